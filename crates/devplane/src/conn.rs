//! Accepted connections for the gRPC ports, TLS or plaintext, with what handlers need to know
//! about the peer (address, verified client certificate).

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

/// Peer facts, available to handlers as a request extension.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub remote_addr: Option<SocketAddr>,
    /// The client certificate chain, already verified against devplane's root by rustls.
    pub peer_certs: Option<Arc<Vec<CertificateDer<'static>>>>,
    pub tls: bool,
}

pub enum Conn {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        match self {
            Conn::Plain(s) => ConnInfo {
                remote_addr: s.peer_addr().ok(),
                peer_certs: None,
                tls: false,
            },
            Conn::Tls(s) => {
                let (tcp, session) = s.get_ref();
                ConnInfo {
                    remote_addr: tcp.peer_addr().ok(),
                    peer_certs: session
                        .peer_certificates()
                        .map(|c| Arc::new(c.iter().map(|c| c.clone().into_owned()).collect())),
                    tls: true,
                }
            }
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// Accepts connections; TLS handshakes run concurrently so one slow or failing client never
/// blocks others. Failed handshakes are logged and dropped rather than ending the server.
pub fn incoming(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
) -> ReceiverStream<Result<Conn, io::Error>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let tx = tx.clone();
            match &tls {
                None => {
                    if tx.send(Ok(Conn::Plain(tcp))).await.is_err() {
                        return;
                    }
                }
                Some(acceptor) => {
                    let acceptor = acceptor.clone();
                    tokio::spawn(async move {
                        match tokio::time::timeout(
                            std::time::Duration::from_secs(10),
                            acceptor.accept(tcp),
                        )
                        .await
                        {
                            Ok(Ok(s)) => {
                                let _ = tx.send(Ok(Conn::Tls(Box::new(s)))).await;
                            }
                            Ok(Err(e)) => tracing::info!(%peer, error = %e, "TLS handshake failed"),
                            Err(_) => tracing::info!(%peer, "TLS handshake timed out"),
                        }
                    });
                }
            }
        }
    });
    ReceiverStream::new(rx)
}
