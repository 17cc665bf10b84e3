//! A bounded, TTL-respecting cache of forwarded answers. Istio has none (istio#58806): every
//! lookup of an external name by an application goes to the cluster DNS.
//!
//! Keyed by the lower-cased question plus what changes the answer (EDNS presence, DO, CD).
//! Only NOERROR answers with records, and NXDOMAIN/NODATA answers carrying an SOA (RFC 2308
//! negative caching) are stored; never truncated replies, SERVFAIL or TTL 0. Served copies
//! have their TTLs reduced by the time spent in the cache. When full, the oldest entry goes.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{RData, Record};

use crate::metrics::Counter;

/// Longest time an answer is kept, whatever its TTL says.
const MAX_TTL: u32 = 3600;

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
    msg: Message,
    stored: Instant,
    expires: Instant,
    seq: u64,
}

struct Inner {
    map: HashMap<Key, Item>,
    order: VecDeque<(Key, u64)>,
    seq: u64,
}

pub struct Cache {
    capacity: usize,
    inner: Mutex<Inner>,
    pub hits: Counter,
    pub misses: Counter,
}

impl Cache {
    pub fn new(capacity: usize, hits: Counter, misses: Counter) -> Cache {
        Cache {
            capacity,
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                order: VecDeque::new(),
                seq: 0,
            }),
            hits,
            misses,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the cached answer for `req` (its ID, question and RD), TTLs aged.
    pub fn get(&self, key: &Key, req: &Message) -> Option<Message> {
        let now = Instant::now();
        let mut inner = self.lock();
        let found = match inner.map.get(key) {
            Some(item) if item.expires > now => {
                let aged = now.duration_since(item.stored).as_secs() as u32;
                let mut msg = item.msg.clone();
                for r in msg
                    .answers
                    .iter_mut()
                    .chain(msg.authorities.iter_mut())
                    .chain(msg.additionals.iter_mut())
                {
                    r.ttl = r.ttl.saturating_sub(aged);
                }
                Some(msg)
            }
            Some(_) => {
                inner.map.remove(key);
                None
            }
            None => None,
        };
        drop(inner);
        match found {
            Some(mut msg) => {
                self.hits.inc();
                msg.metadata.id = req.metadata.id;
                msg.metadata.recursion_desired = req.metadata.recursion_desired;
                msg.queries = req.queries.clone();
                Some(msg)
            }
            None => {
                self.misses.inc();
                None
            }
        }
    }

    pub fn insert(&self, key: Key, msg: &Message) {
        let Some(ttl) = cacheable_ttl(msg) else {
            return;
        };
        let now = Instant::now();
        let mut inner = self.lock();
        inner.seq += 1;
        let seq = inner.seq;
        while inner.map.len() >= self.capacity && !inner.map.contains_key(&key) {
            let Some((old, s)) = inner.order.pop_front() else {
                break;
            };
            if inner.map.get(&old).is_some_and(|i| i.seq == s) {
                inner.map.remove(&old);
            }
        }
        inner.order.push_back((key.clone(), seq));
        // Stale order entries (replaced keys) are skipped when popped; keep the queue bounded.
        if inner.order.len() > 2 * self.capacity.max(1) {
            let Inner { map, order, .. } = &mut *inner;
            order.retain(|(k, s)| map.get(k).is_some_and(|i| i.seq == *s));
        }
        inner.map.insert(
            key,
            Item {
                msg: msg.clone(),
                stored: now,
                expires: now + Duration::from_secs(u64::from(ttl)),
                seq,
            },
        );
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

    #[test]
    fn bounded_oldest_goes_first() {
        let c = Cache::new(2, Counter::default(), Counter::default());
        let mut keys = Vec::new();
        for name in ["a.example.", "b.example.", "c.example."] {
            let mut m = reply(ResponseCode::NoError);
            let n = Name::from_ascii(name).unwrap();
            m.queries = vec![Query::query(n.clone(), RecordType::A)];
            m.add_answer(Record::from_rdata(n, 60, RData::A(A::new(1, 1, 1, 1))));
            let k = Key::of(&m).unwrap();
            c.insert(k.clone(), &m);
            keys.push((k, m));
        }
        assert_eq!(c.len(), 2);
        assert!(c.get(&keys[0].0, &keys[0].1).is_none(), "oldest evicted");
        let hit = c.get(&keys[2].0, &keys[2].1).unwrap();
        assert_eq!(hit.metadata.id, 7);
        assert_eq!(c.hits.get(), 1);
        assert_eq!(c.misses.get(), 1);
    }
}
