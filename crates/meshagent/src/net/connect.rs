//! Connectors for [`super::send`]: how the TCP connection is opened ([`Dial`]: [`Plain`],
//! [`Guarded`], [`ProbeSource`]) and, for `https` URLs, the TLS handshake on top
//! ([`Connector::with_tls`]). Each connection serves one request: none of the agent's HTTP
//! peers is called often enough for reuse to matter, and Istio's clients for them are
//! short-lived too.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpSocket, TcpStream};

use super::error_chain;
use super::guard::{Guard, ResolveError};
use super::tls::{self, Verify};

/// Why no connection was made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0}")]
    Url(String),
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error("connect {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The handshake failed; `plain_http` when the server answered in plain HTTP (what Go
    /// reports as "server gave HTTP response to HTTPS client").
    #[error("TLS handshake: {reason}")]
    Tls { reason: String, plain_http: bool },
}

/// How a connector opens the TCP connection to `host:port` (`host` without brackets).
pub trait Dial: Clone + Send + Sync + 'static {
    fn dial(&self, host: String, port: u16) -> BoxFuture<'static, Result<TcpStream, ConnectError>>;
}

/// Resolves the host (an IP literal as is, else the system resolver) and tries each address
/// in order.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

impl Dial for Plain {
    fn dial(&self, host: String, port: u16) -> BoxFuture<'static, Result<TcpStream, ConnectError>> {
        Box::pin(async move {
            let addrs = resolve(&host, port).await?;
            connect_any(addrs).await
        })
    }
}

/// [`Plain`] with the SSRF guard at connect time: every resolved address is checked against
/// the blocked ranges just before it is dialled, so redirects, realms and DNS answers that
/// point at a metadata address are refused like a literal one (Istio master
/// `pkg/security/dial.go`; Go gets the same from a `net.Dialer.Control` hook).
#[derive(Debug, Clone)]
pub struct Guarded(pub Arc<Guard>);

impl Dial for Guarded {
    fn dial(&self, host: String, port: u16) -> BoxFuture<'static, Result<TcpStream, ConnectError>> {
        let guard = self.0.clone();
        Box::pin(async move {
            let addrs = resolve(&host, port).await?;
            let mut first_refusal = None;
            let mut allowed = Vec::with_capacity(addrs.len());
            for a in addrs {
                match guard.check(a) {
                    Ok(()) => allowed.push(a),
                    Err(e) => {
                        first_refusal.get_or_insert(e);
                    }
                }
            }
            if allowed.is_empty()
                && let Some(e) = first_refusal
            {
                return Err(ResolveError::Guard(e).into());
            }
            connect_any(allowed).await
        })
    }
}

/// Application probes: always to `to` (the request's URL only names the authority it
/// carries), from `127.0.0.6` / `::6`, the source Istio's iptables rules let through
/// uncaptured (`pilot/cmd/pilot-agent/status/server.go`), when that address exists here (it
/// always does on Linux loopback for IPv4; `::6` usually does not), else from the default
/// source.
#[derive(Debug, Clone, Copy)]
pub struct ProbeSource {
    pub to: SocketAddr,
}

impl Dial for ProbeSource {
    fn dial(&self, _: String, _: u16) -> BoxFuture<'static, Result<TcpStream, ConnectError>> {
        let addr = self.to;
        Box::pin(async move {
            connect_from_probe_source(addr)
                .await
                .map_err(|source| ConnectError::Connect { addr, source })
        })
    }
}

/// Connects to `addr` from the probe source address (see [`ProbeSource`]).
pub async fn connect_from_probe_source(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let (socket, source) = match addr {
        SocketAddr::V4(_) => (
            TcpSocket::new_v4()?,
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6)),
        ),
        SocketAddr::V6(_) => (
            TcpSocket::new_v6()?,
            IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6)),
        ),
    };
    // Istio's Go dialer sets SO_LINGER 1s. In tokio a non-zero linger makes `close` block a
    // runtime thread for up to that long (deprecated for that reason), so we keep the default:
    // the probe has no unsent data at close, so both end the same way.
    let socket = match socket.bind(SocketAddr::new(source, 0)) {
        Ok(()) => socket,
        Err(e) => {
            tracing::trace!(%source, error = %e, "probe source address unavailable");
            if addr.is_ipv4() {
                TcpSocket::new_v4()?
            } else {
                TcpSocket::new_v6()?
            }
        }
    };
    socket.connect(addr).await
}

/// `host:port` as addresses, in resolver order.
pub async fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, ResolveError> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| ResolveError::Dns(host.to_owned(), e.to_string()))?
        .collect();
    if addrs.is_empty() {
        return Err(ResolveError::Dns(host.to_owned(), "no addresses".into()));
    }
    Ok(addrs)
}

/// The first address that accepts; the last failure otherwise.
async fn connect_any(addrs: Vec<SocketAddr>) -> Result<TcpStream, ConnectError> {
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(s) => return Ok(s),
            Err(source) => last = Some(ConnectError::Connect { addr, source }),
        }
    }
    Err(last.unwrap_or_else(|| ConnectError::Url("no address to connect to".into())))
}

/// The TLS side of a connector: which configuration a host gets.
#[derive(Clone)]
pub struct Tls {
    /// Verified against the system roots plus `extra_root`; built at the first verified
    /// connection, on the blocking pool (parsing the OS bundle, ~140 certificates, takes
    /// 5–9 ms, for clients most agents never use).
    verified: Arc<tokio::sync::OnceCell<Arc<rustls::ClientConfig>>>,
    extra_root: Option<Arc<Path>>,
    unverified: Arc<rustls::ClientConfig>,
    skip_verify: Arc<dyn Fn(&str) -> bool + Send + Sync>,
    /// The server name sent and checked instead of the URL's host.
    server_name: Option<Arc<str>>,
}

impl Tls {
    /// No host is verified (HTTPS app probes: kubelet does not verify either).
    pub fn unverified(alpn: &[&[u8]]) -> Result<Tls, rustls::Error> {
        Ok(Tls {
            verified: Arc::default(),
            extra_root: None,
            unverified: Arc::new(tls::client_config(Verify::Skip, alpn)?),
            skip_verify: Arc::new(|_| true),
            server_name: None,
        })
    }

    /// Hosts verified against the system roots plus `extra_root` (read at the first verified
    /// connection, when the file exists), except those `skip_verify` names.
    pub fn verified(
        extra_root: Option<&Path>,
        skip_verify: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Tls {
        Tls {
            verified: Arc::default(),
            extra_root: extra_root.map(Arc::from),
            unverified: Arc::new(
                tls::client_config(Verify::Skip, &[]).unwrap_or_else(|_| tls::unusable_config()),
            ),
            skip_verify: Arc::new(skip_verify),
            server_name: None,
        }
    }

    /// Names the server `name` (no brackets) instead of the URL's host: app probes send
    /// the kubelet's `Host` as the request's authority but the target's host as SNI.
    pub fn with_server_name(mut self, name: &str) -> Tls {
        self.server_name = Some(Arc::from(name));
        self
    }

    async fn config_for(&self, host: &str) -> Arc<rustls::ClientConfig> {
        if (self.skip_verify)(host) {
            return self.unverified.clone();
        }
        self.verified
            .get_or_init(|| async {
                let extra = self.extra_root.clone();
                let cfg = tokio::task::spawn_blocking(move || {
                    let roots = tls::system_roots_plus(extra.as_deref());
                    tls::client_config(Verify::Roots(roots), &[])
                        .unwrap_or_else(|_| tls::unusable_config())
                })
                .await
                .unwrap_or_else(|_| tls::unusable_config());
                Arc::new(cfg)
            })
            .await
            .clone()
    }
}

/// A connector for the legacy client: `D` opens TCP; `https` URLs get TLS when configured.
#[derive(Clone)]
pub struct Connector<D> {
    dial: D,
    tls: Option<Tls>,
}

impl<D: Dial> Connector<D> {
    pub fn new(dial: D) -> Connector<D> {
        Connector { dial, tls: None }
    }

    pub fn with_tls(mut self, tls: Tls) -> Connector<D> {
        self.tls = Some(tls);
        self
    }

    async fn connect(self, uri: Uri) -> Result<Conn, ConnectError> {
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => return Err(ConnectError::Url("scheme must be http or https".into())),
        };
        let Some(authority) = uri.authority() else {
            return Err(ConnectError::Url("no host".into()));
        };
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tcp = self.dial.dial(host.clone(), port).await?;
        let _ = tcp.set_nodelay(true);
        if !https {
            return Ok(Conn {
                io: TokioIo::new(Stream::Tcp(tcp)),
                h2: false,
            });
        }
        let Some(tls) = &self.tls else {
            return Err(ConnectError::Url("https is not supported here".into()));
        };
        let host = tls.server_name.as_deref().map_or(host, str::to_owned);
        let cfg = tls.config_for(&host).await;
        let name = match host.parse::<IpAddr>() {
            Ok(ip) => ServerName::IpAddress(ip.into()),
            Err(_) => ServerName::try_from(host.clone())
                .map_err(|e| ConnectError::Url(format!("server name {host:?}: {e}")))?,
        };
        let stream = tokio_rustls::TlsConnector::from(cfg)
            .connect(name, tcp)
            .await
            .map_err(|e| {
                let reason = error_chain(&e);
                ConnectError::Tls {
                    plain_http: reason.contains("InvalidContentType")
                        || reason.contains("corrupt message"),
                    reason,
                }
            })?;
        let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
        Ok(Conn {
            io: TokioIo::new(Stream::Tls(Box::new(stream))),
            h2,
        })
    }
}

impl<D: Dial> tower::Service<Uri> for Connector<D> {
    type Response = Conn;
    type Error = ConnectError;
    type Future = BoxFuture<'static, Result<Conn, ConnectError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(self.clone().connect(uri))
    }
}

/// A plain or TLS connection.
enum Stream {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A connection as hyper sees it; HTTP/2 when TLS negotiated `h2`.
pub struct Conn {
    io: TokioIo<Stream>,
    h2: bool,
}

impl Conn {
    /// A plain TCP connection (for callers that drive hyper or tonic themselves).
    pub fn tcp(s: TcpStream) -> Conn {
        Conn {
            io: TokioIo::new(Stream::Tcp(s)),
            h2: false,
        }
    }
}

impl Connection for Conn {
    fn connected(&self) -> Connected {
        if self.h2 {
            Connected::new().negotiated_h2()
        } else {
            Connected::new()
        }
    }
}

impl hyper::rt::Read for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        hyper::rt::Read::poll_read(Pin::new(&mut self.get_mut().io), cx, buf)
    }
}

impl hyper::rt::Write for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        hyper::rt::Write::poll_write(Pin::new(&mut self.get_mut().io), cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        hyper::rt::Write::poll_flush(Pin::new(&mut self.get_mut().io), cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        hyper::rt::Write::poll_shutdown(Pin::new(&mut self.get_mut().io), cx)
    }
}
