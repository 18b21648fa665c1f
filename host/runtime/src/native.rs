//! Backends linked natively instead of loaded as components, for benchmarks and tests: a
//! [`NativeDriver`] is a backend's exports as plain functions over the host's binding types.
//! It exists to measure what the sandbox costs (the same backend, `.wasm` vs native, through
//! the same CSI path) and to let host tests plug in a planner without compiling a component.
//! Production loads `.wasm`; a native backend has no memory cap, deadline trap or fuel, only
//! the import-side checks (`dir` resolution).
//!
//! Two ways in: [`NativeDriver::of`] a type implementing [`Guest`] (host types, for host
//! tests), and, with the `native` feature (benches and tests only, it links the guest SDK),
//! `NativeDriver::of_backend` a `wasmcsi_backend_sdk::Backend`: the backend's own crate,
//! compiled for the host, with `dir` and `log` served by the host and nothing else granted.
use crate::bindings::driver::*;
use crate::bindings::types::Error;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[cfg(feature = "native")]
mod sdk;

thread_local! {
    /// Dir roots of the native backend whose call runs on this thread.
    static ROOTS: RefCell<BTreeMap<String, PathBuf>> = const { RefCell::new(BTreeMap::new()) };
}

/// Run `f` with `roots` as this thread's dir grants.
pub(crate) fn with_roots<R>(roots: &BTreeMap<String, PathBuf>, f: impl FnOnce() -> R) -> R {
    ROOTS.with(|r| *r.borrow_mut() = roots.clone());
    let out = f();
    ROOTS.with(|r| r.borrow_mut().clear());
    out
}

/// The `driver` exports, as the guest implements them (same signatures as wit-bindgen's). Every
/// export but `info` answers `unimplemented` unless the guest implements it: a host test's planner
/// writes only what it plans, and the host calls what `info` does not declare only where the
/// contract says every backend has it (so such a test sees `unimplemented`, never a panic).
pub trait Guest {
    fn info() -> BackendInfo;
    fn create_volume(_req: CreateVolumeRequest) -> Result<Volume, Error> {
        not_implemented("create-volume")
    }
    fn delete_volume(_volume_id: String, _secrets: Vec<SecretRef>) -> Result<(), Error> {
        not_implemented("delete-volume")
    }
    fn expand_volume(
        _volume_id: String,
        _capacity: CapacityRange,
        _capability: Option<VolumeCapability>,
        _secrets: Vec<SecretRef>,
    ) -> Result<Expansion, Error> {
        not_implemented("expand-volume")
    }
    fn get_volume(_volume_id: String) -> Result<VolumeStatus, Error> {
        not_implemented("get-volume")
    }
    fn list_volumes(_max_entries: u32, _starting_token: String) -> Result<VolumePage, Error> {
        not_implemented("list-volumes")
    }
    fn validate_volume_capabilities(
        _volume_id: String,
        _volume_context: Vec<Pair>,
        _capabilities: Vec<VolumeCapability>,
        _parameters: Vec<Pair>,
    ) -> Result<Option<String>, Error> {
        not_implemented("validate-volume-capabilities")
    }
    fn create_snapshot(
        _name: String,
        _source_volume_id: String,
        _parameters: Vec<Pair>,
        _secrets: Vec<SecretRef>,
    ) -> Result<Snapshot, Error> {
        not_implemented("create-snapshot")
    }
    fn delete_snapshot(_snapshot_id: String, _secrets: Vec<SecretRef>) -> Result<(), Error> {
        not_implemented("delete-snapshot")
    }
    fn list_snapshots(
        _snapshot_id: Option<String>,
        _source_volume_id: Option<String>,
        _max_entries: u32,
        _starting_token: String,
    ) -> Result<SnapshotPage, Error> {
        not_implemented("list-snapshots")
    }
    fn get_capacity(
        _capabilities: Vec<VolumeCapability>,
        _parameters: Vec<Pair>,
        _topology: Option<Topology>,
    ) -> Result<Capacity, Error> {
        not_implemented("get-capacity")
    }
    fn attach_plan(
        _volume_id: String,
        _volume_context: Vec<Pair>,
        _capability: VolumeCapability,
    ) -> Result<Attachment, Error> {
        not_implemented("attach-plan")
    }
    /// Optional (feature `get-snapshot`): unimplemented unless a guest has it.
    fn get_snapshot(snapshot_id: String) -> Result<Snapshot, Error> {
        Err(Error::Unimplemented(format!("get-snapshot {snapshot_id}: not supported by this backend")))
    }
    /// Optional (feature `self-healing`): unimplemented unless a guest has it.
    fn reconcile_volume(volume_id: String) -> Result<(), Error> {
        Err(Error::Unimplemented(format!("reconcile-volume {volume_id}: not supported by this backend")))
    }
}

/// The default of an export a native guest does not implement.
fn not_implemented<T>(export: &str) -> Result<T, Error> {
    Err(Error::Unimplemented(format!("{export}: not implemented by this native backend")))
}

/// A native guest's exports as plain function pointers (what a `Backend` holds).
#[derive(Clone, Copy)]
#[allow(clippy::type_complexity, reason = "one field per WIT export, spelled like the export")]
pub struct NativeDriver {
    pub(crate) info: fn() -> BackendInfo,
    pub(crate) create_volume: fn(CreateVolumeRequest) -> Result<Volume, Error>,
    pub(crate) delete_volume: fn(String, Vec<SecretRef>) -> Result<(), Error>,
    pub(crate) expand_volume:
        fn(String, CapacityRange, Option<VolumeCapability>, Vec<SecretRef>) -> Result<Expansion, Error>,
    pub(crate) get_volume: fn(String) -> Result<VolumeStatus, Error>,
    pub(crate) list_volumes: fn(u32, String) -> Result<VolumePage, Error>,
    pub(crate) validate_volume_capabilities:
        fn(String, Vec<Pair>, Vec<VolumeCapability>, Vec<Pair>) -> Result<Option<String>, Error>,
    pub(crate) create_snapshot: fn(String, String, Vec<Pair>, Vec<SecretRef>) -> Result<Snapshot, Error>,
    pub(crate) delete_snapshot: fn(String, Vec<SecretRef>) -> Result<(), Error>,
    pub(crate) list_snapshots: fn(Option<String>, Option<String>, u32, String) -> Result<SnapshotPage, Error>,
    pub(crate) get_capacity: fn(Vec<VolumeCapability>, Vec<Pair>, Option<Topology>) -> Result<Capacity, Error>,
    pub(crate) attach_plan: fn(String, Vec<Pair>, VolumeCapability) -> Result<Attachment, Error>,
    pub(crate) get_snapshot: fn(String) -> Result<Snapshot, Error>,
    pub(crate) reconcile_volume: fn(String) -> Result<(), Error>,
}

impl NativeDriver {
    pub fn of<G: Guest>() -> Self {
        Self {
            info: G::info,
            create_volume: G::create_volume,
            delete_volume: G::delete_volume,
            expand_volume: G::expand_volume,
            get_volume: G::get_volume,
            list_volumes: G::list_volumes,
            validate_volume_capabilities: G::validate_volume_capabilities,
            create_snapshot: G::create_snapshot,
            delete_snapshot: G::delete_snapshot,
            list_snapshots: G::list_snapshots,
            get_capacity: G::get_capacity,
            attach_plan: G::attach_plan,
            get_snapshot: G::get_snapshot,
            reconcile_volume: G::reconcile_volume,
        }
    }
}
