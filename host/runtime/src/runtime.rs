//! `Runtime`: the engine, compile cache, metadata store, configuration and metrics every
//! backend shares, and `load`, which turns `.wasm` bytes into a checked [`Backend`]: compile
//! (or take from cache) → tell which contract version it is built against → check imports
//! against grants → link only what is granted, under that version's names → pre-instantiate →
//! call `info` once under the backend's limits.
use crate::backend::{Backend, Kind};
use crate::bindings::driver::BackendInfo;
use crate::cache::CompileCache;
use crate::call_error::CallError;
use crate::capabilities::{Capability, ImportSummary};
use crate::compat::ComponentPre;
use crate::config::{HostConfig, is_valid_name};
use crate::contract::{ContractError, ContractVersion};
use crate::imports::backup::BackupCtx;
use crate::imports::block::BlockCtx;
use crate::imports::dir::{CopyJobs, DirCtx};
use crate::imports::kv::KvCtx;
use crate::imports::nfs::NfsCtx;
use crate::imports::rbd::{RbdCtx, RbdProvider};
use crate::metadata::{MetaStore, MetadataError};
use crate::metrics::{BackendLabels, Metrics};
use crate::state::{CallState, Capabilities};
use crate::wasm_engine::{EpochTicker, WasmEngineSettings, build_engine};
use sha2::{Digest, Sha256};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use tokio::sync::Semaphore;
use wasmtime::Engine;
use wasmtime::component::Linker;

/// Why a component could not be loaded. The message is the one log line an operator sees.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("backend name {0:?} is invalid: file stems must be 1-32 of [a-z0-9-]")]
    InvalidName(String),
    #[error("backend {name}: not a valid component: {message}")]
    Compile { name: String, message: String },
    #[error("backend {name}: refused: {}", violations.join("; "))]
    NotGranted { name: String, violations: Vec<String> },
    /// Not a backend of a contract version this host serves (or of several at once).
    #[error("backend {name}: refused: {source}")]
    Contract { name: String, source: ContractError },
    #[error("backend {name}: linking failed: {message}")]
    Link { name: String, message: String },
    #[error("backend {name}: info() failed: {source}")]
    Info { name: String, source: Box<CallError> },
    #[error("backend {name}: info() returned {message}")]
    BadInfo { name: String, message: String },
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
}

/// Errors starting the runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Engine(#[from] crate::wasm_engine::EngineError),
    #[error(transparent)]
    Store(#[from] MetadataError),
}

/// Where the runtime keeps state.
#[derive(Debug, Clone)]
pub struct RuntimeOptions {
    pub config: HostConfig,
    /// compiled artifacts; `None` = no cache
    pub cache_dir: Option<PathBuf>,
    /// the metadata store file (kv, volume journal)
    pub store_path: PathBuf,
    pub wasm_engine: WasmEngineSettings,
}

/// Shared by every backend.
pub struct Runtime {
    pub engine: Engine,
    /// The operator's configuration, replaced whole when its file changes
    /// ([`Runtime::reconfigure`]). A backend is assembled from one snapshot of it and keeps
    /// that snapshot's grants and limits until it is loaded again ([`Backend::config`]).
    config: RwLock<Arc<HostConfig>>,
    pub metadata: Arc<MetaStore>,
    pub metrics: Arc<Metrics>,
    /// `dir` copies running in the background; kept here so they outlive a hot reload.
    copies: Arc<CopyJobs>,
    /// Backups running, the configured targets and restores into new sets: one per host, so
    /// a backup outlives a hot reload of the backend that started it.
    pub backups: Arc<crate::backups::Backups>,
    /// Each backend's guest threads, by name: shared by its versions across hot reloads.
    executors: crate::executor::Executors,
    cache: CompileCache,
    _ticker: EpochTicker,
    /// How the `block` capability's catalog reaches replica servers: plaintext until the host
    /// sets this process's credentials ([`Runtime::reach_replicas`]).
    block_reach: RwLock<wasmcsi_block::control::Reach>,
}

impl Runtime {
    /// Backends loaded from now on reach replica servers as `reach` says (TLS with this
    /// process's credentials).
    pub fn reach_replicas(&self, reach: wasmcsi_block::control::Reach) {
        *self.block_reach.write().unwrap_or_else(std::sync::PoisonError::into_inner) = reach;
    }

    fn block_reach(&self) -> wasmcsi_block::control::Reach {
        self.block_reach.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    pub fn new(opts: RuntimeOptions) -> Result<Arc<Self>, RuntimeError> {
        let engine = build_engine(&opts.wasm_engine)?;
        let metadata = Arc::new(MetaStore::open(&opts.store_path)?);
        Ok(Arc::new(Self {
            cache: CompileCache::new(&engine, opts.cache_dir),
            _ticker: EpochTicker::start(engine.clone()),
            engine,
            backups: Arc::new(crate::backups::Backups::new(opts.config.backup_targets.clone())),
            config: RwLock::new(Arc::new(opts.config)),
            metadata,
            metrics: Arc::new(Metrics::new()),
            copies: Arc::default(),
            executors: Default::default(),
            block_reach: RwLock::new(wasmcsi_block::control::Reach::plaintext()),
        }))
    }

    /// The configuration in force: what the next load links with.
    pub fn config(&self) -> Arc<HostConfig> {
        // A panic while the lock was held cannot leave a half-written `Arc` behind.
        match self.config.read() {
            Ok(c) => c.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Put `config` in force for every load from now on; backends already loaded keep theirs
    /// until they are loaded again (the registry does that on a configuration change).
    pub fn reconfigure(&self, config: HostConfig) -> Arc<HostConfig> {
        self.backups.configure(config.backup_targets.clone());
        let config = Arc::new(config);
        match self.config.write() {
            Ok(mut c) => *c = config.clone(),
            Err(poisoned) => *poisoned.into_inner() = config.clone(),
        }
        config
    }

    /// sha256 of component bytes, hex.
    pub fn digest(wasm: &[u8]) -> String {
        hex::encode(Sha256::digest(wasm))
    }

    /// The imports of a component, without loading it as a backend (for `backend check`).
    pub fn inspect(&self, name: &str, wasm: &[u8]) -> Result<(ImportSummary, Vec<String>), LoadError> {
        let (component, _) = self.compile(name, wasm)?;
        Ok(self.summarize(&component))
    }

    fn compile(&self, name: &str, wasm: &[u8]) -> Result<(wasmtime::component::Component, bool), LoadError> {
        self.cache
            .load(&self.engine, &Self::digest(wasm), wasm)
            .map_err(|e| LoadError::Compile { name: name.into(), message: format!("{e:#}") })
    }

    fn summarize(&self, component: &wasmtime::component::Component) -> (ImportSummary, Vec<String>) {
        let ty = component.component_type();
        // An interface imported for its types alone (`nfs` uses `dir.file-stat`, so every nfs
        // guest imports `dir` without calling it) asks for no capability.
        let imports: Vec<String> = ty
            .imports(&self.engine)
            .filter(|(_, item)| !is_types_only(&self.engine, &item.ty))
            .map(|(n, _)| n.to_string())
            .collect();
        let exports: Vec<String> = ty.exports(&self.engine).map(|(n, _)| n.to_string()).collect();
        (ImportSummary::classify(imports.iter().map(String::as_str)), exports)
    }

    /// Load `wasm` as backend `name`: compile (on the blocking pool; from the cache when
    /// warm), check grants, link, pre-instantiate, call `info`.
    pub async fn load(&self, name: &str, wasm: &[u8], path: Option<PathBuf>) -> Result<Arc<Backend>, LoadError> {
        if !is_valid_name(name) {
            return Err(LoadError::InvalidName(name.into()));
        }
        let result = self.load_checked(name, wasm, path).await;
        let labels = BackendLabels { backend: name.into() };
        match &result {
            Ok(_) => self.metrics.reloads.get_or_create(&labels).inc(),
            Err(_) => self.metrics.rejected.get_or_create(&labels).inc(),
        };
        result
    }

    async fn load_checked(&self, name: &str, wasm: &[u8], path: Option<PathBuf>) -> Result<Arc<Backend>, LoadError> {
        let digest = Self::digest(wasm);
        // Compiling takes 100s of ms of CPU: off the async workers, so serving goes on.
        let (engine, cache, bytes, key) = (self.engine.clone(), self.cache.clone(), wasm.to_vec(), digest.clone());
        let (component, cache_hit) = tokio::task::spawn_blocking(move || cache.load(&engine, &key, &bytes))
            .await
            .map_err(|e| LoadError::Compile { name: name.into(), message: format!("compile task failed: {e}") })?
            .map_err(|e| LoadError::Compile { name: name.into(), message: format!("{e:#}") })?;
        let (imports, exports) = self.summarize(&component);
        let contract = ContractVersion::detect(&imports.wasmcsi, &exports)
            .map_err(|source| LoadError::Contract { name: name.into(), source })?;
        // One snapshot for the whole load: the grants checked are the grants linked.
        let config = self.config();
        let grants = config.grants_for(name);
        let violations = imports.violations(&grants, contract);
        if !violations.is_empty() {
            return Err(LoadError::NotGranted { name: name.into(), violations });
        }

        let link = |e: wasmtime::Error| LoadError::Link { name: name.into(), message: format!("{e:#}") };
        let mut linker: Linker<CallState> = Linker::new(&self.engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(link)?;
        // Only what was granted is linked at all: an ungranted interface does not exist for
        // this backend, whatever its bytes say. `types`, `log` and `kv` are everyone's.
        // `dir` imported for its types only still needs its instance linked; the guest cannot
        // reach a function it does not import.
        let dir_types = component.component_type().imports(&self.engine).any(|(n, item)| {
            n.split('@').next() == Some("wasmcsi:backend/dir") && is_types_only(&self.engine, &item.ty)
        });
        let mut linked = vec![Capability::Types, Capability::Log, Capability::Kv];
        for c in imports.capabilities.iter().copied().chain(dir_types.then_some(Capability::Dir)) {
            if !linked.contains(&c) {
                linked.push(c);
            }
        }
        for capability in linked {
            crate::compat::link(&mut linker, contract, capability).map_err(link)?;
        }
        let pre = linker.instantiate_pre(&component).map_err(link)?;
        let pre = ComponentPre::new(contract, pre).map_err(link)?;

        let kind = Kind::Wasm { engine: self.engine.clone(), pre };
        let mut backend = self.assemble(&config, name, kind, empty_info(), imports);
        backend.digest = digest;
        backend.contract = contract;
        backend.path = path;
        backend.cache_hit = cache_hit;
        let info = backend
            .call_in_place("info", |driver, store| driver.info(store))
            .await
            .map_err(|e| LoadError::Info { name: name.into(), source: Box::new(e) })?;
        if info.name.is_empty() || info.name.len() > 64 || info.version.len() > 64 {
            return Err(LoadError::BadInfo {
                name: name.into(),
                message: "a name of 1-64 bytes and a version of at most 64".into(),
            });
        }
        backend.info = info;
        Ok(Arc::new(backend))
    }

    /// A backend whose guest source is linked into this process (see [`crate::native`]):
    /// same grants, limits and metrics, no sandbox. For benchmarks and tests (feature
    /// `native`).
    #[cfg(feature = "native")]
    pub fn load_native(&self, name: &str, driver: crate::native::NativeDriver) -> Result<Arc<Backend>, LoadError> {
        if !is_valid_name(name) {
            return Err(LoadError::InvalidName(name.into()));
        }
        let config = self.config();
        let mut backend = self.assemble(&config, name, Kind::Native(driver), (driver.info)(), ImportSummary::default());
        backend.digest = Self::digest(format!("native:{name}").as_bytes());
        Ok(Arc::new(backend))
    }

    /// A backend with `config`'s grants and limits and this runtime's metrics for `name`.
    fn assemble(
        &self,
        config: &Arc<HostConfig>,
        name: &str,
        kind: Kind,
        info: BackendInfo,
        imports: ImportSummary,
    ) -> Backend {
        let limits = config.limits_for(name);
        let grants = config.grants_for(name);
        // One catalog for `block` and `backup`: a backup reads the sets `block` made.
        let catalog = grants.block.clone().filter(|b| !b.is_empty()).map(|sources| {
            let restorer: Arc<dyn wasmcsi_block::catalog::Restorer> = self.backups.clone();
            wasmcsi_block::catalog::Catalog::new(sources, limits.import_timeout())
                .with_reach(self.block_reach())
                .with_restorer(restorer)
        });
        match self.metadata.kv_usage(name) {
            Ok(usage) => self.metrics.kv_usage(name, usage),
            Err(e) => tracing::warn!(backend = name, error = %e, "cannot read kv usage"),
        }
        Backend {
            name: name.into(),
            digest: String::new(),
            path: None,
            info,
            contract: ContractVersion::CURRENT,
            config: config.clone(),
            imports,
            permits: Arc::new(Semaphore::new(limits.max_concurrent_calls as usize)),
            caps: Arc::new(Capabilities {
                backend: name.into(),
                kv: KvCtx {
                    backend: name.into(),
                    metadata: self.metadata.clone(),
                    quota: limits.kv_quota(),
                    metrics: self.metrics.clone(),
                },
                dir: DirCtx {
                    backend: name.into(),
                    roots: grants.dir,
                    import_timeout: limits.import_timeout(),
                    copies: self.copies.clone(),
                },
                nfs: NfsCtx::new(name, grants.nfs.as_deref().unwrap_or_default(), limits.import_timeout()),
                rbd: RbdCtx {
                    backend: name.into(),
                    provider: RbdProvider::from_grants(
                        grants.rbd.as_deref().unwrap_or_default(),
                        &config.clusters,
                        limits.import_timeout(),
                    )
                    .map(Arc::new),
                    import_timeout: limits.import_timeout(),
                },
                block: BlockCtx {
                    backend: name.into(),
                    catalog: catalog.clone(),
                    import_timeout: limits.import_timeout(),
                    backup_targets: grants.backup.clone(),
                },
                backup: BackupCtx {
                    backend: name.into(),
                    targets: grants.backup,
                    catalog,
                    backups: self.backups.clone(),
                    import_timeout: limits.import_timeout(),
                },
            }),
            limits,
            cache_hit: false,
            kind,
            metrics: self.metrics.clone(),
            memory_peak: AtomicU64::new(0),
            executor: self.executors.of(name),
        }
    }
}

fn empty_info() -> BackendInfo {
    BackendInfo { name: String::new(), version: String::new(), features: vec![], parameters: vec![] }
}

/// An instance import that exports no function (types only).
fn is_types_only(engine: &wasmtime::Engine, item: &wasmtime::component::types::ComponentItem) -> bool {
    use wasmtime::component::types::ComponentItem;
    match item {
        ComponentItem::ComponentInstance(i) => {
            !i.exports(engine).any(|(_, e)| matches!(e.ty, ComponentItem::ComponentFunc(_)))
        }
        _ => false,
    }
}
