//! Operability views on the status port: `/debug/certz`, `/debug/xdsz`, `/logging` and the
//! status page at `/`; `/debug/dnsz` and `/debug/wasmz` are rendered by their subsystems
//! ([`crate::dns::view`], [`crate::wasm::view`]) and linked from the page.
//!
//! Istio's status server (`pilot/cmd/pilot-agent/status/server.go`) has none of these; the
//! closest are istiod's `/debug/syncz` (server side of `istioctl proxy-status`), Envoy's
//! admin `/certs` and ControlZ's logging scopes (`pkg/ctrlz/topics/scopes.go`, which also
//! changes levels at run time). Every view is built when asked and from state the agent keeps
//! anyway (the secret table, the identity status, the xDS proxy's per-stream counters of
//! [`crate::xds::view`]); certificate parsing and file reads run on the blocking pool.
//!
//! Access: all of them are loopback-only (403 otherwise), as `/debug/ndsz`: certz and xdsz
//! reveal configuration, `/logging` changes the process, and the page shows all of it.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde_json::{Value, json};

use crate::identity::store::{SecretData, SecretState};
use crate::identity::{CertzSource, IdentityMode};

/// The sources the views read, filled in as the subsystems start (the status server starts
/// before identity and the xDS proxy).
#[derive(Clone, Default)]
pub struct Views {
    pub identity: Arc<OnceLock<CertzSource>>,
    pub xds: Arc<OnceLock<crate::xds::XdszSource>>,
    /// Envoy's extension list against Istio's, once read (`envoy::extensions`).
    pub envoy_extensions: Arc<OnceLock<crate::envoy::extensions::ExtensionReport>>,
    /// The DNS proxy, for `/debug/dnsz` ([`crate::dns::view`]).
    pub dns: Arc<OnceLock<Arc<crate::dns::Core>>>,
    /// The Wasm modules' records, for `/debug/wasmz` ([`crate::wasm::view`]).
    pub wasm: Arc<OnceLock<Arc<crate::wasm::view::WasmView>>>,
}

fn time(t: SystemTime) -> String {
    crate::logging::format_time(t)
}

fn secs_until(t: SystemTime, now: SystemTime) -> i64 {
    match t.duration_since(now) {
        Ok(d) => d.as_secs_f64().round() as i64,
        Err(e) => -(e.duration().as_secs_f64().round() as i64),
    }
}

fn asn1_time(t: x509_parser::time::ASN1Time) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(t.timestamp()).unwrap_or(0))
}

fn key_type(cert: &x509_parser::certificate::X509Certificate<'_>) -> String {
    use x509_parser::public_key::PublicKey;
    match cert.public_key().parsed() {
        Ok(PublicKey::RSA(k)) => format!("RSA {}", k.key_size()),
        Ok(PublicKey::EC(p)) => match p.key_size() {
            256 => "ECDSA P-256".to_owned(),
            384 => "ECDSA P-384".to_owned(),
            n => format!("ECDSA {n}"),
        },
        Ok(_) => cert.public_key().algorithm.algorithm.to_id_string(),
        Err(e) => format!("unparsable ({e})"),
    }
}

fn serial_hex(raw: &[u8]) -> String {
    let mut s = String::with_capacity(raw.len() * 3);
    for (i, b) in raw.iter().enumerate() {
        if i > 0 {
            s.push(':');
        }
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// One certificate: identity, validity, key type. Never key material.
fn describe_cert(der: &[u8], now: SystemTime) -> Value {
    let Ok((_, c)) = x509_parser::parse_x509_certificate(der) else {
        return json!({"error": "unparsable certificate"});
    };
    let sans: Vec<String> = c
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .map(|n| match n {
                    x509_parser::extensions::GeneralName::URI(u) => (*u).to_owned(),
                    x509_parser::extensions::GeneralName::DNSName(d) => (*d).to_owned(),
                    x509_parser::extensions::GeneralName::IPAddress(ip) => match ip.len() {
                        4 => std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*ip).unwrap_or_default())
                            .to_string(),
                        16 => {
                            std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*ip).unwrap_or_default())
                                .to_string()
                        }
                        _ => format!("{ip:?}"),
                    },
                    other => other.to_string(),
                })
                .collect()
        })
        .unwrap_or_default();
    let not_after = asn1_time(c.validity().not_after);
    json!({
        "serial": serial_hex(c.raw_serial()),
        "subject": c.subject().to_string(),
        "issuer": c.issuer().to_string(),
        "sans": sans,
        "notBefore": time(asn1_time(c.validity().not_before)),
        "notAfter": time(not_after),
        "expiresInSeconds": secs_until(not_after, now),
        "keyType": key_type(&c),
    })
}

fn ders(pem: &str) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .filter_map(Result::ok)
        .collect()
}

/// A chain: the leaf described, the rest counted.
fn describe_chain(pem: &str, now: SystemTime) -> Value {
    let certs = ders(pem);
    let mut leaf = certs.first().map_or_else(
        || json!({"error": "no certificate"}),
        |d| describe_cert(d, now),
    );
    leaf["chainLength"] = json!(certs.len());
    leaf
}

/// A bundle: each root's subject and expiry.
fn describe_roots(pem: &str, now: SystemTime) -> Value {
    Value::Array(
        ders(pem)
            .iter()
            .map(|d| {
                let c = describe_cert(d, now);
                json!({
                    "subject": c["subject"],
                    "serial": c["serial"],
                    "notAfter": c["notAfter"],
                    "expiresInSeconds": c["expiresInSeconds"],
                })
            })
            .collect(),
    )
}

/// Where a resource comes from.
fn source_of(src: &CertzSource, name: &str, key: &str) -> Value {
    if let Some((files, watched)) = crate::identity::files::describe(key, &src.cwd) {
        return json!({
            "kind": "files",
            "resource": key,
            "files": files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "watched": watched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        });
    }
    match (&src.mode, name) {
        (IdentityMode::ExternalSds, _) => json!({
            "kind": "externalSds",
            "socket": src.external_sds.as_ref().map(|p| p.display().to_string()),
        }),
        (IdentityMode::Ca, crate::identity::store::ROOT) => json!({
            "kind": "ca",
            "caAddress": src.ca_addr,
            "note": "the CA's root merged with PCDS trust anchors",
        }),
        _ => json!({ "kind": "ca", "caAddress": src.ca_addr }),
    }
}

/// One served resource.
fn resource(
    src: &CertzSource,
    status: &crate::identity::IdentityStatus,
    name: &str,
    key: &str,
    state: &SecretState,
    subscribers: usize,
    now: SystemTime,
) -> Value {
    let ca_workload = src.mode == IdentityMode::Ca && key == crate::identity::store::WORKLOAD;
    let mut v = json!({
        "name": name,
        "subscribers": subscribers,
        "source": source_of(src, name, key),
    });
    if key != name {
        v["servedFrom"] = json!(key);
    }
    let (state_name, error) = match state {
        SecretState::Pending if ca_workload && status.last_error.is_some() => {
            ("Failing", status.last_error.clone())
        }
        SecretState::Pending => ("Initializing", None),
        SecretState::Ready(_) if ca_workload && status.last_error.is_some() => {
            // The previous certificate is still served; its renewal is failing.
            ("Failing", status.last_error.clone())
        }
        SecretState::Ready(_) => ("Available", None),
        SecretState::Failed(e) => ("Failing", Some(e.to_string())),
    };
    v["state"] = json!(state_name);
    if let Some(e) = error {
        v["lastError"] = json!(e);
    }
    if ca_workload {
        v["nextRetry"] = json!(
            status
                .next_retry
                .filter(|_| state_name == "Failing")
                .map(time)
        );
        v["nextRotation"] = json!(status.next_rotation.map(time));
    }
    if let SecretState::Ready(d) = state {
        match d.as_ref() {
            SecretData::Cert { chain, .. } => v["certificate"] = describe_chain(chain, now),
            SecretData::Root { pem, crl } => {
                v["roots"] = describe_roots(pem, now);
                if let Some(crl) = crl {
                    v["crl"] = json!(crl.display().to_string());
                }
            }
        }
    }
    v
}

/// What OUTPUT_CERTS holds now (read from disk, the leaf and roots described).
fn output_certs(dir: &Path, now: SystemTime) -> Value {
    let read = |f: &str| {
        crate::fsio::read_bounded(&dir.join(f), 4 << 20)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .map_err(|e| {
                let missing = matches!(
                    &e,
                    crate::fsio::ReadError::Io { kind, .. } if *kind == std::io::ErrorKind::NotFound
                );
                (e.to_string(), missing)
            })
    };
    let mut missing = false;
    let chain = match read("cert-chain.pem") {
        Ok(p) => describe_chain(&p, now),
        Err((e, m)) => {
            missing = m;
            json!({"error": e})
        }
    };
    let roots = match read("root-cert.pem") {
        Ok(p) => describe_roots(&p, now),
        Err((e, _)) => json!({"error": e}),
    };
    let state = if chain["serial"].is_string() {
        "Available"
    } else if missing {
        "Initializing"
    } else {
        "Failing"
    };
    json!({
        "dir": dir.display().to_string(),
        "state": state,
        "certificate": chain,
        "roots": roots,
    })
}

/// `/debug/certz`. Blocking (PEM/X.509 parsing, stat, OUTPUT_CERTS reads): run it on the
/// blocking pool.
pub fn certz(src: &CertzSource, now: SystemTime) -> Value {
    let status = src.status.borrow().clone();
    let mut snapshot = src.store.snapshot();
    let aliases = src.store.aliases().clone();
    // `default` and `ROOTCA` are always listed, under their own names, even before anything
    // asked for them (CA mode issues `default` on its own).
    let mut resources = Vec::new();
    if src.mode != IdentityMode::ExternalSds {
        for name in [
            crate::identity::store::WORKLOAD,
            crate::identity::store::ROOT,
        ] {
            let key = src.store.resolve(name).to_owned();
            let (state, subs) = snapshot
                .iter()
                .find(|(k, _, _)| *k == key)
                .map_or((SecretState::Pending, 0), |(_, s, n)| (s.clone(), *n));
            resources.push(resource(src, &status, name, &key, &state, subs, now));
        }
    }
    snapshot.retain(|(k, _, _)| {
        k != crate::identity::store::WORKLOAD
            && k != crate::identity::store::ROOT
            && Some(k) != aliases.workload.as_ref()
            && Some(k) != aliases.root.as_ref()
    });
    for (key, state, subs) in &snapshot {
        resources.push(resource(src, &status, key, key, state, *subs, now));
    }
    let output = src.output_certs.as_ref().map(|d| {
        let mut o = output_certs(d, now);
        // Whether the files hold the certificate being served (a failing write leaves the
        // previous one there).
        let served = resources
            .first()
            .map(|r| r["certificate"]["serial"].clone())
            .unwrap_or_default();
        o["current"] = json!(!served.is_null() && o["certificate"]["serial"] == served);
        // Not (yet) the served certificate: being written, or the write is failing (it is
        // retried with backoff and the error is the identity status' last error).
        if o["current"] == false && !served.is_null() {
            match &status.last_error {
                Some(e) => {
                    o["state"] = json!("Failing");
                    o["lastError"] = json!(e);
                }
                None => o["state"] = json!("Initializing"),
            }
        }
        o
    });
    json!({
        "mode": format!("{:?}", src.mode),
        "sdsSocket": src.sds_socket.display().to_string(),
        "resources": resources,
        "outputCerts": output,
    })
}

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '&' => o.push_str("&amp;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

fn txt(v: &Value) -> String {
    match v {
        Value::String(s) => esc(s),
        Value::Null => "—".to_owned(),
        other => esc(&other.to_string()),
    }
}

/// What the page shows besides certz and xdsz.
pub struct PageFacts {
    pub ready: Result<(), String>,
    pub dns_names: Option<usize>,
    pub proxy_type: String,
}

/// The status page: plain HTML, no scripts, refreshed every 10 s.
pub fn page(certz: Option<&Value>, xdsz: Option<&Value>, facts: &PageFacts) -> String {
    let mut h = String::with_capacity(8 << 10);
    h.push_str(concat!(
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\">",
        "<meta http-equiv=\"refresh\" content=\"10\"><title>meshagent status</title><style>",
        "body{font-family:sans-serif;margin:1.5em;color:#222}h1{font-size:1.4em}",
        "h2{font-size:1.1em;margin-top:1.5em;border-bottom:1px solid #ccc}",
        "table{border-collapse:collapse}td,th{padding:.25em .8em;text-align:left;",
        "border-bottom:1px solid #eee;vertical-align:top}th{background:#f4f4f4}",
        ".ok{color:#1a7f37;font-weight:bold}.bad{color:#cf222e;font-weight:bold}",
        ".warn{color:#9a6700;font-weight:bold}code{font-size:.9em}",
        "</style></head><body><h1>meshagent status</h1>",
    ));
    let cls = |s: &str| match s {
        "Available" | "ACK" | "CONNECTED" | "ready" => "ok",
        "Initializing" | "SENT" | "PENDING" => "warn",
        _ => "bad",
    };
    // Readiness.
    let (r, reason) = match &facts.ready {
        Ok(()) => ("ready", String::new()),
        Err(e) => ("not ready", e.clone()),
    };
    h.push_str(&format!(
        "<h2>Readiness</h2><p id=\"readiness\"><span class=\"{}\">{r}</span> {}</p>\
         <p>Proxy type: {}. DNS table: {}.</p>",
        cls(r),
        esc(&reason),
        esc(&facts.proxy_type),
        facts
            .dns_names
            .map_or_else(|| "no DNS proxy".to_owned(), |n| format!("{n} names")),
    ));
    // Identity.
    h.push_str("<h2>Identity and certificates</h2>");
    match certz {
        None => h.push_str("<p>Identity has not started.</p>"),
        Some(c) => {
            h.push_str(&format!("<p>Mode: {}</p>", txt(&c["mode"])));
            h.push_str("<table id=\"certs\"><tr><th>resource</th><th>state</th><th>identity / roots</th><th>expires</th><th>next rotation</th><th>error</th></tr>");
            for r in c["resources"].as_array().into_iter().flatten() {
                let state = r["state"].as_str().unwrap_or("");
                let (who, expiry) = if r["certificate"].is_object() {
                    let cert = &r["certificate"];
                    let sans = cert["sans"]
                        .as_array()
                        .map(|a| a.iter().map(txt).collect::<Vec<_>>().join(", "))
                        .unwrap_or_default();
                    (
                        format!(
                            "{sans}<br><small>{} · serial {}</small>",
                            txt(&cert["keyType"]),
                            txt(&cert["serial"])
                        ),
                        txt(&cert["notAfter"]),
                    )
                } else if let Some(roots) = r["roots"].as_array() {
                    let subj = roots
                        .iter()
                        .map(|x| format!("{} (until {})", txt(&x["subject"]), txt(&x["notAfter"])))
                        .collect::<Vec<_>>()
                        .join("<br>");
                    let first = roots
                        .iter()
                        .filter_map(|x| x["notAfter"].as_str())
                        .min()
                        .map_or_else(|| "—".to_owned(), esc);
                    (subj, first)
                } else {
                    ("—".to_owned(), "—".to_owned())
                };
                let err = match (&r["lastError"], &r["nextRetry"]) {
                    (Value::Null, _) => String::new(),
                    (e, Value::Null) => txt(e),
                    (e, t) => format!("{} (retry at {})", txt(e), txt(t)),
                };
                h.push_str(&format!(
                    "<tr><td><code>{}</code></td><td class=\"{}\">{}</td><td>{who}</td><td>{expiry}</td><td>{}</td><td>{err}</td></tr>",
                    txt(&r["name"]),
                    cls(state),
                    esc(state),
                    txt(&r["nextRotation"]),
                ));
            }
            h.push_str("</table>");
            let o = &c["outputCerts"];
            if o.is_object() {
                let state = o["state"].as_str().unwrap_or("");
                h.push_str(&format!(
                    "<p id=\"output-certs\">OUTPUT_CERTS <code>{}</code>: <span class=\"{}\">{}</span>, expires {}{}</p>",
                    txt(&o["dir"]),
                    cls(state),
                    esc(state),
                    txt(&o["certificate"]["notAfter"]),
                    match &o["lastError"] {
                        Value::Null => String::new(),
                        e => format!(" — {}", txt(e)),
                    },
                ));
            }
        }
    }
    // xDS.
    h.push_str("<h2>xDS</h2>");
    match xdsz {
        None => h.push_str("<p>The xDS proxy has not started.</p>"),
        Some(x) => {
            let u = &x["upstream"];
            let st = u["state"].as_str().unwrap_or("");
            h.push_str(&format!(
                "<p>Upstream <code>{}</code>: <span class=\"{}\">{}</span>, connected at {}",
                txt(&u["address"]),
                cls(st),
                esc(st),
                txt(&u["connectedAt"]),
            ));
            if u["lastDisconnect"].is_object() {
                h.push_str(&format!(
                    "; last disconnect {}: {}",
                    txt(&u["lastDisconnect"]["at"]),
                    txt(&u["lastDisconnect"]["reason"])
                ));
            }
            h.push_str("</p><table id=\"xds\"><tr><th>client</th><th>type</th><th>state</th><th>version</th><th>resources</th><th>bytes</th><th>detail</th></tr>");
            for c in x["clients"].as_array().into_iter().flatten() {
                for t in c["types"].as_array().into_iter().flatten() {
                    let state = t["state"].as_str().unwrap_or("");
                    let short = t["typeUrl"]
                        .as_str()
                        .and_then(|u| u.rsplit('.').next())
                        .unwrap_or("");
                    let detail = if t["nack"].is_object() && state == "NACK" {
                        txt(&t["nack"]["errorDetail"])
                    } else if let Some(i) = t["intercepted"].as_str() {
                        format!("intercepted ({})", esc(i))
                    } else {
                        String::new()
                    };
                    h.push_str(&format!(
                        "<tr><td>#{} {} <small>{}</small></td><td>{}</td><td class=\"{}\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{detail}</td></tr>",
                        txt(&c["id"]),
                        txt(&c["api"]),
                        txt(&c["node"]),
                        esc(short),
                        cls(state),
                        esc(state),
                        txt(&t["sentVersion"]),
                        txt(&t["resources"]),
                        txt(&t["bytes"]),
                    ));
                }
            }
            h.push_str("</table>");
        }
    }
    h.push_str("<p><small>JSON: <code>/debug/certz</code>, <code>/debug/xdsz</code>, <code>/logging</code>, <code>/debug/ndsz</code>, <a href=\"/debug/dnsz\"><code>/debug/dnsz</code></a> (<code>?name=…&amp;type=…</code>), <a href=\"/debug/wasmz\"><code>/debug/wasmz</code></a>.</small></p></body></html>");
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert() -> (String, SystemTime) {
        let mut p = rcgen::CertificateParams::new(vec!["svc.example".into()]).unwrap();
        p.subject_alt_names.push(rcgen::SanType::URI(
            "spiffe://cluster.local/ns/default/sa/app"
                .try_into()
                .unwrap(),
        ));
        let key = rcgen::KeyPair::generate().unwrap();
        let c = p.self_signed(&key).unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(c.der()).unwrap();
        (c.pem(), asn1_time(parsed.validity().not_after))
    }

    #[test]
    fn chain_description_has_identity_and_no_key() {
        let (pem, not_after) = cert();
        let now = SystemTime::now();
        let d = describe_chain(&pem, now);
        assert_eq!(d["chainLength"], 1);
        assert_eq!(d["keyType"], "ECDSA P-256");
        assert_eq!(d["notAfter"], time(not_after));
        let sans: Vec<&str> = d["sans"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert!(
            sans.contains(&"spiffe://cluster.local/ns/default/sa/app"),
            "{sans:?}"
        );
        assert!(!d.to_string().contains("PRIVATE"));
        let roots = describe_roots(&format!("{pem}{pem}"), now);
        assert_eq!(roots.as_array().unwrap().len(), 2);
    }

    #[test]
    fn certz_states_follow_the_store_and_the_ca() {
        use crate::identity::store::{Aliases, ROOT, SecretStore, WORKLOAD};
        let (store, _files) = SecretStore::new(Aliases::default());
        let (tx, rx) = tokio::sync::watch::channel(crate::identity::IdentityStatus::default());
        let src = CertzSource {
            mode: IdentityMode::Ca,
            ca_addr: Some("istiod:15012".into()),
            external_sds: None,
            sds_socket: "/s".into(),
            output_certs: None,
            cwd: "/".into(),
            status: rx,
            store: store.clone(),
        };
        let now = SystemTime::now();
        let c = certz(&src, now);
        assert_eq!(c["resources"][0]["name"], WORKLOAD);
        assert_eq!(c["resources"][0]["state"], "Initializing");
        assert_eq!(c["resources"][1]["name"], ROOT);
        let retry = now + Duration::from_secs(5);
        tx.send_modify(|s| {
            s.last_error = Some("connection refused".into());
            s.next_retry = Some(retry);
        });
        let c = certz(&src, now);
        assert_eq!(c["resources"][0]["state"], "Failing");
        assert_eq!(c["resources"][0]["lastError"], "connection refused");
        assert_eq!(c["resources"][0]["nextRetry"], time(retry));
        let (pem, _) = cert();
        store.set(
            WORKLOAD,
            SecretState::Ready(Arc::new(SecretData::Cert {
                chain: pem,
                key: "-----BEGIN PRIVATE KEY-----".into(),
            })),
        );
        tx.send_modify(|s| s.last_error = None);
        let c = certz(&src, now);
        assert_eq!(c["resources"][0]["state"], "Available");
        assert_eq!(c["resources"][0]["nextRetry"], Value::Null);
        assert!(c["resources"][0]["certificate"]["serial"].is_string());
        assert!(!c.to_string().contains("PRIVATE"));
        store.set(
            "file-root:/nonexistent/r.pem",
            SecretState::Failed("cannot read".into()),
        );
        // Not subscribed: a file resource nobody asked for is not kept.
        assert_eq!(certz(&src, now)["resources"].as_array().unwrap().len(), 2);
        let _sub = store.subscribe("file-root:/nonexistent/r.pem");
        store.set(
            "file-root:/nonexistent/r.pem",
            SecretState::Failed("cannot read".into()),
        );
        let c = certz(&src, now);
        let f = &c["resources"][2];
        assert_eq!(
            (&f["state"], &f["lastError"]),
            (&json!("Failing"), &json!("cannot read"))
        );
        assert_eq!(f["source"]["kind"], "files");
        assert_eq!(f["source"]["files"][0], "/nonexistent/r.pem");
    }

    #[test]
    fn page_escapes_and_shows_states() {
        let certz = json!({"mode": "Ca", "resources": [
            {"name": "default", "state": "Available", "certificate": {"sans": ["spiffe://x/<y>"], "notAfter": "2027-01-01T00:00:00.000000Z", "keyType": "RSA 2048", "serial": "01"}, "nextRotation": null},
            {"name": "ROOTCA", "state": "Failing", "lastError": "CA <down>", "nextRetry": "soon"},
        ]});
        let facts = PageFacts {
            ready: Err("Envoy not ready".into()),
            dns_names: Some(3),
            proxy_type: "sidecar".into(),
        };
        let h = page(Some(&certz), None, &facts);
        assert!(h.contains("spiffe://x/&lt;y&gt;"));
        assert!(h.contains("2027-01-01T00:00:00.000000Z"));
        assert!(h.contains(">Available<"));
        assert!(h.contains("CA &lt;down&gt; (retry at soon)"));
        assert!(h.contains("3 names"));
        assert!(h.contains("href=\"/debug/dnsz\"") && h.contains("href=\"/debug/wasmz\""));
        assert!(!h.contains("<script"));
    }
}
