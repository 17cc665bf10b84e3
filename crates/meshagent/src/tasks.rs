//! The agent's long-lived tasks, by name: spawned with a `tracing` span naming them (so every
//! log line says which task wrote it), tracked until they end, and waited for at shutdown with
//! a deadline — tasks still running then are named, and the agent exits non-zero instead of
//! hanging until the kubelet's SIGKILL (ztunnel `src/drain.rs` `run_with_drain` does the
//! same; linkerd2-proxy bounds its drain with `time::timeout(grace, drain)`).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

/// A set of named tasks. Cheap to clone; clones share the set.
#[derive(Clone, Default)]
pub struct Tasks {
    tracker: TaskTracker,
    /// Running tasks: id → name.
    running: Arc<Mutex<BTreeMap<u64, &'static str>>>,
    next: Arc<std::sync::atomic::AtomicU64>,
}

/// Removes a task's name when it ends, however it ends (return, panic, abort).
struct Registered {
    running: Arc<Mutex<BTreeMap<u64, &'static str>>>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&self.running).remove(&self.id);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Tasks {
    pub fn new() -> Tasks {
        Tasks::default()
    }

    /// Spawns `fut` as task `name`, inside a span of that name.
    pub fn spawn<F>(&self, name: &'static str, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        lock(&self.running).insert(id, name);
        let guard = Registered {
            running: self.running.clone(),
            id,
        };
        let span = tracing::info_span!("task", name);
        self.tracker.spawn(
            async move {
                let _guard = guard;
                fut.await
            }
            .instrument(span),
        )
    }

    /// Names of the tasks still running, sorted.
    pub fn running(&self) -> Vec<&'static str> {
        let mut v: Vec<_> = lock(&self.running).values().copied().collect();
        v.sort_unstable();
        v
    }

    /// Waits until every task has ended (callers bound this themselves).
    pub async fn wait_all(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Waits until every task has ended, or `deadline` passes: then the names of those still
    /// running.
    pub async fn wait(&self, deadline: Duration) -> Result<(), Vec<&'static str>> {
        self.tracker.close();
        match tokio::time::timeout(deadline, self.tracker.wait()).await {
            Ok(()) => Ok(()),
            Err(_) => Err(self.running()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn names_what_outlives_the_deadline() {
        let t = Tasks::new();
        let stop = tokio_util::sync::CancellationToken::new();
        let s = stop.clone();
        t.spawn("sds", async move { s.cancelled().await });
        t.spawn("stuck", std::future::pending::<()>());
        t.spawn("quick", async {});
        tokio::task::yield_now().await;
        assert_eq!(t.running(), vec!["sds", "stuck"]);
        stop.cancel();
        assert_eq!(t.wait(Duration::from_secs(5)).await, Err(vec!["stuck"]));
    }

    #[tokio::test(start_paused = true)]
    async fn all_done_in_time() {
        let t = Tasks::new();
        t.spawn("a", tokio::time::sleep(Duration::from_secs(1)));
        assert_eq!(t.wait(Duration::from_secs(5)).await, Ok(()));
        assert!(t.running().is_empty());
    }

    #[tokio::test]
    async fn a_panicking_task_is_not_listed() {
        let t = Tasks::new();
        let h = t.spawn("boom", async { panic!("boom") });
        assert!(h.await.is_err());
        assert!(t.running().is_empty());
    }
}
