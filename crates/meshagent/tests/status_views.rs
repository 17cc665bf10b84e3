//! The operability views on the status port against a real Envoy and devplane:
//! `/debug/certz`, `/debug/xdsz`, `/logging` and the HTML page at `/` (rendered by a real
//! headless Chromium, `make chromiumpeers`), including failure states (CA down, a NACK). The
//! loopback rule (403 from any other peer) is unit-tested in `status.rs`.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use meshagent_proto::envoy::pb::envoy::config::cluster::v3::Cluster;
use meshagent_proto::type_url;
use meshagent_testkit::{
    DEADLINE, Devplane, Sidecar, TwoWorkloads, free_port, http, http_get, wait_for, workspace_root,
};
use prost::Message;
use serde_json::Value;

async fn get_json(addr: SocketAddr, path: &str) -> Option<Value> {
    match http_get(addr, path).await {
        Ok((200, b)) => serde_json::from_str(&b).ok(),
        _ => None,
    }
}

fn resource<'a>(certz: &'a Value, name: &str) -> &'a Value {
    certz["resources"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {certz:#}"))
}

fn rfc3339_secs(t: &str) -> i64 {
    // `2026-12-06T22:22:25.330563Z`: days from civil (Howard Hinnant's algorithm).
    let (date, rest) = t.split_once('T').unwrap();
    let d: Vec<i64> = date.split('-').map(|x| x.parse().unwrap()).collect();
    let hms: Vec<i64> = rest
        .trim_end_matches('Z')
        .split('.')
        .next()
        .unwrap()
        .split(':')
        .map(|x| x.parse().unwrap())
        .collect();
    let (y, m, day) = (if d[1] <= 2 { d[0] - 1 } else { d[0] }, d[1], d[2]);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    days * 86_400 + hms[0] * 3600 + hms[1] * 60 + hms[2]
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn artifacts() -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
        .join("test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs headless Chromium on `url` with `args`, off the runtime thread, bounded.
async fn chromium(url: &str, args: &[String]) -> (bool, String, String) {
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new("chromium");
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .args(args)
    .arg(url)
    .kill_on_drop(true)
    .stdin(std::process::Stdio::null());
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("chromium finishes within 120 s")
        .expect("chromium runs (make chromiumpeers)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A cluster Envoy must reject: a negative connect timeout fails proto validation.
fn bad_cluster() -> Vec<u8> {
    Cluster {
        name: "status-views-bad".into(),
        connect_timeout: Some(meshagent_proto::google::protobuf::Duration {
            seconds: -1,
            nanos: 0,
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

#[tokio::test(flavor = "multi_thread")]
async fn views_show_identity_xds_logging_and_render_in_a_browser() {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    let mut sc = Sidecar::start(
        &dp,
        "a",
        "default",
        "a",
        &[("OUTPUT_CERTS", "var/run/secrets/output-certs".into())],
    )
    .await;
    sc.wait_ready(DEADLINE).await;
    let status = SocketAddr::from(([127, 0, 0, 1], sc.status.port()));

    // certz: the workload certificate and roots, Available.
    let certz = wait_for(
        "certz with an Available default, written to OUTPUT_CERTS",
        DEADLINE,
        || async {
            let c = get_json(status, "/debug/certz").await?;
            (resource(&c, "default")["state"] == "Available"
                && c["outputCerts"]["state"] == "Available")
                .then_some(c)
        },
    )
    .await;
    assert_eq!(certz["outputCerts"]["current"], true, "{certz:#}");
    assert_eq!(
        certz["outputCerts"]["certificate"]["serial"],
        resource(&certz, "default")["certificate"]["serial"]
    );
    let default = resource(&certz, "default");
    let cert = &default["certificate"];
    assert!(
        cert["sans"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s.as_str().unwrap().ends_with("/ns/default/sa/a")),
        "{certz:#}"
    );
    assert!(cert["serial"].as_str().unwrap().len() > 2, "{certz:#}");
    assert!(
        cert["keyType"].as_str().unwrap().starts_with("RSA"),
        "{certz:#}"
    );
    assert!(default["nextRotation"].is_string(), "{certz:#}");
    assert_eq!(default["source"]["kind"], "ca");
    assert!(
        default["source"]["caAddress"]
            .as_str()
            .unwrap()
            .contains(&dp.grpc_addr.port().to_string())
    );
    let roots = resource(&certz, "ROOTCA")["roots"]
        .as_array()
        .unwrap()
        .clone();
    assert!(
        !roots.is_empty() && roots[0]["notAfter"].is_string(),
        "{certz:#}"
    );
    assert!(!certz.to_string().contains("PRIVATE KEY"));
    // Agrees with istio_agent_cert_expiry_seconds.
    let not_after = cert["notAfter"].as_str().unwrap().to_owned();
    let (code, metrics) = http_get(status, "/stats/prometheus").await.unwrap();
    assert_eq!(code, 200);
    let metric: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("istio_agent_cert_expiry_seconds{resource_name=\"default\"} "))
        .unwrap_or_else(|| panic!("no expiry metric in {metrics}"))
        .trim()
        .parse()
        .unwrap();
    let from_certz = rfc3339_secs(&not_after) - now_secs();
    assert!(
        (metric as i64 - from_certz).abs() <= 5,
        "metric {metric} vs certz {from_certz} ({not_after})"
    );

    // xdsz: Envoy's stream, its node and ACKed types.
    let xdsz = wait_for(
        "xdsz with ACKed clusters and listeners",
        DEADLINE,
        || async {
            let x = get_json(status, "/debug/xdsz").await?;
            let acked = |t: &str| {
                x["clients"].as_array().into_iter().flatten().any(|c| {
                    c["types"].as_array().into_iter().flatten().any(|ty| {
                        ty["typeUrl"] == t && ty["state"] == "ACK" && ty["acks"].as_u64() > Some(0)
                    })
                })
            };
            (acked(type_url::CLUSTER) && acked(type_url::LISTENER)).then_some(x)
        },
    )
    .await;
    assert_eq!(xdsz["upstream"]["state"], "CONNECTED", "{xdsz:#}");
    let envoy = &xdsz["clients"][0];
    assert!(
        envoy["node"].as_str().unwrap().starts_with("sidecar~"),
        "{xdsz:#}"
    );

    // A NACK: devplane serves a cluster Envoy rejects; xdsz carries Envoy's error detail.
    dp.set_resource(type_url::CLUSTER, "status-views-bad", &bad_cluster())
        .await;
    let nack = wait_for("xdsz to show Envoy's CDS NACK", DEADLINE, || async {
        let x = get_json(status, "/debug/xdsz").await?;
        x["clients"].as_array()?.iter().find_map(|c| {
            c["types"].as_array()?.iter().find_map(|t| {
                (t["typeUrl"] == type_url::CLUSTER && t["state"] == "NACK")
                    .then(|| t["nack"].clone())
            })
        })
    })
    .await;
    // Envoy's own words (its proto validation of the negative connect timeout).
    let detail = nack["errorDetail"].as_str().unwrap();
    assert!(detail.contains("Expected positive duration"), "{nack:#}");
    assert_eq!(nack["byAgent"], false);

    // /logging: read, change, reject a bad level, reset.
    let levels = get_json(status, "/logging").await.unwrap();
    assert_eq!(levels["xdsproxy"], "info", "{levels}");
    assert_eq!(levels["grpc"], "none", "{levels}");
    let (code, body) = http("POST", status, "/logging?level=xdsproxy:debug,dns:warn")
        .await
        .unwrap();
    assert_eq!(code, 200, "{body}");
    let levels = get_json(status, "/logging").await.unwrap();
    assert_eq!(
        (&levels["xdsproxy"], &levels["dns"]),
        (&Value::from("debug"), &Value::from("warn"))
    );
    let (code, body) = http("POST", status, "/logging?level=xdsproxy:bogus")
        .await
        .unwrap();
    assert_eq!((code, body.trim()), (400, "invalid output level 'bogus'"));
    wait_for("the level change logged at info", DEADLINE, || async {
        sc.proc
            .log_text()
            .contains("log levels changed through /logging")
            .then_some(())
    })
    .await;
    let (code, _) = http("POST", status, "/logging?reset").await.unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        get_json(status, "/logging").await.unwrap()["xdsproxy"],
        "info"
    );

    // The loopback rule (403 for every view from a non-loopback peer, readiness open) is
    // checked by the status server's unit tests with a non-loopback peer address; this test
    // reaches the port from loopback only.

    // The page, in a real browser.
    let url = format!("http://127.0.0.1:{}/", sc.status.port());
    let (ok, dom, err) = chromium(&url, &["--dump-dom".to_owned()]).await;
    assert!(ok, "chromium --dump-dom failed: {err}");
    assert!(dom.contains("Available"), "{dom}");
    assert!(
        dom.contains(&not_after),
        "page shows the expiry {not_after}: {dom}"
    );
    assert!(dom.contains("ready"), "{dom}");
    let shot = artifacts().join("status_page.png");
    let _ = std::fs::remove_file(&shot);
    let (ok, _, err) = chromium(
        &url,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1200,900".to_owned(),
            "--hide-scrollbars".to_owned(),
        ],
    )
    .await;
    assert!(ok, "chromium --screenshot failed: {err}");
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "{}",
        shot.display()
    );
    eprintln!("status page screenshot: {}", shot.display());
}

#[tokio::test(flavor = "multi_thread")]
async fn certz_reports_failing_with_the_error_while_the_ca_is_down() {
    let dp = Devplane::start(&TwoWorkloads::new().yaml(false)).await;
    // Nothing listens on the CA address: every CSR fails.
    let dead = format!("localhost:{}", free_port());
    let sc = Sidecar::start(&dp, "a", "default", "a", &[("CA_ADDR", dead.clone())]).await;
    let status = SocketAddr::from(([127, 0, 0, 1], sc.status.port()));
    let certz = wait_for("certz to report the CA failure", DEADLINE, || async {
        let c = get_json(status, "/debug/certz").await?;
        (resource(&c, "default")["state"] == "Failing").then_some(c)
    })
    .await;
    let d = resource(&certz, "default");
    assert!(
        d["lastError"].as_str().is_some_and(|e| !e.is_empty()),
        "{certz:#}"
    );
    assert!(d["nextRetry"].is_string(), "{certz:#}");
    assert!(d["certificate"].is_null(), "{certz:#}");
    assert_eq!(d["source"]["caAddress"], dead.as_str());
    // Readiness says why, and the page shows the failure.
    let (code, reason) = http_get(status, "/healthz/ready").await.unwrap();
    assert_eq!(code, 503, "{reason}");
    let (code, page) = http_get(status, "/").await.unwrap();
    assert_eq!(code, 200);
    assert!(
        page.contains(">Failing<") && page.contains("not ready"),
        "{page}"
    );
}
