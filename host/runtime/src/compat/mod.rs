//! The contract versions this host serves side by side, and the one place that tells them
//! apart once a component's version is known (`contract::ContractVersion::detect`): [`link`]
//! links the host's capabilities under that version's names, and [`ComponentPre`] /
//! [`Driver`] instantiate it and call its exports through the current (0.2.0) Rust types, so
//! nothing outside this module knows an older guest from a current one. What 0.1.0 does
//! differently lives in [`v0_1`].
//!
//! It does not decide which capabilities a backend may import (`capabilities`), nor run calls
//! under limits (`backend`).
mod current;
pub mod v0_1;

pub use current::Current;

use crate::bindings;
use crate::bindings::driver::{
    Attachment, BackendInfo, Capacity, CapacityRange, CreateVolumeRequest, Expansion, Pair, SecretRef, Snapshot,
    SnapshotPage, Topology, Volume, VolumeCapability, VolumePage, VolumeStatus,
};
use crate::bindings::types::Error;
use crate::capabilities::Capability;
use crate::contract::{BLOCK_REFUSED, ContractVersion};
use crate::imports;
use crate::state::CallState;
use wasmtime::Store;
use wasmtime::component::{InstancePre, Linker};

/// Link the host's implementation of `capability` under the name `version` gives it. Every
/// interface but `block` is the same in 0.1.0 and 0.2.0, so one implementation serves both
/// names; bindgen's own `add_to_linker` would register the 0.2.0 name only, and the linker
/// (rightly) treats 0.1 and 0.2 as incompatible. 0.1.0's `block` has no implementation:
/// `ImportSummary::violations` refuses such a component before linking.
pub(crate) fn link(
    linker: &mut Linker<CallState>,
    version: ContractVersion,
    capability: Capability,
) -> wasmtime::Result<()> {
    if capability == Capability::Block && version == ContractVersion::V0_1 {
        return Err(wasmtime::Error::msg(BLOCK_REFUSED));
    }
    let mut instance = linker.instance(&version.interface(capability.name()))?;
    match capability {
        Capability::Types => imports::types::add_to_instance(&mut instance),
        Capability::Log => imports::log::add_to_instance(&mut instance),
        Capability::Kv => imports::kv::add_to_instance(&mut instance),
        Capability::Dir => imports::dir::add_to_instance(&mut instance),
        Capability::Nfs => imports::nfs::add_to_instance(&mut instance),
        Capability::Rbd => imports::rbd::add_to_instance(&mut instance),
        Capability::Block => imports::block::add_to_instance(&mut instance),
    }
}

/// A linked, type-checked component of either version, ready to instantiate per call. A
/// 0.1.0 guest goes through bindgen's instantiation (its exports type-checked per instance);
/// a current one through [`current`], which checks them once, here.
pub(crate) enum ComponentPre {
    V0_1(bindings::v0_1::BackendPre<CallState>),
    V0_2 { pre: InstancePre<CallState>, exports: current::Exports },
}

/// One fresh instance (one call's).
pub(crate) enum Instance {
    V0_1(bindings::v0_1::Backend),
    V0_2(Current),
}

impl ComponentPre {
    /// Check that the component exports `version`'s driver with the types this host expects.
    pub(crate) fn new(version: ContractVersion, pre: InstancePre<CallState>) -> wasmtime::Result<Self> {
        Ok(match version {
            ContractVersion::V0_1 => Self::V0_1(bindings::v0_1::BackendPre::new(pre)?),
            ContractVersion::V0_2 => Self::V0_2 { exports: current::Exports::new(&pre)?, pre },
        })
    }

    pub(crate) async fn instantiate(&self, store: &mut Store<CallState>) -> wasmtime::Result<Instance> {
        Ok(match self {
            Self::V0_1(pre) => Instance::V0_1(pre.instantiate_async(store).await?),
            Self::V0_2 { pre, exports } => Instance::V0_2(Current::new(pre.instantiate_async(store).await?, *exports)),
        })
    }
}

impl Instance {
    pub(crate) fn driver(&self) -> Driver<'_> {
        match self {
            Self::V0_1(i) => Driver::V0_1(i.wasmcsi_backend_driver()),
            Self::V0_2(i) => Driver::V0_2(i),
        }
    }
}

/// The `driver` exports of one instance, whatever version it was built against, called with
/// and answering the current types. Method names and arguments are those of the current
/// bindings' `Guest`.
#[derive(Clone, Copy)]
pub enum Driver<'a> {
    V0_1(&'a bindings::v0_1::driver::Guest),
    V0_2(&'a Current),
}

/// Per export: a 0.2.0 guest is called as is; a `forward`ed export takes the same arguments in
/// 0.1.0 and its answer is converted, an `adapt`ed one is answered by [`v0_1`].
macro_rules! dispatch {
    (
        forward { $(fn $f:ident($($fa:ident: $ft:ty),*) -> $fr:ty;)* }
        adapt { $(fn $a:ident($($aa:ident: $at:ty),*) -> $ar:ty;)* }
    ) => {
        impl Driver<'_> {
            $(pub async fn $f(self, store: &mut Store<CallState>, $($fa: $ft),*) -> wasmtime::Result<Result<$fr, Error>> {
                match self {
                    Self::V0_1(g) => g.$f(store, $($fa),*).await.map(|answer| answer.map(Into::into)),
                    Self::V0_2(g) => g.$f(store, $($fa),*).await,
                }
            })*
            $(pub async fn $a(self, store: &mut Store<CallState>, $($aa: $at),*) -> wasmtime::Result<$ar> {
                match self {
                    Self::V0_1(g) => v0_1::$a(g, store, $($aa),*).await,
                    Self::V0_2(g) => g.$a(store, $($aa),*).await,
                }
            })*
        }
    };
}

dispatch! {
    forward {
        fn call_delete_volume(volume_id: &str, secrets: &[SecretRef]) -> ();
        fn call_expand_volume(
            volume_id: &str,
            capacity: CapacityRange,
            capability: Option<&VolumeCapability>,
            secrets: &[SecretRef]
        ) -> Expansion;
        fn call_get_volume(volume_id: &str) -> VolumeStatus;
        fn call_list_volumes(max_entries: u32, starting_token: &str) -> VolumePage;
        fn call_validate_volume_capabilities(
            volume_id: &str,
            volume_context: &[Pair],
            capabilities: &[VolumeCapability],
            parameters: &[Pair]
        ) -> Option<String>;
        fn call_create_snapshot(name: &str, source_volume_id: &str, parameters: &[Pair], secrets: &[SecretRef]) -> Snapshot;
        fn call_delete_snapshot(snapshot_id: &str, secrets: &[SecretRef]) -> ();
        fn call_list_snapshots(
            snapshot_id: Option<&str>,
            source_volume_id: Option<&str>,
            max_entries: u32,
            starting_token: &str
        ) -> SnapshotPage;
        fn call_get_capacity(capabilities: &[VolumeCapability], parameters: &[Pair], topology: Option<&Topology>) -> Capacity;
        fn call_attach_plan(volume_id: &str, volume_context: &[Pair], capability: &VolumeCapability) -> Attachment;
    }
    adapt {
        fn call_info() -> BackendInfo;
        fn call_create_volume(req: &CreateVolumeRequest) -> Result<Volume, Error>;
        fn call_get_snapshot(snapshot_id: &str) -> Result<Snapshot, Error>;
        fn call_reconcile_volume(volume_id: &str) -> Result<(), Error>;
    }
}
