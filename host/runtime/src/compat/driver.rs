//! [`Driver`]: the `driver` exports of one instance, whatever contract version it was built
//! against, called with and answering the current types. Generated from
//! [`crate::exports::for_each_export!`]; each served version implements it (`current.rs`,
//! `v0_1.rs`).
use crate::bindings::driver::{
    Attachment, BackendInfo, Capacity, CapacityRange, CreateVolumeRequest, Expansion, GroupSnapshot, Pair, Snapshot,
    SnapshotPage, Timestamp, Topology, Volume, VolumeCapability, VolumePage, VolumeStatus,
};
use crate::bindings::types::Error;
use crate::exports::{for_each_export, secret_refs_type};
use crate::state::CallState;
use std::future::Future;
use std::pin::Pin;
use wasmtime::Store;

/// What a call into an instance comes to: the export's answer (its own WIT error included),
/// or a wasmtime error (a trap, or an answer that could not be lifted).
pub type CallFuture<'a, R> = Pin<Box<dyn Future<Output = wasmtime::Result<Result<R, Error>>> + Send + 'a>>;

macro_rules! driver_trait {
    ($(
        $(#[$doc:meta])*
        $f:ident = $wit:literal $([$feature:ident])? ($($a:ident: $t:ty),*) $(+ $refs:ident)? $(with $values:ident)? -> $r:ty;
    )*) => {
        /// The `driver` exports of one instance, in the current types (see the module docs). A
        /// method's future borrows the instance and the store for the call.
        pub trait Driver: Sync {
            /// What the backend is and supports (called once, at load; it cannot fail, so
            /// the answer is never a WIT error).
            fn info<'a>(&'a self, store: &'a mut Store<CallState>) -> CallFuture<'a, BackendInfo>;
            $(
                $(#[$doc])*
                fn $f<'a>(
                    &'a self,
                    store: &'a mut Store<CallState>,
                    $($a: $t,)*
                    $($refs: secret_refs_type!($refs),)?
                ) -> CallFuture<'a, $r>;
            )*
        }
    };
}

for_each_export!(driver_trait);
