//! `OUTPUT_CERTS`: exported `key.pem`, `cert-chain.pem`, `root-cert.pem` (spec §4.4 step 4).
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
        if let Err(e) = job.await {
            tracing::warn!(dir = %self.dir.display(), error = %e, "OUTPUT_CERTS write task failed");
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

/// Atomic write with `mode`, skipped when the file already has exactly `content`.
pub fn write_if_changed(path: &Path, content: &[u8], mode: u32) -> std::io::Result<bool> {
    if std::fs::read(path).is_ok_and(|old| old == content) {
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
        assert!(write_if_changed(&key, b"K2", 0o600).unwrap());
        let k8s = OutputCerts::new(dir.path().join("k8s"), true);
        k8s.write_workload("K", "C", "R").await;
        let meta = std::fs::metadata(dir.path().join("k8s/root-cert.pem")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    }
}
