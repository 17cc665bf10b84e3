//! The iptables ruleset as plain data, and its `iptables-restore` text.
//!
//! Mirrors Istio tools/istio-iptables/pkg/capture/run.go `IptablesConfigurator.Run` and the
//! rule builder (tools/istio-iptables/pkg/builder): rules are appended in generation order
//! per family; the restore text has one block per table (mangle, nat, raw), each with `-N`
//! for the Istio chains in order of first use, then the `-A`/`-I` lines, then `COMMIT`.

use super::config::{CidrSelection, Config, InterceptionMode, OwnerGroups, PortSelection};

/// Tables in the order Istio's builder emits them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    Mangle,
    Nat,
    Raw,
}

impl Table {
    pub const ALL: [Table; 3] = [Table::Mangle, Table::Nat, Table::Raw];

    pub fn name(self) -> &'static str {
        match self {
            Table::Mangle => "mangle",
            Table::Nat => "nat",
            Table::Raw => "raw",
        }
    }
}

/// Chains Istio creates (tools/istio-iptables/pkg/constants).
pub const ISTIO_INBOUND: &str = "ISTIO_INBOUND";
pub const ISTIO_REDIRECT: &str = "ISTIO_REDIRECT";
pub const ISTIO_IN_REDIRECT: &str = "ISTIO_IN_REDIRECT";
pub const ISTIO_OUTPUT: &str = "ISTIO_OUTPUT";
pub const ISTIO_OUTPUT_DNS: &str = "ISTIO_OUTPUT_DNS";
pub const ISTIO_DIVERT: &str = "ISTIO_DIVERT";
pub const ISTIO_TPROXY: &str = "ISTIO_TPROXY";
pub const ISTIO_DROP: &str = "ISTIO_DROP";
/// The agent's DNS listener (constants `IstioAgentDNSListenerPort`).
pub const DNS_PORT: &str = "15053";
/// Mark of Envoy's own outbound-to-inbound traffic in TPROXY mode (constants `OutboundMark`).
pub const OUTBOUND_MARK: &str = "1338";

/// Kernel-defined chains: never created or deleted by us.
pub fn is_builtin(chain: &str) -> bool {
    matches!(
        chain,
        "PREROUTING" | "INPUT" | "FORWARD" | "OUTPUT" | "POSTROUTING"
    )
}

/// Append or insert at a 1-based position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Append,
    Insert(u32),
}

/// One rule of one family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub table: Table,
    pub chain: String,
    pub op: Op,
    pub args: Vec<String>,
}

impl Rule {
    /// The `-A CHAIN …` / `-I CHAIN N …` line.
    pub fn line(&self) -> String {
        let head = match self.op {
            Op::Append => format!("-A {}", self.chain),
            Op::Insert(n) => format!("-I {} {}", self.chain, n),
        };
        if self.args.is_empty() {
            head
        } else {
            format!("{head} {}", self.args.join(" "))
        }
    }

    /// The `-j` target.
    pub fn target(&self) -> Option<&str> {
        self.args
            .iter()
            .position(|a| a == "-j")
            .and_then(|i| self.args.get(i + 1))
            .map(String::as_str)
    }
}

/// Both families' rules. v6 rules are generated only when IPv6 is enabled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleSet {
    pub v4: Vec<Rule>,
    pub v6: Vec<Rule>,
}

/// Placeholder replaced per family by [`Builder::versioned`] (builder `IPVersionSpecific`).
const V: &str = "\u{0}ver";

struct Builder {
    ipv6: bool,
    rules: RuleSet,
}

fn strs(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| (*s).to_owned()).collect()
}

/// One of [`Builder::append_v4`] / [`Builder::append_v6`], to walk both families alike.
type AppendFamily = fn(&mut Builder, Table, &str, &[&str]);

impl Builder {
    fn push(&mut self, v4: bool, v6: bool, table: Table, chain: &str, op: Op, args: Vec<String>) {
        let rule = Rule {
            table,
            chain: chain.to_owned(),
            op,
            args,
        };
        if v6 && self.ipv6 {
            self.rules.v6.push(rule.clone());
        }
        if v4 {
            self.rules.v4.push(rule);
        }
    }
    fn append(&mut self, table: Table, chain: &str, args: &[&str]) {
        self.push(true, true, table, chain, Op::Append, strs(args));
    }
    fn append_v4(&mut self, table: Table, chain: &str, args: &[&str]) {
        self.push(true, false, table, chain, Op::Append, strs(args));
    }
    fn append_v6(&mut self, table: Table, chain: &str, args: &[&str]) {
        self.push(false, true, table, chain, Op::Append, strs(args));
    }
    fn insert(&mut self, v4: bool, v6: bool, table: Table, chain: &str, pos: u32, args: &[&str]) {
        self.push(v4, v6, table, chain, Op::Insert(pos), strs(args));
    }
    /// builder `AppendVersionedRule`: `V` becomes `v4`/`v6` per family.
    fn versioned(&mut self, v4: &str, v6: &str, table: Table, chain: &str, args: &[&str]) {
        let sub = |val: &str| {
            args.iter()
                .map(|a| {
                    if *a == V {
                        val.to_owned()
                    } else {
                        (*a).to_owned()
                    }
                })
                .collect()
        };
        self.push(true, false, table, chain, Op::Append, sub(v4));
        self.push(false, true, table, chain, Op::Append, sub(v6));
    }
}

/// Generates Istio's ruleset for `cfg` (capture/run.go `Run`, in its order).
pub fn build(cfg: &Config) -> RuleSet {
    use Table::{Mangle, Nat};
    let mut b = Builder {
        ipv6: cfg.enable_ipv6,
        rules: RuleSet::default(),
    };
    let tproxy = cfg.mode == InterceptionMode::Tproxy;
    let lo4 = cfg.loopback_cidr.to_string();
    let lo4 = lo4.as_str();
    let lo6 = "::1/128";
    let proxy_port = cfg.proxy_port.to_string();
    let capture_port = cfg.inbound_capture_port.to_string();
    let tunnel = cfg.inbound_tunnel_port.to_string();
    let mark = cfg.tproxy_mark.to_string();
    let (include_v4, include_v6) = split_cidrs(&cfg.outbound_cidrs_include);
    let include_has_loopback = include_v4
        .iter()
        .chain(&include_v6)
        .any(|c| c.is_loopback());
    let dns = redirect_dns(cfg);

    // Excluded interfaces: nothing in or out of them is captured (`shortCircuitExcludeInterfaces`).
    for nic in &cfg.exclude_interfaces {
        b.append(Nat, "PREROUTING", &["-i", nic, "-j", "RETURN"]);
        b.append(Nat, "OUTPUT", &["-o", nic, "-j", "RETURN"]);
    }
    if tproxy {
        for nic in &cfg.exclude_interfaces {
            b.append(Mangle, "PREROUTING", &["-i", nic, "-j", "RETURN"]);
            b.append(Mangle, "OUTPUT", &["-o", nic, "-j", "RETURN"]);
        }
    }
    // VM-in-pod interfaces are not inbound (`shortCircuitKubeInternalInterface`).
    for nic in &cfg.kube_virt_interfaces {
        b.insert(
            true,
            true,
            Nat,
            "PREROUTING",
            1,
            &["-i", nic, "-j", "RETURN"],
        );
    }
    if cfg.drop_invalid {
        b.append(
            Mangle,
            "PREROUTING",
            &["-m", "conntrack", "--ctstate", "INVALID", "-j", ISTIO_DROP],
        );
        b.append(Mangle, ISTIO_DROP, &["-j", "DROP"]);
    }
    // The HBONE tunnel port is never captured.
    b.append(
        Nat,
        ISTIO_INBOUND,
        &["-p", "tcp", "--dport", &tunnel, "-j", "RETURN"],
    );
    b.append(
        Nat,
        ISTIO_REDIRECT,
        &["-p", "tcp", "-j", "REDIRECT", "--to-ports", &proxy_port],
    );
    b.append(
        Nat,
        ISTIO_IN_REDIRECT,
        &["-p", "tcp", "-j", "REDIRECT", "--to-ports", &capture_port],
    );

    // Inbound (`handleInboundPortsInclude`).
    if cfg.inbound_ports != PortSelection::None {
        let table = if tproxy {
            b.append(Mangle, ISTIO_DIVERT, &["-j", "MARK", "--set-mark", &mark]);
            b.append(Mangle, ISTIO_DIVERT, &["-j", "ACCEPT"]);
            let tmark = format!("{mark}/0xffffffff");
            b.versioned(
                lo4,
                lo6,
                Mangle,
                ISTIO_TPROXY,
                &[
                    "!",
                    "-d",
                    V,
                    "-p",
                    "tcp",
                    "-j",
                    "TPROXY",
                    "--tproxy-mark",
                    &tmark,
                    "--on-port",
                    &capture_port,
                ],
            );
            Mangle
        } else {
            Nat
        };
        b.append(table, "PREROUTING", &["-p", "tcp", "-j", ISTIO_INBOUND]);
        match &cfg.inbound_ports {
            PortSelection::All => {
                for p in &cfg.inbound_ports_exclude {
                    b.append(
                        table,
                        ISTIO_INBOUND,
                        &["-p", "tcp", "--dport", &p.to_string(), "-j", "RETURN"],
                    );
                }
                if tproxy {
                    b.append(
                        Mangle,
                        ISTIO_INBOUND,
                        &[
                            "-p",
                            "tcp",
                            "-m",
                            "conntrack",
                            "--ctstate",
                            "RELATED,ESTABLISHED",
                            "-j",
                            ISTIO_DIVERT,
                        ],
                    );
                    b.append(Mangle, ISTIO_INBOUND, &["-p", "tcp", "-j", ISTIO_TPROXY]);
                } else {
                    b.append(Nat, ISTIO_INBOUND, &["-p", "tcp", "-j", ISTIO_IN_REDIRECT]);
                }
            }
            PortSelection::Ports(ports) => {
                for p in ports {
                    let p = p.to_string();
                    if tproxy {
                        b.append(
                            Mangle,
                            ISTIO_INBOUND,
                            &[
                                "-p",
                                "tcp",
                                "--dport",
                                &p,
                                "-m",
                                "conntrack",
                                "--ctstate",
                                "RELATED,ESTABLISHED",
                                "-j",
                                ISTIO_DIVERT,
                            ],
                        );
                        b.append(
                            Mangle,
                            ISTIO_INBOUND,
                            &["-p", "tcp", "--dport", &p, "-j", ISTIO_TPROXY],
                        );
                    } else {
                        b.append(
                            Nat,
                            ISTIO_INBOUND,
                            &["-p", "tcp", "--dport", &p, "-j", ISTIO_IN_REDIRECT],
                        );
                    }
                }
            }
            PortSelection::None => {}
        }
    }

    // Outbound.
    b.append(Nat, "OUTPUT", &["-j", ISTIO_OUTPUT]);
    for p in &cfg.outbound_ports_exclude {
        let p = p.to_string();
        b.append(
            Nat,
            ISTIO_OUTPUT,
            &["-p", "tcp", "--dport", &p, "-j", "RETURN"],
        );
        b.append(
            Nat,
            ISTIO_OUTPUT,
            &["-p", "udp", "--dport", &p, "-j", "RETURN"],
        );
    }
    // Envoy's inbound passthrough binds 127.0.0.6 / ::6.
    b.versioned(
        "127.0.0.6/32",
        "::6/128",
        Nat,
        ISTIO_OUTPUT,
        &["-o", "lo", "-s", V, "-j", "RETURN"],
    );
    let dports = format!("53,{tunnel}");
    // Envoy calling the app through a VIP goes back through Envoy inbound. With DNS capture,
    // port 53 is left out of the uid rule so the agent reaches its upstream resolver
    // directly; Istio keeps `! --dport <tunnel>` in the gid rule even then.
    let uid_ports: &[&str] = if dns {
        &["-m", "multiport", "!", "--dports", &dports]
    } else {
        &["!", "--dport", &tunnel]
    };
    let gid_ports: &[&str] = &["!", "--dport", &tunnel];
    let owners = [
        ("--uid-owner", &cfg.proxy_uid, uid_ports),
        ("--gid-owner", &cfg.proxy_gid, gid_ports),
    ];
    for (flag, ids, ports) in owners {
        for id in ids {
            let mut redirect = vec!["-o", "lo", "!", "-d", V, "-p", "tcp"];
            redirect.extend_from_slice(ports);
            redirect.extend_from_slice(&["-m", "owner", flag, id, "-j", ISTIO_IN_REDIRECT]);
            b.versioned(lo4, lo6, Nat, ISTIO_OUTPUT, &redirect);
            owner_loopback_return(&mut b, flag, id, dns, include_has_loopback);
            b.append(
                Nat,
                ISTIO_OUTPUT,
                &["-m", "owner", flag, id, "-j", "RETURN"],
            );
        }
    }
    // Owner-group filter (`handleCaptureByOwnerGroup`).
    let group_filter: Option<Vec<String>> = match &cfg.owner_groups {
        OwnerGroups::All => None,
        OwnerGroups::Include(groups) => {
            let mut m = Vec::new();
            for g in groups {
                m.extend(strs(&["-m", "owner", "!", "--gid-owner", g]));
            }
            Some(m)
        }
        OwnerGroups::Exclude(_) => None,
    };
    match &cfg.owner_groups {
        OwnerGroups::All => {}
        OwnerGroups::Include(_) => {
            let mut args: Vec<String> = group_filter.clone().unwrap_or_default();
            args.extend(strs(&["-j", "RETURN"]));
            b.push(true, true, Nat, ISTIO_OUTPUT, Op::Append, args);
        }
        OwnerGroups::Exclude(groups) => {
            for g in groups {
                b.append(
                    Nat,
                    ISTIO_OUTPUT,
                    &["-m", "owner", "--gid-owner", g, "-j", "RETURN"],
                );
            }
        }
    }
    if dns {
        setup_dns(&mut b, cfg);
    }
    // Envoy-aware apps and container-to-container traffic use localhost.
    b.versioned(lo4, lo6, Nat, ISTIO_OUTPUT, &["-d", V, "-j", "RETURN"]);
    for c in cfg.outbound_cidrs_exclude.iter().filter(|c| c.is_v4()) {
        b.append_v4(Nat, ISTIO_OUTPUT, &["-d", &c.to_string(), "-j", "RETURN"]);
    }
    for c in cfg.outbound_cidrs_exclude.iter().filter(|c| !c.is_v4()) {
        b.append_v6(Nat, ISTIO_OUTPUT, &["-d", &c.to_string(), "-j", "RETURN"]);
    }
    for p in &cfg.outbound_ports_include {
        b.append(
            Nat,
            ISTIO_OUTPUT,
            &["-p", "tcp", "--dport", &p.to_string(), "-j", ISTIO_REDIRECT],
        );
    }
    outbound_include(&mut b, cfg, true, &include_v4);
    outbound_include(&mut b, cfg, false, &include_v6);

    if tproxy {
        // Keep the mark Envoy's original_src listener filter sets on the connection.
        b.append(
            Mangle,
            "PREROUTING",
            &[
                "-p",
                "tcp",
                "-m",
                "mark",
                "--mark",
                &mark,
                "-j",
                "CONNMARK",
                "--save-mark",
            ],
        );
        b.append(
            Mangle,
            "OUTPUT",
            &[
                "-p", "tcp", "-o", "lo", "-m", "mark", "--mark", &mark, "-j", "RETURN",
            ],
        );
        for (flag, ids) in [
            ("--uid-owner", &cfg.proxy_uid),
            ("--gid-owner", &cfg.proxy_gid),
        ] {
            for id in ids {
                b.versioned(
                    lo4,
                    lo6,
                    Mangle,
                    "OUTPUT",
                    &[
                        "!",
                        "-d",
                        V,
                        "-p",
                        "tcp",
                        "-o",
                        "lo",
                        "-m",
                        "owner",
                        flag,
                        id,
                        "-j",
                        "MARK",
                        "--set-mark",
                        OUTBOUND_MARK,
                    ],
                );
            }
        }
        b.append(
            Mangle,
            "OUTPUT",
            &[
                "-p",
                "tcp",
                "-m",
                "connmark",
                "--mark",
                &mark,
                "-j",
                "CONNMARK",
                "--restore-mark",
            ],
        );
        b.insert(
            true,
            true,
            Mangle,
            ISTIO_INBOUND,
            1,
            &["-p", "tcp", "-m", "mark", "--mark", &mark, "-j", "RETURN"],
        );
        b.insert(
            true,
            false,
            Mangle,
            ISTIO_INBOUND,
            2,
            &[
                "-p",
                "tcp",
                "-s",
                "127.0.0.6/32",
                "-i",
                "lo",
                "-j",
                "RETURN",
            ],
        );
        b.insert(
            false,
            true,
            Mangle,
            ISTIO_INBOUND,
            2,
            &["-p", "tcp", "-s", "::6/128", "-i", "lo", "-j", "RETURN"],
        );
        b.insert(
            true,
            true,
            Mangle,
            ISTIO_INBOUND,
            3,
            &[
                "-p",
                "tcp",
                "-i",
                "lo",
                "-m",
                "mark",
                "!",
                "--mark",
                OUTBOUND_MARK,
                "-j",
                "RETURN",
            ],
        );
    }
    b.rules
}

/// App-to-itself over lo is not captured, unless an include CIDR is loopback.
fn owner_loopback_return(
    b: &mut Builder,
    flag: &str,
    id: &str,
    dns: bool,
    include_has_loopback: bool,
) {
    if include_has_loopback {
        return;
    }
    if dns {
        // A DNS server on localhost must still be captured over TCP.
        b.append(
            Table::Nat,
            ISTIO_OUTPUT,
            &[
                "-o", "lo", "-p", "tcp", "!", "--dport", "53", "-m", "owner", "!", flag, id, "-j",
                "RETURN",
            ],
        );
    } else {
        b.append(
            Table::Nat,
            ISTIO_OUTPUT,
            &["-o", "lo", "-m", "owner", "!", flag, id, "-j", "RETURN"],
        );
    }
}

/// Whether DNS rules are generated: capture-all, or resolv.conf servers to capture (capture/run.go
/// warns "REDIRECT_DNS is set, but CAPTURE_ALL_DNS is false, and no DNS servers provided").
pub fn redirect_dns(cfg: &Config) -> bool {
    cfg.redirect_dns
        && (cfg.capture_all_dns || !cfg.dns_servers_v4.is_empty() || !cfg.dns_servers_v6.is_empty())
}

fn split_cidrs(sel: &CidrSelection) -> (Vec<super::config::Cidr>, Vec<super::config::Cidr>) {
    match sel {
        CidrSelection::Cidrs(c) => (
            c.iter().copied().filter(|c| c.is_v4()).collect(),
            c.iter().copied().filter(|c| !c.is_v4()).collect(),
        ),
        _ => (vec![], vec![]),
    }
}

/// `handleOutboundIncludeRules` for one family.
fn outbound_include(b: &mut Builder, cfg: &Config, v4: bool, cidrs: &[super::config::Cidr]) {
    let (a4, a6) = (v4, !v4);
    match &cfg.outbound_cidrs_include {
        CidrSelection::All => {
            b.push(
                a4,
                a6,
                Table::Nat,
                ISTIO_OUTPUT,
                Op::Append,
                strs(&["-j", ISTIO_REDIRECT]),
            );
            for nic in &cfg.kube_virt_interfaces {
                b.insert(
                    a4,
                    a6,
                    Table::Nat,
                    "PREROUTING",
                    1,
                    &["-i", nic, "-j", ISTIO_REDIRECT],
                );
            }
        }
        CidrSelection::Cidrs(_) => {
            for c in cidrs {
                let c = c.to_string();
                for nic in &cfg.kube_virt_interfaces {
                    b.insert(
                        a4,
                        a6,
                        Table::Nat,
                        "PREROUTING",
                        1,
                        &["-i", nic, "-d", &c, "-j", ISTIO_REDIRECT],
                    );
                }
                b.push(
                    a4,
                    a6,
                    Table::Nat,
                    ISTIO_OUTPUT,
                    Op::Append,
                    strs(&["-d", &c, "-j", ISTIO_REDIRECT]),
                );
            }
        }
        CidrSelection::None => {}
    }
}

/// capture/run.go `SetupDNSRedir` + `addDNSConntrackZones`.
fn setup_dns(b: &mut Builder, cfg: &Config) {
    use Table::{Nat, Raw};
    let all = cfg.capture_all_dns;
    let v4s: Vec<String> = cfg
        .dns_servers_v4
        .iter()
        .map(|s| format!("{s}/32"))
        .collect();
    let v6s: Vec<String> = cfg
        .dns_servers_v6
        .iter()
        .map(|s| format!("{s}/128"))
        .collect();
    b.append(Raw, "OUTPUT", &["-j", ISTIO_OUTPUT_DNS]);
    if all || !v4s.is_empty() {
        b.append_v4(Nat, ISTIO_OUTPUT, &["-j", ISTIO_OUTPUT_DNS]);
    }
    if all || !v6s.is_empty() {
        b.append_v6(Nat, ISTIO_OUTPUT, &["-j", ISTIO_OUTPUT_DNS]);
    }
    let tcp = ["-p", "tcp", "--dport", "53"];
    if all {
        b.append(
            Nat,
            ISTIO_OUTPUT_DNS,
            &[&tcp[..], &["-j", "REDIRECT", "--to-ports", DNS_PORT]].concat(),
        );
    } else {
        for s in &v4s {
            b.append_v4(
                Nat,
                ISTIO_OUTPUT_DNS,
                &[
                    &tcp[..],
                    &["-d", s, "-j", "REDIRECT", "--to-ports", DNS_PORT],
                ]
                .concat(),
            );
        }
        for s in &v6s {
            b.append_v6(
                Nat,
                ISTIO_OUTPUT_DNS,
                &[
                    &tcp[..],
                    &["-d", s, "-j", "REDIRECT", "--to-ports", DNS_PORT],
                ]
                .concat(),
            );
        }
    }
    // No owner rules here (Istio `tools/istio-iptables/pkg/capture/run.go` `SetupDNSRedir`):
    // ISTIO_OUTPUT returns the proxy's own traffic, and that of groups outside the capture
    // filter, before it jumps to ISTIO_OUTPUT_DNS.
    let udp_redirect = ["-j", "REDIRECT", "--to-port", DNS_PORT];
    if all {
        b.append(
            Nat,
            ISTIO_OUTPUT_DNS,
            &[&["-p", "udp", "--dport", "53"][..], &udp_redirect].concat(),
        );
    } else {
        for s in &v4s {
            b.append_v4(
                Nat,
                ISTIO_OUTPUT_DNS,
                &[&["-p", "udp", "--dport", "53", "-d", s][..], &udp_redirect].concat(),
            );
        }
        for s in &v6s {
            b.append_v6(
                Nat,
                ISTIO_OUTPUT_DNS,
                &[&["-p", "udp", "--dport", "53", "-d", s][..], &udp_redirect].concat(),
            );
        }
    }
    // Conntrack zones: agent ↔ upstream in zone 1, app ↔ agent in zone 2, so the NATed and
    // un-NATed legs of one query never share a conntrack entry.
    for (flag, ids) in [
        ("--uid-owner", &cfg.proxy_uid),
        ("--gid-owner", &cfg.proxy_gid),
    ] {
        for id in ids {
            b.append(
                Raw,
                ISTIO_OUTPUT_DNS,
                &[
                    "-p", "udp", "--dport", "53", "-m", "owner", flag, id, "-j", "CT", "--zone",
                    "1",
                ],
            );
            b.append(
                Raw,
                ISTIO_OUTPUT_DNS,
                &[
                    "-p", "udp", "--sport", "15053", "-m", "owner", flag, id, "-j", "CT", "--zone",
                    "2",
                ],
            );
        }
    }
    if all {
        b.append(Raw, "PREROUTING", &["-j", ISTIO_INBOUND]);
        b.append(
            Raw,
            ISTIO_OUTPUT_DNS,
            &["-p", "udp", "--dport", "53", "-j", "CT", "--zone", "2"],
        );
        b.append(
            Raw,
            ISTIO_INBOUND,
            &["-p", "udp", "--sport", "53", "-j", "CT", "--zone", "1"],
        );
    } else {
        // Per family: its servers only, and PREROUTING → ISTIO_INBOUND only if it has any.
        let families: [(&[String], AppendFamily); 2] =
            [(&v4s, Builder::append_v4), (&v6s, Builder::append_v6)];
        for (servers, append) in families {
            if !servers.is_empty() {
                append(b, Raw, "PREROUTING", &["-j", ISTIO_INBOUND]);
            }
            for s in servers {
                append(
                    b,
                    Raw,
                    ISTIO_OUTPUT_DNS,
                    &[
                        "-p", "udp", "--dport", "53", "-d", s, "-j", "CT", "--zone", "2",
                    ],
                );
                append(
                    b,
                    Raw,
                    ISTIO_INBOUND,
                    &[
                        "-p", "udp", "--sport", "53", "-s", s, "-j", "CT", "--zone", "1",
                    ],
                );
            }
        }
    }
}

/// The `iptables-restore --noflush` input for one family's rules ("" when there are none).
pub fn restore_text(rules: &[Rule]) -> String {
    let mut out = String::new();
    for table in Table::ALL {
        let in_table: Vec<&Rule> = rules.iter().filter(|r| r.table == table).collect();
        if in_table.is_empty() {
            continue;
        }
        out.push_str(&format!("* {}\n", table.name()));
        let mut chains: Vec<&str> = Vec::new();
        for r in &in_table {
            if !is_builtin(&r.chain) && !chains.contains(&r.chain.as_str()) {
                chains.push(&r.chain);
            }
        }
        for c in chains {
            out.push_str(&format!("-N {c}\n"));
        }
        for r in in_table {
            out.push_str(&r.line());
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

/// The Istio chains of one family's rules, per table, in first-use order.
pub fn chains(rules: &[Rule]) -> Vec<(Table, String)> {
    let mut out: Vec<(Table, String)> = Vec::new();
    for r in rules {
        if !is_builtin(&r.chain) && !out.iter().any(|(t, c)| *t == r.table && *c == r.chain) {
            out.push((r.table, r.chain.clone()));
        }
    }
    out
}
