//! Differential: DNS answers of the real pilot-agent's DNS proxy beside meshagent's, both as a
//! pod runs them against the same istiod-box (one NDS table: Kubernetes services, headless
//! services with pod hostnames and pods of two addresses, 40 endpoints, ServiceEntries with
//! addresses, without (auto-allocated), wildcard and multi-host) and the same upstream (a
//! dnsmasq on a loopback address of the test's own, which each agent sees as the only
//! `nameserver` of its `/etc/resolv.conf`: each runs in a mount namespace of its own with the
//! test's file bind-mounted there, testkit `start_agent_with_resolv_conf`).
//!
//! Every question of [`cases`] goes to both over UDP without EDNS, UDP with an EDNS OPT, and
//! TCP (the large ones with more limits); the replies are compared as parsed messages
//! ([`compare`]) and every difference is reported. Where meshagent answers otherwise on
//! purpose the difference is matched to its COMPAT.md row ("Deliberate differences",
//! [`deliberate`]); any other difference fails, and so does a listed one that no case shows
//! any more.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod dns_support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{Record, RecordType};
use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, RunningPod, mesh_with_free_ports, start_agent_with_resolv_conf,
};
use meshagent_testkit::{Sidecar, free_port, http_get, json, wait_for, workspace_root};

use dns_support::{Dnsmasq, query, tcp, udp};

/// The upstream's address (the 127.0.53.x of this test; port 53, as resolv.conf implies).
const UPSTREAM: &str = "127.0.53.60";
/// The pod's resolv.conf as kubelet writes it for namespace `default`.
const SEARCH: &str = "search default.svc.cluster.local svc.cluster.local cluster.local\n";
const NDS_TYPE: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";
/// Until both agents hold the NDS table: istiod's first push after the agent connects.
const NDS: Duration = Duration::from_secs(90);

/// The mesh: what istiod-box turns into the NDS table. Hosts (registry Kubernetes unless
/// said): `svc1` (default, 10.96.1.1), `svc2` (ns2), headless `hl` (two pods with hostname
/// and subdomain, so `hl-0.hl...` names too), headless `mip` (one pod with an IPv4 and an
/// IPv6 address, one EndpointSlice per family), headless `many` (40 endpoints, no pods);
/// ServiceEntries `ext.example.com` (two addresses), `*.wild.example.com`, `m1.example.com` +
/// `m2.internal` (one entry, two hosts), `noaddr.example.com` (no address: istiod-box's
/// `--legacy-ip-autoallocate` allocates one for proxies with `ISTIO_META_DNS_AUTO_ALLOCATE`),
/// `v6only.example.com` (an IPv6 address only, which istiod leaves out for an IPv4 proxy).
fn config() -> String {
    let mut y = String::new();
    let doc = |y: &mut String, s: &str| {
        y.push_str(s.trim_start_matches('\n'));
        y.push_str("---\n");
    };
    doc(
        &mut y,
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ns2\n",
    );
    // The two agents' pods: the same labels and account, one address each.
    for (name, ip) in [("dnsp-5f7d9", "127.0.60.2"), ("dnsm-5f7d9", "127.0.60.3")] {
        let pod = RunningPod {
            name,
            namespace: "default",
            labels: &[("app", "client")],
            service_account: Some("client"),
            hostname: None,
            ips: &[ip],
        };
        doc(&mut y, &pod.yaml());
    }
    for (name, ns, ip) in [
        ("svc1", "default", "10.96.1.1"),
        ("svc2", "ns2", "10.96.2.2"),
    ] {
        doc(
            &mut y,
            &format!(
                r#"
apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: {ns}
spec:
  clusterIP: {ip}
  ports:
  - name: http
    port: 80
"#
            ),
        );
    }
    let headless = |name: &str| {
        format!(
            r#"
apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: default
spec:
  clusterIP: None
  selector:
    app: {name}
  ports:
  - name: tcp
    port: 5432
"#
        )
    };
    let pod = |name: &str, app: &str, ips: &[&str]| {
        RunningPod {
            name,
            namespace: "default",
            labels: &[("app", app)],
            service_account: None,
            hostname: Some((name, app)),
            ips,
        }
        .yaml()
    };
    let slice = |name: &str, svc: &str, family: &str, eps: &[(&str, Option<&str>)]| {
        let mut s = format!(
            r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: default
  labels:
    kubernetes.io/service-name: {svc}
addressType: {family}
ports:
- name: tcp
  port: 5432
  protocol: TCP
endpoints:
"#
        );
        for (ip, pod) in eps {
            s.push_str(&format!(
                "- addresses: [\"{ip}\"]\n  conditions:\n    ready: true\n"
            ));
            if let Some(p) = pod {
                s.push_str(&format!(
                    "  hostname: {p}\n  targetRef:\n    kind: Pod\n    name: {p}\n    namespace: default\n"
                ));
            }
        }
        s
    };
    doc(&mut y, &headless("hl"));
    doc(&mut y, &pod("hl-0", "hl", &["10.1.0.10"]));
    doc(&mut y, &pod("hl-1", "hl", &["10.1.0.11"]));
    doc(
        &mut y,
        &slice(
            "hl-x1",
            "hl",
            "IPv4",
            &[("10.1.0.10", Some("hl-0")), ("10.1.0.11", Some("hl-1"))],
        ),
    );
    doc(&mut y, &headless("mip"));
    doc(&mut y, &pod("mip-0", "mip", &["10.1.1.1", "fd00::1:1"]));
    doc(
        &mut y,
        &slice("mip-v4", "mip", "IPv4", &[("10.1.1.1", Some("mip-0"))]),
    );
    doc(
        &mut y,
        &slice("mip-v6", "mip", "IPv6", &[("fd00::1:1", Some("mip-0"))]),
    );
    doc(&mut y, &headless("many"));
    let many: Vec<String> = (1..=40).map(|i| format!("10.2.0.{i}")).collect();
    let many: Vec<(&str, Option<&str>)> = many.iter().map(|ip| (ip.as_str(), None)).collect();
    doc(&mut y, &slice("many-x1", "many", "IPv4", &many));
    let se = |name: &str, hosts: &[&str], addresses: &[&str], resolution: &str| {
        let q = |v: &[&str]| {
            v.iter()
                .map(|s| format!("\"{s}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            r#"
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata:
  name: {name}
  namespace: default
spec:
  hosts: [{}]
  addresses: [{}]
  ports:
  - number: 80
    name: http
    protocol: HTTP
  location: MESH_EXTERNAL
  resolution: {resolution}
"#,
            q(hosts),
            q(addresses)
        )
    };
    doc(
        &mut y,
        &se(
            "ext",
            &["ext.example.com"],
            &["240.1.0.1", "240.1.0.2"],
            "DNS",
        ),
    );
    doc(
        &mut y,
        &se("wild", &["*.wild.example.com"], &["240.1.0.9"], "NONE"),
    );
    doc(
        &mut y,
        &se(
            "multi",
            &["m1.example.com", "m2.internal"],
            &["240.1.0.3"],
            "DNS",
        ),
    );
    doc(&mut y, &se("noaddr", &["noaddr.example.com"], &[], "DNS"));
    doc(
        &mut y,
        &se(
            "v6only",
            &["v6only.example.com"],
            &["2001:db8::5"],
            "STATIC",
        ),
    );
    y
}

/// Hosts both agents must hold before the comparison starts (a sanity check that NDS reached
/// them, not an expected answer).
const HOSTS: &[&str] = &[
    "svc1.default.svc.cluster.local",
    "svc2.ns2.svc.cluster.local",
    "hl.default.svc.cluster.local",
    "hl-0.hl.default.svc.cluster.local",
    "mip.default.svc.cluster.local",
    "mip-0.mip.default.svc.cluster.local",
    "many.default.svc.cluster.local",
    "ext.example.com",
    "*.wild.example.com",
    "m1.example.com",
    "m2.internal",
    "noaddr.example.com",
];

/// How a question is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// UDP without EDNS (a 512-byte limit).
    Udp,
    /// UDP with an OPT of this payload size.
    UdpEdns(u16),
    Tcp,
}

/// The questions: every one is asked over UDP, UDP with EDNS 1232 and TCP; the large answers
/// also with EDNS 4096.
fn cases() -> Vec<(String, RecordType, Via)> {
    use RecordType::{A, AAAA, MX, TXT};
    let names: &[(&str, RecordType)] = &[
        // Short names and search domains of a service in the proxy's namespace.
        ("svc1.", A),
        ("svc1.default.", A),
        ("svc1.default.svc.", A),
        ("svc1.default.svc.cluster.local.", A),
        ("SVC1.Default.Svc.Cluster.Local.", A),
        // Known name, no IPv6 address: NOERROR with no answers, not NXDOMAIN.
        ("svc1.default.svc.cluster.local.", AAAA),
        ("svc1.", AAAA),
        // The FQDN with the first search domain appended (a resolver's first try).
        (
            "svc1.default.svc.cluster.local.default.svc.cluster.local.",
            A,
        ),
        // Other types of a mesh name go upstream.
        ("svc1.default.svc.cluster.local.", TXT),
        ("svc1.default.svc.cluster.local.", MX),
        // Another namespace: no bare short name; the search-domain CNAME.
        ("svc2.", A),
        ("svc2.ns2.", A),
        ("svc2.ns2.svc.", A),
        ("svc2.ns2.svc.cluster.local.", A),
        ("svc2.ns2.default.svc.cluster.local.", A),
        ("svc2.ns2.default.svc.cluster.local.", AAAA),
        ("svc2.ns2.svc.cluster.local.", AAAA),
        // Headless: every ready endpoint; per-pod names and their short forms.
        ("hl.default.svc.cluster.local.", A),
        ("hl.", A),
        ("hl-0.hl.default.svc.cluster.local.", A),
        ("hl-1.hl.default.", A),
        ("hl-0.hl.", A),
        ("hl-0.hl.default.svc.cluster.local.", AAAA),
        // A pod with an IPv4 and an IPv6 address.
        ("mip.default.svc.cluster.local.", A),
        ("mip.default.svc.cluster.local.", AAAA),
        ("mip-0.mip.default.svc.cluster.local.", A),
        ("mip-0.mip.default.svc.cluster.local.", AAAA),
        ("mip.", AAAA),
        // 40 endpoints: 16 bytes an answer, over 512.
        ("many.default.svc.cluster.local.", A),
        ("many.", A),
        ("many.default.svc.cluster.local.", AAAA),
        // ServiceEntries.
        ("ext.example.com.", A),
        ("ext.example.com.", AAAA),
        ("Ext.Example.Com.", A),
        ("ext.example.com.default.svc.cluster.local.", A),
        ("ext.", A),
        ("a.wild.example.com.", A),
        ("x.y.wild.example.com.", A),
        ("a.wild.example.com.", AAAA),
        ("wild.example.com.", A),
        ("a.wild.example.com.default.svc.cluster.local.", A),
        ("m1.example.com.", A),
        ("m2.internal.", A),
        ("noaddr.example.com.", A),
        ("noaddr.example.com.", AAAA),
        ("v6only.example.com.", AAAA),
        // Unknown names: the upstream's answers relayed.
        ("up.test.local.", A),
        ("up.test.local.", AAAA),
        ("x.nx.test.local.", A),
        ("up.test.local.default.svc.cluster.local.", A),
        ("big.test.local.", TXT),
    ];
    let mut out = Vec::new();
    for (name, ty) in names {
        let mut vias = vec![Via::Udp, Via::UdpEdns(1232), Via::Tcp];
        if name.starts_with("many.") || name.starts_with("big.") {
            vias.push(Via::UdpEdns(4096));
        }
        for via in vias {
            out.push(((*name).to_owned(), *ty, via));
        }
    }
    out
}

async fn ask(addr: SocketAddr, name: &str, ty: RecordType, via: Via) -> (Message, usize) {
    match via {
        Via::Udp => udp(addr, &query(name, ty, None)).await,
        Via::UdpEdns(n) => udp(addr, &query(name, ty, Some(n))).await,
        Via::Tcp => tcp(addr, &query(name, ty, None)).await,
    }
}

/// One record as compared: owner, type, class, TTL, data.
fn rr(r: &Record) -> String {
    format!(
        "{} {} {} {} {}",
        r.name,
        r.ttl,
        r.dns_class,
        r.record_type(),
        r.data
    )
}

fn sorted(rs: &[Record]) -> Vec<String> {
    let mut v: Vec<String> = rs.iter().map(rr).collect();
    v.sort();
    v
}

/// The differences between pilot-agent's reply `p` and meshagent's `m`, as
/// (field, pilot-agent's, meshagent's).
///
/// Compared: ID, QR, opcode, RCODE (extended included), AA, TC, RD, RA, AD, CD; the question
/// section; answer, authority and additional records (owner, TTL, class, type, data)
/// order-insensitively, and the order of the answers' types (a CNAME before the addresses it
/// leads to); the OPT (present, payload size, version, DO); the reply fitting the client's
/// limit.
///
/// Ignored, and why:
/// * the order of records of one type: Istio shuffles the addresses of every local answer
///   (`pkg/dns/client/dns.go` `roundRobinResponse`), meshagent too;
/// * which records a truncated (TC) answer keeps: the shuffle comes first, so any subset of
///   the full answer is right; the number kept, and every field but the data, are compared;
/// * the bytes on the wire (name compression, record order): the same message encoded
///   otherwise; only the size against the limit is checked.
fn compare(
    p: &Message,
    m: &Message,
    pn: usize,
    mn: usize,
    limit: usize,
) -> Vec<(String, String, String)> {
    let mut d = Vec::new();
    let mut diff = |field: &str, a: String, b: String| {
        if a != b {
            d.push((field.to_owned(), a, b));
        }
    };
    let (pm, mm) = (&p.metadata, &m.metadata);
    diff("id", pm.id.to_string(), mm.id.to_string());
    diff(
        "qr",
        format!("{:?}", pm.message_type),
        format!("{:?}", mm.message_type),
    );
    diff(
        "opcode",
        format!("{:?}", pm.op_code),
        format!("{:?}", mm.op_code),
    );
    diff(
        "rcode",
        format!("{:?}", pm.response_code),
        format!("{:?}", mm.response_code),
    );
    diff(
        "aa",
        pm.authoritative.to_string(),
        mm.authoritative.to_string(),
    );
    diff("tc", pm.truncation.to_string(), mm.truncation.to_string());
    diff(
        "rd",
        pm.recursion_desired.to_string(),
        mm.recursion_desired.to_string(),
    );
    diff(
        "ra",
        pm.recursion_available.to_string(),
        mm.recursion_available.to_string(),
    );
    diff(
        "ad",
        pm.authentic_data.to_string(),
        mm.authentic_data.to_string(),
    );
    diff(
        "cd",
        pm.checking_disabled.to_string(),
        mm.checking_disabled.to_string(),
    );
    let qs = |x: &Message| {
        x.queries
            .iter()
            .map(|q| format!("{} {} {}", q.name(), q.query_class(), q.query_type()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    diff("question", qs(p), qs(m));
    let types = |x: &Message| {
        let mut t: Vec<String> = x
            .answers
            .iter()
            .map(|r| r.record_type().to_string())
            .collect();
        t.dedup();
        t.join(" ")
    };
    diff("answer type order", types(p), types(m));
    if pm.truncation && mm.truncation {
        // Any subset of the shuffled answer: all but the data.
        let shape = |x: &Message| {
            let mut v: Vec<String> = x
                .answers
                .iter()
                .map(|r| format!("{} {} {} {}", r.name, r.ttl, r.dns_class, r.record_type()))
                .collect();
            v.sort();
            v.join("\n")
        };
        diff("answers (truncated, data ignored)", shape(p), shape(m));
    } else {
        diff(
            "answers",
            sorted(&p.answers).join("\n"),
            sorted(&m.answers).join("\n"),
        );
    }
    diff(
        "authority",
        sorted(&p.authorities).join("\n"),
        sorted(&m.authorities).join("\n"),
    );
    diff(
        "additional",
        sorted(&p.additionals).join("\n"),
        sorted(&m.additionals).join("\n"),
    );
    let opt = |x: &Message| match &x.edns {
        None => "none".to_owned(),
        Some(e) => format!(
            "payload {} version {} do {}",
            e.max_payload(),
            e.version(),
            e.flags().dnssec_ok
        ),
    };
    diff("opt", opt(p), opt(m));
    diff(
        "fits the limit",
        (pn <= limit).to_string(),
        (mn <= limit).to_string(),
    );
    d
}

/// COMPAT.md rows ("Deliberate differences", first column) this test checks.
const ROW_RA: &str = "RA in the DNS proxy's own replies";
const ROW_OPT: &str = "the DNS proxy's own replies to a query with EDNS";
const ROWS: &[&str] = &[ROW_RA, ROW_OPT];

/// A difference meshagent makes on purpose: the COMPAT.md row whose behaviour it is. Replies
/// the agents relay from the upstream carry its RA and OPT (dnsmasq sets RA and answers an
/// OPT with one), so these fields differ only in replies an agent writes itself.
fn deliberate(via: Via, d: &(String, String, String)) -> Option<&'static str> {
    match (d.0.as_str(), d.1.as_str(), d.2.as_str()) {
        // Istio answers with miekg's `SetReply`, which leaves RA clear
        // (`pkg/dns/client/dns.go` `ServeDNS`).
        ("ra", "false", "true") => Some(ROW_RA),
        // `SetReply` copies no OPT; meshagent echoes the client's payload size (at least 512).
        ("opt", "none", m) => match via {
            Via::UdpEdns(n) if m == format!("payload {} version 0 do false", n.max(512)) => {
                Some(ROW_OPT)
            }
            _ => None,
        },
        _ => None,
    }
}

async fn ndsz(sc: &Sidecar) -> Option<serde_json::Value> {
    match http_get(sc.status, "/debug/ndsz").await {
        Ok((200, body)) => serde_json::from_str(&body).ok(),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_answers_match_pilot_agent() {
    let started = tokio::time::Instant::now();
    let mut flags: Vec<String> = (0..14)
        .map(|i| format!("--txt-record=big.test.local,{i:02}{}", "x".repeat(248)))
        .collect();
    flags.extend([
        "--address=/nx.test.local/".to_owned(),
        "--edns-packet-max=4096".to_owned(),
        "--txt-record=svc1.default.svc.cluster.local,from-upstream".to_owned(),
        "--mx-host=svc1.default.svc.cluster.local,mail.test.local,10".to_owned(),
    ]);
    let upstream = Dnsmasq::start(UPSTREAM, "10.9.9.9 up.test.local\n", &flags).await;
    let dir = tempfile::tempdir().unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(
        &resolv,
        format!("nameserver {UPSTREAM}\n{SEARCH}options ndots:5\n"),
    )
    .unwrap();

    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&config(), Some(&mesh), &["--legacy-ip-autoallocate"]).await;
    let mut agents = Vec::new();
    for (kind, workload, ip) in [
        (AgentKind::PilotAgent, "dnsp", "127.0.60.2"),
        (AgentKind::Meshagent, "dnsm", "127.0.60.3"),
    ] {
        let dns = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let dns_env = dns.to_string();
        let env = [
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("ISTIO_META_DNS_AUTO_ALLOCATE", "true"),
            ("DNS_PROXY_ADDR", dns_env.as_str()),
        ];
        let pod = PodSpec {
            workload,
            namespace: "default",
            service_account: "client",
            ip,
            proxy_config: json!({}),
            env: &env,
        };
        let sc = start_agent_with_resolv_conf(&istiod, kind, &pod, Some(&resolv)).await;
        agents.push((kind, sc, dns));
    }
    // NDS reached both (their /debug/ndsz), and the tables are the same.
    let mut tables = Vec::new();
    for (kind, sc, _) in &agents {
        let t = wait_for(&format!("{kind:?} to hold the NDS table"), NDS, || async {
            let t = ndsz(sc).await?;
            HOSTS
                .iter()
                .all(|h| t["table"].get(*h).is_some())
                .then_some(t)
        })
        .await;
        tables.push(t);
    }
    assert_eq!(
        tables[0], tables[1],
        "/debug/ndsz differs (pilot-agent's, then meshagent's)"
    );
    // istiod's side: both connections watch the NDS type (`/debug/adsz`).
    let adsz = istiod.debug_json("/debug/adsz").await;
    for pod in ["dnsp-5f7d9.default", "dnsm-5f7d9.default"] {
        let watching = adsz["clients"].as_array().into_iter().flatten().any(|c| {
            c["connectionId"]
                .as_str()
                .is_some_and(|id| id.starts_with(pod))
                && c["watches"].get(NDS_TYPE).is_some()
        });
        assert!(watching, "istiod lists no NDS watch of {pod}: {adsz}");
    }
    let (p_addr, m_addr) = (agents[0].2, agents[1].2);

    let mut unlisted = Vec::new();
    let mut seen: BTreeMap<&'static str, usize> = BTreeMap::new();
    // What pilot-agent's replies showed, to check that the cases reach what they are meant
    // to (not what either agent should answer).
    let mut shown: BTreeMap<&'static str, usize> = BTreeMap::new();
    let cases = cases();
    for (name, ty, via) in &cases {
        let (p, pn) = ask(p_addr, name, *ty, *via).await;
        let (m, mn) = ask(m_addr, name, *ty, *via).await;
        let limit = match via {
            Via::Udp => 512,
            Via::UdpEdns(n) => usize::from(*n),
            Via::Tcp => 65535,
        };
        let pm = &p.metadata;
        for (what, yes) in [
            // The agent's own answers carry Istio's TTL, 30 s; dnsmasq's its local TTL, 0.
            (
                "local answer",
                pm.authoritative && p.answers.iter().any(|r| r.ttl == 30),
            ),
            (
                "local NOERROR, no answers",
                pm.authoritative
                    && pm.response_code == ResponseCode::NoError
                    && p.answers.is_empty(),
            ),
            (
                "forwarded answer",
                p.answers.iter().any(|r| r.ttl == 0) && pn <= limit,
            ),
            ("NXDOMAIN", pm.response_code == ResponseCode::NXDomain),
            ("truncated", pm.truncation),
            ("over 512 bytes", pn > 512),
            (
                "CNAME",
                p.answers
                    .iter()
                    .any(|r| r.record_type() == RecordType::CNAME),
            ),
            (
                "AAAA record",
                p.answers
                    .iter()
                    .any(|r| r.record_type() == RecordType::AAAA),
            ),
        ] {
            if yes {
                *shown.entry(what).or_default() += 1;
            }
        }
        for d in compare(&p, &m, pn, mn, limit) {
            match deliberate(*via, &d) {
                Some(row) => *seen.entry(row).or_default() += 1,
                None => unlisted.push(format!(
                    "{name} {ty} {via:?}: {}\n    pilot-agent: {}\n    meshagent:   {}",
                    d.0,
                    d.1.replace('\n', "\n                 "),
                    d.2.replace('\n', "\n                 ")
                )),
            }
        }
    }
    assert_eq!(
        shown.len(),
        8,
        "pilot-agent's replies lack a kind the cases are meant to reach: {shown:?}"
    );
    let compat = std::fs::read_to_string(workspace_root().join("COMPAT.md")).unwrap();
    for row in ROWS {
        assert!(
            compat.contains(&format!("\n| {row} |")),
            "COMPAT.md has no row {row:?}"
        );
    }
    let gone: Vec<&&str> = ROWS.iter().filter(|r| !seen.contains_key(**r)).collect();
    eprintln!(
        "{} cases in {:?}; pilot-agent's replies: {shown:?}; deliberate differences seen: {seen:?}",
        cases.len(),
        started.elapsed()
    );
    assert!(
        unlisted.is_empty() && gone.is_empty(),
        "{} differences not in COMPAT.md:\n{}\nlisted differences no case shows any more: {gone:?}",
        unlisted.len(),
        unlisted.join("\n")
    );
    drop(upstream);
}
