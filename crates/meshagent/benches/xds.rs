//! xDS proxy benchmark: time for a real Envoy to receive and apply (and so ACK) the initial
//! push of N clusters (plus their endpoints), fed directly by devplane vs through the agent,
//! in the same run, alternating the two paths per repetition.
//!
//! The agent runs in-process on its own thread with a current-thread Tokio runtime, so that
//! thread's CPU time (`/proc/thread-self/stat`) is exactly the proxy's work; peak RSS is the
//! process's `VmHWM`, reset before each push through `/proc/self/clear_refs`.
//!
//! Run: `make bench` (or `cargo build --release --bins && cargo bench -p meshagent --bench xds`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // a benchmark fails loudly

#[path = "../tests/xds_support/mod.rs"]
mod xds_support;

use std::path::Path;
use std::time::Duration;

use meshagent::metrics::status_kib;
use meshagent::xds::Metrics;
use meshagent_proto::type_url;
use meshagent_testkit::static_sds::StaticSds;
use meshagent_testkit::{
    DEADLINE, Devplane, Envoy, Value, direct_bootstrap, free_port, json, wait_for,
};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use xds_support::*;

/// Repetitions per size (`XDS_BENCH_REPS` overrides); the two paths alternate.
const REPS: usize = 5;
/// Linux USER_HZ: the unit of utime/stime in /proc stat files.
const CLOCK_TICKS: f64 = 100.0;

fn mesh(n: usize) -> String {
    let (a_app, a_in, b_app, b_in) = (free_port(), free_port(), free_port(), free_port());
    let mut y = format!(
        "workloads:\n  - name: a\n    serviceAccount: a\n    ports: [{{name: http, port: {a_app}, inboundPort: {a_in}}}]\n  - name: b\n    serviceAccount: b\n    ports: [{{name: http, port: {b_app}, inboundPort: {b_in}}}]\nservices:\n"
    );
    for i in 0..n {
        y.push_str(&format!(
            "  - name: s{i}\n    selector: [b]\n    ports: [{{port: 80, targetPort: {b_app}}}]\n"
        ));
    }
    y
}

fn thread_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // fields 14 and 15 of stat(5) are utime and stime; `after` starts at field 3.
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / CLOCK_TICKS
}

enum Cmd {
    Cpu(oneshot::Sender<f64>),
}

/// Starts the agent on its own thread; returns its socket, metrics and a command channel.
fn spawn_agent(
    dp_addr: String,
    root: String,
    token: String,
    cwd: &Path,
) -> (std::path::PathBuf, Metrics, mpsc::UnboundedSender<Cmd>) {
    let cwd = cwd.to_path_buf();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let agent = Agent::start(&cwd, &dp_addr, Some(&token), &[("XDS_ROOT_CA", &root)]);
            let (tx, mut rx) = mpsc::unbounded_channel();
            ready_tx
                .send((
                    agent.handle.socket().to_path_buf(),
                    agent.handle.metrics().clone(),
                    tx,
                ))
                .unwrap();
            while let Some(Cmd::Cpu(reply)) = rx.recv().await {
                let _ = reply.send(thread_cpu_seconds());
            }
        });
    });
    ready_rx.recv().unwrap()
}

struct Sample {
    /// Messages each way through the agent during the push.
    msgs: (u64, u64),
    secs: f64,
    cpu: f64,
    bytes: u64,
    rss_growth_kib: f64,
}

async fn agent_cpu(cmd: &mpsc::UnboundedSender<Cmd>) -> f64 {
    let (tx, rx) = oneshot::channel();
    cmd.send(Cmd::Cpu(tx)).unwrap();
    rx.await.unwrap()
}

/// Types Envoy must have ACKed for the push to count as received and applied.
const PUSHED: [&str; 3] = [type_url::CLUSTER, type_url::ENDPOINT, type_url::LISTENER];

/// devplane's live ADS client carrying Envoy's node (direct, or the agent's upstream).
async fn envoy_client(dp: &Devplane) -> Option<Value> {
    dp.acks()
        .await
        .into_iter()
        .find(|c| c["node_id"] == NODE_ID)
}

/// One push: start Envoy; the clock stops when devplane has Envoy's ACK of every pushed
/// type (CDS, EDS, LDS), read from devplane's cheap `/debug/acks`, so that Envoy's main
/// thread, busy applying thousands of clusters, is not also serving admin requests. After
/// the clock, Envoy's own stats must show every cluster active and none warming.
async fn push(dp: &Devplane, bootstrap: Value, expect: u64) -> f64 {
    // The previous Envoy's stream (direct, or via the agent) must be gone first.
    wait_for("previous ADS client to disconnect", DEADLINE, || async {
        envoy_client(dp).await.is_none().then_some(())
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let envoy = Envoy::start(bootstrap, dir.path());
    loop {
        if let Some(c) = envoy_client(dp).await {
            assert!(
                c["nacks"].as_object().is_none_or(|m| m.is_empty()),
                "Envoy NACKed the push: {c}"
            );
            if PUSHED.iter().all(|t| c["acked"].get(*t).is_some()) {
                break;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "push of {expect} clusters timed out"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    wait_for("every cluster active, none warming", DEADLINE, || async {
        let active = envoy.stat("cluster_manager.active_clusters").await?;
        let warming = envoy.stat("cluster_manager.warming_clusters").await?;
        (active >= expect && warming == 0).then_some(())
    })
    .await;
    drop(envoy);
    secs
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let reps: usize = std::env::var("XDS_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(REPS);
    println!(
        "xDS push: Envoy 1.40 initial Delta ADS push of N clusters (+N EDS), direct vs via meshagent; median of {reps}"
    );
    println!(
        "{:>6} {:>10} {:>10} {:>7} {:>14} {:>12} {:>12}",
        "N", "direct_s", "agent_s", "ratio", "agent_cpu_ms/MB", "max_msg_MiB", "rss_peak_MiB"
    );
    // XDS_BENCH_N=100,500 overrides the sizes (quick checks).
    let sizes: Vec<usize> = std::env::var("XDS_BENCH_N")
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|_| vec![1_000, 10_000]);
    for n in sizes {
        let dp = Devplane::start(&mesh(n)).await;
        let token = dp.token("default", "a", 3600).await;
        let work = tempfile::tempdir().unwrap();
        let (chain, key, root_pem) =
            meshagent_testkit::ca_client::workload_cert(dp.grpc_addr, &dp.root_cert_path(), &token)
                .await;
        let sds = StaticSds::start(work.path(), &chain, &key, &root_pem);
        let agent_dir = work.path().join("agent");
        std::fs::create_dir_all(&agent_dir).unwrap();
        let (socket, metrics, cmd) = spawn_agent(
            dp.grpc_addr.to_string(),
            dp.root_cert_path().to_string_lossy().into_owned(),
            token.clone(),
            &agent_dir,
        );
        // outbound clusters + inbound|… + static xds-grpc and sds-grpc
        let expect = n as u64 + 3;
        let mut direct_b = direct_bootstrap(
            NODE_ID,
            json!({"NAMESPACE": "default", "NAME": "a-5f7d", "CLUSTER_ID": "Kubernetes"}),
            dp.grpc_addr,
            &dp.root_cert_path(),
            &token,
            true,
        );
        // Same node as the agent path's bootstrap: only the way to devplane differs.
        direct_b["node"]["cluster"] = json!("a.default");
        meshagent_testkit::add_sds_cluster(&mut direct_b, &sds.socket);
        let agent_b = bootstrap(&socket, true, Some(&sds.socket));

        let (mut direct, mut via, mut samples) = (vec![], vec![], vec![]);
        for rep in 0..reps {
            // Alternate which path goes first, so neither always follows the other's teardown.
            if rep % 2 == 0 {
                direct.push(push(&dp, direct_b.clone(), expect).await);
            }
            std::fs::write("/proc/self/clear_refs", "5").unwrap();
            let rss0 = status_kib("VmRSS:").unwrap();
            let (cpu0, bytes0) = (agent_cpu(&cmd).await, metrics.response_bytes.get());
            let msgs0 = (metrics.requests.get(), metrics.responses.get());
            let secs = push(&dp, agent_b.clone(), expect).await;
            let s = Sample {
                msgs: (
                    metrics.requests.get() - msgs0.0,
                    metrics.responses.get() - msgs0.1,
                ),
                secs,
                cpu: agent_cpu(&cmd).await - cpu0,
                bytes: metrics.response_bytes.get() - bytes0,
                rss_growth_kib: status_kib("VmHWM:").unwrap() - rss0,
            };
            via.push(s.secs);
            samples.push(s);
            if rep % 2 == 1 {
                direct.push(push(&dp, direct_b.clone(), expect).await);
            }
        }
        let fmt = |v: &[f64]| {
            v.iter()
                .map(|x| format!("{x:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let (all_d, all_a) = (fmt(&direct), fmt(&via));
        let (d, a) = (median(direct), median(via));
        let mb: f64 = samples.iter().map(|s| s.bytes as f64).sum::<f64>() / 1e6;
        let cpu: f64 = samples.iter().map(|s| s.cpu).sum();
        let (reqs, resps) = samples.last().map(|s| s.msgs).unwrap_or_default();
        println!("        per push: {reqs} requests from Envoy, {resps} responses from devplane");
        let rss = samples.iter().map(|s| s.rss_growth_kib).fold(0.0, f64::max) / 1024.0;
        println!(
            "{n:>6} {d:>10.3} {a:>10.3} {:>7.3} {:>14.1} {:>12.2} {:>12.2}",
            a / d,
            cpu * 1000.0 / mb,
            metrics.upstream_max.get() / 1048576.0,
            rss
        );
        println!(
            "        ({mb:.1} MB forwarded over {reps} pushes, agent CPU {cpu:.2} s; direct s: {all_d}; agent s: {all_a}; load {})",
            std::fs::read_to_string("/proc/loadavg")
                .unwrap_or_default()
                .trim()
        );
        drop(sds);
    }
}
