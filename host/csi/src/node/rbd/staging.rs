//! The staging of RBD images on this node ([`RbdNode`]), the bulk of the rbd attacher: NodeStage
//! maps exactly the planned image — with the kernel (krbd) where it maps RBD, else with one
//! `rbd-fuse` and a loop device on the image file — and then either formats (only when blank)
//! and mounts it at the staging path, or — for `volumeMode: Block` — keeps the device as the
//! staged device that NodePublish bind-mounts onto the target file.
//!
//! **State.** Each staged volume owns a directory `<state>/rbd/<volume id>/` (0700): rbd-fuse's
//! mount point and private directory (conf, keyring, log), `state.json` (what is attached:
//! rbd-fuse's pid and mount, the loop device, whether the fence may be held) and `credentials`
//! (0600; NodeUnstageVolume carries no secrets, yet must release the fence). The state file is
//! written before each step that creates something, so whatever a crash leaves behind is named
//! there; a retried stage finds the volume healthy (live rbd-fuse, loop device backed by its
//! file, mount of that loop device at the staging path) and does nothing, or finds it broken
//! and rebuilds the local parts.
//!
//! **Who runs rbd-fuse.** Where the plugin has a data path (the node's `wasmcsi datapath`, or
//! the one in its own process: the same condition replicated volumes use), the data path runs
//! it ([`wasmcsi_datapath::rbd_fuse`]) and the plugin only asks: for the image's file at
//! stage, whether it still runs, and to stop it at unstage. In a pod a restart of the plugin's
//! container kills every process in it, so only a daemon outside it keeps the loop device and
//! the filesystem above it served. Without a data path (`serve` with neither replicas nor
//! `--datapath-socket`, and tests that build the attachers alone) the plugin spawns rbd-fuse
//! itself, as its own process group's member that outlives the plugin's process but not its
//! container; a restarted plugin finds it through the state file.
//!
//! **Fencing (RWO).** Before anything is attached the node takes the image's fence
//! ([`wasmcsi_rbd::fence`]: an exclusive RADOS lock with the node id as cookie on the image
//! header); another node's stage is refused with FAILED_PRECONDITION until unstage released
//! it. Taken by this node already (a retry, a restarted plugin) counts as held.
//!
//! **Teardown** runs in the only safe order — filesystem unmount, loop detach (and wait until
//! the kernel let go of the file), rbd-fuse teardown, fence release — and every step is
//! bounded: an unmount that hangs on a dead cluster gets the FUSE connection aborted under it,
//! which fails the pending I/O instead of waiting forever. Each step tolerates its object
//! being gone already (rbd-fuse killed, loop device autocleared, mount removed by hand).
//!
//! Long (~780 lines) because its unit tests live beside it; the code itself is ~730 lines of one
//! flow (stage, the health check a retry makes, unstage) that reads best in one place.
use std::collections::HashMap;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use wasmcsi_datapath::client::{Engines, EnginesError};
use wasmcsi_datapath::rbd_fuse::{CephKey, RbdFuseSpec};
use wasmcsi_frontend::loop_dev::{self, LoopOptions};
use wasmcsi_rbd::fuse_attach::{self, FuseAttachRequest, FuseRecord};
use wasmcsi_rbd::krbd::{self, KrbdRecord, KrbdRequest};
use wasmcsi_rbd::{RbdClient, RbdCluster, RbdConfig, RbdCredentials, RbdError, RbdPool};

use crate::error::{CsiError, CsiResult};
use crate::node::filesystem::{self, Filesystem, PATIENCE, io_err, write_atomically};
use wasmcsi_mountinfo as mountinfo;

const STATE_FILE: &str = "state.json";
const CREDENTIALS_FILE: &str = "credentials";
/// Bound on rbd-fuse's start and on each of its teardown steps.
const FUSE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long NodeExpandVolume waits for rbd-fuse to show the grown image (its attribute cache
/// lives a second; librbd learns the new size from the header watch).
const GROW_WAIT: Duration = Duration::from_secs(15);

/// How the volume is staged.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StagedAs {
    /// Mounted at the staging path. `fs_type` is what is on the image (what was asked for when
    /// it was blank).
    Filesystem { fs_type: String, mount_flags: Vec<String> },
    /// The loop device is the staged device.
    Block,
}

/// `state.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RbdState {
    pub volume_id: String,
    pub cluster: String,
    pub monitors: Vec<String>,
    pub pool: String,
    pub image: String,
    pub staging_path: PathBuf,
    pub staged_as: StagedAs,
    pub read_only: bool,
    /// Set before the fence is taken, cleared once it is released.
    pub fenced: bool,
    pub fuse: Option<FuseRecord>,
    pub loop_device: Option<PathBuf>,
    /// The kernel mapping, where the kernel maps RBD (then there is no rbd-fuse nor loop).
    #[serde(default)]
    pub krbd: Option<KrbdRecord>,
    /// Who runs `fuse` (a state written before the data path ran rbd-fuse: this plugin).
    #[serde(default)]
    pub fuse_owner: FuseOwner,
}

/// Who runs a staged volume's rbd-fuse.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FuseOwner {
    /// This plugin spawned it (it has no data path): found again by its pid record.
    #[default]
    Plugin,
    /// The node's data path runs it: asked whether it runs, and told to stop it.
    DataPath,
}

/// What NodeStageVolume asks for, resolved (monitors from the host config, credentials from
/// the request's secrets).
#[derive(Clone, Debug)]
pub struct StageRequest {
    pub volume_id: String,
    pub cluster: String,
    pub monitors: Vec<String>,
    pub pool: String,
    pub image: String,
    pub creds: RbdCredentials,
    pub staging_path: PathBuf,
    /// `Filesystem.fs_type` empty means ext4 (or whatever the image already holds).
    pub staged_as: StagedAs,
    pub read_only: bool,
}

#[derive(Serialize, Deserialize)]
struct StoredCredentials {
    user: String,
    key: String,
}

/// Cluster name, its monitors, pool.
type ClientKey = (String, Vec<String>, String);

/// The node's RBD executor: where volume state lives, and one librados client per cluster and
/// pool (connections are pooled inside it).
pub struct RbdNode {
    state_dir: PathBuf,
    clients: Mutex<HashMap<ClientKey, RbdClient>>,
    /// Whether this kernel maps RBD images (krbd); decided on the first stage.
    kernel_rbd: std::sync::OnceLock<bool>,
    /// The node's data path, which runs rbd-fuse when there is one.
    datapath: Option<Engines>,
}

impl std::fmt::Debug for RbdNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdNode").field("state_dir", &self.state_dir).finish_non_exhaustive()
    }
}

fn rbd_err(e: RbdError) -> CsiError {
    match e {
        RbdError::NotFound(m) => CsiError::NotFound(m),
        RbdError::FailedPrecondition(m) => CsiError::FailedPrecondition(m),
        RbdError::InvalidArgument(m) => CsiError::Invalid(m),
        RbdError::Unavailable { .. } => CsiError::Unavailable(e.to_string()),
        RbdError::PermissionDenied(m) => CsiError::FailedPrecondition(format!("the cluster refused: {m}")),
        other => CsiError::Rbd(other),
    }
}

/// A data-path failure as the CSI call's error: a concurrent call for the volume is retried by
/// the CO (ABORTED), everything else is UNAVAILABLE (the data path may come back).
fn datapath_err(e: EnginesError) -> CsiError {
    match e {
        EnginesError::Busy(m) => CsiError::InProgress(m),
        other => CsiError::Unavailable(format!("the data path's rbd-fuse: {other}")),
    }
}

/// Runs a data-path call from a blocking task (the stage and teardown steps run on one).
fn block_on<T>(f: impl std::future::Future<Output = Result<T, EnginesError>>) -> CsiResult<T> {
    let handle = tokio::runtime::Handle::try_current()
        .map_err(|e| CsiError::Internal(format!("a data-path call outside the runtime: {e}")))?;
    handle.block_on(f).map_err(datapath_err)
}

impl RbdState {
    /// Everything attached and alive: rbd-fuse runs (`fuse_alive`, which its owner says), the
    /// loop device is backed by its file, and (filesystem) that loop device is mounted at the
    /// staging path.
    fn healthy(&self, mounts: &[mountinfo::MountEntry], fuse_alive: bool) -> bool {
        let device = if let Some(k) = &self.krbd {
            if !krbd::is_mapped(k) {
                return false;
            }
            &k.device
        } else {
            let (Some(fuse), Some(device)) = (&self.fuse, &self.loop_device) else { return false };
            if !fuse_alive || loop_dev::backing_file(device).as_deref() != Some(fuse.file.as_path()) {
                return false;
            }
            device
        };
        match self.staged_as {
            StagedAs::Block => true,
            StagedAs::Filesystem { .. } => filesystem::device_mounted_at(mounts, device, &self.staging_path),
        }
    }

    /// What differs between this staging and a request, if anything.
    fn conflict(&self, req: &StageRequest) -> Option<String> {
        let same_fs = match (&self.staged_as, &req.staged_as) {
            (StagedAs::Block, StagedAs::Block) => true,
            (
                StagedAs::Filesystem { fs_type: a, mount_flags: fa },
                StagedAs::Filesystem { fs_type: b, mount_flags: fb },
            ) => (b.is_empty() || a == b) && fa == fb,
            _ => false,
        };
        if (&self.cluster, &self.pool, &self.image) != (&req.cluster, &req.pool, &req.image) {
            Some(format!("it is staged from {}/{}/{}", self.cluster, self.pool, self.image))
        } else if self.staging_path != req.staging_path {
            Some(format!("it is staged at {}", self.staging_path.display()))
        } else if !same_fs || self.read_only != req.read_only {
            Some(format!("it is staged as {:?} (read-only {})", self.staged_as, self.read_only))
        } else {
            None
        }
    }
}

impl RbdNode {
    /// Volume state under `state_dir`; rbd-fuse run by `datapath` when there is one, else by
    /// this process.
    pub fn new(state_dir: impl Into<PathBuf>, datapath: Option<Engines>) -> Self {
        Self {
            state_dir: state_dir.into(),
            clients: Mutex::new(HashMap::new()),
            kernel_rbd: std::sync::OnceLock::new(),
            datapath,
        }
    }

    /// The data path that runs the rbd-fuse of `state`.
    fn datapath_of(&self, state: &RbdState) -> CsiResult<&Engines> {
        self.datapath.as_ref().ok_or_else(|| {
            CsiError::Unavailable(format!(
                "volume {} was staged with rbd-fuse in the node's data path, which this plugin is not given \
                 (--datapath-socket)",
                state.volume_id
            ))
        })
    }

    /// Whether the rbd-fuse of `state` runs, as its owner says: its pid (this plugin's), or the
    /// data path's answer (its pid namespace may not be ours). A data path that does not
    /// answer is an error, not "dead": a blip of it must never make a stage tear a healthy
    /// volume down.
    async fn fuse_alive(&self, state: &RbdState) -> CsiResult<bool> {
        let Some(fuse) = &state.fuse else { return Ok(false) };
        match state.fuse_owner {
            FuseOwner::Plugin => Ok(fuse_attach::is_alive(fuse)),
            FuseOwner::DataPath => {
                let view = self.datapath_of(state)?.rbd_fuse_status(&state.volume_id).await.map_err(datapath_err)?;
                Ok(view.is_some_and(|v| v.alive && v.pid == fuse.pid && v.file == fuse.file))
            }
        }
    }

    /// [`Self::fuse_alive`] from a blocking task.
    fn fuse_alive_blocking(&self, state: &RbdState) -> CsiResult<bool> {
        match state.fuse_owner {
            FuseOwner::Plugin => Ok(state.fuse.as_ref().is_some_and(fuse_attach::is_alive)),
            FuseOwner::DataPath => {
                let handle = tokio::runtime::Handle::try_current()
                    .map_err(|e| CsiError::Internal(format!("a data-path call outside the runtime: {e}")))?;
                handle.block_on(self.fuse_alive(state))
            }
        }
    }

    /// `<state>/rbd/<volume id>`; volume ids are `backend:local` of `[A-Za-z0-9._-]` (checked
    /// by the caller's routing), safe as one path component.
    pub fn volume_dir(&self, volume_id: &str) -> PathBuf {
        self.state_dir.join("rbd").join(volume_id)
    }

    fn pool(&self, cluster: &str, monitors: &[String], pool: &str, creds: &RbdCredentials) -> CsiResult<RbdPool> {
        let key = (cluster.to_owned(), monitors.to_vec(), pool.to_owned());
        let client = {
            let mut clients = self.clients.lock().unwrap_or_else(PoisonError::into_inner);
            clients
                .entry(key)
                .or_insert_with(|| {
                    RbdClient::new(RbdConfig::new(vec![RbdCluster {
                        name: cluster.to_owned(),
                        monitors: monitors.to_vec(),
                        pools: vec![pool.to_owned()],
                    }]))
                })
                .clone()
        };
        client.pool(cluster, pool, creds).map_err(rbd_err)
    }

    /// The state of a volume staged on this node, if any.
    pub fn load(&self, volume_id: &str) -> CsiResult<Option<RbdState>> {
        let path = self.volume_dir(volume_id).join(STATE_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| CsiError::Internal(format!("unreadable {}: {e}", path.display()))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(CsiError::Internal(format!("reading {}: {e}", path.display()))),
        }
    }

    fn save(&self, state: &RbdState) -> CsiResult<()> {
        let dir = self.volume_dir(&state.volume_id);
        let bytes = serde_json::to_vec_pretty(state).map_err(|e| CsiError::Internal(format!("encoding state: {e}")))?;
        write_atomically(&dir.join(STATE_FILE), &bytes)
    }

    fn save_credentials(&self, volume_id: &str, creds: &RbdCredentials) -> CsiResult<()> {
        let stored = StoredCredentials { user: creds.user.clone(), key: creds.key().to_owned() };
        let bytes =
            serde_json::to_vec(&stored).map_err(|e| CsiError::Internal(format!("encoding credentials: {e}")))?;
        write_atomically(&self.volume_dir(volume_id).join(CREDENTIALS_FILE), &bytes)
    }

    fn load_credentials(&self, volume_id: &str) -> CsiResult<RbdCredentials> {
        let path = self.volume_dir(volume_id).join(CREDENTIALS_FILE);
        let bytes = std::fs::read(&path).map_err(io_err(format!("reading {}", path.display())))?;
        let c: StoredCredentials = serde_json::from_slice(&bytes)
            .map_err(|_| CsiError::Internal(format!("unreadable credentials in {}", path.display())))?;
        Ok(RbdCredentials::new(c.user, c.key))
    }

    /// NodeStageVolume. See the module docs for the steps and their state.
    #[tracing::instrument(name = "rbd.node_stage", skip_all, fields(volume.id = %req.volume_id, pool = %req.pool, image = %req.image))]
    pub async fn stage(self: &Arc<Self>, node_id: &str, req: StageRequest) -> CsiResult<()> {
        let dir = self.volume_dir(&req.volume_id);
        if let Some(state) = self.load(&req.volume_id)? {
            let mounts = mountinfo::read_current().map_err(|e| CsiError::Mount(e.to_string()))?;
            let healthy = state.healthy(&mounts, self.fuse_alive(&state).await?);
            if let Some(why) = state.conflict(&req) {
                if healthy {
                    return Err(CsiError::AlreadyExists(format!(
                        "volume {} cannot be staged so: {why}",
                        req.volume_id
                    )));
                }
                if (&state.cluster, &state.pool, &state.image) != (&req.cluster, &req.pool, &req.image) {
                    // A broken staging of another image under this id: finish tearing it down
                    // (fence included) before anything else.
                    let this = self.clone();
                    return Err(this.unstage_state(node_id, state).await.err().unwrap_or_else(|| {
                        CsiError::Unavailable(format!("volume {} had a broken staging; cleaned, retry", req.volume_id))
                    }));
                }
            } else if healthy {
                tracing::debug!("already staged");
                return Ok(());
            }
            // Broken (rbd-fuse died, loop gone, mount removed): rebuild the local parts; the
            // fence is ours and stays.
            tracing::warn!(?state, "staged volume is broken; re-attaching");
            let this = self.clone();
            let mut state = state;
            tokio::task::spawn_blocking(move || this.teardown_local(&mut state))
                .await
                .map_err(|e| CsiError::Internal(format!("teardown task: {e}")))??;
        }
        std::fs::create_dir_all(self.state_dir.join("rbd")).map_err(io_err("creating the rbd state directory"))?;
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_err(format!("creating {}", dir.display()))(e)),
        }
        let mut state = RbdState {
            volume_id: req.volume_id.clone(),
            cluster: req.cluster.clone(),
            monitors: req.monitors.clone(),
            pool: req.pool.clone(),
            image: req.image.clone(),
            staging_path: req.staging_path.clone(),
            staged_as: req.staged_as.clone(),
            read_only: req.read_only,
            fenced: true,
            fuse: None,
            loop_device: None,
            krbd: None,
            fuse_owner: FuseOwner::Plugin,
        };
        self.save_credentials(&req.volume_id, &req.creds)?;
        self.save(&state)?;

        let pool = self.pool(&req.cluster, &req.monitors, &req.pool, &req.creds)?;
        let t = Instant::now();
        match pool.fence_acquire(&req.image, node_id).await {
            Ok(fence) => tracing::debug!(?fence, took = ?t.elapsed(), "fence held"),
            Err(e) => {
                // Not ours (or not reachable): nothing is attached, leave no trace.
                let _ = std::fs::remove_dir_all(&dir);
                return Err(rbd_err(e));
            }
        }
        let size = match pool.info(&req.image).await {
            Ok(Some(info)) => info.size_bytes,
            Ok(None) => {
                let e = CsiError::NotFound(format!("image {}/{} does not exist", req.pool, req.image));
                return Err(self.fail_stage(e, &pool, &req.image, node_id, &dir).await);
            }
            Err(e) => return Err(self.fail_stage(rbd_err(e), &pool, &req.image, node_id, &dir).await),
        };

        let this = self.clone();
        let creds = req.creds.clone();
        let (attached, mut state) = tokio::task::spawn_blocking(move || {
            let r = this.attach_local(&mut state, creds, size);
            (r, state)
        })
        .await
        .map_err(|e| CsiError::Internal(format!("stage task: {e}")))?;
        let Err(e) = attached else { return Ok(()) };
        let this = self.clone();
        let cleaned = tokio::task::spawn_blocking(move || this.teardown_local(&mut state))
            .await
            .map_err(CsiError::Task)
            .and_then(|r| r);
        if let Err(c) = cleaned {
            // Something is still attached: keep the state (and the fence) for unstage.
            tracing::warn!(error = %c, "cleaning up a failed stage");
            return Err(e);
        }
        Err(self.fail_stage(e, &pool, &req.image, node_id, &dir).await)
    }

    /// After a failed stage that left nothing attached: release the fence and forget the
    /// volume. If the release fails the state stays (fenced), for unstage to retry it.
    async fn fail_stage(&self, e: CsiError, pool: &RbdPool, image: &str, node_id: &str, dir: &Path) -> CsiError {
        match pool.fence_release(image, node_id).await {
            Ok(()) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Err(r) => tracing::warn!(error = %r, "releasing the fence after a failed stage"),
        }
        e
    }

    /// Whether this node maps with the kernel (decided once: the module is there or loads).
    fn kernel_rbd(&self) -> bool {
        *self.kernel_rbd.get_or_init(|| {
            let yes = krbd::available();
            tracing::info!(krbd = yes, "rbd attach: {}", if yes { "kernel (krbd)" } else { "rbd-fuse + loop" });
            yes
        })
    }

    /// The device (krbd, or rbd-fuse + loop), then the filesystem: the blocking part of a
    /// stage. Records each object in the state file before creating the next.
    fn attach_local(&self, state: &mut RbdState, creds: RbdCredentials, size: u64) -> CsiResult<()> {
        // The loop device handle stays open until the mount holds the device (autoclear).
        let (dev, loop_handle) = if self.kernel_rbd() {
            let t = Instant::now();
            let record = krbd::map(&KrbdRequest {
                monitors: state.monitors.clone(),
                pool: state.pool.clone(),
                image: state.image.clone(),
                creds,
                read_only: state.read_only,
                timeout: FUSE_TIMEOUT,
            })
            .map_err(|e| match e {
                krbd::KrbdError::InvalidArgument(m) => CsiError::Invalid(m),
                other => CsiError::Unavailable(other.to_string()),
            })?;
            tracing::debug!(device = %record.device.display(), took = ?t.elapsed(), "image mapped");
            let dev = record.device.clone();
            state.krbd = Some(record);
            self.save(state)?;
            (dev, None)
        } else {
            let handle = self.attach_fuse_loop(state, creds, size)?;
            (handle.path().to_owned(), Some(handle))
        };
        self.filesystem(state, &dev)?;
        drop(loop_handle);
        tracing::info!(device = %dev.display(), "rbd volume staged");
        Ok(())
    }

    /// rbd-fuse and a loop device on its image file.
    fn attach_fuse_loop(
        &self,
        state: &mut RbdState,
        creds: RbdCredentials,
        size: u64,
    ) -> CsiResult<loop_dev::LoopDevice> {
        let t = Instant::now();
        // Recorded before the daemon exists: a plugin that dies before it records the daemon
        // leaves a state that sends its unstage to the data path.
        state.fuse_owner = if self.datapath.is_some() { FuseOwner::DataPath } else { FuseOwner::Plugin };
        self.save(state)?;
        let record = match state.fuse_owner {
            FuseOwner::DataPath => {
                let spec = RbdFuseSpec {
                    volume: state.volume_id.clone(),
                    monitors: state.monitors.clone(),
                    pool: state.pool.clone(),
                    image: state.image.clone(),
                    user: creds.user.clone(),
                    key: CephKey(creds.key().to_owned()),
                    size,
                };
                let view = block_on(self.datapath_of(state)?.rbd_fuse_attach(spec))?;
                // The data path's own files (conf, keyring, log) are its to remove.
                FuseRecord {
                    pid: view.pid,
                    mount_point: view.mount_point,
                    file: view.file,
                    connection: view.connection,
                    private_dir: PathBuf::new(),
                }
            }
            FuseOwner::Plugin => {
                let dir = self.volume_dir(&state.volume_id);
                let attachment = fuse_attach::attach(&FuseAttachRequest {
                    monitors: state.monitors.clone(),
                    pool: state.pool.clone(),
                    image: state.image.clone(),
                    creds,
                    size_bytes: size,
                    runtime_dir: dir.clone(),
                    timeout: FUSE_TIMEOUT,
                    private_dir: Some(dir.join("fuse")),
                })
                .map_err(|e| match e {
                    fuse_attach::FuseAttachError::InvalidArgument(m) => CsiError::Invalid(m),
                    other => CsiError::Unavailable(other.to_string()),
                })?;
                attachment.persist().map_err(CsiError::RbdFuse)?
            }
        };
        tracing::debug!(pid = record.pid, owner = ?state.fuse_owner, took = ?t.elapsed(), "rbd-fuse attached");
        let file = record.file.clone();
        state.fuse = Some(record);
        self.save(state)?;

        // Buffered (no O_DIRECT: rbd-fuse's file goes through the page cache, and flushes reach
        // librbd as fsync). Autoclear for filesystems: the mount holds the device, and the
        // device goes away with the unmount even if this plugin dies right after it. Not for
        // raw block: nothing holds it between stage and the pod opening it.
        let block = state.staged_as == StagedAs::Block;
        let opts = LoopOptions { direct_io: false, autoclear: !block, read_only: state.read_only };
        let device = loop_dev::attach(&file, opts).map_err(CsiError::Device)?;
        state.loop_device = Some(device.path().to_owned());
        self.save(state)?;
        Ok(device)
    }

    /// Filesystem volumes: format `dev` when blank (never otherwise), grow an ext4 that missed
    /// an expansion, mount it at the staging path.
    fn filesystem(&self, state: &mut RbdState, dev: &Path) -> CsiResult<()> {
        if let StagedAs::Filesystem { fs_type, mount_flags } = &state.staged_as {
            let mut fs =
                Filesystem { fs_type: fs_type.clone(), mount_flags: mount_flags.clone(), read_only: state.read_only };
            fs.format_and_mount(dev, &state.staging_path, &format!("image {}/{}", state.pool, state.image))?;
            if let StagedAs::Filesystem { fs_type, .. } = &mut state.staged_as {
                *fs_type = fs.fs_type;
            }
            self.save(state)?;
        }
        Ok(())
    }

    /// Filesystem unmount, loop detach, rbd-fuse teardown, each tolerant of its object being
    /// gone already; the state file follows each step. The fence is left alone.
    fn teardown_local(&self, state: &mut RbdState) -> CsiResult<()> {
        let connection = state.fuse.as_ref().and_then(|f| Some((f.mount_point.clone(), f.connection?)));
        if let StagedAs::Filesystem { .. } = state.staged_as {
            filesystem::unmount_all(&state.staging_path, connection.as_ref().map(|(p, id)| (p.as_path(), *id)))?;
        }
        if let Some(k) = state.krbd.clone() {
            krbd::unmap(&k, PATIENCE).map_err(CsiError::Krbd)?;
            state.krbd = None;
            self.save(state)?;
        }
        if let Some(device) = state.loop_device.clone() {
            let backing = state.fuse.as_ref().map(|f| f.file.clone());
            // Only our device: a loop number reused by someone else after an autoclear has
            // another backing file.
            if backing.is_some() && loop_dev::backing_file(&device) == backing {
                loop_dev::detach(&device, PATIENCE).map_err(CsiError::Device)?;
            }
            state.loop_device = None;
            self.save(state)?;
        }
        match state.fuse_owner {
            FuseOwner::Plugin => {
                if let Some(fuse) = state.fuse.clone() {
                    // Any other loop device on our file (a crash between attach and recording it).
                    loop_dev::detach_all_of(&fuse.file, PATIENCE).map_err(CsiError::Device)?;
                    fuse_attach::detach_recorded(&fuse, FUSE_TIMEOUT).map_err(CsiError::RbdFuse)?;
                }
            }
            // Asked even when the state names no daemon: a plugin that died between the data
            // path's attach and its own record left one there.
            FuseOwner::DataPath => {
                let engines = self.datapath_of(state)?;
                let file = match &state.fuse {
                    Some(fuse) => Some(fuse.file.clone()),
                    None => block_on(engines.rbd_fuse_status(&state.volume_id))?.map(|v| v.file),
                };
                if let Some(file) = file {
                    loop_dev::detach_all_of(&file, PATIENCE).map_err(CsiError::Device)?;
                }
                block_on(engines.rbd_fuse_detach(&state.volume_id))?;
            }
        }
        if state.fuse.take().is_some() {
            self.save(state)?;
        }
        Ok(())
    }

    /// NodeUnstageVolume for a volume this executor staged: `Ok(false)` when there is no rbd
    /// state for it (not staged here, or unstaged already).
    #[tracing::instrument(name = "rbd.node_unstage", skip_all, fields(volume.id = %volume_id))]
    pub async fn unstage(self: &Arc<Self>, node_id: &str, volume_id: &str, staging: &Path) -> CsiResult<bool> {
        let Some(state) = self.load(volume_id)? else { return Ok(false) };
        if state.staging_path != staging {
            return Err(CsiError::FailedPrecondition(format!(
                "volume {volume_id} is staged at {}, not {}",
                state.staging_path.display(),
                staging.display()
            )));
        }
        self.clone().unstage_state(node_id, state).await?;
        Ok(true)
    }

    async fn unstage_state(self: Arc<Self>, node_id: &str, mut state: RbdState) -> CsiResult<()> {
        let t = Instant::now();
        let this = self.clone();
        let state = tokio::task::spawn_blocking(move || this.teardown_local(&mut state).map(|()| state))
            .await
            .map_err(|e| CsiError::Internal(format!("unstage task: {e}")))??;
        if state.fenced {
            let creds = self.load_credentials(&state.volume_id)?;
            let pool = self.pool(&state.cluster, &state.monitors, &state.pool, &creds)?;
            // A cluster that does not answer keeps the fence (and this state) until a retry
            // gets through: releasing it is what lets another node attach.
            pool.fence_release(&state.image, node_id).await.map_err(rbd_err)?;
        }
        let dir = self.volume_dir(&state.volume_id);
        std::fs::remove_dir_all(&dir)
            .or_else(|e| if e.kind() == io::ErrorKind::NotFound { Ok(()) } else { Err(e) })
            .map_err(io_err(format!("removing {}", dir.display())))?;
        tracing::info!(took = ?t.elapsed(), "rbd volume unstaged");
        Ok(())
    }

    /// The staged loop device of a healthy staging of `volume_id`.
    pub fn staged_device(&self, volume_id: &str) -> CsiResult<(RbdState, PathBuf)> {
        let not_staged = || CsiError::FailedPrecondition(format!("volume {volume_id} is not staged on this node"));
        let state = self.load(volume_id)?.ok_or_else(not_staged)?;
        let mounts = mountinfo::read_current().map_err(|e| CsiError::Mount(e.to_string()))?;
        if !state.healthy(&mounts, self.fuse_alive_blocking(&state)?) {
            return Err(CsiError::FailedPrecondition(format!(
                "the staging of volume {volume_id} is broken (its rbd device is gone); unstage and stage it again"
            )));
        }
        let device = state.krbd.as_ref().map(|k| k.device.clone()).or_else(|| state.loop_device.clone());
        let device = device.ok_or_else(not_staged)?;
        Ok((state, device))
    }

    /// NodeExpandVolume: the loop device takes on the image's new size once rbd-fuse shows it,
    /// then the filesystem grows (XFS online; ext4 online only where the host allows it).
    /// Returns the device's size.
    #[tracing::instrument(name = "rbd.node_expand", skip_all, fields(volume.id = %volume_id, required_bytes))]
    pub fn expand(&self, volume_id: &str, required_bytes: u64) -> CsiResult<u64> {
        let (state, device) = self.staged_device(volume_id)?;
        // krbd learns the new size from the image header's watch; rbd-fuse shows it on its
        // file once its attribute cache expired.
        let (shown_by, current): (&str, Box<dyn Fn() -> CsiResult<u64>>) = match (&state.krbd, &state.fuse) {
            (Some(k), _) => ("the kernel", Box::new(|| Ok(krbd::size_bytes(k).unwrap_or(0)))),
            (None, Some(fuse)) => (
                "rbd-fuse",
                Box::new(|| {
                    Ok(std::fs::metadata(&fuse.file).map_err(io_err(format!("stat {}", fuse.file.display())))?.len())
                }),
            ),
            (None, None) => return Err(CsiError::Internal("staged without a device".into())),
        };
        let deadline = Instant::now() + GROW_WAIT;
        let seen = loop {
            let seen = current()?;
            if seen >= required_bytes || Instant::now() >= deadline {
                break seen;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if seen < required_bytes {
            return Err(CsiError::Unavailable(format!(
                "{shown_by} still shows {seen} bytes for {}/{}, {required_bytes} asked: has the controller grown the image?",
                state.pool, state.image
            )));
        }
        let size = if state.krbd.is_some() {
            seen
        } else {
            let size = loop_dev::set_capacity(&device).map_err(CsiError::Device)?;
            tracing::info!(size, "loop device resized");
            size
        };
        let StagedAs::Filesystem { fs_type, mount_flags } = &state.staged_as else { return Ok(size) };
        let fs = Filesystem { fs_type: fs_type.clone(), mount_flags: mount_flags.clone(), read_only: state.read_only };
        fs.grow(&device, &state.staging_path, size)?;
        tracing::info!(fs = %fs_type, size, "filesystem grown");
        Ok(size)
    }

    /// Whether rbd-fuse of a staged volume still runs (for the volume condition).
    pub fn condition(&self, volume_id: &str) -> Option<String> {
        let state = self.load(volume_id).ok()??;
        let mounts = mountinfo::read_current().ok()?;
        let parts = if state.krbd.is_some() { "the kernel mapping" } else { "rbd-fuse or the loop device" };
        let alive = match self.fuse_alive_blocking(&state) {
            Ok(alive) => alive,
            Err(e) => return Some(format!("whether rbd-fuse of this volume runs is unknown: {e}")),
        };
        (!state.healthy(&mounts, alive)).then(|| format!("{parts} of this volume is gone; restage it"))
    }
}

/// Size of a staged raw block volume.
pub fn block_size_of(device: &Path) -> CsiResult<u64> {
    loop_dev::size_bytes(device).map_err(CsiError::Device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(staged_as: StagedAs) -> RbdState {
        RbdState {
            volume_id: "ceph:v1".into(),
            cluster: "c".into(),
            monitors: vec![],
            pool: "p".into(),
            image: "i".into(),
            staging_path: "/s".into(),
            staged_as,
            read_only: false,
            fenced: true,
            fuse: None,
            loop_device: None,
            krbd: None,
            fuse_owner: FuseOwner::Plugin,
        }
    }

    fn request(staged_as: StagedAs) -> StageRequest {
        StageRequest {
            volume_id: "ceph:v1".into(),
            cluster: "c".into(),
            monitors: vec![],
            pool: "p".into(),
            image: "i".into(),
            creds: RbdCredentials::new("u", "k"),
            staging_path: "/s".into(),
            staged_as,
            read_only: false,
        }
    }

    #[test]
    fn a_restage_conflicts_only_when_it_asks_for_something_else() {
        let ext4 = StagedAs::Filesystem { fs_type: "ext4".into(), mount_flags: vec![] };
        let default = StagedAs::Filesystem { fs_type: String::new(), mount_flags: vec![] };
        let xfs = StagedAs::Filesystem { fs_type: "xfs".into(), mount_flags: vec![] };
        let s = state(ext4.clone());
        assert_eq!(s.conflict(&request(ext4)), None);
        assert_eq!(s.conflict(&request(default)), None, "no fs type asked: whatever is there");
        assert!(s.conflict(&request(xfs)).is_some());
        assert!(s.conflict(&request(StagedAs::Block)).is_some());
        let mut other_path = request(StagedAs::Block);
        other_path.staging_path = "/elsewhere".into();
        assert!(state(StagedAs::Block).conflict(&other_path).is_some());
        assert!(!state(StagedAs::Block).healthy(&[], true), "nothing attached is not healthy");
    }
}
