//! The replica wire protocol: frames, messages, the encoder and a streaming decoder. This module
//! owns the byte layout documented in `proto/replica-protocol.md` and nothing else: it does no
//! I/O, keeps no connection state and never decides what a message means for a replica or the
//! engine (that is the `engine`'s job and, later, the replica server's).
//!
//! Every frame is `header (24 bytes) + payload`, little-endian. The decoder accepts arbitrary
//! bytes, never panics, and rejects a frame whose declared payload exceeds its limit before
//! allocating anything for it; every length inside a payload is checked against the bytes that
//! are actually there, so no field can make it allocate more than the frame it already holds.

use bytes::{Buf as _, Bytes, BytesMut};
use thiserror::Error;

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
    /// First request on a connection.
    Hello {
        volume_id: String,
        protocol_version: u16,
        revision: u64,
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
    SetRecord {
        volume_id: String,
        version: u64,
        epoch: u64,
        data: Vec<u8>,
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
            Self::SetRecord { .. } => 27,
            Self::Identify => 28,
            Self::Identity { .. } => 29,
            Self::EngineCall { .. } => 30,
            Self::EngineReply { .. } => 31,
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

#[derive(Debug, Error, PartialEq, Eq)]
pub enum EncodeError {
    #[error("payload of {len} bytes exceeds the frame limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("name of {len} bytes exceeds {MAX_NAME_LEN}")]
    NameTooLong { len: usize },
    #[error("{count} list entries exceed the wire limit")]
    TooManyEntries { count: usize },
}

/// Why bytes are not a frame. Every variant is fatal for the connection: after it the stream has
/// no trustworthy frame boundary, so the peer must close it.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("bad magic {0:02x?}: not a wasmcsi replica stream")]
    BadMagic([u8; 4]),
    #[error("unsupported protocol version {0} (this side speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion(u16),
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge { len: usize, max: usize },
    #[error("checksum mismatch on frame {request_id}")]
    ChecksumMismatch { request_id: u64 },
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    #[error("malformed message kind {kind}: {what}")]
    Malformed { kind: u16, what: &'static str },
}

/// Outcome of looking at the front of a byte stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// Not a whole frame yet; at least this many bytes in total are needed.
    NeedMore(usize),
    /// A frame and how many bytes of the input it used.
    Frame(Frame, usize),
}

/// Appends the encoding of `frame` to `out`.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    encode_with_limit(frame, out, DEFAULT_MAX_PAYLOAD)
}

/// Like [`encode`] with an explicit payload limit (the peer's decoder limit).
pub fn encode_with_limit(frame: &Frame, out: &mut Vec<u8>, max_payload: usize) -> Result<(), EncodeError> {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&frame.message.kind().to_le_bytes());
    out.extend_from_slice(&frame.request_id.to_le_bytes());
    out.extend_from_slice(&[0; 8]); // length and checksum, filled in below
    if let Err(e) = encode_payload(&frame.message, out) {
        out.truncate(start);
        return Err(e);
    }
    let len = out.len() - start - HEADER_LEN;
    if len > max_payload {
        out.truncate(start);
        return Err(EncodeError::TooLarge { len, max: max_payload });
    }
    let len32 = u32::try_from(len).map_err(|_| EncodeError::TooLarge { len, max: max_payload })?;
    out[start + 16..start + 20].copy_from_slice(&len32.to_le_bytes());
    let crc = checksum(&out[start..start + 20], &out[start + HEADER_LEN..]);
    out[start + 20..start + 24].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Payloads at least this large are not copied into the encoding by [`encode_split`].
pub const SPLIT_MIN: usize = 64 * 1024;

/// The checksum of the last large payload [`encode_split`] encoded: a write goes to every
/// replica as the same shared bytes, and is checksummed once, not once per replica.
#[derive(Debug, Default)]
pub struct PayloadCrc {
    /// Holding the payload keeps its allocation alive, so while it is cached no other payload
    /// can appear at the same address: address and length identify it.
    last: Option<(Bytes, crc32fast::Hasher)>,
}

impl PayloadCrc {
    fn of(&mut self, data: &Bytes) -> crc32fast::Hasher {
        if let Some((seen, h)) = &self.last
            && seen.as_ptr() == data.as_ptr()
            && seen.len() == data.len()
        {
            return h.clone();
        }
        let mut h = crc32fast::Hasher::new();
        h.update(data);
        self.last = Some((data.clone(), h.clone()));
        h
    }
}

/// Like [`encode_with_limit`], except that the payload of a large `Write` (at least
/// [`SPLIT_MIN`] bytes) is not copied into `out`: `out` receives everything before it, and the
/// data is returned, to be sent right after `out`'s bytes (a vectored write). The checksum
/// covers it all the same.
pub fn encode_split(
    frame: &Frame,
    out: &mut Vec<u8>,
    max_payload: usize,
    crc: &mut PayloadCrc,
) -> Result<Option<Bytes>, EncodeError> {
    let Message::Write { offset, revision, data } = &frame.message else {
        return encode_with_limit(frame, out, max_payload).map(|()| None);
    };
    if data.len() < SPLIT_MIN {
        return encode_with_limit(frame, out, max_payload).map(|()| None);
    }
    let len = 16 + data.len();
    if len > max_payload {
        return Err(EncodeError::TooLarge { len, max: max_payload });
    }
    let len32 = u32::try_from(len).map_err(|_| EncodeError::TooLarge { len, max: max_payload })?;
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&frame.message.kind().to_le_bytes());
    out.extend_from_slice(&frame.request_id.to_le_bytes());
    out.extend_from_slice(&len32.to_le_bytes());
    out.extend_from_slice(&[0; 4]); // checksum, filled in below
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&revision.to_le_bytes());
    let mut h = crc32fast::Hasher::new();
    h.update(&out[start..start + 20]);
    h.update(&out[start + HEADER_LEN..]);
    h.combine(&crc.of(data));
    let crc = h.finalize();
    out[start + 20..start + 24].copy_from_slice(&crc.to_le_bytes());
    Ok(Some(data.clone()))
}

/// The checksum covers the header fields before it, so a flipped kind or request id is caught
/// too, not only a damaged payload.
fn checksum(header: &[u8], payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(header);
    h.update(payload);
    h.finalize()
}

fn put_name(out: &mut Vec<u8>, s: &str) -> Result<(), EncodeError> {
    if s.len() > MAX_NAME_LEN {
        return Err(EncodeError::NameTooLong { len: s.len() });
    }
    // MAX_NAME_LEN < u16::MAX, checked above.
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_header(out: &mut Vec<u8>, header: &ReplicaHeader) -> Result<(), EncodeError> {
    put_name(out, &header.volume_id)?;
    out.extend_from_slice(&header.size.to_le_bytes());
    out.extend_from_slice(&header.revision.to_le_bytes());
    out.push(u8::from(header.dirty));
    let count = u16::try_from(header.snapshots.len())
        .map_err(|_| EncodeError::TooManyEntries { count: header.snapshots.len() })?;
    out.extend_from_slice(&count.to_le_bytes());
    for s in &header.snapshots {
        put_name(out, &s.name)?;
        out.extend_from_slice(&s.revision.to_le_bytes());
        out.extend_from_slice(&s.created_ns.to_le_bytes());
    }
    Ok(())
}

fn encode_payload(m: &Message, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    match m {
        Message::Hello { volume_id, protocol_version, revision } => {
            put_name(out, volume_id)?;
            out.extend_from_slice(&protocol_version.to_le_bytes());
            out.extend_from_slice(&revision.to_le_bytes());
        }
        Message::HelloReply { status, header } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            put_header(out, header)?;
        }
        Message::Read { offset, len } => {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        Message::ReadReply { status, data } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            out.extend_from_slice(data);
        }
        Message::Write { offset, revision, data } => {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&revision.to_le_bytes());
            out.extend_from_slice(data);
        }
        Message::Flush => {}
        Message::Unmap { offset, len, revision } => {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&revision.to_le_bytes());
        }
        Message::Snapshot { name, revision } => {
            put_name(out, name)?;
            out.extend_from_slice(&revision.to_le_bytes());
        }
        Message::SetRevision { revision } => out.extend_from_slice(&revision.to_le_bytes()),
        Message::Reply { status } => out.extend_from_slice(&(*status as u16).to_le_bytes()),
        Message::ListExtents { offset, len } => {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        Message::ExtentMap { status, extents } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            let count =
                u32::try_from(extents.len()).map_err(|_| EncodeError::TooManyEntries { count: extents.len() })?;
            out.extend_from_slice(&count.to_le_bytes());
            for e in extents {
                out.extend_from_slice(&e.offset.to_le_bytes());
                out.extend_from_slice(&e.len.to_le_bytes());
                out.push(e.state as u8);
            }
        }
        Message::ReadExtent { offset, len, revision } => {
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&revision.to_le_bytes());
        }
        Message::Resize { size, revision } => {
            out.extend_from_slice(&size.to_le_bytes());
            out.extend_from_slice(&revision.to_le_bytes());
        }
        Message::DeleteSnapshot { name, revision } | Message::Revert { name, revision } => {
            put_name(out, name)?;
            out.extend_from_slice(&revision.to_le_bytes());
        }
        Message::ReadSnapshot { name, offset, len } => {
            put_name(out, name)?;
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        Message::ListSnapshotExtents { name, offset, len } => {
            put_name(out, name)?;
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        Message::CreateReplica { volume_id, size } => {
            put_name(out, volume_id)?;
            out.extend_from_slice(&size.to_le_bytes());
        }
        Message::DeleteReplica { volume_id } => put_name(out, volume_id)?,
        Message::NodeInfo => {}
        Message::Reinitialize { revision } => out.extend_from_slice(&revision.to_le_bytes()),
        Message::NodeInfoReply { status, capacity, available, replicas } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            out.extend_from_slice(&capacity.to_le_bytes());
            out.extend_from_slice(&available.to_le_bytes());
            let count =
                u32::try_from(replicas.len()).map_err(|_| EncodeError::TooManyEntries { count: replicas.len() })?;
            out.extend_from_slice(&count.to_le_bytes());
            for r in replicas {
                put_name(out, &r.volume_id)?;
                out.extend_from_slice(&r.size.to_le_bytes());
                out.extend_from_slice(&r.revision.to_le_bytes());
                out.push(u8::from(r.dirty));
                out.extend_from_slice(&r.allocated.to_le_bytes());
            }
        }
        Message::Claim { epoch } => out.extend_from_slice(&epoch.to_le_bytes()),
        Message::Describe { volume_id } => put_name(out, volume_id)?,
        Message::Description { status, header, record } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            put_header(out, header)?;
            out.extend_from_slice(&record.version.to_le_bytes());
            out.extend_from_slice(&record.epoch.to_le_bytes());
            out.extend_from_slice(&record.data);
        }
        Message::SetRecord { volume_id, version, epoch, data } => {
            put_name(out, volume_id)?;
            out.extend_from_slice(&version.to_le_bytes());
            out.extend_from_slice(&epoch.to_le_bytes());
            out.extend_from_slice(data);
        }
        Message::Identify => {}
        Message::Identity { status, node, labels } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            put_name(out, node)?;
            if labels.len() > MAX_LABELS {
                return Err(EncodeError::TooManyEntries { count: labels.len() });
            }
            // MAX_LABELS < u16::MAX, checked above.
            out.extend_from_slice(&(labels.len() as u16).to_le_bytes());
            for (k, v) in labels {
                put_name(out, k)?;
                put_name(out, v)?;
            }
        }
        Message::EngineCall { volume_id, request } => {
            put_name(out, volume_id)?;
            out.extend_from_slice(request);
        }
        Message::EngineReply { status, reply } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            out.extend_from_slice(reply);
        }
    }
    Ok(())
}

/// Decodes the frame at the front of `buf` with [`DEFAULT_MAX_PAYLOAD`].
pub fn decode(buf: &[u8]) -> Result<Decoded, DecodeError> {
    decode_with_limit(buf, DEFAULT_MAX_PAYLOAD)
}

/// Decodes the frame at the front of `buf`. The header is validated as soon as it is complete,
/// so garbage and oversized frames fail fast instead of waiting for megabytes that never come.
pub fn decode_with_limit(buf: &[u8], max_payload: usize) -> Result<Decoded, DecodeError> {
    match check_frame(buf, max_payload)? {
        Checked::NeedMore(n) => Ok(Decoded::NeedMore(n)),
        Checked::Complete { kind, request_id, total } => {
            let message = decode_payload(kind, &buf[HEADER_LEN..total], None)?;
            Ok(Decoded::Frame(Frame { request_id, message }, total))
        }
    }
}

/// What the front of a byte stream holds, as far as the header and checksum tell.
enum Checked {
    NeedMore(usize),
    /// A whole frame of `total` bytes whose checksum matched.
    Complete {
        kind: u16,
        request_id: u64,
        total: usize,
    },
}

fn check_frame(buf: &[u8], max_payload: usize) -> Result<Checked, DecodeError> {
    // Reject a wrong magic byte by byte, before the whole header arrived.
    let seen = buf.len().min(4);
    if buf[..seen] != MAGIC[..seen] {
        let mut m = [0; 4];
        m[..seen].copy_from_slice(&buf[..seen]);
        return Err(DecodeError::BadMagic(m));
    }
    if buf.len() < HEADER_LEN {
        return Ok(Checked::NeedMore(HEADER_LEN));
    }
    let mut r = Reader { buf: &buf[4..HEADER_LEN], kind: 0, origin: None };
    let version = r.u16()?;
    if version != PROTOCOL_VERSION {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    let kind = r.u16()?;
    let request_id = r.u64()?;
    let len = r.u32()? as usize;
    let crc = r.u32()?;
    if len > max_payload {
        return Err(DecodeError::FrameTooLarge { len, max: max_payload });
    }
    let total = HEADER_LEN + len;
    if buf.len() < total {
        return Ok(Checked::NeedMore(total));
    }
    if checksum(&buf[..20], &buf[HEADER_LEN..total]) != crc {
        return Err(DecodeError::ChecksumMismatch { request_id });
    }
    Ok(Checked::Complete { kind, request_id, total })
}

/// Bounds-checked cursor over a payload; every read fails instead of panicking.
struct Reader<'a> {
    buf: &'a [u8],
    kind: u16,
    /// The payload as shared bytes, when the caller has it so: a write's data is then a view
    /// into it instead of a copy.
    origin: Option<&'a Bytes>,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Malformed { kind: self.kind, what: "payload ends inside a field" });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn malformed(&self, what: &'static str) -> DecodeError {
        DecodeError::Malformed { kind: self.kind, what }
    }
    fn status(&mut self) -> Result<Status, DecodeError> {
        let v = self.u16()?;
        Status::from_wire(v).ok_or(self.malformed("unknown status"))
    }
    fn name(&mut self) -> Result<String, DecodeError> {
        let len = self.u16()? as usize;
        if len > MAX_NAME_LEN {
            return Err(self.malformed("name too long"));
        }
        let raw = self.bytes(len)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.malformed("name is not UTF-8"))
    }
    fn flag(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.malformed("flag is not 0 or 1")),
        }
    }
    fn rest(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf).to_vec()
    }
    fn rest_shared(&mut self) -> Bytes {
        let rest = std::mem::take(&mut self.buf);
        match self.origin {
            // `rest` is the tail of the payload `origin` holds.
            Some(origin) => origin.slice(origin.len() - rest.len()..),
            None => Bytes::copy_from_slice(rest),
        }
    }
    fn header(&mut self) -> Result<ReplicaHeader, DecodeError> {
        let volume_id = self.name()?;
        let size = self.u64()?;
        let revision = self.u64()?;
        let dirty = self.flag()?;
        let count = self.u16()? as usize;
        // Each entry is at least 18 bytes, so the count cannot ask for more than is there.
        if count * 18 > self.buf.len() {
            return Err(self.malformed("snapshot count exceeds payload"));
        }
        let mut snapshots = Vec::with_capacity(count);
        for _ in 0..count {
            snapshots.push(SnapshotInfo { name: self.name()?, revision: self.u64()?, created_ns: self.u64()? });
        }
        Ok(ReplicaHeader { volume_id, size, revision, snapshots, dirty })
    }
    fn finish(self) -> Result<(), DecodeError> {
        if self.buf.is_empty() { Ok(()) } else { Err(self.malformed("trailing bytes")) }
    }
}

/// `origin`, if given, holds the same bytes as `payload`.
fn decode_payload(kind: u16, payload: &[u8], origin: Option<&Bytes>) -> Result<Message, DecodeError> {
    let mut r = Reader { buf: payload, kind, origin };
    let m = match kind {
        1 => Message::Hello { volume_id: r.name()?, protocol_version: r.u16()?, revision: r.u64()? },
        2 => Message::HelloReply { status: r.status()?, header: r.header()? },
        3 => Message::Read { offset: r.u64()?, len: r.u32()? },
        4 => Message::ReadReply { status: r.status()?, data: r.rest() },
        5 => Message::Write { offset: r.u64()?, revision: r.u64()?, data: r.rest_shared() },
        6 => Message::Flush,
        7 => Message::Unmap { offset: r.u64()?, len: r.u64()?, revision: r.u64()? },
        8 => Message::Snapshot { name: r.name()?, revision: r.u64()? },
        9 => Message::SetRevision { revision: r.u64()? },
        10 => Message::Reply { status: r.status()? },
        11 => Message::ListExtents { offset: r.u64()?, len: r.u64()? },
        12 => {
            let status = r.status()?;
            let count = r.u32()? as usize;
            if count.saturating_mul(17) != r.buf.len() {
                return Err(r.malformed("extent count does not match payload"));
            }
            let mut extents = Vec::with_capacity(count);
            for _ in 0..count {
                let offset = r.u64()?;
                let len = r.u64()?;
                let state = match r.u8()? {
                    1 => ExtentState::Allocated,
                    2 => ExtentState::Unflushed,
                    _ => return Err(r.malformed("unknown extent state")),
                };
                extents.push(Extent { offset, len, state });
            }
            Message::ExtentMap { status, extents }
        }
        13 => Message::ReadExtent { offset: r.u64()?, len: r.u32()?, revision: r.u64()? },
        14 => Message::Resize { size: r.u64()?, revision: r.u64()? },
        15 => Message::DeleteSnapshot { name: r.name()?, revision: r.u64()? },
        16 => Message::Revert { name: r.name()?, revision: r.u64()? },
        17 => Message::ReadSnapshot { name: r.name()?, offset: r.u64()?, len: r.u32()? },
        18 => Message::ListSnapshotExtents { name: r.name()?, offset: r.u64()?, len: r.u64()? },
        19 => Message::CreateReplica { volume_id: r.name()?, size: r.u64()? },
        20 => Message::DeleteReplica { volume_id: r.name()? },
        21 => Message::NodeInfo,
        23 => Message::Reinitialize { revision: r.u64()? },
        22 => {
            let status = r.status()?;
            let capacity = r.u64()?;
            let available = r.u64()?;
            let count = r.u32()? as usize;
            // Each entry is at least 27 bytes, so the count cannot ask for more than is there.
            if count.saturating_mul(27) > r.buf.len() {
                return Err(r.malformed("replica count exceeds payload"));
            }
            let mut replicas = Vec::with_capacity(count);
            for _ in 0..count {
                replicas.push(ReplicaSummary {
                    volume_id: r.name()?,
                    size: r.u64()?,
                    revision: r.u64()?,
                    dirty: r.flag()?,
                    allocated: r.u64()?,
                });
            }
            Message::NodeInfoReply { status, capacity, available, replicas }
        }
        24 => Message::Claim { epoch: r.u64()? },
        25 => Message::Describe { volume_id: r.name()? },
        26 => {
            let status = r.status()?;
            let header = r.header()?;
            let record = RecordInfo { version: r.u64()?, epoch: r.u64()?, data: r.rest() };
            if record.data.len() > MAX_RECORD_LEN {
                return Err(r.malformed("record too long"));
            }
            Message::Description { status, header, record }
        }
        27 => {
            let m = Message::SetRecord { volume_id: r.name()?, version: r.u64()?, epoch: r.u64()?, data: r.rest() };
            if let Message::SetRecord { data, .. } = &m
                && data.len() > MAX_RECORD_LEN
            {
                return Err(DecodeError::Malformed { kind, what: "record too long" });
            }
            m
        }
        28 => Message::Identify,
        29 => {
            let status = r.status()?;
            let node = r.name()?;
            let count = r.u16()? as usize;
            if count > MAX_LABELS {
                return Err(r.malformed("too many labels"));
            }
            let mut labels = Vec::with_capacity(count);
            for _ in 0..count {
                labels.push((r.name()?, r.name()?));
            }
            Message::Identity { status, node, labels }
        }
        30 => Message::EngineCall { volume_id: r.name()?, request: r.rest() },
        31 => Message::EngineReply { status: r.status()?, reply: r.rest() },
        other => return Err(DecodeError::UnknownKind(other)),
    };
    r.finish()?;
    Ok(m)
}

/// Buffers a byte stream and yields whole frames: what a connection reader needs.
///
/// Consumed frames are not shifted out one by one (a 256 KiB read of 4 KiB writes would move the
/// rest of the buffer sixty times): the buffer's front just advances. The data of a large write
/// is handed out as a view into the buffer, not copied ([`SPLIT_MIN`]); the buffer then moves
/// on to fresh memory when it next needs room. Readers append straight into the buffer with
/// [`FrameDecoder::read_buffer`] (e.g. tokio's `read_buf`), so bytes are not staged in an
/// intermediate buffer either.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: BytesMut,
    /// Total bytes the frame at the front needs, as far as known.
    need: usize,
    max_payload: usize,
    failed: bool,
}

/// Room a [`FrameDecoder::read_buffer`] offers at least, so small frames are read many at once.
const MIN_READ: usize = 256 * 1024;

impl FrameDecoder {
    pub fn new(max_payload: usize) -> Self {
        Self { buf: BytesMut::new(), need: HEADER_LEN, max_payload, failed: false }
    }

    /// Appends bytes read from the connection.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The buffer to append the next read to, with room for at least the rest of the frame at
    /// the front (or [`MIN_READ`] bytes). Append only; never remove or change what it holds.
    ///
    /// While a large frame is incomplete, the room offered ends where it ends: a large write's
    /// data is handed out as a view into this buffer, so the buffer then moves to fresh memory,
    /// and whatever of the next frame had already been read would be copied along.
    pub fn read_buffer(&mut self) -> bytes::buf::Limit<&mut BytesMut> {
        let rest = self.need.saturating_sub(self.buf.len());
        let want = rest.max(MIN_READ);
        self.buf.reserve(want);
        let limit = if rest > MIN_READ { rest } else { usize::MAX };
        bytes::BufMut::limit(&mut self.buf, limit)
    }

    /// The next complete frame, `None` if more bytes are needed. After an error every later call
    /// returns the same kind of failure: the stream has lost its framing.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, DecodeError> {
        if self.failed {
            return Err(DecodeError::Malformed { kind: 0, what: "stream already failed" });
        }
        if self.buf.is_empty() {
            self.need = HEADER_LEN;
            return Ok(None);
        }
        let decoded = check_frame(&self.buf, self.max_payload).and_then(|checked| match checked {
            Checked::NeedMore(n) => Ok(Err(n)),
            Checked::Complete { kind, request_id, total } if kind == 5 && total >= HEADER_LEN + 16 + SPLIT_MIN => {
                // A large write: its data stays where it was read.
                let frame = self.buf.split_to(total).freeze();
                let payload = frame.slice(HEADER_LEN..);
                let message = decode_payload(kind, &payload, Some(&payload))?;
                Ok(Ok(Frame { request_id, message }))
            }
            Checked::Complete { kind, request_id, total } => {
                let message = decode_payload(kind, &self.buf[HEADER_LEN..total], None)?;
                self.buf.advance(total);
                Ok(Ok(Frame { request_id, message }))
            }
        });
        match decoded {
            Ok(Err(n)) => {
                self.need = n;
                Ok(None)
            }
            Ok(Ok(frame)) => {
                self.need = HEADER_LEN;
                Ok(Some(frame))
            }
            Err(e) => {
                self.failed = true;
                Err(e)
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::testutil::Rng;

    pub(crate) fn random_message(rng: &mut Rng) -> Message {
        let name = |rng: &mut Rng| -> String {
            let n = rng.below(12) as usize;
            (0..n).map(|_| char::from(b'a' + rng.below(26) as u8)).collect()
        };
        let data = |rng: &mut Rng| -> Vec<u8> {
            let n = rng.below(300) as usize;
            (0..n).map(|_| rng.next() as u8).collect()
        };
        let status = |rng: &mut Rng| Status::from_wire(rng.below(11) as u16).unwrap_or(Status::Ok);
        match rng.below(31) {
            0 => Message::Hello { volume_id: name(rng), protocol_version: rng.next() as u16, revision: rng.next() },
            1 => Message::HelloReply {
                status: status(rng),
                header: ReplicaHeader {
                    volume_id: name(rng),
                    size: rng.next(),
                    revision: rng.next(),
                    snapshots: (0..rng.below(4))
                        .map(|_| SnapshotInfo { name: name(rng), revision: rng.next(), created_ns: rng.next() })
                        .collect(),
                    dirty: rng.below(2) == 1,
                },
            },
            2 => Message::Read { offset: rng.next(), len: rng.next() as u32 },
            3 => Message::ReadReply { status: status(rng), data: data(rng) },
            4 => Message::Write { offset: rng.next(), revision: rng.next(), data: data(rng).into() },
            5 => Message::Flush,
            6 => Message::Unmap { offset: rng.next(), len: rng.next(), revision: rng.next() },
            7 => Message::Snapshot { name: name(rng), revision: rng.next() },
            8 => Message::SetRevision { revision: rng.next() },
            9 => Message::Reply { status: status(rng) },
            10 => Message::ListExtents { offset: rng.next(), len: rng.next() },
            11 => Message::ExtentMap {
                status: status(rng),
                extents: (0..rng.below(5))
                    .map(|_| Extent {
                        offset: rng.next(),
                        len: rng.next(),
                        state: if rng.below(2) == 0 { ExtentState::Allocated } else { ExtentState::Unflushed },
                    })
                    .collect(),
            },
            12 => Message::ReadExtent { offset: rng.next(), len: rng.next() as u32, revision: rng.next() },
            13 => Message::Resize { size: rng.next(), revision: rng.next() },
            14 => Message::DeleteSnapshot { name: name(rng), revision: rng.next() },
            15 => Message::Revert { name: name(rng), revision: rng.next() },
            16 => Message::ReadSnapshot { name: name(rng), offset: rng.next(), len: rng.next() as u32 },
            17 => Message::ListSnapshotExtents { name: name(rng), offset: rng.next(), len: rng.next() },
            18 => Message::CreateReplica { volume_id: name(rng), size: rng.next() },
            19 => Message::DeleteReplica { volume_id: name(rng) },
            20 => Message::NodeInfo,
            21 => Message::Reinitialize { revision: rng.next() },
            22 => Message::Claim { epoch: rng.next() },
            23 => Message::Describe { volume_id: name(rng) },
            24 => Message::Description {
                status: status(rng),
                header: ReplicaHeader {
                    volume_id: name(rng),
                    size: rng.next(),
                    revision: rng.next(),
                    snapshots: (0..rng.below(3))
                        .map(|_| SnapshotInfo { name: name(rng), revision: rng.next(), created_ns: rng.next() })
                        .collect(),
                    dirty: rng.below(2) == 1,
                },
                record: RecordInfo { version: rng.next(), epoch: rng.next(), data: data(rng) },
            },
            25 => Message::SetRecord { volume_id: name(rng), version: rng.next(), epoch: rng.next(), data: data(rng) },
            26 => Message::Identify,
            27 => Message::Identity {
                status: status(rng),
                node: name(rng),
                labels: (0..rng.below(4)).map(|_| (name(rng), name(rng))).collect(),
            },
            28 => Message::EngineCall { volume_id: name(rng), request: data(rng) },
            29 => Message::EngineReply { status: status(rng), reply: data(rng) },
            _ => Message::NodeInfoReply {
                status: status(rng),
                capacity: rng.next(),
                available: rng.next(),
                replicas: (0..rng.below(4))
                    .map(|_| ReplicaSummary {
                        volume_id: name(rng),
                        size: rng.next(),
                        revision: rng.next(),
                        dirty: rng.below(2) == 1,
                        allocated: rng.next(),
                    })
                    .collect(),
            },
        }
    }

    fn encoded(frame: &Frame) -> Vec<u8> {
        let mut out = Vec::new();
        encode(frame, &mut out).expect("encodable");
        out
    }

    #[test]
    fn every_message_kind_round_trips() {
        let mut rng = Rng::new(1);
        let mut kinds = std::collections::HashSet::new();
        for i in 0..2000 {
            let frame = Frame { request_id: i, message: random_message(&mut rng) };
            kinds.insert(frame.message.kind());
            let bytes = encoded(&frame);
            assert_eq!(decode(&bytes), Ok(Decoded::Frame(frame, bytes.len())));
        }
        assert_eq!(kinds.len(), 31, "the generator covers every kind");
    }

    #[test]
    fn header_layout_is_little_endian_with_magic_and_version() {
        let bytes = encoded(&Frame { request_id: 0x0102_0304_0506_0708, message: Message::Flush });
        assert_eq!(&bytes[0..4], b"WCSB");
        assert_eq!(&bytes[4..6], &[1, 0]);
        assert_eq!(&bytes[6..8], &[6, 0]);
        assert_eq!(&bytes[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&bytes[16..20], &[0, 0, 0, 0]);
        assert_eq!(bytes.len(), HEADER_LEN);
    }

    #[test]
    fn every_strict_prefix_of_a_frame_needs_more() {
        let mut rng = Rng::new(2);
        for i in 0..200 {
            let bytes = encoded(&Frame { request_id: i, message: random_message(&mut rng) });
            for cut in 0..bytes.len() {
                match decode(&bytes[..cut]) {
                    Ok(Decoded::NeedMore(n)) => assert!(n > cut && n <= bytes.len()),
                    other => panic!("prefix of {cut}/{} bytes gave {other:?}", bytes.len()),
                }
            }
        }
    }

    #[test]
    fn any_single_flipped_bit_is_rejected_or_needs_more() {
        let mut rng = Rng::new(3);
        for i in 0..300 {
            let frame = Frame { request_id: i, message: random_message(&mut rng) };
            let mut bytes = encoded(&frame);
            let bit = rng.below(bytes.len() as u64 * 8) as usize;
            bytes[bit / 8] ^= 1 << (bit % 8);
            // A flipped length may make the frame look longer (NeedMore) but never yields a frame.
            match decode(&bytes) {
                Err(_) | Ok(Decoded::NeedMore(_)) => {}
                Ok(Decoded::Frame(f, _)) => panic!("corrupted frame accepted: {f:?}"),
            }
        }
    }

    #[test]
    fn random_garbage_never_panics_and_never_over_allocates() {
        let mut rng = Rng::new(4);
        for _ in 0..20_000 {
            let n = rng.below(64) as usize;
            let mut bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            // Half the time start with a valid header prefix so the deeper paths get exercised.
            if rng.below(2) == 0 && bytes.len() >= 8 {
                bytes[..4].copy_from_slice(&MAGIC);
                bytes[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            }
            let _ = decode_with_limit(&bytes, 1 << 20);
        }
    }

    #[test]
    fn oversized_frame_is_rejected_from_the_header_alone() {
        let mut header = Vec::new();
        encode(&Frame { request_id: 9, message: Message::Flush }, &mut header).expect("encodable");
        header[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode_with_limit(&header, 4096),
            Err(DecodeError::FrameTooLarge { len: u32::MAX as usize, max: 4096 })
        );
    }

    #[test]
    fn encoder_refuses_a_payload_over_the_limit() {
        let frame =
            Frame { request_id: 1, message: Message::Write { offset: 0, revision: 0, data: vec![0; 100].into() } };
        let mut out = vec![7];
        assert_eq!(encode_with_limit(&frame, &mut out, 50), Err(EncodeError::TooLarge { len: 116, max: 50 }));
        assert_eq!(out, vec![7], "a failed encode leaves the buffer as it was");
    }

    #[test]
    fn wrong_magic_is_rejected_after_the_first_byte() {
        assert_eq!(decode(b"X"), Err(DecodeError::BadMagic([b'X', 0, 0, 0])));
        assert_eq!(decode(b""), Ok(Decoded::NeedMore(HEADER_LEN)));
    }

    #[test]
    fn other_protocol_version_is_rejected() {
        let mut bytes = encoded(&Frame { request_id: 1, message: Message::Flush });
        bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
        assert_eq!(decode(&bytes), Err(DecodeError::UnsupportedVersion(2)));
    }

    #[test]
    fn trailing_bytes_inside_a_payload_are_malformed() {
        let mut bytes = encoded(&Frame { request_id: 1, message: Message::SetRevision { revision: 5 } });
        bytes.push(0);
        bytes[16..20].copy_from_slice(&9u32.to_le_bytes());
        let crc = checksum(&bytes[..20], &bytes[HEADER_LEN..]);
        bytes[20..24].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(decode(&bytes), Err(DecodeError::Malformed { kind: 9, .. })));
    }

    #[test]
    fn stream_decoder_reassembles_frames_split_at_random_points() {
        let mut rng = Rng::new(5);
        let frames: Vec<Frame> = (0..500).map(|i| Frame { request_id: i, message: random_message(&mut rng) }).collect();
        let mut stream = Vec::new();
        for f in &frames {
            encode(f, &mut stream).expect("encodable");
        }
        let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
        let mut got = Vec::new();
        let mut pos = 0;
        while pos < stream.len() {
            let n = (rng.below(100) as usize + 1).min(stream.len() - pos);
            dec.push(&stream[pos..pos + n]);
            pos += n;
            while let Some(f) = dec.next_frame().expect("valid stream") {
                got.push(f);
            }
        }
        assert_eq!(got, frames);
    }

    /// A large write encoded in two pieces (header, shared payload) is the same bytes as the
    /// one-piece encoding, and decodes from a stream split anywhere, also around small frames.
    #[test]
    fn split_encoding_of_large_writes_matches_and_round_trips_through_the_stream_decoder() {
        let mut rng = Rng::new(11);
        let mut frames = Vec::new();
        for i in 0..40u64 {
            let len = [SPLIT_MIN - 1, SPLIT_MIN, SPLIT_MIN + 4096, 1 << 20, 4096][i as usize % 5];
            let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let write = Message::Write { offset: rng.next(), revision: i, data: data.into() };
            frames.push(Frame { request_id: 2 * i, message: write });
            frames.push(Frame { request_id: 2 * i + 1, message: Message::Read { offset: i, len: 4096 } });
        }
        let mut stream = Vec::new();
        let mut crc = PayloadCrc::default();
        for f in &frames {
            let mut whole = Vec::new();
            encode(f, &mut whole).expect("encodable");
            // Twice, as for two replicas (the second checksum comes from the cache), and once
            // more under another request id with the payload still cached.
            for _ in 0..2 {
                let mut head = Vec::new();
                let tail = encode_split(f, &mut head, DEFAULT_MAX_PAYLOAD, &mut crc).expect("encodable");
                head.extend_from_slice(tail.as_deref().unwrap_or_default());
                assert_eq!(head, whole, "frame {}", f.request_id);
            }
            let other = Frame { request_id: f.request_id + 1000, message: f.message.clone() };
            let (mut plain, mut head) = (Vec::new(), Vec::new());
            encode(&other, &mut plain).expect("encodable");
            let tail = encode_split(&other, &mut head, DEFAULT_MAX_PAYLOAD, &mut crc).expect("encodable");
            head.extend_from_slice(tail.as_deref().unwrap_or_default());
            assert_eq!(head, plain, "frame {} again", f.request_id);
            stream.extend_from_slice(&whole);
        }
        let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
        let mut got = Vec::new();
        let mut pos = 0;
        while pos < stream.len() {
            let n = (rng.below(300_000) as usize + 1).min(stream.len() - pos);
            dec.push(&stream[pos..pos + n]);
            pos += n;
            while let Some(f) = dec.next_frame().expect("valid stream") {
                got.push(f);
            }
        }
        assert_eq!(got, frames);
        let mut small = Vec::new();
        let frame =
            Frame { request_id: 1, message: Message::Write { offset: 0, revision: 0, data: vec![0; 4 << 20].into() } };
        assert!(matches!(encode_split(&frame, &mut small, 1 << 20, &mut crc), Err(EncodeError::TooLarge { .. })));
        assert!(small.is_empty());
    }

    /// While a large frame is incomplete, a read through `read_buffer` stops at its end, so the
    /// next frame's bytes never share the buffer the large write's data is a view into.
    #[test]
    fn read_buffer_ends_at_a_large_frame_and_not_before_small_ones() {
        use bytes::BufMut as _;
        let data = vec![7u8; 1 << 20];
        let big = Frame { request_id: 1, message: Message::Write { offset: 0, revision: 0, data: data.into() } };
        let small = Frame { request_id: 2, message: Message::Flush };
        let mut stream = Vec::new();
        encode(&big, &mut stream).expect("encodable");
        encode(&small, &mut stream).expect("encodable");
        let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
        dec.push(&stream[..100]);
        assert_eq!(dec.next_frame(), Ok(None));
        let room = dec.read_buffer().remaining_mut();
        assert_eq!(room, HEADER_LEN + 16 + (1 << 20) - 100);
        let mut pos = 100;
        while pos < stream.len() {
            let mut room = dec.read_buffer();
            let n = room.remaining_mut().min(stream.len() - pos);
            room.put_slice(&stream[pos..pos + n]);
            pos += n;
            if let Some(f) = dec.next_frame().expect("valid") {
                assert_eq!(f, [&big, &small][f.request_id as usize - 1].clone());
            }
        }
        assert!(dec.read_buffer().remaining_mut() >= MIN_READ);
    }

    #[test]
    fn stream_decoder_stays_failed_after_corruption() {
        let mut dec = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
        dec.push(b"nope, not a frame at all");
        assert!(dec.next_frame().is_err());
        let mut good = Vec::new();
        encode(&Frame { request_id: 1, message: Message::Flush }, &mut good).expect("encodable");
        dec.push(&good);
        assert!(dec.next_frame().is_err());
    }
}
