//! Protocol types used by meshagent and devplane.
//!
//! * Envoy v3 xDS types come from `envoy-types` (re-exported as [`envoy`]).
//! * The Istio CA (`istio.v1.auth`) and NDS (`istio.networking.nds.v1`) protos are vendored under
//!   `proto/` (hand-written from the public schema) and compiled at build time with protox.
#![forbid(unsafe_code)]

pub use envoy_types as envoy;
pub use envoy_types::pb::google;

/// Istio CA service: `istio.v1.auth.IstioCertificateService`.
#[allow(clippy::all, missing_docs)]
pub mod ca {
    tonic::include_proto!("istio.v1.auth");
}

/// Istio DNS name table: `istio.networking.nds.v1`.
#[allow(clippy::all, missing_docs)]
pub mod nds {
    tonic::include_proto!("istio.networking.nds.v1");
}

/// `udpa.type.v1.TypedStruct` (and its twin `xds.type.v3.TypedStruct`, same fields and
/// numbers, cncf/xds `udpa/type/v1/typed_struct.proto`): an extension config as a JSON-like
/// `Struct` plus the type URL it stands for. Hand-written (envoy-types lacks it): two fields.
pub mod typed_struct {
    use envoy_types::pb::google::protobuf::Struct;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TypedStruct {
        #[prost(string, tag = "1")]
        pub type_url: String,
        #[prost(message, optional, tag = "2")]
        pub value: Option<Struct>,
    }

    pub const UDPA_TYPE_URL: &str = "type.googleapis.com/udpa.type.v1.TypedStruct";
    pub const XDS_TYPE_URL: &str = "type.googleapis.com/xds.type.v3.TypedStruct";
}

/// xDS type URLs used across the agent and devplane.
pub mod type_url {
    pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
    pub const EXTENSION_CONFIG: &str =
        "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig";
    pub const NAME_TABLE: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";
    pub const PROXY_CONFIG: &str = "type.googleapis.com/istio.mesh.v1alpha1.ProxyConfig";
    pub const HEALTH_INFO: &str = "type.googleapis.com/istio.v1.HealthInformation";
    pub const WORKLOAD: &str = "type.googleapis.com/istio.workload.Workload";
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Name;

    #[test]
    fn type_urls_are_xds_type_urls() {
        assert_eq!(nds::NameTable::type_url(), type_url::NAME_TABLE);
        assert_eq!(
            ca::IstioCertificateRequest::type_url(),
            "type.googleapis.com/istio.v1.auth.IstioCertificateRequest"
        );
    }

    #[test]
    fn ca_request_field_numbers() {
        use prost::Message;
        let req = ca::IstioCertificateRequest {
            csr: "x".into(),
            validity_duration: 5,
            metadata: None,
        };
        // field 1 (tag 0x0a, len 1, 'x'), field 3 varint (tag 0x18, 5)
        assert_eq!(req.encode_to_vec(), vec![0x0a, 1, b'x', 0x18, 5]);
    }
}
