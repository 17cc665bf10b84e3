//! Starts one sidecar agent (`IDLE_AGENT=meshagent`, default, or `pilot-agent`) against
//! istiod-box as `side_by_side` does, waits until it is ready and settled (10 s), then for
//! `IDLE_SECS` (default 60) records every wake-up of the idle, connected agent: each thread's
//! CPU time from `schedstat` (ns) and switch count, and, unless `IDLE_STRACE=0`, the agent's
//! system calls (`strace -f -tt`, written to `IDLE_STRACE_OUT`, default
//! `target/idle-<agent>.strace`) summarised per thread. A measuring aid for the idle-CPU
//! figure (docs/benchmarks-log.md), not a benchmark: strace slows every system call, so the
//! CPU figures printed while it runs are not the bench's.
#![allow(
    clippy::disallowed_methods,
    reason = "a profiling example, not the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::collections::BTreeMap;
use std::time::Duration;

use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, mesh_with_free_ports, start_agent, workload_a,
};
use meshagent_testkit::{http_get, json};

/// Per thread: (name, run ns, voluntary + involuntary switches).
fn threads(pid: u32) -> BTreeMap<u32, (String, u64, u64)> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let p = e.path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        let sched = std::fs::read_to_string(p.join("schedstat")).unwrap_or_default();
        let mut f = sched.split_whitespace();
        let run: u64 = f.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        let slices: u64 = f.nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
        out.insert(tid, (comm.trim().to_owned(), run, slices));
    }
    out
}

/// The process's (minor, major) page faults so far (`/proc/<pid>/stat` fields 10 and 12).
fn faults(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name, which may contain spaces.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    (
        f.get(7).copied().unwrap_or(0),
        f.get(9).copied().unwrap_or(0),
    )
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let kind = match std::env::var("IDLE_AGENT").as_deref() {
        Ok("pilot-agent") => AgentKind::PilotAgent,
        _ => AgentKind::Meshagent,
    };
    let secs: u64 = std::env::var("IDLE_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh_with_free_ports()), &[]).await;
    let pod = PodSpec {
        proxy_config: json!({}),
        ..PodSpec::new("a", "127.0.0.1")
    };
    let mut s = start_agent(&istiod, kind, &pod).await;
    let pid = s.proc.pid();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !matches!(http_get(s.status, "/healthz/ready").await, Ok((200, _))) {
        if tokio::time::Instant::now() > deadline {
            s.proc.print_log();
            panic!("{kind:?} not ready within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let name = if kind == AgentKind::Meshagent {
        "meshagent"
    } else {
        "pilot-agent"
    };
    let out = std::env::var("IDLE_STRACE_OUT").unwrap_or_else(|_| {
        format!(
            "{}/../../target/idle-{name}.strace",
            env!("CARGO_MANIFEST_DIR")
        )
    });
    let strace = (std::env::var("IDLE_STRACE").as_deref() != Ok("0")).then(|| {
        std::process::Command::new("strace")
            .args(["-f", "-tt", "-qq", "-o", &out, "-p", &pid.to_string()])
            .spawn()
            .expect("strace")
    });
    let before = threads(pid);
    let f0 = faults(pid);
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let after = threads(pid);
    let f1 = faults(pid);
    if let Some(mut st) = strace {
        // SIGINT detaches strace from the agent.
        let _ = std::process::Command::new("kill")
            .args(["-INT", &st.id().to_string()])
            .status();
        let _ = st.wait();
    }
    println!("{name} pid {pid}, {secs} s idle, connected:");
    let mut total = 0u64;
    for (tid, (comm, run, slices)) in &after {
        let (r0, s0) = before.get(tid).map(|b| (b.1, b.2)).unwrap_or((0, 0));
        total += run - r0;
        if slices - s0 > 0 {
            println!(
                "  tid {tid} {comm:16} {:>9.3} ms  {:>5} wake-ups",
                (run - r0) as f64 / 1e6,
                slices - s0
            );
        }
    }
    println!(
        "  all threads {:.3} ms = {:.4} % of a core (under strace if it ran)",
        total as f64 / 1e6,
        total as f64 / 1e9 / secs as f64 * 100.0
    );
    println!(
        "  page faults: {} minor, {} major",
        f1.0 - f0.0,
        f1.1 - f0.1
    );
    if std::env::var("IDLE_STRACE").as_deref() != Ok("0") {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let mut calls: BTreeMap<(String, String), u64> = BTreeMap::new();
        for l in text.lines() {
            let mut f = l.split_whitespace();
            let (Some(tid), Some(_ts), Some(call)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            let call = call.split('(').next().unwrap_or(call).to_owned();
            *calls.entry((tid.to_owned(), call)).or_default() += 1;
        }
        println!("  system calls per thread (strace, {out}):");
        for ((tid, call), n) in calls {
            println!("    {tid:>8} {call:24} {n}");
        }
    }
    s.proc.kill();
}
