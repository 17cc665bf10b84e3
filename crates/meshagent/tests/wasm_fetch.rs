//! Wasm module fetching through the agent's ECDS converter, in-process, against real peers:
//! an HTTP module server, Debian's `docker-registry` filled by skopeo, and the proxy-wasm
//! module assembled by wabt. Each failure must produce Istio's RBAC stand-in (allow-all for
//! fail-open, deny-all otherwise) and the right `istio_agent_wasm_*` sample.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

mod status_support;
mod wasm_support;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use meshagent::config::WasmConfig;
use meshagent::metrics::Registry;
use meshagent::wasm::convert::{self, Converter};
use meshagent::wasm::{WasmOptions, start};
use meshagent_proto::envoy::pb::envoy::config::core::v3::{
    TypedExtensionConfig, async_data_source, data_source,
};
use meshagent_proto::envoy::pb::envoy::extensions::filters::http::rbac::v3::Rbac;
use meshagent_proto::envoy::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use meshagent_proto::envoy::pb::envoy::extensions::wasm::v3::plugin_config;
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryResponse;
use prost::Message;
use wasm_support::*;

fn wasm_config(blocked: &[&str], max: u64) -> WasmConfig {
    WasmConfig {
        insecure_registries: vec![],
        module_expiry: Duration::from_secs(24 * 3600),
        purge_interval: Duration::from_secs(3600),
        http_request_timeout: Duration::from_secs(15),
        http_request_max_retries: 5,
        max_binary_size_bytes: max,
        blocked_cidrs: blocked.iter().map(|s| s.to_string()).collect(),
        remote_load_conversion: true,
        docker_config: None,
    }
}

struct Agent {
    conv: Arc<Converter>,
    registry: Registry,
    _tasks: meshagent::tasks::Tasks,
}

fn agent(dir: &Path, cfg: WasmConfig) -> Agent {
    let registry = Registry::new();
    let tasks = meshagent::tasks::Tasks::new();
    let conv = start(
        WasmOptions {
            dir: dir.to_owned(),
            cfg,
            mesh_root: None,
            docker_config: None,
        },
        &registry,
        &tasks,
        tokio_util::sync::CancellationToken::new(),
    )
    .unwrap();
    Agent {
        conv,
        registry,
        _tasks: tasks,
    }
}

#[derive(Debug, PartialEq)]
enum Out {
    /// The module was localised: its file.
    Local(String),
    /// The RBAC stand-in: (stat prefix, denies everything).
    Rbac(String, bool),
}

async fn convert_one(a: &Agent, url: &str, sha: &str, fail_open: bool) -> Out {
    convert_with_env(a, url, sha, fail_open, BTreeMap::new())
        .await
        .0
}

async fn convert_with_env(
    a: &Agent,
    url: &str,
    sha: &str,
    fail_open: bool,
    env: BTreeMap<String, String>,
) -> (Out, BTreeMap<String, String>) {
    let res = convert::remote_wasm_resource("default.hdr", url, sha, env, fail_open);
    let msg = convert::sotw_response("v1", "n1", vec![res]);
    let out = a.conv.convert_response(false, &msg).await.expect("no NACK");
    let r = DiscoveryResponse::decode(out.as_slice()).unwrap();
    assert_eq!((r.version_info.as_str(), r.nonce.as_str()), ("v1", "n1"));
    decode(&r.resources[0].value)
}

fn decode(value: &[u8]) -> (Out, BTreeMap<String, String>) {
    let (name, out, env) = decode_named(value);
    assert_eq!(name, "default.hdr");
    (out, env)
}

fn decode_named(value: &[u8]) -> (String, Out, BTreeMap<String, String>) {
    let ec = TypedExtensionConfig::decode(value).unwrap();
    let name = ec.name.clone();
    let (out, env) = decode_ec(ec);
    (name, out, env)
}

fn decode_ec(ec: TypedExtensionConfig) -> (Out, BTreeMap<String, String>) {
    let tc = ec.typed_config.unwrap();
    if tc.type_url == convert::RBAC_HTTP {
        let r = Rbac::decode(tc.value.as_slice()).unwrap();
        return (
            Out::Rbac(r.rules_stat_prefix, r.rules.is_some()),
            BTreeMap::new(),
        );
    }
    assert_eq!(tc.type_url, convert::WASM_HTTP);
    let w = Wasm::decode(tc.value.as_slice()).unwrap();
    let Some(plugin_config::Vm::VmConfig(vm)) = w.config.unwrap().vm else {
        panic!("no vm config")
    };
    let env: BTreeMap<String, String> = vm
        .environment_variables
        .map(|e| e.key_values.into_iter().collect())
        .unwrap_or_default();
    match vm.code.unwrap().specifier.unwrap() {
        async_data_source::Specifier::Local(d) => match d.specifier.unwrap() {
            data_source::Specifier::Filename(f) => (Out::Local(f), env),
            s => panic!("unexpected local source {s:?}"),
        },
        async_data_source::Specifier::Remote(r) => panic!("still remote: {r:?}"),
    }
}

fn metrics(a: &Agent) -> String {
    a.registry.encode()
}

fn deny() -> Out {
    Out::Rbac("wasm-default-deny".into(), true)
}
fn allow() -> Out {
    Out::Rbac("wasm-default-allow".into(), false)
}

#[tokio::test(flavor = "multi_thread")]
async fn http_modules_are_verified_cached_and_survive_a_restart() {
    let module = module();
    let sha = sha256_hex(&module);
    let srv = ModServer::start().await;
    srv.route("/hdr.wasm", Behaviour::Serve(module.clone()));
    srv.route("/hdr.wasm.gz", Behaviour::Serve(gzip(&module)));
    srv.route(
        "/hdr.tgz",
        Behaviour::Serve(gzip(&tar_of("hdr.wasm", &module))),
    );
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), wasm_config(&[], 256 << 20));

    let env: BTreeMap<String, String> = [
        ("ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION", "7"),
        ("ISTIO_META_WASM_IMAGE_PULL_POLICY", "IfNotPresent"),
        ("PLUGIN_MODE", "test"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let url = srv.url("/hdr.wasm");
    let (out, env_out) = convert_with_env(&a, &url, &sha, false, env).await;
    // Istio's layout: <dir>/<hex sha256(url)>/<sha256 of the module>.wasm, 0755 / 0644.
    let want = dir
        .path()
        .join(sha256_hex(url.as_bytes()))
        .join(format!("{sha}.wasm"));
    assert_eq!(out, Out::Local(want.to_string_lossy().into_owned()));
    assert_eq!(std::fs::read(&want).unwrap(), module);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!((mode(want.parent().unwrap()), mode(&want)), (0o755, 0o644));
    // ISTIO_META_* keys are consumed and stripped; others stay.
    assert_eq!(
        env_out.into_iter().collect::<Vec<_>>(),
        vec![("PLUGIN_MODE".to_owned(), "test".to_owned())]
    );

    // Cached: no second request, also without a checksum (the URL's last download).
    assert!(matches!(
        convert_one(&a, &url, &sha, false).await,
        Out::Local(_)
    ));
    assert!(matches!(
        convert_one(&a, &url, "nil", false).await,
        Out::Local(_)
    ));
    assert_eq!(srv.hits("/hdr.wasm"), 1);

    // gzip and tar.gz are unwrapped; the checksum is of the module itself.
    for p in ["/hdr.wasm.gz", "/hdr.tgz"] {
        let out = convert_one(&a, &srv.url(p), &sha, false).await;
        let Out::Local(f) = out else {
            panic!("{p}: {out:?}")
        };
        assert_eq!(std::fs::read(f).unwrap(), module, "{p}");
    }
    let m = metrics(&a);
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"success\"}"
        ),
        3.0,
        "{m}"
    );
    assert_eq!(metric(&m, "istio_agent_wasm_cache_entries"), 3.0, "{m}");
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_config_conversion_count{result=\"success\"}"
        ),
        5.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "istio_agent_wasm_cache_lookup_count{hit=\"true\"}"),
        2.0,
        "{m}"
    );

    // A restarted agent (same emptyDir) uses the files on disk: no refetch, with or
    // without a checksum.
    drop(a);
    let b = agent(dir.path(), wasm_config(&[], 256 << 20));
    assert_eq!(
        convert_one(&b, &url, "nil", false).await,
        Out::Local(want.to_string_lossy().into_owned())
    );
    assert!(matches!(
        convert_one(&b, &url, &sha, false).await,
        Out::Local(_)
    ));
    assert_eq!(srv.hits("/hdr.wasm"), 1);
    assert_eq!(metric(&metrics(&b), "istio_agent_wasm_cache_entries"), 3.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_requests_for_one_module_download_it_once() {
    let module = module();
    let sha = sha256_hex(&module);
    let srv = ModServer::start().await;
    srv.route("/slow.wasm", Behaviour::Gate(module.clone()));
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), wasm_config(&[], 256 << 20));
    let url = srv.url("/slow.wasm");
    let resources = (0..4)
        .map(|_| convert::remote_wasm_resource("default.hdr", &url, &sha, BTreeMap::new(), false))
        .collect();
    let msg = convert::sotw_response("v1", "n1", resources);
    let conv = a.conv.clone();
    let job = tokio::spawn(async move { conv.convert_response(false, &msg).await });
    meshagent_testkit::wait_for("the download to start", Duration::from_secs(10), || async {
        (srv.hits("/slow.wasm") > 0).then_some(())
    })
    .await;
    srv.release();
    let out = job.await.unwrap().unwrap();
    let r = DiscoveryResponse::decode(out.as_slice()).unwrap();
    assert_eq!(r.resources.len(), 4);
    for res in &r.resources {
        assert!(matches!(decode(&res.value).0, Out::Local(_)));
    }
    assert_eq!(srv.hits("/slow.wasm"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn failures_become_istios_rbac_stand_ins_with_metrics() {
    let module = module();
    let sha = sha256_hex(&module);
    let srv = ModServer::start().await;
    // A second server on a loopback address listed in BLOCKED_CIDRS_IN_WASM_FETCH.
    let blocked = ModServer::start_on("127.0.0.9:0".parse().unwrap()).await;
    blocked.route("/hdr.wasm", Behaviour::Serve(module.clone()));
    let token = ModServer::start().await;
    token.route("/token", Behaviour::Serve(b"{\"token\":\"t\"}".to_vec()));

    let mut big = module.clone();
    big.resize(64 * 1024, 0);
    let mut bomb = module.clone();
    bomb.resize(8 << 20, 0);
    srv.route("/hdr.wasm", Behaviour::Serve(module.clone()));
    srv.route("/big.wasm", Behaviour::Serve(big));
    srv.route("/bomb.wasm.gz", Behaviour::Serve(gzip(&bomb)));
    srv.route(
        "/flaky.wasm",
        Behaviour::FailThen(vec![500, 503], module.clone()),
    );
    srv.route(
        "/teapot.wasm",
        Behaviour::FailThen(vec![501], module.clone()),
    );
    srv.route(
        "/redirect.wasm",
        Behaviour::Redirect(blocked.url("/hdr.wasm")),
    );
    srv.route(
        "/html.wasm",
        Behaviour::Serve(b"<html>not wasm</html>".to_vec()),
    );
    srv.route(
        "/v2/wasm/x/manifests/v1",
        Behaviour::Challenge(format!(
            "Bearer realm=\"{}\",service=\"registry\"",
            token.url("/token")
        )),
    );
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), wasm_config(&["127.0.0.9/32"], 32 * 1024));

    // Checksum mismatch, fail-closed.
    assert_eq!(
        convert_one(&a, &srv.url("/hdr.wasm"), &"0".repeat(64), false).await,
        deny()
    );
    let m = metrics(&a);
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"checksum_mismatched\"}"
        ),
        1.0,
        "{m}"
    );

    // 404, fail-open: allow-all.
    assert_eq!(
        convert_one(&a, &srv.url("/missing.wasm"), "nil", true).await,
        allow()
    );
    assert_eq!(srv.hits("/missing.wasm"), 1, "a 404 is not retried");
    // 500, 503, then success: retried.
    assert!(matches!(
        convert_one(&a, &srv.url("/flaky.wasm"), &sha, false).await,
        Out::Local(_)
    ));
    assert_eq!(srv.hits("/flaky.wasm"), 3);
    // 501 is not retried.
    assert_eq!(
        convert_one(&a, &srv.url("/teapot.wasm"), &sha, false).await,
        deny()
    );
    assert_eq!(srv.hits("/teapot.wasm"), 1);
    let m = metrics(&a);
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"download_failure\"}"
        ),
        2.0,
        "{m}"
    );

    // Oversize body and a gzip bomb: clear failures at ISTIO_WASM_MAX_BINARY_SIZE_BYTES.
    assert_eq!(
        convert_one(&a, &srv.url("/big.wasm"), "nil", false).await,
        deny()
    );
    assert_eq!(
        convert_one(&a, &srv.url("/bomb.wasm.gz"), "nil", true).await,
        allow()
    );
    // Not a module.
    assert_eq!(
        convert_one(&a, &srv.url("/html.wasm"), "nil", false).await,
        deny()
    );
    let m = metrics(&a);
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"download_failure\"}"
        ),
        4.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"fetch_failure\"}"
        ),
        1.0,
        "{m}"
    );

    // The SSRF guard: a blocked address directly and through a redirect; never connected.
    assert_eq!(
        convert_one(&a, &blocked.url("/hdr.wasm"), &sha, false).await,
        deny()
    );
    assert_eq!(
        convert_one(&a, &srv.url("/redirect.wasm"), &sha, true).await,
        allow()
    );
    assert_eq!(srv.hits("/redirect.wasm"), 1);
    assert_eq!(blocked.hits("/hdr.wasm"), 0);

    // A registry whose bearer realm points at a loopback token server: refused before use.
    let url = format!("oci://{}/wasm/x:v1", srv.addr);
    assert_eq!(convert_one(&a, &url, "nil", false).await, deny());
    assert_eq!(token.hits("/token"), 0);
    let m = metrics(&a);
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"manifest_failure\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_config_conversion_count{result=\"fetch_failure\"}"
        ),
        9.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_config_conversion_count{result=\"success\"}"
        ),
        1.0,
        "{m}"
    );
    assert!(
        m.contains("istio_agent_wasm_config_conversion_duration_bucket{le=\"1\"}"),
        "{m}"
    );

    // A pull secret present but empty fails without any request (Istio convert.go).
    let env = [(
        "ISTIO_META_WASM_IMAGE_PULL_SECRET".to_owned(),
        String::new(),
    )]
    .into();
    let (out, _) = convert_with_env(&a, &srv.url("/hdr.wasm"), &sha, false, env).await;
    assert_eq!(out, deny());
    assert_eq!(srv.hits("/hdr.wasm"), 1, "only the checksum-mismatch fetch");
}

#[tokio::test(flavor = "multi_thread")]
async fn oci_images_in_every_layout_from_a_real_registry() {
    let module = module();
    let reg = OciRegistry::start().await;
    let layouts = tempfile::tempdir().unwrap();
    let art = oci_layout(&layouts.path().join("art"), "v1", &module, false);
    let compat = oci_layout(&layouts.path().join("compat"), "v1", &module, true);
    let d_art = reg.push(&art, "v1", "wasm/artifact", false).await;
    let d_compat = reg.push(&compat, "v1", "wasm/compat", false).await;
    let d_docker = reg.push(&compat, "v1", "wasm/docker", true).await;

    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), wasm_config(&[], 256 << 20));
    for (repo, digest) in [
        ("wasm/artifact", &d_art),
        ("wasm/compat", &d_compat),
        ("wasm/docker", &d_docker),
    ] {
        let url = format!("oci://{}/{repo}:v1", reg.addr);
        let out = convert_one(&a, &url, digest, false).await;
        // The cache file is named after the manifest digest, under sha256("oci://registry/repo").
        let want = dir
            .path()
            .join(sha256_hex(format!("oci://{}/{repo}", reg.addr).as_bytes()))
            .join(format!("{digest}.wasm"));
        assert_eq!(
            out,
            Out::Local(want.to_string_lossy().into_owned()),
            "{repo}"
        );
        assert_eq!(std::fs::read(&want).unwrap(), module, "{repo}");
        // By digest: the digest is the checksum, served from the cache.
        let by_digest = format!("oci://{}/{repo}@sha256:{digest}", reg.addr);
        assert!(matches!(
            convert_one(&a, &by_digest, "nil", false).await,
            Out::Local(_)
        ));
    }
    // The sha256 of a WasmPlugin for OCI is compared with the manifest digest.
    let url = format!("oci://{}/wasm/compat:v1", reg.addr);
    assert_eq!(
        convert_one(&a, &url, &sha256_hex(&module), false).await,
        deny()
    );
    let m = metrics(&a);
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"success\"}"
        ),
        3.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"checksum_mismatched\"}"
        ),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, "istio_agent_wasm_cache_lookup_count{hit=\"true\"}"),
        3.0,
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn pull_policy_always_follows_the_resource_version_and_purge_expires() {
    let module = module();
    let srv = ModServer::start().await;
    srv.route("/hdr.wasm", Behaviour::Serve(module.clone()));
    let url = srv.url("/hdr.wasm");
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = wasm_config(&[], 256 << 20);
    cfg.module_expiry = Duration::ZERO;
    let a = agent(dir.path(), cfg);
    let env = |policy: &str, version: &str| -> BTreeMap<String, String> {
        [
            ("ISTIO_META_WASM_IMAGE_PULL_POLICY", policy),
            ("ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION", version),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    };
    for (policy, version, hits) in [
        ("Always", "1", 1),
        ("Always", "1", 1), // same version: cached
        ("Always", "2", 2), // new version: fetched again
        ("IfNotPresent", "3", 2),
        ("bogus", "4", 2), // unknown = unspecified = IfNotPresent for HTTP
    ] {
        let (out, _) = convert_with_env(&a, &url, "nil", false, env(policy, version)).await;
        assert!(matches!(out, Out::Local(_)), "{policy} {version}: {out:?}");
        assert_eq!(srv.hits("/hdr.wasm"), hits, "{policy} {version}");
    }
    // WASM_MODULE_EXPIRY=0: a purge removes the unused module and its file.
    let file = dir
        .path()
        .join(sha256_hex(url.as_bytes()))
        .join(format!("{}.wasm", sha256_hex(&module)));
    assert!(file.exists());
    a.conv.cache.purge().await;
    assert!(!file.exists());
    assert_eq!(metric(&metrics(&a), "istio_agent_wasm_cache_entries"), 0.0);
    let (out, _) = convert_with_env(&a, &url, "nil", false, env("IfNotPresent", "5")).await;
    assert!(matches!(out, Out::Local(_)));
    assert_eq!(srv.hits("/hdr.wasm"), 3, "fetched again after the purge");
}

// === Stalled servers and superseded ECDS responses ===

/// Slack over a deadline for the conversion to return (no IO is left at the deadline).
const SLACK: Duration = Duration::from_millis(1500);

/// One SotW conversion with `http_uri.timeout` = `timeout`: the outcome and its duration.
async fn convert_timed(
    conv: Arc<Converter>,
    url: String,
    fail_open: bool,
    timeout: Duration,
) -> (Out, Duration) {
    let res = convert::remote_wasm_resource_with_timeout(
        "default.hdr",
        &url,
        "nil",
        BTreeMap::new(),
        fail_open,
        timeout,
    );
    let msg = convert::sotw_response("v1", "n1", vec![res]);
    let t = tokio::time::Instant::now();
    let out = conv.convert_response(false, &msg).await.expect("no NACK");
    let r = DiscoveryResponse::decode(out.as_slice()).unwrap();
    (decode(&r.resources[0].value).0, t.elapsed())
}

#[tokio::test(flavor = "multi_thread")]
async fn stalled_bodies_end_within_http_uri_timeout_and_apply_the_fail_strategy() {
    let timeout = Duration::from_secs(2);
    let short = Duration::from_secs(1);
    // (status, a registry challenge first, OCI, fail-open)
    let cases = [
        (404, false, false, false),
        (503, false, false, true),
        (200, false, false, false),
        (404, false, true, true),
        (404, true, true, false),
    ];
    for (status, challenge, oci, fail_open) in cases {
        let srv = StallServer::start_with(status, challenge).await;
        let dir = tempfile::tempdir().unwrap();
        let a = agent(dir.path(), wasm_config(&[], 1 << 20));
        let url = if oci {
            format!("oci://{}/wasm/stall:v1", srv.addr)
        } else {
            srv.url("/stall.wasm")
        };
        let what = format!("{status} challenge={challenge} {url}");
        // Two callers of one module (one download) and a third, with a shorter timeout,
        // joining it: none waits past its own timeout.
        let all = futures::future::join3(
            convert_timed(a.conv.clone(), url.clone(), fail_open, timeout),
            convert_timed(a.conv.clone(), url.clone(), fail_open, timeout),
            convert_timed(a.conv.clone(), url.clone(), fail_open, short),
        );
        let ((o1, d1), (o2, d2), (o3, d3)) = tokio::time::timeout(Duration::from_secs(30), all)
            .await
            .unwrap_or_else(|_| panic!("{what}: the conversion still hangs after 30 s"));
        let want = if fail_open { allow() } else { deny() };
        for o in [&o1, &o2, &o3] {
            assert_eq!(*o, want, "{what}");
        }
        assert!(
            d1 <= timeout + SLACK && d2 <= timeout + SLACK,
            "{what}: {d1:?} {d2:?}"
        );
        assert!(
            d3 <= short + SLACK,
            "{what}: the joining caller waited {d3:?}"
        );
        assert!(srv.connections() >= 1, "{what}");
        // The download's own outcome is counted as it ends (with its deadline).
        meshagent_testkit::wait_for(
            "the failed fetch to be counted",
            Duration::from_secs(5),
            || async {
                let m = metrics(&a);
                let failed = |r: &str| {
                    metric(
                        &m,
                        &format!("istio_agent_wasm_remote_fetch_count{{result=\"{r}\"}}"),
                    )
                };
                (failed("download_failure") + failed("manifest_failure") >= 1.0).then_some(())
            },
        )
        .await;
        // The agent closed its connections: nothing is left holding a socket.
        meshagent_testkit::wait_for(
            "the agent to close its connections",
            Duration::from_secs(5),
            || async { (srv.open() == 0).then_some(()) },
        )
        .await;
    }
}

/// A future's result, waited for in the order the futures were started (as the xDS stream
/// hands ECDS responses to Envoy).
async fn in_order<T: Send + 'static>(
    jobs: Vec<tokio::task::JoinHandle<T>>,
    within: Duration,
) -> Vec<T> {
    let mut out = Vec::new();
    for j in jobs {
        out.push(
            tokio::time::timeout(within, j)
                .await
                .expect("an ECDS response is held back")
                .unwrap(),
        );
    }
    out
}

fn delta_out(b: &[u8]) -> Vec<(String, Out)> {
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse;
    DeltaDiscoveryResponse::decode(b)
        .unwrap()
        .resources
        .into_iter()
        .map(|r| (r.name, decode_named(&r.resource.unwrap().value).1))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_newer_ecds_response_is_not_queued_behind_a_hung_fetch() {
    use convert::Converted;
    let module = module();
    // A module download whose body stalls (200, 10 of 1000 bytes).
    let hung = StallServer::start(200).await;
    let srv = ModServer::start().await;
    srv.route("/good.wasm", Behaviour::Serve(module.clone()));
    srv.route("/gate.wasm", Behaviour::Gate(module.clone()));
    srv.route("/gate2.wasm", Behaviour::Gate(module.clone()));
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), wasm_config(&[], 1 << 20));
    let res = |name: &str, url: &str| {
        convert::remote_wasm_resource(name, url, "nil", BTreeMap::new(), false)
    };
    let hung_url = hung.url("/hung.wasm");
    let good_url = srv.url("/good.wasm");
    let wait_hung = |n: u32| {
        let hung = &hung;
        async move {
            meshagent_testkit::wait_for(
                "the hung fetch to start",
                Duration::from_secs(10),
                || async { (hung.connections() >= n).then_some(()) },
            )
            .await
        }
    };

    // SotW: the first response hangs on its module (http_uri.timeout 30 s); the second
    // replaces the plugin. The second is handed on at once, the first is dropped (the
    // second carries the whole set).
    let first = convert::sotw_response("v1", "n1", vec![res("default.hdr", &hung_url)]);
    let second = convert::sotw_response("v2", "n2", vec![res("default.hdr", &good_url)]);
    let j1 = tokio::spawn(a.conv.convert_latest(false, &first));
    wait_hung(1).await;
    let t = tokio::time::Instant::now();
    let j2 = tokio::spawn(a.conv.convert_latest(false, &second));
    let out = in_order(vec![j1, j2], Duration::from_secs(5)).await;
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(out[0], Ok(Converted::Superseded));
    let Ok(Converted::Forward(b)) = &out[1] else {
        panic!("{:?}", out[1])
    };
    let r = DiscoveryResponse::decode(b.as_slice()).unwrap();
    assert_eq!((r.version_info.as_str(), r.nonce.as_str()), ("v2", "n2"));
    let Out::Local(f) = decode(&r.resources[0].value).0 else {
        panic!("not localised")
    };
    assert_eq!(std::fs::read(f).unwrap(), module);

    // Delta: a newer response updating "a" and removing "c" releases those two; "b" of the
    // first response, not named by the second, is still converted and forwarded.
    let first = convert::delta_response(
        "d1",
        vec![
            ("a".into(), res("a", &hung_url)),
            ("b".into(), res("b", &good_url)),
            ("c".into(), res("c", &hung.url("/other.wasm"))),
        ],
        vec![],
    );
    let second = convert::delta_response(
        "d2",
        vec![("a".into(), res("a", &good_url))],
        vec!["c".into()],
    );
    let before = hung.connections();
    let j1 = tokio::spawn(a.conv.convert_latest(true, &first));
    // "a" joins the first (superseded, still running) download of the hung URL; "c" is new.
    wait_hung(before + 1).await;
    let j2 = tokio::spawn(a.conv.convert_latest(true, &second));
    let out = in_order(vec![j1, j2], Duration::from_secs(5)).await;
    let (Ok(Converted::Forward(b1)), Ok(Converted::Forward(b2))) = (&out[0], &out[1]) else {
        panic!("{out:?}")
    };
    let d1 = delta_out(b1);
    assert_eq!(d1.len(), 1, "{d1:?}");
    assert_eq!(d1[0].0, "b");
    assert!(matches!(d1[0].1, Out::Local(_)), "{d1:?}");
    let d2 = delta_out(b2);
    assert_eq!(d2.len(), 1);
    assert_eq!(d2[0].0, "a");
    assert!(matches!(d2[0].1, Out::Local(_)), "{d2:?}");

    // A newer SotW response carrying the same resource (and another) still wants it: both
    // wait for the one download and are forwarded in order.
    let gated = res("default.hdr", &srv.url("/gate.wasm"));
    let first = convert::sotw_response("v3", "n3", vec![gated.clone()]);
    let second = convert::sotw_response("v4", "n4", vec![gated, res("other", &good_url)]);
    let j1 = tokio::spawn(a.conv.convert_latest(false, &first));
    meshagent_testkit::wait_for("the gated fetch", Duration::from_secs(10), || async {
        (srv.hits("/gate.wasm") > 0).then_some(())
    })
    .await;
    let j2 = tokio::spawn(a.conv.convert_latest(false, &second));
    srv.release();
    let out = in_order(vec![j1, j2], Duration::from_secs(10)).await;
    for o in &out {
        let Ok(Converted::Forward(b)) = o else {
            panic!("{out:?}")
        };
        let r = DiscoveryResponse::decode(b.as_slice()).unwrap();
        assert!(matches!(decode(&r.resources[0].value).0, Out::Local(_)));
    }
    assert_eq!(srv.hits("/gate.wasm"), 1);

    // A newer Delta response about another resource does not release a pending one: the
    // slow module is still fetched and forwarded first.
    let first = convert::delta_response(
        "d3",
        vec![("g".into(), res("g", &srv.url("/gate2.wasm")))],
        vec![],
    );
    let second = convert::delta_response("d4", vec![("h".into(), res("h", &good_url))], vec![]);
    let j1 = tokio::spawn(a.conv.convert_latest(true, &first));
    meshagent_testkit::wait_for("the gated fetch", Duration::from_secs(10), || async {
        (srv.hits("/gate2.wasm") > 0).then_some(())
    })
    .await;
    let j2 = tokio::spawn(a.conv.convert_latest(true, &second));
    srv.release();
    let out = in_order(vec![j1, j2], Duration::from_secs(10)).await;
    let (Ok(Converted::Forward(b1)), Ok(Converted::Forward(_))) = (&out[0], &out[1]) else {
        panic!("{out:?}")
    };
    let d = delta_out(b1);
    assert_eq!(d.len(), 1);
    assert_eq!(d[0].0, "g");
    assert!(matches!(d[0].1, Out::Local(_)), "{d:?}");
}

// === Disk full and read-only cache ===

/// The cache's answer for `url` (the error text the agent logs for a failed fetch).
async fn get(
    a: &Agent,
    url: &str,
) -> Result<std::path::PathBuf, meshagent::wasm::fetch::FetchError> {
    a.conv
        .cache
        .get(
            url,
            meshagent::wasm::cache::GetOptions {
                resource_name: "default.hdr".into(),
                timeout: Duration::from_secs(30),
                ..Default::default()
            },
        )
        .await
}

#[tokio::test(flavor = "multi_thread")]
async fn wasm_cache_disk_full_leaves_nothing_behind_and_is_retried() {
    let small = module();
    let big = padded_module(&small, 600 * 1024);
    let srv = ModServer::start().await;
    srv.route("/big.wasm", Behaviour::Serve(big.clone()));
    // Fits as a download (zeros compress), not once unpacked.
    srv.route("/big.wasm.gz", Behaviour::Serve(gzip(&big)));
    srv.route("/small.wasm", Behaviour::Serve(small.clone()));
    let fs = Tmpfs::mount("256k");
    let a = agent(fs.path(), wasm_config(&[], 8 << 20));
    let big_sha = sha256_hex(&big);
    for p in ["/big.wasm", "/big.wasm.gz"] {
        let url = srv.url(p);
        // Disk full: the fail strategy applies, with the reason.
        assert_eq!(convert_one(&a, &url, &big_sha, false).await, deny(), "{p}");
        assert_eq!(convert_one(&a, &url, &big_sha, true).await, allow(), "{p}");
        let e = get(&a, &url).await.unwrap_err();
        assert!(e.message.contains("No space left on device"), "{p}: {e}");
        // No partial file is left, in the cache or its temp directory.
        assert_eq!(fs.files(), Vec::<std::path::PathBuf>::new(), "{p}");
        assert!(a.conv.cache.is_empty());
    }
    let m = metrics(&a);
    assert_eq!(
        metric(
            &m,
            "istio_agent_wasm_remote_fetch_count{result=\"success\"}"
        ),
        0.0,
        "{m}"
    );
    // The agent keeps serving: a module that fits is fetched and cached.
    assert!(matches!(
        convert_one(&a, &srv.url("/small.wasm"), &sha256_hex(&small), false).await,
        Out::Local(_)
    ));
    // Each request tried again (failures are not cached); with space, the next succeeds.
    assert_eq!(srv.hits("/big.wasm"), 3);
    fs.remount("size=4m");
    let Out::Local(f) = convert_one(&a, &srv.url("/big.wasm"), &big_sha, false).await else {
        panic!("not fetched once there is space")
    };
    assert_eq!(std::fs::read(f).unwrap(), big);
    // A restart trusts only the complete modules.
    drop(a);
    let b = agent(fs.path(), wasm_config(&[], 8 << 20));
    assert!(matches!(
        convert_one(&b, &srv.url("/big.wasm"), &big_sha, false).await,
        Out::Local(_)
    ));
    assert_eq!(b.conv.cache.len(), 2);
    assert_eq!(srv.hits("/big.wasm"), 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn wasm_cache_read_only_serves_cached_modules_and_retries() {
    let one = module();
    let two = padded_module(&one, 4096);
    let srv = ModServer::start().await;
    srv.route("/one.wasm", Behaviour::Serve(one.clone()));
    srv.route("/two.wasm", Behaviour::Serve(two.clone()));
    let fs = Tmpfs::mount("4m");
    let a = agent(fs.path(), wasm_config(&[], 8 << 20));
    let (sha1, sha2) = (sha256_hex(&one), sha256_hex(&two));
    assert!(matches!(
        convert_one(&a, &srv.url("/one.wasm"), &sha1, false).await,
        Out::Local(_)
    ));
    let before = fs.files();
    assert_eq!(before.len(), 1);

    fs.remount("ro");
    // The running agent: a new module cannot be written; the fail strategy applies, with
    // the reason; a cached one is still served.
    assert_eq!(
        convert_one(&a, &srv.url("/two.wasm"), &sha2, false).await,
        deny()
    );
    let e = get(&a, &srv.url("/two.wasm")).await.unwrap_err();
    assert!(e.message.contains("Read-only file system"), "{e}");
    assert!(matches!(
        convert_one(&a, &srv.url("/one.wasm"), &sha1, false).await,
        Out::Local(_)
    ));
    // An agent restarted on the read-only cache restores and serves what is there.
    let b = agent(fs.path(), wasm_config(&[], 8 << 20));
    assert!(matches!(
        convert_one(&b, &srv.url("/one.wasm"), &sha1, false).await,
        Out::Local(_)
    ));
    assert_eq!(srv.hits("/one.wasm"), 1);
    assert_eq!(
        convert_one(&b, &srv.url("/two.wasm"), &sha2, true).await,
        allow()
    );
    assert_eq!(fs.files(), before);

    // Writable again: the next request fetches it.
    fs.remount("rw");
    let Out::Local(f) = convert_one(&b, &srv.url("/two.wasm"), &sha2, false).await else {
        panic!("not fetched once writable")
    };
    assert_eq!(std::fs::read(f).unwrap(), two);
    assert_eq!(srv.hits("/two.wasm"), 4);
}

/// One ECDS resource named `name` through the converter.
async fn convert_named(a: &Agent, name: &str, url: &str, sha: &str, fail_open: bool) -> Out {
    let res = convert::remote_wasm_resource(name, url, sha, BTreeMap::new(), fail_open);
    let msg = convert::sotw_response("v1", "n1", vec![res]);
    let out = a.conv.convert_response(false, &msg).await.expect("no NACK");
    let r = DiscoveryResponse::decode(out.as_slice()).unwrap();
    decode_named(&r.resources[0].value).1
}

/// `/debug/wasmz` on the status port after real fetches: a module fetched shows its file,
/// sha256, size and the ECDS resources using it; a 401, a 404, a checksum mismatch and an
/// address refused by the SSRF guard show the error, its kind and the fail strategy applied.
#[tokio::test(flavor = "multi_thread")]
async fn wasmz_shows_each_modules_last_fetch() {
    let module = module();
    let sha = sha256_hex(&module);
    let srv = ModServer::start().await;
    srv.route("/hdr.wasm", Behaviour::Serve(module.clone()));
    srv.route("/secret.wasm", Behaviour::Status(401));
    let blocked = ModServer::start_on("127.0.0.9:0".parse().unwrap()).await;
    blocked.route("/hdr.wasm", Behaviour::Serve(module.clone()));
    let dir = tempfile::tempdir().unwrap();
    let a = agent(dir.path(), wasm_config(&["127.0.0.9/32"], 32 * 1024));
    let views = meshagent::status::views::Views::default();
    let _ = views.wasm.set(a.conv.view.clone());
    let (status, _stop) = status_support::serve_views(views).await;

    let (code, v) = status_support::get_json(status, "/debug/wasmz").await;
    assert_eq!(
        (code, v["modules"].as_array().map(Vec::len)),
        (200, Some(0)),
        "{v}"
    );

    let ok = srv.url("/hdr.wasm");
    assert!(matches!(
        convert_named(&a, "ns.hdr-a", &ok, &sha, false).await,
        Out::Local(_)
    ));
    assert!(matches!(
        convert_named(&a, "ns.hdr-b", &ok, "nil", false).await,
        Out::Local(_)
    ));
    let secret = srv.url("/secret.wasm");
    assert_eq!(
        convert_named(&a, "ns.secret", &secret, "nil", true).await,
        allow()
    );
    let gone = srv.url("/gone.wasm");
    assert_eq!(
        convert_named(&a, "ns.gone", &gone, "nil", false).await,
        deny()
    );
    let bad_sum = srv.url("/hdr.wasm?v=2");
    assert_eq!(
        convert_named(&a, "ns.mismatch", &bad_sum, &"0".repeat(64), false).await,
        deny()
    );
    let refused = blocked.url("/hdr.wasm");
    assert_eq!(
        convert_named(&a, "ns.ssrf", &refused, "nil", true).await,
        allow()
    );

    let (code, v) = status_support::get_json(status, "/debug/wasmz").await;
    assert_eq!(code, 200);
    let by_url = |u: &str| {
        v["modules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["url"] == u)
            .unwrap_or_else(|| panic!("no {u} in {v:#}"))
            .clone()
    };
    let m = by_url(&ok);
    assert_eq!(m["state"], "Available", "{m:#}");
    assert_eq!(m["sha256"], sha.as_str(), "{m:#}");
    assert_eq!(m["size"], module.len() as u64, "{m:#}");
    assert_eq!(m["resources"], serde_json::json!(["ns.hdr-a", "ns.hdr-b"]));
    let file = m["file"].as_str().unwrap();
    assert!(file.starts_with(dir.path().to_str().unwrap()), "{file}");
    assert_eq!(std::fs::read(file).unwrap(), module);
    assert!(
        m["lastError"].is_null() && m["lastSuccess"].is_string(),
        "{m:#}"
    );
    assert_eq!(m["pullPolicy"], "UNSPECIFIED_POLICY");

    let m = by_url(&secret);
    assert_eq!(
        (
            &m["state"],
            &m["lastError"]["httpStatus"],
            &m["lastError"]["kind"]
        ),
        (
            &serde_json::json!("Failing"),
            &serde_json::json!(401),
            &serde_json::json!("http_status")
        ),
        "{m:#}"
    );
    assert_eq!(m["failStrategy"], "FAIL_OPEN");
    assert!(
        m["fallbackApplied"]
            .as_str()
            .unwrap()
            .starts_with("allow-all"),
        "{m:#}"
    );
    assert_eq!(m["lastError"]["result"], "download_failure");
    assert!(m["sha256"].is_null() && m["lastSuccess"].is_null(), "{m:#}");
    assert_eq!(m["resources"], serde_json::json!(["ns.secret"]));

    let m = by_url(&gone);
    assert_eq!(m["lastError"]["httpStatus"], 404, "{m:#}");
    assert_eq!(m["failStrategy"], "FAIL_CLOSE");
    assert!(
        m["fallbackApplied"]
            .as_str()
            .unwrap()
            .starts_with("deny-all"),
        "{m:#}"
    );

    let m = by_url(&bad_sum);
    assert_eq!(m["lastError"]["kind"], "checksum_mismatch", "{m:#}");
    assert_eq!(m["lastError"]["result"], "checksum_mismatched");
    assert_eq!(m["expectedSha256"], "0".repeat(64));
    assert!(
        m["lastError"]["error"].as_str().unwrap().contains(&sha),
        "{m:#}"
    );

    let m = by_url(&refused);
    assert_eq!(m["lastError"]["kind"], "blocked", "{m:#}");
    assert_eq!(
        blocked.hits("/hdr.wasm"),
        0,
        "the guard refused before connecting"
    );

    // A resource that moves to another module is listed under that one only.
    assert!(matches!(
        convert_named(&a, "ns.hdr-b", &bad_sum, "nil", false).await,
        Out::Local(_)
    ));
    let (_, v) = status_support::get_json(status, "/debug/wasmz").await;
    let ok_now = v["modules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["url"] == ok.as_str())
        .unwrap();
    assert_eq!(
        ok_now["resources"],
        serde_json::json!(["ns.hdr-a"]),
        "{v:#}"
    );
    // The module that failed its checksum is now cached, and the failure is gone.
    let moved = v["modules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["url"] == bad_sum.as_str())
        .unwrap();
    assert_eq!(moved["state"], "Available", "{v:#}");
    assert_eq!(
        moved["resources"],
        serde_json::json!(["ns.hdr-b", "ns.mismatch"]),
        "{v:#}"
    );
}
