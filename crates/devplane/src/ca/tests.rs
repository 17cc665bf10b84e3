//! Unit tests of the signer, the service and the CSR log.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};
use meshagent_proto::ca::IstioCertificateRequest;
use meshagent_proto::ca::istio_certificate_service_server::IstioCertificateService as _;
use meshagent_proto::google::protobuf as pb;
use rcgen::{CertificateParams, DistinguishedName, KeyPair, PublicKeyData as _, SanType};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateSigningRequestDer};
use tonic::Request;
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::FromDer;

use super::*;
use crate::token::{Identity, TokenIssuer};

const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);

fn ca() -> Ca {
    let (cert, key) = new_root_ca(DEFAULT_TRUST_DOMAIN, 10 * YEAR, SystemTime::now()).unwrap();
    Ca::new(&cert, &key).unwrap()
}

fn tokens() -> TokenIssuer {
    let rng = aws_lc_rs::rand::SystemRandom::new();
    let doc = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
    TokenIssuer::from_pkcs8(doc.as_ref()).unwrap()
}

fn id(ns: &str, sa: &str) -> Identity {
    Identity {
        namespace: ns.into(),
        service_account: sa.into(),
    }
}

/// A CSR like the agent's: empty subject, critical URI SAN (here deliberately a *different*
/// identity, which the CA must ignore).
fn csr(alg: &'static rcgen::SignatureAlgorithm) -> (String, KeyPair) {
    let key = KeyPair::generate_for(alg).unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(
        "spiffe://evil.example/ns/kube-system/sa/admin"
            .try_into()
            .unwrap(),
    )];
    let pem = params.serialize_request(&key).unwrap().pem().unwrap();
    (pem, key)
}

fn der_of(pem: &str) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .unwrap()
        .to_vec()
}

#[test]
fn signs_with_caller_identity_only() {
    let ca = ca();
    let (csr_pem, key) = csr(&rcgen::PKCS_ECDSA_P256_SHA256);
    let now = SystemTime::now();
    let chain = ca
        .sign(&csr_pem, &id("NS", "SA"), Duration::from_secs(3600), now)
        .unwrap();
    assert_eq!(chain.len(), 2);
    assert_eq!(chain[1], ca.root_cert_pem());
    for pem in &chain {
        assert!(pem.ends_with("-----END CERTIFICATE-----\n"));
        assert_eq!(pem.matches("BEGIN").count(), 1);
    }

    let leaf_der = der_of(&chain[0]);
    let root_der = der_of(&chain[1]);
    let (_, leaf) = x509_parser::parse_x509_certificate(&leaf_der).unwrap();
    let (_, root) = x509_parser::parse_x509_certificate(&root_der).unwrap();

    // Chains to the root.
    leaf.verify_signature(Some(root.public_key())).unwrap();
    assert_eq!(leaf.issuer(), root.subject());
    // Uses the CSR's key.
    assert_eq!(
        leaf.public_key().raw,
        key.subject_public_key_info().as_slice()
    );
    // Exactly one SAN, the caller's, critical, empty subject.
    let san = leaf.subject_alternative_name().unwrap().unwrap();
    assert!(san.critical);
    assert_eq!(
        san.value.general_names,
        vec![GeneralName::URI("spiffe://cluster.local/ns/NS/sa/SA")]
    );
    assert_eq!(leaf.subject().iter_attributes().count(), 0);
    // Usages.
    assert!(!leaf.is_ca());
    let ku = leaf.key_usage().unwrap().unwrap().value;
    assert!(ku.digital_signature() && ku.key_encipherment() && !ku.key_cert_sign());
    let eku = leaf.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && eku.client_auth);
    // Validity: backdated a minute, NotAfter = now + 1h.
    let now_s = now.duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    assert_eq!(leaf.validity().not_before.timestamp(), now_s - 60);
    assert_eq!(leaf.validity().not_after.timestamp(), now_s + 3600);
    // 128-bit positive serial.
    assert_eq!(leaf.raw_serial().len(), 16);
    assert!(leaf.raw_serial()[0] < 0x80);
    let has_aki = leaf.iter_extensions().any(|e| {
        matches!(
            e.parsed_extension(),
            ParsedExtension::AuthorityKeyIdentifier(_)
        )
    });
    assert!(has_aki);
}

#[test]
fn validity_default_and_cap() {
    let ca = ca();
    let (csr_pem, _) = csr(&rcgen::PKCS_ECDSA_P256_SHA256);
    let now = SystemTime::now();
    let now_s = now.duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    let not_after = |v| {
        let chain = ca.sign(&csr_pem, &id("a", "b"), v, now).unwrap();
        let der = der_of(&chain[0]);
        let (_, c) = x509_parser::parse_x509_certificate(&der).unwrap();
        c.validity().not_after.timestamp() - now_s
    };
    assert_eq!(not_after(Duration::ZERO), 24 * 3600);
    assert_eq!(not_after(YEAR), 90 * 24 * 3600);
}

#[test]
fn trust_domain_is_configurable() {
    let ca = ca().with_trust_domain("example.org");
    let (csr_pem, _) = csr(&rcgen::PKCS_ECDSA_P256_SHA256);
    let issued = ca
        .sign_detailed(&csr_pem, &id("x", "y"), Duration::ZERO, SystemTime::now())
        .unwrap();
    assert_eq!(issued.spiffe_id, "spiffe://example.org/ns/x/sa/y");
    let bad = ca.with_trust_domain("has space");
    assert!(matches!(
        bad.sign(&csr_pem, &id("x", "y"), Duration::ZERO, SystemTime::now()),
        Err(CaError::InvalidIdentity { .. })
    ));
}

#[test]
fn rsa_csr_like_the_default_agent() {
    let ca = ca();
    let key = KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048).unwrap();
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    let csr_pem = params.serialize_request(&key).unwrap().pem().unwrap();
    let chain = ca
        .sign(
            &csr_pem,
            &id("default", "sleep"),
            Duration::ZERO,
            SystemTime::now(),
        )
        .unwrap();
    let der = der_of(&chain[0]);
    let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
    assert_eq!(
        leaf.public_key().raw,
        key.subject_public_key_info().as_slice()
    );
}

#[test]
fn tampered_csr_is_rejected() {
    let ca = ca();
    let (csr_pem, _) = csr(&rcgen::PKCS_ECDSA_P256_SHA256);
    let mut der = CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes())
        .unwrap()
        .to_vec();
    // Swap in another key's SPKI: the signature no longer matches the embedded key.
    let other = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let (_, parsed) = X509CertificationRequest::from_der(&der).unwrap();
    let old_spki = parsed.certification_request_info.subject_pki.raw.to_vec();
    let new_spki = other.subject_public_key_info();
    assert_eq!(old_spki.len(), new_spki.len());
    let pos = der
        .windows(old_spki.len())
        .position(|w| w == old_spki.as_slice())
        .unwrap();
    der[pos..pos + new_spki.len()].copy_from_slice(&new_spki);
    let forged = pem_encode("CERTIFICATE REQUEST", &der);
    let err = ca
        .sign(&forged, &id("a", "b"), Duration::ZERO, SystemTime::now())
        .unwrap_err();
    assert!(
        matches!(err, CaError::InvalidCsr(ref m) if m.contains("self-signature")),
        "{err}"
    );

    // Flip a bit in the signature itself.
    let mut der = CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes())
        .unwrap()
        .to_vec();
    let last = der.len() - 2;
    der[last] ^= 0x01;
    let forged = pem_encode("CERTIFICATE REQUEST", &der);
    assert!(matches!(
        ca.sign(&forged, &id("a", "b"), Duration::ZERO, SystemTime::now()),
        Err(CaError::InvalidCsr(_))
    ));
}

#[test]
fn garbage_csr_is_rejected() {
    let ca = ca();
    let big = "A".repeat(MAX_CSR_LEN + 1);
    for input in [
        "",
        "   \n",
        "hello",
        "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
        "-----BEGIN CERTIFICATE REQUEST-----\n!!!!\n-----END CERTIFICATE REQUEST-----\n",
        ca.root_cert_pem(),
        big.as_str(),
    ] {
        let r = ca.sign(input, &id("a", "b"), Duration::ZERO, SystemTime::now());
        assert!(
            matches!(r, Err(CaError::InvalidCsr(_))),
            "{input:.40}: {r:?}"
        );
    }
}

#[test]
fn root_and_key_must_match() {
    let (cert, _) = new_root_ca("x", YEAR, SystemTime::now()).unwrap();
    let (_, other_key) = new_root_ca("x", YEAR, SystemTime::now()).unwrap();
    assert!(matches!(
        Ca::new(&cert, &other_key),
        Err(CaError::InvalidRoot(_))
    ));
    assert!(matches!(
        Ca::new("junk", &other_key),
        Err(CaError::InvalidRoot(_))
    ));
}

#[test]
fn rfc3339_formats() {
    assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
    assert_eq!(
        rfc3339(UNIX_EPOCH + Duration::from_millis(951_782_400_250)),
        "2000-02-29T00:00:00.250Z"
    );
    assert_eq!(
        rfc3339(UNIX_EPOCH + Duration::from_secs(1_767_225_599)),
        "2025-12-31T23:59:59.000Z"
    );
}

fn request(csr: &str, auth: Option<&str>) -> Request<IstioCertificateRequest> {
    let mut metadata = pb::Struct::default();
    metadata.fields.insert(
        "CertSigner".into(),
        pb::Value {
            kind: Some(pb::value::Kind::StringValue(String::new())),
        },
    );
    let mut req = Request::new(IstioCertificateRequest {
        csr: csr.into(),
        validity_duration: 7200,
        metadata: Some(metadata),
    });
    req.metadata_mut()
        .insert("clusterid", "Kubernetes".parse().unwrap());
    if let Some(a) = auth {
        req.metadata_mut()
            .insert("authorization", a.parse().unwrap());
    }
    req
}

#[tokio::test]
async fn service_authenticates_and_signs() {
    let tokens = tokens();
    let svc = CaService::new(ca(), tokens.clone());
    let (csr_pem, _) = csr(&rcgen::PKCS_ECDSA_P256_SHA256);

    let err = svc
        .create_certificate(request(&csr_pem, None))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(err.message().contains("no authorization header"), "{err}");

    let forged = tokens_other_key().issue("default", "sleep", YEAR).unwrap();
    let err = svc
        .create_certificate(request(&csr_pem, Some(&format!("Bearer {forged}"))))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(err.message().contains("signature"), "{err}");

    let expired = tokens
        .issue_at(
            "default",
            "sleep",
            Duration::from_secs(60),
            SystemTime::now() - Duration::from_secs(3600),
        )
        .unwrap();
    let err = svc
        .create_certificate(request(&csr_pem, Some(&format!("Bearer {expired}"))))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(err.message().contains("expired"), "{err}");

    let good = tokens
        .issue("default", "sleep", Duration::from_secs(600))
        .unwrap();
    let err = svc
        .create_certificate(request("nope", Some(&format!("Bearer {good}"))))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    // Case-insensitive scheme, as gRPC-Go peers may send.
    let resp = svc
        .create_certificate(request(&csr_pem, Some(&format!("bearer {good}"))))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(resp.cert_chain.len(), 2);
    let der = der_of(&resp.cert_chain[0]);
    let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
    let san = leaf.subject_alternative_name().unwrap().unwrap();
    assert_eq!(
        san.value.general_names,
        vec![GeneralName::URI(
            "spiffe://cluster.local/ns/default/sa/sleep"
        )]
    );
    let lifetime = leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
    assert_eq!(lifetime, 7200 + 60);

    let log = svc.csr_log().snapshot();
    assert_eq!(log.len(), 5);
    let last = log.last().unwrap();
    assert_eq!(last.identity, Some(id("default", "sleep")));
    assert_eq!(last.validity_requested_secs, 7200);
    assert_eq!(last.metadata, serde_json::json!({"CertSigner": ""}));
    assert_eq!(last.headers["clusterid"], "Kubernetes");
    assert!(last.serial.as_deref().is_some_and(|s| s.len() == 32));
    assert!(last.error.is_none());
    // The raw token never reaches the log.
    let auth = &last.headers["authorization"];
    assert_eq!(*auth, format!("Bearer {}", crate::auth::fingerprint(&good)));
    let json = serde_json::to_string(&log).unwrap();
    assert!(!json.contains(&good) && !json.contains(&forged) && !json.contains(&expired));
    assert!(log[0].error.as_deref().unwrap().contains("Unauthenticated"));
}

fn tokens_other_key() -> TokenIssuer {
    tokens()
}

#[test]
fn csr_log_is_bounded() {
    let log = CsrLog::new();
    for i in 0..(CSR_LOG_CAPACITY + 5) {
        log.push(CsrRecord {
            time: SystemTime::now(),
            peer: None,
            headers: BTreeMap::new(),
            identity: None,
            metadata: serde_json::Value::Null,
            validity_requested_secs: i as i64,
            serial: None,
            error: None,
        });
    }
    let snap = log.snapshot();
    assert_eq!(snap.len(), CSR_LOG_CAPACITY);
    assert_eq!(snap[0].validity_requested_secs, 5);
}
