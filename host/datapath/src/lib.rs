//! The node's data path: the process that holds the volumes attached on a node, as Longhorn's
//! instance-manager holds its engines and replicas. It owns this node's replica server (every
//! replica on the node), the engine of every replicated volume attached here with the frontend
//! that exposes it to the kernel (FUSE + loop, [`attach`]), and the node's rbd-fuse daemons
//! ([`rbd_fuse`]). It decides nothing about CSI, backends or filesystems: the node plugin asks
//! the backend for the plan and the replica nodes for the members and epoch, then hands them
//! here, and formats and mounts the devices this crate makes. The replication itself (protocol,
//! engine, replica storage, control plane) is `wasmcsi-block`'s; how a volume becomes a kernel
//! device is `wasmcsi-frontend`'s; how rbd-fuse runs is `wasmcsi-rbd`'s.
//!
//! [`DataPath`] is the node's data path in one value: the node plugin keeps one, or a process
//! of its own does. The CSI node attacher attaches and detaches volumes through it, and the
//! control plane reaches the engines through the replica server's `EngineCall` (see
//! `wasmcsi_block::catalog::engine_call`), so an operation on an attached volume is ordered
//! with its I/O wherever the controller runs. A volume's engine reaches the replica on this
//! node in-process (no socket), the others over TCP; its persisted state lives under
//! `engine_root/VOLUME`, kept across attaches, so a re-attach after a crash resumes rebuilds
//! instead of restarting them.
//!
//! The data path runs in the node plugin's process, or in a process of its own
//! (`wasmcsi datapath`, [`process`]) that serves it on a unix socket ([`socket`], [`wire`]) so
//! that the plugin can die, restart or be upgraded without an I/O error on any volume: the
//! plugin then reaches it through [`client::Engines`], the same handle either way.
//!
//! A data-path process hands its volumes to a new binary live ([`handover`]: what one process
//! image hands the next; [`upgrade`]: the `execve` and the taking of the inherited fds; with a
//! new TLS configuration for the replica port when asked, checked first by [`tls_change`]): every
//! volume is suspended ([`DataPath::suspend_all`]), the process image is replaced, and the new
//! one adopts them ([`DataPath::adopt`]) with the FUSE connections, mounts and loop devices the
//! kernel already has.
//!
//! Its replica server and its engines' connections travel as `--tls-mode` says (plaintext, or
//! mutual TLS with the node's credentials, [`DataPathConfig::transport`]); over TLS a volume's
//! engine presents the volume's grant to open sessions on other nodes' replicas, which the
//! attach brings and [`grants`] keeps fresh from the node's grant source.
//!
//! It also keeps the node's rbd-fuse daemons ([`rbd_fuse`]) for the plugin's RBD staging, so
//! they outlive the plugin too; they are plain children of this process, which an `execve`
//! keeps, and [`rbd_fuse::daemons`] finds them again from their records.

pub mod attach;
pub mod client;
pub mod grants;
pub mod handover;
pub mod process;
pub mod rbd_fuse;
pub mod socket;
pub mod tls_change;
pub mod upgrade;
pub mod wire;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, UNIX_EPOCH};

use wasmcsi_block::catalog::AttachInfo;
use wasmcsi_block::catalog::engine_call::{EngineReplica, EngineReply, EngineRequest, EngineStatus, MAX_HOLD_MS};
use wasmcsi_block::engine::ReplicaHealth;
use wasmcsi_block::protocol::Status;
use wasmcsi_block::replica::{
    EngineCalls, NodeIdentity, ReplicaDisks, ReplicaNode, ReplicaServer, ServerConfig, ServerError,
};
use wasmcsi_block::transport::Transport;
use wasmcsi_block::volume::{InProcessNode, ReplicaEndpoint, VolumeGrant};
use wasmcsi_trust::{GrantSource, Limits, Role};

use crate::attach::{AttachConfig, AttachError, AttachedVolume, SuspendedVolume};

/// Where this node's data path keeps what, and who it is.
#[derive(Debug, Clone)]
pub struct DataPathConfig {
    pub identity: NodeIdentity,
    /// Every replica on this node's disk `default`, one directory each.
    pub replica_root: PathBuf,
    /// More disks of this node: replica roots by name (a replica of a volume lives on one of
    /// them or on `default`).
    pub replica_disks: Vec<(String, PathBuf)>,
    /// Where the replica server listens (every other node's engines connect here).
    pub listen: SocketAddr,
    /// Engine state per attached volume (kept across attaches).
    pub engine_root: PathBuf,
    /// FUSE mounts of the frontends.
    pub runtime_root: PathBuf,
    /// Bound on each replica server request while attaching.
    pub request_timeout: Duration,
    /// How long an engine may take to reach a healthy replica.
    pub attach_timeout: Duration,
    /// How the replica server and the engines' connections travel (`--tls-mode`, with the
    /// node's credentials from `--tls-dir`).
    pub transport: Transport,
    /// The replica listener's bounds.
    pub limits: Limits,
}

/// The volumes attached on this node, shared by the node plugin and the replica server (which
/// answers `EngineCall`s from them).
#[derive(Default)]
struct Volumes {
    map: Mutex<HashMap<String, Arc<AttachedVolume>>>,
    /// What each attached volume's engine was started with, and its members as they changed
    /// since: what a handover passes on (with the grant as it is then, see `kept`). Shared with
    /// the engine calls that change the members.
    infos: Arc<Mutex<HashMap<String, AttachInfo>>>,
    /// Each attached volume's grant and the task keeping it fresh (TLS as a node only).
    kept: Mutex<HashMap<String, Kept>>,
}

/// An attached volume's grant and its keeper.
struct Kept {
    grant: Arc<VolumeGrant>,
    keeper: tokio::task::JoinHandle<()>,
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

impl Volumes {
    fn get(&self, id: &str) -> Option<Arc<AttachedVolume>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner).get(id).cloned()
    }
}

/// How long [`DataPath::abandon`] lets the replica server's connections close.
pub const SERVER_STOP_WAIT: Duration = Duration::from_secs(1);

/// How long a handover waits for the attaches and detaches running when it starts.
const HANDOVER_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// The node's data path (see the module docs).
pub struct DataPath {
    config: DataPathConfig,
    /// Taken by [`DataPath::shutdown`]; the address and replicas stay readable after it.
    server: Mutex<Option<ReplicaServer>>,
    local_addr: SocketAddr,
    node: Arc<ReplicaNode>,
    /// Every disk of this node (`node` is its `default`).
    disks: ReplicaDisks,
    volumes: Arc<Volumes>,
    /// One attach or detach per volume at a time (the CSI layer's guard already ensures it; this
    /// keeps the data path safe on its own).
    busy: Mutex<std::collections::HashSet<String>>,
    /// The replica server's listening socket (a second fd of it): what a handover passes on, so
    /// that connections queue instead of being refused while the new process starts.
    listener: TcpListener,
    /// Set while the volumes are handed over: attaches and detaches answer busy.
    handing_over: AtomicBool,
    /// Handovers this data path went through, and the last one's outcome.
    handovers: Mutex<handover::HandoverReport>,
    /// What runs rbd-fuse for RBD volumes staged here, when the binary registered it.
    rbd_fuse: std::sync::OnceLock<Arc<dyn rbd_fuse::RbdFuseDaemons>>,
    /// Where the attached volumes' grants come from, and their keepers' failures.
    grants: grants::GrantKeepers,
    /// The replica listener's counters (kept past a shutdown, for the metrics).
    replica_stats: Arc<wasmcsi_trust::listener::Stats>,
}

#[derive(Debug, thiserror::Error)]
pub enum DataPathError {
    #[error("replica server: {0}")]
    Server(#[from] ServerError),
    #[error("opening the replica root {path}: {message}")]
    Root { path: PathBuf, message: String },
    #[error(transparent)]
    Attach(#[from] AttachError),
    #[error("volume {0} is being attached or detached by another call")]
    Busy(String),
    #[error("the data path is handing its volumes to a new binary; retry")]
    HandingOver,
    #[error("the replica listener: {0}")]
    Listener(std::io::Error),
    #[error("rbd-fuse: {0}")]
    RbdFuse(#[from] rbd_fuse::RbdFuseError),
    #[error("this data path runs no rbd-fuse daemons")]
    NoRbdFuse,
}

impl DataPath {
    /// Opens this node's replicas and serves them; engines attach on demand.
    #[tracing::instrument(name = "datapath.start", skip_all, fields(node = %config.identity.node, listen = %config.listen))]
    pub async fn start(config: DataPathConfig) -> Result<Self, DataPathError> {
        Self::start_on(config, None).await
    }

    /// Like [`Self::start`], serving replicas on `listener` (inherited from the data path this
    /// one takes over from) instead of binding `config.listen`.
    #[tracing::instrument(name = "datapath.start", skip_all, fields(node = %config.identity.node, listen = %config.listen))]
    pub async fn start_on(config: DataPathConfig, listener: Option<TcpListener>) -> Result<Self, DataPathError> {
        let listener = match listener {
            Some(l) => l,
            None => bind(config.listen).map_err(|e| DataPathError::Server(ServerError::Bind(e)))?,
        };
        let kept = listener.try_clone().map_err(DataPathError::Listener)?;
        // Before any attach here: what a dead process (a crashed data path, a plugin that ran
        // one, whatever their pids) left under the runtime directory goes.
        reclaim_dead(config.runtime_root.clone()).await;
        let disks = open_disks(&config).await?;
        let volumes = Arc::new(Volumes::default());
        let server_config = ServerConfig {
            identity: config.identity.clone(),
            transport: config.transport.clone(),
            limits: config.limits.clone(),
            ..ServerConfig::plaintext()
        };
        let engines: Arc<dyn EngineCalls> = volumes.clone();
        let server = ReplicaServer::serve_disks_on_listener(listener, disks, server_config, Some(engines)).await?;
        let (local_addr, node, disks) = (server.local_addr(), server.node().clone(), server.disks().clone());
        let replica_stats = server.stats().clone();
        Ok(Self {
            config,
            server: Mutex::new(Some(server)),
            local_addr,
            node,
            disks,
            volumes,
            busy: Mutex::default(),
            listener: kept,
            handing_over: AtomicBool::new(false),
            handovers: Mutex::default(),
            rbd_fuse: std::sync::OnceLock::new(),
            grants: grants::GrantKeepers::default(),
            replica_stats,
        })
    }

    /// The replica listener's counters (connections open, refused, handshakes).
    pub fn replica_stats(&self) -> &Arc<wasmcsi_trust::listener::Stats> {
        &self.replica_stats
    }

    /// Attached volumes' grants come from `source` from now on (once; a second call is ignored
    /// and says so): the controller's authority endpoint, or this process's own controller.
    pub fn serve_grants(&self, source: Arc<dyn GrantSource>) -> bool {
        self.grants.set_source(source)
    }

    /// Grant renewals that failed since this data path started.
    pub fn grant_renewal_failures(&self) -> u64 {
        self.grants.renewal_failures()
    }

    /// The grant the engine of `id` presents now, if it holds one.
    pub fn grant(&self, id: &str) -> Option<Vec<u8>> {
        let kept = self.volumes.kept.lock().unwrap_or_else(PoisonError::into_inner);
        kept.get(id).and_then(|k| k.grant.current()).map(|g| g.to_vec())
    }

    pub fn identity(&self) -> &NodeIdentity {
        &self.config.identity
    }

    /// How the replica port and the engines' connections travel now.
    pub fn tls_mode(&self) -> wasmcsi_trust::TlsMode {
        self.config.transport.mode()
    }

    /// What each attached volume's engine was started with (its members and epoch), by volume
    /// id.
    pub fn attach_infos(&self) -> Vec<(String, AttachInfo)> {
        let infos = self.volumes.infos.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<(String, AttachInfo)> = infos.iter().map(|(id, i)| (id.clone(), i.clone())).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Where the replica server listens (port 0 in the configuration: the one it got).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    pub fn replicas(&self) -> &Arc<ReplicaNode> {
        &self.node
    }

    /// The attached volume `id`, if it is attached here by this process.
    pub fn volume(&self, id: &str) -> Option<Arc<AttachedVolume>> {
        self.volumes.get(id)
    }

    /// Volumes attached here now.
    pub fn attached(&self) -> Vec<String> {
        let mut ids: Vec<String> =
            self.volumes.map.lock().unwrap_or_else(PoisonError::into_inner).keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Every volume attached here with its engine's status, by volume id: what the node's
    /// `/metrics` shows of its replicated volumes.
    pub fn statuses(&self) -> Vec<(String, wasmcsi_block::volume::VolumeStatus)> {
        let volumes: Vec<(String, Arc<AttachedVolume>)> = {
            let map = self.volumes.map.lock().unwrap_or_else(PoisonError::into_inner);
            map.iter().map(|(id, v)| (id.clone(), v.clone())).collect()
        };
        let mut out: Vec<_> = volumes.into_iter().map(|(id, v)| (id, v.engine_status())).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn begin(&self, id: &str) -> Result<BusyGuard<'_>, DataPathError> {
        let mut busy = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        if self.handing_over.load(Ordering::SeqCst) {
            return Err(DataPathError::HandingOver);
        }
        if !busy.insert(id.to_owned()) {
            return Err(DataPathError::Busy(id.to_owned()));
        }
        Ok(BusyGuard { path: self, id: id.to_owned() })
    }

    /// Starts the engine of `id` with the record's members and epoch and exposes it as a block
    /// device; the attached volume when it already is.
    #[tracing::instrument(name = "datapath.attach", skip(self, info), fields(epoch = info.epoch))]
    pub async fn attach(&self, id: &str, info: &AttachInfo) -> Result<Arc<AttachedVolume>, DataPathError> {
        if let Some(v) = self.volumes.get(id) {
            return Ok(v);
        }
        let _guard = self.begin(id)?;
        let (config, kept) = self.attach_config(id, info)?;
        let volume = Arc::new(AttachedVolume::start(config).await?);
        self.insert(id, info, volume.clone(), kept);
        Ok(volume)
    }

    fn insert(&self, id: &str, info: &AttachInfo, volume: Arc<AttachedVolume>, kept: Option<Kept>) {
        self.volumes.infos.lock().unwrap_or_else(PoisonError::into_inner).insert(id.to_owned(), info.clone());
        self.volumes.map.lock().unwrap_or_else(PoisonError::into_inner).insert(id.to_owned(), volume);
        let mut grants = self.volumes.kept.lock().unwrap_or_else(PoisonError::into_inner);
        match kept {
            Some(kept) => grants.insert(id.to_owned(), kept),
            None => grants.remove(id),
        };
    }

    fn remove(&self, id: &str) {
        self.volumes.map.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        self.volumes.infos.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        self.volumes.kept.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
    }

    /// How the engine of `id` is started on this node, from the record's members and epoch,
    /// with the grant it presents and its keeper when it runs as a node over TLS (not started
    /// yet: nothing runs for an attach that fails before it starts).
    fn attach_config(&self, id: &str, info: &AttachInfo) -> Result<(AttachConfig, Option<Kept>), DataPathError> {
        // A member no discovery ever found has no address: its slot never connects, the volume
        // serves degraded, and the control plane replaces it.
        let unknown = SocketAddr::from(([0, 0, 0, 0], 0));
        // The engine's own replicas (members named like this node; one per disk) are served
        // in-process, each by its disk.
        let replicas = info
            .members
            .iter()
            .enumerate()
            .map(|(i, (name, addr))| {
                let addr = addr.unwrap_or(unknown);
                match self.disks.get(info.disk(i)) {
                    Ok(node) if *name == self.config.identity.node => {
                        ReplicaEndpoint::InProcess(InProcessNode { addr, node: node.clone() })
                    }
                    // A disk this node does not have (any more): its server answers that the
                    // replica is not found, and the control plane replaces it.
                    _ => ReplicaEndpoint::Remote(addr),
                }
            })
            .collect();
        let dir = wasmcsi_block::replica::replica_dir_name(id)
            .map_err(|e| DataPathError::Root { path: self.config.engine_root.clone(), message: e.to_string() })?;
        let mut config = AttachConfig::new(id, replicas, self.config.engine_root.join(dir), &self.config.runtime_root);
        config.epoch = info.epoch;
        config.request_timeout = self.config.request_timeout;
        config.attach_timeout = self.config.attach_timeout;
        config.transport = self.config.transport.clone();
        config.nodes = info.members.iter().map(|(name, _)| Some(name.clone())).collect();
        config.disks = (0..info.members.len()).map(|i| info.disk(i).to_owned()).collect();
        config.limits = info.limits;
        let kept = match (self.config.transport.credentials(), self.config.transport.role()) {
            (Some(credentials), Some(Role::Node(_))) => {
                let grant = Arc::new(VolumeGrant::new(info.grant.clone()));
                let keeper = self.grants.keep(id, grant.clone(), credentials.clone());
                config.grant = Some(grant.clone());
                Some(Kept { grant, keeper })
            }
            _ => None,
        };
        Ok((config, kept))
    }

    /// The replica listener (another fd of it), for a handover.
    pub fn replica_listener(&self) -> std::io::Result<TcpListener> {
        self.listener.try_clone()
    }

    /// Handovers so far and how the last one went.
    pub fn handover_report(&self) -> handover::HandoverReport {
        self.handovers.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Records the outcome of a handover (this process adopted, or it failed and serves on).
    pub fn record_handover(&self, report: handover::HandoverReport) {
        *self.handovers.lock().unwrap_or_else(PoisonError::into_inner) = report;
    }

    /// Suspends every attached volume for a handover (see [`AttachedVolume::suspend`]), all at
    /// once, after the attaches and detaches running now finished; later ones answer
    /// [`DataPathError::HandingOver`] until [`Self::end_handover`]. The volumes leave this data
    /// path: hand them to [`Self::adopt`], here or in the next process image. If one cannot be
    /// suspended, those already suspended are adopted again and the error returned.
    #[tracing::instrument(name = "datapath.suspend_all", skip_all)]
    pub async fn suspend_all(&self) -> Result<Vec<(AttachInfo, SuspendedVolume)>, DataPathError> {
        if self.handing_over.swap(true, Ordering::SeqCst) {
            return Err(DataPathError::HandingOver);
        }
        let deadline = tokio::time::Instant::now() + HANDOVER_WAIT;
        while !self.busy.lock().unwrap_or_else(PoisonError::into_inner).is_empty() {
            if tokio::time::Instant::now() >= deadline {
                self.end_handover();
                return Err(DataPathError::Busy("an attach or detach that does not end".into()));
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let volumes: Vec<(String, AttachInfo, Arc<AttachedVolume>)> = {
            let map = self.volumes.map.lock().unwrap_or_else(PoisonError::into_inner);
            let infos = self.volumes.infos.lock().unwrap_or_else(PoisonError::into_inner);
            let kept = self.volumes.kept.lock().unwrap_or_else(PoisonError::into_inner);
            map.iter()
                .filter_map(|(id, v)| {
                    let mut info = infos.get(id)?.clone();
                    // The grant as it is now (renewed since the attach, perhaps): the next image
                    // presents it.
                    if let Some(current) = kept.get(id).and_then(|k| k.grant.current()) {
                        info.grant = Some(current.to_vec());
                    }
                    // The limits as they are now (set since the attach, perhaps).
                    info.limits = v.limits();
                    Some((id.clone(), info, v.clone()))
                })
                .collect()
        };
        let tasks: Vec<_> = volumes
            .iter()
            .map(|(_, _, v)| {
                let v = v.clone();
                tokio::spawn(async move { v.suspend().await })
            })
            .collect();
        let mut suspended = Vec::new();
        let mut failed = None;
        for ((id, info, _), task) in volumes.into_iter().zip(tasks) {
            let result = task.await.unwrap_or_else(|e| {
                Err(AttachError::Task { volume_id: id.clone(), what: "suspend", message: e.to_string() })
            });
            match result {
                Ok(s) => {
                    self.remove(&id);
                    suspended.push((info, s));
                }
                Err(e) => {
                    tracing::error!(volume.id = %id, error = %e, "suspending a volume for a handover");
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            self.adopt_all(suspended).await;
            self.end_handover();
            return Err(e.into());
        }
        Ok(suspended)
    }

    /// Adopts every suspended volume (see [`Self::adopt`]), all at once; returns each one's
    /// pause (from its suspend until it serves again). A volume that cannot be adopted is lost
    /// to this data path, as after a crash (logged).
    pub async fn adopt_all(&self, volumes: Vec<(AttachInfo, SuspendedVolume)>) -> Vec<(String, std::time::Duration)> {
        let mut tasks = Vec::new();
        for (info, s) in volumes {
            let (id, since) = (s.volume_id.clone(), s.suspended_at);
            match self.attach_config(&id, &info) {
                Ok((config, kept)) => tasks.push((
                    id,
                    info,
                    kept,
                    tokio::spawn(async move {
                        let adopted = AttachedVolume::adopt(config, s).await;
                        (adopted, since.elapsed().unwrap_or_default())
                    }),
                )),
                Err(e) => tracing::error!(volume.id = %id, error = %e, "a handed-over volume could not be adopted"),
            }
        }
        let mut pauses = Vec::new();
        for (id, info, kept, task) in tasks {
            match task.await {
                Ok((Ok(volume), pause)) => {
                    self.insert(&id, &info, Arc::new(volume), kept);
                    pauses.push((id, pause));
                }
                Ok((Err(e), _)) => {
                    tracing::error!(volume.id = %id, error = %e, "a handed-over volume could not be adopted")
                }
                Err(e) => tracing::error!(volume.id = %id, error = %e, "adopting a handed-over volume"),
            }
        }
        pauses
    }

    /// Serves a volume suspended by a data path of this node (this one, or the process image
    /// before this one), started with `info`: see [`AttachedVolume::adopt`].
    #[tracing::instrument(name = "datapath.adopt", skip_all, fields(volume.id = %suspended.volume_id))]
    pub async fn adopt(
        &self,
        info: &AttachInfo,
        suspended: SuspendedVolume,
    ) -> Result<Arc<AttachedVolume>, DataPathError> {
        let id = suspended.volume_id.clone();
        let (config, kept) = self.attach_config(&id, info)?;
        let volume = Arc::new(AttachedVolume::adopt(config, suspended).await?);
        self.insert(&id, info, volume.clone(), kept);
        Ok(volume)
    }

    /// Attaches and detaches are served again.
    pub fn end_handover(&self) {
        self.handing_over.store(false, Ordering::SeqCst);
    }

    /// Runs rbd-fuse for the RBD volumes staged here with `daemons` (once; a second call is
    /// ignored and says so).
    pub fn serve_rbd_fuse(&self, daemons: Arc<dyn rbd_fuse::RbdFuseDaemons>) -> bool {
        self.rbd_fuse.set(daemons).is_ok()
    }

    fn rbd_fuse(&self) -> Result<Arc<dyn rbd_fuse::RbdFuseDaemons>, DataPathError> {
        self.rbd_fuse.get().cloned().ok_or(DataPathError::NoRbdFuse)
    }

    /// Starts rbd-fuse for an RBD volume; the running attachment when it has one. Ordered
    /// with the volume's other rbd-fuse calls and with handovers like an attach.
    #[tracing::instrument(name = "datapath.rbd_fuse_attach", skip_all, fields(volume.id = %spec.volume, pool = %spec.pool, image = %spec.image))]
    pub async fn rbd_fuse_attach(&self, spec: rbd_fuse::RbdFuseSpec) -> Result<rbd_fuse::RbdFuseView, DataPathError> {
        let daemons = self.rbd_fuse()?;
        let _guard = self.begin(&rbd_fuse_key(&spec.volume))?;
        let id = spec.volume.clone();
        Ok(tokio::task::spawn_blocking(move || daemons.attach(&spec)).await.map_err(|e| AttachError::Task {
            volume_id: id,
            what: "rbd-fuse attach",
            message: e.to_string(),
        })??)
    }

    /// Tears an RBD volume's rbd-fuse down; absent succeeds.
    #[tracing::instrument(name = "datapath.rbd_fuse_detach", skip(self))]
    pub async fn rbd_fuse_detach(&self, volume: &str) -> Result<(), DataPathError> {
        let daemons = self.rbd_fuse()?;
        let _guard = self.begin(&rbd_fuse_key(volume))?;
        let id = volume.to_owned();
        Ok(tokio::task::spawn_blocking(move || daemons.detach(&id)).await.map_err(|e| AttachError::Task {
            volume_id: volume.to_owned(),
            what: "rbd-fuse detach",
            message: e.to_string(),
        })??)
    }

    /// Every rbd-fuse attachment (none when this data path runs no rbd-fuse).
    pub fn rbd_fuse_list(&self) -> Vec<rbd_fuse::RbdFuseView> {
        self.rbd_fuse.get().map(|d| d.list()).unwrap_or_default()
    }

    /// Stops the engine of `id` (its device must no longer be mounted); absent succeeds.
    #[tracing::instrument(name = "datapath.detach", skip(self))]
    pub async fn detach(&self, id: &str) -> Result<(), DataPathError> {
        let _guard = self.begin(id)?;
        let Some(volume) = self.volumes.get(id) else { return Ok(()) };
        let result = volume.stop().await;
        // Stopped, or the final flush failed after a complete teardown: either way it is gone.
        if !matches!(result, Err(AttachError::InUse(_))) {
            self.remove(id);
        }
        Ok(result?)
    }

    /// Stops as a crash would, at once (a data-path process on SIGTERM): no attach or detach
    /// starts any more, every attached volume is abandoned ([`AttachedVolume::abandon`]: nothing
    /// is detached, flushed or waited for; its FUSE mount and loop device stay for the next
    /// start to reclaim), and the replica server stops (its connections are cut, as by an exit,
    /// after at most [`SERVER_STOP_WAIT`]). Returns the volumes it left.
    pub async fn abandon(&self) -> Vec<String> {
        self.handing_over.store(true, Ordering::SeqCst);
        let volumes: Vec<(String, Arc<AttachedVolume>)> =
            self.volumes.map.lock().unwrap_or_else(PoisonError::into_inner).drain().collect();
        for (_, volume) in &volumes {
            volume.abandon();
        }
        let server = self.server.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(server) = server
            && tokio::time::timeout(SERVER_STOP_WAIT, server.shutdown()).await.is_err()
        {
            tracing::warn!("the replica server's connections did not close in time; cut at exit");
        }
        let mut ids: Vec<String> = volumes.into_iter().map(|(id, _)| id).collect();
        ids.sort();
        ids
    }

    /// Stops every engine (best effort) and the replica server.
    pub async fn shutdown(&self) -> Result<(), DataPathError> {
        for id in self.attached() {
            if let Err(e) = self.detach(&id).await {
                tracing::warn!(volume.id = %id, error = %e, "volume left attached at shutdown");
            }
        }
        let server = self.server.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(server) = server {
            server.shutdown().await?;
        }
        Ok(())
    }
}

/// Claims `runtime_root` for this process's owner and reclaims what dead owners left there
/// (`wasmcsi_frontend::fuse::reclaim_dead`, which logs each mount and loop device). A failure is
/// logged and does not stop the start: the leftovers only cost a mount and a loop device each.
pub async fn reclaim_dead(runtime_root: PathBuf) {
    let dir = runtime_root.clone();
    let done = tokio::task::spawn_blocking(move || {
        wasmcsi_frontend::owner::this_process().claim(&dir)?;
        wasmcsi_frontend::fuse::reclaim_dead(&dir)
    })
    .await;
    match done {
        Ok(Ok(r)) if r == Default::default() => {}
        Ok(Ok(r)) => {
            tracing::info!(runtime = %runtime_root.display(), mounts = r.mounts, loops = r.loops, "reclaimed what dead processes left")
        }
        Ok(Err(e)) => {
            tracing::error!(runtime = %runtime_root.display(), error = %e, "reclaiming what dead processes left")
        }
        Err(e) => tracing::error!(error = %e, "the reclaim task failed"),
    }
}

/// Binds the replica listener as tokio would (`SO_REUSEADDR`: a data path restarted after a
/// crash binds again while its old connections linger in TIME_WAIT).
fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(1024)?.into_std()
}

/// The busy-set key of a volume's rbd-fuse (apart from a replicated volume of the same id).
fn rbd_fuse_key(volume: &str) -> String {
    format!("rbd-fuse/{volume}")
}

struct BusyGuard<'a> {
    path: &'a DataPath,
    id: String,
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.path.busy.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

/// Opens the node's replica roots: `default` and every more disk of `config`.
async fn open_disks(config: &DataPathConfig) -> Result<ReplicaDisks, DataPathError> {
    let root_error = |path: &Path, message: String| DataPathError::Root { path: path.to_owned(), message };
    let mut roots = vec![config.replica_root.clone()];
    roots.extend(config.replica_disks.iter().map(|(_, path)| path.clone()));
    let mut opened = Vec::with_capacity(roots.len());
    for root in roots {
        let path = root.clone();
        let node = tokio::task::spawn_blocking(move || ReplicaNode::open(&path))
            .await
            .map_err(|e| root_error(&root, e.to_string()))?
            .map_err(|e| root_error(&root, e.to_string()))?;
        opened.push(Arc::new(node));
    }
    let default = opened.remove(0);
    let more = config.replica_disks.iter().map(|(name, _)| name.clone()).zip(opened).collect();
    ReplicaDisks::new(default, more).map_err(|e| root_error(&config.replica_root, e.to_string()))
}

/// An attached volume as the node plugin sees it (served by this process).
pub fn view(id: &str, attached: &AttachedVolume) -> wire::VolumeView {
    wire::VolumeView {
        volume: id.to_owned(),
        device: attached.device().to_owned(),
        pid: std::process::id(),
        owner: wasmcsi_frontend::owner::this_process().id().to_owned(),
        status: engine_status(attached),
    }
}

/// The engine's view for the control plane.
pub fn engine_status(volume: &AttachedVolume) -> EngineStatus {
    let s = volume.engine_status();
    let rebuild = s.rebuild.as_ref();
    EngineStatus {
        attached: s.attached,
        fenced: s.fenced,
        size: s.size,
        revision: s.revision,
        replicas: s
            .replicas
            .iter()
            .enumerate()
            .map(|(i, (health, since))| {
                let (rebuilt, rebuild_total) = rebuild
                    .filter(|r| r.replica == i)
                    .map(|r| (r.done.saturating_mul(r.region_size), r.total.saturating_mul(r.region_size)))
                    .unwrap_or((0, 0));
                EngineReplica {
                    state: match health {
                        ReplicaHealth::Healthy => "healthy",
                        ReplicaHealth::Rebuilding => "rebuilding",
                        ReplicaHealth::Stale => "stale",
                        ReplicaHealth::Down => "down",
                    }
                    .to_owned(),
                    down_since_ns: since.and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map(|d| d.as_nanos() as u64),
                    rebuilt,
                    rebuild_total,
                    server: s.placement.get(i).map(|(addr, _)| *addr),
                    disk: s.placement.get(i).map(|(_, disk)| disk.clone()),
                }
            })
            .collect(),
    }
}

/// Keeps an attached volume's members as its engine has them after `request` succeeded, so a
/// handover starts the next engine with the same set (the record's order: added at the end, a
/// removed one gone).
fn follow_members(info: &mut AttachInfo, request: &EngineRequest) {
    let disks = |info: &mut AttachInfo| {
        let n = info.members.len();
        let mut disks: Vec<String> = (0..n).map(|i| info.disk(i).to_owned()).collect();
        std::mem::swap(&mut info.disks, &mut disks);
    };
    match request {
        EngineRequest::AddReplica { addr, disk, node } => {
            if info.members.iter().enumerate().any(|(i, (_, a))| *a == Some(*addr) && info.disk(i) == disk) {
                return;
            }
            disks(info);
            info.members.push((node.clone(), Some(*addr)));
            info.disks.push(disk.clone());
        }
        EngineRequest::RemoveReplica { addr, disk } => {
            let Some(i) =
                info.members.iter().enumerate().position(|(i, (_, a))| *a == Some(*addr) && info.disk(i) == disk)
            else {
                return;
            };
            disks(info);
            info.members.remove(i);
            info.disks.remove(i);
        }
        _ => {}
    }
}

/// Answers one engine request.
async fn answer(volume: Arc<AttachedVolume>, request: EngineRequest) -> EngineReply {
    let done = |r: Result<(), AttachError>| match r {
        Ok(()) => EngineReply::ok(),
        // Snapshots need every replica healthy: the engine says "retry after the rebuild".
        Err(AttachError::Io { source, .. }) if source.kind() == std::io::ErrorKind::ResourceBusy => {
            EngineReply::retry(source)
        }
        Err(e) => EngineReply::error(e),
    };
    match request {
        EngineRequest::Status => EngineReply { status: Some(engine_status(&volume)), ..EngineReply::ok() },
        EngineRequest::Snapshot { name } => done(volume.snapshot(&name).await),
        EngineRequest::DeleteSnapshot { name } => done(volume.delete_snapshot(&name).await),
        EngineRequest::Expand { size } => done(volume.expand(size).await.map(|_| ())),
        EngineRequest::ReplaceReplica { index, addr, disk } => done(volume.replace_replica(index, addr, &disk).await),
        EngineRequest::AddReplica { addr, disk, node } => match volume.add_replica(addr, &disk, &node).await {
            // Still attaching: asked again shortly.
            Err(AttachError::Io { source, .. }) if source.kind() == std::io::ErrorKind::WouldBlock => {
                EngineReply::retry(source)
            }
            r => done(r.map(drop)),
        },
        EngineRequest::RemoveReplica { addr, disk } => done(volume.remove_replica(addr, &disk).await),
        EngineRequest::SetLimits { limits } => {
            volume.set_limits(limits);
            EngineReply::ok()
        }
        EngineRequest::HoldSnapshot { holder, name, hold_ms } => {
            let deadline = Duration::from_millis(hold_ms.min(MAX_HOLD_MS));
            match volume.hold_snapshot(&holder, &name, deadline).await {
                // Held by another group snapshot: this one is retried once that one let go.
                Err(AttachError::Io { source, .. }) if source.kind() == std::io::ErrorKind::WouldBlock => {
                    EngineReply::retry(source)
                }
                r => done(r),
            }
        }
        EngineRequest::ReleaseHold { holder } => {
            let held = volume.release_hold(&holder);
            EngineReply { held_us: held.map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)), ..EngineReply::ok() }
        }
    }
}

impl EngineCalls for Volumes {
    fn call(
        &self,
        volume_id: String,
        request: Vec<u8>,
    ) -> Pin<Box<dyn std::future::Future<Output = Result<Vec<u8>, Status>> + Send>> {
        let volume = self.get(&volume_id);
        let infos = self.infos.clone();
        Box::pin(async move {
            let Some(volume) = volume else { return Err(Status::NotFound) };
            let reply = match serde_json::from_slice::<EngineRequest>(&request) {
                Ok(request) => {
                    let span = tracing::info_span!("datapath.engine_call", volume.id = %volume_id, ?request);
                    let reply = tracing::Instrument::instrument(answer(volume, request.clone()), span).await;
                    if reply.ok
                        && let Some(info) = infos.lock().unwrap_or_else(PoisonError::into_inner).get_mut(&volume_id)
                    {
                        follow_members(info, &request);
                    }
                    reply
                }
                Err(e) => EngineReply::error(format!("malformed engine request: {e}")),
            };
            serde_json::to_vec(&reply).map_err(|_| Status::IoError)
        })
    }
}
