//! meshagent: a Rust drop-in replacement for the Istio agent (`pilot-agent`).
//!
//! `main.rs` only parses the command line, sets up logging and maps errors to
//! exit codes; everything else lives here so it can be tested in-process.

#![deny(unsafe_code)]
#![deny(rust_2018_idioms, clippy::disallowed_methods, clippy::disallowed_types)]

pub mod app;
pub mod bootstrap;
pub mod cli;
pub mod code_pages;
pub mod config;
pub mod control_plane;
pub mod dns;
pub mod envoy;
pub mod fsio;
#[doc(hidden)]
pub mod fuzzing;
pub mod grpcxds;
pub mod http_client;
pub mod identity;
pub mod iptables;
pub mod logging;
pub mod malloc;
pub mod metrics;
pub mod platform;
pub mod request;
pub mod sds;
pub mod status;
pub mod supervise;
pub mod tasks;
pub mod uds;
pub mod wait;
pub mod wasm;
pub mod xds;

/// The Istio release whose agent behaviour (flags, env, files) we match.
pub const ISTIO_COMPAT_VERSION: &str = "1.29.0";
