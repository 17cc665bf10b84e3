//! The `meshagent` binary (also installed as `pilot-agent`).

use std::path::Path;
use std::process::ExitCode;

use meshagent::cli::{self, Command, ProxyArgs};
use meshagent::{config, logging};

fn main() -> ExitCode {
    // Before any thread exists (mallopt settings are process-wide).
    meshagent::malloc::configure();
    // Before the first name lookup: a static agent uses glibc's built-in name services only,
    // as pilot-agent's Go code does (nss.rs says why).
    meshagent::nss::pin_builtin_sources();
    // `istio-iptables` has its own pflag-style flags (short letters, env bindings); it is
    // dispatched before the agent's command line is parsed.
    let argv: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    if let Some(args) = meshagent::iptables::subcommand_args(&argv) {
        return ExitCode::from(meshagent::iptables::main(&args));
    }
    let parsed = match cli::parse_args(std::env::args_os()) {
        Ok(p) => p,
        Err(e) => {
            // --help output is a clap "error" printed to stdout.
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // A bad command line is also an error log line (Istio's defaults: text on
            // stdout), as pilot-agent's `main.go` logs cobra's error; the usage goes to stderr.
            let _ = logging::init(&logging::LogOptions::default());
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            tracing::error!("{}", first.strip_prefix("error: ").unwrap_or(first));
            // cobra's `Error: ` prefix; the exit status stays 1 (COMPAT.md, "a failed command").
            eprint!("Error: {}", text.strip_prefix("error: ").unwrap_or(&text));
            return ExitCode::from(1);
        }
    };
    let cli::Cli { log, command } = parsed.cli;
    let mut log_options = log.to_options();
    // `--dump-config` keeps stdout for the JSON dump, `config-reference` for the Markdown,
    // `debug bundle -o -` for the archive, `doctor` for its report; logs go to stderr.
    let stdout_reserved = matches!(&command, Command::Proxy(a) if a.dump_config)
        || matches!(&command, Command::ConfigReference)
        || matches!(&command, Command::Debug(d) if matches!(&d.command,
            cli::DebugCommand::Bundle(b) if b.output == "-"))
        || matches!(&command, Command::Doctor(_));
    if stdout_reserved {
        log_options.targets = vec!["stderr".into()];
    }
    // Invalid flags still get logging (Istio's defaults), so their error is a log line.
    let fallback = if stdout_reserved { "stderr" } else { "stdout" };
    if let Err(e) = logging::init_or_default(&log_options, fallback) {
        return fail(&e);
    }
    for flag in &parsed.dropped_flags {
        tracing::warn!("ignoring unknown flag {flag}");
    }
    match command {
        Command::Debug(cli::DebugArgs {
            command: cli::DebugCommand::Bundle(args),
        }) => debug_bundle(&args),
        Command::Version(args) => exit_with(cli::version_output(&args), |out| print!("{out}")),
        Command::ConfigReference => match meshagent::reference::markdown() {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Command::Proxy(args) => proxy(&args, log.as_json),
        Command::Doctor(args) => doctor(&args, log.as_json),
        Command::Wait(args) => exit_with(on_runtime(meshagent::wait::run(&args)), |()| {}),
        // The body streams to stdout as it arrives (a config dump can be hundreds of MiB).
        Command::Request(args) => {
            let r = on_runtime(async {
                meshagent::request::run(&args, &mut tokio::io::stdout()).await
            });
            match r {
                // The reader went away (`meshagent request GET config_dump | head`): a CLI
                // stops quietly (Go's pilot-agent dies of SIGPIPE without a word).
                Err(Failure::Command(e)) if e.is_broken_pipe() => ExitCode::SUCCESS,
                r => exit_with(r, |()| {}),
            }
        }
    }
}

/// Logs `e` and exits 1. As Istio (`pilot/cmd/pilot-agent/main.go` logs the command's error;
/// cobra prints it to stderr), the error is both a log line and a line on stderr.
fn fail(e: &dyn std::fmt::Display) -> ExitCode {
    tracing::error!("{e}");
    if !logging::logs_to_stderr() {
        eprintln!("error: {e}");
    }
    ExitCode::from(1)
}

/// `on_ok` with the value and exit 0, or the error logged and exit 1.
fn exit_with<T, E: std::fmt::Display>(r: Result<T, E>, on_ok: impl FnOnce(T)) -> ExitCode {
    match r {
        Ok(v) => {
            on_ok(v);
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

/// A subcommand that failed, or the runtime it needed.
#[derive(Debug, thiserror::Error)]
enum Failure<E: std::error::Error + 'static> {
    #[error("cannot start the runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error(transparent)]
    Command(E),
}

/// Runs `fut` on the agent's runtime.
fn on_runtime<T, E: std::error::Error + 'static>(
    fut: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, Failure<E>> {
    let rt = runtime().map_err(Failure::Runtime)?;
    rt.block_on(fut).map_err(Failure::Command)
}

/// One thread runs every task (blocking work — key generation, file reads — goes to Tokio's
/// blocking pool). The agent's own work is small (docs/benchmarks-log.md: ~2 ms of CPU per MB of
/// xDS forwarded), so a multi-threaded scheduler would only add threads, per-thread malloc
/// arenas and, through its poll-time statistics, libm: about 1 MiB of RSS next to every
/// sidecar. (Unlike Envoy or a data-plane proxy, nothing here is on the request path.)
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// `debug bundle`: collects, writes, and says where (on stderr: stdout may be the archive).
fn debug_bundle(args: &cli::BundleArgs) -> ExitCode {
    let localhost = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let opts = meshagent::debug_bundle::BundleOptions {
        output: (args.output != "-").then(|| args.output.clone().into()),
        status: localhost(args.status_port),
        admin: args.admin_port.map(localhost),
        timeout: args.timeout,
        log_lines: args.log_lines,
        base_dir: ".".into(),
    };
    let r = on_runtime(meshagent::debug_bundle::run(&opts, &config::ProcessEnv));
    exit_with(r, |s| {
        eprintln!(
            "wrote {} ({} files, {} not collected: see MANIFEST.txt; {} secrets scrubbed)",
            opts.output.as_ref().map_or_else(
                || "the bundle to stdout".to_owned(),
                |p| p.display().to_string()
            ),
            s.files,
            s.errors,
            s.redactions
        );
    })
}

/// `doctor`: the report on stdout; exit 1 when any check failed (a configuration that does
/// not load is itself a failed check).
fn doctor(args: &cli::DoctorArgs, log_as_json: bool) -> ExitCode {
    use meshagent::doctor::{self, Check, Report};
    let loaded = args
        .proxy
        .to_flags(log_as_json)
        .map_err(anyhow::Error::from)
        .and_then(|flags| {
            config::load(&flags, &config::ProcessEnv, Path::new(".")).map_err(anyhow::Error::from)
        });
    let report = match loaded {
        Ok(cfg) => {
            let opts = doctor::Options {
                step_timeout: std::time::Duration::from_millis(args.step_timeout_ms.max(1)),
                dns_name: args.dns_name.clone(),
                ..Default::default()
            };
            let mut report = match runtime() {
                Ok(rt) => rt.block_on(doctor::run(&cfg, &opts)),
                Err(e) => return fail(&format!("cannot start the runtime: {e}")),
            };
            // What a start would refuse beyond the config itself (template, override file,
            // CA and xDS endpoints): the agent's own preflight.
            if let Err(e) = meshagent::preflight::plan(&cfg, Path::new(".")) {
                report.checks.insert(
                    0,
                    Check::fail(
                        "config",
                        format!("the agent would refuse to start: {e}"),
                        "fix the variable, flag or file named above",
                    ),
                );
            }
            report
        }
        Err(e) => Report {
            checks: vec![Check::fail(
                "config",
                format!("the agent's configuration does not load: {e}"),
                "fix the variable, flag or file named above: the agent would refuse to start",
            )],
        },
    };
    if args.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.text());
    }
    if report.failed() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn proxy(args: &ProxyArgs, log_as_json: bool) -> ExitCode {
    let loaded = args
        .to_flags(log_as_json)
        .map_err(anyhow::Error::from)
        .and_then(|flags| {
            config::load(&flags, &config::ProcessEnv, Path::new(".")).map_err(anyhow::Error::from)
        });
    let mut config = match loaded {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    config::resolve_statsd(&mut config.proxy_config);
    // What the start would reject, before anything starts; `--dump-config` fails the same way.
    let plan = match meshagent::preflight::plan(&config, Path::new(".")) {
        Ok(p) => p,
        Err(e) => return fail(&e),
    };
    if args.dump_config {
        return match serde_json::to_string_pretty(&config) {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(&format!("cannot render config: {e}")),
        };
    }
    match serde_json::to_string(&config) {
        Ok(json) => tracing::info!("Effective config: {json}"),
        Err(e) => tracing::warn!("cannot render effective config: {e}"),
    }
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let agent = meshagent::app::Agent::with_plan(config, plan, Path::new("."));
    match runtime().map(|rt| rt.block_on(agent.run())) {
        Ok(Ok(code)) => ExitCode::from(code),
        Ok(Err(e)) => fail(&e),
        Err(e) => fail(&format!("cannot start the runtime: {e}")),
    }
}
