//! The flag table (long, short, env names) and collecting raw values from the command line and
//! the environment with Istio's precedence.

use super::*;

/// How a flag takes its value.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Str,
    Bool,
}

/// One flag: long name, short letter, primary env (None = not bound), additional env names.
struct Spec {
    long: &'static str,
    short: Option<char>,
    kind: Kind,
    env: Option<&'static str>,
    extra_env: &'static [&'static str],
}

const fn s(long: &'static str, short: Option<char>, env: Option<&'static str>) -> Spec {
    Spec {
        long,
        short,
        kind: Kind::Str,
        env,
        extra_env: &[],
    }
}

const fn b(long: &'static str, env: &'static str, extra_env: &'static [&'static str]) -> Spec {
    Spec {
        long,
        short: None,
        kind: Kind::Bool,
        env: Some(env),
        extra_env,
    }
}

/// Every flag of Istio's `istio-iptables` (tools/istio-iptables/pkg/cmd/root.go
/// `bindCmdlineFlags`), plus the root logging flags pilot-agent accepts on every subcommand.
const SPECS: &[Spec] = &[
    // `--envoy-port` is the one port flag without an env binding.
    s("envoy-port", Some('p'), None),
    s(
        "inbound-capture-port",
        Some('z'),
        Some("INBOUND_CAPTURE_PORT"),
    ),
    s(
        "inbound-tunnel-port",
        Some('e'),
        Some("INBOUND_TUNNEL_PORT"),
    ),
    s("proxy-uid", Some('u'), Some("PROXY_UID")),
    s("proxy-gid", Some('g'), Some("PROXY_GID")),
    s(
        "istio-inbound-interception-mode",
        Some('m'),
        Some("ISTIO_INBOUND_INTERCEPTION_MODE"),
    ),
    s(
        "istio-inbound-ports",
        Some('b'),
        Some("ISTIO_INBOUND_PORTS"),
    ),
    s(
        "istio-local-exclude-ports",
        Some('d'),
        Some("ISTIO_LOCAL_EXCLUDE_PORTS"),
    ),
    s(
        "istio-exclude-interfaces",
        Some('c'),
        Some("ISTIO_EXCLUDE_INTERFACES"),
    ),
    s("istio-service-cidr", Some('i'), Some("ISTIO_SERVICE_CIDR")),
    s(
        "istio-service-exclude-cidr",
        Some('x'),
        Some("ISTIO_SERVICE_EXCLUDE_CIDR"),
    ),
    s(
        "istio-outbound-ports",
        Some('q'),
        Some("ISTIO_OUTBOUND_PORTS"),
    ),
    s(
        "istio-local-outbound-ports-exclude",
        Some('o'),
        Some("ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE"),
    ),
    s(
        "kube-virt-interfaces",
        Some('k'),
        Some("KUBE_VIRT_INTERFACES"),
    ),
    s(
        "istio-inbound-tproxy-mark",
        Some('t'),
        Some("ISTIO_INBOUND_TPROXY_MARK"),
    ),
    s(
        "istio-inbound-tproxy-route-table",
        Some('r'),
        Some("ISTIO_INBOUND_TPROXY_ROUTE_TABLE"),
    ),
    Spec {
        long: "dry-run",
        short: Some('n'),
        kind: Kind::Bool,
        env: Some("DRY_RUN"),
        extra_env: &[],
    },
    s("iptables-probe-port", None, Some("IPTABLES_PROBE_PORT")),
    s("probe-timeout", None, Some("PROBE_TIMEOUT")),
    b("skip-rule-apply", "SKIP_RULE_APPLY", &[]),
    b("run-validation", "RUN_VALIDATION", &[]),
    b("redirect-dns", "REDIRECT_DNS", &["ISTIO_META_DNS_CAPTURE"]),
    b("drop-invalid", "DROP_INVALID", &["INVALID_DROP"]),
    b("dual-stack", "DUAL_STACK", &["ISTIO_DUAL_STACK"]),
    b("capture-all-dns", "CAPTURE_ALL_DNS", &[]),
    s("network-namespace", None, Some("NETWORK_NAMESPACE")),
    b("cni-mode", "CNI_MODE", &[]),
    b("reconcile", "RECONCILE", &[]),
    b("cleanup-only", "CLEANUP_ONLY", &[]),
    b("force-apply", "FORCE_APPLY", &[]),
    b("native-nftables", "NATIVE_NFTABLES", &[]),
    s("force-iptables-binary", None, Some("FORCE_IPTABLES_BINARY")),
    // Root (pilot-agent) logging flags: accepted here as on every subcommand.
    s("log_output_level", None, None),
    s("log_target", None, None),
    s("log_caller", None, None),
    s("log_stacktrace_level", None, None),
    Spec {
        long: "log_as_json",
        short: None,
        kind: Kind::Bool,
        env: None,
        extra_env: &[],
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
        })
        .collect()
}

/// `istio-iptables --help`: every flag with its short letter and env names.
pub fn usage() -> String {
    let mut out = String::from(
        "Set up iptables (or native nftables) rules for the Istio sidecar.\n\nUsage:\n  istio-iptables [flags]\n\nFlags:\n",
    );
    for s in SPECS {
        let short = s
            .short
            .map_or_else(|| "    ".to_owned(), |c| format!("-{c}, "));
        let value = if s.kind == Kind::Str { " string" } else { "" };
        let mut envs: Vec<String> = s.env.iter().map(|e| format!("${e}")).collect();
        envs.extend(s.extra_env.iter().map(|e| format!("${e}")));
        let envs = if envs.is_empty() {
            String::new()
        } else {
            format!("  (env {})", envs.join(", "))
        };
        out.push_str(&format!("  {short}--{}{value}{envs}\n", s.long));
    }
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
