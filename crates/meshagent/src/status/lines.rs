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
//! new families are passed through unchecked. Output is held back per family block (up to
//! [`HOLD_BACK`]) so an aborted source (cap, timeout, reset) is cut at a family boundary.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hash, Hasher};

use bytes::{Bytes, BytesMut};

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

fn hash(bytes: &[u8]) -> u64 {
    // SipHash with fixed keys: stable within the process, which is all the dedupe needs.
    let mut h = std::hash::DefaultHasher::new();
    bytes.hash(&mut h);
    h.finish()
}

/// Families seen across all sources of one scrape.
#[derive(Default)]
pub struct Seen {
    families: HashSet64,
    /// Lines dropped as duplicates (for logs).
    pub dropped: u64,
}

impl Seen {
    /// Records family `name`; false when an earlier source already had it (past
    /// [`MAX_FAMILIES`] every name passes, unchecked).
    pub fn first(&mut self, name: &[u8]) -> bool {
        self.families.len() >= MAX_FAMILIES || self.families.insert(hash(name))
    }
}

/// Per-source state: partial line, current family block and held-back output.
pub struct SourceFilter {
    partial: BytesMut,
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
    series: HashSet64,
    out: BytesMut,
    /// Offset in `out` where the current family block starts.
    boundary: usize,
}

impl Default for SourceFilter {
    fn default() -> Self {
        SourceFilter {
            partial: BytesMut::new(),
            skipping_long_line: false,
            family: Vec::new(),
            keep: true,
            had_help: false,
            had_type: false,
            had_unit: false,
            had_samples: false,
            dropped_families: 0,
            failure: None,
            series: HashSet64::default(),
            out: BytesMut::with_capacity(FLUSH_AT + 1024),
            boundary: 0,
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

    /// Feeds a chunk; returns chunks ready to be written.
    pub fn push(&mut self, seen: &mut Seen, mut chunk: &[u8], ready: &mut Vec<Bytes>) {
        if self.failure.is_some() {
            return;
        }
        while let Some(nl) = chunk.iter().position(|b| *b == b'\n') {
            let (head, rest) = chunk.split_at(nl);
            chunk = &rest[1..];
            if self.skipping_long_line {
                self.skipping_long_line = false;
                continue;
            }
            if self.partial.is_empty() {
                self.line(seen, head);
            } else {
                self.partial.extend_from_slice(head);
                let line = self.partial.split().freeze();
                self.line(seen, &line);
            }
            if self.failure.is_some() {
                return;
            }
            self.maybe_flush(ready);
        }
        if !chunk.is_empty() && !self.skipping_long_line {
            if self.partial.len() + chunk.len() > MAX_LINE {
                tracing::debug!("dropping a metrics line longer than {MAX_LINE} bytes");
                self.partial.clear();
                self.skipping_long_line = true;
            } else {
                self.partial.extend_from_slice(chunk);
            }
        }
    }

    /// End of a source that completed: the last line may lack a newline.
    /// Check [`SourceFilter::failure`] after it: the last line may fail the source.
    pub fn finish(&mut self, seen: &mut Seen, ready: &mut Vec<Bytes>) {
        if !self.partial.is_empty() && !self.skipping_long_line && self.failure.is_none() {
            let line = self.partial.split().freeze();
            self.line(seen, &line);
        }
        if self.failure.is_some() {
            return;
        }
        if !self.out.is_empty() {
            ready.push(self.out.split().freeze());
        }
        self.boundary = 0;
    }

    /// A source failed mid-body: drop the incomplete family block, keep what came before it.
    pub fn abort(&mut self, ready: &mut Vec<Bytes>) {
        self.partial.clear();
        self.out.truncate(self.boundary);
        if !self.out.is_empty() {
            ready.push(self.out.split().freeze());
        }
        self.boundary = 0;
    }

    fn maybe_flush(&mut self, ready: &mut Vec<Bytes>) {
        if self.out.len() < FLUSH_AT {
            return;
        }
        if self.boundary > 0 {
            ready.push(self.out.split_to(self.boundary).freeze());
            self.boundary = 0;
        } else if self.out.len() >= HOLD_BACK {
            ready.push(self.out.split().freeze());
        }
    }

    /// A new family block; `repeated` when it repeats the block just written (same name).
    fn start_block(&mut self, seen: &mut Seen, name: &[u8], repeated: bool) {
        self.boundary = self.out.len();
        self.had_help = false;
        self.had_type = false;
        self.had_unit = false;
        self.had_samples = false;
        self.family.clear();
        self.family.extend_from_slice(name);
        if self.series.capacity() > 4096 {
            // Do not keep a huge table around after one very large family.
            self.series = HashSet64::default();
        } else {
            self.series.clear();
        }
        self.keep = if repeated {
            false
        } else if seen.families.len() >= MAX_FAMILIES {
            true
        } else {
            seen.families.insert(hash(name))
        };
        if !self.keep {
            self.dropped_families += 1;
            tracing::debug!(
                family = %String::from_utf8_lossy(name),
                "dropping a family block already written (by an earlier source or this one)"
            );
        }
    }

    fn line(&mut self, seen: &mut Seen, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(|b| b.is_ascii_whitespace()) {
            return;
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
            return;
        }
        if line[0] == b'#' {
            let Some((kind, name)) = meta_name(line) else {
                // `# EOF` and free-form comments.
                return;
            };
            if !valid_name(name) {
                let new_block = name != self.family.as_slice();
                self.fail("a HELP/TYPE/UNIT line names an invalid metric", new_block);
                return;
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
            if self.keep {
                self.emit(line);
            } else {
                seen.dropped += 1;
            }
            return;
        }
        let Some((name, key)) = series_key(line) else {
            seen.dropped += 1;
            return;
        };
        if !valid_name(name) {
            let new_block = !belongs(name, &self.family);
            self.fail("a sample has an invalid metric name", new_block);
            return;
        }
        if !belongs(name, &self.family) {
            self.start_block(seen, name, false);
        }
        self.had_samples = true;
        if !self.keep || !self.series.insert(hash(key)) {
            seen.dropped += 1;
            return;
        }
        self.emit(line);
    }

    /// Ends the source at a family boundary: the end of the output when the bad line starts
    /// a new family, else the start of the current block.
    fn fail(&mut self, why: &'static str, new_block: bool) {
        if new_block {
            self.boundary = self.out.len();
        }
        self.failure = Some(why);
    }

    fn emit(&mut self, line: &[u8]) {
        self.out.extend_from_slice(line);
        self.out.extend_from_slice(b"\n");
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
