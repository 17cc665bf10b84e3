//! Wasm pulls against real registries and TLS servers: multi-platform image indexes, registry
//! auth (htpasswd Basic and the distribution token flow, with a pull secret or the docker
//! config keychain), and HTTPS module servers and registries with a test CA (trusted,
//! untrusted, `WASM_INSECURE_REGISTRIES`). Peers: Debian's `docker-registry`, skopeo,
//! htpasswd (apache2-utils), wabt, and rustls servers in the test.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

mod wasm_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use meshagent::config::WasmConfig;
use meshagent::metrics::Registry;
use meshagent::wasm::cache::{GetOptions, PullPolicy};
use meshagent::wasm::convert::{self, Converter};
use meshagent::wasm::fetch::FetchError;
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

fn wasm_config(insecure: &[&str]) -> WasmConfig {
    WasmConfig {
        insecure_registries: insecure.iter().map(|s| s.to_string()).collect(),
        module_expiry: Duration::from_secs(24 * 3600),
        purge_interval: Duration::from_secs(3600),
        http_request_timeout: Duration::from_secs(15),
        http_request_max_retries: 2,
        max_binary_size_bytes: 256 << 20,
        blocked_cidrs: vec![],
        remote_load_conversion: true,
        docker_config: None,
    }
}

struct Agent {
    conv: Arc<Converter>,
    registry: Registry,
    dir: tempfile::TempDir,
    _tasks: meshagent::tasks::Tasks,
}

fn agent(cfg: WasmConfig, mesh_root: Option<&Path>, docker_config: Option<PathBuf>) -> Agent {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::new();
    let tasks = meshagent::tasks::Tasks::new();
    let conv = start(
        WasmOptions {
            dir: dir.path().to_owned(),
            cfg,
            mesh_root: mesh_root.map(Path::to_owned),
            docker_config,
        },
        &registry,
        &tasks,
        tokio_util::sync::CancellationToken::new(),
    )
    .unwrap();
    Agent {
        conv,
        registry,
        dir,
        _tasks: tasks,
    }
}

/// What the agent hands Envoy for one remote Wasm resource.
#[derive(Debug, PartialEq)]
enum Out {
    /// Localised: the file's bytes.
    Module(Vec<u8>),
    /// The RBAC stand-in of a failed fetch (fail-closed: deny-all).
    Deny,
    Allow,
}

/// One ECDS conversion, the pull secret (if any) in the VM env as istiod sends it.
async fn ecds(a: &Agent, url: &str, sha: &str, secret: Option<&str>) -> Out {
    let env: BTreeMap<String, String> = secret
        .map(|s| (convert::PULL_SECRET_ENV.to_owned(), s.to_owned()))
        .into_iter()
        .collect();
    let res = convert::remote_wasm_resource("default.hdr", url, sha, env, false);
    let msg = convert::sotw_response("v1", "n1", vec![res]);
    let out = a.conv.convert_response(false, &msg).await.expect("no NACK");
    let r = DiscoveryResponse::decode(out.as_slice()).unwrap();
    let ec = TypedExtensionConfig::decode(r.resources[0].value.as_slice()).unwrap();
    let tc = ec.typed_config.unwrap();
    if tc.type_url == convert::RBAC_HTTP {
        let rbac = Rbac::decode(tc.value.as_slice()).unwrap();
        return match rbac.rules_stat_prefix.as_str() {
            "wasm-default-deny" => Out::Deny,
            _ => Out::Allow,
        };
    }
    assert_eq!(tc.type_url, convert::WASM_HTTP);
    let w = Wasm::decode(tc.value.as_slice()).unwrap();
    let Some(plugin_config::Vm::VmConfig(vm)) = w.config.unwrap().vm else {
        panic!("no vm config")
    };
    match vm.code.unwrap().specifier.unwrap() {
        async_data_source::Specifier::Local(d) => match d.specifier.unwrap() {
            data_source::Specifier::Filename(f) => {
                assert!(f.starts_with(&*a.dir.path().to_string_lossy()), "{f}");
                Out::Module(std::fs::read(f).unwrap())
            }
            s => panic!("unexpected local source {s:?}"),
        },
        async_data_source::Specifier::Remote(r) => panic!("still remote: {r:?}"),
    }
}

/// [`ecds`], which must localise `want`; otherwise the fetch error and the peer's log.
async fn expect_module(
    a: &Agent,
    url: &str,
    sha: &str,
    secret: Option<&str>,
    want: &[u8],
    log: &str,
) {
    let out = ecds(a, url, sha, secret).await;
    if out != Out::Module(want.to_vec()) {
        let e = get(a, url, secret).await.err();
        panic!("{url}: {out:?}, fetch error: {e:?}\nregistry log:\n{log}");
    }
}

/// The cache's answer for `url` (the error text the agent logs for a failed fetch).
async fn get(a: &Agent, url: &str, secret: Option<&str>) -> Result<PathBuf, FetchError> {
    a.conv
        .cache
        .get(
            url,
            GetOptions {
                checksum: String::new(),
                resource_name: "default.hdr".into(),
                resource_version: "1".into(),
                pull_policy: PullPolicy::IfNotPresent,
                pull_secret: secret.map(|s| s.as_bytes().to_vec()),
                timeout: Duration::from_secs(30),
            },
        )
        .await
}

fn count(a: &Agent, result: &str) -> f64 {
    metric(
        &a.registry.encode(),
        &format!("istio_agent_wasm_remote_fetch_count{{result=\"{result}\"}}"),
    )
}

/// A second, different valid module: the test module with a custom section appended.
fn other_module(module: &[u8]) -> Vec<u8> {
    let mut m = module.to_vec();
    m.extend_from_slice(&[0, 4, 3, b'a', b'r', b'm']);
    m
}

#[tokio::test(flavor = "multi_thread")]
async fn image_indexes_resolve_to_the_linux_amd64_child() {
    let module = module();
    let arm = other_module(&module);
    let reg = OciRegistry::start().await;
    let layouts = tempfile::tempdir().unwrap();
    // The arm64 child first, so that "the first child" is not what is tested.
    let (multi, children) = oci_index_layout(
        &layouts.path().join("multi"),
        "v1",
        &[
            (Some(("linux", "arm64")), &arm),
            (Some(("linux", "amd64")), &module),
        ],
    );
    let index_digest = reg.push_with(&multi, "v1", "wasm/multi", &["--multi-arch=all"]);
    let (none, _) = oci_index_layout(
        &layouts.path().join("none"),
        "v1",
        &[
            (Some(("linux", "arm64")), &arm),
            (Some(("windows", "amd64")), &arm),
        ],
    );
    reg.push_with(&none, "v1", "wasm/noamd64", &["--multi-arch=all"]);
    // A child without a platform counts as linux/amd64 (go-containerregistry).
    let (bare, bare_children) = oci_index_layout(
        &layouts.path().join("bare"),
        "v1",
        &[(Some(("linux", "arm64")), &arm), (None, &module)],
    );
    reg.push_with(&bare, "v1", "wasm/bare", &["--multi-arch=all"]);
    // The same index as a Docker manifest list (skopeo converts the list and its images).
    reg.push_with(
        &multi,
        "v1",
        "wasm/dockerlist",
        &["--multi-arch=all", "--format", "v2s2"],
    );

    let a = agent(wasm_config(&[]), None, None);
    let url = format!("oci://{}/wasm/multi:v1", reg.addr);
    assert_eq!(
        ecds(&a, &url, "nil", None).await,
        Out::Module(module.clone())
    );
    // The checksum is the chosen child's manifest digest: the cache file is named after it,
    // and a WasmPlugin sha256 is compared with it.
    let file = get(&a, &url, None).await.unwrap();
    assert_eq!(
        file.file_name().unwrap().to_string_lossy(),
        format!("{}.wasm", children[1])
    );
    assert_eq!(
        ecds(&a, &url, &children[1], None).await,
        Out::Module(module.clone())
    );
    assert_eq!(ecds(&a, &url, &index_digest, None).await, Out::Deny);
    // Pinned by the index digest: the digest in the URL is the checksum, and it is not the
    // image's (Istio fails the same way; pin the platform image's digest instead).
    let pinned = format!("oci://{}/wasm/multi@sha256:{index_digest}", reg.addr);
    assert_eq!(ecds(&a, &pinned, "nil", None).await, Out::Deny);
    assert_eq!(count(&a, "checksum_mismatched"), 2.0);
    let by_child = format!("oci://{}/wasm/multi@sha256:{}", reg.addr, children[1]);
    assert_eq!(
        ecds(&a, &by_child, "nil", None).await,
        Out::Module(module.clone())
    );

    let bare_url = format!("oci://{}/wasm/bare:v1", reg.addr);
    let f = get(&a, &bare_url, None).await.unwrap();
    assert_eq!(std::fs::read(&f).unwrap(), module);
    assert!(f.ends_with(format!("{}.wasm", bare_children[1])), "{f:?}");

    let list_url = format!("oci://{}/wasm/dockerlist:v1", reg.addr);
    assert_eq!(
        ecds(&a, &list_url, "nil", None).await,
        Out::Module(module.clone())
    );

    let none_url = format!("oci://{}/wasm/noamd64:v1", reg.addr);
    assert_eq!(ecds(&a, &none_url, "nil", None).await, Out::Deny);
    let e = get(&a, &none_url, None).await.unwrap_err();
    assert!(
        e.message.contains("no child with platform linux/amd64"),
        "{e}"
    );
    assert_eq!(count(&a, "manifest_failure"), 2.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn basic_auth_registries_take_a_pull_secret_or_the_docker_keychain() {
    let module = module();
    let tmp = tempfile::tempdir().unwrap();
    let pw = tmp.path().join("htpasswd");
    htpasswd(&pw, "wasm", "s3cret");
    let auth = format!(
        "auth:\n  htpasswd:\n    realm: meshagent-test\n    path: {}\n",
        pw.display()
    );
    let reg = OciRegistry::start_with(&auth, None).await;
    let layout = oci_layout(&tmp.path().join("img"), "v1", &module, true);
    reg.push_with(
        &layout,
        "v1",
        "wasm/private",
        &["--dest-creds", "wasm:s3cret"],
    );
    let host = reg.addr.to_string();
    let url = format!("oci://{host}/wasm/private:v1");
    let good = docker_config_json(&host, "wasm", "s3cret");
    let bad = docker_config_json(&host, "wasm", "wrong");

    // ISTIO_META_WASM_IMAGE_PULL_SECRET.
    let a = agent(wasm_config(&[]), None, None);
    expect_module(&a, &url, "nil", Some(&good), &module, &reg.proc.log_text()).await;
    // Wrong password, and no credentials at all: clear failures.
    let b = agent(wasm_config(&[]), None, None);
    assert_eq!(ecds(&b, &url, "nil", Some(&bad)).await, Out::Deny);
    let e = get(&b, &url, Some(&bad)).await.unwrap_err();
    assert!(e.message.contains("unauthorized"), "{e}");
    let e = get(&b, &url, None).await.unwrap_err();
    assert!(e.message.contains("registry requires credentials"), "{e}");
    assert_eq!(count(&b, "manifest_failure"), 3.0);
    // A secret that is not a docker config.
    let e = get(&b, &url, Some("not json")).await.unwrap_err();
    assert!(e.message.contains("pull secret"), "{e}");

    // The docker config keychain ($DOCKER_CONFIG/config.json) when there is no pull secret;
    // a pull secret, when present, wins over it.
    let cfg = tmp.path().join("config.json");
    std::fs::write(&cfg, &good).unwrap();
    let c = agent(wasm_config(&[]), None, Some(cfg));
    assert_eq!(ecds(&c, &url, "nil", Some(&bad)).await, Out::Deny);
    assert_eq!(
        ecds(&c, &url, "nil", None).await,
        Out::Module(module.clone())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn token_auth_registries_are_pulled_through_the_bearer_realm() {
    let module = module();
    let tmp = tempfile::tempdir().unwrap();
    let signer = TokenSigner::new(tmp.path());
    let mut front = TokenFront::bind().await;
    let reg = OciRegistry::start_with(&signer.registry_auth_yaml(&front.realm()), None).await;
    front.serve(reg.addr, signer, "wasm", "s3cret");
    let layout = oci_layout(&tmp.path().join("img"), "v1", &module, false);
    let digest = reg.push_with(
        &layout,
        "v1",
        "wasm/private",
        &["--dest-creds", "wasm:s3cret"],
    );

    // The agent talks to the front, whose realm is on the registry's own host:port.
    let host = front.addr.to_string();
    let url = format!("oci://{host}/wasm/private:v1");
    let a = agent(wasm_config(&[]), None, None);
    let before = front.token_hits();
    let good = docker_config_json(&host, "wasm", "s3cret");
    expect_module(
        &a,
        &url,
        &digest,
        Some(&good),
        &module,
        &reg.proc.log_text(),
    )
    .await;
    assert!(front.token_hits() > before, "a token was requested");

    let b = agent(wasm_config(&[]), None, None);
    let bad = docker_config_json(&host, "wasm", "wrong");
    assert_eq!(ecds(&b, &url, "nil", Some(&bad)).await, Out::Deny);
    let e = get(&b, &url, Some(&bad)).await.unwrap_err();
    assert!(
        e.message.contains("token endpoint") && e.message.contains("401"),
        "{e}\nregistry log:\n{}",
        reg.proc.log_text()
    );
    assert_eq!(count(&b, "manifest_failure"), 2.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn https_module_servers_need_a_trusted_ca_or_an_insecure_entry() {
    let module = module();
    let tmp = tempfile::tempdir().unwrap();
    let ca = test_ca(tmp.path());
    let srv = TlsModServer::start(&ca, module.clone()).await;
    let url = srv.url("/hdr.wasm");
    let sha = sha256_hex(&module);

    // The test CA is in neither the system roots nor the mesh root: refused at the
    // handshake, naming the certificate problem; no request is sent.
    let a = agent(wasm_config(&[]), None, None);
    assert_eq!(ecds(&a, &url, &sha, None).await, Out::Deny);
    let e = get(&a, &url, None).await.unwrap_err();
    assert!(
        e.message.contains("TLS handshake") && e.message.contains("UnknownIssuer"),
        "{e}"
    );
    assert_eq!(srv.hits(), 0);
    assert_eq!(count(&a, "download_failure"), 2.0);

    // Trusted through the mesh root bundle (root-cert.pem), added to the system roots.
    let b = agent(wasm_config(&[]), Some(&ca.ca_pem), None);
    assert_eq!(
        ecds(&b, &url, &sha, None).await,
        Out::Module(module.clone())
    );
    // WASM_INSECURE_REGISTRIES: verification skipped for that host:port, as Istio's
    // `allowInsecure(u.Host)` picks its insecure client (a bare host also matches here).
    let c = agent(wasm_config(&[&srv.addr.to_string()]), None, None);
    assert_eq!(
        ecds(&c, &url, &sha, None).await,
        Out::Module(module.clone())
    );
    let d = agent(wasm_config(&["*"]), None, None);
    assert_eq!(
        ecds(&d, &url, &sha, None).await,
        Out::Module(module.clone())
    );
    assert_eq!(srv.hits(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn https_registries_with_an_untrusted_cert_need_an_insecure_entry() {
    let module = module();
    let tmp = tempfile::tempdir().unwrap();
    let ca = test_ca(tmp.path());
    let reg = OciRegistry::start_with("", Some((&ca.cert_pem, &ca.key_pem))).await;
    let layout = oci_layout(&tmp.path().join("img"), "v1", &module, true);
    let digest = reg.push_with(&layout, "v1", "wasm/tls", &[]);
    let url = format!("oci://{}/wasm/tls:v1", reg.addr);

    // Untrusted: the TLS failure is the error (also after the plain-HTTP fallback a
    // loopback registry gets, which a TLS port answers with 400).
    let a = agent(wasm_config(&[]), None, None);
    assert_eq!(ecds(&a, &url, &digest, None).await, Out::Deny);
    let e = get(&a, &url, None).await.unwrap_err();
    assert!(e.message.contains("UnknownIssuer"), "{e}");
    assert_eq!(count(&a, "manifest_failure"), 2.0);

    let c = agent(wasm_config(&[&reg.addr.to_string()]), None, None);
    assert_eq!(
        ecds(&c, &url, &digest, None).await,
        Out::Module(module.clone())
    );
    let b = agent(wasm_config(&[]), Some(&ca.ca_pem), None);
    assert_eq!(
        ecds(&b, &url, &digest, None).await,
        Out::Module(module.clone())
    );
}

/// go-containerregistry's keychain (`authn.DefaultKeychain`, docker/cli `config.Load`):
/// without a usable docker config the pull is anonymous; only a present, malformed file is
/// an error, and it names the file.
#[tokio::test(flavor = "multi_thread")]
async fn c2_oci_pulls_without_a_docker_config_are_anonymous() {
    let module = module();
    let reg = OciRegistry::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let layout = oci_layout(&tmp.path().join("img"), "v1", &module, true);
    reg.push(&layout, "v1", "wasm/public", false).await;
    let url = format!("oci://{}/wasm/public:v1", reg.addr);

    // HOME is an empty directory (a pod, a fresh machine).
    let home = tempfile::tempdir().unwrap();
    let cfg = home.path().join(".docker/config.json");
    let a = agent(wasm_config(&[]), None, Some(cfg.clone()));
    expect_module(&a, &url, "nil", None, &module, &reg.proc.log_text()).await;

    // Each of these is anonymous too; a fresh agent each time (nothing cached).
    let file_home = home.path().join("plain-file");
    std::fs::write(&file_home, "x").unwrap();
    let cases: Vec<(&str, PathBuf, Option<&str>)> = vec![
        ("no .docker directory", cfg.clone(), None),
        (
            "HOME does not exist",
            home.path().join("gone/.docker/config.json"),
            None,
        ),
        (
            "HOME is a file",
            file_home.join(".docker/config.json"),
            None,
        ),
        ("an empty file", cfg.clone(), Some("")),
        ("only whitespace", cfg.clone(), Some(" \n\t\n")),
    ];
    for (what, path, content) in cases {
        if let Some(c) = content {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, c).unwrap();
        }
        let a = agent(wasm_config(&[]), None, Some(path.clone()));
        let got = get(&a, &url, None).await;
        assert!(got.is_ok(), "{what} ({}): {got:?}", path.display());
        assert_eq!(count(&a, "success"), 1.0, "{what}");
    }

    // A present but malformed file: a clear error naming it, the fail strategy applies.
    std::fs::write(&cfg, "{\"auths\": ").unwrap();
    let b = agent(wasm_config(&[]), None, Some(cfg.clone()));
    assert_eq!(ecds(&b, &url, "nil", None).await, Out::Deny);
    let e = get(&b, &url, None).await.unwrap_err();
    assert!(
        e.message.contains(&*cfg.to_string_lossy()) && e.message.contains("docker config"),
        "{e}"
    );
    assert_eq!(count(&b, "manifest_failure"), 2.0);
}

/// A registry that needs credentials, with no docker config: the registry's refusal is the
/// error, not the missing file.
#[tokio::test(flavor = "multi_thread")]
async fn c2_missing_docker_config_reports_the_registrys_refusal() {
    let module = module();
    let tmp = tempfile::tempdir().unwrap();
    let pw = tmp.path().join("htpasswd");
    htpasswd(&pw, "wasm", "s3cret");
    let auth = format!(
        "auth:\n  htpasswd:\n    realm: meshagent-test\n    path: {}\n",
        pw.display()
    );
    let reg = OciRegistry::start_with(&auth, None).await;
    let layout = oci_layout(&tmp.path().join("img"), "v1", &module, true);
    reg.push_with(
        &layout,
        "v1",
        "wasm/private",
        &["--dest-creds", "wasm:s3cret"],
    );
    let url = format!("oci://{}/wasm/private:v1", reg.addr);
    let home = tempfile::tempdir().unwrap();
    let a = agent(
        wasm_config(&[]),
        None,
        Some(home.path().join(".docker/config.json")),
    );
    let e = get(&a, &url, None).await.unwrap_err();
    assert!(e.message.contains("registry requires credentials"), "{e}");
    assert!(!e.message.contains("docker config"), "{e}");
    // A pull secret still works next to the missing keychain.
    let good = docker_config_json(&reg.addr.to_string(), "wasm", "s3cret");
    expect_module(&a, &url, "nil", Some(&good), &module, &reg.proc.log_text()).await;
}
