//! Remote module downloads over HTTP(S) (Istio `pkg/wasm/httpfetcher.go` `Fetch`): up to
//! `WASM_HTTP_REQUEST_MAX_RETRIES` **attempts** in total; transport errors and 5xx other
//! than 501/505/511 are retried with exponential backoff from 500 ms; any other non-200
//! stops at once. The body streams to a temp file in the cache directory, then is unwrapped
//! (gzip/tar) on the blocking pool.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderMap;
use tempfile::NamedTempFile;
use tokio::time::Instant;

use super::client::{Client, ClientError, Fetched};
use super::unpack::{self, Module, TarMember};

/// `wasm_remote_fetch_count{result}` values (Istio `pkg/wasm/monitoring.go`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchResult {
    Success,
    DownloadFailure,
    ManifestFailure,
    ChecksumMismatched,
    /// The download is not a valid module.
    FetchFailure,
}

impl FetchResult {
    pub fn label(self) -> &'static str {
        match self {
            FetchResult::Success => "success",
            FetchResult::DownloadFailure => "download_failure",
            FetchResult::ManifestFailure => "manifest_failure",
            FetchResult::ChecksumMismatched => "checksum_mismatched",
            FetchResult::FetchFailure => "fetch_failure",
        }
    }
}

/// A failed fetch: the metric outcome and a message for logs and NACK/fallback reasons.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FetchError {
    pub result: FetchResult,
    pub message: String,
}

impl FetchError {
    pub fn new(result: FetchResult, message: impl Into<String>) -> FetchError {
        FetchError {
            result,
            message: message.into(),
        }
    }
}

pub(crate) fn download_err(e: impl std::fmt::Display) -> FetchError {
    FetchError::new(FetchResult::DownloadFailure, e.to_string())
}

/// Istio `retryable`: 5xx except 501 Not Implemented, 505 HTTP Version Not Supported and
/// 511 Network Authentication Required.
pub fn retryable(status: u16) -> bool {
    (500..600).contains(&status) && !matches!(status, 501 | 505 | 511)
}

/// Fetch parameters shared by every download.
#[derive(Debug, Clone)]
pub struct Limits {
    /// `WASM_HTTP_REQUEST_MAX_RETRIES`: total attempts (at least one is made).
    pub attempts: u32,
    /// `ISTIO_WASM_MAX_BINARY_SIZE_BYTES`.
    pub max_bytes: u64,
}

/// Downloads an HTTP(S) module and unwraps it; `deadline` is the overall budget
/// (`http_uri.timeout`, 5 s when absent).
pub async fn http(
    client: &Client,
    url: &str,
    limits: &Limits,
    tmp_dir: &Path,
    deadline: Instant,
) -> Result<Module, FetchError> {
    let mut backoff = Duration::from_millis(500);
    let mut last = String::from("no attempt made");
    for attempt in 0..limits.attempts.max(1) {
        if attempt > 0 {
            if Instant::now() + backoff >= deadline {
                break;
            }
            tokio::time::sleep(backoff).await;
            backoff = backoff.mul_f64(1.5);
        }
        let resp = match tokio::time::timeout_at(
            deadline,
            client.get(url, &HeaderMap::new(), None, deadline),
        )
        .await
        {
            Err(_) => {
                last = format!("{url}: timed out");
                break;
            }
            Ok(Err(e)) => {
                let stop = !e.transient();
                last = e.to_string();
                if stop {
                    break;
                }
                continue;
            }
            Ok(Ok(r)) => r,
        };
        let status = resp.status.as_u16();
        if status == 200 {
            let (file, sha) = body_to_temp(resp, tmp_dir, limits.max_bytes, deadline)
                .await
                .map_err(download_err)?;
            return unpack_blocking(file, Some(sha), tmp_dir, limits.max_bytes, TarMember::First)
                .await;
        }
        last = format!("wasm module download request failed: {url}: status code {status}");
        resp.discard();
        if !retryable(status) {
            break;
        }
    }
    Err(FetchError::new(FetchResult::DownloadFailure, last))
}

/// Streams a body into a new temp file in `tmp_dir`; also returns the body's sha256.
pub(crate) async fn body_to_temp(
    resp: Fetched,
    tmp_dir: &Path,
    max: u64,
    deadline: Instant,
) -> Result<(NamedTempFile, String), ClientError> {
    let dir = tmp_dir.to_owned();
    #[allow(clippy::disallowed_methods, reason = "inside spawn_blocking")]
    let (tmp, std_file) = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&dir)?;
        let t = NamedTempFile::new_in(&dir)?;
        let f = t.as_file().try_clone()?;
        Ok::<_, std::io::Error>((t, f))
    })
    .await
    .map_err(|e| ClientError::Write(std::io::Error::other(e)))?
    .map_err(ClientError::Write)?;
    let (_, sha) = resp.to_file(std_file, max, deadline).await?;
    Ok((tmp, sha))
}

pub(crate) async fn unpack_blocking(
    file: NamedTempFile,
    sha256: Option<String>,
    tmp_dir: &Path,
    max: u64,
    member: TarMember,
) -> Result<Module, FetchError> {
    let dir: PathBuf = tmp_dir.to_owned();
    let shown = dir.display().to_string();
    tokio::task::spawn_blocking(move || unpack::unpack(file, sha256, &dir, max, member))
        .await
        .map_err(|e| FetchError::new(FetchResult::FetchFailure, e.to_string()))?
        .map_err(|e| match e {
            unpack::UnpackError::TooLarge { .. } => {
                FetchError::new(FetchResult::DownloadFailure, e.to_string())
            }
            // Disk full, read-only cache: say where (the temp file is already removed).
            unpack::UnpackError::Io(e) => FetchError::new(
                FetchResult::FetchFailure,
                format!("unpacking the module in {shown}: {e}"),
            ),
            e => FetchError::new(FetchResult::FetchFailure, e.to_string()),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_rules() {
        for s in [500, 502, 503, 504, 599] {
            assert!(retryable(s), "{s}");
        }
        for s in [200, 301, 404, 429, 501, 505, 511] {
            assert!(!retryable(s), "{s}");
        }
    }
}
