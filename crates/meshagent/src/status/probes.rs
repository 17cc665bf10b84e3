//! Application probe rewriting (Istio `pilot/cmd/pilot-agent/status/server.go` `handleAppProbe`).
//!
//! The injector points kubelet's probes and lifecycle hooks at `/app-health/<c>/<kind>` and
//! `/app-lifecycle/<c>/<kind>` on the status port; `ISTIO_KUBE_APP_PROBERS` says what to call
//! instead. Every probe opens a fresh connection from `127.0.0.6` (`::6`), the source address
//! Istio's iptables rules let through uncaptured, to `INSTANCE_IP` (apps that bind only the pod
//! IP work, #25177) or `localhost` with the legacy switch. HTTPS is not verified (kubelet does
//! not verify either) and may negotiate HTTP/2. Answers follow Istio: any 3xx → 200, otherwise
//! the app's status and at most 10 KiB of body; transport errors → 500.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, header};
use bytes::Bytes;
use http_body_util::Full;
use tokio::time::Instant;

use crate::config::probers::{AppProber, ProberKind};
use crate::net::connect::{Conn, ProbeSource, Tls, connect_from_probe_source};
use crate::net::{self, ConnectError, Connector, SendError, error_chain};

/// Body bytes passed back to kubelet (Istio's 10 KiB).
pub const MAX_BODY: usize = 10 * 1024;
/// gRPC health responses are a few bytes; a larger message is an error.
const MAX_GRPC_BODY: usize = 64 * 1024;
const MAX_REDIRECTS: usize = 10;
const H2_AND_H1: &[&[u8]] = &[b"h2", b"http/1.1"];
const H1_ONLY: &[&[u8]] = &[b"http/1.1"];
/// The bound of a probe whose configuration has no timeout (Istio's client then has none;
/// kubelet gives up after its own `timeoutSeconds`, default 1 s, and closes the request,
/// which cancels the probe here).
const UNSET_TIMEOUT_BOUND: Duration = Duration::from_secs(600);

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("connect to {addr} failed: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot resolve {0}")]
    Resolve(String),
    #[error("TLS handshake failed: {0}")]
    Tls(String),
    #[error("HTTP request failed: {0}")]
    Http(String),
    #[error("timed out")]
    Timeout,
    #[error("bad gRPC health response: {0}")]
    Grpc(String),
}

/// The rewritten probes and how to reach the application.
#[derive(Clone)]
pub struct AppProbes {
    probers: Arc<BTreeMap<String, AppProber>>,
    /// Where the application is: `INSTANCE_IP`, or loopback with the legacy switch.
    dest: IpAddr,
    status_port: u16,
    tls: Tls,
}

impl AppProbes {
    pub fn new(
        probers: BTreeMap<String, AppProber>,
        dest: IpAddr,
        status_port: u16,
        http2: bool,
    ) -> Result<AppProbes, rustls::Error> {
        Ok(AppProbes {
            probers: Arc::new(probers),
            dest,
            status_port,
            // Kubelet does not verify probe certificates; neither do we.
            tls: Tls::unverified(if http2 { H2_AND_H1 } else { H1_ONLY })?,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.probers.is_empty()
    }

    /// Answers kubelet for `path`.
    pub async fn handle(&self, path: &str, incoming: &HeaderMap) -> Response<Body> {
        let Some(prober) = self.probers.get(path) else {
            return plain(
                StatusCode::BAD_REQUEST,
                Bytes::from(format!("app prober config does not exists for {path}")),
            );
        };
        let deadline = Instant::now() + prober.timeout().unwrap_or(UNSET_TIMEOUT_BOUND);
        let work = self.run(prober, incoming, deadline);
        let result = tokio::time::timeout_at(deadline, work)
            .await
            .unwrap_or(Err(ProbeError::Timeout));
        match result {
            Ok((code, body)) => plain(code, body),
            Err(e) => {
                tracing::debug!(path, error = %e, "application probe failed");
                plain(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    Bytes::from(format!("probe failed: {e}")),
                )
            }
        }
    }

    async fn run(
        &self,
        prober: &AppProber,
        incoming: &HeaderMap,
        deadline: Instant,
    ) -> Result<(StatusCode, Bytes), ProbeError> {
        match &prober.kind {
            ProberKind::TcpSocket { port } => {
                let addr = SocketAddr::new(self.dest, *port);
                match connect_from_probe_source(addr).await {
                    Ok(_) => Ok((StatusCode::OK, Bytes::new())),
                    Err(e) => {
                        tracing::debug!(error = %e, "TCP probe failed");
                        Ok((StatusCode::INTERNAL_SERVER_ERROR, Bytes::new()))
                    }
                }
            }
            ProberKind::Grpc { port, service } => {
                let addr = SocketAddr::new(self.dest, *port);
                let ua = incoming.get(header::USER_AGENT).cloned();
                match grpc_check(addr, service, ua).await {
                    Ok(true) => Ok((StatusCode::OK, Bytes::new())),
                    Ok(false) => Ok((StatusCode::INTERNAL_SERVER_ERROR, Bytes::new())),
                    Err(e) => {
                        tracing::debug!(error = %e, "gRPC probe failed");
                        Ok((StatusCode::INTERNAL_SERVER_ERROR, Bytes::new()))
                    }
                }
            }
            ProberKind::HttpGet {
                path,
                port,
                https,
                host,
                headers,
            } => {
                self.http(
                    path,
                    *port,
                    *https,
                    host.as_deref(),
                    headers,
                    incoming,
                    deadline,
                )
                .await
            }
        }
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the probe's fields, passed through"
    )]
    async fn http(
        &self,
        path: &str,
        port: u16,
        https: bool,
        host: Option<&str>,
        extra: &[(String, String)],
        incoming: &HeaderMap,
        deadline: Instant,
    ) -> Result<(StatusCode, Bytes), ProbeError> {
        let dest_host = host
            .map(str::to_owned)
            .unwrap_or_else(|| self.dest.to_string());
        let mut target = Target {
            https,
            host: dest_host.clone(),
            port,
            path_and_query: if path.starts_with('/') {
                path.to_owned()
            } else {
                format!("/{path}")
            },
        };
        let headers = self.request_headers(port, extra, incoming);
        for _ in 0..=MAX_REDIRECTS {
            let (status, location, body) = self.http_once(&target, &headers, deadline).await?;
            if !status.is_redirection() {
                return Ok((status, body));
            }
            // Follow only to the same hostname; otherwise the 3xx itself is the answer: 200
            // with no body, as Istio writes only the status for a redirect.
            let Some(next) = location.and_then(|l| target.redirect(&l)) else {
                return Ok((StatusCode::OK, Bytes::new()));
            };
            if next.host != dest_host {
                return Ok((StatusCode::OK, Bytes::new()));
            }
            target = next;
        }
        // Too many redirects: Go's client errors out, which Istio maps to 500.
        Err(ProbeError::Http("stopped after 10 redirects".into()))
    }

    /// Incoming headers minus hop-by-hop ones; Host with the status port replaced by the app
    /// port; configured `httpHeaders` last (an explicit `Host` wins).
    fn request_headers(
        &self,
        port: u16,
        extra: &[(String, String)],
        incoming: &HeaderMap,
    ) -> HeaderMap {
        let mut out = HeaderMap::new();
        for (k, v) in incoming {
            if matches!(
                k.as_str(),
                "host"
                    | "connection"
                    | "keep-alive"
                    | "proxy-connection"
                    | "transfer-encoding"
                    | "upgrade"
                    | "te"
                    | "content-length"
                    | "accept-encoding"
            ) {
                continue;
            }
            out.append(k.clone(), v.clone());
        }
        if let Some(h) = incoming.get(header::HOST).and_then(|v| v.to_str().ok()) {
            let status_suffix = format!(":{}", self.status_port);
            let host = match h.strip_suffix(&status_suffix) {
                Some(name) => format!("{name}:{port}"),
                None => h.to_owned(),
            };
            if let Ok(v) = HeaderValue::from_str(&host) {
                out.insert(header::HOST, v);
            }
        }
        for (k, v) in extra {
            if let (Ok(k), Ok(v)) = (
                HeaderName::from_bytes(k.as_bytes()),
                HeaderValue::from_str(v),
            ) {
                out.insert(k, v);
            }
        }
        out
    }

    async fn http_once(
        &self,
        t: &Target,
        headers: &HeaderMap,
        deadline: Instant,
    ) -> Result<(StatusCode, Option<String>, Bytes), ProbeError> {
        let addr = resolve(&t.host, t.port).await?;
        let authority = match headers.get(header::HOST).and_then(|v| v.to_str().ok()) {
            Some(h) => h.to_owned(),
            None => SocketAddr::new(addr.ip(), t.port).to_string(),
        };
        let scheme = if t.https { "https" } else { "http" };
        // The URL carries the authority the request names (HTTP/2's `:authority`); the
        // connector dials `addr` whatever it says, and TLS uses the target's host as the
        // server name.
        let default_port = if t.https { 443 } else { 80 };
        let (url, host_by_hand) = match net::url(scheme, &authority, &t.path_and_query) {
            // hyper-util writes HTTP/1.1's `Host` from the URL but drops a default port.
            Ok(u) => {
                let by_hand = u.port_u16() == Some(default_port);
                (u, by_hand)
            }
            // A `Host` that is no URL authority still goes out as the header.
            Err(_) => {
                let direct = SocketAddr::new(addr.ip(), t.port).to_string();
                let u = net::url(scheme, &direct, &t.path_and_query).map_err(ProbeError::Http)?;
                (u, true)
            }
        };
        let mut req = Request::get(url);
        // `Host` comes from the URL: HTTP/1.1's header, HTTP/2's `:authority` (no `Host`
        // header there, as before); written by hand only where the URL cannot say it.
        for (k, v) in headers {
            if k != header::HOST {
                req = req.header(k, v);
            }
        }
        if host_by_hand {
            req = req.header(header::HOST, authority.as_str());
        }
        // No keep-alive: every probe is a fresh connection (Istio's default).
        req = req.header(header::CONNECTION, "close");
        let req = req
            .body(Full::new(Bytes::new()))
            .map_err(|e| ProbeError::Http(e.to_string()))?;
        let connector = Connector::new(ProbeSource { to: addr })
            .with_tls(self.tls.clone().with_server_name(&t.host));
        let resp = net::send(connector, req, deadline, deadline)
            .await
            .map_err(|e| match e {
                SendError::Timeout => ProbeError::Timeout,
                SendError::Connect(ConnectError::Connect { addr, source }) => {
                    ProbeError::Connect { addr, source }
                }
                SendError::Connect(ConnectError::Tls { reason, .. }) => ProbeError::Tls(reason),
                SendError::Connect(e) => ProbeError::Resolve(e.to_string()),
                SendError::Exchange(e) => ProbeError::Http(e),
            })?;
        let status = resp.status();
        let location = resp
            .headers()
            .get(header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let (body, _) = net::prefix(resp.into_body(), MAX_BODY, deadline)
            .await
            .map_err(|e| ProbeError::Http(e.to_string()))?;
        Ok((status, location, body))
    }
}

#[derive(Clone)]
struct Target {
    https: bool,
    host: String,
    port: u16,
    path_and_query: String,
}

impl Target {
    fn redirect(&self, location: &str) -> Option<Target> {
        let uri: Uri = location.parse().ok()?;
        let mut next = self.clone();
        if let Some(auth) = uri.authority() {
            next.https = uri.scheme_str() == Some("https");
            next.host = auth.host().trim_matches(['[', ']']).to_owned();
            next.port = auth.port_u16().unwrap_or(if next.https { 443 } else { 80 });
        }
        next.path_and_query = match uri.path_and_query() {
            Some(p) if p.as_str().starts_with('/') => p.as_str().to_owned(),
            Some(p) => format!("/{}", p.as_str()),
            None => "/".to_owned(),
        };
        Some(next)
    }
}

/// The first address `host` resolves to.
async fn resolve(host: &str, port: u16) -> Result<SocketAddr, ProbeError> {
    crate::net::connect::resolve(host, port)
        .await
        .ok()
        .and_then(|a| a.into_iter().next())
        .ok_or_else(|| ProbeError::Resolve(host.to_owned()))
}

/// `grpc.health.v1.Health/Check` with tonic-health's generated client, over one fresh
/// connection from the probe source address (Istio `pilot/cmd/pilot-agent/status/server.go`,
/// `handleAppProbeGRPC`: any call error or a status other than SERVING fails the probe).
/// kubelet's User-Agent is passed on, tonic appending its own as grpc-go does.
async fn grpc_check(
    addr: SocketAddr,
    service: &str,
    user_agent: Option<HeaderValue>,
) -> Result<bool, ProbeError> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

    let grpc = |e: &dyn std::error::Error| ProbeError::Grpc(error_chain(e));
    let mut endpoint =
        tonic::transport::Endpoint::from_shared(format!("http://{addr}")).map_err(|e| grpc(&e))?;
    if let Some(ua) = user_agent {
        endpoint = endpoint.user_agent(ua).map_err(|e| grpc(&e))?;
    }
    let channel = endpoint
        .connect_with_connector(tower::service_fn(move |_: Uri| async move {
            connect_from_probe_source(addr).await.map(Conn::tcp)
        }))
        .await
        .map_err(|e| grpc(&e))?;
    let mut client = HealthClient::new(channel).max_decoding_message_size(MAX_GRPC_BODY);
    let resp = client
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await
        .map_err(|s| ProbeError::Grpc(format!("{}: {}", s.code(), s.message())))?;
    Ok(resp.into_inner().status() == ServingStatus::Serving)
}

fn plain(code: StatusCode, body: Bytes) -> Response<Body> {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = code;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_targets() {
        let t = Target {
            https: false,
            host: "10.0.0.1".into(),
            port: 8080,
            path_and_query: "/a".into(),
        };
        let r = t.redirect("/b?x=1").unwrap();
        assert_eq!(
            (r.host.as_str(), r.port, r.path_and_query.as_str()),
            ("10.0.0.1", 8080, "/b?x=1")
        );
        let r = t.redirect("https://example.com/c").unwrap();
        assert_eq!(
            (r.host.as_str(), r.port, r.https),
            ("example.com", 443, true)
        );
    }
}
