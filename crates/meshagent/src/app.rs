//! Wires the agent together for `meshagent proxy` (Istio's order, `pilot/cmd/pilot-agent/app`
//! and `pkg/istio-agent/agent.go` `Run`): status server, identity/SDS, xDS proxy, then Envoy's
//! bootstrap and process, supervised until Envoy exits or the agent is told to stop
//! (SIGTERM/SIGINT or `/quitquitquit`), in which case Envoy is drained first.
//!
//! Shutdown: the first SIGTERM/SIGINT drains; a second one skips what is left of the drain.
//! From the first signal the agent has [`shutdown_budget`] to finish: tasks still running then
//! are named in a log line and the agent exits 1.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::bootstrap::{self, Node};
use crate::config::Config;
use crate::envoy::{self, DrainOptions, DrainState, Envoy, EnvoyArgs, Outcome};
use crate::metrics::Registry;
use crate::preflight::StartPlan;
use crate::status;
use crate::tasks::Tasks;

/// Time allowed after the drain for stopping Envoy (SIGTERM, then SIGKILL after 5 s) and the
/// agent's own servers.
const SHUTDOWN_MARGIN: std::time::Duration = std::time::Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Bootstrap(#[from] bootstrap::BootstrapError),
    #[error(transparent)]
    Envoy(#[from] envoy::EnvoyError),
    #[error("cannot serve the status port {port}: {source}")]
    StatusPort {
        port: u16,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Preflight(#[from] crate::preflight::PreflightError),
    #[error("a start-up step on the blocking pool failed: {0}")]
    Blocking(String),
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Identity(#[from] crate::identity::IdentityError),
    #[error(transparent)]
    Xds(#[from] crate::xds::XdsError),
    #[error(transparent)]
    Dns(#[from] crate::dns::DnsError),
    #[error("cannot set up TLS for application probes: {0}")]
    ProbeTls(#[source] rustls::Error),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    #[error(transparent)]
    GrpcBootstrap(#[from] crate::grpcxds::GrpcXdsError),
    #[error(transparent)]
    Wasm(#[from] crate::wasm::WasmError),
}

/// The running agent's shared pieces; tests drive an agent in-process through this.
pub struct Agent {
    pub config: Config,
    pub cwd: PathBuf,
    pub registry: Registry,
    pub shutdown: CancellationToken,
    pub drain: Arc<DrainState>,
    pub readiness: status::Readiness,
    pub started: tokio::time::Instant,
    /// Where the xDS proxy publishes each NDS name table it receives; read by the DNS
    /// readiness probe and `/debug/ndsz`.
    pub name_table: tokio::sync::watch::Sender<Option<Arc<crate::dns::LookupTable>>>,
    /// The agent's long-lived tasks, waited for (with a deadline) at shutdown.
    pub tasks: Tasks,
    /// Supervised internal servers that are down (SDS, xDS proxy): not ready while any is.
    pub servers: crate::supervise::Servers,
    /// What the status server's operability views read (`/debug/certz`, `/debug/xdsz`, `/`).
    pub views: status::views::Views,
    /// The start's plan when the caller ran preflight already (`main` does, to fail before
    /// anything starts); otherwise the agent runs it.
    pub plan: Option<StartPlan>,
}

impl Agent {
    pub fn new(config: Config, cwd: &Path) -> Agent {
        Agent {
            config,
            cwd: cwd.to_path_buf(),
            registry: Registry::new(),
            shutdown: CancellationToken::new(),
            drain: Arc::default(),
            readiness: status::Readiness::default(),
            started: tokio::time::Instant::now(),
            name_table: tokio::sync::watch::Sender::new(None),
            tasks: Tasks::new(),
            servers: crate::supervise::Servers::new(),
            views: Default::default(),
            plan: None,
        }
    }

    /// [`Agent::new`] with the plan `preflight::plan` made for `config`.
    pub fn with_plan(config: Config, plan: StartPlan, cwd: &Path) -> Agent {
        Agent {
            plan: Some(plan),
            ..Agent::new(config, cwd)
        }
    }

    /// Runs until Envoy exits or shutdown completes; returns the process exit code. Once
    /// shutdown has begun, it ends within [`shutdown_budget`] (exit code 1 if it had to give
    /// up on tasks that would not stop).
    pub async fn run(self) -> Result<u8, AppError> {
        let shutdown = self.shutdown.clone();
        let tasks = self.tasks.clone();
        let budget = shutdown_budget(&self.config);
        let deadline = async move {
            shutdown.cancelled().await;
            tokio::time::sleep(budget).await;
        };
        tokio::select! {
            r = self.run_inner() => r,
            () = deadline => {
                tracing::error!(budget = %crate::logging::dur(budget), still_running = %crate::logging::list(tasks.running()), "shutdown did not finish in time; exiting");
                Ok(1)
            }
        }
    }

    async fn run_inner(mut self) -> Result<u8, AppError> {
        raise_fd_limit();
        let plan = match self.plan.take() {
            Some(p) => p,
            None => crate::preflight::plan(&self.config, &self.cwd)?,
        };
        let cfg = &self.config;
        crate::metrics::register_process_metrics(&self.registry)?;
        self.registry.counter_fn(
            "task_panics_total",
            "Long-lived agent tasks that died by panicking (readiness names the first).",
            || crate::tasks::Deaths::process().all().len() as f64,
        )?;
        bootstrap::note_unused_image_template(cfg, &self.cwd, plan.template.as_ref());
        let StartPlan {
            template,
            node,
            bootstrap_override,
        } = plan;
        // Cloud platform discovery (bounded, see `platform`) runs while the status server and
        // identity start; the node gets its result before the xDS proxy and Envoy need it.
        let platform = self.tasks.spawn("platform-discovery", {
            let cfg = cfg.clone();
            // Istio passes `proxy.SupportsIPv6()`: IPv6-only or dual-stack (pkg/model/proxy.go).
            let ipv6 = node.ips.iter().any(std::net::IpAddr::is_ipv6);
            async move { crate::platform::discover(&cfg, ipv6).await }
        });
        let admin = std::net::SocketAddr::new(node.localhost, cfg.proxy_config.proxy_admin_port);
        let envoy_enabled = !cfg.lifecycle.disable_envoy;

        // A dead internal server is the root cause of whatever else fails: reported first.
        // A dead long-lived task first: it is the root cause of whatever else goes stale.
        self.readiness.add(Arc::new(|| {
            let reason = crate::tasks::Deaths::process().not_ready();
            Box::pin(async move { reason.map_or(Ok(()), Err) })
        }));
        let servers = self.servers.clone();
        self.readiness.add(Arc::new(move || {
            let reason = servers.not_ready();
            Box::pin(async move { reason.map_or(Ok(()), Err) })
        }));
        // The identity probe comes next (root causes before their effects); it is armed once
        // identity has started.
        let identity_slot: Arc<
            std::sync::OnceLock<tokio::sync::watch::Receiver<crate::identity::IdentityStatus>>,
        > = Arc::default();
        let slot = identity_slot.clone();
        self.readiness.add(Arc::new(move || {
            let reason = slot.get().and_then(|s| s.borrow().not_ready.clone());
            Box::pin(async move { reason.map_or(Ok(()), Err) })
        }));
        self.drain.set_ignored_ports(ignored_ports(cfg));
        let envoy_probe = if envoy_enabled {
            let probe =
                status::EnvoyProbe::new(admin, self.started, &self.registry, self.drain.clone())?;
            self.readiness.add_envoy(probe.clone());
            Some(probe)
        } else {
            None
        };
        // Istio's order (`pilot/cmd/pilot-agent/status/ready/probe.go`): Envoy, gRPC
        // bootstrap, DNS table. The agent always writes the gRPC bootstrap (Istio
        // `agent.go` `Run`); GRPC_XDS_BOOTSTRAP="" turns it (and this check) off, as in Istio.
        // The file itself is written once the node has the platform's metadata (below).
        let grpc_bootstrap = !cfg.grpc.xds_bootstrap.as_os_str().is_empty();
        if grpc_bootstrap {
            self.readiness.add_grpc_bootstrap(
                crate::grpcxds::absolute(&self.cwd, &cfg.grpc.xds_bootstrap),
                true,
            );
        }
        let dns_enabled = crate::dns::enabled(cfg);
        if dns_enabled {
            self.readiness.add_dns_table(self.name_table.subscribe());
        }
        let status_stop = CancellationToken::new();
        let mut status_task = None;
        if cfg.proxy_config.status_port > 0 {
            let port = cfg.proxy_config.status_port;
            let listener = status::bind(port)
                .await
                .map_err(|source| AppError::StatusPort { port, source })?;
            let state = status::StatusState {
                views: self.views.clone(),
                readiness: self.readiness.clone(),
                registry: self.registry.clone(),
                drain: self.drain.clone(),
                shutdown: self.shutdown.clone(),
                envoy_admin: envoy_enabled.then_some(admin),
                proxy_type: cfg.proxy_type,
                merger: merger(cfg, &self.registry, node.localhost, envoy_enabled)?,
                // With DISABLE_ENVOY the grpc-agent template rewrites no probes
                // (`rewriteAppHTTPProbers: "false"`, no ISTIO_KUBE_APP_PROBERS); probers that
                // are configured are still served, as Istio's status server does.
                probes: status::AppProbes::new(
                    cfg.status.kube_app_probers.clone(),
                    probe_destination(cfg, node.localhost),
                    port,
                    cfg.status.enable_http2_probing,
                )
                .map_err(AppError::ProbeTls)?,
                metrics_localhost_only: cfg.status.metrics_localhost_access_only,
                name_table: Some(self.name_table.subscribe()),
                config_dump: cfg
                    .flags
                    .profiling
                    .then(|| serde_json::to_value(cfg).ok().map(Arc::new))
                    .flatten(),
                profiling: status::profile::Profiling::new(
                    cfg.flags.profiling,
                    cfg.status.profiling,
                ),
            };
            let stop = status_stop.clone();
            let shutdown = self.shutdown.clone();
            status_task = Some(self.tasks.spawn("status-server", async move {
                if let Err(e) = status::serve(listener, state, stop).await {
                    // Istio's agent terminates itself when the status server dies.
                    tracing::error!(error = %e, "status server failed; shutting down");
                    shutdown.cancel();
                }
            }));
            tracing::info!(port, "status server listening");
        }
        spawn_signal_handler(
            self.shutdown.clone(),
            self.drain.clone(),
            self.readiness.clone(),
        )
        .map_err(AppError::Signals)?;

        // Identity and xDS serve Envoy until it has drained and stopped, so they stop on their
        // own token, after Envoy — not on the shutdown signal.
        let services = CancellationToken::new();
        // Freed memory back to the OS after bursts (big xDS pushes, NDS tables).
        self.tasks
            .spawn("malloc-trim", crate::malloc::trimmer(services.clone()));
        // DISABLE_ENVOY (the grpc-agent template): no SDS server, certificates only in
        // OUTPUT_CERTS (Istio `agent.go` `initSdsServer`).
        let identity_opts = crate::identity::Options {
            servers: self.servers.clone(),
            sds_server: envoy_enabled,
            ..Default::default()
        };
        let identity = crate::identity::start_with(
            cfg,
            &self.cwd,
            &self.registry,
            services.clone(),
            identity_opts,
        )
        .await?;
        // Certificates gate readiness where something depends on them: Envoy's SDS, or the
        // files proxyless gRPC reads (OUTPUT_CERTS). Istio does not check them at all, so an
        // expired certificate stays "ready" there; here it does not. The probe was registered
        // before Envoy's, so a CA failure is reported rather than its consequence (Envoy's
        // "config not fully received").
        if envoy_enabled || cfg.identity.output_certs.is_some() {
            let _ = identity_slot.set(identity.status());
        }
        let _ = self.views.identity.set(identity.certz_source());
        // Istio starts the DNS proxy before the xDS proxy (`initLocalDNSServer`): it answers
        // SERVFAIL (or forwards, in `:53` root mode) until the first table arrives. An
        // unreadable resolv.conf or an address that cannot be bound is a startup error.
        let dns = if dns_enabled {
            let mut opts = crate::dns::Options::from_config(cfg);
            opts.servers = self.servers.clone();
            Some(
                crate::dns::start(
                    opts,
                    &self.registry,
                    self.name_table.subscribe(),
                    services.clone(),
                )
                .await?,
            )
        } else {
            None
        };
        if let Some(d) = &dns {
            let _ = self.views.dns.set(d.core.clone());
        }
        let platform = platform
            .await
            .unwrap_or_else(|_| crate::platform::Platform::unknown());
        let mut node = Node::with_platform(cfg, node.ips, &platform)?;
        if *identity.mode() == crate::identity::IdentityMode::ExternalSds {
            // Istio's agent marks the node so istiod and the bootstrap send `file-*` names to
            // the agent's own file-only SDS socket (pkg/istio-agent/agent.go, initSdsServer).
            node.metadata.insert(
                bootstrap::FILE_CREDENTIAL_META.to_owned(),
                serde_json::Value::String("true".to_owned()),
            );
        }
        tracing::info!(node = %node.id, ips = %crate::logging::list(&node.ips), locality = %node.locality, "proxy node");
        if grpc_bootstrap {
            // Istio renders it from the same node metadata as Envoy's (PLATFORM_METADATA and
            // locality included).
            let socket = cfg.proxy_config.config_path.join(crate::xds::SOCKET_NAME);
            let text = crate::grpcxds::render(cfg, &node, &self.cwd, &socket)?;
            let (cwd, file) = (self.cwd.clone(), cfg.grpc.xds_bootstrap.clone());
            let path =
                tokio::task::spawn_blocking(move || crate::grpcxds::write(&cwd, &file, &text))
                    .await
                    .map_err(|e| crate::grpcxds::GrpcXdsError::Write {
                        path: cfg.grpc.xds_bootstrap.clone(),
                        source: std::io::Error::other(e.to_string()),
                    })??;
            tracing::info!(path = %path.display(), "wrote the gRPC xDS bootstrap");
        }
        let mut xds_opts = crate::xds::XdsOptions::from_config(cfg, &self.cwd)?;
        xds_opts.servers = self.servers.clone();
        if cfg.wasm.remote_load_conversion {
            let converter = crate::wasm::start(
                crate::wasm::WasmOptions::from_config(cfg, &self.cwd),
                &self.registry,
                &self.tasks,
                services.clone(),
            )?;
            let _ = self.views.wasm.set(converter.view.clone());
            xds_opts.ecds = Arc::new(crate::wasm::WasmRewrite { converter });
        }
        let xds = crate::xds::start_with(xds_opts, &self.cwd, &self.registry, services.clone())?;
        let _ = self.views.xds.set(xds.xdsz());
        if let Some(probe) = &envoy_probe {
            probe.set_rejections(xds.xdsz());
        }
        // The NDS table feeds the DNS readiness probe and /debug/ndsz; PCDS trust anchors go
        // into ROOTCA. Both forwarders end when the xDS proxy drops its senders.
        let mut names = xds.name_table();
        let table_tx = self.name_table.clone();
        self.tasks.spawn("nds-table-forwarder", async move {
            while names.changed().await.is_ok() {
                let t = names.borrow_and_update().clone();
                table_tx.send_replace(t);
            }
        });
        let mut bundle = xds.pcds_bundle();
        let anchors = identity.trust_anchors();
        self.tasks.spawn("pcds-bundle-forwarder", async move {
            while bundle.changed().await.is_ok() {
                let pems = bundle.borrow_and_update().clone();
                anchors.set(pems);
            }
        });

        let code = if envoy_enabled {
            // Rendering and writing the bootstrap and reading ISTIO_BOOTSTRAP_OVERRIDE are file
            // work, and the status port and SDS are already served: the blocking pool.
            let (generated, args) = {
                let (cfg, node, cwd) = (cfg.clone(), node.clone(), self.cwd.clone());
                tokio::task::spawn_blocking(move || -> Result<_, AppError> {
                    let (config_file, generated) =
                        if cfg.proxy_config.custom_config_file.as_os_str().is_empty() {
                            let rendered = bootstrap::generate(&cfg, &node, template.as_ref())?;
                            let path = bootstrap::write(&cfg, &cwd, &rendered)?;
                            (path.clone(), Some(crate::fsio::under(&cwd, path)))
                        } else {
                            (cfg.proxy_config.custom_config_file.clone(), None)
                        };
                    let args = envoy_args(&cfg, &node, config_file, bootstrap_override);
                    Ok((generated, args))
                })
                .await
                .map_err(|e| AppError::Blocking(e.to_string()))??
            };
            let envoy = Envoy::start(&args, &self.cwd, generated)?;
            // The agent's own start is done; what follows (the first certificate, Envoy's
            // xDS and SDS streams) runs other code and holds the heap's high-water mark, so
            // the code and stack that ran until here leave before it (src/malloc.rs).
            self.tasks
                .spawn("startup-release", crate::malloc::release_all());
            // Whether this Envoy has Istio's extensions, and one clear error if it rejects
            // istiod's configuration for lack of them (`envoy::extensions`).
            self.tasks.spawn(
                "envoy-extension-check",
                envoy::extensions::check(
                    admin,
                    self.views.envoy_extensions.clone(),
                    xds.xdsz().missing_extensions(),
                    services.clone(),
                ),
            );
            let drain = DrainOptions {
                admin,
                proxy_type: cfg.proxy_type,
                termination_drain_duration: cfg.proxy_config.termination_drain_duration.get(),
                minimum_drain_duration: cfg.lifecycle.minimum_drain_duration,
                exit_on_zero_active_connections: cfg.lifecycle.exit_on_zero_active_connections,
                ignored_ports: ignored_ports(cfg),
                start_delay: cfg.lifecycle.drain_start_delay,
            };
            let supervised = self.tasks.spawn(
                "envoy",
                envoy.supervise(self.shutdown.clone(), drain, self.drain.clone()),
            );
            let outcome = supervised.await.map_err(|e| {
                envoy::EnvoyError::Wait(std::io::Error::other(format!(
                    "Envoy supervisor task failed: {e}"
                )))
            })??;
            match outcome {
                Outcome::EnvoyExited(status) => {
                    self.shutdown.cancel();
                    envoy::process::exit_code(status)
                }
                Outcome::Stopped(_) => 0,
            }
        } else {
            self.shutdown.cancelled().await;
            // No Envoy to drain (DISABLE_ENVOY): `/drain/status` goes straight to stopping.
            self.drain.set_phase(envoy::Phase::Stopping);
            0
        };
        services.cancel();
        self.tasks.spawn("xds-proxy", xds.wait());
        if let Some(dns) = dns {
            self.tasks.spawn("dns-proxy", dns.wait());
        }
        self.tasks
            .spawn("identity", async move { identity.stopped().await });
        status_stop.cancel();
        if let Some(t) = status_task {
            let _ = t.await;
        }
        // The deadline in `run` bounds this wait.
        self.tasks.wait_all().await;
        let code = if code == 0
            && self
                .drain
                .signalled_before_ready
                .load(std::sync::atomic::Ordering::SeqCst)
        {
            1
        } else {
            code
        };
        tracing::info!(code, "agent exiting");
        Ok(code)
    }
}

/// Sources of the merged metrics (Istio: `pilot/cmd/pilot-agent/status/server.go` `handleStats`): Envoy unless disabled, application targets only
/// for sidecars with `ISTIO_PROMETHEUS_ANNOTATIONS` and `scrape` not "false".
fn merger(
    cfg: &Config,
    registry: &Registry,
    localhost: std::net::IpAddr,
    envoy_enabled: bool,
) -> Result<status::Merger, crate::metrics::MetricsError> {
    let envoy =
        (envoy_enabled && cfg.status.merge_envoy_stats && cfg.bootstrap.envoy_prometheus_port != 0)
            .then(|| std::net::SocketAddr::new(localhost, cfg.bootstrap.envoy_prometheus_port));
    let targets = match &cfg.status.prometheus_annotations {
        Some(p) if p.scrape && cfg.proxy_type == crate::config::ProxyType::Sidecar => {
            p.targets.clone()
        }
        _ => Vec::new(),
    };
    Ok(status::Merger::new(
        registry.clone(),
        status::MergeMetrics::register(registry)?,
        envoy,
        targets,
    ))
}

/// `INSTANCE_IP` (apps bound only to the pod IP, #25177), or loopback with
/// `REWRITE_PROBE_LEGACY_LOCALHOST_DESTINATION` or without a pod IP.
fn probe_destination(cfg: &Config, localhost: std::net::IpAddr) -> std::net::IpAddr {
    if cfg.status.rewrite_probe_legacy_localhost_destination {
        return localhost;
    }
    cfg.pod.instance_ip.unwrap_or(localhost)
}

fn envoy_args(
    cfg: &Config,
    node: &Node,
    config: PathBuf,
    config_yaml: Option<String>,
) -> EnvoyArgs {
    EnvoyArgs {
        binary: cfg.proxy_config.binary_path.clone(),
        config,
        drain_duration: cfg.proxy_config.drain_duration.get(),
        ipv6: node.ipv6_only(),
        file_flush_interval: cfg
            .proxy_config
            .file_flush_interval
            .map(|d| d.get())
            .unwrap_or(std::time::Duration::from_secs(1)),
        file_flush_min_size_kb: cfg
            .proxy_config
            .passthrough
            .get("fileFlushMinSizeKb")
            .and_then(|v| {
                v.as_u64()
                    .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            })
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(0),
        log_level: cfg.flags.proxy_log_level.clone(),
        component_log_level: cfg.flags.proxy_component_log_level.clone(),
        skip_deprecated_logs: cfg.bootstrap.envoy_skip_deprecated_logs,
        enable_core_dump: cfg.bootstrap.envoy_enable_core_dump,
        config_yaml,
        concurrency: cfg.proxy_config.concurrency,
        compliance_policy: cfg.xds.compliance_policy.clone(),
    }
}

/// Raises the soft open-files limit to the hard limit, as the Go runtime does at start
/// (`syscall.rlimit` in Go 1.19+): the inherited soft limit (often 1024) is easy to exhaust
/// with status-port, SDS and xDS connections, and then every new connection fails.
pub fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::debug!(from = soft, to = hard, "raised the open-files limit"),
            Err(e) => tracing::warn!(error = %e, soft, hard, "cannot raise the open-files limit"),
        },
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read the open-files limit"),
    }
}

/// Envoy listener ports whose connections the drain does not wait for: the agent's own
/// (readiness, Prometheus, secure metrics), as Istio's `activeProxyConnections` skips them.
fn ignored_ports(cfg: &Config) -> Vec<u16> {
    [
        cfg.bootstrap.envoy_status_port,
        cfg.bootstrap.envoy_prometheus_port,
        cfg.bootstrap.envoy_secure_metrics_port,
        cfg.bootstrap.envoy_secure_merged_metrics_port,
    ]
    .into_iter()
    .filter(|p| *p != 0)
    .collect()
}

/// How long shutdown may take from the first signal: `MESHAGENT_DRAIN_START_DELAY`, then the
/// drain Envoy is given (`terminationDrainDuration`, or `MINIMUM_DRAIN_DURATION` with
/// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS` if longer), plus [`SHUTDOWN_MARGIN`].
pub fn shutdown_budget(cfg: &Config) -> std::time::Duration {
    let mut drain = cfg.proxy_config.termination_drain_duration.get();
    if cfg.lifecycle.exit_on_zero_active_connections {
        drain = drain.max(cfg.lifecycle.minimum_drain_duration);
    }
    drain += cfg.lifecycle.drain_start_delay;
    if cfg.lifecycle.disable_envoy {
        drain = std::time::Duration::ZERO;
    }
    drain + SHUTDOWN_MARGIN
}

/// How long the last readiness check on a signal before ready may take.
const NOT_READY_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// SIGTERM or SIGINT starts graceful shutdown; a second one (either) skips the rest of the
/// drain. SIGHUP, SIGUSR1 and SIGUSR2 are ignored, as a Go program ignores them unless it
/// asks for them (their default action would kill the agent and orphan Envoy).
///
/// A signal before the proxy was ever ready (no readiness check passed, and one more check
/// now fails) makes the agent exit 1 once it has shut down. Istio's agent exits 0, so a pod
/// with `restartPolicy: OnFailure` whose `holdApplicationUntilProxyStarts` hook timed out is
/// never retried (istio/istio#45627); an explicit `/quitquitquit` still exits 0.
fn spawn_signal_handler(
    shutdown: CancellationToken,
    drain: Arc<DrainState>,
    readiness: status::Readiness,
) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    // Registering a handler replaces the default (terminating) action; never reading the
    // streams drops the signals.
    let ignored = [
        signal(SignalKind::hangup())?,
        signal(SignalKind::user_defined1())?,
        signal(SignalKind::user_defined2())?,
    ];
    let span = tracing::info_span!("task", task = "signals");
    tokio::spawn(tracing::Instrument::instrument(
        async move {
            let _ignored = ignored;
            tokio::select! {
                _ = term.recv() => tracing::info!("received SIGTERM; starting graceful shutdown"),
                _ = int.recv() => tracing::info!("received SIGINT; starting graceful shutdown"),
                _ = shutdown.cancelled() => {}
            }
            // Readiness fails at once, before anything else happens (the drain itself may
            // wait MESHAGENT_DRAIN_START_DELAY). A proxy never seen ready is checked once
            // more first, so that check is not failed by the shutdown itself.
            let ready_once = readiness.ready_once();
            if ready_once {
                drain.begin_shutdown();
            }
            if !shutdown.is_cancelled() && !ready_once {
                let check = tokio::time::timeout(NOT_READY_CHECK, readiness.check()).await;
                if !matches!(check, Ok(Ok(()))) {
                    tracing::warn!(
                        "terminated before the proxy was ever ready: exiting 1 after shutdown"
                    );
                    drain
                        .signalled_before_ready
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
            drain.begin_shutdown();
            shutdown.cancel();
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::warn!("second termination signal; skipping the rest of the drain");
            drain
                .skip_drain
                .store(true, std::sync::atomic::Ordering::SeqCst);
            drain.abort.cancel();
        },
        span,
    ));
    Ok(())
}
