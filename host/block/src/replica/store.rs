//! One replica on disk: a chain of sparse layer files (oldest snapshot … live head) and a
//! crash-safe header ([`header_file`](super::header_file)) that lists them. This module owns the
//! data path — reads merged across the chain, writes and unmaps into the head, flush, revision
//! fencing, extent lists — and the replica-side rules of `proto/replica-protocol.md`; snapshot,
//! delete, revert, resize and reinitialize are in [`chain`](super::chain). It does not own sockets
//! or request scheduling (that is `server`).
//!
//! Without snapshots the chain is one file (`data.img`) and every request is what it always was:
//! one positional read or write, a hole punch for unmap. With snapshots a read takes each 4 KiB
//! block from the topmost layer holding it (in-memory [`BlockMap`](super::block_map::BlockMap)s,
//! no syscall per block); a write goes to the head, and a write that covers only part of a block
//! the head does not hold yet first copies that block up from the chain (read-modify-write), so
//! the head only ever holds whole blocks; an unmap writes zeros into the head where an older
//! layer holds data (a hole would let it show through) and punches holes elsewhere.
//!
//! Thread safety: every method takes `&self`. Data I/O holds the chain's read lock, so requests
//! run in parallel; changes to the header or the chain take the write lock, so once
//! `set_revision` returned no write checked against the old revision can still land. Writes also
//! hold `fold_gate` shared, which a snapshot delete takes exclusively one chunk at a time while it
//! folds blocks into the live head, and read-modify-write of one block is serialized by a striped
//! lock (two non-overlapping writes may share a 4 KiB block).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::error::{StoreError, io_err, nix_err};

pub use super::header_file::{DATA_FILE, HEADER_FILE};

use super::block_map::BLOCK;
use super::header_file::{self, HEADER_TMP, StoredHeader, is_layer_file_name};
use super::layers::{Layer, read_view, view_extents};
use crate::dirty_map::DirtyMap;
use crate::protocol::{Extent, ExtentState, MAX_NAME_LEN, ReplicaHeader};

/// Granularity at which writes since the last flush are remembered for `ExtentMap`'s
/// `Unflushed` state: coarse enough to stay small (16 Mi bits per TiB), fine enough to be useful.
const UNFLUSHED_REGION: u64 = 64 * 1024;
/// Locks that serialize read-modify-write per block; a block uses `block % RMW_STRIPES`.
const RMW_STRIPES: u64 = 64;

/// Writes since the last flush, for `ExtentMap`'s `Unflushed` state. Two maps so a flush can
/// forget exactly what it made durable while writes continue: `flushing` is what an fdatasync in
/// progress covers, `current` what arrived after it started.
#[derive(Debug)]
pub(crate) struct Unflushed {
    current: DirtyMap,
    flushing: DirtyMap,
    flushes_in_progress: usize,
}

impl Unflushed {
    fn new(size: u64) -> Result<Self, StoreError> {
        let map = || DirtyMap::new(size, UNFLUSHED_REGION).map_err(|e| StoreError::Invalid(e.to_string()));
        Ok(Self { current: map()?, flushing: map()?, flushes_in_progress: 0 })
    }

    /// The same marks over a grown volume (resize).
    pub(crate) fn grown(&self, size: u64) -> Result<Self, StoreError> {
        let mut next = Self::new(size)?;
        next.flushes_in_progress = self.flushes_in_progress;
        for (src, dst) in [(&self.current, &mut next.current), (&self.flushing, &mut next.flushing)] {
            for r in src.marked() {
                dst.mark(r * UNFLUSHED_REGION, UNFLUSHED_REGION);
            }
        }
        Ok(next)
    }
}

/// The replica's layers and the header that describes them; changed only under the write lock.
#[derive(Debug)]
pub(crate) struct Chain {
    pub(crate) header: ReplicaHeader,
    pub(crate) next_layer: u64,
    /// One layer per `header.snapshots` entry, oldest first.
    pub(crate) snapshots: Vec<Layer>,
    pub(crate) head: Layer,
}

impl Chain {
    pub(crate) fn stored(&self) -> StoredHeader {
        StoredHeader {
            wire: self.header.clone(),
            snapshot_files: self.snapshots.iter().map(|l| l.name.clone()).collect(),
            head_file: self.head.name.clone(),
            next_layer: self.next_layer,
        }
    }

    /// Every layer, bottom first: the volume as it reads now.
    pub(crate) fn full_view(&self) -> Vec<&Layer> {
        self.snapshots.iter().chain([&self.head]).collect()
    }

    pub(crate) fn snapshot_index(&self, name: &str) -> Result<usize, StoreError> {
        self.header
            .snapshots
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| StoreError::SnapshotNotFound { name: name.to_owned() })
    }

    /// Whether a layer below the head holds `block`.
    fn below_head(&self, block: u64) -> bool {
        self.snapshots.iter().any(|l| l.map.get(block))
    }

    pub(crate) fn blocks(&self) -> u64 {
        self.header.size / BLOCK
    }
}

/// A replica opened from its directory.
#[derive(Debug)]
pub struct ReplicaStore {
    pub(crate) dir: PathBuf,
    pub(crate) chain: RwLock<Chain>,
    /// Serializes changes to the chain's structure (snapshot, delete, revert, resize,
    /// reinitialize): a fold runs for a long time without holding `chain` exclusively.
    pub(crate) structure: Mutex<()>,
    /// Shared by writes and unmaps, exclusive for a fold into the head (one chunk at a time).
    pub(crate) fold_gate: RwLock<()>,
    rmw_stripes: Vec<Mutex<()>>,
    pub(crate) unflushed: Mutex<Unflushed>,
    /// Why snapshots cannot be taken here, if they cannot (see [`check_fs_block_size`]).
    pub(crate) chain_unsupported: Option<String>,
    failed: AtomicBool,
}

pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn lock<T>(l: &Mutex<T>) -> MutexGuard<'_, T> {
    l.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The chain's block maps assume a layer acquires or frees whole 4 KiB blocks; on a file system
/// with larger blocks a 4 KiB write allocates (and SEEK_DATA reports) its neighbours too, which
/// after a reopen would hide older layers' data behind zeros. Such a replica works without
/// snapshots and refuses to take one.
fn check_fs_block_size(dir: &Path) -> Result<Option<String>, StoreError> {
    let vfs = nix::sys::statvfs::statvfs(dir).map_err(nix_err("statvfs", dir))?;
    let bsize = vfs.block_size();
    Ok((bsize > BLOCK).then(|| format!("file system block size {bsize} exceeds {BLOCK}; snapshots need ≤ {BLOCK}")))
}

impl ReplicaStore {
    /// Creates a new, empty replica of `size` bytes (a multiple of 4096) in `dir` (created if
    /// missing). Refuses a directory that already holds a replica, so a typo cannot wipe one.
    pub fn create(dir: &Path, volume_id: &str, size: u64) -> Result<Self, StoreError> {
        if volume_id.is_empty() || volume_id.len() > MAX_NAME_LEN {
            return Err(StoreError::Invalid(format!("volume id of {} bytes", volume_id.len())));
        }
        if !size.is_multiple_of(BLOCK) {
            return Err(StoreError::Invalid(format!("size {size} is not a multiple of {BLOCK}")));
        }
        std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
        if dir.join(HEADER_FILE).exists() {
            return Err(StoreError::AlreadyExists(dir.to_path_buf()));
        }
        let head = Layer::create(dir, DATA_FILE, size)?;
        let header =
            ReplicaHeader { volume_id: volume_id.to_owned(), size, revision: 0, snapshots: Vec::new(), dirty: false };
        let chain = Chain { header, next_layer: 1, snapshots: Vec::new(), head };
        // The header goes last: a crash before it leaves a directory `open` rejects, not a
        // replica with a header and no data file.
        header_file::persist(dir, &chain.stored())?;
        Self::from_chain(dir, chain)
    }

    /// Opens the replica in `dir`, validating its header; a corrupt or missing header, or a
    /// layer file of the wrong size, is an error. Files a crash left behind (a header.tmp, a
    /// layer the committed header does not list) are removed: the header is the commit point.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let stored = header_file::load(dir)?;
        let header_path = dir.join(HEADER_FILE);
        let corrupt = |what: String| StoreError::CorruptHeader { path: header_path.clone(), what };
        let size = stored.wire.size;
        if !size.is_multiple_of(BLOCK) {
            return Err(corrupt(format!("size {size} is not a multiple of {BLOCK}")));
        }
        remove_leftovers(dir, &stored)?;
        let blocks = size / BLOCK;
        let head = Layer::open(dir, &stored.head_file, blocks)?;
        let len = head.file.metadata().map_err(io_err("stat", &head.path))?.len();
        if len > size {
            // Only a resize that crashed before its header commit makes the head longer than the
            // header says; nothing was written past the committed size, so cutting it is exact.
            tracing::warn!(
                replica.dir = %dir.display(),
                len,
                size,
                "replica head longer than its header: undoing an uncommitted resize"
            );
            head.file.set_len(size).map_err(io_err("truncate", &head.path))?;
        } else if len < size {
            return Err(corrupt(format!("{} is {len} bytes, header says {size}", stored.head_file)));
        }
        let mut snapshots = Vec::with_capacity(stored.snapshot_files.len());
        for name in &stored.snapshot_files {
            let layer = Layer::open(dir, name, blocks)?;
            let len = layer.file.metadata().map_err(io_err("stat", &layer.path))?.len();
            // A snapshot layer was the head at some earlier size, and sizes only grow.
            if len > size {
                return Err(corrupt(format!("{name} is {len} bytes, more than the volume's {size}")));
            }
            snapshots.push(layer);
        }
        let chain = Chain { header: stored.wire, next_layer: stored.next_layer, snapshots, head };
        let store = Self::from_chain(dir, chain)?;
        if let Some(why) = &store.chain_unsupported
            && !read(&store.chain).snapshots.is_empty()
        {
            return Err(StoreError::Invalid(format!("replica in {} has snapshots, but {why}", dir.display())));
        }
        Ok(store)
    }

    fn from_chain(dir: &Path, chain: Chain) -> Result<Self, StoreError> {
        let unflushed = Unflushed::new(chain.header.size)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            chain: RwLock::new(chain),
            structure: Mutex::new(()),
            fold_gate: RwLock::new(()),
            rmw_stripes: (0..RMW_STRIPES).map(|_| Mutex::new(())).collect(),
            unflushed: Mutex::new(unflushed),
            chain_unsupported: check_fs_block_size(dir)?,
            failed: AtomicBool::new(false),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The header as it is on disk now.
    pub fn header(&self) -> ReplicaHeader {
        read(&self.chain).header.clone()
    }

    /// Bytes the replica's layer files occupy on disk.
    pub fn allocated_bytes(&self) -> Result<u64, StoreError> {
        let chain = read(&self.chain);
        chain.full_view().iter().map(|l| l.allocated()).sum()
    }

    pub(crate) fn check_range(size: u64, offset: u64, len: u64) -> Result<(), StoreError> {
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(StoreError::OutOfRange { offset, len, size }),
        }
    }

    /// Refuses a request whose revision is older than the replica's, and any change after a
    /// failed commit.
    pub(crate) fn fence(&self, header: &ReplicaHeader, revision: u64) -> Result<(), StoreError> {
        if self.failed.load(Ordering::Acquire) {
            return Err(StoreError::Failed(self.dir.clone()));
        }
        if revision < header.revision {
            return Err(StoreError::StaleRevision { request: revision, replica: header.revision });
        }
        Ok(())
    }

    /// Persists `stored`; on failure the on-disk header may be either version, so the store
    /// stops accepting changes rather than risk writing into a layer the disk no longer lists.
    pub(crate) fn commit(&self, stored: &StoredHeader) -> Result<(), StoreError> {
        let result = header_file::persist(&self.dir, stored);
        if let Err(e) = &result {
            tracing::error!(replica.dir = %self.dir.display(), error = %e, "replica header commit failed");
            self.failed.store(true, Ordering::Release);
        }
        result
    }

    /// Exactly `len` bytes at `offset` of the volume as it reads now; holes read as zeros.
    pub fn read(&self, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        let chain = read(&self.chain);
        Self::check_range(chain.header.size, offset, u64::from(len))?;
        let mut buf = vec![0; len as usize];
        if chain.snapshots.is_empty() {
            chain.head.read_at(&mut buf, offset)?;
        } else {
            read_view(&chain.full_view(), offset, &mut buf)?;
        }
        Ok(buf)
    }

    /// [`Self::read`] if it can be served from the page cache without waiting for the disk;
    /// `None` when it cannot (or when any error or a snapshot chain makes it not worth trying:
    /// the blocking [`Self::read`] then does it and reports what went wrong).
    pub fn read_cached(&self, offset: u64, len: u32) -> Option<Vec<u8>> {
        let chain = read(&self.chain);
        Self::check_range(chain.header.size, offset, u64::from(len)).ok()?;
        if !chain.snapshots.is_empty() {
            return None;
        }
        let mut buf = vec![0; len as usize];
        chain.head.read_cached_at(&mut buf, offset).then_some(buf)
    }

    /// A read for rebuild: refused when this replica's revision is below `revision`, so a stale
    /// replica is never a rebuild source.
    pub fn read_extent(&self, offset: u64, len: u32, revision: u64) -> Result<Vec<u8>, StoreError> {
        let replica = read(&self.chain).header.revision;
        if replica < revision {
            return Err(StoreError::StaleRevision { request: revision, replica });
        }
        self.read(offset, len)
    }

    /// Writes `data` at `offset`, refused when `revision` is below the replica's (fencing).
    pub fn write(&self, offset: u64, data: &[u8], revision: u64) -> Result<(), StoreError> {
        let chain = read(&self.chain);
        self.fence(&chain.header, revision)?;
        let len = data.len() as u64;
        Self::check_range(chain.header.size, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let _gate = read(&self.fold_gate);
        let head = &chain.head;
        let end = offset + len;
        let (first, last) = (offset / BLOCK, (end - 1) / BLOCK);
        if chain.snapshots.is_empty() {
            // Nothing below the head: a partial block needs no copy-up, it is the whole truth.
            head.write_at(data, offset)?;
            head.map.set(first, last + 1);
        } else {
            let (mut lo, mut hi) = (offset, end);
            let partial = |b: u64| b * BLOCK < offset || (b + 1) * BLOCK > end;
            if partial(first) && !head.map.get(first) {
                lo = ((first + 1) * BLOCK).min(end);
                self.copy_up_and_patch(&chain, first, offset, &data[..(lo - offset) as usize])?;
            }
            if last != first && partial(last) && !head.map.get(last) {
                hi = last * BLOCK;
                self.copy_up_and_patch(&chain, last, hi, &data[(hi - offset) as usize..])?;
            }
            if lo < hi {
                head.write_at(&data[(lo - offset) as usize..(hi - offset) as usize], lo)?;
                head.map.set(lo / BLOCK, hi.div_ceil(BLOCK));
            }
        }
        self.mark_unflushed(offset, len);
        Ok(())
    }

    /// Gives the head its own copy of `block` (read from the chain below), with `bytes` at byte
    /// `at` of the volume (inside the block) replacing what was there.
    fn copy_up_and_patch(&self, chain: &Chain, block: u64, at: u64, bytes: &[u8]) -> Result<(), StoreError> {
        let _stripe = lock(&self.rmw_stripes[(block % RMW_STRIPES) as usize]);
        let head = &chain.head;
        // Another write into the same block may have copied it up while we waited.
        if head.map.get(block) {
            return head.write_at(bytes, at);
        }
        let mut buf = vec![0; BLOCK as usize];
        read_view(&chain.full_view(), block * BLOCK, &mut buf)?;
        let start = (at - block * BLOCK) as usize;
        buf[start..start + bytes.len()].copy_from_slice(bytes);
        head.write_at(&buf, block * BLOCK)?;
        head.map.set(block, block + 1);
        Ok(())
    }

    /// Discards `[offset, offset + len)`: later reads return zeros. Without snapshots the blocks
    /// are freed (hole punch); with them, blocks an older layer holds get zeros in the head.
    pub fn unmap(&self, offset: u64, len: u64, revision: u64) -> Result<(), StoreError> {
        let chain = read(&self.chain);
        self.fence(&chain.header, revision)?;
        Self::check_range(chain.header.size, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let _gate = read(&self.fold_gate);
        let head = &chain.head;
        let end = offset + len;
        // Blocks wholly inside the range; the (at most two) others are only partly discarded.
        let (full_lo, full_hi) = (offset.div_ceil(BLOCK), end / BLOCK);
        if chain.snapshots.is_empty() {
            head.punch(offset, len)?;
            if full_lo < full_hi {
                head.map.clear(full_lo, full_hi);
            }
        } else {
            let mut edges = Vec::with_capacity(2);
            if full_lo > full_hi {
                // Both ends inside one block.
                edges.push((offset, end));
            } else {
                if offset < full_lo * BLOCK {
                    edges.push((offset, full_lo * BLOCK));
                }
                if full_hi * BLOCK < end {
                    edges.push((full_hi * BLOCK, end));
                }
            }
            for (s, e) in edges {
                let block = s / BLOCK;
                let zeros = vec![0; (e - s) as usize];
                if head.map.get(block) {
                    head.write_at(&zeros, s)?;
                } else if chain.below_head(block) {
                    self.copy_up_and_patch(&chain, block, s, &zeros)?;
                }
            }
            if full_lo < full_hi {
                self.discard_full_blocks(&chain, full_lo, full_hi)?;
            }
        }
        // The hole's metadata must reach the disk with the next flush like a write's data would.
        self.mark_unflushed(offset, len);
        Ok(())
    }

    /// Discards whole blocks `lo..hi` of the head over a chain: zeros where a snapshot layer holds
    /// data, holes elsewhere.
    fn discard_full_blocks(&self, chain: &Chain, lo: u64, hi: u64) -> Result<(), StoreError> {
        let head = &chain.head;
        let below: Vec<&Layer> = chain.snapshots.iter().collect();
        let mut pos = lo;
        for (s, l) in view_extents(&below, lo * BLOCK, (hi - lo) * BLOCK).into_iter().chain([(hi * BLOCK, 0)]) {
            let (b, e) = (s / BLOCK, (s + l) / BLOCK);
            if pos < b && head.map.any(pos, b) {
                head.punch(pos * BLOCK, (b - pos) * BLOCK)?;
                head.map.clear(pos, b);
            }
            if b < e {
                head.write_zeros(s, l)?;
                head.map.set(b, e);
            }
            pos = e.max(pos);
        }
        Ok(())
    }

    fn mark_unflushed(&self, offset: u64, len: u64) {
        lock(&self.unflushed).current.mark(offset, len);
    }

    /// Makes every write that completed before this call durable (fdatasync of the head: data
    /// plus the metadata needed to find it; snapshot layers are synced when they are frozen).
    pub fn flush(&self) -> Result<(), StoreError> {
        {
            // What this fdatasync covers moves to `flushing`; writes finishing from now on stay
            // in `current` because the fdatasync may or may not include them.
            let mut u = lock(&self.unflushed);
            let Unflushed { current, flushing, flushes_in_progress } = &mut *u;
            flushing.merge(current);
            current.clear();
            *flushes_in_progress += 1;
        }
        let result = read(&self.chain).head.sync_data();
        let mut u = lock(&self.unflushed);
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
        let mut chain = write(&self.chain);
        let mut next = chain.header.clone();
        change(&mut next);
        if next != chain.header {
            let mut stored = chain.stored();
            stored.wire = next.clone();
            self.commit(&stored)?;
            chain.header = next;
        }
        Ok(chain.header.revision)
    }

    /// The extents of `[offset, offset + len)` that hold data in the volume as it reads now,
    /// clipped to the range, at 4 KiB granularity (they may cover zeros); regions written since
    /// the last flush are reported `Unflushed`.
    pub fn list_extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, StoreError> {
        let chain = read(&self.chain);
        Self::check_range(chain.header.size, offset, len)?;
        let allocated = view_extents(&chain.full_view(), offset, len);
        drop(chain);
        let u = lock(&self.unflushed);
        let mut extents = Vec::new();
        for (start, l) in allocated {
            split_by_unflushed(start, l, &u, &mut extents);
        }
        Ok(extents)
    }
}

/// Removes what a crash may have left in `dir`: a header.tmp, and layer files the committed
/// header does not list (a snapshot's new head before its commit, a deleted snapshot's layer
/// after it). Only names this store creates are touched.
fn remove_leftovers(dir: &Path, stored: &StoredHeader) -> Result<(), StoreError> {
    let mut removed = false;
    for entry in std::fs::read_dir(dir).map_err(io_err("list", dir))? {
        let entry = entry.map_err(io_err("list", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let listed = stored.head_file == name || stored.snapshot_files.iter().any(|f| f == name);
        if name == HEADER_TMP || (is_layer_file_name(name) && !listed) {
            let path = entry.path();
            tracing::info!(replica.dir = %dir.display(), file = name, "removing a file left by an interrupted change");
            std::fs::remove_file(&path).map_err(io_err("remove", &path))?;
            removed = true;
        }
    }
    if removed {
        header_file::sync_dir(dir)?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn create_refuses_an_existing_replica_and_an_unaligned_size() {
        let dir = tempfile::tempdir().expect("tempdir");
        ReplicaStore::create(dir.path(), "v", 4096).expect("create");
        assert!(matches!(ReplicaStore::create(dir.path(), "v", 4096), Err(StoreError::AlreadyExists(_))));
        let other = tempfile::tempdir().expect("tempdir");
        assert!(matches!(ReplicaStore::create(other.path(), "v", 4097), Err(StoreError::Invalid(_))));
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

    #[test]
    fn a_replica_without_snapshots_is_one_data_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = ReplicaStore::create(dir.path(), "v", 1 << 20).expect("create");
        s.write(100, &[7; 5000], 0).expect("write");
        s.unmap(8192, 4096, 0).expect("unmap");
        let mut names: Vec<_> =
            std::fs::read_dir(dir.path()).expect("list").map(|e| e.expect("entry").file_name()).collect();
        names.sort();
        assert_eq!(names, [DATA_FILE, HEADER_FILE]);
        let data = std::fs::read(dir.path().join(DATA_FILE)).expect("read");
        assert_eq!(&data[100..5100], &[7; 5000][..]);
    }
}
