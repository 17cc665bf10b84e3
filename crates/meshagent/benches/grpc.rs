//! Proxyless gRPC at scale: N agents in `DISABLE_ENVOY` mode (the grpc-agent template) against
//! one devplane, each with one small Rust xDS client on its socket (SotW ADS, node with
//! `GENERATOR=grpc`, subscribed to one EDS cluster, ACKing every response, as a gRPC client
//! does). Reported:
//!
//! * agent RSS once ready with its client attached (median and max of N; VmRSS);
//! * devplane CPU for one config change pushed to all N clients;
//! * the time for one config change (an endpoint added to or removed from the service) to
//!   reach all N clients through their agents, against the same N clients connected to
//!   devplane directly (TLS and token, as the agents connect); phases alternate.
//!
//! Run: `make bench`, or `make agent && cargo build --release --bins &&
//! MESHAGENT_BIN=$PWD/target/dist/meshagent cargo bench -p meshagent --bench grpc`.
//! `GRPC_BENCH_N=50,200` chooses the sizes; `GRPC_BENCH_CHANGES` the changes per phase.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::Path;
use std::time::Duration;

use meshagent::control_plane::{Keepalive, Roots, Target, Tls};
use meshagent_testkit::{Devplane, wait_for};
use support::{Seen, attach, cpu_secs, median, mesh, rss_mib, start_agents, uds_channel};
use tokio::time::Instant;

/// Writes the mesh with `endpoints` endpoints and returns (time for all clients to see a
/// new version, devplane CPU seconds meanwhile).
async fn change(dp: &Devplane, seen: &[Seen], endpoints: usize) -> (f64, f64) {
    let before: Vec<usize> = seen.iter().map(|s| s.lock().unwrap().len()).collect();
    let cpu0 = cpu_secs(dp.proc.pid());
    let t0 = Instant::now();
    dp.write_mesh(&mesh(endpoints));
    let views = seen.to_vec();
    let last = wait_for(
        "the change to reach every client",
        Duration::from_secs(120),
        || {
            let mut latest = t0;
            let mut all = true;
            for (s, n) in views.iter().zip(&before) {
                let v = s.lock().unwrap();
                match v.get(*n) {
                    Some((_, at)) => latest = latest.max(*at),
                    None => all = false,
                }
            }
            async move { all.then_some(latest) }
        },
    )
    .await;
    // Let devplane finish what it does after the last push before reading its CPU.
    tokio::time::sleep(Duration::from_millis(200)).await;
    (
        last.duration_since(t0).as_secs_f64() * 1000.0,
        cpu_secs(dp.proc.pid()) - cpu0,
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    meshagent::app::raise_fd_limit();
    let sizes: Vec<usize> = std::env::var("GRPC_BENCH_N")
        .unwrap_or_else(|_| "50,200".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let changes: usize = std::env::var("GRPC_BENCH_CHANGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    println!("proxyless gRPC: N agents (DISABLE_ENVOY) against one devplane, one xDS client each");
    for n in sizes {
        let dp = Devplane::start(&mesh(1)).await;
        let started = Instant::now();
        let agents = start_agents(&dp, "bench", n).await;
        let ready_s = started.elapsed().as_secs_f64();
        let token = dp.token("default", "bench", 3600).await;
        let target = Target {
            addr: format!("localhost:{}", dp.grpc_addr.port()),
            tls: Some(Tls {
                roots: Roots::File(dp.root_cert_path()),
                server_name: "istiod.istio-system.svc".into(),
                client_cert: None,
            }),
        };
        let direct_channels = || {
            (0..n)
                .map(|_| {
                    (
                        meshagent::control_plane::channel(
                            &target,
                            Path::new("/"),
                            Keepalive::default(),
                        )
                        .unwrap(),
                        Some(token.clone()),
                    )
                })
                .collect::<Vec<_>>()
        };
        let agent_channels = || {
            agents
                .iter()
                .map(|a| (uds_channel(a.cwd.path().join("etc/istio/proxy/XDS")), None))
                .collect::<Vec<_>>()
        };

        let (mut via, mut direct, mut cpu_via, mut cpu_direct) = (vec![], vec![], vec![], vec![]);
        let mut rss = vec![];
        let mut endpoints = 1;
        for phase in 0..2 {
            for through_agents in [true, false] {
                let chans = if through_agents {
                    agent_channels()
                } else {
                    direct_channels()
                };
                let (seen, tasks) = attach(chans).await;
                if through_agents && phase == 0 {
                    rss = agents.iter().map(|a| rss_mib(a.proc.pid())).collect();
                }
                for _ in 0..changes {
                    endpoints = if endpoints == 1 { 2 } else { 1 };
                    let (ms, cpu) = change(&dp, &seen, endpoints).await;
                    if through_agents {
                        via.push(ms);
                        cpu_via.push(cpu);
                    } else {
                        direct.push(ms);
                        cpu_direct.push(cpu);
                    }
                }
                for t in tasks {
                    t.abort();
                }
                // Let the streams close before the other path attaches.
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        let rss_max = rss.iter().copied().fold(0.0, f64::max);
        let (v, d) = (median(via.clone()), median(direct.clone()));
        println!(
            "N={n:>3}: {n} agents ready in {ready_s:.1} s; agent RSS median {:.2} MiB, max {rss_max:.2} MiB",
            median(rss.clone())
        );
        println!(
            "       config change to all N clients: through agents {v:.1} ms, direct {d:.1} ms (median of {} each), ratio {:.2}",
            via.len(),
            v / d
        );
        println!(
            "       devplane CPU per change: through agents {:.0} ms, direct {:.0} ms",
            median(cpu_via) * 1000.0,
            median(cpu_direct) * 1000.0
        );
        println!("       raw (ms): via {via:.1?} direct {direct:.1?}");
        drop(agents);
        drop(dp);
    }
}
