//! Peeking at xDS messages on the protobuf wire, without decoding them.
//!
//! The proxy needs three or four scalar fields of the *top-level* message (type URL, nonce,
//! version, whether an error is attached); everything else — nodes, resources — is skipped by
//! length, so peeking costs one pass over the field headers, not a decode.
//!
//! Field numbers are those of `envoy.service.discovery.v3` (checked against the generated
//! types in the tests below).

use thiserror::Error;

/// Which xDS message a buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    SotwRequest,
    SotwResponse,
    DeltaRequest,
    DeltaResponse,
}

/// Field numbers of the fields we peek at, per message kind (0 = absent).
struct Fields {
    version: u32,
    type_url: u32,
    nonce: u32,
    error_detail: u32,
    resources: u32,
}

impl Kind {
    fn fields(self) -> Fields {
        match self {
            // DiscoveryRequest: version_info=1, node=2, resource_names=3, type_url=4,
            // response_nonce=5, error_detail=6.
            Kind::SotwRequest => Fields {
                version: 1,
                type_url: 4,
                nonce: 5,
                error_detail: 6,
                resources: 0,
            },
            // DiscoveryResponse: version_info=1, resources=2, type_url=4, nonce=5.
            Kind::SotwResponse => Fields {
                version: 1,
                type_url: 4,
                nonce: 5,
                error_detail: 0,
                resources: 2,
            },
            // DeltaDiscoveryRequest: node=1, type_url=2, response_nonce=6, error_detail=7.
            Kind::DeltaRequest => Fields {
                version: 0,
                type_url: 2,
                nonce: 6,
                error_detail: 7,
                resources: 0,
            },
            // DeltaDiscoveryResponse: system_version_info=1, resources=2, type_url=4, nonce=5.
            Kind::DeltaResponse => Fields {
                version: 1,
                type_url: 4,
                nonce: 5,
                error_detail: 0,
                resources: 2,
            },
        }
    }
}

/// The fields of one message the proxy looks at. Borrowed from the message bytes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Peek<'a> {
    pub type_url: &'a str,
    pub nonce: &'a str,
    /// `version_info` (SotW) or `system_version_info` (Delta response); empty for Delta
    /// requests.
    pub version: &'a str,
    /// Whether the message carries `error_detail` (a NACK, or an unhealthy report).
    pub has_error: bool,
    /// Number of `resources` entries (responses only).
    pub resources: usize,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("truncated protobuf message")]
    Truncated,
    #[error("varint longer than 10 bytes")]
    VarintTooLong,
    #[error("unsupported protobuf wire type {0}")]
    WireType(u8),
    #[error("field {0} is not valid UTF-8")]
    Utf8(u32),
    #[error("field number 0 is invalid")]
    FieldZero,
}

/// One top-level field: number and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32,
}

/// Iterates the top-level fields of a protobuf message.
pub struct FieldIter<'a> {
    buf: &'a [u8],
}

/// Iterates the top-level fields of `buf`.
pub fn fields(buf: &[u8]) -> FieldIter<'_> {
    FieldIter { buf }
}

fn varint(buf: &mut &[u8]) -> Result<u64, WireError> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&b, rest) = buf.split_first().ok_or(WireError::Truncated)?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(WireError::VarintTooLong)
}

fn take<'a>(buf: &mut &'a [u8], n: u64) -> Result<&'a [u8], WireError> {
    let n = usize::try_from(n).map_err(|_| WireError::Truncated)?;
    if buf.len() < n {
        return Err(WireError::Truncated);
    }
    let (head, rest) = buf.split_at(n);
    *buf = rest;
    Ok(head)
}

impl<'a> Iterator for FieldIter<'a> {
    type Item = Result<(u32, Value<'a>), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.is_empty() {
            return None;
        }
        let r = (|| {
            let key = varint(&mut self.buf)?;
            let number = u32::try_from(key >> 3).map_err(|_| WireError::Truncated)?;
            if number == 0 {
                return Err(WireError::FieldZero);
            }
            let value = match (key & 7) as u8 {
                0 => Value::Varint(varint(&mut self.buf)?),
                1 => {
                    take(&mut self.buf, 8)?;
                    Value::Fixed64
                }
                2 => {
                    let len = varint(&mut self.buf)?;
                    Value::Bytes(take(&mut self.buf, len)?)
                }
                5 => {
                    take(&mut self.buf, 4)?;
                    Value::Fixed32
                }
                // Groups (3, 4) are proto2-only and absent from xDS.
                t => return Err(WireError::WireType(t)),
            };
            Ok((number, value))
        })();
        if r.is_err() {
            // Stop after the first error.
            self.buf = &[];
        }
        Some(r)
    }
}

fn utf8(number: u32, b: &[u8]) -> Result<&str, WireError> {
    std::str::from_utf8(b).map_err(|_| WireError::Utf8(number))
}

/// Peeks at the fields the proxy needs; the whole top level is walked, so a malformed
/// message is detected here rather than by the peer.
pub fn peek(kind: Kind, buf: &[u8]) -> Result<Peek<'_>, WireError> {
    let f = kind.fields();
    let mut p = Peek::default();
    for field in fields(buf) {
        let (n, v) = field?;
        let Value::Bytes(b) = v else { continue };
        // Proto3 scalars: the last occurrence wins, as in a real decoder.
        if n == f.type_url {
            p.type_url = utf8(n, b)?;
        } else if n == f.nonce {
            p.nonce = utf8(n, b)?;
        } else if n == f.version {
            p.version = utf8(n, b)?;
        } else if n == f.error_detail {
            p.has_error = true;
        } else if n == f.resources {
            p.resources += 1;
        }
    }
    Ok(p)
}

/// All values of a repeated string field `number` at the top level of `buf`.
pub fn repeated_strings(buf: &[u8], number: u32) -> Result<Vec<String>, WireError> {
    let mut out = Vec::new();
    for field in fields(buf) {
        if let (n, Value::Bytes(b)) = field?
            && n == number
        {
            out.push(utf8(n, b)?.to_owned());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use meshagent_proto::envoy::pb::envoy::config::core::v3::Node;
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
        Resource,
    };
    use meshagent_proto::envoy::pb::google::protobuf::Any;
    use meshagent_proto::envoy::pb::google::rpc::Status;
    use prost::Message;

    fn node() -> Option<Node> {
        Some(Node {
            id: "sidecar~1.2.3.4~a.ns~ns.svc.cluster.local".into(),
            ..Default::default()
        })
    }

    #[test]
    fn sotw_request_fields() {
        let m = DiscoveryRequest {
            version_info: "v1".into(),
            node: node(),
            resource_names: vec!["a".into(), "b".into()],
            type_url: "T".into(),
            response_nonce: "n1".into(),
            error_detail: Some(Status {
                code: 13,
                message: "bad".into(),
                details: vec![],
            }),
            ..Default::default()
        }
        .encode_to_vec();
        let p = peek(Kind::SotwRequest, &m).unwrap();
        assert_eq!(
            p,
            Peek {
                type_url: "T",
                nonce: "n1",
                version: "v1",
                has_error: true,
                resources: 0
            }
        );
    }

    #[test]
    fn sotw_response_fields() {
        let any = Any {
            type_url: "T".into(),
            value: vec![1, 2, 3],
        };
        let m = DiscoveryResponse {
            version_info: "v2".into(),
            resources: vec![any.clone(), any],
            type_url: "T".into(),
            nonce: "n2".into(),
            canary: true,
            ..Default::default()
        }
        .encode_to_vec();
        let p = peek(Kind::SotwResponse, &m).unwrap();
        assert_eq!(
            (p.type_url, p.nonce, p.version, p.resources),
            ("T", "n2", "v2", 2)
        );
        assert!(!p.has_error);
    }

    #[test]
    fn delta_fields() {
        let m = DeltaDiscoveryRequest {
            node: node(),
            type_url: "D".into(),
            resource_names_subscribe: vec!["x".into()],
            response_nonce: "n3".into(),
            initial_resource_versions: [("k".to_owned(), "v".to_owned())].into(),
            ..Default::default()
        }
        .encode_to_vec();
        let p = peek(Kind::DeltaRequest, &m).unwrap();
        assert_eq!(
            (p.type_url, p.nonce, p.version, p.has_error),
            ("D", "n3", "", false)
        );

        let m = DeltaDiscoveryResponse {
            system_version_info: "sv".into(),
            resources: vec![Resource::default()],
            type_url: "D".into(),
            nonce: "n4".into(),
            removed_resources: vec!["gone".into()],
            ..Default::default()
        }
        .encode_to_vec();
        let p = peek(Kind::DeltaResponse, &m).unwrap();
        assert_eq!(
            (p.type_url, p.nonce, p.version, p.resources),
            ("D", "n4", "sv", 1)
        );
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        let good = DiscoveryResponse {
            type_url: "T".into(),
            nonce: "n".into(),
            ..Default::default()
        }
        .encode_to_vec();
        // Every truncation of a valid message either peeks or errors.
        for i in 0..good.len() {
            let _ = peek(Kind::SotwResponse, &good[..i]);
        }
        assert_eq!(
            peek(Kind::SotwResponse, &[0x22, 0x05, b'a']),
            Err(WireError::Truncated)
        );
        assert_eq!(
            peek(Kind::SotwResponse, &[0x23]),
            Err(WireError::WireType(3))
        );
        assert_eq!(
            peek(Kind::SotwResponse, &[0xff; 11]),
            Err(WireError::VarintTooLong)
        );
        assert_eq!(
            peek(Kind::SotwResponse, &[0x22, 0x01, 0xff]),
            Err(WireError::Utf8(4))
        );
        assert_eq!(peek(Kind::SotwResponse, &[0x00]), Err(WireError::FieldZero));
        assert_eq!(peek(Kind::SotwResponse, &[]).unwrap(), Peek::default());
    }

    #[test]
    fn repeated_string_field() {
        // field 34, wire type 2: key = 34<<3|2 = 274 = varint [0x92, 0x02]
        let mut buf = vec![0x0a, 1, b'x']; // field 1
        for s in ["A", "BC"] {
            buf.extend([0x92, 0x02, s.len() as u8]);
            buf.extend(s.as_bytes());
        }
        assert_eq!(repeated_strings(&buf, 34).unwrap(), vec!["A", "BC"]);
    }
}
