//! Differential: the log lines of the real pilot-agent (built from the Go module
//! `istio.io/istio` pinned in `compat/go.sum`, `make pilot-agent`) against meshagent's, for
//! events both produce offline: `wait` timing out on a closed port, `request` to a closed
//! port, a bad `--log_output_level`, a bad `PROXY_CONFIG`, `istio-iptables --dry-run`.
//!
//! Compared is the structure of each line (Istio `pkg/log`): the time format, the level's
//! spelling, the scope column (absent for `default`), and in JSON the key order — not the
//! message texts, except where meshagent uses Istio's text. Each run is in a network
//! namespace of its own (`unshare --net`, the tests run as root), so no port is open. A missing
//! pilot-agent is a failure, never a skip: `make test` builds it first.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use meshagent_testkit::workspace_root;

/// The real pilot-agent: `PILOT_AGENT`, else `.tools/istio/pilot-agent` (`make pilot-agent`).
fn pilot_agent() -> PathBuf {
    let p = std::env::var_os("PILOT_AGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".tools/istio/pilot-agent"));
    assert!(
        p.exists(),
        "the real pilot-agent is missing at {} (run `make pilot-agent`)",
        p.display()
    );
    p
}

fn meshagent() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_meshagent"))
}

/// A pod-like network namespace: loopback up, an eth0 with an IPv4 and an IPv6 address
/// (`istio-iptables` picks the rule families from them), no listener anywhere.
const POD_NETNS: &str = "set -e; ip link set lo up; ip link add eth0 type veth peer name eth0p; \
    ip addr add 10.1.2.3/24 dev eth0; ip -6 addr add fd00::3/64 dev eth0 nodad; \
    ip link set eth0 up; ip link set eth0p up; exec timeout -s KILL 30 \"$@\"";

/// Runs `exe args` in a new network namespace, in an empty working directory.
fn run(exe: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    Command::new("unshare")
        .args(["--net", "--", "sh", "-c", POD_NETNS, "sh"])
        .arg(exe)
        .args(args)
        .current_dir(dir.path())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("CLOUD_PLATFORM", "none")
        .envs(env.iter().copied())
        .output()
        .unwrap()
}

/// Scopes pilot-agent registers (its `--help`).
const SCOPES: &[&str] = &[
    "ads",
    "ca",
    "cache",
    "citadelclient",
    "dns",
    "gcecred",
    "grpc",
    "healthcheck",
    "klog",
    "mockcred",
    "monitoring",
    "probes",
    "sds",
    "security",
    "spiffe",
    "validation",
    "wasm",
    "xdsproxy",
];

/// `2026-12-06T22:22:25.330563Z` (Istio `pkg/log/config.go` `formatDate`).
fn is_istio_time(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() == 27
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b'-',
            10 => *c == b'T',
            13 | 16 => *c == b':',
            19 => *c == b'.',
            26 => *c == b'Z',
            _ => c.is_ascii_digit(),
        })
}

/// One log line's structure: level and scope (`None` = default), message and the keys of
/// its fields (in order for text; JSON's are sorted by the parser).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Shape {
    level: String,
    scope: Option<String>,
    msg: String,
    keys: Vec<String>,
}

/// Text lines: `time\tlevel\t[scope\t]msg[\tk=v…]`; lines that do not start with a time
/// continue a multi-line message and are skipped.
fn text_shapes(out: &[u8]) -> Vec<Shape> {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|l| {
            let cols: Vec<&str> = l.split('\t').collect();
            if !is_istio_time(cols[0]) {
                // Only a continuation may lack the time; it never looks like a log line.
                assert!(
                    !cols[0].starts_with("20") || cols[0].len() != 27,
                    "bad time in {l:?}"
                );
                return None;
            }
            assert!(cols.len() >= 3, "{l:?}");
            let level = cols[1].to_owned();
            assert!(
                ["debug", "info", "warn", "error"].contains(&level.as_str()),
                "{l:?}"
            );
            let scoped = cols.len() > 3 && SCOPES.contains(&cols[2]);
            let at = if scoped { 3 } else { 2 };
            // Fields: one more column of space-separated `k=v` (values are unquoted, so only
            // keys at the start of a token are certain; enough for the shape).
            let keys = cols
                .get(at + 1)
                .map(|f| {
                    f.split(' ')
                        .filter_map(|t| t.split_once('=').map(|(k, _)| k))
                        .filter(|k| {
                            !k.is_empty()
                                && k.chars()
                                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
                        })
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            Some(Shape {
                level,
                scope: scoped.then(|| cols[2].to_owned()),
                msg: cols[at].to_owned(),
                keys,
            })
        })
        .collect()
}

/// JSON lines: `{"level":…,"time":…[,"scope":…][,"caller":…],"msg":…[,fields]}`, the keys
/// in this order (zap's JSON encoder with Istio's keys); every line must be one.
fn json_shapes(out: &[u8]) -> Vec<Shape> {
    String::from_utf8_lossy(out)
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}"));
            // The keys before `msg` hold plain strings: walk the raw line for their order.
            let mut rest = l.strip_prefix('{').unwrap();
            let mut keys = Vec::new();
            while let Some(after) = rest.strip_prefix('"') {
                let (k, tail) = after.split_once("\":").unwrap();
                keys.push(k);
                if k == "msg" {
                    break;
                }
                let tail = tail.strip_prefix('"').unwrap();
                let end = tail.find('"').unwrap();
                rest = tail[end + 1..].strip_prefix(',').unwrap();
            }
            let mut want = vec!["level", "time"];
            if v.get("scope").is_some() {
                want.push("scope");
            }
            if v.get("caller").is_some() {
                want.push("caller");
            }
            want.push("msg");
            assert_eq!(keys, want, "{l}");
            assert!(is_istio_time(v["time"].as_str().unwrap()), "{l}");
            Shape {
                level: v["level"].as_str().unwrap().to_owned(),
                scope: v.get("scope").map(|s| s.as_str().unwrap().to_owned()),
                msg: v["msg"].as_str().unwrap().to_owned(),
                keys: v
                    .as_object()
                    .unwrap()
                    .keys()
                    .filter(|k| !["level", "time", "scope", "caller", "msg"].contains(&k.as_str()))
                    .cloned()
                    .collect(),
            }
        })
        .collect()
}

/// Levels and scopes, without the messages.
fn levels(shapes: &[Shape]) -> Vec<(String, Option<String>)> {
    shapes
        .iter()
        .map(|s| (s.level.clone(), s.scope.clone()))
        .collect()
}

#[test]
fn wait_timeout_text() {
    let args = [
        "wait",
        "--timeoutSeconds",
        "1",
        "--url",
        "http://127.0.0.1:15021/healthz/ready",
    ];
    let istio = run(&pilot_agent(), &args, &[]);
    let ours = run(&meshagent(), &args, &[]);
    let (i, o) = (text_shapes(&istio.stdout), text_shapes(&ours.stdout));
    assert_eq!(levels(&i), levels(&o), "istio {i:?}\nours {o:?}");
    assert_eq!(
        levels(&o),
        [("info".to_owned(), None), ("error".to_owned(), None)]
    );
    // The start line is Istio's text (startup hooks are grepped).
    assert_eq!(i[0].msg, o[0].msg);
    assert!(
        o[1].msg
            .starts_with("timeout waiting for Envoy proxy to become ready")
    );
    assert!(!istio.status.success() && !ours.status.success());
}

#[test]
fn request_to_closed_port_text() {
    let args = ["request", "GET", "stats"];
    let istio = run(&pilot_agent(), &args, &[]);
    let ours = run(&meshagent(), &args, &[]);
    let (i, o) = (text_shapes(&istio.stdout), text_shapes(&ours.stdout));
    assert_eq!(levels(&i), levels(&o), "istio {i:?}\nours {o:?}");
    assert_eq!(levels(&o), [("error".to_owned(), None)]);
    assert!(!ours.status.success());
}

#[test]
fn invalid_output_level_is_an_istio_error_line() {
    for (flag, want) in [
        ("default:bogus", "invalid output level 'bogus'"),
        ("a:b:c", "invalid output level format 'a:b:c'"),
    ] {
        let args = ["proxy", "sidecar", "--log_output_level", flag];
        let istio = run(&pilot_agent(), &args, &[]);
        let ours = run(&meshagent(), &args, &[]);
        let (i, o) = (text_shapes(&istio.stdout), text_shapes(&ours.stdout));
        assert_eq!(i, o, "{flag}");
        assert_eq!(o.last().unwrap().msg, want);
        assert!(!ours.status.success());
    }
}

#[test]
fn bad_proxy_config_text_and_json() {
    let env = [("PROXY_CONFIG", "{{bad")];
    for json in [false, true] {
        let mut args = vec!["proxy", "sidecar"];
        if json {
            args.push("--log_as_json");
        }
        let istio = run(&pilot_agent(), &args, &env);
        let ours = run(&meshagent(), &args, &env);
        let shapes = |o: &Output| {
            if json {
                json_shapes(&o.stdout)
            } else {
                text_shapes(&o.stdout)
            }
        };
        let (i, o) = (shapes(&istio), shapes(&ours));
        // Istio logs its flags and version first; the failure is the last line of both.
        let (il, ol) = (i.last().unwrap(), o.last().unwrap());
        assert_eq!(
            (&il.level, &il.scope),
            (&ol.level, &ol.scope),
            "{i:?}\n{o:?}"
        );
        assert_eq!(ol.level, "error");
        assert!(ol.msg.contains("PROXY_CONFIG"), "{ol:?}");
        assert!(!ours.status.success());
    }
}

#[test]
fn iptables_dry_run_text_and_json() {
    for json in [false, true] {
        let mut args = vec![
            "istio-iptables",
            "--dry-run",
            "-p",
            "15001",
            "-u",
            "1337",
            "-m",
            "REDIRECT",
            "-i",
            "*",
        ];
        if json {
            args.push("--log_as_json");
        }
        let istio = run(&pilot_agent(), &args, &[]);
        let ours = run(&meshagent(), &args, &[]);
        assert!(istio.status.success() && ours.status.success());
        // Istio logs to stdout beside the rules; meshagent keeps stdout for the transcript and
        // logs to stderr. `istio-iptables` logs through the default scope, at info.
        let (i, o) = if json {
            (json_shapes(&istio.stdout), json_shapes(&ours.stderr))
        } else {
            (text_shapes(&istio.stdout), text_shapes(&ours.stderr))
        };
        assert!(!i.is_empty() && !o.is_empty());
        for s in i.iter().chain(&o) {
            assert_eq!((s.level.as_str(), &s.scope), ("info", &None), "{s:?}");
        }
        // The first line is Istio's.
        assert_eq!(i[0].msg, o[0].msg);
    }
}

#[test]
fn version_logs_nothing_on_stdout() {
    let istio = run(&pilot_agent(), &["version"], &[]);
    let ours = run(&meshagent(), &["version"], &[]);
    assert!(text_shapes(&istio.stdout).is_empty());
    assert!(text_shapes(&ours.stdout).is_empty());
}

#[test]
fn scoped_lines_with_fields_text_and_json() {
    // Offline, pilot-agent's scoped lines with fields are its `monitoring` debug lines at
    // start; meshagent's are `cache` and `xdsproxy` info lines (the start then fails: no
    // Envoy, no CA root, in both).
    for json in [false, true] {
        let mut istio_args = vec!["proxy", "sidecar", "--log_output_level", "all:debug"];
        let mut our_args = vec!["proxy", "sidecar"];
        if json {
            istio_args.push("--log_as_json");
            our_args.push("--log_as_json");
        }
        let istio = run(&pilot_agent(), &istio_args, &[]);
        let ours = run(&meshagent(), &our_args, &[]);
        let shapes = |o: &Output| {
            if json {
                json_shapes(&o.stdout)
            } else {
                text_shapes(&o.stdout)
            }
        };
        let scoped_with_fields = |v: Vec<Shape>| -> Vec<Shape> {
            v.into_iter()
                .filter(|s| s.scope.is_some() && !s.keys.is_empty())
                .collect()
        };
        let i = scoped_with_fields(shapes(&istio));
        let o = scoped_with_fields(shapes(&ours));
        assert!(!i.is_empty(), "no scoped line from pilot-agent");
        assert!(
            o.iter().any(|s| s.scope.as_deref() == Some("xdsproxy")
                && s.msg == "xDS proxy listening"
                && s.keys.iter().any(|k| k == "socket")),
            "{o:?}"
        );
        assert!(
            o.iter().any(|s| s.scope.as_deref() == Some("cache")),
            "{o:?}"
        );
    }
}
