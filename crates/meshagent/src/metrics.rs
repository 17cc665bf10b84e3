//! The agent's metrics registry, shared by every module.
//!
//! Istio's agent exports through an OTel→Prometheus bridge that adds the `istio_agent_` prefix
//! but **no** `_total` suffix to counters (`istio_agent_xds_proxy_requests` is a counter). Common
//! Rust Prometheus crates always append `_total` to counters, which would rename half of Istio's
//! metrics, so this small registry writes the text exposition format (0.0.4) itself. Each module
//! registers its own families through [`Registry`] and keeps the returned handles.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Prefix of every agent metric, as Istio exports them.
pub const PREFIX: &str = "istio_agent_";

#[derive(Clone, Default)]
pub struct Registry {
    families: Arc<Mutex<Vec<Family>>>,
}

struct Family {
    name: String,
    help: String,
    kind: &'static str,
    source: Source,
}

enum Source {
    Counter(CounterVec),
    Gauge(GaugeVec),
    GaugeFn(
        Box<dyn Fn() -> Vec<(Vec<String>, f64)> + Send + Sync>,
        Vec<String>,
    ),
    Histogram(Histogram),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Metrics must keep working even if some thread panicked while holding the lock.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    fn add(&self, name: &str, help: &str, kind: &'static str, source: Source) {
        let mut f = lock(&self.families);
        let name = format!("{PREFIX}{name}");
        // Registering twice (e.g. two agents in one test process) keeps the first family.
        if f.iter().any(|x| x.name == name) {
            return;
        }
        f.push(Family {
            name,
            help: help.to_owned(),
            kind,
            source,
        });
    }

    /// A counter without labels.
    pub fn counter(&self, name: &str, help: &str) -> Counter {
        let v = self.counter_vec(name, help, &[]);
        v.with(&[])
    }

    /// A counter with the given label names; children are created on first use (or
    /// pre-created with [`CounterVec::with`]).
    pub fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> CounterVec {
        let v = CounterVec::new(labels);
        self.add(name, help, "counter", Source::Counter(v.clone()));
        v
    }

    pub fn gauge(&self, name: &str, help: &str) -> Gauge {
        self.gauge_vec(name, help, &[]).with(&[])
    }

    pub fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
        let v = GaugeVec(CounterVec::new(labels));
        self.add(name, help, "gauge", Source::Gauge(v.clone()));
        v
    }

    /// A gauge computed at scrape time (e.g. seconds until a certificate expires).
    pub fn gauge_fn(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        f: impl Fn() -> Vec<(Vec<String>, f64)> + Send + Sync + 'static,
    ) {
        let labels = labels.iter().map(|s| s.to_string()).collect();
        self.add(name, help, "gauge", Source::GaugeFn(Box::new(f), labels));
    }

    /// A counter whose value is read at scrape time (e.g. CPU seconds from `/proc`).
    pub fn counter_fn(&self, name: &str, help: &str, f: impl Fn() -> f64 + Send + Sync + 'static) {
        self.add(
            name,
            help,
            "counter",
            Source::GaugeFn(Box::new(move || vec![(Vec::new(), f())]), Vec::new()),
        );
    }

    pub fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Histogram {
        let h = Histogram::new(buckets);
        self.add(name, help, "histogram", Source::Histogram(h.clone()));
        h
    }

    /// Prometheus text format 0.0.4.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        for f in lock(&self.families).iter() {
            let _ = writeln!(out, "# HELP {} {}", f.name, escape_help(&f.help));
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind);
            match &f.source {
                Source::Counter(v) => v.encode(&f.name, &mut out, |x| x as f64),
                Source::Gauge(v) => v.0.encode(&f.name, &mut out, f64::from_bits),
                Source::GaugeFn(func, labels) => {
                    for (values, x) in func() {
                        let _ =
                            writeln!(out, "{}{} {}", f.name, label_str(labels, &values), fmt(x));
                    }
                }
                Source::Histogram(h) => h.encode(&f.name, &mut out),
            }
        }
        out
    }
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('\n', "\\n")
        .replace('"', "\\\"")
}

fn label_str(names: &[String], values: &[String]) -> String {
    if names.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = names
        .iter()
        .zip(values)
        .map(|(n, v)| format!("{n}=\"{}\"", escape_value(v)))
        .collect();
    format!("{{{}}}", parts.join(","))
}

fn fmt(x: f64) -> String {
    if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        }
    } else {
        format!("{x}")
    }
}

// === process metrics ===

/// Go's process collector, as Istio exports it (`istio_agent_process_*`), read from `/proc/self`.
/// Linux only; on read errors the family is simply empty for that scrape.
pub fn register_process_metrics(registry: &Registry) {
    registry.counter_fn(
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds.",
        || proc_stat().map_or(0.0, |s| s.cpu_seconds),
    );
    registry.gauge_fn(
        "process_open_fds",
        "Number of open file descriptors.",
        &[],
        || {
            std::fs::read_dir("/proc/self/fd")
                .map(|d| vec![(Vec::new(), d.count() as f64)])
                .unwrap_or_default()
        },
    );
    registry.gauge_fn(
        "process_max_fds",
        "Maximum number of open file descriptors.",
        &[],
        || {
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .map(|(soft, _)| vec![(Vec::new(), soft as f64)])
                .unwrap_or_default()
        },
    );
    registry.gauge_fn(
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        &[],
        || status_kib("VmSize:").map_or_else(Vec::new, |v| vec![(Vec::new(), v * 1024.0)]),
    );
    registry.gauge_fn(
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        &[],
        || status_kib("VmRSS:").map_or_else(Vec::new, |v| vec![(Vec::new(), v * 1024.0)]),
    );
    registry.gauge_fn(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        &[],
        || {
            proc_stat()
                .and_then(|s| s.start_time_seconds)
                .map_or_else(Vec::new, |t| vec![(Vec::new(), t)])
        },
    );
}

struct ProcStat {
    cpu_seconds: f64,
    start_time_seconds: Option<f64>,
}

/// Clock ticks per second; 100 on every Linux ABI the agent runs on.
const CLK_TCK: f64 = 100.0;

fn proc_stat() -> Option<ProcStat> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name (which may contain spaces).
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state): utime=14, stime=15, starttime=22.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let start_ticks: Option<f64> = fields.get(19).and_then(|s| s.parse().ok());
    let btime = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    });
    Some(ProcStat {
        cpu_seconds: (utime + stime) / CLK_TCK,
        start_time_seconds: btime.zip(start_ticks).map(|(b, t)| b + t / CLK_TCK),
    })
}

/// A `kB` value from `/proc/self/status` (`VmRSS:`, `VmHWM:`, ...).
pub fn status_kib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

// === counters and gauges ===

#[derive(Clone)]
pub struct CounterVec {
    labels: Arc<Vec<String>>,
    children: Arc<Mutex<BTreeMap<Vec<String>, Arc<AtomicU64>>>>,
}

impl CounterVec {
    fn new(labels: &[&str]) -> CounterVec {
        CounterVec {
            labels: Arc::new(labels.iter().map(|s| s.to_string()).collect()),
            children: Arc::default(),
        }
    }

    /// The child for these label values (in label-name order).
    pub fn with(&self, values: &[&str]) -> Counter {
        let key: Vec<String> = values.iter().map(|s| s.to_string()).collect();
        let cell = lock(&self.children).entry(key).or_default().clone();
        Counter(cell)
    }

    fn encode(&self, name: &str, out: &mut String, conv: impl Fn(u64) -> f64) {
        for (values, cell) in lock(&self.children).iter() {
            let _ = writeln!(
                out,
                "{name}{} {}",
                label_str(&self.labels, values),
                fmt(conv(cell.load(Ordering::Relaxed)))
            );
        }
    }
}

#[derive(Clone, Default)]
pub struct Counter(Arc<AtomicU64>);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

#[derive(Clone)]
pub struct GaugeVec(CounterVec);

impl GaugeVec {
    pub fn with(&self, values: &[&str]) -> Gauge {
        let c = self.0.with(values);
        Gauge(c.0)
    }
}

/// An f64 gauge (stored as bits).
#[derive(Clone, Default)]
pub struct Gauge(Arc<AtomicU64>);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
    /// Raises the gauge to `v` if larger (for "largest message seen").
    pub fn set_max(&self, v: f64) {
        let mut cur = self.0.load(Ordering::Relaxed);
        while v > f64::from_bits(cur) {
            match self.0.compare_exchange_weak(
                cur,
                v.to_bits(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }
}

// === histogram ===

#[derive(Clone)]
pub struct Histogram {
    bounds: Arc<Vec<f64>>,
    state: Arc<Mutex<(Vec<u64>, f64, u64)>>,
}

impl Histogram {
    fn new(buckets: &[f64]) -> Histogram {
        Histogram {
            bounds: Arc::new(buckets.to_vec()),
            state: Arc::new(Mutex::new((vec![0; buckets.len()], 0.0, 0))),
        }
    }

    pub fn observe(&self, v: f64) {
        let mut s = lock(&self.state);
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            s.0[i] += 1;
        }
        s.1 += v;
        s.2 += 1;
    }

    fn encode(&self, name: &str, out: &mut String) {
        let s = lock(&self.state);
        let mut cumulative = 0;
        for (b, n) in self.bounds.iter().zip(&s.0) {
            cumulative += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{}\"}} {cumulative}", fmt(*b));
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", s.2);
        let _ = writeln!(out, "{name}_sum {}", fmt(s.1));
        let _ = writeln!(out, "{name}_count {}", s.2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn istio_names_without_total_suffix() {
        let r = Registry::new();
        let c = r.counter("xds_proxy_requests", "requests forwarded");
        c.inc();
        c.inc();
        let t = r.counter_vec("istiod_connection_terminations", "ends", &["type"]);
        t.with(&["error"]).inc();
        let g = r.gauge("pilot_xds_recv_max", "largest");
        g.set_max(10.0);
        g.set_max(5.0);
        r.gauge_fn("cert_expiry_seconds", "ttl", &["resource_name"], || {
            vec![(vec!["default".into()], 42.5)]
        });
        let h = r.histogram(
            "dns_upstream_request_duration_seconds",
            "lat",
            &[0.001, 1.0],
        );
        h.observe(0.5);
        let out = r.encode();
        assert!(
            out.contains(
                "# TYPE istio_agent_xds_proxy_requests counter\nistio_agent_xds_proxy_requests 2\n"
            ),
            "{out}"
        );
        assert!(out.contains("istio_agent_istiod_connection_terminations{type=\"error\"} 1"));
        assert!(out.contains("istio_agent_pilot_xds_recv_max 10\n"));
        assert!(out.contains("istio_agent_cert_expiry_seconds{resource_name=\"default\"} 42.5"));
        assert!(
            out.contains("istio_agent_dns_upstream_request_duration_seconds_bucket{le=\"1\"} 1")
        );
        assert!(out.contains("istio_agent_dns_upstream_request_duration_seconds_count 1"));
        assert!(!out.contains("_total"), "{out}");
    }

    #[test]
    fn process_metrics_from_proc() {
        let r = Registry::new();
        register_process_metrics(&r);
        let out = r.encode();
        for name in [
            "istio_agent_process_cpu_seconds_total ",
            "istio_agent_process_open_fds ",
            "istio_agent_process_max_fds ",
            "istio_agent_process_resident_memory_bytes ",
            "istio_agent_process_start_time_seconds ",
        ] {
            assert!(out.contains(name), "{name} missing in {out}");
        }
        assert!(out.contains("# TYPE istio_agent_process_cpu_seconds_total counter"));
    }

    #[test]
    fn label_values_are_escaped() {
        let r = Registry::new();
        r.counter_vec("x", "h", &["l"]).with(&["a\"b\\c\nd"]).inc();
        assert!(r.encode().contains(r#"istio_agent_x{l="a\"b\\c\nd"} 1"#));
    }
}
