//! The measurements behind docs/dependencies.md (hand-written code kept where a crate exists).
//!
//! * Metrics: encode time of the agent's own registry — every family a running agent
//!   registers (each module's own registration code, as `app.rs` does), with the series a
//!   pod's agent has after a while (CSR counters, xDS counters and gauges, DNS histogram
//!   observations, Wasm counters, process metrics from `/proc`), encoded as the status port's
//!   merged scrape does for every `/stats/prometheus`; also without the process families,
//!   whose `/proc` reads cost the same under any encoder.
//! * ProxyConfig: a typical `PROXY_CONFIG` document parsed by the agent's model (through
//!   `config::load`, less a load without it) against the same document as a prost-reflect
//!   `DynamicMessage` of Istio's `istio.mesh.v1alpha1.ProxyConfig`, the descriptor compiled
//!   with protox from the `istio.io/api` module compat/go.mod pins (Go module cache,
//!   `make pilot-agent`); skipped with a note when that module is not in the cache.
//!
//! * Agent memory (only with `DEPS_RSS_ROUNDS=<n>`; needs `make envoy istiod-box`): the agent
//!   at `MESHAGENT_BIN` started as a pod runs it against istiod-box, ready, scraped 20 times
//!   on `/stats/prometheus` (as Prometheus does every 15 s), then settled 10 s: VmRSS, RssAnon
//!   and Pss, the median of `n` rounds. Run once per binary to compare two builds.
//!
//! `cargo bench -p meshagent --bench dependencies`. `BENCH_N` sets the operations per sample
//! (default 2000); `METRICS_BENCH_OUT=<file>` also writes one encoded scrape there, so two
//! builds' outputs can be diffed.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::disallowed_types)] // a benchmark binary

#[path = "support/mem.rs"]
mod mem;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use meshagent::config::{MapEnv, ProxyFlags, load};
use meshagent::metrics::{Registry, register_process_metrics};

fn agent_registry(process: bool) -> Registry {
    let r = Registry::new();
    if process {
        register_process_metrics(&r).unwrap();
    }
    let id = meshagent::identity::metrics::Metrics::register(&r).unwrap();
    *id.expiry.lock().unwrap() =
        Some(std::time::SystemTime::now() + std::time::Duration::from_secs(86_400));
    id.csr_requests.add(3);
    id.csr_latency_ms.add(42);
    let xds = meshagent::xds::Metrics::new(&r).unwrap();
    xds.requests.add(120);
    xds.responses.add(118);
    xds.istiod_connection_terminations.with(&["EOF"]).inc();
    xds.downstream_max.set_max(65_536.0);
    meshagent::status::EnvoyProbe::new(
        std::net::SocketAddr::from(([127, 0, 0, 1], 15000)),
        tokio::time::Instant::now(),
        &r,
        Arc::default(),
    )
    .unwrap();
    let merge = meshagent::status::MergeMetrics::register(&r).unwrap();
    merge.scrapes.add(1000);
    let dns = meshagent::dns::metrics::Metrics::new(&r).unwrap();
    for i in 0..500 {
        dns.requests.inc();
        dns.upstream_duration.observe(f64::from(i % 50) / 1000.0);
    }
    let wasm = meshagent::wasm::metrics::Metrics::new(&r).unwrap();
    wasm.cache_lookup.with(&["true"]).add(4);
    wasm.cache_lookup.with(&["false"]).inc();
    wasm.remote_fetch.with(&["success"]).inc();
    wasm.conversion_duration_ms.observe(37.0);
    r
}

/// Median, min and max µs per call of `f` over 7 samples of `n` calls.
fn time_us(n: usize, mut f: impl FnMut() -> usize) -> (f64, f64, f64) {
    let mut samples = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        let mut sink = 0;
        for _ in 0..n {
            sink += std::hint::black_box(f());
        }
        std::hint::black_box(sink);
        samples.push(t.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
    samples.sort_by(f64::total_cmp);
    (samples[3], samples[0], samples[6])
}

fn metrics(n: usize) {
    let full = agent_registry(true);
    if let Ok(path) = std::env::var("METRICS_BENCH_OUT") {
        std::fs::write(&path, full.encode()).unwrap();
    }
    for (what, r) in [
        ("agent registry", full),
        ("without process metrics", agent_registry(false)),
    ] {
        let text = r.encode();
        let (med, min, max) = time_us(n, || r.encode().len());
        println!(
            "metrics, {what}: {} families, {} lines, {} bytes; encode median {med:.1} µs \
             (min {min:.1}, max {max:.1}) over 7 samples of {n}",
            r.names().len(),
            text.lines().count(),
            text.len(),
        );
    }
}

/// A mesh-wide `defaultConfig` as an operator writes it, in one document.
const PROXY_CONFIG: &str = r#"{"discoveryAddress":"istiod.istio-system.svc:15012","drainDuration":"45s","terminationDrainDuration":"5s","proxyAdminPort":15000,"controlPlaneAuthPolicy":"MUTUAL_TLS","concurrency":2,"tracing":{"zipkin":{"address":"zipkin.istio-system:9411"},"sampling":1.0},"proxyMetadata":{"ISTIO_META_DNS_CAPTURE":"true","ISTIO_META_DNS_AUTO_ALLOCATE":"true"},"holdApplicationUntilProxyStarts":true,"proxyStatsMatcher":{"inclusionPrefixes":["cluster.outbound"]},"statusPort":15020,"interceptionMode":"REDIRECT","meshId":"mesh1","extraStatTags":["a","b"],"image":{"imageType":"distroless"}}"#;

/// Istio's ProxyConfig descriptor from the Go module cache, if `make pilot-agent` put it there.
fn istio_proxy_config() -> Option<prost_reflect::MessageDescriptor> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let go_mod = std::fs::read_to_string(root.join("compat/go.mod")).ok()?;
    let version = go_mod
        .lines()
        .find_map(|l| l.trim().strip_prefix("istio.io/api "))?
        .split_whitespace()
        .next()?
        .to_owned();
    let api = root.join(format!(".tools/go/mod/istio.io/api@{version}"));
    let fds = protox::compile(
        ["mesh/v1alpha1/proxy.proto"],
        [api.clone(), api.join("common-protos")],
    )
    .ok()?;
    prost_reflect::DescriptorPool::from_file_descriptor_set(fds)
        .ok()?
        .get_message_by_name("istio.mesh.v1alpha1.ProxyConfig")
}

fn proxy_config(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let flags = ProxyFlags::default();
    let with = MapEnv::from_pairs([("PROXY_CONFIG", PROXY_CONFIG)]);
    let without = MapEnv::from_pairs([("PROXY_CONFIG", "")]);
    let (w, _, _) = time_us(n, || {
        load(&flags, &with, dir.path()).unwrap().warnings.len()
    });
    let (wo, _, _) = time_us(n, || {
        load(&flags, &without, dir.path()).unwrap().warnings.len()
    });
    println!(
        "proxy config, agent model: config::load {w:.1} µs with PROXY_CONFIG, {wo:.1} µs without: \
         {:.1} µs for the document",
        w - wo
    );
    // PROXY_CONFIG is YAML: the agent converts it to JSON first, as Istio's ApplyYAML does.
    let (yaml, _, _) = time_us(n, || {
        serde_yaml::from_str::<serde_json::Value>(PROXY_CONFIG)
            .unwrap()
            .as_object()
            .map_or(0, |m| m.len())
    });
    println!("proxy config, of which YAML to JSON: {yaml:.1} µs");
    let Some(desc) = istio_proxy_config() else {
        println!(
            "proxy config, Istio's descriptor: istio.io/api not in .tools/go/mod (make pilot-agent)"
        );
        return;
    };
    let opts = prost_reflect::DeserializeOptions::new().deny_unknown_fields(false);
    let (med, min, max) = time_us(n, || {
        let mut de = serde_json::Deserializer::from_str(PROXY_CONFIG);
        prost_reflect::DynamicMessage::deserialize_with_options(desc.clone(), &mut de, &opts)
            .unwrap()
            .fields()
            .count()
    });
    println!(
        "proxy config, prost-reflect DynamicMessage of Istio's descriptor: median {med:.1} µs \
         (min {min:.1}, max {max:.1}) over 7 samples of {n}"
    );
}

/// The settled memory of the agent at `MESHAGENT_BIN` after scrapes, median of `rounds`.
fn agent_memory(rounds: usize) {
    use meshagent_testkit::istiod_box::{
        AgentKind, IstiodBox, PodSpec, mesh_with_free_ports, start_agent, workload_a,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mesh = mesh_with_free_ports();
        let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
        let mut samples: Vec<mem::Mem> = Vec::new();
        for _ in 0..rounds {
            let pod = PodSpec {
                workload: "a",
                namespace: "default",
                service_account: "a",
                ip: "127.0.0.1",
                proxy_config: meshagent_testkit::json!({}),
                env: &[],
            };
            let mut sidecar = start_agent(&istiod, AgentKind::Meshagent, &pod).await;
            let deadline = Instant::now() + Duration::from_secs(60);
            while !matches!(
                meshagent_testkit::http_get(sidecar.status, "/healthz/ready").await,
                Ok((200, _))
            ) {
                if Instant::now() > deadline {
                    sidecar.proc.print_log();
                    panic!("agent not ready within 60 s");
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            for _ in 0..20 {
                let (code, _) = meshagent_testkit::http_get(sidecar.status, "/stats/prometheus")
                    .await
                    .unwrap();
                assert_eq!(code, 200);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tokio::time::sleep(Duration::from_secs(10)).await;
            samples.push(mem::Mem::of(sidecar.proc.pid()));
            sidecar.proc.kill();
        }
        let med = |f: fn(&mem::Mem) -> f64| {
            let mut v: Vec<f64> = samples.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        println!(
            "agent memory ({}), scraped and settled, median of {rounds}: VmRSS {:.2} MiB, \
             RssAnon {:.2}, Pss {:.2}",
            meshagent_testkit::workspace_bin("meshagent").display(),
            med(|m| m.vm_rss),
            med(|m| m.rss_anon),
            med(|m| m.pss)
        );
    });
}

fn main() {
    if let Some(rounds) = std::env::var("DEPS_RSS_ROUNDS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        agent_memory(rounds);
        return;
    }
    let n: usize = std::env::var("BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    metrics(n);
    proxy_config(n);
}
