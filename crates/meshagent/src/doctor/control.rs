//! The control plane as the agent would reach it: the CA and istiod TLS handshakes with the
//! roots and server name the agent would use ([`crate::control_plane::ca_target`],
//! [`crate::control_plane::xds_target`]), the projected token, and the clock against the CA's
//! certificate (a clock behind makes every fresh certificate "not yet valid").

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

use super::{Check, DoctorError, Options, step};
use crate::config::Config;
use crate::control_plane::{self, DialError, Roots, Target};

/// A projected token is well under this; anything larger is not one.
const MAX_TOKEN_BYTES: u64 = 64 << 10;
/// A token this close to its expiry is worth a warning: kubelet refreshes at 80 % of its life.
const TOKEN_SOON: Duration = Duration::from_secs(300);

/// CA, istiod, token and clock findings.
pub async fn checks(cfg: &Config, opts: &Options) -> Vec<Check> {
    let mut out = Vec::new();
    let mut not_before = Vec::new();
    if cfg.identity.file_mounted_certs {
        out.push(Check::ok(
            "ca",
            "FILE_MOUNTED_CERTS=true: certificates come from files, no CA is called",
        ));
    } else {
        let (c, nb) = handshake(
            "ca",
            "the CA (CA_ADDR)",
            control_plane::ca_target(cfg),
            opts,
        )
        .await;
        out.push(c);
        not_before.extend(nb);
    }
    let (c, nb) = handshake(
        "istiod",
        "istiod (discoveryAddress)",
        control_plane::xds_target(cfg, &opts.cwd),
        opts,
    )
    .await;
    out.push(c);
    not_before.extend(nb);
    out.push(token(cfg, opts).await);
    out.push(clock(&not_before, SystemTime::now()));
    out
}

/// Records the leaf the server presents, then verifies it as the agent would.
#[derive(Debug)]
struct Recording {
    inner: Arc<dyn ServerCertVerifier>,
    leaf: Mutex<Option<Vec<u8>>>,
}

impl ServerCertVerifier for Recording {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Ok(mut l) = self.leaf.lock() {
            *l = Some(end_entity.as_ref().to_vec());
        }
        self.inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

fn roots_name(r: &Roots) -> String {
    match r {
        Roots::System => "the OS trust bundle".to_owned(),
        Roots::File(p) => p.display().to_string(),
    }
}

/// The leaf's DNS/IP/URI SANs and NotBefore.
fn leaf_facts(der: &[u8]) -> (Vec<String>, Option<SystemTime>) {
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
        return (vec![], None);
    };
    let mut sans = Vec::new();
    if let Ok(Some(ext)) = cert.subject_alternative_name() {
        for n in &ext.value.general_names {
            use x509_parser::extensions::GeneralName;
            match n {
                GeneralName::DNSName(d) => sans.push((*d).to_owned()),
                GeneralName::URI(u) => sans.push((*u).to_owned()),
                GeneralName::IPAddress(b) => match b.len() {
                    4 => sans.push(
                        std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).unwrap_or_default())
                            .to_string(),
                    ),
                    16 => sans.push(
                        std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).unwrap_or_default())
                            .to_string(),
                    ),
                    _ => {}
                },
                _ => {}
            }
        }
    }
    let nb = SystemTime::UNIX_EPOCH
        + Duration::from_secs(u64::try_from(cert.validity().not_before.timestamp()).unwrap_or(0));
    (sans, Some(nb))
}

const UNREACHABLE_FIX: &str = "check that istiod runs and is reachable from the pod \
    (`kubectl -n istio-system get pods -l app=istiod`), that no NetworkPolicy or egress rule \
    blocks the port, and the address (CA_ADDR, discoveryAddress, the \
    sidecar.istio.io/discoveryAddress annotation)";

/// One TLS handshake (or a TCP connect for plaintext) to `target`; also the server
/// certificate's NotBefore when one was presented.
async fn handshake(
    name: &str,
    what: &str,
    target: Result<Target, DialError>,
    opts: &Options,
) -> (Check, Option<SystemTime>) {
    let target = match target {
        Ok(t) => t,
        Err(e) => {
            return (
                Check::fail(
                    name,
                    format!("{what}: {e}"),
                    "set the address as host:port (CA_ADDR, ProxyConfig discoveryAddress) and \
                     give TLS a root (PILOT_CERT_PROVIDER, CA_ROOT_CA, XDS_ROOT_CA)",
                ),
                None,
            );
        }
    };
    let addr = target.addr.clone();
    let connect = step(opts, async {
        tokio::net::TcpStream::connect(&addr)
            .await
            .map_err(|error| DoctorError::Connect {
                addr: addr.clone(),
                error,
            })
    })
    .await;
    let tcp = match connect {
        Ok(t) => t,
        Err(e) => {
            return (
                Check::fail(
                    name,
                    format!("{what} {addr} unreachable: {e}"),
                    UNREACHABLE_FIX,
                ),
                None,
            );
        }
    };
    let Some(tls) = target.tls else {
        return (
            Check::ok(name, format!("{what} {addr} reachable (plaintext)")),
            None,
        );
    };
    let roots_label = roots_name(&tls.roots);
    let cwd = opts.cwd.clone();
    let tls2 = tls.clone();
    let built = tokio::task::spawn_blocking(move || {
        let roots = control_plane::load_roots(&tls2.roots, &cwd)?;
        let config = control_plane::client_config(&tls2, &cwd)?;
        Ok::<_, std::io::Error>((roots, config))
    })
    .await
    .map_err(std::io::Error::other)
    .and_then(|r| r);
    let (roots, mut config) = match built {
        Ok(b) => b,
        Err(e) => {
            return (
                Check::fail(
                    name,
                    format!("{what}: cannot load the TLS roots {roots_label}: {e}"),
                    "mount istiod's root (the istio-ca-root-cert configmap at \
                     ./var/run/secrets/istio/root-cert.pem) or point CA_ROOT_CA / XDS_ROOT_CA \
                     at a PEM bundle",
                ),
                None,
            );
        }
    };
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let inner = match rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        provider,
    )
    .build()
    {
        Ok(v) => v,
        Err(e) => {
            return (
                Check::fail(
                    name,
                    format!("{what}: TLS roots {roots_label}: {e}"),
                    "fix the root bundle",
                ),
                None,
            );
        }
    };
    let recording = Arc::new(Recording {
        inner,
        leaf: Mutex::new(None),
    });
    config
        .dangerous()
        .set_certificate_verifier(recording.clone());
    let server_name = match ServerName::try_from(tls.server_name.clone()) {
        Ok(n) => n,
        Err(e) => {
            return (
                Check::fail(
                    name,
                    format!("{what}: server name {:?} is invalid: {e}", tls.server_name),
                    "set ISTIOD_SAN to a DNS name",
                ),
                None,
            );
        }
    };
    let result = step(opts, async {
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(server_name, tcp)
            .await
            .map_err(|e| DoctorError::Tls {
                addr: addr.clone(),
                reason: e.to_string(),
            })
    })
    .await;
    let leaf = recording.leaf.lock().ok().and_then(|l| l.clone());
    let (sans, nb) = leaf.as_deref().map(leaf_facts).unwrap_or_default();
    let check = match result {
        Ok(_) => Check::ok(
            name,
            format!(
                "{what} {addr}: TLS verified against {roots_label}, server name {} in the \
                 certificate",
                tls.server_name
            ),
        ),
        Err(DoctorError::Tls { reason, .. }) => explain_tls(
            name,
            what,
            &addr,
            &tls.server_name,
            &roots_label,
            &sans,
            &reason,
        ),
        Err(e) => Check::fail(name, format!("{what} {addr}: {e}"), UNREACHABLE_FIX),
    };
    (check, nb)
}

fn explain_tls(
    name: &str,
    what: &str,
    addr: &str,
    server_name: &str,
    roots: &str,
    sans: &[String],
    reason: &str,
) -> Check {
    let presented = if sans.is_empty() {
        "no SAN".to_owned()
    } else {
        sans.join(", ")
    };
    // rustls says "certificate not valid for name …"; the presented SANs decide it plainly.
    let name_ok = sans.iter().any(|s| s.eq_ignore_ascii_case(server_name));
    let name_error = reason.contains("not valid for name")
        || reason.contains(&format!("{:?}", CertificateError::NotValidForName));
    if name_error || (!sans.is_empty() && !name_ok && !reason.contains("UnknownIssuer")) {
        return Check::fail(
            name,
            format!(
                "{what} {addr}: SAN mismatch: the agent expects {server_name:?} but the \
                 certificate is for {presented}"
            ),
            format!(
                "set ISTIOD_SAN to a name the certificate carries (or address istiod by one, \
                 e.g. istiod.istio-system.svc:15012), or add {server_name:?} to istiod's \
                 certificate (PILOT_CERT_PROVIDER / the istiod DNS cert)"
            ),
        );
    }
    if reason.contains("UnknownIssuer") || reason.contains("unknown issuer") {
        return Check::fail(
            name,
            format!(
                "{what} {addr}: the certificate ({presented}) is not signed by the root in {roots}"
            ),
            "the root is not istiod's CA: refresh the istio-ca-root-cert configmap (a CA \
             rotation or a plugged-in cacerts secret changes it) or fix CA_ROOT_CA / XDS_ROOT_CA",
        );
    }
    if reason.contains("NotValidYet") || reason.contains("not valid yet") {
        return Check::fail(
            name,
            format!("{what} {addr}: the certificate is not valid yet: this clock is behind"),
            "synchronise the node's clock (NTP/chrony)",
        );
    }
    Check::fail(
        name,
        format!("{what} {addr}: TLS handshake failed: {reason}"),
        UNREACHABLE_FIX,
    )
}

/// The JWT payload's claims (no signature check: the CA checks it; we only explain).
fn jwt_claims(token: &str) -> Result<serde_json::Value, String> {
    let mut parts = token.trim().split('.');
    let (Some(_), Some(payload), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("not a JWT (expected three dot-separated parts)".to_owned());
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|e| format!("the JWT payload is not base64url: {e}"))?;
    serde_json::from_slice(&bytes).map_err(|e| format!("the JWT payload is not JSON: {e}"))
}

async fn token(cfg: &Config, opts: &Options) -> Check {
    const NAME: &str = "token";
    let Some(path) = cfg.identity.jwt_path.clone() else {
        return Check::ok(
            NAME,
            format!("JWT_POLICY={}: no token is used", cfg.identity.jwt_policy),
        );
    };
    if cfg.identity.file_mounted_certs {
        return Check::ok(NAME, "FILE_MOUNTED_CERTS=true: the token is not used");
    }
    let shown = path.display().to_string();
    let full = crate::fsio::under(&opts.cwd, &path);
    let read =
        tokio::task::spawn_blocking(move || crate::fsio::read_bounded(&full, MAX_TOKEN_BYTES))
            .await;
    let bytes = match read {
        Ok(Ok(b)) => b,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Check::fail(
                NAME,
                format!("token {shown} is missing"),
                "mount the projected service-account token volume `istio-token` (audience \
                 istio-ca) at ./var/run/secrets/tokens as the sidecar injector does, or set \
                 JWT_POLICY to match how the pod authenticates",
            );
        }
        Ok(Err(e)) => {
            return Check::fail(
                NAME,
                format!("token {shown} is not readable: {e}"),
                "the proxy's uid must be able to read it: check the volume's defaultMode and \
                 the pod's fsGroup / runAsUser",
            );
        }
        Err(e) => return Check::fail(NAME, format!("token {shown}: {e}"), "retry"),
    };
    let text = String::from_utf8_lossy(&bytes);
    let claims = match jwt_claims(&text) {
        Ok(c) => c,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("token {shown}: {e}"),
                "the file must hold the projected service-account JWT written by kubelet",
            );
        }
    };
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let aud: Vec<String> = match &claims["aud"] {
        serde_json::Value::String(s) => vec![s.clone()],
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        _ => vec![],
    };
    let want = &cfg.identity.token_audiences;
    if !aud.iter().any(|a| want.contains(a)) {
        return Check::fail(
            NAME,
            format!(
                "token {shown} has audience [{}], the CA expects one of [{}]",
                aud.join(", "),
                want.join(", ")
            ),
            format!(
                "project the token with `audience: {}` (the istio-token volume) or set \
                 TOKEN_AUDIENCES to its audience",
                want.first().map_or("istio-ca", String::as_str)
            ),
        );
    }
    let Some(exp) = claims["exp"].as_i64() else {
        return Check::warn(
            NAME,
            format!("token {shown} (audience {}) has no expiry", aud.join(", ")),
            "use a projected token (bounded lifetime), not a legacy secret token",
        );
    };
    let at = crate::logging::format_time(
        SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(exp).unwrap_or(0)),
    );
    if exp <= now {
        return Check::fail(
            NAME,
            format!("token {shown} expired at {at} ({}s ago)", now - exp),
            "kubelet refreshes a projected token before it expires: an expired one means the \
             file is a copy (mount the projected volume itself) or kubelet cannot reach the API \
             server; restart the pod once fixed",
        );
    }
    let left = exp - now;
    let detail = format!(
        "token {shown}: audience {}, expires at {at} (in {left}s)",
        aud.join(", ")
    );
    if (left as u64) < TOKEN_SOON.as_secs() {
        return Check::warn(
            NAME,
            detail,
            "kubelet should have refreshed it by now: check that the volume is projected",
        );
    }
    Check::ok(NAME, detail)
}

/// Compares this clock with the NotBefore of the certificates the control plane presented.
fn clock(not_before: &[SystemTime], now: SystemTime) -> Check {
    const NAME: &str = "clock";
    let Some(latest) = not_before.iter().max() else {
        return Check::warn(
            NAME,
            "no control-plane certificate was seen to compare this clock with",
            "fix the ca/istiod checks above, then run the doctor again",
        );
    };
    let at = crate::logging::format_time(*latest);
    match latest.duration_since(now) {
        Ok(ahead) if ahead > Duration::from_secs(1) => Check::fail(
            NAME,
            format!(
                "this clock is at least {}s behind: the control plane's certificate is valid \
                 only from {at}",
                ahead.as_secs()
            ),
            "synchronise the node's clock (NTP/chrony): certificates issued now look not yet \
             valid here",
        ),
        _ => Check::ok(
            NAME,
            format!("this clock is after the control plane certificate's NotBefore ({at})"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jwt_payloads() {
        let b = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let t = format!("{}.{}.sig", b("{}"), b(r#"{"aud":["istio-ca"],"exp":5}"#));
        let c = jwt_claims(&t).unwrap();
        assert_eq!(c["exp"], 5);
        assert!(jwt_claims("abc").unwrap_err().contains("three"));
        assert!(jwt_claims("a.!!.c").unwrap_err().contains("base64url"));
    }

    #[test]
    fn clock_behind_is_a_failure() {
        let now = SystemTime::now();
        assert_eq!(
            clock(&[now - Duration::from_secs(60)], now).status,
            super::super::Status::Ok
        );
        let c = clock(&[now + Duration::from_secs(3600)], now);
        assert_eq!(c.status, super::super::Status::Fail);
        assert!(c.detail.contains("3600s behind"), "{c:?}");
    }
}
