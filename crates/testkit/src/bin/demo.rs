//! `make demo`: devplane (examples/mesh.yaml) plus two workloads, each with `meshagent proxy
//! sidecar` + Envoy + a tiny HTTP app, run exactly as pods run them (Istio's env vars, a
//! working directory with the projected token and istiod's root). A's app calls B through A's
//! Envoy over mTLS; the demo prints the response and both SPIFFE identities from Envoy's
//! `/certs`, then stops everything (SIGTERM → drain) and exits 0.

use std::net::SocketAddr;
use std::time::Duration;

use meshagent_testkit::{
    DEADLINE, Devplane, Sidecar, http_get, identity_app, wait_for, workspace_root,
};

const APP_A: u16 = 18080;
const APP_B: u16 = 18081;
const A_OUTBOUND_TO_B: &str = "127.0.0.1:15180";

async fn app(name: &'static str, port: u16) {
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap_or_else(|e| panic!("app {name} cannot listen on 127.0.0.1:{port}: {e}"));
    tokio::spawn(identity_app(name, l, Duration::ZERO));
}

async fn stop(name: &str, s: &mut Sidecar) {
    let pid = s.proc.pid().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    let st = wait_for(&format!("agent {name} to drain and exit"), DEADLINE, || {
        let st = s.proc.try_wait();
        async move { st }
    })
    .await;
    println!("agent {name}: {st}");
}

#[tokio::main]
async fn main() {
    let mesh = std::fs::read_to_string(workspace_root().join("examples/mesh.yaml"))
        .expect("read examples/mesh.yaml");
    println!("==> devplane (stand-in istiod) with examples/mesh.yaml");
    let dp = Devplane::start(&mesh).await;
    app("a", APP_A).await;
    app("b", APP_B).await;

    println!("==> meshagent proxy sidecar for workload a and workload b");
    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    let mut b = Sidecar::start(&dp, "b", "default", "b", &[]).await;
    a.wait_ready(Duration::from_secs(60)).await;
    b.wait_ready(Duration::from_secs(60)).await;
    println!("both sidecars ready (/healthz/ready = 200)");

    let addr: SocketAddr = A_OUTBOUND_TO_B.parse().expect("addr");
    println!("\n==> app a calls service b through its sidecar: GET http://{addr}/");
    let (status, body) = wait_for("a 200 from b through both sidecars", DEADLINE, || async {
        http_get(addr, "/").await.ok().filter(|(s, _)| *s == 200)
    })
    .await;
    println!("HTTP {status}: {}", body.trim());

    println!("\n--- workload identities (Envoy /certs) ---");
    println!("envoy a: {}", a.spiffe_ids().await.join(", "));
    println!("envoy b: {}", b.spiffe_ids().await.join(", "));

    println!("\n==> SIGTERM to both agents (graceful drain)");
    stop("a", &mut a).await;
    stop("b", &mut b).await;
    println!("\ndemo OK");
}
