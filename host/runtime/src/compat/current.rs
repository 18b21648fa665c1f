//! The `driver` exports of a guest built against the current contract, called without
//! bindgen's per-instance setup. Bindgen's `BackendPre::instantiate` type-checks every export
//! of every fresh instance (14 functions, their records compared field by field): ~14 µs of
//! each call's CPU, a sixth of what the sandbox added to hostpath's CreateVolume, for an answer
//! that cannot change, since every instance comes from the same component. Here every export is
//! found and type-checked once, when the component is loaded ([`Exports::new`]); a call
//! type-checks only the one export it calls, against the same types, and calls it as bindgen
//! would.
use crate::bindings::driver::{
    Attachment, BackendInfo, Capacity, CapacityRange, CreateVolumeRequest, Expansion, Pair, SecretRef, Snapshot,
    SnapshotPage, Topology, Volume, VolumeCapability, VolumePage, VolumeStatus,
};
use crate::bindings::types::Error;
use crate::state::CallState;
use wasmtime::Store;
use wasmtime::component::types::ComponentItem;
use wasmtime::component::{ComponentExportIndex, Instance, InstancePre};
use wasmtime::error::Context as _;

/// The export this module calls into.
const DRIVER: &str = "wasmcsi:backend/driver@0.2.0";

/// One fresh instance's `driver` exports.
#[derive(Clone, Copy)]
pub struct Current {
    instance: Instance,
    exports: Exports,
}

impl Current {
    pub(crate) fn new(instance: Instance, exports: Exports) -> Self {
        Self { instance, exports }
    }
}

/// Per export (the name of its `call_…` method, its WIT name, its arguments and answer as
/// bindgen types them): where it is and, once, its type check; and the call.
macro_rules! exports {
    ($($f:ident = $name:literal ($($a:ident: $t:ty),*) -> $r:ty;)*) => {
        /// Where each `driver` export is in one component (a field per `call_…` method).
        #[derive(Clone, Copy)]
        pub(crate) struct Exports {
            $($f: ComponentExportIndex,)*
        }

        impl Exports {
            /// Find every export and check its type, as bindgen's instantiation would on every
            /// instance: a component whose exports do not match is refused when it is loaded.
            pub(crate) fn new(pre: &InstancePre<CallState>) -> wasmtime::Result<Self> {
                let component = pre.component();
                let driver = component
                    .get_export_index(None, DRIVER)
                    .ok_or_else(|| wasmtime::format_err!("no exported instance named `{DRIVER}`"))?;
                // The instantiated types (the linker's resources included), as bindgen checks them.
                let types = pre.instance_type();
                Ok(Self {
                    $($f: {
                        let (item, index) = component.get_export(Some(&driver), $name).ok_or_else(|| {
                            wasmtime::format_err!("instance export `{DRIVER}` does not have export `{}`", $name)
                        })?;
                        let ComponentItem::ComponentFunc(func) = item else {
                            wasmtime::bail!("export `{}` is not a function", $name);
                        };
                        func.typecheck::<($($t,)*), ($r,)>(&types)
                            .with_context(|| format!("type-checking export func `{}`", $name))?;
                        index
                    },)*
                })
            }
        }

        impl Current {
            $(pub async fn $f(&self, store: &mut Store<CallState>, $($a: $t),*) -> wasmtime::Result<$r> {
                let func = self.instance.get_typed_func::<($($t,)*), ($r,)>(&mut *store, &self.exports.$f)?;
                Ok(func.call_async(store, ($($a,)*)).await?.0)
            })*
        }
    };
}

exports! {
    call_info = "info"() -> BackendInfo;
    call_create_volume = "create-volume"(req: &CreateVolumeRequest) -> Result<Volume, Error>;
    call_delete_volume = "delete-volume"(volume_id: &str, secrets: &[SecretRef]) -> Result<(), Error>;
    call_expand_volume = "expand-volume"(
        volume_id: &str,
        capacity: CapacityRange,
        capability: Option<&VolumeCapability>,
        secrets: &[SecretRef]
    ) -> Result<Expansion, Error>;
    call_get_volume = "get-volume"(volume_id: &str) -> Result<VolumeStatus, Error>;
    call_list_volumes = "list-volumes"(max_entries: u32, starting_token: &str) -> Result<VolumePage, Error>;
    call_validate_volume_capabilities = "validate-volume-capabilities"(
        volume_id: &str,
        volume_context: &[Pair],
        capabilities: &[VolumeCapability],
        parameters: &[Pair]
    ) -> Result<Option<String>, Error>;
    call_create_snapshot = "create-snapshot"(
        name: &str,
        source_volume_id: &str,
        parameters: &[Pair],
        secrets: &[SecretRef]
    ) -> Result<Snapshot, Error>;
    call_delete_snapshot = "delete-snapshot"(snapshot_id: &str, secrets: &[SecretRef]) -> Result<(), Error>;
    call_list_snapshots = "list-snapshots"(
        snapshot_id: Option<&str>,
        source_volume_id: Option<&str>,
        max_entries: u32,
        starting_token: &str
    ) -> Result<SnapshotPage, Error>;
    call_get_snapshot = "get-snapshot"(snapshot_id: &str) -> Result<Snapshot, Error>;
    call_reconcile_volume = "reconcile-volume"(volume_id: &str) -> Result<(), Error>;
    call_get_capacity = "get-capacity"(
        capabilities: &[VolumeCapability],
        parameters: &[Pair],
        topology: Option<&Topology>
    ) -> Result<Capacity, Error>;
    call_attach_plan = "attach-plan"(
        volume_id: &str,
        volume_context: &[Pair],
        capability: &VolumeCapability
    ) -> Result<Attachment, Error>;
}
