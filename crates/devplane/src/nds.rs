//! The NDS name table, shaped as istiod builds it (`pkg/dns/server/name_table.go`
//! `BuildNameTable`): Kubernetes services with their VIP (registry `Kubernetes`, short name and
//! namespace for the agent's expansions), headless services with the addresses of their
//! endpoints, and ServiceEntry hosts (registry `External`) with their own or auto-allocated
//! addresses. A Kubernetes service wins over a ServiceEntry for the same host.
//!
//! Headless entries carry every address of every selected workload (a dual-stack pod's IPv4
//! and IPv6, `extraAddresses`), in workload order, as istiod appends each endpoint's
//! `Addresses`. Every selected workload serves every `targetPort` of its service (the mesh
//! file is refused otherwise, as Kubernetes lists a pod on every port of the service), so
//! istiod's endpoints of the first port (the pinned Istio) and of all ports (istio#61039)
//! are the same set here.

use std::collections::HashMap;

use meshagent_proto::nds::{NameTable, name_table::NameInfo};

use crate::mesh::Mesh;

pub fn name_table(mesh: &Mesh) -> NameTable {
    let mut table = HashMap::new();
    for e in &mesh.service_entries {
        for h in &e.hosts {
            let ips: Vec<String> = if e.addresses.is_empty() {
                e.allocated.get(h).cloned().unwrap_or_default()
            } else {
                e.addresses.clone()
            }
            .iter()
            .map(|ip| ip.to_string())
            .collect();
            // istiod leaves hosts without any address out of the table.
            if ips.is_empty() {
                continue;
            }
            table.insert(
                h.clone(),
                NameInfo {
                    ips,
                    registry: "External".into(),
                    shortname: h.clone(),
                    namespace: e.namespace.clone(),
                    alt_hosts: vec![],
                },
            );
        }
    }
    for s in &mesh.services {
        let ips: Vec<String> = if s.headless {
            mesh.workloads
                .iter()
                .filter(|w| w.namespace == s.namespace && s.selector.contains(&w.name))
                .flat_map(|w| std::iter::once(&w.address).chain(&w.extra_addresses))
                .map(|ip| ip.to_string())
                .collect()
        } else {
            s.vip.iter().map(|ip| ip.to_string()).collect()
        };
        if ips.is_empty() {
            continue;
        }
        table.insert(
            mesh.hostname(s),
            NameInfo {
                ips,
                registry: "Kubernetes".into(),
                shortname: s.name.clone(),
                namespace: s.namespace.clone(),
                alt_hosts: vec![],
            },
        );
    }
    NameTable { table }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const MESH: &str = r#"
workloads:
  - {name: web, namespace: shop, serviceAccount: web, address: 10.0.1.1, ports: [{port: 8080, inboundPort: 15006}]}
  - {name: db-0, namespace: shop, serviceAccount: db, address: 10.0.2.1, ports: [{port: 5432, inboundPort: 15006}]}
  - {name: db-1, namespace: shop, serviceAccount: db, address: 10.0.2.2, ports: [{port: 5432, inboundPort: 15006}]}
  - {name: db-2, namespace: shop, serviceAccount: db, address: 10.0.2.3, ports: [{port: 5432, inboundPort: 15006}]}
services:
  - {name: web, namespace: shop, selector: [web], ports: [{port: 80, targetPort: 8080}]}
  - {name: auth, namespace: identity, vip: 10.96.0.20, ports: [{port: 80, targetPort: 8080}]}
  - {name: db, namespace: shop, headless: true, selector: [db-0, db-1, db-2], ports: [{port: 5432, targetPort: 5432}]}
serviceEntries:
  - {hosts: [api.payments.example.com, api.maps.example.com]}
  - {hosts: [dual.example.com], dualStack: true}
  - {hosts: ["*.cdn.example.com"], addresses: [203.0.113.7]}
  - {hosts: ["*.nowhere.example.com"]}
"#;

    /// The shape istiod-box gives a headless service over a dual-stack pod (`compat_dns`'s
    /// `mip`: the pod's IPv4 then its IPv6), for a service of two ports: each address once.
    #[test]
    fn headless_entries_carry_every_address_of_every_workload() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("mesh.yaml");
        std::fs::write(
            &p,
            r#"
workloads:
  - {name: mip-0, serviceAccount: mip, address: 10.1.1.1, extraAddresses: ["fd00::1:1"], ports: [{port: 80, inboundPort: 15006}, {port: 9090, inboundPort: 15007}]}
  - {name: mip-1, serviceAccount: mip, address: 10.1.1.2, extraAddresses: ["fd00::1:2", "10.9.9.9"], ports: [{port: 80, inboundPort: 15006}, {port: 9090, inboundPort: 15007}]}
  - {name: other, serviceAccount: other, address: 10.1.2.1, extraAddresses: ["fd00::2:1"], ports: [{port: 80, inboundPort: 15006}]}
services:
  - {name: mip, headless: true, selector: [mip-0, mip-1], ports: [{port: 80, targetPort: 80}, {port: 9090, targetPort: 9090}]}
  - {name: other, selector: [other], ports: [{port: 80, targetPort: 80}]}
"#,
        )
        .unwrap();
        let m = Mesh::load(&p).unwrap();
        let t = name_table(&m).table;
        let mip = &t["mip.default.svc.cluster.local"];
        assert_eq!(
            mip.ips,
            ["10.1.1.1", "fd00::1:1", "10.1.1.2", "fd00::1:2", "10.9.9.9"]
        );
        assert_eq!(
            (mip.registry.as_str(), mip.shortname.as_str()),
            ("Kubernetes", "mip")
        );
        // A service with a VIP publishes the VIP, not its workloads' addresses.
        let other = &t["other.default.svc.cluster.local"].ips;
        assert_eq!(other.len(), 1, "{other:?}");
        assert!(other[0].starts_with("240.240."), "{other:?}");
    }

    #[test]
    fn realistic_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("mesh.yaml");
        std::fs::write(&p, MESH).unwrap();
        let m = Mesh::load(&p).unwrap();
        let t = name_table(&m).table;
        let web = &t["web.shop.svc.cluster.local"];
        assert_eq!(web.registry, "Kubernetes");
        assert_eq!(
            (web.shortname.as_str(), web.namespace.as_str()),
            ("web", "shop")
        );
        assert!(web.ips[0].starts_with("240.240."));
        assert_eq!(t["auth.identity.svc.cluster.local"].ips, ["10.96.0.20"]);
        assert_eq!(
            t["db.shop.svc.cluster.local"].ips,
            ["10.0.2.1", "10.0.2.2", "10.0.2.3"]
        );
        let a = &t["api.payments.example.com"];
        assert_eq!(a.registry, "External");
        assert!(a.ips[0].starts_with("240.240."));
        assert_ne!(a.ips, t["api.maps.example.com"].ips, "distinct VIPs");
        let d = &t["dual.example.com"].ips;
        assert!(
            d[0].starts_with("240.240.") && d[1].starts_with("2001:2::"),
            "{d:?}"
        );
        assert_eq!(t["*.cdn.example.com"].ips, ["203.0.113.7"]);
        assert!(!t.contains_key("*.nowhere.example.com"));
    }
}
