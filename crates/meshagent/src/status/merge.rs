//! Merged Prometheus output on `/stats/prometheus` and `/metrics` (Istio `pilot/cmd/pilot-agent/status/server.go` `handleStats`).
//!
//! Order: the agent's registry, Envoy's `/stats/prometheus` (unless disabled), then each
//! application target from `ISTIO_PROMETHEUS_ANNOTATIONS` in target order. Unlike Istio, which
//! reads every body into memory (Istio #32386), every source is **streamed**: all sources are
//! requested at once (so a slow target does not delay the others' connection setup), each
//! behind a small bounded channel, and the writer drains them in order. A source that is not
//! being written yet is held back by TCP flow control, not by our memory. A failing source
//! (transport error, non-200, over the 10 MiB cap, past the scrape deadline, a Content-Type
//! that is not a text exposition format, a line that is not valid UTF-8 or not a metric line:
//! see [`super::lines`]) is counted in `scrape_failures_total{type}` as Istio counts its
//! scrape errors (`pilot/cmd/pilot-agent/status/server.go` `handleStats`) and cut at a family
//! boundary; the response is still 200. Family blocks dropped as duplicates are counted in
//! `merge_dropped_families_total{type}`.
//!
//! A scraper preferring protobuf gets protobuf when every source answered it ([`super::proto`]),
//! so native histograms survive; otherwise text as above.
//!
//! After the sources, meshagent adds how each fared in this scrape (names of its own, not
//! Istio's): `istio_agent_merge_target_up{type,target}` (1 read whole, 0 failed) and
//! `istio_agent_merge_target_scrape_duration_seconds{type,target}`, so a broken application
//! metrics port shows as 0 instead of its families silently missing.

use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::lines::{Seen, SourceFilter};
use super::proto;
use crate::config::probers::ScrapeTarget;
use crate::metrics::{Counter, CounterVec, MetricsError, Registry};

/// Per-target body cap (Istio's 10 MiB).
pub const MAX_TARGET_BYTES: u64 = 10 * 1024 * 1024;
/// Used when the scraper sends no `X-Prometheus-Scrape-Timeout-Seconds`.
pub const DEFAULT_SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
/// Chunks buffered per source before TCP back-pressure applies.
const SOURCE_CHANNEL: usize = 2;
/// hyper's HTTP/1 read buffer limit per upstream connection.
const READ_BUFFER: usize = 64 * 1024;

pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
const TIMEOUT_HEADER: &str = "x-prometheus-scrape-timeout-seconds";

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("request failed: {0}")]
    Transport(String),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("body is larger than {MAX_TARGET_BYTES} bytes")]
    TooLarge,
    #[error("scrape timeout reached")]
    Timeout,
    #[error("answered Content-Type {0:?}, not a text exposition format")]
    ContentType(String),
    #[error("invalid body: {0}")]
    Invalid(&'static str),
}

/// Whether a source's Content-Type can be merged into text output: Prometheus text,
/// OpenMetrics text, or none or `application/octet-stream` (static file servers; Prometheus 2
/// parses unknown types as text too). Protobuf, JSON, HTML and the rest are refused: their
/// bytes are not exposition lines.
pub fn mergeable_content_type(ct: Option<&str>) -> bool {
    let Some(ct) = ct else {
        return true;
    };
    let media = ct.split(';').next().unwrap_or("").trim();
    [
        "text/plain",
        "application/openmetrics-text",
        "application/octet-stream",
        "",
    ]
    .iter()
    .any(|m| media.eq_ignore_ascii_case(m))
}

/// `scrapes_total` and `scrape_failures_total{type}`, registered by their owner.
#[derive(Clone)]
pub struct MergeMetrics {
    pub scrapes: Counter,
    failures: CounterVec<1>,
    dropped_families: CounterVec<1>,
}

impl MergeMetrics {
    pub fn register(registry: &Registry) -> Result<MergeMetrics, MetricsError> {
        let failures = registry.counter_vec(
            "scrape_failures_total",
            "The total number of failed scrapes.",
            &["type"],
        )?;
        let dropped_families = registry.counter_vec(
            "merge_dropped_families_total",
            "Metric family blocks left out of the merged scrape because an earlier block (of any source, or of the same one) had the same name.",
            &["type"],
        )?;
        for t in ["envoy", "application", "agent"] {
            failures.with(&[t]);
            dropped_families.with(&[t]);
        }
        Ok(MergeMetrics {
            scrapes: registry.counter("scrapes_total", "The total number of scrapes.")?,
            failures,
            dropped_families,
        })
    }

    pub fn failures(&self, kind: &str) -> u64 {
        self.failures.with(&[kind]).get()
    }

    pub fn dropped_families(&self, kind: &str) -> u64 {
        self.dropped_families.with(&[kind]).get()
    }
}

/// What the merge needs; built once by the status server.
#[derive(Clone)]
pub struct Merger {
    pub registry: Registry,
    pub metrics: MergeMetrics,
    /// Envoy's Prometheus listener; `None` without Envoy or with
    /// `PILOT_AGENT_MERGE_ENVOY_STATS=false`.
    pub envoy: Option<SocketAddr>,
    /// Application targets (empty unless scraping is enabled for a sidecar).
    pub app_targets: Vec<ScrapeTarget>,
    client: Client<HttpConnector, Empty<Bytes>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Envoy,
    Application,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Envoy => "envoy",
            Kind::Application => "application",
        }
    }
}

enum Msg {
    /// Response headers: the Content-Type the source answered with.
    Head(Option<String>),
    Data(Bytes),
    Failed(ScrapeError),
}

struct Source {
    kind: Kind,
    what: String,
    /// The `target` label of the health series: host, port and path, no query.
    target: String,
    /// When its request was sent.
    started: Instant,
    rx: mpsc::Receiver<Msg>,
    head: Option<Option<String>>,
    /// A failure seen while waiting for the head, reported by the writer in order.
    early_failure: Option<ScrapeError>,
}

impl Merger {
    pub fn new(
        registry: Registry,
        metrics: MergeMetrics,
        envoy: Option<SocketAddr>,
        app_targets: Vec<ScrapeTarget>,
    ) -> Merger {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        // A small read buffer per connection: chunks are handed on as they arrive, so a larger
        // buffer would only raise peak memory (hyper's default grows to ~400 KiB).
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(1)
            .http1_max_buf_size(READ_BUFFER)
            .build(connector);
        Merger {
            registry,
            metrics,
            envoy,
            app_targets,
            client,
        }
    }

    /// Handles one scrape; the body streams after the application targets' headers arrived
    /// (their Content-Type decides the response's).
    pub async fn scrape(&self, headers: &HeaderMap, query: Option<&str>) -> Response<Body> {
        self.metrics.scrapes.inc();
        let timeout = headers
            .get(TIMEOUT_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(|s| Duration::from_secs_f64(s.min(3600.0)))
            .unwrap_or(DEFAULT_SCRAPE_TIMEOUT);
        let deadline = Instant::now() + timeout;
        let accept = headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let mut forwarded = HeaderMap::new();
        for name in [header::USER_AGENT.as_str(), TIMEOUT_HEADER] {
            if let Some(v) = headers.get(name) {
                forwarded.insert(name, v.clone());
            }
        }

        // Protobuf when the scraper prefers it (native histograms): every source is asked for
        // it first, text second; the answer is protobuf only if all of them used it.
        let protobuf = proto::wants_protobuf(accept);
        let source_accept = |app: bool| {
            if protobuf {
                proto::SOURCE_ACCEPT.to_owned()
            } else {
                negotiate_accept(accept, app)
            }
        };
        let mut sources = Vec::new();
        if let Some(envoy) = self.envoy {
            let path = match query {
                Some(q) if !q.is_empty() => format!("/stats/prometheus?{q}"),
                _ => "/stats/prometheus".to_owned(),
            };
            let uri = format!("http://{envoy}{path}");
            sources.push(self.spawn_fetch(
                Kind::Envoy,
                uri,
                &forwarded,
                &source_accept(false),
                deadline,
            ));
        }
        for t in &self.app_targets {
            let uri = format!("http://localhost:{}{}", t.port, t.path);
            sources.push(self.spawn_fetch(
                Kind::Application,
                uri,
                &forwarded,
                &source_accept(true),
                deadline,
            ));
        }

        // Wait for the application heads (concurrently) for at most half the scrape budget: the
        // Content-Type must be chosen before the body starts, but a slow target must not eat
        // the time Envoy's body needs. Heads arriving later are still streamed; they just do
        // not take part in choosing the format.
        let head_deadline = Instant::now() + timeout / 2;
        // With protobuf asked, Envoy's head is waited for too: it takes part in the choice.
        let heads = futures::future::join_all(
            sources
                .iter_mut()
                .filter(|s| s.kind == Kind::Application || protobuf)
                .map(|s| async move {
                    match tokio::time::timeout_at(head_deadline, s.rx.recv()).await {
                        Ok(Some(Msg::Head(ct)))
                            if protobuf && proto::is_protobuf(ct.as_deref()) =>
                        {
                            s.head = Some(ct);
                            None
                        }
                        Ok(Some(Msg::Head(ct))) if !mergeable_content_type(ct.as_deref()) => {
                            s.early_failure =
                                Some(ScrapeError::ContentType(ct.unwrap_or_default()));
                            None
                        }
                        Ok(Some(Msg::Head(ct))) => {
                            s.head = Some(ct.clone());
                            Some(ct)
                        }
                        Ok(Some(Msg::Failed(e))) => {
                            s.early_failure = Some(e);
                            None
                        }
                        // Timeout or a vanished task: the writer reports it at this source.
                        _ => None,
                    }
                }),
        )
        .await;
        let answered: Vec<Option<String>> = heads.into_iter().flatten().collect();
        let all_protobuf = protobuf
            && sources.iter().all(|s| {
                s.early_failure.is_some()
                    || s.head
                        .as_ref()
                        .is_some_and(|ct| proto::is_protobuf(ct.as_deref()))
            });
        let (tx, rx) = mpsc::channel::<Bytes>(SOURCE_CHANNEL);
        let agent_text = self.registry.encode();
        let metrics = self.metrics.clone();
        let content_type = if all_protobuf {
            tokio::spawn(write_all_proto(agent_text, sources, deadline, metrics, tx));
            proto::CONTENT_TYPE.to_owned()
        } else {
            if protobuf {
                // Text after all: the sources that answered protobuf are asked again for text
                // (what Istio asks every source for).
                for s in &mut sources {
                    if s.head
                        .as_ref()
                        .is_some_and(|ct| proto::is_protobuf(ct.as_deref()))
                    {
                        *s = self.spawn_fetch(
                            s.kind,
                            s.what.clone(),
                            &forwarded,
                            &negotiate_accept(accept, s.kind == Kind::Application),
                            deadline,
                        );
                    }
                }
            }
            let content_type = response_content_type(&answered);
            let openmetrics = content_type.starts_with("application/openmetrics-text");
            tokio::spawn(write_all(
                agent_text,
                sources,
                deadline,
                openmetrics,
                metrics,
                tx,
            ));
            content_type
        };
        // Fused: the gzip layer polls the body once more after its end.
        let stream = futures::StreamExt::fuse(futures::stream::unfold(rx, |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
        }));
        let mut resp = Response::new(Body::from_stream(stream));
        *resp.status_mut() = StatusCode::OK;
        if let Ok(v) = HeaderValue::from_str(&content_type) {
            resp.headers_mut().insert(header::CONTENT_TYPE, v);
        }
        resp
    }

    fn spawn_fetch(
        &self,
        kind: Kind,
        uri: String,
        forwarded: &HeaderMap,
        accept: &str,
        deadline: Instant,
    ) -> Source {
        let (tx, rx) = mpsc::channel(SOURCE_CHANNEL);
        let mut req = Request::get(uri.as_str());
        for (k, v) in forwarded {
            req = req.header(k, v);
        }
        req = req.header(header::ACCEPT, accept);
        let client = self.client.clone();
        let what = uri.clone();
        let target = uri
            .strip_prefix("http://")
            .unwrap_or(&uri)
            .split('?')
            .next()
            .unwrap_or("")
            .to_owned();
        // Istio caps application targets only; Envoy's body is large by nature (100k+ lines)
        // and is streamed, so it needs no cap to stay out of memory.
        let cap = (kind == Kind::Application).then_some(MAX_TARGET_BYTES);
        tokio::spawn(async move {
            let r = match req.body(Empty::<Bytes>::new()) {
                Ok(req) => fetch(client, req, &tx, deadline, cap).await,
                Err(e) => Err(ScrapeError::Transport(e.to_string())),
            };
            if let Err(e) = r {
                let _ = tx.send(Msg::Failed(e)).await;
            }
        });
        Source {
            kind,
            what,
            target,
            started: Instant::now(),
            rx,
            head: None,
            early_failure: None,
        }
    }
}

async fn fetch(
    client: Client<HttpConnector, Empty<Bytes>>,
    req: Request<Empty<Bytes>>,
    tx: &mpsc::Sender<Msg>,
    deadline: Instant,
    cap: Option<u64>,
) -> Result<(), ScrapeError> {
    let resp = tokio::time::timeout_at(deadline, client.request(req))
        .await
        .map_err(|_| ScrapeError::Timeout)?
        .map_err(|e| ScrapeError::Transport(e.to_string()))?;
    if resp.status() != StatusCode::OK {
        return Err(ScrapeError::Status(resp.status().as_u16()));
    }
    let ct = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if tx.send(Msg::Head(ct)).await.is_err() {
        return Ok(());
    }
    let mut body = resp.into_body();
    let mut total: u64 = 0;
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(ScrapeError::Timeout),
            Ok(None) => return Ok(()),
            Ok(Some(Err(e))) => return Err(ScrapeError::Transport(e.to_string())),
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        if cap.is_some_and(|c| total > c) {
            return Err(ScrapeError::TooLarge);
        }
        // A dropped receiver means the scraper went away: stop reading.
        if tx.send(Msg::Data(data)).await.is_err() {
            return Ok(());
        }
    }
}

async fn write_all(
    agent_text: String,
    sources: Vec<Source>,
    deadline: Instant,
    openmetrics: bool,
    metrics: MergeMetrics,
    tx: mpsc::Sender<Bytes>,
) {
    let mut seen = Seen::default();
    let mut ready = Vec::new();
    let mut agent = SourceFilter::default();
    agent.push_bytes(&mut seen, &Bytes::from(agent_text), &mut ready);
    agent.finish(&mut seen, &mut ready);
    if !send(&tx, &mut ready).await {
        return;
    }
    let mut health = Vec::with_capacity(sources.len());
    for mut s in sources {
        let mut filter = SourceFilter::default();
        let mut failed = s.early_failure.take();
        if failed.is_none() && s.head.is_none() {
            // Heads of Envoy (and of applications that were late) are read here.
            match tokio::time::timeout_at(deadline, s.rx.recv()).await {
                Ok(Some(Msg::Head(ct))) if !mergeable_content_type(ct.as_deref()) => {
                    failed = Some(ScrapeError::ContentType(ct.unwrap_or_default()))
                }
                Ok(Some(Msg::Head(ct))) => s.head = Some(ct),
                Ok(Some(Msg::Failed(e))) => failed = Some(e),
                Ok(Some(Msg::Data(_))) | Ok(None) => {
                    failed = Some(ScrapeError::Transport("no response".into()))
                }
                Err(_) => failed = Some(ScrapeError::Timeout),
            }
        }
        let Ok(mut failed) = read_source(
            &mut s,
            failed,
            &mut filter,
            &mut seen,
            &mut ready,
            &tx,
            deadline,
        )
        .await
        else {
            return;
        };
        if failed.is_none() {
            filter.finish(&mut seen, &mut ready);
            failed = filter.failure().map(ScrapeError::Invalid);
        }
        if failed.is_some() {
            filter.abort(&mut ready);
        }
        health.push(source_done(
            &mut s,
            failed,
            filter.dropped_families,
            &metrics,
        ));
        // Dropping the receiver ends the fetch task if it is still running.
        drop(s.rx);
        if !send(&tx, &mut ready).await {
            return;
        }
    }
    if !health.is_empty() {
        // Through a filter of its own like any source: an application that exports these
        // names keeps them (first source wins) and the output stays valid.
        let mut filter = SourceFilter::default();
        filter.push(&mut seen, health_text(&health).as_bytes(), &mut ready);
        filter.finish(&mut seen, &mut ready);
        if !send(&tx, &mut ready).await {
            return;
        }
    }
    if seen.dropped > 0 {
        tracing::debug!(dropped = seen.dropped, "dropped duplicate metric lines");
    }
    if openmetrics {
        let _ = tx.send(Bytes::from_static(b"# EOF\n")).await;
    }
}

/// [`write_all`] in delimited protobuf: every source's head was protobuf (or it failed).
async fn write_all_proto(
    agent_text: String,
    sources: Vec<Source>,
    deadline: Instant,
    metrics: MergeMetrics,
    tx: mpsc::Sender<Bytes>,
) {
    let mut seen = Seen::default();
    let agent = proto::encode(&proto::from_text(&agent_text), &mut seen);
    drop(agent_text);
    if tx.send(Bytes::from(agent)).await.is_err() {
        return;
    }
    let mut ready = Vec::new();
    let mut health = Vec::with_capacity(sources.len());
    for mut s in sources {
        let mut filter = proto::ProtoFilter::default();
        let failed = s.early_failure.take();
        let Ok(mut failed) = read_source(
            &mut s,
            failed,
            &mut filter,
            &mut seen,
            &mut ready,
            &tx,
            deadline,
        )
        .await
        else {
            return;
        };
        // Whole messages held back are sent whatever happened: each is a complete family.
        filter.finish(&mut ready);
        if failed.is_none() {
            failed = filter.failure().map(ScrapeError::Invalid);
        }
        health.push(source_done(
            &mut s,
            failed,
            filter.dropped_families,
            &metrics,
        ));
        drop(s.rx);
        if !send(&tx, &mut ready).await {
            return;
        }
    }
    if !health.is_empty() {
        let families = proto::from_text(&health_text(&health));
        let _ = tx
            .send(Bytes::from(proto::encode(&families, &mut seen)))
            .await;
    }
}

/// What the text and protobuf merges have in common: a filter fed a source's chunks that
/// hands on whole, de-duplicated families and says when the input is not valid.
trait Filter {
    fn push(&mut self, seen: &mut Seen, chunk: &Bytes, ready: &mut Vec<Bytes>);
    fn failure(&self) -> Option<&'static str>;
}

impl Filter for SourceFilter {
    fn push(&mut self, seen: &mut Seen, chunk: &Bytes, ready: &mut Vec<Bytes>) {
        // Kept lines go on as slices of `chunk`, not copies.
        SourceFilter::push_bytes(self, seen, chunk, ready)
    }
    fn failure(&self) -> Option<&'static str> {
        SourceFilter::failure(self)
    }
}

impl Filter for proto::ProtoFilter {
    fn push(&mut self, seen: &mut Seen, chunk: &Bytes, ready: &mut Vec<Bytes>) {
        proto::ProtoFilter::push(self, seen, chunk, ready)
    }
    fn failure(&self) -> Option<&'static str> {
        proto::ProtoFilter::failure(self)
    }
}

/// The scraper went away: stop merging.
struct Gone;

/// Reads one source's body through `filter` until it ends, fails, turns invalid or the
/// scrape's deadline passes, sending what is ready as it goes. Returns why the source failed
/// (`None`: read whole; the caller still finishes the filter).
async fn read_source(
    s: &mut Source,
    mut failed: Option<ScrapeError>,
    filter: &mut impl Filter,
    seen: &mut Seen,
    ready: &mut Vec<Bytes>,
    tx: &mpsc::Sender<Bytes>,
    deadline: Instant,
) -> Result<Option<ScrapeError>, Gone> {
    while failed.is_none() {
        match tokio::time::timeout_at(deadline, s.rx.recv()).await {
            Ok(Some(Msg::Data(d))) => {
                filter.push(seen, &d, ready);
                if let Some(why) = filter.failure() {
                    failed = Some(ScrapeError::Invalid(why));
                }
                if !send(tx, ready).await {
                    return Err(Gone);
                }
            }
            Ok(Some(Msg::Failed(e))) => failed = Some(e),
            Ok(Some(Msg::Head(_))) => {}
            Ok(None) => break,
            Err(_) => failed = Some(ScrapeError::Timeout),
        }
    }
    Ok(failed)
}

/// Counts and logs how one source ended, and returns its health line.
fn source_done(
    s: &mut Source,
    failed: Option<ScrapeError>,
    dropped_families: u64,
    metrics: &MergeMetrics,
) -> TargetHealth {
    if dropped_families > 0 {
        metrics
            .dropped_families
            .with(&[s.kind.label()])
            .add(dropped_families);
    }
    if let Some(e) = &failed {
        metrics.failures.with(&[s.kind.label()]).inc();
        tracing::warn!(source = %s.what, error = %e, "failed scraping {} metrics", s.kind.label());
    }
    TargetHealth {
        kind: s.kind,
        target: std::mem::take(&mut s.target),
        up: failed.is_none(),
        seconds: s.started.elapsed().as_secs_f64(),
    }
}

/// How one merged source fared in this scrape.
struct TargetHealth {
    kind: Kind,
    target: String,
    up: bool,
    seconds: f64,
}

/// Per-source health, written after the sources so it describes this scrape (the agent's
/// registry is written first, before any source was read). meshagent's own names: Istio has
/// only the `scrape_failures_total{type}` counter.
pub const TARGET_UP: &str = "istio_agent_merge_target_up";
pub const TARGET_DURATION: &str = "istio_agent_merge_target_scrape_duration_seconds";

fn health_text(health: &[TargetHealth]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP {TARGET_UP} Whether this scrape read the merged source whole (1) or failed it (0: refused, an error status, over the size cap, past the scrape timeout, not a text format or an invalid line)."
    );
    let _ = writeln!(out, "# TYPE {TARGET_UP} gauge");
    for h in health {
        let _ = writeln!(
            out,
            "{TARGET_UP}{{type=\"{}\",target=\"{}\"}} {}",
            h.kind.label(),
            escape_label(&h.target),
            u8::from(h.up)
        );
    }
    let _ = writeln!(
        out,
        "# HELP {TARGET_DURATION} Seconds from this scrape's request to the merged source until its body was read to the end or it failed; sources are written in order, so this includes waiting for the sources before it."
    );
    let _ = writeln!(out, "# TYPE {TARGET_DURATION} gauge");
    for h in health {
        let _ = writeln!(
            out,
            "{TARGET_DURATION}{{type=\"{}\",target=\"{}\"}} {:.6}",
            h.kind.label(),
            escape_label(&h.target),
            h.seconds
        );
    }
    out
}

/// A label value in the text format: backslash, double quote and newline escaped; other
/// control characters (which no format allows) replaced.
fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c if c.is_control() => out.push('?'),
            c => out.push(c),
        }
    }
    out
}

async fn send(tx: &mpsc::Sender<Bytes>, ready: &mut Vec<Bytes>) -> bool {
    for b in ready.drain(..) {
        if tx.send(b).await.is_err() {
            return false;
        }
    }
    true
}

/// Istio's Accept filtering: only exposition formats a source may answer with survive, wildcards
/// map to concrete types, and q-values are re-assigned in the order given.
pub fn negotiate_accept(accept: &str, app: bool) -> String {
    let mut kept: Vec<String> = Vec::new();
    for part in accept.split(',') {
        let mut params = part.split(';').map(str::trim);
        let media = params.next().unwrap_or("").to_ascii_lowercase();
        let extra: Vec<&str> = params
            .filter(|p| !p.is_empty() && !p.to_ascii_lowercase().starts_with("q="))
            .collect();
        let with_params = |m: &str| {
            std::iter::once(m)
                .chain(extra.iter().copied())
                .collect::<Vec<_>>()
                .join(";")
        };
        let mapped = match media.as_str() {
            "*" | "*/*" => Some("text/plain;version=0.0.4".to_owned()),
            "text/*" | "text/plain" => Some(with_params(&media)),
            "application/*" if app => Some("application/openmetrics-text;version=0.0.1".to_owned()),
            "application/openmetrics-text" if app => Some(with_params(&media)),
            _ => None,
        };
        if let Some(m) = mapped
            && !kept.contains(&m)
        {
            kept.push(m);
        }
    }
    if kept.is_empty() {
        return "text/plain;version=0.0.4".to_owned();
    }
    if kept.len() == 1 {
        return kept.remove(0);
    }
    kept.iter()
        .enumerate()
        .map(|(i, m)| {
            let q = (10usize.saturating_sub(i)).max(1);
            if q == 10 {
                format!("{m};q=1.0")
            } else {
                format!("{m};q=0.{q}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The merged body's Content-Type: OpenMetrics only when every application that answered used
/// the same OpenMetrics version, else text 0.0.4.
pub fn response_content_type(app_content_types: &[Option<String>]) -> String {
    let mut version: Option<&str> = None;
    for ct in app_content_types {
        let Some(ct) = ct.as_deref() else {
            return TEXT_CONTENT_TYPE.to_owned();
        };
        let lower = ct.to_ascii_lowercase();
        if !lower.starts_with("application/openmetrics-text") {
            return TEXT_CONTENT_TYPE.to_owned();
        }
        let v = if lower.contains("version=1.0.0") {
            "1.0.0"
        } else {
            "0.0.1"
        };
        match version {
            Some(prev) if prev != v => return TEXT_CONTENT_TYPE.to_owned(),
            _ => version = Some(v),
        }
    }
    match version {
        Some(v) => format!("application/openmetrics-text; version={v}; charset=utf-8"),
        None => TEXT_CONTENT_TYPE.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_negotiation() {
        assert_eq!(negotiate_accept("", true), "text/plain;version=0.0.4");
        assert_eq!(negotiate_accept("*/*", false), "text/plain;version=0.0.4");
        assert_eq!(
            negotiate_accept(
                "application/openmetrics-text;version=1.0.0;q=0.9,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                true
            ),
            "application/openmetrics-text;version=1.0.0;q=1.0,text/plain;version=0.0.4;q=0.9"
        );
        assert_eq!(
            negotiate_accept(
                "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4",
                false
            ),
            "text/plain;version=0.0.4"
        );
        assert_eq!(
            negotiate_accept(
                "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited",
                true
            ),
            "text/plain;version=0.0.4"
        );
        assert_eq!(
            negotiate_accept("application/*", true),
            "application/openmetrics-text;version=0.0.1"
        );
    }

    #[test]
    fn health_series_escape_the_target() {
        let text = health_text(&[
            TargetHealth {
                kind: Kind::Envoy,
                target: "127.0.0.1:15090/stats/prometheus".into(),
                up: true,
                seconds: 0.0125,
            },
            TargetHealth {
                kind: Kind::Application,
                target: "localhost:9/m\"x\\\n\x01".into(),
                up: false,
                seconds: 2.0,
            },
        ]);
        assert!(text.contains(
            "istio_agent_merge_target_up{type=\"envoy\",target=\"127.0.0.1:15090/stats/prometheus\"} 1\n"
        ), "{text}");
        assert!(text.contains(
            "istio_agent_merge_target_up{type=\"application\",target=\"localhost:9/m\\\"x\\\\\\n?\"} 0\n"
        ), "{text}");
        assert!(text.contains(
            "istio_agent_merge_target_scrape_duration_seconds{type=\"envoy\",target=\"127.0.0.1:15090/stats/prometheus\"} 0.012500\n"
        ), "{text}");
        // Valid lines for the merge's own filter.
        let mut seen = Seen::default();
        let mut out = Vec::new();
        let mut f = SourceFilter::default();
        f.push(&mut seen, text.as_bytes(), &mut out);
        f.finish(&mut seen, &mut out);
        assert_eq!(f.failure(), None);
        assert_eq!(out.concat(), text.as_bytes());
    }

    #[test]
    fn content_type_choice() {
        let om = Some("application/openmetrics-text; version=1.0.0; charset=utf-8".to_owned());
        assert_eq!(response_content_type(&[]), TEXT_CONTENT_TYPE);
        assert_eq!(
            response_content_type(std::slice::from_ref(&om)),
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        );
        assert_eq!(
            response_content_type(&[om, Some("text/plain".into())]),
            TEXT_CONTENT_TYPE
        );
    }
}
