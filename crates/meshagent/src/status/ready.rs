//! Readiness (Istio `pilot/cmd/pilot-agent/status/ready/probe.go`): probes evaluated in order, Envoy first, then the gRPC bootstrap, then
//! the DNS table; the first failure's reason is the 503 body and is logged.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::envoy::{DrainState, admin};
use crate::metrics::{Gauge, MetricsError, Registry};

use super::NameTableWatch;

/// A readiness check: `Err(reason)` when not ready.
pub type Probe =
    Arc<dyn Fn() -> futures::future::BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Envoy's readiness (Istio `pilot/cmd/pilot-agent/status/ready/probe.go`), with the "once true" caches Istio keeps.
pub struct EnvoyProbe {
    admin: SocketAddr,
    config_received: AtomicBool,
    live: AtomicBool,
    started: tokio::time::Instant,
    startup_duration: Gauge,
    drain: Arc<DrainState>,
    /// When the stats were last queried while Envoy was not ready, and the reason they gave.
    last_scan: Mutex<Option<(tokio::time::Instant, String)>>,
    /// What Envoy rejects now, once the xDS proxy runs: named in the not-ready reason.
    rejections: std::sync::OnceLock<crate::xds::XdszSource>,
    /// When the pending init targets were last logged, and what they were.
    last_wait_log: Mutex<Option<(tokio::time::Instant, String)>>,
    /// `cluster_manager.warming_clusters` at the last stats query.
    warming_clusters: std::sync::atomic::AtomicU64,
}

/// The same pending init targets are logged again after this long; a change is logged at
/// once (but not more often than [`WAIT_LOG_MIN`]). Kubelet probes every few seconds, and
/// each failed probe is already a warning line: the targets need not be repeated with each.
const WAIT_LOG_REPEAT: Duration = Duration::from_secs(60);
const WAIT_LOG_MIN: Duration = Duration::from_secs(5);
/// Deadline of the `/init_dump` query.
const INIT_DUMP_TIMEOUT: Duration = Duration::from_millis(500);

/// While Envoy is starting, how often its stats may be queried (see [`EnvoyProbe::check`]).
const STATS_INTERVAL: Duration = Duration::from_millis(100);

impl EnvoyProbe {
    pub fn new(
        admin: SocketAddr,
        started: tokio::time::Instant,
        registry: &Registry,
        drain: Arc<DrainState>,
    ) -> Result<Arc<EnvoyProbe>, MetricsError> {
        Ok(Arc::new(EnvoyProbe {
            admin,
            config_received: AtomicBool::new(false),
            live: AtomicBool::new(false),
            started,
            startup_duration: registry.gauge(
                "startup_duration_seconds",
                "The time from the process starting to being marked ready.",
            )?,
            drain,
            last_scan: Mutex::new(None),
            rejections: std::sync::OnceLock::new(),
            last_wait_log: Mutex::new(None),
            warming_clusters: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    /// Lets the not-ready reason name what Envoy rejects (the xDS proxy starts after the
    /// probe is registered).
    pub fn set_rejections(&self, source: crate::xds::XdszSource) {
        let _ = self.rejections.set(source);
    }

    /// Istio's verdict, with Istio's reason; while Envoy NACKs something the reason goes on
    /// to name it. Only the body is richer: the verdict is Istio's for the same state.
    pub async fn check(&self) -> Result<(), String> {
        let result = self.check_istio().await;
        match (&result, self.rejections.get()) {
            (Err(reason), Some(src)) if !reason.starts_with("server is terminated") => {
                let rejected = src.rejections();
                if rejected.is_empty() {
                    result
                } else {
                    Err(with_rejections(reason, &rejected))
                }
            }
            _ => result,
        }
    }

    async fn check_istio(&self) -> Result<(), String> {
        let settled =
            self.config_received.load(Ordering::Relaxed) && self.live.load(Ordering::Relaxed);
        if settled {
            return self.not_terminated();
        }
        // Envoy answers /ready without touching its stats, while the stats query scans every
        // stat on Envoy's main thread — the thread that is busy starting up. So until /ready
        // says LIVE the stats are queried at most every STATS_INTERVAL, and the reason they
        // gave is repeated in between: a probe polled every few milliseconds does not slow the
        // start-up it is waiting for.
        let live_now = matches!(
            admin::request("GET", self.admin, "/ready", Duration::from_secs(1)).await,
            Ok((200, ref body)) if body.trim() == "LIVE"
        );
        if !live_now {
            let last = self.last_scan.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((at, reason)) = &*last
                && at.elapsed() < STATS_INTERVAL
            {
                return Err(reason.clone());
            }
        }
        let mut result = self.scan().await;
        if let Err(reason) = &mut result
            && !reason.starts_with("server is terminated")
            && !reason.starts_with("failed to get readiness stats")
            && let Some(waiting) = self.waiting_for().await
        {
            self.log_waiting(&waiting);
            reason.push_str("; ");
            reason.push_str(&waiting);
        }
        if let Err(reason) = &result {
            *self.last_scan.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((tokio::time::Instant::now(), reason.clone()));
        }
        result
    }

    /// What Envoy's initialization waits for, from its admin `/init_dump` (the unready init
    /// targets of each listener): `waiting for ECDS app-ns.my-plugin (listener …), …`. Istio's
    /// reason only says the server is not live (Istio #60530: a start that hangs on an ECDS
    /// resource says nothing more). `None` when the dump names nothing or cannot be read
    /// (the reason stays Istio's).
    async fn waiting_for(&self) -> Option<String> {
        // Shorter than the stats query's second: it only adds words, and a kubelet probe's
        // own timeout is one second by default.
        let body = match admin::request("GET", self.admin, "/init_dump", INIT_DUMP_TIMEOUT).await {
            Ok((200, body)) => body,
            _ => String::new(),
        };
        describe_init_dump(&body, self.warming_clusters.load(Ordering::Relaxed))
    }

    /// One line when the pending targets change (at most every [`WAIT_LOG_MIN`]), or after
    /// [`WAIT_LOG_REPEAT`] of the same.
    fn log_waiting(&self, waiting: &str) {
        let mut last = self.last_wait_log.lock().unwrap_or_else(|e| e.into_inner());
        let due = match &*last {
            None => true,
            Some((at, text)) => {
                let since = at.elapsed();
                since >= WAIT_LOG_REPEAT || (text != waiting && since >= WAIT_LOG_MIN)
            }
        };
        if due {
            tracing::warn!("Envoy is not ready, its initialization is {waiting}");
            *last = Some((tokio::time::Instant::now(), waiting.to_owned()));
        }
    }

    fn not_terminated(&self) -> Result<(), String> {
        if self.drain.shutting_down.load(Ordering::Relaxed) {
            return Err("server is terminated".into());
        }
        Ok(())
    }

    /// Istio's checks, in its order, from one stats query.
    async fn scan(&self) -> Result<(), String> {
        // One admin request for both checks (Istio makes two): each is handled on Envoy's main
        // thread, which at start-up is busy applying the configuration being waited for.
        // Istio's stats, and the warming clusters the not-ready reason names.
        let path = "/stats?usedonly&filter=^((cluster_manager\\.cds|listener_manager\\.lds)\\.(update_success|update_rejected)|server\\.state|listener_manager\\.workers_started|cluster_manager\\.warming_clusters)$";
        let (_, body) = admin::request("GET", self.admin, path, Duration::from_secs(1))
            .await
            .map_err(|e| format!("failed to get readiness stats: {e}"))?;
        let body = body.as_str();
        self.warming_clusters.store(
            admin::stat_value(body, "cluster_manager.warming_clusters").unwrap_or(0),
            Ordering::Relaxed,
        );
        if !self.config_received.load(Ordering::Relaxed) {
            let cds = admin::stat_value(body, "cluster_manager.cds.update_success");
            let lds = admin::stat_value(body, "listener_manager.lds.update_success");
            let rejected = admin::stat_value(body, "cluster_manager.cds.update_rejected")
                .unwrap_or(0)
                + admin::stat_value(body, "listener_manager.lds.update_rejected").unwrap_or(0);
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
                        admin::stat_value(body, "cluster_manager.cds.update_rejected").unwrap_or(0),
                        lds.unwrap_or(0),
                        admin::stat_value(body, "listener_manager.lds.update_rejected")
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
        self.not_terminated()?;
        if !self.live.load(Ordering::Relaxed) {
            let state = admin::stat_value(body, "server.state");
            let workers = admin::stat_value(body, "listener_manager.workers_started");
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

/// Envoy's `/init_dump` (`envoy.admin.v3.UnreadyTargetsDumps`) in words: each pending
/// target with the listener whose initialization waits for it (Envoy lists listener init
/// managers only: `source/server/admin/init_dump_handler.cc`), Envoy's target names turned
/// into the xDS type they wait on (`FilterConfigSubscription init X` → `ECDS X`,
/// `RdsRouteConfigSubscription … X` → `RDS X`, `SdsApi X` → `SDS X`; others verbatim).
///
/// `warming_clusters` (the `cluster_manager.warming_clusters` gauge) comes first: the
/// cluster manager initializes before the listeners, and `/init_dump` does not list it.
pub fn describe_init_dump(body: &str, warming_clusters: u64) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let mut parts: Vec<String> = Vec::new();
    if warming_clusters > 0 {
        let s = if warming_clusters == 1 { "" } else { "s" };
        parts.push(format!(
            "{warming_clusters} warming cluster{s} (cluster manager: CDS/EDS)"
        ));
    }
    for dump in v["unready_targets_dumps"].as_array().into_iter().flatten() {
        // `init manager Listener-local-init-manager <listener> <hash>`.
        let manager = dump["name"].as_str().unwrap_or_default();
        let manager = manager.strip_prefix("init manager ").unwrap_or(manager);
        let owner = manager
            .strip_prefix("Listener-local-init-manager ")
            .map(|rest| {
                // `<listener name> <hash>`: the hash means nothing to an operator.
                let name = rest.rsplit_once(' ').map_or(rest, |(n, _)| n);
                format!("listener {name}")
            })
            .unwrap_or_else(|| manager.to_owned());
        for t in dump["target_names"].as_array().into_iter().flatten() {
            let Some(t) = t.as_str() else { continue };
            let what = target_words(t);
            let part = if owner.is_empty() {
                what
            } else {
                format!("{what} ({owner})")
            };
            if !parts.contains(&part) {
                parts.push(part);
            }
        }
    }
    if parts.is_empty() {
        return None;
    }
    // A bound on the body: a mesh with thousands of warming listeners names the first few.
    const SHOWN: usize = 10;
    let more = parts.len().saturating_sub(SHOWN);
    parts.truncate(SHOWN);
    let mut out = format!("waiting for {}", parts.join(", "));
    if more > 0 {
        out.push_str(&format!(" and {more} more"));
    }
    Some(out)
}

fn target_words(t: &str) -> String {
    // Envoy names a target `target <name>`, or `shared target <name>` when several listeners
    // wait on the same subscription.
    let t = t
        .strip_prefix("shared target ")
        .or_else(|| t.strip_prefix("target "))
        .unwrap_or(t);
    let (kind, rest) = if let Some(r) = t.strip_prefix("FilterConfigSubscription init ") {
        ("ECDS", r)
    } else if let Some(r) = t.strip_prefix("RdsRouteConfigSubscription init ") {
        ("RDS", r)
    } else if let Some(r) = t.strip_prefix("RdsRouteConfigSubscription ") {
        ("RDS", r)
    } else if let Some(r) = t.strip_prefix("SdsApi ") {
        ("SDS", r)
    } else {
        return t.to_owned();
    };
    format!("{kind} {rest}")
}

/// `reason`, then each standing NACK: its type, Envoy's message (which names the resources),
/// and the extensions it says are missing.
pub fn with_rejections(reason: &str, rejected: &[crate::xds::rejections::Rejection]) -> String {
    let mut out = reason.to_owned();
    for r in rejected {
        out.push_str(&format!(
            "; Envoy rejected (NACK) {}: {}",
            r.kind(),
            r.message
        ));
        if !r.missing.is_empty() {
            let names: Vec<String> = r.missing.iter().map(ToString::to_string).collect();
            out.push_str(&format!(
                "; missing extensions: {}: not in this Envoy build (the agent's error log says \
                 what to do)",
                names.join(", ")
            ));
        }
    }
    out
}

#[derive(Clone, Default)]
pub struct Readiness {
    probes: Arc<Mutex<Vec<Probe>>>,
    /// Some check has passed since start (a kubelet probe, `wait`, or the agent's own).
    ready_once: Arc<std::sync::atomic::AtomicBool>,
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
        if !self
            .ready_once
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            // Start-up is over: its transient memory and the code that ran only for it can
            // leave the resident set (src/malloc.rs, src/code_pages.rs).
            crate::malloc::trim_soon();
        }
        Ok(())
    }

    /// Whether a check has ever passed.
    pub fn ready_once(&self) -> bool {
        self.ready_once.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// gRPC bootstrap probe (Istio: `pilot/cmd/pilot-agent/status/server.go`): the file must parse as JSON, and a `file_watcher`
/// certificate provider's files must exist (proxyless gRPC would fail to start otherwise).
///
/// `required = false` accepts a missing file (a bootstrap the agent did not write); the agent
/// registers the file it writes with `required = true`.
pub async fn check_grpc_bootstrap(path: &std::path::Path, required: bool) -> Result<(), String> {
    let text = match tokio::fs::read(path).await {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => return Ok(()),
        // Istio's messages (`pilot/cmd/pilot-agent/status/grpcready/probe.go`).
        Err(e) => return Err(format!("failed loading {}: {e}", path.display())),
    };
    let v: serde_json::Value = serde_json::from_slice(&text)
        .map_err(|e| format!("failed loading {}: {e}", path.display()))?;
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
                    return Err(format!("{f} does not exist"));
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
#[allow(
    clippy::disallowed_methods,
    reason = "test code, not on the agent's runtime"
)]
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
        assert!(e.starts_with("failed loading "), "{e}");
        let cert = dir.path().join("cert-chain.pem");
        let bootstrap = serde_json::json!({
            "xds_servers": [],
            "certificate_providers": {"default": {"plugin_name": "file_watcher", "config": {
                "certificate_file": cert, "private_key_file": cert, "ca_certificate_file": cert
            }}}
        });
        std::fs::write(&path, bootstrap.to_string()).unwrap();
        let e = check_grpc_bootstrap(&path, false).await.unwrap_err();
        assert_eq!(e, format!("{} does not exist", cert.display()));
        std::fs::write(&cert, "x").unwrap();
        assert!(check_grpc_bootstrap(&path, false).await.is_ok());
    }

    /// A stand-in for Envoy's admin: `/ready` and the readiness stats, counting stats queries.
    async fn fake_admin(
        live: Arc<AtomicBool>,
        scans: Arc<std::sync::atomic::AtomicUsize>,
    ) -> SocketAddr {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                let (live, scans) = (live.clone(), scans.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0; 4096];
                    let n = c.read(&mut buf).await.unwrap_or(0);
                    let req = String::from_utf8_lossy(&buf[..n]).into_owned();
                    let live = live.load(Ordering::Relaxed);
                    let (code, body) = if req.starts_with("GET /ready") {
                        if live {
                            (200, "LIVE\n".to_owned())
                        } else {
                            (503, "PRE_INITIALIZING\n".to_owned())
                        }
                    } else if req.starts_with("GET /init_dump") {
                        (200, "{}".to_owned())
                    } else {
                        scans.fetch_add(1, Ordering::Relaxed);
                        // `usedonly`: nothing is reported before the first update.
                        let body = if live {
                            "cluster_manager.cds.update_success: 1\nlistener_manager.lds.update_success: 1\nlistener_manager.workers_started: 1\nserver.state: 0\n"
                        } else {
                            ""
                        };
                        (200, body.to_owned())
                    };
                    let resp = format!(
                        "HTTP/1.1 {code} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = c.write_all(resp.as_bytes()).await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn starting_envoy_is_not_flooded_with_stats_queries() {
        let (live, scans) = (Arc::new(AtomicBool::new(false)), Arc::default());
        let admin = fake_admin(live.clone(), Arc::clone(&scans)).await;
        let probe = EnvoyProbe::new(
            admin,
            tokio::time::Instant::now(),
            &Registry::new(),
            Arc::default(),
        )
        .unwrap();
        let t = tokio::time::Instant::now();
        for _ in 0..20 {
            let e = probe.check().await.unwrap_err();
            assert!(e.contains("config not received"), "{e}");
        }
        let n = scans.load(Ordering::Relaxed);
        // One query per STATS_INTERVAL at most while /ready is not LIVE.
        let allowed = 1 + (t.elapsed().as_millis() / STATS_INTERVAL.as_millis()) as usize;
        assert!(
            n >= 1 && n <= allowed,
            "{n} stats queries in {:?}",
            t.elapsed()
        );
        // LIVE is acted on at once, not after the interval.
        live.store(true, Ordering::Relaxed);
        probe.check().await.unwrap();
        let n = scans.load(Ordering::Relaxed);
        // Once ready, the "once true" caches end the queries.
        probe.check().await.unwrap();
        assert_eq!(scans.load(Ordering::Relaxed), n);
    }

    #[test]
    fn init_dump_in_words() {
        // As Envoy 1.40 answers while a listener waits for an ECDS resource.
        let body = r#"{"unready_targets_dumps": [
            {"name": "init manager Listener-local-init-manager 0.0.0.0_20036 1280065122545500427"},
            {"name": "init manager Listener-local-init-manager 127.0.0.1_29398 141181565622",
             "target_names": ["shared target FilterConfigSubscription init app-ns.my-plugin",
                              "target RdsRouteConfigSubscription init http.80",
                              "target SdsApi default", "target SomethingElse x"]}]}"#;
        assert_eq!(
            describe_init_dump(body, 0).unwrap(),
            "waiting for ECDS app-ns.my-plugin (listener 127.0.0.1_29398), RDS http.80 (listener \
             127.0.0.1_29398), SDS default (listener 127.0.0.1_29398), SomethingElse x \
             (listener 127.0.0.1_29398)"
        );
        assert_eq!(describe_init_dump("{}", 0), None);
        assert_eq!(describe_init_dump("not json", 0), None);
        assert_eq!(
            describe_init_dump("", 2).unwrap(),
            "waiting for 2 warming clusters (cluster manager: CDS/EDS)"
        );
        assert!(
            describe_init_dump(body, 1)
                .unwrap()
                .starts_with("waiting for 1 warming cluster (cluster manager: CDS/EDS), ECDS ")
        );
        let many: Vec<String> = (0..15).map(|i| format!("\"target SdsApi s{i}\"")).collect();
        let body = format!(
            r#"{{"unready_targets_dumps": [{{"name": "m", "target_names": [{}]}}]}}"#,
            many.join(",")
        );
        let d = describe_init_dump(&body, 0).unwrap();
        assert!(d.ends_with("SDS s9 (m) and 5 more"), "{d}");
    }

    #[test]
    fn the_reason_names_standing_nacks() {
        use crate::xds::rejections::{MissingExtension, Rejection};
        let reason = "config received from XDS server, but was rejected: cds updates: 0 successful, 1 rejected; lds updates: 1 successful, 0 rejected";
        assert_eq!(with_rejections(reason, &[]), reason);
        let r = Rejection {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            message: "Error adding/updating cluster(s) c: Didn't find ...".into(),
            missing: vec![MissingExtension {
                name: "istio.stats".into(),
                type_url: "stats.PluginConfig".into(),
            }],
        };
        assert_eq!(
            with_rejections(reason, &[r]),
            format!(
                "{reason}; Envoy rejected (NACK) CDS: Error adding/updating cluster(s) c: \
                 Didn't find ...; missing extensions: 'istio.stats' (type URL \
                 'stats.PluginConfig'): not in this Envoy build (the agent's error log says \
                 what to do)"
            )
        );
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
        assert!(r.check().await.unwrap_err().contains("failed loading"));
        std::fs::write(&path, "{}").unwrap();
        assert_eq!(
            r.check().await.unwrap_err(),
            "istio DNS capture is turned ON and DNS lookup table is not ready yet"
        );
        tx.send_replace(Some(Arc::new(crate::dns::LookupTable::default())));
        assert!(r.check().await.is_ok());
    }
}
