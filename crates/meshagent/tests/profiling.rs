//! `/debug/pprof/profile` and `/debug/tokioz` on a running agent (`meshagent proxy sidecar`
//! with only its status server, as a pod with `DISABLE_ENVOY` runs it), in a network namespace
//! of the test's own that also holds a non-loopback address on `lo`, so a non-loopback peer can
//! be tried. Clients are curl run in that namespace; the profile is read by the real peer,
//! `go tool pprof -top`.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use meshagent_testkit::{DEADLINE, Proc, free_port, status_only_agent, wait_for};

/// A non-loopback address, on the namespace's `lo`: a peer connecting to it is that address.
const OTHER: &str = "10.77.0.1";
const GO: &str = "/usr/local/go/bin/go";

/// A network namespace for one test, removed on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Netns {
        let ns = Netns(format!("ma-{tag}-{}", std::process::id()));
        let _ = Command::new("ip").args(["netns", "del", &ns.0]).output();
        let addr = format!("{OTHER}/32");
        for args in [
            vec!["netns", "add", &ns.0],
            vec!["-n", &ns.0, "link", "set", "lo", "up"],
            vec!["-n", &ns.0, "addr", "add", &addr, "dev", "lo"],
        ] {
            let out = Command::new("ip").args(&args).output().unwrap();
            assert!(out.status.success(), "ip {args:?}: {out:?}");
        }
        ns
    }

    fn command(&self, program: &str) -> Command {
        in_ns(&self.0, program)
    }

    async fn get(&self, host: &str, port: u16, path: &str, out: &Path) -> (u16, Vec<u8>) {
        get(&self.0, host, port, path, out).await
    }
}

fn in_ns(ns: &str, program: &str) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, program]);
    c
}

/// GET `http://{host}:{port}{path}` from inside namespace `ns`, the body into `out`:
/// (status code, body), bounded in time.
async fn get(ns: &str, host: &str, port: u16, path: &str, out: &Path) -> (u16, Vec<u8>) {
    let _ = std::fs::remove_file(out);
    let mut cmd = tokio::process::Command::from(in_ns(ns, "curl"));
    cmd.args(["-s", "--max-time", "60", "-o"])
        .arg(out)
        .args(["-w", "%{http_code}"])
        .arg(format!("http://{host}:{port}{path}"))
        .kill_on_drop(true);
    let o = tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .expect("curl finishes")
        .unwrap();
    let code = String::from_utf8_lossy(&o.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    (code, std::fs::read(out).unwrap_or_default())
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

fn agent(ns: &Netns, cwd: &Path, status: u16, env: &[(&str, &str)], args: &[&str]) -> Proc {
    let mut cmd = ns.command(env!("CARGO_BIN_EXE_meshagent"));
    status_only_agent(&mut cmd, cwd, status);
    // `--profiling=false` goes after `proxy sidecar`, before the flags Istio's injector adds.
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Proc::spawn("agent", cmd, cwd)
}

async fn wait_up(ns: &Netns, status: u16, dir: &Path) {
    let f = dir.join("ready");
    wait_for("the status server", DEADLINE, || async {
        let (code, _) = ns.get("127.0.0.1", status, "/debug/tokioz", &f).await;
        (code != 0).then_some(())
    })
    .await;
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `go tool pprof -top` on `profile`: its output, or a panic with it.
fn pprof_top(profile: &Path) -> String {
    let out = Command::new(GO)
        .args(["tool", "pprof", "-top"])
        .arg(profile)
        .env("HOME", std::env::temp_dir())
        .env("PPROF_TMPDIR", std::env::temp_dir())
        .output()
        .expect("run go tool pprof");
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "go tool pprof -top failed: {all}");
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_profile_is_opt_in_loopback_bounded_and_read_by_go_pprof() {
    let ns = Netns::new("prof");
    let dir = tempfile::tempdir().unwrap();
    let status = free_port();
    let mut a = agent(
        &ns,
        dir.path(),
        status,
        &[("MESHAGENT_PROFILING", "true")],
        &[],
    );
    wait_up(&ns, status, dir.path()).await;
    let f = |n: &str| -> PathBuf { dir.path().join(n) };
    let fail = |what: &str, a: &Proc| -> String { format!("{what}\nagent log:\n{}", a.log_text()) };

    // The Tokio view: a current-thread runtime with one worker and live tasks.
    let (code, body) = ns
        .get("127.0.0.1", status, "/debug/tokioz", &f("tokioz"))
        .await;
    assert_eq!(code, 200, "{}", fail(&text(&body), &a));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["flavor"], "current_thread", "{v}");
    assert_eq!(v["workers"], 1, "{v}");
    assert!(v["aliveTasks"].as_u64().unwrap() > 0, "{v}");
    assert!(v["globalQueueDepth"].is_u64(), "{v}");
    assert!(
        v["perWorker"][0]["busySeconds"].as_f64().unwrap() > 0.0,
        "{v}"
    );

    // Bad `seconds`: 400 naming the parameter and the range, before any profiling.
    for bad in ["0", "301", "abc", "-5"] {
        let path = format!("/debug/pprof/profile?seconds={bad}");
        let (code, body) = ns.get("127.0.0.1", status, &path, &f("bad")).await;
        let body = text(&body);
        assert_eq!(code, 400, "{path}: {}", fail(&body, &a));
        assert!(
            body.contains("seconds") && body.contains("1 to 300"),
            "{path}: {body}"
        );
    }

    // A non-loopback peer is refused, as Istio's pprof handlers refuse it.
    let (code, body) = ns
        .get(OTHER, status, "/debug/pprof/profile?seconds=1", &f("other"))
        .await;
    assert_eq!(code, 403, "{}", fail(&text(&body), &a));
    assert!(text(&body).contains("Only requests from localhost"));
    let (code, _) = ns.get(OTHER, status, "/debug/tokioz", &f("other")).await;
    assert_eq!(code, 403);

    // Enabled but idle: no SIGPROF handler yet.
    let sigprof = 1u64 << (libc_sigprof() - 1);
    assert_eq!(
        signal_mask(a.pid(), "SigCgt") & sigprof,
        0,
        "SIGPROF caught before a profile"
    );

    // A 3 s profile while the agent works (metrics scrapes in a loop), and a second request
    // once the agent has logged that the first one holds the profiler: refused.
    let first = {
        let ns_name = ns.0.clone();
        let out = f("profile.pb.gz");
        tokio::spawn(async move {
            get(
                &ns_name,
                "127.0.0.1",
                status,
                "/debug/pprof/profile?seconds=3",
                &out,
            )
            .await
        })
    };
    let load = {
        let ns_name = ns.0.clone();
        let out = f("load");
        tokio::spawn(async move {
            let end = tokio::time::Instant::now() + Duration::from_secs(3);
            while tokio::time::Instant::now() < end {
                let mut c = tokio::process::Command::from(in_ns(&ns_name, "curl"));
                c.args(["-s", "--max-time", "5", "-o"]).arg(&out);
                for _ in 0..50 {
                    c.arg(format!("http://127.0.0.1:{status}/stats/prometheus"));
                }
                let _ = c.kill_on_drop(true).output().await;
            }
        })
    };
    wait_for("the first profile to start", DEADLINE, || async {
        a.log_text().contains("CPU profile started").then_some(())
    })
    .await;
    let (code, body) = ns
        .get(
            "127.0.0.1",
            status,
            "/debug/pprof/profile?seconds=1",
            &f("second"),
        )
        .await;
    let refused = text(&body);
    assert_eq!(code, 409, "{}", fail(&refused, &a));
    assert!(refused.contains("already"), "{refused}");
    load.await.unwrap();
    let (code, body) = first.await.unwrap();
    assert_eq!(code, 200, "{}", fail(&text(&body), &a));
    assert_eq!(
        &body[..2],
        &[0x1f, 0x8b],
        "gzip, as Go's net/http/pprof serves it"
    );
    let top = pprof_top(&f("profile.pb.gz"));
    eprintln!("{}", top.lines().take(20).collect::<Vec<_>>().join("\n"));
    assert!(top.contains("Type: cpu"), "{top}");
    // `Duration: 3s, Total samples = 120ms (4%)`: some CPU time was sampled.
    let total = top
        .lines()
        .find_map(|l| l.split_once("Total samples = ").map(|(_, r)| r.to_owned()))
        .unwrap_or_else(|| panic!("no samples line in {top}"));
    assert!(!total.starts_with("0 "), "no samples: {top}");
    assert!(top.contains("meshagent"), "no agent frames in {top}");

    // The slot is free again: another profile is served.
    let (code, body) = ns
        .get(
            "127.0.0.1",
            status,
            "/debug/pprof/profile?seconds=1",
            &f("again"),
        )
        .await;
    assert_eq!(code, 200, "{}", fail(&text(&body), &a));
    assert!(a.try_wait().is_none(), "{}", fail("the agent exited", &a));
    // The handler is gone once the profiles are done.
    assert_eq!(
        signal_mask(a.pid(), "SigCgt") & sigprof,
        0,
        "SIGPROF still caught"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cpu_profile_is_off_without_the_env_var_or_with_profiling_false() {
    let ns = Netns::new("noprof");
    let dir = tempfile::tempdir().unwrap();
    let f = |n: &str| -> PathBuf { dir.path().join(n) };

    // Without MESHAGENT_PROFILING: 404 naming the variable; tokioz and the index still served.
    let status = free_port();
    let mut a = agent(&ns, dir.path(), status, &[], &[]);
    wait_up(&ns, status, dir.path()).await;
    let (code, body) = ns
        .get(
            "127.0.0.1",
            status,
            "/debug/pprof/profile?seconds=1",
            &f("p"),
        )
        .await;
    assert_eq!(code, 404, "{}\n{}", text(&body), a.log_text());
    assert!(
        text(&body).contains("MESHAGENT_PROFILING=true"),
        "{}",
        text(&body)
    );
    let (code, body) = ns.get("127.0.0.1", status, "/debug/pprof/", &f("i")).await;
    assert_eq!(code, 200);
    assert!(text(&body).contains("off"), "{}", text(&body));
    // No SIGPROF handler was ever installed: the signal is still at its default disposition.
    let sigcgt = signal_mask(a.pid(), "SigCgt");
    assert_eq!(
        sigcgt & (1 << (libc_sigprof() - 1)),
        0,
        "SIGPROF caught: {sigcgt:x}"
    );
    a.kill();

    // `--profiling=false` wins over the env var: nothing of it is served.
    let status = free_port();
    let mut a = agent(
        &ns,
        dir.path(),
        status,
        &[("MESHAGENT_PROFILING", "true")],
        &["--profiling=false"],
    );
    wait_for("the status server", DEADLINE, || async {
        let (code, _) = ns.get("127.0.0.1", status, "/healthz/ready", &f("r")).await;
        (code != 0).then_some(())
    })
    .await;
    for path in [
        "/debug/pprof/profile?seconds=1",
        "/debug/tokioz",
        "/debug/pprof/",
    ] {
        let (code, body) = ns.get("127.0.0.1", status, path, &f("p")).await;
        assert_eq!(code, 404, "{path}: {}\n{}", text(&body), a.log_text());
    }
    a.kill();
}

/// SIGPROF's number on Linux.
fn libc_sigprof() -> u32 {
    27
}

/// A `/proc/<pid>/status` signal mask (`SigCgt`, `SigIgn`) as bits.
fn signal_mask(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = s
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap()
        .trim()
        .to_owned();
    u64::from_str_radix(&hex, 16).unwrap()
}
