//! This node's data path: the replica server holding every replica on the node, and the engine
//! (with its frontend) of every replicated volume attached here. The node plugin keeps one; the
//! CSI node attacher attaches and detaches volumes through it, and the control plane reaches the
//! engines through the replica server's `EngineCall` (see `catalog::engine_call`), so an
//! operation on an attached volume is ordered with its I/O wherever the controller runs.
//!
//! A volume's engine reaches the replica on this node in-process (no socket), the others over
//! TCP; its persisted state lives under `engine_root/VOLUME`, kept across attaches, so a
//! re-attach after a crash resumes rebuilds instead of restarting them.
//!
//! The data path runs in the node plugin's process, or in a process of its own
//! (`wasmcsi datapath`) that serves it on a unix socket ([`socket`], [`wire`]) so that the
//! plugin can die, restart or be upgraded without an I/O error on any volume: the plugin then
//! reaches it through [`client::Engines`], the same handle either way.

pub mod client;
pub mod socket;
pub mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, UNIX_EPOCH};

use crate::attach::{AttachConfig, AttachError, AttachedVolume};
use crate::catalog::AttachInfo;
use crate::catalog::engine_call::{EngineReplica, EngineReply, EngineRequest, EngineStatus};
use crate::engine::ReplicaHealth;
use crate::protocol::Status;
use crate::replica::{EngineCalls, NodeIdentity, ReplicaNode, ReplicaServer, ServerConfig, ServerError};
use crate::volume::InProcessNode;

/// Where this node's data path keeps what, and who it is.
#[derive(Debug, Clone)]
pub struct DataPathConfig {
    pub identity: NodeIdentity,
    /// Every replica on this node, one directory each.
    pub replica_root: PathBuf,
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
}

/// The volumes attached on this node, shared by the node plugin and the replica server (which
/// answers `EngineCall`s from them).
#[derive(Default)]
struct Volumes {
    map: Mutex<HashMap<String, Arc<AttachedVolume>>>,
}

impl Volumes {
    fn get(&self, id: &str) -> Option<Arc<AttachedVolume>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner).get(id).cloned()
    }
}

/// The node's data path (see the module docs).
pub struct DataPath {
    config: DataPathConfig,
    /// Taken by [`DataPath::shutdown`]; the address and replicas stay readable after it.
    server: Mutex<Option<ReplicaServer>>,
    local_addr: SocketAddr,
    node: Arc<ReplicaNode>,
    volumes: Arc<Volumes>,
    /// One attach or detach per volume at a time (the CSI layer's guard already ensures it; this
    /// keeps the data path safe on its own).
    busy: Mutex<std::collections::HashSet<String>>,
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
}

impl DataPath {
    /// Opens this node's replicas and serves them; engines attach on demand.
    #[tracing::instrument(name = "datapath.start", skip_all, fields(node = %config.identity.node, listen = %config.listen))]
    pub async fn start(config: DataPathConfig) -> Result<Self, DataPathError> {
        let root = config.replica_root.clone();
        let node = tokio::task::spawn_blocking(move || ReplicaNode::open(&root))
            .await
            .map_err(|e| DataPathError::Root { path: config.replica_root.clone(), message: e.to_string() })?
            .map_err(|e| DataPathError::Root { path: config.replica_root.clone(), message: e.to_string() })?;
        let volumes = Arc::new(Volumes::default());
        let server_config = ServerConfig { identity: config.identity.clone(), ..ServerConfig::default() };
        let engines: Arc<dyn EngineCalls> = volumes.clone();
        let server =
            ReplicaServer::serve_with_engines(config.listen, Arc::new(node), server_config, Some(engines)).await?;
        let (local_addr, node) = (server.local_addr(), server.node().clone());
        Ok(Self { config, server: Mutex::new(Some(server)), local_addr, node, volumes, busy: Mutex::default() })
    }

    pub fn identity(&self) -> &NodeIdentity {
        &self.config.identity
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
    pub fn statuses(&self) -> Vec<(String, crate::volume::VolumeStatus)> {
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
        // A member no discovery ever found has no address: its slot never connects, the volume
        // serves degraded, and the control plane replaces it.
        let unknown = SocketAddr::from(([0, 0, 0, 0], 0));
        let replicas: Vec<SocketAddr> = info.members.iter().map(|(_, a)| a.unwrap_or(unknown)).collect();
        let local = info.members.iter().position(|(name, _)| *name == self.config.identity.node);
        let mut config =
            AttachConfig::new(
                id,
                replicas.clone(),
                self.config.engine_root.join(crate::replica::replica_dir_name(id).map_err(|e| {
                    DataPathError::Root { path: self.config.engine_root.clone(), message: e.to_string() }
                })?),
                &self.config.runtime_root,
            );
        config.local = local;
        config.epoch = info.epoch;
        config.request_timeout = self.config.request_timeout;
        config.attach_timeout = self.config.attach_timeout;
        // The engine's own replica is served in-process: the slot whose address is ours.
        config.in_process = local.map(|l| InProcessNode { addr: replicas[l], node: self.node.clone() });
        let volume = Arc::new(AttachedVolume::start(config).await?);
        self.volumes.map.lock().unwrap_or_else(PoisonError::into_inner).insert(id.to_owned(), volume.clone());
        Ok(volume)
    }

    /// Stops the engine of `id` (its device must no longer be mounted); absent succeeds.
    #[tracing::instrument(name = "datapath.detach", skip(self))]
    pub async fn detach(&self, id: &str) -> Result<(), DataPathError> {
        let _guard = self.begin(id)?;
        let Some(volume) = self.volumes.get(id) else { return Ok(()) };
        let result = volume.stop().await;
        // Stopped, or the final flush failed after a complete teardown: either way it is gone.
        if !matches!(result, Err(AttachError::InUse(_))) {
            self.volumes.map.lock().unwrap_or_else(PoisonError::into_inner).remove(id);
        }
        Ok(result?)
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

struct BusyGuard<'a> {
    path: &'a DataPath,
    id: String,
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.path.busy.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.id);
    }
}

/// An attached volume as the node plugin sees it (served by this process).
pub fn view(id: &str, attached: &AttachedVolume) -> wire::VolumeView {
    wire::VolumeView {
        volume: id.to_owned(),
        device: attached.device().to_owned(),
        pid: std::process::id(),
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
                }
            })
            .collect(),
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
        EngineRequest::ReplaceReplica { index, addr } => done(volume.replace_replica(index, addr).await),
    }
}

impl EngineCalls for Volumes {
    fn call(
        &self,
        volume_id: String,
        request: Vec<u8>,
    ) -> Pin<Box<dyn std::future::Future<Output = Result<Vec<u8>, Status>> + Send>> {
        let volume = self.get(&volume_id);
        Box::pin(async move {
            let Some(volume) = volume else { return Err(Status::NotFound) };
            let reply = match serde_json::from_slice::<EngineRequest>(&request) {
                Ok(request) => {
                    let span = tracing::info_span!("datapath.engine_call", volume.id = %volume_id, ?request);
                    tracing::Instrument::instrument(answer(volume, request), span).await
                }
                Err(e) => EngineReply::error(format!("malformed engine request: {e}")),
            };
            serde_json::to_vec(&reply).map_err(|_| Status::IoError)
        })
    }
}
