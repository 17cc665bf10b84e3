//! What every xDS client told devplane, for the debug endpoint: tests assert on what an agent
//! sent upstream (headers, node, subscriptions, ACKs) through it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use meshagent_proto::envoy::pb::envoy::config::core::v3::Node;
use meshagent_proto::envoy::pb::google::protobuf::{Struct, Value, value::Kind};
use serde::Serialize;

/// How many disconnected clients are remembered.
const HISTORY: usize = 64;

#[derive(Debug, Clone, Serialize, Default)]
pub struct ClientInfo {
    pub id: u64,
    /// `sotw` or `delta`.
    pub api: &'static str,
    /// `tls` or `plaintext`.
    pub transport: &'static str,
    pub peer: Option<String>,
    pub connected: bool,
    pub connected_at: f64,
    pub disconnected_at: Option<f64>,
    /// gRPC request metadata as received (ASCII values). `authorization` is replaced by a
    /// fingerprint: tokens are credentials and are never echoed back.
    pub headers: BTreeMap<String, String>,
    /// `spiffe://...` identity authenticated from the token or client certificate.
    pub identity: Option<String>,
    /// `sha256:<first 16 hex>` of the bearer token, when one was sent.
    pub token_fingerprint: Option<String>,
    pub node_id: Option<String>,
    pub node_cluster: Option<String>,
    pub node_metadata: serde_json::Value,
    pub subscriptions: BTreeMap<String, Subscription>,
    /// Last ACKed version per type (SotW `version_info`; Delta: `system_version_info` of the
    /// ACKed response).
    pub acked: BTreeMap<String, String>,
    pub nacks: BTreeMap<String, Nack>,
    /// The last response handed to the stream per type: its version (SotW `version_info`,
    /// Delta `system_version_info`) and when (Unix seconds), so a benchmark can split a push's
    /// time into devplane's part and the delivery.
    pub sent: BTreeMap<String, Sent>,
    pub requests: u64,
    pub responses: u64,
    pub stale_nonces: u64,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Subscription {
    pub wildcard: bool,
    pub names: BTreeSet<String>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Sent {
    pub version: String,
    pub unix_time: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Nack {
    pub nonce: String,
    pub version: String,
    pub message: String,
    pub count: u64,
}

#[derive(Default)]
struct Inner {
    live: BTreeMap<u64, ClientInfo>,
    gone: VecDeque<ClientInfo>,
    next_id: u64,
}

/// Shared registry; cheap to clone.
#[derive(Clone, Default)]
pub struct Clients(Arc<Mutex<Inner>>);

impl Clients {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock only loses debug data; keep serving.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn register(&self, mut info: ClientInfo) -> ClientHandle {
        let mut inner = self.lock();
        inner.next_id += 1;
        info.id = inner.next_id;
        info.connected = true;
        info.connected_at = now();
        let id = info.id;
        inner.live.insert(id, info);
        ClientHandle {
            id,
            clients: self.clone(),
        }
    }

    /// Live clients' progress only (no subscriptions or metadata): cheap enough to poll
    /// while a client applies a push of thousands of resources.
    pub fn acks(&self) -> serde_json::Value {
        let inner = self.lock();
        let live: Vec<_> = inner
            .live
            .values()
            .map(|c| {
                serde_json::json!({
                    "id": c.id,
                    "node_id": c.node_id,
                    "acked": c.acked,
                    "nacks": c.nacks,
                    "sent": c.sent,
                    "requests": c.requests,
                    "responses": c.responses,
                })
            })
            .collect();
        serde_json::json!({ "clients": live })
    }

    pub fn snapshot(&self) -> serde_json::Value {
        let inner = self.lock();
        serde_json::json!({
            "clients": inner.live.values().collect::<Vec<_>>(),
            "disconnected": inner.gone.iter().collect::<Vec<_>>(),
        })
    }
}

/// Updates one client's entry; moves it to history when dropped.
pub struct ClientHandle {
    id: u64,
    clients: Clients,
}

impl ClientHandle {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn update(&self, f: impl FnOnce(&mut ClientInfo)) {
        if let Some(c) = self.clients.lock().live.get_mut(&self.id) {
            f(c);
        }
    }
}

impl Drop for ClientHandle {
    fn drop(&mut self) {
        let mut inner = self.clients.lock();
        if let Some(mut c) = inner.live.remove(&self.id) {
            c.connected = false;
            c.disconnected_at = Some(now());
            inner.gone.push_back(c);
            while inner.gone.len() > HISTORY {
                inner.gone.pop_front();
            }
        }
    }
}

pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

pub fn record_node(c: &mut ClientInfo, node: &Node) {
    c.node_id = Some(node.id.clone());
    c.node_cluster = Some(node.cluster.clone());
    c.node_metadata = node
        .metadata
        .as_ref()
        .map(struct_to_json)
        .unwrap_or(serde_json::Value::Null);
}

pub fn struct_to_json(s: &Struct) -> serde_json::Value {
    serde_json::Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value_to_json(v)))
            .collect(),
    )
}

fn value_to_json(v: &Value) -> serde_json::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::NumberValue(n)) => serde_json::Number::from_f64(*n)
            .map(serde_json::Value::Number)
            .unwrap_or(serde_json::Value::Null),
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::StructValue(s)) => struct_to_json(s),
        Some(Kind::ListValue(l)) => {
            serde_json::Value::Array(l.values.iter().map(value_to_json).collect())
        }
    }
}

/// The string-valued node metadata keys, which identify the proxy.
pub fn string_metadata(node: &Node) -> BTreeMap<String, String> {
    node.metadata
        .iter()
        .flat_map(|s| s.fields.iter())
        .filter_map(|(k, v)| match &v.kind {
            Some(Kind::StringValue(s)) => Some((k.clone(), s.clone())),
            _ => None,
        })
        .collect()
}
