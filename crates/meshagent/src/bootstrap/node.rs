//! The proxy's xDS node: instance IPs, node id and node metadata (Istio: `pkg/bootstrap/config.go`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde_json::{Map, Value, json};

use crate::config::Config;

/// Annotation listing interfaces whose addresses are not instance IPs.
pub const EXCLUDE_INTERFACES_ANNOTATION: &str = "traffic.sidecar.istio.io/excludeInterfaces";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NodeError {
    #[error("invalid node metadata {key}={value:?} (from {origin}): expected {expected}")]
    Metadata {
        key: String,
        value: String,
        origin: String,
        expected: &'static str,
    },
    #[error("invalid {origin}: {reason}")]
    MetaJson { origin: String, reason: String },
}

/// A network interface address, as the OS reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceAddr {
    pub interface: String,
    pub ip: IpAddr,
    pub up: bool,
    pub loopback: bool,
}

/// The host's interface addresses (empty if they cannot be listed).
pub fn interface_addrs() -> Vec<InterfaceAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return vec![];
    };
    addrs
        .filter_map(|a| {
            let sa = a.address?;
            let ip = if let Some(v4) = sa.as_sockaddr_in() {
                IpAddr::V4(v4.ip())
            } else {
                IpAddr::V6(sa.as_sockaddr_in6()?.ip())
            };
            Some(InterfaceAddr {
                interface: a.interface_name,
                ip,
                up: a.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP),
                loopback: a
                    .flags
                    .contains(nix::net::if_::InterfaceFlags::IFF_LOOPBACK),
            })
        })
        .collect()
}

fn link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// `INSTANCE_IP` first, then every up, non-loopback, non-link-local interface address not on
/// an excluded interface; `127.0.0.1` and `::1` when nothing is found. Deduplicated.
pub fn instance_ips(
    instance_ip: Option<IpAddr>,
    interfaces: &[InterfaceAddr],
    excluded: &[&str],
) -> Vec<IpAddr> {
    let mut out: Vec<IpAddr> = instance_ip.into_iter().collect();
    for a in interfaces {
        if a.up
            && !a.loopback
            && !a.ip.is_loopback()
            && !a.ip.is_unspecified()
            && !link_local(&a.ip)
            && !excluded.contains(&a.interface.as_str())
            && !out.contains(&a.ip)
        {
            out.push(a.ip);
        }
    }
    if out.is_empty() {
        out = vec![
            IpAddr::from([127, 0, 0, 1]),
            IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        ];
    }
    out
}

/// The loopback address of the bootstrap (admin, the agent and Prometheus clusters), which the
/// agent then reaches Envoy's admin on: `::1` when every instance IP is IPv6, or, with dual
/// stack on, when the first is; else `127.0.0.1`, also for a mixed pod without dual stack
/// whose INSTANCE_IP is IPv6 (pkg/bootstrap/config.go: `AllIPv4`, `AllIPv6`, then
/// `CheckIPFamilyTypeForFirstIPs` under `ISTIO_DUAL_STACK`).
pub fn localhost_for(ips: &[IpAddr], dual_stack: bool) -> IpAddr {
    let v6_only = !ips.is_empty() && ips.iter().all(|i| i.is_ipv6());
    let v6_first = dual_stack && ips.first().is_some_and(IpAddr::is_ipv6);
    if v6_only || v6_first {
        IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
    } else {
        IpAddr::from([127, 0, 0, 1])
    }
}

/// `TYPE~IP~POD_NAME.POD_NAMESPACE~DOMAIN`.
pub fn node_id(cfg: &Config, ips: &[IpAddr]) -> String {
    let ip = ips.first().map(|i| i.to_string()).unwrap_or_default();
    format!(
        "{}~{ip}~{}.{}~{}",
        cfg.proxy_type.as_str(),
        cfg.pod.name,
        cfg.pod.namespace,
        cfg.domain
    )
}

/// Metadata keys whose values must be the strings "true"/"false" (Istio `StringBool`,
/// pkg/model/proxy.go `NodeMetadata`; `HTTP10` and `UNPRIVILEGED_POD` are plain strings there).
const STRING_BOOL_KEYS: &[&str] = &[
    "DNS_CAPTURE",
    "DNS_AUTO_ALLOCATE",
    "ENABLE_HBONE",
    "DISABLE_HBONE_SEND",
    "ENABLE_SELF_DISCOVERY",
    "EXIT_ON_ZERO_ACTIVE_CONNECTIONS",
    "INBOUND_LISTENER_EXACT_BALANCE",
    "OUTBOUND_LISTENER_EXACT_BALANCE",
    "METADATA_DISCOVERY",
    "ENVOY_SKIP_DEPRECATED_LOGS",
];

/// Validates typed metadata keys the way Istio's decode into `NodeMetadata` does: a type error
/// is fatal at startup rather than a surprise in istiod.
fn validate(
    meta: &Map<String, Value>,
    origin_of: impl Fn(&str) -> String,
) -> Result<(), NodeError> {
    let err = |key: &str, value: &Value, expected: &'static str| NodeError::Metadata {
        key: key.to_owned(),
        value: match value {
            Value::String(s) => s.clone(),
            v => v.to_string(),
        },
        origin: origin_of(key),
        expected,
    };
    for (key, value) in meta {
        if STRING_BOOL_KEYS.contains(&key.as_str()) {
            match value {
                // Istio's StringBool reads what Go's `strconv.ParseBool` accepts
                // (pkg/model `StringBool.UnmarshalJSON`): "1" or "T" start the proxy there.
                Value::String(s)
                    if s.is_empty()
                        || matches!(
                            s.as_str(),
                            "1" | "t"
                                | "T"
                                | "TRUE"
                                | "true"
                                | "True"
                                | "0"
                                | "f"
                                | "F"
                                | "FALSE"
                                | "false"
                                | "False"
                        ) => {}
                Value::Bool(_) => {}
                _ => {
                    return Err(err(
                        key,
                        value,
                        "\"true\" or \"false\" (or 1, t, T, TRUE, True, 0, f, F, FALSE, False)",
                    ));
                }
            }
        }
        if key == "POD_PORTS" {
            // A JSON array of container ports, carried as a string.
            let ok = value
                .as_str()
                .map(|s| {
                    serde_json::from_str::<Vec<Value>>(s)
                        .is_ok_and(|v| v.iter().all(|p| p.is_object()))
                })
                .unwrap_or(false);
            if !ok {
                return Err(err(
                    key,
                    value,
                    "a string holding a JSON array of ports, e.g. [{\"containerPort\":8080,\"protocol\":\"TCP\"}]",
                ));
            }
        }
        if key == "INTERCEPTION_MODE"
            && !matches!(value.as_str(), Some("REDIRECT" | "TPROXY" | "NONE"))
        {
            return Err(err(key, value, "REDIRECT, TPROXY or NONE"));
        }
        if matches!(key.as_str(), "LABELS" | "ANNOTATIONS" | "STATIC_LABELS") && !value.is_object()
        {
            return Err(err(key, value, "a JSON object of strings"));
        }
    }
    Ok(())
}

/// Node metadata (Istio: `pkg/bootstrap/config.go` `GetNodeMetaData`): ProxyConfig `proxyMetadata` `ISTIO_META_*`, then env
/// `ISTIO_META_*`, then `ISTIO_METAJSON_*` objects, then the fixed keys.
pub fn metadata(cfg: &Config, ips: &[IpAddr]) -> Result<Map<String, Value>, NodeError> {
    metadata_with(cfg, ips, &crate::platform::Platform::unknown())
}

/// [`metadata`] on a discovered platform: its metadata becomes `PLATFORM_METADATA`
/// (pkg/bootstrap/config.go `extractAttributesMetadata`: set when non-empty, over any raw value).
pub fn metadata_with(
    cfg: &Config,
    ips: &[IpAddr],
    platform: &crate::platform::Platform,
) -> Result<Map<String, Value>, NodeError> {
    let mut meta = Map::new();
    let mut origins: BTreeMap<String, String> = BTreeMap::new();
    for (k, v) in &cfg.proxy_config.proxy_metadata {
        if let Some(key) = k.strip_prefix("ISTIO_META_") {
            meta.insert(key.to_owned(), Value::String(v.clone()));
            origins.insert(key.to_owned(), format!("ProxyConfig proxyMetadata {k}"));
        }
    }
    for (k, v) in &cfg.bootstrap.node_meta {
        meta.insert(k.clone(), Value::String(v.clone()));
        origins.insert(k.clone(), format!("env ISTIO_META_{k}"));
    }
    for (k, raw) in &cfg.bootstrap.node_meta_json {
        let origin = format!("env ISTIO_METAJSON_{k}");
        let obj: Map<String, Value> =
            serde_json::from_str(raw).map_err(|e| NodeError::MetaJson {
                origin: origin.clone(),
                reason: format!("expected a JSON object: {e}"),
            })?;
        // Every object is merged at the top level (pkg/bootstrap/config.go `GetNodeMetaData`);
        // ISTIO_METAJSON_LABELS also becomes LABELS and STATIC_LABELS
        // (`extractAttributesMetadata`), below.
        for (kk, vv) in &obj {
            origins.insert(kk.clone(), origin.clone());
            meta.insert(kk.clone(), vv.clone());
        }
    }
    let static_labels: Option<Map<String, Value>> = cfg
        .bootstrap
        .node_meta_json
        .get("LABELS")
        .and_then(|raw| serde_json::from_str::<Map<String, Value>>(raw).ok())
        .filter(|m| !m.is_empty());
    if cfg.dns.proxy_addr_set {
        meta.insert(
            "DNS_PROXY_ADDR".into(),
            Value::String(cfg.dns.proxy_addr.clone()),
        );
    }
    validate(&meta, |k| {
        origins
            .get(k)
            .cloned()
            .unwrap_or_else(|| "node metadata".into())
    })?;
    // A StringBool is written back as "true"/"false" whatever spelling it was read in
    // ("T", "1", ...): Istio marshals the typed field.
    for key in STRING_BOOL_KEYS {
        if let Some(Value::String(v)) = meta.get_mut(*key) {
            match v.as_str() {
                "1" | "t" | "T" | "TRUE" | "True" => *v = "true".into(),
                "0" | "f" | "F" | "FALSE" | "False" => *v = "false".into(),
                _ => {}
            }
        }
    }
    // Istio decodes these raw values into typed fields, sets its own, marshals the typed struct
    // (`omitempty`) and adds back every raw key the typed output lacks
    // (pkg/bootstrap/option/convert.go `nodeMetadataConverter`).
    let raw = meta.clone();

    let s = |v: &str| Value::String(v.to_owned());
    let b = |v: bool| Value::String(v.to_string());
    if !meta.contains_key("ISTIO_VERSION") {
        meta.insert("ISTIO_VERSION".into(), s(crate::ISTIO_COMPAT_VERSION));
    }
    let ips_str: Vec<String> = ips.iter().map(|i| i.to_string()).collect();
    meta.insert("INSTANCE_IPS".into(), s(&ips_str.join(",")));
    if cfg.flags.sts_port != 0 {
        meta.insert("STS_PORT".into(), s(&cfg.flags.sts_port.to_string()));
    }
    let boot = &cfg.bootstrap;
    meta.insert("ENVOY_STATUS_PORT".into(), json!(boot.envoy_status_port));
    meta.insert(
        "ENVOY_PROMETHEUS_PORT".into(),
        json!(boot.envoy_prometheus_port),
    );
    if boot.envoy_secure_metrics_port != 0 {
        meta.insert(
            "ENVOY_SECURE_METRICS_PORT".into(),
            json!(boot.envoy_secure_metrics_port),
        );
    }
    if boot.envoy_secure_merged_metrics_port != 0 {
        meta.insert(
            "ENVOY_SECURE_MERGED_METRICS_PORT".into(),
            json!(boot.envoy_secure_merged_metrics_port),
        );
    }
    meta.insert(
        "EXIT_ON_ZERO_ACTIVE_CONNECTIONS".into(),
        b(cfg.lifecycle.exit_on_zero_active_connections),
    );
    let hbone = meta.get("ENABLE_HBONE").and_then(Value::as_str) == Some("true");
    meta.insert(
        "METADATA_DISCOVERY".into(),
        b(boot.peer_metadata_discovery.unwrap_or(hbone)),
    );
    meta.insert(
        "ENVOY_SKIP_DEPRECATED_LOGS".into(),
        b(boot.envoy_skip_deprecated_logs),
    );
    meta.insert(
        "WORKLOAD_IDENTITY_SOCKET_FILE".into(),
        s(&cfg.identity.workload_identity_socket_file),
    );
    meta.insert("PROXY_CONFIG".into(), proxy_config_json(&cfg.proxy_config));
    // LABELS: the static labels, then the pod labels file without `pod-template-hash`; label
    // values are kept as given (pkg/bootstrap/config.go `GetNodeMetaData`).
    let mut labels: Map<String, Value> = static_labels.clone().unwrap_or_default();
    for (k, v) in &cfg.pod_labels {
        if k != "pod-template-hash" {
            labels.insert(k.clone(), s(v));
        }
    }
    // Istio overrides the `istio-locality` label with the sanitized locality label
    // (`topology.istio.io/locality` first), dots turned into slashes
    // (pkg/bootstrap/config.go `GetNodeMetaData`): istiod reads the node's locality from it.
    let loc = ["topology.istio.io/locality", "istio-locality"]
        .iter()
        .find_map(|k| labels.get(*k).and_then(Value::as_str))
        .filter(|l| !l.is_empty())
        .map(sanitize_locality);
    let mut static_labels = static_labels.unwrap_or_default();
    if let Some(loc) = loc {
        // Without a pod labels file, Istio's LABELS is the very map of STATIC_LABELS
        // (ISTIO_METAJSON_LABELS), so the rewrite shows in both.
        if cfg.pod_labels.is_empty() && !static_labels.is_empty() {
            static_labels.insert("istio-locality".into(), Value::String(loc.clone()));
        }
        labels.insert("istio-locality".into(), Value::String(loc));
    }
    meta.insert("LABELS".into(), Value::Object(labels));
    meta.insert("STATIC_LABELS".into(), Value::Object(static_labels));
    {
        meta.insert(
            "ANNOTATIONS".into(),
            Value::Object(
                cfg.pod_annotations
                    .iter()
                    .map(|(k, v)| (k.clone(), s(v)))
                    .collect(),
            ),
        );
    }
    meta.insert("NAME".into(), s(&cfg.pod.name));
    meta.insert("NAMESPACE".into(), s(&cfg.pod.namespace));
    meta.insert("SERVICE_ACCOUNT".into(), s(&cfg.pod.service_account));
    if cfg.proxy_config.control_plane_auth_policy == crate::config::AuthenticationPolicy::MutualTls
    {
        let host = cfg
            .proxy_config
            .discovery_address
            .rsplit_once(':')
            .map_or(cfg.proxy_config.discovery_address.as_str(), |(h, _)| h);
        let san = if host.starts_with("localhost") {
            crate::control_plane::ISTIOD_SVC
        } else {
            host
        };
        meta.insert("PILOT_SAN".into(), json!([san]));
    }
    meta.insert("OUTLIER_LOG_PATH".into(), s(&cfg.flags.outlier_log_path));
    if !platform.metadata.is_empty() {
        meta.insert(
            "PLATFORM_METADATA".into(),
            Value::Object(
                platform
                    .metadata
                    .iter()
                    .map(|(k, v)| (k.clone(), s(v)))
                    .collect(),
            ),
        );
    }
    omit_empty(&mut meta, &raw);
    Ok(meta)
}

/// Istio's typed node metadata keys (pkg/model/proxy.go `NodeMetadata`, JSON names): all are
/// `omitempty`, so an empty string, `false` StringBool, 0, or empty map/list is not emitted.
const TYPED_KEYS: &[&str] = &[
    "PROXY_CONFIG",
    "ISTIO_VERSION",
    "ISTIO_REVISION",
    "LABELS",
    "STATIC_LABELS",
    "ANNOTATIONS",
    "INSTANCE_IPS",
    "NAMESPACE",
    "NODE_NAME",
    "WORKLOAD_NAME",
    "INTERCEPTION_MODE",
    "SERVICE_ACCOUNT",
    "HTTP_PROXY_PORT",
    "MESH_ID",
    "CLUSTER_ID",
    "NETWORK",
    "REQUESTED_NETWORK_VIEW",
    "POD_PORTS",
    "TLS_SERVER_CERT_CHAIN",
    "TLS_SERVER_KEY",
    "TLS_SERVER_ROOT_CERT",
    "TLS_CLIENT_CERT_CHAIN",
    "TLS_CLIENT_KEY",
    "TLS_CLIENT_ROOT_CERT",
    "BASE",
    "IDLE_TIMEOUT",
    "HTTP10",
    "GENERATOR",
    "ENABLE_SELF_DISCOVERY",
    "DNS_CAPTURE",
    "DNS_AUTO_ALLOCATE",
    "DNS_PROXY_ADDR",
    "ENABLE_HBONE",
    "DISABLE_HBONE_SEND",
    "AUTO_REGISTER_GROUP",
    "WORKLOAD_ENTRY",
    "UNPRIVILEGED_POD",
    "PLATFORM_METADATA",
    "STS_PORT",
    "ENVOY_STATUS_PORT",
    "ENVOY_PROMETHEUS_PORT",
    "ENVOY_SECURE_METRICS_PORT",
    "ENVOY_SECURE_MERGED_METRICS_PORT",
    "EXIT_ON_ZERO_ACTIVE_CONNECTIONS",
    "INBOUND_LISTENER_EXACT_BALANCE",
    "OUTBOUND_LISTENER_EXACT_BALANCE",
    "CLOUDRUN_ADDR",
    "ENVOY_SKIP_DEPRECATED_LOGS",
    "WORKLOAD_IDENTITY_SOCKET_FILE",
    "NAME",
    "OWNER",
    "PILOT_SAN",
    "OUTLIER_LOG_PATH",
    "APP_CONTAINERS",
    "ISTIO_PROXY_SHA",
];

/// Drops typed keys whose value is empty (Go `omitempty`), then restores the raw value of any
/// dropped key the raw metadata had. `METADATA_DISCOVERY` is a pointer in Istio, so
/// `"false"` stays.
fn omit_empty(meta: &mut Map<String, Value>, raw: &Map<String, Value>) {
    let empty = |k: &str, v: &Value| match v {
        Value::Null => true,
        Value::String(s) => s.is_empty() || (s == "false" && STRING_BOOL_KEYS.contains(&k)),
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    };
    for k in TYPED_KEYS {
        if meta.get(*k).is_some_and(|v| empty(k, v)) {
            match raw.get(*k) {
                Some(v) => {
                    meta.insert((*k).to_owned(), v.clone());
                }
                None => {
                    meta.remove(*k);
                }
            }
        }
    }
}

/// ProxyConfig fields that are protobuf wrappers (`google.protobuf.*Value`): proto-JSON emits
/// them whenever they are set, zero included.
const PROXY_CONFIG_WRAPPERS: &[&str] = &[
    "concurrency",
    "holdApplicationUntilProxyStarts",
    "statsCompression",
];

/// ProxyConfig's map fields (mesh/v1alpha1/proxy.proto `map<string, string>`).
const PROXY_CONFIG_MAPS: &[&str] = &["proxyMetadata", "runtimeValues"];

/// The ProxyConfig as Istio's `protomarshal.Marshal` writes it: proto-JSON, so scalar fields
/// at their zero value (`""`, 0, false, empty lists and maps, enum value 0) are absent.
pub fn proxy_config_json(pc: &crate::config::ProxyConfig) -> Value {
    let Ok(Value::Object(mut m)) = serde_json::to_value(pc) else {
        return Value::Object(Map::new());
    };
    m.retain(|k, v| {
        if PROXY_CONFIG_WRAPPERS.contains(&k.as_str()) {
            return !v.is_null();
        }
        match v {
            Value::Null => false,
            // Enum zero values: InboundInterceptionMode REDIRECT, AuthenticationPolicy NONE.
            Value::String(s) => !matches!(
                (k.as_str(), s.as_str()),
                (_, "") | ("interceptionMode", "REDIRECT") | ("controlPlaneAuthPolicy", "NONE")
            ),
            Value::Bool(b) => *b,
            Value::Number(n) => n.as_f64() != Some(0.0),
            Value::Array(a) => !a.is_empty(),
            // An empty map (proxyMetadata, runtimeValues) is left out; a message that is set
            // is written even when empty (`tracing: {}`), as protojson does.
            Value::Object(o) => !o.is_empty() || !PROXY_CONFIG_MAPS.contains(&k.as_str()),
        }
    });
    Value::Object(m)
}

/// A locality label's value as a locality: Kubernetes label values cannot hold `/`, so dots
/// stand for them unless the value already has a `/` (pkg/model/proxy.go
/// `SanitizeLocalityLabel`).
fn sanitize_locality(l: &str) -> String {
    if l.contains('/') {
        l.to_owned()
    } else {
        l.replace('.', "/")
    }
}

/// Locality `{region, zone, sub_zone}` from the `topology.istio.io/locality` label, else the
/// legacy `istio-locality` label, dots read as slashes (pkg/model `GetLocalityLabel`,
/// `SanitizeLocalityLabel`, `ConvertLocality`).
pub fn locality(meta: &Map<String, Value>) -> Value {
    locality_with(meta, &crate::platform::Locality::default())
}

/// [`locality`], falling back to the platform's locality when the pod has no locality label
/// (pkg/bootstrap/config.go `GetNodeMetaData`: `options.Platform.Locality()`).
pub fn locality_with(meta: &Map<String, Value>, platform: &crate::platform::Locality) -> Value {
    let label = |k: &str| {
        meta.get("LABELS")
            .and_then(|l| l.get(k))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
    };
    let loc = label("topology.istio.io/locality")
        .or_else(|| label("istio-locality"))
        .map(sanitize_locality)
        .unwrap_or_default();
    let mut out = Map::new();
    if loc.is_empty() {
        for (key, v) in [
            ("region", &platform.region),
            ("zone", &platform.zone),
            ("sub_zone", &platform.sub_zone),
        ] {
            if !v.is_empty() {
                out.insert(key.into(), Value::String(v.clone()));
            }
        }
        return Value::Object(out);
    }
    let mut parts = loc.splitn(3, '/');
    for key in ["region", "zone", "sub_zone"] {
        if let Some(p) = parts.next().filter(|p| !p.is_empty()) {
            out.insert(key.into(), Value::String(p.to_owned()));
        }
    }
    Value::Object(out)
}

/// Node `cluster`: serviceCluster unless it is the default, else the app label (or
/// `WORKLOAD_NAME`, or `istio-proxy`) with the namespace.
pub fn cluster(cfg: &Config, meta: &Map<String, Value>) -> String {
    let label = |k: &str| {
        meta.get("LABELS")
            .and_then(|l| l.get(k))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let workload = || {
        meta.get("WORKLOAD_NAME")
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    // pkg/bootstrap/config.go `getServiceCluster`: the tracingServiceName variants use the
    // canonical service name (pkg/config/labels `CanonicalService`).
    let canonical = || {
        label("service.istio.io/canonical-name")
            .or_else(|| label("app.kubernetes.io/name"))
            .or_else(|| label("app"))
            .or_else(workload)
            .unwrap_or_default()
    };
    let sc = match cfg.proxy_config.tracing_service_name.as_deref() {
        Some("CANONICAL_NAME_ONLY") => canonical(),
        Some("CANONICAL_NAME_AND_NAMESPACE") if !cfg.pod.namespace.is_empty() => {
            return format!("{}.{}", canonical(), cfg.pod.namespace);
        }
        Some("CANONICAL_NAME_AND_NAMESPACE") => canonical(),
        Some(_) => String::new(),
        None => cfg.proxy_config.service_cluster.clone(),
    };
    if !sc.is_empty() && sc != "istio-proxy" {
        return sc;
    }
    let name = label("app")
        .or_else(|| label("app.kubernetes.io/name"))
        .or_else(workload)
        .or_else(|| (!cfg.pod.namespace.is_empty()).then(|| "istio-proxy".into()));
    match name {
        Some(name) => format!("{name}.{}", cfg.pod.namespace),
        // pkg/bootstrap/config.go `serviceClusterOrDefault`: no namespace, no suffix.
        None => "istio-proxy".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, ip: &str, up: bool, lo: bool) -> InterfaceAddr {
        InterfaceAddr {
            interface: name.into(),
            ip: ip.parse().unwrap(),
            up,
            loopback: lo,
        }
    }

    #[test]
    fn instance_ips_order_and_filters() {
        let ifs = vec![
            iface("lo", "127.0.0.1", true, true),
            iface("eth0", "10.0.0.5", true, false),
            iface("eth0", "fe80::1", true, false),
            iface("eth1", "10.1.0.5", true, false),
            iface("down0", "10.2.0.5", false, false),
            iface("eth0", "169.254.1.1", true, false),
        ];
        let ips = instance_ips(Some("10.9.9.9".parse().unwrap()), &ifs, &["eth1"]);
        assert_eq!(
            ips,
            vec![
                "10.9.9.9".parse::<IpAddr>().unwrap(),
                "10.0.0.5".parse().unwrap()
            ]
        );
        let none = instance_ips(None, &[iface("lo", "127.0.0.1", true, true)], &[]);
        assert_eq!(none.len(), 2);
        assert_eq!(localhost_for(&none, false), IpAddr::from([127, 0, 0, 1]));
        let v6: Vec<IpAddr> = vec!["fd00::1".parse().unwrap()];
        assert!(localhost_for(&v6, false).is_ipv6());
        // A mixed pod with an IPv6 INSTANCE_IP: IPv4 unless dual stack is on.
        let mixed: Vec<IpAddr> = vec!["fd00::1".parse().unwrap(), "10.0.0.1".parse().unwrap()];
        assert!(localhost_for(&mixed, false).is_ipv4());
        assert!(localhost_for(&mixed, true).is_ipv6());
    }

    #[test]
    fn proxy_config_json_drops_zero_values_and_keeps_set_wrappers() {
        let mut pc = crate::config::ProxyConfig {
            concurrency: Some(0),
            interception_mode: crate::config::InterceptionMode::Tproxy,
            ..Default::default()
        };
        pc.passthrough
            .insert("statsCompression".into(), json!(false));
        let v = proxy_config_json(&pc);
        let m = v.as_object().unwrap();
        assert_eq!(m["concurrency"], json!(0));
        assert_eq!(m["statsCompression"], json!(false));
        assert_eq!(m["interceptionMode"], json!("TPROXY"));
        for absent in [
            "statsdUdpAddress",
            "customConfigFile",
            "proxyBootstrapTemplatePath",
            "extraStatTags",
            "proxyMetadata",
            "runtimeValues",
            "caCertificatesPem",
            "meshId",
        ] {
            assert!(!m.contains_key(absent), "{absent} in {v}");
        }
        // REDIRECT is the enum's zero value: absent.
        let v = proxy_config_json(&crate::config::ProxyConfig::default());
        assert!(
            v.get("interceptionMode").is_none() && v.get("concurrency").is_none(),
            "{v}"
        );
    }

    #[test]
    fn pod_ports_must_be_a_json_array_string() {
        let mut m = Map::new();
        m.insert("POD_PORTS".into(), json!("[{\"containerPort\":80}]"));
        assert!(validate(&m, |_| "x".into()).is_ok());
        m.insert("POD_PORTS".into(), json!("80,81"));
        let e = validate(&m, |_| "env ISTIO_META_POD_PORTS".into()).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("POD_PORTS")
                && msg.contains("80,81")
                && msg.contains("env ISTIO_META_POD_PORTS"),
            "{msg}"
        );
        let mut m = Map::new();
        m.insert("DNS_CAPTURE".into(), json!("yes"));
        assert!(validate(&m, |_| "x".into()).is_err());
    }
}
