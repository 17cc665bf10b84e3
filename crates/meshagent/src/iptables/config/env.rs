//! Building a [`Config`] from the raw values and the environment.

use super::*;

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
}

/// uid of `ENVOY_USER` (default `istio-proxy`), else Istio's default 1337.
pub(super) fn envoy_user_uid(env: &dyn Env) -> String {
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
