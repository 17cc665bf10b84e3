//! Shared pieces of the DNS proxy tests: a real dnsmasq upstream on its own loopback address
//! (port 53, as resolv.conf implies), the proxy started in-process with a resolv.conf the test
//! writes, and a small client built on hickory-proto (the same wire library as the proxy, but
//! only for encoding questions and decoding answers) plus `dig` for a second, independent one.
#![allow(clippy::unwrap_used, dead_code)] // tests fail loudly by design

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::Message;
use hickory_proto::rr::RecordType;
use meshagent::dns::{self, DnsHandle, NameInfo, NameTable};
use meshagent::metrics::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A dnsmasq answering from a hosts file and `extra` flags on `ip:53` (a 127.x address of
/// the test's own; loopback only). Killed on drop; its log is printed if the test fails.
pub struct Dnsmasq {
    pub ip: String,
    child: Child,
    dir: tempfile::TempDir,
}

impl Dnsmasq {
    pub async fn start(ip: &str, hosts: &str, extra: &[String]) -> Dnsmasq {
        let dir = tempfile::tempdir().unwrap();
        // dnsmasq runs as nobody and chdirs to /: absolute, world-readable paths.
        let hosts_path = dir.path().join("hosts");
        std::fs::write(&hosts_path, hosts).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let log = dir.path().join("log");
        let child = Command::new("dnsmasq")
            .args([
                "-k",
                "--port=53",
                &format!("--listen-address={ip}"),
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                &format!("--addn-hosts={}", hosts_path.display()),
                &format!("--pid-file={}", dir.path().join("pid").display()),
                &format!("--log-facility={}", log.display()),
                "--log-queries",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("dnsmasq (make dnspeers) must be installed");
        let d = Dnsmasq {
            ip: ip.to_owned(),
            child,
            dir,
        };
        // Ready when it answers anything (REFUSED for an unknown name is an answer).
        let addr: SocketAddr = format!("{ip}:53").parse().unwrap();
        meshagent_testkit::wait_for("dnsmasq to answer", meshagent_testkit::DEADLINE, || async {
            let q = query("ready.invalid.", RecordType::A, None);
            udp_within(addr, &q, Duration::from_millis(200)).await
        })
        .await;
        d
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    pub fn queries_for(&self, name: &str) -> usize {
        self.log()
            .lines()
            .filter(|l| l.contains("query[") && l.contains(&format!(" {name} from")))
            .count()
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- dnsmasq {} log ---\n{}", self.ip, self.log());
        }
    }
}

/// A DNS query for `name`/`ty`, with an OPT of `edns` bytes if given.
pub use meshagent::fuzzing::dns_query as query;

async fn udp_within(addr: SocketAddr, q: &[u8], t: Duration) -> Option<(Message, usize)> {
    let s = UdpSocket::bind("127.0.0.1:0").await.ok()?;
    s.connect(addr).await.ok()?;
    s.send(q).await.ok()?;
    let mut buf = vec![0u8; 65535];
    let n = tokio::time::timeout(t, s.recv(&mut buf)).await.ok()?.ok()?;
    Some((Message::from_vec(&buf[..n]).unwrap(), n))
}

/// One UDP exchange: the reply and its size on the wire.
pub async fn udp(addr: SocketAddr, q: &[u8]) -> (Message, usize) {
    udp_within(addr, q, Duration::from_secs(10))
        .await
        .expect("a UDP reply from the DNS proxy")
}

/// One TCP exchange (two-byte length framing).
pub async fn tcp(addr: SocketAddr, q: &[u8]) -> (Message, usize) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let mut out = (q.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(q);
    s.write_all(&out).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), s.read_u16())
        .await
        .unwrap()
        .unwrap() as usize;
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).await.unwrap();
    (Message::from_vec(&buf).unwrap(), n)
}

/// The answers as `name TYPE data` lines, sorted.
pub fn answers(m: &Message) -> Vec<String> {
    let mut v: Vec<String> = m
        .answers
        .iter()
        .map(|r| format!("{} {} {}", r.name, r.record_type(), r.data))
        .collect();
    v.sort();
    v
}

/// `dig` against the proxy; returns its stdout.
pub fn dig(addr: SocketAddr, args: &[&str]) -> String {
    let out = Command::new("dig")
        .arg(format!("@{}", addr.ip()))
        .args(["-p", &addr.port().to_string(), "+time=5", "+tries=1"])
        .args(args)
        .output()
        .expect("dig (make dnspeers) must be installed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The DNS proxy in-process on `127.0.0.1:<free port>` with `resolv` as its resolv.conf.
pub struct Proxy {
    pub handle: DnsHandle,
    pub addr: SocketAddr,
    pub registry: Registry,
    pub stop: CancellationToken,
    _dir: tempfile::TempDir,
}

impl Proxy {
    pub async fn start(
        resolv: &str,
        tables: dns::NameTableWatch,
        tweak: impl FnOnce(&mut dns::Options),
    ) -> Proxy {
        let dir = tempfile::tempdir().unwrap();
        let resolv_path = dir.path().join("resolv.conf");
        std::fs::write(&resolv_path, resolv).unwrap();
        let mut opts = options(&resolv_path);
        tweak(&mut opts);
        let registry = Registry::new();
        let stop = CancellationToken::new();
        let handle = dns::start(opts, &registry, tables, stop.clone())
            .await
            .unwrap();
        let addr = handle.addrs[0];
        Proxy {
            handle,
            addr,
            registry,
            stop,
            _dir: dir,
        }
    }

    /// A metric's value from the registry's Prometheus text (0 if absent).
    pub fn metric(&self, series: &str) -> f64 {
        self.registry
            .encode()
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// What `Options::from_config` gives a pod in `default` (tests change the rest).
pub fn options(resolv: &Path) -> dns::Options {
    dns::Options {
        addr: "127.0.0.1:0".into(),
        resolv_conf: PathBuf::from(resolv),
        parallel: false,
        timeout: Duration::from_secs(5),
        cache_size: 1024,
        cache_bytes: dns::cache::DEFAULT_BYTES,
        allow_non_loopback: false,
        forward_before_table: false,
        servers: meshagent::supervise::Servers::new(),
        udp_batch: dns::server::UDP_BATCH,
    }
}

pub const SEARCH: &str = "search default.svc.cluster.local svc.cluster.local cluster.local\n";

fn k8s(ns: &str, short: &str, ips: &[&str]) -> NameInfo {
    NameInfo {
        ips: ips.iter().map(|s| s.to_string()).collect(),
        registry: "Kubernetes".into(),
        shortname: short.into(),
        namespace: ns.into(),
        alt_hosts: vec![],
    }
}

fn external(ips: &[String]) -> NameInfo {
    NameInfo {
        ips: ips.to_vec(),
        registry: "External".into(),
        shortname: String::new(),
        namespace: "default".into(),
        alt_hosts: vec![],
    }
}

/// The test mesh's table: every shape the proxy must handle.
pub fn mesh_table() -> NameTable {
    let mut t = NameTable::default();
    t.table.insert(
        "productpage.default.svc.cluster.local".into(),
        k8s("default", "productpage", &["10.0.0.1"]),
    );
    t.table.insert(
        "reviews.ns2.svc.cluster.local".into(),
        k8s("ns2", "reviews", &["10.0.0.2"]),
    );
    t.table.insert(
        "dual.default.svc.cluster.local".into(),
        k8s("default", "dual", &["10.0.0.3", "fd00::3"]),
    );
    t.table
        .insert("api.example.com".into(), external(&["240.240.0.1".into()]));
    t.table.insert(
        "*.wild.example.com".into(),
        external(&["240.240.0.9".into()]),
    );
    t.table.insert(
        "big.example.com".into(),
        external(&(1..=40).map(|i| format!("10.1.0.{i}")).collect::<Vec<_>>()),
    );
    t
}

/// A table feed that already holds `t`.
pub fn fixed_table(
    t: NameTable,
) -> (
    watch::Sender<Option<Arc<dns::LookupTable>>>,
    dns::NameTableWatch,
) {
    // The scope of `options`' proxy: namespace `default`.
    let scope = dns::Scope {
        namespace: "default".into(),
        domain: "default.svc.cluster.local".into(),
    };
    watch::channel(Some(Arc::new(dns::LookupTable::build(&t, &scope))))
}

/// A small authoritative upstream of the test's own on `ip:53` (UDP and TCP), for answers
/// dnsmasq cannot give: every name's answer comes from `answer(name lower-case, qtype)` as
/// (TTL, TXT strings or an A address). It encodes replies as a compressing server does —
/// every owner name a pointer to the question — so their size is what a real upstream
/// sends. UDP replies larger than the client's limit (EDNS size, or 512) are TC=1 with no
/// records, as authoritative servers answer them. Counts the queries per lower-case name.
pub struct Upstream {
    pub ip: String,
    counts: Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// What [`Upstream`] answers for a name.
#[derive(Clone, Debug)]
pub enum Rr {
    Txt(u32, Vec<Vec<u8>>),
    A(u32, [u8; 4]),
}

pub type AnswerFn = Arc<dyn Fn(&str, RecordType) -> Vec<Rr> + Send + Sync>;

impl Upstream {
    pub async fn start(ip: &str, answer: AnswerFn) -> Upstream {
        let counts = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
        let udp = Arc::new(UdpSocket::bind(format!("{ip}:53")).await.unwrap());
        let tcp = tokio::net::TcpListener::bind(format!("{ip}:53"))
            .await
            .unwrap();
        let (a, c) = (answer.clone(), counts.clone());
        let u = tokio::spawn(async move {
            let mut buf = vec![0u8; 65535];
            while let Ok((n, peer)) = udp.recv_from(&mut buf).await {
                if let Some(r) = upstream_reply(&buf[..n], &a, &c, false) {
                    let _ = udp.send_to(&r, peer).await;
                }
            }
        });
        let (a, c) = (answer, counts.clone());
        let t = tokio::spawn(async move {
            loop {
                let mut s = match tcp.accept().await {
                    Ok((s, _)) => s,
                    // A connection reset before it was accepted, or descriptors short for a
                    // moment: the listener stays.
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let (a, c) = (a.clone(), c.clone());
                tokio::spawn(async move {
                    loop {
                        let Ok(n) = s.read_u16().await else { return };
                        let mut q = vec![0u8; n as usize];
                        if s.read_exact(&mut q).await.is_err() {
                            return;
                        }
                        let Some(r) = upstream_reply(&q, &a, &c, true) else {
                            return;
                        };
                        let mut out = (r.len() as u16).to_be_bytes().to_vec();
                        out.extend_from_slice(&r);
                        if s.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        Upstream {
            ip: ip.to_owned(),
            counts,
            tasks: vec![u, t],
        }
    }

    pub fn queries_for(&self, name: &str) -> usize {
        self.counts.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn upstream_reply(
    q: &[u8],
    answer: &AnswerFn,
    counts: &std::sync::Mutex<std::collections::HashMap<String, usize>>,
    tcp: bool,
) -> Option<Vec<u8>> {
    let m = Message::from_vec(q).ok()?;
    let query = m.queries.first()?;
    let name = query.name().to_lowercase().to_ascii();
    *counts.lock().unwrap().entry(name.clone()).or_default() += 1;
    let rrs = answer(&name, query.query_type());
    // The question exactly as asked: header, then the question's bytes.
    use hickory_proto::serialize::binary::BinEncodable as _;
    let qend = 12 + query.name().to_bytes().ok()?.len() + 4;
    let mut out = q.get(..qend)?.to_vec();
    out[2] |= 0x84; // QR, AA
    out[3] = 0x80; // RA, NOERROR
    out[6..12].fill(0);
    let mut body = Vec::new();
    for rr in &rrs {
        body.extend_from_slice(&[0xc0, 12]);
        match rr {
            Rr::Txt(ttl, strings) => {
                body.extend_from_slice(&16u16.to_be_bytes());
                body.extend_from_slice(&1u16.to_be_bytes());
                body.extend_from_slice(&ttl.to_be_bytes());
                let len: usize = strings.iter().map(|s| 1 + s.len()).sum();
                body.extend_from_slice(&(len as u16).to_be_bytes());
                for s in strings {
                    body.push(s.len() as u8);
                    body.extend_from_slice(s);
                }
            }
            Rr::A(ttl, ip) => {
                body.extend_from_slice(&1u16.to_be_bytes());
                body.extend_from_slice(&1u16.to_be_bytes());
                body.extend_from_slice(&ttl.to_be_bytes());
                body.extend_from_slice(&4u16.to_be_bytes());
                body.extend_from_slice(ip);
            }
        }
    }
    let edns = m.edns.as_ref().map(|e| e.max_payload());
    let opt: [u8; 11] = {
        let size = edns.unwrap_or(512).clamp(512, 4096);
        let s = size.to_be_bytes();
        [0, 0, 41, s[0], s[1], 0, 0, 0, 0, 0, 0]
    };
    let limit = if tcp {
        65535
    } else {
        edns.map_or(512, |e| e.max(512) as usize)
    };
    let opt_len = if edns.is_some() { 11 } else { 0 };
    if out.len() + body.len() + opt_len > limit {
        out[2] |= 0x02; // TC, no records
    } else {
        out[6..8].copy_from_slice(&(rrs.len() as u16).to_be_bytes());
        out.extend_from_slice(&body);
    }
    if edns.is_some() {
        out[10..12].copy_from_slice(&1u16.to_be_bytes());
        out.extend_from_slice(&opt);
    }
    Some(out)
}

/// The process's resident set, in KiB (`VmRSS`).
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}
