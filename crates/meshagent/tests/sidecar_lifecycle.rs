//! `meshagent proxy` as a pod runs it (separate process, Istio's env vars, temp cwd): Envoy
//! started with a generated bootstrap that Envoy itself validates, readiness reasons, `wait`,
//! SIGTERM drain, Envoy crash propagation, `/quitquitquit`.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use meshagent::config::{self, MapEnv, ProxyFlags, ProxyType};
use meshagent_testkit::{
    DEADLINE, Proc, children_of, envoy_bin, free_port, http, http_get, signal, wait_for,
};

struct AgentUnderTest {
    proc: Proc,
    cwd: tempfile::TempDir,
    status: SocketAddr,
}

fn agent_env(status: u16, admin: u16, extra: &[(&str, String)]) -> Vec<(String, String)> {
    let pc = serde_json::json!({
        "binaryPath": envoy_bin(),
        "proxyAdminPort": admin,
        "statusPort": status,
        // Nothing listens here: Envoy never gets config in these tests.
        "discoveryAddress": format!("127.0.0.1:{}", free_port()),
        "terminationDrainDuration": "2s",
        "drainDuration": "2s",
    });
    let mut env: Vec<(String, String)> = vec![
        ("POD_NAME".into(), "app-7d9f".into()),
        ("POD_NAMESPACE".into(), "default".into()),
        ("SERVICE_ACCOUNT".into(), "app".into()),
        ("INSTANCE_IP".into(), "127.0.0.1".into()),
        ("ISTIO_META_CLUSTER_ID".into(), "Kubernetes".into()),
        ("ENVOY_STATUS_PORT".into(), free_port().to_string()),
        ("ENVOY_PROMETHEUS_PORT".into(), free_port().to_string()),
        ("PROXY_CONFIG".into(), pc.to_string()),
    ];
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
    env
}

fn start_agent(proxy_type: &str, extra: &[(&str, String)]) -> AgentUnderTest {
    start_agent_in_via(tempfile::tempdir().unwrap(), &[], proxy_type, extra)
}

fn start_agent_in(
    cwd: tempfile::TempDir,
    proxy_type: &str,
    extra: &[(&str, String)],
) -> AgentUnderTest {
    start_agent_in_via(cwd, &[], proxy_type, extra)
}

/// [`start_agent`] through a wrapper command that execs the agent (e.g. `prlimit … --`).
fn start_agent_via(wrapper: &[&str], proxy_type: &str, extra: &[(&str, String)]) -> AgentUnderTest {
    start_agent_in_via(tempfile::tempdir().unwrap(), wrapper, proxy_type, extra)
}

fn start_agent_in_via(
    cwd: tempfile::TempDir,
    wrapper: &[&str],
    proxy_type: &str,
    extra: &[(&str, String)],
) -> AgentUnderTest {
    let status = free_port();
    let agent = env!("CARGO_BIN_EXE_meshagent");
    let mut cmd = match wrapper.split_first() {
        None => Command::new(agent),
        Some((prog, args)) => {
            let mut c = Command::new(prog);
            c.args(args).arg(agent);
            c
        }
    };
    cmd.args([
        "proxy",
        proxy_type,
        "--proxyLogLevel=warning",
        "--proxyComponentLogLevel=misc:error",
    ])
    .current_dir(cwd.path())
    .env_clear()
    .env("CLOUD_PLATFORM", "none")
    .envs(agent_env(status, free_port(), extra));
    let proc = Proc::spawn("agent", cmd, cwd.path());
    AgentUnderTest {
        proc,
        cwd,
        status: SocketAddr::from(([127, 0, 0, 1], status)),
    }
}

async fn wait_exit(p: &mut Proc, within: Duration) -> std::process::ExitStatus {
    wait_for("the agent to exit", within, || {
        let s = p.try_wait();
        async move { s }
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn not_ready_without_config_then_sigterm_drains_and_exits() {
    let mut a = start_agent("sidecar", &[]);
    let status = a.status;
    // Nothing answers at the discovery address, which is also the CA: readiness reports the
    // root cause (no certificate from the CA, naming it) before its consequence (Envoy has no
    // config).
    let reason = wait_for(
        "readiness 503 with the CA failure",
        DEADLINE,
        || async move {
            match http_get(status, "/healthz/ready").await {
                Ok((503, body)) if body.contains("no workload certificate yet:") => Some(body),
                _ => None,
            }
        },
    )
    .await;
    assert!(
        reason.contains("127.0.0.1:"),
        "the CA address is named: {reason}"
    );
    assert!(!reason.contains("config not received"), "{reason}");

    // `wait` fails on timeout while the proxy is not ready.
    let out = Command::new(env!("CARGO_BIN_EXE_meshagent"))
        .args([
            "wait",
            &format!("--url=http://{status}/healthz/ready"),
            "--timeoutSeconds=1",
            "--periodMillis=100",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("timeout waiting for Envoy proxy to become ready")
    );

    // The generated bootstrap is accepted by Envoy itself.
    let bootstrap = a.cwd.path().join("etc/istio/proxy/envoy-rev.json");
    assert!(bootstrap.exists());
    let v = Command::new(envoy_bin())
        .args([
            "--mode",
            "validate",
            "--disable-hot-restart",
            "-l",
            "error",
            "-c",
        ])
        .arg(&bootstrap)
        .current_dir(a.cwd.path())
        .output()
        .unwrap();
    assert!(
        v.status.success(),
        "envoy --mode validate: {}",
        String::from_utf8_lossy(&v.stderr)
    );
    let b: serde_json::Value = serde_json::from_slice(&std::fs::read(&bootstrap).unwrap()).unwrap();
    assert_eq!(
        b["node"]["id"],
        "sidecar~127.0.0.1~app-7d9f.default~default.svc.cluster.local"
    );
    assert_eq!(b["node"]["metadata"]["CLUSTER_ID"], "Kubernetes");
    assert_eq!(
        b["dynamic_resources"]["ads_config"]["api_type"],
        "DELTA_GRPC"
    );

    // SIGTERM: drain, wait terminationDrainDuration (2s), stop Envoy, remove bootstrap, and
    // exit 1 because the proxy was never ready (scenario F17: Istio exits 0, so a pod with
    // `restartPolicy: OnFailure` is never retried).
    let envoy_pids = children_of(a.proc.pid());
    assert_eq!(envoy_pids.len(), 1, "one Envoy child");
    let t0 = tokio::time::Instant::now();
    signal(a.proc.pid(), "-TERM");
    let st = wait_exit(&mut a.proc, Duration::from_secs(10)).await;
    let took = t0.elapsed();
    assert_eq!(st.code(), Some(1), "{st:?}\n{}", a.proc.log_text());
    assert!(
        a.proc
            .log_text()
            .contains("terminated before the proxy was ever ready")
    );
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(7),
        "{took:?}"
    );
    assert!(!bootstrap.exists(), "bootstrap removed after Envoy exits");
    assert!(
        !Path::new(&format!("/proc/{}", envoy_pids[0])).exists(),
        "Envoy stopped"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn envoy_killed_agent_exits_nonzero() {
    let mut a = start_agent("sidecar", &[]);
    let pid = a.proc.pid();
    let envoy = wait_for("Envoy child", DEADLINE, || async move {
        children_of(pid).first().copied()
    })
    .await;
    signal(envoy, "-KILL");
    let st = wait_exit(&mut a.proc, Duration::from_secs(10)).await;
    assert_eq!(st.code(), Some(137), "128 + SIGKILL");
    assert!(
        a.proc.log_text().contains("out of memory"),
        "OOM hint logged"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn quitquitquit_from_loopback_stops_everything() {
    let mut a = start_agent("router", &[]);
    let status = a.status;
    wait_for("status server", DEADLINE, || async move {
        http_get(status, "/healthz/ready").await.ok()
    })
    .await;
    let pid = a.proc.pid();
    let envoy = wait_for("Envoy child", DEADLINE, || async move {
        children_of(pid).first().copied()
    })
    .await;
    assert_eq!(http("GET", status, "/quitquitquit").await.unwrap().0, 405);
    let (code, body) = http("POST", status, "/quitquitquit").await.unwrap();
    assert_eq!((code, body.as_str()), (200, "OK"));
    let st = wait_exit(&mut a.proc, Duration::from_secs(5)).await;
    assert!(st.success(), "{st:?}");
    assert!(!Path::new(&format!("/proc/{envoy}")).exists());
}

/// Under a working directory so long that the absolute socket paths exceed a socket
/// address (108 bytes), the SDS and XDS sockets still bind (relative to the working directory,
/// as Istio binds them) and Envoy starts on them.
#[tokio::test(flavor = "multi_thread")]
async fn sidecar_starts_under_a_long_working_directory() {
    let base = tempfile::tempdir().unwrap();
    let long = base.path().join("a".repeat(60)).join("b".repeat(60));
    std::fs::create_dir_all(&long).unwrap();
    let sds = long.join("var/run/secrets/workload-spiffe-uds/socket");
    assert!(sds.as_os_str().len() > 108, "{}", sds.display());
    // A TempDir handle that removes `base` with the agent's directory.
    let cwd = tempfile::Builder::new().tempdir_in(&long).unwrap();
    let mut a = start_agent_in(cwd, "sidecar", &[]);
    let status = a.status;
    // Readiness answers (not ready: no CA here) and Envoy was started: nothing got stuck
    // binding the sockets.
    wait_for("the agent's readiness answer", DEADLINE, || async move {
        match http_get(status, "/healthz/ready").await {
            Ok((503, body)) if body.contains("no workload certificate yet") => Some(()),
            _ => None,
        }
    })
    .await;
    let pid = a.proc.pid();
    wait_for("Envoy started behind the agent", DEADLINE, || async move {
        (children_of(pid).len() == 1).then_some(())
    })
    .await;
    assert!(
        a.cwd
            .path()
            .join("var/run/secrets/workload-spiffe-uds/socket")
            .exists()
    );
    assert!(a.cwd.path().join("etc/istio/proxy/XDS").exists());
    signal(a.proc.pid(), "-TERM");
    let st = wait_exit(&mut a.proc, Duration::from_secs(10)).await;
    // A clean shutdown, reported as 1 because the proxy was never ready (scenario F17).
    assert_eq!(st.code(), Some(1), "{st:?}\n{}", a.proc.log_text());
}

/// `ISTIO_BOOTSTRAP` names a custom template: the agent renders it (here the project's own
/// template of the default bootstrap) and Envoy runs on the result.
#[tokio::test(flavor = "multi_thread")]
async fn sidecar_runs_on_a_custom_template() {
    let tmpl = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/default_bootstrap.json.tmpl");
    let mut a = start_agent(
        "sidecar",
        &[("ISTIO_BOOTSTRAP", tmpl.display().to_string())],
    );
    let status = a.status;
    wait_for(
        "Envoy up on the template's bootstrap",
        DEADLINE,
        || async move {
            match http_get(status, "/healthz/ready").await {
                // Not ready (no CA here), with Envoy running: the template rendered and loaded.
                Ok((503, body)) if body.contains("no workload certificate yet") => Some(()),
                _ => None,
            }
        },
    )
    .await;
    let pid = a.proc.pid();
    assert_eq!(
        children_of(pid).len(),
        1,
        "Envoy runs on the rendered template"
    );
    let b: serde_json::Value = serde_json::from_slice(
        &std::fs::read(a.cwd.path().join("etc/istio/proxy/envoy-rev.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        b["node"]["id"],
        "sidecar~127.0.0.1~app-7d9f.default~default.svc.cluster.local"
    );
    signal(a.proc.pid(), "-TERM");
    let st = wait_exit(&mut a.proc, Duration::from_secs(10)).await;
    // A clean shutdown, reported as 1 because the proxy was never ready (scenario F17).
    assert_eq!(st.code(), Some(1), "{st:?}\n{}", a.proc.log_text());
}

/// A custom template calling a function meshagent does not provide stops the agent at startup
/// with the template, the line and the function named.
#[test]
fn custom_template_with_unknown_function_is_a_startup_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("t.json"),
        "{\n  \"node\": {\"id\": \"{{ sha1sum .nodeID }}\"}\n}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_meshagent"))
        .args(["proxy", "sidecar"])
        .current_dir(dir.path())
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .envs([("ISTIO_BOOTSTRAP", "t.json"), ("POD_NAMESPACE", "ns")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("t.json:2") && err.contains("sha1sum"), "{err}");
}

/// Every generated bootstrap variant passes `envoy --mode validate`.
#[test]
fn generated_bootstraps_validate() {
    let cases: Vec<(ProxyType, Vec<(&str, &str)>)> = vec![
        (ProxyType::Sidecar, vec![]),
        (ProxyType::Router, vec![("ISTIO_DELTA_XDS", "false")]),
        (
            ProxyType::Sidecar,
            vec![
                ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true"),
                ("ISTIO_META_DNS_CAPTURE", "true"),
                (
                    "ISTIO_METAJSON_LABELS",
                    r#"{"app":"web","topology.istio.io/locality":"us-east1.b"}"#,
                ),
                (
                    "ISTIO_META_POD_PORTS",
                    r#"[{"containerPort":8080,"protocol":"TCP"}]"#,
                ),
                ("HOST_IP", "10.0.0.9"),
                (
                    "PROXY_CONFIG",
                    r#"{"tracing":{"zipkin":{"address":"$(HOST_IP):9411"}},"statsdUdpAddress":"127.0.0.1:8125","extraStatTags":["my_tag"],"proxyStatsMatcher":{"inclusionPrefixes":["upstream_rq"],"inclusionRegexps":[".*circuit_breakers.*"]},"runtimeValues":{"foo.bar":"true"},"concurrency":2}"#,
                ),
            ],
        ),
    ];
    for (ty, env) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut e = vec![
            ("POD_NAME", "p"),
            ("POD_NAMESPACE", "ns"),
            ("INSTANCE_IP", "10.1.1.1"),
        ];
        e.extend(env.iter().copied());
        let flags = ProxyFlags {
            proxy_type: ty,
            ..ProxyFlags::default()
        };
        let cfg = config::load(&flags, &MapEnv::from_pairs(e), dir.path()).unwrap();
        let node = meshagent::bootstrap::Node::from_config(&cfg).unwrap();
        let b = meshagent::bootstrap::generate(&cfg, &node, None).unwrap();
        let path = meshagent::bootstrap::write(&cfg, dir.path(), &b).unwrap();
        let out = Command::new(envoy_bin())
            .args([
                "--mode",
                "validate",
                "--disable-hot-restart",
                "-l",
                "error",
                "-c",
            ])
            .arg(dir.path().join(&path))
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{ty:?} {env:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            b.contents
        );
    }
}

#[test]
fn malformed_pod_ports_is_a_startup_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_meshagent"))
        .args(["proxy", "sidecar"])
        .current_dir(dir.path())
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .envs([
            ("ISTIO_META_POD_PORTS", "8080,9090"),
            ("POD_NAMESPACE", "ns"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("POD_PORTS") && err.contains("8080,9090"),
        "{err}"
    );
}

/// A SIGKILLed agent (no chance to stop Envoy itself) must not leave Envoy running: the
/// kernel's parent-death signal ends it.
#[tokio::test(flavor = "multi_thread")]
async fn sigkilled_agent_takes_envoy_with_it() {
    let mut a = start_agent("sidecar", &[]);
    let pid = a.proc.pid();
    let envoy = wait_for("Envoy child", DEADLINE, || async move {
        children_of(pid).first().copied()
    })
    .await;
    signal(pid, "-KILL");
    let _ = wait_exit(&mut a.proc, Duration::from_secs(10)).await;
    // Gone, or a zombie waiting for its new parent to reap it: either way not running.
    wait_for(
        "Envoy to die with the agent",
        Duration::from_secs(10),
        || async move {
            match std::fs::read_to_string(format!("/proc/{envoy}/stat")) {
                Err(_) => Some(()),
                Ok(s) => s
                    .rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X'))
                    .then_some(()),
            }
        },
    )
    .await;
}

/// The first SIGTERM drains (here for up to 60 s); a second one skips the rest of the drain.
#[tokio::test(flavor = "multi_thread")]
async fn second_sigterm_skips_the_drain() {
    let pc = serde_json::json!({
        "binaryPath": envoy_bin(),
        "proxyAdminPort": free_port(),
        "statusPort": free_port(),
        "discoveryAddress": format!("127.0.0.1:{}", free_port()),
        "terminationDrainDuration": "60s",
        "drainDuration": "2s",
    });
    let mut a = start_agent("sidecar", &[("PROXY_CONFIG", pc.to_string())]);
    let pid = a.proc.pid();
    wait_for("Envoy child", DEADLINE, || async move {
        children_of(pid).first().copied()
    })
    .await;
    signal(pid, "-TERM");
    wait_for("the drain to start", DEADLINE, || {
        let log = a.proc.log_text();
        async move {
            log.contains("waiting for terminationDrainDuration")
                .then_some(())
        }
    })
    .await;
    assert!(a.proc.try_wait().is_none(), "exited before the drain ended");
    signal(pid, "-TERM");
    let st = wait_exit(&mut a.proc, Duration::from_secs(20)).await;
    // Never ready (nothing at the discovery address): 1, see scenario F17.
    assert_eq!(st.code(), Some(1), "{st:?}\n{}", a.proc.log_text());
    assert!(
        a.proc.log_text().contains("second termination signal"),
        "{}",
        a.proc.log_text()
    );
}

/// SIGHUP, SIGUSR1 and SIGUSR2 neither kill the agent nor orphan Envoy (Go ignores them).
#[tokio::test(flavor = "multi_thread")]
async fn hup_and_usr_signals_are_ignored() {
    let mut a = start_agent("sidecar", &[]);
    let pid = a.proc.pid();
    let status = a.status;
    wait_for("the status port", DEADLINE, || async move {
        http_get(status, "/healthz/ready").await.ok()
    })
    .await;
    for sig in ["-HUP", "-USR1", "-USR2"] {
        signal(pid, sig);
    }
    // Still serving after the signals were delivered.
    for _ in 0..5 {
        assert!(http_get(status, "/healthz/ready").await.is_ok());
        assert!(a.proc.try_wait().is_none(), "{}", a.proc.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(children_of(pid).len(), 1, "Envoy still running");
}

/// A supervised server whose socket disappears is down: the next readiness check (here the
/// test's, in a pod kubelet's) finds it, the agent logs it naming the server, binds the
/// socket again, and clients can connect to it. (Without readiness checks the files are
/// looked at once a minute: the supervisor's unit tests check that, and that the failing
/// readiness answer names the server.)
#[tokio::test(flavor = "multi_thread")]
async fn removed_sds_and_xds_sockets_are_rebound() {
    let a = start_agent("sidecar", &[]);
    for (name, rel) in [
        ("xds-proxy", "etc/istio/proxy/XDS"),
        ("sds", "var/run/secrets/workload-spiffe-uds/socket"),
    ] {
        let sock = a.cwd.path().join(rel);
        wait_for("the socket", DEADLINE, || {
            let ok = sock.exists();
            async move { ok.then_some(()) }
        })
        .await;
        std::fs::remove_file(&sock).unwrap();
        let want = format!("server={name} error=socket");
        let status = a.status;
        wait_for("the supervisor to notice", DEADLINE, || {
            let log = a.proc.log_text();
            let hit = log
                .lines()
                .any(|l| l.contains(&want) && l.contains("was removed"));
            async move {
                // The probe that makes the agent look.
                let _ = http_get(status, "/healthz/ready").await;
                hit.then_some(())
            }
        })
        .await;
        wait_for("the socket bound again and accepting", DEADLINE, || {
            let sock = sock.clone();
            async move { tokio::net::UnixStream::connect(&sock).await.ok() }
        })
        .await;
    }
}

/// The status port answers on both loopback families, and a flood of idle
/// connections neither exhausts the agent's file descriptors (its soft limit is raised to the
/// hard one, as Go does) nor keeps the port unusable (idle connections time out).
#[tokio::test(flavor = "multi_thread")]
async fn status_port_is_dual_stack_and_survives_an_idle_connection_flood() {
    let hard = std::fs::read_to_string("/proc/self/limits")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4).map(str::to_owned))
        .unwrap();
    let nofile = format!("--nofile=1024:{hard}");
    let a = start_agent_via(&["prlimit", &nofile, "--"], "sidecar", &[]);
    let status = a.status;
    let v6 = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, status.port()));
    for addr in [status, v6] {
        wait_for("a readiness answer", DEADLINE, || async move {
            http_get(addr, "/healthz/ready").await.ok()
        })
        .await;
    }
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", a.proc.pid())).unwrap();
    let soft = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3).map(str::to_owned))
        .unwrap();
    assert_eq!(soft, hard, "soft open-files limit raised\n{limits}");

    // 1,100 idle connections (more than the inherited soft limit and the connection cap).
    let mut idle = Vec::new();
    for _ in 0..1100 {
        idle.push(tokio::net::TcpStream::connect(status).await.unwrap());
    }
    // SDS still accepts and serves: the server's HTTP/2 SETTINGS arrive after our preface.
    let sds = a
        .cwd
        .path()
        .join("var/run/secrets/workload-spiffe-uds/socket");
    let mut c = tokio::net::UnixStream::connect(&sds).await.unwrap();
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut frame = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut frame))
        .await
        .expect("SDS answered during the flood")
        .unwrap();
    assert_eq!(frame[3], 0x04, "a SETTINGS frame");
    // Readiness answers while they are held: the connection table, sized from the raised
    // limit, has room, and a full one closes its oldest idle connection for a new one
    // (`status_flood` holds floods beyond the table from another network namespace).
    let t = tokio::time::Instant::now();
    let (code, _) = http_get(status, "/healthz/ready").await.unwrap();
    assert!(code == 200 || code == 503, "{code}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    drop(idle);
}

/// An external SDS server (e.g. SPIRE's) owns the workload socket: the agent takes no
/// certificate from the CA, serves only file certificates on its own socket, marks the node
/// `file-credential: "true"` (so istiod sends `file-*` names to cluster `sds-files-grpc`) and
/// Envoy's bootstrap has that cluster; Envoy's workload certificate comes from the external
/// server.
#[tokio::test(flavor = "multi_thread")]
async fn external_sds_server_gets_sds_files_grpc_and_file_credential() {
    use meshagent_testkit::{
        Devplane, Sidecar, ca_client, static_sds::StaticSds, two_workload_mesh,
    };
    let (mesh, ..) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    let token = dp.token("default", "a", 3600).await;
    let cwd = tempfile::tempdir().unwrap();
    let uds = cwd.path().join("var/run/secrets/workload-spiffe-uds");
    std::fs::create_dir_all(&uds).unwrap();
    let (chain, key, root) =
        ca_client::workload_cert(dp.grpc_addr, &dp.root_cert_path(), &token).await;
    let _external = StaticSds::start(&uds, &chain, &key, &root);
    let mut s = Sidecar::start_in(
        cwd,
        &dp,
        "a",
        "default",
        "a",
        &[("WORKLOAD_IDENTITY_SOCKET_FILE", "sds.sock".to_owned())],
        serde_json::json!({}),
        &token,
    )
    .await;
    s.wait_ready(DEADLINE).await;

    let text = std::fs::read_to_string(s.cwd.path().join("etc/istio/proxy/envoy-rev.json"))
        .unwrap_or_else(|e| panic!("bootstrap: {e}\n{}", s.proc.log_text()));
    let boot: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(boot["node"]["metadata"]["file-credential"], "true");
    let clusters = boot["static_resources"]["clusters"].as_array().unwrap();
    let pipe = |name: &str| {
        clusters
            .iter()
            .find(|c| c["name"] == name)
            .map(|c| {
                c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                    ["pipe"]["path"]
                    .clone()
            })
            .unwrap_or_else(|| panic!("no cluster {name} in the bootstrap"))
    };
    assert_eq!(
        pipe("sds-grpc"),
        "./var/run/secrets/workload-spiffe-uds/sds.sock"
    );
    assert_eq!(
        pipe("sds-files-grpc"),
        "./var/run/secrets/credential-uds/files-socket"
    );
    assert!(
        s.cwd
            .path()
            .join("var/run/secrets/credential-uds/files-socket")
            .exists(),
        "the agent serves file certificates on its own socket"
    );
    // Envoy runs with both clusters and its certificate is the external server's.
    let (_, clusters) = http_get(s.admin, "/clusters").await.unwrap();
    assert!(clusters.contains("sds-files-grpc::"), "{clusters}");
    let (_, certs) = http_get(s.admin, "/certs").await.unwrap();
    assert!(
        certs.contains("spiffe://cluster.local/ns/default/sa/a"),
        "{certs}"
    );
    assert!(
        !s.proc.log_text().contains("certificate issued"),
        "no CSR with an external SDS server:\n{}",
        s.proc.log_text()
    );
}

/// A sidecar whose Envoy admin address the test knows.
fn start_with_admin() -> (AgentUnderTest, SocketAddr) {
    let admin = free_port();
    let pc = serde_json::json!({
        "binaryPath": envoy_bin(),
        "proxyAdminPort": admin,
        "statusPort": free_port(),
        "discoveryAddress": format!("127.0.0.1:{}", free_port()),
        "terminationDrainDuration": "2s",
        "drainDuration": "2s",
    });
    let a = start_agent("sidecar", &[("PROXY_CONFIG", pc.to_string())]);
    (a, SocketAddr::from(([127, 0, 0, 1], admin)))
}

/// Q5: with Envoy hung (SIGSTOP), the drain call's own 5 s timeout came on top of
/// `terminationDrainDuration`, and the agent exited after TDD + 10 s. Now the drain has one
/// deadline: the agent is gone within TDD + the SIGTERM→SIGKILL grace (5 s), and says that
/// the listeners could not be drained.
#[tokio::test(flavor = "multi_thread")]
async fn q5_hung_envoy_shutdown_stays_within_drain_plus_kill_grace() {
    let (mut a, admin) = start_with_admin();
    let pid = a.proc.pid();
    let envoy = wait_for("Envoy child", DEADLINE, || async move {
        children_of(pid).first().copied()
    })
    .await;
    // Hung while serving its admin port: connections are accepted, nothing is answered.
    wait_for("Envoy's admin", DEADLINE, || async move {
        http_get(admin, "/server_info").await.ok()
    })
    .await;
    signal(envoy, "-STOP");
    let t = tokio::time::Instant::now();
    signal(pid, "-TERM");
    wait_exit(&mut a.proc, Duration::from_secs(30)).await;
    let took = t.elapsed();
    // terminationDrainDuration is 2 s here, the kill grace 5 s; the old code took 12 s.
    let bound = Duration::from_secs(2 + 5) + Duration::from_millis(2500);
    assert!(
        took <= bound,
        "shutdown took {took:?}\n{}",
        a.proc.log_text()
    );
    let log = a.proc.log_text();
    assert!(
        log.contains("were not drained before terminationDrainDuration ended")
            && log.contains("killing it"),
        "{log}"
    );
}

/// Q8: Envoy exiting 0 by itself (its own /quitquitquit) was logged at ERROR. As Istio
/// (`pkg/envoy/agent.go`): "Envoy exited normally" at INFO, and the agent exits 0.
#[tokio::test(flavor = "multi_thread")]
async fn q8_envoy_exiting_zero_is_not_an_error() {
    let (mut a, admin) = start_with_admin();
    wait_for("Envoy's admin", DEADLINE, || async move {
        http_get(admin, "/server_info").await.ok()
    })
    .await;
    assert_eq!(http("POST", admin, "/quitquitquit").await.unwrap().0, 200);
    let st = wait_exit(&mut a.proc, Duration::from_secs(10)).await;
    let log = a.proc.log_text();
    assert_eq!(st.code(), Some(0), "{log}");
    assert!(log.contains("Envoy exited normally"), "{log}");
    assert!(
        !log.lines()
            .any(|l| l.contains("\terror\t") && l.contains("Envoy")),
        "{log}"
    );
}
