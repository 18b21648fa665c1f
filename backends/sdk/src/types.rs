//! The WIT's types under one short path: what the `driver` exports take and return, and the
//! [`Error`] every capability and export reports. Capability-specific types live with their
//! capability ([`crate::dir`], [`crate::nfs`], [`crate::rbd`], [`crate::block`],
//! [`crate::backup`]).
pub use crate::wit::exports::wasmcsi::backend::driver::{
    Attachment, BackendInfo, BindPlan, BlockPlan, Capacity, CreateVolumeRequest, Encryption, Expansion, Feature,
    Frontend, GroupSnapshot, NfsPlan, RbdPlan, SnapshotPage, VolumePage, VolumeStatus,
};
pub use crate::wit::wasmcsi::backend::types::{
    AccessMode, AccessType, CapacityRange, ContentSource, Error, IoLimits, MountVolume, Pair, SecretRef, Snapshot,
    Timestamp, Topology, TopologyRequirement, Volume, VolumeCapability, VolumeCondition,
};

impl IoLimits {
    /// No limit at all.
    pub const UNLIMITED: IoLimits =
        IoLimits { read_iops: 0, write_iops: 0, read_bytes_per_second: 0, write_bytes_per_second: 0 };
}

impl AccessMode {
    /// Modes a volume on one node can serve.
    pub fn is_single_node(self) -> bool {
        use AccessMode::*;
        matches!(self, SingleNodeWriter | SingleNodeReaderOnly | SingleNodeSingleWriter | SingleNodeMultiWriter)
    }
    /// Modes where several nodes may write.
    pub fn is_multi_node_writer(self) -> bool {
        matches!(self, AccessMode::MultiNodeSingleWriter | AccessMode::MultiNodeMultiWriter)
    }
}

impl VolumeCapability {
    /// A raw block device (`volumeMode: Block`), not a filesystem.
    pub fn is_block(&self) -> bool {
        matches!(self.access_type, AccessType::Block)
    }
}

impl Volume {
    /// A volume with no context, source or topology.
    pub fn new(volume_id: impl Into<String>, capacity_bytes: u64) -> Self {
        Volume {
            volume_id: volume_id.into(),
            capacity_bytes,
            volume_context: vec![],
            content_source: None,
            accessible_topology: vec![],
        }
    }
}

/// Prefix the message of a WIT error with what was being done, keeping its case (and so its
/// gRPC code): `read meta/v1: not utf-8`.
pub trait Context<T> {
    fn context(self, what: impl std::fmt::Display) -> Result<T, Error>;
}

impl<T> Context<T> for Result<T, Error> {
    fn context(self, what: impl std::fmt::Display) -> Result<T, Error> {
        self.map_err(|e| with_message(e, |m| format!("{what}: {m}")))
    }
}

/// The message of a WIT error, whatever its case.
pub fn message(e: &Error) -> &str {
    match e {
        Error::InvalidArgument(m)
        | Error::NotFound(m)
        | Error::AlreadyExists(m)
        | Error::FailedPrecondition(m)
        | Error::OutOfRange(m)
        | Error::ResourceExhausted(m)
        | Error::Unavailable(m)
        | Error::Aborted(m)
        | Error::Unimplemented(m)
        | Error::DeadlineExceeded(m)
        | Error::PermissionDenied(m)
        | Error::Internal(m) => m,
    }
}

/// The same case with its message rewritten.
pub fn with_message(e: Error, f: impl FnOnce(&str) -> String) -> Error {
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(f(&m)),
        Error::NotFound(m) => Error::NotFound(f(&m)),
        Error::AlreadyExists(m) => Error::AlreadyExists(f(&m)),
        Error::FailedPrecondition(m) => Error::FailedPrecondition(f(&m)),
        Error::OutOfRange(m) => Error::OutOfRange(f(&m)),
        Error::ResourceExhausted(m) => Error::ResourceExhausted(f(&m)),
        Error::Unavailable(m) => Error::Unavailable(f(&m)),
        Error::Aborted(m) => Error::Aborted(f(&m)),
        Error::Unimplemented(m) => Error::Unimplemented(f(&m)),
        Error::DeadlineExceeded(m) => Error::DeadlineExceeded(f(&m)),
        Error::PermissionDenied(m) => Error::PermissionDenied(f(&m)),
        Error::Internal(m) => Error::Internal(f(&m)),
    }
}

/// A `key = value` list (parameters, volume context) as WIT pairs.
pub fn pairs<'a>(kv: impl IntoIterator<Item = (&'a str, &'a str)>) -> Vec<Pair> {
    kv.into_iter().map(|(k, v)| Pair { key: k.into(), value: v.into() }).collect()
}

/// The value of `key` in WIT pairs.
pub fn lookup<'a>(pairs: &'a [Pair], key: &str) -> Option<&'a str> {
    pairs.iter().find(|p| p.key == key).map(|p| p.value.as_str())
}
