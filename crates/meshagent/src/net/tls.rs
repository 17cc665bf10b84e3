//! Every rustls client configuration of the HTTP clients is built by [`client_config`], so a
//! policy on versions or cipher suites (Istio's `COMPLIANCE_POLICY`, `pkg/tls/tls.go`) is
//! applied in one place. Verification is on unless a caller asks for [`Verify::Skip`], which
//! only HTTPS app probes (kubelet does not verify) and `WASM_INSECURE_REGISTRIES` do.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// Where OS trust bundles live (Istio's list, first existing wins).
pub const SYSTEM_ROOT_PATHS: [&str; 8] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/pki/tls/cacert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    "/etc/ssl/cert.pem",
    "/usr/local/etc/ssl/cert.pem",
    "/etc/ssl/certs/ca-certificates",
];

/// How the server's certificate is checked.
pub enum Verify {
    /// Against these roots (webpki: chain, names, validity).
    Roots(rustls::RootCertStore),
    /// Not at all (Go's `InsecureSkipVerify`); handshake signatures are still checked.
    Skip,
}

/// The one builder: aws-lc-rs, rustls' safe default protocol versions, no client
/// certificate, `alpn` in preference order.
pub fn client_config(
    verify: Verify,
    alpn: &[&[u8]],
) -> Result<rustls::ClientConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let mut cfg = match verify {
        Verify::Roots(roots) => builder.with_root_certificates(roots).with_no_client_auth(),
        Verify::Skip => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AcceptAnyCert(provider)))
            .with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    cfg.resumption = rustls::client::Resumption::in_memory_sessions(SESSION_CACHE_SERVERS);
    Ok(cfg)
}

/// Servers whose TLS sessions a client config remembers. rustls' default (256) preallocates
/// ~14 KiB per config, resident for the agent's life, for the handful of hosts an agent
/// fetches from (a registry, a metadata server, app probes); Go's `http.Transport`, which
/// pilot-agent's fetches go through, keeps no session cache at all.
const SESSION_CACHE_SERVERS: usize = 8;

/// A configuration that fails every handshake (no roots): what a caller uses if
/// [`client_config`] ever fails, so the failure shows on the connection that needed TLS.
pub fn unusable_config() -> rustls::ClientConfig {
    let mut cfg = rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    cfg.resumption = rustls::client::Resumption::disabled();
    cfg
}

/// The OS trust bundle (the first of [`SYSTEM_ROOT_PATHS`] that exists) plus `extra` (the
/// mesh CA bundle) when that file exists. Blocking: file reads and certificate parsing, for
/// the blocking pool.
#[allow(clippy::disallowed_methods, reason = "runs on the blocking pool")]
pub fn system_roots_plus(extra: Option<&Path>) -> rustls::RootCertStore {
    let mut roots = rustls::RootCertStore::empty();
    let files = SYSTEM_ROOT_PATHS
        .iter()
        .map(Path::new)
        .filter(|p| p.is_file())
        .take(1)
        .chain(extra.filter(|p| p.is_file()));
    for f in files {
        if let Ok(pem) = crate::fsio::read_bounded(f, 16 * 1024 * 1024) {
            for der in CertificateDer::pem_slice_iter(&pem).flatten() {
                let _ = roots.add(der);
            }
        }
    }
    roots
}

/// A server certificate verifier that accepts any certificate but still checks the handshake
/// signatures against it, as Go's `InsecureSkipVerify` does.
#[derive(Debug)]
struct AcceptAnyCert(Arc<rustls::crypto::CryptoProvider>);

impl rustls::client::danger::ServerCertVerifier for AcceptAnyCert {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
