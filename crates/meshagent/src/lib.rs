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
pub mod debug_bundle;
pub mod dns;
pub mod doctor;
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
pub mod net;
pub mod nss;
pub mod platform;
pub mod preflight;
pub mod reference;
pub mod request;
pub mod status;
pub mod supervise;
pub mod tasks;
pub mod tls_policy;
pub mod uds;
pub mod wait;
pub mod wasm;
pub mod xds;

/// The Istio version meshagent reports: node metadata `ISTIO_VERSION` (istiod picks the xDS it
/// generates by it, `pilot/pkg/model/context.go` `ParseIstioVersion`) and `meshagent version`.
/// pilot-agent reports the version it was built as (`-X istio.io/istio/pkg/version.buildVersion`,
/// `pkg/version/version.go`); so does meshagent: the build-time environment variable
/// `ISTIO_BUILD_VERSION` sets it (the Makefile passes its own, the one it builds the real
/// pilot-agent with), and without it the build says the Istio release it targets.
pub const ISTIO_COMPAT_VERSION: &str = match option_env!("ISTIO_BUILD_VERSION") {
    Some(v) if !v.is_empty() => v,
    _ => DEFAULT_ISTIO_VERSION,
};

/// The Istio release this code targets: the Go module pinned in `compat/go.mod` (Istio 1.31
/// before its release, which Istio's own builds call `1.31-dev`).
pub const DEFAULT_ISTIO_VERSION: &str = "1.31-dev";
