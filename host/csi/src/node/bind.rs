//! The bind attacher: directory volumes of hostpath-like backends. The plan names a directory
//! under one of the backend's `dir` roots; NodeStage binds that directory onto the staging path,
//! once the root is found granted to the backend on this node (labelling the tree with the CO's
//! SELinux context first, as a bind mount cannot take one), and NodePublish binds the staging
//! path onto the target. A directory has no filesystem of its own: its capacity is the plan's
//! bookkeeping (expansion only records it) and its usage is the walked tree, abnormal above the
//! capacity. The bind mounts themselves are `mounts`' work, shared with every kind.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::driver;

use super::attacher::{
    Attacher, ConfigSource, Expand, Publish, Stage, Stats, Unstaged, blocking, ensure_bind, ensure_unmounted,
    mount_err, publish_staged,
};
use super::mount_options;
use super::mounts::MountSystem;
use super::usage;
use crate::convert;
use crate::error::{CsiError, CsiResult};
use wasmcsi_mountinfo as mountinfo;

pub struct BindAttacher {
    config: Arc<dyn ConfigSource>,
    mounts: Arc<dyn MountSystem>,
}

impl BindAttacher {
    pub fn new(config: Arc<dyn ConfigSource>, mounts: Arc<dyn MountSystem>) -> Self {
        Self { config, mounts }
    }

    /// The host directory a plan names, once its root is found granted to `backend`.
    fn source(&self, backend: &str, plan: &driver::BindPlan) -> CsiResult<PathBuf> {
        let grants = self.config.grants_for(backend);
        let root = grants.dir.get(&plan.root).ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "dir root {:?} of backend {backend} is not granted on this node",
                plan.root
            ))
        })?;
        wasmcsi_runtime::resolve_dir_path(root, &plan.path)
            .map_err(|e| CsiError::Internal(format!("backend {backend} planned an invalid path: {e:?}")))
    }
}

#[tonic::async_trait]
impl Attacher for BindAttacher {
    type Plan = driver::BindPlan;

    async fn stage(&self, call: &Stage<'_>, plan: &driver::BindPlan) -> CsiResult<()> {
        let source = self.source(&call.volume.backend.name, plan)?;
        let label = match &call.capability.access_type {
            types::AccessType::Mount(m) => mount_options::selinux_context(&m.mount_flags)?,
            types::AccessType::Block => None,
        };
        let (sys, staging) = (self.mounts.clone(), call.staging.to_owned());
        blocking(move || {
            // A bind mount takes no context=: the directory's own labels are what the pod sees.
            if let Some(label) = &label {
                mount_options::relabel_tree(&source, label)?;
            }
            ensure_bind(sys.as_ref(), &source, &staging, false)
        })
        .await
    }

    /// Whatever is mounted at the staging path is unmounted: this attacher is asked last, so
    /// it also finishes an unstage no other kind recognised (or of a volume not staged at all).
    async fn unstage(&self, _volume_id: &str, staging: &Path) -> CsiResult<Unstaged> {
        let (sys, staging) = (self.mounts.clone(), staging.to_owned());
        blocking(move || ensure_unmounted(sys.as_ref(), &staging, false)).await?;
        Ok(Unstaged::Done)
    }

    async fn publish(&self, call: &Publish<'_>, _plan: &driver::BindPlan) -> CsiResult<()> {
        publish_staged(&self.mounts, call).await
    }

    /// NOT_FOUND unless the volume path is this volume: a mount point whose root is the
    /// volume's own directory (a staging path or a target, as NodeStage and NodePublish bind it).
    /// A path with nothing mounted on it, or another directory mounted there, is not the volume,
    /// whatever the filesystem under it holds.
    async fn stats(&self, call: &Stats<'_>, plan: &driver::BindPlan) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
        use csi::volume_usage::Unit;
        let source = self.source(&call.volume.backend.name, plan)?;
        let (path, volume) = (call.path.to_owned(), call.volume.id.to_owned());
        let checked = path.clone();
        blocking(move || is_the_volume(&checked, &source, &volume)).await?;
        let walk = path.clone();
        let (used, inodes_used) = blocking(move || usage::directory_usage(&walk).map_err(mount_err)).await?;
        let fs = nix::sys::statvfs::statvfs(&path).map_err(mount_err)?;
        let (abnormal, message) = if used > plan.capacity_bytes {
            (true, format!("uses {used} bytes of its {} byte capacity", plan.capacity_bytes))
        } else {
            (false, "healthy".to_string())
        };
        let b = convert::bytes;
        Ok(csi::NodeGetVolumeStatsResponse {
            usage: vec![
                csi::VolumeUsage {
                    available: b(plan.capacity_bytes.saturating_sub(used)),
                    total: b(plan.capacity_bytes),
                    used: b(used),
                    unit: Unit::Bytes as i32,
                },
                // One scope, the volume's (as for bytes): what its tree uses, what it can still
                // take (a directory has no inode quota: the filesystem's free inodes), and their
                // sum. Mixing the filesystem's total with the volume's used misleads kubelet's
                // eviction and every dashboard that computes used / total.
                csi::VolumeUsage {
                    available: b(fs.files_available()),
                    total: b(inodes_used.saturating_add(fs.files_available())),
                    used: b(inodes_used),
                    unit: Unit::Inodes as i32,
                },
            ],
            volume_condition: Some(csi::VolumeCondition { abnormal, message }),
        })
    }

    /// A directory has no filesystem of its own to grow: the new size is bookkeeping.
    async fn expand(&self, call: &Expand<'_>, plan: &driver::BindPlan) -> CsiResult<u64> {
        Ok(plan.capacity_bytes.max(call.required_bytes))
    }
}

/// `Ok` when `path` is `source` bound there: a mount point, and the same directory (device and
/// inode: a bind mount's root is the very directory it binds). NOT_FOUND otherwise, saying what
/// is there instead.
fn is_the_volume(path: &Path, source: &Path, volume: &str) -> CsiResult<()> {
    use std::os::unix::fs::MetadataExt as _;
    let not_found = |why: String| CsiError::NotFound(format!("volume {volume} is not at {}: {why}", path.display()));
    let here = std::fs::metadata(path).map_err(|e| not_found(e.to_string()))?;
    let volume_dir = match std::fs::metadata(source) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(not_found(format!("its directory {} no longer exists", source.display())));
        }
        Err(e) => return Err(mount_err(format!("{}: {e}", source.display()))),
    };
    if !mountinfo::is_mount_point(path).map_err(mount_err)? {
        return Err(not_found("nothing is mounted there".into()));
    }
    if (here.dev(), here.ino()) != (volume_dir.dev(), volume_dir.ino()) {
        return Err(not_found("another directory is mounted there".into()));
    }
    Ok(())
}
