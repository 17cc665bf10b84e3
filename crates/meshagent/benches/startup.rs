//! Sidecar startup: `meshagent proxy sidecar` start → `/healthz/ready` 200 (first CSR, SDS,
//! xDS through the agent, Envoy LIVE with devplane's config), against a bare Envoy started
//! with an equivalent static config (the same bootstrap plus the same clusters, endpoints,
//! listeners, routes and certificate, all static, and the agent's Envoy flags) → `/ready` LIVE,
//! and against Envoy with the agent's bootstrap talking ADS to devplane directly with a ready
//! certificate (the agent path minus the agent's work). All timed from `spawn()`, interleaved,
//! after one warm-up each. Also the CA round trip on its own (TLS + CreateCertificate) and the
//! agent's RSS (VmRSS, VmHWM, anonymous / file-backed) once ready.
//!
//! Run: `make bench`, or `make agent && cargo build --release --bins &&
//! MESHAGENT_BIN=$PWD/target/dist/meshagent cargo bench -p meshagent --bench startup`.
//! `STARTUP_DUMP_STATIC=<file>` writes the static bootstrap, to start that Envoy by hand.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/mem.rs"]
mod mem;
use mem::status_kib;
#[path = "support/floors.rs"]
mod floors;
use floors::agent_envoy_args;

use std::process::Command;
use std::time::Duration;

use meshagent_testkit::{
    Devplane, Envoy, Sidecar, Value, ca_client, envoy_bin, http_get, json, two_workload_mesh,
};

/// Rounds per figure; `STARTUP_RUNS` overrides (e.g. 1 with `STARTUP_TRACE` to read one log).
fn runs() -> usize {
    std::env::var("STARTUP_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(11)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// CPU ms per thread of `pid` and of its children (Envoy), from `/proc/<pid>/task/*/schedstat`,
/// for `STARTUP_TRACE=rsa`: where the cores went until the agent turned ready.
fn thread_cpu(pid: u32) -> Vec<(u32, String, f64)> {
    let mut out = vec![];
    let mut pids = vec![pid];
    if let Ok(c) = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
        pids.extend(c.split_whitespace().filter_map(|v| v.parse::<u32>().ok()));
    }
    for p in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            let ns: f64 = std::fs::read_to_string(t.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse().ok())
                .unwrap_or(0.0);
            out.push((p, comm.trim().to_owned(), ns / 1e6));
        }
    }
    out
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
async fn equivalent_static(s: &Sidecar, generated: &Value) -> Value {
    let cwd = s.cwd.path();
    let mut b = generated.clone();
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
/// From spawning `meshagent` (the pod's files are written before) to `/healthz/ready` 200.
async fn ready_sidecar(dp: &Devplane, env: &[(&str, String)]) -> (Sidecar, f64) {
    let s = Sidecar::start(dp, "a", "default", "a", env).await;
    poll_until(s.status, "/healthz/ready", |c, _| c == 200).await;
    let ms = s.proc.started.elapsed().as_secs_f64() * 1e3;
    (s, ms)
}

/// A bare Envoy with `bootstrap` and `args`, from spawn to `/ready` LIVE.
async fn bare_ready(bootstrap: &Value, args: &[&str]) -> f64 {
    let dir = tempfile::tempdir().unwrap();
    let e = Envoy::start_with_args(bootstrap.clone(), dir.path(), args);
    poll_until(e.admin, "/ready", |c, body| {
        c == 200 && body.trim() == "LIVE"
    })
    .await;
    e.proc.started.elapsed().as_secs_f64() * 1e3
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
    for _ in 0..runs() {
        let t = tokio::time::Instant::now();
        let _ = ca_client::workload_cert(dp.grpc_addr, &dp.root_cert_path(), &token).await;
        ca.push(t.elapsed().as_secs_f64() * 1e3);
    }

    // Warm-up, discarded: one run of each path. The RSA run also gives the equivalent static
    // config and the Envoy flags for the bare baseline.
    // `STARTUP_AGENT_ENV="K=V K2=V2"` adds variables to every agent run (experiments).
    let extra = std::env::var("STARTUP_AGENT_ENV").unwrap_or_default();
    let extra: Vec<(&str, String)> = extra
        .split_whitespace()
        .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k, v.to_owned())))
        .collect();
    let mut ecdsa_env = vec![("ECC_SIGNATURE_ALGORITHM", "ECDSA".to_owned())];
    let mut rsa_env = vec![("OUTPUT_CERTS", "./out".to_owned())];
    ecdsa_env.extend(extra.iter().cloned());
    rsa_env.extend(extra.iter().cloned());
    let (s, _) = ready_sidecar(&dp, &rsa_env).await;
    // The bootstrap the agent generated (removed when its Envoy exits).
    let rev = s.cwd.path().join("etc/istio/proxy/envoy-rev.json");
    let generated: Value = serde_json::from_slice(&std::fs::read(rev).unwrap()).unwrap();
    let b = equivalent_static(&s, &generated).await;
    let args = agent_envoy_args(s.proc.pid());
    let sds_dir = tempfile::tempdir().unwrap();
    let sds =
        meshagent_testkit::static_sds::StaticSds::from_devplane(&dp, &token, sds_dir.path()).await;
    let direct = floors::bypass_agent(
        &generated,
        dp.grpc_addr,
        &dp.root_cert_path(),
        &token,
        &sds.socket,
    );
    stop(s).await;
    if let Ok(p) = std::env::var("STARTUP_DUMP_STATIC") {
        std::fs::write(&p, serde_json::to_vec_pretty(&b).unwrap()).unwrap();
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (s, _) = ready_sidecar(&dp, &ecdsa_env).await;
    stop(s).await;
    bare_ready(&b, &args).await;
    bare_ready(&direct, &args).await;

    // Interleaved rounds, so machine noise (writeback after a build, other work) falls on
    // every path alike. ECC_SIGNATURE_ALGORITHM=ECDSA shows how much of the default path is
    // RSA key generation.
    let (mut bare, mut agent, mut agent_ecdsa) = (vec![], vec![], vec![]);
    let mut envoy_direct = vec![];
    let (mut rss, mut hwm, mut anon, mut file) = (vec![], vec![], vec![], vec![]);
    let mut by_mapping = vec![];
    // Each start is preceded by a pause, so the previous run's processes are gone and their
    // memory reclaimed before the clock starts.
    let settle = || tokio::time::sleep(Duration::from_millis(300));
    for _ in 0..runs() {
        settle().await;
        bare.push(bare_ready(&b, &args).await);
        settle().await;
        envoy_direct.push(bare_ready(&direct, &args).await);
        settle().await;
        let (s, ms) = ready_sidecar(&dp, &ecdsa_env).await;
        agent_ecdsa.push(ms);
        if std::env::var("STARTUP_TRACE").is_ok_and(|v| v != "rsa") {
            println!("--- ECDSA agent log ({ms:.0} ms to ready)");
            s.proc.print_log();
        }
        stop(s).await;
        settle().await;
        let (s, ms) = ready_sidecar(&dp, &rsa_env).await;
        agent.push(ms);
        if std::env::var("STARTUP_TRACE").as_deref() == Ok("rsa") {
            let cpu = thread_cpu(s.proc.pid());
            let total: f64 = cpu.iter().map(|c| c.2).sum();
            println!("--- RSA agent: CPU ms per thread once ready ({total:.0} in all):");
            for (p, comm, ms) in cpu.iter().filter(|c| c.2 >= 1.0) {
                println!("    {p} {comm:<20} {ms:>6.1}");
            }
            println!("--- RSA agent log ({ms:.0} ms to ready)");
            s.proc.print_log();
        }
        let pid = s.proc.pid();
        rss.push(status_kib(pid, "VmRSS:"));
        hwm.push(status_kib(pid, "VmHWM:"));
        anon.push(status_kib(pid, "RssAnon:"));
        file.push(status_kib(pid, "RssFile:"));
        by_mapping = rss_by_mapping(pid);
        stop(s).await;
    }

    let samples = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "samples ms: bare {}; Envoy direct to devplane {}; agent RSA {}; agent ECDSA {}",
        samples(&bare),
        samples(&envoy_direct),
        samples(&agent),
        samples(&agent_ecdsa)
    );
    let (a, e, c) = (median(agent), median(bare), median(ca));
    let (ae, d) = (median(agent_ecdsa), median(envoy_direct));
    println!("envoy: {}", envoy_bin().display());
    println!("runs per figure: {}, interleaved (medians)", runs());
    println!("bare Envoy has the agent's Envoy flags: {}", args.join(" "));
    println!("bare Envoy, static config → /ready LIVE: {e:.1} ms");
    println!(
        "Envoy, agent's bootstrap but ADS direct to devplane + a ready certificate → /ready LIVE: {d:.1} ms"
    );
    println!("meshagent proxy sidecar → /healthz/ready 200: {a:.1} ms");
    println!("meshagent proxy sidecar, ECDSA keys → /healthz/ready 200: {ae:.1} ms");
    println!("CA round trip (TLS + CreateCertificate): {c:.1} ms");
    println!(
        "ratio (agent − one CA round trip) / bare Envoy: RSA {:.2}, ECDSA {:.2}  (goal ≤ 1.2)",
        (a - c) / e,
        (ae - c) / e
    );
    println!(
        "ratio (agent − one CA round trip) / Envoy direct: RSA {:.2}, ECDSA {:.2}  (the agent's own cost)",
        (a - c) / d,
        (ae - c) / d
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
    println!("  by mapping (last run, KiB):");
    for (name, kib) in by_mapping.iter().take(8) {
        println!("    {kib:>6}  {name}");
    }
}

/// Resident KiB per mapping of process `pid` (file and permissions, `[heap]`, `[anon]`, ...),
/// largest first: where the agent's RSS is.
fn rss_by_mapping(pid: u32) -> Vec<(String, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut sums: std::collections::HashMap<String, u64> = Default::default();
    let mut current = String::new();
    for line in smaps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let Some(kib) = line.strip_prefix("Rss:") {
            let kib: u64 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0);
            *sums.entry(current.clone()).or_default() += kib;
        } else if fields.len() >= 5 && fields[0].contains('-') && !fields[0].ends_with(':') {
            // "start-end perms offset dev inode [path]"
            let path = fields.get(5).copied().unwrap_or("[anon]");
            current = format!("{path} {}", fields[1]);
        }
    }
    let mut v: Vec<_> = sums.into_iter().filter(|(_, k)| *k > 0).collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1));
    v
}
