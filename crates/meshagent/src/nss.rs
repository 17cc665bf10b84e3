//! glibc's name service sources, pinned to the built-in ones when the agent is linked statically.
//!
//! Why: `make agent` links glibc into the agent (Makefile, `AGENT_STATIC`), so no loader and
//! no libc.so are mapped. In a static glibc (2.34 and later) the `files` and `dns` sources are
//! built in, but any other source `/etc/nsswitch.conf` names (`systemd`, `mdns4_minimal`,
//! `resolve`, `sss`, ...) is loaded by glibc's static `dlopen`, which maps a second libc.so, of
//! whatever version the image carries, into the process. With Debian 12's `libnss_systemd` that
//! crashed the process (SIGSEGV) on the first lookup of a user name not in `/etc/passwd`
//! (`istio-iptables` resolving `ENVOY_USER`). pilot-agent (Go, `CGO_ENABLED=0`) never loads an
//! NSS module either: `os/user` reads `/etc/passwd` and `/etc/group` itself, and Go's resolver
//! reads `/etc/hosts` and `resolv.conf` itself, in the order the `hosts:` line gives `files`
//! and `dns` (files first when the line names neither; Go's `net/conf.go` `hostLookupOrder`).
//! So a static agent configures glibc the same way before its first lookup: `hosts` from the
//! `files` and `dns` of that line, `passwd` and `group` from `files`.
//!
//! A dynamically linked agent (the debug builds, `make agent AGENT_STATIC=no`) keeps glibc's own
//! reading of nsswitch.conf: there, modules load through the real loader and work.

use std::path::Path;

/// Where glibc reads its sources.
const NSSWITCH: &str = "/etc/nsswitch.conf";
/// nsswitch.conf is a few hundred bytes; a larger one is not read.
const MAX_NSSWITCH: u64 = 64 * 1024;

/// The `hosts` sources a static agent uses: `files` and `dns` in the order the file's `hosts:`
/// line names them, `files dns` when it names neither (or there is no file).
pub fn hosts_sources(nsswitch: &str) -> String {
    let line = nsswitch
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter_map(|l| l.strip_prefix("hosts:"))
        .next_back();
    let mut kept: Vec<&str> = Vec::new();
    for source in line.unwrap_or_default().split_whitespace() {
        if matches!(source, "files" | "dns") && !kept.contains(&source) {
            kept.push(source);
        }
    }
    if kept.is_empty() {
        "files dns".to_owned()
    } else {
        kept.join(" ")
    }
}

/// Pins `hosts`, `passwd` and `group` to glibc's built-in sources when the process has no
/// dynamic loader (a static link); otherwise does nothing. Call it first in `main`, before any
/// thread or lookup.
pub fn pin_builtin_sources() {
    if !imp::is_static() {
        return;
    }
    let text = crate::fsio::read_bounded(Path::new(NSSWITCH), MAX_NSSWITCH)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let hosts = hosts_sources(&text);
    for (db, sources) in [
        ("hosts", hosts.as_str()),
        ("passwd", "files"),
        ("group", "files"),
    ] {
        if !imp::configure(db, sources) {
            // Only an out-of-memory or unknown database fails; glibc then reads nsswitch.conf.
            eprintln!("meshagent: could not set the {db} name service to \"{sources}\"");
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
mod imp {
    use std::ffi::{CString, c_char, c_int};

    unsafe extern "C" {
        /// glibc (`nss/nss_database.c`): sets a database's sources as a line of nsswitch.conf
        /// would, and keeps glibc from reading the file for it; exported (GLIBC_2.2.5) for
        /// static programs.
        fn __nss_configure_lookup(dbname: *const c_char, service_line: *const c_char) -> c_int;
    }

    /// No interpreter base in the auxiliary vector: the kernel started this process without a
    /// dynamic loader, i.e. it is statically linked.
    pub fn is_static() -> bool {
        // SAFETY: getauxval(3) reads the auxiliary vector the kernel put on the initial stack;
        // it takes an integer and returns an integer (0 for a missing entry).
        unsafe { libc::getauxval(libc::AT_BASE) == 0 }
    }

    pub fn configure(db: &str, sources: &str) -> bool {
        let (Ok(db), Ok(sources)) = (CString::new(db), CString::new(sources)) else {
            return false;
        };
        // SAFETY: both arguments are NUL-terminated strings that outlive the call; glibc copies
        // what it keeps (it parses the line into its own allocation under its lock).
        unsafe { __nss_configure_lookup(db.as_ptr(), sources.as_ptr()) == 0 }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub fn is_static() -> bool {
        false
    }
    pub fn configure(_db: &str, _sources: &str) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::hosts_sources;

    #[test]
    fn hosts_keeps_files_and_dns_in_the_lines_order() {
        assert_eq!(hosts_sources("hosts: files dns\n"), "files dns");
        assert_eq!(hosts_sources("hosts:  dns files\n"), "dns files");
        assert_eq!(
            hosts_sources(
                "passwd: files systemd\n# hosts: dns\nhosts: files mdns4_minimal [NOTFOUND=return] resolve dns myhostname # tail\n"
            ),
            "files dns"
        );
        assert_eq!(hosts_sources("hosts: dns\n"), "dns");
        assert_eq!(
            hosts_sources("hosts: resolve [!UNAVAIL=return] dns files\n"),
            "dns files"
        );
    }

    #[test]
    fn hosts_defaults_to_files_then_dns() {
        assert_eq!(hosts_sources(""), "files dns");
        assert_eq!(hosts_sources("passwd: files\n"), "files dns");
        assert_eq!(
            hosts_sources("hosts: mdns4_minimal myhostname\n"),
            "files dns"
        );
    }
}
