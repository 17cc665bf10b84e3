//! The workload `make orderfile` profiles to lay out the shipped agent's code: the functions a
//! pod's agent runs are linked next to each other, so the pages the kernel maps around them
//! (64 KiB per fault) hold code that runs, not code that never does. See "Code layout" in
//! docs/benchmarks-log.md.
//!
//! Each scenario runs the agent binary named by `MESHAGENT_BIN`; `make orderfile` points it at
//! a wrapper that runs the agent under callgrind, which records every function executed. The
//! scenarios are what an agent does in a pod: a sidecar starting with RSA and with ECDSA keys
//! (CSR, SDS, the xDS proxy, Envoy's lifecycle, readiness), Prometheus scrapes of the merged
//! metrics, kubelet's readiness probe through Envoy, a certificate rotation, DNS answers from
//! the name table and forwarded ones, the proxyless gRPC mode (DISABLE_ENVOY, OUTPUT_CERTS, the
//! gRPC bootstrap), the `istio-iptables` init container, and a drain on SIGTERM. The sidecars
//! start against devplane and against istiod-box (Istio's own config generation, CA and TLS
//! stack): a pod's agent talks to the real istiod, whose TLS handshake, token exchange and
//! generated config run code paths devplane's do not, and code a profile misses is laid out
//! among the code that never runs, one 64 KiB window per function at the start-up peak.
//!
//! Run: `make orderfile` (not part of `make test`: it takes minutes under callgrind).
#![allow(
    clippy::disallowed_methods,
    reason = "a profiling example, not the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::process::Command;
use std::time::Duration;

use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, mesh_with_free_ports, start_agent, workload_a,
};
use meshagent_testkit::{Devplane, Sidecar, free_port, http_get, json, two_workload_mesh};

/// Generous: every agent runs under callgrind, 20–50× slower than native.
const READY: Duration = Duration::from_secs(180);

fn agent_bin() -> String {
    std::env::var("MESHAGENT_BIN").expect("MESHAGENT_BIN names the agent binary to profile")
}

/// A DNS query for `name` (type A), as a stub resolver sends it.
fn dns_query(id: u16, name: &str) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]); // RD, one question
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]); // root, type A, class IN
    q
}

fn ask_dns(addr: SocketAddr, name: &str) {
    let sock = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    sock.send_to(&dns_query(0x4d41, name), addr).unwrap();
    let mut buf = [0u8; 1500];
    match sock.recv_from(&mut buf) {
        Ok((n, _)) => println!("  dns {name}: {n} byte answer"),
        Err(e) => println!("  dns {name}: no answer ({e})"),
    }
}

/// The agent's VmRSS (run natively, e.g. `MESHAGENT_BIN=target/dist/meshagent`, this is the
/// figure of each scenario; under callgrind it is callgrind's).
fn rss(s: &Sidecar) -> String {
    std::fs::read_to_string(format!("/proc/{}/status", s.proc.pid()))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

async fn stop(mut s: Sidecar) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(s.proc.pid() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while s.proc.try_wait().is_none() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.proc.kill();
}

/// Waits for a sidecar to be ready, then has Prometheus scrape its merged metrics twice.
async fn ready_and_scraped(s: &mut Sidecar) {
    s.wait_ready(READY).await;
    println!("  ready, VmRSS {}", rss(s));
    for _ in 0..2 {
        let (code, body) = http_get(s.status, "/stats/prometheus").await.unwrap();
        println!("  scrape: {code}, {} bytes", body.len());
    }
}

async fn sidecar(dp: &Devplane, name: &str, env: &[(&str, String)]) {
    println!("scenario: sidecar {name}");
    let mut s = Sidecar::start(dp, "a", "default", "a", env).await;
    ready_and_scraped(&mut s).await;
    let (code, _) = http_get(s.envoy_status, "/healthz/ready").await.unwrap();
    println!("  kubelet probe via Envoy: {code}");
    if env.iter().any(|(k, _)| *k == "DNS_PROXY_ADDR") {
        let addr: SocketAddr = env
            .iter()
            .find(|(k, _)| *k == "DNS_PROXY_ADDR")
            .map(|(_, v)| v.parse().unwrap())
            .unwrap();
        ask_dns(addr, "b.default.svc.cluster.local");
        ask_dns(addr, "b");
        ask_dns(addr, "localhost");
    }
    if env.iter().any(|(k, _)| *k == "SECRET_TTL") {
        // SECRET_TTL is short: wait for one rotation (Envoy then holds a second certificate
        // serial) so the rotation path is recorded too.
        let first = s.spiffe_ids().await;
        println!("  waiting for a rotation (identities {first:?})");
        tokio::time::sleep(Duration::from_secs(25)).await;
    }
    stop(s).await;
}

/// A sidecar of pod `a` against istiod-box, as the side-by-side benchmark starts it: ready,
/// two scrapes of the merged metrics, then a drain.
async fn sidecar_istiod_box(istiod: &IstiodBox, name: &str, env: &[(&str, &str)]) {
    println!("scenario: sidecar against istiod-box, {name}");
    let pod = PodSpec {
        env,
        proxy_config: json!({}),
        ..PodSpec::new("a", "127.0.0.1")
    };
    let mut s = start_agent(istiod, AgentKind::Meshagent, &pod).await;
    ready_and_scraped(&mut s).await;
    stop(s).await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let bin = agent_bin();
    {
        let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh_with_free_ports()), &[]).await;
        sidecar_istiod_box(&istiod, "RSA", &[]).await;
        sidecar_istiod_box(&istiod, "ECDSA", &[("ECC_SIGNATURE_ALGORITHM", "ECDSA")]).await;
    }
    let (mesh, _, _, _) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;

    sidecar(&dp, "RSA, rotation", &[("SECRET_TTL", "40s".to_owned())]).await;
    let dns = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    sidecar(
        &dp,
        "ECDSA, DNS capture",
        &[
            ("ECC_SIGNATURE_ALGORITHM", "ECDSA".to_owned()),
            ("ISTIO_META_DNS_CAPTURE", "true".to_owned()),
            ("DNS_PROXY_ADDR", dns.to_string()),
        ],
    )
    .await;

    println!("scenario: proxyless gRPC (DISABLE_ENVOY)");
    let mut g = Sidecar::start_with(
        &dp,
        "g",
        "default",
        "g",
        &[
            ("DISABLE_ENVOY", "true".to_owned()),
            ("ISTIO_META_DNS_CAPTURE", "false".to_owned()),
            ("OUTPUT_CERTS", "./etc/istio-output-certs".to_owned()),
            (
                "GRPC_XDS_BOOTSTRAP",
                "./etc/istio/proxy/grpc-bootstrap.json".to_owned(),
            ),
            ("ISTIO_META_GENERATOR", "grpc".to_owned()),
        ],
        json!({}),
    )
    .await;
    g.wait_ready(READY).await;
    println!("  ready, VmRSS {}", rss(&g));
    stop(g).await;

    println!("scenario: istio-iptables --dry-run (the injector's default arguments)");
    let out = Command::new(&bin)
        .arg("istio-iptables")
        .args(meshagent::iptables::ISTIO_INIT_DEFAULT_ARGS)
        .args(["--redirect-dns", "--dry-run"])
        .output()
        .unwrap();
    println!("  exit {}", out.status);
    drop(dp);
}
