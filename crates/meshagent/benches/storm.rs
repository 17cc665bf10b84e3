//! Reconnect storm (field scenario F20): N agents (default 200) in `DISABLE_ENVOY` mode against
//! one devplane, each with a tiny ADS client on its `XDS` socket that reconnects as Envoy does.
//!
//! * **(a) devplane restarted** while every client is connected: devplane is killed, stays down
//!   for `STORM_OUTAGE_MS` (default 5000), and is started again on the same address and state
//!   (same root CA). Reported: the arrival histogram of the xDS stream re-opens at devplane
//!   relative to devplane serving again (`serving_since` in its `/debug/clients`), the dial
//!   attempts per agent during the outage (each agent's `istiod_connection_failures`, and the
//!   client's stream attempts, which must match: the agent never redials on its own), and the
//!   time until every client has config again.
//! * **(b) all N agents started at once** (their clients attach as soon as each agent's socket
//!   exists, as Envoy does when the agent starts it): the arrival histogram of the CSRs at the
//!   CA (devplane's `/debug/csr`) and of the xDS stream opens, relative to the first spawn, and
//!   the time until every client has config.
//!
//! Who spreads the reconnects: the agent never reconnects upstream on its own (Istio
//! `pkg/istio-agent/xds_proxy.go` `handleStream`: an upstream error ends the downstream stream,
//! and Envoy's retry drives the next attempt), so the spread is Envoy's backoff, which the
//! clients here reproduce: `source/common/config/grpc_stream.h` (`RetryInitialDelayMs` 500,
//! `RetryMaxDelayMs` 30000) with `JitteredExponentialBackOffStrategy::nextBackOffMs`
//! (`source/common/common/backoff_strategy.cc`): full jitter, a uniformly random delay below an
//! interval that doubles per failure, reset when a response arrives.
//!
//! Run: `make bench`, or `make agent && cargo build --release --bins &&
//! MESHAGENT_BIN=$PWD/target/dist/meshagent cargo bench -p meshagent --bench storm`.
//! `STORM_N`, `STORM_OUTAGE_MS`, `STORM_BUCKET_MS` (histogram bucket, default 100) adjust it.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshagent_testkit::{Devplane, Sidecar, Value, http_get, json, wait_for};
use support::{
    Seen, ads_stream, cpu_secs, loadavg, median, mesh, node_id, print_histogram, print_summary,
    proxyless_env, start_agents, uds_channel, unix_now,
};

/// Envoy's xDS stream backoff (see the module comment).
struct EnvoyBackoff {
    next_ms: u64,
}

const ENVOY_BASE_MS: u64 = 500;
const ENVOY_MAX_MS: u64 = 30_000;

impl EnvoyBackoff {
    fn new() -> EnvoyBackoff {
        EnvoyBackoff {
            next_ms: ENVOY_BASE_MS,
        }
    }

    fn next(&mut self) -> Duration {
        let interval = self.next_ms;
        self.next_ms = if interval < ENVOY_MAX_MS / 2 {
            interval * 2
        } else {
            ENVOY_MAX_MS
        };
        Duration::from_millis(rand::random_range(0..interval).min(ENVOY_MAX_MS))
    }

    fn reset(&mut self) {
        self.next_ms = ENVOY_BASE_MS;
    }
}

/// What one client did, in Unix seconds.
#[derive(Default)]
struct Log {
    /// Every stream attempt.
    attempts: Vec<f64>,
    /// Every response received.
    responses: Vec<f64>,
    /// Why attempts ended without a response (the first few).
    failures: Vec<String>,
}

type Shared = Arc<Mutex<Log>>;

/// An ADS client that behaves as Envoy's xDS stream does: once the agent's socket exists it
/// opens a stream, ACKs every response, and after the stream ends (or fails to open) retries
/// after [`EnvoyBackoff`].
async fn envoy_like_client(socket: PathBuf, node: String, log: Shared) {
    while !socket.exists() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let channel = uds_channel(socket);
    let seen: Seen = Arc::default();
    let mut backoff = EnvoyBackoff::new();
    loop {
        log.lock().unwrap().attempts.push(unix_now());
        let mut got = false;
        let end = ads_stream(channel.clone(), None, &node, &seen, || {
            got = true;
            log.lock().unwrap().responses.push(unix_now());
        })
        .await;
        seen.lock().unwrap().clear();
        if !got {
            let mut l = log.lock().unwrap();
            if l.failures.len() < 4 {
                l.failures.push(format!("{end:?}"));
            }
        }
        if got {
            backoff.reset();
        }
        tokio::time::sleep(backoff.next()).await;
    }
}

fn spawn_client(agent: &Sidecar, node: String) -> (Shared, tokio::task::JoinHandle<()>) {
    let log: Shared = Arc::default();
    let socket = agent.cwd.path().join("etc/istio/proxy/XDS");
    let task = tokio::spawn(envoy_like_client(socket, node, log.clone()));
    (log, task)
}

/// Waits until every client has a response after `since` (Unix seconds); returns each
/// client's first such response.
async fn all_configured(logs: &[Shared], since: f64, what: &str) -> Vec<f64> {
    wait_for(what, Duration::from_secs(300), || {
        let firsts: Option<Vec<f64>> = logs
            .iter()
            .map(|l| {
                l.lock()
                    .unwrap()
                    .responses
                    .iter()
                    .copied()
                    .find(|t| *t > since)
            })
            .collect();
        async move { firsts }
    })
    .await
}

/// Each agent's `istio_agent_istiod_connection_failures` (its failed upstream dials).
async fn dial_failures(agents: &[Sidecar]) -> Vec<f64> {
    let mut out = vec![];
    for a in agents {
        let body = match http_get(a.status, "/stats/prometheus").await {
            Ok((200, b)) => b,
            other => panic!("metrics of {}: {other:?}", a.proc.name),
        };
        let v = body
            .lines()
            .find_map(|l| {
                l.strip_prefix("istio_agent_istiod_connection_failures")?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no istiod_connection_failures in {}", a.proc.name));
        out.push(v);
    }
    out
}

/// devplane's live xDS clients whose node id starts with `prefix`: the earliest stream open
/// of each, in Unix seconds.
fn opens(clients: &Value, prefix: &str) -> Vec<f64> {
    let mut by_node = std::collections::BTreeMap::<String, f64>::new();
    for c in clients["clients"].as_array().into_iter().flatten() {
        let (Some(id), Some(at)) = (c["node_id"].as_str(), c["connected_at"].as_f64()) else {
            continue;
        };
        if id.starts_with(prefix) {
            let e = by_node.entry(id.to_owned()).or_insert(at);
            *e = e.min(at);
        }
    }
    by_node.into_values().collect()
}

fn ms_since(ts: &[f64], t0: f64) -> Vec<f64> {
    ts.iter().map(|t| (t - t0) * 1000.0).collect()
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// (a): devplane killed and started again while every client is connected.
async fn devplane_restart(n: usize, outage: Duration, bucket: f64) {
    println!(
        "(a) devplane restarted under {n} connected agents, down for {} ms (load {})",
        outage.as_millis(),
        loadavg()
    );
    let mut dp = Devplane::start(&mesh(1)).await;
    let agents = start_agents(&dp, "storm", n).await;
    let (logs, tasks): (Vec<_>, Vec<_>) = agents
        .iter()
        .enumerate()
        .map(|(i, a)| spawn_client(a, node_id("storm", i)))
        .unzip();
    all_configured(&logs, 0.0, "every client's first response").await;
    let dials0 = dial_failures(&agents).await;

    let killed = unix_now();
    dp.stop();
    tokio::time::sleep(outage).await;
    dp.start_again().await;
    let back = dp.debug_json("/debug/clients").await["serving_since"]
        .as_f64()
        .unwrap();
    let configured = all_configured(&logs, back, "every client's config after the restart").await;
    let recovered = configured.iter().copied().fold(back, f64::max);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Everything the new process did: its start and the 200 reconnects.
    let cpu = cpu_secs(dp.proc.pid());
    let reopened = opens(
        &dp.debug_json("/debug/clients").await,
        "sidecar~127.0.0.1~storm",
    );
    let dials: Vec<f64> = dial_failures(&agents)
        .await
        .iter()
        .zip(&dials0)
        .map(|(a, b)| a - b)
        .collect();
    // Stream attempts made while devplane was down (each one an agent dial that failed), and
    // each client's first retry after the loss.
    let (mut attempts, mut first_retry) = (vec![], vec![]);
    for l in &logs {
        let l = l.lock().unwrap();
        attempts.push(
            l.attempts
                .iter()
                .filter(|t| **t > killed && **t < back)
                .count() as f64,
        );
        if let Some(t) = l.attempts.iter().find(|t| **t > killed) {
            first_retry.push((t - killed) * 1000.0);
        }
    }
    for t in tasks {
        t.abort();
    }
    println!(
        "  outage: killed → serving again {:.0} ms; every client configured {:.0} ms after that; devplane CPU since its restart {:.0} ms",
        (back - killed) * 1000.0,
        (recovered - back) * 1000.0,
        cpu * 1000.0
    );
    print_histogram(
        "clients' first retry after the loss (ms after the kill)",
        &first_retry,
        bucket,
    );
    print_histogram(
        "xDS stream re-opens at devplane (ms after serving again)",
        &ms_since(&reopened, back),
        bucket,
    );
    print_summary(
        "config again at the client (ms after serving again)",
        &ms_since(&configured, back),
    );
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    println!(
        "  dial attempts per agent during the outage: agent-side (istiod_connection_failures) median {:.0}, max {:.0}, total {:.0}; client stream attempts median {:.0}, max {:.0}, total {:.0}",
        median(dials.clone()),
        max(&dials),
        dials.iter().sum::<f64>(),
        median(attempts.clone()),
        max(&attempts),
        attempts.iter().sum::<f64>()
    );
    // No hot loop: every failed dial was a client's attempt (the agent never redials on its
    // own), and the attempts follow the backoff schedule.
    assert!(
        dials.iter().sum::<f64>() <= attempts.iter().sum::<f64>(),
        "agents dialled more often than their clients asked"
    );
    println!(
        "  re-opened streams at devplane: {} of {n}; load after: {}",
        reopened.len(),
        loadavg()
    );
    drop(agents);
    drop(dp);
}

/// (b): N agents started at once.
async fn burst_start(n: usize, bucket: f64) {
    println!("(b) {n} agents started at once (load {})", loadavg());
    let dp = Devplane::start(&mesh(1)).await;
    let token = dp.token("default", "burst", 3600).await;
    let env = proxyless_env();
    let t0 = unix_now();
    let mut agents = vec![];
    let mut logs = vec![];
    let mut tasks = vec![];
    let mut spawns = vec![];
    for i in 0..n {
        spawns.push(unix_now());
        let a = Sidecar::start_with_token(
            &dp,
            &format!("burst{i}"),
            "default",
            "burst",
            &env,
            json!({}),
            &token,
        )
        .await;
        let (l, t) = spawn_client(&a, node_id("burst", i));
        agents.push(a);
        logs.push(l);
        tasks.push(t);
    }
    let spawned = unix_now();
    for a in &mut agents {
        a.wait_ready(Duration::from_secs(300)).await;
    }
    let ready = unix_now();
    let configured = all_configured(&logs, 0.0, "every client's config").await;
    let done = configured.iter().copied().fold(t0, f64::max);
    let csrs: Vec<f64> = dp
        .debug_json("/debug/csr")
        .await
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["identity"].to_string().contains("burst"))
        .filter_map(|r| r["unix_time"].as_f64())
        .collect();
    let csr_errors = dp
        .debug_json("/debug/csr")
        .await
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| !r["error"].is_null())
        .count();
    let opened = opens(
        &dp.debug_json("/debug/clients").await,
        "sidecar~127.0.0.1~burst",
    );
    let retries: Vec<f64> = logs
        .iter()
        .map(|l| l.lock().unwrap().attempts.len() as f64 - 1.0)
        .collect();
    let mut why: Vec<String> = logs
        .iter()
        .flat_map(|l| l.lock().unwrap().failures.clone())
        .collect();
    why.sort();
    why.dedup();
    for t in tasks {
        t.abort();
    }
    println!(
        "  all {n} spawned in {:.0} ms, all ready after {:.0} ms, every client configured after {:.0} ms",
        (spawned - t0) * 1000.0,
        (ready - t0) * 1000.0,
        (done - t0) * 1000.0
    );
    print_histogram(
        "agent spawns (ms after the first)",
        &ms_since(&spawns, t0),
        bucket,
    );
    print_histogram(
        "CSR arrivals at the CA (ms after the first spawn)",
        &ms_since(&csrs, t0),
        bucket,
    );
    print_histogram(
        "xDS stream opens at devplane (ms after the first spawn)",
        &ms_since(&opened, t0),
        bucket,
    );
    let latency: Vec<f64> = configured
        .iter()
        .zip(&spawns)
        .map(|(c, s)| (c - s) * 1000.0)
        .collect();
    print_summary(
        "each agent's spawn → its client's first config (ms)",
        &latency,
    );
    println!(
        "  CSRs: {} for {n} agents ({csr_errors} failed); client stream retries before config: max {:.0}; load after: {}",
        csrs.len(),
        retries.iter().copied().fold(0.0, f64::max),
        loadavg()
    );
    for w in why.iter().take(3) {
        println!("    a failed attempt: {w}");
    }
    drop(agents);
    drop(dp);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    meshagent::app::raise_fd_limit();
    let n = env_num("STORM_N", 200) as usize;
    let outage = Duration::from_millis(env_num("STORM_OUTAGE_MS", 5000));
    let bucket = env_num("STORM_BUCKET_MS", 100) as f64;
    println!(
        "reconnect storm: {n} agents (DISABLE_ENVOY) against one devplane, Envoy-like ADS clients"
    );
    devplane_restart(n, outage, bucket).await;
    burst_start(n, bucket).await;
}
