//! A guest-SDK backend linked natively: [`NativeDriver::of_backend`] calls a
//! `wasmcsi_backend_sdk::Backend` with a host that serves `dir` (the backend's granted roots,
//! through the same checked operations as the component's import) and `log` (tracing), and
//! grants nothing else. The two bindings of the one WIT (wasmtime's here, wit-bindgen's in the
//! SDK) have the same shapes under different types; [`Conv`] maps one onto the other.
use super::{NativeDriver, ROOTS};
use crate::bindings::types as h;
use crate::exports::for_each_export;
use crate::imports::dir as ops;
use std::path::PathBuf;
use wasmcsi_backend_sdk::dir::{FileKind, FileStat, Space};
use wasmcsi_backend_sdk::log::Level;
use wasmcsi_backend_sdk::{Backend, Host, Ungranted, types as s};

/// The host's types under the same names as the SDK's `types`.
mod host_types {
    pub use crate::bindings::driver::{
        Attachment, BackendInfo, BindPlan, BlockPlan, Capacity, CreateVolumeRequest, Encryption, Expansion, Feature,
        Frontend, GroupSnapshot, NfsPlan, RbdPlan, SnapshotPage, VolumePage, VolumeStatus,
    };
    pub use crate::bindings::types::*;
    pub use crate::bindings::wasmcsi::backend::dir::{FileKind, FileStat, Space};
}
use host_types as ht;

/// The same WIT value in the other binding.
trait Conv<T> {
    fn conv(self) -> T;
}

macro_rules! same {
    ($($t:ty),*) => { $(impl Conv<$t> for $t { fn conv(self) -> $t { self } })* };
}
same!(String, u8, u64, u32, i64, bool);

impl<A: Conv<B>, B> Conv<Vec<B>> for Vec<A> {
    fn conv(self) -> Vec<B> {
        self.into_iter().map(Conv::conv).collect()
    }
}
impl<A: Conv<B>, B> Conv<Option<B>> for Option<A> {
    fn conv(self) -> Option<B> {
        self.map(Conv::conv)
    }
}
impl<A: Conv<C>, B: Conv<D>, C, D> Conv<Result<C, D>> for Result<A, B> {
    fn conv(self) -> Result<C, D> {
        self.map(Conv::conv).map_err(Conv::conv)
    }
}
impl Conv<()> for () {
    fn conv(self) {}
}

/// Records: field by field, both ways.
macro_rules! records {
    ($($name:ident { $($f:ident),* })*) => { $(
        impl Conv<s::$name> for ht::$name {
            fn conv(self) -> s::$name { s::$name { $($f: self.$f.conv()),* } }
        }
        impl Conv<ht::$name> for s::$name {
            fn conv(self) -> ht::$name { ht::$name { $($f: self.$f.conv()),* } }
        }
    )* };
}

/// Enums and variants (cases without a payload or with one): case by case, both ways.
macro_rules! cases {
    ($($name:ident { $($case:ident $(($x:ident))?),* })*) => { $(
        impl Conv<s::$name> for ht::$name {
            fn conv(self) -> s::$name { match self { $(ht::$name::$case $(($x))? => s::$name::$case $(($x.conv()))?),* } }
        }
        impl Conv<ht::$name> for s::$name {
            fn conv(self) -> ht::$name { match self { $(s::$name::$case $(($x))? => ht::$name::$case $(($x.conv()))?),* } }
        }
    )* };
}

records! {
    Pair { key, value }
    SecretRef { key, handle }
    Timestamp { seconds, nanos }
    Topology { segments }
    TopologyRequirement { requisite, preferred }
    CapacityRange { required_bytes, limit_bytes }
    MountVolume { fs_type, mount_flags }
    VolumeCapability { access_type, access_mode }
    Volume { volume_id, capacity_bytes, volume_context, content_source, accessible_topology }
    VolumeCondition { abnormal, message }
    Snapshot { snapshot_id, source_volume_id, size_bytes, creation_time, ready_to_use }
    BackendInfo { name, version, features, parameters }
    CreateVolumeRequest {
        name, capacity, capabilities, parameters, secrets, content_source, accessibility, mutable_parameters
    }
    Expansion { capacity_bytes, node_expansion_required }
    SnapshotPage { entries, next_token }
    VolumeStatus { volume, condition }
    VolumePage { entries, next_token }
    Capacity { available_bytes, maximum_volume_bytes, minimum_volume_bytes }
    BindPlan { root, path, capacity_bytes }
    NfsPlan { server, share, path, mount_options }
    BlockPlan { volume_id, size_bytes, fs_type, frontend, encryption }
    RbdPlan { cluster, pool, image, secrets, encryption }
    Encryption { passphrase }
    GroupSnapshot { group_snapshot_id, snapshots, creation_time, ready_to_use }
}

cases! {
    AccessMode {
        SingleNodeWriter, SingleNodeReaderOnly, MultiNodeReaderOnly, MultiNodeSingleWriter, MultiNodeMultiWriter,
        SingleNodeSingleWriter, SingleNodeMultiWriter
    }
    AccessType { Block, Mount(m) }
    ContentSource { Snapshot(id), Volume(id) }
    Feature {
        CreateDeleteVolume, CreateDeleteSnapshot, ListSnapshots, CloneVolume, ExpandVolume, OnlineExpansion, GetCapacity,
        ListVolumes, GetVolume, VolumeCondition, SingleNodeMultiWriter, NodeExpansion, GetSnapshot, SelfHealing,
        ModifyVolume, GroupSnapshots
    }
    Frontend { Ublk, Nbd, FuseLoop }
    Attachment { Bind(p), Nfs(p), ReplicatedBlock(p), Rbd(p) }
    Error {
        InvalidArgument(m), NotFound(m), AlreadyExists(m), FailedPrecondition(m), OutOfRange(m), ResourceExhausted(m),
        Unavailable(m), Aborted(m), Unimplemented(m), DeadlineExceeded(m), PermissionDenied(m), Internal(m)
    }
}

impl Conv<FileStat> for ht::FileStat {
    fn conv(self) -> FileStat {
        let kind = match self.kind {
            ht::FileKind::Directory => FileKind::Directory,
            ht::FileKind::File => FileKind::File,
            ht::FileKind::Symlink => FileKind::Symlink,
            ht::FileKind::Other => FileKind::Other,
        };
        FileStat {
            kind,
            size: self.size,
            mode: self.mode,
            uid: self.uid,
            gid: self.gid,
            modified: self.modified.conv(),
        }
    }
}
impl Conv<Space> for ht::Space {
    fn conv(self) -> Space {
        Space { total_bytes: self.total_bytes, available_bytes: self.available_bytes }
    }
}

/// The host of a native backend: `dir` and `log` served by this process, nothing else granted.
struct NativeHost;

/// `dir` on the roots of the backend whose call runs on this thread ([`super::with_roots`]).
struct NativeDir;

/// `log` into tracing, like the component's import.
struct NativeLog;

impl Host for NativeHost {
    type Kv = Ungranted;
    type Log = NativeLog;
    type Dir = NativeDir;
    type Nfs = Ungranted;
    type Rbd = Ungranted;
    type Block = Ungranted;
    type Backup = Ungranted;
    fn kv(&self) -> &Ungranted {
        &Ungranted
    }
    fn log(&self) -> &NativeLog {
        &NativeLog
    }
    fn dir(&self) -> &NativeDir {
        &NativeDir
    }
    fn nfs(&self) -> &Ungranted {
        &Ungranted
    }
    fn rbd(&self) -> &Ungranted {
        &Ungranted
    }
    fn block(&self) -> &Ungranted {
        &Ungranted
    }
    fn backup(&self) -> &Ungranted {
        &Ungranted
    }
}

impl wasmcsi_backend_sdk::log::Log for NativeLog {
    fn log(&self, level: Level, message: &str, fields: &[(&str, &str)]) {
        let fields: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let fields = fields.join(" ");
        match level {
            Level::Trace | Level::Debug => tracing::debug!(target: "wasmcsi::native", fields, "{message}"),
            Level::Info => tracing::info!(target: "wasmcsi::native", fields, "{message}"),
            Level::Warn | Level::Error => tracing::warn!(target: "wasmcsi::native", fields, "{message}"),
        }
    }
}

/// A granted root's directory, as the component's import looks it up.
fn base(root: &str) -> Result<PathBuf, h::Error> {
    ROOTS
        .with(|r| r.borrow().get(root).cloned())
        .ok_or_else(|| h::Error::PermissionDenied(format!("dir root {root:?} is not granted")))
}

impl wasmcsi_backend_sdk::dir::Dir for NativeDir {
    fn roots(&self) -> Vec<String> {
        ROOTS.with(|r| r.borrow().keys().cloned().collect())
    }
    fn mkdir(&self, root: &str, p: &str, mode: u32) -> Result<(), s::Error> {
        base(root).and_then(|b| ops::mkdir(&b, p, mode)).conv()
    }
    fn stat(&self, root: &str, p: &str) -> Result<Option<FileStat>, s::Error> {
        base(root).and_then(|b| ops::stat(&b, p)).conv()
    }
    fn read_dir(&self, root: &str, p: &str) -> Result<Vec<String>, s::Error> {
        base(root).and_then(|b| ops::read_dir(&b, p)).conv()
    }
    fn read_file(&self, root: &str, p: &str) -> Result<Vec<u8>, s::Error> {
        base(root).and_then(|b| ops::read_file(&b, p)).conv()
    }
    fn write_file(&self, root: &str, p: &str, data: &[u8]) -> Result<(), s::Error> {
        base(root).and_then(|b| ops::write_file(&b, p, data)).conv()
    }
    fn copy_tree(&self, root: &str, from: &str, to: &str) -> Result<(), s::Error> {
        base(root).and_then(|b| ops::copy_tree(&b, from, to)).conv()
    }
    fn rename(&self, root: &str, from: &str, to: &str) -> Result<(), s::Error> {
        base(root).and_then(|b| ops::rename(&b, from, to)).conv()
    }
    fn remove_all(&self, root: &str, p: &str) -> Result<(), s::Error> {
        base(root).and_then(|b| ops::remove_all(&b, p)).conv()
    }
    fn usage(&self, root: &str, p: &str) -> Result<u64, s::Error> {
        base(root).and_then(|b| ops::usage(&b, p)).conv()
    }
    fn fs_stats(&self, root: &str) -> Result<Space, s::Error> {
        base(root).and_then(|b| ops::space(&b)).conv()
    }
}

macro_rules! of_backend {
    ($(
        $(#[$doc:meta])*
        $f:ident = $wit:literal $([$feature:ident])? ($($a:ident: $t:ty),*) $(+ $refs:ident)? $(with $values:ident)? -> $r:ty;
    )*) => {
        /// The exports of `B`, each converting its arguments to the SDK's types and its answer
        /// back.
        mod exports {
            use super::*;
            use crate::bindings::driver::{
                Attachment, BackendInfo, Capacity, CapacityRange, CreateVolumeRequest, Expansion, GroupSnapshot, Pair,
                SecretRef, Snapshot, SnapshotPage, Timestamp, Topology, Volume, VolumeCapability, VolumePage,
                VolumeStatus,
            };

            pub fn info<B: Backend>() -> BackendInfo {
                B::info().conv()
            }
            $(
                pub fn $f<B: Backend>($($a: $t,)* $($refs: Vec<SecretRef>,)?) -> Result<$r, h::Error> {
                    B::$f(&NativeHost, $($a.conv(),)* $($refs.conv(),)?).conv()
                }
            )*
        }

        impl NativeDriver {
            /// A backend written on the guest SDK, linked into the host: the same crate as its
            /// component, `dir` and `log` served by this process, every other capability not
            /// granted.
            pub fn of_backend<B: Backend>() -> Self {
                Self { info: exports::info::<B>, $($f: exports::$f::<B>,)* }
            }
        }
    };
}

for_each_export!(of_backend);
