//! Differential: `istio-iptables --dry-run` of the real pilot-agent (built from the Go module
//! `istio.io/istio` pinned in `compat/go.sum`, `make pilot-agent`) against meshagent's, for the
//! same flags and environment, iptables and native nftables.
//!
//! Compared: the input each would give `iptables-restore`/`ip6tables-restore` (per family, in
//! order) or `nft -f -`, line by line. Istio logs them ("Running iptables restore with: <bin>
//! and the following input:", "nftables rules programmed:"); meshagent logs the same input
//! ("Running <bin> ... with the following input:"). Not compared: the surrounding log lines
//! (Istio's `pkg/log` format is another concern). Also compared: the `DRY_RUN_FILE_PATH` record
//! each writes, line by line.
//!
//! Each run is in a network namespace of its own (`unshare --net`, the tests run as root):
//! Istio's dry run with `--native-nftables` loads its rules for real. Both read the machine's
//! `/etc/resolv.conf` for DNS capture, in the same run. A missing
//! pilot-agent is a failure, never a skip: `make test` builds it first.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use meshagent_testkit::istiod_box::pilot_agent_bin as pilot_agent;

/// What one tool would apply: table input per family ("iptables-restore", "ip6tables-restore",
/// "nft"), in order; or the failure.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Applied {
        input: BTreeMap<String, Vec<Vec<String>>>,
        /// The `DRY_RUN_FILE_PATH` record (None when no file was written): every command line
        /// and restore input line, in order (Istio's `tools/istio-iptables/pkg/dependencies/
        /// stub.go` `writeAllToDryRunPath`).
        record: Option<Vec<String>>,
    },
    Failed,
}

fn starts_log_line(l: &str) -> bool {
    // RFC 3339 (both agents) or Go's `log` package ("2026/12/04 18:20:07").
    let b = l.as_bytes();
    b.len() > 10 && b[..4].iter().all(u8::is_ascii_digit) && (b[4] == b'-' || b[4] == b'/')
}

/// The blocks following each "...following input:" / "nftables rules programmed:" line.
fn blocks(text: &str) -> BTreeMap<String, Vec<Vec<String>>> {
    let mut out: BTreeMap<String, Vec<Vec<String>>> = BTreeMap::new();
    let mut cur: Option<(String, Vec<String>)> = None;
    let mut close = |cur: &mut Option<(String, Vec<String>)>| {
        if let Some((fam, lines)) = cur.take() {
            out.entry(fam).or_default().push(lines);
        }
    };
    for l in text.lines() {
        let head = l.contains("following input:") || l.contains("nftables rules programmed:");
        if head {
            close(&mut cur);
            // The part after "Running" (a log line's target may name a module "iptables").
            let what = l.rsplit_once("Running").map_or(l, |(_, w)| w);
            let fam = if l.contains("nftables rules programmed:")
                || what.trim_start().starts_with("nft")
            {
                "nft"
            } else if what.contains("ip6tables") {
                "ip6tables-restore"
            } else {
                "iptables-restore"
            };
            cur = Some((fam.to_owned(), Vec::new()));
            continue;
        }
        if starts_log_line(l) {
            close(&mut cur);
            continue;
        }
        if let Some((_, lines)) = cur.as_mut()
            && !l.trim().is_empty()
        {
            lines.push(l.trim_end().to_owned());
        }
    }
    close(&mut cur);
    out
}

fn run(bin: &PathBuf, args: &[&str], env: &[(&str, &str)]) -> (Outcome, String) {
    let dir = tempfile::tempdir().unwrap();
    // In a network namespace of its own: Istio's `--dry-run` still programs nftables rules
    // (`--native-nftables`), which on the host would capture the machine's own traffic.
    // The namespace looks like a pod's: loopback up and an eth0 with an IPv4 and an IPv6
    // address (both agents pick the rule families from the local addresses).
    let out = Command::new("unshare")
        .args(["--net", "--", "sh", "-c", POD_NETNS, "sh"])
        .arg(bin)
        .arg("istio-iptables")
        .arg("--dry-run")
        .args(args)
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .env("DRY_RUN_FILE_PATH", dir.path().join("dry-run.txt"))
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let outcome = if out.status.success() {
        Outcome::Applied {
            input: blocks(&String::from_utf8_lossy(&out.stderr))
                .into_iter()
                .chain(blocks(&String::from_utf8_lossy(&out.stdout)))
                .collect(),
            record: std::fs::read_to_string(dir.path().join("dry-run.txt"))
                .ok()
                .map(|t| t.lines().map(str::to_owned).collect()),
        }
    } else {
        Outcome::Failed
    };
    (outcome, text)
}

/// Run by `sh -c` in the new network namespace, then `exec "$@"`.
const POD_NETNS: &str = "set -e; ip link set lo up; ip link add eth0 type veth peer name eth0p; \
    ip addr add 10.1.2.3/24 dev eth0; ip -6 addr add fd00::3/64 dev eth0 nodad; \
    ip link set eth0 up; ip link set eth0p up; exec \"$@\"";

/// A case: flags and env, as a pod's init container or CNI would pass them.
struct Case {
    args: &'static [&'static str],
    env: &'static [(&'static str, &'static str)],
}

const fn c(args: &'static [&'static str], env: &'static [(&'static str, &'static str)]) -> Case {
    Case { args, env }
}

/// The sidecar injector's flags (Istio's injection template) before each case's own.
const BASE: &[&str] = &["-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT"];

const CASES: &[Case] = &[
    c(
        &["-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020"],
        &[],
    ),
    c(&["-i", "*", "-b", "*"], &[]),
    c(&["-m", "TPROXY", "-i", "*", "-b", "*"], &[]),
    c(
        &["-m", "TPROXY", "-i", "*", "-b", "80,443", "-d", "15020"],
        &[],
    ),
    c(
        &[
            "-i",
            "10.0.0.0/8,172.16.0.0/12",
            "-x",
            "10.1.0.0/16",
            "-b",
            "80,443",
        ],
        &[],
    ),
    c(&["-i", "*", "-b", ""], &[]),
    c(&["-i", "", "-b", "*"], &[]),
    c(&["-i", "", "-b", "*", "-q", "8080,9090"], &[]),
    c(&["-i", "*", "-b", "*", "-o", "3306,5432"], &[]),
    c(&["-i", "*", "-b", "*", "-c", "eth1,eth2"], &[]),
    c(&["-i", "*", "-b", "*", "-k", "veth0"], &[]),
    c(&["-i", "*", "-b", "*", "--drop-invalid"], &[]),
    c(&["-i", "*", "-b", "*", "-g", "1338"], &[]),
    c(&["-i", "*", "-b", "*", "-u", "1000", "-g", "1000"], &[]),
    c(&["-i", "*", "-b", "*", "-e", "15009"], &[]),
    c(
        &[
            "-m", "TPROXY", "-i", "*", "-b", "*", "-t", "1338", "-r", "134",
        ],
        &[],
    ),
    c(&["-i", "*", "-b", "*"], &[("ENABLE_INBOUND_IPV6", "true")]),
    c(
        &["-i", "10.0.0.0/8,fd00::/8", "-x", "fd00:1::/64", "-b", "*"],
        &[("ENABLE_INBOUND_IPV6", "true")],
    ),
    c(
        &["-i", "*", "-b", "*", "--dual-stack"],
        &[("ENABLE_INBOUND_IPV6", "true")],
    ),
    c(
        &["-i", "*", "-b", "*"],
        &[("ISTIO_OUTBOUND_OWNER_GROUPS", "root,1000")],
    ),
    c(
        &["-i", "*", "-b", "*"],
        &[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "1001")],
    ),
    c(&["-i", "*", "-b", "*", "--redirect-dns"], &[]),
    c(
        &["-i", "*", "-b", "*", "--redirect-dns"],
        &[("ENABLE_INBOUND_IPV6", "true")],
    ),
    c(
        &[
            "-m",
            "TPROXY",
            "-i",
            "*",
            "-b",
            "*",
            "--redirect-dns",
            "-c",
            "not-istio-nic",
        ],
        &[("ENABLE_INBOUND_IPV6", "true")],
    ),
    c(
        &["-i", "*", "-b", "*", "--redirect-dns", "--capture-all-dns"],
        &[],
    ),
    c(
        &["-i", "*", "-b", "*", "-g", "1337"],
        &[("ISTIO_META_DNS_CAPTURE", "true")],
    ),
    c(
        &["-i", "*", "-b", "*", "--redirect-dns"],
        &[("ISTIO_OUTBOUND_OWNER_GROUPS", "1000,root")],
    ),
    c(
        &[],
        &[
            ("ISTIO_SERVICE_CIDR", "*"),
            ("ISTIO_INBOUND_PORTS", "*"),
            ("ISTIO_LOCAL_EXCLUDE_PORTS", "15020"),
            ("ISTIO_EXCLUDE_INTERFACES", "eth9"),
        ],
    ),
    c(
        &[],
        &[
            ("ISTIO_SERVICE_CIDR", "10.0.0.0/8"),
            ("ISTIO_SERVICE_EXCLUDE_CIDR", "10.9.0.0/16"),
            ("ISTIO_INBOUND_PORTS", "8080"),
            ("ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE", "25"),
        ],
    ),
];

/// Differences that are known and listed in COMPAT.md: (case index, backend). Each must still
/// differ (so a fix removes it from here and from COMPAT.md), and no other case may.
const KNOWN: &[(usize, &str)] = &[];

#[test]
fn istio_iptables_dry_run_matches_pilot_agent() {
    let pa = pilot_agent();
    let ma = PathBuf::from(env!("CARGO_BIN_EXE_meshagent"));
    let mut report = Vec::new();
    let mut compared = 0;
    for (i, case) in CASES.iter().enumerate() {
        for backend in ["iptables", "nft"] {
            let mut args: Vec<&str> = BASE.to_vec();
            args.extend_from_slice(case.args);
            if backend == "nft" {
                args.push("--native-nftables");
            }
            let (want, want_text) = run(&pa, &args, case.env);
            let (got, got_text) = run(&ma, &args, case.env);
            compared += 1;
            let differs = want != got;
            let known = KNOWN.contains(&(i, backend));
            if differs != known {
                report.push(format!(
                    "case {i} ({backend}) args {args:?} env {:?}: {}\n--- pilot-agent {want:#?}\n--- meshagent {got:#?}\n--- pilot-agent output\n{want_text}\n--- meshagent output\n{got_text}",
                    case.env,
                    if differs { "differs" } else { "listed as a known difference but now equal: remove it from KNOWN and COMPAT.md" }
                ));
            }
            // Every case is one Istio accepts: a failure or an empty rule set means the
            // harness, not the agents, is broken.
            assert!(
                matches!(&want, Outcome::Applied { input, .. } if !input.is_empty()),
                "case {i} ({backend}): no rules from pilot-agent:\n{want_text}"
            );
        }
    }
    assert!(compared >= 40, "only {compared} cases");
    let tables = Command::new("nft")
        .args(["list", "tables"])
        .output()
        .unwrap();
    let tables = String::from_utf8_lossy(&tables.stdout);
    assert!(
        !tables.contains("istio-proxy"),
        "a run left Istio tables in the host's network namespace:\n{tables}"
    );
    assert!(
        report.is_empty(),
        "{} of {compared} cases:\n{}",
        report.len(),
        report.join("\n\n")
    );
}
