//! Workload identity: keys and CSRs, the Istio CA client, the secret cache with rotation,
//! file-mounted certificates, OUTPUT_CERTS, and the SDS server Envoy gets them from
//! (Istio `pkg/istio-agent/agent.go`, `security/pkg/nodeagent`).
//!
//! # Wiring
//!
//! ```ignore
//! let shutdown = CancellationToken::new();
//! let identity = meshagent::identity::start(&cfg, Path::new("."), &registry, shutdown.clone()).await?;
//! // readiness: `not_ready` is Some(reason) until the first certificate, and again once the
//! // certificate has expired while the CA keeps failing.
//! let mut status = identity.status();
//! // PCDS `caCertificatesPem` from the xDS proxy: merged into ROOTCA.
//! identity.set_trust_anchors(vec![pem]);
//! // shutdown: cancel the token, then
//! identity.stopped().await;
//! ```
//!
//! [`start`] picks the mode as Istio's `initSdsServer` does (`pkg/istio-agent/agent.go`):
//! * a healthy external socket at `./var/run/secrets/workload-spiffe-uds/<WORKLOAD_IDENTITY_SOCKET_FILE>`
//!   → no CA client; file certificates only, on `./var/run/secrets/credential-uds/files-socket`
//!   (an unhealthy one is removed);
//! * `./var/run/secrets/workload-spiffe-credentials/{cert-chain,key,root-cert}.pem` present, or
//!   `FILE_MOUNTED_CERTS` → `default`/`ROOTCA` come from files, never from a CA;
//! * otherwise the CA-backed [`manager::SecretManager`], with `./etc/certs/*` still taking
//!   precedence for `default`/`ROOTCA` when present (unless `OUTPUT_CERTS` points there).
//!
//! Every path is resolved against the `cwd` argument, never the process working directory, so
//! tests run several agents in one process.

pub mod caclient;
pub mod files;
pub mod keys;
pub mod manager;
pub mod metrics;
pub mod output;
pub mod sds;
pub mod store;
pub mod verify;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::control_plane::{CallMetadata, TokenSource};
use crate::metrics::Registry;
use store::{Aliases, SecretStore};

/// Sets the PCDS trust anchors merged into `ROOTCA` (see [`IdentityHandle::set_trust_anchors`]).
#[derive(Clone)]
pub struct TrustAnchors(watch::Sender<Vec<String>>);

impl TrustAnchors {
    /// An unchanged set is a no-op (no `ROOTCA` push).
    pub fn set(&self, pems: Vec<String>) {
        self.0.send_if_modified(|cur| {
            if *cur == pems {
                false
            } else {
                *cur = pems;
                true
            }
        });
    }
}

/// The external SDS socket directory (Istio `pkg/security/security.go` `WorkloadIdentityPath`).
pub const WORKLOAD_SPIFFE_UDS_DIR: &str = "var/run/secrets/workload-spiffe-uds";
/// Mounted workload credentials that switch to file-mounted mode when all three exist.
pub const WORKLOAD_SPIFFE_CREDENTIALS_DIR: &str = "var/run/secrets/workload-spiffe-credentials";
/// Legacy mounted certificates.
pub const ETC_CERTS_DIR: &str = "etc/certs";

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    #[error("configured for non-default SDS socket path {0} but no healthy socket found there")]
    NoExternalSocket(PathBuf),
    #[error("cannot remove unhealthy SDS socket {path}: {source}")]
    RemoveSocket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot probe the identity mode: {0}")]
    Probe(String),
    #[error("CA_PROVIDER {0} is not supported (only Citadel, as in open-source Istio)")]
    CaProvider(String),
    #[error(transparent)]
    Key(#[from] keys::KeyError),
    #[error(transparent)]
    Dial(#[from] crate::control_plane::DialError),
    #[error(transparent)]
    Sds(#[from] crate::identity::sds::SdsError),
}

/// Where the identity subsystem stands, for readiness and debugging.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdentityStatus {
    /// `Some(reason)` while no valid workload certificate can be served: none issued yet, or
    /// the last one expired while the CA kept failing. Readiness should fail with this reason.
    pub not_ready: Option<String>,
    /// The last CA failure, until the next success (informational while the certificate is
    /// still valid: Envoy keeps the old one).
    pub last_error: Option<String>,
    /// `NotAfter` of the served workload certificate.
    pub cert_expiry: Option<SystemTime>,
    /// When the next CSR goes out after a failure (`/debug/certz`).
    pub next_retry: Option<SystemTime>,
    /// When the served workload certificate is due to be rotated (`/debug/certz`).
    pub next_rotation: Option<SystemTime>,
}

/// Where the served secrets come from, for `/debug/certz` (never key material).
#[derive(Debug, Clone)]
pub struct CertzSource {
    pub mode: IdentityMode,
    /// `CA_ADDR` in CA mode.
    pub ca_addr: Option<String>,
    /// The external SDS socket that owns `default`/`ROOTCA` (external SDS mode).
    pub external_sds: Option<PathBuf>,
    /// The socket our SDS server listens on.
    pub sds_socket: PathBuf,
    /// `OUTPUT_CERTS`, absolute.
    pub output_certs: Option<PathBuf>,
    /// The agent's working directory (`file-*` names resolve against it).
    pub cwd: PathBuf,
    pub status: watch::Receiver<IdentityStatus>,
    pub store: Arc<SecretStore>,
}

/// How certificates are obtained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityMode {
    /// CSRs to the Istio CA.
    Ca,
    /// `default`/`ROOTCA` from mounted files; no CA client.
    FileMounted,
    /// An external SDS server owns the workload socket; we serve only `file-*` names.
    ExternalSds,
}

/// Knobs tests turn; production uses [`Options::default`].
#[derive(Debug, Clone)]
pub struct Options {
    /// How long a file secret may fail to load before streams get the error (Istio: 10 s).
    pub file_load_wait: Duration,
    /// The wall clock used for rotation; [`manager::Clock::tokio`] for paused-time tests.
    pub clock: manager::Clock,
    /// Per-identity CSR backoff.
    pub backoff: manager::Backoff,
    /// Where the SDS server's supervisor reports it down (readiness).
    pub servers: crate::supervise::Servers,
    /// Serve SDS on the workload socket. Off with `DISABLE_ENVOY` (Istio `agent.go`
    /// `initSdsServer`: no SDS server; certificates are only kept in `OUTPUT_CERTS`).
    pub sds_server: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            file_load_wait: Duration::from_secs(10),
            clock: manager::Clock::System,
            backoff: manager::default_backoff(),
            servers: crate::supervise::Servers::new(),
            sds_server: true,
        }
    }
}

/// The running identity subsystem.
#[derive(Debug)]
pub struct IdentityHandle {
    status: watch::Receiver<IdentityStatus>,
    anchors: watch::Sender<Vec<String>>,
    socket: PathBuf,
    mode: IdentityMode,
    store: Arc<SecretStore>,
    tasks: Vec<JoinHandle<()>>,
    ca_addr: Option<String>,
    external_sds: Option<PathBuf>,
    output_certs: Option<PathBuf>,
    cwd: PathBuf,
}

impl IdentityHandle {
    pub fn status(&self) -> watch::Receiver<IdentityStatus> {
        self.status.clone()
    }

    /// A cloneable setter for PCDS trust anchors, for a task that forwards PCDS bundles.
    pub fn trust_anchors(&self) -> TrustAnchors {
        TrustAnchors(self.anchors.clone())
    }

    /// PCDS trust anchors (`caCertificatesPem`), merged into `ROOTCA`; an unchanged set is a
    /// no-op. Ignored in file-mounted modes. Unlike Istio we do not also drop the workload
    /// certificate and re-issue it: the leaf does not change with the bundle, and a CSR per
    /// bundle change would only load the CA.
    pub fn set_trust_anchors(&self, pems: Vec<String>) {
        self.trust_anchors().set(pems);
    }

    /// The socket our SDS server listens on (absolute).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn mode(&self) -> &IdentityMode {
        &self.mode
    }

    /// The secret table (for the status server's debug views and tests).
    pub fn store(&self) -> &Arc<SecretStore> {
        &self.store
    }

    /// What `/debug/certz` reads: the store, the status and where secrets come from.
    pub fn certz_source(&self) -> CertzSource {
        CertzSource {
            mode: self.mode.clone(),
            ca_addr: self.ca_addr.clone(),
            external_sds: self.external_sds.clone(),
            sds_socket: self.socket.clone(),
            output_certs: self.output_certs.clone(),
            cwd: self.cwd.clone(),
            status: self.status.clone(),
            store: self.store.clone(),
        }
    }

    /// Waits for every task to finish after the shutdown token was cancelled.
    pub async fn stopped(self) {
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Starts identity with production options. See the module docs.
pub async fn start(
    cfg: &Config,
    cwd: &Path,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<IdentityHandle, IdentityError> {
    start_with(cfg, cwd, registry, shutdown, Options::default()).await
}

/// What [`probe_mode`] found.
struct Probed {
    mode: IdentityMode,
    aliases: Aliases,
    /// A healthy external SDS socket: serve only file certificates, on the files socket.
    serve_only_files: bool,
    external: PathBuf,
}

/// The identity source, in Istio's order (`pkg/istio-agent/agent.go`): an external SDS socket,
/// mounted credentials, the file-mounted metadata paths, then the CA, with `./etc/certs`
/// taking precedence for `default`/`ROOTCA`. Blocking (stats, a unix connect): run it on the
/// blocking pool.
#[allow(
    clippy::disallowed_methods,
    reason = "runs on the blocking pool (start_with)"
)]
fn probe_mode(
    id: &crate::config::IdentityConfig,
    cwd: &Path,
    meta: &std::collections::BTreeMap<String, String>,
) -> Result<Probed, IdentityError> {
    let cwd = cwd.to_path_buf();
    // 1–3: an external workload SDS socket?
    let external = cwd
        .join(WORKLOAD_SPIFFE_UDS_DIR)
        .join(&id.workload_identity_socket_file);
    let serve_only_files = external_socket_healthy(&external)?;
    if !serve_only_files && id.workload_identity_socket_file != "socket" {
        return Err(IdentityError::NoExternalSocket(external));
    }

    // 4–5: file-mounted?
    let creds = crate::fsio::under(&cwd, WORKLOAD_SPIFFE_CREDENTIALS_DIR);
    let (creds_chain, creds_key, creds_root) = (
        creds.join("cert-chain.pem"),
        creds.join("key.pem"),
        creds.join("root-cert.pem"),
    );
    let etc = crate::fsio::under(&cwd, ETC_CERTS_DIR);
    let meta_path = |k: &str, default: PathBuf| {
        meta.get(k)
            .filter(|v| !v.is_empty())
            .map_or(default, |v| crate::fsio::under(&cwd, v))
    };
    let mut aliases = Aliases::default();
    let mode = if serve_only_files {
        IdentityMode::ExternalSds
    } else if creds_chain.exists() && creds_key.exists() && creds_root.exists() {
        aliases.workload = Some(file_cert_name(&creds_chain, &creds_key));
        aliases.root = Some(file_root_name(&creds_root));
        IdentityMode::FileMounted
    } else if id.file_mounted_certs {
        let chain = meta_path(
            "ISTIO_META_TLS_CLIENT_CERT_CHAIN",
            etc.join("cert-chain.pem"),
        );
        let key = meta_path("ISTIO_META_TLS_CLIENT_KEY", etc.join("key.pem"));
        let root = meta_path("ISTIO_META_TLS_CLIENT_ROOT_CERT", etc.join("root-cert.pem"));
        aliases.workload = Some(file_cert_name(&chain, &key));
        aliases.root = Some(file_root_name(&root));
        IdentityMode::FileMounted
    } else {
        // ./etc/certs still wins for default/ROOTCA, except when we export there ourselves.
        let exporting_there = id.output_certs.as_ref().is_some_and(|o| {
            std::fs::canonicalize(crate::fsio::under(&cwd, o)).ok()
                == std::fs::canonicalize(&etc).ok()
        });
        if !exporting_there {
            let (chain, key, root) = (
                etc.join("cert-chain.pem"),
                etc.join("key.pem"),
                etc.join("root-cert.pem"),
            );
            if non_empty(&chain) && non_empty(&key) {
                aliases.workload = Some(file_cert_name(&chain, &key));
            }
            if non_empty(&root) {
                aliases.root = Some(file_root_name(&root));
            }
        }
        IdentityMode::Ca
    };
    Ok(Probed {
        mode,
        aliases,
        serve_only_files,
        external,
    })
}

/// Dials the external socket like Istio's `checkSocket` (1 s); healthy = accepts connections.
#[allow(
    clippy::disallowed_methods,
    reason = "called by probe_mode, on the blocking pool"
)]
fn external_socket_healthy(path: &Path) -> Result<bool, IdentityError> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(false);
    };
    if meta.is_file() {
        return Ok(false);
    }
    if crate::uds::accepts_connections(path) {
        return Ok(true);
    }
    tracing::warn!(path = %path.display(), "removing unhealthy SDS socket");
    std::fs::remove_file(path).map_err(|source| IdentityError::RemoveSocket {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(false)
}

#[allow(
    clippy::disallowed_methods,
    reason = "called by probe_mode, on the blocking pool"
)]
fn non_empty(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.len() > 0)
}

fn file_cert_name(chain: &Path, key: &Path) -> String {
    format!(
        "{}{}~{}",
        store::FILE_CERT_PREFIX,
        chain.display(),
        key.display()
    )
}

fn file_root_name(root: &Path) -> String {
    format!("{}{}", store::FILE_ROOT_PREFIX, root.display())
}

/// [`start`] with explicit [`Options`].
pub async fn start_with(
    cfg: &Config,
    cwd: &Path,
    registry: &Registry,
    shutdown: CancellationToken,
    opts: Options,
) -> Result<IdentityHandle, IdentityError> {
    let id = &cfg.identity;
    let metrics = metrics::Metrics::register(registry)?;
    let cwd = if cwd.is_absolute() {
        cwd.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(cwd))
            .unwrap_or_else(|_| cwd.to_path_buf())
    };

    // Which mode: stats and a connect of the pod's mounted paths, on the blocking pool (the
    // status port is already served).
    let probed = {
        let (id, cwd, meta) = (
            id.clone(),
            cwd.clone(),
            cfg.proxy_config.proxy_metadata.clone(),
        );
        tokio::task::spawn_blocking(move || probe_mode(&id, &cwd, &meta))
            .await
            .map_err(|e| IdentityError::Probe(e.to_string()))??
    };
    let Probed {
        mode,
        aliases,
        serve_only_files,
        external,
    } = probed;
    tracing::info!(?mode, "identity mode");

    // Validate everything before starting any task, so an error leaves nothing running.
    let ca_parts = if mode == IdentityMode::Ca {
        if id.ca_provider != "Citadel" {
            return Err(IdentityError::CaProvider(id.ca_provider.clone()));
        }
        if cfg.pod.namespace.is_empty() || cfg.pod.service_account.is_empty() {
            // Istio carries on: the CA takes the identity from the token, not the CSR SAN.
            tracing::warn!(
                namespace = %cfg.pod.namespace,
                service_account = %cfg.pod.service_account,
                "POD_NAMESPACE or SERVICE_ACCOUNT is empty; the CSR's SPIFFE SAN will be incomplete (the CA uses the token's identity)"
            );
        }
        // An unsupported ECC_SIGNATURE_ALGORITHM is not a start error: like Istio, every
        // key generation fails with it (logged, retried, readiness names it).
        let key_spec = match keys::KeySpec::from_config(id) {
            Err(e @ keys::KeyError::EcAlgorithm(_)) => Err(e),
            other => Ok(other?),
        };
        Some((key_spec, crate::control_plane::ca_target(cfg)?))
    } else {
        None
    };
    let socket = crate::fsio::under(
        &cwd,
        if serve_only_files {
            crate::identity::sds::FILES_SOCKET
        } else {
            crate::identity::sds::WORKLOAD_SOCKET
        },
    );
    let listener = if opts.sds_server {
        Some(crate::identity::sds::bind(&socket).await?)
    } else {
        None
    };

    let ca_addr = (mode == IdentityMode::Ca).then(|| id.ca_addr.clone());
    let external_sds = serve_only_files.then(|| external.clone());
    let output_certs = id
        .output_certs
        .as_ref()
        .map(|d| crate::fsio::under(&cwd, d));
    let (store, file_requests) = SecretStore::new(aliases);
    let (status_tx, status_rx) = watch::channel(IdentityStatus {
        not_ready: (mode == IdentityMode::Ca)
            .then(|| "waiting for the first workload certificate".to_owned()),
        ..Default::default()
    });
    let (anchors_tx, anchors_rx) = watch::channel(Vec::new());
    let mut tasks = Vec::new();

    let crl = (id.pilot_enable_ca_crl).then(|| PathBuf::from(files::CRL_PATH));
    let file_task = files::FileSecrets {
        store: store.clone(),
        requests: file_requests,
        cwd: cwd.clone(),
        debounce: id.file_debounce_duration,
        load_wait: opts.file_load_wait,
        crl,
        metrics: metrics.clone(),
    };
    tasks.push(tokio::spawn(tracing::Instrument::instrument(
        crate::tasks::guarded("file-secrets", file_task.run(shutdown.clone())),
        tracing::info_span!("task", task = "file-secrets"),
    )));

    if let Some((key_spec, target)) = ca_parts {
        let token = TokenSource::new(id.jwt_path.as_ref().map(|p| crate::fsio::under(&cwd, p)));
        let md = CallMetadata::new(&id.cluster_id, &id.ca_headers, token);
        let ca =
            caclient::IstioCaClient::new(target, &cwd, md, id.cert_signer.clone(), metrics.clone());
        let mgr = manager::SecretManager {
            ca: Arc::new(ca),
            key_spec,
            spiffe_id: format!(
                "spiffe://{}/ns/{}/sa/{}",
                id.trust_domain, cfg.pod.namespace, cfg.pod.service_account
            ),
            ttl: id.secret_ttl,
            grace_ratio: id.secret_grace_period_ratio,
            grace_jitter: id.secret_grace_period_ratio_jitter,
            store: store.clone(),
            status: status_tx,
            anchors: anchors_rx,
            output: id.output_certs.as_ref().map(|d| {
                output::OutputCerts::new(
                    crate::fsio::under(&cwd, d),
                    !cfg.pod.kubernetes_service_host.is_empty(),
                )
            }),
            metrics: metrics.clone(),
            clock: opts.clock,
            backoff: opts.backoff,
            crl: id
                .pilot_enable_ca_crl
                .then(|| PathBuf::from(files::CRL_PATH)),
            keys: manager::KeySource::Background,
            output_gates_readiness: !opts.sds_server,
        };
        tasks.push(tokio::spawn(tracing::Instrument::instrument(
            crate::tasks::guarded("secret-manager", mgr.run(shutdown.clone())),
            tracing::info_span!("task", task = "secret-manager"),
        )));
    }

    let Some(listener) = listener else {
        tracing::info!("no SDS server (DISABLE_ENVOY); certificates go to OUTPUT_CERTS only");
        return Ok(IdentityHandle {
            status: status_rx,
            anchors: anchors_tx,
            socket,
            mode,
            store,
            tasks,
            ca_addr,
            external_sds,
            output_certs,
            cwd: cwd.clone(),
        });
    };
    tracing::info!(socket = %socket.display(), "SDS server listening");
    let sds_store = store.clone();
    let sds_shutdown = shutdown.clone();
    let sds_socket = socket.clone();
    // The first run serves the listener bound above (a bind failure is a startup error);
    // restarts bind again.
    let mut first = Some(listener);
    tasks.push(tokio::spawn(tracing::Instrument::instrument(
        crate::tasks::guarded(
            "sds-server",
            crate::supervise::run(
                "sds",
                opts.servers.clone(),
                crate::supervise::Backoff::default(),
                shutdown.clone(),
                move || {
                    let (store, stop, path) =
                        (sds_store.clone(), sds_shutdown.clone(), sds_socket.clone());
                    let listener = first.take();
                    async move {
                        let listener = match listener {
                            Some(l) => l,
                            None => crate::identity::sds::bind(&path)
                                .await
                                .map_err(|e| e.to_string())?,
                        };
                        Ok(crate::supervise::Serving {
                            serve: Box::pin(async move {
                                crate::identity::sds::serve(listener, store, stop)
                                    .await
                                    .map_err(|e| e.to_string())
                            }),
                            socket: Some(path),
                        })
                    }
                },
            ),
        ),
        tracing::info_span!("task", task = "sds"),
    )));

    Ok(IdentityHandle {
        status: status_rx,
        anchors: anchors_tx,
        socket,
        mode,
        store,
        tasks,
        ca_addr,
        external_sds,
        output_certs,
        cwd,
    })
}
