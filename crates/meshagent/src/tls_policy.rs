//! `COMPLIANCE_POLICY` applied to the agent's own TLS clients (istiod's xDS and CA).
//!
//! Istio restricts every gRPC client's Go `tls.Config` with `EnforceGoCompliance`
//! (`pkg/model/fips.go`, called from `pilot/pkg/grpc/tls.go` for the xDS proxy's upstream and
//! the CA client): the same restrictions here, on the rustls provider and protocol versions:
//!
//! | policy | versions | TLS 1.2 suites | TLS 1.3 suites | key exchange |
//! |---|---|---|---|---|
//! | `fips-140-2` | 1.2 | ECDHE-{ECDSA,RSA}-AES{128,256}-GCM | — | P-256 |
//! | `fips-140-3` | 1.2, 1.3 | the same | AES-GCM | P-256, P-384 |
//! | `pqc` | 1.3 | — | AES-GCM | X25519MLKEM768 |
//!
//! Under `fips-140-3` Go leaves TLS 1.3 suites to its FIPS mode (`GODEBUG=fips140=only`, AES-GCM
//! only) and warns when that mode is off; rustls lets the suites be chosen, so AES-GCM is always
//! enforced here. Any other value is ignored with a warning, as Istio does ("unknown compliance
//! policy"). Built with the `fips` feature, the provider is aws-lc-rs's FIPS module, and
//! [`is_fips_module`] says so.

use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::crypto::aws_lc_rs::{self, cipher_suite as cs, kx_group as kx};
use rustls::{ClientConfig, ConfigBuilder, SupportedProtocolVersion, WantsVerifier};

/// The values Istio knows (`pkg/features/security.go`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompliancePolicy {
    /// Unset (or unknown): no restriction.
    #[default]
    None,
    Fips1402,
    Fips1403,
    Pqc,
}

impl CompliancePolicy {
    /// `COMPLIANCE_POLICY`'s value; an unknown one is ignored with a warning, as Istio does.
    pub fn parse(value: &str) -> CompliancePolicy {
        match value {
            "" => CompliancePolicy::None,
            "fips-140-2" => CompliancePolicy::Fips1402,
            "fips-140-3" => CompliancePolicy::Fips1403,
            "pqc" => CompliancePolicy::Pqc,
            other => {
                tracing::warn!(
                    policy = other,
                    "unknown compliance policy: {other:?} (expected fips-140-2, fips-140-3 or pqc); TLS is not restricted"
                );
                CompliancePolicy::None
            }
        }
    }
}

static TLS12_ONLY: &[&SupportedProtocolVersion] = &[&rustls::version::TLS12];
static TLS13_ONLY: &[&SupportedProtocolVersion] = &[&rustls::version::TLS13];

/// The provider (aws-lc-rs; its FIPS module with the `fips` feature) and protocol versions
/// `policy` allows: the default provider's suites and groups filtered, so a `fips` build only
/// ever narrows further.
pub fn tls_policy(
    policy: CompliancePolicy,
) -> (CryptoProvider, &'static [&'static SupportedProtocolVersion]) {
    let mut p = aws_lc_rs::default_provider();
    let tls12_gcm = [
        cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
    ];
    let tls13_gcm = [cs::TLS13_AES_128_GCM_SHA256, cs::TLS13_AES_256_GCM_SHA384];
    let (suites, groups, versions) = match policy {
        CompliancePolicy::None => return (p, rustls::DEFAULT_VERSIONS),
        CompliancePolicy::Fips1402 => (tls12_gcm.to_vec(), vec![kx::SECP256R1.name()], TLS12_ONLY),
        CompliancePolicy::Fips1403 => (
            [tls12_gcm.as_slice(), tls13_gcm.as_slice()].concat(),
            vec![kx::SECP256R1.name(), kx::SECP384R1.name()],
            rustls::ALL_VERSIONS,
        ),
        CompliancePolicy::Pqc => (
            tls13_gcm.to_vec(),
            vec![kx::X25519MLKEM768.name()],
            TLS13_ONLY,
        ),
    };
    let suite_ids: Vec<_> = suites.iter().map(|s| s.suite()).collect();
    p.cipher_suites.retain(|s| suite_ids.contains(&s.suite()));
    // X25519MLKEM768 is in the default provider; `retain` keeps the policy's order otherwise.
    p.kx_groups = groups
        .iter()
        .filter_map(|g| aws_lc_rs::ALL_KX_GROUPS.iter().find(|k| k.name() == *g))
        .copied()
        .collect();
    (p, versions)
}

/// A client config builder restricted by `policy`.
pub fn client_builder(
    policy: CompliancePolicy,
) -> Result<ConfigBuilder<ClientConfig, WantsVerifier>, rustls::Error> {
    let (provider, versions) = tls_policy(policy);
    ClientConfig::builder_with_provider(Arc::new(provider)).with_protocol_versions(versions)
}

/// Whether the crypto module in use is aws-lc's FIPS-validated one (the `fips` build).
pub fn is_fips_module() -> bool {
    aws_lc_rs::default_provider().fips()
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::disallowed_methods,
        reason = "test code, not on the agent's runtime"
    )]
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    use rustls::{CipherSuite, NamedGroup, ProtocolVersion, ServerConfig};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    struct Server {
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        roots: rustls::RootCertStore,
    }

    fn pki() -> Server {
        let key = rcgen::KeyPair::generate().unwrap(); // ECDSA P-256
        let params = rcgen::CertificateParams::new(vec!["istiod.istio-system.svc".into()]).unwrap();
        let cert = params.self_signed(&key).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone()).unwrap();
        Server {
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            roots,
        }
    }

    /// A loopback TLS server offering only `suite` over `group` at `version`; the client
    /// restricted by `policy` connects. Returns what was negotiated, or the client's error.
    async fn handshake(
        policy: CompliancePolicy,
        version: &'static SupportedProtocolVersion,
        suite: CipherSuite,
        group: NamedGroup,
    ) -> Result<(ProtocolVersion, CipherSuite, NamedGroup), String> {
        let pki = pki();
        let mut sp = aws_lc_rs::default_provider();
        sp.cipher_suites = aws_lc_rs::ALL_CIPHER_SUITES
            .iter()
            .filter(|s| s.suite() == suite)
            .copied()
            .collect();
        sp.kx_groups = aws_lc_rs::ALL_KX_GROUPS
            .iter()
            .filter(|g| g.name() == group)
            .copied()
            .collect();
        let server = ServerConfig::builder_with_provider(Arc::new(sp))
            .with_protocol_versions(&[version])
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(pki.chain, pki.key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let serve = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            if let Ok(mut tls) = acceptor.accept(tcp).await {
                let mut b = [0u8; 1];
                let _ = tls.read_exact(&mut b).await;
                let _ = tls.write_all(&b).await;
                let _ = tls.shutdown().await;
            }
        });
        let client = client_builder(policy)
            .unwrap()
            .with_root_certificates(pki.roots)
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let deadline = std::time::Duration::from_secs(10);
        let res = tokio::time::timeout(
            deadline,
            tokio_rustls::TlsConnector::from(Arc::new(client)).connect(
                ServerName::try_from("istiod.istio-system.svc").unwrap(),
                tcp,
            ),
        )
        .await
        .expect("handshake within 10 s");
        let out = match res {
            Ok(mut tls) => {
                tls.write_all(b"x").await.unwrap();
                let mut b = [0u8; 1];
                tls.read_exact(&mut b).await.unwrap();
                let (_, c) = tls.get_ref();
                Ok((
                    c.protocol_version().unwrap(),
                    c.negotiated_cipher_suite().unwrap().suite(),
                    c.negotiated_key_exchange_group().unwrap().name(),
                ))
            }
            Err(e) => Err(e.to_string()),
        };
        let _ = tokio::time::timeout(deadline, serve).await;
        out
    }

    use CipherSuite as S;
    use NamedGroup as G;
    use rustls::version::{TLS12, TLS13};

    const ECDSA_AES128: S = S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256;
    const ECDSA_AES256: S = S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384;
    const ECDSA_CHACHA: S = S::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256;

    #[test]
    fn policy_values_as_istio_reads_them() {
        assert_eq!(CompliancePolicy::parse(""), CompliancePolicy::None);
        assert_eq!(
            CompliancePolicy::parse("fips-140-2"),
            CompliancePolicy::Fips1402
        );
        assert_eq!(
            CompliancePolicy::parse("fips-140-3"),
            CompliancePolicy::Fips1403
        );
        assert_eq!(CompliancePolicy::parse("pqc"), CompliancePolicy::Pqc);
        // Istio warns and applies nothing.
        assert_eq!(
            CompliancePolicy::parse("FIPS-140-2"),
            CompliancePolicy::None
        );
    }

    /// The `fips` build runs on aws-lc's FIPS module, the default build does not.
    #[test]
    fn the_fips_feature_selects_the_fips_module() {
        assert_eq!(is_fips_module(), cfg!(feature = "fips"));
    }

    #[tokio::test]
    async fn fips_140_2_allows_tls12_aes_gcm_over_p256_only() {
        let p = CompliancePolicy::Fips1402;
        assert_eq!(
            handshake(p, &TLS12, ECDSA_AES128, G::secp256r1).await,
            Ok((ProtocolVersion::TLSv1_2, ECDSA_AES128, G::secp256r1))
        );
        assert_eq!(
            handshake(p, &TLS12, ECDSA_AES256, G::secp256r1).await,
            Ok((ProtocolVersion::TLSv1_2, ECDSA_AES256, G::secp256r1))
        );
        for (what, v, s, g) in [
            ("ChaCha20", &TLS12, ECDSA_CHACHA, G::secp256r1),
            ("X25519", &TLS12, ECDSA_AES128, G::X25519),
            ("P-384", &TLS12, ECDSA_AES128, G::secp384r1),
            ("TLS 1.3", &TLS13, S::TLS13_AES_128_GCM_SHA256, G::secp256r1),
        ] {
            let r = handshake(p, v, s, g).await;
            assert!(
                r.is_err(),
                "fips-140-2 accepted a server with {what}: {r:?}"
            );
        }
    }

    #[tokio::test]
    async fn fips_140_3_allows_aes_gcm_over_p256_or_p384() {
        let p = CompliancePolicy::Fips1403;
        assert_eq!(
            handshake(p, &TLS13, S::TLS13_AES_256_GCM_SHA384, G::secp384r1).await,
            Ok((
                ProtocolVersion::TLSv1_3,
                S::TLS13_AES_256_GCM_SHA384,
                G::secp384r1
            ))
        );
        assert_eq!(
            handshake(p, &TLS12, ECDSA_AES128, G::secp256r1).await,
            Ok((ProtocolVersion::TLSv1_2, ECDSA_AES128, G::secp256r1))
        );
        for (what, v, s, g) in [
            (
                "TLS 1.3 ChaCha20",
                &TLS13,
                S::TLS13_CHACHA20_POLY1305_SHA256,
                G::secp256r1,
            ),
            ("TLS 1.2 ChaCha20", &TLS12, ECDSA_CHACHA, G::secp256r1),
            ("X25519", &TLS13, S::TLS13_AES_128_GCM_SHA256, G::X25519),
        ] {
            let r = handshake(p, v, s, g).await;
            assert!(
                r.is_err(),
                "fips-140-3 accepted a server with {what}: {r:?}"
            );
        }
    }

    #[tokio::test]
    async fn pqc_requires_tls13_with_x25519mlkem768() {
        let p = CompliancePolicy::Pqc;
        assert_eq!(
            handshake(p, &TLS13, S::TLS13_AES_128_GCM_SHA256, G::X25519MLKEM768).await,
            Ok((
                ProtocolVersion::TLSv1_3,
                S::TLS13_AES_128_GCM_SHA256,
                G::X25519MLKEM768
            ))
        );
        for (what, v, s, g) in [
            ("X25519", &TLS13, S::TLS13_AES_128_GCM_SHA256, G::X25519),
            ("TLS 1.2", &TLS12, ECDSA_AES128, G::secp256r1),
        ] {
            let r = handshake(p, v, s, g).await;
            assert!(r.is_err(), "pqc accepted a server with {what}: {r:?}");
        }
    }

    /// Without a policy the default provider's suites and groups all work; a `fips` build's
    /// default provider has no ChaCha20 or X25519 to offer.
    #[cfg(not(feature = "fips"))]
    #[tokio::test]
    async fn no_policy_and_unknown_policy_restrict_nothing() {
        for p in [
            CompliancePolicy::None,
            CompliancePolicy::parse("fips-140-9"),
        ] {
            assert_eq!(
                handshake(p, &TLS13, S::TLS13_CHACHA20_POLY1305_SHA256, G::X25519).await,
                Ok((
                    ProtocolVersion::TLSv1_3,
                    S::TLS13_CHACHA20_POLY1305_SHA256,
                    G::X25519
                ))
            );
            assert!(handshake(p, &TLS12, ECDSA_CHACHA, G::X25519).await.is_ok());
        }
    }
}
