//! The agent's xDS proxy between a real Envoy and devplane (stand-in istiod over TLS).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod xds_support;

use std::time::Duration;

use meshagent::xds::Health;
use meshagent_proto::type_url;
use meshagent_testkit::{DEADLINE, Devplane, json, signal, wait_for};
use xds_support::*;

async fn envoy_through_agent(delta: bool) {
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[]).await;
    let (envoy, _sds) = envoy_through(&dp, &agent, dir.path(), delta).await;

    // What the agent sent upstream: Istio's metadata, the token, and Envoy's node verbatim.
    let api = if delta { "delta" } else { "sotw" };
    let client = acked(&dp, api).await;
    assert_eq!(
        client["nacks"],
        json!({}),
        "Envoy rejected config: {client:#}"
    );
    assert_eq!(client["transport"], "tls");
    assert_eq!(client["headers"]["clusterid"], "Kubernetes", "{client:#}");
    assert_eq!(client["headers"]["team"], "payments", "{client:#}");
    assert_eq!(client["headers"]["x-trace-tag"], "e2e", "{client:#}");
    assert_eq!(client["token_fingerprint"], fingerprint(&agent.token));
    assert_eq!(
        client["headers"]["authorization"],
        fingerprint(&agent.token)
    );
    assert_eq!(client["identity"], "spiffe://cluster.local/ns/default/sa/a");
    assert_eq!(client["node_id"], NODE_ID);
    assert_eq!(client["node_metadata"]["NAME"], "a-5f7d");
    // Envoy's own types only: NDS is not intercepted here (DNS proxy off), so nobody asked.
    assert!(
        client["subscriptions"].get(type_url::NAME_TABLE).is_none(),
        "{client:#}"
    );

    // A mesh change pushed by devplane reaches Envoy.
    dp.write_mesh(&mesh_yaml(true));
    envoy
        .wait_for_cluster(
            "the pushed cluster for service c",
            DEADLINE,
            "outbound|8080||c.default.svc.cluster.local",
        )
        .await;
    assert_eq!(client_for(&dp, api).await["nacks"], json!({}));
    assert!(agent.metric("istio_agent_xds_proxy_requests") >= 4.0);
    assert!(agent.metric("istio_agent_xds_proxy_responses") >= 4.0);
    assert!(agent.metric("istio_agent_pilot_xds_recv_max") > 0.0);
    assert!(agent.metric("istio_agent_xds_proxy_upstream_recv_max") > 0.0);

    // Shutdown ends the server promptly even with Envoy still connected.
    agent.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), agent.handle.wait())
        .await
        .expect("xDS proxy stops within 10s of shutdown");
    drop(envoy);
}

#[tokio::test(flavor = "multi_thread")]
async fn sotw_envoy_gets_devplane_config_through_agent() {
    envoy_through_agent(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn delta_envoy_gets_devplane_config_through_agent() {
    envoy_through_agent(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn devplane_restart_envoy_reconverges_through_agent() {
    let mut dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[]).await;
    let (envoy, _sds) = envoy_through(&dp, &agent, dir.path(), true).await;
    acked(&dp, "delta").await;
    let terminations = || {
        agent.metric("istio_agent_istiod_connection_terminations{type=\"cancelled\"}")
            + agent.metric("istio_agent_istiod_connection_terminations{type=\"error\"}")
    };
    assert_eq!(terminations(), 0.0);
    let connected_before = envoy.stat("control_plane.connected_state").await;
    assert_eq!(connected_before, Some(1));

    dp.restart().await;
    // A fresh devplane knows nothing: the client it lists must come from a reconnect.
    let client = acked(&dp, "delta").await;
    assert_eq!(client["nacks"], json!({}));
    assert_eq!(client["node_id"], NODE_ID);
    assert!(terminations() >= 1.0, "{}", agent.registry.encode());
    // Envoy saw its stream end (not stuck on a dead upstream) and is connected again.
    wait_for("Envoy to reconnect", DEADLINE, || async {
        (envoy.stat("control_plane.connected_state").await == Some(1)).then_some(())
    })
    .await;
    // Config still flows after the reconnect.
    dp.write_mesh(&mesh_yaml(true));
    envoy
        .wait_for_cluster(
            "a push after the restart",
            DEADLINE,
            "outbound|8080||c.default.svc.cluster.local",
        )
        .await;
    assert!(!agent.shutdown.is_cancelled());
    assert!(
        std::fs::metadata(agent.handle.socket()).is_ok(),
        "agent still serving"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_mib_response_reaches_envoy_intact() {
    const SIZE: usize = 20 * 1024 * 1024;
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[]).await;
    let (envoy, _sds) = envoy_through(&dp, &agent, dir.path(), false).await;
    acked(&dp, "sotw").await;

    dp.set_resource(type_url::CLUSTER, "big", &big_cluster("big", SIZE))
        .await;
    envoy
        .wait_for_cluster(
            "Envoy to have the 20 MiB cluster",
            Duration::from_secs(60),
            "big",
        )
        .await;
    // Intact: Envoy's copy of the blob is byte-for-byte what devplane sent.
    let (status, body) = meshagent_testkit::http_get(
        envoy.admin,
        "/config_dump?resource=dynamic_active_clusters&name_regex=^big$",
    )
    .await
    .unwrap();
    assert_eq!(status, 200);
    let dump: serde_json::Value = serde_json::from_str(&body).unwrap();
    let blob = dump["configs"][0]["cluster"]["metadata"]["filter_metadata"]["test"]["blob"]
        .as_str()
        .unwrap_or_else(|| panic!("no blob in {}", &body[..body.len().min(2000)]));
    assert_eq!(blob.len(), SIZE);
    assert!(
        blob.bytes()
            .enumerate()
            .all(|(i, b)| b == b'a' + (i % 26) as u8)
    );
    let client = client_for(&dp, "sotw").await;
    assert_eq!(client["nacks"], json!({}), "Envoy refused the big response");
    assert!(agent.metric("istio_agent_xds_proxy_upstream_recv_max") > SIZE as f64);
}

#[tokio::test(flavor = "multi_thread")]
async fn nds_is_consumed_by_the_agent_and_malformed_tables_are_nacked() {
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(
        &dp,
        dir.path(),
        &[
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("PROXY_CONFIG_XDS_AGENT", "true"),
        ],
    )
    .await;
    let (envoy, _sds) = envoy_through(&dp, &agent, dir.path(), false).await;

    // The agent subscribed (after Envoy's LDS request), received, decoded and ACKed the table.
    let mut names = agent.handle.name_table();
    let table = wait_for("the NDS table in the agent", DEADLINE, || {
        let t = names.borrow_and_update().clone();
        async move { t }
    })
    .await;
    assert!(
        table.has_host("b.default.svc.cluster.local"),
        "{}",
        table.ndsz()
    );
    let client = wait_for("the NDS ACK at devplane", DEADLINE, || async {
        let c = client_for(&dp, "sotw").await;
        c["acked"].get(type_url::NAME_TABLE).is_some().then_some(c)
    })
    .await;
    assert_eq!(
        client["subscriptions"][type_url::NAME_TABLE]["wildcard"],
        true
    );

    // Envoy never sees the type: no NDS in its config, nothing about it in its log.
    let dump = envoy.admin_get("/config_dump").await.unwrap();
    assert!(!dump.contains("NameTable"));
    assert!(
        !envoy.proc.log_text().contains("NameTable"),
        "{}",
        envoy.proc.log_text()
    );

    // A malformed table is NACKed upstream and the last good table stays.
    dp.set_resource(type_url::NAME_TABLE, "", &[0x0a, 0x05, 0x01])
        .await;
    let nack = wait_for("the NDS NACK at devplane", DEADLINE, || async {
        let c = client_for(&dp, "sotw").await;
        c["nacks"].get(type_url::NAME_TABLE).cloned()
    })
    .await;
    assert!(
        nack["message"].as_str().unwrap().contains("NameTable"),
        "{nack}"
    );
    assert!(
        agent
            .handle
            .name_table()
            .borrow()
            .as_ref()
            .unwrap()
            .has_host("b.default.svc.cluster.local")
    );
    // Envoy's own types were never NACKed.
    let c = client_for(&dp, "sotw").await;
    assert_eq!(c["nacks"].as_object().unwrap().len(), 1, "{c:#}");

    // PCDS: caCertificatesPem (ProxyConfig field 34) reaches the published bundle.
    let pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    let mut pc = vec![0x92, 0x02, pem.len() as u8];
    pc.extend(pem.as_bytes());
    dp.set_resource(type_url::PROXY_CONFIG, "", &pc).await;
    let mut bundle = agent.handle.pcds_bundle();
    let got = wait_for("the PCDS bundle", DEADLINE, || {
        let b = bundle.borrow_and_update().clone();
        async move { (!b.is_empty()).then_some(b) }
    })
    .await;
    assert_eq!(got, vec![pem.to_owned()]);
    assert!(!envoy.proc.log_text().contains("ProxyConfig"));
}

#[tokio::test(flavor = "multi_thread")]
async fn health_is_replayed_after_lds_and_sent_on_change() {
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[]).await;
    // Set before any stream exists: must not be sent before LDS, and must be replayed after.
    agent
        .handle
        .set_health(Health::Unhealthy("probe failed".into()));
    let (_envoy, _sds) = envoy_through(&dp, &agent, dir.path(), false).await;
    // devplane records an error_detail on a SotW request as a NACK of that type (its Delta
    // server records only nonce-carrying ones, so this test speaks SotW).
    let health_nack = |want: &'static str| {
        let dp = &dp;
        async move {
            wait_for("the health report at devplane", DEADLINE, || async {
                let c = client_for(dp, "sotw").await;
                (c["nacks"][type_url::HEALTH_INFO]["message"] == want).then_some(c)
            })
            .await
        }
    };
    let c = health_nack("probe failed").await;
    assert_eq!(c["nacks"][type_url::HEALTH_INFO]["count"], 1);
    agent
        .handle
        .set_health(Health::Unhealthy("still failing".into()));
    health_nack("still failing").await;
    // Envoy's own types are untouched.
    let c = acked(&dp, "sotw").await;
    assert_eq!(c["nacks"].as_object().unwrap().len(), 1, "{c:#}");
}

fn sha256(b: &[u8]) -> Vec<u8> {
    aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, b)
        .as_ref()
        .to_vec()
}

/// The next response on a raw stream, decoded (panics on a stream end).
async fn next_response(
    stream: &mut tonic::Streaming<bytes::Bytes>,
    what: &str,
) -> (
    usize,
    meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryResponse,
) {
    use prost::Message;
    let raw = tokio::time::timeout(Duration::from_secs(60), stream.message())
        .await
        .unwrap_or_else(|_| panic!("no response within 60 s: {what}"))
        .unwrap_or_else(|s| panic!("stream failed waiting for {what}: {s}"))
        .unwrap_or_else(|| panic!("stream ended waiting for {what}"));
    (
        raw.len(),
        meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryResponse::decode(raw)
            .unwrap(),
    )
}

/// F9: a 100 MiB CDS response from devplane reaches the client on the agent's socket intact
/// (no agent-side limit on responses: istio#52815), and `xds_proxy_upstream_recv_max` shows
/// it. A raw gRPC client stands in for Envoy, whose own handling of 100 MiB is not the
/// agent's concern (the 20 MiB test above runs a real Envoy).
#[tokio::test(flavor = "multi_thread")]
async fn hundred_mib_response_reaches_the_client_intact() {
    const SIZE: usize = 100 * 1024 * 1024;
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[]).await;
    let (tx, mut stream, first) = cds_stream(&agent, "the first CDS response").await;
    tx.send(sotw_request(
        type_url::CLUSTER,
        vec![],
        Some((&first.version_info, &first.nonce)),
    ))
    .await
    .unwrap();

    let blob = big_cluster("huge", SIZE);
    let want = sha256(&blob);
    let started = tokio::time::Instant::now();
    dp.set_resource(type_url::CLUSTER, "huge", &blob).await;
    drop(blob);
    let (len, resp) = next_response(&mut stream, "the 100 MiB CDS push").await;
    eprintln!(
        "a {len}-byte CDS response through the agent in {:?}",
        started.elapsed()
    );
    assert!(len > SIZE, "{len}");
    let huge: Vec<_> = resp
        .resources
        .iter()
        .filter(|r| r.value.len() >= SIZE)
        .collect();
    assert_eq!(huge.len(), 1, "one huge cluster in the push");
    assert_eq!(sha256(&huge[0].value), want, "the cluster arrived intact");
    assert!(agent.metric("istio_agent_xds_proxy_upstream_recv_max") > SIZE as f64);
    assert_eq!(
        agent.metric("istio_agent_istiod_connection_terminations{type=\"error\"}"),
        0.0
    );
}

/// F9, the other way: a 20 MiB request (an Envoy subscribing to 10,000 long EDS names)
/// passes an agent whose `ISTIO_GPRC_MAXRECVMSGSIZE` is raised to 64 MiB — so no agent-side
/// failure — and is counted by `pilot_xds_recv_max`; devplane, like istiod (4 MiB
/// `ISTIO_GPRC_MAXRECVMSGSIZE`), refuses it, and the client sees istiod's clean error
/// (`ResourceExhausted`, grpc-go's message) rather than a hang or a reset. The agent keeps
/// serving: a new stream gets config.
#[tokio::test(flavor = "multi_thread")]
async fn twenty_mib_request_passes_the_agent_and_devplane_refuses_it_as_istiod() {
    const LIMIT: usize = 64 * 1024 * 1024;
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let limit = LIMIT.to_string();
    let agent = agent_for(&dp, dir.path(), &[("ISTIO_GPRC_MAXRECVMSGSIZE", &limit)]).await;
    let names: Vec<String> = (0..10_000)
        .map(|i| {
            format!(
                "outbound|80||svc-{i:05}.{}.svc.cluster.local",
                "n".repeat(2100)
            )
        })
        .collect();
    let big = sotw_request(type_url::ENDPOINT, names, None);
    let size = big.len();
    assert!(size > 20 * 1024 * 1024 && size < LIMIT, "{size}");
    let status = status_after(&agent, vec![big]).await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains(&format!(
            "grpc: received message larger than max ({} vs. 4194304)",
            size
        )),
        "{status:?}"
    );
    assert!(
        agent.metric("istio_agent_pilot_xds_recv_max") >= size as f64,
        "{}",
        agent.registry.encode()
    );
    assert_eq!(
        agent.metric("istio_agent_istiod_connection_terminations{type=\"error\"}"),
        1.0
    );
    // The agent serves on: a new stream gets config.
    serves_cds_on_a_new_stream(&agent).await;
}

/// Sends `requests` after a first CDS exchange on a fresh stream of `agent` and returns the
/// status the stream ends with.
async fn status_after(agent: &Agent, requests: Vec<bytes::Bytes>) -> tonic::Status {
    let (tx, mut stream, first) = cds_stream(agent, "the first CDS response").await;
    tx.send(sotw_request(
        type_url::CLUSTER,
        vec![],
        Some((&first.version_info, &first.nonce)),
    ))
    .await
    .unwrap();
    for r in requests {
        tx.send(r).await.unwrap();
    }
    loop {
        match tokio::time::timeout(Duration::from_secs(60), stream.message())
            .await
            .expect("the stream to end within 60 s")
        {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended with OK, not a refusal"),
            Err(s) => break s,
        }
    }
}

/// A new stream of `agent` gets a non-empty CDS response: the agent serves on.
async fn serves_cds_on_a_new_stream(agent: &Agent) {
    let (_, _, again) = cds_stream(agent, "CDS on a new stream").await;
    assert!(!again.resources.is_empty());
}

/// A new raw SotW stream of `agent` that has asked for CDS: its request sender, the stream,
/// and the first CDS response (`what` names it if it does not come).
async fn cds_stream(
    agent: &Agent,
    what: &str,
) -> (
    tokio::sync::mpsc::Sender<bytes::Bytes>,
    tonic::Streaming<bytes::Bytes>,
    meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryResponse,
) {
    let (tx, stream) = raw_sotw(agent.handle.socket()).await;
    let mut stream = stream.unwrap();
    tx.send(sotw_request(type_url::CLUSTER, vec![], None))
        .await
        .unwrap();
    let (_, first) = next_response(&mut stream, what).await;
    (tx, stream, first)
}

/// An EDS request naming `n` resources of about 100 bytes each, the last one `extra` bytes
/// longer (each name is under 128 bytes, so one more byte in it is one more in the message).
fn eds_request(n: usize, extra: usize) -> bytes::Bytes {
    let mut names: Vec<String> = (0..n)
        .map(|i| {
            format!(
                "outbound|80||svc-{i:07}.{}.svc.cluster.local",
                "n".repeat(60)
            )
        })
        .collect();
    if let Some(last) = names.last_mut() {
        last.push_str(&"x".repeat(extra));
    }
    sotw_request(type_url::ENDPOINT, names, None)
}

/// Istio's agent applies `ISTIO_GPRC_MAXRECVMSGSIZE` (default 4 MiB,
/// `pilot/pkg/features/tuning.go`) to its Envoy-facing server (`pilot/pkg/grpc/grpc.go`
/// `ServerOptions`), and gRPC-Go ends a stream whose request is larger with
/// `ResourceExhausted` "grpc: received message larger than max (<len> vs. <limit>)"
/// (`rpc_util.go`), which `pkg/istio-agent/xds_proxy.go` returns to Envoy. The same here:
/// by default a 5 MiB request is refused by the agent itself (istiod is never sent it), and
/// a configured limit is applied exactly (a request of the limit passes, one byte more is
/// refused). The agent serves on.
#[tokio::test(flavor = "multi_thread")]
async fn oversized_request_is_refused_by_the_agent_as_istio_refuses_it() {
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[]).await;
    let big = eds_request(50_000, 0);
    let size = big.len();
    assert!(size > 5 * 1024 * 1024 && size < 6 * 1024 * 1024, "{size}");
    let status = status_after(&agent, vec![big]).await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        format!("grpc: received message larger than max ({size} vs. 4194304)"),
        "{status:?}"
    );
    assert_eq!(
        agent.metric("istio_agent_envoy_connection_terminations{type=\"error\"}"),
        1.0,
        "{}",
        agent.registry.encode()
    );
    // Refused by the agent, not istiod.
    assert_eq!(
        agent.metric("istio_agent_istiod_connection_terminations{type=\"error\"}"),
        0.0
    );
    assert!(agent.metric("istio_agent_pilot_xds_recv_max") < size as f64);

    // A configured limit: a request of exactly the limit passes, one byte more does not.
    let at = eds_request(20, 0);
    let over = eds_request(20, 1);
    let (limit, olen) = (at.len(), over.len());
    assert_eq!(olen, limit + 1);
    let dir2 = tempfile::tempdir().unwrap();
    let limit_env = limit.to_string();
    let agent2 = agent_for(
        &dp,
        dir2.path(),
        &[("ISTIO_GPRC_MAXRECVMSGSIZE", &limit_env)],
    )
    .await;
    let status = status_after(&agent2, vec![at, over]).await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        format!("grpc: received message larger than max ({olen} vs. {limit})")
    );
    // Both agents serve on.
    for a in [&agent, &agent2] {
        serves_cds_on_a_new_stream(a).await;
    }
}

/// F10: a paused Envoy slows the upstream read instead of growing the agent's memory: while
/// devplane pushes ~80 MiB, the agent takes in only what fits its byte-bounded queue, the
/// hand-over slot and the stream in flight; everything arrives once Envoy resumes (on the same
/// stream, or on a new one if the pause outlasted `STALL` and the agent cut Envoy off).
#[tokio::test(flavor = "multi_thread")]
async fn paused_envoy_backpressures_upstream() {
    const SIZE: usize = 4 * 1024 * 1024;
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[]).await;
    let (envoy, _sds) = envoy_through(&dp, &agent, dir.path(), false).await;
    acked(&dp, "sotw").await;

    signal(envoy.proc.pid(), "-STOP");
    let responses = || agent.metric("istio_agent_xds_proxy_responses");
    let before = responses();
    let pushes = 6;
    for i in 0..pushes {
        // Each SotW CDS push carries every big cluster so far: 4, 8, ... 24 MiB.
        let name = format!("big{i}");
        dp.set_resource(type_url::CLUSTER, &name, &big_cluster(&name, SIZE))
            .await;
    }
    let sent = wait_for("devplane to have sent every push", DEADLINE, || async {
        let c = client_for(&dp, "sotw").await;
        let n = c["responses"].as_f64().unwrap();
        (n >= 3.0 + pushes as f64).then_some(n)
    })
    .await;
    tokio::time::sleep(SHORT).await;
    let taken = responses() - before;
    eprintln!("paused Envoy: devplane sent {sent} responses, the agent read {taken}");
    // At most: one in Envoy's slot, one being written by the HTTP/2 stream, one encoded ahead
    // by tonic, and what the pair's queue takes while it holds less than `MAX_QUEUED` (one
    // of these 4+ MiB pushes); the rest waits in istiod (HTTP/2 flow control), however much
    // it pushes.
    let queued = meshagent::xds::stream::MAX_QUEUED.div_ceil(SIZE) as f64;
    assert!(
        taken <= 3.0 + queued,
        "agent read {taken} responses while Envoy was paused (devplane sent {sent})"
    );

    signal(envoy.proc.pid(), "-CONT");
    envoy
        .wait_for_cluster(
            "the last big cluster in Envoy",
            Duration::from_secs(60),
            "big5",
        )
        .await;
    assert_eq!(client_for(&dp, "sotw").await["nacks"], json!({}));
}

/// An NDS interceptor whose first response waits until the test opens the gate (standing in
/// for a slow Wasm download); later ones finish at once.
struct GatedNds {
    gate: std::sync::Arc<tokio::sync::Semaphore>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl meshagent::xds::intercept::Interceptor for GatedNds {
    fn type_url(&self) -> &'static str {
        type_url::NAME_TABLE
    }

    fn on_first_lds(&self, api: meshagent::xds::Api) -> Vec<bytes::Bytes> {
        vec![meshagent::xds::intercept::request(
            api,
            type_url::NAME_TABLE,
            "",
            "",
            None,
        )]
    }

    fn on_response(
        &self,
        api: meshagent::xds::Api,
        _msg: bytes::Bytes,
        meta: meshagent::xds::intercept::Meta,
    ) -> meshagent::xds::intercept::Outcome {
        let first = {
            let mut seen = self.seen.lock().unwrap();
            seen.push(meta.version.clone());
            seen.len() == 1
        };
        let gate = self.gate.clone();
        Box::pin(async move {
            if first {
                let _ = gate.acquire().await;
            }
            Ok(meshagent::xds::intercept::Verdict::Consume(Some(
                meshagent::xds::intercept::ack(api, &meta),
            )))
        })
    }
}

/// Runs on a current-thread runtime, as the agent does: the proxy, the SDS server Envoy uses and
/// the test's own polling share one thread, so a pending interception that blocked anything
/// would stall the whole test.
#[tokio::test(flavor = "current_thread")]
async fn pending_interception_delays_no_other_type_and_keeps_its_order() {
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let nds = std::sync::Arc::new(GatedNds {
        gate: gate.clone(),
        seen: seen.clone(),
    });
    let agent = agent_for_with(&dp, dir.path(), &[], |o| o.interceptors.push(nds)).await;
    let (envoy, _sds) = envoy_through(&dp, &agent, dir.path(), false).await;
    let seen_n = |n: usize| {
        let seen = seen.clone();
        async move {
            wait_for("NDS responses at the interceptor", DEADLINE, || {
                let v = seen.lock().unwrap().clone();
                async move { (v.len() >= n).then_some(v) }
            })
            .await
        }
    };
    seen_n(1).await;

    // While the first NDS verdict is pending, a CDS push reaches Envoy and is ACKed.
    dp.set_resource(
        type_url::CLUSTER,
        "while-pending",
        &big_cluster("while-pending", 16),
    )
    .await;
    envoy
        .wait_for_cluster("the pushed cluster in Envoy", DEADLINE, "while-pending")
        .await;
    let c = client_for(&dp, "sotw").await;
    assert!(
        c["acked"].get(type_url::NAME_TABLE).is_none(),
        "the gated NDS response was ACKed before its verdict: {c:#}"
    );

    // A second NDS response finishes at once but is applied after the first.
    dp.set_resource(type_url::NAME_TABLE, "", &[]).await;
    let versions = seen_n(2).await;
    assert_ne!(versions[0], versions[1]);
    gate.add_permits(1);
    // The last ACK is for the newest response (out of order, the gated first one would end
    // up last).
    wait_for("the NDS ACKs in arrival order", DEADLINE, || async {
        let last = seen.lock().unwrap().last().cloned().unwrap();
        let c = client_for(&dp, "sotw").await;
        (c["acked"][type_url::NAME_TABLE] == last.as_str()).then_some(())
    })
    .await;
    // Nothing was NACKed along the way.
    let c = client_for(&dp, "sotw").await;
    assert_eq!(c["nacks"], json!({}), "{c:#}");
}
