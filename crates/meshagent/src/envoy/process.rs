//! Envoy's command line (Istio: `pkg/envoy/proxy.go` `args`) and exit-status mapping.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

/// Everything that shapes Envoy's argv.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyArgs {
    pub binary: PathBuf,
    /// Bootstrap path as passed to Envoy (relative to the agent's working directory).
    pub config: PathBuf,
    pub drain_duration: Duration,
    pub ipv6: bool,
    pub file_flush_interval: Duration,
    /// ProxyConfig `fileFlushMinSizeKb`: `--file-flush-min-size-kb` when > 0.
    pub file_flush_min_size_kb: u32,
    /// `--proxyLogLevel`, e.g. `warning` or `info,misc:error`.
    pub log_level: String,
    /// `--proxyComponentLogLevel`, used only when `log_level` has no `scope:level` parts.
    pub component_log_level: String,
    pub skip_deprecated_logs: bool,
    pub enable_core_dump: bool,
    /// `ISTIO_BOOTSTRAP_OVERRIDE` contents, converted to JSON.
    pub config_yaml: Option<String>,
    pub concurrency: Option<u32>,
    /// `COMPLIANCE_POLICY` (`fips-140-2`, `fips-140-3`, ...): see [`EnvoyArgs::env`].
    pub compliance_policy: String,
}

/// TLS 1.2 ciphers Envoy's Google gRPC client may use under a FIPS policy
/// (Istio: `pkg/envoy/proxy.go` `Run`).
pub const FIPS_GRPC_CIPHER_SUITES: &str = "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384";

impl EnvoyArgs {
    /// Variables added to the environment Envoy inherits. Istio (`pkg/envoy/proxy.go` `Run`)
    /// limits the Google gRPC client's TLS 1.2 ciphers under `fips-140-2` and `fips-140-3`
    /// through `GRPC_SSL_CIPHER_SUITES`; gRPC reads it from the process environment.
    pub fn env(&self) -> Vec<(&'static str, &'static str)> {
        match self.compliance_policy.as_str() {
            "fips-140-2" | "fips-140-3" => {
                vec![("GRPC_SSL_CIPHER_SUITES", FIPS_GRPC_CIPHER_SUITES)]
            }
            _ => Vec::new(),
        }
    }

    /// Envoy's argv after the binary, in Istio's order.
    pub fn argv(&self) -> Vec<String> {
        let mut a = vec![
            "-c".to_owned(),
            self.config.display().to_string(),
            "--drain-time-s".into(),
            self.drain_duration.as_secs().to_string(),
            "--drain-strategy".into(),
            "immediate".into(),
            "--local-address-ip-version".into(),
            if self.ipv6 { "v6" } else { "v4" }.into(),
            "--file-flush-interval-msec".into(),
            self.file_flush_interval.as_millis().to_string(),
            "--disable-hot-restart".into(),
            "--allow-unknown-static-fields".into(),
        ];
        // pkg/envoy/proxy.go `args`: right after the fixed flags.
        if self.file_flush_min_size_kb > 0 {
            a.push("--file-flush-min-size-kb".into());
            a.push(self.file_flush_min_size_kb.to_string());
        }
        let (level, components) = split_log_level(&self.log_level);
        if let Some(level) = level {
            a.push("-l".into());
            a.push(level);
        }
        let components = if components.is_empty() {
            self.component_log_level.clone()
        } else {
            components
        };
        if !components.is_empty() {
            a.push("--component-log-level".into());
            a.push(components);
        }
        if self.skip_deprecated_logs {
            a.push("--skip-deprecated-logs".into());
        }
        if self.enable_core_dump {
            a.push("--enable-core-dump".into());
        }
        if let Some(y) = &self.config_yaml {
            a.push("--config-yaml".into());
            a.push(y.clone());
        }
        if let Some(c) = self.concurrency.filter(|c| *c > 0) {
            a.push("--concurrency".into());
            a.push(c.to_string());
        }
        a
    }
}

/// `info,misc:error,upstream:debug` → (`info`, `misc:error,upstream:debug`).
fn split_log_level(s: &str) -> (Option<String>, String) {
    let mut level = None;
    let mut scoped = vec![];
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if part.contains(':') {
            scoped.push(part.to_owned());
        } else {
            level = Some(part.to_owned());
        }
    }
    (level, scoped.join(","))
}

/// The agent's exit code for Envoy's exit status: Envoy's own code, or 128+signal (a shell's
/// convention) — so Kubernetes sees a crash as a failure, unlike Istio's agent, which exits 0.
pub fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(255),
        (None, None) => 1,
    }
}

/// A log-friendly description, with Istio's OOM hint for SIGKILL.
pub fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status.signal() {
        Some(9) => {
            "killed by SIGKILL (possibly out of memory: check the container's memory limit)".into()
        }
        Some(s) => format!("killed by signal {s}"),
        None => format!("exited with code {}", status.code().unwrap_or(-1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> EnvoyArgs {
        EnvoyArgs {
            binary: "/usr/local/bin/envoy".into(),
            config: "./etc/istio/proxy/envoy-rev.json".into(),
            drain_duration: Duration::from_secs(45),
            ipv6: false,
            file_flush_interval: Duration::from_secs(1),
            file_flush_min_size_kb: 0,
            log_level: "warning".into(),
            component_log_level: "misc:error".into(),
            skip_deprecated_logs: true,
            enable_core_dump: false,
            config_yaml: None,
            concurrency: Some(2),
            compliance_policy: String::new(),
        }
    }

    #[test]
    fn fips_policies_limit_envoys_grpc_ciphers() {
        assert!(base().env().is_empty());
        for policy in ["fips-140-2", "fips-140-3"] {
            let a = EnvoyArgs {
                compliance_policy: policy.into(),
                ..base()
            };
            assert_eq!(
                a.env(),
                vec![("GRPC_SSL_CIPHER_SUITES", FIPS_GRPC_CIPHER_SUITES)],
                "{policy}"
            );
        }
        let pqc = EnvoyArgs {
            compliance_policy: "pqc".into(),
            ..base()
        };
        assert!(pqc.env().is_empty());
    }

    #[test]
    fn argv_like_istio() {
        assert_eq!(
            base().argv().join(" "),
            "-c ./etc/istio/proxy/envoy-rev.json --drain-time-s 45 --drain-strategy immediate \
             --local-address-ip-version v4 --file-flush-interval-msec 1000 --disable-hot-restart \
             --allow-unknown-static-fields -l warning --component-log-level misc:error \
             --skip-deprecated-logs --concurrency 2"
        );
    }

    #[test]
    fn file_flush_min_size_follows_the_fixed_flags() {
        let mut a = base();
        a.file_flush_min_size_kb = 64;
        let argv = a.argv().join(" ");
        assert!(
            argv.contains("--allow-unknown-static-fields --file-flush-min-size-kb 64 -l warning"),
            "{argv}"
        );
    }

    #[test]
    fn scoped_levels_win_over_component_flag() {
        let mut a = base();
        a.log_level = "info,upstream:debug".into();
        a.concurrency = Some(0);
        a.config_yaml = Some("{\"a\":1}".into());
        let argv = a.argv().join(" ");
        assert!(
            argv.contains("-l info --component-log-level upstream:debug"),
            "{argv}"
        );
        assert!(
            !argv.contains("misc:error") && !argv.contains("--concurrency"),
            "{argv}"
        );
        assert!(argv.ends_with("--config-yaml {\"a\":1}"), "{argv}");
    }

    #[test]
    fn exit_codes() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(9)), 137);
        assert!(describe(ExitStatus::from_raw(9)).contains("out of memory"));
    }
}
