//! The field-failure suite: one test per scenario of the agent's field lessons (F1–F21) that
//! applies to what exists, named after its scenario. docs/testing.md "Field-failure suite" maps
//! every scenario to its test (some are proven by tests elsewhere, named there) and lists those
//! that do not apply. The peers are real: devplane as istiod (ADS + CA over TLS), real Envoy, the
//! agent binary as a pod runs it or its modules in-process, and loopback TCP relays that
//! black-hole or reset the path to istiod.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod xds_support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use meshagent_proto::type_url;
use meshagent_testkit::{
    DEADLINE, Devplane, Sidecar, TwoWorkloads, Value, http_get, json, kubelet, wait_for,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use xds_support::*;

// === a loopback relay to istiod that can black-hole or reset the path ===

/// A TCP relay on loopback in front of devplane's gRPC port. While black-holed it accepts
/// connections and never answers (as a dropped path looks to the agent); forwarding, it
/// relays bytes both ways. It counts connections and can reset every forwarded one, or reset
/// the current one once `arm_reset_after` more bytes have gone towards the agent.
struct Relay {
    addr: SocketAddr,
    forward: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    forwarded: Arc<AtomicUsize>,
    open: Arc<AtomicUsize>,
    reset_at: Arc<AtomicU64>,
    downstream_bytes: Arc<AtomicU64>,
    reset_now: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    async fn start(upstream: SocketAddr, forward: bool) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut r = Relay {
            addr,
            forward: Arc::new(AtomicBool::new(forward)),
            accepted: Arc::default(),
            forwarded: Arc::default(),
            open: Arc::default(),
            reset_at: Arc::new(AtomicU64::new(u64::MAX)),
            downstream_bytes: Arc::default(),
            reset_now: Arc::new(Notify::new()),
            task: tokio::spawn(async {}),
        };
        let (fwd, accepted, forwarded, open) = (
            r.forward.clone(),
            r.accepted.clone(),
            r.forwarded.clone(),
            r.open.clone(),
        );
        let (reset_at, down, reset_now) = (
            r.reset_at.clone(),
            r.downstream_bytes.clone(),
            r.reset_now.clone(),
        );
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                if !fwd.load(Ordering::SeqCst) {
                    // Black hole: keep the socket open, never read or answer.
                    held.push(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                forwarded.fetch_add(1, Ordering::SeqCst);
                let (open, reset_at, down, reset_now) = (
                    open.clone(),
                    reset_at.clone(),
                    down.clone(),
                    reset_now.clone(),
                );
                tokio::spawn(async move {
                    open.fetch_add(1, Ordering::SeqCst);
                    pipe(client, server, reset_at, down, reset_now).await;
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        r.task = task;
        r
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    fn forwarded(&self) -> usize {
        self.forwarded.load(Ordering::SeqCst)
    }

    fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    fn restore(&self) {
        self.forward.store(true, Ordering::SeqCst);
    }

    /// Resets the forwarded connection once `n` more bytes have been relayed to the agent.
    fn arm_reset_after(&self, n: u64) {
        let now = self.downstream_bytes.load(Ordering::SeqCst);
        self.reset_at.store(now + n, Ordering::SeqCst);
    }
}

/// Relays until either side closes, or resets both (RST, linger 0) at the armed byte count.
async fn pipe(
    client: TcpStream,
    server: TcpStream,
    reset_at: Arc<AtomicU64>,
    down: Arc<AtomicU64>,
    reset_now: Arc<Notify>,
) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let up = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if sw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    let downward = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match sr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let total = down.fetch_add(n as u64, Ordering::SeqCst) + n as u64;
                    if total >= reset_at.load(Ordering::SeqCst) {
                        reset_at.store(u64::MAX, Ordering::SeqCst);
                        reset_now.notify_waiters();
                        return;
                    }
                    if cw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = downward => {}
    }
    // Dropping the halves closes both sockets; with linger 0 the close is a reset.
    let rst = nix::libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    for s in [cr.reunite(cw), sr.reunite(sw)].into_iter().flatten() {
        let _ = nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Linger, &rst);
    }
}

// === helpers for the agent binary ===

/// The agent's readiness: status code and body (0 when the status port does not answer).
async fn ready(sc: &Sidecar) -> (u16, String) {
    http_get(sc.status, "/healthz/ready")
        .await
        .unwrap_or((0, String::new()))
}

/// One series of the agent's merged `/stats/prometheus` on its status port.
async fn agent_metric(sc: &Sidecar, series: &str) -> f64 {
    let Ok((200, body)) = http_get(sc.status, "/stats/prometheus").await else {
        return 0.0;
    };
    body.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0.0)
}

/// The agent's Envoy (its only child process).
fn envoy_pid(agent: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{agent}/task/{agent}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn send_signal(pid: u32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).unwrap();
}

async fn wait_exit(sc: &mut Sidecar, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = sc.proc.try_wait() {
            return st;
        }
        assert!(
            Instant::now() < deadline,
            "agent did not exit in {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// devplane's CSR log, oldest first.
async fn csr_records(dp: &Devplane) -> Vec<Value> {
    dp.debug_json("/debug/csr")
        .await
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// A CSR record's time (devplane logs `YYYY-MM-DDTHH:MM:SS.mmmZ`) as seconds of the day.
fn record_secs(r: &Value) -> f64 {
    let t = r["time"].as_str().unwrap();
    let hms = &t[11..t.len() - 1];
    let mut parts = hms.split(':');
    let h: f64 = parts.next().unwrap().parse().unwrap();
    let m: f64 = parts.next().unwrap().parse().unwrap();
    let s: f64 = parts.next().unwrap().parse().unwrap();
    h * 3600.0 + m * 60.0 + s
}

/// The SPIFFE workload a sidecar here runs as.
const SPIFFE_A: &str = "spiffe://cluster.local/ns/default/sa/a";

// === F1 ===

/// F1: istiod black-holed at start (connections accepted, never answered), then restored.
/// The agent neither hangs on the dead path nor spins: every dial gives up (connect timeout),
/// `istiod_connection_failures` counts them, readiness is 503 with a reason, and once the
/// path is back the pod is ready within one retry step.
#[tokio::test(flavor = "multi_thread")]
async fn f01_istiod_blackholed_at_start_then_restored() {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let relay = Relay::start(dp.grpc_addr, false).await;
    let istiod = format!("localhost:{}", relay.addr.port());
    let mut sc = Sidecar::start_with(
        &dp,
        "a",
        "default",
        "a",
        &[("CA_ADDR", istiod.clone())],
        json!({"discoveryAddress": istiod}),
    )
    .await;

    // The xDS dial through the black hole fails (it does not wait forever) and is counted.
    let failures = wait_for(
        "istiod_connection_failures while black-holed",
        Duration::from_secs(30),
        || async {
            let n = agent_metric(&sc, "istio_agent_istiod_connection_failures").await;
            (n >= 1.0).then_some(n)
        },
    )
    .await;
    let (code, body) = ready(&sc).await;
    assert_eq!(code, 503, "not ready while istiod is unreachable: {body}");
    assert!(!body.trim().is_empty(), "readiness names a reason");
    assert!(relay.accepted() >= 2, "CA and xDS both dialled");
    // No hot loop: the dials are spaced by timeouts and backoff.
    let spent = sc.proc.started.elapsed().as_secs_f64();
    assert!(
        (relay.accepted() as f64) < 4.0 * spent + 10.0,
        "{} dials in {spent:.1}s",
        relay.accepted()
    );
    eprintln!("black-holed: {failures} xDS failures, readiness {code}: {body}");

    relay.restore();
    let restored = Instant::now();
    // The CA dial in flight gives up after its 5 s connect timeout; the next one (after the
    // retry step) and Envoy's next ADS attempt succeed.
    sc.wait_ready(Duration::from_secs(40)).await;
    let took = restored.elapsed();
    eprintln!("ready {took:?} after the path was restored");
    assert!(relay.forwarded() >= 2, "CA and xDS through the relay");
    assert_eq!(sc.spiffe_ids().await, vec![SPIFFE_A.to_owned()]);
    assert!(sc.proc.try_wait().is_none(), "agent still running");
}

// === F2 ===

/// F2: the CA rejects the CSR (`Unauthenticated`). It is not retried in-call, the manager
/// backs off exponentially with jitter (0.5 s doubling, each step × [0.8, 1.0], as measured by
/// the CA's own arrival times), readiness names the error and the likely cause, and the pod
/// recovers once the cause is fixed. The full status matrix (which codes are retried, hints
/// for `Unimplemented`/`InvalidArgument`) and the 150 s cap are proven in the unit tests named
/// in docs/testing.md.
#[tokio::test(flavor = "multi_thread")]
async fn f02_ca_rejects_unauthenticated_backs_off_with_jitter() {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let mut sc =
        Sidecar::start_with_token(&dp, "a", "default", "a", &[], json!({}), "not-a-jwt").await;
    let recs = wait_for("five rejected CSRs", Duration::from_secs(30), || async {
        let r = csr_records(&dp).await;
        (r.len() >= 5).then_some(r)
    })
    .await;
    for r in &recs {
        assert!(r["serial"].is_null(), "nothing signed: {r}");
        assert!(
            r["error"]
                .as_str()
                .unwrap_or("")
                .contains("Unauthenticated"),
            "{r}"
        );
    }
    let times: Vec<f64> = recs.iter().map(record_secs).collect();
    let mut base = 0.5;
    let mut ratios = vec![];
    for w in times.windows(2).take(4) {
        let gap = w[1] - w[0];
        // Jitter scales a step by [0.8, 1.0]; the CA's millisecond clock and one round trip
        // of scheduling on a loaded machine add a little.
        assert!(
            gap >= base * 0.8 - 0.01 && gap <= base + 0.5,
            "gap {gap:.3}s for step {base}s: {times:?}"
        );
        ratios.push(gap / base);
        base *= 2.0;
    }
    assert!(
        ratios.iter().any(|r| *r < 0.99),
        "no jitter in the backoff: {ratios:?}"
    );
    let (code, body) = ready(&sc).await;
    assert_eq!(code, 503);
    assert!(body.contains("Unauthenticated"), "{body}");
    assert!(body.contains("token"), "names the likely cause: {body}");
    assert_eq!(
        agent_metric(
            &sc,
            "istio_agent_num_outgoing_retries{request_type=\"csr\"}"
        )
        .await,
        0.0,
        "Unauthenticated is not retried in-call"
    );
    assert!(
        agent_metric(
            &sc,
            "istio_agent_num_failed_outgoing_requests{request_type=\"csr\"}"
        )
        .await
            >= 5.0
    );

    // The cause fixed (a valid token projected), the next attempt succeeds.
    let token = dp.token("default", "a", 3600).await;
    kubelet::atomic_write(
        &sc.cwd.path().join("var/run/secrets/tokens"),
        &[("istio-token", token.as_bytes())],
    );
    sc.wait_ready(Duration::from_secs(40)).await;
    assert_eq!(sc.spiffe_ids().await, vec![SPIFFE_A.to_owned()]);
}

// === F3 ===

/// F3: the projected token is rotated by the kubelet (`..data` symlink swap) twice. Every CSR
/// and every xDS (re)connection reads the file anew (the Linkerd model): the CSR after each
/// swap carries the new token, and after istiod restarts the xDS stream authenticates with the
/// newest one. (A token missing at start: `identity_e2e`
/// `missing_token_is_one_clear_readiness_reason_without_retries`; devplane, like the
/// apiserver, accepts `exp` with 60 s leeway, so an expired token is a rejection like F2's.)
#[tokio::test(flavor = "multi_thread")]
async fn f03_rotated_token_is_read_on_every_csr_and_xds_reconnect() {
    let mut dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let first = dp.token("default", "a", 3600).await;
    // 4 s certificates: a CSR every ~2 s, so each swap is followed by CSRs soon.
    let env = [
        ("SECRET_TTL", "4s".to_owned()),
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA".to_owned()),
    ];
    let mut sc = Sidecar::start_with_token(&dp, "a", "default", "a", &env, json!({}), &first).await;
    sc.wait_ready(DEADLINE).await;
    let bearer = |t: &str| format!("Bearer {}", fingerprint(t));
    xds_stream_with_token(&dp, &first).await;
    let tokens = sc.cwd.path().join("var/run/secrets/tokens");
    for ttl in [7200, 10800] {
        let next = dp.token("default", "a", ttl).await;
        kubelet::atomic_write(&tokens, &[("istio-token", next.as_bytes())]);
        let want = bearer(&next);
        wait_for("a signed CSR with the new token", DEADLINE, || async {
            csr_records(&dp)
                .await
                .into_iter()
                .find(|r| r["headers"]["authorization"] == want.as_str() && r["serial"].is_string())
        })
        .await;
        dp.restart().await;
        xds_stream_with_token(&dp, &next).await;
        sc.wait_ready(DEADLINE).await;
    }
    // Rejected CSRs would mean a stale token was sent.
    assert!(
        csr_records(&dp).await.iter().all(|r| r["error"].is_null()),
        "{:#?}",
        csr_records(&dp).await
    );
}

/// Waits until devplane lists the proxied xDS stream authenticated with `token`.
async fn xds_stream_with_token(dp: &Devplane, token: &str) -> Value {
    let want = fingerprint(token);
    wait_for("the xDS stream with the token", DEADLINE, || async {
        dp.clients()
            .await
            .into_iter()
            .find(|c| c["node_id"].is_string() && c["token_fingerprint"] == want.as_str())
    })
    .await
}

// === F4 ===

/// F4: clock skew between the agent and the CA. A certificate the CA issues with its clock
/// 60 s ahead of (NotBefore in the agent's future) or 60 s behind the agent's is accepted as
/// it is; only a NotBefore beyond the skew allowance (10 min ahead) or a certificate already
/// expired by the agent's clock is refused, naming why. Devplane's real CA code signs; the
/// agent's real check decides.
#[test]
fn f04_clock_skew_accepts_fresh_certs_and_refuses_far_future() {
    use meshagent::identity::verify::verify_chain;
    use meshagent_devplane::ca::Ca;
    use meshagent_devplane::token::Identity;

    let root_key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let root = params.self_signed(&root_key).unwrap();
    let ca = Ca::new(&root.pem(), &root_key.serialize_pem()).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let csr = rcgen::CertificateParams::new(Vec::<String>::new())
        .unwrap()
        .serialize_request(&key)
        .unwrap()
        .pem()
        .unwrap();
    let id = Identity {
        namespace: "default".into(),
        service_account: "a".into(),
    };
    let agent_now = SystemTime::now();
    let ttl = Duration::from_secs(3600);
    let issue = |ca_skew: i64| {
        let at = if ca_skew >= 0 {
            agent_now + Duration::from_secs(ca_skew as u64)
        } else {
            agent_now - Duration::from_secs(ca_skew.unsigned_abs())
        };
        ca.sign_detailed(&csr, &id, ttl, at).unwrap().chain
    };
    for skew in [-60, -30, -5, 0, 5, 30, 60] {
        let issued = verify_chain(&issue(skew), SPIFFE_A, agent_now)
            .unwrap_or_else(|e| panic!("CA clock {skew:+}s: fresh certificate refused: {e}"));
        assert_eq!(issued.spiffe_id, SPIFFE_A);
    }
    let e = verify_chain(&issue(600), SPIFFE_A, agent_now).unwrap_err();
    assert!(e.contains("not valid yet"), "{e}");
    let e = verify_chain(&issue(-7200), SPIFFE_A, agent_now).unwrap_err();
    assert!(e.contains("already expired"), "{e}");
}

// === F6 ===

/// `istio.mesh.v1alpha1.ProxyConfig` with only `ca_certificates_pem` (field 34) set.
fn proxy_config_with_roots(pems: &[String]) -> Vec<u8> {
    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    let mut out = vec![];
    for p in pems {
        varint((34 << 3) | 2, &mut out);
        varint(p.len() as u64, &mut out);
        out.extend_from_slice(p.as_bytes());
    }
    out
}

/// The largest number of CA certificates Envoy holds in any TLS context (`/certs`).
async fn envoy_ca_count(sc: &Sidecar) -> Option<usize> {
    let (code, body) = http_get(sc.admin, "/certs").await.ok()?;
    (code == 200).then_some(())?;
    let v: Value = serde_json::from_str(&body).ok()?;
    v["certificates"]
        .as_array()?
        .iter()
        .filter_map(|c| c["ca_cert"].as_array().map(Vec::len))
        .max()
}

/// F6: a root CA change pushed by istiod over PCDS (a superset bundle: the current root plus
/// a new one) reaches Envoy's `ROOTCA` over SDS without an Envoy restart, and shrinking
/// the bundle again is pushed too.
#[tokio::test(flavor = "multi_thread")]
async fn f06_pcds_root_change_reaches_envoy_rootca_without_restart() {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let mut sc = Sidecar::start(
        &dp,
        "a",
        "default",
        "a",
        &[("PROXY_CONFIG_XDS_AGENT", "true".into())],
    )
    .await;
    sc.wait_ready(DEADLINE).await;
    let envoy = envoy_pid(sc.proc.pid()).unwrap();
    let count = wait_for("Envoy to hold ROOTCA", DEADLINE, || envoy_ca_count(&sc)).await;
    assert_eq!(count, 1, "istiod's root only");
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let new_root = p.self_signed(&key).unwrap().pem();
    let old_root = std::fs::read_to_string(dp.root_cert_path()).unwrap();
    dp.set_resource(
        type_url::PROXY_CONFIG,
        "pcds",
        &proxy_config_with_roots(&[old_root, new_root]),
    )
    .await;
    wait_for("ROOTCA with both roots", DEADLINE, || async {
        (envoy_ca_count(&sc).await == Some(2)).then_some(())
    })
    .await;

    // Back to istiod's root alone.
    dp.set_resource(
        type_url::PROXY_CONFIG,
        "pcds",
        &proxy_config_with_roots(&[]),
    )
    .await;
    wait_for("ROOTCA with one root again", DEADLINE, || async {
        (envoy_ca_count(&sc).await == Some(1)).then_some(())
    })
    .await;
    assert_eq!(envoy_pid(sc.proc.pid()), Some(envoy), "Envoy not restarted");
    assert!(sc.proc.try_wait().is_none());
}

// === F8 ===

/// F8: Envoy crashes (SIGSEGV). The agent exits non-zero with the shell's code for the
/// signal (128 + 11), so the kubelet restarts the container with its own backoff; it does
/// not linger serving nothing. SIGKILL with the OOM hint: `sidecar_lifecycle`
/// `envoy_killed_agent_exits_nonzero`.
#[tokio::test(flavor = "multi_thread")]
async fn f08_envoy_segfault_makes_the_agent_exit_nonzero() {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let mut sc = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    sc.wait_ready(DEADLINE).await;
    let envoy = envoy_pid(sc.proc.pid()).unwrap();
    send_signal(envoy, nix::sys::signal::Signal::SIGSEGV);
    let st = wait_exit(&mut sc, Duration::from_secs(15)).await;
    assert_eq!(st.code(), Some(139), "128 + SIGSEGV: {st:?}");
    let log = sc.proc.log_text();
    assert!(log.contains("killed by signal 11"), "{log}");
    assert!(!Path::new(&format!("/proc/{envoy}")).exists());
}

// === F11 ===

/// F11: the connection to istiod is reset in the middle of a large CDS push. The agent
/// reconnects once (one new TCP connection, no leak or storm), Envoy's stream is re-established
/// and every type is delivered and ACKed again, including the cluster whose push was cut.
#[tokio::test(flavor = "multi_thread")]
async fn f11_upstream_reset_mid_cds_push_reconnects_once() {
    const SIZE: usize = 8 * 1024 * 1024;
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let relay = Relay::start(dp.grpc_addr, true).await;
    let dir = tempfile::tempdir().unwrap();
    let token = dp.token("default", "a", 3600).await;
    let root = dp.root_cert_path();
    let agent = Agent::start(
        dir.path(),
        &relay.addr.to_string(),
        Some(&token),
        &[("XDS_ROOT_CA", root.to_str().unwrap())],
    );
    let (envoy, _sds) = envoy_through(&dp, &agent, dir.path(), false).await;
    let first = acked(&dp, "sotw").await;
    assert_eq!(relay.forwarded(), 1, "one upstream connection");

    // Cut the path after 1 MiB of the 8 MiB cluster has been relayed.
    relay.arm_reset_after(1024 * 1024);
    dp.set_resource(type_url::CLUSTER, "big", &big_cluster("big", SIZE))
        .await;
    wait_for("the reset", DEADLINE, || async {
        (relay.reset_at.load(Ordering::SeqCst) == u64::MAX).then_some(())
    })
    .await;
    envoy
        .wait_for_cluster("Envoy to have the big cluster", DEADLINE, "big")
        .await;
    let again = wait_for("CDS and LDS ACKed on a new stream", DEADLINE, || async {
        let c = acked(&dp, "sotw").await;
        (c["id"] != first["id"]).then_some(c)
    })
    .await;
    assert_eq!(again["nacks"], json!({}), "{again:#}");
    converged(&envoy).await;
    // Not synchronisation: a window in which a reconnect loop or a leaked dial would show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(relay.forwarded(), 2, "exactly one reconnect");
    assert_eq!(relay.open(), 1, "one TCP connection to istiod");
    assert_eq!(dp.clients().await.len(), 1, "one stream at istiod");
    assert!(
        agent.metric("istio_agent_istiod_connection_terminations{type=\"error\"}")
            + agent.metric("istio_agent_istiod_connection_terminations{type=\"cancelled\"}")
            >= 1.0,
        "{}",
        agent.registry.encode()
    );
}

// === F12 ===

mod sds_client {
    use super::*;
    use hyper_util::rt::TokioIo;
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use meshagent_proto::envoy::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
    use tonic::transport::{Channel, Endpoint};

    pub async fn client(socket: &Path) -> SecretDiscoveryServiceClient<Channel> {
        let socket = socket.to_path_buf();
        let ch = Endpoint::from_static("http://sds")
            .connect_with_connector(tower::service_fn(move |_| {
                let s = socket.clone();
                async move { tokio::net::UnixStream::connect(s).await.map(TokioIo::new) }
            }))
            .await
            .unwrap();
        SecretDiscoveryServiceClient::new(ch)
    }

    pub fn req(names: &[String], version: &str, nonce: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.into(),
            resource_names: names.to_vec(),
            type_url: type_url::SECRET.into(),
            response_nonce: nonce.into(),
            ..Default::default()
        }
    }
}

fn vm_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// F12: 5,000 file-cert resources (a gateway with thousands of credentials) on one SDS
/// stream. All are served within a deadline, the agent's memory grows by a bounded amount
/// per resource, a change to one file pushes that one resource only (no fan-out to the
/// others), and all are forgotten when the stream ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f12_five_thousand_file_cert_resources() {
    use meshagent::config::{self, MapEnv, ProxyFlags};
    use meshagent::identity::{self, Options};
    use meshagent::metrics::Registry;
    use tokio_stream::wrappers::ReceiverStream;
    use tokio_util::sync::CancellationToken;

    const N: usize = 5000;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config::load(
        &ProxyFlags::default(),
        &MapEnv::from_pairs([
            ("POD_NAMESPACE".to_owned(), "default".to_owned()),
            ("SERVICE_ACCOUNT".to_owned(), "a".to_owned()),
            ("POD_NAME".to_owned(), "a-1".to_owned()),
            ("FILE_MOUNTED_CERTS".to_owned(), "true".to_owned()),
        ]),
        dir.path(),
    )
    .unwrap();
    let registry = Registry::new();
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let handle = identity::start_with(
        &cfg,
        dir.path(),
        &registry,
        cancel.clone(),
        Options::default(),
    )
    .await
    .unwrap();
    let metric = |series: &str| -> u64 {
        registry
            .encode()
            .lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    };

    // N credentials: a certificate and key per file pair, as a gateway mounts them.
    let certs = dir.path().join("creds");
    std::fs::create_dir_all(&certs).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["gw.example".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap()
        .pem();
    let key_pem = key.serialize_pem();
    for i in 0..N {
        std::fs::write(certs.join(format!("c{i}.pem")), &cert).unwrap();
        std::fs::write(certs.join(format!("k{i}.pem")), &key_pem).unwrap();
    }
    let names: Vec<String> = (0..N)
        .map(|i| format!("file-cert:creds/c{i}.pem~creds/k{i}.pem"))
        .collect();

    let rss_before = vm_rss_kib();
    let mut c = sds_client::client(handle.socket()).await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(sds_client::req(&names, "", "")).await.unwrap();
    let mut stream = c
        .stream_secrets(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let started = Instant::now();
    let mut got = std::collections::HashSet::new();
    let mut last = None;
    while got.len() < N {
        let r = tokio::time::timeout(Duration::from_secs(60), stream.message())
            .await
            .expect("all resources within 60 s")
            .unwrap()
            .unwrap();
        for res in &r.resources {
            let s: meshagent_proto::envoy::pb::envoy::extensions::transport_sockets::tls::v3::Secret =
                prost::Message::decode(res.value.as_slice()).unwrap();
            got.insert(s.name);
        }
        last = Some(r);
    }
    let took = started.elapsed();
    let rss_after = vm_rss_kib();
    let per_resource = (rss_after.saturating_sub(rss_before) * 1024) / N as u64;
    eprintln!(
        "{N} file-cert resources in {took:?}; RSS +{} KiB ({per_resource} B per resource)",
        rss_after.saturating_sub(rss_before)
    );
    assert_eq!(metric("istio_agent_file_secret_resources"), N as u64);
    // Each resource holds a ~0.6 KiB certificate and key, twice (PEM and encoded secret).
    assert!(
        per_resource < 32 * 1024,
        "{per_resource} bytes per resource"
    );
    if let Some(r) = last {
        let _ = tx.try_send(sds_client::req(&names, &r.version_info, &r.nonce));
    }

    // One credential rotates: only it is pushed.
    let key2 = rcgen::KeyPair::generate().unwrap();
    let cert2 = rcgen::CertificateParams::new(vec!["gw2.example".into()])
        .unwrap()
        .self_signed(&key2)
        .unwrap()
        .pem();
    meshagent_testkit::write_atomic(&certs.join("c7.pem"), cert2.as_bytes());
    meshagent_testkit::write_atomic(&certs.join("k7.pem"), key2.serialize_pem().as_bytes());
    let pushed = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let r = stream.message().await.unwrap().unwrap();
            // ACK as Envoy does; never block on it (the agent may be busy answering).
            let _ = tx.try_send(sds_client::req(&names, &r.version_info, &r.nonce));
            // The key and the certificate may land in two debounce windows: wait for the pair.
            let names: Vec<String> = r
                .resources
                .iter()
                .map(|res| {
                    let s: meshagent_proto::envoy::pb::envoy::extensions::transport_sockets::tls::v3::Secret =
                        prost::Message::decode(res.value.as_slice()).unwrap();
                    s.name
                })
                .collect();
            if !names.is_empty() {
                return names;
            }
        }
    })
    .await
    .expect("the rotated credential is pushed");
    assert_eq!(
        pushed,
        vec!["file-cert:creds/c7.pem~creds/k7.pem".to_owned()],
        "only the changed resource"
    );

    // The stream ends: every resource is forgotten.
    drop((stream, tx, c));
    wait_for("resources forgotten", DEADLINE, || async {
        (metric("istio_agent_file_secret_resources") == 0).then_some(())
    })
    .await;
}
