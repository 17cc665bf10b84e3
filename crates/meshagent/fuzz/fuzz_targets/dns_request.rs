//! The DNS proxy's request path on arbitrary bytes: `Core::handle` over UDP and TCP, with a
//! table holding every shape (short names, CNAME expansions, wildcard, 40 addresses). Must
//! never panic; a reply must decode and carry the request's ID. Forwarding needs I/O and is
//! not taken here (the decision to forward is).
//!
//! `cargo +nightly fuzz run dns_request` from crates/meshagent (see README, "Fuzzing").
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use meshagent::dns::handler::{Action, Core, Proto};
use meshagent::dns::{LookupTable, NameInfo, NameTable, Scope};

fn core() -> &'static Core {
    static CORE: OnceLock<Core> = OnceLock::new();
    CORE.get_or_init(|| {
        let mut nt = NameTable::default();
        let mut add = |h: &str, reg: &str, ips: Vec<String>| {
            nt.table.insert(
                h.into(),
                NameInfo {
                    ips,
                    registry: reg.into(),
                    shortname: h.split('.').next().unwrap_or_default().into(),
                    namespace: "default".into(),
                    alt_hosts: vec!["alt.example".into()],
                },
            );
        };
        add(
            "a.default.svc.cluster.local",
            "Kubernetes",
            vec!["10.0.0.1".into(), "fd00::1".into()],
        );
        add("*.wild.example.com", "External", vec!["240.240.0.9".into()]);
        add(
            "big.example.com",
            "External",
            (1..=40).map(|i| format!("10.1.0.{i}")).collect(),
        );
        let scope = Scope {
            namespace: "default".into(),
            domain: "default.svc.cluster.local".into(),
            search: vec!["default.svc.cluster.local".into()],
        };
        let table = LookupTable::build(&nt, &scope);
        let (tx, rx) = tokio::sync::watch::channel(Some(Arc::new(table)));
        std::mem::forget(tx);
        Core {
            table: rx,
            upstreams: vec![],
            parallel: false,
            timeout: Duration::from_secs(1),
            forward_before_table: false,
            cache: None,
            pool: Default::default(),
            metrics: meshagent::dns::metrics::Metrics::new(&meshagent::metrics::Registry::new()),
        }
    })
}

fuzz_target!(|data: &[u8]| {
    for proto in [Proto::Udp, Proto::Tcp] {
        if let Action::Reply(b) = core().handle(data, proto) {
            assert!(b.len() >= 12);
            assert_eq!(b[..2], data[..2], "reply ID");
            assert!(b[2] & 0x80 != 0, "QR set on every reply");
            if proto == Proto::Udp && b.len() > 512 {
                // Only a client that sent an OPT may get more than 512 bytes.
                assert!(
                    data.len() > 12 && data[10..12] != [0, 0],
                    "large reply without OPT"
                );
            }
        }
    }
});
