//! The unix sockets the agent serves Envoy on (SDS `var/run/secrets/...`, xDS
//! `etc/istio/proxy/XDS`): one way to bind them, shared by [`crate::identity::sds`] and [`crate::xds`].
//!
//! Istio (`pkg/uds/listener.go`, `NewListener`) removes a stale socket left by a previous run,
//! listens, and makes the socket 0666 so Envoy can connect whatever its uid.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;

/// The path to bind a unix socket at: relative to the process's working directory when `path`
/// is under it, as Istio binds `./var/run/...` and `./etc/istio/proxy/XDS`. A socket address
/// holds at most 107 bytes (SUN_LEN), so an absolute path under a long working directory
/// would not bind.
pub fn bind_path(path: &Path) -> PathBuf {
    if path.is_absolute()
        && let Ok(cwd) = std::env::current_dir()
        && let Ok(rel) = path.strip_prefix(&cwd)
    {
        return Path::new(".").join(rel);
    }
    path.to_path_buf()
}

/// Whether a live server listens at `path`: a connect succeeds, or the listener's backlog is
/// full (still a live listener). Non-blocking, so it never waits on the runtime thread; a
/// missing path, a stale socket left by a dead process (`ECONNREFUSED`) or a non-socket is
/// not live. Istio's `checkSocket` (`pkg/istio-agent/agent.go`) dials the same way.
pub fn accepts_connections(path: &Path) -> bool {
    use nix::errno::Errno;
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    use std::os::fd::AsRawFd as _;
    let Ok(addr) = UnixAddr::new(&bind_path(path)) else {
        return false;
    };
    let Ok(fd) = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return false;
    };
    matches!(
        connect(fd.as_raw_fd(), &addr),
        Ok(()) | Err(Errno::EAGAIN | Errno::EINPROGRESS)
    )
}

/// Binds `path` once (its directory must exist): a stale socket is removed first and the new
/// one made 0666. `what` names the socket in logs ("SDS", "xDS").
///
/// A socket removed between bind and chmod is not an error: the listener is returned and the
/// server's supervisor (`supervise.rs`) notices the missing file and binds it again.
#[allow(
    clippy::disallowed_methods,
    reason = "callers run it on the blocking pool (sds::bind, xds rebinds) or once at start"
)]
pub fn bind_once(path: &Path, what: &str) -> std::io::Result<UnixListener> {
    let bound = bind_path(path);
    match std::fs::remove_file(&bound) {
        Ok(()) => tracing::debug!(socket = %path.display(), "removed stale {what} socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = UnixListener::bind(&bound)?;
    match std::fs::set_permissions(&bound, std::fs::Permissions::from_mode(0o666)) {
        Ok(()) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!(socket = %path.display(), "{what} socket removed right after bind");
            Ok(l)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::disallowed_methods,
        reason = "test code, not on the agent's runtime"
    )]
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::FileTypeExt as _;

    #[tokio::test]
    async fn replaces_a_stale_socket_and_makes_it_world_connectable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sock");
        std::fs::write(&path, b"stale").unwrap();
        let _l = bind_once(&path, "test").unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o666);
        tokio::net::UnixStream::connect(&path).await.unwrap();
    }

    #[test]
    fn a_path_under_the_working_directory_binds_relative() {
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(bind_path(&cwd.join("a/b")), Path::new("./a/b"));
        assert_eq!(
            bind_path(Path::new("/elsewhere/x")),
            Path::new("/elsewhere/x")
        );
        assert_eq!(bind_path(Path::new("rel/x")), Path::new("rel/x"));
    }
}
