//! `pilot-agent request <method> <path> [<body>]` (Istio `pilot/cmd/pilot-agent/app/request.go`): an HTTP request to a local
//! debug port; the body is streamed to the output verbatim (istioctl parses it), so a
//! config dump of any size passes through in bounded memory. A body cut short is an error
//! (exit 1), not a silently shorter dump.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use tokio::io::AsyncWrite;

use crate::cli::RequestArgs;
use crate::http_client::{self, Call, HttpError};

/// Ports `request` may talk to: Envoy admin, agent status, Envoy readiness, legacy debug.
pub const ALLOWED_PORTS: [i32; 4] = [15000, 15020, 15021, 15004];
/// Istio's client timeout (`pilot-agent request`), covering the whole body.
pub const TIMEOUT: Duration = Duration::from_secs(60);
/// How much of an error response's body goes into the error message.
const ERROR_BODY: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("debug port {0} is not allowed; use one of 15000, 15020, 15021, 15004")]
    Port(i32),
    #[error("unsupported HTTP method {0:?}")]
    Method(String),
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("received unsuccessful status code {code}: {body}")]
    Status { code: u16, body: String },
}

fn method(m: &str) -> Option<Method> {
    Some(match m.to_ascii_uppercase().as_str() {
        "GET" => Method::GET,
        "POST" => Method::POST,
        "PUT" => Method::PUT,
        "DELETE" => Method::DELETE,
        "HEAD" => Method::HEAD,
        "PATCH" => Method::PATCH,
        "OPTIONS" => Method::OPTIONS,
        _ => return None,
    })
}

impl RequestError {
    /// Writing the body failed because the reader of stdout has gone (EPIPE).
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, RequestError::Http(HttpError { kind: http_client::HttpErrorKind::Write(e), .. })
            if e.kind() == std::io::ErrorKind::BrokenPipe)
    }
}

/// Sends the request and streams the response body into `out`; statuses above 399 other
/// than 404 are errors carrying (the start of) the body, as in Istio.
pub async fn run<W: AsyncWrite + Unpin>(
    args: &RequestArgs,
    out: &mut W,
) -> Result<(), RequestError> {
    if !ALLOWED_PORTS.contains(&args.debug_port) {
        return Err(RequestError::Port(args.debug_port));
    }
    let port = u16::try_from(args.debug_port).map_err(|_| RequestError::Port(args.debug_port))?;
    let m = method(&args.method).ok_or_else(|| RequestError::Method(args.method.clone()))?;
    let path = format!("/{}", args.path.trim_start_matches('/'));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let call = Call {
        body: Bytes::from(args.body.clone().unwrap_or_default()),
        ..Call::new(m, addr, &path, TIMEOUT)
    };
    let resp = http_client::send(&call).await?;
    let code = resp.status.as_u16();
    if code > 399 && code != 404 {
        let (body, more) = resp.prefix(ERROR_BODY).await?;
        let mut body = String::from_utf8_lossy(&body).into_owned();
        if more {
            body.push_str(&format!(" [body cut at {ERROR_BODY} bytes]"));
        }
        return Err(RequestError::Status { code, body });
    }
    resp.copy_to(out).await?;
    Ok(())
}
