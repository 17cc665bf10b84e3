//! Bearer realms (OCI token endpoints) get the stricter check of Istio's
//! `ssrfProtectionTransport` (`pkg/wasm/ociimage.go`, PR #58969), with go-containerregistry
//! v0.21.6's exception for a realm on the registry's own host and port. Every address a Wasm
//! fetch dials is checked by the guarded connector (`net::connect::Guarded`).

use std::net::IpAddr;

pub use crate::net::guard::{Guard, GuardError, ResolveError};

/// Istio `pkg/wasm/ociimage.go` `validateBearerRealm`: a realm must be http(s) with a host
/// that is neither `localhost`, `metadata.google.internal`, nor a private, loopback or
/// link-local IP literal. A realm on the registry's own `host:port` is allowed
/// (go-containerregistry #2302). Hostnames that resolve to blocked addresses are caught at
/// dial time by [`Guard::check`].
pub fn check_realm(realm: &str, registry_authority: &str) -> Result<(), GuardError> {
    let bad = |why| GuardError::UnsafeRealm {
        realm: realm.to_owned(),
        why,
    };
    let uri: http::Uri = realm.parse().map_err(|_| bad("not a URL"))?;
    let scheme = uri.scheme_str().unwrap_or_default();
    if scheme != "http" && scheme != "https" {
        return Err(bad("scheme is not http or https"));
    }
    let Some(auth) = uri.authority() else {
        return Err(bad("empty host"));
    };
    let default_port = if scheme == "https" { 443 } else { 80 };
    let same = |a: &str| {
        let (h, p) = split_authority(a, default_port);
        let (rh, rp) = split_authority(registry_authority, default_port);
        h.eq_ignore_ascii_case(&rh) && p == rp
    };
    if same(auth.as_str()) {
        return Ok(());
    }
    let host = auth.host().trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    if host.eq_ignore_ascii_case("localhost") {
        return Err(bad("localhost"));
    }
    if host.eq_ignore_ascii_case("metadata.google.internal") {
        return Err(bad("metadata host"));
    }
    if let Ok(ip) = host.parse::<IpAddr>() {
        let ip = ip.to_canonical();
        let private = match ip {
            IpAddr::V4(v4) => v4.is_private() || v4.is_loopback() || v4.is_link_local(),
            IpAddr::V6(v6) => {
                v6.is_loopback()
                    || (v6.segments()[0] & 0xfe00) == 0xfc00
                    || (v6.segments()[0] & 0xffc0) == 0xfe80
            }
        };
        if private {
            return Err(bad("private, loopback or link-local address"));
        }
    }
    Ok(())
}

/// `host` and port of an authority, with the scheme's default port.
fn split_authority(a: &str, default_port: u16) -> (String, u16) {
    if let Some(rest) = a.strip_prefix('[') {
        if let Some((h, p)) = rest.split_once("]:") {
            return (h.to_owned(), p.parse().unwrap_or(default_port));
        }
        return (rest.trim_end_matches(']').to_owned(), default_port);
    }
    match a.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h.to_owned(), p.parse().unwrap_or(default_port)),
        _ => (a.to_owned(), default_port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_realms() {
        let reg = "registry.example:5000";
        for ok in [
            "https://auth.example/token",
            "http://registry.example:5000/token",
            "https://8.8.8.8/token",
        ] {
            check_realm(ok, reg).unwrap();
        }
        for bad in [
            "ftp://auth.example/token",
            "https://localhost/token",
            "https://metadata.google.internal/computeMetadata",
            "http://169.254.169.254/latest",
            "http://127.0.0.1:9000/token",
            "http://10.1.2.3/token",
            "http://[::1]/token",
            "/token",
        ] {
            let e = check_realm(bad, reg).unwrap_err();
            assert!(
                e.to_string().starts_with("rejected unsafe bearer realm"),
                "{e}"
            );
        }
    }
}
