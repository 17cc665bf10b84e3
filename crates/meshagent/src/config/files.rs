//! The files read while loading config: the mesh config and the pod
//! annotations written by the Kubernetes downward API.
#![allow(
    clippy::disallowed_methods,
    reason = "config loads before the runtime serves anything"
)]

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::ConfigError;
use super::parse::unquote_go;

/// Where the downward API mounts pod annotations (cwd-relative, like Istio).
pub const POD_ANNOTATIONS_PATH: &str = "./etc/istio/pod/annotations";
/// Downward-API pod labels file.
pub const POD_LABELS_PATH: &str = "./etc/istio/pod/labels";

/// Reads `path` (resolved against `base_dir`); a missing file is `Ok(None)`.
fn read_optional(
    base_dir: &Path,
    path: &Path,
    what: &'static str,
) -> Result<Option<String>, ConfigError> {
    match std::fs::read_to_string(base_dir.join(path)) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ConfigError::ReadFile {
            what,
            path: path.to_path_buf(),
            reason: e.to_string(),
        }),
    }
}

/// Parses YAML (or JSON, a YAML subset) into a JSON value.
pub(crate) fn yaml_to_json(origin: &str, text: &str) -> Result<Value, ConfigError> {
    let parse_err = |reason: String| ConfigError::Parse {
        origin: origin.to_owned(),
        reason,
    };
    let yaml: serde_yaml::Value =
        serde_yaml::from_str(text).map_err(|e| parse_err(e.to_string()))?;
    serde_json::to_value(yaml).map_err(|e| parse_err(e.to_string()))
}

/// The mesh config's `defaultConfig` (a ProxyConfig document), if the file
/// exists and sets it. Other mesh fields are istiod's business and ignored.
pub(crate) fn mesh_default_config(
    base_dir: &Path,
    path: &Path,
) -> Result<Option<Value>, ConfigError> {
    let Some(text) = read_optional(base_dir, path, "mesh config file")? else {
        return Ok(None);
    };
    let origin = mesh_origin(path);
    match yaml_to_json(&origin, &text)? {
        Value::Null => Ok(None),
        Value::Object(mut mesh) => Ok(mesh.remove("defaultConfig")),
        _ => Err(ConfigError::Parse {
            origin,
            reason: "expected a YAML mapping".to_owned(),
        }),
    }
}

pub(crate) fn mesh_origin(path: &Path) -> String {
    format!("mesh config file {}", path.display())
}

/// Pod annotations from [`POD_ANNOTATIONS_PATH`]; a missing file means none.
pub(crate) fn pod_annotations(base_dir: &Path) -> Result<BTreeMap<String, String>, ConfigError> {
    let path = PathBuf::from(POD_ANNOTATIONS_PATH);
    match read_optional(base_dir, &path, "pod annotations file")? {
        Some(text) => parse_downward_api(&text).map_err(|reason| ConfigError::Parse {
            origin: format!("pod annotations file {}", path.display()),
            reason,
        }),
        None => Ok(BTreeMap::new()),
    }
}

/// Pod labels from [`POD_LABELS_PATH`]; a missing file means none.
pub(crate) fn pod_labels(base_dir: &Path) -> Result<BTreeMap<String, String>, ConfigError> {
    let path = PathBuf::from(POD_LABELS_PATH);
    match read_optional(base_dir, &path, "pod labels file")? {
        Some(text) => parse_downward_api(&text).map_err(|reason| ConfigError::Parse {
            origin: format!("pod labels file {}", path.display()),
            reason,
        }),
        None => Ok(BTreeMap::new()),
    }
}

/// Istio's `ParseDownwardAPI`: `key="Go-quoted value"` lines; lines without
/// `=` are skipped, a value that does not unquote is an error.
pub(crate) fn parse_downward_api(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let Some((key, quoted)) = line.split_once('=') else {
            continue;
        };
        let value = unquote_go(quoted).ok_or_else(|| {
            format!(
                "line {}: value of {key:?} is not a Go-quoted string: {quoted}",
                n + 1
            )
        })?;
        out.insert(key.to_owned(), value);
    }
    Ok(out)
}
