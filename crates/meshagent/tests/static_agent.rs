//! The shipped agent (`make agent`) is a static PIE, and its name lookups never load an NSS
//! module (src/nss.rs). A static glibc loads the modules nsswitch.conf names beyond `files` and
//! `dns` through its static `dlopen`, which crashed with Debian 12's `libnss_systemd` on the first
//! user name not in `/etc/passwd`; so each lookup here runs under an nsswitch.conf naming such
//! modules (bind-mounted over /etc/nsswitch.conf in a mount namespace of the test's own).
//!
//! Needs the shipped agent: `make image-test` runs it (`--ignored`) with MESHAGENT_BIN naming
//! target/dist/meshagent.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// nsswitch.conf as a systemd host has it (Debian's, with mDNS): every name not in the files
/// goes on to a module.
const HOSTILE_NSSWITCH: &str = "passwd: files systemd\ngroup: files systemd\nshadow: files\n\
hosts: files mdns4_minimal [NOTFOUND=return] resolve [!UNAVAIL=return] myhostname dns\n";

fn agent() -> PathBuf {
    let bin = std::env::var("MESHAGENT_BIN")
        .expect("MESHAGENT_BIN must name the shipped agent (make image-test sets it)");
    PathBuf::from(bin)
}

/// Program header types of an ELF64 little-endian file, and its type (`e_type`).
fn elf_program_headers(path: &Path) -> (u16, Vec<u32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..4], b"\x7fELF", "{} is not an ELF file", path.display());
    assert_eq!(b[4], 2, "not ELF64");
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let e_type = u16_at(16);
    let phoff = u64::from_le_bytes(b[32..40].try_into().unwrap()) as usize;
    let phentsize = u16_at(54) as usize;
    let phnum = u16_at(56) as usize;
    let types = (0..phnum)
        .map(|i| {
            let o = phoff + i * phentsize;
            u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
        })
        .collect();
    (e_type, types)
}

/// What one run under [`HOSTILE_NSSWITCH`] did: its output, and every mapping of a shared
/// object seen in the process while it ran (an NSS module, or the second libc.so a static
/// glibc's `dlopen` maps for one).
struct Run {
    out: Output,
    shared_objects: Vec<String>,
}

/// Runs the agent with `args` in a mount namespace whose /etc/nsswitch.conf is
/// [`HOSTILE_NSSWITCH`], with `env` added and the rest of the test's environment removed, and
/// reads its /proc/<pid>/maps until it exits (`unshare` and `sh` exec into the agent, so the
/// child's pid becomes the agent's; a module, once loaded, stays mapped until exit).
fn run_hostile(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let conf = dir.join("nsswitch.conf");
    std::fs::write(&conf, HOSTILE_NSSWITCH).unwrap();
    // Its real path: what /proc/<pid>/exe reads once the agent runs.
    let agent = std::fs::canonicalize(agent()).unwrap();
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount --bind "$0" /etc/nsswitch.conf && exec "$@""#)
        .arg(&conf)
        .arg(&agent)
        .args(args)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let maps = format!("/proc/{}/maps", child.id());
    let exe = format!("/proc/{}/exe", child.id());
    let mut shared_objects = Vec::new();
    while child.try_wait().unwrap().is_none() {
        // Only once the agent runs: `unshare` and `sh` before it map their own libc.
        if std::fs::read_link(&exe).ok().as_deref() != Some(agent.as_path()) {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        if let Ok(text) = std::fs::read_to_string(&maps) {
            for line in text.lines() {
                if line.contains(".so") && !shared_objects.iter().any(|l| l == line) {
                    shared_objects.push(line.to_owned());
                }
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Run {
        out: child.wait_with_output().unwrap(),
        shared_objects,
    }
}

fn show(o: &Output) -> String {
    format!(
        "status {:?} (signal {:?})\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        o.status.signal(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
#[ignore = "needs the shipped agent: make image-test"]
fn the_shipped_agent_is_a_static_pie() {
    const ET_DYN: u16 = 3;
    const PT_INTERP: u32 = 3;
    const PT_DYNAMIC: u32 = 2;
    let (e_type, types) = elf_program_headers(&agent());
    assert_eq!(e_type, ET_DYN, "not position-independent: e_type {e_type}");
    assert!(
        !types.contains(&PT_INTERP),
        "the agent names a dynamic loader (PT_INTERP): not linked statically"
    );
    // A static PIE relocates itself from its own dynamic section.
    assert!(types.contains(&PT_DYNAMIC));
}

#[test]
#[ignore = "needs the shipped agent: make image-test"]
fn a_user_name_missing_from_passwd_loads_no_nss_module() {
    let dir = tempfile::tempdir().unwrap();
    // ENVOY_USER is looked up by name (istio-iptables' default uid); a name no /etc/passwd has
    // goes on to the next source, `systemd`, in the hostile file.
    let run = run_hostile(
        dir.path(),
        &[
            "istio-iptables",
            "--dry-run",
            "-p",
            "15001",
            "-z",
            "15006",
            "-m",
            "REDIRECT",
            "-i",
            "*",
        ],
        &[("ENVOY_USER", "meshagent-no-such-user")],
    );
    let out = &run.out;
    assert!(out.status.success(), "{}", show(out));
    assert!(
        run.shared_objects.is_empty(),
        "shared objects mapped: {:?}",
        run.shared_objects
    );
    // Istio's default uid when the name does not resolve.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("--uid-owner 1337"),
        "the dry run does not exclude uid 1337\n{}",
        show(out)
    );
}

#[test]
#[ignore = "needs the shipped agent: make image-test"]
fn a_host_name_missing_from_hosts_loads_no_nss_module() {
    let dir = tempfile::tempdir().unwrap();
    // `.invalid` never resolves (RFC 6761); `wait` resolves the URL's host before each attempt,
    // through getaddrinfo, and gives up after its timeout with exit status 1.
    let run = run_hostile(
        dir.path(),
        &[
            "wait",
            "--url",
            "http://meshagent-no-such-host.invalid:15021/healthz/ready",
            "--timeoutSeconds",
            "1",
            "--periodMillis",
            "100",
        ],
        &[],
    );
    let out = &run.out;
    assert_eq!(out.status.signal(), None, "{}", show(out));
    assert_eq!(out.status.code(), Some(1), "{}", show(out));
    // A static glibc reading this nsswitch.conf loads `libnss_mdns4_minimal` (and a second
    // libc.so for it) for a name /etc/hosts does not have.
    assert!(
        run.shared_objects.is_empty(),
        "shared objects mapped: {:?}",
        run.shared_objects
    );
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        all.contains("meshagent-no-such-host.invalid"),
        "the failure does not name the host\n{}",
        show(out)
    );
}
