//! Checks a certificate chain from the CA before it is served. Istio's agent serves whatever
//! `CreateCertificate` returns (`security/pkg/nodeagent/cache/secretcache.go`
//! `generateNewSecret` only parses the leaf's expiry), so a CA that returns an expired leaf, a
//! leaf for another workload or a chain that does not verify leaves Envoy with a certificate
//! that fails every handshake — while the pod reports ready. Here such a response is a CA
//! failure: backoff, `num_failed_outgoing_requests`, and the last good certificate kept.

use std::time::{Duration, SystemTime};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};

/// Clock skew tolerated on the leaf's `NotBefore` (istiod backdates by a minute or two;
/// nodes' clocks drift).
const NOT_BEFORE_SKEW: Duration = Duration::from_secs(5 * 60);

/// What a verified chain carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    /// The leaf's `NotAfter`.
    pub expiry: SystemTime,
    /// The leaf's SPIFFE URI SAN (the identity actually issued).
    pub spiffe_id: String,
}

/// Verifies `chain` (leaf first, root last, each a PEM string) at `now` for `requested`:
/// the leaf is currently valid, chains to the returned root, and carries the requested
/// identity's namespace and service account. The trust domain may differ (istiod issues its
/// own, whatever the agent's `TRUST_DOMAIN`): that is logged, not refused. When the request
/// itself has no namespace or service account, istiod takes the identity from the token alone,
/// so any issued identity is accepted.
pub fn verify_chain(chain: &[String], requested: &str, now: SystemTime) -> Result<Issued, String> {
    let ders: Vec<CertificateDer<'static>> = chain
        .iter()
        .map(|pem| {
            CertificateDer::from_pem_slice(pem.as_bytes())
                .map_err(|e| format!("certificate chain entry is not a PEM certificate: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let (leaf, rest) = ders.split_first().ok_or("empty certificate chain")?;
    let root = rest.last().ok_or("certificate chain has no root")?;
    let intermediates = &rest[..rest.len() - 1];

    let (_, parsed) = x509_parser::parse_x509_certificate(leaf.as_ref())
        .map_err(|e| format!("leaf certificate: {e}"))?;
    let secs = |t: i64| SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(t).unwrap_or(0));
    let not_before = secs(parsed.validity().not_before.timestamp());
    let expiry = secs(parsed.validity().not_after.timestamp());
    if expiry <= now {
        return Err(format!(
            "the CA issued a certificate that has already expired (NotAfter {})",
            parsed.validity().not_after
        ));
    }
    if not_before > now + NOT_BEFORE_SKEW {
        return Err(format!(
            "the CA issued a certificate that is not valid yet (NotBefore {})",
            parsed.validity().not_before
        ));
    }
    let spiffe_id = parsed
        .subject_alternative_name()
        .ok()
        .flatten()
        .and_then(|san| {
            san.value.general_names.iter().find_map(|n| match n {
                x509_parser::extensions::GeneralName::URI(u) if u.starts_with("spiffe://") => {
                    Some((*u).to_owned())
                }
                _ => None,
            })
        })
        .ok_or("the CA issued a certificate without a SPIFFE URI SAN")?;
    if let Some(want) = workload_path(requested)
        && workload_path(&spiffe_id) != Some(want)
    {
        return Err(format!(
            "the CA issued a certificate for {spiffe_id}, not for the requested {requested}"
        ));
    }

    // The chain must verify up to the root the CA returned (at `now`, with the validity of
    // every link; as a client certificate, which Istio's workload certificates all are).
    let anchor = webpki::anchor_from_trusted_cert(root)
        .map_err(|e| format!("the CA's root certificate is unusable: {e:?}"))?;
    let ee =
        webpki::EndEntityCert::try_from(leaf).map_err(|e| format!("leaf certificate: {e:?}"))?;
    let time = UnixTime::since_unix_epoch(
        now.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            // webpki has no skew allowance; give NotBefore the same slack as above.
            .max(
                not_before
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default(),
            ),
    );
    let algs = rustls::crypto::aws_lc_rs::default_provider()
        .signature_verification_algorithms
        .all;
    ee.verify_for_usage(
        algs,
        &[anchor],
        intermediates,
        time,
        webpki::KeyUsage::client_auth(),
        None,
        None,
    )
    .map_err(|e| format!("the certificate chain from the CA does not verify: {e:?}"))?;
    Ok(Issued { expiry, spiffe_id })
}

/// `ns/<ns>/sa/<sa>` of a SPIFFE ID, when both are non-empty.
fn workload_path(id: &str) -> Option<&str> {
    let rest = id.strip_prefix("spiffe://")?;
    let (_, path) = rest.split_once('/')?;
    let mut parts = path.split('/');
    match (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) {
        (Some("ns"), Some(ns), Some("sa"), Some(sa), None) if !ns.is_empty() && !sa.is_empty() => {
            Some(path)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SanType};

    struct Ca {
        key: KeyPair,
        cert: rcgen::Certificate,
        params: CertificateParams,
    }

    fn ca() -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        Ca { key, cert, params }
    }

    fn leaf(ca: &Ca, id: &str, days: (i64, i64)) -> String {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.subject_alt_names = vec![SanType::URI(id.try_into().unwrap())];
        p.is_ca = IsCa::ExplicitNoCa;
        p.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let day = |n: i64| {
            let d = Duration::from_secs(86400 * n.unsigned_abs());
            if n < 0 {
                SystemTime::now() - d
            } else {
                SystemTime::now() + d
            }
        };
        p.not_before = day(days.0).into();
        p.not_after = day(days.1).into();
        let issuer = rcgen::Issuer::from_params(&ca.params, &ca.key);
        p.signed_by(&key, &issuer).unwrap().pem()
    }

    const ID: &str = "spiffe://cluster.local/ns/default/sa/a";

    #[test]
    fn a_good_chain_verifies() {
        let ca = ca();
        let chain = vec![leaf(&ca, ID, (-1, 1)), ca.cert.pem()];
        let got = verify_chain(&chain, ID, SystemTime::now()).unwrap();
        assert_eq!(got.spiffe_id, ID);
        // Another trust domain for the same workload is istiod's choice, not an error.
        let other_td = "spiffe://example.org/ns/default/sa/a";
        let chain = vec![leaf(&ca, other_td, (-1, 1)), ca.cert.pem()];
        assert_eq!(
            verify_chain(&chain, ID, SystemTime::now())
                .unwrap()
                .spiffe_id,
            other_td
        );
    }

    #[test]
    fn expired_wrong_identity_and_foreign_roots_are_refused() {
        let ca = ca();
        let now = SystemTime::now();
        let e = verify_chain(&[leaf(&ca, ID, (-3, -1)), ca.cert.pem()], ID, now).unwrap_err();
        assert!(e.contains("already expired"), "{e}");
        let e = verify_chain(&[leaf(&ca, ID, (2, 3)), ca.cert.pem()], ID, now).unwrap_err();
        assert!(e.contains("not valid yet"), "{e}");
        let other = "spiffe://cluster.local/ns/default/sa/b";
        let e = verify_chain(&[leaf(&ca, other, (-1, 1)), ca.cert.pem()], ID, now).unwrap_err();
        assert!(e.contains("not for the requested"), "{e}");
        let stranger = self::ca();
        let e = verify_chain(&[leaf(&ca, ID, (-1, 1)), stranger.cert.pem()], ID, now).unwrap_err();
        assert!(e.contains("does not verify"), "{e}");
    }

    #[test]
    fn an_incomplete_request_accepts_the_tokens_identity() {
        let ca = ca();
        let chain = vec![leaf(&ca, ID, (-1, 1)), ca.cert.pem()];
        let got = verify_chain(&chain, "spiffe://cluster.local/ns//sa/", SystemTime::now());
        assert_eq!(got.unwrap().spiffe_id, ID);
    }
}
