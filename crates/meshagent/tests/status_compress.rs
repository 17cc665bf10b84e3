//! gzip and zstd on the status port, negotiated as Istio's status server does through
//! klauspost/compress `gzhttp` (`pilot/cmd/pilot-agent/status/server.go`): real HTTP requests
//! with each `Accept-Encoding`, the answers decompressed and compared with the identity
//! answer, the headers checked (`Content-Encoding`, `Vary`, no `Content-Length`), and the
//! merged metrics shown to stream through the encoder: a target's first megabytes reach the
//! client, compressed, while a later target has not answered yet.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use meshagent::config::probers::ScrapeTarget;
use meshagent::metrics::Registry;
use meshagent::status::{self, MergeMetrics, Merger, StatusState};
use meshagent_testkit::free_port;
use tokio::io::AsyncReadExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Lines of the large target: ~2.3 MiB of text.
const BIG_LINES: usize = 20_000;

fn big_line(i: usize) -> String {
    format!("app_big{{i=\"{i}\",pad=\"{}\"}} {i}\n", "p".repeat(90))
}

/// The application: `/big` (a large exposition, streamed in 64 KiB chunks), `/small`, and
/// `/held`, whose head comes at once and whose body waits for `release`.
async fn start_app(release: Arc<Notify>) -> u16 {
    async fn big() -> axum::body::Body {
        let mut text = String::from("# TYPE app_big gauge\n");
        for i in 0..BIG_LINES {
            text.push_str(&big_line(i));
        }
        let bytes = Bytes::from(text);
        let chunks: Vec<Bytes> = (0..bytes.len())
            .step_by(64 * 1024)
            .map(|o| bytes.slice(o..(o + 64 * 1024).min(bytes.len())))
            .collect();
        axum::body::Body::from_stream(futures::stream::iter(
            chunks.into_iter().map(Ok::<_, std::io::Error>),
        ))
    }
    async fn small() -> &'static str {
        "# TYPE app_small gauge\napp_small 1\n"
    }
    let held = move || {
        let release = release.clone();
        async move {
            axum::body::Body::from_stream(futures::stream::once(async move {
                release.notified().await;
                Ok::<_, std::io::Error>(Bytes::from_static(b"# TYPE app_held gauge\napp_held 1\n"))
            }))
        }
    };
    let app = axum::Router::new()
        .route("/big", axum::routing::get(big))
        .route("/small", axum::routing::get(small))
        .route("/held", axum::routing::get(held));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    port
}

struct Agent {
    addr: SocketAddr,
    stop: CancellationToken,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn start_status(targets: Vec<ScrapeTarget>) -> Agent {
    let registry = Registry::new();
    let metrics = MergeMetrics::register(&registry).unwrap();
    let merger = Merger::new(registry.clone(), metrics, None, targets);
    let state = StatusState::new(registry, merger).unwrap();

    let port = free_port();
    let listener = status::bind(port).await.unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(status::serve(listener, state, stop.clone()));
    Agent {
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        stop,
    }
}

fn target(port: u16, path: &str) -> ScrapeTarget {
    ScrapeTarget {
        port,
        path: path.into(),
    }
}

async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    accept_encoding: Option<&str>,
) -> hyper::Response<hyper::body::Incoming> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let mut req = axum::http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    if let Some(ae) = accept_encoding {
        req = req.header(header::ACCEPT_ENCODING, ae);
    }
    tokio::time::timeout(
        Duration::from_secs(30),
        client.request(req.body(Empty::new()).unwrap()),
    )
    .await
    .unwrap()
    .unwrap()
}

async fn decode(encoding: Option<&str>, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match encoding {
        None => out.extend_from_slice(body),
        Some("gzip") => {
            async_compression::tokio::bufread::GzipDecoder::new(body)
                .read_to_end(&mut out)
                .await
                .unwrap();
        }
        Some("zstd") => {
            async_compression::tokio::bufread::ZstdDecoder::new(body)
                .read_to_end(&mut out)
                .await
                .unwrap();
        }
        Some(other) => panic!("unexpected Content-Encoding {other}"),
    }
    out
}

fn header<'a>(h: &'a HeaderMap, name: &header::HeaderName) -> Option<&'a str> {
    h.get(name).map(|v| v.to_str().unwrap())
}

/// The merged body without the samples that change from scrape to scrape.
fn stable(body: &[u8]) -> String {
    String::from_utf8(body.to_vec())
        .unwrap()
        .lines()
        .filter(|l| {
            !l.starts_with("istio_agent_scrapes_total")
                && !l.starts_with("istio_agent_merge_target_scrape_duration_seconds{")
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

#[tokio::test]
async fn merged_metrics_are_compressed_as_accept_encoding_asks() {
    let app = start_app(Arc::new(Notify::new())).await;
    let agent = start_status(vec![target(app, "/big"), target(app, "/small")]).await;

    let resp = request(agent.addr, "GET", "/stats/prometheus", None).await;
    assert_eq!(
        header(resp.headers(), &header::VARY),
        Some("Accept-Encoding")
    );
    assert_eq!(header(resp.headers(), &header::CONTENT_ENCODING), None);
    let identity = resp.into_body().collect().await.unwrap().to_bytes();
    let identity = stable(&identity);
    assert!(
        identity.contains(&big_line(BIG_LINES - 1)),
        "the whole target"
    );
    assert!(identity.contains("app_small 1\n"));

    // (Accept-Encoding, the coding gzhttp picks)
    let cases: &[(&str, Option<&str>)] = &[
        ("gzip", Some("gzip")),
        ("zstd", Some("zstd")),
        // Both at q=1: zstd.
        ("gzip, deflate, br, zstd", Some("zstd")),
        ("gzip;q=1.0, zstd;q=0.5", Some("gzip")),
        ("gzip;q=0.2, zstd;q=0.3", Some("zstd")),
        ("x-gzip, GZIP", Some("gzip")),
        ("gzip;q=0, zstd;q=0", None),
        ("gzip;q=0", None),
        ("br, deflate", None),
        // identity and * are not looked at: identity.
        ("identity", None),
        ("*", None),
        ("identity;q=1, gzip;q=0.1", Some("gzip")),
        ("", None),
    ];
    for (ae, want) in cases {
        let resp = request(agent.addr, "GET", "/stats/prometheus", Some(ae)).await;
        assert_eq!(resp.status(), 200, "{ae}");
        let h = resp.headers().clone();
        assert_eq!(header(&h, &header::CONTENT_ENCODING), *want, "{ae}");
        assert_eq!(header(&h, &header::VARY), Some("Accept-Encoding"), "{ae}");
        assert_eq!(
            header(&h, &header::CONTENT_TYPE),
            Some("text/plain; version=0.0.4; charset=utf-8"),
            "{ae}"
        );
        if want.is_some() {
            assert_eq!(header(&h, &header::CONTENT_LENGTH), None, "{ae}");
        }
        let raw = resp.into_body().collect().await.unwrap().to_bytes();
        if want.is_some() {
            assert!(
                raw.len() * 4 < identity.len(),
                "{ae}: {} compressed bytes for {}",
                raw.len(),
                identity.len()
            );
        }
        let body = decode(*want, &raw).await;
        assert!(stable(&body) == identity, "{ae}: decoded body differs");
    }

    // HEAD is never compressed; a short answer neither, and both say Vary.
    let resp = request(agent.addr, "HEAD", "/stats/prometheus", Some("gzip")).await;
    assert_eq!(header(resp.headers(), &header::CONTENT_ENCODING), None);
    assert_eq!(
        header(resp.headers(), &header::VARY),
        Some("Accept-Encoding")
    );
    for path in ["/healthz/ready", "/debug/ndsz"] {
        let resp = request(agent.addr, "GET", path, Some("gzip, zstd")).await;
        let h = resp.headers().clone();
        assert_eq!(header(&h, &header::CONTENT_ENCODING), None, "{path}");
        assert_eq!(header(&h, &header::VARY), Some("Accept-Encoding"), "{path}");
    }
}

/// Not buffered whole: with the last target's body held back, the client decompresses most
/// of the first target (over a megabyte) from the compressed stream; released, the rest
/// follows and the decoded answer is complete.
#[tokio::test]
async fn compressed_merge_streams_before_the_last_target_answers() {
    let release = Arc::new(Notify::new());
    let app = start_app(release.clone()).await;
    let agent = start_status(vec![target(app, "/big"), target(app, "/held")]).await;
    for coding in ["gzip", "zstd"] {
        let resp = request(agent.addr, "GET", "/stats/prometheus", Some(coding)).await;
        assert_eq!(
            header(resp.headers(), &header::CONTENT_ENCODING),
            Some(coding)
        );
        let stream = resp.into_body().into_data_stream();
        let reader = tokio_util::io::StreamReader::new(futures::StreamExt::map(stream, |r| {
            r.map_err(std::io::Error::other)
        }));
        let mut decoded: Box<dyn tokio::io::AsyncRead + Unpin + Send> = match coding {
            "gzip" => Box::new(async_compression::tokio::bufread::GzipDecoder::new(reader)),
            _ => Box::new(async_compression::tokio::bufread::ZstdDecoder::new(reader)),
        };
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        // The held target never answers before this: only streaming gets past it.
        let want = big_line(BIG_LINES / 2);
        tokio::time::timeout(Duration::from_secs(20), async {
            while !String::from_utf8_lossy(&out).contains(&want) {
                let n = decoded.read(&mut buf).await.unwrap();
                assert!(n > 0, "{coding}: ended before the held target answered");
                out.extend_from_slice(&buf[..n]);
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{coding}: only {} bytes decoded while the last target was held",
                out.len()
            )
        });
        assert!(out.len() > 1 << 20, "{coding}: {}", out.len());
        release.notify_one();
        tokio::time::timeout(Duration::from_secs(20), decoded.read_to_end(&mut out))
            .await
            .unwrap()
            .unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains(&big_line(BIG_LINES - 1)), "{coding}");
        assert!(text.contains("\napp_held 1\n"), "{coding}");
    }
}
