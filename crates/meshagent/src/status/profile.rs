//! `/debug/pprof/profile` (a CPU profile in pprof's format) and `/debug/tokioz` (the Tokio
//! runtime's metrics), both loopback-only.
//!
//! Istio's status server registers Go's `net/http/pprof` under `/debug/pprof/` when
//! `--profiling` is on (its default), each handler refusing non-loopback peers
//! (`pilot/cmd/pilot-agent/status/server.go` `handlePprofProfile`). Go's profiler is part of
//! its runtime and costs nothing until asked. Here a profile installs a `SIGPROF` handler and
//! allocates a sample buffer for its duration ([`super::sampler`]); a signal handler that
//! unwinds stacks in a sidecar is something an operator should ask for, so the CPU profiler
//! also needs `MESHAGENT_PROFILING=true`. Until a profile is requested, and after it, nothing of
//! it is installed or kept (measured in docs/benchmarks-log.md).
//!
//! `/debug/tokioz` reads counters the runtime keeps anyway, so it follows `--profiling` alone,
//! as `/debug/config_dump` does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::{ConnectInfo, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use std::net::SocketAddr;

use super::{StatusState, forbidden, json, loopback, sampler};

/// `seconds` when the request has none: Go's `net/http/pprof` `Profile` default.
pub const DEFAULT_SECONDS: u64 = 30;
/// The longest profile served: bounds how long the one profiler slot is held.
pub const MAX_SECONDS: u64 = 300;

/// What is served, from `--profiling` and `MESHAGENT_PROFILING`, and the one profiler slot.
#[derive(Clone, Default)]
pub struct Profiling {
    /// `--profiling` (default on): `/debug/tokioz`.
    pub views: bool,
    /// `--profiling` and `MESHAGENT_PROFILING=true`: `/debug/pprof/profile`.
    pub cpu: bool,
    busy: Arc<AtomicBool>,
}

impl Profiling {
    pub fn new(flag: bool, env: bool) -> Profiling {
        Profiling {
            views: flag,
            cpu: flag && env,
            busy: Arc::default(),
        }
    }
}

/// Releases the profiler slot however the request ends (done, client gone, shutdown).
struct Slot(Arc<AtomicBool>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// `seconds` from the query: absent or empty → the default; otherwise 1..=MAX_SECONDS.
pub fn seconds(query: Option<&str>) -> Result<u64, String> {
    let raw = query
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .filter(|(k, _)| *k == "seconds")
        .map(|(_, v)| v)
        .next_back();
    match raw {
        None | Some("") => Ok(DEFAULT_SECONDS),
        Some(v) => match v.parse::<u64>() {
            Ok(n) if (1..=MAX_SECONDS).contains(&n) => Ok(n),
            _ => Err(format!(
                "invalid seconds={:?}: expected a whole number of seconds from 1 to {MAX_SECONDS} (default {DEFAULT_SECONDS})\n",
                v.chars().take(32).collect::<String>()
            )),
        },
    }
}

fn text(code: StatusCode, body: impl Into<String>) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body.into(),
    )
        .into_response()
}

/// `/debug/pprof/`: what is served here, as Go's index lists its profiles.
pub async fn index(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    if !s.profiling.views {
        return StatusCode::NOT_FOUND.into_response();
    }
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    let cpu = if s.profiling.cpu {
        format!(
            "profile?seconds=N  CPU profile, gzipped profile.proto (default {DEFAULT_SECONDS}, at most {MAX_SECONDS}); read with `go tool pprof`\n"
        )
    } else {
        "profile  off: start the agent with MESHAGENT_PROFILING=true to serve CPU profiles\n"
            .to_owned()
    };
    text(
        StatusCode::OK,
        format!("/debug/pprof/\n{cpu}/debug/tokioz  Tokio runtime metrics (JSON)\n"),
    )
}

/// `/debug/pprof/profile?seconds=N`: samples every thread's CPU time at 100 Hz for N seconds
/// and answers the gzipped profile.proto Go's `net/http/pprof` serves. One at a time.
pub async fn profile(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    uri: Uri,
) -> Response {
    if !s.profiling.cpu {
        let why = if s.profiling.views {
            "CPU profiling is off: start the agent with MESHAGENT_PROFILING=true\n"
        } else {
            "CPU profiling is off: --profiling=false\n"
        };
        return text(StatusCode::NOT_FOUND, why);
    }
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    let secs = match seconds(uri.query()) {
        Ok(n) => n,
        Err(e) => return text(StatusCode::BAD_REQUEST, e),
    };
    if s.profiling
        .busy
        .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return text(
            StatusCode::CONFLICT,
            "a CPU profile is already being taken; one at a time, retry when it ends\n",
        );
    }
    let slot = Slot(s.profiling.busy.clone());
    take(secs, slot, s.shutdown.clone()).await
}

/// Profiles for `secs` seconds holding `slot`, and answers the encoded profile.
async fn take(secs: u64, slot: Slot, shutdown: tokio_util::sync::CancellationToken) -> Response {
    tracing::info!(seconds = secs, "CPU profile started");
    // Room for every sample of two busy threads (the agent's runtime and one blocking task);
    // the sampler caps it.
    let samples = usize::try_from(secs)
        .unwrap_or(usize::MAX)
        .saturating_mul(sampler::HZ * 2);
    let running = match sampler::start(samples) {
        Ok(r) => r,
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot start the CPU profiler: {e}\n"),
            );
        }
    };
    tokio::select! {
        () = tokio::time::sleep(std::time::Duration::from_secs(secs)) => {}
        () = shutdown.cancelled() => {
            return text(StatusCode::SERVICE_UNAVAILABLE, "the agent is shutting down\n");
        }
    }
    // Stopping waits for a handler still running; reading the mappings and encoding take
    // milliseconds: off the reactor thread.
    let encoded = tokio::task::spawn_blocking(move || {
        let _slot = slot;
        let samples = running.stop();
        let maps = sampler::own_mappings().map_err(|e| e.to_string())?;
        let body = gzip(&sampler::encode(&samples, &maps)).map_err(|e| e.to_string())?;
        Ok::<_, String>((body, samples.stacks.len(), samples.dropped))
    })
    .await;
    match encoded {
        Ok(Ok((body, n, dropped))) => {
            tracing::info!(
                seconds = secs,
                samples = n,
                dropped,
                bytes = body.len(),
                "CPU profile served"
            );
            (
                StatusCode::OK,
                [
                    (header::CONTENT_TYPE, "application/octet-stream"),
                    (
                        header::CONTENT_DISPOSITION,
                        "attachment; filename=\"profile\"",
                    ),
                    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
                ],
                body,
            )
                .into_response()
        }
        Ok(Err(e)) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot build the CPU profile: {e}\n"),
        ),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

/// Gzipped, as Go's `net/http/pprof` serves profile.proto.
fn gzip(raw: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(raw)?;
    gz.finish()
}

/// `/debug/tokioz`: the runtime's stable metrics (`tokio::runtime::RuntimeMetrics`).
pub async fn tokioz(
    State(s): State<StatusState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> Response {
    if !s.profiling.views {
        return StatusCode::NOT_FOUND.into_response();
    }
    if !loopback(&peer) {
        return forbidden(&peer);
    }
    json(
        StatusCode::OK,
        &tokio_metrics(&tokio::runtime::Handle::current()),
    )
}

/// Workers, alive tasks, global queue depth, and per worker its busy time and parks.
pub fn tokio_metrics(rt: &tokio::runtime::Handle) -> serde_json::Value {
    let m = rt.metrics();
    let flavor = match rt.runtime_flavor() {
        tokio::runtime::RuntimeFlavor::CurrentThread => "current_thread",
        tokio::runtime::RuntimeFlavor::MultiThread => "multi_thread",
        _ => "other",
    };
    let workers: Vec<serde_json::Value> = (0..m.num_workers())
        .map(|w| {
            serde_json::json!({
                "worker": w,
                "busySeconds": m.worker_total_busy_duration(w).as_secs_f64(),
                "parkCount": m.worker_park_count(w),
                "parkUnparkCount": m.worker_park_unpark_count(w),
            })
        })
        .collect();
    serde_json::json!({
        "flavor": flavor,
        "workers": m.num_workers(),
        "aliveTasks": m.num_alive_tasks(),
        "globalQueueDepth": m.global_queue_depth(),
        "perWorker": workers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_is_bounded_and_named() {
        assert_eq!(seconds(None), Ok(DEFAULT_SECONDS));
        assert_eq!(seconds(Some("seconds=")), Ok(DEFAULT_SECONDS));
        assert_eq!(seconds(Some("debug=1")), Ok(DEFAULT_SECONDS));
        assert_eq!(seconds(Some("seconds=5")), Ok(5));
        assert_eq!(seconds(Some("seconds=300")), Ok(300));
        for bad in [
            "seconds=0",
            "seconds=301",
            "seconds=-1",
            "seconds=x",
            "seconds=1.5",
        ] {
            let e = seconds(Some(bad)).unwrap_err();
            assert!(
                e.contains("seconds") && e.contains("1 to 300"),
                "{bad}: {e}"
            );
        }
    }
}
