//! System facts: IPv6 from the interface addresses, DNS servers from resolv.conf.
#![allow(
    clippy::disallowed_methods,
    reason = "istio-iptables runs synchronously as its own command; no runtime is serving"
)]

use super::*;

impl Config {
    /// The system facts Istio's `constructConfig` gathers: IPv6 from the first non-loopback
    /// interface address, DNS servers from resolv.conf when DNS capture needs them.
    pub fn detect(&mut self, resolv_conf: &str) -> Result<(), DetectError> {
        self.enable_ipv6 = detect_ipv6(self.dual_stack)?;
        if self.redirect_dns && !self.capture_all_dns {
            let text =
                std::fs::read_to_string(resolv_conf).map_err(|e| DetectError::ResolvConf {
                    path: resolv_conf.to_owned(),
                    error: e,
                })?;
            let (v4, v6) = resolv_conf_servers(&text);
            self.dns_servers_v4 = v4;
            self.dns_servers_v6 = v6;
        }
        Ok(())
    }
}

/// A failure to gather system facts.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    #[error("cannot list interface addresses: {0}")]
    Addresses(nix::Error),
    #[error("no valid local IP address found (needed to decide between IPv4 and IPv6 rules)")]
    NoAddress,
    #[error("failed to load {path}: {error}")]
    ResolvConf { path: String, error: std::io::Error },
}

/// Istio cmd `getLocalIP`: the first address that is not loopback or link-local decides;
/// with dual stack, any IPv6 address among them enables IPv6.
pub(super) fn detect_ipv6(dual_stack: bool) -> Result<bool, DetectError> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(DetectError::Addresses)?;
    let mut found = false;
    for ifa in addrs {
        let Some(addr) = ifa.address else { continue };
        let ip: IpAddr = if let Some(a) = addr.as_sockaddr_in() {
            IpAddr::V4(a.ip())
        } else if let Some(a) = addr.as_sockaddr_in6() {
            let ip = a.ip();
            match ip.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(ip),
            }
        } else {
            continue;
        };
        let link_local = match ip {
            IpAddr::V4(a) => a.is_link_local(),
            IpAddr::V6(a) => (a.segments()[0] & 0xffc0) == 0xfe80,
        };
        let ll_multicast = match ip {
            IpAddr::V4(a) => a.octets()[0] == 224 && a.octets()[1] == 0 && a.octets()[2] == 0,
            IpAddr::V6(a) => (a.segments()[0] & 0xff0f) == 0xff02,
        };
        if ip.is_loopback() || link_local || ll_multicast {
            continue;
        }
        found = true;
        if !dual_stack || ip.is_ipv6() {
            return Ok(ip.is_ipv6());
        }
    }
    if found {
        Ok(false)
    } else {
        Err(DetectError::NoAddress)
    }
}

/// `nameserver` lines of resolv.conf ([`crate::net::resolv`]), split into v4 and v6 as
/// written there, zone removed (Istio uses miekg/dns `ClientConfigFromFile`, then
/// `IPsSplitV4V6`); an IPv4-mapped IPv6 address counts as the IPv4 address.
pub fn resolv_conf_servers(text: &str) -> (Vec<String>, Vec<String>) {
    let parsed = crate::net::resolv::ResolvConf::parse(text);
    for s in &parsed.skipped {
        tracing::warn!("ignoring unparseable nameserver {s:?} in resolv.conf");
    }
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for n in parsed.nameservers {
        match n.ip {
            IpAddr::V4(_) => v4.push(n.written),
            IpAddr::V6(ip) => match ip.to_ipv4_mapped() {
                Some(m) => v4.push(m.to_string()),
                None => v6.push(n.written),
            },
        }
    }
    (v4, v6)
}
