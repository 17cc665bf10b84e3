//! The agent's modules form layers: `config` is the leaf (it imports nothing of the agent),
//! `preflight` sits above the subsystems whose checks it runs, `app` on top. This test reads
//! the crate's sources and fails on an import cycle between top-level modules (with the
//! cycle and the lines that make it) or on `config` importing anything of the agent, so the
//! layering stays a checked fact instead of a promise (ARCHITECTURE.md, "Layers").
#![allow(
    clippy::disallowed_methods,
    reason = "test code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Top-level module → (referenced top-level module → first `file:line` referencing it).
type Graph = BTreeMap<String, BTreeMap<String, String>>;

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module paths a line names as `crate::<name>`, outside comments.
fn crate_refs(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap_or("");
    let mut out = vec![];
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `meshagent_crate::`
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            out.push(name);
        }
    }
    out
}

fn graph() -> Graph {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    rs_files(&src, &mut files);
    let modules: BTreeSet<String> = files
        .iter()
        .filter(|p| p.parent() == Some(src.as_path()))
        .filter_map(|p| p.file_stem()?.to_str().map(str::to_owned))
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut g = Graph::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        if !modules.contains(&top) || rel.ends_with("tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        // Unit tests may use anything; they start at the module's `#[cfg(test)] mod tests`.
        let text = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or_default();
        for (n, line) in text.lines().enumerate() {
            for r in crate_refs(line) {
                if r != top && modules.contains(&r) {
                    g.entry(top.clone())
                        .or_default()
                        .entry(r)
                        .or_insert_with(|| format!("src/{}:{}", rel.display(), n + 1));
                }
            }
        }
        g.entry(top).or_default();
    }
    g
}

/// A cycle through `start`, if any, as the modules along it.
fn cycle_from(g: &Graph, start: &str) -> Option<Vec<String>> {
    fn walk(
        g: &Graph,
        at: &str,
        start: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in g.get(at).into_iter().flat_map(|e| e.keys()) {
            if next == start {
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if walk(g, next, start, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.to_owned()];
    walk(g, start, start, &mut path, &mut BTreeSet::new()).then_some(path)
}

#[test]
fn config_imports_nothing_of_the_agent() {
    let g = graph();
    let deps = &g["config"];
    assert!(
        deps.is_empty(),
        "config must stay the leaf (checks a start makes belong in preflight); it imports: {deps:?}"
    );
}

#[test]
fn no_import_cycle_between_top_level_modules() {
    let g = graph();
    assert!(g.contains_key("app") && g.contains_key("identity"), "{g:?}");
    for m in g.keys() {
        if let Some(c) = cycle_from(&g, m) {
            let mut hops = vec![];
            for (i, a) in c.iter().enumerate() {
                let b = &c[(i + 1) % c.len()];
                hops.push(format!("{a} → {b} ({})", g[a][b]));
            }
            panic!("import cycle: {}", hops.join(", "));
        }
    }
}

/// The checker itself: a cycle it must see, and comment text it must ignore.
#[test]
fn the_checker_finds_a_cycle_and_ignores_comments() {
    assert_eq!(crate_refs("use crate::xds::X; // crate::app"), ["xds"]);
    assert!(crate_refs("/// see [`crate::app`]").is_empty());
    let mut g = Graph::new();
    g.entry("a".into())
        .or_default()
        .insert("b".into(), "a.rs:1".into());
    g.entry("b".into())
        .or_default()
        .insert("a".into(), "b.rs:1".into());
    assert_eq!(
        cycle_from(&g, "a"),
        Some(vec!["a".to_owned(), "b".to_owned()])
    );
    g.get_mut("b").unwrap().clear();
    assert_eq!(cycle_from(&g, "a"), None);
}
