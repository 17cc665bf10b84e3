//! The agent's ProxyConfig against Istio's own schema: `istio.mesh.v1alpha1.ProxyConfig`
//! from `mesh/v1alpha1/proxy.proto` of the `istio.io/api` Go module that compat/go.mod pins
//! (the same Istio the differential tests run), compiled here with protox. The agent's
//! parser is generated from the same file at build time (build.rs); this checks the layer
//! between the generated message and the rest of the agent (the typed fields, the
//! proto-JSON kept for the others, the agent's own value checks). Nothing of Istio's is in
//! the repository: the module is read from the Go module cache (`.tools/go/mod`), which the
//! build fills.
//!
//! For every field Istio's ProxyConfig has, a layer setting it (by JSON name, and again by
//! proto field name, as Istio's `protomarshal.ApplyYAML` accepts both; a message with every
//! nested field set) goes through [`meshagent::config::load`] as `PROXY_CONFIG`, and:
//! * the agent must know the field (no "unknown field" warning);
//! * the effective ProxyConfig the agent serializes (its `PROXY_CONFIG` node metadata) must
//!   hold the field under Istio's JSON name with the value proto-JSON gives it
//!   (prost-reflect's proto-JSON mapping of the same layer against Istio's descriptor).
//!
//! And every field name the agent serializes must be one of Istio's JSON names.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use prost_reflect::{DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor};
use serde_json::{Value, json};

use meshagent::config::{MapEnv, ProxyFlags, load};

/// The workspace root (this crate is `crates/meshagent`).
fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `istio.io/api` version compat/go.mod pins.
fn pinned_api_version() -> String {
    let go_mod = workspace_root().join("compat/go.mod");
    let text = std::fs::read_to_string(&go_mod).unwrap();
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("istio.io/api "))
        .map(|v| v.split_whitespace().next().unwrap_or_default().to_owned())
        .unwrap_or_else(|| panic!("no istio.io/api requirement in {}", go_mod.display()))
}

/// Istio's ProxyConfig descriptor, compiled from the Go module cache.
fn istio_proxy_config() -> MessageDescriptor {
    // The Makefile's module cache first (GOMODCACHE=.tools/go/mod), then the environment's.
    let module = format!("istio.io/api@{}", pinned_api_version());
    let local = workspace_root().join(".tools/go/mod").join(&module);
    let api = match std::env::var_os("GOMODCACHE") {
        Some(cache) if !local.is_dir() => PathBuf::from(cache).join(&module),
        _ => local,
    };
    assert!(
        api.join("mesh/v1alpha1/proxy.proto").is_file(),
        "Istio's proxy.proto is not in the Go module cache at {}: building the agent \
         downloads it (build.rs), or run `make pilot-agent`, or set GOMODCACHE",
        api.display()
    );
    let fds = protox::compile(
        ["mesh/v1alpha1/proxy.proto"],
        [api.clone(), api.join("common-protos")],
    )
    .unwrap_or_else(|e| panic!("compiling {}/mesh/v1alpha1/proxy.proto: {e}", api.display()));
    let pool = DescriptorPool::from_file_descriptor_set(fds).unwrap();
    pool.get_message_by_name("istio.mesh.v1alpha1.ProxyConfig")
        .unwrap()
}

/// Samples for fields whose value the agent also checks beyond its proto type, as Istio's
/// agent does later (`ValidateMeshConfigProxyConfig`): an address must be `host:port`.
const VALID_SAMPLES: &[(&str, &str)] = &[
    ("discoveryAddress", "istiod.sample.svc:15012"),
    ("statsdUdpAddress", "statsd.sample.svc:8125"),
];

/// A proto-JSON value for the field that differs from its default (proto-JSON leaves
/// defaults out, and the agent's defaults are Istio's), in a spelling proto-JSON accepts but
/// does not write (ints as strings, `1.5s`), so normalisation is checked. A message gets every nested field
/// set (one member per oneof), a few levels deep, so nested names and values are checked too.
fn sample(f: &FieldDescriptor) -> Value {
    sample_at(f, 0)
}

fn sample_at(f: &FieldDescriptor, depth: usize) -> Value {
    if let Some((_, v)) = VALID_SAMPLES.iter().find(|(n, _)| *n == f.json_name()) {
        return json!(v);
    }
    let one = match f.kind() {
        Kind::String => json!("sample"),
        Kind::Bytes => json!("AQI="),
        Kind::Bool => json!(true),
        Kind::Double | Kind::Float => json!(1.5),
        Kind::Int32
        | Kind::Uint32
        | Kind::Int64
        | Kind::Uint64
        | Kind::Sint32
        | Kind::Sint64
        | Kind::Fixed32
        | Kind::Fixed64
        | Kind::Sfixed32
        | Kind::Sfixed64 => json!("7"),
        Kind::Enum(e) => {
            // A value that is not the proto default (number 0).
            let v = e.values().find(|v| v.number() != 0).unwrap();
            json!(v.name())
        }
        Kind::Message(m) => match m.full_name() {
            "google.protobuf.Duration" => json!("1.5s"),
            "google.protobuf.BoolValue" => json!(true),
            "google.protobuf.StringValue" => json!("sample"),
            "google.protobuf.DoubleValue" | "google.protobuf.FloatValue" => json!(1.5),
            "google.protobuf.Int32Value"
            | "google.protobuf.UInt32Value"
            | "google.protobuf.Int64Value"
            | "google.protobuf.UInt64Value" => json!(3),
            "google.protobuf.Struct" => json!({"k": "v"}),
            "google.protobuf.Value" => json!("v"),
            "google.protobuf.Empty" => json!({}),
            _ if f.is_map() => json!({"k": sample_at(&m.map_entry_value_field(), depth + 1)}),
            _ if depth >= 3 => json!({}),
            _ => {
                let mut obj = serde_json::Map::new();
                let mut oneofs = Vec::new();
                for nf in m.fields() {
                    if let Some(o) = nf.containing_oneof() {
                        if oneofs.contains(&o.name().to_owned()) {
                            continue;
                        }
                        oneofs.push(o.name().to_owned());
                    }
                    obj.insert(nf.json_name().to_owned(), sample_at(&nf, depth + 1));
                }
                Value::Object(obj)
            }
        },
    };
    if f.is_list() { json!([one]) } else { one }
}

/// The effective ProxyConfig (as the agent serializes it) and the warnings of one load with
/// `PROXY_CONFIG` set to `layer`.
fn agent_load(layer: &Value) -> Result<(serde_json::Map<String, Value>, Vec<String>), String> {
    let dir = tempfile::tempdir().unwrap();
    let env = MapEnv::from_pairs([("PROXY_CONFIG".to_owned(), layer.to_string())]);
    let cfg = load(&ProxyFlags::default(), &env, dir.path())
        .map_err(|e| format!("layer {layer} rejected: {e}"))?;
    let Value::Object(pc) = serde_json::to_value(&cfg.proxy_config).unwrap() else {
        panic!("ProxyConfig does not serialize to an object")
    };
    Ok((pc, cfg.warnings))
}

#[test]
fn every_istio_proxy_config_field_is_modelled_with_istios_name_and_value() {
    let desc = istio_proxy_config();
    let mut problems = Vec::new();
    for f in desc.fields() {
        let json_name = f.json_name().to_owned();
        let value = sample(&f);
        let expected = {
            let layer = json!({ &json_name: value.clone() });
            let msg = DynamicMessage::deserialize(desc.clone(), layer).unwrap();
            serde_json::to_value(&msg).unwrap()[&json_name].clone()
        };
        for key in [json_name.as_str(), f.name()] {
            let (pc, warnings) = match agent_load(&json!({ key: value.clone() })) {
                Ok(r) => r,
                Err(e) => {
                    problems.push(format!("{key}: {e}"));
                    continue;
                }
            };
            let unknown = warnings
                .iter()
                .any(|w| w.contains("unknown ProxyConfig fields") && w.contains(key));
            if unknown {
                problems.push(format!("{key}: Istio's field is unknown to the agent"));
                continue;
            }
            match pc.get(&json_name) {
                Some(got) if *got == expected => {}
                got => problems.push(format!(
                    "{key} = {value}: the agent's ProxyConfig has {json_name} = {got:?}, \
                     Istio's proto-JSON {expected}"
                )),
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the agent's ProxyConfig model differs from Istio's {}:\n{}",
        desc.full_name(),
        problems.join("\n")
    );
}

#[test]
fn every_field_the_agent_serializes_is_istios() {
    let desc = istio_proxy_config();
    let names: Vec<String> = desc.fields().map(|f| f.json_name().to_owned()).collect();
    // Every optional field set, so each serialized name shows up.
    let layer: serde_json::Map<String, Value> = desc
        .fields()
        // One member of the serviceCluster/tracingServiceName oneof at a time.
        .filter(|f| f.json_name() != "tracingServiceName")
        .map(|f| (f.json_name().to_owned(), sample(&f)))
        .collect();
    let mut seen = Vec::new();
    for layer in [
        Value::Object(layer),
        json!({ "tracingServiceName": "CANONICAL_NAME_ONLY" }),
    ] {
        let (pc, _) = agent_load(&layer).unwrap();
        seen.extend(pc.into_iter().map(|(k, _)| k));
    }
    let foreign: Vec<&String> = seen.iter().filter(|k| !names.contains(k)).collect();
    assert!(
        foreign.is_empty(),
        "the agent serializes ProxyConfig fields Istio's {} does not have: {foreign:?}",
        desc.full_name()
    );
}

/// Other proto-JSON spellings of scalar, enum, duration and wrapper values, valid and not:
/// the agent must accept what Istio's schema accepts (with the same resulting value) and
/// reject what it rejects. prost-reflect's proto-JSON mapping against Istio's descriptor is
/// the reference (Istio's `protomarshal.ApplyJSON` is golang/protobuf's jsonpb, the same
/// mapping).
fn spellings(f: &FieldDescriptor) -> Vec<Value> {
    if f.is_list() || f.is_map() {
        return vec![json!("not a list"), json!(7)];
    }
    match f.kind() {
        Kind::String => vec![json!(7), json!(true)],
        Kind::Bool => vec![json!("true"), json!(1)],
        Kind::Int32 | Kind::Uint32 => {
            vec![
                json!("7"),
                json!(-1),
                json!(7.5),
                json!("x"),
                json!(4_294_967_296_u64),
            ]
        }
        Kind::Enum(e) => {
            let v = e.values().find(|v| v.number() != 0).unwrap();
            vec![json!(v.number()), json!("NO_SUCH_VALUE"), json!(99)]
        }
        Kind::Message(m) => match m.full_name() {
            "google.protobuf.Duration" => vec![
                json!("2s"),
                json!("0.000000001s"),
                json!("1m"),
                json!("-1s"),
                json!(5),
            ],
            "google.protobuf.BoolValue" => vec![json!("true"), json!(1)],
            "google.protobuf.Int32Value" | "google.protobuf.UInt32Value" => {
                vec![json!("3"), json!(-1), json!("x")]
            }
            _ => vec![json!("not an object"), json!(7)],
        },
        _ => Vec::new(),
    }
}

/// Spellings where the agent knowingly differs from Istio's schema, with the reason; each is
/// checked to still differ, so the list stays exact. All are values the schema takes that the
/// agent refuses at load, naming the field.
const KNOWN_DIFFERENCES: &[(&str, &str, &str)] = &[
    // Refused by Istio's agent too, right after parsing: pilot/cmd/pilot-agent/config/config.go
    // runs pkg/config/validation/agent ValidateMeshConfigProxyConfig (ValidateDrainDuration,
    // ValidatePort, ValidateControlPlaneAuthPolicy).
    (
        "drainDuration",
        r#""0.000000001s""#,
        "Istio: drain duration must be >= 1ms",
    ),
    (
        "drainDuration",
        r#""-1s""#,
        "Istio: drain duration must be >= 1ms",
    ),
    (
        "proxyAdminPort",
        "-1",
        "Istio: port number -1 must be in the range 1..65535",
    ),
    (
        "statusPort",
        "-1",
        "Istio: port number -1 must be in the range 1..65535",
    ),
    (
        "controlPlaneAuthPolicy",
        "99",
        "Istio: unrecognized control plane auth policy",
    ),
    // Taken by Istio's agent and meaningless: a negative count, size or wait (the agent's own
    // checks after parsing), an enum number with no name (pbjson's generated enums are
    // closed; protojson keeps unknown numbers); COMPAT.md "ProxyConfig values Istio's schema
    // takes".
    ("statNameLength", "-1", "a negative name length"),
    ("concurrency", "-1", "a negative worker count"),
    ("terminationDrainDuration", r#""-1s""#, "a negative wait"),
    ("fileFlushInterval", r#""-1s""#, "a negative interval"),
    ("interceptionMode", "99", "no such interception mode"),
    ("tracingServiceName", "99", "no such naming scheme"),
];

#[test]
fn proto_json_spellings_are_accepted_and_rejected_as_istios_schema_does() {
    let desc = istio_proxy_config();
    let mut problems = Vec::new();
    let mut differences = Vec::new();
    for f in desc.fields() {
        let name = f.json_name().to_owned();
        for value in spellings(&f) {
            let layer = json!({ &name: value.clone() });
            let istio = DynamicMessage::deserialize(desc.clone(), layer.clone())
                .map(|m| serde_json::to_value(&m).unwrap()[&name].clone());
            let ours = agent_load(&layer).map(|(pc, _)| pc.get(&name).cloned());
            let verdict = match (&istio, &ours) {
                (Ok(i), Ok(Some(o))) if i == o => None,
                // Istio's proto-JSON leaves a default value out; the agent writes it.
                (Ok(Value::Null), Ok(Some(_))) => None,
                (Err(_), Err(_)) => None,
                (Ok(i), Ok(o)) => Some(format!("Istio {i}, agent {o:?}")),
                (Ok(i), Err(e)) => Some(format!("Istio accepts ({i}), agent rejects: {e}")),
                (Err(e), Ok(o)) => Some(format!("Istio rejects ({e}), agent accepts: {o:?}")),
            };
            let shown = value.to_string();
            let known = KNOWN_DIFFERENCES
                .iter()
                .any(|(n, v, _)| *n == name && *v == shown);
            match (verdict, known) {
                (Some(v), false) => problems.push(format!("{name} = {value}: {v}")),
                (Some(_), true) => differences.push((name.clone(), value.to_string())),
                (None, true) => problems.push(format!(
                    "{name} = {value}: now as Istio's schema; remove it from KNOWN_DIFFERENCES"
                )),
                (None, false) => {}
            }
        }
    }
    assert!(
        problems.is_empty(),
        "proto-JSON differences from Istio's schema:\n{}",
        problems.join("\n")
    );
    assert_eq!(differences.len(), KNOWN_DIFFERENCES.len());
}
