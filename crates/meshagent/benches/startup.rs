//! Sidecar startup: `meshagent proxy sidecar` start → `/healthz/ready` 200 (first CSR, SDS,
//! xDS through the agent, Envoy LIVE with devplane's config), against a bare Envoy started
//! with an equivalent static config (the same generated bootstrap without dynamic resources)
//! → `/ready` LIVE, in the same run. Also the CA round trip on its own (TLS + CreateCertificate)
//! and the agent's RSS (VmRSS, VmHWM) once ready.
//!
//! Run: `cargo build --release --bins && cargo bench -p meshagent --bench startup`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use meshagent_testkit::{
    Devplane, Envoy, Sidecar, ca_client, envoy_bin, http_get, two_workload_mesh,
};

const RUNS: usize = 7;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

async fn poll_until(addr: std::net::SocketAddr, path: &str, want: impl Fn(u16, &str) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((c, b)) = http_get(addr, path).await
            && want(c, &b)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out polling {addr}{path}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::main]
async fn main() {
    let (mesh, _, _, _) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    let token = dp.token("default", "a", 3600).await;
    // Warm devplane and the page cache once.
    let _ = ca_client::workload_cert(dp.grpc_addr, &dp.root_cert_path(), &token).await;

    let mut ca = vec![];
    for _ in 0..RUNS {
        let t = tokio::time::Instant::now();
        let _ = ca_client::workload_cert(dp.grpc_addr, &dp.root_cert_path(), &token).await;
        ca.push(t.elapsed().as_secs_f64() * 1e3);
    }

    // ECC_SIGNATURE_ALGORITHM=ECDSA shows how much of the default path is RSA key generation.
    let mut agent_ecdsa = vec![];
    for _ in 0..RUNS {
        let t = tokio::time::Instant::now();
        let mut s = Sidecar::start(
            &dp,
            "a",
            "default",
            "a",
            &[("ECC_SIGNATURE_ALGORITHM", "ECDSA".into())],
        )
        .await;
        poll_until(s.status, "/healthz/ready", |c, _| c == 200).await;
        agent_ecdsa.push(t.elapsed().as_secs_f64() * 1e3);
        let _ = Command::new("kill")
            .args(["-TERM", &s.proc.pid().to_string()])
            .status();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while s.proc.try_wait().is_none() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    let mut agent = vec![];
    let mut rss = vec![];
    let mut hwm = vec![];
    let mut anon = vec![];
    let mut file = vec![];
    let mut static_bootstrap = None;
    for _ in 0..RUNS {
        let t = tokio::time::Instant::now();
        let mut s = Sidecar::start(&dp, "a", "default", "a", &[]).await;
        poll_until(s.status, "/healthz/ready", |c, _| c == 200).await;
        agent.push(t.elapsed().as_secs_f64() * 1e3);
        rss.push(status_kib(s.proc.pid(), "VmRSS:") as f64);
        hwm.push(status_kib(s.proc.pid(), "VmHWM:") as f64);
        anon.push(status_kib(s.proc.pid(), "RssAnon:") as f64);
        file.push(status_kib(s.proc.pid(), "RssFile:") as f64);
        if static_bootstrap.is_none() {
            let p = s.cwd.path().join("etc/istio/proxy/envoy-rev.json");
            let mut b: serde_json::Value =
                serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
            // The same bootstrap, static only: no ADS, no SDS/xDS clusters.
            b.as_object_mut().unwrap().remove("dynamic_resources");
            let clusters = b["static_resources"]["clusters"].as_array_mut().unwrap();
            clusters.retain(|c| c["name"] != "xds-grpc" && c["name"] != "sds-grpc");
            for l in b["static_resources"]["listeners"].as_array_mut().unwrap() {
                l["address"]["socket_address"]["port_value"] =
                    serde_json::json!(meshagent_testkit::free_port());
            }
            static_bootstrap = Some(b);
        }
        let _ = Command::new("kill")
            .args(["-TERM", &s.proc.pid().to_string()])
            .status();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while s.proc.try_wait().is_none() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    let mut bare = vec![];
    let b = static_bootstrap.unwrap();
    for _ in 0..RUNS {
        let dir = tempfile::tempdir().unwrap();
        let t = tokio::time::Instant::now();
        let e = Envoy::start(b.clone(), dir.path());
        poll_until(e.admin, "/ready", |c, body| {
            c == 200 && body.trim() == "LIVE"
        })
        .await;
        bare.push(t.elapsed().as_secs_f64() * 1e3);
        drop(e);
    }

    let (a, e, c) = (median(agent), median(bare), median(ca));
    println!("envoy: {}", envoy_bin().display());
    println!("runs per figure: {RUNS} (medians)");
    println!("bare Envoy, static config → /ready LIVE: {e:.1} ms");
    println!("meshagent proxy sidecar → /healthz/ready 200: {a:.1} ms");
    println!(
        "meshagent proxy sidecar, ECDSA keys → /healthz/ready 200: {:.1} ms",
        median(agent_ecdsa)
    );
    println!("CA round trip (TLS + CreateCertificate): {c:.1} ms");
    println!("ratio agent / bare Envoy: {:.2}", a / e);
    println!(
        "ratio (agent − one CA round trip) / bare Envoy: {:.2}  (goal ≤ 1.2)",
        (a - c) / e
    );
    println!(
        "agent RSS once ready: VmRSS {:.1} MiB, VmHWM {:.1} MiB (goal ≤ 8 MiB)",
        median(rss) / 1024.0,
        median(hwm) / 1024.0
    );
    println!(
        "  of which anonymous {:.1} MiB, file-backed (binary pages) {:.1} MiB",
        median(anon) / 1024.0,
        median(file) / 1024.0
    );
}
