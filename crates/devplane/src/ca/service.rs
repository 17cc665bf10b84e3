//! The tonic service: authenticates the caller, signs, and records the call.

use std::time::{Duration, SystemTime};

use meshagent_proto::ca::istio_certificate_service_server::{
    IstioCertificateService, IstioCertificateServiceServer,
};
use meshagent_proto::ca::{IstioCertificateRequest, IstioCertificateResponse};
use tonic::{Request, Response, Status};

use super::redact::{bearer_token, record_headers};
use super::{Ca, CaError, CsrLog, CsrRecord, rfc3339};
use crate::clients::struct_to_json;
use crate::token::{Identity, TokenError, TokenIssuer};

/// The tonic service for `istio.v1.auth.IstioCertificateService`.
#[derive(Clone, Debug)]
pub struct CaService {
    ca: Ca,
    tokens: TokenIssuer,
    log: CsrLog,
}

impl CaService {
    pub fn new(ca: Ca, tokens: TokenIssuer) -> Self {
        Self {
            ca,
            tokens,
            log: CsrLog::new(),
        }
    }

    /// Records calls into `log` (e.g. one shared with the debug endpoint).
    pub fn with_csr_log(mut self, log: CsrLog) -> Self {
        self.log = log;
        self
    }

    pub fn csr_log(&self) -> CsrLog {
        self.log.clone()
    }

    /// Wraps the service for `tonic::transport::Server::add_service`.
    pub fn into_server(self) -> IstioCertificateServiceServer<Self> {
        IstioCertificateServiceServer::new(self)
    }

    fn authenticate(
        &self,
        metadata: &tonic::metadata::MetadataMap,
        now: SystemTime,
    ) -> Result<Identity, Status> {
        let Some(value) = metadata.get("authorization") else {
            return Err(Status::unauthenticated(
                "authenticate: no authorization header (want \"Bearer <service account token>\")",
            ));
        };
        let value = value.to_str().map_err(|_| {
            Status::unauthenticated("authenticate: authorization header is not ASCII")
        })?;
        let token = bearer_token(value).ok_or_else(|| {
            Status::unauthenticated("authenticate: authorization header is not \"Bearer <token>\"")
        })?;
        self.tokens
            .verify(token, now)
            .map_err(|e: TokenError| Status::unauthenticated(format!("authenticate: {e}")))
    }
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let now = SystemTime::now();
        // devplane's listeners attach `conn::ConnInfo` rather than tonic's own connect info.
        let peer = request.remote_addr().or_else(|| {
            request
                .extensions()
                .get::<crate::conn::ConnInfo>()
                .and_then(|c| c.remote_addr)
        });
        let headers = record_headers(request.metadata());
        let auth = self.authenticate(request.metadata(), now);
        let req = request.into_inner();
        let mut record = CsrRecord {
            time: now,
            peer,
            headers,
            identity: auth.as_ref().ok().cloned(),
            metadata: req
                .metadata
                .as_ref()
                .map_or(serde_json::Value::Null, struct_to_json),
            validity_requested_secs: req.validity_duration,
            serial: None,
            error: None,
        };

        let result = auth.and_then(|identity| {
            let validity = u64::try_from(req.validity_duration)
                .map(Duration::from_secs)
                .unwrap_or(Duration::ZERO);
            self.ca
                .sign_detailed(&req.csr, &identity, validity, now)
                .map_err(|e| match e {
                    CaError::InvalidCsr(_) | CaError::InvalidIdentity { .. } => {
                        Status::invalid_argument(e.to_string())
                    }
                    CaError::InvalidRoot(_) | CaError::Sign { .. } => {
                        Status::internal(e.to_string())
                    }
                })
                .map(|issued| (identity, issued))
        });

        match result {
            Ok((identity, issued)) => {
                tracing::info!(
                    namespace = %identity.namespace,
                    service_account = %identity.service_account,
                    spiffe_id = %issued.spiffe_id,
                    serial = %issued.serial,
                    not_after = %rfc3339(issued.not_after),
                    peer = ?peer,
                    "issued workload certificate"
                );
                record.serial = Some(issued.serial);
                self.log.push(record);
                Ok(Response::new(IstioCertificateResponse {
                    cert_chain: issued.chain,
                }))
            }
            Err(status) => {
                tracing::warn!(
                    code = ?status.code(),
                    error = status.message(),
                    peer = ?peer,
                    "rejected CSR"
                );
                record.error = Some(format!("{:?}: {}", status.code(), status.message()));
                self.log.push(record);
                Err(status)
            }
        }
    }
}
