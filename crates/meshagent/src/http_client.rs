//! HTTP/1.1 client for loopback debug endpoints: Envoy's admin API, the agent's own status
//! port (`meshagent request`, `meshagent wait`) and the test harness. On the agent's one
//! client ([`crate::net`], plain connector): one request per connection (`Connection:
//! close`), as Istio's agent does with its short-lived Go clients.
//!
//! Bodies are never cut silently. [`Response::bytes`] reads a whole body only up to an
//! explicit cap and fails past it; [`Response::copy_to`] streams a body of any size with
//! bounded memory. A body that ends early (fewer bytes than `Content-Length`, a broken chunked
//! encoding) is an error either way: hyper's decoder reports it.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
pub use http::{Method, StatusCode};

use http::{HeaderValue, Request, header};
use http_body_util::Full;
use hyper::body::Incoming;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;

use crate::net::{self, BodyError, ConnectError, Connector, SendError, connect::Plain};

/// HTTP/1 read buffer of this client (`net::send_buffered`): its callers read bodies whole
/// from loopback peers (Envoy's admin, the agent's own status port), where a 124 KB `/server_info` grew
/// hyper's default buffer to 256 KiB beside the body being collected.
const READ_BUFFER: usize = 32 * 1024;
/// Largest body buffer allocated up front from a Content-Length.
const PRESIZE_MAX: usize = 1024 * 1024;

/// What went wrong, without the request it belongs to (see [`HttpError`]).
#[derive(Debug, thiserror::Error)]
pub enum HttpErrorKind {
    #[error("invalid request: {0}")]
    Request(String),
    #[error("connect failed: {0}")]
    Connect(#[source] std::io::Error),
    /// The exchange failed before the response head arrived; the message carries hyper's
    /// cause (e.g. "connection closed before message completed").
    #[error("{0}")]
    Exchange(String),
    /// The response body was cut short or malformed (e.g. "end of file before message
    /// length reached", "invalid chunk size line").
    #[error("incomplete response body after {received} bytes: {reason}")]
    Body { received: u64, reason: String },
    /// The body is larger than the caller's cap; nothing is returned.
    #[error("response body exceeds the {cap}-byte limit")]
    TooLarge { cap: usize },
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("cannot write the response body: {0}")]
    Write(#[source] std::io::Error),
}

/// A failed request, naming the method and URL.
#[derive(Debug, thiserror::Error)]
#[error("{method} http://{addr}{path}: {kind}")]
pub struct HttpError {
    pub method: Method,
    pub addr: SocketAddr,
    pub path: String,
    pub kind: HttpErrorKind,
}

/// A request to send with [`send`].
#[derive(Debug, Clone)]
pub struct Call<'a> {
    pub method: Method,
    pub addr: SocketAddr,
    /// Origin-form target: path and query, e.g. `/stats?usedonly`.
    pub path: &'a str,
    pub body: Bytes,
    /// Covers connecting, the response head and reading the body.
    pub timeout: Duration,
}

impl<'a> Call<'a> {
    /// A request without a body.
    pub fn new(method: Method, addr: SocketAddr, path: &'a str, timeout: Duration) -> Call<'a> {
        Call {
            method,
            addr,
            path,
            body: Bytes::new(),
            timeout,
        }
    }

    fn error(&self, kind: HttpErrorKind) -> HttpError {
        HttpError {
            method: self.method.clone(),
            addr: self.addr,
            path: self.path.to_owned(),
            kind,
        }
    }
}

/// A response whose head has arrived; the body is read with [`Response::bytes`],
/// [`Response::text`] or [`Response::copy_to`].
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    body: Incoming,
    deadline: Instant,
    timeout: Duration,
    method: Method,
    addr: SocketAddr,
    path: String,
}

/// Sends `call` and waits for the response head.
pub async fn send(call: &Call<'_>) -> Result<Response, HttpError> {
    let deadline = Instant::now() + call.timeout;
    let timeout = call.timeout;
    let url = net::url("http", &call.addr.to_string(), call.path)
        .map_err(|e| call.error(HttpErrorKind::Request(e)))?;
    let req = Request::builder()
        .method(call.method.clone())
        .uri(url)
        .header(header::HOST, call.addr.to_string())
        .header(header::CONNECTION, "close")
        .header(header::USER_AGENT, HeaderValue::from_static("meshagent"))
        .body(Full::new(call.body.clone()))
        .map_err(|e| call.error(HttpErrorKind::Request(e.to_string())))?;
    let resp = net::send_buffered(
        Connector::new(Plain),
        req,
        deadline,
        deadline,
        Some(READ_BUFFER),
    )
    .await
    .map_err(|e| {
        call.error(match e {
            SendError::Timeout => HttpErrorKind::Timeout(timeout),
            SendError::Connect(ConnectError::Connect { source, .. }) => {
                HttpErrorKind::Connect(source)
            }
            SendError::Connect(c) => HttpErrorKind::Connect(std::io::Error::other(c)),
            SendError::Exchange(reason) => HttpErrorKind::Exchange(reason),
        })
    })?;
    let (parts, body) = resp.into_parts();
    Ok(Response {
        status: parts.status,
        headers: parts.headers,
        body,
        deadline,
        timeout,
        method: call.method.clone(),
        addr: call.addr,
        path: call.path.to_owned(),
    })
}

impl Response {
    /// The whole body, failing with [`HttpErrorKind::TooLarge`] if it is longer than `cap`.
    pub async fn bytes(mut self, cap: usize) -> Result<Bytes, HttpError> {
        // Sized once from Content-Length when the peer sent one (bounded: a peer can claim
        // any length), instead of doubling: each doubling holds the old and the new copy.
        let hint = hyper::body::Body::size_hint(&self.body)
            .exact()
            .unwrap_or(0);
        let mut out =
            BytesMut::with_capacity(usize::try_from(hint).unwrap_or(0).min(cap).min(PRESIZE_MAX));
        while let Some(data) = self.next_data(out.len() as u64).await? {
            if out.len() + data.len() > cap {
                return Err(self.fail(HttpErrorKind::TooLarge { cap }));
            }
            out.extend_from_slice(&data);
        }
        Ok(out.freeze())
    }

    /// [`Response::bytes`] as text; invalid UTF-8 is replaced (Envoy's admin output is
    /// ASCII, and callers only look for ASCII tokens).
    pub async fn text(self, cap: usize) -> Result<String, HttpError> {
        let b = self.bytes(cap).await?;
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    /// At most `cap` bytes of the body for an error message, and whether there was more.
    /// For bodies that are only shown to a person; a cut-short transfer is still an error.
    pub async fn prefix(mut self, cap: usize) -> Result<(Bytes, bool), HttpError> {
        let mut out = BytesMut::new();
        while let Some(data) = self.next_data(out.len() as u64).await? {
            let room = cap - out.len();
            if data.len() > room {
                out.extend_from_slice(&data[..room]);
                return Ok((out.freeze(), true));
            }
            out.extend_from_slice(&data);
        }
        Ok((out.freeze(), false))
    }

    /// Streams the body into `out` as it arrives (memory bounded by one frame); returns the
    /// number of bytes written. `out` is flushed at the end.
    pub async fn copy_to<W: AsyncWrite + Unpin>(mut self, out: &mut W) -> Result<u64, HttpError> {
        let mut written: u64 = 0;
        while let Some(data) = self.next_data(written).await? {
            // The deadline covers the writes too: a stalled reader of our stdout must not
            // keep the connection open forever.
            match tokio::time::timeout_at(self.deadline, out.write_all(&data)).await {
                Err(_) => return Err(self.fail(HttpErrorKind::Timeout(self.timeout))),
                Ok(Err(e)) => return Err(self.fail(HttpErrorKind::Write(e))),
                Ok(Ok(())) => {}
            }
            written += data.len() as u64;
        }
        out.flush()
            .await
            .map_err(|e| self.fail(HttpErrorKind::Write(e)))?;
        Ok(written)
    }

    /// The next data frame (trailers are skipped); `None` at a complete end of body.
    async fn next_data(&mut self, received: u64) -> Result<Option<Bytes>, HttpError> {
        net::next_data(&mut self.body, self.deadline, received)
            .await
            .map_err(|e| {
                self.fail(match e {
                    BodyError::Timeout => HttpErrorKind::Timeout(self.timeout),
                    BodyError::Broken { received, reason } => {
                        HttpErrorKind::Body { received, reason }
                    }
                    BodyError::TooLarge { cap } => HttpErrorKind::TooLarge { cap: cap as usize },
                })
            })
    }

    fn fail(&self, kind: HttpErrorKind) -> HttpError {
        HttpError {
            method: self.method.clone(),
            addr: self.addr,
            path: self.path.clone(),
            kind,
        }
    }
}

/// Status and whole body as text, capped at `cap` bytes (an error beyond it).
pub async fn text(call: &Call<'_>, cap: usize) -> Result<(StatusCode, String), HttpError> {
    let resp = send(call).await?;
    let status = resp.status;
    Ok((status, resp.text(cap).await?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    /// A raw TCP peer that reads one request head and answers with `reply`, then closes.
    async fn serve_once(reply: Vec<u8>) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let mut head = Vec::new();
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    return;
                }
                head.extend_from_slice(&buf[..n]);
            }
            s.write_all(&reply).await.unwrap();
            s.shutdown().await.unwrap();
        });
        addr
    }

    fn get(addr: SocketAddr) -> Call<'static> {
        Call::new(Method::GET, addr, "/x", Duration::from_secs(5))
    }

    #[tokio::test]
    async fn plain_chunked_and_close_delimited_bodies() {
        let addr = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec()).await;
        let (s, b) = text(&get(addr), 10).await.unwrap();
        assert_eq!((s.as_u16(), b.as_str()), (200, "ok"));

        let addr = serve_once(
            b"HTTP/1.1 503 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
                .to_vec(),
        )
        .await;
        let (s, b) = text(&get(addr), 10).await.unwrap();
        assert_eq!((s.as_u16(), b.as_str()), (503, "abcde"));

        let addr = serve_once(b"HTTP/1.1 200 OK\r\n\r\nuntil close".to_vec()).await;
        let (_, b) = text(&get(addr), 100).await.unwrap();
        assert_eq!(b, "until close");
    }

    #[tokio::test]
    async fn short_bodies_are_errors() {
        let addr =
            serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this".to_vec()).await;
        let e = text(&get(addr), 1000).await.unwrap_err();
        assert!(
            matches!(e.kind, HttpErrorKind::Body { received: 9, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("message length"), "{e}");

        let addr = serve_once(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\nshort".to_vec(),
        )
        .await;
        let e = text(&get(addr), 1000).await.unwrap_err();
        assert!(matches!(e.kind, HttpErrorKind::Body { .. }), "{e}");

        let addr = serve_once(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n".to_vec(),
        )
        .await;
        let e = text(&get(addr), 1000).await.unwrap_err();
        assert!(matches!(e.kind, HttpErrorKind::Body { .. }), "{e}");

        let addr = serve_once(b"garbage\r\n\r\n".to_vec()).await;
        let e = text(&get(addr), 1000).await.unwrap_err();
        assert!(matches!(e.kind, HttpErrorKind::Exchange(_)), "{e}");
    }

    #[tokio::test]
    async fn cap_is_an_error_not_a_truncation() {
        let addr =
            serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world".to_vec()).await;
        let e = text(&get(addr), 5).await.unwrap_err();
        assert!(matches!(e.kind, HttpErrorKind::TooLarge { cap: 5 }), "{e}");
        assert!(e.to_string().starts_with("GET http://127.0.0.1:"), "{e}");

        let addr =
            serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello world".to_vec()).await;
        let (b, more) = send(&get(addr)).await.unwrap().prefix(5).await.unwrap();
        assert_eq!((&b[..], more), (&b"hello"[..], true));
    }

    #[tokio::test]
    async fn streams_and_times_out() {
        let addr = serve_once(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello".to_vec()).await;
        let mut out = Vec::new();
        let n = send(&get(addr)).await.unwrap().copy_to(&mut out).await;
        assert_eq!((n.unwrap(), out.as_slice()), (5, &b"hello"[..]));

        // A peer that accepts and never answers.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let _keep = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(s);
        });
        let call = Call::new(Method::GET, addr, "/", Duration::from_millis(200));
        let e = send(&call).await.unwrap_err();
        assert!(matches!(e.kind, HttpErrorKind::Timeout(_)), "{e}");
    }
}
