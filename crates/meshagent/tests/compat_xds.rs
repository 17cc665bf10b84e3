//! Differential: the xDS streams each agent opens to istiod and the configuration its Envoy
//! ends with, the real pilot-agent beside meshagent, each run as a pod runs it against
//! istiod-box with a real Envoy (testkit `start_agent`). Compared, once each agent is ready:
//!
//! - **the streams opened upstream** on istiod's TLS port, as istiod-box received them (`GET
//!   /streams`, compat/istiod-box/streams.go): the gRPC method (SotW or Delta ADS), the first
//!   request's type URL, the request headers (`:authority`, the token's scheme, `ClusterID`,
//!   anything an agent adds), whether a client certificate was presented, and the first
//!   request's node (id, cluster, metadata, locality, Envoy's user agent and extensions);
//! - **Envoy's dynamic configuration** after the same pushes (`/config_dump`): every dynamic
//!   cluster, listener, route configuration and secret name, with the resources themselves.
//!
//! Ignored as volatile, each with its reason: the `user-agent`, `grpc-accept-encoding`,
//! `grpc-timeout` and `te` headers (the gRPC library's: grpc-go against tonic); `version_info`
//! and `last_updated` of dumped resources (istiod's push time and each Envoy's clock); secret
//! contents (compared field by field in `compat_identity`). Each agent runs with its own
//! ports (status, admin, Envoy's readiness and Prometheus ports): those numbers are replaced
//! by their names wherever they appear, the same for both. Differences meshagent makes on
//! purpose are listed in `DELIBERATE` with their COMPAT.md row; any other difference fails.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::time::Duration;

use meshagent_testkit::istiod_box::{
    AgentKind, IstiodBox, PodSpec, dynamic_config, envoy_config_dump, mesh_with_free_ports,
    recorded_headers, start_agent, workload_a,
};
use meshagent_testkit::{Sidecar, Value, free_port, http, http_get, json, json_diff, wait_for};

const READY: Duration = Duration::from_secs(60);

/// Differences meshagent makes on purpose: (path prefix, COMPAT.md row).
const DELIBERATE: &[(&str, &str)] = &[];

/// Replaces each agent-specific port number (as a number or inside a string) by its name.
fn normalise_ports(v: &mut Value, ports: &[(u16, &str)]) {
    match v {
        Value::String(s) => {
            for (p, name) in ports {
                let p = p.to_string();
                if s.contains(&p) {
                    *s = s.replace(&p, &format!("<{name}>"));
                }
            }
        }
        Value::Number(n) => {
            if let Some((_, name)) = ports
                .iter()
                .find(|(p, _)| n.as_u64() == Some(u64::from(*p)))
            {
                *v = Value::String(format!("<{name}>"));
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| normalise_ports(x, ports)),
        Value::Object(o) => o.values_mut().for_each(|x| normalise_ports(x, ports)),
        _ => {}
    }
}

fn describe_stream(r: &Value) -> Value {
    let headers = recorded_headers(r);
    json!({
        "method": r["method"],
        "type_url": r["type_url"],
        "headers": headers,
        "client_cert": r["client_cert"],
        "node": r["node"],
    })
}

/// One agent's streams and Envoy's configuration once ready and settled.
async fn observe(istiod: &IstiodBox, kind: AgentKind) -> Value {
    let (code, _) = http("DELETE", istiod.http, "/streams").await.unwrap();
    assert_eq!(code, 204, "DELETE /streams");
    let prom = free_port();
    let prom_s = prom.to_string();
    let env = [("ENVOY_PROMETHEUS_PORT", prom_s.as_str())];
    let pod = PodSpec {
        env: &env,
        ..PodSpec::new("a", "127.0.0.1")
    };
    let sc: Sidecar = start_agent(istiod, kind, &pod).await;
    wait_for(&format!("{kind:?} to be ready"), READY, || async {
        matches!(http_get(sc.status, "/healthz/ready").await, Ok((200, _))).then_some(())
    })
    .await;
    // Settled: the same configuration twice in a row, a second apart (istiod's debounced
    // pushes and Envoy's warming are over).
    let deadline = tokio::time::Instant::now() + READY;
    let mut prev = None;
    let config = loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if let Some(dump) = envoy_config_dump(&sc).await {
            let now = dynamic_config(&dump);
            if prev.as_ref() == Some(&now) {
                break now;
            }
            prev = Some(now);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{kind:?}: Envoy's config still changing after {READY:?}\n{}",
            sc.proc.log_text()
        );
    };
    let (code, body) = http_get(istiod.http, "/streams").await.unwrap();
    assert_eq!(code, 200, "GET /streams: {body}");
    let records: Vec<Value> = serde_json::from_str(&body).unwrap();
    let mut v = json!({
        "streams": records.iter().map(describe_stream).collect::<Vec<_>>(),
        "envoy_config": config,
    });
    let ports = [
        (sc.status.port(), "status_port"),
        (sc.admin.port(), "admin_port"),
        (sc.envoy_status.port(), "envoy_status_port"),
        (prom, "prometheus_port"),
    ];
    normalise_ports(&mut v, &ports);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xds_streams_and_envoy_config_match_pilot_agent() {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    let pilot = observe(&istiod, AgentKind::PilotAgent).await;
    let ours = observe(&istiod, AgentKind::Meshagent).await;
    for (who, o) in [("pilot-agent", &pilot), ("meshagent", &ours)] {
        assert!(
            !o["streams"].as_array().unwrap().is_empty(),
            "{who} opened no stream: {o:#}"
        );
        assert!(
            o["envoy_config"].as_object().unwrap().len() > 3,
            "{who}'s Envoy has almost no config: {o:#}"
        );
    }
    if std::env::var_os("COMPAT_XDS_SHOW").is_some() {
        eprintln!("pilot-agent: {pilot:#}");
    }
    let mut unexpected = Vec::new();
    for (path, p, m) in json_diff(&pilot, &ours) {
        let line = format!("{path}: pilot-agent {p} | meshagent {m}");
        match DELIBERATE
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix))
        {
            Some((_, why)) => eprintln!("listed: {line} (COMPAT.md: {why})"),
            None => unexpected.push(line),
        }
    }
    assert!(unexpected.is_empty(), "{}", unexpected.join("\n"));
}

/// A raw SotW ADS stream on the agent's `XDS` socket, as Envoy opens it, sending an EDS request
/// of `names` names of ~100 bytes; returns the status the stream ends with.
async fn oversized_request_status(socket: std::path::PathBuf, names: usize) -> tonic::Status {
    use futures::StreamExt as _;
    use meshagent_proto::envoy::pb::envoy::service::discovery::v3::DiscoveryRequest;
    use prost::Message;
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector_lazy(tower::service_fn(move |_| {
            let p = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }));
    let grpc = tonic::client::Grpc::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX);
    let request = DiscoveryRequest {
        type_url: "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment".into(),
        resource_names: (0..names)
            .map(|i| {
                format!(
                    "outbound|80||svc-{i:07}.{}.svc.cluster.local",
                    "n".repeat(60)
                )
            })
            .collect(),
        ..Default::default()
    }
    .encode_to_vec();
    async fn call(
        mut grpc: tonic::client::Grpc<tonic::transport::Channel>,
        request: Vec<u8>,
    ) -> Result<(), tonic::Status> {
        grpc.ready()
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let requests =
            futures::stream::iter([bytes::Bytes::from(request)]).chain(futures::stream::pending());
        let mut stream = grpc
            .streaming(
                tonic::Request::new(requests),
                http::uri::PathAndQuery::from_static(meshagent::xds::stream::SOTW_PATH),
                meshagent::xds::codec::RawCodec,
            )
            .await?
            .into_inner();
        while stream.message().await?.is_some() {}
        Ok(())
    }
    let call = call(grpc, request);
    match tokio::time::timeout(Duration::from_secs(30), call).await {
        Ok(Err(s)) => s,
        Ok(Ok(())) => panic!("the stream ended with OK, not a refusal"),
        Err(_) => panic!("no refusal within 30 s"),
    }
}

/// `ISTIO_GPRC_MAXRECVMSGSIZE` on Envoy's requests: with the limit at 64 KiB, each agent ends
/// an ADS stream whose request is ~100 KiB with the same gRPC status and message (gRPC-Go's
/// `ResourceExhausted` "grpc: received message larger than max (N vs. 65536)"), while its own
/// Envoy, whose requests are smaller, gets ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_is_refused_as_pilot_agent_refuses_it() {
    let mesh = mesh_with_free_ports();
    let istiod = IstiodBox::start_with(&workload_a(), Some(&mesh), &[]).await;
    let mut seen = Vec::new();
    for kind in [AgentKind::PilotAgent, AgentKind::Meshagent] {
        let prom = free_port().to_string();
        let env = [
            ("ENVOY_PROMETHEUS_PORT", prom.as_str()),
            ("ISTIO_GPRC_MAXRECVMSGSIZE", "65536"),
        ];
        let pod = PodSpec {
            env: &env,
            ..PodSpec::new("a", "127.0.0.1")
        };
        let sc: Sidecar = start_agent(&istiod, kind, &pod).await;
        wait_for(&format!("{kind:?} to be ready"), READY, || async {
            matches!(http_get(sc.status, "/healthz/ready").await, Ok((200, _))).then_some(())
        })
        .await;
        let s = oversized_request_status(sc.cwd.path().join("etc/istio/proxy/XDS"), 1000).await;
        eprintln!("{kind:?}: {:?} {:?}", s.code(), s.message());
        seen.push((s.code(), s.message().to_owned()));
    }
    assert_eq!(seen[0], seen[1], "pilot-agent | meshagent");
    assert_eq!(seen[0].0, tonic::Code::ResourceExhausted);
    assert!(
        seen[0]
            .1
            .starts_with("grpc: received message larger than max (")
            && seen[0].1.ends_with(" vs. 65536)"),
        "{seen:?}"
    );
}
