//! Whether Envoy has the extensions istiod configures by default, and saying so when it
//! rejects istiod's configuration for lack of them.
//!
//! istiod emits, with its defaults, filters that only Istio's Envoy build (the `proxyv2`
//! image) implements; an upstream Envoy rejects every listener and cluster that carries one
//! and never becomes ready. Once Envoy's admin answers, its `/server_info`
//! (`node.extensions`: name, category, type URLs) is read once, with a deadline, off every
//! hot path, and compared with [`ISTIO_EXTENSIONS`]. A build without them is not an error in
//! itself (istiod can be configured not to emit them): that is logged at INFO. When Envoy
//! then NACKs a resource naming a missing extension ([`crate::xds::rejections`]), one ERROR
//! line names the missing extensions and what to do; readiness names the NACK as long as it
//! stands (`status/ready.rs`).
//!
//! Istio's agent checks nothing of the kind.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::xds::rejections::MissingExtension;

/// An extension istiod emits by default that only Istio's Envoy build implements.
#[derive(Debug)]
pub struct IstioExtension {
    /// The name istiod gives the filter.
    pub name: &'static str,
    /// The type URL of its configuration (inside a `TypedStruct` where istiod sends one),
    /// which is what Envoy looks its implementation up by.
    pub type_url: &'static str,
    /// Where istiod puts it.
    pub used_for: &'static str,
    /// The istiod setting that leaves it out.
    pub avoided_by: &'static str,
}

/// The Istio-only extensions in istiod's default sidecar configuration, each checked against
/// upstream Envoy 1.40's `/server_info` (none of these type URLs is registered there; the
/// Wasm filter `envoy.filters.http.wasm` and `envoy.tls.cert_validator.spiffe` are).
pub const ISTIO_EXTENSIONS: &[IstioExtension] = &[
    // pilot/pkg/xds/filters/filters.go (MxFilterName, MetadataExchangeTypeURL), added by
    // pilot/pkg/networking/core/cluster_builder.go and networkfilter.go when
    // features.MetadataExchange (pilot/pkg/features/telemetry.go).
    IstioExtension {
        name: "istio.metadata_exchange",
        type_url: "envoy.tcp.metadataexchange.config.MetadataExchange",
        used_for: "TCP metadata exchange on inbound listeners and outbound clusters",
        avoided_by: "PILOT_ENABLE_METADATA_EXCHANGE=false",
    },
    // pilot/pkg/xds/filters/filters.go (PeerMetadataTypeURL: the HTTP filters named
    // istio.metadata_exchange), added by pilot/pkg/networking/core/listener_builder.go.
    IstioExtension {
        name: "istio.metadata_exchange",
        type_url: "io.istio.http.peer_metadata.Config",
        used_for: "HTTP peer metadata on inbound and outbound HTTP connection managers",
        avoided_by: "PILOT_ENABLE_METADATA_EXCHANGE=false",
    },
    // pilot/pkg/xds/filters/filters.go (AlpnFilterName, istio.io/api
    // envoy/config/filter/http/alpn/v2alpha1), added by listener_builder.go when
    // features.ALPNFilter (pilot/pkg/features/pilot.go).
    IstioExtension {
        name: "istio.alpn",
        type_url: "istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig",
        used_for: "ALPN override on outbound HTTP connection managers",
        avoided_by: "PILOT_ENABLE_ALPN_FILTER=false",
    },
    // pkg/config/xds/filters.go (StatsFilterName), pilot/pkg/model/telemetry.go
    // (buildHTTPTelemetryFilter, buildTCPTelemetryFilter: istio.io/api envoy/extensions/stats)
    // for a Prometheus metrics provider, which an installed istiod has by default.
    IstioExtension {
        name: "istio.stats",
        type_url: "stats.PluginConfig",
        used_for: "Istio's standard metrics (HTTP and TCP filters)",
        avoided_by: "no Prometheus provider in meshConfig.defaultProviders.metrics, and no \
                     Telemetry resource selecting one",
    },
];

/// What to do, for the log line and the docs.
pub const REMEDY: &str = "run Istio's Envoy build (the istio/proxyv2 image; \
     deploy/Dockerfile.proxyv2 layers the agent onto it), or configure istiod not to emit them";

/// How long Envoy's admin may take to answer `/server_info` after Envoy starts.
pub const DEADLINE: Duration = Duration::from_secs(60);
/// Each attempt's timeout, and the pause between attempts.
const ATTEMPT: Duration = Duration::from_secs(1);
const RETRY: Duration = Duration::from_millis(250);

/// The result of reading `/server_info`.
#[derive(Debug, Clone)]
pub struct ExtensionReport {
    /// Envoy's version string (`node.user_agent_build_version.version`, `major.minor.patch`).
    pub envoy_version: String,
    /// Extensions Envoy registers.
    pub registered: usize,
    /// Entries of [`ISTIO_EXTENSIONS`] it lacks.
    pub missing: Vec<&'static IstioExtension>,
}

/// The parts of `/server_info` the check reads, borrowed from the body. Deserialized into
/// these types, serde skips everything else without building it: Envoy 1.40's body is 124 KB
/// (516 extensions), and as a `serde_json::Value` tree it was ~0.45 MiB of heap for a
/// millisecond, the agent's resident peak (`VmHWM`) when Envoy's admin first answers
/// (docs/benchmarks-log.md, "The sidecar's own phases").
#[derive(Deserialize)]
struct ServerInfo<'a> {
    #[serde(borrow)]
    node: Option<NodeInfo<'a>>,
}

#[derive(Deserialize)]
struct NodeInfo<'a> {
    #[serde(borrow)]
    extensions: Option<Vec<Extension<'a>>>,
    user_agent_build_version: Option<BuildVersion>,
}

#[derive(Deserialize)]
struct Extension<'a> {
    #[serde(default)]
    disabled: bool,
    #[serde(borrow, default)]
    type_urls: Vec<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct BuildVersion {
    version: Option<Version>,
}

#[derive(Deserialize)]
struct Version {
    #[serde(default)]
    major_number: u64,
    #[serde(default)]
    minor_number: u64,
    #[serde(default)]
    patch: u64,
}

impl ExtensionReport {
    /// From `/server_info`'s JSON body; `None` if it is not JSON of that shape or has no
    /// extension list.
    pub fn from_server_info(body: &[u8]) -> Option<ExtensionReport> {
        let node = serde_json::from_slice::<ServerInfo<'_>>(body).ok()?.node?;
        let exts = node.extensions?;
        let registered = |url: &str| {
            exts.iter()
                .any(|e| !e.disabled && e.type_urls.iter().any(|t| t == url))
        };
        let missing = ISTIO_EXTENSIONS
            .iter()
            .filter(|x| !registered(x.type_url))
            .collect();
        let envoy_version = node
            .user_agent_build_version
            .and_then(|b| b.version)
            .map(|v| format!("{}.{}.{}", v.major_number, v.minor_number, v.patch))
            .unwrap_or_default();
        Some(ExtensionReport {
            envoy_version,
            registered: exts.len(),
            missing,
        })
    }

    pub fn to_json(&self) -> Value {
        json!({
            "envoyVersion": self.envoy_version,
            "registered": self.registered,
            "missingIstioExtensions": self.missing.iter().map(|x| json!({
                "name": x.name,
                "typeUrl": x.type_url,
                "usedFor": x.used_for,
                "avoidedBy": x.avoided_by,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Reads `/server_info` until it answers or [`DEADLINE`] passes.
pub async fn read(admin: SocketAddr, stop: &CancellationToken) -> Option<ExtensionReport> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        match super::admin::get_bytes(admin, "/server_info", ATTEMPT).await {
            Ok((200, body)) => {
                return match ExtensionReport::from_server_info(&body) {
                    Some(r) => Some(r),
                    None => {
                        tracing::debug!("Envoy's /server_info lists no extensions");
                        None
                    }
                };
            }
            Ok((code, _)) => tracing::debug!(code, "Envoy's /server_info not answered yet"),
            Err(e) => tracing::debug!(error = %e, "Envoy's /server_info not answered yet"),
        }
        if tokio::time::Instant::now() + RETRY >= deadline {
            tracing::debug!(deadline = %crate::logging::dur(DEADLINE), "Envoy's /server_info did not answer; its extensions are not checked");
            return None;
        }
        tokio::select! {
            () = stop.cancelled() => return None,
            () = tokio::time::sleep(RETRY) => {}
        }
    }
}

/// The check, run once per agent: reads the extension list into `report`, then logs the one
/// ERROR when a NACK names a missing extension. Ends at `stop` or after that line.
pub async fn check(
    admin: SocketAddr,
    report: Arc<OnceLock<ExtensionReport>>,
    mut nacked: watch::Receiver<Vec<MissingExtension>>,
    stop: CancellationToken,
) {
    if let Some(r) = read(admin, &stop).await {
        if !r.missing.is_empty() {
            tracing::info!(envoy = %r.envoy_version, missing = %names(&r.missing), "this Envoy build lacks Istio's extensions: istiod must be configured not to emit them, or Envoy will reject its configuration");
        }
        let _ = report.set(r);
    }
    let named = tokio::select! {
        () = stop.cancelled() => return,
        n = nacked.wait_for(|m| !m.is_empty()) => match n {
            Ok(n) => n.clone(),
            Err(_) => return,
        },
    };
    tracing::error!("{}", error_line(report.get(), &named));
}

fn names(missing: &[&IstioExtension]) -> String {
    missing
        .iter()
        .map(|x| format!("{} ({})", x.name, x.type_url))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The ERROR line: what Envoy rejected for lack of which extension, all of Istio's that it
/// lacks, and what to do.
pub fn error_line(report: Option<&ExtensionReport>, named: &[MissingExtension]) -> String {
    let rejected = named
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let mut line =
        format!("Envoy rejects istiod's configuration: it has no implementation of {rejected}. ");
    // The full list from /server_info when it was read; otherwise Istio's entries the NACKs
    // named.
    let lacking: Vec<&IstioExtension> = match report {
        Some(r) => r.missing.clone(),
        None => ISTIO_EXTENSIONS
            .iter()
            .filter(|x| named.iter().any(|m| m.type_url == x.type_url))
            .collect(),
    };
    if !lacking.is_empty() {
        let version = report
            .map(|r| format!(" {}", r.envoy_version))
            .unwrap_or_default();
        line.push_str(&format!(
            "This Envoy{version} lacks Istio's extensions {}, which istiod emits by default. ",
            names(&lacking)
        ));
    }
    if lacking.is_empty() && report.is_some() {
        // Istio's build (or one with its extensions): something else names the extension.
        line.push_str(
            "This Envoy has Istio's extensions; the configuration names one it does not have \
             (an EnvoyFilter, for instance).",
        );
        return line;
    }
    let mut settings: Vec<&str> = lacking.iter().map(|x| x.avoided_by).collect();
    settings.dedup();
    line.push_str(&format!("To fix: {REMEDY}"));
    if settings.is_empty() {
        line.push('.');
    } else {
        line.push_str(&format!(" ({}).", settings.join("; ")));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_info(type_urls: &[&str]) -> Vec<u8> {
        serde_json::to_vec(&json!({"node": {
            "user_agent_build_version": {"version": {"major_number": 1, "minor_number": 40, "patch": 0}},
            "extensions": type_urls.iter().map(|t| json!({
                "name": format!("x.{t}"), "category": "envoy.filters.http", "type_urls": [t]
            })).collect::<Vec<_>>(),
        }}))
        .unwrap()
    }

    #[test]
    fn reports_the_istio_extensions_envoy_lacks() {
        let upstream = server_info(&["envoy.extensions.filters.http.wasm.v3.Wasm"]);
        let r = ExtensionReport::from_server_info(&upstream).unwrap();
        assert_eq!(r.envoy_version, "1.40.0");
        assert_eq!(r.missing.len(), ISTIO_EXTENSIONS.len());
        let istio: Vec<&str> = ISTIO_EXTENSIONS.iter().map(|x| x.type_url).collect();
        let r = ExtensionReport::from_server_info(&server_info(&istio)).unwrap();
        assert!(r.missing.is_empty());
        assert!(ExtensionReport::from_server_info(br#"{"node": {}}"#).is_none());
        assert!(ExtensionReport::from_server_info(br#""x""#).is_none());
        assert!(ExtensionReport::from_server_info(b"{").is_none());
        // A disabled extension does not count; escapes in a type URL are decoded.
        let r = ExtensionReport::from_server_info(
            br#"{"node": {"extensions": [
                {"name": "a", "type_urls": ["envoy.tcp.metadataexchange.config.MetadataExchange"], "disabled": true},
                {"name": "b", "type_urls": ["io.istio.http.peer_metadata\u002eConfig"], "extra": {"x": [1]}}
            ], "other": null}, "command_line_options": {}}"#,
        )
        .unwrap();
        assert_eq!(r.registered, 2);
        assert_eq!(r.envoy_version, "");
        let missing: Vec<&str> = r.missing.iter().map(|x| x.type_url).collect();
        assert!(missing.contains(&"envoy.tcp.metadataexchange.config.MetadataExchange"));
        assert!(!missing.contains(&"io.istio.http.peer_metadata.Config"));
    }

    #[test]
    fn error_line_names_extensions_and_the_fix() {
        let named = vec![MissingExtension {
            name: "istio.metadata_exchange".into(),
            type_url: "envoy.tcp.metadataexchange.config.MetadataExchange".into(),
        }];
        let upstream = server_info(&[]);
        let r = ExtensionReport::from_server_info(&upstream).unwrap();
        let line = error_line(Some(&r), &named);
        for want in [
            "'istio.metadata_exchange' (type URL 'envoy.tcp.metadataexchange.config.MetadataExchange')",
            "This Envoy 1.40.0 lacks",
            "istio.stats (stats.PluginConfig)",
            "istio.alpn",
            "proxyv2",
            "PILOT_ENABLE_METADATA_EXCHANGE=false; PILOT_ENABLE_ALPN_FILTER=false; no Prometheus",
        ] {
            assert!(line.contains(want), "{want:?} not in {line}");
        }
        // Istio's build: the extension comes from elsewhere; no advice to change Envoy.
        let istio: Vec<&str> = ISTIO_EXTENSIONS.iter().map(|x| x.type_url).collect();
        let full = ExtensionReport::from_server_info(&server_info(&istio)).unwrap();
        let other = vec![MissingExtension {
            name: "acme.filter".into(),
            type_url: "acme.Config".into(),
        }];
        let line = error_line(Some(&full), &other);
        assert!(
            line.contains("'acme.filter' (type URL 'acme.Config')"),
            "{line}"
        );
        assert!(line.contains("an EnvoyFilter"), "{line}");
        assert!(!line.contains("proxyv2"), "{line}");
        // Without /server_info: Istio's entries the NACK named.
        let line = error_line(None, &named);
        assert!(
            line.contains("PILOT_ENABLE_METADATA_EXCHANGE=false)."),
            "{line}"
        );
        assert!(!line.contains("istio.alpn"), "{line}");
    }
}
