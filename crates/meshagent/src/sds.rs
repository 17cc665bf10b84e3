//! The SDS server Envoy's `sds-grpc` cluster talks to (spec §4.1 step 6, §4.2).
//!
//! Listens on a unix socket (by default `<cwd>/var/run/secrets/workload-spiffe-uds/socket`):
//! the directory is created, a stale socket from a previous run is removed, and the socket is
//! made 0666 so Envoy can connect whatever its uid. Protocol details are in [`service`].

pub mod service;

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use meshagent_proto::envoy::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryServiceServer;
use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;

use crate::identity::store::SecretStore;
pub use service::SdsService;

/// The workload SDS socket, relative to the agent's working directory.
pub const WORKLOAD_SOCKET: &str = "var/run/secrets/workload-spiffe-uds/socket";
/// The file-only SDS socket used when an external workload SDS socket exists.
pub const FILES_SOCKET: &str = "var/run/secrets/credential-uds/files-socket";

#[derive(Debug, thiserror::Error)]
pub enum SdsError {
    #[error("SDS socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The path to bind a unix socket at: relative to the process's working directory when `path`
/// is under it, as Istio binds `./var/run/...` and `./etc/istio/proxy/XDS`. A socket address
/// holds at most 107 bytes (SUN_LEN), so an absolute path under a long working directory
/// would not bind.
pub fn bind_path(path: &Path) -> PathBuf {
    if path.is_absolute()
        && let Ok(cwd) = std::env::current_dir()
        && let Ok(rel) = path.strip_prefix(&cwd)
    {
        return Path::new(".").join(rel);
    }
    path.to_path_buf()
}

/// Binds `path` (removing a stale socket, creating the directory, mode 0666). Retried up to 5
/// times with 1 s doubling, as Istio does for a transiently busy path; an unusable path (e.g.
/// too long for a socket address) fails at once.
pub async fn bind(path: &Path) -> Result<UnixListener, SdsError> {
    let err = |source| SdsError::Socket {
        path: path.to_path_buf(),
        source,
    };
    let shown = path;
    let bound = bind_path(path);
    let path = bound.as_path();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let mut delay = Duration::from_secs(1);
    let mut attempt = 0;
    loop {
        match std::fs::remove_file(path) {
            Ok(()) => tracing::debug!(path = %shown.display(), "removed stale SDS socket"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
        match UnixListener::bind(path) {
            Ok(l) => {
                match std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)) {
                    Ok(()) => {}
                    // Removed between bind and chmod: the server supervisor notices the
                    // missing socket and binds it again, so this is not a startup failure.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        tracing::warn!(path = %shown.display(), "SDS socket removed right after bind");
                    }
                    Err(e) => return Err(err(e)),
                }
                return Ok(l);
            }
            Err(e) if attempt < 5 && e.kind() != std::io::ErrorKind::InvalidInput => {
                tracing::warn!(path = %shown.display(), error = %e, retry_in = ?delay, "cannot listen for SDS; retrying");
                attempt += 1;
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            Err(e) => return Err(err(e)),
        }
    }
}

/// Serves SDS from `store` on `listener` until `shutdown`.
pub async fn serve(
    listener: UnixListener,
    store: Arc<SecretStore>,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(100_000))
        .add_service(SecretDiscoveryServiceServer::new(SdsService::new(
            store,
            shutdown.clone(),
        )))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
}
