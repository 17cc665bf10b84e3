//! devplane: a small, protocol-faithful stand-in for istiod, for meshagent's tests and demo.
//!
//! One gRPC port (TLS, like istiod's 15012) serves ADS (SotW and Delta) and the Istio CA
//! (`istio.v1.auth.IstioCertificateService`); an optional plaintext port serves the same
//! without TLS (like 15010). A debug HTTP port shows what every client sent.
#![forbid(unsafe_code)]

pub mod ads;
pub mod auth;
pub mod ca;
pub mod clients;
pub mod conn;
pub mod debug;
pub mod generate;
pub mod grpcgen;
pub mod local_cluster;
pub mod mesh;
pub mod nds;
pub mod state;
pub mod token;
pub mod wasm;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use meshagent_proto::envoy::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::AggregatedDiscoveryServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::mesh::Mesh;

#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub state_dir: PathBuf,
    pub mesh_path: PathBuf,
    pub grpc_addr: SocketAddr,
    pub plaintext_addr: Option<SocketAddr>,
    pub debug_addr: Option<SocketAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    State(#[from] state::StateError),
    #[error(transparent)]
    Mesh(#[from] mesh::MeshError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS setup: {0}")]
    Tls(#[from] rustls::Error),
    #[error("gRPC server on {addr}: {source}")]
    Serve {
        addr: SocketAddr,
        #[source]
        source: tonic::transport::Error,
    },
}

/// How often the mesh file is re-read. Polling (rather than inotify) sees every kind of
/// update — in-place writes, atomic renames, symlink swaps — which is all a test tool needs.
const MESH_POLL: Duration = Duration::from_millis(200);

/// Runs devplane until the process is stopped.
pub async fn serve(opts: ServeOptions) -> Result<(), ServeError> {
    let state = state::State::load_or_create(&opts.state_dir)?;
    let mesh = Mesh::load(&opts.mesh_path)?;
    let trust_domain = mesh.trust_domain.clone();
    let (mesh_tx, mesh_rx) = watch::channel(Arc::new(mesh));
    let mesh_feed = Arc::new(MeshFeed {
        tx: mesh_tx,
        generation: AtomicU64::new(0),
    });
    tokio::spawn(watch_mesh(opts.mesh_path.clone(), mesh_feed.clone()));

    let tokens = Arc::new(state.token_issuer()?);
    let auth = auth::Auth::new(tokens.clone(), trust_domain.clone());
    let clients = clients::Clients::default();
    let ca = state.ca()?.with_trust_domain(trust_domain);
    let ca_service = ca::CaService::new(ca, state.token_issuer()?);
    let csr_log = ca_service.csr_log();
    // Raw resources injected through the debug endpoint (tests: malformed or huge ones).
    let (overrides_tx, overrides_rx) = watch::channel(Arc::new(generate::Resources::new()));

    let tls = tokio_rustls::TlsAcceptor::from(Arc::new(state.server_tls_config()?));
    let grpc = TcpListener::bind(opts.grpc_addr)
        .await
        .map_err(|source| ServeError::Listen {
            addr: opts.grpc_addr,
            source,
        })?;
    let grpc_addr = grpc.local_addr().unwrap_or(opts.grpc_addr);
    let serving_since = std::time::SystemTime::now();
    let mut tasks = tokio::task::JoinSet::new();
    {
        let ads = ads::AdsService::new(
            mesh_rx.clone(),
            overrides_rx.clone(),
            clients.clone(),
            auth.clone(),
            true,
        );
        let router = grpc_router(ads, ca_service.clone());
        let incoming = conn::incoming(grpc, Some(tls));
        tasks.spawn(async move {
            router
                .serve_with_incoming(incoming)
                .await
                .map_err(|source| ServeError::Serve {
                    addr: grpc_addr,
                    source,
                })
        });
    }
    if let Some(addr) = opts.plaintext_addr {
        let l = TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Listen { addr, source })?;
        let ads = ads::AdsService::new(
            mesh_rx.clone(),
            overrides_rx.clone(),
            clients.clone(),
            auth.clone(),
            false,
        );
        let router = grpc_router(ads, ca_service.clone());
        let incoming = conn::incoming(l, None);
        tasks.spawn(async move {
            router
                .serve_with_incoming(incoming)
                .await
                .map_err(|source| ServeError::Serve { addr, source })
        });
    }
    if let Some(addr) = opts.debug_addr {
        let l = TcpListener::bind(addr)
            .await
            .map_err(|source| ServeError::Listen { addr, source })?;
        let app = debug::router(debug::DebugState {
            clients,
            csr_log,
            mesh: mesh_rx,
            mesh_feed,
            tokens,
            overrides: overrides_tx,
            serving_since,
        });
        tasks.spawn(async move {
            axum::serve(l, app)
                .await
                .map_err(|source| ServeError::Listen { addr, source })
        });
    }
    tracing::info!(grpc = %grpc_addr, plaintext = ?opts.plaintext_addr, debug = ?opts.debug_addr, "devplane ready");
    // Every server runs until the process ends; the first to fail ends devplane.
    match tasks.join_next().await {
        Some(Ok(r)) => r,
        Some(Err(e)) => {
            tracing::error!(error = %e, "server task failed");
            Ok(())
        }
        None => Ok(()),
    }
}

fn grpc_router(ads: ads::AdsService, ca: ca::CaService) -> tonic::transport::server::Router {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .add_service(
            AggregatedDiscoveryServiceServer::new(ads)
                // Requests are limited as istiod limits them; responses are not.
                .max_decoding_message_size(ads::MAX_RECV_MESSAGE)
                .max_encoding_message_size(usize::MAX),
        )
        .add_service(ca.into_server())
}

/// Where a new mesh enters devplane: the file watch and `POST /debug/mesh` both publish here,
/// and every stream regenerates its resources and pushes what changed, as istiod's config
/// events do (`pilot/pkg/xds/discovery.go` `ConfigUpdate` → `Push`).
pub struct MeshFeed {
    tx: watch::Sender<Arc<Mesh>>,
    generation: AtomicU64,
}

impl MeshFeed {
    /// Publishes `mesh` to every stream; returns its generation (1 for the first change).
    pub fn publish(&self, mesh: Mesh, source: &str) -> u64 {
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(source, generation, "mesh changed; pushing");
        self.tx.send_replace(Arc::new(mesh));
        generation
    }
}

async fn watch_mesh(path: PathBuf, feed: Arc<MeshFeed>) {
    let mut last = std::fs::read(&path).ok();
    loop {
        tokio::time::sleep(MESH_POLL).await;
        if feed.tx.is_closed() {
            return;
        }
        let Ok(now) = tokio::fs::read(&path).await else {
            continue; // mid-swap or deleted; the last good mesh stays in force
        };
        if last.as_deref() == Some(now.as_slice()) {
            continue;
        }
        last = Some(now.clone());
        match Mesh::parse(&path, &String::from_utf8_lossy(&now)) {
            Ok(m) => {
                feed.publish(m, &path.display().to_string());
            }
            Err(e) => tracing::error!(error = %e, "mesh file invalid; keeping the previous mesh"),
        }
    }
}
