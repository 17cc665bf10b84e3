//! The one resolv.conf parser: name servers, the search list and `ndots`, read as glibc's
//! `res_init` reads them (`resolv/res_init.c`): `#` and `;` start comments, unknown lines are
//! skipped, the last `search` or `domain` line wins, unparseable addresses are skipped.
//! Its readers: the DNS proxy's upstreams and search list (Istio `pkg/dns/client/dns.go`,
//! miekg's `ClientConfigFromFile`), the iptables DNS capture rules
//! (`tools/istio-iptables/pkg/capture/run.go`) and the GKE zone (`pkg/bootstrap/platform/gcp.go`).

use std::net::{IpAddr, SocketAddr};

/// A `nameserver` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nameserver {
    pub ip: IpAddr,
    /// The address as written, without the zone (`fe80::1` of `fe80::1%eth0`).
    pub written: String,
    /// The zone of a scoped IPv6 address (`eth0` of `fe80::1%eth0`).
    pub zone: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvConf {
    pub nameservers: Vec<Nameserver>,
    /// The search list of the last `search` (or `domain`) line.
    pub search: Vec<String>,
    /// `options ndots:N` (glibc caps it at 15); `None` when absent.
    pub ndots: Option<u8>,
    /// `nameserver` values that are not addresses, for callers that warn about them.
    pub skipped: Vec<String>,
}

impl ResolvConf {
    /// Parses the text; never fails (a bad line is skipped, as libc does).
    pub fn parse(text: &str) -> ResolvConf {
        let mut out = ResolvConf::default();
        for line in text.lines() {
            let line = line.split(['#', ';']).next().unwrap_or("");
            let mut words = line.split_whitespace();
            match words.next() {
                Some("nameserver") => {
                    let Some(w) = words.next() else { continue };
                    let (addr, zone) = match w.split_once('%') {
                        Some((a, z)) => (a, Some(z.to_owned())),
                        None => (w, None),
                    };
                    match addr.parse::<IpAddr>() {
                        Ok(ip) => out.nameservers.push(Nameserver {
                            ip,
                            written: addr.to_owned(),
                            zone: zone.filter(|_| ip.is_ipv6()),
                        }),
                        Err(_) => out.skipped.push(w.to_owned()),
                    }
                }
                Some("search") => out.search = words.map(str::to_owned).collect(),
                Some("domain") => out.search = words.take(1).map(str::to_owned).collect(),
                Some("options") => {
                    for o in words {
                        if let Some(n) = o.strip_prefix("ndots:") {
                            // glibc: atoi, capped at RES_MAXNDOTS (15).
                            if let Ok(n) = n.parse::<u32>() {
                                out.ndots = Some(n.min(15) as u8);
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// The name servers on port 53.
    pub fn servers(&self) -> Vec<SocketAddr> {
        self.nameservers
            .iter()
            .map(|n| SocketAddr::new(n.ip, 53))
            .collect()
    }

    pub fn has_v4(&self) -> bool {
        self.nameservers.iter().any(|n| n.ip.is_ipv4())
    }

    pub fn has_v6(&self) -> bool {
        self.nameservers.iter().any(|n| n.ip.is_ipv6())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_unknown_lines() {
        let r = ResolvConf::parse(
            "# kubelet\n; also a comment\nnameserver 10.96.0.10 # trailing\nnameserver bogus\n\
             sortlist 10.0.0.0\nnameserver 10.96.0.11;x\n",
        );
        let ips: Vec<String> = r.nameservers.iter().map(|n| n.written.clone()).collect();
        assert_eq!(ips, ["10.96.0.10", "10.96.0.11"]);
        assert_eq!(r.skipped, ["bogus"]);
        assert!(r.has_v4() && !r.has_v6());
        assert_eq!(ResolvConf::parse(""), ResolvConf::default());
    }

    #[test]
    fn ndots_option() {
        let r = ResolvConf::parse("options timeout:2 ndots:5 attempts:3\n");
        assert_eq!(r.ndots, Some(5));
        assert_eq!(ResolvConf::parse("options ndots:99\n").ndots, Some(15));
        assert_eq!(ResolvConf::parse("options ndots:x\n").ndots, None);
        assert_eq!(ResolvConf::parse("options rotate\n").ndots, None);
    }

    #[test]
    fn last_search_line_wins() {
        let r = ResolvConf::parse("search a.local b.local\nnameserver 10.0.0.1\nsearch c.local\n");
        assert_eq!(r.search, ["c.local"]);
        let r = ResolvConf::parse("search a.local\ndomain d.local other\n");
        assert_eq!(r.search, ["d.local"]);
    }

    #[test]
    fn ipv6_with_zone() {
        let r = ResolvConf::parse("nameserver fe80::1%eth0\nnameserver fd00::a\n");
        assert_eq!(
            r.nameservers[0],
            Nameserver {
                ip: "fe80::1".parse().unwrap_or_else(|_| unreachable!()),
                written: "fe80::1".into(),
                zone: Some("eth0".into()),
            }
        );
        assert_eq!(r.nameservers[1].zone, None);
        assert_eq!(
            r.servers(),
            vec![
                "[fe80::1]:53".parse().unwrap_or_else(|_| unreachable!()),
                "[fd00::a]:53".parse().unwrap_or_else(|_| unreachable!())
            ]
        );
        assert!(r.has_v6() && !r.has_v4());
    }
}
