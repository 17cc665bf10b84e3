//! `--run-validation` (Istio tools/istio-iptables/pkg/validation/validator.go): prove that
//! the capture rules are in place by connecting to `127.0.0.6:<probe port>` from 127.0.0.1
//! and checking that the connection arrives, redirected, on the proxy ports with the
//! original destination port intact.
//!
//! This runs in the synchronous `istio-iptables` command, outside any Tokio runtime, so it
//! uses std sockets, threads and `std::time::Instant`.
#![allow(
    clippy::disallowed_methods,
    clippy::disallowed_types,
    reason = "synchronous command without a Tokio runtime"
)]

use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage, sockopt};

use super::config::Config;

/// Istio's message on validation failure (exit code 126).
pub const FAILURE_MESSAGE: &str = "iptables validation failed; workload is not ready for Istio.
When using Istio CNI, this can occur if a pod is scheduled before the node is ready.

If installed with 'cni.repair.deletePods=true', this pod should automatically be deleted and retry.
Otherwise, this pod will need to be manually removed so that it is scheduled on a node with istio-cni running, allowing iptables rules to be established.
";

/// Exit code of a failed validation (constants `ValidationErrorCode`).
pub const VALIDATION_ERROR_CODE: u8 = 126;

/// Why validation failed.
#[derive(Debug, thiserror::Error)]
pub enum ValidationError {
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error("validation timeout")]
    Timeout,
}

/// The original destination of an accepted (REDIRECTed) connection.
pub fn original_dst(stream: &TcpStream, v6: bool) -> Option<SocketAddr> {
    if v6 {
        let a = socket::getsockopt(stream, sockopt::Ip6tOriginalDst).ok()?;
        let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
        Some(SocketAddr::new(IpAddr::V6(ip), u16::from_be(a.sin6_port)))
    } else {
        let a = socket::getsockopt(stream, sockopt::OriginalDst).ok()?;
        let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
        Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(a.sin_port)))
    }
}

/// A TCP connection from `src` (port chosen by the kernel) to `dst`.
fn connect_from(src: IpAddr, dst: SocketAddr) -> std::io::Result<TcpStream> {
    let family = if dst.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd: OwnedFd = socket::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    socket::bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(SocketAddr::new(src, 0)),
    )?;
    socket::connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(dst),
    )?;
    Ok(TcpStream::from(fd))
}

/// Runs the validation; `Ok` once a probe arrived with the probe port as original destination.
pub fn run(cfg: &Config) -> Result<(), ValidationError> {
    let v6 = cfg.enable_ipv6 && !cfg.dual_stack;
    let (listen_ip, src_ip, probe_ip): (IpAddr, IpAddr, IpAddr) = if v6 {
        (
            Ipv6Addr::LOCALHOST.into(),
            Ipv6Addr::LOCALHOST.into(),
            Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6).into(),
        )
    } else {
        (
            Ipv4Addr::LOCALHOST.into(),
            Ipv4Addr::LOCALHOST.into(),
            Ipv4Addr::new(127, 0, 0, 6).into(),
        )
    };
    let mut listeners = Vec::new();
    for port in [cfg.proxy_port, cfg.inbound_capture_port] {
        let addr = SocketAddr::new(listen_ip, port);
        // std's bind sets SO_REUSEADDR, as Istio's validator does.
        let l = TcpListener::bind(addr).map_err(|error| ValidationError::Listen { addr, error })?;
        l.set_nonblocking(true)
            .map_err(|error| ValidationError::Listen { addr, error })?;
        listeners.push(l);
    }
    let probe = SocketAddr::new(probe_ip, cfg.probe_port);
    let deadline = Instant::now() + cfg.probe_timeout;
    let mut next_dial = Instant::now();
    let mut pending: Vec<TcpStream> = Vec::new();
    while Instant::now() < deadline {
        if Instant::now() >= next_dial {
            next_dial = Instant::now() + Duration::from_secs(1);
            match connect_from(src_ip, probe) {
                Ok(s) => pending.push(s),
                Err(e) => tracing::debug!("validation probe to {probe}: {e}"),
            }
        }
        for l in &listeners {
            match l.accept() {
                Ok((s, peer)) => {
                    let dst = original_dst(&s, v6);
                    tracing::info!(
                        "validation: accepted {peer} with original destination {}",
                        dst.map_or_else(|| "unknown".to_owned(), |d| d.to_string())
                    );
                    if dst.is_some_and(|d| d.port() == cfg.probe_port) {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => tracing::debug!("validation accept: {e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(pending);
    Err(ValidationError::Timeout)
}
