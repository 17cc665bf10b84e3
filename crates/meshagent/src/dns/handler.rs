//! One request in, one action out: Istio's `LocalDNSServer.ServeDNS` (`pkg/dns/client/dns.go`),
//! plus the RFC hygiene Istio lacks and ztunnel has (`src/dns/server.rs`):
//!
//! * RA=1 and the client's EDNS OPT echoed (`max_payload = max(client, 512)`) on local answers;
//!   Istio sends RA=0 and no OPT.
//! * Malformed requests: FORMERR when the header is readable, dropped when it is not or when
//!   the packet is a response (never answer a response: that is how reflection loops start).
//!   Other opcodes get NOTIMP.
//! * Replies larger than the client's limit (UDP: its EDNS size, at least 512; TCP: 65535) are
//!   truncated with TC=1 — for forwarded answers too, so a large upstream answer reaches the
//!   client over TCP instead of becoming SERVFAIL (istio#61371).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use hickory_proto::op::{Edns, Message, MessageType, Metadata, OpCode, ResponseCode};
use rand::seq::SliceRandom;
use tokio::sync::watch;

use super::cache::{Cache, Key};
use super::forward;
use super::metrics::Metrics;
use super::table::{Lookup, LookupTable};

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
}

impl Core {
    /// Everything that can be answered without I/O is answered here, synchronously.
    pub fn handle(&self, raw: &[u8], proto: Proto) -> Action {
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
            && let Some(mut m) = cache.get(k, &req)
        {
            return reply(&mut m, limit);
        }
        Action::Forward(Forward {
            req,
            raw: raw.to_vec(),
            limit,
            key,
        })
    }

    /// Istio's `queryUpstream`: the query unchanged (ID, OPT) over the client's protocol;
    /// sequential over the shuffled servers, or all at once with `DNS_FORWARD_PARALLEL`; the
    /// first reply wins (an upstream NXDOMAIN or SERVFAIL is a reply); none → SERVFAIL.
    pub async fn forward(&self, f: Forward, proto: Proto) -> Vec<u8> {
        self.metrics.upstream_requests.inc();
        let start = Instant::now();
        let result = if self.parallel {
            forward::parallel(&self.pool, &self.upstreams, &f.raw, proto, self.timeout).await
        } else if self.upstreams.len() == 1 {
            forward::sequential(&self.pool, &self.upstreams, &f.raw, proto, self.timeout).await
        } else {
            let mut servers = self.upstreams.clone();
            servers.shuffle(&mut rand::rng());
            forward::sequential(&self.pool, &servers, &f.raw, proto, self.timeout).await
        };
        self.metrics
            .upstream_duration
            .observe(start.elapsed().as_secs_f64());
        match result {
            Ok((bytes, msg)) => {
                if let (Some(cache), Some(k)) = (&self.cache, f.key) {
                    cache.insert(k, &msg);
                }
                if bytes.len() <= f.limit {
                    bytes
                } else {
                    let mut msg = msg;
                    encode_limited(&mut msg, f.limit)
                }
            }
            Err(e) => {
                tracing::info!(name = ?f.req.queries.first().map(|q| q.name().to_string()), error = %e, "upstream failure");
                self.metrics.upstream_failures.inc();
                encode_limited(&mut answer(&f.req, ResponseCode::ServFail), f.limit)
            }
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
