//! The lookup table built from an NDS name table, with Istio's expansion and lookup rules
//! (`pkg/dns/client/dns.go`: `buildNameTable`, `generateAltHosts`, `buildDNSAnswers`,
//! `lookupHost`).
//!
//! Every key is a lower-cased absolute name ending in `.`, mapped to the addresses of the NDS
//! host it names. Istio also stores one CNAME per name for the first search domain
//! (`<name>.<search[0]>` → `<name>`); here those are derived at lookup time (strip the suffix,
//! find the rest), which halves the table and gives the same answers, precedence included: a
//! derived CNAME wins over an address entry of the same name, as Istio consults its CNAME map
//! first.
//!
//! Layout: every key's text in one string, a vector of 16-byte keys sorted by hash (binary
//! search, then a text compare), and the addresses in two shared vectors. A 5,000-name table
//! (~15,000 keys) is ~0.6 MiB; the earlier `HashMap<Arc<str>, Entry>` of hickory `Name`s with
//! one stored CNAME entry per name held ~30,000 entries of ~240 B, i.e. a 65,536-bucket
//! table of ~16 MiB (estimated from the types; BENCHMARKS.md, DNS proxy).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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

/// One name: its text in [`LookupTable::text`], and the host it names.
#[derive(Debug, Clone, Copy)]
struct Key {
    hash: u32,
    start: u32,
    host: u32,
    len: u16,
}

/// One NDS host's addresses: ranges of [`LookupTable::v4`] and [`LookupTable::v6`].
#[derive(Debug, Clone, Copy)]
struct Host {
    v4: (u32, u16),
    v6: (u32, u16),
}

/// A built table; immutable, swapped whole when a new NDS table arrives.
#[derive(Debug, Default)]
pub struct LookupTable {
    text: String,
    /// Sorted by `(hash, text)`; one key per distinct name.
    keys: Vec<Key>,
    hosts: Vec<Host>,
    v4: Vec<Ipv4Addr>,
    v6: Vec<Ipv6Addr>,
    /// The first search domain, lower-cased, absolute; empty when there is none.
    search0: String,
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// The name is not in the table (or the type is not A/AAAA): forward upstream.
    NotFound,
    /// Answer locally, authoritatively, NOERROR — possibly with no records.
    Answer(Vec<Record>),
}

/// What a name resolves to in the table.
enum Found<'a> {
    Host(u32),
    /// The first-search-domain expansion of `target` (a key of `host`).
    Cname {
        target: &'a str,
        host: u32,
    },
}

/// FNV-1a: keys are short, and the table's content comes from istiod, not from clients.
fn hash(s: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in s.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

impl LookupTable {
    pub fn build(nt: &NameTable, scope: &Scope) -> LookupTable {
        // `NewLocalDNSServer`: the proxy domain without its leading namespace label.
        let mut parts: Vec<&str> = scope.domain.split('.').filter(|s| !s.is_empty()).collect();
        if parts.first() == Some(&scope.namespace.as_str()) {
            parts.remove(0);
        }
        let proxy_domain = parts.join(".");
        let mut t = LookupTable {
            search0: scope.search.first().map_or(String::new(), |s| {
                let s = s.to_ascii_lowercase();
                if s.ends_with('.') { s } else { format!("{s}.") }
            }),
            ..LookupTable::default()
        };
        // (key, insertion order): the last host to claim a name keeps it.
        let mut keys: Vec<(Key, u32)> = Vec::new();
        let mut alt: Vec<String> = Vec::new();
        for (hostname, ni) in &nt.table {
            let (v4_start, v6_start) = (t.v4.len(), t.v6.len());
            for ip in &ni.ips {
                match ip.parse::<IpAddr>() {
                    Ok(IpAddr::V4(a)) => t.v4.push(a),
                    Ok(IpAddr::V6(a)) => t.v6.push(a),
                    Err(_) => {}
                }
            }
            let (n4, n6) = (t.v4.len() - v4_start, t.v6.len() - v6_start);
            if n4 == 0 && n6 == 0 {
                continue;
            }
            // u16 counts and u32 offsets: an NDS table is far below both.
            let (Ok(n4), Ok(n6), Ok(s4), Ok(s6), Ok(host)) = (
                u16::try_from(n4),
                u16::try_from(n6),
                u32::try_from(v4_start),
                u32::try_from(v6_start),
                u32::try_from(t.hosts.len()),
            ) else {
                t.v4.truncate(v4_start);
                t.v6.truncate(v6_start);
                continue;
            };
            t.hosts.push(Host {
                v4: (s4, n4),
                v6: (s6, n6),
            });
            alt.clear();
            alt.push(format!("{hostname}."));
            if ni.registry == "Kubernetes" {
                alt_hosts(hostname, ni, scope, &proxy_domain, &parts, &mut alt);
            }
            for h in alt.iter_mut() {
                h.make_ascii_lowercase();
            }
            alt.sort();
            alt.dedup();
            for h in &alt {
                if Name::from_ascii(h).is_err() {
                    continue;
                }
                let (Ok(start), Ok(len), Ok(order)) = (
                    u32::try_from(t.text.len()),
                    u16::try_from(h.len()),
                    u32::try_from(keys.len()),
                ) else {
                    continue;
                };
                t.text.push_str(h);
                keys.push((
                    Key {
                        hash: hash(h),
                        start,
                        host,
                        len,
                    },
                    order,
                ));
            }
        }
        let text = &t.text;
        let at = |k: &Key| &text[k.start as usize..k.start as usize + usize::from(k.len)];
        keys.sort_unstable_by(|(a, ao), (b, bo)| (a.hash, at(a), bo).cmp(&(b.hash, at(b), ao)));
        // Sorted with the latest first among equal names: keep that one.
        keys.dedup_by(|(later, _), (first, _)| later.hash == first.hash && at(later) == at(first));
        t.keys = keys.into_iter().map(|(k, _)| k).collect();
        t.keys.shrink_to_fit();
        t.text.shrink_to_fit();
        t.hosts.shrink_to_fit();
        t.v4.shrink_to_fit();
        t.v6.shrink_to_fit();
        t
    }

    /// Names in the table (without the derived search-domain CNAMEs).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn key_text(&self, k: &Key) -> &str {
        &self.text[k.start as usize..k.start as usize + usize::from(k.len)]
    }

    /// The host an exact key names.
    fn exact(&self, name: &str) -> Option<u32> {
        let h = hash(name);
        let i = self.keys.partition_point(|k| k.hash < h);
        self.keys[i..]
            .iter()
            .take_while(|k| k.hash == h)
            .find(|k| self.key_text(k) == name)
            .map(|k| k.host)
    }

    /// `name` as Istio's tables have it: first as a search-domain CNAME (`<alt><search[0]>`,
    /// for an `alt` not itself in the search domain and not when the expansion is one of the
    /// same host's own names), then as an address entry.
    fn find<'a>(&self, name: &'a str) -> Option<Found<'a>> {
        let s0 = self.search0.as_str();
        if !s0.is_empty()
            && let Some(target) = name.strip_suffix(s0)
            && target.len() > 1
            && target.ends_with('.')
            && target != s0
            && !in_domain(target, s0)
            && let Some(host) = self.exact(target)
            && self.exact(name) != Some(host)
        {
            return Some(Found::Cname { target, host });
        }
        self.exact(name).map(Found::Host)
    }

    /// `lookupHost`: `qname` is the lower-cased absolute question; `question` the name as
    /// asked (wildcard answers are renamed to it).
    pub fn lookup(&self, qtype: RecordType, qname: &str, question: &Name) -> Lookup {
        let wild: String;
        let (owner, found, wildcard) = match self.find(qname) {
            Some(f) => (qname, f, false),
            None => {
                // `*.<parent>` walking up: the nearest wildcard wins, at any depth below it.
                let mut rest = qname;
                let mut hit = None;
                while let Some((_, parent)) = rest.split_once('.') {
                    if parent.is_empty() {
                        break;
                    }
                    let w = format!("*.{parent}");
                    if self.find(&w).is_some() {
                        hit = Some(w);
                        break;
                    }
                    rest = parent;
                }
                let Some(w) = hit else {
                    return Lookup::NotFound;
                };
                wild = w;
                match self.find(&wild) {
                    Some(f) => (wild.as_str(), f, true),
                    None => return Lookup::NotFound,
                }
            }
        };
        if !matches!(qtype, RecordType::A | RecordType::AAAA) {
            // Istio forwards every other type, even for mesh names.
            return Lookup::NotFound;
        }
        // Keys were checked to be names when the table was built.
        let name = |s: &str| Name::from_ascii(s).unwrap_or_else(|_| question.to_lowercase());
        let (host, cname, addr_owner) = match found {
            Found::Host(h) => (h, None, name(owner)),
            Found::Cname { target, host } => {
                let t = name(target);
                let c = Record::from_rdata(name(owner), TTL, RData::CNAME(CNAME(t.clone())));
                (host, Some(c), t)
            }
        };
        let h = self.hosts[host as usize];
        let mut ips: Vec<Record> = match qtype {
            RecordType::A => self.v4[h.v4.0 as usize..][..usize::from(h.v4.1)]
                .iter()
                .map(|a| Record::from_rdata(addr_owner.clone(), TTL, RData::A(A(*a))))
                .collect(),
            _ => self.v6[h.v6.0 as usize..][..usize::from(h.v6.1)]
                .iter()
                .map(|a| Record::from_rdata(addr_owner.clone(), TTL, RData::AAAA(AAAA(*a))))
                .collect(),
        };
        let mut out = Vec::new();
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

/// `name` ends with `.<domain>` (both absolute, lower-case).
fn in_domain(name: &str, domain: &str) -> bool {
    name.len() > domain.len()
        && name.ends_with(domain)
        && name.as_bytes()[name.len() - domain.len() - 1] == b'.'
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
    fn derived_search_domain_cname_wins_over_an_address_entry() {
        // Istio consults its CNAME map before its address map: a host that happens to be
        // spelled like another host's search-domain expansion is answered with the CNAME.
        let ext = |ip: &str| NameInfo {
            ips: vec![ip.into()],
            registry: "External".into(),
            ..Default::default()
        };
        let mut nt = NameTable::default();
        nt.table.insert("x.example.com".into(), ext("240.240.0.1"));
        nt.table.insert(
            "x.example.com.ns1.svc.cluster.local".into(),
            ext("240.240.0.2"),
        );
        let t = LookupTable::build(&nt, &scope());
        assert_eq!(
            ask(&t, "x.example.com.ns1.svc.cluster.local.", RecordType::A),
            Some(vec![
                "x.example.com.ns1.svc.cluster.local. x.example.com.".to_owned(),
                "x.example.com. 240.240.0.1".to_owned()
            ])
        );
        // Without a search list there is no expansion: the address entry answers.
        let t = LookupTable::build(
            &nt,
            &Scope {
                search: vec![],
                ..scope()
            },
        );
        assert_eq!(
            ask(&t, "x.example.com.ns1.svc.cluster.local.", RecordType::A),
            Some(vec![
                "x.example.com.ns1.svc.cluster.local. 240.240.0.2".to_owned()
            ])
        );
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
