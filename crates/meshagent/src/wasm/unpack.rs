//! Turns a downloaded file into a Wasm module on disk: gzip and tar wrappers are removed
//! until the `\0asm` magic appears (Istio `pkg/wasm/httpfetcher.go` `unboxIfPossible`), each
//! stage streamed file to file with `ISTIO_WASM_MAX_BINARY_SIZE_BYTES` as a hard limit on
//! every output (Istio's `io.LimitReader` truncates silently; a gzip bomb here is a clear
//! error after `max` bytes, #59395). Blocking: run on the blocking pool.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

pub const WASM_MAGIC: &[u8; 4] = b"\0asm";
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
/// gzip inside tar inside gzip… is allowed a few levels, not forever.
const MAX_LAYERS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the {what} is larger than ISTIO_WASM_MAX_BINARY_SIZE_BYTES ({max} bytes)")]
    TooLarge { what: &'static str, max: u64 },
    #[error("not a Wasm module (no \\0asm magic after unwrapping gzip/tar)")]
    NotWasm,
    #[error("Wasm module too short ({0} bytes, at least 8 needed)")]
    TooShort(u64),
    #[error("tar archive has no {0}")]
    NoTarMember(&'static str),
}

/// Which file of a tar archive is the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TarMember {
    /// The first regular file (HTTP archives, Docker-format images).
    First,
    /// A file whose base name is `plugin.wasm` (OCI "compat" images).
    PluginWasm,
}

/// A module on disk: its temp file (in the cache directory, ready to be persisted) and
/// hex sha256.
pub struct Module {
    pub file: NamedTempFile,
    pub sha256: String,
    pub len: u64,
}

/// Unwraps `input` into a module in `tmp_dir`; `input_sha256` is the input's hash when the
/// caller computed it while writing (used if the input is the module itself).
pub fn unpack(
    input: NamedTempFile,
    input_sha256: Option<String>,
    tmp_dir: &Path,
    max: u64,
    member: TarMember,
) -> Result<Module, UnpackError> {
    let mut cur = input;
    let mut known = input_sha256;
    for _ in 0..MAX_LAYERS {
        let mut head = [0u8; 512];
        let n = read_head(cur.as_file_mut(), &mut head)?;
        let head = &head[..n];
        if head.starts_with(WASM_MAGIC) {
            let (sha256, len) = match known.take() {
                Some(s) => (s, cur.as_file().metadata()?.len()),
                None => sha256_file(cur.path())?,
            };
            if len < 8 {
                return Err(UnpackError::TooShort(len));
            }
            return Ok(Module {
                file: cur,
                sha256,
                len,
            });
        }
        let next = NamedTempFile::new_in(tmp_dir)?;
        if head.starts_with(&GZIP_MAGIC) {
            let gz = flate2::read::MultiGzDecoder::new(BufReader::new(cur.reopen()?));
            copy_limited(gz, next.as_file(), max, "decompressed module")?;
        } else if head.len() >= 262 && &head[257..262] == b"ustar" {
            let mut ar = tar::Archive::new(BufReader::new(cur.reopen()?));
            let mut found = false;
            for entry in ar.entries()? {
                let entry = entry?;
                if !entry.header().entry_type().is_file() {
                    continue;
                }
                let wanted = match member {
                    TarMember::First => true,
                    TarMember::PluginWasm => entry
                        .path()
                        .ok()
                        .and_then(|p| p.file_name().map(|n| n == "plugin.wasm"))
                        .unwrap_or(false),
                };
                if wanted {
                    copy_limited(entry, next.as_file(), max, "tar entry")?;
                    found = true;
                    break;
                }
            }
            if !found {
                return Err(UnpackError::NoTarMember(match member {
                    TarMember::First => "regular file",
                    TarMember::PluginWasm => "plugin.wasm",
                }));
            }
        } else {
            return Err(UnpackError::NotWasm);
        }
        cur = next;
        known = None;
    }
    Err(UnpackError::NotWasm)
}

fn read_head(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    f.seek(SeekFrom::Start(0))?;
    let mut n = 0;
    while n < buf.len() {
        let r = f.read(&mut buf[n..])?;
        if r == 0 {
            break;
        }
        n += r;
    }
    f.seek(SeekFrom::Start(0))?;
    Ok(n)
}

fn copy_limited(
    r: impl Read,
    mut out: &File,
    max: u64,
    what: &'static str,
) -> Result<u64, UnpackError> {
    let mut limited = r.take(max + 1);
    let n = std::io::copy(&mut limited, &mut out)?;
    if n > max {
        return Err(UnpackError::TooLarge { what, max });
    }
    out.flush()?;
    Ok(n)
}

/// Hex sha256 and length of a file, streamed.
#[allow(
    clippy::disallowed_methods,
    reason = "runs on the blocking pool (unpack)"
)]
pub fn sha256_file(path: &Path) -> std::io::Result<(String, u64)> {
    let mut f = File::open(path)?;
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    let mut buf = vec![0u8; 128 * 1024];
    let mut len = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        len += n as u64;
        ctx.update(&buf[..n]);
    }
    Ok((hex(ctx.finish().as_ref()), len))
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, data).as_ref())
}

pub fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// Where temp files of a cache directory go (same file system, so persisting is a rename).
pub fn tmp_dir(cache_dir: &Path) -> PathBuf {
    cache_dir.join(".tmp")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &[u8] = b"\0asm\x01\0\0\0";

    fn temp(dir: &Path, data: &[u8]) -> NamedTempFile {
        let mut f = NamedTempFile::new_in(dir).unwrap();
        f.write_all(data).unwrap();
        f
    }

    fn gz(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn tar_of(name: &str, data: &[u8]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_ustar();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).unwrap();
        b.into_inner().unwrap()
    }

    #[test]
    fn plain_gzip_tar_and_tar_gz() {
        let d = tempfile::tempdir().unwrap();
        let want = sha256_hex(MODULE);
        for input in [
            MODULE.to_vec(),
            gz(MODULE),
            tar_of("x/filter.wasm", MODULE),
            gz(&tar_of("filter.wasm", MODULE)),
        ] {
            let m = unpack(
                temp(d.path(), &input),
                None,
                d.path(),
                1 << 20,
                TarMember::First,
            )
            .unwrap();
            assert_eq!((m.sha256.as_str(), m.len), (want.as_str(), 8));
        }
        let m = unpack(
            temp(d.path(), &gz(&tar_of("a/plugin.wasm", MODULE))),
            None,
            d.path(),
            1 << 20,
            TarMember::PluginWasm,
        )
        .unwrap();
        assert_eq!(m.sha256, want);
        let e = unpack(
            temp(d.path(), &tar_of("other.wasm", MODULE)),
            None,
            d.path(),
            1 << 20,
            TarMember::PluginWasm,
        )
        .err()
        .unwrap();
        assert!(matches!(e, UnpackError::NoTarMember(_)), "{e}");
    }

    #[test]
    fn bombs_short_and_garbage_fail_clearly() {
        let d = tempfile::tempdir().unwrap();
        let mut big = MODULE.to_vec();
        big.resize(4 << 20, 0);
        let e = unpack(
            temp(d.path(), &gz(&big)),
            None,
            d.path(),
            1 << 20,
            TarMember::First,
        )
        .err()
        .unwrap();
        assert!(matches!(e, UnpackError::TooLarge { .. }), "{e}");
        let e = unpack(
            temp(d.path(), b"\0asm"),
            None,
            d.path(),
            100,
            TarMember::First,
        )
        .err()
        .unwrap();
        assert!(matches!(e, UnpackError::TooShort(4)), "{e}");
        let e = unpack(
            temp(d.path(), b"<html>"),
            None,
            d.path(),
            100,
            TarMember::First,
        )
        .err()
        .unwrap();
        assert!(matches!(e, UnpackError::NotWasm), "{e}");
    }
}
