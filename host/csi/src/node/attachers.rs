//! The attacher of every kind this node carries out ([`Attachers`]), what they are built from
//! ([`NodeSetup`]), and the one place a plan's kind is matched ([`Attachers::route`]). It
//! depends on every kind's file; the kinds depend only on `attacher` (the trait and the steps
//! they share), never on this file.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::driver::Attachment;

use super::attacher::{
    Attacher, ConfigSource, Expand, Publish, Stage, Stats, Unstaged, blocking, ensure_unmounted, mount_err, provided,
};
use super::bind::BindAttacher;
use super::mounts::MountSystem;
use super::nfs::NfsAttacher;
use super::rbd::RbdAttacher;
use super::replicated::ReplicatedAttacher;
use crate::error::CsiResult;

/// A volume's plan together with the attacher of its kind: what the node service calls.
#[tonic::async_trait]
pub trait PlannedVolume: Send + Sync {
    async fn stage(&self, call: &Stage<'_>) -> CsiResult<()>;
    async fn publish(&self, call: &Publish<'_>) -> CsiResult<()>;
    async fn stats(&self, call: &Stats<'_>) -> CsiResult<csi::NodeGetVolumeStatsResponse>;
    async fn expand(&self, call: &Expand<'_>) -> CsiResult<u64>;
}

struct Planned<'a, A: Attacher> {
    attacher: &'a A,
    plan: A::Plan,
}

#[tonic::async_trait]
impl<A: Attacher> PlannedVolume for Planned<'_, A> {
    async fn stage(&self, call: &Stage<'_>) -> CsiResult<()> {
        self.attacher.stage(call, &self.plan).await
    }
    async fn publish(&self, call: &Publish<'_>) -> CsiResult<()> {
        self.attacher.publish(call, &self.plan).await
    }
    async fn stats(&self, call: &Stats<'_>) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
        self.attacher.stats(call, &self.plan).await
    }
    async fn expand(&self, call: &Expand<'_>) -> CsiResult<u64> {
        self.attacher.expand(call, &self.plan).await
    }
}

/// What the node's attachers are built from.
pub struct NodeSetup {
    /// This node's id (the rbd fence's cookie).
    pub node_id: String,
    /// Where attachers keep what they must find again after a restart (`<dir>/rbd/<volume>`).
    pub state_dir: PathBuf,
    /// The operator's configuration: grants, Ceph clusters.
    pub config: Arc<dyn ConfigSource>,
    /// Mount syscalls: the kernel's ([`mounts::KernelMounts`]), or a fake in tests.
    pub mounts: Arc<dyn MountSystem>,
    /// Where FUSE mounts of block frontends live (the replicated volumes' devices).
    pub runtime_dir: PathBuf,
    /// This node's engines and rbd-fuse daemons (in this process or a data-path process);
    /// `None` when the plugin serves no replicated volumes (rbd-fuse then runs in this process).
    pub datapath: Option<wasmcsi_datapath::client::Engines>,
}

/// The attacher of every kind this node carries out.
pub struct Attachers {
    mounts: Arc<dyn MountSystem>,
    bind: BindAttacher,
    nfs: NfsAttacher,
    rbd: RbdAttacher,
    replicated: ReplicatedAttacher,
}

impl Attachers {
    pub fn new(setup: NodeSetup) -> Self {
        let NodeSetup { node_id, state_dir, config, mounts, runtime_dir, datapath } = setup;
        Self {
            bind: BindAttacher::new(config.clone(), mounts.clone()),
            nfs: NfsAttacher::new(config.clone(), mounts.clone()),
            replicated: ReplicatedAttacher::new(
                node_id.clone(),
                &state_dir,
                runtime_dir,
                config.clone(),
                mounts.clone(),
                datapath.clone(),
            ),
            rbd: RbdAttacher::new(node_id, &state_dir, config, mounts.clone(), datapath),
            mounts,
        }
    }

    /// The attacher of `plan`'s kind, holding the plan. The one place a plan's kind is matched:
    /// a new kind is its file, an arm here and a line in [`Self::unstage`]. A plan asking for
    /// what this node does not provide is refused first ([`provided`]).
    pub fn route(&self, plan: Attachment) -> CsiResult<Box<dyn PlannedVolume + '_>> {
        provided(&plan)?;
        Ok(match plan {
            Attachment::Bind(plan) => Box::new(Planned { attacher: &self.bind, plan }),
            Attachment::Nfs(plan) => Box::new(Planned { attacher: &self.nfs, plan }),
            Attachment::Rbd(plan) => Box::new(Planned { attacher: &self.rbd, plan }),
            Attachment::ReplicatedBlock(plan) => Box::new(Planned { attacher: &self.replicated, plan }),
        })
    }

    /// NodeUnstageVolume: each attacher is asked in turn whether the volume is its own. First
    /// the kinds that keep state per volume (they know their volumes by id, whatever the mount
    /// table shows), then the NFS share the mount table shows at the staging path; whatever
    /// else is mounted there (a bind of a directory volume, or anything stacked on it) is
    /// unmounted last, by the bind attacher, which also makes an unstage of a volume that is
    /// not staged a success.
    pub async fn unstage(&self, volume_id: &str, staging: &Path) -> CsiResult<()> {
        if self.replicated.unstage(volume_id, staging).await? == Unstaged::Done {
            return Ok(());
        }
        if self.rbd.unstage(volume_id, staging).await? == Unstaged::Done {
            return Ok(());
        }
        if self.nfs.unstage(volume_id, staging).await? == Unstaged::Done {
            return Ok(());
        }
        self.bind.unstage(volume_id, staging).await.map(drop)
    }

    /// NodeUnpublishVolume: the same for every kind, so it needs no plan. A block volume's
    /// target is a file (with a device node bound onto it), a filesystem's a directory: each is
    /// removed the way it was made.
    pub async fn unpublish(&self, target: &Path) -> CsiResult<()> {
        let sys = self.mounts.clone();
        let target = target.to_owned();
        blocking(move || {
            let is_dir = std::fs::symlink_metadata(&target).map(|m| m.is_dir()).unwrap_or(true);
            ensure_unmounted(sys.as_ref(), &target, is_dir)?;
            if !is_dir {
                match std::fs::remove_file(&target) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(mount_err(format!("removing {}: {e}", target.display())));
                    }
                    _ => {}
                }
            }
            Ok(())
        })
        .await
    }
}
