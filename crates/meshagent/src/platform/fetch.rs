//! One bounded HTTP/1.1 exchange with a metadata server on the agent's one client
//! ([`crate::net`], plain connector): connect, send, read a capped body, all under one
//! deadline. Metadata servers are plain HTTP on a link-local address (or a host named by
//! `GCE_METADATA_HOST`), so this needs no TLS and no connection reuse.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::Full;
use tokio::time::Instant;

use crate::net::{self, Connector, SendError, connect::Plain};

/// Metadata answers are small; anything larger is not a metadata server.
const BODY_CAP: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{method} http://{authority}{path}: timed out after {timeout:?}")]
    Timeout {
        method: Method,
        authority: String,
        path: String,
        timeout: Duration,
    },
    #[error("{method} http://{authority}{path}: {reason}")]
    Failed {
        method: Method,
        authority: String,
        path: String,
        reason: String,
    },
}

/// A response: status, headers and the whole body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    /// The body as text with surrounding whitespace removed (the Go metadata client's
    /// `getTrimmed`), if the status is 200.
    pub fn ok_text(&self) -> Option<String> {
        (self.status == StatusCode::OK)
            .then(|| String::from_utf8_lossy(&self.body).trim().to_owned())
    }
}

/// `method http://authority/path` with `headers`, bounded by `timeout` from connect to the
/// end of the body. `authority` is `host[:port]` (port 80 when absent; IPv6 in brackets).
pub async fn fetch(
    method: Method,
    authority: &str,
    path: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<Answer, FetchError> {
    let fail = |reason: String| FetchError::Failed {
        method: method.clone(),
        authority: authority.to_owned(),
        path: path.to_owned(),
        reason,
    };
    let deadline = Instant::now() + timeout;
    let timed_out = || FetchError::Timeout {
        method: method.clone(),
        authority: authority.to_owned(),
        path: path.to_owned(),
        timeout,
    };
    // A bare IPv6 address (as `GCE_METADATA_HOST` may hold) is bracketed in a URL.
    let url = match authority.parse::<std::net::Ipv6Addr>() {
        Ok(_) => net::url("http", &format!("[{authority}]"), path),
        Err(_) => net::url("http", authority, path),
    }
    .map_err(fail)?;
    let mut req = Request::builder()
        .method(method.clone())
        .uri(url)
        .header(header::HOST, authority)
        .header(header::CONNECTION, "close")
        .header(header::USER_AGENT, "meshagent");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|e| fail(e.to_string()))?;
    let resp = match net::send(Connector::new(Plain), req, deadline, deadline).await {
        Ok(r) => r,
        Err(SendError::Timeout) => return Err(timed_out()),
        Err(SendError::Connect(net::ConnectError::Connect { source, .. })) => {
            return Err(fail(format!("connect: {source}")));
        }
        Err(SendError::Connect(e)) => return Err(fail(format!("connect: {e}"))),
        Err(SendError::Exchange(e)) => return Err(fail(e)),
    };
    let (parts, body) = resp.into_parts();
    let body = match net::collect(body, BODY_CAP, deadline).await {
        Ok(b) => b,
        Err(net::BodyError::Timeout) => return Err(timed_out()),
        Err(e) => return Err(fail(format!("reading the body: {e}"))),
    };
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// `host:port` for connecting: the authority as given if it has a port, else port 80.
fn with_port(authority: &str) -> String {
    let has_port = match authority.rfind(']') {
        // `[v6]` or `[v6]:port`
        Some(i) => authority[i..].contains(':'),
        None => authority.matches(':').count() == 1,
    };
    if has_port {
        authority.to_owned()
    } else if authority.contains(':') && !authority.starts_with('[') {
        // A bare IPv6 address.
        format!("[{authority}]:80")
    } else {
        format!("{authority}:80")
    }
}

/// Whether a plain TCP connection to `authority` opens within `timeout` (Istio's
/// `isMetadataEndpointAccessible` dial).
pub async fn dial(authority: &str, timeout: Duration) -> bool {
    let target = with_port(authority);
    matches!(
        tokio::time::timeout(timeout, tokio::net::TcpStream::connect(target.as_str())).await,
        Ok(Ok(_))
    )
}

#[cfg(test)]
mod tests {
    use super::with_port;

    #[test]
    fn default_port_80() {
        assert_eq!(with_port("169.254.169.254"), "169.254.169.254:80");
        assert_eq!(with_port("127.0.0.1:8080"), "127.0.0.1:8080");
        assert_eq!(with_port("[fd00:ec2::254]"), "[fd00:ec2::254]:80");
        assert_eq!(with_port("[::1]:99"), "[::1]:99");
        assert_eq!(
            with_port("metadata.google.internal"),
            "metadata.google.internal:80"
        );
    }
}
