//! The demo mesh with each sidecar in its own container of the self-contained image (built by
//! `make image`), run by podman the way Kubernetes runs the injected istio-proxy container of
//! deploy/reference/injected-sidecar-pod.yaml: that manifest's uid/gid (1337), no
//! capabilities, no privilege escalation, a read-only root filesystem, a tmpfs for each of
//! its emptyDir volumes and read-only mounts for the token, root certificate and pod info.
//! So the test fails if meshagent or Envoy writes anywhere Istio does not give them an
//! emptyDir. A's app calls B through both containers over mTLS.
//!
//! Needs the image and podman: `make image-test` runs it (`--run-ignored only`), with
//! MESHAGENT_IMAGE naming the image. Host networking: devplane and the apps stay on loopback.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use meshagent_testkit::{
    DEADLINE, Devplane, Proc, free_addr, free_port, http_get, identity_app, json,
    two_workload_mesh, wait_for, workspace_root,
};
use serde_json::Value;

const READY: Duration = Duration::from_secs(60);

/// podman's defaults do not run here (crun cannot raise RLIMIT_NOFILE; see PEERS.md): runc and
/// ulimits within the sandbox's caps.
fn containers_conf(dir: &Path) -> PathBuf {
    let p = dir.join("containers.conf");
    std::fs::write(
        &p,
        "[containers]\ndefault_ulimits = [\"nofile=20000:20000\",\"nproc=32768:32768\"]\n[engine]\nruntime = \"runc\"\n",
    )
    .unwrap();
    p
}

/// The istio-proxy container of the reference injected pod, and the pod's volumes.
fn reference_proxy() -> (Value, Vec<Value>) {
    let path = workspace_root().join("deploy/reference/injected-sidecar-pod.yaml");
    let pod: Value = serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let proxy = pod["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "istio-proxy")
        .unwrap()
        .clone();
    let volumes = pod["spec"]["volumes"].as_array().unwrap().clone();
    (proxy, volumes)
}

/// Removes the container when the test ends, however it ends.
struct Container {
    name: String,
    conf: PathBuf,
    proc: Proc,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("podman")
            .env("CONTAINERS_CONF", &self.conf)
            .args(["rm", "-f", "-t", "0", &self.name])
            .output();
    }
}

/// Fields drop in order: the container (and its log) before the directory holding them.
struct Pod {
    container: Container,
    _dir: tempfile::TempDir,
    status: std::net::SocketAddr,
    envoy_status: std::net::SocketAddr,
}

async fn start(image: &str, dp: &Devplane, workload: &str) -> Pod {
    let dir = tempfile::tempdir().unwrap();
    let conf = containers_conf(dir.path());
    // What the kubelet mounts read-only: the istio-token projection, the root certificate
    // configMap, the downward-API pod info.
    let mounts = dir.path().join("mounts");
    let token_dir = mounts.join("istio-token");
    let ca_dir = mounts.join("istiod-ca-cert");
    let podinfo = mounts.join("istio-podinfo");
    use std::os::unix::fs::PermissionsExt;
    for d in [&mounts, &token_dir, &ca_dir, &podinfo] {
        std::fs::create_dir_all(d).unwrap();
    }
    // uid 1337 must be able to read them, as from the kubelet's mounts.
    for d in [dir.path(), &mounts, &token_dir, &ca_dir, &podinfo] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(
        token_dir.join("istio-token"),
        dp.token("default", workload, 3600).await,
    )
    .unwrap();
    std::fs::copy(dp.root_cert_path(), ca_dir.join("root-cert.pem")).unwrap();
    std::fs::write(
        podinfo.join("labels"),
        format!("app=\"{workload}\"\nsecurity.istio.io/tlsMode=\"istio\"\n"),
    )
    .unwrap();
    std::fs::write(podinfo.join("annotations"), "").unwrap();

    let (proxy, volumes) = reference_proxy();
    let sc = &proxy["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    let name = format!("meshagent-test-{}-{workload}", std::process::id());
    let (status, admin, envoy_status) = (free_addr(), free_addr(), free_addr());
    let pc = json!({
        "discoveryAddress": format!("localhost:{}", dp.grpc_addr.port()),
        "proxyAdminPort": admin.port(),
        "statusPort": status.port(),
        "terminationDrainDuration": "2s",
        "drainDuration": "2s",
    });
    let mut cmd = Command::new("podman");
    cmd.env("CONTAINERS_CONF", &conf).args([
        "run",
        "--rm",
        "--name",
        &name,
        "--network",
        "host",
        "--read-only",
        "--read-only-tmpfs=false",
        "--security-opt",
        "no-new-privileges",
        "--cap-drop",
        "ALL",
        "--user",
        &format!("{}:{}", sc["runAsUser"], sc["runAsGroup"]),
    ]);
    let mut emptydirs = 0;
    for m in proxy["volumeMounts"].as_array().unwrap() {
        let vol = volumes.iter().find(|v| v["name"] == m["name"]).unwrap();
        let path = m["mountPath"].as_str().unwrap();
        if vol.get("emptyDir").is_some() {
            // Kubernetes mounts an empty, world-writable directory (no copy-up of the image's).
            cmd.args(["--tmpfs", &format!("{path}:rw,mode=0777,notmpcopyup")]);
            emptydirs += 1;
            continue;
        }
        let src = mounts.join(m["name"].as_str().unwrap());
        if src.exists() {
            cmd.args(["-v", &format!("{}:{path}:ro", src.display())]);
        } else {
            // Optional configMaps that do not exist (istio-ca-crl) are not mounted.
            assert_eq!(vol["configMap"]["optional"], true, "no stand-in for {vol}");
        }
    }
    assert!(emptydirs >= 5, "{proxy}");
    for (k, v) in [
        ("POD_NAME", format!("{workload}-5f7d9")),
        ("POD_NAMESPACE", "default".into()),
        ("SERVICE_ACCOUNT", workload.into()),
        ("INSTANCE_IP", "127.0.0.1".into()),
        ("CA_ADDR", format!("localhost:{}", dp.grpc_addr.port())),
        ("ISTIO_META_CLUSTER_ID", "Kubernetes".into()),
        ("ISTIO_META_WORKLOAD_NAME", workload.into()),
        ("ENVOY_STATUS_PORT", envoy_status.port().to_string()),
        ("ENVOY_PROMETHEUS_PORT", free_port().to_string()),
        ("PROXY_CONFIG", pc.to_string()),
        ("CLOUD_PLATFORM", "none".into()),
    ] {
        cmd.args(["-e", &format!("{k}={v}")]);
    }
    cmd.arg(image);
    for a in proxy["args"].as_array().unwrap() {
        cmd.arg(a.as_str().unwrap().replace("$(POD_NAMESPACE)", "default"));
    }
    eprintln!("{workload}: {cmd:?}");
    let proc = Proc::spawn(&format!("container-{workload}"), cmd, dir.path());
    Pod {
        container: Container { name, conf, proc },
        _dir: dir,
        status,
        envoy_status,
    }
}

impl Pod {
    async fn wait_ready(&mut self) {
        let status = self.envoy_status;
        let proc = &mut self.container.proc;
        let deadline = tokio::time::Instant::now() + READY;
        loop {
            if let Some(s) = proc.try_wait() {
                panic!("container exited before ready: {s}");
            }
            if let Ok((200, _)) = http_get(status, "/healthz/ready").await {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "not ready within {READY:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// The pod's memory as a memory limit sees it: the container cgroup's `memory.current` and
/// `memory.peak` (Envoy and the agent together, page cache charged to the pod included), and
/// the agent's own VmRSS / RssAnon / Pss / VmHWM. VmRSS alone drops when clean code pages are
/// unmapped that stay in the page cache and charged to the pod, so all are printed together.
/// Read from the host (`/proc/<pid>` of the container's init, which is the agent, and its
/// cgroup under `/sys/fs/cgroup`): the image needs no shell.
fn report_memory(c: &Container) {
    let out = Command::new("podman")
        .env("CONTAINERS_CONF", &c.conf)
        .args(["inspect", "--format", "{{.State.Pid}}", &c.name])
        .output()
        .unwrap();
    let pid = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("the agent's /proc/{pid}/status: {e}"));
    let kib = |text: &str, key: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(f64::NAN)
            / 1024.0
    };
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    // cgroup v2 (`0::<path>`: memory.current, memory.peak), or v1's memory controller
    // (`N:memory:<path>`: memory.usage_in_bytes, memory.max_usage_in_bytes), as the machine has.
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let v1 = cgroups.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        ctrl.split(',')
            .any(|c| c == "memory")
            .then(|| format!("/sys/fs/cgroup/memory{path}"))
    });
    let v2 = cgroups
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| format!("/sys/fs/cgroup{p}"));
    let (dir, files) = match (v1, v2) {
        (Some(d), _) => (
            Some(d),
            ["memory.usage_in_bytes", "memory.max_usage_in_bytes"],
        ),
        (None, d) => (d, ["memory.current", "memory.peak"]),
    };
    let cg = |file: &str| -> String {
        dir.as_ref()
            .and_then(|d| std::fs::read_to_string(format!("{d}/{file}")).ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or_else(
                || "unavailable".to_owned(),
                |b| format!("{:.1} MiB", b / 1048576.0),
            )
    };
    println!(
        "{}: cgroup {} {}, {} {}; agent ({}, pid {pid}) VmRSS {:.2} MiB, \
         RssAnon {:.2}, Pss {:.2}, VmHWM {:.2}",
        c.name,
        files[0],
        cg(files[0]),
        files[1],
        cg(files[1]),
        comm.trim(),
        kib(&status, "VmRSS:"),
        kib(&status, "RssAnon:"),
        kib(&rollup, "Pss:"),
        kib(&status, "VmHWM:"),
    );
    assert!(kib(&status, "RssAnon:") > 0.0, "{status}");
}

fn image() -> String {
    std::env::var("MESHAGENT_IMAGE").expect("MESHAGENT_IMAGE names the image (make image-test)")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the image and podman: make image-test"]
async fn demo_mesh_in_containers_with_read_only_root() {
    let image = image();
    let (mesh, a_to_b, a_app, b_app) = two_workload_mesh();
    let dp = Devplane::start(&mesh).await;
    for (name, port) in [("a", a_app), ("b", b_app)] {
        let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        tokio::spawn(identity_app(name, l, Duration::ZERO));
    }
    let mut a = start(&image, &dp, "a").await;
    let mut b = start(&image, &dp, "b").await;
    a.wait_ready().await;
    b.wait_ready().await;
    let (_, body) = wait_for("A → B through both containers", DEADLINE, || async {
        http_get(a_to_b, "/").await.ok().filter(|(c, _)| *c == 200)
    })
    .await;
    assert!(
        body.contains("hello from b; caller identity: spiffe://cluster.local/ns/default/sa/a"),
        "{body}"
    );
    report_memory(&a.container);
    report_memory(&b.container);
    // The agent's own status port answers as in a pod.
    let (code, _) = http_get(a.status, "/healthz/ready").await.unwrap();
    assert_eq!(code, 200);
    // `meshagent version` inside the container (what docs/install.md tells users to run).
    let out = Command::new("podman")
        .env("CONTAINERS_CONF", &a.container.conf)
        .args(["exec", &a.container.name, "meshagent", "version", "--short"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.stdout.is_empty());
}
