//! The one path every Controller call on a backend takes before its own work, as a tower
//! layer or Mayastor's node handlers do it: resolve the backend (and the object) the request
//! names, refuse what that backend does not offer, route the call to the node that holds a
//! node-local object (forwarded whole, the node's answer returned as it is, see `peer`), and
//! while it runs here hold the per-object guard and the backend's gate (see `guard`). A
//! handler keeps what is CSI-specific: its fields, its backend call, the checks of the answer.
//!
//! ```text
//!  request ──> resolve ──> feature? ──> route ──┬── Node(n) ──> forward to n ──> n's answer
//!              (id or                           │
//!               StorageClass)                   └── Here ──> guard ──> gate ──> handler
//! ```
use super::ControllerService;
use crate::error::{CsiError, CsiResult, ObjectKind};
use crate::guard::{GatePass, OperationGuard, Side};
use crate::ids::ObjectId;
use crate::topology::Route;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_client::ControllerClient;
use wasmcsi_runtime::Backend;
use wasmcsi_runtime::driver::Feature;

/// What a forwarded call may take beyond the backend's own deadline, twice (a creation may
/// wait one deadline at the backend's gate, then run one): the hop and the node's queue.
const FORWARD_MARGIN: Duration = Duration::from_secs(2);

/// A Controller request a controller can forward whole to a node plugin.
pub(super) trait Forward: Clone + Send + Sync + 'static {
    type Response: Default + Send;
    /// The RPC's name, as `/csi.v1.Controller/{METHOD}` spells it.
    const METHOD: &'static str;
    /// Send it with `client`.
    fn send(
        client: ControllerClient<Channel>,
        req: tonic::Request<Self>,
    ) -> impl Future<Output = Result<tonic::Response<Self::Response>, tonic::Status>> + Send;
}

/// The table of forwardable requests: request => response, RPC name, client method.
macro_rules! forwardable {
    ($($req:ident => $resp:ident, $method:literal, $call:ident;)*) => {$(
        impl Forward for csi::$req {
            type Response = csi::$resp;
            const METHOD: &'static str = $method;
            async fn send(
                mut client: ControllerClient<Channel>,
                req: tonic::Request<Self>,
            ) -> Result<tonic::Response<csi::$resp>, tonic::Status> {
                client.$call(req).await
            }
        }
    )*};
}

forwardable! {
    CreateVolumeRequest => CreateVolumeResponse, "CreateVolume", create_volume;
    DeleteVolumeRequest => DeleteVolumeResponse, "DeleteVolume", delete_volume;
    ControllerPublishVolumeRequest => ControllerPublishVolumeResponse, "ControllerPublishVolume", controller_publish_volume;
    ControllerUnpublishVolumeRequest => ControllerUnpublishVolumeResponse, "ControllerUnpublishVolume", controller_unpublish_volume;
    ValidateVolumeCapabilitiesRequest => ValidateVolumeCapabilitiesResponse, "ValidateVolumeCapabilities", validate_volume_capabilities;
    ListVolumesRequest => ListVolumesResponse, "ListVolumes", list_volumes;
    GetCapacityRequest => GetCapacityResponse, "GetCapacity", get_capacity;
    CreateSnapshotRequest => CreateSnapshotResponse, "CreateSnapshot", create_snapshot;
    DeleteSnapshotRequest => DeleteSnapshotResponse, "DeleteSnapshot", delete_snapshot;
    ListSnapshotsRequest => ListSnapshotsResponse, "ListSnapshots", list_snapshots;
    GetSnapshotRequest => GetSnapshotResponse, "GetSnapshot", get_snapshot;
    ControllerExpandVolumeRequest => ControllerExpandVolumeResponse, "ControllerExpandVolume", controller_expand_volume;
    ControllerGetVolumeRequest => ControllerGetVolumeResponse, "ControllerGetVolume", controller_get_volume;
    ControllerModifyVolumeRequest => ControllerModifyVolumeResponse, "ControllerModifyVolume", controller_modify_volume;
}

/// What a call holds while it runs on this node.
pub(super) struct Hold {
    /// The in-flight key: a second call with the same key meanwhile is ABORTED.
    key: Option<String>,
    /// The side of the backend's gate it enters, and how an ABORTED after waiting names it.
    gate: Option<(Side, String)>,
}

impl Hold {
    pub(super) fn nothing() -> Self {
        Self { key: None, gate: None }
    }

    /// The in-flight guard of `key`.
    pub(super) fn key(key: String) -> Self {
        Self { key: Some(key), gate: None }
    }

    /// The in-flight guard of `key`, then the backend's gate on `side`.
    pub(super) fn gated(key: String, side: Side, what: String) -> Self {
        Self { key: Some(key), gate: Some((side, what)) }
    }
}

/// Held while a call runs here: dropping it lets the next call of the key, and the other
/// side of the gate, in.
pub(super) struct Held {
    _guard: Option<OperationGuard>,
    _pass: Option<GatePass>,
}

/// What an id that cannot be ours (it does not parse as one) is answered.
pub(super) enum Unknown {
    /// the call's empty answer: it names nothing, so there is nothing to do (deletions)
    Nothing,
    /// NOT_FOUND, naming the object as this kind
    NotFound(ObjectKind),
}

/// A call on an existing object, by its id.
pub(super) struct OnObject<'a> {
    id: &'a str,
    unknown: Unknown,
    needs: Option<(Feature, &'static str)>,
    hold: Hold,
}

impl<'a> OnObject<'a> {
    /// The object `id`; an id that cannot be ours is answered as `unknown` says.
    pub(super) fn new(id: &'a str, unknown: Unknown) -> Self {
        Self { id, unknown, needs: None, hold: Hold::nothing() }
    }

    /// The backend must offer `feature`, else UNIMPLEMENTED naming it as `what`.
    pub(super) fn needs(self, feature: Feature, what: &'static str) -> Self {
        Self { needs: Some((feature, what)), ..self }
    }

    /// One call on the object at a time.
    pub(super) fn guarded(self) -> Self {
        let hold = Hold::key(self.id.to_string());
        Self { hold, ..self }
    }

    /// One call on the object at a time, on `side` of the backend's gate.
    pub(super) fn exclusive(self, side: Side) -> Self {
        let hold = Hold::gated(self.id.to_string(), side, self.id.to_string());
        Self { hold, ..self }
    }

    /// Holds `hold` instead (a creation named apart from the object it starts from).
    pub(super) fn holding(self, hold: Hold) -> Self {
        Self { hold, ..self }
    }
}

/// A new volume of `backend`, placed by its accessibility requirements and content source.
pub(super) struct NewVolume<'a> {
    pub backend: &'a Arc<Backend>,
    pub accessibility: Option<&'a csi::TopologyRequirement>,
    pub source: Option<&'a ObjectId>,
    pub hold: Hold,
}

/// The backend must offer `feature`; UNIMPLEMENTED naming it as `what` otherwise.
pub(super) fn need(backend: &Backend, feature: Feature, what: &'static str) -> CsiResult<()> {
    if backend.has_feature(feature) {
        Ok(())
    } else {
        Err(CsiError::Unsupported { backend: backend.name.clone(), what })
    }
}

impl ControllerService {
    /// Run `req` on the existing object `call` names: here (`here` with its backend and
    /// parsed id, while holding what `call` asks) or on the node that holds it.
    pub(super) async fn on_object<Req: Forward>(
        &self,
        req: &Req,
        call: OnObject<'_>,
        here: impl AsyncFnOnce(Arc<Backend>, ObjectId) -> CsiResult<Req::Response>,
    ) -> CsiResult<Req::Response> {
        let Some((backend, oid)) = self.0.backend_for_id(call.id)? else {
            return match call.unknown {
                Unknown::Nothing => Ok(Req::Response::default()),
                Unknown::NotFound(kind) => Err(CsiError::ObjectNotFound { kind, id: call.id.to_string() }),
            };
        };
        if let Some((feature, what)) = call.needs {
            need(&backend, feature, what)?;
        }
        let route = self.0.route_object(&backend, &oid).await?;
        let _held = match self.dispatch(req, &backend, route, call.hold).await? {
            Dispatched::Forwarded(answer) => return Ok(answer),
            Dispatched::Here(held) => held,
        };
        here(backend, oid).await
    }

    /// Run `req`, the creation of `call`'s volume: here (`here`, while holding what `call`
    /// asks) or on the node it is placed on.
    pub(super) async fn on_new_volume<Req: Forward>(
        &self,
        req: &Req,
        call: NewVolume<'_>,
        here: impl AsyncFnOnce() -> CsiResult<Req::Response>,
    ) -> CsiResult<Req::Response> {
        let route = self.0.route_create(call.backend, call.accessibility, call.source).await?;
        let _held = match self.dispatch(req, call.backend, route, call.hold).await? {
            Dispatched::Forwarded(answer) => return Ok(answer),
            Dispatched::Here(held) => held,
        };
        here().await
    }

    /// Forward `req` to the node `route` names, or take what it holds here.
    async fn dispatch<Req: Forward>(
        &self,
        req: &Req,
        backend: &Backend,
        route: Route,
        hold: Hold,
    ) -> CsiResult<Dispatched<Req::Response>> {
        if let Route::Node(node) = route {
            return self.forward(&node, backend, req.clone()).await.map(Dispatched::Forwarded);
        }
        let guard = hold.key.map(|key| self.0.inflight.try_start(key)).transpose()?;
        let pass = match hold.gate {
            Some((side, what)) => Some(self.enter(backend, side, &what).await?),
            None => None,
        };
        Ok(Dispatched::Here(Held { _guard: guard, _pass: pass }))
    }

    /// Enter `backend`'s gate on `side` (see `guard`): a creation and a change of an existing
    /// object of one backend never run at once, whatever ids the backend gives names. A call
    /// waits for the other side at most one backend deadline (what the other side's call can
    /// take), then answers ABORTED.
    async fn enter(&self, backend: &Backend, side: Side, what: &str) -> CsiResult<GatePass> {
        self.0.inflight.gates.enter(&backend.name, side, backend.limits.call_deadline(), what).await
    }

    /// Forward one call of `backend` to node `node`'s plugin (see `peer`); its answer, or its
    /// error with the node's code.
    pub(super) async fn forward<Req: Forward>(
        &self,
        node: &str,
        backend: &Backend,
        req: Req,
    ) -> CsiResult<Req::Response> {
        let peers = self.0.node_local.peers.as_ref().ok_or_else(|| CsiError::NoPeers { node: node.to_string() })?;
        let timeout = backend.limits.call_deadline() * 2 + FORWARD_MARGIN;
        peers.call(node, Req::METHOD, timeout, req, Req::send).await
    }
}

/// Where `dispatch` sent a call.
enum Dispatched<R> {
    /// to a node plugin, which answered this
    Forwarded(R),
    /// nowhere: it runs here, holding this
    Here(Held),
}
