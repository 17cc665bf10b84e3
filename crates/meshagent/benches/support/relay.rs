//! The floor of an extra loopback hop, shared by the DNS benchmarks (`dns.rs`,
//! `side_by_side_load.rs`): a trivial UDP relay on its own current-thread runtime, one task, no
//! parsing and no ID rewriting (a client's ID is its key; fine for one dnsperf client), one
//! connected upstream socket. Whatever a DNS proxy adds to a forwarded query beyond this is its
//! own work.
#![allow(clippy::unwrap_used, dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

/// Starts the relay to `upstream` on a thread of its own (`on_thread` runs first on it, e.g. to
/// pin it to a core): its downstream address, and its thread's `/proc` directory (for its CPU
/// time).
pub fn udp_relay(
    upstream: SocketAddr,
    on_thread: impl FnOnce() + Send + 'static,
) -> (SocketAddr, PathBuf) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        on_thread();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let down = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            let up = tokio::net::UdpSocket::bind("0.0.0.0:0").await.unwrap();
            up.connect(upstream).await.unwrap();
            tx.send((
                down.local_addr().unwrap(),
                std::path::Path::new("/proc")
                    .join(std::fs::read_link("/proc/thread-self").unwrap()),
            ))
            .unwrap();
            let mut peers: Vec<Option<SocketAddr>> = vec![None; 65536];
            let (mut a, mut b) = (vec![0u8; 65535], vec![0u8; 65535]);
            loop {
                tokio::select! {
                    r = down.recv_from(&mut a) => {
                        let Ok((n, peer)) = r else { continue };
                        if n < 12 { continue }
                        peers[usize::from(u16::from_be_bytes([a[0], a[1]]))] = Some(peer);
                        let _ = up.send(&a[..n]).await;
                    }
                    r = up.recv(&mut b) => {
                        let Ok(n) = r else { continue };
                        if n < 12 { continue }
                        if let Some(peer) = peers[usize::from(u16::from_be_bytes([b[0], b[1]]))] {
                            let _ = down.send_to(&b[..n], peer).await;
                        }
                    }
                }
            }
        });
    });
    rx.recv().unwrap()
}
