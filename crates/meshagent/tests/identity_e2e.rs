//! Identity end to end: the agent's identity subsystem in-process (in a temp dir as its cwd),
//! devplane as the CA, and a real Envoy whose `sds-grpc` cluster points at the agent's socket.
//! Envoy asks for the secrets because a static listener's TLS context names them.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // test helpers: failing loudly is the point

use std::path::{Path, PathBuf};
use std::time::Duration;

use meshagent::config::{self, MapEnv, ProxyFlags};
use meshagent::identity::{self, IdentityHandle, Options};
use meshagent::metrics::Registry;
use meshagent_testkit::{
    Devplane, Envoy, Value, add_sds_cluster, free_port, json, kubelet, workspace_root,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const SPIFFE_A: &str = "spiffe://cluster.local/ns/default/sa/a";

struct Agent {
    handle: Option<IdentityHandle>,
    cancel: CancellationToken,
    registry: Registry,
    // last: the handle's tasks must stop before the directory goes
    dir: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Agent {
    fn path(&self) -> &Path {
        self.dir.path()
    }
    fn socket(&self) -> PathBuf {
        self.handle.as_ref().unwrap().socket().to_path_buf()
    }
    fn handle(&self) -> &IdentityHandle {
        self.handle.as_ref().unwrap()
    }
}

async fn devplane() -> Devplane {
    let mesh = std::fs::read_to_string(workspace_root().join("examples/mesh.yaml")).unwrap();
    Devplane::start(&mesh).await
}

/// Lays out `dir` like a pod's filesystem: istiod's root and (optionally) the projected token.
async fn prepare_pod(dir: &Path, dp: &Devplane, token: bool) {
    let root_dir = dir.join("var/run/secrets/istio");
    std::fs::create_dir_all(&root_dir).unwrap();
    std::fs::copy(dp.root_cert_path(), root_dir.join("root-cert.pem")).unwrap();
    if token {
        let token = dp.token("default", "a", 3600).await;
        kubelet::atomic_write(
            &dir.join("var/run/secrets/tokens"),
            &[("istio-token", token.as_bytes())],
        );
    }
}

/// Starts identity with `dir` as the agent's cwd.
async fn start_in(dir: tempfile::TempDir, env: &[(&str, &str)], opts: Options) -> Agent {
    let mut pairs: Vec<(String, String)> = vec![
        ("POD_NAMESPACE".into(), "default".into()),
        ("SERVICE_ACCOUNT".into(), "a".into()),
        ("POD_NAME".into(), "a-1".into()),
    ];
    pairs.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let cfg = config::load(
        &ProxyFlags::default(),
        &MapEnv::from_pairs(pairs),
        dir.path(),
    )
    .expect("config");
    let registry = Registry::new();
    let cancel = CancellationToken::new();
    let handle = identity::start_with(&cfg, dir.path(), &registry, cancel.clone(), opts)
        .await
        .expect("identity starts");
    Agent {
        handle: Some(handle),
        cancel,
        registry,
        dir,
    }
}

/// A pod dir with root and token, identity started against `dp` (or without a CA).
async fn start_agent(dp: Option<&Devplane>, env: &[(&str, &str)], opts: Options) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let mut env = env.to_vec();
    let ca_addr = dp.map(|d| d.grpc_addr.to_string()).unwrap_or_default();
    if let Some(dp) = dp {
        prepare_pod(dir.path(), dp, true).await;
        env.push(("CA_ADDR", &ca_addr));
    }
    start_in(dir, &env, opts).await
}

fn sds_config() -> Value {
    json!({"api_config_source": {"api_type": "GRPC", "transport_api_version": "V3",
        "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]},
        "resource_api_version": "V3"})
}

/// A bootstrap with one TLS listener whose certificate and validation context come over SDS.
fn bootstrap(socket: &Path, cert_name: &str, root_name: &str) -> Value {
    let mut b = json!({
        "node": {"id": "sidecar~127.0.0.1~a-1.default~default.svc.cluster.local", "cluster": "a.default"},
        "static_resources": {
            "listeners": [{
                "name": "mtls",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}},
                "filter_chains": [{
                    "filters": [{"name": "tcp", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                        "stat_prefix": "t", "cluster": "dummy"}}],
                    "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                        "common_tls_context": {
                            "tls_certificate_sds_secret_configs": [{"name": cert_name, "sds_config": sds_config()}],
                            "validation_context_sds_secret_config": {"name": root_name, "sds_config": sds_config()}
                        }}}
                }]
            }],
            "clusters": [{
                "name": "dummy", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "dummy", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 1}}}}]}]}
            }]
        }
    });
    add_sds_cluster(&mut b, socket);
    b
}

fn start_envoy(agent: &Agent, cert_name: &str, root_name: &str) -> Envoy {
    let dir = agent.path().join("envoy");
    std::fs::create_dir_all(&dir).unwrap();
    Envoy::start(bootstrap(&agent.socket(), cert_name, root_name), &dir)
}

/// Leaf serial and URI SANs of every certificate Envoy holds, and whether it holds a CA cert.
#[derive(Debug, Clone, PartialEq)]
struct Held {
    serial: String,
    uris: Vec<String>,
    has_ca: bool,
}

async fn held(envoy: &Envoy) -> Option<Held> {
    let body = envoy.admin_get("/certs").await?;
    let v: Value = serde_json::from_str(&body).ok()?;
    let c = v["certificates"].as_array()?.first()?.clone();
    let leaf = c["cert_chain"].as_array()?.first()?.clone();
    Some(Held {
        serial: leaf["serial_number"].as_str()?.to_owned(),
        uris: leaf["subject_alt_names"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["uri"].as_str().map(str::to_owned))
            .collect(),
        has_ca: c["ca_cert"].as_array().is_some_and(|a| !a.is_empty()),
    })
}

/// Polls every 50 ms until `f` yields, or panics after `timeout` naming `what`.
async fn poll<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_for_cert(envoy: &Envoy, not_serial: Option<&str>, timeout: Duration) -> Held {
    poll(
        "Envoy to hold a (new) workload certificate",
        timeout,
        || async {
            held(envoy)
                .await
                .filter(|h| h.has_ca && Some(h.serial.as_str()) != not_serial && !h.uris.is_empty())
        },
    )
    .await
}

async fn stat(envoy: &Envoy, name: &str) -> u64 {
    envoy.stat(name).await.unwrap_or(0)
}

async fn csr_records(dp: &Devplane) -> Vec<Value> {
    dp.debug_json("/debug/csr")
        .await
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn gets_default_and_rootca(env: &[(&str, &str)], key_header: &str) {
    let dp = devplane().await;
    let mut env = env.to_vec();
    env.push(("OUTPUT_CERTS", "out"));
    let agent = start_agent(Some(&dp), &env, Options::default()).await;
    let envoy = start_envoy(&agent, "default", "ROOTCA");
    let h = wait_for_cert(&envoy, None, Duration::from_secs(30)).await;
    assert_eq!(h.uris, vec![SPIFFE_A.to_owned()]);
    poll("ROOTCA applied", Duration::from_secs(10), || async {
        (stat(&envoy, "sds.ROOTCA.update_success").await >= 1).then_some(())
    })
    .await;
    // The exported key carries Istio's PEM type for the algorithm, mode 0600. The files are
    // written after Envoy has the certificate over SDS (their fsyncs are not on Envoy's
    // path), so they may lag behind it.
    let key_path = agent.path().join("out/key.pem");
    let key = poll("OUTPUT_CERTS written", Duration::from_secs(10), || async {
        std::fs::read_to_string(&key_path).ok()
    })
    .await;
    assert!(
        key.starts_with(&format!("-----BEGIN {key_header}-----")),
        "{}",
        &key[..40]
    );
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(agent.path().join("out/key.pem"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let metrics = agent.registry.encode();
    assert!(
        metrics.contains("istio_agent_num_outgoing_requests{request_type=\"csr\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("istio_agent_cert_expiry_seconds{resource_name=\"default\"}"),
        "{metrics}"
    );
    assert!(agent.handle().status().borrow().not_ready.is_none());
    // Shutdown is prompt even with Envoy's SDS streams open.
    let mut agent = agent;
    agent.cancel.cancel();
    let handle = agent.handle.take().unwrap();
    tokio::time::timeout(Duration::from_secs(5), handle.stopped())
        .await
        .expect("identity stops promptly with Envoy connected");
    drop(envoy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gets_default_and_rootca_rsa() {
    gets_default_and_rootca(&[], "RSA PRIVATE KEY").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gets_default_and_rootca_ecdsa() {
    gets_default_and_rootca(&[("ECC_SIGNATURE_ALGORITHM", "ECDSA")], "EC PRIVATE KEY").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_ttl_rotates_on_schedule_without_reconnecting() {
    let dp = devplane().await;
    let env = [
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA"),
        ("SECRET_TTL", "4s"),
        ("OUTPUT_CERTS", "out"),
    ];
    let agent = start_agent(Some(&dp), &env, Options::default()).await;
    let envoy = start_envoy(&agent, "default", "ROOTCA");
    let mut h = wait_for_cert(&envoy, None, Duration::from_secs(30)).await;
    // The files follow SDS (written after Envoy has the certificate), so they are polled.
    let exported = || std::fs::read_to_string(agent.path().join("out/cert-chain.pem")).ok();
    let first_export = poll("OUTPUT_CERTS written", Duration::from_secs(10), || async {
        exported()
    })
    .await;
    let mut changed_at = Instant::now();
    for _ in 0..3 {
        let next = wait_for_cert(&envoy, Some(&h.serial), Duration::from_secs(10)).await;
        let gap = changed_at.elapsed();
        // 4 s certs (NotAfter has 1 s resolution) rotate at half life ± 1 %: 1.5–2 s, plus
        // polling and push latency.
        assert!(
            gap >= Duration::from_millis(1000) && gap <= Duration::from_millis(3500),
            "rotation after {gap:?}"
        );
        assert_eq!(next.uris, vec![SPIFFE_A.to_owned()]);
        h = next;
        changed_at = Instant::now();
    }
    assert_eq!(
        stat(&envoy, "cluster.sds-grpc.upstream_cx_total").await,
        1,
        "SDS reconnected"
    );
    assert!(csr_records(&dp).await.len() >= 4);
    // OUTPUT_CERTS follows rotations (istio#53118: written once, never updated).
    poll("OUTPUT_CERTS rotated", Duration::from_secs(10), || async {
        exported().filter(|e| *e != first_export)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ca_outage_keeps_the_old_cert_and_recovers() {
    let mut dp = devplane().await;
    // Long enough that the first failed rotation (at ~7 s, after ~3 s of in-call retries)
    // ends before the certificate expires.
    let env = [("ECC_SIGNATURE_ALGORITHM", "ECDSA"), ("SECRET_TTL", "14s")];
    let agent = start_agent(Some(&dp), &env, Options::default()).await;
    let envoy = start_envoy(&agent, "default", "ROOTCA");
    let h = wait_for_cert(&envoy, None, Duration::from_secs(30)).await;
    dp.stop();
    let status = agent.handle().status();
    // Past the rotation point (~7 s): the CSR fails and Envoy keeps the old certificate.
    poll("a failed rotation", Duration::from_secs(15), || async {
        status.borrow().last_error.clone()
    })
    .await;
    assert_eq!(held(&envoy).await.unwrap().serial, h.serial);
    assert!(
        status.borrow().not_ready.is_none(),
        "still valid: still ready"
    );
    let failed = agent.registry.encode();
    assert!(failed.contains("istio_agent_num_failed_outgoing_requests{request_type=\"csr\"}"));
    // Past expiry the readiness reason appears.
    poll(
        "not ready after expiry",
        Duration::from_secs(15),
        || async { status.borrow().not_ready.clone() },
    )
    .await;
    assert_eq!(
        held(&envoy).await.unwrap().serial,
        h.serial,
        "old cert kept"
    );

    dp.restart().await;
    let restarted = Instant::now();
    // One backoff step (≤ 4 s at this point: 0.5, 1, 2, 4 …) plus one attempt's internal
    // retries (≤ 3.1 s) plus push latency.
    let new = wait_for_cert(&envoy, Some(&h.serial), Duration::from_secs(20)).await;
    let took = restarted.elapsed();
    assert!(took <= Duration::from_secs(10), "recovered after {took:?}");
    assert_eq!(new.uris, vec![SPIFFE_A.to_owned()]);
    assert!(status.borrow().not_ready.is_none());
}

fn fingerprint(token: &str) -> String {
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, token.as_bytes());
    let hex: String = d.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("Bearer sha256:{}", &hex[..16])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_token_is_sent_with_the_next_csr() {
    let dp = devplane().await;
    let env = [("ECC_SIGNATURE_ALGORITHM", "ECDSA"), ("SECRET_TTL", "4s")];
    let agent = start_agent(Some(&dp), &env, Options::default()).await;
    let first =
        std::fs::read_to_string(agent.path().join("var/run/secrets/tokens/istio-token")).unwrap();
    poll("first CSR", Duration::from_secs(30), || async {
        let r = csr_records(&dp).await;
        r.iter().any(|c| c["serial"].is_string()).then_some(())
    })
    .await;
    let records = csr_records(&dp).await;
    assert_eq!(records[0]["headers"]["authorization"], fingerprint(&first));

    // Same identity, later expiry, swapped in through `..data` like the kubelet does.
    let second = dp.token("default", "a", 7200).await;
    assert_ne!(first, second);
    kubelet::atomic_write(
        &agent.path().join("var/run/secrets/tokens"),
        &[("istio-token", second.as_bytes())],
    );
    let swapped = csr_records(&dp).await.len();
    let recs = poll("a CSR after the swap", Duration::from_secs(10), || async {
        let r = csr_records(&dp).await;
        (r.len() > swapped).then_some(r)
    })
    .await;
    assert_eq!(
        recs[swapped]["headers"]["authorization"],
        fingerprint(&second)
    );
    assert!(
        recs[swapped]["serial"].is_string(),
        "signed: {}",
        recs[swapped]
    );
}

fn self_signed(n: u32) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(vec![format!("rot{n}.example")]).unwrap();
    p.subject_alt_names.push(rcgen::SanType::URI(
        format!("spiffe://cluster.local/ns/default/sa/rot{n}")
            .try_into()
            .unwrap(),
    ));
    p.serial_number = Some(rcgen::SerialNumber::from(u64::from(n) + 1000));
    (p.self_signed(&key).unwrap().pem(), key.serialize_pem())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_kubelet_rotations_of_mounted_certs_reach_envoy() {
    let agent = start_agent(None, &[("FILE_MOUNTED_CERTS", "true")], Options::default()).await;
    let mount = agent.path().join("etc/secret");
    let publish = |n: u32| {
        let (cert, key) = self_signed(n);
        kubelet::atomic_write(
            &mount,
            &[
                ("tls.crt", cert.as_bytes()),
                ("tls.key", key.as_bytes()),
                ("ca.crt", cert.as_bytes()),
            ],
        );
    };
    publish(0);
    let cert_name = format!(
        "file-cert:{}~{}",
        mount.join("tls.crt").display(),
        mount.join("tls.key").display()
    );
    let root_name = format!("file-root:{}", mount.join("ca.crt").display());
    let envoy = start_envoy(&agent, &cert_name, &root_name);
    let mut h = wait_for_cert(&envoy, None, Duration::from_secs(30)).await;
    let mut seen = vec![h.serial.clone()];
    for n in 1..=10 {
        publish(n);
        h = wait_for_cert(&envoy, Some(&h.serial), Duration::from_secs(10)).await;
        assert_eq!(
            h.uris,
            vec![format!("spiffe://cluster.local/ns/default/sa/rot{n}")]
        );
        seen.push(h.serial.clone());
    }
    seen.dedup();
    assert_eq!(seen.len(), 11, "{seen:?}");
    // A metadata-only update (same content) is not a push: Envoy counts exactly one update
    // per real rotation (initial + 10 + the one below).
    let dir = std::fs::read_link(mount.join("..data")).unwrap();
    let same: Vec<(String, Vec<u8>)> = ["tls.crt", "tls.key", "ca.crt"]
        .iter()
        .map(|f| {
            (
                f.to_string(),
                std::fs::read(mount.join(&dir).join(f)).unwrap(),
            )
        })
        .collect();
    let refs: Vec<(&str, &[u8])> = same
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_slice()))
        .collect();
    kubelet::atomic_write(&mount, &refs);
    // Not synchronisation: keeps the two updates in separate debounce windows (100 ms) so the
    // identical one is really re-read on its own.
    tokio::time::sleep(Duration::from_millis(400)).await;
    publish(11);
    let last = wait_for_cert(&envoy, Some(&h.serial), Duration::from_secs(10)).await;
    assert_eq!(
        last.uris,
        vec!["spiffe://cluster.local/ns/default/sa/rot11".to_owned()]
    );
    let updates = poll(
        "Envoy's update count for the file cert",
        Duration::from_secs(5),
        || async {
            let body = envoy.admin_get("/stats?filter=update_success").await?;
            body.lines()
                .find(|l| l.starts_with("sds.file-cert") && l.contains(".update_success: "))
                .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        },
    )
    .await;
    assert_eq!(updates, 12, "the identical update must not be pushed");
    let metrics = agent.registry.encode();
    assert!(
        metrics.contains("istio_agent_num_file_secret_failures_total 0"),
        "{metrics}"
    );
    // Both SDS streams share one HTTP/2 connection that never reconnected.
    assert_eq!(stat(&envoy, "cluster.sds-grpc.upstream_cx_total").await, 1);
}

// === raw SDS client tests ===

mod raw {
    use super::*;
    use hyper_util::rt::TokioIo;
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DiscoveryRequest,
    };
    use meshagent_proto::envoy::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
    use meshagent_proto::envoy::pb::google::rpc::Status as RpcStatus;
    use meshagent_proto::type_url;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::transport::{Channel, Endpoint};

    pub async fn client(socket: &Path) -> SecretDiscoveryServiceClient<Channel> {
        let socket = socket.to_path_buf();
        let ch = Endpoint::from_static("http://sds")
            .connect_with_connector(tower::service_fn(move |_| {
                let s = socket.clone();
                async move { tokio::net::UnixStream::connect(s).await.map(TokioIo::new) }
            }))
            .await
            .unwrap();
        SecretDiscoveryServiceClient::new(ch)
    }

    pub fn req(names: &[&str], version: &str, nonce: &str, nack: bool) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.into(),
            resource_names: names.iter().map(|s| s.to_string()).collect(),
            type_url: type_url::SECRET.into(),
            response_nonce: nonce.into(),
            error_detail: nack.then(|| RpcStatus {
                code: 3,
                message: "rejected by test".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nack_gets_no_response_and_ack_none_either() {
        let dp = devplane().await;
        let env = [("ECC_SIGNATURE_ALGORITHM", "ECDSA")];
        let agent = start_agent(Some(&dp), &env, Options::default()).await;
        let mut c = client(&agent.socket()).await;
        let (tx, rx) = mpsc::channel(8);
        tx.send(req(&["default"], "", "", false)).await.unwrap();
        let mut stream = c
            .stream_secrets(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let first = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(first.resources.len(), 1);
        // NACK: held, no response.
        for _ in 0..3 {
            tx.send(req(&["default"], &first.version_info, &first.nonce, true))
                .await
                .unwrap();
        }
        let quiet = tokio::time::timeout(Duration::from_secs(2), stream.message()).await;
        assert!(quiet.is_err(), "response to a NACK: {quiet:?}");
        // ACK with the same names: no response either.
        tx.send(req(&["default"], &first.version_info, &first.nonce, false))
            .await
            .unwrap();
        let quiet = tokio::time::timeout(Duration::from_secs(1), stream.message()).await;
        assert!(quiet.is_err(), "response to an ACK: {quiet:?}");
        // A new name on the same stream: only that one.
        tx.send(req(
            &["default", "ROOTCA"],
            &first.version_info,
            &first.nonce,
            false,
        ))
        .await
        .unwrap();
        let second = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(second.resources.len(), 1);
        let secret: meshagent_proto::envoy::pb::envoy::extensions::transport_sockets::tls::v3::Secret =
            prost::Message::decode(second.resources[0].value.as_slice()).unwrap();
        assert_eq!(secret.name, "ROOTCA");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn delta_secrets_work() {
        let dp = devplane().await;
        let agent = start_agent(
            Some(&dp),
            &[("ECC_SIGNATURE_ALGORITHM", "ECDSA")],
            Options::default(),
        )
        .await;
        let mut c = client(&agent.socket()).await;
        let (tx, rx) = mpsc::channel(8);
        tx.send(DeltaDiscoveryRequest {
            type_url: type_url::SECRET.into(),
            resource_names_subscribe: vec!["default".into(), "ROOTCA".into()],
            ..Default::default()
        })
        .await
        .unwrap();
        let mut stream = c
            .delta_secrets(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut names = Vec::new();
        while names.len() < 2 {
            let r = tokio::time::timeout(Duration::from_secs(30), stream.message())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            names.extend(r.resources.into_iter().map(|r| r.name));
        }
        names.sort();
        assert_eq!(names, vec!["ROOTCA".to_owned(), "default".to_owned()]);
    }

    /// A new SotW stream that has asked for `name`, and its request sender.
    async fn ask(
        agent: &Agent,
        name: &str,
    ) -> (
        tonic::Streaming<
            meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryResponse,
        >,
        mpsc::Sender<DiscoveryRequest>,
    ) {
        let mut c = client(&agent.socket()).await;
        let (tx, rx) = mpsc::channel(8);
        tx.send(req(&[name], "", "", false)).await.unwrap();
        let stream = c
            .stream_secrets(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        (stream, tx)
    }

    async fn stream_error(agent: &Agent, name: &str) -> String {
        let (mut stream, _tx) = ask(agent, name).await;
        let r = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .unwrap();
        match r {
            Err(status) => status.message().to_owned(),
            Ok(other) => panic!("expected an error for {name}, got {other:?}"),
        }
    }

    /// Fetches `name` on a new stream: the number of resources in the answer, and the stream
    /// (the subscription lasts as long as it does).
    async fn fetch(agent: &Agent, name: &str) -> (usize, Box<dyn std::any::Any>) {
        let (mut stream, tx) = ask(agent, name).await;
        let r = tokio::time::timeout(Duration::from_secs(10), stream.message())
            .await
            .unwrap_or_else(|_| panic!("no answer for {name} within 10 s"))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .unwrap();
        (r.resources.len(), Box::new((stream, tx)))
    }

    fn metric(agent: &Agent, series: &str) -> u64 {
        agent
            .registry
            .encode()
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }

    /// Hostile file roots (a FIFO, a character device, a file over the size bound) are refused
    /// without stalling other resources, and reading the watched files does not trigger more
    /// loads. Runs on a current-thread runtime,
    /// as the agent does, so a blocking read on the reactor would stall the test itself.
    #[tokio::test(flavor = "current_thread")]
    async fn hostile_file_roots_stall_nothing_and_reads_do_not_retrigger() {
        let opts = Options {
            file_load_wait: Duration::from_millis(300),
            ..Options::default()
        };
        let agent = start_agent(None, &[("FILE_MOUNTED_CERTS", "true")], opts).await;
        let d = agent.path();
        nix::unistd::mkfifo(&d.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        // The standard MUTUAL DestinationRule layout: cert, key and CA in one directory.
        let certs = d.join("etc/certs");
        std::fs::create_dir_all(&certs).unwrap();
        let (c1, k1) = self_signed(1);
        std::fs::write(certs.join("cert.pem"), &c1).unwrap();
        std::fs::write(certs.join("key.pem"), k1).unwrap();
        std::fs::write(certs.join("ca.pem"), &c1).unwrap();
        std::fs::write(d.join("huge.pem"), c1.repeat((5 << 20) / c1.len() + 1)).unwrap();

        let started = Instant::now();
        for (name, want) in [
            ("file-root:fifo", "not a regular file (a FIFO)"),
            (
                "file-root:/dev/zero",
                "not a regular file (a character device)",
            ),
            ("file-root:huge.pem", "larger than"),
        ] {
            let e = stream_error(&agent, name).await;
            assert!(e.contains(want), "{name}: {e}");
        }
        // Everything else is still served, at once.
        let (n, _cert) = fetch(&agent, "file-cert:etc/certs/cert.pem~etc/certs/key.pem").await;
        assert_eq!(n, 1);
        let (n, _root) = fetch(&agent, "file-root:etc/certs/ca.pem").await;
        assert_eq!(n, 1);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "hostile files held up the agent for {:?}",
            started.elapsed()
        );

        // Reading the files must not trigger more reads (inotify open/access events): the
        // load count stays put while nothing changes...
        let settle = Instant::now() + Duration::from_millis(500);
        tokio::time::sleep_until(settle).await;
        let loads = metric(&agent, "istio_agent_file_secret_loads_total");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            metric(&agent, "istio_agent_file_secret_loads_total"),
            loads,
            "file secrets were re-read with no change on disk"
        );
        // ...and a real change is still picked up.
        let (c2, _) = self_signed(2);
        std::fs::write(certs.join("ca.pem"), c2).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while metric(&agent, "istio_agent_file_secret_loads_total") <= loads {
            assert!(Instant::now() < deadline, "the CA change was not reloaded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// File resources used to be kept (and re-read on every change) forever.
    #[tokio::test(flavor = "current_thread")]
    async fn file_resources_are_forgotten_when_no_stream_subscribes() {
        const N: usize = 300;
        let agent = start_agent(None, &[("FILE_MOUNTED_CERTS", "true")], Options::default()).await;
        let d = agent.path();
        std::fs::create_dir_all(d.join("roots")).unwrap();
        let (c1, _) = self_signed(1);
        std::fs::write(d.join("roots/ca.pem"), &c1).unwrap();
        // N names for the same file (istiod may name one path in many ways over time).
        let names: Vec<String> = (0..N)
            .map(|i| format!("file-root:roots/{}ca.pem", "./".repeat(i)))
            .collect();
        let mut c = client(&agent.socket()).await;
        let (tx, rx) = mpsc::channel(8);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        tx.send(req(&refs, "", "", false)).await.unwrap();
        let mut stream = c
            .stream_secrets(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut got = 0;
        while got < N {
            let r = tokio::time::timeout(Duration::from_secs(30), stream.message())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            got += r.resources.len();
        }
        assert_eq!(
            metric(&agent, "istio_agent_file_secret_resources"),
            N as u64
        );
        // The stream goes away: every resource is forgotten.
        drop((stream, tx, c));
        let deadline = Instant::now() + Duration::from_secs(10);
        while metric(&agent, "istio_agent_file_secret_resources") != 0 {
            assert!(
                Instant::now() < deadline,
                "file resources kept after their stream ended"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // ...and a change to the file no longer causes reads.
        let loads = metric(&agent, "istio_agent_file_secret_loads_total");
        let (c2, _) = self_signed(2);
        std::fs::write(d.join("roots/ca.pem"), c2).unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(metric(&agent, "istio_agent_file_secret_loads_total"), loads);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mismatched_or_unreadable_file_certs_are_clear_errors() {
        let opts = Options {
            file_load_wait: Duration::from_millis(300),
            ..Options::default()
        };
        let agent = start_agent(None, &[("FILE_MOUNTED_CERTS", "true")], opts).await;
        let d = agent.path();
        let (c1, _) = self_signed(1);
        let (_, k2) = self_signed(2);
        std::fs::write(d.join("c.pem"), c1).unwrap();
        std::fs::write(d.join("k.pem"), k2).unwrap();
        let e = stream_error(&agent, "file-cert:c.pem~k.pem").await;
        assert!(
            e.contains("failed to generate secret for file-cert:c.pem~k.pem"),
            "{e}"
        );
        assert!(e.contains("do not match"), "{e}");
        let e = stream_error(&agent, "file-root:missing.pem").await;
        assert!(
            e.contains("cannot read") && e.contains("missing.pem"),
            "{e}"
        );
        // At least these two failures are counted (under load a retry streak of another
        // name may add to it, so the exact total is not asserted).
        let metrics = agent.registry.encode();
        let failures: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("istio_agent_num_file_secret_failures_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        assert!(failures >= 2, "{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_token_is_one_clear_readiness_reason_without_retries() {
    let dp = devplane().await;
    let dir = tempfile::tempdir().unwrap();
    prepare_pod(dir.path(), &dp, false).await;
    let env = [
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA"),
        ("CA_ADDR", &dp.grpc_addr.to_string()),
    ];
    let agent = start_in(dir, &env, Options::default()).await;
    let status = agent.handle().status();
    let reason = poll("a readiness reason", Duration::from_secs(20), || async {
        status
            .borrow()
            .not_ready
            .clone()
            .filter(|r| r.contains("Unauthenticated"))
    })
    .await;
    assert!(reason.contains("token"), "names the likely cause: {reason}");
    let m = agent.registry.encode();
    assert!(
        m.contains("istio_agent_num_outgoing_retries{request_type=\"csr\"} 0"),
        "{m}"
    );
    assert!(
        m.contains("istio_agent_num_failed_outgoing_requests{request_type=\"csr\"} 1"),
        "{m}"
    );
    // Once a token appears, the next attempt (0.5 s backoff, then 1 s …) succeeds.
    let token = dp.token("default", "a", 3600).await;
    kubelet::atomic_write(
        &agent.path().join("var/run/secrets/tokens"),
        &[("istio-token", token.as_bytes())],
    );
    poll(
        "ready once the token exists",
        Duration::from_secs(10),
        || async { status.borrow().not_ready.is_none().then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_requests_are_held_until_the_first_cert() {
    let mut dp = devplane().await;
    let dir = tempfile::tempdir().unwrap();
    prepare_pod(dir.path(), &dp, true).await;
    // The CA is down when the agent starts (F1) and Envoy asks at once.
    dp.stop();
    let ca_addr = dp.grpc_addr.to_string();
    let env = [
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA"),
        ("CA_ADDR", ca_addr.as_str()),
    ];
    let agent = start_in(dir, &env, Options::default()).await;
    let envoy = start_envoy(&agent, "default", "ROOTCA");
    let status = agent.handle().status();
    poll("a failed first CSR", Duration::from_secs(20), || async {
        status.borrow().last_error.clone()
    })
    .await;
    assert!(held(&envoy).await.is_none(), "nothing to hold yet");
    dp.restart().await;
    let h = wait_for_cert(&envoy, None, Duration::from_secs(20)).await;
    assert_eq!(h.uris, vec![SPIFFE_A.to_owned()]);
    assert_eq!(
        stat(&envoy, "cluster.sds-grpc.upstream_cx_total").await,
        1,
        "held, not refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pcds_trust_anchors_are_merged_into_rootca() {
    let dp = devplane().await;
    let agent = start_agent(
        Some(&dp),
        &[("ECC_SIGNATURE_ALGORITHM", "ECDSA")],
        Options::default(),
    )
    .await;
    let envoy = start_envoy(&agent, "default", "ROOTCA");
    wait_for_cert(&envoy, None, Duration::from_secs(30)).await;
    let ca_count = |envoy: &Envoy| {
        let envoy_admin = envoy.admin;
        async move {
            let (_, body) = meshagent_testkit::http_get(envoy_admin, "/certs")
                .await
                .ok()?;
            let v: Value = serde_json::from_str(&body).ok()?;
            Some(v["certificates"][0]["ca_cert"].as_array()?.len())
        }
    };
    assert_eq!(ca_count(&envoy).await, Some(1));
    let (extra, _) = self_signed(99);
    agent.handle().set_trust_anchors(vec![extra]);
    poll("ROOTCA with two roots", Duration::from_secs(10), || async {
        (ca_count(&envoy).await == Some(2)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_sds_socket_serves_only_files() {
    // A healthy external socket: we must not take it over.
    let dir = tempfile::tempdir().unwrap();
    let ext = dir
        .path()
        .join("var/run/secrets/workload-spiffe-uds/socket");
    std::fs::create_dir_all(ext.parent().unwrap()).unwrap();
    let listener = tokio::net::UnixListener::bind(&ext).unwrap();
    let agent = start_in(dir, &[], Options::default()).await;
    assert_eq!(*agent.handle().mode(), identity::IdentityMode::ExternalSds);
    assert!(
        agent
            .socket()
            .ends_with("var/run/secrets/credential-uds/files-socket")
    );
    assert!(ext.exists(), "external socket left alone");
    drop(listener);
    drop(agent);

    // An unhealthy one (nobody listening) is removed and we serve the workload socket.
    let dir = tempfile::tempdir().unwrap();
    let ext = dir
        .path()
        .join("var/run/secrets/workload-spiffe-uds/socket");
    std::fs::create_dir_all(ext.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&ext).unwrap());
    let agent = start_in(dir, &[("FILE_MOUNTED_CERTS", "true")], Options::default()).await;
    assert_eq!(*agent.handle().mode(), identity::IdentityMode::FileMounted);
    assert_eq!(agent.socket(), ext);
    use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
    let meta = std::fs::metadata(&ext).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o666);
}
