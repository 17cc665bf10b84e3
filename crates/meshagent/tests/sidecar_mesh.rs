//! The demo scenario end to end: devplane plus two `meshagent proxy sidecar` processes, each
//! run with Istio's env vars in its own working directory exactly as a pod runs it; A's app
//! calls B through both Envoys over mTLS. Also readiness, `wait`, and graceful drain with a
//! slow request in flight.

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
