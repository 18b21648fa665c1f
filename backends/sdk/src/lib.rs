//! The guest SDK of wasmcsi backends: what a backend author writes policy against.
//!
//! It owns the one `wit_bindgen::generate!` of the guests (of the workspace's `wit/`, hidden in
//! `wit`), the export glue ([`export!`]), the [`Backend`] trait a backend implements, the
//! [`Host`] trait through which it reaches the capabilities it imports ([`kv`], [`log`],
//! [`dir`], [`nfs`], [`rbd`], [`block`], [`backup`]), and the policy helpers every backend needs
//! once:
//! [`page`], [`capacity`], [`names`] (CSI names → safe local ids), [`targets`] (where volumes
//! were made, in kv), [`meta`] (metadata files) and [`io_limits`] (the VolumeAttributesClass
//! keys of I/O limits). On wasm32 the host is the component's
//! imports ([`Imports`]); natively the `fake` feature gives [`fake::FakeHost`], so a backend's
//! policy unit-tests in milliseconds, and `wasmcsi-runtime`'s `native` feature runs a backend
//! linked into the host for the sandbox-cost benchmark.
//!
//! It does not load or bound anything (the host's `wasmcsi-runtime` does) and decides no
//! policy: names, sizes, ids and what deleting means are each backend's.
//!
//! **A component imports only what it calls.** The bindings declare the whole `backend`
//! world; `wit-component` keeps only the imports the linked module uses, and the host refuses a
//! component that imports a capability its operator did not grant. Capabilities are therefore
//! reached through `&impl Host` (static dispatch): a function a backend never calls, and the
//! import behind it, is not linked. Never put a capability behind `dyn`.
//!
//! A backend crate is an `rlib` (the artifact build makes the component with
//! `cargo rustc --crate-type cdylib`), denies `unsafe_code`, and ends with
//! `wasmcsi_backend_sdk::export!(MyBackend);`. See [`Backend`] for a whole example and
//! `examples/hostpath` for the template.
pub mod backend;
pub mod backup;
pub mod block;
pub mod capacity;
pub mod dir;
#[cfg(feature = "fake")]
pub mod fake;
pub mod host;
pub mod io_limits;
pub mod kv;
pub mod log;
pub mod meta;
pub mod names;
pub mod nfs;
pub mod page;
pub mod rbd;
pub mod targets;
pub mod types;
#[doc(hidden)]
pub mod wit;

pub use backend::{Backend, Component, unsupported};
pub use host::{Host, Imports, Ungranted};
pub use types::Error;

/// What most backends use, in one import. The capability traits come in unnamed (their methods
/// work through `h.dir()`, `h.nfs()`, …) so they never clash with a backend's own names
/// (a backend called `Nfs`).
pub mod prelude {
    pub use crate::backend::{Backend, unsupported};
    pub use crate::backup::Backup as _;
    pub use crate::block::Block as _;
    pub use crate::capacity::{GIB, MIB, Sizing, grow};
    pub use crate::dir::Dir as _;
    pub use crate::host::Host;
    pub use crate::kv::Kv as _;
    pub use crate::log::Log as _;
    pub use crate::meta::Meta;
    pub use crate::names::{MAX_ID_BYTES, check_csi_name, is_id_byte, local_name, stable_name};
    pub use crate::nfs::Nfs as _;
    pub use crate::page::page;
    pub use crate::rbd::Rbd as _;
    pub use crate::types::{
        AccessMode, AccessType, Attachment, BackendInfo, BindPlan, BlockPlan, Capacity, CapacityRange, ContentSource,
        Context, CreateVolumeRequest, Encryption, Error, Expansion, Feature, Frontend, GroupSnapshot, IoLimits,
        MountVolume, NfsPlan, Pair, RbdPlan, SecretRef, Snapshot, SnapshotPage, Timestamp, Topology,
        TopologyRequirement, Volume, VolumeCapability, VolumeCondition, VolumePage, VolumeStatus,
    };
}

/// Export a [`Backend`] as the component's `driver` (on wasm32; natively it expands to
/// nothing, so the crate still links into native tests). Takes the backend's bare type name,
/// once per component:
///
/// ```ignore
/// pub struct HostPath;
/// impl wasmcsi_backend_sdk::Backend for HostPath { /* … */ }
/// wasmcsi_backend_sdk::export!(HostPath);
/// ```
#[macro_export]
macro_rules! export {
    ($backend:ident) => {
        #[cfg(target_arch = "wasm32")]
        #[allow(unsafe_code, reason = "the export glue is the canonical ABI's unsafe entry points")]
        const _: () = {
            // wit-bindgen's macro takes an identifier, not a path: name the adapter here.
            type WasmcsiComponent = $crate::Component<$backend>;
    $crate::__export_backend_impl!(WasmcsiComponent with_types_in $crate::wit);
        };
    };
}
