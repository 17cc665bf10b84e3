//! The agent-side view of `istioctl proxy-status` for `/debug/xdsz`: per stream pair and type
//! URL, what was sent to the client and how it answered.
//!
//! Istio's agent keeps nothing of the kind (`pkg/istio-agent/xds_proxy.go` forwards and
//! forgets; istiod's `/debug/syncz` has the server's side). The bookkeeping here runs where
//! the proxy already peeks at every message ([`super::wire::peek`]): a few counters and the
//! last version, nonce and NACK detail per type, each truncated to [`MAX_FIELD`] bytes and
//! written into strings that keep their capacity, so after a type's first message nothing is
//! allocated per message. One uncontended mutex per pair is taken per message; the status
//! server reads it only when `/debug/xdsz` is asked.

use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::SystemTime;

use serde_json::{Value, json};

use super::Api;
use super::wire;

/// Longest version, nonce, node id or error detail kept (bytes; longer ones are cut at a
/// character boundary).
pub const MAX_FIELD: usize = 256;
/// Most type URLs tracked per pair (a client asks for a handful; a hostile one cannot grow
/// the table).
pub const MAX_TYPES: usize = 16;

fn set_bounded(dst: &mut String, src: &str) {
    let mut end = src.len().min(MAX_FIELD);
    while !src.is_char_boundary(end) {
        end -= 1;
    }
    dst.clear();
    dst.push_str(&src[..end]);
}

/// One type URL on one pair.
#[derive(Debug, Default)]
pub struct TypeView {
    pub type_url: String,
    /// Responses from upstream of this type (forwarded or intercepted).
    pub responses: u64,
    pub bytes: u64,
    /// Resources in the last response.
    pub resources: usize,
    pub sent_version: String,
    pub sent_nonce: String,
    pub sent_at: Option<SystemTime>,
    /// Requests from the client carrying a nonce: ACKs and NACKs.
    pub acks: u64,
    pub nacks: u64,
    pub acked_nonce: String,
    pub acked_version: String,
    /// The error detail of the last NACK (from the client, or the agent's own when an
    /// interceptor rejected the response).
    pub nack_detail: String,
    pub nack_nonce: String,
    pub nack_at: Option<SystemTime>,
    /// Whether the last answer was a NACK.
    pub nacked: bool,
    /// Handled by an agent interceptor (NDS, PCDS, ECDS Wasm, health) rather than passed
    /// through untouched.
    pub intercepted: Option<&'static str>,
    pub agent_nacks: u64,
}

/// One downstream stream and its upstream stream.
#[derive(Debug)]
pub struct PairView {
    pub id: u64,
    pub api: Api,
    /// The downstream connection (pairs of one client share it).
    pub conn: u64,
    /// The client's node id, from its first request.
    pub node: String,
    pub started: SystemTime,
    pub upstream_connected: Option<SystemTime>,
    pub types: Vec<TypeView>,
}

impl PairView {
    fn entry(&mut self, type_url: &str) -> Option<&mut TypeView> {
        if type_url.is_empty() {
            return None;
        }
        if let Some(i) = self.types.iter().position(|t| t.type_url == type_url) {
            return self.types.get_mut(i);
        }
        if self.types.len() >= MAX_TYPES {
            return None;
        }
        let mut t = TypeView::default();
        set_bounded(&mut t.type_url, type_url);
        self.types.push(t);
        self.types.last_mut()
    }

    /// A request from the client: the node id once, ACK/NACK when it carries a nonce.
    pub fn on_request(&mut self, api: Api, msg: &[u8], p: &wire::Peek<'_>) {
        if self.node.is_empty()
            && let Some(id) = node_id(api, msg)
        {
            set_bounded(&mut self.node, id);
        }
        if p.nonce.is_empty() {
            return;
        }
        let Some(t) = self.entry(p.type_url) else {
            return;
        };
        if p.has_error {
            t.nacks += 1;
            t.nacked = true;
            t.nack_at = Some(SystemTime::now());
            set_bounded(&mut t.nack_nonce, p.nonce);
            let detail = error_message(api, msg).unwrap_or("");
            set_bounded(&mut t.nack_detail, detail);
        } else {
            t.acks += 1;
            t.nacked = false;
            set_bounded(&mut t.acked_nonce, p.nonce);
            set_bounded(&mut t.acked_version, p.version);
        }
    }

    /// A response from upstream on its way to the client (or to an interceptor).
    pub fn on_response(
        &mut self,
        len: usize,
        p: &wire::Peek<'_>,
        intercepted: Option<&'static str>,
    ) {
        let Some(t) = self.entry(p.type_url) else {
            return;
        };
        t.responses += 1;
        t.bytes += len as u64;
        t.resources = p.resources;
        t.intercepted = intercepted;
        t.sent_at = Some(SystemTime::now());
        set_bounded(&mut t.sent_version, p.version);
        set_bounded(&mut t.sent_nonce, p.nonce);
    }

    /// The agent NACKed an intercepted response itself.
    pub fn on_agent_nack(&mut self, type_url: &str, nonce: &str, error: &str) {
        let Some(t) = self.entry(type_url) else {
            return;
        };
        t.agent_nacks += 1;
        t.nacks += 1;
        t.nacked = true;
        t.nack_at = Some(SystemTime::now());
        set_bounded(&mut t.nack_nonce, nonce);
        set_bounded(&mut t.nack_detail, error);
    }

    fn to_json(&self) -> Value {
        let types: Vec<Value> = self
            .types
            .iter()
            .map(|t| {
                json!({
                    "typeUrl": t.type_url,
                    "responses": t.responses,
                    "bytes": t.bytes,
                    "resources": t.resources,
                    "sentVersion": t.sent_version,
                    "sentNonce": t.sent_nonce,
                    "sentAt": t.sent_at.map(crate::logging::format_time),
                    "state": match (t.nacked, t.acks + t.nacks) {
                        (true, _) => "NACK",
                        (false, 0) => "SENT",
                        _ if !t.sent_nonce.is_empty() && t.acked_nonce != t.sent_nonce => "PENDING",
                        _ => "ACK",
                    },
                    "acks": t.acks,
                    "nacks": t.nacks,
                    "ackedNonce": t.acked_nonce,
                    "ackedVersion": t.acked_version,
                    "nack": (!t.nack_detail.is_empty() || t.nack_at.is_some()).then(|| json!({
                        "nonce": t.nack_nonce,
                        "errorDetail": t.nack_detail,
                        "at": t.nack_at.map(crate::logging::format_time),
                        "byAgent": t.agent_nacks > 0,
                    })),
                    "intercepted": t.intercepted,
                })
            })
            .collect();
        json!({
            "id": self.id,
            "api": format!("{:?}", self.api),
            "connection": self.conn,
            "node": self.node,
            "started": crate::logging::format_time(self.started),
            "upstreamConnected": self.upstream_connected.map(crate::logging::format_time),
            "types": types,
        })
    }
}

/// The top-level `node.id` of a request (SotW: node=2, Delta: node=1; Node.id=1). Read only
/// until the pair knows its client.
fn node_id(api: Api, msg: &[u8]) -> Option<&str> {
    let node_field = match api {
        Api::Sotw => 2,
        Api::Delta => 1,
    };
    let node = nested(msg, node_field)?;
    let id = nested(node, 1)?;
    std::str::from_utf8(id).ok()
}

/// `error_detail.message` (google.rpc.Status message=2) of a NACK: SotW error_detail=6,
/// Delta error_detail=7. Decoded only when the peek saw an error.
pub(crate) fn error_message(api: Api, msg: &[u8]) -> Option<&str> {
    let field = match api {
        Api::Sotw => 6,
        Api::Delta => 7,
    };
    let status = nested(msg, field)?;
    std::str::from_utf8(nested(status, 2)?).ok()
}

fn nested(buf: &[u8], number: u32) -> Option<&[u8]> {
    let mut found = None;
    for f in wire::fields(buf) {
        match f {
            Ok((n, wire::Value::Bytes(b))) if n == number => found = Some(b),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    found
}

/// The upstream side, shared by all pairs.
#[derive(Debug, Default)]
struct Upstream {
    connected_at: Option<SystemTime>,
    disconnected_at: Option<SystemTime>,
    last_disconnect: String,
    connects: u64,
    disconnects: u64,
}

/// Every live pair and the upstream connection's history.
#[derive(Debug, Default)]
pub struct XdsView {
    pairs: Mutex<Vec<Weak<Mutex<PairView>>>>,
    upstream: Mutex<Upstream>,
    /// What the client rejects now, across pairs (readiness reads it).
    pub rejections: super::rejections::Rejections,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A pair's entry; dropped with the pair (the registry holds only a weak reference).
pub type PairHandle = Arc<Mutex<PairView>>;

impl XdsView {
    /// Registers a new pair (once per stream, not per message).
    pub fn register(&self, id: u64, api: Api, conn: u64) -> PairHandle {
        let h = Arc::new(Mutex::new(PairView {
            id,
            api,
            conn,
            node: String::new(),
            started: SystemTime::now(),
            upstream_connected: None,
            types: Vec::new(),
        }));
        let mut pairs = lock(&self.pairs);
        pairs.retain(|w| w.strong_count() > 0);
        pairs.push(Arc::downgrade(&h));
        h
    }

    pub fn pair(h: &PairHandle) -> MutexGuard<'_, PairView> {
        lock(h)
    }

    pub fn upstream_connected(&self, h: &PairHandle) {
        let now = SystemTime::now();
        lock(h).upstream_connected = Some(now);
        let mut u = lock(&self.upstream);
        u.connected_at = Some(now);
        u.connects += 1;
    }

    /// A pair ended on the upstream side (or could not connect), with the reason.
    pub fn upstream_ended(&self, reason: &str) {
        let mut u = lock(&self.upstream);
        u.disconnected_at = Some(SystemTime::now());
        u.disconnects += 1;
        set_bounded(&mut u.last_disconnect, reason);
    }

    /// The JSON of `/debug/xdsz`. `address` is the upstream target; `connections` its live
    /// connections now.
    pub fn to_json(&self, address: &str, connections: usize) -> Value {
        let pairs: Vec<PairHandle> = lock(&self.pairs).iter().filter_map(Weak::upgrade).collect();
        let mut clients: Vec<Value> = pairs.iter().map(|p| lock(p).to_json()).collect();
        clients.sort_by_key(|c| c["id"].as_u64());
        let u = lock(&self.upstream);
        json!({
            "upstream": {
                "address": address,
                "state": if connections > 0 { "CONNECTED" } else { "DISCONNECTED" },
                "connections": connections,
                "connectedAt": u.connected_at.map(crate::logging::format_time),
                "connects": u.connects,
                "disconnects": u.disconnects,
                "lastDisconnect": (!u.last_disconnect.is_empty()).then(|| json!({
                    "reason": u.last_disconnect,
                    "at": u.disconnected_at.map(crate::logging::format_time),
                })),
                // The agent does not retry on its own: each client reconnects with its own
                // backoff (Envoy's, grpc-go's) and every new stream dials at once, as Istio's
                // `xds_proxy.go` does.
                "backoff": "client-driven",
            },
            "clients": clients,
            "rejected": self.rejections.current().iter().map(|r| json!({
                "typeUrl": r.type_url,
                "errorDetail": r.message,
                "missingExtensions": r.missing.iter().map(|m| json!({
                    "name": m.name,
                    "typeUrl": m.type_url,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshagent_proto::envoy::pb::envoy::config::core::v3::Node;
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
        DiscoveryRequest, DiscoveryResponse,
    };
    use meshagent_proto::envoy::pb::google::rpc::Status;
    use prost::Message;

    #[test]
    fn ack_nack_and_node_are_recorded_bounded() {
        let v = XdsView::default();
        let h = v.register(1, Api::Sotw, 7);
        let resp = DiscoveryResponse {
            version_info: "v1".into(),
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            nonce: "n1".into(),
            resources: vec![Default::default(), Default::default()],
            ..Default::default()
        }
        .encode_to_vec();
        let p = wire::peek(wire::Kind::SotwResponse, &resp).unwrap();
        XdsView::pair(&h).on_response(resp.len(), &p, None);
        let long = "x".repeat(10_000);
        let nack = DiscoveryRequest {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            response_nonce: "n1".into(),
            node: Some(Node {
                id: "sidecar~1.2.3.4~a.b~b.svc.cluster.local".into(),
                ..Default::default()
            }),
            error_detail: Some(Status {
                code: 3,
                message: format!("bad cluster {long}"),
                details: vec![],
            }),
            ..Default::default()
        }
        .encode_to_vec();
        let p = wire::peek(wire::Kind::SotwRequest, &nack).unwrap();
        XdsView::pair(&h).on_request(Api::Sotw, &nack, &p);
        let j = v.to_json("istiod:15012", 1);
        let c = &j["clients"][0];
        assert_eq!(c["node"], "sidecar~1.2.3.4~a.b~b.svc.cluster.local");
        let t = &c["types"][0];
        assert_eq!(t["state"], "NACK");
        assert_eq!(t["resources"], 2);
        assert_eq!(t["sentVersion"], "v1");
        let detail = t["nack"]["errorDetail"].as_str().unwrap();
        assert!(detail.starts_with("bad cluster x"), "{detail}");
        assert_eq!(detail.len(), MAX_FIELD);
        // An ACK afterwards clears the NACK state.
        let ack = DiscoveryRequest {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            response_nonce: "n1".into(),
            version_info: "v1".into(),
            ..Default::default()
        }
        .encode_to_vec();
        let p = wire::peek(wire::Kind::SotwRequest, &ack).unwrap();
        XdsView::pair(&h).on_request(Api::Sotw, &ack, &p);
        let j = v.to_json("istiod:15012", 1);
        assert_eq!(j["clients"][0]["types"][0]["state"], "ACK");
        drop(h);
        assert_eq!(v.to_json("x", 0)["clients"].as_array().unwrap().len(), 0);
    }
}
