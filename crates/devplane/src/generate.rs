//! Generates a proxy's xDS resources from the mesh, shaped like istiod's sidecar config:
//! inbound listeners that require mTLS with SDS secrets `default` and `ROOTCA` from the
//! `sds-grpc` cluster, outbound listeners and EDS clusters that originate mTLS and verify the
//! server's SPIFFE identity, RDS routes, and the NDS name table.

use std::collections::BTreeMap;

use meshagent_proto::envoy::pb::envoy::config::cluster::v3 as cluster;
use meshagent_proto::envoy::pb::envoy::config::core::v3 as core;
use meshagent_proto::envoy::pb::envoy::config::endpoint::v3 as endpoint;
use meshagent_proto::envoy::pb::envoy::config::listener::v3 as listener;
use meshagent_proto::envoy::pb::envoy::config::route::v3 as route;
use meshagent_proto::envoy::pb::envoy::extensions::filters::http::router::v3::Router;
use meshagent_proto::envoy::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use meshagent_proto::envoy::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
use meshagent_proto::envoy::pb::envoy::r#type::matcher::v3 as matcher;
use meshagent_proto::envoy::pb::google::protobuf::{Any, Duration, UInt32Value};
use meshagent_proto::envoy::util::pack_any;
use meshagent_proto::type_url;

use crate::mesh::{Mesh, ProxyIdentity, Service, Workload};

/// All resources of one proxy, by type URL then resource name.
pub type Resources = BTreeMap<&'static str, BTreeMap<String, Any>>;

/// The types devplane serves, in the order istiod pushes them.
pub const SERVED_TYPES: [&str; 5] = [
    type_url::CLUSTER,
    type_url::ENDPOINT,
    type_url::LISTENER,
    type_url::ROUTE,
    type_url::NAME_TABLE,
];

/// NDS is a single unnamed resource in istiod's push; it is keyed by an empty name.
pub const NAME_TABLE_RESOURCE: &str = "";

pub fn generate(mesh: &Mesh, proxy: &ProxyIdentity) -> Resources {
    // istiod picks the generator from node metadata `GENERATOR` (pilot/pkg/xds `findGenerator`).
    if proxy.generator.as_deref() == Some("grpc") {
        return crate::grpcgen::generate(mesh, proxy);
    }
    let mut out = Resources::new();
    for t in SERVED_TYPES {
        out.insert(t, BTreeMap::new());
    }
    let me = mesh.find_workload(proxy);

    for svc in &mesh.services {
        for port in &svc.ports {
            let name = outbound_cluster_name(mesh, svc, port.port);
            out.get_mut(type_url::CLUSTER).map(|m| {
                m.insert(
                    name.clone(),
                    pack_any(outbound_cluster(mesh, svc, &name, port.port)),
                )
            });
            out.get_mut(type_url::ENDPOINT).map(|m| {
                m.insert(
                    name.clone(),
                    pack_any(endpoints(mesh, svc, &name, port.target_port)),
                )
            });
        }
    }
    if let Some(w) = me {
        for p in &w.ports {
            let name = format!("inbound|{}||", p.port);
            let c = inbound_cluster(w, &name, p.port);
            out.get_mut(type_url::CLUSTER)
                .map(|m| m.insert(name.clone(), pack_any(c)));
            let l = inbound_listener(w, &name, p.inbound_port);
            out.get_mut(type_url::LISTENER)
                .map(|m| m.insert(l.name.clone(), pack_any(l)));
        }
        for o in &w.outbound {
            let Some(svc) = mesh.service_by_key(&o.service) else {
                continue; // validated at load; kept defensive for hand-built meshes
            };
            let cluster_name = outbound_cluster_name(mesh, svc, o.port);
            let listener_name = format!("{}_{}", o.bind.ip(), o.bind.port());
            let l = outbound_listener(&listener_name, o.bind, &cluster_name, &mesh.wasm_plugins);
            out.get_mut(type_url::LISTENER)
                .map(|m| m.insert(listener_name.clone(), pack_any(l)));
            let r = route::RouteConfiguration {
                name: cluster_name.clone(),
                virtual_hosts: vec![route::VirtualHost {
                    name: format!("{}:{}", mesh.hostname(svc), o.port),
                    domains: vec!["*".into()],
                    routes: vec![route_to(&cluster_name)],
                    ..Default::default()
                }],
                validate_clusters: Some(bool_value(false)),
                ..Default::default()
            };
            out.get_mut(type_url::ROUTE)
                .map(|m| m.insert(cluster_name.clone(), pack_any(r)));
        }
    }
    if !mesh.wasm_plugins.is_empty() {
        let ecds = out.entry(type_url::EXTENSION_CONFIG).or_default();
        for p in &mesh.wasm_plugins {
            ecds.insert(p.resource_name(), p.extension_config());
        }
    }
    // istiod answers the self-discovery cluster for any proxy that watches it (Envoy does when
    // its bootstrap has `local_cluster`), empty when the proxy has no service.
    out.get_mut(type_url::ENDPOINT).map(|m| {
        m.insert(
            crate::local_cluster::NAME.into(),
            pack_any(crate::local_cluster::load_assignment(mesh, me)),
        )
    });
    let table = crate::nds::name_table(mesh);
    out.get_mut(type_url::NAME_TABLE)
        .map(|m| m.insert(NAME_TABLE_RESOURCE.into(), pack_any(table)));
    out
}

pub fn outbound_cluster_name(mesh: &Mesh, svc: &Service, port: u16) -> String {
    format!("outbound|{port}||{}", mesh.hostname(svc))
}

pub(crate) fn ads_config_source() -> core::ConfigSource {
    core::ConfigSource {
        config_source_specifier: Some(core::config_source::ConfigSourceSpecifier::Ads(
            core::AggregatedConfigSource {},
        )),
        initial_fetch_timeout: Some(duration_secs(0)),
        resource_api_version: core::ApiVersion::V3 as i32,
        ..Default::default()
    }
}

/// SDS from the agent's socket, exactly as istiod renders it.
fn sds_secret(name: &str) -> tls::SdsSecretConfig {
    tls::SdsSecretConfig {
        name: name.into(),
        sds_config: Some(core::ConfigSource {
            config_source_specifier: Some(
                core::config_source::ConfigSourceSpecifier::ApiConfigSource(
                    core::ApiConfigSource {
                        api_type: core::api_config_source::ApiType::Grpc as i32,
                        transport_api_version: core::ApiVersion::V3 as i32,
                        set_node_on_first_message_only: true,
                        grpc_services: vec![core::GrpcService {
                            target_specifier: Some(core::grpc_service::TargetSpecifier::EnvoyGrpc(
                                core::grpc_service::EnvoyGrpc {
                                    cluster_name: "sds-grpc".into(),
                                    ..Default::default()
                                },
                            )),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                ),
            ),
            initial_fetch_timeout: Some(duration_secs(0)),
            resource_api_version: core::ApiVersion::V3 as i32,
            ..Default::default()
        }),
    }
}

fn common_tls(alpn: &[&str], verify_sans: Vec<String>) -> tls::CommonTlsContext {
    let default_validation = tls::CertificateValidationContext {
        match_typed_subject_alt_names: verify_sans
            .into_iter()
            .map(|san| tls::SubjectAltNameMatcher {
                san_type: tls::subject_alt_name_matcher::SanType::Uri as i32,
                matcher: Some(matcher::StringMatcher {
                    match_pattern: Some(matcher::string_matcher::MatchPattern::Exact(san)),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    tls::CommonTlsContext {
        tls_certificate_sds_secret_configs: vec![sds_secret("default")],
        alpn_protocols: alpn.iter().map(|s| s.to_string()).collect(),
        validation_context_type: Some(
            tls::common_tls_context::ValidationContextType::CombinedValidationContext(
                tls::common_tls_context::CombinedCertificateValidationContext {
                    default_validation_context: Some(default_validation),
                    validation_context_sds_secret_config: Some(sds_secret("ROOTCA")),
                    ..Default::default()
                },
            ),
        ),
        ..Default::default()
    }
}

pub(crate) fn transport_socket(name: &str, config: Any) -> core::TransportSocket {
    core::TransportSocket {
        name: name.into(),
        config_type: Some(core::transport_socket::ConfigType::TypedConfig(config)),
    }
}

fn outbound_cluster(mesh: &Mesh, svc: &Service, name: &str, port: u16) -> cluster::Cluster {
    // Istio verifies the identities of the service's backing workloads.
    let sans: Vec<String> = svc
        .selector
        .iter()
        .filter_map(|w| mesh.workload(&svc.namespace, w))
        .map(|w| mesh.spiffe_id(&w.namespace, &w.service_account))
        .collect();
    let ctx = tls::UpstreamTlsContext {
        common_tls_context: Some(common_tls(&["istio"], sans)),
        sni: format!("outbound_.{port}_._.{}", mesh.hostname(svc)),
        ..Default::default()
    };
    cluster::Cluster {
        name: name.into(),
        connect_timeout: Some(duration_secs(10)),
        cluster_discovery_type: Some(cluster::cluster::ClusterDiscoveryType::Type(
            cluster::cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::cluster::EdsClusterConfig {
            eds_config: Some(ads_config_source()),
            service_name: name.into(),
        }),
        transport_socket: Some(transport_socket(
            "envoy.transport_sockets.tls",
            pack_any(ctx),
        )),
        ..Default::default()
    }
}

fn inbound_cluster(w: &Workload, name: &str, app_port: u16) -> cluster::Cluster {
    cluster::Cluster {
        name: name.into(),
        connect_timeout: Some(duration_secs(10)),
        cluster_discovery_type: Some(cluster::cluster::ClusterDiscoveryType::Type(
            cluster::cluster::DiscoveryType::Static as i32,
        )),
        load_assignment: Some(endpoint::ClusterLoadAssignment {
            cluster_name: name.into(),
            endpoints: vec![locality_endpoints(vec![(w.address.to_string(), app_port)])],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn endpoints(
    mesh: &Mesh,
    svc: &Service,
    name: &str,
    target_port: u16,
) -> endpoint::ClusterLoadAssignment {
    let addrs = svc
        .selector
        .iter()
        .filter_map(|w| mesh.workload(&svc.namespace, w))
        .filter_map(|w| {
            w.ports
                .iter()
                .find(|p| p.port == target_port)
                .map(|p| (w.address.to_string(), p.inbound_port))
        })
        .collect();
    endpoint::ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: vec![locality_endpoints(addrs)],
        ..Default::default()
    }
}

/// A workload's `region/zone/subzone` as an Envoy locality (missing parts empty).
pub(crate) fn locality(s: &str) -> core::Locality {
    let mut parts = s.splitn(3, '/');
    let mut part = || parts.next().unwrap_or_default().to_owned();
    core::Locality {
        region: part(),
        zone: part(),
        sub_zone: part(),
    }
}

fn locality_endpoints(addrs: Vec<(String, u16)>) -> endpoint::LocalityLbEndpoints {
    endpoint::LocalityLbEndpoints {
        lb_endpoints: addrs
            .into_iter()
            .map(|(ip, port)| endpoint::LbEndpoint {
                host_identifier: Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(
                    endpoint::Endpoint {
                        address: Some(socket_address(&ip, port)),
                        ..Default::default()
                    },
                )),
                load_balancing_weight: Some(UInt32Value { value: 1 }),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

pub(crate) fn socket_address(ip: &str, port: u16) -> core::Address {
    core::Address {
        address: Some(core::address::Address::SocketAddress(core::SocketAddress {
            address: ip.into(),
            port_specifier: Some(core::socket_address::PortSpecifier::PortValue(port.into())),
            ..Default::default()
        })),
    }
}

fn route_to(cluster_name: &str) -> route::Route {
    route::Route {
        name: "default".into(),
        r#match: Some(route::RouteMatch {
            path_specifier: Some(route::route_match::PathSpecifier::Prefix("/".into())),
            ..Default::default()
        }),
        action: Some(route::route::Action::Route(route::RouteAction {
            cluster_specifier: Some(route::route_action::ClusterSpecifier::Cluster(
                cluster_name.into(),
            )),
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(crate) fn router_filter() -> hcm::HttpFilter {
    hcm::HttpFilter {
        name: "envoy.filters.http.router".into(),
        config_type: Some(hcm::http_filter::ConfigType::TypedConfig(pack_any(
            Router::default(),
        ))),
        ..Default::default()
    }
}

fn network_filter(name: &str, config: Any) -> listener::Filter {
    listener::Filter {
        name: name.into(),
        config_type: Some(listener::filter::ConfigType::TypedConfig(config)),
    }
}

fn inbound_listener(w: &Workload, cluster_name: &str, inbound_port: u16) -> listener::Listener {
    let name = format!("inbound_{}_{inbound_port}", w.address);
    let manager = hcm::HttpConnectionManager {
        stat_prefix: name.clone(),
        route_specifier: Some(hcm::http_connection_manager::RouteSpecifier::RouteConfig(
            route::RouteConfiguration {
                name: cluster_name.into(),
                virtual_hosts: vec![route::VirtualHost {
                    name: "inbound|http".into(),
                    domains: vec!["*".into()],
                    routes: vec![route_to(cluster_name)],
                    ..Default::default()
                }],
                validate_clusters: Some(bool_value(false)),
                ..Default::default()
            },
        )),
        http_filters: vec![router_filter()],
        // Like Istio: the app learns the caller's SPIFFE identity from XFCC.
        forward_client_cert_details:
            hcm::http_connection_manager::ForwardClientCertDetails::AppendForward as i32,
        set_current_client_cert_details: Some(
            hcm::http_connection_manager::SetCurrentClientCertDetails {
                uri: true,
                dns: true,
                ..Default::default()
            },
        ),
        ..Default::default()
    };
    let tls_ctx = tls::DownstreamTlsContext {
        common_tls_context: Some(common_tls(&["istio", "h2", "http/1.1"], vec![])),
        require_client_certificate: Some(bool_value(true)),
        ..Default::default()
    };
    listener::Listener {
        name,
        address: Some(socket_address(&w.address.to_string(), inbound_port)),
        filter_chains: vec![listener::FilterChain {
            filters: vec![network_filter(
                "envoy.filters.network.http_connection_manager",
                pack_any(manager),
            )],
            transport_socket: Some(transport_socket(
                "envoy.transport_sockets.tls",
                pack_any(tls_ctx),
            )),
            ..Default::default()
        }],
        traffic_direction: core::TrafficDirection::Inbound as i32,
        ..Default::default()
    }
}

fn outbound_listener(
    name: &str,
    bind: std::net::SocketAddr,
    route_name: &str,
    plugins: &[crate::wasm::WasmPlugin],
) -> listener::Listener {
    let mut http_filters: Vec<hcm::HttpFilter> = plugins
        .iter()
        .map(|p| p.http_filter(ads_config_source()))
        .collect();
    http_filters.push(router_filter());
    let manager = hcm::HttpConnectionManager {
        stat_prefix: format!("outbound_{name}"),
        route_specifier: Some(hcm::http_connection_manager::RouteSpecifier::Rds(
            hcm::Rds {
                config_source: Some(ads_config_source()),
                route_config_name: route_name.into(),
            },
        )),
        http_filters,
        ..Default::default()
    };
    listener::Listener {
        name: name.into(),
        address: Some(socket_address(&bind.ip().to_string(), bind.port())),
        filter_chains: vec![listener::FilterChain {
            filters: vec![network_filter(
                "envoy.filters.network.http_connection_manager",
                pack_any(manager),
            )],
            ..Default::default()
        }],
        traffic_direction: core::TrafficDirection::Outbound as i32,
        ..Default::default()
    }
}

pub(crate) fn duration_secs(seconds: i64) -> Duration {
    Duration { seconds, nanos: 0 }
}

fn bool_value(value: bool) -> meshagent_proto::envoy::pb::google::protobuf::BoolValue {
    meshagent_proto::envoy::pb::google::protobuf::BoolValue { value }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshagent_proto::nds::NameTable;
    use prost::Message;
    use std::path::Path;

    fn mesh() -> Mesh {
        Mesh::parse(Path::new("m"), include_str!("../../../examples/mesh.yaml")).unwrap()
    }

    fn proxy(pod: &str) -> ProxyIdentity {
        ProxyIdentity {
            pod_name: pod.into(),
            namespace: "default".into(),
            workload_name: None,
            generator: None,
        }
    }

    #[test]
    fn workload_a_gets_inbound_outbound_and_names() {
        let m = mesh();
        let r = generate(&m, &proxy("a-1"));
        let clusters: Vec<_> = r[type_url::CLUSTER].keys().cloned().collect();
        assert!(clusters.contains(&"outbound|80||b.default.svc.cluster.local".to_string()));
        assert!(clusters.contains(&"inbound|18080||".to_string()));
        let listeners: Vec<_> = r[type_url::LISTENER].keys().cloned().collect();
        assert_eq!(
            listeners,
            vec!["127.0.0.1_15180", "inbound_127.0.0.1_15106"]
        );
        let eds = &r[type_url::ENDPOINT]["outbound|80||b.default.svc.cluster.local"];
        let cla = endpoint::ClusterLoadAssignment::decode(eds.value.as_slice()).unwrap();
        let ep = &cla.endpoints[0].lb_endpoints[0];
        let Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(e)) = &ep.host_identifier else {
            panic!("no endpoint")
        };
        let Some(core::address::Address::SocketAddress(sa)) = &e.address.as_ref().unwrap().address
        else {
            panic!("no address")
        };
        assert_eq!(
            sa.port_specifier,
            Some(core::socket_address::PortSpecifier::PortValue(15206))
        );
        let nt = NameTable::decode(r[type_url::NAME_TABLE][""].value.as_slice()).unwrap();
        assert_eq!(nt.table["b.default.svc.cluster.local"].shortname, "b");
    }

    #[test]
    fn outbound_cluster_verifies_server_identity() {
        let m = mesh();
        let r = generate(&m, &proxy("a-1"));
        let any = &r[type_url::CLUSTER]["outbound|80||b.default.svc.cluster.local"];
        let c = cluster::Cluster::decode(any.value.as_slice()).unwrap();
        let Some(core::transport_socket::ConfigType::TypedConfig(t)) =
            c.transport_socket.unwrap().config_type
        else {
            panic!()
        };
        let ctx = tls::UpstreamTlsContext::decode(t.value.as_slice()).unwrap();
        let Some(tls::common_tls_context::ValidationContextType::CombinedValidationContext(v)) =
            ctx.common_tls_context.unwrap().validation_context_type
        else {
            panic!()
        };
        let sans = v
            .default_validation_context
            .unwrap()
            .match_typed_subject_alt_names;
        assert_eq!(sans.len(), 1);
        let Some(matcher::string_matcher::MatchPattern::Exact(s)) =
            sans[0].matcher.as_ref().unwrap().match_pattern.clone()
        else {
            panic!()
        };
        assert_eq!(s, "spiffe://cluster.local/ns/default/sa/b");
    }

    #[test]
    fn unknown_proxy_gets_only_outbound_clusters() {
        let r = generate(&mesh(), &proxy("zzz"));
        assert!(r[type_url::LISTENER].is_empty());
        assert_eq!(r[type_url::CLUSTER].len(), 2);
    }
}
