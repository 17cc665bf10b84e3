//! Wasm module fetching through the agent's ECDS converter, in-process, against real peers:
//! an HTTP module server, Debian's `docker-registry` filled by skopeo, and the proxy-wasm
//! module assembled by wabt. Each failure must produce Istio's RBAC stand-in (allow-all for
//! fail-open, deny-all otherwise) and the right `istio_agent_wasm_*` sample.

#![allow(clippy::unwrap_used)]

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
    let ec = TypedExtensionConfig::decode(value).unwrap();
    assert_eq!(ec.name, "default.hdr");
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
