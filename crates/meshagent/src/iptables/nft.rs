//! Native nftables ruleset (Istio tools/istio-nftables, `--native-nftables`).
//!
//! The same capture logic as [`super::rules`], written as nft rules in the `inet` tables
//! `istio-proxy-{nat,mangle,raw}`. Istio sends one knftables transaction to `nft -f -`:
//! per table `add table` + `flush table` (so every run is idempotent), the base and regular
//! chains that receive rules, then the rules, each with a `counter` (1.28+). An iptables
//! `-I chain N` becomes `insert rule … index N-1`, or `add rule` when the chain has fewer
//! than N rules.

use super::config::{
    Cidr, CidrSelection, Config, ConfigError, InterceptionMode, OwnerGroups, OwnerId, PortSelection,
};
use super::rules::{DNS_PORT, OUTBOUND_MARK, redirect_dns};

/// Istio's nft tables, in transaction order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NftTable {
    Nat,
    Mangle,
    Raw,
}

impl NftTable {
    pub const ALL: [NftTable; 3] = [NftTable::Nat, NftTable::Mangle, NftTable::Raw];

    /// `istio-proxy-nat` etc.
    pub fn name(self) -> &'static str {
        match self {
            NftTable::Nat => "istio-proxy-nat",
            NftTable::Mangle => "istio-proxy-mangle",
            NftTable::Raw => "istio-proxy-raw",
        }
    }

    /// Regular chains in declaration order (tools/istio-nftables/pkg/constants).
    fn regular_chains(self) -> &'static [&'static str] {
        match self {
            NftTable::Nat => &[
                "istio-inbound",
                "istio-redirect",
                "istio-in-redirect",
                "istio-output",
                "istio-output-dns",
            ],
            NftTable::Mangle => &[
                "istio-divert",
                "istio-tproxy",
                "istio-inbound",
                "istio-drop",
            ],
            NftTable::Raw => &["istio-inbound", "istio-output-dns"],
        }
    }

    /// Base chain declaration (hook, type, priority).
    fn base_chain(self, chain: &str) -> Option<String> {
        let (ty, prio) = match (self, chain) {
            (NftTable::Nat, "prerouting" | "output") => ("nat", -100),
            (NftTable::Mangle, "prerouting") => ("filter", -150),
            // A route chain re-routes a packet whose mark it changed (TPROXY marks).
            (NftTable::Mangle, "output") => ("route", -150),
            (NftTable::Raw, "prerouting" | "output") => ("filter", -300),
            _ => return None,
        };
        Some(format!("{{ type {ty} hook {chain} priority {prio} ; }}"))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct NftRule {
    table: NftTable,
    chain: &'static str,
    /// `None` = add; `Some(i)` = insert at 0-based index.
    index: Option<usize>,
    body: String,
}

struct Builder {
    ipv6: bool,
    rules: Vec<NftRule>,
}

impl Builder {
    fn count(&self, table: NftTable, chain: &str) -> usize {
        self.rules
            .iter()
            .filter(|r| r.table == table && r.chain == chain)
            .count()
    }
    fn add(&mut self, table: NftTable, chain: &'static str, body: String) {
        self.rules.push(NftRule {
            table,
            chain,
            index: None,
            body,
        });
    }
    fn add_v6(&mut self, table: NftTable, chain: &'static str, body: String) {
        if self.ipv6 {
            self.add(table, chain, body);
        }
    }
    /// iptables `-I chain pos` (1-based).
    fn insert(&mut self, table: NftTable, chain: &'static str, pos: usize, body: String) {
        let index = pos.saturating_sub(1);
        let index = (index < self.count(table, chain)).then_some(index);
        self.rules.push(NftRule {
            table,
            chain,
            index,
            body,
        });
    }
    /// One rule per enabled family: `f(ip, v4 loopback)` / `f(ip6, ::1/128)`.
    fn versioned(
        &mut self,
        table: NftTable,
        chain: &'static str,
        lo4: &str,
        f: impl Fn(&str, &str) -> String,
    ) {
        self.add(table, chain, f("ip", lo4));
        self.add_v6(table, chain, f("ip6", "::1/128"));
    }
}

/// An nft quoted string. Values are validated before they get here ([`Config::validate`]);
/// dropping the bytes that could end the string or the line keeps even an unvalidated value
/// inside its one token.
fn quoted(s: &str) -> String {
    let inner: String = s.chars().filter(|c| *c != '"' && !c.is_control()).collect();
    format!("\"{inner}\"")
}

/// Whether `s` can stand bare in nft text as Istio writes it (`oifname eth0`, `skgid java`):
/// an identifier nft's scanner reads as one string token, that is no keyword of the rule
/// grammar. Anything else is quoted: Istio's nft path pastes every name bare, where `#`
/// starts a comment, `;` ends the rule and a keyword such as `return` is no name at all, so
/// names Istio handles correctly keep Istio's exact text and the others keep their meaning.
fn bare(s: &str) -> bool {
    const KEYWORDS: &[&str] = &[
        "accept",
        "drop",
        "reject",
        "return",
        "jump",
        "goto",
        "continue",
        "queue",
        "counter",
        "redirect",
        "tproxy",
        "to",
        "meta",
        "mark",
        "ct",
        "state",
        "zone",
        "set",
        "ip",
        "ip6",
        "inet",
        "tcp",
        "udp",
        "dport",
        "sport",
        "saddr",
        "daddr",
        "iifname",
        "oifname",
        "skuid",
        "skgid",
        "l4proto",
        "log",
        "limit",
        "masquerade",
        "snat",
        "dnat",
        "notrack",
        "vmap",
        "map",
        "element",
        "table",
        "chain",
        "rule",
        "add",
        "insert",
        "delete",
        "flush",
        "type",
        "hook",
        "priority",
        "policy",
        "comment",
        "th",
        "icmp",
        "icmpv6",
        "ether",
        "vlan",
        "arp",
        "socket",
        "fib",
        "rt",
        "nat",
        "filter",
        "route",
        "any",
    ];
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        && !KEYWORDS.contains(&s)
}

/// An interface name for `iifname`/`oifname`: bare when [`bare`] allows (as Istio writes
/// it), else quoted. iptables' trailing `+` wildcard is nft's trailing `*`, as iptables-nft
/// translates it.
pub fn ifname(n: &str) -> String {
    match n.strip_suffix('+') {
        Some(prefix) => quoted(&format!("{prefix}*")),
        None if bare(n) => n.to_owned(),
        None => quoted(n),
    }
}

/// A uid/gid for `skuid`/`skgid`: numbers and ranges bare, names as [`ifname`] writes them
/// (nft resolves a quoted name like a bare one).
pub fn owner(id: &str) -> String {
    match OwnerId::parse(id) {
        Some(OwnerId::Id(n)) => n.to_string(),
        Some(OwnerId::Range(lo, hi)) => format!("{lo}-{hi}"),
        Some(OwnerId::Name(name)) if bare(name) => name.to_owned(),
        Some(OwnerId::Name(name)) => quoted(name),
        None => quoted(id),
    }
}

/// [`build`] after [`Config::validate`]: what the command runs.
pub fn try_build(cfg: &Config) -> Result<String, ConfigError> {
    cfg.validate()?;
    Ok(build(cfg))
}

fn family(c: &Cidr) -> &'static str {
    if c.is_v4() { "ip" } else { "ip6" }
}

/// Generates the transaction text for `cfg`, which must be valid ([`Config::validate`];
/// [`try_build`] checks).
pub fn build(cfg: &Config) -> String {
    use NftTable::{Mangle, Nat};
    let mut b = Builder {
        ipv6: cfg.enable_ipv6,
        rules: Vec::new(),
    };
    let tproxy = cfg.mode == InterceptionMode::Tproxy;
    let lo4 = cfg.loopback_cidr.to_string();
    let lo4 = lo4.as_str();
    let mark = cfg.tproxy_mark;
    let tunnel = cfg.inbound_tunnel_port;
    let dns = redirect_dns(cfg);
    let include: Vec<Cidr> = match &cfg.outbound_cidrs_include {
        CidrSelection::Cidrs(c) => c.clone(),
        _ => vec![],
    };
    let include_has_loopback = include.iter().any(Cidr::is_loopback);

    for nic in cfg.exclude_interfaces.iter().map(|n| ifname(n)) {
        b.add(Nat, "prerouting", format!("iifname {nic} counter return"));
        b.add(Nat, "output", format!("oifname {nic} counter return"));
    }
    if tproxy {
        for nic in cfg.exclude_interfaces.iter().map(|n| ifname(n)) {
            b.add(
                Mangle,
                "prerouting",
                format!("iifname {nic} counter return"),
            );
            b.add(Mangle, "output", format!("oifname {nic} counter return"));
        }
    }
    for nic in cfg.kube_virt_interfaces.iter().map(|n| ifname(n)) {
        b.insert(
            Nat,
            "prerouting",
            1,
            format!("iifname {nic} counter return"),
        );
    }
    if cfg.drop_invalid {
        // Istio's nft variant limits this to TCP (the iptables one does not).
        b.add(
            Mangle,
            "prerouting",
            "meta l4proto tcp ct state invalid counter jump istio-drop".into(),
        );
        b.add(Mangle, "istio-drop", "counter drop".into());
    }
    b.add(
        Nat,
        "istio-inbound",
        format!("meta l4proto tcp tcp dport {tunnel} counter return"),
    );
    b.add(
        Nat,
        "istio-redirect",
        format!("meta l4proto tcp counter redirect to :{}", cfg.proxy_port),
    );
    b.add(
        Nat,
        "istio-in-redirect",
        format!(
            "meta l4proto tcp counter redirect to :{}",
            cfg.inbound_capture_port
        ),
    );

    if cfg.inbound_ports != PortSelection::None {
        let table = if tproxy {
            b.add(
                Mangle,
                "istio-divert",
                format!("counter meta mark set {mark}"),
            );
            b.add(Mangle, "istio-divert", "counter accept".into());
            let port = cfg.inbound_capture_port;
            b.versioned(Mangle, "istio-tproxy", lo4, |ip, lo| {
                format!("meta l4proto tcp {ip} daddr != {lo} tproxy {ip} to :{port} meta mark set {mark} counter accept")
            });
            Mangle
        } else {
            Nat
        };
        b.add(
            table,
            "prerouting",
            "meta l4proto tcp counter jump istio-inbound".into(),
        );
        match &cfg.inbound_ports {
            PortSelection::All => {
                for p in &cfg.inbound_ports_exclude {
                    b.add(
                        table,
                        "istio-inbound",
                        format!("meta l4proto tcp tcp dport {p} counter return"),
                    );
                }
                if tproxy {
                    b.add(
                        Mangle,
                        "istio-inbound",
                        "meta l4proto tcp ct state related,established counter jump istio-divert"
                            .into(),
                    );
                    b.add(
                        Mangle,
                        "istio-inbound",
                        "meta l4proto tcp counter jump istio-tproxy".into(),
                    );
                } else {
                    b.add(
                        Nat,
                        "istio-inbound",
                        "meta l4proto tcp counter jump istio-in-redirect".into(),
                    );
                }
            }
            PortSelection::Ports(ports) => {
                for p in ports {
                    if tproxy {
                        b.add(
                            Mangle,
                            "istio-inbound",
                            format!("meta l4proto tcp ct state related,established tcp dport {p} counter jump istio-divert"),
                        );
                        b.add(
                            Mangle,
                            "istio-inbound",
                            format!("meta l4proto tcp tcp dport {p} counter jump istio-tproxy"),
                        );
                    } else {
                        b.add(
                            Nat,
                            "istio-inbound",
                            format!(
                                "meta l4proto tcp tcp dport {p} counter jump istio-in-redirect"
                            ),
                        );
                    }
                }
            }
            PortSelection::None => {}
        }
    }

    b.add(Nat, "output", "counter jump istio-output".into());
    for p in &cfg.outbound_ports_exclude {
        b.add(Nat, "istio-output", format!("tcp dport {p} counter return"));
        b.add(Nat, "istio-output", format!("udp dport {p} counter return"));
    }
    b.add(
        Nat,
        "istio-output",
        "oifname lo ip saddr 127.0.0.6/32 counter return".into(),
    );
    b.add_v6(
        Nat,
        "istio-output",
        "oifname lo ip6 saddr ::6/128 counter return".into(),
    );
    for (key, ids) in [("skuid", &cfg.proxy_uid), ("skgid", &cfg.proxy_gid)] {
        for id in ids.iter().map(|i| owner(i)) {
            // As in iptables, only the uid rule leaves port 53 out under DNS capture.
            let dport = if dns && key == "skuid" {
                format!("tcp dport != {{ 53, {tunnel} }}")
            } else {
                format!("tcp dport != {tunnel}")
            };
            b.versioned(Nat, "istio-output", lo4, |ip, lo| {
                format!("oifname lo meta l4proto tcp {ip} daddr != {lo} {dport} {key} {id} counter jump istio-in-redirect")
            });
            if !include_has_loopback {
                if dns {
                    b.add(Nat, "istio-output", format!("oifname lo meta l4proto tcp tcp dport != 53 {key} != {id} counter return"));
                } else {
                    b.add(
                        Nat,
                        "istio-output",
                        format!("oifname lo {key} != {id} counter return"),
                    );
                }
            }
            b.add(Nat, "istio-output", format!("{key} {id} counter return"));
        }
    }
    let group_filter = match &cfg.owner_groups {
        OwnerGroups::Include(groups) => Some(
            groups
                .iter()
                .map(|g| format!("skgid != {}", owner(g)))
                .collect::<Vec<_>>()
                .join(" "),
        ),
        _ => None,
    };
    match &cfg.owner_groups {
        OwnerGroups::All => {}
        OwnerGroups::Include(_) => {
            b.add(
                Nat,
                "istio-output",
                format!(
                    "{} counter return",
                    group_filter.clone().unwrap_or_default()
                ),
            );
        }
        OwnerGroups::Exclude(groups) => {
            for g in groups.iter().map(|g| owner(g)) {
                b.add(Nat, "istio-output", format!("skgid {g} counter return"));
            }
        }
    }
    if dns {
        setup_dns(&mut b, cfg);
    }
    b.versioned(Nat, "istio-output", lo4, |ip, lo| {
        format!("{ip} daddr {lo} counter return")
    });
    let ipv6 = b.ipv6;
    for c in cfg
        .outbound_cidrs_exclude
        .iter()
        .filter(|c| c.is_v4() || ipv6)
    {
        b.add(
            Nat,
            "istio-output",
            format!("{} daddr {c} counter return", family(c)),
        );
    }
    for p in &cfg.outbound_ports_include {
        b.add(
            Nat,
            "istio-output",
            format!("tcp dport {p} counter jump istio-redirect"),
        );
    }
    match &cfg.outbound_cidrs_include {
        CidrSelection::All => {
            b.add(Nat, "istio-output", "counter jump istio-redirect".into());
            for nic in cfg.kube_virt_interfaces.iter().map(|n| ifname(n)) {
                b.insert(
                    Nat,
                    "prerouting",
                    1,
                    format!("iifname {nic} counter jump istio-redirect"),
                );
            }
        }
        CidrSelection::Cidrs(cidrs) => {
            for c in cidrs.iter().filter(|c| c.is_v4() || ipv6) {
                let fam = family(c);
                for nic in cfg.kube_virt_interfaces.iter().map(|n| ifname(n)) {
                    b.insert(
                        Nat,
                        "prerouting",
                        1,
                        format!("iifname {nic} {fam} daddr {c} counter jump istio-redirect"),
                    );
                }
                b.add(
                    Nat,
                    "istio-output",
                    format!("{fam} daddr {c} counter jump istio-redirect"),
                );
            }
        }
        CidrSelection::None => {}
    }

    if tproxy {
        b.add(
            Mangle,
            "prerouting",
            format!("meta l4proto tcp mark {mark} counter ct mark set mark"),
        );
        b.add(
            Mangle,
            "output",
            format!("oifname lo meta l4proto tcp mark {mark} counter return"),
        );
        for (key, ids) in [("skuid", &cfg.proxy_uid), ("skgid", &cfg.proxy_gid)] {
            for id in ids.iter().map(|i| owner(i)) {
                b.versioned(Mangle, "output", lo4, |ip, lo| {
                    format!("oifname lo meta l4proto tcp {ip} daddr != {lo} {key} {id} counter meta mark set {OUTBOUND_MARK}")
                });
            }
        }
        b.add(
            Mangle,
            "output",
            format!("meta l4proto tcp ct mark {mark} counter meta mark set ct mark"),
        );
        b.insert(
            Mangle,
            "istio-inbound",
            1,
            format!("meta l4proto tcp mark {mark} counter return"),
        );
        b.insert(
            Mangle,
            "istio-inbound",
            2,
            "iifname lo meta l4proto tcp ip saddr 127.0.0.6/32 counter return".into(),
        );
        if b.ipv6 {
            b.insert(
                Mangle,
                "istio-inbound",
                2,
                "iifname lo meta l4proto tcp ip6 saddr ::6/128 counter return".into(),
            );
        }
        b.insert(
            Mangle,
            "istio-inbound",
            3,
            format!("iifname lo meta l4proto tcp mark != {OUTBOUND_MARK} counter return"),
        );
    }
    render(&b.rules)
}

/// DNS capture: nat redirects to the agent and raw conntrack zones (tools/istio-nftables
/// `SetupDNSRedir`).
fn setup_dns(b: &mut Builder, cfg: &Config) {
    use NftTable::{Nat, Raw};
    let all = cfg.capture_all_dns;
    let v6_on = b.ipv6;
    let servers: Vec<(&str, String)> = cfg
        .dns_servers_v4
        .iter()
        .map(|s| ("ip", format!("{s}/32")))
        .chain(
            cfg.dns_servers_v6
                .iter()
                .filter(|_| v6_on)
                .map(|s| ("ip6", format!("{s}/128"))),
        )
        .collect();
    b.add(Raw, "output", "counter jump istio-output-dns".into());
    if all || !servers.is_empty() {
        b.add(Nat, "istio-output", "counter jump istio-output-dns".into());
    }
    for proto in ["tcp", "udp"] {
        if all {
            // Istio names the protocol for TCP only (`istio-nftables` `SetupDNSRedir`).
            let l4 = if proto == "tcp" {
                "meta l4proto tcp "
            } else {
                ""
            };
            b.add(
                Nat,
                "istio-output-dns",
                format!("{l4}{proto} dport 53 counter redirect to :{DNS_PORT}"),
            );
        } else {
            for (fam, s) in &servers {
                b.add(
                    Nat,
                    "istio-output-dns",
                    format!("{fam} daddr {s} {proto} dport 53 counter redirect to :{DNS_PORT}"),
                );
            }
        }
    }
    for (key, ids) in [("skuid", &cfg.proxy_uid), ("skgid", &cfg.proxy_gid)] {
        for id in ids.iter().map(|i| owner(i)) {
            b.add(
                Raw,
                "istio-output-dns",
                format!("udp dport 53 meta {key} {id} counter ct zone set 1"),
            );
            b.add(
                Raw,
                "istio-output-dns",
                format!("udp sport {DNS_PORT} meta {key} {id} counter ct zone set 2"),
            );
        }
    }
    if all {
        b.add(Raw, "prerouting", "counter jump istio-inbound".into());
        b.add(
            Raw,
            "istio-output-dns",
            "udp dport 53 counter ct zone set 2".into(),
        );
        b.add(
            Raw,
            "istio-inbound",
            "udp sport 53 counter ct zone set 1".into(),
        );
    } else if !servers.is_empty() {
        b.add(Raw, "prerouting", "counter jump istio-inbound".into());
        for (fam, s) in &servers {
            b.add(
                Raw,
                "istio-output-dns",
                format!("udp dport 53 {fam} daddr {s} counter ct zone set 2"),
            );
            b.add(
                Raw,
                "istio-inbound",
                format!("udp sport 53 {fam} saddr {s} counter ct zone set 1"),
            );
        }
    }
}

fn render(rules: &[NftRule]) -> String {
    let mut blocks = Vec::new();
    for table in NftTable::ALL {
        let in_table: Vec<&NftRule> = rules.iter().filter(|r| r.table == table).collect();
        if in_table.is_empty() {
            continue;
        }
        let t = table.name();
        let mut out = format!("add table inet {t}\nflush table inet {t}\n");
        let used = |c: &str| in_table.iter().any(|r| r.chain == c);
        for base in ["prerouting", "output"] {
            if used(base) {
                let decl = table.base_chain(base).unwrap_or_default();
                out.push_str(&format!("add chain inet {t} {base} {decl}\n"));
            }
        }
        for chain in table.regular_chains() {
            if used(chain) {
                out.push_str(&format!("add chain inet {t} {chain}\n"));
            }
        }
        for r in in_table {
            match r.index {
                None => out.push_str(&format!("add rule inet {t} {} {}\n", r.chain, r.body)),
                Some(i) => out.push_str(&format!(
                    "insert rule inet {t} {} index {i} {}\n",
                    r.chain, r.body
                )),
            }
        }
        blocks.push(out);
    }
    blocks.join("\n")
}

/// `--cleanup-only`: Istio adds then deletes each table, which works whether or not it exists.
pub fn cleanup() -> String {
    NftTable::ALL
        .iter()
        .map(|t| format!("add table inet {0}\ndelete table inet {0}\n", t.name()))
        .collect()
}
