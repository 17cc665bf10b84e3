//! `OUTPUT_CERTS`: exported `key.pem`, `cert-chain.pem`, `root-cert.pem` (Istio `security/pkg/nodeagent/cache/secretcache.go`, `OUTPUT_CERTS` in `pkg/istio-agent/agent.go`).
//!
//! Istio rewrites the three files one after the other (`OutputKeyCertToDir`: key, then chain,
//! then root, each with an atomic rename), so a reader between two renames sees a new key with
//! the old chain — and proxyless gRPC's `file_watcher` provider reads exactly these paths. Here
//! the three files are replaced **as one set**, the way the kubelet publishes projected
//! volumes (`pkg/volume/util/atomic_writer.go`):
//!
//! ```text
//! <dir>/..2026_12_01_13_05_01.123456789/{key,cert-chain,root-cert}.pem   one generation
//! <dir>/..data -> ..2026_12_01_13_05_01.123456789                        swapped by rename
//! <dir>/key.pem -> ..data/key.pem   (and cert-chain.pem, root-cert.pem)  fixed
//! ```
//!
//! A new generation is written and fsynced in full, then `..data` is replaced by one
//! `rename(2)`: at every instant the three paths resolve into the same generation. The
//! previous generation is kept (a reader that resolved it a moment ago can finish), older ones
//! are removed. Files have mode 0600 — or 0644 when `KUBERNETES_SERVICE_HOST` is set, as Istio
//! does for other containers of the pod. Nothing is written when the set is unchanged.
#![allow(
    clippy::disallowed_methods,
    reason = "OUTPUT_CERTS writes run on the blocking pool (OutputCerts::write_workload)"
)]

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// The exported files, in Istio's names.
pub const FILES: [&str; 3] = ["key.pem", "cert-chain.pem", "root-cert.pem"];
/// The symlink naming the current generation (the kubelet's name).
const DATA: &str = "..data";

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

    /// Writes the set on the blocking pool (each write ends in an fsync, which can take long
    /// on a slow disk). `Ok(true)` when a new generation was published, `Ok(false)` when the
    /// files already held this set; `Err` says why not (disk full, read-only filesystem, a
    /// hung disk): the caller retries — exporting never stops serving, and a failure never
    /// leaves a partial generation behind.
    pub async fn write_workload(&self, key: &str, chain: &str, root: &str) -> Result<bool, String> {
        let this = self.clone();
        let contents = [key.to_owned(), chain.to_owned(), root.to_owned()];
        let job = tokio::task::spawn_blocking(move || this.write_set(&contents));
        // A hung disk must not stop rotation: the write may finish later on its own.
        match tokio::time::timeout(WRITE_TIMEOUT, job).await {
            Ok(Ok(Ok(written))) => {
                if written {
                    tracing::debug!(dir = %self.dir.display(), "OUTPUT_CERTS updated");
                }
                Ok(written)
            }
            Ok(Ok(Err(e))) => Err(format!(
                "cannot write OUTPUT_CERTS {}: {e}",
                self.dir.display()
            )),
            Ok(Err(e)) => Err(format!("OUTPUT_CERTS write task failed: {e}")),
            Err(_) => Err(format!(
                "writing OUTPUT_CERTS {} did not finish within {WRITE_TIMEOUT:?}",
                self.dir.display()
            )),
        }
    }

    /// Publishes `contents` (in [`FILES`] order) as a new generation; `false` when the
    /// current set already has exactly this content.
    pub fn write_set(&self, contents: &[String; 3]) -> std::io::Result<bool> {
        let dir = &self.dir;
        self.create_dir()?;
        let unchanged = FILES.iter().zip(contents).all(|(name, c)| {
            crate::fsio::read_bounded(&dir.join(name), c.len() as u64)
                .is_ok_and(|old| old == c.as_bytes())
        });
        if unchanged && self.links_in_place() {
            return Ok(false);
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let gen_name = format!(
            "..{}.{:09}.{}",
            now.as_secs(),
            now.subsec_nanos(),
            std::process::id()
        );
        let generation = dir.join(&gen_name);
        // Traversable by the application's uid only when the files are meant to be readable.
        std::fs::DirBuilder::new()
            .mode(self.dir_mode())
            .create(&generation)?;
        // Until `..data` names it, a failed generation is removed at once: a disk that filled
        // up half-way must not leave a complete `key.pem` beside an empty `cert-chain.pem`
        // for anyone listing the directory (or for the next attempt to trip over).
        let written = self.fill_generation(&generation, contents).and_then(|()| {
            let previous = std::fs::read_link(dir.join(DATA)).ok();
            // The one switch readers can observe.
            replace_symlink(Path::new(&gen_name), &dir.join(DATA))?;
            Ok(previous)
        });
        let previous = match written {
            Ok(p) => p,
            Err(e) => {
                if let Err(rm) = std::fs::remove_dir_all(&generation) {
                    tracing::debug!(path = %generation.display(), error = %rm, "cannot remove a failed OUTPUT_CERTS generation");
                }
                return Err(e);
            }
        };
        // Fixed links (first write, or a directory an Istio agent wrote regular files into).
        for name in FILES {
            let want = Path::new(DATA).join(name);
            if std::fs::read_link(dir.join(name)).ok().as_deref() != Some(want.as_path()) {
                replace_symlink(&want, &dir.join(name))?;
            }
        }
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        self.remove_old(&gen_name, previous.as_deref());
        Ok(true)
    }

    fn dir_mode(&self) -> u32 {
        if self.mode & 0o004 != 0 { 0o755 } else { 0o700 }
    }

    /// The export directory, created with an explicit mode rather than the umask's: 0700 when
    /// only the agent's uid reads the files, 0755 when they are world-readable anyway
    /// (`KUBERNETES_SERVICE_HOST` set: other containers of the pod read them, as in Istio). An
    /// existing directory is left as its owner made it (a volume mount).
    fn create_dir(&self) -> std::io::Result<()> {
        if self.dir.is_dir() {
            return Ok(());
        }
        let mode = self.dir_mode();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(&self.dir)?;
        // The umask may have taken bits away from `mode` (never added any).
        std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(mode))
    }

    fn fill_generation(&self, generation: &Path, contents: &[String; 3]) -> std::io::Result<()> {
        for (name, content) in FILES.iter().zip(contents) {
            // Created with the final mode so the key is never briefly readable by others.
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(self.mode)
                .open(generation.join(name))?;
            f.write_all(content.as_bytes())?;
            f.sync_all()?;
            std::fs::set_permissions(
                generation.join(name),
                std::fs::Permissions::from_mode(self.mode),
            )?;
        }
        Ok(())
    }

    fn links_in_place(&self) -> bool {
        FILES.iter().all(|name| {
            std::fs::read_link(self.dir.join(name)).ok().as_deref()
                == Some(Path::new(DATA).join(name).as_path())
        })
    }

    /// Removes generations other than the current and the previous one.
    fn remove_old(&self, current: &str, previous: Option<&Path>) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if !name.starts_with("..")
                || name == DATA
                || name == current
                || previous.is_some_and(|p| p == Path::new(name.as_ref()))
                || !e.file_type().is_ok_and(|t| t.is_dir())
            {
                continue;
            }
            if let Err(err) = std::fs::remove_dir_all(e.path()) {
                tracing::debug!(path = %e.path().display(), error = %err, "cannot remove an old OUTPUT_CERTS generation");
            }
        }
    }
}

/// Points `link` at `target` with one rename (a temporary link next to it first).
fn replace_symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    let tmp = link.with_file_name(format!(
        ".{}.tmp-link",
        link.file_name()
            .map_or("out".into(), |n| n.to_string_lossy())
    ));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    std::fs::rename(&tmp, link)
}

/// How long exporting one certificate set may take before rotation moves on.
const WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn set(n: usize) -> [String; 3] {
        [format!("K{n}"), format!("C{n}"), "R".to_owned()]
    }

    #[tokio::test]
    async fn set_written_once_with_modes_and_links() {
        let dir = tempfile::tempdir().unwrap();
        let out = OutputCerts::new(dir.path().join("out"), false);
        assert!(out.write_workload("K", "C", "R").await.unwrap());
        let key = dir.path().join("out/key.pem");
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "K");
        assert_eq!(
            std::fs::read_link(&key).unwrap(),
            Path::new("..data/key.pem")
        );
        let meta = std::fs::metadata(&key).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let first = std::fs::read_link(dir.path().join("out/..data")).unwrap();
        assert!(
            !out.write_set(&["K".into(), "C".into(), "R".into()])
                .unwrap()
        );
        assert_eq!(
            std::fs::read_link(dir.path().join("out/..data")).unwrap(),
            first
        );
        let k8s = OutputCerts::new(dir.path().join("k8s"), true);
        assert!(k8s.write_workload("K", "C", "R").await.unwrap());
        let meta = std::fs::metadata(dir.path().join("k8s/root-cert.pem")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o644);
    }

    #[test]
    fn regular_files_from_istio_are_replaced_and_old_generations_pruned() {
        let dir = tempfile::tempdir().unwrap();
        for name in FILES {
            std::fs::write(dir.path().join(name), "old").unwrap();
        }
        let out = OutputCerts::new(dir.path().to_path_buf(), false);
        for n in 0..5 {
            assert!(out.write_set(&set(n)).unwrap());
        }
        assert_eq!(
            std::fs::read_to_string(dir.path().join("cert-chain.pem")).unwrap(),
            "C4"
        );
        let gens = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .filter(|e| e.file_type().unwrap().is_dir())
            .count();
        assert_eq!(gens, 2, "current and previous generation kept");
    }

    /// A reader polling the three paths during rotations never sees a key of one set with
    /// the chain of another. It reads key, chain, key (gRPC's file_watcher likewise re-checks
    /// the key around reading the chain): when both key reads agree, the chain read between
    /// them must be from the same set. Istio's file-by-file renames fail this.
    #[test]
    fn polling_reader_never_sees_a_mixed_set() {
        let dir = tempfile::tempdir().unwrap();
        let out = OutputCerts::new(dir.path().to_path_buf(), false);
        out.write_set(&set(0)).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (path, flag) = (dir.path().to_path_buf(), stop.clone());
        let reader = std::thread::spawn(move || {
            let (mut consistent, mut mixed) = (0u64, Vec::new());
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let read = |n: &str| std::fs::read_to_string(path.join(n)).unwrap_or_default();
                let (k1, c, k2) = (read("key.pem"), read("cert-chain.pem"), read("key.pem"));
                if k1 == k2 && !k1.is_empty() {
                    consistent += 1;
                    if k1[1..] != c[1..] {
                        mixed.push((k1, c));
                    }
                }
            }
            (consistent, mixed)
        });
        for n in 1..=300 {
            out.write_set(&set(n)).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (consistent, mixed) = reader.join().unwrap();
        assert!(consistent > 0);
        assert!(mixed.is_empty(), "mixed sets seen: {mixed:?}");
    }
}
