//! What the status port's debug views and the opt-in CPU profiler cost the shipped agent: the
//! views must cost nothing until asked, and `/debug/xdsz` must answer quickly with 10,000
//! clusters.
//!
//! Two sidecars of the same binary (`meshagent proxy sidecar`, testkit `Sidecar`, each with a
//! real Envoy) against one devplane: `a` without `MESHAGENT_PROFILING` (the profiler compiled
//! in, off), `b` with `MESHAGENT_PROFILING=true` (on, idle). For each, once ready and settled
//! (3 s after ready, then the last of five 1 s samples): VmRSS, RssAnon, Pss, and idle CPU
//! over `VIEWS_IDLE_SECS` (default 20). Then on `a`: every debug view requested once and the
//! memory settled again; devplane switches the mesh to 10,000 services (10,000 CDS clusters +
//! EDS through the agent to Envoy), and `/debug/xdsz` is timed over 50 requests once Envoy has
//! them all (p50 / p99 / max, answer size). On `b`: a 5 s CPU profile and the memory after it
//! (what pprof-rs keeps once used).
//!
//! Run: `make bench`, or `make agent && cargo build --release --bins &&
//! MESHAGENT_BIN=$PWD/target/dist/meshagent cargo bench -p meshagent --bench views`.
//! Knobs: `VIEWS_N` (default 10000), `VIEWS_IDLE_SECS` (default 20).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)] // a benchmark

mod support;
use support::mem::Mem;
use support::{cpu_secs, loadavg};

use std::net::SocketAddr;
use std::time::Duration;

use meshagent_testkit::{Devplane, Sidecar, free_port, http_get};
use tokio::time::Instant;

/// Every GET view of the status port but the CPU profile.
const VIEWS: [&str; 12] = [
    "/",
    "/debug/certz",
    "/debug/xdsz",
    "/debug/dnsz",
    "/debug/dnsz?name=s1.default.svc.cluster.local&type=A",
    "/debug/ndsz",
    "/debug/wasmz",
    "/debug/config_dump",
    "/logging",
    "/debug/logs",
    "/debug/tokioz",
    "/drain/status",
];

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

/// Workloads a and b plus `n` services backed by b (one outbound cluster + EDS each).
fn mesh(n: usize, ports: [u16; 4]) -> String {
    let [a_app, a_in, b_app, b_in] = ports;
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

/// Settled: 3 s, then the last of five 1 s samples.
async fn settled(pid: u32) -> Mem {
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut m = Mem::of(pid);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        m = Mem::of(pid);
    }
    m
}

async fn active_clusters(admin: SocketAddr) -> Option<(u64, u64)> {
    let (_, body) = http_get(
        admin,
        "/stats?filter=^cluster_manager\\.(active|warming)_clusters$",
    )
    .await
    .ok()?;
    let val = |k: &str| -> Option<u64> {
        body.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}: ")))
            .and_then(|v| v.trim().parse().ok())
    };
    Some((
        val("cluster_manager.active_clusters")?,
        val("cluster_manager.warming_clusters")?,
    ))
}

fn pct(s: &[f64], q: f64) -> f64 {
    s[((s.len() as f64 * q) as usize).min(s.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = env_num("VIEWS_N", 10_000) as usize;
    let idle = Duration::from_secs(env_num("VIEWS_IDLE_SECS", 20));
    let ports = [free_port(), free_port(), free_port(), free_port()];
    let dp = Devplane::start(&mesh(10, ports)).await;
    let bin = meshagent_testkit::workspace_bin("meshagent");
    let size = std::fs::metadata(&bin).map(|m| m.len()).unwrap_or(0);
    println!(
        "views: {} ({size} bytes), 2 sidecars, devplane, real Envoy; load at start {}",
        bin.display(),
        loadavg()
    );

    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    let mut b = Sidecar::start(
        &dp,
        "b",
        "default",
        "b",
        &[("MESHAGENT_PROFILING", "true".into())],
    )
    .await;
    a.wait_ready(Duration::from_secs(60)).await;
    b.wait_ready(Duration::from_secs(60)).await;
    let (pa, pb) = (a.proc.pid(), b.proc.pid());
    let (ma, mb) = (settled(pa).await, settled(pb).await);
    let (ca, cb) = (cpu_secs(pa), cpu_secs(pb));
    tokio::time::sleep(idle).await;
    let (ia, ib) = (
        (cpu_secs(pa) - ca) / idle.as_secs_f64() * 100.0,
        (cpu_secs(pb) - cb) / idle.as_secs_f64() * 100.0,
    );
    println!("\n| agent | state | VmRSS MiB | RssAnon MiB | Pss MiB | VmHWM MiB | idle CPU % |");
    println!("|---|---|---|---|---|---|---|");
    let row = |who: &str, state: &str, m: &Mem, cpu: &str| {
        println!(
            "| {who} | {state} | {:.2} | {:.2} | {:.2} | {:.2} | {cpu} |",
            m.vm_rss, m.rss_anon, m.pss, m.vm_hwm
        );
    };
    row("a", "profiler off, no view asked", &ma, &format!("{ia:.3}"));
    row(
        "b",
        "profiler on, idle, no view asked",
        &mb,
        &format!("{ib:.3}"),
    );

    // Every view once, then settled again.
    let status_a = SocketAddr::from(([127, 0, 0, 1], a.status.port()));
    for v in VIEWS {
        let (code, body) = http_get(status_a, v).await.unwrap();
        println!("  {v}: {code}, {} bytes", body.len());
    }
    let ma2 = settled(pa).await;
    row("a", "after every view once", &ma2, "—");
    println!(
        "  views' cost: RssAnon {:+.3} MiB ({:+.1} %), Pss {:+.3} MiB",
        ma2.rss_anon - ma.rss_anon,
        (ma2.rss_anon / ma.rss_anon - 1.0) * 100.0,
        ma2.pss - ma.pss
    );

    // A CPU profile on b, and what stays after it.
    let status_b = SocketAddr::from(([127, 0, 0, 1], b.status.port()));
    let t = Instant::now();
    let (code, body) = http_get(status_b, "/debug/pprof/profile?seconds=5")
        .await
        .unwrap();
    println!(
        "  b: 5 s CPU profile: {code}, {} bytes, {:.2} s",
        body.len(),
        t.elapsed().as_secs_f64()
    );
    let mb2 = settled(pb).await;
    row("b", "after one 5 s CPU profile", &mb2, "—");

    // 10,000 clusters through a's agent to its Envoy, then /debug/xdsz timed.
    dp.write_mesh(&mesh(n, ports));
    let t0 = Instant::now();
    loop {
        if let Some((active, warming)) = active_clusters(a.admin).await
            && active >= n as u64
            && warming == 0
        {
            break;
        }
        if t0.elapsed() > Duration::from_secs(300) {
            a.proc.print_log();
            panic!("the push of {n} clusters did not reach Envoy in 300 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "\n{n}-cluster push applied by a's Envoy in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let ma3 = settled(pa).await;
    row("a", &format!("after the {n}-cluster push"), &ma3, "—");
    let mut lat = vec![];
    let mut bytes = 0;
    for _ in 0..50 {
        let t = Instant::now();
        let (code, body) = http_get(status_a, "/debug/xdsz").await.unwrap();
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(code, 200, "{body}");
        bytes = body.len();
    }
    lat.sort_by(f64::total_cmp);
    println!(
        "/debug/xdsz with {n} clusters, 50 requests (connect + answer), load {}: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms, {bytes} bytes",
        loadavg(),
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat[lat.len() - 1]
    );
    let ma4 = settled(pa).await;
    row("a", "after 50 xdsz with 10,000 clusters", &ma4, "—");
    for s in [&mut a, &mut b] {
        if let Some(st) = s.proc.try_wait() {
            s.proc.print_log();
            panic!("agent exited: {st}");
        }
    }
    println!("load at end {}", loadavg());
}
