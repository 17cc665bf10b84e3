//! Proxyless gRPC configuration for nodes with `GENERATOR=grpc`, shaped like istiod's grpc
//! generator (pilot/pkg/networking/grpcgen: `lds.go`, `rds.go`, `cds.go`, `grpcgen.go`):
//!
//! * **LDS, client side**: one API listener per service port, named `<host>:<port>` (the
//!   application dials `xds:///<host>:<port>`), an HTTP connection manager with RDS (route
//!   `<host>:<port>`, from ADS) and the router filter (gRPC rejects an empty filter list,
//!   istio#36150);
//! * **RDS**: a virtual host for `<host>` and `<host>:<port>` routing to `outbound|<port>||<host>`;
//! * **CDS**: EDS clusters `outbound|<port>||<host>`, round robin, with an
//!   `UpstreamTlsContext` when mTLS is on;
//! * **EDS**: the selected workloads' application ports (no sidecar in between), grouped by
//!   locality, each locality weighted (gRPC ignores a locality without a weight);
//! * **LDS, server side**: `xds.istio.io/grpc/lds/inbound/<ip>:<port>` for each port of the
//!   node's own workload (the name the gRPC server asks for through the bootstrap's
//!   `server_listener_resource_name_template`), with an inline route whose action is
//!   `non_forwarding_action` (required for xDS servers) and, with mTLS, a
//!   `DownstreamTlsContext` requiring client certificates.
//!
//! TLS contexts name certificate provider instance `default` with certificate names `default`
//! (identity) and `ROOTCA` (roots), in both the deprecated and the current fields as istiod
//! does (`buildCommonTLSContext`); SANs are matched exactly against the backends' SPIFFE IDs.
//!
//! devplane generates every resource up front and serves the subscribed names; istiod builds
//! inbound listeners from the requested name's host, so here a workload's inbound listeners
//! exist for its address and for the wildcard hosts `0.0.0.0` and `[::]`.

use std::collections::BTreeMap;

use meshagent_proto::envoy::pb::envoy::config::cluster::v3 as cluster;
use meshagent_proto::envoy::pb::envoy::config::core::v3 as core;
use meshagent_proto::envoy::pb::envoy::config::endpoint::v3 as endpoint;
use meshagent_proto::envoy::pb::envoy::config::listener::v3 as listener;
use meshagent_proto::envoy::pb::envoy::config::route::v3 as route;
use meshagent_proto::envoy::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use meshagent_proto::envoy::pb::envoy::extensions::transport_sockets::tls::v3 as tls;
use meshagent_proto::envoy::pb::envoy::r#type::matcher::v3 as matcher;
use meshagent_proto::envoy::pb::google::protobuf::UInt32Value;
use meshagent_proto::envoy::util::pack_any;
use meshagent_proto::type_url;

use crate::generate::{
    Resources, SERVED_TYPES, ads_config_source, locality, outbound_cluster_name, router_filter,
    socket_address, transport_socket,
};
use crate::mesh::{Mesh, ProxyIdentity, Service, Workload};

/// istiod's `grpcxds.ServerListenerNamePrefix`.
pub const SERVER_LISTENER_PREFIX: &str = "xds.istio.io/grpc/lds/inbound/";
/// The certificate provider instance the agent's gRPC bootstrap defines.
pub const PROVIDER_INSTANCE: &str = "default";

pub fn generate(mesh: &Mesh, proxy: &ProxyIdentity) -> Resources {
    let mut out = Resources::new();
    for t in SERVED_TYPES {
        out.insert(t, BTreeMap::new());
    }
    let mut put = |t: &'static str, name: String, any| {
        out.entry(t).or_default().insert(name, any);
    };
    for svc in &mesh.services {
        let host = mesh.hostname(svc);
        for port in &svc.ports {
            let name = format!("{host}:{}", port.port);
            let cluster_name = outbound_cluster_name(mesh, svc, port.port);
            put(
                type_url::LISTENER,
                name.clone(),
                pack_any(api_listener(&name)),
            );
            put(
                type_url::ROUTE,
                name.clone(),
                pack_any(route_config(&name, &host, port.port, &cluster_name)),
            );
            put(
                type_url::CLUSTER,
                cluster_name.clone(),
                pack_any(eds_cluster(mesh, svc, &cluster_name)),
            );
            put(
                type_url::ENDPOINT,
                cluster_name.clone(),
                pack_any(endpoints(mesh, svc, &cluster_name, port.target_port)),
            );
        }
    }
    if let Some(w) = mesh.find_workload(proxy) {
        for p in &w.ports {
            for host in inbound_hosts(w) {
                let name = format!("{SERVER_LISTENER_PREFIX}{host}:{}", p.port);
                let l = inbound_listener(mesh, &name, &host, p.port);
                put(type_url::LISTENER, name, pack_any(l));
            }
        }
    }
    out
}

/// `ip` as it appears in `host:port` (IPv6 in brackets), for the workload and the wildcards.
fn inbound_hosts(w: &Workload) -> Vec<String> {
    let own = match w.address {
        std::net::IpAddr::V6(a) => format!("[{a}]"),
        a => a.to_string(),
    };
    let mut hosts = vec![own];
    for h in ["0.0.0.0", "[::]"] {
        if !hosts.iter().any(|x| x == h) {
            hosts.push(h.to_owned());
        }
    }
    hosts
}

fn http_connection_manager(
    route_specifier: hcm::http_connection_manager::RouteSpecifier,
) -> hcm::HttpConnectionManager {
    hcm::HttpConnectionManager {
        route_specifier: Some(route_specifier),
        http_filters: vec![router_filter()],
        ..Default::default()
    }
}

fn api_listener(name: &str) -> listener::Listener {
    let manager = http_connection_manager(hcm::http_connection_manager::RouteSpecifier::Rds(
        hcm::Rds {
            config_source: Some(ads_config_source()),
            route_config_name: name.into(),
        },
    ));
    listener::Listener {
        name: name.into(),
        api_listener: Some(listener::ApiListener {
            api_listener: Some(pack_any(manager)),
        }),
        ..Default::default()
    }
}

fn route_config(
    name: &str,
    host: &str,
    port: u16,
    cluster_name: &str,
) -> route::RouteConfiguration {
    route::RouteConfiguration {
        name: name.into(),
        virtual_hosts: vec![route::VirtualHost {
            name: name.into(),
            domains: vec![host.into(), format!("{host}:{port}")],
            routes: vec![route::Route {
                r#match: Some(route::RouteMatch {
                    path_specifier: Some(route::route_match::PathSpecifier::Prefix(String::new())),
                    ..Default::default()
                }),
                action: Some(route::route::Action::Route(route::RouteAction {
                    cluster_specifier: Some(route::route_action::ClusterSpecifier::Cluster(
                        cluster_name.into(),
                    )),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Backing workloads of `svc` that exist in the mesh.
fn backends<'a>(mesh: &'a Mesh, svc: &'a Service) -> impl Iterator<Item = &'a Workload> + 'a {
    svc.selector
        .iter()
        .filter_map(|w| mesh.workload(&svc.namespace, w))
}

fn eds_cluster(mesh: &Mesh, svc: &Service, name: &str) -> cluster::Cluster {
    let transport_socket = mesh.grpc_mtls.then(|| {
        let sans = backends(mesh, svc)
            .map(|w| mesh.spiffe_id(&w.namespace, &w.service_account))
            .collect();
        let ctx = tls::UpstreamTlsContext {
            common_tls_context: Some(common_tls(sans)),
            ..Default::default()
        };
        transport_socket("envoy.transport_sockets.tls", pack_any(ctx))
    });
    cluster::Cluster {
        name: name.into(),
        cluster_discovery_type: Some(cluster::cluster::ClusterDiscoveryType::Type(
            cluster::cluster::DiscoveryType::Eds as i32,
        )),
        eds_cluster_config: Some(cluster::cluster::EdsClusterConfig {
            eds_config: Some(ads_config_source()),
            service_name: name.into(),
        }),
        lb_policy: cluster::cluster::LbPolicy::RoundRobin as i32,
        transport_socket,
        ..Default::default()
    }
}

fn endpoints(
    mesh: &Mesh,
    svc: &Service,
    name: &str,
    target_port: u16,
) -> endpoint::ClusterLoadAssignment {
    let mut by_locality: BTreeMap<&str, Vec<endpoint::LbEndpoint>> = BTreeMap::new();
    for w in backends(mesh, svc) {
        if !w.ports.iter().any(|p| p.port == target_port) {
            continue;
        }
        by_locality
            .entry(w.locality.as_str())
            .or_default()
            .push(endpoint::LbEndpoint {
                host_identifier: Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(
                    endpoint::Endpoint {
                        address: Some(socket_address(&w.address.to_string(), target_port)),
                        ..Default::default()
                    },
                )),
                health_status: core::HealthStatus::Healthy as i32,
                load_balancing_weight: Some(UInt32Value { value: 1 }),
                ..Default::default()
            });
    }
    endpoint::ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: by_locality
            .into_iter()
            .map(|(loc, eps)| {
                endpoint::LocalityLbEndpoints {
                    locality: Some(locality(loc)),
                    // gRPC's weighted_target drops localities without a weight.
                    load_balancing_weight: Some(UInt32Value {
                        value: u32::try_from(eps.len()).unwrap_or(u32::MAX),
                    }),
                    lb_endpoints: eps,
                    ..Default::default()
                }
            })
            .collect(),
        ..Default::default()
    }
}

fn inbound_listener(mesh: &Mesh, name: &str, host: &str, port: u16) -> listener::Listener {
    let manager = http_connection_manager(
        hcm::http_connection_manager::RouteSpecifier::RouteConfig(route::RouteConfiguration {
            name: "inbound".into(),
            virtual_hosts: vec![route::VirtualHost {
                name: format!("inbound|http|{port}"),
                domains: vec!["*".into()],
                routes: vec![route::Route {
                    r#match: Some(route::RouteMatch {
                        path_specifier: Some(route::route_match::PathSpecifier::Prefix("/".into())),
                        ..Default::default()
                    }),
                    action: Some(route::route::Action::NonForwardingAction(
                        route::NonForwardingAction {},
                    )),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        }),
    );
    let (suffix, transport) = if mesh.grpc_mtls {
        let ctx = tls::DownstreamTlsContext {
            common_tls_context: Some(common_tls(vec![])),
            require_client_certificate: Some(
                meshagent_proto::envoy::pb::google::protobuf::BoolValue { value: true },
            ),
            ..Default::default()
        };
        (
            "mtls",
            Some(transport_socket(
                "envoy.transport_sockets.tls",
                pack_any(ctx),
            )),
        )
    } else {
        ("plaintext", None)
    };
    let ip = host.trim_start_matches('[').trim_end_matches(']');
    listener::Listener {
        name: name.into(),
        address: Some(socket_address(ip, port)),
        filter_chains: vec![listener::FilterChain {
            name: format!("inbound-{suffix}"),
            filters: vec![listener::Filter {
                name: format!("inbound-hcm-{suffix}"),
                config_type: Some(listener::filter::ConfigType::TypedConfig(pack_any(manager))),
            }],
            transport_socket: transport,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// istiod's `buildCommonTLSContext`: provider instance `default`, certificate `default` for
/// the identity and `ROOTCA` for the roots, in the deprecated and the current fields.
#[allow(deprecated)]
fn common_tls(sans: Vec<String>) -> tls::CommonTlsContext {
    let instance = |cert: &str| tls::CertificateProviderPluginInstance {
        instance_name: PROVIDER_INSTANCE.into(),
        certificate_name: cert.into(),
    };
    let legacy = |cert: &str| tls::common_tls_context::CertificateProviderInstance {
        instance_name: PROVIDER_INSTANCE.into(),
        certificate_name: cert.into(),
    };
    tls::CommonTlsContext {
        tls_certificate_provider_instance: Some(instance("default")),
        tls_certificate_certificate_provider_instance: Some(legacy("default")),
        validation_context_type: Some(
            tls::common_tls_context::ValidationContextType::CombinedValidationContext(
                tls::common_tls_context::CombinedCertificateValidationContext {
                    default_validation_context: Some(tls::CertificateValidationContext {
                        ca_certificate_provider_instance: Some(instance("ROOTCA")),
                        match_subject_alt_names: sans
                            .into_iter()
                            .map(|san| matcher::StringMatcher {
                                match_pattern: Some(matcher::string_matcher::MatchPattern::Exact(
                                    san,
                                )),
                                ..Default::default()
                            })
                            .collect(),
                        ..Default::default()
                    }),
                    validation_context_certificate_provider_instance: Some(legacy("ROOTCA")),
                    ..Default::default()
                },
            ),
        ),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use std::path::Path;

    const MESH: &str = "
grpcMtls: true
workloads:
  - {name: echo, serviceAccount: echo-sa, address: 127.0.0.1, locality: r1/z1/s1,
     ports: [{port: 17070, inboundPort: 17070}]}
  - {name: echo2, serviceAccount: echo-sa, address: 127.0.0.2, locality: r1/z2,
     ports: [{port: 17070, inboundPort: 17070}]}
  - {name: client, serviceAccount: client}
services:
  - {name: echo, selector: [echo, echo2], ports: [{port: 7070, targetPort: 17070}]}
";

    fn proxy(pod: &str) -> ProxyIdentity {
        let meta = [("GENERATOR".to_owned(), "grpc".to_owned())].into();
        ProxyIdentity::from_node(
            &format!("sidecar~127.0.0.1~{pod}.default~default.svc.cluster.local"),
            &meta,
        )
    }

    #[test]
    #[allow(deprecated)]
    fn client_resources_follow_istio_names() {
        let m = Mesh::parse(Path::new("m"), MESH).unwrap();
        let r = crate::generate::generate(&m, &proxy("client-1"));
        let host = "echo.default.svc.cluster.local";
        let l = listener::Listener::decode(
            r[type_url::LISTENER][&format!("{host}:7070")]
                .value
                .as_slice(),
        )
        .unwrap();
        let api = l.api_listener.unwrap().api_listener.unwrap();
        let h = hcm::HttpConnectionManager::decode(api.value.as_slice()).unwrap();
        assert_eq!(h.http_filters[0].name, "envoy.filters.http.router");
        let Some(hcm::http_connection_manager::RouteSpecifier::Rds(rds)) = h.route_specifier else {
            panic!("RDS expected")
        };
        assert_eq!(rds.route_config_name, format!("{host}:7070"));
        assert!(r[type_url::ROUTE].contains_key(&format!("{host}:7070")));
        let cname = format!("outbound|7070||{host}");
        let c = cluster::Cluster::decode(r[type_url::CLUSTER][&cname].value.as_slice()).unwrap();
        let Some(core::transport_socket::ConfigType::TypedConfig(t)) =
            c.transport_socket.unwrap().config_type
        else {
            panic!()
        };
        let ctx = tls::UpstreamTlsContext::decode(t.value.as_slice()).unwrap();
        let common = ctx.common_tls_context.unwrap();
        assert_eq!(
            common
                .tls_certificate_provider_instance
                .unwrap()
                .instance_name,
            "default"
        );
        let Some(tls::common_tls_context::ValidationContextType::CombinedValidationContext(v)) =
            common.validation_context_type
        else {
            panic!()
        };
        let dv = v.default_validation_context.unwrap();
        assert_eq!(
            dv.ca_certificate_provider_instance
                .unwrap()
                .certificate_name,
            "ROOTCA"
        );
        assert_eq!(dv.match_subject_alt_names.len(), 2);
        let cla =
            endpoint::ClusterLoadAssignment::decode(r[type_url::ENDPOINT][&cname].value.as_slice())
                .unwrap();
        assert_eq!(cla.endpoints.len(), 2, "two localities");
        assert_eq!(cla.endpoints[0].locality.as_ref().unwrap().sub_zone, "s1");
        assert!(
            cla.endpoints
                .iter()
                .all(|e| e.load_balancing_weight.is_some())
        );
        // No inbound listener for a workload without ports; no sidecar-style listeners.
        assert_eq!(r[type_url::LISTENER].len(), 1);
    }

    #[test]
    fn server_gets_inbound_listeners_with_non_forwarding_routes() {
        let m = Mesh::parse(Path::new("m"), MESH).unwrap();
        let r = crate::generate::generate(&m, &proxy("echo-1"));
        let name = "xds.istio.io/grpc/lds/inbound/127.0.0.1:17070";
        let l = listener::Listener::decode(r[type_url::LISTENER][name].value.as_slice()).unwrap();
        assert!(r[type_url::LISTENER].contains_key("xds.istio.io/grpc/lds/inbound/0.0.0.0:17070"));
        assert!(r[type_url::LISTENER].contains_key("xds.istio.io/grpc/lds/inbound/[::]:17070"));
        let fc = &l.filter_chains[0];
        assert!(fc.transport_socket.is_some());
        let Some(listener::filter::ConfigType::TypedConfig(t)) = &fc.filters[0].config_type else {
            panic!()
        };
        let h = hcm::HttpConnectionManager::decode(t.value.as_slice()).unwrap();
        let Some(hcm::http_connection_manager::RouteSpecifier::RouteConfig(rc)) = h.route_specifier
        else {
            panic!()
        };
        assert!(matches!(
            rc.virtual_hosts[0].routes[0].action,
            Some(route::route::Action::NonForwardingAction(_))
        ));
    }
}
