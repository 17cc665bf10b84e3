//! `istio-iptables --cni-mode`: the rules are applied from the host's filesystem into a pod's
//! network namespace with a lock of the pod's own, so a held host xtables lock (another pod
//! being set up, kube-proxy) does not stall it. Root test in a network namespace it creates
//! and deletes (address 192.0.2.9 on one end of a veth pair inside it); needs iptables-legacy (`make netpeers`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design
#![allow(
    clippy::disallowed_types,
    reason = "synchronous test without a Tokio runtime: std::time::Instant deadlines"
)]

use std::fs::OpenOptions;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use meshagent::iptables::ISTIO_INIT_DEFAULT_ARGS;
use nix::fcntl::{Flock, FlockArg};

const BIN: &str = env!("CARGO_BIN_EXE_meshagent");

fn run(cmd: &str, args: &[&str]) -> Output {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| {
        panic!("cannot run {cmd} (install the peers with `make netpeers`): {e}")
    });
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

#[test]
fn cni_mode_takes_a_pod_scoped_xtables_lock() {
    let ns = Netns(format!("macni-{}", std::process::id()));
    run("ip", &["netns", "add", &ns.0]);
    for args in [
        &["link", "set", "lo", "up"][..],
        &["link", "add", "v0", "type", "veth", "peer", "name", "v1"],
        &["addr", "add", "192.0.2.9/24", "dev", "v0"],
        &["link", "set", "v0", "up"],
    ] {
        let mut a = vec!["-n", ns.0.as_str()];
        a.extend_from_slice(args);
        run("ip", &a);
    }

    // The host's lock, held the whole time: legacy iptables would wait for it (--wait=30)
    // and then fail.
    let lock = OpenOptions::new()
        .create(true)
        .append(true)
        .open("/run/xtables.lock")
        .unwrap();
    let held = Flock::lock(lock, FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .unwrap();
    let started = Instant::now();
    let mut args = vec![
        "istio-iptables",
        "--cni-mode",
        "--network-namespace",
        ns.0.as_str(),
        "--force-iptables-binary",
        "legacy",
    ];
    args.extend_from_slice(ISTIO_INIT_DEFAULT_ARGS);
    let out = Command::new(BIN).args(&args).output().unwrap();
    let took = started.elapsed();
    drop(held);
    assert!(
        out.status.success(),
        "istio-iptables --cni-mode failed ({}) after {took:?}:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        took < Duration::from_secs(20),
        "waited {took:?}: the host's lock was taken, not the pod's"
    );

    let save = run(
        "ip",
        &["netns", "exec", &ns.0, "iptables-legacy-save", "-t", "nat"],
    );
    let save = String::from_utf8_lossy(&save.stdout);
    for rule in [
        "-A OUTPUT -j ISTIO_OUTPUT",
        "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
    ] {
        assert!(
            save.contains(rule),
            "missing {rule:?} in the pod's rules:\n{save}"
        );
    }
    // The bind mount lived in the tool's own mount namespace only.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(" /run/xtables.lock "),
        "the lock's bind mount leaked into the host's mount namespace:\n{mounts}"
    );
}
