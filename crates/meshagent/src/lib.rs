//! meshagent: a Rust drop-in replacement for the Istio agent (`pilot-agent`).
//!
//! `main.rs` only parses the command line, sets up logging and maps errors to
//! exit codes; everything else lives here so it can be tested in-process.

#![forbid(unsafe_code)]
#![deny(rust_2018_idioms, clippy::disallowed_methods, clippy::disallowed_types)]

pub mod cli;
pub mod config;
pub mod control_plane;
pub mod logging;
pub mod metrics;
pub mod xds;

/// The Istio release whose agent behaviour (flags, env, files) we match.
pub const ISTIO_COMPAT_VERSION: &str = "1.29.0";

/// Why [`run`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// This build has configuration only; the runtime arrives in later work.
    #[error("the proxy runtime is not built yet in this build of meshagent")]
    NotBuilt,
}

impl RunError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::NotBuilt => 2,
        }
    }
}

/// Runs the agent with a loaded configuration.
pub fn run(config: &config::Config) -> Result<(), RunError> {
    match serde_json::to_string(config) {
        Ok(json) => tracing::info!("Effective config: {json}"),
        Err(e) => tracing::warn!("cannot render effective config: {e}"),
    }
    Err(RunError::NotBuilt)
}
