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
        Self::start_with("", None).await
    }

    /// With an `auth:` section (YAML at top level, e.g. htpasswd or token) and, when
    /// `tls` = (certificate, key) PEM files, HTTPS.
    pub async fn start_with(auth_yaml: &str, tls: Option<(&Path, &Path)>) -> OciRegistry {
        let dir = tempfile::tempdir().unwrap();
        let addr = free_addr();
        let mut cfg = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\n",
            dir.path().join("data").display()
        );
        if let Some((cert, key)) = tls {
            cfg.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                cert.display(),
                key.display()
            ));
        }
        cfg.push_str(auth_yaml);
        std::fs::write(dir.path().join("config.yml"), cfg).unwrap();
        let mut cmd = Command::new("docker-registry");
        cmd.arg("serve").arg(dir.path().join("config.yml"));
        let proc = Proc::spawn("docker-registry", cmd, dir.path());
        let plain = auth_yaml.is_empty() && tls.is_none();
        let ready = wait_for("docker-registry to serve", DEADLINE, || async move {
            // Plain and open: 200. With auth: 401; with TLS, Go answers a plain request 400.
            meshagent_testkit::http_get(addr, "/v2/")
                .await
                .ok()
                .filter(|(c, _)| !plain || *c == 200)
        });
        ready.await;
        OciRegistry { proc, dir, addr }
    }

    /// `skopeo copy` of `layout:tag` to `repo:tag` on `dest` (the registry, or a front of it)
    /// with extra flags (`--dest-creds`, `--multi-arch=all`, `--format v2s2`…). Returns the
    /// digest (hex) of the manifest or index pushed, as skopeo reports it.
    pub fn push_with(&self, layout: &Path, tag: &str, repo: &str, flags: &[&str]) -> String {
        let digest_file = self.dir.path().join("digest");
        let out = Command::new("skopeo")
            .args(["copy", "--quiet", "--dest-tls-verify=false"])
            .args(flags)
            .arg("--digestfile")
            .arg(&digest_file)
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{}/{repo}:{tag}", self.addr))
            .output()
            .expect("skopeo (`make wasmpeers` installs it)");
        assert!(
            out.status.success(),
            "skopeo: {}\nregistry log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.proc.log_text()
        );
        let d = std::fs::read_to_string(&digest_file).unwrap();
        d.trim().trim_start_matches("sha256:").to_owned()
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
    let (md, ms) = image_blobs(dir, module, compat);
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
        "annotations": {"org.opencontainers.image.ref.name": tag},
    }]});
    std::fs::write(dir.join("index.json"), index.to_string()).unwrap();
    std::fs::write(dir.join("oci-layout"), "{\"imageLayoutVersion\":\"1.0.0\"}").unwrap();
    dir.to_owned()
}

/// One image of [`oci_index_layout`]: its platform (`(os, architecture)`, `None` = no
/// platform field) and module.
pub type IndexChild<'a> = (Option<(&'a str, &'a str)>, &'a [u8]);

/// Writes an OCI layout whose `tag` is an image index (multi-platform): one OCI compat
/// image per `(platform, module)`, in order; `None` leaves the child's platform out.
/// Returns the layout and the children's manifest digests (hex).
pub fn oci_index_layout(
    dir: &Path,
    tag: &str,
    children: &[IndexChild<'_>],
) -> (PathBuf, Vec<String>) {
    let mut manifests = Vec::new();
    let mut digests = Vec::new();
    for (platform, module) in children {
        let (md, ms) = image_blobs(dir, module, true);
        digests.push(md.trim_start_matches("sha256:").to_owned());
        let mut d = serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ms,
        });
        if let Some((os, arch)) = platform {
            d["platform"] = serde_json::json!({"os": os, "architecture": arch});
        }
        manifests.push(d);
    }
    let idx = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": manifests,
    });
    let bytes = idx.to_string().into_bytes();
    let h = sha256_hex(&bytes);
    std::fs::write(dir.join("blobs/sha256").join(&h), &bytes).unwrap();
    let top = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "digest": format!("sha256:{h}"), "size": bytes.len(),
        "annotations": {"org.opencontainers.image.ref.name": tag},
    }]});
    std::fs::write(dir.join("index.json"), top.to_string()).unwrap();
    std::fs::write(dir.join("oci-layout"), "{\"imageLayoutVersion\":\"1.0.0\"}").unwrap();
    (dir.to_owned(), digests)
}

/// The blobs of one image (config, layers, manifest) under `dir/blobs/sha256`; returns the
/// manifest's digest (`sha256:…`) and size.
fn image_blobs(dir: &Path, module: &[u8], compat: bool) -> (String, usize) {
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
    blob(manifest.to_string().as_bytes())
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

// === TLS ===

/// A test CA and a server certificate it signed for `127.0.0.1` and `localhost` (PEM), with
/// the files written under `dir` (`ca.pem`, `server.pem`, `server.key`).
pub struct TestCa {
    pub ca_pem: PathBuf,
    pub cert_pem: PathBuf,
    pub key_pem: PathBuf,
}

pub fn test_ca(dir: &Path) -> TestCa {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(rcgen::DnType::CommonName, "meshagent wasm test CA");
    let ca = p.self_signed(&ca_key).unwrap();
    let issuer = rcgen::Issuer::new(p, ca_key);
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let t = TestCa {
        ca_pem: dir.join("ca.pem"),
        cert_pem: dir.join("server.pem"),
        key_pem: dir.join("server.key"),
    };
    std::fs::write(&t.ca_pem, ca.pem()).unwrap();
    std::fs::write(&t.cert_pem, leaf.pem()).unwrap();
    std::fs::write(&t.key_pem, key.serialize_pem()).unwrap();
    t
}

/// An HTTPS (rustls) server answering every GET with `body`; counts requests that got
/// past the handshake.
pub struct TlsModServer {
    pub addr: SocketAddr,
    hits: Arc<std::sync::atomic::AtomicU32>,
}

impl TlsModServer {
    pub async fn start(ca: &TestCa, body: Vec<u8>) -> TlsModServer {
        use rustls::pki_types::pem::PemObject as _;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&ca.cert_pem)
            .unwrap()
            .map(|c| c.unwrap())
            .collect();
        let key = PrivateKeyDer::from_pem_file(&ca.key_pem).unwrap();
        let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let hits = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let h = hits.clone();
        let body = Arc::new(body);
        tokio::spawn(async move {
            while let Ok((tcp, _)) = l.accept().await {
                let (acceptor, h, body) = (acceptor.clone(), h.clone(), body.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return; // the client refused the certificate
                    };
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = tls.write_all(resp.as_bytes()).await;
                    let _ = tls.write_all(&body).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        TlsModServer { addr, hits }
    }

    pub fn url(&self, path: &str) -> String {
        format!("https://{}{path}", self.addr)
    }

    pub fn hits(&self) -> u32 {
        self.hits.load(std::sync::atomic::Ordering::SeqCst)
    }
}

// === registry token server ===

/// The token issuer of a registry configured with `auth: token` (distribution's token
/// spec): ES256 JWTs whose `x5c` header carries a self-signed certificate the registry
/// trusts (`rootcertbundle`).
pub struct TokenSigner {
    key: aws_lc_rs::signature::EcdsaKeyPair,
    cert_der: Vec<u8>,
    pub cert_pem: PathBuf,
    pub issuer: String,
    pub service: String,
}

impl TokenSigner {
    pub fn new(dir: &Path) -> TokenSigner {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "meshagent test token signer");
        let cert = p.self_signed(&key).unwrap();
        let cert_pem = dir.join("token-signer.pem");
        std::fs::write(&cert_pem, cert.pem()).unwrap();
        let key = aws_lc_rs::signature::EcdsaKeyPair::from_pkcs8(
            &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &key.serialize_der(),
        )
        .unwrap();
        TokenSigner {
            key,
            cert_der: cert.der().to_vec(),
            cert_pem,
            issuer: "meshagent-test-issuer".into(),
            service: "meshagent-test-registry".into(),
        }
    }

    /// The registry's `auth:` section, with the token realm at `realm`.
    pub fn registry_auth_yaml(&self, realm: &str) -> String {
        format!(
            "auth:\n  token:\n    realm: {realm}\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
            self.service,
            self.issuer,
            self.cert_pem.display()
        )
    }

    /// A token granting `scopes` (`repository:<name>:<actions>`) to `subject`.
    pub fn token(&self, subject: &str, scopes: &[String]) -> String {
        use base64::Engine as _;
        let b64u = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let access: Vec<serde_json::Value> = scopes
            .iter()
            .filter_map(|s| {
                let mut it = s.splitn(3, ':');
                let (t, n, a) = (it.next()?, it.next()?, it.next()?);
                Some(serde_json::json!({"type": t, "name": n, "actions": a.split(',').collect::<Vec<_>>()}))
            })
            .collect();
        let header = serde_json::json!({"typ": "JWT", "alg": "ES256",
            "x5c": [base64::engine::general_purpose::STANDARD.encode(&self.cert_der)]});
        let claims = serde_json::json!({"iss": self.issuer, "sub": subject, "aud": self.service,
            "exp": now + 600, "nbf": now - 60, "iat": now - 60, "jti": format!("{now}"),
            "access": access});
        let input = format!(
            "{}.{}",
            b64u(header.to_string().as_bytes()),
            b64u(claims.to_string().as_bytes())
        );
        let sig = self
            .key
            .sign(&aws_lc_rs::rand::SystemRandom::new(), input.as_bytes())
            .unwrap();
        format!("{input}.{}", b64u(sig.as_ref()))
    }
}

/// One loopback port in front of a token-auth registry: `GET /token…` is answered here
/// (Basic credentials `user:password` required, the requested scopes granted), every other
/// connection is spliced to the registry. The realm then shares the registry's host and
/// port, the one loopback realm Istio accepts (go-containerregistry #2302).
pub struct TokenFront {
    pub addr: SocketAddr,
    listener: Option<tokio::net::TcpListener>,
    token_hits: Arc<std::sync::atomic::AtomicU32>,
}

impl TokenFront {
    pub async fn bind() -> TokenFront {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        TokenFront {
            addr: l.local_addr().unwrap(),
            listener: Some(l),
            token_hits: Arc::default(),
        }
    }

    pub fn realm(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    pub fn serve(&mut self, registry: SocketAddr, signer: TokenSigner, user: &str, pass: &str) {
        use base64::Engine as _;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let l = self.listener.take().unwrap();
        let want = format!(
            "basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
        );
        let signer = Arc::new(signer);
        let hits = self.token_hits.clone();
        let user = user.to_owned();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                let (want, signer, hits, user) =
                    (want.clone(), signer.clone(), hits.clone(), user.clone());
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match c.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                        if head.first() == Some(&0x16) {
                            // A TLS ClientHello: answer as Go's plain HTTP server does.
                            let _ = c.write_all(b"HTTP/1.0 400 Bad Request\r\n\r\n").await;
                            return;
                        }
                    }
                    let text = String::from_utf8_lossy(&head).into_owned();
                    let target = text.split_whitespace().nth(1).unwrap_or("").to_owned();
                    if !target.starts_with("/token") {
                        let Ok(mut up) = tokio::net::TcpStream::connect(registry).await else {
                            return;
                        };
                        if up.write_all(&head).await.is_ok() {
                            let _ = tokio::io::copy_bidirectional(&mut c, &mut up).await;
                        }
                        return;
                    }
                    hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let authorized = text.lines().any(|l| {
                        l.split_once(':').is_some_and(|(k, v)| {
                            k.eq_ignore_ascii_case("authorization")
                                && v.trim().eq_ignore_ascii_case(&want)
                        })
                    });
                    let resp = if authorized {
                        let scopes: Vec<String> = target
                            .split_once('?')
                            .map(|(_, q)| q)
                            .unwrap_or("")
                            .split('&')
                            .filter_map(|kv| kv.strip_prefix("scope="))
                            .flat_map(|v| {
                                percent_decode(v)
                                    .split(' ')
                                    .map(str::to_owned)
                                    .collect::<Vec<_>>()
                            })
                            .collect();
                        let body =
                            serde_json::json!({"token": signer.token(&user, &scopes)}).to_string();
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        )
                    } else {
                        "HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            .to_owned()
                    };
                    let _ = c.write_all(resp.as_bytes()).await;
                    let _ = c.shutdown().await;
                });
            }
        });
    }

    pub fn token_hits(&self) -> u32 {
        self.token_hits.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match h {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    None => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A docker config JSON with `user:password` for `registry` (`auths.<registry>.auth`).
pub fn docker_config_json(registry: &str, user: &str, password: &str) -> String {
    use base64::Engine as _;
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    serde_json::json!({"auths": {registry: {"auth": auth}}}).to_string()
}

/// A bcrypt htpasswd file for the registry's `auth: htpasswd` (Apache's `htpasswd -B`).
pub fn htpasswd(path: &Path, user: &str, password: &str) {
    let out = Command::new("htpasswd")
        .args(["-Bbn", user, password])
        .output()
        .expect("htpasswd (Debian apache2-utils; `make wasmpeers` installs it)");
    assert!(out.status.success());
    std::fs::write(path, out.stdout).unwrap();
}

// === hostile module server ===

/// A raw TCP server that answers every request with `status`, `Content-Length: 1000` and
/// only 10 body bytes, then holds the socket open (until the server is dropped or 10 min
/// pass). With `challenge`, requests not for `/token` get a registry 401 whose Bearer realm
/// is this server's `/token`, so the stall is in the token exchange. It answers the first
/// bytes it reads, whatever they are, so a TLS ClientHello gets plain HTTP (an OCI client
/// then falls back to plain HTTP, as against a real plain-HTTP registry).
pub struct StallServer {
    pub addr: SocketAddr,
    conns: Arc<std::sync::atomic::AtomicU32>,
    open: Arc<std::sync::atomic::AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

impl StallServer {
    pub async fn start(status: u16) -> StallServer {
        Self::start_with(status, false).await
    }

    pub async fn start_with(status: u16, challenge: bool) -> StallServer {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let conns = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let open = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let c = conns.clone();
        let o = open.clone();
        let task = tokio::spawn(async move {
            let mut held = tokio::task::JoinSet::new();
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    return;
                };
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                o.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let o = o.clone();
                held.spawn(async move {
                    let mut buf = vec![0u8; 8192];
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    let req = String::from_utf8_lossy(&buf[..n]).into_owned();
                    let head = if challenge && !req.contains("/token") {
                        format!(
                            "HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer realm=\"http://{addr}/token\",service=\"stall\"\r\nContent-Length: 0\r\n\r\n"
                        )
                    } else {
                        format!(
                            "HTTP/1.1 {status} Stalled\r\nContent-Type: application/octet-stream\r\nContent-Length: 1000\r\n\r\n0123456789"
                        )
                    };
                    let _ = s.write_all(head.as_bytes()).await;
                    let _ = s.flush().await;
                    // Hold it: read (and ignore) until the client closes, or 10 minutes.
                    let _ = tokio::time::timeout(Duration::from_secs(600), async {
                        while s.read(&mut buf).await.is_ok_and(|n| n > 0) {}
                    })
                    .await;
                    o.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        });
        StallServer {
            addr,
            conns,
            open,
            task,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u32 {
        self.conns.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Connections the client has not closed yet.
    pub fn open(&self) -> u32 {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for StallServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A valid module of at least `size` bytes: `module` with a custom section of padding.
pub fn padded_module(module: &[u8], size: usize) -> Vec<u8> {
    let payload = size.saturating_sub(module.len());
    let name = b"pad";
    let mut body = vec![name.len() as u8];
    body.extend_from_slice(name);
    body.extend(std::iter::repeat_n(0u8, payload));
    let mut m = module.to_vec();
    m.push(0); // custom section
    let mut n = body.len();
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            m.push(b);
            break;
        }
        m.push(b | 0x80);
    }
    m.extend_from_slice(&body);
    m
}

// === small filesystems ===

/// A tmpfs of `size` mounted on a fresh temp directory (tests run as root), unmounted on
/// drop even when the test fails.
pub struct Tmpfs {
    pub dir: tempfile::TempDir,
}

impl Tmpfs {
    pub fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let st = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ])
            .arg(dir.path())
            .status()
            .expect("mount (tests run as root)");
        assert!(st.success(), "mount tmpfs on {}", dir.path().display());
        Tmpfs { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `mount -o remount,<opts>` (e.g. `ro`, `rw`, `size=4m`).
    pub fn remount(&self, opts: &str) {
        let st = Command::new("mount")
            .args(["-o", &format!("remount,{opts}")])
            .arg(self.dir.path())
            .status()
            .unwrap();
        assert!(st.success(), "remount {opts}");
    }

    /// Every regular file below the mount.
    pub fn files(&self) -> Vec<PathBuf> {
        fn walk(d: &Path, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
                let p = e.path();
                match e.file_type() {
                    Ok(t) if t.is_dir() => walk(&p, out),
                    Ok(_) => out.push(p),
                    Err(_) => {}
                }
            }
        }
        let mut out = Vec::new();
        walk(self.dir.path(), &mut out);
        out
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}
