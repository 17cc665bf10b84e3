//! `ISTIO_META_ENABLE_SELF_DISCOVERY=true` end to end: devplane, `meshagent proxy sidecar` and
//! the real Envoy. The bootstrap's `local_cluster` is fed over ADS with the endpoints of the
//! proxy's own service, as istiod's EDS generator answers it (pilot/pkg/xds/eds.go
//! `parseClusterName`, PR istio/istio#60765): the first service selecting the proxy, its
//! endpoints filtered to the proxy's region, workload name and pod-template-hash. Istio's own
//! integration test checks the same thing: Envoy's `/clusters` lists `local_cluster` with
//! the expected hosts.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeSet;
use std::time::Duration;

use meshagent_testkit::{DEADLINE, Devplane, Sidecar, free_port, http_get, wait_for};
use serde_json::Value;

const READY: Duration = Duration::from_secs(40);

fn self_discovery_env() -> Vec<(&'static str, String)> {
    vec![("ISTIO_META_ENABLE_SELF_DISCOVERY", "true".to_owned())]
}

/// `local_cluster`'s hosts (`ip:port`) in Envoy's `/clusters?format=json`, or `None` while
/// Envoy does not list the cluster.
async fn local_cluster_hosts(sidecar: &Sidecar) -> Option<BTreeSet<String>> {
    let (code, body) = http_get(sidecar.admin, "/clusters?format=json")
        .await
        .ok()?;
    if code != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    let c = v["cluster_statuses"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == "local_cluster")?;
    Some(
        c["host_statuses"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|h| {
                let s = &h["address"]["socket_address"];
                format!(
                    "{}:{}",
                    s["address"].as_str().unwrap_or(""),
                    s["port_value"]
                )
            })
            .collect(),
    )
}

/// `cluster_manager.local_cluster_name` in Envoy's bootstrap as loaded (`/config_dump`).
async fn local_cluster_name(sidecar: &Sidecar) -> Option<String> {
    let (_, body) = http_get(sidecar.admin, "/config_dump").await.ok()?;
    let v: Value = serde_json::from_str(&body).ok()?;
    v["configs"]
        .as_array()?
        .iter()
        .find_map(|c| c["bootstrap"]["cluster_manager"]["local_cluster_name"].as_str())
        .map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread")]
async fn local_cluster_holds_the_proxys_own_service_endpoints() {
    let ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
    let [app, a1, a2, a3, a4] = [ports[0], ports[1], ports[2], ports[3], ports[4]];
    // Service `a` selects five replicas-like workloads. Only those in the proxy's region
    // (r1), with its workload name (`a`) and its pod-template-hash (`h1`) are its local
    // cluster: a (itself) and a-z2 (another zone of the same region).
    let mesh = format!(
        r#"
workloads:
  - name: a
    serviceAccount: a
    address: 127.0.0.1
    locality: r1/z1/s1
    labels: {{pod-template-hash: h1}}
    ports: [{{name: http, port: {app}, inboundPort: {a1}}}]
  - name: a-z2
    serviceAccount: a
    address: 127.0.0.2
    locality: r1/z2/s1
    labels: {{service.istio.io/workload-name: a, pod-template-hash: h1}}
    ports: [{{name: http, port: {app}, inboundPort: {a2}}}]
  - name: a-other-region
    serviceAccount: a
    address: 127.0.0.3
    locality: r2/z1/s1
    labels: {{service.istio.io/workload-name: a, pod-template-hash: h1}}
    ports: [{{name: http, port: {app}, inboundPort: {a3}}}]
  - name: a-old-template
    serviceAccount: a
    address: 127.0.0.4
    locality: r1/z1/s1
    labels: {{service.istio.io/workload-name: a, pod-template-hash: h0}}
    ports: [{{name: http, port: {app}, inboundPort: {a4}}}]
  - name: canary
    serviceAccount: a
    address: 127.0.0.5
    locality: r1/z1/s1
    labels: {{pod-template-hash: h1}}
    ports: [{{name: http, port: {app}, inboundPort: {a4}}}]
services:
  - name: a
    selector: [a, a-z2, a-other-region, a-old-template, canary]
    ports: [{{port: 80, targetPort: {app}}}]
  - name: a-alias
    selector: [a]
    ports: [{{port: 81, targetPort: {app}}}]
"#
    );
    let dp = Devplane::start(&mesh).await;
    let mut a = Sidecar::start(&dp, "a", "default", "a", &self_discovery_env()).await;
    a.wait_ready(READY).await;

    let want: BTreeSet<String> = [format!("127.0.0.1:{a1}"), format!("127.0.0.2:{a2}")].into();
    let got = wait_for(
        "local_cluster with a's local endpoints",
        DEADLINE,
        || async { local_cluster_hosts(&a).await.filter(|h| *h == want) },
    )
    .await;
    assert_eq!(got, want);
    assert_eq!(
        local_cluster_name(&a).await.as_deref(),
        Some("local_cluster")
    );

    // A new replica in a third zone of the region: istiod pushes the local service's new
    // endpoints (pilot/pkg/xds/eds.go `affectedService`), and Envoy's local_cluster follows.
    let a5 = free_port();
    let replica = format!(
        "  - name: a-z3\n    serviceAccount: a\n    address: 127.0.0.6\n    locality: r1/z3/s1\n    labels: {{service.istio.io/workload-name: a, pod-template-hash: h1}}\n    ports: [{{name: http, port: {app}, inboundPort: {a5}}}]\nservices:"
    );
    let edited = mesh.replacen("services:", &replica, 1).replacen(
        "selector: [a, a-z2,",
        "selector: [a, a-z2, a-z3,",
        1,
    );
    dp.write_mesh(&edited);
    let mut want = want;
    want.insert(format!("127.0.0.6:{a5}"));
    let got = wait_for(
        "local_cluster with the new zone's replica",
        DEADLINE,
        || async { local_cluster_hosts(&a).await.filter(|h| *h == want) },
    )
    .await;
    assert_eq!(got, want);
}

/// A proxy no service selects gets an empty `local_cluster` (istiod answers every watched
/// EDS name, empty when there is no service), and Envoy is ready: the static EDS cluster does
/// not hold Envoy's initialization.
#[tokio::test(flavor = "multi_thread")]
async fn local_cluster_is_empty_without_a_service_and_envoy_is_ready() {
    let (app, inbound) = (free_port(), free_port());
    let mesh = format!(
        r#"
workloads:
  - name: lonely
    serviceAccount: lonely
    ports: [{{name: http, port: {app}, inboundPort: {inbound}}}]
"#
    );
    let dp = Devplane::start(&mesh).await;
    let mut s = Sidecar::start(&dp, "lonely", "default", "lonely", &self_discovery_env()).await;
    s.wait_ready(READY).await;
    let hosts = wait_for("local_cluster listed by Envoy", DEADLINE, || async {
        local_cluster_hosts(&s).await
    })
    .await;
    assert!(hosts.is_empty(), "{hosts:?}");
}
