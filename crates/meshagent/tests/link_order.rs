//! The shipped agent's linker wrapper (`crates/meshagent/link/cc-ordered`, `make agent`) with
//! a small C program and the linker rustc uses (its self-contained `rust-lld`): an order file
//! whose names resolve places those functions first; one whose names are mostly gone (a
//! dependency bump renamed them) still links, without the layout, and says so.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use meshagent_testkit::workspace_root;

/// rustc's `gcc-ld` directory, where `-fuse-ld=lld` finds `rust-lld` as rustc passes it.
fn gcc_ld_dir() -> PathBuf {
    let out = Command::new("rustc")
        .args(["--print", "sysroot"])
        .output()
        .unwrap();
    assert!(out.status.success(), "rustc --print sysroot failed");
    let sysroot = String::from_utf8(out.stdout).unwrap();
    let host = Command::new("rustc").arg("-vV").output().unwrap();
    let host = String::from_utf8(host.stdout).unwrap();
    let triple = host
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .unwrap()
        .to_owned();
    PathBuf::from(sysroot.trim()).join(format!("lib/rustlib/{triple}/bin/gcc-ld"))
}

fn link(dir: &Path, order: &str) -> (Output, String) {
    std::fs::write(
        dir.join("a.c"),
        "int hot(void){return 1;}\nint cold(void){return 2;}\nint main(void){return hot()-1;}\n",
    )
    .unwrap();
    std::fs::write(dir.join("x.order"), order).unwrap();
    let status = dir.join("status");
    let _ = std::fs::remove_file(&status);
    let out = Command::new(workspace_root().join("crates/meshagent/link/cc-ordered"))
        .current_dir(dir)
        .env("MESHAGENT_ORDER_FILE", dir.join("x.order"))
        .env("MESHAGENT_ORDER_STATUS", &status)
        .arg(format!("-B{}", gcc_ld_dir().display()))
        .args(["-fuse-ld=lld", "-ffunction-sections", "a.c", "-o", "a"])
        .output()
        .unwrap();
    let said = std::fs::read_to_string(&status).unwrap_or_default();
    (out, said)
}

/// Function addresses in the linked program, by name.
fn addresses(dir: &Path) -> std::collections::HashMap<String, u64> {
    let out = Command::new("nm").arg(dir.join("a")).output().unwrap();
    assert!(out.status.success(), "nm failed");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let addr = u64::from_str_radix(f.next()?, 16).ok()?;
            let _kind = f.next()?;
            Some((f.next()?.to_owned(), addr))
        })
        .collect()
}

fn runs(dir: &Path) {
    let st = Command::new(dir.join("a")).status().unwrap();
    assert!(st.success(), "the linked program does not run: {st}");
}

/// Links with an order file naming two functions that both resolve, requires the link to
/// succeed, say so and run, and returns the program's function addresses.
fn link_both_resolved(order: &str) -> std::collections::HashMap<String, u64> {
    let dir = tempfile::tempdir().unwrap();
    let (out, said) = link(dir.path(), order);
    assert!(
        out.status.success(),
        "cc-ordered failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("2 functions of the 2 names"),
        "status: {said}"
    );
    runs(dir.path());
    addresses(dir.path())
}

#[test]
fn resolved_order_places_the_listed_functions_first() {
    let a = link_both_resolved("hot\nmain\n");
    // Source order is hot, cold, main; the layout moves main before cold.
    assert!(
        a["hot"] < a["cold"] && a["main"] < a["cold"],
        "not ordered: {a:?}"
    );
}

/// The functions are laid out in the order file's order, not in the order the compiler
/// emitted them: `orderfile.py` groups them by the agent's phases, and a phase's code pages
/// are released at its end (src/code_pages.rs), which frees only what its own stretch holds.
/// A stale entry (here LTO's `.<n>` suffix changed) keeps its place in that order.
#[test]
fn functions_are_laid_out_in_the_order_file_order() {
    for order in ["main\nhot\n", "main\nhot.7\n"] {
        let a = link_both_resolved(order);
        // Source order is hot, cold, main; the file asks for main, then hot.
        assert!(
            a["main"] < a["hot"] && a["hot"] < a["cold"],
            "not in the file's order ({order:?}): {a:?}"
        );
    }
}

#[test]
fn a_mostly_stale_order_file_links_without_the_layout_and_warns() {
    let dir = tempfile::tempdir().unwrap();
    let (out, said) = link(dir.path(), "gone1\ngone2\ngone3\nhot\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "a stale order file broke the link: {stderr}"
    );
    for text in [&*stderr, &*said] {
        assert!(
            text.contains("warning: only 1 functions of the 4 names")
                && text.contains("linked without the code layout"),
            "no warning: {text}"
        );
    }
    runs(dir.path());
}

/// A callgrind profile part as `make orderfile` leaves it: its number in the header and
/// the functions it saw run.
fn part(dir: &Path, file: &str, part: u32, fns: &[&str]) {
    let mut text = format!("version: 1\ncreator: callgrind\npart: {part}\n\nevents: Ir\n");
    for (i, f) in fns.iter().enumerate() {
        text.push_str(&format!("fn=({}) {f}\n0 1\n", i + 1));
    }
    std::fs::write(dir.join(file), text).unwrap();
}

/// `link/orderfile.py` lays the functions out by the phases of the sidecar agent they ran in,
/// from the parts callgrind dumps at each code-page release (part 1 start-up's first phase,
/// part 2 its second, later parts the steady state; the last part is the file without a
/// number): first and steady, first only, first and second, all three, second and steady,
/// second only, steady only. The code only other processes ran (a proxyless agent, whose
/// profile has fewer parts, or `istio-iptables`, one) follows, and what they ran does not
/// move a function the sidecar runs; callgrind's `(below main)` is `_start`; functions no
/// profile saw are not listed.
#[test]
fn the_order_file_is_laid_out_by_phase() {
    let dir = tempfile::tempdir().unwrap();
    let src = "int first(void){return 1;}\nint both(void){return 2;}\n\
               int second(void){return 3;}\nint stays(void){return 4;}\n\
               int idle(void){return 5;}\nint never(void){return 6;}\n\
               int init(void){return 7;}\n\
               int main(void){return 0;}\n";
    std::fs::write(dir.path().join("p.c"), src).unwrap();
    let out = Command::new("cc")
        .current_dir(dir.path())
        .args(["p.c", "-o", "p"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cg = dir.path().join("cg");
    std::fs::create_dir(&cg).unwrap();
    // One agent process in three parts, listed out of order on purpose.
    part(&cg, "cg.100", 3, &["stays", "idle", "main"]);
    part(&cg, "cg.100.1", 1, &["main", "first", "both"]);
    part(&cg, "cg.100.2", 2, &["both", "second", "stays", "main"]);
    // istio-iptables: one part, its whole run; `second` runs there at its start.
    part(&cg, "cg.200", 1, &["second", "init", "(below main)"]);
    let order = dir.path().join("agent.order");
    let out = Command::new("python3")
        .arg(workspace_root().join("crates/meshagent/link/orderfile.py"))
        .args([dir.path().join("p"), cg, order.clone()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "orderfile.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let names = std::fs::read_to_string(&order).unwrap();
    let names: Vec<&str> = names.lines().collect();
    assert_eq!(
        names,
        [
            "first", "both", "main", "stays", "second", "idle", "_start", "init"
        ],
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}
