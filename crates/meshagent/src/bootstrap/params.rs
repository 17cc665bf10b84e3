//! The parameters a custom bootstrap template sees: Istio's option names and value shapes
//! (pkg/bootstrap/option/instances.go), from the same [`Inputs`] as the built-in renderer.
//! Like Istio (`newOptionOrSkipIfZero`), empty values are left out, so `{{ if .x }}` is false;
//! lists are always present (possibly empty), so `range` over them works with gtmpl.

use serde_json::{Map, Value, json};

use super::{Inputs, Node, stats, tracing::Tracer};
use crate::config::Config;

/// Every parameter name meshagent provides. A template naming any other top-level parameter
/// is refused at startup.
pub const NAMES: &[&str] = &[
    "config",
    "nodeID",
    "nodeType",
    "cluster",
    "region",
    "zone",
    "sub_zone",
    "meta_json_str",
    "metadata",
    "runtime_flags",
    "xds_type",
    "metadata_discovery",
    "pilot_SAN",
    "discovery_address",
    "discovery_host",
    "localhost",
    "additional_localhost",
    "wildcard",
    "additional_wildcard",
    "dual_stack",
    "dns_lookup_family",
    "outlier_log_path",
    "custom_file_path",
    "log_json",
    "zipkin",
    "lightstep",
    "lightstepToken",
    "datadog",
    "tracing_tls",
    "statsd",
    "envoy_metrics_service_address",
    "envoy_metrics_service_tls",
    "envoy_metrics_service_tcp_keepalive",
    "envoy_metrics_stats_compression",
    "envoy_accesslog_service_address",
    "envoy_accesslog_service_tls",
    "envoy_accesslog_service_tcp_keepalive",
    "envoy_status_port",
    "envoy_prometheus_port",
    "secure_metrics_port",
    "secure_merged_metrics_port",
    "envoy_status_port_enable_proxy_protocol",
    "global_downstream_max_connections",
    "sts_port",
    "metrics_localhost_access_only",
    "load_stats_config_json_str",
    "workload_identity_socket_file",
    "extraStatTags",
    "inclusionPrefix",
    "inclusionSuffix",
    "inclusionRegexps",
    "histogram_buckets",
    "stats_flush_interval",
    "stats_eviction_interval",
    "enable_self_discovery",
    "sts",
    // Istio's names for features meshagent refuses at startup (OpenCensus-based tracers) or
    // never configures: always absent, so `{{ if .x }}` is false as in Istio when unset.
    "stackdriver",
    "stackdriverProjectID",
    "stackdriverDebug",
    "stackdriverMaxAnnotations",
    "stackdriverMaxAttributes",
    "stackdriverMaxEvents",
    "openCensusAgent",
    "openCensusAgentContexts",
    "gcp_project_id",
    "gcp_project_number",
    "pilot_grpc_address",
    "xds_root_cert",
    "custom_file_path",
];

/// ProxyConfig as the template's `.config`: Go field names (`.config.ProxyAdminPort`,
/// `.config.ConfigPath`, `.config.ProxyMetadata.X`), proto-JSON values.
pub fn go_proxy_config(cfg: &Config) -> Value {
    let mut pc = match super::node::proxy_config_json(&cfg.proxy_config) {
        Value::Object(m) => m,
        _ => Map::new(),
    };
    // Go structs always have every field: the zero values proto-JSON drops come back.
    let p = &cfg.proxy_config;
    pc.entry("proxyAdminPort")
        .or_insert(json!(p.proxy_admin_port));
    pc.entry("statusPort").or_insert(json!(p.status_port));
    pc.entry("configPath")
        .or_insert(json!(p.config_path.display().to_string()));
    pc.entry("proxyMetadata").or_insert(json!({}));
    Value::Object(
        pc.into_iter()
            .map(|(k, v)| {
                let mut c = k.chars();
                let go = match c.next() {
                    Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
                    None => k,
                };
                (go, v)
            })
            .collect(),
    )
}

fn json_str(v: &Value) -> Value {
    Value::String(v.to_string())
}

/// The parameters for `cfg`, `node` and `inp`.
pub fn params(cfg: &Config, node: &Node, inp: &Inputs) -> Map<String, Value> {
    let pc = &cfg.proxy_config;
    let boot = &cfg.bootstrap;
    let mut m = Map::new();
    let mut put = |k: &str, v: Value| {
        let empty = match &v {
            Value::Null => true,
            Value::String(s) => s.is_empty(),
            // Lists stay even when empty: gtmpl refuses to `range` over a missing value, where
            // Go iterates zero times.
            Value::Object(o) => o.is_empty(),
            _ => false,
        };
        if !empty {
            m.insert(k.to_owned(), v);
        }
    };
    put("config", go_proxy_config(cfg));
    put("nodeID", json!(node.id));
    put("nodeType", json!(cfg.proxy_type.as_str()));
    put("cluster", json!(node.cluster));
    for k in ["region", "zone", "sub_zone"] {
        put(k, node.locality.get(k).cloned().unwrap_or(Value::Null));
    }
    put(
        "meta_json_str",
        json_str(&Value::Object(node.metadata.clone())),
    );
    put("metadata", Value::Object(node.metadata.clone()));
    put("runtime_flags", json_str(&inp.runtime_flags));
    put(
        "xds_type",
        json!(if inp.delta { "DELTA_GRPC" } else { "GRPC" }),
    );
    put("metadata_discovery", json!(inp.metadata_discovery));
    put(
        "pilot_SAN",
        node.metadata
            .get("PILOT_SAN")
            .cloned()
            .unwrap_or(Value::Null),
    );
    put("discovery_address", json!(pc.discovery_address));
    put(
        "discovery_host",
        json!(
            pc.discovery_address
                .rsplit_once(':')
                .map_or(pc.discovery_address.as_str(), |(h, _)| h)
        ),
    );
    put("localhost", json!(inp.localhost));
    put("wildcard", json!(inp.wildcard));
    put(
        "additional_localhost",
        json!(inp.additional_localhost.clone().unwrap_or_default()),
    );
    put(
        "additional_wildcard",
        json!(inp.additional_wildcard.clone().unwrap_or_default()),
    );
    put("dual_stack", json!(inp.additional_wildcard.is_some()));
    put("dns_lookup_family", json!(inp.dns_lookup_family));
    put("outlier_log_path", json!(cfg.flags.outlier_log_path));
    if let Some(path) = super::custom_file_sds_path(node) {
        put("custom_file_path", json!(path));
    }
    put("log_json", json!(cfg.flags.log_as_json));
    match &inp.tracer {
        Some(Tracer::Zipkin { address }) => put("zipkin", json_str(address)),
        Some(Tracer::Lightstep {
            address,
            token_path,
            ..
        }) => {
            put("lightstep", json_str(address));
            put("lightstepToken", json!(token_path.display().to_string()));
        }
        Some(Tracer::Datadog { address }) => put("datadog", json_str(address)),
        None => {}
    }
    if let Some(t) = &inp.tracing_tls {
        put("tracing_tls", json_str(t));
    }
    if let Some(s) = &inp.statsd {
        put("statsd", json_str(s));
    }
    for (prefix, rs) in [
        ("envoy_metrics_service", &inp.metrics_service),
        ("envoy_accesslog_service", &inp.accesslog_service),
    ] {
        if let Some(rs) = rs {
            put(&format!("{prefix}_address"), json_str(&rs.address));
            if let Some(t) = &rs.tls {
                put(&format!("{prefix}_tls"), json_str(t));
            }
            if let Some(k) = &rs.tcp_keepalive {
                put(&format!("{prefix}_tcp_keepalive"), json_str(k));
            }
        }
    }
    put(
        "envoy_metrics_stats_compression",
        json!(inp.stats_compression),
    );
    put("envoy_status_port", json!(boot.envoy_status_port));
    put("envoy_prometheus_port", json!(boot.envoy_prometheus_port));
    if boot.envoy_secure_metrics_port != 0 {
        put("secure_metrics_port", json!(boot.envoy_secure_metrics_port));
    }
    if boot.envoy_secure_merged_metrics_port != 0 {
        put(
            "secure_merged_metrics_port",
            json!(boot.envoy_secure_merged_metrics_port),
        );
    }
    put(
        "envoy_status_port_enable_proxy_protocol",
        json!(boot.envoy_status_port_enable_proxy_protocol),
    );
    put(
        "global_downstream_max_connections",
        json!(inp.global_downstream_max_connections),
    );
    put("sts", json!(cfg.flags.sts_port != 0));
    if cfg.flags.sts_port != 0 {
        put("sts_port", json!(cfg.flags.sts_port));
    }
    put("enable_self_discovery", json!(inp.self_discovery));
    put(
        "metrics_localhost_access_only",
        json!(inp.metrics_localhost_only),
    );
    if let Some(l) = &inp.load_stats_config {
        put("load_stats_config_json_str", json_str(l));
    }
    put(
        "workload_identity_socket_file",
        json!(cfg.identity.workload_identity_socket_file),
    );
    put("extraStatTags", json!(inp.stats.extra_tags));
    put("inclusionPrefix", json!(inp.stats.prefixes));
    put("inclusionSuffix", json!(inp.stats.suffixes));
    put("inclusionRegexps", json!(inp.stats.regexps));
    if let Some(b) = &inp.stats.histogram_buckets {
        put("histogram_buckets", b.clone());
    }
    if let Some(d) = inp.stats.flush_interval {
        put("stats_flush_interval", json!(stats::proto_duration(d)));
    }
    if let Some(d) = inp.stats.eviction_interval {
        put("stats_eviction_interval", json!(stats::proto_duration(d)));
    }
    m
}
