//! The DNS proxy answering from the NDS table that devplane (stand-in istiod) sends through
//! the agent's xDS proxy to a real Envoy: every expansion form, CNAME chains, wildcards,
//! families, sizes — over UDP and TCP, with hickory-proto messages and with `dig`.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod dns_support;
mod status_support;
mod xds_support;

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use meshagent::dns::NameInfo;
use meshagent_proto::type_url;
use meshagent_testkit::{DEADLINE, Devplane, wait_for};
use prost::Message as _;

use dns_support::*;
use xds_support::*;

#[tokio::test(flavor = "multi_thread")]
async fn mesh_names_answered_from_the_nds_table() {
    let dp = Devplane::start(&mesh_yaml(false)).await;
    // devplane's own table plus every shape the proxy must handle.
    dp.set_resource(type_url::NAME_TABLE, "", &mesh_table().encode_to_vec())
        .await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[("ISTIO_META_DNS_CAPTURE", "true")]).await;
    // No upstream is needed: every name here is local. (An unreachable one proves it.)
    let proxy = Proxy::start(
        &format!("nameserver 127.0.53.254\n{SEARCH}"),
        agent.handle.name_table(),
        |_| {},
    )
    .await;
    let addr = proxy.addr;

    // Before the table: SERVFAIL at once, not a hang.
    let (m, _) = udp(addr, &query("api.example.com.", RecordType::A, None)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);

    let (_envoy, _sds) = envoy_through(&dp, &agent, dir.path(), false).await;
    wait_for("the table in the DNS proxy", DEADLINE, || async {
        let (m, _) = udp(addr, &query("api.example.com.", RecordType::A, None)).await;
        (m.metadata.response_code == ResponseCode::NoError).then_some(())
    })
    .await;

    for proto in ["udp", "tcp"] {
        let ask = |name: &'static str, ty: RecordType| async move {
            let q = query(name, ty, Some(1232));
            if proto == "udp" {
                udp(addr, &q).await.0
            } else {
                tcp(addr, &q).await.0
            }
        };
        let a = |name: &'static str| async move {
            let m = ask(name, RecordType::A).await;
            assert_eq!(m.metadata.response_code, ResponseCode::NoError, "{name}");
            assert!(m.metadata.authoritative, "{name}: AA");
            assert!(m.metadata.recursion_available, "{name}: RA");
            assert!(m.edns.is_some(), "{name}: EDNS echoed");
            for r in &m.answers {
                assert_eq!(r.ttl, 30, "{name}");
            }
            answers(&m)
        };
        // FQDN, name.ns., short name in the proxy's namespace, name.ns.svc.
        assert_eq!(
            a("productpage.default.svc.cluster.local.").await,
            ["productpage.default.svc.cluster.local. A 10.0.0.1"]
        );
        assert_eq!(
            a("productpage.default.").await,
            ["productpage.default. A 10.0.0.1"]
        );
        assert_eq!(a("productpage.").await, ["productpage. A 10.0.0.1"]);
        assert_eq!(
            a("productpage.default.svc.").await,
            ["productpage.default.svc. A 10.0.0.1"]
        );
        assert_eq!(a("reviews.ns2.").await, ["reviews.ns2. A 10.0.0.2"]);
        // devplane's own services arrive too (devplane's table merged with ours).
        assert_eq!(
            ask("reviews.", RecordType::A).await.metadata.response_code,
            ResponseCode::ServFail,
            "a short name of another namespace is not local (forwarded; the upstream is down)"
        );
        // The first search domain's CNAME chain: a stub resolver asks `reviews.ns2.` with
        // the search suffix appended first.
        assert_eq!(
            a("reviews.ns2.default.svc.cluster.local.").await,
            [
                "reviews.ns2. A 10.0.0.2",
                "reviews.ns2.default.svc.cluster.local. CNAME reviews.ns2."
            ]
        );
        assert_eq!(
            a("api.example.com.default.svc.cluster.local.").await,
            [
                "api.example.com. A 240.240.0.1",
                "api.example.com.default.svc.cluster.local. CNAME api.example.com."
            ]
        );
        // Case-insensitive; owner names are the lower-cased keys (Istio).
        assert_eq!(
            a("ProductPage.Default.SVC.cluster.local.").await,
            ["productpage.default.svc.cluster.local. A 10.0.0.1"]
        );
        // Wildcards at any depth, renamed to the question.
        assert_eq!(
            a("x.wild.example.com.").await,
            ["x.wild.example.com. A 240.240.0.9"]
        );
        assert_eq!(
            a("a.b.c.wild.example.com.").await,
            ["a.b.c.wild.example.com. A 240.240.0.9"]
        );
        // AAAA on a v4-only name: NOERROR, no answers, never NXDOMAIN; through the CNAME
        // too (and then no CNAME either, as Istio).
        for name in [
            "productpage.default.svc.cluster.local.",
            "api.example.com.default.svc.cluster.local.",
        ] {
            let m = ask(name, RecordType::AAAA).await;
            assert_eq!(m.metadata.response_code, ResponseCode::NoError, "{name}");
            assert!(m.answers.is_empty(), "{name}: {:?}", m.answers);
        }
        // Dual stack.
        assert_eq!(
            answers(&ask("dual.default.svc.cluster.local.", RecordType::AAAA).await),
            ["dual.default.svc.cluster.local. AAAA fd00::3"]
        );
        assert_eq!(a("dual.").await, ["dual. A 10.0.0.3"]);
    }

    // The 40-address host: without EDNS over UDP it does not fit in 512 bytes: TC=1.
    let (m, size) = udp(addr, &query("big.example.com.", RecordType::A, None)).await;
    assert!(m.metadata.truncation, "TC=1 without EDNS");
    assert!(size <= 512, "{size} bytes");
    assert!(m.answers.len() < 40);
    // Complete over TCP.
    let (m, _) = tcp(addr, &query("big.example.com.", RecordType::A, None)).await;
    assert!(!m.metadata.truncation);
    assert_eq!(m.answers.len(), 40);
    // With EDNS 1232 and 4096 it fits (16 bytes a record with name compression).
    for size in [1232, 4096] {
        let (m, n) = udp(addr, &query("big.example.com.", RecordType::A, Some(size))).await;
        assert!(!m.metadata.truncation, "EDNS {size}");
        assert_eq!(m.answers.len(), 40, "EDNS {size}");
        assert!(n <= size as usize);
        assert_eq!(m.edns.as_ref().unwrap().max_payload(), size);
    }
    // Shuffled per response: the order changes across a few answers.
    let mut orders = std::collections::BTreeSet::new();
    for _ in 0..8 {
        let (m, _) = tcp(addr, &query("big.example.com.", RecordType::A, None)).await;
        orders.insert(format!(
            "{:?}",
            m.answers
                .iter()
                .map(|r| r.data.to_string())
                .collect::<Vec<_>>()
        ));
    }
    assert!(
        orders.len() > 1,
        "40 addresses came back in one order 8 times"
    );

    // dig, an independent resolver client: UDP (EDNS by default), TCP, and no EDNS.
    let out = dig(addr, &["+short", "productpage"]);
    assert_eq!(out.trim(), "10.0.0.1", "{out}");
    let out = dig(
        addr,
        &["+tcp", "+short", "reviews.ns2.default.svc.cluster.local"],
    );
    assert_eq!(out.trim(), "reviews.ns2.\n10.0.0.2", "{out}");
    let out = dig(addr, &["+noedns", "+ignore", "big.example.com"]);
    assert!(out.contains(" tc"), "{out}");
    assert!(out.contains("flags: qr aa tc rd ra"), "{out}");
    let out = dig(addr, &["+noedns", "big.example.com"]);
    // dig retries over TCP on TC=1 and gets all 40.
    assert!(out.contains("ANSWER: 40"), "{out}");
    let out = dig(addr, &["AAAA", "productpage.default.svc.cluster.local"]);
    assert!(
        out.contains("status: NOERROR") && out.contains("ANSWER: 0"),
        "{out}"
    );

    // Istio's metric names.
    assert!(proxy.metric("istio_agent_dns_requests_total") > 10.0);
}

#[test]
fn enabled_exactly_as_istio() {
    use meshagent::config::{self, MapEnv, ProxyFlags, ProxyType};
    let dir = tempfile::tempdir().unwrap();
    let load = |ty: ProxyType, env: &[(&str, &str)]| {
        let flags = ProxyFlags {
            proxy_type: ty,
            ..Default::default()
        };
        let mut pairs = vec![("POD_NAMESPACE", "default")];
        pairs.extend_from_slice(env);
        config::load(&flags, &MapEnv::from_pairs(pairs), dir.path()).unwrap()
    };
    let on = |ty, env: &[(&str, &str)]| meshagent::dns::enabled(&load(ty, env));
    assert!(!on(ProxyType::Sidecar, &[]));
    assert!(on(
        ProxyType::Sidecar,
        &[("ISTIO_META_DNS_CAPTURE", "true")]
    ));
    assert!(!on(
        ProxyType::Router,
        &[("ISTIO_META_DNS_CAPTURE", "true")]
    ));
    assert!(on(
        ProxyType::Router,
        &[("ISTIO_META_ENABLE_DNS_SERVER", "true")]
    ));
    assert!(on(
        ProxyType::Sidecar,
        &[("ISTIO_META_ENABLE_DNS_SERVER", "1")]
    ));
    let cfg = load(
        ProxyType::Sidecar,
        &[
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("DNS_FORWARD_TIMEOUT", "750ms"),
            ("DNS_FORWARD_PARALLEL", "true"),
        ],
    );
    let o = meshagent::dns::Options::from_config(&cfg);
    assert_eq!(o.addr, "localhost:15053");
    assert_eq!(o.resolv_conf, std::path::Path::new("/etc/resolv.conf"));
    assert_eq!(o.timeout, std::time::Duration::from_millis(750));
    assert!(o.parallel);
    let scope = meshagent::dns::Scope::from_config(&cfg);
    assert_eq!(scope.domain, "default.svc.cluster.local");
    assert_eq!(scope.namespace, "default");
}

/// The agent binary as a pod runs it (`meshagent proxy sidecar`, real Envoy, devplane): with
/// `ISTIO_META_DNS_CAPTURE=true` it is ready only once the table arrived, and then its DNS
/// proxy on `DNS_PROXY_ADDR` answers the mesh's names over UDP and TCP. (The binary reads the
/// machine's /etc/resolv.conf, so only local names are asked here: nothing leaves loopback.)
#[tokio::test(flavor = "multi_thread")]
async fn the_agent_binary_serves_dns_once_ready() {
    let dp = Devplane::start(&mesh_yaml(false)).await;
    let dns_addr = meshagent_testkit::free_addr();
    let mut a = meshagent_testkit::Sidecar::start(
        &dp,
        "a",
        "default",
        "a",
        &[
            ("ISTIO_META_DNS_CAPTURE", "true".to_owned()),
            ("DNS_PROXY_ADDR", dns_addr.to_string()),
        ],
    )
    .await;
    a.wait_ready(DEADLINE).await;
    let (m, _) = udp(
        dns_addr,
        &query("b.default.svc.cluster.local.", RecordType::A, None),
    )
    .await;
    assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    assert_eq!(m.answers.len(), 1, "{m:?}\n{}", a.proc.log_text());
    let (m, _) = tcp(dns_addr, &query("b.", RecordType::A, Some(1232))).await;
    assert_eq!(m.answers.len(), 1, "{m:?}");
    assert!(m.metadata.authoritative && m.metadata.recursion_available);
}

/// `/debug/ndsz` of the agent binary shows the whole NDS table as istiod sent it (Istio's
/// `NameTable` in protojson field names, every host and field, and the names the hosts
/// answer to), although the agent keeps
/// only the resource's wire bytes and the compact lookup table: 2,000 generated hosts with
/// alt hosts and one address the lookup table cannot use (it stays in ndsz), on top of every
/// shape of the test mesh.
#[tokio::test(flavor = "multi_thread")]
async fn ndsz_shows_the_whole_table() {
    let mut table = mesh_table();
    for i in 0..2000 {
        let ns = format!("ns-{}", i % 20);
        let mut ni = NameInfo {
            ips: vec![format!("10.9.{}.{}", i / 256, i % 256)],
            registry: "Kubernetes".into(),
            shortname: format!("svc-{i}"),
            namespace: ns.clone(),
            alt_hosts: vec![],
        };
        if i % 7 == 0 {
            ni.alt_hosts = vec![format!("svc-{i}.{ns}.svc.clusterset.local")];
            ni.ips.push(format!("fd00::9:{i:x}"));
        }
        table
            .table
            .insert(format!("svc-{i}.{ns}.svc.cluster.local"), ni);
    }
    table.table.insert(
        "odd.example.com".into(),
        NameInfo {
            ips: vec!["not-an-ip".into(), "240.240.0.7".into()],
            registry: "External".into(),
            ..Default::default()
        },
    );
    let mut want = serde_json::Map::new();
    for (host, ni) in &table.table {
        let mut e = serde_json::json!({ "ips": ni.ips });
        for (k, v) in [
            ("registry", &ni.registry),
            ("shortname", &ni.shortname),
            ("namespace", &ni.namespace),
        ] {
            if !v.is_empty() {
                e[k] = serde_json::json!(v);
            }
        }
        if !ni.alt_hosts.is_empty() {
            e["altHosts"] = serde_json::json!(ni.alt_hosts);
        }
        want.insert(host.clone(), e);
    }
    let want = serde_json::json!({ "table": want });

    let dp = Devplane::start(&mesh_yaml(false)).await;
    dp.set_resource(type_url::NAME_TABLE, "", &table.encode_to_vec())
        .await;
    let mut a = meshagent_testkit::Sidecar::start(
        &dp,
        "a",
        "default",
        "a",
        &[
            ("ISTIO_META_DNS_CAPTURE", "true".to_owned()),
            ("DNS_PROXY_ADDR", meshagent_testkit::free_addr().to_string()),
        ],
    )
    .await;
    a.wait_ready(DEADLINE).await;
    let status = a.status;
    let body = wait_for("the table in /debug/ndsz", DEADLINE, || async move {
        let (code, body) = meshagent_testkit::http_get(status, "/debug/ndsz")
            .await
            .ok()?;
        (code == 200).then_some(body)
    })
    .await;
    let got: serde_json::Value = serde_json::from_str(&body).unwrap();
    // Every host as sent; beside them, as Istio's agent lists them (`GetDNSTable`), the
    // absolute names and short forms the hosts answer to (compat_dns compares the whole view
    // with pilot-agent's).
    let (got_t, want_t) = (
        got["table"].as_object().unwrap(),
        want["table"].as_object().unwrap(),
    );
    for (host, e) in want_t {
        assert_eq!(
            got_t.get(host),
            Some(e),
            "{host} in ndsz\n{}",
            a.proc.log_text()
        );
    }
    for (name, e) in got_t.iter().filter(|(n, _)| !want_t.contains_key(*n)) {
        assert!(
            name.ends_with('.') && e["registry"] == "Kubernetes" && e["ips"][0].is_string(),
            "{name}: {e}"
        );
    }
    assert!(got_t.contains_key("svc-7.ns-7.svc.clusterset.local."));
    // Twice: rendering does not consume what the agent keeps.
    let (code, again) = meshagent_testkit::http_get(status, "/debug/ndsz")
        .await
        .unwrap();
    assert_eq!((code, again.len()), (200, body.len()));
}

/// `/debug/dnsz` on the status port explains names with the proxy's own lookup, against the
/// table devplane pushed through the xDS proxy and a real Envoy: a table name shows its
/// entry, a short name the expansion it matched, a search-domain name the CNAME; an unknown
/// name is "forward", and with `forward=true` dnsmasq's answer and who gave it. The
/// per-upstream counters move with forwarded queries, and an upstream that is down
/// (nothing listens on 127.0.53.42) shows its failed exchanges as refusals, not timeouts: the
/// forwarder sees the ICMP port unreachable at once and moves on, as Istio's resolver does.
#[tokio::test(flavor = "multi_thread")]
async fn dnsz_explains_names_and_counts_per_upstream() {
    let up = Dnsmasq::start("127.0.53.41", "10.9.9.41 ext.dnsz.test\n", &[]).await;
    let dp = Devplane::start(&mesh_yaml(false)).await;
    dp.set_resource(type_url::NAME_TABLE, "", &mesh_table().encode_to_vec())
        .await;
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_for(&dp, dir.path(), &[("ISTIO_META_DNS_CAPTURE", "true")]).await;
    let proxy = Proxy::start(
        &format!("nameserver 127.0.53.41\nnameserver 127.0.53.42\n{SEARCH}"),
        agent.handle.name_table(),
        |o| {
            o.cache_size = 0;
            o.timeout = std::time::Duration::from_secs(1);
        },
    )
    .await;
    let views = meshagent::status::views::Views::default();
    let _ = views.dns.set(proxy.handle.core.clone());
    let (status, _stop) = status_support::serve_views(views).await;

    // Before the table: SERVFAIL, as the proxy answers.
    let (code, v) = status_support::get_json(status, "/debug/dnsz?name=productpage").await;
    assert_eq!(
        (code, &v["action"]),
        (200, &serde_json::json!("servfail")),
        "{v:#}"
    );
    let (m, _) = udp(proxy.addr, &query("productpage.", RecordType::A, None)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);

    let (_envoy, _sds) = envoy_through(&dp, &agent, dir.path(), false).await;
    let summary = wait_for("the table in /debug/dnsz", DEADLINE, || async {
        let (_, v) = status_support::get_json(status, "/debug/dnsz").await;
        (v["table"]["names"].as_u64().unwrap_or(0) > 0).then_some(v)
    })
    .await;
    assert!(summary["table"]["hosts"].as_u64().unwrap() >= mesh_table().table.len() as u64);
    assert_eq!(summary["searchDomain"], "default.svc.cluster.local.");
    let addrs: Vec<&str> = summary["upstreams"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["address"].as_str().unwrap())
        .collect();
    assert_eq!(addrs, ["127.0.53.41:53", "127.0.53.42:53"]);

    let dnsz = |q: &'static str| async move {
        let (code, v) = status_support::get_json(status, &format!("/debug/dnsz?{q}")).await;
        assert_eq!(code, 200, "{q}: {v:#}");
        v
    };
    // A table name: its entry and the answer the proxy gives.
    let v = dnsz("name=productpage.default.svc.cluster.local&type=A").await;
    assert_eq!(v["action"], "answer", "{v:#}");
    assert_eq!(v["match"]["host"], "productpage.default.svc.cluster.local");
    assert_eq!(v["match"]["form"], "hostname");
    assert_eq!(v["answers"][0]["data"], "10.0.0.1", "{v:#}");
    // A short name: the expansion it matched.
    let v = dnsz("name=productpage").await;
    assert_eq!(
        (&v["action"], &v["match"]["form"], &v["match"]["host"]),
        (
            &serde_json::json!("answer"),
            &serde_json::json!("shortname"),
            &serde_json::json!("productpage.default.svc.cluster.local")
        ),
        "{v:#}"
    );
    assert_eq!(v["answers"][0]["name"], "productpage.");
    // A name in the first search domain: the CNAME synthesised, as the proxy answers it.
    let v = dnsz("name=reviews.ns2.default.svc.cluster.local.&type=A").await;
    assert_eq!(v["cname"]["to"], "reviews.ns2.", "{v:#}");
    assert_eq!(v["match"]["form"], "shortname.namespace");
    let view: Vec<String> = v["answers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            format!(
                "{} {} {}",
                a["name"].as_str().unwrap(),
                a["type"].as_str().unwrap(),
                a["data"].as_str().unwrap()
            )
        })
        .collect();
    let (m, _) = udp(
        proxy.addr,
        &query(
            "reviews.ns2.default.svc.cluster.local.",
            RecordType::A,
            None,
        ),
    )
    .await;
    let mut proxy_said = answers(&m);
    let mut view_said = view.clone();
    proxy_said.sort();
    view_said.sort();
    assert_eq!(view_said, proxy_said);
    // Other types of mesh names, and unknown names, are forwarded.
    let v = dnsz("name=productpage.default.svc.cluster.local&type=TXT").await;
    assert_eq!(v["action"], "forward", "{v:#}");
    let v = dnsz("name=ext.dnsz.test").await;
    assert_eq!(v["action"], "forward", "{v:#}");
    assert!(v["match"].is_null() && v["forwarded"].is_null(), "{v:#}");
    // Bad input: 400 with the reason.
    let (code, v) = status_support::get_json(status, "/debug/dnsz?name=a&type=BOGUS").await;
    assert_eq!(code, 400, "{v}");

    // Actually forwarded: dnsmasq answered.
    let v = dnsz("name=ext.dnsz.test&forward=true").await;
    let f = &v["forwarded"];
    assert_eq!(f["upstream"], "127.0.53.41:53", "{v:#}\n{}", up.log());
    assert_eq!(f["rcode"], "NOERROR", "{v:#}");
    assert_eq!(f["answers"][0]["data"], "10.9.9.41", "{v:#}");
    assert!(f["latencyMs"].as_f64().unwrap() >= 0.0);

    // Forwarded client queries move the counters; the upstream that is down gets errors
    // (each query tries the servers in a shuffled order: ask until it was tried).
    for _ in 0..10 {
        let (m, _) = udp(proxy.addr, &query("ext.dnsz.test.", RecordType::A, None)).await;
        assert_eq!(answers(&m), ["ext.dnsz.test. A 10.9.9.41"], "{}", up.log());
    }
    let asked = std::sync::atomic::AtomicU32::new(0);
    let summary = wait_for("errors of the upstream that is down", DEADLINE, || async {
        let (_, s) = status_support::get_json(status, "/debug/dnsz").await;
        let n = asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let down = &s["upstreams"][1];
        let failed = down["errors"].as_u64().unwrap_or(0) + down["timeouts"].as_u64().unwrap_or(0);
        if failed > 0 || n >= 200 {
            return Some(s);
        }
        let _ = udp(proxy.addr, &query("ext.dnsz.test.", RecordType::A, None)).await;
        None
    })
    .await;
    let (good, down) = (&summary["upstreams"][0], &summary["upstreams"][1]);
    assert!(good["answered"].as_u64().unwrap() >= 11, "{summary:#}");
    assert!(
        good["queries"].as_u64() >= good["answered"].as_u64(),
        "{summary:#}"
    );
    assert_eq!(good["errors"], 0, "{summary:#}");
    assert_eq!(good["latency"]["count"], good["answered"]);
    assert!(
        good["latency"]["maxMs"].as_f64().unwrap() > 0.0,
        "{summary:#}"
    );
    let last = good["latency"]["buckets"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["count"], good["answered"], "{summary:#}");
    assert!(down["errors"].as_u64().unwrap() > 0, "{summary:#}");
    assert_eq!(
        down["timeouts"], 0,
        "refusals waited for the timeout: {summary:#}"
    );
    assert_eq!(down["answered"], 0, "{summary:#}");
    assert!(
        down["lastError"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("refused")),
        "{summary:#}"
    );
    // Istio's totals count every forwarded query once, the view's own included.
    assert_eq!(
        summary["upstreamRequests"].as_f64().unwrap(),
        proxy.metric("istio_agent_dns_upstream_requests_total")
    );
    assert_eq!(summary["upstreamFailures"], 0, "{summary:#}");
}
