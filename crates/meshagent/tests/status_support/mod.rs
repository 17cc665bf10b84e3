//! The agent's status server, in-process on a free loopback port, serving the given views:
//! for tests whose subsystems (DNS proxy, Wasm converter) run in-process too.

use std::net::SocketAddr;

use meshagent::metrics::Registry;
use meshagent::status::{self, MergeMetrics, Merger, StatusState};
use tokio_util::sync::CancellationToken;

/// Serves `views` until the returned token is cancelled (or dropped with the runtime).
pub async fn serve_views(views: status::views::Views) -> (SocketAddr, CancellationToken) {
    let registry = Registry::new();
    let metrics = MergeMetrics::register(&registry).unwrap();
    let merger = Merger::new(registry.clone(), metrics, None, Vec::new());
    let state = StatusState {
        views,
        ..StatusState::new(registry, merger).unwrap()
    };

    let port = meshagent_testkit::free_port();
    let listener = status::bind(port).await.unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(status::serve(listener, state, stop.clone()));
    (SocketAddr::from(([127, 0, 0, 1], port)), stop)
}

/// `GET path` as JSON: (status, body).
pub async fn get_json(addr: SocketAddr, path: &str) -> (u16, serde_json::Value) {
    let (code, body) = meshagent_testkit::http_get(addr, path)
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let v = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("GET {path}: {code} not JSON ({e}): {body}"));
    (code, v)
}
