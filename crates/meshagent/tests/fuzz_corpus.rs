//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/*`, including every crash found
//! so far as a regression entry) through the same entry points the cargo-fuzz targets call
//! (`meshagent::fuzzing`), so `make test` catches a regression without nightly or
//! cargo-fuzz. `make fuzz` grows the corpus; this only replays it.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]

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
fn fuzz_corpus_nft_render() {
    replay("nft_render");
}

/// Runs one `nft_render` input with `nft -c -f -` required; a broken property names the input.
fn nft_render_required(name: &str, data: &[u8]) -> meshagent::fuzzing::NftRender {
    use meshagent::fuzzing::{NftCheck, nft_render_checked};
    std::panic::catch_unwind(|| nft_render_checked(data, NftCheck::Required)).unwrap_or_else(|e| {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        panic!(
            "nft_render input {name} ({:?}): {msg}",
            String::from_utf8_lossy(data)
        )
    })
}

/// The `nft_render` corpus through the real `nft -c -f -` (each in a fresh network
/// namespace; tests run as root with nft installed). Entries named `*_rejected` must be
/// refused before any rule text exists; every other entry must render and load.
#[test]
fn nft_render_corpus_loads_in_nft() {
    use meshagent::fuzzing::NftRender;
    let dir = corpus_dir().join("nft_render");
    let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.is_file())
        .collect();
    entries.sort();
    let (mut rendered, mut rejected) = (0, 0);
    for path in &entries {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("?");
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        match nft_render_required(name, &data) {
            NftRender::Rejected(why) => {
                assert!(
                    name.ends_with("_rejected"),
                    "corpus entry {name} was rejected: {why}"
                );
                rejected += 1;
            }
            NftRender::Rendered { nft_checked, .. } => {
                assert!(
                    !name.ends_with("_rejected"),
                    "corpus entry {name} rendered but is meant to be rejected"
                );
                assert!(nft_checked, "{name}: nft -c did not run");
                rendered += 1;
            }
        }
    }
    assert!(
        rendered >= 4 && rejected >= 4,
        "{rendered} rendered, {rejected} rejected"
    );
}

/// A fixed-seed xorshift generator: the same inputs on every run.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap_or(0)
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// A few hundred generated hostile configurations through the `nft_render` property, each
/// checked by the real `nft -c -f -`: values that reach rule text, with comment, statement,
/// set, quote, whitespace, escape and wildcard characters, nft keywords, overlong names and
/// out-of-range ids spliced in. Every input is either refused with an error naming its
/// source, or renders text in which every rule keeps its verdict and nft loads it.
#[test]
fn generated_hostile_configs_keep_every_verdict() {
    use meshagent::fuzzing::NftRender;
    let hostile = [
        "#",
        ";",
        "{",
        "}",
        "\\n",
        "\"",
        "'",
        " ",
        "\\t",
        "*",
        "/",
        ":",
        "..",
        ".",
        "+",
        "$",
        "-",
        "\\\\",
        "é",
        "0123456789abcdef",
        "counter",
        "return",
        "accept",
        "jump",
        "@s",
        ",",
        "!=",
        "\\0",
        "\\r",
        "010",
        "4294967295",
        "0x10",
    ];
    let users = [
        "1337",
        "0",
        "root",
        "1000-2000",
        "65534",
        "4294967294",
        "a.b_c-d",
    ];
    let nics = [
        "eth0", "veth+", "a.b", "x-y_z", "eth9#", "a;{b}", "return", "lo", "+",
    ];
    let fields: &[(&str, bool)] = &[
        ("-u ", false),
        ("-g ", false),
        ("PROXY_UID=", false),
        ("PROXY_GID=", false),
        ("@uid ", false),
        ("@gid ", false),
        ("ISTIO_OUTBOUND_OWNER_GROUPS=", false),
        ("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE=", false),
        ("@grp+ ", false),
        ("@grp- ", false),
        ("-c ", true),
        ("-k ", true),
        ("ISTIO_EXCLUDE_INTERFACES=", true),
        ("KUBE_VIRT_INTERFACES=", true),
        ("@nic ", true),
        ("@kvi ", true),
    ];
    let extras = [
        "-m TPROXY",
        "-b *",
        "-b 80,8080",
        "-i *",
        "-i 10.0.0.0/8,fd00::/8",
        "-x 192.168.0.0/16",
        "--redirect-dns",
        "--capture-all-dns",
        "--drop-invalid",
        "@ipv6",
        "@dns4 10.96.0.10",
        "@dns6 fd00::10",
        "-d 15090,15021",
        "-q 443",
        "-o 22",
        "-t 1337",
    ];
    let mut g = Gen(0x005e_ed0f_1571_0b1e);
    let (mut rendered, mut rejected) = (0, 0);
    for n in 0..400 {
        let mut input = String::from("--native-nftables\n");
        for _ in 0..g.below(4) {
            input.push_str(g.pick(&extras));
            input.push('\n');
        }
        for _ in 0..1 + g.below(3) {
            let (field, nic) = fields[g.below(fields.len())];
            let mut items = Vec::new();
            for _ in 0..1 + g.below(3) {
                let mut item = if nic { g.pick(&nics) } else { g.pick(&users) }.to_owned();
                // One item in four is spliced, so valid configs are rendered and loaded too.
                if g.below(4) == 0 {
                    let frag = g.pick(&hostile);
                    let mut at = g.below(item.len() + 1);
                    while !item.is_char_boundary(at) {
                        at -= 1;
                    }
                    item.insert_str(at, frag);
                }
                items.push(item);
            }
            input.push_str(field);
            input.push_str(&items.join(","));
            input.push('\n');
        }
        match nft_render_required(&format!("generated #{n}"), input.as_bytes()) {
            NftRender::Rejected(why) => {
                assert!(
                    why.contains("invalid value") || why.contains("does not exist"),
                    "generated #{n} ({input:?}): unclear error {why:?}"
                );
                rejected += 1;
            }
            NftRender::Rendered { nft_checked, .. } => {
                assert!(nft_checked);
                rendered += 1;
            }
        }
    }
    assert!(
        rendered >= 50 && rejected >= 50,
        "{rendered} rendered, {rejected} rejected: the generator no longer covers both"
    );
}

#[test]
fn fuzz_corpus_xds_authority() {
    replay("xds_authority");
}
