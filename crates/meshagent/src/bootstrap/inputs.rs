//! Everything the default template branches on, from the configuration and the node.

use std::net::IpAddr;

use serde_json::{Map, Value, json};

use super::{BootstrapError, Node, remote, stats, tracing};
use crate::config::Config;

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
    /// Node metadata `ENABLE_SELF_DISCOVERY` (env `ISTIO_META_ENABLE_SELF_DISCOVERY` or the
    /// same key in proxyMetadata): the `local_cluster` static cluster.
    pub self_discovery: bool,
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
        // The wildcard's family follows the loopback's (pkg/bootstrap/config.go): IPv6 for an
        // IPv6-only pod, or a dual-stack one whose first instance IP is IPv6.
        let (wildcard, other_wildcard) = if node.localhost.is_ipv6() {
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
        // pkg/bootstrap/config.go passes the node metadata's StringBool to the template, so
        // proxyMetadata alone enables it as well as the container env.
        let self_discovery = node
            .metadata
            .get("ENABLE_SELF_DISCOVERY")
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
            self_discovery,
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
