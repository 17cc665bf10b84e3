//! The `authorization` header: parsing the bearer token, and reducing it to a fingerprint
//! before request headers reach the debug log.

use std::collections::BTreeMap;

use tonic::metadata::KeyAndValueRef;

use crate::token::hex_prefix;

/// `Bearer <token>` with a case-insensitive scheme (RFC 6750 §2.1, and what gRPC-Go sends).
pub(super) fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

pub(super) fn record_headers(metadata: &tonic::metadata::MetadataMap) -> BTreeMap<String, String> {
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
