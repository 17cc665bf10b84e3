//! Typed environment settings, one struct per concern (Istio: `pilot/cmd/pilot-agent/options/*.go`).
//! Identity/CA settings live in `identity.rs`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use super::ConfigError;
use super::env::Reader;
use super::probers::{
    AppProber, PrometheusScrape, parse_app_probers, parse_prometheus_annotations,
};
use super::{serde_duration, serde_redacted};

const MIB: u64 = 1024 * 1024;

// === Pod ===

/// Pod identity from the downward API (Istio: `pilot/cmd/pilot-agent/options/options.go`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodConfig {
    /// `POD_NAME`: node ID and node meta `NAME`.
    pub name: String,
    /// `POD_NAMESPACE`: node ID, DNS domain, CSR SAN.
    pub namespace: String,
    /// `INSTANCE_IP`: pod IP, put first among the instance IPs.
    pub instance_ip: Option<IpAddr>,
    /// `SERVICE_ACCOUNT`: service account name.
    pub service_account: String,
    /// `HOST_IP`: substituted for `$(HOST_IP)` in tracer addresses and bootstrap overrides.
    pub host_ip: String,
    /// `ISTIO_CPU_LIMIT` (default 0): Envoy concurrency when ProxyConfig leaves it unset.
    pub cpu_limit: u32,
    /// `KUBERNETES_SERVICE_HOST`: when set, exported certs are world-readable (0644).
    pub kubernetes_service_host: String,
}

impl PodConfig {
    pub(crate) fn from_env(r: &mut Reader<'_>) -> Self {
        Self {
            name: r.string("POD_NAME", ""),
            namespace: r.string("POD_NAMESPACE", ""),
            instance_ip: r.validated(
                "INSTANCE_IP",
                None,
                "unset",
                "an IPv4 or IPv6 address",
                |s| s.parse().ok().map(Some),
            ),
            service_account: r.string("SERVICE_ACCOUNT", ""),
            host_ip: r.string("HOST_IP", ""),
            cpu_limit: r.int("ISTIO_CPU_LIMIT", 0, 0, u32::MAX),
            kubernetes_service_host: r.string("KUBERNETES_SERVICE_HOST", ""),
        }
    }
}

// === xDS ===

/// Upstream (istiod) and downstream (Envoy UDS) xDS settings (Istio: `pkg/istio-agent/xds_proxy.go`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct XdsConfig {
    /// `XDS_ROOT_CA`: root for istiod TLS; `SYSTEM` means OS roots.
    pub root_ca: String,
    /// `XDS_HEADER_<NAME>`: extra gRPC metadata on upstream ADS streams (values redacted
    /// when serialized).
    #[serde(with = "serde_redacted")]
    pub headers: BTreeMap<String, String>,
    /// `PROXY_CONFIG_XDS_AGENT` (default false): subscribe to ProxyConfig (PCDS).
    pub proxy_config_xds_agent: bool,
    /// `ISTIO_DELTA_XDS` (default true): bootstrap ADS uses `DELTA_GRPC`.
    pub delta_xds: bool,
    /// `GRPC_KEEPALIVE_INTERVAL` (default 30s).
    #[serde(with = "serde_duration")]
    pub keepalive_interval: Duration,
    /// `GRPC_KEEPALIVE_TIMEOUT` (default 10s).
    #[serde(with = "serde_duration")]
    pub keepalive_timeout: Duration,
    /// `ISTIO_GPRC_MAXSTREAMS` (sic, default 100000): downstream max concurrent streams.
    pub max_streams: u32,
    /// `ISTIO_GPRC_MAXRECVMSGSIZE` (sic, default 4 MiB): downstream max message size.
    pub max_recv_msg_size: u32,
    /// `COMPLIANCE_POLICY`: e.g. `fips-140-2`/`fips-140-3` restrict TLS.
    pub compliance_policy: String,
}

impl XdsConfig {
    pub(crate) fn from_env(r: &mut Reader<'_>) -> Self {
        Self {
            root_ca: r.string("XDS_ROOT_CA", ""),
            headers: r.prefixed("XDS_HEADER_"),
            proxy_config_xds_agent: r.bool("PROXY_CONFIG_XDS_AGENT", false),
            delta_xds: r.bool("ISTIO_DELTA_XDS", true),
            keepalive_interval: r.duration("GRPC_KEEPALIVE_INTERVAL", Duration::from_secs(30)),
            keepalive_timeout: r.duration("GRPC_KEEPALIVE_TIMEOUT", Duration::from_secs(10)),
            max_streams: r.int("ISTIO_GPRC_MAXSTREAMS", 100_000, 1, u32::MAX),
            max_recv_msg_size: r.int("ISTIO_GPRC_MAXRECVMSGSIZE", 4 * 1024 * 1024, 1, u32::MAX),
            compliance_policy: r.string("COMPLIANCE_POLICY", ""),
        }
    }
}

// === Bootstrap ===

/// Bootstrap generation and node metadata (Istio: `pkg/bootstrap/config.go`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapConfig {
    /// `ISTIO_META_<KEY>`: node metadata `KEY` = value.
    pub node_meta: BTreeMap<String, String>,
    /// `ISTIO_METAJSON_<KEY>`: raw JSON objects merged at the top of node metadata.
    pub node_meta_json: BTreeMap<String, String>,
    /// `ISTIO_BOOTSTRAP`: bootstrap template path override.
    pub template_override: Option<PathBuf>,
    /// `ISTIO_BOOTSTRAP_OVERRIDE`: file passed to Envoy as `--config-yaml`.
    pub bootstrap_override: Option<PathBuf>,
    /// `ISTIO_META_ENABLE_SELF_DISCOVERY` (default false): add a `local_cluster`.
    pub enable_self_discovery: bool,
    /// `PEER_METADATA_DISCOVERY`: unset means "same as `ENABLE_HBONE`".
    pub peer_metadata_discovery: Option<bool>,
    /// `ENVOY_STATUS_PORT` (default 15021): Envoy health listener.
    pub envoy_status_port: u16,
    /// `ENVOY_PROMETHEUS_PORT` (default 15090): Envoy Prometheus listener.
    pub envoy_prometheus_port: u16,
    /// `ENVOY_SECURE_METRICS_PORT` (default 0 = off): mTLS listener for Envoy stats.
    pub envoy_secure_metrics_port: u16,
    /// `ENVOY_SECURE_MERGED_METRICS_PORT` (default 0 = off): mTLS listener for merged metrics.
    pub envoy_secure_merged_metrics_port: u16,
    /// `ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL` (default false).
    pub envoy_status_port_enable_proxy_protocol: bool,
    /// `ISTIO_DUAL_STACK` (default false).
    pub dual_stack: bool,
    /// `HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED` (default true).
    pub http_strip_fragment_from_path: bool,
    /// `ENVOY_SKIP_DEPRECATED_LOGS` (default true).
    pub envoy_skip_deprecated_logs: bool,
    /// `ISTIO_ENVOY_ENABLE_CORE_DUMP` (default false).
    pub envoy_enable_core_dump: bool,
    /// `ISTIO_META_ISTIO_PROXY_SHA`: set in the image.
    pub istio_proxy_sha: String,
}

impl BootstrapConfig {
    pub(crate) fn from_env(r: &mut Reader<'_>) -> Self {
        let node_meta_json = r.prefixed("ISTIO_METAJSON_");
        for (key, raw) in &node_meta_json {
            let ok = serde_json::from_str::<Value>(raw).is_ok_and(|v| v.is_object());
            if !ok {
                r.invalid(&format!("ISTIO_METAJSON_{key}"), raw, "a JSON object");
            }
        }
        Self {
            node_meta: r.prefixed("ISTIO_META_"),
            node_meta_json,
            template_override: r.non_empty("ISTIO_BOOTSTRAP").map(PathBuf::from),
            bootstrap_override: r.non_empty("ISTIO_BOOTSTRAP_OVERRIDE").map(PathBuf::from),
            enable_self_discovery: r.meta_bool("ISTIO_META_ENABLE_SELF_DISCOVERY"),
            peer_metadata_discovery: r.opt_bool("PEER_METADATA_DISCOVERY"),
            envoy_status_port: r.port("ENVOY_STATUS_PORT", 15021),
            envoy_prometheus_port: r.port("ENVOY_PROMETHEUS_PORT", 15090),
            envoy_secure_metrics_port: r.port("ENVOY_SECURE_METRICS_PORT", 0),
            envoy_secure_merged_metrics_port: r.port("ENVOY_SECURE_MERGED_METRICS_PORT", 0),
            envoy_status_port_enable_proxy_protocol: r
                .bool("ENVOY_STATUS_PORT_ENABLE_PROXY_PROTOCOL", false),
            dual_stack: r.bool("ISTIO_DUAL_STACK", false),
            http_strip_fragment_from_path: r
                .bool("HTTP_STRIP_FRAGMENT_FROM_PATH_UNSAFE_IF_DISABLED", true),
            envoy_skip_deprecated_logs: r.bool("ENVOY_SKIP_DEPRECATED_LOGS", true),
            envoy_enable_core_dump: r.bool("ISTIO_ENVOY_ENABLE_CORE_DUMP", false),
            istio_proxy_sha: r.string("ISTIO_META_ISTIO_PROXY_SHA", ""),
        }
    }
}

// === Lifecycle ===

/// Envoy lifecycle and drain (Istio: `pkg/envoy/agent.go`; the two ProxyConfig durations live in `ProxyConfig`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LifecycleConfig {
    /// `MINIMUM_DRAIN_DURATION` (default 5s): wait before polling connections.
    #[serde(with = "serde_duration")]
    pub minimum_drain_duration: Duration,
    /// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS` (default false).
    pub exit_on_zero_active_connections: bool,
    /// `DISABLE_ENVOY` (default false): proxyless mode.
    pub disable_envoy: bool,
    /// `MESHAGENT_DRAIN_START_DELAY` (default 0s, Istio's behaviour; at most 1h): on
    /// SIGTERM readiness fails at once and Envoy's listeners are drained only after this
    /// delay, so endpoints are withdrawn before connections are closed. Not in Istio.
    #[serde(with = "serde_duration")]
    pub drain_start_delay: Duration,
}

impl LifecycleConfig {
    pub(crate) fn from_env(r: &mut Reader<'_>) -> Self {
        Self {
            minimum_drain_duration: r.duration("MINIMUM_DRAIN_DURATION", Duration::from_secs(5)),
            exit_on_zero_active_connections: r.bool("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", false),
            disable_envoy: r.bool("DISABLE_ENVOY", false),
            drain_start_delay: drain_start_delay(r),
        }
    }
}

/// Longest `MESHAGENT_DRAIN_START_DELAY`: a pod's termination grace period is rarely longer.
const MAX_DRAIN_START_DELAY: Duration = Duration::from_secs(3600);

/// `MESHAGENT_DRAIN_START_DELAY`: meshagent's own variable, so a bad value is an error (the
/// agent refuses to start) rather than Istio's warn-and-default.
fn drain_start_delay(r: &mut Reader<'_>) -> Duration {
    r.validated(
        "MESHAGENT_DRAIN_START_DELAY",
        Duration::ZERO,
        "0s",
        "a duration between 0s and 1h, e.g. 5s or 1500ms",
        |s| super::parse::parse_go_duration(s).filter(|d| *d <= MAX_DRAIN_START_DELAY),
    )
}

// === Status ===

/// Status server, probes and metrics merge (Istio: `pilot/cmd/pilot-agent/options/statusserver.go`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusConfig {
    /// `ISTIO_KUBE_APP_PROBERS`: path → prober, validated (empty when unset).
    pub kube_app_probers: BTreeMap<String, AppProber>,
    /// `ISTIO_PROMETHEUS_ANNOTATIONS`: app metrics targets to merge, validated.
    pub prometheus_annotations: Option<PrometheusScrape>,
    /// `ISTIO_ENABLE_HTTP2_PROBING` (default true).
    pub enable_http2_probing: bool,
    /// `REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION` (default false).
    pub rewrite_probe_legacy_localhost_destination: bool,
    /// `ENABLE_PROBE_KEEPALIVE_CONNECTIONS` (default false).
    pub enable_probe_keepalive_connections: bool,
    /// `PILOT_AGENT_MERGE_ENVOY_STATS` (default true).
    pub merge_envoy_stats: bool,
    /// `METRICS_LOCALHOST_ACCESS_ONLY` (default false): metrics only from loopback.
    pub metrics_localhost_access_only: bool,
    /// `MESHAGENT_PROFILING` (default false): serve CPU profiles on `/debug/pprof/profile`
    /// (with `--profiling`, which alone serves only `/debug/tokioz`).
    pub profiling: bool,
}

impl StatusConfig {
    pub(crate) fn from_env(r: &mut Reader<'_>, status_port: u16) -> Self {
        // Istio exits when these do not validate; the error names the variable and the key.
        let fail = |r: &mut Reader<'_>, name: &str, reason: String| {
            r.errors.push(ConfigError::Parse {
                origin: name.to_owned(),
                reason,
            })
        };
        let kube_app_probers = match r.non_empty("ISTIO_KUBE_APP_PROBERS") {
            None => BTreeMap::new(),
            Some(raw) => parse_app_probers(&raw).unwrap_or_else(|e| {
                fail(r, "ISTIO_KUBE_APP_PROBERS", e);
                BTreeMap::new()
            }),
        };
        let prometheus_annotations = match r.non_empty("ISTIO_PROMETHEUS_ANNOTATIONS") {
            None => None,
            Some(raw) => match parse_prometheus_annotations(&raw, status_port) {
                Ok(p) => Some(p),
                Err(e) => {
                    fail(r, "ISTIO_PROMETHEUS_ANNOTATIONS", e);
                    None
                }
            },
        };
        Self {
            kube_app_probers,
            prometheus_annotations,
            enable_http2_probing: r.bool("ISTIO_ENABLE_HTTP2_PROBING", true),
            rewrite_probe_legacy_localhost_destination: r
                .bool("REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION", false),
            enable_probe_keepalive_connections: r.bool("ENABLE_PROBE_KEEPALIVE_CONNECTIONS", false),
            merge_envoy_stats: r.bool("PILOT_AGENT_MERGE_ENVOY_STATS", true),
            metrics_localhost_access_only: r.bool("METRICS_LOCALHOST_ACCESS_ONLY", false),
            profiling: r.bool("MESHAGENT_PROFILING", false),
        }
    }
}

// === DNS ===

/// DNS proxy (Istio: `pkg/dns/client/dns.go`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DnsConfig {
    /// `ISTIO_META_DNS_CAPTURE` (default false): start the DNS proxy (sidecars).
    pub capture: bool,
    /// `ISTIO_META_ENABLE_DNS_SERVER` (default false): start it for any proxy type.
    pub enable_server: bool,
    /// `DNS_PROXY_ADDR` (default `localhost:15053`): listen address.
    pub proxy_addr: String,
    /// Whether `DNS_PROXY_ADDR` was set (then it is also copied into node metadata).
    pub proxy_addr_set: bool,
    /// `DNS_FORWARD_PARALLEL` (default false): query all upstreams at once.
    pub forward_parallel: bool,
    /// `DNS_FORWARD_TIMEOUT` (default 5s).
    #[serde(with = "serde_duration")]
    pub forward_timeout: Duration,
    /// `ISTIO_META_DNS_AUTO_ALLOCATE` (default false): istiod-side; read for metadata.
    pub auto_allocate: bool,
    /// Where upstream servers and the search list come from: `/etc/resolv.conf` (Istio reads
    /// that path only; in `:53` root mode `/var/lib/istio/resolv.conf` wins when present). Not
    /// an environment variable: a field so tests can point it at their own file.
    pub resolv_conf: std::path::PathBuf,
    /// `MESHAGENT_DNS_CACHE_SIZE` (default 4096, 0 turns it off): entries in the cache of
    /// forwarded answers. Istio has no cache (istio#58806); this is meshagent's own knob.
    pub cache_size: usize,
    /// `MESHAGENT_DNS_CACHE_BYTES` (default 4 MiB, 0 turns the cache off): the cache's byte
    /// budget; answers over 16 KiB are not cached.
    pub cache_bytes: usize,
    /// `MESHAGENT_DNS_ALLOW_NON_LOOPBACK` (default false): let `DNS_PROXY_ADDR` be an
    /// address that is not loopback (the proxy then answers, and amplifies, for anyone).
    pub allow_non_loopback: bool,
}

impl DnsConfig {
    /// `sidecar`: whether the proxy type is a sidecar (DNS capture only starts the DNS
    /// proxy there).
    pub(crate) fn from_env(r: &mut Reader<'_>, sidecar: bool) -> Self {
        let capture = r.meta_bool("ISTIO_META_DNS_CAPTURE");
        let enable_server = r.bool("ISTIO_META_ENABLE_DNS_SERVER", false);
        // "" falls back to the default (Istio pkg/dns/server `NewLocalDNSServer`).
        let set = r.non_empty("DNS_PROXY_ADDR");
        let proxy_addr = set.clone().unwrap_or_else(|| "localhost:15053".to_owned());
        // The DNS proxy's listen address: Go's net.SplitHostPort rules, a numeric port. Only
        // a DNS proxy that starts can fail on it.
        if ((capture && sidecar) || enable_server) && !is_listen_addr(&proxy_addr) {
            r.invalid(
                "DNS_PROXY_ADDR",
                &proxy_addr,
                "host:port with a port number 0-65535, e.g. localhost:15053",
            );
        }
        Self {
            capture,
            enable_server,
            proxy_addr,
            proxy_addr_set: set.is_some(),
            forward_parallel: r.bool("DNS_FORWARD_PARALLEL", false),
            forward_timeout: r.duration("DNS_FORWARD_TIMEOUT", Duration::from_secs(5)),
            auto_allocate: r.meta_bool("ISTIO_META_DNS_AUTO_ALLOCATE"),
            resolv_conf: std::path::PathBuf::from("/etc/resolv.conf"),
            cache_size: r.int("MESHAGENT_DNS_CACHE_SIZE", 4096, 0, 1 << 20),
            cache_bytes: r.int("MESHAGENT_DNS_CACHE_BYTES", 4 << 20, 0, 1 << 30),
            allow_non_loopback: r.bool("MESHAGENT_DNS_ALLOW_NON_LOOPBACK", false),
        }
    }
}

// === Wasm ===

/// Wasm module fetching (Istio: `pkg/wasm/options.go`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WasmConfig {
    /// `WASM_INSECURE_REGISTRIES`: hosts allowed over plain HTTP/unverified TLS; `*` = all.
    pub insecure_registries: Vec<String>,
    /// `WASM_MODULE_EXPIRY` (default 24h).
    #[serde(with = "serde_duration")]
    pub module_expiry: Duration,
    /// `WASM_PURGE_INTERVAL` (default 1h).
    #[serde(with = "serde_duration")]
    pub purge_interval: Duration,
    /// `WASM_HTTP_REQUEST_TIMEOUT` (default 15s).
    #[serde(with = "serde_duration")]
    pub http_request_timeout: Duration,
    /// `WASM_HTTP_REQUEST_MAX_RETRIES` (default 5).
    pub http_request_max_retries: u32,
    /// `ISTIO_WASM_MAX_BINARY_SIZE_BYTES` (default 256 MiB).
    pub max_binary_size_bytes: u64,
    /// `BLOCKED_CIDRS_IN_WASM_FETCH`: extra CIDRs refused when fetching.
    pub blocked_cidrs: Vec<String>,
    /// `ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION` (default true): localise remote Wasm in ECDS.
    pub remote_load_conversion: bool,
    /// The docker config keychain for OCI pulls without a pull secret
    /// (go-containerregistry `authn.DefaultKeychain`): `$DOCKER_CONFIG/config.json`, else
    /// `$HOME/.docker/config.json`.
    pub docker_config: Option<std::path::PathBuf>,
}

impl WasmConfig {
    pub(crate) fn from_env(r: &mut Reader<'_>) -> Self {
        let blocked_cidrs = r.list("BLOCKED_CIDRS_IN_WASM_FETCH", &[]);
        for cidr in &blocked_cidrs {
            if !is_cidr(cidr) {
                r.invalid(
                    "BLOCKED_CIDRS_IN_WASM_FETCH",
                    cidr,
                    "a comma-separated list of CIDRs such as 10.0.0.0/8",
                );
            }
        }
        Self {
            insecure_registries: r.list("WASM_INSECURE_REGISTRIES", &[]),
            module_expiry: r.duration("WASM_MODULE_EXPIRY", Duration::from_secs(24 * 3600)),
            purge_interval: r.duration("WASM_PURGE_INTERVAL", Duration::from_secs(3600)),
            http_request_timeout: r.duration("WASM_HTTP_REQUEST_TIMEOUT", Duration::from_secs(15)),
            http_request_max_retries: r.int("WASM_HTTP_REQUEST_MAX_RETRIES", 5, 0, u32::MAX),
            max_binary_size_bytes: r.int(
                "ISTIO_WASM_MAX_BINARY_SIZE_BYTES",
                256 * MIB,
                1,
                u64::MAX,
            ),
            blocked_cidrs,
            remote_load_conversion: r.bool("ISTIO_AGENT_ENABLE_WASM_REMOTE_LOAD_CONVERSION", true),
            docker_config: match r.string("DOCKER_CONFIG", "") {
                d if !d.is_empty() => Some(std::path::PathBuf::from(d).join("config.json")),
                _ => match r.string("HOME", "") {
                    h if !h.is_empty() => {
                        Some(std::path::PathBuf::from(h).join(".docker/config.json"))
                    }
                    _ => None,
                },
            },
        }
    }
}

/// `host:port` as Go's `net.SplitHostPort` splits it (IPv6 hosts in brackets; the host may
/// be empty), with a numeric port.
fn is_listen_addr(s: &str) -> bool {
    let (host, port) = match s.strip_prefix('[') {
        Some(rest) => match rest.split_once("]:") {
            Some((h, p)) => (h, p),
            None => return false,
        },
        None => match s.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, p),
            _ => return false,
        },
    };
    !host.contains(['[', ']']) && !port.is_empty() && port.parse::<u16>().is_ok()
}

fn is_cidr(s: &str) -> bool {
    let Some((ip, bits)) = s.split_once('/') else {
        return false;
    };
    let max = match ip.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => 32,
        Ok(IpAddr::V6(_)) => 128,
        Err(_) => return false,
    };
    bits.parse::<u8>().is_ok_and(|b| b <= max)
}

// === Proxyless gRPC ===

/// Proxyless gRPC (Istio: `pkg/istio-agent/grpcxds/grpc_bootstrap.go`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GrpcConfig {
    /// `GRPC_XDS_BOOTSTRAP` (default `./etc/istio/proxy/grpc-bootstrap.json`): where the
    /// gRPC xDS bootstrap is written. Set but empty, it is empty: no gRPC bootstrap and no
    /// gRPC bootstrap readiness check (Istio `pkg/istio-agent/agent.go`:
    /// `if a.cfg.GRPCBootstrapPath != ""`).
    pub xds_bootstrap: PathBuf,
    /// `ISTIO_META_GENERATOR`: `grpc` for the grpc-agent template.
    pub generator: String,
}

impl GrpcConfig {
    pub(crate) fn from_env(r: &Reader<'_>) -> Self {
        Self {
            xds_bootstrap: PathBuf::from(r.string(
                "GRPC_XDS_BOOTSTRAP",
                "./etc/istio/proxy/grpc-bootstrap.json",
            )),
            generator: r.string("ISTIO_META_GENERATOR", ""),
        }
    }
}
