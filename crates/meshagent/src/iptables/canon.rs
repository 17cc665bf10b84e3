//! A canonical form of one iptables rule, so a rule as we write it and the same rule as
//! `iptables-save` prints it compare equal.
//!
//! `iptables-save` reorders matches (`-o lo ! -d X` → `! -d X -o lo`), adds implicit
//! `-m tcp`/`-m udp`, prints marks in hex (`--mark 1337` → `--mark 0x539`, `--set-mark 1338`
//! → `--set-xmark 0x53a/0xffffffff`), adds defaults (`--on-ip 0.0.0.0`, CONNMARK masks),
//! spells `--to-port` as `--to-ports`, prints owners as numbers and IPv6 addresses in their
//! canonical text. The canonical form undoes all of that and ignores token order (a rule's
//! tokens as a sorted multiset), which is exact enough to tell Istio's rules apart.

use std::net::IpAddr;

/// The canonical form of a rule spec (the part after `-A CHAIN`).
pub fn canon(tokens: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        let t = tokens[i];
        let next = tokens.get(i + 1).copied();
        match (t, next) {
            // Implicit protocol matches that iptables-save adds.
            ("-m", Some("tcp" | "udp")) => {
                i += 2;
                continue;
            }
            // Defaults iptables-save prints.
            ("--on-ip", Some("0.0.0.0" | "::")) | ("--nfmask" | "--ctmask", Some("0xffffffff")) => {
                i += 2;
                continue;
            }
            ("--to-port", _) => out.push("--to-ports".to_owned()),
            ("--set-mark", Some(v)) => {
                out.push("--set-xmark".to_owned());
                out.push(format!("{}/0xffffffff", hex(v)));
                i += 2;
                continue;
            }
            ("--mark" | "--tproxy-mark", Some(v)) => {
                out.push(t.to_owned());
                out.push(match v.split_once('/') {
                    Some((m, mask)) => format!("{}/{}", hex(m), hex(mask)),
                    None => hex(v),
                });
                i += 2;
                continue;
            }
            ("--uid-owner", Some(v)) => {
                out.push(t.to_owned());
                out.push(owner_id(v, false));
                i += 2;
                continue;
            }
            ("--gid-owner", Some(v)) => {
                out.push(t.to_owned());
                out.push(owner_id(v, true));
                i += 2;
                continue;
            }
            ("-d" | "-s", Some(v)) => {
                out.push(t.to_owned());
                out.push(cidr(v));
                i += 2;
                continue;
            }
            _ => out.push(t.to_owned()),
        }
        i += 1;
    }
    out.sort();
    out
}

/// `1337` → `0x539`; hex stays hex (lower case).
fn hex(v: &str) -> String {
    let n = match v.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => v.parse::<u64>().ok(),
    };
    n.map_or_else(|| v.to_owned(), |n| format!("{n:#x}"))
}

/// Owner names as iptables-save prints them: numbers.
fn owner_id(v: &str, group: bool) -> String {
    if v.bytes().all(|b| b.is_ascii_digit()) {
        return v.to_owned();
    }
    let id = if group {
        nix::unistd::Group::from_name(v)
            .ok()
            .flatten()
            .map(|g| g.gid.as_raw())
    } else {
        nix::unistd::User::from_name(v)
            .ok()
            .flatten()
            .map(|u| u.uid.as_raw())
    };
    id.map_or_else(|| v.to_owned(), |n| n.to_string())
}

/// Addresses in canonical text, `/32` or `/128` added as iptables-save does.
fn cidr(v: &str) -> String {
    let (addr, len) = match v.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (v, None),
    };
    match addr.parse::<IpAddr>() {
        Ok(ip) => {
            let max = if ip.is_ipv4() { "32" } else { "128" };
            format!("{ip}/{}", len.unwrap_or(max))
        }
        Err(_) => v.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::canon;

    fn c(s: &str) -> Vec<String> {
        canon(&s.split_whitespace().collect::<Vec<_>>())
    }

    #[test]
    fn planned_and_saved_spellings_match() {
        // Pairs of (what we write, what iptables-save 1.8.9 prints).
        let pairs = [
            (
                "-o lo ! -d 127.0.0.1/32 -p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT",
                "! -d 127.0.0.1/32 -o lo -p tcp -m tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT",
            ),
            (
                "-o lo -s 127.0.0.6/32 -j RETURN",
                "-s 127.0.0.6/32 -o lo -j RETURN",
            ),
            (
                "-p udp --dport 53 -d 127.0.0.53/32 -j REDIRECT --to-port 15053",
                "-d 127.0.0.53/32 -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053",
            ),
            (
                "-j MARK --set-mark 1337",
                "-j MARK --set-xmark 0x539/0xffffffff",
            ),
            (
                "! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 1337/0xffffffff --on-port 15006",
                "! -d 127.0.0.1/32 -p tcp -j TPROXY --on-port 15006 --on-ip 0.0.0.0 --tproxy-mark 0x539/0xffffffff",
            ),
            (
                "-p tcp -m mark --mark 1337 -j CONNMARK --save-mark",
                "-p tcp -m mark --mark 0x539 -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff",
            ),
            (
                "-p tcp --dport 53 -d ::127.0.0.53/128 -j REDIRECT --to-ports 15053",
                "-d ::7f00:35/128 -p tcp -m tcp --dport 53 -j REDIRECT --to-ports 15053",
            ),
        ];
        for (ours, saved) in pairs {
            assert_eq!(c(ours), c(saved), "{ours}");
        }
        assert_ne!(
            c("-p tcp --dport 8080 -j ISTIO_IN_REDIRECT"),
            c("-p tcp -j ISTIO_IN_REDIRECT")
        );
    }
}
