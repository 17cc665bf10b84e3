//! The one place the agent reads environment variables.
//!
//! Everything goes through [`EnvSource`] so tests can hand in a [`MapEnv`]
//! instead of mutating the process environment.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::str::FromStr;
use std::time::Duration;

use super::ConfigError;
use super::parse::{EXPECT_BOOL, EXPECT_DURATION, parse_go_bool, parse_go_duration};

/// A source of environment variables.
pub trait EnvSource {
    /// The value of `key`, or `None` if it is not set (or not valid UTF-8).
    fn get(&self, key: &str) -> Option<String>;
    /// Every variable, for prefix families such as `ISTIO_META_*`.
    fn vars(&self) -> Vec<(String, String)>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }

    fn vars(&self) -> Vec<(String, String)> {
        // `std::env::vars` panics on non-UTF-8 entries; skip those instead.
        std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
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

/// Typed reads over an [`EnvSource`] that collect every bad value instead of
/// stopping at the first one.
///
/// A variable that is set but empty counts as unset for typed values
/// (Kubernetes manifests often render `value: ""`); string values keep the
/// empty string, as Istio does.
pub(crate) struct Reader<'a> {
    env: &'a dyn EnvSource,
    pub(crate) errors: Vec<ConfigError>,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(env: &'a dyn EnvSource) -> Self {
        Self {
            env,
            errors: Vec::new(),
        }
    }

    pub(crate) fn string(&self, key: &str, default: &str) -> String {
        self.env.get(key).unwrap_or_else(|| default.to_owned())
    }

    /// The value if set and non-empty.
    pub(crate) fn non_empty(&self, key: &str) -> Option<String> {
        self.env.get(key).filter(|v| !v.is_empty())
    }

    pub(crate) fn invalid(&mut self, key: &str, value: &str, expected: impl Into<String>) {
        self.errors.push(ConfigError::InvalidEnv {
            name: key.to_owned(),
            value: value.to_owned(),
            expected: expected.into(),
        });
    }

    /// Parses `key` with `parse`, recording an error (and returning `default`)
    /// when the value does not parse.
    pub(crate) fn parse<T>(
        &mut self,
        key: &str,
        default: T,
        expected: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> T {
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
        self.parse(key, default, EXPECT_BOOL, parse_go_bool)
    }

    pub(crate) fn opt_bool(&mut self, key: &str) -> Option<bool> {
        self.parse(key, None, EXPECT_BOOL, |s| parse_go_bool(s).map(Some))
    }

    pub(crate) fn duration(&mut self, key: &str, default: Duration) -> Duration {
        self.parse(key, default, EXPECT_DURATION, parse_go_duration)
    }

    /// An integer within `min..=max`.
    pub(crate) fn int<T>(&mut self, key: &str, default: T, min: T, max: T) -> T
    where
        T: FromStr + PartialOrd + Copy + Display,
    {
        let expected = format!("an integer between {min} and {max}");
        self.parse(key, default, &expected, |s| {
            s.parse::<T>().ok().filter(|v| *v >= min && *v <= max)
        })
    }

    pub(crate) fn port(&mut self, key: &str, default: u16) -> u16 {
        self.parse(key, default, "a port number between 0 and 65535", |s| {
            s.parse().ok()
        })
    }

    /// A finite float within `min..=max`.
    pub(crate) fn float(&mut self, key: &str, default: f64, min: f64, max: f64) -> f64 {
        let expected = format!("a number between {min} and {max}");
        self.parse(key, default, &expected, |s| {
            s.parse::<f64>().ok().filter(|v| (min..=max).contains(v))
        })
    }

    /// A comma-separated list; blank items are dropped.
    pub(crate) fn list(&self, key: &str, default: &[&str]) -> Vec<String> {
        match self.env.get(key) {
            Some(v) => split_list(&v),
            None => default.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// Every variable `<prefix><NAME>` with a non-empty NAME, keyed by NAME.
    pub(crate) fn prefixed(&self, prefix: &str) -> BTreeMap<String, String> {
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

pub(crate) fn split_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}
