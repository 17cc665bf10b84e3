//! A minimal HTTP/1.1 client for admin and debug endpoints.

use std::net::SocketAddr;
use std::time::Duration;

/// Largest body the harness reads (Envoy config dumps of test meshes are far smaller).
const HTTP_BODY_CAP: usize = 256 * 1024 * 1024;

/// One HTTP/1.1 request to an admin or debug endpoint, through the agent's own client
/// ([`meshagent::http_client`]); a body cut short is an error.
pub async fn http(method: &str, addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    http_with_body(method, addr, path, &[]).await
}

/// Like [`http`], sending `body`.
pub async fn http_with_body(
    method: &str,
    addr: SocketAddr,
    path: &str,
    body: &[u8],
) -> std::io::Result<(u16, String)> {
    use meshagent::http_client::{self, Call, Method};
    let method = Method::from_bytes(method.as_bytes()).map_err(std::io::Error::other)?;
    let call = Call {
        body: bytes::Bytes::copy_from_slice(body),
        ..Call::new(method, addr, path, Duration::from_secs(10))
    };
    let (status, text) = http_client::text(&call, HTTP_BODY_CAP)
        .await
        .map_err(std::io::Error::other)?;
    Ok((status.as_u16(), text))
}

pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    http("GET", addr, path).await
}
