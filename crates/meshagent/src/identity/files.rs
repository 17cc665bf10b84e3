//! File-backed secrets: `file-cert:<cert>~<key>`, `file-root:<path>`, `file-root:system`, and
//! `default`/`ROOTCA` in file-mounted mode (Istio `security/pkg/nodeagent/cache/secretcache.go` `generateFileSecret`).
//!
//! Watching: Kubernetes' atomic writer never modifies the files we are given — it writes a new
//! `..<timestamp>` directory, renames a `..data_tmp` symlink over `..data`, then deletes the
//! old directory, and the visible files are symlinks through `..data`. A watch on the file (or
//! its resolved target) is lost at the first swap (istio#38366, kubernetes#111947), and event
//! names are `..data`, never the file. So we watch the **directories** (the one holding the
//! name we were given, and the one holding its current target) and treat any event in them as
//! "re-read every resource that lives there", debounced by `FILE_DEBOUNCE_DURATION`. Content is
//! compared, so metadata-only events never push, and a real change is never missed because we
//! do not try to match event names (istio#59912). If inotify is unavailable we poll once a
//! second instead. Only content events count (create, write, rename, remove — the mask of
//! Istio's fsnotify watcher, `pkg/filewatcher`): our own reads raise open/access events, and
//! reacting to those re-read every file ten times a second, forever.
//!
//! Reading: the files are chosen by whoever writes a DestinationRule, so each load runs on
//! the blocking pool with a timeout and reads only regular files of at most
//! [`MAX_FILE_BYTES`] ([`crate::fsio`]: a FIFO or `/proc/self/fd/1` would block forever,
//! `/dev/zero` never ends). A stuck or failing file affects only its own resource.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecursiveMode, Watcher as _};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::metrics::Metrics;
use super::store::{
    FILE_CERT_PREFIX, FILE_ROOT_PREFIX, FileRequest, SecretData, SecretState, SecretStore,
};
use crate::control_plane::SYSTEM_ROOT_PATHS;

/// Istio's CRL file, attached to roots when present.
pub const CRL_PATH: &str = "/var/run/secrets/istio/crl/ca-crl.pem";

/// Largest certificate, key or bundle file read (an OS bundle is ~200 KiB; Istio has no cap,
/// so one huge file costs it its memory on every reload).
pub const MAX_FILE_BYTES: u64 = 4 * 1024 * 1024;

/// How long one load may take before its resource is reported failed (the read itself may
/// stay stuck on the blocking pool; nothing waits for it).
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum FileSecretError {
    #[error(
        "invalid file resource name {0:?} (expected file-cert:<cert>~<key> or file-root:<path>)"
    )]
    Name(String),
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{path}: no valid PEM certificate")]
    NoCertificate { path: String },
    #[error("{path}: no valid PEM private key")]
    NoKey { path: String },
    #[error("certificate {cert} and key {key} do not match: {reason}")]
    Mismatch {
        cert: String,
        key: String,
        reason: String,
    },
    #[error("no OS trust bundle found (looked in {0})")]
    NoSystemRoots(String),
    #[error(transparent)]
    File(#[from] crate::fsio::ReadError),
}

/// What a file resource reads.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    Cert {
        cert: PathBuf,
        key: PathBuf,
    },
    Root {
        path: PathBuf,
    },
    /// `file-root:system`: the first OS bundle found, looked up at each load.
    SystemRoot,
}

fn parse_name(name: &str, cwd: &Path) -> Result<Source, FileSecretError> {
    let bad = || FileSecretError::Name(name.to_owned());
    if let Some(rest) = name.strip_prefix(FILE_CERT_PREFIX) {
        let (c, k) = rest.split_once('~').ok_or_else(bad)?;
        if c.is_empty() || k.is_empty() {
            return Err(bad());
        }
        return Ok(Source::Cert {
            cert: crate::fsio::under(cwd, c),
            key: crate::fsio::under(cwd, k),
        });
    }
    let rest = name.strip_prefix(FILE_ROOT_PREFIX).ok_or_else(bad)?;
    if rest == "system" {
        return Ok(Source::SystemRoot);
    }
    if rest.is_empty() {
        return Err(bad());
    }
    Ok(Source::Root {
        path: crate::fsio::under(cwd, rest),
    })
}

#[allow(
    clippy::disallowed_methods,
    reason = "called from load/source_dirs on the blocking pool"
)]
fn system_roots() -> Result<PathBuf, FileSecretError> {
    SYSTEM_ROOT_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| FileSecretError::NoSystemRoots(SYSTEM_ROOT_PATHS.join(", ")))
}

/// Blocking: loads run on the blocking pool ([`load_off_reactor`]).
fn read(path: &Path) -> Result<Vec<u8>, FileSecretError> {
    Ok(crate::fsio::read_bounded(path, MAX_FILE_BYTES)?)
}

/// Loads a cert/key pair, checking that the key belongs to the leaf.
pub fn load_cert_pair(cert: &Path, key: &Path) -> Result<SecretData, FileSecretError> {
    parse_cert_pair(cert, key, &read(cert)?, &read(key)?)
}

fn parse_cert_pair(
    cert: &Path,
    key: &Path,
    chain_pem: &[u8],
    key_pem: &[u8],
) -> Result<SecretData, FileSecretError> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain_pem)
        .collect::<Result<_, _>>()
        .map_err(|_| FileSecretError::NoCertificate {
            path: cert.display().to_string(),
        })?;
    if chain.is_empty() {
        return Err(FileSecretError::NoCertificate {
            path: cert.display().to_string(),
        });
    }
    let key_der = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| FileSecretError::NoKey {
        path: key.display().to_string(),
    })?;
    let provider = rustls::crypto::aws_lc_rs::default_provider();
    let mismatch = |reason: String| FileSecretError::Mismatch {
        cert: cert.display().to_string(),
        key: key.display().to_string(),
        reason,
    };
    let signing = provider
        .key_provider
        .load_private_key(key_der)
        .map_err(|e| mismatch(e.to_string()))?;
    rustls::sign::CertifiedKey::new(chain, signing)
        .keys_match()
        .map_err(|e| mismatch(e.to_string()))?;
    Ok(SecretData::Cert {
        chain: String::from_utf8_lossy(chain_pem).into_owned(),
        key: String::from_utf8_lossy(key_pem).into_owned(),
    })
}

/// Loads a root bundle: invalid certificates are skipped; none valid is an error.
pub fn load_root(path: &Path, crl: Option<PathBuf>) -> Result<SecretData, FileSecretError> {
    parse_root(path, &read(path)?, crl)
}

fn parse_root(
    path: &Path,
    pem: &[u8],
    crl: Option<PathBuf>,
) -> Result<SecretData, FileSecretError> {
    let mut out = String::new();
    for der in CertificateDer::pem_slice_iter(pem).flatten() {
        if x509_parser::parse_x509_certificate(der.as_ref()).is_ok() {
            out.push_str(&super::keys::pem_encode("CERTIFICATE", der.as_ref()));
        }
    }
    if out.is_empty() {
        return Err(FileSecretError::NoCertificate {
            path: path.display().to_string(),
        });
    }
    Ok(SecretData::Root { pem: out, crl })
}

/// A digest of the bytes a resource was last loaded from.
type Digest = [u8; 32];

fn digest(parts: &[&[u8]]) -> Digest {
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    for p in parts {
        // Length-prefixed, so moving bytes between files changes the digest.
        ctx.update(&(p.len() as u64).to_le_bytes());
        ctx.update(p);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// What a load found.
#[derive(Debug)]
enum Found {
    /// The same bytes as last time: nothing to parse or publish.
    Unchanged,
    Loaded(SecretData, Digest),
}

/// Reads the source's files and parses them unless they are byte-for-byte what was loaded
/// last time (`prev`): most reloads are caused by events for *other* files of a directory, or
/// by rewrites with the same content, and parsing and key checks are the expensive part.
#[allow(
    clippy::disallowed_methods,
    reason = "runs on the blocking pool (FileSecrets::load_one)"
)]
fn load(
    source: &Source,
    crl: &Option<PathBuf>,
    prev: Option<Digest>,
) -> Result<Found, FileSecretError> {
    let crl = crl.clone().filter(|p| p.is_file());
    let crl_tag = crl
        .as_ref()
        .map(|p| p.as_os_str().as_encoded_bytes().to_vec());
    let crl_tag = crl_tag.as_deref().unwrap_or_default();
    match source {
        Source::Cert { cert, key } => {
            let (c, k) = (read(cert)?, read(key)?);
            let d = digest(&[&c, &k]);
            if prev == Some(d) {
                return Ok(Found::Unchanged);
            }
            Ok(Found::Loaded(parse_cert_pair(cert, key, &c, &k)?, d))
        }
        Source::Root { path } => {
            let p = read(path)?;
            let d = digest(&[&p, crl_tag]);
            if prev == Some(d) {
                return Ok(Found::Unchanged);
            }
            Ok(Found::Loaded(parse_root(path, &p, crl)?, d))
        }
        Source::SystemRoot => {
            let path = system_roots()?;
            let p = read(&path)?;
            let d = digest(&[path.as_os_str().as_encoded_bytes(), &p, crl_tag]);
            if prev == Some(d) {
                return Ok(Found::Unchanged);
            }
            Ok(Found::Loaded(parse_root(&path, &p, crl)?, d))
        }
    }
}

/// The files a source reads, as named (system roots: the bundle found now, if any).
fn source_files(source: &Source) -> Vec<PathBuf> {
    match source {
        Source::Cert { cert, key } => vec![cert.clone(), key.clone()],
        Source::Root { path } => vec![path.clone()],
        Source::SystemRoot => system_roots().into_iter().collect(),
    }
}

/// The directories to watch for a source: each file's own, and its resolved target's
/// (kubelet's `..data` indirection). Blocking (canonicalize, stat).
#[allow(
    clippy::disallowed_methods,
    reason = "runs on the blocking pool with load"
)]
fn source_dirs(source: &Source) -> HashSet<PathBuf> {
    let mut dirs = HashSet::new();
    for f in source_files(source) {
        if let Some(p) = f.parent() {
            dirs.insert(p.to_path_buf());
        }
        if let Some(p) = std::fs::canonicalize(&f)
            .ok()
            .and_then(|c| c.parent().map(Path::to_path_buf))
        {
            dirs.insert(p);
        }
    }
    dirs.retain(|d| d.is_dir());
    dirs
}

/// The files behind a `file-*` resource name and the directories watched for it, for
/// `/debug/certz`. Blocking (canonicalize, stat): call it on the blocking pool.
pub fn describe(name: &str, cwd: &Path) -> Option<(Vec<PathBuf>, Vec<PathBuf>)> {
    let source = parse_name(name, cwd).ok()?;
    let mut dirs: Vec<PathBuf> = source_dirs(&source).into_iter().collect();
    dirs.sort();
    Some((source_files(&source), dirs))
}

/// Only content changes trigger a reload (Istio's fsnotify mask: create, write, rename,
/// remove); open/read/close-without-write and metadata events are our own reads or noise.
fn is_content_event(kind: &EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, ModifyKind};
    match kind {
        EventKind::Create(_) | EventKind::Remove(_) => true,
        EventKind::Modify(ModifyKind::Metadata(_)) => false,
        EventKind::Modify(_) => true,
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) | EventKind::Any | EventKind::Other => false,
    }
}

/// One finished load: the resource name, what it read, and the directories to watch.
type Loaded = (String, Result<Found, FileSecretError>, HashSet<PathBuf>);

/// Loads running at once. Loading is CPU work too (PEM, X.509, key match); with one at a time
/// a directory of 2,000 resources re-verifies in about a second, and the other core stays
/// free for the runtime thread (tests/runtime_policy.rs measures the status port meanwhile).
const CONCURRENT_LOADS: usize = 1;

/// Loads `source` on the blocking pool, giving up after [`LOAD_TIMEOUT`].
async fn load_off_reactor(
    name: String,
    source: Source,
    crl: Option<PathBuf>,
    prev: Option<Digest>,
    limit: Arc<tokio::sync::Semaphore>,
) -> Loaded {
    // The permit is held while the load runs, or until it times out (a stuck read then holds
    // a blocking thread, not the others' turn).
    let _permit = limit.acquire_owned().await;
    let path = source_files(&source)
        .first()
        .map_or_else(|| name.clone(), |p| p.display().to_string());
    let job =
        tokio::task::spawn_blocking(move || (load(&source, &crl, prev), source_dirs(&source)));
    match tokio::time::timeout(LOAD_TIMEOUT, job).await {
        Ok(Ok((result, dirs))) => (name, result, dirs),
        Ok(Err(e)) => (
            name,
            Err(FileSecretError::Read {
                path,
                reason: format!("load task failed: {e}"),
            }),
            HashSet::new(),
        ),
        Err(_) => (
            name,
            Err(FileSecretError::File(crate::fsio::ReadError::Timeout {
                path,
                timeout: LOAD_TIMEOUT,
            })),
            HashSet::new(),
        ),
    }
}

struct Resource {
    source: Source,
    dirs: HashSet<PathBuf>,
    /// What the published secret was loaded from.
    digest: Option<Digest>,
    /// First failure of the current failing streak (load retried until `load_wait` passes).
    failing_since: Option<Instant>,
    loaded_once: bool,
}

/// The file-secret task. Owns the watcher and every file resource.
pub struct FileSecrets {
    pub store: Arc<SecretStore>,
    pub requests: mpsc::UnboundedReceiver<FileRequest>,
    pub cwd: PathBuf,
    pub debounce: Duration,
    /// How long a resource may fail to load before its streams get the error (Istio: 10 s,
    /// since cert and key are often written one after the other).
    pub load_wait: Duration,
    pub crl: Option<PathBuf>,
    pub metrics: Metrics,
}

impl FileSecrets {
    pub async fn run(mut self, cancel: CancellationToken) {
        let (ev_tx, mut events) = mpsc::unbounded_channel::<PathBuf>();
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if let Ok(ev) = res
                && is_content_event(&ev.kind)
            {
                for p in ev.paths {
                    let _ = ev_tx.send(p);
                }
            }
        });
        let mut watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                self.metrics.file_watcher_failures.inc();
                tracing::warn!(error = %e, "file watcher unavailable; polling certificate files every second");
                None
            }
        };
        let mut resources: HashMap<String, Resource> = HashMap::new();
        let mut watched: HashSet<PathBuf> = HashSet::new();
        let mut dirty: HashSet<String> = HashSet::new();
        let mut reload_at: Option<Instant> = None;
        let poll = Duration::from_secs(1);
        let mut next_poll = Instant::now() + poll;
        // Loads in flight (at most one per resource) and those asked for again meanwhile.
        let mut loads: JoinSet<Loaded> = JoinSet::new();
        let mut in_flight: HashSet<String> = HashSet::new();
        let mut again: HashSet<String> = HashSet::new();
        let limit = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_LOADS));

        loop {
            // Event arms only mark work; loading starts at one debounced deadline, so a burst
            // of kubelet events (create dir, rename symlink, delete old dir) costs one read.
            // Loads run on the blocking pool and report back in their own arm, so a slow file
            // never holds up requests, events or other resources.
            tokio::select! {
                _ = cancel.cancelled() => return,
                Some(req) = self.requests.recv() => {
                    let name = match req {
                        FileRequest::Forget(name) => {
                            Self::forget(&name, &mut resources, &mut dirty, &mut again, watcher.as_mut(), &mut watched);
                            self.metrics.file_secret_resources.set(resources.len() as f64);
                            continue;
                        }
                        FileRequest::Load(name) => name,
                    };
                    match parse_name(&name, &self.cwd) {
                        Ok(source) => {
                            resources.insert(name.clone(), Resource { source, dirs: HashSet::new(), digest: None, failing_since: None, loaded_once: false });
                            self.metrics.file_secret_resources.set(resources.len() as f64);
                            self.start_load(&name, &resources, &limit, &mut loads, &mut in_flight, &mut again);
                        }
                        Err(e) => {
                            self.metrics.file_secret_failures.inc();
                            self.store.set(&name, SecretState::Failed(e.to_string().into()));
                        }
                    }
                }
                Some(done) = loads.join_next(), if !loads.is_empty() => {
                    let Ok((name, result, dirs)) = done else { continue };
                    in_flight.remove(&name);
                    self.loaded(&name, result, dirs, &mut resources, watcher.as_mut(), &mut watched);
                    if again.remove(&name) || resources.get(&name).is_some_and(|r| r.failing_since.is_some()) {
                        dirty.insert(name);
                        reload_at.get_or_insert(Instant::now() + self.debounce);
                    }
                }
                Some(path) = events.recv() => {
                    let parent = path.parent().map(Path::to_path_buf);
                    for (name, r) in &resources {
                        if r.dirs.contains(&path) || parent.as_ref().is_some_and(|p| r.dirs.contains(p)) {
                            dirty.insert(name.clone());
                        }
                    }
                    // The window opens at the first event and is not extended by later ones:
                    // a file rewritten more often than the debounce would otherwise never be
                    // reloaded.
                    if !dirty.is_empty() {
                        reload_at.get_or_insert(Instant::now() + self.debounce);
                    }
                }
                _ = sleep_until(reload_at.unwrap_or_else(far_future)), if reload_at.is_some() => {
                    reload_at = None;
                    for name in std::mem::take(&mut dirty) {
                        self.start_load(&name, &resources, &limit, &mut loads, &mut in_flight, &mut again);
                    }
                }
                _ = sleep_until(next_poll), if watcher.is_none() => {
                    next_poll = Instant::now() + poll;
                    dirty.extend(resources.keys().cloned());
                    reload_at = Some(Instant::now());
                }
            }
        }
    }

    /// Nobody subscribes to `name` any more: forget it, and stop watching directories no other
    /// resource lives in. A load in flight finds it gone.
    fn forget(
        name: &str,
        resources: &mut HashMap<String, Resource>,
        dirty: &mut HashSet<String>,
        again: &mut HashSet<String>,
        mut watcher: Option<&mut notify::RecommendedWatcher>,
        watched: &mut HashSet<PathBuf>,
    ) {
        let Some(r) = resources.remove(name) else {
            return;
        };
        dirty.remove(name);
        again.remove(name);
        for d in r.dirs {
            if resources.values().any(|o| o.dirs.contains(&d)) || !watched.remove(&d) {
                continue;
            }
            if let Some(w) = watcher.as_deref_mut() {
                let _ = w.unwatch(&d);
            }
        }
        tracing::debug!(resource = name, "file secret forgotten (no subscribers)");
    }

    /// Starts loading `name` unless a load of it is already running (then it runs again after).
    fn start_load(
        &self,
        name: &str,
        resources: &HashMap<String, Resource>,
        limit: &Arc<tokio::sync::Semaphore>,
        loads: &mut JoinSet<Loaded>,
        in_flight: &mut HashSet<String>,
        again: &mut HashSet<String>,
    ) {
        let Some(r) = resources.get(name) else {
            return;
        };
        if !in_flight.insert(name.to_owned()) {
            again.insert(name.to_owned());
            return;
        }
        self.metrics.file_secret_loads.inc();
        let span = tracing::debug_span!("file_secret_load", resource = name);
        loads.spawn(tracing::Instrument::instrument(
            load_off_reactor(
                name.to_owned(),
                r.source.clone(),
                self.crl.clone(),
                r.digest,
                limit.clone(),
            ),
            span,
        ));
    }

    /// Applies a finished load: publish the secret or track the failure streak, and watch
    /// the directories it lives in.
    fn loaded(
        &self,
        name: &str,
        result: Result<Found, FileSecretError>,
        dirs: HashSet<PathBuf>,
        resources: &mut HashMap<String, Resource>,
        watcher: Option<&mut notify::RecommendedWatcher>,
        watched: &mut HashSet<PathBuf>,
    ) {
        let Some(r) = resources.get_mut(name) else {
            return;
        };
        match result {
            Ok(found) => {
                if r.failing_since.take().is_some() && r.loaded_once {
                    tracing::info!(resource = name, "file secret readable again");
                }
                r.loaded_once = true;
                if let Found::Loaded(data, d) = found {
                    r.digest = Some(d);
                    self.store.set(name, SecretState::Ready(Arc::new(data)));
                }
            }
            Err(e) => {
                let since = *r.failing_since.get_or_insert_with(Instant::now);
                // Errors that no rewrite of the same path fixes soon are reported at once.
                let permanent = matches!(&e, FileSecretError::File(f) if f.is_permanent());
                if permanent || since.elapsed() >= self.load_wait {
                    // Give up on this streak: report once, and wait for the next file event.
                    r.failing_since = None;
                    self.metrics.file_secret_failures.inc();
                    tracing::warn!(resource = name, error = %e, "cannot load file secret");
                    if !r.loaded_once {
                        self.store
                            .set(name, SecretState::Failed(e.to_string().into()));
                    }
                }
            }
        }
        r.dirs.extend(dirs.iter().cloned());
        let Some(w) = watcher else { return };
        for d in dirs {
            if watched.contains(&d) {
                continue;
            }
            // inotify_add_watch: a syscall on a directory that was just stat'ed; it does not
            // read file contents.
            match w.watch(&d, RecursiveMode::NonRecursive) {
                Ok(()) => {
                    watched.insert(d);
                }
                Err(e) => {
                    self.metrics.file_watcher_failures.inc();
                    tracing::warn!(dir = %d.display(), error = %e, "cannot watch certificate directory");
                }
            }
        }
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86400 * 365)
}

#[cfg(test)]
#[allow(
    clippy::disallowed_methods,
    reason = "test code, not on the agent's runtime"
)]
mod tests {
    use super::*;

    fn pair() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["a".into()]).unwrap();
        (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
    }

    #[test]
    fn mismatch_and_unreadable_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let (c1, k1) = pair();
        let (_, k2) = pair();
        let w = |n: &str, s: &str| {
            let p = dir.path().join(n);
            std::fs::write(&p, s).unwrap();
            p
        };
        let (c, k, k_other) = (w("c.pem", &c1), w("k.pem", &k1), w("k2.pem", &k2));
        assert!(load_cert_pair(&c, &k).is_ok());
        let e = load_cert_pair(&c, &k_other).unwrap_err();
        assert!(matches!(e, FileSecretError::Mismatch { .. }), "{e}");
        assert!(e.to_string().contains("do not match"), "{e}");
        let e = load_cert_pair(&dir.path().join("missing.pem"), &k).unwrap_err();
        assert!(
            e.to_string().contains("cannot read") && e.to_string().contains("missing.pem"),
            "{e}"
        );
    }

    #[test]
    fn root_bundle_skips_invalid_certs() {
        let dir = tempfile::tempdir().unwrap();
        let (c1, _) = pair();
        let junk = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let p = dir.path().join("roots.pem");
        std::fs::write(&p, format!("{junk}{c1}")).unwrap();
        let SecretData::Root { pem, .. } = load_root(&p, None).unwrap() else {
            panic!()
        };
        assert_eq!(pem.matches("BEGIN CERTIFICATE").count(), 1);
        std::fs::write(&p, junk).unwrap();
        let e = load_root(&p, None).unwrap_err();
        assert!(e.to_string().contains("roots.pem"), "{e}");
    }

    #[test]
    fn only_content_events_trigger_reloads() {
        use notify::event::{
            AccessKind, AccessMode, CreateKind, DataChange, MetadataKind, ModifyKind, RemoveKind,
            RenameMode,
        };
        for k in [
            EventKind::Create(CreateKind::File),
            EventKind::Modify(ModifyKind::Data(DataChange::Any)),
            EventKind::Modify(ModifyKind::Name(RenameMode::To)),
            EventKind::Remove(RemoveKind::File),
            EventKind::Access(AccessKind::Close(AccessMode::Write)),
        ] {
            assert!(is_content_event(&k), "{k:?}");
        }
        for k in [
            EventKind::Access(AccessKind::Open(AccessMode::Any)),
            EventKind::Access(AccessKind::Close(AccessMode::Read)),
            EventKind::Access(AccessKind::Read),
            EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime)),
        ] {
            assert!(!is_content_event(&k), "{k:?}");
        }
    }

    #[test]
    fn names() {
        let cwd = Path::new("/w");
        assert_eq!(
            parse_name("file-cert:a.pem~b.pem", cwd).unwrap(),
            Source::Cert {
                cert: "/w/a.pem".into(),
                key: "/w/b.pem".into()
            }
        );
        assert_eq!(
            parse_name("file-root:/etc/r.pem", cwd).unwrap(),
            Source::Root {
                path: "/etc/r.pem".into()
            }
        );
        assert!(parse_name("file-cert:nokey", cwd).is_err());
    }
}
