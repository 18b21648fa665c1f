//! Rebuilds: bringing one out-of-sync replica (the *target*) back from a healthy one (the
//! *source*). Part of the engine (`impl Engine`), kept apart because it is a state machine of its
//! own. Phases, in order, each only when needed:
//!
//! 1. **Resize**: the target is smaller than the volume (it missed an expansion): grow it first.
//! 2. **Reinitialize** (full rebuilds only): the target's snapshot chain differs from the
//!    source's, so its data and chain are dropped.
//! 3. **Snapshots** (full rebuilds only), oldest first: list the regions holding data in the
//!    source's view of the snapshot, copy them (`ReadSnapshot` → `Write`), zero the regions that
//!    held data in the previous view only (`Unmap`), then take the snapshot on the target. The
//!    target receives no client writes during these phases; its map stays full.
//! 4. **Head**: copy every region the target's map marks (`ReadExtent` → `Write`) while it
//!    receives client writes, then promote it with the next revision.
//!
//! Checkpoints make the head phase resumable: a copied region is cleared from the target's map
//! only after a `Flush` on the target that followed the copy's acknowledgment succeeded, and the
//! cleared map is persisted. So after an engine crash, or when the target or the source fails,
//! the next rebuild continues with the regions still marked — never from zero, never skipping a
//! region whose copy was not durable. An interrupted snapshot phase is not resumed: the target's
//! chain then differs from the source's and the next rebuild reinitializes it (snapshot views are
//! usually far smaller than the head, which is what the checkpoints protect).

use crate::dirty_map::DirtyMap;
use crate::protocol::{Message, Status};

use super::{
    Action, Engine, FailReason, Lock, Op, OpId, RebuildKind, ReplicaId, ReplicaState, empty_map, full_map, lock_range,
    mismatch,
};

/// Regions per `ListSnapshotExtents` request: small enough that the answer fits one frame even
/// for a fragmented snapshot, large enough to list a big volume in few round trips.
const LIST_REGIONS: u64 = 1024;

/// Where a rebuild is, for progress displays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebuildPhase {
    Resize,
    Reinitialize,
    /// Seeding snapshot `index` of `count` (0-based, oldest first).
    Snapshot {
        index: usize,
        count: usize,
    },
    Head,
}

/// Progress of the running rebuild: `done` of `total` regions of the current phase copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildStatus {
    pub replica: ReplicaId,
    pub source: ReplicaId,
    pub kind: RebuildKind,
    pub phase: RebuildPhase,
    pub done: u64,
    pub total: u64,
    pub region_size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Resize,
    Reinitialize,
    /// Listing the regions of seed `Rebuild::seed`'s view.
    List,
    /// Copying seed `Rebuild::seed`'s view.
    Seed,
    /// Taking snapshot `Rebuild::seed` on the target.
    Mark,
    Head,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CopyStage {
    Reading,
    Writing,
    Unmapping,
}

/// A rebuild request in flight.
#[derive(Debug)]
pub(super) enum RebuildOp {
    Step(Phase),
    /// Grows the target to `size`: the size sent, since the volume may grow again meanwhile.
    Grow {
        size: u64,
    },
    List {
        offset: u64,
        len: u64,
    },
    Copy {
        region: u64,
        stage: CopyStage,
    },
    Checkpoint {
        regions: Vec<u64>,
    },
}

#[derive(Debug)]
pub(super) struct Rebuild {
    pub(super) target: ReplicaId,
    pub(super) source: ReplicaId,
    kind: RebuildKind,
    phase: Phase,
    /// The source's snapshot names, oldest first (full rebuilds).
    seeds: Vec<String>,
    seed: usize,
    reinitialized: bool,
    /// Regions holding data in the view being seeded (filled by listing).
    view: DirtyMap,
    /// Regions holding data on the target after the previous seed: zeroed unless in `view`.
    seeded: DirtyMap,
    regions: Vec<u64>,
    next: usize,
    in_flight: usize,
    done: u64,
    /// Head phase: copies acknowledged but not yet covered by a checkpoint flush.
    copied: Vec<u64>,
    checkpointing: bool,
    /// Head regions cleared by checkpoints so far.
    durable: u64,
    pub(super) target_size: u64,
}

impl Engine {
    pub fn rebuild_status(&self) -> Option<RebuildStatus> {
        let b = self.rebuild.as_ref()?;
        let phase = match b.phase {
            Phase::Resize => RebuildPhase::Resize,
            Phase::Reinitialize => RebuildPhase::Reinitialize,
            Phase::List | Phase::Seed | Phase::Mark => RebuildPhase::Snapshot { index: b.seed, count: b.seeds.len() },
            Phase::Head => RebuildPhase::Head,
        };
        Some(RebuildStatus {
            replica: b.target,
            source: b.source,
            kind: b.kind,
            phase,
            done: b.done,
            total: b.regions.len() as u64,
            region_size: self.cfg.region_size,
        })
    }

    /// Bytes every rebuild of this engine copied to its targets so far (data written, not
    /// counting regions zeroed), for the rebuild counters an operator graphs.
    pub fn rebuilt_bytes(&self) -> u64 {
        self.rebuilt_bytes
    }

    pub(super) fn pump_rebuild(&mut self) {
        if self.rebuild.is_none() {
            self.start_rebuild();
        }
        // Runs on every event: the scans of every op in flight only in the resize phase.
        if self.rebuild.as_ref().is_some_and(|b| b.phase == Phase::Resize) {
            let growing = self.ops.values().any(|op| matches!(op, Op::Rebuild(RebuildOp::Grow { .. })));
            let resizing =
                self.ops.values().any(|op| matches!(op, Op::Fanout { kind: super::Fanout::Resize { .. }, .. }));
            if !growing && !resizing {
                self.after_resize();
            }
        }
        self.pump_copies();
    }

    fn start_rebuild(&mut self) {
        if self.rebuild.is_some() || self.promote.is_some() || self.revision_sync_in_flight {
            return;
        }
        let Some(target) = (0..self.replicas.len()).find(|r| self.replicas[*r] == ReplicaState::Stale) else {
            return;
        };
        // Only a healthy replica is a source: it is at the current revision by construction, and
        // the copy's ReadExtent carries that revision so the replica itself refuses otherwise.
        // A remote one is preferred so the local replica keeps serving reads undisturbed.
        let healthy = self.healthy();
        let Some(source) = healthy.iter().find(|r| !self.replica_cfg[*r].local).or(healthy.first()) else {
            return;
        };
        let names = |c: &[crate::protocol::SnapshotInfo]| c.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        let kind = if names(&self.known[target].chain) == names(&self.chain) {
            RebuildKind::Delta
        } else {
            // Everything is copied again; persisted so a crash in the middle does not forget it.
            self.missing.insert(target, full_map(self.size, self.cfg.region_size));
            self.persist();
            RebuildKind::Full
        };
        let regions = self.missing.get(&target).map_or(0, DirtyMap::count);
        tracing::info!(replica = target, source, ?kind, regions, snapshots = self.chain.len(), "rebuild started");
        self.actions.push(Action::RebuildStarted { replica: target, source, kind, regions });
        self.replicas[target] = ReplicaState::Seeding;
        let map = empty_map(self.size, self.cfg.region_size);
        self.rebuild = Some(Rebuild {
            target,
            source,
            kind,
            phase: Phase::Resize,
            seeds: names(&self.chain),
            seed: 0,
            reinitialized: false,
            view: map.clone(),
            seeded: map,
            regions: Vec::new(),
            next: 0,
            in_flight: 0,
            done: 0,
            copied: Vec::new(),
            checkpointing: false,
            durable: 0,
            target_size: self.known[target].size,
        });
        self.after_resize();
    }

    fn rebuild_mut(&mut self) -> Option<&mut Rebuild> {
        self.rebuild.as_mut()
    }

    /// Sends one step request of the rebuild to `replica`.
    fn step(&mut self, replica: ReplicaId, op: RebuildOp, message: Message) {
        let id = self.alloc_op();
        self.ops.insert(id, Op::Rebuild(op));
        self.send(replica, id, message);
    }

    fn enter(&mut self, phase: Phase) {
        let revision = self.revision;
        let Some(b) = self.rebuild_mut() else { return };
        b.phase = phase;
        b.regions.clear();
        b.next = 0;
        b.done = 0;
        let (target, source, seed) = (b.target, b.source, b.seeds.get(b.seed).cloned());
        tracing::info!(replica = target, source, ?phase, snapshot = seed.as_deref(), "rebuild phase");
        match phase {
            Phase::Resize => {
                if self.ops.values().any(|op| matches!(op, Op::Fanout { kind: super::Fanout::Resize { .. }, .. })) {
                    // A client resize is in flight and reaches this target too; sending ours now
                    // would race it. `pump_rebuild` looks again once it is done.
                    return;
                }
                let size = self.size;
                let id = self.alloc_op();
                // Locks the whole volume like a client resize: a client resize starting now
                // would race this one on the target, which refuses the smaller of the two.
                self.locks.push(Lock { op: id, start: 0, end: u64::MAX, exclusive: true });
                self.ops.insert(id, Op::Rebuild(RebuildOp::Grow { size }));
                self.send(target, id, Message::Resize { size, revision });
            }
            Phase::Reinitialize => self.step(target, RebuildOp::Step(phase), Message::Reinitialize { revision }),
            Phase::List => {
                if let Some(b) = self.rebuild_mut() {
                    b.view.clear();
                }
                self.list_from(0);
            }
            Phase::Seed => {
                let Some(b) = self.rebuild_mut() else { return };
                let mut regions = b.view.clone();
                regions.merge(&b.seeded);
                b.regions = regions.marked().collect();
                if b.regions.is_empty() {
                    self.enter(Phase::Mark);
                }
            }
            Phase::Mark => {
                let Some(name) = seed else { return };
                self.step(target, RebuildOp::Step(phase), Message::Snapshot { name, revision });
            }
            Phase::Head => {
                let needs_resize = self.rebuild.as_ref().is_some_and(|b| b.target_size < self.size);
                if needs_resize {
                    return self.enter(Phase::Resize);
                }
                // From here on the target receives every write, so nothing new gets marked for it.
                self.replicas[target] = ReplicaState::Rebuilding;
                let regions: Vec<u64> = self.missing.get(&target).map(|m| m.marked().collect()).unwrap_or_default();
                let empty = regions.is_empty();
                if let Some(b) = self.rebuild_mut() {
                    b.regions = regions;
                }
                if empty {
                    self.finish_rebuild();
                }
            }
        }
    }

    /// After the target reached the volume's size (or was large enough).
    fn after_resize(&mut self) {
        let Some(b) = self.rebuild.as_ref() else { return };
        if b.target_size < self.size {
            self.enter(Phase::Resize);
        } else if b.kind == RebuildKind::Full && !b.reinitialized {
            self.enter(Phase::Reinitialize);
        } else {
            self.enter(Phase::Head);
        }
    }

    fn list_from(&mut self, offset: u64) {
        let Some(b) = self.rebuild.as_ref() else { return };
        let (source, name) = (b.source, b.seeds.get(b.seed).cloned().unwrap_or_default());
        let len = (LIST_REGIONS * self.cfg.region_size).min(self.size - offset);
        self.step(source, RebuildOp::List { offset, len }, Message::ListSnapshotExtents { name, offset, len });
    }

    /// The next snapshot to seed, or the head phase when every snapshot is on the target.
    fn next_seed(&mut self) {
        let Some(b) = self.rebuild.as_ref() else { return };
        if b.seed < b.seeds.len() { self.enter(Phase::List) } else { self.enter(Phase::Head) }
    }

    /// Handles the answer to a rebuild request; `Err` gives the request back with the reason to
    /// fail the replica that sent the answer.
    pub(super) fn on_rebuild_reply(
        &mut self,
        op_id: OpId,
        op: RebuildOp,
        message: Message,
    ) -> Result<(), Box<(Op, FailReason)>> {
        let Some(b) = self.rebuild.as_ref() else { return Ok(()) };
        let target = b.target;
        let ok = |m: &Message| matches!(m, Message::Reply { status: Status::Ok });
        match (op, message) {
            (RebuildOp::Grow { size }, m) if ok(&m) => {
                self.unlock(op_id);
                self.known[target].size = size;
                if let Some(b) = self.rebuild_mut() {
                    b.target_size = b.target_size.max(size);
                }
                self.after_resize();
            }
            (RebuildOp::Step(Phase::Reinitialize), m) if ok(&m) => {
                self.known[target].chain.clear();
                if let Some(b) = self.rebuild_mut() {
                    b.reinitialized = true;
                    b.seeded.clear();
                    b.seed = 0;
                }
                self.next_seed();
            }
            (RebuildOp::Step(Phase::Mark), m) if ok(&m) => {
                let Some(b) = self.rebuild_mut() else { return Ok(()) };
                b.seeded = b.view.clone();
                let name = b.seeds.get(b.seed).cloned();
                b.seed += 1;
                if let Some(info) = self.chain.iter().find(|s| Some(&s.name) == name.as_ref()).cloned() {
                    self.known[target].chain.push(info);
                }
                self.next_seed();
            }
            (RebuildOp::List { offset, len }, Message::ExtentMap { status: Status::Ok, extents }) => {
                let Some(b) = self.rebuild_mut() else { return Ok(()) };
                for e in extents {
                    // Clipped to what was asked: a replica's answer never widens the copy set
                    // beyond the volume.
                    let start = e.offset.max(offset);
                    let end = e.offset.saturating_add(e.len).min(offset + len);
                    if start < end {
                        b.view.mark(start, end - start);
                    }
                }
                if offset + len < self.size {
                    self.list_from(offset + len);
                } else {
                    self.enter(Phase::Seed);
                }
            }
            (
                RebuildOp::Copy { region, stage: CopyStage::Reading },
                Message::ReadReply { status: Status::Ok, data },
            ) => {
                let (offset, len) = self.unflushed.region_range(region, self.size);
                if data.len() as u64 != len {
                    return Err(Box::new((
                        Op::Rebuild(RebuildOp::Copy { region, stage: CopyStage::Reading }),
                        FailReason::Protocol("short extent read"),
                    )));
                }
                self.ops.insert(op_id, Op::Rebuild(RebuildOp::Copy { region, stage: CopyStage::Writing }));
                self.send(target, op_id, Message::Write { offset, revision: self.revision, data: data.into() });
            }
            (RebuildOp::Copy { region, stage: stage @ (CopyStage::Writing | CopyStage::Unmapping) }, m) if ok(&m) => {
                self.unlock(op_id);
                if stage == CopyStage::Writing {
                    self.rebuilt_bytes += self.unflushed.region_range(region, self.size).1;
                }
                let Some(b) = self.rebuild_mut() else { return Ok(()) };
                b.in_flight -= 1;
                b.done += 1;
                if b.phase == Phase::Head {
                    b.copied.push(region);
                }
                self.after_copy();
            }
            (RebuildOp::Checkpoint { regions }, m) if ok(&m) => {
                let mut cleared = 0;
                if let Some(map) = self.missing.get_mut(&target) {
                    cleared = regions.iter().filter(|reg| map.clear_region(**reg)).count() as u64;
                }
                self.persist();
                let Some(b) = self.rebuild_mut() else { return Ok(()) };
                b.checkpointing = false;
                b.durable += cleared;
                let (done, total) = (b.durable, b.regions.len() as u64);
                tracing::debug!(replica = target, done, total, "rebuild checkpoint");
                self.actions.push(Action::RebuildProgress { replica: target, done, total });
                self.after_copy();
            }
            (op, m) => return Err(Box::new((Op::Rebuild(op), mismatch(&m)))),
        }
        Ok(())
    }

    /// After a copy or a checkpoint: starts a checkpoint when enough copies are waiting for one,
    /// and moves to the next phase when this one is complete.
    fn after_copy(&mut self) {
        let every = (self.unflushed.regions() / 100).max(1) as usize;
        let Some(b) = self.rebuild.as_ref() else { return };
        let all_copied = b.next >= b.regions.len() && b.in_flight == 0;
        match b.phase {
            Phase::Seed if all_copied => self.enter(Phase::Mark),
            Phase::Head => {
                if !b.checkpointing && (b.copied.len() >= every || (all_copied && !b.copied.is_empty())) {
                    let target = b.target;
                    let regions = self.rebuild_mut().map(|b| {
                        b.checkpointing = true;
                        std::mem::take(&mut b.copied)
                    });
                    // The flush comes after every copy in `regions` was acknowledged, so when it
                    // succeeds those copies are on the target's stable storage.
                    self.step(target, RebuildOp::Checkpoint { regions: regions.unwrap_or_default() }, Message::Flush);
                } else if all_copied && !b.checkpointing && b.copied.is_empty() {
                    let target = b.target;
                    if self.missing.get(&target).is_some_and(|m| !m.is_empty()) {
                        // Marked again while copying (cannot happen while the target receives
                        // every write, but never promote a replica that lacks something).
                        self.enter(Phase::Head);
                    } else {
                        self.finish_rebuild();
                    }
                }
            }
            _ => {}
        }
    }

    /// Every region is on the target: it becomes healthy with the next revision sync.
    fn finish_rebuild(&mut self) {
        let Some(b) = self.rebuild.take() else { return };
        tracing::info!(replica = b.target, source = b.source, "rebuild copied everything; promoting");
        self.promote = Some(b.target);
        self.bump_revision();
        if !self.revision_sync_in_flight && !self.locks.iter().any(|l| l.exclusive) {
            self.start_revision_sync();
        }
    }

    /// Stops the rebuild; its target goes back to waiting, still out of sync, its map holding
    /// every region not cleared by a checkpoint.
    pub(super) fn abort_rebuild(&mut self) {
        let Some(b) = self.rebuild.take() else { return };
        tracing::info!(replica = b.target, source = b.source, phase = ?b.phase, "rebuild interrupted");
        let steps: Vec<OpId> =
            self.ops.iter().filter(|(_, op)| matches!(op, Op::Rebuild(_))).map(|(id, _)| *id).collect();
        for op in steps {
            self.ops.remove(&op);
            self.unlock(op);
            self.pending.retain(|_, p| p.op != op);
        }
        if self.replicas[b.target] == ReplicaState::Rebuilding {
            // It received client writes; from now on it does not, and client flushes no longer
            // reach it, so whatever it holds only in its cache must be copied again.
            self.mark_unsettled(b.target);
            self.persist();
        }
        if matches!(self.replicas[b.target], ReplicaState::Rebuilding | ReplicaState::Seeding) {
            self.replicas[b.target] = ReplicaState::Stale;
        }
    }

    fn pump_copies(&mut self) {
        if self.revision_sync_wanted || self.revision_sync_in_flight {
            return;
        }
        loop {
            let Some(b) = self.rebuild.as_ref() else { return };
            let copying = matches!(b.phase, Phase::Seed | Phase::Head);
            if !copying || b.in_flight >= self.cfg.rebuild_parallelism.max(1) || b.next >= b.regions.len() {
                return;
            }
            let (source, target, region, phase) = (b.source, b.target, b.regions[b.next], b.phase);
            let in_view = b.view.is_marked(region);
            let name = b.seeds.get(b.seed).cloned().unwrap_or_default();
            let (offset, len) = self.unflushed.region_range(region, self.size);
            if phase == Phase::Head {
                // Client requests already queued on this region go first; the copy waits its turn.
                let queued = self.queue.iter().any(|(_, op)| {
                    let (s, e, _) = lock_range(op);
                    s < offset + len && offset < e
                });
                if queued || self.conflicts(offset, offset + len, true) {
                    return;
                }
                let id = self.alloc_op();
                self.locks.push(Lock { op: id, start: offset, end: offset + len, exclusive: true });
                // len ≤ region size; region sizes are far below 4 GiB.
                let read = Message::ReadExtent { offset, len: len as u32, revision: self.revision };
                self.ops.insert(id, Op::Rebuild(RebuildOp::Copy { region, stage: CopyStage::Reading }));
                self.send(source, id, read);
            } else {
                // Seeding: snapshot views never change and the target takes no client writes,
                // so seed copies need no lock.
                let id = self.alloc_op();
                if in_view {
                    let read = Message::ReadSnapshot { name, offset, len: len as u32 };
                    self.ops.insert(id, Op::Rebuild(RebuildOp::Copy { region, stage: CopyStage::Reading }));
                    self.send(source, id, read);
                } else {
                    let unmap = Message::Unmap { offset, len, revision: self.revision };
                    self.ops.insert(id, Op::Rebuild(RebuildOp::Copy { region, stage: CopyStage::Unmapping }));
                    self.send(target, id, unmap);
                }
            }
            if let Some(b) = self.rebuild_mut() {
                b.next += 1;
                b.in_flight += 1;
            }
        }
    }
}
