//! The N-agent harness shared by the proxyless (`grpc.rs`) and reconnect-storm (`storm.rs`)
//! benchmarks: agents run as the `grpc-agent` template runs them (`DISABLE_ENVOY`), each with a
//! tiny Rust ADS client on its `XDS` socket (SotW, node with `GENERATOR=grpc`, subscribed to one
//! EDS cluster, ACKing every response), plus /proc readers and a compact histogram printer.
//!
//! Lives in a directory (`support/mod.rs`) so Cargo does not take it for a benchmark target.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

#[path = "floors.rs"]
pub mod floors;
#[path = "mem.rs"]
pub mod mem;
#[path = "relay.rs"]
pub mod relay;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use meshagent_proto::envoy::pb::envoy::config::core::v3::Node;
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
    DiscoveryRequest, DiscoveryResponse,
};
use meshagent_proto::envoy::pb::google::protobuf::{Struct, Value as PbValue, value::Kind};
use meshagent_proto::type_url;
use meshagent_testkit::{Devplane, Sidecar, wait_for};
use tokio::sync::mpsc;
use tokio::time::Instant;

pub const SOTW: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
pub const CLUSTER: &str = "outbound|7070||echo.default.svc.cluster.local";
const CLOCK_TICKS: f64 = 100.0;

/// A mesh of one service with `endpoints` endpoints.
pub fn mesh(endpoints: usize) -> String {
    let mut y = String::from("workloads:\n");
    let mut sel = vec![];
    for i in 0..endpoints {
        y.push_str(&format!(
            "  - {{name: echo{i}, serviceAccount: echo, address: 127.0.0.{}, ports: [{{port: 17070, inboundPort: 17070}}]}}\n",
            i + 1
        ));
        sel.push(format!("echo{i}"));
    }
    y.push_str(&format!(
        "services:\n  - {{name: echo, selector: [{}], ports: [{{port: 7070, targetPort: 17070}}]}}\n",
        sel.join(", ")
    ));
    y
}

/// The env of the `grpc-agent` template (proxyless gRPC: no Envoy).
pub fn proxyless_env() -> Vec<(&'static str, String)> {
    vec![
        ("ISTIO_META_GENERATOR", "grpc".into()),
        ("OUTPUT_CERTS", "./var/lib/istio/data".into()),
        ("ISTIO_META_DNS_CAPTURE", "false".into()),
        ("DISABLE_ENVOY", "true".into()),
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA".into()),
    ]
}

/// Starts `n` proxyless agents (pods `<prefix><i>`) one after the other and waits until all are
/// ready.
pub async fn start_agents(dp: &Devplane, prefix: &str, n: usize) -> Vec<Sidecar> {
    let env = proxyless_env();
    let mut agents = vec![];
    for i in 0..n {
        agents.push(Sidecar::start(dp, &format!("{prefix}{i}"), "default", prefix, &env).await);
    }
    for a in &mut agents {
        a.wait_ready(Duration::from_secs(180)).await;
    }
    agents
}

/// The node id of client `i` (a gRPC client's id as the grpc-agent bootstrap writes it).
pub fn node_id(prefix: &str, i: usize) -> String {
    format!("sidecar~127.0.0.1~{prefix}{i}-1.default~default.svc.cluster.local")
}

/// One client's view: versions of EDS responses, with arrival times.
pub type Seen = Arc<Mutex<Vec<(String, Instant)>>>;

pub fn node(id: &str) -> Node {
    let mut fields = std::collections::BTreeMap::new();
    fields.insert(
        "GENERATOR".to_owned(),
        PbValue {
            kind: Some(Kind::StringValue("grpc".into())),
        },
    );
    Node {
        id: id.into(),
        metadata: Some(Struct {
            fields: fields.into_iter().collect(),
        }),
        ..Default::default()
    }
}

/// Why one ADS stream ended.
#[derive(Debug)]
pub enum StreamEnd {
    /// The stream could not be opened (socket missing, agent refused, upstream unreachable).
    Open(tonic::Status),
    /// The stream ended after it was opened (`None`: graceful end).
    Ended(Option<tonic::Status>),
}

/// One SotW ADS stream on `channel` subscribed to [`CLUSTER`]'s endpoints, until it ends. Every
/// response is recorded in `seen` (and reported to `on_response`) and ACKed.
pub async fn ads_stream(
    channel: tonic::transport::Channel,
    token: Option<&str>,
    node_id: &str,
    seen: &Seen,
    mut on_response: impl FnMut(),
) -> StreamEnd {
    let (tx, rx) = mpsc::channel::<DiscoveryRequest>(4);
    tx.send(DiscoveryRequest {
        node: Some(node(node_id)),
        type_url: type_url::ENDPOINT.into(),
        resource_names: vec![CLUSTER.into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    if let Err(e) = grpc.ready().await {
        return StreamEnd::Open(tonic::Status::unavailable(e.to_string()));
    }
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let codec = tonic_prost::ProstCodec::<DiscoveryRequest, DiscoveryResponse>::default();
    let mut stream = match grpc
        .streaming(req, http::uri::PathAndQuery::from_static(SOTW), codec)
        .await
    {
        Ok(s) => s.into_inner(),
        Err(s) => return StreamEnd::Open(s),
    };
    loop {
        match stream.message().await {
            Ok(Some(resp)) => {
                seen.lock()
                    .unwrap()
                    .push((resp.version_info.clone(), Instant::now()));
                on_response();
                let _ = tx
                    .send(DiscoveryRequest {
                        type_url: resp.type_url,
                        version_info: resp.version_info,
                        response_nonce: resp.nonce,
                        resource_names: vec![CLUSTER.into()],
                        ..Default::default()
                    })
                    .await;
            }
            Ok(None) => return StreamEnd::Ended(None),
            Err(s) => return StreamEnd::Ended(Some(s)),
        }
    }
}

/// A SotW ADS client that holds one stream for the benchmark's lifetime (panics if it cannot).
pub async fn xds_client(
    channel: tonic::transport::Channel,
    token: Option<String>,
    node_id: String,
    seen: Seen,
) {
    if let StreamEnd::Open(s) = ads_stream(channel, token.as_deref(), &node_id, &seen, || {}).await
    {
        panic!("ADS stream of {node_id}: {s}");
    }
}

/// Spawns one [`xds_client`] and waits (up to `timeout`) for its first response; `on_fail`
/// runs before the panic if none comes (e.g. printing the agent's log).
pub async fn spawn_client(
    channel: tonic::transport::Channel,
    token: Option<String>,
    node_id: String,
    timeout: Duration,
    on_fail: impl FnOnce(),
) -> (Seen, tokio::task::JoinHandle<()>) {
    let seen = Seen::default();
    let what = node_id.clone();
    let client = tokio::spawn(xds_client(channel, token, node_id, seen.clone()));
    let deadline = Instant::now() + timeout;
    while seen.lock().unwrap().is_empty() {
        if Instant::now() > deadline || client.is_finished() {
            on_fail();
            panic!("xDS client {what}: no response within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (seen, client)
}

/// A channel to a unix socket (the agent's `XDS`), connecting lazily and again after a failure.
pub fn uds_channel(path: PathBuf) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_static("http://localhost").connect_with_connector_lazy(
        tower::service_fn(move |_| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }),
    )
}

/// Starts one client per channel; returns their views and tasks once all have a version.
pub async fn attach(
    channels: Vec<(tonic::transport::Channel, Option<String>)>,
) -> (Vec<Seen>, Vec<tokio::task::JoinHandle<()>>) {
    let mut seen = vec![];
    let mut tasks = vec![];
    for (i, (ch, token)) in channels.into_iter().enumerate() {
        let s: Seen = Arc::default();
        seen.push(s.clone());
        tasks.push(tokio::spawn(xds_client(ch, token, node_id("bench", i), s)));
    }
    let views = seen.clone();
    wait_for(
        "every client's first EDS response",
        Duration::from_secs(120),
        || {
            let ok = views.iter().all(|s| !s.lock().unwrap().is_empty());
            async move { ok.then_some(()) }
        },
    )
    .await;
    (seen, tasks)
}

// === /proc ===

/// CPU time of all of `pid`'s threads, ms, from `/proc/<pid>/task/*/schedstat` (ns; `stat`'s
/// 10 ms ticks are too coarse for one push or an idle minute).
pub fn cpu_ms(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return f64::NAN;
    };
    let ns: u64 = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 / 1e6
}

/// One clock tick in seconds: the resolution of `/proc/<pid>/stat`'s CPU times.
pub const TICK_SECS: f64 = 1.0 / CLOCK_TICKS;

pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / CLOCK_TICKS
}

pub fn rss_mib(pid: u32) -> f64 {
    mem::status_kib(pid, "VmRSS:") / 1024.0
}

/// The 1-minute load average (recorded next to every figure: the machine is shared).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

// === statistics ===

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The `p`-quantile (0..=1) of `v`, nearest rank; 0 for an empty `v`.
pub fn quantile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// Seconds since the Unix epoch (devplane's debug endpoint reports times this way).
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// Prints p50/p90/max of `values` (milliseconds) on one line.
pub fn print_summary(title: &str, values: &[f64]) {
    println!(
        "  {title} (n={}): p50 {:.0} ms, p90 {:.0} ms, max {:.0} ms",
        values.len(),
        quantile(values, 0.5),
        quantile(values, 0.9),
        quantile(values, 1.0)
    );
}

/// Prints `values` (milliseconds) as a histogram of `bucket_ms` buckets from the first to the
/// last non-empty one (widened so at most 40 rows print), then p50/p90/max.
pub fn print_histogram(title: &str, values: &[f64], bucket_ms: f64) {
    if values.is_empty() {
        println!("  {title}: no samples");
        return;
    }
    let lo = values
        .iter()
        .copied()
        .fold(f64::INFINITY, f64::min)
        .min(0.0);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let mut bucket = bucket_ms;
    while ((hi - lo) / bucket).floor() >= 40.0 {
        bucket *= 2.0;
    }
    let first = (lo / bucket).floor() as i64;
    let last = (hi / bucket).floor() as i64;
    let mut counts = vec![0usize; (last - first + 1) as usize];
    for v in values {
        counts[((v / bucket).floor() as i64 - first) as usize] += 1;
    }
    let widest = counts.iter().copied().max().unwrap_or(1).max(1);
    println!(
        "  {title} (n={}, {bucket:.0} ms buckets): p50 {:.0} ms, p90 {:.0} ms, max {:.0} ms",
        values.len(),
        quantile(values, 0.5),
        quantile(values, 0.9),
        hi
    );
    let (skip_lo, skip_hi) = (
        counts.iter().position(|c| *c > 0).unwrap_or(0),
        counts.iter().rposition(|c| *c > 0).unwrap_or(0),
    );
    for (k, c) in counts.iter().enumerate().take(skip_hi + 1).skip(skip_lo) {
        let start = (first + k as i64) as f64 * bucket;
        let bar = "#".repeat((c * 50).div_ceil(widest));
        println!("    {:>7.0}..{:<7.0} {:>4} {bar}", start, start + bucket, c);
    }
}
