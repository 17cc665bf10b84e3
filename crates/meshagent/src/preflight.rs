//! Preflight: the start's checks and the values a start computes once from a loaded
//! [`Config`], made before anything runs, so `proxy --dump-config` fails exactly as `proxy`
//! would and the start does not compute them again. It sits above `config` (a leaf: it
//! imports nothing of the agent) and below `app`: it calls the functions the start itself
//! would call — the bootstrap template, node metadata, the bootstrap override file, CA
//! provider, key size, CA and xDS endpoints — and keeps their errors, so each message is the
//! one a start prints.
//!
//! Files are judged only where the start reads them itself (the template, the bootstrap
//! override) or its choice of identity mode depends on them: the CA checks only apply when
//! the start would use the CA, as in `identity::start_with`. Certificates and roots, read per
//! connection, are not checked here.
#![allow(
    clippy::disallowed_methods,
    reason = "preflight runs before the runtime serves anything"
)]

use std::path::Path;

use crate::bootstrap::{self, BootstrapError, Node, template::Template};
use crate::config::Config;
use crate::control_plane::DialError;
use crate::identity::{self, IdentityError, keys::KeyError};
use crate::xds::XdsError;

/// Why a start would fail; each message is the one the failing step prints.
#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    #[error(transparent)]
    Identity(#[from] IdentityError),
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error(transparent)]
    Dial(#[from] DialError),
    #[error(transparent)]
    Xds(#[from] XdsError),
    /// Several of the above (the same wording as `ConfigError::Multiple`).
    #[error("{} configuration errors: {}", .0.len(), join(.0))]
    Multiple(Vec<PreflightError>),
}

fn join(errors: &[PreflightError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// What the start uses, computed once.
#[derive(Debug)]
pub struct StartPlan {
    /// The custom bootstrap template, parsed and checked (`None`: the built-in renderer).
    pub template: Option<Template>,
    /// The proxy's node (id, metadata, IPs) before platform discovery adds its part.
    pub node: Node,
    /// `ISTIO_BOOTSTRAP_OVERRIDE` as JSON for Envoy's `--config-yaml`, read once.
    pub bootstrap_override: Option<String>,
}

/// Runs every check and builds the plan; every failing check is reported, not only the first.
pub fn plan(cfg: &Config, base_dir: &Path) -> Result<StartPlan, PreflightError> {
    let mut errors: Vec<PreflightError> = Vec::new();
    let template = bootstrap::load_template(cfg, base_dir)
        .map_err(|e| errors.push(e.into()))
        .ok()
        .flatten();
    let node = Node::from_config(cfg)
        .map_err(|e| errors.push(e.into()))
        .ok();
    let bootstrap_override = if cfg.lifecycle.disable_envoy {
        None
    } else {
        bootstrap::read_override(cfg, base_dir)
            .map_err(|e| errors.push(e.into()))
            .ok()
            .flatten()
    };
    if uses_ca(cfg, base_dir) {
        let id = &cfg.identity;
        if id.ca_provider != "Citadel" {
            errors.push(IdentityError::CaProvider(id.ca_provider.clone()).into());
        }
        // An unsupported ECC_SIGNATURE_ALGORITHM fails each key generation, as in Istio,
        // not the start.
        if let Err(e) = identity::keys::KeySpec::from_config(id)
            && !matches!(e, KeyError::EcAlgorithm(_))
        {
            errors.push(e.into());
        }
        if let Err(e) = crate::control_plane::ca_target(cfg) {
            errors.push(e.into());
        }
    }
    // What `xds::XdsOptions::from_config` checks, without building the call metadata
    // (which warns about headers itself at start).
    if let Err(e) = crate::control_plane::xds_target(cfg, base_dir) {
        errors.push(XdsError::Upstream(e).into());
    }
    match (node, errors.len()) {
        (Some(node), 0) => Ok(StartPlan {
            template,
            node,
            bootstrap_override,
        }),
        _ if errors.len() == 1 => Err(errors.remove(0)),
        _ => Err(PreflightError::Multiple(errors)),
    }
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
