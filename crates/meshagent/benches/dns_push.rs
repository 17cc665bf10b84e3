//! DNS proxy of the shipped agent binary: DNS latency during a 10,000-cluster xDS
//! push through the agent, and the agent's RSS with DNS on and a 5,000-name table.
//!
//! The agent runs as a pod runs it (`meshagent proxy sidecar`, testkit `Sidecar`, a real
//! Envoy) with `ISTIO_META_DNS_CAPTURE=true`, in a mount namespace of its own whose
//! `/etc/resolv.conf` is a file the benchmark writes (bind-mounted by a two-line wrapper that
//! `exec`s the agent, so the pid measured is the agent's). devplane serves a 5,000-name NDS
//! table (Kubernetes services in 50 namespaces) and a mesh of 10 services, then switches the
//! mesh to 10,000 services: 10,000 CDS clusters + 10,000 EDS assignments through the agent to
//! Envoy. A dnsmasq on 127.0.53.110 answering the same names from a hosts file is queried
//! at the same rate at the same time by a second dnsperf: the control for what the machine
//! itself (2 shared cores, Envoy applying 10,000 clusters) does to any DNS server's latency.
//!
//! dnsperf 2.10, UDP, `-c 1 -Q <rate> -v` (one line per reply, in completion order; at a
//! throttled rate reply i belongs to second ≈ i / rate): idle (before the push) and during
//! the push (from the mesh write until Envoy has every cluster active, none warming).
//!
//! RSS: `VmRSS` (and anonymous / file-backed) of the agent pid once ready with the table
//! loaded and the idle queries answered, and the same agent binary with DNS off in the same
//! run (the DNS-attributable delta); again after the push.
//!
//! Run: `make bench`, or `make agent && cargo build --release --bins &&
//! MESHAGENT_BIN=$PWD/target/dist/meshagent cargo bench -p meshagent --bench dns_push`.
//! Root (mount namespace, dnsmasq on port 53); `make dnspeers envoy`.
//! Knobs: `DNS_PUSH_QPS` (default 2000), `DNS_PUSH_N` (default 10000).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)] // a benchmark

mod support;
use support::loadavg;
use support::mem::status_kib;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use meshagent_proto::type_url;
use meshagent_testkit::{Devplane, Sidecar, free_port, http_get, wait_for};
use prost::Message as _;

const UPSTREAM: &str = "127.0.53.110";
const TABLE: usize = 5000;
/// Names queried (all in the table, and in dnsmasq's hosts file).
const NAMES: usize = 100;
const IDLE_SECS: u64 = 8;
/// The dnsperf run that covers the push: started 1 s before the mesh write.
const LEAD_SECS: f64 = 1.0;
const WINDOW_SECS: u64 = 40;

fn ns(i: usize) -> String {
    format!("ns-{}", i % 50)
}

fn host(i: usize) -> String {
    format!("svc-{i}.{}.svc.cluster.local", ns(i))
}

fn ip(i: usize) -> String {
    format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256)
}

fn name_table() -> meshagent::dns::NameTable {
    let mut t = meshagent::dns::NameTable::default();
    for i in 0..TABLE {
        t.table.insert(
            host(i),
            meshagent::dns::NameInfo {
                ips: vec![ip(i)],
                registry: "Kubernetes".into(),
                shortname: format!("svc-{i}"),
                namespace: ns(i),
                alt_hosts: vec![],
            },
        );
    }
    t
}

/// Workloads a and b plus `n` services backed by b (one outbound cluster + EDS each).
fn mesh(n: usize, a_app: u16, a_in: u16, b_app: u16, b_in: u16) -> String {
    let mut y = format!(
        "workloads:\n  - name: a\n    serviceAccount: a\n    ports: [{{name: http, port: {a_app}, inboundPort: {a_in}}}]\n  - name: b\n    serviceAccount: b\n    ports: [{{name: http, port: {b_app}, inboundPort: {b_in}}}]\nservices:\n"
    );
    for i in 0..n {
        y.push_str(&format!(
            "  - name: s{i}\n    selector: [b]\n    ports: [{{port: 80, targetPort: {b_app}}}]\n"
        ));
    }
    y
}

struct Dnsmasq(Child);

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `VmRSS / RssAnon / RssFile` in MiB, and the heap mapping's Rss from smaps.
fn rss(pid: u32) -> String {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut heap = 0.0;
    let mut in_heap = false;
    for l in smaps.lines() {
        if l.contains(" [heap]") {
            in_heap = true;
        } else if in_heap && let Some(v) = l.strip_prefix("Rss:") {
            heap = v
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .unwrap_or(0.0);
            in_heap = false;
        }
    }
    let m = |k| status_kib(pid, k) / 1024.0;
    format!(
        "VmRSS {:.2} MiB (anonymous {:.2}, file-backed {:.2}; heap {:.2})",
        m("VmRSS:"),
        m("RssAnon:"),
        m("RssFile:"),
        heap / 1024.0
    )
}

/// One throttled dnsperf run; latencies (ms) in completion order, and the lost count.
fn dnsperf(addr: SocketAddr, queries: &Path, qps: u32, secs: u64) -> (Vec<f64>, u64) {
    let out = Command::new("dnsperf")
        .args(["-s", &addr.ip().to_string(), "-p", &addr.port().to_string()])
        .arg("-d")
        .arg(queries)
        .args(["-c", "1", "-Q", &qps.to_string(), "-l", &secs.to_string()])
        .args(["-t", "2", "-v"])
        .output()
        .expect("dnsperf (make dnspeers)");
    let text = String::from_utf8_lossy(&out.stdout);
    let lat = text
        .lines()
        .filter(|l| l.starts_with("> NOERROR"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .map(|s| s * 1000.0)
        .collect();
    let lost = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Queries lost:"))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // Anything but NOERROR (a SERVFAIL, a timeout line) is a failed query: counted as lost.
    let failed = text
        .lines()
        .filter(|l| l.starts_with("> ") && !l.starts_with("> NOERROR"))
        .count() as u64;
    let lost = lost.max(failed);
    (lat, lost)
}

fn pcts(v: &[f64]) -> String {
    if v.is_empty() {
        return "no replies".into();
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let p = |q: f64| s[((s.len() as f64 * q) as usize).min(s.len() - 1)];
    format!(
        "{:>7} | {:.3} | {:.3} | {:.3} | {:.3}",
        s.len(),
        p(0.5),
        p(0.99),
        p(0.999),
        s[s.len() - 1]
    )
}

async fn active_clusters(admin: SocketAddr) -> Option<(u64, u64)> {
    let (c, body) = http_get(
        admin,
        "/stats?filter=^cluster_manager\\.(active|warming)_clusters$",
    )
    .await
    .ok()?;
    if c != 200 {
        return None;
    }
    let val = |k: &str| {
        body.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix(": ")?.trim().parse().ok())
    };
    Some((
        val("cluster_manager.active_clusters")?,
        val("cluster_manager.warming_clusters")?,
    ))
}

/// The agent binary behind a wrapper that gives it its own mount namespace with `resolv`
/// bind-mounted on /etc/resolv.conf; `exec` all the way, so the pid is the agent's.
fn wrapper(dir: &Path, resolv: &Path) -> PathBuf {
    let real = std::env::var("MESHAGENT_BIN").unwrap_or_else(|_| {
        meshagent_testkit::workspace_bin("meshagent")
            .to_string_lossy()
            .into_owned()
    });
    let w = dir.join("meshagent-in-mntns");
    std::fs::write(
        &w,
        format!(
            "#!/bin/sh\nexec unshare --mount --propagation private sh -c 'mount --bind {} /etc/resolv.conf && exec {real} \"$@\"' meshagent \"$@\"\n",
            resolv.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&w, std::fs::Permissions::from_mode(0o755)).unwrap();
    println!("agent binary: {real}");
    w
}

/// Anonymous mappings of the agent with more than 64 KiB resident, KiB, largest first (where
/// an RSS difference is).
fn anon_maps(pid: u32) -> String {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut out: Vec<(u64, String)> = Vec::new();
    let mut name = String::new();
    for l in smaps.lines() {
        let first = l.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            let f: Vec<&str> = l.split_whitespace().collect();
            let size = f[0]
                .split_once('-')
                .map(|(a, b)| {
                    u64::from_str_radix(b, 16).unwrap_or(0)
                        - u64::from_str_radix(a, 16).unwrap_or(0)
                })
                .unwrap_or(0);
            name = format!(
                "{} {} ({} KiB mapped)",
                f.get(5).unwrap_or(&"anon"),
                f[1],
                size / 1024
            );
        } else if let Some(v) = l.strip_prefix("Anonymous:") {
            let kib: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
            if kib > 64 {
                out.push((kib, name.clone()));
            }
        }
    }
    out.sort_by_key(|b| std::cmp::Reverse(b.0));
    out.iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn main() {
    let qps: u32 = std::env::var("DNS_PUSH_QPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let n: usize = std::env::var("DNS_PUSH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // testkit's Sidecar runs MESHAGENT_BIN: the benchmark runs itself again with the wrapper
    // there (the environment of a running process is not changed in place).
    if std::env::var_os("DNS_PUSH_WRAPPED").is_none() {
        let resolv = dir.path().join("resolv.conf");
        std::fs::write(
            &resolv,
            format!(
                "nameserver {UPSTREAM}\nsearch default.svc.cluster.local svc.cluster.local cluster.local\n"
            ),
        )
        .unwrap();
        let w = wrapper(dir.path(), &resolv);
        let status = Command::new(std::env::current_exe().unwrap())
            .args(std::env::args_os().skip(1))
            .env("DNS_PUSH_WRAPPED", "1")
            .env("MESHAGENT_BIN", &w)
            .status()
            .unwrap();
        std::process::exit(status.code().unwrap_or(1));
    }
    let hosts = dir.path().join("hosts");
    let queries = dir.path().join("queries.txt");
    let picked: Vec<usize> = (0..NAMES).map(|k| k * (TABLE / NAMES)).collect();
    std::fs::write(
        &hosts,
        picked
            .iter()
            .map(|&i| format!("{} {}\n", ip(i), host(i)))
            .collect::<String>(),
    )
    .unwrap();
    std::fs::write(
        &queries,
        picked
            .iter()
            .map(|&i| format!("{} A\n", host(i)))
            .collect::<String>(),
    )
    .unwrap();
    let _dnsmasq = Dnsmasq(
        Command::new("dnsmasq")
            .args([
                "-k",
                "--port=53",
                &format!("--listen-address={UPSTREAM}"),
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                &format!("--addn-hosts={}", hosts.display()),
                "--cache-size=1000",
                &format!("--pid-file={}", dir.path().join("pid").display()),
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("dnsmasq (make dnspeers)"),
    );
    let control: SocketAddr = format!("{UPSTREAM}:53").parse().unwrap();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let (a_app, a_in, b_app, b_in) = (free_port(), free_port(), free_port(), free_port());
        let dp = Devplane::start(&mesh(10, a_app, a_in, b_app, b_in)).await;
        dp.set_resource(type_url::NAME_TABLE, "", &name_table().encode_to_vec())
            .await;
        println!(
            "DNS during a {n}-cluster xDS push through the agent binary (sidecar, real Envoy), {TABLE}-name NDS table; dnsperf -c 1 -Q {qps} -v, UDP, loopback; load at start {}",
            loadavg()
        );

        // DNS off: the same binary, same mesh, for the RSS delta.
        let mut off = Sidecar::start(&dp, "a", "default", "a", &[]).await;
        off.wait_ready(Duration::from_secs(60)).await;
        // Settled: a quiet second after it first turns ready the agent trims the heap and
        // releases the start-up code's pages (src/malloc.rs, src/code_pages.rs); the DNS-on
        // agent is measured after 8 s of queries, i.e. settled too.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let rss_off = format!("{}\n  anonymous > 64 KiB: {}", rss(off.proc.pid()), anon_maps(off.proc.pid()));
        drop(off);
        tokio::time::sleep(Duration::from_millis(500)).await;

        let dns_port = free_port();
        let agent_dns: SocketAddr = format!("127.0.0.1:{dns_port}").parse().unwrap();
        let mut on = Sidecar::start(
            &dp,
            "a",
            "default",
            "a",
            &[
                ("ISTIO_META_DNS_CAPTURE", "true".into()),
                ("DNS_PROXY_ADDR", agent_dns.to_string()),
            ],
        )
        .await;
        on.wait_ready(Duration::from_secs(60)).await;
        let pid = on.proc.pid();
        // The table is in the proxy when a table name resolves (readiness already waited for
        // the first table; this also proves the proxy answers from it).
        let q = queries.clone();
        wait_for("a table name answered", Duration::from_secs(30), || {
            let q = q.clone();
            async move {
                let (lat, _) = tokio::task::spawn_blocking(move || dnsperf(agent_dns, &q, 100, 1))
                    .await
                    .unwrap();
                (!lat.is_empty()).then_some(())
            }
        })
        .await;

        println!("| window | server | replies | p50 ms | p99 ms | p99.9 ms | max ms |");
        println!("|---|---|---|---|---|---|---|");
        let run_both = |secs: u64| {
            let (q1, q2) = (queries.clone(), queries.clone());
            let a = std::thread::spawn(move || dnsperf(agent_dns, &q1, qps, secs));
            let c = std::thread::spawn(move || dnsperf(control, &q2, qps, secs));
            (a, c)
        };
        let (a, c) = run_both(IDLE_SECS);
        let ((a_idle, a_lost), (c_idle, c_lost)) = (a.join().unwrap(), c.join().unwrap());
        println!("| idle ({IDLE_SECS} s, load {}) | agent | {} | lost {a_lost}", loadavg(), pcts(&a_idle));
        println!("| idle | dnsmasq (control) | {} | lost {c_lost}", pcts(&c_idle));
        let rss_on = format!("{}\n  anonymous > 64 KiB: {}", rss(pid), anon_maps(pid));

        // The push: dnsperf runs from LEAD_SECS before the mesh write.
        let (a, c) = run_both(WINDOW_SECS);
        tokio::time::sleep(Duration::from_secs_f64(LEAD_SECS)).await;
        dp.write_mesh(&mesh(n, a_app, a_in, b_app, b_in));
        let t0 = tokio::time::Instant::now();
        let want = n as u64;
        loop {
            if let Some((active, warming)) = active_clusters(on.admin).await
                && active >= want
                && warming == 0
            {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(WINDOW_SECS - 5),
                "the push of {n} clusters did not complete within the dnsperf window"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let push_secs = t0.elapsed().as_secs_f64();
        let load_push = loadavg();
        let ((a_all, a_lost), (c_all, c_lost)) = (a.join().unwrap(), c.join().unwrap());
        let during = |v: &[f64]| -> Vec<f64> {
            let (from, to) = (
                (LEAD_SECS * f64::from(qps)) as usize,
                ((LEAD_SECS + push_secs) * f64::from(qps)) as usize,
            );
            v.get(from..to.min(v.len())).unwrap_or(&[]).to_vec()
        };
        println!(
            "| during the push ({push_secs:.1} s, load {load_push}) | agent | {} | lost {a_lost} (whole window)",
            pcts(&during(&a_all))
        );
        println!(
            "| during the push | dnsmasq (control) | {} | lost {c_lost} (whole window)",
            pcts(&during(&c_all))
        );
        println!("RSS, DNS off, ready: {rss_off}");
        println!("RSS, DNS on, ready, table loaded, {} queries answered: {rss_on}", a_idle.len());
        println!(
            "RSS, DNS on, after the {n}-cluster push: {}\n  anonymous > 64 KiB: {}",
            rss(pid),
            anon_maps(pid)
        );
        if let Some(s) = on.proc.try_wait() {
            on.proc.print_log();
            panic!("agent exited: {s}");
        }
    });
}
