//! Encoding frames: the header (magic, version, kind, request id, payload length, checksum) and
//! each message's payload, little-endian, as `proto/replica-protocol.md` lays them out. A large
//! write's data can stay out of the encoding ([`encode_split`]) and its checksum is computed
//! once for every replica it goes to ([`PayloadCrc`]).

use bytes::Bytes;
use thiserror::Error;

use super::{
    DEFAULT_DISK, DEFAULT_MAX_PAYLOAD, Frame, HEADER_LEN, MAGIC, MAX_LABELS, MAX_NAME_LEN, Message, PROTOCOL_VERSION,
    ReplicaHeader,
};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum EncodeError {
    #[error("payload of {len} bytes exceeds the frame limit of {max}")]
    TooLarge { len: usize, max: usize },
    #[error("name of {len} bytes exceeds {MAX_NAME_LEN}")]
    NameTooLong { len: usize },
    #[error("{count} list entries exceed the wire limit")]
    TooManyEntries { count: usize },
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
pub(super) fn checksum(header: &[u8], payload: &[u8]) -> u32 {
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

/// A disk name that follows a request's fields: nothing for [`DEFAULT_DISK`] (the bytes of the
/// version before disks).
fn put_disk(out: &mut Vec<u8>, disk: &str) -> Result<(), EncodeError> {
    if disk == DEFAULT_DISK { Ok(()) } else { put_name(out, disk) }
}

fn encode_payload(m: &Message, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    match m {
        Message::Hello { volume_id, protocol_version, revision, disk } => {
            put_name(out, volume_id)?;
            out.extend_from_slice(&protocol_version.to_le_bytes());
            out.extend_from_slice(&revision.to_le_bytes());
            put_disk(out, disk)?;
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
        Message::DeleteReplica { volume_id, disk } => {
            put_name(out, volume_id)?;
            put_disk(out, disk)?;
        }
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
        Message::Describe { volume_id, disk } => {
            put_name(out, volume_id)?;
            put_disk(out, disk)?;
        }
        Message::Description { status, header, record } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            put_header(out, header)?;
            out.extend_from_slice(&record.version.to_le_bytes());
            out.extend_from_slice(&record.epoch.to_le_bytes());
            out.extend_from_slice(&record.data);
        }
        Message::SetRecord { volume_id, version, epoch, data, disk } => {
            // Kind 37 (see `Message::kind`): the disk first.
            if disk != DEFAULT_DISK {
                put_name(out, disk)?;
            }
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
        Message::Grant { grant } => out.extend_from_slice(grant),
        Message::CreateReplicaOn { disk, volume_id, size } => {
            put_name(out, disk)?;
            put_name(out, volume_id)?;
            out.extend_from_slice(&size.to_le_bytes());
        }
        Message::ListDisks => {}
        Message::DiskList { status, disks } => {
            out.extend_from_slice(&(*status as u16).to_le_bytes());
            let count = u16::try_from(disks.len()).map_err(|_| EncodeError::TooManyEntries { count: disks.len() })?;
            out.extend_from_slice(&count.to_le_bytes());
            for d in disks {
                put_name(out, &d.name)?;
                out.extend_from_slice(&d.capacity.to_le_bytes());
                out.extend_from_slice(&d.available.to_le_bytes());
                let volumes = u32::try_from(d.volumes.len())
                    .map_err(|_| EncodeError::TooManyEntries { count: d.volumes.len() })?;
                out.extend_from_slice(&volumes.to_le_bytes());
                for v in &d.volumes {
                    put_name(out, v)?;
                }
            }
        }
        Message::ListSnapshotDelta { base, name, offset, len } => {
            out.push(u8::from(base.is_some()));
            if let Some(base) = base {
                put_name(out, base)?;
            }
            put_name(out, name)?;
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
    }
    Ok(())
}
