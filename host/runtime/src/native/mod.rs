//! Backends linked natively instead of loaded as components, for benchmarks and tests only
//! (feature `native`; production builds have none of this module): a [`NativeDriver`] is a
//! backend's exports as plain functions over the host's binding types. It exists to measure
//! what the sandbox costs (the same backend, `.wasm` vs native, through the same CSI path) and
//! to let host tests plug in a planner without compiling a component. A native backend has no
//! memory cap, deadline trap or fuel, only the import-side checks (`dir` resolution).
//!
//! Two ways in: [`NativeDriver::of`] a type implementing [`Guest`] (host types, for host
//! tests), and [`NativeDriver::of_backend`] a `wasmcsi_backend_sdk::Backend`: the backend's
//! own crate, compiled for the host, with `dir` and `log` served by the host and nothing else
//! granted. Both are generated from the export table (`crate::exports`).
use crate::bindings::driver::{
    Attachment, BackendInfo, Capacity, CapacityRange, CreateVolumeRequest, Expansion, GroupSnapshot, Pair, Snapshot,
    SnapshotPage, Timestamp, Topology, Volume, VolumeCapability, VolumePage, VolumeStatus,
};
use crate::bindings::types::Error;
use crate::exports::{for_each_export, secret_refs_type};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::PathBuf;

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

/// The default of an export a native guest does not implement.
fn not_implemented<T>(export: &str) -> Result<T, Error> {
    Err(Error::Unimplemented(format!("{export}: not implemented by this native backend")))
}

macro_rules! native {
    ($(
        $(#[$doc:meta])*
        $f:ident = $wit:literal $([$feature:ident])? ($($a:ident: $t:ty),*) $(+ $refs:ident)? $(with $values:ident)? -> $r:ty;
    )*) => {
        /// The `driver` exports, as the guest implements them (same signatures as
        /// wit-bindgen's). Every export but `info` answers `unimplemented` unless the guest
        /// implements it: a host test's planner writes only what it plans, and the host calls
        /// what `info` does not declare only where the contract says every backend has it (so
        /// such a test sees `unimplemented`, never a panic).
        pub trait Guest {
            fn info() -> BackendInfo;
            $(
                $(#[$doc])*
                fn $f($($a: $t,)* $($refs: secret_refs_type!($refs),)?) -> Result<$r, Error> {
                    let _ = ($($a,)* $($refs,)?);
                    not_implemented($wit)
                }
            )*
        }

        /// A native guest's exports as plain function pointers (what a `Backend` holds).
        #[derive(Clone, Copy)]
        #[allow(clippy::type_complexity, reason = "one field per WIT export, spelled like the export")]
        pub struct NativeDriver {
            pub(crate) info: fn() -> BackendInfo,
            $(pub(crate) $f: fn($($t,)* $(secret_refs_type!($refs),)?) -> Result<$r, Error>,)*
        }

        impl NativeDriver {
            pub fn of<G: Guest>() -> Self {
                Self { info: G::info, $($f: G::$f,)* }
            }
        }
    };
}

for_each_export!(native);
