//! Differential: the workload identity each agent obtains, the real pilot-agent beside
//! meshagent, each run as a pod runs it against istiod-box (Istio's CA and authenticators)
//! with a real Envoy (testkit `start_agent`). For every case (key type and size, PKCS#8,
//! certificate TTL, OUTPUT_CERTS) and both agents, compared:
//!
//! - **the CSRs sent to the CA** until Envoy holds its certificates, as istiod-box's CA
//!   received them (`GET /csrs`, compat/istiod-box/csrs.go): subject, public key (algorithm,
//!   size, curve), signature algorithm, the requested extensions (OID, criticality, SANs as
//!   names, other values as bytes), other attributes; the request's `validity_duration` and
//!   metadata; the gRPC request headers; whether a client certificate was presented; the CA's
//!   answer;
//! - **the SDS resources Envoy ends with** (its `/config_dump`, secrets): names, which kind
//!   (certificate or validation context), every certificate of a chain or bundle described
//!   (subject, issuer, SANs, key, lifetime, extensions), the private key redacted, the
//!   bundle equal to istiod-box's root;
//! - **the OUTPUT_CERTS files**: names, modes, the PEM blocks of each (labels and the
//!   certificates described as above).
//!
//! `rotation_timing_matches_istio_rule` checks when each agent renews a short-lived
//! certificate against Istio's rotation rule (see its doc).
//!
//! Ignored as volatile, each with its reason: serial numbers, signatures, key and
//! public-key bytes, validity instants (each run's keys and times differ; the lifetime is
//! compared); `version_info`/`last_updated` of secrets (set by each agent's SDS server at its
//! own time); the `user-agent`, `grpc-accept-encoding`, `grpc-timeout` and `te` request
//! headers (the gRPC library's, grpc-go against tonic; no CA reads them). Where meshagent
//! differs on purpose (COMPAT.md, "Deliberate differences") the difference is listed in
//! `DELIBERATE` with that row's reason; any other difference fails.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, envoy_config_dump, mesh_with_free_ports, recorded_headers,
    start_agent, workload_a,
};
use meshagent_testkit::{Value, http, http_get, json, json_diff, wait_for};
use x509_parser::pem::{Pem, parse_x509_pem};
use x509_parser::prelude::*;

const READY: Duration = Duration::from_secs(60);

/// Differences meshagent makes on purpose: (case or `*`, path prefix, COMPAT.md row).
const DELIBERATE: &[(&str, &str, &str)] = &[];

struct Case {
    name: &'static str,
    env: &'static [(&'static str, &'static str)],
}

const CASES: &[Case] = &[
    Case {
        name: "default_rsa",
        env: &[],
    },
    Case {
        name: "rsa_4096",
        env: &[("WORKLOAD_RSA_KEY_SIZE", "4096")],
    },
    Case {
        name: "ecdsa_p256",
        env: &[("ECC_SIGNATURE_ALGORITHM", "ECDSA")],
    },
    Case {
        name: "ecdsa_p384",
        env: &[("ECC_SIGNATURE_ALGORITHM", "ECDSA"), ("ECC_CURVE", "P384")],
    },
    Case {
        name: "secret_ttl_12h",
        env: &[("SECRET_TTL", "12h")],
    },
    Case {
        name: "output_certs_rsa",
        env: &[("OUTPUT_CERTS", "<dir>")],
    },
    Case {
        name: "output_certs_pkcs8",
        env: &[("OUTPUT_CERTS", "<dir>"), ("PKCS8_KEY", "true")],
    },
    Case {
        name: "output_certs_ecdsa",
        env: &[
            ("OUTPUT_CERTS", "<dir>"),
            ("ECC_SIGNATURE_ALGORITHM", "ECDSA"),
        ],
    },
];

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A public key: algorithm OID, size in bits, and the parameters' OID (the EC curve).
fn describe_spki(spki: &SubjectPublicKeyInfo<'_>) -> Value {
    let params = spki
        .algorithm
        .parameters
        .as_ref()
        .and_then(|p| p.as_oid().ok())
        .map(|o| o.to_id_string());
    json!({
        "algorithm": spki.algorithm.algorithm.to_id_string(),
        "bits": spki.parsed().map(|k| k.key_size()).unwrap_or(0),
        "parameters": params,
    })
}

/// One extension: its OID and criticality; SANs as names, anything else as its bytes.
fn describe_extension(e: &X509Extension<'_>) -> Value {
    let value = match e.parsed_extension() {
        ParsedExtension::SubjectAlternativeName(san) => json!(
            san.general_names
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        ),
        _ => json!(hex(e.value)),
    };
    json!({"oid": e.oid.to_id_string(), "critical": e.critical, "value": value})
}

fn describe_csr(pem_text: &str) -> Value {
    let (_, pem) = parse_x509_pem(pem_text.as_bytes()).expect("CSR PEM");
    let (_, csr) = X509CertificationRequest::from_der(&pem.contents).expect("CSR DER");
    let info = &csr.certification_request_info;
    let mut extensions = Vec::new();
    let mut attributes = Vec::new();
    for a in info.attributes() {
        match a.parsed_attribute() {
            ParsedCriAttribute::ExtensionRequest(r) => {
                extensions.extend(r.extensions.iter().map(describe_extension));
            }
            _ => attributes.push(json!({"oid": a.oid.to_id_string(), "value": hex(a.value)})),
        }
    }
    json!({
        "pem_label": pem.label,
        "version": info.version.0,
        "subject": info.subject.to_string(),
        // The encoding too (string types, empty attributes), not only the printed form.
        "subject_der": hex(info.subject.as_raw()),
        "public_key": describe_spki(&info.subject_pki),
        "signature_algorithm": csr.signature_algorithm.algorithm.to_id_string(),
        "extensions": extensions,
        "attributes": attributes,
    })
}

/// A certificate, without what differs between any two issuances (serial, key, signature,
/// instants); `root` is istiod-box's root certificate (DER), to say whether this is it.
fn describe_cert(der: &[u8], root: &[u8]) -> Value {
    let (_, c) = X509Certificate::from_der(der).expect("certificate DER");
    let v = c.validity();
    json!({
        "subject": c.subject().to_string(),
        "issuer": c.issuer().to_string(),
        "public_key": describe_spki(c.public_key()),
        "signature_algorithm": c.signature_algorithm.algorithm.to_id_string(),
        "lifetime_s": v.not_after.timestamp() - v.not_before.timestamp(),
        "is_ca": c.is_ca(),
        "extensions": c.extensions().iter().map(|e| {
            // Key identifiers are hashes of each run's keys.
            let volatile = e.oid == x509_parser::oid_registry::OID_X509_EXT_SUBJECT_KEY_IDENTIFIER
                || e.oid == x509_parser::oid_registry::OID_X509_EXT_AUTHORITY_KEY_IDENTIFIER;
            if volatile {
                json!({"oid": e.oid.to_id_string(), "critical": e.critical})
            } else {
                describe_extension(e)
            }
        }).collect::<Vec<_>>(),
        "is_istiod_box_root": der == root,
    })
}

/// The PEM blocks of `text`: labels, certificates described.
fn describe_pem_blocks(text: &[u8], root: &[u8]) -> Value {
    let mut out = Vec::new();
    for pem in Pem::iter_from_buffer(text) {
        let pem = pem.expect("PEM block");
        if pem.label == "CERTIFICATE" {
            out.push(
                json!({"label": pem.label, "certificate": describe_cert(&pem.contents, root)}),
            );
        } else {
            out.push(json!({"label": pem.label}));
        }
    }
    json!(out)
}

/// The secrets of Envoy's `/config_dump`, by name.
fn describe_secrets(dump: &Value, root: &[u8]) -> BTreeMap<String, Value> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = BTreeMap::new();
    for cfg in dump["configs"].as_array().into_iter().flatten() {
        if !cfg["@type"]
            .as_str()
            .unwrap_or("")
            .ends_with("SecretsConfigDump")
        {
            continue;
        }
        for s in cfg["dynamic_active_secrets"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let name = s["name"].as_str().unwrap_or("").to_owned();
            let secret = &s["secret"];
            let bytes = |v: &Value| b64.decode(v.as_str().unwrap_or("")).unwrap_or_default();
            let desc = if let Some(tls) = secret.get("tls_certificate") {
                json!({
                    "kind": "tls_certificate",
                    "certificate_chain": describe_pem_blocks(&bytes(&tls["certificate_chain"]["inline_bytes"]), root),
                    // Envoy redacts keys in dumps; anything else would be a leak.
                    "private_key": String::from_utf8_lossy(&bytes(&tls["private_key"]["inline_bytes"])),
                    "fields": tls.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()),
                })
            } else if let Some(vc) = secret.get("validation_context") {
                json!({
                    "kind": "validation_context",
                    "trusted_ca": describe_pem_blocks(&bytes(&vc["trusted_ca"]["inline_bytes"]), root),
                    "fields": vc.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()),
                })
            } else {
                json!({"kind": "other", "secret": secret})
            };
            out.insert(name, desc);
        }
    }
    out
}

/// The OUTPUT_CERTS directory: its mode and, per visible file, mode and PEM blocks.
/// meshagent publishes the set as the kubelet does (COMPAT.md, "OUTPUT_CERTS written"): a
/// `..<ts>` generation and a `..data` link beside the names, which are links into it. Names
/// starting with `..` are that mechanism and are not compared; modes are the targets'.
fn describe_output(dir: &Path, root: &[u8]) -> Value {
    let mut files = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("..") {
            continue;
        }
        let path = e.path();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
        let text = std::fs::read(&path).unwrap();
        files.insert(
            name,
            json!({"mode": format!("{mode:o}"), "pem": describe_pem_blocks(&text, root)}),
        );
    }
    let dir_mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o7777;
    json!({"dir_mode": format!("{dir_mode:o}"), "files": files})
}

fn describe_request(r: &Value) -> Value {
    let headers = recorded_headers(r);
    json!({
        "csr": describe_csr(r["csr"].as_str().unwrap()),
        "validity_duration": r["validity_duration"],
        "metadata": r["metadata"],
        "headers": headers,
        "client_cert": r["client_cert"],
        "code": r["code"],
    })
}

/// What one agent obtained in one case.
async fn observe(istiod: &IstiodBox, kind: AgentKind, case: &Case, root: &[u8]) -> Value {
    let (code, _) = http("DELETE", istiod.http, "/csrs").await.unwrap();
    assert_eq!(code, 204, "DELETE /csrs");
    // OUTPUT_CERTS is a volume in a pod (an emptyDir): it exists before the agent starts, and
    // Istio writes into it without creating it (security/pkg/nodeagent/util/util.go).
    let out_dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(out_dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let out_path = out_dir.path().to_str().unwrap().to_owned();
    let env: Vec<(&str, &str)> = case
        .env
        .iter()
        .map(|&(k, v)| {
            if k == "OUTPUT_CERTS" {
                (k, out_path.as_str())
            } else {
                (k, v)
            }
        })
        .collect();
    let pod = PodSpec {
        env: &env,
        ..PodSpec::new("a", "127.0.0.1")
    };
    let sc = start_agent(istiod, kind, &pod).await;
    let secrets = wait_for(
        &format!(
            "{kind:?} {}: Envoy to hold `default` and `ROOTCA`",
            case.name
        ),
        READY,
        || async {
            let dump = envoy_config_dump(&sc).await?;
            let s = describe_secrets(&dump, root);
            (s.contains_key("default") && s.contains_key("ROOTCA")).then_some(s)
        },
    )
    .await;
    let files = if case.env.iter().any(|(k, _)| *k == "OUTPUT_CERTS") {
        let dir = out_dir.path().to_owned();
        wait_for(
            &format!("{kind:?} {}: OUTPUT_CERTS files", case.name),
            READY,
            || {
                let ok = ["key.pem", "cert-chain.pem", "root-cert.pem"]
                    .iter()
                    .all(|f| dir.join(f).exists());
                async move { ok.then_some(()) }
            },
        )
        .await;
        describe_output(&dir, root)
    } else {
        Value::Null
    };
    let (code, body) = http_get(istiod.http, "/csrs").await.unwrap();
    assert_eq!(code, 200, "GET /csrs: {body}");
    let records: Vec<Value> = serde_json::from_str(&body).unwrap();
    json!({
        "csrs": records.iter().map(describe_request).collect::<Vec<_>>(),
        "sds": secrets,
        "output_certs": files,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_matches_pilot_agent() {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    let root_pem = std::fs::read(istiod.root_cert_path()).unwrap();
    let root = parse_x509_pem(&root_pem).unwrap().1.contents;
    let mut unexpected = Vec::new();
    let mut listed = Vec::new();
    for case in CASES {
        let pilot = observe(&istiod, AgentKind::PilotAgent, case, &root).await;
        let ours = observe(&istiod, AgentKind::Meshagent, case, &root).await;
        // Sanity: both asked the CA at least once and were answered.
        for (who, o) in [("pilot-agent", &pilot), ("meshagent", &ours)] {
            let csrs = o["csrs"].as_array().unwrap();
            assert!(
                !csrs.is_empty() && csrs.iter().all(|c| c["code"] == "OK"),
                "{} {who}: {o:#}",
                case.name
            );
        }
        for (path, p, m) in json_diff(&pilot, &ours) {
            let line = format!("{}: {path}: pilot-agent {p} | meshagent {m}", case.name);
            match DELIBERATE
                .iter()
                .find(|(c, prefix, _)| (*c == "*" || *c == case.name) && path.starts_with(prefix))
            {
                Some((_, _, why)) => listed.push(format!("{line} (COMPAT.md: {why})")),
                None => unexpected.push(line),
            }
        }
        if std::env::var_os("COMPAT_IDENTITY_SHOW").is_some() {
            eprintln!("{} pilot-agent: {pilot:#}", case.name);
        }
        eprintln!("{}: compared", case.name);
    }
    for l in &listed {
        eprintln!("listed: {l}");
    }
    assert!(unexpected.is_empty(), "{}", unexpected.join("\n"));
}

/// The workload certificate lifetime both agents ask for (`SECRET_TTL`) in the rotation test:
/// short enough that the first rotation comes within half a minute of start.
const ROTATION_TTL: Duration = Duration::from_secs(40);

/// Istio's rotation rule (`security/pkg/nodeagent/cache/secretcache.go` `rotateTime`, with
/// `SECRET_GRACE_PERIOD_RATIO` 0.5 and `SECRET_GRACE_PERIOD_RATIO_JITTER` 0.01,
/// `pilot/cmd/pilot-agent/options/options.go`): the next CSR goes out when
/// `ratio ± u·jitter` (u in [0,1)) of the lifetime the agent saw — from receiving the
/// certificate to its `NotAfter` — remains.
const GRACE_RATIO: f64 = 0.5;
const GRACE_JITTER: f64 = 0.01;

/// Slack above Istio's window for the time from the rotation timer firing to the CSR reaching
/// the CA (key generation, the TLS handshake) and the first certificate's way back, on a
/// loaded machine. Below the window only `ROTATION_EPSILON`, for the record's millisecond
/// rounding: an early CSR is never explained by load.
const ROTATION_SLACK: Duration = Duration::from_secs(5);
const ROTATION_EPSILON: f64 = 0.05;

/// The window, in seconds after a CSR arriving at `t_ms` answered with a certificate expiring
/// at `not_after` (Unix seconds), in which Istio's rule sends the next CSR. The lifetime `L`
/// the agent saw is at most `not_after + 1 − t` (X.509 times are whole seconds, rounded down)
/// and at least `not_after − t − d` for the delay `d` of the answer, so the next CSR comes
/// `(1 − r)·L + d` after `t`: at least `(1 − r_max)·(not_after − t)` (less
/// `ROTATION_EPSILON`) and at most
/// `(1 − r_min)·(not_after + 1 − t) + slack`.
fn rotation_window(t_ms: i64, not_after: i64) -> (f64, f64) {
    let life = not_after as f64 - t_ms as f64 / 1000.0;
    let (r_min, r_max) = (GRACE_RATIO - GRACE_JITTER, GRACE_RATIO + GRACE_JITTER);
    (
        (1.0 - r_max) * life - ROTATION_EPSILON,
        (1.0 - r_min) * (life + 1.0) + ROTATION_SLACK.as_secs_f64(),
    )
}

/// The CSRs of identity `sa` in the CA's record: (arrival in Unix ms, issued `NotAfter`).
fn csr_times(records: &[Value], sa: &str) -> Vec<(i64, i64)> {
    let san = format!("/sa/{sa})");
    records
        .iter()
        .filter(|r| {
            r["code"] == "OK"
                && describe_csr(r["csr"].as_str().unwrap_or(""))
                    .to_string()
                    .contains(&san)
        })
        .map(|r| {
            (
                r["time_unix_ms"].as_i64().unwrap(),
                r["not_after"].as_i64().unwrap(),
            )
        })
        .collect()
}

/// Rotation timing under the same certificate lifetime: both agents run side by side (each its
/// own pod and service account) asking for `ROTATION_TTL` certificates with ECDSA keys (key
/// generation adds nothing to the timing), and the CA records each CSR's arrival and the
/// certificate it issued. Each agent's first renewal must fall in Istio's window
/// ([`rotation_window`]), pilot-agent's as the check of the window itself. Windows, not
/// instants: the jitter and a loaded machine's delays only widen them upwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_timing_matches_istio_rule() {
    let mesh = mesh_with_free_ports();
    let ttl = format!("{}s", ROTATION_TTL.as_secs());
    let pods = [
        (AgentKind::PilotAgent, "rotp", "127.0.62.2"),
        (AgentKind::Meshagent, "rotm", "127.0.62.3"),
    ];
    let mut config = String::new();
    for (_, w, ip) in pods {
        let name = format!("{w}-5f7d9");
        let pod = meshagent_testkit::istiod_box::RunningPod {
            name: &name,
            namespace: "default",
            labels: &[("app", w)],
            service_account: Some(w),
            hostname: None,
            ips: &[ip],
        };
        config.push_str(&pod.yaml());
        config.push_str("---\n");
    }
    let istiod = IstiodBox::start_with(&config, Some(&mesh), &["--workload-cert-ttl", &ttl]).await;
    let env = [
        ("SECRET_TTL", ttl.as_str()),
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA"),
    ];
    let mut agents = Vec::new();
    for (kind, w, ip) in pods {
        let pod = PodSpec {
            env: &env,
            ..PodSpec::new(w, ip)
        };
        agents.push((kind, w, start_agent(&istiod, kind, &pod).await));
    }
    let deadline = tokio::time::Instant::now() + READY + ROTATION_TTL;
    let records = loop {
        let (code, body) = http_get(istiod.http, "/csrs").await.unwrap();
        assert_eq!(code, 200, "GET /csrs: {body}");
        let records: Vec<Value> = serde_json::from_str(&body).unwrap();
        if pods
            .iter()
            .all(|(_, w, _)| csr_times(&records, w).len() >= 2)
        {
            break records;
        }
        if tokio::time::Instant::now() >= deadline {
            let logs: Vec<String> = agents
                .iter()
                .map(|(kind, _, sc)| format!("--- {kind:?} ---\n{}", sc.proc.log_text()))
                .collect();
            let seen: Vec<Value> = records
                .iter()
                .map(|r| {
                    json!({"time": r["time"], "code": r["code"], "not_after": r["not_after"],
                        "csr": describe_csr(r["csr"].as_str().unwrap_or(""))["extensions"]})
                })
                .collect();
            panic!(
                "both agents did not renew their certificate within {:?}; CSRs: {:#}\n{}",
                READY + ROTATION_TTL,
                Value::Array(seen),
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let mut out_of_window = Vec::new();
    for (kind, w, sc) in &agents {
        let times = csr_times(&records, w);
        let ((t0, not_after), (t1, _)) = (times[0], times[1]);
        let (lo, hi) = rotation_window(t0, not_after);
        let renewed = (t1 - t0) as f64 / 1000.0;
        eprintln!(
            "{kind:?}: certificate of {:.1} s lifetime renewed after {renewed:.2} s (Istio's window {lo:.2}..{hi:.2} s)",
            not_after as f64 - t0 as f64 / 1000.0
        );
        if !(lo..=hi).contains(&renewed) {
            out_of_window.push(format!(
                "{kind:?}: renewed after {renewed:.2} s, outside Istio's window {lo:.2}..{hi:.2} s\n{}",
                sc.proc.log_text()
            ));
        }
    }
    assert!(out_of_window.is_empty(), "{}", out_of_window.join("\n"));
}
