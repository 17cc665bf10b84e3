//! Building blocks of the bootstrap: static clusters, listeners, HTTP connection managers, the
//! Prometheus compressors and the secure metrics listeners.

use serde_json::{Value, json};

use super::{Inputs, RemoteService, remote};

pub(super) fn socket(addr: &str, port: u16) -> Value {
    json!({"socket_address": {"protocol": "TCP", "address": addr, "port_value": port}})
}

/// A static cluster with Istio's `alt_stat_name` "<name>;" (the `cluster_name` tag regex ends
/// at the `;`).
pub(super) fn static_cluster(name: &str, timeout: &str, address: Value) -> Value {
    json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
        "type": "STATIC",
        "connect_timeout": timeout,
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]}
    })
}

pub(super) fn h2_options() -> Value {
    json!({"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}
    }})
}

pub(super) fn router() -> Value {
    json!({"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
}

pub(super) fn hcm(stat_prefix: &str, routes: Value, filters: Vec<Value>) -> Value {
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

pub(super) fn listener(
    addr: &str,
    additional: Option<&str>,
    port: u16,
    filter_chain: Value,
) -> Value {
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

pub(super) fn route(prefix: &str, cluster: &str) -> Value {
    json!({"match": {"prefix": prefix}, "route": {"cluster": cluster}})
}

/// The Prometheus listener's compressors: brotli, zstd, gzip, for the four content types the
/// stats endpoint answers with (text, protobuf, OpenMetrics text and protobuf), in the
/// template's order.
pub(super) fn compressors() -> Vec<Value> {
    let content_types = json!([
        "text/plain",
        "application/vnd.google.protobuf",
        "application/openmetrics-text",
        "application/openmetrics-protobuf"
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
/// the mesh root (`ROOTCA`) over SDS, client certificate required. The stat prefixes and the
/// TLS context layout are best effort (the references give only routes and secrets).
pub(super) fn secure_metrics_listener(inp: &Inputs, port: u16, merged: bool) -> Value {
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
    // Istio's template: the chain matches TLS only (found by the TLS inspector), the peer is
    // validated against ROOTCA in a combined validation context with an empty default, and
    // the listener has no additional (dual-stack) address. Checked against the real
    // pilot-agent by tests/compat_bootstrap.rs.
    let chain = json!({
        "filter_chain_match": {"transport_protocol": "tls"},
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": true,
            "common_tls_context": {
                "tls_certificate_sds_secret_configs": [remote::sds_secret("default")],
                "combined_validation_context": {
                    "default_validation_context": {},
                    "validation_context_sds_secret_config": remote::sds_secret("ROOTCA")
                }
            }
        }},
        "filters": [hcm(prefix, routes, vec![router()])]
    });
    let mut l = listener(&inp.wildcard, None, port, chain);
    l["listener_filters"] = json!([{
        "name": "envoy.filters.listener.tls_inspector",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}
    }]);
    l
}

pub(super) fn remote_service_cluster(
    name: &str,
    rs: &RemoteService,
    dns_lookup_family: &str,
) -> Value {
    let mut c = json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
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

/// The self-discovery cluster's name: pilot's `util.SelfDiscoveryCluster`, which istiod's EDS
/// generator (pilot/pkg/xds/eds.go `parseClusterName`) answers with the proxy's own service.
pub const SELF_DISCOVERY_CLUSTER: &str = "local_cluster";

/// `ISTIO_META_ENABLE_SELF_DISCOVERY=true` (Istio 1.31, PR istio/istio#60765): a static EDS
/// cluster fed over ADS (service name `local_cluster`), named by
/// `cluster_manager.local_cluster_name`, which Envoy's zone-aware load balancer reads for the
/// local zone's share of the proxy's own service; least-request with zone-aware routing from
/// one endpoint up (`min_cluster_size: 1`), and, like every cluster of the template,
/// `alt_stat_name: "<name>;"`. The shape is the real pilot-agent's
/// (tools/packaging/common/envoy_bootstrap.json, checked by tests/compat_bootstrap.rs); with
/// no `initial_fetch_timeout`, Envoy's default (15 s) bounds the wait for it.
pub(super) fn self_discovery_cluster() -> Value {
    json!({
        "name": SELF_DISCOVERY_CLUSTER,
        "alt_stat_name": format!("{SELF_DISCOVERY_CLUSTER};"),
        "type": "EDS",
        "connect_timeout": "1s",
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.least_request",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
                "locality_lb_config": {"zone_aware_lb_config": {"min_cluster_size": "1"}}
            }
        }}]},
        "eds_cluster_config": {
            "eds_config": {"ads": {}, "resource_api_version": "V3"},
            "service_name": SELF_DISCOVERY_CLUSTER
        }
    })
}
