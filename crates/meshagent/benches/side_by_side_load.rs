//! meshagent beside the real pilot-agent under load, one run, same machine, same Envoy, same
//! istiod-box (Istio's own config generation and CA, `compat/istiod-box`). The agents run one
//! after the other, as a pod runs them (testkit `start_agent`), and every figure is the agent
//! process's own (never its Envoy's):
//!
//! * `push`: a sidecar turns ready, then 10,000 ServiceEntry hosts (100 entries of 100 hosts,
//!   port 80 HTTP, resolution NONE: 10,000 outbound clusters and one route of 10,000 virtual
//!   hosts) are applied through istiod-box's `/apply`. Measured: push latency (`/apply` sent →
//!   Envoy's `cluster_manager.active_clusters` up by 10,000), the agent's CPU from `/apply` to
//!   10 s after (all threads' `schedstat`), CPU per MiB pushed (the MiB: pilot-agent's
//!   `/proc/<pid>/io` `rchar` over the push, its read(2)s of istiod's TLS stream; meshagent's
//!   reads do not all count there), and its memory once settled
//!   (RssAnon, Pss, VmRSS, and the peak VmHWM). The entries are deleted between agents.
//!   Floor: the same push to Envoy straight to istiod-box (meshagent's generated bootstrap
//!   with `xds-grpc` re-pointed at istiod-box, a static SDS server holding a certificate from
//!   its CA; support `floors::EnvoyDirect`).
//! * `dns`: DNS capture on (`ISTIO_META_DNS_CAPTURE`, `DNS_PROXY_ADDR` on a free port), 5,000
//!   ServiceEntries with one address each in istiod-box's config (5,000 names in NDS), each
//!   agent's `/etc/resolv.conf` naming a dnsmasq upstream (testkit
//!   `start_agent_with_resolv_conf`). Measured once the last name answers: memory settled;
//!   then dnsperf 2.10 (`-c 1 -q 100 -l 5`, 100 table names) QPS; then forwarding latency of
//!   100 names dnsmasq answers from its config (`-c 1 -Q 2000 -l 3 -v`: p50 of every reply)
//!   through the agent, straight to dnsmasq, and through a trivial UDP relay (the floor of one
//!   more hop), each agent's added p50 being its p50 minus the direct one. The QPS floor,
//!   next to each agent: the same dnsperf run against a trivial responder (support
//!   `floors::dns_responder`: one `recv_from` and one `send_to` per query, a fixed A record),
//!   and dnsmasq's QPS answering from its config beside it. Nothing is pinned:
//!   each agent runs as a pod gets it (pilot-agent with Go's two Ps, meshagent on its thread).
//! * `grpc`: `DISABLE_ENVOY` with the `grpc-agent` template's env (without `OUTPUT_CERTS`), one SotW ADS client (the
//!   grpc bench's) on the agent's `XDS` socket, subscribed to a cluster's endpoints: memory
//!   10 s after the client's first response.
//!
//! * `merge`: `ISTIO_PROMETHEUS_ANNOTATIONS` names an application serving a 100,000-line
//!   exposition (11 MiB); `/stats/prometheus` on the agent's status port merges it with
//!   Envoy's. Median of 7 scrapes: latency, and the extra peak memory (VmHWM reset through
//!   `/proc/<pid>/clear_refs` before each scrape, minus VmRSS then). Then 7 more with the
//!   application answering one line: the extra peak of a scrape that merges next to nothing
//!   (the floor under the first figure). The latency's floor: the bench's client reading the
//!   application's body straight from it, 7 times before the agents run.
//!
//! * `fanout`: N proxyless agents (`SIDE_FANOUT_N`, default 50) each with its ADS
//!   client; an EndpointSlice change applied to istiod-box (`--debounce 10ms`) → every
//!   client has a new response: median of `SIDE_FANOUT_CHANGES` (default 6) changes after
//!   one uncounted, and the agents' CPU per push per agent. Floor: the same N clients
//!   straight to istiod-box over TLS with a token (no agent), the same changes.
//!   Each pilot-agent holds two inotify instances and the default allows 128 per user
//!   (`fs.inotify.max_user_instances`: the 58th cannot start its SDS server), so the run
//!   raises the limit to what N agents need and puts it back afterwards (root only, as the
//!   benches run; otherwise it says so and runs with the limit it has).
//!
//! Each figure is printed as pilot-agent | meshagent | ratio, with the load average (and, where
//! it has one, its floor and the best ratio that allows: floor / pilot-agent), and drawn
//! as a bar plot under `docs/bench-plots/` (`plot_bars.py`, matplotlib from `make plotpeers`;
//! `SIDE_PLOTS=0` skips them). `SIDE_LOAD=push,dns,grpc,merge,fanout` picks the scenarios (default all).
//! Run: `make bench`, or `make agent pilot-agent istiod-box envoy dnspeers plotpeers &&
//! MESHAGENT_BIN=$PWD/target/dist/meshagent cargo bench -p meshagent --bench side_by_side_load`.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, envoy_counter, mesh_with_free_ports, start_agent,
    start_agent_with_resolv_conf, workload_a,
};
use meshagent_testkit::{Sidecar, free_port, http_get, json, workspace_root};
use support::floors::EnvoyDirect;
use support::mem::Mem;
use support::{Seen, cpu_ms, loadavg};
use tokio::time::Instant;

const KINDS: [AgentKind; 2] = [AgentKind::PilotAgent, AgentKind::Meshagent];
const CLUSTERS: usize = 10_000;
const NAMES: usize = 5_000;
/// dnsmasq, the agents' upstream (port 53, as resolv.conf implies).
const UPSTREAM: &str = "127.0.53.120";

fn name(kind: AgentKind) -> &'static str {
    match kind {
        AgentKind::PilotAgent => "pilot-agent",
        AgentKind::Meshagent => "meshagent",
    }
}

/// One figure of both agents, for the printout and the plot.
struct Figure {
    slug: String,
    title: String,
    unit: &'static str,
    pilot: f64,
    mesh: f64,
    goal: &'static str,
    /// The same work with no agent in the way, same run: (what, value). The best ratio any
    /// agent can reach is floor / pilot-agent.
    floor: Option<(String, f64)>,
}

struct Report {
    figures: Vec<Figure>,
}

impl Report {
    fn add(
        &mut self,
        slug: &str,
        title: &str,
        unit: &'static str,
        v: [f64; 2],
        goal: &'static str,
    ) {
        println!(
            "  {title:<58} {:>10.3} | {:>10.3} | {:>7.3}   ({unit}; goal {goal}; load {})",
            v[0],
            v[1],
            v[1] / v[0],
            loadavg()
        );
        self.figures.push(Figure {
            slug: slug.into(),
            title: title.into(),
            unit,
            pilot: v[0],
            mesh: v[1],
            goal,
            floor: None,
        });
    }

    /// [`Report::add`] with the figure's floor (`what`, `value`) beside it, and the best ratio
    /// it allows (floor / pilot-agent).
    #[allow(clippy::too_many_arguments)]
    fn add_with_floor(
        &mut self,
        slug: &str,
        title: &str,
        unit: &'static str,
        v: [f64; 2],
        goal: &'static str,
        what: &str,
        floor: f64,
    ) {
        self.add(slug, title, unit, v, goal);
        println!(
            "  {:<58} {floor:>10.3}   (floor: {what}; best possible ratio floor / pilot-agent {:.3}; \
             meshagent / floor {:.3})",
            "  floor",
            floor / v[0],
            v[1] / floor
        );
        self.figures.last_mut().unwrap().floor = Some((what.to_owned(), floor));
    }

    fn memory(&mut self, slug: &str, what: &str, m: [Mem; 2]) {
        let pick = |f: fn(&Mem) -> f64| [f(&m[0]), f(&m[1])];
        self.add(
            &format!("{slug}-rss-anon"),
            &format!("{what}: RssAnon"),
            "MiB",
            pick(|m| m.rss_anon),
            "≤ 0.15",
        );
        self.add(
            &format!("{slug}-pss"),
            &format!("{what}: Pss"),
            "MiB",
            pick(|m| m.pss),
            "≤ 0.15",
        );
        self.add(
            &format!("{slug}-vm-rss"),
            &format!("{what}: VmRSS"),
            "MiB",
            pick(|m| m.vm_rss),
            "—",
        );
        self.add(
            &format!("{slug}-vm-hwm"),
            &format!("{what}: peak VmHWM"),
            "MiB",
            pick(|m| m.vm_hwm),
            "≤ 0.15",
        );
    }

    /// Writes the figures as JSON and has `plot_bars.py` draw one PNG per figure.
    fn plot(&self, run: &str) {
        if std::env::var("SIDE_PLOTS").as_deref() == Ok("0") {
            return;
        }
        let out = workspace_root().join("docs/bench-plots");
        std::fs::create_dir_all(&out).unwrap();
        let figures: Vec<_> = self
            .figures
            .iter()
            .map(|f| {
                json!({"slug": f.slug, "title": f.title, "unit": f.unit, "pilot": f.pilot,
                       "mesh": f.mesh, "goal": f.goal,
                       "floor": f.floor.as_ref().map(|(w, v)| json!({"what": w, "value": v}))})
            })
            .collect();
        let data = out.join(format!("{run}.json"));
        let doc = json!({"run": run, "load": loadavg(), "date": utc_now(), "figures": figures});
        std::fs::write(&data, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
        let script = workspace_root().join("crates/meshagent/benches/plot_bars.py");
        let pythonpath = std::env::var("PLOT_PYTHONPATH").unwrap_or_else(|_| {
            workspace_root()
                .join(".tools/plot")
                .to_string_lossy()
                .into_owned()
        });
        let status = Command::new("python3")
            .arg(&script)
            .arg(&data)
            .arg(&out)
            .env("PYTHONPATH", pythonpath)
            .status()
            .expect("python3");
        assert!(
            status.success(),
            "plot_bars.py failed ({status}): `make plotpeers` installs matplotlib"
        );
        println!(
            "plots: {}/<figure>.png, data {}",
            out.display(),
            data.display()
        );
    }
}

fn utc_now() -> String {
    let out = Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `rchar` of `/proc/<pid>/io`: bytes the process read by read-like calls (sockets included).
fn rchar(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("rchar:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

async fn wait_ready(sc: &Sidecar, kind: AgentKind) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok((200, _)) = http_get(sc.status, "/healthz/ready").await {
            return;
        }
        if Instant::now() > deadline {
            sc.proc.print_log();
            panic!("{} not ready within 120 s", name(kind));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Memory once settled: 10 s on, the last of five 1 s samples (VmHWM: the peak since start).
async fn settled(pid: u32) -> Mem {
    tokio::time::sleep(Duration::from_secs(10)).await;
    let mut m = Mem::of(pid);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        m = Mem::of(pid);
    }
    m
}

// === push: 10,000 clusters ===

fn ten_thousand_hosts() -> String {
    let mut y = String::new();
    for e in 0..CLUSTERS / 100 {
        y.push_str(&format!(
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata:\n  name: bulk-{e}\n  \
             namespace: default\nspec:\n  location: MESH_EXTERNAL\n  resolution: NONE\n  ports:\n  \
             - number: 80\n    name: http\n    protocol: HTTP\n  hosts:\n"
        ));
        for h in 0..100 {
            y.push_str(&format!("  - h{h}.bulk{e}.example.com\n"));
        }
        y.push_str("---\n");
    }
    y
}

async fn push(report: &mut Report) {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    let bulk = ten_thousand_hosts();
    println!(
        "\npush: {CLUSTERS} clusters applied after ready ({} KiB of YAML); pilot-agent | meshagent | ratio",
        bulk.len() / 1024
    );
    let (mut lat, mut cpu, mut mib, mut mem) = ([0.0; 2], [0.0; 2], [0.0; 2], vec![]);
    let mut direct = None;
    for (i, kind) in KINDS.into_iter().enumerate() {
        let pod = PodSpec {
            proxy_config: json!({}),
            ..PodSpec::new("a", "127.0.0.1")
        };
        let mut sc = start_agent(&istiod, kind, &pod).await;
        wait_ready(&sc, kind).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let pid = sc.proc.pid();
        let before = envoy_counter(&sc, "cluster_manager.active_clusters").await;
        let (c0, r0, t0) = (cpu_ms(pid), rchar(pid), Instant::now());
        istiod.apply(&bulk).await;
        let deadline = t0 + Duration::from_secs(300);
        loop {
            let now = envoy_counter(&sc, "cluster_manager.active_clusters").await;
            if now >= before + CLUSTERS as u64 {
                break;
            }
            if Instant::now() > deadline {
                sc.proc.print_log();
                panic!("{}: Envoy has {now} clusters after 300 s", name(kind));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        lat[i] = t0.elapsed().as_secs_f64() * 1000.0;
        let m = settled(pid).await;
        cpu[i] = cpu_ms(pid) - c0;
        mib[i] = (rchar(pid) - r0) / (1024.0 * 1024.0);
        println!(
            "  {}: {m}; push {:.0} ms, CPU {:.0} ms, read {:.2} MiB",
            name(kind),
            lat[i],
            cpu[i],
            mib[i]
        );
        mem.push(m);
        if kind == AgentKind::Meshagent {
            direct = Some(EnvoyDirect::capture(&istiod, sc.cwd.path(), pid, "default", "a").await);
        }
        sc.proc.kill();
        istiod.delete(&bulk).await;
    }
    // The floor: the same push to Envoy straight from istiod-box (no agent in the way).
    let direct = direct.expect("captured from meshagent's run");
    let (envoy, _dir, _) = direct.start_ready().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = envoy
        .stat("cluster_manager.active_clusters")
        .await
        .unwrap_or(0);
    let t0 = Instant::now();
    istiod.apply(&bulk).await;
    let deadline = t0 + Duration::from_secs(300);
    loop {
        let now = envoy
            .stat("cluster_manager.active_clusters")
            .await
            .unwrap_or(0);
        if now >= before + CLUSTERS as u64 {
            break;
        }
        if Instant::now() > deadline {
            envoy.proc.print_log();
            panic!("Envoy direct: {now} clusters after 300 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let direct_ms = t0.elapsed().as_secs_f64() * 1000.0;
    println!("  Envoy straight to istiod-box: push {direct_ms:.0} ms");
    drop(envoy);
    istiod.delete(&bulk).await;
    report.memory(
        "push-10k",
        "memory after a 10,000-cluster push",
        [mem[0], mem[1]],
    );
    report.add_with_floor(
        "push-10k-latency",
        "xDS pass-through, 10,000 clusters: /apply → Envoy has them",
        "ms",
        lat,
        "≤ 1.0",
        "Envoy straight to istiod-box",
        direct_ms,
    );
    report.add(
        "push-10k-cpu",
        "xDS pass-through, 10,000 clusters: agent CPU, /apply + 10 s",
        "ms",
        cpu,
        "—",
    );
    // The bytes are istiod's, the same for both; meshagent's reads do not all show in `rchar`
    // (recvmsg), so pilot-agent's count (its read(2)s of the TLS stream) is the MiB of both.
    report.add(
        "push-10k-cpu-per-mib",
        "xDS pass-through, 10,000 clusters: agent CPU per MiB pushed",
        "ms/MiB",
        [cpu[0] / mib[0], cpu[1] / mib[0]],
        "≤ 0.5",
    );
}

// === dns: capture on, 5,000 names ===

fn dns_config() -> String {
    let mut y = workload_a();
    y.push_str("---\n");
    for i in 0..NAMES {
        y.push_str(&format!(
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata:\n  name: se-{i}\n  \
             namespace: default\nspec:\n  hosts:\n  - svc{i}.bench.example.com\n  addresses:\n  \
             - 240.1.{}.{}\n  location: MESH_EXTERNAL\n  resolution: NONE\n  ports:\n  \
             - number: 80\n    name: http\n    protocol: HTTP\n---\n",
            i / 256,
            i % 256
        ));
    }
    y
}

struct Dnsmasq(std::process::Child);

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `dig +short` of `name` at `server`: the answer's first line, if any.
fn dig(server: SocketAddr, name: &str) -> Option<String> {
    let out = Command::new("dig")
        .args(["+short", "+time=1", "+tries=1", "-p"])
        .arg(server.port().to_string())
        .arg(format!("@{}", server.ip()))
        .arg(name)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .next()
        .filter(|l| !l.starts_with(';'))
        .map(str::to_owned)
}

/// Saturated QPS: `dnsperf -c 1 -q 100 -l 5`.
fn dnsperf_qps(addr: SocketAddr, queries: &Path) -> f64 {
    let out = dnsperf(addr, queries, &["-q", "100", "-l", "5"]);
    out.lines()
        .find_map(|l| l.trim().strip_prefix("Queries per second:"))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

/// p50 latency in ms of a throttled run (`-Q 2000 -l 3 -v`: one line per reply).
fn dnsperf_p50(addr: SocketAddr, queries: &Path) -> f64 {
    let out = dnsperf(addr, queries, &["-Q", "2000", "-l", "3", "-v"]);
    let mut lat: Vec<f64> = out
        .lines()
        .filter(|l| l.starts_with('>'))
        .filter_map(|l| l.split_whitespace().last()?.parse().ok())
        .collect();
    if lat.is_empty() {
        return f64::NAN;
    }
    lat.sort_by(f64::total_cmp);
    lat[lat.len() / 2] * 1000.0
}

fn dnsperf(addr: SocketAddr, queries: &Path, extra: &[&str]) -> String {
    let out = Command::new("dnsperf")
        .args(["-s", &addr.ip().to_string(), "-p", &addr.port().to_string()])
        .arg("-d")
        .arg(queries)
        .args(["-c", "1"])
        .args(extra)
        .output()
        .expect("dnsperf (make dnspeers)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn dns(report: &mut Report) {
    let dir = tempfile::tempdir().unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let q_table = dir.path().join("table.txt");
    let q_fwd = dir.path().join("fwd.txt");
    std::fs::write(
        &q_table,
        (0..100)
            .map(|i| format!("svc{}.bench.example.com A\n", i * (NAMES / 100)))
            .collect::<String>(),
    )
    .unwrap();
    std::fs::write(
        &q_fwd,
        (0..100)
            .map(|i| format!("n{i}.fwd.bench A\n"))
            .collect::<String>(),
    )
    .unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, format!("nameserver {UPSTREAM}\n")).unwrap();
    // dnsmasq answers every *.fwd.bench name from its config (no upstream of its own).
    let _dnsmasq = Dnsmasq(
        Command::new("dnsmasq")
            .args([
                "-k",
                "--port=53",
                &format!("--listen-address={UPSTREAM}"),
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                "--address=/fwd.bench/10.9.9.9",
                "--cache-size=1000",
                &format!("--pid-file={}", dir.path().join("pid").display()),
                &format!("--log-facility={}", dir.path().join("log").display()),
            ])
            .stdout(Stdio::null())
            .spawn()
            .expect("dnsmasq (make dnspeers)"),
    );
    let direct: SocketAddr = format!("{UPSTREAM}:53").parse().unwrap();
    let t = Instant::now();
    while dig(direct, "n0.fwd.bench").is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "dnsmasq not answering"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&dns_config(), Some(&mesh), &[]).await;
    println!(
        "\ndns: capture on, {NAMES} ServiceEntry names in NDS; pilot-agent | meshagent | ratio"
    );
    let last = format!("svc{}.bench.example.com", NAMES - 1);
    let (mut mem, mut qps, mut p50) = (vec![], [0.0; 2], [0.0; 2]);
    let (mut direct_p50, mut relay_p50) = (vec![], vec![]);
    let relay_addr = support::relay::udp_relay(direct, || {}).0;
    let (responder, responder_thread) = support::floors::dns_responder();
    let (mut responder_qps, mut dnsmasq_qps, mut responder_busy) = (vec![], vec![], vec![]);
    for (i, kind) in KINDS.into_iter().enumerate() {
        let dns_addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let dns_env = dns_addr.to_string();
        let env = [
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("DNS_PROXY_ADDR", dns_env.as_str()),
        ];
        let pod = PodSpec {
            proxy_config: json!({}),
            env: &env,
            ..PodSpec::new("a", "127.0.0.1")
        };
        let sc = start_agent_with_resolv_conf(&istiod, kind, &pod, Some(&resolv)).await;
        wait_ready(&sc, kind).await;
        let deadline = Instant::now() + Duration::from_secs(120);
        while dig(dns_addr, &last).as_deref() != Some("240.1.19.135") {
            if Instant::now() > deadline {
                sc.proc.print_log();
                panic!("{} does not answer {last} from NDS", name(kind));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let pid = sc.proc.pid();
        let m = settled(pid).await;
        qps[i] = dnsperf_qps(dns_addr, &q_table);
        // The floors, next to each agent: a trivial responder (one recv_from and one send_to
        // per query, a fixed answer: the most a DNS server gets from dnsperf here) and
        // dnsmasq answering from its config.
        let (c0, t0) = (
            support::floors::thread_cpu_ms(&responder_thread),
            Instant::now(),
        );
        responder_qps.push(dnsperf_qps(responder, &q_table));
        responder_busy.push(
            (support::floors::thread_cpu_ms(&responder_thread) - c0)
                / (t0.elapsed().as_secs_f64() * 1000.0),
        );
        dnsmasq_qps.push(dnsperf_qps(direct, &q_fwd));
        // Alternated with the baselines so each agent's added latency is against a direct
        // run measured next to it.
        direct_p50.push(dnsperf_p50(direct, &q_fwd));
        p50[i] = dnsperf_p50(dns_addr, &q_fwd);
        relay_p50.push(dnsperf_p50(relay_addr, &q_fwd));
        println!(
            "  {}: {m}; table QPS {:.0} (trivial responder {:.0}, dnsmasq {:.0}); forwarding p50 \
             {:.3} ms (direct {:.3}, relay {:.3})",
            name(kind),
            qps[i],
            responder_qps[i],
            dnsmasq_qps[i],
            p50[i],
            direct_p50[i],
            relay_p50[i]
        );
        mem.push(m);
        drop(sc);
    }
    report.memory(
        "dns-5k",
        "memory, DNS capture on, 5,000 names",
        [mem[0], mem[1]],
    );
    report.add_with_floor(
        "dns-table-qps",
        "DNS table answers, QPS (dnsperf -c 1 -q 100 -l 5)",
        "queries/s",
        qps,
        "≥ 2.0",
        "a trivial UDP responder, mean of its two runs",
        (responder_qps[0] + responder_qps[1]) / 2.0,
    );
    println!(
        "  the trivial responder's thread was busy {:.0} % / {:.0} % of a core during its runs \
         ({})",
        responder_busy[0] * 100.0,
        responder_busy[1] * 100.0,
        if responder_busy.iter().all(|b| *b < 0.9) {
            "below a full core: dnsperf's side, not the server, sets the floor"
        } else {
            "a full core: the responder itself is the limit"
        }
    );
    println!(
        "  dnsmasq answering from its config: {:.0} / {:.0} QPS (next to each agent); \
         meshagent / dnsmasq {:.2}",
        dnsmasq_qps[0],
        dnsmasq_qps[1],
        qps[1] / dnsmasq_qps[1]
    );
    let added = [p50[0] - direct_p50[0], p50[1] - direct_p50[1]];
    report.add(
        "dns-forward-added-p50",
        "DNS forwarding, p50 added over a direct query",
        "ms",
        added,
        "≤ 0.7",
    );
    let relay_added: Vec<f64> = (0..2).map(|i| relay_p50[i] - direct_p50[i]).collect();
    println!(
        "  trivial UDP relay, p50 added over direct: {:.3} / {:.3} ms (next to each agent); \
         meshagent / relay {:.2}",
        relay_added[0],
        relay_added[1],
        added[1] / relay_added[1]
    );
}

// === grpc: DISABLE_ENVOY ===

fn grpc_config() -> String {
    format!(
        "{}---\napiVersion: v1\nkind: Service\nmetadata:\n  name: echo\n  namespace: default\n\
         spec:\n  clusterIP: 10.96.0.20\n  selector:\n    app: a\n  ports:\n  - name: grpc\n    \
         port: 7070\n    targetPort: 17070\n",
        workload_a()
    )
}

/// The `grpc-agent` template's env without `OUTPUT_CERTS` (the pod image's
/// `/var/lib/istio/data` is not in the agents' fresh working directories; pilot-agent only logs
/// the failed writes), plus `GRPC_XDS_BOOTSTRAP`.
fn proxyless_env() -> Vec<(&'static str, String)> {
    let mut env: Vec<(&str, String)> = support::proxyless_env()
        .into_iter()
        .filter(|(k, _)| *k != "OUTPUT_CERTS")
        .collect();
    env.push((
        "GRPC_XDS_BOOTSTRAP",
        "./etc/istio/proxy/grpc-bootstrap.json".into(),
    ));
    env
}

/// Waits for the agent's `XDS` socket (the client's channel fails at once without it).
async fn xds_socket(sc: &Sidecar, kind: AgentKind) -> PathBuf {
    let sock = sc.cwd.path().join("etc/istio/proxy/XDS");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !sock.exists() {
        if Instant::now() > deadline {
            sc.proc.print_log();
            panic!("{}: no XDS socket after 60 s", name(kind));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sock
}

async fn grpc(report: &mut Report) {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&grpc_config(), Some(&mesh), &[]).await;
    println!(
        "\ngrpc: DISABLE_ENVOY, one ADS client on the agent's XDS socket; pilot-agent | meshagent | ratio"
    );
    let mut mem = vec![];
    for kind in KINDS {
        let env = proxyless_env();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let pod = PodSpec {
            proxy_config: json!({}),
            env: &env,
            ..PodSpec::new("a", "127.0.0.1")
        };
        let sc = start_agent(&istiod, kind, &pod).await;
        let sock = xds_socket(&sc, kind).await;
        let (_seen, client) = support::spawn_client(
            support::uds_channel(sock),
            None,
            "sidecar~127.0.0.1~a-5f7d9.default~default.svc.cluster.local".into(),
            Duration::from_secs(120),
            || sc.proc.print_log(),
        )
        .await;
        let m = settled(sc.proc.pid()).await;
        println!("  {}: {m}", name(kind));
        mem.push(m);
        client.abort();
        drop(sc);
    }
    report.memory(
        "grpc",
        "memory, DISABLE_ENVOY (proxyless, one client)",
        [mem[0], mem[1]],
    );
}

// === merge: 100,000-line application exposition ===

/// 100,000 lines of application metrics (10,000 families × TYPE + 9 series), the shape of
/// `benches/merge.rs`'s Envoy body.
fn app_exposition() -> Vec<u8> {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(12 << 20);
    for f in 0..10_000 {
        let _ = writeln!(s, "# TYPE app_upstream_rq_{f} counter");
        for i in 0..9 {
            let _ = writeln!(
                s,
                "app_upstream_rq_{f}{{response_code=\"{}\",cluster_name=\"outbound|8080||svc-{i}.default.svc.cluster.local\"}} {}",
                200 + i,
                f * 7 + i
            );
        }
    }
    s.into_bytes()
}

/// Serves `body` as `text/plain; version=0.0.4` to every HTTP/1 request on its own thread
/// (so the benchmark's runtime does not serve it), or a one-line exposition while the
/// returned flag is set (the floor); returns the port.
fn serve_app(body: Vec<u8>) -> (u16, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let one_line = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = one_line.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap().port()).unwrap();
            let body = std::sync::Arc::new(body);
            let one: std::sync::Arc<Vec<u8>> =
                std::sync::Arc::new(b"# TYPE app_one counter\napp_one 1\n".to_vec());
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    continue;
                };
                let body = if flag.load(std::sync::atomic::Ordering::SeqCst) {
                    one.clone()
                } else {
                    body.clone()
                };
                tokio::spawn(async move {
                    let mut req = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 65536 {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => req.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = s.write_all(head.as_bytes()).await;
                    let _ = s.write_all(&body).await;
                    let _ = s.shutdown().await;
                });
            }
        });
    });
    (rx.recv().unwrap(), one_line)
}

/// Resets `pid`'s peak RSS (VmHWM) to its current RSS ("5" to `clear_refs`, Linux ≥ 4.0).
fn reset_hwm(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

async fn merge(report: &mut Report) {
    let body = app_exposition();
    let bytes = body.len();
    let (port, one_line) = serve_app(body);
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    let scrapes = 7;
    println!(
        "\nmerge: /stats/prometheus with a 100,000-line ({:.1} MiB) application exposition, \
         median of {scrapes} scrapes; pilot-agent | meshagent | ratio",
        bytes as f64 / (1024.0 * 1024.0)
    );
    let annotations = format!(r#"{{"scrape":"true","path":"/metrics","port":"{port}"}}"#);
    // The latency's floor: the same client reading the application's body straight from it,
    // no agent in the way.
    let app = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut direct = vec![];
    for _ in 0..scrapes {
        let t0 = Instant::now();
        let (code, text) = http_get(app, "/metrics").await.unwrap();
        direct.push(t0.elapsed().as_secs_f64() * 1000.0);
        assert!(code == 200 && text.contains("app_upstream_rq_9999{"));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "  straight from the application: latency {:?} ms",
        direct.iter().map(|v| v.round()).collect::<Vec<_>>()
    );
    let (mut extra, mut lat, mut floor) = ([0.0; 2], [0.0; 2], [0.0; 2]);
    for (i, kind) in KINDS.into_iter().enumerate() {
        let env = [("ISTIO_PROMETHEUS_ANNOTATIONS", annotations.as_str())];
        let pod = PodSpec {
            proxy_config: json!({}),
            env: &env,
            ..PodSpec::new("a", "127.0.0.1")
        };
        let sc = start_agent(&istiod, kind, &pod).await;
        wait_ready(&sc, kind).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let pid = sc.proc.pid();
        let (mut peaks, mut took) = (vec![], vec![]);
        for _ in 0..scrapes {
            reset_hwm(pid);
            let base = Mem::of(pid).vm_rss;
            let t0 = Instant::now();
            let (code, text) = http_get(sc.status, "/stats/prometheus").await.unwrap();
            took.push(t0.elapsed().as_secs_f64() * 1000.0);
            peaks.push(Mem::of(pid).vm_hwm - base);
            assert_eq!(code, 200, "{}: /stats/prometheus", name(kind));
            assert!(
                text.contains("app_upstream_rq_9999{"),
                "{}: the merged body lacks the application's last family",
                name(kind)
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        extra[i] = support::median(peaks.clone());
        lat[i] = support::median(took.clone());
        // The floor: the same scrape with the application answering one line.
        one_line.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut small = vec![];
        for _ in 0..scrapes {
            reset_hwm(pid);
            let base = Mem::of(pid).vm_rss;
            let (code, text) = http_get(sc.status, "/stats/prometheus").await.unwrap();
            small.push(Mem::of(pid).vm_hwm - base);
            assert!(code == 200 && text.contains("app_one 1"), "{}", name(kind));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        one_line.store(false, std::sync::atomic::Ordering::SeqCst);
        floor[i] = support::median(small.clone());
        println!(
            "  {}: extra peak {:?} MiB; latency {:?} ms; 1-line exposition: extra peak {:?} MiB",
            name(kind),
            peaks
                .iter()
                .map(|v| (v * 1000.0).round() / 1000.0)
                .collect::<Vec<_>>(),
            took.iter().map(|v| v.round()).collect::<Vec<_>>(),
            small
                .iter()
                .map(|v| (v * 1000.0).round() / 1000.0)
                .collect::<Vec<_>>()
        );
        drop(sc);
    }
    report.add(
        "merge-extra-peak",
        "metrics merge, 100k-line exposition: extra peak memory (VmHWM − VmRSS before)",
        "MiB",
        extra,
        "≤ 0.1",
    );
    report.add(
        "merge-floor-peak",
        "metrics merge, 1-line exposition: extra peak memory (the floor)",
        "MiB",
        floor,
        "—",
    );
    report.add_with_floor(
        "merge-latency",
        "metrics merge, 100k-line exposition: scrape latency",
        "ms",
        lat,
        "≤ 1.0",
        "the body read straight from the application",
        support::median(direct),
    );
}

// === fanout: one change to N proxyless clients through their agents ===

/// The echo Service's EndpointSlice with endpoints 10.2.0.1 .. 10.2.0.`n`.
fn echo_endpoints(n: usize) -> String {
    let mut y = String::from(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: echo-1\n  \
         namespace: default\n  labels:\n    kubernetes.io/service-name: echo\naddressType: IPv4\n\
         ports:\n- name: grpc\n  port: 17070\n  protocol: TCP\nendpoints:\n",
    );
    for i in 1..=n {
        y.push_str(&format!(
            "- addresses:\n  - 10.2.0.{i}\n  conditions:\n    ready: true\n"
        ));
    }
    y
}

fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

/// Who the fan-out's clients talk to: each through its own agent, or straight to istiod-box
/// (the floor: the same clients, no agent).
#[derive(Clone, Copy)]
enum Via {
    Agent(AgentKind),
    Direct,
}

impl Via {
    fn name(self) -> &'static str {
        match self {
            Via::Agent(kind) => name(kind),
            Via::Direct => "clients straight to istiod-box",
        }
    }
}

const INOTIFY_INSTANCES: &str = "/proc/sys/fs/inotify/max_user_instances";

/// `fs.inotify.max_user_instances` raised for the fan-out run, restored when dropped (also
/// when the run panics). A ready pilot-agent holds two instances, meshagent one (its file
/// certificate watcher); istiod-box and the machine's other users hold a few more.
struct InotifyLimit {
    old: Option<String>,
}

impl InotifyLimit {
    fn at_least(want: u64) -> InotifyLimit {
        let old = std::fs::read_to_string(INOTIFY_INSTANCES).ok();
        let have: u64 = old
            .as_deref()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        if have >= want {
            return InotifyLimit { old: None };
        }
        match std::fs::write(INOTIFY_INSTANCES, want.to_string()) {
            Ok(()) => {
                println!("  fs.inotify.max_user_instances {have} → {want} for this run");
                InotifyLimit { old }
            }
            Err(e) => {
                println!(
                    "  cannot raise fs.inotify.max_user_instances from {have} to {want} ({e}): \
                     pilot-agents past the limit will not start"
                );
                InotifyLimit { old: None }
            }
        }
    }
}

impl Drop for InotifyLimit {
    fn drop(&mut self) {
        if let Some(old) = self.old.take()
            && let Err(e) = std::fs::write(INOTIFY_INSTANCES, old.trim())
        {
            println!(
                "  cannot restore fs.inotify.max_user_instances to {}: {e}",
                old.trim()
            );
        }
    }
}

async fn fanout(report: &mut Report) {
    let sizes = env_list("SIDE_FANOUT_N", "50");
    // Four per agent leaves room for the machine's own users of inotify.
    let _inotify =
        InotifyLimit::at_least(sizes.iter().copied().max().unwrap_or(0) as u64 * 4 + 128);
    let changes = env_list("SIDE_FANOUT_CHANGES", "6")
        .first()
        .copied()
        .unwrap_or(6);
    let mesh = mesh_with_free_ports();
    let config = format!("{}---\n{}", grpc_config(), echo_endpoints(2));
    // A short debounce so the agents' part is not drowned by istiod's 100 ms wait.
    let istiod = IstiodBox::start_with(&config, Some(&mesh), &["--debounce", "10ms"]).await;
    let proxyless = proxyless_env();
    let env: Vec<(&str, &str)> = proxyless.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let token = istiod.token("default", "a").await;
    for n in sizes {
        println!(
            "\nfanout: one EndpointSlice change → all {n} clients through their agents, median of \
             {changes} (istiod-box --debounce 10ms); pilot-agent | meshagent | ratio"
        );
        let (mut lat, mut cpu, mut rss) = ([0.0; 2], [0.0; 2], [0.0; 2]);
        let mut direct_lat = f64::NAN;
        let vias = [
            Via::Agent(AgentKind::PilotAgent),
            Via::Agent(AgentKind::Meshagent),
            Via::Direct,
        ];
        for (k, via) in vias.into_iter().enumerate() {
            let t_start = Instant::now();
            let names: Vec<String> = (0..n).map(|i| format!("f{i}")).collect();
            let ips: Vec<String> = (0..n)
                .map(|i| format!("127.1.{}.{}", i / 250, i % 250 + 2))
                .collect();
            let mut agents = vec![];
            if let Via::Agent(kind) = via {
                for i in 0..n {
                    let pod = PodSpec {
                        proxy_config: json!({}),
                        env: &env,
                        service_account: "a",
                        ..PodSpec::new(&names[i], &ips[i])
                    };
                    agents.push(start_agent(&istiod, kind, &pod).await);
                }
            }
            // Clients attach one after the other: istiod's connection rate limit
            // (`PILOT_MAX_REQUESTS_PER_SECOND`, 25/s) refuses a burst of 50 new streams.
            let mut seen: Vec<Seen> = vec![];
            let mut clients = vec![];
            for i in 0..n {
                let node_id = format!(
                    "sidecar~{}~{}-5f7d9.default~default.svc.cluster.local",
                    ips[i], names[i]
                );
                let (channel, token) = match via {
                    Via::Agent(kind) => (
                        support::uds_channel(xds_socket(&agents[i], kind).await),
                        None,
                    ),
                    Via::Direct => (
                        meshagent_testkit::ca_client::channel(
                            istiod.grpc_tls,
                            istiod.root_cert_path(),
                        )
                        .await,
                        Some(token.clone()),
                    ),
                };
                let (s, client) =
                    support::spawn_client(channel, token, node_id, Duration::from_secs(60), || {
                        if let Some(a) = agents.get(i) {
                            a.proc.print_log();
                        }
                    })
                    .await;
                clients.push(client);
                seen.push(s);
            }
            println!(
                "  {}: {n} clients up in {:.1} s",
                via.name(),
                t_start.elapsed().as_secs_f64()
            );
            tokio::time::sleep(Duration::from_secs(5)).await;
            let pids: Vec<u32> = agents.iter().map(|a| a.proc.pid()).collect();
            let cpu0: f64 = pids.iter().map(|&p| cpu_ms(p)).sum();
            let mut took = vec![];
            // One uncounted change first.
            for c in 0..=changes {
                let before: Vec<usize> = seen.iter().map(|s| s.lock().unwrap().len()).collect();
                let t0 = Instant::now();
                istiod.apply(&echo_endpoints(3 + (c % 2))).await;
                let deadline = t0 + Duration::from_secs(60);
                while seen
                    .iter()
                    .zip(&before)
                    .any(|(s, b)| s.lock().unwrap().len() <= *b)
                {
                    assert!(
                        Instant::now() < deadline,
                        "{}: a change did not reach every client in 60 s",
                        via.name()
                    );
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                if c > 0 {
                    took.push(t0.elapsed().as_secs_f64() * 1000.0);
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            let median = support::median(took.clone());
            if let Via::Agent(_) = via {
                let cpu1: f64 = pids.iter().map(|&p| cpu_ms(p)).sum();
                lat[k] = median;
                cpu[k] = (cpu1 - cpu0) / ((changes + 1) * n) as f64;
                rss[k] = support::median(pids.iter().map(|&p| Mem::of(p).vm_rss).collect());
                println!(
                    "  {}: change → all {n}: {:?} ms; agent CPU per push per agent {:.2} ms; \
                     median VmRSS {:.2} MiB",
                    via.name(),
                    took.iter().map(|v| v.round()).collect::<Vec<_>>(),
                    cpu[k],
                    rss[k]
                );
            } else {
                direct_lat = median;
                println!(
                    "  {}: change → all {n}: {:?} ms",
                    via.name(),
                    took.iter().map(|v| v.round()).collect::<Vec<_>>(),
                );
            }
            for c in clients {
                c.abort();
            }
            drop(agents);
            // Back to the state the next run starts from.
            istiod.apply(&echo_endpoints(2)).await;
        }
        report.add_with_floor(
            &format!("fanout-{n}"),
            &format!("proxyless fan-out, one change → all {n} clients, p50"),
            "ms",
            lat,
            "≤ 0.8",
            "the same clients straight to istiod-box",
            direct_lat,
        );
        report.add(
            &format!("fanout-{n}-cpu"),
            &format!("proxyless fan-out, N = {n}: agent CPU per push per agent"),
            "ms",
            cpu,
            "—",
        );
        report.add(
            &format!("fanout-{n}-rss"),
            &format!("proxyless fan-out, N = {n}: agent VmRSS, median"),
            "MiB",
            rss,
            "—",
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let which = std::env::var("SIDE_LOAD").unwrap_or_else(|_| "push,dns,grpc,merge,fanout".into());
    println!(
        "side by side under load: {which}; one run per agent, one istiod-box per scenario, Envoy {}; load {}; {}",
        meshagent_testkit::envoy_bin().display(),
        loadavg(),
        utc_now()
    );
    for s in which.split(',') {
        let mut report = Report { figures: vec![] };
        match s {
            "push" => push(&mut report).await,
            "dns" => dns(&mut report).await,
            "grpc" => grpc(&mut report).await,
            "merge" => merge(&mut report).await,
            "fanout" => fanout(&mut report).await,
            other => {
                panic!("SIDE_LOAD: unknown scenario {other:?} (push, dns, grpc, merge, fanout)")
            }
        }
        // The fan-out's data file is named by its sizes, so runs of other sizes keep theirs.
        let run = match s {
            "fanout" => format!(
                "fanout-{}",
                std::env::var("SIDE_FANOUT_N").unwrap_or_else(|_| "50".into())
            )
            .replace(',', "-"),
            _ => s.to_owned(),
        };
        report.plot(&run);
    }
}
