//! The signer: a root loaded from PEM, and the leaf it issues for an authenticated identity.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData as _, SanType, SerialNumber,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateSigningRequestDer};
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::prelude::FromDer;

use super::{BACKDATE, CaError, DEFAULT_CERT_TTL, DEFAULT_TRUST_DOMAIN, MAX_CERT_TTL, MAX_CSR_LEN};
use crate::token::{Identity, hex};

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
