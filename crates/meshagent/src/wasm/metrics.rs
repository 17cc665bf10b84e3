//! Istio's Wasm metrics (`pkg/wasm/monitoring.go`), `istio_agent_` prefixed by the registry.

use crate::metrics::{CounterVec, Gauge, Histogram, MetricsError, Registry};

#[derive(Clone)]
pub struct Metrics {
    pub cache_entries: Gauge,
    pub cache_lookup: CounterVec<1>,
    pub remote_fetch: CounterVec<1>,
    pub conversion: CounterVec<1>,
    pub conversion_duration_ms: Histogram,
}

impl Metrics {
    pub fn new(r: &Registry) -> Result<Metrics, MetricsError> {
        let buckets: Vec<f64> = (0..15).map(|i| f64::from(1u32 << i)).collect();
        Ok(Metrics {
            cache_entries: r.gauge("wasm_cache_entries", "number of Wasm remote fetch cache entries.")?,
            cache_lookup: r.counter_vec(
                "wasm_cache_lookup_count",
                "number of Wasm remote fetch cache lookups.",
                &["hit"],
            )?,
            remote_fetch: r.counter_vec(
                "wasm_remote_fetch_count",
                "number of Wasm remote fetches and results, including success, download failure, and checksum mismatch.",
                &["result"],
            )?,
            conversion: r.counter_vec(
                "wasm_config_conversion_count",
                "number of Wasm config conversions and results, including success, no remote load, marshal failure, remote fetch failure, miss remote fetch hint.",
                &["result"],
            )?,
            conversion_duration_ms: r.histogram(
                "wasm_config_conversion_duration",
                "Total time in milliseconds istio-agent spends on converting remote load in Wasm config.",
                &buckets,
            )?,
        })
    }
}
