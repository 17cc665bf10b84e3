//! What lives in the pod: the SDS and xDS sockets Envoy connects to, Envoy's admin, the
//! agent's status port, the application's probe and scrape targets, the certificates the agent
//! serves (its `/debug/certz` view) and the DNS proxy.

use hickory_proto::op::ResponseCode;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderMap, Method, StatusCode};
use serde_json::Value;

use super::{Check, DoctorError, Options, step};
use crate::config::Config;
use crate::http_client::{Call, text};

/// Admin and status answers the doctor reads are small; `/init_dump` of a big mesh is not.
const MAX_BODY: usize = 8 << 20;
/// Envoy still warming after this long is stuck, not starting (Istio #60530).
const WARMING_STUCK: Duration = Duration::from_secs(60);

/// Socket, Envoy, status, probe, scrape, certificate and DNS findings.
pub async fn checks(cfg: &Config, opts: &Options) -> Vec<Check> {
    let sockets = [
        (
            "sds-socket",
            "SDS",
            PathBuf::from(format!(
                "./var/run/secrets/workload-spiffe-uds/{}",
                cfg.identity.workload_identity_socket_file
            )),
        ),
        (
            "xds-socket",
            "xDS",
            cfg.proxy_config.config_path.join(crate::xds::SOCKET_NAME),
        ),
    ];
    let mut out = Vec::new();
    for (name, what, path) in sockets {
        // stat and connect: off the runtime thread.
        let cwd = opts.cwd.clone();
        out.push(
            tokio::task::spawn_blocking(move || socket(name, what, path, &cwd))
                .await
                .unwrap_or_else(|e| Check::fail(name, e.to_string(), "report this")),
        );
    }
    out.push(envoy(cfg, opts).await);
    out.push(status_port(cfg, opts).await);
    out.extend(probes(cfg, opts).await);
    out.extend(scrape(cfg, opts).await);
    out.push(certs(cfg, opts).await);
    out.push(dns(cfg, opts).await);
    out
}

fn localhost(cfg: &Config) -> IpAddr {
    let ips: Vec<IpAddr> = cfg.pod.instance_ip.into_iter().collect();
    crate::bootstrap::node::localhost_for(&ips, cfg.bootstrap.dual_stack)
}

async fn get(
    addr: SocketAddr,
    path: &str,
    opts: &Options,
) -> Result<(StatusCode, String), DoctorError> {
    Ok(text(
        &Call::new(Method::GET, addr, path, opts.step_timeout),
        MAX_BODY,
    )
    .await?)
}

/// A unix socket Envoy connects to: present, a socket, accepting, and 0666 as the agent
/// makes it (Istio `pkg/uds/listener.go`) so Envoy reaches it whatever its uid.
#[allow(
    clippy::disallowed_methods,
    reason = "runs on the blocking pool (checks)"
)]
fn socket(name: &str, what: &str, path: PathBuf, cwd: &std::path::Path) -> Check {
    let shown = path.display().to_string();
    let full = crate::fsio::under(cwd, &path);
    let meta = match std::fs::symlink_metadata(&full) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Check::fail(
                name,
                format!("{what} socket {shown} does not exist: Envoy cannot get its {what}"),
                "start the agent (`pilot-agent proxy sidecar`); if it runs, check that the \
                 socket's directory is a writable emptyDir volume mounted in the proxy container",
            );
        }
        Err(e) => {
            return Check::fail(
                name,
                format!("{what} socket {shown}: {e}"),
                "the proxy's uid must be able to reach the socket's directory",
            );
        }
    };
    if !meta.file_type().is_socket() {
        return Check::fail(
            name,
            format!("{shown} is not a unix socket"),
            format!("remove {shown} and restart the agent, which binds the {what} socket there"),
        );
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o666 != 0o666 {
        return Check::fail(
            name,
            format!(
                "{what} socket {shown} has mode {mode:04o} (owner uid {}): Envoy connecting with \
                 another uid, or a non-owner, is refused (the agent makes it 0666)",
                meta.uid()
            ),
            format!(
                "`chmod 0666 {shown}`, or restart the agent so it binds the socket afresh; find \
                 what changes it (a securityContext, an init container or a volume policy)"
            ),
        );
    }
    if !crate::uds::accepts_connections(&full) {
        return Check::fail(
            name,
            format!("{what} socket {shown} exists but nothing accepts on it (a stale socket)"),
            "restart the agent: it binds the socket again at start",
        );
    }
    Check::ok(
        name,
        format!("{what} socket {shown}: mode {mode:04o}, accepting connections"),
    )
}

/// `name: value` lines of Envoy's `/stats` text.
fn stat(stats: &str, name: &str) -> Option<u64> {
    stats.lines().find_map(|l| {
        let (k, v) = l.split_once(": ")?;
        (k == name).then(|| v.trim().parse().ok())?
    })
}

/// Names of init targets Envoy still waits for (`/init_dump`).
fn unready(init_dump: &str) -> Vec<String> {
    let v: Value = serde_json::from_str(init_dump).unwrap_or_default();
    let mut out = Vec::new();
    for d in v["unready_targets_dumps"].as_array().into_iter().flatten() {
        for t in d["target_names"].as_array().into_iter().flatten() {
            if let Some(t) = t.as_str() {
                out.push(t.to_owned());
            }
        }
    }
    out
}

async fn envoy(cfg: &Config, opts: &Options) -> Check {
    const NAME: &str = "envoy";
    if cfg.lifecycle.disable_envoy {
        return Check::ok(NAME, "DISABLE_ENVOY=true: no Envoy to check");
    }
    let admin = SocketAddr::new(localhost(cfg), cfg.proxy_config.proxy_admin_port);
    let ready = match get(admin, "/ready", opts).await {
        Ok(r) => r,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("Envoy's admin {admin} does not answer: {e}"),
                "check that Envoy runs (the agent's log says why it exited) and that \
                 proxyAdminPort matches the bootstrap",
            );
        }
    };
    let stats = get(
        admin,
        "/stats?filter=^(listener_manager.total_listeners_warming|server.uptime)$",
        opts,
    )
    .await
    .map(|(_, b)| b)
    .unwrap_or_default();
    let warming = stat(&stats, "listener_manager.total_listeners_warming").unwrap_or(0);
    let uptime = stat(&stats, "server.uptime").unwrap_or(0);
    let state = ready.1.lines().next().unwrap_or_default().trim().to_owned();
    if ready.0 == StatusCode::OK && warming == 0 {
        return Check::ok(
            NAME,
            format!("Envoy's admin {admin}: {state}, no listener warming"),
        );
    }
    let waiting = match get(admin, "/init_dump", opts).await {
        Ok((StatusCode::OK, b)) => unready(&b),
        _ => vec![],
    };
    let detail = format!(
        "Envoy's admin {admin}: {state} ({warming} listeners warming, up {uptime}s){}",
        if waiting.is_empty() {
            String::new()
        } else {
            format!(", waiting for {}", waiting.join(", "))
        }
    );
    let fix = "a listener warms until every cluster, secret and ECDS resource it names arrives: \
               look for NACKs (/debug/xdsz on the status port), missing secrets (/debug/certz) \
               and ECDS/Wasm fetch errors for the names above";
    if uptime >= WARMING_STUCK.as_secs() {
        Check::fail(NAME, format!("{detail}: stuck"), fix)
    } else {
        Check::warn(NAME, format!("{detail}: still starting"), fix)
    }
}

async fn status_port(cfg: &Config, opts: &Options) -> Check {
    const NAME: &str = "status-port";
    let addr = SocketAddr::new(localhost(cfg), cfg.proxy_config.status_port);
    match get(addr, "/healthz/ready", opts).await {
        Ok((StatusCode::OK, _)) => {
            Check::ok(NAME, format!("agent status {addr}/healthz/ready: 200"))
        }
        Ok((code, body)) => Check::fail(
            NAME,
            format!(
                "agent status {addr}/healthz/ready: {code} {}",
                body.lines().next().unwrap_or_default()
            ),
            "the pod is not ready: see the envoy, ca and istiod checks for the cause",
        ),
        Err(e) => Check::fail(
            NAME,
            format!("agent status port {addr} does not answer: {e}"),
            "start the agent (`pilot-agent proxy sidecar`) or check statusPort \
             (status.sidecar.istio.io/port) against the probes kubelet sends",
        ),
    }
}

/// Each rewritten app probe, run as the agent runs it for kubelet (`ISTIO_KUBE_APP_PROBERS`).
async fn probes(cfg: &Config, opts: &Options) -> Vec<Check> {
    let probers = &cfg.status.kube_app_probers;
    if probers.is_empty() {
        return vec![];
    }
    let dest = if cfg.status.rewrite_probe_legacy_localhost_destination {
        localhost(cfg)
    } else {
        cfg.pod.instance_ip.unwrap_or_else(|| localhost(cfg))
    };
    let app = match crate::status::AppProbes::new(
        probers.clone(),
        dest,
        cfg.proxy_config.status_port,
        cfg.status.enable_http2_probing,
    ) {
        Ok(a) => a,
        Err(e) => {
            return vec![Check::fail(
                "probe",
                format!("cannot build the probes: {e}"),
                "report this",
            )];
        }
    };
    let mut out = Vec::new();
    for (path, prober) in probers.iter() {
        let name = format!("probe {path}");
        let target = match &prober.kind {
            crate::config::probers::ProberKind::HttpGet {
                path,
                port,
                https,
                host,
                ..
            } => format!(
                "{} {}:{port}{path}",
                if *https { "HTTPS" } else { "HTTP" },
                host.clone().unwrap_or_else(|| dest.to_string())
            ),
            crate::config::probers::ProberKind::TcpSocket { port } => format!("TCP {dest}:{port}"),
            crate::config::probers::ProberKind::Grpc { port, .. } => format!("gRPC {dest}:{port}"),
        };
        let res = step(opts, async {
            let r = app.handle(path, &HeaderMap::new()).await;
            let code = r.status();
            let body = http_body_util::BodyExt::collect(r.into_body())
                .await
                .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                .unwrap_or_default();
            Ok((code, body))
        })
        .await;
        out.push(match res {
            Ok((code, _)) if code.is_success() => Check::ok(&name, format!("{target}: {code}")),
            Ok((code, body)) => Check::fail(
                &name,
                format!(
                    "{target}: {code} {}",
                    body.lines().next().unwrap_or_default().trim()
                ),
                "the application does not answer its probe there: check that it listens on \
                 that port and address (a probe goes to the pod IP, so an app bound to \
                 127.0.0.1 fails it) and the probe's path",
            ),
            Err(e) => Check::fail(
                &name,
                format!("{target}: {e}"),
                "the application does not answer within the deadline: check that it is up",
            ),
        });
    }
    out
}

/// Each application metrics target the merged `/stats/prometheus` scrapes
/// (`ISTIO_PROMETHEUS_ANNOTATIONS`).
async fn scrape(cfg: &Config, opts: &Options) -> Vec<Check> {
    let Some(p) = cfg
        .status
        .prometheus_annotations
        .as_ref()
        .filter(|p| p.scrape)
    else {
        return vec![];
    };
    let mut out = Vec::new();
    for t in &p.targets {
        let addr = SocketAddr::new(localhost(cfg), t.port);
        let name = format!("scrape :{}{}", t.port, t.path);
        let fix = "the app's prometheus.io/port and prometheus.io/path annotations must name a \
                   port the app serves metrics on, on localhost";
        out.push(match get(addr, &t.path, opts).await {
            Ok((StatusCode::OK, _)) => Check::ok(&name, format!("http://{addr}{}: 200", t.path)),
            Ok((code, _)) => Check::fail(&name, format!("http://{addr}{}: {code}", t.path), fix),
            Err(e) => Check::fail(&name, e.to_string(), fix),
        });
    }
    out
}

/// Certificate state and rotation from the agent's `/debug/certz`.
async fn certs(cfg: &Config, opts: &Options) -> Check {
    const NAME: &str = "certs";
    let addr = SocketAddr::new(localhost(cfg), cfg.proxy_config.status_port);
    let body = match get(addr, "/debug/certz", opts).await {
        Ok((StatusCode::OK, b)) => b,
        Ok((code, _)) => {
            return Check::warn(
                NAME,
                format!("{addr}/debug/certz answered {code}"),
                "run the doctor in the pod (certz answers loopback only)",
            );
        }
        Err(e) => {
            return Check::fail(
                NAME,
                format!("certificate state unknown: {e}"),
                "start the agent; see the status-port check",
            );
        }
    };
    let v: Value = serde_json::from_str(&body).unwrap_or_default();
    let mut parts = Vec::new();
    for r in v["resources"].as_array().into_iter().flatten() {
        let name = r["name"].as_str().unwrap_or("?");
        match r["state"].as_str() {
            Some("Available") => {}
            Some("Failing") => {
                return Check::fail(
                    NAME,
                    format!(
                        "{name}: Failing: {} (next retry {})",
                        r["lastError"].as_str().unwrap_or("unknown error"),
                        r["nextRetry"].as_str().unwrap_or("unknown")
                    ),
                    "the agent cannot get a certificate: see the ca and token checks",
                );
            }
            s => {
                parts.push(format!("{name}: {}", s.unwrap_or("unknown")));
                continue;
            }
        }
        if let Some(exp) = r["certificate"]["expiresInSeconds"].as_i64() {
            if exp <= 0 {
                return Check::fail(
                    NAME,
                    format!("{name}: the served certificate expired {}s ago", -exp),
                    "the agent rotates before expiry: see the ca check for why it cannot",
                );
            }
            let mut s = format!(
                "{name}: Available, expires {} (in {exp}s)",
                r["certificate"]["notAfter"].as_str().unwrap_or("?")
            );
            if let Some(next) = r["nextRotation"].as_str() {
                s.push_str(&format!(", rotates {next}"));
            }
            parts.push(s);
        }
        for root in r["roots"].as_array().into_iter().flatten() {
            if root["expiresInSeconds"].as_i64().is_some_and(|e| e <= 0) {
                return Check::fail(
                    NAME,
                    format!(
                        "{name}: root {} expired at {}",
                        root["subject"].as_str().unwrap_or("?"),
                        root["notAfter"].as_str().unwrap_or("?")
                    ),
                    "rotate the mesh's root CA (istio-ca-root-cert / cacerts)",
                );
            }
        }
    }
    if parts.iter().any(|p| !p.contains("Available")) {
        return Check::warn(
            NAME,
            parts.join("; "),
            "a resource still initializing: run the doctor again in a few seconds",
        );
    }
    if parts.is_empty() {
        return Check::ok(
            NAME,
            format!(
                "no certificate served by the agent yet (mode {})",
                v["mode"].as_str().unwrap_or("unknown")
            ),
        );
    }
    Check::ok(NAME, parts.join("; "))
}

/// A DNS query (UDP, then TCP) with EDNS to the agent's DNS proxy, when it runs.
async fn dns(cfg: &Config, opts: &Options) -> Check {
    const NAME: &str = "dns";
    let sidecar = cfg.proxy_type == crate::config::ProxyType::Sidecar;
    if !(cfg.dns.enable_server || (sidecar && cfg.dns.capture)) {
        return Check::ok(
            NAME,
            "DNS capture is off (ISTIO_META_DNS_CAPTURE): nothing to check",
        );
    }
    let Some((host, port)) = cfg.dns.proxy_addr.rsplit_once(':') else {
        return Check::fail(
            NAME,
            format!("DNS_PROXY_ADDR={:?} is not host:port", cfg.dns.proxy_addr),
            "set DNS_PROXY_ADDR to host:port",
        );
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ip = if host == "localhost" || host.is_empty() {
        localhost(cfg)
    } else {
        match host.parse::<IpAddr>() {
            Ok(ip) => ip,
            Err(_) => {
                return Check::fail(
                    NAME,
                    format!("DNS_PROXY_ADDR host {host:?} is not an IP"),
                    "set DNS_PROXY_ADDR to ip:port",
                );
            }
        }
    };
    let Ok(port) = port.parse::<u16>() else {
        return Check::fail(
            NAME,
            format!("DNS_PROXY_ADDR port {port:?} is not a number"),
            "set DNS_PROXY_ADDR to host:port",
        );
    };
    let addr = SocketAddr::new(ip, port);
    let qname = opts
        .dns_name
        .clone()
        .unwrap_or_else(|| format!("kubernetes.default.svc.{}", cluster_domain(&cfg.domain)));
    let fix = "the agent's DNS proxy does not answer: check the agent log for its DNS server, \
               and that ISTIO_META_DNS_CAPTURE is set in the proxy and istio-init (-r/DNS \
               capture rules to port 15053)";
    let udp = step(opts, udp_query(addr, &qname)).await;
    let tcp = step(opts, tcp_query(addr, &qname)).await;
    match (udp, tcp) {
        (Ok(u), Ok(t)) => {
            let detail = format!(
                "{addr}: {qname} answered over UDP ({}) and TCP ({})",
                rcode(u),
                rcode(t)
            );
            if u == ResponseCode::ServFail || t == ResponseCode::ServFail {
                Check::warn(
                    NAME,
                    detail,
                    "SERVFAIL: the proxy answers but its upstream (resolv.conf) did not",
                )
            } else {
                Check::ok(NAME, detail)
            }
        }
        (Err(e), _) => Check::fail(NAME, format!("{addr} UDP: {qname}: {e}"), fix),
        (_, Err(e)) => Check::fail(
            NAME,
            format!("{addr} TCP (truncated answers retry here): {qname}: {e}"),
            fix,
        ),
    }
}

/// `ns.svc.cluster.local` → `cluster.local`.
fn cluster_domain(domain: &str) -> &str {
    domain
        .split_once(".svc.")
        .map_or("cluster.local", |(_, d)| d)
}

/// The mnemonic `dig` prints (RFC 1035/6895 names), which operators search for.
fn rcode(c: ResponseCode) -> &'static str {
    match c {
        ResponseCode::NoError => "NOERROR",
        ResponseCode::FormErr => "FORMERR",
        ResponseCode::ServFail => "SERVFAIL",
        ResponseCode::NXDomain => "NXDOMAIN",
        ResponseCode::NotImp => "NOTIMP",
        ResponseCode::Refused => "REFUSED",
        _ => "other rcode",
    }
}

/// An A query for `name` with an EDNS0 OPT record (payload 1232), recursion desired.
fn query(id: u16, name: &str) -> Result<Vec<u8>, DoctorError> {
    use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
    use hickory_proto::rr::{Name, RecordType};
    let name = Name::from_ascii(name)
        .map_err(|e| DoctorError::Invalid(format!("DNS name {name:?}: {e}")))?;
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(name, RecordType::A));
    let mut edns = Edns::new();
    edns.set_max_payload(1232);
    m.set_edns(edns);
    m.to_vec()
        .map_err(|e| DoctorError::Invalid(format!("DNS query: {e}")))
}

/// The response code of a response to query `id`.
fn response_rcode(id: u16, b: &[u8]) -> Result<ResponseCode, DoctorError> {
    use hickory_proto::op::{Message, MessageType};
    let m = Message::from_vec(b)
        .map_err(|e| DoctorError::Invalid(format!("not a DNS message: {e}")))?;
    if m.metadata.id != id || m.metadata.message_type != MessageType::Response {
        return Err(DoctorError::Invalid(
            "not a DNS response to the query".to_owned(),
        ));
    }
    Ok(m.metadata.response_code)
}

async fn udp_query(addr: SocketAddr, name: &str) -> Result<ResponseCode, DoctorError> {
    let bind: SocketAddr = if addr.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let io = |error| DoctorError::Connect {
        addr: addr.to_string(),
        error,
    };
    let s = tokio::net::UdpSocket::bind(bind).await.map_err(io)?;
    s.connect(addr).await.map_err(io)?;
    let id = rand::random::<u16>();
    s.send(&query(id, name)?).await.map_err(io)?;
    let mut buf = vec![0u8; 4096];
    let n = s.recv(&mut buf).await.map_err(io)?;
    response_rcode(id, &buf[..n])
}

async fn tcp_query(addr: SocketAddr, name: &str) -> Result<ResponseCode, DoctorError> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let io = |error| DoctorError::Connect {
        addr: addr.to_string(),
        error,
    };
    let mut s = tokio::net::TcpStream::connect(addr).await.map_err(io)?;
    let id = rand::random::<u16>();
    let q = query(id, name)?;
    let mut msg = (q.len() as u16).to_be_bytes().to_vec();
    msg.extend_from_slice(&q);
    s.write_all(&msg).await.map_err(io)?;
    let len = s.read_u16().await.map_err(io)?;
    let mut buf = vec![0u8; usize::from(len)];
    s.read_exact(&mut buf).await.map_err(io)?;
    response_rcode(id, &buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_text() {
        let s = "listener_manager.total_listeners_warming: 2\nserver.uptime: 75\n";
        assert_eq!(stat(s, "listener_manager.total_listeners_warming"), Some(2));
        assert_eq!(stat(s, "server.uptime"), Some(75));
        let d = r#"{"unready_targets_dumps":[{"name":"x","target_names":["Listener-init-target a","RTDS"]}]}"#;
        assert_eq!(unready(d), ["Listener-init-target a", "RTDS"]);
        assert_eq!(cluster_domain("ns.svc.cluster.local"), "cluster.local");
        let q = query(7, "a.b").unwrap();
        assert_eq!(&q[12..17], &[1, b'a', 1, b'b', 0]);
        assert_eq!(
            response_rcode(7, &[0, 7, 0x81, 0x83, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap(),
            ResponseCode::NXDomain
        );
        assert!(response_rcode(8, &[0, 7, 0x81, 0x83, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(query(1, &format!("{}.b", "a".repeat(64))).is_err());
    }
}
