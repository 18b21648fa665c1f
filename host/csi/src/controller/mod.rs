//! CSI Controller: validates each request as the spec asks, routes it to the backend that
//! owns it, and checks the backend's answer before it reaches Kubernetes. ControllerPublish
//! gives a replicated block volume to one node (the host's own mechanism: it raises the
//! volume's epoch on its replicas, see `docs/replicated-block.md`); for every other attachment
//! kind it checks the volume exists and answers with an empty publish context. A replicated
//! volume's publish context carries the node's grant of it (`grant`). Every publish first asks
//! the node directory whether its node exists (`node_directory`): NOT_FOUND when it is certainly
//! none, before any backend is asked.
//! ControllerModifyVolume (a VolumeAttributesClass) goes to the volume's backend whole: the
//! backend applies every key or none, and names the one it refuses. MODIFY_VOLUME is advertised
//! while at least one backend declares `modify-volume`; for a volume of a backend that does not,
//! every key is one it does not take: INVALID_ARGUMENT naming it (as at CreateVolume).
//!
//! Every call on a backend takes one path before its own work (`pipeline`): resolve the
//! backend and object, check the feature, route, guard, gate. A call on a node-local
//! backend's volume runs on the node that holds it (`topology`): a controller that is not that
//! node forwards it whole to the node plugin (`peer`) and answers what the node answered; the
//! node runs it here and pins what it made to itself.
pub mod grant;
mod listing;
mod pipeline;

use crate::answer;
use crate::convert::{self, bytes};
use crate::error::{CsiError, CsiResult, ObjectKind};
use crate::guard::Side;
use crate::ids::ObjectId;
use crate::plugin::{Plugin, backend_context, backend_parameters, required};
use pipeline::{Hold, NewVolume, OnObject, Unknown, need};
use std::sync::Arc;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_server::Controller;
use wasmcsi_runtime::Backend;
use wasmcsi_runtime::driver::{self, Feature};
use wasmcsi_runtime::secret_refs;

#[derive(Clone)]
pub struct ControllerService(pub Arc<Plugin>);

type Reply<T> = Result<tonic::Response<T>, tonic::Status>;

/// A content source must name an object of the same backend (a volume cannot be cloned
/// across backends: each owns its storage). The source as the backend sees it, and its id.
fn content_source(
    d: &Plugin,
    backend: &Backend,
    src: &csi::VolumeContentSource,
) -> CsiResult<(driver::ContentSource, ObjectId)> {
    use csi::volume_content_source::Type;
    let (id, is_snapshot) = match &src.r#type {
        Some(Type::Snapshot(s)) => (required(&s.snapshot_id, "volume_content_source.snapshot.snapshot_id")?, true),
        Some(Type::Volume(v)) => (required(&v.volume_id, "volume_content_source.volume.volume_id")?, false),
        None => return Err(CsiError::Missing("volume_content_source.type")),
    };
    let (owner, oid) = d
        .backend_for_id(id)?
        .ok_or_else(|| CsiError::ObjectNotFound { kind: ObjectKind::ContentSource, id: id.to_string() })?;
    if owner.name != backend.name {
        return Err(CsiError::Invalid(format!(
            "content source {id} belongs to backend {}, not {}",
            owner.name, backend.name
        )));
    }
    if is_snapshot {
        Ok((driver::ContentSource::Snapshot(oid.local.clone()), oid))
    } else {
        need(backend, Feature::CloneVolume, "cloning volumes")?;
        Ok((driver::ContentSource::Volume(oid.local.clone()), oid))
    }
}

/// The parameters of a class GetCapacity passes to its backend: those the backend declares
/// (`backend-info.parameters`) and the CO's own (`csi.storage.k8s.io/…`). A parameter the
/// backend does not take cannot change its capacity, and refusing it here would hide it: the
/// external-provisioner logs a failed GetCapacity and publishes no CSIStorageCapacity, so the
/// scheduler answers a WaitForFirstConsumer claim "not enough free storage" and CreateVolume,
/// whose INVALID_ARGUMENT the provisioner shows on the claim (a ProvisioningFailed event),
/// never runs. CreateVolume gets every parameter and refuses the unknown one there.
fn capacity_parameters(declared: &[String], mut parameters: Vec<driver::Pair>) -> Vec<driver::Pair> {
    parameters.retain(|p| p.key.starts_with(CO_PARAMETER_PREFIX) || declared.contains(&p.key));
    parameters
}

/// The prefix of the parameters the CO itself adds or reads (secrets, fstype, PVC metadata).
const CO_PARAMETER_PREFIX: &str = "csi.storage.k8s.io/";

/// The capability to ask for a plan with when the CO sent none (unpublish).
fn plain_mount() -> driver::VolumeCapability {
    use wasmcsi_runtime::bindings::types;
    driver::VolumeCapability {
        access_type: types::AccessType::Mount(types::MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: types::AccessMode::SingleNodeWriter,
    }
}

/// The replica sets a backend that planned a replicated block attachment may reach.
fn block_catalog(backend: &Backend) -> CsiResult<&wasmcsi_block::catalog::Catalog> {
    backend.block_catalog().ok_or_else(|| CsiError::NoBlockGrant { backend: backend.name.clone() })
}

impl ControllerService {
    /// A snapshot a node-local backend made here, its ids pinned to this node.
    fn pin_snapshot(&self, backend: &Backend, mut s: csi::Snapshot) -> CsiResult<csi::Snapshot> {
        s.snapshot_id = self.0.pin_id(backend, &s.snapshot_id)?;
        s.source_volume_id = self.0.pin_id(backend, &s.source_volume_id)?;
        Ok(s)
    }

    async fn create_volume(&self, req: csi::CreateVolumeRequest) -> CsiResult<csi::CreateVolumeResponse> {
        let d = &self.0;
        let name = required(&req.name, "name")?;
        crate::ids::check_name("name", name)?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::Missing("volume_capabilities"));
        }
        let capabilities = convert::capabilities(&req.volume_capabilities)?;
        let capacity = convert::capacity(req.capacity_range.as_ref())?;
        let (backend, parameters) = d.backend_for_parameters(&req.parameters)?;
        need(&backend, Feature::CreateDeleteVolume, "creating volumes")?;
        // The spec lets a CO send these only to a plugin with MODIFY_VOLUME: a backend that
        // cannot apply them must not create the volume without them.
        if let Some(key) = req.mutable_parameters.keys().min()
            && !backend.has_feature(driver::Feature::ModifyVolume)
        {
            return Err(CsiError::Invalid(format!(
                "mutable parameter {key:?}: backend {} does not support modifying volumes",
                backend.name
            )));
        }
        let (source, source_oid) = match &req.volume_content_source {
            Some(s) => content_source(d, &backend, s).map(|(s, oid)| (Some(s), Some(oid)))?,
            None => (None, None),
        };
        let call = NewVolume {
            backend: &backend,
            accessibility: req.accessibility_requirements.as_ref(),
            source: source_oid.as_ref(),
            hold: Hold::gated(format!("create-volume/{name}"), Side::Create, format!("volume {name}")),
        };
        self.on_new_volume(&req, call, async || {
            let secrets = convert::secrets(&req.secrets);
            let request = driver::CreateVolumeRequest {
                name: name.to_string(),
                capacity,
                capabilities,
                parameters,
                secrets: secret_refs(&secrets),
                content_source: source,
                accessibility: req.accessibility_requirements.as_ref().map(|t| driver::TopologyRequirement {
                    requisite: t.requisite.iter().map(convert::topology).collect(),
                    preferred: t.preferred.iter().map(convert::topology).collect(),
                }),
                mutable_parameters: convert::pairs(&req.mutable_parameters),
            };
            let created = backend.create_volume(request, secrets).await?;
            let mut volume = answer::created(&backend, &created, &capacity)?;
            d.pin_volume(&backend, &mut volume)?;
            // The first creation records which build made the volume; retries keep that record.
            let record = d
                .registry
                .journal_created(&backend, &volume.volume_id, created.capacity_bytes)
                .map_err(|source| CsiError::Journal { subject: format!("volume {}", volume.volume_id), source })?;
            volume.volume_context.insert(crate::plugin::DIGEST_CONTEXT_KEY.into(), record.digest);
            volume.content_source = req.volume_content_source.clone();
            tracing::info!(volume.id = %volume.volume_id, bytes = volume.capacity_bytes, "volume ready");
            Ok(csi::CreateVolumeResponse { volume: Some(volume) })
        })
        .await
    }

    async fn delete_volume(&self, req: csi::DeleteVolumeRequest) -> CsiResult<csi::DeleteVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        // An id that cannot be ours names no volume: deleting it succeeds (idempotency).
        let call = OnObject::new(id, Unknown::Nothing)
            .needs(Feature::CreateDeleteVolume, "deleting volumes")
            .exclusive(Side::Existing);
        self.on_object(&req, call, async |backend, oid| {
            backend.delete_volume(oid.local, convert::secrets(&req.secrets)).await?;
            self.0
                .registry
                .journal_deleted(id)
                .map_err(|source| CsiError::Journal { subject: format!("volume {id}"), source })?;
            tracing::info!(volume.id = %id, "volume deleted");
            Ok(csi::DeleteVolumeResponse {})
        })
        .await
    }

    async fn validate(
        &self,
        req: csi::ValidateVolumeCapabilitiesRequest,
    ) -> CsiResult<csi::ValidateVolumeCapabilitiesResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::Missing("volume_capabilities"));
        }
        let caps = convert::capabilities(&req.volume_capabilities)?;
        let call = OnObject::new(id, Unknown::NotFound(ObjectKind::Volume));
        self.on_object(&req, call, async |backend, oid| {
            let context = backend_context(&req.volume_context);
            let verdict = backend
                .validate_volume_capabilities(oid.local, context, caps, backend_parameters(&req.parameters))
                .await?;
            Ok(match verdict {
                None => csi::ValidateVolumeCapabilitiesResponse {
                    confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                        volume_context: req.volume_context.clone(),
                        volume_capabilities: req.volume_capabilities.clone(),
                        parameters: req.parameters.clone(),
                        mutable_parameters: Default::default(),
                    }),
                    message: String::new(),
                },
                Some(message) => {
                    csi::ValidateVolumeCapabilitiesResponse { confirmed: None, message: answer::message(&message) }
                }
            })
        })
        .await
    }

    fn capable(&self, f: Feature) -> Vec<Arc<Backend>> {
        self.0.registry.all().into_iter().filter(|b| b.has_feature(f)).collect()
    }

    async fn get_capacity(&self, req: csi::GetCapacityRequest) -> CsiResult<csi::GetCapacityResponse> {
        let caps = convert::capabilities(&req.volume_capabilities)?;
        let topology = req.accessible_topology.as_ref().map(convert::topology);
        // With a StorageClass: that backend. Without one: the sum over every backend that
        // reports capacity, so a bare GetCapacity still answers.
        let single = req.parameters.contains_key(crate::plugin::BACKEND_PARAMETER);
        let (backends, params) = if single {
            let (b, p) = self.0.backend_for_parameters(&req.parameters)?;
            need(&b, Feature::GetCapacity, "GetCapacity")?;
            if let Some(elsewhere) = self.capacity_elsewhere(&b, &req).await? {
                return Ok(elsewhere);
            }
            let p = capacity_parameters(&b.info.parameters, p);
            (vec![b], p)
        } else {
            (self.capable(Feature::GetCapacity), convert::pairs(&req.parameters))
        };
        let mut total = driver::Capacity { available_bytes: 0, maximum_volume_bytes: 0, minimum_volume_bytes: 0 };
        // Every backend at once: a hung one costs its deadline, not the sum of all of them.
        let answers = futures::future::join_all(backends.iter().map(|b| {
            let (caps, params, topology) = (caps.clone(), params.clone(), topology.clone());
            async move {
                let c = b.get_capacity(caps, params, topology).await?;
                answer::capacity(b, &c).map(|()| c)
            }
        }))
        .await;
        for (b, answer) in backends.iter().zip(answers) {
            match answer {
                Ok(c) => {
                    total.available_bytes = total.available_bytes.saturating_add(c.available_bytes);
                    total.maximum_volume_bytes = total.maximum_volume_bytes.max(c.maximum_volume_bytes);
                    total.minimum_volume_bytes = c.minimum_volume_bytes;
                }
                Err(e) if single => return Err(e),
                Err(e) => tracing::debug!(backend = %b.name, "capacity not counted: {e}"),
            }
        }
        Ok(csi::GetCapacityResponse {
            available_capacity: bytes(total.available_bytes),
            maximum_volume_size: (total.maximum_volume_bytes > 0).then(|| bytes(total.maximum_volume_bytes)),
            minimum_volume_size: (single && total.minimum_volume_bytes > 0).then(|| bytes(total.minimum_volume_bytes)),
        })
    }

    /// GetCapacity of a node-local backend, per node: the node the topology names answers for
    /// itself (forwarded there unless it is this one); a node no plugin answers for has none;
    /// without a node, a controller sums every node's. `None`: this host answers, here.
    async fn capacity_elsewhere(
        &self,
        backend: &Backend,
        req: &csi::GetCapacityRequest,
    ) -> CsiResult<Option<csi::GetCapacityResponse>> {
        let d = &self.0;
        if !crate::topology::is_node_local(backend) {
            return Ok(None);
        }
        let asked = req.accessible_topology.as_ref().and_then(|t| t.segments.get(crate::plugin::TOPOLOGY_NODE_KEY));
        let peers = d.node_local.peers.as_ref();
        let forward = |node: String| {
            let mut req = req.clone();
            req.accessible_topology = Some(crate::topology::node_topology(&node));
            async move { self.forward(&node, backend, req).await }
        };
        match (asked, peers) {
            (Some(node), _) if d.mode.node() && *node == d.node_id => Ok(None),
            (Some(node), Some(p)) if p.knows(node).await => forward(node.clone()).await.map(Some),
            (Some(_), _) => Ok(Some(csi::GetCapacityResponse::default())),
            (None, Some(p)) if !d.mode.node() => {
                let answers = futures::future::join_all(p.node_names().await.into_iter().map(forward)).await;
                let mut total = csi::GetCapacityResponse::default();
                for answer in answers {
                    match answer {
                        Ok(c) => {
                            total.available_capacity = total.available_capacity.saturating_add(c.available_capacity);
                            total.maximum_volume_size = total.maximum_volume_size.max(c.maximum_volume_size);
                        }
                        Err(e) => tracing::debug!(backend = %backend.name, "a node's capacity not counted: {e}"),
                    }
                }
                Ok(Some(total))
            }
            (None, _) => Ok(None),
        }
    }

    async fn create_snapshot(&self, req: csi::CreateSnapshotRequest) -> CsiResult<csi::CreateSnapshotResponse> {
        let source = required(&req.source_volume_id, "source_volume_id")?;
        let name = required(&req.name, "name")?;
        crate::ids::check_name("name", name)?;
        let call = OnObject::new(source, Unknown::NotFound(ObjectKind::SourceVolume))
            .needs(Feature::CreateDeleteSnapshot, "snapshots")
            .holding(Hold::gated(format!("create-snapshot/{name}"), Side::Create, format!("snapshot {name}")));
        self.on_object(&req, call, async |backend, oid| {
            let local_source = oid.local.clone();
            let params = backend_parameters(&req.parameters);
            let secrets = convert::secrets(&req.secrets);
            let s = backend.create_snapshot(name.to_string(), oid.local, params, secrets).await?;
            if s.source_volume_id != local_source {
                return Err(backend
                    .reject_output(
                        "create_snapshot",
                        format!("snapshotted {} instead of {local_source}", s.source_volume_id),
                    )
                    .into());
            }
            let snapshot = self.pin_snapshot(&backend, answer::snapshot(&backend, "create_snapshot", &s)?)?;
            Ok(csi::CreateSnapshotResponse { snapshot: Some(snapshot) })
        })
        .await
    }

    async fn delete_snapshot(&self, req: csi::DeleteSnapshotRequest) -> CsiResult<csi::DeleteSnapshotResponse> {
        let id = required(&req.snapshot_id, "snapshot_id")?;
        let call = OnObject::new(id, Unknown::Nothing)
            .needs(Feature::CreateDeleteSnapshot, "snapshots")
            .exclusive(Side::Existing);
        self.on_object(&req, call, async |backend, oid| {
            backend.delete_snapshot(oid.local, convert::secrets(&req.secrets)).await?;
            Ok(csi::DeleteSnapshotResponse {})
        })
        .await
    }

    /// GetSnapshot. A backend with the `get-snapshot` feature answers it; one that only lists
    /// snapshots (a guest of an older contract) is asked for the list filtered by the id. Either
    /// way the answer must be the snapshot asked for: a backend that answers another one is
    /// refused (INTERNAL), never passed on as if it were the one the CO named.
    async fn get_snapshot(&self, req: csi::GetSnapshotRequest) -> CsiResult<csi::GetSnapshotResponse> {
        let id = required(&req.snapshot_id, "snapshot_id")?;
        let not_found = || CsiError::ObjectNotFound { kind: ObjectKind::Snapshot, id: id.to_string() };
        // An id that cannot be ours names no snapshot.
        let call = OnObject::new(id, Unknown::NotFound(ObjectKind::Snapshot));
        self.on_object(&req, call, async |backend, oid| {
            let found = if backend.has_feature(Feature::GetSnapshot) {
                backend.get_snapshot(oid.local.clone()).await?
            } else {
                need(&backend, Feature::ListSnapshots, "GetSnapshot")?;
                let page = backend.list_snapshots(Some(oid.local.clone()), None, 1, String::new()).await?;
                page.entries.into_iter().find(|s| s.snapshot_id == oid.local).ok_or_else(not_found)?
            };
            if found.snapshot_id != oid.local {
                return Err(backend
                    .reject_output("get_snapshot", format!("answered snapshot {} for {}", found.snapshot_id, oid.local))
                    .into());
            }
            let snapshot = self.pin_snapshot(&backend, answer::snapshot(&backend, "get_snapshot", &found)?)?;
            Ok(csi::GetSnapshotResponse { snapshot: Some(snapshot) })
        })
        .await
    }

    async fn expand(&self, req: csi::ControllerExpandVolumeRequest) -> CsiResult<csi::ControllerExpandVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let range = convert::capacity(Some(req.capacity_range.as_ref().ok_or(CsiError::Missing("capacity_range"))?))?;
        let capability = req.volume_capability.as_ref().map(convert::capability).transpose()?;
        let call = OnObject::new(id, Unknown::NotFound(ObjectKind::Volume))
            .needs(Feature::ExpandVolume, "expansion")
            .exclusive(Side::Existing);
        self.on_object(&req, call, async |backend, oid| {
            let e = backend.expand_volume(oid.local, range, capability, convert::secrets(&req.secrets)).await?;
            Ok(csi::ControllerExpandVolumeResponse {
                capacity_bytes: answer::expansion(&backend, &e, &range)?,
                node_expansion_required: e.node_expansion_required,
            })
        })
        .await
    }

    /// The volume's attachment plan, asked of its backend; `None` when the backend does not
    /// know the volume.
    async fn plan_of(
        backend: &Arc<Backend>,
        oid: ObjectId,
        context: &std::collections::HashMap<String, String>,
        cap: driver::VolumeCapability,
    ) -> CsiResult<Option<driver::Attachment>> {
        // The controller reads a plan for its kind only: no NodeStageVolume secrets to give.
        match backend.attach_plan(oid.local, backend_context(context), cap, Vec::new()).await {
            Ok(plan) => Ok(Some(plan)),
            Err(wasmcsi_runtime::CallError::Backend { error: wasmcsi_runtime::WitError::NotFound(_), .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn publish(
        &self,
        req: csi::ControllerPublishVolumeRequest,
    ) -> CsiResult<csi::ControllerPublishVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let node = required(&req.node_id, "node_id")?;
        let cap = convert::capability(req.volume_capability.as_ref().ok_or(CsiError::Missing("volume_capability"))?)?;
        // Before any backend sees it: a node no node has is NOT_FOUND on every backend, and
        // becomes nothing (an owner, a grant).
        self.0.check_node(node).await?;
        let not_found = || CsiError::ObjectNotFound { kind: ObjectKind::Volume, id: id.to_string() };
        let call = OnObject::new(id, Unknown::NotFound(ObjectKind::Volume)).guarded();
        self.on_object(&req, call, async |backend, oid| {
            let plan = Self::plan_of(&backend, oid, &req.volume_context, cap).await?.ok_or_else(not_found)?;
            if let driver::Attachment::ReplicatedBlock(p) = plan {
                let catalog = block_catalog(&backend)?;
                let epoch = catalog.claim(&p.volume_id, node).await?;
                tracing::info!(volume.id = %id, node, epoch, "replicated volume published");
                let publish_context = grant::publish_context(self.0.grant_signer.as_ref(), &p.volume_id, node, epoch)?;
                return Ok(csi::ControllerPublishVolumeResponse { publish_context });
            }
            Ok(csi::ControllerPublishVolumeResponse { publish_context: Default::default() })
        })
        .await
    }

    async fn unpublish(
        &self,
        req: csi::ControllerUnpublishVolumeRequest,
    ) -> CsiResult<csi::ControllerUnpublishVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        // A volume that is gone (or never was ours) is unpublished everywhere.
        let call = OnObject::new(id, Unknown::Nothing).guarded();
        self.on_object(&req, call, async |backend, oid| {
            let Some(plan) = Self::plan_of(&backend, oid, &Default::default(), plain_mount()).await? else {
                return Ok(csi::ControllerUnpublishVolumeResponse {});
            };
            if let driver::Attachment::ReplicatedBlock(p) = plan {
                let catalog = block_catalog(&backend)?;
                // An empty node id means every node (the spec's unpublish from all).
                let node = (!req.node_id.is_empty()).then_some(req.node_id.as_str());
                catalog.release(&p.volume_id, node).await?;
                tracing::info!(volume.id = %id, node = ?node, "replicated volume unpublished");
            }
            Ok(csi::ControllerUnpublishVolumeResponse {})
        })
        .await
    }

    /// ControllerModifyVolume: the mutable parameters go to the backend as they are (only it
    /// knows its keys); it applies all of them or none, so a retry of the same parameters is
    /// a no-op and an unknown key leaves the volume as it was.
    async fn modify(&self, req: csi::ControllerModifyVolumeRequest) -> CsiResult<csi::ControllerModifyVolumeResponse> {
        if self.capable(Feature::ModifyVolume).is_empty() {
            return Err(CsiError::Unimplemented(
                "ControllerModifyVolume: no backend of this plugin modifies volumes (MODIFY_VOLUME is not offered)"
                    .into(),
            ));
        }
        let id = required(&req.volume_id, "volume_id")?;
        // REQUIRED by the spec: a modification that names nothing to change is malformed.
        if req.mutable_parameters.is_empty() {
            return Err(CsiError::Missing("mutable_parameters"));
        }
        let call = OnObject::new(id, Unknown::NotFound(ObjectKind::Volume)).exclusive(Side::Existing);
        self.on_object(&req, call, async |backend, oid| {
            // Not UNIMPLEMENTED: the plugin offers MODIFY_VOLUME (another backend modifies), and
            // what this volume's backend cannot apply is a parameter it does not take, which
            // the resizer reports as infeasible instead of retrying it for ever.
            if !backend.has_feature(driver::Feature::ModifyVolume) {
                // The spec's order: an unknown volume is NOT_FOUND before its parameters are
                // judged (a backend without GetVolume cannot tell; its answer is about the keys).
                if backend.has_feature(Feature::GetVolume) {
                    backend.get_volume(oid.local.clone()).await?;
                }
                let key = req.mutable_parameters.keys().min().map(String::as_str).unwrap_or_default();
                return Err(CsiError::Invalid(format!(
                    "mutable parameter {key:?}: backend {} takes none (it does not modify volumes)",
                    backend.name
                )));
            }
            let parameters = convert::pairs(&req.mutable_parameters);
            backend.modify_volume(oid.local, parameters, convert::secrets(&req.secrets)).await?;
            let keys: Vec<&String> = req.mutable_parameters.keys().collect();
            tracing::info!(volume.id = %id, ?keys, "volume modified");
            Ok(csi::ControllerModifyVolumeResponse {})
        })
        .await
    }

    async fn get_volume(&self, req: csi::ControllerGetVolumeRequest) -> CsiResult<csi::ControllerGetVolumeResponse> {
        let id = required(&req.volume_id, "volume_id")?;
        let call =
            OnObject::new(id, Unknown::NotFound(ObjectKind::Volume)).needs(Feature::GetVolume, "ControllerGetVolume");
        self.on_object(&req, call, async |backend, oid| {
            let st = backend.get_volume(oid.local.clone()).await?;
            let mut volume = answer::volume(&backend, "get_volume", &st.volume, Some(oid.local.as_str()))?;
            self.0.pin_volume(&backend, &mut volume)?;
            Ok(csi::ControllerGetVolumeResponse {
                volume: Some(volume),
                status: Some(csi::controller_get_volume_response::VolumeStatus {
                    published_node_ids: vec![],
                    volume_condition: st.condition.as_ref().map(answer::condition),
                }),
            })
        })
        .await
    }
}

/// What the controller offers; per backend, a missing feature is answered UNIMPLEMENTED.
/// MODIFY_VOLUME only when some backend can modify (`modifiable`): a CO that sees it sends
/// `mutable_parameters` at creation too, which a plugin that cannot apply them must refuse.
pub fn controller_capabilities(modifiable: bool) -> Vec<csi::ControllerServiceCapability> {
    use csi::controller_service_capability::{Rpc, Type, rpc::Type as R};
    [
        R::CreateDeleteVolume,
        R::PublishUnpublishVolume,
        R::CreateDeleteSnapshot,
        R::ListSnapshots,
        R::GetSnapshot,
        R::CloneVolume,
        R::ExpandVolume,
        R::GetCapacity,
        R::ListVolumes,
        R::GetVolume,
        R::VolumeCondition,
        R::SingleNodeMultiWriter,
    ]
    .into_iter()
    .chain(modifiable.then_some(R::ModifyVolume))
    .map(|t| csi::ControllerServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
    .collect()
}

#[tonic::async_trait]
impl Controller for ControllerService {
    #[tracing::instrument(name = "csi.create_volume", skip_all, fields(volume.name = %r.get_ref().name))]
    async fn create_volume(&self, r: tonic::Request<csi::CreateVolumeRequest>) -> Reply<csi::CreateVolumeResponse> {
        self.0.observe("CreateVolume", Self::create_volume(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.delete_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn delete_volume(&self, r: tonic::Request<csi::DeleteVolumeRequest>) -> Reply<csi::DeleteVolumeResponse> {
        self.0.observe("DeleteVolume", Self::delete_volume(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_publish_volume", skip_all, fields(volume.id = %r.get_ref().volume_id, node.id = %r.get_ref().node_id))]
    async fn controller_publish_volume(
        &self,
        r: tonic::Request<csi::ControllerPublishVolumeRequest>,
    ) -> Reply<csi::ControllerPublishVolumeResponse> {
        self.0.observe("ControllerPublishVolume", self.publish(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_unpublish_volume", skip_all, fields(volume.id = %r.get_ref().volume_id, node.id = %r.get_ref().node_id))]
    async fn controller_unpublish_volume(
        &self,
        r: tonic::Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Reply<csi::ControllerUnpublishVolumeResponse> {
        self.0.observe("ControllerUnpublishVolume", self.unpublish(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.validate_volume_capabilities", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn validate_volume_capabilities(
        &self,
        r: tonic::Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Reply<csi::ValidateVolumeCapabilitiesResponse> {
        self.0.observe("ValidateVolumeCapabilities", self.validate(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.list_volumes", skip_all)]
    async fn list_volumes(&self, r: tonic::Request<csi::ListVolumesRequest>) -> Reply<csi::ListVolumesResponse> {
        self.0.observe("ListVolumes", Self::list_volumes(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.get_capacity", skip_all)]
    async fn get_capacity(&self, r: tonic::Request<csi::GetCapacityRequest>) -> Reply<csi::GetCapacityResponse> {
        self.0.observe("GetCapacity", Self::get_capacity(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_get_capabilities", skip_all)]
    async fn controller_get_capabilities(
        &self,
        _: tonic::Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Reply<csi::ControllerGetCapabilitiesResponse> {
        self.0
            .observe("ControllerGetCapabilities", async {
                let modifiable = !self.capable(Feature::ModifyVolume).is_empty();
                Ok(csi::ControllerGetCapabilitiesResponse { capabilities: controller_capabilities(modifiable) })
            })
            .await
    }
    #[tracing::instrument(name = "csi.create_snapshot", skip_all, fields(snapshot.name = %r.get_ref().name))]
    async fn create_snapshot(
        &self,
        r: tonic::Request<csi::CreateSnapshotRequest>,
    ) -> Reply<csi::CreateSnapshotResponse> {
        self.0.observe("CreateSnapshot", Self::create_snapshot(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.delete_snapshot", skip_all, fields(snapshot.id = %r.get_ref().snapshot_id))]
    async fn delete_snapshot(
        &self,
        r: tonic::Request<csi::DeleteSnapshotRequest>,
    ) -> Reply<csi::DeleteSnapshotResponse> {
        self.0.observe("DeleteSnapshot", Self::delete_snapshot(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.list_snapshots", skip_all)]
    async fn list_snapshots(&self, r: tonic::Request<csi::ListSnapshotsRequest>) -> Reply<csi::ListSnapshotsResponse> {
        self.0.observe("ListSnapshots", Self::list_snapshots(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.get_snapshot", skip_all, fields(snapshot.id = %r.get_ref().snapshot_id))]
    async fn get_snapshot(&self, r: tonic::Request<csi::GetSnapshotRequest>) -> Reply<csi::GetSnapshotResponse> {
        self.0.observe("GetSnapshot", Self::get_snapshot(self, r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_expand_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn controller_expand_volume(
        &self,
        r: tonic::Request<csi::ControllerExpandVolumeRequest>,
    ) -> Reply<csi::ControllerExpandVolumeResponse> {
        self.0.observe("ControllerExpandVolume", self.expand(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_get_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn controller_get_volume(
        &self,
        r: tonic::Request<csi::ControllerGetVolumeRequest>,
    ) -> Reply<csi::ControllerGetVolumeResponse> {
        self.0.observe("ControllerGetVolume", self.get_volume(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.controller_modify_volume", skip_all, fields(volume.id = %r.get_ref().volume_id))]
    async fn controller_modify_volume(
        &self,
        r: tonic::Request<csi::ControllerModifyVolumeRequest>,
    ) -> Reply<csi::ControllerModifyVolumeResponse> {
        self.0.observe("ControllerModifyVolume", self.modify(r.into_inner())).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(kv: &[(&str, &str)]) -> Vec<driver::Pair> {
        kv.iter().map(|(k, v)| driver::Pair { key: (*k).into(), value: (*v).into() }).collect()
    }

    /// GetCapacity passes on what the backend takes and what the CO adds, and leaves a
    /// parameter the backend does not take to CreateVolume, which refuses it.
    #[test]
    fn capacity_sees_the_declared_and_the_co_parameters_only() {
        let declared = vec!["root".to_string()];
        let class = pairs(&[("colour", "red"), ("csi.storage.k8s.io/fstype", "ext4"), ("root", "fast")]);
        let kept: Vec<(String, String)> =
            capacity_parameters(&declared, class).into_iter().map(|p| (p.key, p.value)).collect();
        assert_eq!(kept, [("csi.storage.k8s.io/fstype".into(), "ext4".into()), ("root".into(), "fast".into())]);
        assert!(capacity_parameters(&[], pairs(&[("root", "fast")])).is_empty());
    }
}
