//! The sans-I/O replication core of one volume's engine: [`Engine::handle`] takes an [`Event`]
//! (client I/O, a frame from a replica, a connection change, a clock tick) and returns the
//! [`Action`]s a driver must carry out, in order (send a frame, answer the client, persist the
//! dirty map, report a failed replica or rebuild progress). It owns the rules of the design's
//! "replicated block data path": fan-out writes acknowledged only when every healthy replica
//! acknowledged, reads from one healthy replica (local first, then round-robin), flush on every
//! healthy replica, dropping failed replicas while ≥ 1 stays healthy, the revision that keeps a
//! stale replica from serving reads or being a rebuild source, and the dirty-region tracking plus
//! region copies of delta and full rebuilds. It does not own sockets, timers, disks or the
//! frontend; nor snapshots, expansion, or reconciling replicas after an *engine* crash that left
//! unacknowledged writes on some replicas only (the header's dirty flag is carried but not yet
//! acted on).
//!
//! Ordering: the engine never has two conflicting operations on overlapping bytes in flight (a
//! write or a rebuild copy excludes everything else on its range; reads share). That makes the
//! replicas apply overlapping writes in the same order even though a replica may execute
//! pipelined requests in any order, and it makes a rebuild copy and a client write on the same
//! region impossible to interleave.
//!
//! Revisions: each replica's header keeps the last revision at which it was a complete member.
//! Whenever the healthy set changes the engine bumps its revision, waits until no write is in
//! flight, and records the new revision on every healthy replica (`SetRevision`) before the next
//! write starts. So a replica that missed anything always has a lower revision than the ones that
//! did not, even if the engine's persisted state is lost.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use thiserror::Error;

use crate::dirty::DirtyMap;
use crate::protocol::{Frame, Message, PROTOCOL_VERSION, ReplicaHeader, Status};

/// Index of a replica in [`EngineConfig::replicas`].
pub type ReplicaId = usize;
/// The driver's handle for a client request, echoed in [`Action::Reply`].
pub type ClientId = u64;
/// Milliseconds on the driver's monotonic clock; the engine only compares them.
pub type Millis = u64;

/// Largest single client read; bounded so one read fits one frame.
pub const MAX_IO: u64 = 4 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    /// On the engine's own node: preferred for reads (no network hop).
    pub local: bool,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub volume_id: String,
    pub size: u64,
    pub replicas: Vec<ReplicaConfig>,
    /// Granularity of dirty tracking and of rebuild copies (power of two, e.g. 1 MiB).
    pub region_size: u64,
    /// A replica that has not answered a request within this long is failed.
    pub request_timeout: Millis,
    /// How long attaching waits for every replica before serving with those that answered.
    pub attach_timeout: Millis,
    /// Rebuild copies in flight at once: rebuild speed against client latency.
    pub rebuild_parallelism: usize,
}

/// What the engine needs to survive its own crash: which replicas are out of sync, whether the
/// dirty map covers everything each of them missed, and the map itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersistedState {
    pub revision: u64,
    /// Replica → "a delta rebuild from `dirty` is enough" (false: full rebuild).
    pub out_of_sync: BTreeMap<ReplicaId, bool>,
    pub dirty: DirtyMap,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Advances the clock; fails replicas whose requests timed out.
    Tick,
    /// A new connection to the replica is up; the engine starts the handshake on it.
    ReplicaConnected(ReplicaId),
    ReplicaDisconnected(ReplicaId),
    /// A decoded frame from the replica's current connection.
    Received(ReplicaId, Frame),
    ClientRead {
        client: ClientId,
        offset: u64,
        len: u64,
    },
    ClientWrite {
        client: ClientId,
        offset: u64,
        data: Vec<u8>,
    },
    ClientFlush {
        client: ClientId,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientReply {
    Read(Vec<u8>),
    Written,
    Flushed,
}

/// Why a client request failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum IoError {
    #[error("no healthy replica left for volume {volume_id}")]
    NoHealthyReplica { volume_id: String },
    #[error("range {offset}+{len} is outside volume {volume_id} of {size} bytes")]
    OutOfRange { volume_id: String, offset: u64, len: u64, size: u64 },
    #[error("request of {len} bytes exceeds the {MAX_IO}-byte limit")]
    TooLarge { len: u64 },
}

/// Why a replica was dropped from the set.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum FailReason {
    #[error("connection lost")]
    Disconnected,
    #[error("request {request_id} timed out")]
    Timeout { request_id: u64 },
    #[error("replica answered {status:?}")]
    ErrorReply { status: Status },
    #[error("replica holds volume {found:?}, size {size}")]
    WrongVolume { found: String, size: u64 },
    #[error("replica revision {replica} is ahead of the engine's {engine}: another engine wrote to it")]
    RevisionAhead { replica: u64, engine: u64 },
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebuildKind {
    /// Copies only the regions in the dirty map.
    Delta,
    /// Copies every region.
    Full,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Send {
        replica: ReplicaId,
        frame: Frame,
    },
    Reply {
        client: ClientId,
        result: Result<ClientReply, IoError>,
    },
    /// The replica left the set; the driver closes its connection and reconnects later.
    ReplicaFailed {
        replica: ReplicaId,
        reason: FailReason,
    },
    /// Must be durable before the driver executes any later action of the same batch.
    Persist(PersistedState),
    RebuildStarted {
        replica: ReplicaId,
        source: ReplicaId,
        kind: RebuildKind,
        regions: u64,
    },
    RebuildProgress {
        replica: ReplicaId,
        done: u64,
        total: u64,
    },
    /// The replica is healthy again.
    RebuildFinished {
        replica: ReplicaId,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum ReplicaState {
    /// No connection, or failed and waiting for the driver to reconnect.
    Down,
    Handshaking,
    /// Answered Hello while attaching; classified when attaching ends.
    Attached(ReplicaHeader),
    /// Connected but behind: waits for a rebuild; never read from.
    Stale,
    /// Receives writes and copies; not read from, not a source, not counted for acknowledgment.
    Rebuilding,
    Healthy,
}

type OpId = u64;

#[derive(Debug)]
enum Op {
    Hello,
    Read { client: ClientId, offset: u64, len: u64 },
    Write { client: ClientId, offset: u64, data: Vec<u8>, waiting: BTreeSet<ReplicaId>, acked: BTreeSet<ReplicaId> },
    Flush { client: ClientId, waiting: BTreeSet<ReplicaId>, acked: BTreeSet<ReplicaId>, covered: DirtyMap },
    SetRevision { revision: u64, waiting: BTreeSet<ReplicaId>, acked: BTreeSet<ReplicaId> },
    Copy { region: u64, writing: bool },
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

#[derive(Debug)]
struct Rebuild {
    target: ReplicaId,
    source: ReplicaId,
    regions: Vec<u64>,
    next: usize,
    in_flight: usize,
    done: u64,
}

/// One volume's replication state machine. See the module docs for the rules it keeps.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    now: Millis,
    revision: u64,
    attach_deadline: Millis,
    attached: bool,
    replicas: Vec<ReplicaState>,
    out_of_sync: BTreeMap<ReplicaId, bool>,
    /// Regions an out-of-sync replica may have missed.
    dirty: DirtyMap,
    /// Regions written since the last flush was issued: what a replica crash may lose.
    unflushed: DirtyMap,
    next_request: u64,
    next_op: OpId,
    pending: HashMap<u64, Pending>,
    ops: HashMap<OpId, Op>,
    /// Client requests not yet started, in arrival order.
    queue: VecDeque<(OpId, Op)>,
    locks: Vec<Lock>,
    /// The revision changed and healthy replicas must learn it before the next write.
    revision_sync_wanted: bool,
    revision_sync_in_flight: bool,
    /// Rebuilt replica to make healthy with the next revision sync.
    promote: Option<ReplicaId>,
    rebuild: Option<Rebuild>,
    round_robin: usize,
    actions: Vec<Action>,
}

impl Engine {
    /// An engine that starts attaching: it waits for `ReplicaConnected` events. `persisted` is
    /// the last [`Action::Persist`] state from a previous run, if any.
    pub fn new(cfg: EngineConfig, persisted: Option<PersistedState>, now: Millis) -> Self {
        // A bad region size is a configuration bug; fall back to 1 MiB rather than panic.
        let map = DirtyMap::new(cfg.size, cfg.region_size)
            .or_else(|_| DirtyMap::new(cfg.size, 1 << 20))
            .unwrap_or_else(|_| unreachable_map());
        let (revision, out_of_sync, dirty) = match persisted {
            Some(p) if p.dirty.regions() == map.regions() => (p.revision, p.out_of_sync, p.dirty),
            // A map of another geometry (volume expanded) says nothing reliable: full rebuilds.
            Some(p) => (p.revision, p.out_of_sync.keys().map(|r| (*r, false)).collect(), map.clone()),
            None => (0, BTreeMap::new(), map.clone()),
        };
        Self {
            replicas: vec![ReplicaState::Down; cfg.replicas.len()],
            attach_deadline: now + cfg.attach_timeout,
            cfg,
            now,
            revision,
            attached: false,
            out_of_sync,
            dirty,
            unflushed: map,
            next_request: 1,
            next_op: 1,
            pending: HashMap::new(),
            ops: HashMap::new(),
            queue: VecDeque::new(),
            locks: Vec::new(),
            revision_sync_wanted: false,
            revision_sync_in_flight: false,
            promote: None,
            rebuild: None,
            round_robin: 0,
            actions: Vec::new(),
        }
    }

    pub fn revision(&self) -> u64 {
        self.revision
    }

    pub fn is_attached(&self) -> bool {
        self.attached
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

    pub fn dirty_map(&self) -> &DirtyMap {
        &self.dirty
    }

    /// Feeds one event at time `now`; returns the actions to execute, in order.
    pub fn handle(&mut self, now: Millis, event: Event) -> Vec<Action> {
        self.now = self.now.max(now);
        match event {
            Event::Tick => self.on_tick(),
            Event::ReplicaConnected(r) if r < self.replicas.len() => self.on_connected(r),
            Event::ReplicaDisconnected(r) if r < self.replicas.len() => self.fail(r, FailReason::Disconnected),
            Event::Received(r, frame) if r < self.replicas.len() => self.on_frame(r, frame),
            Event::ClientRead { client, offset, len } => {
                self.enqueue_client(client, offset, len, |client| Op::Read { client, offset, len })
            }
            Event::ClientWrite { client, offset, data } => {
                let len = data.len() as u64;
                self.enqueue_client(client, offset, len, |client| Op::Write {
                    client,
                    offset,
                    data,
                    waiting: BTreeSet::new(),
                    acked: BTreeSet::new(),
                })
            }
            Event::ClientFlush { client } => {
                // Placeholder: what the flush covers is decided when it starts.
                let covered = self.unflushed.clone();
                let id = self.alloc_op();
                self.queue
                    .push_back((id, Op::Flush { client, waiting: BTreeSet::new(), acked: BTreeSet::new(), covered }));
            }
            // An event for a replica that does not exist is a driver bug; ignore it.
            _ => {}
        }
        self.pump();
        std::mem::take(&mut self.actions)
    }

    fn alloc_op(&mut self) -> OpId {
        self.next_op += 1;
        self.next_op
    }

    fn volume_error(&self) -> IoError {
        IoError::NoHealthyReplica { volume_id: self.cfg.volume_id.clone() }
    }

    fn enqueue_client(&mut self, client: ClientId, offset: u64, len: u64, make: impl FnOnce(ClientId) -> Op) {
        if len > MAX_IO {
            self.actions.push(Action::Reply { client, result: Err(IoError::TooLarge { len }) });
        } else if offset.checked_add(len).is_none_or(|end| end > self.cfg.size) {
            let e = IoError::OutOfRange { volume_id: self.cfg.volume_id.clone(), offset, len, size: self.cfg.size };
            self.actions.push(Action::Reply { client, result: Err(e) });
        } else {
            let id = self.alloc_op();
            self.queue.push_back((id, make(client)));
        }
    }

    fn send(&mut self, replica: ReplicaId, op: OpId, message: Message) {
        let request_id = self.next_request;
        self.next_request += 1;
        self.pending.insert(request_id, Pending { replica, op, deadline: self.now + self.cfg.request_timeout });
        self.actions.push(Action::Send { replica, frame: Frame { request_id, message } });
    }

    fn persist(&mut self) {
        self.actions.push(Action::Persist(PersistedState {
            revision: self.revision,
            out_of_sync: self.out_of_sync.clone(),
            dirty: self.dirty.clone(),
        }));
    }

    fn degraded(&self) -> bool {
        self.replicas.iter().any(|s| *s != ReplicaState::Healthy)
    }

    fn healthy(&self) -> Vec<ReplicaId> {
        (0..self.replicas.len()).filter(|r| self.replicas[*r] == ReplicaState::Healthy).collect()
    }

    /// Replicas that receive writes: the healthy ones and the one being rebuilt.
    fn writable(&self) -> BTreeSet<ReplicaId> {
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

    fn on_connected(&mut self, r: ReplicaId) {
        if self.replicas[r] != ReplicaState::Down {
            // The driver saw a new connection before reporting the old one gone.
            self.fail(r, FailReason::Disconnected);
        }
        self.replicas[r] = ReplicaState::Handshaking;
        let op = self.alloc_op();
        self.ops.insert(op, Op::Hello);
        let hello = Message::Hello {
            volume_id: self.cfg.volume_id.clone(),
            protocol_version: PROTOCOL_VERSION,
            revision: self.revision,
        };
        self.send(r, op, hello);
    }

    fn on_frame(&mut self, r: ReplicaId, frame: Frame) {
        // Unknown ids are late answers to requests already written off (timed out, or sent on a
        // connection that failed): whatever they say no longer counts.
        let Some(p) = self.pending.get(&frame.request_id) else { return };
        if p.replica != r {
            return;
        }
        let op_id = p.op;
        self.pending.remove(&frame.request_id);
        let Some(op) = self.ops.remove(&op_id) else { return };
        match (op, frame.message) {
            (Op::Hello, Message::HelloReply { status: Status::Ok, header }) => self.on_hello(r, header),
            (Op::Read { client, offset, len }, Message::ReadReply { status: Status::Ok, data })
                if data.len() as u64 == len =>
            {
                let _ = offset;
                self.unlock(op_id);
                self.actions.push(Action::Reply { client, result: Ok(ClientReply::Read(data)) });
            }
            (Op::Write { client, offset, data, mut waiting, mut acked }, Message::Reply { status: Status::Ok }) => {
                waiting.remove(&r);
                acked.insert(r);
                self.ops.insert(op_id, Op::Write { client, offset, data, waiting, acked });
                self.maybe_complete(op_id);
            }
            (Op::Flush { client, mut waiting, mut acked, covered }, Message::Reply { status: Status::Ok }) => {
                waiting.remove(&r);
                acked.insert(r);
                self.ops.insert(op_id, Op::Flush { client, waiting, acked, covered });
                self.maybe_complete(op_id);
            }
            (Op::SetRevision { revision, mut waiting, mut acked }, Message::Reply { status: Status::Ok }) => {
                waiting.remove(&r);
                acked.insert(r);
                self.ops.insert(op_id, Op::SetRevision { revision, waiting, acked });
                self.maybe_complete(op_id);
            }
            (Op::Copy { region, writing: false }, Message::ReadReply { status: Status::Ok, data }) => {
                let Some(target) = self.rebuild.as_ref().map(|b| b.target) else { return };
                let (offset, len) = self.dirty.region_range(region, self.cfg.size);
                if data.len() as u64 != len {
                    self.ops.insert(op_id, Op::Copy { region, writing: false });
                    self.fail(r, FailReason::Protocol("short extent read"));
                    return;
                }
                self.ops.insert(op_id, Op::Copy { region, writing: true });
                self.send(target, op_id, Message::Write { offset, revision: self.revision, data });
            }
            (Op::Copy { writing: true, .. }, Message::Reply { status: Status::Ok }) => {
                self.unlock(op_id);
                if let Some(b) = self.rebuild.as_mut() {
                    b.in_flight -= 1;
                    b.done += 1;
                    let (replica, done, total) = (b.target, b.done, b.regions.len() as u64);
                    self.actions.push(Action::RebuildProgress { replica, done, total });
                    if done == total {
                        self.rebuild = None;
                        self.promote = Some(replica);
                        self.bump_revision();
                    }
                }
            }
            (op, message) => {
                // Put the op back so failing the replica resolves it like any other casualty.
                self.ops.insert(op_id, op);
                self.pending.insert(frame.request_id, Pending { replica: r, op: op_id, deadline: self.now });
                let reason = match message {
                    Message::Reply { status }
                    | Message::ReadReply { status, .. }
                    | Message::HelloReply { status, .. }
                    | Message::ExtentMap { status, .. }
                        if status != Status::Ok =>
                    {
                        FailReason::ErrorReply { status }
                    }
                    _ => FailReason::Protocol("reply does not match its request"),
                };
                self.fail(r, reason);
            }
        }
    }

    fn on_hello(&mut self, r: ReplicaId, header: ReplicaHeader) {
        if header.volume_id != self.cfg.volume_id || header.size != self.cfg.size {
            self.fail(r, FailReason::WrongVolume { found: header.volume_id, size: header.size });
            return;
        }
        if !self.attached {
            self.replicas[r] = ReplicaState::Attached(header);
            if self.replicas.iter().all(|s| matches!(s, ReplicaState::Attached(_))) {
                self.finish_attach();
            }
            return;
        }
        if header.revision > self.revision {
            let reason = FailReason::RevisionAhead { replica: header.revision, engine: self.revision };
            self.fail(r, reason);
            return;
        }
        // Every replica that is not healthy while serving is out of sync; one the engine has no
        // record of needs a full rebuild, whatever its header says.
        self.out_of_sync.entry(r).or_insert(false);
        self.replicas[r] = ReplicaState::Stale;
    }

    /// Decides which attached replicas are current: those at the highest revision known to the
    /// engine or any replica, and not recorded as out of sync.
    fn finish_attach(&mut self) {
        let newest = self
            .replicas
            .iter()
            .filter_map(|s| if let ReplicaState::Attached(h) = s { Some(h.revision) } else { None })
            .max();
        let Some(newest) = newest else { return };
        self.attached = true;
        self.revision = self.revision.max(newest);
        for r in 0..self.replicas.len() {
            let current = matches!(&self.replicas[r], ReplicaState::Attached(h)
                if h.revision == self.revision && !self.out_of_sync.contains_key(&r));
            self.replicas[r] = match &self.replicas[r] {
                _ if current => ReplicaState::Healthy,
                ReplicaState::Attached(_) => ReplicaState::Stale,
                other => other.clone(),
            };
            if !current {
                self.out_of_sync.entry(r).or_insert(false);
            }
        }
        if self.degraded() {
            self.bump_revision();
        }
        self.persist();
    }

    /// The healthy set changed: a new revision must reach every healthy replica before the next
    /// write, so the ones left behind are recognisably behind.
    fn bump_revision(&mut self) {
        self.revision += 1;
        self.revision_sync_wanted = true;
    }

    fn fail(&mut self, r: ReplicaId, reason: FailReason) {
        let prev = std::mem::replace(&mut self.replicas[r], ReplicaState::Down);
        if prev == ReplicaState::Down {
            return;
        }
        self.actions.push(Action::ReplicaFailed { replica: r, reason });
        if prev == ReplicaState::Healthy {
            // Everything this replica may lack: writes since the last flush (a crash loses them)
            // and writes and flushes in flight (it may not have applied them).
            self.dirty.merge(&self.unflushed);
            let mut ranges = Vec::new();
            for op in self.ops.values() {
                match op {
                    Op::Write { offset, data, .. } => ranges.push((*offset, data.len() as u64)),
                    Op::Flush { covered, .. } => {
                        self.dirty.merge(covered);
                    }
                    _ => {}
                }
            }
            for (offset, len) in ranges {
                self.dirty.mark(offset, len);
            }
            self.out_of_sync.insert(r, true);
            self.bump_revision();
            self.persist();
        }
        if self.promote == Some(r) {
            self.promote = None;
        }
        let source_or_target = self.rebuild.as_ref().is_some_and(|b| b.source == r || b.target == r);
        if source_or_target {
            self.abort_rebuild();
        }
        let mine: Vec<(u64, OpId)> =
            self.pending.iter().filter(|(_, p)| p.replica == r).map(|(id, p)| (*id, p.op)).collect();
        for (request_id, op_id) in mine {
            self.pending.remove(&request_id);
            match self.ops.get_mut(&op_id) {
                Some(Op::Hello) => {
                    self.ops.remove(&op_id);
                }
                Some(Op::Read { .. }) => {
                    if let Some(Op::Read { client, offset, len }) = self.ops.remove(&op_id) {
                        self.unlock(op_id);
                        // Retried like a new read, at the front so it keeps its place.
                        self.queue.push_front((op_id, Op::Read { client, offset, len }));
                    }
                }
                Some(Op::Write { waiting, .. } | Op::Flush { waiting, .. } | Op::SetRevision { waiting, .. }) => {
                    waiting.remove(&r);
                    self.maybe_complete(op_id);
                }
                Some(Op::Copy { .. }) | None => {}
            }
        }
    }

    /// Stops the rebuild; its target goes back to waiting (still out of sync, map intact).
    fn abort_rebuild(&mut self) {
        let Some(b) = self.rebuild.take() else { return };
        let copies: Vec<OpId> =
            self.ops.iter().filter(|(_, op)| matches!(op, Op::Copy { .. })).map(|(id, _)| *id).collect();
        for op in copies {
            self.ops.remove(&op);
            self.unlock(op);
            self.pending.retain(|_, p| p.op != op);
        }
        if self.replicas[b.target] == ReplicaState::Rebuilding {
            self.replicas[b.target] = ReplicaState::Stale;
        }
    }

    fn maybe_complete(&mut self, op_id: OpId) {
        let done = match self.ops.get(&op_id) {
            Some(Op::Write { waiting, .. } | Op::Flush { waiting, .. } | Op::SetRevision { waiting, .. }) => {
                waiting.is_empty()
            }
            _ => false,
        };
        if !done {
            return;
        }
        let Some(op) = self.ops.remove(&op_id) else { return };
        // Success needs an acknowledgment from a replica that is still healthy now: one that
        // acknowledged and then failed may have lost the data.
        let any_healthy = |acked: &BTreeSet<ReplicaId>, replicas: &[ReplicaState]| {
            acked.iter().any(|r| replicas[*r] == ReplicaState::Healthy)
        };
        match op {
            Op::Write { client, offset, data, acked, .. } => {
                self.unlock(op_id);
                let result = if any_healthy(&acked, &self.replicas) {
                    self.unflushed.mark(offset, data.len() as u64);
                    Ok(ClientReply::Written)
                } else {
                    Err(self.volume_error())
                };
                self.actions.push(Action::Reply { client, result });
            }
            Op::Flush { client, acked, .. } => {
                let result = if any_healthy(&acked, &self.replicas) {
                    Ok(ClientReply::Flushed)
                } else {
                    Err(self.volume_error())
                };
                self.actions.push(Action::Reply { client, result });
            }
            Op::SetRevision { revision, acked, .. } => {
                self.revision_sync_in_flight = false;
                if let Some(t) = self.promote
                    && revision == self.revision
                    && acked.contains(&t)
                    && self.replicas[t] == ReplicaState::Rebuilding
                {
                    self.promote = None;
                    self.replicas[t] = ReplicaState::Healthy;
                    self.out_of_sync.remove(&t);
                    if self.out_of_sync.is_empty() {
                        self.dirty.clear();
                    }
                    self.persist();
                    self.actions.push(Action::RebuildFinished { replica: t });
                }
            }
            _ => {}
        }
    }

    fn unlock(&mut self, op: OpId) {
        self.locks.retain(|l| l.op != op);
    }

    fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        start < end && self.locks.iter().any(|l| l.start < end && start < l.end && (exclusive || l.exclusive))
    }

    /// Starts whatever can start: a pending revision sync, queued client requests whose range
    /// is free, and rebuild copies.
    fn pump(&mut self) {
        if !self.attached {
            return;
        }
        let writes_in_flight = self.locks.iter().any(|l| l.exclusive);
        if self.revision_sync_wanted && !self.revision_sync_in_flight && !writes_in_flight {
            self.start_revision_sync();
        }
        let mut i = 0;
        let mut waiting: Vec<(u64, u64, bool)> = Vec::new();
        while i < self.queue.len() {
            let (start, end, exclusive) = match &self.queue[i].1 {
                Op::Read { offset, len, .. } => (*offset, offset + len, false),
                Op::Write { offset, data, .. } => (*offset, offset + data.len() as u64, true),
                _ => (0, 0, false),
            };
            let barred = exclusive && (self.revision_sync_wanted || self.revision_sync_in_flight);
            let behind = waiting.iter().any(|(s, e, x)| *s < end && start < *e && (exclusive || *x));
            if barred || behind || self.conflicts(start, end, exclusive) {
                waiting.push((start, end, exclusive));
                i += 1;
                continue;
            }
            if let Some((id, op)) = self.queue.remove(i) {
                if start < end {
                    self.locks.push(Lock { op: id, start, end, exclusive });
                }
                self.start(id, op);
            }
        }
        self.start_rebuild();
        self.pump_copies();
    }

    fn start_revision_sync(&mut self) {
        self.revision_sync_wanted = false;
        let mut targets: BTreeSet<ReplicaId> = self.healthy().into_iter().collect();
        if let Some(t) = self.promote
            && self.replicas[t] == ReplicaState::Rebuilding
        {
            targets.insert(t);
        }
        if targets.is_empty() {
            return;
        }
        self.revision_sync_in_flight = true;
        let op = self.alloc_op();
        let revision = self.revision;
        self.ops.insert(op, Op::SetRevision { revision, waiting: targets.clone(), acked: BTreeSet::new() });
        for r in targets {
            self.send(r, op, Message::SetRevision { revision });
        }
    }

    fn start(&mut self, id: OpId, op: Op) {
        match op {
            Op::Read { client, offset, len } => {
                let healthy = self.healthy();
                let local = healthy.iter().copied().find(|r| self.cfg.replicas[*r].local);
                let Some(r) = local.or_else(|| {
                    self.round_robin = self.round_robin.wrapping_add(1);
                    healthy.get(self.round_robin % healthy.len().max(1)).copied()
                }) else {
                    self.unlock(id);
                    self.actions.push(Action::Reply { client, result: Err(self.volume_error()) });
                    return;
                };
                self.ops.insert(id, Op::Read { client, offset, len });
                // len ≤ MAX_IO, checked on arrival.
                self.send(r, id, Message::Read { offset, len: len as u32 });
            }
            Op::Write { client, offset, data, .. } => {
                if self.healthy_count() == 0 {
                    self.unlock(id);
                    self.actions.push(Action::Reply { client, result: Err(self.volume_error()) });
                    return;
                }
                // Marked before any replica sees the write: if the engine crashes right after
                // sending, the persisted map already covers what the missing replicas lack.
                if self.degraded() && self.dirty.mark(offset, data.len() as u64) {
                    self.persist();
                }
                let targets = self.writable();
                for r in &targets {
                    let message = Message::Write { offset, revision: self.revision, data: data.clone() };
                    self.send(*r, id, message);
                }
                self.ops.insert(id, Op::Write { client, offset, data, waiting: targets, acked: BTreeSet::new() });
            }
            Op::Flush { client, .. } => {
                if self.healthy_count() == 0 {
                    self.actions.push(Action::Reply { client, result: Err(self.volume_error()) });
                    return;
                }
                // Writes completed before now are covered by this flush; later ones are not.
                let covered = self.unflushed.clone();
                self.unflushed.clear();
                let targets = self.writable();
                for r in &targets {
                    self.send(*r, id, Message::Flush);
                }
                self.ops.insert(id, Op::Flush { client, waiting: targets, acked: BTreeSet::new(), covered });
            }
            other => {
                self.ops.insert(id, other);
            }
        }
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
        let healthy = self.healthy();
        let Some(source) = healthy.iter().copied().find(|r| !self.cfg.replicas[*r].local).or(healthy.first().copied())
        else {
            return;
        };
        let (kind, regions): (RebuildKind, Vec<u64>) = if self.out_of_sync.get(&target) == Some(&true) {
            (RebuildKind::Delta, self.dirty.marked().collect())
        } else {
            (RebuildKind::Full, (0..self.dirty.regions()).collect())
        };
        self.replicas[target] = ReplicaState::Rebuilding;
        self.actions.push(Action::RebuildStarted { replica: target, source, kind, regions: regions.len() as u64 });
        let empty = regions.is_empty();
        self.rebuild = Some(Rebuild { target, source, regions, next: 0, in_flight: 0, done: 0 });
        if empty {
            self.rebuild = None;
            self.promote = Some(target);
            self.bump_revision();
            self.start_revision_sync_if_free();
        }
    }

    fn start_revision_sync_if_free(&mut self) {
        if !self.revision_sync_in_flight && !self.locks.iter().any(|l| l.exclusive) {
            self.start_revision_sync();
        }
    }

    fn pump_copies(&mut self) {
        if self.revision_sync_wanted || self.revision_sync_in_flight {
            return;
        }
        loop {
            let Some(b) = self.rebuild.as_ref() else { return };
            if b.in_flight >= self.cfg.rebuild_parallelism.max(1) || b.next >= b.regions.len() {
                return;
            }
            let (source, region) = (b.source, b.regions[b.next]);
            let (offset, len) = self.dirty.region_range(region, self.cfg.size);
            // Client requests already queued on this region go first; the copy waits its turn.
            let queued = self.queue.iter().any(|(_, op)| match op {
                Op::Read { offset: o, len: l, .. } => *o < offset + len && offset < o + l,
                Op::Write { offset: o, data, .. } => *o < offset + len && offset < o + data.len() as u64,
                _ => false,
            });
            if queued || self.conflicts(offset, offset + len, true) {
                return;
            }
            let id = self.alloc_op();
            if let Some(b) = self.rebuild.as_mut() {
                b.next += 1;
                b.in_flight += 1;
            }
            self.locks.push(Lock { op: id, start: offset, end: offset + len, exclusive: true });
            self.ops.insert(id, Op::Copy { region, writing: false });
            // len ≤ region size; region sizes are far below 4 GiB.
            self.send(source, id, Message::ReadExtent { offset, len: len as u32, revision: self.revision });
        }
    }
}

/// `DirtyMap::new` only fails for a region size that is not a power of two, and 1 MiB is one.
fn unreachable_map() -> DirtyMap {
    match DirtyMap::new(0, 1) {
        Ok(m) => m,
        Err(_) => unreachable!("1 is a power of two"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u64 = 1 << 20;

    fn config(locals: &[bool]) -> EngineConfig {
        EngineConfig {
            volume_id: "vol".into(),
            size: SIZE,
            replicas: locals.iter().map(|l| ReplicaConfig { local: *l }).collect(),
            region_size: 64 * 1024,
            request_timeout: 100,
            attach_timeout: 1000,
            rebuild_parallelism: 4,
        }
    }

    fn header(revision: u64) -> ReplicaHeader {
        ReplicaHeader { volume_id: "vol".into(), size: SIZE, revision, snapshots: vec![], dirty: false }
    }

    fn sends(actions: &[Action]) -> Vec<(ReplicaId, Frame)> {
        actions
            .iter()
            .filter_map(
                |a| if let Action::Send { replica, frame } = a { Some((*replica, frame.clone())) } else { None },
            )
            .collect()
    }

    fn ok(id: u64) -> Frame {
        Frame { request_id: id, message: Message::Reply { status: Status::Ok } }
    }

    /// Attaches an engine whose replicas report the given revisions.
    fn attached(locals: &[bool], revisions: &[u64]) -> (Engine, Vec<Action>) {
        let mut e = Engine::new(config(locals), None, 0);
        let mut out = Vec::new();
        for (r, rev) in revisions.iter().enumerate() {
            let hello = sends(&e.handle(0, Event::ReplicaConnected(r)));
            let reply = Message::HelloReply { status: Status::Ok, header: header(*rev) };
            out = e.handle(0, Event::Received(r, Frame { request_id: hello[0].1.request_id, message: reply }));
        }
        assert!(e.is_attached());
        (e, out)
    }

    #[test]
    fn write_is_acknowledged_only_after_every_healthy_replica_acknowledged() {
        let (mut e, _) = attached(&[false, false], &[3, 3]);
        let out = sends(&e.handle(1, Event::ClientWrite { client: 9, offset: 0, data: vec![1; 512] }));
        assert_eq!(out.len(), 2, "fans out to both replicas");
        assert!(e.handle(2, Event::Received(out[0].0, ok(out[0].1.request_id))).is_empty());
        let done = e.handle(3, Event::Received(out[1].0, ok(out[1].1.request_id)));
        assert_eq!(done, vec![Action::Reply { client: 9, result: Ok(ClientReply::Written) }]);
    }

    #[test]
    fn failed_replica_is_dropped_and_writes_continue_degraded_with_the_region_marked_dirty() {
        let (mut e, _) = attached(&[false, false], &[3, 3]);
        let out = sends(&e.handle(1, Event::ClientWrite { client: 1, offset: 0, data: vec![1; 512] }));
        e.handle(2, Event::Received(0, ok(out[0].1.request_id)));
        // Replica 1 never answers: the timeout drops it and the write completes on replica 0.
        let actions = e.handle(200, Event::Tick);
        assert!(matches!(actions[0], Action::ReplicaFailed { replica: 1, reason: FailReason::Timeout { .. } }));
        let persist = actions.iter().position(|a| matches!(a, Action::Persist(_)));
        let reply = actions.iter().position(|a| matches!(a, Action::Reply { result: Ok(_), .. }));
        assert!(persist < reply, "the dirty map is persisted before the client hears of the write");
        assert!(e.dirty_map().is_marked(0));
        assert_eq!(e.revision(), 4, "a replica set change bumps the revision");
        // The new revision reaches the healthy replica before any further write.
        let sync = sends(&actions);
        assert_eq!(
            sync,
            vec![(0, Frame { request_id: sync[0].1.request_id, message: Message::SetRevision { revision: 4 } })]
        );
        let queued = e.handle(201, Event::ClientWrite { client: 2, offset: 1 << 19, data: vec![2; 10] });
        assert!(sends(&queued).is_empty(), "writes wait for the revision to be recorded");
        let released = sends(&e.handle(202, Event::Received(0, ok(sync[0].1.request_id))));
        assert_eq!(released.len(), 1);
        assert!(matches!(released[0].1.message, Message::Write { revision: 4, .. }));
        assert!(e.dirty_map().is_marked(8), "degraded writes are tracked for the delta rebuild");
    }

    #[test]
    fn client_io_fails_when_no_healthy_replica_remains() {
        let (mut e, _) = attached(&[false], &[1]);
        e.handle(1, Event::ReplicaDisconnected(0));
        let read = e.handle(2, Event::ClientRead { client: 5, offset: 0, len: 10 });
        assert!(matches!(&read[..], [Action::Reply { client: 5, result: Err(IoError::NoHealthyReplica { .. }) }]));
        let write = e.handle(3, Event::ClientWrite { client: 6, offset: 0, data: vec![0; 4] });
        assert!(matches!(&write[..], [Action::Reply { client: 6, result: Err(IoError::NoHealthyReplica { .. }) }]));
    }

    #[test]
    fn reads_go_to_the_local_replica_when_it_is_healthy() {
        let (mut e, _) = attached(&[false, true, false], &[1, 1, 1]);
        for c in 0..5 {
            let out = sends(&e.handle(1, Event::ClientRead { client: c, offset: c * 100, len: 10 }));
            assert_eq!(out[0].0, 1);
        }
    }

    #[test]
    fn reads_spread_round_robin_without_a_local_replica() {
        let (mut e, _) = attached(&[false, false], &[1, 1]);
        let targets: BTreeSet<ReplicaId> = (0..4)
            .map(|c| sends(&e.handle(1, Event::ClientRead { client: c, offset: c * 100, len: 10 }))[0].0)
            .collect();
        assert_eq!(targets.len(), 2);
    }

    #[test]
    fn replica_behind_at_attach_is_never_read_and_gets_a_full_rebuild_from_a_current_one() {
        let (mut e, attach) = attached(&[true, false], &[2, 5]);
        assert!(!e.is_healthy(0) && e.is_healthy(1));
        let sync = sends(&attach);
        assert_eq!(sync.len(), 1, "only the current replica learns the new revision");
        let after = e.handle(1, Event::Received(1, ok(sync[0].1.request_id)));
        assert!(after.contains(&Action::RebuildStarted {
            replica: 0,
            source: 1,
            kind: RebuildKind::Full,
            regions: 16
        }));
        for (r, f) in sends(&after) {
            assert_eq!(r, 1, "copies read from the current replica only: {f:?}");
            assert!(matches!(f.message, Message::ReadExtent { revision: 6, .. }));
        }
        // Even though replica 0 is local, reads avoid it while it is behind.
        let read = sends(&e.handle(2, Event::ClientRead { client: 1, offset: SIZE - 10, len: 10 }));
        assert_eq!(read[0].0, 1);
    }

    #[test]
    fn replica_whose_revision_is_ahead_of_the_engine_is_refused() {
        let (mut e, _) = attached(&[false, false], &[3, 3]);
        e.handle(1, Event::ReplicaDisconnected(1));
        let hello = sends(&e.handle(2, Event::ReplicaConnected(1)));
        let reply = Message::HelloReply { status: Status::Ok, header: header(99) };
        let out = e.handle(3, Event::Received(1, Frame { request_id: hello[0].1.request_id, message: reply }));
        assert!(matches!(out[0], Action::ReplicaFailed { replica: 1, reason: FailReason::RevisionAhead { .. } }));
    }

    #[test]
    fn out_of_range_and_oversized_requests_are_refused_without_touching_replicas() {
        let (mut e, _) = attached(&[false], &[1]);
        let out = e.handle(1, Event::ClientRead { client: 1, offset: SIZE - 1, len: 2 });
        assert!(matches!(&out[..], [Action::Reply { result: Err(IoError::OutOfRange { .. }), .. }]));
        let out = e.handle(1, Event::ClientRead { client: 2, offset: 0, len: MAX_IO + 1 });
        assert!(matches!(&out[..], [Action::Reply { result: Err(IoError::TooLarge { .. }), .. }]));
    }
}
