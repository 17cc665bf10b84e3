//! devplane's Istio CA over real gRPC+TLS: identity comes from the token, never the CSR;
//! bad tokens are `Unauthenticated`, bad CSRs `InvalidArgument`.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hyper_util::rt::TokioIo;
use meshagent_devplane::state::State;
use meshagent_proto::ca::IstioCertificateRequest;
use meshagent_proto::ca::istio_certificate_service_client::IstioCertificateServiceClient;
use meshagent_testkit::Devplane;
use rustls_pki_types::{CertificateDer, ServerName, pem::PemObject};
use tonic::transport::{Channel, Endpoint};

async fn channel(dp: &Devplane) -> Channel {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(dp.root_cert_path()).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let mut cfg = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let addr = dp.grpc_addr;
    Endpoint::from_static("http://istiod.istio-system.svc:15012")
        .connect_with_connector(tower::service_fn(move |_| {
            let connector = connector.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let name = ServerName::try_from("istiod.istio-system.svc").unwrap();
                let tls = connector.connect(name, tcp).await?;
                Ok::<_, std::io::Error>(TokioIo::new(tls))
            }
        }))
        .await
        .unwrap()
}

fn csr() -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    // Asks for another identity: devplane must ignore it.
    params.subject_alt_names = vec![rcgen::SanType::URI(
        "spiffe://cluster.local/ns/kube-system/sa/admin"
            .try_into()
            .unwrap(),
    )];
    params.serialize_request(&key).unwrap().pem().unwrap()
}

async fn call(ch: Channel, token: Option<&str>, csr: String) -> Result<Vec<String>, tonic::Status> {
    let mut req = tonic::Request::new(IstioCertificateRequest {
        csr,
        validity_duration: 3600,
        metadata: None,
    });
    if let Some(t) = token {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    req.metadata_mut()
        .insert("clusterid", "Kubernetes".parse().unwrap());
    IstioCertificateServiceClient::new(ch)
        .create_certificate(req)
        .await
        .map(|r| r.into_inner().cert_chain)
}

fn uri_sans(pem: &str) -> Vec<String> {
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
    let san = cert.subject_alternative_name().unwrap().unwrap();
    san.value
        .general_names
        .iter()
        .map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => u.to_string(),
            other => format!("{other:?}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn signs_for_the_token_identity() {
    let dp = Devplane::start("").await;
    let token = dp.token("ns1", "sa1", 3600).await;
    let chain = call(channel(&dp).await, Some(&token), csr()).await.unwrap();
    assert_eq!(chain.len(), 2, "leaf then root");
    assert_eq!(
        uri_sans(&chain[0]),
        vec!["spiffe://cluster.local/ns/ns1/sa/sa1"]
    );
    let root = std::fs::read_to_string(dp.root_cert_path()).unwrap();
    assert_eq!(chain[1].trim(), root.trim());
    let csrs = dp.debug_json("/debug/csr").await;
    assert_eq!(csrs[0]["headers"]["clusterid"], "Kubernetes");
    assert!(
        !csrs.to_string().contains(&token),
        "debug endpoint must not echo tokens"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn rejects_missing_forged_and_expired_tokens() {
    let dp = Devplane::start("").await;
    let ch = channel(&dp).await;

    let missing = call(ch.clone(), None, csr()).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::Unauthenticated, "{missing:?}");

    let other = tempfile::tempdir().unwrap();
    let forged = State::load_or_create(other.path())
        .unwrap()
        .token_issuer()
        .unwrap()
        .issue("ns1", "sa1", Duration::from_secs(3600))
        .unwrap();
    let e = call(ch.clone(), Some(&forged), csr()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");

    let expired = State::load_or_create(&dp.dir.path().join("state"))
        .unwrap()
        .token_issuer()
        .unwrap()
        .issue_at(
            "ns1",
            "sa1",
            Duration::from_secs(600),
            SystemTime::now() - Duration::from_secs(7200),
        )
        .unwrap();
    let e = call(ch.clone(), Some(&expired), csr()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("expired"), "{e:?}");

    let good = dp.token("ns1", "sa1", 3600).await;
    let e = call(ch, Some(&good), "not a csr".into()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
}
