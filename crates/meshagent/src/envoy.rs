//! Runs and supervises Envoy, and drains it on shutdown (Istio `pkg/envoy/proxy.go`, `pkg/envoy/agent.go`).
//!
//! One task owns the Envoy child ([`Envoy::supervise`]). It ends when Envoy exits on its own
//! (the agent then exits with Envoy's status) or when the shutdown token fires, in which case it
//! drains per Istio's rules and then stops Envoy.

pub mod admin;
pub mod extensions;
pub mod process;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

pub use process::EnvoyArgs;

use crate::config::ProxyType;

#[derive(Debug, thiserror::Error)]
pub enum EnvoyError {
    #[error("cannot start Envoy {binary}: {source}")]
    Spawn {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("waiting for Envoy: {0}")]
    Wait(#[source] std::io::Error),
}

/// Drain decisions made through the status server (`/drain`, `/quitquitquit`), read when the
/// agent shuts down.
#[derive(Debug, Default)]
pub struct DrainState {
    /// `/drain` already drained the listeners: stop Envoy at once on shutdown.
    pub drained: AtomicBool,
    /// `/quitquitquit`: skip draining.
    pub skip_drain: AtomicBool,
    /// Shutdown has begun (readiness then reports "server is terminated").
    pub shutting_down: AtomicBool,
    /// A second SIGTERM/SIGINT: end any drain wait now and stop Envoy.
    pub abort: CancellationToken,
    /// SIGTERM/SIGINT arrived before the proxy was ever ready: the agent exits 1.
    pub signalled_before_ready: AtomicBool,
    /// What `/drain/status` reports.
    progress: std::sync::Mutex<Progress>,
    /// Listener ports whose connections don't count ([`DrainOptions::ignored_ports`]), for
    /// `/drain/status`.
    ignored_ports: std::sync::OnceLock<Vec<u16>>,
}

/// Where shutdown is (`/drain/status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// No shutdown yet.
    #[default]
    Running,
    /// Readiness fails; Envoy's listeners are not drained yet (`MESHAGENT_DRAIN_START_DELAY`).
    Withdrawing,
    /// Listeners draining; waiting out `terminationDrainDuration`.
    Draining,
    /// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS`: polling Envoy until no connection is active.
    WaitingForConnections,
    /// Envoy is being stopped (or was stopped).
    Stopping,
}

#[derive(Debug, Default)]
struct Progress {
    phase: Phase,
    /// When shutdown (or `/drain`) began.
    started: Option<tokio::time::Instant>,
    /// When the agent stops waiting for the drain and stops Envoy.
    deadline: Option<tokio::time::Instant>,
    /// The last failed drain admin call, and how many failed.
    last_admin_error: Option<String>,
    admin_failures: u32,
}

/// A snapshot of [`DrainState`]'s progress, times relative to now.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DrainSnapshot {
    pub phase: Phase,
    /// Seconds since shutdown began; `None` while running.
    pub elapsed_seconds: Option<f64>,
    /// Seconds from the start of shutdown until the drain wait ends; `None` until known.
    pub deadline_seconds: Option<f64>,
    /// Seconds left until that deadline (0 once passed).
    pub remaining_seconds: Option<f64>,
    pub last_admin_error: Option<String>,
    pub admin_failures: u32,
}

impl DrainState {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shutdown has begun: readiness fails from now on. Idempotent; the first call's time is
    /// the start of shutdown.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        let mut p = self.progress();
        if p.started.is_none() {
            p.started = Some(tokio::time::Instant::now());
        }
        if p.phase == Phase::Running {
            p.phase = Phase::Withdrawing;
        }
    }

    pub fn set_ignored_ports(&self, ports: Vec<u16>) {
        let _ = self.ignored_ports.set(ports);
    }

    pub fn ignored_ports(&self) -> &[u16] {
        self.ignored_ports.get().map_or(&[], Vec::as_slice)
    }

    pub fn set_phase(&self, phase: Phase) {
        let mut p = self.progress();
        p.started.get_or_insert_with(tokio::time::Instant::now);
        p.phase = phase;
    }

    fn set_deadline(&self, deadline: tokio::time::Instant) {
        self.progress().deadline = Some(deadline);
    }

    fn admin_failed(&self, error: String) {
        let mut p = self.progress();
        p.last_admin_error = Some(error);
        p.admin_failures += 1;
    }

    pub fn snapshot(&self) -> DrainSnapshot {
        let p = self.progress();
        let now = tokio::time::Instant::now();
        let elapsed = p.started.map(|s| now.saturating_duration_since(s));
        let deadline = p
            .started
            .zip(p.deadline)
            .map(|(s, d)| d.saturating_duration_since(s));
        DrainSnapshot {
            phase: p.phase,
            elapsed_seconds: elapsed.map(|d| d.as_secs_f64()),
            deadline_seconds: deadline.map(|d| d.as_secs_f64()),
            remaining_seconds: p
                .deadline
                .map(|d| d.saturating_duration_since(now).as_secs_f64()),
            last_admin_error: p.last_admin_error.clone(),
            admin_failures: p.admin_failures,
        }
    }
}

/// How the agent drains Envoy.
#[derive(Debug, Clone)]
pub struct DrainOptions {
    pub admin: SocketAddr,
    pub proxy_type: ProxyType,
    pub termination_drain_duration: Duration,
    pub minimum_drain_duration: Duration,
    pub exit_on_zero_active_connections: bool,
    /// Listener ports whose connections don't count (15021, 15090, secure metrics).
    pub ignored_ports: Vec<u16>,
    /// `MESHAGENT_DRAIN_START_DELAY`: readiness fails this long before the drain starts.
    pub start_delay: Duration,
}

/// The longest one drain admin call may take (an Envoy that hangs answers nothing).
const DRAIN_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// First pause between failed drain admin calls; it doubles up to [`DRAIN_RETRY_MAX`].
const DRAIN_RETRY_FIRST: Duration = Duration::from_millis(100);
const DRAIN_RETRY_MAX: Duration = Duration::from_secs(1);
/// How long Envoy has to exit after SIGTERM before it gets SIGKILL: after the drain, the
/// agent's shutdown takes at most `terminationDrainDuration` + this.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

/// Why supervision ended.
#[derive(Debug)]
pub enum Outcome {
    /// Envoy exited without being asked to.
    EnvoyExited(ExitStatus),
    /// The agent stopped Envoy after shutdown (and drain).
    Stopped(ExitStatus),
}

pub struct Envoy {
    child: Child,
    /// Removed once Envoy exits (the generated bootstrap; `None` for customConfigFile).
    bootstrap: Option<PathBuf>,
}

impl Envoy {
    /// Starts Envoy with `args` in `cwd`; its output goes to the agent's stdout/stderr.
    pub fn start(
        args: &EnvoyArgs,
        cwd: &Path,
        bootstrap: Option<PathBuf>,
    ) -> Result<Envoy, EnvoyError> {
        let argv = args.argv();
        tracing::info!(binary = %args.binary.display(), args = %argv.join(" "), "starting Envoy");
        let mut cmd = Command::new(&args.binary);
        set_parent_death_signal(&mut cmd);
        let child = cmd
            .args(&argv)
            .envs(args.env())
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            // If the agent dies, Envoy must not outlive it in the pod.
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| EnvoyError::Spawn {
                binary: args.binary.clone(),
                source,
            })?;
        Ok(Envoy { child, bootstrap })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Owns Envoy until it exits or `shutdown` fires (then drains and stops it).
    pub async fn supervise(
        mut self,
        shutdown: CancellationToken,
        drain: DrainOptions,
        state: Arc<DrainState>,
    ) -> Result<Outcome, EnvoyError> {
        let outcome = tokio::select! {
            status = self.child.wait() => {
                let status = status.map_err(EnvoyError::Wait)?;
                // Istio `pkg/envoy/agent.go`: "Envoy exited normally" at INFO for a clean exit
                // (e.g. its own /quitquitquit), an error otherwise.
                if status.success() {
                    tracing::info!("Envoy exited normally");
                } else {
                    tracing::error!("Envoy {}", process::describe(status));
                }
                Outcome::EnvoyExited(status)
            }
            _ = shutdown.cancelled() => {
                state.begin_shutdown();
                let status = self.drain_and_stop(&drain, &state).await?;
                state.set_phase(Phase::Stopping);
                Outcome::Stopped(status)
            }
        };
        if let Some(p) = self.bootstrap.take() {
            let _ = tokio::fs::remove_file(&p).await;
        }
        Ok(outcome)
    }

    async fn drain_and_stop(
        &mut self,
        d: &DrainOptions,
        state: &DrainState,
    ) -> Result<ExitStatus, EnvoyError> {
        if state.skip_drain.load(Ordering::SeqCst) || state.drained.load(Ordering::SeqCst) {
            tracing::info!("stopping Envoy without draining (already drained or /quitquitquit)");
            state.set_phase(Phase::Stopping);
            return self.stop().await;
        }
        // Readiness already fails (`begin_shutdown`); with a start delay, load balancers get
        // that long to withdraw the endpoint before the listeners start closing connections
        // (Envoy Gateway's shutdown manager does the same). Istio drains at once.
        if !d.start_delay.is_zero() {
            let drain_at = tokio::time::Instant::now() + d.start_delay;
            state.set_deadline(drain_at + d.termination_drain_duration);
            tracing::info!(delay = %crate::logging::dur(d.start_delay), "readiness fails; draining Envoy's listeners after MESHAGENT_DRAIN_START_DELAY");
            tokio::select! {
                _ = tokio::time::sleep_until(drain_at) => {}
                s = self.child.wait() => return s.map_err(EnvoyError::Wait),
                () = state.abort.cancelled() => {
                    tracing::warn!("drain aborted by a second signal");
                    state.set_phase(Phase::Stopping);
                    return self.stop().await;
                }
            }
        }
        state.set_phase(Phase::Draining);
        // Istio `pkg/envoy/admin.go` `DrainListeners`: sidecars drain inbound listeners only,
        // so the application's outbound requests keep flowing (and get no
        // `connection: close`) while the application is still running; gateways drain all.
        let path = if d.proxy_type == ProxyType::Sidecar {
            "/drain_listeners?inboundonly&graceful"
        } else {
            "/drain_listeners?graceful"
        };
        // One deadline for the whole drain: the admin call's own time (up to its timeout
        // when Envoy hangs) comes out of terminationDrainDuration instead of being added to
        // it, so shutdown takes at most terminationDrainDuration + STOP_GRACE.
        let deadline = tokio::time::Instant::now() + d.termination_drain_duration;
        // EXIT_ON_ZERO_ACTIVE_CONNECTIONS waits at least MINIMUM_DRAIN_DURATION instead.
        let call_deadline = if d.exit_on_zero_active_connections {
            deadline.max(tokio::time::Instant::now() + d.minimum_drain_duration)
        } else {
            deadline
        };
        state.set_deadline(call_deadline);
        self.request_drain(d.admin, path, call_deadline, state)
            .await;
        if d.exit_on_zero_active_connections {
            state.set_phase(Phase::WaitingForConnections);
            tokio::select! {
                r = self.wait_for_zero_connections(d) => r?,
                () = state.abort.cancelled() => tracing::warn!("drain aborted by a second signal"),
            }
        } else {
            tracing::info!(wait = %crate::logging::dur(d.termination_drain_duration), "waiting for terminationDrainDuration");
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                s = self.child.wait() => return s.map_err(EnvoyError::Wait),
                () = state.abort.cancelled() => tracing::warn!("drain aborted by a second signal"),
            }
        }
        state.set_phase(Phase::Stopping);
        self.stop().await
    }

    /// `POST <path>` to Envoy's admin, retried with backoff (100 ms doubling to 1 s) until it
    /// succeeds or `deadline` passes: one failed call (Envoy busy, a reset connection) must
    /// not leave the listeners undrained, and never ends the agent (Istio gives up after one
    /// attempt, Istio #50596, #60494). Each attempt is bounded by the time left.
    async fn request_drain(
        &mut self,
        admin: SocketAddr,
        path: &str,
        deadline: tokio::time::Instant,
        state: &DrainState,
    ) {
        let mut attempts = 0u32;
        let mut backoff = DRAIN_RETRY_FIRST;
        loop {
            attempts += 1;
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    attempts,
                    "Envoy's listeners were not drained before terminationDrainDuration ended"
                );
                return;
            }
            let timeout = left.min(DRAIN_CALL_TIMEOUT);
            match admin::request("POST", admin, path, timeout).await {
                Ok((200, _)) => {
                    tracing::info!("draining Envoy listeners ({path})");
                    return;
                }
                Ok((code, body)) => {
                    tracing::warn!(code, body = %body.trim(), attempts, "Envoy refused drain; retrying");
                    state.admin_failed(format!("POST {path}: status {code}: {}", body.trim()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, attempts, "cannot drain Envoy; retrying");
                    state.admin_failed(e.to_string());
                }
            }
            let pause = tokio::time::Instant::now() + backoff;
            backoff = (backoff * 2).min(DRAIN_RETRY_MAX);
            tokio::select! {
                _ = tokio::time::sleep_until(pause.min(deadline)) => {}
                // Envoy gone: nothing left to drain.
                _ = self.child.wait() => return,
                () = state.abort.cancelled() => return,
            }
        }
    }

    /// Istio's EXIT_ON_ZERO_ACTIVE_CONNECTIONS: wait the minimum drain, then poll every
    /// second until no downstream connection is active (or stats vanish, or 5 errors in a row).
    async fn wait_for_zero_connections(&mut self, d: &DrainOptions) -> Result<(), EnvoyError> {
        tracing::info!(min = %crate::logging::dur(d.minimum_drain_duration), "waiting for active connections to end");
        tokio::select! {
            _ = tokio::time::sleep(d.minimum_drain_duration) => {}
            s = self.child.wait() => { s.map_err(EnvoyError::Wait)?; return Ok(()); }
        }
        let mut errors = 0;
        let mut polls = 0u64;
        loop {
            polls += 1;
            match active_connections(d).await {
                Ok(Some(0)) | Ok(None) => {
                    tracing::info!("no active downstream connections; stopping Envoy");
                    return Ok(());
                }
                Ok(Some(n)) => {
                    errors = 0;
                    // Every 10 s, so a drain stuck on idle keep-alive connections is visible.
                    if polls % 10 == 1 {
                        tracing::info!(active = n, "downstream connections still active");
                    }
                }
                Err(e) => {
                    errors += 1;
                    tracing::warn!(error = %e, errors, "cannot read active connections");
                    if errors >= 5 {
                        return Ok(());
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                s = self.child.wait() => { s.map_err(EnvoyError::Wait)?; return Ok(()); }
            }
        }
    }

    /// SIGTERM (Envoy exits promptly), SIGKILL if it lingers.
    async fn stop(&mut self) -> Result<ExitStatus, EnvoyError> {
        if let Ok(Some(s)) = self.child.try_wait() {
            return Ok(s);
        }
        if let Some(pid) = self.child.id().and_then(|p| i32::try_from(p).ok()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        match tokio::time::timeout(STOP_GRACE, self.child.wait()).await {
            Ok(s) => s.map_err(EnvoyError::Wait),
            Err(_) => {
                tracing::warn!("Envoy did not exit after SIGTERM; killing it");
                let _ = self.child.start_kill();
                self.child.wait().await.map_err(EnvoyError::Wait)
            }
        }
    }
}

/// Envoy never outlives the agent: the kernel sends it SIGKILL when the agent dies, even by
/// SIGKILL and outside a container (where no pod teardown would stop it). `kill_on_drop`
/// covers only an orderly exit.
///
/// `PR_SET_PDEATHSIG` fires when the *thread* that forked dies; the agent spawns Envoy from its
/// runtime thread (the main thread on the one-thread runtime, a long-lived worker in tests).
#[allow(unsafe_code)]
fn set_parent_death_signal(cmd: &mut Command) {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the forked child before exec and calls only prctl(2) and
    // getppid(2), both async-signal-safe; it allocates nothing and touches no locks.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(std::io::Error::from)?;
            // The agent may have died between fork and prctl: then nothing would signal us.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::other(
                    "the agent exited before Envoy started",
                ));
            }
            Ok(())
        });
    }
}

/// Sum of active downstream connections on Envoy's listeners, excluding the admin, internal
/// and per-worker stats and the agent's own ports (Istio's `activeProxyConnections`).
/// `None` when Envoy reports no such stats at all.
pub async fn active_connections(d: &DrainOptions) -> Result<Option<u64>, admin::AdminError> {
    let (_, body) = admin::request(
        "GET",
        d.admin,
        "/stats?usedonly&filter=downstream_cx_active$",
        Duration::from_secs(2),
    )
    .await?;
    Ok(sum_active(&body, &d.ignored_ports))
}

fn sum_active(body: &str, ignored_ports: &[u16]) -> Option<u64> {
    let per = active_per_listener(body, ignored_ports);
    (!per.is_empty()).then(|| per.values().sum())
}

/// Active downstream connections per listener stat name (`0.0.0.0_15006`), counting what
/// `EXIT_ON_ZERO_ACTIVE_CONNECTIONS` counts: not the admin listener, not Envoy's internal
/// listeners (`listener.envoy_internal_*`, Istio 1.29 `pkg/envoy/agent.go`), not per-worker
/// stats, not the agent's own ports.
pub fn active_per_listener(
    body: &str,
    ignored_ports: &[u16],
) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    for line in body.lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim();
        let Some(listener) = name
            .strip_prefix("listener.")
            .and_then(|n| n.strip_suffix(".downstream_cx_active"))
        else {
            continue;
        };
        // The admin listener has per-thread stats too (`listener.admin.main_thread.…`),
        // which count the stats query itself.
        if listener == "admin"
            || listener.starts_with("admin.")
            || listener.starts_with("envoy_internal_")
            || listener.contains(".worker_")
            || ignored_ports
                .iter()
                .any(|p| listener.ends_with(&format!("_{p}")))
        {
            continue;
        }
        *out.entry(listener.to_owned()).or_default() += value.trim().parse::<u64>().unwrap_or(0);
    }
    out
}

/// [`active_per_listener`] read from Envoy's admin now.
pub async fn active_connections_by_listener(
    admin: SocketAddr,
    ignored_ports: &[u16],
) -> Result<std::collections::BTreeMap<String, u64>, admin::AdminError> {
    let (_, body) = admin::request(
        "GET",
        admin,
        "/stats?usedonly&filter=downstream_cx_active$",
        Duration::from_secs(2),
    )
    .await?;
    Ok(active_per_listener(&body, ignored_ports))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_only_real_listeners() {
        let body = "listener.0.0.0.0_15006.downstream_cx_active: 2\n\
                    listener.0.0.0.0_15006.worker_0.downstream_cx_active: 2\n\
                    listener.0.0.0.0_15021.downstream_cx_active: 1\n\
                    listener.admin.downstream_cx_active: 1\n\
                    listener.envoy_internal_x.downstream_cx_active: 4\n\
                    http.inbound.downstream_cx_active: 9\n\
                    listener.127.0.0.1_15001.downstream_cx_active: 3\n";
        assert_eq!(sum_active(body, &[15021, 15090]), Some(5));
        assert_eq!(sum_active("", &[15021]), None);
    }

    /// Istio 1.29: `EXIT_ON_ZERO_ACTIVE_CONNECTIONS` ignores `listener.envoy_internal_*`
    /// (connections to Envoy's internal listeners never end on their own).
    #[test]
    fn per_listener_skips_internal_admin_workers_and_own_ports() {
        let body = "listener.0.0.0.0_15006.downstream_cx_active: 2\n\
                    listener.0.0.0.0_15006.worker_1.downstream_cx_active: 2\n\
                    listener.[__]_15001.downstream_cx_active: 1\n\
                    listener.0.0.0.0_15090.downstream_cx_active: 7\n\
                    listener.envoy_internal_connect_originate.downstream_cx_active: 3\n\
                    listener.admin.downstream_cx_active: 1\n\
                    listener.admin.main_thread.downstream_cx_active: 1\n";
        let per = active_per_listener(body, &[15090]);
        assert_eq!(
            per.into_iter().collect::<Vec<_>>(),
            vec![
                ("0.0.0.0_15006".to_owned(), 2),
                ("[__]_15001".to_owned(), 1)
            ]
        );
        let only_internal = "listener.envoy_internal_x.downstream_cx_active: 3\n";
        assert_eq!(sum_active(only_internal, &[]), None);
    }
}
