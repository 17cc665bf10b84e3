//! glibc malloc tuned for a small, long-lived sidecar process: memory freed after a burst (a
//! 10,000-cluster xDS push passed through, an NDS table decoded and built) goes back to the OS
//! instead of staying resident next to every pod for the pod's lifetime.
//!
//! * [`configure`] at startup: one malloc arena for the whole process (`M_ARENA_MAX=1`):
//!   glibc otherwise gives each thread that allocates its own arena (up to 8 per core), and the
//!   blocking pool's short-lived threads (file reads, key generation, DNS table builds) each
//!   left one with freed chunks resident (1.3 MiB after one table build). And a fixed mmap
//!   threshold (`M_MMAP_THRESHOLD=128 KiB`, glibc's initial value): glibc raises the threshold
//!   each time an mmapped chunk is freed (up to 32 MiB), after which multi-megabyte xDS
//!   messages come from the heap and their pages stay behind when freed; fixed, they are
//!   mmapped and unmapped on free. Fixing the threshold also fixes the trim threshold at its
//!   128 KiB default. Either is skipped when the operator set it (`MALLOC_ARENA_MAX`,
//!   `MALLOC_MMAP_THRESHOLD_`, glibc's tunables): their value wins.
//! * [`trim`] (`malloc_trim(0)`): returns free pages — also those inside the heap, which the
//!   top-of-heap trim cannot reach — after transient work; [`trim_soon`] asks the
//!   [`trimmer`] task to do so once a burst is over (a quiet second), on the blocking pool
//!   (after large xDS responses, and after every xDS stream ends: churn of small streams left
//!   their freed buffers resident too, several MiB after 5,000),
//!   together with [`crate::code_pages::release`] (the code that ran during the burst, or
//!   during start-up: the agent asks for a trim when it first becomes ready).
//! * [`release_all`] the same at once, between start-up's phases: when Envoy has been spawned
//!   the agent's own start is over, and the code it ran (configuration, bootstrap, the
//!   servers' set-up) leaves before the first certificate and xDS exchange bring theirs and the
//!   heap's high-water mark: the resident peak (`VmHWM`) is the most resident at any moment.
//!   `make orderfile` lays out the code by these phases, so each faults in its own stretch.
//!
//! * With the trim, the main thread's stack pages below where it runs at that moment
//!   ([`release_idle_stack`]): start-up's deep calls (the bootstrap, the first certificate,
//!   large futures polled on the runtime thread) left ~240 KiB of it resident for the process's
//!   life, an eighth of the settled agent's anonymous memory.
//!
//! Other allocators (musl) have none of this: every function is a no-op there.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// A burst is over when nothing asked for a trim for this long.
const QUIET: Duration = Duration::from_secs(1);
/// `M_MMAP_THRESHOLD`: glibc's initial (and minimum dynamic) value.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 128 * 1024;

static WANTED: Notify = Notify::const_new();
static PENDING: AtomicBool = AtomicBool::new(false);

/// Process-wide malloc settings; call once at startup, before other threads exist.
pub fn configure() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |var: &str| std::env::var_os(var).is_some();
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        if !set("MALLOC_ARENA_MAX") && !tunables.contains("glibc.malloc.arena_max") {
            mallopt(libc::M_ARENA_MAX, 1);
        }
        if !set("MALLOC_MMAP_THRESHOLD_") && !tunables.contains("glibc.malloc.mmap_threshold") {
            mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn mallopt(param: libc::c_int, value: libc::c_int) {
    // SAFETY: mallopt(3) takes two integers and only changes allocator parameters under the
    // allocator's own lock; no pointer crosses the call. It returns 0 for a value it rejects,
    // which leaves glibc's default in place: nothing to handle.
    let ok = unsafe { libc::mallopt(param, value) };
    if ok == 0 {
        tracing::debug!(param, value, "mallopt rejected a setting");
    }
}

/// Returns the allocator's free pages to the OS now. Blocks for a few milliseconds at most
/// (it walks the free lists): call it off the reactor thread.
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    malloc_trim();
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn malloc_trim() {
    // SAFETY: malloc_trim(3) takes a size and works under the allocator's locks on memory the
    // allocator owns; no pointer crosses the call.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Asks the [`trimmer`] to trim once the current burst is over. Cheap: call it after every
/// large transient allocation.
pub fn trim_soon() {
    if !PENDING.swap(true, Ordering::Relaxed) {
        WANTED.notify_one();
    }
}

/// Trims a quiet second after the last [`trim_soon`], until `stop`.
pub async fn trimmer(stop: CancellationToken) {
    let _ = stop
        .run_until_cancelled(async {
            loop {
                WANTED.notified().await;
                // Coalesce: wait until a whole quiet period passes without a new request.
                loop {
                    PENDING.store(false, Ordering::Relaxed);
                    tokio::time::sleep(QUIET).await;
                    if !PENDING.load(Ordering::Relaxed) {
                        break;
                    }
                }
                release_all().await;
            }
        })
        .await;
}

/// What one [`release_all`] gave back: bytes of the main thread's stack range and of code
/// (read-only segments) released; the heap trim returns no figure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    pub stack: usize,
    pub code: usize,
}

/// The idle main-thread stack (on the caller's thread: only it knows how deep its stack is
/// now), then the heap trim and the code pages on the blocking pool. What the [`trimmer`]
/// does once a burst is over, and what start-up does between its phases: the resident peak
/// (`VmHWM`, what a memory limit sees) is the most memory resident at any one moment, so the
/// code only start-up's first phase ran (configuration, bootstrap rendering, the servers'
/// set-up, Envoy's spawn) should leave before the next phase (the first certificate, the
/// first xDS exchange, whose buffers are the heap's high-water mark) brings its own.
pub async fn release_all() -> Released {
    let stack = release_idle_stack();
    let code = tokio::task::spawn_blocking(|| {
        trim();
        crate::code_pages::release()
    })
    .await
    .unwrap_or(0);
    tracing::debug!(
        stack,
        code,
        "heap trimmed; idle stack and code pages released"
    );
    Released { stack, code }
}

/// Below the stack pointer of a running thread nothing lives (x86_64's red zone is 128 bytes;
/// a signal handler builds its frame below the stack pointer at delivery, after this call or
/// before it, never during a system call): pages there are only what earlier, deeper calls
/// left behind. Kept: this much below the caller's frame, for the calls this function makes
/// after it has chosen the range (only `madvise` itself: the maps file is read before). A
/// 64 KiB margin kept ~48 KiB more of the settled agent resident for nothing.
const STACK_MARGIN: usize = 16 * 1024;

/// Drops the resident pages of the main thread's stack (`[stack]` in `/proc/self/maps`) that
/// lie more than [`STACK_MARGIN`] below the caller's frame. `MADV_DONTNEED` on private
/// anonymous memory: a later deeper call finds zeroed pages, as on a fresh stack. Does nothing
/// when called on another thread (a multi-threaded runtime's worker). Returns the bytes of
/// address range released (resident or not).
///
/// A doctest runs on its binary's main thread, so it shows the pages going:
/// ```
/// fn stack_rss_kib() -> u64 {
///     let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
///     let at = smaps.find("[stack]").unwrap();
///     smaps[at..].lines().find_map(|l| l.strip_prefix("Rss:")).unwrap()
///         .trim().trim_end_matches(" kB").trim().parse().unwrap()
/// }
/// #[inline(never)]
/// fn deep(n: u32) -> u8 {
///     let buf = std::hint::black_box([n as u8; 4096]);
///     if n == 0 { buf[7] } else { deep(n - 1).wrapping_add(buf[9]) }
/// }
/// std::hint::black_box(deep(256)); // ~1 MiB of stack touched, then returned from
/// let before = stack_rss_kib();
/// assert!(before >= 1024, "{before} KiB");
/// assert!(meshagent::malloc::release_idle_stack() > 0);
/// let after = stack_rss_kib();
/// assert!(after + 512 < before, "{before} KiB -> {after} KiB");
/// // On any other thread: nothing.
/// assert_eq!(std::thread::spawn(meshagent::malloc::release_idle_stack).join().unwrap(), 0);
/// ```
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
#[allow(
    clippy::disallowed_methods,
    reason = "procfs: /proc/self/maps is generated by the kernel on read, no disk behind it"
)]
pub fn release_idle_stack() -> usize {
    let marker = 0u8;
    let here = std::ptr::addr_of!(marker) as usize;
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return 0;
    };
    let Some((low, high)) = maps
        .lines()
        .filter(|l| l.ends_with("[stack]"))
        .filter_map(|l| {
            let (range, _) = l.split_once(' ')?;
            let (a, b) = range.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .next()
    else {
        return 0;
    };
    if !(low..high).contains(&here) {
        return 0;
    }
    // SAFETY: sysconf(3) takes an integer constant and returns an integer.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    let top = here.saturating_sub(STACK_MARGIN) & !(page - 1);
    if top <= low {
        return 0;
    }
    // SAFETY: [low, top) is part of this thread's own stack mapping (checked against the
    // kernel's map above) and lies wholly below the current frame by STACK_MARGIN, so no live
    // frame, local or argument is in it; MADV_DONTNEED on private anonymous memory only makes
    // later reads of it zero. No pointer into that range exists in the program.
    let rc = unsafe { libc::madvise(low as *mut libc::c_void, top - low, libc::MADV_DONTNEED) };
    if rc == 0 { top - low } else { 0 }
}

#[cfg(not(target_os = "linux"))]
pub fn release_idle_stack() -> usize {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What start-up calls between its phases and the trimmer after a burst: the code pages
    /// are released (on the blocking pool), the figures say so, and the process carries on
    /// (code faults back in). A libtest thread is not the main thread: its stack is left
    /// alone. (That the release empties file-backed RSS is `code_pages`' own test: here the
    /// blocking pool's thread and parallel tests fault code back in before it can be read.)
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn release_all_gives_back_code_pages() {
        let _one = crate::code_pages::tests::RELEASES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let released = rt.block_on(release_all());
        assert!(released.code > 0, "{released:?}");
        assert_eq!(released.stack, 0, "not the main thread: {released:?}");
        assert_eq!(crate::code_pages::last_released(), released.code);
        assert_eq!(format!("{:?}", Some(1)), "Some(1)");
    }
}
