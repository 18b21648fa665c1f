//! The contract versions this host serves side by side, and the one place that tells them
//! apart. A component is built against one `wasmcsi:backend` package version:
//! [`ContractVersion::detect`] reads which from the names it exports and imports, [`link`]
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

use crate::bindings::driver::{
    Attachment, BackendInfo, Capacity, CapacityRange, CreateVolumeRequest, Expansion, Pair, SecretRef, Snapshot,
    SnapshotPage, Topology, Volume, VolumeCapability, VolumePage, VolumeStatus,
};
use crate::bindings::types::Error;
use crate::bindings::{self, wasmcsi::backend as wit};
use crate::capabilities::{Capability, ImportSummary, PACKAGE};
use crate::state::CallState;
use std::fmt;
use wasmtime::Store;
use wasmtime::component::{HasSelf, InstancePre, Linker, LinkerInstance};

/// A version of the `wasmcsi:backend` package this host serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ContractVersion {
    /// `wit/previous/0.1.0`: no provider for `block`, no `get-snapshot` / `reconcile-volume`.
    V0_1,
    /// `wit/backend.wit`, the current contract.
    V0_2,
}

/// Why a component's names do not make it a backend of a version this host serves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    #[error("it exports no {PACKAGE}driver, so it is no wasmcsi backend (exports: [{}])", .exports.join(", "))]
    NoDriver { exports: Vec<String> },
    #[error("it exports more than one driver ({}); a backend is built against one version", .drivers.join(", "))]
    SeveralDrivers { drivers: Vec<String> },
    #[error("it names {name}; this host serves {PACKAGE} at @0.1.0 and @0.2.0 (rebuild it against wit/backend.wit)")]
    Unsupported { name: String },
    #[error(
        "it mixes contract versions: it exports {export} but imports {import}; \
         a backend is built against one wasmcsi:backend version"
    )]
    Mixed { export: String, import: String },
}

impl ContractVersion {
    /// The version this host's own types are.
    pub const CURRENT: Self = Self::V0_2;

    /// The package version as WIT names it.
    pub fn package_version(self) -> &'static str {
        match self {
            Self::V0_1 => "0.1.0",
            Self::V0_2 => "0.2.0",
        }
    }

    /// The version a semver string like `0.1.0` belongs to. Versions `0.x.y` of one `x` are
    /// compatible (wasmtime's linker resolves one to the other), so any patch release counts;
    /// pre-releases and builds do not.
    pub fn of(version: &str) -> Option<Self> {
        let (minor, patch) = version.strip_prefix("0.")?.split_once('.')?;
        if patch.is_empty() || !patch.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        match minor {
            "1" => Some(Self::V0_1),
            "2" => Some(Self::V0_2),
            _ => None,
        }
    }

    /// `wasmcsi:backend/INTERFACE@VERSION`, the name a component of this version imports.
    pub fn interface(self, interface: &str) -> String {
        format!("{PACKAGE}{interface}@{}", self.package_version())
    }

    /// The version a component is built against, from the names it exports (exactly one
    /// `wasmcsi:backend/driver@…`) and imports (every `wasmcsi:backend/…` of that version).
    pub fn detect(imports: &ImportSummary, exports: &[String]) -> Result<Self, ContractError> {
        let drivers: Vec<&String> = exports
            .iter()
            .filter(|e| e.strip_prefix(PACKAGE).is_some_and(|rest| rest.split('@').next() == Some("driver")))
            .collect();
        let export = match drivers[..] {
            [] => return Err(ContractError::NoDriver { exports: exports.to_vec() }),
            [one] => one,
            _ => return Err(ContractError::SeveralDrivers { drivers: drivers.into_iter().cloned().collect() }),
        };
        let version = Self::of_name(export).ok_or_else(|| ContractError::Unsupported { name: export.clone() })?;
        match imports.wasmcsi.iter().find(|import| Self::of_name(import) != Some(version)) {
            Some(import) => Err(ContractError::Mixed { export: export.clone(), import: import.clone() }),
            None => Ok(version),
        }
    }

    /// The version of a name like `wasmcsi:backend/kv@0.1.0`; `None` without a served one.
    fn of_name(name: &str) -> Option<Self> {
        Self::of(name.split_once('@')?.1)
    }
}

impl fmt::Display for ContractVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "wasmcsi:backend@{}", self.package_version())
    }
}

/// Adds one interface's host functions to a linker instance (bindgen's `add_to_linker_instance`).
type AddInstance = fn(&mut LinkerInstance<'_, CallState>, fn(&mut CallState) -> &mut CallState) -> wasmtime::Result<()>;

/// Link the host's implementation of `capability` under the name `version` gives it. Every
/// interface but `block` is the same in 0.1.0 and 0.2.0, so one implementation serves both
/// names; bindgen's own `add_to_linker` would register the 0.2.0 name only, and the linker
/// (rightly) treats 0.1 and 0.2 as incompatible. 0.1.0's `block` has no implementation:
/// [`ImportSummary::violations`] refuses such a component before linking.
pub(crate) fn link(
    linker: &mut Linker<CallState>,
    version: ContractVersion,
    capability: Capability,
) -> wasmtime::Result<()> {
    let add: AddInstance = match capability {
        Capability::Types => wit::types::add_to_linker_instance::<CallState, HasSelf<CallState>>,
        Capability::Log => wit::log::add_to_linker_instance::<CallState, HasSelf<CallState>>,
        Capability::Kv => wit::kv::add_to_linker_instance::<CallState, HasSelf<CallState>>,
        Capability::Dir => wit::dir::add_to_linker_instance::<CallState, HasSelf<CallState>>,
        Capability::Nfs => wit::nfs::add_to_linker_instance::<CallState, HasSelf<CallState>>,
        Capability::Rbd => wit::rbd::add_to_linker_instance::<CallState, HasSelf<CallState>>,
        Capability::Block if version == ContractVersion::V0_1 => {
            return Err(wasmtime::Error::msg(v0_1::BLOCK_REFUSED));
        }
        Capability::Block => wit::block::add_to_linker_instance::<CallState, HasSelf<CallState>>,
    };
    add(&mut linker.instance(&version.interface(capability.name()))?, |s| s)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn imports(names: &[&str]) -> ImportSummary {
        ImportSummary::classify(names.iter().copied())
    }

    fn exports(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn the_version_comes_from_the_driver_export_and_every_import_must_agree() {
        let old = imports(&["wasmcsi:backend/types@0.1.0", "wasmcsi:backend/dir@0.1.0", "wasi:io/streams@0.2.6"]);
        assert_eq!(
            ContractVersion::detect(&old, &exports(&["wasmcsi:backend/driver@0.1.0"])),
            Ok(ContractVersion::V0_1)
        );
        let new = imports(&["wasmcsi:backend/block@0.2.0"]);
        assert_eq!(
            ContractVersion::detect(&new, &exports(&["wasmcsi:backend/driver@0.2.0"])),
            Ok(ContractVersion::V0_2)
        );
        // A patch release of a version is that version (the linker resolves it the same way).
        assert_eq!(
            ContractVersion::detect(
                &imports(&["wasmcsi:backend/kv@0.1.3"]),
                &exports(&["wasmcsi:backend/driver@0.1.0"])
            ),
            Ok(ContractVersion::V0_1)
        );
        // No wasmcsi import at all: the export decides.
        assert_eq!(
            ContractVersion::detect(&imports(&[]), &exports(&["wasmcsi:backend/driver@0.2.0"])),
            Ok(ContractVersion::V0_2)
        );
    }

    #[test]
    fn a_component_mixing_versions_is_refused_naming_both() {
        let mixed = imports(&["wasmcsi:backend/types@0.1.0", "wasmcsi:backend/kv@0.2.0"]);
        let e = ContractVersion::detect(&mixed, &exports(&["wasmcsi:backend/driver@0.1.0"])).expect_err("mixed");
        assert_eq!(
            e,
            ContractError::Mixed {
                export: "wasmcsi:backend/driver@0.1.0".into(),
                import: "wasmcsi:backend/kv@0.2.0".into()
            }
        );
        let text = e.to_string();
        assert!(text.contains("driver@0.1.0") && text.contains("kv@0.2.0"), "{text}");
    }

    #[test]
    fn a_component_without_one_driver_of_a_served_version_is_refused() {
        let none = ContractVersion::detect(&imports(&[]), &exports(&["wasi:cli/run@0.2.6"])).expect_err("no driver");
        assert!(matches!(none, ContractError::NoDriver { .. }), "{none}");
        assert!(none.to_string().contains("wasi:cli/run@0.2.6"), "{none}");
        // `driver-extra` is not `driver`.
        let lookalike = ContractVersion::detect(&imports(&[]), &exports(&["wasmcsi:backend/driver-extra@0.2.0"]));
        assert!(matches!(lookalike, Err(ContractError::NoDriver { .. })), "{lookalike:?}");
        let both = exports(&["wasmcsi:backend/driver@0.1.0", "wasmcsi:backend/driver@0.2.0"]);
        assert!(matches!(ContractVersion::detect(&imports(&[]), &both), Err(ContractError::SeveralDrivers { .. })));
        for unserved in ["0.3.0", "1.0.0", "0.2.0-rc1", "0.1", ""] {
            let driver = if unserved.is_empty() {
                "wasmcsi:backend/driver".to_string()
            } else {
                format!("wasmcsi:backend/driver@{unserved}")
            };
            let e = ContractVersion::detect(&imports(&[]), std::slice::from_ref(&driver)).expect_err("unserved");
            assert_eq!(e, ContractError::Unsupported { name: driver.clone() }, "{driver}");
            assert!(e.to_string().contains("@0.1.0 and @0.2.0"), "{e}");
        }
    }

    #[test]
    fn interface_names_carry_the_package_version() {
        assert_eq!(ContractVersion::V0_1.interface("kv"), "wasmcsi:backend/kv@0.1.0");
        assert_eq!(ContractVersion::CURRENT.interface("block"), "wasmcsi:backend/block@0.2.0");
        assert_eq!(ContractVersion::V0_1.to_string(), "wasmcsi:backend@0.1.0");
    }
}
