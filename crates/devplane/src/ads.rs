//! ADS server: SotW `StreamAggregatedResources` and Delta `DeltaAggregatedResources`, with
//! istiod's wire behaviour: versions and nonces per type, ACK/NACK tracking (a NACK is recorded
//! and never answered), stale nonces ignored, and pushes whenever the mesh changes the
//! resources a client subscribes to.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use meshagent_proto::envoy::pb::envoy::config::core::v3::Node;
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
    aggregated_discovery_service_server::AggregatedDiscoveryService,
};
use meshagent_proto::envoy::pb::google::protobuf::Any;
use meshagent_proto::type_url;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::Auth;
use crate::clients::{self, ClientHandle, ClientInfo, Clients, Nack, Subscription};
use crate::conn::ConnInfo;
use crate::generate::{self, Resources};
use crate::mesh::{Mesh, ProxyIdentity};

/// Outgoing responses buffered per stream before the stream task waits on the client.
const STREAM_BUFFER: usize = 8;

/// Types whose empty subscription means "everything" (wildcard), as in the xDS protocol.
fn wildcard_type(t: &str) -> bool {
    matches!(
        t,
        type_url::CLUSTER | type_url::LISTENER | type_url::NAME_TABLE | type_url::PROXY_CONFIG
    ) || t == type_url::WORKLOAD
}

#[derive(Clone)]
pub struct AdsService {
    inner: Arc<Inner>,
}

struct Inner {
    mesh: watch::Receiver<Arc<Mesh>>,
    /// Resources set through `POST /debug/resource`, laid over the generated ones.
    overrides: watch::Receiver<Arc<Resources>>,
    clients: Clients,
    auth: Auth,
    /// Whether this port requires an authenticated caller (istiod's 15012 does, 15010 not).
    require_auth: bool,
    nonces: AtomicU64,
}

impl AdsService {
    pub fn new(
        mesh: watch::Receiver<Arc<Mesh>>,
        overrides: watch::Receiver<Arc<Resources>>,
        clients: Clients,
        auth: Auth,
        require_auth: bool,
    ) -> AdsService {
        AdsService {
            inner: Arc::new(Inner {
                mesh,
                overrides,
                clients,
                auth,
                require_auth,
                nonces: AtomicU64::new(0),
            }),
        }
    }

    fn admit<T>(&self, req: &Request<T>, api: &'static str) -> Result<ClientHandle, Status> {
        let conn = req.extensions().get::<ConnInfo>();
        let authn = self
            .inner
            .auth
            .authenticate(req.metadata(), conn, self.inner.require_auth)?;
        let headers = req
            .metadata()
            .iter()
            .filter_map(|kv| match kv {
                tonic::metadata::KeyAndValueRef::Ascii(k, v) => {
                    let v = if k.as_str() == "authorization" {
                        authn.token_fingerprint.clone().unwrap_or_default()
                    } else {
                        v.to_str().unwrap_or("<non-ascii>").to_owned()
                    };
                    Some((k.as_str().to_owned(), v))
                }
                tonic::metadata::KeyAndValueRef::Binary(..) => None,
            })
            .collect();
        Ok(self.inner.clients.register(ClientInfo {
            api,
            transport: if conn.is_some_and(|c| c.tls) {
                "tls"
            } else {
                "plaintext"
            },
            peer: conn.and_then(|c| c.remote_addr).map(|a| a.to_string()),
            headers,
            identity: authn.identity,
            token_fingerprint: authn.token_fingerprint,
            ..Default::default()
        }))
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for AdsService {
    type StreamAggregatedResourcesStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let client = self.admit(&request, "sotw")?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let stream = Stream::new(self.inner.clone(), client);
        tokio::spawn(stream.run_sotw(request.into_inner(), tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let client = self.admit(&request, "delta")?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let stream = Stream::new(self.inner.clone(), client);
        tokio::spawn(stream.run_delta(request.into_inner(), tx));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Per-type SotW state.
#[derive(Default)]
struct SotwType {
    sub: Subscription,
    sent_version: Option<String>,
    sent_nonce: String,
}

/// Per-type Delta state.
#[derive(Default)]
struct DeltaType {
    sub: Subscription,
    /// Resource versions the client holds, as far as devplane knows.
    known: BTreeMap<String, String>,
    /// Nonce → system version of responses not yet ACKed.
    pending: HashMap<String, String>,
}

/// One client stream; owned by its task.
struct Stream {
    inner: Arc<Inner>,
    client: ClientHandle,
    mesh: watch::Receiver<Arc<Mesh>>,
    overrides: watch::Receiver<Arc<Resources>>,
    proxy: Option<ProxyIdentity>,
    resources: Resources,
}

/// Largest request devplane accepts, as istiod: its gRPC server takes `MaxRecvMsgSize` from
/// `ISTIO_GPRC_MAXRECVMSGSIZE` (default 4 MiB; Istio `pkg/features`, applied by
/// `pkg/istio-agent/grpcxds`'s and istiod's shared `istiogrpc.ServerOptions`).
pub const MAX_RECV_MESSAGE: usize = 4 * 1024 * 1024;

/// The status istiod's client sees for a failed receive, or `None` when the client went away
/// (nobody to tell). tonic reports an oversized message as `OutOfRange`; grpc-go, and so
/// istiod, as `ResourceExhausted` "grpc: received message larger than max (N vs. M)".
fn receive_error(s: Status) -> Option<Status> {
    if s.code() == tonic::Code::OutOfRange
        && let Some(rest) = s
            .message()
            .strip_prefix("Error, decoded message length too large: found ")
    {
        let found = rest.split(' ').next().unwrap_or("?");
        return Some(Status::resource_exhausted(format!(
            "grpc: received message larger than max ({found} vs. {MAX_RECV_MESSAGE})"
        )));
    }
    match s.code() {
        tonic::Code::Cancelled | tonic::Code::Unknown => None,
        _ => Some(s),
    }
}

enum Event<R> {
    Request(R),
    MeshChanged,
    Closed(Option<Status>),
}

impl Stream {
    fn new(inner: Arc<Inner>, client: ClientHandle) -> Stream {
        let mesh = inner.mesh.clone();
        let overrides = inner.overrides.clone();
        Stream {
            inner,
            client,
            mesh,
            overrides,
            proxy: None,
            resources: Resources::new(),
        }
    }

    fn nonce(&self) -> String {
        let n = self.inner.nonces.fetch_add(1, Ordering::Relaxed);
        format!("{:x}-{n}", rand::random::<u32>())
    }

    /// Records the node from the first request and generates the proxy's resources.
    fn on_node(&mut self, node: Option<&Node>) -> Result<(), Status> {
        if self.proxy.is_some() {
            return Ok(());
        }
        let node = node.ok_or_else(|| Status::invalid_argument("first request must carry node"))?;
        let proxy = ProxyIdentity::from_node(&node.id, &clients::string_metadata(node));
        self.client.update(|c| clients::record_node(c, node));
        tracing::info!(client = self.client.id(), node = %node.id, "client connected");
        self.resources = generate::generate(&self.mesh.borrow(), &proxy);
        self.apply_overrides();
        self.proxy = Some(proxy);
        Ok(())
    }

    fn regenerate(&mut self) {
        if let Some(p) = &self.proxy {
            self.resources = generate::generate(&self.mesh.borrow_and_update(), p);
            self.apply_overrides();
        } else {
            self.mesh.borrow_and_update();
            self.overrides.borrow_and_update();
        }
    }

    fn apply_overrides(&mut self) {
        let o = self.overrides.borrow_and_update().clone();
        for (t, by_name) in o.iter() {
            let m = self.resources.entry(t).or_default();
            for (name, any) in by_name {
                m.insert(name.clone(), any.clone());
            }
        }
    }

    /// Resources of `type_url` within `sub`, by name.
    fn select(&self, type_url: &str, sub: &Subscription) -> BTreeMap<String, Any> {
        let Some(all) = self.resources.get(type_url) else {
            return BTreeMap::new();
        };
        all.iter()
            .filter(|(name, _)| sub.wildcard || sub.names.contains(*name))
            .map(|(n, a)| (n.clone(), a.clone()))
            .collect()
    }

    async fn next_event<R>(&mut self, reqs: &mut Streaming<R>) -> Event<R> {
        tokio::select! {
            r = reqs.message() => match r {
                Ok(Some(r)) => Event::Request(r),
                Ok(None) => Event::Closed(None),
                Err(s) => Event::Closed(Some(s)),
            },
            changed = self.mesh.changed() => match changed {
                Ok(()) => Event::MeshChanged,
                Err(_) => Event::Closed(None),
            },
            changed = self.overrides.changed() => match changed {
                Ok(()) => Event::MeshChanged,
                Err(_) => Event::Closed(None),
            },
        }
    }

    // === SotW ===

    async fn run_sotw(
        mut self,
        mut reqs: Streaming<DiscoveryRequest>,
        tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    ) {
        let mut types: BTreeMap<String, SotwType> = BTreeMap::new();
        loop {
            let out = match self.next_event(&mut reqs).await {
                Event::Request(req) => match self.on_sotw_request(&mut types, req) {
                    Ok(out) => out,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                },
                Event::MeshChanged => {
                    self.regenerate();
                    let names: Vec<String> = types.keys().cloned().collect();
                    names
                        .into_iter()
                        .filter_map(|t| self.sotw_response(&mut types, &t, false))
                        .collect()
                }
                Event::Closed(status) => {
                    tracing::info!(client = self.client.id(), ?status, "client disconnected");
                    // istiod returns a receive error to the client as the stream's status
                    // (`pilot/pkg/xds/ads.go` `Stream`), e.g. an oversized request.
                    if let Some(s) = status.and_then(receive_error) {
                        let _ = tx.send(Err(s)).await;
                    }
                    return;
                }
            };
            for resp in out {
                let sent = (resp.type_url.clone(), resp.version_info.clone());
                // Counted before the send (which waits while the client reads slowly), so
                // a test sees what devplane tried to send; timed once handed over.
                self.client.update(|c| c.responses += 1);
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
                self.client.update(|c| record_sent(c, sent));
            }
        }
    }

    fn on_sotw_request(
        &mut self,
        types: &mut BTreeMap<String, SotwType>,
        req: DiscoveryRequest,
    ) -> Result<Vec<DiscoveryResponse>, Status> {
        self.on_node(req.node.as_ref())?;
        let t = req.type_url.clone();
        self.client.update(|c| c.requests += 1);
        let state = types.entry(t.clone()).or_default();
        if !req.response_nonce.is_empty() && req.response_nonce != state.sent_nonce {
            // Stale: the client answers an older response; istiod ignores these.
            self.client.update(|c| c.stale_nonces += 1);
            return Ok(vec![]);
        }
        if let Some(err) = &req.error_detail {
            tracing::warn!(client = self.client.id(), type_url = %t, message = %err.message, "NACK");
            self.client.update(|c| {
                let count = c.nacks.get(&t).map_or(0, |n| n.count) + 1;
                c.nacks.insert(
                    t.clone(),
                    Nack {
                        nonce: req.response_nonce.clone(),
                        version: req.version_info.clone(),
                        message: err.message.clone(),
                        count,
                    },
                );
            });
            return Ok(vec![]);
        }
        let sub = Subscription {
            wildcard: (wildcard_type(&t) && req.resource_names.is_empty())
                || req.resource_names.iter().any(|n| n == "*"),
            names: req
                .resource_names
                .iter()
                .filter(|n| *n != "*")
                .cloned()
                .collect(),
        };
        let is_ack = !req.response_nonce.is_empty();
        if is_ack {
            let v = req.version_info.clone();
            self.client.update(|c| {
                c.acked.insert(t.clone(), v);
            });
        }
        let changed_sub = state.sub.wildcard != sub.wildcard || state.sub.names != sub.names;
        state.sub = sub.clone();
        self.client.update(|c| {
            c.subscriptions.insert(t.clone(), sub);
        });
        if is_ack && !changed_sub {
            return Ok(vec![]);
        }
        Ok(self.sotw_response(types, &t, true).into_iter().collect())
    }

    /// Builds a response for `t` if it differs from what was last sent (or `force`).
    fn sotw_response(
        &self,
        types: &mut BTreeMap<String, SotwType>,
        t: &str,
        force: bool,
    ) -> Option<DiscoveryResponse> {
        let state = types.get_mut(t)?;
        let selected = self.select(t, &state.sub);
        let version = set_version(&selected);
        if !force && state.sent_version.as_deref() == Some(version.as_str()) {
            return None;
        }
        let nonce = self.nonce();
        state.sent_version = Some(version.clone());
        state.sent_nonce = nonce.clone();
        Some(DiscoveryResponse {
            version_info: version,
            resources: selected.into_values().collect(),
            type_url: t.to_owned(),
            nonce,
            ..Default::default()
        })
    }

    // === Delta ===

    async fn run_delta(
        mut self,
        mut reqs: Streaming<DeltaDiscoveryRequest>,
        tx: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
    ) {
        let mut types: BTreeMap<String, DeltaType> = BTreeMap::new();
        loop {
            let out = match self.next_event(&mut reqs).await {
                Event::Request(req) => match self.on_delta_request(&mut types, req) {
                    Ok(out) => out,
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                },
                Event::MeshChanged => {
                    self.regenerate();
                    let names: Vec<String> = types.keys().cloned().collect();
                    names
                        .into_iter()
                        .filter_map(|t| self.delta_response(&mut types, &t, false))
                        .collect()
                }
                Event::Closed(status) => {
                    tracing::info!(client = self.client.id(), ?status, "client disconnected");
                    // istiod returns a receive error to the client as the stream's status
                    // (`pilot/pkg/xds/ads.go` `Stream`), e.g. an oversized request.
                    if let Some(s) = status.and_then(receive_error) {
                        let _ = tx.send(Err(s)).await;
                    }
                    return;
                }
            };
            for resp in out {
                let sent = (resp.type_url.clone(), resp.system_version_info.clone());
                // Counted before the send (which waits while the client reads slowly), so
                // a test sees what devplane tried to send; timed once handed over.
                self.client.update(|c| c.responses += 1);
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
                self.client.update(|c| record_sent(c, sent));
            }
        }
    }

    fn on_delta_request(
        &mut self,
        types: &mut BTreeMap<String, DeltaType>,
        req: DeltaDiscoveryRequest,
    ) -> Result<Vec<DeltaDiscoveryResponse>, Status> {
        self.on_node(req.node.as_ref())?;
        let t = req.type_url.clone();
        self.client.update(|c| c.requests += 1);
        let first = !types.contains_key(&t);
        let state = types.entry(t.clone()).or_default();
        if first {
            state.known = req
                .initial_resource_versions
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            // Legacy wildcard: the first request of a wildcard type with no names.
            state.sub.wildcard = wildcard_type(&t) && req.resource_names_subscribe.is_empty();
        }
        if !req.response_nonce.is_empty() {
            let version = state.pending.remove(&req.response_nonce);
            if let Some(err) = &req.error_detail {
                tracing::warn!(client = self.client.id(), type_url = %t, message = %err.message, "NACK");
                self.client.update(|c| {
                    let count = c.nacks.get(&t).map_or(0, |n| n.count) + 1;
                    c.nacks.insert(
                        t.clone(),
                        Nack {
                            nonce: req.response_nonce.clone(),
                            version: version.clone().unwrap_or_default(),
                            message: err.message.clone(),
                            count,
                        },
                    );
                });
            } else if let Some(v) = version {
                self.client.update(|c| {
                    c.acked.insert(t.clone(), v);
                });
            } else {
                self.client.update(|c| c.stale_nonces += 1);
            }
        }
        for n in &req.resource_names_subscribe {
            if n == "*" {
                state.sub.wildcard = true;
            } else {
                state.sub.names.insert(n.clone());
            }
        }
        for n in &req.resource_names_unsubscribe {
            if n == "*" {
                state.sub.wildcard = false;
            } else {
                state.sub.names.remove(n);
                // The client drops what it unsubscribed from.
                state.known.remove(n);
            }
        }
        let sub = state.sub.clone();
        self.client.update(|c| {
            c.subscriptions.insert(t.clone(), sub);
        });
        if req.error_detail.is_some() {
            return Ok(vec![]);
        }
        Ok(self.delta_response(types, &t, first).into_iter().collect())
    }

    /// Sends what changed relative to what the client holds; `force` answers even when
    /// nothing changed (a client's first request of a type waits for an answer).
    fn delta_response(
        &self,
        types: &mut BTreeMap<String, DeltaType>,
        t: &str,
        force: bool,
    ) -> Option<DeltaDiscoveryResponse> {
        let state = types.get_mut(t)?;
        let selected = self.select(t, &state.sub);
        let mut resources = Vec::new();
        for (name, any) in &selected {
            let v = resource_version(any);
            if state.known.get(name) != Some(&v) {
                resources.push(Resource {
                    name: name.clone(),
                    version: v,
                    resource: Some(any.clone()),
                    ..Default::default()
                });
            }
        }
        let removed: Vec<String> = state
            .known
            .keys()
            .filter(|n| !selected.contains_key(*n))
            .cloned()
            .collect();
        if resources.is_empty() && removed.is_empty() && !force {
            return None;
        }
        for r in &resources {
            state.known.insert(r.name.clone(), r.version.clone());
        }
        for n in &removed {
            state.known.remove(n);
        }
        let nonce = self.nonce();
        let system_version = set_version(&selected);
        state.pending.insert(nonce.clone(), system_version.clone());
        Some(DeltaDiscoveryResponse {
            system_version_info: system_version,
            resources,
            type_url: t.to_owned(),
            removed_resources: removed,
            nonce,
            ..Default::default()
        })
    }
}

/// Remembers the version and time of a response handed to the stream, per type.
fn record_sent(c: &mut ClientInfo, (type_url, version): (String, String)) {
    c.sent.insert(
        type_url,
        clients::Sent {
            version,
            unix_time: clients::now(),
        },
    );
}

/// Stable content hash, so versions survive a devplane restart (Envoy resends them in
/// `initial_resource_versions`).
fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn resource_version(any: &Any) -> String {
    format!(
        "{:016x}",
        fnv1a(&any.value, fnv1a(any.type_url.as_bytes(), FNV_OFFSET))
    )
}

fn set_version(set: &BTreeMap<String, Any>) -> String {
    let mut h = FNV_OFFSET;
    for (name, any) in set {
        h = fnv1a(name.as_bytes(), h);
        h = fnv1a(&any.value, h);
    }
    format!("{h:016x}")
}
