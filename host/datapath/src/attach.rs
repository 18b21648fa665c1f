//! A replicated volume attached on this node: its engine started against the volume's replicas
//! ([`ReplicatedVolume`]) and exposed to the kernel as a block device through a frontend (FUSE +
//! loop, the one this kernel has), with what an attached volume serves online (status,
//! snapshots, expansion, replica replacement) and the teardown in the only safe order. The CLI's
//! `wasmcsi volume attach` holds one in the foreground; a node plugin holds one per staged
//! volume, for as long as it likes, and calls it from its async tasks.
//!
//! ```text
//!   start:  replica servers ──size──▶ engine (ReplicatedVolume) ──▶ frontend ──▶ /dev/loopN
//!   stop:   /dev/loopN detached ─▶ FUSE server stopped ─▶ engine flushed ─▶ engine stopped
//! ```
//!
//! It formats, mounts and unmounts nothing: the filesystem on the device is the caller's, and
//! [`AttachedVolume::stop`] refuses, leaving everything attached, while one is mounted.
//! A start that fails half-way leaves nothing behind (the frontend undoes its own steps, the
//! engine is stopped). What a process killed with the volume attached leaves (the loop device,
//! the FUSE mount under the runtime directory) is not reclaimed here: the next data path's start
//! does that (`wasmcsi_frontend::fuse::reclaim_dead`).

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use wasmcsi_block::control::{self, ControlError};
use wasmcsi_block::engine::EngineConfig;
use wasmcsi_block::protocol::SnapshotInfo;
use wasmcsi_block::qos::IoLimits;
use wasmcsi_block::transport::Transport;
use wasmcsi_block::volume::{ReplicaEndpoint, ReplicatedVolume, VolumeConfig, VolumeError, VolumeGrant, VolumeStatus};
use wasmcsi_frontend::{Attached, BlockDevice, Frontend, FrontendError, FuseLoopFrontend};

/// Engine settings of an attached volume.
const REGION_SIZE: u64 = 1 << 20;
const ENGINE_REQUEST_TIMEOUT_MS: u64 = 5_000;
const ENGINE_ATTACH_TIMEOUT_MS: u64 = 10_000;
const REBUILD_PARALLELISM: usize = 4;
/// How often `start` looks at the engine's status while it attaches.
const ATTACH_POLL: Duration = Duration::from_millis(5);

/// What attaching a volume on this node takes.
#[derive(Debug, Clone)]
pub struct AttachConfig {
    /// Every replica must have been created with this id.
    pub volume_id: String,
    /// Where each replica is served, in the volume's replica order (those on this node are
    /// preferred for reads, reached in-process when it is this process's own node).
    pub replicas: Vec<ReplicaEndpoint>,
    /// The disk of its server holding each replica, in replica order (missing: `default`).
    pub disks: Vec<String>,
    /// Where the engine persists its state (revision, out-of-sync replicas, dirty maps); keep
    /// it across attaches of the volume on this node.
    pub state_dir: PathBuf,
    /// Where the frontend's FUSE mount lives (created if missing).
    pub runtime_dir: PathBuf,
    /// Deadline of each request to a replica server while attaching (the size query).
    pub request_timeout: Duration,
    /// How long the engine may take to attach to a healthy replica.
    pub attach_timeout: Duration,
    /// The epoch the engine claims on every replica (from the volume's record); 0 for a volume
    /// driven by hand, which claims nothing.
    pub epoch: u64,
    /// How the engine reaches replica servers (see `VolumeConfig::transport`).
    pub transport: Transport,
    /// The node each replica's server must be over TLS, in replica order.
    pub nodes: Vec<Option<String>>,
    /// The grant the engine presents when it runs as a node over TLS.
    pub grant: Option<Arc<VolumeGrant>>,
    /// The I/O limits the engine applies from its first request (the record's).
    pub limits: IoLimits,
}

impl AttachConfig {
    /// A configuration with default timing (10 s per request, 30 s to attach).
    pub fn new(
        volume_id: impl Into<String>,
        replicas: Vec<ReplicaEndpoint>,
        state_dir: impl Into<PathBuf>,
        runtime_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            volume_id: volume_id.into(),
            replicas,
            state_dir: state_dir.into(),
            runtime_dir: runtime_dir.into(),
            request_timeout: Duration::from_secs(10),
            attach_timeout: Duration::from_secs(30),
            epoch: 0,
            transport: Transport::Plain,
            nodes: Vec::new(),
            disks: Vec::new(),
            grant: None,
            limits: IoLimits::UNLIMITED,
        }
    }
}

/// An attached volume's state, as shown to operators (and sent over the CLI's control socket).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachStatus {
    /// The kernel block device, e.g. `/dev/loop3`.
    pub device: PathBuf,
    pub size: u64,
    pub replicas: usize,
    /// Replicas that serve reads and count for acknowledgments.
    pub healthy: usize,
    /// Replicas with an open connection (healthy or not).
    pub connected: usize,
    pub revision: u64,
    pub rebuilds_finished: u64,
    /// The rebuild in progress, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<RebuildProgress>,
}

/// A running rebuild: target replica index, kind and phase, bytes done and total.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebuildProgress {
    pub replica: usize,
    /// e.g. `delta (copying)`.
    pub kind: String,
    pub done: u64,
    pub total: u64,
}

/// `2/2 healthy, 2 connected, 1 rebuilds finished, revision 7`, and ` (degraded)` when a replica
/// is not healthy.
impl fmt::Display for AttachStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&summary(self.healthy, self.replicas, self.connected, self.rebuilds_finished, self.revision))
    }
}

fn summary(healthy: usize, replicas: usize, connected: usize, rebuilds_finished: u64, revision: u64) -> String {
    format!(
        "{healthy}/{replicas} healthy, {connected} connected, {rebuilds_finished} rebuilds finished, revision \
         {revision}{}",
        if healthy < replicas { " (degraded)" } else { "" }
    )
}

/// Why attaching, an online operation or the teardown failed. Each case names the volume.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// The configuration cannot describe a volume (no replica, two replicas on this node).
    #[error("volume {volume_id}: {message}")]
    Invalid { volume_id: String, message: String },
    /// No replica server answered with a replica of the volume.
    #[error("no replica server of {replicas:?} holds volume {volume_id}")]
    NoReplica { volume_id: String, replicas: Vec<SocketAddr>, errors: Vec<ControlError> },
    /// The engine could not start (its state directory, a corrupt state file).
    #[error("starting the engine of volume {volume_id}: {source}")]
    Engine {
        volume_id: String,
        #[source]
        source: VolumeError,
    },
    /// The engine reached no healthy replica in time; it was stopped again.
    #[error("the engine did not attach to any replica within {}s: {status}", timeout.as_secs())]
    NotAttached { volume_id: String, timeout: Duration, status: String },
    /// The frontend failed; what it did of the attach or detach is undone or still named here.
    #[error("volume {volume_id} through FUSE + loop: {source}")]
    Frontend {
        volume_id: String,
        #[source]
        source: FrontendError,
    },
    /// A filesystem on the device is still mounted: nothing was torn down.
    #[error(transparent)]
    InUse(FrontendError),
    /// An online operation failed in the engine.
    #[error("{op} of volume {volume_id}: {source}")]
    Io {
        volume_id: String,
        op: &'static str,
        #[source]
        source: io::Error,
    },
    /// The volume grew, but the kernel device did not take on the new size.
    #[error("the volume grew, but the device did not: {source}")]
    DeviceSize {
        volume_id: String,
        #[source]
        source: FrontendError,
    },
    /// The teardown finished, but the final flush failed: writes acknowledged before it are on
    /// every replica, not necessarily on their disks; the replicas resync the regions that were
    /// in flight at the next attach.
    #[error("final flush of volume {volume_id} failed: {source}")]
    Flush {
        volume_id: String,
        #[source]
        source: io::Error,
    },
    /// The volume was stopped.
    #[error("volume {0} is detached")]
    Stopped(String),
    /// A replica refused the engine's epoch: the volume was given to another node.
    #[error("volume {volume_id} was given to another node: its replicas refused this engine's epoch")]
    Fenced { volume_id: String },
    /// A blocking step's task did not finish (the runtime is shutting down).
    #[error("volume {volume_id}: {what} task failed: {message}")]
    Task { volume_id: String, what: &'static str, message: String },
}

/// A replicated volume attached on this node. Cheap to share: clone the `Arc` it is kept in.
/// Its operations are `async` and run their blocking parts on the runtime's blocking pool,
/// so they are called from async tasks (a multi-threaded runtime: the engine's driver runs on
/// it too). Dropping it without [`Self::stop`] tears down best-effort, without the final flush,
/// and blocks while it does.
pub struct AttachedVolume {
    inner: Arc<Inner>,
}

struct Inner {
    volume_id: String,
    device: PathBuf,
    volume: Arc<ReplicatedVolume>,
    /// `None` once stopped.
    frontend: Mutex<Option<Attached>>,
}

impl fmt::Debug for AttachedVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttachedVolume")
            .field("volume_id", &self.inner.volume_id)
            .field("device", &self.inner.device)
            .finish_non_exhaustive()
    }
}

impl Inner {
    fn frontend(&self) -> MutexGuard<'_, Option<Attached>> {
        self.frontend.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn check_attached(&self) -> Result<(), AttachError> {
        if self.frontend().is_none() { Err(AttachError::Stopped(self.volume_id.clone())) } else { Ok(()) }
    }

    fn io(&self, op: &'static str) -> impl FnOnce(io::Error) -> AttachError + '_ {
        move |source| AttachError::Io { volume_id: self.volume_id.clone(), op, source }
    }
}

impl AttachedVolume {
    /// Starts the engine against the replicas, waits until it serves from a healthy replica,
    /// and exposes it as a block device. The size comes from the replica servers (it changes
    /// with online expansion). On any failure nothing of the attempt is left running.
    #[tracing::instrument(name = "block.attach", skip_all, fields(volume.id = %config.volume_id))]
    pub async fn start(config: AttachConfig) -> Result<Self, AttachError> {
        let volume_id = config.volume_id.clone();
        let invalid = |message: String| AttachError::Invalid { volume_id: volume_id.clone(), message };
        let n = config.replicas.len();
        if n == 0 {
            return Err(invalid("a volume needs at least one replica".into()));
        }
        // Several replicas may live on one node (this one too), each on its own disk; two on
        // one disk of one server would be one replica counted twice.
        let disk = |i: usize| config.disks.get(i).map_or(wasmcsi_block::protocol::DEFAULT_DISK, String::as_str);
        let known = |i: usize| config.replicas[i].addr().port() != 0;
        for second in (1..n).filter(|j| known(*j)) {
            let addr = config.replicas[second].addr();
            if let Some(first) = (0..second).find(|i| config.replicas[*i].addr() == addr && disk(*i) == disk(second)) {
                return Err(invalid(format!(
                    "replicas {first} and {second} are both disk {} of {addr}: one replica counted twice",
                    disk(second)
                )));
            }
        }
        let size = replica_size(&config).await?;
        let volume = start_engine(&config, size, Duration::ZERO).await?;
        let (dev, runtime_dir, name) = (volume.clone(), config.runtime_dir.clone(), volume_id.clone());
        let attached = Self::serve(volume_id, volume, "frontend attach", move || {
            FuseLoopFrontend::new(&runtime_dir).attach(dev, &name)
        })
        .await?;
        tracing::debug!(device = %attached.inner.device.display(), size, "volume attached");
        Ok(attached)
    }

    /// Serves, in this process, a volume suspended by [`Self::suspend`] (in this process, or in
    /// the process image before an `execve`): starts its engine from its persisted state,
    /// clean after the suspend's flush, and serves the FUSE connection `suspended.session`
    /// again, with the mount and loop device the kernel already has. Requests the kernel queued
    /// meanwhile are answered now; nothing is formatted, mounted or attached anew. On failure the
    /// connection is dropped: its mount answers ENOTCONN, its loop device fails I/O, as after a
    /// crash of the data path.
    #[tracing::instrument(name = "block.adopt", skip_all, fields(volume.id = %config.volume_id))]
    pub async fn adopt(config: AttachConfig, suspended: SuspendedVolume) -> Result<Self, AttachError> {
        let volume_id = config.volume_id.clone();
        if suspended.volume_id != volume_id {
            return Err(AttachError::Invalid {
                volume_id,
                message: format!("the suspended volume is {}", suspended.volume_id),
            });
        }
        let volume = start_engine(&config, suspended.size, ADOPT_ALL_HEALTHY).await?;
        let (dev, runtime_dir, name) = (volume.clone(), config.runtime_dir.clone(), volume_id.clone());
        let SuspendedVolume { session, mount, device, .. } = suspended;
        let adopted = Self::serve(volume_id, volume, "frontend adopt", move || {
            FuseLoopFrontend::new(&runtime_dir).adopt(dev, &name, session, &mount, &device)
        })
        .await?;
        tracing::info!(device = %adopted.inner.device.display(), "volume adopted");
        Ok(adopted)
    }

    /// Serves the started engine `volume` through the frontend `frontend` sets up (blocking:
    /// FUSE mount, loop device) on the blocking pool. The frontend undoes its own steps on
    /// failure; the engine is shut down here, so a failed attach or adopt leaves nothing running.
    async fn serve(
        volume_id: String,
        volume: Arc<ReplicatedVolume>,
        what: &'static str,
        frontend: impl FnOnce() -> Result<Attached, FrontendError> + Send + 'static,
    ) -> Result<Self, AttachError> {
        let attached = match tokio::task::spawn_blocking(frontend).await {
            Ok(Ok(attached)) => attached,
            Ok(Err(source)) => {
                volume.shutdown();
                return Err(AttachError::Frontend { volume_id, source });
            }
            Err(e) => {
                volume.shutdown();
                return Err(AttachError::Task { volume_id, what, message: e.to_string() });
            }
        };
        let device = attached.device().to_path_buf();
        Ok(Self { inner: Arc::new(Inner { volume_id, device, volume, frontend: Mutex::new(Some(attached)) }) })
    }

    /// Stops serving the volume for a handover, leaving everything the kernel sees in place (the
    /// FUSE mount, the loop device, a filesystem mounted on it): the FUSE server stops at a
    /// request boundary with every request it read answered, the engine flushes to every
    /// replica's disk (their dirty flags clear: the next engine starts clean) and stops. The
    /// kernel's new requests wait, unanswered, for [`Self::adopt`] here or in a new process
    /// image. This handle is stopped afterwards (operations answer [`AttachError::Stopped`]).
    #[tracing::instrument(name = "block.suspend", skip_all, fields(volume.id = %self.inner.volume_id))]
    pub async fn suspend(&self) -> Result<SuspendedVolume, AttachError> {
        let inner = self.inner.clone();
        run_blocking(&self.inner.volume_id, "suspend", move || inner.suspend()).await
    }

    pub fn volume_id(&self) -> &str {
        &self.inner.volume_id
    }

    /// The kernel block device node, e.g. `/dev/loop3`.
    pub fn device(&self) -> &Path {
        &self.inner.device
    }

    /// The engine's latest status (does not block).
    pub fn status(&self) -> AttachStatus {
        let volume = &self.inner.volume;
        let s = volume.status();
        AttachStatus {
            device: self.inner.device.clone(),
            size: volume.size(),
            replicas: volume.replica_count(),
            healthy: s.healthy,
            connected: s.connected,
            revision: s.revision,
            rebuilds_finished: s.rebuilds_finished,
            rebuild: s.rebuild.as_ref().map(|r| RebuildProgress {
                replica: r.replica,
                kind: format!("{:?} ({:?})", r.kind, r.phase).to_lowercase(),
                done: r.done.saturating_mul(r.region_size),
                total: r.total.saturating_mul(r.region_size),
            }),
        }
    }

    /// The engine's own status: every replica's health, a running rebuild, whether it is fenced.
    pub fn engine_status(&self) -> VolumeStatus {
        self.inner.volume.status()
    }

    /// The volume's snapshots, oldest first, as the engine last knew them.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.inner.volume.snapshots()
    }

    /// Takes a crash-consistent snapshot on every replica, ordered with the I/O in flight;
    /// idempotent for an existing name. Needs every replica healthy.
    pub async fn snapshot(&self, name: &str) -> Result<(), AttachError> {
        let name = name.to_owned();
        self.blocking("snapshot", move |inner| inner.volume.snapshot(&name).map_err(inner.io("snapshot"))).await
    }

    /// A group snapshot's part on this volume: holds its writes for `holder` and takes snapshot
    /// `name` on every replica; the hold ends at [`Self::release_hold`] or after `deadline`.
    pub async fn hold_snapshot(&self, holder: &str, name: &str, deadline: Duration) -> Result<(), AttachError> {
        let (holder, name) = (holder.to_owned(), name.to_owned());
        self.blocking("hold and snapshot", move |inner| {
            inner.volume.hold_snapshot(&holder, &name, deadline).map_err(inner.io("hold and snapshot"))
        })
        .await
    }

    /// Ends `holder`'s hold; how long it held (`None`: it held none, e.g. its deadline passed).
    pub fn release_hold(&self, holder: &str) -> Option<Duration> {
        self.inner.volume.release_hold(holder)
    }

    /// Deletes a snapshot on every replica; a name that does not exist succeeds.
    pub async fn delete_snapshot(&self, name: &str) -> Result<(), AttachError> {
        let name = name.to_owned();
        self.blocking("delete snapshot", move |inner| {
            inner.volume.delete_snapshot(&name).map_err(inner.io("delete snapshot"))
        })
        .await
    }

    /// Grows the volume online to `size` bytes on every replica, then the kernel device; returns
    /// the size the device has now. The filesystem on it is the caller's to grow.
    pub async fn expand(&self, size: u64) -> Result<u64, AttachError> {
        self.blocking("expand", move |inner| {
            inner.volume.resize(size).map_err(inner.io("expand"))?;
            let frontend = inner.frontend();
            let attached = frontend.as_ref().ok_or_else(|| AttachError::Stopped(inner.volume_id.clone()))?;
            attached
                .refresh_size()
                .map_err(|source| AttachError::DeviceSize { volume_id: inner.volume_id.clone(), source })
        })
        .await
    }

    /// Applies `limits` to the volume's reads and writes from now on.
    pub fn set_limits(&self, limits: IoLimits) {
        self.inner.volume.set_limits(limits);
    }

    /// The I/O limits applied now.
    pub fn limits(&self) -> IoLimits {
        self.inner.volume.limits()
    }

    /// Moves replica `index` to a new, empty replica on the disk `disk` of the server at `addr`
    /// (created there first); it is fully rebuilt while I/O goes on.
    pub async fn replace_replica(&self, index: usize, addr: SocketAddr, disk: &str) -> Result<(), AttachError> {
        let disk = disk.to_owned();
        self.blocking("replace replica", move |inner| {
            inner.volume.replace_replica(index, addr, &disk).map_err(inner.io("replace replica"))
        })
        .await
    }

    /// Adds a new, empty replica on disk `disk` of the server at `addr` (the node `node`, created
    /// there first) as the set's last; it is fully rebuilt while I/O goes on. Returns its index.
    pub async fn add_replica(&self, addr: SocketAddr, disk: &str, node: &str) -> Result<usize, AttachError> {
        let (disk, node) = (disk.to_owned(), node.to_owned());
        self.blocking("add replica", move |inner| {
            inner.volume.add_replica(addr, &disk, Some(&node)).map_err(inner.io("add replica"))
        })
        .await
    }

    /// Removes the set's replica on disk `disk` of the server at `addr`: the engine stops using
    /// it at once (the caller deletes it). None there: success. Refused for the last healthy one.
    pub async fn remove_replica(&self, addr: SocketAddr, disk: &str) -> Result<(), AttachError> {
        let disk = disk.to_owned();
        self.blocking("remove replica", move |inner| {
            inner.volume.remove_replica(addr, &disk).map_err(inner.io("remove replica"))
        })
        .await
    }

    /// Detaches in the only safe order: the loop device (refused with [`AttachError::InUse`],
    /// leaving everything attached, while a filesystem on it is mounted), then the FUSE server;
    /// then the engine flushes what was written to every replica's disk, so their dirty flags
    /// clear and the next attach starts clean, and stops. Stopping a stopped volume succeeds.
    /// [`AttachError::Flush`] comes after a complete teardown.
    #[tracing::instrument(name = "block.detach", skip_all, fields(volume.id = %self.inner.volume_id))]
    pub async fn stop(&self) -> Result<(), AttachError> {
        let inner = self.inner.clone();
        run_blocking(&self.inner.volume_id, "detach", move || inner.stop()).await
    }

    /// Leaves the volume as a crash of this process leaves it, at once: the frontend's teardown
    /// is forgotten (the FUSE mount, the loop device and a filesystem mounted on it stay), and
    /// nothing is flushed or detached; the engine keeps serving until the process exits, after
    /// which the device fails I/O until the volume is unstaged. What stays is reclaimed by the
    /// next data path's start (`wasmcsi_frontend::fuse::reclaim_dead`) and the unstage.
    pub fn abandon(&self) {
        if let Some(attached) = self.inner.frontend().take() {
            attached.release();
        }
    }

    /// Runs `f` on the blocking pool (the engine's calls block until the replicas answered),
    /// unless the volume is stopped.
    async fn blocking<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&Inner) -> Result<T, AttachError> + Send + 'static,
    ) -> Result<T, AttachError> {
        self.inner.check_attached()?;
        let inner = self.inner.clone();
        run_blocking(&self.inner.volume_id, what, move || f(&inner)).await
    }
}

impl Inner {
    fn stop(&self) -> Result<(), AttachError> {
        let mut frontend = self.frontend();
        let Some(attached) = frontend.as_mut() else { return Ok(()) };
        match attached.detach() {
            Ok(()) => {}
            Err(e @ FrontendError::InUse { .. }) => return Err(AttachError::InUse(e)),
            Err(source) => return Err(AttachError::Frontend { volume_id: self.volume_id.clone(), source }),
        }
        *frontend = None;
        drop(frontend);
        let flushed = self.volume.flush();
        // A fenced engine cannot flush (every replica refuses it), and has nothing to flush that
        // counts: the volume was given to another node, whose engine the replicas follow. Its
        // teardown is complete, so detaching it succeeds; kubelet must be able to unstage it.
        let fenced = self.volume.status().fenced;
        self.shut_down_engine();
        tracing::debug!(device = %self.device.display(), "volume detached");
        match flushed {
            Err(e) if fenced => {
                tracing::warn!(error = %e, "detached a fenced volume: its unflushed writes were the old owner's");
                Ok(())
            }
            other => other.map_err(|source| AttachError::Flush { volume_id: self.volume_id.clone(), source }),
        }
    }
}

impl Inner {
    fn suspend(&self) -> Result<SuspendedVolume, AttachError> {
        let frontend_error = |source| AttachError::Frontend { volume_id: self.volume_id.clone(), source };
        let mut frontend = self.frontend();
        let attached = frontend.as_mut().ok_or_else(|| AttachError::Stopped(self.volume_id.clone()))?;
        let suspended_at = std::time::SystemTime::now();
        attached.suspend().map_err(frontend_error)?;
        let kept = || -> Result<SuspendedVolume, FrontendError> {
            let fd = attached.session_fd().ok_or_else(|| FrontendError::Invalid("no FUSE session".into()))?;
            let session = fd.try_clone_to_owned().map_err(|e| FrontendError::io("duplicating the FUSE session", e))?;
            let mount = attached.mount_point().ok_or_else(|| FrontendError::Invalid("no FUSE mount".into()))?;
            Ok(SuspendedVolume {
                volume_id: self.volume_id.clone(),
                size: self.volume.size(),
                session,
                mount: mount.to_owned(),
                device: self.device.clone(),
                suspended_at,
            })
        };
        let suspended = match kept() {
            Ok(s) => s,
            Err(e) => {
                // Nothing was handed anywhere: serve on.
                if let Err(r) = attached.resume() {
                    tracing::error!(error = %r, "resuming a volume whose suspend failed");
                }
                return Err(frontend_error(e));
            }
        };
        // From here the suspended volume is the only owner of what the kernel sees: the handle
        // forgets its teardown (no unmount, no loop detach, no FUSE abort).
        if let Some(attached) = frontend.take() {
            attached.release();
        }
        drop(frontend);
        if let Err(e) = self.volume.flush() {
            // The next engine resyncs what was in flight, as after a crash: still no I/O error.
            tracing::warn!(error = %e, "the flush before a handover failed");
        }
        self.shut_down_engine();
        Ok(suspended)
    }

    /// Stops the engine and waits (at most [`STOP_WAIT`]) until its driver let go of its
    /// replica links. Its sessions must end (cleanly: the flush was the last request) before
    /// the next engine says hello, or a replica still counting this one shows itself dirty to
    /// the next and costs a resync; and an in-process link holds the node's replica root, which
    /// a data path started after this one's shutdown must be able to open.
    fn shut_down_engine(&self) {
        self.volume.shutdown();
        let deadline = Instant::now() + STOP_WAIT;
        while !self.volume.is_stopped() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        if !self.volume.is_stopped() {
            tracing::warn!(wait = ?STOP_WAIT, "the stopped engine still holds its replica links");
        }
    }
}

impl Drop for Inner {
    /// The last handle went without `stop`: the frontend's own drop tears it down unless a
    /// filesystem is still mounted on the device, in which case the FUSE server keeps the
    /// engine serving (it holds the volume) until the process ends; otherwise the engine stops.
    fn drop(&mut self) {
        let Some(mut attached) = self.frontend().take() else { return };
        if attached.detach().is_ok() {
            self.volume.shutdown();
        }
    }
}

/// A volume between two engines (see [`AttachedVolume::suspend`]): the kernel's side of it is
/// intact and waits; this holds the FUSE connection that serves it.
#[derive(Debug)]
pub struct SuspendedVolume {
    pub volume_id: String,
    pub size: u64,
    /// The FUSE connection (the fd its mount was made with).
    pub session: std::os::fd::OwnedFd,
    pub mount: PathBuf,
    pub device: PathBuf,
    /// When its I/O stopped being answered: the start of the pause.
    pub suspended_at: std::time::SystemTime,
}

/// How long a suspend waits for the stopped engine to close its replica sessions.
const STOP_WAIT: Duration = Duration::from_secs(2);

/// How long an adopting engine waits for every replica before serving with fewer: a replica
/// that joins after I/O resumed needs a rebuild, one that joins before does not.
const ADOPT_ALL_HEALTHY: Duration = Duration::from_secs(2);

/// Starts the engine of a volume of `size` bytes and waits until it serves from a healthy
/// replica, and up to `all_healthy` longer for every replica to be healthy.
async fn start_engine(
    config: &AttachConfig,
    size: u64,
    all_healthy: Duration,
) -> Result<Arc<ReplicatedVolume>, AttachError> {
    let volume_id = config.volume_id.clone();
    let n = config.replicas.len();
    std::fs::create_dir_all(&config.runtime_dir).map_err(|source| AttachError::Frontend {
        volume_id: volume_id.clone(),
        source: FrontendError::Io { context: format!("creating {}", config.runtime_dir.display()), source },
    })?;
    let engine = EngineConfig {
        volume_id: volume_id.clone(),
        size,
        region_size: REGION_SIZE,
        request_timeout: ENGINE_REQUEST_TIMEOUT_MS,
        attach_timeout: ENGINE_ATTACH_TIMEOUT_MS,
        rebuild_parallelism: REBUILD_PARALLELISM,
        epoch: config.epoch,
    };
    let mut driver = VolumeConfig::new(engine, config.replicas.clone(), &config.state_dir);
    driver.transport = config.transport.clone();
    driver.nodes = config.nodes.clone();
    driver.disks = config.disks.clone();
    driver.grant = config.grant.clone();
    let volume = ReplicatedVolume::start(driver, &tokio::runtime::Handle::current())
        .map_err(|source| AttachError::Engine { volume_id: volume_id.clone(), source })?;
    // Before the frontend exists: no request of the workload runs unlimited.
    volume.set_limits(config.limits);
    let volume = Arc::new(volume);

    let deadline = Instant::now() + config.attach_timeout;
    let mut serving_since: Option<Instant> = None;
    loop {
        let s = volume.status();
        if s.fenced {
            volume.shutdown();
            return Err(AttachError::Fenced { volume_id });
        }
        if s.attached && s.healthy >= 1 {
            let since = *serving_since.get_or_insert_with(Instant::now);
            if s.healthy >= n || since.elapsed() >= all_healthy {
                break;
            }
        }
        if Instant::now() >= deadline {
            volume.shutdown();
            return Err(AttachError::NotAttached {
                volume_id,
                timeout: config.attach_timeout,
                status: describe(&s, n),
            });
        }
        tokio::time::sleep(ATTACH_POLL).await;
    }
    Ok(volume)
}

async fn run_blocking<T: Send + 'static>(
    volume_id: &str,
    what: &'static str,
    f: impl FnOnce() -> Result<T, AttachError> + Send + 'static,
) -> Result<T, AttachError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| AttachError::Task {
        volume_id: volume_id.to_owned(),
        what,
        message: e.to_string(),
    })?
}

/// The volume's size as its replicas report it: the largest, since a replica that missed an
/// expansion is grown by the engine when it attaches.
async fn replica_size(config: &AttachConfig) -> Result<u64, AttachError> {
    let mut size = None;
    let mut errors = Vec::new();
    let addrs: Vec<SocketAddr> = config.replicas.iter().map(ReplicaEndpoint::addr).collect();
    let reach = control::Reach::any_node(config.transport.clone());
    for info in control::list_nodes_over(&addrs, config.request_timeout, &reach).await {
        match info {
            Ok(info) => {
                if let Some(r) = info.replicas.iter().find(|r| r.volume_id == config.volume_id) {
                    size = size.max(Some(r.size));
                }
            }
            Err(e) => errors.push(e),
        }
    }
    size.ok_or_else(|| AttachError::NoReplica { volume_id: config.volume_id.clone(), replicas: addrs, errors })
}

fn describe(s: &VolumeStatus, replicas: usize) -> String {
    summary(s.healthy, replicas, s.connected, s.rebuilds_finished, s.revision)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_degraded_when_a_replica_is_not_healthy() {
        let mut s = AttachStatus { replicas: 2, healthy: 2, connected: 2, revision: 7, ..Default::default() };
        assert_eq!(s.to_string(), "2/2 healthy, 2 connected, 0 rebuilds finished, revision 7");
        s.healthy = 1;
        s.rebuilds_finished = 1;
        assert_eq!(s.to_string(), "1/2 healthy, 2 connected, 1 rebuilds finished, revision 7 (degraded)");
    }

    #[tokio::test]
    async fn a_config_that_names_no_volume_is_refused_before_any_traffic() {
        let dir = std::env::temp_dir();
        let none = AttachConfig::new("pvc-1", vec![], &dir, &dir);
        assert!(matches!(AttachedVolume::start(none).await, Err(AttachError::Invalid { .. })));
        let (a, b): (SocketAddr, SocketAddr) =
            ("127.0.0.1:9".parse().expect("address"), "127.0.0.2:9".parse().expect("address"));
        // Two replicas on one disk of one server: one replica counted twice. (Two on distinct
        // disks of one server are two replicas; the disk of the third says which.)
        let endpoints = vec![ReplicaEndpoint::Local(a), ReplicaEndpoint::Remote(b), ReplicaEndpoint::Remote(b)];
        let mut twice = AttachConfig::new("pvc-1", endpoints, &dir, &dir);
        twice.disks = vec!["default".into(), "ssd".into(), "ssd".into()];
        let err = AttachedVolume::start(twice).await.expect_err("refused");
        assert!(err.to_string().contains("replicas 1 and 2 are both disk ssd of 127.0.0.2:9"), "{err}");
    }

    #[tokio::test]
    async fn a_volume_no_server_holds_is_not_attached() {
        // A port nothing listens on: the server does not answer, so nobody holds the volume.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        drop(listener);
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = AttachConfig::new(
            "pvc-1",
            vec![ReplicaEndpoint::Remote(addr)],
            dir.path().join("state"),
            dir.path().join("run"),
        );
        config.request_timeout = Duration::from_millis(500);
        let err = AttachedVolume::start(config).await.expect_err("nobody holds it");
        assert!(matches!(&err, AttachError::NoReplica { errors, .. } if errors.len() == 1), "{err:?}");
        assert!(!dir.path().join("state").exists(), "no engine was started");
    }
}
