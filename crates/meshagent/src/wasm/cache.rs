//! The module cache (Istio `pkg/wasm/cache.go` `LocalFileCache`): files at
//! `<dir>/<hex sha256(module name)>/<checksum>.wasm` (directories 0755, files 0644), where the
//! module name is the URL for HTTP(S) and `oci://<registry>/<repository>` for OCI; the
//! checksum is the module's sha256 (HTTP) or the image manifest digest (OCI).
//!
//! Better than Istio:
//! * the index is rebuilt from that layout when the agent starts, so a container restart
//!   with a kept `emptyDir` does not refetch every module (Istio keeps the index in memory);
//! * the same module requested concurrently is downloaded once (Istio downloads in parallel);
//! * downloads stream to disk; files appear by rename, so a crash never leaves a partial
//!   module under a cache name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::FutureExt as _;
use futures::future::{BoxFuture, Shared};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use super::client::Client;
use super::fetch::{self, FetchError, FetchResult, Limits};
use super::metrics::Metrics;
use super::oci;
use super::unpack;

/// `ISTIO_META_WASM_IMAGE_PULL_POLICY` (Istio `extensions.v1alpha1.PullPolicy`); unknown
/// values are Unspecified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PullPolicy {
    #[default]
    Unspecified,
    IfNotPresent,
    Always,
}

impl PullPolicy {
    pub fn parse(s: &str) -> PullPolicy {
        match s {
            "IfNotPresent" => PullPolicy::IfNotPresent,
            "Always" => PullPolicy::Always,
            _ => PullPolicy::Unspecified,
        }
    }
}

/// Istio `shouldIgnoreResourceVersion`: `Always` honours resource version changes;
/// Unspecified does so only for OCI URLs whose path ends in `:latest` (an untagged
/// reference does not count, as in Istio's suffix test).
fn ignore_resource_version(policy: PullPolicy, url: &str) -> bool {
    match policy {
        PullPolicy::Always => false,
        PullPolicy::IfNotPresent => true,
        PullPolicy::Unspecified => !(url.starts_with("oci://") && url.ends_with(":latest")),
    }
}

/// One module request.
#[derive(Debug, Clone, Default)]
pub struct GetOptions {
    /// Expected checksum (hex), empty when unknown.
    pub checksum: String,
    /// The ECDS resource name and `ISTIO_META_WASM_PLUGIN_RESOURCE_VERSION`.
    pub resource_name: String,
    pub resource_version: String,
    pub pull_policy: PullPolicy,
    /// `ISTIO_META_WASM_IMAGE_PULL_SECRET` (docker config JSON), OCI only.
    pub pull_secret: Option<Vec<u8>>,
    /// The overall budget (`http_uri.timeout`).
    pub timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct CacheOptions {
    pub dir: PathBuf,
    pub expiry: Duration,
    pub limits: Limits,
    /// The docker config keychain (`$DOCKER_CONFIG/config.json` or `~/.docker/config.json`).
    pub docker_config: Option<PathBuf>,
}

#[derive(Debug, Clone)]
struct Entry {
    path: PathBuf,
    /// The file's size, when known (downloaded, or restored by the startup scan).
    size: Option<u64>,
    last_used: Instant,
    /// When the file was written (restored entries: its mtime); picks the newest module of a
    /// URL after a restart.
    written: SystemTime,
}

#[derive(Debug, Default)]
struct ChecksumEntry {
    checksum: String,
    versions: HashMap<String, String>,
}

type Pending = Shared<BoxFuture<'static, Result<PathBuf, FetchError>>>;

#[derive(Default)]
struct Inner {
    /// (hex sha256 of module name, checksum) → file.
    modules: HashMap<(String, String), Entry>,
    /// URL → last downloaded checksum and resource versions seen per resource.
    checksums: HashMap<String, ChecksumEntry>,
    inflight: HashMap<String, Pending>,
}

pub struct Cache {
    opts: CacheOptions,
    client: Client,
    metrics: Metrics,
    inner: Mutex<Inner>,
    loaded: OnceCell<()>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Cache {
    pub fn new(opts: CacheOptions, client: Client, metrics: Metrics) -> Arc<Cache> {
        Arc::new(Cache {
            opts,
            client,
            metrics,
            inner: Mutex::default(),
            loaded: OnceCell::new(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.opts.dir
    }

    /// Number of modules in the index.
    pub fn len(&self) -> usize {
        lock(&self.inner).modules.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rebuilds the index from the directory (once, on first use; blocking pool).
    async fn load(&self) {
        self.loaded
            .get_or_init(|| async {
                let dir = self.opts.dir.clone();
                let found = tokio::task::spawn_blocking(move || scan(&dir))
                    .await
                    .unwrap_or_default();
                let now = Instant::now();
                let mut inner = lock(&self.inner);
                for (h, sum, path, written, size) in found {
                    inner.modules.insert(
                        (h, sum),
                        Entry {
                            path,
                            size,
                            last_used: now,
                            written,
                        },
                    );
                }
                if !inner.modules.is_empty() {
                    tracing::info!(modules = inner.modules.len(), dir = %self.opts.dir.display(), "Wasm cache restored from disk");
                }
                self.metrics.cache_entries.set(inner.modules.len() as f64);
            })
            .await;
    }

    /// The size of a cached module file, from what the cache recorded (no I/O).
    pub fn module_size(&self, path: &Path) -> Option<u64> {
        lock(&self.inner)
            .modules
            .values()
            .find(|e| e.path == path)
            .and_then(|e| e.size)
    }

    /// The local file of `url`, downloading it if the cache and pull policy say so.
    pub async fn get(self: &Arc<Self>, url: &str, o: GetOptions) -> Result<PathBuf, FetchError> {
        self.load().await;
        let (module_name, mut checksum, oci_ref) =
            if url.starts_with("http://") || url.starts_with("https://") {
                (url.to_owned(), o.checksum.clone(), None)
            } else if url.starts_with("oci://") {
                let r = oci::Reference::parse(url)
                    .map_err(|e| FetchError::new(FetchResult::FetchFailure, e))?;
                let sum = if r.is_digest {
                    r.reference.trim_start_matches("sha256:").to_owned()
                } else {
                    o.checksum.clone()
                };
                (r.module_name(), sum, Some(r))
            } else {
                return Err(FetchError::new(
                    FetchResult::FetchFailure,
                    format!("unsupported Wasm module downloading URL scheme: {url}"),
                ));
            };
        // One overall deadline (Istio `pkg/wasm/convert.go`: the fetch context's timeout is
        // `http_uri.timeout`): every request, body, token exchange and retry of this fetch,
        // and this caller's wait on another caller's download of the same module.
        let deadline = Instant::now() + o.timeout;
        let h = unpack::sha256_hex(module_name.as_bytes());
        let ignore_rv = ignore_resource_version(o.pull_policy, url);
        if let Some(p) = self.lookup(url, &h, &mut checksum, &o, ignore_rv) {
            return Ok(p);
        }
        let key = format!("{url}\n{checksum}");
        let pending = {
            let mut inner = lock(&self.inner);
            inner
                .inflight
                .entry(key.clone())
                .or_insert_with(|| {
                    let me = self.clone();
                    let url = url.to_owned();
                    let o = o.clone();
                    // A task of its own: the download runs to its end (success or deadline)
                    // even when every waiter has gone (a superseded ECDS response), so the
                    // single-flight entry never outlives its deadline unpolled.
                    let task = tokio::spawn(async move {
                        let work = me.download(&url, &h, &checksum, oci_ref, &o, deadline);
                        let r = match tokio::time::timeout_at(deadline, work).await {
                            Ok(r) => r,
                            Err(_) => Err(timed_out(&url, o.timeout)),
                        };
                        lock(&me.inner)
                            .inflight
                            .remove(&format!("{url}\n{checksum}"));
                        let label = match &r {
                            Ok(_) => FetchResult::Success.label(),
                            Err(e) => e.result.label(),
                        };
                        me.metrics.remote_fetch.with(&[label]).inc();
                        r
                    });
                    async move {
                        task.await.unwrap_or_else(|e| {
                            Err(FetchError::new(
                                FetchResult::FetchFailure,
                                format!("the download task failed: {e}"),
                            ))
                        })
                    }
                    .boxed()
                    .shared()
                })
                .clone()
        };
        // A caller joining a download started with a longer timeout still waits no longer
        // than its own.
        match tokio::time::timeout_at(deadline, pending).await {
            Ok(r) => r,
            Err(_) => Err(timed_out(url, o.timeout)),
        }
    }

    /// Istio `getEntry`, with the restart fallback: a URL without checksum whose module dir
    /// holds files from an earlier run uses the newest (when the policy allows the cache).
    fn lookup(
        &self,
        url: &str,
        h: &str,
        checksum: &mut String,
        o: &GetOptions,
        ignore_rv: bool,
    ) -> Option<PathBuf> {
        let mut inner = lock(&self.inner);
        if checksum.is_empty() {
            match inner.checksums.get_mut(url) {
                Some(ce) => {
                    if ignore_rv || ce.versions.get(&o.resource_name) == Some(&o.resource_version) {
                        *checksum = ce.checksum.clone();
                    }
                    ce.versions
                        .insert(o.resource_name.clone(), o.resource_version.clone());
                }
                None if ignore_rv => {
                    if let Some(((_, sum), _)) = inner
                        .modules
                        .iter()
                        .filter(|((mh, _), _)| mh == h)
                        .max_by_key(|(_, e)| e.written)
                    {
                        *checksum = sum.clone();
                        let mut ce = ChecksumEntry {
                            checksum: sum.clone(),
                            ..Default::default()
                        };
                        ce.versions
                            .insert(o.resource_name.clone(), o.resource_version.clone());
                        inner.checksums.insert(url.to_owned(), ce);
                    }
                }
                None => {}
            }
        }
        let hit = if checksum.is_empty() {
            None
        } else {
            inner
                .modules
                .get_mut(&(h.to_owned(), checksum.clone()))
                .map(|e| {
                    e.last_used = Instant::now();
                    e.path.clone()
                })
        };
        self.metrics
            .cache_lookup
            .with(&[if hit.is_some() { "true" } else { "false" }])
            .inc();
        hit
    }

    async fn download(
        self: &Arc<Self>,
        url: &str,
        h: &str,
        expected: &str,
        oci_ref: Option<oci::Reference>,
        o: &GetOptions,
        deadline: Instant,
    ) -> Result<PathBuf, FetchError> {
        let tmp = unpack::tmp_dir(&self.opts.dir);
        let (module, checksum) = match oci_ref {
            None => {
                let m = fetch::http(&self.client, url, &self.opts.limits, &tmp, deadline).await?;
                let sum = m.sha256.clone();
                (m, sum)
            }
            Some(r) => {
                let creds = self.credentials(&r, o.pull_secret.as_deref()).await?;
                let img =
                    oci::pull(&self.client, &r, creds, &self.opts.limits, &tmp, deadline).await?;
                (img.module, img.digest)
            }
        };
        if !expected.is_empty() && !expected.eq_ignore_ascii_case(&checksum) {
            return Err(FetchError::new(
                FetchResult::ChecksumMismatched,
                format!(
                    "module downloaded from {url} has checksum {checksum}, which does not match: {expected}"
                ),
            ));
        }
        let module_len = module.len;
        let dir = self.opts.dir.join(h);
        let path = dir.join(format!("{checksum}.wasm"));
        let p = path.clone();
        tokio::task::spawn_blocking(move || persist(module.file, &dir, &p))
            .await
            .map_err(|e| FetchError::new(FetchResult::FetchFailure, e.to_string()))?
            .map_err(|e| {
                FetchError::new(
                    FetchResult::FetchFailure,
                    format!("cannot write the Wasm module to {}: {e}", path.display()),
                )
            })?;
        let mut inner = lock(&self.inner);
        inner.modules.insert(
            (h.to_owned(), checksum.clone()),
            Entry {
                path: path.clone(),
                size: Some(module_len),
                last_used: Instant::now(),
                written: SystemTime::now(),
            },
        );
        let ce = inner.checksums.entry(url.to_owned()).or_default();
        ce.checksum = checksum;
        ce.versions
            .insert(o.resource_name.clone(), o.resource_version.clone());
        self.metrics.cache_entries.set(inner.modules.len() as f64);
        tracing::info!(url, file = %path.display(), "Wasm module fetched and cached");
        Ok(path)
    }

    /// Pull secret first (Istio: present but empty is an error, raised by the converter),
    /// then the docker config keychain.
    async fn credentials(
        &self,
        r: &oci::Reference,
        secret: Option<&[u8]>,
    ) -> Result<Option<oci::Credentials>, FetchError> {
        let bad = |m: String| FetchError::new(FetchResult::ManifestFailure, m);
        let registry = r.registry.clone();
        let lookup = |json: Vec<u8>, helpers: bool| {
            let registry = registry.clone();
            async move {
                tokio::task::spawn_blocking(move || oci::credentials(&json, &registry, helpers))
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()))
            }
        };
        // A pull secret comes from the mesh's config (a namespace's Secret): it may not make
        // the agent run credential-helper programs.
        if let Some(s) = secret {
            return lookup(s.to_vec(), false)
                .await
                .map_err(|e| bad(format!("pull secret: {e}")));
        }
        let Some(path) = self.opts.docker_config.clone() else {
            tracing::debug!("no HOME or DOCKER_CONFIG: anonymous registry access");
            return Ok(None);
        };
        let p = path.clone();
        let job = tokio::task::spawn_blocking(move || read_docker_config(&p));
        let data = match tokio::time::timeout(DOCKER_CONFIG_READ_TIMEOUT, job).await {
            Ok(Ok(Ok(Some(d)))) => d,
            Ok(Ok(Ok(None))) => return Ok(None),
            Ok(Ok(Err(e))) => return Err(bad(format!("docker config: {e}"))),
            Ok(Err(e)) => return Err(bad(format!("docker config {}: {e}", path.display()))),
            Err(_) => {
                return Err(bad(format!(
                    "docker config {}: not read within {DOCKER_CONFIG_READ_TIMEOUT:?}",
                    path.display()
                )));
            }
        };
        lookup(data, true)
            .await
            .map_err(|e| bad(format!("docker config {}: {e}", path.display())))
    }

    /// Removes modules unused for `WASM_MODULE_EXPIRY` (Istio `purge`).
    pub async fn purge(&self) {
        let now = Instant::now();
        let expired: Vec<((String, String), PathBuf)> = {
            let mut inner = lock(&self.inner);
            let keys: Vec<_> = inner
                .modules
                .iter()
                .filter(|(_, e)| now.duration_since(e.last_used) >= self.opts.expiry)
                .map(|(k, e)| (k.clone(), e.path.clone()))
                .collect();
            for (k, _) in &keys {
                inner.modules.remove(k);
                let sum = &k.1;
                inner.checksums.retain(|_, ce| &ce.checksum != sum);
            }
            self.metrics.cache_entries.set(inner.modules.len() as f64);
            keys
        };
        if expired.is_empty() {
            return;
        }
        #[allow(clippy::disallowed_methods, reason = "inside spawn_blocking")]
        let _ = tokio::task::spawn_blocking(move || {
            for (_, p) in expired {
                tracing::info!(file = %p.display(), "Wasm module expired; removed");
                let _ = std::fs::remove_file(&p);
                if let Some(d) = p.parent() {
                    let _ = std::fs::remove_dir(d); // only when empty
                }
            }
        })
        .await;
    }
}

fn timed_out(url: &str, timeout: Duration) -> FetchError {
    FetchError::new(
        FetchResult::DownloadFailure,
        format!("{url}: not fetched within the {timeout:?} of http_uri.timeout"),
    )
}

/// Bound on reading the docker config (a hung network home directory must not hold a pull
/// beyond it; the read itself may stay stuck on the blocking pool).
const DOCKER_CONFIG_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest docker config read.
const MAX_DOCKER_CONFIG: u64 = 1024 * 1024;

/// The keychain file as go-containerregistry's `authn.DefaultKeychain` finds it
/// (`pkg/authn/keychain.go`): the file is used only if `stat` finds something that is not a
/// directory; any `stat` failure (no file, no `.docker` directory, `HOME` not a directory or
/// not searchable) means anonymous access. A found file is loaded by docker/cli's
/// `config.Load` (`cli/config/config.go`), which fails on an unreadable file but takes an
/// empty one as no configuration (`LoadFromReader` ignores `io.EOF`: 0 bytes or only
/// whitespace). `Ok(None)`: anonymous. Blocking.
#[allow(
    clippy::disallowed_methods,
    reason = "runs on the blocking pool (Cache::auth)"
)]
fn read_docker_config(path: &Path) -> Result<Option<Vec<u8>>, String> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_dir() => {}
        Ok(_) => {
            tracing::debug!(path = %path.display(), "docker config is a directory: anonymous registry access");
            return Ok(None);
        }
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "no docker config: anonymous registry access");
            return Ok(None);
        }
    }
    match crate::fsio::read_bounded(path, MAX_DOCKER_CONFIG) {
        // Removed between the stat and the open: as if the stat had not found it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.to_string()),
        Ok(d) if d.iter().all(u8::is_ascii_whitespace) => {
            tracing::debug!(path = %path.display(), "docker config is empty: anonymous registry access");
            Ok(None)
        }
        Ok(d) => Ok(Some(d)),
    }
}

#[allow(clippy::disallowed_methods, reason = "runs on the blocking pool")]
fn persist(file: tempfile::NamedTempFile, dir: &Path, path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    // No fsync: the cache outlives container restarts (page cache kept), and a module torn
    // by a node crash is rejected by `scan` or fails Envoy's load like a missing one.
    std::fs::set_permissions(file.path(), std::fs::Permissions::from_mode(0o644))?;
    file.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// `(module dir, checksum, file, mtime)` of every `<hex>/<checksum>.wasm` under `dir`; the
/// temp directory of interrupted downloads is emptied.
#[allow(
    clippy::disallowed_methods,
    reason = "runs on the blocking pool (Cache::load)"
)]
fn scan(dir: &Path) -> Vec<(String, String, PathBuf, SystemTime, Option<u64>)> {
    let _ = std::fs::remove_dir_all(unpack::tmp_dir(dir));
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for d in rd.flatten() {
        let name = d.file_name().to_string_lossy().into_owned();
        if name.len() != 64 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
            continue;
        }
        let Ok(files) = std::fs::read_dir(d.path()) else {
            continue;
        };
        for f in files.flatten() {
            let fname = f.file_name().to_string_lossy().into_owned();
            let Some(sum) = fname.strip_suffix(".wasm") else {
                continue;
            };
            if !starts_with_magic(&f.path()) {
                let _ = std::fs::remove_file(f.path());
                continue;
            }
            let meta = f.metadata().ok();
            let mtime = meta
                .as_ref()
                .and_then(|m| m.modified().ok())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            out.push((
                name.clone(),
                sum.to_owned(),
                f.path(),
                mtime,
                meta.map(|m| m.len()),
            ));
        }
    }
    out
}

#[allow(
    clippy::disallowed_methods,
    reason = "called from scan, on the blocking pool"
)]
fn starts_with_magic(p: &Path) -> bool {
    use std::io::Read as _;
    let mut head = [0u8; 8];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut head))
        .is_ok()
        && head.starts_with(unpack::WASM_MAGIC)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::disallowed_methods,
        reason = "test code, not on the agent's runtime"
    )]
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// go-containerregistry's keychain: anything `stat` does not find is anonymous; a found
    /// file that is empty (or only whitespace, `io.EOF` to Go's decoder) is anonymous; a
    /// found file that cannot be read fails, naming it.
    #[test]
    fn c2_docker_config_missing_or_empty_is_anonymous() {
        let home = tempfile::tempdir().unwrap();
        let cfg = home.path().join(".docker/config.json");
        // HOME is an empty directory: no `.docker` directory.
        assert_eq!(read_docker_config(&cfg), Ok(None));
        // `.docker` exists, no config.json.
        std::fs::create_dir(home.path().join(".docker")).unwrap();
        assert_eq!(read_docker_config(&cfg), Ok(None));
        // Empty and whitespace-only files.
        for empty in ["", " \n\t\r\n"] {
            std::fs::write(&cfg, empty).unwrap();
            assert_eq!(read_docker_config(&cfg), Ok(None), "{empty:?}");
        }
        // A directory where the file should be.
        std::fs::remove_file(&cfg).unwrap();
        std::fs::create_dir(&cfg).unwrap();
        assert_eq!(read_docker_config(&cfg), Ok(None));
        // HOME is a file, not a directory (ENOTDIR), or does not exist.
        let file_home = home.path().join("plain");
        std::fs::write(&file_home, "x").unwrap();
        assert_eq!(
            read_docker_config(&file_home.join(".docker/config.json")),
            Ok(None)
        );
        assert_eq!(
            read_docker_config(&home.path().join("gone/.docker/config.json")),
            Ok(None)
        );
        // A present file is returned as is (malformed JSON is refused by the lookup, which
        // names the file: `Cache::credentials`).
        let h2 = tempfile::tempdir().unwrap();
        let cfg2 = h2.path().join("config.json");
        std::fs::write(&cfg2, "{not json").unwrap();
        assert_eq!(read_docker_config(&cfg2), Ok(Some(b"{not json".to_vec())));
        // Found but not a regular file (a FIFO, which would block a plain read): an error
        // naming it.
        std::fs::remove_file(&cfg2).unwrap();
        nix::unistd::mkfifo(&cfg2, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = read_docker_config(&cfg2).unwrap_err();
        assert!(e.contains(&*cfg2.to_string_lossy()), "{e}");
    }

    /// An unsearchable HOME (`stat` fails with EACCES) is anonymous too. Root passes every
    /// permission check, so as root the check runs in this test binary re-executed as
    /// `nobody` ([`c2_unreadable_home_child`]).
    #[test]
    fn c2_unreadable_home_is_anonymous() {
        use std::os::unix::fs::PermissionsExt as _;
        use std::os::unix::process::CommandExt as _;
        let home = tempfile::tempdir().unwrap();
        std::fs::create_dir(home.path().join(".docker")).unwrap();
        let cfg = home.path().join(".docker/config.json");
        std::fs::write(&cfg, "{}").unwrap();
        std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        if nix::unistd::geteuid().is_root() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "wasm::cache::tests::c2_unreadable_home_child"])
                .env("C2_DOCKER_CONFIG", &cfg)
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "{text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
        } else {
            std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o000)).unwrap();
            assert_eq!(read_docker_config(&cfg), Ok(None));
            std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        }
    }

    /// The unprivileged half of [`c2_unreadable_home_is_anonymous`] (does nothing alone).
    #[test]
    fn c2_unreadable_home_child() {
        if let Some(cfg) = std::env::var_os("C2_DOCKER_CONFIG") {
            let cfg = std::path::PathBuf::from(cfg);
            assert!(std::fs::metadata(&cfg).is_err(), "the home is searchable");
            assert_eq!(read_docker_config(&cfg), Ok(None));
        }
    }

    #[test]
    fn pull_policy_rules() {
        assert_eq!(PullPolicy::parse("Always"), PullPolicy::Always);
        assert_eq!(PullPolicy::parse("bogus"), PullPolicy::Unspecified);
        assert!(ignore_resource_version(
            PullPolicy::Unspecified,
            "http://h/x.wasm"
        ));
        assert!(ignore_resource_version(
            PullPolicy::Unspecified,
            "oci://r.io/a:v1"
        ));
        assert!(!ignore_resource_version(
            PullPolicy::Unspecified,
            "oci://r.io/a:latest"
        ));
        assert!(ignore_resource_version(
            PullPolicy::Unspecified,
            "oci://r.io/a"
        ));
        assert!(ignore_resource_version(
            PullPolicy::IfNotPresent,
            "oci://r.io/a:latest"
        ));
        assert!(!ignore_resource_version(
            PullPolicy::Always,
            "http://h/x.wasm"
        ));
    }
}
