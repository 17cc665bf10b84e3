//! A two-workload mesh and the tiny app that reports who called it.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{free_addr, free_port};

/// A tiny HTTP app that says who it is and which SPIFFE identity called it (from the
/// `x-forwarded-client-cert` header its sidecar sets). `delay` slows every response.
pub async fn identity_app(name: &'static str, listener: tokio::net::TcpListener, delay: Duration) {
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            let mut n = 0;
            while n < buf.len() {
                match s.read(&mut buf[n..]).await {
                    Ok(0) | Err(_) => return,
                    Ok(k) => n += k,
                }
                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let caller = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("x-forwarded-client-cert")
                        .then(|| v.trim().to_owned())
                })
                .and_then(|xfcc| {
                    xfcc.split(';')
                        .find_map(|kv| kv.strip_prefix("URI=").map(str::to_owned))
                })
                .unwrap_or_else(|| "unknown (no client certificate)".into());
            tokio::time::sleep(delay).await;
            let body = format!("hello from {name}; caller identity: {caller}\n");
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

/// A two-workload mesh (a calls b) on free ports, so tests can run in parallel.
pub struct TwoWorkloads {
    /// Where A's sidecar accepts A's calls to service b.
    pub a_to_b: SocketAddr,
    pub a_app: u16,
    pub b_app: u16,
    /// Where B's sidecar accepts B's calls to service a ([`TwoWorkloads::with_b_to_a`]).
    pub b_to_a: Option<SocketAddr>,
    a_in: u16,
    b_in: u16,
}

impl Default for TwoWorkloads {
    fn default() -> Self {
        Self::new()
    }
}

impl TwoWorkloads {
    pub fn new() -> TwoWorkloads {
        TwoWorkloads {
            a_to_b: free_addr(),
            a_app: free_port(),
            b_app: free_port(),
            b_to_a: None,
            a_in: free_port(),
            b_in: free_port(),
        }
    }

    /// B calls A too, through an outbound listener of its sidecar at [`TwoWorkloads::b_to_a`].
    pub fn with_b_to_a(mut self) -> TwoWorkloads {
        self.b_to_a = Some(free_addr());
        self
    }

    /// The mesh file; `service_c` adds service `c` (backed by a) to simulate a mesh edit.
    pub fn yaml(&self, service_c: bool) -> String {
        let TwoWorkloads {
            a_to_b,
            a_app,
            b_app,
            b_to_a,
            a_in,
            b_in,
        } = self;
        let b_outbound = b_to_a.map_or_else(String::new, |addr| {
            format!("\n    outbound: [{{service: a.default, port: 80, bind: \"{addr}\"}}]")
        });
        let mut y = format!(
            r#"
workloads:
  - name: a
    serviceAccount: a
    ports: [{{name: http, port: {a_app}, inboundPort: {a_in}}}]
    outbound: [{{service: b.default, port: 80, bind: "{a_to_b}"}}]
  - name: b
    serviceAccount: b
    ports: [{{name: http, port: {b_app}, inboundPort: {b_in}}}]{b_outbound}
services:
  - name: a
    selector: [a]
    ports: [{{port: 80, targetPort: {a_app}}}]
  - name: b
    selector: [b]
    ports: [{{port: 80, targetPort: {b_app}}}]
"#
        );
        if service_c {
            y.push_str(&format!(
                "  - name: c\n    selector: [a]\n    ports: [{{port: 8080, targetPort: {a_app}}}]\n"
            ));
        }
        y
    }
}

/// [`TwoWorkloads`] as (yaml, a's outbound address to b, a's app port, b's app port).
pub fn two_workload_mesh() -> (String, SocketAddr, u16, u16) {
    let m = TwoWorkloads::new();
    (m.yaml(false), m.a_to_b, m.a_app, m.b_app)
}
