//! Starts the agent binary (`MESHAGENT_BIN`) against devplane as the grpc-agent template runs
//! it (`RSS_MODE=grpc`, default) or as a plain sidecar (`RSS_MODE=sidecar`), waits until it is
//! ready, prints its pid and VmRSS, and keeps it running `RSS_HOLD_SECS` (default 30) so its
//! `/proc/<pid>/smaps` can be read. From its spawn until 5 s after ready it reads the agent's
//! `/proc/<pid>/status` every millisecond and then prints the start-up peak (`VmHWM`, and the
//! largest VmRSS read with its anonymous and file parts: on this kernel `VmHWM` is recorded
//! from per-CPU counters and can read below a VmRSS seen earlier) and the settled RssAnon and
//! Pss. A measuring aid (docs/benchmarks-log.md, memory), not a benchmark.
#![allow(
    clippy::disallowed_methods,
    reason = "a profiling example, not the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Duration;

use meshagent_testkit::{Devplane, Sidecar, json, two_workload_mesh};

#[path = "../benches/support/mem.rs"]
mod mem;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let (mesh, ..) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    let mode = std::env::var("RSS_MODE").unwrap_or_else(|_| "grpc".into());
    let env: Vec<(&str, String)> = match mode.as_str() {
        "sidecar" => vec![],
        _ => vec![
            ("DISABLE_ENVOY", "true".to_owned()),
            ("ISTIO_META_DNS_CAPTURE", "false".to_owned()),
            ("OUTPUT_CERTS", "./etc/istio-output-certs".to_owned()),
            (
                "GRPC_XDS_BOOTSTRAP",
                "./etc/istio/proxy/grpc-bootstrap.json".to_owned(),
            ),
            ("ISTIO_META_GENERATOR", "grpc".to_owned()),
        ],
    };
    let mut s = Sidecar::start_with(&dp, "g", "default", "g", &env, json!({})).await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = std::thread::spawn({
        let (pid, stop) = (s.proc.pid(), stop.clone());
        move || sample(pid, &stop)
    });
    s.wait_ready(Duration::from_secs(60)).await;
    let hold: u64 = std::env::var("RSS_HOLD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", s.proc.pid())).unwrap();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .unwrap_or("");
    println!("mode {mode} pid {} {rss}", s.proc.pid());
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (max_rss, anon, file) = sampler.join().unwrap();
    let pid = s.proc.pid();
    let now = mem::Mem::of(pid);
    let mib = |k: u64| k as f64 / 1024.0;
    println!(
        "peak VmHWM {:.2} MiB, largest VmRSS read {:.2} (anon {:.2}, file {:.2}); 5 s after \
         ready: VmRSS {:.2}, RssAnon {:.2}, Pss {:.2} MiB",
        now.vm_hwm,
        mib(max_rss),
        mib(anon),
        mib(file),
        now.vm_rss,
        now.rss_anon,
        now.pss,
    );
    tokio::time::sleep(Duration::from_secs(hold.saturating_sub(5))).await;
    s.proc.kill();
}

/// Reads `/proc/<pid>/status` every millisecond until `stop`: the largest VmRSS seen (KiB),
/// with its RssAnon and RssFile.
fn sample(pid: u32, stop: &std::sync::atomic::AtomicBool) -> (u64, u64, u64) {
    let mut best = (0, 0, 0);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            break;
        };
        let field = |key: &str| -> u64 {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or(0)
        };
        let rss = field("VmRSS:");
        if rss > best.0 {
            best = (rss, field("RssAnon:"), field("RssFile:"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    best
}
