//! A lenient reader of the Prometheus text exposition format (0.0.4, and OpenMetrics text as
//! far as its lines look alike) for differential tests: it records what a scrape says instead
//! of rejecting it, so two agents' merged outputs can be compared as structures — including a
//! family written in two blocks, which a strict parser refuses and which a plain concatenating
//! merge produces.

use std::collections::BTreeMap;

/// Label name → value, sorted by name.
pub type Labels = BTreeMap<String, String>;

/// One contiguous run of a family's lines.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Block {
    /// Every `# HELP` text of the block, as written (escapes kept).
    pub help: Vec<String>,
    /// Every `# TYPE` of the block.
    pub types: Vec<String>,
    /// (sample name, labels) → the value as written; a series repeated in the block keeps
    /// every value.
    pub samples: BTreeMap<(String, Labels), Vec<String>>,
}

/// What one scrape says.
#[derive(Debug, Default, Clone)]
pub struct Exposition {
    /// Family name → its blocks in order of appearance (one when the family is contiguous).
    pub families: BTreeMap<String, Vec<Block>>,
    /// Lines that are not metadata, samples or blank, with their line number.
    pub bad_lines: Vec<String>,
    /// Whether a `# EOF` line was seen (OpenMetrics).
    pub eof: bool,
}

/// Suffixes a sample name may add to its family's name (histograms, summaries, OpenMetrics
/// counters and infos).
const SUFFIXES: &[&str] = &["_bucket", "_sum", "_count", "_total", "_created", "_info"];

/// Parses `body`; never fails (see [`Exposition::bad_lines`]).
pub fn parse(body: &str) -> Exposition {
    let mut out = Exposition::default();
    let mut current = String::new();
    for (i, line) in body.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if line == "# EOF" {
            out.eof = true;
            continue;
        }
        if let Some(meta) = line.strip_prefix("# ") {
            let mut parts = meta.splitn(3, ' ');
            let kind = parts.next().unwrap_or("");
            let (Some(name), rest) = (parts.next(), parts.next().unwrap_or("")) else {
                out.bad_lines.push(format!("{}: {line}", i + 1));
                continue;
            };
            if !matches!(kind, "HELP" | "TYPE" | "UNIT") {
                // A plain comment.
                continue;
            }
            let block = enter(&mut out, &mut current, name);
            match kind {
                "HELP" => block.help.push(rest.to_owned()),
                "TYPE" => block.types.push(rest.to_owned()),
                _ => {}
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        match parse_sample(line) {
            Some((name, labels, value)) => {
                let family = if name == current
                    || SUFFIXES
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(current.as_str()))
                {
                    current.clone()
                } else {
                    name.clone()
                };
                enter(&mut out, &mut current, &family)
                    .samples
                    .entry((name, labels))
                    .or_default()
                    .push(value);
            }
            None => out.bad_lines.push(format!("{}: {line}", i + 1)),
        }
    }
    out
}

/// The block lines of `family` go to: the current one, or a new block.
fn enter<'a>(out: &'a mut Exposition, current: &mut String, family: &str) -> &'a mut Block {
    let blocks = out.families.entry(family.to_owned()).or_default();
    if family != current.as_str() || blocks.is_empty() {
        blocks.push(Block::default());
        *current = family.to_owned();
    }
    blocks.last_mut().unwrap()
}

/// `name{a="b",...} value [timestamp]` → (name, labels, value).
fn parse_sample(line: &str) -> Option<(String, Labels, String)> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut labels = Labels::new();
    let mut rest = &line[name_end..];
    if let Some(mut r) = rest.strip_prefix('{') {
        loop {
            r = r.trim_start_matches([',', ' ']);
            if let Some(after) = r.strip_prefix('}') {
                rest = after;
                break;
            }
            let (lname, after) = r.split_once("=\"")?;
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next()? {
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (i, '"') => break i,
                    (_, c) => value.push(c),
                }
            };
            labels.insert(lname.trim().to_owned(), value);
            r = &after[end + 1..];
        }
    }
    let value = rest.split_whitespace().next()?;
    let numeric = matches!(value, "+Inf" | "-Inf" | "NaN") || value.parse::<f64>().is_ok();
    if !numeric || name.is_empty() {
        return None;
    }
    Some((name.to_owned(), labels, value.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_blocks_and_suffixes() {
        let e = parse(
            "# HELP a_total Things.\n# TYPE a_total counter\na_total{x=\"1\",y=\"q\\\"\"} 3\n\
             # TYPE h histogram\nh_bucket{le=\"+Inf\"} 2\nh_sum 1\nh_count 2\n\
             # TYPE a_total counter\na_total 4\nbare 1 1700000000\nnot a sample\n",
        );
        assert_eq!(e.families["a_total"].len(), 2);
        assert_eq!(e.families["a_total"][0].help, ["Things."]);
        let labels: Labels = [("x", "1"), ("y", "q\"")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        assert_eq!(
            e.families["a_total"][0].samples[&("a_total".to_owned(), labels)],
            ["3"]
        );
        assert_eq!(e.families["h"].len(), 1);
        assert_eq!(e.families["h"][0].samples.len(), 3);
        assert_eq!(e.families["bare"][0].types, Vec::<String>::new());
        assert_eq!(e.bad_lines, ["11: not a sample"]);
    }
}
