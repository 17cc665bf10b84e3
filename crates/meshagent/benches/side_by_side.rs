//! meshagent beside the real pilot-agent, one run, same machine, same Envoy, same istiod-box
//! (Istio's own config generation and CA, `compat/istiod-box`): each round starts one agent as
//! a pod runs it (`proxy sidecar`, token and root in its working directory, RSA-2048 or ECDSA
//! keys) and measures, for the agent process alone (not its Envoy):
//!
//! * start to ready: `spawn()` → `/healthz/ready` 200 (first CSR signed by Istio's CA, SDS,
//!   istiod's config through the agent, Envoy LIVE);
//! * memory once ready and settled (10 s after ready, then the last of five 1 s samples):
//!   VmRSS, RssAnon, Pss (`smaps_rollup`: shared pages divided among their mappers) and the
//!   peak VmHWM since start, which is what a memory limit sees;
//! * idle CPU while connected: CPU time over `SIDE_IDLE_SECS` (default 60; the goal's window
//!   is 10 minutes, `SIDE_IDLE_SECS=600`) after settling, as a share of one core, from all
//!   threads' `schedstat` (ns). The `/proc/<pid>/stat` figure beside it counts 10 ms clock
//!   ticks: its resolution, one tick over the window, is printed with it (0.017 % of a core
//!   over 60 s), so two agents within a tick of each other are not told apart by it.
//!
//! The floors, same run (support `floors`): Envoy straight to istiod-box with a certificate
//! already served (meshagent's generated bootstrap and Envoy flags, `xds-grpc` re-pointed at
//! istiod-box) → `/ready` LIVE, the path minus any agent; the CA round trip on its own (TLS,
//! key, `CreateCertificate`); one RSA-2048 key generation (rcgen, as the agent does it). With
//! them: each agent's (start − CA round trip) / Envoy direct, and the best ratio to
//! pilot-agent any agent can reach: max(Envoy direct, key + CA) / pilot-agent if key and CSR
//! fully overlap Envoy's start, (Envoy direct + key + CA) / pilot-agent if nothing overlaps.
//!
//! Rounds alternate the agents (`SIDE_ROUNDS`, default 5, each per key type); medians are
//! printed with the ratio meshagent / pilot-agent. `SIDE_TRACE=1` prints each agent's log as
//! it turns ready (when its key, certificate and config came). Run: `make bench`, or `make agent
//! pilot-agent istiod-box envoy && MESHAGENT_BIN=$PWD/target/dist/meshagent cargo bench -p
//! meshagent --bench side_by_side`.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use support::mem::{pss_kib, status_kib};

use std::time::Duration;

use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, mesh_with_free_ports, start_agent, workload_a,
};
use meshagent_testkit::{http_get, json};
use support::floors::{EnvoyDirect, ca_round_trip_ms, rsa_keygen_ms};
use support::{TICK_SECS, cpu_ms, cpu_secs};
use tokio::time::Instant;

mod support;

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(default)
}

/// The figures of one round, in this order.
const FIGURES: [&str; 7] = [
    "start to ready, ms",
    "VmRSS settled, MiB",
    "RssAnon settled, MiB",
    "Pss settled, MiB",
    "VmHWM peak, MiB",
    "idle CPU, % of a core",
    "idle CPU, stat ticks, %",
];

fn median(v: &[f64]) -> f64 {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn one_round(istiod: &IstiodBox, kind: AgentKind, ecdsa: bool, idle: Duration) -> [f64; 7] {
    let env: &[(&str, &str)] = if ecdsa {
        &[("ECC_SIGNATURE_ALGORITHM", "ECDSA")]
    } else {
        &[]
    };
    let pod = PodSpec {
        workload: "a",
        namespace: "default",
        service_account: "a",
        ip: "127.0.0.1",
        proxy_config: json!({}),
        env,
    };
    let t0 = Instant::now();
    let mut sidecar = start_agent(istiod, kind, &pod).await;
    let pid = sidecar.proc.pid();
    let deadline = t0 + Duration::from_secs(60);
    loop {
        if let Ok((200, _)) = http_get(sidecar.status, "/healthz/ready").await {
            break;
        }
        if Instant::now() > deadline {
            sidecar.proc.print_log();
            panic!("{kind:?} not ready within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ready_ms = t0.elapsed().as_secs_f64() * 1000.0;
    if std::env::var_os("SIDE_TRACE").is_some() {
        println!("--- {kind:?} ecdsa={ecdsa} ready {ready_ms:.1} ms");
        sidecar.proc.print_log();
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let mut last = [f64::NAN; 3];
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        last = [
            status_kib(pid, "VmRSS:"),
            status_kib(pid, "RssAnon:"),
            pss_kib(pid),
        ];
    }
    let hwm = status_kib(pid, "VmHWM:");
    let (c0, t0) = (cpu_ms(pid), cpu_secs(pid));
    tokio::time::sleep(idle).await;
    let idle_share = (cpu_ms(pid) - c0) / 1000.0 / idle.as_secs_f64();
    let idle_ticks = (cpu_secs(pid) - t0) / idle.as_secs_f64();
    sidecar.proc.kill();
    [
        ready_ms,
        last[0] / 1024.0,
        last[1] / 1024.0,
        last[2] / 1024.0,
        hwm / 1024.0,
        idle_share * 100.0,
        idle_ticks * 100.0,
    ]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let rounds = env_num("SIDE_ROUNDS", 5);
    let idle = Duration::from_secs(env_num("SIDE_IDLE_SECS", 60));
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    println!(
        "side by side: {rounds} rounds per agent and key type, idle window {} s, one istiod-box, \
         Envoy {}",
        idle.as_secs(),
        meshagent_testkit::envoy_bin().display()
    );
    println!(
        "idle CPU resolution of /proc/<pid>/stat: one {:.0} ms tick over {} s = {:.4} % of a core",
        TICK_SECS * 1000.0,
        idle.as_secs(),
        TICK_SECS / idle.as_secs_f64() * 100.0
    );
    // What an Envoy-direct start needs, from one meshagent run (not counted).
    let pod = PodSpec::new("a", "127.0.0.1");
    let warm = start_agent(&istiod, AgentKind::Meshagent, &pod).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(http_get(warm.status, "/healthz/ready").await, Ok((200, _))) {
        if Instant::now() > deadline {
            warm.proc.print_log();
            panic!("meshagent not ready within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let direct =
        EnvoyDirect::capture(&istiod, warm.cwd.path(), warm.proc.pid(), "default", "a").await;
    drop(warm);
    let token = istiod.token("default", "a").await;
    // Warm Envoy's and the CA's paths once.
    drop(direct.start_ready().await);
    let _ = ca_round_trip_ms(&istiod, &token).await;
    for ecdsa in [false, true] {
        let keys = if ecdsa { "ECDSA P-256" } else { "RSA-2048" };
        // [agent][figure] → samples; agent 0 is pilot-agent, 1 meshagent.
        let mut by_kind: [[Vec<f64>; 7]; 2] = Default::default();
        let (mut envoy_direct, mut ca, mut keygen) = (vec![], vec![], vec![]);
        for _ in 0..rounds {
            for (i, kind) in [AgentKind::PilotAgent, AgentKind::Meshagent]
                .into_iter()
                .enumerate()
            {
                let r = one_round(&istiod, kind, ecdsa, idle).await;
                for (f, v) in r.into_iter().enumerate() {
                    by_kind[i][f].push(v);
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            let (e, _dir, ms) = direct.start_ready().await;
            envoy_direct.push(ms);
            drop(e);
            ca.push(ca_round_trip_ms(&istiod, &token).await);
            if !ecdsa {
                keygen.push(tokio::task::spawn_blocking(rsa_keygen_ms).await.unwrap());
            }
        }
        println!("\n{keys}: medians of {rounds} (pilot-agent | meshagent | ratio)");
        for (f, name) in FIGURES.iter().enumerate() {
            let (p, m) = (median(&by_kind[0][f]), median(&by_kind[1][f]));
            // Idle shares are hundredths of a percent: more digits, and the samples.
            if f >= 5 {
                println!(
                    "  {name:<24} {p:>9.4} | {m:>9.4} | {:>6.3}   (samples {:.4?} | {:.4?})",
                    m / p,
                    by_kind[0][f],
                    by_kind[1][f]
                );
            } else {
                println!("  {name:<24} {p:>9.2} | {m:>9.2} | {:>6.3}", m / p);
            }
        }
        let (p, m) = (median(&by_kind[0][0]), median(&by_kind[1][0]));
        let (d, c) = (median(&envoy_direct), median(&ca));
        let k = if ecdsa { 0.0 } else { median(&keygen) };
        println!(
            "  floors: Envoy straight to istiod-box, certificate served → /ready LIVE {d:.1} ms \
             (samples {envoy_direct:.0?}); CA round trip {c:.1} ms{}",
            if ecdsa {
                String::new()
            } else {
                format!("; RSA-2048 key generation {k:.1} ms (samples {keygen:.0?})")
            }
        );
        println!(
            "  (start − CA round trip) / Envoy direct: pilot-agent {:.2}, meshagent {:.2}",
            (p - c) / d,
            (m - c) / d
        );
        println!(
            "  best ratio to pilot-agent any agent can reach: {:.3} (max(Envoy direct, key + CA) / \
             pilot-agent: key and CSR fully behind Envoy's start) .. {:.3} ((Envoy direct + key + \
             CA) / pilot-agent: nothing overlapped); meshagent {:.3}",
            d.max(k + c) / p,
            (d + k + c) / p,
            m / p
        );
    }
}
