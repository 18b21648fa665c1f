//! Changes to a replica's snapshot chain and size: snapshot, delete (fold), revert, resize,
//! reinitialize, and the read-only views as of a snapshot. Every change follows one pattern —
//! prepare new files durably, then atomically replace the header (the commit point), then remove
//! what the new header no longer lists — so a crash at any step leaves either the old or the new
//! chain, plus files `ReplicaStore::open` deletes as leftovers.
//!
//! Structural changes are serialized by `ReplicaStore::structure`. All but delete take the
//! chain's write lock for their whole (short) duration; delete folds a possibly large layer
//! under the read lock, one chunk at a time, and takes the write lock only to commit.

use std::time::{SystemTime, UNIX_EPOCH};

use super::block_map::BLOCK;
use super::error::{StoreError, io_err};
use super::header_file::{self, layer_file_name};
use super::layers::{Layer, read_view, view_extents};
use super::store::{ReplicaStore, lock, read, write};
use crate::protocol::{Extent, ExtentState, MAX_NAME_LEN, SnapshotInfo};

/// Blocks folded per exclusive hold of the fold gate: 1 MiB of copying, so a client write waits
/// at most about one such copy while the newest snapshot is folded into the live head.
const FOLD_CHUNK: u64 = 256;

fn now_ns() -> u64 {
    // Before 1970 only on a broken clock; 0 is an honest "unknown".
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl ReplicaStore {
    /// Takes snapshot `name`: the head's data is synced and frozen as the snapshot's layer and an
    /// empty head starts on top. Retrying the newest snapshot with nothing written since is `Ok`;
    /// any other existing name is [`StoreError::SnapshotExists`].
    pub fn snapshot(&self, name: &str, revision: u64) -> Result<(), StoreError> {
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(StoreError::Invalid(format!("snapshot name of {} bytes", name.len())));
        }
        if let Some(why) = &self.chain_unsupported {
            return Err(StoreError::Invalid(why.clone()));
        }
        let _structure = lock(&self.structure);
        let mut chain = write(&self.chain);
        self.fence(&chain.header, revision)?;
        if let Ok(i) = chain.snapshot_index(name) {
            let blocks = chain.blocks();
            if i + 1 == chain.snapshots.len() && !chain.head.map.any(0, blocks) {
                return Ok(());
            }
            return Err(StoreError::SnapshotExists { name: name.to_owned() });
        }
        // The frozen layer must be durable before a header names it as a snapshot.
        chain.head.sync_data()?;
        let new_head = Layer::create(&self.dir, &layer_file_name(chain.next_layer), chain.header.size)?;
        let mut stored = chain.stored();
        stored.wire.snapshots.push(SnapshotInfo { name: name.to_owned(), revision, created_ns: now_ns() });
        stored.snapshot_files.push(chain.head.name.clone());
        stored.head_file = new_head.name.clone();
        stored.next_layer += 1;
        self.commit(&stored)?;
        let frozen = std::mem::replace(&mut chain.head, new_head);
        chain.snapshots.push(frozen);
        chain.header = stored.wire;
        chain.next_layer = stored.next_layer;
        tracing::info!(replica.dir = %self.dir.display(), snapshot = name, revision, "snapshot taken");
        Ok(())
    }

    /// Removes snapshot `name`, folding the blocks its layer holds and its successor (the next
    /// snapshot's layer, or the live head) lacks into the successor, so every other view reads
    /// the same before and after. [`StoreError::SnapshotNotFound`] when there is no such
    /// snapshot.
    ///
    /// Crash safety: folding copies into the successor only blocks it does not hold, which the
    /// successor's views read from this layer anyway, so a half-done fold changes no view; the
    /// successor is synced before the header commit, and the layer is unlinked only after it.
    pub fn delete_snapshot(&self, name: &str, revision: u64) -> Result<(), StoreError> {
        let _structure = lock(&self.structure);
        let idx = {
            let chain = read(&self.chain);
            self.fence(&chain.header, revision)?;
            chain.snapshot_index(name)?
        };
        self.fold(idx)?;
        let mut chain = write(&self.chain);
        // The revision may have moved while folding; a fenced-out engine must not commit.
        self.fence(&chain.header, revision)?;
        let mut stored = chain.stored();
        stored.wire.snapshots.remove(idx);
        stored.snapshot_files.remove(idx);
        self.commit(&stored)?;
        let gone = chain.snapshots.remove(idx);
        chain.header = stored.wire;
        drop(chain);
        self.remove_layers(vec![gone]);
        tracing::info!(replica.dir = %self.dir.display(), snapshot = name, "snapshot deleted");
        Ok(())
    }

    /// Copies the blocks of snapshot layer `idx` that its successor lacks into the successor,
    /// then syncs the successor.
    pub(crate) fn fold(&self, idx: usize) -> Result<(), StoreError> {
        let mut buf = vec![0; (FOLD_CHUNK * BLOCK) as usize];
        let mut next = 0;
        loop {
            // Reacquired per chunk so header updates (set_revision, the dirty flag) are not held
            // up for the whole fold; structural changes are excluded by `structure`.
            let chain = read(&self.chain);
            let blocks = chain.blocks();
            let layer = &chain.snapshots[idx];
            let into_head = idx + 1 == chain.snapshots.len();
            let succ = if into_head { &chain.head } else { &chain.snapshots[idx + 1] };
            let start = layer.map.next(next, blocks, true);
            if start >= blocks {
                return succ.sync_data();
            }
            let end = (start + FOLD_CHUNK).min(blocks);
            // Client writes only touch the head; folding into it must not race one of them for
            // a block (the write's data would be overwritten by the older copy).
            let _gate = into_head.then(|| write(&self.fold_gate));
            let needs = |b: u64| layer.map.get(b) && !succ.map.get(b);
            let mut b = start;
            while b < end {
                if !needs(b) {
                    b += 1;
                    continue;
                }
                let mut e = b + 1;
                while e < end && needs(e) {
                    e += 1;
                }
                let part = &mut buf[..((e - b) * BLOCK) as usize];
                layer.read_at(part, b * BLOCK)?;
                succ.write_at(part, b * BLOCK)?;
                succ.map.set(b, e);
                b = e;
            }
            next = end;
        }
    }

    /// Makes the volume read as at snapshot `name`: the head and every newer snapshot are
    /// dropped, an empty head starts on top of `name`. The caller refuses this while another
    /// engine has the replica open (`Busy` on the wire).
    pub fn revert(&self, name: &str, revision: u64) -> Result<(), StoreError> {
        let _structure = lock(&self.structure);
        let mut chain = write(&self.chain);
        self.fence(&chain.header, revision)?;
        let idx = chain.snapshot_index(name)?;
        let new_head = Layer::create(&self.dir, &layer_file_name(chain.next_layer), chain.header.size)?;
        let mut stored = chain.stored();
        stored.wire.snapshots.truncate(idx + 1);
        stored.snapshot_files.truncate(idx + 1);
        stored.head_file = new_head.name.clone();
        stored.next_layer += 1;
        self.commit(&stored)?;
        let mut dropped: Vec<Layer> = chain.snapshots.drain(idx + 1..).collect();
        dropped.push(std::mem::replace(&mut chain.head, new_head));
        chain.header = stored.wire;
        chain.next_layer = stored.next_layer;
        drop(chain);
        self.remove_layers(dropped);
        tracing::info!(replica.dir = %self.dir.display(), snapshot = name, "reverted to snapshot");
        Ok(())
    }

    /// Drops every snapshot and all data (the volume reads as zeros) and raises the revision to
    /// `revision`, durably: the first step of a full rebuild onto this replica.
    pub fn reinitialize(&self, revision: u64) -> Result<(), StoreError> {
        let _structure = lock(&self.structure);
        let mut chain = write(&self.chain);
        self.fence(&chain.header, revision)?;
        let new_head = Layer::create(&self.dir, &layer_file_name(chain.next_layer), chain.header.size)?;
        let mut stored = chain.stored();
        stored.wire.snapshots.clear();
        stored.snapshot_files.clear();
        stored.wire.revision = revision;
        stored.head_file = new_head.name.clone();
        stored.next_layer += 1;
        self.commit(&stored)?;
        let mut dropped: Vec<Layer> = chain.snapshots.drain(..).collect();
        dropped.push(std::mem::replace(&mut chain.head, new_head));
        chain.header = stored.wire;
        chain.next_layer = stored.next_layer;
        drop(chain);
        self.remove_layers(dropped);
        tracing::info!(replica.dir = %self.dir.display(), revision, "replica reinitialized");
        Ok(())
    }

    /// Grows the volume to `size` (a multiple of 4096), durably before returning; the same size
    /// is a no-op, a smaller one [`StoreError::Invalid`]. Only the head is lengthened: snapshot
    /// layers keep the size they were taken at and read as zeros beyond it.
    pub fn resize(&self, size: u64, revision: u64) -> Result<(), StoreError> {
        let _structure = lock(&self.structure);
        let mut chain = write(&self.chain);
        self.fence(&chain.header, revision)?;
        let current = chain.header.size;
        if size < current {
            return Err(StoreError::Invalid(format!("cannot shrink the volume from {current} to {size} bytes")));
        }
        if size == current {
            return Ok(());
        }
        if !size.is_multiple_of(BLOCK) {
            return Err(StoreError::Invalid(format!("size {size} is not a multiple of {BLOCK}")));
        }
        let unflushed = lock(&self.unflushed).grown(size)?;
        // Length first, header second: a crash in between leaves a head longer than the header,
        // which open cuts back (nothing can have been written past the committed size).
        let head = &chain.head;
        head.file.set_len(size).map_err(io_err("extend", &head.path))?;
        head.file.sync_all().map_err(io_err("fsync", &head.path))?;
        let mut stored = chain.stored();
        stored.wire.size = size;
        self.commit(&stored)?;
        let blocks = size / BLOCK;
        chain.head.map = chain.head.map.grown(blocks);
        for l in &mut chain.snapshots {
            l.map = l.map.grown(blocks);
        }
        chain.header = stored.wire;
        *lock(&self.unflushed) = unflushed;
        tracing::info!(replica.dir = %self.dir.display(), from = current, to = size, "replica resized");
        Ok(())
    }

    /// Exactly `len` bytes at `offset` of the volume as it was when snapshot `name` was taken.
    pub fn read_snapshot(&self, name: &str, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        let chain = read(&self.chain);
        let idx = chain.snapshot_index(name)?;
        Self::check_range(chain.header.size, offset, u64::from(len))?;
        let view: Vec<&Layer> = chain.snapshots[..=idx].iter().collect();
        let mut buf = vec![0; len as usize];
        read_view(&view, offset, &mut buf)?;
        Ok(buf)
    }

    /// The extents of `[offset, offset + len)` that hold data as of snapshot `name`, all
    /// `Allocated` (a snapshot's layers are synced when frozen).
    pub fn list_snapshot_extents(&self, name: &str, offset: u64, len: u64) -> Result<Vec<Extent>, StoreError> {
        let chain = read(&self.chain);
        let idx = chain.snapshot_index(name)?;
        Self::check_range(chain.header.size, offset, len)?;
        let view: Vec<&Layer> = chain.snapshots[..=idx].iter().collect();
        Ok(view_extents(&view, offset, len)
            .into_iter()
            .map(|(offset, len)| Extent { offset, len, state: ExtentState::Allocated })
            .collect())
    }

    /// The extents of `[offset, offset + len)` whose 4 KiB blocks may differ between the views of
    /// snapshot `base` and snapshot `name`, without reading any data; with no base, those that
    /// hold data as of `name` (what differs from all zeros). All `Allocated`.
    ///
    /// Why the maps suffice: a view reads each block from the topmost layer of its stack that
    /// holds it. The stacks of two snapshots of one chain share every layer up to the older one
    /// (index `lo`); a block that no layer in `lo + 1 ..= hi` holds is read from the same layer
    /// of the shared part in both views, so it is equal. The union of those layers' maps is thus
    /// a superset of the changed blocks: exact when every write between them changed its block's
    /// bytes, larger by blocks rewritten with the same data (and by an unaligned write's
    /// whole block).
    ///
    /// Deleting a snapshot does not change the answer for the snapshots that remain: its fold
    /// copies only blocks the deleted layer held into its successor, so when both are inside
    /// `lo + 1 ..= hi` the union is the same set of blocks, and when the successor is the older
    /// snapshot's own layer (the deleted one was below it) the layers after it are untouched. A
    /// fold interrupted by a crash leaves both layers in the chain, the union again the same.
    /// What a fold does make unknowable is a delta against the deleted snapshot itself (or one
    /// reverted away): that base is [`StoreError::SnapshotNotFound`], and the caller falls back
    /// to everything allocated in `name` (`base` `None`) instead of guessing.
    ///
    /// A base newer than `name` answers the same way (the difference is symmetric).
    pub fn snapshot_delta(
        &self,
        base: Option<&str>,
        name: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<Extent>, StoreError> {
        let chain = read(&self.chain);
        let idx = chain.snapshot_index(name)?;
        let layers: Vec<&Layer> = match base {
            None => chain.snapshots[..=idx].iter().collect(),
            Some(base) => {
                let from = chain.snapshot_index(base)?;
                let (lo, hi) = (from.min(idx), from.max(idx));
                chain.snapshots[lo + 1..=hi].iter().collect()
            }
        };
        Self::check_range(chain.header.size, offset, len)?;
        Ok(view_extents(&layers, offset, len)
            .into_iter()
            .map(|(offset, len)| Extent { offset, len, state: ExtentState::Allocated })
            .collect())
    }

    /// Unlinks layers a committed header no longer lists. Failing here loses nothing: the file
    /// is a leftover `open` removes next time.
    fn remove_layers(&self, layers: Vec<Layer>) {
        for l in layers {
            let path = l.path.clone();
            drop(l);
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(file = %path.display(), error = %e, "could not remove a dropped replica layer");
            }
        }
        if let Err(e) = header_file::sync_dir(&self.dir) {
            tracing::warn!(error = %e, "could not sync the replica directory after removing layers");
        }
    }
}
