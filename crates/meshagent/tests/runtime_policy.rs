//! The runtime policy, checked on the product's runtime (the agent binary, one thread):
//! nothing that can block or burn CPU for long runs on the reactor, so the status port keeps
//! answering quickly while file-backed secrets are re-read in a loop.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryRequest;
use meshagent_proto::envoy::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use meshagent_proto::type_url;
use meshagent_testkit::{DEADLINE, Proc, envoy_bin, free_port, http_get, wait_for};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

/// File-cert resources subscribed, all in one directory (the MUTUAL DestinationRule layout).
const RESOURCES: usize = 40;
const SAMPLES: usize = 600;

fn start_agent(cwd: &Path, status: u16) -> Proc {
    let pc = serde_json::json!({
        "binaryPath": envoy_bin(),
        "proxyAdminPort": free_port(),
        "statusPort": status,
        "discoveryAddress": format!("127.0.0.1:{}", free_port()),
    });
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_meshagent"));
    cmd.args(["proxy", "sidecar", "--proxyLogLevel=warning"])
        .current_dir(cwd)
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .envs([
            ("POD_NAME", "app-1"),
            ("POD_NAMESPACE", "default"),
            ("SERVICE_ACCOUNT", "app"),
            ("INSTANCE_IP", "127.0.0.1"),
            ("FILE_MOUNTED_CERTS", "true"),
            ("FILE_DEBOUNCE_DURATION", "10ms"),
            ("PROXY_CONFIG", &pc.to_string()),
        ])
        .env("ENVOY_STATUS_PORT", free_port().to_string())
        .env("ENVOY_PROMETHEUS_PORT", free_port().to_string());
    Proc::spawn("agent", cmd, cwd)
}

fn pair() -> (String, String) {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_RSA_SHA256)
        .or_else(|_| rcgen::KeyPair::generate())
        .unwrap();
    let params = rcgen::CertificateParams::new(vec!["app.example".into()]).unwrap();
    (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
}

fn write_synced(path: &Path, content: &[u8]) {
    use std::io::Write as _;
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(content).unwrap();
    f.sync_all().unwrap();
}

/// One HTTP/1.1 request on a kept-alive connection; the status code (the body is read and
/// dropped). Plain blocking I/O on its own thread, so the client adds as little as possible
/// to what is measured.
fn get_keepalive(conn: &mut std::io::BufReader<std::net::TcpStream>, path: &str) -> u16 {
    use std::io::{BufRead as _, Read as _, Write as _};
    let req = format!("GET {path} HTTP/1.1\r\nHost: agent\r\n\r\n");
    conn.get_mut().write_all(req.as_bytes()).unwrap();
    let mut line = String::new();
    conn.read_line(&mut line).unwrap();
    let code = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut len = 0usize;
    loop {
        line.clear();
        conn.read_line(&mut line).unwrap();
        if line == "\r\n" {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; len];
    conn.read_exact(&mut body).unwrap();
    code
}

/// `SAMPLES` answer times of `path`, one every 2 ms.
fn sample(status: SocketAddr, path: &'static str) -> Vec<Duration> {
    let tcp = std::net::TcpStream::connect(status).unwrap();
    tcp.set_nodelay(true).unwrap();
    let mut conn = std::io::BufReader::new(tcp);
    (0..SAMPLES)
        .map(|_| {
            let t = tokio::time::Instant::now();
            let code = get_keepalive(&mut conn, path);
            let took = t.elapsed();
            assert_eq!(code, 404, "{path}");
            std::thread::sleep(Duration::from_millis(2));
            took
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_port_p99_stays_low_while_files_reload() {
    let cwd = tempfile::tempdir().unwrap();
    let dir = cwd.path().join("mtls");
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = pair();
    for i in 0..RESOURCES {
        std::fs::write(dir.join(format!("cert{i}.pem")), &cert).unwrap();
        std::fs::write(dir.join(format!("key{i}.pem")), &key).unwrap();
    }
    let status_port = free_port();
    let agent = start_agent(cwd.path(), status_port);
    let status = SocketAddr::from(([127, 0, 0, 1], status_port));
    let socket = cwd
        .path()
        .join("var/run/secrets/workload-spiffe-uds/socket");
    wait_for("the SDS socket", DEADLINE, || {
        let ok = socket.exists();
        async move { ok.then_some(()) }
    })
    .await;

    // One SDS stream subscribing to every file-cert resource.
    let ch = Endpoint::from_static("http://sds")
        .connect_with_connector(tower::service_fn(move |_| {
            let s = socket.clone();
            async move { tokio::net::UnixStream::connect(s).await.map(TokioIo::new) }
        }))
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(4);
    tx.send(DiscoveryRequest {
        resource_names: (0..RESOURCES)
            .map(|i| format!("file-cert:mtls/cert{i}.pem~mtls/key{i}.pem"))
            .collect(),
        type_url: type_url::SECRET.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut stream = SecretDiscoveryServiceClient::new(ch)
        .stream_secrets(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    // Istio's SDS answers each resource on its own as it becomes ready.
    let mut got = std::collections::HashSet::new();
    while got.len() < RESOURCES {
        let r = tokio::time::timeout(DEADLINE, stream.message())
            .await
            .expect("all file-cert resources served")
            .unwrap()
            .unwrap();
        for res in r.resources {
            let s: meshagent_proto::envoy::pb::envoy::extensions::transport_sockets::tls::v3::Secret =
                prost::Message::decode(res.value.as_slice()).unwrap();
            got.insert(s.name);
        }
    }

    // The same samples with nothing reloading: what this machine gives the status port idle.
    let mut idle = tokio::task::spawn_blocking(move || sample(status, "/debug/ndsz"))
        .await
        .unwrap();
    idle.sort();
    let idle_p99 = idle[SAMPLES * 99 / 100];

    // A writer rewrites (and fsyncs) the files in a loop: every write dirties every resource
    // in the directory, so the agent re-reads and re-verifies all of them continuously.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, dir, cert) = (stop.clone(), dir.clone(), cert.clone());
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                write_synced(
                    &dir.join(format!("cert{}.pem", i % RESOURCES)),
                    cert.as_bytes(),
                );
                i += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let loads = |body: &str| -> u64 {
        body.lines()
            .find_map(|l| l.strip_prefix("istio_agent_file_secret_loads_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let before = loads(&http_get(status, "/stats/prometheus").await.unwrap().1);

    // One keep-alive connection, so each sample is the agent's answer time, not connection
    // setup. The path is answered by the agent alone (no NDS table here: 404), so the time is
    // the agent's runtime, not Envoy's admin API behind /healthz/ready.
    let mut took = tokio::task::spawn_blocking(move || sample(status, "/debug/ndsz"))
        .await
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let after = loads(&http_get(status, "/stats/prometheus").await.unwrap().1);

    took.sort();
    let p50 = took[SAMPLES / 2];
    let p99 = took[SAMPLES * 99 / 100];
    println!(
        "status port under reload load: p50 {p50:?} p99 {p99:?} max {:?}; {} loads; idle p50 {:?} p99 {idle_p99:?}",
        took[SAMPLES - 1],
        after - before,
        idle[SAMPLES / 2]
    );
    // The load really happened (every rewrite re-reads the whole directory's resources).
    assert!(
        after - before >= (RESOURCES * 3) as u64,
        "only {} loads during the run\n{}",
        after - before,
        agent.log_text()
    );
    // The goal is 5 ms. Some machines cannot give even the idle status port that (a VM whose
    // idle vCPUs must be woken for every request: 1 ms p50 and 3–9 ms p99 idle were measured
    // on this project's CI machine), so the bound is also relative to the same run's idle
    // figure: reloading must not add stalls of its own. A reload that blocked the runtime
    // thread (a read or an fsync on it: 6–40 ms each on that disk, ten times a second) puts
    // p99 far above both.
    let bound = Duration::from_millis(5).max(idle_p99 * 3);
    assert!(
        p99 < bound,
        "status port p99 {p99:?} (p50 {p50:?}) while files reload, over {bound:?} (idle p99 {idle_p99:?})\n{}",
        agent.log_text()
    );
}
