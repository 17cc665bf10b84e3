//! Cloud platform discovery against fake metadata servers on loopback (never the real
//! link-local addresses): GCP (metadata server, `GCP_METADATA`, resolv.conf zone), AWS
//! (IMDSv2 token flow and the IMDSv1 fallback), Azure, and unreachable and slow servers; then
//! the agent end to end: the platform reaches Envoy's node, and a hanging metadata server does
//! not keep the proxy from becoming ready.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use meshagent::platform::{Endpoints, Kind, Platform, Settings, discover_with};
use meshagent_testkit::{DEADLINE, Devplane, Sidecar, free_addr, http_get, wait_for};

/// What a fake server saw: method, path with query, and the headers that matter.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: BTreeMap<String, String>,
}

/// How the fake behaves.
#[derive(Clone, Default)]
struct Behaviour {
    /// GCP: answer `/` with `Metadata-Flavor: Google`, serve these `computeMetadata/v1` paths.
    gcp: Option<BTreeMap<&'static str, &'static str>>,
    /// AWS: IMDSv2 token to hand out (`None`: the token PUT is refused, IMDSv1 only), and
    /// whether GETs need it.
    aws: Option<(
        Option<&'static str>,
        bool,
        BTreeMap<&'static str, &'static str>,
    )>,
    /// Azure: the `/metadata/instance` answers: versions list, and the document.
    azure: Option<(serde_json::Value, serde_json::Value)>,
    /// Accept connections but never answer.
    hang: bool,
}

struct Fake {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Fake {
    async fn start(b: Behaviour) -> Fake {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let log = seen.clone();
        let b = Arc::new(b);
        let app = axum::Router::new().fallback(
            move |method: Method, uri: Uri, headers: HeaderMap, _req: Request<Body>| {
                let b = b.clone();
                let log = log.clone();
                async move {
                    let path = uri
                        .path_and_query()
                        .map(|p| p.as_str().to_owned())
                        .unwrap_or_default();
                    let h: BTreeMap<String, String> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
                        .collect();
                    log.lock().unwrap().push(Seen {
                        method: method.to_string(),
                        path: path.clone(),
                        headers: h.clone(),
                    });
                    if b.hang {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    respond(&b, &method, uri.path(), uri.query().unwrap_or(""), &h)
                }
            },
        );
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Fake { addr, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn text(status: StatusCode, body: &str) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn respond(
    b: &Behaviour,
    method: &Method,
    path: &str,
    query: &str,
    h: &BTreeMap<String, String>,
) -> Response<Body> {
    if let Some(gcp) = &b.gcp {
        if path == "/" {
            return Response::builder()
                .header("Metadata-Flavor", "Google")
                .body(Body::empty())
                .unwrap();
        }
        if let Some(p) = path.strip_prefix("/computeMetadata/v1/") {
            if h.get("metadata-flavor").map(String::as_str) != Some("Google") {
                return text(StatusCode::FORBIDDEN, "missing Metadata-Flavor");
            }
            return match gcp.get(p) {
                Some(v) => text(StatusCode::OK, v),
                None => text(StatusCode::NOT_FOUND, "not defined"),
            };
        }
    }
    if let Some((token, required, values)) = &b.aws {
        if path == "/latest/api/token" && method == Method::PUT {
            return match (token, h.get("x-aws-ec2-metadata-token-ttl-seconds")) {
                (Some(t), Some(ttl)) if ttl == "60" => text(StatusCode::OK, t),
                (Some(_), _) => text(StatusCode::BAD_REQUEST, "ttl header"),
                (None, _) => text(StatusCode::FORBIDDEN, "IMDSv2 disabled"),
            };
        }
        if let Some(p) = path.strip_prefix("/latest/meta-data/") {
            let given = h.get("x-aws-ec2-metadata-token");
            if *required && given.map(String::as_str) != *token {
                return text(StatusCode::UNAUTHORIZED, "token");
            }
            return match values.get(p) {
                Some(v) => text(StatusCode::OK, v),
                None => text(StatusCode::NOT_FOUND, ""),
            };
        }
    }
    if let Some((versions, doc)) = &b.azure
        && path == "/metadata/instance"
    {
        if h.get("metadata").map(String::as_str) != Some("True") {
            return text(StatusCode::BAD_REQUEST, "{\"error\":\"Metadata header\"}");
        }
        return if query.is_empty() {
            text(StatusCode::BAD_REQUEST, &versions.to_string())
        } else if query == "api-version=2021-02-01" {
            text(StatusCode::OK, &doc.to_string())
        } else {
            text(StatusCode::BAD_REQUEST, "{\"error\":\"api-version\"}")
        };
    }
    text(StatusCode::NOT_FOUND, "")
}

/// Endpoints that all point at `addr` (or a closed port), with a DMI dir and resolv.conf of
/// the test's own.
struct Scene {
    dir: tempfile::TempDir,
    ep: Endpoints,
}

impl Scene {
    fn new(addr: SocketAddr) -> Scene {
        let dir = tempfile::tempdir().unwrap();
        let a = addr.to_string();
        std::fs::write(dir.path().join("resolv.conf"), "nameserver 127.0.0.1\n").unwrap();
        let ep = Endpoints {
            gce_host: a.clone(),
            gce_host_from_env: false,
            gce_probe: a.clone(),
            gce_dns_probe: false,
            aws_v4: a.clone(),
            aws_v6: a.clone(),
            azure: a,
            dmi_dir: dir.path().join("dmi"),
            resolv_conf: dir.path().join("resolv.conf"),
        };
        std::fs::create_dir_all(&ep.dmi_dir).unwrap();
        Scene { dir, ep }
    }

    fn write(&self, rel: &str, content: &str) {
        let p: PathBuf = self.dir.path().join(rel);
        std::fs::write(p, content).unwrap();
    }
}

/// A loopback address nothing listens on.
fn closed_addr() -> SocketAddr {
    free_addr()
}

fn settings() -> Settings {
    Settings::default()
}

async fn discover(s: &Settings, ep: &Endpoints) -> Platform {
    discover_with(s, ep, meshagent::platform::DISCOVERY_TIMEOUT).await
}

fn gcp_values() -> BTreeMap<&'static str, &'static str> {
    BTreeMap::from([
        ("project/project-id", "my-proj\n"),
        ("project/numeric-project-id", "1234"),
        ("instance/attributes/cluster-name", "prod"),
        ("instance/attributes/cluster-location", "us-central1"),
        ("instance/zone", "projects/1234/zones/us-central1-b"),
        ("instance/name", "gke-node-1"),
        ("instance/id", "99"),
        (
            "instance/attributes/created-by",
            "projects/1234/zones/us-central1-b/instanceGroupManagers/g",
        ),
    ])
}

#[tokio::test]
async fn gcp_metadata_server_fills_metadata_and_locality() {
    let fake = Fake::start(Behaviour {
        gcp: Some(gcp_values()),
        ..Default::default()
    })
    .await;
    let scene = Scene::new(fake.addr);
    let p = discover(&settings(), &scene.ep).await;
    assert_eq!(p.kind, Kind::Gcp, "{p:?}");
    let m = &p.metadata;
    assert_eq!(m["gcp_project"], "my-proj", "trimmed: {m:?}");
    assert_eq!(m["gcp_project_number"], "1234");
    assert_eq!(m["gcp_gke_cluster_name"], "prod");
    assert_eq!(m["gcp_location"], "us-central1");
    assert_eq!(m["gcp_gce_instance"], "gke-node-1");
    assert_eq!(m["gcp_gce_instance_id"], "99");
    assert_eq!(
        m["gcp_gce_instance_created_by"],
        "projects/1234/zones/us-central1-b/instanceGroupManagers/g"
    );
    assert!(
        !m.contains_key("gcp_gce_instance_template"),
        "404 → left out: {m:?}"
    );
    assert_eq!(
        m["gcp_gke_cluster_url"],
        "https://container.googleapis.com/v1/projects/my-proj/locations/us-central1/clusters/prod"
    );
    assert_eq!(m["gcp_zone"], "us-central1-b");
    assert_eq!(
        (p.locality.region.as_str(), p.locality.zone.as_str()),
        ("us-central1", "us-central1-b")
    );
    // Every metadata request carried the flavor header.
    let seen = fake.seen();
    assert!(
        seen.iter()
            .filter(|s| s.path.starts_with("/computeMetadata/"))
            .all(|s| s.headers.get("metadata-flavor").map(String::as_str) == Some("Google")),
        "{seen:?}"
    );
}

#[tokio::test]
async fn gcp_env_wins_and_resolv_conf_names_the_zone() {
    let fake = Fake::start(Behaviour {
        gcp: Some(gcp_values()),
        ..Default::default()
    })
    .await;
    let scene = Scene::new(fake.addr);
    scene.write(
        "resolv.conf",
        "nameserver 10.0.0.10\nsearch default.svc.cluster.local svc.cluster.local cluster.local europe-west4-a.c.my-proj.internal c.my-proj.internal google.internal\n",
    );
    let s = Settings {
        gcp_metadata: "env-proj|42|env-cluster|europe-west4".into(),
        gcp_quota_project: "quota-proj".into(),
        ..settings()
    };
    let p = discover(&s, &scene.ep).await;
    assert_eq!(p.kind, Kind::Gcp);
    let m = &p.metadata;
    assert_eq!(m["gcp_project"], "env-proj");
    assert_eq!(m["gcp_project_number"], "42");
    assert_eq!(m["gcp_gke_cluster_name"], "env-cluster");
    assert_eq!(m["gcp_location"], "europe-west4");
    assert_eq!(m["gcp_quota_project"], "quota-proj");
    assert_eq!(
        m["gcp_gce_instance"], "gke-node-1",
        "instance facts still come from the server"
    );
    assert_eq!(
        m["gcp_zone"], "europe-west4-a",
        "resolv.conf before the server"
    );
    assert_eq!(
        (p.locality.region.as_str(), p.locality.zone.as_str()),
        ("europe-west4", "europe-west4-a")
    );
    let seen = fake.seen();
    for skipped in [
        "project/project-id",
        "instance/attributes/cluster-name",
        "instance/zone",
    ] {
        assert!(
            !seen.iter().any(|s| s.path.ends_with(skipped)),
            "{skipped} asked although known: {seen:?}"
        );
    }
}

#[tokio::test]
async fn gcp_metadata_env_without_a_server_is_still_gcp() {
    let scene = Scene::new(closed_addr());
    let s = Settings {
        gcp_metadata: "p|1|c|us-east1".into(),
        ..settings()
    };
    let p = discover(&s, &scene.ep).await;
    assert_eq!(p.kind, Kind::Gcp);
    assert_eq!(p.metadata.get("gcp_project").map(String::as_str), Some("p"));
    assert!(!p.metadata.contains_key("gcp_gce_instance"));
    assert_eq!(p.locality, Default::default());
}

fn aws_values() -> BTreeMap<&'static str, &'static str> {
    BTreeMap::from([
        (
            "iam/info",
            "{\"Code\":\"Success\",\"InstanceProfileArn\":\"arn:aws:iam::123:instance-profile/x\"}",
        ),
        ("placement/region", "eu-west-1"),
        ("placement/availability-zone", "eu-west-1c"),
        ("instance-id", "i-0abc"),
    ])
}

fn assert_aws(p: &Platform) {
    assert_eq!(p.kind, Kind::Aws, "{p:?}");
    assert_eq!(p.metadata["aws_region"], "eu-west-1");
    assert_eq!(p.metadata["aws_availability_zone"], "eu-west-1c");
    assert_eq!(p.metadata["aws_instance_id"], "i-0abc");
    assert_eq!(
        (p.locality.region.as_str(), p.locality.zone.as_str()),
        ("eu-west-1", "eu-west-1c")
    );
}

#[tokio::test]
async fn aws_imdsv2_token_flow() {
    let fake = Fake::start(Behaviour {
        aws: Some((Some("tok-1"), true, aws_values())),
        ..Default::default()
    })
    .await;
    let scene = Scene::new(fake.addr);
    let p = discover(&settings(), &scene.ep).await;
    assert_aws(&p);
    let seen = fake.seen();
    assert!(
        seen.iter()
            .any(|s| s.method == "PUT" && s.path == "/latest/api/token"),
        "{seen:?}"
    );
    let gets: Vec<_> = seen
        .iter()
        .filter(|s| s.path.starts_with("/latest/meta-data/"))
        .collect();
    assert!(
        !gets.is_empty()
            && gets.iter().all(|s| s
                .headers
                .get("x-aws-ec2-metadata-token")
                .map(String::as_str)
                == Some("tok-1")),
        "{gets:?}"
    );
}

#[tokio::test]
async fn aws_falls_back_to_imdsv1() {
    let fake = Fake::start(Behaviour {
        aws: Some((None, false, aws_values())),
        ..Default::default()
    })
    .await;
    let scene = Scene::new(fake.addr);
    let p = discover(&settings(), &scene.ep).await;
    assert_aws(&p);
    let seen = fake.seen();
    assert!(
        seen.iter().any(|s| s.method == "PUT"),
        "a token was asked first: {seen:?}"
    );
    assert!(
        seen.iter()
            .filter(|s| s.method == "GET")
            .all(|s| !s.headers.contains_key("x-aws-ec2-metadata-token"))
    );
}

#[tokio::test]
async fn aws_forced_by_cloud_platform_over_ipv6_endpoint() {
    let fake = Fake::start(Behaviour {
        aws: Some((Some("t"), true, aws_values())),
        ..Default::default()
    })
    .await;
    let mut scene = Scene::new(closed_addr());
    scene.ep.aws_v6 = fake.addr.to_string();
    let s = Settings {
        cloud_platform: "AWS".into(),
        ipv6: true,
        ..settings()
    };
    assert_aws(&discover(&s, &scene.ep).await);
}

#[tokio::test]
async fn azure_from_dmi_vendor_and_imds() {
    let versions = serde_json::json!({"error": "Bad request. api-version was not specified", "newest-versions": ["2020-09-01", "2021-02-01", "2019-08-15"]});
    let doc = serde_json::json!({"compute": {"name": "aks-node-0", "location": "westeurope", "zone": "2", "vmId": "vm-1",
        "tagsList": [{"name": "aks-managed-poolName", "value": "system"}]}, "network": {}});
    let fake = Fake::start(Behaviour {
        azure: Some((versions, doc)),
        ..Default::default()
    })
    .await;
    let scene = Scene::new(fake.addr);
    scene.write("dmi/sys_vendor", "Microsoft Corporation\n");
    let p = discover(&settings(), &scene.ep).await;
    assert_eq!(p.kind, Kind::Azure, "{p:?}");
    assert_eq!(p.metadata["azure_name"], "aks-node-0");
    assert_eq!(p.metadata["azure_location"], "westeurope");
    assert_eq!(p.metadata["azure_vmId"], "vm-1");
    assert_eq!(p.metadata["azure_aks-managed-poolName"], "system");
    assert_eq!(
        (p.locality.region.as_str(), p.locality.zone.as_str()),
        ("westeurope", "2")
    );
    let seen = fake.seen();
    assert!(
        seen.iter()
            .any(|s| s.path == "/metadata/instance?api-version=2021-02-01"),
        "newest version used: {seen:?}"
    );
}

#[tokio::test]
async fn nothing_answers_unknown() {
    let scene = Scene::new(closed_addr());
    let p = discover(&settings(), &scene.ep).await;
    assert_eq!(p, Platform::unknown());
    // CLOUD_PLATFORM=none does not probe at all, even with a cloud to find.
    let fake = Fake::start(Behaviour {
        aws: Some((Some("t"), true, aws_values())),
        ..Default::default()
    })
    .await;
    let scene = Scene::new(fake.addr);
    let s = Settings {
        cloud_platform: "none".into(),
        ..settings()
    };
    assert_eq!(discover(&s, &scene.ep).await, Platform::unknown());
    assert!(fake.seen().is_empty(), "{:?}", fake.seen());
}

#[tokio::test]
async fn hanging_server_is_bounded_by_the_discovery_timeout() {
    let fake = Fake::start(Behaviour {
        hang: true,
        ..Default::default()
    })
    .await;
    let scene = Scene::new(fake.addr);
    let timeout = Duration::from_secs(2);
    let started = tokio::time::Instant::now();
    let p = discover_with(&settings(), &scene.ep, timeout).await;
    let took = started.elapsed();
    assert_eq!(p, Platform::unknown());
    // Bounded (the generous margin is for a loaded machine, not a speed claim).
    assert!(
        took < timeout + Duration::from_secs(3),
        "discovery took {took:?}"
    );
    assert!(!fake.seen().is_empty(), "the probes reached the server");
}

// === the agent ===

fn metadata_env(
    addr: SocketAddr,
    dmi: &std::path::Path,
    extra: &[(&str, &str)],
) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("MESHAGENT_TEST_METADATA_ADDR", addr.to_string()),
        ("MESHAGENT_TEST_DMI_DIR", dmi.display().to_string()),
    ];
    for (k, v) in extra {
        let k: &'static str = Box::leak(k.to_string().into_boxed_str());
        env.push((k, v.to_string()));
    }
    env
}

async fn envoy_node(admin: SocketAddr) -> serde_json::Value {
    let (code, body) = http_get(admin, "/server_info").await.unwrap();
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["node"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_puts_the_platform_in_envoys_node() {
    let (mesh, _, _, _) = meshagent_testkit::two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    let fake = Fake::start(Behaviour {
        aws: Some((Some("tok"), true, aws_values())),
        ..Default::default()
    })
    .await;
    let dmi = tempfile::tempdir().unwrap();
    let env = metadata_env(fake.addr, dmi.path(), &[("CLOUD_PLATFORM", "")]);
    let mut sc = Sidecar::start(&dp, "a", "default", "a", &env).await;
    sc.wait_ready(DEADLINE).await;
    let node = envoy_node(sc.admin).await;
    let pm = &node["metadata"]["PLATFORM_METADATA"];
    assert_eq!(pm["aws_region"], "eu-west-1", "{node}");
    assert_eq!(pm["aws_availability_zone"], "eu-west-1c");
    assert_eq!(pm["aws_instance_id"], "i-0abc");
    assert_eq!(node["locality"]["region"], "eu-west-1", "{node}");
    assert_eq!(node["locality"]["zone"], "eu-west-1c");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_metadata_server_does_not_keep_the_proxy_unready() {
    let (mesh, _, _, _) = meshagent_testkit::two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    let fake = Fake::start(Behaviour {
        hang: true,
        ..Default::default()
    })
    .await;
    let dmi = tempfile::tempdir().unwrap();
    let env = metadata_env(fake.addr, dmi.path(), &[("CLOUD_PLATFORM", "")]);
    let mut sc = Sidecar::start(&dp, "a", "default", "a", &env).await;
    sc.wait_ready(DEADLINE).await;
    let node = envoy_node(sc.admin).await;
    let meta = &node["metadata"];
    assert!(meta.get("PLATFORM_METADATA").is_none(), "{meta}");
    let loc = &node["locality"];
    for k in ["region", "zone", "sub_zone"] {
        assert!(loc.get(k).is_none_or(|v| v == ""), "{loc}");
    }
    let _ = wait_for("a probe at the fake", DEADLINE, || async {
        (!fake.seen().is_empty()).then_some(())
    })
    .await;
}
