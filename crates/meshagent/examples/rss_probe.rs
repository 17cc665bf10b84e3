//! Starts the agent binary (`MESHAGENT_BIN`) against devplane as the grpc-agent template runs
//! it (`RSS_MODE=grpc`, default) or as a plain sidecar (`RSS_MODE=sidecar`), waits until it is
//! ready, prints its pid and VmRSS, and keeps it running `RSS_HOLD_SECS` (default 30) so its
//! `/proc/<pid>/smaps` can be read. A measuring aid (docs/benchmarks-log.md, memory), not a
//! benchmark.
#![allow(
    clippy::disallowed_methods,
    reason = "a profiling example, not the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::Duration;

use meshagent_testkit::{Devplane, Sidecar, json, two_workload_mesh};

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
    tokio::time::sleep(Duration::from_secs(hold)).await;
    s.proc.kill();
}
