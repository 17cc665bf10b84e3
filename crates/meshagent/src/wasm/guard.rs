//! The SSRF guard of Wasm fetches: every connection (first request, each redirect, OCI
//! registries, blob hosts and token realms) is checked **after** name resolution, against
//! the address that is about to be dialled. Istio master `pkg/security/dial.go`
//! `BlockedIPDialContext` (PR #61112) blocks link-local, the Alibaba metadata address
//! `100.100.100.200/32`, AWS's IPv6 metadata range `fd00:ec2::/32` and
//! `BLOCKED_CIDRS_IN_WASM_FETCH`; private and loopback ranges are deliberately allowed.
//! Bearer realms (OCI token endpoints) get the stricter check of Istio's
//! `ssrfProtectionTransport` (`pkg/wasm/ociimage.go`, PR #58969), with go-containerregistry
//! v0.21.6's exception for a realm on the registry's own host and port.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

/// Ranges refused for every Wasm connection, whatever the configuration.
const ALWAYS_BLOCKED: [&str; 4] = [
    "169.254.0.0/16",
    "fe80::/10",
    "100.100.100.200/32",
    "fd00:ec2::/32",
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GuardError {
    #[error("connection blocked: resolved IP {ip} is in blocked range {net}")]
    Blocked { ip: IpAddr, net: IpNet },
    #[error("rejected unsafe bearer realm: {realm}: {why}")]
    UnsafeRealm { realm: String, why: &'static str },
}

/// The blocked ranges: Istio's fixed ones plus `BLOCKED_CIDRS_IN_WASM_FETCH`.
#[derive(Debug, Clone)]
pub struct Guard {
    blocked: Vec<IpNet>,
}

impl Guard {
    /// `extra` are CIDRs validated at config load (`config::vars::WasmConfig`); a bare
    /// address is taken as a host route, as Istio's parser does.
    pub fn new(extra: &[String]) -> Result<Guard, String> {
        let mut blocked = Vec::new();
        for s in ALWAYS_BLOCKED
            .iter()
            .copied()
            .chain(extra.iter().map(String::as_str))
        {
            let s = s.trim();
            let net = s
                .parse::<IpNet>()
                .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| format!("BLOCKED_CIDRS_IN_WASM_FETCH: {s:?} is not a CIDR"))?;
            blocked.push(net);
        }
        Ok(Guard { blocked })
    }

    /// Refuses an address about to be dialled. IPv4-mapped IPv6 addresses are checked as the
    /// IPv4 address they reach.
    pub fn check(&self, addr: SocketAddr) -> Result<(), GuardError> {
        let ip = addr.ip().to_canonical();
        match self.blocked.iter().find(|n| n.contains(&ip)) {
            Some(net) => Err(GuardError::Blocked { ip, net: *net }),
            None => Ok(()),
        }
    }

    /// Resolves `host:port` and returns the addresses that may be dialled, in resolver order.
    /// All blocked: the first refusal is the error.
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, ResolveError> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((host, port))
                .await
                .map_err(|e| ResolveError::Dns(host.to_owned(), e.to_string()))?
                .collect(),
        };
        let mut first_refusal = None;
        let mut ok = Vec::new();
        for a in addrs {
            match self.check(a) {
                Ok(()) => ok.push(a),
                Err(e) => {
                    first_refusal.get_or_insert(e);
                }
            }
        }
        match (ok.is_empty(), first_refusal) {
            (true, Some(e)) => Err(ResolveError::Guard(e)),
            (true, None) => Err(ResolveError::Dns(host.to_owned(), "no addresses".into())),
            _ => Ok(ok),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ResolveError {
    #[error("cannot resolve {0}: {1}")]
    Dns(String, String),
    #[error(transparent)]
    Guard(#[from] GuardError),
}

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
    fn fixed_and_configured_ranges_are_blocked() {
        let g = Guard::new(&["127.0.0.9/32".to_owned()]).unwrap();
        for a in [
            "169.254.169.254:80",
            "[fe80::1]:80",
            "100.100.100.200:80",
            "[fd00:ec2::254]:80",
            "[::ffff:169.254.169.254]:80",
            "127.0.0.9:8080",
        ] {
            let a: SocketAddr = a.parse().unwrap();
            let e = g.check(a).unwrap_err();
            assert!(
                e.to_string().starts_with("connection blocked: resolved IP"),
                "{e}"
            );
        }
        for a in [
            "127.0.0.1:80",
            "10.0.0.1:443",
            "100.100.100.201:80",
            "[::1]:80",
        ] {
            g.check(a.parse().unwrap()).unwrap();
        }
    }

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
