//! CSI Node: carries out a backend's attachment plan on this node. [`NodeService`] only routes:
//! it validates the request (the paths it names through `paths`: absolute, spelled as the mount
//! table spells them, never a symlink target), takes the volume's in-flight guard, asks the
//! owning backend for the plan, and hands the plan to the attacher of its kind (`attacher`: the
//! trait, and the one function that picks the attacher). Each kind lives in its own file —
//! `bind` (directory volumes), `nfs` (kernel NFS mounts under deadlines), `rbd` (krbd, or
//! rbd-fuse + loop, fenced against a second node) — on the mount work they share (`mounts`; the
//! mount table is read by the `wasmcsi-mountinfo` crate) and the usage measurements (`usage`); `propagation` checks at start that those
//! mounts reach kubelet at all. Every attacher reads the node's state,
//! plans, then executes, so a repeated call finds the work done and does nothing.
pub mod attacher;
pub mod attachers;
pub mod bind;
pub mod bounded;
pub mod filesystem;
pub mod mount_options;
pub mod mounts;
pub mod nfs;
pub mod paths;
pub mod propagation;
pub mod rbd;
pub mod replicated;
#[cfg(test)]
mod sandbox;
pub mod usage;

pub use attacher::ConfigSource;
pub use attachers::{Attachers, NodeSetup};

use crate::convert;
use crate::error::{CsiError, CsiResult, ObjectKind};
use crate::plugin::{Plugin, TOPOLOGY_NODE_KEY, backend_context, required};
use attacher::{Expand, Publish, Stage, Stats, Volume, blocking, is_read_only_mode};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::node_server::Node;
use wasmcsi_runtime::Backend;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::driver::{self, Attachment};

#[derive(Clone)]
pub struct NodeService(pub Arc<Plugin>);

type Reply<T> = Result<tonic::Response<T>, tonic::Status>;

/// The capability to ask for a plan with when the CO sent none (stats, expand).
fn plain_mount() -> driver::VolumeCapability {
    driver::VolumeCapability {
        access_type: types::AccessType::Mount(types::MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: types::AccessMode::SingleNodeWriter,
    }
}

/// A volume's owner and its plan, as the backend answered.
struct Planned {
    backend: Arc<Backend>,
    local_id: String,
    plan: Attachment,
}

/// A staging path as given: it must be absolute.
fn staging_path(raw: &str) -> CsiResult<PathBuf> {
    let path = PathBuf::from(required(raw, "staging_target_path")?);
    paths::absolute("staging_target_path", &path)?;
    Ok(path)
}

/// The volume path of NodeGetVolumeStats and NodeExpandVolume, resolved ([`paths::resolve`]);
/// NOT_FOUND when nothing is there.
async fn volume_path(raw: &str) -> CsiResult<PathBuf> {
    let path = PathBuf::from(required(raw, "volume_path")?);
    blocking(move || {
        let path = paths::resolve("volume_path", &path)?;
        if !path.exists() {
            return Err(CsiError::NotFound(format!("volume path {} does not exist", path.display())));
        }
        Ok(path)
    })
    .await
}

impl NodeService {
    fn attachers(&self) -> &Attachers {
        &self.0.attachers
    }

    /// Ask the owning backend how this volume attaches.
    async fn plan(
        &self,
        volume_id: &str,
        context: &HashMap<String, String>,
        cap: driver::VolumeCapability,
        secrets: &HashMap<String, String>,
    ) -> CsiResult<Planned> {
        let (backend, oid) = self
            .0
            .backend_for_id(volume_id)?
            .ok_or_else(|| CsiError::ObjectNotFound { kind: ObjectKind::Volume, id: volume_id.to_string() })?;
        // A node-local volume of another node does not exist here, whatever this node's
        // backend would find under the same path.
        if let Some(tag) = oid.node.as_deref().filter(|_| crate::topology::is_node_local(&backend))
            && crate::ids::node_tag(&backend.name, &self.0.node_id) != tag
        {
            return Err(CsiError::NotOnThisNode {
                id: volume_id.to_string(),
                tag: tag.to_string(),
                node: self.0.node_id.clone(),
            });
        }
        let plan =
            backend.attach_plan(oid.local.clone(), backend_context(context), cap, convert::secrets(secrets)).await?;
        Ok(Planned { backend, local_id: oid.local, plan })
    }

    async fn stage(&self, req: csi::NodeStageVolumeRequest) -> CsiResult<csi::NodeStageVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let staging = staging_path(&req.staging_target_path)?;
        let cap = convert::capability(req.volume_capability.as_ref().ok_or(CsiError::Missing("volume_capability"))?)?;
        let _guard = self.0.inflight.try_start(id.to_string())?;
        let Planned { backend, local_id, plan } = self.plan(id, &req.volume_context, cap.clone(), &req.secrets).await?;
        let call = Stage {
            volume: Volume { id, local_id: &local_id, backend: &backend },
            staging: &staging,
            capability: &cap,
            secrets: &req.secrets,
            publish_context: &req.publish_context,
        };
        self.attachers().route(plan)?.stage(&call).await?;
        tracing::info!(volume.id = %id, "volume staged");
        Ok(csi::NodeStageVolumeResponse {})
    }

    async fn unstage(&self, req: csi::NodeUnstageVolumeRequest) -> CsiResult<csi::NodeUnstageVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let staging = staging_path(&req.staging_target_path)?;
        let _guard = self.0.inflight.try_start(id.to_string())?;
        // No plan: the backend may be gone by now, and the node's state says what is staged.
        self.attachers().unstage(id, &staging).await?;
        Ok(csi::NodeUnstageVolumeResponse {})
    }

    async fn publish(&self, req: csi::NodePublishVolumeRequest) -> CsiResult<csi::NodePublishVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        let staging = staging_path(&req.staging_target_path)?;
        let cap = convert::capability(req.volume_capability.as_ref().ok_or(CsiError::Missing("volume_capability"))?)?;
        let target = blocking(move || paths::resolve("target_path", &target)).await?;
        let read_only = req.readonly || is_read_only_mode(&cap);
        let _guard = self.0.inflight.try_start(id.to_string())?;
        // The backend says whether the volume exists (NOT_FOUND) before the mount table is
        // consulted (FAILED_PRECONDITION when it is not staged).
        // The plan's secrets are NodeStageVolume's; publishing needs none of them.
        let Planned { backend, local_id, plan } =
            self.plan(id, &req.volume_context, cap.clone(), &Default::default()).await?;
        let call = Publish {
            volume: Volume { id, local_id: &local_id, backend: &backend },
            staging: &staging,
            target: &target,
            capability: &cap,
            read_only,
        };
        self.attachers().route(plan)?.publish(&call).await?;
        tracing::info!(volume.id = %id, read_only, "volume published");
        Ok(csi::NodePublishVolumeResponse {})
    }

    async fn unpublish(&self, req: csi::NodeUnpublishVolumeRequest) -> CsiResult<csi::NodeUnpublishVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        let target = blocking(move || paths::spell("target_path", &target)).await?;
        let _guard = self.0.inflight.try_start(id.to_string())?;
        self.attachers().unpublish(&target).await?;
        Ok(csi::NodeUnpublishVolumeResponse {})
    }

    async fn stats(&self, req: csi::NodeGetVolumeStatsRequest) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        required(&req.volume_path, "volume_path")?;
        // The volume first: an unknown volume is NOT_FOUND whatever path came with it (the
        // spec's order; a CO probing a gone volume sends any path).
        let Planned { backend, local_id, plan } =
            self.plan(id, &Default::default(), plain_mount(), &Default::default()).await?;
        let path = volume_path(&req.volume_path).await?;
        let call = Stats { volume: Volume { id, local_id: &local_id, backend: &backend }, path: &path };
        self.attachers().route(plan)?.stats(&call).await
    }

    async fn expand(&self, req: csi::NodeExpandVolumeRequest) -> CsiResult<csi::NodeExpandVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        required(&req.volume_path, "volume_path")?;
        let range = convert::capacity(req.capacity_range.as_ref())?;
        let cap = req.volume_capability.as_ref().map(convert::capability).transpose()?.unwrap_or_else(plain_mount);
        let _guard = self.0.inflight.try_start(id.to_string())?;
        // The volume before its path, as for stats.
        let Planned { backend, local_id, plan } = self.plan(id, &Default::default(), cap, &Default::default()).await?;
        let path = volume_path(&req.volume_path).await?;
        let call = Expand {
            volume: Volume { id, local_id: &local_id, backend: &backend },
            path: &path,
            required_bytes: range.required_bytes,
        };
        let capacity = self.attachers().route(plan)?.expand(&call).await?;
        Ok(csi::NodeExpandVolumeResponse { capacity_bytes: convert::bytes(capacity) })
    }
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
