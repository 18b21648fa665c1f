//! The `driver` exports of the current contract, written once: [`for_each_export!`] is the
//! one list of them, and everything the host needs per export is generated from it, as
//! wasmtime generates its libcalls from `foreach_builtin_function!`:
//!
//! - the [`Driver`](crate::compat::Driver) trait, one method per export, which every contract
//!   version this host serves implements (`compat/`);
//! - the current version's calls into a component (`compat/current.rs`);
//! - the typed entry points callers use, `Backend::create_volume` and the rest
//!   (`backend.rs`);
//! - with the `native` feature, the native test backend's `Guest` trait and function table
//!   (`native/`).
//!
//! `info` is not in the list: it is the one export every version has, that cannot fail and
//! that only loading calls; each of those places writes it out.
//!
//! Why a table and `macro_rules!` rather than a trait with default methods or a procedural
//! macro: the table keeps every generated signature a plain Rust type the compiler checks
//! where it is used (a wrong type in a row fails in the generated code, naming the export and
//! the type), a missing export in an older version's `Driver` impl is the compiler's own
//! "not all trait items implemented, missing: `…`", and nothing is parsed from the WIT at
//! build time (the WIT stays `bindgen!`'s; the table is checked against it when a component
//! is loaded, see `compat/current.rs`).
//!
//! # Adding an export
//!
//! 1. The WIT: a new package version in `wit/` (older ones move to `wit/previous/`).
//! 2. One row below (its arguments as the host passes them: owned; its answer without the
//!    `error`). The compiler then asks for the rest:
//! 3. one entry per older contract version in its `impl Driver` (`compat/v0_1.rs`, …): a
//!    `forward!` line when that version has the export with the same arguments, else a few
//!    lines answering for it;
//! 4. the guest SDK's `Backend` trait and its adapter (`backends/sdk/src/backend.rs`);
//! 5. what the CSI side makes of the answer (`host/csi/src/answer.rs`), if a CSI call uses it.
//!
//! # The rows
//!
//! `NAME = "WIT-NAME" [[FEATURE]] (ARG: TYPE, …) [+ secrets | with secrets] -> ANSWER;` where
//! the types are those of `crate::bindings::driver`, and the answer is what the export returns
//! in its `result<_, error>`. `[FEATURE]` (a case of `driver::Feature`) makes the typed entry
//! point answer `unimplemented` without calling the backend when its `info` does not declare
//! that feature, whatever version it is built against; exports that CSI gates itself (and the
//! older ones, whose features the CSI service checks before calling) carry none. A call that carries the CSI call's secrets says how the guest gets
//! them: `+ secrets` appends their handles (`list<secret-ref>`) as the last argument;
//! `with secrets` means the handles travel inside an argument (the create request), which the
//! caller filled. Either way the entry point takes the secret values, which stay in the
//! host's store for the capabilities that resolve handles.

/// Calls `$callback!` with every `driver` export but `info` (see the module docs for the
/// row syntax).
macro_rules! for_each_export {
    ($callback:ident) => {
        $callback! {
            /// CreateVolume: a volume, or the one an earlier request of the same name made.
            create_volume = "create-volume"(req: CreateVolumeRequest) with secrets -> Volume;
            /// DeleteVolume: an unknown id succeeds.
            delete_volume = "delete-volume"(volume_id: String) + secrets -> ();
            /// ControllerExpandVolume.
            expand_volume = "expand-volume"(
                volume_id: String,
                capacity: CapacityRange,
                capability: Option<VolumeCapability>
            ) + secrets -> Expansion;
            /// ControllerGetVolume.
            get_volume = "get-volume"(volume_id: String) -> VolumeStatus;
            /// ListVolumes: one page.
            list_volumes = "list-volumes"(max_entries: u32, starting_token: String) -> VolumePage;
            /// ValidateVolumeCapabilities: `None` when every capability is supported, else why not.
            validate_volume_capabilities = "validate-volume-capabilities"(
                volume_id: String,
                volume_context: Vec<Pair>,
                capabilities: Vec<VolumeCapability>,
                parameters: Vec<Pair>
            ) -> Option<String>;
            /// CreateSnapshot.
            create_snapshot = "create-snapshot"(
                name: String,
                source_volume_id: String,
                parameters: Vec<Pair>
            ) + secrets -> Snapshot;
            /// DeleteSnapshot: an unknown id succeeds.
            delete_snapshot = "delete-snapshot"(snapshot_id: String) + secrets -> ();
            /// ListSnapshots: one page.
            list_snapshots = "list-snapshots"(
                snapshot_id: Option<String>,
                source_volume_id: Option<String>,
                max_entries: u32,
                starting_token: String
            ) -> SnapshotPage;
            /// GetSnapshot (feature `get-snapshot`).
            get_snapshot = "get-snapshot"(snapshot_id: String) -> Snapshot;
            /// One volume's check and repair (feature `self-healing`), against the host's clock.
            reconcile_volume = "reconcile-volume"(volume_id: String, now: Timestamp) -> ();
            /// GetCapacity.
            get_capacity = "get-capacity"(
                capabilities: Vec<VolumeCapability>,
                parameters: Vec<Pair>,
                topology: Option<Topology>
            ) -> Capacity;
            /// How the node attaches the volume (NodeStageVolume, whose secrets it is given).
            attach_plan = "attach-plan"(
                volume_id: String,
                volume_context: Vec<Pair>,
                capability: VolumeCapability
            ) + secrets -> Attachment;
            /// ControllerModifyVolume: apply mutable parameters, all or nothing.
            modify_volume = "modify-volume" [ModifyVolume] (
                volume_id: String,
                mutable_parameters: Vec<Pair>
            ) + secrets -> ();
            /// CreateVolumeGroupSnapshot: one crash-consistent point of every source volume.
            create_group_snapshot = "create-group-snapshot" [GroupSnapshots] (
                name: String,
                source_volume_ids: Vec<String>,
                parameters: Vec<Pair>
            ) + secrets -> GroupSnapshot;
            /// DeleteVolumeGroupSnapshot: an unknown id succeeds.
            delete_group_snapshot = "delete-group-snapshot" [GroupSnapshots] (
                group_snapshot_id: String,
                snapshot_ids: Vec<String>
            ) + secrets -> ();
            /// GetVolumeGroupSnapshot.
            get_group_snapshot = "get-group-snapshot" [GroupSnapshots] (
                group_snapshot_id: String,
                snapshot_ids: Vec<String>
            ) + secrets -> GroupSnapshot;
        }
    };
}
pub(crate) use for_each_export;

/// The type of the guest's secret handles argument of a `+ secrets` row, for the generated
/// signatures (a macro repetition needs the row's marker inside it to repeat).
macro_rules! secret_refs_type {
    ($secrets:ident) => {
        Vec<$crate::bindings::types::SecretRef>
    };
}
pub(crate) use secret_refs_type;

#[cfg(test)]
mod tests {
    /// The WIT names of the table's rows.
    macro_rules! wit_names {
        ($(
            $(#[$doc:meta])*
            $f:ident = $wit:literal $([$feature:ident])? ($($a:ident: $t:ty),*) $(+ $refs:ident)? $(with $values:ident)? -> $r:ty;
        )*) => {
            [$($wit),*]
        };
    }

    /// A component is checked against the rows it is called through, not for exports the
    /// table lacks: this holds the table to the current WIT, so an export added there and not
    /// here fails here, not when a CSI call finds it missing.
    #[test]
    fn the_table_has_every_driver_export_of_the_current_wit_and_no_other() {
        let wit = include_str!("../../../wit/backend.wit");
        let mut declared: Vec<&str> = wit
            .lines()
            .skip_while(|l| l.trim() != "interface driver {")
            .take_while(|l| *l != "}")
            .filter_map(|l| l.trim().split_once(": func(").map(|(name, _)| name))
            .collect();
        let mut table: Vec<&str> = for_each_export!(wit_names).into_iter().chain(["info"]).collect();
        declared.sort_unstable();
        table.sort_unstable();
        assert!(declared.len() > 10, "no driver interface found in wit/backend.wit: {declared:?}");
        assert_eq!(table, declared);
    }
}
