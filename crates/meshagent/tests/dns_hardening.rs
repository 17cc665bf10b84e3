//! Hostile and unusual peers of the DNS proxy: TCP clients that never read, upstreams with
//! huge or odd answers, EDNS versions we do not speak, and listen addresses that are not
//! loopback. Upstreams are the test's own on 127.0.54.x (port 53, as resolv.conf implies).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod dns_support;

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use meshagent::dns;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use dns_support::*;

/// ~60 KiB of TXT: 240 strings of 250 bytes (RDATA 251 bytes each, owner a pointer).
fn big_txt(ttl: u32) -> Vec<Rr> {
    (0..240)
        .map(|i| Rr::Txt(ttl, vec![format!("{i:03}{}", "t".repeat(247)).into_bytes()]))
        .collect()
}

/// A name answered by 3,000 addresses: a ~48 KB reply over TCP.
fn huge_table() -> dns::NameTable {
    let mut t = mesh_table();
    t.table.insert(
        "huge.example.com".into(),
        NameInfo {
            ips: (0..3000)
                .map(|i| format!("10.{}.{}.{}", 2 + i / 65536, (i / 256) % 256, i % 256))
                .collect(),
            registry: "External".into(),
            shortname: String::new(),
            namespace: "default".into(),
            alt_hosts: vec![],
        },
    );
    t
}

use meshagent::dns::NameInfo;

/// Prints the proxy's metrics if the test fails.
struct OnFailure<'a>(&'a Proxy);

impl Drop for OnFailure<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- proxy metrics ---\n{}", self.0.registry.encode());
        }
    }
}

/// 300 TCP peers (more than the 256 connections served at once) each pipeline queries
/// whose replies (~48 KB each) fill their small receive buffers, and never read. The slots
/// they hold are freed once a reply write has stalled for the TCP write timeout, so a fresh
/// TCP client is answered within that deadline; UDP is answered throughout.
#[tokio::test(flavor = "multi_thread")]
async fn tcp_peers_that_never_read_release_their_slots() {
    let (_tx, tables) = fixed_table(huge_table());
    let proxy = Proxy::start("nameserver 127.0.54.254\n", tables, |_| {}).await;
    let _dump = OnFailure(&proxy);
    let addr = proxy.addr;
    let huge = query("huge.example.com.", RecordType::A, None);
    let mut framed = Vec::new();
    for _ in 0..8 {
        framed.extend_from_slice(&(huge.len() as u16).to_be_bytes());
        framed.extend_from_slice(&huge);
    }
    let mut peers = Vec::new();
    for _ in 0..300 {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        // A small MSS keeps the proxy's send buffer small too: the kernel sizes it from
        // the segment size (loopback's is 64 KiB, and ~2 MiB of buffer would absorb every
        // reply).
        nix::sys::socket::setsockopt(&sock, nix::sys::socket::sockopt::TcpMaxSeg, &536).unwrap();
        let mut s = sock.connect(addr).await.unwrap();
        // Small enough to sit in the socket buffers at once: the peer never blocks.
        let _ = s.write_all(&framed).await;
        peers.push(s);
    }
    let stalled = Instant::now();
    // Whether the slots are all taken now (informational: the first stalls began while the
    // later peers connected).
    let probe = tcp_once(addr, &query("productpage.", RecordType::A, None)).await;
    eprintln!(
        "a TCP client right after the peers connected: answered: {}",
        probe.is_some()
    );
    // UDP is served whatever TCP does.
    let (m, _) = udp(addr, &query("productpage.", RecordType::A, None)).await;
    assert_eq!(answers(&m), ["productpage. A 10.0.0.1"]);
    // A fresh TCP client: answered once the stalled writes have timed out (2 s), not never.
    let deadline = dns::server::TCP_IO + Duration::from_secs(3);
    let q = query("productpage.", RecordType::A, None);
    let answered = loop {
        if let Some(m) = tcp_once(addr, &q).await {
            break m;
        }
        assert!(
            stalled.elapsed() < deadline,
            "no TCP answer {:?} after 300 peers stopped reading",
            stalled.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(answers(&answered), ["productpage. A 10.0.0.1"]);
    let took = stalled.elapsed();
    eprintln!("fresh TCP client answered after {took:?}");
    let (m, _) = udp(addr, &query("productpage.", RecordType::A, None)).await;
    assert_eq!(answers(&m), ["productpage. A 10.0.0.1"]);
    drop(peers);
}

/// 300 TCP peers that connect and send nothing hold their slots only for the first
/// request's read timeout (2 s), not the 10 s idle timeout between requests.
#[tokio::test(flavor = "multi_thread")]
async fn silent_tcp_peers_release_their_slots_after_the_read_timeout() {
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start(
        "nameserver 127.0.54.254
",
        tables,
        |_| {},
    )
    .await;
    let _dump = OnFailure(&proxy);
    let addr = proxy.addr;
    let mut peers = Vec::new();
    for _ in 0..300 {
        peers.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let held = Instant::now();
    let deadline = dns::server::TCP_IO + Duration::from_secs(3);
    let q = query("productpage.", RecordType::A, None);
    let answered = loop {
        if let Some(m) = tcp_once(addr, &q).await {
            break m;
        }
        assert!(
            held.elapsed() < deadline,
            "no TCP answer {:?} after 300 silent peers connected",
            held.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(answers(&answered), ["productpage. A 10.0.0.1"]);
    eprintln!("fresh TCP client answered after {:?}", held.elapsed());
    drop(peers);
}

/// One TCP exchange that may fail (connection closed at accept, no reply within 1 s).
async fn tcp_once(addr: std::net::SocketAddr, q: &[u8]) -> Option<Message> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let mut out = (q.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(q);
    s.write_all(&out).await.ok()?;
    let n = tokio::time::timeout(Duration::from_secs(1), s.read_u16())
        .await
        .ok()?
        .ok()?;
    let mut buf = vec![0u8; n as usize];
    tokio::time::timeout(Duration::from_secs(1), s.read_exact(&mut buf))
        .await
        .ok()?
        .ok()?;
    Message::from_vec(&buf).ok()
}

/// One exchange on an open TCP connection.
async fn tcp_on(s: &mut tokio::net::TcpStream, q: &[u8]) -> Message {
    let mut out = (q.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(q);
    s.write_all(&out).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), s.read_u16())
        .await
        .expect("a reply within 10 s")
        .unwrap();
    let mut buf = vec![0u8; n as usize];
    s.read_exact(&mut buf).await.unwrap();
    Message::from_vec(&buf).unwrap()
}

/// 150 short TXT records: more names than hickory compresses (120), ~3.5 KB as a
/// compressing upstream sends it.
fn many_txt() -> Vec<Rr> {
    (0..150)
        .map(|i| Rr::Txt(300, vec![format!("record-{i:03}").into_bytes()]))
        .collect()
}

fn upstream_zone(name: &str, ty: RecordType) -> Vec<Rr> {
    match (name, ty) {
        (n, RecordType::TXT) if n.ends_with(".big.test.") => big_txt(300),
        (n, RecordType::TXT) if n.ends_with("many.test.") => many_txt(),
        ("hibit.test.", RecordType::A) => vec![Rr::A(0x8000_0010, [10, 9, 9, 1])],
        ("hibit.test.", RecordType::TXT) => vec![
            Rr::Txt(0xffff_ffff, vec![b"high".to_vec()]),
            Rr::Txt(120, vec![b"fine".to_vec()]),
        ],
        _ => vec![],
    }
}

/// A cache hit is the upstream's reply — the same size and answers as the miss, over
/// UDP and TCP — so it fits wherever the first reply fitted (re-encoding made it 284 bytes
/// larger here, and truncated it at a limit the miss fitted).
#[tokio::test(flavor = "multi_thread")]
async fn cache_hits_are_the_size_of_the_miss() {
    let up = Upstream::start("127.0.54.1", Arc::new(upstream_zone)).await;
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start("nameserver 127.0.54.1\n", tables, |_| {}).await;
    let _dump = OnFailure(&proxy);
    // TCP first: the miss, then the hit.
    let (miss, miss_len) = tcp(
        proxy.addr,
        &query("many.test.", RecordType::TXT, Some(4096)),
    )
    .await;
    let (hit, hit_len) = tcp(
        proxy.addr,
        &query("MANY.test.", RecordType::TXT, Some(4096)),
    )
    .await;
    assert_eq!(miss.answers.len(), 150);
    assert_eq!(hit_len, miss_len, "hit {hit_len} bytes, miss {miss_len}");
    assert_eq!(answers(&hit).len(), 150);
    assert_eq!(
        answers(&hit),
        answers(&miss)
            .iter()
            .map(|a| a.replace("many.test.", "MANY.test."))
            .collect::<Vec<_>>()
    );
    assert_eq!(hit.queries[0].name().to_ascii(), "MANY.test.");
    assert_eq!(up.queries_for("many.test."), 1);
    // UDP: the miss with EDNS 4096, then the hit with exactly the miss's size as the EDNS
    // limit: it fits, not truncated.
    let (umiss, umiss_len) = udp(
        proxy.addr,
        &query("udp.many.test.", RecordType::TXT, Some(4096)),
    )
    .await;
    assert!(!umiss.metadata.truncation, "{umiss_len}");
    assert_eq!(umiss.answers.len(), 150);
    let limit = u16::try_from(umiss_len).unwrap();
    let (uhit, uhit_len) = udp(
        proxy.addr,
        &query("udp.many.test.", RecordType::TXT, Some(limit)),
    )
    .await;
    assert!(
        !uhit.metadata.truncation,
        "hit truncated at {limit}: {uhit_len} bytes"
    );
    assert_eq!(uhit_len, umiss_len);
    assert_eq!(answers(&uhit), answers(&umiss));
    assert_eq!(up.queries_for("udp.many.test."), 1);
    assert!(proxy.metric("istio_agent_dns_cache_hits_total") >= 2.0);
}

/// The worst case for the cache — 4,096 distinct ~60 KiB TXT answers over TCP from a wildcard
/// zone — leaves the cache within its byte budget (answers over the per-entry cap are not
/// kept at all), and 4,096 answers of ~6 KiB, under the cap, are evicted to stay within
/// the budget, each eviction counted.
#[tokio::test(flavor = "multi_thread")]
async fn cache_is_bounded_in_bytes() {
    let _up = Upstream::start(
        "127.0.54.2",
        Arc::new(|name: &str, ty| match ty {
            RecordType::TXT if name.ends_with(".big.test.") => big_txt(300),
            // ~6 KiB: 24 strings of 250 bytes.
            RecordType::TXT if name.ends_with(".mid.test.") => {
                big_txt(300).into_iter().take(24).collect()
            }
            _ => vec![],
        }),
    )
    .await;
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start("nameserver 127.0.54.2\n", tables, |o| {
        // The agent's defaults.
        o.cache_size = 4096;
        o.cache_bytes = dns::cache::DEFAULT_BYTES;
    })
    .await;
    let _dump = OnFailure(&proxy);
    let cache = proxy.handle.core.cache.as_ref().unwrap();
    // The proxy's log (upstream failures) in the test's output.
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_test_writer()
        .try_init();
    let budget = dns::cache::DEFAULT_BYTES as u64;
    let addr = proxy.addr;
    let rss0 = rss_kib();
    let run = |zone: &'static str| async move {
        let workers = (0..8).map(|w| {
            tokio::spawn(async move {
                // One connection per worker, one query after the other on it.
                let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
                for i in (w..4096).step_by(8) {
                    let name = format!("n{i}.{zone}.");
                    let m = tcp_on(&mut s, &query(&name, RecordType::TXT, Some(4096))).await;
                    assert_eq!(m.metadata.response_code, ResponseCode::NoError, "{name}");
                    assert!(!m.answers.is_empty(), "{name}");
                }
            })
        });
        for w in futures::future::join_all(workers).await {
            w.unwrap();
        }
    };
    run("big.test").await;
    let rss_big = rss_kib();
    eprintln!(
        "4096 x 60 KiB answers: cache {} entries, {} bytes; test process RSS {} -> {} KiB",
        cache.len(),
        cache.weight(),
        rss0,
        rss_big
    );
    assert!(cache.weight() <= budget, "{}", cache.weight());
    assert_eq!(
        cache.len(),
        0,
        "answers over the per-entry cap are not cached"
    );
    // The whole process (proxy, upstream and clients): ~2 MiB more here, ~560 MiB when every
    // answer was kept.
    assert!(
        rss_big.saturating_sub(rss0) < 64 << 10,
        "RSS {rss0} -> {rss_big} KiB"
    );
    run("mid.test").await;
    eprintln!(
        "4096 x 6 KiB answers: cache {} entries, {} bytes, {} evictions; RSS {} KiB",
        cache.len(),
        cache.weight(),
        proxy.metric("istio_agent_dns_cache_evictions_total"),
        rss_kib()
    );
    assert!(cache.weight() <= budget, "{}", cache.weight());
    assert!(cache.len() >= 400, "{}", cache.len());
    let evictions = proxy.metric("istio_agent_dns_cache_evictions_total");
    assert!(evictions >= 4096.0 - cache.len() as f64, "{evictions}");
    // The cached ones are still served from the cache.
    let hits = proxy.metric("istio_agent_dns_cache_hits_total");
    run("mid.test").await;
    assert!(proxy.metric("istio_agent_dns_cache_hits_total") > hits);
}

/// L1: TTLs with the high bit set (RFC 2181 §8) are served as 0, and such answers are not
/// cached; the other records keep their TTLs.
#[tokio::test(flavor = "multi_thread")]
async fn l1_high_bit_ttls_are_served_as_zero() {
    let up = Upstream::start("127.0.54.3", Arc::new(upstream_zone)).await;
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start("nameserver 127.0.54.3\n", tables, |_| {}).await;
    let _dump = OnFailure(&proxy);
    for round in 1..=2 {
        let (m, _) = udp(proxy.addr, &query("hibit.test.", RecordType::A, None)).await;
        assert_eq!(answers(&m), ["hibit.test. A 10.9.9.1"]);
        assert_eq!(m.answers[0].ttl, 0, "round {round}");
        let (m, _) = tcp(proxy.addr, &query("hibit.test.", RecordType::TXT, None)).await;
        let ttls: Vec<u32> = m.answers.iter().map(|r| r.ttl).collect();
        assert_eq!(ttls, [0, 120], "round {round}");
    }
    // Not cached (TTL 0): every query went upstream.
    assert_eq!(up.queries_for("hibit.test."), 4);
    let out = dig(proxy.addr, &["+noall", "+answer", "A", "hibit.test"]);
    assert!(out.contains("\t0\tIN\tA\t10.9.9.1"), "{out}");
}

/// L2: a query with EDNS version 1 gets BADVERS (extended RCODE 16) and an OPT of version
/// 0, on the lean path (a table name) and the general one (an unknown name, not forwarded).
#[tokio::test(flavor = "multi_thread")]
async fn l2_edns_version_above_zero_gets_badvers() {
    let up = Upstream::start("127.0.54.4", Arc::new(upstream_zone)).await;
    let (_tx, tables) = fixed_table(mesh_table());
    let proxy = Proxy::start("nameserver 127.0.54.4\n", tables, |_| {}).await;
    let _dump = OnFailure(&proxy);
    for (name, ty) in [
        ("productpage.default.svc.cluster.local", "A"),
        ("many.test", "TXT"),
    ] {
        for tcp in [false, true] {
            let mut args = vec!["+edns=1", "+noednsnegotiation", ty, name];
            if tcp {
                args.insert(0, "+tcp");
            }
            let out = dig(proxy.addr, &args);
            assert!(out.contains("status: BADVERS"), "{args:?}: {out}");
            assert!(out.contains("EDNS: version: 0"), "{args:?}: {out}");
            assert!(out.contains("ANSWER: 0"), "{args:?}: {out}");
        }
        // Version 0 is answered as usual.
        let out = dig(proxy.addr, &["+tcp", "+edns=0", ty, name]);
        assert!(out.contains("status: NOERROR"), "{out}");
    }
    assert_eq!(
        up.queries_for("many.test."),
        1,
        "only the version-0 query went upstream"
    );
}

/// L3: a listen address that is not loopback is refused at startup with an error naming
/// the variable, the value and what was expected...
#[tokio::test(flavor = "multi_thread")]
async fn l3_non_loopback_listen_address_needs_the_opt_in() {
    let dir = tempfile::tempdir().unwrap();
    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, "nameserver 127.0.54.254\n").unwrap();
    for addr in ["0.0.0.0:0", ":0", "[::]:0", "10.1.2.3:15053"] {
        let mut o = options(&resolv);
        o.addr = addr.into();
        let r = dns::start(
            o,
            &meshagent::metrics::Registry::new(),
            fixed_table(mesh_table()).1,
            tokio_util::sync::CancellationToken::new(),
        )
        .await;
        let e = r
            .err()
            .expect("a non-loopback address is refused")
            .to_string();
        for want in [
            "DNS_PROXY_ADDR",
            &format!("{addr:?}"),
            "not a loopback address",
            "expected localhost, 127.0.0.0/8 or ::1",
            "MESHAGENT_DNS_ALLOW_NON_LOOPBACK=true",
        ] {
            assert!(e.contains(want), "{addr}: {want:?} not in {e}");
        }
    }
    // Loopback addresses start as before (Istio's default `localhost` among them).
    for addr in ["127.0.0.1:0", "127.0.54.9:0", "[::1]:0", "localhost:0"] {
        let mut o = options(&resolv);
        o.addr = addr.into();
        let h = dns::start(
            o,
            &meshagent::metrics::Registry::new(),
            fixed_table(mesh_table()).1,
            tokio_util::sync::CancellationToken::new(),
        )
        .await;
        assert!(h.is_ok(), "{addr}: {:?}", h.err());
    }
}

/// ...and with `MESHAGENT_DNS_ALLOW_NON_LOOPBACK=true` the same address starts and serves
/// (bound to all addresses inside a network namespace of the test's own, where loopback is
/// the only interface).
#[test]
fn l3_the_explicit_opt_in_starts_on_a_non_loopback_address() {
    use meshagent::config::{self, MapEnv, ProxyFlags, ProxyType};
    // The variable reaches the options.
    let dir = tempfile::tempdir().unwrap();
    let load = |env: &[(&str, &str)]| {
        let mut pairs = vec![
            ("POD_NAMESPACE", "default"),
            ("ISTIO_META_DNS_CAPTURE", "true"),
        ];
        pairs.extend_from_slice(env);
        let flags = ProxyFlags {
            proxy_type: ProxyType::Sidecar,
            ..Default::default()
        };
        dns::Options::from_config(
            &config::load(&flags, &MapEnv::from_pairs(pairs), dir.path()).unwrap(),
        )
    };
    assert!(!load(&[]).allow_non_loopback);
    assert!(load(&[("MESHAGENT_DNS_ALLOW_NON_LOOPBACK", "true")]).allow_non_loopback);
    assert_eq!(load(&[]).cache_bytes, dns::cache::DEFAULT_BYTES);
    assert_eq!(
        load(&[("MESHAGENT_DNS_CACHE_BYTES", "65536")]).cache_bytes,
        65536
    );

    let resolv = dir.path().join("resolv.conf");
    std::fs::write(&resolv, "nameserver 127.0.54.254\n").unwrap();
    let answer = std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
        let up = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("run ip");
        assert!(up.success(), "ip link set lo up: {up}");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut o = options(&resolv);
            o.addr = "0.0.0.0:0".into();
            o.allow_non_loopback = true;
            let h = dns::start(
                o,
                &meshagent::metrics::Registry::new(),
                fixed_table(mesh_table()).1,
                tokio_util::sync::CancellationToken::new(),
            )
            .await
            .unwrap();
            assert!(h.addrs[0].ip().is_unspecified(), "{:?}", h.addrs);
            let at = std::net::SocketAddr::from(([127, 0, 0, 1], h.addrs[0].port()));
            let (m, _) = udp(at, &query("productpage.", RecordType::A, None)).await;
            answers(&m)
        })
    })
    .join()
    .unwrap();
    assert_eq!(answer, ["productpage. A 10.0.0.1"]);
}
