//! Agents against the real istiod code path: istiod-box (`compat/istiod-box`, Istio's config
//! generation, CA and authenticators from the pinned istio.io/istio module) on loopback, with
//! meshagent and with the real pilot-agent (`make pilot-agent`), each as a pod runs it with a
//! real Envoy. Both must get their workload certificate from Istio's CA with the token
//! istiod-box issued, and load the listeners and clusters istiod generated from the YAML.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, dynamic_names, envoy_config_dump, envoy_counter, get_with_host,
    mesh_with_free_ports, start_agent, two_workloads, wait_for_envoy_cluster, workload_a,
};
use meshagent_testkit::{DEADLINE, free_port, http_get, json, wait_for};

const READY: Duration = Duration::from_secs(60);

/// Service b in namespace ns, its endpoint, and an external ServiceEntry.
const REST: &str = r#"
apiVersion: v1
kind: Namespace
metadata:
  name: ns
---
apiVersion: v1
kind: Service
metadata:
  name: b
  namespace: ns
spec:
  clusterIP: 10.96.0.11
  selector:
    app: b
  ports:
  - name: http
    port: 80
    targetPort: 8080
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: b-1
  namespace: ns
  labels:
    kubernetes.io/service-name: b
addressType: IPv4
endpoints:
- addresses:
  - 127.0.0.3
  conditions:
    ready: true
ports:
- name: http
  port: 8080
  protocol: TCP
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata:
  name: external
  namespace: ns
spec:
  hosts:
  - api.example.com
  location: MESH_EXTERNAL
  ports:
  - number: 443
    name: tls
    protocol: TLS
  resolution: DNS
"#;

/// Workload a (testkit's) and the rest.
fn config() -> String {
    format!("{}---\n{REST}", workload_a())
}

const SERVICE_C: &str = r#"
apiVersion: v1
kind: Service
metadata:
  name: c
  namespace: ns
spec:
  clusterIP: 10.96.0.12
  ports:
  - name: http
    port: 8080
"#;

async fn sidecar_against_istiod_box(kind: AgentKind) {
    let istiod = IstiodBox::start_with(&config(), Some(&mesh_with_free_ports()), &[]).await;
    let pod = PodSpec::new("a", "127.0.0.1");
    let mut sidecar = start_agent(&istiod, kind, &pod).await;
    sidecar.wait_ready(READY).await;

    // The workload certificate from Istio's CA, for the identity in the token.
    let ids = wait_for(
        "Envoy to have the workload certificate",
        DEADLINE,
        || async {
            let ids = sidecar.spiffe_ids().await;
            (!ids.is_empty()).then_some(ids)
        },
    )
    .await;
    assert_eq!(ids, vec!["spiffe://cluster.local/ns/default/sa/a"]);

    // istiod's listeners and clusters for this proxy, loaded by upstream Envoy.
    wait_for_envoy_cluster(&sidecar, "outbound|80||b.ns.svc.cluster.local", DEADLINE).await;
    let dump = envoy_config_dump(&sidecar).await.unwrap();
    let (clusters, listeners) = dynamic_names(&dump);
    for c in [
        "outbound|443||api.example.com",
        "outbound|80||a.default.svc.cluster.local",
        "inbound|8080||",
        "BlackHoleCluster",
        "PassthroughCluster",
    ] {
        assert!(clusters.iter().any(|n| n == c), "no {c} in {clusters:?}");
    }
    for l in ["virtualOutbound", "virtualInbound", "0.0.0.0_80"] {
        assert!(listeners.iter().any(|n| n == l), "no {l} in {listeners:?}");
    }
    for counter in [
        "cluster_manager.cds.update_rejected",
        "listener_manager.lds.update_rejected",
    ] {
        assert_eq!(envoy_counter(&sidecar, counter).await, 0, "{counter}");
    }
    if kind == AgentKind::Meshagent {
        // The extension check read Envoy's list (upstream Envoy lacks Istio's four), and
        // with istiod configured not to emit them nothing is rejected: no error line.
        let xdsz = wait_for(
            "the extension check's result in /debug/xdsz",
            DEADLINE,
            || async {
                let (_, body) = http_get(sidecar.status, "/debug/xdsz").await.ok()?;
                let v: serde_json::Value = serde_json::from_str(&body).ok()?;
                (!v["envoy"].is_null()).then_some(v)
            },
        )
        .await;
        assert_eq!(
            xdsz["envoy"]["missingIstioExtensions"]
                .as_array()
                .map(Vec::len),
            Some(4),
            "{xdsz}"
        );
        assert_eq!(xdsz["rejected"], json!([]), "{xdsz}");
        let log = sidecar.proc.log_text();
        assert!(
            error_lines(&log, EXTENSION_ERROR).is_empty(),
            "no extension error expected:\n{log}"
        );
        assert!(
            log.contains("this Envoy build lacks Istio's extensions"),
            "{log}"
        );
    }

    // istiod sees the proxy (its own debug endpoints).
    let proxies = wait_for("istiod to list the proxy", DEADLINE, || async {
        let p = istiod.connected_proxies().await;
        p.iter()
            .any(|p| p.starts_with("a-5f7d9.default"))
            .then_some(p)
    })
    .await;
    let proxy_id = proxies
        .iter()
        .find(|p| p.starts_with("a-5f7d9.default"))
        .unwrap();
    let cd = istiod
        .debug_json(&format!("/debug/config_dump?proxyID={proxy_id}"))
        .await;
    assert!(cd["configs"].is_array(), "{cd}");

    // A live change is pushed; so is its removal.
    istiod.apply(SERVICE_C).await;
    wait_for_envoy_cluster(&sidecar, "outbound|8080||c.ns.svc.cluster.local", DEADLINE).await;
    istiod.delete(SERVICE_C).await;
    wait_for(
        "Envoy to drop the deleted service's cluster",
        DEADLINE,
        || async {
            let dump = envoy_config_dump(&sidecar).await?;
            (!dynamic_names(&dump)
                .0
                .iter()
                .any(|c| c == "outbound|8080||c.ns.svc.cluster.local"))
            .then_some(())
        },
    )
    .await;
    assert_eq!(
        envoy_counter(&sidecar, "cluster_manager.cds.update_rejected").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn meshagent_against_istiod_box() {
    sidecar_against_istiod_box(AgentKind::Meshagent).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pilot_agent_against_istiod_box() {
    sidecar_against_istiod_box(AgentKind::PilotAgent).await;
}

/// The one ERROR line meshagent logs when Envoy rejects istiod's configuration for lack of
/// Istio's extensions (`envoy/extensions.rs`).
const EXTENSION_ERROR: &str = "Envoy rejects istiod's configuration: it has no implementation of";

/// Lines of `log` at level error (Istio's text format: time, tab, level, tab).
fn error_lines<'a>(log: &'a str, containing: &str) -> Vec<&'a str> {
    log.lines()
        .filter(|l| l.contains("\terror\t") && l.contains(containing))
        .collect()
}

/// Why istiod-box changes istiod's defaults: with `--istio-extensions` (istiod as installed)
/// the config names Istio-proxy extensions (metadata exchange on clusters and listeners,
/// istio.alpn, istio.stats) that upstream Envoy does not have, and Envoy rejects it.
/// meshagent says so: one ERROR line naming the missing extensions and the fix, and a 503
/// readiness body naming the NACKed type, Envoy's message and the extension. pilot-agent in
/// the same state answers 503 too (only the body differs).
#[tokio::test(flavor = "multi_thread")]
async fn upstream_envoy_rejects_istiods_default_extensions() {
    let istiod = IstiodBox::start_with(
        &config(),
        Some(&mesh_with_free_ports()),
        &["--istio-extensions"],
    )
    .await;
    let pod = PodSpec::new("a", "127.0.0.1");
    let sidecar = start_agent(&istiod, AgentKind::Meshagent, &pod).await;
    wait_for("Envoy to reject istiod's clusters", DEADLINE, || async {
        (envoy_counter(&sidecar, "cluster_manager.cds.update_rejected").await > 0).then_some(())
    })
    .await;
    let log = sidecar.proc.log_text();
    let rejection = log
        .lines()
        .find(|l| {
            l.contains("Didn't find a registered implementation for 'istio.metadata_exchange'")
        })
        .unwrap_or_else(|| {
            panic!("Envoy's rejection should name the metadata exchange filter:\n{log}")
        });
    eprintln!("upstream Envoy on istiod's defaults: {rejection}");

    // Readiness: Istio's verdict (503), the NACKs of both CDS and LDS named with the
    // extension Envoy lacks.
    let body = wait_for(
        "readiness to name the CDS and LDS rejections",
        DEADLINE,
        || async {
            match http_get(sidecar.status, "/healthz/ready").await {
                Ok((503, b))
                    if b.contains("Envoy rejected (NACK) CDS: ")
                        && b.contains("Envoy rejected (NACK) LDS: ") =>
                {
                    Some(b)
                }
                _ => None,
            }
        },
    )
    .await;
    eprintln!("meshagent readiness: {body}");
    for want in [
        "config received from XDS server, but was rejected",
        "missing extensions: 'istio.metadata_exchange' (type URL 'envoy.tcp.metadataexchange.config.MetadataExchange')",
        "outbound|80||b.ns.svc.cluster.local",
    ] {
        assert!(
            body.contains(want),
            "{want:?} not in the readiness body: {body}"
        );
    }

    // The one ERROR line, after both rejections have arrived: exactly once.
    let errors = wait_for("the extension error line", DEADLINE, || {
        let log = sidecar.proc.log_text();
        async move {
            let n = error_lines(&log, EXTENSION_ERROR)
                .into_iter()
                .map(str::to_owned)
                .collect::<Vec<_>>();
            (!n.is_empty()).then_some(n)
        }
    })
    .await;
    assert_eq!(errors.len(), 1, "{errors:#?}");
    eprintln!("meshagent: {}", errors[0]);
    for want in [
        "'istio.metadata_exchange' (type URL 'envoy.tcp.metadataexchange.config.MetadataExchange')",
        "This Envoy 1.40.0 lacks Istio's extensions",
        "istio.metadata_exchange (io.istio.http.peer_metadata.Config)",
        "istio.alpn (istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig)",
        "istio.stats (stats.PluginConfig)",
        "proxyv2",
        "PILOT_ENABLE_METADATA_EXCHANGE=false",
        "PILOT_ENABLE_ALPN_FILTER=false",
        "meshConfig.defaultProviders.metrics",
    ] {
        assert!(errors[0].contains(want), "{want:?} not in {}", errors[0]);
    }
    // /debug/xdsz carries the same.
    let (code, xdsz) = http_get(sidecar.status, "/debug/xdsz").await.unwrap();
    assert_eq!(code, 200, "{xdsz}");
    let xdsz: serde_json::Value = serde_json::from_str(&xdsz).unwrap();
    assert_eq!(
        xdsz["envoy"]["missingIstioExtensions"]
            .as_array()
            .map(Vec::len),
        Some(4),
        "{xdsz}"
    );
    assert!(
        xdsz["rejected"][0]["missingExtensions"][0]["name"] == "istio.metadata_exchange",
        "{xdsz}"
    );
    drop(sidecar);

    // pilot-agent in the same state: not ready either.
    let pilot = start_agent(&istiod, AgentKind::PilotAgent, &pod).await;
    wait_for(
        "pilot-agent's Envoy to reject istiod's clusters",
        DEADLINE,
        || async {
            (envoy_counter(&pilot, "cluster_manager.cds.update_rejected").await > 0).then_some(())
        },
    )
    .await;
    let (code, body) = http_get(pilot.status, "/healthz/ready").await.unwrap();
    eprintln!("pilot-agent readiness: {code} {body}");
    assert_eq!(code, 503, "{body}");
}

// === a mesh: A calls B over mTLS with config from istiod ===

/// Two pods on their own loopback addresses (`127.0.<net>.2` for a, `.3` for b, so istiod maps
/// each proxy to its pod by IP), service b on port `port`, and Sidecar resources that make
/// istiod bind A's outbound listener and B's inbound listener to the pod addresses
/// (`captureMode: NONE`: no iptables here) with B's inbound forwarding to B's app.
async fn mesh_through_istiod_box(net: u8, a_kind: AgentKind, b_kind: AgentKind) {
    // B's app listens before anything else starts: a port picked free and bound later can be
    // taken meanwhile by istiod-box's or another test's ephemeral ports.
    let l = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let (port, b_app) = (free_port(), l.local_addr().unwrap().port());
    let istiod = IstiodBox::start_with(
        &two_workloads(net, port, b_app),
        Some(&mesh_with_free_ports()),
        &[],
    )
    .await;
    tokio::spawn(meshagent_testkit::identity_app("b", l, Duration::ZERO));
    let (a_ip, b_ip) = (format!("127.0.{net}.2"), format!("127.0.{net}.3"));
    let mut a = start_agent(&istiod, a_kind, &PodSpec::new("a", &a_ip)).await;
    let mut b = start_agent(&istiod, b_kind, &PodSpec::new("b", &b_ip)).await;
    a.wait_ready(READY).await;
    b.wait_ready(READY).await;

    let a_out: std::net::SocketAddr = format!("{a_ip}:{port}").parse().unwrap();
    // The Host header names service b, as A's app would: istiod routes by it (anything else
    // takes the allow-any route to PassthroughCluster).
    let host = format!("b.default.svc.cluster.local:{port}");
    let body = wait_for("A → B through both sidecars", DEADLINE, || async {
        get_with_host(a_out, &host)
            .await
            .filter(|r| r.starts_with("HTTP/1.1 200"))
    })
    .await;
    // B's Envoy saw A's workload certificate (istiod's inbound HCM forwards the client
    // certificate's URI in x-forwarded-client-cert): mTLS with identities from Istio's CA.
    assert!(
        body.contains("hello from b; caller identity: spiffe://cluster.local/ns/default/sa/a"),
        "{body}"
    );
    for (s, id) in [(&a, "a"), (&b, "b")] {
        assert_eq!(
            s.spiffe_ids().await,
            vec![format!("spiffe://cluster.local/ns/default/sa/{id}")]
        );
        for counter in [
            "cluster_manager.cds.update_rejected",
            "listener_manager.lds.update_rejected",
        ] {
            assert_eq!(envoy_counter(s, counter).await, 0, "{id}: {counter}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn mesh_meshagent_to_meshagent() {
    mesh_through_istiod_box(11, AgentKind::Meshagent, AgentKind::Meshagent).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn mesh_pilot_agent_to_pilot_agent() {
    mesh_through_istiod_box(12, AgentKind::PilotAgent, AgentKind::PilotAgent).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn mesh_meshagent_to_pilot_agent() {
    mesh_through_istiod_box(13, AgentKind::Meshagent, AgentKind::PilotAgent).await;
}
