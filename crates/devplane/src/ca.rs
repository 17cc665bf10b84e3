//! The Istio CA: `istio.v1.auth.IstioCertificateService/CreateCertificate`.
//!
//! Mirrors istiod's Citadel signer as the agent sees it (`security/pkg/server/ca/server.go` `CreateCertificate`): the caller is
//! authenticated by its projected token, the CSR contributes only its public key, and the leaf
//! carries exactly one critical URI SAN `spiffe://<trust domain>/ns/<ns>/sa/<sa>` with an empty
//! subject. The chain comes back as one PEM per element, leaf first, root last.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use meshagent_proto::ca::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use meshagent_proto::ca::{IstioCertificateRequest, IstioCertificateResponse};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData as _, SanType, SerialNumber,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateSigningRequestDer};
use serde::Serialize;
use tonic::metadata::KeyAndValueRef;
use tonic::{Request, Response, Status};
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::prelude::FromDer;

use crate::clients::struct_to_json;
use crate::token::{Identity, TokenError, TokenIssuer, hex, hex_prefix};

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

/// A certificate issued by [`Ca::sign_detailed`].
#[derive(Clone, Debug)]
pub struct Issued {
    /// `[leaf_pem, root_pem]`, each one PEM block ending in `\n`.
    pub chain: Vec<String>,
    /// Lowercase hex of the serial number.
    pub serial: String,
    /// The SPIFFE ID in the leaf's only SAN.
    pub spiffe_id: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

/// Signs workload certificates with the devplane root. Cheap to clone.
#[derive(Clone)]
pub struct Ca {
    signer: Arc<Signer>,
    trust_domain: String,
}

struct Signer {
    issuer: Issuer<'static, KeyPair>,
    root_pem: String,
}

impl std::fmt::Debug for Ca {
    // Hand-written so the root key can never end up in a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("trust_domain", &self.trust_domain)
            .finish_non_exhaustive()
    }
}

// === impl Ca ===

impl Ca {
    /// Builds a CA from the root certificate and its PKCS#8 private key (both PEM), with the
    /// default trust domain.
    pub fn new(root_cert_pem: &str, root_key_pem: &str) -> Result<Self, CaError> {
        let root_der = CertificateDer::from_pem_slice(root_cert_pem.as_bytes())
            .map_err(|e| CaError::InvalidRoot(format!("root certificate PEM: {e}")))?;
        let key = KeyPair::from_pem(root_key_pem)
            .map_err(|e| CaError::InvalidRoot(format!("root key PEM: {e}")))?;
        let (_, root) = x509_parser::parse_x509_certificate(&root_der)
            .map_err(|e| CaError::InvalidRoot(format!("root certificate: {e}")))?;
        if root.public_key().raw != key.subject_public_key_info().as_slice() {
            return Err(CaError::InvalidRoot(
                "root key does not match the root certificate".into(),
            ));
        }
        let issuer = Issuer::from_ca_cert_der(&root_der, key)
            .map_err(|e| CaError::InvalidRoot(format!("root certificate: {e}")))?;
        Ok(Self {
            signer: Arc::new(Signer {
                issuer,
                root_pem: pem_encode("CERTIFICATE", &root_der),
            }),
            trust_domain: DEFAULT_TRUST_DOMAIN.to_owned(),
        })
    }

    /// Same CA, issuing identities in `trust_domain` (istiod's `TRUST_DOMAIN`).
    pub fn with_trust_domain(mut self, trust_domain: impl Into<String>) -> Self {
        self.trust_domain = trust_domain.into();
        self
    }

    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// The root certificate, normalised to a single PEM block ending in `\n`.
    pub fn root_cert_pem(&self) -> &str {
        &self.signer.root_pem
    }

    /// `spiffe://<trust domain>/ns/<ns>/sa/<sa>`.
    pub fn spiffe_id(&self, identity: &Identity) -> String {
        format!(
            "spiffe://{}/ns/{}/sa/{}",
            self.trust_domain, identity.namespace, identity.service_account
        )
    }

    /// Signs `csr_pem` for `identity` (which must come from the authenticated caller, never from
    /// the CSR) and returns `[leaf_pem, root_pem]`.
    pub fn sign(
        &self,
        csr_pem: &str,
        identity: &Identity,
        validity: Duration,
        now: SystemTime,
    ) -> Result<Vec<String>, CaError> {
        self.sign_detailed(csr_pem, identity, validity, now)
            .map(|i| i.chain)
    }

    /// [`sign`](Self::sign), also returning serial and validity for logging.
    ///
    /// `validity` of zero means [`DEFAULT_CERT_TTL`]; more than [`MAX_CERT_TTL`] is clamped.
    pub fn sign_detailed(
        &self,
        csr_pem: &str,
        identity: &Identity,
        validity: Duration,
        now: SystemTime,
    ) -> Result<Issued, CaError> {
        let public_key = csr_public_key(csr_pem)?;
        let spiffe_id = self.spiffe_id(identity);
        if !valid_spiffe_id(&spiffe_id) {
            return Err(CaError::InvalidIdentity {
                uri: spiffe_id,
                reason: "trust domain, namespace and service account must be non-empty and \
                         contain no '/', whitespace or control characters"
                    .into(),
            });
        }
        let uri =
            spiffe_id
                .clone()
                .try_into()
                .map_err(|e: rcgen::Error| CaError::InvalidIdentity {
                    uri: spiffe_id.clone(),
                    reason: e.to_string(),
                })?;

        let validity = match validity {
            Duration::ZERO => DEFAULT_CERT_TTL,
            v => v.min(MAX_CERT_TTL),
        };
        let not_before = now.checked_sub(BACKDATE).unwrap_or(now);
        let not_after = now.checked_add(validity).unwrap_or(now);
        let serial = random_serial()?;

        let mut params = CertificateParams::default();
        // istiod leaves the subject empty; rcgen then marks the SAN critical (RFC 5280 §4.2.1.6).
        params.distinguished_name = DistinguishedName::new();
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        params.not_before = not_before.into();
        params.not_after = not_after.into();

        let leaf = params
            .signed_by(&public_key, &self.signer.issuer)
            .map_err(|source| CaError::Sign {
                what: spiffe_id.clone(),
                source,
            })?;
        Ok(Issued {
            chain: vec![
                pem_encode("CERTIFICATE", leaf.der()),
                self.signer.root_pem.clone(),
            ],
            serial: hex(&serial),
            spiffe_id,
            not_before,
            not_after,
        })
    }

    /// A TLS serving certificate for istiod's gRPC port, signed by the root; returns
    /// `(cert_pem, pkcs8_key_pem)`.
    pub(crate) fn new_serving_cert(
        &self,
        dns_names: &[&str],
        ips: &[std::net::IpAddr],
        spiffe_id: &str,
        validity: Duration,
        now: SystemTime,
    ) -> Result<(String, String), CaError> {
        let sign_err = |source| CaError::Sign {
            what: "serving certificate".into(),
            source,
        };
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(sign_err)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        for name in dns_names {
            params
                .subject_alt_names
                .push(SanType::DnsName((*name).try_into().map_err(sign_err)?));
        }
        params
            .subject_alt_names
            .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
        params
            .subject_alt_names
            .push(SanType::URI(spiffe_id.try_into().map_err(sign_err)?));
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        params.serial_number = Some(SerialNumber::from_slice(&random_serial()?));
        params.not_before = now.checked_sub(BACKDATE).unwrap_or(now).into();
        params.not_after = now.checked_add(validity).unwrap_or(now).into();
        let cert = params
            .signed_by(&key, &self.signer.issuer)
            .map_err(sign_err)?;
        Ok((pem_encode("CERTIFICATE", cert.der()), key.serialize_pem()))
    }
}

/// A fresh self-signed root: ECDSA P-256, CN `devplane root CA`, O `<org>`; returns
/// `(cert_pem, pkcs8_key_pem)`.
pub(crate) fn new_root_ca(
    org: &str,
    validity: Duration,
    now: SystemTime,
) -> Result<(String, String), CaError> {
    let sign_err = |source| CaError::Sign {
        what: "root CA".into(),
        source,
    };
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(sign_err)?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, org);
    dn.push(DnType::CommonName, "devplane root CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.serial_number = Some(SerialNumber::from_slice(&random_serial()?));
    params.not_before = now.checked_sub(BACKDATE).unwrap_or(now).into();
    params.not_after = now.checked_add(validity).unwrap_or(now).into();
    let cert = params.self_signed(&key).map_err(sign_err)?;
    Ok((pem_encode("CERTIFICATE", cert.der()), key.serialize_pem()))
}

/// Parses the CSR, checks it is signed by the key it carries (proof of possession) and returns
/// only that key. Everything else in the CSR (subject, SANs, extensions) is ignored on purpose.
fn csr_public_key(csr_pem: &str) -> Result<rcgen::SubjectPublicKeyInfo, CaError> {
    let invalid = |m: String| CaError::InvalidCsr(m);
    if csr_pem.trim().is_empty() {
        return Err(invalid("empty CSR".into()));
    }
    if csr_pem.len() > MAX_CSR_LEN {
        return Err(invalid(format!(
            "CSR is {} bytes, more than {MAX_CSR_LEN}",
            csr_pem.len()
        )));
    }
    let der = CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes())
        .map_err(|e| invalid(format!("no CERTIFICATE REQUEST PEM block: {e}")))?;
    let (rest, csr) = X509CertificationRequest::from_der(&der)
        .map_err(|e| invalid(format!("cannot parse PKCS#10: {e}")))?;
    if !rest.is_empty() {
        return Err(invalid("trailing bytes after PKCS#10 structure".into()));
    }
    csr.verify_signature()
        .map_err(|e| invalid(format!("self-signature does not verify: {e}")))?;
    rcgen::SubjectPublicKeyInfo::from_der(csr.certification_request_info.subject_pki.raw)
        .map_err(|e| invalid(format!("unsupported public key: {e}")))
}

fn valid_spiffe_id(uri: &str) -> bool {
    let Some(rest) = uri.strip_prefix("spiffe://") else {
        return false;
    };
    let segs: Vec<&str> = rest.split('/').collect();
    matches!(segs.as_slice(), [td, "ns", ns, "sa", sa]
        if [td, ns, sa].iter().all(|s| !s.is_empty()
            && s.chars().all(|c| !c.is_whitespace() && !c.is_control())))
}

/// 128 random bits, top bit cleared so the DER INTEGER is positive without padding (RFC 5280
/// allows at most 20 octets).
fn random_serial() -> Result<[u8; 16], CaError> {
    let mut s = [0u8; 16];
    aws_lc_rs::rand::fill(&mut s).map_err(|_| CaError::Sign {
        what: "serial number".into(),
        source: rcgen::Error::RingUnspecified,
    })?;
    s[0] = (s[0] & 0x7f) | 0x01;
    Ok(s)
}

/// One PEM block with 64-column base64 and a trailing `\n`, as Go's `pem.Encode` writes it.
pub(crate) fn pem_encode(label: &str, der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = String::with_capacity(b64.len() + b64.len() / 64 + 2 * label.len() + 40);
    out.push_str("-----BEGIN ");
    out.push_str(label);
    out.push_str("-----\n");
    let mut rest = b64.as_str();
    while !rest.is_empty() {
        let (line, tail) = rest.split_at(rest.len().min(64));
        out.push_str(line);
        out.push('\n');
        rest = tail;
    }
    out.push_str("-----END ");
    out.push_str(label);
    out.push_str("-----\n");
    out
}

// === CSR log ===

/// What one `CreateCertificate` call carried, for the debug endpoint.
///
/// Never holds a raw token: `authorization` is reduced to a SHA-256 fingerprint.
#[derive(Clone, Debug, Serialize)]
pub struct CsrRecord {
    #[serde(serialize_with = "serialize_rfc3339")]
    pub time: SystemTime,
    /// `request.remote_addr()` (absent on transports without connect info, e.g. in-process).
    pub peer: Option<SocketAddr>,
    /// Request metadata; repeated keys are joined with `", "`, binary (`-bin`) values are base64.
    pub headers: BTreeMap<String, String>,
    /// The authenticated caller, if authentication succeeded.
    pub identity: Option<Identity>,
    /// The request's `metadata` Struct as JSON (`null` when absent).
    pub metadata: serde_json::Value,
    /// `validity_duration` as requested, in seconds.
    pub validity_requested_secs: i64,
    /// Serial (hex) of the issued leaf.
    pub serial: Option<String>,
    /// Why the call failed, if it did.
    pub error: Option<String>,
}

/// Bounded, shared log of the last [`CSR_LOG_CAPACITY`] CSR calls. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct CsrLog {
    inner: Arc<Mutex<VecDeque<CsrRecord>>>,
}

impl CsrLog {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&self, record: CsrRecord) {
        // A panic while holding the lock can't leave the deque inconsistent; keep logging.
        let mut q = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if q.len() >= CSR_LOG_CAPACITY {
            q.pop_front();
        }
        q.push_back(record);
    }

    /// Oldest first.
    pub fn snapshot(&self) -> Vec<CsrRecord> {
        let q = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        q.iter().cloned().collect()
    }
}

// === impl CaService ===

/// The tonic service for `istio.v1.auth.IstioCertificateService`.
#[derive(Clone, Debug)]
pub struct CaService {
    ca: Ca,
    tokens: TokenIssuer,
    log: CsrLog,
}

impl CaService {
    pub fn new(ca: Ca, tokens: TokenIssuer) -> Self {
        Self {
            ca,
            tokens,
            log: CsrLog::new(),
        }
    }

    /// Records calls into `log` (e.g. one shared with the debug endpoint).
    pub fn with_csr_log(mut self, log: CsrLog) -> Self {
        self.log = log;
        self
    }

    pub fn csr_log(&self) -> CsrLog {
        self.log.clone()
    }

    /// Wraps the service for `tonic::transport::Server::add_service`.
    pub fn into_server(self) -> IstioCertificateServiceServer<Self> {
        IstioCertificateServiceServer::new(self)
    }

    fn authenticate(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        now: SystemTime,
    ) -> Result<Identity, Status> {
        let Some(value) = metadata.get("authorization") else {
            return Err(Status::unauthenticated(
                "authenticate: no authorization header (want \"Bearer <service account token>\")",
            ));
        };
        let value = value.to_str().map_err(|_| {
            Status::unauthenticated("authenticate: authorization header is not ASCII")
        })?;
        let token = bearer_token(value).ok_or_else(|| {
            Status::unauthenticated("authenticate: authorization header is not \"Bearer <token>\"")
        })?;
        self.tokens
            .verify(token, now)
            .map_err(|e: TokenError| Status::unauthenticated(format!("authenticate: {e}")))
    }
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let now = SystemTime::now();
        // devplane's listeners attach `conn::ConnInfo` rather than tonic's own connect info.
        let peer = request.remote_addr().or_else(|| {
            request
                .extensions()
                .get::<crate::conn::ConnInfo>()
                .and_then(|c| c.remote_addr)
        });
        let headers = record_headers(request.metadata());
        let auth = self.authenticate(request.metadata(), now);
        let req = request.into_inner();
        let mut record = CsrRecord {
            time: now,
            peer,
            headers,
            identity: auth.as_ref().ok().cloned(),
            metadata: req
                .metadata
                .as_ref()
                .map_or(serde_json::Value::Null, struct_to_json),
            validity_requested_secs: req.validity_duration,
            serial: None,
            error: None,
        };

        let result = auth.and_then(|identity| {
            let validity = u64::try_from(req.validity_duration)
                .map(Duration::from_secs)
                .unwrap_or(Duration::ZERO);
            self.ca
                .sign_detailed(&req.csr, &identity, validity, now)
                .map_err(|e| match e {
                    CaError::InvalidCsr(_) | CaError::InvalidIdentity { .. } => {
                        Status::invalid_argument(e.to_string())
                    }
                    CaError::InvalidRoot(_) | CaError::Sign { .. } => {
                        Status::internal(e.to_string())
                    }
                })
                .map(|issued| (identity, issued))
        });

        match result {
            Ok((identity, issued)) => {
                tracing::info!(
                    namespace = %identity.namespace,
                    service_account = %identity.service_account,
                    spiffe_id = %issued.spiffe_id,
                    serial = %issued.serial,
                    not_after = %rfc3339(issued.not_after),
                    peer = ?peer,
                    "issued workload certificate"
                );
                record.serial = Some(issued.serial);
                self.log.push(record);
                Ok(Response::new(IstioCertificateResponse {
                    cert_chain: issued.chain,
                }))
            }
            Err(status) => {
                tracing::warn!(
                    code = ?status.code(),
                    error = status.message(),
                    peer = ?peer,
                    "rejected CSR"
                );
                record.error = Some(format!("{:?}: {}", status.code(), status.message()));
                self.log.push(record);
                Err(status)
            }
        }
    }
}

/// `Bearer <token>` with a case-insensitive scheme (RFC 6750 §2.1, and what gRPC-Go sends).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

fn record_headers(metadata: &tonic::metadata::MetadataMap) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for kv in metadata.iter() {
        let (key, value) = match kv {
            KeyAndValueRef::Ascii(k, v) => {
                let value = if k.as_str() == "authorization" {
                    redact_authorization(v.to_str().unwrap_or(""))
                } else {
                    String::from_utf8_lossy(v.as_encoded_bytes()).into_owned()
                };
                (k.as_str().to_owned(), value)
            }
            KeyAndValueRef::Binary(k, v) => (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_encoded_bytes()).into_owned(),
            ),
        };
        out.entry(key)
            .and_modify(|s| {
                s.push_str(", ");
                s.push_str(&value);
            })
            .or_insert(value);
    }
    out
}

/// Enough to tell tokens apart in the debug log without making the log a credential store.
fn redact_authorization(value: &str) -> String {
    match bearer_token(value) {
        // Same `sha256:<16 hex>` as `auth::fingerprint`, so CSR and ADS records can be joined.
        Some(token) => format!("Bearer sha256:{}", hex_prefix(token.as_bytes(), 16)),
        None => "<redacted: not a bearer token>".into(),
    }
}

fn serialize_rfc3339<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*t))
}

/// UTC `YYYY-MM-DDTHH:MM:SS.mmmZ` (times before 1970 clamp to the epoch).
pub(crate) fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, sod) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days, for days since 1970-01-01 (non-negative here).
    let z = days as i64 + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60,
        d.subsec_millis()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};
    use meshagent_proto::google::protobuf as pb;
    use x509_parser::extensions::{GeneralName, ParsedExtension};

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
        let key =
            KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048).unwrap();
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
        let lifetime =
            leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
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
}
