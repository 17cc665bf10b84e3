//! The xDS proxy (Istio: `pkg/istio-agent/xds_proxy.go`, `xds_proxy_delta.go`): Envoy's ADS stream, SotW or Delta, from the unix socket
//! `<configPath>/XDS` to the control plane, with NDS, PCDS, health and ECDS interception.
//!
//! # Wiring
//!
//! ```ignore
//! let xds = meshagent::xds::start(&cfg, cwd, &registry, shutdown.clone())?;
//! let names = xds.name_table();        // watch: the NDS table, for the DNS proxy
//! let roots = xds.pcds_bundle();       // watch: PCDS caCertificatesPem, for ROOTCA
//! xds.set_health(Health::Healthy);     // VM health reports (ProxyConfig.readinessProbe)
//! xds.wait().await;                    // after `shutdown` is cancelled
//! ```
//!
//! [`start`] must be called inside a Tokio runtime. It binds the socket before returning, so
//! Envoy may be started right after. `cwd` is the agent's working directory: the socket path
//! and every relative file (roots, token) resolve against it, never against the process cwd.
//!
//! # Design
//!
//! * **Pass-through** ([`codec::RawCodec`]): messages travel as bytes; the proxy peeks at
//!   type URL, nonce and version on the wire ([`wire`]) and decodes only the types it owns.
//!   Responses to Envoy are framed by hand ([`codec::ResponseBody`]) so a forwarded message is
//!   never copied: peak memory of a push is about one message, not two.
//! * **One owner task per stream pair** ([`stream`]), a new upstream stream per downstream
//!   stream (istio#27877 was about leaking them, which per-pair ownership prevents), and **any
//!   number of live pairs**: Istio keeps one and closes the previous ("registered overlapping
//!   stream", `xds_proxy.go` `registerStream`), which breaks proxyless gRPC with one xDS client
//!   per target (istio#53532). Live pairs of one downstream connection share an upstream
//!   connection, pairs of different clients never do ([`stream::Upstream`]: HTTP/2 flow
//!   control is per connection); interceptors (NDS, PCDS, health, ECDS) run per pair.
//! * **Interception** through [`intercept::Interceptor`], asynchronous (a pending rewrite
//!   holds back only later responses of its own type): NDS (when the DNS proxy is on), PCDS
//!   (`PROXY_CONFIG_XDS_AGENT`), health replay, and ECDS via [`intercept::EcdsRewrite`]
//!   ([`intercept::PassThrough`] by default; the Wasm module supplies its own through
//!   [`XdsOptions::ecds`]).
//! * **No agent-side limits** on message sizes beyond gRPC framing (4 GiB, istio#52815);
//!   memory per pair is the response being written, a byte-bounded response queue
//!   ([`stream::MAX_QUEUED`]) and a bounded request queue. A client that stops reading is cut
//!   off after [`stream::STALL`] with its queue full (Istio has no push timeout, PR #31167,
//!   but its one connection per stream cannot starve others; shared connections can).
//! * Not served: gRPC server reflection on the socket (Istio registers it; nothing in the
//!   data path uses it).

pub mod authority;
pub mod codec;
pub mod intercept;
pub(crate) mod reader;
pub mod rejections;
pub mod stream;
pub mod view;
pub mod wire;

use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::dns::LookupTable;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;

pub use intercept::{Api, EcdsRewrite, Health, PassThrough};

use crate::config::Config;
use crate::control_plane::{self, CallMetadata, DialError, Keepalive, Target, TokenSource};
use crate::metrics::{Counter, CounterVec, Gauge, MetricsError, Registry};
use crate::supervise;

/// The socket's file name inside `configPath`.
pub const SOCKET_NAME: &str = "XDS";

/// The default largest request the downstream server accepts from Envoy:
/// `ISTIO_GPRC_MAXRECVMSGSIZE`'s default, 4 MiB (`pilot/pkg/features/tuning.go`), which Istio's
/// agent applies to its Envoy-facing gRPC server (`pilot/pkg/grpc/grpc.go` `ServerOptions`, used
/// by `pkg/istio-agent/xds_proxy.go`). Responses from istiod are not limited (Istio sets
/// `MaxCallRecvMsgSize(math.MaxInt32)` upstream; istio#52815). A bound matters here beyond
/// parity: the socket is reachable by any local process and gRPC decoding reserves the declared
/// length up front, so without one a 5-byte prefix made the agent allocate 4 GiB (found by the
/// `xds_framing` fuzz target).
pub const DEFAULT_MAX_RECV_MSG_SIZE: usize = 4 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum XdsError {
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error("xDS upstream: {0}")]
    Upstream(#[from] DialError),
    #[error("cannot create the xDS socket directory {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the xDS socket {path} is in use by a live process (another agent with this working directory and configPath?); stop that agent, or give this one another working directory"
    )]
    InUse { path: PathBuf },
    #[error("cannot listen on the xDS socket {path}: {source}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The proxy's metrics, Istio's names (Istio: `pkg/istio-agent/metrics/metrics.go`).
#[derive(Clone)]
pub struct Metrics {
    pub requests: Counter,
    pub responses: Counter,
    pub istiod_connection_failures: Counter,
    pub istiod_connection_terminations: CounterVec<1>,
    pub envoy_connection_terminations: CounterVec<1>,
    /// `pilot_xds_recv_max`: Istio's gauge of the largest message received on the socket.
    pub downstream_max: Gauge,
    /// Largest response received from the control plane (no Istio equivalent).
    pub upstream_max: Gauge,
    /// Bytes of responses received from the control plane. Not exported (Istio has no such
    /// metric); the benchmark reports CPU per MB from it.
    pub response_bytes: Counter,
    /// Downstream clients cut off for not reading ([`stream::STALL`]; no Istio equivalent).
    pub downstream_stalled: Counter,
}

impl Metrics {
    pub fn new(r: &Registry) -> Result<Metrics, MetricsError> {
        let istiod_terminations = r.counter_vec(
            "istiod_connection_terminations",
            "The total number of connection errors to Istiod",
            &["type"],
        )?;
        let envoy_terminations = r.counter_vec(
            "envoy_connection_terminations",
            "The total number of connection errors from envoy",
            &["type"],
        )?;
        // Pre-create the children so both series exist from the start, as in Istio.
        for t in ["cancelled", "error"] {
            istiod_terminations.with(&[t]);
            envoy_terminations.with(&[t]);
        }
        Ok(Metrics {
            requests: r.counter(
                "xds_proxy_requests",
                "The total number of Xds Proxy Requests",
            )?,
            responses: r.counter(
                "xds_proxy_responses",
                "The total number of Xds Proxy Responses",
            )?,
            istiod_connection_failures: r.counter(
                "istiod_connection_failures",
                "The total number of connection failures to Istiod",
            )?,
            istiod_connection_terminations: istiod_terminations,
            envoy_connection_terminations: envoy_terminations,
            downstream_max: r.gauge(
                "pilot_xds_recv_max",
                "The maximum size request we have received so far.",
            )?,
            upstream_max: r.gauge(
                "xds_proxy_upstream_recv_max",
                "Largest message received from the control plane, in bytes.",
            )?,
            response_bytes: Counter::default(),
            downstream_stalled: r.counter(
                "xds_proxy_downstream_stalled",
                "Downstream xDS clients whose connection was closed because they read no response for 10s with the agent's queue for them full.",
            )?,
        })
    }
}

/// What the proxy does, derived from [`Config`] by [`XdsOptions::from_config`]; tests and
/// later features adjust it before [`start_with`].
#[derive(Clone)]
pub struct XdsOptions {
    /// Where the socket goes: `<cwd>/<configPath>/XDS`.
    pub socket: PathBuf,
    pub target: Target,
    pub keepalive: Keepalive,
    pub metadata: CallMetadata,
    pub max_streams: u32,
    /// Largest request accepted from a downstream client (`ISTIO_GPRC_MAXRECVMSGSIZE`); a
    /// larger one ends its stream with `ResourceExhausted`, as Istio's agent does.
    pub max_recv_msg_size: usize,
    /// Intercept NDS (the DNS proxy is on).
    pub nds: bool,
    /// The proxy's namespace and domain, for building the NDS lookup table.
    pub nds_scope: crate::dns::Scope,
    /// Intercept PCDS (`PROXY_CONFIG_XDS_AGENT`).
    pub pcds: bool,
    /// The ECDS rewrite hook.
    pub ecds: Arc<dyn EcdsRewrite>,
    /// More interceptors (later modules, tests); consulted before the built-in ones, so one
    /// of these owns its type URL.
    pub interceptors: Vec<Arc<dyn intercept::Interceptor>>,
    /// Where the server's supervisor reports it down (readiness).
    pub servers: crate::supervise::Servers,
}

impl XdsOptions {
    pub fn from_config(cfg: &Config, cwd: &Path) -> Result<XdsOptions, XdsError> {
        let target = control_plane::xds_target(cfg, cwd)?;
        let token = TokenSource::new(
            cfg.identity
                .jwt_path
                .as_ref()
                .map(|p| crate::fsio::under(cwd, p)),
        );
        Ok(XdsOptions {
            socket: crate::fsio::under(cwd, &cfg.proxy_config.config_path).join(SOCKET_NAME),
            target,
            keepalive: Keepalive {
                interval: cfg.xds.keepalive_interval,
                timeout: cfg.xds.keepalive_timeout,
            },
            metadata: CallMetadata::new(&cfg.identity.cluster_id, &cfg.xds.headers, token),
            max_streams: cfg.xds.max_streams,
            max_recv_msg_size: cfg.xds.max_recv_msg_size as usize,
            // NDS is subscribed exactly when the DNS proxy runs.
            nds: crate::dns::enabled(cfg),
            nds_scope: crate::dns::Scope::from_config(cfg),
            pcds: cfg.xds.proxy_config_xds_agent,
            ecds: Arc::new(PassThrough),
            interceptors: Vec::new(),
            servers: crate::supervise::Servers::new(),
        })
    }
}

/// How long a pre-dialled connection waits for Envoy's first stream before it is closed
/// (Envoy connects within a second of starting; an idle client is noise at istiod).
const WARM_TTL: Duration = Duration::from_secs(30);

/// Dials istiod now, while Envoy is still initialising, so Envoy's first ADS stream finds a
/// connection with TCP, TLS and HTTP/2 done (about 6 ms of the sidecar's start-up on
/// loopback, more across a cluster; docs/benchmarks-log.md). Istio dials only when Envoy connects.
/// Only the first stream uses it; later streams dial their own connection, as Istio does.
fn prewarm(shared: &Arc<stream::Shared>, shutdown: CancellationToken) {
    let (target, cwd, keepalive) = (shared.target.clone(), shared.cwd.clone(), shared.keepalive);
    let dial = tokio::spawn(tracing::Instrument::instrument(
        async move { control_plane::connect(&target, &cwd, keepalive).await },
        tracing::info_span!("task", task = "xds-predial"),
    ));
    *shared.warm.lock().unwrap_or_else(|e| e.into_inner()) = Some(dial);
    let shared = shared.clone();
    let expire = async move {
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(WARM_TTL) => {}
        }
        if let Some(dial) = shared.take_warm() {
            tracing::debug!("closing the unused pre-dialled connection to the XDS server");
            dial.abort();
        }
    };
    tokio::spawn(tracing::Instrument::instrument(
        expire,
        tracing::info_span!("task", task = "xds-predial-expiry"),
    ));
}

/// The running proxy.
pub struct XdsProxyHandle {
    socket: PathBuf,
    name_table: watch::Receiver<Option<Arc<LookupTable>>>,
    pcds_bundle: watch::Receiver<Vec<String>>,
    health: watch::Sender<Option<Health>>,
    metrics: Metrics,
    task: tokio::task::JoinHandle<()>,
    view: XdszSource,
}

/// What `/debug/xdsz` reads (see [`view`]).
#[derive(Clone)]
pub struct XdszSource {
    view: Arc<view::XdsView>,
    address: String,
    shared: std::sync::Weak<stream::Shared>,
}

impl XdszSource {
    pub fn to_json(&self) -> serde_json::Value {
        let connections = self
            .shared
            .upgrade()
            .map_or(0, |s| s.upstream.connections());
        self.view.to_json(&self.address, connections)
    }

    /// The types Envoy rejects now (its last answer a NACK).
    pub fn rejections(&self) -> Vec<rejections::Rejection> {
        self.view.rejections.current()
    }

    /// Every extension Envoy's NACKs have named as missing since start.
    pub fn missing_extensions(&self) -> watch::Receiver<Vec<rejections::MissingExtension>> {
        self.view.rejections.missing()
    }
}

impl XdsProxyHandle {
    /// The unix socket Envoy's `xds-grpc` cluster points at.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The latest NDS name table (`None` until the first one arrives).
    pub fn name_table(&self) -> watch::Receiver<Option<Arc<LookupTable>>> {
        self.name_table.clone()
    }

    /// PCDS `caCertificatesPem` entries (empty until PCDS delivers some).
    pub fn pcds_bundle(&self) -> watch::Receiver<Vec<String>> {
        self.pcds_bundle.clone()
    }

    /// Reports workload health to the control plane: sent at once if a stream is past its
    /// first LDS request, and replayed on every new stream. Repeating a state sends nothing.
    pub fn set_health(&self, h: Health) {
        self.health.send_if_modified(|cur| {
            if cur.as_ref() == Some(&h) {
                return false;
            }
            *cur = Some(h);
            true
        });
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The per-stream bookkeeping behind `/debug/xdsz`.
    pub fn xdsz(&self) -> XdszSource {
        self.view.clone()
    }

    /// Waits until the server has stopped (after the shutdown token is cancelled).
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Starts the proxy from the agent's configuration.
pub fn start(
    cfg: &Config,
    cwd: &Path,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<XdsProxyHandle, XdsError> {
    start_with(XdsOptions::from_config(cfg, cwd)?, cwd, registry, shutdown)
}

/// Starts the proxy with explicit options.
pub fn start_with(
    opts: XdsOptions,
    cwd: &Path,
    registry: &Registry,
    shutdown: CancellationToken,
) -> Result<XdsProxyHandle, XdsError> {
    let listener = bind(&opts.socket)?;
    let metrics = Metrics::new(registry)?;
    let (table_tx, name_table) = watch::channel(None);
    let (bundle_tx, pcds_bundle) = watch::channel(Vec::new());
    let (health, health_rx) = watch::channel(None);

    let mut interceptors: Vec<Arc<dyn intercept::Interceptor>> = opts.interceptors.clone();
    if opts.nds {
        interceptors.push(Arc::new(intercept::Nds {
            table: table_tx,
            scope: opts.nds_scope.clone(),
        }));
    }
    if opts.pcds {
        interceptors.push(Arc::new(intercept::Pcds { bundle: bundle_tx }));
    }
    interceptors.push(Arc::new(intercept::HealthReplay(health_rx.clone())));
    interceptors.push(Arc::new(intercept::Ecds(opts.ecds.clone())));

    let shared = Arc::new(stream::Shared {
        upstream: stream::Upstream::default(),
        warm: std::sync::Mutex::default(),
        target: opts.target.clone(),
        cwd: cwd.to_path_buf(),
        keepalive: opts.keepalive,
        metadata: opts.metadata.clone(),
        interceptors,
        health: health_rx,
        metrics: metrics.clone(),
        view: Arc::default(),
    });
    let view = shared.view.clone();
    let view_addr = opts.target.addr.clone();
    let view_shared = Arc::downgrade(&shared);
    prewarm(&shared, shutdown.clone());
    let service = AdsServer {
        shared,
        shutdown: shutdown.clone(),
        ids: Arc::default(),
        max_recv: opts.max_recv_msg_size,
    };
    let socket = opts.socket.clone();
    tracing::info!(socket = %socket.display(), upstream = %opts.target.addr, tls = opts.target.tls.is_some(), nds = opts.nds, pcds = opts.pcds, "xDS proxy listening");
    // The first run serves the listener bound above (a bind failure is a startup error);
    // restarts bind again.
    let mut first = Some(listener);
    let (keepalive, max_streams) = (opts.keepalive, opts.max_streams);
    let stop = shutdown.clone();
    let task = tokio::spawn(tracing::Instrument::instrument(
        crate::tasks::guarded(
            "xds-proxy-server",
            supervise::run(
                "xds-proxy",
                opts.servers.clone(),
                supervise::Backoff::default(),
                shutdown,
                move || {
                    let listener = first.take();
                    let (service, stop, path) = (service.clone(), stop.clone(), socket.clone());
                    async move {
                        let listener = match listener {
                            Some(l) => l,
                            None => {
                                let p = path.clone();
                                tokio::task::spawn_blocking(move || bind(&p))
                                    .await
                                    .map_err(|e| e.to_string())?
                                    .map_err(|e| e.to_string())?
                            }
                        };
                        let server = tonic::transport::Server::builder()
                            .http2_keepalive_interval(Some(keepalive.interval))
                            .http2_keepalive_timeout(Some(keepalive.timeout))
                            .max_concurrent_streams(Some(max_streams))
                            .add_service(service);
                        Ok(supervise::Serving {
                            serve: Box::pin(async move {
                                // gRPC clients' percent-encoded `:authority` made acceptable
                                // (see `authority`).
                                let incoming = tokio_stream::StreamExt::map(
                                    UnixListenerStream::new(listener),
                                    |r| r.map(authority::AuthorityFix::new),
                                );
                                server
                                    .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
                                    .await
                                    .map_err(|e| e.to_string())
                            }),
                            socket: Some(path),
                        })
                    }
                },
            ),
        ),
        tracing::info_span!("task", task = "xds-proxy"),
    ));
    Ok(XdsProxyHandle {
        socket: opts.socket,
        name_table,
        pcds_bundle,
        health,
        metrics,
        task,
        view: XdszSource {
            view,
            address: view_addr,
            shared: view_shared,
        },
    })
}

/// Creates the directory (0750), removes a stale socket, binds, and opens the socket to every
/// local user (0666) as Istio does: Envoy may run as another uid; file permissions of the
/// directory are the only access control (as in Istio's `pkg/istio-agent/xds_proxy.go`).
///
/// A socket that still accepts connections belongs to a live process (a second agent started
/// in the same working directory) and is left alone: taking it over made both agents'
/// supervisors rebind in turn forever, each seeing its socket replaced, with readiness
/// flapping on both. At startup that is an error ([`XdsError::InUse`], the agent exits); for
/// a supervisor restart it keeps the server down (and the agent unready) with that reason
/// rather than stealing the socket back.
#[allow(
    clippy::disallowed_methods,
    reason = "the first bind at start; rebinds run it on the blocking pool"
)]
fn bind(path: &Path) -> Result<tokio::net::UnixListener, XdsError> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(dir)
            .map_err(|source| XdsError::Dir {
                path: dir.to_path_buf(),
                source,
            })?;
    }
    if crate::uds::accepts_connections(path) {
        return Err(XdsError::InUse {
            path: path.to_path_buf(),
        });
    }
    // Relative to the working directory, as Istio binds it (SUN_LEN: see `uds::bind_path`).
    crate::uds::bind_once(path, "xDS").map_err(|source| XdsError::Listen {
        path: path.to_path_buf(),
        source,
    })
}

// === the ADS service over raw bytes ===

/// `envoy.service.discovery.v3.AggregatedDiscoveryService` with [`codec::RawCodec`]; written by
/// hand because generated servers are tied to the prost codec.
#[derive(Clone)]
struct AdsServer {
    shared: Arc<stream::Shared>,
    shutdown: CancellationToken,
    /// Numbers the stream pairs (log spans).
    ids: Arc<std::sync::atomic::AtomicU64>,
    /// [`XdsOptions::max_recv_msg_size`].
    max_recv: usize,
}

impl NamedService for AdsServer {
    const NAME: &'static str = "envoy.service.discovery.v3.AggregatedDiscoveryService";
}

impl tower::Service<http::Request<Body>> for AdsServer {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let api = match req.uri().path() {
            stream::SOTW_PATH => Api::Sotw,
            stream::DELTA_PATH => Api::Delta,
            _ => {
                return std::future::ready(Ok(Status::unimplemented(
                    "only ADS is served on this socket",
                )
                .into_http()));
            }
        };
        std::future::ready(Ok(self.open(api, req)))
    }
}

impl AdsServer {
    /// Starts the owner task of a new stream pair and answers with its response body.
    fn open(&self, api: Api, req: http::Request<Body>) -> http::Response<Body> {
        let conn = match req.extensions().get::<authority::ConnInfo>() {
            Some(c) => stream::Downstream {
                conn: c.id,
                cut: c.cut.clone(),
            },
            // Not served through `AuthorityFix` (never in the agent): a connection of its own.
            None => stream::Downstream {
                conn: authority::next_conn_id(),
                cut: CancellationToken::new(),
            },
        };
        // Envoy does not compress ADS; a compressed request would fail decoding below with a
        // clear status rather than being silently misread. Each request is read into a
        // buffer of its own length, not tonic's stream buffer (see `reader.rs`).
        let downstream = reader::MessageReader::request(req.into_body(), self.max_recv);
        let stop = self.shutdown.child_token();
        let id = self
            .ids
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .wrapping_add(1);
        // The hand-over slot toward the client (Istio's `pkg/istio-agent/xds_proxy.go` keeps one too); the pair queues the rest.
        let (tx, rx) = mpsc::channel(1);
        let span = tracing::info_span!("xds_stream", id, api = ?api);
        tokio::spawn(tracing::Instrument::instrument(
            stream::run(self.shared.clone(), api, id, conn, downstream, tx, stop),
            span,
        ));
        let mut resp = http::Response::new(Body::new(codec::ResponseBody::new(rx)));
        resp.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        resp
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::disallowed_methods,
        reason = "test code, not on the agent's runtime"
    )]
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn socket_dir_created_stale_socket_replaced_mode_0666() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("etc/istio/proxy/XDS");
        let first = bind(&path).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o666);
        assert_eq!(mode(path.parent().unwrap()) & 0o750, 0o750);
        // A live socket (another agent's) is left alone, with an error naming it.
        let e = bind(&path).expect_err("a live socket is not taken over");
        assert!(matches!(e, XdsError::InUse { .. }), "{e}");
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        // A socket left behind by a previous agent that is gone is replaced.
        drop(first);
        let _second = bind(&path).unwrap();
        assert!(tokio::net::UnixStream::connect(&path).await.is_ok());
    }

    #[test]
    fn options_follow_config() {
        let dir = tempfile::tempdir().unwrap();
        let env = crate::config::MapEnv::from_pairs([
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("PROXY_CONFIG_XDS_AGENT", "true"),
            ("XDS_ROOT_CA", "/roots.pem"),
        ]);
        let cfg =
            crate::config::load(&crate::config::ProxyFlags::default(), &env, dir.path()).unwrap();
        let o = XdsOptions::from_config(&cfg, dir.path()).unwrap();
        assert_eq!(o.socket, dir.path().join("./etc/istio/proxy").join("XDS"));
        assert_eq!(o.target.addr, "istiod.istio-system.svc:15012");
        assert!(o.nds && o.pcds);
        let cfg = crate::config::load(
            &crate::config::ProxyFlags::default(),
            &crate::config::MapEnv::from_pairs([("XDS_ROOT_CA", "/roots.pem")]),
            dir.path(),
        )
        .unwrap();
        let o = XdsOptions::from_config(&cfg, dir.path()).unwrap();
        assert!(!o.nds && !o.pcds);
    }
}
