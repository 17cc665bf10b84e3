//! `make demo`: devplane (examples/mesh.yaml) feeds two real Envoys directly; workload A's app
//! calls B through A's Envoy over mTLS. Prints what the Envoys received, the response, and both
//! SPIFFE identities from Envoy's `/certs`. Every child is stopped on exit.
//!
//! Until the agent runs the sidecar (`meshagent proxy sidecar`), certificates come from
//! devplane's CA over the Istio CA protocol and a static SDS stands in for the agent's.

use std::net::SocketAddr;
use std::path::Path;

use meshagent_testkit::static_sds::StaticSds;
use meshagent_testkit::{
    DEADLINE, Devplane, Envoy, add_sds_cluster, ca_client, direct_bootstrap, http_get, json,
    wait_for, workspace_root,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const APP_A: u16 = 18080;
const APP_B: u16 = 18081;
const A_OUTBOUND_TO_B: &str = "127.0.0.1:15180";

/// A tiny HTTP app that says who it is and who called it (from the XFCC header its sidecar sets).
async fn app(name: &'static str, port: u16) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap_or_else(|e| panic!("app {name} cannot listen on 127.0.0.1:{port}: {e}"));
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
            let body = format!("hello from {name}; caller identity: {caller}\n");
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

async fn sidecar(dp: &Devplane, name: &str, dir: &Path) -> (Envoy, StaticSds) {
    let token = dp.token("default", name, 3600).await;
    let (chain, key, root) =
        ca_client::workload_cert(dp.grpc_addr, &dp.root_cert_path(), &token).await;
    let sds = StaticSds::start(dir, &chain, &key, &root);
    let mut b = direct_bootstrap(
        &format!("sidecar~127.0.0.1~{name}-demo.default~default.svc.cluster.local"),
        json!({"NAME": format!("{name}-demo"), "NAMESPACE": "default", "CLUSTER_ID": "Kubernetes"}),
        dp.grpc_addr,
        &dp.root_cert_path(),
        &token,
        true,
    );
    add_sds_cluster(&mut b, &sds.socket);
    (Envoy::start(b, dir), sds)
}

async fn spiffe_ids(envoy: &Envoy) -> Vec<String> {
    let certs: serde_json::Value = envoy
        .admin_get("/certs")
        .await
        .and_then(|b| serde_json::from_str(&b).ok())
        .unwrap_or_default();
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

#[tokio::main]
async fn main() {
    let mesh = std::fs::read_to_string(workspace_root().join("examples/mesh.yaml"))
        .expect("read examples/mesh.yaml");
    println!("==> starting devplane with examples/mesh.yaml");
    let dp = Devplane::start(&mesh).await;
    tokio::spawn(app("a", APP_A));
    tokio::spawn(app("b", APP_B));

    let dir_a = tempfile::tempdir().expect("tempdir");
    let dir_b = tempfile::tempdir().expect("tempdir");
    println!("==> starting Envoy for workload a and workload b (Delta ADS over TLS to devplane)");
    let (envoy_a, _sds_a) = sidecar(&dp, "a", dir_a.path()).await;
    let (envoy_b, _sds_b) = sidecar(&dp, "b", dir_b.path()).await;

    for (name, envoy) in [("a", &envoy_a), ("b", &envoy_b)] {
        wait_for(&format!("Envoy {name} to be ready"), DEADLINE, || async {
            envoy
                .admin_get("/ready")
                .await
                .filter(|b| b.trim() == "LIVE")
        })
        .await;
        println!("\n--- what Envoy {name} received from devplane ---");
        println!("clusters:  {:?}", envoy.clusters().await);
        println!("listeners: {:?}", envoy.listeners().await);
    }

    let addr: SocketAddr = A_OUTBOUND_TO_B.parse().expect("addr");
    println!("\n==> app a calls service b through its sidecar: GET http://{addr}/");
    let (status, body) = wait_for("a 200 from b through both sidecars", DEADLINE, || async {
        http_get(addr, "/").await.ok().filter(|(s, _)| *s == 200)
    })
    .await;
    println!("HTTP {status}: {}", body.trim());

    println!("\n--- workload identities (Envoy /certs) ---");
    for (name, envoy) in [("a", &envoy_a), ("b", &envoy_b)] {
        println!("envoy {name}: {}", spiffe_ids(envoy).await.join(", "));
    }
    println!("\ndemo OK");
}
