//! The UDP and TCP loops. Local answers are computed inline on the receive loop (no task, no
//! allocation beyond the reply); forwarded queries run as tasks, bounded in number.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
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

pub async fn serve_udp(sock: Arc<UdpSocket>, core: Arc<Core>) -> Result<(), String> {
    let forwards = Arc::new(Semaphore::new(MAX_FORWARDS));
    let mut buf = vec![0u8; 65535];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            // ICMP errors from earlier replies surface here on some kernels: not fatal.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => continue,
            Err(e) => return Err(format!("UDP receive: {e}")),
        };
        match core.handle(&buf[..n], Proto::Udp) {
            Action::Reply(b) => send(&sock, &b, peer).await,
            Action::Drop => {}
            Action::Forward(f) => {
                let Ok(permit) = forwards.clone().try_acquire_owned() else {
                    tracing::debug!("too many forwarded DNS queries in flight; dropping one");
                    continue;
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
