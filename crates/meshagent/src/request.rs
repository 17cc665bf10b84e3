//! `pilot-agent request <method> <path> [<body>]` (spec §1.4): an HTTP request to a local
//! debug port; the body is printed verbatim (istioctl parses it).

use std::net::SocketAddr;
use std::time::Duration;

use crate::cli::RequestArgs;
use crate::envoy::admin;

/// Ports `request` may talk to: Envoy admin, agent status, Envoy readiness, legacy debug.
pub const ALLOWED_PORTS: [i32; 4] = [15000, 15020, 15021, 15004];

#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("debug port {0} is not allowed; use one of 15000, 15020, 15021, 15004")]
    Port(i32),
    #[error("unsupported HTTP method {0:?}")]
    Method(String),
    #[error(transparent)]
    Http(#[from] admin::AdminError),
    #[error("received unsuccessful status code {code}: {body}")]
    Status { code: u16, body: String },
}

fn method(m: &str) -> Option<&'static str> {
    Some(match m.to_ascii_uppercase().as_str() {
        "GET" => "GET",
        "POST" => "POST",
        "PUT" => "PUT",
        "DELETE" => "DELETE",
        "HEAD" => "HEAD",
        "PATCH" => "PATCH",
        "OPTIONS" => "OPTIONS",
        _ => return None,
    })
}

/// Returns the response body; statuses above 399 other than 404 are errors, as in Istio.
pub async fn run(args: &RequestArgs) -> Result<String, RequestError> {
    if !ALLOWED_PORTS.contains(&args.debug_port) {
        return Err(RequestError::Port(args.debug_port));
    }
    let port = u16::try_from(args.debug_port).map_err(|_| RequestError::Port(args.debug_port))?;
    let m = method(&args.method).ok_or_else(|| RequestError::Method(args.method.clone()))?;
    let path = format!("/{}", args.path.trim_start_matches('/'));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let body = args.body.as_deref().unwrap_or("");
    let (code, resp) =
        admin::request_with_body(m, addr, &path, body, Duration::from_secs(60)).await?;
    if code > 399 && code != 404 {
        return Err(RequestError::Status { code, body: resp });
    }
    Ok(resp)
}
