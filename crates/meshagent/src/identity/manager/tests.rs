//! Rotation schedule, jitter bounds and backoff on paused time, against devplane's CA code
//! signing in-process with the paused clock as "now".
#![allow(
    clippy::disallowed_methods,
    reason = "test code, not on the agent's runtime"
)]

use std::sync::Mutex;

use futures::future::BoxFuture;
use meshagent_devplane::ca::Ca;
use meshagent_devplane::token::Identity;
use tonic::Code;

use super::*;
use crate::identity::keys::KeyKind;
use crate::identity::store::Aliases;

struct FakeCa {
    ca: Ca,
    clock: Clock,
    calls: Mutex<Vec<(Instant, bool)>>,
    fail: Mutex<Option<Code>>,
    /// Issue certificates that expired long ago (a broken or malicious CA).
    expired: Mutex<bool>,
}

impl FakeCa {
    fn new(clock: Clock) -> Arc<FakeCa> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let root = params.self_signed(&key).unwrap();
        Arc::new(FakeCa {
            ca: Ca::new(&root.pem(), &key.serialize_pem()).unwrap(),
            clock,
            calls: Mutex::default(),
            fail: Mutex::default(),
            expired: Mutex::default(),
        })
    }
    fn set_fail(&self, code: Option<Code>) {
        *self.fail.lock().unwrap() = code;
    }
    fn calls(&self) -> Vec<(Instant, bool)> {
        self.calls.lock().unwrap().clone()
    }
}

impl CertificateAuthority for FakeCa {
    fn sign(&self, csr: String, ttl: Duration) -> BoxFuture<'_, Result<Vec<String>, CaError>> {
        Box::pin(async move {
            let fail = *self.fail.lock().unwrap();
            self.calls
                .lock()
                .unwrap()
                .push((Instant::now(), fail.is_none()));
            if let Some(code) = fail {
                return Err(if super::super::caclient::retryable(code) {
                    CaError::Retryable {
                        addr: "fake".into(),
                        code,
                        message: "down".into(),
                    }
                } else {
                    CaError::Rejected {
                        addr: "fake".into(),
                        code,
                        message: "no".into(),
                        hint: "fix the token",
                    }
                });
            }
            let id = Identity {
                namespace: "ns".into(),
                service_account: "sa".into(),
            };
            let mut at = self.clock.now();
            if *self.expired.lock().unwrap() {
                at -= ttl * 10;
            }
            let issued = self.ca.sign_detailed(&csr, &id, ttl, at).unwrap();
            Ok(issued.chain)
        })
    }
}

struct Running {
    ca: Arc<FakeCa>,
    store: Arc<SecretStore>,
    status: watch::Receiver<IdentityStatus>,
    _anchors: watch::Sender<Vec<String>>,
    cancel: CancellationToken,
}

fn start(ttl: Duration, jitter: f64) -> Running {
    start_with(ttl, jitter, KeyKind::EcdsaP256, KeySource::Inline)
}

fn start_with(ttl: Duration, jitter: f64, kind: KeyKind, keys: KeySource) -> Running {
    let clock = Clock::tokio();
    let ca = FakeCa::new(clock);
    let (store, _files) = SecretStore::new(Aliases::default());
    let (status_tx, status) = watch::channel(IdentityStatus::default());
    let (anchors_tx, anchors) = watch::channel(Vec::new());
    let cancel = CancellationToken::new();
    let mgr = SecretManager {
        ca: ca.clone(),
        key_spec: Ok(KeySpec { kind, pkcs8: false }),
        spiffe_id: "spiffe://cluster.local/ns/ns/sa/sa".into(),
        ttl,
        grace_ratio: 0.5,
        grace_jitter: jitter,
        store: store.clone(),
        status: status_tx,
        anchors,
        output: None,
        metrics: Metrics::register(&crate::metrics::Registry::new()).unwrap(),
        clock,
        backoff: default_backoff(),
        crl: None,
        keys,
        output_gates_readiness: false,
    };
    tokio::spawn(mgr.run(cancel.clone()));
    Running {
        ca,
        store,
        status,
        _anchors: anchors_tx,
        cancel,
    }
}

async fn until_calls(ca: &FakeCa, n: usize) -> Vec<(Instant, bool)> {
    for _ in 0..100_000 {
        let c = ca.calls();
        if c.len() >= n {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("only {} CA calls", ca.calls().len());
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[tokio::test(start_paused = true)]
async fn rotates_at_half_life_without_jitter() {
    let r = start(Duration::from_secs(100), 0.0);
    let calls = until_calls(&r.ca, 4).await;
    for w in calls.windows(2) {
        let gap = secs(w[1].0 - w[0].0);
        // X.509 NotAfter has 1 s resolution: the lifetime is 99–100 s, half of it 49.5–50 s.
        assert!((49.0..=50.5).contains(&gap), "rotation gap {gap}s");
    }
    assert!(r.store.ready(WORKLOAD).is_some() && r.store.ready(ROOT).is_some());
    assert!(r.status.borrow().not_ready.is_none());
    r.cancel.cancel();
}

/// C1: key generation off the runtime let the paused clock run on while the runtime waited
/// for the key thread (Tokio auto-advances an idle paused runtime to its next timer), so a
/// rotation measured on that clock came seconds late on a loaded machine. RSA-2048 takes
/// ~100 ms of real CPU per key: with keys made off the runtime this test saw the first CSR
/// seconds after the start and rotation gaps well past 50 s; generated inline, the paused
/// clock stands still while each key is made, whatever the machine's load.
#[tokio::test(start_paused = true)]
async fn c1_key_generation_does_not_move_the_paused_clock() {
    let t0 = Instant::now();
    let r = start_with(
        Duration::from_secs(100),
        0.0,
        KeyKind::Rsa(2048),
        KeySource::Inline,
    );
    let calls = until_calls(&r.ca, 3).await;
    assert_eq!(calls[0].0, t0, "first CSR at +{:?}", calls[0].0 - t0);
    for w in calls.windows(2) {
        let gap = secs(w[1].0 - w[0].0);
        assert!((49.0..=50.5).contains(&gap), "rotation gap {gap}s");
    }
    r.cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn failures_keep_the_old_cert_back_off_and_recover() {
    let r = start(Duration::from_secs(100), 0.0);
    until_calls(&r.ca, 1).await;
    let first = r.store.ready(WORKLOAD).expect("issued");
    let issued_gen = r.store.get(WORKLOAD).1;
    r.ca.set_fail(Some(Code::Unavailable));

    // Rotation at ~50 s fails; retries at 0.5, 1, 2, 4 … s (each × [0.8, 1.0]).
    let calls = until_calls(&r.ca, 8).await;
    let failed: Vec<Instant> = calls.iter().filter(|c| !c.1).map(|c| c.0).collect();
    let mut base = 0.5;
    for w in failed.windows(2) {
        let gap = secs(w[1] - w[0]);
        assert!(
            gap >= base * 0.8 - 0.01 && gap <= base + 0.01,
            "gap {gap}s vs base {base}s"
        );
        base *= 2.0;
    }
    // Still serving the first certificate, and still ready (it has not expired).
    assert_eq!(r.store.get(WORKLOAD).1, issued_gen);
    assert!(Arc::ptr_eq(&r.store.ready(WORKLOAD).unwrap(), &first));
    assert!(r.status.borrow().not_ready.is_none());
    assert!(
        r.status
            .borrow()
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("unavailable")
    );

    // Past expiry (100 s) readiness reports it.
    tokio::time::sleep(Duration::from_secs(120)).await;
    let reason = r
        .status
        .borrow()
        .not_ready
        .clone()
        .expect("not ready after expiry");
    assert!(reason.contains("expired"), "{reason}");

    // The CA returns: the next attempt (within one backoff step, capped at 150 s) succeeds.
    let before = r.ca.calls().len();
    r.ca.set_fail(None);
    let healed_at = Instant::now();
    let calls = until_calls(&r.ca, before + 1).await;
    assert!(calls[before].1);
    assert!(calls[before].0 - healed_at <= Duration::from_secs(150));
    assert!(r.store.get(WORKLOAD).1 > issued_gen, "new cert published");
    assert!(r.status.borrow().not_ready.is_none());

    // Backoff was reset: the next failure streak starts at 0.5 s again.
    r.ca.set_fail(Some(Code::Unavailable));
    let n = r.ca.calls().len();
    let calls = until_calls(&r.ca, n + 2).await;
    let gap = secs(calls[n + 1].0 - calls[n].0);
    assert!(
        (0.39..=0.51).contains(&gap),
        "first retry after reset {gap}s"
    );
    r.cancel.cancel();
}

/// An expired certificate from the CA used to count as success (resetting the
/// backoff: a CSR hot loop) and was served while the pod reported ready.
#[tokio::test(start_paused = true)]
async fn an_expired_certificate_from_the_ca_is_a_failure_with_backoff() {
    let r = start(Duration::from_secs(100), 0.0);
    *r.ca.expired.lock().unwrap() = true;
    // Each response is refused; attempts back off (0.5, 1, 2 … s), never a hot loop.
    let calls = until_calls(&r.ca, 5).await;
    let span = secs(calls[4].0 - calls[0].0);
    assert!(
        span >= (0.5 + 1.0 + 2.0 + 4.0) * 0.8 - 0.01,
        "5 CSRs in {span}s"
    );
    assert!(
        r.store.ready(WORKLOAD).is_none(),
        "an expired certificate was served"
    );
    let reason = r.status.borrow().not_ready.clone().unwrap();
    assert!(reason.contains("already expired"), "{reason}");
    r.cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn non_retryable_error_is_a_readiness_reason() {
    let r = start(Duration::from_secs(100), 0.0);
    r.ca.set_fail(Some(Code::Unauthenticated));
    until_calls(&r.ca, 1).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    let reason = r.status.borrow().not_ready.clone().unwrap();
    assert!(
        reason.contains("no workload certificate yet") && reason.contains("fix the token"),
        "{reason}"
    );
    assert!(r.store.ready(WORKLOAD).is_none());
    r.cancel.cancel();
}

#[test]
fn rotation_jitter_bounds() {
    let created = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
    let life = Duration::from_secs(24 * 3600);
    let expire = created + life;
    let (lo, hi) = (life.mul_f64(0.49), life.mul_f64(0.51));
    for i in 0..1000 {
        let u = f64::from(i) / 1000.0;
        for positive in [true, false] {
            let d = rotation_delay(created, expire, created, 0.5, 0.01, u, positive);
            assert!(d >= lo && d <= hi, "{d:?}");
        }
    }
    // ~12 h ± ~14.4 min: half of 24 h, ± 1 % jitter of the lifetime (Istio `rotateTime`)
    let max = rotation_delay(created, expire, created, 0.5, 0.01, 0.999_999, false);
    assert!((secs(max) - (12.0 * 3600.0 + 864.0)).abs() < 1.0);
    // clamped ratio and a deadline in the past
    assert_eq!(
        rotation_delay(created, expire, created, 0.0, 0.0, 0.0, true),
        life
    );
    assert_eq!(
        rotation_delay(created, expire, expire, 0.5, 0.0, 0.0, true),
        Duration::ZERO
    );
    assert_eq!(
        rotation_delay(created, expire, created, 1.0, 1.0, 1.0, true),
        Duration::ZERO
    );
}

#[test]
fn backoff_doubles_to_cap_with_jitter_and_resets() {
    let mut b = default_backoff();
    let mut base = 0.5f64;
    for _ in 0..20 {
        let d = secs(b.next_delay());
        let expect = base.min(150.0);
        assert!(
            d >= expect * 0.8 - 1e-9 && d <= expect + 1e-9,
            "{d} vs {expect}"
        );
        base *= 2.0;
    }
    b.reset();
    assert_eq!(b.base(), Duration::from_millis(500));
}

#[test]
fn roots_merge_dedup_sorted() {
    let mk = || {
        let key = rcgen::KeyPair::generate().unwrap();
        rcgen::CertificateParams::new(vec!["x".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem()
    };
    let (a, b) = (mk(), mk());
    let merged = merge_roots([a.as_str(), b.as_str(), a.as_str()]);
    assert_eq!(merged.matches("BEGIN CERTIFICATE").count(), 2);
    assert_eq!(merged, merge_roots([b.as_str(), a.as_str()]));
}

/// The nice value of this process's thread named `name`, if one is running.
fn nice_of_thread(name: &str) -> Option<i64> {
    std::fs::read_dir("/proc/self/task")
        .ok()?
        .flatten()
        .find_map(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            if comm.trim() != name {
                return None;
            }
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            // proc(5): `nice` is field 19; fields are counted here from `state` (field 3).
            stat.rsplit_once(") ")?
                .1
                .split_whitespace()
                .nth(16)?
                .parse()
                .ok()
        })
}

/// The key for the next rotation is generated at idle priority on its own thread, so that at
/// start-up it does not take Envoy's CPU while Envoy warms with the first certificate.
#[tokio::test]
async fn the_next_key_is_generated_on_an_idle_priority_thread() {
    let job = spawn_idle_key(KeySpec {
        kind: KeyKind::Rsa(2048),
        pkcs8: false,
    });
    let mut seen = None;
    // RSA generation takes tens of milliseconds at least: the thread is there to be seen.
    while seen.is_none() && !job.is_finished() {
        seen = nice_of_thread("next-key");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let key = job.await.unwrap().unwrap();
    assert_eq!(seen, Some(19), "the next-key thread runs at nice 19");
    assert!(key.pem().starts_with("-----BEGIN RSA PRIVATE KEY-----"));
}
