//! Caller authentication for the xDS port, as istiod does it: a bearer JWT it trusts, or a client
//! certificate issued by its CA (VMs using `PROV_CERT`).

use std::sync::Arc;
use std::time::SystemTime;

use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::conn::ConnInfo;
use crate::token::TokenIssuer;

#[derive(Clone)]
pub struct Auth {
    tokens: Arc<TokenIssuer>,
    trust_domain: String,
}

/// Who the caller is, as far as it could be established.
#[derive(Debug, Default, Clone)]
pub struct Authn {
    /// SPIFFE ID (from a client certificate) or `spiffe://<td>/ns/<ns>/sa/<sa>` from a token.
    pub identity: Option<String>,
    pub token_fingerprint: Option<String>,
}

impl Auth {
    pub fn new(tokens: Arc<TokenIssuer>, trust_domain: impl Into<String>) -> Auth {
        Auth {
            tokens,
            trust_domain: trust_domain.into(),
        }
    }

    /// With `required`, a caller without valid credentials is refused with `Unauthenticated`;
    /// without it (the plaintext port, like istiod's 15010) credentials are only recorded.
    pub fn authenticate(
        &self,
        md: &MetadataMap,
        conn: Option<&ConnInfo>,
        required: bool,
    ) -> Result<Authn, Status> {
        let mut out = Authn::default();
        if let Some(v) = md.get("authorization") {
            let v = v.to_str().unwrap_or_default();
            let token = v
                .split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, t)| t.trim());
            match token {
                Some(t) => {
                    out.token_fingerprint = Some(fingerprint(t));
                    match self.tokens.verify(t, SystemTime::now()) {
                        Ok(id) => {
                            out.identity = Some(format!(
                                "spiffe://{}/ns/{}/sa/{}",
                                self.trust_domain, id.namespace, id.service_account
                            ));
                            return Ok(out);
                        }
                        Err(e) if required => {
                            return Err(Status::unauthenticated(format!(
                                "authentication failure: {e}"
                            )));
                        }
                        Err(e) => {
                            tracing::info!(error = %e, "ignoring invalid token on plaintext port")
                        }
                    }
                }
                None if required => {
                    return Err(Status::unauthenticated(
                        "authentication failure: authorization header is not \"Bearer <token>\"",
                    ));
                }
                None => {}
            }
        }
        if let Some(certs) = conn.and_then(|c| c.peer_certs.as_ref())
            && let Some(leaf) = certs.first()
            && let Some(id) = spiffe_id(leaf.as_ref())
        {
            out.identity = Some(id);
            return Ok(out);
        }
        if required {
            return Err(Status::unauthenticated(
                "authentication failure: no bearer token and no client certificate",
            ));
        }
        Ok(out)
    }
}

/// `sha256:<16 hex>`: lets tests compare tokens without devplane ever echoing one.
pub fn fingerprint(token: &str) -> String {
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, token.as_bytes());
    let hex: String = d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

fn spiffe_id(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let san = cert.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        x509_parser::extensions::GeneralName::URI(u) if u.starts_with("spiffe://") => {
            Some((*u).to_owned())
        }
        _ => None,
    })
}
