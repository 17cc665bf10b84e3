//! The devplane control plane as a child process.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{
    DEADLINE, Proc, Value, free_addr, http_get, http_with_body, wait_for, workspace_bin,
    write_atomic,
};

pub struct Devplane {
    // Declared first so it is dropped (and its log printed) before `dir` is deleted.
    pub proc: Proc,
    pub dir: tempfile::TempDir,
    pub grpc_addr: SocketAddr,
    pub plaintext_addr: SocketAddr,
    pub debug_addr: SocketAddr,
}

impl Devplane {
    /// Starts devplane with `mesh_yaml` and waits until it serves.
    pub async fn start(mesh_yaml: &str) -> Devplane {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("mesh.yaml"), mesh_yaml).unwrap();
        let grpc_addr = free_addr();
        let plaintext_addr = free_addr();
        let debug_addr = free_addr();
        let proc = Self::spawn(dir.path(), grpc_addr, plaintext_addr, debug_addr);
        let mut d = Devplane {
            dir,
            grpc_addr,
            plaintext_addr,
            debug_addr,
            proc,
        };
        d.wait_serving().await;
        d
    }

    fn spawn(dir: &Path, grpc: SocketAddr, plain: SocketAddr, debug: SocketAddr) -> Proc {
        let mut cmd = Command::new(workspace_bin("meshagent-devplane"));
        cmd.arg("serve")
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--mesh")
            .arg(dir.join("mesh.yaml"))
            .arg("--grpc-addr")
            .arg(grpc.to_string())
            .arg("--plaintext-addr")
            .arg(plain.to_string())
            .arg("--debug-addr")
            .arg(debug.to_string())
            .env("RUST_LOG", "info");
        Proc::spawn("devplane", cmd, dir)
    }

    async fn wait_serving(&mut self) {
        let addr = self.debug_addr;
        wait_for("devplane to serve", DEADLINE, || async move {
            matches!(http_get(addr, "/healthz").await, Ok((200, _))).then_some(())
        })
        .await;
        if let Some(status) = self.proc.try_wait() {
            panic!("devplane exited: {status}");
        }
    }

    /// Kills and starts devplane again on the same ports and state (same root CA).
    pub async fn restart(&mut self) {
        self.proc.kill();
        self.start_again().await;
    }

    /// Starts devplane again after [`Devplane::stop`], on the same ports and state (same root
    /// CA), and waits until it serves (an outage of a chosen length: stop, wait, start again).
    pub async fn start_again(&mut self) {
        self.proc.kill();
        self.proc = Self::spawn(
            self.dir.path(),
            self.grpc_addr,
            self.plaintext_addr,
            self.debug_addr,
        );
        self.wait_serving().await;
    }

    pub fn stop(&mut self) {
        self.proc.kill();
    }

    pub fn root_cert_path(&self) -> PathBuf {
        self.dir.path().join("state/root-cert.pem")
    }

    pub fn mesh_path(&self) -> PathBuf {
        self.dir.path().join("mesh.yaml")
    }

    pub fn write_mesh(&self, yaml: &str) {
        write_atomic(&self.mesh_path(), yaml.as_bytes());
    }

    /// Replaces the mesh through `POST /debug/mesh` (the file watch's path without its poll
    /// delay); returns when devplane published it, in Unix seconds.
    pub async fn post_mesh(&self, yaml: &str) -> f64 {
        let (status, body) =
            http_with_body("POST", self.debug_addr, "/debug/mesh", yaml.as_bytes())
                .await
                .unwrap();
        assert_eq!(status, 200, "POST /debug/mesh: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        v["unix_time"].as_f64().unwrap()
    }

    pub async fn token(&self, namespace: &str, service_account: &str, ttl_seconds: u64) -> String {
        let path = format!(
            "/debug/token?namespace={namespace}&serviceAccount={service_account}&ttlSeconds={ttl_seconds}"
        );
        let (status, body) = http_get(self.debug_addr, &path).await.unwrap();
        assert_eq!(status, 200, "token: {body}");
        body.trim().to_owned()
    }

    pub async fn debug_json(&self, path: &str) -> Value {
        let (status, body) = http_get(self.debug_addr, path).await.unwrap();
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str(&body).unwrap()
    }

    /// Serves `value` (a serialized resource, possibly malformed) as resource `name` of
    /// `type_url` to every client, through devplane's `POST /debug/resource`.
    pub async fn set_resource(&self, type_url: &str, name: &str, value: &[u8]) {
        let path = format!("/debug/resource?type={type_url}&name={name}");
        let (status, body) = http_with_body("POST", self.debug_addr, &path, value)
            .await
            .unwrap();
        assert_eq!(status, 200, "set_resource: {body}");
    }

    /// Live xDS clients as devplane sees them.
    pub async fn clients(&self) -> Vec<Value> {
        self.debug_json("/debug/clients").await["clients"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Live clients' ACKed versions per type (`/debug/acks`: no subscriptions, cheap).
    pub async fn acks(&self) -> Vec<Value> {
        self.debug_json("/debug/acks").await["clients"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}
