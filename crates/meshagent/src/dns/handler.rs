//! One request in, one action out: Istio's `LocalDNSServer.ServeDNS` (`pkg/dns/client/dns.go`),
//! plus the RFC hygiene Istio lacks and ztunnel has (`src/dns/server.rs`):
//!
//! * RA=1 and the client's EDNS OPT echoed (`max_payload = max(client, 512)`) on local answers;
//!   Istio sends RA=0 and no OPT.
//! * Malformed requests: FORMERR when the header is readable, dropped when it is not or when
//!   the packet is a response (never answer a response: that is how reflection loops start).
//!   Other opcodes get NOTIMP; an EDNS version other than 0 gets BADVERS (RFC 6891).
//! * Replies larger than the client's limit (UDP: its EDNS size, at least 512; TCP: 65535) are
//!   truncated with TC=1 — for forwarded answers too, so a large upstream answer reaches the
//!   client over TCP instead of becoming SERVFAIL (istio#61371).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use hickory_proto::op::{
    Edns, Header, HeaderCounts, Message, MessageType, Metadata, OpCode, Query, ResponseCode,
};
use hickory_proto::rr::{DNSClass, RData, Record, RecordType};
use hickory_proto::serialize::binary::{BinDecodable, BinDecoder, BinEncodable, BinEncoder};
use rand::Rng;
use rand::seq::SliceRandom;
use tokio::sync::watch;

use super::cache::{Cache, Key};
use super::forward;
use super::metrics::Metrics;
use super::table::{Addrs, Lookup, LookupTable, TTL};
use super::wire;

/// Largest message over TCP (two-byte length prefix).
pub const TCP_MAX: usize = 65535;
/// The UDP limit of a client without EDNS (RFC 1035 §4.2.1).
pub const UDP_MIN: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proto {
    Udp,
    Tcp,
}

impl Proto {
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Udp => "udp",
            Proto::Tcp => "tcp",
        }
    }
}

/// A request that must go upstream.
pub struct Forward {
    req: Message,
    raw: Vec<u8>,
    limit: usize,
    key: Option<Key>,
}

pub enum Action {
    Reply(Vec<u8>),
    Drop,
    Forward(Forward),
}

pub struct Core {
    pub table: watch::Receiver<Option<Arc<LookupTable>>>,
    /// The first resolv.conf search domain, lower-case and absolute; empty when none.
    pub search0: String,
    pub upstreams: Vec<SocketAddr>,
    pub parallel: bool,
    pub timeout: Duration,
    /// `:53` root mode: forward everything until the first table instead of SERVFAIL.
    pub forward_before_table: bool,
    pub cache: Option<Cache>,
    pub metrics: Metrics,
    /// Connected upstream UDP sockets for reuse.
    pub pool: forward::Pool,
    /// Per-upstream counters for `/debug/dnsz` ([`super::view`]).
    pub upstream_stats: super::view::UpstreamStats,
}

impl Core {
    /// Everything that can be answered without I/O is answered here, synchronously.
    pub fn handle(&self, raw: &[u8], proto: Proto) -> Action {
        let mut out = Vec::new();
        if self.answer_table(raw, proto, &mut out) {
            return Action::Reply(out);
        }
        self.handle_general(raw, proto)
    }

    /// The lean path for what almost every request is: one A or AAAA question for a table
    /// name, asked in lower case. The reply is written into `out` (cleared first) and `true`
    /// returned; anything else — other shapes, types, mixed-case names, CNAME chains, names
    /// not in the table, encoding errors — returns `false` without counting, and
    /// [`Self::handle_general`] decides, so every reply this path writes is the one
    /// `handle_general` would write (the same bytes up to the order of the addresses; the
    /// `dns_request` fuzz target and the unit tests below compare the two).
    ///
    /// The request is decoded only as far as needed with hickory's decoder types (header,
    /// the question, the OPT), and the reply is assembled from the request's question bytes
    /// and the table's addresses with hickory's encoder: each answer's owner is a pointer
    /// to the question (offset 12) — what hickory's name compression writes when the owner
    /// equals the question, which it does here as the question is lower-case — then type,
    /// class IN, TTL 30 and the address, shuffled per response; then the OPT echo. Istio
    /// builds `dns.RR`s per query (`pkg/dns/client/dns.go` `ServeDNS`, `lookupHost`).
    pub fn answer_table(&self, raw: &[u8], proto: Proto, out: &mut Vec<u8>) -> bool {
        out.clear();
        let ok = self.try_answer_table(raw, proto, out).is_some();
        if ok {
            self.metrics.requests.inc();
        } else {
            out.clear();
        }
        ok
    }

    fn try_answer_table(&self, raw: &[u8], proto: Proto, out: &mut Vec<u8>) -> Option<()> {
        let mut d = BinDecoder::new(raw);
        let header = Header::read(&mut d).ok()?;
        let (m, c) = (header.metadata, header.counts);
        if m.message_type != MessageType::Query
            || m.op_code != OpCode::Query
            || c.queries != 1
            || c.answers != 0
            || c.authorities != 0
            || c.additionals > 1
        {
            return None;
        }
        let q = Query::read(&mut d).ok()?;
        let qtype = q.query_type();
        if q.query_class() != DNSClass::IN || !matches!(qtype, RecordType::A | RecordType::AAAA) {
            return None;
        }
        let question = raw.get(12..d.index())?;
        let mut key = [0u8; 256];
        let key = lower_key(question.get(..question.len().checked_sub(4)?)?, &mut key)?;
        // As `Message::read_records` takes the additional section: an OPT is the EDNS.
        let edns = if c.additionals == 1 {
            let r = Record::read(&mut d).ok()?;
            match r.data {
                RData::Update0(RecordType::OPT) | RData::OPT(_) => Some(Edns::from(&r)),
                _ => return None,
            }
        } else {
            None
        };
        // An EDNS version we do not speak: BADVERS, from the general path.
        if edns.as_ref().is_some_and(|e| e.version() != 0) {
            return None;
        }
        let table = self.table.borrow();
        let table = table.as_ref()?;
        let addrs = table.lookup_addrs(qtype, key, &self.search0);
        let (rr_type, rdlen, n) = match addrs {
            Addrs::V4(a) => (RecordType::A, 4u16, a.len()),
            Addrs::V6(a) => (RecordType::AAAA, 16, a.len()),
            Addrs::NotFound | Addrs::Chain => return None,
        };
        let rdlen_usize = usize::from(rdlen);
        let limit = match proto {
            Proto::Tcp => TCP_MAX,
            Proto::Udp => edns
                .as_ref()
                .map_or(UDP_MIN, |e| usize::from(e.max_payload()).max(UDP_MIN)),
        };
        // Owner pointer, type, class, TTL, RDLENGTH, RDATA.
        let rr = 2 + 2 + 2 + 4 + 2 + rdlen_usize;
        let opt = if edns.is_some() { 11 } else { 0 };
        let base = 12 + question.len();
        // `encode_limited`: the largest prefix of the (shuffled) answers that fits, TC=1
        // when one was dropped; the question and OPT always fit a 512-byte limit.
        let fit = limit.checked_sub(base + opt)? / rr;
        let count = n.min(fit);
        let mut md = Metadata::response_from_request(&m);
        md.recursion_available = true;
        md.authoritative = true;
        md.truncation = count < n;
        md.response_code = ResponseCode::NoError;
        let header = Header {
            metadata: md,
            counts: HeaderCounts {
                queries: 1,
                answers: u16::try_from(count).ok()?,
                authorities: 0,
                additionals: u16::from(edns.is_some()),
            },
        };
        {
            let mut enc = BinEncoder::new(out);
            header.emit(&mut enc).ok()?;
            enc.emit_vec(question).ok()?;
            let mut emit = |rdata: &[u8]| -> Option<()> {
                // 0xC00C: a compression pointer to the question's name at offset 12.
                enc.emit_u16(0xC000 | 12).ok()?;
                rr_type.emit(&mut enc).ok()?;
                DNSClass::IN.emit(&mut enc).ok()?;
                enc.emit_u32(TTL).ok()?;
                enc.emit_u16(rdlen).ok()?;
                enc.emit_vec(rdata).ok()
            };
            match addrs {
                Addrs::V4(a) => a.iter().try_for_each(|a| emit(&a.octets()))?,
                Addrs::V6(a) => a.iter().try_for_each(|a| emit(&a.octets()))?,
                Addrs::NotFound | Addrs::Chain => return None,
            }
        }
        shuffle_chunks(out.get_mut(base..)?, rr);
        out.truncate(base + count * rr);
        if let Some(e) = &edns {
            let mut o = Edns::new();
            o.set_max_payload(e.max_payload().max(UDP_MIN as u16));
            o.set_version(0);
            let at = u32::try_from(out.len()).ok()?;
            let mut enc = BinEncoder::with_offset(out, at);
            o.emit(&mut enc).ok()?;
        }
        Some(())
    }

    /// Every request, decoded whole into a hickory `Message`.
    pub fn handle_general(&self, raw: &[u8], proto: Proto) -> Action {
        self.metrics.requests.inc();
        if raw.len() < 12 {
            return Action::Drop;
        }
        let req = match Message::from_vec(raw) {
            Ok(m) => m,
            Err(e) => {
                // Bit 7 of byte 2 is QR: never answer a response.
                if raw[2] & 0x80 != 0 {
                    return Action::Drop;
                }
                tracing::debug!(error = %e, "malformed DNS request; FORMERR");
                let id = u16::from_be_bytes([raw[0], raw[1]]);
                let mut m = Message::error_msg(
                    id,
                    OpCode::from_u8((raw[2] >> 3) & 0x0f),
                    ResponseCode::FormErr,
                );
                m.metadata.recursion_desired = raw[2] & 0x01 != 0;
                return reply(&mut m, UDP_MIN);
            }
        };
        if req.metadata.message_type == MessageType::Response {
            return Action::Drop;
        }
        let limit = limit(&req, proto);
        // RFC 6891 §6.1.3: a version above ours (0) gets BADVERS (extended RCODE 16: 0 in the
        // header, 1 in the OPT) and an OPT of version 0, before anything else is looked at.
        // Istio (miekg's server) answers such queries as if they were version 0.
        if req.edns.as_ref().is_some_and(|e| e.version() != 0) {
            return reply(&mut answer(&req, ResponseCode::BADVERS), limit);
        }
        if req.metadata.op_code != OpCode::Query {
            return reply(&mut answer(&req, ResponseCode::NotImp), limit);
        }
        let Some(q) = req.queries.first() else {
            // Istio: an empty question is SERVFAIL.
            return reply(&mut answer(&req, ResponseCode::ServFail), limit);
        };
        let table = self.table.borrow().clone();
        let Some(table) = table else {
            if self.forward_before_table {
                return self.to_upstream(req, raw, limit);
            }
            tracing::debug!(name = %q.name(), "DNS request before the name table arrived; SERVFAIL");
            return reply(&mut answer(&req, ResponseCode::ServFail), limit);
        };
        let lower = q.name().to_lowercase();
        let key = lower.to_ascii();
        match table.lookup(q.query_type(), &key, &lower, &self.search0) {
            Lookup::Answer(records) => {
                let mut m = answer(&req, ResponseCode::NoError);
                m.metadata.authoritative = true;
                m.answers = records;
                reply(&mut m, limit)
            }
            Lookup::NotFound => self.to_upstream(req, raw, limit),
        }
    }

    fn to_upstream(&self, req: Message, raw: &[u8], limit: usize) -> Action {
        let key = self.cache.as_ref().and_then(|_| Key::of(&req));
        if let (Some(cache), Some(k)) = (&self.cache, &key)
            && let Some(hit) = cache.get(k, &req, raw)
        {
            return Action::Reply(fit(hit, limit));
        }
        Action::Forward(Forward {
            req,
            raw: raw.to_vec(),
            limit,
            key,
        })
    }

    /// The exchange with the upstreams of [`Self::forward`] (and `/debug/dnsz?forward=true`):
    /// the query unchanged over `proto`, sequential over the shuffled servers or all at once
    /// with `DNS_FORWARD_PARALLEL`, counted in Istio's upstream metrics and per upstream.
    /// Returns the reply and the server that sent it, and the time taken.
    pub async fn upstream_exchange(
        &self,
        raw: &[u8],
        proto: Proto,
    ) -> (Result<(forward::Reply, SocketAddr), String>, Duration) {
        self.metrics.upstream_requests.inc();
        let start = Instant::now();
        let s = &self.upstream_stats;
        let result = if self.parallel {
            forward::parallel(&self.pool, s, &self.upstreams, raw, proto, self.timeout).await
        } else if self.upstreams.len() == 1 {
            forward::sequential(&self.pool, s, &self.upstreams, raw, proto, self.timeout).await
        } else {
            let mut servers = self.upstreams.clone();
            servers.shuffle(&mut rand::rng());
            forward::sequential(&self.pool, s, &servers, raw, proto, self.timeout).await
        };
        let took = start.elapsed();
        self.metrics.upstream_duration.observe(took.as_secs_f64());
        if result.is_err() {
            self.metrics.upstream_failures.inc();
        }
        (result, took)
    }

    /// Istio's `queryUpstream`: the query unchanged (OPT included; over UDP with an ID of our
    /// own, restored in the reply: `forward::udp`) over the client's protocol;
    /// sequential over the shuffled servers, or all at once with `DNS_FORWARD_PARALLEL`; the
    /// first reply wins (an upstream NXDOMAIN or SERVFAIL is a reply); none → SERVFAIL.
    pub async fn forward(&self, f: Forward, proto: Proto) -> Vec<u8> {
        let (result, _) = self.upstream_exchange(&f.raw, proto).await;
        match result.map(|(r, _)| r) {
            Ok((mut bytes, mut msg)) => {
                // RFC 2181 §8: a TTL with the high bit set means 0 — in what is served (the
                // upstream's bytes, relayed) as in what is cached (nothing, then).
                for r in msg
                    .answers
                    .iter_mut()
                    .chain(msg.authorities.iter_mut())
                    .chain(msg.additionals.iter_mut())
                {
                    r.ttl = wire::clamp_ttl(r.ttl);
                }
                match wire::layout(&bytes) {
                    Some(l) => wire::map_ttls(&mut bytes, &l, wire::clamp_ttl),
                    // hickory decoded it, but it does not walk cleanly: serve hickory's
                    // encoding of what was decoded (clamped), and do not cache it.
                    None => return encode_limited(&mut msg, f.limit),
                }
                if let (Some(cache), Some(k)) = (&self.cache, f.key) {
                    cache.insert(k, &bytes, &msg);
                }
                if bytes.len() <= f.limit {
                    bytes
                } else {
                    encode_limited(&mut msg, f.limit)
                }
            }
            Err(e) => {
                tracing::info!(name = %f.req.queries.first().map(|q| q.name().to_string()).unwrap_or_default(), error = %e, "upstream failure");
                encode_limited(&mut answer(&f.req, ResponseCode::ServFail), f.limit)
            }
        }
    }
}

/// The question's name as the table's keys spell it (`a.b.`), when the wire name is plain
/// labels (no compression pointer) of bytes hickory's `Name::to_ascii` writes unescaped and
/// already lower-case — so that the key is exactly `to_lowercase().to_ascii()` of the name
/// and the answers' owner (the lower-cased question) is the question's own bytes. `None`
/// otherwise: the general path handles it.
fn lower_key<'k>(wire: &[u8], key: &'k mut [u8; 256]) -> Option<&'k str> {
    let (mut at, mut len) = (0usize, 0usize);
    loop {
        let n = usize::from(*wire.get(at)?);
        if n == 0 {
            break;
        }
        if n > 63 {
            return None;
        }
        let label = wire.get(at + 1..at + 1 + n)?;
        for (i, &b) in label.iter().enumerate() {
            let plain = b.is_ascii_lowercase()
                || b.is_ascii_digit()
                || b == b'_'
                || (b == b'-' && i > 0)
                || (b == b'*' && i == 0);
            if !plain {
                return None;
            }
        }
        let dst = key.get_mut(len..len + n + 1)?;
        dst[..n].copy_from_slice(label);
        dst[n] = b'.';
        len += n + 1;
        at += 1 + n;
    }
    // The root name: the general path.
    if len == 0 || at + 1 != wire.len() {
        return None;
    }
    std::str::from_utf8(key.get(..len)?).ok()
}

/// Fisher–Yates over the `size`-byte records of `b` (what `SliceRandom::shuffle` does to a
/// `Vec<Record>`): every order equally likely.
fn shuffle_chunks(b: &mut [u8], size: usize) {
    let n = b.len() / size;
    if n < 2 {
        return;
    }
    let mut rng = rand::rng();
    for i in (1..n).rev() {
        let j = rng.random_range(0..=i);
        if i != j {
            let (lo, hi) = b.split_at_mut(i * size);
            lo[j * size..(j + 1) * size].swap_with_slice(&mut hi[..size]);
        }
    }
}

/// The client's UDP limit: its EDNS size (at least 512), or 512; TCP: 65535.
fn limit(req: &Message, proto: Proto) -> usize {
    match proto {
        Proto::Tcp => TCP_MAX,
        Proto::Udp => req
            .edns
            .as_ref()
            .map_or(UDP_MIN, |e| usize::from(e.max_payload()).max(UDP_MIN)),
    }
}

/// A reply to `req` (miekg's `SetReply`: ID, opcode, RD, CD, question) with RA set and the
/// client's EDNS echoed.
fn answer(req: &Message, rcode: ResponseCode) -> Message {
    let mut m = Message::new(req.metadata.id, MessageType::Response, req.metadata.op_code);
    m.metadata = Metadata::response_from_request(&req.metadata);
    m.metadata.recursion_available = true;
    m.metadata.response_code = rcode;
    m.queries = req.queries.clone();
    if let Some(e) = &req.edns {
        let mut o = Edns::new();
        o.set_max_payload(e.max_payload().max(UDP_MIN as u16));
        o.set_version(0);
        m.set_edns(o);
    }
    m
}

/// `b` if it fits `limit`, else its decoding re-encoded within it ([`encode_limited`]).
fn fit(b: Vec<u8>, limit: usize) -> Vec<u8> {
    if b.len() <= limit {
        return b;
    }
    match Message::from_vec(&b) {
        Ok(mut m) => encode_limited(&mut m, limit),
        // Cached bytes decoded when they were stored; should they not now: the header, as
        // SERVFAIL with no sections.
        Err(_) => {
            let mut h = b;
            h.truncate(12);
            h.resize(12, 0);
            h[3] = (h[3] & 0xf0) | 0x02;
            h[4..].fill(0);
            h
        }
    }
}

fn reply(m: &mut Message, limit: usize) -> Action {
    Action::Reply(encode_limited(m, limit))
}

/// Encodes `m` in at most `limit` bytes: first the additional section goes (the OPT stays),
/// then authority and answer records from the end, with TC=1 (RFC 2181 §9: TC only when
/// answer or authority data was dropped).
pub fn encode_limited(m: &mut Message, limit: usize) -> Vec<u8> {
    let full = match m.to_vec() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode a DNS reply; SERVFAIL");
            return servfail_bytes(m);
        }
    };
    if full.len() <= limit {
        return full;
    }
    m.additionals.clear();
    if let Ok(b) = m.to_vec()
        && b.len() <= limit
    {
        return b;
    }
    m.metadata.truncation = true;
    m.authorities.clear();
    let answers = std::mem::take(&mut m.answers);
    // The largest prefix of the answers that fits (binary search over re-encodings).
    let (mut lo, mut hi) = (0usize, answers.len());
    let mut best = None;
    while lo <= hi {
        let mid = (lo + hi) / 2;
        m.answers = answers[..mid].to_vec();
        match m.to_vec() {
            Ok(b) if b.len() <= limit => {
                best = Some(b);
                lo = mid + 1;
            }
            _ => {
                if mid == 0 {
                    break;
                }
                hi = mid - 1;
            }
        }
    }
    match best {
        Some(b) => b,
        None => {
            // Not even the question fits (a 255-byte name and an OPT cannot exceed 512):
            // header only.
            m.answers.clear();
            m.queries.clear();
            m.edns = None;
            m.to_vec().unwrap_or_else(|_| servfail_bytes(m))
        }
    }
}

fn servfail_bytes(m: &Message) -> Vec<u8> {
    let mut b = vec![0u8; 12];
    b[..2].copy_from_slice(&m.metadata.id.to_be_bytes());
    b[2] = 0x80 | (m.metadata.recursion_desired as u8);
    b[3] = 0x80 | 0x02;
    b
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::fuzzing::{dns_core, dns_paths_agree, dns_query as query};

    /// The lean path answers these (and agrees with the general path); the others go to
    /// the general path.
    #[test]
    fn lean_path_answers_table_names_as_the_general_path_does() {
        let core = dns_core();
        let lean = [
            ("a.default.svc.cluster.local.", RecordType::A),
            ("a.default.svc.cluster.local.", RecordType::AAAA),
            ("a.default.", RecordType::A),
            ("a.", RecordType::AAAA),
            ("alt.example.", RecordType::A),
            ("x.y.wild.example.com.", RecordType::A),
            // Known name, no address of the family: NOERROR, no answers.
            ("x.wild.example.com.", RecordType::AAAA),
            ("big.example.com.", RecordType::A),
        ];
        for (name, ty) in lean {
            for edns in [None, Some(512), Some(1232), Some(4096), Some(100)] {
                let q = query(name, ty, edns);
                for proto in [Proto::Udp, Proto::Tcp] {
                    let mut out = Vec::new();
                    assert!(core.answer_table(&q, proto, &mut out), "{name} {ty}");
                    for _ in 0..20 {
                        dns_paths_agree(core, &q, proto);
                    }
                }
            }
        }
        let general = [
            // Mixed case (0x20), CNAME chains, other types, unknown names.
            ("A.default.svc.cluster.local.", RecordType::A),
            ("a.default.default.svc.cluster.local.", RecordType::A),
            ("a.default.svc.cluster.local.", RecordType::TXT),
            ("nope.example.", RecordType::A),
            (".", RecordType::A),
        ];
        for (name, ty) in general {
            let q = query(name, ty, Some(1232));
            assert!(
                !core.answer_table(&q, Proto::Udp, &mut Vec::new()),
                "{name} {ty}"
            );
        }
    }

    /// Mutated requests (a deterministic generator: 1–3 bytes changed of well-formed
    /// queries, so flags, counts, type, class, case, label lengths and the OPT all vary):
    /// wherever the lean path answers, the general path gives the same reply, and nothing
    /// panics (the `dns_request` fuzz target's checks).
    #[test]
    fn lean_and_general_paths_agree_on_mutated_requests() {
        let bases = [
            query("a.default.svc.cluster.local.", RecordType::A, None),
            query("a.", RecordType::AAAA, Some(1232)),
            query("x.y.wild.example.com.", RecordType::A, Some(512)),
            query("big.example.com.", RecordType::A, Some(600)),
        ];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for base in &bases {
            for _ in 0..3000 {
                let mut q = base.clone();
                for _ in 0..=(next() % 3) {
                    let at = (next() % q.len() as u64) as usize;
                    q[at] = match next() % 4 {
                        0 => q[at] ^ 0x20,
                        1 => q[at].wrapping_add(1),
                        2 => 0,
                        _ => next() as u8,
                    };
                }
                crate::fuzzing::dns_request(&q);
            }
        }
    }

    #[test]
    fn lean_path_truncates_forty_addresses_like_the_general_path() {
        let core = dns_core();
        let q = query("big.example.com.", RecordType::A, None);
        let mut out = Vec::new();
        assert!(core.answer_table(&q, Proto::Udp, &mut out));
        let m = Message::from_vec(&out).unwrap();
        assert!(m.metadata.truncation && out.len() <= 512);
        assert_eq!(m.answers.len(), (512 - 12 - 21) / 16);
        assert!(m.edns.is_none() && m.metadata.authoritative && m.metadata.recursion_available);
        assert_eq!(m.queries[0].name().to_ascii(), "big.example.com.");
        let q = query("big.example.com.", RecordType::A, Some(4096));
        assert!(core.answer_table(&q, Proto::Udp, &mut out));
        let m = Message::from_vec(&out).unwrap();
        assert!(!m.metadata.truncation);
        assert_eq!(m.answers.len(), 40);
        assert_eq!(m.edns.as_ref().map(Edns::max_payload), Some(4096));
        assert!(
            m.answers
                .iter()
                .all(|r| r.ttl == TTL && r.name.to_ascii() == "big.example.com.")
        );
    }

    /// L2: EDNS version 1 gets BADVERS (extended RCODE 16: header 0, OPT high bits 1) and
    /// an OPT of version 0, from both paths: the lean one declines, the general one answers.
    #[test]
    fn l2_edns_version_one_is_badvers_extended_rcode_16() {
        let core = dns_core();
        for (name, ty) in [
            ("a.default.svc.cluster.local.", RecordType::A),
            ("nope.example.", RecordType::TXT),
        ] {
            let mut m = Message::from_vec(&query(name, ty, Some(1232))).unwrap();
            if let Some(e) = m.edns.as_mut() {
                e.set_version(1);
            }
            let raw = m.to_vec().unwrap();
            for proto in [Proto::Udp, Proto::Tcp] {
                assert!(!core.answer_table(&raw, proto, &mut Vec::new()), "{name}");
                let Action::Reply(b) = core.handle(&raw, proto) else {
                    panic!("{name}: no reply");
                };
                assert_eq!(b[3] & 0x0f, 0, "{name}: header RCODE");
                let opt = &b[b.len() - 11..];
                assert_eq!(&opt[..3], &[0, 0, 41], "{name}: OPT last");
                assert_eq!(opt[5], 1, "{name}: extended RCODE high bits");
                assert_eq!(opt[6], 0, "{name}: version");
                let d = Message::from_vec(&b).unwrap();
                assert!(d.answers.is_empty());
                assert_eq!(u16::from(d.metadata.response_code), 16);
            }
        }
    }
}
