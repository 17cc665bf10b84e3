//! The shared secret table between producers (the CA-backed secret manager, the file watcher)
//! and consumers (SDS streams, OUTPUT_CERTS).
//!
//! Each resource has a state and a generation that increases on every change; one `watch`
//! channel carries "something changed". A stream keeps the generation it last sent per name,
//! so a push goes only to streams watching a changed name and only with that name — no
//! per-stream channels to leak, and a slow stream simply sees the latest state.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{mpsc, watch};

/// Resource names with a fixed meaning (Istio `pkg/security/security.go`: `default`, `ROOTCA`, `file-cert:`, `file-root:`).
pub const WORKLOAD: &str = "default";
pub const ROOT: &str = "ROOTCA";
pub const FILE_CERT_PREFIX: &str = "file-cert:";
pub const FILE_ROOT_PREFIX: &str = "file-root:";

/// Secret material. `Debug` never shows the private key.
#[derive(Clone, PartialEq, Eq)]
pub enum SecretData {
    /// A certificate chain (PEM, leaf first) and its private key (PEM).
    Cert { chain: String, key: String },
    /// A trust bundle (PEM) and an optional CRL file attached to it.
    Root { pem: String, crl: Option<PathBuf> },
}

impl fmt::Debug for SecretData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cert { chain, .. } => f
                .debug_struct("Cert")
                .field("chain_len", &chain.len())
                .finish_non_exhaustive(),
            Self::Root { pem, crl } => f
                .debug_struct("Root")
                .field("pem_len", &pem.len())
                .field("crl", crl)
                .finish(),
        }
    }
}

/// Where a resource stands.
#[derive(Debug, Clone)]
pub enum SecretState {
    /// Not available yet: requests are held and answered when it arrives.
    Pending,
    Ready(Arc<SecretData>),
    /// Cannot be produced (e.g. unreadable file); streams asking for it end with this error.
    Failed(Arc<str>),
}

#[derive(Debug)]
struct Entry {
    state: SecretState,
    generation: u64,
    /// Live [`Subscription`]s. A file resource nobody subscribes to any more is forgotten:
    /// its data dropped and its files no longer watched (istiod can name any number of
    /// `file-*` resources over a pod's life).
    subscribers: usize,
}

/// What the file watcher is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileRequest {
    /// Load and watch this `file-*` resource.
    Load(String),
    /// Stop watching it: no stream subscribes to it any more.
    Forget(String),
}

/// A stream's interest in one resource; dropping it unsubscribes.
#[derive(Debug)]
pub struct Subscription {
    store: Arc<SecretStore>,
    key: String,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.store.unsubscribe(&self.key);
    }
}

/// How names map to producers in the current mode.
#[derive(Debug, Clone, Default)]
pub struct Aliases {
    /// `default` (and any unknown name) is served from this `file-cert:` resource.
    pub workload: Option<String>,
    /// `ROOTCA` is served from this `file-root:` resource.
    pub root: Option<String>,
}

pub struct SecretStore {
    entries: Mutex<HashMap<String, Entry>>,
    changed: watch::Sender<u64>,
    aliases: Aliases,
    /// File resources are loaded and watched on first request, forgotten after the last
    /// subscription ends.
    file_requests: mpsc::UnboundedSender<FileRequest>,
}

impl fmt::Debug for SecretStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretStore")
            .field("aliases", &self.aliases)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SecretStore {
    /// The store and the receiver of file-resource requests (owned by the file watcher).
    pub fn new(aliases: Aliases) -> (Arc<SecretStore>, mpsc::UnboundedReceiver<FileRequest>) {
        let (file_requests, rx) = mpsc::unbounded_channel();
        let (changed, _) = watch::channel(0);
        let store = SecretStore {
            entries: Mutex::default(),
            changed,
            aliases,
            file_requests,
        };
        (Arc::new(store), rx)
    }

    /// The resource that actually backs `name`.
    pub fn resolve<'a>(&'a self, name: &'a str) -> &'a str {
        if name.starts_with(FILE_CERT_PREFIX) || name.starts_with(FILE_ROOT_PREFIX) {
            name
        } else if name == ROOT {
            self.aliases.root.as_deref().unwrap_or(ROOT)
        } else {
            // Istio serves any other name as the workload certificate.
            self.aliases.workload.as_deref().unwrap_or(WORKLOAD)
        }
    }

    fn is_file(key: &str) -> bool {
        key.starts_with(FILE_CERT_PREFIX) || key.starts_with(FILE_ROOT_PREFIX)
    }

    /// Makes sure something produces `name` (starting a file load if needed), for as long as
    /// the returned subscription lives.
    pub fn subscribe(self: &Arc<Self>, name: &str) -> Subscription {
        let key = self.resolve(name).to_owned();
        let mut entries = lock(&self.entries);
        let created = !entries.contains_key(&key);
        let entry = entries.entry(key.clone()).or_insert_with(|| Entry {
            state: SecretState::Pending,
            generation: 0,
            subscribers: 0,
        });
        entry.subscribers += 1;
        drop(entries);
        if created && Self::is_file(&key) {
            let _ = self.file_requests.send(FileRequest::Load(key.clone()));
        }
        Subscription {
            store: self.clone(),
            key,
        }
    }

    fn unsubscribe(&self, key: &str) {
        let mut entries = lock(&self.entries);
        let Some(entry) = entries.get_mut(key) else {
            return;
        };
        entry.subscribers = entry.subscribers.saturating_sub(1);
        // Mode aliases (file-mounted `default`/`ROOTCA`) are kept: the agent itself relies on
        // them, not only its streams.
        let alias = self.aliases.workload.as_deref() == Some(key)
            || self.aliases.root.as_deref() == Some(key);
        if entry.subscribers == 0 && Self::is_file(key) && !alias {
            entries.remove(key);
            drop(entries);
            let _ = self.file_requests.send(FileRequest::Forget(key.to_owned()));
        }
    }

    /// Current state and generation of the resource backing `name`.
    pub fn get(&self, name: &str) -> (SecretState, u64) {
        let key = self.resolve(name);
        lock(&self.entries)
            .get(key)
            .map_or((SecretState::Pending, 0), |e| {
                (e.state.clone(), e.generation)
            })
    }

    /// Publishes a new state for the resource `key` (not an alias). Unchanged data is not a
    /// change: no push for a metadata-only file event or an identical root.
    /// A `file-*` resource that is no longer subscribed is not re-created by a late load.
    pub fn set(&self, key: &str, state: SecretState) {
        let mut entries = lock(&self.entries);
        if Self::is_file(key) && !entries.contains_key(key) {
            return;
        }
        let entry = entries.entry(key.to_owned()).or_insert(Entry {
            state: SecretState::Pending,
            generation: 0,
            subscribers: 0,
        });
        let same = match (&entry.state, &state) {
            (SecretState::Ready(a), SecretState::Ready(b)) => a == b,
            (SecretState::Failed(a), SecretState::Failed(b)) => a == b,
            (SecretState::Pending, SecretState::Pending) => true,
            _ => false,
        };
        if same {
            return;
        }
        entry.state = state;
        let generation = self.changed.borrow().wrapping_add(1);
        entry.generation = generation;
        drop(entries);
        self.changed.send_replace(generation);
    }

    /// Fires after every change.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Every resource with its state and live subscriptions, sorted by name (for
    /// `/debug/certz`; the `Arc`s are cloned, no secret is copied).
    pub fn snapshot(&self) -> Vec<(String, SecretState, usize)> {
        let mut v: Vec<_> = lock(&self.entries)
            .iter()
            .map(|(k, e)| (k.clone(), e.state.clone(), e.subscribers))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The aliases of this mode (`default`/`ROOTCA` served from files).
    pub fn aliases(&self) -> &Aliases {
        &self.aliases
    }

    /// The ready data of `name`, if any.
    pub fn ready(&self, name: &str) -> Option<Arc<SecretData>> {
        match self.get(name).0 {
            SecretState::Ready(d) => Some(d),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_and_aliases() {
        let (s, mut files) = SecretStore::new(Aliases {
            workload: Some("file-cert:c~k".into()),
            root: None,
        });
        assert_eq!(s.resolve("anything"), "file-cert:c~k");
        assert_eq!(s.resolve(ROOT), ROOT);
        let sub = s.subscribe("default");
        assert_eq!(
            files.try_recv().unwrap(),
            FileRequest::Load("file-cert:c~k".into())
        );
        let other = s.subscribe("other");
        assert!(files.try_recv().is_err(), "already requested");
        drop((sub, other));
        assert!(files.try_recv().is_err(), "aliases are never forgotten");
        let d = Arc::new(SecretData::Root {
            pem: "x".into(),
            crl: None,
        });
        s.set(ROOT, SecretState::Ready(d.clone()));
        let g1 = s.get(ROOT).1;
        s.set(ROOT, SecretState::Ready(d));
        assert_eq!(s.get(ROOT).1, g1, "identical data is not a change");
        s.set(
            ROOT,
            SecretState::Ready(Arc::new(SecretData::Root {
                pem: "y".into(),
                crl: None,
            })),
        );
        assert!(s.get(ROOT).1 > g1);
        let key = SecretData::Cert {
            chain: "c".into(),
            key: "SECRET".into(),
        };
        assert!(!format!("{key:?}").contains("SECRET"));
    }

    #[test]
    fn file_resources_are_forgotten_after_the_last_subscription() {
        let (s, mut files) = SecretStore::new(Aliases::default());
        let a = s.subscribe("file-root:r.pem");
        let b = s.subscribe("file-root:r.pem");
        assert_eq!(
            files.try_recv().unwrap(),
            FileRequest::Load("file-root:r.pem".into())
        );
        let data = Arc::new(SecretData::Root {
            pem: "x".into(),
            crl: None,
        });
        s.set("file-root:r.pem", SecretState::Ready(data.clone()));
        drop(a);
        assert!(
            s.ready("file-root:r.pem").is_some(),
            "still subscribed once"
        );
        drop(b);
        assert_eq!(
            files.try_recv().unwrap(),
            FileRequest::Forget("file-root:r.pem".into())
        );
        assert!(s.ready("file-root:r.pem").is_none());
        // A load finishing after the forget does not bring it back.
        s.set("file-root:r.pem", SecretState::Ready(data));
        assert!(s.ready("file-root:r.pem").is_none());
        // Non-file resources are never forgotten.
        drop(s.subscribe(ROOT));
        assert!(files.try_recv().is_err());
    }
}
