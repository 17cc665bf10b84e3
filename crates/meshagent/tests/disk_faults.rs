//! Every file the agent writes, on a full disk and on a read-only filesystem: real tmpfs
//! mounts (the tests run as root), the real agent binary, devplane as istiod and CA.
//!
//! What a user should see:
//! * OUTPUT_CERTS: a failed write leaves no partial generation, is retried with backoff until
//!   it succeeds (not at the next rotation, hours later), and while the files are the
//!   certificate's only consumer (`DISABLE_ENVOY`) readiness names the failure;
//! * Envoy's and gRPC's bootstraps, written once at start: the agent exits non-zero with an
//!   error naming the file and the system's reason, and leaves no temporary file behind.
//!
//! The Wasm cache's own disk faults are tested with the Wasm cache (`tests/wasm_fetch.rs`).
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use meshagent_testkit::{Devplane, Sidecar, http_get, json, wait_for, workspace_root};

const DEADLINE: Duration = Duration::from_secs(30);

/// A tmpfs mounted at `path` for the test's lifetime (lazily unmounted on drop, so a test
/// that fails while a process still holds a file there does not leave the mount behind).
struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    fn mount(path: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(path).unwrap();
        run(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ],
            path,
        );
        Tmpfs {
            path: path.to_path_buf(),
        }
    }

    fn remount(&self, opt: &str) {
        run("mount", &["-o", &format!("remount,{opt}")], &self.path);
    }

    /// Fills the filesystem but for `leave` bytes (whole pages: tmpfs counts pages).
    fn fill(&self, leave: u64) -> PathBuf {
        use std::io::Write as _;
        let filler = self.path.join(".filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        let page = [0u8; 4096];
        let mut len = 0u64;
        while f.write_all(&page).is_ok() {
            len += 4096;
        }
        f.set_len(len.saturating_sub(leave)).unwrap();
        filler
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

fn run(cmd: &str, args: &[&str], path: &Path) {
    let out = Command::new(cmd).args(args).arg(path).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?} {}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn devplane() -> Devplane {
    let mesh = std::fs::read_to_string(workspace_root().join("examples/mesh.yaml")).unwrap();
    Devplane::start(&mesh).await
}

/// The proxyless agent of Istio's `grpc-agent` template: OUTPUT_CERTS is where its
/// application reads the certificate from.
fn proxyless_env(out: &Path) -> Vec<(&'static str, String)> {
    vec![
        ("DISABLE_ENVOY", "true".into()),
        ("OUTPUT_CERTS", out.display().to_string()),
        ("ECC_SIGNATURE_ALGORITHM", "ECDSA".into()),
    ]
}

/// Entries of `dir` whose names start with `..` (generations and the `..data` link).
fn generations(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".."))
        .collect()
}

async fn ready(agent: &Sidecar) -> (u16, String) {
    http_get(agent.status, "/healthz/ready")
        .await
        .unwrap_or((0, String::new()))
}

async fn metric(agent: &Sidecar, name: &str) -> f64 {
    let (_, body) = http_get(agent.status, "/stats/prometheus").await.unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits for readiness to fail naming OUTPUT_CERTS; checks no partial generation is left.
async fn fails_cleanly(agent: &Sidecar, out: &Path, reason: &str) {
    let body = wait_for("readiness naming OUTPUT_CERTS", DEADLINE, || async {
        let (code, body) = ready(agent).await;
        (code == 503 && body.contains("OUTPUT_CERTS")).then_some(body)
    })
    .await;
    assert!(body.contains(reason), "{body}");
    assert_eq!(
        generations(out),
        Vec::<String>::new(),
        "a partial generation was left"
    );
    assert!(metric(agent, "istio_agent_output_certs_write_failures_total").await >= 1.0);
}

/// Once the fault is gone, the next retry (backoff at most 30 s) writes the set.
async fn recovers(agent: &Sidecar, out: &Path) {
    wait_for(
        "ready once the disk is writable",
        Duration::from_secs(45),
        || async { (ready(agent).await.0 == 200).then_some(()) },
    )
    .await;
    let chain = std::fs::read_to_string(out.join("cert-chain.pem")).unwrap();
    assert!(chain.contains("BEGIN CERTIFICATE"), "{chain}");
    let key = std::fs::read_to_string(out.join("key.pem")).unwrap();
    assert!(key.contains("PRIVATE KEY"));
    assert_eq!(
        metric(agent, "istio_agent_output_certs_writes_total").await,
        1.0
    );
}

/// On ENOSPC the agent left `..<ts>/` with a complete `key.pem` and an empty
/// `cert-chain.pem` and tried again only at the next rotation, while readiness stayed 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_certs_on_a_full_disk_are_retried_until_written() {
    let dp = devplane().await;
    let cwd = tempfile::tempdir().unwrap();
    let out = cwd.path().join("out");
    let fs = Tmpfs::mount(&out, "64k");
    // One page left: the key fits, the chain does not (the reported partial generation).
    let filler = fs.fill(4096);
    let env = proxyless_env(&out);
    let token = dp.token("default", "a", 3600).await;
    let agent = Sidecar::start_in(cwd, &dp, "a", "default", "a", &env, json!({}), &token).await;
    fails_cleanly(&agent, &out, "No space left on device").await;
    std::fs::remove_file(filler).unwrap();
    recovers(&agent, &out).await;
}

/// A read-only filesystem is retried the same way, until it is writable again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_certs_on_a_read_only_filesystem_are_retried_until_written() {
    let dp = devplane().await;
    let cwd = tempfile::tempdir().unwrap();
    let out = cwd.path().join("out");
    let fs = Tmpfs::mount(&out, "1m");
    fs.remount("ro");
    let env = proxyless_env(&out);
    let token = dp.token("default", "a", 3600).await;
    let agent = Sidecar::start_in(cwd, &dp, "a", "default", "a", &env, json!({}), &token).await;
    fails_cleanly(&agent, &out, "Read-only file system").await;
    fs.remount("rw");
    recovers(&agent, &out).await;
}

/// L4: the OUTPUT_CERTS directory is created 0700 (not with the umask's mode) when the key
/// is only for the agent's uid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_output_certs_directory_is_created_0700() {
    use std::os::unix::fs::PermissionsExt as _;
    let dp = devplane().await;
    let cwd = tempfile::tempdir().unwrap();
    let out = cwd.path().join("exported/certs");
    let env = proxyless_env(&out);
    let token = dp.token("default", "a", 3600).await;
    let mut agent = Sidecar::start_in(cwd, &dp, "a", "default", "a", &env, json!({}), &token).await;
    agent.wait_ready(DEADLINE).await;
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{mode:o}");
}

/// How a start whose bootstrap cannot be written ends.
async fn start_fails(cwd: tempfile::TempDir, env: &[(&str, String)], file: &str, reason: &str) {
    let dp = devplane().await;
    let dir = cwd.path().join("etc/istio/proxy");
    let token = dp.token("default", "a", 3600).await;
    let mut agent = Sidecar::start_in(cwd, &dp, "a", "default", "a", env, json!({}), &token).await;
    let status = wait_for("the agent to exit", DEADLINE, || {
        let s = agent.proc.try_wait();
        async move { s }
    })
    .await;
    let log = agent.proc.log_text();
    assert!(!status.success(), "exit {status}\n{log}");
    assert!(
        log.contains(file) && log.contains(reason),
        "the error names {file} and {reason:?}:\n{log}"
    );
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

/// Envoy's bootstrap on a full disk: a clear startup error, nothing half-written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_bootstrap_on_a_full_disk_is_a_clear_startup_error() {
    let cwd = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(&cwd.path().join("etc/istio/proxy"), "64k");
    fs.fill(0);
    // The gRPC bootstrap (same directory, written first) is tested on its own below.
    let env = [("GRPC_XDS_BOOTSTRAP", String::new())];
    start_fails(cwd, &env, "envoy-rev.json", "No space left on device").await;
}

/// The gRPC bootstrap on a full disk: a clear startup error, nothing half-written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_bootstrap_on_a_full_disk_is_a_clear_startup_error() {
    let cwd = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(&cwd.path().join("etc/istio/proxy"), "64k");
    fs.fill(0);
    start_fails(cwd, &[], "grpc-bootstrap.json", "No space left on device").await;
}

/// A read-only `etc/istio/proxy`: the start fails naming the path (the XDS socket or a
/// bootstrap, whichever the agent creates first) and the filesystem's reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_proxy_config_dir_is_a_clear_startup_error() {
    let cwd = tempfile::tempdir().unwrap();
    let fs = Tmpfs::mount(&cwd.path().join("etc/istio/proxy"), "1m");
    fs.remount("ro");
    start_fails(cwd, &[], "etc/istio/proxy", "Read-only file system").await;
}

/// A long-lived task that dies is never silent (it used to be joined with `let _ = t.await`
/// and readiness kept its last status): readiness fails naming the task and its panic, an
/// ERROR line says so, and `istio_agent_task_panics_total` counts it. The panic is injected
/// through the debug build's `MESHAGENT_TEST_PANIC` hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_secret_manager_is_visible_in_readiness_logs_and_metrics() {
    let dp = devplane().await;
    let cwd = tempfile::tempdir().unwrap();
    let out = cwd.path().join("out");
    let mut env = proxyless_env(&out);
    env.push(("MESHAGENT_TEST_PANIC", "secret-manager".into()));
    let token = dp.token("default", "a", 3600).await;
    let agent = Sidecar::start_in(cwd, &dp, "a", "default", "a", &env, json!({}), &token).await;
    let body = wait_for("readiness naming the dead task", DEADLINE, || async {
        let (code, body) = ready(&agent).await;
        (code == 503 && body.contains("secret-manager")).then_some(body)
    })
    .await;
    assert!(body.contains("agent task secret-manager died"), "{body}");
    assert_eq!(metric(&agent, "istio_agent_task_panics_total").await, 1.0);
    let log = agent.proc.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("\terror\t") && l.contains("long-lived task panicked")),
        "{log}"
    );
}
