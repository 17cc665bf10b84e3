//! Custom bootstrap templates (`ISTIO_BOOTSTRAP`, `--templateFile`, ProxyConfig
//! `proxyBootstrapTemplatePath`), rendered with Go `text/template` semantics by the `gtmpl`
//! crate, with Istio's parameter names ([`super::params`]) and the functions Istio's renderer
//! provides (pkg/bootstrap/instance.go: sprig's generic functions; `toJSON`).
//!
//! Before parsing, the template is scanned: a function or a top-level parameter meshagent does
//! not provide is a startup error naming it and its line, not a silent `<no value>`.
//!
//! Known differences from Go's `text/template`, found by the tests below: `range` over a map
//! visits keys in hash order (Go sorts them); `range` over a missing value is an error (Go
//! iterates zero times; list parameters are therefore always present); `printf "%q"` does not
//! quote; printing a whole map or list uses Rust's debug form; `slice` is not available.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use gtmpl::{Context, Func, FuncError, Value as G};
use serde_json::{Map, Value};

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("cannot read bootstrap template {path} ({origin}): {source}", path = .path.display())]
    Read {
        path: PathBuf,
        origin: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "bootstrap template {path}:{line}: function {name:?} is not provided by meshagent \
         (available: Go's builtins, sprig's generic functions listed in docs/bootstrap.md, toJSON)",
        path = .path.display()
    )]
    UnknownFunction {
        path: PathBuf,
        line: usize,
        name: String,
    },
    #[error(
        "bootstrap template {path}:{line}: parameter .{name} is not provided by meshagent \
         (see docs/bootstrap.md for the parameter list)",
        path = .path.display()
    )]
    UnknownParameter {
        path: PathBuf,
        line: usize,
        name: String,
    },
    #[error("bootstrap template {path}: {reason}", path = .path.display())]
    Parse { path: PathBuf, reason: String },
    #[error("bootstrap template {path}: cannot render: {reason}", path = .path.display())]
    Render { path: PathBuf, reason: String },
}

/// A parsed, checked template.
pub struct Template {
    path: PathBuf,
    yaml: bool,
    inner: gtmpl::Template,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Template")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Go's builtins that gtmpl provides, plus those added here.
const GO_BUILTINS: &[&str] = &[
    "and", "or", "not", "len", "index", "print", "printf", "println", "urlquery", "eq", "ne", "lt",
    "le", "gt", "ge", "call", "js", "html",
];

/// Template keywords (not functions).
const KEYWORDS: &[&str] = &[
    "if", "else", "end", "range", "with", "define", "template", "block", "break", "continue",
    "nil", "true", "false",
];

fn funcs() -> Vec<(&'static str, Func)> {
    vec![
        ("js", f_js as Func),
        ("html", f_html),
        ("toJson", f_to_json),
        ("toJSON", f_to_json),
        ("toRawJson", f_to_json),
        ("toPrettyJson", f_to_pretty_json),
        ("default", f_default),
        ("empty", f_empty),
        ("coalesce", f_coalesce),
        ("ternary", f_ternary),
        ("quote", f_quote),
        ("squote", f_squote),
        ("upper", f_upper),
        ("lower", f_lower),
        ("trim", f_trim),
        ("trimPrefix", f_trim_prefix),
        ("trimSuffix", f_trim_suffix),
        ("hasPrefix", f_has_prefix),
        ("hasSuffix", f_has_suffix),
        ("contains", f_contains),
        ("replace", f_replace),
        ("join", f_join),
        ("splitList", f_split_list),
        ("list", f_list),
        ("dict", f_dict),
        ("hasKey", f_has_key),
        ("toString", f_to_string),
        ("indent", f_indent),
        ("nindent", f_nindent),
        ("repeat", f_repeat),
    ]
}

/// Names of every function a template may call.
pub fn function_names() -> Vec<&'static str> {
    let mut v: Vec<&str> = GO_BUILTINS.to_vec();
    v.extend(funcs().into_iter().map(|(n, _)| n));
    v.sort_unstable();
    v.dedup();
    v
}

impl Template {
    /// Reads, scans and parses the template at `abs` (`shown` is the configured path).
    #[allow(
        clippy::disallowed_methods,
        reason = "templates load at start, before anything is served"
    )]
    pub fn load(abs: &Path, shown: &Path, origin: &'static str) -> Result<Self, TemplateError> {
        let text = std::fs::read_to_string(abs).map_err(|source| TemplateError::Read {
            path: shown.to_path_buf(),
            origin,
            source,
        })?;
        Self::parse(&text, shown)
    }

    /// Scans and parses template `text`; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, TemplateError> {
        let functions = function_names();
        for r in scan(text) {
            match r {
                Ref::Function { name, line } if !functions.contains(&name.as_str()) => {
                    return Err(TemplateError::UnknownFunction {
                        path: path.to_path_buf(),
                        line,
                        name,
                    });
                }
                Ref::Param { name, line } if !super::params::NAMES.contains(&name.as_str()) => {
                    return Err(TemplateError::UnknownParameter {
                        path: path.to_path_buf(),
                        line,
                        name,
                    });
                }
                _ => {}
            }
        }
        let mut inner = gtmpl::Template::default();
        inner.add_funcs(&funcs());
        inner.parse(text).map_err(|e| TemplateError::Parse {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let name = path.display().to_string();
        Ok(Self {
            path: path.to_path_buf(),
            yaml: name.ends_with(".yaml") || name.ends_with(".yaml.tmpl"),
            inner,
        })
    }

    /// `envoy-rev.yaml` for a YAML template, as Istio names it; else `envoy-rev.json`.
    pub fn output_file_name(&self) -> &'static str {
        if self.yaml {
            "envoy-rev.yaml"
        } else {
            "envoy-rev.json"
        }
    }

    /// Renders with `params` as the template's dot.
    pub fn render(&self, params: &Map<String, Value>) -> Result<String, TemplateError> {
        let ctx = Context::from(to_gtmpl(&Value::Object(params.clone())));
        self.inner.render(&ctx).map_err(|e| TemplateError::Render {
            path: self.path.clone(),
            reason: e.to_string(),
        })
    }
}

// === scanning ===

/// A function call or a top-level parameter reference, with its 1-based line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ref {
    Function { name: String, line: usize },
    Param { name: String, line: usize },
}

fn ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Finds the functions and the top-level (`.name` relative to the template's root dot, or
/// `$.name`) parameters a template uses. Inside `range`, `with`, `define` and `block` the dot
/// is rebound, so `.name` there is not a parameter and is not reported.
pub fn scan(text: &str) -> Vec<Ref> {
    let mut out = vec![];
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    let mut line = 1;
    // Block stack: true where the dot is rebound.
    let mut blocks: Vec<bool> = vec![];
    while i < chars.len() {
        if chars[i] == '\n' {
            line += 1;
            i += 1;
            continue;
        }
        if !(chars[i] == '{' && chars.get(i + 1) == Some(&'{')) {
            i += 1;
            continue;
        }
        i += 2;
        if chars.get(i) == Some(&'-') && chars.get(i + 1).is_some_and(|c| c.is_whitespace()) {
            i += 1;
        }
        // One action: tokens until `}}`.
        let mut words: Vec<String> = vec![];
        let mut refs: Vec<Ref> = vec![];
        let rebound = blocks.iter().any(|b| *b);
        let mut prev_ends_operand = false;
        while i < chars.len() {
            let c = chars[i];
            if c == '}' && chars.get(i + 1) == Some(&'}') {
                i += 2;
                break;
            }
            if c == '\n' {
                line += 1;
                i += 1;
                prev_ends_operand = false;
                continue;
            }
            if c.is_whitespace() || c == '-' && chars.get(i + 1) == Some(&'}') {
                i += 1;
                prev_ends_operand = false;
                continue;
            }
            if c == '/' && chars.get(i + 1) == Some(&'*') {
                while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                    if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
                i += 2;
                continue;
            }
            if c == '"' || c == '\'' || c == '`' {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    if chars[i] == '\\' && c != '`' {
                        i += 1;
                    } else if chars[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
                i += 1;
                prev_ends_operand = true;
                continue;
            }
            if c == '$' {
                i += 1;
                let root = i >= chars.len() || !ident_char(chars[i]);
                while i < chars.len() && ident_char(chars[i]) {
                    i += 1;
                }
                // `$.name` is a root parameter wherever it appears.
                if root && chars.get(i) == Some(&'.') {
                    let s = i + 1;
                    let mut e = s;
                    while e < chars.len() && ident_char(chars[e]) {
                        e += 1;
                    }
                    if e > s {
                        refs.push(Ref::Param {
                            name: chars[s..e].iter().collect(),
                            line,
                        });
                    }
                }
                while i < chars.len() && (ident_char(chars[i]) || chars[i] == '.') {
                    i += 1;
                }
                prev_ends_operand = true;
                continue;
            }
            if c == '.' {
                let s = i + 1;
                let mut e = s;
                while e < chars.len() && ident_char(chars[e]) {
                    e += 1;
                }
                if e > s && !prev_ends_operand && !rebound {
                    refs.push(Ref::Param {
                        name: chars[s..e].iter().collect(),
                        line,
                    });
                }
                i = e;
                while i < chars.len() && (ident_char(chars[i]) || chars[i] == '.') {
                    i += 1;
                }
                prev_ends_operand = true;
                continue;
            }
            if c.is_ascii_digit() {
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
                prev_ends_operand = true;
                continue;
            }
            if ident_start(c) {
                let s = i;
                while i < chars.len() && ident_char(chars[i]) {
                    i += 1;
                }
                let w: String = chars[s..i].iter().collect();
                if !KEYWORDS.contains(&w.as_str()) {
                    refs.push(Ref::Function {
                        name: w.clone(),
                        line,
                    });
                }
                words.push(w);
                // A chained field after an identifier (`fn.x`) is not a parameter.
                while i < chars.len() && (ident_char(chars[i]) || chars[i] == '.') {
                    i += 1;
                }
                prev_ends_operand = true;
                continue;
            }
            // `)` ends an operand (`(x).f` is a chain); `(`, `|`, `,`, `:=`, `=` do not.
            prev_ends_operand = c == ')';
            i += 1;
        }
        match words.first().map(String::as_str) {
            Some("if") => blocks.push(false),
            Some("range" | "with" | "define" | "block") => blocks.push(true),
            Some("end") => {
                blocks.pop();
            }
            _ => {}
        }
        out.extend(refs);
    }
    out
}

// === values ===

/// serde_json → gtmpl (objects become Go maps: a missing key is `<no value>`).
pub fn to_gtmpl(v: &Value) -> G {
    match v {
        Value::Null => G::Nil,
        Value::Bool(b) => G::Bool(*b),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                G::from(u)
            } else if let Some(i) = n.as_i64() {
                G::from(i)
            } else {
                G::from(n.as_f64().unwrap_or(0.0))
            }
        }
        Value::String(s) => G::String(s.clone()),
        Value::Array(a) => G::Array(a.iter().map(to_gtmpl).collect()),
        Value::Object(o) => G::Map(
            o.iter()
                .map(|(k, v)| (k.clone(), to_gtmpl(v)))
                .collect::<HashMap<_, _>>(),
        ),
    }
}

/// gtmpl → serde_json (map keys sorted, as Go's encoding/json writes them).
pub fn from_gtmpl(v: &G) -> Value {
    match v {
        G::NoValue | G::Nil | G::Function(_) => Value::Null,
        G::Bool(b) => Value::Bool(*b),
        G::String(s) => Value::String(s.clone()),
        G::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                serde_json::Number::from_f64(n.as_f64().unwrap_or(0.0))
                    .map_or(Value::Null, Value::Number)
            }
        }
        G::Array(a) => Value::Array(a.iter().map(from_gtmpl).collect()),
        G::Object(o) | G::Map(o) => {
            let sorted: std::collections::BTreeMap<_, _> =
                o.iter().map(|(k, v)| (k.clone(), from_gtmpl(v))).collect();
            Value::Object(sorted.into_iter().collect())
        }
    }
}

/// Go's zero-ness (sprig `empty`).
fn is_empty(v: &G) -> bool {
    match v {
        G::NoValue | G::Nil => true,
        G::Bool(b) => !b,
        G::String(s) => s.is_empty(),
        G::Number(n) => n.as_f64() == Some(0.0),
        G::Array(a) => a.is_empty(),
        G::Object(o) | G::Map(o) => o.is_empty(),
        G::Function(_) => false,
    }
}

/// Go's `%v` of a value (sprig `toString`).
fn string_of(v: &G) -> String {
    match v {
        G::String(s) => s.clone(),
        G::NoValue | G::Nil => String::new(),
        other => other.to_string(),
    }
}

fn arg<'a>(args: &'a [G], i: usize, name: &str, n: usize) -> Result<&'a G, FuncError> {
    args.get(i)
        .ok_or_else(|| FuncError::ExactlyXArgs(name.into(), n))
}

fn f_js(args: &[G]) -> Result<G, FuncError> {
    let s: String = args.iter().map(string_of).collect();
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '"' => out.push_str("\\\""),
            '<' => out.push_str("\\u003C"),
            '>' => out.push_str("\\u003E"),
            '&' => out.push_str("\\u0026"),
            '=' => out.push_str("\\u003D"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    Ok(G::String(out))
}

fn f_html(args: &[G]) -> Result<G, FuncError> {
    let s: String = args.iter().map(string_of).collect();
    Ok(G::String(
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
            .replace('"', "&#34;")
            .replace('\'', "&#39;"),
    ))
}

fn f_to_json(args: &[G]) -> Result<G, FuncError> {
    let v = from_gtmpl(arg(args, 0, "toJson", 1)?);
    Ok(G::String(v.to_string()))
}

fn f_to_pretty_json(args: &[G]) -> Result<G, FuncError> {
    let v = from_gtmpl(arg(args, 0, "toPrettyJson", 1)?);
    Ok(G::String(
        serde_json::to_string_pretty(&v).unwrap_or_default(),
    ))
}

fn f_default(args: &[G]) -> Result<G, FuncError> {
    let d = arg(args, 0, "default", 2)?;
    match args.get(1) {
        Some(v) if !is_empty(v) => Ok(v.clone()),
        _ => Ok(d.clone()),
    }
}

fn f_empty(args: &[G]) -> Result<G, FuncError> {
    Ok(G::Bool(args.first().is_none_or(is_empty)))
}

fn f_coalesce(args: &[G]) -> Result<G, FuncError> {
    Ok(args
        .iter()
        .find(|v| !is_empty(v))
        .cloned()
        .unwrap_or(G::Nil))
}

fn f_ternary(args: &[G]) -> Result<G, FuncError> {
    let t = arg(args, 0, "ternary", 3)?;
    let f = arg(args, 1, "ternary", 3)?;
    let c = arg(args, 2, "ternary", 3)?;
    Ok(if is_empty(c) { f.clone() } else { t.clone() })
}

fn f_quote(args: &[G]) -> Result<G, FuncError> {
    let q: Vec<String> = args
        .iter()
        .filter(|a| !matches!(a, G::NoValue | G::Nil))
        .map(|a| Value::String(string_of(a)).to_string())
        .collect();
    Ok(G::String(q.join(" ")))
}

fn f_squote(args: &[G]) -> Result<G, FuncError> {
    let q: Vec<String> = args
        .iter()
        .filter(|a| !matches!(a, G::NoValue | G::Nil))
        .map(|a| format!("'{}'", string_of(a)))
        .collect();
    Ok(G::String(q.join(" ")))
}

fn str_fn(args: &[G], name: &str, f: impl Fn(&str) -> String) -> Result<G, FuncError> {
    Ok(G::String(f(&string_of(arg(args, 0, name, 1)?))))
}

fn f_upper(args: &[G]) -> Result<G, FuncError> {
    str_fn(args, "upper", str::to_uppercase)
}

fn f_lower(args: &[G]) -> Result<G, FuncError> {
    str_fn(args, "lower", str::to_lowercase)
}

fn f_trim(args: &[G]) -> Result<G, FuncError> {
    str_fn(args, "trim", |s| s.trim().to_owned())
}

/// sprig's two-argument string functions take the subject last (`trimPrefix "x" .s`).
fn two(args: &[G], name: &str) -> Result<(String, String), FuncError> {
    Ok((
        string_of(arg(args, 0, name, 2)?),
        string_of(arg(args, 1, name, 2)?),
    ))
}

fn f_trim_prefix(args: &[G]) -> Result<G, FuncError> {
    let (p, s) = two(args, "trimPrefix")?;
    Ok(G::String(s.strip_prefix(&p).unwrap_or(&s).to_owned()))
}

fn f_trim_suffix(args: &[G]) -> Result<G, FuncError> {
    let (p, s) = two(args, "trimSuffix")?;
    Ok(G::String(s.strip_suffix(&p).unwrap_or(&s).to_owned()))
}

fn f_has_prefix(args: &[G]) -> Result<G, FuncError> {
    let (p, s) = two(args, "hasPrefix")?;
    Ok(G::Bool(s.starts_with(&p)))
}

fn f_has_suffix(args: &[G]) -> Result<G, FuncError> {
    let (p, s) = two(args, "hasSuffix")?;
    Ok(G::Bool(s.ends_with(&p)))
}

fn f_contains(args: &[G]) -> Result<G, FuncError> {
    let (p, s) = two(args, "contains")?;
    Ok(G::Bool(s.contains(&p)))
}

fn f_replace(args: &[G]) -> Result<G, FuncError> {
    let old = string_of(arg(args, 0, "replace", 3)?);
    let new = string_of(arg(args, 1, "replace", 3)?);
    let s = string_of(arg(args, 2, "replace", 3)?);
    Ok(G::String(s.replace(&old, &new)))
}

fn f_join(args: &[G]) -> Result<G, FuncError> {
    let sep = string_of(arg(args, 0, "join", 2)?);
    let list = match arg(args, 1, "join", 2)? {
        G::Array(a) => a.iter().map(string_of).collect::<Vec<_>>(),
        other => vec![string_of(other)],
    };
    Ok(G::String(list.join(&sep)))
}

fn f_split_list(args: &[G]) -> Result<G, FuncError> {
    let (sep, s) = two(args, "splitList")?;
    Ok(G::Array(
        s.split(sep.as_str()).map(|p| G::String(p.into())).collect(),
    ))
}

fn f_list(args: &[G]) -> Result<G, FuncError> {
    Ok(G::Array(args.to_vec()))
}

fn f_dict(args: &[G]) -> Result<G, FuncError> {
    let mut m = HashMap::new();
    for pair in args.chunks(2) {
        let v = pair.get(1).cloned().unwrap_or(G::String(String::new()));
        m.insert(string_of(&pair[0]), v);
    }
    Ok(G::Map(m))
}

fn f_has_key(args: &[G]) -> Result<G, FuncError> {
    let key = string_of(arg(args, 1, "hasKey", 2)?);
    Ok(G::Bool(match arg(args, 0, "hasKey", 2)? {
        G::Map(m) | G::Object(m) => m.contains_key(&key),
        _ => false,
    }))
}

fn f_to_string(args: &[G]) -> Result<G, FuncError> {
    Ok(G::String(string_of(arg(args, 0, "toString", 1)?)))
}

fn indent_by(n: &G, s: &G) -> String {
    let n = match n {
        G::Number(x) => x.as_u64().unwrap_or(0) as usize,
        _ => 0,
    };
    let pad = " ".repeat(n);
    string_of(s)
        .split('\n')
        .map(|l| format!("{pad}{l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn f_indent(args: &[G]) -> Result<G, FuncError> {
    Ok(G::String(indent_by(
        arg(args, 0, "indent", 2)?,
        arg(args, 1, "indent", 2)?,
    )))
}

fn f_nindent(args: &[G]) -> Result<G, FuncError> {
    Ok(G::String(format!(
        "\n{}",
        indent_by(arg(args, 0, "nindent", 2)?, arg(args, 1, "nindent", 2)?)
    )))
}

fn f_repeat(args: &[G]) -> Result<G, FuncError> {
    let n = match arg(args, 0, "repeat", 2)? {
        G::Number(x) => x.as_u64().unwrap_or(0) as usize,
        _ => 0,
    };
    Ok(G::String(string_of(arg(args, 1, "repeat", 2)?).repeat(n)))
}
