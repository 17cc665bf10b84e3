//! The command line against the real pilot-agent: both binaries run with the same arguments
//! (meshagent under the `pilot-agent` name, through a symlink), and their exit status, stdout
//! and stderr compared after normalising timestamps, scope lists and Go's memlimit line.
//! Every intended difference is an allow-list entry below with its reason (also in COMPAT.md).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Subcommands only meshagent has, with why.
const MESHAGENT_ONLY_SUBCOMMANDS: &[(&str, &str)] = &[
    (
        "config-reference",
        "prints the reference of every variable, flag and annotation (docs/configuration-reference.md)",
    ),
    ("debug", "`debug bundle`: diagnostics for bug reports"),
    ("doctor", "checks a pod's setup and explains each failure"),
];

/// Subcommands only pilot-agent has, with why.
const PILOT_AGENT_ONLY_SUBCOMMANDS: &[(&str, &str)] = &[(
    "completion",
    "cobra's generated shell completion scripts; an agent in a container is not typed at",
)];

/// Root flags only pilot-agent lists, with why.
const PILOT_AGENT_ONLY_ROOT_FLAGS: &[(&str, &str)] = &[(
    "vklog",
    "klog verbosity; meshagent has no klog, and drops the flag as an unknown one before `proxy`",
)];

/// Subcommands whose one-line description differs, with why.
const DIFFERENT_DESCRIPTIONS: &[(&str, &str)] = &[(
    "help",
    "clap's and cobra's generated help command describe themselves each their way",
)];

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn run(exe: &Path, args: &[&str]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(exe)
        .args(args)
        .current_dir(dir.path())
        .env_clear()
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
    Run {
        code: out.status.code(),
        stdout: normalise(&String::from_utf8_lossy(&out.stdout)),
        stderr: normalise(&String::from_utf8_lossy(&out.stderr)),
    }
}

/// Timestamps become `TS`; Go's automemlimit start-up line goes; the log scopes each binary
/// registers (they are each its own) are cut from the logging flags' descriptions.
fn normalise(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.contains("automemlimit") {
            continue;
        }
        let line = match line.split_once('\t') {
            Some((ts, rest)) if ts.len() > 20 && ts.ends_with('Z') && ts.contains('T') => {
                format!("TS\t{rest}")
            }
            _ => line.to_owned(),
        };
        out.push_str(&cut_scope_lists(&line));
        out.push('\n');
    }
    out
}

fn cut_scope_lists(line: &str) -> String {
    let mut line = line.to_owned();
    for (start, end) in [
        (", scopes can be any of [", "]"),
        (" where scope can be one of [", "] and"),
    ] {
        if let Some(i) = line.find(start)
            && let Some(j) = line[i + start.len()..].find(end)
        {
            let keep = if end == "] and" { " where" } else { "" };
            let tail = line[i + start.len() + j + end.len()..].to_owned();
            line = format!("{}{keep}{tail}", &line[..i]);
        }
    }
    line
}

/// meshagent under the `pilot-agent` name, and the real one.
fn binaries() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("pilot-agent");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_meshagent"), &link).unwrap();
    (dir, link, meshagent_testkit::istiod_box::pilot_agent_bin())
}

/// The `  name   description` lines of a help section (cobra "Available Commands:", clap
/// "Commands:"), by name.
fn section(help: &str, header: &str) -> BTreeMap<String, String> {
    help.lines()
        .skip_while(|l| l.trim_end() != header)
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .map(|l| {
            let l = l.trim();
            let (name, desc) = l.split_once(' ').unwrap_or((l, ""));
            (name.to_owned(), desc.trim().to_owned())
        })
        .collect()
}

/// Long flag names listed in a help text.
fn long_flags(help: &str) -> Vec<String> {
    let mut names: Vec<String> = help
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--"))
        .filter(|w| w.chars().next().is_some_and(|c| c.is_ascii_alphabetic()))
        .map(|w| {
            w.split(['[', '=', ',', '<'])
                .next()
                .unwrap_or(w)
                .trim_end_matches(['.', ')', '"'])
                .to_owned()
        })
        .filter(|w| !w.is_empty())
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn top_level_help_lists_pilot_agents_subcommands() {
    let (_dir, ours, istio) = binaries();
    let (m, p) = (run(&ours, &["--help"]), run(&istio, &["--help"]));
    assert_eq!(
        (m.code, p.code),
        (Some(0), Some(0)),
        "{}\n{}",
        m.stderr,
        p.stderr
    );
    let mine = section(&m.stdout, "Commands:");
    let theirs = section(&p.stdout, "Available Commands:");
    assert!(
        !theirs.is_empty(),
        "no commands in pilot-agent's help:\n{}",
        p.stdout
    );
    for (name, desc) in &theirs {
        let allowed = PILOT_AGENT_ONLY_SUBCOMMANDS.iter().any(|(n, _)| n == name);
        match mine.get(name) {
            None => assert!(
                allowed,
                "`{name}` missing from meshagent's help:\n{}",
                m.stdout
            ),
            Some(ours) => {
                assert!(
                    !allowed,
                    "`{name}` is allow-listed as missing but is listed"
                );
                let differs = DIFFERENT_DESCRIPTIONS.iter().any(|(n, _)| n == name);
                assert!(
                    differs || ours.trim_end_matches('.') == desc.trim_end_matches('.'),
                    "`{name}`: meshagent says {ours:?}, pilot-agent {desc:?}"
                );
            }
        }
    }
    for name in mine.keys() {
        assert!(
            theirs.contains_key(name) || MESHAGENT_ONLY_SUBCOMMANDS.iter().any(|(n, _)| n == name),
            "`{name}` is meshagent's only: add it to MESHAGENT_ONLY_SUBCOMMANDS with why"
        );
    }
    // A listed difference that is gone fails too: the list must stay true.
    for (name, why) in MESHAGENT_ONLY_SUBCOMMANDS {
        assert!(
            mine.contains_key(*name) && !theirs.contains_key(*name),
            "`{name}` ({why}) is no longer meshagent's only: update the list and COMPAT.md"
        );
    }
    for (name, why) in DIFFERENT_DESCRIPTIONS {
        assert_ne!(
            mine.get(*name),
            theirs.get(*name),
            "`{name}` ({why}) now reads the same: drop it from DIFFERENT_DESCRIPTIONS"
        );
    }
    let (mine, theirs) = (long_flags(&m.stdout), long_flags(&p.stdout));
    for (flag, why) in PILOT_AGENT_ONLY_ROOT_FLAGS {
        assert!(
            theirs.iter().any(|f| f == flag) && !mine.iter().any(|f| f == flag),
            "--{flag} ({why}) is no longer pilot-agent's only: update the list and COMPAT.md"
        );
    }
    for f in &theirs {
        assert!(
            mine.contains(f) || PILOT_AGENT_ONLY_ROOT_FLAGS.iter().any(|(n, _)| n == f),
            "root flag --{f} missing from meshagent's help:\n{}",
            m.stdout
        );
    }
    for f in &mine {
        assert!(theirs.contains(f), "root flag --{f} is meshagent's only");
    }
}

/// Same text in both: every flag, its short letter, type, description and default, in
/// pflag's layout (the log scopes cut, see `normalise`).
#[test]
fn istio_iptables_help_is_pilot_agents() {
    let (_dir, ours, istio) = binaries();
    for args in [
        &["istio-iptables", "--help"][..],
        &["istio-iptables", "-h"][..],
        &["--log_as_json", "istio-iptables", "--help"][..],
    ] {
        let (m, p) = (run(&ours, args), run(&istio, args));
        assert_eq!(m.code, p.code, "{args:?}: {}", m.stderr);
        assert_eq!(m.stderr, p.stderr, "{args:?}: stderr");
        let (ml, pl): (Vec<&str>, Vec<&str>) =
            (m.stdout.lines().collect(), p.stdout.lines().collect());
        for (i, (a, b)) in ml.iter().zip(&pl).enumerate() {
            assert_eq!(a, b, "{args:?}: line {i} differs");
        }
        assert_eq!(
            ml.len(),
            pl.len(),
            "{args:?}:\n{}\n---\n{}",
            m.stdout,
            p.stdout
        );
    }
}

/// pflag's `(default "x")` and clap's `[default: x]`, by flag.
fn defaults(help: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut current = None;
    for line in help.lines() {
        let t = line.trim_start();
        if let Some(rest) = t
            .strip_prefix("--")
            .or_else(|| t.get(4..).and_then(|r| r.strip_prefix("--")))
        {
            current = Some(
                rest.split([' ', '[', '='])
                    .next()
                    .unwrap_or(rest)
                    .to_owned(),
            );
        }
        let Some(name) = &current else { continue };
        let found = line
            .rfind("(default ")
            .map(|i| {
                line[i + 9..]
                    .trim_end_matches(')')
                    .trim_matches('"')
                    .to_owned()
            })
            .or_else(|| {
                line.rfind("[default: ").map(|i| {
                    line[i + 10..]
                        .trim_end_matches(']')
                        .trim_matches('"')
                        .to_owned()
                })
            });
        if let Some(d) = found {
            out.insert(name.clone(), d);
        }
    }
    out
}

#[test]
fn proxy_help_defaults_and_descriptions_are_pilot_agents() {
    let (_dir, ours, istio) = binaries();
    let (m, p) = (
        run(&ours, &["proxy", "--help"]),
        run(&istio, &["proxy", "--help"]),
    );
    assert_eq!((m.code, p.code), (Some(0), Some(0)));
    let (md, pd) = (defaults(&m.stdout), defaults(&p.stdout));
    assert_eq!(
        pd.get("proxyLogLevel").map(String::as_str),
        Some("warning"),
        "{}",
        p.stdout
    );
    for flag in ["proxyLogLevel", "profiling", "meshConfig", "serviceCluster"] {
        assert_eq!(
            md.get(flag),
            pd.get(flag),
            "--{flag}: default\n{}",
            m.stdout
        );
    }
    // --profiling says what it turns on (meshagent has no Go profiles: it says so), and
    // --proxyLogLevel which levels exist.
    let para = |help: &str, flag: &str| -> String {
        let start = help.find(&format!("--{flag}")).unwrap();
        help[start..].split("\n      --").next().unwrap().to_owned()
    };
    assert!(
        para(&m.stdout, "profiling").contains("/debug/pprof/"),
        "{}",
        m.stdout
    );
    let levels = para(&m.stdout, "proxyLogLevel");
    for level in [
        "trace", "debug", "info", "warning", "error", "critical", "off",
    ] {
        assert!(
            levels.contains(level),
            "--proxyLogLevel does not list {level}: {levels}"
        );
    }
}

/// An unknown flag on a subcommand pilot-agent does not let tolerate them: the same log line
/// on stdout and `Error: unknown flag: --x` on stderr. The exit status is 1 where cobra's is
/// 255 (COMPAT.md, "a failed command").
#[test]
fn unknown_flags_fail_as_pilot_agent_does() {
    let (_dir, ours, istio) = binaries();
    for args in [
        &["wait", "--x"][..],
        &["istio-iptables", "--x"][..],
        &["request", "--x"][..],
        &["request", "GET", "stats", "--x=1"][..],
        &["version", "--x"][..],
        &["version", "--x", "--short"][..],
    ] {
        let (m, p) = (run(&ours, args), run(&istio, args));
        assert_eq!(
            (p.code, m.code),
            (Some(255), Some(1)),
            "{args:?}\n{}\n{}",
            m.stdout,
            m.stderr
        );
        assert_eq!(m.stdout, p.stdout, "{args:?}: stdout");
        assert_eq!(m.stderr, p.stderr, "{args:?}: stderr");
    }
    // `proxy` tolerates them, as pilot-agent's FParseErrWhitelist does: `--dump-config`
    // stands for a start here (meshagent's own flag, so only meshagent runs it).
    let m = run(&ours, &["proxy", "--x", "--dump-config"]);
    assert_eq!(m.code, Some(0), "{}\n{}", m.stdout, m.stderr);
}
