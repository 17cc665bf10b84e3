//! A TTL-respecting cache of forwarded answers, bounded in bytes. Istio has none
//! (istio#58806): every lookup of an external name by an application goes to the cluster DNS.
//!
//! Keyed by the lower-cased question plus what changes the answer (EDNS presence, DO, CD).
//! Only NOERROR answers with records, and NXDOMAIN/NODATA answers carrying an SOA (RFC 2308
//! negative caching) are stored; never truncated replies, SERVFAIL or TTL 0.
//!
//! What is kept is the upstream's reply as it came on the wire, with where its TTLs are: a
//! hit is that reply with the client's ID, RD and question spelling and TTLs reduced by the
//! time spent in the cache — the same bytes as the first reply, never re-encoded (re-encoding
//! loses name compression, [`super::wire`]), so a hit is never truncated where the miss was
//! not. Bounds: [`DEFAULT_BYTES`] in all (`MESHAGENT_DNS_CACHE_BYTES`) and at most
//! `MESHAGENT_DNS_CACHE_SIZE` entries, each weighed by its bytes plus [`ENTRY_OVERHEAD`];
//! a reply larger than [`MAX_ENTRY`] is not cached at all. Eviction is quick_cache's
//! CLOCK-Pro (an entry asked again survives a scan of one-off names), each eviction counted in
//! `istio_agent_dns_cache_evictions_total`. An expired entry is dropped when it is next asked
//! for, or evicted like any other.

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{RData, Record};

use super::wire::{self, Layout};
use crate::metrics::Counter;

/// Longest time an answer is kept, whatever its TTL says.
const MAX_TTL: u32 = 3600;
/// The cache's default byte budget (`MESHAGENT_DNS_CACHE_BYTES`): a few thousand typical
/// answers (100–500 bytes each).
pub const DEFAULT_BYTES: usize = 4 << 20;
/// Replies larger than this are relayed but not cached: a few huge answers (a 60 KiB TXT)
/// would otherwise push out hundreds of ordinary ones.
pub const MAX_ENTRY: usize = 16 << 10;
/// What an entry costs besides its reply bytes: the key, the TTL offsets' vector, the
/// timestamps and the cache's own slot, rounded up.
pub const ENTRY_OVERHEAD: usize = 160;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    name: String,
    qtype: u16,
    qclass: u16,
    edns: bool,
    dnssec_ok: bool,
    checking_disabled: bool,
}

impl Key {
    /// `None` for requests that are not cacheable (no single question).
    pub fn of(req: &Message) -> Option<Key> {
        let [q] = req.queries.as_slice() else {
            return None;
        };
        Some(Key {
            name: q.name().to_lowercase().to_ascii(),
            qtype: q.query_type().into(),
            qclass: q.query_class().into(),
            edns: req.edns.is_some(),
            dnssec_ok: req.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok),
            checking_disabled: req.metadata.checking_disabled,
        })
    }
}

struct Item {
    wire: Box<[u8]>,
    layout: Layout,
    stored: Instant,
    expires: Instant,
}

/// An entry's weight: its bytes, but at least the budget's share of one entry of the entry
/// bound, so that both bounds hold with one weight capacity.
#[derive(Clone)]
struct Weigher {
    min: u64,
}

impl quick_cache::Weighter<Key, Item> for Weigher {
    fn weight(&self, key: &Key, item: &Item) -> u64 {
        let bytes = item.wire.len() + 2 * item.layout.ttls.len() + key.name.len() + ENTRY_OVERHEAD;
        (bytes as u64).max(self.min)
    }
}

/// Counts evictions (quick_cache calls it for entries pushed out to make room).
#[derive(Clone)]
struct Evictions(Counter);

impl quick_cache::Lifecycle<Key, Item> for Evictions {
    type RequestState = ();
    fn on_evict(&self, _: &mut (), _: Key, _: Item) {
        self.0.inc();
    }
}

type Store =
    quick_cache::unsync::Cache<Key, Item, Weigher, quick_cache::DefaultHashBuilder, Evictions>;

pub struct Cache {
    inner: Mutex<Store>,
    pub hits: Counter,
    pub misses: Counter,
    pub evictions: Counter,
}

/// The cache's bounds.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Entries at most.
    pub entries: usize,
    /// Bytes at most, entries weighed as the module doc says.
    pub bytes: usize,
}

impl Cache {
    pub fn new(limits: Limits, hits: Counter, misses: Counter, evictions: Counter) -> Cache {
        let entries = limits.entries.max(1);
        let bytes = limits.bytes.max(ENTRY_OVERHEAD) as u64;
        let min = bytes.div_ceil(entries as u64);
        let opts = quick_cache::OptionsBuilder::new()
            .estimated_items_capacity(entries.min(limits.bytes / 512).max(16))
            .weight_capacity(bytes)
            .build();
        let store = match opts {
            Ok(o) => Store::with_options(
                o,
                Weigher { min },
                quick_cache::DefaultHashBuilder::default(),
                Evictions(evictions.clone()),
            ),
            // Only an inconsistent set of options fails: fall back to the plain constructor.
            Err(_) => Store::with(
                entries,
                bytes,
                Weigher { min },
                quick_cache::DefaultHashBuilder::default(),
                Evictions(evictions.clone()),
            ),
        };
        Cache {
            inner: Mutex::new(store),
            hits,
            misses,
            evictions,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Store> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The weight held, in bytes as [`Weigher`] counts them.
    pub fn weight(&self) -> u64 {
        self.lock().weight()
    }

    /// The cached reply for `req` (whose wire form is `raw`): the upstream's bytes with
    /// `req`'s ID, RD and question, TTLs aged.
    pub fn get(&self, key: &Key, req: &Message, raw: &[u8]) -> Option<Vec<u8>> {
        let now = Instant::now();
        let mut store = self.lock();
        let found = match store.get(key) {
            Some(item) if item.expires > now => {
                let aged = now.duration_since(item.stored).as_secs();
                let aged = u32::try_from(aged).unwrap_or(u32::MAX);
                let mut b = item.wire.to_vec();
                wire::map_ttls(&mut b, &item.layout, |t| t.saturating_sub(aged));
                // The question as the client spelled it (0x20-randomising clients check it):
                // equal to the cached one but for case, so of the same length.
                let q = wire::question(raw).filter(|q| 12 + q.len() == item.layout.question_end);
                match (q, b.get_mut(12..item.layout.question_end)) {
                    (Some(q), Some(dst)) => {
                        dst.copy_from_slice(q);
                        Some(b)
                    }
                    _ => None,
                }
            }
            Some(_) => {
                store.remove(key);
                None
            }
            None => None,
        };
        drop(store);
        match found {
            Some(mut b) => {
                self.hits.inc();
                b[..2].copy_from_slice(&req.metadata.id.to_be_bytes());
                b[2] = (b[2] & !1) | u8::from(req.metadata.recursion_desired);
                Some(b)
            }
            None => {
                self.misses.inc();
                None
            }
        }
    }

    /// Keeps `wire` (the upstream's reply, decoded as `msg`) for `key` if it may be cached.
    pub fn insert(&self, key: Key, wire: &[u8], msg: &Message) {
        let Some(ttl) = cacheable_ttl(msg) else {
            return;
        };
        if wire.len() > MAX_ENTRY {
            tracing::debug!(bytes = wire.len(), "DNS answer too large to cache");
            return;
        }
        // Only a reply whose question section is the one plain question a hit patches.
        let Some(layout) = wire::layout(wire)
            .filter(|l| wire::question(wire).is_some_and(|q| 12 + q.len() == l.question_end))
        else {
            return;
        };
        let now = Instant::now();
        let item = Item {
            wire: wire.into(),
            layout,
            stored: now,
            expires: now + Duration::from_secs(u64::from(ttl)),
        };
        self.lock().insert(key, item);
    }
}

/// How long `msg` may be cached, if at all.
fn cacheable_ttl(msg: &Message) -> Option<u32> {
    if msg.metadata.truncation {
        return None;
    }
    let rcode = msg.metadata.response_code;
    let ttl = if rcode == ResponseCode::NoError && !msg.answers.is_empty() {
        msg.answers.iter().map(|r| r.ttl).min()?
    } else if rcode == ResponseCode::NoError || rcode == ResponseCode::NXDomain {
        msg.authorities.iter().find_map(soa_negative_ttl)?
    } else {
        return None;
    };
    (ttl > 0).then_some(ttl.min(MAX_TTL))
}

fn soa_negative_ttl(r: &Record) -> Option<u32> {
    match &r.data {
        RData::SOA(soa) => Some(r.ttl.min(soa.minimum)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use hickory_proto::op::{MessageType, OpCode, Query};
    use hickory_proto::rr::rdata::{A, SOA};
    use hickory_proto::rr::{Name, RecordType};

    fn reply(rcode: ResponseCode) -> Message {
        let mut m = Message::new(7, MessageType::Response, OpCode::Query);
        m.metadata.response_code = rcode;
        m.add_query(Query::query(
            Name::from_ascii("x.example.").unwrap(),
            RecordType::A,
        ));
        m
    }

    fn soa(ttl: u32, minimum: u32) -> Record {
        let n = Name::from_ascii("example.").unwrap();
        Record::from_rdata(
            n.clone(),
            ttl,
            RData::SOA(SOA::new(n.clone(), n, 1, 60, 60, 60, minimum)),
        )
    }

    #[test]
    fn what_is_cached_and_for_how_long() {
        let mut ok = reply(ResponseCode::NoError);
        let n = Name::from_ascii("x.example.").unwrap();
        ok.add_answer(Record::from_rdata(
            n.clone(),
            300,
            RData::A(A::new(1, 1, 1, 1)),
        ));
        ok.add_answer(Record::from_rdata(n, 40, RData::A(A::new(1, 1, 1, 2))));
        assert_eq!(cacheable_ttl(&ok), Some(40));
        // RFC 2308: min(SOA TTL, SOA minimum); no SOA, no negative caching.
        let mut nx = reply(ResponseCode::NXDomain);
        assert_eq!(cacheable_ttl(&nx), None);
        nx.add_authority(soa(900, 30));
        assert_eq!(cacheable_ttl(&nx), Some(30));
        let mut nodata = reply(ResponseCode::NoError);
        nodata.add_authority(soa(20, 300));
        assert_eq!(cacheable_ttl(&nodata), Some(20));
        let mut tc = ok.clone();
        tc.metadata.truncation = true;
        assert_eq!(cacheable_ttl(&tc), None);
        assert_eq!(cacheable_ttl(&reply(ResponseCode::ServFail)), None);
    }

    fn answer(name: &str, txt_bytes: usize) -> (Message, Vec<u8>, Vec<u8>) {
        use hickory_proto::rr::rdata::TXT;
        let n = Name::from_ascii(name).unwrap();
        let mut q = Message::new(7, MessageType::Query, OpCode::Query);
        q.add_query(Query::query(n.clone(), RecordType::TXT));
        let mut m = reply(ResponseCode::NoError);
        m.queries = q.queries.clone();
        let chunks = (0..txt_bytes.div_ceil(200))
            .map(|_| "x".repeat(200))
            .collect::<Vec<_>>();
        m.add_answer(Record::from_rdata(n, 60, RData::TXT(TXT::new(chunks))));
        let wire = m.to_vec().unwrap();
        (m, wire, q.to_vec().unwrap())
    }

    fn cache(entries: usize, bytes: usize) -> Cache {
        let limits = Limits { entries, bytes };
        Cache::new(
            limits,
            Counter::default(),
            Counter::default(),
            Counter::default(),
        )
    }

    #[test]
    fn bounded_in_entries() {
        let c = cache(2, DEFAULT_BYTES);
        for name in ["a.example.", "b.example.", "c.example.", "d.example."] {
            let (m, wire, _) = answer(name, 10);
            c.insert(Key::of(&m).unwrap(), &wire, &m);
        }
        assert!(c.len() <= 2, "{}", c.len());
        assert!(c.evictions.get() >= 2);
    }

    /// The byte budget holds whatever the answers' sizes, each eviction is counted, and
    /// answers over the per-entry cap are not cached.
    #[test]
    fn bounded_in_bytes_with_a_per_entry_cap() {
        let budget = 64 << 10;
        let c = cache(4096, budget);
        for i in 0..200 {
            let (m, wire, _) = answer(&format!("n{i}.example."), 4000);
            c.insert(Key::of(&m).unwrap(), &wire, &m);
            assert!(c.weight() <= budget as u64, "{} > {budget}", c.weight());
        }
        assert!(c.len() >= 8, "{}", c.len());
        assert!(c.evictions.get() >= 150, "{}", c.evictions.get());
        let (m, wire, _) = answer("huge.example.", MAX_ENTRY);
        assert!(wire.len() > MAX_ENTRY);
        let before = c.len();
        c.insert(Key::of(&m).unwrap(), &wire, &m);
        assert!(c.get(&Key::of(&m).unwrap(), &m, &wire).is_none());
        assert!(c.len() <= before);
    }

    /// A hit is the cached bytes: same size and answers, the client's ID, RD and spelling.
    #[test]
    fn a_hit_is_the_upstream_reply_with_the_clients_id_and_question() {
        let c = cache(16, DEFAULT_BYTES);
        let (m, wire, _) = answer("many.example.", 8000);
        c.insert(Key::of(&m).unwrap(), &wire, &m);
        let mut req = Message::new(0x4242, MessageType::Query, OpCode::Query);
        req.metadata.recursion_desired = true;
        req.add_query(Query::query(
            Name::from_ascii("MaNy.example.").unwrap(),
            RecordType::TXT,
        ));
        let raw = req.to_vec().unwrap();
        let hit = c.get(&Key::of(&req).unwrap(), &req, &raw).unwrap();
        assert_eq!(hit.len(), wire.len());
        let d = Message::from_vec(&hit).unwrap();
        assert_eq!(d.metadata.id, 0x4242);
        assert!(d.metadata.recursion_desired);
        assert_eq!(d.queries[0].name().to_ascii(), "MaNy.example.");
        assert_eq!(d.answers, m.answers);
    }
}
