//! WasmPlugin-like extensions, served as istiod serves them (pilot/pkg/model/extensions.go,
//! pilot/pkg/networking/core/extension): an ECDS `TypedExtensionConfig` named
//! `<namespace>.<name>` whose Wasm `vm_config.code` is **remote** (the URL as written,
//! `http_uri.timeout` 30 s, `sha256` or `"nil"`), the pull policy, pull secret and resource
//! version in the VM env as `ISTIO_META_WASM_*` keys, and an HCM filter of the same name
//! that discovers it over ADS (type URLs: Wasm and RBAC, so the agent's stand-in is valid).
//! Applied to the outbound listeners of every workload (WasmPlugin `mode: CLIENT`).

#![allow(deprecated)] // PluginConfig.fail_open: istiod still sets it for FAIL_OPEN.

use serde::Deserialize;

use meshagent_proto::envoy::pb::envoy::config::core::v3 as core;
use meshagent_proto::envoy::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use meshagent_proto::envoy::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use meshagent_proto::envoy::pb::envoy::extensions::wasm::v3 as wasm;
use meshagent_proto::envoy::pb::google::protobuf::{Any, Duration, StringValue};
use meshagent_proto::envoy::util::pack_any;
use prost::Message;

pub const WASM_HTTP: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
pub const RBAC_HTTP: &str = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC";

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WasmPlugin {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// `http(s)://…` or `oci://…`.
    pub url: String,
    #[serde(default)]
    pub sha256: String,
    /// `FAIL_CLOSE` (default), `FAIL_OPEN` or `FAIL_RELOAD`.
    #[serde(default)]
    pub fail_strategy: String,
    #[serde(default)]
    pub image_pull_policy: String,
    /// Docker config JSON, as istiod reads it from the pull secret.
    #[serde(default)]
    pub image_pull_secret: Option<String>,
    /// Bumped by istiod on every WasmPlugin change.
    #[serde(default = "default_version")]
    pub resource_version: String,
    /// `pluginConfig`, passed as a StringValue.
    #[serde(default)]
    pub plugin_config: String,
}

fn default_namespace() -> String {
    "default".into()
}
fn default_version() -> String {
    "1".into()
}

impl WasmPlugin {
    pub fn resource_name(&self) -> String {
        format!("{}.{}", self.namespace, self.name)
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.url.starts_with("http://")
            || self.url.starts_with("https://")
            || self.url.starts_with("oci://"))
        {
            return Err(format!(
                "url {:?}: expected http://, https:// or oci://",
                self.url
            ));
        }
        match self.fail_strategy.as_str() {
            "" | "FAIL_CLOSE" | "FAIL_OPEN" | "FAIL_RELOAD" => Ok(()),
            s => Err(format!(
                "failStrategy {s:?}: expected FAIL_CLOSE, FAIL_OPEN or FAIL_RELOAD"
            )),
        }
    }

    /// The ECDS resource istiod pushes.
    pub fn extension_config(&self) -> Any {
        let mut env = std::collections::HashMap::new();
        env.insert(
            "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION".to_owned(),
            self.resource_version.clone(),
        );
        if !self.image_pull_policy.is_empty() {
            env.insert(
                "ISTIO_META_WASM_IMAGE_PULL_POLICY".to_owned(),
                self.image_pull_policy.clone(),
            );
        }
        if let Some(s) = &self.image_pull_secret {
            env.insert("ISTIO_META_WASM_IMAGE_PULL_SECRET".to_owned(), s.clone());
        }
        let (fail_open, policy) = match self.fail_strategy.as_str() {
            "FAIL_OPEN" => (true, wasm::FailurePolicy::FailOpen),
            "FAIL_RELOAD" => (false, wasm::FailurePolicy::FailReload),
            _ => (false, wasm::FailurePolicy::FailClosed),
        };
        let name = self.resource_name();
        let w = Wasm {
            config: Some(wasm::PluginConfig {
                name: name.clone(),
                root_id: self.name.clone(),
                fail_open,
                failure_policy: policy as i32,
                configuration: (!self.plugin_config.is_empty()).then(|| {
                    pack_any(StringValue {
                        value: self.plugin_config.clone(),
                    })
                }),
                vm: Some(wasm::plugin_config::Vm::VmConfig(wasm::VmConfig {
                    runtime: "envoy.wasm.runtime.v8".into(),
                    code: Some(core::AsyncDataSource {
                        specifier: Some(core::async_data_source::Specifier::Remote(
                            core::RemoteDataSource {
                                http_uri: Some(core::HttpUri {
                                    uri: self.url.clone(),
                                    timeout: Some(Duration {
                                        seconds: 30,
                                        nanos: 0,
                                    }),
                                    http_upstream_type: Some(
                                        core::http_uri::HttpUpstreamType::Cluster(self.url.clone()),
                                    ),
                                }),
                                sha256: if self.sha256.is_empty() {
                                    "nil".into()
                                } else {
                                    self.sha256.clone()
                                },
                                ..Default::default()
                            },
                        )),
                    }),
                    environment_variables: Some(wasm::EnvironmentVariables {
                        key_values: env,
                        ..Default::default()
                    }),
                    ..Default::default()
                })),
                ..Default::default()
            }),
        };
        let ec = core::TypedExtensionConfig {
            name,
            typed_config: Some(Any {
                type_url: WASM_HTTP.into(),
                value: w.encode_to_vec(),
            }),
        };
        Any {
            type_url: meshagent_proto::type_url::EXTENSION_CONFIG.into(),
            value: ec.encode_to_vec(),
        }
    }

    /// The HCM filter that discovers the extension over ADS.
    pub fn http_filter(&self, ads: core::ConfigSource) -> hcm::HttpFilter {
        hcm::HttpFilter {
            name: self.resource_name(),
            config_type: Some(hcm::http_filter::ConfigType::ConfigDiscovery(
                core::ExtensionConfigSource {
                    config_source: Some(ads),
                    type_urls: vec![WASM_HTTP.into(), RBAC_HTTP.into()],
                    ..Default::default()
                },
            )),
            ..Default::default()
        }
    }
}
