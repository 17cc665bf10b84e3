#![allow(
    clippy::disallowed_methods,
    reason = "test code, not on the agent's runtime"
)]
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use tempfile::TempDir;

use super::*;

/// A temp dir to act as the agent's cwd, with helpers to place files in it.
struct Fixture {
    dir: TempDir,
    flags: ProxyFlags,
    env: Vec<(String, String)>,
}

impl Fixture {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            flags: ProxyFlags::default(),
            env: Vec::new(),
        }
    }

    fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    fn file(self, rel: &str, content: &str) -> Self {
        let path = self.dir.path().join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
        self
    }

    fn mesh(self, yaml: &str) -> Self {
        self.file("etc/istio/config/mesh", yaml)
    }

    /// Writes pod annotations in downward-API form (Go-quoted values).
    fn annotations(self, pairs: &[(&str, &str)]) -> Self {
        let text: String = pairs
            .iter()
            .map(|(k, v)| format!("{k}={}\n", serde_json::to_string(v).unwrap()))
            .collect();
        self.file("etc/istio/pod/annotations", &text)
    }

    fn load(&self) -> Result<Config, ConfigError> {
        load(
            &self.flags,
            &MapEnv::from_pairs(self.env.clone()),
            self.dir.path(),
        )
    }

    fn ok(&self) -> Config {
        self.load()
            .unwrap_or_else(|e| panic!("unexpected error: {e}"))
    }

    /// The error a start fails with: loading, then preflight (as `main` runs them).
    fn err(&self) -> String {
        match self.load() {
            Ok(c) => match crate::preflight::plan(&c, self.dir.path()) {
                Ok(_) => panic!("expected an error"),
                Err(e) => e.to_string(),
            },
            Err(e) => e.to_string(),
        }
    }
}

fn assert_contains(haystack: &str, needles: &[&str]) {
    for n in needles {
        assert!(haystack.contains(n), "{n:?} not in {haystack:?}");
    }
}

// === defaults ===

#[test]
fn proxy_config_defaults() {
    let pc = Fixture::new().ok().proxy_config;
    assert_eq!(pc.config_path, Path::new("./etc/istio/proxy"));
    assert_eq!(pc.binary_path, Path::new("/usr/local/bin/envoy"));
    assert_eq!(pc.service_cluster, "istio-proxy");
    assert_eq!(pc.drain_duration.get(), Duration::from_secs(45));
    assert_eq!(pc.termination_drain_duration.get(), Duration::from_secs(5));
    assert_eq!(pc.proxy_admin_port, 15000);
    assert_eq!(
        pc.control_plane_auth_policy,
        AuthenticationPolicy::MutualTls
    );
    assert_eq!(pc.discovery_address, "istiod.istio-system.svc:15012");
    assert_eq!(pc.stat_name_length, 189);
    assert_eq!(pc.status_port, 15020);
    assert_eq!(pc.concurrency, None);
    assert_eq!(pc.interception_mode, InterceptionMode::Redirect);
    assert!(pc.proxy_metadata.is_empty());
}

#[test]
fn env_defaults() {
    let c = Fixture::new().ok();
    assert_eq!(c.proxy_type, ProxyType::Sidecar);
    assert_eq!(c.domain, ".svc.cluster.local");
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);

    assert_eq!(c.pod.name, "");
    assert_eq!(c.pod.instance_ip, None);
    assert_eq!(c.pod.cpu_limit, 0);

    let id = &c.identity;
    assert_eq!(id.ca_addr, "istiod.istio-system.svc:15012");
    assert!(!id.ca_addr_set);
    assert_eq!(id.ca_provider, "Citadel");
    assert_eq!(id.pilot_cert_provider, "istiod");
    assert_eq!(id.trust_domain, "cluster.local");
    assert_eq!(id.secret_ttl, Duration::from_secs(24 * 3600));
    assert_eq!(id.secret_grace_period_ratio, 0.5);
    assert_eq!(id.secret_grace_period_ratio_jitter, 0.01);
    assert_eq!(id.workload_rsa_key_size, 2048);
    assert_eq!(id.ecc_curve, EccCurve::P256);
    assert!(!id.pkcs8_key && !id.file_mounted_certs);
    assert_eq!(id.output_certs, None);
    assert_eq!(id.jwt_policy, "third-party-jwt");
    assert_eq!(id.jwt_path.as_deref(), Some(Path::new(ISTIO_TOKEN_PATH)));
    assert_eq!(id.credential_fetcher_type, "JWT");
    assert_eq!(id.credential_identity_provider, "GoogleComputeEngine");
    assert_eq!(id.workload_identity_socket_file, "socket");
    assert_eq!(id.token_audiences, vec!["istio-ca"]);
    assert_eq!(id.file_debounce_duration, Duration::from_millis(100));
    assert!(id.pilot_enable_ca_crl);

    assert!(c.xds.delta_xds && !c.xds.proxy_config_xds_agent);
    assert_eq!(c.xds.keepalive_interval, Duration::from_secs(30));
    assert_eq!(c.xds.keepalive_timeout, Duration::from_secs(10));
    assert_eq!(c.xds.max_streams, 100_000);
    assert_eq!(c.xds.max_recv_msg_size, 4 * 1024 * 1024);

    let b = &c.bootstrap;
    assert_eq!(
        (
            b.envoy_status_port,
            b.envoy_prometheus_port,
            b.envoy_secure_metrics_port,
            b.envoy_secure_merged_metrics_port
        ),
        (15021, 15090, 0, 0)
    );
    assert!(b.envoy_skip_deprecated_logs && b.http_strip_fragment_from_path);
    assert!(!b.dual_stack && !b.envoy_enable_core_dump && !b.enable_self_discovery);
    assert_eq!(b.peer_metadata_discovery, None);

    assert_eq!(c.lifecycle.minimum_drain_duration, Duration::from_secs(5));
    assert!(!c.lifecycle.exit_on_zero_active_connections && !c.lifecycle.disable_envoy);
    assert_eq!(c.lifecycle.drain_start_delay, Duration::ZERO);

    assert!(c.status.enable_http2_probing && c.status.merge_envoy_stats);
    assert!(!c.status.metrics_localhost_access_only);
    assert!(c.status.kube_app_probers.is_empty());

    assert_eq!(c.dns.proxy_addr, "localhost:15053");
    assert!(!c.dns.proxy_addr_set && !c.dns.capture && !c.dns.forward_parallel);
    assert_eq!(c.dns.forward_timeout, Duration::from_secs(5));

    assert_eq!(c.wasm.module_expiry, Duration::from_secs(24 * 3600));
    assert_eq!(c.wasm.purge_interval, Duration::from_secs(3600));
    assert_eq!(c.wasm.http_request_timeout, Duration::from_secs(15));
    assert_eq!(c.wasm.http_request_max_retries, 5);
    assert_eq!(c.wasm.max_binary_size_bytes, 256 * 1024 * 1024);
    assert!(c.wasm.remote_load_conversion);
    assert!(c.wasm.insecure_registries.is_empty());

    assert_eq!(
        c.grpc.xds_bootstrap,
        Path::new("./etc/istio/proxy/grpc-bootstrap.json")
    );
}

#[test]
fn empty_typed_values_mean_default() {
    // Istio's rule: "" is not a bool, int or duration, so it warns and uses the default.
    let c = Fixture::new()
        .env("SECRET_TTL", "")
        .env("ISTIO_DELTA_XDS", "")
        .env("ENVOY_STATUS_PORT", "")
        .ok();
    assert_eq!(c.identity.secret_ttl, Duration::from_secs(24 * 3600));
    assert!(c.xds.delta_xds);
    assert_eq!(c.bootstrap.envoy_status_port, 15021);
    assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
}

#[test]
fn empty_strings_are_empty_not_the_default() {
    // GRPC_XDS_BOOTSTRAP="" turns the gRPC bootstrap off; DNS_PROXY_ADDR="" falls back.
    let c = Fixture::new()
        .env("GRPC_XDS_BOOTSTRAP", "")
        .env("TRUST_DOMAIN", "")
        .env("DNS_PROXY_ADDR", "")
        .env("ISTIO_META_DNS_CAPTURE", "true")
        .ok();
    assert_eq!(c.grpc.xds_bootstrap, PathBuf::new());
    assert_eq!(c.identity.trust_domain, "");
    assert_eq!(c.dns.proxy_addr, "localhost:15053");
    assert!(!c.dns.proxy_addr_set);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

/// Istio `pkg/env/var.go` `Lookup`: a scalar that does not parse logs "Invalid environment
/// variable value …, defaulting to …" and the default is used; loading succeeds.
#[test]
fn unparsable_scalars_warn_and_use_the_default() {
    type Field = fn(&Config) -> String;
    let cases: &[(&str, &str, &str, Field)] = &[
        ("SECRET_TTL", "abc", "24h0m0s", |c| {
            format!("{:?}", c.identity.secret_ttl)
        }),
        ("SECRET_TTL", "-1h", "24h0m0s", |c| {
            format!("{:?}", c.identity.secret_ttl)
        }),
        ("DNS_FORWARD_TIMEOUT", "5", "5s", |c| {
            format!("{:?}", c.dns.forward_timeout)
        }),
        ("PKCS8_KEY", "yes", "false", |c| {
            c.identity.pkcs8_key.to_string()
        }),
        ("ISTIO_DELTA_XDS", "on", "true", |c| {
            c.xds.delta_xds.to_string()
        }),
        ("PEER_METADATA_DISCOVERY", "maybe", "unset", |c| {
            format!("{:?}", c.bootstrap.peer_metadata_discovery)
        }),
        ("WASM_HTTP_REQUEST_MAX_RETRIES", "x", "5", |c| {
            c.wasm.http_request_max_retries.to_string()
        }),
        ("ENVOY_STATUS_PORT", "http", "15021", |c| {
            c.bootstrap.envoy_status_port.to_string()
        }),
        ("WORKLOAD_RSA_KEY_SIZE", "big", "2048", |c| {
            c.identity.workload_rsa_key_size.to_string()
        }),
        ("SECRET_GRACE_PERIOD_RATIO", "half", "0.5", |c| {
            c.identity.secret_grace_period_ratio.to_string()
        }),
    ];
    let defaults = Fixture::new().ok();
    for (name, value, shown, field) in cases {
        let c = Fixture::new().env(name, value).ok();
        assert_eq!(field(&c), field(&defaults), "{name}={value}");
        assert_eq!(c.warnings.len(), 1, "{name}: {:?}", c.warnings);
        assert_contains(
            &c.warnings[0],
            &[
                &format!("Invalid environment variable value {name}={value:?}"),
                &format!("defaulting to {shown}"),
            ],
        );
    }
}

#[test]
fn env_values_are_read() {
    let c = Fixture::new()
        .env("POD_NAME", "app-1")
        .env("POD_NAMESPACE", "prod")
        .env("INSTANCE_IP", "10.1.2.3")
        .env("SECRET_TTL", "1h30m")
        .env("SECRET_GRACE_PERIOD_RATIO", "0.25")
        .env("ECC_CURVE", "P384")
        .env("PKCS8_KEY", "T")
        .env("OUTPUT_CERTS", "/var/lib/istio/data")
        .env("TOKEN_AUDIENCES", "a, b,,c")
        .env("DNS_PROXY_ADDR", ":53")
        .env("WASM_INSECURE_REGISTRIES", "*")
        .env("BLOCKED_CIDRS_IN_WASM_FETCH", "10.0.0.0/8,fd00::/8")
        .env(
            "ISTIO_KUBE_APP_PROBERS",
            r#"{"/app-health/x/livez":{"tcpSocket":{"port":80}}}"#,
        )
        .env("PEER_METADATA_DISCOVERY", "false")
        .ok();
    assert_eq!(c.domain, "prod.svc.cluster.local");
    assert_eq!(c.pod.instance_ip, Some("10.1.2.3".parse().unwrap()));
    assert_eq!(c.identity.secret_ttl, Duration::from_secs(5400));
    assert_eq!(c.identity.secret_grace_period_ratio, 0.25);
    assert_eq!(c.identity.ecc_curve, EccCurve::P384);
    assert!(c.identity.pkcs8_key);
    assert_eq!(
        c.identity.output_certs,
        Some(PathBuf::from("/var/lib/istio/data"))
    );
    assert_eq!(c.identity.token_audiences, vec!["a", "b", "c"]);
    assert_eq!(c.dns.proxy_addr, ":53");
    assert!(c.dns.proxy_addr_set);
    assert_eq!(c.wasm.insecure_registries, vec!["*"]);
    assert_eq!(c.wasm.blocked_cidrs.len(), 2);
    assert_eq!(c.status.kube_app_probers.len(), 1);
    assert_eq!(c.bootstrap.peer_metadata_discovery, Some(false));
}

#[test]
fn explicit_domain_flag_wins() {
    let mut f = Fixture::new().env("POD_NAMESPACE", "prod");
    f.flags.domain = "example.org".to_owned();
    assert_eq!(f.ok().domain, "example.org");
}

#[test]
fn ecc_curve_other_values_mean_p256() {
    let c = Fixture::new().env("ECC_CURVE", "P521").ok();
    assert_eq!(c.identity.ecc_curve, EccCurve::P256);
}

#[test]
fn jwt_policies() {
    for (policy, path) in [
        ("third-party-jwt", Some(ISTIO_TOKEN_PATH)),
        ("first-party-jwt", Some(ISTIO_TOKEN_PATH)),
        ("none", None),
    ] {
        let c = Fixture::new().env("JWT_POLICY", policy).ok();
        assert_eq!(
            c.identity.jwt_path.as_deref(),
            path.map(Path::new),
            "{policy}"
        );
    }
}

// === derived values ===

#[test]
fn ca_addr_derivation() {
    // Falls back to the effective discoveryAddress, annotation override included.
    let c = Fixture::new()
        .annotations(&[(
            ANNOTATION_DISCOVERY_ADDRESS,
            "istiod-canary.istio-system.svc:15012",
        )])
        .ok();
    assert_eq!(c.identity.ca_addr, "istiod-canary.istio-system.svc:15012");
    assert!(!c.identity.ca_addr_set);

    let c = Fixture::new().env("CA_ADDR", "ca.example:443").ok();
    assert_eq!(c.identity.ca_addr, "ca.example:443");
    assert!(c.identity.ca_addr_set);
    assert_eq!(c.identity.ca_provider, "Citadel");

    // GoogleCA is selected, and it is not in open-source Istio: a start with a CA fails, so
    // loading does too; with file-mounted certificates no CA is called and it loads.
    let f = Fixture::new().env("CA_ADDR", "meshca.googleapis.com:443");
    assert_eq!(
        f.err(),
        "CA_PROVIDER GoogleCA is not supported (only Citadel, as in open-source Istio)"
    );
    let c = f.env("FILE_MOUNTED_CERTS", "true").ok();
    assert_eq!(c.identity.ca_provider, "GoogleCA");
}

#[test]
fn prefix_families() {
    let c = Fixture::new()
        .env("CA_HEADER_X-Tenant", "t1")
        .env("XDS_HEADER_Authorization-Extra", "x")
        .env("ISTIO_META_CLUSTER_ID", "Kubernetes")
        .env("ISTIO_META_DNS_CAPTURE", "true")
        .env("ISTIO_META_", "ignored")
        .env("ISTIO_METAJSON_LABELS", r#"{"app":"web"}"#)
        .ok();
    assert_eq!(
        c.identity.ca_headers,
        BTreeMap::from([("X-Tenant".to_owned(), "t1".to_owned())])
    );
    assert_eq!(
        c.xds.headers,
        BTreeMap::from([("Authorization-Extra".to_owned(), "x".to_owned())])
    );
    assert_eq!(
        c.bootstrap.node_meta,
        BTreeMap::from([
            ("CLUSTER_ID".to_owned(), "Kubernetes".to_owned()),
            ("DNS_CAPTURE".to_owned(), "true".to_owned()),
        ])
    );
    assert_eq!(
        c.bootstrap.node_meta_json,
        BTreeMap::from([("LABELS".to_owned(), r#"{"app":"web"}"#.to_owned())])
    );
    assert_eq!(c.identity.cluster_id, "Kubernetes");
    assert!(c.dns.capture);
}

#[test]
fn header_values_are_redacted_when_serialized() {
    let c = Fixture::new()
        .env("CA_HEADER_Authorization", "Bearer ca-credential-1")
        .env("XDS_HEADER_X-Api-Key", "xds-credential-2")
        .ok();
    // The agent itself still has the values ...
    assert_eq!(
        c.identity.ca_headers["Authorization"],
        "Bearer ca-credential-1"
    );
    assert_eq!(c.xds.headers["X-Api-Key"], "xds-credential-2");
    // ... but what is logged and served on /debug/config_dump names them only.
    let v = serde_json::to_value(&c).unwrap();
    let text = v.to_string();
    assert!(!text.contains("credential-"), "{text}");
    assert_eq!(v["identity"]["caHeaders"]["Authorization"], "<redacted>");
    assert_eq!(v["xds"]["headers"]["X-Api-Key"], "<redacted>");
}

/// An environment in which some variables are set to bytes that are not UTF-8.
struct NotUnicodeEnv {
    env: MapEnv,
    bad: Vec<&'static str>,
}

impl EnvSource for NotUnicodeEnv {
    fn get(&self, key: &str) -> Option<String> {
        self.env.get(key)
    }
    fn vars(&self) -> Vec<(String, String)> {
        self.env.vars()
    }
    fn not_unicode(&self) -> Vec<String> {
        self.bad.iter().map(|s| (*s).to_owned()).collect()
    }
}

#[test]
fn non_utf8_values_of_variables_the_agent_reads_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let load_with = |bad: Vec<&'static str>| {
        let env = NotUnicodeEnv {
            env: MapEnv::from_pairs([("POD_NAMESPACE", "shop")]),
            bad,
        };
        load(&ProxyFlags::default(), &env, dir.path())
    };
    // Single variables, prefix families, and PROXY_CONFIG (read before everything else).
    for name in [
        "PROXY_CONFIG",
        "SECRET_TTL",
        "POD_NAME",
        "CA_HEADER_X-Token",
        "ISTIO_META_\u{fffd}",
    ] {
        assert_eq!(
            load_with(vec![name]).unwrap_err(),
            ConfigError::NotUnicode {
                name: name.to_owned()
            },
            "{name}"
        );
    }
    let e = load_with(vec!["PROXY_CONFIG", "XDS_HEADER_A"]).unwrap_err();
    assert_contains(
        &e.to_string(),
        &[
            "environment variable PROXY_CONFIG is not valid UTF-8",
            "environment variable XDS_HEADER_A is not valid UTF-8",
        ],
    );
    // Variables the agent does not read are none of its business.
    assert!(load_with(vec!["LS_COLORS", "PROXY_CONFIGX"]).is_ok());
}

// === layering ===

#[test]
fn layer_precedence() {
    let f = Fixture::new()
        .mesh(
            "accessLogFile: /dev/stdout\n\
             defaultConfig:\n  drainDuration: 10s\n  statNameLength: 100\n  meshId: from-mesh\n  \
             discoveryAddress: mesh:15012\n  proxyMetadata: {A: '1', B: '2'}\n  extraStatTags: [x, y]\n",
        )
        .env(
            "PROXY_CONFIG",
            r#"{"statNameLength": 200, "meshId": "from-env", "discoveryAddress": "env:15012", "proxyMetadata": {"C": "3"}}"#,
        )
        .annotations(&[(
            ANNOTATION_PROXY_CONFIG,
            "meshId: from-annotation\ndiscoveryAddress: anno:15012\nextraStatTags: [z]\n",
        )]);
    let pc = f.ok().proxy_config;
    assert_eq!(pc.drain_duration.get(), Duration::from_secs(10)); // mesh only
    assert_eq!(pc.stat_name_length, 200); // env beats mesh
    assert_eq!(pc.mesh_id, "from-annotation"); // annotation beats env
    assert_eq!(pc.discovery_address, "anno:15012");
    // proxyMetadata merges key by key (Istio's MergeProxyConfig); lists are replaced.
    assert_eq!(
        pc.proxy_metadata,
        BTreeMap::from([
            ("A".to_owned(), "1".to_owned()),
            ("B".to_owned(), "2".to_owned()),
            ("C".to_owned(), "3".to_owned())
        ])
    );
    assert_eq!(pc.extra_stat_tags, vec!["z"]);
    // Untouched fields keep built-in defaults.
    assert_eq!(pc.proxy_admin_port, 15000);

    // The discoveryAddress annotation beats every ProxyConfig layer.
    let f = f.annotations(&[
        (ANNOTATION_PROXY_CONFIG, "discoveryAddress: anno:15012"),
        (ANNOTATION_DISCOVERY_ADDRESS, "direct:15012"),
    ]);
    assert_eq!(f.ok().proxy_config.discovery_address, "direct:15012");
}

#[test]
fn status_port_annotation_overrides() {
    let c = Fixture::new()
        .env("PROXY_CONFIG", "statusPort: 15999")
        .annotations(&[
            (ANNOTATION_PROXY_CONFIG, "statusPort: 15888"),
            (ANNOTATION_STATUS_PORT, "0"),
        ])
        .ok();
    assert_eq!(c.proxy_config.status_port, 0);

    let err = Fixture::new()
        .annotations(&[(ANNOTATION_STATUS_PORT, "http")])
        .err();
    assert_contains(&err, &[ANNOTATION_STATUS_PORT, "\"http\"", "port number"]);
}

#[test]
fn concurrency_rules() {
    // (PROXY_CONFIG, ISTIO_CPU_LIMIT, --concurrency) -> effective
    let cases: &[(Option<&str>, &str, u32, Option<u32>)] = &[
        (None, "0", 0, None),
        (None, "4", 0, Some(4)),
        (Some("concurrency: 2"), "4", 0, Some(2)),
        (Some("concurrency: 0"), "4", 0, Some(0)),
        (None, "4", 8, Some(8)),
        (Some("concurrency: 2"), "0", 3, Some(3)),
    ];
    for (proxy_config, cpu, flag, want) in cases {
        let mut f = Fixture::new().env("ISTIO_CPU_LIMIT", cpu);
        if let Some(pc) = proxy_config {
            f = f.env("PROXY_CONFIG", pc);
        }
        f.flags.concurrency = *flag;
        let c = f.ok();
        assert_eq!(
            c.proxy_config.concurrency, *want,
            "{proxy_config:?} {cpu} {flag}"
        );
        if *flag != 0 {
            assert!(c.warnings.iter().any(|w| w.contains("--concurrency")));
        }
    }
}

#[test]
fn service_cluster_flag_fills_empty_value() {
    let mut f = Fixture::new().env("PROXY_CONFIG", r#"serviceCluster: """#);
    f.flags.service_cluster = "from-flag".to_owned();
    assert_eq!(f.ok().proxy_config.service_cluster, "from-flag");

    let mut f = Fixture::new().env("PROXY_CONFIG", "serviceCluster: mine");
    f.flags.service_cluster = "from-flag".to_owned();
    assert_eq!(f.ok().proxy_config.service_cluster, "mine");

    // tracingServiceName is the other arm of the same oneof: no fill-in.
    let mut f = Fixture::new().env("PROXY_CONFIG", "tracingServiceName: CANONICAL_NAME_ONLY");
    f.flags.service_cluster = "from-flag".to_owned();
    let pc = f.ok().proxy_config;
    assert_eq!(pc.service_cluster, "");
    assert_eq!(
        pc.tracing_service_name.as_deref(),
        Some("CANONICAL_NAME_ONLY")
    );
}

#[test]
fn template_file_flag() {
    // The flag fills proxyBootstrapTemplatePath; a start reads the template, so loading reads
    // it too and a missing file fails with the start's message.
    let mut f = Fixture::new();
    f.flags.template_file = PathBuf::from("/t.json");
    assert_contains(
        &f.err(),
        &["cannot read bootstrap template /t.json (ProxyConfig proxyBootstrapTemplatePath)"],
    );

    let mut f = Fixture::new().env("PROXY_CONFIG", "customConfigFile: /envoy.yaml");
    f.flags.template_file = PathBuf::from("/t.json");
    assert_eq!(
        f.ok().proxy_config.proxy_bootstrap_template_path,
        Path::new("")
    );
}

#[test]
fn proto_json_forms_are_accepted() {
    let c = Fixture::new()
        .env(
            "PROXY_CONFIG",
            r#"{"concurrency": "2", "control_plane_auth_policy": 0, "interceptionMode": "TPROXY",
                "terminationDrainDuration": "0.100s", "holdApplicationUntilProxyStarts": true,
                "proxyStatsMatcher": {"inclusionPrefixes": ["cluster.outbound"]},
                "tracing": {"zipkin": {"address": "zipkin:9411"}}, "gatewayTopology": {"numTrustedProxies": 1}}"#,
        )
        .ok();
    let pc = &c.proxy_config;
    assert_eq!(pc.concurrency, Some(2));
    assert_eq!(pc.control_plane_auth_policy, AuthenticationPolicy::None);
    assert_eq!(pc.interception_mode, InterceptionMode::Tproxy);
    assert_eq!(
        pc.termination_drain_duration.get(),
        Duration::from_millis(100)
    );
    assert_eq!(pc.hold_application_until_proxy_starts, Some(true));
    assert_eq!(
        pc.proxy_stats_matcher.as_ref().unwrap().inclusion_prefixes,
        vec!["cluster.outbound"]
    );
    assert!(pc.tracing.is_some());
    assert!(pc.passthrough.contains_key("gatewayTopology"));
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn unknown_proxy_config_fields_warn() {
    let c = Fixture::new()
        .env("PROXY_CONFIG", "futureField: 1\nanotherOne: x\nmeshId: m")
        .ok();
    assert_eq!(c.proxy_config.mesh_id, "m");
    assert_eq!(c.warnings.len(), 1);
    assert_contains(
        &c.warnings[0],
        &["PROXY_CONFIG", "futureField", "anotherOne"],
    );
}

#[test]
fn missing_files_are_fine_and_annotations_are_kept() {
    let c = Fixture::new()
        .file(
            "etc/istio/pod/annotations",
            "kubectl.kubernetes.io/default-container=\"app\"\n\
             proxy.istio.io/config=\"holdApplicationUntilProxyStarts: true\\nmeshId: \\\"q\\\"\\n\"\n\
             no-equals-line\n",
        )
        .ok();
    assert_eq!(c.proxy_config.mesh_id, "q");
    assert_eq!(
        c.proxy_config.hold_application_until_proxy_starts,
        Some(true)
    );
    assert_eq!(
        c.pod_annotations
            .get("kubectl.kubernetes.io/default-container")
            .map(String::as_str),
        Some("app")
    );
}

// === bad input ===

#[test]
fn bad_probers_and_prometheus_annotations_name_the_problem() {
    let cases: &[(&str, &str, &[&str])] = &[
        ("ISTIO_KUBE_APP_PROBERS", "[1]", &["JSON object"]),
        (
            "ISTIO_KUBE_APP_PROBERS",
            r#"{"/app-health/c/bogus":{"tcpSocket":{"port":1}}}"#,
            &["invalid key \"/app-health/c/bogus\""],
        ),
        (
            "ISTIO_KUBE_APP_PROBERS",
            r#"{"/app-health/c/livez":{"httpGet":{"port":"http"}}}"#,
            &["/app-health/c/livez", "httpGet.port", "integer"],
        ),
        ("ISTIO_PROMETHEUS_ANNOTATIONS", "{", &["not valid JSON"]),
        (
            "ISTIO_PROMETHEUS_ANNOTATIONS",
            r#"{"scrape":"true","port":"15020"}"#,
            &["status port"],
        ),
    ];
    for (name, value, expected) in cases {
        let err = Fixture::new().env(name, value).err();
        assert_contains(&err, &[name]);
        assert_contains(&err, expected);
    }
}

#[test]
fn bad_env_values() {
    // Values that parse but that the agent cannot run with: errors naming the variable,
    // the value and what was expected.
    let cases: &[(&str, &str, &[&str])] = &[
        ("SECRET_GRACE_PERIOD_RATIO", "1.5", &["between 0 and 1"]),
        (
            "SECRET_GRACE_PERIOD_RATIO_JITTER",
            "-0.1",
            &["between 0 and 1"],
        ),
        ("SECRET_GRACE_PERIOD_RATIO", "NaN", &["between 0 and 1"]),
        (
            "WORKLOAD_IDENTITY_SOCKET_FILE",
            "dir/socket",
            &["bare file name"],
        ),
        ("ENVOY_STATUS_PORT", "70000", &["between 0 and 65535"]),
        ("ISTIO_CPU_LIMIT", "-1", &["integer between 0"]),
        ("ISTIO_GPRC_MAXSTREAMS", "0", &["integer between 1"]),
        ("INSTANCE_IP", "10.0.0", &["IPv4 or IPv6"]),
        ("ISTIO_METAJSON_LABELS", "\"str\"", &["JSON object"]),
        ("BLOCKED_CIDRS_IN_WASM_FETCH", "10.0.0.0/33", &["CIDR"]),
        ("CREDENTIAL_FETCHER_TYPE", "GoogleComputeEngine", &["JWT"]),
    ];
    for (name, value, expected) in cases {
        let err = Fixture::new().env(name, value).err();
        assert_contains(&err, &[name, &format!("{value:?}")]);
        assert_contains(&err, expected);
    }
}

/// What a start would reject fails loading, with the start's own message.
#[test]
fn start_time_checks_run_at_load() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[("CA_PROVIDER", "GoogleCA")],
            "CA_PROVIDER GoogleCA is not supported (only Citadel, as in open-source Istio)",
        ),
        // One message for every size refused, below Istio's minimum or not generated here.
        (
            &[("WORKLOAD_RSA_KEY_SIZE", "2049")],
            "unsupported WORKLOAD_RSA_KEY_SIZE 2049: expected 2048, 3072 or 4096 (this build generates 2048, 3072 or 4096-bit keys; Istio requires at least 2048)",
        ),
        (
            &[("WORKLOAD_RSA_KEY_SIZE", "1024")],
            "unsupported WORKLOAD_RSA_KEY_SIZE 1024: expected 2048, 3072 or 4096 (this build generates 2048, 3072 or 4096-bit keys; Istio requires at least 2048)",
        ),
        (
            &[("WORKLOAD_RSA_KEY_SIZE", "-1")],
            "unsupported WORKLOAD_RSA_KEY_SIZE -1: expected 2048, 3072 or 4096 (this build",
        ),
        (
            &[("WORKLOAD_RSA_KEY_SIZE", "99999999999")],
            "unsupported WORKLOAD_RSA_KEY_SIZE 99999999999: expected 2048, 3072 or 4096 (this build",
        ),
        (
            &[("CA_ADDR", "ca.example")],
            "invalid control plane address \"ca.example\": expected host:port",
        ),
        (
            &[("PILOT_CERT_PROVIDER", "none")],
            "TLS is required for the CA but PILOT_CERT_PROVIDER=none gives no root certificate",
        ),
        (
            &[("ISTIO_BOOTSTRAP", "/custom.json")],
            "cannot read bootstrap template /custom.json (ISTIO_BOOTSTRAP)",
        ),
        (
            &[
                ("ISTIO_META_DNS_CAPTURE", "true"),
                ("DNS_PROXY_ADDR", "localhost"),
            ],
            "invalid DNS_PROXY_ADDR=\"localhost\": expected host:port",
        ),
    ];
    for (env, want) in cases {
        let mut f = Fixture::new();
        for (k, v) in *env {
            f = f.env(k, v);
        }
        assert_contains(&f.err(), &[want]);
    }
    // The bootstrap override file is read as Envoy's start reads it.
    let f = Fixture::new().env("ISTIO_BOOTSTRAP_OVERRIDE", "override.yaml");
    assert_contains(
        &f.err(),
        &["cannot read ISTIO_BOOTSTRAP_OVERRIDE file", "override.yaml"],
    );
    let f = f.file("override.yaml", "a: [b");
    assert_contains(&f.err(), &["override.yaml: not YAML/JSON"]);
    let f = f.file("override.yaml", "stats_flush_interval: 5s");
    f.ok();
    f.env("DISABLE_ENVOY", "true")
        .file("override.yaml", "a: [b")
        .ok();
    // The CA checks apply only when the start would use the CA.
    let c = Fixture::new()
        .env("CA_PROVIDER", "GkeWorkloadCertificate")
        .env("WORKLOAD_RSA_KEY_SIZE", "2049")
        .env("FILE_MOUNTED_CERTS", "true")
        .ok();
    assert_eq!(c.identity.ca_provider, "GkeWorkloadCertificate");
    // ECDSA keys: the RSA size is not used.
    Fixture::new()
        .env("ECC_SIGNATURE_ALGORITHM", "ECDSA")
        .env("WORKLOAD_RSA_KEY_SIZE", "2049")
        .ok();
    // DNS_PROXY_ADDR only matters when the DNS proxy starts.
    Fixture::new().env("DNS_PROXY_ADDR", "localhost").ok();
    for ok in ["localhost:15053", ":53", "[::1]:15053", "127.0.0.1:0"] {
        Fixture::new()
            .env("ISTIO_META_DNS_CAPTURE", "true")
            .env("DNS_PROXY_ADDR", ok)
            .ok();
    }
}

#[test]
fn bad_proxy_config_values() {
    let cases: &[(&str, &[&str])] = &[
        (
            "drainDuration: 45",
            &["drainDuration", "45", "duration string"],
        ),
        (
            "drainDuration: 1m",
            &["drainDuration", "1m", "duration string"],
        ),
        ("concurrency: -1", &["concurrency", "-1", "non-negative"]),
        (
            "proxyAdminPort: 70000",
            &["proxyAdminPort", "70000", "port number"],
        ),
        (
            "controlPlaneAuthPolicy: FOO",
            &["controlPlaneAuthPolicy", "FOO", "MUTUAL_TLS"],
        ),
        (
            "tracing: {zipkin: {address: z}, tlsSettings: {mode: SOMETIMES}}",
            &["tracing", "SOMETIMES", "ISTIO_MUTUAL"],
        ),
        (
            "controlPlaneAuthPolicy: INHERIT",
            &["controlPlaneAuthPolicy", "INHERIT", "MUTUAL_TLS"],
        ),
        (
            "interceptionMode: IPVS",
            &["interceptionMode", "IPVS", "TPROXY"],
        ),
        (
            "proxyMetadata: {A: 1}",
            &["proxyMetadata", "map of string to string"],
        ),
        ("extraStatTags: abc", &["extraStatTags", "list of strings"]),
        ("tracing: zipkin", &["tracing", "an object"]),
        (
            "proxyStatsMatcher: {inclusionPrefixes: 7}",
            &["proxyStatsMatcher", "7"],
        ),
        // Nested messages are Istio's types, checked field by field.
        (
            "connectionSettings: {httpIdleTimeout: 5}",
            &["connectionSettings", "duration"],
        ),
        (
            "readinessProbe: {periodSeconds: x}",
            &["readinessProbe", "periodSeconds"],
        ),
        ("[1, 2]", &["expected a ProxyConfig object"]),
        ("a: [", &["cannot parse"]),
    ];
    for (doc, needles) in cases {
        let err = Fixture::new().env("PROXY_CONFIG", doc).err();
        assert_contains(&err, &["PROXY_CONFIG"]);
        assert_contains(&err, needles);
    }
}

#[test]
fn proxy_config_validation() {
    let err = Fixture::new()
        .env("PROXY_CONFIG", "discoveryAddress: nohostport")
        .err();
    assert_contains(&err, &["discoveryAddress", "nohostport", "host:port"]);
    let err = Fixture::new()
        .env("PROXY_CONFIG", "drainDuration: 0s")
        .err();
    assert_contains(&err, &["drainDuration", "at least 1ms"]);
    let err = Fixture::new()
        .env("PROXY_CONFIG", "proxyAdminPort: 0")
        .err();
    assert_contains(&err, &["proxyAdminPort"]);
}

#[test]
fn drain_start_delay_is_validated() {
    let c = Fixture::new()
        .env("MESHAGENT_DRAIN_START_DELAY", "1500ms")
        .ok();
    assert_eq!(c.lifecycle.drain_start_delay, Duration::from_millis(1500));
    for bad in ["5", "-1s", "2h", "soon"] {
        let err = Fixture::new().env("MESHAGENT_DRAIN_START_DELAY", bad).err();
        assert_contains(
            &err,
            &["MESHAGENT_DRAIN_START_DELAY", bad, "between 0s and 1h"],
        );
    }
}

#[test]
fn errors_name_their_source() {
    let err = Fixture::new()
        .mesh("defaultConfig:\n  statusPort: abc\n")
        .err();
    assert_contains(
        &err,
        &[
            "mesh config file ./etc/istio/config/mesh",
            "statusPort",
            "abc",
        ],
    );

    let err = Fixture::new().mesh("defaultConfig: [\n").err();
    assert_contains(
        &err,
        &["cannot parse mesh config file ./etc/istio/config/mesh"],
    );

    let err = Fixture::new()
        .annotations(&[(ANNOTATION_PROXY_CONFIG, "statNameLength: long")])
        .err();
    assert_contains(
        &err,
        &["annotation proxy.istio.io/config", "statNameLength", "long"],
    );

    let err = Fixture::new()
        .file("etc/istio/pod/annotations", "a=unquoted\n")
        .err();
    assert_contains(&err, &["pod annotations file", "unquoted", "Go-quoted"]);
}

#[test]
fn unreadable_mesh_file_is_an_error() {
    // A directory where the file should be cannot be read as a file.
    let f = Fixture::new().file("etc/istio/config/mesh/inner", "");
    let err = f.err();
    assert_contains(
        &err,
        &["cannot read mesh config file", "./etc/istio/config/mesh"],
    );
}

#[test]
fn all_errors_are_reported_together() {
    let err = Fixture::new()
        .env("SECRET_GRACE_PERIOD_RATIO", "2")
        .env("ISTIO_CPU_LIMIT", "-1")
        .env("PROXY_CONFIG", "drainDuration: 45")
        .load()
        .unwrap_err();
    match &err {
        ConfigError::Multiple(all) => assert_eq!(all.len(), 3, "{err}"),
        other => panic!("expected Multiple, got {other}"),
    }
    assert_contains(
        &err.to_string(),
        &[
            "3 configuration errors",
            "SECRET_GRACE_PERIOD_RATIO",
            "ISTIO_CPU_LIMIT",
            "drainDuration",
        ],
    );
}

// === dump ===

#[test]
fn dump_shape() {
    let c = Fixture::new()
        .env("PROXY_CONFIG", "terminationDrainDuration: 1.5s")
        .ok();
    let v = serde_json::to_value(&c).unwrap();
    assert_eq!(v["proxyConfig"]["configPath"], json!("./etc/istio/proxy"));
    assert_eq!(v["proxyConfig"]["drainDuration"], json!("45s"));
    assert_eq!(
        v["proxyConfig"]["terminationDrainDuration"],
        json!("1.500s")
    );
    assert_eq!(
        v["proxyConfig"]["controlPlaneAuthPolicy"],
        json!("MUTUAL_TLS")
    );
    assert_eq!(v["identity"]["secretTtl"], json!("24h0m0s"));
    assert_eq!(v["identity"]["fileDebounceDuration"], json!("100ms"));
    assert_eq!(v["proxyType"], json!("sidecar"));
    assert!(v.get("warnings").is_none());
}

/// Values Istio does not refuse at start are not refused here either; where they cannot work
/// a warning (or the failure where Istio fails) lists the values that do.
#[test]
fn values_istio_accepts_at_start() {
    // PILOT_CERT_PROVIDER: any other value takes the istiod path, as in Istio.
    let c = Fixture::new().env("PILOT_CERT_PROVIDER", "foo").ok();
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert_contains(
        &c.warnings[0],
        &[
            "PILOT_CERT_PROVIDER=\"foo\"",
            "istiod, kubernetes, k8s.io/<signer>, custom, none",
        ],
    );
    for ok in ["istiod", "kubernetes", "k8s.io/my-signer", "custom"] {
        let c = Fixture::new().env("PILOT_CERT_PROVIDER", ok).ok();
        assert!(c.warnings.is_empty(), "{ok}: {:?}", c.warnings);
    }
    // ECC_SIGNATURE_ALGORITHM: every key generation fails (identity), not the start.
    let c = Fixture::new().env("ECC_SIGNATURE_ALGORITHM", "FOO").ok();
    let e = crate::identity::keys::KeySpec::from_config(&c.identity).unwrap_err();
    assert_eq!(
        e.to_string(),
        "unsupported ECC_SIGNATURE_ALGORITHM \"FOO\": expected ECDSA, or unset for RSA keys (WORKLOAD_RSA_KEY_SIZE)"
    );
    // With an unsupported algorithm the RSA size is not what fails, as in Istio's GenCSR.
    let c = Fixture::new()
        .env("ECC_SIGNATURE_ALGORITHM", "ecdsa")
        .env("WORKLOAD_RSA_KEY_SIZE", "1024")
        .ok();
    assert!(matches!(
        crate::identity::keys::KeySpec::from_config(&c.identity),
        Err(crate::identity::keys::KeyError::EcAlgorithm(_))
    ));
    // Envoy log levels: passed on (Envoy refuses them at its start), after a warning.
    let mut f = Fixture::new();
    f.flags.proxy_log_level = "verbose".into();
    let c = f.ok();
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert_contains(
        &c.warnings[0],
        &[
            "--proxyLogLevel=verbose: \"verbose\" is not an Envoy log level",
            "trace, debug, info, warning, warn, error, critical, off",
        ],
    );
    let mut f = Fixture::new();
    f.flags.proxy_log_level = "info,misc:loud,upstream:debug".into();
    assert_contains(&f.ok().warnings.join("\n"), &["\"loud\" is not"]);
    let mut f = Fixture::new();
    f.flags.proxy_log_level = "warning".into();
    f.flags.proxy_component_log_level = "misc:error,upstream:chatty".into();
    assert_contains(
        &f.ok().warnings.join("\n"),
        &["--proxyComponentLogLevel=misc:error,upstream:chatty: \"chatty\" is not"],
    );
    for ok in ["trace", "warn", "off", "info,misc:error", "critical,a:b:c"] {
        let mut f = Fixture::new();
        f.flags.proxy_log_level = ok.into();
        assert!(f.ok().warnings.is_empty(), "{ok}");
    }
}

/// A metadata bool that does not parse fails the start once, naming it, without also being
/// warned about as "defaulting to false".
#[test]
fn unparsable_metadata_bool_fails_without_a_default_warning() {
    for name in [
        "ISTIO_META_DNS_CAPTURE",
        "ISTIO_META_DNS_AUTO_ALLOCATE",
        "ISTIO_META_ENABLE_SELF_DISCOVERY",
    ] {
        let err = Fixture::new().env(name, "maybe").err();
        assert_contains(&err, &[name, "\"maybe\"", "expected \"true\" or \"false\""]);
        // Empty: Istio's StringBool takes it; the variable falls back, with the warning.
        let c = Fixture::new().env(name, "").ok();
        assert_eq!(c.warnings.len(), 1, "{name}: {:?}", c.warnings);
        let c = Fixture::new().env(name, "T").ok();
        assert!(c.warnings.is_empty(), "{name}: {:?}", c.warnings);
    }
}

#[test]
fn each_deprecated_input_is_one_warning_per_process() {
    let mut f = Fixture::new()
        .env("METRIC_ROTATION_INTERVAL", "10m")
        .env("METRIC_GRACEFUL_DELETION_INTERVAL", "5m")
        .annotations(&[("sidecar.istio.io/statsCompression", "false")]);
    f.flags.token_manager_plugin = "GoogleTokenExchange".into();
    // Loaded three times (as `proxy` and then `debug bundle` would each load it): the same
    // four warnings each time, each naming its input and what replaces it.
    let mut warnings = Vec::new();
    for _ in 0..3 {
        let c = f.ok();
        assert_eq!(c.warnings.len(), 4, "{:?}", c.warnings);
        warnings = c.warnings;
    }
    for (input, replacement) in [
        (
            "METRIC_ROTATION_INTERVAL is set but ignored",
            "sidecar.istio.io/statsEvictionInterval",
        ),
        (
            "METRIC_GRACEFUL_DELETION_INTERVAL is set but ignored",
            "sidecar.istio.io/statsEvictionInterval",
        ),
        (
            "annotation sidecar.istio.io/statsCompression is set but ignored",
            "ProxyConfig statsCompression",
        ),
        (
            "--tokenManagerPlugin=GoogleTokenExchange is accepted but ignored",
            "projected token file",
        ),
    ] {
        let lines: Vec<&String> = warnings.iter().filter(|l| l.contains(input)).collect();
        assert_eq!(lines.len(), 1, "{input}: {warnings:?}");
        assert!(lines[0].contains(replacement), "{}", lines[0]);
        // Logged by the first load and never again: `warn_once` logs only the call that
        // inserts it. (Asserted through the process-wide set rather than a captured log:
        // tracing's per-callsite interest cache is shared with tests on other threads.)
        assert!(
            !crate::config::warn_once(lines[0]),
            "{input} was never logged"
        );
    }
    // The config does not change: the ignored annotation leaves statsCompression unset.
    let c = f.ok();
    assert!(!c.proxy_config.passthrough.contains_key("statsCompression"));
}

#[test]
fn nested_messages_are_istios_proto_json() {
    // Normalised as Istio's protojson writes them; unknown nested names ignored as Istio's
    // `protomarshal.ApplyJSON` retry does.
    let c = Fixture::new()
        .env(
            "PROXY_CONFIG",
            r#"{"connection_settings": {"http_idle_timeout": "1.5s", "future": 1},
                "tracing": {"sampling": 100, "zipkin": {"address": "z:9411"}},
                "readinessProbe": {"timeoutSeconds": "3", "httpGet": null, "periodSeconds": null},
                "fileFlushMinSizeKb": "7",
                "zipkinAddress": "old:9411"}"#,
        )
        .ok();
    let pc = &c.proxy_config;
    assert_eq!(
        pc.passthrough["connectionSettings"],
        serde_json::json!({"httpIdleTimeout": "1.500s"})
    );
    assert_eq!(
        pc.tracing,
        Some(serde_json::json!({"sampling": 100, "zipkin": {"address": "z:9411"}}))
    );
    assert_eq!(
        pc.readiness_probe,
        Some(serde_json::json!({"timeoutSeconds": 3}))
    );
    assert_eq!(pc.passthrough["fileFlushMinSizeKb"], serde_json::json!(7));
    // A deprecated field Istio still parses is kept, as in Istio's metadata.
    assert_eq!(
        pc.passthrough["zipkinAddress"],
        serde_json::json!("old:9411")
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn layers_merge_as_istios_merge_proxy_config() {
    let c = Fixture::new()
        .file(
            "etc/istio/config/mesh",
            "defaultConfig: {proxyMetadata: {A: mesh, B: mesh}, extraStatTags: [a, b], \
             proxyHeaders: {requestId: {disabled: true}, server: {value: s}}}",
        )
        .env(
            "PROXY_CONFIG",
            "{proxyMetadata: {B: env, C: env}, proxyHeaders: {server: {value: t}}, \
             extraStatTags: [c], concurrency: null}",
        )
        .ok();
    let pc = &c.proxy_config;
    // proxyMetadata merged key by key (mergeMap); lists replaced.
    assert_eq!(
        pc.proxy_metadata,
        BTreeMap::from([
            ("A".to_owned(), "mesh".to_owned()),
            ("B".to_owned(), "env".to_owned()),
            ("C".to_owned(), "env".to_owned()),
        ])
    );
    assert_eq!(pc.extra_stat_tags, vec!["c"]);
    // proxyHeaders replaced, except headers the later layer leaves unset
    // (correctProxyHeaders).
    assert_eq!(
        pc.proxy_headers,
        Some(serde_json::json!({"requestId": {"disabled": true}, "server": {"value": "t"}}))
    );
    assert_eq!(pc.concurrency, None);
}
