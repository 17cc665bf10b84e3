//! Root tests of `meshagent istio-iptables` against real iptables / nftables, inside network
//! namespaces these tests create and delete: an "app" namespace (the pod) and a "peer"
//! namespace joined by a veth pair, addresses from 192.0.2.0/24 and 2001:db8::/64 only.
//! Nothing here touches the host namespace or any other network. The tests need root and
//! iptables, nftables and iproute2 (`make netpeers`); without them they fail.
//!
//! Sockets are opened inside a namespace by a thread that first `setns`es into it; a socket
//! stays in the namespace it was created in. Traffic owned by uid 1337 comes from a
//! `setpriv`-ed bash (`/dev/tcp`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design
#![allow(
    clippy::disallowed_types,
    reason = "synchronous tests without a Tokio runtime: std::time::Instant deadlines"
)]

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use meshagent::iptables::ISTIO_INIT_DEFAULT_ARGS;
use meshagent::iptables::validation::original_dst;
use nix::sys::socket::{self, sockopt};

const BIN: &str = env!("CARGO_BIN_EXE_meshagent");
const APP: &str = "192.0.2.1";
const PEER: &str = "192.0.2.2";
const WAIT: Duration = Duration::from_secs(5);
/// Long enough to be sure a connection did not arrive somewhere else.
const QUIET: Duration = Duration::from_millis(700);

static COUNTER: AtomicU32 = AtomicU32::new(0);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Iptables,
    Nft,
}

impl Backend {
    fn flags(self) -> &'static [&'static str] {
        match self {
            Backend::Iptables => &[],
            Backend::Nft => &["--native-nftables"],
        }
    }
}

fn run(cmd: &str, args: &[&str]) -> Output {
    let out = Command::new(cmd).args(args).output().unwrap_or_else(|e| {
        panic!("cannot run {cmd} (install the peers with `make netpeers`): {e}")
    });
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn require_peers() {
    for bin in [
        "ip",
        "iptables-save",
        "ip6tables-save",
        "iptables-nft-restore",
        "nft",
        "setpriv",
    ] {
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).exists()))
            .unwrap_or(false);
        assert!(
            found,
            "{bin} is not installed: run `make netpeers` (tests need real iptables/nftables)"
        );
    }
}

/// An app namespace and a peer namespace joined by a veth pair; deleted on drop.
struct Pod {
    app: String,
    peer: String,
    /// The app end of the veth pair.
    app_dev: String,
}

impl Pod {
    fn new() -> Self {
        require_peers();
        let id = format!(
            "{}x{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let (va, vb) = (format!("mv{id}a"), format!("mv{id}b"));
        let pod = Pod {
            app: format!("mait-{id}-app"),
            peer: format!("mait-{id}-peer"),
            app_dev: va.clone(),
        };
        for ns in [&pod.app, &pod.peer] {
            run("ip", &["netns", "add", ns]);
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
        }
        run(
            "ip",
            &[
                "-n", &pod.app, "link", "add", &va, "type", "veth", "peer", "name", &vb, "netns",
                &pod.peer,
            ],
        );
        for (ns, dev, v4, v6) in [
            (&pod.app, &va, APP, "2001:db8::1"),
            (&pod.peer, &vb, PEER, "2001:db8::2"),
        ] {
            run(
                "ip",
                &["-n", ns, "addr", "add", &format!("{v4}/24"), "dev", dev],
            );
            run(
                "ip",
                &[
                    "-n",
                    ns,
                    "addr",
                    "add",
                    &format!("{v6}/64"),
                    "dev",
                    dev,
                    "nodad",
                ],
            );
            run("ip", &["-n", ns, "link", "set", dev, "up"]);
        }
        pod
    }

    /// `/etc/netns/<app>/resolv.conf`, which `ip netns exec` mounts over /etc/resolv.conf.
    fn resolv_conf(&self, text: &str) {
        let dir = format!("/etc/netns/{}", self.app);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(format!("{dir}/resolv.conf"), text).unwrap();
    }

    /// `meshagent istio-iptables ARGS` in the app namespace; returns (exit code, stderr).
    fn istio_iptables(&self, args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.app, BIN, "istio-iptables"])
            .args(args)
            .envs(env.iter().copied())
            .output()
            .expect("run meshagent");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code().unwrap_or(-1), stderr)
    }

    fn apply(&self, args: &[&str]) -> String {
        let (code, log) = self.istio_iptables(args, &[]);
        assert_eq!(code, 0, "istio-iptables {args:?} failed:\n{log}");
        log
    }

    fn exec(&self, ns: &str, cmd: &[&str]) -> Output {
        let mut args = vec!["netns", "exec", ns];
        args.extend_from_slice(cmd);
        run("ip", &args)
    }

    /// The backend's view of the namespace's rules (`iptables-save` + `ip6tables-save`, or
    /// `nft list ruleset`), counters and comments removed.
    fn ruleset(&self, backend: Backend) -> String {
        let cmds: &[&[&str]] = match backend {
            Backend::Iptables => &[&["iptables-save"], &["ip6tables-save"]],
            Backend::Nft => &[&["nft", "list", "ruleset"]],
        };
        let mut out = String::new();
        for cmd in cmds {
            let text = String::from_utf8_lossy(&self.exec(&self.app, cmd).stdout).into_owned();
            for line in text.lines().filter(|l| !l.starts_with('#')) {
                let line = strip_counters(line);
                out.push_str(&line);
                out.push('\n');
            }
        }
        out
    }

    /// Rules of other software that must survive our apply and cleanup.
    fn add_foreign_rules(&self) {
        for (bin, addr) in [
            ("iptables", "203.0.113.7"),
            ("ip6tables", "2001:db8:ffff::7"),
        ] {
            for table in ["nat", "mangle", "raw"] {
                self.exec(
                    &self.app,
                    &[bin, "-t", table, "-A", "OUTPUT", "-d", addr, "-j", "RETURN"],
                );
            }
            self.exec(&self.app, &[bin, "-A", "INPUT", "-s", addr, "-j", "ACCEPT"]);
        }
        self.exec(&self.app, &["nft", "add table inet foreign; add chain inet foreign out { type filter hook output priority 0 ; }; add rule inet foreign out ip daddr 203.0.113.8 counter accept"]);
    }

    /// A socket created inside namespace `ns`.
    fn in_ns<T: Send + 'static>(&self, ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{ns}");
        std::thread::spawn(move || {
            let fd = File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .expect("namespace thread")
    }

    fn listen(&self, ns: &str, addr: &str) -> TcpListener {
        let addr: SocketAddr = addr.parse().unwrap();
        let l = self.in_ns(ns, move || {
            TcpListener::bind(addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"))
        });
        l.set_nonblocking(true).unwrap();
        l
    }

    /// A root-owned (uid 0) connection from namespace `ns`.
    fn connect(&self, ns: &str, dst: &str) -> std::io::Result<TcpStream> {
        let dst: SocketAddr = dst.parse().unwrap();
        self.in_ns(ns, move || TcpStream::connect_timeout(&dst, WAIT))
    }

    /// A connection owned by uid/gid 1337 (the proxy) from the app namespace, kept open
    /// for a moment.
    fn connect_as_proxy(&self, ip: &str, port: u16) -> std::process::Child {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.app,
                "setpriv",
                "--reuid=1337",
                "--regid=1337",
                "--clear-groups",
            ])
            .args([
                "bash",
                "-c",
                &format!("exec 3<>/dev/tcp/{ip}/{port} && echo hi >&3 && sleep 2"),
            ])
            .spawn()
            .expect("spawn setpriv bash")
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        for ns in [&self.app, &self.peer] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{}", self.app));
    }
}

fn strip_counters(line: &str) -> String {
    // iptables-save `[p:b]` on chain lines; nft `counter packets N bytes M`.
    let mut s = line.to_owned();
    if let (Some(a), Some(b)) = (s.rfind('['), s.rfind(']'))
        && s.starts_with(':')
        && a < b
    {
        s.replace_range(a..=b, "[0:0]");
    }
    if let Some(i) = s.find("counter packets ") {
        let rest = &s[i + "counter packets ".len()..];
        let mut parts = rest.splitn(4, ' ');
        let (_, _, _) = (parts.next(), parts.next(), parts.next());
        let tail = parts.next().unwrap_or("");
        s = format!("{}counter {}", &s[..i], tail);
    }
    s.trim_end().to_owned()
}

/// Equal rulesets, or a panic showing the lines that differ.
fn assert_same(got: &str, want: &str, what: &str) {
    if got == want {
        return;
    }
    let g: Vec<&str> = got.lines().collect();
    let w: Vec<&str> = want.lines().collect();
    let extra: Vec<&&str> = g.iter().filter(|l| !w.contains(l)).collect();
    let missing: Vec<&&str> = w.iter().filter(|l| !g.contains(l)).collect();
    panic!(
        "{what}\nextra lines: {extra:#?}\nmissing lines: {missing:#?}\n--- got ---\n{got}\n--- want ---\n{want}"
    );
}

fn accept_within(l: &TcpListener, within: Duration) -> Option<(TcpStream, SocketAddr)> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        match l.accept() {
            Ok(c) => return Some(c),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
    None
}

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// The injector's arguments for a pod with `excludeOutboundPorts: "9090"`.
fn sidecar() -> Vec<&'static str> {
    [
        ISTIO_INIT_DEFAULT_ARGS,
        &["-o", "9090", "--log_output_level=default:info"],
    ]
    .concat()
}

fn with_backend<'a>(backend: Backend, args: &[&'a str]) -> Vec<&'a str> {
    let mut v: Vec<&str> = backend.flags().to_vec();
    v.extend_from_slice(args);
    v
}

/// Default sidecar capture with real connections, then idempotence and cleanup.
fn sidecar_capture(backend: Backend) {
    let pod = Pod::new();
    pod.add_foreign_rules();
    let before = pod.ruleset(backend);
    let args = with_backend(backend, &sidecar());
    let log = pod.apply(&args);

    let outbound = pod.listen(&pod.app, "0.0.0.0:15001");
    let inbound = pod.listen(&pod.app, "0.0.0.0:15006");
    let peer8080 = pod.listen(&pod.peer, &format!("{PEER}:8080"));
    let peer9090 = pod.listen(&pod.peer, &format!("{PEER}:9090"));
    let app15020 = pod.listen(&pod.app, &format!("{APP}:15020"));

    // App traffic to a remote address lands on 15001 with its original destination.
    let _c = pod
        .connect(&pod.app, &format!("{PEER}:8080"))
        .expect("outbound connect");
    let (s, _) = accept_within(&outbound, WAIT).unwrap_or_else(|| {
        panic!(
            "outbound not captured on 15001\n{log}\n{}",
            pod.ruleset(backend)
        )
    });
    assert_eq!(original_dst(&s, false), Some(sa(&format!("{PEER}:8080"))));
    assert!(
        accept_within(&peer8080, QUIET).is_none(),
        "captured connection also reached the peer"
    );

    // Inbound traffic to an app port lands on 15006 with its original destination.
    let _c = pod
        .connect(&pod.peer, &format!("{APP}:8080"))
        .expect("inbound connect");
    let (s, from) = accept_within(&inbound, WAIT).expect("inbound not captured on 15006");
    assert_eq!(original_dst(&s, false), Some(sa(&format!("{APP}:8080"))));
    assert_eq!(from.ip(), PEER.parse::<IpAddr>().unwrap());

    // The proxy's own traffic (uid 1337) is not captured: it reaches the peer.
    let mut child = pod.connect_as_proxy(PEER, 8080);
    let (mut s, _) =
        accept_within(&peer8080, WAIT).expect("uid 1337 traffic did not reach the peer");
    let mut buf = [0u8; 3];
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"hi\n");
    assert!(
        accept_within(&outbound, QUIET).is_none(),
        "uid 1337 traffic was captured"
    );
    let _ = child.wait();

    // Excluded ports are not redirected: outbound -o 9090, inbound -d 15020.
    let _c = pod
        .connect(&pod.app, &format!("{PEER}:9090"))
        .expect("excluded outbound connect");
    assert!(
        accept_within(&peer9090, WAIT).is_some(),
        "-o 9090 traffic did not reach the peer"
    );
    assert!(
        accept_within(&outbound, QUIET).is_none(),
        "-o 9090 traffic was captured"
    );
    let _c = pod
        .connect(&pod.peer, &format!("{APP}:15020"))
        .expect("excluded inbound connect");
    assert!(
        accept_within(&app15020, WAIT).is_some(),
        "-d 15020 traffic did not reach the app port"
    );
    assert!(
        accept_within(&inbound, QUIET).is_none(),
        "-d 15020 traffic was captured"
    );

    // A second run changes nothing.
    let applied = pod.ruleset(backend);
    let log2 = pod.apply(&args);
    assert_same(
        &pod.ruleset(backend),
        &applied,
        &format!("second run changed the ruleset\n{log2}"),
    );
    if backend == Backend::Iptables {
        assert!(
            log2.contains("nothing to apply"),
            "second run applied rules:\n{log2}"
        );
    }

    // --cleanup-only restores exactly what was there before (foreign rules included).
    let mut cleanup = args.clone();
    cleanup.push("--cleanup-only");
    let log3 = pod.apply(&cleanup);
    assert_same(
        &pod.ruleset(backend),
        &before,
        &format!("cleanup did not restore the ruleset\n{log3}"),
    );
}

#[test]
fn iptables_sidecar_capture() {
    sidecar_capture(Backend::Iptables);
}

#[test]
fn nft_sidecar_capture() {
    sidecar_capture(Backend::Nft);
}

/// `--redirect-dns`: DNS to the resolv.conf server reaches the agent on 15053 (UDP and TCP).
fn dns_capture(backend: Backend) {
    let pod = Pod::new();
    pod.resolv_conf("nameserver 192.0.2.53\n");
    let args = with_backend(backend, &["-i", "*", "-b", "*", "--redirect-dns"]);
    let log = pod.apply(&args);
    let udp = pod.in_ns(&pod.app, || {
        UdpSocket::bind("127.0.0.1:15053").expect("bind udp 15053")
    });
    udp.set_read_timeout(Some(WAIT)).unwrap();
    let tcp = pod.listen(&pod.app, "127.0.0.1:15053");

    let client = pod.in_ns(&pod.app, || {
        UdpSocket::bind("0.0.0.0:0").expect("bind udp client")
    });
    client.send_to(b"query", "192.0.2.53:53").unwrap();
    let mut buf = [0u8; 16];
    let (n, _) = udp.recv_from(&mut buf).unwrap_or_else(|e| {
        panic!(
            "UDP DNS not redirected to 15053: {e}\n{log}\n{}",
            pod.ruleset(backend)
        )
    });
    assert_eq!(&buf[..n], b"query");

    let _c = pod
        .connect(&pod.app, "192.0.2.53:53")
        .expect("tcp dns connect");
    let (s, _) = accept_within(&tcp, WAIT).expect("TCP DNS not redirected to 15053");
    assert_eq!(original_dst(&s, false), Some(sa("192.0.2.53:53")));

    // A server not in resolv.conf is not captured (Istio captures only resolv.conf servers).
    client.send_to(b"other", "192.0.2.54:53").unwrap();
    udp.set_read_timeout(Some(QUIET)).unwrap();
    assert!(
        udp.recv_from(&mut buf).is_err(),
        "DNS to a non-resolv.conf server was captured"
    );

    let mut cleanup = args.clone();
    cleanup.push("--cleanup-only");
    pod.apply(&cleanup);
}

#[test]
fn iptables_dns_capture() {
    dns_capture(Backend::Iptables);
}

#[test]
fn nft_dns_capture() {
    dns_capture(Backend::Nft);
}

/// TPROXY mode delivers inbound connections with the original source and destination.
fn tproxy_delivery(backend: Backend) {
    let pod = Pod::new();
    let args = with_backend(
        backend,
        &["-m", "TPROXY", "-b", "*", "-i", "*", "-d", "15020"],
    );
    let log = pod.apply(&args);
    let rules =
        String::from_utf8_lossy(&pod.exec(&pod.app, &["ip", "rule", "show"]).stdout).into_owned();
    assert!(
        rules.contains("fwmark 0x539 lookup 133"),
        "no TPROXY policy rule:\n{rules}"
    );
    let listener = pod.in_ns(&pod.app, || {
        let fd = socket::socket(
            socket::AddressFamily::Inet,
            socket::SockType::Stream,
            socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("socket");
        socket::setsockopt(&fd, sockopt::IpTransparent, &true).expect("IP_TRANSPARENT");
        socket::setsockopt(&fd, sockopt::ReuseAddr, &true).expect("SO_REUSEADDR");
        let addr = socket::SockaddrIn::new(0, 0, 0, 0, 15006);
        socket::bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr).expect("bind 15006");
        socket::listen(&fd, socket::Backlog::new(16).expect("backlog")).expect("listen");
        TcpListener::from(fd)
    });
    listener.set_nonblocking(true).unwrap();

    let mut c = pod
        .connect(&pod.peer, &format!("{APP}:8080"))
        .expect("inbound connect");
    let (mut s, from) = accept_within(&listener, WAIT).unwrap_or_else(|| {
        panic!(
            "TPROXY did not deliver to 15006\n{log}\n{}",
            pod.ruleset(backend)
        )
    });
    // TPROXY keeps both ends: the socket's local address is the original destination.
    assert_eq!(s.local_addr().unwrap(), sa(&format!("{APP}:8080")));
    assert_eq!(
        from,
        c.local_addr().unwrap(),
        "original source not preserved"
    );
    c.write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");

    let mut cleanup = args.clone();
    cleanup.push("--cleanup-only");
    pod.apply(&cleanup);
    let rules =
        String::from_utf8_lossy(&pod.exec(&pod.app, &["ip", "rule", "show"]).stdout).into_owned();
    assert!(
        !rules.contains("lookup 133"),
        "cleanup left the TPROXY policy rule:\n{rules}"
    );
}

#[test]
fn iptables_tproxy_delivery() {
    tproxy_delivery(Backend::Iptables);
}

#[test]
fn nft_tproxy_delivery() {
    tproxy_delivery(Backend::Nft);
}

/// [`ISTIO_INIT_DEFAULT_ARGS`] with the values of the flags in `set` replaced (what a pod's
/// annotations change), followed by `extra`.
fn injected(set: &[(&str, &'static str)], extra: &[&'static str]) -> Vec<&'static str> {
    let mut v = ISTIO_INIT_DEFAULT_ARGS.to_vec();
    for (flag, value) in set {
        let i = v.iter().position(|a| a == flag).expect("a default flag");
        v[i + 1] = value;
    }
    v.extend_from_slice(extra);
    v
}

const LOG: &str = "--log_output_level=default:info";

/// Argument lists Istio's injection template emits for istio-init (and the CNI validation
/// container), each applied for real and cleaned up again.
fn injected_lists() -> Vec<Vec<&'static str>> {
    vec![
        // default
        injected(&[], &[LOG]),
        // TPROXY (interceptionMode annotation)
        injected(&[("-m", "TPROXY")], &[LOG]),
        // includeInboundPorts / excludeOutboundPorts / excludeOutboundIPRanges / includeOutboundPorts
        injected(
            &[
                ("-i", "10.96.0.0/12,2001:db8:1::/64"),
                ("-x", "169.254.169.254/32"),
                ("-b", "8080,9090"),
            ],
            &["-q", "3306", "-o", "25,465", LOG],
        ),
        // kubevirtInterfaces and excludeInterfaces
        injected(&[], &["-k", "net1", "-c", "net2", LOG]),
        // DNS capture (ISTIO_META_DNS_CAPTURE arrives as env; here the flag), drop invalid, dual stack
        injected(
            &[],
            &["--redirect-dns", "--drop-invalid", "--dual-stack", LOG],
        ),
        // forceApplyIptables + logAsJson
        injected(&[], &["--force-apply", LOG, "--log_as_json"]),
        // OpenShift-style proxy uid
        injected(&[("-u", "1000650001")], &[LOG]),
        // CNI validation container
        injected(
            &[],
            &[
                "--run-validation",
                "--skip-rule-apply",
                "--probe-timeout=1s",
            ],
        ),
    ]
}

fn injected_args(backend: Backend) {
    let pod = Pod::new();
    pod.resolv_conf("nameserver 192.0.2.53\nnameserver 2001:db8::53\n");
    pod.add_foreign_rules();
    let before = pod.ruleset(backend);
    for args in injected_lists() {
        let args = with_backend(backend, &args);
        let validation_only = args.contains(&"--skip-rule-apply");
        let (code, log) = pod.istio_iptables(&args, &[("ISTIO_OUTBOUND_OWNER_GROUPS", "*")]);
        if validation_only {
            // No rules in place: validation must fail with Istio's exit code and message.
            assert_eq!(code, 126, "{args:?}:\n{log}");
            assert!(
                log.contains("iptables validation failed; workload is not ready for Istio."),
                "{log}"
            );
            continue;
        }
        assert_eq!(code, 0, "{args:?} rejected or failed:\n{log}");
        assert_ne!(pod.ruleset(backend), before, "{args:?} applied nothing");
        let mut cleanup = args.clone();
        cleanup.push("--cleanup-only");
        let log = pod.apply(&cleanup);
        assert_same(
            &pod.ruleset(backend),
            &before,
            &format!("{args:?}: cleanup did not restore the ruleset\n{log}"),
        );
    }
}

#[test]
fn iptables_injected_args_apply_and_clean_up() {
    injected_args(Backend::Iptables);
}

#[test]
fn nft_injected_args_apply_and_clean_up() {
    injected_args(Backend::Nft);
}

/// `--run-validation` passes once the rules are in place (the probe from the proxy uid to
/// 127.0.0.6:15002 is redirected to 15006 with its original port).
#[test]
fn run_validation_passes_with_rules() {
    let pod = Pod::new();
    pod.apply(&sidecar());
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &pod.app,
            "setpriv",
            "--reuid=1337",
            "--regid=1337",
            "--clear-groups",
            BIN,
        ])
        .args([
            "istio-iptables",
            "--run-validation",
            "--skip-rule-apply",
            "--probe-timeout=5s",
        ])
        .output()
        .expect("run validation");
    assert!(
        out.status.success(),
        "validation failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The forced legacy binary is used when asked for, and the rules land in legacy tables.
#[test]
fn forced_legacy_binary() {
    let pod = Pod::new();
    let log = pod.apply(&["--force-iptables-binary", "legacy", "-b", "*", "-i", "*"]);
    assert!(log.contains("iptables-legacy-restore"), "{log}");
    let save =
        String::from_utf8_lossy(&pod.exec(&pod.app, &["iptables-legacy-save"]).stdout).into_owned();
    assert!(save.contains("-A OUTPUT -j ISTIO_OUTPUT"), "{save}");
    // Legacy rules present: a plain run now picks legacy too (Istio DetectIptablesVersion).
    let log = pod.apply(&["-b", "*", "-i", "*"]);
    assert!(log.contains("iptables-legacy-restore"), "{log}");
    pod.apply(&["--force-iptables-binary", "legacy", "--cleanup-only"]);
    let save =
        String::from_utf8_lossy(&pod.exec(&pod.app, &["iptables-legacy-save"]).stdout).into_owned();
    assert!(!save.contains("ISTIO_"), "{save}");
}

/// Legacy tables that exist but hold no rule (instantiated by a listing, as a detection probe
/// or an earlier run's `iptables-legacy-save` does) do not make the next run pick legacy:
/// only `-A` rules count (Istio #61019/#61020; the pinned Istio counts ≥ 3 lines of
/// `*-save` output, which these tables already give).
#[test]
fn legacy_tables_without_rules_do_not_prime_legacy() {
    let pod = Pod::new();
    let list = pod.exec(&pod.app, &["iptables-legacy", "-t", "nat", "-L", "-n"]);
    assert!(
        list.status.success(),
        "priming the legacy nat table: {}",
        String::from_utf8_lossy(&list.stderr)
    );
    let names = String::from_utf8_lossy(
        &pod.exec(&pod.app, &["cat", "/proc/net/ip_tables_names"])
            .stdout,
    )
    .into_owned();
    assert!(
        names.contains("nat"),
        "legacy nat table not instantiated: {names:?}"
    );
    let save =
        String::from_utf8_lossy(&pod.exec(&pod.app, &["iptables-legacy-save"]).stdout).into_owned();
    assert!(
        save.lines().count() >= 3 && !save.lines().any(|l| l.starts_with("-A ")),
        "{save}"
    );
    let log = pod.apply(&["-b", "*", "-i", "*"]);
    assert!(log.contains("iptables-nft-restore"), "{log}");
    assert!(!log.contains("iptables-legacy-restore"), "{log}");
    pod.apply(&["--cleanup-only"]);
}

/// Bad flags exit 1 naming the flag and the value (no namespace needed: nothing is applied).
#[test]
fn bad_flags_exit_1() {
    for (args, flag, value) in [
        (
            &["-x", "10.0.0.0/8,*"][..],
            "--istio-service-exclude-cidr",
            "10.0.0.0/8,*",
        ),
        (&["-p", "http"], "--envoy-port", "http"),
        (
            &["-m", "BOGUS"],
            "--istio-inbound-interception-mode",
            "BOGUS",
        ),
        (
            &["--force-iptables-binary", "xtables"],
            "--force-iptables-binary",
            "xtables",
        ),
    ] {
        let out = Command::new(BIN)
            .arg("istio-iptables")
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(flag) && err.contains(value), "{args:?}: {err}");
    }
    let out = Command::new(BIN)
        .args(["istio-iptables", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && help.contains("-b, --istio-inbound-ports string"),
        "{help}"
    );
}

/// `--dry-run` prints the save probe and the restore input and changes nothing.
#[test]
fn dry_run_prints_and_changes_nothing() {
    let pod = Pod::new();
    let before = pod.ruleset(Backend::Iptables);
    let out = pod.exec(
        &pod.app,
        &[BIN, "istio-iptables", "-n", "-b", "*", "-i", "*"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("iptables-save\niptables-restore --noflush"),
        "{stdout}"
    );
    assert!(stdout.contains("-A OUTPUT -j ISTIO_OUTPUT"), "{stdout}");
    assert_eq!(pod.ruleset(Backend::Iptables), before);
}

/// `--reconcile`: a changed configuration replaces the old rules (guardrails removed again),
/// ending where a fresh apply of the new configuration ends.
#[test]
fn iptables_reconcile_replaces_changed_rules() {
    let new_args = ["-b", "8080", "-i", "10.0.0.0/8", "-c", "lo2", "--reconcile"];
    // Foreign rules in both, so both have the same tables (iptables-save lists a table once
    // it exists, even when empty).
    let fresh = Pod::new();
    fresh.add_foreign_rules();
    fresh.apply(&new_args);
    let want = fresh.ruleset(Backend::Iptables);

    let pod = Pod::new();
    pod.add_foreign_rules();
    pod.apply(&["-b", "*", "-i", "*", "-d", "15020", "-m", "TPROXY"]);
    // Without --reconcile the drift is reported; with it the rules are replaced.
    let log = pod.apply(&new_args);
    assert!(
        log.contains("Setting up guardrails") && log.contains("Removing guardrails"),
        "{log}"
    );
    assert_same(
        &pod.ruleset(Backend::Iptables),
        &want,
        &format!("reconcile did not converge\n{log}"),
    );
    // A re-run with the same flags is a no-op.
    let log = pod.apply(&new_args);
    assert!(log.contains("nothing to apply"), "{log}");
}

/// Missing binaries are clear errors (run inside a namespace all the same, so a bug here
/// could never touch the host's rules).
#[test]
fn missing_binaries_are_clear_errors() {
    let pod = Pod::new();
    for (flags, want) in [
        (
            &["--native-nftables"][..],
            "nativeNftables is enabled, but the nft binary is missing",
        ),
        (&[][..], "no iptables binary found in PATH"),
    ] {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &pod.app,
                "/usr/bin/env",
                "PATH=/nonexistent",
                BIN,
                "istio-iptables",
            ])
            .args(flags)
            .args(["-b", "*", "-i", "*"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {err}");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
}

/// Dual stack: IPv6 app traffic is captured too (ip6tables / the inet tables' ip6 rules),
/// with the original destination, and IPv6 inbound lands on 15006.
fn dual_stack_capture(backend: Backend) {
    let pod = Pod::new();
    let args = with_backend(backend, &["-b", "*", "-i", "*", "--dual-stack"]);
    let log = pod.apply(&args);
    let outbound = pod.listen(&pod.app, "[::]:15001");
    let inbound = pod.listen(&pod.app, "[::]:15006");
    let _c = pod
        .connect(&pod.app, "[2001:db8::2]:8080")
        .expect("v6 outbound connect");
    let (s, _) =
        accept_within(&outbound, WAIT).unwrap_or_else(|| panic!("v6 outbound not captured\n{log}"));
    assert_eq!(original_dst(&s, true), Some(sa("[2001:db8::2]:8080")));
    let _c = pod
        .connect(&pod.peer, "[2001:db8::1]:8080")
        .expect("v6 inbound connect");
    let (s, _) = accept_within(&inbound, WAIT).expect("v6 inbound not captured");
    assert_eq!(original_dst(&s, true), Some(sa("[2001:db8::1]:8080")));
    let addrs = String::from_utf8_lossy(
        &pod.exec(&pod.app, &["ip", "-6", "addr", "show", "dev", "lo"])
            .stdout,
    )
    .into_owned();
    assert!(addrs.contains("::6/128"), "::6 not added to lo:\n{addrs}");
}

#[test]
fn iptables_dual_stack_capture() {
    dual_stack_capture(Backend::Iptables);
}

#[test]
fn nft_dual_stack_capture() {
    dual_stack_capture(Backend::Nft);
}

/// IPv6 is detected from the first non-loopback address: an IPv6-only pod gets ip6tables
/// rules without `--dual-stack`; an IPv4 pod gets none.
#[test]
fn ipv6_is_auto_detected() {
    let pod = Pod::new();
    pod.apply(&["-b", "*", "-i", "*"]);
    let v6 = String::from_utf8_lossy(&pod.exec(&pod.app, &["ip6tables-save"]).stdout).into_owned();
    assert!(!v6.contains("ISTIO_"), "IPv4 pod got IPv6 rules:\n{v6}");
    pod.apply(&["--cleanup-only"]);

    let del = [
        "ip",
        "addr",
        "del",
        &format!("{APP}/24"),
        "dev",
        &pod.app_dev,
    ];
    pod.exec(&pod.app, &del);
    pod.apply(&["-b", "*", "-i", "*"]);
    let v6 = String::from_utf8_lossy(&pod.exec(&pod.app, &["ip6tables-save"]).stdout).into_owned();
    assert!(
        v6.contains("-A OUTPUT -j ISTIO_OUTPUT") && v6.contains("::6/128"),
        "IPv6 pod got no IPv6 rules:\n{v6}"
    );
}

/// The VM form (no arguments, env only, `ISTIO_META_DNS_CAPTURE` from proxyMetadata),
/// `DRY_RUN_FILE_PATH`, and `--network-namespace` (run from the app namespace against the
/// peer namespace, so even a bug could only touch test namespaces).
#[test]
fn env_only_dry_run_file_and_network_namespace() {
    let pod = Pod::new();
    pod.resolv_conf("nameserver 192.0.2.53\n");
    let env = [
        ("ISTIO_INBOUND_PORTS", "*"),
        ("ISTIO_SERVICE_CIDR", "*"),
        ("ISTIO_LOCAL_EXCLUDE_PORTS", "22"),
        ("ISTIO_META_DNS_CAPTURE", "true"),
    ];
    let (code, log) = pod.istio_iptables(&[], &env);
    assert_eq!(code, 0, "{log}");
    let save = String::from_utf8_lossy(&pod.exec(&pod.app, &["iptables-save"]).stdout).into_owned();
    for want in [
        "-A ISTIO_INBOUND -p tcp -m tcp --dport 22 -j RETURN",
        "-A ISTIO_OUTPUT -j ISTIO_REDIRECT",
        "-A ISTIO_OUTPUT_DNS -d 192.0.2.53/32 -p udp -m udp --dport 53 -j REDIRECT --to-ports 15053",
    ] {
        assert!(save.contains(want), "missing {want:?}:\n{save}");
    }

    let file = format!("/tmp/{}-dry-run.txt", pod.app);
    let (code, log) = pod.istio_iptables(&["-n", "-b", "*"], &[("DRY_RUN_FILE_PATH", &file)]);
    assert_eq!(code, 0, "{log}");
    let dumped = std::fs::read_to_string(&file).unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(
        dumped.starts_with("iptables-save\n")
            && dumped.contains("-A PREROUTING -p tcp -j ISTIO_INBOUND"),
        "{dumped}"
    );

    let before_app = pod.ruleset(Backend::Iptables);
    let peer_before =
        String::from_utf8_lossy(&pod.exec(&pod.peer, &["iptables-save"]).stdout).into_owned();
    assert!(!peer_before.contains("ISTIO_"), "{peer_before}");
    pod.apply(&["--network-namespace", &pod.peer, "-b", "*", "-i", "*"]);
    let peer_after =
        String::from_utf8_lossy(&pod.exec(&pod.peer, &["iptables-save"]).stdout).into_owned();
    assert!(
        peer_after.contains("-A OUTPUT -j ISTIO_OUTPUT"),
        "rules not in the named namespace:\n{peer_after}"
    );
    assert_same(
        &pod.ruleset(Backend::Iptables),
        &before_app,
        "--network-namespace changed the caller's namespace",
    );
}

/// Every flag at once: a re-run is a no-op (our rules compare equal to iptables-save's
/// spelling of them), and a changed configuration is seen as drift.
#[test]
fn iptables_complex_rerun_is_noop_and_drift_is_detected() {
    let pod = Pod::new();
    pod.resolv_conf("nameserver 192.0.2.53\nnameserver 2001:db8::53\n");
    pod.add_foreign_rules();
    let args = [
        "-m",
        "TPROXY",
        "-b",
        "*",
        "-d",
        "15020,15021",
        "-i",
        "10.96.0.0/12,2001:db8:1::/64",
        "-x",
        "10.96.0.1/32",
        "-q",
        "3306",
        "-o",
        "25",
        "-k",
        "kv0",
        "-c",
        "ex0",
        "--redirect-dns",
        "--drop-invalid",
        "--dual-stack",
        "-t",
        "1400",
    ];
    let env = [("ISTIO_OUTBOUND_OWNER_GROUPS", "0,1337")];
    let (code, log) = pod.istio_iptables(&args, &env);
    assert_eq!(code, 0, "{log}");
    let applied = pod.ruleset(Backend::Iptables);
    let (code, log) = pod.istio_iptables(&args, &env);
    assert_eq!(code, 0, "{log}");
    assert!(
        log.contains("nothing to apply"),
        "re-run was not a no-op:\n{log}"
    );
    assert_same(
        &pod.ruleset(Backend::Iptables),
        &applied,
        "re-run changed the ruleset",
    );

    // --force-apply over the same state replaces it (no "Chain already exists").
    let mut force = args.to_vec();
    force.push("--force-apply");
    let (code, log) = pod.istio_iptables(&force, &env);
    assert_eq!(code, 0, "{log}");
    assert_same(
        &pod.ruleset(Backend::Iptables),
        &applied,
        "--force-apply changed the ruleset",
    );

    // Same chains and rule counts, different rule: still drift.
    let mut changed = args.to_vec();
    changed[3] = "8080";
    let mut reconcile = changed.clone();
    reconcile.push("--reconcile");
    let (code, log) = pod.istio_iptables(&reconcile, &env);
    assert_eq!(code, 0, "{log}");
    assert!(
        log.contains("Performing cleanup"),
        "drift not detected:\n{log}"
    );
    let save = String::from_utf8_lossy(
        &pod.exec(&pod.app, &["iptables-save", "-t", "mangle"])
            .stdout,
    )
    .into_owned();
    assert!(save.contains("--dport 8080"), "{save}");
    let mut cleanup = reconcile.clone();
    cleanup.push("--cleanup-only");
    pod.apply(&cleanup);
    let before = Pod::new();
    before.add_foreign_rules();
    assert_same(
        &pod.ruleset(Backend::Iptables),
        &before.ruleset(Backend::Iptables),
        "cleanup left rules",
    );
}

/// `#` in `-u`/`-c` once became an nft comment: `meta skuid 1337` lost its verdict (Envoy's
/// own traffic looped back into Envoy) and the interface exclusion did nothing, while the
/// command exited 0. Now both backends refuse `-u 1337#` before touching the namespace,
/// naming the flag, the value and what was expected.
#[test]
fn hash_in_uid_and_interface_fails_on_both_backends() {
    let pod = Pod::new();
    for backend in [Backend::Nft, Backend::Iptables] {
        let args = with_backend(backend, &["-u", "1337#", "-c", "eth9#"]);
        let (code, log) = pod.istio_iptables(&args, &[]);
        assert_eq!(code, 1, "{backend:?}: {args:?} must fail:\n{log}");
        assert!(
            log.contains("--proxy-uid") && log.contains("\"1337#\"") && log.contains("expected"),
            "{backend:?}: the error must name the flag, the value and what was expected:\n{log}"
        );
        let rules = pod.ruleset(backend);
        assert!(
            !rules.contains("istio") && !rules.contains("ISTIO"),
            "{backend:?}: nothing may be applied:\n{rules}"
        );
        // The same value from the environment is named as such.
        let (code, log) = pod.istio_iptables(backend.flags(), &[("PROXY_UID", "1337#")]);
        assert_eq!(code, 1, "{backend:?}: $PROXY_UID=1337# must fail:\n{log}");
        assert!(
            log.contains("$PROXY_UID") && log.contains("\"1337#\""),
            "{log}"
        );
    }
}

/// Interface names the kernel accepts (`#`, `;`, `{` and nft keywords included) are applied
/// by both backends with the same meaning: quoted in the nft text, the exclusion keeps its
/// `return`; iptables' `+` wildcard becomes nft's `*`. A name the kernel refuses, and user
/// names that do not exist, fail before anything is applied.
#[test]
fn kernel_valid_interface_names_apply_on_both_backends() {
    let pod = Pod::new();
    let nics = "eth9#,a;{b},return,veth+";
    for backend in [Backend::Nft, Backend::Iptables] {
        let args = with_backend(backend, &["-i", "*", "-c", nics, "-k", "kv#1"]);
        pod.apply(&args);
        let rules = pod.ruleset(backend);
        let want: &[&str] = match backend {
            Backend::Nft => &[
                "iifname \"eth9#\" counter return",
                "oifname \"eth9#\" counter return",
                "iifname \"a;{b}\" counter return",
                "oifname \"return\" counter return",
                "iifname \"veth*\" counter return",
                "iifname \"kv#1\" counter jump istio-redirect",
            ],
            Backend::Iptables => &[
                "-A PREROUTING -i eth9# -j RETURN",
                "-A OUTPUT -o eth9# -j RETURN",
                "-A PREROUTING -i a;{b} -j RETURN",
                "-A OUTPUT -o return -j RETURN",
                "-A PREROUTING -i veth+ -j RETURN",
                "-A PREROUTING -i kv#1 -j ISTIO_REDIRECT",
            ],
        };
        for w in want {
            assert!(
                rules.lines().any(|l| l.trim().ends_with(w)),
                "{backend:?}: missing `{w}` in\n{rules}"
            );
        }
        pod.apply(&with_backend(backend, &["--cleanup-only"]));
    }
    for (args, flag, value) in [
        (
            &["-c", "0123456789abcdef"][..],
            "--istio-exclude-interfaces",
            "0123456789abcdef",
        ),
        (&["-k", "a/b"], "--kube-virt-interfaces", "a/b"),
        (&["-u", "no-such-user-r1"], "--proxy-uid", "no-such-user-r1"),
        (
            &["-g", "no-such-group-r1"],
            "--proxy-gid",
            "no-such-group-r1",
        ),
    ] {
        for backend in [Backend::Nft, Backend::Iptables] {
            let (code, log) = pod.istio_iptables(&with_backend(backend, args), &[]);
            assert_eq!(code, 1, "{backend:?} {args:?}:\n{log}");
            assert!(
                log.contains(flag) && log.contains(value),
                "{args:?}:\n{log}"
            );
            let rules = pod.ruleset(backend);
            assert!(
                !rules.contains("istio") && !rules.contains("ISTIO"),
                "{rules}"
            );
        }
    }
}

/// One way to pass a value: arguments, environment, and the name an error must show.
type Source = (Vec<String>, Vec<(String, String)>, String);

/// How a hostile value must come out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Refused, naming the source and the value.
    Refused,
    /// Accepted (the kernel allows it); the rendered nft text keeps every verdict and
    /// `nft -c -f -` loads it.
    Quoted,
}

/// Every flag and env variable whose value reaches rule text, with hostile values: comment,
/// statement and set characters, newline, quotes, spaces, overlong names, out-of-range
/// numbers. Each is refused with a clear error, or — interface names the kernel accepts —
/// rendered quoted so that nft loads it and every rule keeps its verdict.
#[test]
fn every_rule_text_value_refuses_or_quotes_hostile_input() {
    use Outcome::{Quoted, Refused};
    use meshagent::iptables::config::{Config, MapEnv};
    // (flag, env variable, what it takes)
    let ids: &[(&str, &str)] = &[
        ("--proxy-uid", "PROXY_UID"),
        ("--proxy-gid", "PROXY_GID"),
        ("", "ISTIO_OUTBOUND_OWNER_GROUPS"),
        ("", "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE"),
    ];
    let nics: &[(&str, &str)] = &[
        ("--istio-exclude-interfaces", "ISTIO_EXCLUDE_INTERFACES"),
        ("--kube-virt-interfaces", "KUBE_VIRT_INTERFACES"),
    ];
    let ports: &[(&str, &str)] = &[
        ("--envoy-port", ""),
        ("--inbound-capture-port", "INBOUND_CAPTURE_PORT"),
        ("--inbound-tunnel-port", "INBOUND_TUNNEL_PORT"),
        ("--istio-inbound-ports", "ISTIO_INBOUND_PORTS"),
        ("--istio-local-exclude-ports", "ISTIO_LOCAL_EXCLUDE_PORTS"),
        ("--istio-outbound-ports", "ISTIO_OUTBOUND_PORTS"),
        (
            "--istio-local-outbound-ports-exclude",
            "ISTIO_LOCAL_OUTBOUND_PORTS_EXCLUDE",
        ),
        ("--iptables-probe-port", "IPTABLES_PROBE_PORT"),
    ];
    let cidrs: &[(&str, &str)] = &[
        ("--istio-service-cidr", "ISTIO_SERVICE_CIDR"),
        ("--istio-service-exclude-cidr", "ISTIO_SERVICE_EXCLUDE_CIDR"),
        ("", "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR"),
    ];
    let numbers: &[(&str, &str)] = &[
        ("--istio-inbound-tproxy-mark", "ISTIO_INBOUND_TPROXY_MARK"),
        (
            "--istio-inbound-tproxy-route-table",
            "ISTIO_INBOUND_TPROXY_ROUTE_TABLE",
        ),
        (
            "--istio-inbound-interception-mode",
            "ISTIO_INBOUND_INTERCEPTION_MODE",
        ),
    ];
    let long_user = "u".repeat(300);
    let id_values: Vec<(&str, Outcome)> = vec![
        ("1337#", Refused),
        ("1337 #x", Refused),
        ("1337;", Refused),
        ("13;37", Refused),
        ("{1337}", Refused),
        ("1337\ncounter accept", Refused),
        ("\"1337\"", Refused),
        ("'1337'", Refused),
        ("13 37", Refused),
        ("root\\", Refused),
        ("4294967295", Refused),
        ("99999999999", Refused),
        ("010", Refused),
        ("-1", Refused),
        ("2000-1000", Refused),
        (long_user.as_str(), Refused),
    ];
    let nic_values: Vec<(&str, Outcome)> = vec![
        ("eth9#", Quoted),
        ("a;b", Quoted),
        ("{x}", Quoted),
        ("accept", Quoted),
        ("eth+", Quoted),
        ("a\nb", Refused),
        ("\"eth0\"", Refused),
        ("'eth0'", Refused),
        ("eth 0", Refused),
        ("eth\t0", Refused),
        ("a\\b", Refused),
        ("a/b", Refused),
        ("a:b", Refused),
        ("a*", Refused),
        ("+", Refused),
        (".", Refused),
        ("..", Refused),
        ("0123456789abcdef", Refused),
        ("é", Refused),
    ];
    let port_values = [
        "80#", "8;0", "{80}", "8\n0", "\"80\"", "8 0", "65536", "0x50",
    ];
    let cidr_values = [
        "127.0.0.0/8#",
        "127.0.0.0/8;",
        "{127.0.0.0/8}",
        "127.0.0.0/8\n#",
        "\"127.0.0.0/8\"",
        "127.0.0.0 /8",
    ];
    let number_values = [
        "1337#",
        "13;37",
        "{1}",
        "1\n2",
        "\"1\"",
        "1 2",
        "4294967296",
    ];

    let mut cases: Vec<((&str, &str), String, Outcome)> = Vec::new();
    for src in ids {
        for (v, o) in &id_values {
            cases.push((*src, (*v).to_owned(), *o));
        }
    }
    for src in nics {
        for (v, o) in &nic_values {
            cases.push((*src, (*v).to_owned(), *o));
        }
    }
    for (srcs, values) in [
        (ports, &port_values[..]),
        (cidrs, &cidr_values[..]),
        (numbers, &number_values[..]),
    ] {
        for src in srcs {
            for v in values {
                cases.push((*src, (*v).to_owned(), Refused));
            }
        }
    }
    let mut checked = 0;
    for ((flag, var), value, want) in cases {
        // The flag, then the env variable: each is a source the error must name.
        let mut sources: Vec<Source> = Vec::new();
        let base = ["--native-nftables".to_owned()];
        if !flag.is_empty() {
            let mut args = base.to_vec();
            args.push(format!("{flag}={value}"));
            sources.push((args, vec![], flag.to_owned()));
        }
        if !var.is_empty() {
            sources.push((
                base.to_vec(),
                vec![(var.to_owned(), value.clone())],
                format!("${var}"),
            ));
        }
        for (args, mut env, shown) in sources {
            // Capture everything outbound (kube-virt rules then jump too), unless that is
            // the variable under test.
            if var != "ISTIO_SERVICE_CIDR" {
                env.push(("ISTIO_SERVICE_CIDR".to_owned(), "*".to_owned()));
            }
            let env = MapEnv::from_pairs(env);
            let got = Config::from_args(&args, &env);
            match (want, got) {
                (Refused, Err(e)) => {
                    let e = e.to_string();
                    let v_trim = format!("{:?}", value.trim());
                    assert!(
                        e.contains(&shown)
                            && (e.contains(&format!("{value:?}")) || e.contains(&v_trim)),
                        "{shown}={value:?}: the error must name the source and value: {e}"
                    );
                }
                (Refused, Ok(c)) => panic!(
                    "{shown}={value:?} must be refused; renders:\n{}",
                    meshagent::iptables::nft::build(&c)
                ),
                (Quoted, Ok(c)) => {
                    let text = meshagent::iptables::nft::try_build(&c).unwrap();
                    meshagent::fuzzing::check_nft_text(&c, &text)
                        .unwrap_or_else(|e| panic!("{shown}={value:?}: {e}\n{text}"));
                    meshagent::fuzzing::nft_load_check(&text)
                        .unwrap_or_else(|e| panic!("{shown}={value:?}: {e}\n{text}"));
                }
                (Quoted, Err(e)) => panic!("{shown}={value:?} must be accepted: {e}"),
            }
            checked += 1;
        }
    }
    assert!(checked > 300, "only {checked} cases");
}
