//! The contract versions this host serves side by side, and the one place that tells them
//! apart once a component's version is known (`contract::ContractVersion::detect`): [`link`]
//! links the host's capabilities under that version's names, and [`ComponentPre`] instantiates
//! it and hands out its exports as a [`Driver`], called with and answering the current Rust
//! types, so nothing outside this module knows an older guest from a current one.
//!
//! - `driver.rs`: the [`Driver`] trait, generated from the export table (`crate::exports`);
//! - `current.rs`: the current version's exports, generated from the same table;
//! - `v0_1.rs`: what `wasmcsi:backend@0.1.0` guests answer, and the record conversions;
//! - `lend.rs`: `forward!`, for a previous version's exports that take the current arguments.
//!
//! # A new contract version
//!
//! When `@0.N.0` becomes current, the one it replaces becomes a previous version like 0.1.0:
//! its WIT moves to `wit/previous/`, it gets a `bindgen!` in `bindings.rs` (the interfaces it
//! shares with the new version through `with`), a variant in `contract::ContractVersion`, a
//! module here whose `impl Driver for …::driver::Guest` forwards what did not change and
//! converts what did, and an arm in [`ComponentPre`] and [`link`]. The current version's
//! exports are the table's rows (`crate::exports`); its `DRIVER` name is in `current.rs`. An
//! imported interface whose shape changed keeps serving the previous version's guests through
//! that version's `Host` trait implemented on the same view (`impl v0_N::…::rbd::Host for
//! RbdCtxView<'_>`, converting to the current functions) and its own arm in [`link`]; one
//! whose shape did not is shared through `with` and needs nothing.
//!
//! It does not decide which capabilities a backend may import (`capabilities`), nor run calls
//! under limits (`backend`).
mod current;
mod driver;
mod lend;
pub mod v0_1;

pub use current::Current;
pub use driver::{CallFuture, Driver};

use crate::bindings;
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
    /// The instance's `driver` exports, in the current types.
    pub(crate) fn driver(&self) -> &dyn Driver {
        match self {
            Self::V0_1(i) => i.wasmcsi_backend_driver(),
            Self::V0_2(i) => i,
        }
    }
}
