//! Envoy bootstrap generation (spec §6.3).
//!
//! The built-in renderer ([`render`]) produces what Istio's default template
//! (tools/packaging/common/envoy_bootstrap.json, rendered by pkg/bootstrap/instance.go) produces
//! for the same inputs, from typed inputs, as JSON. Custom Go templates (`ISTIO_BOOTSTRAP`,
//! `--templateFile`, ProxyConfig `proxyBootstrapTemplatePath`) are rendered with Go
//! `text/template` semantics and Istio's parameter names by [`template`]. The template that
//! Istio's proxyv2 image ships at `/var/lib/istio/envoy/envoy_bootstrap_tmpl.json` (Istio's
//! default path) is *not* rendered: it is Istio's default template, which the built-in renderer
//! reproduces (see README, "Bootstrap").

pub mod node;
pub mod params;
mod remote;
pub mod stats;
pub mod template;
pub mod tracing;

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::config::Config;

pub use remote::expand_host_ip;
pub use stats::{
    ANNOTATION_EVICTION_INTERVAL, ANNOTATION_EXTRA_STAT_TAGS, ANNOTATION_FLUSH_INTERVAL,
    ANNOTATION_HISTOGRAM_BUCKETS, ANNOTATION_INCLUSION_PREFIXES, ANNOTATION_INCLUSION_REGEXPS,
    ANNOTATION_INCLUSION_SUFFIXES,
};

/// Istio's default template path in the proxyv2 image (relative to the working directory `/`).
pub const IMAGE_TEMPLATE_PATH: &str = "./var/lib/istio/envoy/envoy_bootstrap_tmpl.json";

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(transparent)]
    Node(#[from] node::NodeError),
    #[error("annotation {annotation}={value:?}: {reason}")]
    Annotation {
        annotation: &'static str,
        value: String,
        reason: String,
    },
    #[error("invalid {field}={value:?}: {reason}")]
    Address {
        field: &'static str,
        value: String,
        reason: String,
    },
    #[error("{what} is not supported: {reason}")]
    Unsupported { what: String, reason: String },
    #[error(
        "invalid node metadata LOAD_STATS_CONFIG_JSON={value:?}: expected a JSON object: {reason}"
    )]
    LoadStats { value: String, reason: String },
    #[error(transparent)]
    Template(#[from] template::TemplateError),
    #[error("cannot write bootstrap {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

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
        Self::with_ips(cfg, ips)
    }

    /// The node for the given instance IPs (tests pass fixed IPs).
    pub fn with_ips(cfg: &Config, ips: Vec<IpAddr>) -> Result<Node, BootstrapError> {
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

/// Everything the default template branches on, computed once from the configuration and the
/// node (pkg/bootstrap/config.go `getNodeMetadataOptions`, `getProxyConfigOptions`,
/// `getStatsOptions`). The built-in renderer and the template parameters both read it.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub localhost: String,
    pub wildcard: String,
    /// The other address family's loopback and wildcard, when the proxy is dual-stack.
    pub additional_localhost: Option<String>,
    pub additional_wildcard: Option<String>,
    pub dns_lookup_family: &'static str,
    pub delta: bool,
    pub metadata_discovery: bool,
    pub stats: stats::StatsInputs,
    pub tracer: Option<tracing::Tracer>,
    pub tracing_tls: Option<Value>,
    pub statsd: Option<Value>,
    pub metrics_service: Option<RemoteService>,
    pub accesslog_service: Option<RemoteService>,
    /// ProxyConfig `statsCompression` (default true): compressors on the Prometheus listener.
    pub stats_compression: bool,
    pub metrics_localhost_only: bool,
    pub global_downstream_max_connections: u64,
    pub load_stats_config: Option<Value>,
    pub runtime_flags: Value,
}

/// ProxyConfig `envoyMetricsService` / `envoyAccessLogService`, resolved.
#[derive(Debug, Clone)]
pub struct RemoteService {
    pub address: Value,
    pub tls: Option<Value>,
    pub tcp_keepalive: Option<Value>,
}

fn remote_service(
    cfg: &Config,
    meta: &Map<String, Value>,
    field: &'static str,
    sni: &str,
) -> Result<Option<RemoteService>, BootstrapError> {
    let Some(rs) = cfg.proxy_config.passthrough.get(field) else {
        return Ok(None);
    };
    let addr = rs.get("address").and_then(Value::as_str).unwrap_or("");
    let field_addr = match field {
        "envoyMetricsService" => "envoyMetricsService.address",
        _ => "envoyAccessLogService.address",
    };
    let Some(address) = remote::address(field_addr, addr, &cfg.pod.host_ip)? else {
        return Ok(None);
    };
    Ok(Some(RemoteService {
        address,
        tls: remote::transport_socket(rs.get("tlsSettings"), sni, meta, true)?,
        tcp_keepalive: remote::tcp_keepalive(rs.get("tcpKeepalive")),
    }))
}

/// proto-JSON integers may be numbers or strings.
fn json_u64(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// The global downstream connection limit: ProxyConfig `connectionSettings` wins, then
/// proxyMetadata `ISTIO_META_GLOBAL_DOWNSTREAM_MAX_CONNECTIONS`, then the runtime value, then
/// Istio's default (pkg/bootstrap/config.go).
fn global_downstream_max_connections(cfg: &Config) -> u64 {
    cfg.proxy_config
        .passthrough
        .get("connectionSettings")
        .and_then(|c| c.get("globalDownstreamConnectionLimit"))
        .and_then(json_u64)
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

impl Inputs {
    pub fn new(cfg: &Config, node: &Node) -> Result<Self, BootstrapError> {
        let pc = &cfg.proxy_config;
        let v6_only = node.ipv6_only();
        let has_v4 = node.ips.iter().any(IpAddr::is_ipv4);
        let has_v6 = node.ips.iter().any(IpAddr::is_ipv6);
        let dual = cfg.bootstrap.dual_stack && has_v4 && has_v6;
        let (wildcard, other_wildcard) = if v6_only {
            ("::", "0.0.0.0")
        } else {
            ("0.0.0.0", "::")
        };
        let other_localhost = if node.localhost.is_ipv6() {
            "127.0.0.1"
        } else {
            "::1"
        };
        let delta = cfg.xds.delta_xds || cfg.proxy_type == crate::config::ProxyType::Waypoint;
        let metadata_discovery = delta
            && node
                .metadata
                .get("METADATA_DISCOVERY")
                .and_then(Value::as_str)
                == Some("true");
        let tracer = tracing::tracer(cfg)?;
        let tracing_tls = match &tracer {
            Some(t) => tracing::tracing_tls(cfg, &node.metadata, t)?,
            None => None,
        };
        let load_stats_config = match node
            .metadata
            .get("LOAD_STATS_CONFIG_JSON")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
        {
            None => None,
            Some(raw) => {
                let v: Map<String, Value> =
                    serde_json::from_str(raw).map_err(|e| BootstrapError::LoadStats {
                        value: raw.to_owned(),
                        reason: e.to_string(),
                    })?;
                Some(Value::Object(v))
            }
        };
        Ok(Self {
            localhost: node.localhost.to_string(),
            wildcard: wildcard.into(),
            additional_localhost: dual.then(|| other_localhost.into()),
            additional_wildcard: dual.then(|| other_wildcard.into()),
            dns_lookup_family: if dual {
                "ALL"
            } else if v6_only {
                "V6_ONLY"
            } else {
                "V4_ONLY"
            },
            delta,
            metadata_discovery,
            stats: stats::StatsInputs::from_config(cfg, &node.ips)?,
            tracer,
            tracing_tls,
            statsd: remote::address("statsdUdpAddress", &pc.statsd_udp_address, &cfg.pod.host_ip)?,
            metrics_service: remote_service(
                cfg,
                &node.metadata,
                "envoyMetricsService",
                "envoy_metrics_service",
            )?,
            accesslog_service: remote_service(
                cfg,
                &node.metadata,
                "envoyAccessLogService",
                "envoy_accesslog_service",
            )?,
            stats_compression: pc
                .passthrough
                .get("statsCompression")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            metrics_localhost_only: pc
                .proxy_metadata
                .get("METRICS_LOCALHOST_ACCESS_ONLY")
                .map(String::as_str)
                == Some("true"),
            global_downstream_max_connections: global_downstream_max_connections(cfg),
            load_stats_config,
            runtime_flags: runtime_flags(cfg),
        })
    }
}

fn socket(addr: &str, port: u16) -> Value {
    json!({"socket_address": {"protocol": "TCP", "address": addr, "port_value": port}})
}

/// A static cluster with Istio's `alt_stat_name` "<name>;" (the `cluster_name` tag regex ends
/// at the `;`).
fn static_cluster(name: &str, timeout: &str, address: Value) -> Value {
    json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
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

fn hcm(stat_prefix: &str, routes: Value, filters: Vec<Value>) -> Value {
    json!({
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "codec_type": "AUTO",
            "stat_prefix": stat_prefix,
            "route_config": {"virtual_hosts": [{"name": "backend", "domains": ["*"], "routes": routes}]},
            "http_filters": filters
        }
    })
}

fn listener(addr: &str, additional: Option<&str>, port: u16, filter_chain: Value) -> Value {
    let mut l = json!({
        "name": format!("{addr}_{port}"),
        "address": socket(addr, port),
        "ignore_global_conn_limit": true,
        "bypass_overload_manager": true,
        "filter_chains": [filter_chain]
    });
    if let Some(a) = additional {
        l["additional_addresses"] = json!([{"address": socket(a, port)}]);
    }
    l
}

fn route(prefix: &str, cluster: &str) -> Value {
    json!({"match": {"prefix": prefix}, "route": {"cluster": cluster}})
}

/// The Prometheus listener's compressors: brotli, zstd, gzip, for the stats content types.
fn compressors() -> Vec<Value> {
    let content_types = json!([
        "text/plain",
        "application/openmetrics-text",
        "application/vnd.google.protobuf",
        "application/json"
    ]);
    [
        ("brotli", "envoy.extensions.compression.brotli.compressor.v3.Brotli"),
        ("zstd", "envoy.extensions.compression.zstd.compressor.v3.Zstd"),
        ("gzip", "envoy.extensions.compression.gzip.compressor.v3.Gzip"),
    ]
    .into_iter()
    .map(|(algo, ty)| {
        json!({"name": format!("envoy.filters.http.compressor.{algo}"), "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor",
            "compressor_library": {"name": format!("stats_{algo}"), "typed_config": {"@type": format!("type.googleapis.com/{ty}")}},
            "response_direction_config": {"common_config": {"content_type": content_types}}
        }})
    })
    .collect()
}

/// An mTLS listener for the secure metrics ports: the workload certificate (`default`) and
/// the mesh root (`ROOTCA`) over SDS, client certificate required.
fn secure_metrics_listener(inp: &Inputs, port: u16, merged: bool) -> Value {
    let routes = if merged {
        json!([
            route("/stats/prometheus", "agent"),
            route("/metrics", "agent")
        ])
    } else {
        json!([route("/stats/prometheus", "prometheus_stats")])
    };
    let prefix = if merged {
        "secure_merged_stats"
    } else {
        "secure_stats"
    };
    let chain = json!({
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": true,
            "common_tls_context": {
                "tls_certificate_sds_secret_configs": [remote::sds_secret("default")],
                "validation_context_sds_secret_config": remote::sds_secret("ROOTCA")
            }
        }},
        "filters": [hcm(prefix, routes, vec![router()])]
    });
    listener(
        &inp.wildcard,
        inp.additional_wildcard.as_deref(),
        port,
        chain,
    )
}

fn remote_service_cluster(name: &str, rs: &RemoteService, dns_lookup_family: &str) -> Value {
    let mut c = json!({
        "name": name,
        "type": "STRICT_DNS",
        "respect_dns_ttl": true,
        "dns_lookup_family": dns_lookup_family,
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": h2_options(),
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": rs.address}}}]}]}
    });
    if let Some(t) = &rs.tls {
        c["transport_socket"] = t.clone();
    }
    if let Some(k) = &rs.tcp_keepalive {
        c["upstream_connection_options"] = k.clone();
    }
    c
}

/// Renders Istio's default bootstrap for `cfg` and `node`.
pub fn render(cfg: &Config, node: &Node) -> Result<Value, BootstrapError> {
    let inp = Inputs::new(cfg, node)?;
    Ok(render_inputs(cfg, node, &inp))
}

fn render_inputs(cfg: &Config, node: &Node, inp: &Inputs) -> Value {
    let pc = &cfg.proxy_config;
    let boot = &cfg.bootstrap;
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
            socket(&inp.localhost, pc.proxy_admin_port),
        ),
        static_cluster("agent", "0.250s", socket(&inp.localhost, pc.status_port)),
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
    if let Some(t) = &inp.tracer {
        clusters.push(tracing::cluster(
            t,
            inp.tracing_tls.as_ref(),
            inp.dns_lookup_family,
        ));
    }
    if let Some(ms) = &inp.metrics_service {
        clusters.push(remote_service_cluster(
            "envoy_metrics_service",
            ms,
            inp.dns_lookup_family,
        ));
    }
    if let Some(als) = &inp.accesslog_service {
        clusters.push(remote_service_cluster(
            "envoy_accesslog_service",
            als,
            inp.dns_lookup_family,
        ));
    }

    let (metrics_addr, metrics_additional) = if inp.metrics_localhost_only {
        (&inp.localhost, inp.additional_localhost.as_deref())
    } else {
        (&inp.wildcard, inp.additional_wildcard.as_deref())
    };
    let mut prom_filters = if inp.stats_compression {
        compressors()
    } else {
        vec![]
    };
    prom_filters.push(router());
    let mut listeners = vec![listener(
        metrics_addr,
        metrics_additional,
        boot.envoy_prometheus_port,
        json!({"filters": [hcm("stats", json!([route("/stats/prometheus", "prometheus_stats")]), prom_filters)]}),
    )];
    if boot.envoy_secure_metrics_port != 0 {
        listeners.push(secure_metrics_listener(
            inp,
            boot.envoy_secure_metrics_port,
            false,
        ));
    }
    if boot.envoy_secure_merged_metrics_port != 0 {
        listeners.push(secure_metrics_listener(
            inp,
            boot.envoy_secure_merged_metrics_port,
            true,
        ));
    }
    let mut status = listener(
        &inp.wildcard,
        inp.additional_wildcard.as_deref(),
        boot.envoy_status_port,
        json!({"filters": [hcm("agent", json!([route("/healthz/ready", "agent")]), vec![router()])]}),
    );
    if boot.envoy_status_port_enable_proxy_protocol {
        status["listener_filters"] = json!([{"name": "envoy.filters.listener.proxy_protocol", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol"
        }}]);
    }
    listeners.push(status);

    let mut extensions = vec![];
    if inp.metadata_discovery {
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

    let mut out = json!({
        "application_log_config": {"log_format": log_format},
        "node": {
            "id": node.id,
            "cluster": node.cluster,
            "locality": node.locality,
            "metadata": node.metadata,
        },
        "layered_runtime": {"layers": [
            {"name": "global config", "static_layer": inp.runtime_flags},
            {"name": "admin", "admin_layer": {}}
        ]},
        "bootstrap_extensions": extensions,
        "stats_config": stats::stats_config(&inp.stats, inp.metadata_discovery),
        "admin": {
            "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": "/dev/null"
            }}],
            "profile_path": "/var/lib/istio/data/envoy.prof",
            "address": socket(&inp.localhost, pc.proxy_admin_port)
        },
        "dynamic_resources": {
            "lds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "cds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "ads_config": {
                "api_type": if inp.delta { "DELTA_GRPC" } else { "GRPC" },
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
                "max_active_downstream_connections": inp.global_downstream_max_connections
            }
        }]},
        "deferred_stat_options": {"enable_deferred_creation_stats": true}
    });
    if let Some(d) = inp.stats.flush_interval {
        out["stats_flush_interval"] = json!(stats::proto_duration(d));
    }
    if let Some(d) = inp.stats.eviction_interval {
        out["stats_eviction_interval"] = json!(stats::proto_duration(d));
    }
    if let Some(t) = &inp.tracer {
        out["tracing"] = tracing::tracing(t, &node.cluster);
    }
    let mut sinks = vec![];
    if inp.metrics_service.is_some() {
        sinks.push(
            json!({"name": "envoy.stat_sinks.metrics_service", "typed_config": {
                "@type": "type.googleapis.com/envoy.config.metrics.v3.MetricsServiceConfig",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "envoy_metrics_service"}}
            }}),
        );
    }
    if let Some(statsd) = &inp.statsd {
        sinks.push(json!({"name": "envoy.stat_sinks.statsd", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.metrics.v3.StatsdSink",
            "address": {"socket_address": statsd}
        }}));
    }
    if !sinks.is_empty() {
        out["stats_sinks"] = Value::Array(sinks);
    }
    let mut cm = Map::new();
    if !cfg.flags.outlier_log_path.is_empty() {
        cm.insert(
            "outlier_detection".into(),
            json!({"event_log_path": cfg.flags.outlier_log_path}),
        );
    }
    if let Some(lrs) = &inp.load_stats_config {
        cm.insert("load_stats_config".into(), lrs.clone());
    }
    cm.insert("enable_deferred_cluster_creation".into(), json!(true));
    out["cluster_manager"] = Value::Object(cm);
    out
}

/// A rendered bootstrap, ready to be written.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// File name under configPath: `envoy-rev.json`, or `envoy-rev.yaml` for a YAML template.
    pub file_name: &'static str,
    pub contents: String,
    /// Files the bootstrap refers to (the Lightstep token), path relative to the agent's cwd.
    pub side_files: Vec<(PathBuf, String)>,
}

/// Which template renders the bootstrap: an explicit custom template, else the built-in
/// renderer. Precedence: `ISTIO_BOOTSTRAP` > ProxyConfig `proxyBootstrapTemplatePath`
/// (`--templateFile`) (pkg/bootstrap/instance.go `WriteTo`). With ProxyConfig
/// `customConfigFile` nothing is rendered: that file is Envoy's config as is (pkg/envoy).
pub fn template_path(cfg: &Config) -> Option<(PathBuf, &'static str)> {
    if !cfg.proxy_config.custom_config_file.as_os_str().is_empty() {
        return None;
    }
    if let Some(p) = &cfg.bootstrap.template_override {
        return Some((p.clone(), "ISTIO_BOOTSTRAP"));
    }
    let p = &cfg.proxy_config.proxy_bootstrap_template_path;
    (!p.as_os_str().is_empty()).then(|| (p.clone(), "ProxyConfig proxyBootstrapTemplatePath"))
}

/// Loads and checks the custom template, if any, at startup: a missing file, a parse error,
/// or a function or parameter meshagent does not provide is an error naming it and the line.
pub fn check_template(
    cfg: &Config,
    cwd: &Path,
) -> Result<Option<template::Template>, BootstrapError> {
    match template_path(cfg) {
        None => Ok(None),
        Some((path, origin)) => Ok(Some(template::Template::load(
            &cwd.join(&path),
            &path,
            origin,
        )?)),
    }
}

/// Renders the bootstrap: with `tmpl` when a custom template is configured, else built in.
pub fn generate(
    cfg: &Config,
    node: &Node,
    tmpl: Option<&template::Template>,
) -> Result<Rendered, BootstrapError> {
    let inp = Inputs::new(cfg, node)?;
    let mut side_files = vec![];
    if let Some(tracing::Tracer::Lightstep {
        token_path, token, ..
    }) = &inp.tracer
    {
        side_files.push((token_path.clone(), token.clone()));
    }
    let (file_name, contents) = match tmpl {
        None => {
            let v = render_inputs(cfg, node, &inp);
            (
                "envoy-rev.json",
                serde_json::to_string_pretty(&v).unwrap_or_default(),
            )
        }
        Some(t) => {
            let p = params::params(cfg, node, &inp);
            (t.output_file_name(), t.render(&p)?)
        }
    };
    Ok(Rendered {
        file_name,
        contents,
        side_files,
    })
}

/// Writes the bootstrap to `<configPath>/<file_name>` (resolved against `cwd`) and returns its
/// path relative to the agent's working directory, as passed to Envoy. Side files (the
/// Lightstep token) are written first, mode 0666 as Istio does.
pub fn write(cfg: &Config, cwd: &Path, rendered: &Rendered) -> Result<PathBuf, BootstrapError> {
    use std::os::unix::fs::PermissionsExt;
    for (rel, text) in &rendered.side_files {
        let abs = cwd.join(rel);
        let w = || -> std::io::Result<()> {
            if let Some(dir) = abs.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&abs, text)?;
            std::fs::set_permissions(&abs, std::fs::Permissions::from_mode(0o666))
        };
        w().map_err(|source| BootstrapError::Write {
            path: abs.clone(),
            source,
        })?;
    }
    let rel = cfg.proxy_config.config_path.join(rendered.file_name);
    let abs = cwd.join(&rel);
    let write = || -> std::io::Result<()> {
        if let Some(dir) = abs.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = abs.with_extension("tmp");
        std::fs::write(&tmp, &rendered.contents)?;
        std::fs::rename(&tmp, &abs)
    };
    write().map_err(|source| BootstrapError::Write {
        path: abs.clone(),
        source,
    })?;
    Ok(rel)
}
