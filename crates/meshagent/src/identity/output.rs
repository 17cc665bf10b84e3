//! `OUTPUT_CERTS`: exported `key.pem`, `cert-chain.pem`, `root-cert.pem` (Istio `security/pkg/nodeagent/cache/secretcache.go`, `OUTPUT_CERTS` in `pkg/istio-agent/agent.go`).
//!
//! Each file is written only when its content changed, atomically (temp file in the same
//! directory, then rename) so a reader never sees half a key, with mode 0600 — or 0644 when
//! `KUBERNETES_SERVICE_HOST` is set, as Istio does for other containers of the pod.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct OutputCerts {
    dir: PathBuf,
    mode: u32,
}

impl OutputCerts {
    pub fn new(dir: PathBuf, world_readable: bool) -> OutputCerts {
        OutputCerts {
            dir,
            mode: if world_readable { 0o644 } else { 0o600 },
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes the three files on the blocking pool (each write ends in an fsync, which can
    /// take long on a slow disk); failures are logged (exporting must never stop serving).
    pub async fn write_workload(&self, key: &str, chain: &str, root: &str) {
        let this = self.clone();
        let files = [
            ("key.pem", key.to_owned()),
            ("cert-chain.pem", chain.to_owned()),
            ("root-cert.pem", root.to_owned()),
        ];
        let job = tokio::task::spawn_blocking(move || this.write_blocking(&files));
        // A hung disk must not stop rotation: the write may finish later on its own.
        match tokio::time::timeout(WRITE_TIMEOUT, job).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "OUTPUT_CERTS write task failed")
            }
            Err(_) => {
                tracing::warn!(dir = %self.dir.display(), timeout = ?WRITE_TIMEOUT, "OUTPUT_CERTS write did not finish in time; continuing")
            }
        }
    }

    fn write_blocking(&self, files: &[(&str, String)]) {
        if let Err(e) = std::fs::create_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot create OUTPUT_CERTS directory");
            return;
        }
        for (name, content) in files {
            if let Err(e) = write_if_changed(&self.dir.join(name), content.as_bytes(), self.mode) {
                tracing::warn!(file = name, dir = %self.dir.display(), error = %e, "cannot write OUTPUT_CERTS file");
            }
        }
    }
}

/// How long exporting one certificate set may take before rotation moves on.
const WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Atomic write with `mode`, skipped when the file already has exactly `content`. Whatever
/// is at `path` (a FIFO, a huge file) is only compared through a bounded, non-blocking read,
/// and replaced by the rename.
pub fn write_if_changed(path: &Path, content: &[u8], mode: u32) -> std::io::Result<bool> {
    let limit = content.len() as u64;
    if crate::fsio::read_bounded(path, limit).is_ok_and(|old| old == content) {
        return Ok(false);
    }
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name()
            .map_or("out".into(), |n| n.to_string_lossy())
    ));
    let _ = std::fs::remove_file(&tmp);
    // Created with the final mode so the key is never briefly readable by others.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(content)?;
    f.sync_all()?;
    drop(f);
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, path)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn atomic_only_when_changed_with_modes() {
        let dir = tempfile::tempdir().unwrap();
        let out = OutputCerts::new(dir.path().join("out"), false);
        out.write_workload("K", "C", "R").await;
        let key = dir.path().join("out/key.pem");
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "K");
        let meta = std::fs::metadata(&key).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert!(!write_if_changed(&key, b"K", 0o600).unwrap());
        // Whatever sits at the path (here a FIFO, whose plain read would block) is replaced.
        let fifo = dir.path().join("out/cert-chain.pem");
        std::fs::remove_file(&fifo).unwrap();
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(write_if_changed(&fifo, b"C", 0o600).unwrap());
        assert_eq!(std::fs::read(&fifo).unwrap(), b"C");
        assert!(write_if_changed(&key, b"K2", 0o600).unwrap());
        let k8s = OutputCerts::new(dir.path().join("k8s"), true);
        k8s.write_workload("K", "C", "R").await;
        let meta = std::fs::metadata(dir.path().join("k8s/root-cert.pem")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    }
}
