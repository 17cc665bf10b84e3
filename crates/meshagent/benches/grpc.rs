//! Proxyless gRPC at scale: N agents in `DISABLE_ENVOY` mode (the grpc-agent template) against
//! one devplane, each with one small Rust xDS client on its socket (SotW ADS, node with
//! `GENERATOR=grpc`, subscribed to one EDS cluster, ACKing every response, as a gRPC client
//! does). Reported:
//!
//! * agent RSS once ready with its client attached (median and max of N; VmRSS), and again
//!   after all the changes (settled: start-up's code pages released);
//! * devplane CPU for one config change pushed to all N clients;
//! * the time for one config change (an endpoint added to or removed from the service) to
//!   reach all N clients through their agents, against the same N clients connected to
//!   devplane directly (TLS and token, as the agents connect). A change is posted to devplane's
//!   `POST /debug/mesh` (the path of a mesh-file change without the file poll) and timed from
//!   devplane's publish; it is split into devplane's part (publish → the last stream handed
//!   its response, from `/debug/acks` `sent`) and the delivery (per client: devplane's hand-over
//!   → the client's receipt). Paths alternate in blocks, each block starting with one uncounted
//!   change.
//!
//! Run: `make bench`, or `make agent && cargo build --release --bins &&
//! MESHAGENT_BIN=$PWD/target/dist/meshagent cargo bench -p meshagent --bench grpc`.
//! `GRPC_BENCH_N=50,200` chooses the sizes; `GRPC_BENCH_CHANGES` the counted changes per path
//! (default 20), `GRPC_BENCH_BLOCK` the changes per block (default 5).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use meshagent::control_plane::{Keepalive, Roots, Target, Tls};
use meshagent_proto::type_url;
use meshagent_testkit::{Devplane, wait_for};
use support::{
    Seen, attach, cpu_secs, loadavg, median, mesh, node_id, quantile, rss_mib, start_agents,
    uds_channel, unix_now,
};
use tokio::time::Instant;

/// One config change as measured.
#[derive(Clone, Copy, Default)]
struct Sample {
    /// devplane's publish → the last client's receipt (ms).
    total: f64,
    /// devplane's publish → the last stream handed its response (ms).
    devplane: f64,
    /// Per client devplane's hand-over → receipt: median and max over the N clients (ms).
    deliver_p50: f64,
    deliver_max: f64,
    /// devplane CPU seconds over the change.
    cpu: f64,
}

/// Converts the harness's `Instant`s to Unix seconds (devplane reports those).
#[derive(Clone, Copy)]
struct Clock {
    at: Instant,
    unix: f64,
}

impl Clock {
    fn now() -> Clock {
        Clock {
            at: Instant::now(),
            unix: unix_now(),
        }
    }

    fn unix(&self, t: Instant) -> f64 {
        self.unix + t.duration_since(self.at).as_secs_f64()
    }
}

/// Posts the mesh with `endpoints` endpoints and measures its way to every client.
async fn change(dp: &Devplane, seen: &[Seen], endpoints: usize, clock: Clock) -> Sample {
    let before: Vec<usize> = seen.iter().map(|s| s.lock().unwrap().len()).collect();
    let cpu0 = cpu_secs(dp.proc.pid());
    let t0 = dp.post_mesh(&mesh(endpoints)).await;
    let views = seen.to_vec();
    let received: Vec<(String, Instant)> = wait_for(
        "the change to reach every client",
        Duration::from_secs(120),
        || {
            let got: Option<Vec<_>> = views
                .iter()
                .zip(&before)
                .map(|(s, n)| s.lock().unwrap().get(*n).cloned())
                .collect();
            async move { got }
        },
    )
    .await;
    // Let devplane take the ACKs in before reading its CPU and its view of the push.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cpu = cpu_secs(dp.proc.pid()) - cpu0;
    let sent: HashMap<String, (String, f64)> = dp
        .acks()
        .await
        .iter()
        .filter_map(|c| {
            let s = &c["sent"][type_url::ENDPOINT];
            Some((
                c["node_id"].as_str()?.to_owned(),
                (s["version"].as_str()?.to_owned(), s["unix_time"].as_f64()?),
            ))
        })
        .collect();
    let recv_unix: Vec<f64> = received.iter().map(|(_, at)| clock.unix(*at)).collect();
    let total = recv_unix.iter().copied().fold(t0, f64::max) - t0;
    let mut last_sent = t0;
    let mut deliver = vec![];
    for (i, ((version, _), recv)) in received.iter().zip(&recv_unix).enumerate() {
        if let Some((v, at)) = sent.get(&node_id("bench", i))
            && v == version
        {
            last_sent = last_sent.max(*at);
            deliver.push((recv - at) * 1000.0);
        }
    }
    assert_eq!(
        deliver.len(),
        seen.len(),
        "devplane's /debug/acks must show the version every client received"
    );
    Sample {
        total: total * 1000.0,
        devplane: (last_sent - t0) * 1000.0,
        deliver_p50: quantile(&deliver, 0.5),
        deliver_max: quantile(&deliver, 1.0),
        cpu,
    }
}

fn report(path: &str, s: &[Sample]) {
    let col = |f: fn(&Sample) -> f64| s.iter().map(f).collect::<Vec<_>>();
    let (total, dp, d50, dmax) = (
        col(|x| x.total),
        col(|x| x.devplane),
        col(|x| x.deliver_p50),
        col(|x| x.deliver_max),
    );
    println!(
        "       {path:<14} all N: p50 {:>6.1} ms, p90 {:>6.1} ms | devplane publish→last hand-over p50 {:>6.1} ms | delivery per client p50 {:>5.1} ms, max p50 {:>6.1} ms | devplane CPU p50 {:.0} ms",
        quantile(&total, 0.5),
        quantile(&total, 0.9),
        quantile(&dp, 0.5),
        quantile(&d50, 0.5),
        quantile(&dmax, 0.5),
        median(col(|x| x.cpu)) * 1000.0,
    );
    println!("       {path:<14} raw all-N (ms): {total:.0?}");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    meshagent::app::raise_fd_limit();
    let env_num = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(d)
    };
    let sizes: Vec<usize> = std::env::var("GRPC_BENCH_N")
        .unwrap_or_else(|_| "50,200".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let changes = env_num("GRPC_BENCH_CHANGES", 20);
    let block = env_num("GRPC_BENCH_BLOCK", 5).min(changes);
    println!("proxyless gRPC: N agents (DISABLE_ENVOY) against one devplane, one xDS client each");
    let clock = Clock::now();
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
                policy: Default::default(),
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

        let load_before = loadavg();
        // xDS streams devplane serves with no bench client attached (none expected).
        let idle = dp.acks().await.len();
        let (mut via, mut direct) = (vec![], vec![]);
        // Per block: (all agents' CPU, the bench clients' CPU) per change, seconds.
        let (mut cpu_via, mut cpu_direct) = (vec![], vec![]);
        let mut rss = vec![];
        let mut endpoints = 1;
        while via.len() < changes || direct.len() < changes {
            for through_agents in [true, false] {
                let chans = if through_agents {
                    agent_channels()
                } else {
                    direct_channels()
                };
                let (seen, tasks) = attach(chans).await;
                if through_agents && rss.is_empty() {
                    rss = agents.iter().map(|a| rss_mib(a.proc.pid())).collect();
                }
                let out = if through_agents {
                    &mut via
                } else {
                    &mut direct
                };
                // One uncounted change first: the block's streams settle.
                let cpu_of = || {
                    let agents_cpu: f64 = agents.iter().map(|a| cpu_secs(a.proc.pid())).sum();
                    (agents_cpu, cpu_secs(std::process::id()))
                };
                let (agents0, self0) = cpu_of();
                let todo = block.min(changes - out.len());
                for k in 0..=todo {
                    endpoints = if endpoints == 1 { 2 } else { 1 };
                    let s = change(&dp, &seen, endpoints, clock).await;
                    if k > 0 {
                        out.push(s);
                    }
                }
                let (agents1, self1) = cpu_of();
                let per = (todo + 1) as f64;
                let cpu = if through_agents {
                    &mut cpu_via
                } else {
                    &mut cpu_direct
                };
                cpu.push(((agents1 - agents0) / per, (self1 - self0) / per));
                for t in tasks {
                    t.abort();
                }
                // Let the streams close before the other path attaches.
                wait_for(
                    "the block's streams to close",
                    Duration::from_secs(60),
                    || {
                        let live = dp.acks();
                        async move { (live.await.len() <= idle).then_some(()) }
                    },
                )
                .await;
            }
        }
        let rss_max = rss.iter().copied().fold(0.0, f64::max);
        // After all the changes: the agents have released start-up's code pages (a quiet
        // second after first ready, src/code_pages.rs) and run the push path many times.
        let settled: Vec<support::mem::Mem> = agents
            .iter()
            .map(|a| support::mem::Mem::of(a.proc.pid()))
            .collect();
        let med = |f: fn(&support::mem::Mem) -> f64| median(settled.iter().map(f).collect());
        let total = |s: &[Sample]| median(s.iter().map(|x| x.total).collect());
        println!(
            "N={n:>3}: {n} agents ready in {ready_s:.1} s; agent RSS median {:.2} MiB, max {rss_max:.2} MiB when first attached, median {:.2} MiB after the changes (goal ≤ 6 MiB; RssAnon {:.2}, Pss {:.2}); load average {load_before} before, {} after",
            median(rss.clone()),
            med(|m| m.vm_rss),
            med(|m| m.rss_anon),
            med(|m| m.pss),
            loadavg()
        );
        report("through agents", &via);
        report("direct", &direct);
        let per_change = |c: &[(f64, f64)]| {
            (
                median(c.iter().map(|x| x.0).collect()) * 1000.0,
                median(c.iter().map(|x| x.1).collect()) * 1000.0,
            )
        };
        let ((va, vs), (da, ds)) = (per_change(&cpu_via), per_change(&cpu_direct));
        println!(
            "       CPU per change (median of blocks): all {n} agents {va:.1} ms through agents, {da:.1} ms while idle (direct blocks); bench clients {vs:.1} ms through agents, {ds:.1} ms direct"
        );
        println!(
            "       ratio of medians (through agents / direct): {:.2} ({} changes per path)",
            total(&via) / total(&direct),
            via.len()
        );
        drop(agents);
        drop(dp);
    }
}
