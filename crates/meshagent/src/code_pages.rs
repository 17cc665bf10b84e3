//! Drops this process's page-table entries for the read-only parts of its loaded ELF objects
//! (the agent's code and constants, libc's, the loader's) once start-up or a burst is over.
//!
//! Why: most of the code an agent ever runs runs once — config parsing, bootstrap rendering,
//! key generation, TLS handshakes, the first xDS exchange. Its pages stay mapped and count in
//! the process's RSS for the pod's lifetime (with the kernel's fault-around, in 64 KiB
//! windows): of a ready proxyless agent's 6.7 MiB, 2.8 MiB were the binary's code and 1.2 MiB
//! libc's, while the steady state (timers, keepalives, the status port) touches a fraction.
//! `madvise(MADV_DONTNEED)` on a private, never-written file mapping only removes the
//! mapping's page-table entries: the pages stay in the page cache (shared with every other
//! process that maps the file, reclaimable by the kernel once nobody maps them), and the next
//! access maps them back with a minor fault. Nothing is lost and nothing is read from disk
//! unless the kernel reclaimed the page meanwhile, as it may for any cold code.
//!
//! Which ranges: the `PT_LOAD` segments without `PF_W` of every object `dl_iterate_phdr(3)`
//! reports, i.e. what the dynamic loader mapped read-only. A writable segment (data, bss, the
//! RELRO part that was written by relocation and made read-only afterwards) is never touched:
//! `MADV_DONTNEED` on a private page that was written would discard the write. An object with
//! text relocations (`DT_TEXTREL`, its code was written by the loader) is skipped whole; the
//! vDSO is skipped (the kernel's own mapping). The loader's lock, held during
//! `dl_iterate_phdr`, keeps an object from being unloaded while its ranges are released.
//!
//! A read-only segment can still hold written pages: a debugger's breakpoint (`ptrace`
//! `POKETEXT`), a uprobe placed by an eBPF profiler (bpftrace, Parca), a hooking preload that
//! patched code, all write through `FOLL_FORCE` and leave a private anonymous copy of the page
//! in the file mapping. `MADV_DONTNEED` would discard that copy and silently undo the
//! breakpoint or hook. So every mapping whose `/proc/self/smaps` entry shows `Anonymous:`
//! above 0 is left whole; only mappings with no written page are released. A write that
//! lands between the `smaps` read and the `madvise` (microseconds) is the one window left.
//!
//! Off for the process when `MESHAGENT_RELEASE_CODE_PAGES=false` (for measuring, or kernels
//! where re-faulting is expensive). Other platforms: a no-op.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes covered by the last release (0 when off or unsupported), for logs and tests.
static LAST: AtomicUsize = AtomicUsize::new(0);

/// Whether the release is switched on (default yes).
pub fn enabled() -> bool {
    !matches!(
        std::env::var("MESHAGENT_RELEASE_CODE_PAGES").as_deref(),
        Ok("false" | "0")
    )
}

/// Releases the read-only segments' page-table entries; returns the bytes of address space
/// covered. A few hundred microseconds of system time (the kernel walks the page tables):
/// call it off the reactor thread, after a burst is over.
///
/// Never inlined: `make orderfile` has callgrind start a new part of its profile on entry
/// (`--dump-before`), which splits the profile into start-up's phases.
#[inline(never)]
pub fn release() -> usize {
    if !enabled() {
        return 0;
    }
    let n = imp::release();
    LAST.store(n, Ordering::Relaxed);
    n
}

/// What the last [`release`] covered.
pub fn last_released() -> usize {
    LAST.load(Ordering::Relaxed)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
mod imp {
    use std::ffi::{CStr, c_int, c_void};

    /// `DT_TEXTREL`, and `DF_TEXTREL` in `DT_FLAGS` (ELF gABI).
    const DT_NULL: i64 = 0;
    const DT_TEXTREL: i64 = 22;
    const DT_FLAGS: i64 = 30;
    const DF_TEXTREL: u64 = 0x4;

    /// `Elf64_Dyn`.
    #[repr(C)]
    struct Dyn {
        tag: i64,
        val: u64,
    }

    /// What one `dl_iterate_phdr` walk carries: the bytes released so far, and the
    /// mappings that hold written (anonymous) pages, which are never released.
    struct Walk {
        total: usize,
        written: Vec<(usize, usize)>,
    }

    pub(super) fn release() -> usize {
        // Without smaps we cannot tell a patched page from a clean one: release nothing.
        let Some(written) = super::written_mappings() else {
            return 0;
        };
        let mut walk = Walk { total: 0, written };
        // SAFETY: dl_iterate_phdr calls `each` synchronously, once per loaded object, with a
        // valid `dl_phdr_info` under the loader's lock, and passes our `walk` pointer through
        // untouched; `walk` outlives the call.
        unsafe {
            libc::dl_iterate_phdr(Some(each), (&raw mut walk).cast::<c_void>());
        }
        walk.total
    }

    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader hands a valid info for the duration of the callback; `data` is
        // the `Walk` that `release` passed.
        let (info, walk) = unsafe { (&*info, &mut *data.cast::<Walk>()) };
        if info.dlpi_phdr.is_null() {
            return 0;
        }
        if !info.dlpi_name.is_null() {
            // SAFETY: a NUL-terminated name owned by the loader.
            let name = unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes();
            if name.starts_with(b"linux-vdso") || name.starts_with(b"linux-gate") {
                return 0;
            }
        }
        // SAFETY: the loader's program header table of this object, dlpi_phnum entries.
        let phdrs =
            unsafe { std::slice::from_raw_parts(info.dlpi_phdr, usize::from(info.dlpi_phnum)) };
        if phdrs
            .iter()
            .filter(|p| p.p_type == libc::PT_DYNAMIC)
            // SAFETY: the object's mapped dynamic section, terminated by DT_NULL.
            .any(|p| unsafe { has_textrel((info.dlpi_addr + p.p_vaddr) as *const Dyn) })
        {
            return 0;
        }
        let page = page_size();
        for p in phdrs {
            if p.p_type != libc::PT_LOAD || p.p_flags & libc::PF_W != 0 || p.p_memsz == 0 {
                continue;
            }
            let start = (info.dlpi_addr + p.p_vaddr) as usize;
            // Read-only segments never share a page with a writable one: page permissions
            // are per page, so the loader maps each segment on its own pages.
            let from = start & !(page - 1);
            let to = (start + p.p_memsz as usize).div_ceil(page) * page;
            for (from, to) in super::clean_parts((from, to), &walk.written) {
                // SAFETY: [from, to) is part of a read-only private file mapping of a loaded
                // object (held by the loader's lock) with no written page (smaps); on it
                // MADV_DONTNEED only drops page-table entries, which the next access restores
                // from the page cache. An error (a locked mapping) leaves it as it was.
                if unsafe { libc::madvise(from as *mut c_void, to - from, libc::MADV_DONTNEED) }
                    == 0
                {
                    walk.total += to - from;
                }
            }
        }
        0
    }

    /// Whether the dynamic section at `d` marks text relocations.
    ///
    /// # Safety
    /// `d` must point at a mapped dynamic array terminated by `DT_NULL`.
    unsafe fn has_textrel(mut d: *const Dyn) -> bool {
        loop {
            // SAFETY: within the DT_NULL-terminated array (caller's contract).
            let e = unsafe { &*d };
            match e.tag {
                DT_NULL => return false,
                DT_TEXTREL => return true,
                DT_FLAGS if e.val & DF_TEXTREL != 0 => return true,
                _ => {}
            }
            // SAFETY: not yet at DT_NULL, so the next entry exists.
            d = unsafe { d.add(1) };
        }
    }

    fn page_size() -> usize {
        // SAFETY: sysconf takes an integer and reads no memory of ours.
        let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(n)
            .ok()
            .filter(|n| n.is_power_of_two())
            .unwrap_or(4096)
    }
}

/// The address ranges of this process's mappings that hold anonymous (written) pages, from
/// `/proc/self/smaps`; `None` when it cannot be read or parsed.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(
    clippy::disallowed_methods,
    reason = "procfs, read on the blocking pool with the malloc trim"
)]
fn written_mappings() -> Option<Vec<(usize, usize)>> {
    // Called off the reactor thread (see `release`); smaps of a small process is a few KiB.
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    parse_written(&text)
}

/// The ranges whose smaps entry has `Anonymous:` above 0. A mapping's header line is
/// `start-end perms offset dev inode [path]` (hex addresses); its fields follow as
/// `Name: value kB` lines.
fn parse_written(smaps: &str) -> Option<Vec<(usize, usize)>> {
    let mut out = Vec::new();
    let mut cur: Option<(usize, usize)> = None;
    for line in smaps.lines() {
        let Some(first) = line.split_ascii_whitespace().next() else {
            continue;
        };
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            cur = Some((a, b));
        } else if first == "Anonymous:" {
            let kib: u64 = line.split_ascii_whitespace().nth(1)?.parse().ok()?;
            if kib > 0 {
                out.push(cur?);
            }
        }
    }
    Some(out)
}

/// `range` less every range in `written`: the parts that may be released.
fn clean_parts(range: (usize, usize), written: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut parts = vec![range];
    for &(wa, wb) in written {
        parts = parts
            .into_iter()
            .flat_map(|(a, b)| {
                if wb <= a || wa >= b {
                    vec![(a, b)]
                } else {
                    [(a, wa.max(a)), (wb.min(b), b)]
                        .into_iter()
                        .filter(|(x, y)| x < y)
                        .collect()
                }
            })
            .collect();
    }
    parts
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub(super) fn release() -> usize {
        0
    }
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "test code, not on the agent's runtime"
)]
pub(crate) mod tests {
    use super::*;

    /// The tests that call [`release`] take this (also those of `malloc`): a release running
    /// in a parallel test reads smaps before another test's forced write and madvises after it
    /// (the window the module documents), which would undo that write.
    pub(crate) static RELEASES: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn rss_file_kib() -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("RssFile:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    }

    /// The release unmaps code pages (file-backed RSS drops), and the process keeps running
    /// correctly afterwards: code and constants fault back in, written data is untouched.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn release_drops_file_pages_and_keeps_the_process_working() {
        static WRITTEN: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());
        let _one = RELEASES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        WRITTEN.lock().unwrap().extend(0..1000);
        let before = rss_file_kib();
        let covered = release();
        let after = rss_file_kib();
        assert!(covered > 0, "nothing released");
        assert_eq!(last_released(), covered);
        assert!(
            after < before,
            "file-backed RSS {before} KiB -> {after} KiB"
        );
        // Written data survives; code (formatting, hashing) runs again.
        assert_eq!(WRITTEN.lock().unwrap().iter().sum::<u64>(), 499_500);
        let text = format!("{:?}", std::collections::HashMap::from([(1, "x")]));
        assert_eq!(text, r#"{1: "x"}"#);
    }

    /// A page of a read-only segment written the way a debugger sets a breakpoint or an eBPF
    /// profiler places a uprobe (a `FOLL_FORCE` write, here through `/proc/self/mem`, the
    /// same path as `ptrace(POKETEXT)`) keeps the write across a release: its mapping shows
    /// anonymous pages in smaps and is left alone.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn written_read_only_pages_keep_their_writes() {
        use std::os::unix::fs::FileExt;
        // In .rodata, a read-only PT_LOAD segment; a page of its own so nothing else on it
        // is read by other tests.
        #[repr(C, align(4096))]
        struct Page([u8; 4096]);
        static MARKER: Page = Page([0x11; 4096]);
        let _one = RELEASES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let addr = std::hint::black_box(&raw const MARKER) as usize;
        let mem = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/self/mem")
            .unwrap();
        mem.write_all_at(&[0xCC], addr as u64 + 100).unwrap();
        // Read back through the same file: what the page holds now, never a value the
        // compiler folded from the static's initialiser.
        let read = || {
            let mut b = [0u8];
            mem.read_exact_at(&mut b, addr as u64 + 100).unwrap();
            b[0]
        };
        assert_eq!(read(), 0xCC, "the forced write did not land");
        let written = written_mappings().unwrap();
        assert!(
            written.iter().any(|&(a, b)| (a..b).contains(&addr)),
            "smaps shows no anonymous page in the marker's mapping"
        );
        assert!(release() > 0, "nothing released");
        assert_eq!(read(), 0xCC, "the release undid a written read-only page");
    }

    #[test]
    fn smaps_entries_with_anonymous_pages_are_found() {
        let smaps = "\
55d0a0000000-55d0a0010000 r--p 00000000 fd:01 123   /usr/bin/x
Size:                 64 kB
Anonymous:             0 kB
55d0a0010000-55d0a0020000 r-xp 00010000 fd:01 123   /usr/bin/x
Size:                 64 kB
Anonymous:             4 kB
VmFlags: rd ex mr mw me
7ffd00000000-7ffd00001000 r-xp 00000000 00:00 0     [vdso]
Anonymous:             0 kB
";
        assert_eq!(
            parse_written(smaps),
            Some(vec![(0x55d0_a001_0000, 0x55d0_a002_0000)])
        );
        assert_eq!(parse_written("garbage-line\nAnonymous: 4 kB\n"), None);
    }

    #[test]
    fn clean_parts_leave_out_written_ranges() {
        assert_eq!(clean_parts((0, 100), &[]), vec![(0, 100)]);
        assert_eq!(clean_parts((0, 100), &[(20, 30)]), vec![(0, 20), (30, 100)]);
        assert_eq!(clean_parts((0, 100), &[(0, 100)]), vec![]);
        assert_eq!(
            clean_parts((10, 100), &[(0, 20), (90, 200), (50, 60)]),
            vec![(20, 50), (60, 90)]
        );
        assert_eq!(clean_parts((10, 20), &[(20, 30)]), vec![(10, 20)]);
    }
}
