//! `meshagent debug bundle [-o file.tar.gz]`: one archive for a bug report, collected inside
//! the pod from the agent's status port, Envoy's admin and the pod's network rules. Istio's
//! agent has no such command (operators collect the same pieces by hand with
//! `pilot-agent request` and `istioctl proxy-config`).
//!
//! Every piece has a deadline and a byte bound, and a piece that cannot be collected is a
//! line in `MANIFEST.txt`, never a failed bundle. Keys and tokens never enter the archive:
//! JSON is redacted by key (`private_key`, `password`, header maps…, [`redact_json`]), and
//! every file is then scrubbed of the credentials the bundle can know (the projected token,
//! `XDS_HEADER_*`/`CA_HEADER_*` values), of any PEM private key block and of anything shaped
//! like a JWT ([`Scrubber`]).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::future::BoxFuture;
use http::Method;
use serde_json::Value;
use tokio::io::AsyncReadExt;

use crate::config::{self, EnvSource};
use crate::http_client::{self, Call};

/// The archive's top directory.
pub const ROOT: &str = "meshagent-debug";
/// Largest body read from the status port or Envoy's admin. A config dump of a large mesh is
/// tens of MiB; anything above this is noted in the manifest instead.
pub const MAX_BODY: usize = 256 * 1024 * 1024;
/// Largest output kept from a command (`iptables-save`, `nft`).
const MAX_COMMAND_OUTPUT: usize = 16 * 1024 * 1024;
/// Largest token file read (to scrub it): projected tokens are about 1 KiB.
const MAX_TOKEN: u64 = 64 * 1024;
/// What replaces a secret.
pub const REDACTED: &str = "[redacted]";

/// A value already redacted: ours, Envoy's (`[redacted]`) or the agent config's
/// (`<redacted>`), or nothing at all.
fn redacted(v: &Value) -> bool {
    v.is_null() || matches!(v.as_str(), Some("[redacted]" | "<redacted>"))
}

/// What to collect and where to put it.
#[derive(Debug, Clone)]
pub struct BundleOptions {
    /// The archive path; `None` writes to stdout.
    pub output: Option<PathBuf>,
    /// The agent's status server (15020 in a pod).
    pub status: SocketAddr,
    /// Envoy's admin; `None` takes `proxyAdminPort` from the agent's effective config
    /// (15000 when that is unavailable).
    pub admin: Option<SocketAddr>,
    /// Deadline of each fetch and command.
    pub timeout: Duration,
    /// How many of the agent's recent log lines to include.
    pub log_lines: usize,
    /// Where the pod's relative paths (the projected token) are read from; `.` in a pod.
    pub base_dir: PathBuf,
}

/// A bundle that could not be written (collection failures are only noted in it).
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("cannot write the bundle to {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the bundle writer stopped: {0}")]
    Join(String),
}

/// One file of the archive, or why it is missing.
#[derive(Debug)]
struct Piece {
    name: String,
    data: Result<Vec<u8>, String>,
    /// A remark for the manifest (e.g. how the piece was obtained).
    note: Option<String>,
    /// JSON to parse, redact by key and pretty-print before it is written (done with the
    /// scrubbing off the runtime thread, so a large config dump does not stall the fetches
    /// still running against their deadlines).
    json: bool,
}

impl Piece {
    fn ok(name: &str, data: Vec<u8>) -> Self {
        Self {
            name: name.to_owned(),
            data: Ok(data),
            note: None,
            json: false,
        }
    }

    fn json(name: &str, data: Vec<u8>) -> Self {
        Self {
            json: true,
            ..Self::ok(name, data)
        }
    }

    fn err(name: &str, e: impl Into<String>) -> Self {
        Self {
            name: name.to_owned(),
            data: Err(e.into()),
            note: None,
            json: false,
        }
    }
}

/// What was written: entries and the collection errors among them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub files: usize,
    pub errors: usize,
    pub redactions: usize,
}

/// GET `path` with the deadline; status and body (up to [`MAX_BODY`]).
async fn get(addr: SocketAddr, path: &str, timeout: Duration) -> Result<(u16, Bytes), String> {
    let call = Call::new(Method::GET, addr, path, timeout);
    let resp = http_client::send(&call).await.map_err(|e| e.to_string())?;
    let status = resp.status.as_u16();
    let body = resp.bytes(MAX_BODY).await.map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// A JSON view: 200 → JSON (redacted and pretty-printed by [`finish`]); anything else →
/// the reason.
async fn json_piece(name: &str, addr: SocketAddr, path: &str, timeout: Duration) -> Piece {
    match get(addr, path, timeout).await {
        Ok((200, body)) => Piece::json(name, body.to_vec()),
        Ok((code, body)) => Piece::err(name, status_error(path, code, &body)),
        Err(e) => Piece::err(name, e),
    }
}

/// A text view: 200 → the body as is.
async fn text_piece(name: &str, addr: SocketAddr, path: &str, timeout: Duration) -> Piece {
    match get(addr, path, timeout).await {
        Ok((200, body)) => Piece::ok(name, body.to_vec()),
        Ok((code, body)) => Piece::err(name, status_error(path, code, &body)),
        Err(e) => Piece::err(name, e),
    }
}

/// A readiness answer is worth keeping whatever its status: `<code>\n<body>`.
async fn status_piece(name: &str, addr: SocketAddr, path: &str, timeout: Duration) -> Piece {
    match get(addr, path, timeout).await {
        Ok((code, body)) => {
            let mut out = format!("{code}\n").into_bytes();
            out.extend_from_slice(&body);
            Piece::ok(name, out)
        }
        Err(e) => Piece::err(name, e),
    }
}

fn status_error(path: &str, code: u16, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(512)]);
    let text = text.trim();
    match (code, text) {
        (404, "{}" | "") => format!("GET {path}: 404 (not running in this agent)"),
        _ => format!("GET {path}: status {code}: {text}"),
    }
}

fn pretty(v: &Value) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(v).unwrap_or_default();
    out.push(b'\n');
    out
}

/// Keys whose whole value is a secret, wherever they appear (Envoy's `Secret` and
/// `DataSource` fields, OAuth/HMAC secrets, headers carrying credentials).
const SECRET_KEYS: &[&str] = &[
    "private_key",
    "privatekey",
    "password",
    "generic_secret",
    "session_ticket_keys",
    "hmac_secret",
    "client_secret",
    "token",
    "authorization",
];

/// Redacts secrets by key, in place: the value of a [`SECRET_KEYS`] key, and every value of
/// a header map (an object whose key ends in `headers`, e.g. the agent's `xds.headers` and
/// `identity.caHeaders`). Envoy's config dump already shows `private_key` as `[redacted]`;
/// this is the second line of defence should a version or an extension not.
pub fn redact_json(v: &mut Value) -> usize {
    let mut n = 0;
    match v {
        Value::Object(map) => {
            for (k, child) in map.iter_mut() {
                let key = k.to_ascii_lowercase();
                if SECRET_KEYS.contains(&key.as_str()) {
                    if !redacted(child) {
                        *child = Value::from(REDACTED);
                        n += 1;
                    }
                } else if key.ends_with("headers")
                    && let Value::Object(headers) = child
                {
                    for h in headers.values_mut() {
                        if !redacted(h) {
                            *h = Value::from(REDACTED);
                            n += 1;
                        }
                    }
                } else {
                    n += redact_json(child);
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                n += redact_json(item);
            }
        }
        _ => {}
    }
    n
}

/// Removes credentials from text: the known values (token, header values), PEM private key
/// blocks, and anything shaped like a JWT (three base64url segments, the first two starting
/// with `eyJ`, i.e. a JSON object).
#[derive(Debug, Clone, Default)]
pub struct Scrubber {
    known: Vec<String>,
}

impl Scrubber {
    /// A scrubber for `known` secret values (empty and whitespace-only ones are ignored).
    pub fn new(known: impl IntoIterator<Item = String>) -> Self {
        let mut known: Vec<String> = known
            .into_iter()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        // Longest first, so a value containing another is replaced whole.
        known.sort_by_key(|s| std::cmp::Reverse(s.len()));
        known.dedup();
        Self { known }
    }

    /// `text` without secrets, and how many were replaced.
    pub fn scrub(&self, text: &str) -> (String, usize) {
        let mut n = 0;
        let mut out = text.to_owned();
        for k in &self.known {
            let c = out.matches(k.as_str()).count();
            if c > 0 {
                n += c;
                out = out.replace(k.as_str(), REDACTED);
            }
        }
        let (out, c) = scrub_pem_keys(&out);
        n += c;
        let (out, c) = scrub_jwts(&out);
        (out, n + c)
    }
}

/// Replaces `-----BEGIN … PRIVATE KEY-----` … `-----END … PRIVATE KEY-----` blocks (an
/// unterminated one up to the end of the text).
fn scrub_pem_keys(text: &str) -> (String, usize) {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut n = 0;
    while let Some(begin) = rest.find("-----BEGIN ") {
        let after = &rest[begin..];
        let header_end = after[11..].find("-----").map(|i| i + 16);
        let is_key = header_end.is_some_and(|e| after[..e].contains("PRIVATE KEY"));
        let Some(header_end) = header_end.filter(|_| is_key) else {
            out.push_str(&rest[..begin + 11]);
            rest = &rest[begin + 11..];
            continue;
        };
        out.push_str(&rest[..begin]);
        out.push_str(REDACTED);
        n += 1;
        let body = &after[header_end..];
        rest = match body.find("-----END ") {
            Some(e) => {
                let tail = &body[e + 9..];
                match tail.find("-----") {
                    Some(t) => &tail[t + 5..],
                    None => "",
                }
            }
            None => "",
        };
    }
    out.push_str(rest);
    (out, n)
}

fn is_b64url(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'='
}

/// Replaces `eyJ….eyJ….sig` runs (JWS compact serialization of a JSON header and payload).
fn scrub_jwts(text: &str) -> (String, usize) {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut n = 0;
    let mut copied = 0;
    let mut i = 0;
    while let Some(off) = text[i..].find("eyJ") {
        let start = i + off;
        // Segment ends: header, payload, signature.
        let seg = |from: usize| {
            let mut j = from;
            while j < b.len() && is_b64url(b[j]) {
                j += 1;
            }
            j
        };
        let h_end = seg(start);
        let is_jwt =
            h_end < b.len() && b[h_end] == b'.' && text[h_end + 1..].starts_with("eyJ") && {
                let p_end = seg(h_end + 1);
                p_end < b.len() && b[p_end] == b'.' && seg(p_end + 1) > p_end + 1
            };
        if is_jwt {
            let p_end = seg(h_end + 1);
            let s_end = seg(p_end + 1);
            out.push_str(&text[copied..start]);
            out.push_str(REDACTED);
            copied = s_end;
            i = s_end;
            n += 1;
        } else {
            i = start + 3;
        }
    }
    out.push_str(&text[copied..]);
    (out, n)
}

/// Runs `program args` with the deadline; its stdout (bounded), or why not.
async fn command(program: &str, args: &[&str], timeout: Duration) -> Result<Vec<u8>, String> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("{program} is not installed (not found in PATH)"));
        }
        Err(e) => return Err(format!("cannot run {program}: {e}")),
    };
    let run = async {
        let mut out = Vec::new();
        let mut err = Vec::new();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let read_out = async {
            if let Some(s) = stdout {
                let _ = s
                    .take(MAX_COMMAND_OUTPUT as u64 + 1)
                    .read_to_end(&mut out)
                    .await;
            }
        };
        let read_err = async {
            if let Some(s) = stderr {
                let _ = s.take(4096).read_to_end(&mut err).await;
            }
        };
        tokio::join!(read_out, read_err);
        let status = child.wait().await;
        (out, err, status)
    };
    let (mut out, err, status) = tokio::time::timeout(timeout, run)
        .await
        .map_err(|_| format!("{program} did not finish within {timeout:?}"))?;
    let status = status.map_err(|e| format!("{program}: {e}"))?;
    if !status.success() {
        return Err(format!(
            "{program} {}: {status}: {}",
            args.join(" "),
            String::from_utf8_lossy(&err).trim()
        ));
    }
    if out.len() > MAX_COMMAND_OUTPUT {
        out.truncate(MAX_COMMAND_OUTPUT);
        out.extend_from_slice(b"\n[output cut at the bundle's limit]\n");
    }
    Ok(out)
}

async fn command_piece(name: &str, program: &str, args: &[&str], timeout: Duration) -> Piece {
    match command(program, args, timeout).await {
        Ok(out) => Piece::ok(name, out),
        Err(e) => Piece::err(name, e),
    }
}

/// The agent's effective configuration: its `/debug/config_dump` (served with `--profiling`,
/// the default), else the configuration this process derives from its own environment with
/// default flags (what `proxy --dump-config` prints), marked as such.
async fn effective_config(opts: &BundleOptions, env: &dyn EnvSource) -> (Piece, Option<Value>) {
    const NAME: &str = "agent/config.json";
    let served = get(opts.status, "/debug/config_dump", opts.timeout).await;
    let served_err = match served {
        Ok((200, body)) => match serde_json::from_slice::<Value>(&body) {
            Ok(mut v) => {
                let plain = v.clone();
                redact_json(&mut v);
                return (Piece::ok(NAME, pretty(&v)), Some(plain));
            }
            Err(e) => format!("GET /debug/config_dump: not JSON ({e})"),
        },
        Ok((code, body)) => status_error("/debug/config_dump", code, &body),
        Err(e) => e,
    };
    let flags = config::ProxyFlags::default();
    match config::load(&flags, env, &opts.base_dir) {
        Ok(cfg) => match serde_json::to_value(&cfg) {
            Ok(mut v) => {
                redact_json(&mut v);
                let mut p = Piece::ok(NAME, pretty(&v));
                p.note = Some(format!(
                    "derived by the bundle from its environment with default flags ({served_err})"
                ));
                (p, None)
            }
            Err(e) => (
                Piece::err(NAME, format!("{served_err}; cannot render: {e}")),
                None,
            ),
        },
        Err(e) => (
            Piece::err(
                NAME,
                format!("{served_err}; cannot derive it from the environment either: {e}"),
            ),
            None,
        ),
    }
}

/// Collects every piece and writes the archive.
pub async fn run(opts: &BundleOptions, env: &dyn EnvSource) -> Result<Summary, BundleError> {
    let started = SystemTime::now();
    let t = opts.timeout;
    let status = opts.status;
    let (config_piece, config) = effective_config(opts, env).await;
    let admin = opts.admin.unwrap_or_else(|| {
        let port = config
            .as_ref()
            .and_then(|c| c["proxyConfig"]["proxyAdminPort"].as_u64())
            .and_then(|p| u16::try_from(p).ok())
            .unwrap_or(15000);
        SocketAddr::from(([127, 0, 0, 1], port))
    });

    let logs = format!("/debug/logs?lines={}", opts.log_lines);
    let mut jobs: Vec<BoxFuture<'_, Piece>> = vec![
        Box::pin(json_piece("agent/certz.json", status, "/debug/certz", t)),
        Box::pin(json_piece("agent/xdsz.json", status, "/debug/xdsz", t)),
        Box::pin(json_piece("agent/dnsz.json", status, "/debug/dnsz", t)),
        Box::pin(json_piece("agent/ndsz.json", status, "/debug/ndsz", t)),
        Box::pin(json_piece("agent/wasmz.json", status, "/debug/wasmz", t)),
        Box::pin(json_piece("agent/logging.json", status, "/logging", t)),
        Box::pin(text_piece("agent/logs.txt", status, &logs, t)),
        Box::pin(status_piece("agent/ready.txt", status, "/healthz/ready", t)),
        Box::pin(text_piece("envoy/stats.txt", admin, "/stats", t)),
        Box::pin(text_piece("envoy/clusters.txt", admin, "/clusters", t)),
        Box::pin(text_piece("envoy/listeners.txt", admin, "/listeners", t)),
        Box::pin(json_piece("envoy/certs.json", admin, "/certs", t)),
        Box::pin(json_piece("envoy/init_dump.json", admin, "/init_dump", t)),
        Box::pin(status_piece("envoy/ready.txt", admin, "/ready", t)),
        Box::pin(json_piece(
            "envoy/config_dump.json",
            admin,
            "/config_dump?include_eds",
            t,
        )),
        Box::pin(command_piece(
            "net/iptables-save.txt",
            "iptables-save",
            &[],
            t,
        )),
        Box::pin(command_piece(
            "net/ip6tables-save.txt",
            "ip6tables-save",
            &[],
            t,
        )),
        Box::pin(command_piece(
            "net/nft-ruleset.txt",
            "nft",
            &["list", "ruleset"],
            t,
        )),
    ];
    let server_info = json_piece("envoy/server_info.json", admin, "/server_info", t);
    jobs.push(Box::pin(server_info));
    let mut pieces = vec![config_piece];
    pieces.extend(futures::future::join_all(jobs).await);

    let envoy_version = pieces
        .iter()
        .find(|p| p.name == "envoy/server_info.json")
        .and_then(|p| p.data.as_ref().ok())
        .and_then(|d| serde_json::from_slice::<Value>(d).ok())
        .and_then(|v| v["version"].as_str().map(str::to_owned));
    let versions = serde_json::json!({
        "agent": format!("meshagent {}", env!("CARGO_PKG_VERSION")),
        "istioCompatVersion": crate::ISTIO_COMPAT_VERSION,
        "envoy": envoy_version,
        "collectedAt": crate::logging::format_time(started),
        "statusPort": status.to_string(),
        "envoyAdmin": admin.to_string(),
    });
    pieces.push(Piece::ok("versions.json", pretty(&versions)));

    let scrubber = Scrubber::new(known_secrets(opts, env).await);
    let output = opts.output.clone();
    tokio::task::spawn_blocking(move || {
        let (entries, manifest, summary) = finish(pieces, &scrubber);
        write_archive(output.as_deref(), &entries, &manifest).map(|()| summary)
    })
    .await
    .map_err(|e| BundleError::Join(e.to_string()))?
}

/// The credentials this process can know: the projected token and the header values.
async fn known_secrets(opts: &BundleOptions, env: &dyn EnvSource) -> Vec<String> {
    let mut out = config::secret_env_values(env);
    let token = opts.base_dir.join(config::ISTIO_TOKEN_PATH);
    if let Ok(f) = tokio::fs::File::open(&token).await {
        let mut buf = Vec::new();
        if f.take(MAX_TOKEN).read_to_end(&mut buf).await.is_ok() {
            out.push(String::from_utf8_lossy(&buf).into_owned());
        }
    }
    out
}

/// Scrubs every piece and writes the manifest: `(entries, manifest, summary)`.
fn finish(pieces: Vec<Piece>, scrubber: &Scrubber) -> (Vec<(String, Vec<u8>)>, String, Summary) {
    let mut entries = Vec::new();
    let mut manifest = String::from(
        "# meshagent debug bundle: one line per file, tab-separated: path, bytes or ERROR, notes\n",
    );
    let mut summary = Summary {
        files: 0,
        errors: 0,
        redactions: 0,
    };
    for p in pieces {
        let mut by_key = 0;
        let data = match p.data {
            Ok(d) if p.json => match serde_json::from_slice::<Value>(&d) {
                Ok(mut v) => {
                    by_key = redact_json(&mut v);
                    Ok(pretty(&v))
                }
                Err(e) => Err(format!("not JSON ({e})")),
            },
            other => other,
        };
        match data {
            Ok(data) => {
                let text = String::from_utf8_lossy(&data);
                let (clean, n) = scrubber.scrub(&text);
                summary.redactions += n + by_key;
                let mut notes: Vec<String> = p.note.into_iter().collect();
                if by_key > 0 {
                    notes.push(format!("{by_key} value(s) redacted by key"));
                }
                if n > 0 {
                    notes.push(format!("{n} secret(s) scrubbed"));
                }
                manifest.push_str(&format!(
                    "{}\t{}\t{}\n",
                    p.name,
                    clean.len(),
                    notes.join("; ")
                ));
                entries.push((p.name, clean.into_bytes()));
                summary.files += 1;
            }
            Err(e) => {
                let (e, _) = scrubber.scrub(&e);
                manifest.push_str(&format!("{}\tERROR\t{}\n", p.name, e.replace('\n', " ")));
                summary.errors += 1;
            }
        }
    }
    (entries, manifest, summary)
}

#[allow(
    clippy::disallowed_methods,
    reason = "the debug bundle is its own short-lived command; the archive is written after every fetch ended"
)]
fn write_archive(
    output: Option<&Path>,
    entries: &[(String, Vec<u8>)],
    manifest: &str,
) -> Result<(), BundleError> {
    let shown = output.map_or_else(|| "stdout".to_owned(), |p| p.display().to_string());
    let wrap = |source: std::io::Error| BundleError::Write {
        path: shown.clone(),
        source,
    };
    let sink: Box<dyn Write> = match output {
        Some(p) => {
            use std::os::unix::fs::OpenOptionsExt;
            // The bundle describes the pod's configuration: readable by its owner only.
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(p)
                .map_err(wrap)?;
            Box::new(std::io::BufWriter::new(f))
        }
        None => Box::new(std::io::stdout().lock()),
    };
    let gz = flate2::write::GzEncoder::new(sink, flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    let mtime = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let manifest = ("MANIFEST.txt".to_owned(), manifest.as_bytes().to_vec());
    for (name, data) in std::iter::once(&manifest).chain(entries) {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o600);
        h.set_mtime(mtime);
        h.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut h, format!("{ROOT}/{name}"), data.as_slice())
            .map_err(wrap)?;
    }
    let gz = tar.into_inner().map_err(wrap)?;
    let mut sink = gz.finish().map_err(wrap)?;
    sink.flush().map_err(wrap)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_redaction_by_key() {
        let mut v = serde_json::json!({
            "dynamic_active_secrets": [{"secret": {"tls_certificate": {
                "certificate_chain": {"inline_bytes": "Q0VSVA=="},
                "private_key": {"inline_bytes": "S0VZ"}
            }}}, {"secret": {"generic_secret": {"secret": {"inline_string": "s3cr3t"}}}}],
            "xds": {"headers": {"AUTHORIZATION": "Bearer x"}},
            "routes": [{"match": {"headers": [{"name": "x-user"}]}}],
            "already": {"private_key": "[redacted]", "caHeaders": {"X": "<redacted>"}}
        });
        assert_eq!(redact_json(&mut v), 3);
        let tls = &v["dynamic_active_secrets"][0]["secret"]["tls_certificate"];
        assert_eq!(tls["private_key"], REDACTED);
        assert_eq!(tls["certificate_chain"]["inline_bytes"], "Q0VSVA==");
        assert_eq!(
            v["dynamic_active_secrets"][1]["secret"]["generic_secret"],
            REDACTED
        );
        assert_eq!(v["xds"]["headers"]["AUTHORIZATION"], REDACTED);
        // Header matchers (a list) are configuration, not credentials.
        assert_eq!(v["routes"][0]["match"]["headers"][0]["name"], "x-user");
    }

    #[test]
    fn scrubbing_known_values_keys_and_jwts() {
        let jwt = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl";
        let s = Scrubber::new(["hunter22".to_owned(), " ".to_owned()]);
        let text = format!(
            "a hunter22 b\ntoken={jwt} end\n-----BEGIN RSA PRIVATE KEY-----\nMIIE\n-----END RSA \
             PRIVATE KEY-----\n-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----\n\
             eyJnot.a.jwt eyJ"
        );
        let (out, n) = s.scrub(&text);
        assert_eq!(n, 3, "{out}");
        assert!(!out.contains("hunter22") && !out.contains(jwt) && !out.contains("MIIE"));
        assert!(out.contains("token=[redacted] end"), "{out}");
        assert!(out.contains("-----BEGIN CERTIFICATE-----\nMIIC"), "{out}");
        assert!(out.ends_with("eyJnot.a.jwt eyJ"), "{out}");
        // An unterminated key block goes to the end.
        let (out, n) = s.scrub("x -----BEGIN PRIVATE KEY-----\nMIIE");
        assert_eq!((out.as_str(), n), ("x [redacted]", 1));
    }

    #[test]
    fn manifest_lists_files_and_errors() {
        let pieces = vec![
            Piece::ok("a.txt", b"hello hunter22".to_vec()),
            Piece::err("b.txt", "GET /b: timed out"),
            Piece::json("c.json", br#"{"private_key":"k","x":1}"#.to_vec()),
            Piece::json("d.json", b"{not json".to_vec()),
        ];
        let (entries, manifest, summary) = finish(pieces, &Scrubber::new(["hunter22".into()]));
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0], ("a.txt".into(), b"hello [redacted]".to_vec()));
        let c: Value = serde_json::from_slice(&entries[1].1).unwrap();
        assert_eq!(c, serde_json::json!({"private_key": REDACTED, "x": 1}));
        assert!(manifest.contains("d.json\tERROR\tnot JSON"), "{manifest}");
        assert!(
            manifest.contains("c.json\t") && manifest.contains("\t1 value(s) redacted by key\n"),
            "{manifest}"
        );
        assert!(
            manifest.contains("a.txt\t16\t1 secret(s) scrubbed\n"),
            "{manifest}"
        );
        assert!(
            manifest.contains("b.txt\tERROR\tGET /b: timed out\n"),
            "{manifest}"
        );
        assert_eq!(
            summary,
            Summary {
                files: 2,
                errors: 2,
                redactions: 2
            }
        );
    }
}
