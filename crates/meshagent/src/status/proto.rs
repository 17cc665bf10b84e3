//! The merged metrics in Prometheus' delimited protobuf (`io.prometheus.client.MetricFamily`),
//! so native histograms survive the merge. Istio asks its sources for text only (Istio
//! #49950; its status server downgrades protobuf requests to text since #60622): a scraper
//! asking for protobuf gets text from `pilot-agent` and native histograms are lost.
//!
//! meshagent answers protobuf when the scraper prefers it and every source that answered did
//! so in protobuf (Envoy does, and so does every Prometheus client library); otherwise it
//! answers text as before ([`super::merge`]). Sources are passed through message by message:
//! each length-prefixed `MetricFamily` is held until complete (at most [`MAX_MESSAGE`]), its
//! name read from the wire, and a family an earlier source already sent is left out, as in
//! the text merge. The agent's own registry, which renders text, is converted here.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};

use super::lines::{FLUSH_AT, Seen};

/// What a protobuf-preferring scraper is answered with, and what sources are asked for.
pub const CONTENT_TYPE: &str =
    "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited";
/// The source request's Accept: protobuf first, text when a source cannot.
pub const SOURCE_ACCEPT: &str = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=1.0,text/plain;version=0.0.4;q=0.5";
/// Longest `MetricFamily` message accepted from a source.
pub const MAX_MESSAGE: usize = 16 * 1024 * 1024;

// ===== the messages (prometheus/client_model `io/prometheus/client/metrics.proto`) =====

#[derive(Clone, PartialEq, prost::Message)]
pub struct LabelPair {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(string, optional, tag = "2")]
    pub value: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Gauge {
    #[prost(double, optional, tag = "1")]
    pub value: Option<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Counter {
    #[prost(double, optional, tag = "1")]
    pub value: Option<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Untyped {
    #[prost(double, optional, tag = "1")]
    pub value: Option<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Bucket {
    #[prost(uint64, optional, tag = "1")]
    pub cumulative_count: Option<u64>,
    #[prost(double, optional, tag = "2")]
    pub upper_bound: Option<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Histogram {
    #[prost(uint64, optional, tag = "1")]
    pub sample_count: Option<u64>,
    #[prost(double, optional, tag = "2")]
    pub sample_sum: Option<f64>,
    #[prost(message, repeated, tag = "3")]
    pub bucket: Vec<Bucket>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Metric {
    #[prost(message, repeated, tag = "1")]
    pub label: Vec<LabelPair>,
    #[prost(message, optional, tag = "2")]
    pub gauge: Option<Gauge>,
    #[prost(message, optional, tag = "3")]
    pub counter: Option<Counter>,
    #[prost(message, optional, tag = "5")]
    pub untyped: Option<Untyped>,
    #[prost(message, optional, tag = "7")]
    pub histogram: Option<Histogram>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricFamily {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(string, optional, tag = "2")]
    pub help: Option<String>,
    /// `MetricType`: COUNTER 0, GAUGE 1, SUMMARY 2, UNTYPED 3, HISTOGRAM 4.
    #[prost(int32, optional, tag = "3")]
    pub r#type: Option<i32>,
    #[prost(message, repeated, tag = "4")]
    pub metric: Vec<Metric>,
}

pub const COUNTER: i32 = 0;
pub const GAUGE: i32 = 1;
pub const UNTYPED: i32 = 3;
pub const HISTOGRAM: i32 = 4;

// ===== negotiation =====

fn is_protobuf_media(media: &str, params: &[(String, String)]) -> bool {
    media.eq_ignore_ascii_case("application/vnd.google.protobuf")
        && params
            .iter()
            .any(|(k, v)| k == "proto" && v == "io.prometheus.client.MetricFamily")
        && params
            .iter()
            .any(|(k, v)| k == "encoding" && v == "delimited")
}

fn media_and_params(part: &str) -> (String, Vec<(String, String)>) {
    let mut it = part.split(';').map(str::trim);
    let media = it.next().unwrap_or("").to_ascii_lowercase();
    let params = it
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| {
            (
                k.trim().to_ascii_lowercase(),
                v.trim().trim_matches('"').to_owned(),
            )
        })
        .collect();
    (media, params)
}

/// Whether the scraper prefers delimited protobuf: it lists it with a q-value no lower than
/// any other type's (Prometheus puts it first, at the highest q, when native histograms or
/// `scrape_protocols: [PrometheusProto, …]` are configured).
pub fn wants_protobuf(accept: &str) -> bool {
    let mut proto_q: Option<f64> = None;
    let mut other_q = 0.0f64;
    for part in accept.split(',') {
        let (media, params) = media_and_params(part);
        if media.is_empty() {
            continue;
        }
        let q = params
            .iter()
            .find(|(k, _)| k == "q")
            .map_or(1.0, |(_, v)| v.parse::<f64>().unwrap_or(0.0));
        if is_protobuf_media(&media, &params) {
            proto_q = Some(proto_q.map_or(q, |p| p.max(q)));
        } else {
            other_q = other_q.max(q);
        }
    }
    proto_q.is_some_and(|q| q > 0.0 && q >= other_q)
}

/// Whether a source answered delimited protobuf.
pub fn is_protobuf(content_type: Option<&str>) -> bool {
    let Some(ct) = content_type else {
        return false;
    };
    let (media, params) = media_and_params(ct);
    is_protobuf_media(&media, &params)
}

// ===== the agent's text as protobuf =====

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        v => v.parse().ok(),
    }
}

/// Label names and values of one sample, in order.
type Labels = Vec<(String, String)>;

/// `name{a="x",b="y"} value` → (name, labels, value). The agent's own text: well-formed.
fn parse_sample(line: &str) -> Option<(&str, Labels, f64)> {
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let mut labels = Vec::new();
    let mut rest = &line[name_end..];
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices().peekable();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '}' => {
                    end = Some(i);
                    break;
                }
                ',' | ' ' => {}
                _ => {
                    let eq = r[i..].find('=')? + i;
                    let key = r[i..eq].trim().to_owned();
                    // Skip to the opening quote.
                    while chars.peek().is_some_and(|(j, _)| *j <= eq) {
                        chars.next();
                    }
                    if chars.next().map(|(_, c)| c) != Some('"') {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()? {
                            (_, '\\') => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                c => value.push(c),
                            },
                            (_, '"') => break,
                            (_, c) => value.push(c),
                        }
                    }
                    labels.push((key, value));
                }
            }
        }
        rest = &r[end? + 1..];
    }
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some((name, labels, value))
}

fn label_pairs(labels: &[(String, String)]) -> Vec<LabelPair> {
    labels
        .iter()
        .map(|(k, v)| LabelPair {
            name: Some(k.clone()),
            value: Some(v.clone()),
        })
        .collect()
}

/// The agent's text exposition (counters, gauges, histograms, untyped) as delimited
/// `MetricFamily` messages, in its order.
pub fn from_text(text: &str) -> Vec<MetricFamily> {
    let mut families: Vec<MetricFamily> = Vec::new();
    // Per histogram family: labels (without `le`) → index in `metric`.
    let mut series: BTreeMap<Labels, usize> = BTreeMap::new();
    let mut current: Option<(String, i32)> = None;
    let start = |families: &mut Vec<MetricFamily>, name: &str, help: Option<String>, t: i32| {
        families.push(MetricFamily {
            name: Some(name.to_owned()),
            help,
            r#type: Some(t),
            metric: Vec::new(),
        });
    };
    let mut pending_help: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            pending_help = Some((
                name.to_owned(),
                help.replace("\\n", "\n").replace("\\\\", "\\"),
            ));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, t) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let t = match t.trim() {
                "counter" => COUNTER,
                "gauge" => GAUGE,
                "histogram" => HISTOGRAM,
                _ => UNTYPED,
            };
            let help = pending_help
                .take()
                .filter(|(n, _)| n == name)
                .map(|(_, h)| h);
            start(&mut families, name, help, t);
            current = Some((name.to_owned(), t));
            series.clear();
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let Some((name, mut labels, value)) = parse_sample(line) else {
            continue;
        };
        let in_family = current.as_ref().is_some_and(|(f, t)| {
            name == f
                || (*t == HISTOGRAM
                    && name
                        .strip_prefix(f.as_str())
                        .is_some_and(|s| ["_bucket", "_sum", "_count"].contains(&s)))
        });
        if !in_family {
            start(&mut families, name, None, UNTYPED);
            current = Some((name.to_owned(), UNTYPED));
            series.clear();
        }
        let Some((fname, t)) = current.clone() else {
            continue;
        };
        let Some(family) = families.last_mut() else {
            continue;
        };
        match t {
            HISTOGRAM => {
                let le = labels
                    .iter()
                    .position(|(k, _)| k == "le")
                    .map(|i| labels.remove(i).1);
                let idx = *series.entry(labels.clone()).or_insert_with(|| {
                    family.metric.push(Metric {
                        label: label_pairs(&labels),
                        histogram: Some(Histogram::default()),
                        ..Default::default()
                    });
                    family.metric.len() - 1
                });
                let Some(h) = family.metric[idx].histogram.as_mut() else {
                    continue;
                };
                let suffix = &name[fname.len()..];
                match suffix {
                    "_bucket" => {
                        let bound = le.as_deref().and_then(parse_value);
                        // The +Inf bucket is implicit in protobuf (sample_count).
                        if let Some(b) = bound.filter(|b| b.is_finite()) {
                            h.bucket.push(Bucket {
                                cumulative_count: Some(value as u64),
                                upper_bound: Some(b),
                            });
                        }
                    }
                    "_sum" => h.sample_sum = Some(value),
                    "_count" => h.sample_count = Some(value as u64),
                    _ => {}
                }
            }
            t => family.metric.push(Metric {
                label: label_pairs(&labels),
                gauge: (t == GAUGE).then_some(Gauge { value: Some(value) }),
                counter: (t == COUNTER).then_some(Counter { value: Some(value) }),
                untyped: (t == UNTYPED).then_some(Untyped { value: Some(value) }),
                ..Default::default()
            }),
        }
    }
    families.retain(|f| !f.metric.is_empty());
    families
}

/// Delimited encoding of `families`, each family name recorded in `seen` (a name already
/// there is left out).
pub fn encode(families: &[MetricFamily], seen: &mut Seen) -> Vec<u8> {
    let mut out = Vec::new();
    for f in families {
        if seen.first(f.name.as_deref().unwrap_or("").as_bytes()) {
            let _ = prost::Message::encode_length_delimited(f, &mut out);
        }
    }
    out
}

// ===== sources =====

fn varint(buf: &[u8]) -> Option<Result<(u64, usize), &'static str>> {
    let mut v: u64 = 0;
    for (i, b) in buf.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some(Ok((v, i + 1)));
        }
    }
    if buf.len() >= 10 {
        Some(Err("a length prefix is not a varint"))
    } else {
        None
    }
}

/// The `name` (field 1) of an encoded `MetricFamily`.
fn family_name(msg: &[u8]) -> Result<&[u8], &'static str> {
    let mut i = 0;
    while i < msg.len() {
        let (tag, n) = varint(&msg[i..])
            .ok_or("a field tag is cut")?
            .map_err(|_| "a field tag is not a varint")?;
        i += n;
        let (field, wire) = (tag >> 3, tag & 7);
        match wire {
            0 => {
                let (_, n) = varint(&msg[i..])
                    .ok_or("a varint field is cut")?
                    .map_err(|_| "a varint field is invalid")?;
                i += n;
            }
            1 => i += 8,
            5 => i += 4,
            2 => {
                let (len, n) = varint(&msg[i..])
                    .ok_or("a length is cut")?
                    .map_err(|_| "a length is invalid")?;
                i += n;
                let end = i
                    .checked_add(usize::try_from(len).map_err(|_| "a length is too large")?)
                    .filter(|e| *e <= msg.len())
                    .ok_or("a field runs past its message")?;
                if field == 1 {
                    let name = &msg[i..end];
                    return if std::str::from_utf8(name).is_ok() && !name.is_empty() {
                        Ok(name)
                    } else {
                        Err("a family name is not UTF-8")
                    };
                }
                i = end;
            }
            _ => return Err("a field has an unknown wire type"),
        }
    }
    Err("a MetricFamily has no name")
}

/// Splits one source's delimited stream into whole messages and leaves out families already
/// sent.
#[derive(Default)]
pub struct ProtoFilter {
    buf: BytesMut,
    /// Whole messages to send, handed on in chunks of about [`FLUSH_AT`] bytes (copied out
    /// of `buf`, so its allocation is reused rather than pinned by messages in flight).
    out: BytesMut,
    pub dropped_families: u64,
    failure: Option<&'static str>,
}

impl ProtoFilter {
    pub fn failure(&self) -> Option<&'static str> {
        self.failure
    }

    /// Feeds a chunk; whole messages of new families go to `ready`.
    pub fn push(&mut self, seen: &mut Seen, chunk: &[u8], ready: &mut Vec<Bytes>) {
        if self.failure.is_some() {
            return;
        }
        self.buf.extend_from_slice(chunk);
        loop {
            let (len, n) = match varint(&self.buf) {
                None => return,
                Some(Err(e)) => {
                    self.failure = Some(e);
                    return;
                }
                Some(Ok(v)) => v,
            };
            let Ok(len) = usize::try_from(len) else {
                self.failure = Some("a message is too large");
                return;
            };
            if len > MAX_MESSAGE {
                self.failure = Some("a message is larger than 16 MiB");
                return;
            }
            if self.buf.len() < n + len {
                self.buf.reserve(n + len - self.buf.len());
                return;
            }
            match family_name(&self.buf[n..n + len]) {
                Err(e) => {
                    self.failure = Some(e);
                    return;
                }
                Ok(name) => {
                    if seen.first(name) {
                        self.out.extend_from_slice(&self.buf[..n + len]);
                    } else {
                        self.dropped_families += 1;
                    }
                }
            }
            bytes::Buf::advance(&mut self.buf, n + len);
            if self.out.len() >= FLUSH_AT {
                ready.push(self.out.split().freeze());
            }
        }
    }

    /// End of the source (completed or failed): the whole messages still held go to
    /// `ready`; a partial message left on a completed source means it was cut.
    pub fn finish(&mut self, ready: &mut Vec<Bytes>) {
        if self.failure.is_none() && !self.buf.is_empty() {
            self.failure = Some("the body ends inside a message");
        }
        self.buf = BytesMut::new();
        if !self.out.is_empty() {
            ready.push(self.out.split().freeze());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation() {
        let proto = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited";
        assert!(wants_protobuf(proto));
        assert!(wants_protobuf(&format!(
            "{proto};q=0.7,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
        )));
        assert!(wants_protobuf(&format!(
            "{proto},application/openmetrics-text;version=1.0.0;q=0.9,text/plain;q=0.5"
        )));
        // Prometheus' default order: OpenMetrics first.
        assert!(!wants_protobuf(&format!(
            "application/openmetrics-text;version=1.0.0,{proto};q=0.5"
        )));
        assert!(!wants_protobuf("text/plain;version=0.0.4"));
        assert!(!wants_protobuf(
            "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text"
        ));
        assert!(!wants_protobuf(&format!("{proto};q=0")));
        assert!(is_protobuf(Some(
            "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; encoding=delimited; escaping=underscores"
        )));
        assert!(!is_protobuf(Some("text/plain")));
    }

    #[test]
    fn agent_text_converts() {
        let text = "# HELP c_total Things.\n# TYPE c_total counter\nc_total{a=\"x\\\"y\"} 3\n\
                    # TYPE g gauge\ng 1.5\n# HELP h Latency.\n# TYPE h histogram\n\
                    h_bucket{k=\"v\",le=\"0.5\"} 1\nh_bucket{k=\"v\",le=\"+Inf\"} 2\nh_sum{k=\"v\"} 3.5\nh_count{k=\"v\"} 2\n";
        let f = from_text(text);
        assert_eq!(f.len(), 3);
        assert_eq!(f[0].name.as_deref(), Some("c_total"));
        assert_eq!(f[0].help.as_deref(), Some("Things."));
        assert_eq!(f[0].metric[0].label[0].value.as_deref(), Some("x\"y"));
        assert_eq!(f[0].metric[0].counter.as_ref().unwrap().value, Some(3.0));
        assert_eq!(f[1].metric[0].gauge.as_ref().unwrap().value, Some(1.5));
        let h = f[2].metric[0].histogram.as_ref().unwrap();
        assert_eq!(
            (h.sample_count, h.sample_sum, h.bucket.len()),
            (Some(2), Some(3.5), 1)
        );
        assert_eq!(f[2].metric[0].label.len(), 1);

        // Encoded, split back by the filter in any chunking, duplicates left out.
        let mut seen = Seen::default();
        let bytes = encode(&f, &mut seen);
        for chunk in [1, 7, 4096] {
            let mut seen = Seen::default();
            assert!(seen.first(b"g"));
            let mut out = Vec::new();
            let mut p = ProtoFilter::default();
            for c in bytes.chunks(chunk) {
                p.push(&mut seen, c, &mut out);
            }
            p.finish(&mut out);
            assert_eq!(p.failure(), None);
            assert_eq!(p.dropped_families, 1);
            let all = out.concat();
            let mut rest = &all[..];
            let mut names: Vec<MetricFamily> = Vec::new();
            while !rest.is_empty() {
                let f: MetricFamily = prost::Message::decode_length_delimited(&mut rest).unwrap();
                names.push(f);
            }
            assert_eq!(
                names
                    .iter()
                    .map(|f| f.name.clone().unwrap())
                    .collect::<Vec<_>>(),
                ["c_total", "h"]
            );
        }
        let mut p = ProtoFilter::default();
        p.push(
            &mut Seen::default(),
            &bytes[..bytes.len() - 1],
            &mut Vec::new(),
        );
        p.finish(&mut Vec::new());
        assert!(p.failure().is_some());
    }
}
