//! The `meshagent` binary (also installed as `pilot-agent`).

use std::path::Path;
use std::process::ExitCode;

use meshagent::cli::{self, Command, ProxyArgs};
use meshagent::{config, logging};

fn main() -> ExitCode {
    // Before any thread exists (mallopt settings are process-wide).
    meshagent::malloc::configure();
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
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let cli::Cli { log, command } = parsed.cli;
    let mut log_options = log.to_options();
    if matches!(&command, Command::Proxy(a) if a.dump_config) {
        // stdout carries the JSON dump; keep it parseable.
        log_options.targets = vec!["stderr".into()];
    }
    match logging::init(&log_options) {
        Ok(warnings) => warnings.iter().for_each(|w| tracing::warn!("{w}")),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    }
    for flag in &parsed.dropped_flags {
        tracing::warn!("ignoring unknown flag {flag}");
    }
    match command {
        Command::Version(args) => exit_with(cli::version_output(&args), |out| print!("{out}")),
        Command::Proxy(args) => proxy(&args, log.as_json),
        Command::Wait(args) => exit_with(on_runtime(meshagent::wait::run(&args)), |()| {}),
        // The body streams to stdout as it arrives (a config dump can be hundreds of MiB).
        Command::Request(args) => exit_with(
            on_runtime(async { meshagent::request::run(&args, &mut tokio::io::stdout()).await }),
            |()| {},
        ),
    }
}

/// `on_ok` with the value and exit 0, or the error on stderr and exit 1.
fn exit_with<T, E: std::fmt::Display>(r: Result<T, E>, on_ok: impl FnOnce(T)) -> ExitCode {
    match r {
        Ok(v) => {
            on_ok(v);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs `fut` on the agent's runtime; a runtime that cannot start is an error like `fut`'s.
fn on_runtime<T, E: std::fmt::Display>(
    fut: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, String> {
    let rt = runtime().map_err(|e| e.to_string())?;
    rt.block_on(fut).map_err(|e| e.to_string())
}

/// One thread runs every task (blocking work — key generation, file reads — goes to Tokio's
/// blocking pool). The agent's own work is small (BENCHMARKS.md: ~2 ms of CPU per MB of xDS
/// forwarded), so a multi-threaded scheduler would only add threads, per-thread malloc
/// arenas and, through its poll-time statistics, libm: about 1 MiB of RSS next to every
/// sidecar. (Unlike Envoy or a data-plane proxy, nothing here is on the request path.)
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
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
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    config::resolve_statsd(&mut config.proxy_config);
    if args.dump_config {
        return match serde_json::to_string_pretty(&config) {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: cannot render config: {e}");
                ExitCode::from(1)
            }
        };
    }
    match serde_json::to_string(&config) {
        Ok(json) => tracing::info!("Effective config: {json}"),
        Err(e) => tracing::warn!("cannot render effective config: {e}"),
    }
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let agent = meshagent::app::Agent::new(config, Path::new("."));
    match runtime().map(|rt| rt.block_on(agent.run())) {
        Ok(Ok(code)) => ExitCode::from(code),
        Ok(Err(e)) => {
            tracing::error!("{e}");
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            ExitCode::from(1)
        }
    }
}
