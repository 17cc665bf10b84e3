//! `envoy.service.secret.v3.SecretDiscoveryService` over the [`SecretStore`].
//!
//! SotW follows Istio (`security/pkg/nodeagent/sds/sdsservice.go`): NACK → log and hold (never answer, so no loop, istio#21111);
//! stale nonce → ignore; empty names → unsubscribe; ACK with unchanged names → nothing; new
//! names → only those; a change pushes only the changed name to streams watching it; requests
//! that arrive before a secret exists are held and answered when it appears (istio#22443); a
//! secret that cannot be produced ends the stream with "failed to generate secret for X" so
//! Envoy reconnects with its own backoff. Delta works the same way, keyed by subscriptions.
//!
//! Each stream is one task that owns its state and selects over Envoy's requests and the
//! store's change signal.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use futures::Stream;
use meshagent_proto::envoy::pb::envoy::config::core::v3::{DataSource, data_source::Specifier};
use meshagent_proto::envoy::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, Secret, TlsCertificate, secret,
};
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use meshagent_proto::envoy::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryService;
use meshagent_proto::envoy::util::pack_any;
use meshagent_proto::type_url;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::xds::reader::{MessageReader, TakenBody};

use crate::identity::store::{SecretData, SecretState, SecretStore, Subscription};

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[derive(Debug, Clone)]
pub struct SdsService {
    store: Arc<SecretStore>,
    counter: Arc<AtomicU64>,
    /// Ends every stream, so the server's graceful shutdown does not wait for Envoy.
    shutdown: CancellationToken,
}

impl SdsService {
    pub fn new(store: Arc<SecretStore>, shutdown: CancellationToken) -> SdsService {
        SdsService {
            store,
            counter: Arc::default(),
            shutdown,
        }
    }

    /// `<RFC3339 now>/<counter>`, as Istio.
    fn version(&self) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed) + 1;
        format!("{}/{n}", rfc3339(SystemTime::now()))
    }
}

fn inline(bytes: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(Specifier::InlineBytes(bytes.as_bytes().to_vec())),
        ..Default::default()
    })
}

/// The Envoy `Secret` for `name` from its data.
pub fn to_secret(name: &str, data: &SecretData) -> Secret {
    let r#type = match data {
        SecretData::Cert { chain, key } => secret::Type::TlsCertificate(TlsCertificate {
            certificate_chain: inline(chain),
            private_key: inline(key),
            ..Default::default()
        }),
        SecretData::Root { pem, crl } => {
            secret::Type::ValidationContext(CertificateValidationContext {
                trusted_ca: inline(pem),
                crl: crl.as_ref().map(|p| DataSource {
                    specifier: Some(Specifier::Filename(p.display().to_string())),
                    ..Default::default()
                }),
                ..Default::default()
            })
        }
    };
    Secret {
        name: name.to_owned(),
        r#type: Some(r#type),
    }
}

fn nonce() -> String {
    let a: u64 = rand::random();
    let b: u64 = rand::random();
    format!("{a:016x}{b:016x}")
}

/// What a stream does with the names it must (re)send.
enum Collected {
    Resources(Vec<(String, Arc<SecretData>, u64)>),
    Failed(Status),
}

/// Ready secrets among `names` whose generation differs from what was sent; a failed one ends
/// the stream.
fn collect(
    store: &SecretStore,
    names: impl IntoIterator<Item = String>,
    sent: &HashMap<String, Option<u64>>,
) -> Collected {
    let mut out = Vec::new();
    for name in names {
        let (state, generation) = store.get(&name);
        match state {
            SecretState::Ready(data) => {
                if sent.get(&name).copied().flatten() != Some(generation) {
                    out.push((name, data, generation));
                }
            }
            SecretState::Pending => {}
            SecretState::Failed(e) => {
                return Collected::Failed(Status::unavailable(format!(
                    "failed to generate secret for {name}: {e}"
                )));
            }
        }
    }
    Collected::Resources(out)
}

/// The requests of one SDS stream. The agent's server takes each request body out of tonic's
/// way (`xds::reader::TakeRequestBody`, in `sds::serve`): tonic's stream buffer grows to
/// Envoy's first request, which carries its node with the extension list (~70 KiB), and keeps
/// that capacity for the stream's life; [`MessageReader`] gives each request a buffer of its
/// own length instead. A request without the taken body (the service mounted elsewhere) is
/// read through tonic's `Streaming`.
enum Inbound<T> {
    Tonic(Streaming<T>),
    Own(MessageReader),
}

impl<T: prost::Message + Default> Inbound<T> {
    fn of(request: Request<Streaming<T>>) -> Inbound<T> {
        match request
            .extensions()
            .get::<TakenBody>()
            .and_then(TakenBody::take)
        {
            Some(body) => Inbound::Own(MessageReader::request(body, MAX_REQUEST_BYTES)),
            None => Inbound::Tonic(request.into_inner()),
        }
    }

    async fn message(&mut self) -> Result<Option<T>, Status> {
        match self {
            Inbound::Tonic(s) => s.message().await,
            Inbound::Own(r) => match r.message().await? {
                // tonic's prost decoder's status for a message that does not decode.
                Some(m) => T::decode(m)
                    .map(Some)
                    .map_err(|e| Status::internal(e.to_string())),
                None => Ok(None),
            },
        }
    }
}

/// The largest SDS request read: tonic's default server limit, which the service had before
/// (and gRPC-Go's, behind Istio's SDS server).
const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

// === impl SdsService (SotW) ===

impl SdsService {
    async fn run_sotw(
        self,
        mut inbound: Inbound<DiscoveryRequest>,
        tx: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    ) {
        let store = self.store.clone();
        let mut changes = store.changes();
        // name → generation last sent (None: watched, not sent yet)
        let mut sent: HashMap<String, Option<u64>> = HashMap::new();
        // What this stream keeps alive in the store (dropped with the stream).
        let mut subs: HashMap<String, Subscription> = HashMap::new();
        let mut last_nonce: Option<String> = None;
        let mut peer = String::new();
        loop {
            let to_send: Vec<String> = tokio::select! {
                _ = self.shutdown.cancelled() => return,
                msg = inbound.message() => {
                    let req = match msg {
                        Ok(Some(r)) => r,
                        Ok(None) => return,
                        Err(e) => {
                            tracing::debug!(error = %e, "SDS stream ended");
                            return;
                        }
                    };
                    if let Some(n) = &req.node {
                        peer = n.id.clone();
                    }
                    if let Some(err) = &req.error_detail {
                        // Hold: answering a NACK with the same content is how loops start.
                        tracing::warn!(node = %peer, names = %crate::logging::list(&req.resource_names), nonce = %req.response_nonce, error = %err.message, "SDS NACK; holding");
                        continue;
                    }
                    if !req.response_nonce.is_empty() && last_nonce.as_deref() != Some(req.response_nonce.as_str()) {
                        tracing::debug!(nonce = %req.response_nonce, "stale SDS nonce; ignoring");
                        continue;
                    }
                    let names: HashSet<String> = req.resource_names.iter().cloned().collect();
                    sent.retain(|n, _| names.contains(n));
                    subs.retain(|n, _| names.contains(n));
                    if names.is_empty() {
                        continue;
                    }
                    let initial = req.response_nonce.is_empty();
                    let mut added = Vec::new();
                    for n in names {
                        if initial || !sent.contains_key(&n) {
                            subs.entry(n.clone()).or_insert_with(|| store.subscribe(&n));
                            sent.insert(n.clone(), None);
                            added.push(n);
                        }
                    }
                    added
                }
                r = changes.changed() => {
                    if r.is_err() {
                        return;
                    }
                    sent.keys().cloned().collect()
                }
            };
            if to_send.is_empty() {
                continue;
            }
            let resources = match collect(&store, to_send, &sent) {
                Collected::Resources(r) => r,
                Collected::Failed(status) => {
                    tracing::warn!(node = %peer, error = %status.message(), "SDS: cannot serve secret; closing stream");
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            };
            // One response per resource: pushes carry only what changed, as Istio's.
            for (name, data, generation) in resources {
                let n = nonce();
                let resp = DiscoveryResponse {
                    version_info: self.version(),
                    resources: vec![pack_any(to_secret(&name, &data))],
                    type_url: type_url::SECRET.to_owned(),
                    nonce: n.clone(),
                    ..Default::default()
                };
                tracing::debug!(node = %peer, resource = %name, "SDS push");
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
                last_nonce = Some(n);
                sent.insert(name, Some(generation));
            }
        }
    }

    async fn run_delta(
        self,
        mut inbound: Inbound<DeltaDiscoveryRequest>,
        tx: mpsc::Sender<Result<DeltaDiscoveryResponse, Status>>,
    ) {
        let store = self.store.clone();
        let mut changes = store.changes();
        let mut sent: HashMap<String, Option<u64>> = HashMap::new();
        let mut subs: HashMap<String, Subscription> = HashMap::new();
        loop {
            let to_send: Vec<String> = tokio::select! {
                _ = self.shutdown.cancelled() => return,
                msg = inbound.message() => {
                    let req = match msg {
                        Ok(Some(r)) => r,
                        _ => return,
                    };
                    if let Some(err) = &req.error_detail {
                        tracing::warn!(nonce = %req.response_nonce, error = %err.message, "SDS delta NACK; holding");
                        continue;
                    }
                    for n in &req.resource_names_unsubscribe {
                        sent.remove(n);
                        subs.remove(n);
                    }
                    let mut added = Vec::new();
                    for n in req.resource_names_subscribe {
                        if !sent.contains_key(&n) {
                            subs.insert(n.clone(), store.subscribe(&n));
                            sent.insert(n.clone(), None);
                            added.push(n);
                        }
                    }
                    added
                }
                r = changes.changed() => {
                    if r.is_err() {
                        return;
                    }
                    sent.keys().cloned().collect()
                }
            };
            if to_send.is_empty() {
                continue;
            }
            let resources = match collect(&store, to_send, &sent) {
                Collected::Resources(r) => r,
                Collected::Failed(status) => {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            };
            if resources.is_empty() {
                continue;
            }
            let version = self.version();
            let mut out = Vec::new();
            for (name, data, generation) in resources {
                out.push(Resource {
                    name: name.clone(),
                    version: generation.to_string(),
                    resource: Some(pack_any(to_secret(&name, &data))),
                    ..Default::default()
                });
                sent.insert(name, Some(generation));
            }
            let resp = DeltaDiscoveryResponse {
                system_version_info: version,
                resources: out,
                type_url: type_url::SECRET.to_owned(),
                nonce: nonce(),
                ..Default::default()
            };
            if tx.send(Ok(resp)).await.is_err() {
                return;
            }
        }
    }
}

#[tonic::async_trait]
impl SecretDiscoveryService for SdsService {
    type StreamSecretsStream = ResponseStream<DiscoveryResponse>;
    type DeltaSecretsStream = ResponseStream<DeltaDiscoveryResponse>;

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(tracing::Instrument::instrument(
            self.clone().run_sotw(Inbound::of(request), tx),
            tracing::info_span!("sds_stream", api = "sotw"),
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn delta_secrets(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(tracing::Instrument::instrument(
            self.clone().run_delta(Inbound::of(request), tx),
            tracing::info_span!("sds_stream", api = "delta"),
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn fetch_secrets(
        &self,
        _request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(Status::unimplemented(
            "FetchSecrets is not supported (as Istio)",
        ))
    }
}

/// RFC 3339 UTC with seconds.
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86400).unwrap_or(0);
    let rem = secs % 86400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_format() {
        assert_eq!(rfc3339(SystemTime::UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_796_000_000);
        assert_eq!(rfc3339(t), "2026-11-30T00:53:20Z");
    }
}
