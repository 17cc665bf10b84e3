//! Typed `ISTIO_KUBE_APP_PROBERS` and `ISTIO_PROMETHEUS_ANNOTATIONS` (read by Istio's `pilot/cmd/pilot-agent/status/server.go`).
//!
//! Both are injector-generated JSON. Istio validates them when the status server starts and
//! exits on a bad value; we do the same during config loading so `meshagent proxy` fails with
//! an error naming the variable, the offending key and what was expected, before anything runs.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value};

/// Ports Istio reserves in a pod, with Istio's reasons (`istioReservedPorts` in
/// `pilot/cmd/pilot-agent/status/server.go`): an app metrics target on one of these would
/// make the agent scrape itself, Envoy or a non-metrics listener.
pub const RESERVED_PORTS: &[(u16, &str)] = &[
    (15000, "Envoy admin"),
    (15001, "outbound traffic capture"),
    (15004, "pilot debug"),
    (15006, "inbound traffic capture"),
    (15008, "HBONE tunnel"),
    (15020, "pilot-agent status / merged Prometheus"),
    (15021, "Envoy health"),
    (15053, "DNS proxy"),
    (15090, "Envoy Prometheus (already merged)"),
];

/// One rewritten probe or lifecycle hook: what the agent calls when kubelet hits the path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AppProber {
    pub kind: ProberKind,
    /// `timeoutSeconds`; `None` (or 0) means no timeout, as in Istio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u32>,
}

impl AppProber {
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout_seconds
            .filter(|s| *s > 0)
            .map(|s| Duration::from_secs(u64::from(s)))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProberKind {
    HttpGet {
        path: String,
        port: u16,
        /// `true` for `scheme: HTTPS`.
        https: bool,
        /// `host`: overrides the destination address when set.
        host: Option<String>,
        headers: Vec<(String, String)>,
    },
    TcpSocket {
        port: u16,
    },
    Grpc {
        port: u16,
        service: String,
    },
}

fn path_ok(key: &str) -> bool {
    // ^/(app-health|app-lifecycle)/[^/]+/(livez|readyz|startupz|prestopz|poststartz)$
    let Some(rest) = key
        .strip_prefix("/app-health/")
        .or_else(|| key.strip_prefix("/app-lifecycle/"))
    else {
        return false;
    };
    let Some((container, kind)) = rest.split_once('/') else {
        return false;
    };
    !container.is_empty()
        && matches!(
            kind,
            "livez" | "readyz" | "startupz" | "prestopz" | "poststartz"
        )
}

fn int_port(v: Option<&Value>, what: &str) -> Result<u16, String> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("{what}.port {n} is not a port number between 1 and 65535")),
        Some(other) => Err(format!(
            "{what}.port {other} must be an integer (named ports are not supported)"
        )),
        None => Err(format!("{what}.port is missing")),
    }
}

fn opt_str(o: &Map<String, Value>, field: &str, what: &str) -> Result<Option<String>, String> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(format!("{what}.{field} {other} must be a string")),
    }
}

fn parse_prober(v: &Value) -> Result<AppProber, String> {
    let o = v
        .as_object()
        .ok_or_else(|| format!("{v} is not a JSON object"))?;
    let kinds: Vec<&str> = ["httpGet", "tcpSocket", "grpc"]
        .into_iter()
        .filter(|k| o.get(*k).is_some_and(|v| !v.is_null()))
        .collect();
    if kinds.len() != 1 {
        return Err(format!(
            "exactly one of httpGet, tcpSocket or grpc is required, found {}",
            if kinds.is_empty() {
                "none".to_owned()
            } else {
                kinds.join(", ")
            }
        ));
    }
    let kind_name = kinds[0];
    let body = o[kind_name]
        .as_object()
        .ok_or_else(|| format!("{kind_name} is not a JSON object"))?;
    let kind = match kind_name {
        "httpGet" => {
            let scheme = opt_str(body, "scheme", kind_name)?.unwrap_or_default();
            let https = match scheme.to_ascii_uppercase().as_str() {
                "" | "HTTP" => false,
                "HTTPS" => true,
                _ => return Err(format!("httpGet.scheme {scheme:?} is not HTTP or HTTPS")),
            };
            let mut headers = Vec::new();
            match body.get("httpHeaders") {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    for h in items {
                        let name = h.get("name").and_then(Value::as_str);
                        let value = h.get("value").and_then(Value::as_str);
                        match (name, value) {
                            (Some(n), Some(v)) if !n.is_empty() => {
                                headers.push((n.to_owned(), v.to_owned()))
                            }
                            _ => {
                                return Err(format!(
                                    "httpGet.httpHeaders entry {h} needs string name and value"
                                ));
                            }
                        }
                    }
                }
                Some(other) => return Err(format!("httpGet.httpHeaders {other} is not a list")),
            }
            ProberKind::HttpGet {
                path: opt_str(body, "path", kind_name)?.unwrap_or_default(),
                port: int_port(body.get("port"), kind_name)?,
                https,
                host: opt_str(body, "host", kind_name)?.filter(|h| !h.is_empty()),
                headers,
            }
        }
        "tcpSocket" => ProberKind::TcpSocket {
            port: int_port(body.get("port"), kind_name)?,
        },
        _ => ProberKind::Grpc {
            port: int_port(body.get("port"), kind_name)?,
            service: opt_str(body, "service", kind_name)?.unwrap_or_default(),
        },
    };
    let timeout_seconds = match o.get("timeoutSeconds") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => Some(
            n.as_u64()
                .and_then(|s| u32::try_from(s).ok())
                .ok_or_else(|| format!("timeoutSeconds {n} is not a non-negative integer"))?,
        ),
        Some(other) => return Err(format!("timeoutSeconds {other} is not an integer")),
    };
    Ok(AppProber {
        kind,
        timeout_seconds,
    })
}

/// Parses `ISTIO_KUBE_APP_PROBERS`; the error names the offending key.
pub fn parse_app_probers(raw: &str) -> Result<BTreeMap<String, AppProber>, String> {
    let v: Value = serde_json::from_str(raw).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(map) = v else {
        return Err("not a JSON object of path → prober".into());
    };
    let mut out = BTreeMap::new();
    for (key, prober) in &map {
        if !path_ok(key) {
            return Err(format!(
                "invalid key {key:?}: expected /app-health/<container>/(livez|readyz|startupz) or /app-lifecycle/<container>/(prestopz|poststartz)"
            ));
        }
        let p = parse_prober(prober).map_err(|e| format!("prober {key:?}: {e}"))?;
        out.insert(key.clone(), p);
    }
    Ok(out)
}

/// One application metrics endpoint to merge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScrapeTarget {
    pub port: u16,
    pub path: String,
}

/// `ISTIO_PROMETHEUS_ANNOTATIONS`, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrometheusScrape {
    /// `scrape` ≠ "false".
    pub scrape: bool,
    /// In scrape order; the legacy single `port`/`path` form becomes one target.
    pub targets: Vec<ScrapeTarget>,
}

fn json_port(v: &Value, what: &str) -> Result<u16, String> {
    let s = match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        other => return Err(format!("{what} {other} is not a port")),
    };
    match s.trim().parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(format!(
            "{what} {s:?} is not a port number between 1 and 65535"
        )),
    }
}

fn json_path(v: Option<&Value>, what: &str) -> Result<String, String> {
    match v {
        None | Some(Value::Null) => Ok("/metrics".to_owned()),
        Some(Value::String(s)) if s.is_empty() => Ok("/metrics".to_owned()),
        Some(Value::String(s)) if s.starts_with('/') => Ok(s.clone()),
        Some(Value::String(s)) => Ok(format!("/{s}")),
        Some(other) => Err(format!("{what} {other} is not a string")),
    }
}

/// Parses `ISTIO_PROMETHEUS_ANNOTATIONS` and checks every target port against the status port
/// and Istio's reserved ports.
pub fn parse_prometheus_annotations(
    raw: &str,
    status_port: u16,
) -> Result<PrometheusScrape, String> {
    let v: Value = serde_json::from_str(raw).map_err(|e| format!("not valid JSON: {e}"))?;
    let Value::Object(o) = v else {
        return Err("not a JSON object".into());
    };
    let scrape = match o.get("scrape") {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => !s.eq_ignore_ascii_case("false"),
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(format!("scrape {other} is not \"true\" or \"false\"")),
    };
    let mut targets = Vec::new();
    match o.get("targets") {
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, t) in items.iter().enumerate() {
                let what = format!("targets[{i}]");
                let t = t
                    .as_object()
                    .ok_or_else(|| format!("{what} is not a JSON object"))?;
                let port = t
                    .get("port")
                    .ok_or_else(|| format!("{what}.port is missing"))?;
                targets.push(ScrapeTarget {
                    port: json_port(port, &format!("{what}.port"))?,
                    path: json_path(t.get("path"), &format!("{what}.path"))?,
                });
            }
        }
        None | Some(Value::Null) => {}
        Some(Value::Array(_)) => {}
        Some(other) => return Err(format!("targets {other} is not a list")),
    }
    if targets.is_empty() {
        // Legacy form: port defaults to 80, path to /metrics.
        let port = match o.get("port") {
            None | Some(Value::Null) => 80,
            Some(Value::String(s)) if s.is_empty() => 80,
            Some(p) => json_port(p, "port")?,
        };
        targets.push(ScrapeTarget {
            port,
            path: json_path(o.get("path"), "path")?,
        });
    }
    for (i, t) in targets.iter().enumerate() {
        if t.port == status_port {
            return Err(format!(
                "target {i} port {} is the agent's status port",
                t.port
            ));
        }
        if let Some((_, reason)) = RESERVED_PORTS.iter().find(|(p, _)| *p == t.port) {
            return Err(format!(
                "target {i} port {} is reserved for Istio ({reason}) and cannot be scraped",
                t.port
            ));
        }
    }
    Ok(PrometheusScrape { scrape, targets })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probers_parse_and_validate() {
        let p = parse_app_probers(
            r#"{"/app-health/hello/livez":{"httpGet":{"path":"hz","port":80,"scheme":"HTTPS","httpHeaders":[{"name":"X","value":"y"}]},"timeoutSeconds":3},
                "/app-lifecycle/hello/poststartz":{"tcpSocket":{"port":93}},
                "/app-health/g/readyz":{"grpc":{"port":50051,"service":"svc"}}}"#,
        )
        .unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(
            p["/app-health/hello/livez"].timeout(),
            Some(Duration::from_secs(3))
        );
        assert!(matches!(
            p["/app-health/g/readyz"].kind,
            ProberKind::Grpc { port: 50051, .. }
        ));

        let bad = [
            (
                r#"{"/bad/x/livez":{"tcpSocket":{"port":1}}}"#,
                "invalid key",
            ),
            (r#"{"/app-health/x/livez":{}}"#, "found none"),
            (
                r#"{"/app-health/x/livez":{"tcpSocket":{"port":1},"grpc":{"port":2}}}"#,
                "found tcpSocket, grpc",
            ),
            (
                r#"{"/app-health/x/livez":{"httpGet":{"port":"http"}}}"#,
                "must be an integer",
            ),
            (
                r#"{"/app-health/x/livez":{"tcpSocket":{}}}"#,
                "port is missing",
            ),
            ("[1]", "not a JSON object"),
            ("{", "not valid JSON"),
        ];
        for (raw, want) in bad {
            let e = parse_app_probers(raw).unwrap_err();
            assert!(e.contains(want), "{raw}: {e}");
        }
    }

    #[test]
    fn prometheus_annotations() {
        let p = parse_prometheus_annotations(
            r#"{"scrape":"true","targets":[{"port":"8080","path":"/m"},{"port":9090}]}"#,
            15020,
        )
        .unwrap();
        assert_eq!(p.targets.len(), 2);
        assert_eq!(p.targets[1].path, "/metrics");
        let legacy = parse_prometheus_annotations(r#"{"scrape":"true"}"#, 15020).unwrap();
        assert_eq!(
            legacy.targets,
            vec![ScrapeTarget {
                port: 80,
                path: "/metrics".into()
            }]
        );
        assert!(
            !parse_prometheus_annotations(r#"{"scrape":"false","port":"81"}"#, 15020)
                .unwrap()
                .scrape
        );
        // Not in Istio's reserved list (15009 is no sidecar port): scraped as pilot-agent does.
        assert!(parse_prometheus_annotations(r#"{"port":"15009"}"#, 15020).is_ok());
        // Istio compares ports as numbers: 015020 is the status port.
        assert!(parse_prometheus_annotations(r#"{"port":"015020"}"#, 15020).is_err());
        for (raw, want) in [
            (r#"{"port":"15020"}"#, "status port"),
            (
                r#"{"port":"15090"}"#,
                "reserved for Istio (Envoy Prometheus",
            ),
            (
                r#"{"targets":[{"port":"8080"},{"port":15008}]}"#,
                "target 1 port 15008 is reserved for Istio (HBONE tunnel)",
            ),
            (r#"{"port":"abc"}"#, "not a port number"),
            (r#"{"port":"70000"}"#, "not a port number"),
            (
                r#"{"targets":[{"path":"/x"}]}"#,
                "targets[0].port is missing",
            ),
        ] {
            let e = parse_prometheus_annotations(raw, 15020).unwrap_err();
            assert!(e.contains(want), "{raw}: {e}");
        }
    }
}
