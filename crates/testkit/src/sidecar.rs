//! The agent as a pod runs it: its command line, and a sidecar (agent + Envoy) harness.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::{
    Devplane, Proc, Value, envoy_bin, free_addr, free_port, http_get, json, kubelet, workspace_bin,
};

/// `cmd` (the agent binary, or a wrapper that execs it) set up as `meshagent proxy sidecar`
/// with only its status server on `status`: `DISABLE_ENVOY`, an Envoy path that does not
/// exist, nothing at the discovery address, and a clean environment but for `PATH` — the
/// agent the status-port tests probe, scrape and flood. Add the test's own env after this.
pub fn status_only_agent<'a>(cmd: &'a mut Command, cwd: &Path, status: u16) -> &'a mut Command {
    let pc = json!({
        "binaryPath": "/nonexistent/envoy",
        "statusPort": status,
        "discoveryAddress": format!("127.0.0.1:{}", free_port()),
    });
    cmd.args(["proxy", "sidecar"])
        .current_dir(cwd)
        .env_clear()
        .env("CLOUD_PLATFORM", "none")
        .env("POD_NAME", "app-1")
        .env("POD_NAMESPACE", "default")
        .env("INSTANCE_IP", "127.0.0.1")
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DISABLE_ENVOY", "true")
        .env("PROXY_CONFIG", pc.to_string())
}

/// The pod an agent runs for: `<workload>-5f7d9` in `namespace`.
pub struct AgentPod<'a> {
    pub workload: &'a str,
    pub namespace: &'a str,
    pub service_account: &'a str,
    /// The pod IP (`INSTANCE_IP`).
    pub ip: &'a str,
}

/// The free ports an agent's pod was given in place of 15020, 15000 and 15021.
#[derive(Clone, Copy)]
pub struct PodPorts {
    pub status: SocketAddr,
    pub admin: SocketAddr,
    pub envoy_status: SocketAddr,
}

/// `program` (the agent, or a wrapper that execs it) as `pilot-agent proxy sidecar` for `pod`
/// with the control plane at `discovery` (also the CA): the arguments and environment Istio's
/// sidecar injector gives the agent, in a cleared environment, with every fixed port moved to a
/// free one so tests run in parallel. `proxy_config` fields override the defaults here (free
/// ports, the pinned Envoy, 2 s drains); each of `flags` replaces a default flag of the same
/// name or is appended. The caller adds its own env (it wins) and spawns.
pub fn agent_command(
    mut cmd: Command,
    cwd: &Path,
    pod: &AgentPod<'_>,
    discovery: &str,
    proxy_config: &Value,
    flags: &[&str],
) -> (Command, PodPorts) {
    let ports = PodPorts {
        status: free_addr(),
        admin: free_addr(),
        envoy_status: free_addr(),
    };
    let mut pc = json!({
        "discoveryAddress": discovery,
        "binaryPath": envoy_bin(),
        "proxyAdminPort": ports.admin.port(),
        "statusPort": ports.status.port(),
        "terminationDrainDuration": "2s",
        "drainDuration": "2s",
    });
    for (k, v) in proxy_config.as_object().into_iter().flatten() {
        pc[k] = v.clone();
    }
    let domain = format!("{}.svc.cluster.local", pod.namespace);
    let mut argv = vec![
        "proxy",
        "sidecar",
        "--domain",
        &domain,
        "--proxyLogLevel=warning",
        "--log_output_level=default:info",
    ];
    for extra in flags {
        if let Some((flag, _)) = extra.split_once('=') {
            argv.retain(|a| !a.starts_with(&format!("{flag}=")));
        }
        argv.push(extra);
    }
    cmd.args(argv)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("POD_NAME", format!("{}-5f7d9", pod.workload))
        .env("POD_NAMESPACE", pod.namespace)
        .env("SERVICE_ACCOUNT", pod.service_account)
        .env("INSTANCE_IP", pod.ip)
        .env("CA_ADDR", discovery)
        .env("ISTIO_META_CLUSTER_ID", "Kubernetes")
        .env("ISTIO_META_WORKLOAD_NAME", pod.workload)
        .env("ENVOY_STATUS_PORT", ports.envoy_status.port().to_string())
        .env("ENVOY_PROMETHEUS_PORT", free_port().to_string())
        .env("PROXY_CONFIG", pc.to_string())
        // No cloud metadata probes (link-local addresses) from tests; tests of platform
        // discovery override this.
        .env("CLOUD_PLATFORM", "none")
        .env("RUST_BACKTRACE", "1");
    (cmd, ports)
}

/// `meshagent proxy sidecar` run as a separate process, exactly as a pod runs it: Istio's env
/// vars, a working directory holding the projected token and istiod's root at Istio's
/// relative paths, and Envoy from [`envoy_bin`].
pub struct Sidecar {
    pub proc: Proc,
    pub cwd: tempfile::TempDir,
    /// The agent's status port (15020 in a pod).
    pub status: SocketAddr,
    /// Envoy's admin (15000 in a pod).
    pub admin: SocketAddr,
    /// Envoy's readiness listener (15021 in a pod).
    pub envoy_status: SocketAddr,
}

impl Sidecar {
    /// A sidecar from its spawned agent, working directory and ports.
    pub fn from_parts(proc: Proc, cwd: tempfile::TempDir, ports: PodPorts) -> Sidecar {
        Sidecar {
            proc,
            cwd,
            status: ports.status,
            admin: ports.admin,
            envoy_status: ports.envoy_status,
        }
    }

    /// Starts a sidecar for pod `<workload>-<suffix>` in `namespace` with service account `sa`,
    /// talking to devplane for both CA and xDS. `extra_env` is added last (wins).
    pub async fn start(
        dp: &Devplane,
        workload: &str,
        namespace: &str,
        sa: &str,
        extra_env: &[(&str, String)],
    ) -> Sidecar {
        Self::start_with(dp, workload, namespace, sa, extra_env, json!({})).await
    }

    /// [`Sidecar::start`] with ProxyConfig fields overriding the defaults used here.
    pub async fn start_with(
        dp: &Devplane,
        workload: &str,
        namespace: &str,
        sa: &str,
        extra_env: &[(&str, String)],
        proxy_config: Value,
    ) -> Sidecar {
        let token = dp.token(namespace, sa, 3600).await;
        Self::start_with_token(dp, workload, namespace, sa, extra_env, proxy_config, &token).await
    }

    /// [`Sidecar::start_with`] with `token` as the projected token, published the way the
    /// kubelet does (`..data` symlink swap, see [`kubelet::atomic_write`]) so a test can rotate
    /// it with another [`kubelet::atomic_write`] of `var/run/secrets/tokens` in [`Sidecar::cwd`].
    pub async fn start_with_token(
        dp: &Devplane,
        workload: &str,
        namespace: &str,
        sa: &str,
        extra_env: &[(&str, String)],
        proxy_config: Value,
        token: &str,
    ) -> Sidecar {
        let cwd = tempfile::tempdir().unwrap();
        Self::start_in(
            cwd,
            dp,
            workload,
            namespace,
            sa,
            extra_env,
            proxy_config,
            token,
        )
        .await
    }

    /// [`Sidecar::start_with_token`] in a working directory the test has prepared (e.g. with
    /// an external SDS server already listening on the workload socket).
    #[allow(clippy::too_many_arguments)]
    pub async fn start_in(
        cwd: tempfile::TempDir,
        dp: &Devplane,
        workload: &str,
        namespace: &str,
        sa: &str,
        extra_env: &[(&str, String)],
        proxy_config: Value,
        token: &str,
    ) -> Sidecar {
        let root = cwd.path().join("var/run/secrets/istio/root-cert.pem");
        std::fs::create_dir_all(root.parent().unwrap()).unwrap();
        std::fs::copy(dp.root_cert_path(), &root).unwrap();
        kubelet::atomic_write(
            &cwd.path().join("var/run/secrets/tokens"),
            &[("istio-token", token.as_bytes())],
        );

        // `localhost:<port>` exercises Istio's server-name rule (→ istiod.istio-system.svc).
        let pod = AgentPod {
            workload,
            namespace,
            service_account: sa,
            ip: "127.0.0.1",
        };
        let (mut cmd, ports) = agent_command(
            Command::new(workspace_bin("meshagent")),
            cwd.path(),
            &pod,
            &format!("localhost:{}", dp.grpc_addr.port()),
            &proxy_config,
            &["--proxyComponentLogLevel=misc:error"],
        );
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let proc = Proc::spawn(&format!("agent-{workload}"), cmd, cwd.path());
        Sidecar::from_parts(proc, cwd, ports)
    }

    /// Waits until the agent's `/healthz/ready` answers 200.
    pub async fn wait_ready(&mut self, timeout: Duration) {
        let status = self.status;
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(s) = self.proc.try_wait() {
                panic!("agent exited before ready: {s}");
            }
            let last = match http_get(status, "/healthz/ready").await {
                Ok((200, _)) => return,
                Ok((code, body)) => format!("{code} {body}"),
                Err(e) => e.to_string(),
            };
            if tokio::time::Instant::now() >= deadline {
                panic!("sidecar not ready after {timeout:?}: {last}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Envoy's admin `/certs` URI SANs (deduplicated).
    pub async fn spiffe_ids(&self) -> Vec<String> {
        let body = match http_get(self.admin, "/certs").await {
            Ok((200, b)) => b,
            _ => return vec![],
        };
        let certs: Value = serde_json::from_str(&body).unwrap_or_default();
        let mut ids = vec![];
        for c in certs["certificates"].as_array().into_iter().flatten() {
            for chain in c["cert_chain"].as_array().into_iter().flatten() {
                for san in chain["subject_alt_names"].as_array().into_iter().flatten() {
                    if let Some(u) = san["uri"].as_str() {
                        ids.push(u.to_owned());
                    }
                }
            }
        }
        ids.sort();
        ids.dedup();
        ids
    }
}
