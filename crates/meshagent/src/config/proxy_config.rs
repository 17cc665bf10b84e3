//! Istio's `meshconfig.ProxyConfig`: each layer parsed into the message generated from
//! Istio's `mesh/v1alpha1/proxy.proto` (build.rs, `config::istio`) and merged as Istio does,
//! then presented to the rest of the agent as [`ProxyConfig`] (typed where the agent reads
//! a field, proto-JSON otherwise).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

use super::ConfigError;
use super::istio::mesh::v1alpha1 as pb;

/// A `google.protobuf.Duration`, written in proto-JSON form (`"45s"`, `"0.100s"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ProtoDuration(pub Duration);

impl ProtoDuration {
    /// Parses the proto-JSON form: seconds with up to nine fractional digits
    /// and an `s` suffix. Negative durations are rejected: none make sense here.
    pub fn parse(s: &str) -> Option<Self> {
        let num = s.strip_suffix('s')?;
        let (int, frac) = num.split_once('.').unwrap_or((num, ""));
        if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if num.ends_with('.') {
            return None;
        }
        let secs: u64 = int.parse().ok()?;
        let nanos: u32 = if frac.is_empty() {
            0
        } else {
            format!("{frac:0<9}").parse().ok()?
        };
        Some(Self(Duration::new(secs, nanos)))
    }

    /// The wrapped duration.
    pub fn get(self) -> Duration {
        self.0
    }
}

impl fmt::Display for ProtoDuration {
    /// Same shape as protojson: 0, 3, 6 or 9 fractional digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0.as_secs();
        let nanos = self.0.subsec_nanos();
        if nanos == 0 {
            write!(f, "{secs}s")
        } else if nanos.is_multiple_of(1_000_000) {
            write!(f, "{secs}.{:03}s", nanos / 1_000_000)
        } else if nanos.is_multiple_of(1_000) {
            write!(f, "{secs}.{:06}s", nanos / 1_000)
        } else {
            write!(f, "{secs}.{nanos:09}s")
        }
    }
}

impl Serialize for ProtoDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// `meshconfig.AuthenticationPolicy` for the control-plane connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AuthenticationPolicy {
    /// Plaintext to istiod.
    None,
    /// TLS to istiod (the default).
    MutualTls,
}

/// `ProxyConfig.InboundInterceptionMode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum InterceptionMode {
    /// iptables REDIRECT (the default).
    Redirect,
    /// iptables TPROXY.
    Tproxy,
    /// No interception.
    None,
}

/// `ProxyConfig.proxyStatsMatcher`: extra Envoy stats to keep. Empty lists are not
/// serialized: proto-JSON leaves out empty repeated fields, and the node's `PROXY_CONFIG`
/// metadata is proto-JSON.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProxyStatsMatcher {
    /// Stat name prefixes to include.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inclusion_prefixes: Vec<String>,
    /// Stat name suffixes to include.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inclusion_suffixes: Vec<String>,
    /// Stat name regular expressions to include.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inclusion_regexps: Vec<String>,
}

/// The effective `ProxyConfig` after all layers (see `config::load`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyConfig {
    /// Directory for generated Envoy config and agent sockets.
    pub config_path: PathBuf,
    /// Envoy binary.
    pub binary_path: PathBuf,
    /// Envoy `--service-cluster`; empty means "use `--serviceCluster`".
    pub service_cluster: String,
    /// Alternative to `serviceCluster` (same proto oneof); kept verbatim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracing_service_name: Option<String>,
    /// Envoy `--drain-time-s`.
    pub drain_duration: ProtoDuration,
    /// Fixed wait after draining before Envoy is stopped.
    pub termination_drain_duration: ProtoDuration,
    /// istiod xDS address (`host:port`).
    pub discovery_address: String,
    /// Statsd sink address; empty disables it.
    pub statsd_udp_address: String,
    /// Envoy admin port (localhost only).
    pub proxy_admin_port: u16,
    /// TLS or plaintext to istiod.
    pub control_plane_auth_policy: AuthenticationPolicy,
    /// Use this Envoy config file instead of generating a bootstrap.
    pub custom_config_file: PathBuf,
    /// Envoy `--max-obj-name-len`.
    pub stat_name_length: u32,
    /// Envoy worker threads; `None` means unset (distinct from 0 = one per CPU).
    pub concurrency: Option<u32>,
    /// Bootstrap template override.
    pub proxy_bootstrap_template_path: PathBuf,
    /// Inbound interception mode.
    pub interception_mode: InterceptionMode,
    /// Tracer settings, passed through to bootstrap generation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracing: Option<Value>,
    /// Extra Envoy stats to keep.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_stats_matcher: Option<ProxyStatsMatcher>,
    /// Agent status server port; 0 disables it.
    pub status_port: u16,
    /// Extra stat tags for Istio metrics.
    pub extra_stat_tags: Vec<String>,
    /// Extra environment for the agent (mostly `ISTIO_META_*`).
    pub proxy_metadata: BTreeMap<String, String>,
    /// Envoy runtime overrides.
    pub runtime_values: BTreeMap<String, String>,
    /// Block application start until the proxy is ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_application_until_proxy_starts: Option<bool>,
    /// Extra PEM roots for the istiod connection (public certificates).
    pub ca_certificates_pem: Vec<String>,
    /// Private key provider settings, passed through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub private_key_provider: Option<Value>,
    /// Envoy readiness probe settings, passed through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readiness_probe: Option<Value>,
    /// Mesh ID.
    pub mesh_id: String,
    /// Access log flush interval.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_flush_interval: Option<ProtoDuration>,
    /// Proxy header settings, passed through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_headers: Option<Value>,
    /// Proxy image settings, passed through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image: Option<Value>,
    /// The other fields of Istio's ProxyConfig that are set, as proto-JSON under their JSON
    /// names. The bootstrap reads `envoyMetricsService`, `envoyAccessLogService`,
    /// `connectionSettings` and `statsCompression`; Envoy's argv reads `fileFlushMinSizeKb`.
    #[serde(flatten)]
    pub passthrough: BTreeMap<String, Value>,
}

/// The ProxyConfig fields the agent's struct types itself; every other field Istio's
/// ProxyConfig has goes to [`ProxyConfig::passthrough`] as its proto-JSON.
const TYPED_FIELDS: &[&str] = &[
    "configPath",
    "binaryPath",
    "serviceCluster",
    "tracingServiceName",
    "drainDuration",
    "terminationDrainDuration",
    "discoveryAddress",
    "statsdUdpAddress",
    "proxyAdminPort",
    "controlPlaneAuthPolicy",
    "customConfigFile",
    "statNameLength",
    "concurrency",
    "proxyBootstrapTemplatePath",
    "interceptionMode",
    "tracing",
    "proxyStatsMatcher",
    "statusPort",
    "extraStatTags",
    "proxyMetadata",
    "runtimeValues",
    "holdApplicationUntilProxyStarts",
    "caCertificatesPem",
    "privateKeyProvider",
    "readinessProbe",
    "meshId",
    "fileFlushInterval",
    "proxyHeaders",
    "image",
];

/// Istio's built-in defaults (pkg/config/mesh/mesh.go `DefaultProxyConfig`).
fn default_message() -> pb::ProxyConfig {
    pb::ProxyConfig {
        config_path: "./etc/istio/proxy".to_owned(),
        binary_path: "/usr/local/bin/envoy".to_owned(),
        cluster_name: Some(pb::proxy_config::ClusterName::ServiceCluster(
            "istio-proxy".to_owned(),
        )),
        drain_duration: Some(pbjson_types::Duration {
            seconds: 45,
            nanos: 0,
        }),
        termination_drain_duration: Some(pbjson_types::Duration {
            seconds: 5,
            nanos: 0,
        }),
        discovery_address: "istiod.istio-system.svc:15012".to_owned(),
        proxy_admin_port: 15000,
        control_plane_auth_policy: pb::AuthenticationPolicy::MutualTls as i32,
        stat_name_length: 189,
        status_port: 15020,
        ..Default::default()
    }
}

impl Default for ProxyConfig {
    /// Istio's built-in defaults (`mesh.DefaultProxyConfig`).
    fn default() -> Self {
        Self::from_message(&default_message())
    }
}

/// The ProxyConfig layers (mesh config `defaultConfig`, `PROXY_CONFIG`, the
/// `proxy.istio.io/config` annotation) merged into Istio's generated message as Istio's
/// `MergeProxyConfig` does (pkg/config/mesh/mesh.go).
pub(crate) struct ProxyConfigLayers {
    merged: pb::ProxyConfig,
}

impl Default for ProxyConfigLayers {
    fn default() -> Self {
        Self {
            merged: default_message(),
        }
    }
}

impl ProxyConfigLayers {
    /// Overlays one ProxyConfig document (already parsed to JSON).
    ///
    /// Each field is parsed with Istio's proto-JSON rules (the generated message's pbjson
    /// impls: JSON or proto field name, ints as numbers or strings, enums by name or number,
    /// nested messages checked field by field with unknown nested names ignored, as
    /// `protomarshal.ApplyJSON`'s retry with `AllowUnknownFields` does). Every field present
    /// replaces the current value wholesale, as golang/protobuf's jsonpb does (`null` means
    /// "not set"), except `proxyMetadata`, merged key by key, and `proxyHeaders`, whose unset
    /// headers keep the earlier layer's (`MergeProxyConfig`'s `mergeMap` and
    /// `correctProxyHeaders`). Unknown top-level field names are returned so the caller can
    /// warn once; bad values are pushed to `errors`, naming `origin`.
    pub(crate) fn apply(
        &mut self,
        origin: &str,
        layer: Value,
        errors: &mut Vec<ConfigError>,
    ) -> Vec<String> {
        let map = match layer {
            Value::Null => return Vec::new(),
            Value::Object(map) => map,
            other => {
                errors.push(ConfigError::Parse {
                    origin: origin.to_owned(),
                    reason: format!("expected a ProxyConfig object, found {}", kind(&other)),
                });
                return Vec::new();
            }
        };
        let mut unknown = Vec::new();
        for (key, value) in map {
            // protojson accepts the proto field name as well as the JSON name.
            let Some(&(field, _)) = pb::FIELDS.iter().find(|(j, p)| *j == key || *p == key) else {
                unknown.push(key);
                continue;
            };
            if value.is_null() {
                continue;
            }
            let err = |expected: String| ConfigError::ProxyConfigField {
                origin: origin.to_owned(),
                field: field.to_owned(),
                value: short_json(&value),
                expected,
            };
            let mut one = serde_json::Map::new();
            let mut nested = value.clone();
            drop_nulls(&mut nested);
            one.insert(field.to_owned(), nested);
            let mut parsed: pb::ProxyConfig = match serde_json::from_value(Value::Object(one)) {
                Ok(m) => m,
                Err(e) => {
                    errors.push(err(expected(field, &e.to_string())));
                    continue;
                }
            };
            if let Err(expected) = check(field, &parsed) {
                errors.push(err(expected.to_owned()));
                continue;
            }
            match field {
                "proxyMetadata" => self
                    .merged
                    .proxy_metadata
                    .append(&mut parsed.proxy_metadata),
                "proxyHeaders" => {
                    let orig = self.merged.proxy_headers.take();
                    let mut headers = parsed.proxy_headers.take();
                    if let (Some(h), Some(o)) = (headers.as_mut(), orig) {
                        correct_proxy_headers(h, o);
                    }
                    self.merged.proxy_headers = headers;
                }
                _ => {
                    pb::take_field(&mut self.merged, &mut parsed, field);
                }
            }
        }
        unknown
    }

    /// The effective ProxyConfig of the layers applied.
    pub(crate) fn finish(&self) -> ProxyConfig {
        ProxyConfig::from_message(&self.merged)
    }
}

/// jsonpb skips a `null` field at any depth as unset; pbjson takes `null` only for message
/// fields. ProxyConfig reaches no `google.protobuf.Value`, where `null` would be a value.
fn drop_nulls(v: &mut Value) {
    match v {
        Value::Object(o) => {
            o.retain(|_, v| !v.is_null());
            o.values_mut().for_each(drop_nulls);
        }
        Value::Array(a) => a.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

/// Headers a later layer's `proxyHeaders` leaves unset keep the earlier value
/// (pkg/config/mesh/mesh.go `correctProxyHeaders`: `ptr.NonEmptyOrDefault`).
fn correct_proxy_headers(
    h: &mut pb::proxy_config::ProxyHeaders,
    o: pb::proxy_config::ProxyHeaders,
) {
    if h.forwarded_client_cert == 0 {
        h.forwarded_client_cert = o.forwarded_client_cert;
    }
    h.request_id = h.request_id.take().or(o.request_id);
    h.attempt_count = h.attempt_count.take().or(o.attempt_count);
    h.server = h.server.take().or(o.server);
    h.envoy_debug_headers = h.envoy_debug_headers.take().or(o.envoy_debug_headers);
}

const DURATION: &str = "a duration string such as \"45s\" or \"0.100s\"";
const PORT: &str = "a port number between 0 and 65535";
const UINT: &str = "a non-negative 32-bit integer";
const AUTH_POLICY: &str = "NONE or MUTUAL_TLS (or 0/1)";

/// What a field takes, for an error about a value proto-JSON refused (`reason` is pbjson's).
fn expected(field: &str, reason: &str) -> String {
    let what = match field {
        "drainDuration" | "terminationDrainDuration" | "fileFlushInterval" => DURATION,
        "proxyAdminPort" | "statusPort" => PORT,
        "statNameLength" | "concurrency" | "fileFlushMinSizeKb" => UINT,
        "controlPlaneAuthPolicy" => AUTH_POLICY,
        "interceptionMode" => "REDIRECT, TPROXY or NONE (or 0/1/2)",
        "tracingServiceName" => {
            "APP_LABEL_AND_NAMESPACE, CANONICAL_NAME_ONLY or CANONICAL_NAME_AND_NAMESPACE (or 0/1/2)"
        }
        "proxyMetadata" | "runtimeValues" => "a map of string to string",
        "extraStatTags" | "caCertificatesPem" => "a list of strings",
        "holdApplicationUntilProxyStarts" | "statsCompression" => "a boolean",
        f if pb::FIELDS.iter().any(|(j, _)| *j == f && string_field(j)) => "a string",
        _ => "an object of Istio's type for this field",
    };
    format!("{what} ({reason})")
}

fn string_field(json_name: &str) -> bool {
    matches!(
        json_name,
        "configPath"
            | "binaryPath"
            | "serviceCluster"
            | "discoveryAddress"
            | "zipkinAddress"
            | "statsdUdpAddress"
            | "envoyMetricsServiceAddress"
            | "availabilityZone"
            | "customConfigFile"
            | "proxyBootstrapTemplatePath"
            | "meshId"
    )
}

/// The agent's checks beyond proto-JSON on a field just parsed: values the schema takes
/// that mean nothing (negative counts and waits) or that the agent's types cannot hold
/// (ports above 65535). Istio's agent refuses some of them right after parsing
/// (pkg/config/validation/agent `ValidateMeshConfigProxyConfig`); the rest it takes.
fn check(field: &str, m: &pb::ProxyConfig) -> Result<(), &'static str> {
    let non_negative_duration = |d: Option<&pbjson_types::Duration>| match d {
        Some(d) if d.seconds < 0 || d.nanos < 0 => Err(DURATION),
        _ => Ok(()),
    };
    let port = |p: i32| u16::try_from(p).map(drop).map_err(|_| PORT);
    let uint = |n: i32| u32::try_from(n).map(drop).map_err(|_| UINT);
    match field {
        "drainDuration" => non_negative_duration(m.drain_duration.as_ref()),
        "terminationDrainDuration" => non_negative_duration(m.termination_drain_duration.as_ref()),
        "fileFlushInterval" => non_negative_duration(m.file_flush_interval.as_ref()),
        "proxyAdminPort" => port(m.proxy_admin_port),
        "statusPort" => port(m.status_port),
        "statNameLength" => uint(m.stat_name_length),
        "concurrency" => m.concurrency.as_ref().map_or(Ok(()), |c| uint(c.value)),
        // INHERIT is for scopes below the mesh; Istio's ValidateControlPlaneAuthPolicy refuses
        // it too.
        "controlPlaneAuthPolicy" => {
            match pb::AuthenticationPolicy::try_from(m.control_plane_auth_policy) {
                Ok(pb::AuthenticationPolicy::None | pb::AuthenticationPolicy::MutualTls) => Ok(()),
                _ => Err(AUTH_POLICY),
            }
        }
        _ => Ok(()),
    }
}

// === impl ProxyConfig ===

impl ProxyConfig {
    /// The agent's view of Istio's message. Values are the checked ones ([`check`]); the
    /// nested messages and the fields the agent does not type are kept as proto-JSON.
    fn from_message(m: &pb::ProxyConfig) -> Self {
        use pb::proxy_config::ClusterName;
        let duration = |d: Option<&pbjson_types::Duration>| {
            let d = d.copied().unwrap_or_default();
            ProtoDuration(Duration::new(
                u64::try_from(d.seconds).unwrap_or(0),
                u32::try_from(d.nanos).unwrap_or(0),
            ))
        };
        let (service_cluster, tracing_service_name) = match &m.cluster_name {
            Some(ClusterName::ServiceCluster(s)) => (s.clone(), None),
            Some(ClusterName::TracingServiceName(n)) => (
                String::new(),
                Some(
                    pb::proxy_config::TracingServiceName::try_from(*n)
                        .unwrap_or_default()
                        .as_str_name()
                        .to_owned(),
                ),
            ),
            None => (String::new(), None),
        };
        let mut passthrough = BTreeMap::new();
        if let Ok(Value::Object(all)) = serde_json::to_value(m) {
            for (k, v) in all {
                if !TYPED_FIELDS.contains(&k.as_str()) {
                    passthrough.insert(k, v);
                }
            }
        }
        Self {
            config_path: PathBuf::from(&m.config_path),
            binary_path: PathBuf::from(&m.binary_path),
            service_cluster,
            tracing_service_name,
            drain_duration: duration(m.drain_duration.as_ref()),
            termination_drain_duration: duration(m.termination_drain_duration.as_ref()),
            discovery_address: m.discovery_address.clone(),
            statsd_udp_address: m.statsd_udp_address.clone(),
            proxy_admin_port: u16::try_from(m.proxy_admin_port).unwrap_or(0),
            control_plane_auth_policy: match pb::AuthenticationPolicy::try_from(
                m.control_plane_auth_policy,
            ) {
                Ok(pb::AuthenticationPolicy::None) => AuthenticationPolicy::None,
                _ => AuthenticationPolicy::MutualTls,
            },
            custom_config_file: PathBuf::from(&m.custom_config_file),
            stat_name_length: u32::try_from(m.stat_name_length).unwrap_or(0),
            concurrency: m
                .concurrency
                .as_ref()
                .map(|c| u32::try_from(c.value).unwrap_or(0)),
            proxy_bootstrap_template_path: PathBuf::from(&m.proxy_bootstrap_template_path),
            interception_mode: match pb::proxy_config::InboundInterceptionMode::try_from(
                m.interception_mode,
            ) {
                Ok(pb::proxy_config::InboundInterceptionMode::Tproxy) => InterceptionMode::Tproxy,
                Ok(pb::proxy_config::InboundInterceptionMode::None) => InterceptionMode::None,
                _ => InterceptionMode::Redirect,
            },
            tracing: m.tracing.as_ref().map(proto_json),
            proxy_stats_matcher: m.proxy_stats_matcher.as_ref().map(|s| ProxyStatsMatcher {
                inclusion_prefixes: s.inclusion_prefixes.clone(),
                inclusion_suffixes: s.inclusion_suffixes.clone(),
                inclusion_regexps: s.inclusion_regexps.clone(),
            }),
            status_port: u16::try_from(m.status_port).unwrap_or(0),
            extra_stat_tags: m.extra_stat_tags.clone(),
            proxy_metadata: m.proxy_metadata.clone(),
            runtime_values: m.runtime_values.clone(),
            hold_application_until_proxy_starts: m
                .hold_application_until_proxy_starts
                .as_ref()
                .map(|b| b.value),
            ca_certificates_pem: m.ca_certificates_pem.clone(),
            private_key_provider: m.private_key_provider.as_ref().map(proto_json),
            readiness_probe: m.readiness_probe.as_ref().map(proto_json),
            mesh_id: m.mesh_id.clone(),
            file_flush_interval: m.file_flush_interval.as_ref().map(|d| duration(Some(d))),
            proxy_headers: m.proxy_headers.as_ref().map(proto_json),
            image: m.image.as_ref().map(proto_json),
            passthrough: passthrough
                .into_iter()
                .map(|(k, mut v)| {
                    integral_floats_as_integers(&mut v);
                    (k, v)
                })
                .collect(),
        }
    }
}

/// A generated message's proto-JSON.
fn proto_json<T: Serialize>(m: &T) -> Value {
    let mut v = serde_json::to_value(m).unwrap_or(Value::Null);
    integral_floats_as_integers(&mut v);
    v
}

/// protojson writes a `double` with no fraction as an integer (`100`, not `100.0`), and the
/// node's `PROXY_CONFIG` metadata is compared with Istio's as JSON values.
fn integral_floats_as_integers(v: &mut Value) {
    match v {
        Value::Number(n) if n.is_f64() => {
            if let Some(f) = n.as_f64()
                && f.fract() == 0.0
                && f.abs() < 9.0e15
            {
                #[allow(clippy::cast_possible_truncation, reason = "integral and below 2^53")]
                let i = f as i64;
                *v = Value::from(i);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(integral_floats_as_integers),
        Value::Object(o) => o.values_mut().for_each(integral_floats_as_integers),
        _ => {}
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// A JSON rendering of a bad value, cut short so errors stay one line.
fn short_json(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proto_durations_round_trip() {
        for (s, d, shown) in [
            ("45s", Duration::from_secs(45), "45s"),
            ("1.5s", Duration::from_millis(1500), "1.500s"),
            ("0.100s", Duration::from_millis(100), "0.100s"),
            ("0.000001s", Duration::from_micros(1), "0.000001s"),
            ("0.000000001s", Duration::from_nanos(1), "0.000000001s"),
        ] {
            let p = ProtoDuration::parse(s).unwrap();
            assert_eq!(p.get(), d, "{s}");
            assert_eq!(p.to_string(), shown);
        }
        for bad in ["45", "1m", "-1s", "1.s", ".5s", "1.0000000001s", "s", "abc"] {
            assert_eq!(ProtoDuration::parse(bad), None, "{bad}");
        }
    }
}
