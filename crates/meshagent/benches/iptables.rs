//! `istio-iptables` start-up cost: the init container is on every pod's start-up
//! path. Measures `meshagent istio-iptables` against the floor — the bare
//! `iptables-restore --noflush` (resp. `nft -f -`) of the same ruleset — each run in a
//! fresh network namespace (with one veth pair, so address detection has something to
//! see). Scenarios: the injector's default sidecar arguments, and the same with DNS capture
//! and IPv6 (dual stack; the resolv.conf servers are the host's). Goal: ≤ 1.2× the floor
//! and ≤ 5 ms over it.
//!
//! Wall-clock times (ms, p50/p90) are the goal's measure; the CPU columns (user + system of
//! the process and its children, p50) are what is left when the machine is shared.
//!
//! `cargo bench -p meshagent --bench iptables` (root; `make netpeers`). `MESHAGENT_BIN`
//! selects the binary (default: the one cargo built for this bench); `IPTABLES_BENCH_N`
//! the runs per variant (default 30).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::disallowed_types)] // a benchmark binary

use std::fs::File;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use meshagent::iptables::config::{Config, MapEnv, resolv_conf_servers};
use meshagent::iptables::{ISTIO_INIT_DEFAULT_ARGS, nft, rules};

/// The injector's istio-init arguments, quieter than its `default:info`.
fn default_args() -> Vec<&'static str> {
    [
        ISTIO_INIT_DEFAULT_ARGS,
        &["--log_output_level=default:error"],
    ]
    .concat()
}

fn sh(cmd: &str, args: &[&str]) {
    let st = Command::new(cmd)
        .args(args)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "{cmd} {args:?}: {st}");
}

/// A fresh namespace with a veth pair (v4, and v6 when `v6`); deleted on drop.
struct Ns(String);

impl Ns {
    fn new(i: usize, v6: bool) -> Self {
        let name = format!("maibench-{}-{i}", std::process::id());
        sh("ip", &["netns", "add", &name]);
        sh("ip", &["-n", &name, "link", "set", "lo", "up"]);
        sh(
            "ip",
            &[
                "-n", &name, "link", "add", "bench0", "type", "veth", "peer", "name", "bench1",
            ],
        );
        sh(
            "ip",
            &["-n", &name, "addr", "add", "192.0.2.1/24", "dev", "bench0"],
        );
        if v6 {
            sh(
                "ip",
                &[
                    "-n",
                    &name,
                    "addr",
                    "add",
                    "2001:db8::1/64",
                    "dev",
                    "bench0",
                    "nodad",
                ],
            );
        }
        sh("ip", &["-n", &name, "link", "set", "bench0", "up"]);
        Ns(name)
    }

    /// Runs `f` on a thread inside the namespace (children it spawns are inside too).
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{}", self.0);
        std::thread::spawn(move || {
            nix::sched::setns(
                File::open(path).unwrap(),
                nix::sched::CloneFlags::CLONE_NEWNET,
            )
            .unwrap();
            f()
        })
        .join()
        .unwrap()
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// CPU time (user + system) of every reaped child so far.
fn children_cpu() -> Duration {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN).unwrap();
    let tv =
        |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000);
    tv(u.user_time()) + tv(u.system_time())
}

/// Wall time and CPU time (the process and its children) of one process run.
fn timed(cmd: &str, args: &[String], stdin: Option<String>) -> (Duration, Duration) {
    let cpu0 = children_cpu();
    let start = Instant::now();
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let took = start.elapsed();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (took, children_cpu() - cpu0)
}

struct Scenario {
    name: &'static str,
    args: Vec<&'static str>,
    v6: bool,
    nft: bool,
}

impl Scenario {
    /// The floor: the same ruleset our run applies, as bare restore / nft invocations.
    fn floor_commands(&self) -> Vec<(String, Vec<String>, String)> {
        let args: Vec<String> = self.args.iter().map(|s| (*s).to_owned()).collect();
        let mut cfg = Config::from_args(&args, &MapEnv::default()).unwrap();
        cfg.enable_ipv6 = self.v6;
        if cfg.redirect_dns {
            let (v4, v6) = resolv_conf_servers(
                &std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default(),
            );
            cfg.dns_servers_v4 = v4;
            cfg.dns_servers_v6 = v6;
        }
        if self.nft {
            return vec![(
                "nft".into(),
                vec!["-f".into(), "-".into()],
                nft::build(&cfg),
            )];
        }
        let plan = rules::build(&cfg);
        let noflush = vec!["--noflush".to_owned()];
        let mut cmds = vec![(
            "iptables-nft-restore".to_owned(),
            noflush.clone(),
            rules::restore_text(&plan.v4),
        )];
        if self.v6 {
            cmds.push((
                "ip6tables-nft-restore".to_owned(),
                noflush,
                rules::restore_text(&plan.v6),
            ));
        }
        cmds
    }
}

fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (
        ms(v[v.len() / 2]),
        ms(v[(v.len() * 9 / 10).min(v.len() - 1)]),
    )
}

fn main() {
    let bin = std::env::var("MESHAGENT_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_meshagent").to_owned());
    let n: usize = std::env::var("IPTABLES_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let dns_v6: Vec<&str> = [default_args(), vec!["--redirect-dns", "--dual-stack"]].concat();
    let scenarios = [
        Scenario {
            name: "iptables default",
            args: default_args(),
            v6: false,
            nft: false,
        },
        Scenario {
            name: "iptables DNS+IPv6",
            args: dns_v6.clone(),
            v6: true,
            nft: false,
        },
        Scenario {
            name: "nft default",
            args: [vec!["--native-nftables"], default_args()].concat(),
            v6: false,
            nft: true,
        },
        Scenario {
            name: "nft DNS+IPv6",
            args: [&["--native-nftables"][..], &dns_v6].concat(),
            v6: true,
            nft: true,
        },
    ];
    println!(
        "istio-iptables vs bare restore of the same ruleset, fresh netns per run, n={n}, {bin}"
    );
    println!(
        "{:<18} {:>9} {:>9} {:>9} {:>9} {:>6} {:>7} | {:>8} {:>9} {:>6} {:>7}",
        "scenario",
        "ours p50",
        "ours p90",
        "floor p50",
        "floor p90",
        "ratio",
        "delta",
        "ours cpu",
        "floor cpu",
        "ratio",
        "delta"
    );
    for sc in &scenarios {
        let floor_cmds = sc.floor_commands();
        let (mut ours, mut floor) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let (mut ours_cpu, mut floor_cpu) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n + 2 {
            let ns = Ns::new(i, sc.v6);
            let args: Vec<String> = std::iter::once("istio-iptables".to_owned())
                .chain(sc.args.iter().map(|s| (*s).to_owned()))
                .collect();
            let b = bin.clone();
            let t = ns.run(move || timed(&b, &args, None));
            drop(ns);
            let ns = Ns::new(i, sc.v6);
            let cmds = floor_cmds.clone();
            let f = ns.run(move || {
                cmds.into_iter()
                    .map(|(c, a, input)| timed(&c, &a, Some(input)))
                    .fold((Duration::ZERO, Duration::ZERO), |acc, t| {
                        (acc.0 + t.0, acc.1 + t.1)
                    })
            });
            drop(ns);
            // The first two runs warm caches and modules.
            if i >= 2 {
                ours.push(t.0);
                ours_cpu.push(t.1);
                floor.push(f.0);
                floor_cpu.push(f.1);
            }
        }
        let (o50, o90) = stats(ours);
        let (f50, f90) = stats(floor);
        let (oc, _) = stats(ours_cpu);
        let (fc, _) = stats(floor_cpu);
        println!(
            "{:<18} {o50:>9.2} {o90:>9.2} {f50:>9.2} {f90:>9.2} {:>6.2} {:>7.2} | {oc:>8.2} {fc:>9.2} {:>6.2} {:>7.2}",
            sc.name,
            o50 / f50,
            o50 - f50,
            oc / fc,
            oc - fc
        );
    }
}
