//! The UDP and TCP loops. Local answers are computed inline on the receive loop (no task, no
//! allocation beyond the reply); forwarded queries run as tasks, bounded in number.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use std::io::IoSliceMut;
use std::os::fd::AsRawFd;

use nix::sys::socket::{MsgFlags, MultiHeaders, SockaddrStorage, recvmmsg};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;

use super::handler::{Action, Core, Proto};

/// Forwarded queries in flight per UDP socket; beyond it a query is dropped (the client
/// retries), so a flood of unknown names cannot grow memory without bound.
const MAX_FORWARDS: usize = 4096;
/// TCP connections served at once per listener.
const MAX_TCP: usize = 256;
/// A TCP connection with no complete request for this long is closed.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// Datagrams read per `recvmmsg(2)` by default ([`serve_udp`]).
pub const UDP_BATCH: usize = 16;
/// A receive slot holds any UDP payload.
const SLOT: usize = 65535;

/// The UDP loop. With `batch > 1` the socket is drained with `recvmmsg(2)`, up to `batch`
/// datagrams per system call: a client with many queries in flight (a resolver, dnsperf)
/// queues them, and one wake-up and one call then take them all (dnsmasq does poll and
/// recvmsg per datagram). Replies go out one `sendto` each, as soon as each is built, so
/// batching adds no latency. `batch == 1`: one `recv_from` per datagram.
pub async fn serve_udp(sock: Arc<UdpSocket>, core: Arc<Core>, batch: usize) -> Result<(), String> {
    let forwards = Arc::new(Semaphore::new(MAX_FORWARDS));
    let mut out = Vec::with_capacity(512);
    if batch <= 1 {
        let mut buf = vec![0u8; SLOT];
        loop {
            let (n, peer) = match sock.recv_from(&mut buf).await {
                Ok(x) => x,
                // ICMP errors from earlier replies surface here on some kernels: not fatal.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => continue,
                Err(e) => return Err(format!("UDP receive: {e}")),
            };
            one(&sock, &core, &forwards, &buf[..n], peer, &mut out).await;
        }
    }
    let mut b = Batch::new(batch);
    loop {
        sock.readable()
            .await
            .map_err(|e| format!("UDP receive: {e}"))?;
        let fd = sock.as_raw_fd();
        match sock.try_io(Interest::READABLE, || b.recv(fd)) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => continue,
            Err(e) => return Err(format!("UDP receive: {e}")),
        }
        for (i, &(len, peer)) in b.got.iter().enumerate() {
            let (Some(peer), Some(pkt)) = (peer, b.bufs.get(i * SLOT..i * SLOT + len)) else {
                continue;
            };
            one(&sock, &core, &forwards, pkt, peer, &mut out).await;
        }
    }
}

/// One datagram: answered from the table on the lean path, else the general one.
async fn one(
    sock: &Arc<UdpSocket>,
    core: &Arc<Core>,
    forwards: &Arc<Semaphore>,
    pkt: &[u8],
    peer: SocketAddr,
    out: &mut Vec<u8>,
) {
    if core.answer_table(pkt, Proto::Udp, out) {
        send(sock, out, peer).await;
        return;
    }
    match core.handle_general(pkt, Proto::Udp) {
        Action::Reply(b) => send(sock, &b, peer).await,
        Action::Drop => {}
        Action::Forward(f) => {
            let Ok(permit) = forwards.clone().try_acquire_owned() else {
                tracing::debug!("too many forwarded DNS queries in flight; dropping one");
                return;
            };
            let (sock, core) = (sock.clone(), core.clone());
            tokio::spawn(async move {
                let b = core.forward(f, Proto::Udp).await;
                send(&sock, &b, peer).await;
                drop(permit);
            });
        }
    }
}

/// Receive slots for `recvmmsg(2)`, allocated once per loop: one mmapped allocation whose
/// pages become resident only where datagrams land (the first page of each slot for
/// DNS-sized ones).
struct Batch {
    n: usize,
    bufs: Vec<u8>,
    /// Per datagram of the last call: its length and sender.
    got: Vec<(usize, Option<SocketAddr>)>,
}

thread_local! {
    /// `recvmmsg`'s message headers (raw pointers, so not `Send`: they cannot live in the
    /// loop's future); one set per thread, used only inside one call.
    static HEADERS: std::cell::RefCell<Option<(usize, MultiHeaders<SockaddrStorage>)>> =
        const { std::cell::RefCell::new(None) };
}

impl Batch {
    fn new(n: usize) -> Batch {
        Batch {
            n,
            bufs: vec![0u8; n * SLOT],
            got: Vec::with_capacity(n),
        }
    }

    /// One non-blocking `recvmmsg`: at least one datagram, or an error (`WouldBlock`).
    fn recv(&mut self, fd: std::os::fd::RawFd) -> std::io::Result<usize> {
        let Batch { n, bufs, got } = self;
        got.clear();
        HEADERS.with_borrow_mut(|slot| {
            let headers = match slot {
                Some((len, h)) if *len == *n => h,
                _ => &mut slot.insert((*n, MultiHeaders::preallocate(*n, None))).1,
            };
            let mut iovs: Vec<[IoSliceMut<'_>; 1]> = bufs
                .chunks_exact_mut(SLOT)
                .map(|c| [IoSliceMut::new(c)])
                .collect();
            let msgs = recvmmsg(fd, headers, iovs.iter_mut(), MsgFlags::MSG_DONTWAIT, None)
                .map_err(std::io::Error::from)?;
            for m in msgs {
                let peer = m.address.as_ref().and_then(|a| {
                    a.as_sockaddr_in()
                        .map(|v4| SocketAddr::V4((*v4).into()))
                        .or_else(|| a.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into())))
                });
                got.push((m.bytes, peer));
            }
            Ok(got.len())
        })
    }
}

async fn send(sock: &UdpSocket, b: &[u8], peer: SocketAddr) {
    if let Err(e) = sock.send_to(b, peer).await {
        tracing::debug!(%peer, error = %e, "cannot send a DNS reply");
    }
}

pub async fn serve_tcp(listener: TcpListener, core: Arc<Core>) -> Result<(), String> {
    let conns = Arc::new(Semaphore::new(MAX_TCP));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "DNS TCP accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = conns.clone().try_acquire_owned() else {
            tracing::debug!(%peer, "too many DNS TCP connections; closing one");
            continue;
        };
        let core = core.clone();
        tokio::spawn(async move {
            if let Err(e) = connection(stream, &core).await {
                tracing::debug!(%peer, error = %e, "DNS TCP connection ended");
            }
            drop(permit);
        });
    }
}

async fn connection(mut s: TcpStream, core: &Core) -> std::io::Result<()> {
    let _ = s.set_nodelay(true);
    loop {
        let len = match tokio::time::timeout(TCP_IDLE, s.read_u16()).await {
            Ok(Ok(n)) => n as usize,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Ok(()),
        };
        let mut buf = vec![0u8; len];
        match tokio::time::timeout(TCP_IDLE, s.read_exact(&mut buf)).await {
            Ok(r) => r?,
            Err(_) => return Ok(()),
        };
        let reply = match core.handle(&buf, Proto::Tcp) {
            Action::Reply(b) => b,
            Action::Drop => continue,
            Action::Forward(f) => core.forward(f, Proto::Tcp).await,
        };
        let Ok(n) = u16::try_from(reply.len()) else {
            continue;
        };
        let mut out = Vec::with_capacity(reply.len() + 2);
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&reply);
        s.write_all(&out).await?;
    }
}
