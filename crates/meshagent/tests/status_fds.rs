//! The status server out of file descriptors (its own test binary: it lowers the process's
//! `RLIMIT_NOFILE`). The server runs in this process with a connection cap above the limit, so
//! `accept` fails with EMFILE while a python peer holds idle connections and re-opens each one
//! that is closed: the accept loop must stay alive, free a descriptor by closing an idle
//! connection, not spin, and keep answering `/healthz/ready`.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use meshagent::metrics::Registry;
use meshagent::status::{self, MergeMetrics, Merger, StatusState};
use meshagent_testkit::{DEADLINE, Proc, free_port, wait_for};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const HOLDER: &str = r#"
import asyncio, resource, sys
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
async def hold(port):
    while True:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            await r.read()
            w.close()
        except OSError:
            await asyncio.sleep(0.02)
async def main(port, n):
    await asyncio.gather(*(hold(port) for _ in range(n)))
asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"#;

const LIMIT: u64 = 200;

/// Descriptors open in this process; `LIMIT` when none is left to list them with.
fn open_fds() -> u64 {
    match std::fs::read_dir("/proc/self/fd") {
        Ok(d) => d.count() as u64,
        Err(e) if e.raw_os_error() == Some(libc::EMFILE) => LIMIT,
        Err(e) => panic!("/proc/self/fd: {e}"),
    }
}

/// CPU time of this process (user + system) in clock ticks, from `/proc/self/stat` opened
/// before the descriptors ran out.
fn cpu_ticks(stat: &std::fs::File) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 4096];
    let n = stat.read_at(&mut buf, 0).unwrap();
    let stat = String::from_utf8_lossy(&buf[..n]);
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

async fn get_ready(sock: tokio::net::TcpSocket, addr: SocketAddr) -> Result<String, String> {
    let mut tcp = sock.connect(addr).await.map_err(|e| e.to_string())?;
    tcp.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    tcp.read_to_end(&mut buf).await.map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Running out of file descriptors, seen from `accept`: EMFILE neither ends the accept loop nor
/// makes it spin, and readiness keeps answering within 2 s.
#[tokio::test]
async fn accept_loop_survives_running_out_of_file_descriptors() {
    let registry = Registry::new();
    let metrics = MergeMetrics::register(&registry).unwrap();
    let merger = Merger::new(registry.clone(), metrics, None, Vec::new());
    let state = StatusState::new(registry, merger).unwrap();

    let port = free_port();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = status::bind(port).await.unwrap();
    let stop = CancellationToken::new();
    // A cap far above the descriptors this process has: accept runs out of them first.
    let server = tokio::spawn(status::serve_with_cap(
        listener,
        state,
        stop.clone(),
        100_000,
    ));

    // Everything this test needs later is opened now: no descriptor is left afterwards.
    let probes: Vec<tokio::net::TcpSocket> = (0..3)
        .map(|_| tokio::net::TcpSocket::new_v4().unwrap())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("python3");
    cmd.args(["-c", HOLDER, &port.to_string(), "400"]);
    let holder = Proc::spawn("holder", cmd, dir.path());
    let stat = std::fs::File::open("/proc/self/stat").unwrap();

    let (_, hard) =
        nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, LIMIT, hard)
        .unwrap();
    wait_for("the server to run out of descriptors", DEADLINE, || async {
        (open_fds() >= LIMIT - 5).then_some(())
    })
    .await;

    // No spinning while out of descriptors: well under half a core over a second.
    let (t0, c0) = (Instant::now(), cpu_ticks(&stat));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ticks_per_sec = 100.0; // USER_HZ on Linux
    let cpu = (cpu_ticks(&stat) - c0) as f64 / ticks_per_sec / t0.elapsed().as_secs_f64();

    let mut failures = Vec::new();
    for sock in probes {
        let started = Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(2), get_ready(sock, addr)).await;
        match r {
            Ok(Ok(resp)) if resp.starts_with("HTTP/1.1 200") => {}
            other => failures.push(format!("after {:?}: {other:?}", started.elapsed())),
        }
    }
    let alive = !server.is_finished();
    stop.cancel();
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    assert!(alive, "the accept loop ended");
    assert!(
        failures.is_empty(),
        "readiness not answered within 2 s while out of descriptors: {failures:?}\n{}",
        holder.log_text()
    );
    assert!(
        cpu < 0.5,
        "the accept loop used {cpu:.2} of a core while out of descriptors"
    );
}
