//! One replica on disk: a sparse data file (`data.img`, as long as the volume) and a crash-safe
//! metadata header (`header`: volume id, size, revision, snapshot chain, dirty flag). This module
//! owns the on-disk layout and the replica-side rules of `proto/replica-protocol.md` (revision
//! fencing, exact-length reads, holes read as zeros, flush = fdatasync); it does not own sockets
//! or request scheduling (that is `server`), and snapshots are not implemented yet (the chain is
//! stored and reported, never extended).
//!
//! The header is replaced atomically (temp file, fsync, rename, fsync of the directory) and
//! carries a CRC-32, so after a crash it is either the old or the new header, and a damaged one
//! is an error on open — never silently a fresh, zeroed replica.
//!
//! Thread safety: every method takes `&self`; data I/O is positional so requests run in
//! parallel. Writes and unmaps hold the header's read lock while they touch the data file, and
//! `set_revision` takes the write lock, so once `set_revision` returned no write checked against
//! the old revision can still land.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError, RwLock};

use nix::fcntl::{FallocateFlags, fallocate};
use nix::unistd::{Whence, lseek};
use thiserror::Error;

use crate::dirty::DirtyMap;
use crate::protocol::{Extent, ExtentState, MAX_NAME_LEN, ReplicaHeader, SnapshotInfo, Status};

/// File holding the volume's bytes; sparse, `set_len` to the volume size.
pub const DATA_FILE: &str = "data.img";
/// File holding the metadata header.
pub const HEADER_FILE: &str = "header";
const HEADER_TMP: &str = "header.tmp";
/// "WCSH": wasmcsi stored header.
const HEADER_MAGIC: [u8; 4] = *b"WCSH";
const HEADER_FORMAT: u16 = 1;
/// Granularity at which writes since the last flush are remembered for `ExtentMap`'s
/// `Unflushed` state: coarse enough to stay small (16 Mi bits per TiB), fine enough to be useful.
const UNFLUSHED_REGION: u64 = 64 * 1024;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("replica header {path} is corrupt: {what}")]
    CorruptHeader { path: PathBuf, what: String },
    #[error("replica already exists in {0}")]
    AlreadyExists(PathBuf),
    #[error("range {offset}+{len} is outside the volume of {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("request revision {request} is older than the replica's {replica}")]
    StaleRevision { request: u64, replica: u64 },
    #[error("invalid replica: {0}")]
    Invalid(String),
}

impl StoreError {
    /// The wire status that answers a request failing with this error.
    pub fn status(&self) -> Status {
        match self {
            Self::Io { .. } | Self::CorruptHeader { .. } | Self::AlreadyExists(_) => Status::IoError,
            Self::OutOfRange { .. } => Status::OutOfRange,
            Self::StaleRevision { .. } => Status::StaleRevision,
            Self::Invalid(_) => Status::Invalid,
        }
    }
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { op, path: path.to_path_buf(), source }
}

fn nix_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(nix::Error) -> StoreError + 'a {
    move |e| StoreError::Io { op, path: path.to_path_buf(), source: std::io::Error::from(e) }
}

/// Writes since the last flush, for `ExtentMap`'s `Unflushed` state. Two maps so a flush can
/// forget exactly what it made durable while writes continue: `flushing` is what an fdatasync in
/// progress covers, `current` what arrived after it started.
#[derive(Debug)]
struct Unflushed {
    current: DirtyMap,
    flushing: DirtyMap,
    flushes_in_progress: usize,
}

/// A replica opened from its directory.
#[derive(Debug)]
pub struct ReplicaStore {
    dir: PathBuf,
    data_path: PathBuf,
    data: File,
    header: RwLock<ReplicaHeader>,
    unflushed: Mutex<Unflushed>,
}

impl ReplicaStore {
    /// Creates a new, empty replica of `size` bytes in `dir` (created if missing). Refuses a
    /// directory that already holds a replica, so a typo cannot wipe one.
    pub fn create(dir: &Path, volume_id: &str, size: u64) -> Result<Self, StoreError> {
        if volume_id.is_empty() || volume_id.len() > MAX_NAME_LEN {
            return Err(StoreError::Invalid(format!("volume id of {} bytes", volume_id.len())));
        }
        std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        let header_path = dir.join(HEADER_FILE);
        if header_path.exists() {
            return Err(StoreError::AlreadyExists(dir.to_path_buf()));
        }
        let data_path = dir.join(DATA_FILE);
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&data_path)
            .map_err(io_err("create", &data_path))?;
        data.set_len(size).map_err(io_err("set length of", &data_path))?;
        data.sync_all().map_err(io_err("fsync", &data_path))?;
        let header =
            ReplicaHeader { volume_id: volume_id.to_owned(), size, revision: 0, snapshots: Vec::new(), dirty: false };
        // The header goes last: a crash before it leaves a directory `open` rejects, not a
        // replica with a header and no data file.
        persist_header(dir, &header)?;
        Self::from_parts(dir, data_path, data, header)
    }

    /// Opens the replica in `dir`, validating its header; a corrupt or missing header, or a data
    /// file of the wrong size, is an error.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let header_path = dir.join(HEADER_FILE);
        let bytes = std::fs::read(&header_path).map_err(io_err("read", &header_path))?;
        let header = decode_header(&bytes)
            .map_err(|what| StoreError::CorruptHeader { path: header_path.clone(), what: what.to_owned() })?;
        let data_path = dir.join(DATA_FILE);
        let data = OpenOptions::new().read(true).write(true).open(&data_path).map_err(io_err("open", &data_path))?;
        let len = data.metadata().map_err(io_err("stat", &data_path))?.len();
        if len != header.size {
            return Err(StoreError::CorruptHeader {
                path: header_path,
                what: format!("data file is {len} bytes, header says {}", header.size),
            });
        }
        Self::from_parts(dir, data_path, data, header)
    }

    fn from_parts(dir: &Path, data_path: PathBuf, data: File, header: ReplicaHeader) -> Result<Self, StoreError> {
        let map = || DirtyMap::new(header.size, UNFLUSHED_REGION).map_err(|e| StoreError::Invalid(e.to_string()));
        let unflushed = Unflushed { current: map()?, flushing: map()?, flushes_in_progress: 0 };
        Ok(Self {
            dir: dir.to_path_buf(),
            data_path,
            data,
            header: RwLock::new(header),
            unflushed: Mutex::new(unflushed),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The header as it is on disk now.
    pub fn header(&self) -> ReplicaHeader {
        self.header.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn check_range(size: u64, offset: u64, len: u64) -> Result<(), StoreError> {
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(StoreError::OutOfRange { offset, len, size }),
        }
    }

    /// Exactly `len` bytes at `offset`; holes read as zeros.
    pub fn read(&self, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        let size = self.header.read().unwrap_or_else(PoisonError::into_inner).size;
        Self::check_range(size, offset, u64::from(len))?;
        let mut buf = vec![0; len as usize];
        // `read_exact_at` retries short reads; the range check makes EOF impossible short of the
        // file being truncated behind our back, which is then an I/O error, not zeros.
        self.data.read_exact_at(&mut buf, offset).map_err(io_err("read", &self.data_path))?;
        Ok(buf)
    }

    /// A read for rebuild: refused when this replica's revision is below `revision`, so a stale
    /// replica is never a rebuild source.
    pub fn read_extent(&self, offset: u64, len: u32, revision: u64) -> Result<Vec<u8>, StoreError> {
        let replica = self.header.read().unwrap_or_else(PoisonError::into_inner).revision;
        if replica < revision {
            return Err(StoreError::StaleRevision { request: revision, replica });
        }
        self.read(offset, len)
    }

    /// Writes `data` at `offset`, refused when `revision` is below the replica's (fencing).
    pub fn write(&self, offset: u64, data: &[u8], revision: u64) -> Result<(), StoreError> {
        let header = self.header.read().unwrap_or_else(PoisonError::into_inner);
        Self::fence(&header, revision)?;
        Self::check_range(header.size, offset, data.len() as u64)?;
        self.data.write_all_at(data, offset).map_err(io_err("write", &self.data_path))?;
        self.mark_unflushed(offset, data.len() as u64);
        Ok(())
    }

    /// Discards `[offset, offset + len)`: later reads return zeros and the blocks are freed.
    pub fn unmap(&self, offset: u64, len: u64, revision: u64) -> Result<(), StoreError> {
        let header = self.header.read().unwrap_or_else(PoisonError::into_inner);
        Self::fence(&header, revision)?;
        Self::check_range(header.size, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let (off, l) = (to_off(offset)?, to_off(len)?);
        // KEEP_SIZE: punching the tail must not shrink the volume.
        fallocate(&self.data, FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE, off, l)
            .map_err(nix_err("punch hole in", &self.data_path))?;
        // The hole's metadata must reach the disk with the next flush like a write's data would.
        self.mark_unflushed(offset, len);
        Ok(())
    }

    fn fence(header: &ReplicaHeader, revision: u64) -> Result<(), StoreError> {
        if revision < header.revision {
            return Err(StoreError::StaleRevision { request: revision, replica: header.revision });
        }
        Ok(())
    }

    fn mark_unflushed(&self, offset: u64, len: u64) {
        self.unflushed.lock().unwrap_or_else(PoisonError::into_inner).current.mark(offset, len);
    }

    /// Makes every write that completed before this call durable (fdatasync: data plus the
    /// metadata needed to find it, e.g. newly allocated blocks).
    pub fn flush(&self) -> Result<(), StoreError> {
        {
            // What this fdatasync covers moves to `flushing`; writes finishing from now on stay
            // in `current` because the fdatasync may or may not include them.
            let mut u = self.unflushed.lock().unwrap_or_else(PoisonError::into_inner);
            let Unflushed { current, flushing, flushes_in_progress } = &mut *u;
            flushing.merge(current);
            current.clear();
            *flushes_in_progress += 1;
        }
        let result = self.data.sync_data().map_err(io_err("fdatasync", &self.data_path));
        let mut u = self.unflushed.lock().unwrap_or_else(PoisonError::into_inner);
        u.flushes_in_progress -= 1;
        match &result {
            // Concurrent flushes share `flushing`; only the last one to finish may clear it, as
            // an earlier finisher's fdatasync may have started before some of it was merged in.
            Ok(()) if u.flushes_in_progress == 0 => u.flushing.clear(),
            Ok(()) => {}
            // Nothing was made durable: put it back so it is still reported as unflushed.
            Err(_) => {
                let Unflushed { current, flushing, .. } = &mut *u;
                current.merge(flushing);
                if u.flushes_in_progress == 0 {
                    u.flushing.clear();
                }
            }
        }
        result
    }

    /// Raises the revision to `max(current, revision)` and persists it before returning.
    pub fn set_revision(&self, revision: u64) -> Result<u64, StoreError> {
        self.update_header(|h| h.revision = h.revision.max(revision))
    }

    /// Records whether an engine has the replica open; persisted before returning.
    pub fn set_dirty(&self, dirty: bool) -> Result<(), StoreError> {
        self.update_header(|h| h.dirty = dirty).map(|_| ())
    }

    /// Applies `change` to the header, persists it, and only then makes it visible. Holding the
    /// write lock meanwhile excludes writes, which is what makes a new revision a fence.
    fn update_header(&self, change: impl FnOnce(&mut ReplicaHeader)) -> Result<u64, StoreError> {
        let mut header = self.header.write().unwrap_or_else(PoisonError::into_inner);
        let mut next = header.clone();
        change(&mut next);
        if next != *header {
            persist_header(&self.dir, &next)?;
            *header = next;
        }
        Ok(header.revision)
    }

    /// The allocated extents of `[offset, offset + len)`, clipped to it, as found by
    /// SEEK_DATA/SEEK_HOLE; regions written since the last flush are reported `Unflushed`.
    /// Extents are at the file system's allocation granularity, so they may cover zeros.
    pub fn list_extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, StoreError> {
        let size = self.header.read().unwrap_or_else(PoisonError::into_inner).size;
        Self::check_range(size, offset, len)?;
        let end = offset + len;
        let mut allocated = Vec::new();
        let mut pos = offset;
        while pos < end {
            let data = match lseek(&self.data, to_off(pos)?, Whence::SeekData) {
                Ok(d) => d as u64,
                // ENXIO: no data at or after `pos`.
                Err(nix::Error::ENXIO) => break,
                Err(e) => return Err(nix_err("seek data in", &self.data_path)(e)),
            };
            if data >= end {
                break;
            }
            let hole = lseek(&self.data, to_off(data)?, Whence::SeekHole)
                .map_err(nix_err("seek hole in", &self.data_path))? as u64;
            let stop = hole.min(end);
            allocated.push((data, stop - data));
            pos = stop;
        }
        let u = self.unflushed.lock().unwrap_or_else(PoisonError::into_inner);
        let mut extents = Vec::new();
        for (start, l) in allocated {
            split_by_unflushed(start, l, &u, &mut extents);
        }
        Ok(extents)
    }
}

/// Splits one allocated range at unflushed-region boundaries, merging neighbours of one state.
fn split_by_unflushed(start: u64, len: u64, u: &Unflushed, out: &mut Vec<Extent>) {
    let end = start + len;
    let mut pos = start;
    while pos < end {
        let region = pos / UNFLUSHED_REGION;
        let region_end = ((region + 1) * UNFLUSHED_REGION).min(end);
        let state = if u.current.is_marked(region) || u.flushing.is_marked(region) {
            ExtentState::Unflushed
        } else {
            ExtentState::Allocated
        };
        match out.last_mut() {
            Some(last) if last.state == state && last.offset + last.len == pos => last.len += region_end - pos,
            _ => out.push(Extent { offset: pos, len: region_end - pos, state }),
        }
        pos = region_end;
    }
}

fn to_off(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::Invalid(format!("offset {v} exceeds the file offset range")))
}

/// Replaces `dir/header` atomically: after a crash it is the old header or the new one.
fn persist_header(dir: &Path, header: &ReplicaHeader) -> Result<(), StoreError> {
    let bytes = encode_header(header)?;
    let tmp = dir.join(HEADER_TMP);
    let target = dir.join(HEADER_FILE);
    let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
    f.write_all(&bytes).map_err(io_err("write", &tmp))?;
    f.sync_all().map_err(io_err("fsync", &tmp))?;
    drop(f);
    std::fs::rename(&tmp, &target).map_err(io_err("rename over", &target))?;
    // The rename is durable only once the directory entry is.
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("fsync directory", dir))?;
    Ok(())
}

/// `magic, format: u16, volume_id: name, size: u64, revision: u64, dirty: u8, count: u32,
/// count × (name, revision: u64, created_ns: u64), crc32 of everything before it: u32`, little-endian.
fn encode_header(h: &ReplicaHeader) -> Result<Vec<u8>, StoreError> {
    fn name(out: &mut Vec<u8>, s: &str) -> Result<(), StoreError> {
        if s.len() > MAX_NAME_LEN {
            return Err(StoreError::Invalid(format!("name of {} bytes", s.len())));
        }
        out.extend_from_slice(&(s.len() as u16).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
        Ok(())
    }
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&HEADER_MAGIC);
    out.extend_from_slice(&HEADER_FORMAT.to_le_bytes());
    name(&mut out, &h.volume_id)?;
    out.extend_from_slice(&h.size.to_le_bytes());
    out.extend_from_slice(&h.revision.to_le_bytes());
    out.push(u8::from(h.dirty));
    let count = u32::try_from(h.snapshots.len()).map_err(|_| StoreError::Invalid("too many snapshots".into()))?;
    out.extend_from_slice(&count.to_le_bytes());
    for s in &h.snapshots {
        name(&mut out, &s.name)?;
        out.extend_from_slice(&s.revision.to_le_bytes());
        out.extend_from_slice(&s.created_ns.to_le_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

fn decode_header(bytes: &[u8]) -> Result<ReplicaHeader, &'static str> {
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
    if r.u16()? != HEADER_FORMAT {
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
    let count = r.u32()?;
    let mut snapshots = Vec::new();
    for _ in 0..count {
        snapshots.push(SnapshotInfo { name: r.name()?, revision: r.u64()?, created_ns: r.u64()? });
    }
    if !r.0.is_empty() {
        return Err("trailing bytes");
    }
    Ok(ReplicaHeader { volume_id, size, revision, snapshots, dirty })
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

    fn sample() -> ReplicaHeader {
        ReplicaHeader {
            volume_id: "vol-1".into(),
            size: 1 << 30,
            revision: 7,
            snapshots: vec![SnapshotInfo { name: "s1".into(), revision: 3, created_ns: 1_700_000_000_000_000_000 }],
            dirty: true,
        }
    }

    #[test]
    fn header_round_trips() {
        let h = sample();
        assert_eq!(decode_header(&encode_header(&h).expect("encodable")), Ok(h));
    }

    #[test]
    fn every_flipped_bit_and_truncation_of_the_header_is_rejected() {
        let bytes = encode_header(&sample()).expect("encodable");
        for bit in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            assert!(decode_header(&b).is_err(), "bit {bit}");
        }
        for cut in 0..bytes.len() {
            assert!(decode_header(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn stale_write_is_fenced_and_revision_only_grows() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = ReplicaStore::create(dir.path(), "v", 1 << 20).expect("create");
        assert_eq!(s.set_revision(5).expect("set"), 5);
        assert_eq!(s.set_revision(3).expect("set"), 5, "max of old and new");
        assert!(matches!(s.write(0, b"x", 4), Err(StoreError::StaleRevision { request: 4, replica: 5 })));
        assert!(matches!(s.read_extent(0, 1, 6), Err(StoreError::StaleRevision { .. })));
        s.write(0, b"x", 5).expect("current revision writes");
        assert_eq!(ReplicaStore::open(dir.path()).expect("reopen").header().revision, 5);
    }

    #[test]
    fn create_refuses_an_existing_replica() {
        let dir = tempfile::tempdir().expect("tempdir");
        ReplicaStore::create(dir.path(), "v", 4096).expect("create");
        assert!(matches!(ReplicaStore::create(dir.path(), "v", 4096), Err(StoreError::AlreadyExists(_))));
    }

    #[test]
    fn out_of_range_requests_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = ReplicaStore::create(dir.path(), "v", 4096).expect("create");
        assert!(matches!(s.read(4000, 200), Err(StoreError::OutOfRange { .. })));
        assert!(matches!(s.write(u64::MAX, b"ab", 0), Err(StoreError::OutOfRange { .. })));
        assert!(matches!(s.unmap(0, 4097, 0), Err(StoreError::OutOfRange { .. })));
    }

    #[test]
    fn unflushed_writes_are_reported_until_a_flush() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = ReplicaStore::create(dir.path(), "v", 4 << 20).expect("create");
        s.write(1 << 20, &[1; 4096], 0).expect("write");
        let e = s.list_extents(0, 4 << 20).expect("list");
        assert!(!e.is_empty() && e.iter().any(|x| x.state == ExtentState::Unflushed), "{e:?}");
        s.flush().expect("flush");
        let e = s.list_extents(0, 4 << 20).expect("list");
        assert!(!e.is_empty() && e.iter().all(|x| x.state == ExtentState::Allocated), "{e:?}");
    }
}
