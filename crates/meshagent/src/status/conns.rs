//! The status server's connection table: a bound on open connections that never refuses a new
//! one.
//!
//! Istio's status server (`pilot/cmd/pilot-agent/status/server.go`, a plain Go `http.Server`)
//! has no connection limit, so a peer holding thousands of idle connections only runs the
//! agent out of file descriptors. Closing new connections at a fixed cap is worse: a peer on
//! the pod network holding the cap's worth of idle connections makes every kubelet probe fail.
//! Here the cap is sized from the open-files limit and, when it is reached, the new
//! connection is served and an older one is closed instead, chosen in this order:
//!
//! 1. the non-loopback connection idle the longest (no request being answered: waiting for
//!    its first request, between keep-alive requests, or sending headers slowly);
//! 2. the non-loopback connection whose request started first (a client that stopped reading
//!    its response holds the connection as long as it likes otherwise);
//! 3. the same two for loopback connections: Envoy's pooled health-check connections and local
//!    scrapers, closed only when nothing else is left.
//!
//! So every new connection is served, a request in flight is closed only when everything
//! else is, and a remote peer never closes a loopback connection while it holds one itself.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

/// Upper bound of the cap whatever the open-files limit. A connection that has not sent a
/// byte costs about 1.5 KiB of heap (its task waits outside hyper), one that has sent part of
/// a request about 25 KiB (hyper's buffers; debug build), so even a peer trickling bytes on
/// every connection keeps the table near 100 MiB; beyond the cap, old idle connections are
/// closed.
pub const MAX_CONNECTIONS: usize = 4096;
/// Lower bound of the cap: enough for kubelet, Envoy and a scraper whatever the limit.
pub const MIN_CONNECTIONS: usize = 16;
/// File descriptors left to the rest of the agent when the limit allows: Envoy admin and
/// Prometheus connections, xDS and SDS streams, the DNS proxy's sockets (up to 256 TCP
/// clients), app probe and scrape connections, files and the Wasm cache.
pub const FD_RESERVE: u64 = 512;
/// How often the "evicting connections" warning is repeated while a flood lasts.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// The cap for an open-files (soft) limit: the limit less [`FD_RESERVE`], but never more than
/// half of a small limit, clamped to [`MIN_CONNECTIONS`]..=[`MAX_CONNECTIONS`].
pub fn cap_for_fd_limit(soft: u64) -> usize {
    let cap = soft.saturating_sub(FD_RESERVE).max(soft / 2);
    usize::try_from(cap)
        .unwrap_or(usize::MAX)
        .clamp(MIN_CONNECTIONS, MAX_CONNECTIONS)
}

/// The cap for this process's current soft `RLIMIT_NOFILE` (raised to the hard limit at start
/// by [`crate::app::raise_fd_limit`], as Go does).
pub fn cap_from_rlimit() -> usize {
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) => cap_for_fd_limit(soft),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-files limit; status server assumes 1024");
            cap_for_fd_limit(1024)
        }
    }
}

/// Eviction order: lower first. See the module docs.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Class {
    RemoteIdle = 0,
    RemoteBusy = 1,
    LocalIdle = 2,
    LocalBusy = 3,
}

struct Entry {
    /// Position in `order`: class and the sequence number taken when it entered the class.
    key: (Class, u64),
    local: bool,
    /// Requests being answered (HTTP/1 answers one at a time; a count keeps it exact).
    busy: u32,
    evict: CancellationToken,
}

#[derive(Default)]
struct Inner {
    next: u64,
    conns: HashMap<u64, Entry>,
    order: BTreeMap<(Class, u64), u64>,
    evicted: u64,
    logged_at: Option<Instant>,
}

impl Inner {
    fn seq(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn move_to(&mut self, id: u64, class: Class) {
        let seq = self.seq();
        let Some(e) = self.conns.get_mut(&id) else {
            return;
        };
        self.order.remove(&e.key);
        e.key = (class, seq);
        self.order.insert(e.key, id);
    }

    /// Closes the first connection in eviction order; false when the table is empty.
    fn evict_one(&mut self) -> bool {
        let Some((_, id)) = self.order.pop_first() else {
            return false;
        };
        if let Some(e) = self.conns.remove(&id) {
            e.evict.cancel();
        }
        self.evicted += 1;
        true
    }
}

/// Shared by the accept loop and every connection task.
pub struct ConnTable {
    cap: usize,
    inner: Mutex<Inner>,
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

impl ConnTable {
    pub fn new(cap: usize) -> Arc<ConnTable> {
        Arc::new(ConnTable {
            cap: cap.max(1),
            inner: Mutex::default(),
        })
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    pub fn len(&self) -> usize {
        self.lock().conns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections closed to make room so far.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing panics while holding the lock; a poisoned table is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a new connection, closing another first when the table is full. The connection
    /// must close when the returned handle's [`ConnHandle::evicted`] token is cancelled.
    pub fn register(self: &Arc<Self>, peer: SocketAddr) -> ConnHandle {
        let local = is_loopback(peer.ip());
        let evict = CancellationToken::new();
        let mut inner = self.lock();
        let mut closed = 0u64;
        while inner.conns.len() >= self.cap && inner.evict_one() {
            closed += 1;
        }
        if closed > 0 {
            let now = Instant::now();
            if inner
                .logged_at
                .is_none_or(|t| now.duration_since(t) >= LOG_EVERY)
            {
                inner.logged_at = Some(now);
                tracing::warn!(
                    max = self.cap,
                    evicted_total = inner.evicted,
                    %peer,
                    "status server at its connection limit; closing the oldest idle connections to serve new ones"
                );
            }
        }
        let id = inner.seq();
        let class = if local {
            Class::LocalIdle
        } else {
            Class::RemoteIdle
        };
        let key = (class, inner.seq());
        inner.conns.insert(
            id,
            Entry {
                key,
                local,
                busy: 0,
                evict: evict.clone(),
            },
        );
        inner.order.insert(key, id);
        ConnHandle {
            table: self.clone(),
            id,
            evict,
        }
    }

    /// Closes one connection to free a file descriptor (the accept loop ran out of them);
    /// false when there is none.
    pub fn evict_for_fd(&self) -> bool {
        self.lock().evict_one()
    }

    fn set_busy(&self, id: u64, delta: i32) {
        let mut inner = self.lock();
        let Some(e) = inner.conns.get_mut(&id) else {
            return;
        };
        e.busy = e.busy.saturating_add_signed(delta);
        let class = match (e.local, e.busy > 0) {
            (false, false) => Class::RemoteIdle,
            (false, true) => Class::RemoteBusy,
            (true, false) => Class::LocalIdle,
            (true, true) => Class::LocalBusy,
        };
        inner.move_to(id, class);
    }
}

/// One connection's entry; removed from the table on drop.
pub struct ConnHandle {
    table: Arc<ConnTable>,
    id: u64,
    evict: CancellationToken,
}

impl ConnHandle {
    /// Cancelled when the table closes this connection to make room.
    pub fn evicted(&self) -> &CancellationToken {
        &self.evict
    }

    /// Marks a request as being answered until the guard drops (with the response body).
    pub fn busy(&self) -> BusyGuard {
        self.table.set_busy(self.id, 1);
        BusyGuard {
            table: self.table.clone(),
            id: self.id,
        }
    }
}

impl Drop for ConnHandle {
    fn drop(&mut self) {
        let mut inner = self.table.lock();
        if let Some(e) = inner.conns.remove(&self.id) {
            inner.order.remove(&e.key);
        }
    }
}

/// A request in flight; see [`ConnHandle::busy`].
pub struct BusyGuard {
    table: Arc<ConnTable>,
    id: u64,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.table.set_busy(self.id, -1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cap_follows_the_fd_limit() {
        assert_eq!(cap_for_fd_limit(1024), 512);
        assert_eq!(cap_for_fd_limit(4096), 3584);
        assert_eq!(cap_for_fd_limit(256), 128);
        assert_eq!(cap_for_fd_limit(10), MIN_CONNECTIONS);
        assert_eq!(cap_for_fd_limit(1 << 20), MAX_CONNECTIONS);
        assert_eq!(cap_for_fd_limit(u64::MAX), MAX_CONNECTIONS);
    }

    #[test]
    fn evicts_remote_idle_then_remote_busy_then_loopback() {
        let t = ConnTable::new(3);
        let local = t.register(addr("127.0.0.1:1"));
        let busy_remote = t.register(addr("10.0.0.9:1"));
        let req = busy_remote.busy();
        let idle_remote = t.register(addr("10.0.0.9:2"));
        // Full: the idle remote one goes, though it is the newest.
        let n1 = t.register(addr("10.0.0.9:3"));
        assert!(idle_remote.evicted().is_cancelled());
        assert!(!busy_remote.evicted().is_cancelled() && !local.evicted().is_cancelled());
        assert_eq!(t.len(), 3);
        // Next: the new (idle) remote one, then the busy remote one, then loopback.
        let n2 = t.register(addr("10.0.0.9:4"));
        assert!(n1.evicted().is_cancelled());
        let n3 = t.register(addr("10.0.0.9:5"));
        assert!(n2.evicted().is_cancelled());
        assert!(!busy_remote.evicted().is_cancelled());
        drop(req);
        // Idle again, but since after n3: n3 has been idle the longest.
        let _n4 = t.register(addr("10.0.0.9:6"));
        assert!(n3.evicted().is_cancelled());
        assert!(!busy_remote.evicted().is_cancelled());
        let _n5 = t.register(addr("10.0.0.9:7"));
        assert!(busy_remote.evicted().is_cancelled());
        assert!(!local.evicted().is_cancelled());
        assert_eq!(t.evicted(), 5);
        drop(local);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn loopback_goes_last_and_empty_table_evicts_nothing() {
        let t = ConnTable::new(1);
        assert!(!t.evict_for_fd());
        let a = t.register(addr("[::1]:1"));
        let b = t.register(addr("[::ffff:127.0.0.1]:1"));
        assert!(a.evicted().is_cancelled() && !b.evicted().is_cancelled());
        assert!(t.evict_for_fd());
        assert!(b.evicted().is_cancelled());
        assert!(t.is_empty());
    }
}
