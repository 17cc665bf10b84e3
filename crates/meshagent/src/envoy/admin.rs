//! A minimal HTTP/1.1 client for Envoy's admin API (loopback, small bodies) and the agent's
//! own status port. One request per connection; bodies are capped so a misbehaving peer
//! cannot make the agent allocate without bound.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest admin response the agent reads (stats with filters are far smaller).
pub const MAX_BODY: usize = 16 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{method} http://{addr}{path}: {source}")]
    Io {
        method: &'static str,
        addr: SocketAddr,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{method} http://{addr}{path}: timed out after {timeout:?}")]
    Timeout {
        method: &'static str,
        addr: SocketAddr,
        path: String,
        timeout: Duration,
    },
    #[error("{method} http://{addr}{path}: malformed response: {reason}")]
    Malformed {
        method: &'static str,
        addr: SocketAddr,
        path: String,
        reason: &'static str,
    },
}

/// Status code and body.
pub async fn request(
    method: &'static str,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String), AdminError> {
    request_with_body(method, addr, path, "", timeout).await
}

/// [`request`] with a request body.
pub async fn request_with_body(
    method: &'static str,
    addr: SocketAddr,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Result<(u16, String), AdminError> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\nUser-Agent: meshagent\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        (&mut s)
            .take(MAX_BODY as u64 + 64 * 1024)
            .read_to_end(&mut buf)
            .await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = match tokio::time::timeout(timeout, fut).await {
        Err(_) => {
            return Err(AdminError::Timeout {
                method,
                addr,
                path: path.to_owned(),
                timeout,
            });
        }
        Ok(Err(source)) => {
            return Err(AdminError::Io {
                method,
                addr,
                path: path.to_owned(),
                source,
            });
        }
        Ok(Ok(b)) => b,
    };
    parse(&buf).map_err(|reason| AdminError::Malformed {
        method,
        addr,
        path: path.to_owned(),
        reason,
    })
}

fn parse(buf: &[u8]) -> Result<(u16, String), &'static str> {
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| "headers are not UTF-8")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("bad status line")?;
    let body = &buf[end + 4..];
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n").ok_or("bad chunk")?;
        let size = std::str::from_utf8(&b[..nl]).map_err(|_| "bad chunk size")?;
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| "bad chunk size")?;
        b = &b[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        if b.len() < size {
            return Err("truncated chunk");
        }
        out.extend_from_slice(&b[..size]);
        b = b.get(size + 2..).unwrap_or_default();
    }
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
    fn parses_plain_and_chunked() {
        let (s, b) = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").unwrap();
        assert_eq!((s, b.as_str()), (200, "ok"));
        let (s, b) = parse(
            b"HTTP/1.1 503 X\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((s, b.as_str()), (503, "abcde"));
        assert!(parse(b"garbage").is_err());
    }

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
