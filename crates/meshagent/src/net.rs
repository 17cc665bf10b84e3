//! The agent's one HTTP client: hyper-util's legacy client over a connector per need
//! ([`connect`]: plain, SSRF-guarded, bound to the probe source address, each with TLS for
//! `https` URLs), one request per connection, under a deadline, with bodies read to an
//! explicit byte bound ([`collect`], [`prefix`], [`next_data`]). Its callers: the loopback
//! client of Envoy's admin API and the status port (`http_client.rs`), cloud metadata
//! servers (`platform/fetch.rs`), Wasm module and OCI registry fetches (`wasm/client.rs`)
//! and application probes (`status/probes.rs`). TLS configurations come from one builder
//! ([`tls::client_config`]); errors are printed with one formatter ([`error_chain`]);
//! resolv.conf is read by one parser ([`resolv`]).

pub mod connect;
mod error;
pub mod guard;
pub mod resolv;
pub mod tls;

use bytes::{Bytes, BytesMut};
use http::{Request, Response, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use tokio::time::Instant;

pub use connect::{ConnectError, Connector};
pub use error::error_chain;

/// Why a request got no response head.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The exchange failed before the response head arrived, with hyper's cause (e.g.
    /// "connection closed before message completed").
    #[error("{0}")]
    Exchange(String),
    #[error("timed out")]
    Timeout,
}

/// Why a body was not read whole.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Cut short or malformed (hyper's decoder: "end of file before message length
    /// reached", "invalid chunk size line").
    #[error("incomplete response body after {received} bytes: {reason}")]
    Broken { received: u64, reason: String },
    #[error("response body exceeds the {cap}-byte limit")]
    TooLarge { cap: u64 },
    #[error("timed out")]
    Timeout,
}

/// Runs a connection's task until the deadline of the request it serves at the latest, so
/// a peer that holds a half-sent body open cannot keep the task and its descriptor.
#[derive(Clone, Copy)]
struct UntilDeadline(Instant);

impl<F> hyper::rt::Executor<F> for UntilDeadline
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        let deadline = self.0;
        tokio::spawn(async move {
            let _ = tokio::time::timeout_at(deadline, fut).await;
        });
    }
}

/// Sends `req` (an absolute URL) on a new connection made by `connector` and waits for the
/// response head until `head_by`; the connection lives until `conn_until` at most (the body
/// must be read by then). HTTP/1.1 adds `Host` from the URL when the request has none;
/// HTTP/2 is used when the connector negotiated it.
pub async fn send<D: connect::Dial>(
    connector: Connector<D>,
    req: Request<Full<Bytes>>,
    head_by: Instant,
    conn_until: Instant,
) -> Result<Response<Incoming>, SendError> {
    send_buffered(connector, req, head_by, conn_until, None).await
}

/// [`send`] with HTTP/1's read buffer held to `max_read_buffer` bytes (at least 8 KiB):
/// hyper's own grows by doubling up to ~400 KiB while a large body streams in (reallocated,
/// so twice that for a moment), which for a body read whole lands beside the copy the caller
/// keeps. Small buffers cost only more reads, which a loopback peer answers at once.
pub async fn send_buffered<D: connect::Dial>(
    connector: Connector<D>,
    req: Request<Full<Bytes>>,
    head_by: Instant,
    conn_until: Instant,
    max_read_buffer: Option<usize>,
) -> Result<Response<Incoming>, SendError> {
    let mut builder = Client::builder(UntilDeadline(conn_until.max(head_by)));
    builder.pool_max_idle_per_host(0);
    if let Some(max) = max_read_buffer {
        builder.http1_max_buf_size(max.max(8 * 1024));
    }
    let client: Client<Connector<D>, Full<Bytes>> = builder.build(connector);
    match tokio::time::timeout_at(head_by, client.request(req)).await {
        Err(_) => Err(SendError::Timeout),
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) => Err(classify(&e)),
    }
}

/// The connector's own error, or hyper's cause without the legacy client's wrapper
/// ("client error (SendRequest)").
fn classify(e: &hyper_util::client::legacy::Error) -> SendError {
    let source = std::error::Error::source(e);
    if let Some(c) = source.and_then(|s| s.downcast_ref::<ConnectError>()) {
        return SendError::Connect(match c {
            ConnectError::Url(s) => ConnectError::Url(s.clone()),
            ConnectError::Resolve(r) => ConnectError::Resolve(r.clone()),
            ConnectError::Connect { addr, source } => ConnectError::Connect {
                addr: *addr,
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            ConnectError::Tls { reason, plain_http } => ConnectError::Tls {
                reason: reason.clone(),
                plain_http: *plain_http,
            },
        });
    }
    SendError::Exchange(match source {
        Some(s) => error_chain(s),
        None => e.to_string(),
    })
}

/// `http://authority/path` as a URI, for [`send`].
pub fn url(scheme: &str, authority: &str, path_and_query: &str) -> Result<Uri, String> {
    format!("{scheme}://{authority}{path_and_query}")
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())
}

/// The next data frame (trailers are skipped); `None` at a complete end of body.
/// `received` is only for the error message.
pub async fn next_data(
    body: &mut Incoming,
    deadline: Instant,
    received: u64,
) -> Result<Option<Bytes>, BodyError> {
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(BodyError::Timeout),
            Ok(None) => return Ok(None),
            Ok(Some(Err(e))) => {
                return Err(BodyError::Broken {
                    received,
                    reason: error_chain(&e),
                });
            }
            Ok(Some(Ok(f))) => f,
        };
        if let Ok(data) = frame.into_data()
            && !data.is_empty()
        {
            return Ok(Some(data));
        }
    }
}

/// The whole body; longer than `cap` is an error, not a truncation.
pub async fn collect(
    mut body: Incoming,
    cap: usize,
    deadline: Instant,
) -> Result<Bytes, BodyError> {
    let mut out = BytesMut::new();
    while let Some(data) = next_data(&mut body, deadline, out.len() as u64).await? {
        if out.len() + data.len() > cap {
            return Err(BodyError::TooLarge { cap: cap as u64 });
        }
        out.extend_from_slice(&data);
    }
    Ok(out.freeze())
}

/// At most `cap` bytes of the body, and whether there was more (the rest is not read).
pub async fn prefix(
    mut body: Incoming,
    cap: usize,
    deadline: Instant,
) -> Result<(Bytes, bool), BodyError> {
    let mut out = BytesMut::new();
    while let Some(data) = next_data(&mut body, deadline, out.len() as u64).await? {
        let room = cap - out.len();
        if data.len() > room {
            out.extend_from_slice(&data[..room]);
            return Ok((out.freeze(), true));
        }
        out.extend_from_slice(&data);
    }
    Ok((out.freeze(), false))
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::connect::{Guarded, ProbeSource};
    use super::guard::{Guard, ResolveError};
    use super::*;

    fn get(url: &str) -> Request<Full<Bytes>> {
        Request::get(url)
            .body(Full::new(Bytes::new()))
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    /// A peer that answers one request with 200 and tells the test who connected and the
    /// request head it read.
    async fn peer() -> (
        SocketAddr,
        tokio::sync::oneshot::Receiver<(SocketAddr, String)>,
    ) {
        let l = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let Ok((mut s, from)) = l.accept().await else {
                return;
            };
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await;
            let _ = tx.send((from, String::from_utf8_lossy(&head).into_owned()));
        });
        (addr, rx)
    }

    #[tokio::test]
    async fn guarded_connector_checks_every_resolved_address() {
        let guard = Arc::new(
            Guard::new(&["127.0.0.0/8".to_owned(), "::1/128".to_owned()])
                .unwrap_or_else(|e| panic!("{e}")),
        );
        // A literal and a name that resolves into the blocked range: both refused before
        // anything is dialled (nothing listens on port 9 either way).
        for url in ["http://127.0.0.9:9/", "http://localhost:9/"] {
            let c = Connector::new(Guarded(guard.clone()));
            match send(c, get(url), soon(), soon()).await {
                Err(SendError::Connect(ConnectError::Resolve(ResolveError::Guard(e)))) => {
                    assert!(e.to_string().starts_with("connection blocked"), "{e}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        // An allowed address is dialled.
        let (addr, _) = peer().await;
        let c = Connector::new(Guarded(Arc::new(
            Guard::new(&[]).unwrap_or_else(|e| panic!("{e}")),
        )));
        let resp = send(c, get(&format!("http://{addr}/")), soon(), soon())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(resp.status(), 200);
        let body = collect(resp.into_body(), 10, soon())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(&body[..], b"ok");
    }

    #[tokio::test]
    async fn probe_connector_dials_its_address_from_the_probe_source() {
        let (addr, seen) = peer().await;
        // The URL names only the authority the request carries.
        let c = Connector::new(ProbeSource { to: addr });
        let resp = send(c, get("http://app.example:8080/health"), soon(), soon())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(resp.status(), 200);
        let (from, head) = seen.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(from.ip().to_string(), "127.0.0.6", "{head}");
        assert!(head.starts_with("GET /health HTTP/1.1\r\n"), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("host: app.example:8080\r\n"),
            "{head}"
        );
    }

    #[tokio::test]
    async fn body_bounds_and_deadlines() {
        let (addr, _) = peer().await;
        let resp = send(
            Connector::new(connect::Plain),
            get(&format!("http://{addr}/")),
            soon(),
            soon(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let e = collect(resp.into_body(), 1, soon()).await.unwrap_err();
        assert!(matches!(e, BodyError::TooLarge { cap: 1 }), "{e}");

        // A peer that accepts and never answers: the head's deadline ends the wait.
        let l = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let _keep = tokio::spawn(async move {
            let s = l.accept().await;
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(s);
        });
        let by = Instant::now() + Duration::from_millis(200);
        let e = send(
            Connector::new(connect::Plain),
            get(&format!("http://{addr}/")),
            by,
            by,
        )
        .await
        .unwrap_err();
        assert!(matches!(e, SendError::Timeout), "{e}");

        // https without TLS configured is refused, not sent in plain text.
        let e = send(
            Connector::new(connect::Plain),
            get(&format!("https://{addr}/")),
            soon(),
            soon(),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, SendError::Connect(ConnectError::Url(_))), "{e}");
    }
}
