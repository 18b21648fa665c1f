//! The set of loaded backends by name, and hot reload: the backends directory is polled; a
//! new or changed `NAME.wasm` is loaded and checked off to the side and swapped in only when
//! good. Calls hold an `Arc<Backend>`, so calls in flight finish on the version they started
//! with. A broken file is logged once and the previous version keeps serving. A name whose
//! file is being loaded, or went away less than [`REPLACING`] ago, is *expected*: callers
//! answer "not loaded, retry" for it rather than "no such backend" (an operator replacing a
//! file by remove + copy leaves a moment with no file at all).
//!
//! The configuration file is polled the same way, first in each scan: a changed file that
//! reads and validates is put in force and every backend is loaded again under it (grants and
//! limits are linked at load); a file that does not, or that would refuse a backend serving
//! now (an import it no longer grants), is logged once and the configuration in force keeps
//! serving. Revoking a grant therefore takes removing the backend that uses it first.
use crate::backend::Backend;
use crate::config::HostConfig;
use crate::metadata::{MetadataError, VolumeRecord};
use crate::runtime::{LoadError, Runtime};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};
use tokio::sync::Mutex;

mod sources;
pub use sources::SourceStatus;

/// How long a backend whose file went away stays expected back.
pub const REPLACING: Duration = Duration::from_secs(60);

/// What a file looked like when we last read it; unchanged files are not re-read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
}

/// What one scan did.
#[derive(Debug, Default)]
pub struct ScanReport {
    pub loaded: Vec<String>,
    pub rejected: Vec<(String, String)>,
    pub removed: Vec<String>,
    /// what happened to a changed configuration file; `None` when it did not change
    pub config: Option<ConfigChange>,
}

/// A changed configuration file, as the scan that saw it dealt with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigChange {
    /// in force; every backend was loaded again under it
    Applied,
    /// refused, with why; the configuration in force keeps serving
    Rejected(String),
}

pub struct Registry {
    runtime: Arc<Runtime>,
    dir: Option<PathBuf>,
    /// the configuration file re-read on change (`serve --config`)
    config_file: Option<PathBuf>,
    backends: RwLock<BTreeMap<String, Arc<Backend>>>,
    /// per file: the stamp last seen, so each change is looked at exactly once
    seen: Mutex<HashMap<PathBuf, FileStamp>>,
    scanned: std::sync::atomic::AtomicBool,
    /// Names whose file is being loaded (a new name is not served until it is checked).
    loading: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Names whose file went away, and when.
    departed: std::sync::Mutex<HashMap<String, std::time::Instant>>,
    /// Backends named by an OCI `source` (`registry/sources.rs`).
    sources: sources::Sources,
}

impl Registry {
    /// A registry of the backends in `dir`, under the runtime's configuration, re-read from
    /// `config_file` when that changes (the runtime's must be what the file held at start).
    pub fn new(runtime: Arc<Runtime>, dir: Option<PathBuf>, config_file: Option<PathBuf>) -> Arc<Self> {
        let mut seen = HashMap::new();
        // The configuration the runtime started with is this file's content as it is now.
        if let Some(stamp) = config_file.as_deref().and_then(stamp_of) {
            seen.extend(config_file.clone().map(|path| (path, stamp)));
        }
        Arc::new(Self {
            runtime,
            dir,
            config_file,
            backends: RwLock::new(BTreeMap::new()),
            seen: Mutex::new(seen),
            scanned: std::sync::atomic::AtomicBool::new(false),
            loading: Default::default(),
            departed: Default::default(),
            sources: Default::default(),
        })
    }

    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    pub fn get(&self, name: &str) -> Option<Arc<Backend>> {
        self.backends.read().ok()?.get(name).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Backend>> {
        self.backends.read().map(|b| b.values().cloned().collect()).unwrap_or_default()
    }

    pub fn names(&self) -> Vec<String> {
        self.backends.read().map(|b| b.keys().cloned().collect()).unwrap_or_default()
    }

    /// Whether a backend that is not loaded is expected to be soon: its file is being loaded,
    /// or went away less than [`REPLACING`] ago.
    pub fn expected(&self, name: &str) -> bool {
        let loading = self.loading.lock().map(|l| l.contains(name)).unwrap_or(false);
        let departed = self.departed.lock().ok().and_then(|d| d.get(name).copied());
        loading || departed.is_some_and(|at| at.elapsed() < REPLACING)
    }

    /// Ready once the first scan finished and at least one backend serves.
    pub fn is_ready(&self) -> bool {
        self.scanned.load(std::sync::atomic::Ordering::Acquire) && !self.names().is_empty()
    }

    /// Load bytes as backend `name` and swap it in (tests, embedded backends).
    pub async fn install(&self, name: &str, wasm: &[u8], path: Option<PathBuf>) -> Result<Arc<Backend>, LoadError> {
        Ok(self.insert(self.runtime.load(name, wasm, path).await?))
    }

    /// Swap in an already-built backend (native backends for benchmarks and tests).
    pub fn insert(&self, backend: Arc<Backend>) -> Arc<Backend> {
        if let Ok(mut d) = self.departed.lock() {
            d.remove(&backend.name);
        }
        if let Ok(mut map) = self.backends.write() {
            map.insert(backend.name.clone(), backend.clone());
        }
        backend
    }

    fn remove(&self, name: &str) -> bool {
        self.backends.write().map(|mut m| m.remove(name).is_some()).unwrap_or(false)
    }

    /// Look at the configuration file, then the backends directory, once.
    pub async fn scan(&self) -> ScanReport {
        let mut report = ScanReport::default();
        let mut seen = self.seen.lock().await;
        report.config = self.reread_config(&mut seen);
        let reconfigured = report.config == Some(ConfigChange::Applied);
        self.scan_sources(&mut report, reconfigured).await;
        let Some(dir) = &self.dir else {
            self.publish_info();
            self.scanned.store(true, std::sync::atomic::Ordering::Release);
            return report;
        };
        let config = self.runtime.config();
        // A backend with a configured source is that source's, whatever file has its name.
        let files: Vec<_> = wasm_files(dir)
            .into_iter()
            .filter(|(n, _, _)| config.backends.get(n).is_none_or(|b| b.source.is_none()))
            .collect();
        for (name, path, stamp) in &files {
            // Under a new configuration every file is looked at again, a rejected one too (it
            // may be granted now).
            if seen.get(path) == Some(stamp) && !reconfigured {
                continue;
            }
            seen.insert(path.clone(), stamp.clone());
            if let Ok(mut l) = self.loading.lock() {
                l.insert(name.clone());
            }
            let loaded = self.load_file(name, path).await;
            if let Ok(mut l) = self.loading.lock() {
                l.remove(name);
            }
            match loaded {
                Ok(Some(b)) => {
                    tracing::info!(backend = %name, digest = %b.digest, version = %b.info.version, contract = %b.contract, cache_hit = b.cache_hit, "backend loaded");
                    report.loaded.push(name.clone());
                }
                Ok(None) => {}
                Err(e) => {
                    let serving = self.get(name).map(|b| b.digest.clone());
                    tracing::error!(backend = %name, file = %path.display(), previous = ?serving, "backend rejected: {e}");
                    report.rejected.push((name.clone(), e.to_string()));
                }
            }
        }
        // A file that disappeared takes its backend with it; mounted volumes are untouched.
        let present: Vec<&String> = files.iter().map(|(n, _, _)| n).collect();
        for name in self.names() {
            let from_dir = self.get(&name).and_then(|b| b.path.clone()).is_some_and(|p| p.starts_with(dir));
            // A file replaced by a source keeps serving until the source's version loads.
            let sourced = config.backends.get(&name).is_some_and(|b| b.source.is_some());
            if from_dir && !sourced && !present.contains(&&name) && self.remove(&name) {
                if let Ok(mut d) = self.departed.lock() {
                    d.insert(name.clone(), std::time::Instant::now());
                }
                tracing::warn!(backend = %name, "backend file removed; backend unloaded");
                report.removed.push(name);
            }
        }
        seen.retain(|p, _| files.iter().any(|(_, fp, _)| fp == p) || Some(p) == self.config_file.as_ref());
        self.publish_info();
        self.scanned.store(true, std::sync::atomic::Ordering::Release);
        report
    }

    /// The configuration file, when it changed since the last look: read, validated, checked
    /// against every backend serving now, and put in force; or refused with one log line.
    fn reread_config(&self, seen: &mut HashMap<PathBuf, FileStamp>) -> Option<ConfigChange> {
        let path = self.config_file.as_ref()?;
        let stamp = stamp_of(path);
        if stamp.is_some() && seen.get(path) == stamp.as_ref() {
            return None;
        }
        match stamp {
            Some(stamp) => {
                seen.insert(path.clone(), stamp);
            }
            // Gone (a ConfigMap being swapped, an operator's mistake): said once, until it is back.
            None => {
                seen.remove(path)?;
            }
        }
        let checked = HostConfig::load(path).map_err(|e| e.to_string()).and_then(|config| {
            let refusals: Vec<String> = self
                .all()
                .iter()
                .filter(|b| b.path.is_some())
                .flat_map(|b| {
                    let violations = b.imports.violations(&config.grants_for(&b.name), b.contract);
                    violations.into_iter().map(|v| format!("backend {} serving now: {v}", b.name))
                })
                .collect();
            if refusals.is_empty() { Ok(config) } else { Err(refusals.join("; ")) }
        });
        match checked {
            Ok(config) => {
                self.runtime.reconfigure(config);
                self.runtime.metrics.config_loads.inc();
                tracing::info!(file = %path.display(), "configuration reloaded; loading every backend under it");
                Some(ConfigChange::Applied)
            }
            Err(why) => {
                self.runtime.metrics.config_rejected.inc();
                tracing::error!(file = %path.display(), "configuration rejected, the previous one keeps serving: {why}");
                Some(ConfigChange::Rejected(why))
            }
        }
    }

    /// Load a file unless its content is what already serves, under the configuration in force
    /// (`Ok(None)`).
    async fn load_file(&self, name: &str, path: &Path) -> Result<Option<Arc<Backend>>, LoadError> {
        let wasm = tokio::fs::read(path).await.map_err(|source| LoadError::Read { path: path.into(), source })?;
        let config = self.runtime.config();
        if self.get(name).is_some_and(|b| b.digest == Runtime::digest(&wasm) && Arc::ptr_eq(&b.config, &config)) {
            return Ok(None);
        }
        self.install(name, &wasm, Some(path.to_path_buf())).await.map(Some)
    }

    /// Poll the directory every `interval` until the registry is dropped.
    pub fn watch(self: &Arc<Self>, interval: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(registry) = weak.upgrade() else { return };
                registry.scan().await;
            }
        })
    }
}

/// `NAME.wasm` files directly in `dir`, with their stamps; unreadable entries are skipped.
fn wasm_files(dir: &Path) -> Vec<(String, PathBuf, FileStamp)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return vec![] };
    let mut out: Vec<_> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let path = e.path();
            if path.extension()? != "wasm" {
                return None;
            }
            let name = path.file_stem()?.to_str()?.to_string();
            let stamp = stamp_of(&path)?;
            Some((name, path, stamp))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The stamp of a regular file (through symlinks, as a ConfigMap mounts it); `None` when there
/// is none.
fn stamp_of(path: &Path) -> Option<FileStamp> {
    let m = std::fs::metadata(path).ok()?;
    m.is_file().then(|| FileStamp { modified: m.modified().ok(), len: m.len() })
}

/// The host's journal of volumes (in the metadata store): which backend build made each
/// volume, kept from its creation to its deletion, so a volume is listed (and its backend
/// known) even while its backend is not loaded.
impl Registry {
    /// Journal that `backend` made volume `volume_id` of `capacity_bytes`, unless the journal
    /// holds it already (a retried creation keeps the first record); the record it holds.
    pub fn journal_created(
        &self,
        backend: &Backend,
        volume_id: &str,
        capacity_bytes: u64,
    ) -> Result<VolumeRecord, MetadataError> {
        let created_at = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let record =
            VolumeRecord { backend: backend.name.clone(), digest: backend.digest.clone(), capacity_bytes, created_at };
        self.runtime.metadata.record_volume_once(volume_id, record)
    }

    /// Journal that volume `volume_id` is gone.
    pub fn journal_deleted(&self, volume_id: &str) -> Result<(), MetadataError> {
        self.runtime.metadata.forget_volume(volume_id)
    }

    /// The volumes the journal holds of backend `name` (in id order), skipping the first
    /// `skip`, at most `take`.
    pub fn journal_volumes(
        &self,
        name: &str,
        skip: usize,
        take: usize,
    ) -> Result<Vec<(String, VolumeRecord)>, MetadataError> {
        self.runtime.metadata.volumes_of(name, skip, take)
    }

    /// The backends the journal holds volumes of.
    pub fn journal_backends(&self) -> Result<std::collections::BTreeSet<String>, MetadataError> {
        self.runtime.metadata.backends_with_volumes()
    }
}
