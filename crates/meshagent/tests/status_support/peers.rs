//! The Prometheus parsers the status tests check merged output with: Go programs on
//! Prometheus' own libraries (`status_support/expfmt_check`, `status_support/promproto`),
//! installed into `.tools/bin` by `make metricspeers`. Each prints one line per metric family,
//! its fields separated by spaces, or fails with the parser's error.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The peer `name`: `$env`, else the project's `.tools/bin/<name>`.
pub fn peer(name: &str, env: &str) -> PathBuf {
    let path = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        meshagent_testkit::workspace_root()
            .join(".tools/bin")
            .join(name)
    });
    assert!(
        path.is_file(),
        "{} is missing: run `make metricspeers`",
        path.display()
    );
    path
}

/// Runs `peer args…` with `body` on stdin: each output line split on spaces, or the peer's
/// stderr when it rejects the body.
pub fn parse_lines(peer: PathBuf, args: &[&str], body: &[u8]) -> Result<Vec<Vec<String>>, String> {
    let mut child = Command::new(&peer)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", peer.display()));
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(body)
        .expect("writing the body to the parser");
    let out = child.wait_with_output().expect("the parser's output");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split(' ').map(str::to_owned).collect())
        .collect())
}
