//! Unit tests of flag/env parsing, validation and resolv.conf reading.

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
