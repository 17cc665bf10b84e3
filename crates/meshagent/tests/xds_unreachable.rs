//! Upstream unreachable: every attempt Envoy makes through the agent fails with one clear log
//! line naming the address, `istiod_connection_failures` grows, and Envoy keeps retrying on its
//! own backoff (the agent never retries or holds Envoy's stream).
//!
//! Own test binary: it installs a global log capture.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod xds_support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshagent_testkit::{Envoy, free_port, wait_for};
use xds_support::*;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn unreachable_upstream_is_logged_per_attempt_and_counted() {
    let logs = Capture::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .init();

    // Nothing listens on this port; plaintext so the failure is the TCP dial itself.
    let addr = format!("127.0.0.1:{}", free_port());
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(
        dir.path(),
        &addr,
        None,
        &[(
            "PROXY_CONFIG",
            &format!("discoveryAddress: {addr}\ncontrolPlaneAuthPolicy: NONE\n"),
        )],
    );
    let envoy = Envoy::start(bootstrap(agent.handle.socket(), false, None), dir.path());

    // Envoy reports a closed ADS stream at debug level (warning only after 30 s of failures).
    wait_for("Envoy's admin", Duration::from_secs(10), || async {
        matches!(
            meshagent_testkit::http("POST", envoy.admin, "/logging?config=debug").await,
            Ok((200, _))
        )
        .then_some(())
    })
    .await;

    let line = format!("failed to connect to upstream XDS server {addr}");
    let failures = || agent.metric("istio_agent_istiod_connection_failures");
    wait_for("three failed attempts", Duration::from_secs(60), || async {
        (failures() >= 3.0).then_some(())
    })
    .await;
    // Envoy drives the retries: its own request counter on xds-grpc grows with ours.
    let envoy_attempts = envoy
        .stat("cluster.xds-grpc.upstream_rq_total")
        .await
        .unwrap();
    assert!(envoy_attempts >= 3, "Envoy attempts: {envoy_attempts}");
    // Exactly one log line per attempt, naming the address (the count may be one ahead of the
    // metric snapshot while an attempt is in flight).
    let n_failures = failures() as usize;
    let text = logs.text();
    let n_lines = text.lines().filter(|l| l.contains(&line)).count();
    assert!(
        n_lines == n_failures || n_lines == n_failures + 1 || n_lines + 1 == n_failures,
        "{n_lines} log lines for {n_failures} failures:\n{text}"
    );
    assert!(n_lines >= 3, "{text}");
    eprintln!(
        "example: {}",
        text.lines().find(|l| l.contains(&line)).unwrap_or_default()
    );
    // Envoy's stream ended with the agent's Unavailable status naming the address, so Envoy's
    // own log says why.
    wait_for(
        "Envoy to log the agent's status",
        Duration::from_secs(10),
        || async {
            let log = envoy.proc.log_text();
            log.lines()
                .any(|l| {
                    l.contains("14, agent could not connect to upstream XDS server")
                        && l.contains(&addr)
                })
                .then_some(())
        },
    )
    .await;
    // Retries are spaced by Envoy's backoff, not a tight loop in the agent.
    tokio::time::sleep(SHORT).await;
    assert!(failures() < 20.0, "too many attempts: {}", failures());
    assert!(!agent.shutdown.is_cancelled());
}
