//! Entry points for the cargo-fuzz targets in the root `fuzz/` crate and for the corpus replay test
//! (`tests/fuzz_corpus.rs`), so both exercise exactly the same code.
//!
//! Every function takes arbitrary bytes and must never panic: the inputs model what reaches
//! the agent from the environment, pod files, Envoy, istiod and applications. Where a
//! property stronger than "no panic" holds (the wire peek agrees with a real protobuf decoder;
//! the metrics filter does not depend on how a body is chunked), it is asserted, so a fuzz
//! run also finds wrong answers, not only crashes.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use meshagent_proto::envoy::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use meshagent_proto::envoy::pb::envoy::service::secret::v3::secret_discovery_service_server::SecretDiscoveryService;
use prost::Message;
use tonic::codec::{Codec, Streaming};

use crate::config::{self, MapEnv, ProxyFlags};
use crate::identity::store::{Aliases, SecretData, SecretState, SecretStore, Subscription};
use crate::status::lines::{Seen, SourceFilter};
use crate::xds::wire::{self, Kind, WireError};

/// Files are read relative to this directory while loading; it does not exist, so the
/// mesh config, pod annotations and labels are absent and only the environment varies.
const NO_FILES: &str = "/nonexistent/meshagent-fuzz";

/// Fuzz target `config_env`: the input is an environment, one `NAME=VALUE` per line (lines
/// without `=` are ignored), loaded exactly as the agent's start loads it.
pub fn config_env(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let env = MapEnv::from_pairs(text.lines().filter_map(|l| l.split_once('=')));
    load_and_preflight(&env);
}

/// What a start does with the environment before anything runs: load, then preflight.
fn load_and_preflight(env: &MapEnv) {
    if let Ok(cfg) = config::load(&ProxyFlags::default(), env, Path::new(NO_FILES)) {
        let _ = crate::preflight::plan(&cfg, Path::new(NO_FILES));
    }
}

/// Fuzz target `proxy_config`: the input is the value of `PROXY_CONFIG` (a YAML or JSON
/// ProxyConfig), merged over the defaults and validated as at start.
pub fn proxy_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let env = MapEnv::from_pairs([("PROXY_CONFIG", text)]);
    load_and_preflight(&env);
}

/// Fuzz target `probers`: the input is `ISTIO_KUBE_APP_PROBERS` and, with the status port
/// taken from its first two bytes, `ISTIO_PROMETHEUS_ANNOTATIONS`.
pub fn probers(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(probers) = config::probers::parse_app_probers(text) {
        for p in probers.values() {
            let _ = p.timeout();
        }
    }
    let status_port = match data {
        [a, b, ..] => u16::from_be_bytes([*a, *b]),
        _ => 15020,
    };
    let _ = config::probers::parse_prometheus_annotations(text, status_port);
    let _ = config::probers::parse_prometheus_annotations(text, 15020);
}

/// Fuzz target `xds_wire`: the input is one xDS message as the proxy sees it. It is peeked
/// as each of the four message kinds, and wherever prost (a real decoder) accepts it, the
/// peek must succeed and agree on every field it reports.
pub fn xds_wire(data: &[u8]) {
    for kind in [
        Kind::SotwRequest,
        Kind::SotwResponse,
        Kind::DeltaRequest,
        Kind::DeltaResponse,
    ] {
        let _ = wire::peek(kind, data);
    }
    for number in [2, 3, 4, 5] {
        let _ = wire::repeated_strings(data, number);
    }
    // The peek stops at groups (wire types 3 and 4: proto2 only, absent from xDS), which
    // prost skips; that one difference is by design.
    let groups = |e: &WireError| matches!(e, WireError::WireType(3 | 4));
    if let Ok(req) = DiscoveryRequest::decode(data) {
        match wire::peek(Kind::SotwRequest, data) {
            Ok(p) => {
                assert_eq!(p.type_url, req.type_url, "SotW request type_url");
                assert_eq!(p.nonce, req.response_nonce, "SotW request nonce");
                assert_eq!(p.version, req.version_info, "SotW request version");
                assert_eq!(p.has_error, req.error_detail.is_some(), "SotW error_detail");
            }
            Err(e) => assert!(groups(&e), "prost decodes a DiscoveryRequest, peek: {e}"),
        }
        if let Ok(names) = wire::repeated_strings(data, 3) {
            assert_eq!(names, req.resource_names, "SotW resource_names");
        }
    }
    if let Ok(req) = DeltaDiscoveryRequest::decode(data) {
        match wire::peek(Kind::DeltaRequest, data) {
            Ok(p) => {
                assert_eq!(p.type_url, req.type_url, "Delta request type_url");
                assert_eq!(p.nonce, req.response_nonce, "Delta request nonce");
                assert_eq!(
                    p.has_error,
                    req.error_detail.is_some(),
                    "Delta error_detail"
                );
            }
            Err(e) => assert!(
                groups(&e),
                "prost decodes a DeltaDiscoveryRequest, peek: {e}"
            ),
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    // A current-thread runtime, as the agent runs; building one cannot fail without I/O
    // drivers enabled.
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("current-thread runtime: {e}"))
}

/// Fuzz target `xds_framing`: the input is the HTTP/2 request body of a downstream ADS
/// stream (gRPC length-prefixed frames), read by the very reader the proxy uses
/// (`xds::reader::MessageReader::request`), and every message is peeked.
pub fn xds_framing(data: &[u8]) {
    let body = http_body_util::Full::new(Bytes::copy_from_slice(data));
    runtime().block_on(async {
        let mut stream = crate::xds::reader::MessageReader::request(
            tonic::body::Body::new(body),
            crate::xds::DEFAULT_MAX_RECV_MSG_SIZE,
        );
        while let Ok(Some(msg)) = stream.message().await {
            let _ = wire::peek(Kind::SotwRequest, &msg);
            let _ = wire::peek(Kind::DeltaRequest, &msg);
        }
    });
}

/// A file resource that failed to load; streams asking for it must end with its error.
const FAILING: &str = "file-root:/nonexistent/meshagent-fuzz/root.pem";

fn sds_store() -> (Arc<SecretStore>, Subscription) {
    let (store, _file_requests) = SecretStore::new(Aliases::default());
    store.set(
        "default",
        SecretState::Ready(Arc::new(SecretData::Cert {
            chain: "-----BEGIN CERTIFICATE-----\n".into(),
            key: "-----BEGIN PRIVATE KEY-----\n".into(),
        })),
    );
    store.set(
        "ROOTCA",
        SecretState::Ready(Arc::new(SecretData::Root {
            pem: "-----BEGIN CERTIFICATE-----\n".into(),
            crl: None,
        })),
    );
    // Only a subscribed file resource can hold a state.
    let failing = store.subscribe(FAILING);
    store.set(FAILING, SecretState::Failed("no such file".into()));
    (store, failing)
}

/// Fuzz target `sds`: the input is the request body of an SDS stream. The first byte picks
/// SotW or Delta; the rest is gRPC-framed `DiscoveryRequest`s (or `DeltaDiscoveryRequest`s)
/// fed to the real [`SdsService`](crate::identity::sds::SdsService) over a store holding `default`,
/// `ROOTCA` and one failed file resource ([`FAILING`]) (file resources stay pending: nothing loads files here).
/// Every response is drained until the service ends the stream. Bit 1 of the mode byte reads
/// the requests as the agent's SDS server does (the body taken out of tonic's way,
/// `xds::reader::TakeRequestBody`), unset through tonic's `Streaming`.
pub fn sds(data: &[u8]) {
    let Some((&mode, body)) = data.split_first() else {
        return;
    };
    let body = tonic::body::Body::new(http_body_util::Full::new(Bytes::copy_from_slice(body)));
    let (body, taken) = if mode & 2 == 0 {
        (body, None)
    } else {
        (
            tonic::body::Body::empty(),
            Some(crate::xds::reader::TakenBody::new(body)),
        )
    };
    fn request<T>(inbound: T, taken: &Option<crate::xds::reader::TakenBody>) -> tonic::Request<T> {
        let mut r = tonic::Request::new(inbound);
        if let Some(t) = taken.clone() {
            r.extensions_mut().insert(t);
        }
        r
    }
    let (store, _failing) = sds_store();
    let service = crate::identity::sds::SdsService::new(store, Default::default());
    runtime().block_on(async move {
        if mode & 1 == 0 {
            let mut codec =
                tonic_prost::ProstCodec::<DiscoveryResponse, DiscoveryRequest>::default();
            let inbound = Streaming::new_request(codec.decoder(), body, None, Some(1 << 20));
            if let Ok(resp) = service.stream_secrets(request(inbound, &taken)).await {
                let mut out = resp.into_inner();
                while out.next().await.is_some() {}
            }
        } else {
            let mut codec =
                tonic_prost::ProstCodec::<DeltaDiscoveryResponse, DeltaDiscoveryRequest>::default();
            let inbound = Streaming::new_request(codec.decoder(), body, None, Some(1 << 20));
            if let Ok(resp) = service.delta_secrets(request(inbound, &taken)).await {
                let mut out = resp.into_inner();
                while out.next().await.is_some() {}
            }
        }
    });
}

/// Fuzz target `metrics_dedupe`: the input is up to four exposition bodies separated by NUL
/// bytes (the agent's, Envoy's, applications'), merged by the filter of `/stats/prometheus`.
/// The first byte picks a chunk size; the output must be the same whether each body arrives
/// in one piece or in chunks of that size, and every output line must be an input line.
pub fn metrics_dedupe(data: &[u8]) {
    let Some((&seed, rest)) = data.split_first() else {
        return;
    };
    let sources: Vec<&[u8]> = rest.splitn(4, |b| *b == 0).collect();
    let run = |chunk: usize, abort_last: bool| -> Vec<u8> {
        let mut seen = Seen::default();
        let mut ready = Vec::new();
        for (i, s) in sources.iter().enumerate() {
            let mut f = SourceFilter::default();
            for c in s.chunks(chunk.max(1)) {
                f.push(&mut seen, c, &mut ready);
            }
            if abort_last && i + 1 == sources.len() {
                f.abort(&mut ready);
            } else {
                f.finish(&mut seen, &mut ready);
            }
        }
        ready.concat()
    };
    let whole = run(usize::MAX, false);
    // Lines longer than MAX_LINE are dropped only when they span chunks; inputs that small
    // are all a fuzzer produces, and the property holds for them.
    if rest.len() < crate::status::lines::MAX_LINE {
        let chunked = run(usize::from(seed % 32) + 1, false);
        assert_eq!(
            String::from_utf8_lossy(&whole),
            String::from_utf8_lossy(&chunked),
            "output depends on chunking"
        );
    }
    let input_lines: std::collections::HashSet<&[u8]> = sources
        .iter()
        .flat_map(|s| s.split(|b| *b == b'\n'))
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
        .collect();
    if !whole.is_empty() {
        assert_eq!(whole.last(), Some(&b'\n'), "output ends mid-line");
    }
    for line in whole.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        assert!(
            input_lines.contains(line),
            "output line not in the input: {:?}",
            String::from_utf8_lossy(line)
        );
    }
    let _ = run(usize::from(seed % 7) + 1, true);
}

/// A DNS query for `name`/`ty` (ID 0x1234, RD set as stub resolvers do), with an OPT of
/// `edns` bytes if given: the requests of the DNS unit and end-to-end tests.
///
/// # Panics
/// On a name hickory cannot parse (test input).
#[allow(clippy::unwrap_used)]
pub fn dns_query(name: &str, ty: hickory_proto::rr::RecordType, edns: Option<u16>) -> Vec<u8> {
    use hickory_proto::op::{Edns, Message, Query};
    let mut m = Message::query();
    m.metadata.id = 0x1234;
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(
        hickory_proto::rr::Name::from_ascii(name).unwrap(),
        ty,
    ));
    if let Some(size) = edns {
        let mut e = Edns::new();
        e.set_max_payload(size);
        m.set_edns(e);
    }
    m.to_vec().unwrap()
}

/// The DNS proxy's table for [`dns_request`]: every shape (short names, CNAME expansions, a
/// wildcard, 40 addresses).
pub(crate) fn dns_core() -> &'static crate::dns::handler::Core {
    use crate::dns::{LookupTable, NameInfo, NameTable, Scope};
    static CORE: std::sync::OnceLock<crate::dns::handler::Core> = std::sync::OnceLock::new();
    CORE.get_or_init(|| {
        let mut nt = NameTable::default();
        let mut add = |h: &str, reg: &str, ips: Vec<String>| {
            nt.table.insert(
                h.into(),
                NameInfo {
                    ips,
                    registry: reg.into(),
                    shortname: h.split('.').next().unwrap_or_default().into(),
                    namespace: "default".into(),
                    alt_hosts: vec!["alt.example".into()],
                },
            );
        };
        add(
            "a.default.svc.cluster.local",
            "Kubernetes",
            vec!["10.0.0.1".into(), "fd00::1".into()],
        );
        add("*.wild.example.com", "External", vec!["240.240.0.9".into()]);
        add(
            "big.example.com",
            "External",
            (1..=40).map(|i| format!("10.1.0.{i}")).collect(),
        );
        let scope = Scope {
            namespace: "default".into(),
            domain: "default.svc.cluster.local".into(),
        };
        let table = LookupTable::build(&nt, &scope);
        let (tx, rx) = tokio::sync::watch::channel(Some(Arc::new(table)));
        // The table never changes: the sender lives as long as the process.
        std::mem::forget(tx);
        crate::dns::handler::Core {
            table: rx,
            search0: "default.svc.cluster.local.".into(),
            upstreams: vec![],
            parallel: false,
            timeout: std::time::Duration::from_secs(1),
            forward_before_table: false,
            cache: None,
            pool: Default::default(),
            upstream_stats: Default::default(),
            metrics: crate::dns::metrics::Metrics::new(&crate::metrics::Registry::new())
                .unwrap_or_else(|e| panic!("DNS metrics: {e}")),
        }
    })
}

/// Fuzz target `dns_request`: one DNS packet through the proxy's request path
/// (`Core::handle`) as UDP and as TCP. A reply must carry the request's ID and QR, and more
/// than 512 bytes over UDP only for a client that sent an OPT record. Forwarding needs I/O and
/// is not taken here (the decision to forward is).
pub fn dns_request(data: &[u8]) {
    use crate::dns::handler::{Action, Proto};
    for proto in [Proto::Udp, Proto::Tcp] {
        dns_paths_agree(dns_core(), data, proto);
        if let Action::Reply(b) = dns_core().handle(data, proto) {
            assert!(b.len() >= 12);
            assert_eq!(b[..2], data[..2], "reply ID");
            assert!(b[2] & 0x80 != 0, "QR set on every reply");
            if proto == Proto::Udp && b.len() > 512 {
                assert!(
                    data.len() > 12 && data[10..12] != [0, 0],
                    "large reply without OPT"
                );
            }
        }
    }
}

/// When the lean path (`Core::answer_table`) answers `data`, the general path
/// (`Core::handle_general`, a whole hickory `Message`) answers it with the same bytes up to
/// the order of the answer records, which both shuffle (and, when truncated, which of them
/// are kept).
pub fn dns_paths_agree(core: &crate::dns::handler::Core, data: &[u8], proto: crate::dns::Proto) {
    use crate::dns::handler::Action;
    let mut lean = Vec::new();
    if !core.answer_table(data, proto, &mut lean) {
        return;
    }
    let Action::Reply(general) = core.handle_general(data, proto) else {
        panic!("the lean path answered a request the general path does not answer");
    };
    assert_eq!(
        lean.len(),
        general.len(),
        "reply sizes\nlean    {lean:?}\ngeneral {general:?}"
    );
    assert_eq!(lean[..12], general[..12], "headers");
    let an = usize::from(u16::from_be_bytes([lean[6], lean[7]]));
    let opt = if lean[11] == 1 { 11 } else { 0 };
    let end = lean.len() - opt;
    assert_eq!(lean[end..], general[end..], "OPT");
    if an == 0 {
        assert_eq!(lean, general);
        return;
    }
    // Every answer is the same size (a pointer owner, one address); the question is what
    // precedes them.
    let decoded = hickory_proto::op::Message::from_vec(&lean)
        .unwrap_or_else(|e| panic!("the lean path's reply does not decode: {e}"));
    let rr = match decoded.queries.first().map(|q| q.query_type()) {
        Some(hickory_proto::rr::RecordType::A) => 16,
        _ => 28,
    };
    let base = end - an * rr;
    assert_eq!(lean[..base], general[..base], "header and question");
    let chunks = |b: &[u8]| {
        let mut v: Vec<Vec<u8>> = b[base..end].chunks(rr).map(<[u8]>::to_vec).collect();
        v.sort();
        v
    };
    let (l, g) = (chunks(&lean), chunks(&general));
    if lean[2] & 0x02 == 0 {
        assert_eq!(l, g, "answers");
    } else {
        // Truncated: a random subset each; the same record shape.
        assert!(l.iter().chain(&g).all(|c| c[..12] == g[0][..12]), "answers");
    }
}

/// A fuzz entry point.
pub type Target = fn(&[u8]);

/// Every fuzz target by name, for the corpus replay test.
pub const TARGETS: &[(&str, Target)] = &[
    ("config_env", config_env),
    ("proxy_config", proxy_config),
    ("probers", probers),
    ("xds_wire", xds_wire),
    ("xds_framing", xds_framing),
    ("sds", sds),
    ("metrics_dedupe", metrics_dedupe),
    ("dns_request", dns_request),
    ("nft_render", nft_render),
    ("xds_authority", xds_authority),
];

/// How [`nft_render_checked`] uses the real `nft`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NftCheck {
    /// The structural checks only.
    Off,
    /// Also `nft -c -f -` in a fresh network namespace, when this runs as root and `nft` and
    /// `unshare` are installed (the cargo-fuzz target).
    IfAvailable,
    /// Also `nft -c -f -`; not being able to run it is a failure (the corpus replay and
    /// property tests under `make test`, which run as root with nft installed).
    Required,
}

/// What [`nft_render_checked`] did with one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NftRender {
    /// The configuration was refused (this message) before any rule text existed.
    Rejected(String),
    /// Rendered and checked; `nft_checked` tells whether `nft -c` loaded it.
    Rendered { text: String, nft_checked: bool },
}

/// Decodes `\n`, `\t`, `\r`, `\0` and `\\` so a one-line entry can carry control bytes.
fn unescape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    let mut chars = v.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('0') => out.push('\0'),
            Some(o) => out.push(o),
            None => out.push('\\'),
        }
    }
    out
}

/// The configuration an `nft_render` input describes, validated as the command validates it.
///
/// One entry a line: `-f value` or `--flag=value` is a command-line flag (value after the
/// first space), `NAME=value` an environment variable, and `@` lines set what the command
/// gathers or what code may set directly, bypassing the flag parser: `@ipv6`, `@dns4 A`,
/// `@dns6 A` (resolv.conf servers), `@uid X`, `@gid X`, `@nic X`, `@kvi X`, `@grp+ X`,
/// `@grp- X`. Values take `\n`-style escapes.
pub fn nft_render_config(data: &[u8]) -> Result<crate::iptables::config::Config, String> {
    use crate::iptables::config::{Config, OwnerGroups};
    let text = String::from_utf8_lossy(data);
    let mut args: Vec<String> = Vec::new();
    let mut env: Vec<(String, String)> = Vec::new();
    let mut direct: Vec<(String, String)> = Vec::new();
    let (mut ipv6, mut dns4, mut dns6) = (false, Vec::new(), Vec::new());
    for line in text.lines().take(256) {
        if let Some(rest) = line.strip_prefix('@') {
            let (k, v) = rest.split_once(' ').unwrap_or((rest, ""));
            let v = unescape(v);
            match k {
                "ipv6" => ipv6 = true,
                "dns4" => dns4.push(v),
                "dns6" => dns6.push(v),
                _ => direct.push((k.to_owned(), v)),
            }
        } else if line.starts_with('-') {
            match line.split_once(' ') {
                Some((flag, v)) => {
                    args.push(flag.to_owned());
                    args.push(unescape(v));
                }
                None => args.push(unescape(line)),
            }
        } else if let Some((k, v)) = line.split_once('=') {
            env.push((k.to_owned(), unescape(v)));
        }
    }
    let env = MapEnv::from_pairs(env);
    let mut cfg = Config::from_args(&args, &env).map_err(|e| e.to_string())?;
    cfg.enable_ipv6 = ipv6;
    cfg.dns_servers_v4 = dns4;
    cfg.dns_servers_v6 = dns6;
    for (k, v) in direct {
        match k.as_str() {
            "uid" => cfg.proxy_uid.push(v),
            "gid" => cfg.proxy_gid.push(v),
            "nic" => cfg.exclude_interfaces.push(v),
            "kvi" => cfg.kube_virt_interfaces.push(v),
            "grp+" => match &mut cfg.owner_groups {
                OwnerGroups::Include(g) => g.push(v),
                other => *other = OwnerGroups::Include(vec![v]),
            },
            "grp-" => match &mut cfg.owner_groups {
                OwnerGroups::Exclude(g) => g.push(v),
                other => *other = OwnerGroups::Exclude(vec![v]),
            },
            _ => {}
        }
    }
    cfg.validate().map_err(|e| e.to_string())?;
    // A name nft could not resolve would fail `nft -c` as it fails the real apply.
    cfg.resolve_owners().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// Fuzz target `nft_render`: an arbitrary configuration (see [`nft_render_config`]) is
/// validated, rendered as the native nftables transaction, and the text checked: every rule
/// keeps its verdict and every value stays one token ([`check_nft_text`]), and — with root
/// and nft installed — `nft -c -f -` in a fresh network namespace accepts it.
pub fn nft_render(data: &[u8]) {
    let _ = nft_render_checked(data, NftCheck::IfAvailable);
}

/// [`nft_render`] with the `nft -c` policy explicit; panics (the fuzz finding) on a broken
/// property, returns what happened otherwise.
pub fn nft_render_checked(data: &[u8], check: NftCheck) -> NftRender {
    let cfg = match nft_render_config(data) {
        Ok(c) => c,
        Err(e) => return NftRender::Rejected(e),
    };
    let text = crate::iptables::nft::build(&cfg);
    if let Err(e) = check_nft_text(&cfg, &text) {
        panic!("rendered nft text breaks a rule: {e}\n--- text ---\n{text}");
    }
    if let Err(e) = check_iptables_args(&cfg) {
        panic!("iptables rule text: {e}");
    }
    let run = match check {
        NftCheck::Off => false,
        NftCheck::Required => true,
        NftCheck::IfAvailable => {
            nix::unistd::geteuid().is_root()
                && crate::iptables::apply::in_path("nft").is_some()
                && crate::iptables::apply::in_path("unshare").is_some()
        }
    };
    if run && let Err(e) = nft_load_check(&text) {
        panic!("nft -c -f - rejects the rendered text: {e}\n--- text ---\n{text}");
    }
    NftRender::Rendered {
        text,
        nft_checked: run,
    }
}

/// Every iptables argument from a validated config is one iptables-restore token: no
/// whitespace, quotes or backslash (its quoting), nothing non-printable.
fn check_iptables_args(cfg: &crate::iptables::config::Config) -> Result<(), String> {
    let rules = crate::iptables::rules::build(cfg);
    for r in rules.v4.iter().chain(&rules.v6) {
        for a in &r.args {
            let bad = a.is_empty()
                || a.bytes()
                    .any(|b| !b.is_ascii_graphic() || matches!(b, b'"' | b'\'' | b'\\'));
            if bad {
                return Err(format!("argument {a:?} of {:?}", r.line()));
            }
        }
        if r.target().is_none() {
            return Err(format!("rule without a target: {:?}", r.line()));
        }
    }
    Ok(())
}

/// A token of an nft rule line: quoted (the text between the quotes) or bare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NftToken<'a> {
    quoted: bool,
    text: &'a str,
}

/// Splits a rule line as nft's scanner would, refusing anything that could end a token or
/// the statement early: outside quotes only `[A-Za-z0-9_.:/,!=-{}]`; quotes closed on the line.
fn nft_tokens(line: &str) -> Result<Vec<NftToken<'_>>, String> {
    let mut out = Vec::new();
    let mut rest = line;
    loop {
        rest = rest.trim_start_matches(' ');
        if rest.is_empty() {
            return Ok(out);
        }
        if let Some(q) = rest.strip_prefix('"') {
            let end = q
                .find('"')
                .ok_or_else(|| format!("unterminated quote in {line:?}"))?;
            let text = &q[..end];
            if text.is_empty() || text.chars().any(char::is_control) {
                return Err(format!("quoted value {text:?} in {line:?}"));
            }
            rest = &q[end + 1..];
            if !rest.is_empty() && !rest.starts_with(' ') {
                return Err(format!("text glued to a quoted value in {line:?}"));
            }
            out.push(NftToken { quoted: true, text });
        } else {
            let end = rest.find(' ').unwrap_or(rest.len());
            let text = &rest[..end];
            if let Some(c) = text
                .chars()
                .find(|c| !(c.is_ascii_alphanumeric() || "_.:/,!=-{}".contains(*c)))
            {
                return Err(format!("{c:?} outside quotes in {line:?}"));
            }
            rest = &rest[end..];
            out.push(NftToken {
                quoted: false,
                text,
            });
        }
    }
}

/// The statement a rule ends in, after its one `counter`: a verdict or a packet edit.
fn nft_terminal(tail: &[&str]) -> bool {
    let chains = [
        "istio-inbound",
        "istio-redirect",
        "istio-in-redirect",
        "istio-output",
        "istio-output-dns",
        "istio-divert",
        "istio-tproxy",
        "istio-drop",
    ];
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match tail {
        ["return" | "accept" | "drop"] => true,
        ["jump", c] => chains.contains(c),
        ["redirect", "to", p] => p.strip_prefix(':').is_some_and(number),
        ["meta", "mark", "set", n] | ["ct", "zone", "set", n] => number(n),
        ["meta", "mark", "set", "ct", "mark"] | ["ct", "mark", "set", "mark"] => true,
        _ => false,
    }
}

/// Structural check of a rendered transaction (the property the `nft_render` target
/// asserts): only the statements the renderer writes; each rule one line with exactly one
/// `counter` followed by its verdict (or packet edit); no `#`, `;` or quote outside a quoted
/// value; every interface, uid and gid a single token, every configured value present in
/// its rule with the rule's verdict intact.
pub fn check_nft_text(cfg: &crate::iptables::config::Config, text: &str) -> Result<(), String> {
    use crate::iptables::config::OwnerGroups;
    use crate::iptables::nft::{NftTable, ifname, owner};
    let tables: Vec<&str> = NftTable::ALL.iter().map(|t| t.name()).collect();
    let mut expected: Vec<String> = Vec::new();
    expected.extend(cfg.exclude_interfaces.iter().map(|n| ifname(n)));
    expected.extend(cfg.kube_virt_interfaces.iter().map(|n| ifname(n)));
    expected.extend(cfg.proxy_uid.iter().chain(&cfg.proxy_gid).map(|i| owner(i)));
    if let OwnerGroups::Include(g) | OwnerGroups::Exclude(g) = &cfg.owner_groups {
        expected.extend(g.iter().map(|i| owner(i)));
    }
    let mut rule_lines = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line.split(' ').collect();
        match words.as_slice() {
            [] | [""] => {}
            ["add" | "flush", "table", "inet", t] if tables.contains(t) => {}
            ["add", "chain", "inet", t, _chain] if tables.contains(t) => {}
            [
                "add",
                "chain",
                "inet",
                t,
                _,
                "{",
                "type",
                _,
                "hook",
                _,
                "priority",
                _,
                ";",
                "}",
            ] if tables.contains(t) => {}
            ["add", "rule", "inet", t, chain, ..] if tables.contains(t) => {
                let body = line
                    .split_once(&format!("{t} {chain} "))
                    .map(|(_, b)| b)
                    .ok_or_else(|| format!("empty rule {line:?}"))?;
                rule_lines.push((line, body));
            }
            ["insert", "rule", "inet", t, chain, "index", i, ..]
                if tables.contains(t) && i.bytes().all(|b| b.is_ascii_digit()) =>
            {
                let body = line
                    .split_once(&format!("{t} {chain} index {i} "))
                    .map(|(_, b)| b)
                    .ok_or_else(|| format!("empty rule {line:?}"))?;
                rule_lines.push((line, body));
            }
            _ => return Err(format!("unexpected line {line:?}")),
        }
    }
    for (line, body) in &rule_lines {
        let toks = nft_tokens(body)?;
        let counters: Vec<usize> = toks
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.quoted && t.text == "counter")
            .map(|(i, _)| i)
            .collect();
        let [at] = counters.as_slice() else {
            return Err(format!("{} counters in {line:?}", counters.len()));
        };
        let tail: Vec<&str> = toks[at + 1..].iter().map(|t| t.text).collect();
        if toks[at + 1..].iter().any(|t| t.quoted) || !nft_terminal(&tail) {
            return Err(format!("rule does not end in its verdict: {line:?}"));
        }
        let opens = toks.iter().filter(|t| !t.quoted && t.text == "{").count();
        let closes = toks.iter().filter(|t| !t.quoted && t.text == "}").count();
        if opens != closes
            || toks
                .iter()
                .any(|t| !t.quoted && t.text.len() > 1 && t.text.contains(['{', '}']))
        {
            return Err(format!("unbalanced set braces in {line:?}"));
        }
        for (i, t) in toks.iter().enumerate() {
            if t.quoted {
                let shown = format!("\"{}\"", t.text);
                if !expected.contains(&shown) {
                    return Err(format!(
                        "quoted value {shown} in {line:?} is no configured value"
                    ));
                }
                continue;
            }
            match t.text {
                "skuid" | "skgid" => {
                    let mut v = toks.get(i + 1);
                    if v.is_some_and(|v| !v.quoted && v.text == "!=") {
                        v = toks.get(i + 2);
                    }
                    // Quoted, a number or range, or a plain name written bare as Istio does.
                    let ok = v.is_some_and(|v| {
                        v.quoted
                            || expected.iter().any(|e| e == v.text)
                            || crate::iptables::config::OwnerId::parse(v.text).is_some_and(|o| {
                                !matches!(o, crate::iptables::config::OwnerId::Name(_))
                            })
                    });
                    if !ok {
                        return Err(format!("{} without one id token in {line:?}", t.text));
                    }
                }
                "iifname" | "oifname" => {
                    let ok = toks.get(i + 1).is_some_and(|v| {
                        v.quoted || v.text == "lo" || expected.iter().any(|e| e == v.text)
                    });
                    if !ok {
                        return Err(format!("{} without one name token in {line:?}", t.text));
                    }
                }
                _ => {}
            }
        }
    }
    // Each configured value keeps the rule that uses it, verdict included.
    let has = |want: &str| rule_lines.iter().any(|(l, _)| l.ends_with(want));
    let nat = "istio-proxy-nat";
    for n in cfg.exclude_interfaces.iter().map(|n| ifname(n)) {
        for want in [
            format!("{nat} prerouting iifname {n} counter return"),
            format!("{nat} output oifname {n} counter return"),
        ] {
            if !has(&want) {
                return Err(format!("missing rule `{want}`"));
            }
        }
    }
    for n in cfg.kube_virt_interfaces.iter().map(|n| ifname(n)) {
        if !rule_lines.iter().any(|(l, b)| {
            l.contains(&format!("{nat} prerouting ")) && *b == format!("iifname {n} counter return")
        }) {
            return Err(format!("missing kube-virt return for {n}"));
        }
    }
    for (key, ids) in [("skuid", &cfg.proxy_uid), ("skgid", &cfg.proxy_gid)] {
        for id in ids.iter().map(|i| owner(i)) {
            let want = format!("{nat} istio-output {key} {id} counter return");
            if !has(&want) {
                return Err(format!("missing rule `{want}`"));
            }
        }
    }
    Ok(())
}

/// Runs `nft -c -f -` on `text` in a new network namespace (`nft -c` needs CAP_NET_ADMIN and
/// talks to the kernel, which must not see the host's tables), with a deadline.
#[allow(
    clippy::disallowed_types,
    clippy::disallowed_methods,
    reason = "synchronous check outside any Tokio runtime"
)]
pub fn nft_load_check(text: &str) -> Result<(), String> {
    use std::io::{Read, Write};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let mut child = Command::new("unshare")
        .args(["--net", "--", "nft", "-c", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run unshare --net nft: {e}"))?;
    let mut stderr = child.stderr.take();
    // nft reads all of stdin before it parses, so the write cannot wait on its output; the
    // error text is read on a thread so a long one cannot block it either.
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        if let Some(e) = stderr.as_mut() {
            let _ = e.take(64 * 1024).read_to_string(&mut s);
        }
        s
    });
    // Dropping stdin closes it, so nft sees the end of its input. A failed write (nft gone
    // early) is reported after the child is reaped.
    let written = child
        .stdin
        .take()
        .map(|mut stdin| stdin.write_all(text.as_bytes()));
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err("nft -c did not finish within 30 s".into());
            }
            Err(e) => return Err(format!("waiting for nft: {e}")),
        }
    };
    let err = reader.join().unwrap_or_default();
    if let Some(Err(e)) = written {
        return Err(format!("writing to nft ({status}): {e}: {err}"));
    }
    if status.success() {
        Ok(())
    } else {
        Err(format!("nft -c exited with {status}: {err}"))
    }
}

/// Fuzz target `xds_authority`: the input is what a local client writes to the xDS socket
/// (the HTTP/2 preface is added when missing), through the `:authority` shim
/// ([`crate::xds::authority`]) that HPACK-decodes every header block with a bounded table.
/// It must never panic: malformed input is an error that closes the connection.
pub fn xds_authority(data: &[u8]) {
    let _ = crate::xds::authority::rewrite_bytes(data);
}
