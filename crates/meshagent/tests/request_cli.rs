//! `meshagent request` against a real HTTP peer on its fixed debug port (127.0.0.1:15000),
//! each test in a network namespace of its own so the port is free and nothing else on the
//! machine is reached: a 100 MiB body streams through in bounded memory, and a body cut
//! short (Content-Length not reached, a broken chunked encoding) exits non-zero naming the
//! problem.
#![allow(
    clippy::disallowed_methods,
    reason = "test and benchmark code, not on the agent's runtime"
)]
#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;

const MIB: usize = 1024 * 1024;

fn meshagent() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshagent"))
}

/// In a new network namespace (entered by a helper thread only: namespaces are per thread):
/// binds 127.0.0.1:15000 and starts `meshagent request <args>`, which inherits the namespace.
fn in_netns(args: &'static [&'static str]) -> (TcpListener, Child) {
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
        let up = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("run ip");
        assert!(up.success(), "ip link set lo up: {up}");
        let listener = TcpListener::bind("127.0.0.1:15000").unwrap();
        let child = Command::new(meshagent())
            .arg("request")
            .args(args)
            .env_clear()
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        (listener, child)
    })
    .join()
    .unwrap()
}

/// Accepts one connection, reads the request head, writes `head` and then `body(stream)`.
fn serve(
    listener: TcpListener,
    head: String,
    body: impl FnOnce(&mut TcpStream) + Send + 'static,
) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut req = Vec::new();
        let mut buf = [0u8; 4096];
        while !req.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "client closed before sending a request");
            req.extend_from_slice(&buf[..n]);
        }
        // The client may be gone already when a test makes it fail; ignore write errors.
        let _ = s.write_all(head.as_bytes());
        body(&mut s);
        let _ = s.shutdown(Shutdown::Write);
        String::from_utf8_lossy(&req).into_owned()
    })
}

/// The byte at offset `i` of the served body (period 23: a dropped or repeated 4 KiB-aligned
/// piece shows).
fn pattern(i: usize) -> u8 {
    b'a' + (i % 23) as u8
}

fn vm_kib(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{key} missing in {status}"))
}

fn stderr_of(child: &mut Child) -> String {
    let mut e = String::new();
    child.stderr.take().unwrap().read_to_string(&mut e).unwrap();
    e
}

#[test]
fn hundred_mib_config_dump_streams_with_bounded_memory() {
    const SIZE: usize = 100 * MIB;
    let (listener, mut child) = in_netns(&["GET", "config_dump"]);
    let server = serve(
        listener,
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {SIZE}\r\n\r\n"
        ),
        |s| {
            // A whole number of pattern periods, so every chunk continues the pattern.
            let chunk: Vec<u8> = (0..23 * 4096).map(pattern).collect();
            let mut sent = 0;
            while sent < SIZE {
                let n = chunk.len().min(SIZE - sent);
                if s.write_all(&chunk[..n]).is_err() {
                    return;
                }
                sent += n;
            }
        },
    );
    let pid = child.id();
    let mut out = child.stdout.take().unwrap();
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0usize;
    let mut hwm_kib = None;
    loop {
        let n = out.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        for (k, b) in buf[..n].iter().enumerate() {
            assert_eq!(*b, pattern(got + k), "byte {} of the body", got + k);
        }
        got += n;
        // Nearly all of the body has passed through while the agent is still running
        // (blocked writing to our pipe): had it buffered the body, its peak RSS shows it now.
        if hwm_kib.is_none() && got >= SIZE - 4 * MIB {
            hwm_kib = Some(vm_kib(pid, "VmHWM:"));
        }
    }
    let status = child.wait().unwrap();
    let err = stderr_of(&mut child);
    let req = server.join().unwrap();
    assert!(status.success(), "exit {status}: {err}");
    assert!(req.starts_with("GET /config_dump HTTP/1.1\r\n"), "{req}");
    assert_eq!(got, SIZE, "{err}");
    let hwm = hwm_kib.unwrap();
    eprintln!("peak RSS while streaming 100 MiB: {hwm} KiB");
    assert!(
        hwm < 64 * 1024,
        "peak RSS {hwm} KiB while streaming a 100 MiB body"
    );
}

#[test]
fn content_length_not_reached_exits_nonzero() {
    let (listener, child) = in_netns(&["GET", "config_dump"]);
    let server = serve(
        listener,
        "HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n".to_owned(),
        |s| {
            let _ = s.write_all(&[b'x'; 1000]);
        },
    );
    let out = child.wait_with_output().unwrap();
    server.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("http://127.0.0.1:15000/config_dump")
            && err.contains("incomplete response body after 1000 bytes")
            && err.contains("message length"),
        "{err}"
    );
}

#[test]
fn broken_chunked_body_exits_nonzero() {
    let (listener, child) = in_netns(&["GET", "/config_dump"]);
    let server = serve(
        listener,
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_owned(),
        |s| {
            // A complete chunk, then one announced as 0x400 bytes of which 10 arrive.
            let _ = s.write_all(b"5\r\nhello\r\n400\r\n0123456789");
        },
    );
    let out = child.wait_with_output().unwrap();
    server.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("incomplete response body"), "{err}");
}

#[test]
fn error_status_exits_nonzero_with_the_body() {
    let (listener, child) = in_netns(&["POST", "drain_listeners", "x=1"]);
    let server = serve(
        listener,
        "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 8\r\n\r\ndraining".to_owned(),
        |_| {},
    );
    let out = child.wait_with_output().unwrap();
    let req = server.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("received unsuccessful status code 503: draining"),
        "{err}"
    );
    // No body on stdout; only the error as Istio logs it there (`<time>\terror\t<msg>`, as
    // pilot-agent's `main.go` logs a command's error).
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "{stdout}");
    assert!(
        lines[0].ends_with("\terror\treceived unsuccessful status code 503: draining"),
        "{stdout}"
    );
    assert!(
        req.starts_with("POST /drain_listeners HTTP/1.1\r\n"),
        "{req}"
    );
}

#[test]
fn not_found_prints_the_body_and_succeeds() {
    // Istio treats 404 as an answer, not a failure.
    let (listener, child) = in_netns(&["GET", "nope"]);
    let server = serve(
        listener,
        "HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found".to_owned(),
        |_| {},
    );
    let out = child.wait_with_output().unwrap();
    server.join().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"not found");
}

/// `meshagent request GET config_dump | head`: the reader goes away mid-body. The command
/// ends quietly (no "Broken pipe" error, no log line), as a CLI should; Go's pilot-agent
/// dies of SIGPIPE without a word.
#[test]
fn reader_going_away_ends_quietly() {
    const SIZE: usize = 64 * MIB;
    let (listener, mut child) = in_netns(&["GET", "config_dump"]);
    let server = serve(
        listener,
        format!("HTTP/1.1 200 OK\r\ncontent-length: {SIZE}\r\n\r\n"),
        |s| {
            let chunk = vec![b'x'; 64 * 1024];
            for _ in 0..SIZE / chunk.len() {
                if s.write_all(&chunk).is_err() {
                    return;
                }
            }
        },
    );
    let mut out = child.stdout.take().unwrap();
    let mut buf = [0u8; 100];
    out.read_exact(&mut buf).unwrap();
    drop(out);
    let status = child.wait().unwrap();
    let err = stderr_of(&mut child);
    server.join().unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(err.is_empty(), "{err}");
}
