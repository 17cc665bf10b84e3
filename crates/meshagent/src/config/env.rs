//! The one place the agent reads environment variables.
//!
//! Everything goes through [`EnvSource`] so tests can hand in a [`MapEnv`]
//! instead of mutating the process environment.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Display;
use std::time::Duration;

use super::ConfigError;
use super::parse::{
    EXPECT_BOOL, EXPECT_DURATION, go_duration_string, parse_go_bool, parse_go_duration,
};

/// A source of environment variables.
pub trait EnvSource {
    /// The value of `key`, or `None` if it is not set (or not valid UTF-8; see
    /// [`EnvSource::not_unicode`]).
    fn get(&self, key: &str) -> Option<String>;
    /// Every variable with a UTF-8 name and value, for prefix families such as `ISTIO_META_*`.
    fn vars(&self) -> Vec<(String, String)>;
    /// Names (lossily decoded) of the variables whose name or value is not valid UTF-8, which
    /// [`EnvSource::get`] and [`EnvSource::vars`] leave out. The loader turns those the agent
    /// reads into errors instead of treating them as unset.
    fn not_unicode(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }

    fn vars(&self) -> Vec<(String, String)> {
        // `std::env::vars` panics on non-UTF-8 entries; `not_unicode` reports those.
        std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect()
    }

    fn not_unicode(&self) -> Vec<String> {
        std::env::vars_os()
            .filter(|(k, v)| k.to_str().is_none() || v.to_str().is_none())
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect()
    }
}

/// An in-memory environment for tests and embedding.
#[derive(Debug, Clone, Default)]
pub struct MapEnv(pub HashMap<String, String>);

impl MapEnv {
    /// Builds an environment from `(name, value)` pairs.
    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        Self(
            pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }
}

impl EnvSource for MapEnv {
    fn get(&self, key: &str) -> Option<String> {
        self.0.get(key).cloned()
    }

    fn vars(&self) -> Vec<(String, String)> {
        self.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

/// Typed reads over an [`EnvSource`], with Istio's rules (`pkg/env/var.go`, `Lookup`):
///
/// * a string that is set but empty is `""`, not the default ([`Reader::string`]); a few
///   callers treat `""` as unset where Istio's consumer does ([`Reader::non_empty`]);
/// * a bool, integer, float or duration that does not parse — `""` included — logs a
///   warning and the default is used ([`Reader::scalar`], the one place that rule lives);
/// * a value that parses but that the agent cannot run with (an integer out of range, a
///   socket name with a `/`) is an error; every error is collected instead of stopping at
///   the first one, and loading fails with all of them.
///
/// It also remembers which variables and prefix families were read, so that
/// [`Reader::not_unicode_errors`] reports exactly the non-UTF-8 variables the agent would
/// otherwise have mistaken for unset, and none it does not use.
pub(crate) struct Reader<'a> {
    env: &'a dyn EnvSource,
    pub(crate) errors: Vec<ConfigError>,
    /// "Invalid environment variable value …, defaulting to …" lines, logged by the loader.
    pub(crate) warnings: Vec<String>,
    read: RefCell<BTreeSet<String>>,
    prefixes: RefCell<BTreeSet<String>>,
    /// When asked for (the configuration reference), how each variable is read: its type
    /// and default, as the typed read states them. `None` in the agent: nothing is kept.
    catalog: Option<RefCell<BTreeMap<String, (String, String)>>>,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(env: &'a dyn EnvSource) -> Self {
        Self {
            env,
            errors: Vec::new(),
            warnings: Vec::new(),
            read: RefCell::default(),
            prefixes: RefCell::default(),
            catalog: None,
        }
    }

    /// A reader that also records each variable's type and default, for
    /// [`Reader::take_catalog`].
    pub(crate) fn cataloging(env: &'a dyn EnvSource) -> Self {
        Self {
            catalog: Some(RefCell::default()),
            ..Self::new(env)
        }
    }

    /// Every variable read so far (prefix families as `PREFIX*`) with its type and default,
    /// as recorded by a [`Reader::cataloging`] reader (empty otherwise).
    pub(crate) fn take_catalog(&mut self) -> BTreeMap<String, (String, String)> {
        self.catalog
            .take()
            .map(RefCell::into_inner)
            .unwrap_or_default()
    }

    /// Records how `key` is read (the first, most specific, record wins).
    fn note(&self, key: &str, kind: &str, default: impl Display) {
        if let Some(c) = &self.catalog {
            c.borrow_mut()
                .entry(key.to_owned())
                .or_insert_with(|| (kind.to_owned(), default.to_string()));
        }
    }

    /// The raw value; every read goes through here.
    pub(crate) fn get(&self, key: &str) -> Option<String> {
        self.note(key, "string", "unset");
        self.read.borrow_mut().insert(key.to_owned());
        self.env.get(key)
    }

    pub(crate) fn string(&self, key: &str, default: &str) -> String {
        self.note(key, "string", shown_str(default));
        self.get(key).unwrap_or_else(|| default.to_owned())
    }

    /// The value if set and non-empty.
    pub(crate) fn non_empty(&self, key: &str) -> Option<String> {
        self.note(key, "string", "unset (empty = unset)");
        self.get(key).filter(|v| !v.is_empty())
    }

    /// One error per variable read so far (alone or through a prefix family) whose name or
    /// value is not valid UTF-8.
    pub(crate) fn not_unicode_errors(&self) -> Vec<ConfigError> {
        let read = self.read.borrow();
        let prefixes = self.prefixes.borrow();
        self.env
            .not_unicode()
            .into_iter()
            .filter(|name| read.contains(name) || prefixes.iter().any(|p| name.starts_with(p)))
            .map(|name| ConfigError::NotUnicode { name })
            .collect()
    }

    pub(crate) fn invalid(&mut self, key: &str, value: &str, expected: impl Into<String>) {
        self.errors.push(ConfigError::InvalidEnv {
            name: key.to_owned(),
            value: value.to_owned(),
            expected: expected.into(),
        });
    }

    /// Istio's rule for scalar variables: unset → `default`; set to something `parse`
    /// rejects (`""` included) → a warning and `default` (`shown` is how the warning
    /// prints it).
    pub(crate) fn scalar<T>(
        &mut self,
        key: &str,
        default: T,
        shown: &str,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> T {
        let Some(raw) = self.get(key) else {
            return default;
        };
        match parse(&raw) {
            Some(v) => v,
            None => {
                self.warnings.push(format!(
                    "Invalid environment variable value {key}={raw:?}, expecting {expected}, defaulting to {shown}"
                ));
                default
            }
        }
    }

    /// A value of a type Istio reads as a string and checks later (e.g. an IP address): unset
    /// or empty → `default`; not accepted by `parse` → an error. `default_doc` is how the
    /// configuration reference shows the default (`T` need not be printable).
    pub(crate) fn validated<T>(
        &mut self,
        key: &str,
        default: T,
        default_doc: &str,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> T {
        self.note(key, expected, default_doc);
        let Some(raw) = self.non_empty(key) else {
            return default;
        };
        match parse(&raw) {
            Some(v) => v,
            None => {
                self.invalid(key, &raw, expected);
                default
            }
        }
    }

    pub(crate) fn bool(&mut self, key: &str, default: bool) -> bool {
        self.note(key, "bool", default);
        self.scalar(
            key,
            default,
            &default.to_string(),
            EXPECT_BOOL,
            parse_go_bool,
        )
    }

    /// An `ISTIO_META_*` bool that is also typed node metadata (Istio `StringBool`,
    /// `bootstrap/node.rs` `STRING_BOOL_KEYS`). A non-empty value that does not parse is
    /// refused at start by the node metadata check, naming it, as Istio's decode into
    /// `NodeMetadata` refuses it: it is not also warned about as "defaulting to false".
    pub(crate) fn meta_bool(&mut self, key: &str) -> bool {
        self.note(key, "bool (node metadata)", false);
        match self.get(key) {
            Some(raw) if !raw.is_empty() && parse_go_bool(&raw).is_none() => false,
            _ => self.bool(key, false),
        }
    }

    pub(crate) fn opt_bool(&mut self, key: &str) -> Option<bool> {
        self.note(key, "bool", "unset");
        self.scalar(key, None, "unset", EXPECT_BOOL, |s| {
            parse_go_bool(s).map(Some)
        })
    }

    pub(crate) fn duration(&mut self, key: &str, default: Duration) -> Duration {
        let shown = go_duration_string(default);
        self.note(key, "duration", &shown);
        self.scalar(key, default, &shown, EXPECT_DURATION, parse_go_duration)
    }

    /// An integer within `min..=max`: not an integer → warning and default; an integer out
    /// of range → error.
    pub(crate) fn int<T>(&mut self, key: &str, default: T, min: T, max: T) -> T
    where
        T: TryFrom<i128> + PartialOrd + Copy + Display,
    {
        self.note(key, &range("integer", min, max), default);
        let Some(n) = self.scalar(key, None, &default.to_string(), "an integer", |s| {
            s.parse::<i128>().ok().map(Some)
        }) else {
            return default;
        };
        match T::try_from(n).ok().filter(|v| *v >= min && *v <= max) {
            Some(v) => v,
            None => {
                self.invalid(
                    key,
                    &n.to_string(),
                    format!("an integer between {min} and {max}"),
                );
                default
            }
        }
    }

    pub(crate) fn port(&mut self, key: &str, default: u16) -> u16 {
        self.note(key, "port", default);
        self.int(key, default, 0, u16::MAX)
    }

    /// A finite float within `min..=max`: not a number → warning and default; a number out
    /// of range (or NaN) → error.
    pub(crate) fn float(&mut self, key: &str, default: f64, min: f64, max: f64) -> f64 {
        self.note(key, &range("number", min, max), default);
        let Some(x) = self.scalar(key, None, &default.to_string(), "a number", |s| {
            s.parse::<f64>().ok().map(Some)
        }) else {
            return default;
        };
        if (min..=max).contains(&x) {
            x
        } else {
            self.invalid(
                key,
                &x.to_string(),
                format!("a number between {min} and {max}"),
            );
            default
        }
    }

    /// A comma-separated list; blank items are dropped.
    pub(crate) fn list(&self, key: &str, default: &[&str]) -> Vec<String> {
        self.note(key, "comma-separated list", shown_str(&default.join(",")));
        match self.get(key) {
            Some(v) => split_list(&v),
            None => default.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// Every variable `<prefix><NAME>` with a non-empty NAME, keyed by NAME.
    pub(crate) fn prefixed(&self, prefix: &str) -> BTreeMap<String, String> {
        self.note(&format!("{prefix}*"), "one variable per name", "none");
        self.prefixes.borrow_mut().insert(prefix.to_owned());
        self.env
            .vars()
            .into_iter()
            .filter_map(|(k, v)| {
                let name = k.strip_prefix(prefix)?;
                (!name.is_empty()).then(|| (name.to_owned(), v))
            })
            .collect()
    }
}

/// A string default as the reference shows it.
fn shown_str(default: &str) -> String {
    if default.is_empty() {
        "\"\"".to_owned()
    } else {
        format!("`{default}`")
    }
}

/// `kind` with its bounds, unless they are a type's whole range (which says nothing).
fn range(kind: &str, min: impl Display, max: impl Display) -> String {
    let (min, max) = (min.to_string(), max.to_string());
    if min.len() > 9 || max.len() > 9 {
        kind.to_owned()
    } else {
        format!("{kind} {min}–{max}")
    }
}

pub(crate) fn split_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}
