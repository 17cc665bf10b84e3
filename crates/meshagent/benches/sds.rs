//! SDS issuance latency: Envoy's SDS request → Envoy holds the certificate, ECDSA and RSA,
//! against devplane on loopback, with the CA round trip reported separately.
//!
//! Per iteration: a real Envoy starts with `sds-grpc` pointing at a relay socket. When Envoy's
//! first bytes arrive (t0) the relay starts the agent's identity subsystem from nothing (fresh
//! cwd, no key, no channel) and splices Envoy to the agent's socket. The end is Envoy's own
//! `sds.default.update_time` (ms since the epoch when Envoy applied the secret). The CA share is
//! the agent's `outgoing_latency` for that single CSR (TLS handshake + CreateCertificate).
//! The agent's share = total − CA. Key generation is on that path here (cold start); during
//! rotation it is not (the next key is pre-generated), so it is also reported on its own.
//!
//! Run: `cargo bench -p meshagent --bench sds` (ENVOY_BIN or .tools/pip Envoy; builds devplane
//! first with `cargo build --release --bins`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, SystemTime};

use meshagent::config::{self, MapEnv, ProxyFlags};
use meshagent::identity::keys::{KeyKind, KeySpec, WorkloadKey};
use meshagent::metrics::Registry;
use meshagent_testkit::{Devplane, Envoy, json, kubelet, workspace_root};
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

const ITERATIONS: usize = 15;

#[derive(Default)]
struct Sample {
    total_ms: f64,
    ca_ms: f64,
}

fn bootstrap(relay: &Path) -> meshagent_testkit::Value {
    let sds = json!({"api_config_source": {"api_type": "GRPC", "transport_api_version": "V3",
        "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]}, "resource_api_version": "V3"});
    let mut b = json!({
        "node": {"id": "sidecar~127.0.0.1~a-1.default~default.svc.cluster.local", "cluster": "a"},
        "static_resources": {
            "listeners": [{"name": "l", "address": {"socket_address": {"address": "127.0.0.1", "port_value": meshagent_testkit::free_port()}},
                "filter_chains": [{"filters": [{"name": "tcp", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "stat_prefix": "t", "cluster": "dummy"}}],
                  "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                    "common_tls_context": {"tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": sds}]}}}}]}],
            "clusters": [{"name": "dummy", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "dummy", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 1}}}}]}]}}]
        }
    });
    meshagent_testkit::add_sds_cluster(&mut b, relay);
    b
}

fn epoch_ms(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1000.0
}

async fn one(dp: &Devplane, token: &str, ecdsa: bool) -> Sample {
    let dir = tempfile::tempdir().unwrap();
    let root_dir = dir.path().join("var/run/secrets/istio");
    std::fs::create_dir_all(&root_dir).unwrap();
    std::fs::copy(dp.root_cert_path(), root_dir.join("root-cert.pem")).unwrap();
    kubelet::atomic_write(
        &dir.path().join("var/run/secrets/tokens"),
        &[("istio-token", token.as_bytes())],
    );
    let mut env = vec![
        ("POD_NAMESPACE".to_owned(), "default".to_owned()),
        ("SERVICE_ACCOUNT".to_owned(), "a".to_owned()),
        ("CA_ADDR".to_owned(), dp.grpc_addr.to_string()),
    ];
    if ecdsa {
        env.push(("ECC_SIGNATURE_ALGORITHM".into(), "ECDSA".into()));
    }
    let cfg = config::load(&ProxyFlags::default(), &MapEnv::from_pairs(env), dir.path()).unwrap();

    let relay_path = dir.path().join("relay.sock");
    let relay = tokio::net::UnixListener::bind(&relay_path).unwrap();
    let envoy_dir = dir.path().join("envoy");
    std::fs::create_dir_all(&envoy_dir).unwrap();
    let envoy = Envoy::start(bootstrap(&relay_path), &envoy_dir);

    let (mut from_envoy, _) = relay.accept().await.unwrap();
    let mut first = vec![0u8; 256 * 1024];
    let n = from_envoy.read(&mut first).await.unwrap();
    let t0 = SystemTime::now();
    let registry = Registry::new();
    let cancel = CancellationToken::new();
    let handle = meshagent::identity::start(&cfg, dir.path(), &registry, cancel.clone())
        .await
        .unwrap();
    let mut to_agent = tokio::net::UnixStream::connect(handle.socket())
        .await
        .unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut to_agent, &first[..n])
        .await
        .unwrap();
    let splice = tokio::spawn(async move {
        let _ = tokio::io::copy_bidirectional(&mut from_envoy, &mut to_agent).await;
    });

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if envoy.stat("sds.default.update_success").await.unwrap_or(0) >= 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Envoy never got the cert"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let held_ms = envoy.stat("sds.default.update_time").await.unwrap() as f64;
    let metrics = registry.encode();
    let ca_ms: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("istio_agent_outgoing_latency{request_type=\"csr\"} "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN);
    cancel.cancel();
    splice.abort();
    handle.stopped().await;
    drop(envoy);
    Sample {
        total_ms: held_ms - epoch_ms(t0),
        ca_ms,
    }
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let p = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    (p(0.5), p(0.9), v[v.len() - 1])
}

fn keygen_ms(kind: KeyKind) -> f64 {
    let n = 10;
    let start = tokio::time::Instant::now();
    for _ in 0..n {
        WorkloadKey::generate(KeySpec { kind, pkcs8: false }).unwrap();
    }
    start.elapsed().as_secs_f64() * 1000.0 / f64::from(n)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mesh = std::fs::read_to_string(workspace_root().join("examples/mesh.yaml")).unwrap();
        let dp = Devplane::start(&mesh).await;
        let token = dp.token("default", "a", 3600).await;
        println!("SDS issuance: Envoy's SDS request -> Envoy holds the workload cert (cold agent, devplane CA on loopback), {ITERATIONS} runs each");
        println!("{:<7} {:>24} {:>24} {:>24} {:>10}", "key", "total p50/p90/max ms", "CA RTT p50/p90/max ms", "agent p50/p90/max ms", "keygen ms");
        for (name, ecdsa, kind) in [("ECDSA", true, KeyKind::EcdsaP256), ("RSA", false, KeyKind::Rsa(2048))] {
            let _warmup = one(&dp, &token, ecdsa).await;
            let mut samples = Vec::new();
            for _ in 0..ITERATIONS {
                samples.push(one(&dp, &token, ecdsa).await);
            }
            let total = stats(samples.iter().map(|s| s.total_ms).collect());
            let ca = stats(samples.iter().map(|s| s.ca_ms).collect());
            let agent = stats(samples.iter().map(|s| s.total_ms - s.ca_ms).collect());
            let kg = keygen_ms(kind);
            let f = |t: (f64, f64, f64)| format!("{:.1}/{:.1}/{:.1}", t.0, t.1, t.2);
            println!("{name:<7} {:>24} {:>24} {:>24} {:>10.2}", f(total), f(ca), f(agent), kg);
        }
        println!("(times are from Envoy's update_time stat, 1 ms resolution; CA RTT includes the TLS handshake of the fresh channel; agent = total - CA RTT, including key generation which rotation does not wait for)");
    });
}
