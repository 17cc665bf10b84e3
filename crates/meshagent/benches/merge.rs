//! Merged-metrics benchmark (large application metrics, as in the field): one scrape merging a 100,000-line
//! Envoy stats body and a 1 MiB application body, both served by local HTTP servers. Reports
//! scrape latency and the process's peak RSS increase during the scrape (VmHWM, reset through
//! `/proc/self/clear_refs` before each scrape). Goal: ≤ 2 MiB extra. Then the same bodies in
//! delimited protobuf, scraped with Prometheus' protobuf Accept (the merge that keeps native
//! histograms): its latency and peak against the text path's.
//!
//! `cargo bench -p meshagent --bench merge` (or `make bench`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::print_stdout)] // a benchmark binary, not the agent

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use axum::http::HeaderMap;
use bytes::Bytes;
use http_body_util::BodyExt;
use meshagent::config::probers::ScrapeTarget;
use meshagent::metrics::{Registry, register_process_metrics, status_kib};
use meshagent::status::{MergeMetrics, Merger};

const ENVOY_LINES: usize = 100_000;
const APP_BYTES: usize = 1024 * 1024;

fn envoy_body() -> Bytes {
    // 10,000 families × (TYPE + 9 series) = 100,000 lines, shaped like Envoy's output.
    let mut s = String::with_capacity(12 * 1024 * 1024);
    for f in 0..ENVOY_LINES / 10 {
        let _ = writeln!(s, "# TYPE envoy_cluster_upstream_rq_{f} counter");
        for i in 0..9 {
            let _ = writeln!(
                s,
                "envoy_cluster_upstream_rq_{f}{{response_code=\"{}\",cluster_name=\"outbound|8080||svc-{i}.default.svc.cluster.local\"}} {}",
                200 + i,
                f * 7 + i
            );
        }
    }
    Bytes::from(s)
}

fn app_body() -> Bytes {
    let mut s = String::with_capacity(APP_BYTES + 256);
    let mut n = 0;
    while s.len() < APP_BYTES {
        if n % 10 == 0 {
            let _ = writeln!(s, "# TYPE app_metric_{} gauge", n / 10);
        }
        let _ = writeln!(s, "app_metric_{}{{instance=\"{n}\"}} {n}", n / 10);
        n += 1;
    }
    Bytes::from(s)
}

async fn serve(body: Bytes, path: &'static str, content_type: &'static str) -> SocketAddr {
    let app = axum::Router::new().route(
        path,
        axum::routing::get(move || {
            let b = body.clone();
            async move { ([(axum::http::header::CONTENT_TYPE, content_type)], b) }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

fn reset_hwm() {
    // "5" resets the peak RSS (VmHWM) to the current RSS (Linux ≥ 4.0).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// `text` in delimited protobuf.
fn protobuf(text: &[u8]) -> Bytes {
    use meshagent::status::proto;
    let families = proto::from_text(std::str::from_utf8(text).unwrap());
    Bytes::from(proto::encode(
        &families,
        &mut meshagent::status::lines::Seen::default(),
    ))
}

const TEXT: &str = "text/plain; version=0.0.4";
const PROTO_ACCEPT: &str = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited,text/plain;version=0.0.4;q=0.5";

async fn one_scrape(merger: &Merger, accept: Option<&str>) -> (Duration, usize) {
    let start = tokio::time::Instant::now();
    let mut headers = HeaderMap::new();
    if let Some(a) = accept {
        headers.insert(axum::http::header::ACCEPT, a.parse().unwrap());
    }
    let resp = merger.scrape(&headers, None).await;
    let mut body = resp.into_body();
    let mut total = 0;
    while let Some(f) = body.frame().await {
        if let Ok(d) = f.unwrap().into_data() {
            total += d.len();
        }
    }
    (start.elapsed(), total)
}

/// Child mode: serve the two bodies and print their ports; the parent measures only the merge.
async fn serve_bodies() {
    let envoy_body = envoy_body();
    let app_body = app_body();
    eprintln!(
        "envoy body: {} lines, {:.1} MiB; app body: {:.2} MiB",
        ENVOY_LINES,
        envoy_body.len() as f64 / 1048576.0,
        app_body.len() as f64 / 1048576.0
    );
    let (envoy_pb, app_pb) = (protobuf(&envoy_body), protobuf(&app_body));
    eprintln!(
        "as protobuf: envoy {:.1} MiB, app {:.2} MiB",
        envoy_pb.len() as f64 / 1048576.0,
        app_pb.len() as f64 / 1048576.0
    );
    let envoy = serve(envoy_body, "/stats/prometheus", TEXT).await;
    let app = serve(app_body, "/metrics", TEXT).await;
    let envoy_pb = serve(
        envoy_pb,
        "/stats/prometheus",
        meshagent::status::proto::CONTENT_TYPE,
    )
    .await;
    let app_pb = serve(app_pb, "/metrics", meshagent::status::proto::CONTENT_TYPE).await;
    println!(
        "{} {} {} {}",
        envoy.port(),
        app.port(),
        envoy_pb.port(),
        app_pb.port()
    );
    // Until the parent closes our stdin.
    let _ = tokio::task::spawn_blocking(|| {
        let mut buf = [0u8; 1];
        std::io::Read::read(&mut std::io::stdin(), &mut buf)
    })
    .await;
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if std::env::args().any(|a| a == "--serve-bodies") {
        rt.block_on(serve_bodies());
        return;
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .arg("--serve-bodies")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let ports: Vec<u16> = line
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect();
    rt.block_on(async {
        let envoy = SocketAddr::from(([127, 0, 0, 1], ports[0]));
        let app = SocketAddr::from(([127, 0, 0, 1], ports[1]));
        let registry = Registry::new();
        register_process_metrics(&registry).unwrap();
        let merger = Merger::new(
            registry.clone(),
            MergeMetrics::register(&registry).unwrap(),
            Some(envoy),
            vec![ScrapeTarget {
                port: app.port(),
                path: "/metrics".into(),
            }],
        );
        let merger_pb = Merger::new(
            registry.clone(),
            MergeMetrics::register(&Registry::new()).unwrap(),
            Some(SocketAddr::from(([127, 0, 0, 1], ports[2]))),
            vec![ScrapeTarget {
                port: ports[3],
                path: "/metrics".into(),
            }],
        );
        let mut lat = Vec::new();
        let mut peaks = Vec::new();
        for i in 0..8 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            reset_hwm();
            let before = status_kib("VmRSS:").unwrap_or(0.0);
            let (took, bytes) = one_scrape(&merger, None).await;
            let hwm = status_kib("VmHWM:").unwrap_or(0.0);
            let extra_kib = (hwm - before).max(0.0);
            println!(
                "scrape {i}: {:>7.1} ms, {:.1} MiB out, peak RSS +{:.0} KiB",
                took.as_secs_f64() * 1000.0,
                bytes as f64 / 1048576.0,
                extra_kib
            );
            lat.push(took);
            peaks.push(extra_kib);
        }
        let mut pb_lat = Vec::new();
        let mut pb_peaks = Vec::new();
        for i in 0..8 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            reset_hwm();
            let before = status_kib("VmRSS:").unwrap_or(0.0);
            let (took, bytes) = one_scrape(&merger_pb, Some(PROTO_ACCEPT)).await;
            let extra_kib = (status_kib("VmHWM:").unwrap_or(0.0) - before).max(0.0);
            println!(
                "protobuf scrape {i}: {:>7.1} ms, {:.1} MiB out, peak RSS +{:.0} KiB",
                took.as_secs_f64() * 1000.0,
                bytes as f64 / 1048576.0,
                extra_kib
            );
            pb_lat.push(took);
            pb_peaks.push(extra_kib);
        }
        // Baseline in the same run: read both bodies whole, as Istio's merge does (Istio #32386).
        let client = hyper_util::client::legacy::Client::builder(
            hyper_util::rt::TokioExecutor::new(),
        )
        .build_http::<http_body_util::Empty<Bytes>>();
        for i in 0..3 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            reset_hwm();
            let before = status_kib("VmRSS:").unwrap_or(0.0);
            let start = tokio::time::Instant::now();
            let mut whole = Vec::new();
            for uri in [
                format!("http://{envoy}/stats/prometheus"),
                format!("http://{app}/metrics"),
            ] {
                let resp = client.get(uri.parse().unwrap()).await.unwrap();
                let body = resp.into_body().collect().await.unwrap().to_bytes();
                whole.push(body);
            }
            let merged: Vec<u8> = whole.concat();
            let hwm = status_kib("VmHWM:").unwrap_or(0.0);
            println!(
                "baseline {i} (buffered, Istio-style): {:>7.1} ms, {:.1} MiB, peak RSS +{:.0} KiB",
                start.elapsed().as_secs_f64() * 1000.0,
                merged.len() as f64 / 1048576.0,
                (hwm - before).max(0.0)
            );
        }
        lat.sort();
        let first = peaks[0];
        peaks.sort_by(f64::total_cmp);
        println!(
            "latency median {:.1} ms (min {:.1}, max {:.1}); peak RSS increase: first scrape +{:.0} KiB, median +{:.0} KiB, max +{:.0} KiB (goal ≤ 2048 KiB)",
            lat[lat.len() / 2].as_secs_f64() * 1000.0,
            lat[0].as_secs_f64() * 1000.0,
            lat[lat.len() - 1].as_secs_f64() * 1000.0,
            first,
            peaks[peaks.len() / 2],
            peaks[peaks.len() - 1],
        );
        pb_lat.sort();
        pb_peaks.sort_by(f64::total_cmp);
        println!(
            "protobuf: latency median {:.1} ms ({:.2}x text); peak RSS increase median +{:.0} KiB, max +{:.0} KiB (text median +{:.0} KiB)",
            pb_lat[pb_lat.len() / 2].as_secs_f64() * 1000.0,
            pb_lat[pb_lat.len() / 2].as_secs_f64() / lat[lat.len() / 2].as_secs_f64(),
            pb_peaks[pb_peaks.len() / 2],
            pb_peaks[pb_peaks.len() - 1],
            peaks[peaks.len() / 2],
        );
    });
    drop(child.stdin.take());
    let _ = child.wait();
}
