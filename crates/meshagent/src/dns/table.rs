//! The lookup table built from an NDS name table, with Istio's expansion and lookup rules
//! (`pkg/dns/client/dns.go`: `buildNameTable`, `generateAltHosts`, `buildDNSAnswers`,
//! `lookupHost`). It is also all the agent keeps of the NDS table: `/debug/ndsz` is rendered
//! from it ([`LookupTable::ndsz`]), so the decoded proto is dropped as soon as the table is
//! built.
//!
//! Names: every name a host answers to is a lower-cased absolute name ending in `.`; Istio
//! also stores one CNAME per name for the first search domain (`<name>.<search[0]>` →
//! `<name>`); here those are derived at lookup time (strip the suffix, find the rest), which
//! halves the table and gives the same answers, precedence included: a derived CNAME wins over
//! an address entry of the same name, as Istio consults its CNAME map first.
//!
//! Layout: a host's strings as istiod sent them (hostname; short name and namespace only when
//! they are not already inside the hostname, as they are for Kubernetes services; alt hosts;
//! its addresses only when they are not the canonical text of the parsed ones) in one byte
//! arena; one 36-byte record per host; addresses in two shared vectors. A name is an 8-byte
//! key — its hash and (host, form) — sorted by hash: a lookup is a binary search, then a
//! compare of the asked name with the form spelled from the host's strings (e.g.
//! `<shortname>.<namespace>.`), case-insensitively. A 5,000-name table is ~0.5 MiB
//! (docs/benchmarks-log.md, DNS proxy); the decoded NDS proto it replaces was ~2.3 MiB.

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
}

/// The forms of a name ([`Key::form`]); alt host `i` is `FORM_ALT + i`.
const FORM_HOST: u8 = 0;
/// `<shortname>.<namespace>.`
const FORM_SHORT_NS: u8 = 1;
/// `<shortname>.` (the proxy's own namespace)
const FORM_SHORT: u8 = 2;
/// `<shortname>.<namespace>.<first label of the proxy domain>.` (e.g. `.svc.`)
const FORM_SHORT_NS_FIRST: u8 = 3;
const FORM_ALT: u8 = 4;
/// Hosts are numbered in 24 bits, the form takes the top 8.
const HOST_BITS: u32 = 24;

/// One name: its hash, and which host and form spell it.
#[derive(Debug, Clone, Copy)]
struct Key {
    hash: u32,
    host_form: u32,
}

impl Key {
    fn host(self) -> u32 {
        self.host_form & ((1 << HOST_BITS) - 1)
    }
    fn form(self) -> u8 {
        // The top 8 bits.
        (self.host_form >> HOST_BITS) as u8
    }
}

/// One NDS host. Its strings are in `text[block..]`: the hostname first, the other offsets
/// are relative to `block`. Alt hosts and address texts are each a 2-byte little-endian
/// length and the bytes.
#[derive(Debug, Clone, Copy, Default)]
struct Host {
    block: u32,
    v4: u32,
    v6: u32,
    n4: u16,
    n6: u16,
    name_len: u16,
    short: (u16, u16),
    namespace: (u16, u16),
    /// Where the alt hosts start; the address texts follow them.
    alts: u16,
    n_alts: u16,
    /// Address texts kept verbatim; 0: the addresses are the canonical text of `v4` then
    /// `v6`, in that order (checked when built).
    n_ip_texts: u16,
    registry: u16,
}

/// A built table; immutable, swapped whole when a new NDS table arrives.
#[derive(Debug, Default)]
pub struct LookupTable {
    text: Vec<u8>,
    /// Sorted by hash; one key per distinct name.
    keys: Vec<Key>,
    /// Sorted by hostname (the order `/debug/ndsz` lists them in).
    hosts: Vec<Host>,
    v4: Vec<Ipv4Addr>,
    v6: Vec<Ipv6Addr>,
    /// Registry names (`Kubernetes`, `External`…), each once.
    registries: Vec<String>,
    /// The first label of the proxy domain without its namespace (`svc`), lower-cased.
    first: String,
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// The name is not in the table (or the type is not A/AAAA): forward upstream.
    NotFound,
    /// Answer locally, authoritatively, NOERROR — possibly with no records.
    Answer(Vec<Record>),
}

/// The table entry a name resolves to ([`LookupTable::explain`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explained {
    /// The name matched: the question itself, or the nearest `*.<parent>` wildcard.
    pub matched: String,
    pub wildcard: bool,
    /// The NDS host (as istiod sent it).
    pub host: String,
    /// Which of the host's names matched (`hostname`, `shortname`, `shortname.namespace`,
    /// `shortname.namespace.<domain label>`, `altHost`); for a search-domain CNAME, the
    /// target's.
    pub form: &'static str,
    /// Set when the name is `<target><search[0]>`: answered with a CNAME to `target`.
    pub cname_target: Option<String>,
    pub registry: String,
    pub namespace: String,
    pub v4: Vec<Ipv4Addr>,
    pub v6: Vec<Ipv6Addr>,
}

/// What [`LookupTable::lookup_addrs`] found: the addresses of the asked family (possibly
/// none: NOERROR with no answers), or a name answered with a CNAME chain (built by
/// [`LookupTable::lookup`]), or nothing (forward).
#[derive(Debug, PartialEq, Eq)]
pub enum Addrs<'a> {
    NotFound,
    Chain,
    V4(&'a [Ipv4Addr]),
    V6(&'a [Ipv6Addr]),
}

/// Room for `*.` and the longest name `Name::to_ascii` spells from a wire name (255 octets,
/// every label byte escaped as `\DDD`: under 1,024 characters).
const WILD_BUF: usize = 2 + 1024;

/// `*.<parent>` in `buf`; `None` if it does not fit (no decoded name is that long).
fn spell_wildcard<'b>(buf: &'b mut [u8; WILD_BUF], parent: &str) -> Option<&'b str> {
    let w = buf.get_mut(..2 + parent.len())?;
    w[..2].copy_from_slice(b"*.");
    w[2..].copy_from_slice(parent.as_bytes());
    std::str::from_utf8(w).ok()
}

/// What a name resolves to in the table.
enum Found<'a> {
    Host(u32),
    /// The first-search-domain expansion of `target` (a name of `host`).
    Cname {
        target: &'a str,
        host: u32,
    },
}

/// FNV-1a: keys are short, and the table's content comes from istiod, not from clients.
fn hash(s: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in s {
        h ^= u32::from(b.to_ascii_lowercase());
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// Appends `s` with its 2-byte length; `None` when it does not fit the format.
fn push_counted(text: &mut Vec<u8>, s: &str) -> Option<()> {
    let len = u16::try_from(s.len()).ok()?;
    text.extend_from_slice(&len.to_le_bytes());
    text.extend_from_slice(s.as_bytes());
    Some(())
}

/// The `n` counted strings starting at `at`.
fn counted(bytes: &[u8], mut at: usize, n: u16) -> impl Iterator<Item = &str> {
    (0..n).map_while(move |_| {
        let len = usize::from(u16::from_le_bytes([*bytes.get(at)?, *bytes.get(at + 1)?]));
        let s = std::str::from_utf8(bytes.get(at + 2..at + 2 + len)?).ok()?;
        at += 2 + len;
        Some(s)
    })
}

/// `name` equals the concatenation of `parts`, ASCII case-insensitively (`name` is
/// lower-case).
fn spells(name: &[u8], parts: &[&[u8]]) -> bool {
    if parts.iter().map(|p| p.len()).sum::<usize>() != name.len() {
        return false;
    }
    let mut at = 0;
    parts.iter().all(|p| {
        let ok = name[at..at + p.len()].eq_ignore_ascii_case(p);
        at += p.len();
        ok
    })
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
            first: parts
                .first()
                .map_or(String::new(), |s| s.to_ascii_lowercase()),
            ..LookupTable::default()
        };
        let mut hosts: Vec<(&String, &super::NameInfo)> = nt.table.iter().collect();
        hosts.sort_unstable_by(|a, b| a.0.cmp(b.0));
        // (lower-cased name, key): among equal names the last host keeps it.
        let mut keys: Vec<(String, Key)> = Vec::new();
        let mut forms: Vec<(String, u8)> = Vec::new();
        for (hostname, ni) in hosts {
            let Ok(index) = u32::try_from(t.hosts.len()) else {
                break;
            };
            if index >= 1 << HOST_BITS {
                tracing::warn!("NDS table has more than 16M hosts; the rest are ignored");
                break;
            }
            let Some(host) = t.push_host(hostname, ni) else {
                tracing::warn!(host = %hostname, "NDS host too large for the DNS table; ignored");
                continue;
            };
            if host.n4 == 0 && host.n6 == 0 {
                // Kept for /debug/ndsz; nothing to answer with.
                t.hosts.push(host);
                continue;
            }
            t.hosts.push(host);
            forms.clear();
            forms.push((format!("{hostname}."), FORM_HOST));
            if ni.registry == "Kubernetes"
                && !proxy_domain.is_empty()
                && hostname.ends_with(&proxy_domain)
            {
                // `generateAltHosts`; names in another domain (cluster) get no short names.
                forms.push((format!("{}.{}.", ni.shortname, ni.namespace), FORM_SHORT_NS));
                if scope.namespace == ni.namespace {
                    forms.push((format!("{}.", ni.shortname), FORM_SHORT));
                }
                if !t.first.is_empty() {
                    forms.push((
                        format!("{}.{}.{}.", ni.shortname, ni.namespace, t.first),
                        FORM_SHORT_NS_FIRST,
                    ));
                }
                for (i, a) in ni.alt_hosts.iter().enumerate() {
                    // Forms are 8 bits: alt hosts past the 252nd are not looked up.
                    if let Ok(i) = u8::try_from(i)
                        && let Some(form) = FORM_ALT.checked_add(i)
                    {
                        forms.push((format!("{a}."), form));
                    }
                }
            }
            for (f, _) in forms.iter_mut() {
                f.make_ascii_lowercase();
            }
            forms.sort();
            forms.dedup_by(|a, b| a.0 == b.0);
            for (f, form) in forms.drain(..) {
                if Name::from_ascii(&f).is_err() {
                    continue;
                }
                let key = Key {
                    hash: hash(f.as_bytes()),
                    host_form: index | (u32::from(form) << HOST_BITS),
                };
                keys.push((f, key));
            }
        }
        // Stable: among equal names the later host (in hostname order) stays last, and wins.
        keys.sort_by(|(a, ak), (b, bk)| (ak.hash, a).cmp(&(bk.hash, b)));
        let mut out: Vec<Key> = Vec::with_capacity(keys.len());
        for i in 0..keys.len() {
            if keys.get(i + 1).is_some_and(|next| next.0 == keys[i].0) {
                continue;
            }
            out.push(keys[i].1);
        }
        t.keys = out;
        t.text.shrink_to_fit();
        t.hosts.shrink_to_fit();
        t.v4.shrink_to_fit();
        t.v6.shrink_to_fit();
        t
    }

    /// Stores one host's strings and addresses; `None` when a count or offset does not fit.
    fn push_host(&mut self, hostname: &str, ni: &super::NameInfo) -> Option<Host> {
        let (text_start, v4_start, v6_start) = (self.text.len(), self.v4.len(), self.v6.len());
        let host = self.try_push_host(hostname, ni);
        if host.is_none() {
            self.text.truncate(text_start);
            self.v4.truncate(v4_start);
            self.v6.truncate(v6_start);
        }
        host
    }

    fn try_push_host(&mut self, hostname: &str, ni: &super::NameInfo) -> Option<Host> {
        let block = self.text.len();
        let mut h = Host {
            block: u32::try_from(block).ok()?,
            v4: u32::try_from(self.v4.len()).ok()?,
            v6: u32::try_from(self.v6.len()).ok()?,
            name_len: u16::try_from(hostname.len()).ok()?,
            ..Host::default()
        };
        self.text.extend_from_slice(hostname.as_bytes());
        let rel = |text: &Vec<u8>| u16::try_from(text.len() - block).ok();
        // Short name and namespace: found inside the hostname when they are there (as for
        // every Kubernetes service), stored otherwise.
        let place = |text: &mut Vec<u8>, s: &str| -> Option<(u16, u16)> {
            let len = u16::try_from(s.len()).ok()?;
            if s.is_empty() {
                return Some((0, 0));
            }
            let labels = hostname.match_indices(s).find(|(i, _)| {
                (*i == 0 || hostname.as_bytes()[i - 1] == b'.')
                    && hostname
                        .as_bytes()
                        .get(i + s.len())
                        .is_none_or(|b| *b == b'.')
            });
            if let Some((i, _)) = labels {
                return Some((u16::try_from(i).ok()?, len));
            }
            let at = rel(text)?;
            text.extend_from_slice(s.as_bytes());
            Some((at, len))
        };
        h.short = place(&mut self.text, &ni.shortname)?;
        h.namespace = place(&mut self.text, &ni.namespace)?;
        h.alts = rel(&self.text)?;
        h.n_alts = u16::try_from(ni.alt_hosts.len()).ok()?;
        for a in &ni.alt_hosts {
            push_counted(&mut self.text, a)?;
        }
        for ip in &ni.ips {
            match ip.parse::<IpAddr>() {
                Ok(IpAddr::V4(a)) => self.v4.push(a),
                Ok(IpAddr::V6(a)) => self.v6.push(a),
                Err(_) => {}
            }
        }
        h.n4 = u16::try_from(self.v4.len() - h.v4 as usize).ok()?;
        h.n6 = u16::try_from(self.v6.len() - h.v6 as usize).ok()?;
        // `/debug/ndsz` shows the addresses as sent: kept as text unless they are exactly
        // the canonical forms of the parsed ones, v4 first.
        let canonical = self.v4[h.v4 as usize..]
            .iter()
            .map(|a| a.to_string())
            .chain(self.v6[h.v6 as usize..].iter().map(|a| a.to_string()));
        if !canonical.eq(ni.ips.iter().cloned()) {
            h.n_ip_texts = u16::try_from(ni.ips.len()).ok()?;
            for ip in &ni.ips {
                push_counted(&mut self.text, ip)?;
            }
        }
        // Offsets are 16 bits within a host's block.
        rel(&self.text)?;
        h.registry = match self.registries.iter().position(|r| *r == ni.registry) {
            Some(i) => u16::try_from(i).ok()?,
            None => {
                let i = u16::try_from(self.registries.len()).ok()?;
                self.registries.push(ni.registry.clone());
                i
            }
        };
        Some(h)
    }

    /// Names in the table (without the derived search-domain CNAMEs).
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// NDS hosts in the table (those without a usable address included).
    pub fn hosts(&self) -> usize {
        self.hosts.len()
    }

    fn block(&self, h: &Host) -> &[u8] {
        self.text.get(h.block as usize..).unwrap_or_default()
    }

    fn span(block: &[u8], (at, len): (u16, u16)) -> &[u8] {
        block
            .get(usize::from(at)..usize::from(at) + usize::from(len))
            .unwrap_or_default()
    }

    fn hostname<'a>(&self, h: &'a Host, block: &'a [u8]) -> &'a [u8] {
        Self::span(block, (0, h.name_len))
    }

    /// `name` (lower-case, absolute) is the name `k` stands for.
    fn key_is(&self, k: Key, name: &[u8]) -> bool {
        let Some(h) = self.hosts.get(k.host() as usize) else {
            return false;
        };
        let b = self.block(h);
        let (short, ns) = (Self::span(b, h.short), Self::span(b, h.namespace));
        match k.form() {
            FORM_HOST => spells(name, &[self.hostname(h, b), b"."]),
            FORM_SHORT_NS => spells(name, &[short, b".", ns, b"."]),
            FORM_SHORT => spells(name, &[short, b"."]),
            FORM_SHORT_NS_FIRST => {
                spells(name, &[short, b".", ns, b".", self.first.as_bytes(), b"."])
            }
            f => counted(b, usize::from(h.alts), h.n_alts)
                .nth(usize::from(f - FORM_ALT))
                .is_some_and(|a| spells(name, &[a.as_bytes(), b"."])),
        }
    }

    /// The host an exact name belongs to.
    fn exact(&self, name: &str) -> Option<u32> {
        self.exact_key(name).map(Key::host)
    }

    /// The key of an exact name: its host and the form that spells it.
    fn exact_key(&self, name: &str) -> Option<Key> {
        let h = hash(name.as_bytes());
        let i = self.keys.partition_point(|k| k.hash < h);
        self.keys[i..]
            .iter()
            .take_while(|k| k.hash == h)
            .find(|k| self.key_is(**k, name.as_bytes()))
            .copied()
    }

    /// What `/debug/dnsz` says of a name: the entry the proxy's own resolution
    /// ([`Self::resolve`], which [`Self::lookup`] and [`Self::lookup_addrs`] use) finds for
    /// `qname` (lower-cased, absolute), and which of the host's names it is. `None`: not in
    /// the table (forwarded).
    pub fn explain(&self, qname: &str, search0: &str) -> Option<Explained> {
        let mut buf = [0u8; WILD_BUF];
        let (owner, found) = self.resolve(qname, search0, &mut buf)?;
        let (host, cname_target, spelled) = match found {
            Found::Host(h) => (h, None, owner),
            Found::Cname { target, host } => (host, Some(target.to_owned()), target),
        };
        let h = self.hosts.get(host as usize)?;
        let b = self.block(h);
        let form = match self.exact_key(spelled).map(Key::form) {
            Some(FORM_HOST) => "hostname",
            Some(FORM_SHORT_NS) => "shortname.namespace",
            Some(FORM_SHORT) => "shortname",
            Some(FORM_SHORT_NS_FIRST) => "shortname.namespace.<domain label>",
            Some(_) => "altHost",
            None => "unknown",
        };
        let text = |s: &[u8]| String::from_utf8_lossy(s).into_owned();
        Some(Explained {
            matched: owner.to_owned(),
            wildcard: owner != qname,
            host: text(self.hostname(h, b)),
            form,
            cname_target,
            registry: self
                .registries
                .get(usize::from(h.registry))
                .cloned()
                .unwrap_or_default(),
            namespace: text(Self::span(b, h.namespace)),
            v4: self
                .v4
                .get(h.v4 as usize..h.v4 as usize + usize::from(h.n4))
                .unwrap_or_default()
                .to_vec(),
            v6: self
                .v6
                .get(h.v6 as usize..h.v6 as usize + usize::from(h.n6))
                .unwrap_or_default()
                .to_vec(),
        })
    }

    /// `name` as Istio's tables have it: first as a search-domain CNAME (`<alt><search[0]>`,
    /// for an `alt` not itself in the search domain and not when the expansion is one of the
    /// same host's own names), then as an address entry. `search0` is the first search
    /// domain, lower-case and absolute, or empty.
    fn find<'a>(&self, name: &'a str, search0: &str) -> Option<Found<'a>> {
        if !search0.is_empty()
            && let Some(target) = name.strip_suffix(search0)
            && target.len() > 1
            && target.ends_with('.')
            && target != search0
            && !in_domain(target, search0)
            && let Some(host) = self.exact(target)
            && self.exact(name) != Some(host)
        {
            return Some(Found::Cname { target, host });
        }
        self.exact(name).map(Found::Host)
    }

    /// The entry `qname` resolves to: the name itself, else the nearest `*.<parent>` walking
    /// up (a wildcard matches at any depth below it), spelled in `buf`. Returns the owner
    /// found (`qname` or the wildcard) and what it resolves to; `search0` as for
    /// [`Self::find`]. No allocation: the lean answer path calls it per query.
    fn resolve<'a>(
        &self,
        qname: &'a str,
        search0: &str,
        buf: &'a mut [u8; WILD_BUF],
    ) -> Option<(&'a str, Found<'a>)> {
        if let Some(f) = self.find(qname, search0) {
            return Some((qname, f));
        }
        let mut rest = qname;
        // A host hit is carried out of the loop as its index (it borrows nothing); a CNAME
        // hit borrows the spelled name, so it is found once more in `buf` below.
        let (parent, host) = loop {
            let (_, parent) = rest.split_once('.')?;
            if parent.is_empty() {
                return None;
            }
            match self.find(spell_wildcard(buf, parent)?, search0) {
                Some(Found::Host(h)) => break (parent, Some(h)),
                Some(Found::Cname { .. }) => break (parent, None),
                None => rest = parent,
            }
        };
        let w = spell_wildcard(buf, parent)?;
        let found = match host {
            Some(h) => Found::Host(h),
            None => self.find(w, search0)?,
        };
        Some((w, found))
    }

    /// `lookupHost`: `qname` is the lower-cased absolute question; `question` the name as
    /// asked (wildcard answers are renamed to it); `search0` as for [`Self::find`].
    pub fn lookup(&self, qtype: RecordType, qname: &str, question: &Name, search0: &str) -> Lookup {
        let mut buf = [0u8; WILD_BUF];
        let Some((owner, found)) = self.resolve(qname, search0, &mut buf) else {
            return Lookup::NotFound;
        };
        let wildcard = owner != qname;
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
        let Some(h) = self.hosts.get(host as usize) else {
            return Lookup::NotFound;
        };
        let mut ips: Vec<Record> = match qtype {
            RecordType::A => self.v4[h.v4 as usize..][..usize::from(h.n4)]
                .iter()
                .map(|a| Record::from_rdata(addr_owner.clone(), TTL, RData::A(A(*a))))
                .collect(),
            _ => self.v6[h.v6 as usize..][..usize::from(h.n6)]
                .iter()
                .map(|a| Record::from_rdata(addr_owner.clone(), TTL, RData::AAAA(AAAA(*a))))
                .collect(),
        };
        let mut out = Vec::new();
        // Istio (`buildDNSAnswers`'s chained answer) adds the CNAME only when the target has
        // records of the asked type: otherwise NOERROR with nothing at all.
        if !ips.is_empty() {
            ips.shuffle(&mut rand::rng());
            // A wildcard answers for the question: the addresses take its name, unless a
            // CNAME leads to them, which then takes it (`*.<parent>.<search0>` → question
            // CNAME `*.<parent>.`, and the addresses stay at that target, as `lookupHost`
            // does: one name never holds both a CNAME and addresses).
            let owner = question.to_lowercase();
            match cname {
                Some(mut c) => {
                    if wildcard {
                        c.name = owner;
                    }
                    out.push(c);
                }
                None if wildcard => ips.iter_mut().for_each(|r| r.name = owner.clone()),
                None => {}
            }
            out.extend(ips);
        }
        Lookup::Answer(out)
    }

    /// The lean answer path's lookup (`handler::Core::answer_table`): the same resolution as
    /// [`Self::lookup`] (exact name, derived search-domain CNAME, nearest wildcard), without
    /// building records or allocating. `qname` is the lower-cased absolute question.
    pub fn lookup_addrs(&self, qtype: RecordType, qname: &str, search0: &str) -> Addrs<'_> {
        let mut buf = [0u8; WILD_BUF];
        let host = match self.resolve(qname, search0, &mut buf) {
            Some((_, Found::Host(h))) => h,
            Some((_, Found::Cname { .. })) => return Addrs::Chain,
            None => return Addrs::NotFound,
        };
        let Some(h) = self.hosts.get(host as usize) else {
            return Addrs::NotFound;
        };
        let (v4, v6) = (h.v4 as usize, h.v6 as usize);
        match qtype {
            RecordType::A => self
                .v4
                .get(v4..v4 + usize::from(h.n4))
                .map_or(Addrs::NotFound, Addrs::V4),
            RecordType::AAAA => self
                .v6
                .get(v6..v6 + usize::from(h.n6))
                .map_or(Addrs::NotFound, Addrs::V6),
            _ => Addrs::NotFound,
        }
    }

    /// Bytes this table holds on the heap (its vectors' capacities; the registry strings
    /// are a handful).
    pub fn heap_bytes(&self) -> usize {
        self.text.capacity()
            + self.keys.capacity() * std::mem::size_of::<Key>()
            + self.hosts.capacity() * std::mem::size_of::<Host>()
            + self.v4.capacity() * 4
            + self.v6.capacity() * 16
            + self
                .registries
                .iter()
                .map(|r| r.capacity() + 24)
                .sum::<usize>()
            + self.first.capacity()
    }

    /// The NDS host `hostname` (as sent) is in the table.
    pub fn has_host(&self, hostname: &str) -> bool {
        self.hosts
            .iter()
            .any(|h| self.hostname(h, self.block(h)) == hostname.as_bytes())
    }

    /// Istio's `/debug/ndsz` body: the NDS table as sent, in protojson field names, hosts
    /// sorted, empty fields left out (`ips` always present), and the names the hosts answer
    /// to beside them.
    pub fn ndsz(&self) -> String {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let mut entries = serde_json::Map::new();
        for h in &self.hosts {
            let b = self.block(h);
            let ips: Vec<String> = if h.n_ip_texts == 0 {
                self.v4[h.v4 as usize..][..usize::from(h.n4)]
                    .iter()
                    .map(|a| a.to_string())
                    .chain(
                        self.v6[h.v6 as usize..][..usize::from(h.n6)]
                            .iter()
                            .map(|a| a.to_string()),
                    )
                    .collect()
            } else {
                let mut at = usize::from(h.alts);
                for a in counted(b, at, h.n_alts) {
                    at += 2 + a.len();
                }
                counted(b, at, h.n_ip_texts).map(str::to_owned).collect()
            };
            let mut e = serde_json::Map::new();
            e.insert("ips".into(), serde_json::json!(ips));
            let registry = self
                .registries
                .get(usize::from(h.registry))
                .map_or("", String::as_str);
            if !registry.is_empty() {
                e.insert("registry".into(), serde_json::json!(registry));
            }
            if h.short.1 > 0 {
                e.insert(
                    "shortname".into(),
                    serde_json::json!(text(Self::span(b, h.short))),
                );
            }
            if h.namespace.1 > 0 {
                e.insert(
                    "namespace".into(),
                    serde_json::json!(text(Self::span(b, h.namespace))),
                );
            }
            if h.n_alts > 0 {
                let alts: Vec<&str> = counted(b, usize::from(h.alts), h.n_alts).collect();
                e.insert("altHosts".into(), serde_json::json!(alts));
            }
            entries.insert(text(self.hostname(h, b)), serde_json::Value::Object(e));
        }
        // Istio's agent adds every name a host answers to that is not itself a host of the
        // table (`pkg/istio-agent/agent.go` `GetDNSTable`, over `BuildAlternateHosts`): the
        // absolute hostname, and for Kubernetes services the short forms and alt hosts, with
        // the host's usable addresses (IPv4 first) and registry `Kubernetes` whatever the
        // host's. The search-domain CNAMEs are not listed.
        for k in &self.keys {
            let Some(h) = self.hosts.get(k.host() as usize) else {
                continue;
            };
            let name = text(&self.spell(*k, h));
            if entries.contains_key(&name) {
                continue;
            }
            let ips: Vec<String> = self.v4[h.v4 as usize..][..usize::from(h.n4)]
                .iter()
                .map(|a| a.to_string())
                .chain(
                    self.v6[h.v6 as usize..][..usize::from(h.n6)]
                        .iter()
                        .map(|a| a.to_string()),
                )
                .collect();
            entries.insert(
                name,
                serde_json::json!({ "ips": ips, "registry": "Kubernetes" }),
            );
        }
        // protojson leaves an empty map out: pilot-agent answers `{}` for an empty table
        // (`pilot/cmd/pilot-agent/status/server.go` `handleNdsz`, `protomarshal.Marshal`).
        if entries.is_empty() {
            return "{}".to_owned();
        }
        serde_json::json!({ "table": entries }).to_string()
    }

    /// The name `k` stands for, spelled from its host's strings as istiod sent them (the key
    /// matches it case-insensitively).
    fn spell(&self, k: Key, h: &Host) -> Vec<u8> {
        let b = self.block(h);
        let (short, ns) = (Self::span(b, h.short), Self::span(b, h.namespace));
        let parts: Vec<&[u8]> = match k.form() {
            FORM_HOST => vec![self.hostname(h, b), b"."],
            FORM_SHORT_NS => vec![short, b".", ns, b"."],
            FORM_SHORT => vec![short, b"."],
            FORM_SHORT_NS_FIRST => vec![short, b".", ns, b".", self.first.as_bytes(), b"."],
            f => match counted(b, usize::from(h.alts), h.n_alts).nth(usize::from(f - FORM_ALT)) {
                Some(a) => vec![a.as_bytes(), b"."],
                None => vec![],
            },
        };
        parts.concat()
    }
}

/// `name` ends with `.<domain>` (both absolute, lower-case).
fn in_domain(name: &str, domain: &str) -> bool {
    name.len() > domain.len()
        && name.ends_with(domain)
        && name.as_bytes()[name.len() - domain.len() - 1] == b'.'
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::dns::NameInfo;

    /// The first search domain of the proxy in `ns1`.
    const SEARCH0: &str = "ns1.svc.cluster.local.";

    fn scope() -> Scope {
        Scope {
            namespace: "ns1".into(),
            domain: "ns1.svc.cluster.local".into(),
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
        ask_with(t, q, ty, SEARCH0)
    }

    fn ask_with(t: &LookupTable, q: &str, ty: RecordType, search0: &str) -> Option<Vec<String>> {
        let name = Name::from_ascii(q).unwrap();
        match t.lookup(ty, &q.to_ascii_lowercase(), &name, search0) {
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
    fn a_wildcards_search_domain_cname_leads_to_the_wildcards_addresses() {
        // `*.wild.example.com.<search0>` is a CNAME to `*.wild.example.com.`; asked for
        // `a.wild.example.com.<search0>`, the CNAME is the question's and the addresses stay
        // at its target (`lookupHost`), never a CNAME and an address at one name.
        let t = table();
        let q = format!("a.wild.example.com.{SEARCH0}");
        assert_eq!(
            ask(&t, &q, RecordType::A),
            Some(vec![
                format!("{q} *.wild.example.com."),
                "*.wild.example.com. 240.240.0.9".to_owned()
            ])
        );
        // No address of the family: nothing, as for any CNAME.
        assert_eq!(ask(&t, &q, RecordType::AAAA), Some(vec![]));
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
        assert_eq!(
            ask_with(
                &t,
                "x.example.com.ns1.svc.cluster.local.",
                RecordType::A,
                ""
            ),
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

    #[test]
    fn ndsz_renders_the_table_as_sent() {
        let mut nt = NameTable::default();
        nt.table.insert(
            "productpage.ns1.svc.cluster.local".into(),
            k8s("ns1", "productpage", &["10.0.0.1", "fd00::1"]),
        );
        let mut alt = k8s("ns2", "reviews", &["10.0.0.2"]);
        alt.alt_hosts = vec![
            "reviews.ns2.svc.clusterset.local".into(),
            "Rev.Example".into(),
        ];
        nt.table.insert("reviews.ns2.svc.cluster.local".into(), alt);
        // Short name and namespace not inside the hostname; addresses not in canonical
        // form or order, one unusable; a host with no usable address; no registry.
        nt.table.insert(
            "Odd.Example.COM".into(),
            NameInfo {
                ips: vec!["fd00:0::3".into(), "10.0.0.3".into(), "not-an-ip".into()],
                registry: "External".into(),
                shortname: "odd-short".into(),
                namespace: "elsewhere".into(),
                alt_hosts: vec![],
            },
        );
        nt.table.insert(
            "none.example.com".into(),
            NameInfo {
                ips: vec!["bad".into()],
                ..Default::default()
            },
        );
        nt.table.insert(
            "v6first.example.com".into(),
            NameInfo {
                ips: vec!["fd00::4".into(), "10.0.0.4".into()],
                ..Default::default()
            },
        );
        let t = LookupTable::build(&nt, &scope());
        let mut want = serde_json::Map::new();
        for (h, ni) in &nt.table {
            let mut e = serde_json::json!({ "ips": ni.ips });
            for (k, v) in [
                ("registry", &ni.registry),
                ("shortname", &ni.shortname),
                ("namespace", &ni.namespace),
            ] {
                if !v.is_empty() {
                    e[k] = serde_json::json!(v);
                }
            }
            if !ni.alt_hosts.is_empty() {
                e["altHosts"] = serde_json::json!(ni.alt_hosts);
            }
            want.insert(h.clone(), e);
        }
        // Istio's agent adds the names each usable host answers to (`GetDNSTable`), spelled
        // as sent, with the parsed addresses, IPv4 first, and registry Kubernetes.
        for (names, ips) in [
            (
                &[
                    "productpage.ns1.svc.cluster.local.",
                    "productpage.ns1.",
                    "productpage.",
                    "productpage.ns1.svc.",
                ][..],
                &["10.0.0.1", "fd00::1"][..],
            ),
            (
                &[
                    "reviews.ns2.svc.cluster.local.",
                    "reviews.ns2.",
                    "reviews.ns2.svc.",
                    "reviews.ns2.svc.clusterset.local.",
                    "Rev.Example.",
                ],
                &["10.0.0.2"],
            ),
            (&["Odd.Example.COM."], &["10.0.0.3", "fd00::3"]),
            (&["v6first.example.com."], &["10.0.0.4", "fd00::4"]),
        ] {
            for n in names {
                want.insert(
                    (*n).to_owned(),
                    serde_json::json!({ "ips": ips, "registry": "Kubernetes" }),
                );
            }
        }
        let got: serde_json::Value = serde_json::from_str(&t.ndsz()).unwrap();
        assert_eq!(got, serde_json::json!({ "table": want }));
        assert_eq!(t.hosts(), 5);
        assert!(t.has_host("Odd.Example.COM") && !t.has_host("odd.example.com"));
        // And the lookups still see every form, case-insensitively.
        assert!(ask(&t, "odd.example.com.", RecordType::A).is_some());
        assert!(ask(&t, "rev.example.", RecordType::A).is_some());
        assert!(ask(&t, "reviews.ns2.svc.clusterset.local.", RecordType::A).is_some());
        assert!(ask(&t, "none.example.com.", RecordType::A).is_none());
        assert_eq!(
            ask(&t, "odd.example.com.", RecordType::AAAA),
            Some(vec!["odd.example.com. fd00::3".to_owned()])
        );
    }

    #[test]
    fn ndsz_of_an_empty_table_is_an_empty_object() {
        let t = LookupTable::build(&NameTable::default(), &scope());
        assert_eq!(t.ndsz(), "{}");
    }

    #[test]
    fn a_name_claimed_by_two_hosts_goes_to_the_later_one() {
        // `b.ns1.` is host 2's alt host and host 1's short form: one answer, always the
        // same (hosts are taken in hostname order, the later one keeps a shared name).
        let mut nt = NameTable::default();
        nt.table.insert(
            "b.ns1.svc.cluster.local".into(),
            k8s("ns1", "b", &["10.0.0.1"]),
        );
        let mut c = k8s("ns1", "c", &["10.0.0.2"]);
        c.alt_hosts = vec!["b.ns1".into()];
        nt.table.insert("c.ns1.svc.cluster.local".into(), c);
        let t = LookupTable::build(&nt, &scope());
        assert_eq!(
            ask(&t, "b.ns1.", RecordType::A),
            Some(vec!["b.ns1. 10.0.0.2".to_owned()])
        );
        assert_eq!(
            ask(&t, "b.", RecordType::A),
            Some(vec!["b. 10.0.0.1".to_owned()])
        );
    }
}
