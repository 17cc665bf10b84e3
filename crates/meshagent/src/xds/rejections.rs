//! What Envoy is rejecting now: the last NACK per type URL, for readiness and the extension
//! check ([`crate::envoy::extensions`]).
//!
//! Istio's agent forwards NACKs and keeps nothing (`pkg/istio-agent/xds_proxy.go`); its
//! readiness only counts rejected updates (`pilot/cmd/pilot-agent/status/ready/probe.go`).
//! Here the proxy, which already peeks at every request ([`super::wire::peek`]), keeps the
//! error detail of a NACK until the same type is ACKed, and the extensions the NACK says Envoy
//! has no implementation for. An ACK costs one relaxed atomic load while nothing is rejected;
//! a NACK (rare) takes one mutex and parses its message.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::watch;

use super::Api;
use super::wire;

/// Longest error detail kept per type (bytes; cut at a character boundary).
pub const MAX_MESSAGE: usize = 1024;
/// Most type URLs with a standing rejection (a client asks for a handful).
pub const MAX_TYPES: usize = 16;
/// Most distinct missing extensions remembered.
pub const MAX_MISSING: usize = 16;
/// Longest extension name or type URL kept.
const MAX_NAME: usize = 256;

/// An extension a NACK says Envoy has no implementation for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingExtension {
    /// The name the configuration gives it (e.g. `istio.metadata_exchange`).
    pub name: String,
    /// The type URL Envoy looked for (e.g. `envoy.tcp.metadataexchange.config.MetadataExchange`),
    /// empty when the message names none.
    pub type_url: String,
}

impl std::fmt::Display for MissingExtension {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.type_url.is_empty() {
            write!(f, "'{}'", self.name)
        } else {
            write!(f, "'{}' (type URL '{}')", self.name, self.type_url)
        }
    }
}

/// A type whose last answer from the client was a NACK.
#[derive(Clone, Debug)]
pub struct Rejection {
    pub type_url: String,
    /// The NACK's `error_detail.message`, bounded to [`MAX_MESSAGE`].
    pub message: String,
    /// Extensions the message names as missing.
    pub missing: Vec<MissingExtension>,
}

impl Rejection {
    /// `CDS`, `LDS`, ... for the usual types; the type URL otherwise.
    pub fn kind(&self) -> &str {
        short_type(&self.type_url)
    }
}

/// The xDS short name of a type URL (`CDS` for clusters, ...), or the URL itself.
pub fn short_type(type_url: &str) -> &str {
    match type_url.rsplit('/').next().unwrap_or(type_url) {
        "envoy.config.cluster.v3.Cluster" => "CDS",
        "envoy.config.listener.v3.Listener" => "LDS",
        "envoy.config.route.v3.RouteConfiguration" => "RDS",
        "envoy.config.route.v3.ScopedRouteConfiguration" => "SRDS",
        "envoy.config.route.v3.VirtualHost" => "VHDS",
        "envoy.config.endpoint.v3.ClusterLoadAssignment" => "EDS",
        "envoy.extensions.transport_sockets.tls.v3.Secret" => "SDS",
        "envoy.config.core.v3.TypedExtensionConfig" => "ECDS",
        _ => type_url,
    }
}

/// Standing rejections, shared by every stream pair.
#[derive(Debug)]
pub struct Rejections {
    any: AtomicBool,
    current: Mutex<Vec<Rejection>>,
    /// Every distinct missing extension a NACK has named since start (bounded).
    missing: watch::Sender<Vec<MissingExtension>>,
}

impl Default for Rejections {
    fn default() -> Self {
        Rejections {
            any: AtomicBool::new(false),
            current: Mutex::new(Vec::new()),
            missing: watch::Sender::new(Vec::new()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn bounded(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

impl Rejections {
    /// A request from the client: a NACK records its type's rejection, an ACK clears it.
    pub fn on_request(&self, api: Api, msg: &[u8], p: &wire::Peek<'_>) {
        if p.nonce.is_empty() || p.type_url.is_empty() {
            return;
        }
        if !p.has_error {
            if self.any.load(Ordering::Relaxed) {
                let mut cur = lock(&self.current);
                cur.retain(|r| r.type_url != p.type_url);
                self.any.store(!cur.is_empty(), Ordering::Relaxed);
            }
            return;
        }
        let full = super::view::error_message(api, msg).unwrap_or("");
        let missing = missing_extensions(full);
        let rejection = Rejection {
            type_url: bounded(p.type_url, MAX_NAME),
            message: bounded(full, MAX_MESSAGE),
            missing: missing.clone(),
        };
        {
            let mut cur = lock(&self.current);
            if let Some(r) = cur.iter_mut().find(|r| r.type_url == rejection.type_url) {
                *r = rejection;
            } else if cur.len() < MAX_TYPES {
                cur.push(rejection);
            }
            self.any.store(!cur.is_empty(), Ordering::Relaxed);
        }
        if !missing.is_empty() {
            self.missing.send_if_modified(|all| {
                let mut changed = false;
                for m in missing {
                    if all.len() < MAX_MISSING && !all.contains(&m) {
                        all.push(m);
                        changed = true;
                    }
                }
                changed
            });
        }
    }

    /// The types whose last answer was a NACK, in the order they were first rejected.
    pub fn current(&self) -> Vec<Rejection> {
        if !self.any.load(Ordering::Relaxed) {
            return Vec::new();
        }
        lock(&self.current).clone()
    }

    /// Every distinct extension NACKs have named as missing, updated as they arrive.
    pub fn missing(&self) -> watch::Receiver<Vec<MissingExtension>> {
        self.missing.subscribe()
    }
}

/// The extensions an Envoy error message says it has no implementation for: Envoy's
/// `Didn't find a registered implementation for 'NAME' with type URL: 'TYPE'` (and the older
/// `... for name: 'NAME'`), once each, in order. Bounded to [`MAX_MISSING`].
pub fn missing_extensions(message: &str) -> Vec<MissingExtension> {
    const MARK: &str = "Didn't find a registered implementation for ";
    let mut out: Vec<MissingExtension> = Vec::new();
    let mut rest = message;
    while let Some(i) = rest.find(MARK) {
        rest = &rest[i + MARK.len()..];
        let after = rest.strip_prefix("name: ").unwrap_or(rest);
        let Some((name, tail)) = quoted(after) else {
            continue;
        };
        let type_url = tail
            .strip_prefix(" with type URL: ")
            .and_then(quoted)
            .map_or("", |(t, _)| t);
        let type_url = type_url.rsplit('/').next().unwrap_or(type_url);
        let m = MissingExtension {
            name: bounded(name, MAX_NAME),
            type_url: bounded(type_url, MAX_NAME),
        };
        if !name.is_empty() && !out.contains(&m) {
            out.push(m);
            if out.len() >= MAX_MISSING {
                break;
            }
        }
    }
    out
}

/// `'text'...` → (`text`, the rest after the closing quote).
fn quoted(s: &str) -> Option<(&str, &str)> {
    let s = s.strip_prefix('\'')?;
    let end = s.find('\'')?;
    Some((&s[..end], &s[end + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use meshagent_proto::envoy::pb::google::rpc::Status;
    use prost::Message;

    const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";

    #[test]
    fn names_every_missing_extension_once() {
        let m = "Error adding/updating cluster(s) outbound|80||a.default.svc.cluster.local: \
                 Didn't find a registered implementation for 'istio.metadata_exchange' with type \
                 URL: 'envoy.tcp.metadataexchange.config.MetadataExchange', outbound|80||b: \
                 Didn't find a registered implementation for 'istio.metadata_exchange' with type \
                 URL: 'envoy.tcp.metadataexchange.config.MetadataExchange'; Didn't find a \
                 registered implementation for name: 'istio.alpn'; Didn't find a registered \
                 implementation for 'cut";
        assert_eq!(
            missing_extensions(m),
            vec![
                MissingExtension {
                    name: "istio.metadata_exchange".into(),
                    type_url: "envoy.tcp.metadataexchange.config.MetadataExchange".into(),
                },
                MissingExtension {
                    name: "istio.alpn".into(),
                    type_url: String::new(),
                },
            ]
        );
        assert!(missing_extensions("field 'x' is invalid").is_empty());
        let many: String = (0..100)
            .map(|i| format!("Didn't find a registered implementation for 'e{i}'. "))
            .collect();
        assert_eq!(missing_extensions(&many).len(), MAX_MISSING);
    }

    fn request(nonce: &str, error: Option<&str>) -> Vec<u8> {
        DiscoveryRequest {
            type_url: CDS.into(),
            response_nonce: nonce.into(),
            error_detail: error.map(|m| Status {
                code: 13,
                message: m.into(),
                details: vec![],
            }),
            ..Default::default()
        }
        .encode_to_vec()
    }

    fn feed(r: &Rejections, msg: &[u8]) {
        let p = wire::peek(wire::Kind::SotwRequest, msg).unwrap();
        r.on_request(Api::Sotw, msg, &p);
    }

    #[test]
    fn a_nack_stands_until_its_type_is_acked() {
        let r = Rejections::default();
        let mut missing = r.missing();
        // The first request (no nonce) is neither.
        feed(&r, &request("", None));
        assert!(r.current().is_empty());
        let long = format!(
            "Didn't find a registered implementation for 'istio.stats' with type URL: \
             'stats.PluginConfig' {}",
            "x".repeat(5000)
        );
        feed(&r, &request("n1", Some(&long)));
        let cur = r.current();
        assert_eq!(cur.len(), 1);
        assert_eq!(cur[0].kind(), "CDS");
        assert_eq!(cur[0].message.len(), MAX_MESSAGE);
        assert_eq!(cur[0].missing[0].name, "istio.stats");
        assert!(missing.has_changed().unwrap());
        assert_eq!(
            missing.borrow_and_update()[0].type_url,
            "stats.PluginConfig"
        );
        // The same extension again changes nothing for the watchers.
        feed(&r, &request("n2", Some(&long)));
        assert!(!missing.has_changed().unwrap());
        feed(&r, &request("n3", None));
        assert!(r.current().is_empty());
    }
}
