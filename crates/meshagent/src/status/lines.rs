//! Line-level filter for the merged Prometheus output (Istio `status/server.go` `handleStats`, whose output Prometheus rejects on duplicate families).
//!
//! Istio concatenates the agent's, Envoy's and the application's exposition bodies. When two of
//! them export the same family, or Envoy emits the same series twice (#52221, #54986), the
//! whole scrape is rejected. This filter sees every line once, in output order, and drops:
//! * a family block (`# HELP`/`# TYPE`/`# UNIT` + samples) whose name an earlier block already
//!   used — the first source wins, so one bad source cannot break the others. A block repeated
//!   inside one source counts too: a second `# HELP`, `# TYPE` or `# UNIT` line for the family
//!   being written, or one after its samples, starts a new block of the same name, dropped
//!   whole (Prometheus rejects "second TYPE line for metric name");
//! * a series (`name{labels}`) already written in the current family block;
//! * `# EOF` (re-added once at the end for OpenMetrics), blank lines and free comments.
//!
//! A line that is not valid UTF-8, has control characters, or names a metric with characters
//! the text format does not allow fails its source ([`SourceFilter::failure`]): nothing more
//! of it is read and the caller cuts it at the last family boundary with
//! [`SourceFilter::abort`], so what goes out always parses.
//!
//! Memory stays bounded: family names and series keys are kept as 64-bit hashes only; series
//! hashes are reset at every family block (duplicates within one source are adjacent, because
//! every exporter groups a family's samples), and the family set has a hard cap after which
//! new families are passed through unchecked. The family set grows by adding tables, never by
//! rehashing into a doubled one (which would hold the old and the new table at once: 220 KiB
//! for 10,000 families instead of ~100). Output is held back per family block (up to
//! [`HOLD_BACK`]) so an aborted source (cap, timeout, reset) is cut at a family boundary.
//!
//! Speed: a sample of the family being written (the common line: Envoy and client libraries
//! write a family's samples after its `# TYPE`) is recognised by its name, the end of its label
//! set and then its newline found sixteen bytes at a time with SSE2 on x86-64, eight (SWAR)
//! elsewhere ([`labels_end`], [`value_end`]: these scans also leave the line to the general
//! path at a control character, CR or non-ASCII byte), its series key hashed, and the line
//! kept **without copying it**: kept lines are
//! handed on as slices of the chunk they came in (`Bytes::slice`), consecutive ones as one
//! slice. Every other line (`# HELP`/`# TYPE`, a new family, escaped label values, CRLF,
//! UTF-8, control characters) takes the general path, [`SourceFilter::line`], which decides
//! exactly as the fast one would; only lines it rewrites (a CR dropped) or that were split
//! across chunks are copied.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};

use bytes::{Bytes, BytesMut};
use memchr::{memchr, memrchr};

/// Longest line accepted; longer lines are dropped (bounded memory for a misbehaving peer).
pub const MAX_LINE: usize = 256 * 1024;
/// Output is flushed in chunks of about this size.
pub const FLUSH_AT: usize = 32 * 1024;
/// A family block larger than this is flushed even though it is not complete yet.
pub const HOLD_BACK: usize = 64 * 1024;
/// At most this many family names are remembered (8 bytes each + table overhead).
pub const MAX_FAMILIES: usize = 256 * 1024;

/// The hashes are already uniformly distributed; hashing them again is wasted work.
#[derive(Default)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type HashSet64 = HashSet<u64, BuildHasherDefault<U64Hasher>>;

/// A 64-bit hash of a byte string: 16 bytes per step through a folded 64×64→128-bit multiply
/// (the wyhash/foldhash construction). Stable within the process, which is all the dedupe
/// needs; SipHash, used before, took a quarter of the merge's CPU for 100-byte series keys in
/// the size-optimised release build.
pub(crate) fn hash(bytes: &[u8]) -> u64 {
    const K0: u64 = 0xa076_1d64_78bd_642f;
    const K1: u64 = 0xe703_7ed1_a0b4_28db;
    const K2: u64 = 0x8ebc_6af0_9c88_c6e3;
    #[inline(always)]
    fn fold(a: u64, b: u64) -> u64 {
        let p = u128::from(a) * u128::from(b);
        (p as u64) ^ ((p >> 64) as u64)
    }
    // Whole words by index, not by sub-slice: the size-optimised build calls out for every
    // range index and `copy_from_slice`.
    let (words, rest) = bytes.as_chunks::<8>();
    let mut h = K0 ^ (bytes.len() as u64);
    let mut i = 0;
    while i + 1 < words.len() {
        h = fold(
            u64::from_le_bytes(words[i]) ^ K1,
            u64::from_le_bytes(words[i + 1]) ^ h,
        );
        i += 2;
    }
    // The last 0–7 bytes: the slice's last word shifted down past the bytes already taken
    // (a byte copy into a zeroed word stalls the load that follows it).
    let tail = match bytes.last_chunk::<8>() {
        _ if rest.is_empty() => 0,
        Some(last) => u64::from_le_bytes(*last) >> (8 * (8 - rest.len())),
        None => rest.iter().rev().fold(0, |t, b| (t << 8) | u64::from(*b)),
    };
    if i < words.len() {
        h = fold(u64::from_le_bytes(words[i]) ^ K1, tail ^ h);
    } else if !rest.is_empty() {
        h = fold(tail ^ K1, h);
    }
    fold(h ^ K2, K1)
}

/// The scans eight bytes at a time (SWAR): what runs where SSE2 is not part of the target, and
/// what the tests hold the SSE2 scans to.
#[cfg_attr(
    all(target_arch = "x86_64", target_feature = "sse2", not(test)),
    allow(dead_code, reason = "only the tests use these where SSE2 is there")
)]
mod swar {
    use super::{labels_tail, value_tail};

    pub(super) const LO: u64 = 0x0101_0101_0101_0101;
    pub(super) const HI: u64 = LO * 0x80;
    pub(super) const LOW7: u64 = LO * 0x7f;

    /// The high bit of every byte of `x` that keeps a line off the fast path: control characters
    /// (tab, newline and CR included), DEL, and every byte of a multi-byte UTF-8 sequence (the
    /// general path validates those). Exact.
    #[inline(always)]
    pub(super) fn special(x: u64) -> u64 {
        let t = x & LOW7;
        // Per byte, no carries: `t + 0x60` has its high bit unless t < 0x20, `t + 1` only for 0x7f.
        (!t.wrapping_add(LO * 0x60) | t.wrapping_add(LO) | x) & HI
    }

    /// The high bit of every byte of `x` equal to `c` (ASCII), exact below the first byte with its
    /// high bit set (which [`special`] reports; carries only run from such a byte upwards).
    #[inline(always)]
    pub(super) fn ascii_eq(x: u64, c: u8) -> u64 {
        !(x ^ (LO * u64::from(c))).wrapping_add(LOW7) & HI
    }

    /// Where the label set at the start of `labels` (`{…`) ends, when that is certain without
    /// parsing it: the first `}` after an even number of quotes and no backslash is outside every
    /// label value (the `}` [`series_key`] finds). `None`: no `}` before the line's end, escapes or
    /// a quoted `}` to parse, or a [`special`] byte before it. `labels` may run on past the line:
    /// nothing after the first `}` or newline is looked at. Eight bytes at a time.
    #[inline(always)]
    pub(super) fn labels_end_swar(labels: &[u8]) -> Option<usize> {
        let (words, rest) = labels.as_chunks::<8>();
        // Quote masks XORed together: the parity of their bit count is the quotes' parity.
        let mut quotes = 0u64;
        let mut i = 0;
        while i < words.len() {
            let x = u64::from_le_bytes(words[i]);
            let stop = special(x) | ascii_eq(x, b'\\');
            let any = stop | ascii_eq(x, b'}');
            if any != 0 {
                // The first `}`, backslash or special byte decides; every byte before it is plain.
                let first = any & any.wrapping_neg();
                let before = first - 1;
                if first & stop != 0
                    || (quotes ^ (ascii_eq(x, b'"') & before)).count_ones() & 1 != 0
                {
                    return None;
                }
                return Some(i * 8 + (first.trailing_zeros() / 8) as usize);
            }
            quotes ^= ascii_eq(x, b'"');
            i += 1;
        }
        labels_tail(rest, quotes.count_ones() & 1 != 0, words.len() * 8)
    }

    /// `line.starts_with(prefix)` eight bytes at a time, inline (the size-optimised build calls
    /// `bcmp` for it, once per line).
    #[inline(always)]
    pub(super) fn starts_with(line: &[u8], prefix: &[u8]) -> bool {
        let Some(head) = line.get(..prefix.len()) else {
            return false;
        };
        let (a, a_rest) = head.as_chunks::<8>();
        let (b, b_rest) = prefix.as_chunks::<8>();
        let mut i = 0;
        while i < a.len() && i < b.len() {
            if a[i] != b[i] {
                return false;
            }
            i += 1;
        }
        a_rest == b_rest
    }

    /// Where the newline ending the line at the start of `rest` is, when no [`special`] byte comes
    /// before it (a value and timestamp: a few words). Eight bytes at a time.
    #[inline(always)]
    pub(super) fn value_end_swar(rest: &[u8]) -> Option<usize> {
        let (words, tail) = rest.as_chunks::<8>();
        let mut i = 0;
        while i < words.len() {
            let s = special(u64::from_le_bytes(words[i]));
            if s != 0 {
                let at = (s.trailing_zeros() / 8) as usize;
                return (words[i][at] == b'\n').then_some(i * 8 + at);
            }
            i += 1;
        }
        value_tail(tail, words.len() * 8)
    }
}

use swar::starts_with;
#[cfg(any(test, not(all(target_arch = "x86_64", target_feature = "sse2"))))]
use swar::{labels_end_swar, value_end_swar};

/// [`swar::special`] for one byte.
#[inline(always)]
fn special_byte(b: u8) -> bool {
    !(0x20..0x7f).contains(&b)
}

/// The last bytes of a label set, after the whole words or blocks the scans compare at once:
/// `odd` is the parity of the quotes before them, `base` their offset in the label set.
#[inline(always)]
fn labels_tail(rest: &[u8], mut odd: bool, base: usize) -> Option<usize> {
    let mut j = 0;
    while j < rest.len() {
        match rest[j] {
            b'}' => return (!odd).then_some(base + j),
            b'"' => odd = !odd,
            b'\\' => return None,
            b if special_byte(b) => return None,
            _ => {}
        }
        j += 1;
    }
    None
}

/// The last bytes of a value, after the whole words or blocks: `base` is their offset.
#[inline(always)]
fn value_tail(tail: &[u8], base: usize) -> Option<usize> {
    let mut j = 0;
    while j < tail.len() {
        if special_byte(tail[j]) {
            return (tail[j] == b'\n').then_some(base + j);
        }
        j += 1;
    }
    None
}

/// [`swar::labels_end_swar`]'s answer, sixteen bytes at a time where SSE2 is part of the target
/// (every x86-64): the label set is most of a sample line, and its scan most of the filter's
/// time (docs/benchmarks-log.md).
#[inline(always)]
fn labels_end(labels: &[u8]) -> Option<usize> {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    return sse2_scan(labels, true);
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    return labels_end_swar(labels);
}

/// [`swar::value_end_swar`]'s answer, sixteen bytes at a time where SSE2 is part of the target.
#[inline(always)]
fn value_end(rest: &[u8]) -> Option<usize> {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    return sse2_scan(rest, false);
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse2")))]
    return value_end_swar(rest);
}

/// [`sse2::labels_end`] (`labels`) or [`sse2::value_end`].
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
#[allow(unsafe_code)]
#[inline(always)]
fn sse2_scan(bytes: &[u8], labels: bool) -> Option<usize> {
    // SAFETY: both are safe functions whose only requirement is the `sse2` target feature
    // (`#[target_feature]` makes the call unsafe outside functions that name it), and this
    // code is only compiled when the build enables `sse2` for every function (the cfg
    // above; the x86-64 baseline), so the CPU running it has SSE2.
    unsafe {
        if labels {
            sse2::labels_end(bytes)
        } else {
            sse2::value_end(bytes)
        }
    }
}

/// The SWAR scans' decisions with 16-byte compares (the intrinsics take no pointers: a block
/// is loaded as two words, `_mm_set_epi64x`, which compiles to one unaligned load).
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_cmpeq_epi8, _mm_cmplt_epi8, _mm_movemask_epi8, _mm_or_si128, _mm_set_epi64x,
        _mm_set1_epi8,
    };

    use super::{labels_tail, value_tail};

    #[target_feature(enable = "sse2")]
    #[inline]
    fn load(block: &[u8; 16]) -> __m128i {
        let (w, _) = block.as_chunks::<8>();
        _mm_set_epi64x(i64::from_le_bytes(w[1]), i64::from_le_bytes(w[0]))
    }

    /// Bit `i` set for every byte `i` of `v` that [`special_byte`] reports: below 0x20 or at
    /// or above 0x80 (negative as a signed byte), or DEL.
    #[target_feature(enable = "sse2")]
    #[inline]
    fn special(v: __m128i) -> u32 {
        let low = _mm_cmplt_epi8(v, _mm_set1_epi8(0x20));
        let del = _mm_cmpeq_epi8(v, _mm_set1_epi8(0x7f));
        _mm_movemask_epi8(_mm_or_si128(low, del)) as u32
    }

    #[target_feature(enable = "sse2")]
    #[inline]
    fn eq(v: __m128i, c: u8) -> __m128i {
        _mm_cmpeq_epi8(v, _mm_set1_epi8(c as i8))
    }

    /// [`super::swar::labels_end_swar`].
    #[target_feature(enable = "sse2")]
    #[inline]
    pub(super) fn labels_end(labels: &[u8]) -> Option<usize> {
        let (blocks, rest) = labels.as_chunks::<16>();
        // Quote masks XORed together: the parity of their bit count is the quotes' parity.
        let mut quotes = 0u32;
        let mut i = 0;
        while i < blocks.len() {
            let v = load(&blocks[i]);
            let stop = special(v) | _mm_movemask_epi8(eq(v, b'\\')) as u32;
            let any = stop | _mm_movemask_epi8(eq(v, b'}')) as u32;
            let q = _mm_movemask_epi8(eq(v, b'"')) as u32;
            if any != 0 {
                let first = any & any.wrapping_neg();
                if first & stop != 0 || (quotes ^ (q & (first - 1))).count_ones() & 1 != 0 {
                    return None;
                }
                return Some(i * 16 + first.trailing_zeros() as usize);
            }
            quotes ^= q;
            i += 1;
        }
        labels_tail(rest, quotes.count_ones() & 1 != 0, blocks.len() * 16)
    }

    /// [`super::swar::value_end_swar`].
    #[target_feature(enable = "sse2")]
    #[inline]
    pub(super) fn value_end(rest: &[u8]) -> Option<usize> {
        let (blocks, tail) = rest.as_chunks::<16>();
        let mut i = 0;
        while i < blocks.len() {
            let s = special(load(&blocks[i]));
            if s != 0 {
                let at = s.trailing_zeros() as usize;
                return (blocks[i][at] == b'\n').then_some(i * 16 + at);
            }
            i += 1;
        }
        value_tail(tail, blocks.len() * 16)
    }
}

/// Family hashes of one scrape: a list of tables, each filled to its capacity and never
/// rehashed; a full one is followed by a new one, so memory grows with the families in small
/// steps (18 KiB) and no step holds two copies. A lookup asks every table (six for 10,000
/// families); families are a tenth of the lines.
#[derive(Default)]
struct FamilySet {
    tables: Vec<HashSet64>,
    len: usize,
    /// One bit per hash (bits 34–49, which the tables do not use for slots or tags): clear
    /// means new, so most families are added without asking every table.
    filter: Vec<u64>,
}

/// Words of [`FamilySet::filter`]: 64 Kibit, 8 KiB (one false "maybe" in seven at 10,000
/// families).
const FILTER_WORDS: usize = 1024;

/// Capacity of the second table (2,048 slots; the first grows by itself up to this).
const FAMILY_TABLE: usize = 1792;

impl FamilySet {
    /// Adds `h`; false when it was there already.
    fn insert(&mut self, h: u64) -> bool {
        if self.filter.is_empty() {
            self.filter = vec![0; FILTER_WORDS];
        }
        let (word, bit) = ((h >> 40) as usize % FILTER_WORDS, 1u64 << ((h >> 34) & 63));
        let maybe = self.filter.get(word).is_some_and(|w| w & bit != 0);
        if maybe && self.tables.iter().any(|t| t.contains(&h)) {
            return false;
        }
        if let Some(w) = self.filter.get_mut(word) {
            *w |= bit;
        }
        let full = match self.tables.last() {
            None => true,
            Some(t) => t.len() >= t.capacity() && t.capacity() >= FAMILY_TABLE,
        };
        if full {
            // Equal tables, doubled for every eight tables' worth of families: few tables to
            // ask, and at most an eighth of a table unused.
            let cap = if self.tables.is_empty() {
                0
            } else {
                FAMILY_TABLE * (self.len / (8 * FAMILY_TABLE)).max(1).next_power_of_two()
            };
            self.tables
                .push(HashSet64::with_capacity_and_hasher(cap, Default::default()));
        }
        if let Some(t) = self.tables.last_mut() {
            t.insert(h);
        }
        self.len += 1;
        true
    }
}

/// Series hashes of the family block being written: the first [`FEW`] in an array searched
/// in order (a block has a handful of series: a histogram's buckets, a counter per cluster),
/// the rest in a table.
#[derive(Default)]
struct SeriesSet {
    few: [u64; FEW],
    len: usize,
    many: HashSet64,
}

const FEW: usize = 16;

impl SeriesSet {
    /// Adds `h`; false when it was there already.
    #[inline(always)]
    fn insert(&mut self, h: u64) -> bool {
        let mut i = 0;
        while i < self.len && i < FEW {
            if self.few[i] == h {
                return false;
            }
            i += 1;
        }
        if self.len < FEW {
            self.few[self.len] = h;
            self.len += 1;
            return true;
        }
        self.many.insert(h)
    }

    fn clear(&mut self) {
        self.len = 0;
        if self.many.capacity() > 4096 {
            // Do not keep a huge table around after one very large family.
            self.many = HashSet64::default();
        } else if !self.many.is_empty() {
            self.many.clear();
        }
    }
}

/// Families seen across all sources of one scrape.
#[derive(Default)]
pub struct Seen {
    families: FamilySet,
    /// Lines dropped as duplicates (for logs).
    pub dropped: u64,
}

impl Seen {
    /// Records family `name`; false when an earlier source already had it (past
    /// [`MAX_FAMILIES`] every name passes, unchecked).
    pub fn first(&mut self, name: &[u8]) -> bool {
        self.families.len >= MAX_FAMILIES || self.families.insert(hash(name))
    }
}

/// Per-source state: partial line, current family block and held-back output.
pub struct SourceFilter {
    partial: Vec<u8>,
    skipping_long_line: bool,
    family: Vec<u8>,
    keep: bool,
    /// What the current block has had so far: `# HELP`, `# TYPE`, `# UNIT`, samples.
    had_help: bool,
    had_type: bool,
    had_unit: bool,
    had_samples: bool,
    /// Family blocks of this source dropped whole (duplicates of earlier blocks).
    pub dropped_families: u64,
    failure: Option<&'static str>,
    series: SeriesSet,
    /// Output held back, in order: `pieces`, then `owned` or `run` (at most one is non-empty).
    /// Kept lines are not copied: `pieces` are slices of the chunks they came in.
    pieces: Vec<Bytes>,
    /// Lines not written as they came (CRLF ends, lines joined across chunks).
    owned: BytesMut,
    /// `start..end` in the chunk being pushed: the kept lines since the last piece.
    run: (usize, usize),
    /// Bytes held back (`pieces`, `owned` and `run`).
    held: usize,
    /// Tests: every line through the general path, to compare the fast one against it.
    slow_only: bool,
    /// Offset in the held output where the current family block starts.
    boundary: usize,
}

impl Default for SourceFilter {
    fn default() -> Self {
        SourceFilter {
            partial: Vec::new(),
            skipping_long_line: false,
            family: Vec::new(),
            keep: true,
            had_help: false,
            had_type: false,
            had_unit: false,
            had_samples: false,
            dropped_families: 0,
            failure: None,
            series: SeriesSet::default(),
            pieces: Vec::new(),
            owned: BytesMut::new(),
            run: (0, 0),
            held: 0,
            boundary: 0,
            slow_only: false,
        }
    }
}

const SUFFIXES: &[&[u8]] = &[
    b"_bucket",
    b"_sum",
    b"_count",
    b"_total",
    b"_created",
    b"_info",
    b"_gcount",
    b"_gsum",
];

fn belongs(sample: &[u8], family: &[u8]) -> bool {
    if family.is_empty() {
        return false;
    }
    match sample.strip_prefix(family) {
        Some(rest) => rest.is_empty() || SUFFIXES.contains(&rest),
        None => false,
    }
}

/// `name{labels}` of a sample line (labels may contain quoted spaces and braces); `None` for a
/// line that is not a sample.
fn series_key(line: &[u8]) -> Option<(&[u8], &[u8])> {
    let name_end = line
        .iter()
        .position(|b| *b == b'{' || *b == b' ' || *b == b'\t')
        .unwrap_or(line.len());
    if name_end == 0 {
        return None;
    }
    let name = &line[..name_end];
    if line.get(name_end) != Some(&b'{') {
        return Some((name, name));
    }
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, b) in line.iter().enumerate().skip(name_end + 1) {
        if escaped {
            escaped = false;
            continue;
        }
        match (*b, in_quotes) {
            (b'\\', true) => escaped = true,
            (b'"', _) => in_quotes = !in_quotes,
            (b'}', false) => return Some((name, &line[..=i])),
            _ => {}
        }
    }
    None
}

#[derive(Clone, Copy)]
enum Meta {
    Help,
    Type,
    Unit,
}

/// The kind and metric name of a `# HELP|TYPE|UNIT name ...` line.
fn meta_name(line: &[u8]) -> Option<(Meta, &[u8])> {
    let rest = line.strip_prefix(b"# ")?;
    let (kind, rest) = if let Some(r) = rest.strip_prefix(b"HELP ") {
        (Meta::Help, r)
    } else if let Some(r) = rest.strip_prefix(b"TYPE ") {
        (Meta::Type, r)
    } else {
        (Meta::Unit, rest.strip_prefix(b"UNIT ")?)
    };
    let end = rest
        .iter()
        .position(|b| *b == b' ' || *b == b'\t')
        .unwrap_or(rest.len());
    (end > 0).then(|| (kind, &rest[..end]))
}

/// A metric name of the text format (`[a-zA-Z_:][a-zA-Z0-9_:]*`, the legacy names every
/// Prometheus parser accepts unquoted).
fn valid_name(name: &[u8]) -> bool {
    match name.split_first() {
        Some((first, rest)) => {
            (first.is_ascii_alphabetic() || *first == b'_' || *first == b':')
                && rest
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b':')
        }
        None => false,
    }
}

/// Why a line cannot go into the text output, if it cannot.
fn invalid_line(line: &[u8]) -> Option<&'static str> {
    if line
        .iter()
        .any(|b| (*b < 0x20 && *b != b'\t') || *b == 0x7f)
    {
        return Some("a line has control characters");
    }
    if !line.is_ascii() && std::str::from_utf8(line).is_err() {
        return Some("a line is not valid UTF-8");
    }
    None
}

impl SourceFilter {
    /// Why this source failed (a line that cannot be written); nothing after it was taken.
    pub fn failure(&self) -> Option<&'static str> {
        self.failure
    }

    /// Feeds a chunk; returns chunks ready to be written. [`SourceFilter::push_bytes`] without
    /// a `Bytes` to slice: the chunk is copied once.
    pub fn push(&mut self, seen: &mut Seen, chunk: &[u8], ready: &mut Vec<Bytes>) {
        self.push_bytes(seen, &Bytes::copy_from_slice(chunk), ready);
    }

    /// Feeds a chunk; returns chunks ready to be written, slices of `chunk` where lines are
    /// kept as they came.
    pub fn push_bytes(&mut self, seen: &mut Seen, chunk: &Bytes, ready: &mut Vec<Bytes>) {
        if self.failure.is_some() {
            return;
        }
        self.take(seen, chunk, ready);
        // Nothing may point into `chunk` past this call but the pieces taken from it.
        self.close_run(chunk);
    }

    fn take(&mut self, seen: &mut Seen, chunk: &Bytes, ready: &mut Vec<Bytes>) {
        let mut from = 0;
        // The end of a line begun in an earlier chunk.
        if !self.partial.is_empty() || self.skipping_long_line {
            let Some(nl) = memchr(b'\n', chunk) else {
                self.keep_partial(chunk);
                return;
            };
            if self.skipping_long_line {
                self.skipping_long_line = false;
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(&chunk[..nl]);
                if self.line(seen, &line) {
                    self.keep_owned(chunk, &line);
                }
                line.clear();
                self.partial = line;
                if self.failure.is_some() {
                    return;
                }
                self.maybe_flush(chunk, ready);
            }
            from = nl + 1;
        }
        // The chunk's whole lines, then the start of the next one.
        let end = memrchr(b'\n', &chunk[from..]).map_or(from, |i| from + i + 1);
        if end > from {
            self.lines(seen, chunk, from, end, ready);
            if self.failure.is_some() {
                return;
            }
        }
        if end < chunk.len() {
            self.keep_partial(&chunk[end..]);
        }
    }

    /// Holds the start of a line until its newline arrives; a line over [`MAX_LINE`] is
    /// dropped.
    fn keep_partial(&mut self, part: &[u8]) {
        if self.skipping_long_line {
            return;
        }
        if self.partial.len() + part.len() > MAX_LINE {
            tracing::debug!("dropping a metrics line longer than {MAX_LINE} bytes");
            self.partial = Vec::new();
            self.skipping_long_line = true;
        } else {
            self.partial.extend_from_slice(part);
        }
    }

    /// The whole lines `chunk[start..end]` (ending with a newline).
    fn lines(
        &mut self,
        seen: &mut Seen,
        chunk: &Bytes,
        mut start: usize,
        end: usize,
        ready: &mut Vec<Bytes>,
    ) {
        let region = &chunk[..end];
        while start < end {
            let nl = match self.sample_fast(seen, chunk, start, end) {
                Some(nl) => nl,
                None => {
                    // The region ends with a newline.
                    let nl = memchr(b'\n', &region[start..]).map_or(end - 1, |i| start + i);
                    let line = &region[start..nl];
                    if self.line(seen, line) {
                        if line.last() == Some(&b'\r') {
                            self.keep_owned(chunk, line);
                        } else {
                            self.keep_slice(chunk, start, nl + 1);
                        }
                    }
                    if self.failure.is_some() {
                        return;
                    }
                    nl
                }
            };
            start = nl + 1;
            self.maybe_flush(chunk, ready);
        }
    }

    /// [`SourceFilter::line`] for a sample of the family being written whose bytes are all
    /// plain (no [`swar::special`] byte): the same decision without validating or parsing the line
    /// further, and the line kept as a slice of `chunk`. Returns where its newline is; `None`
    /// when the line needs the general path (another family, no labels' end found, escapes in
    /// label values, a name ending the line, CR, control or non-ASCII bytes).
    #[inline(always)]
    fn sample_fast(
        &mut self,
        seen: &mut Seen,
        chunk: &Bytes,
        start: usize,
        end: usize,
    ) -> Option<usize> {
        let line = &chunk[start..end];
        let family = self.family.as_slice();
        if self.slow_only || family.is_empty() || !starts_with(line, family) {
            return None;
        }
        let name_len = family.len();
        // A suffix (`_bucket`, `_sum`, …) up to the labels or the value.
        let mut e = name_len;
        while line
            .get(e)
            .is_some_and(|b| b.is_ascii_lowercase() || *b == b'_')
        {
            e += 1;
        }
        if e > name_len && !SUFFIXES.contains(&&line[name_len..e]) {
            return None;
        }
        let key_end = match line.get(e) {
            Some(b' ' | b'\t') => e,
            Some(b'{') => e + labels_end(&line[e..])? + 1,
            _ => return None,
        };
        let nl = key_end + value_end(&line[key_end..])?;
        self.had_samples = true;
        // The key without the family's name, which every series of the block starts with.
        if !self.keep || !self.series.insert(hash(&line[name_len..key_end])) {
            seen.dropped += 1;
        } else {
            self.keep_slice(chunk, start, start + nl + 1);
        }
        Some(start + nl)
    }

    /// Keeps `chunk[start..end]` as it is: it extends the run when it follows it.
    #[inline(always)]
    fn keep_slice(&mut self, chunk: &Bytes, start: usize, end: usize) {
        if self.run.1 != start || !self.owned.is_empty() {
            self.start_run(chunk, start);
        }
        self.run.1 = end;
        self.held += end - start;
    }

    #[inline(never)]
    fn start_run(&mut self, chunk: &Bytes, start: usize) {
        self.close_owned();
        self.close_run(chunk);
        self.run = (start, start);
    }

    /// Keeps `line` without its CR, with a newline, copied.
    fn keep_owned(&mut self, chunk: &Bytes, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        self.close_run(chunk);
        self.owned.extend_from_slice(line);
        self.owned.extend_from_slice(b"\n");
        self.held += line.len() + 1;
    }

    fn close_run(&mut self, chunk: &Bytes) {
        if self.run.0 < self.run.1 {
            self.pieces.push(chunk.slice(self.run.0..self.run.1));
        }
        self.run = (0, 0);
    }

    fn close_owned(&mut self) {
        if !self.owned.is_empty() {
            self.pieces.push(self.owned.split().freeze());
        }
    }

    /// Hands on the first `n` held bytes.
    fn hand_on(&mut self, chunk: &Bytes, n: usize, ready: &mut Vec<Bytes>) {
        self.close_owned();
        self.close_run(chunk);
        let mut left = n;
        let mut whole = 0;
        for p in &self.pieces {
            if p.len() > left {
                break;
            }
            left -= p.len();
            whole += 1;
        }
        ready.extend(self.pieces.drain(..whole));
        if left > 0
            && let Some(first) = self.pieces.first_mut()
        {
            ready.push(first.split_to(left));
        }
        self.held -= n;
    }

    /// End of a source that completed: the last line may lack a newline.
    /// Check [`SourceFilter::failure`] after it: the last line may fail the source.
    pub fn finish(&mut self, seen: &mut Seen, ready: &mut Vec<Bytes>) {
        let none = Bytes::new();
        if !self.partial.is_empty() && !self.skipping_long_line && self.failure.is_none() {
            let line = std::mem::take(&mut self.partial);
            if self.line(seen, &line) {
                self.keep_owned(&none, &line);
            }
        }
        if self.failure.is_some() {
            return;
        }
        if self.held > 0 {
            self.hand_on(&none, self.held, ready);
        }
        self.boundary = 0;
    }

    /// A source failed mid-body: drop the incomplete family block, keep what came before it.
    pub fn abort(&mut self, ready: &mut Vec<Bytes>) {
        self.partial.clear();
        self.close_owned();
        let mut cut = self.held - self.boundary;
        while cut > 0 {
            let Some(last) = self.pieces.last_mut() else {
                break;
            };
            if last.len() <= cut {
                cut -= last.len();
                self.pieces.pop();
            } else {
                last.truncate(last.len() - cut);
                cut = 0;
            }
        }
        self.held = self.boundary;
        if self.held > 0 {
            self.hand_on(&Bytes::new(), self.held, ready);
        }
        self.boundary = 0;
    }

    #[inline(always)]
    fn maybe_flush(&mut self, chunk: &Bytes, ready: &mut Vec<Bytes>) {
        if self.held >= FLUSH_AT {
            self.flush(chunk, ready);
        }
    }

    #[inline(never)]
    fn flush(&mut self, chunk: &Bytes, ready: &mut Vec<Bytes>) {
        if self.boundary > 0 {
            self.hand_on(chunk, self.boundary, ready);
            self.boundary = 0;
        } else if self.held >= HOLD_BACK {
            self.hand_on(chunk, self.held, ready);
        }
    }

    /// A new family block; `repeated` when it repeats the block just written (same name).
    fn start_block(&mut self, seen: &mut Seen, name: &[u8], repeated: bool) {
        self.boundary = self.held;
        self.had_help = false;
        self.had_type = false;
        self.had_unit = false;
        self.had_samples = false;
        self.family.clear();
        self.family.extend_from_slice(name);
        self.series.clear();
        self.keep = !repeated && seen.first(name);
        if !self.keep {
            self.dropped_families += 1;
            tracing::debug!(
                family = %String::from_utf8_lossy(name),
                "dropping a family block already written (by an earlier source or this one)"
            );
        }
    }

    /// Decides one line (without its newline); true when it is written (without a trailing
    /// CR, with a newline).
    fn line(&mut self, seen: &mut Seen, line: &[u8]) -> bool {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(|b| b.is_ascii_whitespace()) {
            return false;
        }
        if let Some(why) = invalid_line(line) {
            // Cut before this line when it starts another family (the block being written is
            // complete), else before the block it belongs to.
            let new_block = if line[0] == b'#' {
                meta_name(line).is_some_and(|(_, n)| n != self.family.as_slice())
            } else {
                series_key(line).is_some_and(|(n, _)| !belongs(n, &self.family))
            };
            self.fail(why, new_block);
            return false;
        }
        if line[0] == b'#' {
            let Some((kind, name)) = meta_name(line) else {
                // `# EOF` and free-form comments.
                return false;
            };
            if !valid_name(name) {
                let new_block = name != self.family.as_slice();
                self.fail("a HELP/TYPE/UNIT line names an invalid metric", new_block);
                return false;
            }
            if name != self.family.as_slice() {
                self.start_block(seen, name, false);
            } else {
                let again = match kind {
                    Meta::Help => self.had_help,
                    Meta::Type => self.had_type,
                    Meta::Unit => self.had_unit,
                };
                if again || self.had_samples {
                    self.start_block(seen, name, true);
                }
            }
            match kind {
                Meta::Help => self.had_help = true,
                Meta::Type => self.had_type = true,
                Meta::Unit => self.had_unit = true,
            }
            if !self.keep {
                seen.dropped += 1;
            }
            return self.keep;
        }
        let Some((name, key)) = series_key(line) else {
            seen.dropped += 1;
            return false;
        };
        if !valid_name(name) {
            let new_block = !belongs(name, &self.family);
            self.fail("a sample has an invalid metric name", new_block);
            return false;
        }
        if !belongs(name, &self.family) {
            self.start_block(seen, name, false);
        }
        self.had_samples = true;
        let unique = key.get(self.family.len()..).unwrap_or(key);
        if !self.keep || !self.series.insert(hash(unique)) {
            seen.dropped += 1;
            return false;
        }
        true
    }

    /// Ends the source at a family boundary: the end of the output when the bad line starts
    /// a new family, else the start of the current block.
    fn fail(&mut self, why: &'static str, new_block: bool) {
        if new_block {
            self.boundary = self.held;
        }
        self.failure = Some(why);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(sources: &[&str], chunk: usize) -> String {
        let mut seen = Seen::default();
        let mut out = Vec::new();
        for s in sources {
            let mut f = SourceFilter::default();
            for c in s.as_bytes().chunks(chunk) {
                f.push(&mut seen, c, &mut out);
            }
            f.finish(&mut seen, &mut out);
        }
        out.iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect()
    }

    /// Merges `sources` fed in chunks of `chunk` bytes; with `slow` every line takes the
    /// general path. Returns the output, the dropped family blocks per source, the failures
    /// and the dropped-line count.
    fn merge_with(
        sources: &[&[u8]],
        chunk: usize,
        slow: bool,
    ) -> (Vec<u8>, Vec<u64>, Vec<Option<&'static str>>, u64) {
        let mut seen = Seen::default();
        let mut out = Vec::new();
        let (mut dropped, mut failures) = (Vec::new(), Vec::new());
        for s in sources {
            let mut f = SourceFilter {
                slow_only: slow,
                ..SourceFilter::default()
            };
            for c in s.chunks(chunk.max(1)) {
                f.push(&mut seen, c, &mut out);
            }
            f.finish(&mut seen, &mut out);
            if f.failure().is_some() {
                f.abort(&mut out);
            }
            dropped.push(f.dropped_families);
            failures.push(f.failure());
        }
        (out.concat(), dropped, failures, seen.dropped)
    }

    /// Bodies that exercise every branch of the fast path and every reason to leave it.
    const EDGE_BODIES: &[&[u8]] = &[
        // Histogram suffixes, a suffix that is not one (a new family), labels with a quoted
        // `}`, escapes and spaces, a name followed by a tab, a name ending the line.
        b"# HELP h a histogram\n# TYPE h histogram\nh_bucket{le=\"0.5\"} 1\nh_bucket{le=\"+Inf\"} 2\nh_sum 3\nh_count\t2\nh_other 1\nh\n",
        b"# TYPE e counter\ne{a=\"}\",b=\"x\"} 1\ne{a=\"}\",b=\"x\"} 2\ne{a=\"}\",b=\"y\"} 2\ne{a=\"q\\\"}\"} 3\ne{a=\"q\\\"}\"} 4\ne{a=\"sp ace\"} 5\ne{a=\"x\"}  6\n",
        // Duplicate series (Envoy #52221), a repeated family further down, blank lines, free
        // comments and `# EOF`.
        b"# TYPE d gauge\nd{x=\"1\"} 1\nd{x=\"2\"} 1\nd{x=\"1\"} 9\n\n   \n# free comment\n# TYPE f gauge\nf 1\n# TYPE d gauge\nd 2\n# EOF\n",
        // CRLF endings, UTF-8 in HELP and label values, a missing trailing newline.
        b"# HELP u caf\xc3\xa9 \xe2\x82\xac\r\n# TYPE u gauge\r\nu{n=\"\xc3\xa9\"} 1\r\nu{n=\"b\"} 2",
        // An untyped family, a family shared with an earlier source, an unterminated label set.
        b"x 1\nx{a=\"1\"} 2\n# TYPE e counter\ne 7\n# TYPE g gauge\ng{a=\"1\" 3\ng 4\n",
        // Invalid lines at different places: inside a block, starting a block.
        b"# TYPE i gauge\ni 1\n# TYPE j gauge\nj{x=\"\xff\"} 1\nj 2\n",
        b"# TYPE k gauge\nk 1\nk{x=\"\x01\"} 2\n",
        b"# TYPE l gauge\nl 1\nl\x7f 2\n",
        b"# TYPE m gauge\nm 1\n# TYPE m-n gauge\n",
        b"# TYPE o gauge\no 1\no\rp 2\n",
    ];

    #[test]
    fn fast_path_decides_as_the_general_path() {
        // Every body alone and all of them in one merge, in chunks from one byte (every line
        // split across chunks) to whole bodies.
        let mut cases: Vec<Vec<&[u8]>> = EDGE_BODIES.iter().map(|b| vec![*b]).collect();
        cases.push(EDGE_BODIES.to_vec());
        for sources in &cases {
            for chunk in [1, 2, 3, 5, 8, 13, 64, 4096, usize::MAX] {
                let fast = merge_with(sources, chunk, false);
                let slow = merge_with(sources, chunk, true);
                assert_eq!(
                    String::from_utf8_lossy(&fast.0),
                    String::from_utf8_lossy(&slow.0),
                    "chunk {chunk}, sources {sources:?}"
                );
                assert_eq!(fast.1, slow.1, "dropped families, chunk {chunk}");
                assert_eq!(fast.2, slow.2, "failures, chunk {chunk}");
                assert_eq!(fast.3, slow.3, "dropped lines, chunk {chunk}");
                // And independent of the chunking.
                assert_eq!(
                    fast,
                    merge_with(sources, usize::MAX, false),
                    "chunk {chunk}"
                );
            }
        }
    }

    #[test]
    fn fast_path_decides_as_the_general_path_on_generated_bodies() {
        // Lines built from pieces that hit the fast path's edges, in a fixed pseudo-random
        // order (xorshift), merged as three sources.
        let names = ["a", "a_sum", "a_bucket", "a_x", "b", "b_count", "c", "a1"];
        let labels = [
            "",
            "{x=\"1\"}",
            "{x=\"}\"}",
            "{x=\"}\",y=\"1\"}",
            "{x=\"}\",y=\"2\"}",
            "{x=\"\\\"}\",y=\"2\"}",
            "{x=\"\\\"}\"}",
            "{x=\"1\",y=\"2\"}",
            "{x=\"1\"",
            "{}",
            // Non-ASCII and, rarely, bytes that fail the source: the fast path's scans must
            // leave these lines to the general path wherever they sit in a word.
            "{x=\"caf\u{e9}\"}",
            "{x=\"}\u{20ac}\",y=\"1\"}",
            "{x=\"12345678\u{7f}\"}",
        ];
        let values = [
            " 1",
            " 2",
            "\t3",
            "",
            " 1 1700000000",
            " 1234567\u{e9}",
            " 1\t2",
        ];
        let metas = [
            "# TYPE {} counter",
            "# HELP {} help",
            "# UNIT {} seconds",
            "# c",
        ];
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        for round in 0..80 {
            let mut bodies: Vec<Vec<u8>> = Vec::new();
            for _ in 0..3 {
                let mut body = String::new();
                for _ in 0..60 {
                    let name = names[next(names.len())];
                    if next(4) == 0 {
                        body.push_str(&metas[next(metas.len())].replace("{}", name));
                    } else {
                        body.push_str(name);
                        body.push_str(labels[next(labels.len())]);
                        body.push_str(values[next(values.len())]);
                    }
                    body.push_str(if next(10) == 0 { "\r\n" } else { "\n" });
                }
                if next(2) == 0 {
                    body.pop();
                }
                bodies.push(body.into_bytes());
            }
            let sources: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
            for chunk in [1, 7, 100, usize::MAX] {
                let fast = merge_with(&sources, chunk, false);
                let slow = merge_with(&sources, chunk, true);
                assert_eq!(
                    String::from_utf8_lossy(&fast.0),
                    String::from_utf8_lossy(&slow.0),
                    "round {round}, chunk {chunk}"
                );
                assert_eq!(
                    (fast.1, fast.2, fast.3),
                    (slow.1, slow.2, slow.3),
                    "round {round}, chunk {chunk}"
                );
            }
        }
    }

    #[test]
    fn labels_end_agrees_with_series_key() {
        let sets = [
            "{}",
            "{a=\"1\"}",
            "{a=\"}\"}",
            "{a=\"x\",b=\"}}\"}",
            "{a=\"\\\"}\"}",
            "{a=\"1\"",
            "{a=\"}",
            "{a=\"1\",}",
            // Non-ASCII (Ž is c5 bd, bd being `}` with its high bit) and control bytes: left
            // to the general path.
            "{a=\"\u{17d}\"}",
            "{a=\"\u{e9}\",b=\"}\"}",
            "{a=\"x\ty\"}",
        ];
        // A set unterminated on its line, closed on the next one.
        for pad in 0..9 {
            let text = format!("{{a=\"{}\"\nb}} 1\n", "x".repeat(pad));
            assert_eq!(labels_end(text.as_bytes()), None, "{text}");
        }
        // Every position of the `}` within an eight-byte word, and the tail path.
        for pad in 0..17 {
            for set in sets {
                for value in ["", " 1", " 12345678901234567"] {
                    let line = format!("{}{set}{value}", "n".repeat(pad + 1));
                    let name_end = pad + 1;
                    let want = series_key(line.as_bytes()).map(|(_, k)| k.len());
                    match labels_end(&line.as_bytes()[name_end..]) {
                        // When it answers, it is the general path's answer.
                        Some(close) => assert_eq!(Some(name_end + close + 1), want, "{line}"),
                        // It leaves only escapes, quoted braces and unterminated sets.
                        None => assert!(
                            set.contains('\\')
                                || set.matches('}').count() != 1
                                || want.is_none()
                                || set.bytes().any(special_byte),
                            "{line}"
                        ),
                    }
                }
            }
        }
    }

    #[test]
    fn a_missing_trailing_newline_is_added() {
        for chunk in [1, 4, 4096] {
            let (out, ..) = merge_with(&[b"# TYPE a gauge\na 1", b"b{x=\"1\"} 2"], chunk, false);
            assert_eq!(out, b"# TYPE a gauge\na 1\nb{x=\"1\"} 2\n", "chunk {chunk}");
        }
    }

    #[test]
    fn sixteen_byte_scans_answer_as_the_eight_byte_ones() {
        // `labels_end`/`value_end` (SSE2 on x86-64) against the SWAR scans they replace, on
        // every suffix of lines built from the bytes that decide: quotes, backslashes, braces,
        // newlines, CR, tab, DEL, control and non-ASCII bytes, at every offset in a block.
        let alphabet: &[u8] = b"a\"\\}{ \n\t\r\x7f\xc3\xbd\x01=,1";
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let mut lines: Vec<Vec<u8>> = Vec::new();
        for len in 0..80 {
            for _ in 0..40 {
                // Mostly plain bytes, so the deciding byte falls anywhere in a long line.
                let line = (0..len)
                    .map(|_| match next(6) {
                        0 => alphabet[next(alphabet.len())],
                        _ => b'a' + next(26) as u8,
                    })
                    .collect();
                lines.push(line);
            }
        }
        // One deciding byte of every value at every position of a 40-byte label set.
        for at in 0..40 {
            for b in 0..=255u8 {
                let mut line =
                    b"{a=\"xxxxxxxxxxxx\",bb=\"yyyyyyyyyyyyyyy\"} 12 1700000000\n".to_vec();
                line[at] = b;
                lines.push(line);
            }
        }
        for line in &lines {
            for from in 0..line.len().min(20) {
                let rest = &line[from..];
                assert_eq!(labels_end(rest), labels_end_swar(rest), "{rest:?}");
                assert_eq!(value_end(rest), value_end_swar(rest), "{rest:?}");
            }
        }
    }

    #[test]
    fn plain_bytes_are_told_apart_exactly() {
        // Every byte value in every position of a word, against the byte rule.
        for b in 0..=255u8 {
            for at in 0..8 {
                let mut w = [b'a'; 8];
                w[at] = b;
                let mask = swar::special(u64::from_le_bytes(w));
                let want = if special_byte(b) {
                    0x80u64 << (at * 8)
                } else {
                    0
                };
                assert_eq!(mask, want, "byte {b:#x} at {at}");
            }
        }
        assert_eq!(value_end(b" 1\n"), Some(2));
        assert_eq!(value_end(b" 12345678901234\n"), Some(15));
        for bad in [
            &b" 1\tx\n"[..],
            &b" 1\r\n"[..],
            b" 1\x01\n",
            b" 123456789\x7f\n",
            b" 1\xc3\xa9\n",
            b" 1",
        ] {
            assert_eq!(value_end(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn many_families_are_remembered_in_bounded_tables() {
        let mut set = FamilySet::default();
        let n = 100_000u64;
        for i in 0..n {
            assert!(set.insert(hash(format!("family_{i}").as_bytes())), "{i}");
        }
        for i in (0..n).step_by(7) {
            assert!(!set.insert(hash(format!("family_{i}").as_bytes())), "{i}");
        }
        assert_eq!(set.len, n as usize);
        let capacity: usize = set.tables.iter().map(|t| t.capacity()).sum();
        // Grown by a quarter at a time: never far above what it holds, and no doubling.
        assert!(
            capacity < set.len * 3 / 2,
            "{capacity} slots for {}",
            set.len
        );
        assert!(set.tables.len() < 30, "{} tables", set.tables.len());
        // Across sources: a second source repeating every family drops them all.
        let body: String = (0..20_000)
            .map(|i| format!("# TYPE f_{i} gauge\nf_{i}{{x=\"1\"}} 1\n"))
            .collect();
        let (_, dropped, ..) = merge_with(&[body.as_bytes(), body.as_bytes()], 65536, false);
        assert_eq!(dropped, vec![0, 20_000]);
    }

    #[test]
    fn series_keys_hash_apart() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..200_000 {
            let key = format!(
                "envoy_cluster_upstream_rq{{response_code=\"{}\",cluster_name=\"outbound|8080||svc-{}.default.svc.cluster.local\"}}",
                200 + i % 300,
                i / 300
            );
            assert!(seen.insert(hash(key.as_bytes())), "{key}");
        }
        assert_ne!(hash(b""), hash(b"\0"));
        assert_ne!(hash(b"a"), hash(b"a\0"));
    }

    #[test]
    fn drops_duplicate_families_and_series() {
        let agent = "# HELP a x\n# TYPE a counter\na 1\n";
        let envoy = "# TYPE e counter\ne{x=\"1\"} 1\ne{x=\"1\"} 2\ne{x=\"a b}\"} 3\n\n# TYPE a counter\na 5\n";
        let app = "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n# TYPE e gauge\ne 1\n# EOF\n";
        for chunk in [1, 3, 7, 4096] {
            let out = run(&[agent, envoy, app], chunk);
            assert_eq!(
                out,
                "# HELP a x\n# TYPE a counter\na 1\n# TYPE e counter\ne{x=\"1\"} 1\ne{x=\"a b}\"} 3\n# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 1\nh_count 1\n",
                "chunk {chunk}"
            );
        }
    }

    #[test]
    fn abort_cuts_at_family_boundary() {
        let mut seen = Seen::default();
        let mut out = Vec::new();
        let mut f = SourceFilter::default();
        f.push(
            &mut seen,
            b"# TYPE a gauge\na 1\n# TYPE b gauge\nb{x=\"1\"} 1\nb{x=",
            &mut out,
        );
        f.abort(&mut out);
        assert_eq!(out.concat(), b"# TYPE a gauge\na 1\n");
    }

    #[test]
    fn untyped_samples_form_families() {
        let out = run(&["x 1\ny 2\n", "y 3\nz 4"], 2);
        assert_eq!(out, "x 1\ny 2\nz 4\n");
    }

    #[test]
    fn a_family_repeated_in_one_source_is_dropped_whole() {
        let agent = "# TYPE a counter\na 1\n";
        let app = "# HELP app_dup first\n# TYPE app_dup counter\napp_dup 1\n\
                   # HELP app_dup second\n# TYPE app_dup gauge\napp_dup 2\n\
                   # TYPE b gauge\n# TYPE b gauge\nb 1\n\
                   c 1\n# TYPE c gauge\nc 2\n# TYPE d gauge\nd 1\n";
        for chunk in [1, 5, 4096] {
            let mut seen = Seen::default();
            let mut out = Vec::new();
            let mut a = SourceFilter::default();
            a.push(&mut seen, agent.as_bytes(), &mut out);
            a.finish(&mut seen, &mut out);
            let mut f = SourceFilter::default();
            for c in app.as_bytes().chunks(chunk) {
                f.push(&mut seen, c, &mut out);
            }
            f.finish(&mut seen, &mut out);
            assert_eq!(f.failure(), None);
            assert_eq!(
                String::from_utf8(out.concat()).unwrap(),
                "# TYPE a counter\na 1\n# HELP app_dup first\n# TYPE app_dup counter\napp_dup 1\n\
                 # TYPE b gauge\nc 1\n# TYPE d gauge\nd 1\n",
                "chunk {chunk}"
            );
            // app_dup's second block, b's second TYPE (and its sample), c's TYPE after samples.
            assert_eq!(f.dropped_families, 3, "chunk {chunk}");
        }
    }

    #[test]
    fn invalid_lines_fail_the_source_at_a_family_boundary() {
        let a = "# TYPE a gauge\na 1\n";
        let ab = "# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\n";
        let cases: &[(&[u8], &str)] = &[
            // Inside b's block: b goes.
            (
                b"# TYPE a gauge\na 1\n# TYPE b gauge\nb{x=\"\xff\"} 1\nb 2\n",
                a,
            ),
            (
                b"# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\nb{x=\"\x01\"} 2\n",
                a,
            ),
            // Starting another family: b is complete and stays.
            (
                b"# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\n\x0a\x08\x12\x01b 1\n",
                ab,
            ),
            (b"# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\nb-c 2\n", ab),
            (
                b"# TYPE a gauge\na 1\n# TYPE b gauge\nb 1\n# TYPE \xc3\x28 gauge\n",
                ab,
            ),
        ];
        for (body, want) in cases {
            let mut seen = Seen::default();
            let mut out = Vec::new();
            let mut f = SourceFilter::default();
            f.push(&mut seen, body, &mut out);
            f.finish(&mut seen, &mut out);
            assert!(f.failure().is_some(), "{}", String::from_utf8_lossy(body));
            f.abort(&mut out);
            assert_eq!(
                String::from_utf8(out.concat()).unwrap(),
                *want,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}
