//! Proxyless gRPC end to end (Istio's `grpc-agent` template): real grpcio (C-core's xDS
//! client and xDS server) configured only by the gRPC bootstrap the agent writes, config from
//! devplane's grpc generator through the agent's xDS proxy, certificates from the agent's
//! OUTPUT_CERTS files. The agents run in `DISABLE_ENVOY` mode with `binaryPath` pointing at a
//! real Envoy, which must never start.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use meshagent_testkit::{Devplane, Proc, Sidecar, free_port, wait_for, workspace_root};

const DEADLINE: Duration = Duration::from_secs(30);
const HOST_SUFFIX: &str = "default.svc.cluster.local";

fn echo_py() -> PathBuf {
    workspace_root().join("crates/meshagent/tests/grpc_support/echo.py")
}

/// The grpc-agent template's istio-proxy env (Istio `files/grpc-agent.yaml`), plus a short
/// certificate lifetime so rotations happen during the test.
fn grpc_agent_env(ttl: &str) -> Vec<(&'static str, String)> {
    vec![
        ("ISTIO_META_GENERATOR", "grpc".into()),
        ("OUTPUT_CERTS", "./var/lib/istio/data".into()),
        ("ISTIO_META_DNS_CAPTURE", "false".into()),
        ("DISABLE_ENVOY", "true".into()),
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA".into()),
        ("SECRET_TTL", ttl.into()),
    ]
}

async fn grpc_agent(dp: &Devplane, workload: &str, sa: &str, ttl: &str) -> Sidecar {
    let mut a = Sidecar::start(dp, workload, "default", sa, &grpc_agent_env(ttl)).await;
    a.wait_ready(DEADLINE).await;
    a
}

fn bootstrap_path(agent: &Sidecar) -> PathBuf {
    agent.cwd.path().join("etc/istio/proxy/grpc-bootstrap.json")
}

/// A grpcio process configured by `agent`'s bootstrap (as the app container is).
fn python(agent: &Sidecar, name: &str, args: &[String]) -> Proc {
    let mut cmd = Command::new("python3");
    cmd.arg(echo_py())
        .args(args)
        .env("PYTHONPATH", workspace_root().join(".tools/pip"))
        .env("GRPC_XDS_BOOTSTRAP", bootstrap_path(agent))
        .env("GRPC_XDS_EXPERIMENTAL_SECURITY_SUPPORT", "true")
        .env("GRPC_VERBOSITY", "ERROR")
        .env("PYTHONUNBUFFERED", "1");
    Proc::spawn(name, cmd, agent.cwd.path())
}

/// Lines of a client log from line `from` on.
fn lines_from(p: &Proc, from: usize) -> Vec<String> {
    p.log_text().lines().skip(from).map(str::to_owned).collect()
}

async fn wait_line(p: &Proc, from: usize, what: &str, pred: impl Fn(&str) -> bool) -> usize {
    wait_for(what, DEADLINE, || {
        let lines = lines_from(p, from);
        let hit = lines.iter().position(|l| pred(l)).map(|i| from + i + 1);
        async move { hit }
    })
    .await
}

fn line_count(p: &Proc) -> usize {
    p.log_text().lines().count()
}

/// Records every child process the agent ever has (it must have none: no Envoy).
fn watch_children(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<BTreeSet<String>> {
    std::thread::spawn(move || {
        let mut seen = BTreeSet::new();
        while !stop.load(Ordering::Relaxed) {
            for task in std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten()
                .flatten()
            {
                let children =
                    std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
                for c in children.split_whitespace() {
                    let comm =
                        std::fs::read_to_string(format!("/proc/{c}/comm")).unwrap_or_default();
                    seen.insert(format!("{c} {}", comm.trim()));
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        seen
    })
}

/// SPKI of the leaf certificate and of the private key, for a consistency check.
fn key_matches_leaf(key_pem: &[u8], chain_pem: &[u8]) -> Result<bool, String> {
    use rustls_pki_types::pem::PemObject;
    let leaf = rustls_pki_types::CertificateDer::pem_slice_iter(chain_pem)
        .next()
        .ok_or("no certificate")?
        .map_err(|e| e.to_string())?;
    let (_, cert) = x509_parser::parse_x509_certificate(&leaf).map_err(|e| e.to_string())?;
    let cert_point = cert
        .tbs_certificate
        .subject_pki
        .subject_public_key
        .data
        .to_vec();
    let key =
        rustls_pki_types::PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| e.to_string())?;
    let alg = &aws_lc_rs::signature::ECDSA_P256_SHA256_ASN1_SIGNING;
    let pair = match &key {
        rustls_pki_types::PrivateKeyDer::Pkcs8(k) => {
            aws_lc_rs::signature::EcdsaKeyPair::from_pkcs8(alg, k.secret_pkcs8_der())
        }
        other => aws_lc_rs::signature::EcdsaKeyPair::from_private_key_der(alg, other.secret_der()),
    }
    .map_err(|e| e.to_string())?;
    use aws_lc_rs::signature::KeyPair;
    Ok(pair.public_key().as_ref() == cert_point.as_slice())
}

/// Polls OUTPUT_CERTS the way a file-watching reader does (key, chain, key again) and counts
/// reads where both key reads agree but the chain belongs to another key.
fn poll_cert_files(
    dir: PathBuf,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, Vec<String>)> {
    std::thread::spawn(move || {
        let (mut checked, mut bad) = (0u64, Vec::new());
        while !stop.load(Ordering::Relaxed) {
            let read = |n: &str| std::fs::read(dir.join(n)).unwrap_or_default();
            let (k1, chain, k2) = (read("key.pem"), read("cert-chain.pem"), read("key.pem"));
            if k1 == k2 && !k1.is_empty() && !chain.is_empty() {
                checked += 1;
                match key_matches_leaf(&k1, &chain) {
                    Ok(true) => {}
                    Ok(false) => bad.push("key does not match the leaf certificate".into()),
                    Err(e) => bad.push(e),
                }
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        (checked, bad)
    })
}

async fn sigterm_exits_zero(agent: &mut Sidecar) {
    let pid = nix::unistd::Pid::from_raw(agent.proc.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = wait_for("the agent to exit after SIGTERM", DEADLINE, || {
        let s = agent.proc.try_wait();
        async move { s }
    })
    .await;
    assert_eq!(
        status.code(),
        Some(0),
        "exit status after SIGTERM: {status}"
    );
}

fn mesh(echo_port: u16, mtls: bool) -> String {
    format!(
        "grpcMtls: {mtls}
workloads:
  - {{name: echo, serviceAccount: echo, address: 127.0.0.1, ports: [{{port: {echo_port}, inboundPort: {echo_port}}}]}}
  - {{name: client, serviceAccount: client, address: 127.0.0.1}}
services:
  - {{name: echo, selector: [echo], ports: [{{port: 7070, targetPort: {echo_port}}}]}}
"
    )
}

/// A grpcio client and a grpcio xDS server, each with its own agent: plaintext, then mTLS
/// once the mesh turns it on (the server sees the client's SPIFFE identity), then rotations
/// of both agents' certificates under the same long-lived channel. OUTPUT_CERTS is polled
/// all along and never shows a key with another key's chain. No Envoy ever starts, and
/// SIGTERM ends each agent with 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcio_plaintext_then_mtls_then_rotation_without_envoy() {
    let echo_port = free_port();
    let dp = Devplane::start(&mesh(echo_port, false)).await;
    let mut server_agent = grpc_agent(&dp, "echo", "echo", "10s").await;
    let mut client_agent = grpc_agent(&dp, "client", "client", "10s").await;
    let stop = Arc::new(AtomicBool::new(false));
    let children = [
        watch_children(server_agent.proc.pid(), stop.clone()),
        watch_children(client_agent.proc.pid(), stop.clone()),
    ];
    let certs = server_agent.cwd.path().join("var/lib/istio/data");
    let poller = poll_cert_files(certs.clone(), stop.clone());

    // The bootstrap as Istio writes it, certificate provider included.
    let b: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bootstrap_path(&client_agent)).unwrap()).unwrap();
    assert_eq!(b["node"]["metadata"]["GENERATOR"], "grpc");
    assert_eq!(
        b["xds_servers"][0]["server_uri"],
        format!(
            "unix://{}",
            client_agent
                .cwd
                .path()
                .join("etc/istio/proxy/XDS")
                .display()
        )
    );
    assert_eq!(
        b["certificate_providers"]["default"]["plugin_name"],
        "file_watcher"
    );

    let server = python(
        &server_agent,
        "grpc-server",
        &["xds-server".into(), "echo".into(), echo_port.to_string()],
    );
    wait_line(&server, 0, "the xDS gRPC server", |l| l == "SERVING").await;
    let target = format!("echo.{HOST_SUFFIX}:7070");
    let client = python(
        &client_agent,
        "grpc-client",
        &["client".into(), target.clone()],
    );
    let plain = wait_line(&client, 0, "a plaintext call through xDS config", |l| {
        l.contains(" OK echo peer=none")
    })
    .await;

    dp.write_mesh(&mesh(echo_port, true));
    let client_id = "spiffe://cluster.local/ns/default/sa/client";
    let mtls = wait_line(
        &client,
        plain,
        "an mTLS call carrying the client's identity",
        |l| l.contains(&format!(" OK echo peer={client_id}")),
    )
    .await;

    // Rotation: both agents replace their files (10 s certificates rotate at about half
    // life) while the channel stays up; calls keep succeeding afterwards.
    let read_certs = |dir: &Path| std::fs::read(dir.join("cert-chain.pem")).unwrap();
    let client_certs = client_agent.cwd.path().join("var/lib/istio/data");
    let (s0, c0) = (read_certs(&certs), read_certs(&client_certs));
    wait_for("both agents to rotate their certificates", DEADLINE, || {
        let done = read_certs(&certs) != s0 && read_certs(&client_certs) != c0;
        async move { done.then_some(()) }
    })
    .await;
    let after = line_count(&client);
    wait_line(&client, after, "an mTLS call after the rotation", |l| {
        l.contains(&format!(" OK echo peer={client_id}"))
    })
    .await;
    let errors: Vec<String> = lines_from(&client, mtls)
        .into_iter()
        .filter(|l| l.contains(" ERR "))
        .collect();
    assert!(
        errors.is_empty(),
        "calls failed on the long-lived mTLS channel: {errors:?}"
    );

    // grpcio accepted every resource (a NACK names what it rejected).
    let nacks: Vec<serde_json::Value> = dp
        .clients()
        .await
        .into_iter()
        .filter(|c| c["nacks"].as_object().is_some_and(|n| !n.is_empty()))
        .map(|c| c["nacks"].clone())
        .collect();
    assert!(nacks.is_empty(), "grpcio NACKed: {nacks:?}");

    stop.store(true, Ordering::Relaxed);
    let (checked, bad) = poller.join().unwrap();
    assert!(checked > 0, "the cert poller never read a set");
    assert!(
        bad.is_empty(),
        "OUTPUT_CERTS readers saw mixed sets: {bad:?}"
    );
    for c in children {
        let seen = c.join().unwrap();
        assert!(
            seen.is_empty(),
            "the agent started processes (Envoy?): {seen:?}"
        );
    }
    assert!(
        !server_agent
            .proc
            .log_text()
            .contains("SDS server listening"),
        "an SDS server was started"
    );
    drop(client);
    drop(server);
    sigterm_exits_zero(&mut client_agent).await;
    sigterm_exits_zero(&mut server_agent).await;
}

/// Two xDS clients for different targets in one grpcio process (C-core keeps one xDS client
/// per channel target, like grpc-go ≥ 1.66) and a second process on the same socket: every
/// stream gets its config; killing the second process leaves the first one's streams alone.
/// Istio's agent would close all but the newest stream ("registered overlapping stream").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_xds_clients_in_one_pod() {
    let (pa, pb) = (free_port(), free_port());
    let yaml = format!(
        "workloads:
  - {{name: a, serviceAccount: a, ports: [{{port: {pa}, inboundPort: {pa}}}]}}
  - {{name: b, serviceAccount: b, ports: [{{port: {pb}, inboundPort: {pb}}}]}}
  - {{name: client, serviceAccount: client}}
services:
  - {{name: a, selector: [a], ports: [{{port: 7070, targetPort: {pa}}}]}}
  - {{name: b, selector: [b], ports: [{{port: 7070, targetPort: {pb}}}]}}
"
    );
    let dp = Devplane::start(&yaml).await;
    let agent = grpc_agent(&dp, "client", "client", "1h").await;
    let servers = python(
        &agent,
        "grpc-servers",
        &["plain-server".into(), format!("a:{pa}"), format!("b:{pb}")],
    );
    wait_line(&servers, 0, "the gRPC servers", |l| l == "SERVING").await;
    let (ta, tb) = (
        format!("a.{HOST_SUFFIX}:7070"),
        format!("b.{HOST_SUFFIX}:7070"),
    );
    let first = python(
        &agent,
        "grpc-client-1",
        &["client".into(), ta.clone(), tb.clone()],
    );
    let mut second = python(&agent, "grpc-client-2", &["client".into(), ta.clone()]);
    let mut settled = 0;
    for (p, t, name) in [(&first, &ta, "a"), (&first, &tb, "b"), (&second, &ta, "a")] {
        let at = wait_line(p, 0, &format!("{t} served through the agent"), |l| {
            l.starts_with(&format!("{t} OK {name} "))
        })
        .await;
        if std::ptr::eq(p, &first) {
            settled = settled.max(at);
        }
    }
    // Three live streams from this pod at devplane, one per xDS client.
    let node_streams = || async {
        dp.clients()
            .await
            .iter()
            .filter(|c| c["connected"] == true)
            .filter(|c| {
                c["node_id"]
                    .as_str()
                    .is_some_and(|id| id.contains("~client-"))
            })
            .count()
    };
    assert_eq!(node_streams().await, 3, "clients: {:?}", dp.clients().await);

    second.kill();
    wait_for(
        "devplane to see the second process's stream end",
        DEADLINE,
        || async { (node_streams().await == 2).then_some(()) },
    )
    .await;
    let from = line_count(&first);
    for (t, name) in [(&ta, "a"), (&tb, "b")] {
        wait_line(
            &first,
            from,
            &format!("{t} still served after the other client left"),
            |l| l.starts_with(&format!("{t} OK {name} ")),
        )
        .await;
    }
    // Once both targets were served, no call of the first process failed (the other
    // process's stream ending included).
    let errors: Vec<String> = lines_from(&first, settled)
        .into_iter()
        .filter(|l| l.contains(" ERR "))
        .collect();
    assert!(
        errors.is_empty(),
        "the first process's calls failed: {errors:?}"
    );
    assert!(
        !agent.proc.log_text().contains("stopped by the agent"),
        "the agent closed a stream"
    );
}
