//! The `driver` exports of a guest built against the current contract, called without
//! bindgen's per-instance setup. Bindgen's `BackendPre::instantiate` type-checks every export
//! of every fresh instance (14 functions, their records compared field by field): ~14 µs of
//! each call's CPU, a sixth of what the sandbox added to hostpath's CreateVolume, for an answer
//! that cannot change, since every instance comes from the same component. Here every export is
//! found and type-checked once, when the component is loaded ([`Exports::new`]); a call
//! type-checks only the one export it calls, against the same types, and calls it as bindgen
//! would. Generated from [`crate::exports::for_each_export!`]: the exports' names and types
//! are the table's, which this check holds to the component's WIT.
use super::driver::{CallFuture, Driver};
use crate::bindings::driver::{
    Attachment, BackendInfo, Capacity, CapacityRange, CreateVolumeRequest, Expansion, GroupSnapshot, Pair, Snapshot,
    SnapshotPage, Timestamp, Topology, Volume, VolumeCapability, VolumePage, VolumeStatus,
};
use crate::bindings::types::Error;
use crate::exports::{for_each_export, secret_refs_type};
use crate::state::CallState;
use wasmtime::Store;
use wasmtime::component::types::ComponentItem;
use wasmtime::component::{ComponentExportIndex, ComponentNamedList, Instance, InstancePre, Lift, Lower};
use wasmtime::error::Context as _;

/// The export this module calls into.
const DRIVER: &str = "wasmcsi:backend/driver@0.3.0";

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

    /// Call the export at `index` (found and type-checked at load with these types).
    async fn call<P, R>(
        &self,
        store: &mut Store<CallState>,
        index: &ComponentExportIndex,
        params: P,
    ) -> wasmtime::Result<R>
    where
        P: ComponentNamedList + Lower + Send + Sync,
        R: Lift + Send + Sync + 'static,
    {
        let func = self.instance.get_typed_func::<P, (R,)>(&mut *store, index)?;
        Ok(func.call_async(store, params).await?.0)
    }
}

/// Where `name` is in the component's `driver` export, once its type is checked against `P`
/// and `R` as bindgen's instantiation would check it on every instance: a component whose
/// exports do not match is refused when it is loaded.
fn find<P, R>(
    pre: &InstancePre<CallState>,
    driver: &ComponentExportIndex,
    name: &str,
) -> wasmtime::Result<ComponentExportIndex>
where
    P: ComponentNamedList + Lower,
    R: Lift,
{
    let component = pre.component();
    let (item, index) = component
        .get_export(Some(driver), name)
        .ok_or_else(|| wasmtime::format_err!("instance export `{DRIVER}` does not have export `{name}`"))?;
    let ComponentItem::ComponentFunc(func) = item else {
        wasmtime::bail!("export `{name}` is not a function");
    };
    // The instantiated types (the linker's resources included), as bindgen checks them.
    func.typecheck::<P, (R,)>(&pre.instance_type()).with_context(|| format!("type-checking export func `{name}`"))?;
    Ok(index)
}

macro_rules! current {
    ($(
        $(#[$doc:meta])*
        $f:ident = $wit:literal $([$feature:ident])? ($($a:ident: $t:ty),*) $(+ $refs:ident)? $(with $values:ident)? -> $r:ty;
    )*) => {
        /// Where each `driver` export is in one component.
        #[derive(Clone, Copy)]
        pub(crate) struct Exports {
            info: ComponentExportIndex,
            $($f: ComponentExportIndex,)*
        }

        impl Exports {
            /// Find every export and check its type (see [`find`]).
            pub(crate) fn new(pre: &InstancePre<CallState>) -> wasmtime::Result<Self> {
                let driver = pre
                    .component()
                    .get_export_index(None, DRIVER)
                    .ok_or_else(|| wasmtime::format_err!("no exported instance named `{DRIVER}`"))?;
                Ok(Self {
                    info: find::<(), BackendInfo>(pre, &driver, "info")?,
                    $($f: find::<($($t,)* $(secret_refs_type!($refs),)?), Result<$r, Error>>(pre, &driver, $wit)?,)*
                })
            }
        }

        impl Driver for Current {
            fn info<'a>(&'a self, store: &'a mut Store<CallState>) -> CallFuture<'a, BackendInfo> {
                Box::pin(async move { self.call::<(), BackendInfo>(store, &self.exports.info, ()).await.map(Ok) })
            }
            $(
                fn $f<'a>(
                    &'a self,
                    store: &'a mut Store<CallState>,
                    $($a: $t,)*
                    $($refs: secret_refs_type!($refs),)?
                ) -> CallFuture<'a, $r> {
                    Box::pin(self.call(store, &self.exports.$f, ($($a,)* $($refs,)?)))
                }
            )*
        }
    };
}

for_each_export!(current);
