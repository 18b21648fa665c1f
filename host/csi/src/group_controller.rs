//! CSI GroupController: VolumeGroupSnapshots (Create / Delete / GetVolumeGroupSnapshot), served
//! by the backend that owns every source volume through its `create-`, `delete-` and
//! `get-group-snapshot` exports. Offered only while a loaded backend declares the
//! `group-snapshots` feature (GroupControllerGetCapabilities, and Identity's
//! GROUP_CONTROLLER_SERVICE). A group of a backend without it: a missing source NOT_FOUND, else
//! INVALID_ARGUMENT (the service is offered; those volumes cannot be in a group); delete and
//! get of such a backend's id answer UNIMPLEMENTED.
//!
//! A group's sources must all be volumes of one backend (INVALID_ARGUMENT otherwise: one
//! backend's storage cannot hold a consistent point with another's). A group snapshot runs on
//! the controller: the volumes of a node-local backend live on one node each, so no backend of
//! that kind can offer one (UNIMPLEMENTED). The group id is `BACKEND:LOCAL` like every other id,
//! and each member is an ordinary snapshot of the backend, its `group_snapshot_id` set.
//!
//! Codes as CSI v1.12 says: a name already taken with other sources ALREADY_EXISTS (the
//! backend's), a source that does not exist NOT_FOUND, a call on a name or group already in
//! flight ABORTED, `snapshot_ids` that are not the group's FAILED_PRECONDITION (the backend's),
//! an unknown group id OK at Delete and NOT_FOUND at Get.
use crate::answer;
use crate::convert;
use crate::error::{CsiError, CsiResult, ObjectKind};
use crate::guard::Side;
use crate::ids::ObjectId;
use crate::plugin::{Plugin, backend_parameters, required};
use crate::topology::Route;
use std::sync::Arc;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::group_controller_server::GroupController;
use wasmcsi_runtime::Backend;
use wasmcsi_runtime::driver::Feature;

#[derive(Clone)]
pub struct GroupControllerService(pub Arc<Plugin>);

type Reply<T> = Result<tonic::Response<T>, tonic::Status>;

/// A group snapshot's backend, its parsed id and the local ids of the CO's `snapshot_ids`.
type Group = (Arc<Backend>, ObjectId, Vec<String>);

/// Whether any loaded backend offers group snapshots: the service is advertised only then.
pub fn offered(plugin: &Plugin) -> bool {
    plugin.registry.all().iter().any(|b| b.has_feature(Feature::GroupSnapshots))
}

/// What the group controller offers now.
pub fn group_controller_capabilities(plugin: &Plugin) -> Vec<csi::GroupControllerServiceCapability> {
    use csi::group_controller_service_capability::{Rpc, Type, rpc::Type as R};
    if !offered(plugin) {
        return Vec::new();
    }
    vec![csi::GroupControllerServiceCapability {
        r#type: Some(Type::Rpc(Rpc { r#type: R::CreateDeleteGetVolumeGroupSnapshot as i32 })),
    }]
}

fn need(backend: &Backend) -> CsiResult<()> {
    if backend.has_feature(Feature::GroupSnapshots) {
        Ok(())
    } else {
        Err(CsiError::Unsupported { backend: backend.name.clone(), what: "group snapshots" })
    }
}

impl GroupControllerService {
    /// The one backend owning every id of `ids` (`kind` names them when unknown), and their
    /// local ids, in order.
    async fn owner_of(&self, ids: &[String], kind: ObjectKind) -> CsiResult<(Arc<Backend>, Vec<String>)> {
        let mut owner: Option<Arc<Backend>> = None;
        let mut locals = Vec::with_capacity(ids.len());
        for id in ids {
            let (backend, oid) =
                self.0.backend_for_id(id)?.ok_or_else(|| CsiError::ObjectNotFound { kind, id: id.to_string() })?;
            if let Some(first) = &owner
                && first.name != backend.name
            {
                return Err(CsiError::Invalid(format!(
                    "{kind} {id} belongs to backend {}, the group's first to {}: a group snapshot is of one backend",
                    backend.name, first.name
                )));
            }
            if self.0.route_object(&backend, &oid).await? != Route::Here || oid.node.is_some() {
                return Err(CsiError::Unimplemented(format!(
                    "{kind} {id} is a node-local volume of backend {}: group snapshots are not offered for them",
                    backend.name
                )));
            }
            locals.push(oid.local);
            owner = Some(backend);
        }
        let owner = owner.ok_or(CsiError::Missing("source_volume_ids"))?;
        Ok((owner, locals))
    }

    async fn create(
        &self,
        req: csi::CreateVolumeGroupSnapshotRequest,
    ) -> CsiResult<csi::CreateVolumeGroupSnapshotResponse> {
        let name = required(&req.name, "name")?;
        crate::ids::check_name("name", name)?;
        if req.source_volume_ids.is_empty() {
            return Err(CsiError::Missing("source_volume_ids"));
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(twice) = req.source_volume_ids.iter().find(|id| !seen.insert(id.as_str())) {
            return Err(CsiError::Invalid(format!("source volume {twice} is named twice")));
        }
        let (backend, sources) = self.owner_of(&req.source_volume_ids, ObjectKind::SourceVolume).await?;
        if !backend.has_feature(Feature::GroupSnapshots) {
            // The service is offered (another backend takes group snapshots): a missing source
            // is NOT_FOUND as the spec orders it, an existing one an argument this backend
            // cannot take, not an unimplemented call.
            if backend.has_feature(Feature::GetVolume) {
                for local in &sources {
                    backend.get_volume(local.clone()).await?;
                }
            }
            return Err(CsiError::Invalid(format!(
                "backend {} takes no group snapshots: its volumes cannot be in one",
                backend.name
            )));
        }
        let _guard = self.0.inflight.try_start(format!("create-group-snapshot/{name}"))?;
        let _pass = self
            .0
            .inflight
            .gates
            .enter(&backend.name, Side::Create, backend.limits.call_deadline(), &format!("group snapshot {name}"))
            .await?;
        let g = backend
            .create_group_snapshot(
                name.to_string(),
                sources.clone(),
                backend_parameters(&req.parameters),
                convert::secrets(&req.secrets),
            )
            .await?;
        let group = answer::group_snapshot(&backend, "create_group_snapshot", &g, Some(&sources))?;
        Ok(csi::CreateVolumeGroupSnapshotResponse { group_snapshot: Some(group) })
    }

    /// The group's backend and local id, with the local ids of `snapshot_ids` (each must be
    /// the same backend's, else FAILED_PRECONDITION: they cannot be the group's).
    fn group_of(&self, group_id: &str, snapshot_ids: &[String]) -> CsiResult<Option<Group>> {
        let Some((backend, oid)) = self.0.backend_for_id(group_id)? else { return Ok(None) };
        let mut locals = Vec::with_capacity(snapshot_ids.len());
        for id in snapshot_ids {
            match ObjectId::parse(id) {
                Some(s) if s.backend == backend.name => locals.push(s.local),
                _ => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "snapshot {id} is not of group snapshot {group_id}"
                    )));
                }
            }
        }
        Ok(Some((backend, oid, locals)))
    }

    async fn delete(
        &self,
        req: csi::DeleteVolumeGroupSnapshotRequest,
    ) -> CsiResult<csi::DeleteVolumeGroupSnapshotResponse> {
        let id = required(&req.group_snapshot_id, "group_snapshot_id")?;
        // An id that cannot be ours names nothing to delete.
        let Some((backend, oid, snapshots)) = self.group_of(id, &req.snapshot_ids)? else {
            return Ok(csi::DeleteVolumeGroupSnapshotResponse {});
        };
        need(&backend)?;
        let _guard = self.0.inflight.try_start(id.to_string())?;
        let _pass =
            self.0.inflight.gates.enter(&backend.name, Side::Existing, backend.limits.call_deadline(), id).await?;
        backend.delete_group_snapshot(oid.local, snapshots, convert::secrets(&req.secrets)).await?;
        Ok(csi::DeleteVolumeGroupSnapshotResponse {})
    }

    async fn get(&self, req: csi::GetVolumeGroupSnapshotRequest) -> CsiResult<csi::GetVolumeGroupSnapshotResponse> {
        let id = required(&req.group_snapshot_id, "group_snapshot_id")?;
        let not_found = || CsiError::ObjectNotFound { kind: ObjectKind::GroupSnapshot, id: id.to_string() };
        let (backend, oid, snapshots) = self.group_of(id, &req.snapshot_ids)?.ok_or_else(not_found)?;
        need(&backend)?;
        let g = backend.get_group_snapshot(oid.local.clone(), snapshots, convert::secrets(&req.secrets)).await?;
        if g.group_snapshot_id != oid.local {
            return Err(backend
                .reject_output(
                    "get_group_snapshot",
                    format!("answered group {} for {}", g.group_snapshot_id, oid.local),
                )
                .into());
        }
        let group = answer::group_snapshot(&backend, "get_group_snapshot", &g, None)?;
        Ok(csi::GetVolumeGroupSnapshotResponse { group_snapshot: Some(group) })
    }
}

#[tonic::async_trait]
impl GroupController for GroupControllerService {
    #[tracing::instrument(name = "csi.group_controller_get_capabilities", skip_all)]
    async fn group_controller_get_capabilities(
        &self,
        _: tonic::Request<csi::GroupControllerGetCapabilitiesRequest>,
    ) -> Reply<csi::GroupControllerGetCapabilitiesResponse> {
        let capabilities = group_controller_capabilities(&self.0);
        self.0
            .observe("GroupControllerGetCapabilities", async {
                Ok(csi::GroupControllerGetCapabilitiesResponse { capabilities })
            })
            .await
    }
    #[tracing::instrument(name = "csi.create_volume_group_snapshot", skip_all, fields(group_snapshot.name = %r.get_ref().name, sources = r.get_ref().source_volume_ids.len()))]
    async fn create_volume_group_snapshot(
        &self,
        r: tonic::Request<csi::CreateVolumeGroupSnapshotRequest>,
    ) -> Reply<csi::CreateVolumeGroupSnapshotResponse> {
        self.0.observe("CreateVolumeGroupSnapshot", self.create(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.delete_volume_group_snapshot", skip_all, fields(group_snapshot.id = %r.get_ref().group_snapshot_id))]
    async fn delete_volume_group_snapshot(
        &self,
        r: tonic::Request<csi::DeleteVolumeGroupSnapshotRequest>,
    ) -> Reply<csi::DeleteVolumeGroupSnapshotResponse> {
        self.0.observe("DeleteVolumeGroupSnapshot", self.delete(r.into_inner())).await
    }
    #[tracing::instrument(name = "csi.get_volume_group_snapshot", skip_all, fields(group_snapshot.id = %r.get_ref().group_snapshot_id))]
    async fn get_volume_group_snapshot(
        &self,
        r: tonic::Request<csi::GetVolumeGroupSnapshotRequest>,
    ) -> Reply<csi::GetVolumeGroupSnapshotResponse> {
        self.0.observe("GetVolumeGroupSnapshot", self.get(r.into_inner())).await
    }
}
