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

mod detect;
mod env;
mod flags;
#[cfg(test)]
mod tests;
mod validate;
mod values;

pub use detect::{DetectError, resolv_conf_servers};
pub use env::owner_groups;
pub use flags::{FlagInfo, RawValues, collect, flags, usage};
pub use validate::{
    MAX_ID, MAX_IFNAME, NameKind, OwnerId, UnknownOwner, valid_interface, valid_name,
};
pub use values::{parse_go_duration, split};

use flags::go_bool;
use validate::{check_names, parse_names};
use values::{invalid, parse_cidrs, parse_port, parse_ports, parse_u32};

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
