//! Identity / CA settings (Istio: `pilot/cmd/pilot-agent/options/security.go`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::env::Reader;

/// The projected service-account token; Istio never lets this be configured.
pub const ISTIO_TOKEN_PATH: &str = "./var/run/secrets/tokens/istio-token";

/// Key curve for ECDSA workload keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EccCurve {
    /// NIST P-256 (the default, and what any unrecognised value means).
    P256,
    /// NIST P-384.
    P384,
}

/// Identity and CA client settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct IdentityConfig {
    /// `CA_ADDR`: CA gRPC endpoint; when unset, the effective `discoveryAddress`.
    pub ca_addr: String,
    /// Whether `CA_ADDR` was set; `ISTIOD_SAN` applies to the CA only when it was not.
    pub ca_addr_set: bool,
    /// `CA_PROVIDER` (default `Citadel`); `GoogleCA` when `CA_ADDR` contains `googleapis.com`.
    pub ca_provider: String,
    /// `CA_ROOT_CA`: root for the CA TLS connection; `SYSTEM` means OS roots.
    pub ca_root_ca: String,
    /// `CA_HEADER_<NAME>`: extra gRPC metadata `NAME: value` on CSR calls (values redacted
    /// when serialized).
    #[serde(with = "super::serde_redacted")]
    pub ca_headers: BTreeMap<String, String>,
    /// `PILOT_CERT_PROVIDER` (default `istiod`): where the istiod root comes from.
    pub pilot_cert_provider: String,
    /// `TRUST_DOMAIN` (default `cluster.local`): SPIFFE trust domain.
    pub trust_domain: String,
    /// `SECRET_TTL` (default 24h): requested certificate lifetime.
    #[serde(with = "super::serde_duration")]
    pub secret_ttl: Duration,
    /// `SECRET_GRACE_PERIOD_RATIO` (default 0.5, within [0,1]): rotate when
    /// this fraction of the lifetime remains.
    pub secret_grace_period_ratio: f64,
    /// `SECRET_GRACE_PERIOD_RATIO_JITTER` (default 0.01, within [0,1]).
    pub secret_grace_period_ratio_jitter: f64,
    /// `WORKLOAD_RSA_KEY_SIZE` (default 2048; 2048, 3072 or 4096 start).
    pub workload_rsa_key_size: i64,
    /// `ECC_SIGNATURE_ALGORITHM`: `ECDSA` selects EC keys instead of RSA.
    pub ecc_signature_algorithm: String,
    /// `ECC_CURVE`: `P384`, anything else means P-256 (as Istio).
    pub ecc_curve: EccCurve,
    /// `PKCS8_KEY` (default false): write keys as PKCS#8.
    pub pkcs8_key: bool,
    /// `OUTPUT_CERTS`: directory to export key/cert/root files to.
    pub output_certs: Option<PathBuf>,
    /// `PROV_CERT`: directory with client certs for the CA/xDS connection (VMs).
    pub prov_cert: Option<PathBuf>,
    /// `FILE_MOUNTED_CERTS` (default false): never call a CA.
    pub file_mounted_certs: bool,
    /// `JWT_POLICY` (default `third-party-jwt`).
    pub jwt_policy: String,
    /// Token file for CA and xDS auth: the fixed Istio path for first- and
    /// third-party JWT policies (first-party is treated as third-party);
    /// `None` for any other policy ("use existing certs").
    pub jwt_path: Option<PathBuf>,
    /// `CREDENTIAL_FETCHER_TYPE` (default `JWT`).
    pub credential_fetcher_type: String,
    /// `CREDENTIAL_IDENTITY_PROVIDER` (default `GoogleComputeEngine`).
    pub credential_identity_provider: String,
    /// `ISTIO_META_CLUSTER_ID`: `ClusterID` metadata on CA and xDS calls.
    pub cluster_id: String,
    /// `ISTIO_META_CERT_SIGNER`: `CertSigner` in CSR metadata.
    pub cert_signer: String,
    /// `ISTIOD_SAN`: TLS server name override for istiod.
    pub istiod_san: String,
    /// `WORKLOAD_IDENTITY_SOCKET_FILE` (default `socket`): a bare file name
    /// under `./var/run/secrets/workload-spiffe-uds/`.
    pub workload_identity_socket_file: String,
    /// `TOKEN_AUDIENCES` (default `istio-ca`), comma-separated.
    pub token_audiences: Vec<String>,
    /// `XDS_AUTH_PROVIDER`: stored, unused by agent logic (as in Istio).
    pub xds_auth_provider: String,
    /// `FILE_DEBOUNCE_DURATION` (default 100ms): initial backoff re-reading cert files.
    #[serde(with = "super::serde_duration")]
    pub file_debounce_duration: Duration,
    /// `PILOT_ENABLE_CA_CRL` (default true): attach the CRL file to roots if present.
    pub pilot_enable_ca_crl: bool,
}

impl IdentityConfig {
    /// Reads the identity variables; `discovery_address` is the effective
    /// ProxyConfig value that `CA_ADDR` falls back to.
    pub(crate) fn from_env(r: &mut Reader<'_>, discovery_address: &str) -> Self {
        let ca_addr_env = r.non_empty("CA_ADDR");
        let ca_addr = ca_addr_env
            .clone()
            .unwrap_or_else(|| discovery_address.to_owned());
        let mut ca_provider = r.string("CA_PROVIDER", "Citadel");
        if ca_addr.contains("googleapis.com") {
            ca_provider = "GoogleCA".to_owned();
        }

        // Any integer is read (Istio's `env.Register` int); which sizes work is the start's
        // check (`identity::keys::KeySpec::from_config`, run at load by `config::startup`),
        // with one message for every size it refuses.
        let workload_rsa_key_size = r.int("WORKLOAD_RSA_KEY_SIZE", 2048, i64::MIN, i64::MAX);

        let jwt_policy = r.string("JWT_POLICY", "third-party-jwt");
        let jwt_path = matches!(jwt_policy.as_str(), "third-party-jwt" | "first-party-jwt")
            .then(|| PathBuf::from(ISTIO_TOKEN_PATH));

        // Istio builds a credential fetcher for any other type at start (and fails on an
        // unknown one); meshagent has only the token-file one, so another type is an error
        // rather than a CA call without the expected credential.
        let credential_fetcher_type = r.string("CREDENTIAL_FETCHER_TYPE", "JWT");
        if !matches!(credential_fetcher_type.as_str(), "JWT" | "") {
            r.invalid(
                "CREDENTIAL_FETCHER_TYPE",
                &credential_fetcher_type,
                "JWT (the token file; the GoogleComputeEngine and Mock fetchers are not supported)",
            );
        }

        // Istio's agent special-cases only `custom` and `none` (pkg/istio-agent/agent.go
        // `FindRootCAForXDS`, `FindRootCAForCA`); any other value takes the istiod path, with
        // no word. It starts the same here, with a warning listing the values
        // (pkg/config/constants `CertProvider*`).
        let pilot_cert_provider = r.string("PILOT_CERT_PROVIDER", "istiod");
        if !matches!(
            pilot_cert_provider.as_str(),
            "istiod" | "kubernetes" | "custom" | "none"
        ) && !pilot_cert_provider.starts_with("k8s.io/")
        {
            r.warnings.push(format!(
                "PILOT_CERT_PROVIDER={pilot_cert_provider:?} is not one of istiod, kubernetes, \
                 k8s.io/<signer>, custom, none; the agent uses the istiod root certificate \
                 (./var/run/secrets/istio/root-cert.pem), as for istiod"
            ));
        }

        let workload_identity_socket_file = r.string("WORKLOAD_IDENTITY_SOCKET_FILE", "socket");
        if workload_identity_socket_file.is_empty() || workload_identity_socket_file.contains('/') {
            r.invalid(
                "WORKLOAD_IDENTITY_SOCKET_FILE",
                &workload_identity_socket_file,
                "a bare file name without '/'",
            );
        }

        Self {
            ca_addr,
            ca_addr_set: ca_addr_env.is_some(),
            ca_provider,
            ca_root_ca: r.string("CA_ROOT_CA", ""),
            ca_headers: r.prefixed("CA_HEADER_"),
            pilot_cert_provider,
            trust_domain: r.string("TRUST_DOMAIN", "cluster.local"),
            secret_ttl: r.duration("SECRET_TTL", Duration::from_secs(24 * 3600)),
            secret_grace_period_ratio: r.float("SECRET_GRACE_PERIOD_RATIO", 0.5, 0.0, 1.0),
            secret_grace_period_ratio_jitter: r.float(
                "SECRET_GRACE_PERIOD_RATIO_JITTER",
                0.01,
                0.0,
                1.0,
            ),
            workload_rsa_key_size,
            ecc_signature_algorithm: r.string("ECC_SIGNATURE_ALGORITHM", ""),
            ecc_curve: match r.string("ECC_CURVE", "P256").as_str() {
                "P384" => EccCurve::P384,
                _ => EccCurve::P256,
            },
            pkcs8_key: r.bool("PKCS8_KEY", false),
            output_certs: r.non_empty("OUTPUT_CERTS").map(PathBuf::from),
            prov_cert: r.non_empty("PROV_CERT").map(PathBuf::from),
            file_mounted_certs: r.bool("FILE_MOUNTED_CERTS", false),
            jwt_policy,
            jwt_path,
            credential_fetcher_type,
            credential_identity_provider: r
                .string("CREDENTIAL_IDENTITY_PROVIDER", "GoogleComputeEngine"),
            cluster_id: r.string("ISTIO_META_CLUSTER_ID", ""),
            cert_signer: r.string("ISTIO_META_CERT_SIGNER", ""),
            istiod_san: r.string("ISTIOD_SAN", ""),
            workload_identity_socket_file,
            token_audiences: r.list("TOKEN_AUDIENCES", &["istio-ca"]),
            xds_auth_provider: r.string("XDS_AUTH_PROVIDER", ""),
            file_debounce_duration: r
                .duration("FILE_DEBOUNCE_DURATION", Duration::from_millis(100)),
            pilot_enable_ca_crl: r.bool("PILOT_ENABLE_CA_CRL", true),
        }
    }
}

/// Cloud platform metadata (Istio: `CLOUD_PLATFORM`, `pkg/bootstrap/platform`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PlatformConfig {
    /// `GCP_METADATA`.
    pub gcp_metadata: String,
    /// `GCP_QUOTA_PROJECT`.
    pub gcp_quota_project: String,
    /// `GCP_ZONE`.
    pub gcp_zone: String,
    /// `CLOUD_PLATFORM`.
    pub cloud_platform: String,
    /// `GCE_METADATA_HOST` (Google's metadata client): the GCE metadata server `host[:port]`;
    /// when set the agent takes it that it runs on GCE.
    pub gce_metadata_host: String,
    /// `MESHAGENT_TEST_METADATA_ADDR` (tests only): `host:port` used instead of the
    /// link-local metadata addresses (169.254.169.254, `[fd00:ec2::254]`); also turns off
    /// the `metadata.google.internal` DNS probe.
    pub test_metadata_addr: String,
    /// `MESHAGENT_TEST_DMI_DIR` (tests only): directory read instead of `/sys/class/dmi/id`.
    pub test_dmi_dir: std::path::PathBuf,
}

impl PlatformConfig {
    pub(crate) fn from_env(r: &Reader<'_>) -> Self {
        Self {
            gcp_metadata: r.string("GCP_METADATA", ""),
            gcp_quota_project: r.string("GCP_QUOTA_PROJECT", ""),
            gcp_zone: r.string("GCP_ZONE", ""),
            cloud_platform: r.string("CLOUD_PLATFORM", ""),
            gce_metadata_host: r.string("GCE_METADATA_HOST", ""),
            test_metadata_addr: r.string("MESHAGENT_TEST_METADATA_ADDR", ""),
            test_dmi_dir: r.string("MESHAGENT_TEST_DMI_DIR", "").into(),
        }
    }
}
