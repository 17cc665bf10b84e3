//! Differential: the status port (15020) of the real pilot-agent beside meshagent, each as a
//! pod runs it against istiod-box with a real Envoy (testkit `start_agent`), with the same
//! application peers: an HTTP server (probe targets and Prometheus metrics), grpcio's health
//! server, and a closed port.
//!
//! Compared, as parsed structures:
//! * `/healthz/ready` through start (Envoy not started yet; Envoy up without config because
//!   istiod's xDS is unreachable; the CA unreachable), ready, Envoy stopped after ready, after
//!   SIGTERM (during the drain) and after `POST /drain`: the status code and body, or that
//!   nothing answered;
//! * `POST /drain` and `GET /drain`, and the loopback-only endpoints asked from the host's own
//!   non-loopback address;
//! * the merged `/stats/prometheus` with `ISTIO_PROMETHEUS_ANNOTATIONS` pointing at the app:
//!   Content-Type, the set of families, each family's HELP/TYPE and series, and the values of
//!   the app's samples and of the gauges the configuration fixes ([`values_compared`] lists
//!   what is ignored and why); and, with istiod's xDS or the CA unreachable, the agent's
//!   families and what each agent counted;
//! * the multi-target merge (`targets` in `ISTIO_PROMETHEUS_ANNOTATIONS`, two app paths) with
//!   `PILOT_AGENT_MERGE_ENVOY_STATS=false`: Content-Type and every non-agent family;
//! * response compression: the `Content-Encoding` and `Vary` each `Accept-Encoding` gets;
//! * `/app-health/<c>/<kind>` for HTTP, TCP and gRPC probes (`ISTIO_KUBE_APP_PROBERS`), healthy
//!   and failing, and an unknown path: status code and body.
//!
//! Every difference fails unless COMPAT.md ("Deliberate differences") lists it; those are
//! written here as the expected (pilot-agent, meshagent) pair with the row's reason, and a
//! listed difference that is gone fails too.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode, header};
use http_body_util::{BodyExt, Full};
use meshagent_testkit::istiod_box::{
    AgentKind, GRPC_HEALTH_SERVER, IstiodBox, PodSpec, mesh_with_free_ports, start_agent,
    workload_a,
};
use meshagent_testkit::prom::{self, Block, Exposition};
use meshagent_testkit::{
    DEADLINE, Proc, Sidecar, Value, envoy_bin, envoy_children_of, free_port, json, signal,
    wait_for, workspace_root,
};

const READY: Duration = Duration::from_secs(60);

// ===== peers =====

/// The application: probe targets and a Prometheus endpoint.
async fn start_app() -> u16 {
    use axum::routing::get;
    // What a probe forwarded: Host (the status port replaced by the app's), the kubelet's
    // User-Agent and a header of the probe spec that kubelet sends along.
    async fn ok(h: HeaderMap) -> String {
        let get = |n: &str| {
            h.get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        format!(
            "ok host={} ua={} x-probe={}",
            get("host"),
            get("user-agent"),
            get("x-probe")
        )
    }
    async fn fail() -> (StatusCode, &'static str) {
        (StatusCode::INTERNAL_SERVER_ERROR, "boom")
    }
    async fn redirect() -> (
        StatusCode,
        [(header::HeaderName, &'static str); 1],
        &'static str,
    ) {
        (
            StatusCode::FOUND,
            [(header::LOCATION, "http://elsewhere.invalid/")],
            "moved",
        )
    }
    async fn metrics() -> ([(header::HeaderName, &'static str); 1], &'static str) {
        (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            APP_METRICS,
        )
    }
    let app = axum::Router::new()
        .route("/ok", get(ok))
        .route("/fail", get(fail))
        .route("/redirect", get(redirect))
        .route("/metrics", get(metrics))
        .route("/metrics2", get(|| async { APP_METRICS_2 }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    port
}

/// The app's metrics: a counter, a histogram, a gauge with a label, and a family Envoy also
/// writes (`envoy_server_live`), which the agents merge differently (see [`expected_family`]).
const APP_METRICS: &str = "# HELP app_requests_total Requests served.\n\
# TYPE app_requests_total counter\n\
app_requests_total{code=\"200\",path=\"/\"} 7\n\
app_requests_total{code=\"500\",path=\"/\"} 1\n\
# HELP app_latency_seconds Request latency.\n\
# TYPE app_latency_seconds histogram\n\
app_latency_seconds_bucket{le=\"0.1\"} 1\n\
app_latency_seconds_bucket{le=\"+Inf\"} 2\n\
app_latency_seconds_sum 0.3\n\
app_latency_seconds_count 2\n\
# HELP app_build_info Build.\n\
# TYPE app_build_info gauge\n\
app_build_info{version=\"1.2.3\"} 1\n\
# HELP envoy_server_live The app's own family of Envoy's name.\n\
# TYPE envoy_server_live gauge\n\
envoy_server_live 0\n";

/// A second metrics endpoint of the app, for the multi-target merge.
const APP_METRICS_2: &str = "# HELP app_jobs_total Jobs run.\n\
# TYPE app_jobs_total counter\n\
app_jobs_total{queue=\"a\"} 3\n";

struct Peers {
    web: u16,
    grpc: u16,
    closed: u16,
    _grpc: Proc,
    _dir: tempfile::TempDir,
}

async fn start_peers() -> Peers {
    let dir = tempfile::tempdir().unwrap();
    let web = start_app().await;
    let grpc = free_port();
    let mut cmd = Command::new("python3");
    cmd.args(["-c", GRPC_HEALTH_SERVER, &grpc.to_string()]).env(
        "PYTHONPATH",
        workspace_root().join(".tools/pip").display().to_string(),
    );
    let proc = Proc::spawn("grpc-health", cmd, dir.path());
    let addr = SocketAddr::from(([127, 0, 0, 1], grpc));
    wait_for("the gRPC health server", DEADLINE, || async move {
        tokio::net::TcpStream::connect(addr).await.ok().map(|_| ())
    })
    .await;
    Peers {
        web,
        grpc,
        closed: free_port(),
        _grpc: proc,
        _dir: dir,
    }
}

/// `ISTIO_KUBE_APP_PROBERS` as Istio's injector writes it (every probe with its timeout).
fn probers(p: &Peers) -> String {
    json!({
        "/app-health/web/livez": {"httpGet": {"path": "/ok", "port": p.web}, "timeoutSeconds": 10},
        "/app-health/web/readyz": {"httpGet": {"path": "/fail", "port": p.web}, "timeoutSeconds": 10},
        "/app-health/web/startupz": {"httpGet": {"path": "redirect", "port": p.web}, "timeoutSeconds": 10},
        "/app-health/down/livez": {"httpGet": {"path": "/ok", "port": p.closed}, "timeoutSeconds": 10},
        "/app-health/tcp/livez": {"tcpSocket": {"port": p.web}, "timeoutSeconds": 10},
        "/app-health/tcp/readyz": {"tcpSocket": {"port": p.closed}, "timeoutSeconds": 10},
        "/app-health/grpc/livez": {"grpc": {"port": p.grpc, "service": "ok"}, "timeoutSeconds": 10},
        "/app-health/grpc/readyz": {"grpc": {"port": p.grpc, "service": "bad"}, "timeoutSeconds": 10},
        "/app-health/grpc/startupz": {"grpc": {"port": p.closed, "service": "ok"}, "timeoutSeconds": 2},
    })
    .to_string()
}

/// The probe paths asked, the last one configured for no container.
const PROBE_PATHS: &[&str] = &[
    "/app-health/web/livez",
    "/app-health/web/readyz",
    "/app-health/web/startupz",
    "/app-health/down/livez",
    "/app-health/tcp/livez",
    "/app-health/tcp/readyz",
    "/app-health/grpc/livez",
    "/app-health/grpc/readyz",
    "/app-health/grpc/startupz",
    "/app-health/nope/livez",
];

// ===== HTTP =====

struct Answer {
    code: u16,
    headers: HeaderMap,
    body: String,
}

/// One HTTP/1.1 request with kubelet's and Prometheus' headers as given, on a fresh
/// connection; `Err` names what kept an answer from coming (`refused`, `closed`, ...).
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<Answer, String> {
    let work = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::ConnectionRefused => "refused".to_owned(),
                k => format!("connect: {k:?}"),
            })?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(conn);
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, addr.to_string());
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = send
            .send_request(req.body(Full::new(bytes::Bytes::new())).unwrap())
            .await
            .map_err(|e| {
                if e.is_incomplete_message() || e.is_canceled() {
                    "closed".to_owned()
                } else {
                    format!("request: {e}")
                }
            })?;
        let code = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        Ok(Answer {
            code,
            headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(Duration::from_secs(20), work)
        .await
        .unwrap_or_else(|_| Err("timed out".to_owned()))
}

/// What kubelet sends with a probe: its User-Agent and the probe spec's `httpHeaders`.
const KUBELET: &[(&str, &str)] = &[("user-agent", "kube-probe/1.34"), ("x-probe", "spec")];

/// An answer as compared: code and body, or why none came.
fn observed(r: &Result<Answer, String>) -> Value {
    match r {
        Ok(a) => json!({"code": a.code, "body": a.body}),
        Err(e) => json!({"no_answer": e}),
    }
}

async fn ready_answer(sc: &Sidecar) -> Result<Answer, String> {
    request(sc.status, "GET", "/healthz/ready", KUBELET).await
}

async fn wait_ready(sc: &Sidecar) {
    wait_for("the agent to be ready", READY, || async {
        matches!(ready_answer(sc).await, Ok(Answer { code: 200, .. })).then_some(())
    })
    .await;
}

/// Waits until the status port answers; returns the answer.
async fn first_ready_answer(sc: &Sidecar) -> Answer {
    wait_for("the status port to answer", READY, || async {
        ready_answer(sc).await.ok()
    })
    .await
}

/// Waits until Envoy's admin answers (any HTTP answer).
async fn wait_envoy_admin(sc: &Sidecar) {
    wait_for("Envoy's admin to answer", READY, || async {
        request(sc.admin, "GET", "/ready", &[])
            .await
            .ok()
            .map(|_| ())
    })
    .await;
}

/// Prometheus' Accept header for a text scrape.
const SCRAPE: &[(&str, &str)] = &[("accept", "text/plain;version=0.0.4;q=1,*/*;q=0.1")];

async fn scrape(sc: &Sidecar) -> Exposition {
    let a = request(sc.status, "GET", "/stats/prometheus", SCRAPE)
        .await
        .unwrap();
    assert_eq!(a.code, 200, "{}", a.body);
    prom::parse(&a.body)
}

/// The series of family `name` with a value other than 0.
fn nonzero(e: &Exposition, name: &str) -> BTreeSet<String> {
    e.families
        .get(name)
        .into_iter()
        .flatten()
        .flat_map(|b| &b.samples)
        .filter(|(_, v)| v.iter().any(|v| v.parse::<f64>().is_ok_and(|v| v != 0.0)))
        .map(|((n, labels), _)| format!("{n}{labels:?}"))
        .collect()
}

/// An address of this host that is not loopback (the status port listens on every address):
/// a connection to it comes from it, which both agents must treat as not local.
fn non_loopback_ip() -> std::net::IpAddr {
    let out = Command::new("ip")
        .args(["-o", "addr", "show", "scope", "global"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .find_map(|w| {
            matches!(w[0], "inet" | "inet6")
                .then(|| w[1].split('/').next()?.parse().ok())
                .flatten()
        })
        .expect("the host has no non-loopback address (`ip addr show scope global`): the test asks the loopback-only endpoints from one")
}

// ===== cases =====

fn pod<'a>(proxy_config: Value, env: &'a [(&'a str, &'a str)]) -> PodSpec<'a> {
    PodSpec {
        workload: "a",
        namespace: "default",
        service_account: "a",
        ip: "127.0.0.1",
        proxy_config,
        env,
    }
}

/// Observations of one agent, by case name.
type Observed = BTreeMap<String, Value>;

/// Readiness before Envoy runs: the agent's binary path is a script that waits on a FIFO no
/// one writes to before it execs Envoy.
async fn case_envoy_not_started(istiod: &IstiodBox, kind: AgentKind, out: &mut Observed) {
    let dir = tempfile::tempdir().unwrap();
    let gate = dir.path().join("gate");
    assert!(
        Command::new("mkfifo")
            .arg(&gate)
            .status()
            .unwrap()
            .success()
    );
    let script = dir.path().join("gated-envoy");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\ncase \"$1\" in --version) ;; *) read _ < '{}' ;; esac\nexec '{}' \"$@\"\n",
            gate.display(),
            envoy_bin().display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &script,
        <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
    )
    .unwrap();
    let sc = start_agent(
        istiod,
        kind,
        &pod(json!({"binaryPath": script.display().to_string()}), &[]),
    )
    .await;
    let a = first_ready_answer(&sc).await;
    assert!(
        envoy_children_of(sc.proc.pid()).is_empty(),
        "{kind:?}: Envoy started past the gate"
    );
    out.insert("ready/envoy_not_started".into(), observed(&Ok(a)));
}

/// Readiness with Envoy up but no configuration: istiod's xDS address is a closed port (the
/// CA is still reachable).
async fn case_xds_unreachable(
    istiod: &IstiodBox,
    kind: AgentKind,
    out: &mut Observed,
) -> Exposition {
    let sc = start_agent(
        istiod,
        kind,
        &pod(
            json!({"discoveryAddress": format!("localhost:{}", free_port())}),
            &[],
        ),
    )
    .await;
    wait_envoy_admin(&sc).await;
    out.insert(
        "ready/xds_unreachable".into(),
        observed(&ready_answer(&sc).await),
    );
    // Both agents count the refused connection as a connection error (see
    // compare_not_ready_metrics).
    wait_for(
        "a refused istiod connection to be counted",
        READY,
        || async {
            let m = scrape(&sc).await;
            let counted = !nonzero(&m, "istio_agent_istiod_connection_terminations").is_empty();
            counted.then_some(m)
        },
    )
    .await
}

/// Readiness with the CA unreachable (`CA_ADDR` a closed port), istiod's xDS reachable.
async fn case_ca_down(istiod: &IstiodBox, kind: AgentKind, out: &mut Observed) -> Exposition {
    let ca = format!("localhost:{}", free_port());
    let env = [("CA_ADDR", ca.as_str())];
    let sc = start_agent(istiod, kind, &pod(json!({}), &env)).await;
    wait_envoy_admin(&sc).await;
    out.insert("ready/ca_down".into(), observed(&ready_answer(&sc).await));
    wait_for("a failed CSR to be counted", READY, || async {
        let m = scrape(&sc).await;
        (!nonzero(&m, "istio_agent_num_failed_outgoing_requests").is_empty()).then_some(m)
    })
    .await
}

/// Istio 1.31's multi-target merge (`targets`, as the injector writes it from
/// `prometheus.istio.io/scrape-targets`) with `PILOT_AGENT_MERGE_ENVOY_STATS=false`: the
/// Content-Type and every family that is not the agent's own, each with its series and values.
async fn case_multi_target(istiod: &IstiodBox, kind: AgentKind, peers: &Peers, out: &mut Observed) {
    let web = peers.web.to_string();
    let annotations = json!({"scrape": "true", "port": web, "path": "/metrics", "targets": [
        {"port": web, "path": "/metrics"},
        {"port": web, "path": "/metrics2"},
    ]})
    .to_string();
    let env = [
        ("ISTIO_PROMETHEUS_ANNOTATIONS", annotations.as_str()),
        ("PILOT_AGENT_MERGE_ENVOY_STATS", "false"),
    ];
    let sc = start_agent(istiod, kind, &pod(json!({}), &env)).await;
    wait_ready(&sc).await;
    let a = request(sc.status, "GET", "/stats/prometheus", SCRAPE)
        .await
        .unwrap();
    let parsed = prom::parse(&a.body);
    let families: BTreeMap<&String, Value> = parsed
        .families
        .iter()
        .filter(|(n, _)| !n.starts_with("istio_agent_"))
        .map(|(n, b)| (n, json!(b.iter().map(|b| shape(n, b)).collect::<Vec<_>>())))
        .collect();
    out.insert(
        "metrics/multi_target_without_envoy".into(),
        json!({
            "code": a.code,
            "content_type": a.headers.get(header::CONTENT_TYPE).map(|v| v.to_str().unwrap_or("?")),
            "families": families,
            "bad_lines": parsed.bad_lines.len(),
        }),
    );
}

/// Readiness after SIGTERM, while the agent drains, and an app probe then. The drain
/// (terminationDrainDuration) is 20 s and the agent is killed once observed; within the first
/// 8 s the status port either stops accepting connections (observed as refused) or keeps
/// answering (observed: its last answer in that window).
async fn case_sigterm(istiod: &IstiodBox, kind: AgentKind, peers: &Peers, out: &mut Observed) {
    let env = [("ISTIO_KUBE_APP_PROBERS", probers(peers))];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut sc = start_agent(
        istiod,
        kind,
        &pod(json!({"terminationDrainDuration": "20s"}), &env),
    )
    .await;
    wait_ready(&sc).await;
    signal(sc.proc.pid(), "-TERM");
    let window = tokio::time::Instant::now() + Duration::from_secs(8);
    let mut last;
    loop {
        last = ready_answer(&sc).await;
        let refused = matches!(&last, Err(e) if e == "refused");
        if refused || tokio::time::Instant::now() >= window {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let probe = request(sc.status, "GET", "/app-health/web/livez", KUBELET).await;
    assert!(
        sc.proc.try_wait().is_none(),
        "{kind:?} exited within its 20 s drain"
    );
    out.insert("ready/after_sigterm".into(), observed(&last));
    out.insert("probe_during_drain/web/livez".into(), observed(&probe));
}

/// The ready agent: readiness, Envoy stopped after ready, the merged metrics, every probe,
/// then `POST /drain` and readiness and a probe after it.
async fn case_ready(
    istiod: &IstiodBox,
    kind: AgentKind,
    peers: &Peers,
    out: &mut Observed,
) -> (Answer, Exposition) {
    let annotations =
        json!({"scrape": "true", "port": peers.web.to_string(), "path": "/metrics"}).to_string();
    let env = [
        ("ISTIO_KUBE_APP_PROBERS", probers(peers)),
        ("ISTIO_PROMETHEUS_ANNOTATIONS", annotations),
    ];
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let sc = start_agent(istiod, kind, &pod(json!({}), &env)).await;
    wait_ready(&sc).await;
    out.insert("ready/ready".into(), observed(&ready_answer(&sc).await));

    // Both agents keep "ready once" (Istio's ready.Probe caches it): a stopped Envoy does not
    // turn them unready.
    let envoy = envoy_children_of(sc.proc.pid());
    assert_eq!(envoy.len(), 1, "{kind:?}: {envoy:?}");
    signal(envoy[0], "-STOP");
    let stopped = ready_answer(&sc).await;
    signal(envoy[0], "-CONT");
    out.insert("ready/envoy_stopped".into(), observed(&stopped));

    for path in PROBE_PATHS {
        let a = request(sc.status, "GET", path, KUBELET).await;
        out.insert(
            format!("probe{}", &path["/app-health".len()..]),
            observed(&a),
        );
    }

    // A first scrape creates Envoy's stats for the scrape itself (its Prometheus listener's
    // response codes); the second is compared.
    scrape(&sc).await;
    let metrics = request(sc.status, "GET", "/stats/prometheus", SCRAPE)
        .await
        .unwrap();
    let parsed = prom::parse(&metrics.body);

    // Response compression (gzhttp around Istio's mux): which coding each Accept-Encoding
    // gets, and the headers that come with it, on the merged metrics, on a HEAD of them, and
    // on a short answer.
    for (method, path, ae) in [
        ("GET", "/stats/prometheus", "gzip"),
        ("GET", "/stats/prometheus", "zstd"),
        ("GET", "/stats/prometheus", "gzip, deflate, br, zstd"),
        ("GET", "/stats/prometheus", "gzip;q=1.0, zstd;q=0.5"),
        ("GET", "/stats/prometheus", "gzip;q=0, zstd;q=0"),
        ("GET", "/stats/prometheus", "identity"),
        ("GET", "/stats/prometheus", "*"),
        ("GET", "/stats/prometheus", "identity;q=1, gzip;q=0.1"),
        ("HEAD", "/stats/prometheus", "gzip"),
        ("GET", "/healthz/ready", "gzip, zstd"),
    ] {
        let mut headers = SCRAPE.to_vec();
        headers.push(("accept-encoding", ae));
        let a = request(sc.status, method, path, &headers).await;
        let v = match &a {
            Ok(a) => {
                let h = |n: header::HeaderName| {
                    a.headers
                        .get_all(n)
                        .iter()
                        .map(|v| v.to_str().unwrap_or("?").to_owned())
                        .collect::<Vec<_>>()
                };
                json!({
                    "code": a.code,
                    "content_encoding": h(header::CONTENT_ENCODING),
                    "vary": h(header::VARY),
                    "content_length": !h(header::CONTENT_LENGTH).is_empty(),
                })
            }
            Err(e) => json!({"no_answer": e}),
        };
        out.insert(format!("encoding/{method} {path} [{ae}]"), v);
    }

    let drain = request(sc.status, "POST", "/drain", &[]).await;
    out.insert("drain/post".into(), observed(&drain));
    out.insert(
        "ready/after_post_drain".into(),
        observed(&ready_answer(&sc).await),
    );
    let probe = request(sc.status, "GET", "/app-health/web/livez", KUBELET).await;
    out.insert("probe_after_drain/web/livez".into(), observed(&probe));
    let get_drain = request(sc.status, "GET", "/drain", &[]).await;
    out.insert("drain/get".into(), observed(&get_drain));

    // The loopback-only endpoints, asked from the host's own non-loopback address (last:
    // were /quitquitquit served, the agent would exit).
    let outside = SocketAddr::new(non_loopback_ip(), sc.status.port());
    for (method, path) in [
        ("GET", "/debug/ndsz"),
        ("POST", "/drain"),
        ("GET", "/drain"),
        ("POST", "/quitquitquit"),
    ] {
        let a = request(outside, method, path, &[]).await;
        out.insert(format!("non_loopback/{method} {path}"), observed(&a));
    }
    (metrics, parsed)
}

struct Run {
    observed: Observed,
    metrics: Answer,
    parsed: Exposition,
    /// Scrapes while istiod's xDS, and the CA, are unreachable.
    not_ready: [Exposition; 2],
}

async fn run(istiod: &IstiodBox, kind: AgentKind, peers: &Peers) -> Run {
    let (mut a, mut b, mut c, mut d, mut e, mut f) = Default::default();
    let ((metrics, parsed), (), xds, ca, (), ()) = tokio::join!(
        case_ready(istiod, kind, peers, &mut a),
        case_envoy_not_started(istiod, kind, &mut b),
        case_xds_unreachable(istiod, kind, &mut c),
        case_ca_down(istiod, kind, &mut d),
        case_sigterm(istiod, kind, peers, &mut e),
        case_multi_target(istiod, kind, peers, &mut f),
    );
    let mut observed = Observed::new();
    for m in [a, b, c, d, e, f] {
        observed.extend(m);
    }
    Run {
        observed,
        metrics,
        parsed,
        not_ready: [xds, ca],
    }
}

// ===== comparison =====

/// Stands for "a non-empty reason" in an expected body.
const REASON: &str = "<the failure's reason>";

/// What meshagent is expected to answer for `key`, given pilot-agent's answers: pilot-agent's
/// own answer, but where a row of COMPAT.md's "Deliberate differences" applies. `Err` when
/// pilot-agent no longer does what the row says.
fn expected_answer(key: &str, pilot: &Observed) -> Result<Value, String> {
    let p = &pilot[key];
    let refused = json!({"no_answer": "refused"});
    match key {
        // "the status port after SIGTERM": pilot-agent's status server stops with the agent's
        // context at SIGTERM (pilot/cmd/pilot-agent/status/server.go, Run), so nothing
        // answers; meshagent serves until it exits: readiness fails with Istio's own reason
        // (ready/probe.go, "server is terminated") and app probes still reach the app.
        "ready/after_sigterm" | "probe_during_drain/web/livez" if *p != refused => Err(format!(
            "{key}: COMPAT.md says pilot-agent's status port refuses connections during the \
             drain, it answered {p}: update the row"
        )),
        "ready/after_sigterm" => Ok(json!({"code": 503, "body": "server is terminated"})),
        "probe_during_drain/web/livez" => Ok(pilot["probe/web/livez"].clone()),
        // "the body of a failed readiness check (503) and of an HTTP probe that got no
        // answer (500)": pilot-agent writes readiness failures and
        // HTTP probes that got no answer as a bare status (server.go handleReadyProbe,
        // handleAppProbeHTTPGet).
        k if (k.starts_with("ready/") && p["code"] == 503 && p["body"] == "")
            || (k == "probe/down/livez" && p["code"] == 500 && p["body"] == "") =>
        {
            Ok(json!({"code": p["code"], "body": REASON}))
        }
        "probe/down/livez" => Err(format!(
            "{key}: COMPAT.md says pilot-agent answers a refused HTTP probe with a bare 500, it \
             answered {p}: update the row"
        )),
        _ => Ok(p.clone()),
    }
}

fn answer_matches(expected: &Value, got: &Value) -> bool {
    if expected["body"] == REASON {
        got["code"] == expected["code"] && got["body"].as_str().is_some_and(|b| !b.is_empty())
    } else {
        expected == got
    }
}

/// Families only pilot-agent writes, each with the reason (COMPAT.md rows "`istio_agent_go_*`"
/// and "`istio_agent_pilot_xds_send_time`, `istio_agent_pilot_xds_expired_nonce`").
fn pilot_only_listed(name: &str) -> bool {
    // Go's runtime collector (pilot/cmd/pilot-agent/status/server.go, initializeMonitoring):
    // the garbage collector, goroutines and memstats of a Go process.
    name.starts_with("istio_agent_go_")
        // Istio's SDS server is pilot's xDS server code (pilot/pkg/xds/monitoring.go), which
        // records its pushes and stale nonces; meshagent's SDS server is its own.
        || name == "istio_agent_pilot_xds_send_time"
        || name == "istio_agent_pilot_xds_expired_nonce"
}

/// Istio's agent families that its exporter writes only once something was recorded
/// (pkg/monitoring: OpenTelemetry instruments appear with their first value), each series
/// only once recorded; meshagent registers every family and series at start and writes them
/// with 0 (COMPAT.md row "agent metric families
/// with nothing recorded yet").
const NOT_RECORDED_IN_ISTIO: &[&str] = &[
    "istio_agent_envoy_connection_terminations",
    "istio_agent_istiod_connection_failures",
    "istio_agent_istiod_connection_terminations",
    "istio_agent_num_failed_outgoing_requests",
    "istio_agent_num_file_secret_failures_total",
    "istio_agent_num_file_watcher_failures_total",
    "istio_agent_num_outgoing_retries",
    "istio_agent_scrape_failures_total",
    "istio_agent_wasm_cache_entries",
    "istio_agent_wasm_cache_lookup_count",
    "istio_agent_wasm_config_conversion_count",
    "istio_agent_wasm_config_conversion_duration",
    "istio_agent_wasm_remote_fetch_count",
];

/// meshagent's own families (the COMPAT.md row listing them), documented in docs/ where each
/// mechanism is.
const MESHAGENT_ONLY: &[&str] = &[
    "istio_agent_file_secret_loads_total",
    "istio_agent_file_secret_resources",
    "istio_agent_merge_dropped_families_total",
    "istio_agent_merge_target_scrape_duration_seconds",
    "istio_agent_merge_target_up",
    "istio_agent_output_certs_write_failures_total",
    "istio_agent_output_certs_writes_total",
    "istio_agent_task_panics_total",
    "istio_agent_xds_proxy_downstream_stalled",
    "istio_agent_xds_proxy_upstream_recv_max",
];

/// Families whose sample values are compared: the app's (served identically to both) and
/// those fixed by the configuration, not by the run. Every other value is ignored, by kind:
/// Envoy's counters, histograms and most gauges count the run's own traffic, bytes, memory
/// and timings (xDS and SDS exchanges, the scrapes, uptime); the agent's process_* describe
/// two different processes (CPU, memory, descriptors, start time, network octets of the
/// host's namespace); startup_duration_seconds, cert_expiry_seconds, outgoing_latency and
/// pilot_xds_recv_max are timings and message sizes of the run; the xDS and CSR counters
/// depend on retries and reconnects.
fn values_compared(name: &str) -> bool {
    name.starts_with("app_")
        || [
            "envoy_server_state",
            "envoy_server_live",
            "envoy_server_concurrency",
            "envoy_server_hot_restart_epoch",
            "envoy_cluster_manager_active_clusters",
            "envoy_cluster_manager_warming_clusters",
            "envoy_listener_manager_total_listeners_active",
            "envoy_listener_manager_total_listeners_warming",
            "istio_agent_scrapes_total",
            "istio_agent_process_max_fds",
        ]
        .contains(&name)
}

/// A family as compared: HELP, TYPE, the series (sample name and labels), and the values
/// where [`values_compared`].
fn shape(name: &str, b: &Block) -> Value {
    let series: Vec<Value> = b
        .samples
        .iter()
        .map(|((n, labels), values)| {
            if values_compared(name) {
                json!([n, labels, values])
            } else {
                json!([n, labels])
            }
        })
        .collect();
    json!({"help": b.help, "type": b.types, "series": series})
}

/// COMPAT.md row "a metric family in two merged sources" (docs/operations.md, "Merged metrics"):
/// pilot-agent concatenates the sources, so a family the app shares with Envoy is
/// written twice; meshagent drops the later block. Expected: pilot-agent's first block.
fn expected_family(pilot_blocks: &[Block]) -> &Block {
    &pilot_blocks[0]
}

fn compare_metrics(pilot: &Run, ours: &Run, failures: &mut Vec<String>) {
    let ct = |r: &Run| {
        r.metrics
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    if ct(pilot) != ct(ours) {
        failures.push(format!(
            "metrics Content-Type: pilot-agent {:?}, meshagent {:?}",
            ct(pilot),
            ct(ours)
        ));
    }
    for (who, r) in [("pilot-agent", pilot), ("meshagent", ours)] {
        if !r.parsed.bad_lines.is_empty() {
            failures.push(format!("{who}: unparsed lines {:?}", r.parsed.bad_lines));
        }
    }
    let (p, m) = (&pilot.parsed.families, &ours.parsed.families);
    let mut go_seen = false;
    for (name, blocks) in p {
        let Some(mine) = m.get(name) else {
            go_seen |= name.starts_with("istio_agent_go_");
            if !pilot_only_listed(name) {
                failures.push(format!("metrics: family {name} only in pilot-agent's"));
            }
            continue;
        };
        if mine.len() != 1 {
            failures.push(format!(
                "metrics: meshagent writes {name} in {} blocks",
                mine.len()
            ));
            continue;
        }
        let want = shape(name, expected_family(blocks));
        let mut mine = mine[0].clone();
        if NOT_RECORDED_IN_ISTIO.contains(&name.as_str()) {
            // Istio writes only the series it recorded (e.g. one termination type); meshagent
            // writes every series from the start.
            mine.samples
                .retain(|k, _| blocks[0].samples.contains_key(k));
        }
        let got = shape(name, &mine);
        if want != got {
            failures.push(format!(
                "metrics: family {name}\n  expected {want}\n  meshagent {got}"
            ));
        }
    }
    if !go_seen {
        failures.push(
            "metrics: pilot-agent wrote no istio_agent_go_* family: update COMPAT.md's row".into(),
        );
    }
    // (Whether either agent recorded something in these families depends on the run:
    // retries, reconnects. Their presence is what is compared.)
    let mut not_recorded_seen = false;
    for name in m.keys().filter(|n| !p.contains_key(*n)) {
        if NOT_RECORDED_IN_ISTIO.contains(&name.as_str()) {
            not_recorded_seen = true;
        } else if !MESHAGENT_ONLY.contains(&name.as_str()) {
            failures.push(format!("metrics: family {name} only in meshagent's"));
        }
    }
    if !not_recorded_seen {
        failures.push(
            "metrics: pilot-agent wrote every family meshagent writes at 0: update COMPAT.md's \
             row \"agent metric families with nothing recorded yet\""
                .into(),
        );
    }
    for name in MESHAGENT_ONLY {
        if !m.contains_key(*name) {
            failures.push(format!(
                "metrics: {name} is listed as meshagent's own but not written"
            ));
        }
        if p.contains_key(*name) {
            failures.push(format!(
                "metrics: {name} is listed as meshagent's own but pilot-agent writes it"
            ));
        }
    }
    // The deduplication row holds: the app's envoy_server_live follows Envoy's in
    // pilot-agent's output.
    if p.get("envoy_server_live").map(Vec::len) != Some(2) {
        failures.push(format!(
            "metrics: pilot-agent's envoy_server_live is not in two blocks (Envoy's, the \
             app's): {:?}",
            p.get("envoy_server_live")
        ));
    }
    // Every app family merged, with the app's values.
    let app = prom::parse(APP_METRICS);
    for name in app.families.keys().filter(|n| n.starts_with("app_")) {
        let want = shape(name, &app.families[name][0]);
        for (who, fams) in [("pilot-agent", p), ("meshagent", m)] {
            let got = fams.get(name).map(|b| shape(name, &b[0]));
            if got.as_ref() != Some(&want) {
                failures.push(format!(
                    "metrics: {who}'s {name}: {got:?}, the app's {want}"
                ));
            }
        }
    }
}

/// The agent's families both write while not ready (istiod's xDS unreachable, the CA
/// unreachable): HELP, TYPE and label names (the values and label values depend on retries).
fn compare_not_ready_metrics(pilot: &Run, ours: &Run, failures: &mut Vec<String>) {
    for (i, case) in ["xds_unreachable", "ca_down"].iter().enumerate() {
        let (p, m) = (&pilot.not_ready[i].families, &ours.not_ready[i].families);
        let labels = |b: &[Block]| -> BTreeSet<Vec<String>> {
            b.iter()
                .flat_map(|b| b.samples.keys())
                .map(|(_, l)| l.keys().cloned().collect())
                .collect()
        };
        // Label names where both have series (a gauge of the certificate's expiry has none
        // until the certificate arrives, which these scrapes do not wait for).
        let meta = |name: &str, b: &[Block], other: &[Block]| {
            let (mine, theirs) = (labels(b), labels(other));
            let labels = if mine.is_empty() || theirs.is_empty() {
                None
            } else {
                Some(mine)
            };
            json!({
                "help": b.iter().flat_map(|b| &b.help).collect::<Vec<_>>(),
                "type": b.iter().flat_map(|b| &b.types).collect::<Vec<_>>(),
                "labels": labels,
                "name": name,
            })
        };
        // What each agent counted for the refused istiod connection, or the refused CSR.
        let counted = |e: &Exposition| -> BTreeSet<String> {
            [
                "istio_agent_istiod_connection_failures",
                "istio_agent_istiod_connection_terminations",
                "istio_agent_num_failed_outgoing_requests",
            ]
            .iter()
            .flat_map(|n| nonzero(e, n))
            .collect()
        };
        let (pc, mc) = (counted(&pilot.not_ready[i]), counted(&ours.not_ready[i]));
        let mut want = pc.clone();
        if *case == "xds_unreachable" {
            // COMPAT.md row "istiod unreachable, in the agent's counters": meshagent also
            // counts the failed connection in istiod_connection_failures.
            if pc
                .iter()
                .any(|s| s.starts_with("istio_agent_istiod_connection_failures"))
            {
                failures.push(format!(
                    "{case}: pilot-agent counted istiod_connection_failures ({pc:?}): update \
                     COMPAT.md's row"
                ));
            }
            want.insert("istio_agent_istiod_connection_failures{}".into());
        }
        if mc != want {
            failures.push(format!(
                "{case} counters: pilot-agent {pc:?}, meshagent {mc:?}, expected {want:?}"
            ));
        }
        for (name, blocks) in p.iter().filter(|(n, _)| n.starts_with("istio_agent_")) {
            if let Some(mine) = m.get(name) {
                let (want, got) = (meta(name, blocks, mine), meta(name, mine, blocks));
                if want != got {
                    failures.push(format!(
                        "{case} metrics: {name}\n  pilot-agent {want}\n  meshagent   {got}"
                    ));
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_port_matches_pilot_agent() {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    let peers = start_peers().await;
    // Both agents' cases at once: every case has its own agent, Envoy and ports.
    let (pilot, ours) = tokio::join!(
        run(&istiod, AgentKind::PilotAgent, &peers),
        run(&istiod, AgentKind::Meshagent, &peers)
    );
    let mut failures = Vec::new();
    let keys: BTreeSet<&String> = pilot.observed.keys().chain(ours.observed.keys()).collect();
    for k in keys {
        let (p, m) = (&pilot.observed[k], &ours.observed[k]);
        eprintln!("{k}:\n  pilot-agent {p}\n  meshagent   {m}");
        match expected_answer(k, &pilot.observed) {
            Ok(want) if answer_matches(&want, m) => {}
            Ok(want) => failures.push(format!(
                "{k}: pilot-agent {p}, meshagent {m}, expected meshagent {want}"
            )),
            Err(e) => failures.push(e),
        }
    }
    compare_metrics(&pilot, &ours, &mut failures);
    compare_not_ready_metrics(&pilot, &ours, &mut failures);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
