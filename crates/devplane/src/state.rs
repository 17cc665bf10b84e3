//! devplane's persistent identity material (the `--state-dir`).
//!
//! Tests restart devplane and expect agents to keep trusting it, so the root CA and the JWT key
//! are created once and then only ever loaded. The serving certificate is derived material: it
//! is reissued whenever it is missing, near expiry or no longer chains to the root.

use std::fs::{self, OpenOptions, Permissions};
use std::io::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair};
use rcgen::{KeyPair, PublicKeyData as _};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::ca::{self, Ca, CaError, DEFAULT_TRUST_DOMAIN};
use crate::token::{TokenError, TokenIssuer};

/// What agents trust (`CA_ROOT_CA` / `./var/run/secrets/istio/root-cert.pem`).
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
pub const ROOT_KEY_FILE: &str = "root-key.pem";
pub const JWT_KEY_FILE: &str = "jwt-key.pem";
pub const SERVING_CERT_FILE: &str = "istiod-cert.pem";
pub const SERVING_KEY_FILE: &str = "istiod-key.pem";

const ROOT_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
const SERVING_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// Reissue the serving cert this long before it expires, so a long-lived state dir never
/// serves an expired cert.
const SERVING_RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);

/// The names the agent may use for istiod: ServerName defaults to `istiod.istio-system.svc`
/// (also for `localhost*` CA_ADDR, as Istio's CA client does, `security/pkg/nodeagent/caclient/providers/citadel/client.go`), and tests dial 127.0.0.1 / ::1 directly.
const SERVING_DNS_NAMES: &[&str] = &[
    "istiod.istio-system.svc",
    "istiod.istio-system.svc.cluster.local",
    "istiod",
    "localhost",
];
const SERVING_IPS: &[IpAddr] = &[
    IpAddr::V4(Ipv4Addr::LOCALHOST),
    IpAddr::V6(Ipv6Addr::LOCALHOST),
];
const SERVING_SPIFFE_ID: &str = "spiffe://cluster.local/ns/istio-system/sa/istiod";

/// Errors loading or creating the state dir; each names the file involved.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("create state dir {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error(
        "{path} exists but {missing} does not; refusing to create a new root that existing \
         agents would not trust (delete {path} to start over)"
    )]
    MissingRootKey { path: PathBuf, missing: PathBuf },
    #[error("generate {what}: {source}")]
    Generate {
        what: &'static str,
        #[source]
        source: CaError,
    },
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error("TLS server config: {0}")]
    Tls(String),
}

/// Loaded identity material: the root CA, the JWT issuer and istiod's serving cert.
pub struct State {
    dir: PathBuf,
    ca: Ca,
    tokens: TokenIssuer,
    serving_chain: Vec<CertificateDer<'static>>,
    serving_key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for State {
    // Hand-written so key material can never end up in a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("dir", &self.dir)
            .field("ca", &self.ca)
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}

// === impl State ===

impl State {
    /// Loads the state in `dir`, creating whatever is missing (and `dir` itself).
    pub fn load_or_create(dir: &Path) -> Result<State, StateError> {
        Self::load_or_create_at(dir, SystemTime::now())
    }

    fn load_or_create_at(dir: &Path, now: SystemTime) -> Result<State, StateError> {
        if !dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|source| StateError::CreateDir {
                    path: dir.to_owned(),
                    source,
                })?;
        }
        let ca = load_or_create_root(dir, now)?;
        let tokens = load_or_create_jwt_key(dir)?;
        let (serving_chain, serving_key) = load_or_create_serving(dir, &ca, now)?;
        Ok(State {
            dir: dir.to_owned(),
            ca,
            tokens,
            serving_chain,
            serving_key,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `DIR/root-cert.pem`, the file to hand agents as their CA root.
    pub fn root_cert_path(&self) -> PathBuf {
        self.dir.join(ROOT_CERT_FILE)
    }

    /// The root certificate as one PEM block.
    pub fn root_cert_pem(&self) -> &str {
        self.ca.root_cert_pem()
    }

    /// istiod's serving chain for a rustls `ServerConfig`: `[leaf, root]`.
    pub fn serving_cert_chain(&self) -> Vec<CertificateDer<'static>> {
        self.serving_chain.clone()
    }

    /// The serving certificate's private key.
    pub fn serving_key(&self) -> PrivateKeyDer<'static> {
        self.serving_key.clone_key()
    }

    /// Issues and verifies projected-style service-account tokens (a cheap handle clone).
    ///
    /// Infallible today (the key is validated at load); a `Result` so the key can become
    /// reloadable without changing callers.
    pub fn token_issuer(&self) -> Result<TokenIssuer, StateError> {
        Ok(self.tokens.clone())
    }

    /// The workload CA (trust domain `cluster.local`; see [`Ca::with_trust_domain`]). A cheap
    /// handle clone; a `Result` for the same reason as [`token_issuer`](Self::token_issuer).
    pub fn ca(&self) -> Result<Ca, StateError> {
        Ok(self.ca.clone())
    }

    /// rustls config for istiod's TLS gRPC port: the serving chain, ALPN `h2` (gRPC clients
    /// require it), and an *optional* client certificate verified against the root, so VMs
    /// using `PROV_CERT` can authenticate with a workload cert while pods use tokens.
    pub fn server_tls_config(&self) -> Result<rustls::ServerConfig, StateError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for der in self.serving_chain.iter().skip(1) {
            roots
                .add(der.clone())
                .map_err(|e| StateError::Tls(format!("root certificate: {e}")))?;
        }
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .allow_unauthenticated()
        .build()
        .map_err(|e| StateError::Tls(format!("client verifier: {e}")))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| StateError::Tls(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.serving_cert_chain(), self.serving_key())
            .map_err(|e| StateError::Tls(format!("serving certificate: {e}")))?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(cfg)
    }
}

/// For `meshagent-devplane token --state-dir DIR --namespace NS --service-account SA [--ttl]`:
/// loads (or creates) the state and prints a token the running devplane will accept.
pub fn issue_token_from_state_dir(
    dir: &Path,
    namespace: &str,
    service_account: &str,
    ttl: Duration,
) -> Result<String, StateError> {
    let state = State::load_or_create(dir)?;
    Ok(state.tokens.issue(namespace, service_account, ttl)?)
}

fn load_or_create_root(dir: &Path, now: SystemTime) -> Result<Ca, StateError> {
    let cert_path = dir.join(ROOT_CERT_FILE);
    let key_path = dir.join(ROOT_KEY_FILE);
    // The key is written before the cert, so a key without a cert means an interrupted first
    // start: nobody can trust that root yet and it is safe to mint a new one.
    if !cert_path.exists() {
        let (cert_pem, key_pem) = ca::new_root_ca(DEFAULT_TRUST_DOMAIN, ROOT_VALIDITY, now)
            .map_err(|source| StateError::Generate {
                what: "root CA",
                source,
            })?;
        write_atomic(&key_path, key_pem.as_bytes(), 0o600)?;
        write_atomic(&cert_path, cert_pem.as_bytes(), 0o644)?;
        tracing::info!(path = %cert_path.display(), "created devplane root CA");
        return Ca::new(&cert_pem, &key_pem).map_err(|e| StateError::Invalid {
            path: cert_path,
            reason: e.to_string(),
        });
    }
    if !key_path.exists() {
        return Err(StateError::MissingRootKey {
            path: cert_path,
            missing: key_path,
        });
    }
    let cert_pem = read_string(&cert_path)?;
    let key_pem = read_string(&key_path)?;
    check_key_mode(&key_path);

    let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| invalid(&cert_path, format!("no CERTIFICATE PEM block: {e}")))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&cert_der)
        .map_err(|e| invalid(&cert_path, format!("not an X.509 certificate: {e}")))?;
    if !cert.is_ca() {
        return Err(invalid(&cert_path, "not a CA certificate".into()));
    }
    if cert.validity().not_after.timestamp() < unix(now) {
        tracing::warn!(path = %cert_path.display(), "devplane root CA has expired; delete the state dir to start over");
    }
    KeyPair::from_pem(&key_pem)
        .map_err(|e| invalid(&key_path, format!("not a PKCS#8 private key: {e}")))?;
    Ca::new(&cert_pem, &key_pem).map_err(|e| invalid(&key_path, e.to_string()))
}

fn load_or_create_jwt_key(dir: &Path) -> Result<TokenIssuer, StateError> {
    let path = dir.join(JWT_KEY_FILE);
    if path.exists() {
        check_key_mode(&path);
        let pem = read_string(&path)?;
        let der = PrivatePkcs8KeyDer::from_pem_slice(pem.as_bytes())
            .map_err(|e| invalid(&path, format!("no PRIVATE KEY (PKCS#8) PEM block: {e}")))?;
        return TokenIssuer::from_pkcs8(der.secret_pkcs8_der())
            .map_err(|e| invalid(&path, e.to_string()));
    }
    let doc = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &SystemRandom::new())
        .map_err(|e| StateError::Generate {
            what: "JWT signing key",
            source: CaError::InvalidRoot(e.to_string()),
        })?;
    write_atomic(
        &path,
        ca::pem_encode("PRIVATE KEY", doc.as_ref()).as_bytes(),
        0o600,
    )?;
    tracing::info!(path = %path.display(), "created devplane JWT signing key");
    TokenIssuer::from_pkcs8(doc.as_ref()).map_err(|e| invalid(&path, e.to_string()))
}

type ServingPair = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn load_or_create_serving(dir: &Path, ca: &Ca, now: SystemTime) -> Result<ServingPair, StateError> {
    let cert_path = dir.join(SERVING_CERT_FILE);
    let key_path = dir.join(SERVING_KEY_FILE);
    let root_der = CertificateDer::from_pem_slice(ca.root_cert_pem().as_bytes())
        .map_err(|e| invalid(&dir.join(ROOT_CERT_FILE), e.to_string()))?;

    if cert_path.exists() && key_path.exists() {
        check_key_mode(&key_path);
        let cert_pem = read_string(&cert_path)?;
        let key_pem = read_string(&key_path)?;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| invalid(&cert_path, format!("no CERTIFICATE PEM block: {e}")))?;
        let key_der = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| invalid(&key_path, format!("no private key PEM block: {e}")))?;
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| invalid(&key_path, format!("not a PKCS#8 private key: {e}")))?;
        match serving_cert_is_current(&cert_der, &root_der, &key, now) {
            Ok(()) => return Ok((vec![cert_der, root_der], key_der)),
            Err(StaleReason::Corrupt(reason)) => return Err(invalid(&cert_path, reason)),
            Err(StaleReason::Stale(reason)) => {
                tracing::info!(path = %cert_path.display(), reason, "reissuing istiod serving certificate");
            }
        }
    }

    let (cert_pem, key_pem) = ca
        .new_serving_cert(
            SERVING_DNS_NAMES,
            SERVING_IPS,
            SERVING_SPIFFE_ID,
            SERVING_VALIDITY,
            now,
        )
        .map_err(|source| StateError::Generate {
            what: "istiod serving certificate",
            source,
        })?;
    // Key first: a crash in between leaves an old cert with a new key, which the next start
    // detects as a mismatch and reissues.
    write_atomic(&key_path, key_pem.as_bytes(), 0o600)?;
    write_atomic(&cert_path, cert_pem.as_bytes(), 0o644)?;
    let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| invalid(&cert_path, e.to_string()))?;
    let key_der = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| invalid(&key_path, e.to_string()))?;
    Ok((vec![cert_der, root_der], key_der))
}

enum StaleReason {
    Corrupt(String),
    Stale(&'static str),
}

fn serving_cert_is_current(
    cert_der: &[u8],
    root_der: &[u8],
    key: &KeyPair,
    now: SystemTime,
) -> Result<(), StaleReason> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| StaleReason::Corrupt(format!("not an X.509 certificate: {e}")))?;
    let (_, root) = x509_parser::parse_x509_certificate(root_der)
        .map_err(|e| StaleReason::Corrupt(format!("root: {e}")))?;
    if cert.verify_signature(Some(root.public_key())).is_err() {
        return Err(StaleReason::Stale("not signed by the current root"));
    }
    if cert.public_key().raw != key.subject_public_key_info().as_slice() {
        return Err(StaleReason::Stale("does not match the serving key"));
    }
    let renew_at = cert.validity().not_after.timestamp() - SERVING_RENEW_BEFORE.as_secs() as i64;
    if unix(now) >= renew_at {
        return Err(StaleReason::Stale("expires within 30 days"));
    }
    Ok(())
}

fn invalid(path: &Path, reason: String) -> StateError {
    StateError::Invalid {
        path: path.to_owned(),
        reason,
    }
}

fn read_string(path: &Path) -> Result<String, StateError> {
    fs::read_to_string(path).map_err(|source| StateError::Read {
        path: path.to_owned(),
        source,
    })
}

fn unix(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Keys readable by others are still used (the operator chose that), but worth a warning.
fn check_key_mode(path: &Path) {
    if let Ok(meta) = fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(path = %path.display(), mode = format!("{mode:o}"), "private key file is accessible to group/others");
        }
    }
}

/// Writes via a temp file in the same dir + rename, so readers (and a crash) never see a
/// partial file. The mode is set explicitly because the umask could otherwise make a cert
/// unreadable to agents running as another user.
fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), StateError> {
    let write_err = |source| StateError::Write {
        path: path.to_owned(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.set_permissions(Permissions::from_mode(mode))?;
        f.write_all(contents)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        // Best effort: persist the rename itself.
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(write_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn creates_then_reloads_same_material() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state");
        let s1 = State::load_or_create(&dir).unwrap();
        assert_eq!(mode(&dir.join(ROOT_CERT_FILE)), 0o644);
        assert_eq!(mode(&dir.join(SERVING_CERT_FILE)), 0o644);
        for f in [ROOT_KEY_FILE, JWT_KEY_FILE, SERVING_KEY_FILE] {
            assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
        }
        // No temp files left behind.
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 5);
        assert_eq!(
            fs::read_to_string(s1.root_cert_path()).unwrap(),
            s1.root_cert_pem()
        );

        let tok = s1
            .token_issuer()
            .unwrap()
            .issue("default", "sleep", Duration::from_secs(60))
            .unwrap();
        let s2 = State::load_or_create(&dir).unwrap();
        assert_eq!(s1.root_cert_pem(), s2.root_cert_pem());
        assert_eq!(s1.serving_cert_chain(), s2.serving_cert_chain());
        assert_eq!(
            s1.token_issuer().unwrap().key_id(),
            s2.token_issuer().unwrap().key_id()
        );
        // A token from before the restart is still accepted.
        assert_eq!(
            s2.token_issuer()
                .unwrap()
                .verify(&tok, SystemTime::now())
                .unwrap()
                .service_account,
            "sleep"
        );
        let tok2 = issue_token_from_state_dir(&dir, "ns", "sa", Duration::from_secs(60)).unwrap();
        assert!(
            s1.token_issuer()
                .unwrap()
                .verify(&tok2, SystemTime::now())
                .is_ok()
        );
    }

    #[test]
    fn serving_cert_names_and_chain() {
        use x509_parser::extensions::GeneralName;
        let tmp = tempfile::tempdir().unwrap();
        let s = State::load_or_create(tmp.path()).unwrap();
        let chain = s.serving_cert_chain();
        assert_eq!(chain.len(), 2);
        let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
        let (_, root) = x509_parser::parse_x509_certificate(&chain[1]).unwrap();
        leaf.verify_signature(Some(root.public_key())).unwrap();
        assert!(root.is_ca() && !leaf.is_ca());
        let cn: Vec<_> = root.subject().iter_common_name().collect();
        assert_eq!(cn[0].as_str().unwrap(), "devplane root CA");
        let names = &leaf
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names;
        for dns in SERVING_DNS_NAMES {
            assert!(names.contains(&GeneralName::DNSName(dns)), "{dns}");
        }
        assert!(names.contains(&GeneralName::IPAddress(&[127, 0, 0, 1])));
        assert!(names.contains(&GeneralName::URI(SERVING_SPIFFE_ID)));
        let life = leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
        assert!((364 * 86_400..=366 * 86_400).contains(&life));
        let root_life =
            root.validity().not_after.timestamp() - root.validity().not_before.timestamp();
        assert!(root_life >= 3650 * 86_400);
        // rustls accepts the pair.
        let cfg = s.server_tls_config().unwrap();
        assert_eq!(cfg.alpn_protocols, vec![b"h2".to_vec()]);
    }

    /// A client configured like the agent (trusts root-cert.pem, ServerName
    /// `istiod.istio-system.svc`, ALPN h2) completes a handshake with and without a workload
    /// client certificate.
    #[tokio::test]
    async fn tls_handshake_like_the_agent() {
        use rustls_pki_types::ServerName;
        let tmp = tempfile::tempdir().unwrap();
        let s = State::load_or_create(tmp.path()).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(s.server_tls_config().unwrap()));
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(s.root_cert_pem().as_bytes()).unwrap())
            .unwrap();

        // A workload cert from the same CA, as a VM's PROV_CERT would hold.
        let key = KeyPair::generate().unwrap();
        let csr = rcgen::CertificateParams::default()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        let id = crate::token::Identity {
            namespace: "vm".into(),
            service_account: "app".into(),
        };
        let chain = s
            .ca()
            .unwrap()
            .sign(&csr, &id, Duration::ZERO, SystemTime::now())
            .unwrap();
        let client_chain: Vec<CertificateDer<'static>> = chain
            .iter()
            .map(|p| CertificateDer::from_pem_slice(p.as_bytes()).unwrap())
            .collect();
        let client_key = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).unwrap();

        for with_client_cert in [false, true] {
            let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots.clone());
            let mut cfg = if with_client_cert {
                builder
                    .with_client_auth_cert(client_chain.clone(), client_key.clone_key())
                    .unwrap()
            } else {
                builder.with_no_client_auth()
            };
            cfg.alpn_protocols = vec![b"h2".to_vec()];
            let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
            let (c, srv) = tokio::io::duplex(64 * 1024);
            let server = tokio::spawn({
                let acceptor = acceptor.clone();
                async move {
                    acceptor
                        .accept(srv)
                        .await
                        .map(|t| t.get_ref().1.peer_certificates().map(<[_]>::len))
                }
            });
            let name = ServerName::try_from("istiod.istio-system.svc").unwrap();
            let client = connector.connect(name, c).await.unwrap();
            assert_eq!(client.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
            let peer = server.await.unwrap().unwrap();
            assert_eq!(peer.is_some(), with_client_cert);
        }
    }

    #[test]
    fn corrupt_files_are_named() {
        for f in [
            ROOT_CERT_FILE,
            ROOT_KEY_FILE,
            JWT_KEY_FILE,
            SERVING_CERT_FILE,
            SERVING_KEY_FILE,
        ] {
            let tmp = tempfile::tempdir().unwrap();
            State::load_or_create(tmp.path()).unwrap();
            fs::write(tmp.path().join(f), "garbage").unwrap();
            let err = State::load_or_create(tmp.path()).unwrap_err();
            assert!(err.to_string().contains(f), "{f}: {err}");
        }
    }

    #[test]
    fn missing_root_key_is_an_error_but_serving_cert_is_reissued() {
        let tmp = tempfile::tempdir().unwrap();
        let s1 = State::load_or_create(tmp.path()).unwrap();
        fs::remove_file(tmp.path().join(SERVING_KEY_FILE)).unwrap();
        let s2 = State::load_or_create(tmp.path()).unwrap();
        assert_eq!(s1.root_cert_pem(), s2.root_cert_pem());
        assert_ne!(s1.serving_cert_chain()[0], s2.serving_cert_chain()[0]);

        fs::remove_file(tmp.path().join(ROOT_KEY_FILE)).unwrap();
        let err = State::load_or_create(tmp.path()).unwrap_err();
        assert!(matches!(err, StateError::MissingRootKey { .. }), "{err}");
    }

    #[test]
    fn serving_cert_from_another_root_is_reissued() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        State::load_or_create(a.path()).unwrap();
        let sb = State::load_or_create(b.path()).unwrap();
        for f in [SERVING_CERT_FILE, SERVING_KEY_FILE] {
            fs::copy(a.path().join(f), b.path().join(f)).unwrap();
        }
        let sb2 = State::load_or_create(b.path()).unwrap();
        let chain = sb2.serving_cert_chain();
        let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
        let root_der = CertificateDer::from_pem_slice(sb.root_cert_pem().as_bytes()).unwrap();
        let (_, root) = x509_parser::parse_x509_certificate(&root_der).unwrap();
        leaf.verify_signature(Some(root.public_key())).unwrap();
    }

    #[test]
    fn ca_from_state_signs() {
        let tmp = tempfile::tempdir().unwrap();
        let s = State::load_or_create(tmp.path()).unwrap();
        let key = KeyPair::generate().unwrap();
        let csr = rcgen::CertificateParams::default()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        let id = crate::token::Identity {
            namespace: "a".into(),
            service_account: "b".into(),
        };
        let chain = s
            .ca()
            .unwrap()
            .sign(&csr, &id, Duration::ZERO, SystemTime::now())
            .unwrap();
        assert_eq!(chain[1], s.root_cert_pem());
    }
}
