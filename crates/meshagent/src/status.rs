//! The agent's status server on `statusPort` (15020), as Istio's `pilot/cmd/pilot-agent/status/server.go`.
//!
//! | path | access | module |
//! |---|---|---|
//! | `/healthz/ready` | any | [`ready`]: Envoy, gRPC bootstrap and DNS-table probes in Istio's order |
//! | `/stats/prometheus`, `/metrics` | any, or loopback with `METRICS_LOCALHOST_ACCESS_ONLY` | [`merge`]: streamed agent + Envoy + app merge |
//! | `/app-health/<c>/<kind>`, `/app-lifecycle/<c>/<kind>` | any | [`probes`]: rewritten kubelet probes and hooks |
//! | `POST /quitquitquit`, `POST /drain` | loopback | shutdown without drain; drain listeners now |
//! | `GET /drain/status` | loopback | shutdown phase, elapsed, deadline, active connections per listener, last drain admin error (JSON) |
//! | `/debug/ndsz` | loopback | the DNS name table as JSON, 404 `{}` until one arrived |
//! | `/debug/config_dump` | loopback, `--profiling` | the effective agent configuration as JSON |
//! | `/debug/certz` | loopback | every served secret: state, identity, validity, source ([`views`]) |
//! | `/debug/xdsz` | loopback | per xDS client and type: sent version/nonce, ACK/NACK ([`views`]) |
//! | `/debug/dnsz[?name=…&type=…[&forward=true]]` | loopback | how the DNS proxy answers a name; table size, upstreams and their counters ([`crate::dns::view`]) |
//! | `/debug/wasmz` | loopback | every Wasm module: URL, cache file, sha256, last fetch and its error, ECDS users, fail strategy ([`crate::wasm::view`]) |
//! | `GET /logging`, `POST /logging?level=…` / `?reset` | loopback | scope levels, changed at run time |
//! | `/debug/logs[?lines=N]` | loopback | the agent's last log lines as written ([`crate::logging::RECENT`]) |
//! | `GET /` | loopback | an HTML status page (identity, xDS, DNS, readiness) |
//! | `/debug/pprof/`, `/debug/tokioz` | loopback, `--profiling` | what is served; the Tokio runtime's metrics ([`profile`]) |
//! | `/debug/pprof/profile?seconds=N` | loopback, `--profiling` and `MESHAGENT_PROFILING=true` | a CPU profile, gzipped profile.proto ([`profile`]) |
//!
//! Of Go's `/debug/pprof/*` only the CPU profile has a counterpart (heap, goroutine, trace
//! profiles are Go runtime features); with `--profiling` (default on) the loopback-only
//! `/debug/config_dump` and `/debug/tokioz` are the other "what is this process doing" views.
//! Every response is gzip- or zstd-compressed when the client accepts it, as Istio wraps its
//! mux in klauspost/compress `gzhttp` ([`compress`]).

pub mod compress;
pub mod conns;
pub mod lines;
pub mod merge;
pub mod probes;
pub mod profile;
pub mod proto;
pub mod ready;
pub mod sampler;
pub mod views;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use tokio_util::sync::CancellationToken;

use crate::config::ProxyType;
use crate::envoy::{DrainState, admin};
use crate::metrics::Registry;

pub use merge::{MergeMetrics, Merger};
pub use probes::AppProbes;
pub use ready::{EnvoyProbe, Probe, Readiness};

pub use crate::dns::{NameTable, NameTableWatch};

/// What the status server needs.
#[derive(Clone)]
pub struct StatusState {
    pub readiness: Readiness,
    pub registry: Registry,
    pub drain: Arc<DrainState>,
    /// Cancelled by `/quitquitquit` (and by SIGTERM elsewhere).
    pub shutdown: CancellationToken,
    /// Envoy admin, for `/drain`; `None` without Envoy.
    pub envoy_admin: Option<SocketAddr>,
    pub proxy_type: ProxyType,
    /// Merged metrics (agent, Envoy, application targets).
    pub merger: Merger,
    /// Rewritten application probes from `ISTIO_KUBE_APP_PROBERS`.
    pub probes: AppProbes,
    /// `METRICS_LOCALHOST_ACCESS_ONLY`.
    pub metrics_localhost_only: bool,
    /// The DNS table for `/debug/ndsz`; `None` when no DNS proxy runs.
    pub name_table: Option<NameTableWatch>,
    /// `/debug/config_dump` body; `None` disables it (`--profiling=false`).
    pub config_dump: Option<Arc<serde_json::Value>>,
    /// Sources of `/debug/certz`, `/debug/xdsz` and the page, set as subsystems start.
    pub views: views::Views,
    /// `/debug/pprof/*` and `/debug/tokioz`: off in [`StatusState::new`].
    pub profiling: profile::Profiling,
}

impl StatusState {
    /// A sidecar's state with only metrics wired: default readiness, no Envoy admin, no
    /// application probes (the port they would be rewritten to is 15020), no DNS table, no
    /// config dump, empty debug views. Callers set the rest with struct update syntax; the
    /// agent itself sets every field (`app.rs`).
    pub fn new(registry: Registry, merger: Merger) -> Result<Self, rustls::Error> {
        Ok(StatusState {
            readiness: Readiness::default(),
            registry,
            drain: Arc::default(),
            shutdown: CancellationToken::new(),
            envoy_admin: None,
            proxy_type: ProxyType::Sidecar,
            merger,
            probes: AppProbes::new(
                Default::default(),
                IpAddr::from([127, 0, 0, 1]),
                15020,
                true,
            )?,
            metrics_localhost_only: false,
            name_table: None,
            config_dump: None,
            views: views::Views::default(),
            profiling: profile::Profiling::default(),
        })
    }
}

pub fn router(state: StatusState) -> axum::Router {
    axum::Router::new()
        .route("/healthz/ready", any(ready))
        .route("/quitquitquit", any(quit))
        .route("/drain", any(drain))
        .route("/drain/status", any(drain_status))
        .route("/stats/prometheus", any(metrics))
        .route("/metrics", any(metrics))
        .route("/app-health/{container}/{kind}", any(app_probe))
        .route("/app-lifecycle/{container}/{kind}", any(app_probe))
        .route("/debug/ndsz", any(ndsz))
        .route("/debug/config_dump", any(config_dump))
        .route("/debug/certz", any(certz))
        .route("/debug/xdsz", any(xdsz))
        .route("/debug/dnsz", any(dnsz))
        .route("/debug/wasmz", any(wasmz))
        .route("/logging", any(logging))
        .route("/debug/logs", any(recent_logs))
        .route("/debug/pprof/", any(profile::index))
        .route("/debug/pprof/profile", any(profile::profile))
        .route("/debug/tokioz", any(profile::tokioz))
        .route("/", any(page))
        .with_state(state)
        .layer(axum::middleware::from_fn(settle_after_view))
        .layer(axum::middleware::from_fn(compress::layer))
}

/// Whether `path` is an operator's view (asked by hand, rarely), not a probe or a scrape.
fn is_view(path: &str) -> bool {
    path == "/" || path == "/logging" || path == "/drain/status" || path.starts_with("/debug/")
}

/// A view runs code and builds state nothing else does (JSON and HTML rendering, certificate
/// parsing): once one is answered, the heap is trimmed and the code pages are released again a
/// quiet second later ([`crate::malloc::trimmer`]), so a view asked once leaves nothing
/// resident (docs/benchmarks-log.md, views). Probes and scrapes, asked every few seconds, do
/// not trigger it: their code stays mapped.
async fn settle_after_view(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let view = is_view(req.uri().path());
    let resp = next.run(req).await;
    if view {
        crate::malloc::trim_soon();
    }
    resp
}

/// A client must send its request headers within this time, and an idle keep-alive
/// connection is closed after it (Istio's status server sets no timeouts at all).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Pause after a failed accept that closing connections cannot help (nothing left to close, or
/// not a descriptor shortage); keeps the loop from spinning while the condition lasts.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);
/// Connections closed at once when `accept` runs out of file descriptors.
const FD_EVICT_BATCH: usize = 8;

/// Binds the status port on every address of both families when the host has IPv6 (a
/// dual-stack `[::]` socket, like Go's `net.Listen("tcp", ":port")` in Istio's
/// `pilot/cmd/pilot-agent/status/server.go`), else on `0.0.0.0`. Envoy's readiness route may
/// point at `127.0.0.1` or `[::1]`, so both must answer.
pub async fn bind(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    match bind_dual_stack(port) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(e),
        Err(e) => {
            tracing::debug!(error = %e, "no IPv6 socket; status server on 0.0.0.0 only");
            tokio::net::TcpListener::bind((IpAddr::from([0, 0, 0, 0]), port)).await
        }
    }
}

fn bind_dual_stack(port: u16) -> std::io::Result<tokio::net::TcpListener> {
    let socket = tokio::net::TcpSocket::new_v6()?;
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::Ipv6V6Only, &false)
        .map_err(std::io::Error::from)?;
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)))?;
    socket.listen(1024)
}

/// Serves until `stop`, HTTP/1.1 only (kubelet, Prometheus and Envoy speak it), with
/// [`HEADER_TIMEOUT`] and a connection table sized from the open-files limit
/// ([`conns::cap_from_rlimit`]) that closes an old idle connection to serve each new one
/// once full ([`conns`]). Accept errors are never fatal: out of file descriptors, the oldest
/// idle connections are closed to free some; when nothing can be freed the loop pauses for
/// [`ACCEPT_RETRY`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: StatusState,
    stop: CancellationToken,
) -> std::io::Result<()> {
    serve_with_cap(listener, state, stop, conns::cap_from_rlimit()).await
}

/// [`serve`] with an explicit connection cap.
pub async fn serve_with_cap(
    listener: tokio::net::TcpListener,
    state: StatusState,
    stop: CancellationToken,
    cap: usize,
) -> std::io::Result<()> {
    let app = router(state);
    let table = conns::ConnTable::new(cap);
    tracing::debug!(
        max_connections = table.cap(),
        "status server connection table"
    );
    let tasks = tokio_util::task::TaskTracker::new();
    let mut accept_failing = false;
    loop {
        let (tcp, peer) = tokio::select! {
            () = stop.cancelled() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    let out_of_fds = matches!(
                        e.raw_os_error(),
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                    );
                    // The pending connections stay in the backlog: closing a few of ours (the
                    // oldest idle first) frees the descriptors the next accepts need.
                    let freed = if out_of_fds {
                        (0..FD_EVICT_BATCH).take_while(|_| table.evict_for_fd()).count()
                    } else {
                        0
                    };
                    if !accept_failing {
                        tracing::warn!(error = %e, open = table.len(), freed, "status server: accept failed");
                        accept_failing = true;
                    }
                    if freed > 0 {
                        // Let the closed connections' tasks drop their sockets, then accept.
                        tokio::task::yield_now().await;
                    } else {
                        tokio::time::sleep(ACCEPT_RETRY).await;
                    }
                    continue;
                }
            },
        };
        accept_failing = false;
        let handle = Arc::new(table.register(peer));
        let _ = tcp.set_nodelay(true);
        let app = app.clone();
        let stop = stop.clone();
        let fut = async move {
            // Until its first byte a connection costs only this wait, not hyper's buffers: a
            // peer holding thousands of silent connections holds little memory.
            let started = tokio::time::Instant::now();
            // `peek`, not `readable()`: tokio reports a new socket readable before any data.
            let mut first = [0u8; 1];
            tokio::select! {
                r = tokio::time::timeout(HEADER_TIMEOUT, tcp.peek(&mut first)) => {
                    // Closed before a byte (Ok(0)), an error, or silent for HEADER_TIMEOUT.
                    if !matches!(r, Ok(Ok(n)) if n > 0) {
                        return;
                    }
                }
                () = handle.evicted().cancelled() => return,
                () = stop.cancelled() => return,
            }
            // Boxed: the task's own size stays that of the wait above while a peer only
            // holds the connection open.
            Box::pin(serve_connection(tcp, peer, app, handle, stop, started)).await;
        };
        tasks.spawn(fut);
    }
    tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), tasks.wait()).await;
    Ok(())
}

/// One accepted connection after its first byte arrived.
async fn serve_connection(
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    app: axum::Router,
    handle: Arc<conns::ConnHandle>,
    stop: CancellationToken,
    started: tokio::time::Instant,
) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    // The header timeout counts from accept, as before the wait.
    let header_timeout = HEADER_TIMEOUT
        .saturating_sub(started.elapsed())
        .max(Duration::from_millis(100));
    let router = app.layer(axum::Extension(ConnectInfo(peer)));
    let busy_handle = handle.clone();
    // Each request marks the connection busy until its response body is done (or dropped),
    // so eviction can prefer connections with nothing in flight.
    let svc = hyper::service::service_fn(move |req: axum::http::Request<hyper::body::Incoming>| {
        let busy = busy_handle.busy();
        let router = router.clone();
        async move {
            let resp = tower::ServiceExt::oneshot(router, req).await?;
            Ok::<_, std::convert::Infallible>(resp.map(|body| BusyBody { body, _busy: busy }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(tcp), svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        // Closed to make room: dropping the connection closes the socket.
        () = handle.evicted().cancelled() => {}
        () = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                _ = tokio::time::timeout(Duration::from_secs(5), conn) => {}
                () = handle.evicted().cancelled() => {}
            }
        }
    }
}

/// A response body that keeps its connection marked busy until it is written or dropped.
struct BusyBody {
    body: axum::body::Body,
    _busy: conns::BusyGuard,
}

impl http_body::Body for BusyBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

async fn ready(State(s): State<StatusState>) -> Response {
    match s.readiness.check().await {
        Ok(()) => (StatusCode::OK, "").into_response(),
        Err(reason) => {
            tracing::warn!("Envoy proxy is NOT ready: {reason}");
            (StatusCode::SERVICE_UNAVAILABLE, reason).into_response()
        }
    }
}

fn loopback(peer: &SocketAddr) -> bool {
    match peer.ip() {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

fn forbidden(peer: &SocketAddr) -> Response {
    tracing::warn!(%peer, "refused a loopback-only request from a non-loopback address");
    // Istio's text (`http.Error` in pilot/cmd/pilot-agent/status/server.go).
    (
        StatusCode::FORBIDDEN,
        "Only requests from localhost are allowed\n",
    )
        .into_response()
}

/// `/quitquitquit` and `/drain`: loopback first, then POST only, with Go's `http.Error` text
/// for the 405 (Istio `pilot/cmd/pilot-agent/status/server.go` `handleQuit`, `handleDrain`).
fn admin_guard(method: &Method, peer: &SocketAddr) -> Option<Response> {
    if !loopback(peer) {
        return Some(forbidden(peer));
    }
    if method != Method::POST {
        return Some((StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed\n").into_response());
    }
    None
}

async fn quit(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
) -> Response {
    if let Some(r) = admin_guard(&method, &peer) {
        return r;
    }
    tracing::info!("/quitquitquit: shutting down without draining");
    s.drain.skip_drain.store(true, Ordering::SeqCst);
    s.shutdown.cancel();
    (StatusCode::OK, "OK").into_response()
}

/// `/drain/status` (meshagent only): where shutdown is, and the connections Envoy still
/// holds per listener (the ones `EXIT_ON_ZERO_ACTIVE_CONNECTIONS` waits for), as JSON.
async fn drain_status(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    let snapshot = s.drain.snapshot();
    let mut body = serde_json::to_value(&snapshot).unwrap_or_default();
    if let Some(admin) = s.envoy_admin {
        match crate::envoy::active_connections_by_listener(admin, s.drain.ignored_ports()).await {
            Ok(per) => {
                body["activeConnectionsTotal"] = per.values().sum::<u64>().into();
                body["activeConnections"] = serde_json::to_value(per).unwrap_or_default();
            }
            Err(e) => body["statsError"] = e.to_string().into(),
        }
    }
    (
        StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn drain(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
) -> Response {
    if let Some(r) = admin_guard(&method, &peer) {
        return r;
    }
    let Some(admin) = s.envoy_admin else {
        return (StatusCode::OK, "OK").into_response();
    };
    let path = if s.proxy_type == ProxyType::Sidecar {
        "/drain_listeners?inboundonly&graceful&skip_exit"
    } else {
        "/drain_listeners?graceful&skip_exit"
    };
    match admin::request("POST", admin, path, Duration::from_secs(5)).await {
        Ok((200, _)) => {
            tracing::info!("/drain: Envoy listeners draining");
            s.drain.drained.store(true, Ordering::SeqCst);
            s.drain.set_phase(crate::envoy::Phase::Draining);
            (StatusCode::OK, "OK").into_response()
        }
        Ok((code, body)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Envoy drain failed: {code} {}", body.trim()),
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Envoy drain failed: {e}"),
        )
            .into_response(),
    }
}

async fn metrics(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    if s.metrics_localhost_only && !loopback(&peer) {
        return forbidden(&peer);
    }
    s.merger.scrape(&headers, uri.query()).await
}

async fn app_probe(State(s): State<StatusState>, uri: Uri, headers: HeaderMap) -> Response {
    s.probes.handle(uri.path(), &headers).await
}

fn json(code: StatusCode, v: &serde_json::Value) -> Response {
    (
        code,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// Istio's `/debug/ndsz`: the NameTable in protojson field names, rendered from the DNS
/// lookup table (all the agent keeps of it) on the blocking pool: milliseconds for a
/// 5,000-name table.
async fn ndsz(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    let table = s.name_table.as_ref().and_then(|w| w.borrow().clone());
    let Some(table) = table else {
        return json(StatusCode::NOT_FOUND, &serde_json::json!({}));
    };
    match tokio::task::spawn_blocking(move || table.ndsz()).await {
        Ok(body) => {
            crate::malloc::trim_soon();
            (
                StatusCode::OK,
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn config_dump(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    let Some(dump) = &s.config_dump else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    json(StatusCode::OK, dump)
}

/// `/debug/certz` as JSON, 404 `{}` until identity has started.
async fn certz_value(s: &StatusState) -> Option<serde_json::Value> {
    let src = s.views.identity.get()?.clone();
    tokio::task::spawn_blocking(move || views::certz(&src, std::time::SystemTime::now()))
        .await
        .ok()
}

async fn certz(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    match certz_value(&s).await {
        Some(v) => json(StatusCode::OK, &v),
        None => json(StatusCode::NOT_FOUND, &serde_json::json!({})),
    }
}

async fn xdsz(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    match s.views.xds.get() {
        Some(x) => {
            let mut v = x.to_json();
            v["envoy"] = s
                .views
                .envoy_extensions
                .get()
                .map_or(serde_json::Value::Null, |r| r.to_json());
            json(StatusCode::OK, &v)
        }
        None => json(StatusCode::NOT_FOUND, &serde_json::json!({})),
    }
}

/// `/debug/dnsz`: without `name`, the summary; with it, how the proxy answers it (400 on a
/// name or type it cannot ask); `&forward=true` also sends it upstream. 404 `{}` without a
/// DNS proxy.
async fn dnsz(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    uri: Uri,
) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    let Some(core) = s.views.dns.get().cloned() else {
        return json(StatusCode::NOT_FOUND, &serde_json::json!({}));
    };
    let (mut name, mut qtype, mut fwd) = (None, None, false);
    for pair in uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "name" => name = Some(percent_decode(v)),
            "type" => qtype = Some(percent_decode(v)),
            "forward" => fwd = matches!(v, "true" | "1"),
            _ => {}
        }
    }
    let Some(name) = name else {
        return json(StatusCode::OK, &crate::dns::view::summary(&core));
    };
    let (n, t) = match crate::dns::view::question(&name, qtype.as_deref()) {
        Ok(q) => q,
        Err(e) => {
            return json(
                StatusCode::BAD_REQUEST,
                &serde_json::json!({"error": e.to_string()}),
            );
        }
    };
    let mut v = crate::dns::view::explain(&core, &n, t);
    if fwd {
        match crate::dns::view::forward(&core, &n, t).await {
            Ok(f) => v["forwarded"] = f,
            Err(e) => v["forwarded"] = serde_json::json!({"error": e.to_string()}),
        }
    }
    json(StatusCode::OK, &v)
}

/// `/debug/wasmz`: every module the agent knows; 404 `{}` without Wasm conversion.
async fn wasmz(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    match s.views.wasm.get() {
        Some(w) => json(StatusCode::OK, &w.to_json()),
        None => json(StatusCode::NOT_FOUND, &serde_json::json!({})),
    }
}

fn levels_json() -> serde_json::Value {
    crate::logging::levels().map_or_else(
        || serde_json::json!({}),
        |l| {
            serde_json::Value::Object(
                l.into_iter()
                    .map(|(k, v)| (k.to_owned(), serde_json::Value::from(v)))
                    .collect(),
            )
        },
    )
}

/// `GET /logging`: every scope's level. `POST /logging?level=scope:level[,…]` applies them
/// with `--log_output_level`'s parser (Istio's `processLevels`), `POST /logging?reset`
/// returns to the flags' levels. Both loopback only.
async fn logging(ConnectInfo(peer): ConnectInfo<SocketAddr>, method: Method, uri: Uri) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    if method == Method::GET {
        return json(StatusCode::OK, &levels_json());
    }
    if method != Method::POST {
        return (StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n").into_response();
    }
    let query = uri.query().unwrap_or("");
    let mut level = None;
    let mut reset = false;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "level" => level = Some(percent_decode(v)),
            "reset" => reset = true,
            _ => {}
        }
    }
    let result = match (level.as_deref(), reset) {
        (Some(l), false) => crate::logging::set_levels(Some(l)).map(|()| l.to_owned()),
        (None, true) => crate::logging::set_levels(None).map(|()| "reset".to_owned()),
        _ => {
            return (
                StatusCode::BAD_REQUEST,
                "expected ?level=scope:level[,scope:level] or ?reset\n",
            )
                .into_response();
        }
    };
    match result {
        Ok(what) => {
            tracing::info!(%peer, change = %what, "log levels changed through /logging");
            json(StatusCode::OK, &levels_json())
        }
        Err(e) => (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    }
}

/// `/debug/logs[?lines=N]`: the last `N` (default all) lines the agent logged, as written
/// (text or JSON), from a byte-bounded ring ([`crate::logging::RECENT_BYTES`]). Loopback only:
/// logs name hosts, pods and addresses.
async fn recent_logs(ConnectInfo(peer): ConnectInfo<SocketAddr>, uri: Uri) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    let mut lines = None;
    for pair in uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        if let Some(("lines", v)) = pair.split_once('=') {
            match v.parse::<usize>() {
                Ok(n) => lines = Some(n),
                Err(_) => {
                    return (
                        StatusCode::BAD_REQUEST,
                        format!("lines={v:?}: expected a non-negative integer\n"),
                    )
                        .into_response();
                }
            }
        }
    }
    (
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; charset=utf-8",
        )],
        crate::logging::RECENT.last(lines),
    )
        .into_response()
}

/// `%XX` decoding of a query value (`:` and `,` may arrive encoded).
fn percent_decode(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(if b[i] == b'+' { b' ' } else { b[i] });
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `GET /`: the HTML status page.
async fn page(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
) -> Response {
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    if method != Method::GET && method != Method::HEAD {
        return (StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n").into_response();
    }
    let certz = certz_value(&s).await;
    let xdsz = s.views.xds.get().map(|x| x.to_json());
    let facts = views::PageFacts {
        ready: s.readiness.check().await,
        dns_names: s
            .name_table
            .as_ref()
            .and_then(|w| w.borrow().as_ref().map(|t| t.len())),
        proxy_type: format!("{:?}", s.proxy_type).to_lowercase(),
    };
    (
        StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8")],
        views::page(certz.as_ref(), xdsz.as_ref(), &facts),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::extract::connect_info::MockConnectInfo;
    use axum::http::Request;
    use tower::ServiceExt;

    fn state() -> StatusState {
        let registry = Registry::new();
        let metrics = MergeMetrics::register(&registry).unwrap();
        let merger = Merger::new(registry.clone(), metrics, None, Vec::new());
        StatusState::new(registry, merger).unwrap()
    }

    async fn call(s: StatusState, peer: &str, method: &str, path: &str) -> (StatusCode, String) {
        let peer: SocketAddr = peer.parse().unwrap();
        let app = router(s).layer(MockConnectInfo(peer));
        let resp = app
            .oneshot(
                Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn quitquitquit_is_loopback_post_only() {
        let s = state();
        assert_eq!(
            call(s.clone(), "192.0.2.9:5555", "POST", "/quitquitquit").await,
            (
                StatusCode::FORBIDDEN,
                "Only requests from localhost are allowed\n".to_owned()
            )
        );
        assert!(!s.shutdown.is_cancelled());
        assert_eq!(
            call(s.clone(), "127.0.0.1:5555", "GET", "/quitquitquit").await,
            (
                StatusCode::METHOD_NOT_ALLOWED,
                "Method Not Allowed\n".to_owned()
            )
        );
        // Istio checks the peer before the method.
        assert_eq!(
            call(s.clone(), "192.0.2.9:5555", "GET", "/drain").await.0,
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            call(s.clone(), "[::ffff:192.0.2.9]:1", "POST", "/drain")
                .await
                .0,
            StatusCode::FORBIDDEN
        );
        let (code, body) = call(s.clone(), "[::1]:5555", "POST", "/quitquitquit").await;
        assert_eq!((code, body.as_str()), (StatusCode::OK, "OK"));
        assert!(s.shutdown.is_cancelled());
        assert!(s.drain.skip_drain.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn readiness_reports_first_failing_probe() {
        let s = state();
        assert_eq!(
            call(s.clone(), "192.0.2.9:1", "GET", "/healthz/ready")
                .await
                .0,
            StatusCode::OK
        );
        s.readiness.add(Arc::new(|| {
            Box::pin(async { Err("first reason".to_owned()) })
        }));
        s.readiness
            .add(Arc::new(|| Box::pin(async { Err("second".to_owned()) })));
        let (code, body) = call(s, "192.0.2.9:1", "GET", "/healthz/ready").await;
        assert_eq!(
            (code, body.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "first reason")
        );
    }

    #[tokio::test]
    async fn drain_status_is_loopback_only_json() {
        let s = state();
        assert_eq!(
            call(s.clone(), "192.0.2.1:1", "GET", "/drain/status")
                .await
                .0,
            StatusCode::FORBIDDEN
        );
        let (code, body) = call(s.clone(), "127.0.0.1:1", "GET", "/drain/status").await;
        assert_eq!(code, StatusCode::OK);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["phase"], "running", "{body}");
        assert!(v["elapsedSeconds"].is_null(), "{body}");
        s.drain.begin_shutdown();
        let (_, body) = call(s, "[::1]:1", "GET", "/drain/status").await;
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["phase"], "withdrawing", "{body}");
        assert!(v["elapsedSeconds"].as_f64().is_some(), "{body}");
    }

    #[test]
    fn views_but_not_probes_or_scrapes_settle_afterwards() {
        for p in [
            "/",
            "/logging",
            "/drain/status",
            "/debug/certz",
            "/debug/pprof/profile",
        ] {
            assert!(is_view(p), "{p}");
        }
        for p in [
            "/healthz/ready",
            "/stats/prometheus",
            "/metrics",
            "/app-health/a/livez",
        ] {
            assert!(!is_view(p), "{p}");
        }
    }

    #[tokio::test]
    async fn loopback_only_endpoints_and_unknown_probe() {
        let mut s = state();
        let (code, body) = call(s.clone(), "127.0.0.1:1", "GET", "/debug/ndsz").await;
        assert_eq!((code, body.as_str()), (StatusCode::NOT_FOUND, "{}"));
        let (tx, rx) = tokio::sync::watch::channel(None);
        s.name_table = Some(rx);
        let mut table = NameTable::default();
        table.table.insert(
            "b.default.svc.cluster.local".into(),
            meshagent_proto::nds::name_table::NameInfo {
                ips: vec!["240.240.0.1".into()],
                registry: "Kubernetes".into(),
                shortname: "b".into(),
                namespace: "default".into(),
                alt_hosts: vec![],
            },
        );
        tx.send_replace(Some(Arc::new(crate::dns::LookupTable::build(
            &table,
            &crate::dns::Scope::default(),
        ))));
        let (code, body) = call(s.clone(), "127.0.0.1:1", "GET", "/debug/ndsz").await;
        assert_eq!(code, StatusCode::OK);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v["table"]["b.default.svc.cluster.local"]["registry"],
            "Kubernetes"
        );
        assert_eq!(
            call(s.clone(), "192.0.2.1:1", "GET", "/debug/ndsz").await.0,
            StatusCode::FORBIDDEN
        );

        s.metrics_localhost_only = true;
        assert_eq!(
            call(s.clone(), "192.0.2.1:1", "GET", "/metrics").await.0,
            StatusCode::FORBIDDEN
        );
        let (code, body) = call(s.clone(), "127.0.0.1:1", "GET", "/stats/prometheus").await;
        assert_eq!(code, StatusCode::OK);
        assert!(body.contains("istio_agent_scrapes_total 1"), "{body}");

        for (m, path) in [
            ("GET", "/debug/certz"),
            ("GET", "/debug/xdsz"),
            ("GET", "/debug/dnsz"),
            ("GET", "/debug/dnsz?name=b&type=A"),
            ("GET", "/debug/wasmz"),
            ("GET", "/logging"),
            ("GET", "/debug/logs"),
            ("POST", "/logging?level=default:debug"),
            ("GET", "/"),
        ] {
            assert_eq!(
                call(s.clone(), "[::ffff:192.0.2.1]:1", m, path).await.0,
                StatusCode::FORBIDDEN,
                "{m} {path}"
            );
        }
        for path in ["/debug/certz", "/debug/dnsz", "/debug/wasmz"] {
            assert_eq!(
                call(s.clone(), "127.0.0.1:1", "GET", path).await.0,
                StatusCode::NOT_FOUND,
                "{path}"
            );
        }
        let (code, body) = call(s.clone(), "127.0.0.1:1", "GET", "/").await;
        assert_eq!(code, StatusCode::OK);
        assert!(body.contains("Identity has not started"), "{body}");

        let (code, body) = call(s, "192.0.2.1:1", "GET", "/app-health/x/livez").await;
        assert_eq!(
            (code, body.as_str()),
            (
                StatusCode::BAD_REQUEST,
                "app prober config does not exists for /app-health/x/livez"
            )
        );
    }
}
