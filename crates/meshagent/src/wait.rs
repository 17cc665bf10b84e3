//! `pilot-agent wait`: poll a URL until it answers 200 (Istio `pilot/cmd/pilot-agent/app/wait.go`).

use std::net::SocketAddr;
use std::time::Duration;

use crate::cli::WaitArgs;
use crate::envoy::admin;

#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("invalid --url {url:?}: {reason}")]
    Url { url: String, reason: &'static str },
    #[error("timeout waiting for Envoy proxy to become ready. Last error: {0}")]
    Timeout(String),
}

/// `http://host[:port]/path` → (host, port, path).
pub fn parse_http_url(url: &str) -> Result<(String, u16, String), &'static str> {
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are supported")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || authority.starts_with('[') => {
            (h, p.parse().map_err(|_| "port is not a number")?)
        }
        _ => (authority, 80),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err("missing host");
    }
    Ok((host.to_owned(), port, path.to_owned()))
}

async fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, String> {
    tokio::net::lookup_host((host, port))
        .await
        .map(|a| a.collect())
        .map_err(|e| format!("resolve {host}: {e}"))
}

/// Sleeps `periodMillis` before each attempt; succeeds on the first 200.
pub async fn run(args: &WaitArgs) -> Result<(), WaitError> {
    let (host, port, path) = parse_http_url(&args.url).map_err(|reason| WaitError::Url {
        url: args.url.clone(),
        reason,
    })?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.timeout_seconds);
    let period = Duration::from_millis(args.period_millis);
    let per_request = Duration::from_millis(args.request_timeout_millis);
    let mut last = String::from("no attempt made");
    // Istio's texts (`pilot/cmd/pilot-agent/app/wait.go`): startup hooks' logs are grepped.
    tracing::info!(
        "Waiting for Envoy proxy to be ready (timeout: {} seconds)...",
        args.timeout_seconds
    );
    loop {
        tokio::time::sleep(period).await;
        if tokio::time::Instant::now() >= deadline {
            return Err(WaitError::Timeout(last));
        }
        let addrs = match resolve(&host, port).await {
            Ok(a) => a,
            Err(e) => {
                last = e;
                continue;
            }
        };
        for addr in addrs {
            match admin::request("GET", addr, &path, per_request).await {
                Ok((200, _)) => {
                    tracing::info!("Envoy is ready!");
                    return Ok(());
                }
                Ok((code, body)) => last = format!("HTTP status code {code}: {}", body.trim()),
                Err(e) => last = e.to_string(),
            }
            tracing::debug!("Not ready yet: {last}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            parse_http_url("http://localhost:15021/healthz/ready").unwrap(),
            ("localhost".into(), 15021, "/healthz/ready".into())
        );
        assert_eq!(
            parse_http_url("http://[::1]:15020/x").unwrap(),
            ("::1".into(), 15020, "/x".into())
        );
        assert_eq!(
            parse_http_url("http://h").unwrap(),
            ("h".into(), 80, "/".into())
        );
        assert!(parse_http_url("https://h/").is_err());
    }

    #[tokio::test]
    async fn times_out_with_last_error() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let args = WaitArgs {
            url: format!("http://127.0.0.1:{port}/ready"),
            timeout_seconds: 1,
            request_timeout_millis: 100,
            period_millis: 100,
        };
        let err = run(&args).await.unwrap_err().to_string();
        assert!(
            err.starts_with("timeout waiting for Envoy proxy to become ready"),
            "{err}"
        );
    }
}
