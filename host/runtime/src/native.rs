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
//! Guests not yet on the SDK still bind to [`guest_bindings`] natively.
use crate::bindings::driver::*;
use crate::bindings::types::Error;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;

#[cfg(feature = "native")]
mod sdk;

/// The module tree `wit_bindgen::generate!` would produce for a guest, mapped onto host
/// types, so guest source compiles unchanged for the host.
pub mod guest_bindings {
    pub mod exports {
        pub mod wasmcsi {
            pub mod backend {
                pub mod driver {
                    pub use crate::bindings::driver::*;
                    pub use crate::native::Guest;
                }
            }
        }
    }
    pub mod wasmcsi {
        pub mod backend {
            pub mod types {
                pub use crate::bindings::types::*;
            }
            pub mod log {
                pub use crate::bindings::wasmcsi::backend::log::Level;
                pub fn log(level: Level, message: &str, fields: &[(String, String)]) {
                    let fields: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    let fields = fields.join(" ");
                    match level {
                        Level::Trace | Level::Debug => tracing::debug!(target: "wasmcsi::native", fields, "{message}"),
                        Level::Info => tracing::info!(target: "wasmcsi::native", fields, "{message}"),
                        Level::Warn | Level::Error => tracing::warn!(target: "wasmcsi::native", fields, "{message}"),
                    }
                }
            }
            /// `nfs` for native guests: its types only (natively the nfs backend's logic is
            /// compiled and linted; it runs as a component).
            pub mod nfs {
                pub use crate::bindings::wasmcsi::backend::nfs::{CopyProgress, NfsExport};
            }
            /// `rbd` types for native guests (their driver logic runs over a `Host` trait).
            pub mod rbd {
                pub use crate::bindings::wasmcsi::backend::rbd::{ImageInfo, ImageSnapshot, PoolStats};
            }
            /// `dir` for native guests: the same checked operations the component gets,
            /// on the roots of the backend whose call runs on this thread.
            pub mod dir {
                use crate::bindings::types::Error;
                pub use crate::bindings::wasmcsi::backend::dir::{FileKind, FileStat, Space};
                use crate::host::dir as ops;
                use std::path::PathBuf;

                fn path(root: &str, rel: &str) -> Result<PathBuf, Error> {
                    let base = crate::native::root(root)?;
                    ops::resolve(&base, rel)
                }
                pub fn roots() -> Vec<String> {
                    crate::native::ROOTS.with(|r| r.borrow().keys().cloned().collect())
                }
                pub fn mkdir(root: &str, p: &str, mode: u32) -> Result<(), Error> {
                    ops::mkdir(&path(root, p)?, mode)
                }
                pub fn stat(root: &str, p: &str) -> Result<Option<FileStat>, Error> {
                    ops::stat(&path(root, p)?)
                }
                pub fn read_dir(root: &str, p: &str) -> Result<Vec<String>, Error> {
                    ops::read_dir(&path(root, p)?)
                }
                pub fn read_file(root: &str, p: &str) -> Result<Vec<u8>, Error> {
                    ops::read_file(&path(root, p)?)
                }
                pub fn write_file(root: &str, p: &str, data: &[u8]) -> Result<(), Error> {
                    ops::write_file(&path(root, p)?, data)
                }
                pub fn copy_tree(root: &str, from: &str, to: &str) -> Result<(), Error> {
                    ops::copy_tree(&path(root, from)?, &path(root, to)?)
                }
                pub fn rename(root: &str, from: &str, to: &str) -> Result<(), Error> {
                    ops::rename(&path(root, from)?, &path(root, to)?)
                }
                pub fn remove_all(root: &str, p: &str) -> Result<(), Error> {
                    if p.is_empty() {
                        return Err(Error::InvalidArgument(format!("refusing to remove dir root {root:?} itself")));
                    }
                    ops::remove_all(&path(root, p)?)
                }
                pub fn usage(root: &str, p: &str) -> Result<u64, Error> {
                    ops::usage(&path(root, p)?)
                }
                pub fn fs_stats(root: &str) -> Result<Space, Error> {
                    ops::space(&path(root, "")?)
                }
            }
        }
    }
}

thread_local! {
    /// Dir roots of the native backend whose call runs on this thread.
    static ROOTS: RefCell<BTreeMap<String, PathBuf>> = const { RefCell::new(BTreeMap::new()) };
}

fn root(name: &str) -> Result<PathBuf, Error> {
    ROOTS
        .with(|r| r.borrow().get(name).cloned())
        .ok_or_else(|| Error::PermissionDenied(format!("dir root {name:?} is not granted")))
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
        }
    }
}
