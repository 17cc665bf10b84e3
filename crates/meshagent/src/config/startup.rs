//! The checks a start makes on its configuration before anything runs, made at load time
//! instead, so `proxy --dump-config` fails exactly as `proxy` would: these call the same
//! functions the start calls (bootstrap template, node metadata, the bootstrap override
//! file, CA provider, key size, CA and xDS endpoints) and keep their messages (each error type reaches `main` through
//! `#[error(transparent)]` wrappers, so its text is what a start prints).
//!
//! Files are judged only where the start reads them itself (the bootstrap override) or its
//! choice of identity mode depends on them: the CA checks only apply when the start would
//! use the CA, as in `identity::start_with`. Certificates and roots, read per connection,
//! are not checked here.
#![allow(
    clippy::disallowed_methods,
    reason = "config checks run before the runtime serves anything"
)]

use std::fmt::Display;
use std::path::Path;

use super::{Config, ConfigError};
use crate::identity::{self, IdentityError};

pub(crate) fn check(cfg: &Config, base_dir: &Path) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    let mut fail = |e: &dyn Display| errors.push(ConfigError::Startup(e.to_string()));
    if let Err(e) = crate::bootstrap::load_template(cfg, base_dir) {
        fail(&e);
    }
    if let Err(e) = crate::bootstrap::Node::from_config(cfg) {
        fail(&e);
    }
    if !cfg.lifecycle.disable_envoy
        && let Err(e) = crate::app::bootstrap_override(cfg, base_dir)
    {
        fail(&e);
    }
    if uses_ca(cfg, base_dir) {
        let id = &cfg.identity;
        if id.ca_provider != "Citadel" {
            fail(&IdentityError::CaProvider(id.ca_provider.clone()));
        }
        // An unsupported ECC_SIGNATURE_ALGORITHM fails each key generation, as in Istio,
        // not the start.
        if let Err(e) = identity::keys::KeySpec::from_config(id)
            && !matches!(e, identity::keys::KeyError::EcAlgorithm(_))
        {
            fail(&e);
        }
        if let Err(e) = crate::control_plane::ca_target(cfg) {
            fail(&e);
        }
    }
    // What `xds::XdsOptions::from_config` checks, without building the call metadata
    // (which warns about headers itself at start).
    if let Err(e) = crate::control_plane::xds_target(cfg, base_dir) {
        fail(&crate::xds::XdsError::Upstream(e));
    }
    errors
}

/// Whether `identity::start_with` would pick the CA mode: no external SDS socket (or a
/// non-default socket name, which requires one), no mounted workload credentials, no
/// `FILE_MOUNTED_CERTS`. When in doubt (a socket file exists), the CA checks are left to the
/// start.
fn uses_ca(cfg: &Config, base_dir: &Path) -> bool {
    let id = &cfg.identity;
    let creds = base_dir.join(identity::WORKLOAD_SPIFFE_CREDENTIALS_DIR);
    let mounted = ["cert-chain.pem", "key.pem", "root-cert.pem"]
        .iter()
        .all(|f| creds.join(f).exists());
    let external = base_dir
        .join(identity::WORKLOAD_SPIFFE_UDS_DIR)
        .join(&id.workload_identity_socket_file);
    !id.file_mounted_certs
        && !mounted
        && id.workload_identity_socket_file == "socket"
        && !external.exists()
}
