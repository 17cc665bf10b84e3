//! Merged metrics on the status port (Istio `status/server.go` `handleStats`) against a real Envoy and real HTTP metrics
//! endpoints: the output is parsed back with a strict exposition-format parser (every family
//! once and contiguous, every series once, `# EOF` last for OpenMetrics), and failing
//! application targets (down, slow past the scrape timeout, over the 10 MiB cap) leave the
//! agent's and Envoy's metrics intact with the failures counted.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use meshagent::config::probers::ScrapeTarget;
use meshagent::metrics::Registry;
use meshagent::status::{self, MergeMetrics, Merger, StatusState};
use meshagent_testkit::{DEADLINE, Envoy, free_port, wait_for};
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[path = "status_support/peers.rs"]
mod peers;

const OM: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A real HTTP server standing in for the application's metrics endpoints.
async fn start_app() -> u16 {
    async fn text() -> ([(header::HeaderName, &'static str); 1], &'static str) {
        (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            // `envoy_server_live` collides with Envoy's family, `istio_agent_scrapes_total`
            // with the agent's: both must be dropped, not written twice.
            "# HELP app_requests Requests.\n# TYPE app_requests counter\napp_requests{code=\"200\"} 7\napp_requests{code=\"500\"} 1\n# TYPE envoy_server_live gauge\nenvoy_server_live 0\n# TYPE istio_agent_scrapes_total counter\nistio_agent_scrapes_total 99\n# TYPE app_latency histogram\napp_latency_bucket{le=\"0.1\"} 1\napp_latency_bucket{le=\"+Inf\"} 2\napp_latency_sum 0.3\napp_latency_count 2\n",
        )
    }
    async fn text2() -> &'static str {
        "# TYPE app_second gauge\napp_second{path=\"/x y\"} 3\napp_second{path=\"/x y\"} 3\n"
    }
    async fn om() -> ([(header::HeaderName, &'static str); 1], &'static str) {
        (
            [(header::CONTENT_TYPE, OM)],
            "# TYPE app_om_events counter\n# HELP app_om_events Events.\napp_om_events_total 5\napp_om_events_created 1.7e9\n# TYPE app_om_info info\napp_om_info{version=\"1\"} 1\n# EOF\n",
        )
    }
    async fn slow() -> &'static str {
        tokio::time::sleep(Duration::from_secs(5)).await;
        "# TYPE app_slow gauge\napp_slow 1\n"
    }
    async fn big() -> axum::body::Body {
        // 11 MiB of valid lines, streamed.
        let line = Bytes::from(format!("app_big{{i=\"{}\"}} 1\n", "x".repeat(100)));
        let chunk: Bytes = Bytes::from(line.repeat(1024));
        let n = (11 * 1024 * 1024) / chunk.len() + 1;
        axum::body::Body::from_stream(futures::stream::iter(
            (0..n).map(move |_| Ok::<_, std::io::Error>(chunk.clone())),
        ))
    }
    async fn nine(axum::extract::Path(name): axum::extract::Path<String>) -> String {
        nine_mib(&name)
    }
    async fn error() -> (axum::http::StatusCode, &'static str) {
        (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "boom")
    }
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(text))
        .route("/second", axum::routing::get(text2))
        .route("/om", axum::routing::get(om))
        .route("/slow", axum::routing::get(slow))
        .route("/big", axum::routing::get(big))
        .route("/error", axum::routing::get(error))
        .route("/nine/{name}", axum::routing::get(nine));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

/// Just under 9 MiB of distinct series of family `app_nine_<name>`.
fn nine_mib(name: &str) -> String {
    let mut s = format!("# TYPE app_nine_{name} gauge\n");
    let mut i = 0;
    while s.len() < 9 * 1024 * 1024 - 200 {
        s.push_str(&format!(
            "app_nine_{name}{{i=\"{i:08}\",pad=\"{}\"}} 1\n",
            "p".repeat(80)
        ));
        i += 1;
    }
    s
}

async fn start_envoy(dir: &std::path::Path) -> Envoy {
    let envoy = Envoy::start(
        json!({"node": {"id": "sidecar~127.0.0.1~app.default~default.svc.cluster.local", "cluster": "app"}}),
        dir,
    );
    wait_for("Envoy admin", DEADLINE, || async {
        envoy.admin_get("/ready").await.map(|_| ())
    })
    .await;
    envoy
}

struct Agent {
    addr: SocketAddr,
    metrics: MergeMetrics,
    stop: CancellationToken,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn start_status(envoy: Option<SocketAddr>, targets: Vec<ScrapeTarget>) -> Agent {
    let registry = Registry::new();
    meshagent::metrics::register_process_metrics(&registry).unwrap();
    let metrics = MergeMetrics::register(&registry).unwrap();
    registry
        .counter("xds_proxy_requests", "Requests forwarded.")
        .unwrap()
        .inc();
    let merger = Merger::new(registry.clone(), metrics.clone(), envoy, targets);
    let state = StatusState::new(registry, merger).unwrap();

    let port = free_port();
    let listener = status::bind(port).await.unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(status::serve(listener, state, stop.clone()));
    Agent {
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        metrics,
        stop,
    }
}

async fn scrape(addr: SocketAddr, headers: &[(&str, &str)]) -> (u16, HeaderMap, String) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut req = axum::http::Request::get(format!("http://{addr}/stats/prometheus"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = tokio::time::timeout(
        Duration::from_secs(30),
        client.request(req.body(Empty::new()).unwrap()),
    )
    .await
    .unwrap()
    .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

// === a strict parser for the text exposition formats ===

#[derive(Debug, Default)]
struct Parsed {
    /// family name → type
    types: HashMap<String, String>,
    /// series (`name{sorted labels}`) → value
    series: HashMap<String, f64>,
    eof: bool,
}

const SUFFIXES: &[&str] = &[
    "_bucket", "_sum", "_count", "_total", "_created", "_info", "_gcount", "_gsum",
];

fn family_of(sample: &str, current: &str) -> String {
    if sample == current
        || SUFFIXES
            .iter()
            .any(|s| sample.strip_prefix(current) == Some(s))
    {
        current.to_owned()
    } else {
        sample.to_owned()
    }
}

fn valid_name(n: &str) -> bool {
    let mut chars = n.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

type Labels = Vec<(String, String)>;

fn parse_labels(s: &str) -> Result<(Labels, &str), String> {
    let mut rest = s;
    let mut out = Vec::new();
    loop {
        rest = rest.trim_start_matches(',');
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((out, r));
        }
        let (name, r) = rest.split_once("=\"").ok_or(format!("bad label in {s}"))?;
        if !valid_name(name) {
            return Err(format!("bad label name {name:?}"));
        }
        let mut value = String::new();
        let mut chars = r.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err(format!("unterminated label value in {s}")),
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("dangling escape".into()),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
            }
        };
        out.push((name.to_owned(), value));
        rest = &r[end + 1..];
    }
}

fn parse_exposition(body: &str, openmetrics: bool) -> Result<Parsed, String> {
    let mut p = Parsed::default();
    let mut current = String::new();
    let mut closed: HashSet<String> = HashSet::new();
    let mut enter = |family: &str, current: &mut String| -> Result<(), String> {
        if family != current.as_str() {
            if !current.is_empty() {
                closed.insert(current.clone());
            }
            if closed.contains(family) {
                return Err(format!("family {family} is not contiguous"));
            }
            *current = family.to_owned();
        }
        Ok(())
    };
    for (i, line) in body.lines().enumerate() {
        if p.eof {
            return Err(format!("line {} after # EOF: {line:?}", i + 1));
        }
        if line == "# EOF" {
            if !openmetrics {
                return Err("# EOF in text format".into());
            }
            p.eof = true;
            continue;
        }
        if let Some(meta) = line.strip_prefix("# ") {
            let mut parts = meta.splitn(3, ' ');
            let kind = parts.next().unwrap_or("");
            let name = parts.next().ok_or(format!("bad metadata {line:?}"))?;
            if !valid_name(name) {
                return Err(format!("bad metric name {name:?}"));
            }
            enter(name, &mut current)?;
            if kind == "TYPE" {
                let t = parts.next().ok_or("TYPE without type")?;
                if p.types.insert(name.to_owned(), t.to_owned()).is_some() {
                    return Err(format!("second TYPE line for {name}"));
                }
            } else if kind != "HELP" && kind != "UNIT" {
                return Err(format!("unknown metadata {line:?}"));
            }
            continue;
        }
        if line.is_empty() {
            if openmetrics {
                return Err("empty line in OpenMetrics".into());
            }
            continue;
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or(format!("bad sample {line:?}"))?;
        let name = &line[..name_end];
        if !valid_name(name) {
            return Err(format!("bad metric name in {line:?}"));
        }
        let (mut labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end + 1..])?
        } else {
            (Vec::new(), &line[name_end..])
        };
        let value = rest
            .split_whitespace()
            .next()
            .ok_or(format!("no value in {line:?}"))?;
        let v: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v.parse().map_err(|_| format!("bad value in {line:?}"))?,
        };
        let family = family_of(name, &current);
        enter(&family, &mut current)?;
        labels.sort();
        let key = format!("{name}{labels:?}");
        if p.series.insert(key.clone(), v).is_some() {
            return Err(format!("duplicate series {key}"));
        }
    }
    if openmetrics && !p.eof {
        return Err("OpenMetrics body without # EOF".into());
    }
    Ok(p)
}

fn has_family(p: &Parsed, name: &str) -> bool {
    p.series
        .keys()
        .any(|k| k.starts_with(name) && k[name.len()..].starts_with('['))
}

fn value(p: &Parsed, key: &str) -> Option<f64> {
    p.series.get(key).copied()
}

#[tokio::test]
async fn merged_text_and_openmetrics_parse_strictly() {
    let dir = tempfile::tempdir().unwrap();
    let envoy = start_envoy(dir.path()).await;
    let app = start_app().await;
    let agent = start_status(
        Some(envoy.admin),
        vec![
            ScrapeTarget {
                port: app,
                path: "/metrics".into(),
            },
            ScrapeTarget {
                port: app,
                path: "/second".into(),
            },
        ],
    )
    .await;

    // Text 0.0.4: agent, Envoy and both app targets, each family once.
    let (code, headers, body) = wait_for("a merged scrape", DEADLINE, || async {
        let r = scrape(agent.addr, &[("Accept", "text/plain;version=0.0.4")]).await;
        r.2.contains("envoy_server_live").then_some(r)
    })
    .await;
    assert_eq!(code, 200);
    assert_eq!(
        headers.get(header::CONTENT_TYPE).unwrap(),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let p = parse_exposition(&body, false).unwrap_or_else(|e| panic!("{e}\n{body}"));
    assert_eq!(p.types["istio_agent_xds_proxy_requests"], "counter");
    assert_eq!(value(&p, "istio_agent_xds_proxy_requests[]"), Some(1.0));
    assert!(has_family(&p, "istio_agent_process_resident_memory_bytes"));
    // The agent's own family wins over the application's copy.
    assert_ne!(value(&p, "istio_agent_scrapes_total[]"), Some(99.0));
    // Envoy's `envoy_server_live` (1 = live) wins over the application's (0).
    assert_eq!(value(&p, "envoy_server_live[]"), Some(1.0));
    assert!(p.types.keys().filter(|k| k.starts_with("envoy_")).count() > 20);
    assert_eq!(
        value(&p, "app_requests[(\"code\", \"500\")]"),
        Some(1.0),
        "{body}"
    );
    assert_eq!(value(&p, "app_latency_count[]"), Some(2.0));
    // The second target is written after the first, and its duplicate series only once.
    assert_eq!(value(&p, "app_second[(\"path\", \"/x y\")]"), Some(3.0));
    assert!(body.find("app_requests").unwrap() < body.find("app_second").unwrap());
    assert!(body.find("istio_agent_").unwrap() < body.find("envoy_").unwrap());
    assert!(body.find("envoy_").unwrap() < body.find("app_requests").unwrap());
    assert!(!body.contains("# EOF"));

    // gzip when the scraper accepts it.
    let (code, headers, _) = scrape(agent.addr, &[("Accept-Encoding", "gzip")]).await;
    assert_eq!(code, 200);
    assert_eq!(headers.get(header::CONTENT_ENCODING).unwrap(), "gzip");
    assert_eq!(agent.metrics.failures("envoy"), 0);
    assert_eq!(agent.metrics.failures("application"), 0);
}

#[tokio::test]
async fn openmetrics_target_keeps_one_eof() {
    let dir = tempfile::tempdir().unwrap();
    let envoy = start_envoy(dir.path()).await;
    let app = start_app().await;
    let agent = start_status(
        Some(envoy.admin),
        vec![ScrapeTarget {
            port: app,
            path: "/om".into(),
        }],
    )
    .await;
    let accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5";
    let (code, headers, body) = scrape(agent.addr, &[("Accept", accept)]).await;
    assert_eq!(code, 200);
    assert_eq!(headers.get(header::CONTENT_TYPE).unwrap(), OM);
    let p = parse_exposition(&body, true).unwrap_or_else(|e| panic!("{e}\n{body}"));
    assert!(p.eof);
    assert_eq!(body.matches("# EOF").count(), 1);
    assert!(body.ends_with("# EOF\n"));
    assert_eq!(value(&p, "app_om_events_total[]"), Some(5.0));
    assert!(has_family(&p, "envoy_server_live"));
    assert!(has_family(&p, "istio_agent_scrapes_total"));

    // A text-only scraper still gets text, without the OpenMetrics terminator.
    let (_, headers, body) = scrape(agent.addr, &[("Accept", "text/plain")]).await;
    let ct = headers.get(header::CONTENT_TYPE).unwrap();
    // The app decides the content type; this one always answers OpenMetrics.
    if ct == HeaderValue::from_static(OM) {
        parse_exposition(&body, true).unwrap();
    } else {
        parse_exposition(&body, false).unwrap();
    }
}

#[tokio::test]
async fn failing_targets_still_serve_agent_and_envoy() {
    let dir = tempfile::tempdir().unwrap();
    let envoy = start_envoy(dir.path()).await;
    let app = start_app().await;
    let down = free_port();
    let target = |port, path: &str| ScrapeTarget {
        port,
        path: path.into(),
    };
    let agent = start_status(
        Some(envoy.admin),
        vec![
            target(app, "/metrics"),
            target(down, "/metrics"),
            target(app, "/error"),
            target(app, "/big"),
            target(app, "/slow"),
        ],
    )
    .await;
    let started = tokio::time::Instant::now();
    let (code, _, body) = scrape(
        agent.addr,
        &[("X-Prometheus-Scrape-Timeout-Seconds", "2.5")],
    )
    .await;
    let took = started.elapsed();
    assert_eq!(code, 200);
    assert!(
        took < Duration::from_secs(5),
        "the scrape timeout bounds the scrape: {took:?}"
    );
    let p = parse_exposition(&body, false).unwrap_or_else(|e| panic!("{e}\n{body}"));
    assert!(has_family(&p, "istio_agent_xds_proxy_requests"));
    assert!(has_family(&p, "envoy_server_live"));
    assert!(has_family(&p, "app_requests"));
    assert!(!has_family(&p, "app_slow"));
    // The over-cap body is cut at a family boundary; never more than the cap is passed on.
    assert!(body.len() < 11 * 1024 * 1024, "{}", body.len());
    // down, 500, over the cap, past the timeout
    assert_eq!(agent.metrics.failures("application"), 4);
    assert_eq!(agent.metrics.failures("envoy"), 0);
    let (_, _, body) = scrape(
        agent.addr,
        &[("X-Prometheus-Scrape-Timeout-Seconds", "0.5")],
    )
    .await;
    assert!(
        body.contains("istio_agent_scrape_failures_total{type=\"application\"} 4"),
        "{body}"
    );

    // Envoy gone: agent and application metrics are still served, the failure is counted.
    drop(envoy);
    let (code, _, body) = scrape(agent.addr, &[("X-Prometheus-Scrape-Timeout-Seconds", "1")]).await;
    assert_eq!(code, 200);
    let p = parse_exposition(&body, false).unwrap_or_else(|e| panic!("{e}\n{body}"));
    assert!(has_family(&p, "istio_agent_scrapes_total"));
    assert!(!has_family(&p, "envoy_server_live") || value(&p, "envoy_server_live[]") == Some(0.0));
    assert!(agent.metrics.failures("envoy") >= 1);
}

/// F18: a 100,000-line Envoy exposition (1,000 histogram and counter families, as a sidecar
/// with many clusters and `statsInclusionPrefixes` produces) is merged whole with the
/// application's and the agent's metrics: every Envoy series arrives once and the output
/// still parses strictly.
#[tokio::test]
async fn f18_hundred_thousand_line_envoy_output_is_merged_whole() {
    const FAMILIES: usize = 1_000;
    const SERIES: usize = 98; // + HELP and TYPE: 100 lines per family
    fn envoy_body() -> String {
        let mut s = String::with_capacity(8 << 20);
        for f in 0..FAMILIES {
            s.push_str(&format!(
                "# HELP envoy_cluster_upstream_rq_{f} Requests.\n# TYPE envoy_cluster_upstream_rq_{f} counter\n"
            ));
            for i in 0..SERIES {
                s.push_str(&format!(
                    "envoy_cluster_upstream_rq_{f}{{cluster_name=\"outbound|80||svc{i}.ns.svc.cluster.local\"}} {i}\n"
                ));
            }
        }
        s
    }
    let body = Arc::new(envoy_body());
    assert_eq!(body.lines().count(), 100_000);
    let served = body.clone();
    let fake_envoy = axum::Router::new().route(
        "/stats/prometheus",
        axum::routing::get(move || {
            let b = served.clone();
            async move {
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    (*b).clone(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let envoy_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, fake_envoy).await });
    let app = start_app().await;
    let agent = start_status(
        Some(envoy_addr),
        vec![ScrapeTarget {
            port: app,
            path: "/metrics".into(),
        }],
    )
    .await;

    let (code, _, merged) = scrape(agent.addr, &[]).await;
    assert_eq!(code, 200);
    let p = parse_exposition(&merged, false).unwrap_or_else(|e| panic!("{e}"));
    let envoy_series = p
        .series
        .keys()
        .filter(|k| k.starts_with("envoy_cluster_upstream_rq_"))
        .count();
    assert_eq!(envoy_series, FAMILIES * SERIES, "every Envoy series, once");
    assert_eq!(
        value(
            &p,
            r#"envoy_cluster_upstream_rq_999[("cluster_name", "outbound|80||svc97.ns.svc.cluster.local")]"#
        ),
        Some(97.0)
    );
    assert!(has_family(&p, "app_requests"));
    assert!(has_family(&p, "istio_agent_xds_proxy_requests"));
    assert_eq!(agent.metrics.failures("envoy"), 0);
    assert_eq!(agent.metrics.failures("application"), 0);
}

/// Istio's 10 MiB cap is per target (`maxAppBodyBytes` in `scrapeMultipleApps`): two targets of
/// 9 MiB each are merged whole, 18 MiB in one scrape, nothing counted as failed.
#[tokio::test]
async fn the_size_cap_is_per_target() {
    let app = start_app().await;
    let target = |path: &str| ScrapeTarget {
        port: app,
        path: path.into(),
    };
    let agent = start_status(None, vec![target("/nine/a"), target("/nine/b")]).await;
    let (code, _, body) = scrape(agent.addr, &[]).await;
    assert_eq!(code, 200);
    for name in ["a", "b"] {
        let want = nine_mib(name);
        let got = body
            .lines()
            .filter(|l| l.starts_with(&format!("app_nine_{name}{{")))
            .count();
        assert_eq!(
            got,
            want.lines().count() - 1,
            "app_nine_{name}: every series"
        );
    }
    assert!(body.len() > 18 * 1024 * 1024 - 400, "{}", body.len());
    assert_eq!(agent.metrics.failures("application"), 0);
    assert!(
        body.contains(&format!(
            "istio_agent_merge_target_up{{type=\"application\",target=\"localhost:{app}/nine/b\"}} 1\n"
        )),
        "{}",
        &body[body.len().saturating_sub(2000)..]
    );
}

// === protobuf: native histograms through the merge ===

/// What Prometheus sends with native histograms on (`scrape_protocols` led by
/// `PrometheusProto`).
const PROMETHEUS_PROTO_ACCEPT: &str = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// `promproto`: `$PROMPROTO`, else the project's `.tools/bin` (`make metricspeers`).
fn promproto() -> std::path::PathBuf {
    peers::peer("promproto", "PROMPROTO")
}

/// A Go application on the Prometheus Go client (promhttp), with a native histogram.
async fn start_go_app(dir: &std::path::Path) -> (meshagent_testkit::Proc, u16) {
    let port = free_port();
    let mut cmd = std::process::Command::new(promproto());
    cmd.args(["serve", &port.to_string()]);
    let proc = meshagent_testkit::Proc::spawn("promproto", cmd, dir);
    wait_for("the Go application", DEADLINE, || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    (proc, port)
}

/// The Go client's protobuf parser on `body`: family → (type, series, series with native
/// buckets); its error when it rejects the body.
fn parse_protobuf(body: &[u8]) -> Result<HashMap<String, (String, usize, usize)>, String> {
    Ok(peers::parse_lines(promproto(), &["parse"], body)?
        .into_iter()
        .map(|f| {
            (
                f[0].clone(),
                (f[1].clone(), f[2].parse().unwrap(), f[3].parse().unwrap()),
            )
        })
        .collect())
}

async fn scrape_raw(addr: SocketAddr, accept: &str) -> (HeaderMap, Bytes) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let req = axum::http::Request::get(format!("http://{addr}/stats/prometheus"))
        .header(header::ACCEPT, accept)
        .body(Empty::new())
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    let headers = resp.headers().clone();
    (
        headers,
        resp.into_body().collect().await.unwrap().to_bytes(),
    )
}

/// Prometheus asking for protobuf, with the real Envoy and a Go application (Prometheus' Go
/// client) both answering it: the merge answers protobuf, the application's native histogram
/// arrives with its native buckets, Envoy's and the agent's families each once, and the Go
/// client's own decoder accepts the whole body. With a text-only application beside them the
/// answer is text (what Istio always answers), parsed strictly; asked for text, text.
#[tokio::test]
async fn protobuf_merge_keeps_native_histograms() {
    let dir = tempfile::tempdir().unwrap();
    let envoy = start_envoy(dir.path()).await;
    let (_go, go_port) = start_go_app(dir.path()).await;
    let target = |port, path: &str| ScrapeTarget {
        port,
        path: path.into(),
    };
    let agent = start_status(Some(envoy.admin), vec![target(go_port, "/metrics")]).await;

    let (h, body) = scrape_raw(agent.addr, PROMETHEUS_PROTO_ACCEPT).await;
    assert_eq!(
        h.get(header::CONTENT_TYPE).unwrap(),
        "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited"
    );
    let families = parse_protobuf(&body).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        families.get("app_native_seconds"),
        Some(&("HISTOGRAM".to_owned(), 1, 1)),
        "{families:?}"
    );
    assert_eq!(
        families.get("app_classic_seconds"),
        Some(&("HISTOGRAM".to_owned(), 1, 0))
    );
    assert_eq!(
        families.get("app_requests_total").map(|f| &f.0[..]),
        Some("COUNTER")
    );
    assert_eq!(
        families.get("istio_agent_scrapes_total").map(|f| &f.0[..]),
        Some("COUNTER")
    );
    assert_eq!(
        families
            .get("istio_agent_xds_proxy_requests")
            .map(|f| &f.0[..]),
        Some("COUNTER")
    );
    assert!(
        families.keys().any(|f| f.starts_with("envoy_")),
        "{families:?}"
    );
    assert_eq!(
        families.get("istio_agent_merge_target_up"),
        Some(&("GAUGE".to_owned(), 2, 0))
    );
    assert_eq!(agent.metrics.failures("envoy"), 0);
    assert_eq!(agent.metrics.failures("application"), 0);

    // A text-only application too: text for everyone, strictly parsed.
    let text_app = start_app().await;
    let agent = start_status(
        Some(envoy.admin),
        vec![target(go_port, "/metrics"), target(text_app, "/metrics")],
    )
    .await;
    let (h, body) = scrape_raw(agent.addr, PROMETHEUS_PROTO_ACCEPT).await;
    assert_eq!(
        h.get(header::CONTENT_TYPE).unwrap(),
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let text = String::from_utf8(body.to_vec()).unwrap();
    let p = parse_exposition(&text, false).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert!(has_family(&p, "app_native_seconds_count"), "{text}");
    assert!(has_family(&p, "app_requests"), "{text}");
    assert!(has_family(&p, "envoy_server_live"), "{text}");
    assert_eq!(agent.metrics.failures("envoy"), 0);
    assert_eq!(agent.metrics.failures("application"), 0);

    // Asked for text: text, as before.
    let (h, _) = scrape_raw(agent.addr, "text/plain;version=0.0.4;q=1,*/*;q=0.1").await;
    assert_eq!(
        h.get(header::CONTENT_TYPE).unwrap(),
        "text/plain; version=0.0.4; charset=utf-8"
    );
}
