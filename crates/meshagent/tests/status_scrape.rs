//! The merged `/stats/prometheus` of the agent binary (`meshagent proxy`, `DISABLE_ENVOY=true`)
//! with application targets from `ISTIO_PROMETHEUS_ANNOTATIONS` served by a real HTTP server
//! in the test, some of them broken, parsed by a real strict Prometheus parser:
//! `expfmt-check` (github.com/prometheus/common/expfmt, installed by `make metricspeers`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use axum::http::header;
use meshagent_testkit::{DEADLINE, Proc, free_port, status_only_agent, wait_for};
use serde_json::json;

#[path = "status_support/peers.rs"]
mod peers;

const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
const PROTOBUF: &str =
    "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited";

/// Parses `body` strictly with `expfmt-check` (`$EXPFMT_CHECK`, else the project's
/// `.tools/bin`): family name -> (TYPE, number of series), or the parser's error.
fn parse(body: &[u8]) -> Result<HashMap<String, (String, usize)>, String> {
    let checker = peers::peer("expfmt-check", "EXPFMT_CHECK");
    Ok(peers::parse_lines(checker, &[], body)?
        .into_iter()
        .map(|f| (f[0].clone(), (f[1].clone(), f[2].parse().unwrap())))
        .collect())
}

/// An application serving `(path, content type, body)` on 127.0.0.1.
async fn start_app(routes: Vec<(&'static str, &'static str, Vec<u8>)>) -> u16 {
    let mut app = axum::Router::new();
    for (path, ct, body) in routes {
        app = app.route(
            path,
            axum::routing::get(move || {
                let body = body.clone();
                async move { ([(header::CONTENT_TYPE, ct)], body) }
            }),
        );
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

/// The agent binary scraping `paths` of the app on `port`, in that order.
fn start_agent(cwd: &std::path::Path, status: u16, port: u16, paths: &[&str]) -> Proc {
    let targets: Vec<_> = paths
        .iter()
        .map(|p| json!({"port": port.to_string(), "path": p}))
        .collect();
    let annotations = json!({"scrape": "true", "targets": targets});
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_meshagent"));
    status_only_agent(&mut cmd, cwd, status)
        .env("ISTIO_PROMETHEUS_ANNOTATIONS", annotations.to_string());
    Proc::spawn("agent", cmd, cwd)
}

/// GET /stats/prometheus as raw bytes (HTTP/1.0, so the body ends at close).
fn scrape_raw(status: SocketAddr) -> std::io::Result<Vec<u8>> {
    let mut s = std::net::TcpStream::connect(status)?;
    s.set_read_timeout(Some(Duration::from_secs(15)))?;
    s.write_all(b"GET /stats/prometheus HTTP/1.0\r\nHost: agent\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no header end"))?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(std::io::Error::other(head));
    }
    Ok(raw[split + 4..].to_vec())
}

async fn scrape(status: SocketAddr) -> Vec<u8> {
    wait_for("the agent's /stats/prometheus", DEADLINE, || async move {
        tokio::task::spawn_blocking(move || scrape_raw(status).ok())
            .await
            .unwrap()
    })
    .await
}

fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.split(' ').next()?.parse().ok())
}

const GOOD: &str = "# HELP app_good_total Good requests.\n# TYPE app_good_total counter\napp_good_total{path=\"/\"} 42\n";

/// An application exposing one family twice (`# TYPE app_dup counter` / `app_dup 1` /
/// `# TYPE app_dup gauge` / `app_dup 2`): the repeated block is dropped whole (its TYPE line
/// too) and counted, the rest of that source, the agent's metrics and a second application's
/// all survive, and a strict parser accepts the merged scrape.
#[tokio::test]
async fn q3_family_repeated_in_one_source_is_dropped_whole() {
    let dup = "# TYPE app_dup counter\napp_dup 1\n# TYPE app_dup gauge\napp_dup 2\n# TYPE app_after gauge\napp_after 3\n";
    // The parser is strict about a repeated TYPE line: the app's own body fails it.
    let err = parse(dup.as_bytes()).unwrap_err();
    assert!(
        err.contains("second HELP") || err.contains("second TYPE"),
        "{err}"
    );
    assert!(parse(GOOD.as_bytes()).is_ok());

    let port = start_app(vec![
        ("/dup", TEXT, dup.as_bytes().to_vec()),
        ("/good", TEXT, GOOD.as_bytes().to_vec()),
    ])
    .await;
    let cwd = tempfile::tempdir().unwrap();
    let status = free_port();
    let agent = start_agent(cwd.path(), status, port, &["/dup", "/good"]);
    let status = SocketAddr::from(([127, 0, 0, 1], status));

    let body = scrape(status).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    let families = parse(&body).unwrap_or_else(|e| {
        panic!(
            "strict parser rejected the merged scrape: {e}\n{text}\n{}",
            agent.log_text()
        )
    });
    assert_eq!(
        families.get("app_dup"),
        Some(&("COUNTER".into(), 1)),
        "{text}"
    );
    assert_eq!(sample(&text, "app_dup"), Some(1.0), "{text}");
    assert!(
        !text.contains("Second.") && !text.contains("app_dup gauge"),
        "{text}"
    );
    assert_eq!(sample(&text, "app_after"), Some(3.0), "{text}");
    assert_eq!(
        sample(&text, "app_good_total{path=\"/\"}"),
        Some(42.0),
        "{text}"
    );
    assert!(families.contains_key("istio_agent_scrapes_total"), "{text}");

    // Counted: one dropped block, no failed scrape.
    let text = String::from_utf8(scrape(status).await).unwrap();
    assert_eq!(
        sample(
            &text,
            "istio_agent_merge_dropped_families_total{type=\"application\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(
            &text,
            "istio_agent_scrape_failures_total{type=\"application\"}"
        ),
        Some(0.0),
        "{text}"
    );
}

/// A delimited protobuf `MetricFamily` (`app_proto`, a counter at 1): what a client library
/// answers when it ignores the Accept header the agent sent.
fn protobuf_body() -> Vec<u8> {
    let mut counter = vec![0x09];
    counter.extend_from_slice(&1.0f64.to_le_bytes());
    let mut metric = vec![0x1a, counter.len() as u8];
    metric.extend_from_slice(&counter);
    let mut family = vec![0x0a, 9];
    family.extend_from_slice(b"app_proto");
    family.extend_from_slice(&[0x18, 0x00, 0x22, metric.len() as u8]);
    family.extend_from_slice(&metric);
    let mut body = vec![family.len() as u8];
    body.extend_from_slice(&family);
    // A second family after a newline byte, as a real multi-family body has.
    body.extend_from_slice(b"\napp_proto_next 1\n");
    body
}

/// Sources answering protobuf, or text with invalid UTF-8 in a label value or a metric name:
/// each is cut at a family boundary (protobuf: nothing of it) and counted in
/// `istio_agent_scrape_failures_total{type="application"}`; the agent's metrics and a good
/// application's survive, and a strict parser accepts the merged scrape.
#[tokio::test]
async fn q4_non_text_and_invalid_utf8_sources_are_cut_and_counted() {
    let bad_value = b"# TYPE app_v_ok gauge\napp_v_ok 1\n# TYPE app_v_bad gauge\napp_v_bad{v=\"\xff\xfe\"} 1\n# TYPE app_v_after gauge\napp_v_after 1\n".to_vec();
    let bad_name =
        b"# TYPE app_n_ok gauge\napp_n_ok 1\napp_n_\xc3\x28 1\n# TYPE app_n_after gauge\napp_n_after 1\n"
            .to_vec();
    for body in [&bad_value, &bad_name, &protobuf_body()] {
        assert!(parse(body).is_err(), "{}", String::from_utf8_lossy(body));
    }
    let port = start_app(vec![
        ("/proto", PROTOBUF, protobuf_body()),
        ("/bad-value", TEXT, bad_value),
        ("/bad-name", TEXT, bad_name),
        ("/good", TEXT, GOOD.as_bytes().to_vec()),
    ])
    .await;
    let cwd = tempfile::tempdir().unwrap();
    let status = free_port();
    let agent = start_agent(
        cwd.path(),
        status,
        port,
        &["/proto", "/bad-value", "/bad-name", "/good"],
    );
    let status = SocketAddr::from(([127, 0, 0, 1], status));

    let body = scrape(status).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    let families = parse(&body).unwrap_or_else(|e| {
        panic!(
            "strict parser rejected the merged scrape: {e}\n{text}\n{}",
            agent.log_text()
        )
    });
    assert!(std::str::from_utf8(&body).is_ok(), "{text}");
    // Protobuf: nothing of it.
    assert!(
        !families.keys().any(|f| f.starts_with("app_proto")) && !text.contains("app_proto"),
        "{text}"
    );
    // Text sources: cut at the family before the bad line.
    assert_eq!(sample(&text, "app_v_ok"), Some(1.0), "{text}");
    assert_eq!(sample(&text, "app_n_ok"), Some(1.0), "{text}");
    for gone in ["app_v_bad", "app_v_after", "app_n_after"] {
        assert!(!families.contains_key(gone), "{gone}: {text}");
    }
    assert_eq!(
        sample(&text, "app_good_total{path=\"/\"}"),
        Some(42.0),
        "{text}"
    );
    assert!(families.contains_key("istio_agent_scrapes_total"), "{text}");

    // Counted as failed scrapes of the application, once per bad source.
    let text = String::from_utf8(scrape(status).await).unwrap();
    assert_eq!(
        sample(
            &text,
            "istio_agent_scrape_failures_total{type=\"application\"}"
        ),
        Some(3.0),
        "{text}\n{}",
        agent.log_text()
    );
}

/// Per-target health in the merge: an application metrics port nobody listens on, one that
/// answers 500 and a good one, behind the agent binary. The broken ones show as
/// `istio_agent_merge_target_up … 0` (not as missing families), the good one as 1, each with
/// its scrape duration, and a strict parser accepts the scrape with these series in it.
#[tokio::test]
async fn merge_target_health_shows_a_dead_app_port_as_down() {
    let port = start_app(vec![("/good", TEXT, GOOD.as_bytes().to_vec())]).await;
    let dead = free_port();
    let cwd = tempfile::tempdir().unwrap();
    let status = free_port();
    let annotations = json!({"scrape": "true", "targets": [
        {"port": port.to_string(), "path": "/good"},
        {"port": dead.to_string(), "path": "/metrics"},
        {"port": port.to_string(), "path": "/missing"},
    ]});
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_meshagent"));
    status_only_agent(&mut cmd, cwd.path(), status)
        .env("ISTIO_PROMETHEUS_ANNOTATIONS", annotations.to_string());
    let agent = Proc::spawn("agent", cmd, cwd.path());
    let status = SocketAddr::from(([127, 0, 0, 1], status));

    let body = scrape(status).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    let families = parse(&body).unwrap_or_else(|e| {
        panic!(
            "strict parser rejected the merged scrape: {e}\n{text}\n{}",
            agent.log_text()
        )
    });
    assert_eq!(
        families.get("istio_agent_merge_target_up"),
        Some(&("GAUGE".into(), 3)),
        "{text}"
    );
    assert_eq!(
        families.get("istio_agent_merge_target_scrape_duration_seconds"),
        Some(&("GAUGE".into(), 3)),
        "{text}"
    );
    let up = |target: String| {
        sample(
            &text,
            &format!("istio_agent_merge_target_up{{type=\"application\",target=\"{target}\"}}"),
        )
    };
    assert_eq!(up(format!("localhost:{port}/good")), Some(1.0), "{text}");
    assert_eq!(up(format!("localhost:{dead}/metrics")), Some(0.0), "{text}");
    assert_eq!(up(format!("localhost:{port}/missing")), Some(0.0), "{text}");
    for target in [
        format!("localhost:{port}/good"),
        format!("localhost:{dead}/metrics"),
    ] {
        let secs = sample(
            &text,
            &format!(
                "istio_agent_merge_target_scrape_duration_seconds{{type=\"application\",target=\"{target}\"}}"
            ),
        );
        assert!(
            secs.is_some_and(|s| (0.0..60.0).contains(&s)),
            "{target}: {text}"
        );
    }
    // The good target's metrics are still there; the failures still counted as Istio does.
    assert_eq!(
        sample(&text, "app_good_total{path=\"/\"}"),
        Some(42.0),
        "{text}"
    );
    let text = String::from_utf8(scrape(status).await).unwrap();
    assert_eq!(
        sample(
            &text,
            "istio_agent_scrape_failures_total{type=\"application\"}"
        ),
        Some(2.0),
        "{text}"
    );
}
