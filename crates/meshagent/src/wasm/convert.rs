//! ECDS conversion (Istio `pkg/wasm/convert.go` `MaybeConvertWasmExtensionConfig`): every
//! resource of a response is converted concurrently; a Wasm extension whose
//! `vm_config.code` is remote is fetched through the cache and rewritten to
//! `local.filename`; local code and non-Wasm extensions pass unchanged. A failed fetch
//! becomes an RBAC filter of the same name (allow-all `wasm-default-allow` when fail-open,
//! deny-all `wasm-default-deny` otherwise); only an undecodable resource (or Wasm with no
//! code at all) NACKs the response.

// `fail_open` is deprecated in Envoy's API, but istiod still sets it (legacy WasmPlugin
// `failStrategy`) and Istio honours it when `failure_policy` is unspecified.
#![allow(deprecated)]

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use meshagent_proto::envoy::pb::envoy::config::core::v3::{
    AsyncDataSource, DataSource, TypedExtensionConfig, async_data_source, data_source,
};
use meshagent_proto::envoy::pb::envoy::config::rbac::v3 as rbac_cfg;
use meshagent_proto::envoy::pb::envoy::extensions::filters::http::rbac::v3::Rbac as HttpRbac;
use meshagent_proto::envoy::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
use meshagent_proto::envoy::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use meshagent_proto::envoy::pb::envoy::extensions::wasm::v3::{
    EnvironmentVariables, FailurePolicy, PluginConfig, VmConfig, plugin_config,
};
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryResponse, DiscoveryResponse,
};
use meshagent_proto::envoy::pb::google::protobuf::{Any, StringValue, Struct, Value, value::Kind};
use meshagent_proto::typed_struct::{self, TypedStruct};
use prost::Message;
use tokio::time::Instant;

use super::cache::{Cache, GetOptions, PullPolicy};
use super::metrics::Metrics;

pub const WASM_HTTP: &str = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
pub const WASM_NETWORK: &str = "type.googleapis.com/envoy.extensions.filters.network.wasm.v3.Wasm";
pub const RBAC_HTTP: &str = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC";
pub const RBAC_NETWORK: &str = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC";
const STRING_VALUE: &str = "type.googleapis.com/google.protobuf.StringValue";

/// Istio `pkg/bootstrap` `IstioMetaPrefix` and the Wasm keys istiod puts in the VM env
/// (`pilot/pkg/model/extensions.go`).
const ISTIO_META_PREFIX: &str = "ISTIO_META_";
pub const PULL_SECRET_ENV: &str = "ISTIO_META_WASM_IMAGE_PULL_SECRET";
pub const PULL_POLICY_ENV: &str = "ISTIO_META_WASM_IMAGE_PULL_POLICY";
pub const RESOURCE_VERSION_ENV: &str = "ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION";

/// Istio's stat prefixes of the stand-in filters (1.28+, #57824).
pub const ALLOW_STAT_PREFIX: &str = "wasm-default-allow";
pub const DENY_STAT_PREFIX: &str = "wasm-default-deny";

/// `wasm_config_conversion_count{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conversion {
    Success,
    NoRemoteLoad,
    MarshalFailure,
    UnmarshalFailure,
    FetchFailure,
    MissRemoteFetchHint,
}

impl Conversion {
    pub fn label(self) -> &'static str {
        match self {
            Conversion::Success => "success",
            Conversion::NoRemoteLoad => "no_remote_load",
            Conversion::MarshalFailure => "marshal_failure",
            Conversion::UnmarshalFailure => "unmarshal_failure",
            Conversion::FetchFailure => "fetch_failure",
            Conversion::MissRemoteFetchHint => "miss_remote_fetch_hint",
        }
    }
}

/// An HTTP or a network Wasm filter (they get different RBAC stand-ins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterKind {
    Http,
    Network,
}

pub struct Converter {
    pub cache: Arc<Cache>,
    pub metrics: Metrics,
    /// Conversions of responses still pending, which a newer response may make unwanted.
    pending: Mutex<Pending>,
    /// Each module's last outcome, for `/debug/wasmz`.
    pub view: Arc<super::view::WasmView>,
}

/// Why a response must be NACKed.
pub type Nack = String;

/// What the proxy hands on for one ECDS response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Converted {
    /// The converted response, for Envoy.
    Forward(Vec<u8>),
    /// A newer SotW response arrived while this one was still fetching: it carries the whole
    /// requested set, so this one is neither forwarded nor ACKed.
    Superseded,
}

#[derive(Default)]
struct Pending {
    next: u64,
    entries: Vec<PendingEntry>,
}

/// One resource of a response being converted.
struct PendingEntry {
    id: u64,
    delta: bool,
    name: String,
    /// Of the resource's bytes: a newer response carrying the same resource still wants it.
    digest: u64,
    cancel: CancellationToken,
}

fn digest(a: Option<&Any>) -> u64 {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if let Some(a) = a {
        a.type_url.hash(&mut h);
        a.value.hash(&mut h);
    }
    h.finish()
}

enum Decoded {
    Sotw(DiscoveryResponse),
    Delta(DeltaDiscoveryResponse),
}

impl Decoded {
    fn decode(delta: bool, msg: &[u8]) -> Result<Decoded, Nack> {
        let bad = |e: prost::DecodeError| format!("invalid ECDS response: {e}");
        Ok(if delta {
            Decoded::Delta(DeltaDiscoveryResponse::decode(msg).map_err(bad)?)
        } else {
            Decoded::Sotw(DiscoveryResponse::decode(msg).map_err(bad)?)
        })
    }

    /// The name and digest of each resource (Delta: `Resource.name`, else the extension's
    /// own name), and for Delta the names it removes.
    fn names(&self) -> (Vec<(String, u64)>, Vec<String>) {
        let ec_name = |a: &Any| {
            TypedExtensionConfig::decode(a.value.as_slice())
                .map(|e| e.name)
                .unwrap_or_default()
        };
        match self {
            Decoded::Sotw(r) => (
                r.resources
                    .iter()
                    .map(|a| (ec_name(a), digest(Some(a))))
                    .collect(),
                Vec::new(),
            ),
            Decoded::Delta(r) => (
                r.resources
                    .iter()
                    .map(|x| {
                        let name = match (&x.name, &x.resource) {
                            (n, _) if !n.is_empty() => n.clone(),
                            (_, Some(a)) => ec_name(a),
                            _ => String::new(),
                        };
                        (name, digest(x.resource.as_ref()))
                    })
                    .collect(),
                r.removed_resources.clone(),
            ),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes a response's entries from [`Pending`] when its conversion ends or is dropped.
struct Deregister {
    conv: Arc<Converter>,
    ids: Vec<u64>,
}

impl Drop for Deregister {
    fn drop(&mut self) {
        lock(&self.conv.pending)
            .entries
            .retain(|e| !self.ids.contains(&e.id));
    }
}

impl Converter {
    pub fn new(cache: Arc<Cache>, metrics: Metrics) -> Converter {
        Converter {
            cache,
            metrics,
            pending: Mutex::default(),
            view: Arc::default(),
        }
    }

    /// Converts a whole SotW or Delta response; `Err` is the NACK message. Nothing can
    /// supersede it (see [`Converter::convert_latest`]).
    pub async fn convert_response(&self, delta: bool, msg: &[u8]) -> Result<Vec<u8>, Nack> {
        let d = Decoded::decode(delta, msg)?;
        let n = match &d {
            Decoded::Sotw(r) => r.resources.len(),
            Decoded::Delta(r) => r.resources.len(),
        };
        match self.run(d, vec![None; n]).await? {
            Converted::Forward(b) => Ok(b),
            Converted::Superseded => Err("superseded".into()),
        }
    }

    /// The xDS proxy's conversion of one ECDS response. Registered at once, in the order
    /// responses arrive, so that a newer response releases the older ones it makes unwanted
    /// instead of queueing behind their fetches (the proxy hands ECDS responses to Envoy in
    /// order, `xds/stream.rs`). A pending resource is unwanted once a newer response replaces
    /// it with different content or removes it (SotW: leaves it out; Delta: names it in
    /// `removed_resources`); a newer response carrying the same resource still wants it and
    /// waits for the same download. A SotW response with an unwanted resource is dropped whole
    /// (the newer one carries the whole requested set); a Delta response goes without its
    /// unwanted resources. A released fetch itself runs on to its deadline in the cache (a
    /// later request for the same module joins it). Istio converts each response in its own goroutine and forwards
    /// whichever finishes first (`pkg/istio-agent/xds_proxy.go` `rewriteAndForward`), so a
    /// slow older response can overwrite a newer one there; this keeps the order.
    ///
    /// Only Envoy's ADS stream carries ECDS, so responses are compared across the one
    /// converter (two streams given the same resources do not release each other's).
    pub fn convert_latest(
        self: &Arc<Self>,
        delta: bool,
        msg: &[u8],
    ) -> BoxFuture<'static, Result<Converted, Nack>> {
        let d = match Decoded::decode(delta, msg) {
            Ok(d) => d,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        let (names, removed) = d.names();
        let (ids, tokens) = {
            let mut p = lock(&self.pending);
            let mut released = 0usize;
            for e in p.entries.iter().filter(|e| e.delta == delta) {
                let newer = names.iter().find(|(n, _)| *n == e.name).map(|(_, d)| *d);
                let unwanted = if delta {
                    removed.contains(&e.name) || newer.is_some_and(|d| d != e.digest)
                } else {
                    newer != Some(e.digest)
                };
                if unwanted && !e.cancel.is_cancelled() {
                    e.cancel.cancel();
                    released += 1;
                }
            }
            if released > 0 {
                tracing::info!(
                    resources = released,
                    "a newer ECDS response replaces resources still being fetched; the older response is not held for them"
                );
            }
            let mut ids = Vec::with_capacity(names.len());
            let mut tokens = Vec::with_capacity(names.len());
            for (name, digest) in names {
                let id = p.next;
                p.next += 1;
                let cancel = CancellationToken::new();
                p.entries.push(PendingEntry {
                    id,
                    delta,
                    name,
                    digest,
                    cancel: cancel.clone(),
                });
                ids.push(id);
                tokens.push(Some(cancel));
            }
            (ids, tokens)
        };
        let me = self.clone();
        Box::pin(async move {
            let _done = Deregister {
                conv: me.clone(),
                ids,
            };
            me.run(d, tokens).await
        })
    }

    /// One resource, unless a newer response supersedes it first (`None`).
    async fn convert_unless(
        &self,
        a: Any,
        superseded: Option<CancellationToken>,
    ) -> Option<Result<Any, Nack>> {
        match superseded {
            None => Some(self.convert(a).await),
            Some(t) => tokio::select! {
                biased;
                _ = t.cancelled() => None,
                r = self.convert(a) => Some(r),
            },
        }
    }

    async fn run(
        &self,
        d: Decoded,
        tokens: Vec<Option<CancellationToken>>,
    ) -> Result<Converted, Nack> {
        let start = Instant::now();
        let out = match d {
            Decoded::Delta(mut r) => {
                let resources = std::mem::take(&mut r.resources);
                let converted = futures::future::join_all(resources.iter().zip(tokens).map(
                    |(res, t)| async move {
                        match res.resource.clone() {
                            Some(a) => self.convert_unless(a, t).await.map(|c| c.map(Some)),
                            None => Some(Ok(None)),
                        }
                    },
                ))
                .await;
                for (mut res, c) in resources.into_iter().zip(converted) {
                    match c {
                        Some(c) => {
                            res.resource = c?;
                            r.resources.push(res);
                        }
                        None => {
                            tracing::info!(resource = %res.name, nonce = %r.nonce, "ECDS resource superseded by a newer response before its Wasm module was fetched; left out of this one");
                        }
                    }
                }
                Converted::Forward(r.encode_to_vec())
            }
            Decoded::Sotw(mut r) => {
                let anys = std::mem::take(&mut r.resources);
                let converted = futures::future::join_all(
                    anys.into_iter()
                        .zip(tokens)
                        .map(|(a, t)| self.convert_unless(a, t)),
                )
                .await;
                if converted.iter().any(Option::is_none) {
                    tracing::info!(nonce = %r.nonce, version = %r.version_info, "ECDS response superseded by a newer one before its Wasm modules were fetched; not forwarded");
                    Converted::Superseded
                } else {
                    r.resources = converted.into_iter().flatten().collect::<Result<_, _>>()?;
                    Converted::Forward(r.encode_to_vec())
                }
            }
        };
        self.metrics
            .conversion_duration_ms
            .observe(start.elapsed().as_secs_f64() * 1000.0);
        Ok(out)
    }

    fn count(&self, c: Conversion) {
        self.metrics.conversion.with(&[c.label()]).inc();
    }

    /// One resource (Istio `convert`).
    pub async fn convert(&self, resource: Any) -> Result<Any, Nack> {
        let (mut ec, kind, mut wasm) = match unmarshal(&resource) {
            Ok(Some(x)) => x,
            Ok(None) => return Ok(resource),
            Err(e) => {
                self.count(Conversion::UnmarshalFailure);
                return Err(e);
            }
        };
        let plugin = wasm.config.get_or_insert_with(Default::default);
        let fail_open = plugin.failure_policy == FailurePolicy::FailOpen as i32
            || (plugin.failure_policy == FailurePolicy::Unspecified as i32 && plugin.fail_open);
        let Some(plugin_config::Vm::VmConfig(vm)) = plugin.vm.as_mut() else {
            self.count(Conversion::UnmarshalFailure);
            return Err(format!(
                "no remote and local load found in Wasm filter {:?}",
                ec.name
            ));
        };
        let remote = match vm.code.as_ref().and_then(|c| c.specifier.as_ref()) {
            Some(async_data_source::Specifier::Remote(r)) => r.clone(),
            Some(async_data_source::Specifier::Local(_)) => {
                self.count(Conversion::NoRemoteLoad);
                return Ok(resource);
            }
            None => {
                self.count(Conversion::UnmarshalFailure);
                return Err(format!(
                    "no remote and local load found in Wasm filter {:?}",
                    ec.name
                ));
            }
        };
        let name = ec.name.clone();
        let url = remote.http_uri.as_ref().map(|u| u.uri.clone());
        let checksum = if remote.sha256 == "nil" {
            String::new()
        } else {
            remote.sha256.clone()
        };
        // Read before `take_istio_env` strips it, for the record of a failure there.
        let policy_hint = vm
            .environment_variables
            .as_ref()
            .and_then(|e| e.key_values.get(PULL_POLICY_ENV))
            .map(|p| PullPolicy::parse(p))
            .unwrap_or_default();
        let record = |result: Result<super::view::Fetched<'_>, super::view::Failed<'_>>,
                      pull_policy: PullPolicy| {
            self.view.record(super::view::Outcome {
                url: url.as_deref(),
                resource: &name,
                pull_policy,
                expected_sha256: &checksum,
                fail_open,
                result,
            });
        };
        let fallback = |why: String,
                        status: Conversion,
                        result: &'static str|
         -> Result<Any, Nack> {
            self.count(status);
            tracing::error!(resource = %name, fail_open, error = %why, "cannot fetch Wasm module; applying the {} filter", if fail_open { "allow-all" } else { "deny-all" });
            record(
                Err(super::view::Failed {
                    result,
                    error: &why,
                }),
                policy_hint,
            );
            Ok(fallback_filter(&name, kind, fail_open))
        };
        let Some(http_uri) = remote.http_uri.as_ref() else {
            return fallback(
                "remote fetch has no httpUri".into(),
                Conversion::MissRemoteFetchHint,
                Conversion::MissRemoteFetchHint.label(),
            );
        };
        let timeout = http_uri
            .timeout
            .as_ref()
            .and_then(|d| {
                let secs = u64::try_from(d.seconds).ok()?;
                let nanos = u32::try_from(d.nanos).ok()?;
                Some(Duration::new(secs, nanos))
            })
            .filter(|d| !d.is_zero())
            .unwrap_or(Duration::from_secs(5));
        let (pull_secret, pull_policy, resource_version) = match take_istio_env(vm) {
            Ok(x) => x,
            Err(e) => {
                return fallback(
                    e,
                    Conversion::FetchFailure,
                    Conversion::FetchFailure.label(),
                );
            }
        };
        let got = self
            .cache
            .get(
                &http_uri.uri,
                GetOptions {
                    checksum: checksum.clone(),
                    resource_name: ec.name.clone(),
                    resource_version,
                    pull_policy,
                    pull_secret,
                    timeout,
                },
            )
            .await;
        let file = match got {
            Ok(f) => f,
            Err(e) => {
                return fallback(e.to_string(), Conversion::FetchFailure, e.result.label());
            }
        };
        record(
            Ok(super::view::Fetched {
                file: &file,
                size: self.cache.module_size(&file),
            }),
            pull_policy,
        );
        vm.code = Some(AsyncDataSource {
            specifier: Some(async_data_source::Specifier::Local(DataSource {
                specifier: Some(data_source::Specifier::Filename(
                    file.to_string_lossy().into_owned(),
                )),
                ..Default::default()
            })),
        });
        ec.typed_config = Some(Any {
            type_url: match kind {
                FilterKind::Http => WASM_HTTP,
                FilterKind::Network => WASM_NETWORK,
            }
            .to_owned(),
            value: wasm.encode_to_vec(),
        });
        self.count(Conversion::Success);
        Ok(Any {
            type_url: resource.type_url,
            value: ec.encode_to_vec(),
        })
    }
}

/// Reads and strips the `ISTIO_META_*` VM env keys (Istio strips all of them).
#[allow(clippy::type_complexity)]
fn take_istio_env(vm: &mut VmConfig) -> Result<(Option<Vec<u8>>, PullPolicy, String), String> {
    let Some(env) = vm.environment_variables.as_mut() else {
        return Ok((None, PullPolicy::Unspecified, String::new()));
    };
    let secret = env.key_values.get(PULL_SECRET_ENV).cloned();
    let policy = env
        .key_values
        .get(PULL_POLICY_ENV)
        .map(|p| PullPolicy::parse(p))
        .unwrap_or_default();
    let version = env
        .key_values
        .get(RESOURCE_VERSION_ENV)
        .cloned()
        .unwrap_or_default();
    env.key_values
        .retain(|k, _| !k.starts_with(ISTIO_META_PREFIX));
    if env.key_values.is_empty() && env.host_env_keys.is_empty() {
        vm.environment_variables = None;
    }
    match secret {
        Some(s) if s.is_empty() => {
            Err("cannot fetch Wasm module: missing image pulling secret".into())
        }
        s => Ok((s.map(String::into_bytes), policy, version)),
    }
}

/// The RBAC stand-in (Istio `createAllowAllFilter` / `createDenyAllFilter`): no rules allows
/// everything; empty rules with the default ALLOW action deny everything.
pub fn fallback_filter(name: &str, kind: FilterKind, fail_open: bool) -> Any {
    let prefix = if fail_open {
        ALLOW_STAT_PREFIX
    } else {
        DENY_STAT_PREFIX
    };
    let rules = (!fail_open).then(rbac_cfg::Rbac::default);
    let typed = match kind {
        FilterKind::Http => Any {
            type_url: RBAC_HTTP.into(),
            value: HttpRbac {
                rules,
                rules_stat_prefix: prefix.into(),
                ..Default::default()
            }
            .encode_to_vec(),
        },
        FilterKind::Network => Any {
            type_url: RBAC_NETWORK.into(),
            value: NetworkRbac {
                rules,
                stat_prefix: prefix.into(),
                ..Default::default()
            }
            .encode_to_vec(),
        },
    };
    Any {
        type_url: meshagent_proto::type_url::EXTENSION_CONFIG.into(),
        value: TypedExtensionConfig {
            name: name.into(),
            typed_config: Some(typed),
        }
        .encode_to_vec(),
    }
}

/// Istio `tryUnmarshal`: `Ok(None)` for an extension that is not Wasm.
fn unmarshal(resource: &Any) -> Result<Option<(TypedExtensionConfig, FilterKind, Wasm)>, Nack> {
    let ec = TypedExtensionConfig::decode(resource.value.as_slice())
        .map_err(|e| format!("failed to unmarshal extension config resource: {e}"))?;
    let Some(tc) = ec.typed_config.as_ref() else {
        return Err(format!(
            "typed extension config {:?} does not contain any typed config",
            ec.name
        ));
    };
    let decode = |v: &[u8]| {
        Wasm::decode(v).map_err(|e| format!("failed to unmarshal Wasm filter {:?}: {e}", ec.name))
    };
    let (kind, wasm) = match tc.type_url.as_str() {
        WASM_HTTP => (FilterKind::Http, decode(&tc.value)?),
        WASM_NETWORK => (FilterKind::Network, decode(&tc.value)?),
        typed_struct::UDPA_TYPE_URL | typed_struct::XDS_TYPE_URL => {
            let ts = TypedStruct::decode(tc.value.as_slice())
                .map_err(|e| format!("failed to unmarshal TypedStruct {:?}: {e}", ec.name))?;
            let kind = match ts.type_url.as_str() {
                WASM_HTTP => FilterKind::Http,
                WASM_NETWORK => FilterKind::Network,
                _ => return Ok(None),
            };
            let s = ts.value.unwrap_or_default();
            (
                kind,
                wasm_from_struct(&s).map_err(|e| format!("TypedStruct {:?}: {e}", ec.name))?,
            )
        }
        _ => return Ok(None),
    };
    Ok(Some((ec, kind, wasm)))
}

// === TypedStruct (protobuf JSON mapping of the Wasm filter) ===

fn field<'a>(s: &'a Struct, json: &str, proto: &str) -> Option<&'a Value> {
    s.fields.get(json).or_else(|| s.fields.get(proto))
}

fn as_str<'a>(v: Option<&'a Value>, what: &str) -> Result<Option<&'a str>, String> {
    match v.and_then(|v| v.kind.as_ref()) {
        None | Some(Kind::NullValue(_)) => Ok(None),
        Some(Kind::StringValue(s)) => Ok(Some(s)),
        _ => Err(format!("{what}: expected a string")),
    }
}

fn as_bool(v: Option<&Value>, what: &str) -> Result<bool, String> {
    match v.and_then(|v| v.kind.as_ref()) {
        None | Some(Kind::NullValue(_)) => Ok(false),
        Some(Kind::BoolValue(b)) => Ok(*b),
        _ => Err(format!("{what}: expected a bool")),
    }
}

fn as_struct<'a>(v: Option<&'a Value>, what: &str) -> Result<Option<&'a Struct>, String> {
    match v.and_then(|v| v.kind.as_ref()) {
        None | Some(Kind::NullValue(_)) => Ok(None),
        Some(Kind::StructValue(s)) => Ok(Some(s)),
        _ => Err(format!("{what}: expected an object")),
    }
}

/// `google.protobuf.Any` in JSON: `{"@type": …, "value": …}`; StringValue is what istiod
/// sends for plugin configuration.
fn any_from_struct(s: &Struct, what: &str) -> Result<Any, String> {
    let t = as_str(s.fields.get("@type"), what)?.unwrap_or_default();
    match t {
        STRING_VALUE => {
            let v = as_str(s.fields.get("value"), what)?.unwrap_or_default();
            Ok(Any {
                type_url: t.into(),
                value: StringValue {
                    value: v.to_owned(),
                }
                .encode_to_vec(),
            })
        }
        other => Err(format!(
            "{what}: unsupported @type {other:?} in a TypedStruct"
        )),
    }
}

fn duration_from_json(s: &str) -> Option<meshagent_proto::envoy::pb::google::protobuf::Duration> {
    let secs: f64 = s.strip_suffix('s')?.parse().ok()?;
    if !secs.is_finite() || secs < 0.0 {
        return None;
    }
    Some(meshagent_proto::envoy::pb::google::protobuf::Duration {
        seconds: secs.trunc() as i64,
        nanos: ((secs.fract()) * 1e9).round() as i32,
    })
}

fn wasm_from_struct(s: &Struct) -> Result<Wasm, String> {
    use meshagent_proto::envoy::pb::envoy::config::core::v3::{
        HttpUri, RemoteDataSource, http_uri,
    };
    let Some(c) = as_struct(field(s, "config", "config"), "config")? else {
        return Ok(Wasm::default());
    };
    let mut p = PluginConfig {
        name: as_str(field(c, "name", "name"), "config.name")?
            .unwrap_or_default()
            .into(),
        root_id: as_str(field(c, "rootId", "root_id"), "config.rootId")?
            .unwrap_or_default()
            .into(),
        fail_open: as_bool(field(c, "failOpen", "fail_open"), "config.failOpen")?,
        ..Default::default()
    };
    if let Some(fp) = field(c, "failurePolicy", "failure_policy").and_then(|v| v.kind.as_ref()) {
        p.failure_policy = match fp {
            Kind::StringValue(n) => FailurePolicy::from_str_name(n)
                .ok_or_else(|| format!("config.failurePolicy: unknown value {n:?}"))?
                as i32,
            Kind::NumberValue(n) => *n as i32,
            _ => return Err("config.failurePolicy: expected an enum name".into()),
        };
    }
    if let Some(a) = as_struct(
        field(c, "configuration", "configuration"),
        "config.configuration",
    )? {
        p.configuration = Some(any_from_struct(a, "config.configuration")?);
    }
    if let Some(v) = as_struct(field(c, "vmConfig", "vm_config"), "config.vmConfig")? {
        let mut vm = VmConfig {
            vm_id: as_str(field(v, "vmId", "vm_id"), "vmConfig.vmId")?
                .unwrap_or_default()
                .into(),
            runtime: as_str(field(v, "runtime", "runtime"), "vmConfig.runtime")?
                .unwrap_or_default()
                .into(),
            allow_precompiled: as_bool(
                field(v, "allowPrecompiled", "allow_precompiled"),
                "vmConfig.allowPrecompiled",
            )?,
            nack_on_code_cache_miss: as_bool(
                field(v, "nackOnCodeCacheMiss", "nack_on_code_cache_miss"),
                "vmConfig.nackOnCodeCacheMiss",
            )?,
            ..Default::default()
        };
        if let Some(a) = as_struct(
            field(v, "configuration", "configuration"),
            "vmConfig.configuration",
        )? {
            vm.configuration = Some(any_from_struct(a, "vmConfig.configuration")?);
        }
        if let Some(e) = as_struct(
            field(v, "environmentVariables", "environment_variables"),
            "vmConfig.environmentVariables",
        )? {
            let mut env = EnvironmentVariables::default();
            if let Some(kv) = as_struct(
                field(e, "keyValues", "key_values"),
                "environmentVariables.keyValues",
            )? {
                for (k, val) in &kv.fields {
                    if let Some(Kind::StringValue(s)) = &val.kind {
                        env.key_values.insert(k.clone(), s.clone());
                    }
                }
            }
            if let Some(Kind::ListValue(l)) =
                field(e, "hostEnvKeys", "host_env_keys").and_then(|v| v.kind.as_ref())
            {
                for x in &l.values {
                    if let Some(Kind::StringValue(s)) = &x.kind {
                        env.host_env_keys.push(s.clone());
                    }
                }
            }
            vm.environment_variables = Some(env);
        }
        if let Some(code) = as_struct(field(v, "code", "code"), "vmConfig.code")? {
            let spec = if let Some(r) = as_struct(field(code, "remote", "remote"), "code.remote")? {
                let mut rd = RemoteDataSource {
                    sha256: as_str(field(r, "sha256", "sha256"), "remote.sha256")?
                        .unwrap_or_default()
                        .into(),
                    ..Default::default()
                };
                if let Some(h) = as_struct(field(r, "httpUri", "http_uri"), "remote.httpUri")? {
                    rd.http_uri = Some(HttpUri {
                        uri: as_str(field(h, "uri", "uri"), "httpUri.uri")?
                            .unwrap_or_default()
                            .into(),
                        timeout: as_str(field(h, "timeout", "timeout"), "httpUri.timeout")?
                            .map(|t| {
                                duration_from_json(t).ok_or_else(|| {
                                    format!("httpUri.timeout: invalid duration {t:?}")
                                })
                            })
                            .transpose()?,
                        http_upstream_type: as_str(
                            field(h, "cluster", "cluster"),
                            "httpUri.cluster",
                        )?
                        .map(|c| http_uri::HttpUpstreamType::Cluster(c.into())),
                    });
                }
                Some(async_data_source::Specifier::Remote(rd))
            } else if let Some(l) = as_struct(field(code, "local", "local"), "code.local")? {
                let spec =
                    if let Some(f) = as_str(field(l, "filename", "filename"), "local.filename")? {
                        Some(data_source::Specifier::Filename(f.into()))
                    } else {
                        as_str(
                            field(l, "inlineString", "inline_string"),
                            "local.inlineString",
                        )?
                        .map(|s| data_source::Specifier::InlineString(s.into()))
                    };
                Some(async_data_source::Specifier::Local(DataSource {
                    specifier: spec,
                    ..Default::default()
                }))
            } else {
                None
            };
            vm.code = spec.map(|s| AsyncDataSource { specifier: Some(s) });
        }
        p.vm = Some(plugin_config::Vm::VmConfig(vm));
    }
    Ok(Wasm { config: Some(p) })
}

/// Test/bench helper: a SotW ECDS response of these resources.
pub fn sotw_response(version: &str, nonce: &str, resources: Vec<Any>) -> Vec<u8> {
    DiscoveryResponse {
        version_info: version.into(),
        resources,
        type_url: meshagent_proto::type_url::EXTENSION_CONFIG.into(),
        nonce: nonce.into(),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Test helper: a Delta ECDS response of these named resources and removals.
pub fn delta_response(nonce: &str, resources: Vec<(String, Any)>, removed: Vec<String>) -> Vec<u8> {
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::Resource;
    DeltaDiscoveryResponse {
        system_version_info: nonce.into(),
        resources: resources
            .into_iter()
            .map(|(name, a)| Resource {
                name,
                resource: Some(a),
                ..Default::default()
            })
            .collect(),
        removed_resources: removed,
        type_url: meshagent_proto::type_url::EXTENSION_CONFIG.into(),
        nonce: nonce.into(),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Test/bench helper: an ECDS resource of a remote HTTP Wasm filter (`http_uri.timeout` 30 s,
/// what istiod sets).
pub fn remote_wasm_resource(
    name: &str,
    url: &str,
    sha256: &str,
    env: BTreeMap<String, String>,
    fail_open: bool,
) -> Any {
    remote_wasm_resource_with_timeout(name, url, sha256, env, fail_open, Duration::from_secs(30))
}

/// [`remote_wasm_resource`] with another `http_uri.timeout`.
pub fn remote_wasm_resource_with_timeout(
    name: &str,
    url: &str,
    sha256: &str,
    env: BTreeMap<String, String>,
    fail_open: bool,
    timeout: Duration,
) -> Any {
    use meshagent_proto::envoy::pb::envoy::config::core::v3::{
        HttpUri, RemoteDataSource, http_uri,
    };
    let wasm = Wasm {
        config: Some(PluginConfig {
            name: name.into(),
            fail_open,
            vm: Some(plugin_config::Vm::VmConfig(VmConfig {
                runtime: "envoy.wasm.runtime.v8".into(),
                code: Some(AsyncDataSource {
                    specifier: Some(async_data_source::Specifier::Remote(RemoteDataSource {
                        http_uri: Some(HttpUri {
                            uri: url.into(),
                            timeout: Some(meshagent_proto::envoy::pb::google::protobuf::Duration {
                                seconds: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
                                nanos: i32::try_from(timeout.subsec_nanos()).unwrap_or(0),
                            }),
                            http_upstream_type: Some(http_uri::HttpUpstreamType::Cluster(
                                url.into(),
                            )),
                        }),
                        sha256: sha256.into(),
                        ..Default::default()
                    })),
                }),
                environment_variables: (!env.is_empty()).then(|| EnvironmentVariables {
                    key_values: env.into_iter().collect(),
                    ..Default::default()
                }),
                ..Default::default()
            })),
            ..Default::default()
        }),
    };
    Any {
        type_url: meshagent_proto::type_url::EXTENSION_CONFIG.into(),
        value: TypedExtensionConfig {
            name: name.into(),
            typed_config: Some(Any {
                type_url: WASM_HTTP.into(),
                value: wasm.encode_to_vec(),
            }),
        }
        .encode_to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshagent_proto::envoy::pb::google::protobuf::{ListValue, value};

    fn converter(dir: &std::path::Path) -> Arc<Converter> {
        let cfg = crate::config::WasmConfig {
            insecure_registries: vec![],
            module_expiry: Duration::from_secs(60),
            purge_interval: Duration::from_secs(60),
            http_request_timeout: Duration::from_secs(1),
            http_request_max_retries: 1,
            max_binary_size_bytes: 1 << 20,
            blocked_cidrs: vec![],
            remote_load_conversion: true,
            docker_config: None,
        };
        super::super::start(
            super::super::WasmOptions {
                dir: dir.to_owned(),
                cfg,
                mesh_root: None,
                docker_config: None,
            },
            &crate::metrics::Registry::new(),
            &crate::tasks::Tasks::new(),
            tokio_util::sync::CancellationToken::new(),
        )
        .unwrap()
    }

    fn s(v: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(v.into())),
        }
    }
    fn obj(fields: Vec<(&str, Value)>) -> Value {
        Value {
            kind: Some(Kind::StructValue(Struct {
                fields: fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
            })),
        }
    }

    fn ec(name: &str, type_url: &str, value: Vec<u8>) -> Any {
        Any {
            type_url: meshagent_proto::type_url::EXTENSION_CONFIG.into(),
            value: TypedExtensionConfig {
                name: name.into(),
                typed_config: Some(Any {
                    type_url: type_url.into(),
                    value,
                }),
            }
            .encode_to_vec(),
        }
    }

    fn typed_config(a: &Any) -> Any {
        TypedExtensionConfig::decode(a.value.as_slice())
            .unwrap()
            .typed_config
            .unwrap()
    }

    #[tokio::test]
    async fn typed_struct_failure_policy_and_network_fallbacks() {
        let d = tempfile::tempdir().unwrap();
        let c = converter(d.path());
        // A TypedStruct (JSON form) whose fetch cannot work (unsupported scheme): the
        // FAIL_OPEN policy gives the allow-all stand-in; ISTIO_META keys are read.
        let value = obj(vec![(
            "config",
            obj(vec![
                ("name", s("ts")),
                ("failurePolicy", s("FAIL_OPEN")),
                (
                    "configuration",
                    obj(vec![("@type", s(STRING_VALUE)), ("value", s("{}"))]),
                ),
                (
                    "vmConfig",
                    obj(vec![
                        ("runtime", s("envoy.wasm.runtime.v8")),
                        (
                            "environmentVariables",
                            obj(vec![
                                ("keyValues", obj(vec![(PULL_POLICY_ENV, s("Always"))])),
                                (
                                    "hostEnvKeys",
                                    Value {
                                        kind: Some(value::Kind::ListValue(ListValue {
                                            values: vec![s("HOME")],
                                        })),
                                    },
                                ),
                            ]),
                        ),
                        (
                            "code",
                            obj(vec![(
                                "remote",
                                obj(vec![(
                                    "httpUri",
                                    obj(vec![("uri", s("ftp://x/y.wasm")), ("timeout", s("1.5s"))]),
                                )]),
                            )]),
                        ),
                    ]),
                ),
            ]),
        )]);
        let Some(Kind::StructValue(st)) = value.kind else {
            unreachable!()
        };
        let ts = TypedStruct {
            type_url: WASM_HTTP.into(),
            value: Some(st),
        };
        let out = c
            .convert(ec("ts", typed_struct::UDPA_TYPE_URL, ts.encode_to_vec()))
            .await
            .unwrap();
        let tc = typed_config(&out);
        assert_eq!(tc.type_url, RBAC_HTTP);
        let r = HttpRbac::decode(tc.value.as_slice()).unwrap();
        assert_eq!(
            (r.rules_stat_prefix.as_str(), r.rules.is_none()),
            (ALLOW_STAT_PREFIX, true)
        );

        // FAIL_RELOAD fails closed; a network filter gets the network RBAC.
        let w = Wasm {
            config: Some(PluginConfig {
                failure_policy: FailurePolicy::FailReload as i32,
                fail_open: true,
                vm: Some(plugin_config::Vm::VmConfig(VmConfig {
                    code: Some(AsyncDataSource {
                        specifier: Some(async_data_source::Specifier::Remote(Default::default())),
                    }),
                    ..Default::default()
                })),
                ..Default::default()
            }),
        };
        let out = c
            .convert(ec("net", WASM_NETWORK, w.encode_to_vec()))
            .await
            .unwrap();
        let tc = typed_config(&out);
        assert_eq!(tc.type_url, RBAC_NETWORK);
        let r = NetworkRbac::decode(tc.value.as_slice()).unwrap();
        assert_eq!(
            (r.stat_prefix.as_str(), r.rules.is_some()),
            (DENY_STAT_PREFIX, true)
        );
        let m = c.metrics.conversion.with(&["miss_remote_fetch_hint"]).get();
        assert_eq!(m, 1, "remote without httpUri");
    }

    #[tokio::test]
    async fn local_code_and_other_extensions_pass_and_codeless_wasm_nacks() {
        let d = tempfile::tempdir().unwrap();
        let c = converter(d.path());
        let local = Wasm {
            config: Some(PluginConfig {
                vm: Some(plugin_config::Vm::VmConfig(VmConfig {
                    code: Some(AsyncDataSource {
                        specifier: Some(async_data_source::Specifier::Local(DataSource {
                            specifier: Some(data_source::Specifier::Filename("/x.wasm".into())),
                            ..Default::default()
                        })),
                    }),
                    ..Default::default()
                })),
                ..Default::default()
            }),
        };
        let a = ec("l", WASM_HTTP, local.encode_to_vec());
        assert_eq!(c.convert(a.clone()).await.unwrap(), a);
        let other = ec("r", RBAC_HTTP, HttpRbac::default().encode_to_vec());
        assert_eq!(c.convert(other.clone()).await.unwrap(), other);
        let codeless = ec("n", WASM_HTTP, Wasm::default().encode_to_vec());
        assert!(c.convert(codeless.clone()).await.is_err());
        // One bad resource NACKs the whole response.
        let msg = sotw_response("v1", "n", vec![a, codeless]);
        assert!(c.convert_response(false, &msg).await.is_err());
        let garbage = Any {
            type_url: meshagent_proto::type_url::EXTENSION_CONFIG.into(),
            value: vec![0x0a, 0x09, 1],
        };
        assert!(c.convert(garbage).await.is_err());
        assert_eq!(c.metrics.conversion.with(&["no_remote_load"]).get(), 2);
        assert_eq!(c.metrics.conversion.with(&["unmarshal_failure"]).get(), 3);
    }
}
