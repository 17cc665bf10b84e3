//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/*`, including every crash found
//! so far as a regression entry) through the same entry points the cargo-fuzz targets call
//! (`meshagent::fuzzing`), so `make test` catches a regression without nightly or
//! cargo-fuzz. `make fuzz` grows the corpus; this only replays it.

use std::path::{Path, PathBuf};

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus")
}

fn replay(target: &str) {
    let (_, run) = meshagent::fuzzing::TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .unwrap_or_else(|| panic!("no fuzz entry point {target}"));
    let dir = corpus_dir().join(target);
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| {
            e.map(|e| e.path())
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        })
        .filter(|p| p.is_file())
        .collect();
    entries.sort();
    // A corpus that silently went missing would make this test pass vacuously.
    assert!(
        entries.len() >= 3,
        "corpus {} has {} entries; expected the committed seeds",
        dir.display(),
        entries.len()
    );
    for path in entries {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let outcome = std::panic::catch_unwind(|| run(&data));
        assert!(
            outcome.is_ok(),
            "fuzz target {target} panics on corpus entry {}",
            path.display()
        );
    }
}

#[test]
fn every_fuzz_target_has_a_corpus() {
    let mut dirs: Vec<String> = std::fs::read_dir(corpus_dir())
        .expect("fuzz/corpus")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    dirs.sort();
    let mut targets: Vec<String> = meshagent::fuzzing::TARGETS
        .iter()
        .map(|(n, _)| (*n).to_owned())
        .collect();
    targets.sort();
    assert_eq!(
        dirs, targets,
        "fuzz/corpus/* must match meshagent::fuzzing::TARGETS"
    );
}

#[test]
fn fuzz_corpus_config_env() {
    replay("config_env");
}

#[test]
fn fuzz_corpus_proxy_config() {
    replay("proxy_config");
}

#[test]
fn fuzz_corpus_probers() {
    replay("probers");
}

#[test]
fn fuzz_corpus_xds_wire() {
    replay("xds_wire");
}

#[test]
fn fuzz_corpus_xds_framing() {
    replay("xds_framing");
}

#[test]
fn fuzz_corpus_sds() {
    replay("sds");
}

#[test]
fn fuzz_corpus_metrics_dedupe() {
    replay("metrics_dedupe");
}

#[test]
fn fuzz_corpus_dns_request() {
    replay("dns_request");
}

#[test]
fn fuzz_corpus_xds_authority() {
    replay("xds_authority");
}
