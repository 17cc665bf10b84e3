//! A process's memory from `/proc`, shared by the benchmarks. VmRSS alone misleads: it drops
//! when clean file pages (code) are unmapped, yet those stay in the page cache and are charged
//! to the pod, so every figure is reported with RssAnon (what the process itself holds) and Pss
//! (its fair share of everything mapped) beside it.
//!
//! Included with `#[path = "support/mem.rs"] mod mem;` so benchmarks that do not need the
//! N-agent harness in `support/mod.rs` do not compile it.
#![allow(dead_code)]

/// A `/proc/<pid>/status` field in KiB (e.g. `"VmRSS:"`), NaN when absent.
pub fn status_kib(pid: u32, key: &str) -> f64 {
    kib_field(&format!("/proc/{pid}/status"), key)
}

/// Pss in KiB from `/proc/<pid>/smaps_rollup`, NaN when absent.
pub fn pss_kib(pid: u32) -> f64 {
    kib_field(&format!("/proc/{pid}/smaps_rollup"), "Pss:")
}

fn kib_field(path: &str, key: &str) -> f64 {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(f64::NAN)
}

/// One reading, in MiB.
#[derive(Clone, Copy, Debug)]
pub struct Mem {
    pub vm_rss: f64,
    pub rss_anon: f64,
    pub pss: f64,
    pub vm_hwm: f64,
}

impl Mem {
    pub fn of(pid: u32) -> Mem {
        let m = |k| status_kib(pid, k) / 1024.0;
        Mem {
            vm_rss: m("VmRSS:"),
            rss_anon: m("RssAnon:"),
            pss: pss_kib(pid) / 1024.0,
            vm_hwm: m("VmHWM:"),
        }
    }
}

impl std::fmt::Display for Mem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "VmRSS {:.2} MiB, RssAnon {:.2}, Pss {:.2}, VmHWM {:.2}",
            self.vm_rss, self.rss_anon, self.pss, self.vm_hwm
        )
    }
}
