//! One Envoy stream and its upstream stream, owned by a single task.
//!
//! Istio's behaviour (`pkg/istio-agent/xds_proxy.go`, `xds_proxy_delta.go`), kept: a **new** upstream stream per downstream stream
//! (on one connection shared by the pairs that are live at the same time, see [`Upstream`]);
//! Envoy's requests forwarded verbatim; any failure on either side ends the pair; the agent never
//! reconnects on its own — Envoy's backoff drives reconnection, so Envoy always restarts the
//! full handshake and can never stay attached to a dead upstream.
//!
//! **Responses** are read from istiod promptly into a per-pair queue bounded in bytes
//! ([`MAX_QUEUED`]) and handed to the downstream stream as it takes them. Reading promptly
//! matters because upstream streams share an HTTP/2 connection: data a pair leaves unread holds
//! the connection's flow-control window, and a few downstream clients that stopped reading
//! used to freeze every other stream on it. Only a full queue stops the read (the backpressure
//! then costs at most one stream window), and a downstream client whose queue stays full
//! without taking anything for [`STALL`] is cut off (its connection closed, a warning and
//! `xds_proxy_downstream_stalled`): it gets the whole state again when it reconnects. On top,
//! each downstream *connection* gets its own upstream connection ([`Upstream`]), so Envoy's
//! stream never shares flow control with a proxyless client (test
//! `q1_stuck_clients_do_not_delay_envoy_or_fresh_clients`).
//!
//! **Termination status**: as Istio, the downstream stream ends with the upstream's gRPC status
//! (OK for a graceful upstream end), so Envoy's logs and `control_plane.connected_state` show
//! istiod's own error (e.g. `Unauthenticated`). A failed dial ends it with `Unavailable` naming
//! the address, which is more useful to an operator than Istio's bare dial error.
//!
//! **Intercepted types** ([`Interceptor`]) are handled by futures that may wait (a Wasm
//! download). They queue per type URL in [`Pending`]: the loop keeps reading Envoy's requests
//! and forwarding every other type meanwhile, and each type's verdicts are applied in arrival
//! order. At most [`MAX_PENDING`] may wait per pair; beyond that istiod's stream is not read
//! (backpressure, bounded memory), as for a slow Envoy.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use futures::FutureExt;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use http::uri::PathAndQuery;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::codec::RawCodec;
use super::intercept::{self, Api, Health, InterceptError, Interceptor, Meta, Verdict};
use super::reader::{MessageReader, TakeBody};
use super::{Metrics, wire};
use crate::control_plane::{self, CallMetadata, Keepalive, Target};

/// Requests queued toward istiod. Envoy's reads pause when fewer than [`AGENT_HEADROOM`] slots
/// are free, so agent-originated requests (ACKs, subscriptions, health) always fit and the queue
/// stays bounded.
const UPSTREAM_QUEUE: usize = 64;
const AGENT_HEADROOM: usize = 8;

/// Intercepted responses that may wait for their verdict at once, per stream pair.
const MAX_PENDING: usize = 32;

/// Istio warns when a push to Envoy takes longer than this (it never times it out: PR #31167).
const SLOW_PUSH: Duration = Duration::from_secs(10);

/// Bytes of responses a pair queues for its downstream client beyond the one the HTTP/2
/// layer is writing and the one in the hand-over slot. A message is queued whenever the queue
/// holds less, so any single message fits (responses have no agent-side size limit,
/// istio#52815); a 10,000-cluster CDS is ~5 MB, so a normal push burst (CDS, EDS, LDS, RDS)
/// fits behind a busy Envoy without stopping the upstream read.
pub const MAX_QUEUED: usize = 4 << 20;

/// How long a pair's queue may stay full with nothing taken by the downstream client before
/// the client is cut off. Istio never times out a push (PR #31167: slow Envoys with large
/// configs), so this is well above what applying a large push takes (Istio warns at
/// [`SLOW_PUSH`], the same 10 s), and a false positive costs a reconnect and a full resync,
/// not lost config. Meanwhile a full queue stops only this pair's upstream read.
pub const STALL: Duration = Duration::from_secs(10);

pub const SOTW_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
pub const DELTA_PATH: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// Everything a stream pair needs, shared by all pairs.
pub struct Shared {
    /// The connection the live pairs share.
    pub upstream: Upstream,
    /// A connection to istiod dialled at startup, while Envoy initialises, for Envoy's first
    /// stream (see [`super::prewarm`]).
    pub warm: std::sync::Mutex<Option<Warm>>,
    pub target: Target,
    pub cwd: std::path::PathBuf,
    pub keepalive: Keepalive,
    pub metadata: CallMetadata,
    pub interceptors: Vec<Arc<dyn Interceptor>>,
    pub health: watch::Receiver<Option<Health>>,
    pub metrics: Metrics,
    /// `/debug/xdsz` bookkeeping ([`super::view`]).
    pub view: Arc<super::view::XdsView>,
}

/// An in-flight or finished dial of istiod.
pub type Warm =
    tokio::task::JoinHandle<Result<tonic::transport::Channel, control_plane::ConnectError>>;

impl Shared {
    pub fn take_warm(&self) -> Option<Warm> {
        self.warm.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The upstream connections of the pairs that are live at once, one per downstream
/// connection. Istio's agent serves one downstream stream and dials a connection for it
/// (`xds_proxy.go` `handleStream`); proxyless gRPC opens one xDS stream per target (grpc-go ≥
/// 1.66, istio#53532), so several pairs live side by side here, each with its own upstream
/// *stream*. Pairs whose downstream streams share a connection (one client) share an upstream
/// connection; other clients never do: HTTP/2 flow control is per connection, so a client
/// that stops reading can only ever slow its own streams, never Envoy's. When the last pair of
/// a connection ends its upstream connection is dropped (no idle connection lingers at
/// istiod), and an upstream failure retires it so the next pair dials afresh.
#[derive(Default)]
pub struct Upstream(std::sync::Mutex<Slots>);

#[derive(Default)]
struct Slots {
    by_conn: std::collections::HashMap<u64, Slot>,
    next: u64,
}

struct Slot {
    generation: u64,
    channel: tonic::transport::Channel,
    /// Pairs holding a [`Lease`] on the channel.
    live: usize,
}

/// A pair's hold on its connection's upstream channel; released on drop.
pub struct Lease<'a> {
    upstream: &'a Upstream,
    conn: u64,
    generation: u64,
}

impl Upstream {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The live channel of downstream connection `conn`, if any, with a lease on it.
    fn join(&self, conn: u64) -> Option<(tonic::transport::Channel, Lease<'_>)> {
        let mut slots = self.lock();
        let slot = slots.by_conn.get_mut(&conn)?;
        slot.live += 1;
        Some((
            slot.channel.clone(),
            Lease {
                upstream: self,
                conn,
                generation: slot.generation,
            },
        ))
    }

    /// Installs `channel` (just dialled) for `conn` unless another pair of that connection
    /// installed one meanwhile, which is then used instead.
    fn install(
        &self,
        conn: u64,
        channel: tonic::transport::Channel,
    ) -> (tonic::transport::Channel, Lease<'_>) {
        let mut slots = self.lock();
        slots.next += 1;
        let generation = slots.next;
        let slot = slots.by_conn.entry(conn).or_insert(Slot {
            generation,
            channel,
            live: 0,
        });
        slot.live += 1;
        (
            slot.channel.clone(),
            Lease {
                upstream: self,
                conn,
                generation: slot.generation,
            },
        )
    }

    /// Pairs currently holding an upstream connection (tests, debugging).
    pub fn live(&self) -> usize {
        self.lock().by_conn.values().map(|s| s.live).sum()
    }

    /// Upstream connections currently held (tests, debugging).
    pub fn connections(&self) -> usize {
        self.lock().by_conn.len()
    }
}

impl Lease<'_> {
    /// The connection failed: later pairs dial a new one.
    fn retire(&self) {
        let mut slots = self.upstream.lock();
        if slots
            .by_conn
            .get(&self.conn)
            .is_some_and(|s| s.generation == self.generation)
        {
            slots.by_conn.remove(&self.conn);
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        let mut slots = self.upstream.lock();
        if let Some(slot) = slots.by_conn.get_mut(&self.conn)
            && slot.generation == self.generation
        {
            slot.live = slot.live.saturating_sub(1);
            if slot.live == 0 {
                slots.by_conn.remove(&self.conn);
            }
        }
    }
}

/// How a stream pair ended, for logs and metrics.
enum End {
    /// The agent stopped it (shutdown).
    Stopped,
    /// Envoy ended or broke its stream.
    Downstream(Option<Status>),
    /// istiod ended or broke its stream, or could not be reached.
    Upstream(Option<Status>),
    /// Upstream could not be dialled / the stream could not be created.
    Connect(Status),
    /// The downstream client took nothing for [`STALL`] with its queue full.
    Stalled,
}

/// Istio's `IsExpectedGRPCError`: graceful ends and cancellations are `cancelled`, anything
/// else `error`.
fn termination_type(s: Option<&Status>) -> &'static str {
    let Some(s) = s else { return "cancelled" };
    let msg = s.message();
    let expected = matches!(
        s.code(),
        tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
    ) || (s.code() == tonic::Code::Unavailable
        && [
            "client disconnected",
            "error reading from server: EOF",
            "transport is closing",
        ]
        .iter()
        .any(|m| msg.contains(m)))
        || msg.contains("NO_ERROR");
    if expected { "cancelled" } else { "error" }
}

/// [`termination_type`] for the downstream (Envoy) side. Envoy's connection closing under a
/// live stream — it exits at the end of every shutdown, or restarts — reaches a hyper server
/// as a failed body read ("error reading a body from connection"). gRPC-Go reports the same
/// event as a cancelled stream context, which Istio counts as expected and logs at debug
/// (`pilot/pkg/grpc/grpc.go` `GRPCErrorType`, `pkg/istio-agent/xds_proxy.go`), so it is no
/// warning here either.
fn downstream_termination_type(s: Option<&Status>) -> &'static str {
    let gone = s.is_some_and(|s| {
        s.code() == tonic::Code::Unknown
            && s.message().contains("error reading a body from connection")
    });
    if gone {
        "cancelled"
    } else {
        termination_type(s)
    }
}

/// A downstream read error as gRPC-Go reports it. tonic refuses a message over the server's
/// limit with `OutOfRange` and its own wording; gRPC-Go, behind Istio's agent, says
/// `ResourceExhausted` "grpc: received message larger than max (<len> vs. <limit>)"
/// (`google.golang.org/grpc` `rpc_util.go` `recvAndDecompress`), which is what Envoy logs and
/// what operators search for.
fn recv_status(s: Status) -> Status {
    const TONIC: &str = "Error, decoded message length too large: found ";
    if s.code() != tonic::Code::OutOfRange {
        return s;
    }
    let Some(rest) = s.message().strip_prefix(TONIC) else {
        return s;
    };
    let mut nums = rest
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty());
    match (nums.next(), nums.next()) {
        (Some(len), Some(limit)) => Status::resource_exhausted(format!(
            "grpc: received message larger than max ({len} vs. {limit})"
        )),
        _ => Status::resource_exhausted(s.message().to_owned()),
    }
}

/// The downstream connection a pair's stream arrived on: pairs of one connection share an
/// upstream connection ([`Upstream`]), and `cut` closes the connection (a stalled client).
#[derive(Clone)]
pub struct Downstream {
    pub conn: u64,
    pub cut: CancellationToken,
}

/// Runs one pair until either side ends; the downstream response channel `down` carries at
/// most one message (the hand-over slot), the pair's queue the rest ([`MAX_QUEUED`]).
pub async fn run(
    shared: Arc<Shared>,
    api: Api,
    id: u64,
    conn: Downstream,
    mut downstream: MessageReader,
    down: mpsc::Sender<Result<Bytes, Status>>,
    stop: CancellationToken,
) {
    let addr = shared.target.addr.clone();
    let (up_tx, up_rx) = mpsc::channel::<Bytes>(UPSTREAM_QUEUE);
    let mut connect = connect(&shared, api, conn.conn, up_rx).boxed();
    let mut upstream: Option<MessageReader> = None;
    // Whether upstream has sent its first response on this pair.
    let mut answered = false;
    let mut lease: Option<Lease<'_>> = None;
    let mut health = shared.health.clone();
    health.borrow_and_update();
    let mut seen_lds = false;
    let view = shared.view.register(id, api, conn.conn);
    tracing::debug!(id, ?api, upstream = %addr, "downstream stream connected");

    // The hand-over slot toward the client, reserved whenever it is free.
    let mut permit: Option<mpsc::Permit<'_, Result<Bytes, Status>>> = None;
    // When the last response was handed over, to warn about slow pushes as Istio does.
    let mut handed_over: Option<Instant> = None;
    // Responses read from upstream that the client has not taken yet, and their bytes.
    let mut queue: std::collections::VecDeque<Bytes> = std::collections::VecDeque::new();
    let mut queued = 0usize;
    // Since when the queue has been full with nothing taken (the stall clock).
    let mut full_since: Option<Instant> = None;

    let mut pending = Pending::default();

    let end = loop {
        // Hand the oldest queued response over as soon as the slot is free.
        if !queue.is_empty()
            && let Some(p) = permit.take()
            && let Some(msg) = queue.pop_front()
        {
            queued -= msg.len();
            p.send(Ok(msg));
            handed_over = Some(Instant::now());
            // Progress restarts the stall clock.
            full_since = (queued >= MAX_QUEUED).then(Instant::now);
        }
        let room = queued < MAX_QUEUED;
        let stall_at = full_since.map(|t| t + STALL);
        // Arm order: stop first; then the dial; then the slot toward the client; then finished
        // interceptions before new upstream reads, so a verdict is queued before more of
        // istiod's stream is taken in.
        tokio::select! {
            biased;
            () = stop.cancelled() => break End::Stopped,
            () = async { tokio::time::sleep_until(stall_at.unwrap_or_else(Instant::now)).await }, if stall_at.is_some() => break End::Stalled,
            r = &mut connect, if upstream.is_none() => match r {
                Ok((s, l)) => {
                    tracing::debug!(id, upstream = %addr, "connected to upstream XDS server");
                    shared.view.upstream_connected(&view);
                    upstream = Some(s);
                    lease = Some(l);
                }
                Err(s) => break End::Connect(s),
            },
            p = down.reserve(), if permit.is_none() => match p {
                Ok(p) => {
                    if let Some(t) = handed_over.take()
                        && t.elapsed() > SLOW_PUSH
                    {
                        tracing::warn!(id, took = %crate::logging::dur(t.elapsed()), "slow push to Envoy");
                    }
                    permit = Some(p);
                }
                Err(_) => break End::Downstream(Some(Status::cancelled("Envoy stream closed"))),
            },
            (meta, verdict) = pending.next(), if !pending.is_empty() && room => {
                if let Some(out) = apply_verdict(api, id, &meta, verdict, &up_tx, &view) {
                    enqueue(&mut queue, &mut queued, &mut full_since, out);
                }
            },
            m = async { upstream.as_mut()?.message().await.transpose() }, if upstream.is_some() && room && pending.len() < MAX_PENDING => match m {
                Some(Ok(msg)) => {
                    if !answered {
                        // The stream is up: the code that dialled it (TLS, the token, the
                        // first exchange) and its buffers can leave the resident set, also
                        // where nothing asks for readiness (DISABLE_ENVOY) (crate::malloc).
                        answered = true;
                        crate::malloc::trim_soon();
                    }
                    match on_response(&shared, api, id, msg, &mut pending, &view) {
                        Ok(Some(out)) => enqueue(&mut queue, &mut queued, &mut full_since, out),
                        Ok(None) => {}
                        Err(end) => break end,
                    }
                }
                None => break End::Upstream(None),
                Some(Err(s)) => break End::Upstream(Some(s)),
            },
            m = downstream.message(), if up_tx.capacity() > AGENT_HEADROOM => match m {
                Ok(Some(msg)) => on_request(&shared, api, msg, &up_tx, &mut seen_lds, &view),
                Ok(None) => break End::Downstream(None),
                Err(s) => break End::Downstream(Some(recv_status(s))),
            },
            Ok(()) = health.changed() => {
                // Never before LDS: istiod must know the proxy first (Istio sends it only after the first LDS request, `xds_proxy.go`); the replay
                // after the first LDS request covers changes made before it.
                let h = health.borrow_and_update().clone();
                if seen_lds && let Some(h) = h {
                    send_up(&up_tx, intercept::health_request(api, &h));
                }
            }
        }
    };
    // What was queued for the client is not going to reach it.
    drop(queue);
    // Stream churn leaves freed buffers behind too, not only large responses (crate::malloc).
    crate::malloc::trim_soon();

    // The final status goes through the reserved slot if the loop holds it (try_send would
    // find the slot taken by our own reservation).
    let mut fail = |s: Status| match permit.take() {
        Some(p) => p.send(Err(s)),
        None => {
            let _ = down.try_send(Err(s));
        }
    };
    let m = &shared.metrics;
    match end {
        End::Stopped => {
            tracing::debug!(id, "stream pair stopped by the agent");
            // Dropping `down` ends Envoy's stream with OK; Envoy reconnects if it still wants to.
        }
        End::Connect(s) => {
            shared
                .view
                .upstream_ended(&format!("connect: {:?}: {}", s.code(), s.message()));
            if s.code() == tonic::Code::Unavailable {
                m.istiod_connection_failures.inc();
                // Istio dials lazily (grpc.NewClient), so an unreachable istiod surfaces when
                // the stream is opened and is counted as a connection error
                // (pkg/istio-agent/xds_proxy_delta.go, handleDeltaUpstream): counted there too,
                // so what watches Istio's counter sees it.
                m.istiod_connection_terminations.with(&["error"]).inc();
                tracing::warn!(id, upstream = %addr, error = %s.message(), "failed to connect to upstream XDS server {addr}");
                let s = Status::unavailable(format!(
                    "agent could not connect to upstream XDS server {addr}: {}",
                    s.message()
                ));
                fail(s);
            } else {
                m.istiod_connection_terminations.with(&["error"]).inc();
                tracing::warn!(id, upstream = %addr, code = ?s.code(), error = %s.message(), "upstream XDS server {addr} refused the stream");
                fail(s);
            }
        }
        End::Upstream(s) => {
            let t = termination_type(s.as_ref());
            shared.view.upstream_ended(&match &s {
                Some(s) => format!("{t}: {:?}: {}", s.code(), s.message()),
                None => "upstream closed the stream".to_owned(),
            });
            if t == "error"
                && let Some(l) = &lease
            {
                l.retire();
            }
            m.istiod_connection_terminations.with(&[t]).inc();
            match &s {
                Some(s) if t == "error" => {
                    tracing::warn!(id, upstream = %addr, code = ?s.code(), error = %s.message(), "upstream terminated with unexpected error")
                }
                s => {
                    // DEBUG: one line per stream would flood the log under stream churn.
                    tracing::debug!(id, upstream = %addr, status = ?s.as_ref().map(|s| s.code()), "upstream terminated")
                }
            }
            // End Envoy's stream with istiod's status (Istio's choice); a graceful upstream end
            // closes it with OK.
            if let Some(s) = s {
                // Without a reservation the slot holds a response Envoy has not read yet; wait
                // for it (or for Envoy to go away) so the status follows it.
                match permit.take() {
                    Some(p) => p.send(Err(s)),
                    None => {
                        tokio::select! {
                            _ = down.send(Err(s)) => {}
                            () = stop.cancelled() => {}
                        }
                    }
                }
            }
        }
        End::Stalled => {
            m.downstream_stalled.inc();
            tracing::warn!(id, stall = %crate::logging::dur(STALL), queued_limit = MAX_QUEUED, "downstream xDS client took no response for {} with its queue full; closing its connection", crate::logging::dur(STALL));
            // hyper offers no way to reset a stream whose send waits on the peer's flow
            // control (the body is not polled then), so the client's connection is closed:
            // that frees everything held for it, and the client reconnects and resyncs.
            conn.cut.cancel();
        }
        End::Downstream(s) => {
            let t = downstream_termination_type(s.as_ref());
            m.envoy_connection_terminations.with(&[t]).inc();
            match &s {
                Some(s) if t == "error" => {
                    tracing::warn!(id, code = ?s.code(), error = %s.message(), "downstream terminated with unexpected error")
                }
                s => {
                    tracing::debug!(id, status = ?s.as_ref().map(|s| s.code()), "downstream terminated")
                }
            }
            // Istio's handler returns the downstream error, so gRPC-Go ends Envoy's stream
            // with it (`pkg/istio-agent/xds_proxy.go` `handleUpstream`): e.g. a request over
            // `ISTIO_GPRC_MAXRECVMSGSIZE` gets `ResourceExhausted`. A client that is gone never
            // reads it. Dropping the upstream stream resets it: istiod sees the proxy go away
            // at once.
            if let Some(s) = s {
                fail(s);
            }
        }
    }
}

/// Queues a response for the client and starts the stall clock when the queue is full.
fn enqueue(
    queue: &mut std::collections::VecDeque<Bytes>,
    queued: &mut usize,
    full_since: &mut Option<Instant>,
    msg: Bytes,
) {
    *queued += msg.len();
    queue.push_back(msg);
    if *queued >= MAX_QUEUED && full_since.is_none() {
        *full_since = Some(Instant::now());
    }
}

/// Opens the upstream stream on the upstream connection of the pair's downstream connection,
/// or on a new one (the pre-dialled one for the first pair). Runs concurrently with
/// forwarding the client's first requests: a server may send its response headers only with
/// its first response.
async fn connect(
    shared: &Shared,
    api: Api,
    conn: u64,
    up_rx: mpsc::Receiver<Bytes>,
) -> Result<(MessageReader, Lease<'_>), Status> {
    let (channel, lease) = match shared.upstream.join(conn) {
        Some(joined) => joined,
        None => {
            // The pre-dialled connection if there is one; a failed pre-dial may be stale, so
            // this stream then dials (and reports) on its own.
            let warm = match shared.take_warm() {
                Some(dial) => match dial.await {
                    Ok(Ok(channel)) => Some(channel),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "pre-dialled connection failed; dialling again");
                        None
                    }
                    Err(_) => None,
                },
                None => None,
            };
            let channel = match warm {
                Some(c) => c,
                None => control_plane::channel(&shared.target, &shared.cwd, shared.keepalive)
                    .map_err(|e| Status::unavailable(e.to_string()))?,
            };
            shared.upstream.install(conn, channel)
        }
    };
    match open(shared, api, up_rx, channel).await {
        Ok(s) => Ok((s, lease)),
        Err(s) => {
            // A dial that failed must not be reused by the next pair.
            if s.code() == tonic::Code::Unavailable {
                lease.retire();
            }
            Err(s)
        }
    }
}

async fn open(
    shared: &Shared,
    api: Api,
    up_rx: mpsc::Receiver<Bytes>,
    channel: tonic::transport::Channel,
) -> Result<MessageReader, Status> {
    let take = TakeBody::new(channel);
    let mut grpc = tonic::client::Grpc::new(take.clone())
        // No agent-side limit: Envoy's own limit is the one that matters (istio#52815).
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    let mut req = tonic::Request::new(ReceiverStream::new(up_rx));
    shared.metadata.apply(req.metadata_mut()).await;
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = PathAndQuery::from_static(match api {
        Api::Sotw => SOTW_PATH,
        Api::Delta => DELTA_PATH,
    });
    // tonic checks the response headers; the body is read by `MessageReader` (see
    // `reader.rs`), and tonic's own reader, given an empty body, is dropped unread.
    drop(
        grpc.streaming(req, path, RawCodec)
            .await
            .map_err(control_plane::transport_status)?,
    );
    take.reader()
}

fn send_up(up: &mpsc::Sender<Bytes>, msg: Bytes) {
    match up.try_send(msg) {
        Ok(()) => {}
        // Closed: the upstream stream is gone and its end is being reported by the loop.
        Err(mpsc::error::TrySendError::Closed(_)) => {}
        Err(mpsc::error::TrySendError::Full(_)) => {
            tracing::error!("upstream request queue full; dropping an agent-originated request")
        }
    }
}

fn on_request(
    shared: &Shared,
    api: Api,
    msg: Bytes,
    up: &mpsc::Sender<Bytes>,
    seen_lds: &mut bool,
    view: &super::view::PairHandle,
) {
    let m = &shared.metrics;
    m.requests.inc();
    m.downstream_max.set_max(msg.len() as f64);
    // One pass over the top-level field headers, for the first LDS and for /debug/xdsz.
    let first_lds = match wire::peek(api.request_kind(), &msg) {
        Ok(p) => {
            super::view::XdsView::pair(view).on_request(api, &msg, &p);
            shared.view.rejections.on_request(api, &msg, &p);
            !*seen_lds && p.type_url == meshagent_proto::type_url::LISTENER
        }
        Err(e) => {
            // Forwarded anyway: the proxy does not judge Envoy's requests; istiod will.
            tracing::debug!(error = %e, "cannot peek at an Envoy request");
            false
        }
    };
    send_up(up, msg);
    if first_lds {
        *seen_lds = true;
        for i in &shared.interceptors {
            for r in i.on_first_lds(api) {
                send_up(up, r);
            }
        }
    }
}

/// A response whose interceptor is still deciding.
type Job = BoxFuture<'static, (Meta, Result<Verdict, InterceptError>)>;

/// Pending interceptions, one ordered queue per type URL: futures of one type run
/// concurrently but complete in arrival order; different types do not wait for each other.
#[derive(Default)]
struct Pending {
    queues: Vec<(&'static str, FuturesOrdered<Job>)>,
    len: usize,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, type_url: &'static str, job: Job) {
        self.len += 1;
        match self.queues.iter_mut().find(|(t, _)| *t == type_url) {
            Some((_, q)) => q.push_back(job),
            None => {
                let mut q = FuturesOrdered::new();
                q.push_back(job);
                self.queues.push((type_url, q));
            }
        }
    }

    /// The next verdict of any type; pending forever when empty (the loop guards the arm).
    async fn next(&mut self) -> (Meta, Result<Verdict, InterceptError>) {
        std::future::poll_fn(|cx| {
            for (_, q) in &mut self.queues {
                if let std::task::Poll::Ready(Some(done)) = q.poll_next_unpin(cx) {
                    self.len -= 1;
                    return std::task::Poll::Ready(done);
                }
            }
            std::task::Poll::Pending
        })
        .await
    }
}

/// Applies an interceptor's verdict: bytes for Envoy, or a request upstream (ACK, NACK).
fn apply_verdict(
    api: Api,
    id: u64,
    meta: &Meta,
    verdict: Result<Verdict, InterceptError>,
    up: &mpsc::Sender<Bytes>,
    view: &super::view::PairHandle,
) -> Option<Bytes> {
    match verdict {
        Ok(Verdict::Forward(b)) => Some(b),
        Ok(Verdict::Consume(reply)) => {
            if let Some(r) = reply {
                send_up(up, r);
            }
            None
        }
        Err(e) => {
            tracing::warn!(id, type_url = %meta.type_url, nonce = %meta.nonce, error = %e, "intercepted response rejected; NACK upstream");
            super::view::XdsView::pair(view).on_agent_nack(
                &meta.type_url,
                &meta.nonce,
                &e.to_string(),
            );
            send_up(up, meta.nack(api, &e));
            None
        }
    }
}

/// A response this large (a 10,000-cluster CDS is ~5 MB) asks for a malloc trim after the
/// burst (crate::malloc).
const LARGE_RESPONSE: usize = 1 << 20;

/// Handles one upstream response: `Ok(Some(bytes))` goes to Envoy, `Ok(None)` was queued for
/// its interceptor or dropped, `Err(end)` ends the pair.
fn on_response(
    shared: &Shared,
    api: Api,
    id: u64,
    msg: Bytes,
    pending: &mut Pending,
    view: &super::view::PairHandle,
) -> Result<Option<Bytes>, End> {
    let m = &shared.metrics;
    m.responses.inc();
    m.upstream_max.set_max(msg.len() as f64);
    m.response_bytes.add(msg.len() as u64);
    if msg.len() >= LARGE_RESPONSE {
        // Its buffers (and Envoy's copy on the way out) are freed once passed on.
        crate::malloc::trim_soon();
    }
    let peeked = msg.clone();
    let p = match wire::peek(api.response_kind(), &peeked) {
        Ok(p) => p,
        Err(e) => {
            // Istio's decode would fail the same way and end the pair.
            return Err(End::Upstream(Some(Status::internal(format!(
                "malformed response from upstream: {e}"
            )))));
        }
    };
    let interceptor = shared
        .interceptors
        .iter()
        .find(|i| i.type_url() == p.type_url);
    super::view::XdsView::pair(view).on_response(
        msg.len(),
        &p,
        interceptor.map(|i| intercepted_name(i.type_url())),
    );
    match interceptor {
        Some(i) => {
            let meta = Meta::of(&p);
            let verdict = i.on_response(api, msg, meta.clone());
            pending.push(i.type_url(), Box::pin(verdict.map(move |v| (meta, v))));
            Ok(None)
        }
        None if intercept::forwarded_to_envoy(p.type_url) => Ok(Some(msg)),
        None => {
            tracing::error!(
                id,
                type_url = p.type_url,
                "dropping response of a type the agent does not forward"
            );
            Ok(None)
        }
    }
}

/// What `/debug/xdsz` calls an intercepted type.
fn intercepted_name(type_url: &str) -> &'static str {
    use meshagent_proto::type_url as t;
    match type_url {
        t::NAME_TABLE => "NDS",
        t::PROXY_CONFIG => "PCDS",
        t::EXTENSION_CONFIG => "ECDS",
        t::HEALTH_INFO => "health",
        _ => "agent",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_going_away_is_not_an_error() {
        let gone = Status::unknown("h2 protocol error: error reading a body from connection");
        assert_eq!(downstream_termination_type(Some(&gone)), "cancelled");
        assert_eq!(termination_type(Some(&gone)), "error");
        assert_eq!(
            downstream_termination_type(Some(&Status::unavailable("boom"))),
            "error"
        );
    }

    #[test]
    fn oversized_requests_are_refused_in_grpc_gos_words() {
        let tonic = Status::out_of_range(
            "Error, decoded message length too large: found 5242885 bytes, the limit is: 4194304 bytes",
        );
        let s = recv_status(tonic);
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            s.message(),
            "grpc: received message larger than max (5242885 vs. 4194304)"
        );
        let other = recv_status(Status::out_of_range("something else"));
        assert_eq!(other.code(), tonic::Code::OutOfRange);
        let other = recv_status(Status::internal("x"));
        assert_eq!(other.code(), tonic::Code::Internal);
    }

    #[test]
    fn termination_types() {
        assert_eq!(termination_type(None), "cancelled");
        assert_eq!(termination_type(Some(&Status::cancelled("x"))), "cancelled");
        assert_eq!(
            termination_type(Some(&Status::unavailable("transport is closing"))),
            "cancelled"
        );
        assert_eq!(
            termination_type(Some(&Status::unavailable("boom"))),
            "error"
        );
        assert_eq!(
            termination_type(Some(&Status::unauthenticated("no"))),
            "error"
        );
    }
}
