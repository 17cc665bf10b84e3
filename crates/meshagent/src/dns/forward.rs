//! Upstream exchanges. Unlike Istio's miekg client (512-byte UDP buffer unless the client's
//! OPT says more, istio#61371), UDP replies are read into a 64 KiB buffer: whatever the
//! upstream sends is relayed, truncated to the client's own limit afterwards.

use std::net::SocketAddr;
use std::time::Duration;

use futures::FutureExt;
use hickory_proto::op::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{TcpStream, UdpSocket};

use super::handler::Proto;
use super::view::{Outcome, UpstreamStats};
use super::wire::question;

/// The upstream's reply as it sent it, and decoded.
pub type Reply = (Vec<u8>, Message);

pub async fn sequential(
    pool: &Pool,
    stats: &UpstreamStats,
    servers: &[SocketAddr],
    raw: &[u8],
    proto: Proto,
    timeout: Duration,
) -> Result<(Reply, SocketAddr), String> {
    let mut last = "no upstream servers in resolv.conf".to_owned();
    for s in servers {
        match exchange(pool, stats, *s, raw, proto, timeout).await {
            Ok(r) => return Ok((r, *s)),
            Err(e) => {
                tracing::debug!(upstream = %s, error = %e, "upstream exchange failed");
                last = format!("{s}: {e}");
            }
        }
    }
    Err(last)
}

pub async fn parallel(
    pool: &Pool,
    stats: &UpstreamStats,
    servers: &[SocketAddr],
    raw: &[u8],
    proto: Proto,
    timeout: Duration,
) -> Result<(Reply, SocketAddr), String> {
    if servers.is_empty() {
        return Err("no upstream servers in resolv.conf".to_owned());
    }
    let all = servers.iter().map(|s| {
        exchange(pool, stats, *s, raw, proto, timeout)
            .map(move |r| r.map(|r| (r, *s)).map_err(|e| format!("{s}: {e}")))
            .boxed()
    });
    futures::future::select_ok(all).await.map(|(r, _)| r)
}

/// One exchange with one server, bounded by `timeout` as a whole (Istio applies it to dial,
/// write and read each). Counted in `stats` when it ends (an exchange dropped unfinished, a
/// parallel one that lost the race, counts as sent only).
pub async fn exchange(
    pool: &Pool,
    stats: &UpstreamStats,
    server: SocketAddr,
    raw: &[u8],
    proto: Proto,
    timeout: Duration,
) -> Result<Reply, String> {
    let io = async {
        match proto {
            Proto::Udp => udp(pool, server, raw).await,
            Proto::Tcp => tcp(server, raw).await,
        }
    };
    stats.sent(server);
    let start = tokio::time::Instant::now();
    let r = match tokio::time::timeout(timeout, io).await {
        Ok(r) => r,
        Err(_) => {
            stats.ended(server, start.elapsed(), Outcome::Timeout);
            return Err(format!("i/o timeout after {timeout:?}"));
        }
    };
    match &r {
        Ok(_) => stats.ended(server, start.elapsed(), Outcome::Answered),
        Err(e) => stats.ended(server, start.elapsed(), Outcome::Error(e)),
    }
    r
}

fn id_of(raw: &[u8]) -> u16 {
    u16::from_be_bytes([raw[0], raw[1]])
}

/// The reply must answer our query: our ID (checked by the caller)
/// and the same question (compared on the wire, names case-insensitively: the question is
/// forwarded unchanged, but some servers normalise case). It is decoded in full, as miekg's
/// `Exchange` does: a malformed reply is this server's failure (the next one is tried), not
/// something to relay.
fn check(reply: &[u8], query: &[u8]) -> Result<Message, String> {
    let m = Message::from_vec(reply).map_err(|e| format!("malformed reply: {e}"))?;
    // A reply with no question section (some servers on FORMERR/SERVFAIL) is still ours.
    // A query without exactly one plain question is not checked further.
    if !m.queries.is_empty()
        && let Some(qq) = question(query)
        && !question(reply).is_some_and(|rq| rq.eq_ignore_ascii_case(qq))
    {
        return Err("reply question does not match the query".to_owned());
    }
    Ok(m)
}

/// Connected UDP sockets to upstreams, kept for reuse: creating, binding and connecting a
/// socket per query (what miekg does) costs more than the exchange itself on loopback. A socket
/// goes back only after a clean exchange, so a late reply to a timed-out query is never waiting
/// in it (and would be discarded by the ID and question checks anyway). One pool per proxy: a
/// socket belongs to the runtime that registered it.
///
/// Reuse must not make replies easier to spoof than Istio's fresh socket per query (an
/// unpredictable ephemeral port, RFC 5452 §9.2): every exchange sends an ID drawn at random
/// for it, not the client's (see [`udp`]), and a socket is closed after [`POOL_REUSE`]
/// exchanges, so its source port does not stay the same for long.
#[derive(Default)]
pub struct Pool(std::sync::Mutex<Vec<(SocketAddr, UdpSocket, u32)>>);

/// Exchanges one pooled socket serves before it is closed and replaced: its port changes
/// that often, for 1/64 of a socket's set-up cost per query.
const POOL_REUSE: u32 = 64;

/// Sockets kept per proxy: as many as the queries a burst keeps in flight (glibc sends A and
/// AAAA together; a client with a thread pool sends dozens). With 64, dnsperf's 100 in flight
/// opened, registered and closed a socket for a third of its queries: 15 % of the proxy's
/// forwarding CPU (docs/benchmarks-log.md, DNS proxy). Beyond the cap a socket is opened per
/// query and closed after it, as miekg does. An idle socket costs the kernel ~1 KiB and the
/// agent one descriptor.
const POOL_MAX: usize = 256;

impl Pool {
    /// A pooled socket to `server` and the exchanges it has served.
    fn take(&self, server: SocketAddr) -> Option<(UdpSocket, u32)> {
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let i = p.iter().rposition(|(a, _, _)| *a == server)?;
        let (_, sock, uses) = p.swap_remove(i);
        Some((sock, uses))
    }

    /// `sock` has served `uses` exchanges, the last one clean.
    fn give_back(&self, server: SocketAddr, sock: UdpSocket, uses: u32) {
        if uses >= POOL_REUSE {
            return;
        }
        let mut p = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if p.len() < POOL_MAX {
            p.push((server, sock, uses));
        }
    }
}

thread_local! {
    /// Where upstream UDP replies land: one 64 KiB buffer per thread, not one per query or
    /// per pooled socket (read synchronously once the socket is readable, copied out at once).
    static RECV_BUF: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0u8; 65535].into_boxed_slice());
}

/// One UDP exchange. The upstream gets the query with an ID drawn for this exchange (the
/// client's own may be predictable, and the socket's port is reused); the reply must carry
/// that ID, and the client's is put back in it (bytes and decoded message) before it goes on.
async fn udp(pool: &Pool, server: SocketAddr, raw: &[u8]) -> Result<Reply, String> {
    let client_id = id_of(raw);
    let ours: u16 = rand::random();
    let mut query = raw.to_vec();
    query[..2].copy_from_slice(&ours.to_be_bytes());
    let (sock, uses) = match pool.take(server) {
        Some(s) => s,
        None => {
            let local: SocketAddr = if server.is_ipv4() {
                (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
            } else {
                (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
            };
            let sock = UdpSocket::bind(local).await.map_err(|e| e.to_string())?;
            sock.connect(server).await.map_err(|e| e.to_string())?;
            (sock, 0)
        }
    };
    sock.send(&query).await.map_err(|e| e.to_string())?;
    loop {
        // ERROR too: an ICMP port unreachable for the connected socket sets its error without
        // making it readable (Linux `datagram_poll` reports EPOLLERR alone), and the exchange
        // would sit out the whole timeout. Go's resolver sees the refusal on its next read and
        // moves to the next server at once (miekg/dns `Exchange`, `pkg/dns/client/dns.go`).
        let ready = sock
            .ready(Interest::READABLE | Interest::ERROR)
            .await
            .map_err(|e| e.to_string())?;
        if ready.is_error() {
            if let Some(e) = sock.take_error().map_err(|e| e.to_string())? {
                return Err(e.to_string());
            }
            // No error pending after all: clear the readiness so the next wait blocks.
            let _ = sock.try_io(Interest::ERROR, || {
                Err::<(), _>(std::io::Error::from(std::io::ErrorKind::WouldBlock))
            });
            if !ready.is_readable() {
                continue;
            }
        }
        let got = RECV_BUF.with_borrow_mut(|buf| match sock.try_recv(buf) {
            Ok(n) => {
                let reply = &buf[..n];
                // Stray datagrams (wrong ID) are ignored, as miekg does; the timeout bounds
                // the wait.
                if n < 12 || id_of(reply) != ours {
                    return Ok(None);
                }
                check(reply, raw).map(|mut m| {
                    let mut bytes = reply.to_vec();
                    bytes[..2].copy_from_slice(&client_id.to_be_bytes());
                    m.metadata.id = client_id;
                    Some((bytes, m))
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e.to_string()),
        })?;
        if let Some(r) = got {
            pool.give_back(server, sock, uses + 1);
            return Ok(r);
        }
    }
}

async fn tcp(server: SocketAddr, raw: &[u8]) -> Result<Reply, String> {
    let mut s = TcpStream::connect(server)
        .await
        .map_err(|e| e.to_string())?;
    let _ = s.set_nodelay(true);
    let len = u16::try_from(raw.len()).map_err(|_| "query too large for TCP".to_owned())?;
    let mut out = Vec::with_capacity(raw.len() + 2);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(raw);
    s.write_all(&out).await.map_err(|e| e.to_string())?;
    loop {
        let n = s.read_u16().await.map_err(|e| e.to_string())? as usize;
        let mut buf = vec![0u8; n];
        s.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
        if n < 12 || id_of(&buf) != id_of(raw) {
            continue;
        }
        let m = check(&buf, raw)?;
        return Ok((buf, m));
    }
}
