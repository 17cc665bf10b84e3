//! Differential: live pushes. The real pilot-agent and meshagent run side by side against one
//! istiod-box (two pods of the same workload, one address each, DNS capture on), and the
//! same configuration changes are applied while both are connected: a Service and a
//! ServiceEntry added, changed (a port and an address), deleted. After each step, once both
//! have settled, compared field by field:
//!
//! - **what each agent asked istiod for and ACKed**, as istiod itself records it: the
//!   resource names each connection watches per type (`/debug/adsz`, the names of the last
//!   request of each type), and per type whether the last nonce sent is the one ACKed and the
//!   error of the last NACK (`/debug/syncz`, `resources[type].lastError`: the request's
//!   `error_detail`);
//! - **Envoy's dynamic configuration** (`/config_dump`: clusters, listeners, routes, ECDS
//!   extension configs, secret names; testkit `istiod_box::dynamic_config`);
//! - **the NDS name table** each agent built (`/debug/ndsz` on its status port; pilot-agent
//!   serves it too, `pilot/cmd/pilot-agent/status/server.go`).
//!
//! Normalised, each with its reason: the pod's name, workload name and address (each agent is
//! its own pod, so istiod names them in connection ids, node metadata and inbound config);
//! each agent's own ports (status, admin, Envoy's readiness and Prometheus) and DNS proxy
//! address (`DNS_PROXY_ADDR` in the node metadata); the workload certificate itself (only
//! whether a step replaced it is compared); `version_info`/`last_updated` of dumped
//! resources (istiod's push time, each Envoy's clock); nonces and versions in `syncz` (each
//! connection's own; only "acked = sent" is compared); adsz's connection time and peer port.
//! Any other difference fails.
//!
//! ECDS: `wasm_plugin_pushes_match_pilot_agent` adds, changes and deletes a WasmPlugin whose
//! module a local HTTP server serves; each agent fetches it and rewrites the remote code to
//! its local file, so Envoy's ECDS section holds that file's path (each agent's working
//! directory is normalised to `/`, a pod's). Wire: `xds_requests_on_the_wire_match_pilot_agent`
//! compares the requests each agent sent on its stream (istiod-box `GET /streams` `messages`).
//!
//! PCDS: istiod only answers the ProxyConfig type with `ISTIO_MULTIROOT_MESH` on and a trust
//! bundle behind its generator (`pilot/pkg/xds/pcds.go`); istiod-box's `--multi-root-mesh`
//! wires both, and `PUT /trust-anchors` changes the bundle as meshConfig `caCertificates`
//! would. `pcds_trust_bundle_matches_pilot_agent` compares the `ROOTCA` each Envoy gets over
//! SDS (its certificates by name, in order) and whether the agent replaced the workload
//! certificate (pilot-agent does on every bundle change; meshagent does not, listed in
//! COMPAT.md).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod wasm_support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine as _;
use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, RunningPod, dynamic_config, envoy_config_dump,
    mesh_with_free_ports, start_agent,
};
use meshagent_testkit::{
    Sidecar, Value, free_port, http_get, http_with_body, json, json_diff, workspace_root,
};
use x509_parser::pem::Pem;

/// Until an agent is ready, or a step has reached both and settled.
const DEADLINE: Duration = Duration::from_secs(90);

/// Differences meshagent makes on purpose, in the PCDS test: (path prefix, COMPAT.md row).
/// Each must still show, and COMPAT.md must have its row.
const PCDS_DELIBERATE: &[(&str, &str)] =
    &[(".workload_cert_replaced", "a PCDS trust bundle change")];

/// Differences meshagent makes on purpose, in the WasmPlugin test.
const WASM_DELIBERATE: &[(&str, &str)] = &[];

/// The two pods: (agent, workload, address).
const PODS: [(AgentKind, &str, &str); 2] = [
    (AgentKind::PilotAgent, "pushp", "127.0.61.2"),
    (AgentKind::Meshagent, "pushm", "127.0.61.3"),
];

fn pods_yaml() -> String {
    let mut y = String::new();
    for (_, w, ip) in PODS {
        let name = format!("{w}-5f7d9");
        let pod = RunningPod {
            name: &name,
            namespace: "default",
            labels: &[("app", "client")],
            service_account: Some("client"),
            hostname: None,
            ips: &[ip],
        };
        y.push_str(&pod.yaml());
        y.push_str("\n---\n");
    }
    y
}

fn service(port: u16) -> String {
    format!(
        r#"apiVersion: v1
kind: Service
metadata:
  name: live
  namespace: default
spec:
  clusterIP: 10.96.7.7
  ports:
  - name: http
    port: {port}
"#
    )
}

fn service_entry(address: &str) -> String {
    format!(
        r#"apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata:
  name: pushed
  namespace: default
spec:
  hosts: [pushed.example.com]
  addresses: [{address}]
  location: MESH_EXTERNAL
  resolution: STATIC
  ports:
  - number: 443
    name: tls
    protocol: TLS
  endpoints:
  - address: 10.8.0.1
"#
    )
}

/// One step: what is applied (or deleted), and what both Envoys must hold (or lack) after it.
struct Step {
    name: &'static str,
    apply: Option<String>,
    delete: Option<String>,
    /// Cluster names that must be present.
    present: &'static [&'static str],
    /// Cluster names that must be gone.
    absent: &'static [&'static str],
    /// (NDS host, address) that must be in the table.
    nds: &'static [(&'static str, &'static str)],
    /// The roots Envoy's `ROOTCA` must hold, by name (see [`Roots`]), in any order; `None`:
    /// not checked (still compared).
    roots: Option<&'static [&'static str]>,
    /// Anything else both must show (e.g. an ECDS resource's content); `None`: nothing.
    check: Option<fn(&Value) -> bool>,
}

impl Step {
    /// Applies the step's change to istiod-box (each triggers istiod's push).
    async fn make(&self, istiod: &IstiodBox) {
        if let Some(y) = &self.apply {
            istiod.apply(y).await;
        }
        if let Some(y) = &self.delete {
            istiod.delete(y).await;
        }
    }
}

fn steps() -> Vec<Step> {
    vec![
        Step {
            name: "initial",
            apply: None,
            delete: None,
            present: &[],
            absent: &[],
            nds: &[],
            roots: None,
            check: None,
        },
        Step {
            name: "add Service and ServiceEntry",
            apply: Some(format!("{}---\n{}", service(80), service_entry("10.9.0.1"))),
            delete: None,
            present: &[
                "outbound|80||live.default.svc.cluster.local",
                "outbound|443||pushed.example.com",
            ],
            absent: &[],
            nds: &[
                ("live.default.svc.cluster.local", "10.96.7.7"),
                ("pushed.example.com", "10.9.0.1"),
            ],
            roots: None,
            check: None,
        },
        Step {
            name: "change port and address",
            apply: Some(format!(
                "{}---\n{}",
                service(8080),
                service_entry("10.9.0.2")
            )),
            delete: None,
            present: &[
                "outbound|8080||live.default.svc.cluster.local",
                "outbound|443||pushed.example.com",
            ],
            absent: &["outbound|80||live.default.svc.cluster.local"],
            nds: &[("pushed.example.com", "10.9.0.2")],
            roots: None,
            check: None,
        },
        Step {
            name: "delete both",
            apply: None,
            delete: Some(format!(
                "{}---\n{}",
                service(8080),
                service_entry("10.9.0.2")
            )),
            present: &[],
            absent: &[
                "outbound|8080||live.default.svc.cluster.local",
                "outbound|443||pushed.example.com",
            ],
            nds: &[],
            roots: None,
            check: None,
        },
    ]
}

struct Agent {
    kind: AgentKind,
    workload: &'static str,
    ip: &'static str,
    sc: Sidecar,
    prom: u16,
    /// The DNS proxy's address (`DNS_PROXY_ADDR`, sent in the node metadata).
    dns: String,
}

impl Agent {
    fn proxy_id(&self) -> String {
        format!("{}-5f7d9.default", self.workload)
    }

    /// Pod-specific values → their names, in place.
    fn normalise(&self, v: &mut Value) {
        // The pod name before the workload name it starts with.
        let subst: Vec<(String, String)> = vec![
            (format!("{}-5f7d9", self.workload), "<pod>".into()),
            (self.workload.to_owned(), "<workload>".into()),
            (self.ip.to_owned(), "<pod_ip>".into()),
            (self.dns.clone(), "<dns_proxy_addr>".into()),
            // Each agent's own working directory, as `/`: a pod's agent runs in `/` (Istio's
            // image), where meshagent's Wasm module directory `var/lib/istio/data` under its
            // working directory is pilot-agent's `/var/lib/istio/data`
            // (`pkg/config/constants` `IstioDataDir`).
            (self.sc.cwd.path().to_string_lossy().into_owned(), "".into()),
        ];
        let ports = [
            (self.sc.status.port(), "status_port"),
            (self.sc.admin.port(), "admin_port"),
            (self.sc.envoy_status.port(), "envoy_status_port"),
            (self.prom, "prometheus_port"),
        ];
        normalise(v, &subst, &ports);
    }

    fn logs(&self) -> String {
        format!("--- {:?} log ---\n{}", self.kind, self.sc.proc.log_text())
    }
}

fn normalise(v: &mut Value, subst: &[(String, String)], ports: &[(u16, &str)]) {
    match v {
        Value::String(s) => {
            for (from, to) in subst {
                if s.contains(from.as_str()) {
                    *s = s.replace(from.as_str(), to);
                }
            }
            for (p, name) in ports {
                let p = p.to_string();
                if s.contains(&p) {
                    *s = s.replace(&p, &format!("<{name}>"));
                }
            }
        }
        Value::Number(n) => {
            if let Some((_, name)) = ports
                .iter()
                .find(|(p, _)| n.as_u64() == Some(u64::from(*p)))
            {
                *v = Value::String(format!("<{name}>"));
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| normalise(x, subst, ports)),
        Value::Object(o) => {
            let old = std::mem::take(o);
            for (k, mut x) in old {
                normalise(&mut x, subst, ports);
                let mut k = Value::String(k);
                normalise(&mut k, subst, &[]);
                o.insert(k.as_str().unwrap().to_owned(), x);
            }
        }
        _ => {}
    }
}

/// Known roots by DER, to name the certificates of Envoy's `ROOTCA` secret.
struct Roots(Vec<(Vec<u8>, &'static str)>);

impl Roots {
    fn named(pems: &[(&[u8], &'static str)]) -> Roots {
        let mut out = Vec::new();
        for (pem, name) in pems {
            for p in Pem::iter_from_buffer(pem) {
                out.push((p.expect("PEM block").contents, *name));
            }
        }
        Roots(out)
    }

    /// The certificates of `ROOTCA`'s `trusted_ca` in Envoy's dump, in order, by name
    /// (`<unknown>` for one not known, `<bad PEM>` for an unreadable block).
    fn rootca(&self, dump: &Value) -> Value {
        let b64 = base64::engine::general_purpose::STANDARD;
        for cfg in dump["configs"].as_array().into_iter().flatten() {
            for s in cfg["dynamic_active_secrets"]
                .as_array()
                .into_iter()
                .flatten()
            {
                if s["name"] != "ROOTCA" {
                    continue;
                }
                let inline = &s["secret"]["validation_context"]["trusted_ca"]["inline_bytes"];
                let bytes = b64
                    .decode(inline.as_str().unwrap_or(""))
                    .unwrap_or_default();
                let names: Vec<&str> = Pem::iter_from_buffer(&bytes)
                    .map(|p| match p {
                        Ok(p) => self
                            .0
                            .iter()
                            .find(|(der, _)| *der == p.contents)
                            .map_or("<unknown>", |(_, n)| n),
                        Err(_) => "<bad PEM>",
                    })
                    .collect();
                return json!(names);
            }
        }
        Value::Null
    }
}

/// The certificate chain of the `default` secret in Envoy's dump, as dumped (base64): which
/// workload certificate Envoy holds.
fn default_cert(dump: &Value) -> Value {
    for cfg in dump["configs"].as_array().into_iter().flatten() {
        for s in cfg["dynamic_active_secrets"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if s["name"] == "default" {
                return s["secret"]["tls_certificate"]["certificate_chain"]["inline_bytes"].clone();
            }
        }
    }
    Value::Null
}

/// A new self-signed CA certificate (PEM): another mesh's root, for PCDS.
fn other_root() -> String {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, "other mesh");
    params.self_signed(&key).unwrap().pem()
}

/// istiod's view of one agent's requests: per type, the watched names, whether the last
/// nonce sent is ACKed, and the last NACK's error. `None` while the proxy is not listed.
fn upstream_view(a: &Agent, adsz: &Value, syncz: &Value) -> Option<Value> {
    let id = a.proxy_id();
    let client = adsz["clients"].as_array()?.iter().find(|c| {
        c["connectionId"]
            .as_str()
            .is_some_and(|c| c.starts_with(&format!("{id}-")))
    })?;
    let sync = syncz
        .as_array()?
        .iter()
        .find(|s| s["proxy"].as_str() == Some(id.as_str()))?;
    let mut types = BTreeMap::new();
    let watches = client["watches"].as_object()?;
    for (ty, names) in watches {
        let mut names: Vec<String> = names
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect();
        names.sort();
        let r = &sync["resources"][ty];
        types.insert(
            ty.clone(),
            json!({
                "names": names,
                "acked": r["sent"].is_string() && r["sent"] == r["acked"],
                "last_error": r["lastError"],
            }),
        );
    }
    let mut v =
        json!({ "types": types, "metadata": client["metadata"], "labels": client["labels"] });
    a.normalise(&mut v);
    Some(v)
}

/// Everything compared for one agent at one moment.
async fn observe(a: &Agent, adsz: &Value, syncz: &Value, roots: &Roots) -> Option<Value> {
    let dump = envoy_config_dump(&a.sc).await?;
    let rootca = roots.rootca(&dump);
    let default_cert = default_cert(&dump);
    let (code, body) = http_get(a.sc.status, "/debug/ndsz").await.ok()?;
    let ndsz = json!({ "code": code, "body": serde_json::from_str::<Value>(&body).ok()? });
    let mut v = json!({
        "upstream": upstream_view(a, adsz, syncz)?,
        "envoy_config": dynamic_config(&dump),
        "ndsz": ndsz,
        "rootca": rootca,
        "default_cert": default_cert,
    });
    a.normalise(&mut v);
    Some(v)
}

/// Whether `v` shows what `step` expects.
fn reached(v: &Value, step: &Step) -> bool {
    let cluster = |n: &str| {
        v["envoy_config"]
            .as_object()
            .unwrap()
            .keys()
            .any(|k| k == &format!("ClustersConfigDump/dynamic_active_clusters/{n}"))
    };
    let types = v["upstream"]["types"].as_object().unwrap();
    step.present.iter().all(|n| cluster(n))
        && step.absent.iter().all(|n| !cluster(n))
        && step.nds.iter().all(|(h, ip)| {
            v["ndsz"]["body"]["table"][*h]["ips"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == ip))
        })
        && v["ndsz"]["code"] == 200
        && step.roots.is_none_or(|want| {
            let mut have: Vec<&str> = v["rootca"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let mut want = want.to_vec();
            have.sort_unstable();
            want.sort_unstable();
            have == want
        })
        && step.check.is_none_or(|check| check(v))
        && !types.is_empty()
        // Every type answered: the last response ACKed, or NACKed (its error is compared).
        && types
            .values()
            .all(|t| t["acked"] == true || t["last_error"].as_str().is_some_and(|e| !e.is_empty()))
}

/// Polls until both agents show `step` and their observations are unchanged a second apart.
async fn settle(istiod: &IstiodBox, agents: &[Agent], step: &Step, roots: &Roots) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut prev: Option<Vec<Value>> = None;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let adsz = istiod.debug_json("/debug/adsz").await;
        let syncz = istiod.debug_json("/debug/syncz").await;
        let mut now = Vec::new();
        for a in agents {
            match observe(a, &adsz, &syncz, roots).await {
                Some(v) if reached(&v, step) => now.push(v),
                _ => break,
            }
        }
        if now.len() == agents.len() {
            if prev.as_ref() == Some(&now) {
                return now;
            }
            prev = Some(now);
        } else {
            prev = None;
        }
        if tokio::time::Instant::now() > deadline {
            let logs: Vec<String> = agents.iter().map(Agent::logs).collect();
            panic!(
                "step {:?} not reached and settled by both agents within {DEADLINE:?}\nlast: {prev:#?}\nadsz: {adsz:#}\nsyncz: {syncz:#}\n{}\n--- istiod-box log ---\n{}",
                step.name,
                logs.join("\n"),
                istiod.proc.log_text()
            );
        }
    }
}

/// Starts both agents side by side against `istiod` with `extra_env`, waits for both to be
/// ready.
async fn start_agents(istiod: &IstiodBox, extra_env: &[(&str, &str)]) -> Vec<Agent> {
    let mut agents = Vec::new();
    for (kind, workload, ip) in PODS {
        let prom = free_port();
        let prom_s = prom.to_string();
        let dns = SocketAddr::from(([127, 0, 0, 1], free_port())).to_string();
        let mut env = vec![
            ("ENVOY_PROMETHEUS_PORT", prom_s.as_str()),
            ("ISTIO_META_DNS_CAPTURE", "true"),
            ("ISTIO_META_DNS_AUTO_ALLOCATE", "true"),
            ("DNS_PROXY_ADDR", dns.as_str()),
        ];
        env.extend_from_slice(extra_env);
        let pod = PodSpec {
            workload,
            namespace: "default",
            service_account: "client",
            ip,
            proxy_config: json!({}),
            env: &env,
        };
        let sc = start_agent(istiod, kind, &pod).await;
        agents.push(Agent {
            kind,
            workload,
            ip,
            sc,
            prom,
            dns,
        });
    }
    for a in &agents {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !matches!(http_get(a.sc.status, "/healthz/ready").await, Ok((200, _))) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{:?} not ready within {DEADLINE:?}\n{}",
                a.kind,
                a.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    agents
}

/// Runs `steps` (each: its change, then `before_settle`'s) against both agents, and fails
/// with every difference and both agents' logs.
async fn run_steps(
    istiod: &IstiodBox,
    agents: &[Agent],
    steps: &[Step],
    roots: &Roots,
    trust_anchors: &[Option<String>],
    deliberate: &[(&str, &'static str)],
) {
    let compat = std::fs::read_to_string(workspace_root().join("COMPAT.md")).unwrap();
    for (_, row) in deliberate {
        assert!(
            compat.contains(&format!("\n| {row} |")),
            "COMPAT.md has no row {row:?}"
        );
    }
    let mut seen_rows = std::collections::BTreeSet::new();
    let started = tokio::time::Instant::now();
    let mut unexpected = Vec::new();
    let mut listed = Vec::new();
    // Each agent's workload certificate after the previous step.
    let mut certs: Vec<Value> = vec![Value::Null; agents.len()];
    for (i, step) in steps.iter().enumerate() {
        step.make(istiod).await;
        if let Some(Some(pem)) = trust_anchors.get(i) {
            let (code, body) = http_with_body("PUT", istiod.http, "/trust-anchors", pem.as_bytes())
                .await
                .unwrap();
            assert_eq!(code, 200, "PUT /trust-anchors: {body}");
        }
        let mut seen = settle(istiod, agents, step, roots).await;
        // The certificate itself is each pod's own; whether the step made the agent replace
        // it is compared (not known for the first step).
        for (v, prev) in seen.iter_mut().zip(certs.iter_mut()) {
            let cert = v.as_object_mut().unwrap().remove("default_cert").unwrap();
            if i > 0 {
                v["workload_cert_replaced"] = json!(cert != *prev);
            }
            *prev = cert;
        }
        if std::env::var_os("COMPAT_PUSHES_SHOW").is_some() {
            eprintln!("{}: pilot-agent: {:#}", step.name, seen[0]);
        }
        for (path, p, m) in json_diff(&seen[0], &seen[1]) {
            let line = format!(
                "after {:?}: {path}: pilot-agent {p} | meshagent {m}",
                step.name
            );
            match deliberate
                .iter()
                .find(|(prefix, _)| path.starts_with(prefix))
            {
                Some((_, row)) => {
                    seen_rows.insert(*row);
                    listed.push(format!("{line} (COMPAT.md: {row})"));
                }
                None => unexpected.push(line),
            }
        }
    }
    eprintln!(
        "{} steps compared in {:?}; listed differences:\n{}",
        steps.len(),
        started.elapsed(),
        listed.join("\n")
    );
    let gone: Vec<&str> = deliberate
        .iter()
        .map(|(_, row)| *row)
        .filter(|row| !seen_rows.contains(row))
        .collect();
    if !gone.is_empty() {
        unexpected.push(format!(
            "listed in COMPAT.md but no step shows it any more: {gone:?}"
        ));
    }
    if !unexpected.is_empty() {
        let logs: Vec<String> = agents.iter().map(Agent::logs).collect();
        panic!(
            "{} differences:\n{}\n{}",
            unexpected.len(),
            unexpected.join("\n"),
            logs.join("\n")
        );
    }
}

async fn istiod_root(istiod: &IstiodBox) -> String {
    let (code, pem) = http_get(istiod.http, "/root-cert").await.unwrap();
    assert_eq!(code, 200, "GET /root-cert: {pem}");
    pem
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_pushes_match_pilot_agent() {
    let mesh = mesh_with_free_ports();
    let istiod =
        IstiodBox::start_with(&pods_yaml(), Some(&mesh), &["--legacy-ip-autoallocate"]).await;
    let root = istiod_root(&istiod).await;
    let roots = Roots::named(&[(root.as_bytes(), "istiod_root")]);
    let agents = start_agents(&istiod, &[]).await;
    run_steps(&istiod, &agents, &steps(), &roots, &[], &[]).await;
}

/// PCDS: istiod-box with `--multi-root-mesh` serves the ProxyConfig type with its trust bundle
/// (its CA root, plus the anchors `PUT /trust-anchors` sets, istiod's meshConfig
/// `caCertificates`); both agents subscribe (`PROXY_CONFIG_XDS_AGENT`) and merge it into the
/// `ROOTCA` Envoy gets over SDS. Another mesh's root is added, then removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pcds_trust_bundle_matches_pilot_agent() {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(
        &pods_yaml(),
        Some(&mesh),
        &["--legacy-ip-autoallocate", "--multi-root-mesh"],
    )
    .await;
    let root = istiod_root(&istiod).await;
    let other = other_root();
    let roots = Roots::named(&[
        (root.as_bytes(), "istiod_root"),
        (other.as_bytes(), "other_root"),
    ]);
    let agents = start_agents(&istiod, &[("PROXY_CONFIG_XDS_AGENT", "true")]).await;
    let step = |name, roots| Step {
        name,
        apply: None,
        delete: None,
        present: &[],
        absent: &[],
        nds: &[],
        roots: Some(roots),
        check: None,
    };
    let steps = [
        step("initial", &["istiod_root"]),
        step("another mesh's root added", &["istiod_root", "other_root"]),
        step("another mesh's root removed", &["istiod_root"]),
    ];
    let anchors = [None, Some(other.clone()), Some(String::new())];
    run_steps(&istiod, &agents, &steps, &roots, &anchors, PCDS_DELIBERATE).await;
}

/// A WasmPlugin `hdr` for the pods (label `app: client`), its module at `url`, with
/// `pluginConfig` `{value: <value>}`.
fn wasm_plugin(url: &str, sha256: &str, value: &str) -> String {
    format!(
        r#"apiVersion: extensions.istio.io/v1alpha1
kind: WasmPlugin
metadata:
  name: hdr
  namespace: default
spec:
  selector:
    matchLabels:
      app: client
  url: {url}
  sha256: {sha256}
  phase: AUTHN
  pluginConfig:
    value: {value}
"#
    )
}

/// The ECDS resources (extension configs) in an observation, serialised, by key.
fn ecds_entries(v: &Value) -> Vec<(String, String)> {
    v["envoy_config"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("EcdsConfigDump/"))
        .map(|(k, b)| (k.clone(), b.to_string()))
        .collect()
}

/// Whether Envoy holds the plugin's extension config with `value` in its configuration.
fn has_plugin_with(v: &Value, value: &str) -> bool {
    ecds_entries(v)
        .iter()
        .any(|(k, b)| k.contains("hdr") && b.contains(value))
}

/// Whether no listener references the plugin any more.
fn plugin_unreferenced(v: &Value) -> bool {
    v["envoy_config"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| k.starts_with("ListenersConfigDump/"))
        .all(|(_, b)| !b.to_string().contains("default.hdr"))
}

/// ECDS after live pushes: a WasmPlugin added, its `pluginConfig` changed, then deleted while
/// both agents are connected. Envoy's ECDS section (the extension config each agent forwarded,
/// its remote module rewritten to the local file it fetched from the test's HTTP server), the
/// listeners referencing it, and what each agent ACKed or NACKed upstream (istiod's adsz and
/// syncz) are compared as in the other steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasm_plugin_pushes_match_pilot_agent() {
    // pilot-agent keeps fetched modules in `/var/lib/istio/data` (`pkg/istio-agent/xds_proxy.go`
    // `NewLocalFileCache(constants.IstioDataDir)`), a volume (`istio-data`) every injected pod
    // has; without it pilot-agent cannot cache and gives Envoy its deny-all RBAC stand-in. The
    // cache is keyed by URL and checksum, so runs side by side share it safely.
    std::fs::create_dir_all("/var/lib/istio/data").unwrap();
    let module = wasm_support::module();
    let sha = wasm_support::sha256_hex(&module);
    let server = wasm_support::ModServer::start().await;
    server.route("/hdr.wasm", wasm_support::Behaviour::Serve(module));
    let url = server.url("/hdr.wasm");
    let mesh = mesh_with_free_ports();
    let istiod =
        IstiodBox::start_with(&pods_yaml(), Some(&mesh), &["--legacy-ip-autoallocate"]).await;
    let root = istiod_root(&istiod).await;
    let roots = Roots::named(&[(root.as_bytes(), "istiod_root")]);
    let agents = start_agents(&istiod, &[]).await;
    let step = |name, apply: Option<String>, delete: Option<String>, check| Step {
        name,
        apply,
        delete,
        present: &[],
        absent: &[],
        nds: &[],
        roots: None,
        check: Some(check),
    };
    let steps = [
        step("initial", None, None, |v: &Value| {
            ecds_entries(v).is_empty()
        }),
        step(
            "WasmPlugin added",
            Some(wasm_plugin(&url, &sha, "first")),
            None,
            |v: &Value| has_plugin_with(v, "first"),
        ),
        step(
            "WasmPlugin pluginConfig changed",
            Some(wasm_plugin(&url, &sha, "second")),
            None,
            |v: &Value| has_plugin_with(v, "second") && !has_plugin_with(v, "first"),
        ),
        step(
            "WasmPlugin deleted",
            None,
            Some(wasm_plugin(&url, &sha, "second")),
            plugin_unreferenced,
        ),
    ];
    run_steps(&istiod, &agents, &steps, &roots, &[], WASM_DELIBERATE).await;
    // Both fetched the module (each caches it: one fetch per agent at most per change).
    assert!(
        server.hits("/hdr.wasm") >= 2,
        "the module server saw {} fetches",
        server.hits("/hdr.wasm")
    );
}

/// One agent's xDS stream as istiod-box recorded it (`GET /streams`), by its node id.
fn agent_stream<'a>(a: &Agent, streams: &'a [Value]) -> Vec<&'a Value> {
    let id = a.proxy_id();
    streams
        .iter()
        .filter(|s| s["node"]["id"].as_str().is_some_and(|n| n.contains(&id)))
        .collect()
}

/// The requests an agent sent on one stream, normalised: per type URL, in order, each request
/// as its kind (`initial`: no response nonce; `ack`; `nack`: with `error_detail`), which
/// response it answers (`latest`: the last one istiod sent of that type before it; `older`;
/// `unknown`: a nonce istiod never sent), whether its version is that response's, the resource
/// names it (un)subscribes, whether it carries the node, and the error. Nonces and versions
/// themselves are istiod's (random, a timestamp) and are not compared; consecutive equal
/// entries are collapsed (how many pushes istiod's debounce makes of one change is timing).
fn wire_requests(stream: &Value) -> Value {
    let mut sent: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut per_type: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for m in stream["messages"].as_array().into_iter().flatten() {
        let ty = m["type_url"].as_str().unwrap_or("").to_owned();
        let field = |k: &str| m[k].as_str().unwrap_or("").to_owned();
        if m["dir"] == "send" {
            sent.entry(ty)
                .or_default()
                .push((field("nonce"), field("version_info")));
            continue;
        }
        let nonce = field("response_nonce");
        let responses = sent.get(&ty).map(Vec::as_slice).unwrap_or_default();
        let answered = responses.iter().position(|(n, _)| *n == nonce);
        let kind = if nonce.is_empty() {
            "initial"
        } else if field("error_detail").is_empty() {
            "ack"
        } else {
            "nack"
        };
        let answers = match answered {
            _ if nonce.is_empty() => "none",
            Some(i) if i + 1 == responses.len() => "latest",
            Some(_) => "older",
            None => "unknown",
        };
        let version = field("version_info");
        let version = match answered {
            _ if version.is_empty() => "empty",
            Some(i) if responses[i].1 == version => "the answered response's",
            _ => "another",
        };
        let sorted = |k: &str| {
            let mut v: Vec<&str> = m[k]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            v.sort_unstable();
            json!(v)
        };
        let entry = json!({
            "kind": kind,
            "answers": answers,
            "version": version,
            "delta": m["delta"],
            "has_node": m["has_node"].as_bool().unwrap_or(false),
            "resource_names": sorted("resource_names"),
            "unsubscribe": sorted("unsubscribe"),
            "initial_resources": sorted("initial_resources"),
            "error_detail": m["error_detail"].as_str().unwrap_or(""),
        });
        let seq = per_type.entry(ty).or_default();
        if seq.last() != Some(&entry) {
            seq.push(entry);
        }
    }
    json!(per_type)
}

/// Per-request wire recording: istiod-box records every request each agent sends upstream on
/// its xDS stream (and istiod's responses, to map nonces and versions); after both agents
/// start, and after a push (a Service and a ServiceEntry added) has been ACKed, the request
/// sequences per type are compared (see [`wire_requests`]), with the stream's gRPC method,
/// headers (`authorization`'s scheme, `ClusterID`, ...; gRPC library headers ignored as in
/// `compat_xds`), client certificate presence, the first request's type and the node of the
/// first request (normalised like every other observation here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xds_requests_on_the_wire_match_pilot_agent() {
    let mesh = mesh_with_free_ports();
    let istiod =
        IstiodBox::start_with(&pods_yaml(), Some(&mesh), &["--legacy-ip-autoallocate"]).await;
    let root = istiod_root(&istiod).await;
    let roots = Roots::named(&[(root.as_bytes(), "istiod_root")]);
    let agents = start_agents(&istiod, &[]).await;
    let mut steps = steps();
    steps.truncate(2);
    // Started and settled, then a push applied and ACKed by both.
    for step in &steps {
        step.make(&istiod).await;
        settle(&istiod, &agents, step, &roots).await;
    }
    let (code, body) = http_get(istiod.http, "/streams").await.unwrap();
    assert_eq!(code, 200, "GET /streams: {body}");
    let streams: Vec<Value> = serde_json::from_str(&body).unwrap();
    let mut seen = Vec::new();
    for a in &agents {
        let mine = agent_stream(a, &streams);
        let mut v = json!({
            "streams": mine.iter().map(|s| json!({
                "method": s["method"],
                "headers": meshagent_testkit::istiod_box::recorded_headers(s),
                "client_cert": s["client_cert"],
                "first_type": s["type_url"],
                "node": s["node"],
                "dropped": s["dropped"],
                "requests": wire_requests(s),
            })).collect::<Vec<_>>(),
        });
        a.normalise(&mut v);
        let requests = v["streams"][0]["requests"]
            .as_object()
            .map_or(0, |o| o.len());
        assert!(
            requests >= 3,
            "{:?}: fewer than 3 types requested on its stream: {v:#}\n{}",
            a.kind,
            a.logs()
        );
        seen.push(v);
    }
    if std::env::var_os("COMPAT_PUSHES_SHOW").is_some() {
        eprintln!("pilot-agent: {:#}", seen[0]);
    }
    let diffs: Vec<String> = json_diff(&seen[0], &seen[1])
        .into_iter()
        .map(|(path, p, m)| format!("{path}: pilot-agent {p} | meshagent {m}"))
        .collect();
    assert!(
        diffs.is_empty(),
        "{} differences:\n{}\n{}",
        diffs.len(),
        diffs.join("\n"),
        agents
            .iter()
            .map(Agent::logs)
            .collect::<Vec<_>>()
            .join("\n")
    );
}
