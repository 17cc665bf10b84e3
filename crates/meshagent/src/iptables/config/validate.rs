//! Names that reach rule text (users, groups, interfaces): their syntax, and resolving them on
//! this system before any rule is applied.

use super::*;

/// What a comma-separated name list holds; decides the syntax each entry must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameKind {
    /// `-u`: a uid, a uid range or a user name (`-m owner --uid-owner`, nft `meta skuid`).
    User,
    /// `-g` and the owner-group filters: a gid, a gid range or a group name.
    Group,
    /// `-c` / `-k`: a network interface name (`-i`/`-o`, nft `iifname`/`oifname`).
    Interface,
}

impl NameKind {
    fn expected(self) -> &'static str {
        match self {
            NameKind::User => {
                "expected a comma-separated list of numeric uids (0-4294967294), uid ranges \
                 (1000-2000) or user names (letters, digits, '.', '_', '-')"
            }
            NameKind::Group => {
                "expected a comma-separated list of numeric gids (0-4294967294), gid ranges \
                 (1000-2000) or group names (letters, digits, '.', '_', '-')"
            }
            NameKind::Interface => {
                "expected a comma-separated list of interface names: 1-15 bytes (IFNAMSIZ), \
                 printable ASCII without '/', ':', quotes, '\\' or '*', not \".\" or \"..\" \
                 (a trailing '+' after a prefix matches every interface with that prefix)"
            }
        }
    }
}

/// The largest valid uid/gid: `(uid_t)-1` means "no id" to the kernel, and iptables' owner
/// match rejects it ("Bad value for --uid-owner").
pub const MAX_ID: u32 = u32::MAX - 1;

/// Linux `IFNAMSIZ` (16) less the terminating NUL.
pub const MAX_IFNAME: usize = 15;

/// Plain decimal only: iptables reads the number with base 0, so `010` would be uid 8 there
/// and 10 in nft; a leading zero is rejected rather than meaning two things.
pub(super) fn numeric_id(s: &str) -> Option<u32> {
    if s.is_empty()
        || s.len() > 10
        || (s.len() > 1 && s.starts_with('0'))
        || !s.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    s.parse::<u64>()
        .ok()
        .filter(|n| *n <= u64::from(MAX_ID))
        .and_then(|n| u32::try_from(n).ok())
}

/// A uid/gid entry as written: a number, a numeric range `lo-hi` (what iptables' owner match
/// and nft's `meta skuid` both accept), or a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerId<'a> {
    Id(u32),
    Range(u32, u32),
    Name(&'a str),
}

impl<'a> OwnerId<'a> {
    /// Checks one entry. Names are resolved later, on the machine that applies the rules
    /// ([`Config::resolve_owners`]), as iptables and nft resolve them (`getpwnam`/`getgrnam`).
    ///
    /// Istio passes the text to iptables and nft as is: iptables rejects anything but a
    /// number, a range or an existing name when it applies the rules, while Istio's nft path
    /// pastes it into the `nft -f -` text, where `#` starts a comment and `;`, `{` or a space
    /// split the rule, so a rule could lose its verdict and still load. The syntax checked
    /// here (POSIX portable user names, as shadow's `useradd` allows, with Samba's trailing
    /// `$`) is stricter than Istio's, so nothing reaches either rule text that could change
    /// its meaning, dry run or not.
    pub fn parse(s: &'a str) -> Option<Self> {
        if let Some(n) = numeric_id(s) {
            return Some(OwnerId::Id(n));
        }
        if s.bytes().all(|b| b.is_ascii_digit()) {
            // All digits but out of range.
            return None;
        }
        if let Some((lo, hi)) = s.split_once('-')
            && let (Some(lo), Some(hi)) = (numeric_id(lo), numeric_id(hi))
        {
            return (lo <= hi).then_some(OwnerId::Range(lo, hi));
        }
        let body = s.strip_suffix('$').unwrap_or(s);
        let ok = !body.is_empty()
            && s.len() <= 256
            && !body.starts_with('-')
            && body
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        ok.then_some(OwnerId::Name(s))
    }
}

/// Checks one interface name against what Linux accepts (net/core/dev.c `dev_valid_name`:
/// 1..IFNAMSIZ-1 bytes, not "." or "..", no '/', ':' or whitespace) and what both rule texts
/// can carry. Stricter than the kernel, so each name means the same thing in iptables and
/// nft text: printable ASCII only (no control bytes, no UTF-8), no quotes or backslash
/// (iptables-restore reads them as quoting, and an nft quoted string cannot contain `"`),
/// and no `*` (a wildcard in nft, a literal in iptables). A trailing `+` is iptables'
/// prefix wildcard; the nft text spells it `*` as iptables-nft does. Istio's nft path pastes
/// the name unquoted, where `eth9#` silently loses the rule's verdict; here it is quoted.
/// A bare `+` (every interface: no capture at all) is refused: nft has no all-wildcard
/// name ("All-wildcard strings are not supported").
pub fn valid_interface(n: &str) -> bool {
    !n.is_empty()
        && n != "+"
        && n.len() <= MAX_IFNAME
        && n != "."
        && n != ".."
        && n.bytes().all(|b| {
            b.is_ascii_graphic() && !matches!(b, b'/' | b':' | b'"' | b'\'' | b'\\' | b'*')
        })
}

/// One entry of a list checked as `kind`.
pub fn valid_name(kind: NameKind, n: &str) -> bool {
    match kind {
        NameKind::User | NameKind::Group => OwnerId::parse(n).is_some(),
        NameKind::Interface => valid_interface(n),
    }
}

pub(super) fn describe(n: &str) -> String {
    if n.len() > 64 {
        let mut end = 64;
        while !n.is_char_boundary(end) {
            end -= 1;
        }
        format!("{:?}… ({} bytes)", &n[..end], n.len())
    } else {
        format!("{n:?}")
    }
}

/// Checks every entry of a parsed list; the error names the source, the whole value and the
/// offending entry.
pub(super) fn check_names(
    src: &str,
    raw: &str,
    names: &[String],
    kind: NameKind,
) -> Result<(), ConfigError> {
    for n in names {
        if !valid_name(kind, n) {
            let what = match kind {
                NameKind::User => "user",
                NameKind::Group => "group",
                NameKind::Interface => "interface name",
            };
            let mut why = format!("{} is not a valid {what}", describe(n));
            if kind == NameKind::Interface && n.len() > MAX_IFNAME {
                why.push_str(&format!(
                    " (longer than {MAX_IFNAME} bytes, the kernel's IFNAMSIZ)"
                ));
            }
            return Err(invalid(src, raw, &format!("{why}; {}", kind.expected())));
        }
    }
    Ok(())
}

pub(super) fn parse_names(src: &str, v: &str, kind: NameKind) -> Result<Vec<String>, ConfigError> {
    let names = split(v);
    check_names(src, v, &names, kind)?;
    Ok(names)
}

/// A user or group name that does not exist where the rules are applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{source_name}: {kind} {name:?} does not exist on this system ({lookup})")]
pub struct UnknownOwner {
    /// The flag (or env variable) the name came from.
    pub source_name: &'static str,
    /// "user" or "group".
    pub kind: &'static str,
    pub name: String,
    /// The lookup's error, or "no such entry".
    pub lookup: String,
}

impl Config {
    /// Every value that reaches rule text, checked as the parser checks it, with the flag as
    /// the source. [`Config::from_raw`] already checked what came from flags and env (naming
    /// the exact source); this guards configs built another way (tests, fuzzing) and the
    /// resolv.conf servers [`Config::detect`] adds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let lists: [(&str, &[String], NameKind); 4] = [
            ("--proxy-uid", &self.proxy_uid, NameKind::User),
            ("--proxy-gid", &self.proxy_gid, NameKind::Group),
            (
                "--istio-exclude-interfaces",
                &self.exclude_interfaces,
                NameKind::Interface,
            ),
            (
                "--kube-virt-interfaces",
                &self.kube_virt_interfaces,
                NameKind::Interface,
            ),
        ];
        for (src, names, kind) in lists {
            check_names(src, &names.join(","), names, kind)?;
        }
        match &self.owner_groups {
            OwnerGroups::All => {}
            OwnerGroups::Include(g) => check_names(
                "$ISTIO_OUTBOUND_OWNER_GROUPS",
                &g.join(","),
                g,
                NameKind::Group,
            )?,
            OwnerGroups::Exclude(g) => check_names(
                "$ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE",
                &g.join(","),
                g,
                NameKind::Group,
            )?,
        }
        // Spelled as resolv.conf wrote them, so only text that parses as an address.
        for (src, servers) in [
            ("resolv.conf nameserver", &self.dns_servers_v4),
            ("resolv.conf nameserver", &self.dns_servers_v6),
        ] {
            for s in servers {
                if s.parse::<IpAddr>().is_err() {
                    return Err(invalid(src, s, "expected an IP address"));
                }
            }
        }
        Ok(())
    }

    /// Resolves every user and group name, as iptables (`getpwnam`/`getgrnam` in libxt_owner)
    /// and nft (its uid/gid types) will when they load the rules, so a missing name is an
    /// error naming its flag before anything is changed, not a half-applied ruleset. Dry runs
    /// skip this (Istio prints whatever it would run).
    pub fn resolve_owners(&self) -> Result<(), UnknownOwner> {
        let groups: &[String] = match &self.owner_groups {
            OwnerGroups::All => &[],
            OwnerGroups::Include(g) | OwnerGroups::Exclude(g) => g,
        };
        let group_src = match &self.owner_groups {
            OwnerGroups::Exclude(_) => "$ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE",
            _ => "$ISTIO_OUTBOUND_OWNER_GROUPS",
        };
        let lists: [(&'static str, &[String], bool); 3] = [
            ("--proxy-uid", &self.proxy_uid, true),
            ("--proxy-gid", &self.proxy_gid, false),
            (group_src, groups, false),
        ];
        for (src, names, user) in lists {
            for n in names {
                let Some(OwnerId::Name(name)) = OwnerId::parse(n) else {
                    continue;
                };
                let found = if user {
                    nix::unistd::User::from_name(name).map(|u| u.is_some())
                } else {
                    nix::unistd::Group::from_name(name).map(|g| g.is_some())
                };
                let lookup = match found {
                    Ok(true) => continue,
                    Ok(false) => "no such entry".to_owned(),
                    Err(e) => e.to_string(),
                };
                return Err(UnknownOwner {
                    source_name: src,
                    kind: if user { "user" } else { "group" },
                    name: name.to_owned(),
                    lookup,
                });
            }
        }
        Ok(())
    }
}
