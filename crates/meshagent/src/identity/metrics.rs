//! Identity metrics, Istio's names (`security/pkg/monitoring`; the registry adds `istio_agent_`).

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crate::metrics::{Counter, Gauge, MetricsError, Registry};

#[derive(Clone)]
pub struct Metrics {
    /// `num_outgoing_requests{request_type="csr"}`
    pub csr_requests: Counter,
    /// `outgoing_latency{request_type="csr"}`: cumulative milliseconds.
    pub csr_latency_ms: Counter,
    /// `num_failed_outgoing_requests{request_type="csr"}`
    pub csr_failures: Counter,
    /// `num_outgoing_retries{request_type="csr"}`
    pub csr_retries: Counter,
    /// `num_file_watcher_failures_total`
    pub file_watcher_failures: Counter,
    /// `num_file_secret_failures_total`
    pub file_secret_failures: Counter,
    /// `file_secret_loads_total` (no Istio equivalent): file-secret loads started, so a reload
    /// loop shows up on a dashboard.
    pub file_secret_loads: Counter,
    /// `file_secret_resources` (no Istio equivalent): `file-*` resources currently loaded and
    /// watched; falls when their last subscriber goes.
    pub file_secret_resources: Gauge,
    /// `output_certs_writes_total` (no Istio equivalent): certificate sets written to
    /// OUTPUT_CERTS.
    pub output_certs_writes: Counter,
    /// `output_certs_write_failures_total` (no Istio equivalent): failed OUTPUT_CERTS writes
    /// (each is retried with backoff).
    pub output_certs_write_failures: Counter,
    /// Feeds `cert_expiry_seconds{resource_name="default"}` at scrape time.
    pub expiry: Arc<Mutex<Option<SystemTime>>>,
}

impl Metrics {
    pub fn register(r: &Registry) -> Result<Metrics, MetricsError> {
        let csr = |name: &str, help: &str| {
            Ok::<_, MetricsError>(r.counter_vec(name, help, &["request_type"])?.with(&["csr"]))
        };
        let expiry: Arc<Mutex<Option<SystemTime>>> = Arc::default();
        let e = expiry.clone();
        r.gauge_fn(
            "cert_expiry_seconds",
            "The time remaining, in seconds, before the certificate chain will expire. A negative value indicates the cert is expired.",
            &["resource_name"],
            move || {
                let at = *e.lock().unwrap_or_else(|p| p.into_inner());
                at.map(|at| {
                    let secs = match at.duration_since(SystemTime::now()) {
                        Ok(d) => d.as_secs_f64(),
                        Err(e) => -e.duration().as_secs_f64(),
                    };
                    vec![(["default".to_owned()], secs.round())]
                })
                .unwrap_or_default()
            },
        )?;
        Ok(Metrics {
            csr_requests: csr(
                "num_outgoing_requests",
                "Number of total outgoing requests (e.g. to a token exchange server, CA, etc.)",
            )?,
            csr_latency_ms: csr(
                "outgoing_latency",
                "The latency of outgoing requests (e.g. to a token exchange server, CA, etc.) in milliseconds.",
            )?,
            csr_failures: csr(
                "num_failed_outgoing_requests",
                "Number of failed outgoing requests (e.g. to a token exchange server, CA, etc.)",
            )?,
            csr_retries: csr(
                "num_outgoing_retries",
                "Number of outgoing retry requests (e.g. to a token exchange server, CA, etc.)",
            )?,
            output_certs_writes: r.counter(
                "output_certs_writes_total",
                "Certificate sets written to the OUTPUT_CERTS directory.",
            )?,
            output_certs_write_failures: r.counter(
                "output_certs_write_failures_total",
                "Failed writes of the OUTPUT_CERTS directory; each is retried with backoff.",
            )?,
            file_watcher_failures: r.counter(
                "num_file_watcher_failures_total",
                "Number of times file watcher failed to add watchers",
            )?,
            file_secret_failures: r.counter(
                "num_file_secret_failures_total",
                "Number of times secret generation failed for files",
            )?,
            file_secret_loads: r.counter(
                "file_secret_loads_total",
                "Number of times a file-backed secret was read (initial loads and reloads).",
            )?,
            file_secret_resources: r.gauge(
                "file_secret_resources",
                "Number of file-backed secrets currently loaded and watched.",
            )?,
            expiry,
        })
    }
}
