//! `meshagent-devplane`: run the stand-in control plane, or mint a token it accepts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "meshagent-devplane",
    version,
    about = "A protocol-faithful stand-in for istiod (ADS + Istio CA) for tests and demos"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve ADS and the Istio CA on --grpc-addr (TLS), optionally plaintext and debug ports.
    Serve {
        /// Holds the root CA, the serving certificate and the token signing key (created once).
        #[arg(long)]
        state_dir: PathBuf,
        /// Mesh YAML (workloads and services); re-read when it changes.
        #[arg(long)]
        mesh: PathBuf,
        #[arg(long, default_value = "127.0.0.1:15012")]
        grpc_addr: SocketAddr,
        /// Same services without TLS and without required authentication (like istiod's 15010).
        #[arg(long)]
        plaintext_addr: Option<SocketAddr>,
        /// JSON debug endpoint (/debug/clients, /debug/csr, /debug/token); keep it on loopback.
        #[arg(long)]
        debug_addr: Option<SocketAddr>,
    },
    /// Print a JWT devplane's CA and xDS server accept.
    Token {
        #[arg(long)]
        state_dir: PathBuf,
        #[arg(long)]
        namespace: String,
        #[arg(long)]
        service_account: String,
        /// Lifetime, e.g. 1h, 30m, 90s.
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        ttl: Duration,
    },
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 90s, 30m, 12h, 2d"))?;
    let secs = match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86400,
        _ => return Err(format!("invalid duration {s:?}: unit must be s, m, h or d")),
    };
    Ok(Duration::from_secs(secs))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let cli = Cli::parse();
    let result: anyhow::Result<()> = match cli.command {
        Command::Serve {
            state_dir,
            mesh,
            grpc_addr,
            plaintext_addr,
            debug_addr,
        } => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| {
                rt.block_on(meshagent_devplane::serve(
                    meshagent_devplane::ServeOptions {
                        state_dir,
                        mesh_path: mesh,
                        grpc_addr,
                        plaintext_addr,
                        debug_addr,
                    },
                ))
                .map_err(anyhow::Error::from)
            }),
        Command::Token {
            state_dir,
            namespace,
            service_account,
            ttl,
        } => meshagent_devplane::state::issue_token_from_state_dir(
            &state_dir,
            &namespace,
            &service_account,
            ttl,
        )
        .map(|t| println!("{t}"))
        .map_err(anyhow::Error::from),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("meshagent-devplane: {e:#}");
            ExitCode::FAILURE
        }
    }
}
