//! Istio CA client: `istio.v1.auth.IstioCertificateService/CreateCertificate` (Istio `security/pkg/nodeagent/caclient/providers/citadel/client.go`).
//!
//! Dialing (roots, server name, `PROV_CERT` client cert, plaintext on `:15010`) and per-call
//! metadata (`ClusterID`, `CA_HEADER_*`, the token re-read on every call) come from
//! [`crate::control_plane`]. This module adds Istio's retry interceptor (5 retries from 100 ms,
//! ±10 % jitter, retryable codes only), classification of the final error with a hint for the
//! usual misconfigurations, the CSR metrics, and rebuilding the channel after a final failure
//! so a changed root or address is picked up.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use meshagent_proto::ca::istio_certificate_service_client::IstioCertificateServiceClient;
use meshagent_proto::ca::{IstioCertificateRequest, IstioCertificateResponse};
use meshagent_proto::google::protobuf::{Struct, Value, value::Kind};
use tonic::Code;
use tonic::transport::Channel;

use super::metrics::Metrics;
use crate::control_plane::{self, CallMetadata, Keepalive, Target, TokenSource};

/// Why a certificate could not be obtained.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CaError {
    /// Worth retrying later (CA down, overloaded, network).
    #[error("CA {addr} unavailable ({code:?}): {message}")]
    Retryable {
        addr: String,
        code: Code,
        message: String,
    },
    /// A configuration or authentication problem: retrying quickly will not help.
    #[error("CA {addr} rejected the CSR ({code:?}): {message}; {hint}")]
    Rejected {
        addr: String,
        code: Code,
        message: String,
        hint: &'static str,
    },
    #[error("invalid CA response: {0}")]
    InvalidResponse(String),
    #[error("cannot dial the CA: {0}")]
    Dial(String),
}

impl CaError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Retryable { .. } | Self::Dial(_))
    }
}

/// Istio's retry interceptor codes (security/pkg/nodeagent/caclient).
pub fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Cancelled
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::Internal
            | Code::Unavailable
    )
}

/// The likely cause of a non-retryable code, named in the one log line and readiness reason.
fn hint(code: Code, message: &str) -> &'static str {
    match code {
        Code::Unauthenticated => {
            "the token at ./var/run/secrets/tokens/istio-token is missing, expired, or has the wrong audience (istio-ca); it is re-read on every call"
        }
        Code::PermissionDenied => {
            "the caller identity may not request this certificate (check CA policy / ISTIO_META_CERT_SIGNER)"
        }
        Code::Unimplemented if message.contains("unknown service") => {
            "CA_ADDR does not point at an Istio CA (IstioCertificateService is not served there)"
        }
        Code::Unimplemented => "CA_ADDR does not serve CreateCertificate: check CA_ADDR",
        Code::InvalidArgument => {
            "the CA refused the request (CSR or identity invalid: check POD_NAMESPACE, SERVICE_ACCOUNT, TRUST_DOMAIN)"
        }
        Code::NotFound => "CA_ADDR points at the wrong endpoint",
        _ => "see the CA's logs",
    }
}

/// Signs CSRs. A trait so the secret manager can be tested with a fake on paused time.
pub trait CertificateAuthority: Send + Sync + 'static {
    /// Returns the PEM chain elements, leaf first, root last.
    fn sign(&self, csr: String, ttl: Duration) -> BoxFuture<'_, Result<Vec<String>, CaError>>;
}

/// Retry policy for one CSR (Istio: up to 5 retries, 100 ms doubling, ±10 % jitter).
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    pub retries: u32,
    pub initial: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            retries: 5,
            initial: Duration::from_millis(100),
        }
    }
}

/// The real client.
pub struct IstioCaClient {
    target: Target,
    cwd: PathBuf,
    metadata: CallMetadata,
    cert_signer: String,
    retry: RetryPolicy,
    channel: Mutex<Option<Channel>>,
    metrics: Metrics,
}

impl IstioCaClient {
    pub fn new(
        target: Target,
        cwd: &Path,
        metadata: CallMetadata,
        cert_signer: String,
        metrics: Metrics,
    ) -> IstioCaClient {
        IstioCaClient {
            target,
            cwd: cwd.to_path_buf(),
            metadata,
            cert_signer,
            retry: RetryPolicy::default(),
            channel: Mutex::new(None),
            metrics,
        }
    }

    pub fn token_source(&self) -> &TokenSource {
        self.metadata.token_source()
    }

    fn channel(&self) -> Result<Channel, CaError> {
        let mut slot = self.channel.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = &*slot {
            return Ok(c.clone());
        }
        let c = control_plane::channel(&self.target, &self.cwd, Keepalive::default())
            .map_err(|e| CaError::Dial(e.to_string()))?;
        *slot = Some(c.clone());
        Ok(c)
    }

    /// Drops the channel so the next call dials anew with the current root files.
    fn reset_channel(&self) {
        *self.channel.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    async fn call_once(&self, csr: &str, ttl: Duration) -> Result<Vec<String>, tonic::Status> {
        let channel = self
            .channel()
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut client = IstioCertificateServiceClient::new(channel);
        let mut fields = std::collections::HashMap::new();
        fields.insert(
            "CertSigner".to_owned(),
            Value {
                kind: Some(Kind::StringValue(self.cert_signer.clone())),
            },
        );
        let mut req = tonic::Request::new(IstioCertificateRequest {
            csr: csr.to_owned(),
            validity_duration: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
            metadata: Some(Struct { fields }),
        });
        req.set_timeout(Duration::from_secs(30));
        self.metadata.apply(req.metadata_mut()).await;
        let resp: IstioCertificateResponse = client
            .create_certificate(req)
            .await
            .map_err(control_plane::transport_status)?
            .into_inner();
        Ok(resp.cert_chain)
    }

    async fn sign_with_retries(&self, csr: String, ttl: Duration) -> Result<Vec<String>, CaError> {
        let requests = self.metrics.csr_requests.clone();
        let mut delay = self.retry.initial;
        let mut attempt = 0;
        loop {
            requests.inc();
            let started = tokio::time::Instant::now();
            let result = self.call_once(&csr, ttl).await;
            self.metrics
                .csr_latency_ms
                .add(u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX));
            let status = match result {
                Ok(chain) => return validate_chain(chain),
                Err(s) => s,
            };
            if retryable(status.code()) && attempt < self.retry.retries {
                attempt += 1;
                self.metrics.csr_retries.inc();
                let wait = delay.mul_f64(crate::supervise::jitter_factor(0.1));
                tracing::debug!(code = ?status.code(), error = status.message(), attempt, ?wait, "CSR failed, retrying");
                tokio::time::sleep(wait).await;
                delay *= 2;
                continue;
            }
            self.metrics.csr_failures.inc();
            // Istio closes the connection after a final failure so the next attempt re-reads
            // roots and re-resolves the address.
            self.reset_channel();
            let addr = self.target.addr.clone();
            let message = status.message().to_owned();
            return Err(if retryable(status.code()) {
                CaError::Retryable {
                    addr,
                    code: status.code(),
                    message,
                }
            } else {
                CaError::Rejected {
                    addr,
                    code: status.code(),
                    hint: hint(status.code(), &message),
                    message,
                }
            });
        }
    }
}

impl CertificateAuthority for IstioCaClient {
    fn sign(&self, csr: String, ttl: Duration) -> BoxFuture<'_, Result<Vec<String>, CaError>> {
        Box::pin(self.sign_with_retries(csr, ttl))
    }
}

/// Istio rejects chains with one element or fewer ("invalid empty CertChain").
pub fn validate_chain(chain: Vec<String>) -> Result<Vec<String>, CaError> {
    if chain.len() <= 1 {
        return Err(CaError::InvalidResponse(format!(
            "invalid empty CertChain ({} element(s); expected leaf..root)",
            chain.len()
        )));
    }
    Ok(chain)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_codes_are_istios() {
        for c in [
            Code::Cancelled,
            Code::DeadlineExceeded,
            Code::ResourceExhausted,
            Code::Aborted,
            Code::Internal,
            Code::Unavailable,
        ] {
            assert!(retryable(c), "{c:?}");
        }
        for c in [
            Code::Unauthenticated,
            Code::PermissionDenied,
            Code::Unimplemented,
            Code::InvalidArgument,
            Code::NotFound,
        ] {
            assert!(!retryable(c), "{c:?}");
        }
        assert!(
            hint(
                Code::Unimplemented,
                "unknown service istio.v1.auth.IstioCertificateService"
            )
            .contains("CA_ADDR")
        );
        assert!(hint(Code::Unauthenticated, "").contains("token"));
    }

    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use meshagent_proto::ca::istio_certificate_service_server::{
        IstioCertificateService, IstioCertificateServiceServer,
    };
    use tonic::{Request, Response, Status};

    /// A CA that always answers with one status code and counts calls.
    struct Fixed {
        code: Code,
        calls: Arc<AtomicU32>,
    }

    #[tonic::async_trait]
    impl IstioCertificateService for Fixed {
        async fn create_certificate(
            &self,
            _r: Request<IstioCertificateRequest>,
        ) -> Result<Response<IstioCertificateResponse>, Status> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Err(Status::new(
                self.code,
                "unknown service istio.v1.auth.IstioCertificateService",
            ))
        }
    }

    /// F2: which codes are retried (5 times) and which fail at once with a hint, against a
    /// real gRPC server.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn status_matrix_over_grpc() {
        for (code, retried) in [
            (Code::Unavailable, true),
            (Code::Internal, true),
            (Code::Unauthenticated, false),
            (Code::Unimplemented, false),
            (Code::InvalidArgument, false),
        ] {
            let calls = Arc::new(AtomicU32::new(0));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let svc = IstioCertificateServiceServer::new(Fixed {
                code,
                calls: calls.clone(),
            });
            let server = tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            );
            let registry = crate::metrics::Registry::new();
            let metrics = Metrics::register(&registry).unwrap();
            let md = CallMetadata::new("", &Default::default(), TokenSource::new(None));
            let mut client = IstioCaClient::new(
                Target {
                    addr: addr.to_string(),
                    tls: None,
                },
                Path::new("/"),
                md,
                String::new(),
                metrics.clone(),
            );
            client.retry.initial = Duration::from_millis(5);
            let err = client
                .sign("csr".into(), Duration::from_secs(60))
                .await
                .unwrap_err();
            let expected_calls = if retried { 6 } else { 1 };
            assert_eq!(calls.load(Ordering::SeqCst), expected_calls, "{code:?}");
            assert_eq!(err.is_retryable(), retried, "{code:?}: {err}");
            assert_eq!(metrics.csr_requests.get(), u64::from(expected_calls));
            assert_eq!(metrics.csr_retries.get(), u64::from(expected_calls - 1));
            assert_eq!(metrics.csr_failures.get(), 1);
            if code == Code::Unimplemented {
                assert!(
                    err.to_string()
                        .contains("CA_ADDR does not point at an Istio CA"),
                    "{err}"
                );
            }
            server.abort();
        }
    }

    #[test]
    fn chain_needs_leaf_and_root() {
        assert!(validate_chain(vec!["leaf".into()]).is_err());
        assert!(validate_chain(vec!["leaf".into(), "root".into()]).is_ok());
    }
}
