//! The floors beside the side-by-side goals (`side_by_side.rs`, `side_by_side_load.rs`): what
//! the same work costs on this machine with no agent in the way, measured in the same run as the
//! two agents, so a goal that asks for less than the floor allows shows as such.
//!
//! * a trivial DNS responder (the most any DNS server can answer given dnsperf here);
//! * Envoy straight to istiod-box (the agent's generated bootstrap with `xds-grpc` re-pointed
//!   at istiod-box over TLS, the token as gRPC metadata, and `sds-grpc` at a static SDS server
//!   already holding a certificate from istiod-box's CA): the agent path minus the agent;
//! * the CA round trip and an RSA-2048 key generation on their own (work any agent does before
//!   its first certificate).
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use meshagent_testkit::istiod_box::IstiodBox;
use meshagent_testkit::static_sds::StaticSds;
use meshagent_testkit::{Envoy, Value, ca_client, http_get, json};
use tokio::time::Instant;

// === DNS: a trivial responder ===

/// Starts a DNS responder on a thread of its own: every query of at least a header and a
/// question gets one fixed A record (10.9.9.9, TTL 30) for the name asked, by one `recv_from`
/// and one `send_to`, no parsing beyond finding the question's end. Returns its address and
/// its thread's `/proc` directory (its CPU time: how busy it was while dnsperf ran).
pub fn dns_responder() -> (SocketAddr, PathBuf) {
    let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = sock.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        tx.send(Path::new("/proc").join(std::fs::read_link("/proc/thread-self").unwrap()))
            .unwrap();
        let mut buf = [0u8; 1500];
        loop {
            let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                continue;
            };
            if let Some(len) = answer_in_place(&mut buf, n) {
                let _ = sock.send_to(&buf[..len], peer);
            }
        }
    });
    (addr, rx.recv().unwrap())
}

/// CPU time of the thread at `/proc/<pid>/task/<tid>` (or `thread-self`'s target), ms.
pub fn thread_cpu_ms(dir: &Path) -> f64 {
    std::fs::read_to_string(dir.join("schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(f64::NAN, |ns| ns / 1e6)
}

/// Turns the query in `buf[..n]` into its answer in place; the answer's length, or `None` for
/// a packet that is not one question.
fn answer_in_place(buf: &mut [u8], n: usize) -> Option<usize> {
    if n < 12 || buf[2] & 0x80 != 0 {
        return None;
    }
    // The question: labels up to the root, then type and class.
    let mut i = 12;
    while i < n && buf[i] != 0 {
        i += 1 + usize::from(buf[i]);
    }
    let end = i + 5;
    if end > n || end + 16 > buf.len() {
        return None;
    }
    buf[2] = 0x84 | (buf[2] & 0x01); // QR, AA, RD copied
    buf[3] = 0x80; // RA, NOERROR
    buf[4..12].copy_from_slice(&[0, 1, 0, 1, 0, 0, 0, 0]);
    // A pointer to the question's name, A, IN, TTL 30, 4 bytes.
    buf[end..end + 16].copy_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4, 10, 9, 9, 9]);
    Some(end + 16)
}

// === Envoy straight to istiod-box ===

/// The command line an agent gave its Envoy (its first child), minus the config file and the
/// flags `Envoy::start_with_args` adds itself.
pub fn agent_envoy_args(agent: u32) -> Vec<String> {
    let children = std::fs::read_to_string(format!("/proc/{agent}/task/{agent}/children")).unwrap();
    let envoy = children
        .split_whitespace()
        .next()
        .expect("the agent runs Envoy");
    let cmdline = std::fs::read(format!("/proc/{envoy}/cmdline")).unwrap();
    let argv: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let mut out = vec![];
    let mut it = argv.into_iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "-c" | "--base-id-path" => {
                it.next();
            }
            "--disable-hot-restart" => {}
            _ => out.push(a),
        }
    }
    out
}

/// What an Envoy-direct start needs, taken from one running meshagent sidecar: its generated
/// bootstrap (node, listeners, static clusters) and its Envoy flags, re-pointed at istiod-box.
pub struct EnvoyDirect {
    pub bootstrap: Value,
    pub args: Vec<String>,
    _sds: StaticSds,
    _dir: tempfile::TempDir,
}

impl EnvoyDirect {
    /// From the sidecar in `cwd` (meshagent, `etc/istio/proxy/envoy-rev.json`) with agent
    /// `pid`, for service account `namespace`/`sa` of `istiod`.
    pub async fn capture(
        istiod: &IstiodBox,
        cwd: &Path,
        pid: u32,
        namespace: &str,
        sa: &str,
    ) -> EnvoyDirect {
        let rev = cwd.join("etc/istio/proxy/envoy-rev.json");
        let generated: Value = serde_json::from_slice(&std::fs::read(rev).unwrap()).unwrap();
        let args = agent_envoy_args(pid);
        let token = istiod.token(namespace, sa).await;
        let dir = tempfile::tempdir().unwrap();
        let (chain, key, root) =
            ca_client::workload_cert(istiod.grpc_tls, istiod.root_cert_path(), &token).await;
        let sds = StaticSds::start(dir.path(), &chain, &key, &root);
        let bootstrap = bypass_agent(
            &generated,
            istiod.grpc_tls,
            istiod.root_cert_path(),
            &token,
            &sds.socket,
        );
        EnvoyDirect {
            bootstrap,
            args,
            _sds: sds,
            _dir: dir,
        }
    }

    /// Starts Envoy with the direct bootstrap in `dir`.
    pub fn start(&self, dir: &Path) -> Envoy {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        Envoy::start_with_args(self.bootstrap.clone(), dir, &args)
    }

    /// Starts Envoy in a fresh directory and waits for `/ready` LIVE: the Envoy (kept running
    /// until dropped with its directory) and the time from spawn, ms.
    pub async fn start_ready(&self) -> (Envoy, tempfile::TempDir, f64) {
        let dir = tempfile::tempdir().unwrap();
        let e = self.start(dir.path());
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok((200, body)) = http_get(e.admin, "/ready").await
                && body.trim() == "LIVE"
            {
                break;
            }
            if Instant::now() > deadline {
                e.proc.print_log();
                panic!("Envoy direct to istiod-box not LIVE within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let ms = e.proc.started.elapsed().as_secs_f64() * 1e3;
        (e, dir, ms)
    }
}

/// The agent's bootstrap `generated` as Envoy would run without the agent: `xds-grpc` straight
/// to the control plane at `xds` over TLS (server name `istiod.istio-system.svc`, root `root`,
/// the token as gRPC metadata) and `sds-grpc` at a static SDS server on `sds` that already holds
/// the certificate. Envoy starting with this is the agent path minus the agent's work.
pub fn bypass_agent(
    generated: &Value,
    xds: SocketAddr,
    root: &Path,
    token: &str,
    sds: &Path,
) -> Value {
    let mut b = generated.clone();
    let direct = meshagent_testkit::direct_bootstrap("unused", json!({}), xds, root, token, true);
    b["dynamic_resources"]["ads_config"]["grpc_services"] =
        direct["dynamic_resources"]["ads_config"]["grpc_services"].clone();
    for c in b["static_resources"]["clusters"].as_array_mut().unwrap() {
        if c["name"] == "xds-grpc" {
            *c = direct["static_resources"]["clusters"][0].clone();
        } else if c["name"] == "sds-grpc" {
            c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] =
                json!({"pipe": {"path": sds.to_string_lossy()}});
        }
    }
    b
}

// === the CA's and the key's share ===

/// One CA round trip to istiod-box: TLS, key and CSR (ECDSA P-256), `CreateCertificate`; ms.
pub async fn ca_round_trip_ms(istiod: &IstiodBox, token: &str) -> f64 {
    let t = Instant::now();
    let _ = ca_client::workload_cert(istiod.grpc_tls, istiod.root_cert_path(), token).await;
    t.elapsed().as_secs_f64() * 1e3
}

/// One RSA-2048 key generation, as the agent generates its key (rcgen over aws-lc-rs); ms.
pub fn rsa_keygen_ms() -> f64 {
    let t = Instant::now();
    let _ = rcgen::KeyPair::generate_rsa_for(&rcgen::PKCS_RSA_SHA256, rcgen::RsaKeySize::_2048)
        .unwrap();
    t.elapsed().as_secs_f64() * 1e3
}
