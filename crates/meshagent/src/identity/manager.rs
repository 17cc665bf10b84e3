//! The secret manager: one task that owns the workload certificate (Istio `security/pkg/nodeagent/cache/secretcache.go`).
//!
//! Loop: take a pre-generated key → CSR → CA → publish `default` and `ROOTCA` → sleep until the
//! jittered rotation point → repeat. On failure the last valid certificate stays published and
//! the CSR is retried with per-identity backoff (0.5 s doubling to 150 s, jittered, reset on
//! success); readiness fails only once that certificate has expired (or none was ever issued).
//! The next key is generated on a blocking thread as soon as a certificate has been issued, so
//! a rotation never waits for RSA key generation (and startup does not pay for two keys).
//!
//! Time comes from [`Clock`] and `tokio::time`, so the schedule and backoff run on paused time
//! in tests.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::IdentityStatus;
use super::caclient::{CaError, CertificateAuthority};
use super::keys::{KeySpec, WorkloadKey, pem_encode};
use super::metrics::Metrics;
use super::output::OutputCerts;
use super::store::{ROOT, SecretData, SecretState, SecretStore, WORKLOAD};

/// Wall-clock time, either real or derived from tokio's (pausable) clock.
#[derive(Debug, Clone, Copy)]
pub enum Clock {
    System,
    /// `base_sys` at `base`, advancing with `tokio::time::Instant` (paused-time tests).
    Tokio {
        base_sys: SystemTime,
        base: Instant,
    },
}

impl Clock {
    pub fn tokio() -> Clock {
        Clock::Tokio {
            base_sys: SystemTime::now(),
            base: Instant::now(),
        }
    }

    pub fn now(&self) -> SystemTime {
        match self {
            Clock::System => SystemTime::now(),
            Clock::Tokio { base_sys, base } => *base_sys + base.elapsed(),
        }
    }
}

/// When to rotate (Istio `secretcache.go` `rotateTime`): `ratio' = ratio ± u·jitter` (sign from `positive`), clamped to
/// [0,1]; rotate when `ratio'` of the lifetime remains. `u` is in [0,1).
pub fn rotation_delay(
    created: SystemTime,
    expire: SystemTime,
    now: SystemTime,
    ratio: f64,
    jitter: f64,
    u: f64,
    positive: bool,
) -> Duration {
    let delta = u * jitter;
    let r = if positive {
        ratio + delta
    } else {
        ratio - delta
    }
    .clamp(0.0, 1.0);
    let lifetime = expire.duration_since(created).unwrap_or_default();
    let rotate_at = expire - lifetime.mul_f64(r);
    rotate_at.duration_since(now).unwrap_or_default()
}

/// The agent's backoff ([`crate::supervise::Backoff`]); identities use it with jitter in
/// [0.8, 1.0] of each step, so a retry is never later than `max`.
pub use crate::supervise::Backoff;

/// Per-identity CSR backoff: 0.5 s doubling to 150 s, each step scaled by [0.8, 1.0].
pub fn default_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(500), Duration::from_secs(150))
}

/// A certificate as published.
#[derive(Debug, Clone)]
struct Issued {
    expire: SystemTime,
    root: String,
}

pub struct SecretManager {
    pub ca: Arc<dyn CertificateAuthority>,
    /// The key to generate; an error fails every generation (`KeyError::EcAlgorithm`).
    pub key_spec: Result<KeySpec, super::keys::KeyError>,
    pub spiffe_id: String,
    pub ttl: Duration,
    pub grace_ratio: f64,
    pub grace_jitter: f64,
    pub store: Arc<SecretStore>,
    pub status: watch::Sender<IdentityStatus>,
    /// PCDS trust anchors merged into `ROOTCA`.
    pub anchors: watch::Receiver<Vec<String>>,
    pub output: Option<OutputCerts>,
    pub metrics: Metrics,
    pub clock: Clock,
    pub backoff: Backoff,
    /// CRL file attached to `ROOTCA` when it exists (`PILOT_ENABLE_CA_CRL`).
    pub crl: Option<std::path::PathBuf>,
    /// Where keys come from: generated off the runtime in a pod, inline in paused-time tests.
    pub keys: KeySource,
    /// Whether a certificate not (yet) written to OUTPUT_CERTS makes the agent not ready: when
    /// the files are the certificate's only consumer (no SDS server: `DISABLE_ENVOY`).
    pub output_gates_readiness: bool,
}

/// How the manager obtains workload keys.
///
/// In a pod keys are generated off the runtime thread ([`KeySource::Background`]): RSA takes
/// ~100 ms of CPU. Paused-time tests cannot use that: while the runtime waits for another OS
/// thread it has nothing to run, so Tokio auto-advances the paused clock, and a rotation
/// measured on that clock lands seconds late by however long the thread took to be
/// scheduled (a loaded CI machine showed 56 s for a 50 s schedule). [`KeySource::Inline`]
/// generates on the manager's own task, so the clock cannot move during generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KeySource {
    /// The first key raced on dedicated threads, later ones on an idle-priority thread.
    #[default]
    Background,
    /// Generated synchronously on the calling task. Only for ECDSA-sized work (well under a
    /// millisecond): it blocks the runtime while it runs.
    Inline,
}

impl KeySource {
    fn first(self, spec: KeySpec) -> KeyJob {
        match self {
            KeySource::Background => spawn_first_key(spec),
            KeySource::Inline => inline_key(spec),
        }
    }

    fn next(self, spec: KeySpec) -> KeyJob {
        match self {
            KeySource::Background => spawn_idle_key(spec),
            KeySource::Inline => inline_key(spec),
        }
    }

    fn retry(self, spec: KeySpec) -> KeyJob {
        match self {
            KeySource::Background => spawn_key(spec),
            KeySource::Inline => inline_key(spec),
        }
    }
}

/// A job already finished: the key is generated before this returns.
fn inline_key(spec: KeySpec) -> KeyJob {
    let key = WorkloadKey::generate(spec);
    tokio::spawn(std::future::ready(key))
}

type KeyJob = tokio::task::JoinHandle<Result<WorkloadKey, super::keys::KeyError>>;

fn spawn_key(spec: KeySpec) -> KeyJob {
    tokio::task::spawn_blocking(move || WorkloadKey::generate(spec))
}

/// Linux's lowest priority: such a thread gets a CPU only when nothing else wants it.
const IDLE_NICE: i32 = 19;

/// Drops the calling thread to [`IDLE_NICE`] (Linux keeps a nice value per thread).
fn lower_to_idle_priority() {
    let _ = rustix::process::setpriority_process(None, IDLE_NICE);
}

/// The key for the next rotation, generated right after a certificate is issued but hours
/// before it is needed: on a dedicated thread at nice 19. At start-up the first certificate
/// goes out while Envoy is still warming its clusters and listeners; an RSA generation at
/// normal priority then took a core from Envoy for 60–250 ms and delayed the agent's
/// readiness by as much (the startup bench's per-thread CPU, docs/benchmarks-log.md). A dedicated
/// thread, so no blocking-pool thread keeps the lowered priority; the blocking pool when no
/// thread can be started.
fn spawn_idle_key(spec: KeySpec) -> KeyJob {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let started = std::thread::Builder::new()
        .name("next-key".into())
        .spawn(move || {
            lower_to_idle_priority();
            let _ = tx.send(WorkloadKey::generate(spec));
        });
    match started {
        Ok(_) => tokio::spawn(async move {
            rx.await.unwrap_or_else(|_| {
                Err(super::keys::KeyError::Generate(
                    "key generation thread ended".into(),
                ))
            })
        }),
        Err(e) => {
            tracing::debug!(error = %e, "cannot start the next-key thread");
            spawn_key(spec)
        }
    }
}

/// The first key is on the sidecar's start-up path, and RSA generation time is a random
/// prime search (p50 ~110 ms on an idle core here, p90 ~200): with more than one CPU, two
/// generations race and the first one wins. The race must not take CPU from Envoy, which is
/// initialising at the same time and whose cluster warming waits for this key anyway: the
/// second racer runs at nice 19 (it gets the CPU only when nothing else wants it), and the
/// loser is dropped to nice 19 the moment the race is decided (it cannot be cancelled inside aws-lc; its thread ends when it
/// finishes). Both racers are dedicated threads, so no blocking-pool thread keeps the lowered
/// priority. ECDSA takes well under a millisecond and is never raced. docs/benchmarks-log.md,
/// sidecar startup, has the numbers.
fn spawn_first_key(spec: KeySpec) -> KeyJob {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if !matches!(spec.kind, super::keys::KeyKind::Rsa(_)) || cpus < 2 {
        return spawn_key(spec);
    }
    const RACERS: usize = 2;
    let (tx, mut rx) = tokio::sync::mpsc::channel(RACERS);
    let tids: Arc<std::sync::Mutex<[Option<rustix::process::Pid>; RACERS]>> = Arc::default();
    let mut started = 0;
    for i in 0..RACERS {
        let (tx, tids) = (tx.clone(), tids.clone());
        let racer = std::thread::Builder::new()
            .name(format!("first-key-{i}"))
            .spawn(move || {
                let tid = rustix::thread::gettid();
                tids.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(tid);
                if i > 0 {
                    lower_to_idle_priority();
                }
                let t = tokio::time::Instant::now();
                let key = WorkloadKey::generate(spec);
                // Logged by the receiver, once, for the winner: the loser finishes too (it
                // is only deprioritised) and would otherwise log a second "first key".
                let _ = tx.blocking_send((i, key, t.elapsed()));
            });
        match racer {
            Ok(_) => started += 1,
            Err(e) => tracing::debug!(error = %e, "cannot start a key generation racer"),
        }
    }
    drop(tx);
    if started == 0 {
        return spawn_key(spec);
    }
    tokio::spawn(async move {
        let mut failed = None;
        // A racer that has reported is ending: its thread id may soon be reused.
        let mut reported = [false; RACERS];
        while let Some((winner, r, took)) = rx.recv().await {
            reported[winner] = true;
            match r {
                Ok(k) => {
                    tracing::info!(
                        racer = winner,
                        ms = took.as_millis() as u64,
                        "first key generated"
                    );
                    let tids = *tids.lock().unwrap_or_else(|e| e.into_inner());
                    for (i, tid) in tids.iter().enumerate() {
                        if !reported[i] && tid.is_some() {
                            let _ = rustix::process::setpriority_process(*tid, IDLE_NICE);
                        }
                    }
                    return Ok(k);
                }
                Err(e) => failed = Some(e),
            }
        }
        Err(failed
            .unwrap_or_else(|| super::keys::KeyError::Generate("key generation task ended".into())))
    })
}

/// Trust-bundle merge (Istio `secretcache.go` `mergeTrustAnchorBytes`): the set of PEM certificates from all bundles, deduplicated,
/// sorted, concatenated.
pub fn merge_roots<'a>(bundles: impl IntoIterator<Item = &'a str>) -> String {
    let mut set = BTreeSet::new();
    for b in bundles {
        for der in CertificateDer::pem_slice_iter(b.as_bytes()).flatten() {
            set.insert(pem_encode("CERTIFICATE", der.as_ref()));
        }
    }
    set.into_iter().collect()
}

/// OUTPUT_CERTS retries: a full or read-only disk is usually fixed by someone else within
/// minutes, and the files are what proxyless gRPC reads its certificate from — waiting for
/// the next rotation (hours) would leave it without one.
const EXPORT_RETRY_MIN: Duration = Duration::from_millis(500);
const EXPORT_RETRY_MAX: Duration = Duration::from_secs(30);

/// A certificate set waiting to be written to OUTPUT_CERTS.
struct Export {
    /// key, chain, root (`output::FILES` order).
    contents: [String; 3],
    backoff: Backoff,
    retry_at: Instant,
    /// The last failure, while the files do not hold this set.
    failing: Option<String>,
}

impl SecretManager {
    /// Writes `export`'s set; clears it once written, else schedules the next attempt.
    async fn export(&self, export: &mut Option<Export>) {
        let (Some(out), Some(e)) = (&self.output, export.as_mut()) else {
            *export = None;
            return;
        };
        let [key, chain, root] = &e.contents;
        match out.write_workload(key, chain, root).await {
            Ok(_) => {
                if e.failing.is_some() {
                    tracing::info!(dir = %out.dir().display(), "OUTPUT_CERTS written after earlier failures");
                }
                self.metrics.output_certs_writes.inc();
                *export = None;
            }
            Err(msg) => {
                let delay = e.backoff.next_delay();
                if e.failing.as_deref() != Some(msg.as_str()) {
                    tracing::warn!(error = %msg, retry_in = %crate::logging::dur(delay), "cannot export the certificate to OUTPUT_CERTS; retrying with backoff");
                } else {
                    tracing::debug!(error = %msg, retry_in = %crate::logging::dur(delay), "OUTPUT_CERTS write failed again");
                }
                self.metrics.output_certs_write_failures.inc();
                e.failing = Some(msg);
                e.retry_at = Instant::now() + delay;
            }
        }
    }

    fn set_status(&self, f: impl FnOnce(&mut IdentityStatus)) {
        self.status.send_modify(f);
    }

    #[allow(
        clippy::disallowed_methods,
        reason = "one stat of the CRL path on tmpfs per root publication (each certificate issuance)"
    )]
    fn publish_root(&self, ca_root: &str) {
        let anchors = self.anchors.borrow().clone();
        let merged =
            merge_roots(std::iter::once(ca_root).chain(anchors.iter().map(String::as_str)));
        self.store.set(
            ROOT,
            SecretState::Ready(Arc::new(SecretData::Root {
                pem: merged,
                crl: self.crl.clone().filter(|p| p.is_file()),
            })),
        );
    }

    /// A key generation by `start`, or the spec's error as its result.
    fn key_job(&self, start: fn(KeySource, KeySpec) -> KeyJob) -> KeyJob {
        match &self.key_spec {
            Ok(spec) => start(self.keys, *spec),
            Err(e) => tokio::spawn(std::future::ready(Err(e.clone()))),
        }
    }

    /// Runs until `cancel`.
    pub async fn run(mut self, cancel: CancellationToken) {
        let mut key: Option<WorkloadKey> = None;
        let mut next = Some(self.key_job(KeySource::first));
        let mut current: Option<Issued> = None;
        let mut logged_error: Option<String> = None;
        let mut anchors_open = true;
        // The current certificate set while it is not yet in OUTPUT_CERTS.
        let mut export: Option<Export> = None;
        loop {
            if key.is_none() {
                let handle = next
                    .take()
                    .unwrap_or_else(|| self.key_job(KeySource::retry));
                let generated = tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = handle => r,
                };
                match generated {
                    Ok(Ok(k)) => key = Some(k),
                    Ok(Err(e)) => {
                        let delay = self.backoff.next_delay();
                        tracing::error!(error = %e, retry_in = %crate::logging::dur(delay), "cannot generate workload key");
                        self.set_status(|s| s.not_ready = Some(e.to_string()));
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(delay) => continue,
                        }
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "key generation task failed");
                        continue;
                    }
                }
            }
            let Some(k) = key.as_ref() else { continue };
            let result = match k.csr(&self.spiffe_id) {
                Ok(csr) => tokio::select! {
                    _ = cancel.cancelled() => return,
                    r = self.ca.sign(csr, self.ttl) => r,
                },
                Err(e) => Err(CaError::InvalidResponse(e.to_string())),
            };
            let now = self.clock.now();
            // Expired, foreign or unverifiable chains are CA failures (see `verify`).
            let result = result.and_then(|chain| {
                let issued = super::verify::verify_chain(&chain, &self.spiffe_id, now)
                    .map_err(CaError::InvalidResponse)?;
                Ok((chain, issued))
            });
            let deadline = match result {
                Ok((chain, issued)) => {
                    let expire = issued.expiry;
                    if issued.spiffe_id != self.spiffe_id {
                        tracing::warn!(requested = %self.spiffe_id, issued = %issued.spiffe_id, "the CA issued another SPIFFE ID than requested (its trust domain or the token's identity)");
                    }
                    let Some(k) = key.take() else { continue };
                    let root = chain.last().cloned().unwrap_or_default();
                    let chain_pem: String = chain.concat();
                    // Envoy first (SDS), the OUTPUT_CERTS files next: their write ends in
                    // four fsyncs (7-45 ms here), which Envoy's start-up need not wait for.
                    // Istio writes the files first (`secretcache.go` `generate`); readers of
                    // the files see the same set either way.
                    self.store.set(
                        WORKLOAD,
                        SecretState::Ready(Arc::new(SecretData::Cert {
                            chain: chain_pem.clone(),
                            key: k.pem().to_owned(),
                        })),
                    );
                    self.publish_root(&root);
                    // Served from here on: the expiry metric says so before the files are
                    // written (their write can take a while, and may fail and be retried).
                    *self
                        .metrics
                        .expiry
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = Some(expire);
                    // Where Envoy is the consumer (SDS), the certificate is in use from here
                    // on; where the files are (DISABLE_ENVOY), only once they are written.
                    if !self.output_gates_readiness {
                        self.set_status(|s| {
                            s.not_ready = None;
                            s.last_error = None;
                            s.cert_expiry = Some(expire);
                        });
                    }
                    if self.output.is_some() {
                        export = Some(Export {
                            contents: [k.pem().to_owned(), chain_pem.clone(), root.clone()],
                            backoff: Backoff::new(EXPORT_RETRY_MIN, EXPORT_RETRY_MAX),
                            retry_at: Instant::now(),
                            failing: None,
                        });
                        self.export(&mut export).await;
                    }
                    self.backoff.reset();
                    if logged_error.take().is_some() {
                        tracing::info!("CA recovered; workload certificate issued");
                    }
                    let delay = rotation_delay(
                        now,
                        expire,
                        now,
                        self.grace_ratio,
                        self.grace_jitter,
                        rand::random::<f64>(),
                        rand::random::<bool>(),
                    );
                    tracing::info!(
                        spiffe_id = %issued.spiffe_id,
                        expires_in = %crate::logging::dur(expire.duration_since(now).unwrap_or_default()),
                        rotate_in = %crate::logging::dur(delay),
                        "workload certificate issued"
                    );
                    // Key generation, the CSR and the CA call ran once for this certificate:
                    // their code and buffers can leave the resident set (crate::malloc).
                    crate::malloc::trim_soon();
                    let export_failing = export.as_ref().and_then(|e| e.failing.clone());
                    let rotate_at = now + delay;
                    self.set_status(|s| {
                        s.next_retry = None;
                        s.next_rotation = Some(rotate_at);
                        s.not_ready = export_failing
                            .as_ref()
                            .filter(|_| self.output_gates_readiness)
                            .map(|e| format!("{e} (retrying)"));
                        s.last_error = export_failing.clone();
                        s.cert_expiry = Some(expire);
                    });
                    current = Some(Issued { expire, root });
                    // The following key is generated now, long before the rotation that needs
                    // it — after this certificate is out, and at idle priority, so at startup
                    // RSA key generation competes neither with the CSR nor with Envoy's start.
                    if next.is_none() {
                        next = Some(self.key_job(KeySource::next));
                    }
                    Instant::now() + delay
                }
                Err(e) => {
                    let delay = self.backoff.next_delay();
                    let msg = e.to_string();
                    // One clear line per distinct failure, not one per retry.
                    if logged_error.as_deref() != Some(msg.as_str()) {
                        if e.is_retryable() {
                            tracing::warn!(error = %msg, retry_in = %crate::logging::dur(delay), "CSR failed; keeping the current certificate and retrying with backoff");
                        } else {
                            tracing::error!(error = %msg, retry_in = %crate::logging::dur(delay), "CSR hit a non-retryable error; keeping the current certificate and retrying with backoff");
                        }
                        logged_error = Some(msg.clone());
                    } else {
                        tracing::debug!(error = %msg, retry_in = %crate::logging::dur(delay), "CSR failed again");
                    }
                    let expired = current.as_ref().is_none_or(|c| c.expire <= now);
                    let retry_at = now + delay;
                    self.set_status(|s| {
                        s.last_error = Some(msg.clone());
                        s.next_retry = Some(retry_at);
                        if expired {
                            s.not_ready = Some(match &current {
                                None => format!("no workload certificate yet: {msg}"),
                                Some(_) => format!("workload certificate expired: {msg}"),
                            });
                        }
                    });
                    Instant::now() + delay
                }
            };
            // Wait for the rotation/retry point; PCDS anchor changes re-publish ROOTCA in the
            // meantime without touching the workload certificate, and readiness flips exactly
            // when a certificate we failed to renew expires (not at the next retry, up to 150 s
            // later).
            let expiry = current.as_ref().and_then(|c| {
                let left = c.expire.duration_since(self.clock.now()).ok()?;
                (logged_error.is_some()).then(|| Instant::now() + left)
            });
            let mut expiry_armed = expiry.is_some_and(|e| e < deadline);
            loop {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = sleep_until(deadline) => break,
                    _ = sleep_until(expiry.unwrap_or(deadline)), if expiry_armed => {
                        expiry_armed = false;
                        let last = logged_error.clone().unwrap_or_default();
                        tracing::warn!(error = %last, "workload certificate expired; the CA is still failing");
                        self.set_status(|s| s.not_ready = Some(format!("workload certificate expired: {last}")));
                    }
                    _ = sleep_until(export.as_ref().map_or(deadline, |e| e.retry_at)), if export.is_some() => {
                        self.export(&mut export).await;
                        let failing = export.as_ref().and_then(|e| e.failing.clone());
                        let gate = self.output_gates_readiness;
                        let cert_ok = logged_error.is_none();
                        self.set_status(|s| match failing {
                            Some(e) => {
                                if gate && s.not_ready.is_none() {
                                    s.not_ready = Some(format!("{e} (retrying)"));
                                }
                                s.last_error = Some(e);
                            }
                            None if cert_ok => {
                                s.not_ready = None;
                                s.last_error = None;
                            }
                            None => {}
                        });
                    }
                    r = self.anchors.changed(), if anchors_open => {
                        if r.is_err() {
                            anchors_open = false;
                        } else if let Some(c) = &current {
                            let root = c.root.clone();
                            self.publish_root(&root);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
