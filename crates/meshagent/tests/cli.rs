//! The `meshagent` binary as a pod runs it: env vars, a cwd with Istio's relative paths, and
//! the `pilot-agent` name.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use meshagent_testkit::{Proc, free_port, http_get, wait_for};

fn run(cwd: &Path, exe: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(exe)
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .envs(env.iter().copied())
        .output()
        .expect("run meshagent")
}

fn meshagent() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshagent"))
}

#[test]
fn dump_config_reflects_env_and_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("etc/istio/pod")).unwrap();
    std::fs::write(
        dir.path().join("etc/istio/pod/annotations"),
        "proxy.istio.io/config=\"concurrency: 3\\n\"\n",
    )
    .unwrap();
    let out = run(
        dir.path(),
        meshagent(),
        &["proxy", "sidecar", "--unknownFlag", "x", "--dump-config"],
        &[
            ("POD_NAMESPACE", "shop"),
            ("SECRET_TTL", "12h"),
            ("XDS_HEADER_X_TEAM", "payments"),
            ("PROXY_CONFIG", r#"{"drainDuration": "30s"}"#),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let text = v.to_string();
    assert_eq!(v["domain"], "shop.svc.cluster.local", "{text}");
    assert_eq!(v["proxyConfig"]["drainDuration"], "30s", "{text}");
    assert_eq!(v["proxyConfig"]["concurrency"], 3, "{text}");
    assert_eq!(
        v["proxyConfig"]["discoveryAddress"],
        "istiod.istio-system.svc:15012"
    );
    assert!(text.contains("X_TEAM"), "{text}");
}

/// `config-reference` prints docs/configuration-reference.md, whatever the environment and
/// the log level (logs go to stderr, so the Markdown can be redirected into the file).
#[test]
fn config_reference_prints_the_committed_reference() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        meshagent(),
        &["config-reference", "--log_output_level=default:debug"],
        &[("TRUST_DOMAIN", "example.org"), ("ISTIO_META_FOO", "bar")],
    );
    assert!(out.status.success(), "{out:?}");
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/configuration-reference.md"
    ))
    .unwrap();
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(
        printed == doc,
        "`meshagent config-reference` differs from docs/configuration-reference.md; regenerate \
         it with: cargo run -p meshagent -- config-reference > docs/configuration-reference.md"
    );
}

#[test]
fn bad_value_exits_nonzero_naming_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        meshagent(),
        &["proxy", "--dump-config"],
        &[("ENVOY_STATUS_PORT", "70000")],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ENVOY_STATUS_PORT") && err.contains("70000"),
        "{err}"
    );
}

#[test]
fn unparsable_scalar_warns_and_uses_the_default() {
    // Istio's rule: a duration that does not parse is a warning, not a failed start.
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        meshagent(),
        &["proxy", "--dump-config"],
        &[("SECRET_TTL", "tomorrow")],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(r#"Invalid environment variable value SECRET_TTL="tomorrow""#)
            && err.contains("defaulting to 24h0m0s"),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["identity"]["secretTtl"], "24h0m0s");
}

/// What a start rejects, `--dump-config` rejects too, with the very same message (both run
/// preflight after loading; exit 1 both ways, before anything starts).
#[test]
fn dump_config_fails_as_a_start_fails() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "CA_PROVIDER",
            "GoogleCA",
            "CA_PROVIDER GoogleCA is not supported",
        ),
        (
            "WORKLOAD_RSA_KEY_SIZE",
            "3000",
            "unsupported WORKLOAD_RSA_KEY_SIZE 3000",
        ),
        (
            "ISTIO_BOOTSTRAP",
            "/t.json",
            "cannot read bootstrap template /t.json (ISTIO_BOOTSTRAP)",
        ),
        ("CA_ADDR", "ca:xyz", "invalid control plane address"),
    ];
    for (name, value, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let env = [(*name, *value), ("DISABLE_ENVOY", "true")];
        let dump = run(dir.path(), meshagent(), &["proxy", "--dump-config"], &env);
        let start = run_with_deadline(dir.path(), &["proxy"], &env);
        let (dump_err, start_err) = (
            String::from_utf8_lossy(&dump.stderr),
            String::from_utf8_lossy(&start.stderr),
        );
        assert_eq!(dump.status.code(), Some(1), "{name}: {dump_err}");
        assert_eq!(start.status.code(), Some(1), "{name}: {start_err}");
        // `--dump-config` logs to stderr, so the error is its Istio-format log line there
        // (`<time>\terror\t<msg>`); a start logs to stdout and prints `error: <msg>` on stderr.
        let line = |text: &str| {
            text.lines()
                .find_map(|l| {
                    l.strip_prefix("error: ")
                        .or_else(|| l.split_once("\terror\t").map(|(_, m)| m))
                })
                .map(str::to_owned)
                .unwrap_or_else(|| panic!("{name}: no error line in {text}"))
        };
        assert_eq!(line(&dump_err), line(&start_err), "{name}");
        assert!(line(&dump_err).contains(want), "{name}: {dump_err}");
    }
}

/// Runs the binary; kills it (and fails the test) if it is still running after 20 s.
fn run_with_deadline(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(meshagent())
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if tokio::time::Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{args:?} with {env:?} still running after 20 s: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn answers_as_pilot_agent() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("pilot-agent");
    std::os::unix::fs::symlink(meshagent(), &link).unwrap();
    let a = run(dir.path(), &link, &["version", "--short"], &[]);
    let b = run(dir.path(), meshagent(), &["version", "--short"], &[]);
    assert!(a.status.success());
    assert_eq!(a.stdout, b.stdout);
    let bad = run(dir.path(), &link, &["proxy", "gateway"], &[]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("invalid proxy Type"));
}

/// `CA_HEADER_*` / `XDS_HEADER_*` values are often credentials. The names show in the
/// INFO "Effective config" line and on `/debug/config_dump`; the values never do.
#[tokio::test]
async fn header_values_never_reach_the_log_or_config_dump() {
    let cwd = tempfile::tempdir().unwrap();
    let status = free_port();
    let pc = serde_json::json!({
        "binaryPath": "/nonexistent/envoy",
        "statusPort": status,
        "discoveryAddress": format!("127.0.0.1:{}", free_port()),
    });
    let mut cmd = Command::new(meshagent());
    cmd.args(["proxy", "sidecar"])
        .current_dir(cwd.path())
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .env("POD_NAMESPACE", "default")
        .env("DISABLE_ENVOY", "true")
        .env("PROXY_CONFIG", pc.to_string())
        .env("CA_HEADER_Authorization", "Bearer ca-credential-1")
        .env("XDS_HEADER_X-Api-Key", "xds-credential-2");
    let agent = Proc::spawn("agent", cmd, cwd.path());
    let addr = SocketAddr::from(([127, 0, 0, 1], status));
    let dump = wait_for(
        "/debug/config_dump",
        Duration::from_secs(30),
        || async move {
            match http_get(addr, "/debug/config_dump").await {
                Ok((200, body)) => Some(body),
                _ => None,
            }
        },
    )
    .await;
    assert!(
        dump.contains("Authorization") && dump.contains("X-Api-Key"),
        "{dump}"
    );
    assert!(!dump.contains("credential-"), "{dump}");
    let log = agent.log_text();
    assert!(log.contains("Effective config"), "{log}");
    assert!(log.contains("X-Api-Key"), "{log}");
    assert!(!log.contains("credential-"), "{log}");
}

/// A non-UTF-8 value of a variable the agent reads is a startup error naming it, not
/// "unset" (a non-UTF-8 PROXY_CONFIG used to be ignored and the agent ran on defaults).
#[test]
fn non_utf8_env_value_exits_nonzero_naming_the_variable() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    let dir = tempfile::tempdir().unwrap();
    let bad = OsStr::from_bytes(b"concurrency: 2\n# caf\xe9\n");
    let out = Command::new(meshagent())
        .args(["proxy", "--dump-config"])
        .current_dir(dir.path())
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .env("PROXY_CONFIG", bad)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("environment variable PROXY_CONFIG is not valid UTF-8"),
        "{err}"
    );
    assert!(out.stdout.is_empty());

    // A non-UTF-8 variable the agent does not read changes nothing.
    let out = Command::new(meshagent())
        .args(["proxy", "--dump-config"])
        .current_dir(dir.path())
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .env("UNRELATED", OsStr::from_bytes(b"\xff"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `pilot-agent` alone, or with root flags it does not know, prints its help on stdout and
/// exits 0 (cobra: the root command has no Run and tolerates unknown flags); an unknown
/// subcommand is an error. The real pilot-agent beside meshagent for each.
#[test]
fn root_help_and_unknown_subcommand_exit_as_pilot_agent_does() {
    let dir = tempfile::tempdir().unwrap();
    let pilot_agent = meshagent_testkit::istiod_box::pilot_agent_bin();
    for args in [
        &[][..],
        &["--bogus"][..],
        &["--log_as_json", "--bogus=1"][..],
    ] {
        for exe in [meshagent(), pilot_agent.as_path()] {
            let out = run(dir.path(), exe, args, &[]);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{} {args:?}: {out:?}",
                exe.display()
            );
            assert!(
                stdout.contains("Usage:") && stdout.contains("proxy"),
                "{} {args:?}: no help on stdout: {stdout}",
                exe.display()
            );
        }
    }
    for exe in [meshagent(), pilot_agent.as_path()] {
        let out = run(dir.path(), exe, &["bogus"], &[]);
        assert!(!out.status.success(), "{} bogus: {out:?}", exe.display());
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(text.contains("bogus"), "{} bogus: {text}", exe.display());
    }
}
