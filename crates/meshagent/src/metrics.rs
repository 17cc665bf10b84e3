//! The agent's metrics registry, shared by every module.
//!
//! Istio's agent exports through an OTel→Prometheus bridge that adds the `istio_agent_` prefix
//! but **no** `_total` suffix to counters (`istio_agent_xds_proxy_requests` is a counter).
//! `prometheus-client` appends `_total` to counters, which would rename half of Istio's metrics.
//! The `prometheus` crate (tikv) keeps names and was measured as a replacement
//! (docs/dependencies.md, benches/dependencies.rs): the same output but sorted and without
//! empty families, for +97 KiB of agent binary, +0.4–0.7 MiB settled VmRSS and a 1.6× slower
//! encode; its process collector is not Go's (no network or max-virtual-memory families, an
//! extra `process_threads`), so the `/proc` readers, the name checks and the scrape-time
//! collectors below would stay. So this small registry writes the text exposition format
//! (0.0.4) itself. Each module registers its own families through [`Registry`] and keeps the
//! returned handles.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Prefix of every agent metric, as Istio exports them.
pub const PREFIX: &str = "istio_agent_";

/// A registration the registry refuses. Nothing is registered when one is returned, so a
/// module cannot end up exporting a half-defined or silently shadowed family.
///
/// A label-count mismatch cannot happen at run time: label names and values are arrays of
/// one length `N` ([`CounterVec<N>`], [`Registry::gauge_fn`]), so a child with the wrong
/// number of values does not compile:
///
/// ```compile_fail
/// let r = meshagent::metrics::Registry::new();
/// let v = r.counter_vec("terminations", "help", &["type"]).unwrap();
/// v.with(&["error", "extra"]).inc(); // expected an array of 1 value
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricsError {
    /// Two families would expose the same series name (a histogram also owns its
    /// `_bucket`, `_sum` and `_count` series).
    #[error("metric {0} is already registered")]
    Duplicate(String),
    #[error("invalid metric name {0:?}: expected [a-zA-Z_:][a-zA-Z0-9_:]*")]
    InvalidName(String),
    #[error(
        "metric {metric}: invalid label name {label:?}: expected [a-zA-Z_][a-zA-Z0-9_]*, not starting with __"
    )]
    InvalidLabel { metric: String, label: String },
    #[error("metric {metric}: label {label} is declared twice")]
    DuplicateLabel { metric: String, label: String },
    #[error("histogram {0}: bucket bounds must be finite and strictly increasing")]
    Buckets(String),
}

#[derive(Clone, Default)]
pub struct Registry {
    families: Arc<Mutex<Vec<Family>>>,
}

struct Family {
    name: String,
    help: String,
    kind: &'static str,
    source: Box<dyn Collect>,
}

/// A family's current series in the text format.
trait Collect: Send + Sync {
    fn encode(&self, name: &str, out: &mut String);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Metrics must keep working even if some thread panicked while holding the lock.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn valid_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    !s.starts_with("__")
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The series names a family of this kind writes.
fn series(kind: &str, name: &str) -> Vec<String> {
    if kind == "histogram" {
        ["", "_bucket", "_sum", "_count"]
            .iter()
            .map(|s| format!("{name}{s}"))
            .collect()
    } else {
        vec![name.to_owned()]
    }
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// Adds a family after checking its name, its labels and every series name it would
    /// write against the families already registered.
    fn add(
        &self,
        name: &str,
        help: &str,
        kind: &'static str,
        labels: &[&str],
        source: Box<dyn Collect>,
    ) -> Result<(), MetricsError> {
        let name = format!("{PREFIX}{name}");
        if !valid_metric_name(&name) {
            return Err(MetricsError::InvalidName(name));
        }
        for (i, l) in labels.iter().enumerate() {
            if !valid_label_name(l) || (kind == "histogram" && *l == "le") {
                return Err(MetricsError::InvalidLabel {
                    metric: name,
                    label: (*l).to_owned(),
                });
            }
            if labels[..i].contains(l) {
                return Err(MetricsError::DuplicateLabel {
                    metric: name,
                    label: (*l).to_owned(),
                });
            }
        }
        let mut families = lock(&self.families);
        let new = series(kind, &name);
        for f in families.iter() {
            if let Some(clash) = series(f.kind, &f.name)
                .into_iter()
                .find(|s| new.contains(s))
            {
                return Err(MetricsError::Duplicate(clash));
            }
        }
        families.push(Family {
            name,
            help: help.to_owned(),
            kind,
            source,
        });
        Ok(())
    }

    /// Every registered family name (with [`PREFIX`]), in registration order.
    pub fn names(&self) -> Vec<String> {
        lock(&self.families)
            .iter()
            .map(|f| f.name.clone())
            .collect()
    }

    /// A counter without labels.
    pub fn counter(&self, name: &str, help: &str) -> Result<Counter, MetricsError> {
        Ok(self.counter_vec(name, help, &[])?.with(&[]))
    }

    /// A counter with the given label names; children are created on first use (or
    /// pre-created with [`CounterVec::with`]).
    pub fn counter_vec<const N: usize>(
        &self,
        name: &str,
        help: &str,
        labels: &[&str; N],
    ) -> Result<CounterVec<N>, MetricsError> {
        let v = CounterVec::new(labels);
        self.add(name, help, "counter", labels, Box::new(v.clone()))?;
        Ok(v)
    }

    pub fn gauge(&self, name: &str, help: &str) -> Result<Gauge, MetricsError> {
        Ok(self.gauge_vec(name, help, &[])?.with(&[]))
    }

    pub fn gauge_vec<const N: usize>(
        &self,
        name: &str,
        help: &str,
        labels: &[&str; N],
    ) -> Result<GaugeVec<N>, MetricsError> {
        let v = GaugeVec(CounterVec::new(labels));
        self.add(name, help, "gauge", labels, Box::new(v.clone()))?;
        Ok(v)
    }

    /// A gauge computed at scrape time (e.g. seconds until a certificate expires): `f`
    /// returns the label values (one per label name) and value of each series.
    pub fn gauge_fn<const N: usize>(
        &self,
        name: &str,
        help: &str,
        labels: &[&str; N],
        f: impl Fn() -> Vec<([String; N], f64)> + Send + Sync + 'static,
    ) -> Result<(), MetricsError> {
        let source = FnSource {
            labels: labels.map(str::to_owned),
            f,
        };
        self.add(name, help, "gauge", labels, Box::new(source))
    }

    /// A counter whose value is read at scrape time (e.g. CPU seconds from `/proc`).
    pub fn counter_fn(
        &self,
        name: &str,
        help: &str,
        f: impl Fn() -> f64 + Send + Sync + 'static,
    ) -> Result<(), MetricsError> {
        let source = FnSource {
            labels: [],
            f: move || vec![([], f())],
        };
        self.add(name, help, "counter", &[], Box::new(source))
    }

    pub fn histogram(
        &self,
        name: &str,
        help: &str,
        buckets: &[f64],
    ) -> Result<Histogram, MetricsError> {
        if buckets.iter().any(|b| !b.is_finite()) || buckets.windows(2).any(|w| w[0] >= w[1]) {
            return Err(MetricsError::Buckets(format!("{PREFIX}{name}")));
        }
        let h = Histogram::new(buckets);
        self.add(name, help, "histogram", &[], Box::new(h.clone()))?;
        Ok(h)
    }

    /// Prometheus text format 0.0.4.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        for f in lock(&self.families).iter() {
            let _ = writeln!(out, "# HELP {} {}", f.name, escape_help(&f.help));
            let _ = writeln!(out, "# TYPE {} {}", f.name, f.kind);
            f.source.encode(&f.name, &mut out);
        }
        out
    }
}

struct FnSource<const N: usize, F> {
    labels: [String; N],
    f: F,
}

impl<const N: usize, F> Collect for FnSource<N, F>
where
    F: Fn() -> Vec<([String; N], f64)> + Send + Sync,
{
    fn encode(&self, name: &str, out: &mut String) {
        for (values, x) in (self.f)() {
            let _ = writeln!(out, "{name}{} {}", label_str(&self.labels, &values), fmt(x));
        }
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

fn label_str<const N: usize>(names: &[String; N], values: &[String; N]) -> String {
    if N == 0 {
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
#[allow(
    clippy::disallowed_methods,
    reason = "procfs reads, served from kernel memory; Go's process collector reads them the same way"
)]
pub fn register_process_metrics(registry: &Registry) -> Result<(), MetricsError> {
    registry.counter_fn(
        "process_cpu_seconds_total",
        "Total user and system CPU time spent in seconds.",
        || proc_stat().map_or(0.0, |s| s.cpu_seconds),
    )?;
    registry.gauge_fn(
        "process_open_fds",
        "Number of open file descriptors.",
        &[],
        || {
            std::fs::read_dir("/proc/self/fd")
                .map(|d| vec![([], d.count() as f64)])
                .unwrap_or_default()
        },
    )?;
    registry.gauge_fn(
        "process_max_fds",
        "Maximum number of open file descriptors.",
        &[],
        || {
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                .map(|(soft, _)| vec![([], soft as f64)])
                .unwrap_or_default()
        },
    )?;
    registry.gauge_fn(
        "process_virtual_memory_bytes",
        "Virtual memory size in bytes.",
        &[],
        || status_kib("VmSize:").map_or_else(Vec::new, |v| vec![([], v * 1024.0)]),
    )?;
    registry.gauge_fn(
        "process_virtual_memory_max_bytes",
        "Maximum amount of virtual memory available in bytes.",
        &[],
        || {
            // The soft RLIMIT_AS; unlimited is RLIM_INFINITY (2^64 - 1), as Go's collector
            // reports it.
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_AS)
                .map(|(soft, _)| vec![([], soft as f64)])
                .unwrap_or_default()
        },
    )?;
    registry.gauge_fn(
        "process_resident_memory_bytes",
        "Resident memory size in bytes.",
        &[],
        || status_kib("VmRSS:").map_or_else(Vec::new, |v| vec![([], v * 1024.0)]),
    )?;
    registry.gauge_fn(
        "process_start_time_seconds",
        "Start time of the process since unix epoch in seconds.",
        &[],
        || {
            proc_stat()
                .and_then(|s| s.start_time_seconds)
                .map_or_else(Vec::new, |t| vec![([], t)])
        },
    )?;
    // The network namespace's IP octet counters (`IpExt: InOctets OutOctets` of
    // /proc/self/net/netstat), which Go's collector reports as the process's: in a pod, the
    // pod's traffic.
    registry.counter_fn(
        "process_network_receive_bytes_total",
        "Number of bytes received by the process over the network.",
        || ip_octets().map_or(0.0, |(rx, _)| rx),
    )?;
    registry.counter_fn(
        "process_network_transmit_bytes_total",
        "Number of bytes sent by the process over the network.",
        || ip_octets().map_or(0.0, |(_, tx)| tx),
    )?;
    Ok(())
}

/// `(InOctets, OutOctets)` of the `IpExt:` lines of `/proc/self/net/netstat` (a header line of
/// field names, then one of values).
#[allow(
    clippy::disallowed_methods,
    reason = "procfs, served from kernel memory"
)]
fn ip_octets() -> Option<(f64, f64)> {
    let text = std::fs::read_to_string("/proc/self/net/netstat").ok()?;
    parse_ip_octets(&text)
}

fn parse_ip_octets(text: &str) -> Option<(f64, f64)> {
    let mut ipext = text.lines().filter_map(|l| l.strip_prefix("IpExt:"));
    let (names, values) = (ipext.next()?, ipext.next()?);
    let field = |want: &str| {
        names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find_map(|(n, v)| (n == want).then(|| v.parse::<f64>().ok()).flatten())
    };
    Some((field("InOctets")?, field("OutOctets")?))
}

struct ProcStat {
    cpu_seconds: f64,
    start_time_seconds: Option<f64>,
}

/// Clock ticks per second; 100 on every Linux ABI the agent runs on.
const CLK_TCK: f64 = 100.0;

#[allow(
    clippy::disallowed_methods,
    reason = "procfs, served from kernel memory"
)]
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
#[allow(
    clippy::disallowed_methods,
    reason = "procfs, served from kernel memory"
)]
pub fn status_kib(key: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

// === counters and gauges ===

/// A counter family with `N` labels; children are keyed by `N` label values.
#[derive(Clone)]
pub struct CounterVec<const N: usize> {
    labels: Arc<[String; N]>,
    children: Arc<Mutex<BTreeMap<[String; N], Arc<AtomicU64>>>>,
}

impl<const N: usize> CounterVec<N> {
    fn new(labels: &[&str; N]) -> CounterVec<N> {
        CounterVec {
            labels: Arc::new(labels.map(str::to_owned)),
            children: Arc::default(),
        }
    }

    /// The child for these label values (in label-name order).
    pub fn with(&self, values: &[&str; N]) -> Counter {
        let key = values.map(str::to_owned);
        let cell = lock(&self.children).entry(key).or_default().clone();
        Counter(cell)
    }

    fn encode_with(&self, name: &str, out: &mut String, conv: impl Fn(u64) -> f64) {
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

impl<const N: usize> Collect for CounterVec<N> {
    fn encode(&self, name: &str, out: &mut String) {
        self.encode_with(name, out, |x| x as f64);
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

/// A gauge family with `N` labels.
#[derive(Clone)]
pub struct GaugeVec<const N: usize>(CounterVec<N>);

impl<const N: usize> GaugeVec<N> {
    pub fn with(&self, values: &[&str; N]) -> Gauge {
        let c = self.0.with(values);
        Gauge(c.0)
    }
}

impl<const N: usize> Collect for GaugeVec<N> {
    fn encode(&self, name: &str, out: &mut String) {
        self.0.encode_with(name, out, f64::from_bits);
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
}

impl Collect for Histogram {
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
    fn network_octets_from_netstat() {
        let text = "TcpExt: SyncookiesSent SyncookiesRecv\nTcpExt: 0 0\n\
                    IpExt: InNoRoutes InOctets OutOctets InMcastOctets\nIpExt: 0 1234 567 8\n";
        assert_eq!(parse_ip_octets(text), Some((1234.0, 567.0)));
        assert_eq!(parse_ip_octets("TcpExt: A\nTcpExt: 1\n"), None);
        // The agent's own namespace: the counters exist and are read.
        assert!(ip_octets().is_some());
    }

    #[test]
    fn istio_names_without_total_suffix() {
        let r = Registry::new();
        let c = r
            .counter("xds_proxy_requests", "requests forwarded")
            .unwrap();
        c.inc();
        c.inc();
        let t = r
            .counter_vec("istiod_connection_terminations", "ends", &["type"])
            .unwrap();
        t.with(&["error"]).inc();
        let g = r.gauge("pilot_xds_recv_max", "largest").unwrap();
        g.set_max(10.0);
        g.set_max(5.0);
        r.gauge_fn("cert_expiry_seconds", "ttl", &["resource_name"], || {
            vec![(["default".into()], 42.5)]
        })
        .unwrap();
        let h = r
            .histogram(
                "dns_upstream_request_duration_seconds",
                "lat",
                &[0.001, 1.0],
            )
            .unwrap();
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
        register_process_metrics(&r).unwrap();
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
        r.counter_vec("x", "h", &["l"])
            .unwrap()
            .with(&["a\"b\\c\nd"])
            .inc();
        assert!(r.encode().contains(r#"istio_agent_x{l="a\"b\\c\nd"} 1"#));
    }

    #[test]
    fn registering_a_name_twice_is_an_error_and_keeps_the_first() {
        let r = Registry::new();
        let first = r.counter("xds_proxy_requests", "first").unwrap();
        first.inc();
        // Any kind, any labels: one name is one family.
        let dup = "istio_agent_xds_proxy_requests".to_owned();
        assert_eq!(
            r.counter("xds_proxy_requests", "again").err(),
            Some(MetricsError::Duplicate(dup.clone()))
        );
        assert_eq!(
            r.gauge_vec("xds_proxy_requests", "again", &["type"]).err(),
            Some(MetricsError::Duplicate(dup.clone()))
        );
        assert_eq!(
            r.gauge_fn("xds_proxy_requests", "again", &[], Vec::new)
                .err(),
            Some(MetricsError::Duplicate(dup))
        );
        // A histogram owns its _bucket/_sum/_count series too.
        r.histogram("lat", "h", &[1.0]).unwrap();
        assert_eq!(
            r.counter("lat_count", "clash").err(),
            Some(MetricsError::Duplicate("istio_agent_lat_count".into()))
        );
        r.counter("other_count", "fine").unwrap();
        assert_eq!(
            r.histogram("other", "h", &[1.0]).err(),
            Some(MetricsError::Duplicate("istio_agent_other_count".into()))
        );
        let out = r.encode();
        assert_eq!(
            out.matches("# TYPE istio_agent_xds_proxy_requests ")
                .count(),
            1
        );
        assert!(
            out.contains("# HELP istio_agent_xds_proxy_requests first\n"),
            "{out}"
        );
        assert!(out.contains("istio_agent_xds_proxy_requests 1\n"), "{out}");
    }

    #[test]
    fn bad_names_labels_and_buckets_are_errors() {
        let r = Registry::new();
        assert!(matches!(
            r.counter("bad-name", "h"),
            Err(MetricsError::InvalidName(n)) if n == "istio_agent_bad-name"
        ));
        assert!(matches!(
            r.counter_vec("a", "h", &["type", "type"]),
            Err(MetricsError::DuplicateLabel { label, .. }) if label == "type"
        ));
        for bad in ["__reserved", "1st", "with space", ""] {
            assert!(
                matches!(
                    r.gauge_vec("b", "h", &[bad]),
                    Err(MetricsError::InvalidLabel { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            r.histogram("c", "h", &[1.0, 1.0]),
            Err(MetricsError::Buckets(_))
        ));
        assert!(matches!(
            r.histogram("c", "h", &[f64::NAN]),
            Err(MetricsError::Buckets(_))
        ));
        // Nothing half-registered: the names are still free.
        assert!(r.names().is_empty());
        r.counter_vec("a", "h", &["type"]).unwrap();
        r.histogram("c", "h", &[0.5, 1.0]).unwrap();
    }

    /// Every metric the agent exports, registered by each module's own registration code
    /// into one registry (as one agent does): no clashes, and exactly Istio's names.
    #[test]
    fn every_agent_metric_registers_in_one_registry() {
        let r = Registry::new();
        register_process_metrics(&r).unwrap();
        crate::identity::metrics::Metrics::register(&r).unwrap();
        crate::xds::Metrics::new(&r).unwrap();
        crate::status::EnvoyProbe::new(
            std::net::SocketAddr::from(([127, 0, 0, 1], 15000)),
            tokio::time::Instant::now(),
            &r,
            Arc::default(),
        )
        .unwrap();
        crate::status::MergeMetrics::register(&r).unwrap();
        crate::dns::metrics::Metrics::new(&r).unwrap();
        crate::wasm::metrics::Metrics::new(&r).unwrap();
        let mut names = r.names();
        names.sort();
        let mut want: Vec<String> = [
            "cert_expiry_seconds",
            "dns_cache_evictions_total",
            "dns_cache_hits_total",
            "dns_cache_misses_total",
            "dns_requests_total",
            "dns_upstream_failures_total",
            "dns_upstream_request_duration_seconds",
            "dns_upstream_requests_total",
            "envoy_connection_terminations",
            "istiod_connection_failures",
            "istiod_connection_terminations",
            "merge_dropped_families_total",
            "num_failed_outgoing_requests",
            "num_file_secret_failures_total",
            "file_secret_loads_total",
            "file_secret_resources",
            "num_file_watcher_failures_total",
            "num_outgoing_requests",
            "num_outgoing_retries",
            "outgoing_latency",
            "output_certs_write_failures_total",
            "output_certs_writes_total",
            "pilot_xds_recv_max",
            "process_cpu_seconds_total",
            "process_max_fds",
            "process_open_fds",
            "process_resident_memory_bytes",
            "process_start_time_seconds",
            "process_virtual_memory_bytes",
            "process_virtual_memory_max_bytes",
            "process_network_receive_bytes_total",
            "process_network_transmit_bytes_total",
            "scrape_failures_total",
            "scrapes_total",
            "startup_duration_seconds",
            "wasm_cache_entries",
            "wasm_cache_lookup_count",
            "wasm_config_conversion_count",
            "wasm_config_conversion_duration",
            "wasm_remote_fetch_count",
            "xds_proxy_downstream_stalled",
            "xds_proxy_requests",
            "xds_proxy_responses",
            "xds_proxy_upstream_recv_max",
        ]
        .iter()
        .map(|n| format!("{PREFIX}{n}"))
        .collect();
        want.sort();
        assert_eq!(names, want);
        // A second agent's worth of registrations in the same registry is refused.
        assert!(matches!(
            crate::xds::Metrics::new(&r),
            Err(MetricsError::Duplicate(_))
        ));
    }
}
