//! Drain and termination beyond Istio, with real Envoy and devplane: readiness fails before
//! the listeners drain (`MESHAGENT_DRAIN_START_DELAY`), `/drain/status`, a drain that survives
//! a refused admin call, and an inbound-only drain that leaves the application's outbound
//! requests alone.
//!
//! The agent reaches Envoy's admin through [`AdminGate`], a TCP relay in front of the real
//! admin port (moved with `ISTIO_BOOTSTRAP_OVERRIDE`): it records when the agent asks Envoy to
//! drain and can reset that request's connection.

#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use meshagent_testkit::{
    DEADLINE, Devplane, Proc, Sidecar, TwoWorkloads, free_addr, http_get, wait_for,
};

/// One `POST /drain_listeners…` the agent sent to Envoy's admin.
#[derive(Debug, Clone)]
struct DrainPost {
    at: Instant,
    path: String,
    /// Reset by the gate instead of reaching Envoy.
    refused: bool,
}

/// A TCP relay in front of Envoy's admin port that sees every request line: the first
/// `refuse` drain requests get a TCP reset, everything else is relayed untouched.
struct AdminGate {
    addr: SocketAddr,
    posts: Arc<Mutex<Vec<DrainPost>>>,
    task: tokio::task::JoinHandle<()>,
}

impl AdminGate {
    async fn start(envoy_admin: SocketAddr, refuse: usize) -> AdminGate {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let posts: Arc<Mutex<Vec<DrainPost>>> = Arc::default();
        let seen = posts.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((down, _)) = listener.accept().await else {
                    continue;
                };
                let seen = seen.clone();
                tokio::spawn(async move {
                    let _ = relay(down, envoy_admin, seen, refuse).await;
                });
            }
        });
        AdminGate { addr, posts, task }
    }

    fn posts(&self) -> Vec<DrainPost> {
        self.posts.lock().unwrap().clone()
    }
}

impl Drop for AdminGate {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn relay(
    mut down: TcpStream,
    upstream: SocketAddr,
    seen: Arc<Mutex<Vec<DrainPost>>>,
    refuse: usize,
) -> std::io::Result<()> {
    // The request line, read with a bound and a deadline.
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.contains(&b'\n') && head.len() < 8192 {
        let n = tokio::time::timeout(Duration::from_secs(5), down.read(&mut buf))
            .await
            .map_err(std::io::Error::other)??;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    if let Some(path) = line
        .lines()
        .next()
        .and_then(|l| l.strip_prefix("POST "))
        .filter(|p| p.starts_with("/drain_listeners"))
    {
        let path = path.split(' ').next().unwrap_or_default().to_owned();
        let refused = {
            let mut s = seen.lock().unwrap();
            let refused = s.len() < refuse;
            s.push(DrainPost {
                at: Instant::now(),
                path,
                refused,
            });
            refused
        };
        if refused {
            // SO_LINGER 0: close sends RST, as a crashed or overloaded admin would.
            down.set_zero_linger()?;
            return Ok(());
        }
    }
    let mut up = TcpStream::connect(upstream).await?;
    up.write_all(&head).await?;
    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
    Ok(())
}

/// A sidecar for workload `a` of `yaml` whose agent reaches Envoy's admin through `gate`
/// (Envoy's admin really listens on `envoy_admin`).
async fn sidecar_behind_gate(
    dp: &Devplane,
    gate: &AdminGate,
    envoy_admin: SocketAddr,
    dir: &tempfile::TempDir,
    env: &[(&str, String)],
    proxy_config: Value,
) -> Sidecar {
    let over = dir.path().join("admin-override.yaml");
    std::fs::write(
        &over,
        format!(
            "admin:\n  address:\n    socket_address:\n      address: 127.0.0.1\n      port_value: {}\n",
            envoy_admin.port()
        ),
    )
    .unwrap();
    let mut env: Vec<(&str, String)> = env.to_vec();
    env.push(("ISTIO_BOOTSTRAP_OVERRIDE", over.display().to_string()));
    let mut pc = json!({ "proxyAdminPort": gate.addr.port() });
    for (k, v) in proxy_config.as_object().into_iter().flatten() {
        pc[k] = v.clone();
    }
    let mut s = Sidecar::start_with(dp, "a", "default", "a", &env, pc).await;
    s.admin = envoy_admin;
    s
}

async fn drain_status(sidecar: &Sidecar) -> Value {
    let (code, body) = http_get(sidecar.status, "/drain/status").await.unwrap();
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

async fn wait_exit(p: &mut Proc, within: Duration) -> std::process::ExitStatus {
    wait_for("the agent to exit", within, || {
        let s = p.try_wait();
        async move { s }
    })
    .await
}

fn sigterm(p: &Proc) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(p.pid()).unwrap()),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
}

/// Polls `/healthz/ready` back to back until it answers 503; returns when that answer came.
async fn first_not_ready(status: SocketAddr) -> (Instant, String) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Ok((503, body)) = http_get(status, "/healthz/ready").await {
            return (Instant::now(), body);
        }
        assert!(Instant::now() < deadline, "readiness never turned 503");
    }
}

/// SIGTERM turns readiness 503 at once; Envoy is asked to drain only after
/// `MESHAGENT_DRAIN_START_DELAY`, and `/drain/status` shows each phase.
#[tokio::test(flavor = "multi_thread")]
async fn readiness_fails_before_the_listeners_drain() {
    let (yaml, ..) = meshagent_testkit::two_workload_mesh();
    let dp = Devplane::start(&yaml).await;
    let envoy_admin = free_addr();
    let gate = AdminGate::start(envoy_admin, 0).await;
    let dir = tempfile::tempdir().unwrap();
    let delay = Duration::from_secs(4);
    let mut a = sidecar_behind_gate(
        &dp,
        &gate,
        envoy_admin,
        &dir,
        &[("MESHAGENT_DRAIN_START_DELAY", "4s".into())],
        json!({"terminationDrainDuration": "1s"}),
    )
    .await;
    a.wait_ready(DEADLINE).await;
    let running = drain_status(&a).await;
    assert_eq!(running["phase"], "running", "{running}");
    assert!(
        running["activeConnections"].is_object(),
        "per-listener connections from Envoy's stats: {running}"
    );

    let t0 = Instant::now();
    sigterm(&a.proc);
    let (not_ready_at, reason) = first_not_ready(a.status).await;
    eprintln!(
        "SIGTERM to readiness 503: {:.3} ms",
        (not_ready_at - t0).as_secs_f64() * 1e3
    );
    assert!(reason.contains("server is terminated"), "{reason}");
    let withdrawing = drain_status(&a).await;
    if gate.posts().is_empty() {
        assert_eq!(withdrawing["phase"], "withdrawing", "{withdrawing}");
        assert!(withdrawing["elapsedSeconds"].as_f64().is_some());
    }

    let post = wait_for("the agent to ask Envoy to drain", DEADLINE, || {
        let p = gate.posts();
        async move { p.first().cloned() }
    })
    .await;
    assert!(
        post.at > not_ready_at,
        "readiness failed before the drain was requested"
    );
    assert!(
        post.at - t0 >= delay,
        "the drain waited MESHAGENT_DRAIN_START_DELAY: {:?}",
        post.at - t0
    );
    assert_eq!(post.path, "/drain_listeners?inboundonly&graceful");
    let draining = drain_status(&a).await;
    let phase = draining["phase"].as_str().unwrap_or_default();
    assert!(["draining", "stopping"].contains(&phase), "{draining}");
    let deadline = draining["deadlineSeconds"].as_f64().unwrap();
    assert!(
        (5.0..10.0).contains(&deadline),
        "deadline = delay + terminationDrainDuration: {draining}"
    );
    assert!(draining["lastAdminError"].is_null(), "{draining}");

    let st = wait_exit(&mut a.proc, DEADLINE).await;
    assert_eq!(st.code(), Some(0), "{st:?}");
}

/// Envoy's admin resets the first drain request: the agent retries within the deadline, the
/// listeners are drained, `/drain/status` names the failure, and the agent exits 0.
#[tokio::test(flavor = "multi_thread")]
async fn drain_survives_a_refused_admin_call() {
    let (yaml, ..) = meshagent_testkit::two_workload_mesh();
    let dp = Devplane::start(&yaml).await;
    let envoy_admin = free_addr();
    let gate = AdminGate::start(envoy_admin, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let mut a = sidecar_behind_gate(
        &dp,
        &gate,
        envoy_admin,
        &dir,
        &[],
        json!({"terminationDrainDuration": "5s", "drainDuration": "1s"}),
    )
    .await;
    a.wait_ready(DEADLINE).await;
    let stopped_before = listeners_stopped(envoy_admin).await;

    sigterm(&a.proc);
    let posts = wait_for("a second drain request", DEADLINE, || {
        let p = gate.posts();
        async move { (p.len() >= 2).then_some(p) }
    })
    .await;
    assert!(posts[0].refused && !posts[1].refused, "{posts:?}");
    // Envoy itself drained: once the drain time (drainDuration 1s) is over it stops the
    // inbound listener.
    wait_for(
        "Envoy to stop the drained listener",
        DEADLINE,
        || async move { (listeners_stopped(envoy_admin).await > stopped_before).then_some(()) },
    )
    .await;
    let status = drain_status(&a).await;
    assert_eq!(status["adminFailures"], 1, "{status}");
    assert!(
        status["lastAdminError"]
            .as_str()
            .is_some_and(|e| e.contains("/drain_listeners")),
        "{status}"
    );
    let st = wait_exit(&mut a.proc, DEADLINE).await;
    assert_eq!(st.code(), Some(0), "{st:?}");
    let log = a.proc.log_text();
    assert!(log.contains("cannot drain Envoy; retrying"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

async fn listeners_stopped(admin: SocketAddr) -> u64 {
    match http_get(admin, "/stats?filter=^listener_manager.listener_stopped$").await {
        Ok((200, body)) => {
            meshagent::envoy::admin::stat_value(&body, "listener_manager.listener_stopped")
                .unwrap_or(0)
        }
        _ => 0,
    }
}

/// During `MESHAGENT_DRAIN_START_DELAY` the pod is not ready but still serves: calls into it
/// keep working past Envoy's drain time. A second SIGTERM ends the wait without draining.
#[tokio::test(flavor = "multi_thread")]
async fn inbound_is_served_during_the_start_delay_and_a_second_sigterm_ends_it() {
    let (yaml, a_to_b, _, b_app) = meshagent_testkit::two_workload_mesh();
    let dp = Devplane::start(&yaml).await;
    let l = TcpListener::bind(("127.0.0.1", b_app)).await.unwrap();
    tokio::spawn(keepalive_app(l));
    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    let mut b = Sidecar::start_with(
        &dp,
        "b",
        "default",
        "b",
        &[("MESHAGENT_DRAIN_START_DELAY", "60s".into())],
        json!({"terminationDrainDuration": "1s", "drainDuration": "1s"}),
    )
    .await;
    a.wait_ready(DEADLINE).await;
    b.wait_ready(DEADLINE).await;
    wait_for("a → b", DEADLINE, || async move {
        let mut s = TcpStream::connect(a_to_b).await.ok()?;
        matches!(keepalive_get(&mut s).await, Ok((200, _))).then_some(())
    })
    .await;

    sigterm(&b.proc);
    let (_, reason) = first_not_ready(b.status).await;
    assert!(reason.contains("server is terminated"), "{reason}");
    // Well past Envoy's drain time (1s), b's inbound listener still takes new connections.
    let until = Instant::now() + Duration::from_secs(3);
    let mut n = 0;
    while Instant::now() < until {
        let mut s = TcpStream::connect(a_to_b).await.unwrap();
        let (code, headers) = keepalive_get(&mut s).await.unwrap();
        assert_eq!(
            code, 200,
            "call {n} into b during the start delay: {headers:?}"
        );
        n += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = drain_status(&b).await;
    assert_eq!(status["phase"], "withdrawing", "{status}");
    assert!(b.proc.try_wait().is_none(), "the agent waits out the delay");

    sigterm(&b.proc);
    let st = wait_exit(&mut b.proc, DEADLINE).await;
    assert_eq!(st.code(), Some(0), "{st:?}");
    let log = b.proc.log_text();
    assert!(log.contains("second termination signal"), "{log}");
    assert!(!log.contains("draining Envoy listeners"), "{log}");
}

// === outbound requests during an inbound drain ===

/// An HTTP/1.1 keep-alive server: every request gets `200` with a short body.
async fn keepalive_app(listener: TcpListener) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            loop {
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    match tokio::time::timeout(Duration::from_secs(60), s.read(&mut chunk)).await {
                        Ok(Ok(n)) if n > 0 && buf.len() < 64 * 1024 => {
                            buf.extend_from_slice(&chunk[..n]);
                            continue;
                        }
                        _ => return,
                    }
                };
                buf.drain(..end + 4);
                let body = "ok\n";
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if s.write_all(resp.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// One request on a kept-alive connection: status and lower-cased headers.
async fn keepalive_get(s: &mut TcpStream) -> std::io::Result<(u16, Vec<(String, String)>)> {
    s.write_all(b"GET / HTTP/1.1\r\nhost: peer\r\n\r\n").await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
            .await
            .map_err(std::io::Error::other)??;
        if n == 0 || buf.len() > 64 * 1024 {
            return Err(std::io::Error::other("connection closed before a response"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let mut lines = head.lines();
    let code = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[end + 4..].to_vec();
    while body.len() < len {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
            .await
            .map_err(std::io::Error::other)??;
        if n == 0 {
            return Err(std::io::Error::other("body cut short"));
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok((code, headers))
}

/// A classic sidecar with `EXIT_ON_ZERO_ACTIVE_CONNECTIONS` drains while its application still
/// runs: inbound connections are closed (`connection: close`), while the application's
/// outbound requests on a kept-alive connection keep working without `connection: close`.
/// Once the application closes its connection (and the peer's idle pooled connections are
/// gone) the agent exits.
#[tokio::test(flavor = "multi_thread")]
async fn outbound_requests_keep_flowing_while_inbound_drains() {
    let mesh = TwoWorkloads::new().with_b_to_a();
    let (a_app, b_app, a_to_b) = (mesh.a_app, mesh.b_app, mesh.a_to_b);
    let b_to_a = mesh.b_to_a.expect("b calls a");
    let yaml = mesh.yaml(false);
    let dp = Devplane::start(&yaml).await;
    for port in [a_app, b_app] {
        let l = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        tokio::spawn(keepalive_app(l));
    }
    let mut a = Sidecar::start_with(
        &dp,
        "a",
        "default",
        "a",
        &[
            ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true".into()),
            ("MINIMUM_DRAIN_DURATION", "1s".into()),
        ],
        json!({"terminationDrainDuration": "1s", "drainDuration": "1s"}),
    )
    .await;
    let mut b = Sidecar::start(&dp, "b", "default", "b", &[]).await;
    a.wait_ready(DEADLINE).await;
    b.wait_ready(DEADLINE).await;

    // a's application: one kept-alive connection through its sidecar to b.
    let mut app_conn = wait_for("a → b through a's sidecar", DEADLINE, || async move {
        let mut s = TcpStream::connect(a_to_b).await.ok()?;
        matches!(keepalive_get(&mut s).await, Ok((200, _))).then_some(s)
    })
    .await;
    wait_for("b → a through both sidecars", DEADLINE, || async move {
        let mut s = TcpStream::connect(b_to_a).await.ok()?;
        matches!(keepalive_get(&mut s).await, Ok((200, _))).then_some(())
    })
    .await;

    let a_admin = a.admin;
    let stopped_before = listeners_stopped(a_admin).await;
    sigterm(&a.proc);
    // The inbound side drains: once Envoy's drain time (drainDuration 1s) is over, a's inbound
    // listener is stopped and b's calls into a fail.
    wait_for(
        "a's inbound listener to be drained and stopped",
        DEADLINE,
        || async move { (listeners_stopped(a_admin).await > stopped_before).then_some(()) },
    )
    .await;
    wait_for("b's calls into a to fail", DEADLINE, || async move {
        let mut s = TcpStream::connect(b_to_a).await.ok()?;
        match keepalive_get(&mut s).await {
            Ok((200, _)) => None,
            _ => Some(()),
        }
    })
    .await;
    // Meanwhile, well past Envoy's drain time, a's application keeps using its connection.
    let until = Instant::now() + Duration::from_secs(3);
    let mut sent = 0;
    while Instant::now() < until {
        let (code, headers) = keepalive_get(&mut app_conn)
            .await
            .unwrap_or_else(|e| panic!("outbound request {sent} during drain: {e}"));
        assert_eq!(code, 200, "outbound request {sent}: {headers:?}");
        assert!(
            !headers
                .iter()
                .any(|(k, v)| k == "connection" && v.eq_ignore_ascii_case("close")),
            "outbound request {sent} during drain got connection: close: {headers:?}"
        );
        sent += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The outbound listener was never stopped: a new connection works too.
    let mut fresh = TcpStream::connect(a_to_b).await.unwrap();
    let (code, headers) = keepalive_get(&mut fresh).await.unwrap();
    assert_eq!(code, 200, "{headers:?}");
    drop(fresh);
    let status = drain_status(&a).await;
    assert_eq!(status["phase"], "waiting-for-connections", "{status}");
    assert!(
        status["activeConnectionsTotal"].as_u64().unwrap_or(0) >= 1,
        "the application's connection is counted: {status}"
    );
    assert!(a.proc.try_wait().is_none(), "the agent waits for the app");

    // b goes away: its Envoy keeps one pooled connection into a per worker, and one that
    // carried no request since the drain began is idle and never closed by Envoy's drain
    // (Istio #48409), so EXIT_ON_ZERO_ACTIVE_CONNECTIONS would wait for it.
    b.proc.kill();
    // The application is done: its connection closes and the agent exits.
    drop(app_conn);
    let mut last = Value::Null;
    let deadline = Instant::now() + DEADLINE;
    while a.proc.try_wait().is_none() {
        if let Ok((200, body)) = http_get(a.status, "/drain/status").await {
            last = serde_json::from_str(&body).unwrap_or_default();
        }
        assert!(
            Instant::now() < deadline,
            "connections still active: {last}\n{:?}",
            http_get(a_admin, "/stats?filter=cx_active").await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let st = wait_exit(&mut a.proc, DEADLINE).await;
    assert_eq!(st.code(), Some(0), "{st:?}; last /drain/status: {last}");
}
