//! The SDS server Envoy's `sds-grpc` cluster talks to (Istio `security/pkg/nodeagent/sds`).
//!
//! Listens on a unix socket (by default `<cwd>/var/run/secrets/workload-spiffe-uds/socket`),
//! bound by [`crate::uds`]; the directory is created first. Protocol details are in [`service`].

pub mod service;

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

pub use crate::uds::bind_path;

/// Binds `path` (removing a stale socket, creating the directory, mode 0666). Retried up to 5
/// times with 1 s doubling, as Istio does for a transiently busy path; an unusable path (e.g.
/// too long for a socket address) fails at once.
pub async fn bind(path: &Path) -> Result<UnixListener, SdsError> {
    let err = |source| SdsError::Socket {
        path: path.to_path_buf(),
        source,
    };
    // Directory creation, stale-socket removal and chmod are file work, and a rebind happens
    // while everything else is served: the blocking pool (a blocking-pool thread is in the
    // runtime's context, so the listener registers with its reactor).
    let mut delay = Duration::from_secs(1);
    let mut attempt = 0;
    loop {
        let p = path.to_path_buf();
        #[allow(clippy::disallowed_methods, reason = "inside spawn_blocking")]
        let bound = tokio::task::spawn_blocking(move || {
            if let Some(dir) = bind_path(&p).parent() {
                std::fs::create_dir_all(dir)?;
            }
            crate::uds::bind_once(&p, "SDS")
        })
        .await
        .map_err(|e| err(std::io::Error::other(e)))?;
        match bound {
            Ok(l) => return Ok(l),
            Err(e) if attempt < 5 && e.kind() != std::io::ErrorKind::InvalidInput => {
                tracing::warn!(path = %path.display(), error = %e, retry_in = %crate::logging::dur(delay), "cannot listen for SDS; retrying");
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
        // Each request read into a buffer of its own length (`SdsService`'s `Inbound`).
        .layer(crate::xds::reader::TakeRequestBody)
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
