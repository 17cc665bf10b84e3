//! Logging set up from Istio's root logging flags (Istio `pkg/log/options.go`).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use tracing_subscriber::Layer;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The root logging flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogOptions {
    /// `--log_output_level`: comma list of `scope:level` or a bare level.
    pub output_level: String,
    /// `--log_as_json`: JSON lines.
    pub as_json: bool,
    /// `--log_target`: `stdout`, `stderr` or file paths.
    pub targets: Vec<String>,
    /// `--log_caller`: scopes that include caller info; any non-empty value
    /// turns on file/line for all output (we cannot attach it per scope).
    pub caller: String,
    /// `--log_stacktrace_level`: validated, otherwise unused (no Go stacks here).
    pub stacktrace_level: String,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            output_level: "default:info,grpc:none".to_owned(),
            as_json: false,
            targets: vec!["stdout".to_owned()],
            caller: String::new(),
            stacktrace_level: "default:none".to_owned(),
        }
    }
}

/// A logging setup problem.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    /// A level in a `scope:level` list is not one Istio knows.
    #[error(
        "invalid {flag}={value:?}: unknown level {level:?}, expected one of debug, info, warn, error, fatal, none"
    )]
    InvalidLevel {
        flag: &'static str,
        value: String,
        level: String,
    },
    /// A log file cannot be opened.
    #[error("cannot open --log_target={path:?}: {source}")]
    OpenTarget {
        path: String,
        #[source]
        source: io::Error,
    },
    /// A global subscriber is already installed.
    #[error("cannot install the log subscriber: {0}")]
    Install(String),
}

/// Istio scope names and the module targets they control.
const SCOPES: &[(&str, &[&str])] = &[
    ("sds", &["meshagent::sds"]),
    ("cache", &["meshagent::identity"]),
    ("ca", &["meshagent::identity"]),
    ("citadelclient", &["meshagent::identity"]),
    ("xdsproxy", &["meshagent::xds"]),
    ("dns", &["meshagent::dns"]),
    ("wasm", &["meshagent::wasm"]),
    ("envoy", &["meshagent::envoy"]),
    ("healthcheck", &["meshagent::status"]),
    ("status", &["meshagent::status"]),
    ("iptables", &["meshagent::iptables"]),
    ("grpc", &["tonic", "h2", "hyper"]),
];

fn parse_level(flag: &'static str, value: &str, level: &str) -> Result<LevelFilter, LoggingError> {
    Ok(match level {
        "debug" => LevelFilter::DEBUG,
        "info" => LevelFilter::INFO,
        "warn" => LevelFilter::WARN,
        "error" | "fatal" => LevelFilter::ERROR,
        "none" => LevelFilter::OFF,
        _ => {
            return Err(LoggingError::InvalidLevel {
                flag,
                value: value.to_owned(),
                level: level.to_owned(),
            });
        }
    })
}

/// Parses `--log_output_level` into a target filter, plus warnings for scopes
/// we do not know (accepted, like Istio, which creates scopes lazily).
pub fn build_filter(output_level: &str) -> Result<(Targets, Vec<String>), LoggingError> {
    const FLAG: &str = "--log_output_level";
    let mut default = LevelFilter::INFO;
    let mut targets: Vec<(&str, LevelFilter)> = Vec::new();
    let mut warnings = Vec::new();
    for item in output_level
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let (scope, level) = item.rsplit_once(':').unwrap_or(("default", item));
        let level = parse_level(FLAG, output_level, level)?;
        match scope {
            "default" => default = level,
            "all" => {
                default = level;
                targets.extend(
                    SCOPES
                        .iter()
                        .flat_map(|(_, t)| t.iter().map(|t| (*t, level))),
                );
            }
            _ => match SCOPES.iter().find(|(name, _)| *name == scope) {
                Some((_, mapped)) => targets.extend(mapped.iter().map(|t| (*t, level))),
                None => warnings.push(format!(
                    "unknown log scope {scope:?} in {FLAG}; ignoring it"
                )),
            },
        }
    }
    let filter = Targets::new().with_default(default).with_targets(targets);
    Ok((filter, warnings))
}

/// Installs the global subscriber. Returns warnings to log once it is up.
pub fn init(opts: &LogOptions) -> Result<Vec<String>, LoggingError> {
    let (filter, warnings) = build_filter(&opts.output_level)?;
    for item in opts.stacktrace_level.split(',').filter(|s| !s.is_empty()) {
        let level = item.rsplit_once(':').map_or(item, |(_, l)| l);
        parse_level("--log_stacktrace_level", &opts.stacktrace_level, level)?;
    }
    let writer = LogWriter::open(&opts.targets)?;
    let caller = !opts.caller.is_empty();
    let layer = if opts.as_json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(writer)
            .with_file(caller)
            .with_line_number(caller)
            .with_filter(filter)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(false)
            .with_file(caller)
            .with_line_number(caller)
            .with_filter(filter)
            .boxed()
    };
    tracing_subscriber::registry()
        .with(layer)
        .try_init()
        .map_err(|e| LoggingError::Install(e.to_string()))?;
    Ok(warnings)
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
        for t in self.0.iter() {
            match t {
                Target::Stdout => io::stdout().write_all(buf)?,
                Target::Stderr => io::stderr().write_all(buf)?,
                Target::File(f) => f
                    .lock()
                    .map_err(|_| io::Error::other("log file lock poisoned"))?
                    .write_all(buf)?,
            }
        }
        Ok(buf.len())
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

#[cfg(test)]
mod tests {
    use super::*;
    use tracing::Level;

    fn enabled(t: &Targets, target: &str, level: Level) -> bool {
        t.would_enable(target, &level)
    }

    #[test]
    fn default_output_level() {
        let (t, w) = build_filter("default:info,grpc:none").unwrap();
        assert!(w.is_empty());
        assert!(enabled(&t, "meshagent::sds", Level::INFO));
        assert!(!enabled(&t, "meshagent::sds", Level::DEBUG));
        assert!(!enabled(&t, "tonic::transport", Level::ERROR));
        assert!(!enabled(&t, "h2", Level::ERROR));
    }

    #[test]
    fn scopes_and_levels() {
        let (t, _) = build_filter("warn,sds:debug,xdsproxy:fatal").unwrap();
        assert!(!enabled(&t, "meshagent::config", Level::INFO));
        assert!(enabled(&t, "meshagent::config", Level::WARN));
        assert!(enabled(&t, "meshagent::sds::server", Level::DEBUG));
        assert!(enabled(&t, "meshagent::xds", Level::ERROR));
        assert!(!enabled(&t, "meshagent::xds", Level::WARN));
    }

    #[test]
    fn unknown_scope_warns() {
        let (_, w) = build_filter("default:info,klog:debug").unwrap();
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("klog"), "{w:?}");
    }

    #[test]
    fn bad_level_is_an_error() {
        let err = build_filter("default:verbose").unwrap_err().to_string();
        assert!(err.contains("--log_output_level"), "{err}");
        assert!(err.contains("default:verbose"), "{err}");
        assert!(err.contains("verbose"), "{err}");
    }
}
