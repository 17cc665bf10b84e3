//! The SSRF guard: the ranges a guarded connection ([`super::connect::Guarded`]) refuses,
//! checked **after** name resolution against each address about to be dialled, so every
//! connection of a Wasm fetch (first request, each redirect, OCI registries, blob hosts and
//! token realms) is covered. Istio master `pkg/security/dial.go` `BlockedIPDialContext`
//! (PR #61112) blocks link-local, the Alibaba metadata address `100.100.100.200/32`, AWS's
//! IPv6 metadata range `fd00:ec2::/32` and `BLOCKED_CIDRS_IN_WASM_FETCH`; private and
//! loopback ranges are deliberately allowed.

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
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ResolveError {
    #[error("cannot resolve {0}: {1}")]
    Dns(String, String),
    #[error(transparent)]
    Guard(#[from] GuardError),
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
}
