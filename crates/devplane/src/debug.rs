//! Debug HTTP endpoint (bind it to loopback): JSON views of what clients sent, for tests.
//!
//! * `GET /debug/clients`: every xDS client (live and recently disconnected), with
//!   `serving_since` (Unix seconds: when this devplane process started listening, so a
//!   benchmark can time reconnects relative to a restart)
//! * `GET /debug/acks`: live clients' ACKed versions and NACKs only (cheap to poll)
//! * `GET /debug/csr`: the last CSR calls, each with `unix_time` (Unix seconds of arrival)
//!   besides the RFC 3339 `time`
//! * `GET /debug/token?namespace=NS&serviceAccount=SA[&ttlSeconds=N]`: a token devplane accepts
//! * `POST /debug/resource?type=URL&name=NAME` (body: the serialized resource, any bytes):
//!   serve it to every client as resource NAME of type URL, in place of a generated one, and
//!   push. For tests of what an agent does with malformed or very large resources.
//! * `POST /debug/mesh` (body: a mesh file's YAML): replace the mesh, exactly as a change of
//!   the mesh file does but without the file poll's delay (benchmarks time pushes from here);
//!   answers `{"generation": N, "unix_time": T}`, T being when the mesh was published
//! * `GET /healthz`: 200 once serving

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use meshagent_proto::envoy::pb::google::protobuf::Any;
use meshagent_proto::type_url;
use serde::Deserialize;
use tokio::sync::watch;

use crate::MeshFeed;
use crate::ca::CsrLog;
use crate::clients::Clients;
use crate::generate::Resources;
use crate::mesh::Mesh;
use crate::token::TokenIssuer;

#[derive(Clone)]
pub struct DebugState {
    pub clients: Clients,
    pub csr_log: CsrLog,
    pub mesh: watch::Receiver<Arc<Mesh>>,
    pub mesh_feed: Arc<MeshFeed>,
    pub tokens: Arc<TokenIssuer>,
    pub overrides: watch::Sender<Arc<Resources>>,
    /// When the gRPC listener was bound.
    pub serving_since: SystemTime,
}

/// Largest resource accepted by `POST /debug/resource`.
const MAX_RESOURCE: usize = 256 * 1024 * 1024;

/// Types `POST /debug/resource` accepts (resource maps are keyed by static type URLs).
const OVERRIDABLE: [&str; 8] = [
    type_url::CLUSTER,
    type_url::ENDPOINT,
    type_url::LISTENER,
    type_url::ROUTE,
    type_url::NAME_TABLE,
    type_url::PROXY_CONFIG,
    type_url::EXTENSION_CONFIG,
    type_url::WORKLOAD,
];

pub fn router(state: DebugState) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/debug/clients",
            get(|State(s): State<DebugState>| async move {
                let mut v = s.clients.snapshot();
                v["serving_since"] = unix_secs(s.serving_since).into();
                Json(v)
            }),
        )
        .route(
            "/debug/acks",
            get(|State(s): State<DebugState>| async move { Json(s.clients.acks()) }),
        )
        .route(
            "/debug/csr",
            get(|State(s): State<DebugState>| async move { Json(csr_records(&s.csr_log)) }),
        )
        .route("/debug/token", get(token))
        .route("/debug/mesh", post(set_mesh))
        .route(
            "/debug/resource",
            post(set_resource).layer(DefaultBodyLimit::max(MAX_RESOURCE)),
        )
        .with_state(state)
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// The CSR log with each record's arrival also in Unix seconds (millisecond RFC 3339 is too
/// coarse to histogram a storm, and clients compare it with their own clock).
fn csr_records(log: &CsrLog) -> serde_json::Value {
    log.snapshot()
        .into_iter()
        .map(|r| {
            let mut v = serde_json::to_value(&r).unwrap_or_default();
            v["unix_time"] = unix_secs(r.time).into();
            v
        })
        .collect()
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

#[derive(Deserialize)]
struct ResourceQuery {
    r#type: String,
    name: String,
}

async fn set_resource(
    State(s): State<DebugState>,
    Query(q): Query<ResourceQuery>,
    body: Bytes,
) -> Result<String, (StatusCode, String)> {
    let t = OVERRIDABLE
        .iter()
        .find(|t| **t == q.r#type)
        .ok_or_else(|| {
            (
                StatusCode::BAD_REQUEST,
                format!("type must be one of {OVERRIDABLE:?}"),
            )
        })?;
    let len = body.len();
    s.overrides.send_modify(|o| {
        let mut next = (**o).clone();
        next.entry(t).or_default().insert(
            q.name.clone(),
            Any {
                type_url: q.r#type.clone(),
                value: body.to_vec(),
            },
        );
        *o = Arc::new(next);
    });
    tracing::info!(type_url = %q.r#type, name = %q.name, bytes = len, "debug resource set; pushing");
    Ok(format!("set {} {:?} ({len} bytes)\n", q.r#type, q.name))
}

/// The mesh file's contents, posted: parsed and validated as the file watch does, then
/// published through the same feed.
async fn set_mesh(
    State(s): State<DebugState>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, (StatusCode, String)> {
    let text = std::str::from_utf8(&body)
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("mesh is not UTF-8: {e}")))?;
    let mesh = Mesh::parse(std::path::Path::new("POST /debug/mesh"), text)
        .map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    let unix_time = unix_secs(SystemTime::now());
    let generation = s.mesh_feed.publish(mesh, "POST /debug/mesh");
    Ok(Json(
        serde_json::json!({ "generation": generation, "unix_time": unix_time }),
    ))
}
