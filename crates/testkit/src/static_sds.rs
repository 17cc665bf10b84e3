//! A fixed-content SDS server on a unix socket, for tests where Envoy talks to devplane
//! directly (no agent): it answers every `StreamSecrets` request with the named secrets and
//! ignores ACKs. The real SDS server is the agent's; this only lets Envoy finish warming.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use meshagent_proto::envoy::pb::envoy::config::core::v3::{DataSource, data_source::Specifier};
use meshagent_proto::envoy::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, Secret, TlsCertificate, secret,
};
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use meshagent_proto::envoy::pb::envoy::service::secret::v3::secret_discovery_service_server::{
    SecretDiscoveryService, SecretDiscoveryServiceServer,
};
use meshagent_proto::envoy::util::pack_any;
use meshagent_proto::type_url;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status, Streaming};

pub struct StaticSds {
    pub socket: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for StaticSds {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn inline(bytes: &str) -> Option<DataSource> {
    Some(DataSource {
        specifier: Some(Specifier::InlineBytes(bytes.as_bytes().to_vec())),
        ..Default::default()
    })
}

impl StaticSds {
    /// Serves a workload certificate freshly issued by devplane's CA for `token`'s identity
    /// (what direct-Envoy tests use in place of the agent's SDS).
    pub async fn from_devplane(dp: &crate::Devplane, token: &str, dir: &Path) -> StaticSds {
        let (chain, key, root) =
            crate::ca_client::workload_cert(dp.grpc_addr, &dp.root_cert_path(), token).await;
        StaticSds::start(dir, &chain, &key, &root)
    }

    /// Serves `default` (chain + key) and `ROOTCA` (root) on `<dir>/sds.sock`.
    pub fn start(dir: &Path, chain_pem: &str, key_pem: &str, root_pem: &str) -> StaticSds {
        let mut secrets = HashMap::new();
        secrets.insert(
            "default".to_owned(),
            Secret {
                name: "default".into(),
                r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
                    certificate_chain: inline(chain_pem),
                    private_key: inline(key_pem),
                    ..Default::default()
                })),
            },
        );
        secrets.insert(
            "ROOTCA".to_owned(),
            Secret {
                name: "ROOTCA".into(),
                r#type: Some(secret::Type::ValidationContext(
                    CertificateValidationContext {
                        trusted_ca: inline(root_pem),
                        ..Default::default()
                    },
                )),
            },
        );
        let socket = dir.join("sds.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind static SDS socket");
        let svc = Svc(Arc::new(secrets));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(SecretDiscoveryServiceServer::new(svc))
                .serve_with_incoming(UnixListenerStream::new(listener))
                .await;
        });
        StaticSds { socket, task }
    }
}

#[derive(Clone)]
struct Svc(Arc<HashMap<String, Secret>>);

#[tonic::async_trait]
impl SecretDiscoveryService for Svc {
    type StreamSecretsStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaSecretsStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let mut reqs = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let secrets = self.0.clone();
        tokio::spawn(async move {
            let mut n = 0;
            while let Ok(Some(req)) = reqs.message().await {
                if !req.response_nonce.is_empty() {
                    continue; // ACK or NACK: static content never changes
                }
                n += 1;
                let resources = req
                    .resource_names
                    .iter()
                    .filter_map(|name| secrets.get(name).cloned())
                    .map(pack_any)
                    .collect();
                let resp = DiscoveryResponse {
                    version_info: "static".into(),
                    resources,
                    type_url: type_url::SECRET.into(),
                    nonce: n.to_string(),
                    ..Default::default()
                };
                if tx.send(Ok(resp)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delta_secrets(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        Err(Status::unimplemented(
            "static test SDS serves StreamSecrets only",
        ))
    }

    async fn fetch_secrets(
        &self,
        _request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        Err(Status::unimplemented(
            "static test SDS serves StreamSecrets only",
        ))
    }
}
