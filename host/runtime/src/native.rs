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

/// The `driver` exports, as the guest implements them (same signatures as wit-bindgen's).
pub trait Guest {
    fn info() -> BackendInfo;
    fn create_volume(req: CreateVolumeRequest) -> Result<Volume, Error>;
    fn delete_volume(volume_id: String, secrets: Vec<SecretRef>) -> Result<(), Error>;
    fn expand_volume(
        volume_id: String,
        capacity: CapacityRange,
        capability: Option<VolumeCapability>,
        secrets: Vec<SecretRef>,
    ) -> Result<Expansion, Error>;
    fn get_volume(volume_id: String) -> Result<VolumeStatus, Error>;
    fn list_volumes(max_entries: u32, starting_token: String) -> Result<VolumePage, Error>;
    fn validate_volume_capabilities(
        volume_id: String,
        volume_context: Vec<Pair>,
        capabilities: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
    ) -> Result<Option<String>, Error>;
    fn create_snapshot(
        name: String,
        source_volume_id: String,
        parameters: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<Snapshot, Error>;
    fn delete_snapshot(snapshot_id: String, secrets: Vec<SecretRef>) -> Result<(), Error>;
    fn list_snapshots(
        snapshot_id: Option<String>,
        source_volume_id: Option<String>,
        max_entries: u32,
        starting_token: String,
    ) -> Result<SnapshotPage, Error>;
    fn get_capacity(
        capabilities: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
        topology: Option<Topology>,
    ) -> Result<Capacity, Error>;
    fn attach_plan(
        volume_id: String,
        volume_context: Vec<Pair>,
        capability: VolumeCapability,
    ) -> Result<Attachment, Error>;
    /// Optional (feature `get-snapshot`): unimplemented unless a guest has it.
    fn get_snapshot(snapshot_id: String) -> Result<Snapshot, Error> {
        Err(Error::Unimplemented(format!("get-snapshot {snapshot_id}: not supported by this backend")))
    }
    /// Optional (feature `self-healing`): unimplemented unless a guest has it.
    fn reconcile_volume(volume_id: String) -> Result<(), Error> {
        Err(Error::Unimplemented(format!("reconcile-volume {volume_id}: not supported by this backend")))
    }
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
