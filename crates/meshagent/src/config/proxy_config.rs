//! Istio's `meshconfig.ProxyConfig`, the subset the agent interprets, with
//! proto-JSON field names so dumps and overlays look like Istio's.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

use super::ConfigError;

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
    /// Other ProxyConfig fields Istio defines, kept verbatim as JSON (see
    /// [`PASSTHROUGH_FIELDS`] for who reads them).
    #[serde(flatten)]
    pub passthrough: BTreeMap<String, Value>,
}

/// Real ProxyConfig fields kept as JSON (and in `PROXY_CONFIG` metadata as given). The
/// bootstrap reads `envoyMetricsService`, `envoyAccessLogService`, `connectionSettings` and
/// `statsCompression`; Envoy's argv reads `fileFlushMinSizeKb`.
pub const PASSTHROUGH_FIELDS: &[&str] = &[
    "envoyAccessLogService",
    "envoyMetricsService",
    "gatewayTopology",
    "fileFlushMinSizeKb",
    "connectionSettings",
    "statsCompression",
];

impl Default for ProxyConfig {
    /// Istio's built-in defaults (`mesh.DefaultProxyConfig`).
    fn default() -> Self {
        Self {
            config_path: PathBuf::from("./etc/istio/proxy"),
            binary_path: PathBuf::from("/usr/local/bin/envoy"),
            service_cluster: "istio-proxy".to_owned(),
            tracing_service_name: None,
            drain_duration: ProtoDuration(Duration::from_secs(45)),
            termination_drain_duration: ProtoDuration(Duration::from_secs(5)),
            discovery_address: "istiod.istio-system.svc:15012".to_owned(),
            statsd_udp_address: String::new(),
            proxy_admin_port: 15000,
            control_plane_auth_policy: AuthenticationPolicy::MutualTls,
            custom_config_file: PathBuf::new(),
            stat_name_length: 189,
            concurrency: None,
            proxy_bootstrap_template_path: PathBuf::new(),
            interception_mode: InterceptionMode::Redirect,
            tracing: None,
            proxy_stats_matcher: None,
            status_port: 15020,
            extra_stat_tags: Vec::new(),
            proxy_metadata: BTreeMap::new(),
            runtime_values: BTreeMap::new(),
            hold_application_until_proxy_starts: None,
            ca_certificates_pem: Vec::new(),
            private_key_provider: None,
            readiness_probe: None,
            mesh_id: String::new(),
            file_flush_interval: None,
            proxy_headers: None,
            image: None,
            passthrough: BTreeMap::new(),
        }
    }
}

// === impl ProxyConfig ===

impl ProxyConfig {
    /// Overlays one ProxyConfig document (already parsed to JSON) onto `self`.
    ///
    /// Every field present replaces the current value wholesale: lists and maps
    /// are replaced, not merged (as Istio's `pkg/config/mesh/mesh.go` `ApplyProxyConfig`). `null` means "not set". Unknown
    /// field names are returned so the caller can warn once; bad values are
    /// pushed to `errors`, naming `origin`.
    pub(crate) fn apply_layer(
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
            if value.is_null() {
                continue;
            }
            // protojson accepts the proto field name as well as the JSON name.
            let field = snake_to_camel(&key);
            let err = |expected: &str| ConfigError::ProxyConfigField {
                origin: origin.to_owned(),
                field: field.clone(),
                value: short_json(&value),
                expected: expected.to_owned(),
            };
            let result = match self.set_field(&field, &value) {
                Ok(true) => Ok(()),
                Ok(false) => {
                    unknown.push(key.clone());
                    Ok(())
                }
                Err(expected) => Err(err(expected)),
            };
            if let Err(e) = result {
                errors.push(e);
            }
        }
        unknown
    }

    /// Sets one field; `Ok(false)` for unknown names, `Err(expected)` for bad values.
    fn set_field(&mut self, field: &str, v: &Value) -> Result<bool, &'static str> {
        const STRING: &str = "a string";
        const DURATION: &str = "a duration string such as \"45s\" or \"0.100s\"";
        const PORT: &str = "a port number between 0 and 65535";
        const UINT: &str = "a non-negative 32-bit integer";
        const STRINGS: &str = "a list of strings";
        const STRING_MAP: &str = "a map of string to string";
        const OBJECT: &str = "an object";
        match field {
            "configPath" => self.config_path = string(v).ok_or(STRING)?.into(),
            "binaryPath" => self.binary_path = string(v).ok_or(STRING)?.into(),
            "serviceCluster" => {
                self.service_cluster = string(v).ok_or(STRING)?;
                self.tracing_service_name = None;
            }
            // An enum (`ProxyConfig.TracingServiceName`, istio.io/api mesh/v1alpha1/proxy.proto),
            // kept by its name.
            "tracingServiceName" => {
                const NAMES: [&str; 3] = [
                    "APP_LABEL_AND_NAMESPACE",
                    "CANONICAL_NAME_ONLY",
                    "CANONICAL_NAME_AND_NAMESPACE",
                ];
                let name = match v {
                    Value::String(s) => NAMES.iter().find(|n| **n == s.as_str()),
                    Value::Number(n) => n
                        .as_u64()
                        .and_then(|i| usize::try_from(i).ok())
                        .and_then(|i| NAMES.get(i)),
                    _ => None,
                }
                .ok_or(
                    "APP_LABEL_AND_NAMESPACE, CANONICAL_NAME_ONLY or CANONICAL_NAME_AND_NAMESPACE (or 0/1/2)",
                )?;
                self.tracing_service_name = Some((*name).to_owned());
                self.service_cluster.clear();
            }
            "drainDuration" => self.drain_duration = duration(v).ok_or(DURATION)?,
            "terminationDrainDuration" => {
                self.termination_drain_duration = duration(v).ok_or(DURATION)?;
            }
            "discoveryAddress" => self.discovery_address = string(v).ok_or(STRING)?,
            "statsdUdpAddress" => self.statsd_udp_address = string(v).ok_or(STRING)?,
            "proxyAdminPort" => self.proxy_admin_port = int(v).ok_or(PORT)?,
            "controlPlaneAuthPolicy" => {
                self.control_plane_auth_policy = match v {
                    Value::String(s) if s == "NONE" => AuthenticationPolicy::None,
                    Value::String(s) if s == "MUTUAL_TLS" => AuthenticationPolicy::MutualTls,
                    Value::Number(n) if n.as_u64() == Some(0) => AuthenticationPolicy::None,
                    Value::Number(n) if n.as_u64() == Some(1) => AuthenticationPolicy::MutualTls,
                    _ => return Err("NONE or MUTUAL_TLS (or 0/1)"),
                };
            }
            "customConfigFile" => self.custom_config_file = string(v).ok_or(STRING)?.into(),
            "statNameLength" => self.stat_name_length = int(v).ok_or(UINT)?,
            "concurrency" => self.concurrency = Some(int(v).ok_or(UINT)?),
            "proxyBootstrapTemplatePath" => {
                self.proxy_bootstrap_template_path = string(v).ok_or(STRING)?.into();
            }
            "interceptionMode" => {
                self.interception_mode = match v {
                    Value::String(s) if s == "REDIRECT" => InterceptionMode::Redirect,
                    Value::String(s) if s == "TPROXY" => InterceptionMode::Tproxy,
                    Value::String(s) if s == "NONE" => InterceptionMode::None,
                    Value::Number(n) if n.as_u64() == Some(0) => InterceptionMode::Redirect,
                    Value::Number(n) if n.as_u64() == Some(1) => InterceptionMode::Tproxy,
                    Value::Number(n) if n.as_u64() == Some(2) => InterceptionMode::None,
                    _ => return Err("REDIRECT, TPROXY or NONE (or 0/1/2)"),
                };
            }
            "tracing" => self.tracing = Some(object(v).ok_or(OBJECT)?),
            "proxyStatsMatcher" => {
                self.proxy_stats_matcher = Some(
                    typed(v).ok_or("an object with inclusionPrefixes, inclusionSuffixes or inclusionRegexps string lists")?,
                );
            }
            "statusPort" => self.status_port = int(v).ok_or(PORT)?,
            "extraStatTags" => self.extra_stat_tags = typed(v).ok_or(STRINGS)?,
            // Istio's MergeProxyConfig merges proxyMetadata key by key across layers
            // (mergeMap); every other field is replaced.
            "proxyMetadata" => {
                let layer: BTreeMap<String, String> = typed(v).ok_or(STRING_MAP)?;
                self.proxy_metadata.extend(layer);
            }
            "runtimeValues" => self.runtime_values = typed(v).ok_or(STRING_MAP)?,
            "holdApplicationUntilProxyStarts" => {
                self.hold_application_until_proxy_starts = Some(v.as_bool().ok_or("a boolean")?);
            }
            "caCertificatesPem" => self.ca_certificates_pem = typed(v).ok_or(STRINGS)?,
            "privateKeyProvider" => self.private_key_provider = Some(object(v).ok_or(OBJECT)?),
            "readinessProbe" => self.readiness_probe = Some(object(v).ok_or(OBJECT)?),
            "meshId" => self.mesh_id = string(v).ok_or(STRING)?,
            "fileFlushInterval" => self.file_flush_interval = Some(duration(v).ok_or(DURATION)?),
            "proxyHeaders" => self.proxy_headers = Some(object(v).ok_or(OBJECT)?),
            "image" => self.image = Some(object(v).ok_or(OBJECT)?),
            // Kept as JSON, but of the proto type Istio's schema gives each (a uint32 in its
            // number form, a google.protobuf.BoolValue, messages as objects).
            "fileFlushMinSizeKb" => {
                let kb: u32 = int(v).ok_or(UINT)?;
                self.passthrough.insert(field.to_owned(), Value::from(kb));
            }
            "statsCompression" => {
                let on = v.as_bool().ok_or("a boolean")?;
                self.passthrough.insert(field.to_owned(), Value::Bool(on));
            }
            f if PASSTHROUGH_FIELDS.contains(&f) => {
                self.passthrough
                    .insert(f.to_owned(), object(v).ok_or(OBJECT)?);
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

fn string(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

fn duration(v: &Value) -> Option<ProtoDuration> {
    v.as_str().and_then(ProtoDuration::parse)
}

/// proto-JSON int32: a number or a decimal string.
fn int<T: TryFrom<u64>>(v: &Value) -> Option<T> {
    let n = match v {
        Value::Number(n) => n.as_u64()?,
        Value::String(s) => s.parse().ok()?,
        _ => return None,
    };
    T::try_from(n).ok()
}

fn object(v: &Value) -> Option<Value> {
    v.is_object().then(|| v.clone())
}

fn typed<T: DeserializeOwned>(v: &Value) -> Option<T> {
    serde_json::from_value(v.clone()).ok()
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

fn snake_to_camel(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    let mut upper = false;
    for c in key.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
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

    #[test]
    fn snake_case_keys_are_accepted() {
        assert_eq!(snake_to_camel("discovery_address"), "discoveryAddress");
        assert_eq!(snake_to_camel("proxyAdminPort"), "proxyAdminPort");
    }
}
