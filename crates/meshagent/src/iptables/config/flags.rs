//! The flag table (long, short, env names) and collecting raw values from the command line and
//! the environment with Istio's precedence.

use super::*;

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
    pub(super) fn get(&self, long: &str) -> Option<(&str, &str)> {
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
pub(super) fn go_bool(v: &str) -> Option<bool> {
    crate::config::parse_go_bool(v)
}

/// Applies env then flags (Istio's precedence) and returns the raw values.
///
/// Why this is not clap, like the rest of the CLI: clap can be made to accept pflag's syntax
/// (`--flag=value`, `--flag value`, `-xv`, bools as `--x`/`--x=false` with `num_args(0..=1)`,
/// `require_equals` and `default_missing_value`, repeats with `overrides_with`, and an
/// `UnknownArgument` error rewritten to `unknown flag: --x`), but not the rest of what
/// `tools/istio-iptables/pkg/cmd/root.go` does through viper: a flag bound to a primary and
/// further environment variables where the later one wins, an unparseable boolean in the
/// environment ignored with a warning while the same value on the command line is an error,
/// Go's `strconv.ParseBool` spellings (clap's boolish parser also takes `yes`/`on`), and the
/// source of each value (`--flag` or `$VAR`) named in validation errors. Each of those would
/// need this table beside clap's, so one parser would become two that must agree; cobra's
/// `--help` layout (checked byte for byte against the real binary by `tests/compat_cli.rs`)
/// is rendered from this table too ([`usage`]).
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
