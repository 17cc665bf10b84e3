//! Workload keys and CSRs (Istio `security/pkg/pki/util/generate_csr.go`).
//!
//! Keys are generated with aws-lc (through rcgen) and exported in the PEM type Istio writes:
//! PKCS#1 `RSA PRIVATE KEY`, SEC1 `EC PRIVATE KEY` (with the curve parameters, as Go's
//! `x509.MarshalECPrivateKey`), or PKCS#8 `PRIVATE KEY` with `PKCS8_KEY=true`. Envoy accepts all
//! three. The CSR is the one Istio's `GenCSRTemplate` makes, byte for byte in its structure
//! (checked against the real pilot-agent's by `tests/compat_identity.rs`): a subject of one
//! empty Organization (`O=""` as a PrintableString: `pkix.Name{Organization: []string{""}}`)
//! and a single URI SAN in a critical extension (`BuildSubjectAltNameExtension`).

use std::fmt;

use aws_lc_rs::encoding::AsDer;
use rcgen::{
    CertificateParams, CustomExtension, DistinguishedName, DnType, DnValue, KeyPair, RsaKeySize,
};

use crate::config::{EccCurve, IdentityConfig};

#[derive(Debug, Clone, thiserror::Error)]
pub enum KeyError {
    /// One message for every size refused: Istio's minimum (2048) and the sizes aws-lc
    /// generates are the same answer to the operator.
    #[error(
        "unsupported WORKLOAD_RSA_KEY_SIZE {0}: expected 2048, 3072 or 4096 (this build generates 2048, 3072 or 4096-bit keys; Istio requires at least 2048)"
    )]
    RsaSize(i64),
    /// Istio fails each CSR with it (`security/pkg/pki/util/generate_csr.go` `GenCSR`:
    /// "unsupported EC signature algorithm"), not the start; so does the agent
    /// ([`KeySpec::from_config`] callers defer it to key generation).
    #[error(
        "unsupported ECC_SIGNATURE_ALGORITHM {0:?}: expected ECDSA, or unset for RSA keys (WORKLOAD_RSA_KEY_SIZE)"
    )]
    EcAlgorithm(String),
    #[error("key generation failed: {0}")]
    Generate(String),
    #[error("CSR for {san} failed: {reason}")]
    Csr { san: String, reason: String },
}

/// Which key to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    Rsa(u32),
    EcdsaP256,
    EcdsaP384,
}

/// Key type and PEM encoding, from `WORKLOAD_RSA_KEY_SIZE`, `ECC_*` and `PKCS8_KEY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeySpec {
    pub kind: KeyKind,
    pub pkcs8: bool,
}

impl KeySpec {
    /// Istio's choice (`GenCSR`): any `ECC_SIGNATURE_ALGORITHM` selects EC keys and only
    /// `ECDSA` is one; unset, RSA of `WORKLOAD_RSA_KEY_SIZE` bits.
    pub fn from_config(id: &IdentityConfig) -> Result<KeySpec, KeyError> {
        let kind = match id.ecc_signature_algorithm.as_str() {
            "ECDSA" => match id.ecc_curve {
                EccCurve::P256 => KeyKind::EcdsaP256,
                EccCurve::P384 => KeyKind::EcdsaP384,
            },
            "" => {
                let bits = id.workload_rsa_key_size;
                let checked = u32::try_from(bits).map_err(|_| KeyError::RsaSize(bits))?;
                rsa_size(checked)?;
                KeyKind::Rsa(checked)
            }
            other => return Err(KeyError::EcAlgorithm(other.to_owned())),
        };
        Ok(KeySpec {
            kind,
            pkcs8: id.pkcs8_key,
        })
    }
}

fn rsa_size(bits: u32) -> Result<RsaKeySize, KeyError> {
    match bits {
        2048 => Ok(RsaKeySize::_2048),
        3072 => Ok(RsaKeySize::_3072),
        4096 => Ok(RsaKeySize::_4096),
        other => Err(KeyError::RsaSize(i64::from(other))),
    }
}

/// A generated private key. `Debug` never shows key material.
pub struct WorkloadKey {
    pair: KeyPair,
    /// The private key PEM as Istio would write it.
    pem: String,
}

impl fmt::Debug for WorkloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkloadKey")
            .field("algorithm", self.pair.algorithm())
            .finish_non_exhaustive()
    }
}

impl WorkloadKey {
    /// Generates a key. RSA generation takes tens to hundreds of milliseconds, so callers run
    /// this on a blocking thread ahead of need.
    pub fn generate(spec: KeySpec) -> Result<WorkloadKey, KeyError> {
        let err = |e: rcgen::Error| KeyError::Generate(e.to_string());
        let pair = match spec.kind {
            KeyKind::Rsa(bits) => {
                KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rsa_size(bits)?).map_err(err)?
            }
            KeyKind::EcdsaP256 => {
                KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(err)?
            }
            KeyKind::EcdsaP384 => {
                KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).map_err(err)?
            }
        };
        let pkcs8 = pair.serialized_der();
        let pem = if spec.pkcs8 {
            pem_encode("PRIVATE KEY", pkcs8)
        } else {
            match spec.kind {
                KeyKind::Rsa(_) => pem_encode("RSA PRIVATE KEY", &pkcs8_inner_key(pkcs8)?),
                KeyKind::EcdsaP256 | KeyKind::EcdsaP384 => {
                    pem_encode("EC PRIVATE KEY", &sec1_with_params(spec.kind, pkcs8)?)
                }
            }
        };
        Ok(WorkloadKey { pair, pem })
    }

    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A PEM CSR with the subject `O=""` and one critical URI SAN `san`, as Istio's.
    pub fn csr(&self, san: &str) -> Result<String, KeyError> {
        let fail = |reason: String| KeyError::Csr {
            san: san.to_owned(),
            reason,
        };
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(
            DnType::OrganizationName,
            DnValue::PrintableString(
                "".try_into()
                    .map_err(|e: rcgen::Error| fail(e.to_string()))?,
            ),
        );
        // rcgen marks its own SAN extension critical only under an empty subject (RFC 5280
        // §4.2.1.6); Istio's is critical under `O=""`, so the extension is written here:
        // GeneralNames with one uniformResourceIdentifier [6] IA5String.
        if !san.is_ascii() {
            return Err(fail("a URI SAN must be ASCII (IA5String)".into()));
        }
        let names = yasna::construct_der(|w| {
            w.write_sequence(|w| {
                w.next()
                    .write_tagged_implicit(yasna::Tag::context(6), |w| w.write_ia5_string(san));
            });
        });
        let mut ext = CustomExtension::from_oid_content(&[2, 5, 29, 17], names);
        ext.set_criticality(true);
        params.custom_extensions = vec![ext];
        params
            .serialize_request(&self.pair)
            .and_then(|c| c.pem())
            .map_err(|e| fail(e.to_string()))
    }
}

/// SEC1 `ECPrivateKey` including the curve OID (aws-lc's RFC 5915 encoder), so the
/// `EC PRIVATE KEY` PEM stands alone like Go's.
fn sec1_with_params(kind: KeyKind, pkcs8: &[u8]) -> Result<Vec<u8>, KeyError> {
    let alg = match kind {
        KeyKind::EcdsaP384 => &aws_lc_rs::signature::ECDSA_P384_SHA384_ASN1_SIGNING,
        _ => &aws_lc_rs::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
    };
    let pair = aws_lc_rs::signature::EcdsaKeyPair::from_pkcs8(alg, pkcs8)
        .map_err(|e| KeyError::Generate(format!("re-reading EC key: {e}")))?;
    let der = pair
        .private_key()
        .as_der()
        .map_err(|e| KeyError::Generate(format!("encoding SEC1 key: {e}")))?;
    Ok(der.as_ref().to_vec())
}

/// The `privateKey` OCTET STRING of a PKCS#8 `PrivateKeyInfo`: for RSA that is exactly the
/// PKCS#1 `RSAPrivateKey`.
fn pkcs8_inner_key(pkcs8: &[u8]) -> Result<Vec<u8>, KeyError> {
    let bad = || KeyError::Generate("unexpected PKCS#8 structure".into());
    let (tag, body, _) = der_tlv(pkcs8).ok_or_else(bad)?;
    if tag != 0x30 {
        return Err(bad());
    }
    // version INTEGER, algorithm SEQUENCE, privateKey OCTET STRING
    let (t1, _, rest) = der_tlv(body).ok_or_else(bad)?;
    let (t2, _, rest) = der_tlv(rest).ok_or_else(bad)?;
    let (t3, key, _) = der_tlv(rest).ok_or_else(bad)?;
    if (t1, t2, t3) != (0x02, 0x30, 0x04) {
        return Err(bad());
    }
    Ok(key.to_vec())
}

/// One DER TLV: (tag, contents, rest).
fn der_tlv(data: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = data.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

pub(crate) fn pem_encode(label: &str, der: &[u8]) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::PublicKeyData as _;
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateSigningRequestDer, PrivateKeyDer};
    use x509_parser::prelude::*;

    fn spec(kind: KeyKind, pkcs8: bool) -> KeySpec {
        KeySpec { kind, pkcs8 }
    }

    #[test]
    fn pem_types_as_istio() {
        for (kind, pkcs8, label) in [
            (KeyKind::Rsa(2048), false, "RSA PRIVATE KEY"),
            (KeyKind::EcdsaP256, false, "EC PRIVATE KEY"),
            (KeyKind::EcdsaP384, false, "EC PRIVATE KEY"),
            (KeyKind::EcdsaP256, true, "PRIVATE KEY"),
            (KeyKind::Rsa(2048), true, "PRIVATE KEY"),
        ] {
            let k = WorkloadKey::generate(spec(kind, pkcs8)).unwrap();
            assert!(
                k.pem().starts_with(&format!("-----BEGIN {label}-----\n")),
                "{kind:?}"
            );
            // The PEM parses back as the expected DER kind and matches the key's public half.
            let der = PrivateKeyDer::from_pem_slice(k.pem().as_bytes()).unwrap();
            match (pkcs8, kind) {
                (true, _) => assert!(matches!(der, PrivateKeyDer::Pkcs8(_))),
                (false, KeyKind::Rsa(_)) => assert!(matches!(der, PrivateKeyDer::Pkcs1(_))),
                (false, _) => assert!(matches!(der, PrivateKeyDer::Sec1(_))),
            }
            let signer = rustls::crypto::aws_lc_rs::sign::any_supported_type(&der).unwrap();
            let spki = signer.public_key().unwrap();
            assert_eq!(spki.as_ref(), k.pair.subject_public_key_info().as_slice());
            assert!(!format!("{k:?}").contains("BEGIN"));
        }
    }

    #[test]
    fn csr_has_istios_subject_and_one_critical_uri_san() {
        let san = "spiffe://cluster.local/ns/default/sa/a";
        for kind in [KeyKind::EcdsaP256, KeyKind::Rsa(2048)] {
            let k = WorkloadKey::generate(spec(kind, false)).unwrap();
            let pem = k.csr(san).unwrap();
            assert!(pem.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
            let der = CertificateSigningRequestDer::from_pem_slice(pem.as_bytes()).unwrap();
            let (_, csr) = X509CertificationRequest::from_der(der.as_ref()).unwrap();
            csr.verify_signature().unwrap();
            // SEQUENCE { SET { SEQUENCE { id-at-organizationName, PrintableString "" } } }: the
            // bytes of the real pilot-agent's CSR subject (tests/compat_identity.rs).
            assert_eq!(
                csr.certification_request_info.subject.as_raw(),
                [
                    0x30, 0x0b, 0x31, 0x09, 0x30, 0x07, 0x06, 0x03, 0x55, 0x04, 0x0a, 0x13, 0x00
                ]
            );
            let exts: Vec<_> = csr.requested_extensions().into_iter().flatten().collect();
            assert_eq!(exts.len(), 1, "{exts:?}");
            let ParsedExtension::SubjectAlternativeName(s) = exts[0] else {
                panic!("not a SAN: {:?}", exts[0]);
            };
            assert_eq!(s.general_names, vec![GeneralName::URI(san)]);
            // criticality is on the raw extension
            let raw = csr
                .certification_request_info
                .iter_attributes()
                .find_map(|a| match a.parsed_attribute() {
                    ParsedCriAttribute::ExtensionRequest(e) => Some(e.extensions.clone()),
                    _ => None,
                })
                .unwrap();
            assert!(raw[0].critical);
        }
    }

    #[test]
    fn rsa_sizes() {
        assert!(rsa_size(2048).is_ok());
        assert!(rsa_size(4096).is_ok());
        assert!(matches!(rsa_size(2049), Err(KeyError::RsaSize(2049))));
    }
}
