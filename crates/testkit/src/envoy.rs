//! Envoy as a child process, and the bootstraps tests hand it directly.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{Proc, Value, envoy_bin, free_addr, http_get, json, wait_for};

pub struct Envoy {
    pub proc: Proc,
    pub dir: PathBuf,
    pub admin: SocketAddr,
}

impl Envoy {
    /// Starts a real Envoy with `bootstrap` (its admin address is filled in) in `dir`.
    pub fn start(bootstrap: Value, dir: &Path) -> Envoy {
        Envoy::start_with_args(bootstrap, dir, &["-l", "info"])
    }

    /// Like [`Envoy::start`], with `args` (besides `-c`, hot restart and base id) given.
    pub fn start_with_args(mut bootstrap: Value, dir: &Path, args: &[&str]) -> Envoy {
        let admin = free_addr();
        bootstrap["admin"] = json!({
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin.port()}}
        });
        let config = dir.join("envoy.json");
        std::fs::write(&config, serde_json::to_vec_pretty(&bootstrap).unwrap()).unwrap();
        let mut cmd = Command::new(envoy_bin());
        cmd.arg("-c")
            .arg(&config)
            .args(args)
            .args(["--disable-hot-restart", "--base-id-path"])
            .arg(dir.join("base-id"))
            .current_dir(dir);
        Envoy {
            dir: dir.to_path_buf(),
            admin,
            proc: Proc::spawn("envoy", cmd, dir),
        }
    }

    pub async fn admin_get(&self, path: &str) -> Option<String> {
        match http_get(self.admin, path).await {
            Ok((200, body)) => Some(body),
            _ => None,
        }
    }

    pub async fn config_dump(&self) -> Option<Value> {
        let body = self.admin_get("/config_dump").await?;
        serde_json::from_str(&body).ok()
    }

    /// Names of dynamic resources of a kind in `/config_dump` (active and warming), e.g.
    /// `("ClustersConfigDump", "dynamic_active_clusters", "cluster")`.
    pub async fn dynamic_names(&self, dump_type: &str, list: &str, field: &str) -> Vec<String> {
        let Some(dump) = self.config_dump().await else {
            return vec![];
        };
        let mut out = vec![];
        for cfg in dump["configs"].as_array().into_iter().flatten() {
            if !cfg["@type"].as_str().unwrap_or("").ends_with(dump_type) {
                continue;
            }
            for item in cfg[list].as_array().into_iter().flatten() {
                // listeners nest the resource under active_state/warming_state
                let res = if item[field].is_object() {
                    &item[field]
                } else if item["active_state"][field].is_object() {
                    &item["active_state"][field]
                } else {
                    &item["warming_state"][field]
                };
                if let Some(n) = res["name"].as_str() {
                    out.push(n.to_owned());
                }
            }
        }
        out
    }

    pub async fn clusters(&self) -> Vec<String> {
        let mut c = self
            .dynamic_names("ClustersConfigDump", "dynamic_active_clusters", "cluster")
            .await;
        c.extend(
            self.dynamic_names("ClustersConfigDump", "dynamic_warming_clusters", "cluster")
                .await,
        );
        c
    }

    /// Waits until Envoy has cluster `name`; `what` names the wait if it times out.
    pub async fn wait_for_cluster(&self, what: &str, timeout: Duration, name: &str) {
        wait_for(what, timeout, || async {
            self.clusters()
                .await
                .iter()
                .any(|n| n == name)
                .then_some(())
        })
        .await
    }

    pub async fn listeners(&self) -> Vec<String> {
        self.dynamic_names("ListenersConfigDump", "dynamic_listeners", "listener")
            .await
    }

    /// `name: value` of `/stats?filter=...`.
    pub async fn stat(&self, name: &str) -> Option<u64> {
        let body = self
            .admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\.")))
            .await?;
        body.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}: ")))
            .and_then(|v| v.trim().parse().ok())
    }
}

/// Adds Istio's `sds-grpc` static cluster (a unix socket) to `bootstrap`.
pub fn add_sds_cluster(bootstrap: &mut Value, socket: &Path) {
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .expect("bootstrap has static clusters");
    clusters.push(json!({
        "name": "sds-grpc",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "sds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"pipe": {"path": socket.to_string_lossy()}}
        }}]}]},
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}
        }}
    }));
}

/// A bootstrap for Envoy talking ADS directly to devplane over TLS with a bearer token.
pub fn direct_bootstrap(
    node_id: &str,
    metadata: Value,
    devplane: SocketAddr,
    root_cert: &Path,
    token: &str,
    delta: bool,
) -> Value {
    json!({
        "node": {"id": node_id, "cluster": "test", "metadata": metadata},
        "dynamic_resources": {
            "ads_config": {
                "api_type": if delta { "DELTA_GRPC" } else { "GRPC" },
                "transport_api_version": "V3",
                "set_node_on_first_message_only": true,
                "grpc_services": [{
                    "envoy_grpc": {"cluster_name": "xds-grpc"},
                    "initial_metadata": [{"key": "authorization", "value": format!("Bearer {token}")}]
                }]
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"},
            "lds_config": {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"}
        },
        "static_resources": {
            "clusters": [{
                "name": "xds-grpc",
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": {"socket_address": {"address": devplane.ip().to_string(), "port_value": devplane.port()}}
                }}]}]},
                "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}}
                }},
                "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "sni": "istiod.istio-system.svc",
                    "common_tls_context": {
                        "alpn_protocols": ["h2"],
                        "validation_context": {
                            "trusted_ca": {"filename": root_cert.to_string_lossy()},
                            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": "istiod.istio-system.svc"}}]
                        }
                    }
                }}
            }]
        }
    })
}
