//! Envoy bootstrap generation, equivalent to Istio's default template
//! (`envoy_bootstrap.json`, spec §6.3), rendered as JSON from typed inputs.
//!
//! **Custom Go templates** (`ISTIO_BOOTSTRAP`, `--templateFile`, ProxyConfig
//! `proxyBootstrapTemplatePath`) are refused at startup with a clear error: they are Go
//! `text/template` programs with sprig functions written against Istio's internal parameter
//! names, and a partial re-implementation would silently render something different.
//! `customConfigFile` (use a file as is) and `ISTIO_BOOTSTRAP_OVERRIDE` (`--config-yaml`) cover
//! the same needs and are supported.

pub mod node;

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::config::Config;

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(
        "custom bootstrap templates are not supported ({origin}={path}): meshagent renders \
         Istio's default bootstrap itself; use ProxyConfig customConfigFile for a complete \
         Envoy config, or ISTIO_BOOTSTRAP_OVERRIDE to overlay fields"
    )]
    TemplateUnsupported { origin: &'static str, path: String },
    #[error(transparent)]
    Node(#[from] node::NodeError),
    #[error("annotation {annotation}={value:?}: {reason}")]
    Annotation {
        annotation: &'static str,
        value: String,
        reason: String,
    },
    #[error("cannot write bootstrap {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Annotations the bootstrap reads (spec §6.3).
pub const ANNOTATION_INCLUSION_PREFIXES: &str = "sidecar.istio.io/statsInclusionPrefixes";
pub const ANNOTATION_INCLUSION_SUFFIXES: &str = "sidecar.istio.io/statsInclusionSuffixes";
pub const ANNOTATION_INCLUSION_REGEXPS: &str = "sidecar.istio.io/statsInclusionRegexps";
pub const ANNOTATION_EXTRA_STAT_TAGS: &str = "sidecar.istio.io/extraStatTags";
pub const ANNOTATION_HISTOGRAM_BUCKETS: &str = "sidecar.istio.io/statsHistogramBuckets";
pub const ANNOTATION_FLUSH_INTERVAL: &str = "sidecar.istio.io/statsFlushInterval";

/// The proxy's node, computed once at startup.
#[derive(Debug, Clone)]
pub struct Node {
    pub id: String,
    pub cluster: String,
    pub locality: Value,
    pub metadata: Map<String, Value>,
    pub ips: Vec<IpAddr>,
    /// Where the agent reaches Envoy's admin (`127.0.0.1` or `::1`).
    pub localhost: IpAddr,
}

impl Node {
    pub fn from_config(cfg: &Config) -> Result<Node, BootstrapError> {
        let excluded: Vec<&str> = cfg
            .pod_annotations
            .get(node::EXCLUDE_INTERFACES_ANNOTATION)
            .map(|s| s.split(',').map(str::trim).collect())
            .unwrap_or_default();
        let ips = node::instance_ips(cfg.pod.instance_ip, &node::interface_addrs(), &excluded);
        let metadata = node::metadata(cfg, &ips)?;
        Ok(Node {
            id: node::node_id(cfg, &ips),
            cluster: node::cluster(cfg, &metadata),
            locality: node::locality(&metadata),
            localhost: node::localhost_for(&ips, cfg.pod.instance_ip),
            metadata,
            ips,
        })
    }

    /// IPv6 when every node IP is IPv6 (Envoy `--local-address-ip-version`).
    pub fn ipv6_only(&self) -> bool {
        !self.ips.is_empty() && self.ips.iter().all(IpAddr::is_ipv6)
    }
}

/// Refuses custom Go templates (see module docs).
pub fn check_template(cfg: &Config) -> Result<(), BootstrapError> {
    if let Some(p) = &cfg.bootstrap.template_override {
        return Err(BootstrapError::TemplateUnsupported {
            origin: "ISTIO_BOOTSTRAP",
            path: p.display().to_string(),
        });
    }
    if cfg.proxy_config.custom_config_file.as_os_str().is_empty()
        && !cfg
            .proxy_config
            .proxy_bootstrap_template_path
            .as_os_str()
            .is_empty()
    {
        return Err(BootstrapError::TemplateUnsupported {
            origin: "--templateFile/proxyBootstrapTemplatePath",
            path: cfg
                .proxy_config
                .proxy_bootstrap_template_path
                .display()
                .to_string(),
        });
    }
    Ok(())
}

fn list_annotation(cfg: &Config, key: &str) -> Option<Vec<String>> {
    cfg.pod_annotations.get(key).map(|v| {
        v.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    })
}

/// `{pod_ip}` in stats patterns expands once per instance IP.
fn expand_pod_ip(patterns: Vec<String>, ips: &[IpAddr]) -> Vec<String> {
    patterns
        .into_iter()
        .flat_map(|p| {
            if p.contains("{pod_ip}") {
                ips.iter()
                    .map(|ip| p.replace("{pod_ip}", &ip.to_string()))
                    .collect()
            } else {
                vec![p]
            }
        })
        .collect()
}

fn stats_matcher(cfg: &Config, node: &Node, metadata_discovery: bool) -> Value {
    let m = cfg
        .proxy_config
        .proxy_stats_matcher
        .clone()
        .unwrap_or_default();
    let mut prefixes =
        list_annotation(cfg, ANNOTATION_INCLUSION_PREFIXES).unwrap_or(m.inclusion_prefixes);
    prefixes.extend(
        [
            "cluster_manager",
            "listener_manager",
            "server",
            "cluster.xds-grpc",
            "wasm",
        ]
        .map(str::to_owned),
    );
    let mut suffixes =
        list_annotation(cfg, ANNOTATION_INCLUSION_SUFFIXES).unwrap_or(m.inclusion_suffixes);
    suffixes.extend(
        [
            "rbac.allowed",
            "rbac.denied",
            "shadow_allowed",
            "shadow_denied",
        ]
        .map(str::to_owned),
    );
    if cfg.lifecycle.exit_on_zero_active_connections {
        suffixes.push("downstream_cx_active".into());
    }
    let mut regexps =
        list_annotation(cfg, ANNOTATION_INCLUSION_REGEXPS).unwrap_or(m.inclusion_regexps);
    regexps.push(r"vhost\..*\.route\..*".into());

    let mut patterns = vec![json!({"prefix": "reporter="})];
    if metadata_discovery {
        patterns.push(json!({"prefix": "workload_discovery"}));
    }
    patterns.extend(
        expand_pod_ip(prefixes, &node.ips)
            .into_iter()
            .map(|p| json!({"prefix": p})),
    );
    patterns.extend(
        expand_pod_ip(suffixes, &node.ips)
            .into_iter()
            .map(|s| json!({"suffix": s})),
    );
    patterns.extend(
        expand_pod_ip(regexps, &node.ips)
            .into_iter()
            .map(|r| json!({"safe_regex": {"regex": r}})),
    );
    patterns.push(json!({"prefix": "component"}));
    patterns.push(json!({"prefix": "istio"}));
    json!({"inclusion_list": {"patterns": patterns}})
}

fn stats_tags(cfg: &Config) -> Vec<Value> {
    let mut tags = vec![
        json!({"tag_name": "cluster_name", "regex": r"^cluster\.((.+?(\..+?\.svc\.cluster\.local)?)\.)"}),
        json!({"tag_name": "tcp_prefix", "regex": r"^tcp\.((.*?)\.)\w+?$"}),
        json!({"tag_name": "response_code", "regex": r"_rq(_(\d{3}))$"}),
        json!({"tag_name": "response_code_class", "regex": r"_rq(_(\dxx))$"}),
        json!({"tag_name": "http_conn_manager_listener_prefix", "regex": r"^listener(?=\.).*?\.http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"}),
        json!({"tag_name": "http_conn_manager_prefix", "regex": r"^http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"}),
        json!({"tag_name": "listener_address", "regex": r"^listener\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"}),
        json!({"tag_name": "mongo_prefix", "regex": r"^mongo\.(.+?)\.(collection|cmd|cx_|op_|delays_|decoding_)(.*?)$"}),
    ];
    let mut extra = cfg.proxy_config.extra_stat_tags.clone();
    extra.extend(list_annotation(cfg, ANNOTATION_EXTRA_STAT_TAGS).unwrap_or_default());
    for t in extra {
        tags.push(json!({"tag_name": t, "regex": format!(r"({t}=\.=(.*?);\.;)")}));
    }
    for (name, re) in [
        ("cache", r"(cache\.(.+?)\.)"),
        ("component", r"(component\.(.+?)\.)"),
        ("tag", r"(tag\.(.+?);\.)"),
        ("wasm_filter", r"(wasm_filter\.(.+?)\.)"),
        ("authz_enforce_result", r"rbac(\.(allowed|denied))"),
        ("authz_dry_run_action", r"(\.istio_dry_run_(allow|deny)_)"),
        ("authz_dry_run_result", r"(\.shadow_(allowed|denied))"),
    ] {
        tags.push(json!({"tag_name": name, "regex": re}));
    }
    tags
}

fn runtime_flags(cfg: &Config) -> Value {
    let mut m = Map::new();
    m.insert("re2.max_program_size.error_level".into(), json!("32768"));
    m.insert(
        "envoy.deprecated_features:envoy.config.listener.v3.Listener.hidden_envoy_deprecated_use_original_dst".into(),
        json!(true),
    );
    m.insert(
        "envoy.reloadable_features.http_reject_path_with_fragment".into(),
        json!(false),
    );
    m.insert(
        "envoy.reloadable_features.fixed_heap_use_allocated".into(),
        json!(true),
    );
    m.insert(
        "envoy.reloadable_features.coalesce_lb_rebuilds_on_batch_update".into(),
        json!(false),
    );
    if cfg.xds.compliance_policy == "fips-140-2" {
        m.insert(
            "envoy.reloadable_features.google_grpc_disable_tls_13".into(),
            json!(true),
        );
    }
    if !cfg.bootstrap.http_strip_fragment_from_path {
        m.insert(
            "envoy.reloadable_features.http_strip_fragment_from_path_unsafe_if_disabled".into(),
            json!("false"),
        );
    }
    for (k, v) in &cfg.proxy_config.runtime_values {
        match v.as_str() {
            "" => {
                m.remove(k);
            }
            "true" => {
                m.insert(k.clone(), json!(true));
            }
            "false" => {
                m.insert(k.clone(), json!(false));
            }
            _ => {
                m.insert(k.clone(), json!(v));
            }
        }
    }
    Value::Object(m)
}

fn socket(addr: &str, port: u16) -> Value {
    json!({"socket_address": {"protocol": "TCP", "address": addr, "port_value": port}})
}

fn static_cluster(name: &str, timeout: &str, address: Value) -> Value {
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": timeout,
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]}
    })
}

fn h2_options() -> Value {
    json!({"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}
    }})
}

fn router() -> Value {
    json!({"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
}

fn http_listener(
    name: &str,
    addr: &str,
    port: u16,
    stat_prefix: &str,
    routes: Value,
    filters: Vec<Value>,
) -> Value {
    json!({
        "name": name,
        "address": socket(addr, port),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "codec_type": "AUTO",
                "stat_prefix": stat_prefix,
                "route_config": {"virtual_hosts": [{"name": "backend", "domains": ["*"], "routes": routes}]},
                "http_filters": filters
            }
        }]}],
        "ignore_global_conn_limit": true,
        "bypass_overload_manager": true
    })
}

fn compressors() -> Vec<Value> {
    let lib = |name: &str, ty: &str| {
        json!({"name": "envoy.filters.http.compressor", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor",
            "compressor_library": {"name": name, "typed_config": {"@type": ty}},
            "remove_accept_encoding_header": true
        }})
    };
    vec![
        lib(
            "text_optimized",
            "type.googleapis.com/envoy.extensions.compression.brotli.compressor.v3.Brotli",
        ),
        lib(
            "text_optimized",
            "type.googleapis.com/envoy.extensions.compression.gzip.compressor.v3.Gzip",
        ),
        lib(
            "text_optimized",
            "type.googleapis.com/envoy.extensions.compression.zstd.compressor.v3.Zstd",
        ),
    ]
}

fn global_downstream_max_connections(cfg: &Config) -> u64 {
    cfg.proxy_config
        .passthrough
        .get("connectionSettings")
        .and_then(|c| c.get("globalDownstreamConnectionLimit"))
        .and_then(Value::as_u64)
        .or_else(|| {
            cfg.proxy_config
                .proxy_metadata
                .get("ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS")
                .and_then(|v| v.parse().ok())
        })
        .or_else(|| {
            cfg.proxy_config
                .runtime_values
                .get("overload.global_downstream_max_connections")
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(2_147_483_647)
}

/// Address of a `host:port` string as a bootstrap socket address, with `$(HOST_IP)`
/// substituted (tracer and statsd addresses).
fn host_port(cfg: &Config, addr: &str) -> Option<Value> {
    let addr = addr.replace("$(HOST_IP)", &cfg.pod.host_ip);
    let (h, p) = addr.rsplit_once(':')?;
    let port: u16 = p.parse().ok()?;
    Some(json!({"address": h.trim_start_matches('[').trim_end_matches(']'), "port_value": port}))
}

/// Renders the bootstrap for `cfg` and `node`.
pub fn render(cfg: &Config, node: &Node) -> Value {
    let pc = &cfg.proxy_config;
    let localhost = node.localhost.to_string();
    let wildcard = if node.ipv6_only() { "::" } else { "0.0.0.0" };
    let delta = cfg.xds.delta_xds || cfg.proxy_type == crate::config::ProxyType::Waypoint;
    let metadata_discovery = delta
        && node
            .metadata
            .get("METADATA_DISCOVERY")
            .and_then(Value::as_str)
            == Some("true");
    let log_format = if cfg.flags.log_as_json {
        json!({"json_format": {"time": "%Y-%m-%dT%T.%fZ", "level": "%l", "scope": "envoy %n", "msg": "%j", "caller": "%g:%#", "thread": "%t"}})
    } else {
        json!({"text_format": "%Y-%m-%dT%T.%fZ\t%l\tenvoy %n %g:%#\t%v\tthread=%t"})
    };
    let config_path = pc.config_path.display().to_string();
    let sds_socket = format!(
        "./var/run/secrets/workload-spiffe-uds/{}",
        cfg.identity.workload_identity_socket_file
    );

    let mut clusters = vec![
        static_cluster(
            "prometheus_stats",
            "0.250s",
            socket(&localhost, pc.proxy_admin_port),
        ),
        static_cluster("agent", "0.250s", socket(&localhost, pc.status_port)),
    ];
    let mut sds = static_cluster("sds-grpc", "1s", json!({"pipe": {"path": sds_socket}}));
    sds["typed_extension_protocol_options"] = h2_options();
    clusters.push(sds);
    let mut xds = static_cluster(
        "xds-grpc",
        "1s",
        json!({"pipe": {"path": format!("{config_path}/XDS")}}),
    );
    xds["typed_extension_protocol_options"] = h2_options();
    xds["max_requests_per_connection"] = json!(1);
    xds["upstream_connection_options"] = json!({"tcp_keepalive": {"keepalive_time": 300}});
    let threshold = |p: &str| json!({"priority": p, "max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000});
    xds["circuit_breakers"] = json!({"thresholds": [threshold("DEFAULT"), threshold("HIGH")]});
    clusters.push(xds);

    let mut tracing = Value::Null;
    if let Some(zipkin) = pc
        .tracing
        .as_ref()
        .and_then(|t| t.get("zipkin"))
        .and_then(|z| z.get("address"))
        .and_then(Value::as_str)
        .and_then(|a| host_port(cfg, a))
    {
        let mut c = static_cluster("zipkin", "1s", json!({"socket_address": zipkin}));
        c["type"] = json!("STRICT_DNS");
        c["respect_dns_ttl"] = json!(true);
        c["dns_refresh_rate"] = json!("30s");
        clusters.push(c);
        tracing = json!({"http": {"name": "envoy.tracers.zipkin", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
            "collector_cluster": "zipkin",
            "collector_endpoint": "/api/v2/spans",
            "collector_endpoint_version": "HTTP_JSON",
            "trace_id_128bit": true,
            "shared_span_context": false
        }}});
    }

    let metrics_addr = if pc
        .proxy_metadata
        .get("METRICS_LOCALHOST_ACCESS_ONLY")
        .map(String::as_str)
        == Some("true")
    {
        localhost.as_str()
    } else {
        wildcard
    };
    let mut prom_filters = compressors();
    prom_filters.push(router());
    let listeners = vec![
        http_listener(
            &format!("{metrics_addr}_{}", cfg.bootstrap.envoy_prometheus_port),
            metrics_addr,
            cfg.bootstrap.envoy_prometheus_port,
            "stats",
            json!([{"match": {"prefix": "/stats/prometheus"}, "route": {"cluster": "prometheus_stats"}}]),
            prom_filters,
        ),
        {
            let mut l = http_listener(
                &format!("{wildcard}_{}", cfg.bootstrap.envoy_status_port),
                wildcard,
                cfg.bootstrap.envoy_status_port,
                "agent",
                json!([{"match": {"prefix": "/healthz/ready"}, "route": {"cluster": "agent"}}]),
                vec![router()],
            );
            if cfg.bootstrap.envoy_status_port_enable_proxy_protocol {
                l["listener_filters"] = json!([{"name": "envoy.filters.listener.proxy_protocol", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol"
                }}]);
            }
            l
        },
    ];

    let mut extensions = vec![];
    if metadata_discovery {
        extensions.push(json!({"name": "metadata_discovery", "typed_config": {
            "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
            "type_url": "type.googleapis.com/istio.workload.BootstrapExtension",
            "value": {"config_source": {"ads": {}}}
        }}));
    }
    extensions.push(json!({"name": "envoy.bootstrap.internal_listener", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
        "value": {"buffer_size_kb": 64}
    }}));

    let mut stats_config = json!({
        "use_all_default_tags": false,
        "stats_tags": stats_tags(cfg),
        "stats_matcher": stats_matcher(cfg, node, metadata_discovery),
    });
    if let Some(b) = cfg
        .pod_annotations
        .get(ANNOTATION_HISTOGRAM_BUCKETS)
        .and_then(|v| serde_json::from_str::<Map<String, Value>>(v).ok())
    {
        let settings: Vec<Value> = b
            .into_iter()
            .map(|(prefix, buckets)| json!({"match": {"prefix": prefix}, "buckets": buckets}))
            .collect();
        stats_config["histogram_bucket_settings"] = json!(settings);
    }

    let mut out = json!({
        "application_log_config": {"log_format": log_format},
        "node": {
            "id": node.id,
            "cluster": node.cluster,
            "locality": node.locality,
            "metadata": node.metadata,
        },
        "layered_runtime": {"layers": [
            {"name": "global config", "static_layer": runtime_flags(cfg)},
            {"name": "admin", "admin_layer": {}}
        ]},
        "bootstrap_extensions": extensions,
        "stats_config": stats_config,
        "admin": {
            "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": "/dev/null"
            }}],
            "profile_path": "/var/lib/istio/data/envoy.prof",
            "address": socket(&localhost, pc.proxy_admin_port)
        },
        "dynamic_resources": {
            "lds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "cds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "ads_config": {
                "api_type": if delta { "DELTA_GRPC" } else { "GRPC" },
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
            }
        },
        "static_resources": {"clusters": clusters, "listeners": listeners},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": global_downstream_max_connections(cfg)
            }
        }]},
        "deferred_stat_options": {"enable_deferred_creation_stats": true}
    });
    if let Some(i) = cfg.pod_annotations.get(ANNOTATION_FLUSH_INTERVAL) {
        out["stats_flush_interval"] = json!(i);
    }
    if !tracing.is_null() {
        out["tracing"] = tracing;
    }
    if let Some(statsd) = host_port(cfg, &pc.statsd_udp_address) {
        out["stats_sinks"] = json!([{"name": "envoy.stat_sinks.statsd", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.metrics.v3.StatsdSink",
            "address": {"socket_address": statsd}
        }}]);
    }
    if !cfg.flags.outlier_log_path.is_empty() {
        out["cluster_manager"] =
            json!({"outlier_detection": {"event_log_path": cfg.flags.outlier_log_path}});
    }
    out
}

/// Writes the rendered bootstrap to `<configPath>/envoy-rev.json` (resolved against `cwd`)
/// and returns its path relative to the agent's working directory, as passed to Envoy.
pub fn write(cfg: &Config, cwd: &Path, bootstrap: &Value) -> Result<PathBuf, BootstrapError> {
    let rel = cfg.proxy_config.config_path.join("envoy-rev.json");
    let abs = cwd.join(&rel);
    let write = || -> std::io::Result<()> {
        if let Some(dir) = abs.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = abs.with_extension("json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(bootstrap).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, &abs)
    };
    write().map_err(|source| BootstrapError::Write {
        path: abs.clone(),
        source,
    })?;
    Ok(rel)
}
