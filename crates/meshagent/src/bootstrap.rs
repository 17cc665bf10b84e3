//! Envoy bootstrap generation (Istio: `pkg/bootstrap/config.go`, `tools/packaging/common/envoy_bootstrap.json`).
//!
//! The built-in renderer ([`render`]) produces what Istio's default template
//! (tools/packaging/common/envoy_bootstrap.json, rendered by pkg/bootstrap/instance.go) produces
//! for the same inputs, from typed inputs, as JSON. Custom Go templates (`ISTIO_BOOTSTRAP`,
//! `--templateFile`, ProxyConfig `proxyBootstrapTemplatePath`) are rendered with Go
//! `text/template` semantics and Istio's parameter names by [`template`]. The template that
//! Istio's proxyv2 image ships at `/var/lib/istio/envoy/envoy_bootstrap_tmpl.json` (Istio's
//! default path) is *not* rendered: it is Istio's default template, which the built-in renderer
//! reproduces (see docs/bootstrap.md).

mod inputs;
pub mod node;
pub mod params;
mod remote;
mod resources;
pub mod stats;
pub mod template;
pub mod tracing;

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use crate::config::Config;

pub use inputs::{Inputs, RemoteService};
pub use remote::expand_host_ip;
pub use resources::SELF_DISCOVERY_CLUSTER;
use resources::{
    compressors, h2_options, hcm, listener, remote_service_cluster, route, router,
    secure_metrics_listener, self_discovery_cluster, socket, static_cluster,
};
pub use stats::{
    ANNOTATION_EVICTION_INTERVAL, ANNOTATION_EXTRA_STAT_TAGS, ANNOTATION_FLUSH_INTERVAL,
    ANNOTATION_HISTOGRAM_BUCKETS, ANNOTATION_INCLUSION_PREFIXES, ANNOTATION_INCLUSION_REGEXPS,
    ANNOTATION_INCLUSION_SUFFIXES,
};

/// Istio's default template path in the proxyv2 image (relative to the working directory `/`).
pub const IMAGE_TEMPLATE_PATH: &str = "./var/lib/istio/envoy/envoy_bootstrap_tmpl.json";

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(transparent)]
    Node(#[from] node::NodeError),
    #[error("annotation {annotation}={value:?}: {reason}")]
    Annotation {
        annotation: &'static str,
        value: String,
        reason: String,
    },
    #[error("invalid {field}={value:?}: {reason}")]
    Address {
        field: &'static str,
        value: String,
        reason: String,
    },
    #[error("{what} is not supported: {reason}")]
    Unsupported { what: String, reason: String },
    #[error(
        "invalid node metadata LOAD_STATS_CONFIG_JSON={value:?}: expected a JSON object: {reason}"
    )]
    LoadStats { value: String, reason: String },
    #[error(transparent)]
    Template(#[from] template::TemplateError),
    #[error("cannot read ISTIO_BOOTSTRAP_OVERRIDE file {path}: {reason}")]
    Override { path: PathBuf, reason: String },
    #[error("cannot write bootstrap {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `base` joined with `name` as Go's `filepath.Join` does (`pkg/bootstrap/instance.go` names
/// the bootstrap `filepath.Join(ConfigPath, "envoy-rev.json")`): lexically cleaned, so the
/// default `./etc/istio/proxy` gives `etc/istio/proxy/envoy-rev.json`, which Envoy's argv and
/// the bootstrap's file paths then show as Istio's do.
pub fn go_join(base: &Path, name: &str) -> PathBuf {
    use std::path::Component;
    let joined = base.join(name);
    let mut out: Vec<Component<'_>> = Vec::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir if matches!(out.last(), Some(Component::Normal(_))) => {
                out.pop();
            }
            Component::ParentDir if matches!(out.last(), Some(Component::RootDir)) => {}
            c => out.push(c),
        }
    }
    if out.is_empty() {
        return PathBuf::from(".");
    }
    out.iter().collect()
}

/// The proxy's node, computed once at startup.
#[derive(Debug, Clone)]
pub struct Node {
    pub id: String,
    pub cluster: String,
    pub locality: Value,
    pub metadata: Map<String, Value>,
    pub ips: Vec<IpAddr>,
    /// Where the agent reaches Envoy's admin (`127.0.0.1` or `::1`).
    pub localhost: IpAddr,
}

impl Node {
    pub fn from_config(cfg: &Config) -> Result<Node, BootstrapError> {
        let excluded: Vec<&str> = cfg
            .pod_annotations
            .get(node::EXCLUDE_INTERFACES_ANNOTATION)
            .map(|s| s.split(',').map(str::trim).collect())
            .unwrap_or_default();
        let ips = node::instance_ips(cfg.pod.instance_ip, &node::interface_addrs(), &excluded);
        Self::with_ips(cfg, ips)
    }

    /// The node for the given instance IPs (tests pass fixed IPs).
    pub fn with_ips(cfg: &Config, ips: Vec<IpAddr>) -> Result<Node, BootstrapError> {
        Self::with_platform(cfg, ips, &crate::platform::Platform::unknown())
    }

    /// The node on a discovered cloud platform: `PLATFORM_METADATA` and, without a locality
    /// label, the platform's locality.
    pub fn with_platform(
        cfg: &Config,
        ips: Vec<IpAddr>,
        platform: &crate::platform::Platform,
    ) -> Result<Node, BootstrapError> {
        let metadata = node::metadata_with(cfg, &ips, platform)?;
        Ok(Node {
            id: node::node_id(cfg, &ips),
            cluster: node::cluster(cfg, &metadata),
            locality: node::locality_with(&metadata, &platform.locality),
            localhost: node::localhost_for(&ips, cfg.bootstrap.dual_stack),
            metadata,
            ips,
        })
    }

    /// IPv6 when every node IP is IPv6 (Envoy `--local-address-ip-version`).
    pub fn ipv6_only(&self) -> bool {
        !self.ips.is_empty() && self.ips.iter().all(IpAddr::is_ipv6)
    }
}

/// Node metadata key saying the agent serves `file-*` SDS names on its own socket because an
/// external SDS server owns the workload socket (Istio `security.CredentialFileMetaDataName`).
/// istiod then points `file-*` secrets at cluster `sds-files-grpc`.
pub const FILE_CREDENTIAL_META: &str = "file-credential";

/// Where Envoy reaches the agent's file-only SDS server, when the node says it has one: Istio
/// sets its `custom_file_path` template option to `security.FileCredentialNameSocketPath`
/// when the raw metadata has the `file-credential` key at all (pkg/bootstrap/config.go), and
/// the template adds cluster `sds-files-grpc` for it.
pub fn custom_file_sds_path(node: &Node) -> Option<String> {
    node.metadata
        .contains_key(FILE_CREDENTIAL_META)
        .then(|| format!("./{}", crate::identity::sds::FILES_SOCKET))
}

/// Renders Istio's default bootstrap for `cfg` and `node`.
pub fn render(cfg: &Config, node: &Node) -> Result<Value, BootstrapError> {
    let inp = Inputs::new(cfg, node)?;
    Ok(render_inputs(cfg, node, &inp))
}

fn render_inputs(cfg: &Config, node: &Node, inp: &Inputs) -> Value {
    let pc = &cfg.proxy_config;
    let boot = &cfg.bootstrap;
    let log_format = if cfg.flags.log_as_json {
        json!({"json_format": {"time": "%Y-%m-%dT%T.%fZ", "level": "%l", "scope": "envoy %n", "msg": "%j", "caller": "%g:%#", "thread": "%t"}})
    } else {
        json!({"text_format": "%Y-%m-%dT%T.%fZ\t%l\tenvoy %n %g:%#\t%v\tthread=%t"})
    };
    let config_path = pc.config_path.display().to_string();
    let sds_socket = format!(
        "./var/run/secrets/workload-spiffe-uds/{}",
        cfg.identity.workload_identity_socket_file
    );

    let mut clusters = vec![
        static_cluster(
            "prometheus_stats",
            "0.250s",
            socket(&inp.localhost, pc.proxy_admin_port),
        ),
        static_cluster("agent", "0.250s", socket(&inp.localhost, pc.status_port)),
    ];
    let mut sds = static_cluster("sds-grpc", "1s", json!({"pipe": {"path": sds_socket}}));
    sds["typed_extension_protocol_options"] = h2_options();
    clusters.push(sds);
    if let Some(path) = custom_file_sds_path(node) {
        let mut files = static_cluster("sds-files-grpc", "1s", json!({"pipe": {"path": path}}));
        files["typed_extension_protocol_options"] = h2_options();
        clusters.push(files);
    }
    let mut xds = static_cluster(
        "xds-grpc",
        "1s",
        json!({"pipe": {"path": format!("{config_path}/XDS")}}),
    );
    xds["typed_extension_protocol_options"] = h2_options();
    xds["max_requests_per_connection"] = json!(1);
    xds["upstream_connection_options"] = json!({"tcp_keepalive": {"keepalive_time": 300}});
    let threshold = |p: &str| json!({"priority": p, "max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000});
    xds["circuit_breakers"] = json!({"thresholds": [threshold("DEFAULT"), threshold("HIGH")]});
    clusters.push(xds);
    if let Some(t) = &inp.tracer {
        clusters.push(tracing::cluster(
            t,
            inp.tracing_tls.as_ref(),
            inp.dns_lookup_family,
        ));
    }
    if let Some(ms) = &inp.metrics_service {
        clusters.push(remote_service_cluster(
            "envoy_metrics_service",
            ms,
            inp.dns_lookup_family,
        ));
    }
    if let Some(als) = &inp.accesslog_service {
        clusters.push(remote_service_cluster(
            "envoy_accesslog_service",
            als,
            inp.dns_lookup_family,
        ));
    }
    if inp.self_discovery {
        clusters.push(self_discovery_cluster());
    }

    let (metrics_addr, metrics_additional) = if inp.metrics_localhost_only {
        (&inp.localhost, inp.additional_localhost.as_deref())
    } else {
        (&inp.wildcard, inp.additional_wildcard.as_deref())
    };
    let mut prom_filters = if inp.stats_compression {
        compressors()
    } else {
        vec![]
    };
    prom_filters.push(router());
    let mut listeners = vec![listener(
        metrics_addr,
        metrics_additional,
        boot.envoy_prometheus_port,
        json!({"filters": [hcm("stats", json!([route("/stats/prometheus", "prometheus_stats")]), prom_filters)]}),
    )];
    if boot.envoy_secure_metrics_port != 0 {
        listeners.push(secure_metrics_listener(
            inp,
            boot.envoy_secure_metrics_port,
            false,
        ));
    }
    if boot.envoy_secure_merged_metrics_port != 0 {
        listeners.push(secure_metrics_listener(
            inp,
            boot.envoy_secure_merged_metrics_port,
            true,
        ));
    }
    let mut status = listener(
        &inp.wildcard,
        inp.additional_wildcard.as_deref(),
        boot.envoy_status_port,
        json!({"filters": [hcm("agent", json!([route("/healthz/ready", "agent")]), vec![router()])]}),
    );
    if boot.envoy_status_port_enable_proxy_protocol {
        // The template's legacy filter name; plain health checks keep working
        // (`allow_requests_without_proxy_protocol`).
        status["listener_filters"] = json!([{"name": "envoy.listener.proxy_protocol", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol",
            "allow_requests_without_proxy_protocol": true
        }}]);
    }
    listeners.push(status);

    let mut extensions = vec![];
    if inp.metadata_discovery {
        extensions.push(json!({"name": "metadata_discovery", "typed_config": {
            "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
            "type_url": "type.googleapis.com/istio.workload.BootstrapExtension",
            "value": {"config_source": {"ads": {}}}
        }}));
    }
    extensions.push(json!({"name": "envoy.bootstrap.internal_listener", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
        "value": {"buffer_size_kb": 64}
    }}));

    let mut out = json!({
        "application_log_config": {"log_format": log_format},
        "node": {
            "id": node.id,
            "cluster": node.cluster,
            "locality": node.locality,
            "metadata": node.metadata,
        },
        "layered_runtime": {"layers": [
            {"name": "global config", "static_layer": inp.runtime_flags},
            {"name": "admin", "admin_layer": {}}
        ]},
        "bootstrap_extensions": extensions,
        "stats_config": stats::stats_config(&inp.stats, inp.metadata_discovery),
        "admin": {
            "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": "/dev/null"
            }}],
            "profile_path": "/var/lib/istio/data/envoy.prof",
            // Without `protocol` (TCP is the default), as the template writes it.
            "address": {"socket_address": {"address": inp.localhost, "port_value": pc.proxy_admin_port}}
        },
        "dynamic_resources": {
            "lds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "cds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "ads_config": {
                "api_type": if inp.delta { "DELTA_GRPC" } else { "GRPC" },
                "set_node_on_first_message_only": true,
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
            }
        },
        "static_resources": {"clusters": clusters, "listeners": listeners},
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                "max_active_downstream_connections": inp.global_downstream_max_connections
            }
        }]},
        "deferred_stat_options": {"enable_deferred_creation_stats": true}
    });
    if let Some(d) = inp.stats.flush_interval {
        out["stats_flush_interval"] = json!(stats::proto_duration(d));
    }
    if let Some(d) = inp.stats.eviction_interval {
        out["stats_eviction_interval"] = json!(stats::proto_duration(d));
    }
    if let Some(t) = &inp.tracer {
        out["tracing"] = tracing::tracing(t, &node.cluster);
    }
    let mut sinks = vec![];
    if inp.metrics_service.is_some() {
        sinks.push(
            json!({"name": "envoy.stat_sinks.metrics_service", "typed_config": {
                "@type": "type.googleapis.com/envoy.config.metrics.v3.MetricsServiceConfig",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "envoy_metrics_service"}}
            }}),
        );
    }
    if let Some(statsd) = &inp.statsd {
        sinks.push(json!({"name": "envoy.stat_sinks.statsd", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.metrics.v3.StatsdSink",
            "address": {"socket_address": statsd}
        }}));
    }
    if !sinks.is_empty() {
        out["stats_sinks"] = Value::Array(sinks);
    }
    // `cluster_manager` (with deferred cluster creation) only when one of its entries is
    // configured: the outlier log, LRS or self-discovery. Istio's template
    // (tools/packaging/common/envoy_bootstrap.json) writes the block under
    // `if or .outlier_log_path .load_stats_config_json_str .enable_self_discovery`; the
    // differential suite (compat_bootstrap) checks it against the real pilot-agent.
    let outlier = !cfg.flags.outlier_log_path.is_empty();
    let mut cm = Map::new();
    if inp.self_discovery {
        cm.insert("local_cluster_name".into(), json!(SELF_DISCOVERY_CLUSTER));
    }
    if outlier {
        cm.insert(
            "outlier_detection".into(),
            json!({"event_log_path": cfg.flags.outlier_log_path}),
        );
    }
    if let Some(lrs) = &inp.load_stats_config {
        cm.insert("load_stats_config".into(), lrs.clone());
    }
    if !cm.is_empty() {
        cm.insert("enable_deferred_cluster_creation".into(), json!(true));
        out["cluster_manager"] = Value::Object(cm);
    }
    out
}

/// A rendered bootstrap, ready to be written.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// File name under configPath: `envoy-rev.json`, or `envoy-rev.yaml` for a YAML template.
    pub file_name: &'static str,
    pub contents: String,
    /// Files the bootstrap refers to (the Lightstep token), path relative to the agent's cwd.
    pub side_files: Vec<(PathBuf, String)>,
}

/// Which template renders the bootstrap: an explicit custom template, else the built-in
/// renderer. Precedence: `ISTIO_BOOTSTRAP` > ProxyConfig `proxyBootstrapTemplatePath`
/// (`--templateFile`) (pkg/bootstrap/instance.go `WriteTo`). With ProxyConfig
/// `customConfigFile` nothing is rendered: that file is Envoy's config as is (pkg/envoy).
pub fn template_path(cfg: &Config) -> Option<(PathBuf, &'static str)> {
    if !cfg.proxy_config.custom_config_file.as_os_str().is_empty() {
        return None;
    }
    if let Some(p) = &cfg.bootstrap.template_override {
        return Some((p.clone(), "ISTIO_BOOTSTRAP"));
    }
    let p = &cfg.proxy_config.proxy_bootstrap_template_path;
    (!p.as_os_str().is_empty()).then(|| (p.clone(), "ProxyConfig proxyBootstrapTemplatePath"))
}

/// Loads and checks the custom template, if any, at startup: a missing file, a parse error,
/// or a function or parameter meshagent does not provide is an error naming it and the line.
/// Says once, when Envoy's bootstrap is about to be rendered, that the image's template is
/// not used (config validation calls [`load_template`], which stays quiet).
pub fn check_template(
    cfg: &Config,
    cwd: &Path,
) -> Result<Option<template::Template>, BootstrapError> {
    let t = load_template(cfg, cwd)?;
    note_unused_image_template(cfg, cwd, t.as_ref());
    Ok(t)
}

/// Says once, when Envoy's bootstrap is about to be rendered, that the image's template
/// (`/var/lib/istio/envoy/envoy_bootstrap_tmpl.json`) is not used.
#[allow(
    clippy::disallowed_methods,
    reason = "one stat at start, before anything is served"
)]
pub fn note_unused_image_template(cfg: &Config, cwd: &Path, template: Option<&template::Template>) {
    if template.is_none()
        && cfg.proxy_config.custom_config_file.as_os_str().is_empty()
        && crate::fsio::under(cwd, IMAGE_TEMPLATE_PATH).exists()
    {
        ::tracing::info!(
            template = IMAGE_TEMPLATE_PATH,
            "not rendering the image's bootstrap template: the built-in renderer \
             produces Istio's default bootstrap (set ISTIO_BOOTSTRAP to render a template)"
        );
    }
}

/// [`check_template`] without the log line.
pub fn load_template(
    cfg: &Config,
    cwd: &Path,
) -> Result<Option<template::Template>, BootstrapError> {
    match template_path(cfg) {
        None => Ok(None),
        Some((path, origin)) => Ok(Some(template::Template::load(
            &cwd.join(&path),
            &path,
            origin,
        )?)),
    }
}

/// Renders the bootstrap: with `tmpl` when a custom template is configured, else built in.
pub fn generate(
    cfg: &Config,
    node: &Node,
    tmpl: Option<&template::Template>,
) -> Result<Rendered, BootstrapError> {
    let inp = Inputs::new(cfg, node)?;
    let mut side_files = vec![];
    if let Some(tracing::Tracer::Lightstep {
        token_path, token, ..
    }) = &inp.tracer
    {
        side_files.push((token_path.clone(), token.clone()));
    }
    let (file_name, contents) = match tmpl {
        None => {
            let v = render_inputs(cfg, node, &inp);
            (
                "envoy-rev.json",
                serde_json::to_string_pretty(&v).unwrap_or_default(),
            )
        }
        Some(t) => {
            let p = params::params(cfg, node, &inp);
            (t.output_file_name(), t.render(&p)?)
        }
    };
    Ok(Rendered {
        file_name,
        contents,
        side_files,
    })
}

/// Writes the bootstrap to `<configPath>/<file_name>` (resolved against `cwd`) and returns its
/// path relative to the agent's working directory, as passed to Envoy. Side files (the
/// Lightstep token) are written first, mode 0666 as Istio does.
#[allow(
    clippy::disallowed_methods,
    reason = "called on the blocking pool (app::Agent::run_inner)"
)]
pub fn write(cfg: &Config, cwd: &Path, rendered: &Rendered) -> Result<PathBuf, BootstrapError> {
    use std::os::unix::fs::PermissionsExt;
    for (rel, text) in &rendered.side_files {
        let abs = crate::fsio::under(cwd, rel);
        let w = || -> std::io::Result<()> {
            if let Some(dir) = abs.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&abs, text)?;
            std::fs::set_permissions(&abs, std::fs::Permissions::from_mode(0o666))
        };
        w().map_err(|source| BootstrapError::Write {
            path: abs.clone(),
            source,
        })?;
    }
    let rel = go_join(&cfg.proxy_config.config_path, rendered.file_name);
    let abs = crate::fsio::under(cwd, &rel);
    let write = || -> std::io::Result<()> {
        if let Some(dir) = abs.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = abs.with_extension("tmp");
        // A failed write (disk full, read-only filesystem) leaves no half-written file.
        std::fs::write(&tmp, &rendered.contents)
            .and_then(|()| std::fs::rename(&tmp, &abs))
            .inspect_err(|_| {
                let _ = std::fs::remove_file(&tmp);
            })
    };
    write().map_err(|source| BootstrapError::Write {
        path: abs.clone(),
        source,
    })?;
    Ok(rel)
}

/// The `ISTIO_BOOTSTRAP_OVERRIDE` file as JSON for Envoy's `--config-yaml`, `$(HOST_IP)`
/// substituted (pkg/envoy/proxy.go passes it as `--config-yaml`). Read once, by
/// [`crate::preflight::plan`].
#[allow(
    clippy::disallowed_methods,
    reason = "read once by preflight, before anything is served"
)]
pub fn read_override(cfg: &Config, cwd: &Path) -> Result<Option<String>, BootstrapError> {
    let Some(p) = &cfg.bootstrap.bootstrap_override else {
        return Ok(None);
    };
    let path = crate::fsio::under(cwd, p);
    let text = std::fs::read_to_string(&path).map_err(|e| BootstrapError::Override {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let text = expand_host_ip(&text, &cfg.pod.host_ip);
    let value: serde_json::Value =
        serde_yaml::from_str(&text).map_err(|e| BootstrapError::Override {
            path: path.clone(),
            reason: format!("not YAML/JSON: {e}"),
        })?;
    Ok(Some(value.to_string()))
}
