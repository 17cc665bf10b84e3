//! Dialing the control plane (istiod's CA and xDS ports) the way Istio's agent does.
//!
//! * TLS (1.2+, h2) unless plaintext is configured; roots and server name follow Istio's rules
//!   ([`ca_target`], [`xds_target`]); the client certificate comes from `PROV_CERT` (or file-
//!   mounted certs) and is skipped when expired.
//! * Roots and client certificates are read for **every new connection**, so a rotated root or
//!   client certificate is picked up without restarting (Istio rebuilds its dial options on a
//!   root change; reading per connection has the same effect with nothing to watch).
//! * [`CallMetadata`] adds `ClusterID`, extra headers and `authorization: Bearer <token>`, with
//!   the token read from its file on every call, so kubelet-rotated tokens just work.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_util::either::Either;
use tonic::metadata::{AsciiMetadataKey, AsciiMetadataValue, MetadataMap};
use tonic::transport::{Channel, Endpoint};

use crate::config::{AuthenticationPolicy, Config};
use crate::net::error_chain;

/// Default root of istiod's CA (the `istio-ca-root-cert` configmap mount).
pub const DEFAULT_ROOT: &str = "./var/run/secrets/istio/root-cert.pem";
/// Legacy mounted certs; its root is preferred for xDS when present.
pub const ETC_CERTS_ROOT: &str = "./etc/certs/root-cert.pem";
/// Server name used when the address is `localhost` (and istiod's SAN).
pub const ISTIOD_SVC: &str = "istiod.istio-system.svc";

pub use crate::net::tls::SYSTEM_ROOT_PATHS;

#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("invalid control plane address {addr:?}: {reason}")]
    Address { addr: String, reason: String },
    #[error("TLS is required for {what} but PILOT_CERT_PROVIDER=none gives no root certificate")]
    NoRoot { what: &'static str },
    #[error("no OS trust bundle found (looked in {0:?})")]
    NoSystemRoots(Vec<&'static str>),
}

/// Roots that verify istiod's serving certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Roots {
    /// The OS trust bundle (`SYSTEM`).
    System,
    /// A PEM bundle file, resolved against the agent's working directory.
    File(PathBuf),
}

/// A client certificate (mTLS to istiod, VMs): PEM chain and key files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    pub cert_chain: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    pub roots: Roots,
    pub server_name: String,
    pub client_cert: Option<ClientCert>,
    /// `COMPLIANCE_POLICY`, which Istio applies to these clients (`pilot/pkg/grpc/tls.go`).
    pub policy: crate::tls_policy::CompliancePolicy,
}

/// Where and how to dial.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port`.
    pub addr: String,
    /// `None` means plaintext.
    pub tls: Option<Tls>,
}

fn host_of(addr: &str) -> Result<&str, DialError> {
    let bad = |reason: &str| DialError::Address {
        addr: addr.to_owned(),
        reason: reason.to_owned(),
    };
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| bad("expected host:port"))?;
    port.parse::<u16>()
        .map_err(|_| bad("port is not a number 0-65535"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad("empty host"));
    }
    Ok(host)
}

/// `localhost` is not a name istiod's certificate carries; Istio substitutes its service name.
fn server_name_for(host: &str) -> String {
    if host.starts_with("localhost") {
        ISTIOD_SVC.to_owned()
    } else {
        host.to_owned()
    }
}

fn prov_cert(cfg: &Config) -> Option<ClientCert> {
    cfg.identity.prov_cert.as_ref().map(|d| ClientCert {
        cert_chain: d.join("cert-chain.pem"),
        key: d.join("key.pem"),
    })
}

/// The CA endpoint (Istio `security/pkg/nodeagent/caclient/providers/citadel/client.go`): plaintext when `CA_ADDR` ends in `:15010`; roots from
/// `CA_ROOT_CA` | `SYSTEM` | `./etc/certs/root-cert.pem` (PILOT_CERT_PROVIDER=custom) |
/// `<PROV_CERT>/root-cert.pem` | the istiod root; `ISTIOD_SAN` only when `CA_ADDR` defaulted.
pub fn ca_target(cfg: &Config) -> Result<Target, DialError> {
    let addr = cfg.identity.ca_addr.clone();
    let host = host_of(&addr)?;
    if addr.ends_with(":15010") {
        return Ok(Target { addr, tls: None });
    }
    let id = &cfg.identity;
    let roots = if id.ca_root_ca == "SYSTEM" {
        Roots::System
    } else if !id.ca_root_ca.is_empty() {
        Roots::File(PathBuf::from(&id.ca_root_ca))
    } else if id.pilot_cert_provider == "custom" {
        Roots::File(PathBuf::from(ETC_CERTS_ROOT))
    } else if let Some(d) = &id.prov_cert {
        Roots::File(d.join("root-cert.pem"))
    } else if id.pilot_cert_provider == "none" {
        return Err(DialError::NoRoot { what: "the CA" });
    } else {
        Roots::File(PathBuf::from(DEFAULT_ROOT))
    };
    let server_name = if !id.ca_addr_set && !id.istiod_san.is_empty() {
        id.istiod_san.clone()
    } else {
        server_name_for(host)
    };
    Ok(Target {
        tls: Some(Tls {
            roots,
            server_name,
            client_cert: prov_cert(cfg),
            policy: crate::tls_policy::CompliancePolicy::parse(&cfg.xds.compliance_policy),
        }),
        addr,
    })
}

/// The xDS endpoint (Istio `pkg/istio-agent/xds_proxy.go` `buildUpstreamClientDialOpts`): plaintext when `controlPlaneAuthPolicy` is `NONE`; roots from
/// `XDS_ROOT_CA` (`SYSTEM` or a path) | `./etc/certs/root-cert.pem` if it exists |
/// `<PROV_CERT>/root-cert.pem` | file-mounted `TLS_CLIENT_ROOT_CERT` | the istiod root;
/// `ISTIOD_SAN` always wins for the server name.
#[allow(
    clippy::disallowed_methods,
    reason = "computed once at start (config checks, xds::XdsOptions::from_config), before the proxy serves"
)]
pub fn xds_target(cfg: &Config, cwd: &Path) -> Result<Target, DialError> {
    let addr = cfg.proxy_config.discovery_address.clone();
    let host = host_of(&addr)?;
    if cfg.proxy_config.control_plane_auth_policy == AuthenticationPolicy::None {
        return Ok(Target { addr, tls: None });
    }
    let id = &cfg.identity;
    let meta = &cfg.proxy_config.proxy_metadata;
    let roots = if cfg.xds.root_ca == "SYSTEM" {
        Roots::System
    } else if !cfg.xds.root_ca.is_empty() {
        Roots::File(PathBuf::from(&cfg.xds.root_ca))
    } else if crate::fsio::under(cwd, ETC_CERTS_ROOT).exists() {
        Roots::File(PathBuf::from(ETC_CERTS_ROOT))
    } else if let Some(d) = &id.prov_cert {
        Roots::File(d.join("root-cert.pem"))
    } else if id.file_mounted_certs
        && let Some(p) = meta.get("ISTIO_META_TLS_CLIENT_ROOT_CERT")
    {
        Roots::File(PathBuf::from(p))
    } else if id.pilot_cert_provider == "none" {
        return Err(DialError::NoRoot { what: "xDS" });
    } else {
        Roots::File(PathBuf::from(DEFAULT_ROOT))
    };
    let client_cert = prov_cert(cfg).or_else(|| {
        if !id.file_mounted_certs {
            return None;
        }
        Some(ClientCert {
            cert_chain: PathBuf::from(meta.get("ISTIO_META_TLS_CLIENT_CERT_CHAIN")?),
            key: PathBuf::from(meta.get("ISTIO_META_TLS_CLIENT_KEY")?),
        })
    });
    let server_name = if id.istiod_san.is_empty() {
        server_name_for(host)
    } else {
        id.istiod_san.clone()
    };
    Ok(Target {
        tls: Some(Tls {
            roots,
            server_name,
            client_cert,
            policy: crate::tls_policy::CompliancePolicy::parse(&cfg.xds.compliance_policy),
        }),
        addr,
    })
}

// === dialing ===

/// Keepalive of control-plane connections (`GRPC_KEEPALIVE_INTERVAL`/`_TIMEOUT` defaults).
#[derive(Debug, Clone, Copy)]
pub struct Keepalive {
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for Keepalive {
    fn default() -> Keepalive {
        Keepalive {
            interval: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
        }
    }
}

/// A lazily-connecting channel to `target`. Files are resolved against `cwd` (the agent's
/// working directory; `.` in production, a temp dir in tests).
pub fn channel(target: &Target, cwd: &Path, keepalive: Keepalive) -> Result<Channel, DialError> {
    Ok(endpoint(target, keepalive)?.connect_with_connector_lazy(connector(target, cwd)))
}

/// Like [`channel`], but dials now: resolves once TCP, TLS and HTTP/2 are up, so the first
/// call pays none of it.
pub async fn connect(
    target: &Target,
    cwd: &Path,
    keepalive: Keepalive,
) -> Result<Channel, ConnectError> {
    endpoint(target, keepalive)?
        .connect_with_connector(connector(target, cwd))
        .await
        .map_err(|e| ConnectError::Dial {
            addr: target.addr.clone(),
            reason: error_chain(&e),
        })
}

/// Why [`connect`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Config(#[from] DialError),
    #[error("cannot connect to {addr}: {reason}")]
    Dial { addr: String, reason: String },
}

/// A call's status with dial failures as gRPC names them. tonic reports a lazy channel's failed
/// dial (a connect or TLS handshake timeout, e.g. istiod black-holed by a NetworkPolicy) as
/// `Unknown: transport error`; grpc-go, whose codes Istio's CA retry interceptor
/// (`security/pkg/nodeagent/caclient/providers/citadel/client.go`) and xDS proxy reconnect
/// logic (`pkg/istio-agent/xds_proxy.go`) key on, reports `Unavailable`. A status decoded from
/// the wire never carries a source, so `Unknown` with one is always local.
pub fn transport_status(s: tonic::Status) -> tonic::Status {
    match std::error::Error::source(&s) {
        Some(cause) if s.code() == tonic::Code::Unknown => {
            tonic::Status::unavailable(format!("{}: {}", s.message(), error_chain(cause)))
        }
        _ => s,
    }
}

/// HTTP/2 receive windows of control-plane connections (hyper's defaults are 2 MiB per
/// stream and 5 MiB per connection). The xDS proxy reads every upstream stream promptly into a
/// bounded queue (`xds::stream::MAX_QUEUED`) and stops reading only a stream whose client does
/// not read; such a stream then holds at most one stream window of the connection's. A
/// connection window of eight stream windows keeps the other streams of a client flowing
/// while a few of its streams are stuck, until the stuck ones are cut off (`xds::stream::STALL`).
/// Windows are credit, not allocations: memory is only what the peer actually sends unread.
pub const STREAM_WINDOW: u32 = 2 << 20;
pub const CONNECTION_WINDOW: u32 = 8 * STREAM_WINDOW;

/// The `:authority` (and `:scheme`) of requests on a connection to `target`, as grpc-go sets
/// them for Istio's clients: over TLS the credentials' server name, without a port (grpc-go
/// `clientconn.go` `determineAuthority` prefers `TransportCredentials.Info().ServerName`, which
/// Istio sets in `pilot/pkg/grpc/tls.go` and `pkg/istio-agent/xds_proxy.go`); in plaintext
/// the dialled `host:port`. A gateway or proxy in front of istiod (a remote cluster's
/// east-west gateway) may route on it.
fn origin(target: &Target) -> String {
    match &target.tls {
        Some(tls) if tls.server_name.parse::<std::net::Ipv6Addr>().is_ok() => {
            format!("https://[{}]", tls.server_name)
        }
        Some(tls) => format!("https://{}", tls.server_name),
        None => format!("http://{}", target.addr),
    }
}

fn endpoint(target: &Target, keepalive: Keepalive) -> Result<Endpoint, DialError> {
    let bad = |e: &dyn std::fmt::Display| DialError::Address {
        addr: target.addr.clone(),
        reason: e.to_string(),
    };
    let origin: http::Uri = origin(target).parse().map_err(|e| bad(&e))?;
    // The URI only carries the origin: the connector dials `target.addr` itself.
    Ok(Endpoint::from_shared(format!("http://{}", target.addr))
        .map_err(|e| bad(&e))?
        .origin(origin)
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(keepalive.interval)
        .keep_alive_timeout(keepalive.timeout)
        // Pings only while a call is open, as grpc-go's client does by default
        // (`keepalive.ClientParameters.PermitWithoutStream` false; Istio's `ClientOptions` in
        // `pilot/pkg/grpc/grpc.go` leaves it so): the CA connection, idle between
        // certificate renewals, would otherwise wake the agent every 30 s for nothing.
        .keep_alive_while_idle(false)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .tcp_nodelay(true))
}

type Io = TokioIo<Either<TcpStream, tokio_rustls::client::TlsStream<TcpStream>>>;

/// Dials `target` (TCP, then TLS with the root and client certificate files as they are at
/// this moment, so rotated files apply to the next connection).
fn connector(
    target: &Target,
    cwd: &Path,
) -> impl tower::Service<
    http::Uri,
    Response = Io,
    Error = std::io::Error,
    Future = impl std::future::Future<Output = std::io::Result<Io>> + Send,
> + Clone
+ Send
+ 'static {
    let addr = target.addr.clone();
    let tls = target.tls.clone().map(|t| Arc::new((t, cwd.to_path_buf())));
    tower::service_fn(move |_uri: http::Uri| {
        let addr = addr.clone();
        let tls = tls.clone();
        async move {
            let tcp = TcpStream::connect(&addr).await?;
            let _ = tcp.set_nodelay(true);
            let Some(tls) = tls else {
                return Ok::<_, std::io::Error>(TokioIo::new(Either::Left(tcp)));
            };
            // Roots and client certificate are read from files per connection: on the
            // blocking pool, never on the runtime thread.
            let files = tls.clone();
            let config = tokio::task::spawn_blocking(move || client_config(&files.0, &files.1))
                .await
                .map_err(std::io::Error::other)??;
            let (settings, _) = &*tls;
            let name = ServerName::try_from(settings.server_name.clone()).map_err(|e| {
                std::io::Error::other(format!("server name {:?}: {e}", settings.server_name))
            })?;
            let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(name, tcp)
                .await?;
            Ok(TokioIo::new(Either::Right(stream)))
        }
    })
}

/// Builds the rustls client config for one connection from the current files.
pub fn client_config(tls: &Tls, cwd: &Path) -> std::io::Result<rustls::ClientConfig> {
    let roots = load_roots(&tls.roots, cwd)?;
    let builder = crate::tls_policy::client_builder(tls.policy)
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots);
    let mut config = match tls
        .client_cert
        .as_ref()
        .and_then(|c| load_client_cert(c, cwd))
    {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .map_err(std::io::Error::other)?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    // A config lives for one connection (built from the current files at each dial), so a
    // session cache would die with the connection it could serve; rustls' default one
    // preallocates ~14 KiB. pilot-agent's `tls.Config` has no session cache either
    // (pkg/istio-agent/xds_proxy.go, security/pkg/nodeagent/caclient).
    config.resumption = rustls::client::Resumption::disabled();
    Ok(config)
}

#[allow(
    clippy::disallowed_methods,
    reason = "called by client_config, on the blocking pool"
)]
pub(crate) fn load_roots(roots: &Roots, cwd: &Path) -> std::io::Result<rustls::RootCertStore> {
    let path = match roots {
        Roots::File(p) => crate::fsio::under(cwd, p),
        Roots::System => SYSTEM_ROOT_PATHS
            .iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .ok_or_else(|| {
                std::io::Error::other(DialError::NoSystemRoots(SYSTEM_ROOT_PATHS.to_vec()))
            })?,
    };
    let pem = crate::fsio::read_bounded(&path, MAX_TLS_FILE_BYTES)
        .map_err(|e| std::io::Error::new(e.kind(), format!("root certificates: {e}")))?;
    let mut store = rustls::RootCertStore::empty();
    // Invalid entries in a bundle are skipped, as Istio does; an empty result is an error.
    for der in CertificateDer::pem_slice_iter(&pem).flatten() {
        let _ = store.add(der);
    }
    if store.is_empty() {
        return Err(std::io::Error::other(format!(
            "root certificates {}: no valid PEM certificate",
            path.display()
        )));
    }
    Ok(store)
}

/// The client certificate if both files parse and the leaf has not expired; otherwise no
/// client certificate is presented (the token still authenticates), as Istio does.
fn load_client_cert(
    c: &ClientCert,
    cwd: &Path,
) -> Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let chain_pem = crate::fsio::read_bounded(&cwd.join(&c.cert_chain), MAX_TLS_FILE_BYTES).ok()?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&chain_pem)
        .collect::<Result<_, _>>()
        .ok()?;
    let key_pem = crate::fsio::read_bounded(&cwd.join(&c.key), MAX_TLS_FILE_BYTES).ok()?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).ok()?;
    let leaf = chain.first()?;
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
    if !parsed.validity().is_valid() {
        tracing::warn!(cert = %c.cert_chain.display(), "client certificate expired; connecting with the token only");
        return None;
    }
    Some((chain, key))
}

// === per-call metadata ===

/// Reads the bearer token from its file on every call.
#[derive(Debug, Clone)]
pub struct TokenSource {
    path: Option<PathBuf>,
    warned: Arc<AtomicBool>,
}

impl TokenSource {
    pub fn new(path: Option<PathBuf>) -> TokenSource {
        TokenSource {
            path,
            warned: Arc::default(),
        }
    }

    /// The current token, trimmed; `None` (logged once) when missing, empty or unreadable.
    /// Read on the blocking pool with a size cap and timeout (`fsio`): it is read on every
    /// call, so a slow or hostile mount must not stall the runtime.
    pub async fn token(&self) -> Option<String> {
        let path = self.path.as_ref()?;
        let read = crate::fsio::read(path.clone(), MAX_TOKEN_BYTES, FILE_READ_TIMEOUT).await;
        let result = read.map(|b| String::from_utf8_lossy(&b).trim().to_owned());
        match result {
            Ok(t) if !t.is_empty() => {
                self.warned.store(false, Ordering::Relaxed);
                Some(t)
            }
            result => {
                if !self.warned.swap(true, Ordering::Relaxed) {
                    let why = result.err().map_or("empty".to_owned(), |e| e.to_string());
                    tracing::warn!(path = %path.display(), reason = %why, "no token; calling without an authorization header");
                }
                None
            }
        }
    }
}

/// Largest token file read (projected service-account tokens are ~1 KiB).
const MAX_TOKEN_BYTES: u64 = 64 * 1024;
/// Largest root bundle or client certificate file read per connection.
const MAX_TLS_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// How long reading one of these files may take.
const FILE_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Metadata added to every control-plane call.
#[derive(Debug, Clone)]
pub struct CallMetadata {
    headers: Vec<(AsciiMetadataKey, AsciiMetadataValue)>,
    token: TokenSource,
}

impl CallMetadata {
    /// `ClusterID` (when set) plus `extra` headers; invalid header names or values are
    /// skipped with a warning rather than failing every call.
    pub fn new(
        cluster_id: &str,
        extra: &std::collections::BTreeMap<String, String>,
        token: TokenSource,
    ) -> CallMetadata {
        let mut headers = Vec::new();
        let pairs = (!cluster_id.is_empty())
            .then(|| ("ClusterID".to_owned(), cluster_id.to_owned()))
            .into_iter()
            .chain(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        for (k, v) in pairs {
            match (
                AsciiMetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes()),
                AsciiMetadataValue::try_from(v.as_str()),
            ) {
                (Ok(k), Ok(v)) => headers.push((k, v)),
                _ => tracing::warn!(header = %k, "skipping header that is not valid gRPC metadata"),
            }
        }
        CallMetadata { headers, token }
    }

    pub async fn apply(&self, md: &mut MetadataMap) {
        for (k, v) in &self.headers {
            md.insert(k.clone(), v.clone());
        }
        if let Some(t) = self.token.token().await
            && let Ok(v) = AsciiMetadataValue::try_from(format!("Bearer {t}"))
        {
            md.insert("authorization", v);
        }
    }

    pub fn token_source(&self) -> &TokenSource {
        &self.token
    }
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "test code, not on the agent's runtime"
)]
mod tests {
    use super::*;

    #[test]
    fn local_transport_failures_are_unavailable_and_wire_statuses_are_kept() {
        let local = tonic::Status::from_error(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "handshake timed out",
        )));
        assert_eq!(local.code(), tonic::Code::Unknown);
        let mapped = transport_status(local);
        assert_eq!(mapped.code(), tonic::Code::Unavailable);
        assert!(mapped.message().contains("handshake timed out"), "{mapped}");
        // From the wire (no source): istiod's own `Unknown` stays what it is.
        let wire = transport_status(tonic::Status::unknown("boom"));
        assert_eq!(wire.code(), tonic::Code::Unknown);
        assert_eq!(wire.message(), "boom");
        let other = transport_status(tonic::Status::permission_denied("no"));
        assert_eq!(other.code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn authority_is_the_tls_server_name_or_the_address() {
        let t = |addr: &str, name: Option<&str>| Target {
            addr: addr.to_owned(),
            tls: name.map(|n| Tls {
                roots: Roots::System,
                server_name: n.to_owned(),
                client_cert: None,
                policy: Default::default(),
            }),
        };
        let cases = [
            (
                t("localhost:15012", Some(ISTIOD_SVC)),
                "https://istiod.istio-system.svc",
            ),
            (t("10.0.0.1:15012", Some("10.0.0.1")), "https://10.0.0.1"),
            (t("[fd00::1]:15012", Some("fd00::1")), "https://[fd00::1]"),
            (
                t("istiod.istio-system.svc:15010", None),
                "http://istiod.istio-system.svc:15010",
            ),
        ];
        for (target, want) in cases {
            assert_eq!(origin(&target), want);
            let uri: http::Uri = want.parse().unwrap();
            assert!(endpoint(&target, Keepalive::default()).is_ok(), "{uri}");
        }
    }

    #[test]
    fn server_names() {
        assert_eq!(server_name_for("localhost"), ISTIOD_SVC);
        assert_eq!(server_name_for("istiod.foo.svc"), "istiod.foo.svc");
        assert!(host_of("nohost").is_err());
        assert!(host_of("h:99999").is_err());
        assert_eq!(host_of("[::1]:15012").unwrap(), "::1");
    }

    /// An HTTP/2 peer on a real socket that answers the client's SETTINGS and PINGs and
    /// counts the PINGs it gets (frame type 6 without ACK) until `stop`.
    async fn count_pings(l: tokio::net::TcpListener, stop: tokio::time::Instant) -> (bool, u32) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (mut s, _) = l.accept().await.unwrap();
        let mut preface = [0u8; 24];
        s.read_exact(&mut preface).await.unwrap();
        assert_eq!(&preface[..], b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        let (mut settings, mut pings) = (false, 0);
        loop {
            let mut head = [0u8; 9];
            match tokio::time::timeout_at(stop, s.read_exact(&mut head)).await {
                Err(_) | Ok(Err(_)) => return (settings, pings),
                Ok(Ok(_)) => {}
            }
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let mut body = vec![0u8; len];
            s.read_exact(&mut body).await.unwrap();
            match (head[3], head[4] & 1) {
                (4, 0) => {
                    settings = true;
                    // Our (empty) SETTINGS, then the ACK of theirs.
                    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap();
                    s.write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0]).await.unwrap();
                }
                (6, 0) => {
                    pings += 1;
                    let mut ack = vec![0, 0, 8, 6, 1, 0, 0, 0, 0];
                    ack.extend_from_slice(&body);
                    s.write_all(&ack).await.unwrap();
                }
                _ => {}
            }
        }
    }

    /// A connection without an open call sends no keepalive PINGs, as grpc-go's client by
    /// default: the agent's CA connection sits idle between renewals.
    #[tokio::test]
    async fn no_keepalive_pings_without_an_open_call() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = Target {
            addr: l.local_addr().unwrap().to_string(),
            tls: None,
        };
        let stop = tokio::time::Instant::now() + Duration::from_millis(1500);
        let peer = tokio::spawn(count_pings(l, stop));
        let keepalive = Keepalive {
            interval: Duration::from_millis(100),
            timeout: Duration::from_secs(5),
        };
        let dir = tempfile::tempdir().unwrap();
        let channel = connect(&target, dir.path(), keepalive).await.unwrap();
        let (settings, pings) = peer.await.unwrap();
        drop(channel);
        assert!(settings, "the client never sent its SETTINGS");
        assert_eq!(pings, 0, "keepalive PINGs on a connection without calls");
    }

    #[tokio::test]
    async fn token_is_read_on_every_call() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t");
        let ts = TokenSource::new(Some(p.clone()));
        assert_eq!(ts.token().await, None);
        std::fs::write(&p, "one\n").unwrap();
        assert_eq!(ts.token().await.as_deref(), Some("one"));
        std::fs::write(&p, "two").unwrap();
        assert_eq!(ts.token().await.as_deref(), Some("two"));
        // A FIFO as the token (a hostile or broken mount) is no token, at once.
        std::fs::remove_file(&p).unwrap();
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert_eq!(ts.token().await, None);
    }

    #[tokio::test]
    async fn metadata_headers() {
        let extra = std::collections::BTreeMap::from([("X-Team".to_owned(), "pay".to_owned())]);
        let m = CallMetadata::new("Kubernetes", &extra, TokenSource::new(None));
        let mut md = MetadataMap::new();
        m.apply(&mut md).await;
        assert_eq!(md.get("clusterid").unwrap(), "Kubernetes");
        assert_eq!(md.get("x-team").unwrap(), "pay");
        assert!(md.get("authorization").is_none());
    }
}
