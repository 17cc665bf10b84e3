//! Two agents started in one working directory: the second must not take the first's live
//! `XDS` socket (which made both supervisors rebind in turn forever, readiness flapping on
//! both); it fails at startup naming the socket.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::os::unix::fs::MetadataExt as _;
use std::time::Duration;

use meshagent_testkit::{Devplane, Sidecar, http_get, json, two_workload_mesh};
use tokio::time::Instant;

const READY: Duration = Duration::from_secs(40);

fn inode(p: &std::path::Path) -> Option<u64> {
    std::fs::symlink_metadata(p).ok().map(|m| m.ino())
}

#[tokio::test(flavor = "multi_thread")]
async fn q2_second_agent_leaves_a_live_xds_socket_alone_and_fails_clearly() {
    let (mesh, ..) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    let mut first = Sidecar::start(&dp, "a", "default", "a", &[]).await;
    first.wait_ready(READY).await;
    let proxy_dir = first.cwd.path().join("etc/istio/proxy");
    let socket = proxy_dir.join("XDS");
    let inode0 = inode(&socket).expect("the first agent's XDS socket");

    // The second agent's configPath is the first one's directory (its other files, e.g. its
    // SDS socket, stay its own, so only the XDS socket is contended).
    let cwd2 = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(cwd2.path().join("etc/istio")).unwrap();
    std::os::unix::fs::symlink(&proxy_dir, cwd2.path().join("etc/istio/proxy")).unwrap();
    let token = dp.token("default", "a", 3600).await;
    let mut second =
        Sidecar::start_in(cwd2, &dp, "a", "default", "a", &[], json!({}), &token).await;

    // Over 10 s: the socket's inode changes at most once, the first agent stays ready.
    let started = Instant::now();
    let (mut changes, mut last, mut unready) = (0, Some(inode0), Vec::new());
    let mut second_exit = None;
    while started.elapsed() < Duration::from_secs(10) {
        let now = inode(&socket);
        if now != last {
            changes += 1;
            last = now;
        }
        match http_get(first.status, "/healthz/ready").await {
            Ok((200, _)) => {}
            other => unready.push(format!("{:?}: {other:?}", started.elapsed())),
        }
        if second_exit.is_none() {
            second_exit = second.proc.try_wait();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log2 = second.proc.log_text();
    assert!(
        changes <= 1,
        "the XDS socket changed {changes} times in 10 s\nsecond agent:\n{log2}"
    );
    assert!(
        unready.is_empty(),
        "the first agent's readiness flapped: {unready:?}\nfirst agent:\n{}",
        first.proc.log_text()
    );
    let status = second_exit.unwrap_or_else(|| panic!("the second agent kept running:\n{log2}"));
    assert!(!status.success(), "the second agent exited 0:\n{log2}");
    assert!(
        log2.contains("XDS") && log2.contains("in use by a live process"),
        "the second agent's error names the socket and the cause:\n{log2}"
    );
    assert_eq!(
        inode(&socket),
        Some(inode0),
        "the first agent's socket is untouched"
    );
    // And the first agent still serves on it.
    assert!(meshagent::uds::accepts_connections(&socket));
}
