//! Shared setup for the xDS proxy end-to-end tests: devplane (stand-in istiod), the agent's
//! xDS proxy in-process in a temp dir, and a real Envoy whose `xds-grpc` cluster is the
//! agent's socket.
#![allow(clippy::unwrap_used, dead_code)] // tests fail loudly by design

use std::path::Path;
use std::time::Duration;

use meshagent::config::{self, MapEnv, ProxyFlags};
use meshagent::metrics::Registry;
use meshagent::xds::{self, XdsProxyHandle};
use meshagent_testkit::static_sds::StaticSds;
use meshagent_testkit::{
    DEADLINE, Devplane, Envoy, TwoWorkloads, Value, add_sds_cluster, json, wait_for,
};
use tokio_util::sync::CancellationToken;

/// A two-workload mesh on free ports; `extra` adds service `c`.
pub fn mesh_yaml(extra: bool) -> String {
    TwoWorkloads::new().yaml(extra)
}

/// The agent's xDS proxy running in-process, with its own cwd.
pub struct Agent {
    pub handle: XdsProxyHandle,
    pub registry: Registry,
    pub shutdown: CancellationToken,
    pub token: String,
}

impl Agent {
    /// Starts the proxy in `cwd` against `discovery` with the env a pod would have, plus
    /// `extra_env`. The token (if any) is written where Istio mounts it.
    pub fn start(
        cwd: &Path,
        discovery: &str,
        token: Option<&str>,
        extra_env: &[(&str, &str)],
    ) -> Agent {
        Agent::start_with(cwd, discovery, token, extra_env, |_| {})
    }

    /// [`Agent::start`] with the proxy's options adjusted by `tweak` (e.g. extra interceptors).
    pub fn start_with(
        cwd: &Path,
        discovery: &str,
        token: Option<&str>,
        extra_env: &[(&str, &str)],
        tweak: impl FnOnce(&mut xds::XdsOptions),
    ) -> Agent {
        if let Some(t) = token {
            let p = cwd.join("var/run/secrets/tokens/istio-token");
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, t).unwrap();
        }
        let mut env = vec![
            ("POD_NAME".to_owned(), "a-5f7d".to_owned()),
            ("POD_NAMESPACE".to_owned(), "default".to_owned()),
            (
                "PROXY_CONFIG".to_owned(),
                format!("discoveryAddress: {discovery}\n"),
            ),
            ("ISTIO_META_CLUSTER_ID".to_owned(), "Kubernetes".to_owned()),
            ("XDS_HEADER_TEAM".to_owned(), "payments".to_owned()),
            ("XDS_HEADER_X-TRACE-TAG".to_owned(), "e2e".to_owned()),
        ];
        env.extend(
            extra_env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        let cfg = config::load(&ProxyFlags::default(), &MapEnv::from_pairs(env), cwd).unwrap();
        let registry = Registry::new();
        let shutdown = CancellationToken::new();
        let mut opts = xds::XdsOptions::from_config(&cfg, cwd).unwrap();
        tweak(&mut opts);
        let handle = xds::start_with(opts, cwd, &registry, shutdown.clone()).unwrap();
        Agent {
            handle,
            registry,
            shutdown,
            token: token.unwrap_or_default().to_owned(),
        }
    }

    /// A metric's value from the registry's Prometheus text (0 if absent).
    pub fn metric(&self, series: &str) -> f64 {
        self.registry
            .encode()
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0.0)
    }
}

/// Starts the agent against devplane's TLS port, with a devplane token for `default/a`.
pub async fn agent_for(dp: &Devplane, cwd: &Path, extra_env: &[(&str, &str)]) -> Agent {
    agent_for_with(dp, cwd, extra_env, |_| {}).await
}

/// [`agent_for`] with the proxy's options adjusted by `tweak`.
pub async fn agent_for_with(
    dp: &Devplane,
    cwd: &Path,
    extra_env: &[(&str, &str)],
    tweak: impl FnOnce(&mut xds::XdsOptions),
) -> Agent {
    let token = dp.token("default", "a", 3600).await;
    let root = dp.root_cert_path();
    let mut env = vec![("XDS_ROOT_CA", root.to_str().unwrap())];
    env.extend_from_slice(extra_env);
    Agent::start_with(cwd, &dp.grpc_addr.to_string(), Some(&token), &env, tweak)
}

/// A real Envoy whose `xds-grpc` is the agent's socket, once it has devplane's config. Its
/// `sds-grpc` is a static SDS server with a devplane-issued certificate for `default/a`, so
/// TLS clusters and listeners warm (the agent's own SDS is another module); keep it alive.
pub async fn envoy_through(
    dp: &Devplane,
    agent: &Agent,
    dir: &Path,
    delta: bool,
) -> (Envoy, StaticSds) {
    let sds = StaticSds::from_devplane(dp, &agent.token, dir).await;
    let envoy = Envoy::start(
        bootstrap(agent.handle.socket(), delta, Some(&sds.socket)),
        dir,
    );
    converged(&envoy).await;
    (envoy, sds)
}

pub const NODE_ID: &str = "sidecar~127.0.0.1~a-5f7d.default~default.svc.cluster.local";

/// Istio's bootstrap shape for ADS: `xds-grpc` is the agent's unix socket, plaintext h2.
pub fn bootstrap(xds_socket: &Path, delta: bool, sds: Option<&Path>) -> Value {
    let mut b = json!({
        "node": {"id": NODE_ID, "cluster": "a.default",
                 "metadata": {"NAMESPACE": "default", "NAME": "a-5f7d", "CLUSTER_ID": "Kubernetes"}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": if delta { "DELTA_GRPC" } else { "GRPC" },
                "transport_api_version": "V3",
                "set_node_on_first_message_only": true,
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"},
            "lds_config": {"ads": {}, "resource_api_version": "V3", "initial_fetch_timeout": "0s"}
        },
        "static_resources": {"clusters": [{
            "name": "xds-grpc",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"pipe": {"path": xds_socket.to_string_lossy()}}
            }}]}]},
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }}
        }]}
    });
    if let Some(s) = sds {
        add_sds_cluster(&mut b, s);
    }
    b
}

/// devplane's view of the agent's upstream stream (the one carrying Envoy's node).
pub async fn client_for(dp: &Devplane, api: &str) -> Value {
    wait_for("the proxied ADS stream at devplane", DEADLINE, || async {
        dp.clients()
            .await
            .into_iter()
            .find(|c| c["api"] == api && c["node_id"].as_str().is_some())
    })
    .await
}

/// Waits until Envoy has devplane's clusters and both listeners of workload `a`.
pub async fn converged(envoy: &Envoy) {
    let want = ["inbound|", "outbound|80||b.default.svc.cluster.local"];
    wait_for("devplane's clusters in Envoy", DEADLINE, || async {
        let c = envoy.clusters().await;
        want.iter()
            .all(|w| c.iter().any(|n| n.starts_with(w)))
            .then_some(())
    })
    .await;
    wait_for("two listeners in Envoy", DEADLINE, || async {
        (envoy.listeners().await.len() == 2).then_some(())
    })
    .await;
}

/// Waits for CDS and LDS ACKs at devplane and returns the client.
pub async fn acked(dp: &Devplane, api: &str) -> Value {
    let c = wait_for("CDS and LDS ACKs at devplane", DEADLINE, || async {
        let c = client_for(dp, api).await;
        let acked = c["acked"].as_object().cloned().unwrap_or_default();
        (acked.keys().any(|k| k.ends_with("Cluster"))
            && acked.keys().any(|k| k.ends_with("Listener")))
        .then_some(c)
    })
    .await;
    // The compact view benchmarks poll must agree with the full one.
    let brief = dp.acks().await;
    let same = brief
        .iter()
        .find(|b| b["id"] == c["id"])
        .expect("client in /debug/acks");
    for (t, v) in c["acked"].as_object().unwrap() {
        if t.ends_with("Cluster") || t.ends_with("Listener") {
            assert_eq!(&same["acked"][t], v, "/debug/acks {t}");
        }
    }
    c
}

/// devplane's token fingerprint (`sha256:` + 16 hex digits).
pub fn fingerprint(token: &str) -> String {
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, token.as_bytes());
    let hex: String = d.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

pub const SHORT: Duration = Duration::from_secs(2);

/// A cluster whose metadata carries `size` bytes, so the CDS response exceeds `size`.
pub fn big_cluster(name: &str, size: usize) -> Vec<u8> {
    use meshagent_proto::envoy::pb::envoy::config::cluster::v3::Cluster;
    use meshagent_proto::envoy::pb::envoy::config::core::v3::Metadata;
    use meshagent_proto::envoy::pb::google::protobuf::{
        Duration as PbDuration, Struct, Value as PbValue, value::Kind,
    };
    use prost::Message;
    let blob: String = (0..size).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    Cluster {
        name: name.into(),
        connect_timeout: Some(PbDuration {
            seconds: 1,
            nanos: 0,
        }),
        metadata: Some(Metadata {
            filter_metadata: [(
                "test".to_owned(),
                Struct {
                    fields: [(
                        "blob".to_owned(),
                        PbValue {
                            kind: Some(Kind::StringValue(blob)),
                        },
                    )]
                    .into(),
                },
            )]
            .into(),
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// A lazily-connecting channel to the agent's socket: streams opened on clones of it share
/// one connection, as a proxyless client's xDS streams may.
pub fn socket_channel(socket: &Path) -> tonic::transport::Channel {
    let path = socket.to_path_buf();
    tonic::transport::Endpoint::from_static("http://localhost").connect_with_connector_lazy(
        tower::service_fn(move |_| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }),
    )
}

/// A raw SotW ADS stream on `channel` (see [`raw_sotw`]).
pub async fn raw_sotw_on(
    channel: tonic::transport::Channel,
) -> (
    tokio::sync::mpsc::Sender<bytes::Bytes>,
    Result<tonic::Streaming<bytes::Bytes>, tonic::Status>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    grpc.ready().await.unwrap();
    let stream = grpc
        .streaming(
            tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
            http::uri::PathAndQuery::from_static(meshagent::xds::stream::SOTW_PATH),
            meshagent::xds::codec::RawCodec,
        )
        .await
        .map(|r| r.into_inner());
    (tx, stream)
}

/// A raw SotW ADS stream on a unix socket (the agent's `XDS`), as Envoy opens it: requests are
/// encoded by the caller and sent through the returned sender; responses arrive undecoded.
/// No client-side size limits, so only the agent's and devplane's apply.
pub async fn raw_sotw(
    socket: &Path,
) -> (
    tokio::sync::mpsc::Sender<bytes::Bytes>,
    Result<tonic::Streaming<bytes::Bytes>, tonic::Status>,
) {
    let path = socket.to_path_buf();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector_lazy(tower::service_fn(move |_| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }));
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    grpc.ready().await.unwrap();
    let stream = grpc
        .streaming(
            tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
            http::uri::PathAndQuery::from_static(meshagent::xds::stream::SOTW_PATH),
            meshagent::xds::codec::RawCodec,
        )
        .await
        .map(|r| r.into_inner());
    (tx, stream)
}

/// A SotW request for `type_url` with Envoy's node (as in [`bootstrap`]) and `names`.
pub fn sotw_request(type_url: &str, names: Vec<String>, ack: Option<(&str, &str)>) -> bytes::Bytes {
    use meshagent_proto::envoy::pb::envoy::config::core::v3::Node;
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use meshagent_proto::envoy::pb::google::protobuf::{Struct, Value as PbValue, value::Kind};
    use prost::Message;
    let s = |v: &str| PbValue {
        kind: Some(Kind::StringValue(v.into())),
    };
    let node = Node {
        id: NODE_ID.into(),
        cluster: "a.default".into(),
        metadata: Some(Struct {
            fields: [
                ("NAMESPACE".to_owned(), s("default")),
                ("NAME".to_owned(), s("a-5f7d")),
                ("CLUSTER_ID".to_owned(), s("Kubernetes")),
            ]
            .into(),
        }),
        ..Default::default()
    };
    let (version_info, response_nonce) = ack.unwrap_or_default();
    DiscoveryRequest {
        node: Some(node),
        type_url: type_url.into(),
        resource_names: names,
        version_info: version_info.into(),
        response_nonce: response_nonce.into(),
        ..Default::default()
    }
    .encode_to_vec()
    .into()
}
