//! The agent's status server on `statusPort` (15020), first part (spec §7):
//! `/healthz/ready` with Istio's Envoy readiness logic and reasons, loopback-only
//! `POST /quitquitquit` and `POST /drain`, and the agent's own metrics on `/stats/prometheus`
//! and `/metrics` (merging Envoy's and the app's comes with the full status server).
//!
//! Readiness is a list of probes evaluated in order; the first failure's reason is the 503
//! body and is logged. Other subsystems add probes with [`Readiness::add`].

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{ConnectInfo, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use tokio_util::sync::CancellationToken;

use crate::config::ProxyType;
use crate::envoy::{DrainState, admin};
use crate::metrics::{Gauge, Registry};

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

/// What the status server needs.
#[derive(Clone)]
pub struct StatusState {
    pub readiness: Readiness,
    pub registry: Registry,
    pub drain: Arc<DrainState>,
    /// Cancelled by `/quitquitquit` (and by SIGTERM elsewhere).
    pub shutdown: CancellationToken,
    /// Envoy admin, for `/drain`; `None` without Envoy.
    pub envoy_admin: Option<SocketAddr>,
    pub proxy_type: ProxyType,
}

pub fn router(state: StatusState) -> axum::Router {
    axum::Router::new()
        .route("/healthz/ready", any(ready))
        .route("/quitquitquit", any(quit))
        .route("/drain", any(drain))
        .route("/stats/prometheus", any(metrics))
        .route("/metrics", any(metrics))
        .with_state(state)
}

/// Serves until `shutdown`; a bind failure is returned to the caller (startup error).
pub async fn bind(port: u16, ipv6: bool) -> std::io::Result<tokio::net::TcpListener> {
    let ip: IpAddr = if ipv6 {
        IpAddr::from(std::net::Ipv6Addr::UNSPECIFIED)
    } else {
        IpAddr::from([0, 0, 0, 0])
    };
    tokio::net::TcpListener::bind((ip, port)).await
}

pub async fn serve(
    listener: tokio::net::TcpListener,
    state: StatusState,
    stop: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(
        listener,
        router(state).into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(async move { stop.cancelled().await })
    .await
}

async fn ready(State(s): State<StatusState>) -> Response {
    match s.readiness.check().await {
        Ok(()) => (StatusCode::OK, "").into_response(),
        Err(reason) => {
            tracing::warn!("Envoy proxy is NOT ready: {reason}");
            (StatusCode::SERVICE_UNAVAILABLE, reason).into_response()
        }
    }
}

fn loopback(peer: &SocketAddr) -> bool {
    match peer.ip() {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

fn admin_guard(method: &Method, peer: &SocketAddr) -> Option<Response> {
    if method != Method::POST {
        return Some((StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n").into_response());
    }
    if !loopback(peer) {
        tracing::warn!(%peer, "refused admin request from a non-loopback address");
        return Some((StatusCode::FORBIDDEN, "only allowed from localhost\n").into_response());
    }
    None
}

async fn quit(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
) -> Response {
    if let Some(r) = admin_guard(&method, &peer) {
        return r;
    }
    tracing::info!("/quitquitquit: shutting down without draining");
    s.drain.skip_drain.store(true, Ordering::SeqCst);
    s.shutdown.cancel();
    (StatusCode::OK, "OK").into_response()
}

async fn drain(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
) -> Response {
    if let Some(r) = admin_guard(&method, &peer) {
        return r;
    }
    let Some(admin) = s.envoy_admin else {
        return (StatusCode::OK, "OK").into_response();
    };
    let path = if s.proxy_type == ProxyType::Sidecar {
        "/drain_listeners?inboundonly&graceful&skip_exit"
    } else {
        "/drain_listeners?graceful&skip_exit"
    };
    match admin::request("POST", admin, path, Duration::from_secs(5)).await {
        Ok((200, _)) => {
            tracing::info!("/drain: Envoy listeners draining");
            s.drain.drained.store(true, Ordering::SeqCst);
            (StatusCode::OK, "OK").into_response()
        }
        Ok((code, body)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Envoy drain failed: {code} {}", body.trim()),
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Envoy drain failed: {e}"),
        )
            .into_response(),
    }
}

async fn metrics(State(s): State<StatusState>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.registry.encode(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::extract::connect_info::MockConnectInfo;
    use axum::http::Request;
    use tower::ServiceExt;

    fn state() -> StatusState {
        StatusState {
            readiness: Readiness::default(),
            registry: Registry::new(),
            drain: Arc::default(),
            shutdown: CancellationToken::new(),
            envoy_admin: None,
            proxy_type: ProxyType::Sidecar,
        }
    }

    async fn call(s: StatusState, peer: &str, method: &str, path: &str) -> (StatusCode, String) {
        let peer: SocketAddr = peer.parse().unwrap();
        let app = router(s).layer(MockConnectInfo(peer));
        let resp = app
            .oneshot(
                Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn quitquitquit_is_loopback_post_only() {
        let s = state();
        assert_eq!(
            call(s.clone(), "192.0.2.9:5555", "POST", "/quitquitquit")
                .await
                .0,
            StatusCode::FORBIDDEN
        );
        assert!(!s.shutdown.is_cancelled());
        assert_eq!(
            call(s.clone(), "127.0.0.1:5555", "GET", "/quitquitquit")
                .await
                .0,
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            call(s.clone(), "[::ffff:192.0.2.9]:1", "POST", "/drain")
                .await
                .0,
            StatusCode::FORBIDDEN
        );
        let (code, body) = call(s.clone(), "[::1]:5555", "POST", "/quitquitquit").await;
        assert_eq!((code, body.as_str()), (StatusCode::OK, "OK"));
        assert!(s.shutdown.is_cancelled());
        assert!(s.drain.skip_drain.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn readiness_reports_first_failing_probe() {
        let s = state();
        assert_eq!(
            call(s.clone(), "192.0.2.9:1", "GET", "/healthz/ready")
                .await
                .0,
            StatusCode::OK
        );
        s.readiness.add(Arc::new(|| {
            Box::pin(async { Err("first reason".to_owned()) })
        }));
        s.readiness
            .add(Arc::new(|| Box::pin(async { Err("second".to_owned()) })));
        let (code, body) = call(s, "192.0.2.9:1", "GET", "/healthz/ready").await;
        assert_eq!(
            (code, body.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "first reason")
        );
    }
}
