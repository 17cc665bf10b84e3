//! The one extension point of the xDS proxy: per-type interceptors.
//!
//! Istio intercepts only where it must (NDS, PCDS, ECDS/Wasm, agent-originated health), and
//! field experience says to keep it that way (PR #27884: a "smart" proxy lets Envoy and the
//! control plane fall out of sync). So an [`Interceptor`] is consulted only for responses of
//! its own type URL and for the moment Envoy sends its first LDS request; every other message
//! passes through as bytes.
//!
//! Interceptors are **asynchronous**: [`Interceptor::on_response`] returns a future, and the
//! stream task keeps forwarding other types and reading Envoy's requests while it is pending
//! (a Wasm download must not hold back a CDS push: Istio converts ECDS in its own goroutine,
//! `pkg/istio-agent/xds_proxy.go` `handleUpstreamResponse`). Responses of one type are handed
//! on in the order they arrived, whatever order their futures finish in (`xds/stream.rs`).

use std::sync::Arc;

use crate::dns::{LookupTable, Scope};
use bytes::Bytes;
use futures::future::BoxFuture;
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use meshagent_proto::envoy::pb::google::protobuf::Any;
use meshagent_proto::envoy::pb::google::rpc::Status;
use meshagent_proto::type_url;
use prost::Message;
use tokio::sync::watch;

use super::wire;

/// gRPC code `Internal`, which Istio puts in NACKs and unhealthy reports.
const CODE_INTERNAL: i32 = 13;

/// Which ADS flavour a stream speaks (upstream always matches downstream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Sotw,
    Delta,
}

impl Api {
    pub fn response_kind(self) -> wire::Kind {
        match self {
            Api::Sotw => wire::Kind::SotwResponse,
            Api::Delta => wire::Kind::DeltaResponse,
        }
    }

    pub fn request_kind(self) -> wire::Kind {
        match self {
            Api::Sotw => wire::Kind::SotwRequest,
            Api::Delta => wire::Kind::DeltaRequest,
        }
    }
}

/// What to do with an intercepted response.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Send these bytes to Envoy (the original, or a rewrite).
    Forward(Bytes),
    /// The agent consumed it; send this request upstream if any (an ACK or a NACK).
    Consume(Option<Bytes>),
}

/// Why an interceptor refused a response: the stream NACKs it upstream with this message
/// (gRPC `Internal`, as Istio) and Envoy sees nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InterceptError {
    #[error("{0}")]
    Rejected(String),
}

/// What an interceptor's future resolves to.
pub type Outcome = BoxFuture<'static, Result<Verdict, InterceptError>>;

/// The fields of a response an interceptor needs after the stream has moved on (owned, so a
/// pending future does not borrow the stream's buffers).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Meta {
    pub type_url: String,
    pub nonce: String,
    /// `version_info` (SotW) or `system_version_info` (Delta).
    pub version: String,
}

impl Meta {
    pub fn of(p: &wire::Peek<'_>) -> Meta {
        Meta {
            type_url: p.type_url.to_owned(),
            nonce: p.nonce.to_owned(),
            version: p.version.to_owned(),
        }
    }

    /// The NACK the stream sends when an interceptor fails: no version (the agent keeps no
    /// record of the last accepted one, and istiod keys NACKs on the nonce).
    pub fn nack(&self, api: Api, e: &InterceptError) -> Bytes {
        request(api, &self.type_url, "", &self.nonce, Some(&e.to_string()))
    }
}

/// A per-type hook. Implementations are shared by all streams, so per-stream state must not
/// live in them (the only state Istio keeps is what they publish, e.g. the DNS table).
pub trait Interceptor: Send + Sync {
    /// The response type URL this interceptor owns.
    fn type_url(&self) -> &'static str;

    /// Requests to send upstream right after Envoy's first LDS request on a new upstream
    /// stream (Istio's moment for NDS/PCDS subscriptions and the health replay).
    fn on_first_lds(&self, _api: Api) -> Vec<Bytes> {
        Vec::new()
    }

    /// Handles one response of [`Interceptor::type_url`]. The future may take as long as it
    /// needs (a download); it is dropped if the stream ends first.
    fn on_response(&self, api: Api, msg: Bytes, meta: Meta) -> Outcome;
}

// === request building ===

/// An agent-originated request (subscription, ACK, NACK or health report). Node is never set:
/// Envoy's first request on the stream carried it (`set_node_on_first_message_only`).
pub fn request(api: Api, type_url: &str, version: &str, nonce: &str, error: Option<&str>) -> Bytes {
    let error_detail = error.map(|m| Status {
        code: CODE_INTERNAL,
        message: m.to_owned(),
        details: vec![],
    });
    let bytes = match api {
        Api::Sotw => DiscoveryRequest {
            version_info: version.to_owned(),
            type_url: type_url.to_owned(),
            response_nonce: nonce.to_owned(),
            error_detail,
            ..Default::default()
        }
        .encode_to_vec(),
        Api::Delta => DeltaDiscoveryRequest {
            type_url: type_url.to_owned(),
            response_nonce: nonce.to_owned(),
            error_detail,
            ..Default::default()
        }
        .encode_to_vec(),
    };
    Bytes::from(bytes)
}

/// The first resource of a response, decoded only as far as its `Any` (intercepted types are
/// small and owned by the agent, so a decode is fine here).
fn first_resource(api: Api, msg: &[u8]) -> Result<Option<Any>, prost::DecodeError> {
    Ok(match api {
        Api::Sotw => DiscoveryResponse::decode(msg)?.resources.into_iter().next(),
        Api::Delta => DeltaDiscoveryResponse::decode(msg)?
            .resources
            .into_iter()
            .next()
            .and_then(|r| r.resource),
    })
}

/// Istio's pattern for an agent-consumed type: empty responses are ignored (no ACK); the first
/// resource is applied; success ACKs (SotW: version + nonce; Delta: nonce), failure NACKs with
/// `Internal`.
fn consume(
    api: Api,
    msg: &[u8],
    meta: &Meta,
    what: &str,
    apply: impl FnOnce(&Any) -> Result<(), String>,
) -> Result<Verdict, InterceptError> {
    let result = match first_resource(api, msg) {
        Ok(None) => return Ok(Verdict::Consume(None)),
        Ok(Some(any)) => apply(&any),
        Err(e) => Err(format!("decoding the {what} response: {e}")),
    };
    match result {
        Ok(()) => Ok(Verdict::Consume(Some(ack(api, meta)))),
        Err(e) => {
            tracing::error!(type_url = %meta.type_url, nonce = %meta.nonce, error = %e, "rejecting {what} from upstream (NACK)");
            Err(InterceptError::Rejected(e))
        }
    }
}

/// The ACK of a consumed response: SotW carries version and nonce, Delta the nonce.
pub fn ack(api: Api, meta: &Meta) -> Bytes {
    request(api, &meta.type_url, &meta.version, &meta.nonce, None)
}

/// A subscription request with no names (wildcard), as Istio sends for NDS and PCDS.
fn subscribe(api: Api, type_url: &str) -> Bytes {
    request(api, type_url, "", "", None)
}

// === NDS ===

/// NDS (`istio.networking.nds.v1.NameTable`): subscribed after Envoy's first LDS request,
/// published for the DNS proxy, never forwarded to Envoy. The table is decoded and built into
/// the DNS lookup table on the blocking pool, and only the lookup table is kept
/// (`crate::dns::build_table`).
pub struct Nds {
    pub table: watch::Sender<Option<Arc<LookupTable>>>,
    /// The proxy's namespace and domain: they decide the short names.
    pub scope: Scope,
}

impl Interceptor for Nds {
    fn type_url(&self) -> &'static str {
        type_url::NAME_TABLE
    }

    fn on_first_lds(&self, api: Api) -> Vec<Bytes> {
        vec![subscribe(api, type_url::NAME_TABLE)]
    }

    fn on_response(&self, api: Api, msg: Bytes, meta: Meta) -> Outcome {
        let (table, scope) = (self.table.clone(), self.scope.clone());
        let build = move || {
            consume(api, &msg, &meta, "NDS name table", |any| {
                let t = crate::dns::build_table(any.value.as_slice(), &scope)
                    .map_err(|e| format!("invalid NameTable: {e}"))?;
                tracing::debug!(hosts = t.hosts(), names = t.len(), "NDS name table updated");
                table.send_replace(Some(Arc::new(t)));
                Ok(())
            })
        };
        Box::pin(async move {
            tokio::task::spawn_blocking(build)
                .await
                .unwrap_or_else(|e| {
                    Err(InterceptError::Rejected(format!(
                        "building the NDS table: {e}"
                    )))
                })
        })
    }
}

// === PCDS ===

/// `repeated string ca_certificates_pem = 34;` in `istio.mesh.v1alpha1.ProxyConfig`
/// (istio/api `mesh/v1alpha1/proxy.proto`). Only this field is read, straight off the wire,
/// so the agent needs no copy of the large ProxyConfig schema.
pub const PROXY_CONFIG_CA_CERTIFICATES_PEM: u32 = 34;

/// PCDS (`PROXY_CONFIG_XDS_AGENT`): the extra roots in ProxyConfig's `caCertificatesPem`,
/// published for the identity module's `ROOTCA` trust bundle.
pub struct Pcds {
    pub bundle: watch::Sender<Vec<String>>,
}

impl Interceptor for Pcds {
    fn type_url(&self) -> &'static str {
        type_url::PROXY_CONFIG
    }

    fn on_first_lds(&self, api: Api) -> Vec<Bytes> {
        vec![subscribe(api, type_url::PROXY_CONFIG)]
    }

    fn on_response(&self, api: Api, msg: Bytes, meta: Meta) -> Outcome {
        let v = consume(api, &msg, &meta, "ProxyConfig", |any| {
            let pems = wire::repeated_strings(&any.value, PROXY_CONFIG_CA_CERTIFICATES_PEM)
                .map_err(|e| format!("invalid ProxyConfig: {e}"))?;
            tracing::info!(certificates = pems.len(), "PCDS trust bundle updated");
            self.bundle.send_replace(pems);
            Ok(())
        });
        Box::pin(std::future::ready(v))
    }
}

// === ECDS ===

/// The hook the Wasm module fills: rewrite an ECDS response before it reaches Envoy (it may
/// download first), or refuse it (the proxy NACKs upstream and Envoy sees nothing).
/// `rewrite` is called as each response arrives, in order, and the futures' results are
/// handed on in that order, so an implementation must let a newer response release an
/// older one it makes unwanted rather than wait for it (`wasm::convert`).
pub trait EcdsRewrite: Send + Sync {
    /// `Ok(Some(bytes))` is forwarded to Envoy; `Ok(None)`: superseded by a newer response
    /// of the stream, dropped (neither forwarded nor ACKed; Envoy ACKs the newer one);
    /// `Err` is NACKed upstream.
    fn rewrite(
        &self,
        api: Api,
        msg: Bytes,
    ) -> BoxFuture<'static, Result<Option<Bytes>, InterceptError>>;
}

/// The default: ECDS passes through untouched (no decode).
pub struct PassThrough;

impl EcdsRewrite for PassThrough {
    fn rewrite(
        &self,
        _api: Api,
        msg: Bytes,
    ) -> BoxFuture<'static, Result<Option<Bytes>, InterceptError>> {
        Box::pin(std::future::ready(Ok(Some(msg))))
    }
}

/// ECDS (`envoy.config.core.v3.TypedExtensionConfig`) through an [`EcdsRewrite`].
pub struct Ecds(pub Arc<dyn EcdsRewrite>);

impl Interceptor for Ecds {
    fn type_url(&self) -> &'static str {
        type_url::EXTENSION_CONFIG
    }

    fn on_response(&self, api: Api, msg: Bytes, meta: Meta) -> Outcome {
        let rewrite = self.0.rewrite(api, msg);
        Box::pin(async move {
            let v = rewrite.await.map(|b| match b {
                Some(b) => Verdict::Forward(b),
                None => Verdict::Consume(None),
            });
            v.inspect_err(|e| {
                tracing::error!(nonce = %meta.nonce, error = %e, "ECDS rewrite failed; NACK upstream");
            })
        })
    }
}

// === health ===

/// Workload health reported to the control plane (`istio.v1.HealthInformation`, VMs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy(String),
}

/// The agent-originated health request: healthy is an empty request, unhealthy carries
/// `error_detail{code: Internal, message}` (Istio `pkg/istio-agent/health`, sent by `xds_proxy.go`).
pub fn health_request(api: Api, h: &Health) -> Bytes {
    let error = match h {
        Health::Healthy => None,
        Health::Unhealthy(m) => Some(m.as_str()),
    };
    request(api, type_url::HEALTH_INFO, "", "", error)
}

/// Replays the last known health after the first LDS request of each new upstream stream;
/// changes in between are sent by the stream task as they happen.
pub struct HealthReplay(pub watch::Receiver<Option<Health>>);

impl Interceptor for HealthReplay {
    fn type_url(&self) -> &'static str {
        type_url::HEALTH_INFO
    }

    fn on_first_lds(&self, api: Api) -> Vec<Bytes> {
        self.0
            .borrow()
            .as_ref()
            .map(|h| health_request(api, h))
            .into_iter()
            .collect()
    }

    fn on_response(&self, _api: Api, _msg: Bytes, _meta: Meta) -> Outcome {
        // istiod does not answer health reports; should it, Envoy must not see the type.
        Box::pin(std::future::ready(Ok(Verdict::Consume(None))))
    }
}

/// Forwarded to Envoy only if Istio forwards it (`xds_proxy.go` `handleUpstreamResponse`): Envoy types and WDS.
pub fn forwarded_to_envoy(type_url: &str) -> bool {
    type_url.starts_with("type.googleapis.com/envoy.") || type_url == type_url::WORKLOAD
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::Resource;
    use meshagent_proto::envoy::util::pack_any;
    use meshagent_proto::nds::NameTable;
    use meshagent_proto::nds::name_table::NameInfo;

    fn table() -> NameTable {
        NameTable {
            table: [(
                "b.default.svc.cluster.local".to_owned(),
                NameInfo {
                    ips: vec!["240.240.0.1".into()],
                    ..Default::default()
                },
            )]
            .into(),
        }
    }

    fn sotw_response(t: &str, resources: Vec<Any>) -> Bytes {
        DiscoveryResponse {
            version_info: "v7".into(),
            resources,
            type_url: t.into(),
            nonce: "n7".into(),
            ..Default::default()
        }
        .encode_to_vec()
        .into()
    }

    fn run(i: &dyn Interceptor, api: Api, msg: Bytes) -> Verdict {
        let m = msg.clone();
        let meta = Meta::of(&wire::peek(api.response_kind(), &m).unwrap());
        // On a runtime: NDS builds its table on the blocking pool.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        match rt.block_on(i.on_response(api, msg, meta.clone())) {
            Ok(v) => v,
            // What the stream does with a failure: NACK upstream.
            Err(e) => Verdict::Consume(Some(meta.nack(api, &e))),
        }
    }

    fn sent(v: Verdict, api: Api) -> (String, String, Option<Status>) {
        let Verdict::Consume(Some(b)) = v else {
            panic!("expected a request upstream, got {v:?}")
        };
        match api {
            Api::Sotw => {
                let r = DiscoveryRequest::decode(b).unwrap();
                assert!(r.node.is_none());
                (r.version_info, r.response_nonce, r.error_detail)
            }
            Api::Delta => {
                let r = DeltaDiscoveryRequest::decode(b).unwrap();
                (String::new(), r.response_nonce, r.error_detail)
            }
        }
    }

    #[test]
    fn nds_sotw_publishes_and_acks() {
        let (tx, rx) = watch::channel(None);
        let nds = Nds {
            table: tx,
            scope: Scope::default(),
        };
        let v = run(
            &nds,
            Api::Sotw,
            sotw_response(type_url::NAME_TABLE, vec![pack_any(table())]),
        );
        assert_eq!(sent(v, Api::Sotw), ("v7".into(), "n7".into(), None));
        let t = rx.borrow().clone().unwrap();
        assert!(t.has_host("b.default.svc.cluster.local") && t.hosts() == 1);
    }

    #[test]
    fn nds_delta_publishes_and_acks_with_nonce() {
        let (tx, rx) = watch::channel(None);
        let nds = Nds {
            table: tx,
            scope: Scope::default(),
        };
        let msg: Bytes = DeltaDiscoveryResponse {
            system_version_info: "sv".into(),
            resources: vec![Resource {
                name: String::new(),
                resource: Some(pack_any(table())),
                ..Default::default()
            }],
            type_url: type_url::NAME_TABLE.into(),
            nonce: "d1".into(),
            ..Default::default()
        }
        .encode_to_vec()
        .into();
        let (_, nonce, err) = sent(run(&nds, Api::Delta, msg), Api::Delta);
        assert_eq!((nonce.as_str(), err), ("d1", None));
        assert!(rx.borrow().is_some());
    }

    #[test]
    fn malformed_name_table_is_nacked_and_not_published() {
        let (tx, rx) = watch::channel(None);
        let nds = Nds {
            table: tx,
            scope: Scope::default(),
        };
        let bad = Any {
            type_url: type_url::NAME_TABLE.into(),
            value: vec![0x0a, 0x05, 0x01], // field 1 claims 5 bytes, has 1
        };
        let (version, nonce, err) = sent(
            run(
                &nds,
                Api::Sotw,
                sotw_response(type_url::NAME_TABLE, vec![bad]),
            ),
            Api::Sotw,
        );
        let err = err.unwrap();
        assert_eq!((version.as_str(), nonce.as_str(), err.code), ("", "n7", 13));
        assert!(err.message.contains("invalid NameTable"), "{}", err.message);
        assert!(rx.borrow().is_none());
    }

    #[test]
    fn empty_response_is_ignored_without_ack() {
        let (tx, _rx) = watch::channel(None);
        let nds = Nds {
            table: tx,
            scope: Scope::default(),
        };
        assert_eq!(
            run(&nds, Api::Sotw, sotw_response(type_url::NAME_TABLE, vec![])),
            Verdict::Consume(None)
        );
    }

    #[test]
    fn pcds_publishes_ca_certificates_pem() {
        let (tx, rx) = watch::channel(Vec::new());
        let pcds = Pcds { bundle: tx };
        // ProxyConfig{config_path: "x" (1), ca_certificates_pem: ["PEM1", "PEM2"] (34)}
        let mut value = vec![0x0a, 1, b'x'];
        for s in ["PEM1", "PEM2"] {
            value.extend([0x92, 0x02, 4]);
            value.extend(s.as_bytes());
        }
        let any = Any {
            type_url: type_url::PROXY_CONFIG.into(),
            value,
        };
        let v = run(
            &pcds,
            Api::Sotw,
            sotw_response(type_url::PROXY_CONFIG, vec![any]),
        );
        assert_eq!(sent(v, Api::Sotw).2, None);
        assert_eq!(*rx.borrow(), vec!["PEM1".to_owned(), "PEM2".to_owned()]);
        assert_eq!(pcds.on_first_lds(Api::Delta).len(), 1);
    }

    #[test]
    fn ecds_default_passes_bytes_through_and_failures_nack() {
        let msg = sotw_response(type_url::EXTENSION_CONFIG, vec![]);
        let e = Ecds(Arc::new(PassThrough));
        assert_eq!(
            run(&e, Api::Sotw, msg.clone()),
            Verdict::Forward(msg.clone())
        );

        struct Refuse;
        impl EcdsRewrite for Refuse {
            fn rewrite(
                &self,
                _: Api,
                _: Bytes,
            ) -> BoxFuture<'static, Result<Option<Bytes>, InterceptError>> {
                Box::pin(async { Err(InterceptError::Rejected("wasm fetch failed".into())) })
            }
        }
        let (_, nonce, err) = sent(run(&Ecds(Arc::new(Refuse)), Api::Sotw, msg), Api::Sotw);
        assert_eq!(nonce, "n7");
        assert_eq!(err.unwrap().message, "wasm fetch failed");
    }

    #[test]
    fn health_requests_and_replay() {
        let healthy =
            DiscoveryRequest::decode(health_request(Api::Sotw, &Health::Healthy)).unwrap();
        assert_eq!(healthy.type_url, type_url::HEALTH_INFO);
        assert!(healthy.error_detail.is_none());
        let sick = DeltaDiscoveryRequest::decode(health_request(
            Api::Delta,
            &Health::Unhealthy("probe failed".into()),
        ))
        .unwrap();
        let e = sick.error_detail.unwrap();
        assert_eq!((e.code, e.message.as_str()), (13, "probe failed"));

        let (tx, rx) = watch::channel(None);
        let replay = HealthReplay(rx);
        assert!(
            replay.on_first_lds(Api::Sotw).is_empty(),
            "nothing known: nothing sent"
        );
        tx.send_replace(Some(Health::Healthy));
        assert_eq!(replay.on_first_lds(Api::Sotw).len(), 1);
    }

    #[test]
    fn forwarding_rule() {
        assert!(forwarded_to_envoy(type_url::CLUSTER));
        assert!(forwarded_to_envoy(type_url::WORKLOAD));
        assert!(!forwarded_to_envoy(type_url::NAME_TABLE));
        assert!(!forwarded_to_envoy("istio.io/debug/syncz"));
    }
}
