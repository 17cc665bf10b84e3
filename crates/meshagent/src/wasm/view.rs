//! `/debug/wasmz`: every Wasm module the agent was asked for, with the outcome of its last
//! fetch as the converter decided it ([`super::convert::Converter::convert`]): no I/O to
//! answer the view.
//!
//! Istio has no such view; its agent exports only `wasm_remote_fetch_count{result}` and
//! `wasm_config_conversion_count{result}` (`pkg/wasm/monitoring.go`), whose labels the
//! records reuse as `result`. Bounded: [`MAX_MODULES`] modules (the least recently fetched
//! is dropped), [`MAX_RESOURCES`] ECDS names and [`MAX_ERROR`] bytes of error per module.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Mutex;
use std::time::SystemTime;

use serde_json::{Value, json};

use super::cache::PullPolicy;

pub const MAX_MODULES: usize = 256;
pub const MAX_RESOURCES: usize = 64;
pub const MAX_ERROR: usize = 1024;

/// What one conversion decided for one ECDS resource.
pub struct Outcome<'a> {
    /// The module URL (`http_uri.uri`); `None` when the resource had none.
    pub url: Option<&'a str>,
    /// The ECDS resource (extension config) name.
    pub resource: &'a str,
    pub pull_policy: PullPolicy,
    /// The sha256 the resource asked for (empty: none).
    pub expected_sha256: &'a str,
    pub fail_open: bool,
    pub result: Result<Fetched<'a>, Failed<'a>>,
}

/// A module in the cache.
pub struct Fetched<'a> {
    pub file: &'a Path,
    pub size: Option<u64>,
}

/// A failed fetch or conversion; the fail strategy's stand-in filter was applied.
pub struct Failed<'a> {
    /// `wasm_remote_fetch_count`'s or `wasm_config_conversion_count`'s result label.
    pub result: &'static str,
    pub error: &'a str,
}

struct Record {
    url: Option<String>,
    pull_policy: PullPolicy,
    expected_sha256: String,
    resources: BTreeSet<String>,
    fail_open: bool,
    file: Option<String>,
    sha256: Option<String>,
    size: Option<u64>,
    last_fetch: SystemTime,
    last_success: Option<SystemTime>,
    failure: Option<(&'static str, String)>,
}

/// The records, keyed by URL (`resource:<name>` for a resource without one).
#[derive(Default)]
pub struct WasmView {
    modules: Mutex<HashMap<String, Record>>,
}

fn cut(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// The HTTP status in a fetch error's text (`status code 401` from the HTTP fetcher,
/// `status 401 Unauthorized` from the registry client).
fn http_status(e: &str) -> Option<u16> {
    for marker in ["status code ", "status "] {
        let mut rest = e;
        while let Some(i) = rest.find(marker) {
            rest = &rest[i + marker.len()..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if digits.len() == 3
                && let Ok(n) = digits.parse::<u16>()
                && (100..600).contains(&n)
            {
                return Some(n);
            }
        }
    }
    None
}

/// What kind of failure an error is, for a reader: `http_status`, `timeout`, `blocked`
/// (the SSRF guard refused the address, `super::guard`), `checksum_mismatch`, or the
/// result label.
fn kind(result: &str, e: &str) -> &'static str {
    if result == "checksum_mismatched" {
        "checksum_mismatch"
    } else if e.contains("connection blocked") || e.contains("rejected unsafe bearer realm") {
        "blocked"
    } else if http_status(e).is_some() {
        "http_status"
    } else if e.contains("timed out") || e.contains("not fetched within") {
        "timeout"
    } else {
        "other"
    }
}

fn policy(p: PullPolicy) -> &'static str {
    match p {
        PullPolicy::Unspecified => "UNSPECIFIED_POLICY",
        PullPolicy::IfNotPresent => "IfNotPresent",
        PullPolicy::Always => "Always",
    }
}

impl WasmView {
    pub fn record(&self, o: Outcome<'_>) {
        let key = match o.url {
            Some(u) => cut(u, 4096),
            None => format!("resource:{}", cut(o.resource, 1024)),
        };
        let now = SystemTime::now();
        let mut m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        // A resource uses one module: forget it under any other.
        for (k, r) in m.iter_mut() {
            if *k != key {
                r.resources.remove(o.resource);
            }
        }
        if !m.contains_key(&key) && m.len() >= MAX_MODULES {
            let oldest = m
                .iter()
                .min_by_key(|(_, r)| r.last_fetch)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                m.remove(&k);
            }
        }
        let r = m.entry(key).or_insert_with(|| Record {
            url: o.url.map(|u| cut(u, 4096)),
            pull_policy: o.pull_policy,
            expected_sha256: String::new(),
            resources: BTreeSet::new(),
            fail_open: o.fail_open,
            file: None,
            sha256: None,
            size: None,
            last_fetch: now,
            last_success: None,
            failure: None,
        });
        r.pull_policy = o.pull_policy;
        r.expected_sha256 = cut(o.expected_sha256, 128);
        r.fail_open = o.fail_open;
        r.last_fetch = now;
        if r.resources.len() < MAX_RESOURCES || r.resources.contains(o.resource) {
            r.resources.insert(cut(o.resource, 1024));
        }
        match o.result {
            Ok(f) => {
                r.file = Some(f.file.display().to_string());
                // The cache names a module `<sha256>.wasm` (Istio's layout).
                r.sha256 = f.file.file_stem().map(|s| s.to_string_lossy().into_owned());
                r.size = f.size;
                r.last_success = Some(now);
                r.failure = None;
            }
            Err(f) => r.failure = Some((f.result, cut(f.error, MAX_ERROR))),
        }
    }

    pub fn to_json(&self) -> Value {
        let m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        let mut modules: Vec<(&String, &Record)> = m.iter().collect();
        modules.sort_by(|a, b| a.0.cmp(b.0));
        let time = crate::logging::format_time;
        let list: Vec<Value> = modules
            .into_iter()
            .map(|(_, r)| {
                let strategy = if r.fail_open {
                    "FAIL_OPEN"
                } else {
                    "FAIL_CLOSE"
                };
                let mut v = json!({
                    "url": r.url,
                    "pullPolicy": policy(r.pull_policy),
                    "expectedSha256": if r.expected_sha256.is_empty() { Value::Null } else { json!(r.expected_sha256) },
                    "resources": r.resources,
                    "failStrategy": strategy,
                    "file": r.file,
                    "sha256": r.sha256,
                    "size": r.size,
                    "lastFetch": time(r.last_fetch),
                    "lastSuccess": r.last_success.map(time),
                    "state": if r.failure.is_some() { "Failing" } else { "Available" },
                });
                if let Some((result, e)) = &r.failure {
                    v["lastError"] = json!({
                        "result": result,
                        "kind": kind(result, e),
                        "httpStatus": http_status(e),
                        "error": e,
                    });
                    // What `convert` put in the module's place (`fallback_filter`).
                    v["fallbackApplied"] = json!(if r.fail_open {
                        "allow-all (RBAC allowing every request, in the module's place)"
                    } else {
                        "deny-all (RBAC denying every request, in the module's place)"
                    });
                }
                v
            })
            .collect();
        json!({ "modules": list })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ok<'a>(url: &'a str, res: &'a str, file: &'a Path) -> Outcome<'a> {
        Outcome {
            url: Some(url),
            resource: res,
            pull_policy: PullPolicy::IfNotPresent,
            expected_sha256: "",
            fail_open: false,
            result: Ok(Fetched {
                file,
                size: Some(7),
            }),
        }
    }

    #[test]
    fn records_success_failure_and_moves() {
        let v = WasmView::default();
        let f = Path::new("/d/abc/0123.wasm");
        v.record(ok("http://m/a.wasm", "ns.a", f));
        let j = v.to_json();
        let m = &j["modules"][0];
        assert_eq!(
            (&m["sha256"], &m["size"], &m["state"]),
            (&json!("0123"), &json!(7), &json!("Available"))
        );
        assert_eq!(m["resources"], json!(["ns.a"]));
        v.record(Outcome {
            url: Some("http://m/b.wasm"),
            resource: "ns.a",
            pull_policy: PullPolicy::Always,
            expected_sha256: "ff",
            fail_open: true,
            result: Err(Failed {
                result: "download_failure",
                error: "wasm module download request failed: http://m/b.wasm: status code 401",
            }),
        });
        let j = v.to_json();
        assert_eq!(j["modules"][0]["resources"], json!([]));
        let b = &j["modules"][1];
        assert_eq!(b["lastError"]["httpStatus"], 401);
        assert_eq!(b["lastError"]["kind"], "http_status");
        assert_eq!(b["failStrategy"], "FAIL_OPEN");
        assert_eq!(b["state"], "Failing");
        assert!(
            b["fallbackApplied"]
                .as_str()
                .unwrap()
                .starts_with("allow-all")
        );
    }

    #[test]
    fn kinds_and_bounds() {
        assert_eq!(
            kind(
                "download_failure",
                "x: connection blocked: resolved IP 10.0.0.1 is in blocked range 10.0.0.0/8"
            ),
            "blocked"
        );
        assert_eq!(kind("checksum_mismatched", "y"), "checksum_mismatch");
        assert_eq!(kind("download_failure", "u: timed out after 1s"), "timeout");
        assert_eq!(http_status("reg: status 404 Not Found"), Some(404));
        assert_eq!(http_status("status 40"), None);
        let v = WasmView::default();
        let f = Path::new("/x.wasm");
        for i in 0..MAX_MODULES + 10 {
            let u = format!("http://m/{i}.wasm");
            v.record(ok(&u, "r", f));
        }
        assert_eq!(
            v.to_json()["modules"].as_array().unwrap().len(),
            MAX_MODULES
        );
        for i in 0..MAX_RESOURCES + 10 {
            let r = format!("r{i}");
            v.record(ok("http://m/1.wasm", &r, f));
        }
        let j = v.to_json();
        let one = j["modules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["url"] == "http://m/1.wasm")
            .unwrap();
        assert_eq!(one["resources"].as_array().unwrap().len(), MAX_RESOURCES);
    }
}
