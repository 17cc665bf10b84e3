//! `stats_config`, the stats flush and eviction intervals (Istio's default template, fed by
//! pkg/bootstrap/config.go `getStatsOptions`).

use std::net::IpAddr;
use std::time::Duration;

use serde_json::{Map, Value, json};

use super::BootstrapError;
use crate::config::Config;

/// Annotations the stats configuration reads.
pub const ANNOTATION_INCLUSION_PREFIXES: &str = "sidecar.istio.io/statsInclusionPrefixes";
pub const ANNOTATION_INCLUSION_SUFFIXES: &str = "sidecar.istio.io/statsInclusionSuffixes";
pub const ANNOTATION_INCLUSION_REGEXPS: &str = "sidecar.istio.io/statsInclusionRegexps";
pub const ANNOTATION_EXTRA_STAT_TAGS: &str = "sidecar.istio.io/extraStatTags";
pub const ANNOTATION_HISTOGRAM_BUCKETS: &str = "sidecar.istio.io/statsHistogramBuckets";
pub const ANNOTATION_FLUSH_INTERVAL: &str = "sidecar.istio.io/statsFlushInterval";
pub const ANNOTATION_EVICTION_INTERVAL: &str = "sidecar.istio.io/statsEvictionInterval";

/// Prefixes Istio always keeps (pkg/bootstrap/config.go `requiredEnvoyStatsMatcherInclusionPrefixes`).
const REQUIRED_PREFIXES: [&str; 5] = [
    "cluster_manager",
    "listener_manager",
    "server",
    "cluster.xds-grpc",
    "wasm",
];
/// Suffixes Istio always keeps (`requiredEnvoyStatsMatcherInclusionSuffixes`).
const REQUIRED_SUFFIXES: [&str; 4] = [
    "rbac.allowed",
    "rbac.denied",
    "shadow_allowed",
    "shadow_denied",
];
/// Regexes Istio always keeps (`requiredEnvoyStatsMatcherInclusionRegexes`).
const REQUIRED_REGEXES: [&str; 1] = [r"vhost\..*\.route\..*"];

/// The inputs of the stats section, computed once (also template parameters).
#[derive(Debug, Clone, Default)]
pub struct StatsInputs {
    pub prefixes: Vec<String>,
    pub suffixes: Vec<String>,
    pub regexps: Vec<String>,
    pub extra_tags: Vec<String>,
    /// `histogram_bucket_settings` entries (sorted by prefix).
    pub histogram_buckets: Option<Value>,
    pub flush_interval: Option<Duration>,
    pub eviction_interval: Option<Duration>,
}

fn list_annotation(cfg: &Config, key: &str) -> Option<Vec<String>> {
    cfg.pod_annotations.get(key).map(|v| {
        v.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    })
}

/// `{pod_ip}` in stats patterns expands once per instance IP.
fn expand_pod_ip(patterns: Vec<String>, ips: &[IpAddr]) -> Vec<String> {
    patterns
        .into_iter()
        .flat_map(|p| {
            if p.contains("{pod_ip}") {
                ips.iter()
                    .map(|ip| p.replace("{pod_ip}", &ip.to_string()))
                    .collect()
            } else {
                vec![p]
            }
        })
        .collect()
}

/// A Go `time.ParseDuration` value as used by the stats annotations (`10s`, `1m30s`, `500ms`).
pub fn parse_go_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let mut total = 0f64;
    let mut rest = s;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let mult = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += n * mult;
        rest = &rest[unit_len..];
    }
    Duration::try_from_secs_f64(total).ok()
}

fn duration_annotation(
    cfg: &Config,
    key: &'static str,
) -> Result<Option<Duration>, BootstrapError> {
    let Some(v) = cfg.pod_annotations.get(key) else {
        return Ok(None);
    };
    parse_go_duration(v)
        .map(Some)
        .ok_or_else(|| BootstrapError::Annotation {
            annotation: key,
            value: v.clone(),
            reason: "expected a duration such as \"10s\" or \"1m\"".into(),
        })
}

impl StatsInputs {
    pub fn from_config(cfg: &Config, ips: &[IpAddr]) -> Result<Self, BootstrapError> {
        let m = cfg
            .proxy_config
            .proxy_stats_matcher
            .clone()
            .unwrap_or_default();
        let mut prefixes =
            list_annotation(cfg, ANNOTATION_INCLUSION_PREFIXES).unwrap_or(m.inclusion_prefixes);
        prefixes.extend(REQUIRED_PREFIXES.map(str::to_owned));
        let mut suffixes =
            list_annotation(cfg, ANNOTATION_INCLUSION_SUFFIXES).unwrap_or(m.inclusion_suffixes);
        suffixes.extend(REQUIRED_SUFFIXES.map(str::to_owned));
        if cfg.lifecycle.exit_on_zero_active_connections {
            suffixes.push("downstream_cx_active".into());
        }
        let mut regexps =
            list_annotation(cfg, ANNOTATION_INCLUSION_REGEXPS).unwrap_or(m.inclusion_regexps);
        regexps.extend(REQUIRED_REGEXES.map(str::to_owned));

        let mut extra_tags = cfg.proxy_config.extra_stat_tags.clone();
        extra_tags.extend(list_annotation(cfg, ANNOTATION_EXTRA_STAT_TAGS).unwrap_or_default());

        let histogram_buckets = match cfg.pod_annotations.get(ANNOTATION_HISTOGRAM_BUCKETS) {
            None => None,
            Some(v) => {
                let b: std::collections::BTreeMap<String, Vec<f64>> = serde_json::from_str(v)
                    .map_err(|e| BootstrapError::Annotation {
                        annotation: ANNOTATION_HISTOGRAM_BUCKETS,
                        value: v.clone(),
                        reason: format!(
                            "expected a JSON object of stat prefix to bucket list, e.g. \
                             {{\"istiocustom\":[1,5,10]}}: {e}"
                        ),
                    })?;
                let settings: Vec<Value> = b
                    .into_iter()
                    .map(|(prefix, buckets)| json!({"match": {"prefix": prefix}, "buckets": buckets}))
                    .collect();
                (!settings.is_empty()).then_some(Value::Array(settings))
            }
        };
        let flush_interval = duration_annotation(cfg, ANNOTATION_FLUSH_INTERVAL)?;
        let mut eviction_interval = duration_annotation(cfg, ANNOTATION_EVICTION_INTERVAL)?;
        if let Some(e) = eviction_interval {
            // Envoy refuses an eviction interval that is not a multiple of the flush interval
            // (5 s unless annotated). Istio logs it and leaves the eviction interval out
            // (pkg/bootstrap/config.go `getStatsOptions`), and the proxy starts: so does
            // meshagent, a pod that starts under Istio's agent must start here too.
            let flush = flush_interval.unwrap_or(Duration::from_secs(5));
            if flush.is_zero() || e.as_nanos() % flush.as_nanos() != 0 {
                ::tracing::warn!(
                    annotation = ANNOTATION_EVICTION_INTERVAL,
                    value = %cfg.pod_annotations[ANNOTATION_EVICTION_INTERVAL],
                    "stats eviction interval ignored: it must be a multiple of the stats flush interval ({})",
                    proto_duration(flush)
                );
                eviction_interval = None;
            }
        }
        Ok(Self {
            prefixes: expand_pod_ip(prefixes, ips),
            suffixes: expand_pod_ip(suffixes, ips),
            regexps: expand_pod_ip(regexps, ips),
            extra_tags,
            histogram_buckets,
            flush_interval,
            eviction_interval,
        })
    }
}

/// A duration in proto-JSON form (`5s`, `0.250s`).
pub fn proto_duration(d: Duration) -> String {
    crate::config::ProtoDuration(d).to_string()
}

/// Istio's stat tag extractors, in the template's order.
pub fn stats_tags(inputs: &StatsInputs) -> Vec<Value> {
    let mut tags = vec![
        // Cluster stat names carry `alt_stat_name` "<name>;", hence the `;` terminator.
        json!({"tag_name": "cluster_name", "regex": r"^cluster(\.(.+);)"}),
        json!({"tag_name": "http_conn_manager_prefix", "regex": r"^http\.(((?:[_.[:digit:]\w]*|[_\[\]aAbBcCdDeEfF[:digit:]\w\:]*));\.)"}),
        json!({"tag_name": "thread_name", "regex": r"^server(\.(.+))\.watchdog"}),
        json!({"tag_name": "tcp_prefix", "regex": r"^tcp\.((.*?)\.)\w+?$"}),
        json!({"tag_name": "response_code", "regex": r"_rq(_(\d{3}))$"}),
        json!({"tag_name": "response_code_class", "regex": r"_rq(_(\dxx))$"}),
        json!({"tag_name": "http_conn_manager_listener_prefix", "regex": r"^listener(?=\.).*?\.http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"}),
        json!({"tag_name": "listener_address", "regex": r"^listener\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)"}),
        json!({"tag_name": "mongo_prefix", "regex": r"^mongo\.(.+?)\.(collection|cmd|cx_|op_|delays_|decoding_)(.*?)$"}),
    ];
    for t in &inputs.extra_tags {
        tags.push(json!({"tag_name": t, "regex": format!(r"({t}=\.=(.*?);\.;)")}));
    }
    for (name, re) in [
        ("cache", r"(cache\.(.+?)\.)"),
        ("component", r"(component\.(.+?)\.)"),
        ("tag", r"(tag\.(.+?);\.)"),
        ("wasm_filter", r"(wasm_filter\.(.+?)\.)"),
        ("authz_enforce_result", r"rbac(\.(allowed|denied))"),
        ("authz_dry_run_action", r"(\.istio_dry_run_(allow|deny)_)"),
        ("authz_dry_run_result", r"(\.shadow_(allowed|denied))"),
    ] {
        tags.push(json!({"tag_name": name, "regex": re}));
    }
    tags
}

/// `stats_config`.
pub fn stats_config(inputs: &StatsInputs, metadata_discovery: bool) -> Value {
    let mut patterns = vec![json!({"prefix": "reporter="})];
    if metadata_discovery {
        patterns.push(json!({"prefix": "workload_discovery"}));
    }
    patterns.extend(inputs.prefixes.iter().map(|p| json!({"prefix": p})));
    patterns.extend(inputs.suffixes.iter().map(|s| json!({"suffix": s})));
    patterns.extend(
        inputs
            .regexps
            .iter()
            .map(|r| json!({"safe_regex": {"regex": r}})),
    );
    patterns.push(json!({"prefix": "component"}));
    patterns.push(json!({"prefix": "istio"}));
    let mut out = Map::new();
    out.insert("use_all_default_tags".into(), json!(false));
    out.insert("stats_tags".into(), Value::Array(stats_tags(inputs)));
    if let Some(b) = &inputs.histogram_buckets {
        out.insert("histogram_bucket_settings".into(), b.clone());
    }
    out.insert(
        "stats_matcher".into(),
        json!({"inclusion_list": {"patterns": patterns}}),
    );
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_go_duration("0"), Some(Duration::ZERO));
        for bad in ["", "10", "s", "1x", "-1s"] {
            assert_eq!(parse_go_duration(bad), None, "{bad}");
        }
    }
}
