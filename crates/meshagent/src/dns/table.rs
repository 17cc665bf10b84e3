//! The lookup table built from an NDS name table, with Istio's expansion and lookup rules
//! (`pkg/dns/client/dns.go`: `buildNameTable`, `generateAltHosts`, `buildDNSAnswers`,
//! `lookupHost`).
//!
//! Every key is a lower-cased absolute name ending in `.`. An entry holds the addresses of one
//! name, or a CNAME to another key (the first-search-domain expansion).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use rand::seq::SliceRandom;

use super::NameTable;

/// TTL of every synthesized record (Istio's `defaultTTLInSeconds`).
pub const TTL: u32 = 30;

/// Where a proxy is: decides the short-name expansions.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    /// The proxy's namespace (`POD_NAMESPACE`).
    pub namespace: String,
    /// The proxy's domain (`--domain`, e.g. `ns.svc.cluster.local`).
    pub domain: String,
    /// The resolv.conf `search` list; only the first entry is used.
    pub search: Vec<String>,
}

#[derive(Debug)]
struct Entry {
    name: Name,
    v4: Vec<Ipv4Addr>,
    v6: Vec<Ipv6Addr>,
    /// Set on a search-domain expansion: the key it points at.
    cname: Option<(Name, Arc<str>)>,
}

/// A built table; immutable, swapped whole when a new NDS table arrives.
#[derive(Debug, Default)]
pub struct LookupTable {
    hosts: HashMap<Arc<str>, Entry>,
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// The name is not in the table (or the type is not A/AAAA): forward upstream.
    NotFound,
    /// Answer locally, authoritatively, NOERROR — possibly with no records.
    Answer(Vec<Record>),
}

impl LookupTable {
    pub fn build(nt: &NameTable, scope: &Scope) -> LookupTable {
        // `NewLocalDNSServer`: the proxy domain without its leading namespace label.
        let mut parts: Vec<&str> = scope.domain.split('.').filter(|s| !s.is_empty()).collect();
        if parts.first() == Some(&scope.namespace.as_str()) {
            parts.remove(0);
        }
        let proxy_domain = parts.join(".");
        let search0 = scope.search.first().map(|s| {
            let s = s.to_ascii_lowercase();
            if s.ends_with('.') { s } else { format!("{s}.") }
        });
        let mut t = LookupTable::default();
        for (hostname, ni) in &nt.table {
            let mut v4 = Vec::new();
            let mut v6 = Vec::new();
            for ip in &ni.ips {
                match ip.parse::<IpAddr>() {
                    Ok(IpAddr::V4(a)) => v4.push(a),
                    Ok(IpAddr::V6(a)) => v6.push(a),
                    Err(_) => {}
                }
            }
            if v4.is_empty() && v6.is_empty() {
                continue;
            }
            let mut alt: Vec<String> = vec![format!("{hostname}.")];
            if ni.registry == "Kubernetes" {
                alt_hosts(hostname, ni, scope, &proxy_domain, &parts, &mut alt);
            }
            let alt: Vec<String> = {
                let mut v: Vec<String> = alt.into_iter().map(|h| h.to_ascii_lowercase()).collect();
                v.sort();
                v.dedup();
                v
            };
            for h in &alt {
                let Ok(name) = Name::from_ascii(h) else {
                    continue;
                };
                let key: Arc<str> = Arc::from(h.as_str());
                // Istio keeps CNAMEs in their own map and consults it first: an expansion
                // wins over an address entry of the same name.
                if t.hosts.get(h.as_str()).is_none_or(|e| e.cname.is_none()) {
                    t.hosts.insert(
                        key.clone(),
                        Entry {
                            name: name.clone(),
                            v4: v4.clone(),
                            v6: v6.clone(),
                            cname: None,
                        },
                    );
                }
                let Some(s0) = &search0 else { continue };
                // 1.27+ (`buildDNSAnswers`): no expansion for a name already in the search
                // domain, nor when the expansion is itself one of this entry's names.
                if h.ends_with(&format!(".{s0}")) || h == s0 {
                    continue;
                }
                let expanded = format!("{h}{s0}");
                if alt.contains(&expanded) {
                    continue;
                }
                let Ok(ename) = Name::from_ascii(&expanded) else {
                    continue;
                };
                t.hosts.insert(
                    Arc::from(expanded.as_str()),
                    Entry {
                        name: ename,
                        v4: Vec::new(),
                        v6: Vec::new(),
                        cname: Some((name, key)),
                    },
                );
            }
        }
        t
    }

    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// `lookupHost`: `qname` is the lower-cased absolute question; `question` the name as
    /// asked (wildcard answers are renamed to it).
    pub fn lookup(&self, qtype: RecordType, qname: &str, question: &Name) -> Lookup {
        let mut wildcard = false;
        let mut entry = self.hosts.get(qname);
        if entry.is_none() {
            // `*.<parent>` walking up: the nearest wildcard wins, at any depth below it.
            let mut rest = qname;
            while let Some((_, parent)) = rest.split_once('.') {
                if parent.is_empty() {
                    break;
                }
                if let Some(e) = self.hosts.get(format!("*.{parent}").as_str()) {
                    entry = Some(e);
                    wildcard = true;
                    break;
                }
                rest = parent;
            }
        }
        let Some(mut e) = entry else {
            return Lookup::NotFound;
        };
        if !matches!(qtype, RecordType::A | RecordType::AAAA) {
            // Istio forwards every other type, even for mesh names.
            return Lookup::NotFound;
        }
        let mut out = Vec::new();
        let mut cname = None;
        if let Some((target, key)) = &e.cname {
            cname = Some(Record::from_rdata(
                e.name.clone(),
                TTL,
                RData::CNAME(CNAME(target.clone())),
            ));
            match self.hosts.get(key) {
                Some(t) => e = t,
                None => return Lookup::Answer(out),
            }
        }
        let mut ips: Vec<Record> = match qtype {
            RecordType::A => {
                e.v4.iter()
                    .map(|a| Record::from_rdata(e.name.clone(), TTL, RData::A(A(*a))))
                    .collect()
            }
            _ => {
                e.v6.iter()
                    .map(|a| Record::from_rdata(e.name.clone(), TTL, RData::AAAA(AAAA(*a))))
                    .collect()
            }
        };
        // Istio (`buildDNSAnswers`'s chained answer) adds the CNAME only when the target has
        // records of the asked type: otherwise NOERROR with nothing at all.
        if !ips.is_empty() {
            ips.shuffle(&mut rand::rng());
            out.extend(cname);
            out.extend(ips);
        }
        if wildcard {
            for r in &mut out {
                r.name = question.to_lowercase();
            }
        }
        Lookup::Answer(out)
    }
}

/// `generateAltHosts`: the short forms of a Kubernetes service name.
fn alt_hosts(
    hostname: &str,
    ni: &super::NameInfo,
    scope: &Scope,
    proxy_domain: &str,
    domain_parts: &[&str],
    out: &mut Vec<String>,
) {
    // Names in another domain (cluster) than the proxy's get no short names.
    if proxy_domain.is_empty() || !hostname.ends_with(proxy_domain) {
        return;
    }
    out.push(format!("{}.{}.", ni.shortname, ni.namespace));
    if scope.namespace == ni.namespace {
        out.push(format!("{}.", ni.shortname));
    }
    if let Some(first) = domain_parts.first() {
        out.push(format!("{}.{}.{first}.", ni.shortname, ni.namespace));
    }
    for a in &ni.alt_hosts {
        out.push(format!("{a}."));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::dns::NameInfo;

    fn scope() -> Scope {
        Scope {
            namespace: "ns1".into(),
            domain: "ns1.svc.cluster.local".into(),
            search: vec![
                "ns1.svc.cluster.local".into(),
                "svc.cluster.local".into(),
                "cluster.local".into(),
            ],
        }
    }

    fn k8s(ns: &str, short: &str, ips: &[&str]) -> NameInfo {
        NameInfo {
            ips: ips.iter().map(|s| s.to_string()).collect(),
            registry: "Kubernetes".into(),
            shortname: short.into(),
            namespace: ns.into(),
            alt_hosts: vec![],
        }
    }

    fn table() -> LookupTable {
        let mut nt = NameTable::default();
        nt.table.insert(
            "productpage.ns1.svc.cluster.local".into(),
            k8s("ns1", "productpage", &["10.0.0.1"]),
        );
        nt.table.insert(
            "reviews.ns2.svc.cluster.local".into(),
            k8s("ns2", "reviews", &["10.0.0.2", "fd00::2"]),
        );
        nt.table.insert(
            "*.wild.example.com".into(),
            NameInfo {
                ips: vec!["240.240.0.9".into()],
                registry: "External".into(),
                ..Default::default()
            },
        );
        nt.table.insert(
            "bad.example.com".into(),
            NameInfo {
                ips: vec!["not-an-ip".into()],
                ..Default::default()
            },
        );
        LookupTable::build(&nt, &scope())
    }

    fn ask(t: &LookupTable, q: &str, ty: RecordType) -> Option<Vec<String>> {
        let name = Name::from_ascii(q).unwrap();
        match t.lookup(ty, &q.to_ascii_lowercase(), &name) {
            Lookup::NotFound => None,
            Lookup::Answer(rs) => Some(
                rs.iter()
                    .map(|r| format!("{} {}", r.name, r.data))
                    .collect(),
            ),
        }
    }

    #[test]
    fn expansions_follow_istio() {
        let t = table();
        let a = |q| ask(&t, q, RecordType::A);
        let pp = Some(vec![
            "productpage.ns1.svc.cluster.local. 10.0.0.1".to_owned(),
        ]);
        assert_eq!(a("productpage.ns1.svc.cluster.local."), pp);
        assert_eq!(
            a("productpage.ns1."),
            Some(vec!["productpage.ns1. 10.0.0.1".to_owned()])
        );
        assert_eq!(
            a("productpage."),
            Some(vec!["productpage. 10.0.0.1".to_owned()])
        );
        assert_eq!(
            a("productpage.ns1.svc."),
            Some(vec!["productpage.ns1.svc. 10.0.0.1".to_owned()])
        );
        // Another namespace: no bare short name.
        assert!(a("reviews.").is_none());
        assert!(a("reviews.ns2.").is_some());
        // The first search domain's CNAME chain.
        assert_eq!(
            a("reviews.ns2.ns1.svc.cluster.local."),
            Some(vec![
                "reviews.ns2.ns1.svc.cluster.local. reviews.ns2.".to_owned(),
                "reviews.ns2. 10.0.0.2".to_owned()
            ])
        );
        // The FQDN already ends with search[0]: no `...ns1.svc.cluster.local.ns1.svc...`.
        assert!(a("productpage.ns1.svc.cluster.local.ns1.svc.cluster.local.").is_none());
        // Case-insensitive.
        assert_eq!(a("ProductPage.NS1.svc.cluster.local."), pp);
        // Unparseable-only entries are skipped.
        assert!(a("bad.example.com.").is_none());
    }

    #[test]
    fn families_wildcards_and_other_types() {
        let t = table();
        // AAAA on a v4-only name: known, no answers.
        assert_eq!(
            ask(&t, "productpage.ns1.svc.cluster.local.", RecordType::AAAA),
            Some(vec![])
        );
        // And through the CNAME: no CNAME either (Istio), while A gets the chain.
        assert_eq!(
            ask(
                &t,
                "productpage.ns1.ns1.svc.cluster.local.",
                RecordType::AAAA
            ),
            Some(vec![])
        );
        assert_eq!(
            ask(&t, "productpage.ns1.ns1.svc.cluster.local.", RecordType::A).map(|v| v.len()),
            Some(2)
        );
        assert_eq!(
            ask(&t, "reviews.ns2.svc.cluster.local.", RecordType::AAAA),
            Some(vec!["reviews.ns2.svc.cluster.local. fd00::2".to_owned()])
        );
        // Wildcards at any depth, renamed to the question.
        assert_eq!(
            ask(&t, "a.b.wild.example.com.", RecordType::A),
            Some(vec!["a.b.wild.example.com. 240.240.0.9".to_owned()])
        );
        assert!(ask(&t, "wild.example.com.", RecordType::A).is_none());
        // Other types are forwarded.
        assert!(ask(&t, "productpage.ns1.svc.cluster.local.", RecordType::TXT).is_none());
    }

    #[test]
    fn non_kubernetes_and_other_domains_get_no_short_names() {
        let mut nt = NameTable::default();
        nt.table.insert(
            "db.ns1.svc.other.local".into(),
            k8s("ns1", "db", &["10.1.1.1"]),
        );
        nt.table.insert(
            "api.example.com".into(),
            NameInfo {
                ips: vec!["240.240.0.1".into()],
                registry: "External".into(),
                shortname: "api".into(),
                namespace: "ns1".into(),
                alt_hosts: vec![],
            },
        );
        let mut with_alt = k8s("ns1", "svc", &["10.2.2.2"]);
        with_alt.alt_hosts = vec!["svc.ns1.svc.cluster".into()];
        nt.table
            .insert("svc.ns1.svc.cluster.local".into(), with_alt);
        let t = LookupTable::build(&nt, &scope());
        assert!(ask(&t, "db.ns1.", RecordType::A).is_none());
        assert!(ask(&t, "db.ns1.svc.other.local.", RecordType::A).is_some());
        assert!(ask(&t, "api.", RecordType::A).is_none());
        assert!(ask(&t, "api.example.com.ns1.svc.cluster.local.", RecordType::A).is_some());
        assert!(ask(&t, "svc.ns1.svc.cluster.", RecordType::A).is_some());
    }
}
