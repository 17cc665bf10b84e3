//! Wasm end to end: devplane serves WasmPlugins over ECDS with remote code (HTTP and OCI),
//! `meshagent proxy sidecar` fetches and localises them, and a real Envoy runs the
//! proxy-wasm module (assembled from WAT by wabt), so A → B responses carry its header.
//! Failures give Envoy Istio's RBAC stand-ins (403 fail-closed, plain 200 fail-open), never
//! a stuck listener; a slow module server holds back only ECDS.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

mod wasm_support;

use std::time::Duration;

use meshagent_proto::type_url;
use meshagent_testkit::{
    DEADLINE, Devplane, Sidecar, TwoWorkloads, http_get, identity_app, wait_for,
};
use wasm_support::*;

const READY: Duration = Duration::from_secs(40);
const HEADER: &str = "x-wasm-meshagent: loaded";

fn mesh(m: &TwoWorkloads, plugin: &str) -> String {
    format!("{}wasmPlugins:\n  - {plugin}\n", m.yaml(false))
}

async fn app(name: &'static str, port: u16) {
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(identity_app(name, l, Duration::ZERO));
}

async fn agent_metric(s: &Sidecar, series: &str) -> f64 {
    match http_get(s.status, "/stats/prometheus").await {
        Ok((200, body)) => metric(&body, series),
        _ => 0.0,
    }
}

fn has_header(resp: &str) -> bool {
    resp.to_ascii_lowercase().contains(HEADER)
}

/// Waits until A → B answers `status` with (or without) the module's header.
async fn wait_response(what: &str, m: &TwoWorkloads, status: u16, header: bool, logs: &[&Sidecar]) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let r = raw_get(m.a_to_b, "/").await;
        if status_of(&r) == status && has_header(&r) == header {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            for s in logs {
                s.proc.print_log();
            }
            panic!("{what}: last response:\n{r}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_runs_modules_fetched_over_http_and_oci_and_fallbacks() {
    let module = module();
    let sha = sha256_hex(&module);
    let srv = ModServer::start().await;
    srv.route("/hdr.wasm", Behaviour::Serve(module.clone()));
    let reg = OciRegistry::start().await;
    let layouts = tempfile::tempdir().unwrap();
    let compat = oci_layout(&layouts.path().join("compat"), "v1", &module, true);
    let digest = reg.push(&compat, "v1", "wasm/hdr", false).await;

    let m = TwoWorkloads::new();
    let plugin = |url: &str, sha: &str, fail: &str, version: &str| {
        format!(
            "{{name: hdr, url: \"{url}\", sha256: \"{sha}\", failStrategy: {fail}, resourceVersion: \"{version}\"}}"
        )
    };
    let dp = Devplane::start(&mesh(
        &m,
        &plugin(&srv.url("/hdr.wasm"), &sha, "FAIL_CLOSE", "1"),
    ))
    .await;
    app("a", m.a_app).await;
    app("b", m.b_app).await;
    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    let mut b = Sidecar::start(&dp, "b", "default", "b", &[]).await;
    a.wait_ready(READY).await;
    b.wait_ready(READY).await;

    // HTTP: fetched once by the agent, run by Envoy.
    wait_response("module over HTTP", &m, 200, true, &[&a]).await;
    assert_eq!(srv.hits("/hdr.wasm"), 1);
    let success = "istio_agent_wasm_remote_fetch_count{result=\"success\"}";
    assert_eq!(agent_metric(&a, success).await, 1.0);
    // The module sits in Istio's cache layout under the agent's working directory.
    let cached = a
        .cwd
        .path()
        .join("var/lib/istio/data")
        .join(sha256_hex(srv.url("/hdr.wasm").as_bytes()))
        .join(format!("{sha}.wasm"));
    assert_eq!(std::fs::read(&cached).unwrap(), module);

    // A new WasmPlugin version (IfNotPresent): converted again from the cache, no request.
    dp.write_mesh(&mesh(
        &m,
        &plugin(&srv.url("/hdr.wasm"), &sha, "FAIL_CLOSE", "2"),
    ));
    let conversions = "istio_agent_wasm_config_conversion_count{result=\"success\"}";
    wait_for("second conversion", DEADLINE, || async {
        (agent_metric(&a, conversions).await >= 2.0).then_some(())
    })
    .await;
    assert_eq!(
        srv.hits("/hdr.wasm"),
        1,
        "the second load came from the cache"
    );
    wait_response("module from cache", &m, 200, true, &[&a]).await;

    // OCI: the same module as an image in a real registry.
    let oci = format!("oci://{}/wasm/hdr:v1", reg.addr);
    dp.write_mesh(&mesh(&m, &plugin(&oci, &digest, "FAIL_CLOSE", "3")));
    wait_for("OCI fetch", DEADLINE, || async {
        (agent_metric(&a, success).await >= 2.0).then_some(())
    })
    .await;
    wait_response("module over OCI", &m, 200, true, &[&a]).await;

    // 404, fail-closed: Envoy gets the deny-all RBAC filter (403), not a stuck listener.
    let missing = srv.url("/missing.wasm");
    dp.write_mesh(&mesh(&m, &plugin(&missing, "", "FAIL_CLOSE", "4")));
    wait_response("fail-closed stand-in", &m, 403, false, &[&a]).await;
    // Fail-open: allow-all, so plain responses without the module.
    dp.write_mesh(&mesh(&m, &plugin(&missing, "", "FAIL_OPEN", "5")));
    wait_response("fail-open stand-in", &m, 200, false, &[&a]).await;
    assert!(
        agent_metric(
            &a,
            "istio_agent_wasm_remote_fetch_count{result=\"download_failure\"}"
        )
        .await
            >= 2.0
    );

    // Nothing was NACKed: failures are fallbacks, not rejections.
    let acks = dp.acks().await;
    let ca = acks
        .iter()
        .find(|c| c["node_id"].as_str().is_some_and(|n| n.contains("a-5f7d9")))
        .unwrap();
    assert!(
        ca["nacks"].get(type_url::EXTENSION_CONFIG).is_none(),
        "{ca}"
    );
    assert!(
        ca["acked"].get(type_url::EXTENSION_CONFIG).is_some(),
        "{ca}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slow_module_server_delays_only_ecds() {
    let module = module();
    let sha = sha256_hex(&module);
    let srv = ModServer::start().await;
    srv.route("/slow.wasm", Behaviour::Gate(module.clone()));
    let m = TwoWorkloads::new();
    let url = srv.url("/slow.wasm");
    let plugin = format!("{{name: hdr, url: \"{url}\", sha256: \"{sha}\"}}");
    let dp = Devplane::start(&mesh(&m, &plugin)).await;
    app("a", m.a_app).await;
    app("b", m.b_app).await;
    let mut b = Sidecar::start(&dp, "b", "default", "b", &[]).await;
    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    b.wait_ready(READY).await;

    wait_for("the agent to start downloading", DEADLINE, || async {
        (srv.hits("/slow.wasm") > 0).then_some(())
    })
    .await;
    // While the module download hangs: CDS and LDS are ACKed, SDS served the workload
    // certificate to Envoy, and the status port answers.
    let acked = wait_for("CDS and LDS ACKs during the download", DEADLINE, || async {
        let acks = dp.acks().await;
        acks.into_iter().find(|c| {
            c["node_id"].as_str().is_some_and(|n| n.contains("a-5f7d9"))
                && c["acked"].get(type_url::CLUSTER).is_some()
                && c["acked"].get(type_url::LISTENER).is_some()
        })
    })
    .await;
    // A CDS push during the download is forwarded and ACKed (a new service c).
    let cds_before = acked["acked"][type_url::CLUSTER].clone();
    dp.write_mesh(&format!("{}wasmPlugins:\n  - {plugin}\n", m.yaml(true)));
    wait_for(
        "the CDS push ACKed during the download",
        DEADLINE,
        || async {
            let acks = dp.acks().await;
            acks.into_iter()
                .find(|c| c["node_id"].as_str().is_some_and(|n| n.contains("a-5f7d9")))
                .filter(|c| c["acked"][type_url::CLUSTER] != cds_before)
        },
    )
    .await;
    let ids = wait_for("SDS during the download", DEADLINE, || async {
        let ids = a.spiffe_ids().await;
        (!ids.is_empty()).then_some(ids)
    })
    .await;
    assert_eq!(ids, vec!["spiffe://cluster.local/ns/default/sa/a"]);
    let (code, _) = http_get(a.status, "/healthz/ready").await.unwrap();
    assert!(code == 200 || code == 503, "{code}");
    let (code, _) = http_get(a.status, "/stats/prometheus").await.unwrap();
    assert_eq!(code, 200);
    // ECDS is still held back: not ACKed, the download still pending.
    let acks = dp.acks().await;
    let ca = acks
        .iter()
        .find(|c| c["node_id"].as_str().is_some_and(|n| n.contains("a-5f7d9")))
        .unwrap();
    assert!(
        ca["acked"].get(type_url::EXTENSION_CONFIG).is_none(),
        "{ca} / {acked}"
    );
    assert_eq!(srv.hits("/slow.wasm"), 1);

    srv.release();
    a.wait_ready(READY).await;
    wait_response("module after the slow download", &m, 200, true, &[&a]).await;
}

/// No docker config at all (HOME an empty directory, no DOCKER_CONFIG), as in every pod:
/// the OCI module is pulled anonymously and Envoy runs it.
#[tokio::test(flavor = "multi_thread")]
async fn c2_oci_module_with_home_an_empty_directory() {
    let module = module();
    let reg = OciRegistry::start().await;
    let layouts = tempfile::tempdir().unwrap();
    let compat = oci_layout(&layouts.path().join("compat"), "v1", &module, true);
    let digest = reg.push(&compat, "v1", "wasm/hdr", false).await;
    let m = TwoWorkloads::new();
    let oci = format!("oci://{}/wasm/hdr:v1", reg.addr);
    let plugin =
        format!("{{name: hdr, url: \"{oci}\", sha256: \"{digest}\", failStrategy: FAIL_CLOSE}}");
    let dp = Devplane::start(&mesh(&m, &plugin)).await;
    app("a", m.a_app).await;
    app("b", m.b_app).await;
    let home = tempfile::tempdir().unwrap();
    let env = [("HOME", home.path().display().to_string())];
    let mut a = Sidecar::start(&dp, "a", "default", "a", &env).await;
    let mut b = Sidecar::start(&dp, "b", "default", "b", &env).await;
    a.wait_ready(READY).await;
    b.wait_ready(READY).await;
    wait_response("OCI module with an empty HOME", &m, 200, true, &[&a]).await;
    let success = "istio_agent_wasm_remote_fetch_count{result=\"success\"}";
    assert_eq!(agent_metric(&a, success).await, 1.0);
    assert!(!a.proc.log_text().contains("docker config"));
}

/// A module server that stalls a 404 body cannot hold ECDS or readiness: the fetch fails at
/// once (fail-closed: 403). A plugin whose download hangs (200, body stalled; istiod's
/// `http_uri.timeout` is 30 s) is replaced by the next push at once, not after the timeout.
#[tokio::test(flavor = "multi_thread")]
async fn stalled_servers_hold_neither_readiness_nor_the_next_ecds_push() {
    let module = module();
    let sha = sha256_hex(&module);
    let srv = ModServer::start().await;
    srv.route("/hdr.wasm", Behaviour::Serve(module.clone()));
    let stall_404 = StallServer::start(404).await;
    let stall_200 = StallServer::start(200).await;
    let m = TwoWorkloads::new();
    let plugin = |url: &str, sha: &str, version: &str| {
        format!(
            "{{name: hdr, url: \"{url}\", sha256: \"{sha}\", failStrategy: FAIL_CLOSE, resourceVersion: \"{version}\"}}"
        )
    };
    let dp = Devplane::start(&mesh(&m, &plugin(&stall_404.url("/m.wasm"), "", "1"))).await;
    app("a", m.a_app).await;
    app("b", m.b_app).await;
    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    let mut b = Sidecar::start(&dp, "b", "default", "b", &[]).await;
    a.wait_ready(READY).await;
    b.wait_ready(READY).await;
    wait_response(
        "the fail-closed stand-in of the stalled 404",
        &m,
        403,
        false,
        &[&a],
    )
    .await;

    // A download that hangs; then the plugin is replaced by a good module.
    let before = stall_200.connections();
    dp.write_mesh(&mesh(&m, &plugin(&stall_200.url("/m.wasm"), &sha, "2")));
    wait_for("the agent to start the hung download", DEADLINE, || async {
        (stall_200.connections() > before).then_some(())
    })
    .await;
    let t = tokio::time::Instant::now();
    dp.write_mesh(&mesh(&m, &plugin(&srv.url("/hdr.wasm"), &sha, "3")));
    let within = Duration::from_secs(15);
    loop {
        let r = raw_get(m.a_to_b, "/").await;
        if status_of(&r) == 200 && has_header(&r) {
            break;
        }
        if t.elapsed() > within {
            a.proc.print_log();
            panic!("the replacing push was not applied within {within:?}: {r}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Nothing was NACKed.
    let acks = dp.acks().await;
    let ca = acks
        .iter()
        .find(|c| c["node_id"].as_str().is_some_and(|n| n.contains("a-5f7d9")))
        .unwrap();
    assert!(
        ca["nacks"].get(type_url::EXTENSION_CONFIG).is_none(),
        "{ca}"
    );
}
