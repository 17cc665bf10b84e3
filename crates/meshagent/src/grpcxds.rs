//! The gRPC xDS bootstrap for proxyless gRPC applications (Istio
//! `pkg/istio-agent/grpcxds/grpc_bootstrap.go` `GenerateBootstrap`, written by
//! `pkg/istio-agent/agent.go` `Run` whenever `GRPC_XDS_BOOTSTRAP` is non-empty).
//!
//! The application reads it through `GRPC_XDS_BOOTSTRAP` and then speaks xDS to the agent's
//! socket. Shape and field order are Istio's, which marshals its own struct with Go's
//! `encoding/json` (`MarshalIndent`, two spaces):
//!
//! * `xds_servers`: the agent's `XDS` socket as a `unix:///…` URI, insecure channel
//!   credentials, `server_features: ["xds_v3"]`;
//! * `node`: `id`, the full node metadata with `GENERATOR` forced to `grpc` (keys sorted, as
//!   Go marshals maps), `locality` (`{}` when empty) and the literal
//!   `"UserAgentVersionType": null` that Go's marshalling of `core.Node` leaves;
//! * `certificate_providers.default`: `file_watcher` on the `OUTPUT_CERTS` files, only when
//!   `OUTPUT_CERTS` is set (istiod's grpc generator names instance `default` for both the
//!   identity and `ROOTCA`);
//! * `server_listener_resource_name_template`: `xds.istio.io/grpc/lds/inbound/%s`.
//!
//! Paths: Istio prefixes its relative socket path with `unix:///`, which is right because the
//! agent runs in `/`. Here the socket and certificate paths are resolved against the agent's
//! working directory, which gives exactly Istio's `unix:///etc/istio/proxy/XDS` in a pod and a
//! path that still resolves when the agent runs elsewhere (tests).

use std::path::{Component, Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::bootstrap::Node;
use crate::config::Config;

/// Istio `grpcxds.ServerListenerNamePrefix` + `%s`.
pub const SERVER_LISTENER_TEMPLATE: &str = "xds.istio.io/grpc/lds/inbound/%s";

#[derive(Debug, thiserror::Error)]
pub enum GrpcXdsError {
    #[error("cannot write the gRPC bootstrap GRPC_XDS_BOOTSTRAP={path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot encode the gRPC bootstrap: {0}")]
    Encode(#[from] serde_json::Error),
}

#[derive(Serialize)]
struct Bootstrap {
    xds_servers: Vec<XdsServer>,
    node: GrpcNode,
    #[serde(skip_serializing_if = "Option::is_none")]
    certificate_providers: Option<Providers>,
    server_listener_resource_name_template: &'static str,
}

#[derive(Serialize)]
struct XdsServer {
    server_uri: String,
    channel_creds: [ChannelCreds; 1],
    server_features: [&'static str; 1],
}

#[derive(Serialize)]
struct ChannelCreds {
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct GrpcNode {
    #[serde(skip_serializing_if = "String::is_empty")]
    id: String,
    metadata: Map<String, Value>,
    locality: Value,
    #[serde(rename = "UserAgentVersionType")]
    user_agent_version_type: Option<()>,
}

#[derive(Serialize)]
struct Providers {
    default: Provider,
}

#[derive(Serialize)]
struct Provider {
    plugin_name: &'static str,
    config: FileWatcher,
}

#[derive(Serialize)]
struct FileWatcher {
    certificate_file: String,
    private_key_file: String,
    ca_certificate_file: String,
    refresh_interval: &'static str,
}

/// Lexically cleaned absolute path (`cwd/./a/../b` → `cwd/b`), as Go's `filepath.Join`.
/// A relative `cwd` (the agent's `.`) is taken from the process's working directory.
pub fn absolute(cwd: &Path, p: &Path) -> PathBuf {
    let mut full = crate::fsio::under(cwd, p);
    if full.is_relative()
        && let Ok(dir) = std::env::current_dir()
    {
        full = dir.join(full);
    }
    let mut out = PathBuf::new();
    for c in full.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

/// The bootstrap text for `node`; `socket` is the agent's XDS socket (relative paths resolve
/// against `cwd`).
pub fn render(
    cfg: &Config,
    node: &Node,
    cwd: &Path,
    socket: &Path,
) -> Result<String, GrpcXdsError> {
    let mut metadata = node.metadata.clone();
    metadata.insert("GENERATOR".into(), Value::String("grpc".into()));
    let socket = absolute(cwd, socket);
    let certificate_providers = cfg
        .identity
        .output_certs
        .as_ref()
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| {
            let dir = absolute(cwd, d);
            let file = |n: &str| dir.join(n).display().to_string();
            Providers {
                default: Provider {
                    plugin_name: "file_watcher",
                    config: FileWatcher {
                        certificate_file: file("cert-chain.pem"),
                        private_key_file: file("key.pem"),
                        ca_certificate_file: file("root-cert.pem"),
                        refresh_interval: "900s",
                    },
                },
            }
        });
    let b = Bootstrap {
        xds_servers: vec![XdsServer {
            // `socket` is absolute, so this is `unix:///…` as Istio writes it.
            server_uri: format!("unix://{}", socket.display()),
            channel_creds: [ChannelCreds { kind: "insecure" }],
            server_features: ["xds_v3"],
        }],
        node: GrpcNode {
            id: node.id.clone(),
            metadata,
            locality: match &node.locality {
                Value::Object(_) => node.locality.clone(),
                _ => Value::Object(Map::new()),
            },
            user_agent_version_type: None,
        },
        certificate_providers,
        server_listener_resource_name_template: SERVER_LISTENER_TEMPLATE,
    };
    Ok(serde_json::to_string_pretty(&b)?)
}

/// Writes the bootstrap atomically: directory created 0700 if missing, file 0644 (Istio:
/// `os.MkdirAll(dir, 0o700)`, `file.AtomicWrite(path, data, 0o644)`). Returns the absolute path.
#[allow(
    clippy::disallowed_methods,
    reason = "called on the blocking pool (app.rs)"
)]
pub fn write(cwd: &Path, path: &Path, contents: &str) -> Result<PathBuf, GrpcXdsError> {
    use std::io::Write as _;
    use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
    let abs = absolute(cwd, path);
    let err = |source| GrpcXdsError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = abs.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err)?;
    }
    let tmp = abs.with_file_name(format!(
        ".{}.tmp",
        abs.file_name()
            .map_or("grpc-bootstrap".into(), |n| n.to_string_lossy())
    ));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&tmp)
        .map_err(err)?;
    // No fsync: the file is rendered again at every agent start, so a crash can lose
    // nothing; the rename below already keeps readers from seeing a partial file. An fsync
    // here sat on Envoy's start-up path (6.6 ms p50, 41 ms max on this machine's disk).
    let written = f.write_all(contents.as_bytes()).and_then(|()| {
        drop(f);
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
        std::fs::rename(&tmp, &abs)
    });
    // A failed write (disk full, read-only filesystem) leaves no half-written file.
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(abs)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::disallowed_methods,
        reason = "test code, not on the agent's runtime"
    )]
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::{MapEnv, ProxyFlags};

    fn node_and_cfg(env: &[(&str, &str)]) -> (Config, Node) {
        let dir = tempfile::tempdir().unwrap();
        let mut pairs = vec![
            ("POD_NAME", "pod1"),
            ("POD_NAMESPACE", "fake-namespace"),
            ("INSTANCE_IP", "127.0.0.1"),
        ];
        pairs.extend_from_slice(env);
        let cfg = crate::config::load(
            &ProxyFlags::default(),
            &MapEnv::from_pairs(pairs),
            dir.path(),
        )
        .unwrap();
        let node = Node::with_ips(&cfg, vec!["127.0.0.1".parse().unwrap()]).unwrap();
        (cfg, node)
    }

    /// Istio's golden (`pkg/istio-agent/testdata/grpc-bootstrap.json`) in shape and order: the
    /// node's metadata differs only by the variables set here.
    #[test]
    fn istio_shape_and_order_in_a_pod() {
        let (cfg, node) = node_and_cfg(&[("OUTPUT_CERTS", "/var/lib/istio/data")]);
        let text = render(
            &cfg,
            &node,
            Path::new("/"),
            Path::new("./etc/istio/proxy/XDS"),
        )
        .unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v["xds_servers"],
            serde_json::json!([{"server_uri": "unix:///etc/istio/proxy/XDS",
                "channel_creds": [{"type": "insecure"}], "server_features": ["xds_v3"]}])
        );
        assert_eq!(
            v["node"]["id"],
            "sidecar~127.0.0.1~pod1.fake-namespace~fake-namespace.svc.cluster.local"
        );
        assert_eq!(v["node"]["metadata"]["GENERATOR"], "grpc");
        assert_eq!(v["node"]["metadata"]["INSTANCE_IPS"], "127.0.0.1");
        assert_eq!(v["node"]["locality"], serde_json::json!({}));
        assert!(
            v["node"]
                .as_object()
                .unwrap()
                .contains_key("UserAgentVersionType")
        );
        assert!(v["node"]["UserAgentVersionType"].is_null());
        assert_eq!(
            v["certificate_providers"],
            serde_json::json!({"default": {"plugin_name": "file_watcher", "config": {
                "certificate_file": "/var/lib/istio/data/cert-chain.pem",
                "private_key_file": "/var/lib/istio/data/key.pem",
                "ca_certificate_file": "/var/lib/istio/data/root-cert.pem",
                "refresh_interval": "900s"}}})
        );
        assert_eq!(
            v["server_listener_resource_name_template"],
            "xds.istio.io/grpc/lds/inbound/%s"
        );
        // Field order and indentation of Go's MarshalIndent(…, "", "  ").
        let keys: Vec<usize> = [
            "\n  \"xds_servers\"",
            "\n  \"node\"",
            "\n  \"certificate_providers\"",
            "\n  \"server_listener_resource_name_template\"",
        ]
        .iter()
        .map(|k| text.find(k).unwrap())
        .collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{text}");
        let node_keys: Vec<usize> = [
            "\"id\"",
            "\"metadata\"",
            "\"locality\"",
            "\"UserAgentVersionType\"",
        ]
        .iter()
        .map(|k| text.find(k).unwrap())
        .collect();
        assert!(node_keys.windows(2).all(|w| w[0] < w[1]), "{text}");
        // Go sorts map keys.
        let meta = text.find("\"metadata\"").unwrap();
        let (g, i) = (
            text[meta..].find("\"GENERATOR\"").unwrap(),
            text[meta..].find("\"INSTANCE_IPS\"").unwrap(),
        );
        assert!(g < i);
    }

    #[test]
    fn no_certificate_providers_without_output_certs_and_locality_kept() {
        let (cfg, node) = node_and_cfg(&[(
            "ISTIO_METAJSON_LABELS",
            r#"{"topology.istio.io/locality":"r1/z1"}"#,
        )]);
        let text = render(
            &cfg,
            &node,
            Path::new("/work"),
            Path::new("./etc/istio/proxy/XDS"),
        )
        .unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert!(v.get("certificate_providers").is_none());
        assert_eq!(
            v["xds_servers"][0]["server_uri"],
            "unix:///work/etc/istio/proxy/XDS"
        );
        assert_eq!(
            v["node"]["locality"],
            serde_json::json!({"region": "r1", "zone": "z1"})
        );
    }

    #[test]
    fn written_atomically_with_istio_modes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = write(
            dir.path(),
            Path::new("./etc/istio/proxy/grpc-bootstrap.json"),
            "{}",
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{}");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&p), 0o644);
        assert_eq!(mode(p.parent().unwrap()), 0o700);
        write(
            dir.path(),
            Path::new("etc/istio/proxy/grpc-bootstrap.json"),
            "{\"a\":1}",
        )
        .unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"a\":1}");
    }
}
