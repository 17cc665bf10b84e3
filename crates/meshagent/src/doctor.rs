//! `meshagent doctor` (also `pilot-agent doctor`): run inside the pod with the agent's own
//! environment and flags, it checks what the agent depends on and explains each finding with a
//! fix. Istio's agent has no such command; `istioctl` checks from outside the pod
//! (`istioctl x precheck`, `proxy-status`), which cannot see the pod's rules, sockets or files.
//!
//! Every check reads the same typed [`Config`] the agent would run with, so it looks at the
//! addresses, paths and roots the agent would use. Every network step has a short deadline
//! ([`Options::step_timeout`]): the doctor never hangs on a black-holed peer.
//!
//! - [`capture`] — iptables / nftables rules for Istio's chains.
//! - [`control`] — CA and istiod TLS with the expected SAN, the token, the clock.
//! - [`local`] — SDS/xDS sockets, Envoy's admin, the status port, probes, scrape targets,
//!   certificates, DNS.

pub mod capture;
pub mod control;
pub mod local;

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use crate::config::Config;

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        }
    }
}

/// One finding: what was checked, the outcome, one line of explanation and, for a warning
/// or a failure, a concrete fix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: String,
    pub status: Status,
    pub detail: String,
    pub fix: Option<String>,
}

impl Check {
    pub fn ok(name: impl Into<String>, detail: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    pub fn warn(
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            name: name.into(),
            status: Status::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    pub fn fail(
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            name: name.into(),
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// A step of a check that could not be carried out. Checks turn these into findings; they
/// never end the run.
#[derive(Debug, thiserror::Error)]
pub enum DoctorError {
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("cannot run {cmd}: {error}")]
    Spawn {
        cmd: String,
        #[source]
        error: std::io::Error,
    },
    #[error("{cmd} failed ({status}): {stderr}")]
    Command {
        cmd: String,
        status: String,
        stderr: String,
    },
    #[error("cannot connect to {addr}: {error}")]
    Connect {
        addr: String,
        #[source]
        error: std::io::Error,
    },
    #[error("TLS handshake with {addr} failed: {reason}")]
    Tls { addr: String, reason: String },
    #[error(transparent)]
    Http(#[from] crate::http_client::HttpError),
    #[error("{0}")]
    Invalid(String),
}

/// How the doctor runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// The agent's working directory (`.` in a pod): relative paths resolve against it.
    pub cwd: PathBuf,
    /// Deadline of each network step (connect, handshake, request, query, command).
    pub step_timeout: Duration,
    /// The name the DNS check asks the agent's DNS proxy for; `None` means
    /// `kubernetes.default.svc.<cluster domain>`, which istiod's name table always holds.
    pub dns_name: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            cwd: PathBuf::from("."),
            step_timeout: Duration::from_secs(3),
            dns_name: None,
        }
    }
}

/// The findings of one run, in check order.
#[derive(Debug, Clone, Serialize)]
#[serde(transparent)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// Whether any check failed (the command then exits 1).
    pub fn failed(&self) -> bool {
        self.checks.iter().any(|c| c.status == Status::Fail)
    }

    /// The checks named `name`.
    pub fn get(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// One line per check (`OK   name: detail`), each failure or warning followed by its fix,
    /// then a summary line.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            out.push_str(&format!(
                "{:<4} {}: {}\n",
                c.status.label(),
                c.name,
                c.detail
            ));
            if let Some(fix) = &c.fix {
                out.push_str(&format!("     fix: {fix}\n"));
            }
        }
        let count = |s| self.checks.iter().filter(|c| c.status == s).count();
        out.push_str(&format!(
            "{} checks: {} OK, {} WARN, {} FAIL\n",
            self.checks.len(),
            count(Status::Ok),
            count(Status::Warn),
            count(Status::Fail)
        ));
        out
    }

    /// The JSON array of checks (`name`, `status`, `detail`, `fix`).
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(&self.checks).unwrap_or_else(|_| "[]".to_owned())
    }
}

/// Runs every check against `cfg`, in priority order.
pub async fn run(cfg: &Config, opts: &Options) -> Report {
    let mut checks = Vec::new();
    checks.extend(capture::check(cfg, opts).await);
    checks.extend(control::checks(cfg, opts).await);
    checks.extend(local::checks(cfg, opts).await);
    Report { checks }
}

/// `fut` within the step deadline.
pub(crate) async fn step<T>(
    opts: &Options,
    fut: impl std::future::Future<Output = Result<T, DoctorError>>,
) -> Result<T, DoctorError> {
    tokio::time::timeout(opts.step_timeout, fut)
        .await
        .unwrap_or(Err(DoctorError::Timeout(opts.step_timeout)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_and_json_shapes() {
        let r = Report {
            checks: vec![
                Check::ok("a", "fine"),
                Check::fail("b", "broken", "mend it"),
            ],
        };
        assert!(r.failed());
        let t = r.text();
        assert!(t.contains("OK   a: fine\n"), "{t}");
        assert!(t.contains("FAIL b: broken\n     fix: mend it\n"), "{t}");
        assert!(t.ends_with("2 checks: 1 OK, 0 WARN, 1 FAIL\n"), "{t}");
        let v: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert_eq!(v[0]["status"], "OK");
        assert_eq!(v[0]["fix"], serde_json::Value::Null);
        assert_eq!(v[1]["fix"], "mend it");
    }
}
