//! `istio-iptables` flags and environment → a validated [`Config`].
//!
//! Istio binds every flag to the environment variable named after it (upper case, `-` → `_`,
//! pkg/flag/flag.go `BindEnv`), then a few flags to additional names (`AdditionalEnv`), then
//! cobra parses the command line. So the precedence is: flag > additional env > primary env >
//! default. Values that cannot be set from the environment (`fs.Set` fails, e.g. an empty
//! bool) are dropped as Istio drops them; the command line is strict: a bad flag is an error
//! naming the flag and the value.
#![allow(
    clippy::disallowed_methods,
    reason = "istio-iptables runs synchronously as its own command; no runtime is serving"
)]

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

pub use crate::config::{EnvSource as Env, MapEnv, ProcessEnv};

/// A bad flag or environment value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A flag this command does not know.
    #[error("unknown flag: {0}")]
    UnknownFlag(String),
    /// A flag that needs a value was last on the line.
    #[error("flag needs an argument: {0}")]
    MissingValue(String),
    /// A positional argument (the command takes none).
    #[error("unexpected argument {0:?}: istio-iptables takes flags only")]
    UnexpectedArg(String),
    /// A value that does not parse or is not allowed.
    #[error("invalid value {value:?} for {source_name}: {reason}")]
    Invalid {
        /// `--flag` or `$ENV`.
        source_name: String,
        /// The offending value.
        value: String,
        /// What was expected.
        reason: String,
    },
}

/// How inbound connections reach Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum InterceptionMode {
    /// NAT REDIRECT (the default; also what "" means).
    #[default]
    Redirect,
    /// TPROXY in the mangle table, keeping the original source and destination.
    Tproxy,
}

/// `--force-iptables-binary`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum ForcedBinary {
    /// `iptables-legacy` / `ip6tables-legacy`.
    Legacy,
    /// `iptables-nft` / `ip6tables-nft`.
    Nft,
}

/// The fully resolved configuration (Istio tools/istio-iptables/pkg/config `Config`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Config {
    pub proxy_port: u16,
    pub inbound_capture_port: u16,
    pub inbound_tunnel_port: u16,
    pub proxy_uid: Vec<String>,
    pub proxy_gid: Vec<String>,
    pub mode: InterceptionMode,
    /// `-b`: `None` = no inbound capture; `Some(vec![])` never occurs.
    pub inbound_ports: PortSelection,
    pub inbound_ports_exclude: Vec<u16>,
    pub exclude_interfaces: Vec<String>,
    /// `-i`.
    pub outbound_cidrs_include: CidrSelection,
    /// `-x`.
    pub outbound_cidrs_exclude: Vec<Cidr>,
    pub outbound_ports_include: Vec<u16>,
    pub outbound_ports_exclude: Vec<u16>,
    pub kube_virt_interfaces: Vec<String>,
    pub tproxy_mark: u32,
    pub tproxy_route_table: u32,
    pub dry_run: bool,
    pub probe_port: u16,
    /// Go duration text (`5s`) in the logged configuration, as Istio prints it.
    #[serde(with = "crate::config::serde_duration")]
    pub probe_timeout: Duration,
    pub skip_rule_apply: bool,
    pub run_validation: bool,
    pub redirect_dns: bool,
    pub drop_invalid: bool,
    pub dual_stack: bool,
    pub capture_all_dns: bool,
    pub network_namespace: String,
    pub cni_mode: bool,
    pub reconcile: bool,
    pub cleanup_only: bool,
    pub force_apply: bool,
    pub native_nftables: bool,
    pub force_binary: Option<ForcedBinary>,
    /// `ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR`.
    pub loopback_cidr: Cidr,
    /// Owner groups whose traffic is captured (`ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]`).
    pub owner_groups: OwnerGroups,
    /// Filled by [`Config::detect`] (or set directly in tests): IPv6 rules are generated.
    pub enable_ipv6: bool,
    /// resolv.conf name servers, spelled as written there (Istio appends `/32` or `/128` to
    /// the text): filled when DNS capture is on and not capture-all.
    pub dns_servers_v4: Vec<String>,
    pub dns_servers_v6: Vec<String>,
    /// `DRY_RUN_FILE_PATH`: where `--dry-run` also writes what it would run.
    pub dry_run_file: Option<String>,
}

/// Inbound ports to capture.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum PortSelection {
    None,
    All,
    Ports(Vec<u16>),
}

/// Outbound CIDRs to capture.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum CidrSelection {
    None,
    All,
    Cidrs(Vec<Cidr>),
}

/// Owner-group capture filter (Istio tools/istio-iptables/pkg/config `InterceptFilter`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum OwnerGroups {
    /// Every group is captured (`*`, the default): no rule.
    All,
    /// Only these groups are captured.
    Include(Vec<String>),
    /// Every group except these is captured.
    Exclude(Vec<String>),
}

/// A CIDR as Istio prints it (`netip.Prefix.String()`: masked address, `/len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Cidr {
    pub addr: IpAddr,
    pub len: u8,
}

impl Cidr {
    /// Parses `a.b.c.d/n` or `x::y/n`. Like Go's `netip.ParsePrefix`, the address is kept
    /// as written (not masked) and a bare address is rejected.
    pub fn parse(s: &str) -> Option<Self> {
        let (a, l) = s.split_once('/')?;
        let addr: IpAddr = a.parse().ok()?;
        if l.is_empty()
            || !l.bytes().all(|b| b.is_ascii_digit())
            || (l.len() > 1 && l.starts_with('0'))
        {
            return None;
        }
        let len: u8 = l.parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        (len <= max).then_some(Self { addr, len })
    }

    /// True for a v4 address.
    pub fn is_v4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// True for 127/8 or ::1 (Go `netip.Addr.IsLoopback`).
    pub fn is_loopback(&self) -> bool {
        self.addr.is_loopback()
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

impl Default for Config {
    /// Istio's defaults with uid/gid 1337 (what `ENVOY_USER` resolves to in Istio's images).
    fn default() -> Self {
        Self {
            proxy_port: 15001,
            inbound_capture_port: 15006,
            inbound_tunnel_port: 15008,
            proxy_uid: vec!["1337".into()],
            proxy_gid: vec!["1337".into()],
            mode: InterceptionMode::Redirect,
            inbound_ports: PortSelection::None,
            inbound_ports_exclude: vec![],
            exclude_interfaces: vec![],
            outbound_cidrs_include: CidrSelection::None,
            outbound_cidrs_exclude: vec![],
            outbound_ports_include: vec![],
            outbound_ports_exclude: vec![],
            kube_virt_interfaces: vec![],
            tproxy_mark: 1337,
            tproxy_route_table: 133,
            dry_run: false,
            probe_port: 15002,
            probe_timeout: Duration::from_secs(5),
            skip_rule_apply: false,
            run_validation: false,
            redirect_dns: false,
            drop_invalid: false,
            dual_stack: false,
            capture_all_dns: false,
            network_namespace: String::new(),
            cni_mode: false,
            reconcile: false,
            cleanup_only: false,
            force_apply: false,
            native_nftables: false,
            force_binary: None,
            loopback_cidr: Cidr {
                addr: IpAddr::from([127, 0, 0, 1]),
                len: 32,
            },
            owner_groups: OwnerGroups::All,
            enable_ipv6: false,
            dns_servers_v4: vec![],
            dns_servers_v6: vec![],
            dry_run_file: None,
        }
    }
}

/// How a flag takes its value.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Str,
    Bool,
}

/// One flag: long name, short letter, primary env (None = not bound), additional env names,
/// and what `--help` says of it (value type as pflag names it, default, description).
struct Spec {
    long: &'static str,
    short: Option<char>,
    kind: Kind,
    env: Option<&'static str>,
    extra_env: &'static [&'static str],
    /// pflag's type name shown after the flag (`string`, `uint16`, `duration`); empty for bools.
    ty: &'static str,
    /// The default `--help` shows; empty when pflag shows none (a zero value).
    default: &'static str,
    help: &'static str,
    /// A root flag of pilot-agent (listed under "Global Flags").
    global: bool,
}

const fn s(
    long: &'static str,
    short: Option<char>,
    env: Option<&'static str>,
    help: &'static str,
) -> Spec {
    Spec {
        long,
        short,
        kind: Kind::Str,
        env,
        extra_env: &[],
        ty: "string",
        default: "",
        help,
        global: false,
    }
}

const fn b(
    long: &'static str,
    env: &'static str,
    extra_env: &'static [&'static str],
    help: &'static str,
) -> Spec {
    Spec {
        long,
        short: None,
        kind: Kind::Bool,
        env: Some(env),
        extra_env,
        ty: "",
        default: "",
        help,
        global: false,
    }
}

/// `spec` with the default `--help` shows.
const fn with_default(spec: Spec, default: &'static str) -> Spec {
    Spec { default, ..spec }
}

/// `spec` shown with pflag's type name `ty` (the value is still parsed by `Config::from_raw`).
const fn typed(spec: Spec, ty: &'static str) -> Spec {
    Spec { ty, ..spec }
}

/// A root logging flag (`pkg/log/options.go`), accepted here as on every subcommand.
const fn root(spec: Spec) -> Spec {
    Spec {
        global: true,
        ..spec
    }
}

/// Every flag of Istio's `istio-iptables` (tools/istio-iptables/pkg/cmd/root.go
/// `bindCmdlineFlags`, descriptions and defaults as its `--help` gives them), plus the root
/// logging flags pilot-agent accepts on every subcommand.
const SPECS: &[Spec] = &[
    // `--envoy-port` is the one port flag without an env binding.
    with_default(
        s(
            "envoy-port",
            Some('p'),
            None,
            "Specify the envoy port to which redirect all TCP traffic.",
        ),
        "15001",
    ),
    with_default(
        s(
            "inbound-capture-port",
            Some('z'),
            Some("INBOUND_CAPTURE_PORT"),
            "Port to which all inbound TCP traffic to the pod/VM should be redirected to.",
        ),
        "15006",
    ),
    with_default(
        s(
            "inbound-tunnel-port",
            Some('e'),
            Some("INBOUND_TUNNEL_PORT"),
            "Specify the istio tunnel port for inbound tcp traffic.",
        ),
        "15008",
    ),
    s(
        "proxy-uid",
        Some('u'),
        Some("PROXY_UID"),
        "Specify the UID of the user for which the redirection is not applied. Typically, this is the UID of the proxy container.",
    ),
    s(
        "proxy-gid",
        Some('g'),
        Some("PROXY_GID"),
        "Specify the GID of the user for which the redirection is not applied (same default value as -u param).",
    ),
    s(
        "istio-inbound-interception-mode",
        Some('m'),
        Some("ISTIO_INBOUND_INTERCEPTION_MODE"),
        "The mode used to redirect inbound connections to Envoy, either \"REDIRECT\" or \"TPROXY\".",
    ),
    s(
        "istio-inbound-ports",
        Some('b'),
        Some("ISTIO_INBOUND_PORTS"),
        "Comma separated list of inbound ports for which traffic is to be redirected to Envoy (optional). The wildcard character \"*\" can be used to configure redirection for all ports. An empty list will disable.",
    ),
    s(
        "istio-local-exclude-ports",
        Some('d'),
        Some("ISTIO_LOCAL_EXCLUDE_PORTS"),
        "Comma separated list of inbound ports to be excluded from redirection to Envoy (optional). Only applies when all inbound traffic (i.e. \"*\") is being redirected.",
    ),
    s(
        "istio-exclude-interfaces",
        Some('c'),
        Some("ISTIO_EXCLUDE_INTERFACES"),
        "Comma separated list of NIC (optional). Neither inbound nor outbound traffic will be captured.",
    ),
    s(
        "istio-service-cidr",
        Some('i'),
        Some("ISTIO_SERVICE_CIDR"),
        "Comma separated list of IP ranges in CIDR form to redirect to envoy (optional). The wildcard character \"*\" can be used to redirect all outbound traffic. An empty list will disable all outbound.",
    ),
    // Istio's text has the double space after "all".
    s(
        "istio-service-exclude-cidr",
        Some('x'),
        Some("ISTIO_SERVICE_EXCLUDE_CIDR"),
        "Comma separated list of IP ranges in CIDR form to be excluded from redirection. Only applies when all  outbound traffic (i.e. \"*\") is being redirected.",
    ),
    s(
        "istio-outbound-ports",
        Some('q'),
        Some("ISTIO_OUTBOUND_PORTS"),
        "Comma separated list of outbound ports to be explicitly included for redirection to Envoy.",
    ),
    s(
        "istio-local-outbound-ports-exclude",
        Some('o'),
        Some("ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE"),
        "Comma separated list of outbound ports to be excluded from redirection to Envoy.",
    ),
    s(
        "kube-virt-interfaces",
        Some('k'),
        Some("KUBE_VIRT_INTERFACES"),
        "Comma separated list of virtual interfaces whose inbound traffic (from VM) will be treated as outbound.",
    ),
    // Istio gives these two no description.
    with_default(
        s(
            "istio-inbound-tproxy-mark",
            Some('t'),
            Some("ISTIO_INBOUND_TPROXY_MARK"),
            "",
        ),
        "1337",
    ),
    with_default(
        s(
            "istio-inbound-tproxy-route-table",
            Some('r'),
            Some("ISTIO_INBOUND_TPROXY_ROUTE_TABLE"),
            "",
        ),
        "133",
    ),
    Spec {
        short: Some('n'),
        ..b(
            "dry-run",
            "DRY_RUN",
            &[],
            "Do not call any external dependencies like iptables.",
        )
    },
    with_default(
        typed(
            s(
                "iptables-probe-port",
                None,
                Some("IPTABLES_PROBE_PORT"),
                "Set listen port for failure detection.",
            ),
            "uint16",
        ),
        "15002",
    ),
    with_default(
        typed(
            s(
                "probe-timeout",
                None,
                Some("PROBE_TIMEOUT"),
                "Failure detection timeout.",
            ),
            "duration",
        ),
        "5s",
    ),
    b(
        "skip-rule-apply",
        "SKIP_RULE_APPLY",
        &[],
        "Skip iptables apply.",
    ),
    b(
        "run-validation",
        "RUN_VALIDATION",
        &[],
        "Validate iptables.",
    ),
    b(
        "redirect-dns",
        "REDIRECT_DNS",
        &["ISTIO_META_DNS_CAPTURE"],
        "Enable capture of dns traffic by istio-agent.",
    ),
    b(
        "drop-invalid",
        "DROP_INVALID",
        &["INVALID_DROP"],
        "Enable invalid drop in the iptables rules.",
    ),
    b(
        "dual-stack",
        "DUAL_STACK",
        &["ISTIO_DUAL_STACK"],
        "Enable ipv4/ipv6 redirects for dual-stack.",
    ),
    b(
        "capture-all-dns",
        "CAPTURE_ALL_DNS",
        &[],
        "Instead of only capturing DNS traffic to DNS server IP, capture all DNS traffic at port 53. This setting is only effective when redirect dns is enabled.",
    ),
    s(
        "network-namespace",
        None,
        Some("NETWORK_NAMESPACE"),
        "The network namespace that iptables rules should be applied to.",
    ),
    b("cni-mode", "CNI_MODE", &[], "Whether to run as CNI plugin."),
    b(
        "reconcile",
        "RECONCILE",
        &[],
        "Reconcile pre-existing and incompatible iptables rules instead of failing if drift is detected.",
    ),
    b(
        "cleanup-only",
        "CLEANUP_ONLY",
        &[],
        "Perform a forced cleanup without creating new iptables chains or rules.",
    ),
    b(
        "force-apply",
        "FORCE_APPLY",
        &[],
        "Apply iptables changes even if they appear to already be in place.",
    ),
    b(
        "native-nftables",
        "NATIVE_NFTABLES",
        &[],
        "Use native nftables instead of iptables rules.",
    ),
    s(
        "force-iptables-binary",
        None,
        Some("FORCE_IPTABLES_BINARY"),
        "Break glass option to choose which iptables binary to use.",
    ),
    // Root (pilot-agent) logging flags: accepted here as on every subcommand.
    root(s(
        "log_output_level",
        None,
        None,
        "Comma-separated minimum per-scope logging level of messages to output, in the form of <scope>:<level>,<scope>:<level>,... where level can be one of [debug, info, warn, error, fatal, none]",
    )),
    // Repeatable in Istio; the last one wins here.
    with_default(
        typed(
            root(s(
                "log_target",
                None,
                None,
                "The set of paths where to output the log. This can be any path as well as the special values stdout and stderr",
            )),
            "stringArray",
        ),
        "[stdout]",
    ),
    root(s(
        "log_caller",
        None,
        None,
        "Comma-separated list of scopes for which to include caller information",
    )),
    with_default(
        root(s(
            "log_stacktrace_level",
            None,
            None,
            "Comma-separated minimum per-scope logging level at which stack traces are captured, in the form of <scope>:<level>,<scope:level>,... where level can be one of [debug, info, warn, error, fatal, none]",
        )),
        "default:none",
    ),
    // klog's verbosity: accepted and unused (nothing here logs through klog).
    typed(
        root(s(
            "vklog",
            None,
            None,
            "number for the log level verbosity. Like -v flag. ex: --vklog=9",
        )),
        "Level",
    ),
    Spec {
        long: "log_as_json",
        short: None,
        kind: Kind::Bool,
        env: None,
        extra_env: &[],
        ty: "",
        default: "",
        help: "Whether to format output as JSON or in plain console-friendly format",
        global: true,
    },
];

fn spec_long(name: &str) -> Option<&'static Spec> {
    SPECS.iter().find(|s| s.long == name)
}

fn spec_short(c: char) -> Option<&'static Spec> {
    SPECS.iter().find(|s| s.short == Some(c))
}

/// One `istio-iptables` flag as the configuration reference lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagInfo {
    /// Long name, without `--`.
    pub long: &'static str,
    /// Short letter, if any.
    pub short: Option<char>,
    /// Whether it is a bool flag (`--flag`, `--flag=false`) rather than one taking a value.
    pub bool: bool,
    /// The environment variables bound to it, the primary one first (later ones win).
    pub env: Vec<&'static str>,
    /// What it does (Istio's description).
    pub help: &'static str,
    /// The default `--help` shows (empty: none).
    pub default: &'static str,
}

/// Every flag `istio-iptables` accepts, in `--help` order.
pub fn flags() -> Vec<FlagInfo> {
    SPECS
        .iter()
        .map(|s| FlagInfo {
            long: s.long,
            short: s.short,
            bool: s.kind == Kind::Bool,
            env: s.env.iter().chain(s.extra_env).copied().collect(),
            help: s.help,
            default: s.default,
        })
        .collect()
}

/// One help line's parts: the flag column and the text after it.
fn help_line(
    short: Option<char>,
    long: &str,
    ty: &str,
    help: &str,
    default: &str,
) -> (String, String) {
    let mut left = match short {
        Some(c) => format!("  -{c}, --{long}"),
        None => format!("      --{long}"),
    };
    if !ty.is_empty() {
        left.push(' ');
        left.push_str(ty);
    }
    let mut text = help.to_owned();
    if !default.is_empty() {
        // pflag quotes string defaults only.
        if ty == "string" {
            text.push_str(&format!(" (default {default:?})"));
        } else {
            text.push_str(&format!(" (default {default})"));
        }
    }
    (left, text)
}

/// pflag's `FlagUsages` layout (the caller sorts by name): descriptions in one column three
/// spaces after the longest flag.
fn render_flags(out: &mut String, lines: &[(String, String)]) {
    let width = lines.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    for (left, text) in lines.iter() {
        out.push_str(&format!("{left:width$}   {text}\n"));
    }
}

/// `istio-iptables --help`, laid out as cobra prints pilot-agent's: every flag with its
/// description and default (the env bindings are in the configuration reference).
pub fn usage(bin: &str) -> String {
    let mut out = format!(
        "istio-iptables is responsible for setting up port forwarding for Istio Sidecar.\n\nUsage:\n  {bin} istio-iptables [flags]\n\nFlags:\n"
    );
    let flag_name = |s: &Spec| s.long;
    let mut own: Vec<(&str, (String, String))> = SPECS
        .iter()
        .filter(|s| !s.global)
        .map(|s| {
            (
                flag_name(s),
                help_line(s.short, s.long, s.ty, s.help, s.default),
            )
        })
        .collect();
    own.push((
        "help",
        help_line(Some('h'), "help", "", "help for istio-iptables", ""),
    ));
    own.sort_by_key(|(name, _)| *name);
    let lines: Vec<(String, String)> = own.into_iter().map(|(_, l)| l).collect();
    render_flags(&mut out, &lines);
    out.push_str("\nGlobal Flags:\n");
    let mut global: Vec<(&str, (String, String))> = SPECS
        .iter()
        .filter(|s| s.global)
        .map(|s| {
            (
                flag_name(s),
                help_line(s.short, s.long, s.ty, s.help, s.default),
            )
        })
        .collect();
    global.sort_by_key(|(name, _)| *name);
    let lines: Vec<(String, String)> = global.into_iter().map(|(_, l)| l).collect();
    render_flags(&mut out, &lines);
    out
}

/// Raw values by long flag name, with where each came from (for error messages).
#[derive(Default, Debug)]
pub struct RawValues {
    values: HashMap<&'static str, (String, String)>,
}

impl RawValues {
    fn get(&self, long: &str) -> Option<(&str, &str)> {
        self.values
            .get(long)
            .map(|(v, src)| (v.as_str(), src.as_str()))
    }

    /// The `--log_*` flags seen on the command line (for the logging setup).
    pub fn log_flag(&self, long: &str) -> Option<&str> {
        self.get(long).map(|(v, _)| v)
    }
}

/// Go `strconv.ParseBool`.
fn go_bool(v: &str) -> Option<bool> {
    crate::config::parse_go_bool(v)
}

/// Applies env then flags (Istio's precedence) and returns the raw values.
pub fn collect(args: &[String], env: &dyn Env) -> Result<RawValues, ConfigError> {
    let mut raw = RawValues::default();
    // Primary env, then additional env: later wins.
    for spec in SPECS {
        let names = spec.env.into_iter().chain(spec.extra_env.iter().copied());
        for name in names {
            let Some(v) = env.get(name) else { continue };
            // pflag `fs.Set` fails for a bool that does not parse; Istio ignores that error.
            if spec.kind == Kind::Bool && go_bool(&v).is_none() {
                tracing::warn!("ignoring ${name}={v:?}: not a boolean");
                continue;
            }
            raw.values.insert(spec.long, (v, format!("${name}")));
        }
    }
    // Command line (pflag syntax): --name=v, --name v, -x v, -xv, bool --name / --name=false.
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        if arg == "--" {
            if let Some(extra) = it.next() {
                return Err(ConfigError::UnexpectedArg(extra.clone()));
            }
            break;
        }
        let (spec, inline, shown) = if let Some(body) = arg.strip_prefix("--") {
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (body, None),
            };
            let spec =
                spec_long(name).ok_or_else(|| ConfigError::UnknownFlag(format!("--{name}")))?;
            (spec, inline, format!("--{name}"))
        } else if let Some(body) = arg.strip_prefix('-').filter(|b| !b.is_empty()) {
            let mut chars = body.chars();
            let c = chars.next().unwrap_or('-');
            let spec = spec_short(c).ok_or_else(|| ConfigError::UnknownFlag(format!("-{c}")))?;
            let rest: String = chars.collect();
            let inline = match rest.strip_prefix('=') {
                Some(v) => Some(v.to_owned()),
                None if rest.is_empty() => None,
                None => Some(rest),
            };
            (spec, inline, format!("-{c} (--{})", spec.long))
        } else {
            return Err(ConfigError::UnexpectedArg(arg.clone()));
        };
        let value = match (spec.kind, inline) {
            (Kind::Bool, None) => "true".to_owned(),
            (Kind::Bool, Some(v)) => {
                if go_bool(&v).is_none() {
                    return Err(invalid(&shown, &v, "expected a boolean (true/false)"));
                }
                v
            }
            (Kind::Str, Some(v)) => v,
            (Kind::Str, None) => it
                .next()
                .cloned()
                .ok_or_else(|| ConfigError::MissingValue(shown.clone()))?,
        };
        raw.values
            .insert(spec.long, (value, format!("--{}", spec.long)));
    }
    Ok(raw)
}

fn invalid(source: &str, value: &str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        source_name: source.to_owned(),
        value: value.to_owned(),
        reason: reason.to_owned(),
    }
}

/// Istio tools/istio-iptables/pkg/config `Split`: comma list, blanks trimmed and dropped.
pub fn split(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect()
}

fn parse_port(src: &str, v: &str) -> Result<u16, ConfigError> {
    let v = v.trim();
    match v.parse::<u16>() {
        Ok(p) if p > 0 && v.bytes().all(|b| b.is_ascii_digit()) => Ok(p),
        _ => Err(invalid(src, v, "expected a port number 1-65535")),
    }
}

fn parse_ports(src: &str, v: &str) -> Result<Vec<u16>, ConfigError> {
    let mut out = Vec::new();
    for p in split(v) {
        if p == "*" {
            return Err(invalid(
                src,
                v,
                "\"*\" is only allowed in --istio-inbound-ports; expected a comma-separated list of ports",
            ));
        }
        out.push(
            parse_port(src, &p)
                .map_err(|_| invalid(src, v, &format!("{p:?} is not a port number 1-65535")))?,
        );
    }
    Ok(out)
}

fn parse_cidrs(src: &str, v: &str) -> Result<Vec<Cidr>, ConfigError> {
    let mut out = Vec::new();
    for c in split(v) {
        if c == "*" {
            return Err(invalid(
                src,
                v,
                "\"*\" is not allowed here; expected a comma-separated list of CIDRs",
            ));
        }
        out.push(Cidr::parse(&c).ok_or_else(|| {
            invalid(
                src,
                v,
                &format!("{c:?} is not a CIDR (address/prefix-length)"),
            )
        })?);
    }
    Ok(out)
}

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
fn numeric_id(s: &str) -> Option<u32> {
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

fn describe(n: &str) -> String {
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
fn check_names(src: &str, raw: &str, names: &[String], kind: NameKind) -> Result<(), ConfigError> {
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

fn parse_names(src: &str, v: &str, kind: NameKind) -> Result<Vec<String>, ConfigError> {
    let names = split(v);
    check_names(src, v, &names, kind)?;
    Ok(names)
}

fn parse_u32(src: &str, v: &str) -> Result<u32, ConfigError> {
    v.trim()
        .parse::<u32>()
        .map_err(|_| invalid(src, v, "expected a non-negative integer"))
}

/// Go `time.ParseDuration`.
pub fn parse_go_duration(v: &str) -> Option<Duration> {
    crate::config::parse_go_duration(v.trim())
}

impl Config {
    /// Parses the arguments after `istio-iptables` with `env`; does not touch the system.
    /// `enable_ipv6` and the DNS servers stay empty: see [`Config::detect`].
    pub fn from_args(args: &[String], env: &dyn Env) -> Result<Self, ConfigError> {
        let raw = collect(args, env)?;
        Self::from_raw(&raw, env)
    }

    /// Builds the typed config from raw values.
    pub fn from_raw(raw: &RawValues, env: &dyn Env) -> Result<Self, ConfigError> {
        let mut c = Config::default();
        let get = |k: &str| raw.get(k);
        let boolean = |k: &str| get(k).and_then(|(v, _)| go_bool(v)).unwrap_or(false);
        if let Some((v, src)) = get("envoy-port") {
            c.proxy_port = parse_port(src, v)?;
        }
        if let Some((v, src)) = get("inbound-capture-port") {
            c.inbound_capture_port = parse_port(src, v)?;
        }
        if let Some((v, src)) = get("inbound-tunnel-port") {
            c.inbound_tunnel_port = parse_port(src, v)?;
        }
        // Istio cmd `constructConfig`: an empty uid means the uid of ENVOY_USER, else 1337;
        // an empty gid means the uid list.
        let uid = get("proxy-uid").filter(|(v, _)| !v.trim().is_empty());
        c.proxy_uid = match uid {
            Some((v, src)) => parse_names(src, v, NameKind::User)?,
            None => vec![envoy_user_uid(env)],
        };
        let gid = get("proxy-gid").filter(|(v, _)| !v.trim().is_empty());
        c.proxy_gid = match gid {
            Some((v, src)) => parse_names(src, v, NameKind::Group)?,
            None => c.proxy_uid.clone(),
        };
        if let Some((v, src)) = get("istio-inbound-interception-mode") {
            c.mode = match v.trim() {
                "" | "REDIRECT" => InterceptionMode::Redirect,
                "TPROXY" => InterceptionMode::Tproxy,
                _ => return Err(invalid(src, v, "expected REDIRECT or TPROXY")),
            };
        }
        if let Some((v, src)) = get("istio-inbound-ports") {
            c.inbound_ports = match v.trim() {
                "" => PortSelection::None,
                "*" => PortSelection::All,
                _ => PortSelection::Ports(parse_ports(src, v).map_err(|_| {
                    invalid(src, v, "expected \"*\" or a comma-separated list of ports")
                })?),
            };
        }
        if let Some((v, src)) = get("istio-local-exclude-ports") {
            c.inbound_ports_exclude = parse_ports(src, v)?;
        }
        if let Some((v, src)) = get("istio-exclude-interfaces") {
            c.exclude_interfaces = parse_names(src, v, NameKind::Interface)?;
        }
        if let Some((v, src)) = get("istio-service-cidr") {
            c.outbound_cidrs_include = match v.trim() {
                "" => CidrSelection::None,
                "*" => CidrSelection::All,
                _ => {
                    let cidrs = parse_cidrs(src, v)?;
                    if cidrs.is_empty() {
                        CidrSelection::None
                    } else {
                        CidrSelection::Cidrs(cidrs)
                    }
                }
            };
        }
        if let Some((v, src)) = get("istio-service-exclude-cidr") {
            // Istio capture/run.go `Run`: "invalid value for OUTBOUND_IP_RANGES_EXCLUDE" on `*`.
            c.outbound_cidrs_exclude = parse_cidrs(src, v)?;
        }
        if let Some((v, src)) = get("istio-outbound-ports") {
            c.outbound_ports_include = parse_ports(src, v)?;
        }
        if let Some((v, src)) = get("istio-local-outbound-ports-exclude") {
            c.outbound_ports_exclude = parse_ports(src, v)?;
        }
        if let Some((v, src)) = get("kube-virt-interfaces") {
            c.kube_virt_interfaces = parse_names(src, v, NameKind::Interface)?;
        }
        if let Some((v, src)) = get("istio-inbound-tproxy-mark") {
            c.tproxy_mark = parse_u32(src, v)?;
        }
        if let Some((v, src)) = get("istio-inbound-tproxy-route-table") {
            c.tproxy_route_table = parse_u32(src, v)?;
        }
        if let Some((v, src)) = get("iptables-probe-port") {
            c.probe_port = parse_port(src, v)?;
        }
        if let Some((v, src)) = get("probe-timeout") {
            c.probe_timeout = parse_go_duration(v)
                .ok_or_else(|| invalid(src, v, "expected a duration such as 5s or 500ms"))?;
        }
        if let Some((v, src)) = get("force-iptables-binary") {
            // Istio dependencies: "iptables binary unsupported: X, supported values are
            // 'legacy' or 'nft'".
            c.force_binary = match v.trim() {
                "" => None,
                "legacy" => Some(ForcedBinary::Legacy),
                "nft" => Some(ForcedBinary::Nft),
                _ => {
                    return Err(invalid(
                        src,
                        v,
                        "iptables binary unsupported, supported values are 'legacy' or 'nft'",
                    ));
                }
            };
        }
        if let Some((v, _)) = get("network-namespace") {
            c.network_namespace = v.to_owned();
        }
        c.dry_run = boolean("dry-run");
        c.skip_rule_apply = boolean("skip-rule-apply");
        c.run_validation = boolean("run-validation");
        c.redirect_dns = boolean("redirect-dns");
        c.drop_invalid = boolean("drop-invalid");
        c.dual_stack = boolean("dual-stack");
        c.capture_all_dns = boolean("capture-all-dns");
        c.cni_mode = boolean("cni-mode");
        c.reconcile = boolean("reconcile");
        c.cleanup_only = boolean("cleanup-only");
        c.force_apply = boolean("force-apply");
        c.native_nftables = boolean("native-nftables");

        // Env-only settings (Istio tools/istio-iptables/pkg/constants + config `Validate`).
        if let Some(v) = env.get("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR") {
            let src = "$ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR";
            let cidr =
                Cidr::parse(v.trim()).ok_or_else(|| invalid(src, &v, "expected an IPv4 CIDR"))?;
            let ok = matches!(cidr.addr, IpAddr::V4(a) if a.octets()[0] == 127) && cidr.len >= 8;
            if !ok {
                return Err(invalid(
                    src,
                    &v,
                    "expected an IPv4 loopback CIDR within 127.0.0.0/8 with a prefix length of at least 8",
                ));
            }
            c.loopback_cidr = cidr;
        }
        let include = env
            .get("ISTIO_OUTBOUND_OWNER_GROUPS")
            .unwrap_or_else(|| "*".into());
        let exclude = env
            .get("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE")
            .unwrap_or_default();
        c.owner_groups = owner_groups(&include, &exclude)?;
        c.dry_run_file = env.get("DRY_RUN_FILE_PATH").filter(|p| !p.is_empty());
        // Every value was checked with its own source above; this keeps the two in step.
        c.validate()?;
        Ok(c)
    }

    /// The system facts Istio's `constructConfig` gathers: IPv6 from the first non-loopback
    /// interface address, DNS servers from resolv.conf when DNS capture needs them.
    pub fn detect(&mut self, resolv_conf: &str) -> Result<(), DetectError> {
        self.enable_ipv6 = detect_ipv6(self.dual_stack)?;
        if self.redirect_dns && !self.capture_all_dns {
            let text =
                std::fs::read_to_string(resolv_conf).map_err(|e| DetectError::ResolvConf {
                    path: resolv_conf.to_owned(),
                    error: e,
                })?;
            let (v4, v6) = resolv_conf_servers(&text);
            self.dns_servers_v4 = v4;
            self.dns_servers_v6 = v6;
        }
        Ok(())
    }
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

/// A failure to gather system facts.
#[derive(Debug, thiserror::Error)]
pub enum DetectError {
    #[error("cannot list interface addresses: {0}")]
    Addresses(nix::Error),
    #[error("no valid local IP address found (needed to decide between IPv4 and IPv6 rules)")]
    NoAddress,
    #[error("failed to load {path}: {error}")]
    ResolvConf { path: String, error: std::io::Error },
}

/// Istio cmd `getLocalIP`: the first address that is not loopback or link-local decides;
/// with dual stack, any IPv6 address among them enables IPv6.
fn detect_ipv6(dual_stack: bool) -> Result<bool, DetectError> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(DetectError::Addresses)?;
    let mut found = false;
    for ifa in addrs {
        let Some(addr) = ifa.address else { continue };
        let ip: IpAddr = if let Some(a) = addr.as_sockaddr_in() {
            IpAddr::V4(a.ip())
        } else if let Some(a) = addr.as_sockaddr_in6() {
            let ip = a.ip();
            match ip.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(ip),
            }
        } else {
            continue;
        };
        let link_local = match ip {
            IpAddr::V4(a) => a.is_link_local(),
            IpAddr::V6(a) => (a.segments()[0] & 0xffc0) == 0xfe80,
        };
        let ll_multicast = match ip {
            IpAddr::V4(a) => a.octets()[0] == 224 && a.octets()[1] == 0 && a.octets()[2] == 0,
            IpAddr::V6(a) => (a.segments()[0] & 0xff0f) == 0xff02,
        };
        if ip.is_loopback() || link_local || ll_multicast {
            continue;
        }
        found = true;
        if !dual_stack || ip.is_ipv6() {
            return Ok(ip.is_ipv6());
        }
    }
    if found {
        Ok(false)
    } else {
        Err(DetectError::NoAddress)
    }
}

/// `nameserver` lines of resolv.conf, split into v4 and v6 (Istio uses miekg/dns
/// `ClientConfigFromFile`, then `IPsSplitV4V6`).
pub fn resolv_conf_servers(text: &str) -> (Vec<String>, Vec<String>) {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        if f.next() != Some("nameserver") {
            continue;
        }
        // A zone suffix (fe80::1%eth0) is not part of the address.
        let Some(addr) = f.next().map(|a| a.split('%').next().unwrap_or(a)) else {
            continue;
        };
        match addr.parse::<IpAddr>() {
            Ok(IpAddr::V4(_)) => v4.push(addr.to_owned()),
            Ok(IpAddr::V6(ip)) => match ip.to_ipv4_mapped() {
                Some(m) => v4.push(m.to_string()),
                None => v6.push(addr.to_owned()),
            },
            Err(_) => tracing::warn!("ignoring unparseable nameserver {addr:?} in resolv.conf"),
        }
    }
    (v4, v6)
}

/// uid of `ENVOY_USER` (default `istio-proxy`), else Istio's default 1337.
fn envoy_user_uid(env: &dyn Env) -> String {
    let name = env
        .get("ENVOY_USER")
        .unwrap_or_else(|| "istio-proxy".into());
    match nix::unistd::User::from_name(&name) {
        Ok(Some(u)) => u.uid.to_string(),
        _ => "1337".into(),
    }
}

/// Istio config `ParseInterceptFilter` + `ValidateOwnerGroups`: `*` (or empty) include means
/// all; an exclude list wins over the default include; both set is an error; at most 64.
pub fn owner_groups(include: &str, exclude: &str) -> Result<OwnerGroups, ConfigError> {
    let inc = include.trim();
    let exc = split(exclude);
    let all = inc.is_empty() || inc == "*";
    if !all && !exc.is_empty() {
        return Err(invalid(
            "$ISTIO_OUTBOUND_OWNER_GROUPS",
            include,
            "only one of ISTIO_OUTBOUND_OWNER_GROUPS and ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE may be set",
        ));
    }
    let (list, src, raw) = if all {
        (exc, "$ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", exclude)
    } else {
        (split(inc), "$ISTIO_OUTBOUND_OWNER_GROUPS", include)
    };
    if list.len() > 64 {
        return Err(invalid(src, raw, "at most 64 owner groups are supported"));
    }
    // Each group reaches `--gid-owner` / nft `skgid` as a `-g` value does.
    check_names(src, raw, &list, NameKind::Group)?;
    Ok(if list.is_empty() {
        OwnerGroups::All
    } else if all {
        OwnerGroups::Exclude(list)
    } else {
        OwnerGroups::Include(list)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> MapEnv {
        MapEnv::from_pairs(pairs.iter().copied())
    }

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn injected_default_args() {
        // The injector's istio-init args (injection-template.yaml).
        let c = Config::from_args(
            &args(
                &[
                    crate::iptables::ISTIO_INIT_DEFAULT_ARGS,
                    &["--log_output_level=default:info"],
                ]
                .concat(),
            ),
            &env(&[]),
        )
        .unwrap();
        assert_eq!(c.inbound_ports, PortSelection::All);
        assert_eq!(c.inbound_ports_exclude, vec![15090, 15021, 15020]);
        assert_eq!(c.outbound_cidrs_include, CidrSelection::All);
        assert_eq!(c.proxy_gid, vec!["1337"]);
    }

    #[test]
    fn precedence_flag_over_additional_over_primary() {
        let e = env(&[
            ("REDIRECT_DNS", "false"),
            ("ISTIO_META_DNS_CAPTURE", "true"),
        ]);
        assert!(Config::from_args(&[], &e).unwrap().redirect_dns);
        assert!(
            !Config::from_args(&args(&["--redirect-dns=false"]), &e)
                .unwrap()
                .redirect_dns
        );
        let e = env(&[("DROP_INVALID", "true"), ("INVALID_DROP", "false")]);
        assert!(!Config::from_args(&[], &e).unwrap().drop_invalid);
        let e = env(&[("DUAL_STACK", "false"), ("ISTIO_DUAL_STACK", "1")]);
        assert!(Config::from_args(&[], &e).unwrap().dual_stack);
        // An unparseable bool in env is dropped (pflag Set error ignored), not an error.
        let e = env(&[("REDIRECT_DNS", "true"), ("ISTIO_META_DNS_CAPTURE", "")]);
        assert!(Config::from_args(&[], &e).unwrap().redirect_dns);
        // Primary env for string flags; envoy-port has none.
        let e = env(&[("ISTIO_INBOUND_PORTS", "80,81"), ("ENVOY_PORT", "1")]);
        let c = Config::from_args(&[], &e).unwrap();
        assert_eq!(c.inbound_ports, PortSelection::Ports(vec![80, 81]));
        assert_eq!(c.proxy_port, 15001);
        let c = Config::from_args(&args(&["-b", "9"]), &e).unwrap();
        assert_eq!(c.inbound_ports, PortSelection::Ports(vec![9]));
    }

    #[test]
    fn flag_syntaxes() {
        let c = Config::from_args(
            &args(&[
                "-p15002",
                "--inbound-capture-port=15007",
                "-e",
                "15009",
                "-n",
                "--reconcile",
            ]),
            &env(&[]),
        )
        .unwrap();
        assert_eq!(
            (c.proxy_port, c.inbound_capture_port, c.inbound_tunnel_port),
            (15002, 15007, 15009)
        );
        assert!(c.dry_run && c.reconcile);
    }

    #[test]
    fn bad_flags_name_flag_and_value() {
        let cases: &[(&[&str], &str, &str)] = &[
            (
                &["-x", "10.0.0.0/8,*"],
                "--istio-service-exclude-cidr",
                "10.0.0.0/8,*",
            ),
            (&["-p", "abc"], "--envoy-port", "abc"),
            (
                &["-o", "80,http"],
                "--istio-local-outbound-ports-exclude",
                "80,http",
            ),
            (&["-m", "NONE"], "--istio-inbound-interception-mode", "NONE"),
            (
                &["--force-iptables-binary", "iptables"],
                "--force-iptables-binary",
                "iptables",
            ),
            (&["-b", "80,x"], "--istio-inbound-ports", "80,x"),
            (&["-d", "*"], "--istio-local-exclude-ports", "*"),
            (&["-i", "10.0.0.1"], "--istio-service-cidr", "10.0.0.1"),
            (&["--probe-timeout", "5"], "--probe-timeout", "5"),
            (&["--redirect-dns=maybe"], "--redirect-dns", "maybe"),
        ];
        for (a, flag, value) in cases {
            let err = Config::from_args(&args(a), &env(&[]))
                .unwrap_err()
                .to_string();
            assert!(err.contains(flag) && err.contains(value), "{a:?}: {err}");
        }
        let err = Config::from_args(&args(&["--bogus"]), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--bogus"), "{err}");
        let err = Config::from_args(&[], &env(&[("ISTIO_INBOUND_INTERCEPTION_MODE", "X")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("$ISTIO_INBOUND_INTERCEPTION_MODE") && err.contains("\"X\""),
            "{err}"
        );
    }

    #[test]
    fn owner_group_filters() {
        assert_eq!(owner_groups("*", "").unwrap(), OwnerGroups::All);
        assert_eq!(
            owner_groups("java,202", "").unwrap(),
            OwnerGroups::Include(vec!["java".into(), "202".into()])
        );
        assert_eq!(
            owner_groups("*", "888").unwrap(),
            OwnerGroups::Exclude(vec!["888".into()])
        );
        assert!(owner_groups("java", "888").is_err());
    }

    #[test]
    fn owner_ids_and_interface_names() {
        assert_eq!(OwnerId::parse("1337"), Some(OwnerId::Id(1337)));
        assert_eq!(OwnerId::parse("0"), Some(OwnerId::Id(0)));
        assert_eq!(OwnerId::parse("4294967294"), Some(OwnerId::Id(MAX_ID)));
        assert_eq!(OwnerId::parse("1-5"), Some(OwnerId::Range(1, 5)));
        assert_eq!(
            OwnerId::parse("istio-proxy"),
            Some(OwnerId::Name("istio-proxy"))
        );
        assert_eq!(OwnerId::parse("host$"), Some(OwnerId::Name("host$")));
        for bad in [
            "",
            "1337#",
            "13 37",
            "1337;",
            "{1}",
            "\"1\"",
            "4294967295",
            "010",
            "5-1",
            "-1",
            "a\nb",
            "$",
            "a$b",
            "é",
        ] {
            assert_eq!(OwnerId::parse(bad), None, "{bad:?}");
        }
        for ok in [
            "eth0",
            "eth9#",
            "a;{b}",
            "veth+",
            "return",
            "a.b",
            "123456789012345",
        ] {
            assert!(valid_interface(ok), "{ok:?}");
        }
        for bad in [
            "",
            ".",
            "..",
            "+",
            "a/b",
            "a:b",
            "a b",
            "a\tb",
            "a\nb",
            "\"a\"",
            "'a'",
            "a\\b",
            "a*",
            "é",
            "1234567890123456",
        ] {
            assert!(!valid_interface(bad), "{bad:?}");
        }
        // The parsed config keeps each entry; the error names the source.
        let err = Config::from_args(&args(&["-g", "1337,a b"]), &env(&[]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--proxy-gid") && err.contains("\"a b\""),
            "{err}"
        );
        let err = Config::from_args(&[], &env(&[("ISTIO_OUTBOUND_OWNER_GROUPS", "java#")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("$ISTIO_OUTBOUND_OWNER_GROUPS"), "{err}");
    }

    #[test]
    fn loopback_cidr_validation() {
        let e = env(&[("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "127.0.0.1/8")]);
        assert_eq!(
            Config::from_args(&[], &e)
                .unwrap()
                .loopback_cidr
                .to_string(),
            "127.0.0.1/8"
        );
        let e = env(&[("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "10.0.0.0/8")]);
        assert!(Config::from_args(&[], &e).is_err());
    }

    #[test]
    fn durations_and_resolv_conf() {
        assert_eq!(parse_go_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_go_duration("5"), None);
        let (v4, v6) =
            resolv_conf_servers("# x\nnameserver 10.96.0.10\nsearch a\nnameserver fd00::10\n");
        assert_eq!(v4, vec!["10.96.0.10"]);
        assert_eq!(v6, vec!["fd00::10"]);
    }
}
