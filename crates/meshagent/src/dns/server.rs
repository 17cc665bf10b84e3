//! The UDP and TCP loops. Local answers are computed inline on the receive loop (no task, no
//! allocation beyond the reply); forwarded queries run as tasks, bounded in number.
//!
//! This module holds one audited `unsafe` call: `sendmmsg(2)` ([`sendmmsg`]). nix's safe
//! wrapper (nix 0.30 `sys::socket::sendmmsg`) does not fit: how many datagrams the kernel
//! took is only readable through its `MultiResults` iterator, which `assume_init`s the
//! address slots of its `MultiHeaders` — slots a send never writes, so reading them is
//! undefined behaviour — and it wants the replies as one `[IoSlice]` group per message plus
//! an `Option` per address, which borrow the batch's buffers and so would be rebuilt (one
//! allocation) per call, where the raw call reuses one thread's header arrays.

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
/// A TCP connection with no request started for this long after its last reply is closed.
const TCP_IDLE: Duration = Duration::from_secs(10);
/// Within this each: the first request after the connect, a started request whole, and its
/// reply written whole (miekg/dns's `ReadTimeout`/`WriteTimeout`, which Istio's
/// `pkg/dns/client` server uses). A peer that sends queries and never reads the replies
/// holds its connection slot, and a reply buffer, for at most this long after the socket's
/// buffers fill. Forwarding in between is bounded by `DNS_FORWARD_TIMEOUT`.
pub const TCP_IO: Duration = Duration::from_secs(2);

/// Datagrams read per `recvmmsg(2)` by default ([`serve_udp`]).
pub const UDP_BATCH: usize = 16;
/// A receive slot holds any UDP payload.
const SLOT: usize = 65535;

/// The UDP loop. With `batch > 1` the socket is drained with `recvmmsg(2)`, up to `batch`
/// datagrams per system call: a client with many queries in flight (a resolver, dnsperf)
/// queues them, and one wake-up and one call then take them all (dnsmasq does poll and
/// recvmsg per datagram). The replies answered inline (table answers, local errors) go out
/// together with one `sendmmsg(2)` once the batch is done: building one takes ~1 µs, so the
/// first reply of a full batch waits ~15 µs, and the client is woken once per batch instead
/// of once per reply. Forwarded replies go out from their tasks. `batch == 1`: one
/// `recv_from` per datagram, its reply sent on its own.
pub async fn serve_udp(sock: Arc<UdpSocket>, core: Arc<Core>, batch: usize) -> Result<(), String> {
    let forwards = Arc::new(Semaphore::new(MAX_FORWARDS));
    let mut replies = Replies::default();
    if batch <= 1 {
        let mut buf = vec![0u8; SLOT];
        loop {
            let (n, peer) = match sock.recv_from(&mut buf).await {
                Ok(x) => x,
                // ICMP errors from earlier replies surface here on some kernels: not fatal.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => continue,
                Err(e) => return Err(format!("UDP receive: {e}")),
            };
            one(&sock, &core, &forwards, &buf[..n], peer, &mut replies);
            replies.flush(&sock).await;
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
            one(&sock, &core, &forwards, pkt, peer, &mut replies);
        }
        replies.flush(&sock).await;
    }
}

/// One datagram, answered from the table on the lean path, else the general one: a reply
/// built inline joins `replies` (the caller flushes them); a forwarded query gets its task.
fn one(
    sock: &Arc<UdpSocket>,
    core: &Arc<Core>,
    forwards: &Arc<Semaphore>,
    pkt: &[u8],
    peer: SocketAddr,
    replies: &mut Replies,
) {
    if core.answer_table(pkt, Proto::Udp, replies.slot()) {
        replies.commit(peer);
        return;
    }
    match core.handle_general(pkt, Proto::Udp) {
        Action::Reply(b) => {
            let slot = replies.slot();
            slot.clear();
            slot.extend_from_slice(&b);
            replies.commit(peer);
        }
        Action::Drop => {}
        Action::Forward(f) => forward(sock, core, forwards, f, peer),
    }
}

fn forward(
    sock: &Arc<UdpSocket>,
    core: &Arc<Core>,
    forwards: &Arc<Semaphore>,
    f: super::handler::Forward,
    peer: SocketAddr,
) {
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

/// The replies of one receive batch, waiting for one `sendmmsg`. The buffers keep their
/// capacity from batch to batch.
#[derive(Default)]
struct Replies {
    bufs: Vec<Vec<u8>>,
    peers: Vec<SockaddrStorage>,
    /// Replies pending: `bufs[..n]` to `peers[..n]`.
    n: usize,
}

impl Replies {
    /// The buffer for the next reply (its old content is the caller's to clear).
    fn slot(&mut self) -> &mut Vec<u8> {
        if self.bufs.len() == self.n {
            self.bufs.push(Vec::with_capacity(512));
        }
        &mut self.bufs[self.n]
    }

    /// The reply in [`Replies::slot`] is complete: it goes to `peer`.
    fn commit(&mut self, peer: SocketAddr) {
        self.peers.truncate(self.n);
        self.peers.push(peer.into());
        self.n += 1;
    }

    /// Sends every pending reply: as many per call as the kernel takes, waiting for
    /// writability when the socket's buffer is full. A reply the kernel refuses (an
    /// unreachable or filtered peer) is logged and dropped, as a failed `sendto` is.
    async fn flush(&mut self, sock: &UdpSocket) {
        let fd = sock.as_raw_fd();
        let mut sent = 0;
        while sent < self.n {
            let (bufs, peers) = (&self.bufs[sent..self.n], &self.peers[sent..self.n]);
            match sock
                .async_io(Interest::WRITABLE, || sendmmsg(fd, bufs, peers))
                .await
            {
                Ok(k) => sent += k.max(1),
                Err(e) => {
                    tracing::debug!(peer = %self.peers[sent], error = %e, "cannot send a DNS reply");
                    sent += 1;
                }
            }
        }
        self.n = 0;
    }
}

/// One non-blocking `sendmmsg(2)` of `bufs[i]` to `peers[i]`: how many the kernel took (at
/// least one), or the error of the first.
#[allow(unsafe_code)]
fn sendmmsg(
    fd: std::os::fd::RawFd,
    bufs: &[Vec<u8>],
    peers: &[SockaddrStorage],
) -> std::io::Result<usize> {
    use nix::sys::socket::SockaddrLike;
    thread_local! {
        /// The header arrays of the last call on this thread, kept for their capacity (the
        /// pointers they hold are overwritten before every call, never read after it).
        static ARRAYS: std::cell::RefCell<(Vec<libc::iovec>, Vec<libc::mmsghdr>)> =
            const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    }
    // UIO_MAXIOV: the kernel's cap on messages per call.
    let n = bufs.len().min(peers.len()).min(1024);
    let r = ARRAYS.with_borrow_mut(|(iovs, hdrs)| {
        iovs.clear();
        iovs.extend(bufs[..n].iter().map(|b| libc::iovec {
            iov_base: b.as_ptr().cast_mut().cast(),
            iov_len: b.len(),
        }));
        hdrs.clear();
        hdrs.extend(iovs.iter_mut().zip(peers).map(|(iov, peer)| {
            // SAFETY: `mmsghdr` is plain data (pointers, lengths, flags); all-zero is a valid
            // value of it (null pointers, zero lengths).
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_name = peer.as_ptr().cast_mut().cast();
            h.msg_hdr.msg_namelen = peer.len();
            h.msg_hdr.msg_iov = iov;
            h.msg_hdr.msg_iovlen = 1;
            h
        }));
        // SAFETY: `hdrs` holds `n` headers initialised just above; each points at one iovec
        // of `iovs` and at one address of `peers`, which the kernel only reads for a send,
        // and each iovec at one buffer of `bufs`; all of them outlive the call, which keeps
        // no pointer after it returns. The kernel writes only each header's `msg_len`.
        unsafe { libc::sendmmsg(fd, hdrs.as_mut_ptr(), n as libc::c_uint, libc::MSG_DONTWAIT) }
    });
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(r as usize)
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
    // miekg's server: the first request within its read timeout of the connect, later ones
    // within the idle timeout of the last reply.
    let mut wait = TCP_IO;
    loop {
        let len = match tokio::time::timeout(wait, s.read_u16()).await {
            Ok(Ok(n)) => n as usize,
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Ok(()),
        };
        wait = TCP_IDLE;
        let mut buf = vec![0u8; len];
        match tokio::time::timeout(TCP_IO, s.read_exact(&mut buf)).await {
            Ok(r) => r?,
            Err(_) => return Err(timed_out("reading a request")),
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
        match tokio::time::timeout(TCP_IO, s.write_all(&out)).await {
            Ok(r) => r?,
            // The peer does not read: the connection is closed (dropped) and its slot freed.
            Err(_) => return Err(timed_out("writing a reply")),
        }
    }
}

fn timed_out(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what} took over {TCP_IO:?}"),
    )
}
