//! Reading files the agent does not control, without ever blocking the runtime.
//!
//! The agent runs one runtime thread (`main.rs`), so a read that blocks stalls readiness,
//! metrics, SDS and xDS alike. Files named by others — a DestinationRule's
//! `caCertificates` (istiod sends it as `file-root:<path>`,
//! `pilot/pkg/networking/core/cluster_tls.go`), the projected token, mounted roots — are
//! therefore read on Tokio's blocking pool with a timeout, only if they are regular files,
//! and only up to a size cap. The open itself never blocks (`O_NONBLOCK`: a FIFO with no
//! writer would), and the type is checked on the opened descriptor, so swapping a FIFO in
//! between check and read does not work.
#![allow(
    clippy::disallowed_methods,
    reason = "this module is the blocking side: its callers run it on the blocking pool"
)]

use std::io::Read as _;
use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a bounded read failed; every variant names the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// `kind` is the failure's own `std::io::ErrorKind` (callers tell a missing file from an
    /// unreadable one by it).
    #[error("cannot read {path}: {reason}")]
    Io {
        path: String,
        reason: String,
        kind: std::io::ErrorKind,
    },
    #[error("cannot read {path}: not a regular file (a {kind})")]
    NotRegular { path: String, kind: &'static str },
    #[error("cannot read {path}: larger than {max} bytes")]
    TooLarge { path: String, max: u64 },
    #[error("reading {path} did not finish within {timeout:?}")]
    Timeout { path: String, timeout: Duration },
}

impl ReadError {
    /// Failures that rewriting the file soon will not fix (not worth a quick retry).
    pub fn is_permanent(&self) -> bool {
        !matches!(self, ReadError::Io { .. })
    }

    /// The `std::io::ErrorKind` closest to this failure.
    pub fn kind(&self) -> std::io::ErrorKind {
        match self {
            ReadError::Io { kind, .. } => *kind,
            ReadError::NotRegular { .. } | ReadError::TooLarge { .. } => {
                std::io::ErrorKind::InvalidData
            }
            ReadError::Timeout { .. } => std::io::ErrorKind::TimedOut,
        }
    }
}

/// Reads a regular file of at most `max` bytes. Blocking: call it off the reactor (see
/// [`read`]).
pub fn read_bounded(path: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    let shown = || path.display().to_string();
    let io = |e: std::io::Error| ReadError::Io {
        path: shown(),
        reason: e.to_string(),
        kind: e.kind(),
    };
    let flags = nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_NOCTTY;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits())
        .open(path)
        .map_err(io)?;
    let t = f.metadata().map_err(io)?.file_type();
    if !t.is_file() {
        let kind = if t.is_fifo() {
            "FIFO"
        } else if t.is_char_device() {
            "character device"
        } else if t.is_block_device() {
            "block device"
        } else if t.is_socket() {
            "socket"
        } else if t.is_dir() {
            "directory"
        } else {
            "special file"
        };
        return Err(ReadError::NotRegular {
            path: shown(),
            kind,
        });
    }
    let mut buf = Vec::new();
    f.take(max + 1).read_to_end(&mut buf).map_err(io)?;
    if buf.len() as u64 > max {
        return Err(ReadError::TooLarge { path: shown(), max });
    }
    Ok(buf)
}

/// [`read_bounded`] on the blocking pool, giving up after `timeout` (the read itself may stay
/// stuck there, e.g. on a hung network filesystem; nothing waits for it).
pub async fn read(path: PathBuf, max: u64, timeout: Duration) -> Result<Vec<u8>, ReadError> {
    let shown = path.display().to_string();
    let job = tokio::task::spawn_blocking(move || read_bounded(&path, max));
    match tokio::time::timeout(timeout, job).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(ReadError::Io {
            path: shown,
            reason: format!("read task failed: {e}"),
            kind: std::io::ErrorKind::Other,
        }),
        Err(_) => Err(ReadError::Timeout {
            path: shown,
            timeout,
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_regular_bounded_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        // Opening a FIFO with no writer would block a plain read forever.
        let e = read_bounded(&fifo, 10).unwrap_err();
        assert!(
            matches!(e, ReadError::NotRegular { kind: "FIFO", .. }),
            "{e}"
        );
        let e = read_bounded(Path::new("/dev/zero"), 10).unwrap_err();
        assert!(
            e.to_string()
                .contains("not a regular file (a character device)"),
            "{e}"
        );
        let f = dir.path().join("f");
        std::fs::write(&f, [b'x'; 11]).unwrap();
        assert!(matches!(
            read_bounded(&f, 10).unwrap_err(),
            ReadError::TooLarge { max: 10, .. }
        ));
        assert_eq!(read_bounded(&f, 11).unwrap().len(), 11);
        let e = read_bounded(&dir.path().join("missing"), 10).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        assert!(!e.is_permanent(), "a missing file may appear: {e}");
    }

    #[test]
    fn io_failures_keep_their_error_kind() {
        let dir = tempfile::tempdir().unwrap();
        let e = read_bounded(&dir.path().join("missing"), 10).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
        let e = read_bounded(&dir.path().join("missing/f"), 10).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
        let f = dir.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let e = read_bounded(&f.join("below"), 10).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotADirectory, "{e}");
        let e = read_bounded(dir.path(), 10).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn async_read_of_a_fifo_returns_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = read(fifo, 10, Duration::from_secs(5)).await.unwrap_err();
        assert!(e.is_permanent(), "{e}");
    }
}

/// `base.join(p)` without the `./` of each part: the agent's base is `.` and Istio's
/// default paths start with `./` (`./etc/istio/proxy`), and a plain join gives
/// `././etc/istio/proxy/XDS` in every log line and error naming the file. One leading `./`
/// is kept, as Istio writes its relative paths (`pkg/config/constants`); an absolute `p`
/// replaces `base`, as with `Path::join`.
pub fn under(base: &Path, p: impl AsRef<Path>) -> PathBuf {
    use std::path::Component;
    let joined = base.join(p);
    let mut out = PathBuf::new();
    let mut leading_dot = false;
    for c in joined.components() {
        match c {
            Component::CurDir => leading_dot |= out.as_os_str().is_empty(),
            c => out.push(c),
        }
    }
    match (leading_dot, out.as_os_str().is_empty()) {
        (_, true) => PathBuf::from("."),
        (true, false) => Path::new(".").join(out),
        (false, false) => out,
    }
}

#[cfg(test)]
mod under_tests {
    use super::under;
    use std::path::Path;

    #[test]
    fn joins_without_repeated_dots() {
        let p = under(Path::new("."), "./etc/istio/proxy");
        assert_eq!(p.to_str(), Some("./etc/istio/proxy"));
        let p = under(&under(Path::new("."), "./etc/istio/proxy"), "XDS");
        assert_eq!(p.to_str(), Some("./etc/istio/proxy/XDS"));
        assert_eq!(under(Path::new("/w"), "./a/./b").to_str(), Some("/w/a/b"));
        assert_eq!(under(Path::new("."), "/abs/x").to_str(), Some("/abs/x"));
        assert_eq!(under(Path::new("."), "").to_str(), Some("."));
        assert_eq!(under(Path::new("."), "var/run").to_str(), Some("./var/run"));
    }
}
