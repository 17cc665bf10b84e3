//! Wasm extensions: remote modules of ECDS `TypedExtensionConfig`s (WasmPlugin resources
//! from istiod) fetched over HTTP(S) or from OCI registries, verified, cached on disk and
//! rewritten to `local.filename` before Envoy sees them (Istio `pkg/wasm`).
//!
//! * [`convert`]: the ECDS rewrite and the RBAC stand-ins of failed fetches;
//! * [`cache`]: Istio's on-disk layout, pull policies, expiry, one download per module;
//! * [`fetch`] (HTTP retries), [`oci`] (registry API, auth), [`unpack`] (gzip/tar, size
//!   limits, sha256), [`client`] (the guarded HTTP client) and [`guard`] (SSRF);
//! * [`metrics`]: the `istio_agent_wasm_*` metrics;
//! * [`view`]: `/debug/wasmz`, each module's last outcome as the converter decided it.
//!
//! Conversion runs inside the xDS stream's ECDS interceptor future, so a slow download
//! holds back only later ECDS responses (`xds/intercept.rs`), and those only until the
//! fetch's `http_uri.timeout` or until a newer response replaces the plugin being fetched
//! (`convert::Converter::convert_latest`).

pub mod cache;
pub mod client;
pub mod convert;
pub mod fetch;
pub mod guard;
pub mod metrics;
pub mod oci;
pub mod unpack;
pub mod view;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::metrics::{MetricsError, Registry};
use crate::tasks::Tasks;
use crate::xds::intercept::{Api, EcdsRewrite, InterceptError};

/// Istio's module directory (`constants.IstioDataDir`), under the agent's working directory.
pub const DATA_DIR: &str = "var/lib/istio/data";
/// The mesh root added to the system roots for HTTPS module URLs.
const MESH_ROOT: &str = "var/run/secrets/istio/root-cert.pem";

#[derive(Debug, thiserror::Error)]
pub enum WasmError {
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error("{0}")]
    Config(String),
}

/// The [`EcdsRewrite`] of the xDS proxy.
pub struct WasmRewrite {
    pub converter: Arc<convert::Converter>,
}

impl EcdsRewrite for WasmRewrite {
    fn rewrite(
        &self,
        api: Api,
        msg: Bytes,
    ) -> BoxFuture<'static, Result<Option<Bytes>, InterceptError>> {
        // Registered now, in arrival order (`Converter::convert_latest`).
        let job = self.converter.convert_latest(api == Api::Delta, &msg);
        Box::pin(async move {
            match job.await {
                Ok(convert::Converted::Forward(b)) => Ok(Some(Bytes::from(b))),
                Ok(convert::Converted::Superseded) => Ok(None),
                Err(e) => Err(InterceptError::Rejected(e)),
            }
        })
    }
}

/// Everything [`start`] builds from configuration (tests build it by hand).
pub struct WasmOptions {
    pub dir: PathBuf,
    pub cfg: crate::config::WasmConfig,
    pub mesh_root: Option<PathBuf>,
    pub docker_config: Option<PathBuf>,
}

impl WasmOptions {
    pub fn from_config(cfg: &Config, cwd: &Path) -> WasmOptions {
        WasmOptions {
            // Absolute, as pilot-agent's `/var/lib/istio/data` (`pkg/istio-agent/xds_proxy.go`
            // `NewLocalFileCache(constants.IstioDataDir)`): the module file Envoy gets over ECDS
            // names the same path in both agents' config dumps (`tests/compat_pushes.rs`).
            dir: crate::grpcxds::absolute(cwd, Path::new(DATA_DIR)),
            cfg: cfg.wasm.clone(),
            mesh_root: Some(crate::fsio::under(cwd, MESH_ROOT)),
            docker_config: cfg.wasm.docker_config.clone(),
        }
    }
}

/// Builds the converter and starts the purge task (every `WASM_PURGE_INTERVAL`).
pub fn start(
    opts: WasmOptions,
    registry: &Registry,
    tasks: &Tasks,
    shutdown: CancellationToken,
) -> Result<Arc<convert::Converter>, WasmError> {
    let metrics = metrics::Metrics::new(registry)?;
    let g = guard::Guard::new(&opts.cfg.blocked_cidrs).map_err(WasmError::Config)?;
    let client = client::Client::new(
        g,
        opts.cfg.insecure_registries.clone(),
        opts.cfg.http_request_timeout,
        opts.mesh_root.as_deref(),
    );
    let cache = cache::Cache::new(
        cache::CacheOptions {
            dir: opts.dir,
            expiry: opts.cfg.module_expiry,
            limits: fetch::Limits {
                attempts: opts.cfg.http_request_max_retries,
                max_bytes: opts.cfg.max_binary_size_bytes,
            },
            docker_config: opts.docker_config,
        },
        client,
        metrics.clone(),
    );
    let purge = cache.clone();
    // A zero interval (`WASM_PURGE_INTERVAL=0s`) would make tokio's interval panic.
    let every = opts
        .cfg
        .purge_interval
        .max(std::time::Duration::from_secs(1));
    tasks.spawn("wasm-cache-purge", async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => purge.purge().await,
            }
        }
    });
    Ok(Arc::new(convert::Converter::new(cache, metrics)))
}
