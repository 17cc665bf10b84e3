//! The self-discovery cluster `local_cluster` (Istio 1.31, PR istio/istio#60765): the
//! ClusterLoadAssignment istiod's EDS generator answers for it (pilot/pkg/xds/eds.go
//! `parseClusterName` maps the name to `proxy.LocalService`). Its endpoints are those of the
//! first service selecting the proxy, kept to the proxy's region, its workload name and its
//! pod-template-hash, grouped by locality so Envoy's zone-aware load balancer sees how the
//! proxy's own service spreads over zones. No service: an empty assignment, still answered
//! (istiod answers every watched EDS name; an unanswered static EDS cluster with
//! `initial_fetch_timeout: 0s` would hold Envoy's initialization forever).

use std::collections::BTreeMap;

use meshagent_proto::envoy::pb::envoy::config::endpoint::v3 as endpoint;
use meshagent_proto::envoy::pb::google::protobuf::UInt32Value;

use crate::generate::{locality, socket_address};
use crate::mesh::{Mesh, Workload};

/// pilot's `util.SelfDiscoveryCluster`.
pub const NAME: &str = "local_cluster";

/// Labels that tell one rollout of a workload from another: a replica of an older template
/// is not part of the proxy's local cluster.
const POD_TEMPLATE_HASH_LABELS: [&str; 2] = ["pod-template-hash", "rollouts-pod-template-hash"];

/// The `local_cluster` assignment for the proxy running as `me` (`None`: unknown proxy).
pub fn load_assignment(mesh: &Mesh, me: Option<&Workload>) -> endpoint::ClusterLoadAssignment {
    let mut by_locality: BTreeMap<&str, Vec<endpoint::LbEndpoint>> = BTreeMap::new();
    let service = me.and_then(|w| mesh.first_service_selecting(w).map(|s| (w, s)));
    if let Some((me, svc)) = service
        && let Some(port) = svc.ports.first()
    {
        let peers = svc
            .selector
            .iter()
            .filter_map(|n| mesh.workload(&svc.namespace, n))
            .filter(|w| same_local_cluster(me, w));
        for w in peers {
            let Some(p) = w.ports.iter().find(|p| p.port == port.target_port) else {
                continue;
            };
            by_locality
                .entry(w.locality.as_str())
                .or_default()
                .push(endpoint::LbEndpoint {
                    host_identifier: Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(
                        endpoint::Endpoint {
                            address: Some(socket_address(&w.address.to_string(), p.inbound_port)),
                            ..Default::default()
                        },
                    )),
                    load_balancing_weight: Some(UInt32Value { value: 1 }),
                    ..Default::default()
                });
        }
    }
    endpoint::ClusterLoadAssignment {
        cluster_name: NAME.into(),
        endpoints: by_locality
            .into_iter()
            .map(|(loc, lb_endpoints)| endpoint::LocalityLbEndpoints {
                locality: Some(locality(loc)),
                lb_endpoints,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

/// Whether `w` belongs in `me`'s local cluster: same region, same workload name, and the
/// same pod-template-hash where the proxy has one.
fn same_local_cluster(me: &Workload, w: &Workload) -> bool {
    w.region() == me.region()
        && w.workload_name() == me.workload_name()
        && POD_TEMPLATE_HASH_LABELS.iter().all(|k| {
            me.labels
                .get(*k)
                .is_none_or(|h| w.labels.get(*k) == Some(h))
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use meshagent_proto::envoy::pb::envoy::config::core::v3 as core;
    use std::path::Path;

    use super::*;
    use crate::mesh::ProxyIdentity;

    const MESH: &str = r#"
workloads:
  - {name: a, serviceAccount: a, address: 127.0.0.1, locality: r1/z1/s1,
     labels: {pod-template-hash: h1}, ports: [{port: 8080, inboundPort: 15006}]}
  - {name: a-2, serviceAccount: a, address: 127.0.0.2, locality: r1/z2,
     labels: {service.istio.io/workload-name: a, pod-template-hash: h1},
     ports: [{port: 8080, inboundPort: 15007}]}
  - {name: a-3, serviceAccount: a, address: 127.0.0.3, locality: r2/z1,
     labels: {service.istio.io/workload-name: a, pod-template-hash: h1},
     ports: [{port: 8080, inboundPort: 15008}]}
  - {name: a-old, serviceAccount: a, address: 127.0.0.4, locality: r1/z1,
     labels: {service.istio.io/workload-name: a, pod-template-hash: h0},
     ports: [{port: 8080, inboundPort: 15009}]}
  - {name: b, serviceAccount: b, address: 127.0.0.5, locality: r1/z1,
     ports: [{port: 8080, inboundPort: 15010}]}
  - {name: lonely, serviceAccount: l, ports: [{port: 8080, inboundPort: 15011}]}
services:
  - {name: a, selector: [a, a-2, a-3, a-old, b], ports: [{port: 80, targetPort: 8080}]}
"#;

    fn cla(pod: &str) -> endpoint::ClusterLoadAssignment {
        let mesh = Mesh::parse(Path::new("mesh.yaml"), MESH).unwrap();
        let proxy = ProxyIdentity {
            pod_name: format!("{pod}-5f7d9"),
            namespace: "default".into(),
            ..Default::default()
        };
        load_assignment(&mesh, mesh.find_workload(&proxy))
    }

    fn hosts(c: &endpoint::ClusterLoadAssignment) -> Vec<(String, String)> {
        c.endpoints
            .iter()
            .flat_map(|l| {
                let zone = l.locality.as_ref().unwrap().zone.clone();
                l.lb_endpoints.iter().map(move |e| {
                    let Some(endpoint::lb_endpoint::HostIdentifier::Endpoint(ep)) =
                        &e.host_identifier
                    else {
                        panic!("no endpoint")
                    };
                    let Some(core::address::Address::SocketAddress(s)) =
                        &ep.address.as_ref().unwrap().address
                    else {
                        panic!("no socket address")
                    };
                    (zone.clone(), s.address.clone())
                })
            })
            .collect()
    }

    #[test]
    fn same_region_workload_and_template_grouped_by_zone() {
        let c = cla("a");
        assert_eq!(c.cluster_name, "local_cluster");
        assert_eq!(
            hosts(&c),
            vec![
                ("z1".to_owned(), "127.0.0.1".to_owned()),
                ("z2".to_owned(), "127.0.0.2".to_owned())
            ]
        );
    }

    #[test]
    fn no_service_or_unknown_proxy_is_an_empty_assignment() {
        for pod in ["lonely", "nobody"] {
            let c = cla(pod);
            assert_eq!(c.cluster_name, "local_cluster");
            assert!(c.endpoints.is_empty(), "{pod}: {c:?}");
        }
    }
}
