//! The replica wire protocol: frames, messages, the encoder and a streaming decoder. This module
//! owns the byte layout documented in `proto/replica-protocol.md` and nothing else: it does no
//! I/O, keeps no connection state and never decides what a message means for a replica or the
//! engine (that is the engine's job and the replica server's).
//!
//! Every frame is `header (24 bytes) + payload`, little-endian. The decoder accepts arbitrary
//! bytes, never panics, and rejects a frame whose declared payload exceeds its limit before
//! allocating anything for it; every length inside a payload is checked against the bytes that
//! are actually there, so no field can make it allocate more than the frame it already holds.
//!
//! The message set and its types are here; the byte layout is in `encode` (what a frame looks
//! like on the wire, including the split encoding that keeps a large write's data uncopied)
//! and `decode` (checking a frame's header and checksum, the payload reader, and the streaming
//! [`FrameDecoder`] connection readers use).

use bytes::Bytes;

mod decode;
mod encode;
#[cfg(test)]
pub(crate) mod tests;

pub use decode::{DecodeError, Decoded, FrameDecoder, decode, decode_with_limit};
pub use encode::{EncodeError, PayloadCrc, SPLIT_MIN, encode, encode_split, encode_with_limit};

/// First four bytes of every frame: "WCSB" (wasmcsi block).
pub const MAGIC: [u8; 4] = *b"WCSB";
/// Version of the framing and of the message set; bumped on any incompatible change.
pub const PROTOCOL_VERSION: u16 = 1;
/// Bytes before the payload: magic, version, kind, request id, payload length, checksum.
pub const HEADER_LEN: usize = 24;
/// Default upper bound for a payload: a 4 MiB write plus its fixed fields. Peers negotiate
/// nothing larger; a larger frame is a protocol error, not a reason to allocate.
pub const DEFAULT_MAX_PAYLOAD: usize = 4 * 1024 * 1024 + 64;
/// Longest volume id or snapshot name; names are identifiers, not data.
pub const MAX_NAME_LEN: usize = 1024;
/// The disk every replica server has (its `--replica-root`). A request that names a replica of
/// a volume (`Hello`, `Describe`, `SetRecord`, `DeleteReplica`) carries the disk only when it
/// is another one: the bytes a peer of the version before disks sends and reads are unchanged,
/// and a request without a disk means this one.
pub const DEFAULT_DISK: &str = "default";

/// Result of one request, carried by every reply. Numbers are wire values and never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Status {
    Ok = 0,
    /// The replica's storage failed (EIO, ENOSPC, fdatasync error).
    IoError = 1,
    /// Offset or length outside the volume.
    OutOfRange = 2,
    /// The request's revision is older than the replica's: an engine that lost its place.
    StaleRevision = 3,
    /// The replica stores another volume.
    WrongVolume = 4,
    /// The peer speaks a protocol version this replica does not serve.
    UnsupportedVersion = 5,
    /// The request was well-framed but made no sense (e.g. shrinking a volume).
    Invalid = 6,
    /// No such replica (control requests, and `Hello` for a volume the node does not hold) or
    /// snapshot.
    NotFound = 7,
    /// A replica or snapshot of that name exists with different properties.
    AlreadyExists = 8,
    /// Refused while an engine has the replica open (e.g. deleting or reverting it).
    Busy = 9,
    /// The session's claim is older than the replica's epoch: another engine was given the
    /// volume (see `Claim`). The engine that gets this must stop serving the volume.
    Fenced = 10,
    /// The peer may not make this request: its certificate's role does not allow it, or a
    /// node's grant for the session is missing, invalid, expired, of another node or volume, or
    /// of an older epoch than the replica's. The replica closes the connection after it.
    Denied = 11,
}

impl Status {
    fn from_wire(v: u16) -> Option<Self> {
        Some(match v {
            0 => Self::Ok,
            1 => Self::IoError,
            2 => Self::OutOfRange,
            3 => Self::StaleRevision,
            4 => Self::WrongVolume,
            5 => Self::UnsupportedVersion,
            6 => Self::Invalid,
            7 => Self::NotFound,
            8 => Self::AlreadyExists,
            9 => Self::Busy,
            10 => Self::Fenced,
            11 => Self::Denied,
            _ => return None,
        })
    }
}

/// A snapshot in a replica's chain, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    pub revision: u64,
    /// When the snapshot was taken, nanoseconds since the Unix epoch (CSI's creation_time).
    pub created_ns: u64,
}

/// One replica held by a replica server, as `NodeInfoReply` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSummary {
    pub volume_id: String,
    pub size: u64,
    pub revision: u64,
    pub dirty: bool,
    /// Bytes of the replica's files actually allocated on the node's disk.
    pub allocated: u64,
}

/// What a replica says about itself in `HelloReply`: the crash-safe header it keeps on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaHeader {
    pub volume_id: String,
    pub size: u64,
    /// Last revision at which this replica was a complete member of the replica set.
    pub revision: u64,
    pub snapshots: Vec<SnapshotInfo>,
    /// Set while an engine has the replica open; still set after a crash (unclean shutdown).
    pub dirty: bool,
}

/// One disk of a replica server, as `DiskList` lists it: a root its replicas live under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSummary {
    pub name: String,
    /// Bytes of the filesystem holding the disk's replicas, and bytes still available to them.
    pub capacity: u64,
    pub available: u64,
    /// The volumes with a replica on this disk.
    pub volumes: Vec<String>,
}

/// A replica's volume record as `Description` carries it: bytes the replica stores for the
/// control plane without reading them (who the members are, which node may attach), with the
/// version that orders updates and the epoch that fences engines (see `SetRecord`, `Claim`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordInfo {
    /// 0 and empty data: the replica has no record (made by hand, `wasmcsi volume create`).
    pub version: u64,
    pub epoch: u64,
    pub data: Vec<u8>,
}

/// Longest record a replica stores: a record names members and small metadata, never data.
pub const MAX_RECORD_LEN: usize = 64 * 1024;
/// Longest grant a `Grant` carries: the largest `wasmcsi_trust::grant` encodes (8 KiB).
pub const MAX_GRANT_LEN: usize = 8 * 1024;
/// Most labels an `Identity` carries.
pub const MAX_LABELS: usize = 64;

/// State of one extent in an `ExtentMap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ExtentState {
    /// Holds data that is on stable storage.
    Allocated = 1,
    /// Written since the last flush: what a crash of this replica may lose.
    Unflushed = 2,
}

/// A byte range of the volume, as reported by `ListExtents`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
    pub state: ExtentState,
}

/// Every message of the protocol. Requests go engine → replica, replies replica → engine; a
/// reply carries the request id of the request it answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// First request on a connection: a session on the replica of `volume_id` on `disk`.
    Hello {
        volume_id: String,
        protocol_version: u16,
        revision: u64,
        /// Encoded after `revision` only when not [`DEFAULT_DISK`].
        disk: String,
    },
    HelloReply {
        status: Status,
        header: ReplicaHeader,
    },
    Read {
        offset: u64,
        len: u32,
    },
    /// Answers `Read` and `ReadExtent`; `data` is empty unless `status` is `Ok`.
    ReadReply {
        status: Status,
        data: Vec<u8>,
    },
    /// Refused with `StaleRevision` when `revision` is older than the replica's (fencing).
    Write {
        offset: u64,
        revision: u64,
        /// Shared, not owned: the engine hands one payload to every replica's connection, and
        /// a decoded write keeps pointing into the buffer it was read into.
        data: Bytes,
    },
    /// Answered only once everything acknowledged before it is on stable storage.
    Flush,
    Unmap {
        offset: u64,
        len: u64,
        revision: u64,
    },
    Snapshot {
        name: String,
        revision: u64,
    },
    /// Records a new revision in the replica's header (durably) before replying.
    SetRevision {
        revision: u64,
    },
    /// Answers `Write`, `Flush`, `Unmap`, `Snapshot` and `SetRevision`.
    Reply {
        status: Status,
    },
    /// Rebuild: which extents of `[offset, offset + len)` hold data.
    ListExtents {
        offset: u64,
        len: u64,
    },
    ExtentMap {
        status: Status,
        extents: Vec<Extent>,
    },
    /// Rebuild: a read that the replica refuses (`StaleRevision`) when its own revision is below
    /// `revision`, so a stale replica can never be a rebuild source even if the engine's view is
    /// wrong.
    ReadExtent {
        offset: u64,
        len: u32,
        revision: u64,
    },
    /// Grows the volume to `size` (durably, header and data file) before replying; a smaller
    /// size is `Invalid`, the same size is `Ok` (idempotent). Fenced by `revision` like `Write`.
    Resize {
        size: u64,
        revision: u64,
    },
    /// Removes snapshot `name` from the chain, folding its data into its successor. `NotFound`
    /// when there is no such snapshot (the engine treats that as done on a retry).
    DeleteSnapshot {
        name: String,
        revision: u64,
    },
    /// Discards everything written since snapshot `name` and every snapshot taken after it: the
    /// volume reads as it was when `name` was taken. Refused (`Busy`) while another connection
    /// has the replica open.
    Revert {
        name: String,
        revision: u64,
    },
    /// Reads the volume as it was when snapshot `name` was taken; answered by `ReadReply`.
    ReadSnapshot {
        name: String,
        offset: u64,
        len: u32,
    },
    /// Which extents of `[offset, offset + len)` hold data in the volume as of snapshot `name`;
    /// answered by `ExtentMap` (every extent `Allocated`).
    ListSnapshotExtents {
        name: String,
        offset: u64,
        len: u64,
    },
    /// Drops every snapshot and all data (the replica reads as zeros, chain empty) and records
    /// `revision`: the first step of a full rebuild onto a replica whose snapshot chain differs
    /// from the source's. Fenced by `revision`.
    Reinitialize {
        revision: u64,
    },
    /// Control (no `Hello` first): create an empty replica of `volume_id` on this server.
    /// Idempotent: the same id and size is `Ok`; the same id with another size `AlreadyExists`.
    CreateReplica {
        volume_id: String,
        size: u64,
    },
    /// Control: delete the replica and its files. `NotFound` when absent (done on a retry),
    /// `Busy` while an engine has it open.
    DeleteReplica {
        volume_id: String,
        /// Encoded after `volume_id` only when not [`DEFAULT_DISK`].
        disk: String,
    },
    /// Control: what this server holds and how much space is left.
    NodeInfo,
    NodeInfoReply {
        status: Status,
        /// Bytes of the filesystem holding the replicas, and bytes still available to them.
        capacity: u64,
        available: u64,
        replicas: Vec<ReplicaSummary>,
    },
    /// In a session, after `Hello`: the engine's epoch, from the volume's record. `Ok` when it
    /// is at least the replica's (a higher one is stored durably first), `Fenced` when lower.
    /// From then on every mutating request of a session whose epoch is below the replica's is
    /// refused `Fenced`; a session that never claims has epoch 0.
    Claim {
        epoch: u64,
    },
    /// Control: the replica's header and volume record, without opening a session; answered
    /// by `Description` (`NotFound` without a replica; a replica without a record answers `Ok`
    /// with record version 0).
    Describe {
        volume_id: String,
        /// Encoded after `volume_id` only when not [`DEFAULT_DISK`].
        disk: String,
    },
    Description {
        status: Status,
        header: ReplicaHeader,
        record: RecordInfo,
    },
    /// Control: replace the volume record (durably) if `version` is newer than the stored one
    /// and `epoch` is not older; the same version with the same epoch and data is `Ok` (a
    /// retry), anything else older or conflicting `StaleRevision`. Raising the epoch fences
    /// every session that claimed a lower one. `Invalid` above [`MAX_RECORD_LEN`].
    /// On [`DEFAULT_DISK`] it is kind 27 as before disks; on another disk kind 37, the disk's
    /// name before the volume's (the record's bytes run to the end of the payload, so nothing
    /// can follow them).
    SetRecord {
        volume_id: String,
        version: u64,
        epoch: u64,
        data: Vec<u8>,
        disk: String,
    },
    /// Control: who this server is; answered by `Identity`.
    Identify,
    Identity {
        status: Status,
        /// the node's name (its CSI node id), empty when the server was given none
        node: String,
        /// the node's labels (topology and operator-given), at most [`MAX_LABELS`]
        labels: Vec<(String, String)>,
    },
    /// Control: a request for the engine of `volume_id` running in this server's process
    /// (snapshot, expand, replace a replica, status), encoded by the engine's control surface;
    /// answered by `EngineReply` (`NotFound` when no engine of that volume runs here).
    EngineCall {
        volume_id: String,
        request: Vec<u8>,
    },
    EngineReply {
        status: Status,
        reply: Vec<u8>,
    },
    /// First frame of a session of an engine with a node's certificate, before `Hello`: the
    /// controller-signed grant (`wasmcsi_trust::grant`) that lets this node open sessions of
    /// the volume. Answered by `Reply`: `Ok`, or `Denied` (and the connection closes).
    Grant {
        grant: Vec<u8>,
    },
    /// Control: like `CreateReplica`, on the server's disk `disk` (`CreateReplica` means the disk
    /// `default`). `NotFound` when the server has no such disk. Replicas of the volume on its
    /// other disks are other replicas of it.
    CreateReplicaOn {
        disk: String,
        volume_id: String,
        size: u64,
    },
    /// Control: the server's disks; answered by `DiskList`.
    ListDisks,
    DiskList {
        status: Status,
        disks: Vec<DiskSummary>,
    },
    /// Which extents of `[offset, offset + len)` may differ between the volume as of snapshot
    /// `base` and as of snapshot `name`, from the layers' block maps (no data is read); with no
    /// base, which hold data as of `name`. Answered by `ExtentMap` (every extent `Allocated`);
    /// `NotFound` when either snapshot is absent — a deleted base is never answered with a
    /// guess.
    ListSnapshotDelta {
        base: Option<String>,
        name: String,
        offset: u64,
        len: u64,
    },
}

impl Message {
    fn kind(&self) -> u16 {
        match self {
            Self::Hello { .. } => 1,
            Self::HelloReply { .. } => 2,
            Self::Read { .. } => 3,
            Self::ReadReply { .. } => 4,
            Self::Write { .. } => 5,
            Self::Flush => 6,
            Self::Unmap { .. } => 7,
            Self::Snapshot { .. } => 8,
            Self::SetRevision { .. } => 9,
            Self::Reply { .. } => 10,
            Self::ListExtents { .. } => 11,
            Self::ExtentMap { .. } => 12,
            Self::ReadExtent { .. } => 13,
            Self::Resize { .. } => 14,
            Self::DeleteSnapshot { .. } => 15,
            Self::Revert { .. } => 16,
            Self::ReadSnapshot { .. } => 17,
            Self::ListSnapshotExtents { .. } => 18,
            Self::CreateReplica { .. } => 19,
            Self::DeleteReplica { .. } => 20,
            Self::NodeInfo => 21,
            Self::NodeInfoReply { .. } => 22,
            Self::Reinitialize { .. } => 23,
            Self::Claim { .. } => 24,
            Self::Describe { .. } => 25,
            Self::Description { .. } => 26,
            Self::SetRecord { disk, .. } if disk != DEFAULT_DISK => 37,
            Self::SetRecord { .. } => 27,
            Self::Identify => 28,
            Self::Identity { .. } => 29,
            Self::EngineCall { .. } => 30,
            Self::EngineReply { .. } => 31,
            Self::Grant { .. } => 32,
            Self::CreateReplicaOn { .. } => 33,
            Self::ListDisks => 34,
            Self::DiskList { .. } => 35,
            Self::ListSnapshotDelta { .. } => 36,
        }
    }
}

/// One message with the request id that pairs a reply with its request (pipelining: replies may
/// arrive in any order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub request_id: u64,
    pub message: Message,
}
