//! Command line, compatible with `pilot-agent` (Istio `pilot/cmd/pilot-agent/app/cmd.go`).
//!
//! Unknown flags are dropped before clap sees them, as cobra's
//! `FParseErrWhitelist{UnknownFlags: true}` does, because injection templates
//! from other Istio versions may pass flags we do not know.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use serde_json::json;

use crate::ISTIO_COMPAT_VERSION;
use crate::config::{InvalidProxyType, ProxyFlags, ProxyType};
use crate::logging::LogOptions;

/// Istio Pilot agent runs in the sidecar or gateway container and bootstraps Envoy.
#[derive(Debug, Parser)]
#[command(name = "meshagent", disable_version_flag = true)]
pub struct Cli {
    /// Root logging flags, accepted on every subcommand.
    #[command(flatten)]
    pub log: LogArgs,
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// Go `strconv.ParseBool` for bool flag values (`--flag=false`).
fn parse_bool(s: &str) -> Result<bool, String> {
    crate::config::parse_go_bool(s).ok_or_else(|| format!("{s:?} is not a boolean"))
}

/// Root logging flags (Istio `pkg/log/options.go`); `logging` gives them Istio's meaning.
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Comma-separated minimum per-scope logging level of messages to output, in the form of
    /// <scope>:<level>,<scope>:<level>,... (levels debug, info, warn, error, fatal, none);
    /// applied after the built-in default:info,grpc:none.
    #[arg(long = "log_output_level", global = true, default_value = "")]
    pub output_level: String,
    /// Whether to format output as JSON or in plain console-friendly format.
    #[arg(
        long = "log_as_json",
        global = true,
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = parse_bool
    )]
    pub as_json: bool,
    /// The set of paths where to output the log: any path, or stdout and stderr (repeatable).
    #[arg(long = "log_target", global = true, default_value = "stdout")]
    pub target: Vec<String>,
    /// Comma-separated list of scopes (or all) for which to include caller information.
    #[arg(long = "log_caller", global = true, default_value = "")]
    pub caller: String,
    /// Comma-separated minimum per-scope logging level at which stack traces are captured.
    #[arg(
        long = "log_stacktrace_level",
        global = true,
        default_value = "default:none"
    )]
    pub stacktrace_level: String,
}

impl LogArgs {
    /// The logging module's view of these flags.
    pub fn to_options(&self) -> LogOptions {
        LogOptions {
            output_level: self.output_level.clone(),
            as_json: self.as_json,
            targets: self.target.clone(),
            caller: self.caller.clone(),
            stacktrace_level: self.stacktrace_level.clone(),
        }
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// XDS proxy agent
    Proxy(ProxyArgs),
    /// Prints out build version information
    Version(VersionArgs),
    /// Waits until the Envoy proxy is ready
    Wait(WaitArgs),
    /// Makes an HTTP request to the Envoy admin API
    Request(RequestArgs),
    /// Print the reference of every environment variable, flag and annotation, as Markdown.
    ConfigReference,
    /// Diagnostics for bug reports (meshagent addition).
    Debug(DebugArgs),
    /// Check the pod's capture rules, control plane, sockets, Envoy, probes, certificates and
    /// DNS with the agent's own configuration; explain each failure with a fix (meshagent
    /// addition: pilot-agent has no such command).
    Doctor(DoctorArgs),
}

/// `debug` (meshagent addition; pilot-agent has no such command).
#[derive(Debug, Args)]
pub struct DebugArgs {
    /// The debug subcommand.
    #[command(subcommand)]
    pub command: DebugCommand,
}

/// `debug` subcommands.
#[derive(Debug, Subcommand)]
pub enum DebugCommand {
    /// Collect the agent's views, Envoy's state, the network rules, versions and recent logs
    /// into one tar.gz, with keys and tokens removed. Run inside the pod.
    Bundle(BundleArgs),
}

/// `debug bundle` flags.
#[derive(Debug, Clone, Args)]
pub struct BundleArgs {
    /// Archive to write; `-` writes it to stdout.
    #[arg(
        short = 'o',
        long = "output",
        default_value = "/tmp/meshagent-debug.tar.gz"
    )]
    pub output: String,
    /// The agent's status port on localhost.
    #[arg(long = "status-port", default_value_t = 15020)]
    pub status_port: u16,
    /// Envoy's admin port on localhost; by default the agent's effective proxyAdminPort.
    #[arg(long = "admin-port")]
    pub admin_port: Option<u16>,
    /// Deadline of each fetch and command, e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub timeout: std::time::Duration,
    /// How many of the agent's recent log lines to include.
    #[arg(long = "log-lines", default_value_t = 1000)]
    pub log_lines: usize,
}

/// A Go duration (`10s`, `1m30s`) for duration flags.
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    crate::config::parse_go_duration(s)
        .ok_or_else(|| format!("{s:?} is not a duration (expected e.g. 10s or 1m)"))
}

/// `doctor [TYPE] [proxy flags] [--json]`: the `proxy` flags, so the doctor loads exactly the
/// configuration the agent runs with.
#[derive(Debug, Clone, Args)]
pub struct DoctorArgs {
    /// The agent's `proxy` flags and TYPE.
    #[command(flatten)]
    pub proxy: ProxyArgs,
    /// Print a JSON array of checks (name, status, detail, fix) instead of text.
    #[arg(
        long,
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = parse_bool
    )]
    pub json: bool,
    /// Deadline of each network step, in milliseconds.
    #[arg(long = "step-timeout-ms", default_value_t = 3000)]
    pub step_timeout_ms: u64,
    /// Name the DNS check resolves through the agent's DNS proxy (default
    /// kubernetes.default.svc.<cluster domain>).
    #[arg(long = "dns-name")]
    pub dns_name: Option<String>,
}

/// `wait` flags (Istio `pilot/cmd/pilot-agent/app/wait.go`).
#[derive(Debug, Clone, Args)]
pub struct WaitArgs {
    /// URL to poll until it returns 200.
    #[arg(long, default_value = "http://localhost:15021/healthz/ready")]
    pub url: String,
    /// Overall timeout.
    #[arg(long = "timeoutSeconds", default_value_t = 60)]
    pub timeout_seconds: u64,
    /// Timeout of each request.
    #[arg(long = "requestTimeoutMillis", default_value_t = 500)]
    pub request_timeout_millis: u64,
    /// Wait before each attempt, including the first.
    #[arg(long = "periodMillis", default_value_t = 500)]
    pub period_millis: u64,
}

/// `request <method> <path> [<body>]` (Istio `pilot/cmd/pilot-agent/app/request.go`).
#[derive(Debug, Clone, Args)]
pub struct RequestArgs {
    /// HTTP method, e.g. GET or POST.
    pub method: String,
    /// Path, with or without a leading slash.
    pub path: String,
    /// Optional request body.
    pub body: Option<String>,
    /// Port on localhost: one of 15000 (Envoy admin), 15020 (agent), 15021, 15004.
    #[arg(long = "debug-port", default_value_t = 15000)]
    pub debug_port: i32,
}

/// `proxy [TYPE]` flags (Istio `pilot/cmd/pilot-agent/app/cmd.go`, `options/`).
#[derive(Debug, Clone, Args)]
pub struct ProxyArgs {
    /// sidecar, router, waypoint, ztunnel or agentgateway.
    #[arg(value_name = "TYPE", default_value = "sidecar")]
    pub proxy_type: String,
    /// DNS domain; empty means ${POD_NAMESPACE}.svc.cluster.local.
    #[arg(long, default_value = "")]
    pub domain: String,
    /// Mesh config file.
    #[arg(long = "meshConfig", default_value = "./etc/istio/config/mesh")]
    pub mesh_config: String,
    /// STS port, reported in node metadata only.
    #[arg(long = "stsPort", default_value_t = 0)]
    pub sts_port: u16,
    /// Accepted for compatibility; unused.
    #[arg(long = "tokenManagerPlugin", default_value = "")]
    pub token_manager_plugin: String,
    /// Deprecated: fills an empty ProxyConfig.serviceCluster.
    #[arg(long = "serviceCluster", default_value = "istio-proxy")]
    pub service_cluster: String,
    /// The log level used to start the Envoy proxy (choose from {trace, debug, info, warning,
    /// error, critical, off}). Level may also include one or more scopes, such as
    /// 'info,misc:error,upstream:debug'
    #[arg(long = "proxyLogLevel", default_value = "warning")]
    pub proxy_log_level: String,
    /// Envoy --component-log-level.
    #[arg(long = "proxyComponentLogLevel", default_value = "")]
    pub proxy_component_log_level: String,
    /// Legacy: overrides ProxyConfig.concurrency if non-zero.
    #[arg(long, default_value_t = 0)]
    pub concurrency: u32,
    /// Bootstrap template path.
    #[arg(long = "templateFile", default_value = "")]
    pub template_file: String,
    /// Envoy outlier event log path.
    #[arg(long = "outlierLogPath", default_value = "")]
    pub outlier_log_path: String,
    /// Enable the status port's debug views host:port/debug/config_dump (the effective
    /// configuration as JSON) and /debug/tokioz (runtime metrics), from localhost only; CPU
    /// profiles at /debug/pprof/profile also need MESHAGENT_PROFILING=true (pilot-agent's
    /// other Go profiles have no equivalent here).
    #[arg(
        long,
        num_args = 0..=1,
        require_equals = true,
        default_value = "true",
        default_missing_value = "true",
        value_parser = parse_bool
    )]
    pub profiling: bool,
    /// Print the effective configuration as JSON and exit (meshagent addition).
    #[arg(
        long = "dump-config",
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = parse_bool
    )]
    pub dump_config: bool,
}

impl ProxyArgs {
    /// Plain-data flags for `config::load`; fails on an unknown TYPE.
    pub fn to_flags(&self, log_as_json: bool) -> Result<ProxyFlags, InvalidProxyType> {
        Ok(ProxyFlags {
            proxy_type: self.proxy_type.parse::<ProxyType>()?,
            domain: self.domain.clone(),
            mesh_config: PathBuf::from(&self.mesh_config),
            sts_port: self.sts_port,
            token_manager_plugin: self.token_manager_plugin.clone(),
            service_cluster: self.service_cluster.clone(),
            proxy_log_level: self.proxy_log_level.clone(),
            proxy_component_log_level: self.proxy_component_log_level.clone(),
            concurrency: self.concurrency,
            template_file: PathBuf::from(&self.template_file),
            outlier_log_path: self.outlier_log_path.clone(),
            profiling: self.profiling,
            log_as_json,
        })
    }
}

/// `version` flags (Istio `pkg/version/cobra.go`).
#[derive(Debug, Clone, Args)]
pub struct VersionArgs {
    /// Print just the version number.
    #[arg(
        short,
        long,
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = parse_bool
    )]
    pub short: bool,
    /// One of 'yaml' or 'json'.
    #[arg(short, long, value_parser = ["yaml", "json"])]
    pub output: Option<String>,
}

/// The result of [`parse_args`].
#[derive(Debug)]
pub struct Parsed {
    /// The parsed command line.
    pub cli: Cli,
    /// Unknown flags that were dropped (each with its value, if one was dropped).
    pub dropped_flags: Vec<String>,
}

/// Parses `argv` (including argv\[0\]), tolerating unknown flags.
pub fn parse_args(argv: impl IntoIterator<Item = OsString>) -> Result<Parsed, clap::Error> {
    let argv: Vec<String> = argv
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let bin = argv
        .first()
        .and_then(|a| Path::new(a).file_name())
        .map_or_else(
            || "meshagent".to_owned(),
            |n| n.to_string_lossy().into_owned(),
        );
    // `istio-iptables` is dispatched before this parser (`iptables::subcommand_args`), with
    // its own pflag-style flags; it is here so the help lists it as pilot-agent's does.
    let mut cmd = Cli::command().bin_name(bin).subcommand(
        clap::Command::new(IPTABLES_SUBCOMMAND)
            .about("Set up iptables rules for Istio Sidecar")
            .disable_help_flag(true),
    );
    cmd.build();
    let (kept, dropped_flags, leaf) = strip_unknown_flags(&cmd, argv);
    // Only `proxy` tolerates unknown flags in pilot-agent (its `FParseErrWhitelist`); cobra
    // fails every other Istio subcommand on one (meshagent's own subcommands tolerate them).
    if let (Some(leaf), Some(first)) = (leaf.as_deref(), dropped_flags.first())
        && STRICT_SUBCOMMANDS.contains(&leaf)
    {
        return Err(clap::Error::raw(
            ErrorKind::UnknownArgument,
            format!("{}\n", unknown_flag_message(first)),
        ));
    }
    let matches = match cmd.try_get_matches_from_mut(kept) {
        Ok(m) => m,
        // No subcommand (also after root flags pilot-agent does not know, which it tolerates):
        // Istio's root command has no Run, so cobra prints its help on stdout and exits 0
        // (pilot/cmd/pilot-agent/app/cmd.go). A DisplayHelp error is what `--help` gives.
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            let help = cmd.render_help().to_string();
            return Err(clap::Error::raw(ErrorKind::DisplayHelp, help));
        }
        Err(e) => return Err(e),
    };
    let cli = Cli::from_arg_matches(&matches)?;
    // `doctor` borrows the `proxy` flags to load the same configuration; `--dump-config`
    // among them would otherwise be accepted and silently do nothing.
    if let Command::Doctor(d) = &cli.command
        && d.proxy.dump_config
    {
        return Err(clap::Error::raw(
            ErrorKind::ArgumentConflict,
            "doctor does not take --dump-config (run `proxy --dump-config` to print the configuration)\n",
        ));
    }
    Ok(Parsed { cli, dropped_flags })
}

/// The subcommand `main` hands to `iptables::main` before parsing.
const IPTABLES_SUBCOMMAND: &str = "istio-iptables";

/// Istio subcommands that fail on an unknown flag (all but `proxy`).
const STRICT_SUBCOMMANDS: &[&str] = &["version", "wait", "request"];

/// pflag's message for an unknown flag, from the dropped argument (`--x`, `--x=v`, `--x v`,
/// `-xv`).
fn unknown_flag_message(dropped: &str) -> String {
    let arg = dropped.split_whitespace().next().unwrap_or(dropped);
    if let Some(body) = arg.strip_prefix("--") {
        let name = body.split_once('=').map_or(body, |(n, _)| n);
        format!("unknown flag: --{name}")
    } else {
        let c = arg.chars().nth(1).unwrap_or('-');
        format!("unknown shorthand flag: '{c}' in {arg}")
    }
}

/// Flags a command knows: name → whether a value may follow as the next arg.
#[derive(Default)]
struct KnownFlags {
    longs: HashMap<String, bool>,
    shorts: HashMap<char, bool>,
}

impl KnownFlags {
    fn of(cmd: &clap::Command) -> Self {
        let mut known = Self::default();
        for arg in cmd.get_arguments().filter(|a| !a.is_positional()) {
            let separate_value = arg.get_action().takes_values() && !arg.is_require_equals_set();
            for long in arg.get_long_and_visible_aliases().into_iter().flatten() {
                known.longs.insert(long.to_owned(), separate_value);
            }
            for short in arg.get_short_and_visible_aliases().into_iter().flatten() {
                known.shorts.insert(short, separate_value);
            }
        }
        known
    }
}

/// pflag's unknown-flag handling: `--x=v` is dropped; `--x` also drops the
/// next arg unless it starts with `-` (pflag `stripUnknownFlagValue`).
/// Returns the kept args, a description of each dropped flag, and the subcommand run (the
/// innermost one named).
fn strip_unknown_flags(
    root: &clap::Command,
    argv: Vec<String>,
) -> (Vec<String>, Vec<String>, Option<String>) {
    let mut known = KnownFlags::of(root);
    let mut current = root;
    let mut in_subcommand = false;
    let mut kept = Vec::with_capacity(argv.len());
    let mut dropped = Vec::new();
    let mut args = argv.into_iter();
    if let Some(bin) = args.next() {
        kept.push(bin);
    }
    while let Some(arg) = args.next() {
        let next_is_value = |args: &std::vec::IntoIter<String>| {
            args.as_slice().first().is_some_and(|n| !n.starts_with('-'))
        };
        if arg == "--" {
            kept.push(arg);
            kept.extend(args);
            break;
        }
        let flag = if let Some(body) = arg.strip_prefix("--") {
            let (name, inline) = match body.split_once('=') {
                Some((n, _)) => (n, true),
                None => (body, false),
            };
            Some((known.longs.get(name).copied(), inline))
        } else if arg.len() > 1 && arg.starts_with('-') {
            let c = arg.chars().nth(1).unwrap_or('-');
            Some((known.shorts.get(&c).copied(), arg.chars().count() > 2))
        } else {
            None
        };
        match flag {
            Some((Some(separate_value), inline)) => {
                kept.push(arg);
                if separate_value && !inline {
                    kept.extend(args.next());
                }
            }
            Some((None, inline)) => {
                if !inline && next_is_value(&args) {
                    let value = args.next().unwrap_or_default();
                    dropped.push(format!("{arg} {value}"));
                } else {
                    dropped.push(arg);
                }
            }
            None => {
                // A nested subcommand (`debug bundle`) brings its own flags; the first
                // positional after a leaf command is its argument, never a subcommand.
                if (!in_subcommand || current.has_subcommands())
                    && let Some(sub) = current.find_subcommand(&arg)
                {
                    known = KnownFlags::of(sub);
                    current = sub;
                    in_subcommand = true;
                }
                kept.push(arg);
            }
        }
    }
    let leaf = in_subcommand.then(|| current.get_name().to_owned());
    (kept, dropped, leaf)
}

/// A failure to render `version` output.
#[derive(Debug, thiserror::Error)]
pub enum VersionError {
    /// JSON rendering failed.
    #[error("cannot render version as JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// YAML rendering failed.
    #[error("cannot render version as YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
}

/// The `version` output, shaped like Istio's `pkg/version`. The version is
/// the Istio release we are compatible with; revision and tag say what this
/// binary really is.
pub fn version_output(args: &VersionArgs) -> Result<String, VersionError> {
    let ours = format!("meshagent {}", env!("CARGO_PKG_VERSION"));
    let golang_version = "n/a (Rust)";
    let status = "unknown";
    let info = if args.short {
        json!({ "version": ISTIO_COMPAT_VERSION })
    } else {
        json!({
            "version": ISTIO_COMPAT_VERSION,
            "revision": ours,
            "golang_version": golang_version,
            "status": status,
            "tag": ours,
        })
    };
    let doc = json!({ "clientVersion": info });
    Ok(match args.output.as_deref() {
        Some("json") => format!("{}\n", serde_json::to_string_pretty(&doc)?),
        Some(_) => serde_yaml::to_string(&doc)?,
        None if args.short => format!("{ISTIO_COMPAT_VERSION}\n"),
        None => format!(
            "version.BuildInfo{{Version:{ISTIO_COMPAT_VERSION:?}, GitRevision:{ours:?}, \
             GolangVersion:{golang_version:?}, BuildStatus:{status:?}, GitTag:{ours:?}}}\n"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Parsed, clap::Error> {
        parse_args(args.iter().map(OsString::from))
    }

    fn proxy(p: &Parsed) -> &ProxyArgs {
        match &p.cli.command {
            Command::Proxy(a) => a,
            _ => panic!("expected proxy"),
        }
    }

    #[test]
    fn proxy_defaults() {
        let p = parse(&["pilot-agent", "proxy"]).unwrap();
        let flags = proxy(&p).to_flags(p.cli.log.as_json).unwrap();
        assert_eq!(flags, ProxyFlags::default());
        assert_eq!(p.cli.log.to_options(), LogOptions::default());
        assert!(!proxy(&p).dump_config);
    }

    #[test]
    fn injected_invocation_parses() {
        let p = parse(&[
            "/usr/local/bin/pilot-agent",
            "proxy",
            "sidecar",
            "--domain",
            "ns.svc.cluster.local",
            "--proxyLogLevel=warning",
            "--proxyComponentLogLevel=misc:error",
            "--log_output_level=default:info",
            "--stsPort=15463",
            "--log_as_json",
            "--outlierLogPath=/dev/stdout",
        ])
        .unwrap();
        let f = proxy(&p).to_flags(p.cli.log.as_json).unwrap();
        assert_eq!(f.domain, "ns.svc.cluster.local");
        assert_eq!(f.proxy_component_log_level, "misc:error");
        assert_eq!(f.sts_port, 15463);
        assert_eq!(f.outlier_log_path, "/dev/stdout");
        assert!(f.log_as_json);
        assert_eq!(p.cli.log.output_level, "default:info");
        assert!(p.dropped_flags.is_empty());
    }

    #[test]
    fn unknown_flags_are_stripped() {
        let cases: &[(&[&str], &[&str])] = &[
            // --x=v: only the flag goes.
            (&["a", "proxy", "--vklog=9", "router"], &["--vklog=9"]),
            // --x v: the value goes too, even if it was meant as TYPE.
            (
                &["a", "proxy", "--unknown", "v", "--domain=d"],
                &["--unknown v"],
            ),
            // --x --next: only --x goes.
            (&["a", "proxy", "--unknown", "--domain=d"], &["--unknown"]),
            // trailing --x.
            (&["a", "proxy", "--domain=d", "--unknown"], &["--unknown"]),
            // root-level unknown flag before the subcommand.
            (&["a", "--old-root=1", "proxy"], &["--old-root=1"]),
            // unknown short flags.
            (&["a", "proxy", "-x", "v"], &["-x v"]),
            (&["a", "proxy", "-xv"], &["-xv"]),
        ];
        for (args, want) in cases {
            let p = parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(p.dropped_flags, *want, "{args:?}");
        }
        let p = parse(&["a", "proxy", "--vklog=9", "router"]).unwrap();
        assert_eq!(proxy(&p).proxy_type, "router");
        let p = parse(&["a", "proxy", "--unknown", "v", "--domain=d"]).unwrap();
        assert_eq!(proxy(&p).domain, "d");
        assert_eq!(proxy(&p).proxy_type, "sidecar");
    }

    #[test]
    fn known_flag_values_are_not_mistaken_for_flags() {
        // A value that names a subcommand or looks like a positional stays a value.
        let p = parse(&[
            "a",
            "--log_output_level",
            "default:debug",
            "proxy",
            "--domain",
            "version",
        ])
        .unwrap();
        assert_eq!(p.cli.log.output_level, "default:debug");
        assert_eq!(proxy(&p).domain, "version");
    }

    #[test]
    fn bool_flag_forms() {
        let cases: &[(&[&str], bool)] = &[
            (&["a", "proxy"], false),
            (&["a", "proxy", "--log_as_json"], true),
            (&["a", "proxy", "--log_as_json=true"], true),
            (&["a", "proxy", "--log_as_json=1"], true),
            (&["a", "proxy", "--log_as_json=T"], true),
            (&["a", "proxy", "--log_as_json=false"], false),
            (&["a", "proxy", "--log_as_json=0"], false),
            (&["a", "--log_as_json", "proxy"], true),
        ];
        for (args, want) in cases {
            let p = parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(p.cli.log.as_json, *want, "{args:?}");
        }
        // A bool flag never swallows the next argument.
        let p = parse(&["a", "proxy", "--profiling", "router"]).unwrap();
        assert!(proxy(&p).profiling);
        assert_eq!(proxy(&p).proxy_type, "router");
        let p = parse(&["a", "proxy", "--profiling=false"]).unwrap();
        assert!(!proxy(&p).profiling);
        assert!(parse(&["a", "proxy", "--profiling=maybe"]).is_err());
    }

    #[test]
    fn proxy_types() {
        for t in ["sidecar", "router", "waypoint", "ztunnel", "agentgateway"] {
            let p = parse(&["a", "proxy", t]).unwrap();
            assert_eq!(proxy(&p).to_flags(false).unwrap().proxy_type.as_str(), t);
        }
        let p = parse(&["a", "proxy", "gateway"]).unwrap();
        let err = proxy(&p).to_flags(false).unwrap_err().to_string();
        assert!(err.contains("invalid proxy Type"), "{err}");
        assert!(err.contains("gateway"), "{err}");
    }

    #[test]
    fn unknown_subcommands_are_rejected() {
        assert!(parse(&["a", "collateral"]).is_err());
        assert!(parse(&["a", "istio-iptables"]).is_err());
        assert!(parse(&["a"]).is_err());
    }

    #[test]
    fn wait_and_request_flags() {
        let p = parse(&[
            "pilot-agent",
            "wait",
            "--url=http://localhost:15020/healthz/ready",
            "--timeoutSeconds",
            "5",
        ])
        .unwrap();
        let Command::Wait(w) = p.cli.command else {
            panic!("expected wait")
        };
        assert_eq!(w.url, "http://localhost:15020/healthz/ready");
        assert_eq!(
            (w.timeout_seconds, w.request_timeout_millis, w.period_millis),
            (5, 500, 500)
        );
        let p = parse(&[
            "pilot-agent",
            "request",
            "--debug-port=15020",
            "POST",
            "drain",
        ])
        .unwrap();
        let Command::Request(r) = p.cli.command else {
            panic!("expected request")
        };
        assert_eq!(
            (r.method.as_str(), r.path.as_str(), r.debug_port),
            ("POST", "drain", 15020)
        );
    }

    #[test]
    fn debug_bundle_flags() {
        for bin in ["pilot-agent", "/usr/local/bin/meshagent"] {
            let p = parse(&[
                bin,
                "debug",
                "bundle",
                "-o",
                "/tmp/b.tar.gz",
                "--status-port=15999",
                "--timeout",
                "3s",
                "--unknown-flag",
            ])
            .unwrap();
            let Command::Debug(DebugArgs {
                command: DebugCommand::Bundle(b),
            }) = p.cli.command
            else {
                panic!("expected debug bundle")
            };
            assert_eq!(
                (b.output.as_str(), b.status_port, b.admin_port, b.log_lines),
                ("/tmp/b.tar.gz", 15999, None, 1000)
            );
            assert_eq!(b.timeout, std::time::Duration::from_secs(3));
            assert_eq!(p.dropped_flags, ["--unknown-flag"]);
        }
        assert!(parse(&["a", "debug", "bundle", "--timeout=soon"]).is_err());
        assert!(parse(&["a", "debug"]).is_err());
    }

    #[test]
    fn doctor_takes_the_proxy_flags() {
        for bin in ["meshagent", "/usr/local/bin/pilot-agent"] {
            let p = parse(&[bin, "doctor", "--json", "--domain", "d", "--unknown=1"]).unwrap();
            let Command::Doctor(d) = p.cli.command else {
                panic!("expected doctor")
            };
            assert!(d.json);
            assert_eq!(d.proxy.domain, "d");
            assert_eq!(d.proxy.proxy_type, "sidecar");
            assert_eq!(d.step_timeout_ms, 3000);
            assert_eq!(p.dropped_flags, ["--unknown=1"]);
        }
        let p = parse(&["a", "doctor", "router"]).unwrap();
        let Command::Doctor(d) = p.cli.command else {
            panic!("expected doctor")
        };
        assert!(!d.json);
        assert_eq!(d.proxy.proxy_type, "router");
        let err = parse(&["a", "doctor", "--dump-config"]).unwrap_err();
        assert!(
            err.to_string()
                .contains("doctor does not take --dump-config"),
            "{err}"
        );
    }

    #[test]
    fn usage_uses_invoked_name() {
        for name in ["pilot-agent", "meshagent"] {
            let err = parse(&[&format!("/usr/local/bin/{name}"), "--help"]).unwrap_err();
            assert!(!err.use_stderr());
            assert!(err.to_string().contains(name), "{err}");
        }
    }

    fn version(args: &[&str]) -> String {
        let mut argv = vec!["a", "version"];
        argv.extend_from_slice(args);
        match parse(&argv).unwrap().cli.command {
            Command::Version(v) => version_output(&v).unwrap(),
            _ => panic!("expected version"),
        }
    }

    #[test]
    fn version_shapes() {
        assert_eq!(version(&["--short"]), format!("{ISTIO_COMPAT_VERSION}\n"));
        assert_eq!(version(&["-s"]), format!("{ISTIO_COMPAT_VERSION}\n"));

        let long = version(&[]);
        assert!(
            long.starts_with(&format!(
                "version.BuildInfo{{Version:{ISTIO_COMPAT_VERSION:?}, GitRevision:\"meshagent "
            )),
            "{long}"
        );
        assert!(
            long.contains("GolangVersion:")
                && long.contains("BuildStatus:")
                && long.contains("GitTag:")
        );

        let v: serde_json::Value = serde_json::from_str(&version(&["-o", "json"])).unwrap();
        let info = &v["clientVersion"];
        assert_eq!(info["version"], ISTIO_COMPAT_VERSION);
        for key in ["revision", "golang_version", "status", "tag"] {
            assert!(info[key].is_string(), "{key} missing in {v}");
        }
        assert!(info["revision"].as_str().unwrap().starts_with("meshagent "));

        let v: serde_json::Value = serde_yaml::from_str(&version(&["--output=yaml"])).unwrap();
        assert_eq!(v["clientVersion"]["version"], ISTIO_COMPAT_VERSION);
        assert!(v["clientVersion"]["tag"].is_string());

        let v: serde_json::Value = serde_json::from_str(&version(&["-s", "-o", "json"])).unwrap();
        assert_eq!(
            v,
            json!({"clientVersion": {"version": ISTIO_COMPAT_VERSION}})
        );

        assert!(parse(&["a", "version", "-o", "xml"]).is_err());
    }
}
