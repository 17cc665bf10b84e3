//! Application probe rewriting (Istio `status/server.go` `handleAppProbe`) with `meshagent proxy` run as a pod runs it
//! (`DISABLE_ENVOY=true`, so only the status server works): real HTTP(S) servers
//! (`python3 -m http.server`), a real TCP listener and grpcio's gRPC health server, each
//! healthy and unhealthy; unknown probe paths; and startup validation of
//! `ISTIO_KUBE_APP_PROBERS` / `ISTIO_PROMETHEUS_ANNOTATIONS`.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};

use meshagent_testkit::{DEADLINE, Proc, free_port, http_get, wait_for, workspace_root};
use serde_json::json;

fn pythonpath() -> String {
    workspace_root().join(".tools/pip").display().to_string()
}

fn agent_cmd(cwd: &Path, status: u16, extra: &[(&str, String)]) -> Command {
    let pc = json!({
        "binaryPath": "/nonexistent/envoy",
        "statusPort": status,
        "discoveryAddress": format!("127.0.0.1:{}", free_port()),
    });
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_meshagent"));
    cmd.args(["proxy", "sidecar"])
        .current_dir(cwd)
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .env("POD_NAME", "app-1")
        .env("POD_NAMESPACE", "default")
        .env("INSTANCE_IP", "127.0.0.1")
        .env("DISABLE_ENVOY", "true")
        .env("PROXY_CONFIG", pc.to_string());
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

const GRPC_SERVER: &str = r#"
import sys
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
h = health.HealthServicer()
h.set("ok", health_pb2.HealthCheckResponse.SERVING)
h.set("bad", health_pb2.HealthCheckResponse.NOT_SERVING)
health_pb2_grpc.add_HealthServicer_to_server(h, server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
server.wait_for_termination()
"#;

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
    cmd.args(["-c", GRPC_SERVER, &grpc.to_string()])
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
            "reserved by Istio",
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
