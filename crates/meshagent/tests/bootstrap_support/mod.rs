//! Shared by the bootstrap suites (`bootstrap_golden`, `compat_bootstrap`): bootstraps compared
//! as `envoy.config.bootstrap.v3.Bootstrap` protos, and a readable field-by-field diff.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Paths where `a` and `b` differ (for a readable failure).
pub fn diff(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => diff(&format!("{path}/{k}"), v, w, out),
                    None => out.push(format!("{path}/{k}: unexpected {v}")),
                }
            }
            for (k, w) in y {
                if !x.contains_key(k) {
                    out.push(format!("{path}/{k}: missing, expected {w}"));
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (v, w)) in x.iter().zip(y).enumerate() {
                diff(&format!("{path}/{i}"), v, w, out);
            }
        }
        _ if a != b => out.push(format!("{path}: got {a}, expected {b}")),
        _ => {}
    }
}

/// Envoy's API descriptors: envoy-types ships the FileDescriptorSet its Rust types were
/// generated from (`src/generated/types.bin`), found through `cargo metadata` at the version
/// Cargo.lock pins. `udpa.type.v1.TypedStruct` (cncf/xds) is not in that set; it is added by
/// hand (two fields), its `value` staying an untyped `Struct` as it is for Envoy.
pub fn envoy_descriptors() -> prost_reflect::DescriptorPool {
    use prost_reflect::prost_types::{
        DescriptorProto, FieldDescriptorProto, FileDescriptorProto,
        field_descriptor_proto::{Label, Type},
    };
    let out = Command::new(env!("CARGO"))
        // Not `--offline`: listing every platform's packages may need crates a Linux build
        // never downloaded.
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--manifest-path",
        ])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml"))
        .output()
        .expect("cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    let manifest = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "envoy-types")
        .and_then(|p| p["manifest_path"].as_str())
        .expect("envoy-types in cargo metadata");
    let set = Path::new(manifest).with_file_name("src/generated/types.bin");
    let bytes = std::fs::read(&set).unwrap_or_else(|e| panic!("{}: {e}", set.display()));
    let mut pool = prost_reflect::DescriptorPool::decode(bytes.as_slice())
        .unwrap_or_else(|e| panic!("{}: {e}", set.display()));
    let field = |name: &str, number: i32, ty: Type, type_name: Option<&str>| FieldDescriptorProto {
        name: Some(name.into()),
        json_name: None,
        number: Some(number),
        label: Some(Label::Optional as i32),
        r#type: Some(ty as i32),
        type_name: type_name.map(str::to_owned),
        ..Default::default()
    };
    pool.add_file_descriptor_proto(FileDescriptorProto {
        name: Some("udpa/type/v1/typed_struct.proto".into()),
        package: Some("udpa.type.v1".into()),
        dependency: vec!["google/protobuf/struct.proto".into()],
        message_type: vec![DescriptorProto {
            name: Some("TypedStruct".into()),
            field: vec![
                field("type_url", 1, Type::String, None),
                field("value", 2, Type::Message, Some(".google.protobuf.Struct")),
            ],
            ..Default::default()
        }],
        syntax: Some("proto3".into()),
        ..Default::default()
    })
    .unwrap();
    pool
}

/// `v` parsed as an `envoy.config.bootstrap.v3.Bootstrap` (proto3 JSON mapping, unknown fields
/// rejected, every `typed_config` resolved), printed back in the canonical proto-JSON form:
/// two bootstraps are the same proto exactly when these are equal.
pub fn as_bootstrap_proto(
    pool: &prost_reflect::DescriptorPool,
    v: &Value,
) -> Result<Value, String> {
    let desc = pool
        .get_message_by_name("envoy.config.bootstrap.v3.Bootstrap")
        .ok_or("no Bootstrap descriptor")?;
    let msg = prost_reflect::DynamicMessage::deserialize(desc, v.clone())
        .map_err(|e| format!("not a Bootstrap proto: {e}"))?;
    serde_json::to_value(&msg).map_err(|e| e.to_string())
}
