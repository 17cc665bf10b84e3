//! Parsing single flag values: ports, CIDRs, numbers, durations, comma lists.

use super::*;

pub(super) fn invalid(source: &str, value: &str, reason: &str) -> ConfigError {
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

pub(super) fn parse_port(src: &str, v: &str) -> Result<u16, ConfigError> {
    let v = v.trim();
    match v.parse::<u16>() {
        Ok(p) if p > 0 && v.bytes().all(|b| b.is_ascii_digit()) => Ok(p),
        _ => Err(invalid(src, v, "expected a port number 1-65535")),
    }
}

pub(super) fn parse_ports(src: &str, v: &str) -> Result<Vec<u16>, ConfigError> {
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

pub(super) fn parse_cidrs(src: &str, v: &str) -> Result<Vec<Cidr>, ConfigError> {
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

pub(super) fn parse_u32(src: &str, v: &str) -> Result<u32, ConfigError> {
    v.trim()
        .parse::<u32>()
        .map_err(|_| invalid(src, v, "expected a non-negative integer"))
}

/// Go `time.ParseDuration`.
pub fn parse_go_duration(v: &str) -> Option<Duration> {
    crate::config::parse_go_duration(v.trim())
}
