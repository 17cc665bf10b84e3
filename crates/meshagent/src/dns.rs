//! The DNS proxy on `DNS_PROXY_ADDR` (default `localhost:15053`), Istio's
//! `pkg/dns/client` (`dns.go` `NewLocalDNSServer`/`ServeDNS`, `proxy.go`): names in the NDS
//! table are answered locally (A/AAAA, authoritative, TTL 30), everything else is forwarded to
//! the resolv.conf servers over the client's protocol.
//!
//! | module | does |
//! |---|---|
//! | [`table`] | NDS table → lookup table: Istio's short names, search-domain CNAMEs, wildcards; renders `/debug/ndsz` |
//! | [`handler`] | one request → reply / forward / drop; truncation; RA and EDNS echo; the lean path for lower-case A/AAAA table names |
//! | [`forward`] | upstream exchanges (UDP with a 64 KiB buffer, TCP), sequential or parallel |
//! | [`cache`] | TTL cache of forwarded answers, bounded in bytes (Istio has none) |
//! | [`wire`] | where TTLs and the question are in a message: forwarded replies patched, not re-encoded |
//! | [`server`] | the UDP (recvmmsg batches) and TCP loops |
//! | [`view`] | `/debug/dnsz`: a name explained through the proxy's own lookup; per-upstream counters |
//!
//! Each listen address gets a UDP and a TCP server; all of them run under one supervisor
//! ([`crate::supervise`]): if one dies they are rebound and readiness names the `dns` server
//! until they serve again.

pub mod cache;
pub mod forward;
pub mod handler;
pub mod metrics;
pub mod server;
pub mod table;
pub mod view;
pub mod wire;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ProxyType};
use crate::metrics::Registry;
use crate::supervise;

pub use crate::net::resolv::ResolvConf;
pub use handler::{Core, Proto};
pub use table::{LookupTable, Scope};

/// The decoded NDS resource (`istio.networking.nds.v1.NameTable`).
pub type NameTable = meshagent_proto::nds::NameTable;
pub type NameInfo = meshagent_proto::nds::name_table::NameInfo;
/// The NDS table as the xDS proxy publishes it, already built into the lookup table (which
/// also renders `/debug/ndsz`); `None` until the first push.
pub type NameTableWatch = watch::Receiver<Option<Arc<LookupTable>>>;

/// Decodes an NDS resource and builds the lookup table, then drops the decoded proto and
/// hands what it used back to the OS: of a 5,000-name table the agent keeps ~0.5 MiB instead
/// of ~2.3 MiB of decoded strings and hash map (docs/benchmarks-log.md, DNS proxy). Blocking:
/// milliseconds of CPU for such a table.
pub fn build_table(wire: &[u8], scope: &Scope) -> Result<LookupTable, prost::DecodeError> {
    let nt = NameTable::decode(wire)?;
    let t = LookupTable::build(&nt, scope);
    drop(nt);
    crate::malloc::trim();
    Ok(t)
}

impl Scope {
    /// The proxy's namespace and domain, as Istio's `NewLocalDNSServer` gets them.
    pub fn from_config(cfg: &Config) -> Scope {
        Scope {
            namespace: cfg.pod.namespace.clone(),
            domain: cfg.domain.clone(),
        }
    }
}

/// Istio's one rule (`pkg/istio-agent/agent.go` `initLocalDNSServer`, and the NDS
/// subscription in `xds_proxy.go`): sidecars with `ISTIO_META_DNS_CAPTURE`, or any proxy with
/// `ISTIO_META_ENABLE_DNS_SERVER`.
pub fn enabled(cfg: &Config) -> bool {
    // Never without Envoy (DISABLE_ENVOY: proxyless gRPC resolves through xDS).
    !cfg.lifecycle.disable_envoy
        && ((cfg.dns.capture && cfg.proxy_type == ProxyType::Sidecar) || cfg.dns.enable_server)
}

/// Where root mode (`DNS_PROXY_ADDR` on port 53) reads resolv.conf when the file exists
/// (Istio's `pilot/cmd/pilot-agent/options`: the original pod resolv.conf saved there).
const ROOT_RESOLV_CONF: &str = "/var/lib/istio/resolv.conf";
const DEFAULT_ADDR: &str = "localhost:15053";
/// The opt-in for a listen address that is not loopback ([`DnsError::NonLoopback`]).
pub const ALLOW_NON_LOOPBACK_VAR: &str = "MESHAGENT_DNS_ALLOW_NON_LOOPBACK";

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("the DNS proxy needs its upstream servers: {0}")]
    ResolvConf(#[source] crate::fsio::ReadError),
    #[error(
        "invalid DNS_PROXY_ADDR {value:?}: {reason} (expected host:port, e.g. localhost:15053)"
    )]
    Addr { value: String, reason: String },
    #[error("cannot listen for DNS on {proto} {addr}: {source}")]
    Bind {
        proto: &'static str,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "DNS_PROXY_ADDR {value:?} listens on {addr}, which is not a loopback address: the DNS \
         proxy answers and forwards queries for anyone who can reach it, an amplifier for \
         spoofed queries (expected localhost, 127.0.0.0/8 or ::1; set \
         {ALLOW_NON_LOOPBACK_VAR}=true to listen there anyway)"
    )]
    NonLoopback { value: String, addr: SocketAddr },
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
}

/// Everything the DNS proxy needs; [`Options::from_config`] gives Istio's behaviour.
#[derive(Debug, Clone)]
pub struct Options {
    pub addr: String,
    pub resolv_conf: PathBuf,
    pub parallel: bool,
    pub timeout: Duration,
    pub cache_size: usize,
    /// The cache's byte budget ([`cache::DEFAULT_BYTES`]).
    pub cache_bytes: usize,
    /// Listen on an address that is not loopback (`MESHAGENT_DNS_ALLOW_NON_LOOPBACK`).
    pub allow_non_loopback: bool,
    /// `:53` root mode: forward before the first table instead of SERVFAIL.
    pub forward_before_table: bool,
    /// Where the supervisor reports the servers down.
    pub servers: supervise::Servers,
    /// UDP datagrams read per `recvmmsg(2)` ([`server::UDP_BATCH`]; 1: one `recv` each).
    pub udp_batch: usize,
}

impl Options {
    #[allow(
        clippy::disallowed_methods,
        reason = "computed once at start, before the DNS proxy serves"
    )]
    pub fn from_config(cfg: &Config) -> Options {
        let mut addr = cfg.dns.proxy_addr.clone();
        let mut resolv_conf = cfg.dns.resolv_conf.clone();
        let mut forward_before_table = false;
        if addr.ends_with(":53") {
            if nix::unistd::Uid::effective().is_root() {
                forward_before_table = true;
                let saved = Path::new(ROOT_RESOLV_CONF);
                if resolv_conf == Path::new("/etc/resolv.conf") && saved.exists() {
                    resolv_conf = saved.to_path_buf();
                }
            } else {
                tracing::error!(addr = %addr, "DNS_PROXY_ADDR on port 53 needs root; falling back to {DEFAULT_ADDR}");
                addr = DEFAULT_ADDR.to_owned();
            }
        }
        Options {
            addr,
            resolv_conf,
            parallel: cfg.dns.forward_parallel,
            timeout: cfg.dns.forward_timeout,
            cache_size: cfg.dns.cache_size,
            cache_bytes: cfg.dns.cache_bytes,
            allow_non_loopback: cfg.dns.allow_non_loopback,
            forward_before_table,
            servers: supervise::Servers::new(),
            udp_batch: server::UDP_BATCH,
        }
    }
}

/// The running proxy.
pub struct DnsHandle {
    /// The addresses actually bound (UDP and TCP share each).
    pub addrs: Vec<SocketAddr>,
    pub core: Arc<Core>,
    task: tokio::task::JoinHandle<()>,
}

impl DnsHandle {
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Reads resolv.conf, binds every address (a failure here is a startup error), and serves
/// until `stop`. `tables` is the NDS table feed (built by the xDS proxy's NDS interceptor).
pub async fn start(
    opts: Options,
    registry: &Registry,
    tables: NameTableWatch,
    stop: CancellationToken,
) -> Result<DnsHandle, DnsError> {
    let text = crate::fsio::read(opts.resolv_conf.clone(), 1 << 20, Duration::from_secs(5))
        .await
        .map_err(DnsError::ResolvConf)?;
    let resolv = ResolvConf::parse(&String::from_utf8_lossy(&text));
    let servers = resolv.servers();
    let addrs = listen_addrs(&opts.addr, &resolv)?;
    // What Istio binds by default (`localhost`) is loopback; any other address serves, and
    // forwards for, whoever can reach it: a reflector and amplifier for queries with a
    // spoofed source (a 40-byte query for a large TXT answer returns 100 times its size, and
    // each forwarded one costs the cluster DNS too). Istio (`pkg/dns/client/dns.go`) binds
    // whatever `DNS_PROXY_ADDR` says; here it takes an explicit opt-in.
    if !opts.allow_non_loopback
        && let Some(a) = addrs.iter().find(|a| !a.ip().is_loopback())
    {
        return Err(DnsError::NonLoopback {
            value: opts.addr.clone(),
            addr: *a,
        });
    }
    let mut bound = Vec::new();
    for a in &addrs {
        bound.push(bind(*a).await?);
    }
    let addrs: Vec<SocketAddr> = bound
        .iter()
        .filter_map(|(u, _)| u.local_addr().ok())
        .collect();

    let metrics = metrics::Metrics::new(registry)?;
    let cache = (opts.cache_size > 0 && opts.cache_bytes > 0).then(|| {
        cache::Cache::new(
            cache::Limits {
                entries: opts.cache_size,
                bytes: opts.cache_bytes,
            },
            metrics.cache_hits.clone(),
            metrics.cache_misses.clone(),
            metrics.cache_evictions.clone(),
        )
    });
    // The first search domain, for the derived CNAMEs (`LookupTable::lookup`).
    let search0 = resolv.search.first().map_or(String::new(), |s| {
        let s = s.to_ascii_lowercase();
        if s.ends_with('.') { s } else { format!("{s}.") }
    });
    let core = Arc::new(Core {
        table: tables,
        search0,
        upstreams: servers.clone(),
        parallel: opts.parallel,
        timeout: opts.timeout,
        forward_before_table: opts.forward_before_table,
        cache,
        metrics,
        pool: forward::Pool::default(),
        upstream_stats: view::UpstreamStats::new(&servers),
    });
    tracing::info!(addrs = %crate::logging::list(&addrs), upstreams = %crate::logging::list(&servers), search = %crate::logging::list(&resolv.search), "DNS proxy listening");

    let mut first = Some(bound);
    let serve_core = core.clone();
    let bind_addrs = addrs.clone();
    let udp_batch = opts.udp_batch;
    let task = tokio::spawn(tracing::Instrument::instrument(
        crate::tasks::guarded(
            "dns-server",
            supervise::run(
                "dns",
                opts.servers.clone(),
                supervise::Backoff::default(),
                stop,
                move || {
                    let bound = first.take();
                    let (core, addrs) = (serve_core.clone(), bind_addrs.clone());
                    async move {
                        let bound = match bound {
                            Some(b) => b,
                            None => {
                                let mut v = Vec::new();
                                for a in &addrs {
                                    v.push(bind(*a).await.map_err(|e| e.to_string())?);
                                }
                                v
                            }
                        };
                        let mut loops = Vec::new();
                        for (udp, tcp) in bound {
                            loops.push(futures::FutureExt::boxed(server::serve_udp(
                                Arc::new(udp),
                                core.clone(),
                                udp_batch,
                            )));
                            loops.push(futures::FutureExt::boxed(server::serve_tcp(
                                tcp,
                                core.clone(),
                            )));
                        }
                        Ok(supervise::Serving {
                            serve: Box::pin(async move {
                                futures::future::try_join_all(loops).await.map(|_| ())
                            }),
                            socket: None,
                        })
                    }
                },
            ),
        ),
        tracing::info_span!("task", task = "dns"),
    ));
    Ok(DnsHandle { addrs, core, task })
}

async fn bind(a: SocketAddr) -> Result<(UdpSocket, TcpListener), DnsError> {
    // Port 0 (tests): TCP takes the port UDP got, which a TCP socket may already hold (an
    // outgoing connection's ephemeral port): then another port is drawn, a few times.
    let mut attempts = if a.port() == 0 { 16 } else { 1 };
    loop {
        attempts -= 1;
        let udp = UdpSocket::bind(a).await.map_err(|source| DnsError::Bind {
            proto: "udp",
            addr: a,
            source,
        })?;
        let at = udp.local_addr().unwrap_or(a);
        match TcpListener::bind(at).await {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && attempts > 0 => continue,
            Err(source) => {
                return Err(DnsError::Bind {
                    proto: "tcp",
                    addr: at,
                    source,
                });
            }
        }
    }
}

/// Istio's listen rule: with host `localhost` and servers in resolv.conf, `127.0.0.1` if any
/// is IPv4 and `::1` if any is IPv6; otherwise the address as given (empty host: all).
pub fn listen_addrs(addr: &str, resolv: &ResolvConf) -> Result<Vec<SocketAddr>, DnsError> {
    let bad = |reason: &str| DnsError::Addr {
        value: addr.to_owned(),
        reason: reason.to_owned(),
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let ips: Vec<IpAddr> = match host {
        "localhost" if !resolv.nameservers.is_empty() => {
            let mut v = Vec::new();
            if resolv.has_v4() {
                v.push(Ipv4Addr::LOCALHOST.into());
            }
            if resolv.has_v6() {
                v.push(Ipv6Addr::LOCALHOST.into());
            }
            v
        }
        "localhost" => vec![Ipv4Addr::LOCALHOST.into()],
        "" => vec![Ipv6Addr::UNSPECIFIED.into()],
        h => vec![
            h.parse()
                .map_err(|_| bad("the host is not an IP address or localhost"))?,
        ],
    };
    Ok(ips
        .into_iter()
        .map(|ip| SocketAddr::new(ip, port))
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn listen_rule() {
        let v4 = ResolvConf::parse("nameserver 10.0.0.1\n");
        let both = ResolvConf::parse("nameserver 10.0.0.1\nnameserver fd00::1\n");
        let v6 = ResolvConf::parse("nameserver fd00::1\n");
        let none = ResolvConf::default();
        let s = |v: Vec<SocketAddr>| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        assert_eq!(
            s(listen_addrs("localhost:15053", &v4).unwrap()),
            ["127.0.0.1:15053"]
        );
        assert_eq!(
            s(listen_addrs("localhost:15053", &both).unwrap()),
            ["127.0.0.1:15053", "[::1]:15053"]
        );
        assert_eq!(
            s(listen_addrs("localhost:15053", &v6).unwrap()),
            ["[::1]:15053"]
        );
        assert_eq!(
            s(listen_addrs("localhost:15053", &none).unwrap()),
            ["127.0.0.1:15053"]
        );
        assert_eq!(s(listen_addrs(":53", &v4).unwrap()), ["[::]:53"]);
        assert_eq!(
            s(listen_addrs("127.0.0.2:5353", &v4).unwrap()),
            ["127.0.0.2:5353"]
        );
        let e = listen_addrs("dns.local:53", &v4).unwrap_err().to_string();
        assert!(e.contains("DNS_PROXY_ADDR"), "{e}");
        assert!(listen_addrs("15053", &v4).is_err());
    }
}
