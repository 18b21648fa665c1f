//! CSI Node: carries out a backend's attachment plan on this node. Each handler reads the
//! mount table, plans (pure, in `mounts` and `nfs`), then executes, so a repeated call finds the
//! work done and does nothing. Executors: `mounts` (bind mounts of directory volumes) and `nfs` (kernel NFS
//! mounts under deadlines) and `rbd` (rbd-fuse + loop device, fenced against a second node);
//! the replicated block executor arrives with its backend.
pub mod mounts;
pub mod bounded;
pub mod mountinfo;
pub mod nfs;
pub mod rbd;

use crate::convert;
use crate::driver::{DIGEST_CONTEXT_KEY, Driver, TOPOLOGY_NODE_KEY, required};
use crate::error::{CsiError, CsiResult};
use mounts::{MountSystem, SourceIdentity};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::node_server::Node;
use wasmcsi_runtime::bindings::types as wt;
use wasmcsi_runtime::driver::{self as wit, Attachment};

#[derive(Clone)]
pub struct NodeService(pub Arc<Driver>);

type Reply<T> = Result<tonic::Response<T>, tonic::Status>;

/// Mount-table work is blocking syscalls: keep it off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> CsiResult<T> + Send + 'static) -> CsiResult<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| CsiError::Internal(format!("node task failed: {e}")))?
}

fn mount_err(e: impl std::fmt::Display) -> CsiError {
    CsiError::Mount(e.to_string())
}

/// Bind `source` onto `target` (read-only if asked), unless that is already so.
fn ensure_bind(sys: &dyn MountSystem, source: &Path, target: &Path, read_only: bool) -> CsiResult<()> {
    let mounts = mountinfo::read_current().map_err(mount_err)?;
    let source_id = mounts::identify(source).map_err(|e| CsiError::NotFound(format!("{}: {e}", source.display())))?;
    let target_exists = target.exists();
    let mounted = !mountinfo::mounts_at(&mounts, target).is_empty();
    let target_id: Option<SourceIdentity> = if mounted { mounts::identify(target).ok() } else { None };
    let plan = mounts::plan_bind(&mounts, source, &source_id, target, target_id, target_exists, read_only)
        .map_err(|e| CsiError::AlreadyExists(e.to_string()))?;
    mounts::execute(sys, &plan).map_err(mount_err)
}

fn ensure_unmounted(sys: &dyn MountSystem, target: &Path, remove_dir: bool) -> CsiResult<()> {
    let mounts = mountinfo::read_current().map_err(mount_err)?;
    let plan = mounts::plan_unmount(&mounts, target, target.exists(), remove_dir);
    mounts::execute(sys, &plan).map_err(mount_err)
}

/// The capability to ask for a plan with when the CO sent none (stats, expand).
fn plain_mount() -> wit::VolumeCapability {
    wit::VolumeCapability {
        access_type: wt::AccessType::Mount(wt::MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: wt::AccessMode::SingleNodeWriter,
    }
}

fn is_read_only_mode(cap: &wit::VolumeCapability) -> bool {
    matches!(cap.access_mode, wt::AccessMode::SingleNodeReaderOnly | wt::AccessMode::MultiNodeReaderOnly)
}

impl NodeService {
    /// Ask the owning backend how this volume attaches.
    async fn plan(
        &self,
        volume_id: &str,
        context: &std::collections::HashMap<String, String>,
        cap: wit::VolumeCapability,
    ) -> CsiResult<(Arc<wasmcsi_runtime::Backend>, Attachment)> {
        let (backend, oid) = self
            .0
            .backend_for_id(volume_id)?
            .ok_or_else(|| CsiError::NotFound(format!("volume {volume_id} not found")))?;
        let mut context = context.clone();
        context.remove(DIGEST_CONTEXT_KEY);
        let plan = backend.attach_plan(oid.local, convert::pairs(&context), cap).await?;
        Ok((backend, plan))
    }

    /// The host directory a bind plan names, if the root is granted on this node.
    fn bind_source(backend: &wasmcsi_runtime::Backend, plan: &wit::BindPlan) -> CsiResult<PathBuf> {
        let root = backend.dir_root(&plan.root).ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "dir root {:?} of backend {} is not granted on this node",
                plan.root, backend.name
            ))
        })?;
        wasmcsi_runtime::resolve_dir_path(root, &plan.path)
            .map_err(|e| CsiError::Internal(format!("backend {} planned an invalid path: {e:?}", backend.name)))
    }

    async fn stage(&self, req: csi::NodeStageVolumeRequest) -> CsiResult<csi::NodeStageVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        let cap = convert::capability(req.volume_capability.as_ref().ok_or(CsiError::Missing("volume_capability"))?)?;
        let _guard = self.0.inflight.try_start(id.to_string())?;
        let (backend, plan) = self.plan(id, &req.volume_context, cap.clone()).await?;
        match plan {
            Attachment::Bind(p) => {
                let source = Self::bind_source(&backend, &p)?;
                let sys = self.0.mounts.clone();
                blocking(move || ensure_bind(sys.as_ref(), &source, &staging, false)).await?;
            }
            Attachment::Nfs(p) => {
                let invalid = |e: String| CsiError::Internal(format!("backend {} planned {e}", backend.name));
                let source = nfs::source_spec(&p.server, &p.share, &p.path).map_err(invalid)?;
                let options = nfs::mount_options(&p.mount_options, false).map_err(invalid)?;
                blocking(move || {
                    let mounts = mountinfo::read_current().map_err(mount_err)?;
                    match nfs::plan_stage(&mounts, &staging, &source) {
                        nfs::StagePlan::Done => Ok(()),
                        nfs::StagePlan::Conflict(why) => Err(CsiError::AlreadyExists(why)),
                        nfs::StagePlan::Mount => nfs::mount_nfs(&source, &staging, &options, nfs::NFS_DEADLINE)
                            .map_err(CsiError::Unavailable),
                    }
                })
                .await?;
            }
            Attachment::Rbd(p) => {
                let req = self.rbd_stage_request(&backend, id, &p, &staging, &cap, &req.secrets)?;
                self.0.rbd.stage(&self.0.node_id, req).await?;
            }
            other => return Err(unsupported(&other)),
        }
        tracing::info!(volume.id = %id, "volume staged");
        Ok(csi::NodeStageVolumeResponse {})
    }

    async fn unstage(&self, req: csi::NodeUnstageVolumeRequest) -> CsiResult<csi::NodeUnstageVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        let _guard = self.0.inflight.try_start(id.to_string())?;
        // An rbd volume has a state directory of its own; everything else is what is mounted
        // at the staging path.
        if self.0.rbd.unstage(&self.0.node_id, id, &staging).await? {
            return Ok(csi::NodeUnstageVolumeResponse {});
        }
        let sys = self.0.mounts.clone();
        blocking(move || {
            // An NFS mount whose server died can block umount in the kernel: bounded, with
            // forced and lazy fallbacks. Everything else goes through the planned unmount.
            let mounts = mountinfo::read_current().map_err(mount_err)?;
            let top = mounts.iter().rev().find(|m| m.mount_point == staging);
            if top.is_some_and(|m| m.fs_type.starts_with("nfs")) {
                let how = nfs::unmount_bounded(&staging, nfs::NFS_DEADLINE).map_err(mount_err)?;
                tracing::info!(path = %staging.display(), ?how, "NFS share unmounted");
            }
            ensure_unmounted(sys.as_ref(), &staging, false)
        })
        .await?;
        Ok(csi::NodeUnstageVolumeResponse {})
    }

    async fn publish(&self, req: csi::NodePublishVolumeRequest) -> CsiResult<csi::NodePublishVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        let cap = convert::capability(req.volume_capability.as_ref().ok_or(CsiError::Missing("volume_capability"))?)?;
        let read_only = req.readonly || is_read_only_mode(&cap);
        let _guard = self.0.inflight.try_start(id.to_string())?;
        // The backend says whether the volume exists (NOT_FOUND) before the mount table is
        // consulted (FAILED_PRECONDITION when it is not staged).
        let block = matches!(cap.access_type, wt::AccessType::Block);
        let (_, plan) = self.plan(id, &req.volume_context, cap).await?;
        let sys = self.0.mounts.clone();
        if let (Attachment::Rbd(_), true) = (&plan, block) {
            // Raw block: the staged loop device node, bind-mounted onto the target file.
            let rbd = self.0.rbd.clone();
            let volume = id.to_owned();
            blocking(move || {
                let (_, device) = rbd.staged_device(&volume)?;
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(mount_err)?;
                }
                if !target.exists() {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(false)
                        .open(&target)
                        .map_err(|e| mount_err(format!("creating {}: {e}", target.display())))?;
                }
                ensure_bind(sys.as_ref(), &device, &target, read_only)
            })
            .await?;
            tracing::info!(volume.id = %id, read_only, "block volume published");
            return Ok(csi::NodePublishVolumeResponse {});
        }
        blocking(move || {
            let mounts = mountinfo::read_current().map_err(mount_err)?;
            if mountinfo::mounts_at(&mounts, &staging).is_empty() {
                return Err(CsiError::FailedPrecondition(format!("volume is not staged at {}", staging.display())));
            }
            ensure_bind(sys.as_ref(), &staging, &target, read_only)
        })
        .await?;
        tracing::info!(volume.id = %id, read_only, "volume published");
        Ok(csi::NodePublishVolumeResponse {})
    }

    async fn unpublish(&self, req: csi::NodeUnpublishVolumeRequest) -> CsiResult<csi::NodeUnpublishVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        let _guard = self.0.inflight.try_start(id.to_string())?;
        let sys = self.0.mounts.clone();
        blocking(move || {
            // A block volume's target is a file (with a device node bound onto it), a
            // filesystem's a directory: each is removed the way it was made.
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
        .await?;
        Ok(csi::NodeUnpublishVolumeResponse {})
    }

    async fn stats(&self, req: csi::NodeGetVolumeStatsRequest) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
        use csi::volume_usage::Unit;
        let id = required(&req.volume_id, "volume_id")?;
        let path = PathBuf::from(required(&req.volume_path, "volume_path")?);
        if !path.exists() {
            return Err(CsiError::NotFound(format!("volume path {} does not exist", path.display())));
        }
        let (backend, plan) = self.plan(id, &Default::default(), plain_mount()).await?;
        if let Attachment::Nfs(_) = plan {
            let local = self.0.backend_for_id(id)?.map(|(_, oid)| oid.local).unwrap_or_default();
            let capacity = match backend.get_volume(local).await {
                Ok(status) => Some(status.volume.capacity_bytes),
                Err(e) => {
                    tracing::debug!(volume = id, error = %e, "no capacity record for NFS stats");
                    None
                }
            };
            return fs_stats(path, "the NFS server of the volume does not answer", None, capacity).await;
        }
        if let Attachment::Rbd(_) = plan {
            let rbd = self.0.rbd.clone();
            let volume = id.to_owned();
            let (state, condition) = blocking(move || Ok((rbd.load(&volume)?, rbd.condition(&volume)))).await?;
            let Some(state) = state else {
                return Err(CsiError::NotFound(format!("volume {id} is not staged on this node")));
            };
            if let (rbd::StagedAs::Block, Some(device)) = (&state.staged_as, &state.loop_device) {
                let size = rbd::block_size_of(device)?;
                return Ok(csi::NodeGetVolumeStatsResponse {
                    usage: vec![csi::VolumeUsage {
                        total: convert::bytes(size),
                        unit: Unit::Bytes as i32,
                        ..Default::default()
                    }],
                    volume_condition: Some(csi::VolumeCondition {
                        abnormal: condition.is_some(),
                        message: condition.unwrap_or_else(|| "healthy".into()),
                    }),
                });
            }
            return fs_stats(path, "the Ceph cluster of the volume does not answer", condition, None).await;
        }
        let Attachment::Bind(p) = plan else { return Err(unsupported(&plan)) };
        let walk = path.clone();
        let (used, inodes_used) = blocking(move || mounts::directory_usage(&walk).map_err(mount_err)).await?;
        let fs = nix::sys::statvfs::statvfs(&path).map_err(mount_err)?;
        let mounted = blocking(move || {
            Ok(!mountinfo::mounts_at(&mountinfo::read_current().map_err(mount_err)?, &path).is_empty())
        })
        .await?;
        let (abnormal, message) = if !mounted {
            (true, "volume path is not mounted".to_string())
        } else if used > p.capacity_bytes {
            (true, format!("uses {used} bytes of its {} byte capacity", p.capacity_bytes))
        } else {
            (false, "healthy".to_string())
        };
        let b = convert::bytes;
        Ok(csi::NodeGetVolumeStatsResponse {
            usage: vec![
                csi::VolumeUsage {
                    available: b(p.capacity_bytes.saturating_sub(used)),
                    total: b(p.capacity_bytes),
                    used: b(used),
                    unit: Unit::Bytes as i32,
                },
                csi::VolumeUsage {
                    available: b(fs.files_free()),
                    total: b(fs.files()),
                    used: b(inodes_used),
                    unit: Unit::Inodes as i32,
                },
            ],
            volume_condition: Some(csi::VolumeCondition { abnormal, message }),
        })
    }

    async fn expand(&self, req: csi::NodeExpandVolumeRequest) -> CsiResult<csi::NodeExpandVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let path = PathBuf::from(required(&req.volume_path, "volume_path")?);
        let range = convert::capacity(req.capacity_range.as_ref())?;
        let cap = req.volume_capability.as_ref().map(convert::capability).transpose()?.unwrap_or_else(plain_mount);
        if !path.exists() {
            return Err(CsiError::NotFound(format!("volume path {} does not exist", path.display())));
        }
        let _guard = self.0.inflight.try_start(id.to_string())?;
        match self.plan(id, &Default::default(), cap).await? {
            // A directory has no filesystem of its own to grow: the new size is bookkeeping.
            (_, Attachment::Bind(p)) => Ok(csi::NodeExpandVolumeResponse {
                capacity_bytes: convert::bytes(p.capacity_bytes.max(range.required_bytes)),
            }),
            // The share has no filesystem of its own on the node either: the controller
            // recorded the new size with the volume.
            (_, Attachment::Nfs(_)) => {
                Ok(csi::NodeExpandVolumeResponse { capacity_bytes: convert::bytes(range.required_bytes) })
            }
            (_, Attachment::Rbd(_)) => {
                let rbd = self.0.rbd.clone();
                let volume = id.to_owned();
                let size = blocking(move || rbd.expand(&volume, range.required_bytes)).await?;
                Ok(csi::NodeExpandVolumeResponse { capacity_bytes: convert::bytes(size) })
            }
            (_, other) => Err(unsupported(&other)),
        }
    }

    /// NodeStageVolume's rbd plan, resolved on this host: the cluster's monitors from the
    /// host configuration, the grant checked (the node executes only what the operator let
    /// this backend use), the credentials from the request's secrets.
    fn rbd_stage_request(
        &self,
        backend: &wasmcsi_runtime::Backend,
        id: &str,
        p: &wit::RbdPlan,
        staging: &Path,
        cap: &wit::VolumeCapability,
        secrets: &std::collections::HashMap<String, String>,
    ) -> CsiResult<rbd::StageRequest> {
        let config = &self.0.registry.runtime().config;
        let cluster = config.clusters.get(&p.cluster).ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "ceph cluster {:?} is not configured on this node ([clusters.{}] in the host config)",
                p.cluster, p.cluster
            ))
        })?;
        let granted =
            config.grants_for(&backend.name).rbd.iter().any(|g| g.cluster == p.cluster && g.pools.contains(&p.pool));
        if !granted {
            return Err(CsiError::FailedPrecondition(format!(
                "pool {:?} of cluster {:?} is not granted to backend {} on this node",
                p.pool, p.cluster, backend.name
            )));
        }
        let staged_as = match &cap.access_type {
            wt::AccessType::Block => rbd::StagedAs::Block,
            wt::AccessType::Mount(m) => {
                if !matches!(m.fs_type.as_str(), "" | "ext4" | "xfs") {
                    return Err(CsiError::Invalid(format!("fs_type {:?} is not supported (ext4, xfs)", m.fs_type)));
                }
                rbd::StagedAs::Filesystem { fs_type: m.fs_type.clone(), mount_flags: m.mount_flags.clone() }
            }
        };
        Ok(rbd::StageRequest {
            volume_id: id.to_owned(),
            cluster: p.cluster.clone(),
            monitors: cluster.monitors.clone(),
            pool: p.pool.clone(),
            image: p.image.clone(),
            creds: rbd::resolve_credentials(&p.secrets, secrets)?,
            staging_path: staging.to_owned(),
            staged_as,
            read_only: is_read_only_mode(cap),
        })
    }
}

/// Stats of a mounted filesystem (an NFS share, a filesystem on an rbd image). Space and inodes
/// from statvfs; with `capacity` (an NFS volume's recorded size) the used bytes are the mounted
/// tree's, walked, so a volume over its size is abnormal. Every filesystem call is bounded: a
/// dead server makes them block, which is then the abnormal condition (`unreachable`) rather
/// than a hung call. `problem` is a known abnormal condition of the attachment.
async fn fs_stats(
    path: PathBuf,
    unreachable: &str,
    problem: Option<String>,
    capacity: Option<u64>,
) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
    use csi::volume_usage::Unit;
    const LIVENESS: std::time::Duration = std::time::Duration::from_secs(10);
    const WALK: std::time::Duration = std::time::Duration::from_secs(60);
    let b = convert::bytes;
    let probe = path.clone();
    let fs = match blocking(move || Ok(bounded::bounded(LIVENESS, move || nix::sys::statvfs::statvfs(&probe)))).await? {
        Some(Ok(fs)) => fs,
        Some(Err(e)) => return Err(mount_err(format!("statvfs {}: {e}", path.display()))),
        None => {
            return Ok(csi::NodeGetVolumeStatsResponse {
                usage: vec![],
                volume_condition: Some(csi::VolumeCondition {
                    abnormal: true,
                    message: format!("{unreachable} ({})", path.display()),
                }),
            });
        }
    };
    let inodes = csi::VolumeUsage {
        available: b(fs.files_available()),
        total: b(fs.files()),
        used: b(fs.files().saturating_sub(fs.files_free())),
        unit: Unit::Inodes as i32,
    };
    let frag = fs.fragment_size();
    let whole_fs = |problem: Option<String>| csi::NodeGetVolumeStatsResponse {
        usage: vec![
            csi::VolumeUsage {
                available: b(fs.blocks_available() * frag),
                total: b(fs.blocks() * frag),
                used: b((fs.blocks() - fs.blocks_free()) * frag),
                unit: Unit::Bytes as i32,
            },
            inodes,
        ],
        volume_condition: Some(csi::VolumeCondition {
            abnormal: problem.is_some(),
            message: problem.unwrap_or_else(|| "healthy".into()),
        }),
    };
    let Some(capacity) = capacity else { return Ok(whole_fs(problem)) };
    let walk = path.clone();
    let used = match blocking(move || Ok(bounded::bounded(WALK, move || mounts::directory_usage(&walk)))).await? {
        Some(Ok((bytes, _))) => bytes,
        Some(Err(e)) => return Err(mount_err(format!("walking {}: {e}", path.display()))),
        // A tree too big to walk in time: the filesystem's numbers are the best there is.
        None => return Ok(whole_fs(problem)),
    };
    let problem =
        problem.or_else(|| (used > capacity).then(|| format!("uses {used} bytes of its {capacity} byte capacity")));
    Ok(csi::NodeGetVolumeStatsResponse {
        usage: vec![
            csi::VolumeUsage {
                available: b(capacity.saturating_sub(used)),
                total: b(capacity),
                used: b(used),
                unit: Unit::Bytes as i32,
            },
            inodes,
        ],
        volume_condition: Some(csi::VolumeCondition {
            abnormal: problem.is_some(),
            message: problem.unwrap_or_else(|| "healthy".into()),
        }),
    })
}

fn unsupported(plan: &Attachment) -> CsiError {
    let kind = match plan {
        Attachment::Bind(_) => "bind",
        Attachment::Nfs(_) => "nfs",
        Attachment::ReplicatedBlock(_) => "replicated-block",
        Attachment::Rbd(_) => "rbd",
    };
    CsiError::FailedPrecondition(format!("this host has no executor for {kind} attachments yet"))
}

pub fn node_capabilities() -> Vec<csi::NodeServiceCapability> {
    use csi::node_service_capability::{Rpc, Type, rpc::Type as R};
    [R::StageUnstageVolume, R::GetVolumeStats, R::ExpandVolume, R::VolumeCondition, R::SingleNodeMultiWriter]
        .into_iter()
        .map(|t| csi::NodeServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
        .collect()
}

#[tonic::async_trait]
impl Node for NodeService {
    #[tracing::instrument(name = "csi.node_stage_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn node_stage_volume(
        &self,
        r: tonic::Request<csi::NodeStageVolumeRequest>,
    ) -> Reply<csi::NodeStageVolumeResponse> {
        self.0.observe("NodeStageVolume", self.stage(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.node_unstage_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn node_unstage_volume(
        &self,
        r: tonic::Request<csi::NodeUnstageVolumeRequest>,
    ) -> Reply<csi::NodeUnstageVolumeResponse> {
        self.0.observe("NodeUnstageVolume", self.unstage(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.node_publish_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn node_publish_volume(
        &self,
        r: tonic::Request<csi::NodePublishVolumeRequest>,
    ) -> Reply<csi::NodePublishVolumeResponse> {
        self.0.observe("NodePublishVolume", self.publish(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.node_unpublish_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn node_unpublish_volume(
        &self,
        r: tonic::Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Reply<csi::NodeUnpublishVolumeResponse> {
        self.0.observe("NodeUnpublishVolume", self.unpublish(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.node_get_volume_stats", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn node_get_volume_stats(
        &self,
        r: tonic::Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Reply<csi::NodeGetVolumeStatsResponse> {
        self.0.observe("NodeGetVolumeStats", self.stats(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.node_expand_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn node_expand_volume(
        &self,
        r: tonic::Request<csi::NodeExpandVolumeRequest>,
    ) -> Reply<csi::NodeExpandVolumeResponse> {
        self.0.observe("NodeExpandVolume", self.expand(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.node_get_capabilities", skip_all)]
    async fn node_get_capabilities(
        &self,
        _: tonic::Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Reply<csi::NodeGetCapabilitiesResponse> {
        self.0
            .observe("NodeGetCapabilities", async {
                Ok(csi::NodeGetCapabilitiesResponse { capabilities: node_capabilities() })
            })
            .await
    }
    #[tracing::instrument(name = "csi.node_get_info", skip_all)]
    async fn node_get_info(&self, _: tonic::Request<csi::NodeGetInfoRequest>) -> Reply<csi::NodeGetInfoResponse> {
        let d = &self.0;
        d.observe("NodeGetInfo", async {
            Ok(csi::NodeGetInfoResponse {
                node_id: d.node_id.clone(),
                max_volumes_per_node: 0,
                accessible_topology: Some(csi::Topology {
                    segments: [(TOPOLOGY_NODE_KEY.to_string(), d.node_id.clone())].into_iter().collect(),
                }),
            })
        })
        .await
    }
}
