//! Decoding frames: the header checked as soon as it is complete (magic, version, payload limit,
//! checksum), a bounds-checked reader for payloads, and the streaming [`FrameDecoder`] that
//! yields whole frames from a connection's bytes. Arbitrary input never panics and never makes
//! it allocate more than the frame it already holds.

use bytes::{Buf as _, Bytes, BytesMut};
use thiserror::Error;

use super::encode::checksum;
use super::{
    DEFAULT_DISK, DEFAULT_MAX_PAYLOAD, DiskSummary, Extent, ExtentState, Frame, HEADER_LEN, MAGIC, MAX_GRANT_LEN,
    MAX_LABELS, MAX_NAME_LEN, MAX_RECORD_LEN, Message, PROTOCOL_VERSION, RecordInfo, ReplicaHeader, ReplicaSummary,
    SPLIT_MIN, SnapshotInfo, Status,
};

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
    /// A disk name that ends a request: [`DEFAULT_DISK`] when the payload ends first (a peer of
    /// the version before disks, or the default disk), which must not be spelled out.
    fn disk(&mut self) -> Result<String, DecodeError> {
        if self.buf.is_empty() {
            return Ok(DEFAULT_DISK.to_owned());
        }
        let disk = self.name()?;
        if disk == DEFAULT_DISK {
            return Err(self.malformed("the default disk is named by leaving it out"));
        }
        Ok(disk)
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
        1 => Message::Hello { volume_id: r.name()?, protocol_version: r.u16()?, revision: r.u64()?, disk: r.disk()? },
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
        20 => Message::DeleteReplica { volume_id: r.name()?, disk: r.disk()? },
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
        25 => Message::Describe { volume_id: r.name()?, disk: r.disk()? },
        26 => {
            let status = r.status()?;
            let header = r.header()?;
            let record = RecordInfo { version: r.u64()?, epoch: r.u64()?, data: r.rest() };
            if record.data.len() > MAX_RECORD_LEN {
                return Err(r.malformed("record too long"));
            }
            Message::Description { status, header, record }
        }
        27 | 37 => {
            let disk = if kind == 37 { r.name()? } else { DEFAULT_DISK.to_owned() };
            if kind == 37 && disk == DEFAULT_DISK {
                // One form for one request: the default disk is kind 27's.
                return Err(r.malformed("kind 37 names the default disk"));
            }
            let m =
                Message::SetRecord { volume_id: r.name()?, version: r.u64()?, epoch: r.u64()?, data: r.rest(), disk };
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
        32 => {
            let grant = r.rest();
            if grant.len() > MAX_GRANT_LEN {
                return Err(DecodeError::Malformed { kind, what: "grant too long" });
            }
            Message::Grant { grant }
        }
        33 => Message::CreateReplicaOn { disk: r.name()?, volume_id: r.name()?, size: r.u64()? },
        34 => Message::ListDisks,
        35 => {
            let status = r.status()?;
            let count = r.u16()? as usize;
            // Each disk is at least 22 bytes, each volume 2: no count asks for more than is there.
            if count.saturating_mul(22) > r.buf.len() {
                return Err(r.malformed("disk count exceeds payload"));
            }
            let mut disks = Vec::with_capacity(count);
            for _ in 0..count {
                let (name, capacity, available) = (r.name()?, r.u64()?, r.u64()?);
                let volumes = r.u32()? as usize;
                if volumes.saturating_mul(2) > r.buf.len() {
                    return Err(r.malformed("volume count exceeds payload"));
                }
                let volumes = (0..volumes).map(|_| r.name()).collect::<Result<Vec<_>, _>>()?;
                disks.push(DiskSummary { name, capacity, available, volumes });
            }
            Message::DiskList { status, disks }
        }
        36 => Message::ListSnapshotDelta {
            base: if r.flag()? { Some(r.name()?) } else { None },
            name: r.name()?,
            offset: r.u64()?,
            len: r.u64()?,
        },
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
    /// Room the next [`FrameDecoder::read_buffer`] offers at least: doubles with every read up
    /// to [`MIN_READ`], so a connection that sends little (an idle one, a control client) holds
    /// little, and a busy engine session soon reads many frames at once.
    room: usize,
}

/// Room a busy connection's [`FrameDecoder::read_buffer`] offers at least, so small frames are
/// read many at once.
pub(super) const MIN_READ: usize = 256 * 1024;
/// Room the first read of a connection gets.
pub(super) const FIRST_READ: usize = 16 * 1024;

impl FrameDecoder {
    pub fn new(max_payload: usize) -> Self {
        Self { buf: BytesMut::new(), need: HEADER_LEN, max_payload, failed: false, room: FIRST_READ }
    }

    /// Appends bytes read from the connection.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The buffer to append the next read to, with room for at least the rest of the frame at
    /// the front (or the room reads have grown to, see `room`). Append only; never remove or
    /// change what it holds.
    ///
    /// While a large frame is incomplete, the room offered ends where it ends: a large write's
    /// data is handed out as a view into this buffer, so the buffer then moves to fresh memory,
    /// and whatever of the next frame had already been read would be copied along.
    pub fn read_buffer(&mut self) -> bytes::buf::Limit<&mut BytesMut> {
        let rest = self.need.saturating_sub(self.buf.len());
        let want = rest.max(self.room);
        self.room = (self.room * 2).min(MIN_READ);
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
