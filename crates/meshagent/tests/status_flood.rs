//! A peer on the pod network holding thousands of idle connections to the status port
//! (`meshagent proxy` with `DISABLE_ENVOY=true`, run in a network namespace of its own): the
//! holder runs on a thread of the test moved into a second namespace joined to the pod's by a
//! veth pair, so its connections come from a non-loopback address, and re-opens every
//! connection the agent closes. Kubelet-style probes from another address of that namespace
//! and local probes from the pod's loopback must keep being answered.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use meshagent_testkit::{DEADLINE, Proc, free_port, status_only_agent, wait_for};
use serde_json::json;

/// Two namespaces joined by a veth pair: `pod` (`eth0` = `pod_ip`) where the agent runs,
/// `peer` (`eth0` = `holder_ip` and `kubelet_ip`). Removed on drop.
struct Pair {
    pod: String,
    peer: String,
    pod_ip: IpAddr,
    holder_ip: IpAddr,
    kubelet_ip: IpAddr,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(out.status.success(), "ip {args:?}: {out:?}");
}

impl Pair {
    fn new(tag: &str, subnet: u8) -> Pair {
        let id = std::process::id();
        let p = Pair {
            pod: format!("ma-{tag}-pod-{id}"),
            peer: format!("ma-{tag}-peer-{id}"),
            pod_ip: IpAddr::from([10, 253, subnet, 2]),
            holder_ip: IpAddr::from([10, 253, subnet, 3]),
            kubelet_ip: IpAddr::from([10, 253, subnet, 4]),
        };
        for ns in [&p.pod, &p.peer] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        ip(&[
            "-n", &p.pod, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p",
        ]);
        ip(&[
            "-n", &p.pod, "link", "set", "eth0p", "netns", &p.peer, "name", "eth0",
        ]);
        let addrs = [
            (&p.pod, p.pod_ip),
            (&p.peer, p.holder_ip),
            (&p.peer, p.kubelet_ip),
        ];
        for (ns, a) in addrs {
            ip(&["-n", ns, "addr", "add", &format!("{a}/24"), "dev", "eth0"]);
        }
        for ns in [&p.pod, &p.peer] {
            ip(&["-n", ns, "link", "set", "eth0", "up"]);
        }
        p
    }

    fn command(ns: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, program]);
        c
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for ns in [&self.pod, &self.peer] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// The agent in the pod namespace, with one HTTP app probe on a python http.server there.
fn agent_cmd(pair: &Pair, cwd: &Path, status: u16, web: u16, nofile: Option<u64>) -> Command {
    let probers = json!({
        "/app-health/web/livez": {"httpGet": {"path": "/healthz", "port": web}, "timeoutSeconds": 2},
    });
    let bin = env!("CARGO_BIN_EXE_meshagent");
    let mut cmd = match nofile {
        // prlimit sets both limits, so the agent cannot raise its soft limit.
        Some(n) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--nofile={n}:{n}"))
                .args(["--", "ip", "netns", "exec", &pair.pod, bin]);
            c
        }
        None => Pair::command(&pair.pod, bin),
    };
    status_only_agent(&mut cmd, cwd, status).env("ISTIO_KUBE_APP_PROBERS", probers.to_string());
    cmd
}

/// Counters of the holder thread.
#[derive(Default)]
struct HolderStats {
    open: AtomicU64,
    opened: AtomicU64,
    closed_by_agent: AtomicU64,
    connect_errors: AtomicU64,
}

/// Holds `n` idle connections from `from` to `to` (never sending a byte) in namespace `ns`,
/// re-opening each one as soon as the agent closes it, until `stop`.
fn hold(
    ns: &str,
    from: IpAddr,
    to: SocketAddr,
    n: usize,
    stats: Arc<HolderStats>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let netns = std::fs::File::open(format!("/var/run/netns/{ns}")).unwrap();
    std::thread::spawn(move || {
        // Only this thread moves; sockets it creates belong to the peer namespace.
        nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut tasks = Vec::new();
            for _ in 0..n {
                let (stats, stop) = (stats.clone(), stop.clone());
                tasks.push(tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let sock = tokio::net::TcpSocket::new_v4().unwrap();
                        sock.bind(SocketAddr::new(from, 0)).unwrap();
                        let Ok(Ok(mut tcp)) =
                            tokio::time::timeout(Duration::from_secs(5), sock.connect(to)).await
                        else {
                            stats.connect_errors.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        };
                        stats.opened.fetch_add(1, Ordering::Relaxed);
                        stats.open.fetch_add(1, Ordering::Relaxed);
                        let mut buf = [0u8; 64];
                        loop {
                            tokio::select! {
                                r = tokio::io::AsyncReadExt::read(&mut tcp, &mut buf) => {
                                    if matches!(r, Ok(0) | Err(_)) { break; }
                                }
                                () = tokio::time::sleep(Duration::from_millis(200)) => {
                                    if stop.load(Ordering::Relaxed) { break; }
                                }
                            }
                        }
                        stats.open.fetch_sub(1, Ordering::Relaxed);
                        if !stop.load(Ordering::Relaxed) {
                            stats.closed_by_agent.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
        });
    })
}

/// One GET with curl in namespace `ns` (from `from` when given) within 2 s: (code, seconds).
fn probe(ns: &str, from: Option<IpAddr>, url: &str) -> (u16, f64, String) {
    let mut c = Pair::command(ns, "curl");
    c.args(["-s", "-o", "/dev/null", "--max-time", "2"]);
    c.args(["-w", "%{http_code} %{time_total}"]);
    if let Some(a) = from {
        c.args(["--interface", &a.to_string()]);
    }
    let out = c.arg(url).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut it = text.split_whitespace();
    let code = it.next().and_then(|s| s.parse().ok()).unwrap_or(0);
    let secs = it.next().and_then(|s| s.parse().ok()).unwrap_or(f64::NAN);
    (
        code,
        secs,
        format!("{text} {}", String::from_utf8_lossy(&out.stderr)),
    )
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn soft_nofile(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/limits"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or("")
        .to_owned()
}

/// Starts the agent, holds `held` idle connections from the peer namespace, and asserts that
/// three readiness and three app probes from the "kubelet" address and from the pod's
/// loopback are each answered 200 within 2 s.
async fn flood_and_probe(tag: &str, subnet: u8, held: usize, nofile: Option<u64>) {
    // One flood at a time: they share the machine's cores with everything else.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _turn = ONE_AT_A_TIME.lock().await;
    meshagent::app::raise_fd_limit();
    let pair = Pair::new(tag, subnet);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("healthz"), "ok").unwrap();
    let web = free_port();
    let mut cmd = Pair::command(&pair.pod, "python3");
    cmd.args(["-m", "http.server", "--bind", "127.0.0.1"])
        .arg(web.to_string())
        .current_dir(dir.path());
    let _web = Proc::spawn("app-http-server", cmd, dir.path());
    let status = free_port();
    let cwd = tempfile::tempdir().unwrap();
    let agent = Proc::spawn(
        "agent",
        agent_cmd(&pair, cwd.path(), status, web, nofile),
        cwd.path(),
    );
    let ready_url = format!("http://{}:{status}/healthz/ready", pair.pod_ip);
    let app_url = format!("http://{}:{status}/app-health/web/livez", pair.pod_ip);
    let (peer, kubelet) = (pair.peer.clone(), pair.kubelet_ip);
    wait_for("the agent to answer /app-health", DEADLINE, || {
        let (peer, url) = (peer.clone(), app_url.clone());
        async move { (probe(&peer, Some(kubelet), &url).0 == 200).then_some(()) }
    })
    .await;
    if nofile.is_none() {
        // The agent raised its soft limit to the hard limit, as Go's runtime does.
        let limits = soft_nofile(agent.pid());
        let f: Vec<&str> = limits.split_whitespace().collect();
        assert!(f.len() >= 5 && f[3] == f[4], "{limits}");
    }

    let stats = Arc::new(HolderStats::default());
    let stop = Arc::new(AtomicBool::new(false));
    let holder = hold(
        &pair.peer,
        pair.holder_ip,
        SocketAddr::new(pair.pod_ip, status),
        held,
        stats.clone(),
        stop.clone(),
    );
    let report = |stats: &HolderStats| {
        format!(
            "holder: open {} opened {} closed by the agent {} connect errors {}; agent RSS {} KiB",
            stats.open.load(Ordering::Relaxed),
            stats.opened.load(Ordering::Relaxed),
            stats.closed_by_agent.load(Ordering::Relaxed),
            stats.connect_errors.load(Ordering::Relaxed),
            rss_kib(agent.pid()),
        )
    };
    let t0 = Instant::now();
    wait_for(&format!("{held} connections opened"), DEADLINE, || {
        let stats = stats.clone();
        async move { (stats.opened.load(Ordering::Relaxed) >= held as u64).then_some(()) }
    })
    .await;
    eprintln!(
        "{tag}: {held} opened in {:?}; {}",
        t0.elapsed(),
        report(&stats)
    );

    let mut failures = Vec::new();
    for round in 0..3 {
        for (who, ns, from, url) in [
            ("kubelet", &pair.peer, Some(kubelet), &ready_url),
            ("kubelet", &pair.peer, Some(kubelet), &app_url),
            (
                "loopback",
                &pair.pod,
                None,
                &format!("http://127.0.0.1:{status}/healthz/ready"),
            ),
            (
                "loopback",
                &pair.pod,
                None,
                &format!("http://127.0.0.1:{status}/app-health/web/livez"),
            ),
        ] {
            let started = Instant::now();
            let (code, secs, raw) = probe(ns, from, url);
            let took = started.elapsed();
            eprintln!("{tag} round {round}: {who} {url} -> {code} in {secs}s ({took:?})");
            // curl's own --max-time 2 bounds the answer; a code of 200 means answered in time.
            if code != 200 || secs.is_nan() || secs >= 2.0 {
                failures.push(format!("{who} {url}: {raw}"));
            }
        }
        eprintln!("{tag} round {round}: {}", report(&stats));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let summary = report(&stats);
    stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || holder.join()).await;
    assert!(
        failures.is_empty(),
        "{tag}: probes failed with {held} idle connections held:\n{}\n{summary}\nagent log:\n{}",
        failures.join("\n"),
        agent.log_text()
    );
    eprintln!("{tag}: {summary}");
    for l in agent
        .log_text()
        .lines()
        .filter(|l| l.contains("status server"))
    {
        eprintln!("{tag}: agent: {l}");
    }
}

/// A peer holding 1,100 idle connections (more than the old fixed cap of 1,024) and
/// re-opening each one the agent closes: readiness and app probes are still answered.
#[tokio::test]
async fn probes_answered_with_1100_idle_connections_held() {
    flood_and_probe("r3a", 1, 1100, None).await;
}

/// The same with 5,000 held idle connections.
#[tokio::test]
async fn probes_answered_with_5000_idle_connections_held() {
    flood_and_probe("r3b", 2, 5000, None).await;
}

/// The agent started with `RLIMIT_NOFILE` 1024 (soft and hard, so it cannot raise it) and
/// 1,100 idle connections held: more than it has file descriptors for, so it must close old
/// idle connections to serve the probes rather than run out of descriptors.
#[tokio::test]
async fn readiness_answers_under_nofile_1024_with_1100_idle_connections() {
    flood_and_probe("d4", 3, 1100, Some(1024)).await;
}
