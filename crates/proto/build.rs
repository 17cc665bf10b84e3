//! Compiles the vendored Istio protos with protox (pure Rust), so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/istio/v1/auth/ca.proto",
        "proto/istio/networking/nds/v1/nds.proto",
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"])?;
    let mut config = tonic_prost_build::Config::new();
    // Type URLs must be `type.googleapis.com/<full name>` to be valid xDS type URLs.
    config
        .enable_type_names()
        .type_name_domain(["."], "type.googleapis.com");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Share google.protobuf types with envoy-types so Struct/Any interoperate.
        .compile_well_known_types(true)
        .extern_path(".google.protobuf", "::envoy_types::pb::google::protobuf")
        .compile_fds_with_config(fds, config)?;
    Ok(())
}
