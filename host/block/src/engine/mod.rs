//! The sans-I/O replication core of one volume's engine: [`Engine::handle`] takes an [`Event`]
//! (client I/O, a frame from a replica, a connection change, a clock tick) and returns the
//! [`Action`]s a driver must carry out, in order (send a frame, answer the client, persist the
//! engine state, report a failed replica or rebuild progress). It owns the rules of the design's
//! "replicated block data path": fan-out writes and unmaps acknowledged only when every healthy
//! replica acknowledged, reads from one healthy replica (local first, then round-robin), flush on
//! every healthy replica, dropping failed replicas while ≥ 1 stays healthy, the revision that
//! keeps a stale replica from serving reads or being a rebuild source, online expansion,
//! crash-consistent snapshots, and per-replica tracking of what each out-of-sync replica lacks
//! plus the resumable rebuilds that repair it ([`rebuild`]). It does not own sockets, timers,
//! disks or the frontend, nor snapshot revert and clones: those are offline operations of the
//! control plane on a detached volume ([`crate::control`]).
//!
//! Ordering: the engine never has two conflicting operations on overlapping bytes in flight (a
//! write, an unmap or a rebuild copy excludes everything else on its range; reads share). That
//! makes the replicas apply overlapping writes in the same order even though a replica may
//! execute pipelined requests in any order, and it makes a rebuild copy and a client write on the
//! same region impossible to interleave. Resize, snapshot and snapshot deletion are *barriers*:
//! they lock the whole volume, so they start only once every write and unmap queued before them
//! finished, and everything queued after them waits until they are done. A snapshot therefore
//! holds exactly the writes issued before it, on every replica.
//!
//! Revisions: each replica's header keeps the last revision at which it was a complete member.
//! Whenever the healthy set changes the engine bumps its revision, waits until no write is in
//! flight, and records the new revision on every healthy replica (`SetRevision`) before the next
//! write starts. So a replica that missed anything always has a lower revision than the ones that
//! did not, even if the engine's persisted state is lost.
//!
//! What a replica lacks: the engine keeps one [`DirtyMap`] per out-of-sync replica (a replica
//! without an entry is in sync). A replica the engine knows nothing about gets a full map. A
//! write or unmap that does not reach an out-of-sync replica marks its map *before* any replica
//! sees it (persisted first), and a replica that fails gets everything it may not have made
//! durable marked: writes since the last flush, writes and flushes in flight.
//!
//! Snapshots: taking or deleting one requires every configured replica healthy (otherwise
//! [`IoError::Degraded`], which the caller retries after the rebuild), so the replicas' chains
//! never diverge in normal operation. A replica whose chain differs anyway (it failed during a
//! snapshot operation, or the engine crashed in the middle of one) gets a full, snapshot-aware
//! rebuild. Names already in the chain make `Snapshot` succeed at once, and names not in it make
//! `DeleteSnapshot` succeed at once (idempotent retries).
//!
//! Volume size: the engine starts from the persisted size (the configured one the first time)
//! and adopts, at attach, the size of the replicas at the newest revision. A replica that is
//! smaller is behind (it missed a resize), its rebuild first grows it; one that is larger than
//! every current replica was grown by someone else and is fenced like a revision from the future.
//!
//! After an engine restart, the replicas may hold writes of the previous engine that were never
//! flushed; attaching therefore starts with a flush of every healthy replica, and a replica that
//! fails before it completed is marked as lacking everything.
//!
//! After an *engine* crash, a write it sent but never acknowledged may have reached some replicas
//! only; they then agree on revision, size and chain but not on content. The replicas' dirty flag
//! tells the next attach that the previous session ended uncleanly; one healthy replica (local
//! first) then becomes the only source and every other replica is rebuilt from it for the
//! regions of the persisted write-intent map (marked and persisted before a write or unmap
//! reaches a region not yet in it; cleared after a flush covered the region and no write touched
//! it for a further flush interval), or the whole volume when the map is unknown (lost or old
//! state file). Until then reads come from the source only; the volume is as available as it.
//!
//! Fencing: an engine given an epoch (`EngineConfig::epoch`, from the volume's record) claims it
//! on every replica right after `Hello` and counts a replica as attached only once the claim
//! succeeded. A replica that answers `Fenced` (to the claim or to any request) says another
//! engine was given the volume: this engine is then *fenced* for good — every replica is
//! dropped, every request in flight, queued or new fails with [`IoError::Fenced`], and the driver
//! stops reconnecting. Continuing with the replicas that did not answer so (e.g. the local one,
//! cut off from the controller with this node) would let the workload write where the new
//! engine will never read.
//!
//! Not yet handled: the loss of unflushed data on a replica that crashes together with the engine.

mod attach;
mod io;
mod marking;
mod rebuild;
mod replica_set;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
mod types;

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
// Ids here are the engine's own counters, never chosen from outside, so a hash that is not
// flood-resistant is safe, and it is several times cheaper than SipHash per write.
use rustc_hash::FxHashMap;

use crate::dirty_map::DirtyMap;
use crate::protocol::{Frame, MAX_NAME_LEN, Message, PROTOCOL_VERSION, ReplicaHeader, SnapshotInfo, Status};

use io::{fanout, lock_range, mismatch, tolerated};
use marking::{empty_map, full_map};
use rebuild::{Rebuild, RebuildOp};
pub use rebuild::{RebuildPhase, RebuildStatus};
pub use replica_set::{MAX_REPLICAS, ReplicaSet};
pub use types::{
    Action, ClientId, ClientReply, EPOCH_REVISION_BITS, EngineConfig, Event, FailReason, INTENT_LINGER, IoError,
    MAX_IO, MAX_UNMAP, Millis, PersistedState, RebuildKind, ReplicaConfig, ReplicaHealth, ReplicaId,
};

#[derive(Debug, Clone, PartialEq, Eq)]
enum ReplicaState {
    /// No connection, or failed and waiting for the driver to reconnect.
    Down,
    Handshaking,
    /// Answered Hello while attaching; classified when attaching ends.
    Attached(ReplicaHeader),
    /// Connected but behind: waits for a rebuild; never read from.
    Stale,
    /// Full rebuild before the head phase (reinitialize, snapshots): receives no client writes.
    Seeding,
    /// Head phase of a rebuild: receives writes and copies; not read from, not a source, not
    /// counted for acknowledgment.
    Rebuilding,
    Healthy,
    /// Removed from the set while the engine runs ([`Event::ReplicaRemoved`]): never
    /// connected, read, written or counted again. Its index stays, so the others keep theirs.
    Retired,
}

type OpId = u64;

/// An operation sent to a set of replicas, complete when every one of them answered or failed.
#[derive(Debug)]
enum Fanout {
    /// A write, or an unmap when `data` is `None`.
    Write {
        offset: u64,
        len: u64,
        data: Option<Bytes>,
    },
    Flush {
        covered: DirtyMap,
        /// Regions touched between the previous flush's start and this one's: kept in the
        /// intent map one more interval, so a hot region does not cost a persist per flush.
        window: DirtyMap,
    },
    SetRevision {
        revision: u64,
    },
    Resize {
        size: u64,
    },
    Snapshot {
        name: String,
        created_ns: u64,
    },
    DeleteSnapshot {
        name: String,
    },
}

#[derive(Debug)]
enum Op {
    Hello,
    /// `Claim` sent after a successful `Hello`, whose header waits for the claim's answer.
    Claim(ReplicaHeader),
    Read {
        client: ClientId,
        offset: u64,
        len: u64,
    },
    Fanout {
        client: Option<ClientId>,
        kind: Fanout,
        waiting: ReplicaSet,
        acked: ReplicaSet,
    },
    Rebuild(RebuildOp),
}

#[derive(Debug)]
struct Pending {
    replica: ReplicaId,
    op: OpId,
    deadline: Millis,
}

#[derive(Debug)]
struct Lock {
    op: OpId,
    start: u64,
    end: u64,
    exclusive: bool,
}

/// What the engine last heard or learned of a replica's header: its size and snapshot chain.
#[derive(Debug, Clone, Default)]
struct Known {
    size: u64,
    chain: Vec<SnapshotInfo>,
}

/// The persisted maps (keyed by the persisting engine's indices, whose replicas `members` names)
/// keyed by this engine's indices: a map follows its replica's identity, and the map of a
/// replica that is no member any more is dropped. A state without identities (written before
/// membership could change while attached), or replicas without one, keep the indices.
fn rekey_by_identity(
    missing: BTreeMap<ReplicaId, DirtyMap>,
    members: &[String],
    replicas: &[ReplicaConfig],
) -> BTreeMap<ReplicaId, DirtyMap> {
    if members.is_empty() || replicas.iter().any(|c| c.identity.is_empty()) {
        return missing;
    }
    missing
        .into_iter()
        .filter_map(|(r, map)| {
            let who = members.get(r).filter(|who| !who.is_empty())?;
            let now = replicas.iter().position(|c| c.identity == *who)?;
            Some((now, map))
        })
        .collect()
}

/// One volume's replication state machine. See the module docs for the rules it keeps.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    /// One per replica, in replica order; replicas are added at the end and a removed one
    /// stays as [`ReplicaState::Retired`], so an index names one replica for the engine's life.
    replica_cfg: Vec<ReplicaConfig>,
    now: Millis,
    revision: u64,
    size: u64,
    attach_deadline: Millis,
    attached: bool,
    replicas: Vec<ReplicaState>,
    known: Vec<Known>,
    /// The healthy replicas' snapshot chain, oldest first.
    chain: Vec<SnapshotInfo>,
    /// Replica → regions it lacks; a replica without an entry is in sync.
    missing: BTreeMap<ReplicaId, DirtyMap>,
    /// Regions written since the last flush was issued: what a replica crash may lose.
    unflushed: DirtyMap,
    /// Write-intent map of this session (see [`PersistedState::intent`]); marked and persisted
    /// before a write or unmap reaches a region not yet in it, cleared lazily after flushes.
    intent: DirtyMap,
    /// What the previous session left in its intent map, until attaching acts on it; `None`
    /// when unknown.
    prior_intent: Option<DirtyMap>,
    /// Regions a write or unmap started or finished on since the last flush started.
    touched: DirtyMap,
    /// When each region of `intent` was last written: a region stays marked for at least
    /// [`INTENT_LINGER`] after its last write, so a workload that flushes often while writing
    /// all over the volume (a database on ext4) does not pay an fsync of the state file per write
    /// — the write-intent bitmap's lazy clearing, as in md.
    intent_touched: BTreeMap<u64, Millis>,
    next_request: u64,
    next_op: OpId,
    pending: FxHashMap<u64, Pending>,
    ops: FxHashMap<OpId, Op>,
    /// Client requests not yet started, in arrival order.
    queue: VecDeque<(OpId, Op)>,
    locks: Vec<Lock>,
    /// The revision changed and healthy replicas must learn it before the next write.
    revision_sync_wanted: bool,
    revision_sync_in_flight: bool,
    /// Rebuilt replica to make healthy with the next revision sync.
    promote: Option<ReplicaId>,
    rebuild: Option<Rebuild>,
    /// See [`Engine::rebuilt_bytes`].
    rebuilt_bytes: u64,
    round_robin: usize,
    /// A replica answered `Fenced`: final (see the module docs).
    fenced: bool,
    actions: Vec<Action>,
}

impl Engine {
    /// An engine that starts attaching to `replicas` (replica `i` is [`ReplicaId`] `i`): it
    /// waits for `ReplicaConnected` events. `persisted` is the last [`Action::Persist`] state
    /// from a previous run, if any.
    pub fn new(
        cfg: EngineConfig,
        replicas: Vec<ReplicaConfig>,
        persisted: Option<PersistedState>,
        now: Millis,
    ) -> Self {
        // A bad region size is a configuration bug; fall back to 1 MiB rather than panic.
        if DirtyMap::new(0, cfg.region_size).is_err() {
            tracing::error!(region_size = cfg.region_size, "region size is not a power of two; using 1 MiB");
        }
        let region_size = if cfg.region_size.is_power_of_two() { cfg.region_size } else { 1 << 20 };
        let (revision, size, missing, prior_intent) = match persisted {
            Some(p) => {
                let size = if p.size == 0 { cfg.size } else { p.size };
                let missing = rekey_by_identity(p.missing, &p.members, &replicas)
                    .into_iter()
                    .map(|(r, m)| {
                        // A map of another geometry says nothing reliable: that replica gets a
                        // full rebuild.
                        let fits = m.region_size() == region_size && m.regions() == size.div_ceil(region_size);
                        (r, if fits { m } else { full_map(size, region_size) })
                    })
                    .collect();
                // An intent map of another geometry cannot say which regions are suspect.
                let intent =
                    p.intent.filter(|m| m.region_size() == region_size && m.regions() == size.div_ceil(region_size));
                (p.revision, size, missing, intent)
            }
            None => (0, cfg.size, BTreeMap::new(), None),
        };
        let mut cfg = cfg;
        cfg.region_size = region_size;
        Self {
            replicas: vec![ReplicaState::Down; replicas.len()],
            known: vec![Known::default(); replicas.len()],
            replica_cfg: replicas,
            attach_deadline: now + cfg.attach_timeout,
            unflushed: empty_map(size, region_size),
            intent: empty_map(size, region_size),
            prior_intent,
            touched: empty_map(size, region_size),
            intent_touched: BTreeMap::new(),
            cfg,
            now,
            revision,
            size,
            attached: false,
            chain: Vec::new(),
            missing,
            next_request: 1,
            next_op: 1,
            pending: FxHashMap::default(),
            ops: FxHashMap::default(),
            queue: VecDeque::new(),
            locks: Vec::new(),
            revision_sync_wanted: false,
            revision_sync_in_flight: false,
            promote: None,
            rebuild: None,
            rebuilt_bytes: 0,
            round_robin: 0,
            fenced: false,
            actions: Vec::new(),
        }
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The volume's current size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn is_attached(&self) -> bool {
        self.attached
    }

    /// Another engine was given the volume: nothing this engine does will succeed again.
    pub fn is_fenced(&self) -> bool {
        self.fenced
    }

    /// Every replica's part, in configuration order.
    pub fn replica_health(&self) -> Vec<ReplicaHealth> {
        self.replica_health_iter().collect()
    }

    /// [`Self::replica_health`] without allocating, for comparing with a status already sent.
    pub fn replica_health_iter(&self) -> impl ExactSizeIterator<Item = ReplicaHealth> + '_ {
        (0..self.replicas.len()).map(|r| self.health(r))
    }

    /// One replica's part (a retired one shows as down).
    pub fn health(&self, replica: ReplicaId) -> ReplicaHealth {
        match self.replicas.get(replica) {
            Some(ReplicaState::Healthy) => ReplicaHealth::Healthy,
            Some(ReplicaState::Seeding | ReplicaState::Rebuilding) => ReplicaHealth::Rebuilding,
            Some(ReplicaState::Stale | ReplicaState::Attached(_)) => ReplicaHealth::Stale,
            Some(ReplicaState::Down | ReplicaState::Handshaking | ReplicaState::Retired) | None => ReplicaHealth::Down,
        }
    }

    /// True for a replica removed from the set (see [`Event::ReplicaRemoved`]).
    pub fn is_retired(&self, replica: ReplicaId) -> bool {
        self.replicas.get(replica) == Some(&ReplicaState::Retired)
    }

    /// The replicas of the set: every one but the retired ones.
    pub fn configured(&self) -> usize {
        self.replicas.iter().filter(|s| **s != ReplicaState::Retired).count()
    }

    pub fn is_healthy(&self, replica: ReplicaId) -> bool {
        self.replicas.get(replica) == Some(&ReplicaState::Healthy)
    }

    pub fn healthy_count(&self) -> usize {
        self.replicas.iter().filter(|s| **s == ReplicaState::Healthy).count()
    }

    /// True when nothing is queued or in flight (a quiescent point for checkers).
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.ops.is_empty() && self.rebuild.is_none() && !self.revision_sync_wanted
    }

    /// True when no client request is queued or in flight (rebuild traffic may be).
    pub fn clients_idle(&self) -> bool {
        self.queue.is_empty()
            && !self.ops.values().any(|op| matches!(op, Op::Read { .. } | Op::Fanout { client: Some(_), .. }))
    }

    /// The regions `replica` lacks; `None` when it is in sync.
    pub fn missing(&self, replica: ReplicaId) -> Option<&DirtyMap> {
        self.missing.get(&replica)
    }

    /// The volume's snapshots, oldest first.
    pub fn snapshots(&self) -> &[SnapshotInfo] {
        &self.chain
    }

    /// Feeds one event at time `now`; returns the actions to execute, in order.
    pub fn handle(&mut self, now: Millis, event: Event) -> Vec<Action> {
        let mut actions = Vec::new();
        self.handle_into(now, event, &mut actions);
        actions
    }

    /// [`Self::handle`], appending the actions to `out`: a driver that reuses one buffer saves
    /// an allocation per event (several per I/O).
    #[allow(clippy::collapsible_match, reason = "the checks answer the client; a guard would hide that side effect")]
    pub fn handle_into(&mut self, now: Millis, event: Event, out: &mut Vec<Action>) {
        self.now = self.now.max(now);
        match event {
            Event::Tick => self.on_tick(),
            Event::ReplicaConnected(r) if r < self.replicas.len() => self.on_connected(r),
            Event::ReplicaDisconnected(r) if r < self.replicas.len() => self.fail(r, FailReason::Disconnected),
            Event::ReplicaReplaced(r, disk, identity) if r < self.replicas.len() && !self.is_retired(r) => {
                self.fail(r, FailReason::Replaced);
                self.replica_cfg[r].disk = disk;
                self.replica_cfg[r].identity = identity;
                self.missing.insert(r, full_map(self.size, self.cfg.region_size));
                self.persist();
            }
            Event::Received(r, frame) if r < self.replicas.len() => self.on_frame(r, frame),
            Event::ReplicaAdded(config) => self.add_replica(config),
            Event::ReplicaRemoved(r) if r < self.replicas.len() => self.remove_replica(r),
            Event::ClientRead { client, offset, len } => {
                if self.check_range(client, offset, len, MAX_IO) {
                    self.enqueue(Op::Read { client, offset, len });
                }
            }
            Event::ClientWrite { client, offset, data } => {
                let len = data.len() as u64;
                if self.check_range(client, offset, len, MAX_IO) {
                    self.enqueue(fanout(client, Fanout::Write { offset, len, data: Some(data) }));
                }
            }
            Event::ClientUnmap { client, offset, len } => {
                if self.check_range(client, offset, len, MAX_UNMAP) {
                    self.enqueue(fanout(client, Fanout::Write { offset, len, data: None }));
                }
            }
            Event::ClientFlush { client } => {
                // Placeholders: what the flush covers is decided when it starts.
                let covered = self.unflushed.clone();
                let window = self.touched.clone();
                self.enqueue(fanout(client, Fanout::Flush { covered, window }));
            }
            Event::ClientResize { client, size } => self.enqueue(fanout(client, Fanout::Resize { size })),
            Event::ClientSnapshot { client, name, created_ns } => {
                if self.check_name(client, &name) {
                    self.enqueue(fanout(client, Fanout::Snapshot { name, created_ns }));
                }
            }
            Event::ClientDeleteSnapshot { client, name } => {
                if self.check_name(client, &name) {
                    self.enqueue(fanout(client, Fanout::DeleteSnapshot { name }));
                }
            }
            // An event for a replica that does not exist is a driver bug; ignore it.
            _ => {}
        }
        self.pump();
        out.append(&mut self.actions);
    }

    fn alloc_op(&mut self) -> OpId {
        self.next_op += 1;
        self.next_op
    }

    fn enqueue(&mut self, op: Op) {
        let id = self.alloc_op();
        self.queue.push_back((id, op));
    }

    fn volume_error(&self) -> IoError {
        if self.fenced {
            return IoError::Fenced { volume_id: self.cfg.volume_id.clone() };
        }
        IoError::NoHealthyReplica { volume_id: self.cfg.volume_id.clone() }
    }

    fn reply(&mut self, client: ClientId, result: Result<ClientReply, IoError>) {
        self.actions.push(Action::Reply { client, result });
    }

    /// Answers the client with an error and returns false when the range is not servable.
    fn check_range(&mut self, client: ClientId, offset: u64, len: u64, max: u64) -> bool {
        if len > max {
            self.reply(client, Err(IoError::TooLarge { len, max }));
            false
        } else if offset.checked_add(len).is_none_or(|end| end > self.size) {
            let e = IoError::OutOfRange { volume_id: self.cfg.volume_id.clone(), offset, len, size: self.size };
            self.reply(client, Err(e));
            false
        } else {
            true
        }
    }

    fn check_name(&mut self, client: ClientId, name: &str) -> bool {
        let ok = !name.is_empty() && name.len() <= MAX_NAME_LEN;
        if !ok {
            self.reply(client, Err(IoError::BadSnapshotName { len: name.len() }));
        }
        ok
    }

    fn send(&mut self, replica: ReplicaId, op: OpId, message: Message) {
        let request_id = self.next_request;
        self.next_request += 1;
        self.pending.insert(request_id, Pending { replica, op, deadline: self.now + self.cfg.request_timeout });
        self.actions.push(Action::Send { replica, frame: Frame { request_id, message } });
    }

    fn persist(&mut self) {
        // Before attaching has acted on the previous session's intent map, it must survive
        // another crash unchanged.
        let intent = if self.attached { Some(self.intent.clone()) } else { self.prior_intent.clone() };
        // Who each index is, so a later engine with another membership (a replica added or
        // removed meanwhile shifts the indices) finds each map's replica.
        let members = (0..self.replicas.len())
            .map(|r| if self.is_retired(r) { String::new() } else { self.replica_cfg[r].identity.clone() })
            .collect();
        self.actions.push(Action::Persist(PersistedState {
            revision: self.revision,
            size: self.size,
            missing: self.missing.clone(),
            intent,
            members,
        }));
    }

    fn healthy(&self) -> ReplicaSet {
        (0..self.replicas.len()).filter(|r| self.replicas[*r] == ReplicaState::Healthy).collect()
    }

    /// Replicas that receive writes: the healthy ones and the one in a rebuild's head phase.
    fn writable(&self) -> ReplicaSet {
        (0..self.replicas.len())
            .filter(|r| matches!(self.replicas[*r], ReplicaState::Healthy | ReplicaState::Rebuilding))
            .collect()
    }

    fn on_tick(&mut self) {
        let mut overdue: Vec<(ReplicaId, u64)> =
            self.pending.iter().filter(|(_, p)| p.deadline <= self.now).map(|(id, p)| (p.replica, *id)).collect();
        overdue.sort_unstable();
        for (replica, request_id) in overdue {
            self.fail(replica, FailReason::Timeout { request_id });
        }
        if !self.attached && self.now >= self.attach_deadline {
            self.finish_attach();
        }
    }
}
