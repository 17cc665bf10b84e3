//! The CPU sampler behind `/debug/pprof/profile`: `ITIMER_PROF` delivers `SIGPROF` 100 times a
//! second of the process's CPU time, and the handler records the interrupted thread's stack
//! (return addresses, unwound through `.eh_frame` by libgcc's `_Unwind_Backtrace`, which Rust's
//! standard library already links) into a buffer allocated for that one profile. The profile
//! is then written as Go's `runtime/pprof` writes it: profile.proto with the executable
//! mappings from `/proc/self/maps`, addresses only (the shipped binary is stripped; `go tool
//! pprof` symbolises from the binary file the mapping names, or one given to it).
//!
//! Before the first profile and after each one nothing is installed or kept: no handler (the
//! signal is ignored after a profile, so one still in flight cannot end the process), no timer,
//! no buffer. While one runs the buffer holds at most [`MAX_SAMPLES`] stacks of [`DEPTH`]
//! frames (34 MiB of address space at most, resident only as samples arrive); later samples are
//! counted as dropped. pprof-rs was measured first: it keeps a ~95 MiB sample table for the
//! life of the process once used (docs/benchmarks-log.md).

#![allow(
    unsafe_code,
    reason = "a SIGPROF handler: sigaction, setitimer, libgcc's unwinder, writes into the sample buffer"
)]

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Frames kept per sample (the leaf first).
pub const DEPTH: usize = 64;
/// Words per sample: frame count, interrupted pc, frames.
const WORDS: usize = DEPTH + 2;
/// Samples one profile can hold: 300 s of two busy threads at 100 Hz, and a little more.
pub const MAX_SAMPLES: usize = 64 * 1024;
/// Sampling rate: Go's `runtime/pprof` rate.
pub const HZ: usize = 100;
const PERIOD_NS: i64 = 1_000_000_000 / HZ as i64;

/// The running profile's buffer (`slots * WORDS` words), null when none runs.
static BUF: AtomicPtr<usize> = AtomicPtr::new(std::ptr::null_mut());
static SLOTS: AtomicUsize = AtomicUsize::new(0);
static NEXT: AtomicUsize = AtomicUsize::new(0);
/// Handlers running now: the buffer is freed only once none is.
static IN_HANDLER: AtomicUsize = AtomicUsize::new(0);

#[allow(non_camel_case_types)]
type _Unwind_Trace_Fn = extern "C" fn(*mut c_void, *mut c_void) -> c_int;

unsafe extern "C" {
    // libgcc's unwinder (`unwind.h`), linked by Rust's standard library on linux-gnu.
    fn _Unwind_Backtrace(trace: _Unwind_Trace_Fn, arg: *mut c_void) -> c_int;
    fn _Unwind_GetIP(ctx: *mut c_void) -> usize;
}

const URC_NO_REASON: c_int = 0;
const URC_END_OF_STACK: c_int = 5;

struct Walk {
    slot: *mut usize,
    n: usize,
}

extern "C" fn frame(ctx: *mut c_void, arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Walk` `on_sigprof` passed, alive for the whole backtrace; `ctx`
    // is the unwinder's context for this frame.
    let w = unsafe { &mut *arg.cast::<Walk>() };
    let ip = unsafe { _Unwind_GetIP(ctx) };
    if ip == 0 || w.n >= DEPTH {
        return URC_END_OF_STACK;
    }
    // SAFETY: the slot has WORDS words and 2 + n < WORDS.
    unsafe { w.slot.add(2 + w.n).write_volatile(ip) };
    w.n += 1;
    URC_NO_REASON
}

/// The interrupted instruction's address, from the signal's context.
fn interrupted_pc(uctx: *mut c_void) -> usize {
    if uctx.is_null() {
        return 0;
    }
    // SAFETY: the kernel passes a `ucontext_t` as the third argument of an SA_SIGINFO handler.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        (*uctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs[libc::REG_RIP as usize] as usize
    }
    #[cfg(target_arch = "aarch64")]
    unsafe {
        (*uctx.cast::<libc::ucontext_t>()).uc_mcontext.pc as usize
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    0
}

extern "C" fn on_sigprof(_sig: c_int, _info: *mut libc::siginfo_t, uctx: *mut c_void) {
    // Async-signal-safe only: atomics, writes into the preallocated buffer, the unwinder.
    // SAFETY: errno is thread-local; restored so the interrupted code sees its own.
    let errno = unsafe { *libc::__errno_location() };
    IN_HANDLER.fetch_add(1, SeqCst);
    let buf = BUF.load(SeqCst);
    if !buf.is_null() {
        let i = NEXT.fetch_add(1, SeqCst);
        if i < SLOTS.load(SeqCst) {
            // SAFETY: slot i (reserved by the fetch_add above, for this handler alone) lies
            // within the buffer, which is not freed while IN_HANDLER is non-zero.
            let slot = unsafe { buf.add(i * WORDS) };
            unsafe { slot.add(1).write_volatile(interrupted_pc(uctx)) };
            let mut w = Walk { slot, n: 0 };
            unsafe { _Unwind_Backtrace(frame, (&raw mut w).cast()) };
            unsafe { slot.write_volatile(w.n) };
        }
    }
    IN_HANDLER.fetch_sub(1, SeqCst);
    unsafe { *libc::__errno_location() = errno };
}

#[derive(Debug, thiserror::Error)]
pub enum SamplerError {
    #[error("cannot install the SIGPROF handler: {0}")]
    Signal(std::io::Error),
    #[error("cannot arm ITIMER_PROF: {0}")]
    Timer(std::io::Error),
    #[error("cannot read /proc/self/maps: {0}")]
    Maps(String),
}

/// One profile in progress; [`Running::stop`] ends it (dropping it ends it too).
pub struct Running {
    buf: Option<Box<[usize]>>,
    started: SystemTime,
}

/// Raw samples: per sample, the interrupted pc and the return addresses, leaf first.
pub struct Samples {
    pub stacks: Vec<Vec<usize>>,
    pub dropped: usize,
    pub started: SystemTime,
    pub duration: Duration,
}

fn set_timer(period: Duration) -> std::io::Result<()> {
    let tv = libc::timeval {
        tv_sec: period.as_secs() as libc::time_t,
        tv_usec: period.subsec_micros() as libc::suseconds_t,
    };
    let it = libc::itimerval {
        it_interval: tv,
        it_value: tv,
    };
    // SAFETY: a valid itimerval; the old value is not asked for.
    if unsafe { libc::setitimer(libc::ITIMER_PROF, &it, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn set_handler(handler: libc::sighandler_t, flags: c_int) -> std::io::Result<()> {
    // SAFETY: a zeroed sigaction with an empty mask and a handler of the SA_SIGINFO shape
    // (or SIG_IGN) is valid.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler;
        sa.sa_flags = flags;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGPROF, &sa, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Starts sampling with room for `samples` stacks (at most [`MAX_SAMPLES`]). The caller
/// makes sure only one runs at a time (the status server's profiler slot).
pub fn start(samples: usize) -> Result<Running, SamplerError> {
    let slots = samples.clamp(1, MAX_SAMPLES);
    // Zeroed allocation: pages are not resident until a sample is written into them.
    let mut buf = vec![0usize; slots * WORDS].into_boxed_slice();
    NEXT.store(0, SeqCst);
    SLOTS.store(slots, SeqCst);
    BUF.store(buf.as_mut_ptr(), SeqCst);
    let running = Running {
        buf: Some(buf),
        started: SystemTime::now(),
    };
    let handler: extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void) = on_sigprof;
    set_handler(
        handler as libc::sighandler_t,
        libc::SA_SIGINFO | libc::SA_RESTART,
    )
    .map_err(SamplerError::Signal)?;
    set_timer(Duration::from_nanos(PERIOD_NS as u64)).map_err(SamplerError::Timer)?;
    Ok(running)
}

impl Running {
    /// Stops the timer, ignores the signal again, waits for handlers still running, and
    /// returns the samples (the buffer is freed).
    pub fn stop(mut self) -> Samples {
        self.halt();
        let buf = self.buf.take().unwrap_or_default();
        let n = NEXT.load(SeqCst);
        let slots = buf.len() / WORDS;
        let mut stacks = Vec::with_capacity(n.min(slots));
        for slot in buf.chunks_exact(WORDS).take(n.min(slots)) {
            let frames = slot[0].min(DEPTH);
            let pc = slot[1];
            let walked = &slot[2..2 + frames];
            // The unwinder starts in the handler: keep from the interrupted frame on.
            let from = walked.iter().position(|&ip| ip == pc).unwrap_or(0);
            if walked.len() > from {
                stacks.push(walked[from..].to_vec());
            } else if pc != 0 {
                stacks.push(vec![pc]);
            }
        }
        Samples {
            stacks,
            dropped: n.saturating_sub(slots),
            started: self.started,
            duration: self.started.elapsed().unwrap_or_default(),
        }
    }

    fn halt(&mut self) {
        if self.buf.is_none() {
            return;
        }
        let _ = set_timer(Duration::ZERO);
        // Ignored, not default: a SIGPROF already pending must not end the process.
        let _ = set_handler(libc::SIG_IGN, 0);
        BUF.store(std::ptr::null_mut(), SeqCst);
        // A handler that loaded the buffer before the store above finishes within
        // microseconds; the buffer is freed only after.
        while IN_HANDLER.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.halt();
    }
}

/// An executable mapping of `/proc/self/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub limit: u64,
    pub offset: u64,
    pub file: String,
}

/// The executable mappings of a `/proc/<pid>/maps` text, the main binary (`exe`) first.
pub fn executable_mappings(maps: &str, exe: &str) -> Vec<Mapping> {
    let mut out: Vec<Mapping> = maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms, offset) = (f.next()?, f.next()?, f.next()?);
            let file = f.nth(2).unwrap_or("").to_owned();
            if !perms.contains('x') {
                return None;
            }
            let (s, e) = range.split_once('-')?;
            Some(Mapping {
                start: u64::from_str_radix(s, 16).ok()?,
                limit: u64::from_str_radix(e, 16).ok()?,
                offset: u64::from_str_radix(offset, 16).ok()?,
                file,
            })
        })
        .collect();
    out.sort_by_key(|m| (m.file != exe, m.start));
    out
}

/// profile.proto (`github.com/google/pprof/proto/profile.proto`), the fields written here.
mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub memory_start: u64,
        #[prost(uint64, tag = "3")]
        pub memory_limit: u64,
        #[prost(uint64, tag = "4")]
        pub file_offset: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
    }
}

/// The samples as an uncompressed profile.proto: sample types `samples/count` and
/// `cpu/nanoseconds` (Go's CPU profile), one location per address (a return address less one,
/// so it falls in the call), mappings as given.
pub fn encode(s: &Samples, mappings: &[Mapping]) -> Vec<u8> {
    use prost::Message;
    let mut strings: Vec<String> = vec![String::new()];
    let mut intern = |v: &str| -> i64 {
        if let Some(i) = strings.iter().position(|s| s == v) {
            return i as i64;
        }
        strings.push(v.to_owned());
        (strings.len() - 1) as i64
    };
    let vt = |t: i64, u: i64| proto::ValueType { r#type: t, unit: u };
    let (samples, count, cpu, ns) = (
        intern("samples"),
        intern("count"),
        intern("cpu"),
        intern("nanoseconds"),
    );
    let mapping: Vec<proto::Mapping> = mappings
        .iter()
        .enumerate()
        .map(|(i, m)| proto::Mapping {
            id: i as u64 + 1,
            memory_start: m.start,
            memory_limit: m.limit,
            file_offset: m.offset,
            filename: intern(&m.file),
        })
        .collect();
    let comment = if s.dropped > 0 {
        vec![intern(&format!(
            "{} samples dropped: more than {MAX_SAMPLES}",
            s.dropped
        ))]
    } else {
        vec![]
    };
    let mut locations: HashMap<u64, u64> = HashMap::new();
    let mut location = vec![];
    let mut stacks: HashMap<Vec<u64>, i64> = HashMap::new();
    for stack in &s.stacks {
        let ids = stack
            .iter()
            .enumerate()
            .map(|(depth, &ip)| {
                let addr = if depth == 0 { ip } else { ip.saturating_sub(1) } as u64;
                *locations.entry(addr).or_insert_with(|| {
                    let id = location.len() as u64 + 1;
                    let mapping_id = mappings
                        .iter()
                        .position(|m| (m.start..m.limit).contains(&addr))
                        .map_or(0, |i| i as u64 + 1);
                    location.push(proto::Location {
                        id,
                        mapping_id,
                        address: addr,
                    });
                    id
                })
            })
            .collect();
        *stacks.entry(ids).or_default() += 1;
    }
    let sample = stacks
        .into_iter()
        .map(|(location_id, n)| proto::Sample {
            location_id,
            value: vec![n, n * PERIOD_NS],
        })
        .collect();
    proto::Profile {
        sample_type: vec![vt(samples, count), vt(cpu, ns)],
        sample,
        mapping,
        location,
        string_table: strings,
        time_nanos: s
            .started
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i64),
        duration_nanos: s.duration.as_nanos() as i64,
        period_type: Some(vt(cpu, ns)),
        period: PERIOD_NS,
        comment,
    }
    .encode_to_vec()
}

/// `/proc/self/maps` and the executable's path, read (bounded) for [`executable_mappings`].
pub fn own_mappings() -> Result<Vec<Mapping>, SamplerError> {
    let maps = crate::fsio::read_bounded(std::path::Path::new("/proc/self/maps"), 4 << 20)
        .map_err(|e| SamplerError::Maps(e.to_string()))?;
    let exe = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    Ok(executable_mappings(&String::from_utf8_lossy(&maps), &exe))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_are_executable_ones_main_binary_first() {
        let maps = "\
5600-5700 r--p 00000000 fd:01 11 /usr/bin/meshagent
5700-5900 r-xp 00100000 fd:01 11 /usr/bin/meshagent
7f00-7f10 r-xp 00028000 fd:01 22 /usr/lib/x86_64-linux-gnu/libc.so.6
1000-2000 r-xp 00000000 00:00 0 [vdso]
7f20-7f30 rw-p 00000000 00:00 0
";
        let m = executable_mappings(maps, "/usr/bin/meshagent");
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].file, "/usr/bin/meshagent");
        assert_eq!(
            (m[0].start, m[0].limit, m[0].offset),
            (0x5700, 0x5900, 0x100000)
        );
        assert_eq!(m[1].file, "[vdso]");
    }

    #[test]
    fn samples_aggregate_into_a_profile() {
        use prost::Message;
        let s = Samples {
            stacks: vec![vec![0x5710, 0x5720], vec![0x5710, 0x5720], vec![0x7f05]],
            dropped: 2,
            started: SystemTime::now(),
            duration: Duration::from_secs(1),
        };
        let maps = executable_mappings(
            "5700-5900 r-xp 00000000 fd:01 11 /a\n7f00-7f10 r-xp 0 fd:01 2 /b\n",
            "/a",
        );
        let p = proto::Profile::decode(&encode(&s, &maps)[..]).unwrap();
        assert_eq!(p.string_table[0], "");
        assert_eq!(p.sample.len(), 2);
        let total: i64 = p.sample.iter().map(|s| s.value[0]).sum();
        assert_eq!(total, 3);
        assert_eq!(p.location.len(), 3);
        // The caller's return address less one; each location in its mapping.
        assert!(
            p.location
                .iter()
                .any(|l| l.address == 0x571f && l.mapping_id == 1)
        );
        assert!(
            p.location
                .iter()
                .any(|l| l.address == 0x7f05 && l.mapping_id == 2)
        );
        assert_eq!(p.comment.len(), 1);
    }
}
