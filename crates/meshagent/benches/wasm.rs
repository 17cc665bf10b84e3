//! Wasm fetch benchmark, same run, loopback only:
//!
//! * a 50 MiB module fetched over HTTP from `python3 -m http.server` (a separate process):
//!   the bench process's peak RSS growth during the cold ECDS conversion (Linux `VmHWM`,
//!   reset through `/proc/self/clear_refs` first) — the download streams to disk;
//! * time to the rewritten ECDS response (cold cache) vs `curl -o <file>` of the same file
//!   into the same file system
//!   (median of 5 each, interleaved);
//! * ECDS conversion with the module cached: p50/p99 over 2,000 conversions.
//!
//! The converter runs on a current-thread runtime, as in the agent.
//! `cargo bench -p meshagent --bench wasm` (or `make bench`); needs python3 and curl.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::print_stdout)] // a benchmark binary, not the agent
#![allow(clippy::disallowed_types)] // std Instant: wall-clock timing of a benchmark

#[path = "support/mem.rs"]
mod mem;
use mem::status_kib;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use meshagent::metrics::Registry;
use meshagent::wasm::convert::{self, Converter};
use meshagent::wasm::{WasmOptions, start};

const MODULE_BYTES: usize = 50 << 20;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn converter(dir: &std::path::Path) -> (std::sync::Arc<Converter>, meshagent::tasks::Tasks) {
    let cfg = meshagent::config::WasmConfig {
        insecure_registries: vec![],
        module_expiry: Duration::from_secs(86400),
        purge_interval: Duration::from_secs(3600),
        http_request_timeout: Duration::from_secs(15),
        http_request_max_retries: 5,
        max_binary_size_bytes: 256 << 20,
        blocked_cidrs: vec![],
        remote_load_conversion: true,
        docker_config: None,
    };
    let tasks = meshagent::tasks::Tasks::new();
    let c = start(
        WasmOptions {
            dir: dir.to_owned(),
            cfg,
            mesh_root: None,
            docker_config: None,
        },
        &Registry::new(),
        &tasks,
        tokio_util::sync::CancellationToken::new(),
    )
    .unwrap();
    (c, tasks)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let srv_dir = tempfile::tempdir().unwrap();
    let mut f = std::fs::File::create(srv_dir.path().join("big.wasm")).unwrap();
    let mut module = b"\0asm\x01\0\0\0".to_vec();
    // Incompressible-looking content (no gzip path involved; the bytes only need hashing).
    let mut x: u64 = 0x9e3779b97f4a7c15;
    while module.len() < MODULE_BYTES {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        module.extend_from_slice(&x.to_le_bytes());
    }
    f.write_all(&module).unwrap();
    drop(f);
    let sha = meshagent::wasm::unpack::sha256_hex(&module);
    drop(module);

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _srv = Server(
        Command::new("python3")
            .args([
                "-m",
                "http.server",
                "--bind",
                "127.0.0.1",
                &port.to_string(),
            ])
            .current_dir(srv_dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3"),
    );
    let url = format!("http://127.0.0.1:{port}/big.wasm");
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let msg = convert::sotw_response(
        "v1",
        "n1",
        vec![convert::remote_wasm_resource(
            "default.big",
            &url,
            &sha,
            BTreeMap::new(),
            false,
        )],
    );

    // Warm the server's page cache and the client code paths once.
    let warm = tempfile::tempdir().unwrap();
    let (c, _t) = converter(warm.path());
    rt.block_on(c.convert_response(false, &msg)).unwrap();

    // 1. Peak RSS growth of a cold conversion.
    let cold = tempfile::tempdir().unwrap();
    let (c, _t2) = converter(cold.path());
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let base = status_kib(std::process::id(), "VmRSS:") as u64;
    let hwm_reset = status_kib(std::process::id(), "VmHWM:") as u64;
    rt.block_on(c.convert_response(false, &msg)).unwrap();
    let peak = status_kib(std::process::id(), "VmHWM:") as u64;
    let growth_kib = peak.saturating_sub(base.max(hwm_reset.min(base)));
    println!(
        "wasm fetch 50 MiB: RSS before {base} KiB, peak during {peak} KiB, growth {growth_kib} KiB ({:.2} MiB; goal <= 2 MiB)",
        growth_kib as f64 / 1024.0
    );

    // 2. Time to the rewritten ECDS (cold cache each time) vs curl, interleaved.
    let (mut agent, mut curl) = (vec![], vec![]);
    for _ in 0..5 {
        let d = tempfile::tempdir().unwrap();
        let (c, _t) = converter(d.path());
        let t = Instant::now();
        rt.block_on(c.convert_response(false, &msg)).unwrap();
        agent.push(t.elapsed().as_secs_f64() * 1000.0);
        // curl saves the file too (on the same file system), as the agent does.
        let out = d.path().join("curl.wasm");
        let t = Instant::now();
        let st = Command::new("curl")
            .args(["-s", "-o", out.to_str().unwrap(), &url])
            .status()
            .expect("curl");
        assert!(st.success());
        curl.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let (a, k) = (median(agent), median(curl));
    println!(
        "wasm fetch 50 MiB: rewritten ECDS after {a:.1} ms, curl download {k:.1} ms, ratio {:.2}x (goal <= 1.1x)",
        a / k
    );

    // 3. Conversion with the module cached.
    let small = convert::sotw_response(
        "v1",
        "n1",
        vec![convert::remote_wasm_resource(
            "default.big",
            &url,
            &sha,
            BTreeMap::new(),
            false,
        )],
    );
    let mut lat = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let t = Instant::now();
        rt.block_on(c.convert_response(false, &small)).unwrap();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    println!(
        "wasm cached conversion: p50 {:.1} us, p99 {:.1} us (goal p50 <= 1 ms)",
        lat[lat.len() / 2],
        lat[lat.len() * 99 / 100]
    );
}
