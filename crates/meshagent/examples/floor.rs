//! The floor under the agent's memory figures on this machine: a process built as the shipped
//! agent is (`make floor`: release profile, fat LTO, the agent's link flags), linking the same
//! libc, that starts a current-thread Tokio runtime and does one rustls (aws-lc) handshake to
//! `FLOOR_ADDR`, verifying the server against the PEM root in `FLOOR_ROOT` for the name
//! `FLOOR_NAME` — the least any agent that talks TLS to istiod does. Then it trims its heap as
//! the agent does once ready, and prints its own peak and settled memory from `/proc/self`.
//! No configuration, no Envoy, no xDS, no certificate of its own. A measuring aid
//! (docs/benchmarks-log.md, "Start-up peak"), not a benchmark.
#![allow(
    clippy::disallowed_methods,
    reason = "a measuring example, not the agent's runtime"
)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "../benches/support/mem.rs"]
mod mem;

fn main() {
    meshagent::malloc::configure();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_file_iter(var("FLOOR_ROOT")).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let config = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        // The server (`make floor` starts `openssl s_server`) may still be starting: 5 s.
        let addr = var("FLOOR_ADDR");
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let tcp = loop {
            match tokio::net::TcpStream::connect(&addr).await {
                Ok(t) => break t,
                Err(e) if tokio::time::Instant::now() >= deadline => panic!("{addr}: {e}"),
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        };
        let name = ServerName::try_from(var("FLOOR_NAME")).unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .unwrap();
        tls.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        let mut first = [0u8; 64];
        let n = tls.read(&mut first).await.unwrap();
        assert!(n > 0, "no answer after the handshake");
        let me = std::process::id();
        let hwm = mem::status_kib(me, "VmHWM:") / 1024.0;
        meshagent::malloc::trim();
        meshagent::code_pages::release();
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let settled = mem::Mem::of(me);
        println!(
            "floor: peak VmHWM {hwm:.2} MiB; settled RssAnon {:.2} MiB, Pss {:.2} MiB, VmRSS {:.2} MiB",
            settled.rss_anon, settled.pss, settled.vm_rss,
        );
    });
}
