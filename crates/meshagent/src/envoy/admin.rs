//! Envoy's admin API (loopback) through the agent's HTTP client ([`crate::http_client`]).
//!
//! Every caller here needs a whole body (readiness stats, drain answers, connection counts),
//! so bodies are read up to [`MAX_BODY`]; a larger or cut-short body is an error, never a
//! truncated result that would be parsed as if it were complete.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Method;

use crate::http_client::{self, Call, HttpError, HttpErrorKind};

/// Largest admin response read whole. The agent's queries are filtered (`/ready`,
/// `/stats?usedonly&filter=…`, drain answers): a few KiB, at most a few hundred KiB for
/// per-listener connection stats in a large mesh. A larger body fails with
/// [`HttpErrorKind::TooLarge`] rather than being cut.
pub const MAX_BODY: usize = 16 * 1024 * 1024;

/// A failed admin request; names the method and URL.
pub type AdminError = HttpError;

/// Status code and body.
pub async fn request(
    method: &'static str,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String), AdminError> {
    request_with_body(method, addr, path, "", timeout).await
}

/// A `GET` whose body is parsed as bytes (no copy into a `String`).
pub async fn get_bytes(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, Bytes), AdminError> {
    let call = Call::new(Method::GET, addr, path, timeout);
    let resp = http_client::send(&call).await?;
    let status = resp.status;
    Ok((status.as_u16(), resp.bytes(MAX_BODY).await?))
}

/// [`request`] with a request body.
pub async fn request_with_body(
    method: &'static str,
    addr: SocketAddr,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Result<(u16, String), AdminError> {
    let method = Method::from_bytes(method.as_bytes()).map_err(|e| HttpError {
        method: Method::GET,
        addr,
        path: path.to_owned(),
        kind: HttpErrorKind::Request(format!("method {method:?}: {e}")),
    })?;
    let call = Call {
        body: Bytes::copy_from_slice(body.as_bytes()),
        ..Call::new(method, addr, path, timeout)
    };
    let (status, text) = http_client::text(&call, MAX_BODY).await?;
    Ok((status.as_u16(), text))
}

/// Parses Envoy's `/stats` text (`name: value` lines): the first line whose name equals `name`.
pub fn stat_value(body: &str, name: &str) -> Option<u64> {
    body.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == name).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_lines() {
        let body =
            "cluster_manager.cds.update_success: 3\nlistener_manager.lds.update_success: 1\n";
        assert_eq!(
            stat_value(body, "cluster_manager.cds.update_success"),
            Some(3)
        );
        assert_eq!(stat_value(body, "server.state"), None);
    }
}
