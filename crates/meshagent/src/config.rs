//! The agent's typed configuration.
//!
//! [`load`] assembles one plain-data [`Config`] from built-in defaults, the
//! mesh config file, `PROXY_CONFIG`, pod annotations, environment variables
//! and `proxy` flags, in Istio's order (Istio: `pilot/cmd/pilot-agent/config/config.go`, `pkg/config/mesh/mesh.go`). This is the only module
//! that reads the environment; everything else receives a `Config`.
//!
//! Environment variables follow Istio's parsing rules (see `env::Reader`): a scalar
//! that does not parse is a warning and the default, as in Istio. Every other bad
//! value is an error. What a start would reject beyond that (a template, the override file,
//! the CA and xDS endpoints) is checked one layer up, by `preflight`, which `proxy` and
//! `proxy --dump-config` both run. This module imports nothing else of the agent.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Serialize;

mod env;
mod files;
mod identity;
mod istio;
pub(crate) mod parse;
pub mod probers;
mod proxy_config;
mod vars;

#[cfg(test)]
mod tests;

pub use env::{EnvSource, MapEnv, ProcessEnv};
pub use files::POD_ANNOTATIONS_PATH;
pub use identity::{EccCurve, ISTIO_TOKEN_PATH, IdentityConfig, PlatformConfig};
pub use proxy_config::{
    AuthenticationPolicy, InterceptionMode, ProtoDuration, ProxyConfig, ProxyStatsMatcher,
};
pub use vars::{
    BootstrapConfig, DnsConfig, GrpcConfig, LifecycleConfig, PodConfig, StatusConfig, WasmConfig,
    XdsConfig,
};

use env::Reader;
pub(crate) use parse::{parse_go_bool, parse_go_duration};

/// Pod annotation carrying a ProxyConfig overlay.
pub const ANNOTATION_PROXY_CONFIG: &str = "proxy.istio.io/config";
/// Pod annotation overriding `discoveryAddress`.
pub const ANNOTATION_DISCOVERY_ADDRESS: &str = "sidecar.istio.io/discoveryAddress";
/// Pod annotation overriding `statusPort`.
pub const ANNOTATION_STATUS_PORT: &str = "status.sidecar.istio.io/port";

/// A configuration problem. Messages name the variable, file or field, the
/// bad value, and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// An environment variable has a bad value.
    #[error("invalid {name}={value:?}: expected {expected}")]
    InvalidEnv {
        name: String,
        value: String,
        expected: String,
    },
    /// An environment variable the agent reads is set to bytes that are not UTF-8.
    #[error("environment variable {name} is not valid UTF-8")]
    NotUnicode { name: String },
    /// A pod annotation has a bad value.
    #[error("invalid annotation {name}={value:?}: expected {expected}")]
    InvalidAnnotation {
        name: String,
        value: String,
        expected: String,
    },
    /// A file exists but cannot be read.
    #[error("cannot read {what} {path}: {reason}", path = .path.display())]
    ReadFile {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    /// A document (file, env value or annotation) is not valid YAML/JSON of the right shape.
    #[error("cannot parse {origin}: {reason}")]
    Parse { origin: String, reason: String },
    /// A known ProxyConfig field has a value of the wrong type.
    #[error("invalid ProxyConfig field {field}={value} in {origin}: expected {expected}")]
    ProxyConfigField {
        origin: String,
        field: String,
        value: String,
        expected: String,
    },
    /// The merged ProxyConfig fails validation.
    #[error("invalid effective ProxyConfig {field}={value:?}: expected {expected}")]
    Validation {
        field: &'static str,
        value: String,
        expected: &'static str,
    },
    /// Several of the above.
    #[error("{} configuration errors: {}", .0.len(), join(.0))]
    Multiple(Vec<ConfigError>),
}

fn join(errors: &[ConfigError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl ConfigError {
    fn from_many(mut errors: Vec<ConfigError>) -> Self {
        if errors.len() == 1 {
            errors.remove(0)
        } else {
            Self::Multiple(errors)
        }
    }
}

/// Environment variables Istio removed or replaced, which the agent ignores: name, and what to
/// use instead. Each set one is one warning per process ([`warn_once`]).
pub const DEPRECATED_ENV: &[(&str, &str)] = &[
    // Istio #57571 removed the istio-proxy stats plugin's metric rotation; Envoy's own stats
    // eviction (`stats_eviction_interval` in the bootstrap) replaces it.
    (
        "METRIC_ROTATION_INTERVAL",
        "Envoy's stats eviction: the sidecar.istio.io/statsEvictionInterval annotation",
    ),
    (
        "METRIC_GRACEFUL_DELETION_INTERVAL",
        "Envoy's stats eviction: the sidecar.istio.io/statsEvictionInterval annotation",
    ),
];

/// Pod annotations Istio replaced, which the agent ignores: name, and what to use instead.
pub const DEPRECATED_ANNOTATIONS: &[(&str, &str)] = &[
    // Istio #58717 moved it into ProxyConfig.
    (
        "sidecar.istio.io/statsCompression",
        "ProxyConfig statsCompression (e.g. the proxy.istio.io/config annotation \
         `statsCompression: false`)",
    ),
];

/// Logs `message` as a warning unless this process already did: a deprecated or ignored
/// input is named once, however often the configuration is loaded (`proxy`, then a `debug
/// bundle` deriving it again, or a test loading it many times). Returns whether this call
/// logged it.
pub fn warn_once(message: &str) -> bool {
    static WARNED: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let first = WARNED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(message.to_owned());
    if first {
        tracing::warn!("{message}");
    }
    first
}

/// One warning per deprecated input that is set: variables from `r`, annotations, and the
/// flags the agent accepts but does nothing with.
fn deprecation_warnings(
    r: &Reader<'_>,
    annotations: &BTreeMap<String, String>,
    flags: &ProxyFlags,
) -> Vec<String> {
    let mut out = Vec::new();
    for (name, instead) in DEPRECATED_ENV {
        if r.get(name).is_some() {
            out.push(format!(
                "{name} is set but ignored: Istio removed it; use {instead}"
            ));
        }
    }
    for (name, instead) in DEPRECATED_ANNOTATIONS {
        if annotations.contains_key(*name) {
            out.push(format!(
                "annotation {name} is set but ignored: Istio replaced it; use {instead}"
            ));
        }
    }
    if !flags.token_manager_plugin.is_empty() {
        out.push(format!(
            "--tokenManagerPlugin={} is accepted but ignored: the agent has no STS token \
             manager (tokens come from the projected token file)",
            flags.token_manager_plugin
        ));
    }
    out
}

/// The `proxy` subcommand's TYPE argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProxyType {
    /// Application sidecar (the default).
    #[default]
    Sidecar,
    /// Gateway.
    Router,
    /// Ambient waypoint.
    Waypoint,
    /// Ambient node proxy.
    Ztunnel,
    /// agentgateway.
    Agentgateway,
}

impl ProxyType {
    /// The name used on the command line and in node IDs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sidecar => "sidecar",
            Self::Router => "router",
            Self::Waypoint => "waypoint",
            Self::Ztunnel => "ztunnel",
            Self::Agentgateway => "agentgateway",
        }
    }
}

impl fmt::Display for ProxyType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unrecognised `proxy` TYPE (Istio's wording).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid proxy Type: {0:?}")]
pub struct InvalidProxyType(pub String);

impl FromStr for ProxyType {
    type Err = InvalidProxyType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "sidecar" => Self::Sidecar,
            "router" => Self::Router,
            "waypoint" => Self::Waypoint,
            "ztunnel" => Self::Ztunnel,
            "agentgateway" => Self::Agentgateway,
            _ => return Err(InvalidProxyType(s.to_owned())),
        })
    }
}

/// The `proxy` command-line flags (Istio: `pilot/cmd/pilot-agent/app/cmd.go`) as plain data, so config can be
/// loaded without going through the CLI parser.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyFlags {
    /// Positional TYPE.
    pub proxy_type: ProxyType,
    /// `--domain`; empty means `${POD_NAMESPACE}.svc.cluster.local`.
    pub domain: String,
    /// `--meshConfig`: mesh config YAML file.
    pub mesh_config: PathBuf,
    /// `--stsPort`: only reported in node metadata.
    pub sts_port: u16,
    /// `--tokenManagerPlugin`: accepted, unused.
    pub token_manager_plugin: String,
    /// `--serviceCluster`: fills an empty ProxyConfig.serviceCluster.
    pub service_cluster: String,
    /// `--proxyLogLevel`: Envoy log level, possibly with `scope:level` pairs.
    pub proxy_log_level: String,
    /// `--proxyComponentLogLevel`: Envoy `--component-log-level`.
    pub proxy_component_log_level: String,
    /// `--concurrency`: legacy; non-zero overrides ProxyConfig.concurrency.
    pub concurrency: u32,
    /// `--templateFile`: bootstrap template, unless customConfigFile is set.
    pub template_file: PathBuf,
    /// `--outlierLogPath`: Envoy outlier event log.
    pub outlier_log_path: String,
    /// `--profiling`: `/debug/config_dump`, `/debug/tokioz` and (with `MESHAGENT_PROFILING`)
    /// `/debug/pprof/profile` on the status port.
    pub profiling: bool,
    /// Root `--log_as_json`; also passed to the Envoy bootstrap as `log_json`.
    pub log_as_json: bool,
}

impl Default for ProxyFlags {
    fn default() -> Self {
        Self {
            proxy_type: ProxyType::Sidecar,
            domain: String::new(),
            mesh_config: PathBuf::from("./etc/istio/config/mesh"),
            sts_port: 0,
            token_manager_plugin: String::new(),
            service_cluster: "istio-proxy".to_owned(),
            proxy_log_level: "warning".to_owned(),
            proxy_component_log_level: String::new(),
            concurrency: 0,
            template_file: PathBuf::new(),
            outlier_log_path: String::new(),
            profiling: true,
            log_as_json: false,
        }
    }
}

/// Everything the agent needs to run, resolved and validated.
///
/// File paths are kept exactly as configured (usually cwd-relative, like
/// Istio). Contains no secret material: token and key files are only named.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Config {
    /// Proxy type from the command line.
    pub proxy_type: ProxyType,
    /// Effective DNS domain (`--domain`, or `${POD_NAMESPACE}.svc.cluster.local`).
    pub domain: String,
    /// The `proxy` flags as given.
    pub flags: ProxyFlags,
    /// Effective ProxyConfig after all layers and overrides.
    pub proxy_config: ProxyConfig,
    /// Pod annotations from the downward API file (empty if absent).
    pub pod_annotations: BTreeMap<String, String>,
    /// Pod labels from the downward API file `./etc/istio/pod/labels` (empty if absent).
    pub pod_labels: BTreeMap<String, String>,
    /// Pod identity.
    pub pod: PodConfig,
    /// Identity and CA client.
    pub identity: IdentityConfig,
    /// Cloud platform metadata.
    pub platform: PlatformConfig,
    /// xDS proxy.
    pub xds: XdsConfig,
    /// Bootstrap and node metadata.
    pub bootstrap: BootstrapConfig,
    /// Envoy lifecycle.
    pub lifecycle: LifecycleConfig,
    /// Status server and probes.
    pub status: StatusConfig,
    /// DNS proxy.
    pub dns: DnsConfig,
    /// Wasm fetching.
    pub wasm: WasmConfig,
    /// Proxyless gRPC.
    pub grpc: GrpcConfig,
    /// Non-fatal findings (already logged), e.g. unknown ProxyConfig fields.
    #[serde(skip)]
    pub warnings: Vec<String>,
}

/// Loads the agent configuration.
///
/// `base_dir` is used only to *read* files while loading (production passes
/// `.`; tests pass a temp dir); paths stored in the result stay as configured.
/// All bad values are reported together.
pub fn load(
    flags: &ProxyFlags,
    env: &dyn EnvSource,
    base_dir: &Path,
) -> Result<Config, ConfigError> {
    load_cataloging(flags, env, base_dir, None)
}

/// [`load`], and when `catalog` is given, every environment variable the load read, with
/// its type and default as the typed read states them (for `meshagent config-reference`).
pub(crate) fn load_cataloging(
    flags: &ProxyFlags,
    env: &dyn EnvSource,
    base_dir: &Path,
    catalog: Option<&mut BTreeMap<String, (String, String)>>,
) -> Result<Config, ConfigError> {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let mut layers = proxy_config::ProxyConfigLayers::default();
    let mut r = if catalog.is_some() {
        Reader::cataloging(env)
    } else {
        Reader::new(env)
    };

    let mut apply =
        |layers: &mut proxy_config::ProxyConfigLayers, origin: &str, layer: serde_json::Value| {
            let unknown = layers.apply(origin, layer, &mut errors);
            if !unknown.is_empty() {
                warnings.push(format!(
                    "ignoring unknown ProxyConfig fields in {origin}: {}",
                    unknown.join(", ")
                ));
            }
        };

    let mesh_origin = format!("{} (defaultConfig)", files::mesh_origin(&flags.mesh_config));
    let mesh = files::mesh_default_config(base_dir, &flags.mesh_config);
    let proxy_config_env = r
        .get("PROXY_CONFIG")
        .filter(|s| !s.trim().is_empty())
        .map(|text| files::yaml_to_json("PROXY_CONFIG", &text));
    let annotations = files::pod_annotations(base_dir);
    let annotation_origin = format!("annotation {ANNOTATION_PROXY_CONFIG}");

    let mut layer_errors = Vec::new();
    match mesh {
        Ok(Some(layer)) => apply(&mut layers, &mesh_origin, layer),
        Ok(None) => {}
        Err(e) => layer_errors.push(e),
    }
    match proxy_config_env {
        Some(Ok(layer)) => apply(&mut layers, "PROXY_CONFIG", layer),
        Some(Err(e)) => layer_errors.push(e),
        None => {}
    }
    let annotations = annotations.unwrap_or_else(|e| {
        layer_errors.push(e);
        BTreeMap::new()
    });
    if let Some(text) = annotations.get(ANNOTATION_PROXY_CONFIG) {
        match files::yaml_to_json(&annotation_origin, text) {
            Ok(layer) => apply(&mut layers, &annotation_origin, layer),
            Err(e) => layer_errors.push(e),
        }
    }
    let labels = files::pod_labels(base_dir).unwrap_or_else(|e| {
        layer_errors.push(e);
        BTreeMap::new()
    });
    errors.extend(layer_errors);
    let mut pc = layers.finish();

    let pod = PodConfig::from_env(&mut r);

    if pc.concurrency.is_none() && pod.cpu_limit != 0 {
        pc.concurrency = Some(pod.cpu_limit);
    }
    if flags.concurrency != 0 {
        warnings.push(format!(
            "legacy --concurrency={} flag detected; prefer to use ProxyConfig",
            flags.concurrency
        ));
        pc.concurrency = Some(flags.concurrency);
    }
    // serviceCluster and tracingServiceName share a proto oneof; the flag only
    // fills the serviceCluster arm.
    if pc.service_cluster.is_empty() && pc.tracing_service_name.is_none() {
        pc.service_cluster.clone_from(&flags.service_cluster);
    }
    if let Some(addr) = annotations.get(ANNOTATION_DISCOVERY_ADDRESS) {
        pc.discovery_address.clone_from(addr);
    }
    if let Some(port) = annotations.get(ANNOTATION_STATUS_PORT) {
        match port.parse::<u16>() {
            Ok(p) => pc.status_port = p,
            Err(_) => errors.push(ConfigError::InvalidAnnotation {
                name: ANNOTATION_STATUS_PORT.to_owned(),
                value: port.clone(),
                expected: "a port number between 0 and 65535".to_owned(),
            }),
        }
    }
    warnings.extend(envoy_log_level_warnings(flags));
    warnings.extend(deprecation_warnings(&r, &annotations, flags));
    if !flags.template_file.as_os_str().is_empty() && pc.custom_config_file.as_os_str().is_empty() {
        pc.proxy_bootstrap_template_path
            .clone_from(&flags.template_file);
    }
    validate(&pc, &mut errors);

    let domain = if flags.domain.is_empty() {
        format!("{}.svc.cluster.local", pod.namespace)
    } else {
        flags.domain.clone()
    };

    let identity = IdentityConfig::from_env(&mut r, &pc.discovery_address);
    let platform = PlatformConfig::from_env(&r);
    let xds = XdsConfig::from_env(&mut r);
    let bootstrap = BootstrapConfig::from_env(&mut r);
    let lifecycle = LifecycleConfig::from_env(&mut r);
    let status = StatusConfig::from_env(&mut r, pc.status_port);
    let dns = DnsConfig::from_env(&mut r, flags.proxy_type == ProxyType::Sidecar);
    let wasm = WasmConfig::from_env(&mut r);
    let grpc = GrpcConfig::from_env(&r);
    if let Some(c) = catalog {
        *c = r.take_catalog();
    }
    errors.extend(r.not_unicode_errors());
    errors.extend(r.errors);
    warnings.extend(r.warnings);

    if !errors.is_empty() {
        return Err(ConfigError::from_many(errors));
    }
    for w in &warnings {
        let _ = warn_once(w);
    }
    let config = Config {
        proxy_type: flags.proxy_type,
        domain,
        flags: flags.clone(),
        proxy_config: pc,
        pod_annotations: annotations,
        pod_labels: labels,
        pod,
        identity,
        platform,
        xds,
        bootstrap,
        lifecycle,
        status,
        dns,
        wasm,
        grpc,
        warnings,
    };
    Ok(config)
}

/// Every environment variable `proxy` reads (prefix families as `PREFIX*`), with its type
/// and default as the typed read states them: the configuration reference is generated from
/// this, so it lists what the code reads, not what a document remembers. Read from an empty
/// environment, where every variable is read (none depends on another's value).
pub fn env_catalog() -> BTreeMap<String, (String, String)> {
    let mut catalog = BTreeMap::new();
    // The start's own checks fail on an empty environment; the reads happened before them.
    let _ = load_cataloging(
        &ProxyFlags::default(),
        &MapEnv::default(),
        Path::new("/nonexistent/meshagent-config-reference"),
        Some(&mut catalog),
    );
    catalog
}

/// Envoy's log levels (`envoy --help`, `-l`), for `--proxyLogLevel` and
/// `--proxyComponentLogLevel`.
pub const ENVOY_LOG_LEVELS: &[&str] = &[
    "trace", "debug", "info", "warning", "warn", "error", "critical", "off",
];

/// Istio passes the levels to Envoy unchecked (pkg/envoy/proxy.go `splitComponentLog`), and
/// Envoy refuses to start on one it does not know: the start fails at the same point here
/// (Envoy's exit), after a warning that lists the levels.
fn envoy_log_level_warnings(flags: &ProxyFlags) -> Vec<String> {
    let mut out = Vec::new();
    for (flag, value) in [
        ("--proxyLogLevel", &flags.proxy_log_level),
        ("--proxyComponentLogLevel", &flags.proxy_component_log_level),
    ] {
        // The component flag is used only when --proxyLogLevel names no component.
        let unused = flag == "--proxyComponentLogLevel" && flags.proxy_log_level.contains(':');
        if value.is_empty() || unused {
            continue;
        }
        let bad: Vec<&str> = value
            .split(',')
            .filter_map(|item| {
                let level = match item.split(':').collect::<Vec<_>>().as_slice() {
                    [""] => return None,
                    [level] | [_, level] => *level,
                    // Istio drops these with its own warning (`splitComponentLog`).
                    _ => return None,
                };
                (!ENVOY_LOG_LEVELS.contains(&level)).then_some(level)
            })
            .collect();
        if !bad.is_empty() {
            out.push(format!(
                "{flag}={value}: {} not an Envoy log level (expected {}); Envoy will refuse to start",
                bad.iter()
                    .map(|b| format!("{b:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
                    + if bad.len() == 1 { " is" } else { " are" },
                ENVOY_LOG_LEVELS.join(", ")
            ));
        }
    }
    out
}

/// A subset of Istio's `ValidateMeshConfigProxyConfig`, on the merged result.
fn validate(pc: &ProxyConfig, errors: &mut Vec<ConfigError>) {
    let mut fail = |field: &'static str, value: String, expected: &'static str| {
        errors.push(ConfigError::Validation {
            field,
            value,
            expected,
        });
    };
    if pc.config_path.as_os_str().is_empty() {
        fail("configPath", String::new(), "a non-empty path");
    }
    if pc.binary_path.as_os_str().is_empty() {
        fail("binaryPath", String::new(), "a non-empty path");
    }
    if pc.drain_duration.get() < std::time::Duration::from_millis(1) {
        fail(
            "drainDuration",
            pc.drain_duration.to_string(),
            "a duration of at least 1ms",
        );
    }
    if !is_host_port(&pc.discovery_address) {
        fail(
            "discoveryAddress",
            pc.discovery_address.clone(),
            "host:port with a port between 1 and 65535",
        );
    }
    if pc.proxy_admin_port == 0 {
        fail(
            "proxyAdminPort",
            "0".to_owned(),
            "a port number between 1 and 65535",
        );
    }
}

fn is_host_port(addr: &str) -> bool {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return false;
    };
    !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
}

/// Values in `env` that are credentials by name: `CA_HEADER_*` and `XDS_HEADER_*` (the
/// config serializes them redacted; `meshagent debug bundle` also scrubs them from every file
/// it collects). Values shorter than 4 bytes are left out: scrubbing `"1"` everywhere would
/// mangle the bundle and protect nothing.
pub fn secret_env_values(env: &dyn EnvSource) -> Vec<String> {
    let r = Reader::new(env);
    let mut out: Vec<String> = ["CA_HEADER_", "XDS_HEADER_"]
        .iter()
        .flat_map(|p| r.prefixed(p).into_values())
        .filter(|v| v.len() >= 4)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Serializes a header map (`CA_HEADER_*`, `XDS_HEADER_*`) with its names and every value
/// replaced: the values are often credentials, and the config is logged at INFO
/// ("Effective config") and served on `/debug/config_dump`.
mod serde_redacted {
    use serde::Serializer;
    use std::collections::BTreeMap;

    pub(crate) const REDACTED: &str = "<redacted>";

    pub(crate) fn serialize<S: Serializer>(
        m: &BTreeMap<String, String>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(m.keys().map(|k| (k, REDACTED)))
    }
}

/// Serializes `std::time::Duration` the way Go prints durations (`24h0m0s`).
pub(crate) mod serde_duration {
    use serde::Serializer;
    use std::time::Duration;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&super::parse::go_duration_string(*d))
    }
}

/// Resolves ProxyConfig `statsdUdpAddress` to `ip:port` once at startup, as pilot-agent does
/// (pilot/cmd/pilot-agent/config/config.go `ConstructProxyConfig`, pilot/pkg/util/network
/// `ResolveAddr`): the first IPv4 address, else the last one; an address that does not resolve
/// is logged and dropped (no statsd sink; the proxy starts). Envoy's statsd sink needs an IP,
/// so a host name left in the bootstrap would be a rejected bootstrap. Done here rather than
/// in [`load`], which does no I/O beyond reading files.
pub fn resolve_statsd(pc: &mut ProxyConfig) {
    use std::net::ToSocketAddrs;
    if pc.statsd_udp_address.is_empty() {
        return;
    }
    let addr = pc.statsd_udp_address.clone();
    tracing::info!("Attempting to lookup address: {addr}");
    let resolved = addr.to_socket_addrs().ok().and_then(|addrs| {
        let mut chosen = None;
        for a in addrs {
            let ip = match a.ip() {
                std::net::IpAddr::V6(v6) => v6
                    .to_ipv4_mapped()
                    .map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4),
                v4 => v4,
            };
            chosen = Some(std::net::SocketAddr::new(ip, a.port()));
            if ip.is_ipv4() {
                break;
            }
        }
        chosen
    });
    match resolved {
        Some(a) => {
            tracing::info!("Addr resolved to: {a}");
            pc.statsd_udp_address = a.to_string();
        }
        None => {
            tracing::warn!("resolve StatsdUdpAddress failed: lookup failed for {addr}");
            pc.statsd_udp_address.clear();
        }
    }
}
