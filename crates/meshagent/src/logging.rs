//! Logging in Istio's `pkg/log` format, set up from Istio's root logging flags
//! (`pkg/log/options.go`).
//!
//! Log pipelines parse pilot-agent's output, so every line — from the first, including
//! configuration errors and `istio-iptables` — has exactly Istio's layout (zap's console and
//! JSON encoders with the encoder config of `pkg/log/config.go`):
//!
//! ```text
//! 2026-12-06T22:22:25.330563Z\twarn\txdsproxy\tstream closed\tid=3 dur=5s
//! {"level":"warn","time":"2026-12-06T22:22:25.333802Z","scope":"xdsproxy","msg":"stream closed","id":3,"dur":"5s"}
//! ```
//!
//! (`\t` is a tab.)
//!
//! - time: UTC with microseconds and `Z` (`formatDate` in `pkg/log/config.go`);
//! - level: lower case (`zapcore.LowercaseLevelEncoder`);
//! - scope: the Istio scope name; omitted for `default` (`pkg/log/scope.go` leaves
//!   `nameToEmit` empty for it, and zap drops an empty logger name);
//! - caller (`--log_caller`): `dir/file.rs:line` (`zapcore.ShortCallerEncoder`);
//! - text: fields follow the message after a tab as space-separated `k=v`, values
//!   unquoted (`Scope.emit` builds `msg\tk=v k=v` from labels); JSON: fields follow `msg`
//!   as keys of their own, in the order the event gives them;
//! - fields of the spans around an event follow the event's own, outermost span first; a key
//!   the event (or an inner span) already has is not repeated. Istio has no spans.
//!
//! The scope of an event comes from its target (the Rust module path) through
//! [`TARGET_SCOPES`]: each module gets the scope Istio registers for the same concern.

use std::collections::{HashMap, VecDeque};
use std::fmt::{self, Write as _};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::sync::atomic::{AtomicU8, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::layer::{Context, Filter, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// The root logging flags, as given (Istio `pkg/log/options.go`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogOptions {
    /// `--log_output_level`: comma list of `scope:level` or a bare level (the `default`
    /// scope); applied after Istio's built-in `default:info,grpc:none`.
    pub output_level: String,
    /// `--log_as_json`: JSON lines.
    pub as_json: bool,
    /// `--log_target`: `stdout`, `stderr` or file paths.
    pub targets: Vec<String>,
    /// `--log_caller`: scopes (or `all`) whose lines carry the caller's `file:line`.
    pub caller: String,
    /// `--log_stacktrace_level`: `scope:level` list; lines at or above it carry a stack.
    pub stacktrace_level: String,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            output_level: String::new(),
            as_json: false,
            targets: vec!["stdout".to_owned()],
            caller: String::new(),
            stacktrace_level: "default:none".to_owned(),
        }
    }
}

/// A logging setup problem. The messages are Istio's (`convertScopedLevel` in
/// `pkg/log/options.go`), since scripts match them.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    /// A level in a `scope:level` list is not one Istio knows.
    #[error("invalid output level '{0}'")]
    InvalidLevel(String),
    /// An item with more than one `:`.
    #[error("invalid output level format '{0}'")]
    InvalidFormat(String),
    /// A log file cannot be opened.
    #[error("couldn't open sink \"{path}\": {source}")]
    OpenTarget {
        path: String,
        #[source]
        source: io::Error,
    },
    /// A global subscriber is already installed.
    #[error("cannot install the log subscriber: {0}")]
    Install(String),
}

/// Istio's built-in levels, before `--log_output_level` (`DefaultOptions` in
/// `pkg/log/options.go`).
const DEFAULT_OUTPUT_LEVELS: &str = "default:info,grpc:none";

/// `--log_output_level` / `--log_caller` name that means every scope (`OverrideScopeName`).
const ALL: &str = "all";

/// The scopes pilot-agent registers (its `--help` lists them). Levels of other names are
/// ignored without a word, as Istio's `processLevels` does.
pub const SCOPES: &[&str] = &[
    "ads",
    "ca",
    "cache",
    "citadelclient",
    "default",
    "dns",
    "gcecred",
    "grpc",
    "healthcheck",
    "klog",
    "mockcred",
    "monitoring",
    "probes",
    "sds",
    "security",
    "spiffe",
    "validation",
    "wasm",
    "xdsproxy",
];

/// Module path prefix → Istio scope, longest prefix first where they nest. Anything not
/// listed is `default`, which is also what Istio uses for the agent's command, Envoy
/// supervision (`pkg/envoy`), the status server, bootstrap, platform metadata and
/// `istio-iptables` (`tools/istio-iptables` logs through the default scope).
pub const TARGET_SCOPES: &[(&str, &str)] = &[
    // security/pkg/nodeagent/caclient/providers/citadel/client.go
    ("meshagent::identity::caclient", "citadelclient"),
    // security/pkg/nodeagent/cache/secretcache.go: keys, certificates, rotation, files.
    ("meshagent::identity", "cache"),
    ("meshagent::control_plane", "cache"),
    // security/pkg/nodeagent/sds/sdsservice.go
    ("meshagent::identity::sds", "sds"),
    // pkg/istio-agent/xds_proxy.go
    ("meshagent::xds", "xdsproxy"),
    // pkg/dns/client/dns.go
    ("meshagent::dns", "dns"),
    // pkg/wasm/cache.go
    ("meshagent::wasm", "wasm"),
    // pilot/cmd/pilot-agent/status/server.go: forwarded application probes.
    ("meshagent::status::probes", "probes"),
    // gRPC library logging (pkg/log/config.go captures grpclog into `grpc`, off by default).
    ("tonic", "grpc"),
    ("h2", "grpc"),
    ("hyper", "grpc"),
    ("hyper_util", "grpc"),
    ("tower", "grpc"),
];

/// The Istio scope of a target (a Rust module path).
pub fn scope_of(target: &str) -> &'static str {
    TARGET_SCOPES
        .iter()
        .filter(|(prefix, _)| {
            target
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
        })
        .max_by_key(|(prefix, _)| prefix.len())
        .map_or("default", |(_, scope)| scope)
}

fn level_code(l: LevelFilter) -> u8 {
    match l.into_level() {
        None => 0,
        Some(Level::ERROR) => 1,
        Some(Level::WARN) => 2,
        Some(Level::INFO) => 3,
        Some(Level::DEBUG) => 4,
        Some(_) => 5,
    }
}

fn level_of_code(c: u8) -> LevelFilter {
    match c {
        0 => LevelFilter::OFF,
        1 => LevelFilter::ERROR,
        2 => LevelFilter::WARN,
        3 => LevelFilter::INFO,
        4 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// Istio's name of a level (`none` for off: `fatal`/`none` both hide everything here).
pub fn level_name_of(l: LevelFilter) -> &'static str {
    match level_code(l) {
        0 => "none",
        1 => "error",
        2 => "warn",
        3 => "info",
        4 => "debug",
        _ => "debug",
    }
}

/// `debug`, `info`, … as a filter: `fatal` and `none` show nothing here (a scope at `fatal`
/// hides errors in Istio, and the agent logs nothing at fatal).
fn parse_level(level: &str) -> Option<LevelFilter> {
    Some(match level {
        "debug" => LevelFilter::DEBUG,
        "info" => LevelFilter::INFO,
        "warn" => LevelFilter::WARN,
        "error" => LevelFilter::ERROR,
        "fatal" | "none" => LevelFilter::OFF,
        _ => return None,
    })
}

/// Istio's `processLevels`: each comma item is `scope:level` or a bare level for `default`;
/// `all` sets every scope; later items win; unknown scopes are ignored. Every item must
/// parse — there is no trimming and an empty item is an invalid level, as in Istio.
fn apply_levels(
    levels: &mut HashMap<&'static str, LevelFilter>,
    arg: &str,
) -> Result<(), LoggingError> {
    for item in arg.split(',') {
        let pieces: Vec<&str> = item.split(':').collect();
        let (scope, level) = match pieces.as_slice() {
            [level] => ("default", *level),
            [scope, level] => (*scope, *level),
            _ => return Err(LoggingError::InvalidFormat(item.to_owned())),
        };
        let level = parse_level(level).ok_or_else(|| LoggingError::InvalidLevel(level.into()))?;
        if scope == ALL {
            levels.values_mut().for_each(|l| *l = level);
        } else if let Some(l) = levels.get_mut(scope) {
            *l = level;
        }
    }
    Ok(())
}

/// Per-scope output levels, stack-trace levels and caller flags.
#[derive(Debug, Clone)]
pub struct ScopeConfig {
    /// The levels from the flags (`/logging?reset` returns to them).
    output: HashMap<&'static str, LevelFilter>,
    /// The levels in force, one per [`SCOPES`] entry: the status server's `/logging` changes
    /// them at run time, so the filter reads them on each event (a relaxed atomic load; Istio
    /// reads an atomic per scope too, `pkg/log/scope.go` `outputLevel`).
    live: Arc<[AtomicU8]>,
    stack: HashMap<&'static str, LevelFilter>,
    callers: HashMap<&'static str, bool>,
}

impl ScopeConfig {
    /// Parses the three per-scope flags the way Istio's `updateScopes` does.
    pub fn parse(opts: &LogOptions) -> Result<Self, LoggingError> {
        let mut output: HashMap<_, _> = SCOPES.iter().map(|s| (*s, LevelFilter::INFO)).collect();
        let levels = if opts.output_level.is_empty() {
            DEFAULT_OUTPUT_LEVELS.to_owned()
        } else {
            format!("{DEFAULT_OUTPUT_LEVELS},{}", opts.output_level)
        };
        apply_levels(&mut output, &levels)?;
        let mut stack: HashMap<_, _> = SCOPES.iter().map(|s| (*s, LevelFilter::OFF)).collect();
        apply_levels(&mut stack, &opts.stacktrace_level)?;
        let mut callers: HashMap<_, _> = SCOPES.iter().map(|s| (*s, false)).collect();
        for name in opts.caller.split(',') {
            if name == ALL {
                callers.values_mut().for_each(|c| *c = true);
            } else if let Some(c) = callers.get_mut(name) {
                *c = true;
            }
        }
        let live = SCOPES
            .iter()
            .map(|s| AtomicU8::new(level_code(output[s])))
            .collect();
        Ok(Self {
            output,
            live,
            stack,
            callers,
        })
    }

    /// The output level of `scope` in force (every scope we map to is in [`SCOPES`]).
    pub fn level(&self, scope: &str) -> LevelFilter {
        SCOPES
            .binary_search(&scope)
            .ok()
            .and_then(|i| self.live.get(i))
            .map_or(LevelFilter::INFO, |l| {
                level_of_code(l.load(AtomicOrdering::Relaxed))
            })
    }

    /// Every scope with its level in force, in [`SCOPES`] order.
    pub fn levels(&self) -> Vec<(&'static str, LevelFilter)> {
        SCOPES.iter().map(|s| (*s, self.level(s))).collect()
    }

    /// Applies `scope:level[,scope:level]` (the `--log_output_level` syntax) on top of the
    /// levels in force; nothing changes when any item is invalid.
    pub fn update(&self, arg: &str) -> Result<(), LoggingError> {
        let mut levels: HashMap<&'static str, LevelFilter> = self.levels().into_iter().collect();
        apply_levels(&mut levels, arg)?;
        self.store(&levels);
        Ok(())
    }

    /// Back to the levels the flags gave.
    pub fn reset(&self) {
        self.store(&self.output);
    }

    fn store(&self, levels: &HashMap<&'static str, LevelFilter>) {
        for (i, s) in SCOPES.iter().enumerate() {
            if let (Some(l), Some(a)) = (levels.get(s), self.live.get(i)) {
                a.store(level_code(*l), AtomicOrdering::Relaxed);
            }
        }
    }

    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        self.level(scope_of(meta.target())) >= *meta.level()
    }

    fn caller(&self, scope: &str) -> bool {
        self.callers.get(scope).copied().unwrap_or(false)
    }

    /// Istio's `dumpStack` (`pkg/log/zapcore_handler.go`): the default scope compares the
    /// line's level; every other scope compares `error` whatever the line's level, so
    /// `xdsproxy:error` puts a stack on all of its lines and `xdsproxy:warn` does too.
    fn stack(&self, scope: &str, level: &Level) -> bool {
        let thresh = if scope == "default" {
            *level
        } else {
            Level::ERROR
        };
        self.stack
            .get(scope)
            .is_some_and(|l| *l != LevelFilter::OFF && *l >= thresh)
    }
}

/// The per-scope output levels as a `tracing` filter. Levels are fixed once the process has
/// parsed its flags, so each callsite's interest is decided once.
#[derive(Debug, Clone)]
struct ScopeFilter(Arc<ScopeConfig>);

impl<S> Filter<S> for ScopeFilter {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        self.0.enabled(meta)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        // Events bridged from the `log` crate share one callsite; decide those per event.
        if meta.target() == "log" || meta.name().starts_with("log event") {
            return tracing::subscriber::Interest::sometimes();
        }
        if self.0.enabled(meta) {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        self.0.levels().into_iter().map(|(_, l)| l).max()
    }
}

/// One field value, kept typed so JSON gets numbers and booleans as Istio's zap fields do.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(String),
    I64(i64),
    U64(u64),
    F64(f64),
    Bool(bool),
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Str(s) => f.write_str(s),
            Value::I64(v) => write!(f, "{v}"),
            Value::U64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
        }
    }
}

impl Value {
    fn write_json(&self, out: &mut String) {
        match self {
            Value::Str(s) => json_string(out, s),
            Value::F64(v) if !v.is_finite() => json_string(out, &v.to_string()),
            other => {
                let _ = write!(out, "{other}");
            }
        }
    }
}

/// A JSON string literal (`serde_json`'s escaping: quotes, backslashes, control characters).
fn json_string(out: &mut String, s: &str) {
    out.push_str(&serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned()));
}

/// Fields of an event or span, in the order given.
#[derive(Debug, Default)]
struct Fields {
    message: Option<String>,
    fields: Vec<(&'static str, Value)>,
    /// The `log` crate's target/file/line when the event came through `tracing-log`.
    log_target: Option<String>,
    log_file: Option<String>,
    log_line: Option<u64>,
}

impl Fields {
    fn put(&mut self, field: &Field, value: Value) {
        match (field.name(), value) {
            ("message", v) => self.message = Some(v.to_string()),
            ("log.target", v) => self.log_target = Some(v.to_string()),
            ("log.file", v) => self.log_file = Some(v.to_string()),
            ("log.line", Value::U64(v)) => self.log_line = Some(v),
            ("log.line", Value::I64(v)) => self.log_line = u64::try_from(v).ok(),
            (name, _) if name.starts_with("log.") => {}
            (name, v) => match self.fields.iter_mut().find(|(k, _)| *k == name) {
                Some(slot) => slot.1 = v,
                None => self.fields.push((name, v)),
            },
        }
    }
}

impl Visit for Fields {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, Value::F64(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::I64(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::U64(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::Bool(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::Str(value.to_owned()));
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, Value::Str(value.to_string()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, Value::Str(format!("{value:?}")));
    }
}

/// Span fields, kept in the span's extensions by [`SpanFieldsLayer`].
#[derive(Debug, Default)]
struct SpanFields(Vec<(&'static str, Value)>);

/// Records span fields typed, for [`IstioFormat`] to append to events inside the span.
struct SpanFieldsLayer;

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for SpanFieldsLayer {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut f = Fields::default();
        attrs.record(&mut f);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(f.fields));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        let mut f = Fields {
            fields: ext.remove::<SpanFields>().map(|s| s.0).unwrap_or_default(),
            ..Fields::default()
        };
        values.record(&mut f);
        ext.insert(SpanFields(f.fields));
    }
}

/// Istio's level names (`zapcore.LowercaseLevelEncoder`). Istio has no trace level.
fn level_name(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "error",
        Level::WARN => "warn",
        Level::INFO => "info",
        _ => "debug",
    }
}

/// `2026-12-06T22:22:25.330563Z`: UTC, microseconds, `Z` (`formatDate` in
/// `pkg/log/config.go`).
pub fn format_time(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, day) = civil_from_days(i64::try_from(days).unwrap_or(0));
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// Days since 1970-01-01 → (year, month, day) in the proleptic Gregorian calendar, counted
/// in 400-year eras from 0000-03-01 so leap days fall at the end of each year.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `dir/file.rs:line`, zap's `ShortCallerEncoder` (the last directory and the file).
fn short_caller(file: &str, line: u32) -> String {
    let mut parts = file.rsplitn(3, '/');
    let name = parts.next().unwrap_or(file);
    match parts.next() {
        Some(dir) => format!("{dir}/{name}:{line}"),
        None => format!("{name}:{line}"),
    }
}

/// One log line's parts, rendered in Istio's text or JSON layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Line<'a> {
    pub time: String,
    pub level: &'static str,
    pub scope: &'a str,
    pub caller: Option<String>,
    pub msg: &'a str,
    pub fields: &'a [(&'a str, Value)],
    pub stack: Option<String>,
}

impl Line<'_> {
    /// zap's console encoder: tab-separated time, level, scope (not for `default`),
    /// caller, then the message with `\tk=v k=v` labels (`Scope.emit`), and a stack on the
    /// next line.
    pub fn text(&self) -> String {
        let mut out = String::with_capacity(64 + self.msg.len());
        out.push_str(&self.time);
        out.push('\t');
        out.push_str(self.level);
        if self.scope != "default" {
            out.push('\t');
            out.push_str(self.scope);
        }
        if let Some(c) = &self.caller {
            out.push('\t');
            out.push_str(c);
        }
        out.push('\t');
        out.push_str(self.msg);
        for (i, (k, v)) in self.fields.iter().enumerate() {
            out.push(if i == 0 { '\t' } else { ' ' });
            let _ = write!(out, "{k}={v}");
        }
        if let Some(s) = &self.stack {
            out.push('\n');
            out.push_str(s.trim_end());
        }
        out.push('\n');
        out
    }

    /// zap's JSON encoder with Istio's keys: `level`, `time`, `scope` (not for `default`),
    /// `caller`, `msg`, the fields, `stack`.
    pub fn json(&self) -> String {
        let mut out = String::with_capacity(96 + self.msg.len());
        out.push_str("{\"level\":");
        json_string(&mut out, self.level);
        out.push_str(",\"time\":");
        json_string(&mut out, &self.time);
        if self.scope != "default" {
            out.push_str(",\"scope\":");
            json_string(&mut out, self.scope);
        }
        if let Some(c) = &self.caller {
            out.push_str(",\"caller\":");
            json_string(&mut out, c);
        }
        out.push_str(",\"msg\":");
        json_string(&mut out, self.msg);
        for (k, v) in self.fields {
            out.push(',');
            json_string(&mut out, k);
            out.push(':');
            v.write_json(&mut out);
        }
        if let Some(s) = &self.stack {
            out.push_str(",\"stack\":");
            json_string(&mut out, s.trim_end());
        }
        out.push_str("}\n");
        out
    }
}

/// The `FormatEvent` that writes Istio's lines.
pub struct IstioFormat {
    json: bool,
    scopes: Arc<ScopeConfig>,
}

impl<S, N> FormatEvent<S, N> for IstioFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut f = Fields::default();
        event.record(&mut f);
        let target = f.log_target.as_deref().unwrap_or(meta.target());
        let scope = scope_of(target);
        // `log` crate events share one callsite; their level check happens here.
        if f.log_target.is_some() && self.scopes.level(scope) < *meta.level() {
            return Ok(());
        }
        if let Some(spans) = ctx.event_scope() {
            let mut inherited: Vec<(&'static str, Value)> = Vec::new();
            // Innermost first, so an inner span's value wins over an outer one's.
            for span in spans {
                if let Some(SpanFields(sf)) = span.extensions().get::<SpanFields>() {
                    for (k, v) in sf {
                        if !f.fields.iter().any(|(e, _)| e == k)
                            && !inherited.iter().any(|(e, _)| e == k)
                        {
                            inherited.push((k, v.clone()));
                        }
                    }
                }
            }
            // ...and the outermost span's fields come first on the line.
            f.fields.extend(inherited.into_iter().rev());
        }
        let caller = self.scopes.caller(scope).then(|| {
            let file = f.log_file.as_deref().or(meta.file()).unwrap_or("?");
            let line = f.log_line.and_then(|l| u32::try_from(l).ok());
            short_caller(file, line.or(meta.line()).unwrap_or(0))
        });
        let stack = self
            .scopes
            .stack(scope, meta.level())
            .then(|| std::backtrace::Backtrace::force_capture().to_string());
        let fields: Vec<(&str, Value)> = f.fields.into_iter().collect();
        let line = Line {
            time: format_time(SystemTime::now()),
            level: level_name(meta.level()),
            scope,
            caller,
            msg: f.message.as_deref().unwrap_or(""),
            fields: &fields,
            stack,
        };
        writer.write_str(&if self.json { line.json() } else { line.text() })
    }
}

/// Go's `time.Duration.String()` (`5s`, `1m30s`, `500ms`) for duration fields, as Istio's
/// `zapcore.StringDurationEncoder` and `fmt.Sprint` print them: `retry_in = %dur(d)`.
pub fn dur(d: Duration) -> String {
    crate::config::parse::go_duration_string(d)
}

/// A list as Go's `fmt.Sprint` prints a slice (`[192.0.2.2 fd00::2]`), which is how Istio's
/// labels show lists (`ips=[…]` on its "Proxy role" line): `ips = %list(&node.ips)`.
pub fn list<T: fmt::Display>(items: impl IntoIterator<Item = T>) -> String {
    let mut out = String::from("[");
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let _ = write!(out, "{item}");
    }
    out.push(']');
    out
}

/// The subscriber: span fields recorded for [`IstioFormat`], which writes to `writer`, all
/// behind the per-scope levels.
fn subscriber<W>(scopes: Arc<ScopeConfig>, json: bool, writer: W) -> impl Subscriber + Send + Sync
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(false)
        .event_format(IstioFormat {
            json,
            scopes: scopes.clone(),
        });
    tracing_subscriber::registry().with(
        SpanFieldsLayer
            .and_then(fmt)
            .with_filter(ScopeFilter(scopes)),
    )
}

/// Whether the installed subscriber writes to stderr: then an error already logged must
/// not be printed there a second time, unformatted.
static TO_STDERR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the logs go to stderr (see [`init`]).
pub fn logs_to_stderr() -> bool {
    TO_STDERR.load(std::sync::atomic::Ordering::Relaxed)
}

/// The installed subscriber's scopes, for the status server's `/logging`.
static INSTALLED: std::sync::OnceLock<Arc<ScopeConfig>> = std::sync::OnceLock::new();

/// Installs the global subscriber.
pub fn init(opts: &LogOptions) -> Result<(), LoggingError> {
    let scopes = Arc::new(ScopeConfig::parse(opts)?);
    let writer = LogWriter::open(&opts.targets)?;
    let to_stderr = writer.0.iter().any(|t| matches!(t, Target::Stderr));
    subscriber(scopes.clone(), opts.as_json, writer)
        .try_init()
        .map_err(|e| LoggingError::Install(e.to_string()))?;
    let _ = INSTALLED.set(scopes);
    TO_STDERR.store(to_stderr, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// The scope levels in force, `None` when this process installed no subscriber (tests).
pub fn levels() -> Option<Vec<(&'static str, &'static str)>> {
    INSTALLED.get().map(|s| {
        s.levels()
            .into_iter()
            .map(|(k, l)| (k, level_name_of(l)))
            .collect()
    })
}

/// Changes levels at run time (`--log_output_level` syntax), or resets them to the flags'
/// with `arg == None`. Every callsite's cached interest is recomputed, so a scope raised to
/// `debug` logs at once and one lowered stops costing anything.
pub fn set_levels(arg: Option<&str>) -> Result<(), LoggingError> {
    let Some(s) = INSTALLED.get() else {
        return Err(LoggingError::Install("no log subscriber installed".into()));
    };
    match arg {
        Some(a) => s.update(a)?,
        None => s.reset(),
    }
    tracing::callsite::rebuild_interest_cache();
    Ok(())
}

/// [`init`], or — when the flags are invalid — Istio's defaults (text on stdout, as
/// `pkg/log` configures itself before flags are read) so the error that follows is a log
/// line like every other. Returns the flag error for the caller to log and exit on.
pub fn init_or_default(opts: &LogOptions, fallback_target: &str) -> Result<(), LoggingError> {
    match init(opts) {
        Ok(()) => Ok(()),
        Err(e) => {
            let defaults = LogOptions {
                targets: vec![fallback_target.to_owned()],
                ..LogOptions::default()
            };
            let _ = init(&defaults);
            Err(e)
        }
    }
}

/// One log destination.
#[derive(Clone)]
enum Target {
    Stdout,
    Stderr,
    File(Arc<Mutex<File>>),
}

/// Every `--log_target`, written to in turn.
#[derive(Clone)]
struct LogWriter(Arc<Vec<Target>>);

impl LogWriter {
    #[allow(
        clippy::disallowed_methods,
        reason = "log files open at start, before the runtime exists"
    )]
    fn open(paths: &[String]) -> Result<Self, LoggingError> {
        let mut out = Vec::new();
        for p in paths.iter().flat_map(|p| p.split(',')).map(str::trim) {
            out.push(match p {
                "" => continue,
                "stdout" => Target::Stdout,
                "stderr" => Target::Stderr,
                path => {
                    let file = OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                        .map_err(|source| LoggingError::OpenTarget {
                            path: path.to_owned(),
                            source,
                        })?;
                    Target::File(Arc::new(Mutex::new(file)))
                }
            });
        }
        if out.is_empty() {
            out.push(Target::Stdout);
        }
        Ok(Self(Arc::new(out)))
    }
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // The formatter hands each line over in one write.
        RECENT.push(buf);
        // Every target gets the line even if an earlier one fails (a closed stdout pipe must
        // not cost the log file its lines).
        let mut result = Ok(buf.len());
        for t in self.0.iter() {
            let r = match t {
                Target::Stdout => io::stdout().write_all(buf),
                Target::Stderr => io::stderr().write_all(buf),
                Target::File(f) => f
                    .lock()
                    .map_err(|_| io::Error::other("log file lock poisoned"))
                    .and_then(|mut f| f.write_all(buf)),
            };
            if let Err(e) = r {
                result = Err(e);
            }
        }
        result
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Bytes of formatted lines [`RECENT`] keeps: a few hundred lines, enough to see what led up
/// to a problem in a debug bundle, small next to the agent's resident set (and only filled
/// as lines are written).
pub const RECENT_BYTES: usize = 64 * 1024;

/// The last lines written, exactly as formatted (text or JSON), oldest first; served on the
/// status port's loopback-only `/debug/logs` and collected by `meshagent debug bundle`.
/// Istio's agent keeps nothing (its logs exist only where the container runtime put them).
pub static RECENT: LogRing = LogRing::new(RECENT_BYTES);

/// A byte-bounded ring of log lines: the oldest lines leave to make room, and a single line
/// longer than the whole bound is cut to it.
pub struct LogRing {
    cap: usize,
    inner: Mutex<RingInner>,
}

struct RingInner {
    lines: VecDeque<Box<[u8]>>,
    bytes: usize,
}

impl LogRing {
    /// An empty ring holding at most `cap` bytes.
    pub const fn new(cap: usize) -> Self {
        Self {
            cap,
            inner: Mutex::new(RingInner {
                lines: VecDeque::new(),
                bytes: 0,
            }),
        }
    }

    /// Appends one formatted line.
    pub fn push(&self, line: &[u8]) {
        if self.cap == 0 || line.is_empty() {
            return;
        }
        let line = &line[..line.len().min(self.cap)];
        let mut r = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while r.bytes + line.len() > self.cap {
            match r.lines.pop_front() {
                Some(old) => r.bytes -= old.len(),
                None => break,
            }
        }
        r.bytes += line.len();
        r.lines.push_back(line.into());
    }

    /// The last `n` lines (all with `None`), oldest first, as one text.
    pub fn last(&self, n: Option<usize>) -> String {
        let r = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let skip = n.map_or(0, |n| r.lines.len().saturating_sub(n));
        let mut out = Vec::with_capacity(r.bytes);
        for l in r.lines.iter().skip(skip) {
            out.extend_from_slice(l);
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Lines and bytes held.
    pub fn len(&self) -> (usize, usize) {
        let r = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (r.lines.len(), r.bytes)
    }

    /// Whether no line is held.
    pub fn is_empty(&self) -> bool {
        self.len().0 == 0
    }
}

#[cfg(test)]
mod tests;
