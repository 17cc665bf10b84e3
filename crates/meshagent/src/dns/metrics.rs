//! Istio's DNS metrics (`pkg/dns/client/monitoring.go`; the `_total` is part of Istio's names)
//! plus the cache counters Istio lacks.

use crate::metrics::{Counter, Histogram, MetricsError, Registry};

#[derive(Clone)]
pub struct Metrics {
    pub requests: Counter,
    pub upstream_requests: Counter,
    pub upstream_failures: Counter,
    pub upstream_duration: Histogram,
    pub cache_hits: Counter,
    pub cache_misses: Counter,
    pub cache_evictions: Counter,
}

impl Metrics {
    pub fn new(r: &Registry) -> Result<Metrics, MetricsError> {
        Ok(Metrics {
            requests: r.counter("dns_requests_total", "Total number of DNS requests.")?,
            upstream_requests: r.counter(
                "dns_upstream_requests_total",
                "Total number of DNS requests forwarded to upstream.",
            )?,
            upstream_failures: r.counter(
                "dns_upstream_failures_total",
                "Total number of DNS failures.",
            )?,
            upstream_duration: r.histogram(
                "dns_upstream_request_duration_seconds",
                "Total time in seconds Istio takes to get DNS response from upstream.",
                &[0.001, 0.005, 0.01, 0.1, 1.0, 5.0],
            )?,
            cache_hits: r.counter(
                "dns_cache_hits_total",
                "Forwarded DNS requests answered from the agent's cache.",
            )?,
            cache_misses: r.counter(
                "dns_cache_misses_total",
                "Forwarded DNS requests not found in the agent's cache.",
            )?,
            cache_evictions: r.counter(
                "dns_cache_evictions_total",
                "Answers evicted from the agent's DNS cache to stay within its byte and entry bounds.",
            )?,
        })
    }
}
