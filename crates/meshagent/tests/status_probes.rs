//! Application probe rewriting (Istio `status/server.go` `handleAppProbe`) with `meshagent proxy` run as a pod runs it
//! (`DISABLE_ENVOY=true`, so only the status server works): real HTTP(S) servers
//! (`python3 -m http.server`), a real TCP listener and grpcio's gRPC health server, each
//! healthy and unhealthy; unknown probe paths; and startup validation of
//! `ISTIO_KUBE_APP_PROBERS` / `ISTIO_PROMETHEUS_ANNOTATIONS`.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use meshagent_testkit::istiod_box::GRPC_HEALTH_SERVER;
use meshagent_testkit::{
    DEADLINE, Proc, free_port, http_get, status_only_agent, wait_for, workspace_root,
};
use serde_json::json;

fn pythonpath() -> String {
    workspace_root().join(".tools/pip").display().to_string()
}

fn agent_cmd(cwd: &Path, status: u16, extra: &[(&str, String)]) -> Command {
    agent_cmd_in(None, cwd, status, extra)
}

/// [`agent_cmd`], run in network namespace `netns` when given (`ip netns exec`).
fn agent_cmd_in(netns: Option<&str>, cwd: &Path, status: u16, extra: &[(&str, String)]) -> Command {
    let bin = env!("CARGO_BIN_EXE_meshagent");
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, bin]);
            c
        }
        None => Command::new(bin),
    };
    status_only_agent(&mut cmd, cwd, status);
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd
}

async fn wait_port(addr: SocketAddr) {
    wait_for(&format!("{addr} to accept"), DEADLINE, || async move {
        tokio::net::TcpStream::connect(addr).await.ok().map(|_| ())
    })
    .await;
}

const HTTPS_SERVER: &str = r#"
import http.server, ssl, sys
srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[2], sys.argv[3])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
srv.serve_forever()
"#;

#[tokio::test]
async fn probes_against_real_servers() {
    let dir = tempfile::tempdir().unwrap();
    let www = dir.path().join("www");
    std::fs::create_dir_all(www.join("sub")).unwrap();
    std::fs::write(www.join("healthz"), "ok").unwrap();

    // HTTP: python's http.server.
    let web = free_port();
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "http.server", "--bind", "127.0.0.1"])
        .arg(web.to_string())
        .current_dir(&www);
    let web_proc = Proc::spawn("http-server", cmd, dir.path());

    // HTTPS with a self-signed certificate (probes do not verify, as kubelet does not).
    let tls = free_port();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let ok = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "1", "-subj", "/CN=app"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(ok.status.success(), "{ok:?}");
    let mut cmd = Command::new("python3");
    cmd.args(["-c", HTTPS_SERVER, &tls.to_string()])
        .arg(&cert)
        .arg(&key)
        .current_dir(&www);
    let tls_proc = Proc::spawn("https-server", cmd, dir.path());

    // gRPC: grpcio's health servicer.
    let grpc = free_port();
    let mut cmd = Command::new("python3");
    cmd.args(["-c", GRPC_HEALTH_SERVER, &grpc.to_string()])
        .env("PYTHONPATH", pythonpath());
    let grpc_proc = Proc::spawn("grpc-health", cmd, dir.path());

    // TCP: a plain listener that records where connections come from.
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_port = tcp.local_addr().unwrap().port();
    let peers: Arc<Mutex<Vec<IpAddr>>> = Arc::default();
    let seen = peers.clone();
    tokio::spawn(async move {
        while let Ok((_, peer)) = tcp.accept().await {
            seen.lock().unwrap().push(peer.ip());
        }
    });
    let closed = free_port();

    let probers = json!({
        "/app-health/web/livez": {"httpGet": {"path": "/healthz", "port": web}, "timeoutSeconds": 5},
        "/app-health/web/readyz": {"httpGet": {"path": "/missing", "port": web}},
        "/app-health/web/startupz": {"httpGet": {"path": "sub", "port": web}},
        "/app-health/down/livez": {"httpGet": {"path": "/", "port": closed}},
        "/app-health/tls/livez": {"httpGet": {"path": "/healthz", "port": tls, "scheme": "HTTPS"}},
        "/app-health/tls/readyz": {"httpGet": {"path": "/missing", "port": tls, "scheme": "HTTPS"}},
        "/app-health/tcp/livez": {"tcpSocket": {"port": tcp_port}},
        "/app-health/tcp/readyz": {"tcpSocket": {"port": closed}},
        "/app-health/grpc/livez": {"grpc": {"port": grpc, "service": "ok"}, "timeoutSeconds": 5},
        "/app-health/grpc/readyz": {"grpc": {"port": grpc, "service": "bad"}},
        "/app-health/grpc/startupz": {"grpc": {"port": grpc, "service": "unknown"}},
        "/app-health/nogrpc/livez": {"grpc": {"port": closed}},
        "/app-lifecycle/web/prestopz": {"httpGet": {"path": "/healthz", "port": web}},
    });
    let status = free_port();
    let cwd = tempfile::tempdir().unwrap();
    let cmd = agent_cmd(
        cwd.path(),
        status,
        &[("ISTIO_KUBE_APP_PROBERS", probers.to_string())],
    );
    let agent = Proc::spawn("agent", cmd, cwd.path());
    let status = SocketAddr::from(([127, 0, 0, 1], status));
    for port in [status.port(), web, tls, grpc] {
        wait_port(SocketAddr::from(([127, 0, 0, 1], port))).await;
    }

    let cases: &[(&str, u16, Option<&str>)] = &[
        ("/app-health/web/livez", 200, Some("ok")),
        ("/app-health/web/readyz", 404, None),
        // 301 to /sub/ on the same host is followed.
        ("/app-health/web/startupz", 200, Some("Directory listing")),
        ("/app-health/down/livez", 500, None),
        ("/app-health/tls/livez", 200, Some("ok")),
        ("/app-health/tls/readyz", 404, None),
        ("/app-health/tcp/livez", 200, None),
        ("/app-health/tcp/readyz", 500, None),
        ("/app-health/grpc/livez", 200, None),
        ("/app-health/grpc/readyz", 500, None),
        ("/app-health/grpc/startupz", 500, None),
        ("/app-health/nogrpc/livez", 500, None),
        ("/app-lifecycle/web/prestopz", 200, Some("ok")),
        (
            "/app-health/nope/livez",
            400,
            Some("app prober config does not exists for /app-health/nope/livez"),
        ),
    ];
    for (path, want, body_has) in cases {
        let (code, body) = http_get(status, path).await.unwrap();
        assert_eq!(code, *want, "{path}: {body}\n{}", agent.log_text());
        if let Some(s) = body_has {
            assert!(body.contains(s), "{path}: {body}");
        }
    }
    // Probe connections come from 127.0.0.6, which Istio's iptables rules never capture.
    assert!(
        peers
            .lock()
            .unwrap()
            .iter()
            .all(|ip| *ip == IpAddr::from([127, 0, 0, 6]))
    );
    assert!(!peers.lock().unwrap().is_empty());
    assert!(
        web_proc.log_text().contains("127.0.0.6 - - "),
        "{}",
        web_proc.log_text()
    );
    drop((tls_proc, grpc_proc));
}

#[test]
fn bad_probers_and_annotations_fail_startup() {
    let cases = [
        (
            "ISTIO_KUBE_APP_PROBERS",
            r#"{"/app-health/web/bogus":{"httpGet":{"port":80}}}"#,
            "invalid key \"/app-health/web/bogus\"",
        ),
        (
            "ISTIO_KUBE_APP_PROBERS",
            r#"{"/app-health/web/livez":{}}"#,
            "exactly one of httpGet, tcpSocket or grpc",
        ),
        (
            "ISTIO_KUBE_APP_PROBERS",
            r#"{"/app-health/web/livez":{"tcpSocket":{"port":"http"}}}"#,
            "tcpSocket.port \"http\" must be an integer",
        ),
        (
            "ISTIO_PROMETHEUS_ANNOTATIONS",
            r#"{"scrape":"true","port":"not-a-port"}"#,
            "not a port number",
        ),
        (
            "ISTIO_PROMETHEUS_ANNOTATIONS",
            r#"{"scrape":"true","targets":[{"port":"15090"}]}"#,
            "reserved for Istio (Envoy Prometheus (already merged)) and cannot be scraped",
        ),
    ];
    for (name, value, want) in cases {
        let cwd = tempfile::tempdir().unwrap();
        let out = agent_cmd(cwd.path(), free_port(), &[(name, value.to_owned())])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}={value}: {stderr}");
        assert!(
            stderr.contains(name) && stderr.contains(want),
            "{name}={value}: {stderr}"
        );
    }
}

/// The wiring in `app.rs`: `ISTIO_PROMETHEUS_ANNOTATIONS` makes the agent binary merge a real
/// application's metrics (python's http.server serving a file) after its own, with
/// `istio_agent_process_*` metrics, and `/debug/ndsz` answers 404 `{}` until a table arrives.
#[tokio::test]
async fn binary_merges_annotated_app_metrics() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("metrics"),
        "# TYPE app_hits counter\napp_hits{path=\"/\"} 42\n",
    )
    .unwrap();
    let web = free_port();
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "http.server", "--bind", "127.0.0.1"])
        .arg(web.to_string())
        .current_dir(dir.path());
    let _web = Proc::spawn("http-server", cmd, dir.path());
    let annotations =
        json!({"scrape": "true", "targets": [{"port": web.to_string(), "path": "/metrics"}]});
    let status = free_port();
    let cwd = tempfile::tempdir().unwrap();
    let cmd = agent_cmd(
        cwd.path(),
        status,
        &[("ISTIO_PROMETHEUS_ANNOTATIONS", annotations.to_string())],
    );
    let _agent = Proc::spawn("agent", cmd, cwd.path());
    let status = SocketAddr::from(([127, 0, 0, 1], status));
    wait_port(status).await;
    wait_port(SocketAddr::from(([127, 0, 0, 1], web))).await;
    let (code, body) = http_get(status, "/stats/prometheus").await.unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("istio_agent_scrapes_total 1\n"), "{body}");
    assert!(
        body.contains("istio_agent_process_resident_memory_bytes "),
        "{body}"
    );
    assert!(body.contains("app_hits{path=\"/\"} 42\n"), "{body}");
    assert!(body.find("istio_agent_").unwrap() < body.find("app_hits").unwrap());
    let (code, body) = http_get(status, "/debug/ndsz").await.unwrap();
    assert_eq!((code, body.as_str()), (404, "{}"));
    let (code, body) = http_get(status, "/healthz/ready").await.unwrap();
    assert_eq!(code, 200, "{body}");
}

/// A network namespace for one test, removed on drop.
struct Netns(String);

impl Netns {
    /// A namespace with `lo` up and interface `pod0` (one end of a veth pair, both ends in
    /// the namespace) holding `ip`/24, the pod IP.
    fn new(tag: &str, ip: &str) -> Netns {
        let ns = Netns(format!("ma-{tag}-{}", std::process::id()));
        let _ = Command::new("ip").args(["netns", "del", &ns.0]).output();
        for args in [
            vec!["netns", "add", &ns.0],
            vec!["-n", &ns.0, "link", "set", "lo", "up"],
            vec![
                "-n", &ns.0, "link", "add", "pod0", "type", "veth", "peer", "name", "pod0p",
            ],
            vec!["-n", &ns.0, "link", "set", "pod0p", "up"],
            vec![
                "-n",
                &ns.0,
                "addr",
                "add",
                &format!("{ip}/24"),
                "dev",
                "pod0",
            ],
            vec!["-n", &ns.0, "link", "set", "pod0", "up"],
        ] {
            let out = Command::new("ip").args(&args).output().unwrap();
            assert!(out.status.success(), "ip {args:?}: {out:?}");
        }
        ns
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.0, program]);
        c
    }

    /// GET `url` from inside the namespace: (status code, body).
    fn get(&self, url: &str) -> (u16, String) {
        let out = self
            .command("curl")
            .args(["-s", "--max-time", "10", "-w", "\n%{http_code}", url])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// Scenario F21: an application bound only to the pod IP (not to localhost) is probed through
/// the pod IP (INSTANCE_IP, Istio `status/server.go` `NewServer` `podIP`), over HTTP, TCP and
/// gRPC, with probe connections from 127.0.0.6; with the legacy switch
/// `REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION=true` the same probes go to localhost and fail.
#[tokio::test]
async fn f21_probes_reach_an_app_bound_only_to_the_pod_ip() {
    const POD_IP: &str = "10.250.0.2";
    let ns = Netns::new("f21", POD_IP);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("healthz"), "ok").unwrap();
    let (web, grpc) = (free_port(), free_port());
    let mut cmd = ns.command("python3");
    cmd.args(["-m", "http.server", "--bind", POD_IP])
        .arg(web.to_string())
        .current_dir(dir.path());
    let web_proc = Proc::spawn("pod-ip-http-server", cmd, dir.path());
    let mut cmd = ns.command("python3");
    cmd.args([
        "-c",
        &GRPC_HEALTH_SERVER.replace("127.0.0.1", POD_IP),
        &grpc.to_string(),
    ])
    .env("PYTHONPATH", pythonpath());
    let _grpc_proc = Proc::spawn("pod-ip-grpc-health", cmd, dir.path());

    let probers = json!({
        "/app-health/web/livez": {"httpGet": {"path": "/healthz", "port": web}, "timeoutSeconds": 5},
        "/app-health/tcp/livez": {"tcpSocket": {"port": web}},
        "/app-health/grpc/livez": {"grpc": {"port": grpc, "service": "ok"}, "timeoutSeconds": 5},
    });
    let paths = [
        "/app-health/web/livez",
        "/app-health/tcp/livez",
        "/app-health/grpc/livez",
    ];
    for (legacy, want) in [(false, 200), (true, 500)] {
        let status = free_port();
        let cwd = tempfile::tempdir().unwrap();
        let mut env = vec![
            ("ISTIO_KUBE_APP_PROBERS", probers.to_string()),
            ("INSTANCE_IP", POD_IP.to_owned()),
        ];
        if legacy {
            env.push(("REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION", "true".into()));
        }
        let cmd = agent_cmd_in(Some(&ns.0), cwd.path(), status, &env);
        let agent = Proc::spawn("agent", cmd, cwd.path());
        let ready = |url: String| {
            let ns = &ns;
            move || {
                let url = url.clone();
                async move { (ns.get(&url).0 != 0).then_some(()) }
            }
        };
        wait_for(
            "the agent's status port in the namespace",
            DEADLINE,
            ready(format!("http://127.0.0.1:{status}/healthz/ready")),
        )
        .await;
        wait_for(
            "the HTTP app on the pod IP",
            DEADLINE,
            ready(format!("http://{POD_IP}:{web}/healthz")),
        )
        .await;
        wait_for("the gRPC app on the pod IP", DEADLINE, || {
            let ns = &ns;
            async move {
                let probe = ns
                    .command("python3")
                    .args(["-c", "import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)", POD_IP, &grpc.to_string()])
                    .output()
                    .ok()?;
                probe.status.success().then_some(())
            }
        })
        .await;
        for path in paths {
            let (code, body) = ns.get(&format!("http://127.0.0.1:{status}{path}"));
            assert_eq!(
                code,
                want,
                "{path} (legacy localhost destination: {legacy}): {body}\n{}\n{}",
                agent.log_text(),
                web_proc.log_text()
            );
        }
    }
    assert!(
        web_proc.log_text().contains("127.0.0.6 - - "),
        "probe connections come from 127.0.0.6: {}",
        web_proc.log_text()
    );
}
