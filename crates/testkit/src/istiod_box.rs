//! istiod-box (`compat/istiod-box`, `make istiod-box`): Istio's own control-plane code (config
//! generation, CA, authenticators) on loopback, run as a process, plus the agents — meshagent
//! and the real pilot-agent — started against it exactly as a pod runs them.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{
    AgentPod, Proc, Sidecar, Value, agent_command, free_port, http_get, http_with_body, wait_for,
    workspace_bin, workspace_root,
};

/// How long istiod-box may take to start: building the first push context of Istio's fake
/// server and generating the CA's RSA keys take a few seconds on a loaded 2-core machine.
pub const ISTIOD_BOX_START: Duration = Duration::from_secs(90);

/// The istiod-box binary: `ISTIOD_BOX`, else `.tools/istio/istiod-box`. Missing fails the
/// test (never a skip).
pub fn istiod_box_bin() -> PathBuf {
    let p = std::env::var_os("ISTIOD_BOX")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".tools/istio/istiod-box"));
    assert!(
        p.exists(),
        "istiod-box not found at {}: run `make istiod-box` (or set ISTIOD_BOX)",
        p.display()
    );
    p
}

/// The real pilot-agent: `PILOT_AGENT`, else `.tools/istio/pilot-agent` (`make pilot-agent`).
pub fn pilot_agent_bin() -> PathBuf {
    let p = std::env::var_os("PILOT_AGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".tools/istio/pilot-agent"));
    assert!(
        p.exists(),
        "pilot-agent not found at {}: run `make pilot-agent` (or set PILOT_AGENT)",
        p.display()
    );
    p
}

/// Istio's default Envoy bootstrap template (`tools/packaging/common/envoy_bootstrap.json` of
/// the pinned istio.io/istio module), which pilot-agent reads from
/// `./var/lib/istio/envoy/envoy_bootstrap_tmpl.json`: `ISTIO_BOOTSTRAP_TEMPLATE`, else the copy
/// `make istiod-box` puts in `.tools/istio/` (it is never part of the repository).
pub fn istio_bootstrap_template() -> PathBuf {
    let p = std::env::var_os("ISTIO_BOOTSTRAP_TEMPLATE")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".tools/istio/envoy_bootstrap.json"));
    assert!(
        p.exists(),
        "Istio's bootstrap template not found at {}: run `make istiod-box` (it copies it from \
         the Go module cache) or set ISTIO_BOOTSTRAP_TEMPLATE",
        p.display()
    );
    p
}

/// A running istiod-box.
pub struct IstiodBox {
    // Declared first so it is dropped (and its log printed) before `dir` is deleted.
    pub proc: Proc,
    pub dir: tempfile::TempDir,
    /// ADS + Istio CA over TLS (istiod's 15012).
    pub grpc_tls: SocketAddr,
    /// ADS in plaintext (istiod's 15010).
    pub grpc_plain: SocketAddr,
    /// istiod's debug endpoints, `/ready`, `/jwks`, `/token`, `/apply`.
    pub http: SocketAddr,
    root_cert: PathBuf,
}

impl IstiodBox {
    /// Starts istiod-box with `config` (Kubernetes objects and Istio resources) and waits for
    /// its ready line.
    pub async fn start(config: &str) -> IstiodBox {
        Self::start_with(config, None, &[]).await
    }

    /// [`IstiodBox::start`] with a mesh config and extra flags.
    pub async fn start_with(config: &str, mesh: Option<&str>, args: &[&str]) -> IstiodBox {
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, config).unwrap();
        let ready_file = dir.path().join("ready.json");
        let mut cmd = Command::new(istiod_box_bin());
        cmd.arg("--config")
            .arg(&config_path)
            .arg("--ready-file")
            .arg(&ready_file)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .args(args);
        if let Some(mesh) = mesh {
            let mesh_path = dir.path().join("mesh.yaml");
            std::fs::write(&mesh_path, mesh).unwrap();
            cmd.arg("--mesh").arg(mesh_path);
        }
        let mut proc = Proc::spawn("istiod-box", cmd, dir.path());
        let deadline = tokio::time::Instant::now() + ISTIOD_BOX_START;
        let ready: Value = loop {
            if let Ok(text) = std::fs::read_to_string(&ready_file) {
                break serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("istiod-box ready file {text:?}: {e}"));
            }
            if let Some(status) = proc.try_wait() {
                panic!("istiod-box exited before it was ready: {status}");
            }
            if tokio::time::Instant::now() >= deadline {
                panic!("istiod-box not ready after {ISTIOD_BOX_START:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let addr = |k: &str| -> SocketAddr {
            ready[k]
                .as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("istiod-box ready line lacks {k}: {ready}"))
        };
        let b = IstiodBox {
            grpc_tls: addr("grpc_tls"),
            grpc_plain: addr("grpc_plain"),
            http: addr("http"),
            root_cert: PathBuf::from(ready["root_cert"].as_str().unwrap()),
            proc,
            dir,
        };
        let (code, body) = http_get(b.http, "/ready").await.unwrap();
        assert_eq!(code, 200, "istiod-box /ready: {body}");
        b
    }

    pub fn root_cert_path(&self) -> &Path {
        &self.root_cert
    }

    /// `POST /apply`: creates or updates the objects; returns istiod-box's account of them.
    pub async fn apply(&self, yaml: &str) -> String {
        self.post("/apply", yaml).await
    }

    /// `POST /delete`: deletes the objects.
    pub async fn delete(&self, yaml: &str) -> String {
        self.post("/delete", yaml).await
    }

    async fn post(&self, path: &str, yaml: &str) -> String {
        let (code, body) = http_with_body("POST", self.http, path, yaml.as_bytes())
            .await
            .unwrap();
        assert_eq!(code, 200, "istiod-box {path}: {body}");
        body
    }

    /// A service account token for `namespace`/`sa` signed by istiod-box's issuer.
    pub async fn token(&self, namespace: &str, sa: &str) -> String {
        let (code, body) = http_get(
            self.http,
            &format!("/token?namespace={namespace}&serviceAccount={sa}"),
        )
        .await
        .unwrap();
        assert_eq!(code, 200, "istiod-box /token: {body}");
        body.trim().to_owned()
    }

    /// Writes a token for `namespace`/`sa` and the root certificate where an agent running in
    /// `dir` reads them (`./var/run/secrets/tokens/istio-token`,
    /// `./var/run/secrets/istio/root-cert.pem`); istiod-box writes them itself.
    pub async fn write_token(&self, dir: &Path, namespace: &str, sa: &str) {
        let (code, body) = http_get(
            self.http,
            &format!(
                "/token?namespace={namespace}&serviceAccount={sa}&dir={}",
                query_escape(&dir.to_string_lossy())
            ),
        )
        .await
        .unwrap();
        assert_eq!(code, 200, "istiod-box /token: {body}");
    }

    /// GET of one of istiod's debug endpoints (`/debug/syncz`, `/debug/config_dump?proxyID=`).
    pub async fn debug_json(&self, path: &str) -> Value {
        let (code, body) = http_get(self.http, path).await.unwrap();
        assert_eq!(code, 200, "istiod-box {path}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
    }

    /// Proxies connected to istiod (`/debug/syncz`), as their proxy IDs.
    pub async fn connected_proxies(&self) -> Vec<String> {
        let v = self.debug_json("/debug/syncz").await;
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["proxy"].as_str().map(str::to_owned))
            .collect()
    }
}

/// `s` as a query value (Go's `url.Query` decodes `+` as a space, so it is escaped too).
fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A Pod as the API server holds it once the kubelet runs it (phase Running, Ready, its
/// addresses in `podIPs`): what istiod needs to map a proxy or an endpoint to its pod.
pub struct RunningPod<'a> {
    pub name: &'a str,
    pub namespace: &'a str,
    pub labels: &'a [(&'a str, &'a str)],
    pub service_account: Option<&'a str>,
    /// `spec.hostname` and `spec.subdomain` (a headless Service's per-pod DNS names).
    pub hostname: Option<(&'a str, &'a str)>,
    /// `status.podIPs`; the first is also `status.podIP`.
    pub ips: &'a [&'a str],
}

impl RunningPod<'_> {
    pub fn yaml(&self) -> String {
        let labels: String = self
            .labels
            .iter()
            .map(|(k, v)| format!("    {k}: {v}\n"))
            .collect();
        let mut spec = String::new();
        if let Some(sa) = self.service_account {
            spec.push_str(&format!("  serviceAccountName: {sa}\n"));
        }
        if let Some((host, sub)) = self.hostname {
            spec.push_str(&format!("  hostname: {host}\n  subdomain: {sub}\n"));
        }
        let ips: String = self
            .ips
            .iter()
            .map(|ip| format!("  - ip: {ip}\n"))
            .collect();
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels:\n{labels}\
             spec:\n{spec}  containers:\n  - name: app\n    image: app\n\
             status:\n  phase: Running\n  podIP: {ip}\n  podIPs:\n{ips}\
             \x20 conditions:\n  - type: Ready\n    status: \"True\"\n",
            name = self.name,
            ns = self.namespace,
            ip = self.ips.first().copied().unwrap_or_default(),
        )
    }
}

/// Workload a: Service `a` in `default` (port 80 → 8080) selecting the running pod
/// `a-5f7d9` (service account `a`, IP 127.0.0.1), the pod of a [`PodSpec`] with workload `a`.
pub fn workload_a() -> String {
    let pod = RunningPod {
        name: "a-5f7d9",
        namespace: "default",
        labels: &[("app", "a")],
        service_account: Some("a"),
        hostname: None,
        ips: &["127.0.0.1"],
    };
    format!(
        r#"apiVersion: v1
kind: Service
metadata:
  name: a
  namespace: default
spec:
  clusterIP: 10.96.0.10
  selector:
    app: a
  ports:
  - name: http
    port: 80
    targetPort: 8080
---
{}"#,
        pod.yaml()
    )
}

/// Two workloads for a mesh through istiod-box: pods `a-5f7d9` (127.0.`net`.2) and `b-5f7d9`
/// (127.0.`net`.3) with Istio's mTLS label, Service `b` on `port` with its EndpointSlice, and
/// Sidecars that make A's outbound listener bind `a_ip:port` and B's inbound forward to its
/// app on 127.0.0.1:`b_app` (no traffic capture: loopback addresses stand in for pod IPs).
pub fn two_workloads(net: u8, port: u16, b_app: u16) -> String {
    let (a_ip, b_ip) = (format!("127.0.{net}.2"), format!("127.0.{net}.3"));
    let pod = |name: &str, ip: &str| {
        RunningPod {
            name: &format!("{name}-5f7d9"),
            namespace: "default",
            labels: &[("app", name), ("security.istio.io/tlsMode", "istio")],
            service_account: Some(name),
            hostname: None,
            ips: &[ip],
        }
        .yaml()
    };
    format!(
        r#"{pod_a}---
{pod_b}---
apiVersion: v1
kind: Service
metadata:
  name: b
  namespace: default
spec:
  clusterIP: 10.96.{net}.11
  selector:
    app: b
  ports:
  - name: http
    port: {port}
    targetPort: {port}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: b-1
  namespace: default
  labels:
    kubernetes.io/service-name: b
addressType: IPv4
endpoints:
- addresses:
  - {b_ip}
  conditions:
    ready: true
  targetRef:
    kind: Pod
    name: b-5f7d9
    namespace: default
ports:
- name: http
  port: {port}
  protocol: TCP
---
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata:
  name: a
  namespace: default
spec:
  workloadSelector:
    labels:
      app: a
  egress:
  - port:
      number: {port}
      protocol: HTTP
      name: http
    bind: {a_ip}
    captureMode: NONE
    hosts:
    - ./*
---
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata:
  name: b
  namespace: default
spec:
  workloadSelector:
    labels:
      app: b
  ingress:
  - port:
      number: {port}
      protocol: HTTP
      name: http
    bind: {b_ip}
    defaultEndpoint: 127.0.0.1:{b_app}
    captureMode: NONE
  egress:
  - hosts:
    - ./*
"#,
        pod_a = pod("a", &a_ip),
        pod_b = pod("b", &b_ip),
    )
}

/// `GET /` with `Host: host` over HTTP/1.1; the whole response, or None if it failed.
pub async fn get_with_host(addr: std::net::SocketAddr, host: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        String::from_utf8(out).ok()
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .ok()
        .flatten()
}

/// A mesh config (istiod-box `--mesh`) whose sidecar capture ports (`proxyListenPort` 15001,
/// `proxyInboundListenPort` 15006) are free ones, so the Envoys of tests running side by side
/// do not contend for them.
pub fn mesh_with_free_ports() -> String {
    format!(
        "proxyListenPort: {}\nproxyInboundListenPort: {}\n",
        free_port(),
        free_port()
    )
}

/// The gRPC request headers of an istiod-box record (`/csrs`, `/streams`) without those that
/// only name the client's gRPC library or transport defaults (`user-agent`,
/// `grpc-accept-encoding`, `grpc-timeout`, `te`: grpc-go's and tonic's differ, and neither the
/// CA nor istiod reads them).
pub fn recorded_headers(record: &Value) -> std::collections::BTreeMap<String, Value> {
    const LIBRARY: &[&str] = &["user-agent", "grpc-accept-encoding", "grpc-timeout", "te"];
    record["headers"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(k, _)| !LIBRARY.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Python for a gRPC health server (grpcio, `make peers`) on 127.0.0.1:`argv[1]` with services
/// `ok` (SERVING) and `bad` (NOT_SERVING): run as `python3 -c GRPC_HEALTH_SERVER <port>` with
/// `PYTHONPATH` holding grpcio.
pub const GRPC_HEALTH_SERVER: &str = r#"
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
h = health.HealthServicer()
h.set("ok", health_pb2.HealthCheckResponse.SERVING)
h.set("bad", health_pb2.HealthCheckResponse.NOT_SERVING)
health_pb2_grpc.add_HealthServicer_to_server(h, server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
server.wait_for_termination()
"#;

/// Which agent [`start_agent`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentKind {
    Meshagent,
    PilotAgent,
}

/// One pod's sidecar against istiod-box.
pub struct PodSpec<'a> {
    /// The workload; the pod is `<workload>-5f7d9`.
    pub workload: &'a str,
    pub namespace: &'a str,
    pub service_account: &'a str,
    /// The pod IP (a loopback address; one per pod so istiod maps proxies to pods).
    pub ip: &'a str,
    /// ProxyConfig fields added to the defaults (free ports, Envoy binary, drain durations).
    pub proxy_config: Value,
    /// Container env added to Istio's (e.g. `ECC_SIGNATURE_ALGORITHM`, which pilot-agent reads
    /// once at start, so ProxyConfig `proxyMetadata` cannot set it).
    pub env: &'a [(&'a str, &'a str)],
}

impl<'a> PodSpec<'a> {
    /// Pod `<workload>-5f7d9` in `default` with service account `workload` at `ip`, no
    /// ProxyConfig or env of its own; set the rest with struct update syntax
    /// (`PodSpec { env: &env, ..PodSpec::new("a", "127.0.0.1") }`).
    pub fn new(workload: &'a str, ip: &'a str) -> Self {
        PodSpec {
            workload,
            namespace: "default",
            service_account: workload,
            ip,
            proxy_config: Value::Null,
            env: &[],
        }
    }
}

/// Starts `kind` as `pilot-agent proxy sidecar` for `pod` against `istiod`, as a pod runs it:
/// Istio's env vars, the token and root at Istio's relative paths in its own working
/// directory, every fixed port moved to a free one so tests run in parallel.
pub async fn start_agent(istiod: &IstiodBox, kind: AgentKind, pod: &PodSpec<'_>) -> Sidecar {
    launch(istiod, kind, pod, None, &[]).await
}

/// [`start_agent`], with `resolv_conf` (when given) seen by the agent at `/etc/resolv.conf`:
/// the agent runs in a mount namespace of its own (`unshare --mount`, private propagation)
/// where that file is bind-mounted over `/etc/resolv.conf`, so its DNS proxy forwards to the
/// test's upstream without the machine's file changing. Istio reads the path fixed
/// (`pkg/dns/client/dns.go` `NewLocalDNSServer`), as meshagent does by default. `unshare`
/// and the shell `exec` the agent, so the process is the agent's (same PID). Needs root.
pub async fn start_agent_with_resolv_conf(
    istiod: &IstiodBox,
    kind: AgentKind,
    pod: &PodSpec<'_>,
    resolv_conf: Option<&Path>,
) -> Sidecar {
    launch(istiod, kind, pod, resolv_conf, &[]).await
}

/// [`start_agent`] with more `proxy sidecar` flags (`--name=value`); one naming a flag
/// `start_agent` sets (e.g. `--proxyLogLevel=`) replaces it.
pub async fn start_agent_with_args(
    istiod: &IstiodBox,
    kind: AgentKind,
    pod: &PodSpec<'_>,
    args: &[&str],
) -> Sidecar {
    launch(istiod, kind, pod, None, args).await
}

async fn launch(
    istiod: &IstiodBox,
    kind: AgentKind,
    pod: &PodSpec<'_>,
    resolv_conf: Option<&Path>,
    args: &[&str],
) -> Sidecar {
    let cwd = tempfile::tempdir().unwrap();
    istiod
        .write_token(cwd.path(), pod.namespace, pod.service_account)
        .await;
    if kind == AgentKind::PilotAgent {
        // pilot-agent reads its template relative to its cwd (pkg/bootstrap/config.go).
        let tmpl = cwd
            .path()
            .join("var/lib/istio/envoy/envoy_bootstrap_tmpl.json");
        std::fs::create_dir_all(tmpl.parent().unwrap()).unwrap();
        std::fs::copy(istio_bootstrap_template(), &tmpl).unwrap();
    }
    // `localhost:<port>` → server name istiod.istio-system.svc (Istio's rule for a local
    // discovery address), which istiod-box's serving certificate carries.
    let istiod_addr = format!("localhost:{}", istiod.grpc_tls.port());
    let program = match kind {
        AgentKind::Meshagent => workspace_bin("meshagent"),
        AgentKind::PilotAgent => pilot_agent_bin(),
    };
    let cmd = match resolv_conf {
        None => Command::new(program),
        Some(rc) => {
            let mut c = Command::new("unshare");
            c.args(["--mount", "--propagation", "private", "sh", "-c"])
                .arg(r#"mount --bind "$0" /etc/resolv.conf && exec "$@""#)
                .arg(rc)
                .arg(program);
            c
        }
    };
    let agent_pod = AgentPod {
        workload: pod.workload,
        namespace: pod.namespace,
        service_account: pod.service_account,
        ip: pod.ip,
    };
    let (mut cmd, ports) = agent_command(
        cmd,
        cwd.path(),
        &agent_pod,
        &istiod_addr,
        &pod.proxy_config,
        args,
    );
    cmd.env("PILOT_CERT_PROVIDER", "istiod")
        .env("ISTIO_META_MESH_ID", "cluster.local")
        .envs(pod.env.iter().copied());
    let name = match kind {
        AgentKind::Meshagent => format!("meshagent-{}", pod.workload),
        AgentKind::PilotAgent => format!("pilot-agent-{}", pod.workload),
    };
    let proc = Proc::spawn(&name, cmd, cwd.path());
    Sidecar::from_parts(proc, cwd, ports)
}

/// Envoy's `/config_dump` of `sidecar` (its admin port), parsed.
pub async fn envoy_config_dump(sidecar: &Sidecar) -> Option<Value> {
    match http_get(sidecar.admin, "/config_dump").await {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

/// Names of the dynamic clusters (active and warming) and listeners in a `/config_dump`.
pub fn dynamic_names(dump: &Value) -> (Vec<String>, Vec<String>) {
    let (mut clusters, mut listeners) = (vec![], vec![]);
    for cfg in dump["configs"].as_array().into_iter().flatten() {
        let t = cfg["@type"].as_str().unwrap_or("");
        if t.ends_with("ClustersConfigDump") {
            for list in ["dynamic_active_clusters", "dynamic_warming_clusters"] {
                for c in cfg[list].as_array().into_iter().flatten() {
                    if let Some(n) = c["cluster"]["name"].as_str() {
                        clusters.push(n.to_owned());
                    }
                }
            }
        } else if t.ends_with("ListenersConfigDump") {
            for l in cfg["dynamic_listeners"].as_array().into_iter().flatten() {
                if let Some(n) = l["name"].as_str() {
                    listeners.push(n.to_owned());
                }
            }
        }
    }
    (clusters, listeners)
}

/// Drops the volatile fields of dumped resources, recursively: `version_info` (istiod's push
/// version, a timestamp) and `last_updated` (each Envoy's clock).
pub fn strip_volatile(v: &mut Value) {
    match v {
        Value::Object(o) => {
            o.remove("version_info");
            o.remove("last_updated");
            o.values_mut().for_each(strip_volatile);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_volatile),
        _ => {}
    }
}

/// Envoy's dynamic resources in a `/config_dump`, keyed `<dump kind>/<list>/<name>`: clusters
/// (active and warming), listeners, route configurations, ECDS extension configs (each with its
/// resource, without [`strip_volatile`]'s fields), and secrets by name only (their contents are
/// each pod's own; `compat_identity` compares them field by field).
pub fn dynamic_config(dump: &Value) -> std::collections::BTreeMap<String, Value> {
    let mut out = std::collections::BTreeMap::new();
    for cfg in dump["configs"].as_array().into_iter().flatten() {
        let t = cfg["@type"].as_str().unwrap_or("");
        let (lists, inner): (&[&str], &str) = if t.ends_with("ClustersConfigDump") {
            (
                &["dynamic_active_clusters", "dynamic_warming_clusters"],
                "cluster",
            )
        } else if t.ends_with("ListenersConfigDump") {
            (&["dynamic_listeners"], "active_state")
        } else if t.ends_with("RoutesConfigDump") {
            (&["dynamic_route_configs"], "route_config")
        } else if t.ends_with("EcdsConfigDump") {
            (&["ecds_filters"], "ecds_filter")
        } else if t.ends_with("SecretsConfigDump") {
            (&["dynamic_active_secrets", "dynamic_warming_secrets"], "")
        } else {
            continue;
        };
        let kind = t.rsplit('.').next().unwrap_or(t);
        for list in lists {
            for r in cfg[*list].as_array().into_iter().flatten() {
                let mut body = match inner {
                    "" => Value::Null,
                    "active_state" => r["active_state"]["listener"].clone(),
                    _ => r[inner].clone(),
                };
                let name = r["name"]
                    .as_str()
                    .or_else(|| body["name"].as_str())
                    .unwrap_or("")
                    .to_owned();
                strip_volatile(&mut body);
                out.insert(format!("{kind}/{list}/{name}"), body);
            }
        }
    }
    out
}

/// Waits until `sidecar`'s Envoy has cluster `name`.
pub async fn wait_for_envoy_cluster(sidecar: &Sidecar, name: &str, timeout: Duration) {
    wait_for(
        &format!("Envoy to have cluster {name}"),
        timeout,
        || async {
            let dump = envoy_config_dump(sidecar).await?;
            dynamic_names(&dump)
                .0
                .iter()
                .any(|c| c == name)
                .then_some(())
        },
    )
    .await
}

/// Envoy's counter `name` from its admin `/stats` (0 if absent).
pub async fn envoy_counter(sidecar: &Sidecar, name: &str) -> u64 {
    let path = format!("/stats?filter=^{}$", name.replace('.', "\\."));
    let Ok((200, body)) = http_get(sidecar.admin, &path).await else {
        return 0;
    };
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::RunningPod;

    /// The manifest istiod-box accepted when the tests wrote it by hand.
    #[test]
    fn running_pod_yaml_is_the_manifest_istiod_box_accepts() {
        let pod = RunningPod {
            name: "hl-0",
            namespace: "default",
            labels: &[("app", "hl"), ("security.istio.io/tlsMode", "istio")],
            service_account: Some("hl"),
            hostname: Some(("hl-0", "hl")),
            ips: &["10.1.1.1", "fd00::1:1"],
        };
        assert_eq!(
            pod.yaml(),
            r#"apiVersion: v1
kind: Pod
metadata:
  name: hl-0
  namespace: default
  labels:
    app: hl
    security.istio.io/tlsMode: istio
spec:
  serviceAccountName: hl
  hostname: hl-0
  subdomain: hl
  containers:
  - name: app
    image: app
status:
  phase: Running
  podIP: 10.1.1.1
  podIPs:
  - ip: 10.1.1.1
  - ip: fd00::1:1
  conditions:
  - type: Ready
    status: "True"
"#
        );
    }
}
