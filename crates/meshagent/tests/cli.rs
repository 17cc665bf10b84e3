//! The `meshagent` binary as a pod runs it: env vars, a cwd with Istio's relative paths, and
//! the `pilot-agent` name.

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

#[test]
fn bad_value_exits_nonzero_naming_the_variable() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(
        dir.path(),
        meshagent(),
        &["proxy", "--dump-config"],
        &[("SECRET_TTL", "tomorrow")],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("SECRET_TTL") && err.contains("tomorrow"),
        "{err}"
    );
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

/// D8: `CA_HEADER_*` / `XDS_HEADER_*` values are often credentials. The names show in the
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

/// D10: a non-UTF-8 value of a variable the agent reads is a startup error naming it, not
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
        .env("UNRELATED", OsStr::from_bytes(b"\xff"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
