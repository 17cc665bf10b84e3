//! OCI registry pulls (Istio `pkg/wasm/imagefetcher.go`, which uses go-containerregistry):
//! the distribution API (`/v2/<repo>/manifests/<ref>`, `/v2/<repo>/blobs/<digest>`) with
//! anonymous, Basic or Bearer-token auth, over the guarded [`Client`] so that the registry,
//! blob redirects (S3/CDN) and token realms are all checked at dial time. The checksum of
//! an image is its **manifest digest**. Layouts, tried in Istio's order: Docker schema2
//! (last layer a gzip tar; its first file is the module), OCI "compat" (last layer an OCI
//! gzip tar holding `plugin.wasm`), OCI artifact (two layers, one of them the raw module).
//!
//! Image indexes (OCI index, Docker manifest list) resolve to the child for `linux/amd64`, as
//! go-containerregistry's `remote.Descriptor.Image` does for Istio; the checksum is then the
//! child's manifest digest (`img.Digest()`).
//!
//! The protocol runs on the agent's own client rather than an OCI client crate: oci-client
//! (and its predecessor oci-distribution) builds its reqwest client itself from a
//! `ClientConfig` that has no resolver, connector or redirect hook, so the dial-time SSRF
//! check (resolved address, every redirect and realm) could not be applied (docs/wasm.md).
//! The formats are maintained crates: manifests and indexes are `oci-spec` types, docker
//! config files are read by `docker_credential`.

use std::path::Path;

use base64::Engine as _;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use tokio::time::Instant;

use super::client::{Client, ClientError};
use super::fetch::{self, FetchError, FetchResult, Limits, download_err};
use super::guard;
use super::unpack::{self, Module, TarMember};
use oci_spec::image::{Arch, ImageIndex, ImageManifest, Os};

pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_LAYER: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
pub const OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const WASM_LAYER: &str = "application/vnd.module.wasm.content.layer.v1+wasm";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// What go-containerregistry's `remote.Get` accepts (images and indexes).
const ACCEPT: &str = "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.oci.image.index.v1+json";
const MAX_MANIFEST: usize = 4 * 1024 * 1024;

/// A parsed `oci://` reference, normalised as go-containerregistry's `name.ParseReference`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `host[:port]`; Docker Hub is `index.docker.io`.
    pub registry: String,
    pub repository: String,
    /// Tag (default `latest`) or `sha256:<hex>`.
    pub reference: String,
    pub is_digest: bool,
}

impl Reference {
    pub fn parse(url: &str) -> Result<Reference, String> {
        let rest = url
            .strip_prefix("oci://")
            .ok_or_else(|| format!("{url:?} is not an oci:// URL"))?;
        let (name, reference, is_digest) = match rest.split_once('@') {
            Some((n, d)) => {
                let hex = d
                    .strip_prefix("sha256:")
                    .ok_or_else(|| format!("{url:?}: only sha256 digests are supported"))?;
                if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(format!("{url:?}: invalid digest"));
                }
                (n, d.to_ascii_lowercase(), true)
            }
            None => {
                let slash = rest.rfind('/').map(|i| i + 1).unwrap_or(0);
                match rest[slash..].rfind(':') {
                    Some(i) => (&rest[..slash + i], rest[slash + i + 1..].to_owned(), false),
                    None => (rest, "latest".to_owned(), false),
                }
            }
        };
        let (first, path) = name.split_once('/').unwrap_or(("", name));
        let (registry, repository) =
            if first.contains('.') || first.contains(':') || first == "localhost" {
                (first.to_owned(), path.to_owned())
            } else {
                let repo = if name.contains('/') {
                    name.to_owned()
                } else {
                    format!("library/{name}")
                };
                ("index.docker.io".to_owned(), repo)
            };
        let registry = if registry == "docker.io" {
            "index.docker.io".to_owned()
        } else {
            registry
        };
        if repository.is_empty()
            || reference.is_empty()
            || !repository
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-/".contains(&b))
        {
            return Err(format!("{url:?}: invalid repository or tag"));
        }
        Ok(Reference {
            registry,
            repository,
            reference,
            is_digest,
        })
    }

    /// The cache's module name: `oci://<registry>/<repository>` (tag and digest stripped).
    pub fn module_name(&self) -> String {
        format!("oci://{}/{}", self.registry, self.repository)
    }

    fn host(&self) -> &str {
        let r = self.registry.as_str();
        if let Some(rest) = r.strip_prefix('[') {
            return rest.split(']').next().unwrap_or(rest);
        }
        r.rsplit_once(':').map(|(h, _)| h).unwrap_or(r)
    }

    /// go-containerregistry `Registry.Scheme`: plain HTTP for insecure registries,
    /// `localhost:`, loopback and RFC 1918 addresses; HTTPS otherwise.
    fn plain_http_by_default(&self, client: &Client) -> bool {
        let h = self.host();
        client.insecure(h)
            || self.registry.starts_with("localhost:")
            || h.parse::<std::net::IpAddr>()
                .map(|ip| match ip {
                    std::net::IpAddr::V4(v4) => v4.is_loopback() || v4.is_private(),
                    std::net::IpAddr::V6(v6) => v6.is_loopback(),
                })
                .unwrap_or(false)
    }
}

/// Registry credentials from a docker config (pull secret or keychain).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

/// Looks `registry` up in a docker `config.json` (a pull secret or the keychain file) with
/// `docker_credential`: `auths` entries (`auth` = b64(user:pass), or `username`/`password`;
/// keys may carry a scheme and path, Docker Hub's is `https://index.docker.io/v1/`), then
/// `credHelpers` / `credsStore` helpers (`docker-credential-<name>`, as the Docker CLI
/// config that go-containerregistry's keychain reads) when `helpers` is set; a pull secret
/// (`helpers` false) gets its `auths` only, so that a Secret cannot make the agent run a
/// program. No entry is anonymous access. Blocking (a helper is a process): call it on the
/// blocking pool.
pub fn credentials(
    config_json: &[u8],
    registry: &str,
    helpers: bool,
) -> Result<Option<Credentials>, String> {
    use docker_credential::{CredentialRetrievalError as E, DockerCredential};
    let stripped;
    let json = if helpers {
        config_json
    } else {
        let mut v: serde_json::Value = serde_json::from_slice(config_json)
            .map_err(|_| "not a docker config JSON document".to_owned())?;
        if let Some(o) = v.as_object_mut() {
            o.remove("credsStore");
            o.remove("credHelpers");
        }
        stripped = v.to_string();
        stripped.as_bytes()
    };
    match docker_credential::get_credential_from_reader(json, registry) {
        Ok(DockerCredential::UsernamePassword(username, password)) => {
            Ok(Some(Credentials { username, password }))
        }
        Ok(DockerCredential::IdentityToken(_)) => Err(format!(
            "the entry for {registry} is an identity token (OAuth2 refresh token), which is not supported; use a username and password"
        )),
        Err(E::NoCredentialConfigured) => Ok(None),
        Err(E::ConfigReadError) => Err("not a docker config JSON document".to_owned()),
        Err(e) => Err(format!("credentials for {registry}: {e}")),
    }
}

/// A pulled image: the module and the manifest digest (hex, the cache checksum).
pub struct Image {
    pub module: Module,
    pub digest: String,
}

struct Session<'a> {
    client: &'a Client,
    base: String,
    reference: &'a Reference,
    creds: Option<Credentials>,
    auth: Option<String>,
    /// The fetch's overall deadline (`http_uri.timeout`), for every request of the pull.
    deadline: Instant,
}

pub async fn pull(
    client: &Client,
    r: &Reference,
    creds: Option<Credentials>,
    limits: &Limits,
    tmp_dir: &Path,
    deadline: Instant,
) -> Result<Image, FetchError> {
    let work = async {
        // go-containerregistry's ping: HTTPS first; plain HTTP after it for the registries
        // `Registry.Scheme` calls "http" (insecure, localhost, loopback, RFC 1918). Istio
        // (`imagefetcher.go` `PrepareFetch`) also retries with `name.Insecure` when a TLS
        // registry "gave HTTP response", which ends in the same plain-HTTP attempt.
        let mut schemes = vec!["https"];
        if r.plain_http_by_default(client) {
            schemes.push("http");
        }
        let mut s = Session {
            client,
            base: String::new(),
            reference: r,
            creds,
            auth: None,
            deadline,
        };
        let mut i = 0;
        // A failed HTTPS attempt is part of the error of the plain-HTTP one that follows
        // (an untrusted certificate would otherwise end as the 400 a TLS port answers).
        let mut earlier: Option<String> = None;
        let manifest = loop {
            s.base = format!("{}://{}", schemes[i], r.registry);
            match s.manifest(&r.reference).await {
                Ok(m) => break m,
                Err(Failure::Client(ClientError::Tls {
                    plain_http: true, ..
                })) if !schemes.contains(&"http") => schemes.push("http"),
                // A plain-HTTP server behind the HTTPS attempt: nothing worth reporting.
                Err(Failure::Client(ClientError::Tls {
                    plain_http: true, ..
                })) if i + 1 < schemes.len() => {}
                Err(Failure::Client(
                    e @ (ClientError::Tls { .. }
                    | ClientError::Connect { .. }
                    | ClientError::Exchange { .. }),
                )) if i + 1 < schemes.len() => earlier = Some(e.to_string()),
                Err(e) => {
                    let mut e = e.into_fetch(FetchResult::ManifestFailure);
                    if let Some(first) = earlier {
                        e.message = format!("{first}; then {}", e.message);
                    }
                    return Err(e);
                }
            }
            i += 1;
        };
        s.image(manifest, limits, tmp_dir, deadline).await
    };
    match tokio::time::timeout_at(deadline, work).await {
        Ok(r) => r,
        Err(_) => Err(FetchError::new(
            FetchResult::DownloadFailure,
            format!("{}: timed out", r.module_name()),
        )),
    }
}

enum Failure {
    Client(ClientError),
    Other(String),
}

impl Failure {
    fn into_fetch(self, result: FetchResult) -> FetchError {
        match self {
            Failure::Client(e) => FetchError::new(result, e.to_string()),
            Failure::Other(m) => FetchError::new(result, m),
        }
    }
}

impl From<ClientError> for Failure {
    fn from(e: ClientError) -> Failure {
        Failure::Client(e)
    }
}

impl Session<'_> {
    /// GET with the session's auth; on a 401, authenticate once as the challenge says.
    async fn get(
        &mut self,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<super::client::Fetched, Failure> {
        let url = format!("{}{path}", self.base);
        let resp = self
            .client
            .get(&url, headers, self.auth.as_deref(), self.deadline)
            .await?;
        if resp.status != StatusCode::UNAUTHORIZED {
            return Ok(resp);
        }
        let parsed = challenges(
            resp.headers
                .get_all(header::WWW_AUTHENTICATE)
                .iter()
                .filter_map(|v| v.to_str().ok()),
        );
        resp.discard();
        let challenges = parsed.map_err(|e| Failure::Other(format!("{url}: {e}")))?;
        // Istio `ssrfProtectionTransport`: every realm of every Bearer challenge is checked
        // before any is used. A Basic realm is a protection-space label, never dialled
        // (htpasswd registries send e.g. `Basic realm="Registry Realm"`), so it is not a URL
        // to check.
        for c in challenges.iter().filter(|c| c.scheme == "bearer") {
            if let Some(realm) = c.param("realm") {
                guard::check_realm(realm, &self.reference.registry)
                    .map_err(|e| Failure::Other(e.to_string()))?;
            }
        }
        // The first challenge is the one answered (go-containerregistry `transport/ping.go`).
        let Some(c) = challenges.first() else {
            return Err(Failure::Other(format!(
                "{url}: 401 without WWW-Authenticate"
            )));
        };
        let scheme = c.scheme.clone();
        self.auth = Some(match scheme.as_str() {
            "bearer" => format!("Bearer {}", self.token(c).await?),
            "basic" => match &self.creds {
                Some(cr) => basic(cr),
                None => {
                    return Err(Failure::Other(format!(
                        "{url}: registry requires credentials"
                    )));
                }
            },
            _ => {
                return Err(Failure::Other(format!(
                    "{url}: unsupported auth scheme {scheme:?}"
                )));
            }
        });
        let resp = self
            .client
            .get(&url, headers, self.auth.as_deref(), self.deadline)
            .await?;
        if resp.status == StatusCode::UNAUTHORIZED {
            resp.discard();
            return Err(Failure::Other(format!("{url}: unauthorized")));
        }
        Ok(resp)
    }

    /// The registry token flow (distribution `token` spec): GET realm?service&scope, Basic
    /// credentials if any; the answer's `token` or `access_token`.
    async fn token(&self, challenge: &Challenge) -> Result<String, Failure> {
        let realm = challenge.param("realm").unwrap_or_default().to_owned();
        let service = challenge.param("service").map(str::to_owned);
        let scope = challenge
            .param("scope")
            .map(str::to_owned)
            .unwrap_or_else(|| format!("repository:{}:pull", self.reference.repository));
        let mut url = realm.clone();
        url.push(if realm.contains('?') { '&' } else { '?' });
        if let Some(s) = service {
            url.push_str(&format!("service={}&", encode(&s)));
        }
        url.push_str(&format!("scope={}", encode(&scope)));
        let auth = self.creds.as_ref().map(basic);
        let resp = self
            .client
            .get(&url, &HeaderMap::new(), auth.as_deref(), self.deadline)
            .await?;
        if resp.status != StatusCode::OK {
            let st = resp.status;
            resp.discard();
            let why = match (st, &self.creds) {
                (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, Some(_)) => {
                    " (the credentials were refused)"
                }
                (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, None) => {
                    " (no credentials for this registry in the pull secret or docker config)"
                }
                _ => "",
            };
            return Err(Failure::Other(format!(
                "token endpoint {realm}: status {st}{why}"
            )));
        }
        let body = resp.bytes(1024 * 1024).await?;
        let v: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| Failure::Other(format!("token endpoint {realm}: {e}")))?;
        v.get("token")
            .or_else(|| v.get("access_token"))
            .and_then(|t| t.as_str())
            .map(str::to_owned)
            .ok_or_else(|| Failure::Other(format!("token endpoint {realm}: no token")))
    }

    /// GET `/v2/<repo>/manifests/<reference>`: the raw bytes (they are what the digest is
    /// of) and the `Content-Type`.
    async fn manifest(&mut self, reference: &str) -> Result<(Vec<u8>, String), Failure> {
        let mut h = HeaderMap::new();
        h.insert(header::ACCEPT, HeaderValue::from_static(ACCEPT));
        let path = format!("/v2/{}/manifests/{reference}", self.reference.repository);
        let resp = self.get(&path, &h).await?;
        if resp.status != StatusCode::OK {
            let st = resp.status;
            let u = resp.url_text().to_owned();
            resp.discard();
            return Err(Failure::Other(format!("{u}: status {st}")));
        }
        let ct = resp
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        Ok((resp.bytes(MAX_MANIFEST).await?, ct))
    }

    async fn image(
        &mut self,
        (mut bytes, content_type): (Vec<u8>, String),
        limits: &Limits,
        tmp_dir: &Path,
        deadline: Instant,
    ) -> Result<Image, FetchError> {
        let manifest_err = |m: String| FetchError::new(FetchResult::ManifestFailure, m);
        let mut digest = unpack::sha256_hex(&bytes);
        // go-containerregistry checks what a digest reference returns against the digest.
        if self.reference.is_digest && self.reference.reference != format!("sha256:{digest}") {
            return Err(manifest_err(format!(
                "manifest digest sha256:{digest} does not match {}",
                self.reference.reference
            )));
        }
        let mut media_type = media_type_of(&bytes, &content_type);
        if media_type == OCI_INDEX || media_type == DOCKER_MANIFEST_LIST {
            let child = platform_child(&bytes)
                .map_err(|m| manifest_err(format!("{}: {m}", self.reference.module_name())))?;
            let (b, ct) = self
                .manifest(&child)
                .await
                .map_err(|e| e.into_fetch(FetchResult::ManifestFailure))?;
            digest = unpack::sha256_hex(&b);
            if child != format!("sha256:{digest}") {
                return Err(manifest_err(format!(
                    "manifest digest sha256:{digest} does not match {child} (from the index)"
                )));
            }
            media_type = media_type_of(&b, &ct);
            bytes = b;
        }
        let m: ImageManifest = serde_json::from_slice(&bytes)
            .map_err(|e| manifest_err(format!("invalid image manifest: {e}")))?;
        let layers: Vec<(String, String)> = m
            .layers()
            .iter()
            .map(|l| (l.media_type().to_string(), l.digest().to_string()))
            .collect();
        let (layer_digest, member) = select_layer(&media_type, &layers).ok_or_else(|| {
            manifest_err(format!(
                "{}: the image is not a Wasm image (Docker schema2, OCI compat or OCI artifact layout)",
                self.reference.module_name()
            ))
        })?;
        let Some(want) = layer_digest.strip_prefix("sha256:").map(str::to_owned) else {
            return Err(manifest_err(format!(
                "unsupported layer digest {layer_digest:?}"
            )));
        };
        let path = format!("/v2/{}/blobs/{layer_digest}", self.reference.repository);
        let resp = self
            .get(&path, &HeaderMap::new())
            .await
            .map_err(|e| e.into_fetch(FetchResult::DownloadFailure))?;
        if resp.status != StatusCode::OK {
            let msg = format!("{}: status {}", resp.url_text(), resp.status);
            resp.discard();
            return Err(FetchError::new(FetchResult::DownloadFailure, msg));
        }
        let (file, got) = fetch::body_to_temp(resp, tmp_dir, limits.max_bytes, deadline)
            .await
            .map_err(download_err)?;
        if got != want {
            return Err(FetchError::new(
                FetchResult::DownloadFailure,
                format!("layer {layer_digest}: content has digest sha256:{got}"),
            ));
        }
        let module =
            fetch::unpack_blocking(file, Some(got), tmp_dir, limits.max_bytes, member).await?;
        Ok(Image { module, digest })
    }
}

/// The manifest's own `mediaType`, else the response's `Content-Type`.
fn media_type_of(bytes: &[u8], content_type: &str) -> String {
    #[derive(serde::Deserialize)]
    struct Head {
        #[serde(rename = "mediaType")]
        media_type: Option<String>,
    }
    serde_json::from_slice::<Head>(bytes)
        .ok()
        .and_then(|h| h.media_type)
        .unwrap_or_else(|| {
            content_type
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
}

/// go-containerregistry `remoteIndex.childByPlatform` with its default platform
/// `linux/amd64`: the first child whose platform has that OS and architecture (any variant,
/// OS version or features, since the wanted platform sets none); a child without a platform
/// counts as `linux/amd64`. No such child is an error, as in go-containerregistry.
pub fn platform_child(index: &[u8]) -> Result<String, String> {
    let idx: ImageIndex =
        serde_json::from_slice(index).map_err(|e| format!("invalid image index: {e}"))?;
    idx.manifests()
        .iter()
        .find(|d| {
            d.platform()
                .as_ref()
                .is_none_or(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64)
        })
        .map(|d| d.digest().to_string())
        .ok_or_else(|| "no child with platform linux/amd64 in the image index".to_owned())
}

/// The layer holding the module, in Istio's order (`imagefetcher.go` `PrepareFetch`):
/// Docker schema2 (last layer a Docker gzip tar; its first file), OCI compat (last layer an
/// OCI gzip tar; `plugin.wasm`), OCI artifact (two layers, one the raw module).
fn select_layer(media_type: &str, layers: &[(String, String)]) -> Option<(String, TarMember)> {
    match layers.last() {
        Some((mt, d)) if media_type == DOCKER_MANIFEST && mt == DOCKER_LAYER => {
            Some((d.clone(), TarMember::First))
        }
        Some((mt, d)) if mt == OCI_LAYER => Some((d.clone(), TarMember::PluginWasm)),
        _ if layers.len() == 2 => layers
            .iter()
            .find(|(mt, _)| mt == WASM_LAYER)
            .map(|(_, d)| (d.clone(), TarMember::First)),
        _ => None,
    }
}

fn basic(c: &Credentials) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", c.username, c.password))
    )
}

/// One `WWW-Authenticate` challenge: the scheme lowercased, parameter names lowercased and
/// values unquoted and unescaped.
#[derive(Debug, PartialEq, Eq)]
struct Challenge {
    scheme: String,
    params: Vec<(String, String)>,
}

impl Challenge {
    fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every challenge of every `WWW-Authenticate` value, in order, parsed by `http-auth` (RFC
/// 7235: commas and escaped quotes inside quoted values, several challenges in one value).
/// A malformed value is an error naming it.
fn challenges<'a>(values: impl Iterator<Item = &'a str>) -> Result<Vec<Challenge>, String> {
    let mut out = Vec::new();
    for v in values {
        for c in http_auth::parser::ChallengeParser::new(v) {
            let c = c.map_err(|e| format!("malformed WWW-Authenticate {v:?}: {e}"))?;
            out.push(Challenge {
                scheme: c.scheme.to_ascii_lowercase(),
                params: c
                    .params
                    .iter()
                    .map(|(k, v)| (k.to_ascii_lowercase(), v.to_unescaped()))
                    .collect(),
            });
        }
    }
    Ok(out)
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_normalise_as_go_containerregistry() {
        let r = Reference::parse("oci://127.0.0.1:5000/wasm/hdr:v1").unwrap();
        assert_eq!(
            (
                r.registry.as_str(),
                r.repository.as_str(),
                r.reference.as_str()
            ),
            ("127.0.0.1:5000", "wasm/hdr", "v1")
        );
        assert_eq!(r.module_name(), "oci://127.0.0.1:5000/wasm/hdr");
        let r = Reference::parse("oci://plugin").unwrap();
        assert_eq!(r.module_name(), "oci://index.docker.io/library/plugin");
        assert_eq!(r.reference, "latest");
        let d = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("oci://ghcr.io/o/p@{d}")).unwrap();
        assert!(r.is_digest);
        assert_eq!(r.reference, d);
        assert!(Reference::parse("oci://ghcr.io/o/p@sha256:zz").is_err());
        assert!(Reference::parse("http://x/y").is_err());
    }

    #[test]
    fn index_children_are_chosen_as_go_containerregistry_does() {
        let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        let idx = |children: serde_json::Value| {
            serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": children})
                .to_string()
        };
        let child = |c: char, platform: serde_json::Value| {
            let mut v = serde_json::json!({"mediaType": OCI_MANIFEST, "digest": d(c), "size": 1});
            if !platform.is_null() {
                v["platform"] = platform;
            }
            v
        };
        let p = |os: &str, arch: &str| serde_json::json!({"os": os, "architecture": arch});
        // The first linux/amd64 child, whatever its variant; arm64 and windows are skipped.
        let i = idx(serde_json::json!([
            child('a', p("linux", "arm64")),
            child('b', p("windows", "amd64")),
            child(
                'c',
                serde_json::json!({"os": "linux", "architecture": "amd64", "variant": "v3"})
            ),
            child('e', p("linux", "amd64")),
        ]));
        assert_eq!(platform_child(i.as_bytes()).unwrap(), d('c'));
        // No platform: taken as linux/amd64.
        let i = idx(serde_json::json!([
            child('a', p("linux", "arm64")),
            child('b', serde_json::Value::Null)
        ]));
        assert_eq!(platform_child(i.as_bytes()).unwrap(), d('b'));
        let i = idx(serde_json::json!([child('a', p("linux", "arm64"))]));
        assert!(
            platform_child(i.as_bytes())
                .unwrap_err()
                .contains("no child with platform linux/amd64")
        );
        assert!(platform_child(b"{}").is_err());
    }

    #[test]
    fn module_layers_in_istios_order() {
        let l = |mt: &str, c: char| {
            (
                mt.to_owned(),
                format!("sha256:{}", c.to_string().repeat(64)),
            )
        };
        let docker = [l(DOCKER_LAYER, 'a')];
        assert!(matches!(
            select_layer(DOCKER_MANIFEST, &docker),
            Some((_, TarMember::First))
        ));
        // A Docker layer in an OCI manifest is not the Docker layout.
        assert!(select_layer(OCI_MANIFEST, &docker).is_none());
        let compat = [l(DOCKER_LAYER, 'a'), l(OCI_LAYER, 'b')];
        assert!(matches!(
            select_layer(OCI_MANIFEST, &compat),
            Some((_, TarMember::PluginWasm))
        ));
        let art = [
            l("application/vnd.oci.image.layer.v1.tar", 'a'),
            l(WASM_LAYER, 'b'),
        ];
        let (d, m) = select_layer(OCI_MANIFEST, &art).unwrap();
        assert_eq!((d.as_str(), m), (art[1].1.as_str(), TarMember::First));
        let three = [l(WASM_LAYER, 'a'), l("x", 'b'), l("y", 'c')];
        assert!(select_layer(OCI_MANIFEST, &three).is_none());
    }

    #[test]
    fn challenge_with_quoted_comma_in_scope() {
        let c = challenges(
            [r#"Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull,push""#]
                .into_iter(),
        )
        .unwrap();
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].param("scope"), Some("repository:a/b:pull,push"));
        assert_eq!(c[0].param("service"), Some("reg"));
    }

    #[test]
    fn a_parameter_name_inside_a_quoted_value_is_text() {
        // The hand parser this replaced took `scope=evil"` out of the realm's query.
        let c = challenges(
            [r#"Bearer realm="https://auth.example/token?a=1, scope=evil",scope="repository:x:pull""#]
                .into_iter(),
        )
        .unwrap();
        assert_eq!(
            c[0].param("realm"),
            Some("https://auth.example/token?a=1, scope=evil")
        );
        assert_eq!(c[0].param("scope"), Some("repository:x:pull"));
    }

    #[test]
    fn challenge_with_escaped_quotes_and_case() {
        let c = challenges(
            [r#"BEARER Realm="https://a.example/t",  error="say \"no\", twice""#].into_iter(),
        )
        .unwrap();
        assert_eq!(c[0].scheme, "bearer");
        assert_eq!(c[0].param("realm"), Some("https://a.example/t"));
        assert_eq!(c[0].param("error"), Some(r#"say "no", twice"#));
    }

    #[test]
    fn several_challenges_basic_and_bearer() {
        // Two challenges in one value, a third in a second header value.
        let c = challenges(
            [
                r#"Basic realm="Registry Realm", Bearer realm="https://auth.example/token",scope="repository:x:pull""#,
                r#"Bearer realm="https://other.example/t""#,
            ]
            .into_iter(),
        )
        .unwrap();
        let schemes: Vec<&str> = c.iter().map(|c| c.scheme.as_str()).collect();
        assert_eq!(schemes, ["basic", "bearer", "bearer"]);
        assert_eq!(c[0].param("realm"), Some("Registry Realm"));
        assert_eq!(c[0].param("scope"), None);
        assert_eq!(c[1].param("scope"), Some("repository:x:pull"));
        assert_eq!(c[2].param("realm"), Some("https://other.example/t"));
        // Unterminated quotes are an error, not a guess.
        let e = challenges([r#"Bearer realm="https://a.example"#].into_iter()).unwrap_err();
        assert!(e.starts_with("malformed WWW-Authenticate"), "{e}");
    }

    #[test]
    fn challenge_params_and_keychain() {
        let c = r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a:pull""#;
        let c = &challenges([c].into_iter()).unwrap()[0];
        assert_eq!(c.param("realm"), Some("https://auth.example/token"));
        assert_eq!(c.param("service"), Some("registry.example"));
        let cfg = br#"{"auths":{"https://index.docker.io/v1/":{"auth":"dTpw"},"r.example:5000":{"username":"a","password":"b"}}}"#;
        assert_eq!(
            credentials(cfg, "index.docker.io", true)
                .unwrap()
                .unwrap()
                .username,
            "u"
        );
        assert_eq!(
            credentials(cfg, "r.example:5000", false)
                .unwrap()
                .unwrap()
                .password,
            "b"
        );
        assert_eq!(credentials(cfg, "other", true).unwrap(), None);
        assert!(credentials(b"{", "x", true).is_err());
        // `username`/`password` next to an `auth` that disagrees: refused, not guessed.
        let both = br#"{"auths":{"r:1":{"auth":"dTpw","username":"x","password":"y"}}}"#;
        assert!(credentials(both, "r:1", true).is_err());
        // A pull secret naming a credential helper runs nothing: no entry, anonymous.
        let helper = br#"{"credsStore":"meshagent-test-none","credHelpers":{"r:1":"x"}}"#;
        assert_eq!(credentials(helper, "r:1", false).unwrap(), None);
        assert!(
            credentials(helper, "r:1", true).is_err(),
            "the keychain runs helpers"
        );
        assert!(credentials(b"{", "x", false).is_err());
        let tok = br#"{"auths":{"r:1":{"identitytoken":"t"}}}"#;
        assert!(
            credentials(tok, "r:1", true)
                .unwrap_err()
                .contains("identity token")
        );
    }
}
