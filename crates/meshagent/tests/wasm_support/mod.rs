//! Peers of the Wasm tests: the proxy-wasm module assembled from WAT by wabt's `wat2wasm`,
//! a module HTTP server with scripted behaviours, and a real OCI registry (Debian's
//! `docker-registry`) filled with skopeo from OCI layouts the tests write.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use meshagent_testkit::{DEADLINE, Proc, free_addr, wait_for};
use tokio::sync::Notify;

/// The proxy-wasm filter of `tests/data/add_header.wat`, assembled now.
pub fn module() -> Vec<u8> {
    let wat = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/add_header.wat");
    let out = tempfile::NamedTempFile::new().unwrap();
    let st = Command::new("wat2wasm")
        .arg(&wat)
        .arg("-o")
        .arg(out.path())
        .status()
        .expect("wat2wasm (Debian wabt; `make wasmpeers` installs it)");
    assert!(st.success());
    std::fs::read(out.path()).unwrap()
}

pub fn sha256_hex(b: &[u8]) -> String {
    meshagent::wasm::unpack::sha256_hex(b)
}

pub fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

pub fn tar_of(name: &str, data: &[u8]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    b.append_data(&mut h, name, data).unwrap();
    b.into_inner().unwrap()
}

// === module server ===

#[derive(Clone)]
pub enum Behaviour {
    Serve(Vec<u8>),
    Status(u16),
    /// Answer these statuses first (one per request), then serve.
    FailThen(Vec<u16>, Vec<u8>),
    Redirect(String),
    /// Hold the request until [`ModServer::release`] (at most 20 s), then serve.
    Gate(Vec<u8>),
    /// A registry-like 401 with this `WWW-Authenticate`.
    Challenge(String),
}

#[derive(Default)]
struct ServerState {
    routes: Mutex<HashMap<String, Behaviour>>,
    hits: Mutex<HashMap<String, u32>>,
    gate: Notify,
}

#[derive(Clone)]
pub struct ModServer {
    pub addr: SocketAddr,
    state: Arc<ServerState>,
}

impl ModServer {
    pub async fn start() -> ModServer {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    pub async fn start_on(addr: SocketAddr) -> ModServer {
        let state = Arc::new(ServerState::default());
        let l = tokio::net::TcpListener::bind(addr).await.unwrap();
        let addr = l.local_addr().unwrap();
        let app = axum::Router::new()
            .route("/{*path}", axum::routing::get(serve))
            .with_state(state.clone());
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        ModServer { addr, state }
    }

    pub fn route(&self, path: &str, b: Behaviour) {
        self.state.routes.lock().unwrap().insert(path.to_owned(), b);
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn hits(&self, path: &str) -> u32 {
        self.state
            .hits
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    pub fn release(&self) {
        self.state.gate.notify_waiters();
    }
}

async fn serve(State(s): State<Arc<ServerState>>, UrlPath(p): UrlPath<String>) -> Response {
    let path = format!("/{p}");
    let n = {
        let mut h = s.hits.lock().unwrap();
        let e = h.entry(path.clone()).or_default();
        *e += 1;
        *e
    };
    let b = s.routes.lock().unwrap().get(&path).cloned();
    let ok = |body: Vec<u8>| (StatusCode::OK, Body::from(body)).into_response();
    match b {
        None => StatusCode::NOT_FOUND.into_response(),
        Some(Behaviour::Serve(body)) => ok(body),
        Some(Behaviour::Status(c)) => StatusCode::from_u16(c).unwrap().into_response(),
        Some(Behaviour::FailThen(codes, body)) => match codes.get(n as usize - 1) {
            Some(c) => StatusCode::from_u16(*c).unwrap().into_response(),
            None => ok(body),
        },
        Some(Behaviour::Redirect(to)) => {
            let mut h = HeaderMap::new();
            h.insert(header::LOCATION, to.parse().unwrap());
            (StatusCode::FOUND, h).into_response()
        }
        Some(Behaviour::Gate(body)) => {
            let _ = tokio::time::timeout(Duration::from_secs(20), s.gate.notified()).await;
            ok(body)
        }
        Some(Behaviour::Challenge(c)) => {
            let mut h = HeaderMap::new();
            h.insert(header::WWW_AUTHENTICATE, c.parse().unwrap());
            (StatusCode::UNAUTHORIZED, h).into_response()
        }
    }
}

// === OCI registry ===

pub struct OciRegistry {
    pub proc: Proc,
    pub dir: tempfile::TempDir,
    pub addr: SocketAddr,
}

impl OciRegistry {
    /// Debian's `docker-registry` (distribution v2) on a loopback port, plain HTTP.
    pub async fn start() -> OciRegistry {
        let dir = tempfile::tempdir().unwrap();
        let addr = free_addr();
        let cfg = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            dir.path().join("data").display()
        );
        std::fs::write(dir.path().join("config.yml"), cfg).unwrap();
        let mut cmd = Command::new("docker-registry");
        cmd.arg("serve").arg(dir.path().join("config.yml"));
        let proc = Proc::spawn("docker-registry", cmd, dir.path());
        wait_for("docker-registry to serve", DEADLINE, || async move {
            meshagent_testkit::http_get(addr, "/v2/")
                .await
                .ok()
                .filter(|(c, _)| *c == 200)
        })
        .await;
        OciRegistry { proc, dir, addr }
    }

    /// Pushes the OCI layout at `layout` (tag `tag`) as `repo:tag` with skopeo; `docker`
    /// converts to Docker schema2. Returns the manifest digest (hex) the registry serves.
    pub async fn push(&self, layout: &Path, tag: &str, repo: &str, docker: bool) -> String {
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "--quiet", "--dest-tls-verify=false"]);
        if docker {
            cmd.args(["--format", "v2s2"]);
        }
        cmd.arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}/{repo}:{tag}", self.addr));
        let out = cmd.output().expect("skopeo (`make wasmpeers` installs it)");
        assert!(
            out.status.success(),
            "skopeo: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let accept = if docker {
            "application/vnd.docker.distribution.manifest.v2+json"
        } else {
            "application/vnd.oci.image.manifest.v1+json"
        };
        let body = raw_get_with(
            self.addr,
            &format!("/v2/{repo}/manifests/{tag}"),
            &[("Accept", accept)],
        )
        .await;
        let b = body.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
        // Manifests are ASCII JSON: the text round-trips to the served bytes.
        sha256_hex(b.as_bytes())
    }
}

/// Writes an OCI image layout with one manifest tagged `tag`: `compat` is the image format
/// (an OCI gzip tar layer holding `plugin.wasm`), otherwise the Wasm artifact format (two
/// layers, one the raw module).
pub fn oci_layout(dir: &Path, tag: &str, module: &[u8], compat: bool) -> PathBuf {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let blob = |b: &[u8]| {
        let h = sha256_hex(b);
        std::fs::write(blobs.join(&h), b).unwrap();
        (format!("sha256:{h}"), b.len())
    };
    let (config, layers) = if compat {
        let tar = tar_of("plugin.wasm", module);
        let diff = format!("sha256:{}", sha256_hex(&tar));
        let cfg = serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [diff]},
        });
        let (cd, cs) = blob(cfg.to_string().as_bytes());
        let (ld, ls) = blob(&gzip(&tar));
        (
            serde_json::json!({"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cs}),
            vec![
                serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": ld, "size": ls}),
            ],
        )
    } else {
        let (cd, cs) = blob(b"{}");
        let (wd, ws) = blob(module);
        let (nd, ns) = blob(b"{\"note\":\"meshagent test\"}");
        (
            serde_json::json!({"mediaType": "application/vnd.module.wasm.config.v1+json", "digest": cd, "size": cs}),
            vec![
                serde_json::json!({"mediaType": "application/vnd.module.wasm.content.layer.v1+wasm", "digest": wd, "size": ws}),
                serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": nd, "size": ns}),
            ],
        )
    };
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config,
        "layers": layers,
    });
    let (md, ms) = blob(manifest.to_string().as_bytes());
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
        "annotations": {"org.opencontainers.image.ref.name": tag},
    }]});
    std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
    std::fs::write(dir.join("oci-layout"), "{\"imageLayoutVersion\":\"1.0.0\"}").unwrap();
    dir.to_owned()
}

/// A raw HTTP/1.1 GET: the whole response text (head and body), for header checks.
pub async fn raw_get(addr: SocketAddr, path: &str) -> String {
    raw_get_with(addr, path, &[]).await
}

pub async fn raw_get_with(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(Ok(mut s)) =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr)).await
    else {
        return String::new();
    };
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// The status code of a raw response (0 if none).
pub fn status_of(resp: &str) -> u16 {
    resp.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// One sample of the agent's Prometheus text, e.g.
/// `istio_agent_wasm_remote_fetch_count{result="success"}`; 0 when absent.
pub fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}
