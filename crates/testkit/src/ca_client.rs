//! Gets a workload certificate from devplane's CA the way an agent does: key + CSR, then
//! `CreateCertificate` over TLS with a bearer token. For direct-Envoy tests and the demo.

use std::path::Path;
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use meshagent_proto::ca::IstioCertificateRequest;
use meshagent_proto::ca::istio_certificate_service_client::IstioCertificateServiceClient;
use rustls_pki_types::{CertificateDer, ServerName, pem::PemObject};
use tonic::transport::{Channel, Endpoint};

/// A TLS gRPC channel to `addr`, trusting the root in `root_pem_path`, verifying the server as
/// `istiod.istio-system.svc`.
pub async fn channel(addr: std::net::SocketAddr, root_pem_path: &Path) -> Channel {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(root_pem_path).expect("read root") {
        roots.add(c.expect("root PEM")).expect("add root");
    }
    let mut cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    Endpoint::from_static("http://istiod.istio-system.svc:15012")
        .connect_with_connector(tower::service_fn(move |_| {
            let connector = connector.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let name = ServerName::try_from("istiod.istio-system.svc")
                    .map_err(std::io::Error::other)?;
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        }))
        .await
        .expect("connect to devplane")
}

/// A signed workload certificate: (chain PEM, key PEM, root PEM).
pub async fn workload_cert(
    addr: std::net::SocketAddr,
    root_pem_path: &Path,
    token: &str,
) -> (String, String, String) {
    let key = rcgen::KeyPair::generate().expect("generate key");
    let csr = rcgen::CertificateParams::new(Vec::<String>::new())
        .expect("params")
        .serialize_request(&key)
        .expect("CSR")
        .pem()
        .expect("CSR PEM");
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr,
        validity_duration: 3600,
        metadata: None,
    });
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("ascii token"),
    );
    let chain = IstioCertificateServiceClient::new(channel(addr, root_pem_path).await)
        .create_certificate(req)
        .await
        .expect("CreateCertificate")
        .into_inner()
        .cert_chain;
    let root = chain.last().cloned().unwrap_or_default();
    (chain.concat(), key.serialize_pem(), root)
}
