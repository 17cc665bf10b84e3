//! The demo scenario end to end: devplane plus two `meshagent proxy sidecar` processes, each
//! run with Istio's env vars in its own working directory exactly as a pod runs it; A's app
//! calls B through both Envoys over mTLS. Also readiness, `wait`, and graceful drain with a
//! slow request in flight.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::process::Command;
use std::time::Duration;

use meshagent_testkit::{
    DEADLINE, Devplane, Sidecar, http_get, identity_app, json, two_workload_mesh, wait_for,
    workspace_bin,
};

const READY: Duration = Duration::from_secs(40);

async fn app(name: &'static str, port: u16, delay: Duration) {
    let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(identity_app(name, l, delay));
}

#[tokio::test(flavor = "multi_thread")]
async fn two_sidecars_talk_mtls() {
    let (mesh, a_to_b, a_app, b_app) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    app("a", a_app, Duration::ZERO).await;
    app("b", b_app, Duration::ZERO).await;
    let mut a = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    let mut b = Sidecar::start(&dp, "b", "default", "b", &[]).await;
    a.wait_ready(READY).await;
    b.wait_ready(READY).await;

    // `wait` returns 0 once ready (the postStart hook of holdApplicationUntilProxyStarts),
    // here through Envoy's 15021 listener like the real hook.
    let out = Command::new(workspace_bin("meshagent"))
        .args([
            "wait",
            &format!("--url=http://{}/healthz/ready", a.envoy_status),
            "--timeoutSeconds=20",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let (code, body) = wait_for("A → B through both sidecars", DEADLINE, || async {
        http_get(a_to_b, "/").await.ok().filter(|(c, _)| *c == 200)
    })
    .await;
    assert_eq!(code, 200);
    assert!(
        body.contains("hello from b; caller identity: spiffe://cluster.local/ns/default/sa/a"),
        "{body}"
    );
    assert_eq!(
        a.spiffe_ids().await,
        vec!["spiffe://cluster.local/ns/default/sa/a"]
    );
    assert_eq!(
        b.spiffe_ids().await,
        vec!["spiffe://cluster.local/ns/default/sa/b"]
    );

    // devplane saw what a pod's agent sends upstream.
    let clients = dp.clients().await;
    let ca = clients
        .iter()
        .find(|c| {
            c["node_id"]
                .as_str()
                .is_some_and(|n| n.contains("a-5f7d9.default"))
        })
        .expect("A's xDS client at devplane");
    assert_eq!(ca["headers"]["clusterid"], "Kubernetes");
    assert_eq!(ca["identity"], "spiffe://cluster.local/ns/default/sa/a");
}

/// A → B with B's app answering after `b_delay`: B's agent gets SIGTERM while a request is in
/// flight. Returns whether that request succeeded (status, body), B's exit status, and the time
/// from SIGTERM to B's exit.
async fn sigterm_b_during_request(
    b_delay: Duration,
    a_config: serde_json::Value,
    b_env: &[(&str, String)],
    b_config: serde_json::Value,
) -> ((u16, String), std::process::ExitStatus, Duration) {
    let (mesh, a_to_b, a_app, b_app) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    app("a", a_app, Duration::ZERO).await;
    app("b", b_app, b_delay).await;
    let mut a = Sidecar::start_with(&dp, "a", "default", "a", &[], a_config).await;
    let mut b = Sidecar::start_with(&dp, "b", "default", "b", b_env, b_config).await;
    a.wait_ready(READY).await;
    b.wait_ready(READY).await;
    wait_for("first request", DEADLINE, || async {
        http_get(a_to_b, "/").await.ok().filter(|(c, _)| *c == 200)
    })
    .await;

    let request = tokio::spawn(async move { http_get(a_to_b, "/").await });
    tokio::time::sleep(Duration::from_millis(500)).await; // the request is now at B's app
    let t0 = tokio::time::Instant::now();
    assert!(
        Command::new("kill")
            .args(["-TERM", &b.proc.pid().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let response = request.await.unwrap().unwrap();
    let st = wait_for("B's agent to exit", Duration::from_secs(30), || {
        let s = b.proc.try_wait();
        async move { s }
    })
    .await;
    (response, st, t0.elapsed())
}

/// SIGTERM to B's agent while a slow request is in flight: the request completes, and the
/// agent exits within terminationDrainDuration plus a small margin.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_in_flight_request() {
    let ((code, body), st, took) = sigterm_b_during_request(
        Duration::from_secs(2),
        json!({}),
        &[],
        json!({"terminationDrainDuration": "4s"}),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    assert!(st.success(), "{st:?}");
    assert!(
        took >= Duration::from_millis(3800) && took < Duration::from_secs(7),
        "exit after {took:?}"
    );
}

/// With EXIT_ON_ZERO_ACTIVE_CONNECTIONS, the agent exits as soon as the last connection
/// closes after the minimum drain — long before terminationDrainDuration.
#[tokio::test(flavor = "multi_thread")]
async fn exit_on_zero_active_connections() {
    // One Envoy worker on A, so both requests share one upstream connection to B. With two,
    // the first request's connection stays idle in the other worker's pool, and an idle HTTP/1
    // keep-alive connection is never closed by Envoy's drain: EXIT_ON_ZERO_ACTIVE_CONNECTIONS
    // would then wait out terminationDrainDuration, as it does in Istio (istio#48409).
    let ((code, body), st, took) = sigterm_b_during_request(
        Duration::from_secs(3),
        json!({"concurrency": 1}),
        &[
            ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true".into()),
            ("MINIMUM_DRAIN_DURATION", "1s".into()),
        ],
        json!({"terminationDrainDuration": "60s"}),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    assert!(st.success(), "{st:?}");
    // The request needed ~2.5 s more; exit follows within the 1 s polling period plus margin,
    // far below the 60 s terminationDrainDuration.
    assert!(
        took >= Duration::from_millis(2400) && took < Duration::from_secs(12),
        "exit after {took:?}"
    );
}

/// One HTTP/1.1 request on an open keep-alive connection; returns the status line and the
/// response head's lines (lower-cased), after reading the body (`content-length`).
async fn keepalive_get(s: &mut tokio::net::TcpStream) -> (String, Vec<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"GET / HTTP/1.1\r\nhost: b.default\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = tokio::time::timeout(DEADLINE, s.read(&mut chunk))
            .await
            .expect("a response within the deadline")
            .unwrap();
        assert!(n > 0, "connection closed before a response head");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
    let mut lines = head.lines().map(str::to_owned);
    let status = lines.next().unwrap_or_default();
    let headers: Vec<String> = lines.filter(|l| !l.is_empty()).collect();
    let len: usize = headers
        .iter()
        .find_map(|h| h.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed mid-body");
        buf.extend_from_slice(&chunk[..n]);
    }
    (status, headers)
}

/// F16, outbound during the drain: after SIGTERM a sidecar drains only its inbound listeners
/// (Istio `pkg/envoy/agent.go` drains with `/drain_listeners?inboundonly&graceful`), so the
/// app's outbound calls through it keep working on their keep-alive connection and never get
/// `connection: close` while terminationDrainDuration runs (istio#44690, #47718).
#[tokio::test(flavor = "multi_thread")]
async fn f16_outbound_requests_during_the_drain_get_no_connection_close() {
    let (mesh, a_to_b, a_app, b_app) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    app("a", a_app, Duration::ZERO).await;
    app("b", b_app, Duration::ZERO).await;
    let mut a = Sidecar::start_with(
        &dp,
        "a",
        "default",
        "a",
        &[],
        json!({"terminationDrainDuration": "8s"}),
    )
    .await;
    let mut b = Sidecar::start(&dp, "b", "default", "b", &[]).await;
    a.wait_ready(READY).await;
    b.wait_ready(READY).await;
    wait_for("first request", DEADLINE, || async {
        http_get(a_to_b, "/").await.ok().filter(|(c, _)| *c == 200)
    })
    .await;
    // A keep-alive connection from A's app to A's outbound listener, used before and during
    // the drain.
    let mut conn = tokio::net::TcpStream::connect(a_to_b).await.unwrap();
    let (status, headers) = keepalive_get(&mut conn).await;
    assert!(status.contains(" 200 "), "{status}");
    let close = |h: &[String]| {
        h.iter()
            .any(|l| l.starts_with("connection:") && l.contains("close"))
    };
    assert!(!close(&headers), "before the drain: {headers:?}");

    assert!(
        Command::new("kill")
            .args(["-TERM", &a.proc.pid().to_string()])
            .status()
            .unwrap()
            .success()
    );
    wait_for("A's agent to start draining Envoy", DEADLINE, || {
        let drained = a.proc.log_text().contains("draining Envoy listeners");
        async move { drained.then_some(()) }
    })
    .await;
    assert!(
        a.proc.log_text().contains("inboundonly"),
        "a sidecar drains inbound listeners only:\n{}",
        a.proc.log_text()
    );
    // Well inside terminationDrainDuration (8 s): outbound requests on the same connection and
    // on new ones answer 200 with no `connection: close`.
    for i in 0..5 {
        let (status, headers) = keepalive_get(&mut conn).await;
        assert!(
            status.contains(" 200 "),
            "request {i} during the drain: {status}"
        );
        assert!(
            !close(&headers),
            "request {i} during the drain: {headers:?}"
        );
        let mut fresh = tokio::net::TcpStream::connect(a_to_b).await.unwrap();
        let (status, headers) = keepalive_get(&mut fresh).await;
        assert!(status.contains(" 200 "), "new connection {i}: {status}");
        assert!(!close(&headers), "new connection {i}: {headers:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        a.proc.try_wait().is_none(),
        "A exited before terminationDrainDuration"
    );
    // The contrast, so this test can fail: draining every listener (what the agent must not
    // do to a sidecar) makes Envoy answer the outbound requests with `connection: close`.
    let (code, _) = meshagent_testkit::http("POST", a.admin, "/drain_listeners?graceful&skip_exit")
        .await
        .unwrap();
    assert_eq!(code, 200);
    let (_, headers) = keepalive_get(&mut conn).await;
    assert!(
        close(&headers),
        "a fully drained outbound listener: {headers:?}"
    );
}
