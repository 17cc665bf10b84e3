//! Generates Istio's `istio.mesh.v1alpha1.ProxyConfig` (and only the messages it reaches) from
//! `mesh/v1alpha1/proxy.proto` of the `istio.io/api` Go module that compat/go.mod pins: prost
//! structs with pbjson's proto-JSON serde impls, so every field and proto-JSON rule of the
//! agent's ProxyConfig is Istio's. Nothing of Istio's is in the repository: the module comes
//! from `$ISTIO_API_DIR`, else the repository's Go module cache (`.tools/go/mod`, which
//! `make pilot-agent` fills), else `go mod download` into that cache.
#![allow(
    clippy::disallowed_methods,
    reason = "build script, not on the agent's runtime"
)]

use std::collections::{BTreeSet, HashMap};
use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use prost::Message as _;
use prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet};

const PROXY_PROTO: &str = "mesh/v1alpha1/proxy.proto";
const ROOT: &str = ".istio.mesh.v1alpha1.ProxyConfig";

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn main() -> Result<()> {
    println!("cargo:rerun-if-changed=build.rs");
    // `make agent` links through link/cc-ordered, which lays the code out by this file; cargo
    // does not know the linker reads it, so without this a regenerated order file would not
    // be linked until something else changed; nor that the wrapper itself decides the layout.
    println!("cargo:rerun-if-changed=link/agent.order");
    println!("cargo:rerun-if-changed=link/cc-ordered");
    println!("cargo:rerun-if-env-changed=ISTIO_API_DIR");
    println!("cargo:rerun-if-env-changed=GO");
    let api = istio_api_dir()?;
    let mut fds = protox::compile([PROXY_PROTO], [api.clone(), api.join("common-protos")])
        .map_err(|e| format!("compiling {}: {e}", api.join(PROXY_PROTO).display()))?;
    for f in &fds.file {
        let name = f.name();
        for dir in [&api, &api.join("common-protos")] {
            if dir.join(name).is_file() {
                println!("cargo:rerun-if-changed={}", dir.join(name).display());
            }
        }
    }
    prune(&mut fds);
    let out = PathBuf::from(env::var("OUT_DIR")?);
    write_fields(&fds, &out.join("proxy_config_fields.rs"))?;

    let mut config = prost_build::Config::new();
    config
        .out_dir(&out)
        // Istio's comments are its documentation, with examples rustdoc would run as tests.
        .disable_comments(["."])
        .btree_map(["."])
        .compile_well_known_types()
        .extern_path(".google.protobuf", "::pbjson_types");
    config.compile_fds(fds.clone())?;
    pbjson_build::Builder::new()
        .out_dir(&out)
        .register_descriptors(&fds.encode_to_vec())?
        // Istio's protomarshal.ApplyJSON retries with AllowUnknownFields: unknown names are
        // ignored (the agent lists the top-level ones itself, for its warning).
        .ignore_unknown_fields()
        .btree_map(["."])
        .build(&[".istio"])?;
    Ok(())
}

/// The pinned `istio.io/api` module's directory.
fn istio_api_dir() -> Result<PathBuf> {
    if let Some(dir) = env::var_os("ISTIO_API_DIR") {
        let dir = PathBuf::from(dir);
        if !dir.join(PROXY_PROTO).is_file() {
            return Err(format!(
                "ISTIO_API_DIR={} has no {PROXY_PROTO}: point it at a checkout of istio.io/api",
                dir.display()
            )
            .into());
        }
        return Ok(dir);
    }
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?);
    let repo = manifest.join("../..");
    let compat = repo.join("compat");
    let go_mod = compat.join("go.mod");
    println!("cargo:rerun-if-changed={}", go_mod.display());
    let text = std::fs::read_to_string(&go_mod).map_err(|e| {
        format!(
            "reading {} for the pinned istio.io/api version: {e}; outside this repository \
             set ISTIO_API_DIR to a checkout of istio.io/api",
            go_mod.display()
        )
    })?;
    let version = text
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("istio.io/api "))
        .and_then(|v| v.split_whitespace().next())
        .ok_or_else(|| format!("no istio.io/api requirement in {}", go_mod.display()))?
        .to_owned();
    let cache = repo.join(".tools/go/mod");
    let dir = cache.join(format!("istio.io/api@{version}"));
    if dir.join(PROXY_PROTO).is_file() {
        return Ok(dir);
    }
    let go = go_binary();
    let status = Command::new(&go)
        .args(["mod", "download", "istio.io/api"])
        .current_dir(&compat)
        .env("GOMODCACHE", &cache)
        .env("GOCACHE", repo.join(".tools/go/cache"))
        .env("GOFLAGS", "-mod=readonly")
        .env("GOTOOLCHAIN", "local")
        .status();
    match status {
        Ok(s) if s.success() && dir.join(PROXY_PROTO).is_file() => Ok(dir),
        outcome => Err(format!(
            "Istio's {PROXY_PROTO} (istio.io/api {version}) is not at {} and \
             `{} mod download istio.io/api` in {} did not fetch it ({}). Either install Go \
             (set GO to its binary if it is not on PATH) with access to the Go module proxy, \
             or set ISTIO_API_DIR to a checkout of istio.io/api at that version",
            dir.display(),
            go.display(),
            compat.display(),
            match outcome {
                Ok(s) => format!("exit {s}"),
                Err(e) => e.to_string(),
            }
        )
        .into()),
    }
}

/// `$GO`, else `go` on PATH, else Go's default install location.
fn go_binary() -> PathBuf {
    if let Some(go) = env::var_os("GO") {
        return PathBuf::from(go);
    }
    let on_path = env::var_os("PATH")
        .into_iter()
        .flat_map(|p| env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("go"))
        .find(|p| p.is_file());
    on_path.unwrap_or_else(|| PathBuf::from("/usr/local/go/bin/go"))
}

/// Keeps only the messages and enums ProxyConfig reaches (proxy.proto imports networking
/// protos whose other types the agent never parses), and no services or source info.
fn prune(fds: &mut FileDescriptorSet) {
    // Every message by full name, with the names of the types its fields use.
    let mut uses: HashMap<String, Vec<String>> = HashMap::new();
    fn walk(prefix: &str, m: &DescriptorProto, uses: &mut HashMap<String, Vec<String>>) {
        let name = format!("{prefix}.{}", m.name());
        let mut used: Vec<String> = m
            .field
            .iter()
            .filter(|f| !f.type_name().is_empty())
            .map(|f| f.type_name().to_owned())
            .collect();
        // A nested type keeps its parent (prost nests it in the parent's module).
        used.push(prefix.to_owned());
        for n in &m.nested_type {
            walk(&name, n, uses);
        }
        uses.insert(name, used);
    }
    for f in &fds.file {
        let prefix = format!(".{}", f.package());
        for m in &f.message_type {
            walk(&prefix, m, &mut uses);
        }
    }
    let mut reached = BTreeSet::new();
    let mut todo = vec![ROOT.to_owned()];
    while let Some(n) = todo.pop() {
        if !reached.insert(n.clone()) {
            continue;
        }
        if let Some(u) = uses.get(&n) {
            todo.extend(u.iter().cloned());
        }
    }
    fn keep(prefix: &str, m: &mut DescriptorProto, reached: &BTreeSet<String>) {
        let name = format!("{prefix}.{}", m.name());
        m.nested_type
            .retain(|n| reached.contains(&format!("{name}.{}", n.name())));
        m.enum_type
            .retain(|e| reached.contains(&format!("{name}.{}", e.name())));
        for n in &mut m.nested_type {
            keep(&name, n, reached);
        }
    }
    for f in &mut fds.file {
        let prefix = format!(".{}", f.package());
        f.message_type
            .retain(|m| reached.contains(&format!("{prefix}.{}", m.name())));
        f.enum_type
            .retain(|e| reached.contains(&format!("{prefix}.{}", e.name())));
        for m in &mut f.message_type {
            keep(&prefix, m, &reached);
        }
        f.service.clear();
        f.extension.clear();
        f.source_code_info = None;
    }
    // Files left without types are dropped (prost would write empty modules for them).
    fds.file.retain(|f: &FileDescriptorProto| {
        !f.message_type.is_empty() || !f.enum_type.is_empty() || f.package() == "google.protobuf"
    });
}

/// `FIELDS`: ProxyConfig's fields as (JSON name, proto name); `take_field` moves one field (by
/// JSON name) from a parsed layer into the merged message, a oneof as a whole.
fn write_fields(fds: &FileDescriptorSet, path: &Path) -> Result<()> {
    let pc = fds
        .file
        .iter()
        .filter(|f| f.package() == "istio.mesh.v1alpha1")
        .flat_map(|f| &f.message_type)
        .find(|m| m.name() == "ProxyConfig")
        .ok_or("no istio.mesh.v1alpha1.ProxyConfig in proxy.proto")?;
    let mut fields = String::new();
    let mut arms = String::new();
    for f in &pc.field {
        writeln!(fields, "    ({:?}, {:?}),", f.json_name(), f.name())?;
        // proto3 `optional` is a synthetic oneof: prost makes it a plain Option field.
        let member = f
            .oneof_index
            .filter(|_| !f.proto3_optional())
            .map(|i| pc.oneof_decl[i as usize].name().to_owned());
        let rust = rust_ident(member.as_deref().unwrap_or(f.name()));
        writeln!(
            arms,
            "        {:?} => dst.{rust} = ::std::mem::take(&mut src.{rust}),",
            f.json_name()
        )?;
    }
    let code = format!(
        "/// ProxyConfig's fields as (JSON name, proto field name).\n\
         pub const FIELDS: &[(&str, &str)] = &[\n{fields}];\n\n\
         /// Moves the field `json_name` from `src` to `dst` (a oneof member moves the oneof);\n\
         /// false for a name ProxyConfig does not have.\n\
         pub fn take_field(dst: &mut ProxyConfig, src: &mut ProxyConfig, json_name: &str) -> bool {{\n\
         \x20   match json_name {{\n{arms}        _ => return false,\n    }}\n    true\n}}\n"
    );
    std::fs::write(path, code)?;
    Ok(())
}

/// prost's field name for a proto field name (snake case; keywords raw).
fn rust_ident(name: &str) -> String {
    let mut s = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                s.push('_');
            }
            s.push(c.to_ascii_lowercase());
        } else {
            s.push(c);
        }
    }
    match s.as_str() {
        "type" | "match" | "ref" | "mod" | "move" | "self" | "crate" | "super" => {
            format!("r#{s}")
        }
        _ => s,
    }
}
