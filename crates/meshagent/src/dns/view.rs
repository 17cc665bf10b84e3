//! `/debug/dnsz`: how the DNS proxy would answer a name, and a summary of its table and
//! upstreams with per-upstream counters.
//!
//! Istio has no such view; its agent exports only the unlabelled totals of
//! `pkg/dns/client/monitoring.go` (`dns_requests_total`, `dns_upstream_requests_total`,
//! `dns_upstream_failures_total`, `dns_upstream_request_duration_seconds`), which
//! [`super::metrics`] registers under the same names. The per-upstream counters here are
//! atomics updated where each exchange ends ([`super::forward::exchange`]), bounded to
//! [`MAX_UPSTREAMS`] servers; nothing is kept per query.
//!
//! A name is explained with the proxy's own resolution ([`super::LookupTable::lookup`] for
//! the decision and the records, [`super::LookupTable::explain`] for the entry matched), so
//! the view cannot drift from what the proxy answers.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use hickory_proto::op::{Message, Query};
use hickory_proto::rr::{Name, RecordType};
use serde_json::{Value, json};

use super::handler::{Core, Proto};
use super::table::Lookup;

/// Upstream servers counted one by one (resolv.conf has at most a few; glibc reads 3).
pub const MAX_UPSTREAMS: usize = 16;
/// Latency buckets, in seconds: those of Istio's `dns_upstream_request_duration_seconds`
/// (`pkg/dns/client/monitoring.go`).
pub const BUCKETS: [f64; 6] = [0.001, 0.005, 0.01, 0.1, 1.0, 5.0];
/// Longest last-error text kept per upstream.
const MAX_ERROR: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum DnszError {
    #[error("invalid name {name:?}: {reason}")]
    Name { name: String, reason: String },
    #[error("unknown record type {0:?} (expected e.g. A, AAAA, CNAME, TXT, SRV)")]
    Type(String),
    #[error("cannot encode the query: {0}")]
    Encode(String),
}

/// How one exchange with one upstream ended.
pub enum Outcome<'a> {
    Answered,
    Timeout,
    Error(&'a str),
}

#[derive(Default)]
struct Counters {
    queries: AtomicU64,
    answered: AtomicU64,
    errors: AtomicU64,
    timeouts: AtomicU64,
    nanos: AtomicU64,
    max_nanos: AtomicU64,
    /// Answered exchanges at or under each of [`BUCKETS`] (not cumulative).
    buckets: [AtomicU64; BUCKETS.len()],
    last_error: Mutex<Option<(SystemTime, String)>>,
}

/// Per-upstream counters of the forwarding code.
#[derive(Default)]
pub struct UpstreamStats {
    entries: Box<[(SocketAddr, Counters)]>,
}

impl UpstreamStats {
    /// Counters for the first [`MAX_UPSTREAMS`] distinct `servers`; others are not counted
    /// one by one (the Istio totals still count them).
    pub fn new(servers: &[SocketAddr]) -> UpstreamStats {
        let mut v: Vec<(SocketAddr, Counters)> = Vec::new();
        for s in servers {
            if v.len() < MAX_UPSTREAMS && !v.iter().any(|(a, _)| a == s) {
                v.push((*s, Counters::default()));
            }
        }
        UpstreamStats {
            entries: v.into_boxed_slice(),
        }
    }

    fn get(&self, server: SocketAddr) -> Option<&Counters> {
        self.entries
            .iter()
            .find(|(a, _)| *a == server)
            .map(|(_, c)| c)
    }

    /// An exchange with `server` starts.
    pub fn sent(&self, server: SocketAddr) {
        if let Some(c) = self.get(server) {
            c.queries.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An exchange with `server` ended after `took`.
    pub fn ended(&self, server: SocketAddr, took: Duration, outcome: Outcome<'_>) {
        let Some(c) = self.get(server) else {
            return;
        };
        match outcome {
            Outcome::Answered => {
                let n = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
                c.answered.fetch_add(1, Ordering::Relaxed);
                c.nanos.fetch_add(n, Ordering::Relaxed);
                c.max_nanos.fetch_max(n, Ordering::Relaxed);
                let secs = took.as_secs_f64();
                if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
                    c.buckets[i].fetch_add(1, Ordering::Relaxed);
                }
            }
            Outcome::Timeout => {
                c.timeouts.fetch_add(1, Ordering::Relaxed);
                set_error(c, &format!("i/o timeout after {took:?}"));
            }
            Outcome::Error(e) => {
                c.errors.fetch_add(1, Ordering::Relaxed);
                set_error(c, e);
            }
        }
    }

    pub fn to_json(&self) -> Value {
        Value::Array(
            self.entries
                .iter()
                .map(|(a, c)| {
                    let answered = c.answered.load(Ordering::Relaxed);
                    let nanos = c.nanos.load(Ordering::Relaxed);
                    let mut cumulative = 0;
                    let buckets: Vec<Value> = BUCKETS
                        .iter()
                        .zip(c.buckets.iter())
                        .map(|(le, n)| {
                            cumulative += n.load(Ordering::Relaxed);
                            json!({"le": le, "count": cumulative})
                        })
                        .collect();
                    let last = c
                        .last_error
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .clone();
                    json!({
                        "address": a.to_string(),
                        "queries": c.queries.load(Ordering::Relaxed),
                        "answered": answered,
                        "errors": c.errors.load(Ordering::Relaxed),
                        "timeouts": c.timeouts.load(Ordering::Relaxed),
                        "latency": {
                            "count": answered,
                            "meanMs": nanos.checked_div(answered).map_or(Value::Null, ms),
                            "maxMs": if answered > 0 { ms(c.max_nanos.load(Ordering::Relaxed)) } else { Value::Null },
                            "buckets": buckets,
                        },
                        "lastError": last.map(|(at, e)| json!({"at": crate::logging::format_time(at), "error": e})),
                    })
                })
                .collect(),
        )
    }
}

fn set_error(c: &Counters, e: &str) {
    let mut e = e.to_owned();
    if e.len() > MAX_ERROR {
        let mut cut = MAX_ERROR;
        while !e.is_char_boundary(cut) {
            cut -= 1;
        }
        e.truncate(cut);
    }
    *c.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some((SystemTime::now(), e));
}

/// An RCODE as dig spells it.
fn rcode(c: hickory_proto::op::ResponseCode) -> String {
    use hickory_proto::op::ResponseCode as R;
    match c {
        R::NoError => "NOERROR".to_owned(),
        R::FormErr => "FORMERR".to_owned(),
        R::ServFail => "SERVFAIL".to_owned(),
        R::NXDomain => "NXDOMAIN".to_owned(),
        R::NotImp => "NOTIMP".to_owned(),
        R::Refused => "REFUSED".to_owned(),
        other => other.to_string(),
    }
}

fn ms(nanos: u64) -> Value {
    json!((nanos as f64 / 1e4).round() / 100.0)
}

/// The summary: table size, upstreams and their counters.
pub fn summary(core: &Core) -> Value {
    let table = core.table.borrow().clone();
    json!({
        "table": table.as_ref().map(|t| json!({"hosts": t.hosts(), "names": t.len()})),
        "searchDomain": if core.search0.is_empty() { Value::Null } else { json!(core.search0) },
        "parallel": core.parallel,
        "timeoutMs": u64::try_from(core.timeout.as_millis()).unwrap_or(u64::MAX),
        "cache": core.cache.is_some(),
        "requests": core.metrics.requests.get(),
        "upstreamRequests": core.metrics.upstream_requests.get(),
        "upstreamFailures": core.metrics.upstream_failures.get(),
        "upstreams": core.upstream_stats.to_json(),
        "untrackedUpstreams": core.upstreams.len().saturating_sub(MAX_UPSTREAMS),
    })
}

/// The question as the proxy sees it: an absolute name and a record type.
pub fn question(name: &str, qtype: Option<&str>) -> Result<(Name, RecordType), DnszError> {
    let bad = |reason: String| DnszError::Name {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() || name.len() > 1024 {
        return Err(bad("empty or too long".into()));
    }
    let abs = if name.ends_with('.') {
        name.to_owned()
    } else {
        format!("{name}.")
    };
    let n = Name::from_ascii(&abs).map_err(|e| bad(e.to_string()))?;
    let t = qtype.unwrap_or("A");
    let rt: RecordType = t
        .to_ascii_uppercase()
        .parse()
        .map_err(|_| DnszError::Type(t.to_owned()))?;
    Ok((n, rt))
}

/// How the proxy would answer `name`/`qtype` now. No I/O.
pub fn explain(core: &Core, name: &Name, qtype: RecordType) -> Value {
    let lower = name.to_lowercase();
    let key = lower.to_ascii();
    let mut v = json!({"name": key, "type": qtype.to_string()});
    let table = core.table.borrow().clone();
    let Some(table) = table else {
        v["table"] = json!(false);
        if core.forward_before_table {
            v["action"] = json!("forward");
            v["reason"] =
                json!("no name table yet; root mode forwards everything until one arrives");
        } else {
            v["action"] = json!("servfail");
            v["reason"] = json!("no name table yet");
        }
        return v;
    };
    v["table"] = json!(true);
    let matched = table.explain(&key, &core.search0);
    if let Some(m) = &matched {
        v["match"] = json!({
            "matched": m.matched,
            "wildcard": m.wildcard,
            "host": m.host,
            "form": m.form,
            "registry": m.registry,
            "namespace": if m.namespace.is_empty() { Value::Null } else { json!(m.namespace) },
            "addresses": m.v4.iter().map(|a| a.to_string()).chain(m.v6.iter().map(|a| a.to_string())).collect::<Vec<_>>(),
        });
        if let Some(t) = &m.cname_target {
            v["cname"] = json!({
                "from": m.matched,
                "to": t,
                "reason": format!("search-domain expansion: {} is {t} in the first search domain {}", m.matched, core.search0),
            });
        }
    }
    match table.lookup(qtype, &key, &lower, &core.search0) {
        Lookup::Answer(records) => {
            v["action"] = json!("answer");
            v["rcode"] = json!("NOERROR");
            v["answers"] = Value::Array(
                records
                    .iter()
                    .map(|r| {
                        json!({
                            "name": r.name.to_ascii(),
                            "type": r.record_type().to_string(),
                            "ttl": r.ttl,
                            "data": r.data.to_string(),
                        })
                    })
                    .collect(),
            );
        }
        Lookup::NotFound => {
            v["action"] = json!("forward");
            v["reason"] = json!(if matched.is_some() {
                "a mesh name, but only A and AAAA are answered from the table (as Istio)"
            } else {
                "not in the name table"
            });
            v["upstreams"] = json!(
                core.upstreams
                    .iter()
                    .map(|a| a.to_string())
                    .collect::<Vec<_>>()
            );
        }
    }
    v
}

/// `&forward=true`: sends the question upstream as the proxy would (same server order and
/// timeout, not through the cache) and reports who answered.
pub async fn forward(core: &Core, name: &Name, qtype: RecordType) -> Result<Value, DnszError> {
    let mut m = Message::query();
    m.metadata.id = rand::random();
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(name.clone(), qtype));
    let raw = m.to_vec().map_err(|e| DnszError::Encode(e.to_string()))?;
    let start = tokio::time::Instant::now();
    let (result, _) = core.upstream_exchange(&raw, Proto::Udp).await;
    let took = start.elapsed();
    Ok(match result {
        Ok(((_, reply), server)) => json!({
            "upstream": server.to_string(),
            "rcode": rcode(reply.metadata.response_code),
            "latencyMs": ms(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX)),
            "answers": reply.answers.iter().map(|r| json!({
                "name": r.name.to_ascii(),
                "type": r.record_type().to_string(),
                "ttl": r.ttl,
                "data": r.data.to_string(),
            })).collect::<Vec<_>>(),
        }),
        Err(e) => json!({
            "upstream": Value::Null,
            "rcode": "SERVFAIL",
            "latencyMs": ms(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX)),
            "error": e,
        }),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn counters_are_per_upstream_and_bounded() {
        let a: SocketAddr = "127.0.0.1:53".parse().unwrap();
        let b: SocketAddr = "[::1]:53".parse().unwrap();
        let many: Vec<SocketAddr> = (0..40)
            .map(|i| SocketAddr::from(([127, 0, 0, i as u8], 53)))
            .chain([a, b])
            .collect();
        assert_eq!(UpstreamStats::new(&many).entries.len(), MAX_UPSTREAMS);
        let s = UpstreamStats::new(&[a, b, a]);
        s.sent(a);
        s.ended(a, Duration::from_millis(2), Outcome::Answered);
        s.sent(a);
        s.ended(a, Duration::from_secs(2), Outcome::Timeout);
        s.sent(b);
        s.ended(
            b,
            Duration::from_millis(1),
            Outcome::Error(&"x".repeat(1000)),
        );
        // Not an upstream: ignored.
        s.ended(
            "10.0.0.1:53".parse().unwrap(),
            Duration::ZERO,
            Outcome::Answered,
        );
        let j = s.to_json();
        assert_eq!(j.as_array().unwrap().len(), 2);
        assert_eq!(j[0]["queries"], 2);
        assert_eq!(j[0]["answered"], 1);
        assert_eq!(j[0]["timeouts"], 1);
        assert_eq!(j[0]["latency"]["buckets"][0]["count"], 0);
        assert_eq!(j[0]["latency"]["buckets"][1]["count"], 1);
        assert_eq!(j[0]["latency"]["maxMs"], 2.0);
        assert_eq!(j[1]["errors"], 1);
        assert_eq!(j[1]["latency"]["meanMs"], Value::Null);
        assert_eq!(
            j[1]["lastError"]["error"].as_str().unwrap().len(),
            MAX_ERROR
        );
    }

    #[test]
    fn questions_are_validated() {
        let (n, t) = question("reviews", None).unwrap();
        assert_eq!((n.to_ascii().as_str(), t), ("reviews.", RecordType::A));
        assert_eq!(question("a.b.", Some("aaaa")).unwrap().1, RecordType::AAAA);
        assert!(matches!(
            question("a", Some("BOGUS")),
            Err(DnszError::Type(_))
        ));
        assert!(question("", None).is_err());
        assert!(question(&"a".repeat(300), None).is_err());
    }
}
