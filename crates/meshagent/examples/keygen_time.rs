//! RSA-2048 workload key generation time on this machine, one thread, the agent's own code path
//! (`WorkloadKey::generate`: rcgen over aws-lc): the distribution behind the RSA start-up
//! figures in docs/benchmarks-log.md. `cargo build --release --example keygen_time &&
//! target/release/examples/keygen_time [N]` (N keys, default 40).
#![allow(
    clippy::disallowed_methods,
    reason = "a profiling example, not the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::disallowed_types)] // a measuring tool

use meshagent::identity::keys::{KeyKind, KeySpec, WorkloadKey};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
        .max(1);
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n {
        let t = std::time::Instant::now();
        WorkloadKey::generate(KeySpec {
            kind: KeyKind::Rsa(2048),
            pkcs8: false,
        })
        .unwrap();
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    ms.sort_by(f64::total_cmp);
    println!(
        "RSA 2048, {n} keys, ms: p10 {:.1}  p50 {:.1}  p90 {:.1}  max {:.1}  mean {:.1}",
        ms[n / 10],
        ms[n / 2],
        ms[n * 9 / 10],
        ms[n - 1],
        ms.iter().sum::<f64>() / n as f64
    );
}
