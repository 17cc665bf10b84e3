//! Remote endpoints of the bootstrap — tracers, metrics and access-log services, statsd — and
//! their TLS and keepalive settings (pkg/bootstrap/option/convert.go).

use serde_json::{Map, Value, json};

use super::BootstrapError;

/// A `host:port` setting as the template's `socket_address` body, `{"address", "port_value"}`
/// (convert.go `addressConverter`): a host of `$(HOST_IP)` becomes the `HOST_IP` variable.
pub fn address(
    field: &'static str,
    addr: &str,
    host_ip: &str,
) -> Result<Option<Value>, BootstrapError> {
    if addr.is_empty() {
        return Ok(None);
    }
    let bad = |reason: &str| BootstrapError::Address {
        field,
        value: addr.to_owned(),
        reason: reason.to_owned(),
    };
    let (host, port) = split_host_port(addr).ok_or_else(|| bad("expected host:port"))?;
    let host = if host == "$(HOST_IP)" {
        if host_ip.is_empty() {
            return Err(bad("$(HOST_IP) is used but HOST_IP is not set"));
        }
        host_ip
    } else {
        host
    };
    let port: u16 = port.parse().map_err(|_| bad("the port must be a number"))?;
    Ok(Some(json!({"address": host, "port_value": port})))
}

/// Go `net.SplitHostPort`: `host:port` or `[v6]:port`; a bare IPv6 address is an error.
fn split_host_port(s: &str) -> Option<(&str, &str)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        return Some((host, after.strip_prefix(':')?));
    }
    let (host, port) = s.rsplit_once(':')?;
    (!host.contains(':')).then_some((host, port))
}

/// `$(HOST_IP)` in an override file, bracketed when it is IPv6 and followed by a port
/// (`[dead::beef]:8126`), as Go's `net.JoinHostPort` writes it.
pub fn expand_host_ip(text: &str, host_ip: &str) -> String {
    const VAR: &str = "$(HOST_IP)";
    if !host_ip.contains(':') {
        return text.replace(VAR, host_ip);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find(VAR) {
        out.push_str(&rest[..i]);
        rest = &rest[i + VAR.len()..];
        let port_follows = rest
            .strip_prefix(':')
            .is_some_and(|p| p.starts_with(|c: char| c.is_ascii_digit()));
        if port_follows {
            out.push('[');
            out.push_str(host_ip);
            out.push(']');
        } else {
            out.push_str(host_ip);
        }
    }
    out.push_str(rest);
    out
}

/// An SDS secret served by the agent's `sds-grpc` cluster
/// (pilot/pkg/model `ConstructSdsSecretConfig`).
pub fn sds_secret(name: &str) -> Value {
    json!({
        "name": name,
        "sds_config": {
            "api_config_source": {
                "api_type": "GRPC",
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]
            },
            "resource_api_version": "V3"
        }
    })
}

fn str_field<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

/// ClientTLSSettings `mode` (proto-JSON: name or number).
fn tls_mode(tls: &Value) -> Result<&'static str, BootstrapError> {
    let m = tls.get("mode").cloned().unwrap_or(Value::Null);
    Ok(match &m {
        Value::Null => "DISABLE",
        Value::String(s) if s == "DISABLE" => "DISABLE",
        Value::String(s) if s == "SIMPLE" => "SIMPLE",
        Value::String(s) if s == "MUTUAL" => "MUTUAL",
        Value::String(s) if s == "ISTIO_MUTUAL" => "ISTIO_MUTUAL",
        Value::Number(n) => match n.as_u64() {
            Some(0) => "DISABLE",
            Some(1) => "SIMPLE",
            Some(2) => "MUTUAL",
            Some(3) => "ISTIO_MUTUAL",
            _ => return Err(bad_mode(&m)),
        },
        _ => return Err(bad_mode(&m)),
    })
}

fn bad_mode(m: &Value) -> BootstrapError {
    BootstrapError::Address {
        field: "tlsSettings.mode",
        value: m.to_string(),
        reason: "expected DISABLE, SIMPLE, MUTUAL or ISTIO_MUTUAL".into(),
    }
}

/// A ClientTLSSettings as an `envoy.transport_sockets.tls` transport socket, or `None` for
/// DISABLE (convert.go `tlsContextConvert`, `transportSocketConverter`). `meta` supplies the
/// `TLS_CLIENT_*` overrides; `sni` is the default SNI for ISTIO_MUTUAL.
pub fn transport_socket(
    tls: Option<&Value>,
    sni: &str,
    meta: &Map<String, Value>,
    h2: bool,
) -> Result<Option<Value>, BootstrapError> {
    let Some(tls) = tls else { return Ok(None) };
    let mode = tls_mode(tls)?;
    let meta_or = |key: &str, field: &str| {
        meta.get(key)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| str_field(tls, field))
            .to_owned()
    };
    let sans: Vec<Value> = tls
        .get("subjectAltNames")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(|s| json!({"exact": s}))
                .collect()
        })
        .unwrap_or_default();
    let default_vc = if sans.is_empty() {
        json!({})
    } else {
        json!({"match_subject_alt_names": sans})
    };
    let mut common = Map::new();
    let mut sni_out = str_field(tls, "sni").to_owned();
    let root = match mode {
        "DISABLE" => return Ok(None),
        "SIMPLE" => format!(
            "file-root:{}",
            meta_or("TLS_CLIENT_ROOT_CERT", "caCertificates")
        ),
        "MUTUAL" => {
            let cert = meta_or("TLS_CLIENT_CERT_CHAIN", "clientCertificate");
            let key = meta_or("TLS_CLIENT_KEY", "privateKey");
            if !cert.is_empty() && !key.is_empty() {
                common.insert(
                    "tls_certificate_sds_secret_configs".into(),
                    json!([sds_secret(&format!("file-cert:{cert}~{key}"))]),
                );
            }
            format!(
                "file-root:{}",
                meta_or("TLS_CLIENT_ROOT_CERT", "caCertificates")
            )
        }
        _ => {
            common.insert(
                "tls_certificate_sds_secret_configs".into(),
                json!([sds_secret("default")]),
            );
            if sni_out.is_empty() {
                sni_out = sni.to_owned();
            }
            "ROOTCA".to_owned()
        }
    };
    common.insert(
        "combined_validation_context".into(),
        json!({
            "default_validation_context": default_vc,
            "validation_context_sds_secret_config": sds_secret(&root),
        }),
    );
    if h2 {
        let alpn = if mode == "ISTIO_MUTUAL" {
            json!(["istio-h2", "h2"])
        } else {
            json!(["h2"])
        };
        common.insert("alpn_protocols".into(), alpn);
    }
    let mut ctx = Map::new();
    ctx.insert(
        "@type".into(),
        json!("type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"),
    );
    ctx.insert("common_tls_context".into(), Value::Object(common));
    if !sni_out.is_empty() {
        ctx.insert("sni".into(), json!(sni_out));
    }
    Ok(Some(
        json!({"name": "envoy.transport_sockets.tls", "typed_config": ctx}),
    ))
}

/// A `tcpKeepalive` setting as `upstream_connection_options` (convert.go `keepaliveConverter`).
pub fn tcp_keepalive(ka: Option<&Value>) -> Option<Value> {
    let ka = ka?;
    let secs = |k: &str| {
        ka.get(k)
            .and_then(Value::as_str)
            .and_then(crate::config::ProtoDuration::parse)
            .map(|d| d.get().as_secs())
            .filter(|s| *s > 0)
    };
    let mut out = Map::new();
    if let Some(p) = ka.get("probes").and_then(Value::as_u64).filter(|p| *p > 0) {
        out.insert("keepalive_probes".into(), json!(p));
    }
    if let Some(t) = secs("time") {
        out.insert("keepalive_time".into(), json!(t));
    }
    if let Some(i) = secs("interval") {
        out.insert("keepalive_interval".into(), json!(i));
    }
    Some(json!({"tcp_keepalive": out}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_ip_expansion_brackets_ipv6_with_a_port() {
        assert_eq!(
            expand_host_ip("a $(HOST_IP):8126 b $(HOST_IP)", "dead::beef"),
            "a [dead::beef]:8126 b dead::beef"
        );
        assert_eq!(expand_host_ip("$(HOST_IP):1", "10.0.0.1"), "10.0.0.1:1");
    }

    #[test]
    fn addresses() {
        assert_eq!(
            address("x", "$(HOST_IP):8126", "dead::beef").unwrap(),
            Some(json!({"address": "dead::beef", "port_value": 8126}))
        );
        assert_eq!(
            address("x", "[::1]:9411", "").unwrap(),
            Some(json!({"address": "::1", "port_value": 9411}))
        );
        assert!(address("x", "zipkin", "").is_err());
        assert!(address("x", "$(HOST_IP):1", "").is_err());
        assert_eq!(address("x", "", "").unwrap(), None);
    }
}
