//! The one trait every attachment kind implements ([`Attacher`]), the calls it serves, and the
//! steps every kind shares (publish a staged volume, unpublish a target). The one place that
//! picks the attacher of a plan is `attachers` ([`Attachers::route`](super::Attachers::route)):
//! it knows every kind, and no kind knows it.
//!
//! ```text
//!   NodeService: validate, take the volume's guard, ask the backend for its plan
//!        │
//!        │ Attachers::route(plan)                 NodeUnstageVolume has no plan:
//!        ▼                                        Attachers::unstage asks each attacher
//!   PlannedVolume: stage / publish / stats / expand   in turn whether the volume is its own
//!        │
//!        ├── bind.rs   directory volumes (bind mounts)
//!        ├── nfs.rs    kernel NFS mounts
//!        ├── rbd/      RBD images (krbd, or rbd-fuse + loop)
//!        └── replicated.rs  replicated block volumes (an engine in this node's data path)
//! ```
//!
//! A plan is the backend's word, a grant the operator's: each attacher checks its plan against
//! the backend's grants in `stage`, before anything is mounted, and refuses with
//! FAILED_PRECONDITION naming the missing grant. Publish, stats and expand act on what stage
//! made (the staging path, the node's state of the volume), so they check nothing more.
//!
//! Attachers read the operator's configuration through the [`ConfigSource`] handle they are
//! built with, on every call, never through the runtime: a configuration reloaded while the
//! node runs reaches attachers that already exist.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::Backend;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::config::{CephCluster, Grants, HostConfig};
use wasmcsi_runtime::driver::{self, Attachment};

use super::mounts::{self, MountSystem, SourceIdentity};
use crate::error::{CsiError, CsiResult};
use wasmcsi_mountinfo as mountinfo;

/// What attachers read from the operator's configuration. A handle rather than a copy, so that
/// a reloaded configuration reaches attachers built before it; [`HostConfig`] itself is the
/// handle of a configuration that never changes.
pub trait ConfigSource: Send + Sync {
    /// The grants of `backend` (none when the configuration does not name it).
    fn grants_for(&self, backend: &str) -> Grants;
    /// A Ceph cluster by the name plans and grants use.
    fn cluster(&self, name: &str) -> Option<CephCluster>;
}

impl ConfigSource for HostConfig {
    fn grants_for(&self, backend: &str) -> Grants {
        HostConfig::grants_for(self, backend)
    }
    fn cluster(&self, name: &str) -> Option<CephCluster> {
        self.clusters.get(name).cloned()
    }
}

/// The configuration in force in the runtime, reloaded when its file changes: what a serving
/// host gives its attachers.
impl ConfigSource for wasmcsi_runtime::Runtime {
    fn grants_for(&self, backend: &str) -> Grants {
        self.config().grants_for(backend)
    }
    fn cluster(&self, name: &str) -> Option<CephCluster> {
        self.config().clusters.get(name).cloned()
    }
}

/// The volume a call is about and the backend whose plan it carries out.
#[derive(Clone, Copy)]
pub struct Volume<'a> {
    /// The CSI volume id.
    pub id: &'a str,
    /// The id the backend knows the volume by (the CSI id without the backend's prefix).
    pub local_id: &'a str,
    pub backend: &'a Arc<Backend>,
}

/// A validated NodeStageVolume.
pub struct Stage<'a> {
    pub volume: Volume<'a>,
    pub staging: &'a Path,
    pub capability: &'a driver::VolumeCapability,
    pub secrets: &'a HashMap<String, String>,
    /// What ControllerPublishVolume returned for this node (a replicated volume's grant).
    pub publish_context: &'a HashMap<String, String>,
}

/// A validated NodePublishVolume.
pub struct Publish<'a> {
    pub volume: Volume<'a>,
    pub staging: &'a Path,
    pub target: &'a Path,
    pub capability: &'a driver::VolumeCapability,
    /// The request's `readonly`, or a read-only access mode.
    pub read_only: bool,
}

/// A validated NodeGetVolumeStats.
pub struct Stats<'a> {
    pub volume: Volume<'a>,
    /// The volume path the CO asked about (it exists).
    pub path: &'a Path,
}

/// A validated NodeExpandVolume.
pub struct Expand<'a> {
    pub volume: Volume<'a>,
    pub path: &'a Path,
    pub required_bytes: u64,
}

/// What [`Attacher::unstage`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unstaged {
    /// The volume was this kind's; it is not staged any more.
    Done,
    /// Nothing of this kind is staged for the volume; nothing was touched.
    NotMine,
}

/// Carries out one attachment kind's plans on this node; one implementation per kind, each in
/// its own file. Every method is idempotent: it reads the node's state first and does only what
/// is missing. Methods run on the async workers: blocking work goes through [`blocking`].
#[tonic::async_trait]
pub trait Attacher: Send + Sync + 'static {
    /// The plan this kind carries out (its variant of [`Attachment`]).
    type Plan: Send + Sync + 'static;

    /// NodeStageVolume: check the plan against the backend's grants, then make the volume
    /// available at the staging path (or, for a raw block volume, on this node).
    async fn stage(&self, call: &Stage<'_>, plan: &Self::Plan) -> CsiResult<()>;

    /// NodeUnstageVolume. It carries no plan, and the backend may be gone by then (its file
    /// removed, the plugin restarted): each kind recognises its volumes from what the node
    /// holds (its own state, the mount table), undoes the staging and says [`Unstaged::Done`],
    /// or touches nothing and says [`Unstaged::NotMine`].
    async fn unstage(&self, volume_id: &str, staging: &Path) -> CsiResult<Unstaged>;

    /// NodePublishVolume: make the staged volume visible at the target; most kinds bind the
    /// staging path onto it ([`publish_staged`]).
    async fn publish(&self, call: &Publish<'_>, plan: &Self::Plan) -> CsiResult<()>;

    /// NodeGetVolumeStats of a volume published or staged at `call.path`.
    async fn stats(&self, call: &Stats<'_>, plan: &Self::Plan) -> CsiResult<csi::NodeGetVolumeStatsResponse>;

    /// NodeExpandVolume: grow what the node holds of the volume (device, filesystem) to the
    /// required size; returns the capacity the volume has now.
    async fn expand(&self, call: &Expand<'_>, plan: &Self::Plan) -> CsiResult<u64>;
}

/// The frontends this node serves replicated volumes through: FUSE + loop only (ublk and NBD
/// are not provided by this host yet).
const FRONTENDS: &[driver::Frontend] = &[driver::Frontend::FuseLoop];

/// A plan asking for what this host does not provide is FAILED_PRECONDITION saying so, before
/// anything is attached: encryption at rest (never an unencrypted volume instead) and a frontend
/// the node lacks.
pub fn provided(plan: &Attachment) -> CsiResult<()> {
    let (encryption, frontend) = match plan {
        Attachment::ReplicatedBlock(p) => (p.encryption.is_some(), p.frontend),
        Attachment::Rbd(p) => (p.encryption.is_some(), None),
        Attachment::Bind(_) | Attachment::Nfs(_) => (false, None),
    };
    if encryption {
        return Err(CsiError::FailedPrecondition(
            "the plan asks for encryption at rest, which is not provided by this host".into(),
        ));
    }
    match frontend {
        Some(f) if !FRONTENDS.contains(&f) => Err(CsiError::FailedPrecondition(format!(
            "the plan asks for frontend {}, which is not provided by this host (it has {})",
            frontend_name(f),
            FRONTENDS.iter().map(|f| frontend_name(*f)).collect::<Vec<_>>().join(", ")
        ))),
        _ => Ok(()),
    }
}

/// A frontend as the WIT names it.
fn frontend_name(f: driver::Frontend) -> &'static str {
    match f {
        driver::Frontend::Ublk => "ublk",
        driver::Frontend::Nbd => "nbd",
        driver::Frontend::FuseLoop => "fuse-loop",
    }
}

// ---- steps every kind shares -------------------------------------------------------------------

/// Mount-table work is blocking syscalls: keep it off the async workers.
pub async fn blocking<T: Send + 'static>(f: impl FnOnce() -> CsiResult<T> + Send + 'static) -> CsiResult<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| CsiError::Internal(format!("node task failed: {e}")))?
}

pub fn mount_err(e: impl std::fmt::Display) -> CsiError {
    CsiError::Mount(e.to_string())
}

pub fn is_read_only_mode(cap: &driver::VolumeCapability) -> bool {
    matches!(cap.access_mode, types::AccessMode::SingleNodeReaderOnly | types::AccessMode::MultiNodeReaderOnly)
}

/// Bind `source` onto `target` (read-only if asked), unless that is already so. Blocking.
pub fn ensure_bind(sys: &dyn MountSystem, source: &Path, target: &Path, read_only: bool) -> CsiResult<()> {
    let table = mountinfo::read_current().map_err(mount_err)?;
    let plan = plan_bind_now(&table, source, target, read_only)?;
    mounts::execute(sys, &plan).map_err(mount_err)
}

/// [`mounts::plan_bind`] on what stat'ing `source` and `target` finds now. Blocking.
fn plan_bind_now(
    table: &[mountinfo::MountEntry],
    source: &Path,
    target: &Path,
    read_only: bool,
) -> CsiResult<Vec<mounts::MountAction>> {
    let source_id = mounts::identify(source).map_err(|e| CsiError::NotFound(format!("{}: {e}", source.display())))?;
    let target_exists = target.exists();
    let mounted = !mountinfo::mounts_at(table, target).is_empty();
    let target_id: Option<SourceIdentity> = if mounted { mounts::identify(target).ok() } else { None };
    mounts::plan_bind(table, source, &source_id, target, target_id, target_exists, read_only)
        .map_err(|e| CsiError::AlreadyExists(e.to_string()))
}

/// Where a NodePublishVolume puts the volume, owned so that it can move into a blocking task.
#[derive(Debug, Clone)]
pub struct Placement {
    /// The CSI volume id (for messages).
    pub volume: String,
    pub target: PathBuf,
    pub read_only: bool,
    /// SINGLE_NODE_SINGLE_WRITER: the volume may be published at one target path only.
    pub single_writer: bool,
}

impl Placement {
    pub fn of(call: &Publish<'_>) -> Self {
        Self {
            volume: call.volume.id.to_owned(),
            target: call.target.to_owned(),
            read_only: call.read_only,
            single_writer: matches!(call.capability.access_mode, types::AccessMode::SingleNodeSingleWriter),
        }
    }
}

/// Bind what a staged volume shows at `source` (the staging path, or its device node) onto the
/// publish target, unless that is already so. A SINGLE_NODE_SINGLE_WRITER volume that the mount
/// table shows published at another target is FAILED_PRECONDITION (the spec's NodePublishVolume
/// table); the same target again is the idempotent success. Blocking.
fn bind_published(sys: &dyn MountSystem, source: &Path, to: &Placement) -> CsiResult<()> {
    let table = mountinfo::read_current().map_err(mount_err)?;
    refuse_second_target(&table, source, to)?;
    let plan = plan_bind_now(&table, source, &to.target, to.read_only)?;
    mounts::execute(sys, &plan).map_err(mount_err)
}

/// FAILED_PRECONDITION when `to` is single-writer and the mount table shows what `source` shows
/// at a target other than `to.target`.
fn refuse_second_target(table: &[mountinfo::MountEntry], source: &Path, to: &Placement) -> CsiResult<()> {
    if !to.single_writer {
        return Ok(());
    }
    match mounts::other_binds(table, source, &to.target).first() {
        None => Ok(()),
        Some(other) => Err(CsiError::FailedPrecondition(format!(
            "volume {} is published at {}; its access mode SINGLE_NODE_SINGLE_WRITER allows one target, not also {}",
            to.volume,
            other.display(),
            to.target.display()
        ))),
    }
}

/// Unmount everything stacked at `target`, then remove it when `remove_dir`. Blocking.
pub fn ensure_unmounted(sys: &dyn MountSystem, target: &Path, remove_dir: bool) -> CsiResult<()> {
    let table = mountinfo::read_current().map_err(mount_err)?;
    let plan = mounts::plan_unmount(&table, target, target.exists(), remove_dir);
    mounts::execute(sys, &plan).map_err(mount_err)
}

/// NodePublishVolume of a volume staged as a filesystem: the staging path bind-mounted onto the
/// target. FAILED_PRECONDITION when nothing is mounted at the staging path.
pub async fn publish_staged(sys: &Arc<dyn MountSystem>, call: &Publish<'_>) -> CsiResult<()> {
    let (sys, staging, to) = (sys.clone(), call.staging.to_owned(), Placement::of(call));
    blocking(move || {
        let table = mountinfo::read_current().map_err(mount_err)?;
        if mountinfo::mounts_at(&table, &staging).is_empty() {
            return Err(CsiError::FailedPrecondition(format!("volume is not staged at {}", staging.display())));
        }
        bind_published(sys.as_ref(), &staging, &to)
    })
    .await
}

/// NodePublishVolume of a raw block volume: the staged device node bind-mounted onto the target,
/// a file (created with its parent directories if missing). Blocking.
pub fn publish_device(sys: &dyn MountSystem, device: &Path, to: &Placement) -> CsiResult<()> {
    let target = to.target.as_path();
    // Before the target file is made: a refused publish leaves nothing behind.
    refuse_second_target(&mountinfo::read_current().map_err(mount_err)?, device, to)?;
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(mount_err)?;
    }
    if !target.exists() {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(target)
            .map_err(|e| mount_err(format!("creating {}: {e}", target.display())))?;
    }
    bind_published(sys, device, to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(frontend: Option<driver::Frontend>, encrypted: bool) -> Attachment {
        Attachment::ReplicatedBlock(driver::BlockPlan {
            volume_id: "v".into(),
            size_bytes: 4096,
            fs_type: String::new(),
            frontend,
            encryption: encrypted
                .then(|| driver::Encryption { passphrase: types::SecretRef { key: "p".into(), handle: 0 } }),
        })
    }

    fn refusal(plan: &Attachment) -> String {
        match provided(plan) {
            Err(CsiError::FailedPrecondition(m)) => m,
            other => panic!("expected FAILED_PRECONDITION for {plan:?}, got {other:?}"),
        }
    }

    /// What this host does not provide is refused before anything is attached, saying so; the
    /// host that provides one flips its line here.
    #[test]
    fn a_plan_asking_for_what_this_node_lacks_is_refused_saying_so() {
        assert!(provided(&block(None, false)).is_ok());
        assert!(provided(&block(Some(driver::Frontend::FuseLoop), false)).is_ok());
        for (frontend, name) in [(driver::Frontend::Ublk, "ublk"), (driver::Frontend::Nbd, "nbd")] {
            let m = refusal(&block(Some(frontend), false));
            assert!(m.contains(name) && m.contains("not provided by this host") && m.contains("fuse-loop"), "{m}");
        }
        let m = refusal(&block(None, true));
        assert!(m.contains("encryption") && m.contains("not provided by this host"), "{m}");
        let rbd = Attachment::Rbd(driver::RbdPlan {
            cluster: "c".into(),
            pool: "p".into(),
            image: "i".into(),
            secrets: vec![],
            encryption: Some(driver::Encryption { passphrase: types::SecretRef { key: "p".into(), handle: 0 } }),
        });
        assert!(refusal(&rbd).contains("encryption"));
    }
}
