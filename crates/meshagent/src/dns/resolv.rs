//! resolv.conf: the upstream servers (`nameserver`, port 53) and the `search` list, as Istio
//! reads them (`pkg/dns/client/dns.go` `NewLocalDNSServer`, miekg's `ClientConfigFromFile`).

use std::net::{IpAddr, SocketAddr};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvConf {
    pub servers: Vec<SocketAddr>,
    pub search: Vec<String>,
}

impl ResolvConf {
    /// Parses the text; unknown lines and unparseable addresses are ignored, as libc does.
    pub fn parse(text: &str) -> ResolvConf {
        let mut out = ResolvConf::default();
        for line in text.lines() {
            let line = line.split(['#', ';']).next().unwrap_or("");
            let mut words = line.split_whitespace();
            match words.next() {
                Some("nameserver") => {
                    // A scoped IPv6 address (`fe80::1%eth0`) keeps only the address part.
                    if let Some(ip) = words
                        .next()
                        .and_then(|w| w.split('%').next())
                        .and_then(|w| w.parse::<IpAddr>().ok())
                    {
                        out.servers.push(SocketAddr::new(ip, 53));
                    }
                }
                // The last `search` (or `domain`) line wins.
                Some("search") => out.search = words.map(str::to_owned).collect(),
                Some("domain") => out.search = words.take(1).map(str::to_owned).collect(),
                _ => {}
            }
        }
        out
    }

    pub fn has_v4(&self) -> bool {
        self.servers.iter().any(|s| s.is_ipv4())
    }

    pub fn has_v6(&self) -> bool {
        self.servers.iter().any(|s| s.is_ipv6())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_and_search() {
        let r = ResolvConf::parse(
            "# kubelet\nnameserver 10.96.0.10\nnameserver fd00::a # v6\nnameserver bogus\n\
             search ns1.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n",
        );
        assert_eq!(
            r.servers,
            vec![
                "10.96.0.10:53".parse().unwrap_or_else(|_| unreachable!()),
                "[fd00::a]:53".parse().unwrap_or_else(|_| unreachable!())
            ]
        );
        assert_eq!(r.search.len(), 3);
        assert!(r.has_v4() && r.has_v6());
        assert_eq!(ResolvConf::parse("").servers, vec![]);
    }
}
