//! Downstream stream churn (proxyless clients opening and closing xDS streams): memory goes
//! back to where it was, and the log does not get a line per stream. Its own test binary, so
//! the process's RSS is this test's alone.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

mod xds_support;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshagent_proto::type_url;
use meshagent_testkit::{DEADLINE, Devplane};
use xds_support::*;

/// The process's anonymous resident memory (`RssAnon`: heap, stacks), what a leak or a
/// retained buffer grows. Not VmRSS: its file-backed part moves with the code the run happens
/// to execute (a loaded machine takes timeout and flow-control paths an idle one does not,
/// faulting their pages in), which says nothing about memory held per stream.
fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kb * 1024
}

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// `count` streams on `channel`, `at_once` at a time: each asks for CDS, reads the first
/// response and closes.
async fn churn(channel: &tonic::transport::Channel, count: usize, at_once: usize) {
    let mut done = 0;
    while done < count {
        let batch = at_once.min(count - done);
        let mut tasks = Vec::new();
        for _ in 0..batch {
            let ch = channel.clone();
            tasks.push(tokio::spawn(async move {
                let (tx, stream) = raw_sotw_on(ch).await;
                let mut stream = stream.unwrap();
                tx.send(sotw_request(type_url::CLUSTER, vec![], None))
                    .await
                    .unwrap();
                tokio::time::timeout(Duration::from_secs(30), stream.message())
                    .await
                    .expect("a CDS response within 30 s")
                    .unwrap()
                    .unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        done += batch;
    }
}

#[test]
fn q7_stream_churn_returns_memory_and_logs_no_line_per_stream() {
    meshagent::malloc::configure();
    let log = Log::default();
    let writer = log.clone();
    tracing::subscriber::set_global_default(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish(),
    )
    .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dp = Devplane::start(&mesh_yaml(false)).await;
        let dir = tempfile::tempdir().unwrap();
        let agent = agent_for(&dp, dir.path(), &[]).await;
        tokio::spawn(meshagent::malloc::trimmer(agent.shutdown.clone()));
        let channel = socket_channel(agent.handle.socket());
        // One stream stays open for the whole test, as a client's long-lived ADS stream
        // would: the churning streams share its connections (downstream and upstream).
        let (anchor_tx, anchor) = raw_sotw_on(channel.clone()).await;
        let mut anchor = anchor.unwrap();
        anchor_tx
            .send(sotw_request(type_url::CLUSTER, vec![], None))
            .await
            .unwrap();
        anchor.message().await.unwrap().unwrap();
        // Warm up (runtime, TLS, allocator), then the baseline after a trim.
        churn(&channel, 200, 50).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        meshagent::malloc::trim();
        let start = rss_bytes();
        let lines_before = log.text().lines().count();

        churn(&channel, 5_000, 50).await;
        let after_churn = rss_bytes();
        // Back within 2 MiB of the start once the churn is over (the agent trims after it).
        let settled = tokio::time::timeout(DEADLINE, async {
            loop {
                let now = rss_bytes();
                if now <= start + (2 << 20) {
                    break now;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await;
        let text = log.text();
        let churn_lines: Vec<&str> = text.lines().skip(lines_before).collect();
        eprintln!(
            "RssAnon {} KiB at start, {} KiB after 5,000 streams, settled: {:?} KiB; {} log lines during the churn",
            start >> 10,
            after_churn >> 10,
            settled.as_ref().map(|b| b >> 10).ok(),
            churn_lines.len()
        );
        assert!(
            settled.is_ok(),
            "RssAnon stayed at {} KiB after the churn (started at {} KiB)",
            rss_bytes() >> 10,
            start >> 10
        );
        // Not one line per stream: a handful at most for 5,000 streams.
        assert!(
            churn_lines.len() < 20,
            "{} log lines for 5,000 streams, e.g.:\n{}",
            churn_lines.len(),
            churn_lines.iter().take(5).copied().collect::<Vec<_>>().join("\n")
        );
        drop(anchor_tx);
        agent.shutdown.cancel();
    });
}
