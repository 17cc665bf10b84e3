//! End-to-end test harness: runs devplane, Envoy (and the agent) as real processes in temp
//! dirs on free ports, waits with deadlines, prints every child's log when a test fails, and
//! kills every child on drop.
#![forbid(unsafe_code)]
#![allow(clippy::unwrap_used)] // test support: failing loudly is the point

use std::time::Duration;

pub use serde_json::{Value, json};

pub mod ca_client;
pub mod istiod_box;
pub mod kubelet;
pub mod prom;
pub mod static_sds;

mod devplane;
mod envoy;
mod http;
mod json;
mod mesh;
mod paths;
mod ports;
mod process;
mod sidecar;

pub use devplane::*;
pub use envoy::*;
pub use http::*;
pub use json::*;
pub use mesh::*;
pub use paths::*;
pub use ports::*;
pub use process::*;
pub use sidecar::*;

/// Default deadline for things that should happen "soon" (process start, config push).
pub const DEADLINE: Duration = Duration::from_secs(30);
