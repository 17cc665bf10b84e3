//! Forwarding to real upstreams: dnsmasq on loopback addresses of the test's own (port 53, as
//! resolv.conf implies), a black-hole upstream for timeouts, the cache, and malformed input.
//! Each test uses its own 127.0.53.x addresses so they can run in parallel.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod dns_support;

use std::time::Duration;
use tokio::time::Instant;

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use tokio::net::UdpSocket;

use dns_support::*;

/// 14 TXT records of ~250 bytes: a ~3.7 KB answer.
fn big_txt_flags() -> Vec<String> {
    (0..14)
        .map(|i| format!("--txt-record=big.test.local,{i:02}{}", "x".repeat(248)))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_names_and_other_types_go_upstream() {
    let mut flags = big_txt_flags();
    flags.extend([
        "--address=/nx.test.local/".to_owned(),
        // dnsmasq 2.90 caps its own UDP replies at 1232 bytes by default.
        "--edns-packet-max=4096".to_owned(),
        "--txt-record=productpage.default.svc.cluster.local,from-upstream".to_owned(),
    ]);
    let up = Dnsmasq::start("127.0.53.1", "10.9.9.9 ext1.test.local\n", &flags).await;
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start(&format!("nameserver 127.0.53.1\n{SEARCH}"), tables, |o| {
        o.cache_size = 0;
    })
    .await;
    let addr = proxy.addr;

    for tcp_too in [false, true] {
        let ask = |name: &'static str, ty: RecordType, edns: Option<u16>| async move {
            let q = query(name, ty, edns);
            if tcp_too {
                tcp(addr, &q).await
            } else {
                udp(addr, &q).await
            }
        };
        // An unknown name: dnsmasq's answer, relayed.
        let (m, _) = ask("ext1.test.local.", RecordType::A, None).await;
        assert_eq!(answers(&m), ["ext1.test.local. A 10.9.9.9"]);
        // NXDOMAIN relayed as is.
        let (m, _) = ask("a.nx.test.local.", RecordType::A, None).await;
        assert_eq!(m.metadata.response_code, ResponseCode::NXDomain);
        // Other types for mesh names are forwarded (Istio synthesizes only A/AAAA).
        let (m, _) = ask(
            "productpage.default.svc.cluster.local.",
            RecordType::TXT,
            None,
        )
        .await;
        assert_eq!(m.answers.len(), 1, "{m:?}");
        assert!(m.answers[0].data.to_string().contains("from-upstream"));
        // The 3.7 KB upstream answer: relayed whole with EDNS 4096 (Istio: SERVFAIL, #61371),
        // and over TCP.
        let (m, n) = ask("big.test.local.", RecordType::TXT, Some(4096)).await;
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
        assert_eq!(m.answers.len(), 14, "{n} bytes");
        assert!(!m.metadata.truncation);
        assert!(n > 3000, "{n}");
    }
    // Smaller client limits: truncated with TC=1 within the limit, never SERVFAIL.
    for edns in [None, Some(1232)] {
        let (m, n) = udp(addr, &query("big.test.local.", RecordType::TXT, edns)).await;
        assert_eq!(m.metadata.response_code, ResponseCode::NoError, "{edns:?}");
        assert!(m.metadata.truncation, "{edns:?}");
        assert!(n <= edns.unwrap_or(512) as usize, "{edns:?}: {n}");
    }
    // dig retries over TCP by itself.
    let out = dig(addr, &["+noedns", "TXT", "big.test.local"]);
    assert!(out.contains("ANSWER: 14"), "{out}");
    // Mesh names never reached the upstream as A queries.
    assert_eq!(up.queries_for("productpage.default.svc.cluster.local"), 2);
    assert_eq!(proxy.metric("istio_agent_dns_upstream_failures_total"), 0.0);
    assert!(proxy.metric("istio_agent_dns_upstream_requests_total") >= 10.0);
    assert!(proxy.metric("istio_agent_dns_upstream_request_duration_seconds_count") >= 10.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_timeout_is_servfail_after_the_configured_timeout() {
    // A black hole: reads queries, never answers.
    let hole = UdpSocket::bind("127.0.53.9:53").await.unwrap();
    let _hole = tokio::spawn(async move {
        let mut b = [0u8; 512];
        while hole.recv_from(&mut b).await.is_ok() {}
    });
    let (_tx, tables) = fixed_table(mesh_table());
    let timeout = Duration::from_millis(800);
    let proxy = Proxy::start("nameserver 127.0.53.9\n", tables, |o| o.timeout = timeout).await;
    let t0 = Instant::now();
    let (m, _) = udp(proxy.addr, &query("slow.test.local.", RecordType::A, None)).await;
    let took = t0.elapsed();
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
    assert!(
        took >= timeout,
        "SERVFAIL after {took:?}, before the {timeout:?} timeout"
    );
    assert_eq!(proxy.metric("istio_agent_dns_upstream_failures_total"), 1.0);
    // Local names are unaffected by a dead upstream.
    let (m, _) = udp(proxy.addr, &query("productpage.", RecordType::A, None)).await;
    assert_eq!(answers(&m), ["productpage. A 10.0.0.1"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn parallel_mode_takes_the_first_answer() {
    let hole = UdpSocket::bind("127.0.53.19:53").await.unwrap();
    let _hole = tokio::spawn(async move {
        let mut b = [0u8; 512];
        while hole.recv_from(&mut b).await.is_ok() {}
    });
    let _up = Dnsmasq::start("127.0.53.11", "10.9.9.7 p.test.local\n", &[]).await;
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start(
        "nameserver 127.0.53.19\nnameserver 127.0.53.11\n",
        tables,
        |o| {
            o.parallel = true;
            o.cache_size = 0;
            o.timeout = Duration::from_secs(20);
        },
    )
    .await;
    // Ten queries: in sequential mode about half would wait 20 s for the black hole first.
    let t0 = Instant::now();
    for _ in 0..10 {
        let (m, _) = udp(proxy.addr, &query("p.test.local.", RecordType::A, None)).await;
        assert_eq!(answers(&m), ["p.test.local. A 10.9.9.7"]);
    }
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread")]
async fn forwarded_answers_are_cached_within_their_ttl() {
    let up = Dnsmasq::start(
        "127.0.53.21",
        "10.9.9.8 cached.test.local\n",
        &["--local-ttl=60".to_owned()],
    )
    .await;
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start("nameserver 127.0.53.21\n", tables, |_| {}).await;
    let (m1, _) = udp(
        proxy.addr,
        &query("cached.test.local.", RecordType::A, None),
    )
    .await;
    let (m2, _) = udp(
        proxy.addr,
        &query("CACHED.test.local.", RecordType::A, None),
    )
    .await;
    assert_eq!(answers(&m1), ["cached.test.local. A 10.9.9.8"], "{m1:?}");
    assert_eq!(m2.answers.len(), 1);
    assert!(m2.answers[0].ttl <= 60);
    // The question is echoed as asked (0x20-randomising clients check it).
    assert_eq!(m2.queries[0].name().to_ascii(), "CACHED.test.local.");
    assert_eq!(up.queries_for("cached.test.local"), 1, "{}", up.log());
    assert_eq!(proxy.metric("istio_agent_dns_cache_hits_total"), 1.0);
    assert_eq!(proxy.metric("istio_agent_dns_cache_misses_total"), 1.0);
    assert_eq!(proxy.metric("istio_agent_dns_upstream_requests_total"), 1.0);

    // Switched off: every query goes upstream.
    let (_tx, tables) = fixed_table(mesh_table());
    let off = Proxy::start("nameserver 127.0.53.21\n", tables, |o| o.cache_size = 0).await;
    for _ in 0..2 {
        udp(off.addr, &query("cached.test.local.", RecordType::A, None)).await;
    }
    assert_eq!(up.queries_for("cached.test.local"), 3, "{}", up.log());
}

const ANY: u8 = 255;

#[tokio::test(flavor = "multi_thread")]
async fn malformed_packets_get_formerr_or_are_dropped_and_the_server_keeps_serving() {
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start("nameserver 127.0.53.254\n", tables, |_| {}).await;
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    sock.connect(proxy.addr).await.unwrap();
    let good = query("productpage.", RecordType::A, None);
    let mut corpus: Vec<(&str, Vec<u8>, Option<u8>)> = vec![
        ("empty", vec![], None),
        ("short header", vec![0x12, 0x34, 0x01], None),
        // qdcount=1 and no question.
        (
            "missing question",
            vec![0xab, 0xcd, 0x01, 0, 0, 1, 0, 0, 0, 0, 0, 0],
            Some(1),
        ),
        // A compression pointer pointing at itself.
        (
            "pointer loop",
            vec![0, 7, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xc0, 12, 0, 1, 0, 1],
            Some(1),
        ),
        // A label longer than 63.
        (
            "label too long",
            {
                let mut p = vec![0, 8, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 64];
                p.extend([b'a'; 64]);
                p.extend([0, 0, 1, 0, 1]);
                p
            },
            Some(1),
        ),
        // Noise: any answer (FORMERR/NOTIMP) or none is fine; serving on is what matters.
        (
            "garbage",
            (0..300u32).map(|i| (i * 7919 % 251) as u8).collect(),
            Some(ANY),
        ),
    ];
    // A response sent as a request: dropped.
    let mut response = good.clone();
    response[2] |= 0x80;
    corpus.push(("a response", response, None));
    // Opcode STATUS (2): NOTIMP.
    let mut status = good.clone();
    status[2] = (status[2] & 0x87) | (2 << 3);
    corpus.push(("opcode status", status, Some(4)));

    for (what, pkt, want) in &corpus {
        sock.send(pkt).await.unwrap();
        let mut buf = vec![0u8; 65535];
        let got = tokio::time::timeout(Duration::from_millis(300), sock.recv(&mut buf)).await;
        match (want, got) {
            (Some(ANY), _) => {}
            (Some(rcode), Ok(Ok(n))) => {
                assert!(n >= 12, "{what}");
                assert_eq!(buf[3] & 0x0f, *rcode, "{what}: rcode");
                assert_eq!(buf[..2], pkt[..2], "{what}: ID echoed");
                assert!(buf[2] & 0x80 != 0, "{what}: QR");
            }
            (None, Err(_)) => {}
            (want, got) => panic!("{what}: wanted rcode {want:?}, got {got:?}"),
        }
        // Still serving.
        let (m, _) = udp(proxy.addr, &good).await;
        assert_eq!(answers(&m), ["productpage. A 10.0.0.1"], "after {what}");
    }
    // The fuzz target's seed corpus (fuzz/corpus/dns_request at the root): any reply or none,
    // but every reply decodes with the request's ID, and serving goes on.
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/dns_request");
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 10, "{}", dir.display());
    for path in &seeds {
        let pkt = std::fs::read(path).unwrap();
        sock.send(&pkt).await.unwrap();
        let mut buf = vec![0u8; 65535];
        if let Ok(Ok(n)) =
            tokio::time::timeout(Duration::from_millis(300), sock.recv(&mut buf)).await
        {
            assert_eq!(buf[..2], pkt[..2], "{}: ID echoed", path.display());
            hickory_proto::op::Message::from_vec(&buf[..n]).unwrap();
        }
        let (m, _) = udp(proxy.addr, &good).await;
        assert_eq!(
            answers(&m),
            ["productpage. A 10.0.0.1"],
            "after {}",
            path.display()
        );
        corpus.push(("seed", pkt, None));
    }
    // The same corpus over TCP, then a good query on the same connection kind.
    for (what, pkt, _) in &corpus {
        if pkt.is_empty() {
            continue;
        }
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        use tokio::io::AsyncWriteExt;
        let mut out = (pkt.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(pkt);
        s.write_all(&out).await.unwrap();
        drop(s);
        let (m, _) = tcp(proxy.addr, &good).await;
        assert_eq!(answers(&m), ["productpage. A 10.0.0.1"], "after TCP {what}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn no_table_is_servfail_and_resolv_conf_is_required() {
    let (_tx, tables) = tokio::sync::watch::channel(None);
    let proxy = Proxy::start("nameserver 127.0.53.254\n", tables, |_| {}).await;
    let (m, _) = tcp(proxy.addr, &query("productpage.", RecordType::A, None)).await;
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);

    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(&dir.path().join("missing-resolv.conf"));
    opts.addr = "127.0.0.1:0".into();
    let (_tx, tables) = tokio::sync::watch::channel(None);
    let err = meshagent::dns::start(
        opts,
        &meshagent::metrics::Registry::new(),
        tables,
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("missing-resolv.conf"), "{err}");
}

/// A burst: 8 clients each send 24 queries before reading any reply, so datagrams queue on
/// the proxy's socket and are taken in `recvmmsg` batches (`dns::server::serve_udp`). Every
/// client gets exactly its own replies, each answering its own question — lean-path names
/// (lower case), general-path ones (mixed case, a search-domain CNAME, a missing family) and
/// malformed packets mixed in the same batches.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_from_many_clients_is_answered_to_each() {
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start(
        &format!("nameserver 127.0.53.254\n{SEARCH}"),
        tables,
        |_| {},
    )
    .await;
    let asks: [(&str, RecordType, &[&str]); 6] = [
        ("productpage.", RecordType::A, &["productpage. A 10.0.0.1"]),
        (
            "ProductPage.Default.svc.cluster.local.",
            RecordType::A,
            &["productpage.default.svc.cluster.local. A 10.0.0.1"],
        ),
        (
            "reviews.ns2.default.svc.cluster.local.",
            RecordType::A,
            &[
                "reviews.ns2. A 10.0.0.2",
                "reviews.ns2.default.svc.cluster.local. CNAME reviews.ns2.",
            ],
        ),
        (
            "dual.default.svc.cluster.local.",
            RecordType::AAAA,
            &["dual.default.svc.cluster.local. AAAA fd00::3"],
        ),
        ("api.example.com.", RecordType::AAAA, &[]),
        (
            "x.wild.example.com.",
            RecordType::A,
            &["x.wild.example.com. A 240.240.0.9"],
        ),
    ];
    let mut clients = Vec::new();
    for c in 0..8u16 {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        s.connect(proxy.addr).await.unwrap();
        for i in 0..24u16 {
            let (name, ty, _) = asks[usize::from(i) % asks.len()];
            let mut q = query(name, ty, i.is_multiple_of(2).then_some(1232));
            let id = c * 100 + i;
            q[..2].copy_from_slice(&id.to_be_bytes());
            s.send(&q).await.unwrap();
            if i % 8 == 7 {
                // Malformed (a label longer than 63): FORMERR, in the same burst.
                let mut p = (60000 + c * 100 + i).to_be_bytes().to_vec();
                p.extend([1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 64]);
                p.extend([b'a'; 64]);
                p.extend([0, 0, 1, 0, 1]);
                s.send(&p).await.unwrap();
            }
        }
        clients.push((c, s));
    }
    for (c, s) in clients {
        let mut want: std::collections::BTreeSet<u16> = (0..24)
            .map(|i| c * 100 + i)
            .chain((0..24).filter(|i| i % 8 == 7).map(|i| 60000 + c * 100 + i))
            .collect();
        let mut buf = vec![0u8; 65535];
        while !want.is_empty() {
            let n = tokio::time::timeout(Duration::from_secs(10), s.recv(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("client {c}: no reply for {want:?}"))
                .unwrap();
            let id = u16::from_be_bytes([buf[0], buf[1]]);
            assert!(
                want.remove(&id),
                "client {c}: reply {id} is not one of its queries"
            );
            if id >= 60000 {
                assert_eq!(buf[3] & 0x0f, 1, "FORMERR");
                continue;
            }
            let m = hickory_proto::op::Message::from_vec(&buf[..n]).unwrap();
            let (name, ty, want_answers) = asks[usize::from(id % 100) % asks.len()];
            assert_eq!(m.queries[0].name().to_ascii(), name, "question echoed");
            assert_eq!(m.queries[0].query_type(), ty);
            assert_eq!(answers(&m), want_answers, "{name} {ty}");
            assert_eq!(
                m.edns.is_some(),
                id.is_multiple_of(2),
                "OPT echoed when sent"
            );
            assert!(m.metadata.authoritative && m.metadata.recursion_available);
        }
    }
}

/// Pooled upstream sockets are not easier to spoof than Istio's fresh socket per query: each
/// exchange sends an ID drawn for it, not the client's (a client with a fixed or predictable ID
/// gains nothing), the client gets its own ID back, and a socket serves at most 64 exchanges
/// before its port changes. A recording upstream answers every query itself.
#[tokio::test(flavor = "multi_thread")]
async fn upstream_sees_random_ids_and_changing_ports_the_client_its_own_id() {
    let up = UdpSocket::bind("127.0.53.29:53").await.unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(u16, u16)>::new()));
    let log = seen.clone();
    let _up = tokio::spawn(async move {
        let mut b = [0u8; 512];
        while let Ok((n, peer)) = up.recv_from(&mut b).await {
            log.lock()
                .unwrap()
                .push((u16::from_be_bytes([b[0], b[1]]), peer.port()));
            // The query back as its own empty NOERROR answer: QR and RA set.
            let mut r = b[..n].to_vec();
            r[2] |= 0x80;
            r[3] |= 0x80;
            let _ = up.send_to(&r, peer).await;
        }
    });
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start("nameserver 127.0.53.29\n", tables, |o| o.cache_size = 0).await;
    const N: u16 = 70;
    for i in 0..N {
        let mut q = query(&format!("n{i}.test.local."), RecordType::A, None);
        q[..2].copy_from_slice(&0x1234u16.to_be_bytes());
        let (m, _) = udp(proxy.addr, &q).await;
        assert_eq!(m.metadata.id, 0x1234, "the client's own ID comes back");
        assert_eq!(m.metadata.response_code, ResponseCode::NoError);
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), usize::from(N), "every query went upstream once");
    let ids: std::collections::BTreeSet<u16> = seen.iter().map(|s| s.0).collect();
    // 70 draws from 65,536: a repeat or two at most, barring a broken generator.
    assert!(
        ids.len() >= 65,
        "upstream IDs are drawn per exchange: {seen:?}"
    );
    let mut per_port = std::collections::BTreeMap::<u16, usize>::new();
    for (_, port) in &seen {
        *per_port.entry(*port).or_default() += 1;
    }
    assert!(
        per_port.len() >= 2 && per_port.values().all(|&n| n <= 64),
        "a pooled socket serves at most 64 exchanges: {per_port:?}"
    );
}
