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

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshagent::control_plane::{Keepalive, Roots, Target, Tls};
use meshagent_proto::envoy::pb::envoy::config::core::v3::Node;
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
    DiscoveryRequest, DiscoveryResponse,
};
use meshagent_proto::envoy::pb::google::protobuf::{Struct, Value as PbValue, value::Kind};
use meshagent_proto::type_url;
use meshagent_testkit::{Devplane, Sidecar, wait_for};
use tokio::sync::mpsc;
use tokio::time::Instant;

const SOTW: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const CLUSTER: &str = "outbound|7070||echo.default.svc.cluster.local";
const CLOCK_TICKS: f64 = 100.0;

fn mesh(endpoints: usize) -> String {
    let mut y = String::from("workloads:\n");
    let mut sel = vec![];
    for i in 0..endpoints {
        y.push_str(&format!(
            "  - {{name: echo{i}, serviceAccount: echo, address: 127.0.0.{}, ports: [{{port: 17070, inboundPort: 17070}}]}}\n",
            i + 1
        ));
        sel.push(format!("echo{i}"));
    }
    y.push_str(&format!(
        "services:\n  - {{name: echo, selector: [{}], ports: [{{port: 7070, targetPort: 17070}}]}}\n",
        sel.join(", ")
    ));
    y
}

/// One client's view: versions of EDS responses, with arrival times.
type Seen = Arc<Mutex<Vec<(String, Instant)>>>;

fn node(id: &str) -> Node {
    let mut fields = std::collections::BTreeMap::new();
    fields.insert(
        "GENERATOR".to_owned(),
        PbValue {
            kind: Some(Kind::StringValue("grpc".into())),
        },
    );
    Node {
        id: id.into(),
        metadata: Some(Struct {
            fields: fields.into_iter().collect(),
        }),
        ..Default::default()
    }
}

/// A SotW ADS client on `channel` subscribed to [`CLUSTER`]'s endpoints.
async fn xds_client(
    channel: tonic::transport::Channel,
    token: Option<String>,
    node_id: String,
    seen: Seen,
) {
    let (tx, rx) = mpsc::channel::<DiscoveryRequest>(4);
    tx.send(DiscoveryRequest {
        node: Some(node(&node_id)),
        type_url: type_url::ENDPOINT.into(),
        resource_names: vec![CLUSTER.into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let codec = tonic_prost::ProstCodec::<DiscoveryRequest, DiscoveryResponse>::default();
    let mut stream = grpc
        .streaming(req, http::uri::PathAndQuery::from_static(SOTW), codec)
        .await
        .unwrap()
        .into_inner();
    while let Ok(Some(resp)) = stream.message().await {
        seen.lock()
            .unwrap()
            .push((resp.version_info.clone(), Instant::now()));
        let _ = tx
            .send(DiscoveryRequest {
                type_url: resp.type_url,
                version_info: resp.version_info,
                response_nonce: resp.nonce,
                resource_names: vec![CLUSTER.into()],
                ..Default::default()
            })
            .await;
    }
}

fn uds_channel(path: PathBuf) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_static("http://localhost").connect_with_connector_lazy(
        tower::service_fn(move |_| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }),
    )
}

fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / CLOCK_TICKS
}

fn rss_mib(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Starts one client per channel; returns their views and tasks once all have a version.
async fn attach(
    channels: Vec<(tonic::transport::Channel, Option<String>)>,
) -> (Vec<Seen>, Vec<tokio::task::JoinHandle<()>>) {
    let mut seen = vec![];
    let mut tasks = vec![];
    for (i, (ch, token)) in channels.into_iter().enumerate() {
        let s: Seen = Arc::default();
        seen.push(s.clone());
        tasks.push(tokio::spawn(xds_client(
            ch,
            token,
            format!("sidecar~127.0.0.1~bench{i}-1.default~default.svc.cluster.local"),
            s,
        )));
    }
    let views = seen.clone();
    wait_for(
        "every client's first EDS response",
        Duration::from_secs(120),
        || {
            let ok = views.iter().all(|s| !s.lock().unwrap().is_empty());
            async move { ok.then_some(()) }
        },
    )
    .await;
    (seen, tasks)
}

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
        let env: Vec<(&str, String)> = vec![
            ("ISTIO_META_GENERATOR", "grpc".into()),
            ("OUTPUT_CERTS", "./var/lib/istio/data".into()),
            ("ISTIO_META_DNS_CAPTURE", "false".into()),
            ("DISABLE_ENVOY", "true".into()),
            ("ECC_SIGNATURE_ALGORITHM", "ECDSA".into()),
        ];
        let started = Instant::now();
        let mut agents = vec![];
        for i in 0..n {
            agents.push(Sidecar::start(&dp, &format!("bench{i}"), "default", "bench", &env).await);
        }
        for a in &mut agents {
            a.wait_ready(Duration::from_secs(180)).await;
        }
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
