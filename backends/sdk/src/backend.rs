//! [`Backend`]: the `driver` exports as a trait whose calls take the [`Host`] they may use, and
//! [`Component`], the adapter [`export!`](crate::export) exports on wasm32 (it calls the
//! backend with the component's [`Imports`]). A backend implements the trait once; the same
//! code runs in the component, against [`crate::fake::FakeHost`] in unit tests, and against a
//! native host in the sandbox-cost benchmark.
use crate::host::{Host, Imports};
use crate::types::*;
use crate::wit::exports::wasmcsi::backend::driver::Guest;
use std::marker::PhantomData;

/// The answer to an operation a backend does not implement (the host only calls it when the
/// backend lists the matching [`Feature`], so reaching this is the backend's own mistake).
pub fn unsupported<T>(op: &str) -> Result<T, Error> {
    Err(Error::Unimplemented(format!("{op} is not supported by this backend")))
}

/// A backend: CSI provisioning policy over the capabilities of a [`Host`]. Signatures are the
/// WIT's (`wit/backend.wit` documents every call and its errors) with the host first.
/// Operations behind an optional [`Feature`] default to unimplemented.
///
/// ```
/// use wasmcsi_backend_sdk::prelude::*;
///
/// /// Volumes are kv keys: a toy, but a whole backend.
/// pub struct Toy;
///
/// impl Backend for Toy {
///     fn info() -> BackendInfo {
///         BackendInfo { name: "toy".into(), version: "0.1.0".into(), features: vec![Feature::CreateDeleteVolume], parameters: vec![] }
///     }
///     fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error> {
///         let bytes = Sizing::DEFAULT.resolve(req.capacity.required_bytes, req.capacity.limit_bytes)?;
///         let id = local_name(&req.name, MAX_ID_BYTES);
///         h.kv().set(&format!("volumes/{id}"), bytes.to_string().as_bytes())?;
///         h.log().info("volume created", &[("volume", &id)]);
///         Ok(Volume::new(id, bytes))
///     }
///     fn delete_volume(h: &impl Host, id: String, _: Vec<SecretRef>) -> Result<(), Error> {
///         h.kv().delete(&format!("volumes/{id}"))
///     }
///     fn validate_volume_capabilities(_: &impl Host, _: String, _: Vec<Pair>, _: Vec<VolumeCapability>, _: Vec<Pair>) -> Result<Option<String>, Error> {
///         Ok(None)
///     }
///     fn attach_plan(_: &impl Host, id: String, _: Vec<Pair>, _: VolumeCapability, _: Vec<SecretRef>) -> Result<Attachment, Error> {
///         Err(Error::FailedPrecondition(format!("volume {id} has no data to attach")))
///     }
/// }
///
/// wasmcsi_backend_sdk::export!(Toy);
/// ```
pub trait Backend {
    /// What the backend is and supports. Must not fail; the host calls it once at load.
    fn info() -> BackendInfo;

    /// Create a volume, or return the one an earlier request of the same name created.
    fn create_volume(host: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error>;

    /// Delete a volume; an unknown id succeeds.
    fn delete_volume(host: &impl Host, volume_id: String, secrets: Vec<SecretRef>) -> Result<(), Error>;

    /// Grow a volume ([`Feature::ExpandVolume`]).
    fn expand_volume(
        host: &impl Host,
        volume_id: String,
        capacity: CapacityRange,
        capability: Option<VolumeCapability>,
        secrets: Vec<SecretRef>,
    ) -> Result<Expansion, Error> {
        let _ = (host, volume_id, capacity, capability, secrets);
        unsupported("expand-volume")
    }

    /// One volume ([`Feature::GetVolume`]).
    fn get_volume(host: &impl Host, volume_id: String) -> Result<VolumeStatus, Error> {
        let _ = (host, volume_id);
        unsupported("get-volume")
    }

    /// A page of volumes ([`Feature::ListVolumes`]); see [`crate::page`].
    fn list_volumes(host: &impl Host, max_entries: u32, starting_token: String) -> Result<VolumePage, Error> {
        let _ = (host, max_entries, starting_token);
        unsupported("list-volumes")
    }

    /// `Ok(None)` when the volume supports every capability, `Ok(Some(reason))` when not.
    fn validate_volume_capabilities(
        host: &impl Host,
        volume_id: String,
        volume_context: Vec<Pair>,
        capabilities: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
    ) -> Result<Option<String>, Error>;

    /// Snapshot a volume ([`Feature::CreateDeleteSnapshot`]).
    fn create_snapshot(
        host: &impl Host,
        name: String,
        source_volume_id: String,
        parameters: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<Snapshot, Error> {
        let _ = (host, name, source_volume_id, parameters, secrets);
        unsupported("create-snapshot")
    }

    /// Delete a snapshot; an unknown id succeeds ([`Feature::CreateDeleteSnapshot`]).
    fn delete_snapshot(host: &impl Host, snapshot_id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        let _ = (host, snapshot_id, secrets);
        unsupported("delete-snapshot")
    }

    /// A page of snapshots ([`Feature::ListSnapshots`]); see [`crate::page`].
    fn list_snapshots(
        host: &impl Host,
        snapshot_id: Option<String>,
        source_volume_id: Option<String>,
        max_entries: u32,
        starting_token: String,
    ) -> Result<SnapshotPage, Error> {
        let _ = (host, snapshot_id, source_volume_id, max_entries, starting_token);
        unsupported("list-snapshots")
    }

    /// One snapshot ([`Feature::GetSnapshot`]).
    fn get_snapshot(host: &impl Host, snapshot_id: String) -> Result<Snapshot, Error> {
        let _ = (host, snapshot_id);
        unsupported("get-snapshot")
    }

    /// Check one volume and repair what policy says to ([`Feature::SelfHealing`]: the host
    /// calls it for each volume periodically), deciding by time against `now`, the host's clock.
    fn reconcile_volume(host: &impl Host, volume_id: String, now: Timestamp) -> Result<(), Error> {
        let _ = (host, volume_id, now);
        unsupported("reconcile-volume")
    }

    /// Capacity for volumes of these capabilities and parameters ([`Feature::GetCapacity`]).
    fn get_capacity(
        host: &impl Host,
        capabilities: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
        topology: Option<Topology>,
    ) -> Result<Capacity, Error> {
        let _ = (host, capabilities, parameters, topology);
        unsupported("get-capacity")
    }

    /// How the node attaches the volume. Runs on the node: keep it cheap. `secrets` are
    /// NodeStageVolume's, as handles a plan may name (an RBD user's keys, a passphrase).
    fn attach_plan(
        host: &impl Host,
        volume_id: String,
        volume_context: Vec<Pair>,
        capability: VolumeCapability,
        secrets: Vec<SecretRef>,
    ) -> Result<Attachment, Error>;

    /// Apply VolumeAttributesClass parameters, all or nothing ([`Feature::ModifyVolume`]).
    fn modify_volume(
        host: &impl Host,
        volume_id: String,
        mutable_parameters: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        let _ = (host, volume_id, mutable_parameters, secrets);
        unsupported("modify-volume")
    }

    /// One crash-consistent snapshot of every source volume ([`Feature::GroupSnapshots`]).
    fn create_group_snapshot(
        host: &impl Host,
        name: String,
        source_volume_ids: Vec<String>,
        parameters: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<GroupSnapshot, Error> {
        let _ = (host, name, source_volume_ids, parameters, secrets);
        unsupported("create-group-snapshot")
    }

    /// Delete a group snapshot; an unknown id succeeds ([`Feature::GroupSnapshots`]).
    fn delete_group_snapshot(
        host: &impl Host,
        group_snapshot_id: String,
        snapshot_ids: Vec<String>,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        let _ = (host, group_snapshot_id, snapshot_ids, secrets);
        unsupported("delete-group-snapshot")
    }

    /// One group snapshot ([`Feature::GroupSnapshots`]).
    fn get_group_snapshot(
        host: &impl Host,
        group_snapshot_id: String,
        snapshot_ids: Vec<String>,
        secrets: Vec<SecretRef>,
    ) -> Result<GroupSnapshot, Error> {
        let _ = (host, group_snapshot_id, snapshot_ids, secrets);
        unsupported("get-group-snapshot")
    }
}

/// A [`Backend`] as the component's `driver` export, over the component's [`Imports`].
/// [`export!`](crate::export) exports it; nothing else names it.
#[doc(hidden)]
pub struct Component<B>(PhantomData<B>);

impl<B: Backend + 'static> Guest for Component<B> {
    fn info() -> BackendInfo {
        B::info()
    }
    fn create_volume(req: CreateVolumeRequest) -> Result<Volume, Error> {
        B::create_volume(&Imports, req)
    }
    fn delete_volume(volume_id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        B::delete_volume(&Imports, volume_id, secrets)
    }
    fn expand_volume(
        volume_id: String,
        capacity: CapacityRange,
        capability: Option<VolumeCapability>,
        secrets: Vec<SecretRef>,
    ) -> Result<Expansion, Error> {
        B::expand_volume(&Imports, volume_id, capacity, capability, secrets)
    }
    fn get_volume(volume_id: String) -> Result<VolumeStatus, Error> {
        B::get_volume(&Imports, volume_id)
    }
    fn list_volumes(max_entries: u32, starting_token: String) -> Result<VolumePage, Error> {
        B::list_volumes(&Imports, max_entries, starting_token)
    }
    fn validate_volume_capabilities(
        volume_id: String,
        volume_context: Vec<Pair>,
        capabilities: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
    ) -> Result<Option<String>, Error> {
        B::validate_volume_capabilities(&Imports, volume_id, volume_context, capabilities, parameters)
    }
    fn create_snapshot(
        name: String,
        source_volume_id: String,
        parameters: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<Snapshot, Error> {
        B::create_snapshot(&Imports, name, source_volume_id, parameters, secrets)
    }
    fn delete_snapshot(snapshot_id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        B::delete_snapshot(&Imports, snapshot_id, secrets)
    }
    fn list_snapshots(
        snapshot_id: Option<String>,
        source_volume_id: Option<String>,
        max_entries: u32,
        starting_token: String,
    ) -> Result<SnapshotPage, Error> {
        B::list_snapshots(&Imports, snapshot_id, source_volume_id, max_entries, starting_token)
    }
    fn get_snapshot(snapshot_id: String) -> Result<Snapshot, Error> {
        B::get_snapshot(&Imports, snapshot_id)
    }
    fn reconcile_volume(volume_id: String, now: Timestamp) -> Result<(), Error> {
        B::reconcile_volume(&Imports, volume_id, now)
    }
    fn get_capacity(
        capabilities: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
        topology: Option<Topology>,
    ) -> Result<Capacity, Error> {
        B::get_capacity(&Imports, capabilities, parameters, topology)
    }
    fn attach_plan(
        volume_id: String,
        volume_context: Vec<Pair>,
        capability: VolumeCapability,
        secrets: Vec<SecretRef>,
    ) -> Result<Attachment, Error> {
        B::attach_plan(&Imports, volume_id, volume_context, capability, secrets)
    }
    fn modify_volume(volume_id: String, mutable_parameters: Vec<Pair>, secrets: Vec<SecretRef>) -> Result<(), Error> {
        B::modify_volume(&Imports, volume_id, mutable_parameters, secrets)
    }
    fn create_group_snapshot(
        name: String,
        source_volume_ids: Vec<String>,
        parameters: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<GroupSnapshot, Error> {
        B::create_group_snapshot(&Imports, name, source_volume_ids, parameters, secrets)
    }
    fn delete_group_snapshot(
        group_snapshot_id: String,
        snapshot_ids: Vec<String>,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        B::delete_group_snapshot(&Imports, group_snapshot_id, snapshot_ids, secrets)
    }
    fn get_group_snapshot(
        group_snapshot_id: String,
        snapshot_ids: Vec<String>,
        secrets: Vec<SecretRef>,
    ) -> Result<GroupSnapshot, Error> {
        B::get_group_snapshot(&Imports, group_snapshot_id, snapshot_ids, secrets)
    }
}
