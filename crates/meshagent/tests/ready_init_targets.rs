//! Readiness that names what Envoy waits for: a real Envoy held unready by an ECDS resource
//! it cannot get yet (a WasmPlugin whose module download hangs, so the agent holds the ECDS
//! response back; devplane's listeners wait for ECDS without a fetch timeout, as istiod's
//! do). The 503 body names the pending init target from Envoy's `/init_dump`, one log line
//! says it (not one per probe), and once the module arrives the pod turns ready.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

mod wasm_support;

use std::time::Duration;

use meshagent_testkit::{DEADLINE, Devplane, Sidecar, TwoWorkloads, http_get, wait_for};
use wasm_support::*;

#[tokio::test(flavor = "multi_thread")]
async fn not_ready_body_names_the_pending_ecds_resource() {
    let module = module();
    let sha = sha256_hex(&module);
    let srv = ModServer::start().await;
    srv.route("/plugin.wasm", Behaviour::Gate(module));
    let m = TwoWorkloads::new();
    let url = srv.url("/plugin.wasm");
    let plugin = format!(
        "{{name: my-plugin, namespace: app-ns, url: \"{url}\", sha256: \"{sha}\", failStrategy: FAIL_CLOSE}}"
    );
    let dp = Devplane::start(&format!("{}wasmPlugins:\n  - {plugin}\n", m.yaml(false))).await;
    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;

    wait_for("the agent to start the download", DEADLINE, || async {
        (srv.hits("/plugin.wasm") > 0).then_some(())
    })
    .await;
    // The download is held (at most 20 s by the module server): Envoy's listener waits for
    // its ECDS resource, and the readiness body says so, after Istio's reason.
    let body = wait_for(
        "a 503 naming ECDS app-ns.my-plugin",
        Duration::from_secs(15),
        || async {
            match http_get(a.status, "/healthz/ready").await {
                Ok((503, b)) if b.contains("waiting for ECDS app-ns.my-plugin") => Some(b),
                other => {
                    // Shown if the wait fails (test output is captured otherwise).
                    let dump = http_get(a.admin, "/init_dump").await;
                    eprintln!("readiness {other:?}; Envoy /init_dump {dump:?}");
                    None
                }
            }
        },
    )
    .await;
    // Istio's reason (whichever of its checks fails first), then what Envoy waits for, with
    // the listener that waits.
    let (istio, ours) = body.split_once("; waiting for ").unwrap();
    assert!(
        istio.starts_with("server.state or listener_manager.workers_started stat missing")
            || istio.starts_with("server is not live, current state is: INITIALIZING")
            || istio.starts_with("config not fully received"),
        "Istio's reason first: {body}"
    );
    assert!(
        ours.starts_with("ECDS app-ns.my-plugin (listener 127.0.0.1_"),
        "{body}"
    );
    // More probes; the targets are logged once, not per probe.
    for _ in 0..5 {
        let (code, _) = http_get(a.status, "/healthz/ready").await.unwrap();
        assert_eq!(code, 503);
    }
    let log = a.proc.log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("Envoy is not ready, its initialization is waiting for")
                && l.contains("ECDS app-ns.my-plugin")
        })
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(lines[0].contains("app-ns.my-plugin"), "{}", lines[0]);

    srv.release();
    a.wait_ready(DEADLINE).await;
    let (code, body) = http_get(a.status, "/healthz/ready").await.unwrap();
    assert_eq!((code, body.as_str()), (200, ""));
}

/// An EDS cluster whose endpoints never come (no fetch timeout, as istiod's clusters): Envoy's
/// cluster manager cannot finish, which `/init_dump` does not list; the body names the warming
/// cluster from Envoy's `cluster_manager.warming_clusters`, and the endpoints end the wait.
#[tokio::test(flavor = "multi_thread")]
async fn not_ready_body_names_a_warming_cluster() {
    use meshagent_proto::envoy::pb::envoy::config::cluster::v3 as cluster;
    use meshagent_proto::envoy::pb::envoy::config::core::v3 as core;
    use meshagent_proto::envoy::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
    use meshagent_proto::type_url;
    use prost::Message;

    let m = TwoWorkloads::new();
    let dp = Devplane::start(&m.yaml(false)).await;
    let ads = core::ConfigSource {
        config_source_specifier: Some(core::config_source::ConfigSourceSpecifier::Ads(
            core::AggregatedConfigSource {},
        )),
        initial_fetch_timeout: Some(meshagent_proto::google::protobuf::Duration {
            seconds: 0,
            nanos: 0,
        }),
        resource_api_version: core::ApiVersion::V3 as i32,
        ..Default::default()
    };
    let c = cluster::Cluster {
        name: "warm-forever".into(),
        connect_timeout: Some(meshagent_proto::google::protobuf::Duration {
            seconds: 1,
            nanos: 0,
        }),
        cluster_discovery_type: Some(cluster::cluster::ClusterDiscoveryType::Type(
            cluster::cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::cluster::EdsClusterConfig {
            eds_config: Some(ads),
            service_name: "warm-forever".into(),
        }),
        ..Default::default()
    };
    dp.set_resource(type_url::CLUSTER, "warm-forever", &c.encode_to_vec())
        .await;
    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    let body = wait_for("a 503 naming the warming cluster", DEADLINE, || async {
        match http_get(a.status, "/healthz/ready").await {
            Ok((503, b)) if b.contains("; waiting for 1 warming cluster (cluster manager") => {
                Some(b)
            }
            other => {
                let dump = http_get(a.admin, "/init_dump").await;
                eprintln!("readiness {other:?}; Envoy /init_dump {dump:?}");
                None
            }
        }
    })
    .await;
    assert!(!body.starts_with("; "), "Istio's reason first: {body}");

    let cla = ClusterLoadAssignment {
        cluster_name: "warm-forever".into(),
        ..Default::default()
    };
    dp.set_resource(type_url::ENDPOINT, "warm-forever", &cla.encode_to_vec())
        .await;
    a.wait_ready(DEADLINE).await;
}
