//! The one rule for the agent's internal servers (SDS, the xDS proxy, later DNS): a server
//! that dies is restarted with jittered exponential backoff, and until it is serving again
//! the agent is not ready, with a reason naming it. Istio's agent only logs such a failure
//! (or exits), so a dead SDS or xDS server leaves a pod "ready" that can no longer get
//! certificates or config.
//!
//! Unix-socket servers also count as dead when their socket file is removed or replaced:
//! the listener would keep running but no client could ever reach it again. The socket files
//! are looked at when readiness is asked (kubelet's probe, which wakes the agent anyway, so
//! the look costs no wake-up of its own and a probe never answers ready over a lost socket)
//! and otherwise every [`SOCKET_CHECK`]. Istio's agent does not notice at all.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

/// Which supervised servers are down, and why. Cheap to clone; clones share the state.
#[derive(Clone, Default, Debug)]
pub struct Servers {
    down: Arc<Mutex<BTreeMap<&'static str, String>>>,
    /// The socket file each serving unix-socket server is bound to.
    sockets: Arc<Mutex<BTreeMap<&'static str, Bound>>>,
}

/// A serving server's socket file: its path, the inode it was bound as, and how to tell the
/// server's supervisor that it is lost.
#[derive(Debug)]
struct Bound {
    path: PathBuf,
    inode: u64,
    lost: Arc<tokio::sync::Notify>,
}

impl Servers {
    pub fn new() -> Servers {
        Servers::default()
    }

    /// The first down server's reason (for readiness), if any. Looks at the socket files
    /// first, so a socket removed since the last look fails this answer already.
    pub fn not_ready(&self) -> Option<String> {
        self.check_sockets();
        lock(&self.down)
            .iter()
            .next()
            .map(|(name, why)| format!("{name} server is down: {why}"))
    }

    fn set_down(&self, name: &'static str, why: String) {
        lock(&self.down).insert(name, why);
    }

    fn set_up(&self, name: &'static str) {
        lock(&self.down).remove(name);
    }

    /// Marks every server whose socket file is gone or replaced as down, and wakes its
    /// supervisor to bind it again.
    fn check_sockets(&self) {
        let mut sockets = lock(&self.sockets);
        let mut lost = vec![];
        sockets.retain(|name, b| match socket_problem(&b.path, b.inode) {
            None => true,
            Some(why) => {
                b.lost.notify_one();
                lost.push((*name, why));
                false
            }
        });
        drop(sockets);
        for (name, why) in lost {
            self.set_down(name, format!("{why}; restarting"));
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Exponential backoff with jitter, the agent's one implementation: `initial` doubling per
/// attempt up to `max`, each delay scaled by a random factor in `[jitter.0, jitter.1]` so a
/// fleet does not retry in lockstep. [`Backoff::default`] is the server restart schedule:
/// 100 ms doubling to 30 s, ±20 %, reset after a minute of serving. The identity module uses
/// the same type with its own schedule (`identity::manager::default_backoff`).
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    jitter: (f64, f64),
    attempt: u32,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff::new(Duration::from_millis(100), Duration::from_secs(30)).jitter(0.8, 1.2)
    }
}

impl Backoff {
    /// `initial` doubling to `max` (at least `initial`), jitter `[0.8, 1.0]` until
    /// [`Backoff::jitter`] says otherwise.
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max: max.max(initial),
            jitter: (0.8, 1.0),
            attempt: 0,
        }
    }

    /// Scales each delay by a random factor in `[lo, hi]`.
    pub fn jitter(mut self, lo: f64, hi: f64) -> Backoff {
        self.jitter = (lo.min(hi), hi.max(lo));
        self
    }

    /// The un-jittered step the next attempt uses.
    pub fn base(&self) -> Duration {
        let factor = 2u32.saturating_pow(self.attempt.min(20));
        self.initial.saturating_mul(factor).min(self.max)
    }

    /// The next delay, jittered; the one after it doubles.
    pub fn next_delay(&mut self) -> Duration {
        let (lo, hi) = self.jitter;
        let d = self.base().mul_f64(lo + (hi - lo) * rand::random::<f64>());
        self.attempt = self.attempt.saturating_add(1);
        d
    }

    /// Back to `initial`.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// How long a server must serve before its backoff resets.
const HEALTHY_AFTER: Duration = Duration::from_secs(60);
/// How often a unix socket's file is checked when nothing asks for readiness. Each check is a
/// wake-up of an otherwise idle agent (with tokio's timer wheel, three: a long timer is
/// re-filed into finer levels as its deadline nears), and wake-ups are all of the idle agent's
/// CPU (docs/benchmarks-log.md, "Idle CPU"). In a pod kubelet's readiness probe checks far
/// more often, at no extra wake-up ([`Servers::not_ready`]); this is the bound without one (a
/// socket removed under an agent nobody probes is rebound within a minute; Istio's agent does
/// not notice at all, and Envoy retries its SDS and xDS connections with backoff meanwhile).
/// inotify would make it free, but instances are limited per user (128 by default) and
/// shared by every agent of a node running as 1337.
const SOCKET_CHECK: Duration = Duration::from_secs(60);

/// A bound server: the future that serves until it ends, and (for unix sockets) the socket
/// file that must keep existing with the inode bound.
pub struct Serving {
    pub serve: BoxFuture<'static, Result<(), String>>,
    pub socket: Option<PathBuf>,
}

/// Runs `start` (bind, then serve) until `stop`, restarting it under the rule above.
pub async fn run<F, Fut>(
    name: &'static str,
    servers: Servers,
    backoff: Backoff,
    stop: CancellationToken,
    mut start: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Serving, String>>,
{
    let mut backoff = backoff;
    loop {
        let why = match start().await {
            Err(e) => format!("cannot start: {e}"),
            Ok(Serving { serve, socket }) => {
                servers.set_up(name);
                let inode = match &socket {
                    Some(p) => inode_of(p),
                    None => None,
                };
                let lost = Arc::new(tokio::sync::Notify::new());
                if let (Some(path), Some(inode)) = (&socket, inode) {
                    let bound = Bound {
                        path: path.clone(),
                        inode,
                        lost: lost.clone(),
                    };
                    lock(&servers.sockets).insert(name, bound);
                }
                let started = tokio::time::Instant::now();
                let why = tokio::select! {
                    () = stop.cancelled() => None,
                    r = serve => match r {
                        Ok(()) if stop.is_cancelled() => None,
                        Ok(()) => Some("stopped unexpectedly".to_owned()),
                        Err(e) => Some(e),
                    },
                    why = socket_lost(socket.clone(), inode, &lost) => Some(why),
                };
                // Stopping (the agent shuts down and may remove the socket) or restarting:
                // either way the file is no longer this server's to check.
                lock(&servers.sockets).remove(name);
                let Some(why) = why else { return };
                if started.elapsed() >= HEALTHY_AFTER {
                    backoff.reset();
                }
                why
            }
        };
        if stop.is_cancelled() {
            return;
        }
        let wait = backoff.next_delay();
        tracing::error!(server = name, error = %why, restart_in = %crate::logging::dur(wait), "server down; restarting");
        servers.set_down(name, format!("{why}; restarting"));
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// The inode at `p` (not following a symlink), by a synchronous `lstat` on the runtime thread.
///
/// The exception to "blocking I/O goes to the blocking pool" is deliberate: the path is the
/// agent's own socket, which it just bound in its own local directory (an emptyDir), so the
/// lookup is answered from the dentry cache in about a microsecond and never waits on a
/// device. Through the blocking pool (`tokio::fs`) each check was a thread hand-off — two
/// futex wake-ups, an eventfd write and an extra runtime wake-up, ~10 syscalls and three
/// context switches — per check per agent; idle proxyless agents spent most of their CPU
/// on it (docs/benchmarks-log.md, "Proxyless gRPC at scale").
#[allow(
    clippy::disallowed_methods,
    reason = "one lstat of the agent's own socket per readiness check or minute, cheaper than a blocking-pool hand-off (ARCHITECTURE.md, Runtime policy)"
)]
fn inode_of(p: &std::path::Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(p).ok().map(|m| m.ino())
}

/// Why the socket file at `path` no longer reaches the listener bound as `inode`, if it does not.
fn socket_problem(path: &std::path::Path, inode: u64) -> Option<String> {
    match inode_of(path) {
        Some(i) if i == inode => None,
        Some(_) => Some(format!("socket {} was replaced", path.display())),
        None => Some(format!("socket {} was removed", path.display())),
    }
}

/// Resolves when the socket file is gone or is another file than the one bound, as found
/// every [`SOCKET_CHECK`] or by a readiness check (`lost`); never for servers without a
/// socket file.
async fn socket_lost(
    socket: Option<PathBuf>,
    inode: Option<u64>,
    lost: &tokio::sync::Notify,
) -> String {
    let Some(path) = socket else {
        return std::future::pending().await;
    };
    // Gone already between bind and the first look.
    let Some(inode) = inode else {
        return format!("socket {} was removed", path.display());
    };
    loop {
        tokio::select! {
            () = tokio::time::sleep(SOCKET_CHECK) => {}
            () = lost.notified() => {}
        }
        if let Some(why) = socket_problem(&path, inode) {
            return why;
        }
    }
}

/// A random factor in `[1 - spread, 1 + spread]`: the jitter of every backoff in the agent.
pub(crate) fn jitter_factor(spread: f64) -> f64 {
    1.0 + spread * (2.0 * rand::random::<f64>() - 1.0)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::disallowed_methods,
        reason = "test code, not on the agent's runtime"
    )]
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn server_backoff_doubles_to_thirty_seconds_within_twenty_percent_and_resets() {
        let mut b = Backoff::default();
        let mut base = 0.1f64;
        for _ in 0..16 {
            let d = b.next_delay().as_secs_f64();
            let expect = base.min(30.0);
            assert!(
                d >= expect * 0.8 - 1e-9 && d <= expect * 1.2 + 1e-9,
                "{d} vs {expect}"
            );
            base *= 2.0;
        }
        b.reset();
        assert_eq!(b.base(), Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_server_is_restarted_and_not_ready_meanwhile() {
        let servers = Servers::new();
        let stop = CancellationToken::new();
        let starts = Arc::new(AtomicU32::new(0));
        let (die_tx, die_rx) = tokio::sync::watch::channel(0u32);
        let s = starts.clone();
        let task = tokio::spawn(run(
            "sds",
            servers.clone(),
            Backoff::default(),
            stop.clone(),
            move || {
                let n = s.fetch_add(1, Ordering::SeqCst) + 1;
                let mut die = die_rx.clone();
                async move {
                    if n == 2 {
                        return Err("address in use".to_owned());
                    }
                    Ok(Serving {
                        serve: Box::pin(async move {
                            let _ = die.wait_for(|d| *d >= n).await;
                            Err(format!("accept failed ({n})"))
                        }),
                        socket: None,
                    })
                }
            },
        ));
        tokio::task::yield_now().await;
        assert_eq!(starts.load(Ordering::SeqCst), 1);
        assert_eq!(servers.not_ready(), None);

        die_tx.send_replace(1);
        tokio::time::sleep(Duration::from_millis(10)).await;
        let r = servers.not_ready().unwrap();
        assert!(
            r.contains("sds server is down: accept failed (1); restarting"),
            "{r}"
        );
        // First restart fails to bind; the second (after a doubled delay) serves again.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(starts.load(Ordering::SeqCst), 3);
        assert_eq!(servers.not_ready(), None);

        stop.cancel();
        task.await.unwrap();
    }

    /// Supervises, as `name`, a unix-socket server that binds `path` (removing what is there)
    /// and serves until stopped; returns how many times it was started, and the supervisor.
    fn socket_server(
        name: &'static str,
        servers: &Servers,
        stop: &CancellationToken,
        path: &std::path::Path,
    ) -> (Arc<AtomicU32>, tokio::task::JoinHandle<()>) {
        let starts = Arc::new(AtomicU32::new(0));
        let (s, p) = (starts.clone(), path.to_owned());
        let task = tokio::spawn(run(
            name,
            servers.clone(),
            Backoff::default(),
            stop.clone(),
            move || {
                s.fetch_add(1, Ordering::SeqCst);
                let p = p.clone();
                async move {
                    let _ = std::fs::remove_file(&p);
                    let l = tokio::net::UnixListener::bind(&p).map_err(|e| e.to_string())?;
                    Ok(Serving {
                        serve: Box::pin(async move {
                            let _l = l;
                            std::future::pending().await
                        }),
                        socket: Some(p),
                    })
                }
            },
        ));
        (starts, task)
    }

    #[tokio::test]
    async fn a_removed_socket_counts_as_dead() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock");
        let servers = Servers::new();
        let stop = CancellationToken::new();
        let (starts, task) = socket_server("xds-proxy", &servers, &stop, &path);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while starts.load(Ordering::SeqCst) < 1 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(servers.not_ready(), None);
        std::fs::remove_file(&path).unwrap();
        // The next readiness check finds it at once, and wakes the supervisor.
        let r = servers
            .not_ready()
            .expect("not ready over a removed socket");
        assert!(
            r.contains("xds-proxy server is down: socket") && r.contains("was removed"),
            "{r}"
        );
        while starts.load(Ordering::SeqCst) < 2 {
            assert!(tokio::time::Instant::now() < deadline, "not restarted");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Bound again: the socket is back.
        while !path.exists() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "socket not re-created"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.cancel();
        task.await.unwrap();
    }

    /// Without readiness checks the socket file is looked at once a [`SOCKET_CHECK`], not
    /// more often (each look is a wake-up of an idle agent), and a removed one is still found.
    #[tokio::test(start_paused = true)]
    async fn without_readiness_checks_a_removed_socket_is_found_within_the_check_period() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock");
        let servers = Servers::new();
        let stop = CancellationToken::new();
        let (starts, task) = socket_server("sds", &servers, &stop, &path);
        while starts.load(Ordering::SeqCst) < 1 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        std::fs::remove_file(&path).unwrap();
        tokio::time::sleep(SOCKET_CHECK - Duration::from_secs(1)).await;
        assert_eq!(starts.load(Ordering::SeqCst), 1, "looked before the period");
        // The check, then the restart's backoff (at most 120 ms).
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(starts.load(Ordering::SeqCst), 2, "not restarted");
        assert!(path.exists(), "socket not bound again");
        assert_eq!(servers.not_ready(), None);
        stop.cancel();
        task.await.unwrap();
    }
}
