//! `istio-iptables`: the traffic capture the `istio-init` container installs (Istio
//! tools/istio-iptables and tools/istio-nftables), with the same flags, env, rules and exit
//! codes.
//!
//! - [`config`] — flags + env → a validated [`config::Config`] (Istio's precedence).
//! - [`rules`] — config → iptables rules (plain data) → `iptables-restore` text.
//! - [`nft`] — config → the native nftables transaction text.
//! - [`netlink`] — in-process netlink: empty-namespace probe, `::6/128` on lo.
//! - [`canon`] — canonical rule form: our spelling vs `iptables-save`'s.
//! - [`apply`] — binary selection, `*-save`/`*-restore`, `nft -f -`, `ip rule/route`.
//! - [`validation`] — `--run-validation`.
#![allow(
    clippy::disallowed_methods,
    reason = "istio-iptables runs synchronously as its own command; no runtime is serving"
)]

pub mod apply;
pub mod canon;
pub mod config;
pub mod netlink;
pub mod nft;
pub mod rules;
pub mod validation;

use std::fs::File;
use std::path::PathBuf;

use config::{Config, ConfigError, ProcessEnv};

/// Path of the resolv.conf whose servers DNS capture redirects.
pub const RESOLV_CONF: &str = "/etc/resolv.conf";

/// The capture arguments Istio's sidecar injector gives the `istio-init` container of a pod
/// without traffic annotations (`manifests/charts/istio-control/istio-discovery/files/injection-template.yaml`,
/// the `istio-init` container's `args`: listener ports, proxy uid, interception mode, the
/// `includeOutboundIPRanges` / `excludeOutboundIPRanges` / `includeInboundPorts` defaults, and
/// `-d` from the template's `excludeInboundPort` function: 15090, 15021 and the status port
/// 15020). The injector follows them with `--log_output_level=default:info`, left to callers
/// here; annotations add `-q`/`-o`/`-k`/`-c`. Tests and benchmarks start from this list.
pub const ISTIO_INIT_DEFAULT_ARGS: &[&str] = &[
    "-p",
    "15001",
    "-z",
    "15006",
    "-u",
    "1337",
    "-m",
    "REDIRECT",
    "-i",
    "*",
    "-x",
    "",
    "-b",
    "*",
    "-d",
    "15090,15021,15020",
];

/// A failed run (exit code 1).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Detect(#[from] config::DetectError),
    #[error(transparent)]
    UnknownOwner(#[from] config::UnknownOwner),
    #[error(transparent)]
    Apply(#[from] apply::ApplyError),
    #[error("cannot enter network namespace {path}: {error}")]
    Netns { path: String, error: String },
    #[error("cannot set up logging: {0}")]
    Logging(String),
    #[error("--cni-mode: cannot set up the pod-scoped xtables lock ({step}): {error}")]
    LockSandbox { step: String, error: String },
}

/// If `argv` (with argv\[0\]) runs the `istio-iptables` subcommand, its arguments (root
/// logging flags before the subcommand are kept with them).
pub fn subcommand_args(argv: &[String]) -> Option<Vec<String>> {
    let mut i = 1;
    while let Some(arg) = argv.get(i) {
        if arg == "istio-iptables" {
            let mut args: Vec<String> = argv[1..i].to_vec();
            args.extend(argv[i + 1..].iter().cloned());
            return Some(args);
        }
        if !arg.starts_with('-') {
            return None;
        }
        // A root flag with its value in the next argument.
        let takes_value = matches!(
            arg.as_str(),
            "--log_output_level" | "--log_target" | "--log_caller" | "--log_stacktrace_level"
        );
        i += if takes_value { 2 } else { 1 };
    }
    None
}

/// Runs `istio-iptables` with the arguments after the subcommand; returns the exit code.
pub fn main(args: &[String]) -> u8 {
    if args.iter().any(|a| a == "-h" || a == "--help") {
        print!("{}", config::usage(&bin_name()));
        return 0;
    }
    let raw = match config::collect(args, &ProcessEnv) {
        Ok(raw) => raw,
        // A flag pflag itself rejects: cobra's error, as pilot-agent prints it (the log line
        // with Istio's logging defaults, on stdout; `Error: …` on stderr).
        Err(e @ ConfigError::UnknownFlag(_)) => {
            let _ = crate::logging::init(&crate::logging::LogOptions::default());
            tracing::error!("{e}");
            eprintln!("Error: {e}");
            return 1;
        }
        Err(e) => {
            // The flags that say how to log are among those that failed: Istio's defaults.
            let _ = crate::logging::init(&log_options(None));
            return fail(&e);
        }
    };
    if let Err(e) = crate::logging::init_or_default(&log_options(Some(&raw)), "stderr") {
        return fail(&RunError::Logging(e.to_string()));
    }
    let cfg = match Config::from_raw(&raw, &ProcessEnv) {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    match run(cfg) {
        Ok(code) => code,
        Err(e) => fail(&e),
    }
}

/// The name this binary was started as (`pilot-agent` or `meshagent`), for the usage line.
fn bin_name() -> String {
    std::env::args_os()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "meshagent".to_owned())
}

/// Istio's `handleErrorWithCode` (`tools/istio-iptables/pkg/cmd/root.go`) logs the error
/// and exits 1; it is also printed on stderr for those who read that.
fn fail(e: &dyn std::fmt::Display) -> u8 {
    tracing::error!("{e}");
    if !crate::logging::logs_to_stderr() {
        eprintln!("error: {e}");
    }
    1
}

/// The root logging flags given to `istio-iptables` (Istio's defaults without `raw`).
fn log_options(raw: Option<&config::RawValues>) -> crate::logging::LogOptions {
    let mut opts = crate::logging::LogOptions::default();
    if let Some(raw) = raw {
        if let Some(v) = raw.log_flag("log_output_level") {
            v.clone_into(&mut opts.output_level);
        }
        if let Some(v) = raw.log_flag("log_target") {
            opts.targets = vec![v.to_owned()];
        }
        if let Some(v) = raw.log_flag("log_caller") {
            v.clone_into(&mut opts.caller);
        }
        if let Some(v) = raw.log_flag("log_stacktrace_level") {
            v.clone_into(&mut opts.stacktrace_level);
        }
        opts.as_json = raw
            .log_flag("log_as_json")
            .and_then(crate::config::parse_go_bool)
            .unwrap_or(false);
    }
    // stdout carries the dry-run transcript; keep logs off it.
    opts.targets = opts
        .targets
        .into_iter()
        .map(|t| {
            if t == "stdout" {
                "stderr".to_owned()
            } else {
                t
            }
        })
        .collect();
    opts
}

/// Enters `--network-namespace` (a path, or a name under /var/run/netns) for this thread,
/// so every command started afterwards runs there.
fn enter_netns(ns: &str) -> Result<(), RunError> {
    let path = if ns.starts_with('/') {
        PathBuf::from(ns)
    } else {
        PathBuf::from("/var/run/netns").join(ns)
    };
    let shown = path.display().to_string();
    let f = File::open(&path).map_err(|e| RunError::Netns {
        path: shown.clone(),
        error: e.to_string(),
    })?;
    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| RunError::Netns {
        path: shown,
        error: e.to_string(),
    })
}

/// The host's xtables lock, which every legacy iptables command takes (`--wait`).
const XTABLES_LOCK: &str = "/run/xtables.lock";

/// `--cni-mode`: the commands run from the host's filesystem but in the pod's network
/// namespace, so they would share the host's `/run/xtables.lock` with every other pod being
/// set up and with the node's own iptables users. As Istio's `runInSandbox`
/// (tools/istio-iptables/pkg/dependencies/implementation_linux.go), this process moves into a
/// mount namespace of its own (propagation from the host kept one-way) and bind-mounts the
/// network namespace file over the lock, so the lock is per pod. Every command started
/// afterwards inherits it; nothing is changed outside this process.
///
/// Must run before any thread is started (unshare(CLONE_NEWNS) needs an unshared `fs`): the
/// `istio-iptables` subcommand is single-threaded.
fn enter_lock_sandbox(netns: &str) -> Result<(), RunError> {
    use nix::mount::{MsFlags, mount};
    let fail = |step: &str| {
        let step = step.to_owned();
        move |e: nix::Error| RunError::LockSandbox {
            step,
            error: e.to_string(),
        }
    };
    let source = if netns.is_empty() {
        // Already in the pod's namespace (the CNI plugin entered it): its file is ours.
        PathBuf::from("/proc/self/ns/net")
    } else if netns.starts_with('/') {
        PathBuf::from(netns)
    } else {
        PathBuf::from("/var/run/netns").join(netns)
    };
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(fail("unshare a mount namespace"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_SLAVE | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(fail("make / a slave mount"))?;
    // The bind target must exist; iptables would create it anyway.
    if let Err(e) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(XTABLES_LOCK)
    {
        return Err(RunError::LockSandbox {
            step: format!("create {XTABLES_LOCK}"),
            error: e.to_string(),
        });
    }
    mount(
        Some(&source),
        XTABLES_LOCK,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(fail(&format!(
        "bind {} over {XTABLES_LOCK}",
        source.display()
    )))?;
    tracing::debug!(lock = %source.display(), "pod-scoped xtables lock");
    Ok(())
}

/// The configured run (Istio tools/istio-iptables/pkg/cmd/root.go `Run`).
pub fn run(mut cfg: Config) -> Result<u8, RunError> {
    if cfg.dry_run {
        // Istio's first line (`tools/istio-iptables/pkg/cmd/root.go` `ProgramIptables`).
        tracing::info!("running iptables in dry-run mode, no rule changes will be made");
    }
    if !cfg.network_namespace.is_empty() {
        enter_netns(&cfg.network_namespace)?;
    }
    if cfg.cni_mode && !cfg.dry_run {
        enter_lock_sandbox(&cfg.network_namespace)?;
    }
    match cfg.detect(RESOLV_CONF) {
        Ok(()) => {}
        // Removing rules needs no address; clean both families.
        Err(config::DetectError::NoAddress) if cfg.cleanup_only => cfg.enable_ipv6 = true,
        Err(e) => return Err(e.into()),
    }
    if cfg.cleanup_only && !cfg.enable_ipv6 {
        // Rules may have been added by a run that saw IPv6: clean v6 too when it is usable.
        cfg.enable_ipv6 = apply::in_path("ip6tables-save").is_some() || cfg.native_nftables;
    }
    // resolv.conf's servers reach the rule text too.
    cfg.validate()?;
    if !cfg.dry_run && !cfg.skip_rule_apply && !cfg.cleanup_only {
        cfg.resolve_owners()?;
    }
    tracing::info!(
        "istio-iptables configuration: {}",
        serde_json::to_string(&cfg).unwrap_or_default()
    );
    if rules::redirect_dns(&cfg) != cfg.redirect_dns {
        tracing::warn!(
            "REDIRECT_DNS is set, but CAPTURE_ALL_DNS is false, and no DNS servers provided. DNS capture disabled."
        );
    }
    let mut sys = apply::System::new(cfg.dry_run);
    if !cfg.skip_rule_apply {
        if cfg.native_nftables {
            let text = if cfg.cleanup_only {
                nft::cleanup()
            } else {
                nft::try_build(&cfg)?
            };
            apply::apply_nft(&mut sys, &text)?;
        } else {
            let plan = rules::build(&cfg);
            apply::apply_iptables(&mut sys, &cfg, &plan)?;
        }
        if cfg.cleanup_only {
            if !cfg.dry_run {
                apply::cleanup_routes(&mut sys, &cfg);
            }
        } else {
            apply::configure_routes(&mut sys, &cfg)?;
        }
    }
    if cfg.dry_run {
        print!("{}", sys.transcript);
        // Istio's iptables dry run records into DRY_RUN_FILE_PATH at each command it would
        // run; its native nftables path does not use those dependencies, and with
        // `--skip-rule-apply` nothing runs: no file then. (Istio opens the file without
        // truncating it, so a longer old file keeps its tail; meshagent replaces it.)
        if let Some(path) = cfg
            .dry_run_file
            .as_ref()
            .filter(|_| !cfg.native_nftables && !sys.record.is_empty())
        {
            let mut text = sys.record.join("\n");
            text.push('\n');
            std::fs::write(path, text).map_err(|error| apply::ApplyError::DryRunFile {
                path: path.clone(),
                error,
            })?;
        }
    }
    if cfg.run_validation {
        if let Err(e) = validation::run(&cfg) {
            tracing::error!("{e}");
            // Istio logs the message as the command's error (`handleErrorWithCode`).
            tracing::error!("{}", validation::FAILURE_MESSAGE.trim_end());
            return Ok(validation::VALIDATION_ERROR_CODE);
        }
        tracing::info!("iptables validation passed");
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::subcommand_args;

    fn argv(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn finds_the_subcommand_under_either_name() {
        for bin in ["/usr/local/bin/pilot-agent", "meshagent"] {
            assert_eq!(
                subcommand_args(&argv(&[bin, "istio-iptables", "-p", "15001"])),
                Some(argv(&["-p", "15001"]))
            );
        }
        // Root logging flags before the subcommand travel with it.
        assert_eq!(
            subcommand_args(&argv(&[
                "pilot-agent",
                "--log_output_level",
                "default:debug",
                "istio-iptables",
                "-n"
            ])),
            Some(argv(&["--log_output_level", "default:debug", "-n"]))
        );
        assert_eq!(
            subcommand_args(&argv(&["pilot-agent", "proxy", "sidecar"])),
            None
        );
        // A value that happens to be the subcommand's name is not the subcommand.
        assert_eq!(
            subcommand_args(&argv(&[
                "pilot-agent",
                "proxy",
                "--domain",
                "istio-iptables"
            ])),
            None
        );
        assert_eq!(subcommand_args(&argv(&["pilot-agent"])), None);
    }
}
