//! The bind attacher: directory volumes of hostpath-like backends. The plan names a directory
//! under one of the backend's `dir` roots; NodeStage binds that directory onto the staging path,
//! once the root is found granted to the backend on this node, and NodePublish binds the staging
//! path onto the target. A directory has no filesystem of its own: its capacity is the plan's
//! bookkeeping (expansion only records it) and its usage is the walked tree, abnormal above the
//! capacity. The bind mounts themselves are `mounts`' work, shared with every kind.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::driver as wit;

use super::attacher::{
    Attacher, ConfigSource, Expand, Publish, Stage, Stats, Unstaged, blocking, ensure_bind, ensure_unmounted,
    mount_err, publish_staged,
};
use super::mounts::MountSystem;
use super::{mountinfo, usage};
use crate::convert;
use crate::error::{CsiError, CsiResult};

pub struct BindAttacher {
    config: Arc<dyn ConfigSource>,
    mounts: Arc<dyn MountSystem>,
}

impl BindAttacher {
    pub fn new(config: Arc<dyn ConfigSource>, mounts: Arc<dyn MountSystem>) -> Self {
        Self { config, mounts }
    }

    /// The host directory a plan names, once its root is found granted to `backend`.
    fn source(&self, backend: &str, plan: &wit::BindPlan) -> CsiResult<PathBuf> {
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
    type Plan = wit::BindPlan;

    async fn stage(&self, call: &Stage<'_>, plan: &wit::BindPlan) -> CsiResult<()> {
        let source = self.source(&call.volume.backend.name, plan)?;
        let (sys, staging) = (self.mounts.clone(), call.staging.to_owned());
        blocking(move || ensure_bind(sys.as_ref(), &source, &staging, false)).await
    }

    /// Whatever is mounted at the staging path is unmounted: this attacher is asked last, so
    /// it also finishes an unstage no other kind recognised (or of a volume not staged at all).
    async fn unstage(&self, _volume_id: &str, staging: &Path) -> CsiResult<Unstaged> {
        let (sys, staging) = (self.mounts.clone(), staging.to_owned());
        blocking(move || ensure_unmounted(sys.as_ref(), &staging, false)).await?;
        Ok(Unstaged::Done)
    }

    async fn publish(&self, call: &Publish<'_>, _plan: &wit::BindPlan) -> CsiResult<()> {
        publish_staged(&self.mounts, call).await
    }

    async fn stats(&self, call: &Stats<'_>, plan: &wit::BindPlan) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
        use csi::volume_usage::Unit;
        let path = call.path.to_owned();
        let walk = path.clone();
        let (used, inodes_used) = blocking(move || usage::directory_usage(&walk).map_err(mount_err)).await?;
        let fs = nix::sys::statvfs::statvfs(&path).map_err(mount_err)?;
        let mounted = blocking(move || mountinfo::is_mount_point(&path).map_err(mount_err)).await?;
        let (abnormal, message) = if !mounted {
            (true, "volume path is not mounted".to_string())
        } else if used > plan.capacity_bytes {
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
    async fn expand(&self, call: &Expand<'_>, plan: &wit::BindPlan) -> CsiResult<u64> {
        Ok(plan.capacity_bytes.max(call.required_bytes))
    }
}
