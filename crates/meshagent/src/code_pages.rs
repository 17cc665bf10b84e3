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

    pub(super) fn release() -> usize {
        let mut total: usize = 0;
        // SAFETY: dl_iterate_phdr calls `each` synchronously, once per loaded object, with a
        // valid `dl_phdr_info` under the loader's lock, and passes our `total` pointer through
        // untouched; `total` outlives the call.
        unsafe {
            libc::dl_iterate_phdr(Some(each), (&raw mut total).cast::<c_void>());
        }
        total
    }

    unsafe extern "C" fn each(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: the loader hands a valid info for the duration of the callback; `data` is
        // the `usize` that `release` passed.
        let (info, total) = unsafe { (&*info, &mut *data.cast::<usize>()) };
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
            // SAFETY: [from, to) is a read-only private file mapping of a loaded object (held
            // by the loader's lock); MADV_DONTNEED on it only drops page-table entries, which
            // the next access restores from the page cache. An error (a locked mapping)
            // leaves the mapping as it was.
            if unsafe { libc::madvise(from as *mut c_void, to - from, libc::MADV_DONTNEED) } == 0 {
                *total += to - from;
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

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub(super) fn release() -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
