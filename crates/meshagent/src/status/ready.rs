//! Readiness (spec §7.2): probes evaluated in order, Envoy first, then the gRPC bootstrap, then
//! the DNS table; the first failure's reason is the 503 body and is logged.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::envoy::{DrainState, admin};
use crate::metrics::{Gauge, Registry};

use super::NameTableWatch;

/// A readiness check: `Err(reason)` when not ready.
pub type Probe =
    Arc<dyn Fn() -> futures::future::BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Envoy's readiness (spec §7.2), with the "once true" caches Istio keeps.
pub struct EnvoyProbe {
    admin: SocketAddr,
    config_received: AtomicBool,
    live: AtomicBool,
    started: tokio::time::Instant,
    startup_duration: Gauge,
    drain: Arc<DrainState>,
}

impl EnvoyProbe {
    pub fn new(
        admin: SocketAddr,
        started: tokio::time::Instant,
        registry: &Registry,
        drain: Arc<DrainState>,
    ) -> Arc<EnvoyProbe> {
        Arc::new(EnvoyProbe {
            admin,
            config_received: AtomicBool::new(false),
            live: AtomicBool::new(false),
            started,
            startup_duration: registry.gauge(
                "startup_duration_seconds",
                "The time from the process starting to being marked ready.",
            ),
            drain,
        })
    }

    pub async fn check(&self) -> Result<(), String> {
        if !self.config_received.load(Ordering::Relaxed) {
            let path = "/stats?usedonly&filter=^(cluster_manager\\.cds|listener_manager\\.lds)\\.(update_success|update_rejected)$";
            let (_, body) = admin::request("GET", self.admin, path, Duration::from_secs(1))
                .await
                .map_err(|e| format!("failed to get readiness stats: {e}"))?;
            let cds = admin::stat_value(&body, "cluster_manager.cds.update_success");
            let lds = admin::stat_value(&body, "listener_manager.lds.update_success");
            let rejected = admin::stat_value(&body, "cluster_manager.cds.update_rejected")
                .unwrap_or(0)
                + admin::stat_value(&body, "listener_manager.lds.update_rejected").unwrap_or(0);
            match (cds, lds) {
                (Some(c), Some(l)) if c > 0 && l > 0 => {
                    self.config_received.store(true, Ordering::Relaxed);
                }
                (None, None) if rejected == 0 => {
                    return Err("config not received from XDS server (is Istiod running?)".into());
                }
                _ if rejected > 0 => {
                    return Err(format!(
                        "config received from XDS server, but was rejected: cds updates: {} successful, {} rejected; lds updates: {} successful, {} rejected",
                        cds.unwrap_or(0),
                        admin::stat_value(&body, "cluster_manager.cds.update_rejected")
                            .unwrap_or(0),
                        lds.unwrap_or(0),
                        admin::stat_value(&body, "listener_manager.lds.update_rejected")
                            .unwrap_or(0),
                    ));
                }
                _ => {
                    return Err(format!(
                        "config not fully received from XDS server: cds updates: {}, lds updates: {}",
                        cds.unwrap_or(0),
                        lds.unwrap_or(0)
                    ));
                }
            }
        }
        if self.drain.shutting_down.load(Ordering::Relaxed) {
            return Err("server is terminated".into());
        }
        if !self.live.load(Ordering::Relaxed) {
            let path =
                "/stats?usedonly&filter=^(server\\.state|listener_manager\\.workers_started)";
            let (_, body) = admin::request("GET", self.admin, path, Duration::from_secs(3))
                .await
                .map_err(|e| format!("failed to get server info: {e}"))?;
            let state = admin::stat_value(&body, "server.state");
            let workers = admin::stat_value(&body, "listener_manager.workers_started");
            match (state, workers) {
                (Some(0), Some(1)) => {
                    self.live.store(true, Ordering::Relaxed);
                    self.startup_duration
                        .set(self.started.elapsed().as_secs_f64());
                }
                (Some(s), Some(w)) => {
                    let name = match s {
                        1 => "DRAINING",
                        2 => "PRE_INITIALIZING",
                        3 => "INITIALIZING",
                        _ => "LIVE",
                    };
                    return Err(format!(
                        "server is not live, current state is: {name}, workers started: {w}"
                    ));
                }
                _ => {
                    return Err(
                        "server.state or listener_manager.workers_started stat missing".into(),
                    );
                }
            }
        }
        Ok(())
    }
}

#[derive(Clone, Default)]
pub struct Readiness {
    probes: Arc<Mutex<Vec<Probe>>>,
}

impl Readiness {
    pub fn add(&self, probe: Probe) {
        self.probes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(probe);
    }

    pub fn add_envoy(&self, envoy: Arc<EnvoyProbe>) {
        self.add(Arc::new(move || {
            let e = envoy.clone();
            Box::pin(async move { e.check().await })
        }));
    }

    /// Runs the probes in order; the first failure wins.
    pub async fn check(&self) -> Result<(), String> {
        let probes: Vec<Probe> = self
            .probes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for p in probes {
            p().await?;
        }
        Ok(())
    }
}

/// gRPC bootstrap probe (spec §7.2 step 2): the file must parse as JSON, and a `file_watcher`
/// certificate provider's files must exist (proxyless gRPC would fail to start otherwise).
///
/// `required = false` accepts a missing file: until the agent writes the gRPC bootstrap itself
/// (Istio always does), a missing file means "not used", not "not ready".
pub async fn check_grpc_bootstrap(path: &std::path::Path, required: bool) -> Result<(), String> {
    let text = match tokio::fs::read(path).await {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => return Ok(()),
        Err(e) => {
            return Err(format!(
                "failed to read gRPC bootstrap {}: {e}",
                path.display()
            ));
        }
    };
    let v: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| format!("failed to parse gRPC bootstrap {}: {e}", path.display()))?;
    if let Some(providers) = v
        .get("certificate_providers")
        .and_then(serde_json::Value::as_object)
    {
        for p in providers.values() {
            if p.get("plugin_name").and_then(serde_json::Value::as_str) != Some("file_watcher") {
                continue;
            }
            let Some(cfg) = p.get("config") else { continue };
            for field in [
                "certificate_file",
                "private_key_file",
                "ca_certificate_file",
            ] {
                if let Some(f) = cfg.get(field).and_then(serde_json::Value::as_str)
                    && tokio::fs::metadata(f).await.is_err()
                {
                    return Err(format!(
                        "gRPC bootstrap certificate provider file {f} ({field}) does not exist"
                    ));
                }
            }
        }
    }
    Ok(())
}

impl Readiness {
    /// Step 2 of Istio's readiness.
    pub fn add_grpc_bootstrap(&self, path: PathBuf, required: bool) {
        let path = Arc::new(path);
        self.add(Arc::new(move || {
            let path = path.clone();
            Box::pin(async move { check_grpc_bootstrap(&path, required).await })
        }));
    }

    /// Step 3: with the DNS proxy on, the first name table must have arrived.
    pub fn add_dns_table(&self, table: NameTableWatch) {
        self.add(Arc::new(move || {
            let ready = table.borrow().is_some();
            Box::pin(async move {
                if ready {
                    Ok(())
                } else {
                    Err(
                        "istio DNS capture is turned ON and DNS lookup table is not ready yet"
                            .to_owned(),
                    )
                }
            })
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn grpc_bootstrap_probe() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("grpc-bootstrap.json");
        assert!(check_grpc_bootstrap(&path, false).await.is_ok());
        assert!(check_grpc_bootstrap(&path, true).await.is_err());
        std::fs::write(&path, "{not json").unwrap();
        let e = check_grpc_bootstrap(&path, false).await.unwrap_err();
        assert!(e.contains("failed to parse gRPC bootstrap"), "{e}");
        let cert = dir.path().join("cert-chain.pem");
        let bootstrap = serde_json::json!({
            "xds_servers": [],
            "certificate_providers": {"default": {"plugin_name": "file_watcher", "config": {
                "certificate_file": cert, "private_key_file": cert, "ca_certificate_file": cert
            }}}
        });
        std::fs::write(&path, bootstrap.to_string()).unwrap();
        let e = check_grpc_bootstrap(&path, false).await.unwrap_err();
        assert!(e.contains("certificate_file"), "{e}");
        std::fs::write(&cert, "x").unwrap();
        assert!(check_grpc_bootstrap(&path, false).await.is_ok());
    }

    #[tokio::test]
    async fn probes_run_in_istio_order() {
        let r = Readiness::default();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.json");
        std::fs::write(&path, "[").unwrap();
        let (tx, rx) = tokio::sync::watch::channel(None);
        r.add_grpc_bootstrap(path.clone(), false);
        r.add_dns_table(rx);
        assert!(r.check().await.unwrap_err().contains("gRPC bootstrap"));
        std::fs::write(&path, "{}").unwrap();
        assert_eq!(
            r.check().await.unwrap_err(),
            "istio DNS capture is turned ON and DNS lookup table is not ready yet"
        );
        tx.send_replace(Some(Arc::new(crate::status::NameTable::default())));
        assert!(r.check().await.is_ok());
    }
}
