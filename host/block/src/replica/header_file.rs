//! The replica's crash-safe metadata file (`header`): the wire header (volume id, size,
//! revision, dirty flag, snapshot chain) plus what only this replica needs — the layer file of
//! every snapshot and of the live head, and the counter that names new layer files. Replacing
//! this file is the commit point of every change to the chain.
//!
//! Replaced atomically (temp file, fsync, rename, fsync of the directory) and CRC'd, so after a
//! crash it is either the old or the new header, and a damaged one is an error on open — never
//! silently a fresh, zeroed replica.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use super::error::{StoreError, io_err};
use crate::protocol::{MAX_NAME_LEN, ReplicaHeader, SnapshotInfo};

/// File holding the metadata header.
pub const HEADER_FILE: &str = "header";
pub(crate) const HEADER_TMP: &str = "header.tmp";
/// The head layer of a replica that never took a snapshot (and of every replica written before
/// snapshots existed), so a replica without snapshots is one `data.img` as it always was.
pub const DATA_FILE: &str = "data.img";
/// "WCSH": wasmcsi stored header.
const HEADER_MAGIC: [u8; 4] = *b"WCSH";
/// Format 1: no layer files (a replica that is only `data.img`). Format 2 adds them.
const FORMAT_V1: u16 = 1;
const FORMAT_V2: u16 = 2;

/// Everything the `header` file holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredHeader {
    pub(crate) wire: ReplicaHeader,
    /// Layer file of each snapshot in `wire.snapshots`, same order (oldest first).
    pub(crate) snapshot_files: Vec<String>,
    /// Layer file of the live head.
    pub(crate) head_file: String,
    /// Number for the next layer file; only grows, so a name is never reused.
    pub(crate) next_layer: u64,
}

/// Name of layer file number `n`.
pub(crate) fn layer_file_name(n: u64) -> String {
    format!("layer-{n:016x}.img")
}

/// Whether `name` is a file the replica may have created as a layer: the only names `open`
/// may delete as crash leftovers, and the only names a header may point at (a header naming
/// `../x` must not make the replica read or delete outside its directory).
pub(crate) fn is_layer_file_name(name: &str) -> bool {
    name == DATA_FILE
        || name
            .strip_prefix("layer-")
            .and_then(|r| r.strip_suffix(".img"))
            .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Replaces `dir/header` atomically: after a crash it is the old header or the new one.
pub(crate) fn persist(dir: &Path, header: &StoredHeader) -> Result<(), StoreError> {
    let bytes = encode(header)?;
    let tmp = dir.join(HEADER_TMP);
    let target = dir.join(HEADER_FILE);
    let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
    f.write_all(&bytes).map_err(io_err("write", &tmp))?;
    f.sync_all().map_err(io_err("fsync", &tmp))?;
    drop(f);
    std::fs::rename(&tmp, &target).map_err(io_err("rename over", &target))?;
    sync_dir(dir)
}

/// Makes renames, creations and unlinks in `dir` durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("fsync directory", dir))
}

/// Reads and validates `dir/header`.
pub(crate) fn load(dir: &Path) -> Result<StoredHeader, StoreError> {
    let path = dir.join(HEADER_FILE);
    let bytes = std::fs::read(&path).map_err(io_err("read", &path))?;
    decode(&bytes).map_err(|what| StoreError::CorruptHeader { path, what: what.to_owned() })
}

/// `magic, format: u16, volume_id: name, size: u64, revision: u64, dirty: u8, next_layer: u64,
/// head_file: name, count: u32, count × (name, revision: u64, created_ns: u64, file: name),
/// crc32 of everything before it: u32`, little-endian.
pub(crate) fn encode(h: &StoredHeader) -> Result<Vec<u8>, StoreError> {
    fn name(out: &mut Vec<u8>, s: &str) -> Result<(), StoreError> {
        if s.len() > MAX_NAME_LEN {
            return Err(StoreError::Invalid(format!("name of {} bytes", s.len())));
        }
        out.extend_from_slice(&(s.len() as u16).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
        Ok(())
    }
    if h.snapshot_files.len() != h.wire.snapshots.len() {
        return Err(StoreError::Invalid("every snapshot needs exactly one layer file".into()));
    }
    let w = &h.wire;
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&HEADER_MAGIC);
    out.extend_from_slice(&FORMAT_V2.to_le_bytes());
    name(&mut out, &w.volume_id)?;
    out.extend_from_slice(&w.size.to_le_bytes());
    out.extend_from_slice(&w.revision.to_le_bytes());
    out.push(u8::from(w.dirty));
    out.extend_from_slice(&h.next_layer.to_le_bytes());
    name(&mut out, &h.head_file)?;
    let count = u32::try_from(w.snapshots.len()).map_err(|_| StoreError::Invalid("too many snapshots".into()))?;
    out.extend_from_slice(&count.to_le_bytes());
    for (s, file) in w.snapshots.iter().zip(&h.snapshot_files) {
        name(&mut out, &s.name)?;
        out.extend_from_slice(&s.revision.to_le_bytes());
        out.extend_from_slice(&s.created_ns.to_le_bytes());
        name(&mut out, file)?;
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

pub(crate) fn decode(bytes: &[u8]) -> Result<StoredHeader, &'static str> {
    if bytes.len() < 8 {
        return Err("too short");
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if body[..4] != HEADER_MAGIC {
        return Err("bad magic");
    }
    let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32fast::hash(body) != crc {
        return Err("checksum mismatch");
    }
    let mut r = Cursor(&body[4..]);
    let format = r.u16()?;
    if format != FORMAT_V1 && format != FORMAT_V2 {
        return Err("unknown header format");
    }
    let volume_id = r.name()?;
    let size = r.u64()?;
    let revision = r.u64()?;
    let dirty = match r.take(1)?[0] {
        0 => false,
        1 => true,
        _ => return Err("dirty flag is not 0 or 1"),
    };
    let (next_layer, head_file) = if format == FORMAT_V2 { (r.u64()?, r.name()?) } else { (0, DATA_FILE.into()) };
    let count = r.u32()?;
    let mut snapshots = Vec::new();
    let mut snapshot_files = Vec::new();
    for _ in 0..count {
        snapshots.push(SnapshotInfo { name: r.name()?, revision: r.u64()?, created_ns: r.u64()? });
        if format == FORMAT_V1 {
            // Format 1 predates snapshots: a chain there has no data to read it from.
            return Err("format 1 header lists snapshots");
        }
        snapshot_files.push(r.name()?);
    }
    if !r.0.is_empty() {
        return Err("trailing bytes");
    }
    if !snapshot_files.iter().chain([&head_file]).all(|f| is_layer_file_name(f)) {
        return Err("a layer file name is not one this replica creates");
    }
    let mut files: Vec<&String> = snapshot_files.iter().chain([&head_file]).collect();
    files.sort();
    files.dedup();
    if files.len() != snapshots.len() + 1 {
        return Err("two layers share a file");
    }
    Ok(StoredHeader {
        wire: ReplicaHeader { volume_id, size, revision, snapshots, dirty },
        snapshot_files,
        head_file,
        next_layer,
    })
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("truncated");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, &'static str> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, &'static str> {
        let mut a = [0; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        let mut a = [0; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn name(&mut self) -> Result<String, &'static str> {
        let len = self.u16()? as usize;
        if len > MAX_NAME_LEN {
            return Err("name too long");
        }
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| "name is not UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredHeader {
        StoredHeader {
            wire: ReplicaHeader {
                volume_id: "vol-1".into(),
                size: 1 << 30,
                revision: 7,
                snapshots: vec![SnapshotInfo { name: "s1".into(), revision: 3, created_ns: 1_700_000_000_000_000_000 }],
                dirty: true,
            },
            snapshot_files: vec![DATA_FILE.into()],
            head_file: layer_file_name(1),
            next_layer: 2,
        }
    }

    #[test]
    fn header_round_trips() {
        let h = sample();
        assert_eq!(decode(&encode(&h).expect("encodable")), Ok(h));
    }

    #[test]
    fn every_flipped_bit_and_truncation_of_the_header_is_rejected() {
        let bytes = encode(&sample()).expect("encodable");
        for bit in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(decode(&b).is_err(), "bit {bit}");
        }
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn a_format_1_header_reads_as_a_chain_of_just_data_img() {
        // Byte layout of format 1, as replicas written before snapshots have it.
        let mut v1 = Vec::new();
        v1.extend_from_slice(b"WCSH");
        v1.extend_from_slice(&1u16.to_le_bytes());
        v1.extend_from_slice(&1u16.to_le_bytes());
        v1.push(b'v');
        v1.extend_from_slice(&4096u64.to_le_bytes());
        v1.extend_from_slice(&5u64.to_le_bytes());
        v1.push(1);
        v1.extend_from_slice(&0u32.to_le_bytes());
        let crc = crc32fast::hash(&v1);
        v1.extend_from_slice(&crc.to_le_bytes());
        let h = decode(&v1).expect("format 1");
        assert_eq!((h.wire.volume_id.as_str(), h.wire.size, h.wire.revision, h.wire.dirty), ("v", 4096, 5, true));
        assert_eq!((h.head_file.as_str(), h.snapshot_files.len()), (DATA_FILE, 0));
    }

    #[test]
    fn layer_file_names_outside_the_replica_are_refused() {
        for bad in ["../data.img", "/etc/passwd", "layer-xyz.img", "header", "layer-0000000000000001.img/x"] {
            let mut h = sample();
            h.head_file = bad.into();
            assert!(decode(&encode(&h).expect("encodable")).is_err(), "{bad}");
        }
        let mut h = sample();
        h.head_file = DATA_FILE.into();
        assert_eq!(decode(&encode(&h).expect("encodable")), Err("two layers share a file"));
    }
}
