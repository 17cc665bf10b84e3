//! `meshagent doctor` (also invoked as `pilot-agent doctor`) against a healthy sidecar — real
//! Envoy, devplane and Istio's capture rules, all inside a network namespace the test creates —
//! and against each broken setup it claims to detect: capture rules missing, rules of both
//! backends, no iptables/nft binary, CA unreachable, a wrong SAN, an expired / missing /
//! wrongly-addressed token, a socket with the wrong mode, an unreachable probe target and a DNS
//! proxy that does not answer. Each must be found with its named fix and a non-zero exit.
//!
//! The doctor runs as a pod would run it: with the agent's own environment and flags, read
//! from `/proc/<agent pid>/{environ,cmdline}`, in the agent's working directory and network
//! namespace. Needs root, iproute2, iptables and nftables (`make netpeers`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use meshagent::iptables::ISTIO_INIT_DEFAULT_ARGS;
use meshagent_proto::type_url;
use meshagent_testkit::{DEADLINE, Devplane, Sidecar, TwoWorkloads, free_port, kubelet};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_meshagent");
static COUNTER: AtomicU32 = AtomicU32::new(0);

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

/// A network namespace of the test's own (loopback up), deleted on drop.
struct Netns(String);

impl Netns {
    fn new() -> Netns {
        let name = format!(
            "madoc-{}x{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        run("ip", &["netns", "add", &name]);
        // Deleted on drop from here on, also when a step below fails.
        let ns = Netns(name);
        let name = &ns.0;
        run("ip", &["-n", name, "link", "set", "lo", "up"]);
        // The pod's interface: istio-iptables picks IPv4 or IPv6 rules by the addresses here.
        run(
            "ip",
            &[
                "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1",
            ],
        );
        run(
            "ip",
            &["-n", name, "addr", "add", "192.0.2.1/24", "dev", "eth0"],
        );
        run("ip", &["-n", name, "link", "set", "eth0", "up"]);
        ns
    }

    /// `meshagent istio-iptables ARGS` (Istio's injected defaults plus `extra`) in here.
    fn capture(&self, extra: &[&str]) {
        let mut args = vec!["netns", "exec", &self.0, BIN, "istio-iptables"];
        args.extend_from_slice(ISTIO_INIT_DEFAULT_ARGS);
        args.extend_from_slice(extra);
        run("ip", &args);
    }

    fn exec(&self, cmd: &[&str]) -> Output {
        let mut args = vec!["netns", "exec", &self.0];
        args.extend_from_slice(cmd);
        run("ip", &args)
    }

    /// Runs `f` on a thread that has entered this namespace: sockets it opens and processes
    /// it (or threads it starts) spawn live in here.
    fn enter<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/var/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let fd = File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// One doctor run: exit code, the parsed `--json` checks, and stderr.
struct Report {
    code: i32,
    checks: Vec<Value>,
    stdout: String,
    stderr: String,
}

impl Report {
    fn get(&self, name: &str) -> &Value {
        self.checks
            .iter()
            .find(|c| c["name"] == name)
            .unwrap_or_else(|| panic!("no check {name}: {}", self.stdout))
    }

    fn status(&self, name: &str) -> &str {
        self.get(name)["status"].as_str().unwrap()
    }

    /// Asserts `name` failed, its detail says `detail` and its fix says `fix`, and the exit
    /// code is non-zero.
    fn assert_fail(&self, name: &str, detail: &str, fix: &str) {
        let c = self.get(name);
        assert_eq!(c["status"], "FAIL", "{name}: {c:#}\n{}", self.stdout);
        let (d, f) = (c["detail"].as_str().unwrap(), c["fix"].as_str().unwrap());
        assert!(d.contains(detail), "{name} detail lacks {detail:?}: {d}");
        assert!(f.contains(fix), "{name} fix lacks {fix:?}: {f}");
        assert_eq!(self.code, 1, "a failed check exits 1: {}", self.stdout);
    }

    fn all_ok(&self) -> bool {
        self.code == 0 && self.checks.iter().all(|c| c["status"] == "OK")
    }
}

/// `bin doctor ARGS --json` in `cwd` with exactly `env` (bounded: the doctor must never hang).
async fn doctor(bin: &Path, cwd: &Path, env: &[(String, String)], args: &[String]) -> Report {
    doctor_via(&[], bin, cwd, env, args).await
}

/// [`doctor`] started through `wrapper` (e.g. `setpriv` to drop root).
async fn doctor_via(
    wrapper: &[&str],
    bin: &Path,
    cwd: &Path,
    env: &[(String, String)],
    args: &[String],
) -> Report {
    let mut cmd = match wrapper.split_first() {
        Some((first, rest)) => {
            let mut c = tokio::process::Command::new(first);
            c.args(rest).arg(bin);
            c
        }
        None => tokio::process::Command::new(bin),
    };
    cmd.arg("doctor")
        .args(args)
        .arg("--json")
        // Generous for loopback on a loaded machine; the silent-CA case waits this long once.
        .arg("--step-timeout-ms=5000")
        .current_dir(cwd)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the doctor finishes within 60 s")
        .expect("run the doctor");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let checks: Vec<Value> = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("--json output does not parse ({e}):\n{stdout}\n{stderr}"));
    for c in &checks {
        for key in ["name", "status", "detail"] {
            assert!(c[key].is_string(), "{key} in {c}");
        }
        assert!(
            c["status"] == "OK" || c["fix"].is_string(),
            "every warning and failure has a fix: {c}"
        );
    }
    Report {
        code: out.status.code().unwrap_or(-1),
        checks,
        stdout,
        stderr,
    }
}

/// `env` with `set` replacing or adding variables.
fn with(env: &[(String, String)], set: &[(&str, String)]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = env
        .iter()
        .filter(|(k, _)| !set.iter().any(|(s, _)| s == k))
        .cloned()
        .collect();
    out.extend(set.iter().map(|(k, v)| (k.to_string(), v.clone())));
    out
}

/// A base environment for a doctor without an agent (capture checks).
fn bare_env(path: &str) -> Vec<(String, String)> {
    vec![
        ("PATH".into(), path.into()),
        ("CLOUD_PLATFORM".into(), "none".into()),
        ("POD_NAMESPACE".into(), "default".into()),
    ]
}

fn host_path() -> String {
    std::env::var("PATH").unwrap_or_default()
}

/// An unsigned JWT (the doctor reads claims; the CA checks signatures).
fn jwt(claims: &Value) -> String {
    let b = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
    format!(
        "{}.{}.{}",
        b(br#"{"alg":"RS256"}"#),
        b(claims.to_string().as_bytes()),
        b(b"not-a-signature")
    )
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// A tiny HTTP application: 200 for every request.
async fn app() -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n")
                    .await;
            });
        }
    });
    port
}

/// A listener whose routes come from RDS `doctor-never`, which no one serves.
fn warming_listener() -> Vec<u8> {
    use meshagent_proto::envoy::pb::envoy::config::core::v3 as core;
    use meshagent_proto::envoy::pb::envoy::config::listener::v3 as listener;
    use meshagent_proto::envoy::pb::envoy::extensions::filters::http::router::v3::Router;
    use meshagent_proto::envoy::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
    use meshagent_proto::envoy::util::pack_any;
    use prost::Message;
    let manager = hcm::HttpConnectionManager {
        stat_prefix: "doctor_warming".into(),
        route_specifier: Some(hcm::http_connection_manager::RouteSpecifier::Rds(
            hcm::Rds {
                config_source: Some(core::ConfigSource {
                    config_source_specifier: Some(core::config_source::ConfigSourceSpecifier::Ads(
                        core::AggregatedConfigSource {},
                    )),
                    initial_fetch_timeout: Some(meshagent_proto::google::protobuf::Duration {
                        seconds: 0,
                        nanos: 0,
                    }),
                    resource_api_version: core::ApiVersion::V3 as i32,
                    ..Default::default()
                }),
                route_config_name: "doctor-never".into(),
            },
        )),
        http_filters: vec![hcm::HttpFilter {
            name: "envoy.filters.http.router".into(),
            config_type: Some(hcm::http_filter::ConfigType::TypedConfig(pack_any(
                Router::default(),
            ))),
            ..Default::default()
        }],
        ..Default::default()
    };
    listener::Listener {
        name: "doctor-warming".into(),
        address: Some(core::Address {
            address: Some(core::address::Address::SocketAddress(core::SocketAddress {
                address: "127.0.0.1".into(),
                port_specifier: Some(core::socket_address::PortSpecifier::PortValue(
                    free_port().into(),
                )),
                ..Default::default()
            })),
        }),
        filter_chains: vec![listener::FilterChain {
            filters: vec![listener::Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(listener::filter::ConfigType::TypedConfig(pack_any(manager))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
    .encode_to_vec()
}

/// The agent's environment and `proxy` arguments, as the kernel has them (polled: right after
/// the spawn the child may not have exec'd yet, and shows the test's own command line).
async fn agent_invocation(pid: u32) -> (Vec<(String, String)>, Vec<String>) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        let argv: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if let Some(at) = argv.iter().position(|a| a == "proxy") {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
            let env = environ
                .split(|b| *b == 0)
                .filter_map(|kv| {
                    let kv = String::from_utf8_lossy(kv);
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                })
                .collect();
            return (env, argv[at + 1..].to_vec());
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "agent {pid} never exec'd `meshagent proxy`: {argv:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The healthy pod: every check OK and exit 0 (run as `pilot-agent doctor`); then each broken
/// setup, one at a time, against the same running sidecar.
#[test]
fn healthy_pod_then_each_broken_setup() {
    let ns = Netns::new();
    ns.capture(&[]);
    ns.enter(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(healthy_then_broken())
    });
}

async fn healthy_then_broken() {
    let app_port = app().await;
    let probers = json!({
        "/app-health/web/readyz": {"httpGet": {"path": "/ready", "port": app_port}, "timeoutSeconds": 2},
        "/app-health/web/livez": {"tcpSocket": {"port": app_port}},
    });
    let scrape = json!({"scrape": "true", "port": app_port.to_string(), "path": "/metrics"});
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let mut sc = Sidecar::start(
        &dp,
        "a",
        "default",
        "a",
        &[
            ("ISTIO_KUBE_APP_PROBERS", probers.to_string()),
            ("ISTIO_PROMETHEUS_ANNOTATIONS", scrape.to_string()),
            // The DNS proxy on 127.0.0.1:15053 of this namespace.
            ("ISTIO_META_DNS_CAPTURE", "true".into()),
        ],
    )
    .await;
    sc.wait_ready(DEADLINE).await;
    let (env, mut args) = agent_invocation(sc.proc.pid()).await;
    // A service of the mesh: in the name table istiod (devplane) sends, answered locally.
    args.push("--dns-name=b.default.svc.cluster.local".into());
    let cwd = sc.cwd.path().to_path_buf();

    // Installed under Istio's name: the subcommand answers all the same.
    let bindir = tempfile::tempdir().unwrap();
    let pilot_agent = bindir.path().join("pilot-agent");
    std::os::unix::fs::symlink(BIN, &pilot_agent).unwrap();

    // Healthy: all OK, exit 0 (polled: Envoy's listeners may still be warming).
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let healthy = loop {
        let started = tokio::time::Instant::now();
        let r = doctor(&pilot_agent, &cwd, &env, &args).await;
        if r.all_ok() {
            println!("a healthy run took {:?}", started.elapsed());
            break r;
        }
        if tokio::time::Instant::now() >= deadline {
            sc.proc.print_log();
            dp.proc.print_log();
            panic!(
                "a healthy pod is not all OK (exit {}):\n{}\n{}",
                r.code, r.stdout, r.stderr
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let names: Vec<&str> = healthy
        .checks
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    for want in [
        "capture",
        "ca",
        "istiod",
        "token",
        "clock",
        "sds-socket",
        "xds-socket",
        "envoy",
        "status-port",
        "probe /app-health/web/readyz",
        "probe /app-health/web/livez",
        &format!("scrape :{app_port}/metrics"),
        "certs",
        "dns",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    assert!(
        healthy.get("certs")["detail"]
            .as_str()
            .unwrap()
            .contains("default: Available")
    );
    assert!(
        healthy.get("token")["detail"]
            .as_str()
            .unwrap()
            .contains("audience istio-ca")
    );
    assert!(
        healthy.get("istiod")["detail"]
            .as_str()
            .unwrap()
            .contains("istiod.istio-system.svc")
    );

    // The text form says the same, one line per check and a summary.
    let out = tokio::process::Command::new(&pilot_agent)
        .args(["doctor"])
        .args(&args)
        .current_dir(&cwd)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("pilot-agent doctor on a healthy pod:\n{text}");
    assert!(out.status.success(), "{text}");
    assert!(text.contains("OK   capture: "), "{text}");
    assert!(
        text.contains(" checks: ") && text.contains(" 0 FAIL"),
        "{text}"
    );

    let bin = PathBuf::from(BIN);
    // CA unreachable: a closed port.
    let closed = format!("127.0.0.1:{}", free_port());
    let r = doctor(
        &bin,
        &cwd,
        &with(&env, &[("CA_ADDR", closed.clone())]),
        &args,
    )
    .await;
    r.assert_fail("ca", &closed, "reachable");
    assert_eq!(r.status("istiod"), "OK");

    // A CA that accepts connections and never answers the handshake: the step's deadline.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let r = doctor(
        &bin,
        &cwd,
        &with(&env, &[("CA_ADDR", silent_addr.clone())]),
        &args,
    )
    .await;
    r.assert_fail("ca", "timed out after 5s", "reachable");
    drop(silent);

    // A server name istiod's certificate does not carry.
    let r = doctor(
        &bin,
        &cwd,
        &with(&env, &[("ISTIOD_SAN", "wrong.example.com".into())]),
        &args,
    )
    .await;
    r.assert_fail("istiod", "SAN mismatch", "ISTIOD_SAN");
    let d = r.get("istiod")["detail"].as_str().unwrap();
    assert!(
        d.contains("wrong.example.com") && d.contains("istiod.istio-system.svc"),
        "{d}"
    );

    // An unreachable probe target.
    let down = json!({"/app-health/down/readyz": {"tcpSocket": {"port": free_port()}}});
    let r = doctor(
        &bin,
        &cwd,
        &with(&env, &[("ISTIO_KUBE_APP_PROBERS", down.to_string())]),
        &args,
    )
    .await;
    r.assert_fail(
        "probe /app-health/down/readyz",
        "500",
        "listens on that port",
    );

    // Envoy's admin not answering where the agent's config says it is.
    let mut pc: Value =
        serde_json::from_str(&env.iter().find(|(k, _)| k == "PROXY_CONFIG").unwrap().1).unwrap();
    let admin_port = free_port();
    pc["proxyAdminPort"] = json!(admin_port);
    let r = doctor(
        &bin,
        &cwd,
        &with(&env, &[("PROXY_CONFIG", pc.to_string())]),
        &args,
    )
    .await;
    r.assert_fail(
        "envoy",
        &format!("127.0.0.1:{admin_port} does not answer"),
        "Envoy runs",
    );

    // A listener that warms forever: its routes (RDS, no initial fetch timeout, as Istio
    // configures them) never arrive. Named with what it waits for; a WARN while Envoy is young.
    dp.set_resource(type_url::LISTENER, "doctor-warming", &warming_listener())
        .await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let r = loop {
        let r = doctor(&bin, &cwd, &env, &args).await;
        if r.status("envoy") != "OK" || tokio::time::Instant::now() >= deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let c = r.get("envoy");
    assert_eq!(c["status"], "WARN", "{c:#}");
    let d = c["detail"].as_str().unwrap();
    println!("warming: {d}");
    assert!(d.contains("1 listeners warming"), "{d}");
    assert!(
        d.contains("doctor-never"),
        "names what Envoy waits for: {d}"
    );
    assert!(c["fix"].as_str().unwrap().contains("NACKs"), "{c:#}");

    // A socket Envoy (another uid) could not connect to.
    let xds = cwd.join("etc/istio/proxy/XDS");
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&xds, std::fs::Permissions::from_mode(0o600)).unwrap();
    let r = doctor(&bin, &cwd, &env, &args).await;
    std::fs::set_permissions(&xds, std::fs::Permissions::from_mode(0o666)).unwrap();
    r.assert_fail("xds-socket", "mode 0600", "chmod 0666");
    assert_eq!(r.status("sds-socket"), "OK");

    // Tokens: expired, for another audience, missing.
    let tokens = cwd.join("var/run/secrets/tokens");
    let expired = jwt(&json!({"aud": ["istio-ca"], "exp": now_secs() - 120, "sub": "x"}));
    kubelet::atomic_write(&tokens, &[("istio-token", expired.as_bytes())]);
    let r = doctor(&bin, &cwd, &env, &args).await;
    r.assert_fail("token", "expired at", "projected volume");
    assert!(
        !r.stdout.contains(&expired) && !r.stderr.contains(&expired),
        "the token is never printed"
    );
    let other = jwt(&json!({"aud": "other", "exp": now_secs() + 3600}));
    kubelet::atomic_write(&tokens, &[("istio-token", other.as_bytes())]);
    let r = doctor(&bin, &cwd, &env, &args).await;
    r.assert_fail("token", "audience [other]", "audience: istio-ca");
    std::fs::remove_file(tokens.join("istio-token")).unwrap();
    let r = doctor(&bin, &cwd, &env, &args).await;
    r.assert_fail("token", "is missing", "istio-token");

    sc.proc.kill();

    // A second pod whose CA is down: its certificate is Failing in /debug/certz, with the
    // agent's own error.
    let down = format!("localhost:{}", free_port());
    let mut sc2 = Sidecar::start(&dp, "b", "default", "b", &[("CA_ADDR", down.clone())]).await;
    let (env2, args2) = agent_invocation(sc2.proc.pid()).await;
    let cwd2 = sc2.cwd.path().to_path_buf();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let r = loop {
        let r = doctor(&bin, &cwd2, &env2, &args2).await;
        if r.status("certs") == "FAIL" || tokio::time::Instant::now() >= deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if r.status("certs") != "FAIL" {
        sc2.proc.print_log();
    }
    r.assert_fail("certs", "default: Failing", "ca and token checks");
    r.assert_fail("ca", &down, "reachable");
    r.assert_fail("status-port", "503", "not ready");
    sc2.proc.kill();
}

/// The capture backends in namespaces of their own: rules missing, one backend, both at once,
/// no binary to read them with; and a DNS proxy that does not answer.
#[test]
fn capture_backends_and_dns() {
    let cwd = tempfile::tempdir().unwrap();
    let run_as = |ns: &Netns, env: Vec<(String, String)>, wrapper: &'static [&'static str]| {
        let cwd = cwd.path().to_path_buf();
        ns.enter(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async { doctor_via(wrapper, Path::new(BIN), &cwd, &env, &[]).await })
        })
    };
    let run_in = |ns: &Netns, env: Vec<(String, String)>| run_as(ns, env, &[]);

    let ns = Netns::new();
    let r = run_in(&ns, bare_env(&host_path()));
    r.assert_fail("capture", "no Istio capture rules", "istio-init");

    ns.capture(&[]);
    let r = run_in(&ns, bare_env(&host_path()));
    assert_eq!(r.status("capture"), "OK", "{}", r.stdout);
    assert!(
        r.get("capture")["detail"]
            .as_str()
            .unwrap()
            .contains("iptables")
    );

    // As the proxy's uid (1337) without CAP_NET_ADMIN, as `kubectl exec` runs it: the rules
    // cannot be read, which is said, with how to read them.
    let r = run_as(
        &ns,
        bare_env(&host_path()),
        &["setpriv", "--reuid=1337", "--regid=1337", "--clear-groups"],
    );
    let c = r.get("capture");
    assert_eq!(c["status"], "WARN", "{c:#}");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains("cannot read capture rules"),
        "{c:#}"
    );
    assert!(c["fix"].as_str().unwrap().contains("nsenter"), "{c:#}");

    // A stale native-nftables table next to the iptables rules.
    ns.exec(&["nft", "add", "table", "inet", "istio-proxy-nat"]);
    let r = run_in(&ns, bare_env(&host_path()));
    r.assert_fail("capture", "more than one backend", "nativeNftables");

    // Neither binary in PATH.
    let r = run_in(&ns, bare_env("/nonexistent"));
    r.assert_fail("capture", "neither iptables-save", "Istio #57978");

    // Native nftables only.
    let ns2 = Netns::new();
    ns2.capture(&["--native-nftables"]);
    let r = run_in(&ns2, bare_env(&host_path()));
    assert_eq!(r.status("capture"), "OK", "{}", r.stdout);
    assert!(
        r.get("capture")["detail"]
            .as_str()
            .unwrap()
            .contains("nftables")
    );

    // Interception off: nothing expected, nothing failing here.
    let pc = json!({"interceptionMode": "NONE"}).to_string();
    let r = run_in(&ns2, with(&bare_env(&host_path()), &[("PROXY_CONFIG", pc)]));
    assert_eq!(r.status("capture"), "OK", "{}", r.stdout);

    // DNS capture on, but no DNS proxy answering on its address.
    let env = with(
        &bare_env(&host_path()),
        &[("ISTIO_META_DNS_CAPTURE", "true".into())],
    );
    let r = run_in(&ns2, env);
    r.assert_fail("dns", "127.0.0.1:15053", "ISTIO_META_DNS_CAPTURE");
}
