//! Time from SIGTERM to the agent's `/healthz/ready` answering 503, over `DRAIN_RUNS` rounds
//! (default 11): each round starts a sidecar (`MESHAGENT_BIN`, else the build's own) against
//! devplane with a real Envoy, waits until it is ready, sends SIGTERM and polls readiness back
//! to back. Each figure includes one readiness round trip (the poll that saw the 503). Prints
//! min / median / max in milliseconds. `DRAIN_START_DELAY` sets `MESHAGENT_DRAIN_START_DELAY`
//! (default 0s, Istio's behaviour). A measuring aid for BENCHMARKS.md, not a test.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Duration;

use meshagent_testkit::{Devplane, Sidecar, http_get, json, two_workload_mesh};
use tokio::time::Instant;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let runs: usize = std::env::var("DRAIN_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(11);
    let delay = std::env::var("DRAIN_START_DELAY").unwrap_or_else(|_| "0s".into());
    let (mesh, ..) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    let mut ms = Vec::with_capacity(runs);
    for _ in 0..runs {
        let mut s = Sidecar::start_with(
            &dp,
            "a",
            "default",
            "a",
            &[("MESHAGENT_DRAIN_START_DELAY", delay.clone())],
            json!({"terminationDrainDuration": "1s"}),
        )
        .await;
        s.wait_ready(Duration::from_secs(60)).await;
        let pid = nix::unistd::Pid::from_raw(i32::try_from(s.proc.pid()).unwrap());
        let t0 = Instant::now();
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        loop {
            if let Ok((503, _)) = http_get(s.status, "/healthz/ready").await {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "never turned 503");
        }
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
        let end = Instant::now() + Duration::from_secs(30);
        while s.proc.try_wait().is_none() && Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    ms.sort_by(f64::total_cmp);
    println!(
        "SIGTERM to readiness 503 over {runs} rounds (MESHAGENT_DRAIN_START_DELAY={delay}): min {:.2} ms, median {:.2} ms, max {:.2} ms",
        ms[0],
        ms[ms.len() / 2],
        ms[ms.len() - 1]
    );
}
