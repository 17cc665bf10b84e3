//! Kubernetes-style projected service-account tokens (ES256 JWTs).
//!
//! istiod authenticates CA callers with the pod's projected token (audience `istio-ca`), checked
//! by the Kubernetes TokenReview API. devplane has no apiserver, so it is both the issuer (the
//! `token` subcommand writes what would be `/var/run/secrets/tokens/istio-token`) and the
//! verifier. Tokens look like real projected tokens so the agent code path is the same.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_lc_rs::digest;
use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{
    self, ECDSA_P256_SHA256_FIXED, ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair as _,
};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Issuer claim of in-cluster Kubernetes service-account tokens.
pub const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";
/// Audience the agent's projected token carries and istiod requires.
pub const AUDIENCE: &str = "istio-ca";
/// Clock-skew allowance on `exp`/`nbf`, as the Kubernetes apiserver allows.
pub const LEEWAY: Duration = Duration::from_secs(60);
/// Larger inputs are rejected before any decoding, so a hostile caller can't make us allocate.
pub const MAX_TOKEN_LEN: usize = 16 * 1024;

const SUBJECT_PREFIX: &str = "system:serviceaccount:";

/// The authenticated caller: who a verified token says it is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Identity {
    pub namespace: String,
    pub service_account: String,
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.service_account)
    }
}

/// Why a token was rejected. Messages never include the token itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("malformed token: {0}")]
    Malformed(&'static str),
    #[error("unsupported token algorithm {0:?} (want ES256)")]
    UnsupportedAlgorithm(String),
    #[error("token signature does not verify with the devplane signing key")]
    BadSignature,
    #[error("token expired at {exp} (unix seconds; now {now})")]
    Expired { exp: u64, now: u64 },
    #[error("token not valid before {nbf} (unix seconds; now {now})")]
    NotYetValid { nbf: u64, now: u64 },
    #[error("token audience {found:?} does not include {AUDIENCE:?}")]
    WrongAudience { found: Vec<String> },
    #[error("token subject {0:?} is not system:serviceaccount:<namespace>:<name>")]
    BadSubject(String),
    #[error("cannot issue token: {0}")]
    Issue(String),
}

/// Invalid key material handed to [`TokenIssuer::from_pkcs8`].
#[derive(Debug, thiserror::Error)]
#[error("invalid ECDSA P-256 PKCS#8 JWT signing key: {0}")]
pub struct KeyError(String);

/// Signs and verifies devplane's projected-style tokens. Cheap to clone.
#[derive(Clone)]
pub struct TokenIssuer {
    inner: Arc<Inner>,
}

struct Inner {
    key: EcdsaKeyPair,
    kid: String,
    rng: SystemRandom,
}

impl std::fmt::Debug for TokenIssuer {
    // Hand-written so the private key can never end up in a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenIssuer")
            .field("kid", &self.inner.kid)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Header {
    alg: Option<String>,
}

#[derive(Deserialize)]
struct Claims {
    sub: Option<String>,
    #[serde(default)]
    aud: Audience,
    exp: Option<f64>,
    nbf: Option<f64>,
}

/// RFC 7519 allows `aud` to be a single string or an array.
#[derive(Deserialize, Default)]
#[serde(untagged)]
enum Audience {
    #[default]
    None,
    One(String),
    Many(Vec<String>),
}

impl Audience {
    fn into_vec(self) -> Vec<String> {
        match self {
            Audience::None => Vec::new(),
            Audience::One(a) => vec![a],
            Audience::Many(v) => v,
        }
    }
}

// === impl TokenIssuer ===

impl TokenIssuer {
    /// Builds an issuer from a PKCS#8 (`PRIVATE KEY`) ECDSA P-256 key.
    pub fn from_pkcs8(pkcs8_der: &[u8]) -> Result<Self, KeyError> {
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8_der)
            .map_err(|e| KeyError(e.to_string()))?;
        let kid = hex_prefix(key.public_key().as_ref(), 16);
        Ok(Self {
            inner: Arc::new(Inner {
                key,
                kid,
                rng: SystemRandom::new(),
            }),
        })
    }

    /// Stable key id (`kid` header): first 16 hex digits of SHA-256 of the public key.
    pub fn key_id(&self) -> &str {
        &self.inner.kid
    }

    /// Issues a token for `system:serviceaccount:<namespace>:<service_account>` valid for `ttl`
    /// from now.
    pub fn issue(
        &self,
        namespace: &str,
        service_account: &str,
        ttl: Duration,
    ) -> Result<String, TokenError> {
        self.issue_at(namespace, service_account, ttl, SystemTime::now())
    }

    /// [`issue`](Self::issue) with an explicit clock, for tests and reproducible tokens.
    pub fn issue_at(
        &self,
        namespace: &str,
        service_account: &str,
        ttl: Duration,
        now: SystemTime,
    ) -> Result<String, TokenError> {
        if !valid_name(namespace) || !valid_name(service_account) {
            return Err(TokenError::Issue(format!(
                "namespace {namespace:?} and service account {service_account:?} must be \
                 non-empty and contain no ':' or whitespace"
            )));
        }
        let iat = unix_secs(now);
        let exp = iat.saturating_add(ttl.as_secs());
        let header = json!({"alg": "ES256", "kid": self.inner.kid, "typ": "JWT"});
        let claims = json!({
            "aud": [AUDIENCE],
            "exp": exp,
            "iat": iat,
            "iss": ISSUER,
            "kubernetes.io": {
                "namespace": namespace,
                "serviceaccount": {"name": service_account, "uid": self.random_uuid()?},
            },
            "nbf": iat,
            "sub": format!("{SUBJECT_PREFIX}{namespace}:{service_account}"),
        });
        let signing_input = format!(
            "{}.{}",
            URL_SAFE_NO_PAD.encode(header.to_string()),
            URL_SAFE_NO_PAD.encode(claims.to_string())
        );
        let sig = self
            .inner
            .key
            .sign(&self.inner.rng, signing_input.as_bytes())
            .map_err(|e| TokenError::Issue(format!("signing failed: {e}")))?;
        Ok(format!(
            "{signing_input}.{}",
            URL_SAFE_NO_PAD.encode(sig.as_ref())
        ))
    }

    /// Verifies a token issued by this key and returns the identity it carries.
    ///
    /// The signature is checked before any claim is trusted, so claim errors are only reported
    /// for tokens we issued.
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Identity, TokenError> {
        if token.len() > MAX_TOKEN_LEN {
            return Err(TokenError::Malformed("token longer than 16 KiB"));
        }
        let token = token.trim();
        let mut parts = token.split('.');
        let (Some(h64), Some(c64), Some(s64), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(TokenError::Malformed(
                "want three dot-separated base64url parts",
            ));
        };
        let header: Header = decode_json(h64, "header")?;
        match header.alg.as_deref() {
            Some("ES256") => {}
            Some(other) => return Err(TokenError::UnsupportedAlgorithm(other.to_owned())),
            None => return Err(TokenError::Malformed("header has no alg")),
        }
        let sig = URL_SAFE_NO_PAD
            .decode(s64)
            .map_err(|_| TokenError::Malformed("signature is not base64url"))?;
        let signing_input_len = h64.len() + 1 + c64.len();
        let signing_input = token
            .get(..signing_input_len)
            .ok_or(TokenError::Malformed("truncated"))?;
        signature::UnparsedPublicKey::new(
            &ECDSA_P256_SHA256_FIXED,
            self.inner.key.public_key().as_ref(),
        )
        .verify(signing_input.as_bytes(), &sig)
        .map_err(|_| TokenError::BadSignature)?;

        let claims: Claims = decode_json(c64, "claims")?;
        let now_s = unix_secs(now);
        let exp = claims
            .exp
            .ok_or(TokenError::Malformed("claims have no exp"))?;
        let exp = secs_claim(exp, "exp")?;
        if now_s > exp.saturating_add(LEEWAY.as_secs()) {
            return Err(TokenError::Expired { exp, now: now_s });
        }
        if let Some(nbf) = claims.nbf {
            let nbf = secs_claim(nbf, "nbf")?;
            if nbf > now_s.saturating_add(LEEWAY.as_secs()) {
                return Err(TokenError::NotYetValid { nbf, now: now_s });
            }
        }
        let aud = claims.aud.into_vec();
        if !aud.iter().any(|a| a == AUDIENCE) {
            return Err(TokenError::WrongAudience { found: aud });
        }
        let sub = claims.sub.unwrap_or_default();
        parse_subject(&sub).ok_or(TokenError::BadSubject(sub))
    }

    fn random_uuid(&self) -> Result<String, TokenError> {
        let mut b = [0u8; 16];
        aws_lc_rs::rand::SecureRandom::fill(&self.inner.rng, &mut b)
            .map_err(|_| TokenError::Issue("random source failed".into()))?;
        // Shape it as a v4 UUID like the apiserver's object UIDs.
        b[6] = (b[6] & 0x0f) | 0x40;
        b[8] = (b[8] & 0x3f) | 0x80;
        let h = hex(&b);
        Ok(format!(
            "{}-{}-{}-{}-{}",
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        ))
    }
}

fn decode_json<T: serde::de::DeserializeOwned>(
    part: &str,
    what: &'static str,
) -> Result<T, TokenError> {
    let bytes = URL_SAFE_NO_PAD.decode(part).map_err(|_| {
        TokenError::Malformed(if what == "header" {
            "header is not base64url"
        } else {
            "claims are not base64url"
        })
    })?;
    serde_json::from_slice(&bytes).map_err(|_| {
        TokenError::Malformed(if what == "header" {
            "header is not a JSON object"
        } else {
            "claims are not a valid JSON object"
        })
    })
}

fn secs_claim(v: f64, what: &'static str) -> Result<u64, TokenError> {
    // NumericDate may be fractional; negative/NaN/huge values are nonsense, not a wrap-around.
    if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
        return Err(TokenError::Malformed(if what == "exp" {
            "exp is not a valid NumericDate"
        } else {
            "nbf is not a valid NumericDate"
        }));
    }
    Ok(v as u64)
}

fn parse_subject(sub: &str) -> Option<Identity> {
    let rest = sub.strip_prefix(SUBJECT_PREFIX)?;
    let (ns, sa) = rest.split_once(':')?;
    (valid_name(ns) && valid_name(sa)).then(|| Identity {
        namespace: ns.to_owned(),
        service_account: sa.to_owned(),
    })
}

/// Loose on purpose (Kubernetes names are DNS labels/subdomains); strict enough that the values
/// can't smuggle structure into the SPIFFE URI or the `sub` claim.
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// First `n` hex digits of SHA-256(`data`): a short, stable, non-reversible fingerprint.
pub(crate) fn hex_prefix(data: &[u8], n: usize) -> String {
    let mut h = hex(digest::digest(&digest::SHA256, data).as_ref());
    h.truncate(n);
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issuer() -> TokenIssuer {
        let rng = SystemRandom::new();
        let doc = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
        TokenIssuer::from_pkcs8(doc.as_ref()).unwrap()
    }

    fn b64json(v: serde_json::Value) -> String {
        URL_SAFE_NO_PAD.encode(v.to_string())
    }

    /// Re-signs arbitrary header/claims with the issuer's key, to reach the claim checks.
    fn sign_raw(iss: &TokenIssuer, header: serde_json::Value, claims: serde_json::Value) -> String {
        let input = format!("{}.{}", b64json(header), b64json(claims));
        let sig = iss
            .inner
            .key
            .sign(&iss.inner.rng, input.as_bytes())
            .unwrap();
        format!("{input}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
    }

    #[test]
    fn round_trip() {
        let iss = issuer();
        let now = SystemTime::now();
        let tok = iss
            .issue_at("default", "sleep", Duration::from_secs(3600), now)
            .unwrap();
        let id = iss.verify(&tok, now).unwrap();
        assert_eq!(
            id,
            Identity {
                namespace: "default".into(),
                service_account: "sleep".into()
            }
        );
        // Looks like a projected token.
        let mut parts = tok.split('.');
        let header: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts.next().unwrap()).unwrap())
                .unwrap();
        assert_eq!(header["alg"], "ES256");
        assert_eq!(header["typ"], "JWT");
        assert_eq!(header["kid"], iss.key_id());
        assert_eq!(iss.key_id().len(), 16);
        let claims: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts.next().unwrap()).unwrap())
                .unwrap();
        assert_eq!(claims["iss"], ISSUER);
        assert_eq!(claims["sub"], "system:serviceaccount:default:sleep");
        assert_eq!(claims["aud"], json!(["istio-ca"]));
        assert_eq!(claims["kubernetes.io"]["namespace"], "default");
        assert_eq!(claims["kubernetes.io"]["serviceaccount"]["name"], "sleep");
        assert_eq!(
            claims["kubernetes.io"]["serviceaccount"]["uid"]
                .as_str()
                .unwrap()
                .len(),
            36
        );
        let exp = claims["exp"].as_u64().unwrap();
        assert_eq!(exp - claims["iat"].as_u64().unwrap(), 3600);
    }

    #[test]
    fn forged_token_is_bad_signature() {
        let ours = issuer();
        let theirs = issuer();
        let tok = theirs
            .issue("default", "sleep", Duration::from_secs(600))
            .unwrap();
        assert_eq!(
            ours.verify(&tok, SystemTime::now()),
            Err(TokenError::BadSignature)
        );
        // Claims swapped into a genuine token's envelope.
        let good = ours
            .issue("default", "sleep", Duration::from_secs(600))
            .unwrap();
        let mut p: Vec<&str> = good.split('.').collect();
        let evil = b64json(json!({"sub": "system:serviceaccount:kube-system:admin",
            "aud": ["istio-ca"], "exp": 9_999_999_999u64}));
        p[1] = &evil;
        assert_eq!(
            ours.verify(&p.join("."), SystemTime::now()),
            Err(TokenError::BadSignature)
        );
    }

    #[test]
    fn expired_and_not_yet_valid() {
        let iss = issuer();
        let t0 = SystemTime::now();
        let tok = iss
            .issue_at("ns", "sa", Duration::from_secs(600), t0)
            .unwrap();
        // Within leeway.
        assert!(iss.verify(&tok, t0 + Duration::from_secs(650)).is_ok());
        assert!(iss.verify(&tok, t0 - Duration::from_secs(30)).is_ok());
        assert!(matches!(
            iss.verify(&tok, t0 + Duration::from_secs(700)),
            Err(TokenError::Expired { .. })
        ));
        assert!(matches!(
            iss.verify(&tok, t0 - Duration::from_secs(120)),
            Err(TokenError::NotYetValid { .. })
        ));
    }

    #[test]
    fn wrong_audience_and_subject() {
        let iss = issuer();
        let now = SystemTime::now();
        let exp = unix_secs(now) + 600;
        let h = json!({"alg": "ES256", "typ": "JWT"});
        let tok = sign_raw(
            &iss,
            h.clone(),
            json!({"sub": "system:serviceaccount:a:b", "aud": ["kubernetes"], "exp": exp}),
        );
        assert_eq!(
            iss.verify(&tok, now),
            Err(TokenError::WrongAudience {
                found: vec!["kubernetes".into()]
            })
        );
        // Single-string aud is valid JWT.
        let tok = sign_raw(
            &iss,
            h.clone(),
            json!({"sub": "system:serviceaccount:a:b", "aud": "istio-ca", "exp": exp}),
        );
        assert!(iss.verify(&tok, now).is_ok());
        let tok = sign_raw(&iss, h.clone(), json!({"aud": ["istio-ca"], "exp": exp}));
        assert_eq!(
            iss.verify(&tok, now),
            Err(TokenError::BadSubject(String::new()))
        );
        for sub in [
            "system:serviceaccount:a",
            "system:serviceaccount:a:b:c",
            "user:alice",
            "system:serviceaccount::b",
            "system:serviceaccount:a/x:b",
        ] {
            let tok = sign_raw(
                &iss,
                h.clone(),
                json!({"sub": sub, "aud": ["istio-ca"], "exp": exp}),
            );
            assert_eq!(
                iss.verify(&tok, now),
                Err(TokenError::BadSubject(sub.into())),
                "{sub}"
            );
        }
        let tok = sign_raw(
            &iss,
            json!({"alg": "HS256"}),
            json!({"sub": "system:serviceaccount:a:b", "aud": ["istio-ca"], "exp": exp}),
        );
        assert_eq!(
            iss.verify(&tok, now),
            Err(TokenError::UnsupportedAlgorithm("HS256".into()))
        );
        let tok = sign_raw(
            &iss,
            h,
            json!({"sub": "system:serviceaccount:a:b", "aud": ["istio-ca"]}),
        );
        assert!(matches!(
            iss.verify(&tok, now),
            Err(TokenError::Malformed(_))
        ));
    }

    #[test]
    fn garbage_never_panics() {
        let iss = issuer();
        let now = SystemTime::now();
        let big = "a".repeat(MAX_TOKEN_LEN + 1);
        for input in [
            "",
            ".",
            "..",
            "...",
            "a.b.c",
            "a.b.c.d",
            "é.ü.ß",
            "eyJhbGciOiJFUzI1NiJ9..",
            "eyJhbGciOiJFUzI1NiJ9.e30.AAAA",
            "bnVsbA.bnVsbA.AAAA",
            big.as_str(),
        ] {
            let r = iss.verify(input, now);
            assert!(
                matches!(
                    r,
                    Err(TokenError::Malformed(_)) | Err(TokenError::BadSignature)
                ),
                "{input:.40}: {r:?}"
            );
        }
    }

    #[test]
    fn issue_rejects_bad_names() {
        let iss = issuer();
        for (ns, sa) in [("", "sa"), ("ns", ""), ("a:b", "sa"), ("ns", "s a")] {
            assert!(iss.issue(ns, sa, Duration::from_secs(60)).is_err());
        }
    }
}
