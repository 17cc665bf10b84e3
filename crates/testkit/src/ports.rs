//! Free loopback ports for parallel tests, and polling with a deadline.

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::sync::Mutex;
use std::time::Duration;

static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());

/// The lowest port the kernel hands out on its own (`bind(:0)`, an outgoing connection's
/// local port): `/proc/sys/net/ipv4/ip_local_port_range`, 32768 when unreadable.
fn ephemeral_floor() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768)
}

/// A loopback port, free (TCP and UDP) a moment ago and not handed out before by this
/// process, that the kernel will not pick by itself meanwhile: it is taken below the
/// ephemeral range. (A port found with `bind(:0)` is an ephemeral one: until the test binds
/// it, any process's outgoing connection or `bind(:0)` — istiod-box's, Envoy's, another
/// test's — may take it, and the test fails with "address in use".) From 20000 up, clear of
/// the agent's and Envoy's default ports (15000–15090) and of the range's floor; randomised
/// so that test processes running side by side rarely meet.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    const FROM: u16 = 20000;
    let to = ephemeral_floor().max(FROM + 1000);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    loop {
        h.write_u32(std::process::id());
        let port = FROM + (h.finish() % u64::from(to - FROM)) as u16;
        let mut seen = HANDED_OUT.lock().unwrap();
        if seen.contains(&port) {
            continue;
        }
        let free = TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok();
        if free {
            seen.push(port);
            return port;
        }
    }
}

pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// Polls `f` until it yields `Some`, or panics after `timeout` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut delay = Duration::from_millis(20);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(250));
    }
}
