//! Sidecar startup: `meshagent proxy sidecar` start → `/healthz/ready` 200 (first CSR, SDS,
//! xDS through the agent, Envoy LIVE with devplane's config), against a bare Envoy started
//! with an equivalent static config (the same bootstrap plus the same clusters, endpoints,
//! listeners, routes and certificate, all static) → `/ready` LIVE, in the same run. Also the CA round trip on its own (TLS + CreateCertificate)
//! and the agent's RSS (VmRSS, VmHWM) once ready.
//!
//! Run: `cargo build --release --bins && cargo bench -p meshagent --bench startup`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use meshagent_testkit::{
    Devplane, Envoy, Sidecar, Value, ca_client, envoy_bin, http_get, json, two_workload_mesh,
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

/// The sidecar's running config made static: the agent's generated bootstrap without ADS, plus
/// every cluster, endpoint, listener and route Envoy received (from `/config_dump`), with SDS
/// references turned into static secrets holding the same certificate (from `OUTPUT_CERTS`).
async fn equivalent_static(s: &Sidecar) -> Value {
    let cwd = s.cwd.path();
    let mut b: Value =
        serde_json::from_slice(&std::fs::read(cwd.join("etc/istio/proxy/envoy-rev.json")).unwrap())
            .unwrap();
    let (_, dump) = http_get(s.admin, "/config_dump?include_eds").await.unwrap();
    let dump: Value = serde_json::from_str(&dump).unwrap();
    let mut clusters = vec![];
    let mut endpoints = serde_json::Map::new();
    let mut listeners = vec![];
    let mut routes = serde_json::Map::new();
    for cfg in dump["configs"].as_array().unwrap() {
        let t = cfg["@type"].as_str().unwrap_or("");
        if t.ends_with("ClustersConfigDump") {
            for c in cfg["dynamic_active_clusters"]
                .as_array()
                .into_iter()
                .flatten()
            {
                clusters.push(c["cluster"].clone());
            }
        } else if t.ends_with("EndpointsConfigDump") {
            for e in cfg["dynamic_endpoint_configs"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let cla = e["endpoint_config"].clone();
                endpoints.insert(cla["cluster_name"].as_str().unwrap().to_owned(), cla);
            }
        } else if t.ends_with("ListenersConfigDump") {
            for l in cfg["dynamic_listeners"].as_array().into_iter().flatten() {
                listeners.push(l["active_state"]["listener"].clone());
            }
        } else if t.ends_with("RoutesConfigDump") {
            for r in cfg["dynamic_route_configs"]
                .as_array()
                .into_iter()
                .flatten()
            {
                let rc = r["route_config"].clone();
                routes.insert(rc["name"].as_str().unwrap().to_owned(), rc);
            }
        }
    }
    // config_dump wraps each resource as an Any: drop the type tag to use it as config.
    let untag = |v: &mut Value| {
        v.as_object_mut().map(|m| m.remove("@type"));
    };
    clusters
        .iter_mut()
        .chain(listeners.iter_mut())
        .for_each(untag);
    endpoints
        .values_mut()
        .chain(routes.values_mut())
        .for_each(untag);
    for c in &mut clusters {
        if let Some(eds) = c.as_object_mut().unwrap().remove("eds_cluster_config") {
            let name = eds["service_name"]
                .as_str()
                .unwrap_or(c["name"].as_str().unwrap())
                .to_owned();
            c["type"] = json!("STATIC");
            let mut cla = endpoints[&name].clone();
            // The dump renders an unset locality weight as 0, which static config rejects.
            for l in cla["endpoints"].as_array_mut().into_iter().flatten() {
                if l["load_balancing_weight"].as_u64().unwrap_or(0) == 0 {
                    l.as_object_mut().map(|m| m.remove("load_balancing_weight"));
                }
            }
            c["load_assignment"] = cla;
        }
    }
    fn make_static(v: &mut Value, routes: &serde_json::Map<String, Value>) {
        match v {
            Value::Object(m) => {
                if m.contains_key("sds_config") && m.contains_key("name") {
                    m.remove("sds_config");
                }
                if let Some(rds) = m.remove("rds") {
                    let name = rds["route_config_name"].as_str().unwrap();
                    m.insert("route_config".into(), routes[name].clone());
                }
                m.values_mut().for_each(|x| make_static(x, routes));
            }
            Value::Array(a) => a.iter_mut().for_each(|x| make_static(x, routes)),
            _ => {}
        }
    }
    for x in clusters.iter_mut().chain(listeners.iter_mut()) {
        make_static(x, &routes);
    }
    let out = cwd.join("out");
    let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap();
    let secrets = json!([
        {"name": "default", "tls_certificate": {
            "certificate_chain": {"inline_string": read("cert-chain.pem")},
            "private_key": {"inline_string": read("key.pem")}}},
        {"name": "ROOTCA", "validation_context": {"trusted_ca": {"inline_string": read("root-cert.pem")}}}
    ]);
    b.as_object_mut().unwrap().remove("dynamic_resources");
    let st = &mut b["static_resources"];
    let statics = st["clusters"].as_array_mut().unwrap();
    statics.retain(|c| c["name"] != "xds-grpc" && c["name"] != "sds-grpc");
    statics.extend(clusters);
    let ls = st["listeners"].as_array_mut().unwrap();
    for l in ls.iter_mut() {
        l["address"]["socket_address"]["port_value"] = json!(meshagent_testkit::free_port());
    }
    ls.extend(listeners);
    st["secrets"] = secrets;
    b
}

/// Starts a sidecar and returns it with the time to `/healthz/ready` 200 (ms).
async fn ready_sidecar(dp: &Devplane, env: &[(&str, String)]) -> (Sidecar, f64) {
    let t = tokio::time::Instant::now();
    let s = Sidecar::start(dp, "a", "default", "a", env).await;
    poll_until(s.status, "/healthz/ready", |c, _| c == 200).await;
    (s, t.elapsed().as_secs_f64() * 1e3)
}

/// SIGTERM and wait for the agent (and so its Envoy) to be gone.
async fn stop(mut s: Sidecar) {
    let _ = Command::new("kill")
        .args(["-TERM", &s.proc.pid().to_string()])
        .status();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while s.proc.try_wait().is_none() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
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
        let (s, ms) = ready_sidecar(&dp, &[("ECC_SIGNATURE_ALGORITHM", "ECDSA".into())]).await;
        agent_ecdsa.push(ms);
        stop(s).await;
    }

    let mut agent = vec![];
    let mut rss = vec![];
    let mut hwm = vec![];
    let mut anon = vec![];
    let mut file = vec![];
    let mut static_bootstrap = None;
    for _ in 0..RUNS {
        let (s, ms) = ready_sidecar(&dp, &[("OUTPUT_CERTS", "./out".into())]).await;
        agent.push(ms);
        let pid = s.proc.pid();
        rss.push(status_kib(pid, "VmRSS:") as f64);
        hwm.push(status_kib(pid, "VmHWM:") as f64);
        anon.push(status_kib(pid, "RssAnon:") as f64);
        file.push(status_kib(pid, "RssFile:") as f64);
        if static_bootstrap.is_none() {
            static_bootstrap = Some(equivalent_static(&s).await);
        }
        stop(s).await;
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
