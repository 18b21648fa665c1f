//! The contract versions this host serves side by side, and the one place that tells them
//! apart once a component's version is known (`contract::ContractVersion::detect`): [`link`]
//! links the host's capabilities under that version's names, and [`ComponentPre`] instantiates
//! it and hands out its exports as a [`Driver`], called with and answering the current Rust
//! types, so nothing outside this module knows an older guest from a current one.
//!
//! - `driver.rs`: the [`Driver`] trait, generated from the export table (`crate::exports`);
//! - `current.rs`: the current version's exports, generated from the same table;
//! - `v0_2/`: what `wasmcsi:backend@0.2.0` guests answer (`mod.rs`) and its `block` and `rbd`
//!   imports, whose shape 0.3.0 changed, served on the current capabilities (`block.rs`,
//!   `rbd.rs`);
//! - `v0_1.rs`: what `wasmcsi:backend@0.1.0` guests answer (its `rbd` is 0.2.0's);
//! - `convert.rs`: the macros both write their record conversions with;
//! - `lend.rs`: `forward!`, for a previous version's exports that take the current arguments.
//!
//! # A new contract version
//!
//! When `@0.N.0` becomes current (as 0.3.0 did), the one it replaces becomes a previous version:
//! 1. its WIT moves to `wit/previous/0.M.0/` (frozen: never edited again), the new one is
//!    `wit/backend.wit`, and `wit/testkit` names the new version;
//! 2. `bindings.rs`: a `bindgen!` for it, taking through `with` every interface whose WIT did
//!    not change (a test in its module holds that true: `v0_2::tests`); the older versions'
//!    `with`s that pointed at the current module for an interface that changed now point at
//!    the previous version's generated one (0.1.0's `rbd` → 0.2.0's);
//! 3. `contract.rs`: a variant, its `package_version`, `of`, `ALL`, `CURRENT`, and
//!    `has_interface` for an interface that is new;
//! 4. a module here, `v0_M/`: `impl Driver for …::driver::Guest` that `forward!`s what did not
//!    change and converts or answers (`lacks`) what did; for each imported interface whose shape
//!    changed, that version's `Host` trait implemented on the current capability's view
//!    (`impl v0_M::…::rbd::Host for RbdCtxView<'_>`), converting to the current functions, with
//!    its own `add_to_instance`;
//! 5. arms in [`ComponentPre`], [`Instance`] and [`link`] (the changed imports' adapters);
//! 6. `current.rs`: the `DRIVER` name; `exports.rs`: the new and changed rows, which the
//!    compiler then asks every version's `Driver` impl for;
//! 7. the capabilities' grant checks for a new interface (`capabilities.rs`, refused at the
//!    versions that lack it) and a frozen fixture component of the previous version under
//!    `testing/fixtures/` with tests that it loads and serves (`tests/all/compat.rs`).
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
use crate::bindings::driver::CreateVolumeRequest;
use crate::bindings::types::Error;
use crate::capabilities::Capability;
use crate::contract::{BLOCK_REFUSED, ContractVersion};
use crate::imports;
use crate::state::CallState;
use wasmtime::Store;
use wasmtime::component::{InstancePre, Linker};

mod convert;
pub mod v0_2;

/// Link the host's implementation of `capability` under the name `version` gives it. An
/// interface whose WIT is the same in every version has one implementation under each name
/// (bindgen's own `add_to_linker` would register the current name only, and the linker
/// rightly treats 0.x and 0.y as incompatible); `rbd` before 0.3.0 and `block` at 0.2.0 go
/// through `v0_2`'s adapters. 0.1.0's `block` and `backup` before 0.3.0 have no implementation:
/// `ImportSummary::violations` refuses such a component before linking.
pub(crate) fn link(
    linker: &mut Linker<CallState>,
    version: ContractVersion,
    capability: Capability,
) -> wasmtime::Result<()> {
    if capability == Capability::Block && version == ContractVersion::V0_1 {
        return Err(wasmtime::Error::msg(BLOCK_REFUSED));
    }
    if !version.has_interface(capability.name()) {
        return Err(wasmtime::format_err!("{version} has no interface {}", capability.name()));
    }
    let previous = version < ContractVersion::V0_3;
    let mut instance = linker.instance(&version.interface(capability.name()))?;
    match capability {
        Capability::Types => imports::types::add_to_instance(&mut instance),
        Capability::Log => imports::log::add_to_instance(&mut instance),
        Capability::Kv => imports::kv::add_to_instance(&mut instance),
        Capability::Dir => imports::dir::add_to_instance(&mut instance),
        Capability::Nfs => imports::nfs::add_to_instance(&mut instance),
        Capability::Rbd if previous => v0_2::rbd::add_to_instance(&mut instance),
        Capability::Rbd => imports::rbd::add_to_instance(&mut instance),
        Capability::Block if previous => v0_2::block::add_to_instance(&mut instance),
        Capability::Block => imports::block::add_to_instance(&mut instance),
        Capability::Backup => imports::backup::add_to_instance(&mut instance),
    }
}

/// What an export a version lacks answers: `unimplemented`, without calling the guest (the
/// same answer a current backend without the export's feature gets).
fn lacks<'a, R: 'a>(version: ContractVersion, export: &str) -> CallFuture<'a, R> {
    let message = format!("{export} is not in {version}, which this backend is built against");
    Box::pin(async move { Ok(Err(Error::Unimplemented(message))) })
}

/// A create request for a version without `mutable-parameters`: refused when it carries some
/// (never dropped: the volume would silently lack what the VolumeAttributesClass asked for).
fn refuse_mutable_parameters(version: ContractVersion, req: &CreateVolumeRequest) -> Result<(), Error> {
    match req.mutable_parameters.first() {
        None => Ok(()),
        Some(p) => Err(Error::InvalidArgument(format!(
            "mutable parameter {:?}: this backend is built against {version}, which cannot apply mutable parameters",
            p.key
        ))),
    }
}

/// A linked, type-checked component of any version, ready to instantiate per call. A
/// previous version's guest goes through bindgen's instantiation (its exports type-checked per
/// instance); a current one through [`current`], which checks them once, here.
pub(crate) enum ComponentPre {
    V0_1(bindings::v0_1::BackendPre<CallState>),
    V0_2(bindings::v0_2::BackendPre<CallState>),
    V0_3 { pre: InstancePre<CallState>, exports: current::Exports },
}

/// One fresh instance (one call's).
pub(crate) enum Instance {
    V0_1(bindings::v0_1::Backend),
    V0_2(bindings::v0_2::Backend),
    V0_3(Current),
}

impl ComponentPre {
    /// Check that the component exports `version`'s driver with the types this host expects.
    pub(crate) fn new(version: ContractVersion, pre: InstancePre<CallState>) -> wasmtime::Result<Self> {
        Ok(match version {
            ContractVersion::V0_1 => Self::V0_1(bindings::v0_1::BackendPre::new(pre)?),
            ContractVersion::V0_2 => Self::V0_2(bindings::v0_2::BackendPre::new(pre)?),
            ContractVersion::V0_3 => Self::V0_3 { exports: current::Exports::new(&pre)?, pre },
        })
    }

    pub(crate) async fn instantiate(&self, store: &mut Store<CallState>) -> wasmtime::Result<Instance> {
        Ok(match self {
            Self::V0_1(pre) => Instance::V0_1(pre.instantiate_async(store).await?),
            Self::V0_2(pre) => Instance::V0_2(pre.instantiate_async(store).await?),
            Self::V0_3 { pre, exports } => Instance::V0_3(Current::new(pre.instantiate_async(store).await?, *exports)),
        })
    }
}

impl Instance {
    /// The instance's `driver` exports, in the current types.
    pub(crate) fn driver(&self) -> &dyn Driver {
        match self {
            Self::V0_1(i) => i.wasmcsi_backend_driver(),
            Self::V0_2(i) => i.wasmcsi_backend_driver(),
            Self::V0_3(i) => i,
        }
    }
}
