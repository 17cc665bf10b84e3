//! The Istio CA: `istio.v1.auth.IstioCertificateService/CreateCertificate`.
//!
//! Mirrors istiod's Citadel signer as the agent sees it (`security/pkg/server/ca/server.go` `CreateCertificate`): the caller is
//! authenticated by its projected token, the CSR contributes only its public key, and the leaf
//! carries exactly one critical URI SAN `spiffe://<trust domain>/ns/<ns>/sa/<sa>` with an empty
//! subject. The chain comes back as one PEM per element, leaf first, root last.

mod csr_log;
mod redact;
mod service;
mod signer;
#[cfg(test)]
mod tests;

use std::time::Duration;

pub(crate) use csr_log::rfc3339;
pub use csr_log::{CsrLog, CsrRecord};
pub use service::CaService;
pub use signer::{Ca, Issued};
pub(crate) use signer::{new_root_ca, pem_encode};

/// Trust domain of a default Istio install.
pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";
/// istiod's `DEFAULT_WORKLOAD_CERT_TTL`, used when the request asks for 0 or less.
pub const DEFAULT_CERT_TTL: Duration = Duration::from_secs(24 * 3600);
/// istiod's `MAX_WORKLOAD_CERT_TTL`. istiod rejects longer requests; devplane clamps instead so
/// demos with odd SECRET_TTL values still get a certificate.
pub const MAX_CERT_TTL: Duration = Duration::from_secs(90 * 24 * 3600);
/// NotBefore is backdated so a workload whose clock runs slightly behind accepts the cert.
pub const BACKDATE: Duration = Duration::from_secs(60);
/// A real CSR is ~1 KiB (RSA 4096 ~2 KiB); anything far bigger is not a CSR.
pub const MAX_CSR_LEN: usize = 64 * 1024;
/// How many CSR records the debug log keeps (the reconnect-storm benchmark starts 200 agents
/// at once and reads every arrival time back).
pub const CSR_LOG_CAPACITY: usize = 1024;

/// Errors from building the CA or signing a CSR.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// The CSR is unusable: unparseable, empty, self-signature doesn't verify, unsupported key.
    #[error("invalid CSR: {0}")]
    InvalidCsr(String),
    /// The identity or trust domain can't be encoded into a SPIFFE URI SAN.
    #[error("cannot build SPIFFE ID {uri:?}: {reason}")]
    InvalidIdentity { uri: String, reason: String },
    /// The root certificate or key handed to [`Ca::new`] is unusable.
    #[error("invalid CA root: {0}")]
    InvalidRoot(String),
    /// rcgen failed to produce a certificate (should not happen with valid inputs).
    #[error("signing certificate for {what} failed: {source}")]
    Sign {
        what: String,
        #[source]
        source: rcgen::Error,
    },
}
