//! Tracer clusters and `tracing.http` (the template's `zipkin` / `lightstep` / `datadog`
//! branches, fed by pkg/bootstrap/config.go `getProxyConfigOptions`).

use std::path::PathBuf;

use serde_json::{Map, Value, json};

use super::{BootstrapError, remote};
use crate::config::Config;

/// File the Lightstep access token is written to, under configPath.
pub const LIGHTSTEP_TOKEN_FILE: &str = "lightstep_access_token.txt";

/// The configured tracer, resolved.
#[derive(Debug, Clone, PartialEq)]
pub enum Tracer {
    Zipkin {
        address: Value,
    },
    Lightstep {
        address: Value,
        token_path: PathBuf,
        token: String,
    },
    Datadog {
        address: Value,
    },
}

/// Reads ProxyConfig `tracing`. A tracer whose address is empty is skipped, as Istio skips
/// empty options. Stackdriver and OpenCensus need Envoy's OpenCensus tracer, which Envoy
/// 1.40 no longer has: refused with an error instead of a bootstrap Envoy rejects.
pub fn tracer(cfg: &Config) -> Result<Option<Tracer>, BootstrapError> {
    let Some(t) = cfg.proxy_config.tracing.as_ref() else {
        return Ok(None);
    };
    let host_ip = &cfg.pod.host_ip;
    let addr = |v: &Value, field| {
        remote::address(
            field,
            v.get("address").and_then(Value::as_str).unwrap_or(""),
            host_ip,
        )
    };
    if let Some(z) = t.get("zipkin") {
        return Ok(addr(z, "tracing.zipkin.address")?.map(|address| Tracer::Zipkin { address }));
    }
    if let Some(l) = t.get("lightstep") {
        let token = l
            .get("accessToken")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let token_path =
            crate::bootstrap::go_join(&cfg.proxy_config.config_path, LIGHTSTEP_TOKEN_FILE);
        // Rendered as Istio renders it, but Envoy 1.40 has no Lightstep tracer: such a
        // bootstrap only starts an Envoy built with it.
        ::tracing::warn!(
            "ProxyConfig tracing.lightstep: Envoy 1.40 has no envoy.tracers.lightstep and will \
             reject this bootstrap; use a telemetry provider (OpenTelemetry) instead"
        );
        return Ok(
            addr(l, "tracing.lightstep.address")?.map(|address| Tracer::Lightstep {
                address,
                token_path,
                token,
            }),
        );
    }
    if let Some(d) = t.get("datadog") {
        return Ok(addr(d, "tracing.datadog.address")?.map(|address| Tracer::Datadog { address }));
    }
    for unsupported in ["stackdriver", "openCensusAgent"] {
        if t.get(unsupported).is_some() {
            return Err(BootstrapError::Unsupported {
                what: format!("ProxyConfig tracing.{unsupported}"),
                reason: "it needs Envoy's OpenCensus tracer, which Envoy 1.40 no longer has; \
                         use a telemetry provider (OpenTelemetry) instead"
                    .into(),
            });
        }
    }
    Ok(None)
}

/// `tracing_tls`: the tracer's `tlsSettings` as a transport socket (SNI `tracer`).
pub fn tracing_tls(
    cfg: &Config,
    meta: &Map<String, Value>,
    tracer: &Tracer,
) -> Result<Option<Value>, BootstrapError> {
    let tls = cfg
        .proxy_config
        .tracing
        .as_ref()
        .and_then(|t| t.get("tlsSettings"));
    let h2 = matches!(tracer, Tracer::Lightstep { .. });
    remote::transport_socket(tls, "tracer", meta, h2)
}

fn load_assignment(name: &str, address: &Value) -> Value {
    json!({"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": address}}}]}]})
}

/// The tracer's static cluster.
pub fn cluster(tracer: &Tracer, tls: Option<&Value>, dns_lookup_family: &str) -> Value {
    let (name, address) = match tracer {
        Tracer::Zipkin { address } => ("zipkin", address),
        Tracer::Lightstep { address, .. } => ("lightstep", address),
        Tracer::Datadog { address } => ("datadog_agent", address),
    };
    let mut c = json!({
        "name": name,
        "alt_stat_name": format!("{name};"),
        "type": "STRICT_DNS",
        "respect_dns_ttl": true,
        "dns_lookup_family": dns_lookup_family,
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": load_assignment(name, address),
    });
    match tracer {
        Tracer::Zipkin { .. } => c["dns_refresh_rate"] = json!("30s"),
        Tracer::Lightstep { .. } => c["typed_extension_protocol_options"] = super::h2_options(),
        Tracer::Datadog { .. } => {}
    }
    if let Some(tls) = tls {
        c["transport_socket"] = tls.clone();
    }
    c
}

/// The `tracing` section; datadog's service name is the node cluster.
pub fn tracing(tracer: &Tracer, node_cluster: &str) -> Value {
    let http = match tracer {
        Tracer::Zipkin { .. } => json!({"name": "envoy.tracers.zipkin", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
            "collector_cluster": "zipkin",
            "collector_endpoint": "/api/v2/spans",
            "collector_endpoint_version": "HTTP_JSON",
            "trace_id_128bit": true,
            "shared_span_context": false
        }}),
        Tracer::Lightstep { token_path, .. } => {
            json!({"name": "envoy.tracers.lightstep", "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.LightstepConfig",
                "collector_cluster": "lightstep",
                "access_token_file": token_path.display().to_string()
            }})
        }
        Tracer::Datadog { .. } => json!({"name": "envoy.tracers.datadog", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.DatadogConfig",
            "collector_cluster": "datadog_agent",
            "service_name": node_cluster
        }}),
    };
    json!({"http": http})
}
