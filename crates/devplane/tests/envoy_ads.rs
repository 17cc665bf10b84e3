//! A real Envoy talks ADS directly to devplane over TLS (SotW and Delta): it receives the
//! generated clusters and listeners, ACKs them (no NACK), and receives mesh edits.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::SocketAddr;
use std::path::Path;

use meshagent_testkit::static_sds::StaticSds;
use meshagent_testkit::{
    DEADLINE, Devplane, Envoy, TwoWorkloads, Value, add_sds_cluster, direct_bootstrap, json,
    wait_for,
};

/// Workload certificates for Envoy from devplane's CA (for `default/a`), served by a static
/// SDS: the agent's SDS is not part of these tests.
async fn static_sds(dp: &Devplane, token: &str, dir: &Path) -> StaticSds {
    StaticSds::from_devplane(dp, token, dir).await
}

fn bootstrap(dp: &Devplane, token: &str, delta: bool, sds: &Path) -> Value {
    let mut b = direct_bootstrap(
        "sidecar~127.0.0.1~a-5f7d.default~default.svc.cluster.local",
        json!({"NAMESPACE": "default", "NAME": "a-5f7d", "CLUSTER_ID": "Kubernetes"}),
        dp.grpc_addr,
        &dp.root_cert_path(),
        token,
        delta,
    );
    // Generated config fetches secrets from `sds-grpc`, as in Istio's bootstrap.
    add_sds_cluster(&mut b, sds);
    b
}

async fn client_for(dp: &Devplane, api: &str) -> Value {
    wait_for("envoy's ADS stream at devplane", DEADLINE, || async {
        dp.clients()
            .await
            .into_iter()
            .find(|c| c["api"] == api && c["node_id"].as_str().is_some())
    })
    .await
}

async fn envoy_gets_config(delta: bool) {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let token = dp.token("default", "a", 3600).await;
    let dir = tempfile::tempdir().unwrap();
    let sds = static_sds(&dp, &token, dir.path()).await;
    let envoy = Envoy::start(bootstrap(&dp, &token, delta, &sds.socket), dir.path());

    let want_clusters = ["inbound|", "outbound|80||b.default.svc.cluster.local"];
    wait_for("clusters in Envoy's config_dump", DEADLINE, || async {
        let c = envoy.clusters().await;
        want_clusters
            .iter()
            .all(|w| c.iter().any(|n| n.starts_with(w)))
            .then_some(())
    })
    .await;
    let listeners = wait_for("two listeners in Envoy's config_dump", DEADLINE, || async {
        let l = envoy.listeners().await;
        (l.len() == 2).then_some(l)
    })
    .await;
    assert!(
        listeners
            .iter()
            .any(|l| l.starts_with("inbound_127.0.0.1_")),
        "{listeners:?}"
    );

    let api = if delta { "delta" } else { "sotw" };
    let client = client_for(&dp, api).await;
    assert_eq!(client["transport"], "tls");
    assert_eq!(client["identity"], "spiffe://cluster.local/ns/default/sa/a");
    assert_eq!(client["node_metadata"]["CLUSTER_ID"], "Kubernetes");
    // Envoy accepted everything it was sent: ACKs recorded for CDS and LDS, no NACK at all.
    let client = wait_for("CDS and LDS ACKs", DEADLINE, || async {
        let c = client_for(&dp, api).await;
        let acked = c["acked"].as_object().cloned().unwrap_or_default();
        (acked.keys().any(|k| k.ends_with("Cluster"))
            && acked.keys().any(|k| k.ends_with("Listener")))
        .then_some(c)
    })
    .await;
    assert_eq!(
        client["nacks"],
        json!({}),
        "Envoy rejected generated config"
    );

    // A mesh edit is pushed and reaches Envoy: a mesh-file change (SotW) or the same change
    // posted to `POST /debug/mesh` (Delta), which takes the file watch's path without its poll.
    if delta {
        let published = dp.post_mesh(&TwoWorkloads::new().yaml(true)).await;
        assert!(published > 0.0);
    } else {
        dp.write_mesh(&TwoWorkloads::new().yaml(true));
    }
    envoy
        .wait_for_cluster(
            "the pushed cluster for service c",
            DEADLINE,
            "outbound|8080||c.default.svc.cluster.local",
        )
        .await;
    let client = client_for(&dp, api).await;
    assert_eq!(client["nacks"], json!({}), "Envoy rejected pushed config");
    // The last response handed over per type is on record, with its time.
    let sent = client["sent"].as_object().cloned().unwrap_or_default();
    let cds = sent
        .iter()
        .find(|(k, _)| k.ends_with("Cluster"))
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("no CDS response on record: {client}"));
    assert!(cds["unix_time"].as_f64().unwrap_or(0.0) > 0.0, "{cds}");
    assert!(!cds["version"].as_str().unwrap_or("").is_empty(), "{cds}");
    // A mesh devplane cannot parse is refused with its reason, and nothing changes.
    let (status, body) =
        meshagent_testkit::http_with_body("POST", dp.debug_addr, "/debug/mesh", b"workloads: 7")
            .await
            .unwrap();
    assert_eq!(status, 400, "{body}");
    drop(envoy);
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_sotw_ads_over_tls() {
    envoy_gets_config(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_delta_ads_over_tls() {
    envoy_gets_config(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_without_token_is_refused() {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let dir = tempfile::tempdir().unwrap();
    let mut b = bootstrap(&dp, "not-a-jwt", false, &dir.path().join("no-sds"));
    b["dynamic_resources"]["ads_config"]["grpc_services"][0]
        .as_object_mut()
        .unwrap()
        .remove("initial_metadata");
    let envoy = Envoy::start(b, dir.path());
    // Envoy keeps retrying; devplane must never admit it.
    wait_for("Envoy to attempt ADS", DEADLINE, || async {
        envoy
            .stat("cluster.xds-grpc.upstream_rq_total")
            .await
            .filter(|n| *n >= 2)
    })
    .await;
    assert!(dp.clients().await.is_empty());
    let _: SocketAddr = envoy.admin;
}
