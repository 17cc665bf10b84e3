//! The mesh file: the workloads and services devplane generates sidecar configuration for.
//!
//! There is no traffic capture here, so every listener binds an explicit address (see
//! docs/devplane.md for the port scheme):
//! * each workload port has an `inboundPort`: the workload's sidecar terminates mTLS there and
//!   forwards plaintext to the application on `address:port`;
//! * each `outbound` entry of a workload makes its sidecar bind `bind` (plain HTTP from the app)
//!   and route to the named service over mTLS, verifying the server's SPIFFE identity.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Errors loading a mesh file; each names the file and the offending field.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("cannot read mesh file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid mesh file {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_yaml::Error,
    },
    #[error("invalid mesh file {path}: {field}: {problem}")]
    Invalid {
        path: PathBuf,
        field: String,
        problem: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mesh {
    /// SPIFFE trust domain of every identity in the mesh.
    #[serde(default = "default_trust_domain")]
    pub trust_domain: String,
    /// DNS suffix of service hostnames (`<svc>.<ns>.svc.<domain_suffix>`).
    #[serde(default = "default_domain_suffix")]
    pub domain_suffix: String,
    #[serde(default)]
    pub workloads: Vec<Workload>,
    #[serde(default)]
    pub services: Vec<Service>,
    /// ServiceEntry-like hosts (registry `External` in the NDS table).
    #[serde(default)]
    pub service_entries: Vec<ServiceEntry>,
    /// Proxyless gRPC (`GENERATOR=grpc` nodes) uses mTLS: as if a DestinationRule set
    /// `tls.mode: ISTIO_MUTUAL` for every host and a PeerAuthentication `STRICT` applied to
    /// every workload (istiod's grpc generator has no auto-mTLS). Off: plaintext.
    #[serde(default)]
    pub grpc_mtls: bool,
    /// WasmPlugins, served over ECDS to every workload's outbound listeners.
    #[serde(default)]
    pub wasm_plugins: Vec<crate::wasm::WasmPlugin>,
}

/// A ServiceEntry's hosts and addresses, as far as DNS sees them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServiceEntry {
    pub hosts: Vec<String>,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Without addresses, each non-wildcard host gets one from 240.240.0.0/16 (and one from
    /// 2001:2::/48 with `dualStack`), as istiod's `ISTIO_META_DNS_AUTO_ALLOCATE`; wildcard
    /// hosts are never allocated (and so are not in the table without addresses).
    #[serde(default)]
    pub addresses: Vec<IpAddr>,
    #[serde(default)]
    pub dual_stack: bool,
    /// Filled by auto-allocation: host → addresses.
    #[serde(skip)]
    pub allocated: BTreeMap<String, Vec<IpAddr>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Workload {
    /// Matched against the pod name of a connecting proxy (`<name>` or `<name>-<suffix>`),
    /// or its `WORKLOAD_NAME` metadata, within `namespace`.
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    pub service_account: String,
    /// Address peers use to reach this workload's sidecar (the "pod IP").
    #[serde(default = "default_address")]
    pub address: IpAddr,
    /// The pod's other IPs (Kubernetes `status.podIPs` after the first, e.g. the IPv6 one of a
    /// dual-stack pod). Headless services publish them in NDS after `address`, as istiod
    /// does with every address of an endpoint (`pkg/dns/server/name_table.go`).
    #[serde(default)]
    pub extra_addresses: Vec<IpAddr>,
    #[serde(default)]
    pub ports: Vec<WorkloadPort>,
    #[serde(default)]
    pub outbound: Vec<Outbound>,
    /// `region/zone/subzone` (the `topology.istio.io/locality` label); empty: none.
    #[serde(default)]
    pub locality: String,
    /// Pod labels. devplane reads `service.istio.io/workload-name` (the workload's name for
    /// istiod, default `name`) and the pod-template-hash labels, for self-discovery.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// The label naming a pod's workload (its Deployment), as istiod reads it.
pub const WORKLOAD_NAME_LABEL: &str = "service.istio.io/workload-name";

impl Workload {
    /// The workload name istiod groups replicas by: the `service.istio.io/workload-name`
    /// label, else the workload's `name`.
    pub fn workload_name(&self) -> &str {
        self.labels
            .get(WORKLOAD_NAME_LABEL)
            .map(String::as_str)
            .unwrap_or(&self.name)
    }

    /// The region part of `locality`.
    pub fn region(&self) -> &str {
        self.locality.split('/').next().unwrap_or_default()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkloadPort {
    #[serde(default)]
    pub name: String,
    /// The application's plaintext port on `address`.
    pub port: u16,
    /// The sidecar's mTLS listener port for this application port.
    pub inbound_port: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Outbound {
    /// `<name>.<namespace>` of a service in this file.
    pub service: String,
    /// The service port to call.
    pub port: u16,
    /// Where this workload's sidecar listens for the application's plain HTTP calls.
    pub bind: SocketAddr,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Service {
    pub name: String,
    #[serde(default = "default_namespace")]
    pub namespace: String,
    /// Virtual IP published in the DNS name table; auto-allocated from 240.240.0.0/16 if absent.
    #[serde(default)]
    pub vip: Option<IpAddr>,
    /// A headless service (`clusterIP: None`): no VIP; its name resolves to the addresses of
    /// the selected workloads.
    #[serde(default)]
    pub headless: bool,
    /// Names of workloads (same namespace) backing this service.
    #[serde(default)]
    pub selector: Vec<String>,
    pub ports: Vec<ServicePort>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServicePort {
    #[serde(default)]
    pub name: String,
    pub port: u16,
    /// A `port` of the selected workloads.
    pub target_port: u16,
}

fn default_trust_domain() -> String {
    "cluster.local".into()
}
fn default_domain_suffix() -> String {
    "cluster.local".into()
}
fn default_namespace() -> String {
    "default".into()
}
fn default_address() -> IpAddr {
    IpAddr::V4(Ipv4Addr::LOCALHOST)
}

// === impl Mesh ===

impl Mesh {
    pub fn load(path: &Path) -> Result<Mesh, MeshError> {
        let text = std::fs::read_to_string(path).map_err(|source| MeshError::Read {
            path: path.to_owned(),
            source,
        })?;
        Mesh::parse(path, &text)
    }

    pub fn parse(path: &Path, text: &str) -> Result<Mesh, MeshError> {
        let mut mesh: Mesh = if text.trim().is_empty() {
            Mesh {
                trust_domain: default_trust_domain(),
                domain_suffix: default_domain_suffix(),
                workloads: vec![],
                services: vec![],
                service_entries: vec![],
                grpc_mtls: false,
                wasm_plugins: vec![],
            }
        } else {
            serde_yaml::from_str(text).map_err(|source| MeshError::Parse {
                path: path.to_owned(),
                source,
            })?
        };
        mesh.validate(path)?;
        for (i, p) in mesh.wasm_plugins.iter().enumerate() {
            p.validate().map_err(|problem| MeshError::Invalid {
                path: path.to_owned(),
                field: format!("wasmPlugins[{i}]"),
                problem,
            })?;
        }
        mesh.allocate_vips();
        Ok(mesh)
    }

    fn validate(&self, path: &Path) -> Result<(), MeshError> {
        let invalid = |field: String, problem: String| MeshError::Invalid {
            path: path.to_owned(),
            field,
            problem,
        };
        let mut names = HashSet::new();
        for (i, w) in self.workloads.iter().enumerate() {
            if w.name.is_empty() || w.service_account.is_empty() {
                return Err(invalid(
                    format!("workloads[{i}]"),
                    "name and serviceAccount must be non-empty".into(),
                ));
            }
            if !names.insert((w.namespace.as_str(), w.name.as_str())) {
                return Err(invalid(
                    format!("workloads[{i}].name"),
                    format!("duplicate workload {}.{}", w.name, w.namespace),
                ));
            }
        }
        let mut services = HashSet::new();
        for (i, s) in self.services.iter().enumerate() {
            if !services.insert(format!("{}.{}", s.name, s.namespace)) {
                return Err(invalid(
                    format!("services[{i}].name"),
                    format!("duplicate service {}.{}", s.name, s.namespace),
                ));
            }
            for sel in &s.selector {
                let Some(w) = self.workload(&s.namespace, sel) else {
                    return Err(invalid(
                        format!("services[{i}].selector"),
                        format!("no workload {sel} in namespace {}", s.namespace),
                    ));
                };
                for (j, p) in s.ports.iter().enumerate() {
                    if !w.ports.iter().any(|wp| wp.port == p.target_port) {
                        return Err(invalid(
                            format!("services[{i}].ports[{j}].targetPort"),
                            format!("workload {sel} has no port {}", p.target_port),
                        ));
                    }
                }
            }
        }
        for (i, w) in self.workloads.iter().enumerate() {
            for (j, o) in w.outbound.iter().enumerate() {
                let Some(s) = self.service_by_key(&o.service) else {
                    return Err(invalid(
                        format!("workloads[{i}].outbound[{j}].service"),
                        format!("no service {:?} (expected <name>.<namespace>)", o.service),
                    ));
                };
                if !s.ports.iter().any(|p| p.port == o.port) {
                    return Err(invalid(
                        format!("workloads[{i}].outbound[{j}].port"),
                        format!("service {} has no port {}", o.service, o.port),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Gives services without a `vip` one from 240.240.0.0/16 (as Istio's DNS auto-allocation),
    /// skipping addresses already used, in file order so the result is stable.
    fn allocate_vips(&mut self) {
        let used: HashSet<IpAddr> = self
            .services
            .iter()
            .filter_map(|s| s.vip)
            .chain(
                self.service_entries
                    .iter()
                    .flat_map(|e| e.addresses.clone()),
            )
            .collect();
        let mut next: u32 = 1;
        let mut alloc = || loop {
            let ip = IpAddr::V4(Ipv4Addr::from(0xF0F0_0000 | (next & 0xFFFF)));
            next += 1;
            if !used.contains(&ip) {
                return ip;
            }
        };
        for s in self
            .services
            .iter_mut()
            .filter(|s| s.vip.is_none() && !s.headless)
        {
            s.vip = Some(alloc());
        }
        let mut next6: u16 = 1;
        for e in self
            .service_entries
            .iter_mut()
            .filter(|e| e.addresses.is_empty())
        {
            for h in e.hosts.iter().filter(|h| !h.starts_with('*')) {
                let mut ips = vec![alloc()];
                if e.dual_stack {
                    ips.push(IpAddr::V6(std::net::Ipv6Addr::new(
                        0x2001, 0x2, 0, 0, 0, 0, 0, next6,
                    )));
                    next6 += 1;
                }
                e.allocated.insert(h.clone(), ips);
            }
        }
    }

    pub fn workload(&self, namespace: &str, name: &str) -> Option<&Workload> {
        self.workloads
            .iter()
            .find(|w| w.namespace == namespace && w.name == name)
    }

    /// The first service (file order) selecting `w`: istiod's `proxy.LocalService`.
    pub fn first_service_selecting(&self, w: &Workload) -> Option<&Service> {
        self.services
            .iter()
            .find(|s| s.namespace == w.namespace && s.selector.contains(&w.name))
    }

    /// `key` is `<name>.<namespace>`.
    pub fn service_by_key(&self, key: &str) -> Option<&Service> {
        self.services.iter().find(|s| {
            key.strip_prefix(s.name.as_str())
                .and_then(|r| r.strip_prefix('.'))
                == Some(&s.namespace)
        })
    }

    pub fn hostname(&self, s: &Service) -> String {
        format!("{}.{}.svc.{}", s.name, s.namespace, self.domain_suffix)
    }

    pub fn spiffe_id(&self, namespace: &str, service_account: &str) -> String {
        format!(
            "spiffe://{}/ns/{namespace}/sa/{service_account}",
            self.trust_domain
        )
    }

    /// Finds the workload a connecting proxy runs for: by `WORKLOAD_NAME` metadata, else by pod
    /// name (`<name>` or `<name>-<suffix>`, the longest matching name wins).
    pub fn find_workload(&self, proxy: &ProxyIdentity) -> Option<&Workload> {
        let ns = proxy.namespace.as_str();
        if let Some(wn) = &proxy.workload_name
            && let Some(w) = self.workload(ns, wn)
        {
            return Some(w);
        }
        self.workloads
            .iter()
            .filter(|w| w.namespace == ns)
            .filter(|w| {
                proxy.pod_name == w.name
                    || proxy
                        .pod_name
                        .strip_prefix(w.name.as_str())
                        .is_some_and(|rest| rest.starts_with('-'))
            })
            .max_by_key(|w| w.name.len())
    }
}

/// Who a connecting proxy says it is (from its xDS node).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyIdentity {
    pub pod_name: String,
    pub namespace: String,
    pub workload_name: Option<String>,
    /// Node metadata `GENERATOR` (`grpc` for proxyless gRPC).
    pub generator: Option<String>,
}

impl ProxyIdentity {
    /// Parses an Istio node (`TYPE~IP~POD.NS~DOMAIN` plus `NAME`/`NAMESPACE`/`WORKLOAD_NAME`
    /// metadata, which win when present).
    pub fn from_node(id: &str, meta: &BTreeMap<String, String>) -> ProxyIdentity {
        let mut parts = id.split('~');
        let pod_ns = parts.nth(2).unwrap_or_default();
        let (pod, ns) = pod_ns.split_once('.').unwrap_or((pod_ns, ""));
        ProxyIdentity {
            pod_name: meta.get("NAME").cloned().unwrap_or_else(|| pod.to_owned()),
            namespace: meta
                .get("NAMESPACE")
                .cloned()
                .unwrap_or_else(|| ns.to_owned()),
            workload_name: meta.get("WORKLOAD_NAME").cloned(),
            generator: meta.get("GENERATOR").cloned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../../examples/mesh.yaml");

    #[test]
    fn example_parses() {
        let m = Mesh::parse(Path::new("examples/mesh.yaml"), EXAMPLE).unwrap();
        assert_eq!(m.workloads.len(), 2);
        assert!(m.services.iter().all(|s| s.vip.is_some()));
    }

    #[test]
    fn errors_name_the_field() {
        let bad = "workloads:\n- name: a\n  serviceAccount: a\n  outbound:\n  - {service: nope.default, port: 80, bind: 127.0.0.1:1}\n";
        let err = Mesh::parse(Path::new("m.yaml"), bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("m.yaml"), "{err}");
        assert!(err.contains("workloads[0].outbound[0].service"), "{err}");
        let unknown = "workloads:\n- name: a\n  serviceAccount: a\n  colour: red\n";
        let err = Mesh::parse(Path::new("m.yaml"), unknown)
            .unwrap_err()
            .to_string();
        assert!(err.contains("colour"), "{err}");
    }

    #[test]
    fn finds_workload_by_pod_name() {
        let m = Mesh::parse(Path::new("m"), EXAMPLE).unwrap();
        let meta = BTreeMap::new();
        let p = ProxyIdentity::from_node(
            "sidecar~10.0.0.1~a-7d9f-xyz.default~default.svc.cluster.local",
            &meta,
        );
        assert_eq!(m.find_workload(&p).map(|w| w.name.as_str()), Some("a"));
        let p = ProxyIdentity::from_node("sidecar~10.0.0.1~ab.default~x", &meta);
        assert!(m.find_workload(&p).is_none());
    }
}
