//! `meshagent debug bundle` against a running sidecar (agent, real Envoy, devplane as CA and
//! istiod): the archive holds the agent's views, Envoy's state, versions, recent log lines and
//! a manifest, a failing piece is a manifest line rather than a failed bundle, and no key,
//! token or `XDS_HEADER_*` value is anywhere in it.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::time::Duration;

use meshagent_testkit::{DEADLINE, Devplane, Sidecar, TwoWorkloads, free_port, workspace_bin};
use serde_json::Value;

const HEADER_SECRET: &str = "xds-header-credential-8c1f27d0";

/// Runs `meshagent debug bundle` (as a pod's `kubectl exec` would: the container's env and
/// working directory) and returns its exit status and stderr.
async fn bundle(sc: &Sidecar, out: &Path, extra: &[&str]) -> (bool, String) {
    let mut cmd = tokio::process::Command::new(workspace_bin("meshagent"));
    cmd.args(["debug", "bundle", "-o"])
        .arg(out)
        .arg(format!("--status-port={}", sc.status.port()))
        .args(extra)
        .current_dir(sc.cwd.path())
        .env("XDS_HEADER_AUTHORIZATION", HEADER_SECRET)
        .kill_on_drop(true);
    let o = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("debug bundle finishes within 120 s")
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The archive's files by path (without the top directory), and its raw decompressed bytes.
fn unpack(path: &Path) -> (BTreeMap<String, String>, Vec<u8>) {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_end(&mut raw)
        .unwrap();
    let mut files = BTreeMap::new();
    let mut ar = tar::Archive::new(raw.as_slice());
    for e in ar.entries().unwrap() {
        let mut e = e.unwrap();
        let name = e.path().unwrap().to_string_lossy().into_owned();
        let name = name
            .strip_prefix("meshagent-debug/")
            .unwrap_or_else(|| panic!("{name} outside meshagent-debug/"))
            .to_owned();
        let mut text = String::new();
        e.read_to_string(&mut text).unwrap();
        files.insert(name, text);
    }
    (files, raw)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// The base64 lines of a PEM block (what would leak if the key did).
fn pem_body_lines(pem: &str) -> Vec<String> {
    pem.lines()
        .filter(|l| !l.starts_with("-----") && l.len() >= 16)
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn bundle_has_the_views_and_no_secrets() {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let mut sc = Sidecar::start(
        &dp,
        "a",
        "default",
        "a",
        &[
            ("OUTPUT_CERTS", "var/run/secrets/output-certs".into()),
            ("XDS_HEADER_AUTHORIZATION", HEADER_SECRET.into()),
            ("CA_HEADER_X_API_KEY", format!("ca-{HEADER_SECRET}")),
            // The DNS proxy, for its views (the DNS table comes from devplane's NDS).
            ("ISTIO_META_DNS_CAPTURE", "true".into()),
            ("DNS_PROXY_ADDR", format!("127.0.0.1:{}", free_port())),
        ],
    )
    .await;
    sc.wait_ready(DEADLINE).await;
    let key_path = sc.cwd.path().join("var/run/secrets/output-certs/key.pem");
    let key = meshagent_testkit::wait_for("the workload key in OUTPUT_CERTS", DEADLINE, || {
        let p = key_path.clone();
        async move {
            std::fs::read_to_string(p)
                .ok()
                .filter(|k| k.contains("PRIVATE KEY"))
        }
    })
    .await;
    let token =
        std::fs::read_to_string(sc.cwd.path().join("var/run/secrets/tokens/istio-token")).unwrap();
    assert!(token.starts_with("eyJ"), "a JWT: {token}");

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bundle.tar.gz");
    let (ok, stderr) = bundle(&sc, &out, &[]).await;
    assert!(ok, "debug bundle failed: {stderr}");
    assert!(stderr.contains("wrote "), "{stderr}");
    let (files, raw) = unpack(&out);

    // The expected files, each listed in the manifest with its size.
    let manifest = &files["MANIFEST.txt"];
    for f in [
        "agent/config.json",
        "agent/certz.json",
        "agent/xdsz.json",
        "agent/dnsz.json",
        "agent/ndsz.json",
        "agent/logging.json",
        "agent/logs.txt",
        "agent/ready.txt",
        "envoy/config_dump.json",
        "envoy/certs.json",
        "envoy/clusters.txt",
        "envoy/stats.txt",
        "envoy/server_info.json",
        "envoy/listeners.txt",
        "envoy/init_dump.json",
        "envoy/ready.txt",
        "versions.json",
    ] {
        let body = files
            .get(f)
            .unwrap_or_else(|| panic!("{f} missing; manifest:\n{manifest}"));
        assert!(
            manifest.contains(&format!("{f}\t{}\t", body.len())),
            "{f} not in the manifest with its size:\n{manifest}"
        );
    }
    // Every file but the manifest is in it; every piece is either a file or an error line.
    for f in files.keys().filter(|f| *f != "MANIFEST.txt") {
        assert!(manifest.contains(&format!("{f}\t")), "{f}:\n{manifest}");
    }
    for l in manifest.lines().filter(|l| !l.starts_with('#')) {
        let (name, rest) = l.split_once('\t').unwrap();
        assert!(
            files.contains_key(name) || rest.starts_with("ERROR\t"),
            "{l}"
        );
    }
    // The network rules: the output, or why not (a binary missing is a note, not a failure).
    for f in ["net/iptables-save.txt", "net/nft-ruleset.txt"] {
        assert!(manifest.contains(&format!("{f}\t")), "{f}:\n{manifest}");
    }

    // Envoy's config dump parses, with its secrets, keys redacted.
    let dump: Value = serde_json::from_str(&files["envoy/config_dump.json"]).unwrap();
    let configs = dump["configs"].as_array().unwrap();
    let secrets = configs
        .iter()
        .find(|c| c["@type"].as_str().unwrap().ends_with("SecretsConfigDump"))
        .unwrap_or_else(|| panic!("no secrets dump in {dump:#}"));
    let active = secrets["dynamic_active_secrets"].as_array().unwrap();
    let default = active
        .iter()
        .find(|s| s["name"] == "default")
        .unwrap_or_else(|| panic!("no default secret in {secrets:#}"));
    assert_eq!(
        default["secret"]["tls_certificate"]["private_key"], "[redacted]",
        "{default:#}"
    );
    assert!(
        default["secret"]["tls_certificate"]["certificate_chain"].is_object(),
        "{default:#}"
    );
    // The agent's views and config are JSON; the config names the headers, not their values.
    let cfg: Value = serde_json::from_str(&files["agent/config.json"]).unwrap();
    assert_eq!(
        cfg["xds"]["headers"]["AUTHORIZATION"], "<redacted>",
        "{cfg:#}"
    );
    assert_eq!(cfg["identity"]["caHeaders"]["X_API_KEY"], "<redacted>");
    let ndsz: Value = serde_json::from_str(&files["agent/ndsz.json"]).unwrap();
    assert!(ndsz["table"].is_object(), "{ndsz:#}");
    let dnsz: Value = serde_json::from_str(&files["agent/dnsz.json"]).unwrap();
    assert!(dnsz.is_object(), "{dnsz:#}");
    let certz: Value = serde_json::from_str(&files["agent/certz.json"]).unwrap();
    assert!(certz["resources"].is_array(), "{certz:#}");
    assert!(files["agent/ready.txt"].starts_with("200\n"));
    assert!(files["envoy/ready.txt"].starts_with("200\nLIVE"));
    let versions: Value = serde_json::from_str(&files["versions.json"]).unwrap();
    assert!(
        versions["agent"]
            .as_str()
            .unwrap()
            .starts_with("meshagent "),
        "{versions:#}"
    );
    assert!(versions["envoy"].is_string(), "{versions:#}");
    assert!(files["envoy/clusters.txt"].contains("xds-grpc"));
    assert!(files["envoy/stats.txt"].contains("server.state"));

    // The agent's recent log lines, as it wrote them.
    let logs = &files["agent/logs.txt"];
    assert!(logs.contains("Effective config"), "{logs}");
    assert!(
        logs.lines().count() >= 5 && logs.lines().all(|l| l.starts_with("20")),
        "{logs}"
    );

    // Never keys or tokens, anywhere in the decompressed archive.
    for line in pem_body_lines(&key) {
        assert!(!contains(&raw, line.as_bytes()), "key line {line} leaked");
    }
    assert!(!contains(&raw, token.trim().as_bytes()), "token leaked");
    for part in token.trim().split('.') {
        assert!(!contains(&raw, part.as_bytes()), "token part {part} leaked");
    }
    assert!(!contains(&raw, HEADER_SECRET.as_bytes()), "header leaked");
    assert!(!contains(&raw, b"PRIVATE KEY-----\n"), "a PEM key");
    // The file is the owner's only.
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // Envoy's admin unreachable: the bundle is still written, the failures are noted.
    let out2 = dir.path().join("partial.tar.gz");
    let dead = free_port().to_string();
    let (ok, stderr) = bundle(
        &sc,
        &out2,
        &["--admin-port", &dead, "--timeout=2s", "--log-lines=3"],
    )
    .await;
    assert!(ok, "debug bundle failed: {stderr}");
    let (files, _) = unpack(&out2);
    let manifest = &files["MANIFEST.txt"];
    for f in [
        "envoy/config_dump.json",
        "envoy/stats.txt",
        "envoy/certs.json",
    ] {
        assert!(
            manifest.contains(&format!("{f}\tERROR\t")) && !files.contains_key(f),
            "{f}:\n{manifest}"
        );
    }
    assert!(manifest.contains("connect failed"), "{manifest}");
    assert!(files.contains_key("agent/certz.json"), "{manifest}");
    assert_eq!(files["agent/logs.txt"].lines().count(), 3);
    let versions: Value = serde_json::from_str(&files["versions.json"]).unwrap();
    assert!(versions["envoy"].is_null(), "{versions:#}");
}
