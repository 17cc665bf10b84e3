//! The HTTP(S) client of Wasm fetches (module URLs, OCI registries, blob redirects, token
//! realms), on the agent's one client ([`crate::net`]) with the guarded connector: it
//! resolves the host, refuses blocked addresses ([`Guard`]) and only then dials, so
//! redirects and realms are guarded like the first request (Istio master
//! `pkg/security/dial.go`; Go's transport gets the same effect from a `net.Dialer.Control`
//! hook). TLS is rustls with the system roots plus the mesh root; hosts in
//! `WASM_INSECURE_REGISTRIES` skip verification, as Istio's `InsecureSkipVerify` transport
//! does.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::guard::{Guard, ResolveError};
use crate::net::connect::{Guarded, Tls};
use crate::net::{self, ConnectError, Connector, SendError, error_chain};

/// Redirects followed per request (Go's `http.Client` default).
const MAX_REDIRECTS: usize = 10;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid URL {0:?}: {1}")]
    Url(String, String),
    #[error("{url}: {source}")]
    Resolve {
        url: String,
        #[source]
        source: ResolveError,
    },
    #[error("{url}: connect {addr}: {source}")]
    Connect {
        url: String,
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// TLS failed; `plain_http` when the server answered in plain HTTP (what Go reports as
    /// "server gave HTTP response to HTTPS client").
    #[error("{url}: TLS handshake: {reason}")]
    Tls {
        url: String,
        reason: String,
        plain_http: bool,
    },
    #[error("{url}: {reason}")]
    Exchange { url: String, reason: String },
    #[error("{url}: more than {MAX_REDIRECTS} redirects")]
    Redirects { url: String },
    #[error("{url}: timed out after {after:?}")]
    Timeout { url: String, after: Duration },
    #[error("{url}: response body exceeds the {max}-byte limit")]
    TooLarge { url: String, max: u64 },
    #[error("{url}: reading the body: {reason}")]
    Body { url: String, reason: String },
    #[error("writing the download: {0}")]
    Write(#[source] std::io::Error),
}

impl ClientError {
    /// Worth another attempt (Istio retries transport errors, not policy refusals).
    pub fn transient(&self) -> bool {
        !matches!(
            self,
            ClientError::Url(..)
                | ClientError::Resolve {
                    source: ResolveError::Guard(_),
                    ..
                }
                | ClientError::TooLarge { .. }
                | ClientError::Redirects { .. }
                | ClientError::Write(_)
        )
    }
}

/// A response with the URL it finally came from (after redirects), and the deadline of the
/// fetch it belongs to: its body is read by then or not at all.
pub struct Fetched {
    pub url: Uri,
    pub status: StatusCode,
    pub headers: HeaderMap,
    body: Incoming,
    url_text: String,
    deadline: Instant,
}

#[derive(Clone)]
pub struct Client {
    guard: Arc<Guard>,
    connector: Connector<Guarded>,
    insecure_hosts: Arc<Vec<String>>,
    /// Per request (`WASM_HTTP_REQUEST_TIMEOUT`): connect and response head, within the
    /// fetch's overall deadline.
    pub request_timeout: Duration,
}

/// Whether `host` (no port) is in `WASM_INSECURE_REGISTRIES` (`*` = all).
fn insecure(hosts: &[String], host: &str) -> bool {
    hosts.iter().any(|h| {
        h == "*" || h.eq_ignore_ascii_case(host) || {
            // Entries may carry a port (`registry:5000`).
            h.rsplit_once(':')
                .is_some_and(|(hh, _)| hh.eq_ignore_ascii_case(host))
        }
    })
}

impl Client {
    /// `mesh_root`: the mesh CA bundle, added to the system roots when the file exists (read
    /// when the first verified connection is made).
    pub fn new(
        guard: Guard,
        insecure_hosts: Vec<String>,
        request_timeout: Duration,
        mesh_root: Option<&Path>,
    ) -> Client {
        let guard = Arc::new(guard);
        let insecure_hosts = Arc::new(insecure_hosts);
        let hosts = insecure_hosts.clone();
        let tls = Tls::verified(mesh_root, move |host| insecure(&hosts, host));
        Client {
            connector: Connector::new(Guarded(guard.clone())).with_tls(tls),
            guard,
            insecure_hosts,
            request_timeout,
        }
    }

    pub fn guard(&self) -> &Guard {
        &self.guard
    }

    /// Whether `host` (no port) is in `WASM_INSECURE_REGISTRIES` (`*` = all).
    pub fn insecure(&self, host: &str) -> bool {
        insecure(&self.insecure_hosts, host)
    }

    /// GET `url`, following redirects (each hop through the guard). `auth` is sent only to
    /// the original host, as Go's client drops `Authorization` on a cross-host redirect.
    /// `deadline` is the whole fetch's (`http_uri.timeout`): no part of this request, its
    /// body or its connection outlives it.
    pub async fn get(
        &self,
        url: &str,
        headers: &HeaderMap,
        auth: Option<&str>,
        deadline: Instant,
    ) -> Result<Fetched, ClientError> {
        let mut uri: Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| ClientError::Url(url.into(), e.to_string()))?;
        let first_authority = uri.authority().cloned();
        for _ in 0..=MAX_REDIRECTS {
            let same_host = uri.authority() == first_authority.as_ref();
            let resp = self
                .exchange(&uri, headers, auth.filter(|_| same_host), deadline)
                .await?;
            if resp.status().is_redirection()
                && let Some(loc) = resp.headers().get(header::LOCATION)
            {
                let loc = loc.to_str().unwrap_or_default();
                uri = resolve_location(&uri, loc)
                    .ok_or_else(|| ClientError::Url(loc.to_owned(), "bad redirect".into()))?;
                continue;
            }
            let (parts, body) = resp.into_parts();
            return Ok(Fetched {
                url_text: uri.to_string(),
                url: uri,
                status: parts.status,
                headers: parts.headers,
                body,
                deadline,
            });
        }
        Err(ClientError::Redirects { url: url.into() })
    }

    async fn exchange(
        &self,
        uri: &Uri,
        headers: &HeaderMap,
        auth: Option<&str>,
        deadline: Instant,
    ) -> Result<Response<Incoming>, ClientError> {
        let text = uri.to_string();
        match uri.scheme_str() {
            Some("https" | "http") => {}
            _ => {
                return Err(ClientError::Url(
                    text,
                    "scheme must be http or https".into(),
                ));
            }
        };
        let Some(authority) = uri.authority() else {
            return Err(ClientError::Url(text, "no host".into()));
        };
        let mut req = Request::builder()
            .method(Method::GET)
            .uri(uri.clone())
            .header(header::HOST, authority.as_str())
            .header(header::USER_AGENT, "meshagent")
            .body(Full::new(Bytes::new()))
            .map_err(|e| ClientError::Url(text.clone(), e.to_string()))?;
        for (k, v) in headers {
            req.headers_mut().insert(k, v.clone());
        }
        if let Some(a) = auth
            && let Ok(v) = a.parse()
        {
            req.headers_mut().insert(header::AUTHORIZATION, v);
        }
        let start = Instant::now();
        let until = deadline.min(start + self.request_timeout);
        // The connection lives until the fetch's deadline at most, whatever the peer does.
        net::send(self.connector.clone(), req, until, deadline)
            .await
            .map_err(|e| match e {
                SendError::Timeout => ClientError::Timeout {
                    url: text.clone(),
                    after: until.saturating_duration_since(start),
                },
                SendError::Connect(ConnectError::Resolve(source)) => ClientError::Resolve {
                    url: text.clone(),
                    source,
                },
                SendError::Connect(ConnectError::Connect { addr, source }) => {
                    ClientError::Connect {
                        url: text.clone(),
                        addr,
                        source,
                    }
                }
                SendError::Connect(ConnectError::Tls { reason, plain_http }) => ClientError::Tls {
                    url: text.clone(),
                    reason,
                    plain_http,
                },
                SendError::Connect(ConnectError::Url(reason)) => {
                    ClientError::Url(text.clone(), reason)
                }
                SendError::Exchange(reason) => ClientError::Exchange {
                    url: text.clone(),
                    reason,
                },
            })
    }
}

/// A `Location` value against the URL it came from (absolute, or an absolute path).
fn resolve_location(base: &Uri, loc: &str) -> Option<Uri> {
    if loc.starts_with("http://") || loc.starts_with("https://") {
        return loc.parse().ok();
    }
    if loc.starts_with('/') {
        let mut p = base.clone().into_parts();
        p.path_and_query = Some(loc.parse().ok()?);
        return Uri::from_parts(p).ok();
    }
    None
}

impl Fetched {
    /// The body into `out`, failing (not truncating, unlike Istio's `io.LimitReader`) past
    /// `max` bytes. Returns the byte count and the hex sha256 of the body. Hashing and
    /// writing run on a blocking-pool thread fed through a small bounded channel, so the
    /// reactor only receives frames (the download overlaps with the disk and the hash) and
    /// memory stays at a few frames.
    pub async fn to_file(
        mut self,
        out: std::fs::File,
        max: u64,
        deadline: Instant,
    ) -> Result<(u64, String), ClientError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(2);
        let writer = tokio::task::spawn_blocking(move || {
            use std::io::Write as _;
            let mut hash = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
            let mut w = std::io::BufWriter::with_capacity(256 * 1024, out);
            while let Some(b) = rx.blocking_recv() {
                hash.update(&b);
                w.write_all(&b)?;
            }
            w.flush()?;
            Ok::<_, std::io::Error>(super::unpack::hex(hash.finish().as_ref()))
        });
        let deadline = deadline.min(self.deadline);
        let mut n: u64 = 0;
        let result = loop {
            let frame = match tokio::time::timeout_at(deadline, self.body.frame()).await {
                Err(_) => {
                    break Err(ClientError::Timeout {
                        url: self.url_text.clone(),
                        after: Duration::ZERO,
                    });
                }
                Ok(None) => break Ok(()),
                Ok(Some(Err(e))) => {
                    break Err(ClientError::Body {
                        url: self.url_text.clone(),
                        reason: error_chain(&e),
                    });
                }
                Ok(Some(Ok(f))) => f,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            n += data.len() as u64;
            if n > max {
                break Err(ClientError::TooLarge {
                    url: self.url_text.clone(),
                    max,
                });
            }
            if tx.send(data).await.is_err() {
                break Ok(()); // the writer failed; its error is reported below
            }
        };
        drop(tx);
        let written = writer
            .await
            .map_err(|e| ClientError::Write(std::io::Error::other(e)))?;
        result?;
        let sha = written.map_err(ClientError::Write)?;
        Ok((n, sha))
    }

    /// A small body (manifests, tokens), an error past `max` or at the fetch's deadline.
    pub async fn bytes(mut self, max: usize) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        loop {
            let f = match tokio::time::timeout_at(self.deadline, self.body.frame()).await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(_) => {
                    return Err(ClientError::Timeout {
                        url: self.url_text,
                        after: Duration::ZERO,
                    });
                }
            };
            let f = f.map_err(|e| ClientError::Body {
                url: self.url_text.clone(),
                reason: error_chain(&e),
            })?;
            if let Ok(d) = f.into_data() {
                if out.len() + d.len() > max {
                    return Err(ClientError::TooLarge {
                        url: self.url_text,
                        max: max as u64,
                    });
                }
                out.extend_from_slice(&d);
            }
        }
        Ok(out)
    }

    /// Drops a response whose body is not wanted (non-200, a 401 challenge). Not read:
    /// every request has its own connection (`exchange`), so nothing is reused that a
    /// half-read body could corrupt, and a server holding a body back (a 404 with
    /// `Content-Length: 1000` and 10 bytes sent) would otherwise hold the fetch. Dropping the
    /// body ends the connection task, which closes the socket.
    pub fn discard(self) {
        drop(self);
    }

    pub fn url_text(&self) -> &str {
        &self.url_text
    }
}
