//! The agent's long-lived tasks, by name: spawned with a `tracing` span naming them (so every
//! log line says which task wrote it), tracked until they end, and waited for at shutdown with
//! a deadline — tasks still running then are named, and the agent exits non-zero instead of
//! hanging until the kubelet's SIGKILL (ztunnel `src/drain.rs` `run_with_drain` does the
//! same; linkerd2-proxy bounds its drain with `time::timeout(grace, drain)`).

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt as _;
use tokio_util::task::TaskTracker;
use tracing::Instrument as _;

/// A long-lived task that died by panicking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    pub task: &'static str,
    pub reason: String,
}

/// The deaths of long-lived tasks. A panicked task is a defect, and whatever it owned (the
/// certificate rotation, a file watch, the xDS upstream) no longer happens: the agent keeps
/// serving with the state it has — Envoy keeps its configuration and certificates — and
/// says so: an ERROR line, readiness fails with the task's name and panic message (so the
/// pod leaves the endpoints and an operator sees why in `kubectl describe`), and
/// `istio_agent_task_panics_total` counts them. Joining such a task's handle with
/// `let _ = t.await` alone would hide all of that.
#[derive(Debug, Clone, Default)]
pub struct Deaths(Arc<Mutex<Vec<Death>>>);

impl Deaths {
    /// The process's deaths: every task spawned through [`guarded`] or [`Tasks::spawn`].
    pub fn process() -> &'static Deaths {
        static PROCESS: std::sync::OnceLock<Deaths> = std::sync::OnceLock::new();
        PROCESS.get_or_init(Deaths::default)
    }

    pub fn all(&self) -> Vec<Death> {
        lock(&self.0).clone()
    }

    /// The readiness reason: the first death, and how many there were.
    pub fn not_ready(&self) -> Option<String> {
        let deaths = lock(&self.0);
        let first = deaths.first()?;
        let more = match deaths.len() {
            1 => String::new(),
            n => format!(" (and {} more)", n - 1),
        };
        Some(format!(
            "agent task {} died: {}{more}; the agent keeps serving with its last state, restart the pod",
            first.task, first.reason
        ))
    }

    fn record(&self, task: &'static str, reason: String) {
        tracing::error!(task, panic = %reason, "a long-lived task panicked: it no longer runs; the agent keeps serving with its last state and reports not ready");
        lock(&self.0).push(Death { task, reason });
    }

    /// Runs `fut`, recording a panic as the death of `task` before letting it unwind into
    /// the caller (a `JoinHandle` still yields the panic).
    pub async fn watch<F: Future>(&self, task: &'static str, fut: F) -> F::Output {
        match std::panic::AssertUnwindSafe(injected_panic(task, fut))
            .catch_unwind()
            .await
        {
            Ok(v) => v,
            Err(payload) => {
                self.record(task, panic_message(payload.as_ref()));
                std::panic::resume_unwind(payload)
            }
        }
    }
}

/// `fut` as long-lived task `task` of this process: its panic is recorded in
/// [`Deaths::process`].
pub async fn guarded<F: Future>(task: &'static str, fut: F) -> F::Output {
    Deaths::process().watch(task, fut).await
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}

/// Debug builds only (the test suite's binaries): `MESHAGENT_TEST_PANIC=<task>` makes that
/// task panic when it starts, so tests can check what a dead task leads to. Release builds,
/// the ones shipped, compile this away.
async fn injected_panic<F: Future>(task: &'static str, fut: F) -> F::Output {
    #[cfg(debug_assertions)]
    {
        let target = std::env::var("MESHAGENT_TEST_PANIC").unwrap_or_default();
        if target.split(',').any(|t| t == task) {
            panic!("injected by MESHAGENT_TEST_PANIC");
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = task;
    fut.await
}

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
        let span = tracing::info_span!("task", task = name);
        self.tracker.spawn(
            async move {
                let _guard = guard;
                guarded(name, fut).await
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

    /// A panic is recorded with the task's name and message, and still reaches the handle.
    #[tokio::test]
    async fn a_panic_is_recorded_as_a_death() {
        let deaths = Deaths::default();
        assert_eq!(deaths.not_ready(), None);
        let d = deaths.clone();
        let h = tokio::spawn(async move {
            d.watch("secret-manager", async { panic!("boom {}", 1) })
                .await
        });
        assert!(h.await.unwrap_err().is_panic());
        assert_eq!(
            deaths.all(),
            vec![Death {
                task: "secret-manager",
                reason: "boom 1".into()
            }]
        );
        let reason = deaths.not_ready().unwrap();
        assert!(
            reason.contains("agent task secret-manager died: boom 1"),
            "{reason}"
        );
        // A task that returns is no death.
        assert_eq!(deaths.watch("quick", async { 7 }).await, 7);
        assert_eq!(deaths.all().len(), 1);
    }

    #[tokio::test]
    async fn a_panicking_task_is_not_listed() {
        let t = Tasks::new();
        let h = t.spawn("boom", async { panic!("boom") });
        assert!(h.await.is_err());
        assert!(t.running().is_empty());
    }
}
