//! Debug HTTP endpoint (bind it to loopback): JSON views of what clients sent, for tests.
//!
//! * `GET /debug/clients`: every xDS client (live and recently disconnected)
//! * `GET /debug/csr`: the last CSR calls
//! * `GET /debug/token?namespace=NS&serviceAccount=SA[&ttlSeconds=N]`: a token devplane accepts
//! * `GET /healthz`: 200 once serving

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use serde::Deserialize;
use tokio::sync::watch;

use crate::ca::CsrLog;
use crate::clients::Clients;
use crate::mesh::Mesh;
use crate::token::TokenIssuer;

#[derive(Clone)]
pub struct DebugState {
    pub clients: Clients,
    pub csr_log: CsrLog,
    pub mesh: watch::Receiver<Arc<Mesh>>,
    pub tokens: Arc<TokenIssuer>,
}

pub fn router(state: DebugState) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/debug/clients",
            get(|State(s): State<DebugState>| async move { Json(s.clients.snapshot()) }),
        )
        .route(
            "/debug/csr",
            get(|State(s): State<DebugState>| async move { Json(s.csr_log.snapshot()) }),
        )
        .route("/debug/token", get(token))
        .with_state(state)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TokenQuery {
    namespace: String,
    service_account: String,
    ttl_seconds: Option<u64>,
}

async fn token(
    State(s): State<DebugState>,
    Query(q): Query<TokenQuery>,
) -> Result<String, (StatusCode, String)> {
    let ttl = Duration::from_secs(q.ttl_seconds.unwrap_or(3600));
    s.tokens
        .issue(&q.namespace, &q.service_account, ttl)
        .map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))
}
