//! Emulation of the kubelet's atomic writer (projected tokens, secret and configmap volumes).
//!
//! Layout it maintains in `dir`: a timestamped `..<ts>` directory holding the real files, a
//! `..data` symlink to it, and for every file a visible symlink `name -> ..data/name`. An update
//! writes a new timestamped directory, points `..data_tmp` at it, renames `..data_tmp` over
//! `..data` (the atomic step) and deletes the old directory — so watchers of the visible files
//! only ever see events on `..data`, never on the names they watch.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static SEQ: AtomicU64 = AtomicU64::new(0);

/// Publishes `files` into `dir` as one atomic update; returns the new data directory.
pub fn atomic_write(dir: &Path, files: &[(&str, &[u8])]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let data = dir.join("..data");
    let old = std::fs::read_link(&data).ok().map(|t| dir.join(t));
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let ts = format!("..2026_11_29_00_00_00.{}{n}", std::process::id());
    let new_dir = dir.join(&ts);
    std::fs::create_dir(&new_dir).unwrap();
    for (name, content) in files {
        std::fs::write(new_dir.join(name), content).unwrap();
    }
    let tmp = dir.join("..data_tmp");
    let _ = std::fs::remove_file(&tmp);
    symlink(&ts, &tmp).unwrap();
    std::fs::rename(&tmp, &data).unwrap();
    for (name, _) in files {
        let visible = dir.join(name);
        if std::fs::symlink_metadata(&visible).is_err() {
            symlink(Path::new("..data").join(name), &visible).unwrap();
        }
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(old).unwrap();
    }
    new_dir
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swaps_data_and_keeps_visible_names() {
        let d = tempfile::tempdir().unwrap();
        let first = atomic_write(d.path(), &[("a", b"1")]);
        assert_eq!(std::fs::read(d.path().join("a")).unwrap(), b"1");
        atomic_write(d.path(), &[("a", b"2")]);
        assert_eq!(std::fs::read(d.path().join("a")).unwrap(), b"2");
        assert!(!first.exists(), "old data dir removed");
        assert!(
            std::fs::symlink_metadata(d.path().join("a"))
                .unwrap()
                .file_type()
                .is_symlink()
        );
    }
}
