//! DNS proxy benchmark: dnsperf 2.10 on loopback, UDP, fixed flags, same run.
//!
//! * table: the proxy answering 100 names from a 5,000-name NDS table, vs dnsmasq answering
//!   the same 100 names from a hosts file;
//! * forwarding: the proxy (cache off) forwarding 100 unknown names to that dnsmasq, vs
//!   querying dnsmasq directly; and the same with the proxy's cache on.
//!
//! Each case: saturated `dnsperf -c 1 -q 100 -l 5` (QPS, mean latency), then a throttled
//! `-c 1 -Q 5000 -l 3 -v` run for p50/p99 (dnsperf prints no percentiles; `-v` gives one line
//! per reply). The proxy runs on its own current-thread runtime, as in the agent. Each row
//! also gives, for the saturated run, the serving thread's CPU per answered query and its
//! share of a core, and dnsperf's cores: with both near one core, QPS is the inverse of the
//! server's CPU per query. dnsperf runs on CPU 0 and the server under test on the last CPU
//! (`DNS_BENCH_PIN=0`: unpinned).
//!
//! `cargo bench -p meshagent --bench dns` (or `make bench`); needs dnsmasq and dnsperf
//! (`make dnspeers`) and root (dnsmasq listens on 127.0.53.100:53, as resolv.conf implies).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::print_stdout)] // a benchmark binary, not the agent

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

#[path = "support/relay.rs"]
mod relay;

use meshagent::dns::{self, NameInfo, NameTable};
use meshagent::metrics::Registry;

const UPSTREAM: &str = "127.0.53.100";
const NAMES: usize = 100;
const TABLE: usize = 5000;

struct Dnsmasq(Child);

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn table() -> NameTable {
    let mut t = NameTable::default();
    for i in 0..TABLE {
        let ns = format!("ns-{}", i % 50);
        let short = format!("svc-{i}");
        t.table.insert(
            format!("{short}.{ns}.svc.cluster.local"),
            NameInfo {
                ips: vec![format!("10.{}.{}.{}", i / 65536, (i / 256) % 256, i % 256)],
                registry: "Kubernetes".into(),
                shortname: short,
                namespace: ns,
                alt_hosts: vec![],
            },
        );
    }
    t
}

fn mesh_name(i: usize) -> String {
    format!("svc-{i}.ns-{}.svc.cluster.local", i % 50)
}

fn ext_name(i: usize) -> String {
    format!("ext-{i}.bench.local")
}

struct Run {
    qps: f64,
    mean_ms: f64,
    p50_ms: f64,
    p99_ms: f64,
    lost: u64,
    /// The server's CPU (one thread: the proxy's or dnsmasq's) per answered query in the
    /// saturated run, µs; and its share of one core there.
    server_us: f64,
    server_busy: f64,
    /// dnsperf's CPU in the saturated run, in cores (it runs several threads).
    client_cores: f64,
}

/// CPU placement, unless `DNS_BENCH_PIN=0`: the server under test (dnsmasq, the proxy's
/// thread, the relay's) on the last CPU, dnsperf on CPU 0. Unpinned, the scheduler sometimes
/// puts the server next to one of dnsperf's threads, and every server's cost per query moves
/// by ±15 % from run to run with where it lands; pinned, both servers of a comparison get
/// the same placement.
fn pinned() -> Option<(usize, usize)> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpus >= 2 && std::env::var("DNS_BENCH_PIN").as_deref() != Ok("0")).then_some((0, cpus - 1))
}

/// A command run under `taskset -c <cpu>` when pinning is on.
fn placed(program: &str, cpu: impl Fn((usize, usize)) -> usize) -> Command {
    match pinned() {
        Some(p) => {
            let mut c = Command::new("taskset");
            c.args(["-c", &cpu(p).to_string(), program]);
            c
        }
        None => Command::new(program),
    }
}

/// Pins the calling thread (a server) to the server CPU when pinning is on.
fn pin_server_thread() {
    if let Some((_, cpu)) = pinned() {
        let mut set = nix::sched::CpuSet::new();
        set.set(cpu).unwrap();
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).unwrap();
    }
}

/// Cumulative CPU time of one thread, ns (`/proc/<pid>/task/<tid>/schedstat`'s first field).
fn thread_cpu_ns(task: &std::path::Path) -> u64 {
    std::fs::read_to_string(task.join("schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// CPU used by this process's waited-for children (dnsperf), ns: `cutime + cstime` of
/// `/proc/self/stat`, in USER_HZ (100 on Linux) ticks.
fn children_cpu_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(") ").map_or("", |(_, r)| r);
    let f: Vec<u64> = after
        .split_whitespace()
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // Fields 16 and 17 of proc(5), counted from `state` (field 3) here.
    (f.get(13).unwrap_or(&0) + f.get(14).unwrap_or(&0)) * 10_000_000
}

/// `server`: the `/proc` task directory of the server's one serving thread.
fn dnsperf(addr: SocketAddr, queries: &std::path::Path, server: &std::path::Path) -> Run {
    let base = |extra: &[&str]| {
        let out = placed("dnsperf", |(client, _)| client)
            .args(["-s", &addr.ip().to_string(), "-p", &addr.port().to_string()])
            .arg("-d")
            .arg(queries)
            .args(["-c", "1"])
            .args(extra)
            .output()
            .expect("dnsperf (make dnspeers)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (cpu0, kids0, t0) = (
        thread_cpu_ns(server),
        children_cpu_ns(),
        tokio::time::Instant::now(),
    );
    let sat = base(&["-q", "100", "-l", "5"]);
    let (cpu1, kids1, wall) = (thread_cpu_ns(server), children_cpu_ns(), t0.elapsed());
    let field = |text: &str, key: &str| -> f64 {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(key))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let qps = field(&sat, "Queries per second:");
    let answered = field(&sat, "Queries completed:");
    let server_ns = cpu1.saturating_sub(cpu0) as f64;
    let mean_ms = field(&sat, "Average Latency (s):") * 1000.0;
    let lost = field(&sat, "Queries lost:") as u64;
    let verbose = base(&["-Q", "5000", "-l", "3", "-v"]);
    let mut lat: Vec<f64> = verbose
        .lines()
        .filter(|l| l.starts_with('>'))
        .filter_map(|l| l.split_whitespace().last()?.parse().ok())
        .collect();
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let pct = |p: f64| {
        if lat.is_empty() {
            f64::NAN
        } else {
            lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)] * 1000.0
        }
    };
    Run {
        qps,
        mean_ms,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        lost,
        server_us: server_ns / 1000.0 / answered,
        server_busy: server_ns / wall.as_nanos() as f64,
        client_cores: kids1.saturating_sub(kids0) as f64 / wall.as_nanos() as f64,
    }
}

/// Starts the proxy on its own current-thread runtime (like the agent); returns its address.
fn proxy(
    resolv: &std::path::Path,
    cache: usize,
) -> (
    SocketAddr,
    std::path::PathBuf,
    tokio_util::sync::CancellationToken,
) {
    let (tx, rx) = std::sync::mpsc::channel();
    let resolv = resolv.to_path_buf();
    let stop = tokio_util::sync::CancellationToken::new();
    let stop2 = stop.clone();
    std::thread::spawn(move || {
        pin_server_thread();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let opts = dns::Options {
                addr: "127.0.0.1:0".into(),
                resolv_conf: resolv,
                parallel: false,
                timeout: Duration::from_secs(5),
                cache_size: cache,
                cache_bytes: dns::cache::DEFAULT_BYTES,
                allow_non_loopback: false,
                forward_before_table: false,
                servers: meshagent::supervise::Servers::new(),
                // `DNS_BENCH_BATCH=1`: one recv per datagram, for comparison.
                udp_batch: std::env::var("DNS_BENCH_BATCH")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(dns::server::UDP_BATCH),
            };
            let (_ttx, trx) = tokio::sync::watch::channel(Some(Arc::new(dns::LookupTable::build(
                &table(),
                &dns::Scope {
                    namespace: "ns-0".into(),
                    domain: "ns-0.svc.cluster.local".into(),
                },
            ))));
            let h = dns::start(opts, &Registry::new(), trx, stop2.clone())
                .await
                .unwrap();
            tx.send((
                h.addrs[0],
                std::path::Path::new("/proc")
                    .join(std::fs::read_link("/proc/thread-self").unwrap()),
            ))
            .unwrap();
            stop2.cancelled().await;
        });
    });
    let (addr, task) = rx.recv().unwrap();
    (addr, task, stop)
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn row(name: &str, r: &Run, base: Option<&Run>) {
    let ratio = base.map_or(String::new(), |b| {
        format!(
            "{:.2}x qps, {:.2}x p50, {:.2}x p99",
            r.qps / b.qps,
            r.p50_ms / b.p50_ms,
            r.p99_ms / b.p99_ms
        )
    });
    let cpu = base.map_or(String::new(), |b| {
        format!(", {:.2}x server CPU/query", r.server_us / b.server_us)
    });
    println!(
        "| {name} | {:.0} | {:.3} | {:.3} | {:.3} | {} | {:.2} ({:.0} %) | {:.2} | {ratio}{cpu} |",
        r.qps,
        r.mean_ms,
        r.p50_ms,
        r.p99_ms,
        r.lost,
        r.server_us,
        r.server_busy * 100.0,
        r.client_cores
    );
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let hosts = dir.path().join("hosts");
    let mut h = String::new();
    for i in 0..NAMES {
        h.push_str(&format!("10.0.{}.{} {}\n", i / 256, i % 256, mesh_name(i)));
        h.push_str(&format!("10.9.{}.{} {}\n", i / 256, i % 256, ext_name(i)));
    }
    std::fs::write(&hosts, h).unwrap();
    let q_mesh = dir.path().join("mesh.txt");
    let q_ext = dir.path().join("ext.txt");
    std::fs::write(
        &q_mesh,
        (0..NAMES)
            .map(|i| format!("{} A\n", mesh_name(i)))
            .collect::<String>(),
    )
    .unwrap();
    std::fs::write(
        &q_ext,
        (0..NAMES)
            .map(|i| format!("{} A\n", ext_name(i)))
            .collect::<String>(),
    )
    .unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, format!("nameserver {UPSTREAM}\n")).unwrap();

    // dnsmasq's answers from /etc/hosts-style files carry TTL 0 unless --local-ttl: 60 s so
    // the proxy's cache has something to keep in the cache-on case.
    let dnsmasq = Dnsmasq(
        placed("dnsmasq", |(_, server)| server)
            .args([
                "-k",
                "--port=53",
                &format!("--listen-address={UPSTREAM}"),
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                &format!("--addn-hosts={}", hosts.display()),
                "--cache-size=1000",
                "--local-ttl=60",
                &format!("--pid-file={}", dir.path().join("pid").display()),
                &format!("--log-facility={}", dir.path().join("log").display()),
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("dnsmasq (make dnspeers)"),
    );
    std::thread::sleep(Duration::from_millis(500));
    let direct: SocketAddr = format!("{UPSTREAM}:53").parse().unwrap();
    let dnsmasq_task = std::path::PathBuf::from(format!("/proc/{0}/task/{0}", dnsmasq.0.id()));

    let built = dns::LookupTable::build(
        &table(),
        &dns::Scope {
            namespace: "ns-0".into(),
            domain: "ns-0.svc.cluster.local".into(),
        },
    );
    println!(
        "lookup table: {} names, {} KiB on the heap",
        built.len(),
        built.heap_bytes() / 1024
    );
    drop(built);
    let (table_addr, table_task, stop1) = proxy(&resolv, 0);
    println!(
        "DNS proxy benchmark: dnsperf -c 1 -q 100 -l 5 (qps, mean) and -c 1 -Q 5000 -l 3 -v (p50/p99), UDP, loopback; load {}",
        load()
    );
    println!(
        "placement: {}; server CPU: the serving thread's (dnsmasq's, the proxy's, the relay's; not the upstream's) per query and its share of a core, saturated run; client: dnsperf's cores",
        pinned().map_or("unpinned".to_string(), |(c, s)| format!(
            "dnsperf on CPU {c}, servers on CPU {s}"
        ))
    );
    println!(
        "| case | qps | mean ms | p50 ms | p99 ms | lost | server µs/query (busy) | client cores | vs baseline |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let base_table = dnsperf(direct, &q_mesh, &dnsmasq_task);
    row("dnsmasq, hosts file (baseline)", &base_table, None);
    let t = dnsperf(table_addr, &q_mesh, &table_task);
    row("proxy, NDS table (5,000 names)", &t, Some(&base_table));
    if std::env::var("DNS_BENCH_ONLY").as_deref() == Ok("table") {
        stop1.cancel();
        println!("load at the end: {}", load());
        return;
    }
    let base_fwd = dnsperf(direct, &q_ext, &dnsmasq_task);
    row("dnsmasq direct, external names (baseline)", &base_fwd, None);
    let (relay_addr, relay_task) = relay::udp_relay(direct, pin_server_thread);
    let r = dnsperf(relay_addr, &q_ext, &relay_task);
    row(
        "trivial UDP relay to dnsmasq (the floor of one more hop)",
        &r,
        Some(&base_fwd),
    );
    let f = dnsperf(table_addr, &q_ext, &table_task);
    row(
        "proxy forwarding to dnsmasq, cache off",
        &f,
        Some(&base_fwd),
    );
    stop1.cancel();
    let (cached_addr, cached_task, stop2) = proxy(&resolv, 4096);
    let c = dnsperf(cached_addr, &q_ext, &cached_task);
    row("proxy forwarding, cache on", &c, Some(&base_fwd));
    stop2.cancel();
    println!("load at the end: {}", load());
}
