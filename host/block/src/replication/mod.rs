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
//! disks or the frontend, nor snapshot revert and clones (the protocol has `Revert`; nothing here
//! sends it yet).
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

mod rebuild;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use bytes::Bytes;
use thiserror::Error;

use crate::dirty::DirtyMap;
use crate::protocol::{Frame, MAX_NAME_LEN, Message, PROTOCOL_VERSION, ReplicaHeader, SnapshotInfo, Status};

use rebuild::{Rebuild, RebuildOp};
pub use rebuild::{RebuildPhase, RebuildStatus};

/// Index of a replica in [`EngineConfig::replicas`].
pub type ReplicaId = usize;
/// The driver's handle for a client request, echoed in [`Action::Reply`].
pub type ClientId = u64;
/// Milliseconds on the driver's monotonic clock; the engine only compares them.
pub type Millis = u64;

/// Minimum time a region stays in the write-intent map after its last write (see
/// `Engine::intent_touched`): bounds the state-file fsyncs of a write+flush workload to about one
/// per region per this interval, at the price of resyncing regions written in the last few
/// seconds after an engine crash.
pub const INTENT_LINGER: Millis = 5_000;

/// Revisions are counted per epoch: the engine given epoch E counts from `E <<
/// EPOCH_REVISION_BITS`, so every revision a newer owner writes is above every revision an older
/// one could have counted — also on a replica the older engine kept writing to after it was cut
/// off with it (split brain). Without this, that replica could hold the highest revision and be
/// taken as the only current one by the next attach. 2^32 healthy-set changes per epoch is more
/// than a volume sees; epoch 0 (engines started by hand, no claim) counts from 0 as before.
pub const EPOCH_REVISION_BITS: u32 = 32;

/// Largest single client read or write; bounded so one request fits one frame.
pub const MAX_IO: u64 = 4 * 1024 * 1024;
/// Largest single client unmap. An unmap locks its range like a write; bounding it keeps one
/// large discard from stalling every other request on the volume until all replicas punched it.
pub const MAX_UNMAP: u64 = 64 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    /// On the engine's own node: preferred for reads (no network hop).
    pub local: bool,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub volume_id: String,
    /// Initial size; after the first attach the persisted and the replicas' sizes win.
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
    /// The epoch to claim on every replica after `Hello` (see the module docs); 0 claims
    /// nothing (a volume without a record, driven by hand).
    pub epoch: u64,
}

/// What the engine needs to survive its own crash: the volume's size and, for every replica
/// that is out of sync, the regions it lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersistedState {
    pub revision: u64,
    /// The size the maps cover; 0 when unknown (a state written before expansion existed).
    pub size: u64,
    /// Replica → regions it lacks. A replica without an entry is in sync.
    pub missing: BTreeMap<ReplicaId, DirtyMap>,
    /// Write-intent map: every region a write or unmap may have been sent to without being
    /// flushed on every replica yet. After an unclean end only these regions can differ between
    /// replicas that otherwise agree. `None` when unknown (a state written before intent maps
    /// existed): an unclean end then resyncs everything.
    pub intent: Option<DirtyMap>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Advances the clock; fails replicas whose requests timed out.
    Tick,
    /// A new connection to the replica is up; the engine starts the handshake on it.
    ReplicaConnected(ReplicaId),
    ReplicaDisconnected(ReplicaId),
    /// The replica now lives elsewhere (a new, empty replica on another server): whatever the
    /// old one held counts for nothing, and the new one gets a full rebuild.
    ReplicaReplaced(ReplicaId),
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
        /// Shared with every replica's `Write`, never copied per replica.
        data: Bytes,
    },
    ClientFlush {
        client: ClientId,
    },
    /// Discards `[offset, offset + len)` (at most [`MAX_UNMAP`]); it then reads as zeros.
    ClientUnmap {
        client: ClientId,
        offset: u64,
        len: u64,
    },
    /// Grows the volume online; a smaller size is refused, the same size succeeds.
    ClientResize {
        client: ClientId,
        size: u64,
    },
    /// Takes a crash-consistent snapshot on every replica. `created_ns` is the driver's wall
    /// clock (the engine has none); replicas stamp their own, which the next attach reads back.
    ClientSnapshot {
        client: ClientId,
        name: String,
        created_ns: u64,
    },
    ClientDeleteSnapshot {
        client: ClientId,
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientReply {
    Read(Vec<u8>),
    Written,
    Flushed,
    Unmapped,
    Resized,
    SnapshotTaken,
    SnapshotDeleted,
}

/// Why a client request failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum IoError {
    #[error("no healthy replica left for volume {volume_id}")]
    NoHealthyReplica { volume_id: String },
    #[error("range {offset}+{len} is outside volume {volume_id} of {size} bytes")]
    OutOfRange { volume_id: String, offset: u64, len: u64, size: u64 },
    #[error("request of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: u64, max: u64 },
    /// Retry once every replica is healthy again (after its rebuild).
    #[error("volume {volume_id} is degraded ({healthy} of {configured} replicas healthy); {what} needs all of them")]
    Degraded { volume_id: String, healthy: usize, configured: usize, what: &'static str },
    #[error("volume {volume_id} cannot shrink from {size} to {requested} bytes")]
    Shrink { volume_id: String, size: u64, requested: u64 },
    #[error("snapshot name of {len} bytes is empty or longer than {MAX_NAME_LEN}")]
    BadSnapshotName { len: usize },
    /// Another engine was given the volume (a newer epoch on a replica); final.
    #[error("volume {volume_id} was given to another engine; this one is fenced")]
    Fenced { volume_id: String },
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
    #[error("replica holds volume {found:?}")]
    WrongVolume { found: String },
    #[error("replica revision {replica} is ahead of the engine's {engine}: another engine wrote to it")]
    RevisionAhead { replica: u64, engine: u64 },
    #[error("replica size {replica} is larger than the volume's {engine}: another engine grew it")]
    SizeAhead { replica: u64, engine: u64 },
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
    #[error("replaced by a new replica")]
    Replaced,
    #[error("the engine is fenced: another engine was given the volume")]
    Fenced,
}

/// One replica's part in the volume, as operators and the control plane see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaHealth {
    /// In sync: serves reads and counts for acknowledgments.
    Healthy,
    /// The target of the running rebuild.
    Rebuilding,
    /// Connected but behind, waiting for its rebuild.
    Stale,
    /// Not connected (or still saying hello).
    Down,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebuildKind {
    /// The target's snapshot chain equals the source's: copies only the regions it lacks.
    Delta,
    /// The chains differ: reinitializes the target, seeds every snapshot, then copies the head.
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
    /// Emitted at every checkpoint of the head phase: `done` regions of `total` are durable.
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
    /// Full rebuild before the head phase (reinitialize, snapshots): receives no client writes.
    Seeding,
    /// Head phase of a rebuild: receives writes and copies; not read from, not a source, not
    /// counted for acknowledgment.
    Rebuilding,
    Healthy,
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
        waiting: BTreeSet<ReplicaId>,
        acked: BTreeSet<ReplicaId>,
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

/// One volume's replication state machine. See the module docs for the rules it keeps.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
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
    /// See [`Engine::rebuilt_bytes`].
    rebuilt_bytes: u64,
    round_robin: usize,
    /// A replica answered `Fenced`: final (see the module docs).
    fenced: bool,
    actions: Vec<Action>,
}

impl Engine {
    /// An engine that starts attaching: it waits for `ReplicaConnected` events. `persisted` is
    /// the last [`Action::Persist`] state from a previous run, if any.
    pub fn new(cfg: EngineConfig, persisted: Option<PersistedState>, now: Millis) -> Self {
        // A bad region size is a configuration bug; fall back to 1 MiB rather than panic.
        if DirtyMap::new(0, cfg.region_size).is_err() {
            tracing::error!(region_size = cfg.region_size, "region size is not a power of two; using 1 MiB");
        }
        let region_size = if cfg.region_size.is_power_of_two() { cfg.region_size } else { 1 << 20 };
        let (revision, size, missing, prior_intent) = match persisted {
            Some(p) => {
                let size = if p.size == 0 { cfg.size } else { p.size };
                let missing = p
                    .missing
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
            replicas: vec![ReplicaState::Down; cfg.replicas.len()],
            known: vec![Known::default(); cfg.replicas.len()],
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
            pending: HashMap::new(),
            ops: HashMap::new(),
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
        self.replicas
            .iter()
            .map(|s| match s {
                ReplicaState::Healthy => ReplicaHealth::Healthy,
                ReplicaState::Seeding | ReplicaState::Rebuilding => ReplicaHealth::Rebuilding,
                ReplicaState::Stale | ReplicaState::Attached(_) => ReplicaHealth::Stale,
                ReplicaState::Down | ReplicaState::Handshaking => ReplicaHealth::Down,
            })
            .collect()
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
    #[allow(clippy::collapsible_match, reason = "the checks answer the client; a guard would hide that side effect")]
    pub fn handle(&mut self, now: Millis, event: Event) -> Vec<Action> {
        self.now = self.now.max(now);
        match event {
            Event::Tick => self.on_tick(),
            Event::ReplicaConnected(r) if r < self.replicas.len() => self.on_connected(r),
            Event::ReplicaDisconnected(r) if r < self.replicas.len() => self.fail(r, FailReason::Disconnected),
            Event::ReplicaReplaced(r) if r < self.replicas.len() => {
                self.fail(r, FailReason::Replaced);
                self.missing.insert(r, full_map(self.size, self.cfg.region_size));
                self.persist();
            }
            Event::Received(r, frame) if r < self.replicas.len() => self.on_frame(r, frame),
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
        std::mem::take(&mut self.actions)
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
        self.actions.push(Action::Persist(PersistedState {
            revision: self.revision,
            size: self.size,
            missing: self.missing.clone(),
            intent,
        }));
    }

    fn healthy(&self) -> Vec<ReplicaId> {
        (0..self.replicas.len()).filter(|r| self.replicas[*r] == ReplicaState::Healthy).collect()
    }

    /// Replicas that receive writes: the healthy ones and the one in a rebuild's head phase.
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
        if self.fenced {
            // The driver raced the fence; this engine never talks to a replica again.
            self.actions.push(Action::ReplicaFailed { replica: r, reason: FailReason::Fenced });
            return;
        }
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
        let op_and_reason = match (op, frame.message) {
            (Op::Hello, Message::HelloReply { status: Status::Ok, header }) if self.cfg.epoch > 0 => {
                self.ops.insert(op_id, Op::Claim(header));
                return self.send(r, op_id, Message::Claim { epoch: self.cfg.epoch });
            }
            (Op::Hello, Message::HelloReply { status: Status::Ok, header }) => return self.on_hello(r, header),
            (Op::Claim(header), Message::Reply { status: Status::Ok }) => return self.on_hello(r, header),
            (Op::Read { client, len, .. }, Message::ReadReply { status: Status::Ok, data })
                if data.len() as u64 == len =>
            {
                self.unlock(op_id);
                return self.reply(client, Ok(ClientReply::Read(data)));
            }
            (Op::Fanout { client, kind, mut waiting, mut acked }, Message::Reply { status })
                if status == Status::Ok || tolerated(&kind, status) =>
            {
                waiting.remove(&r);
                acked.insert(r);
                self.ops.insert(op_id, Op::Fanout { client, kind, waiting, acked });
                return self.maybe_complete(op_id);
            }
            (Op::Rebuild(step), message) => match self.on_rebuild_reply(op_id, step, message) {
                Ok(()) => return,
                Err(given_back) => *given_back,
            },
            (op, message) => (op, mismatch(&message)),
        };
        // Put the op back so failing the replica resolves it like any other casualty.
        let (op, reason) = op_and_reason;
        self.ops.insert(op_id, op);
        self.pending.insert(frame.request_id, Pending { replica: r, op: op_id, deadline: self.now });
        if reason == (FailReason::ErrorReply { status: Status::Fenced }) {
            return self.fence();
        }
        self.fail(r, reason);
    }

    /// A replica said another engine holds the volume: drop every replica and fail everything
    /// (see the module docs).
    fn fence(&mut self) {
        if !self.fenced {
            tracing::error!(volume = %self.cfg.volume_id, "fenced: another engine was given the volume; failing all I/O");
        }
        self.fenced = true;
        self.abort_rebuild();
        for r in 0..self.replicas.len() {
            self.fail(r, FailReason::Fenced);
        }
        // Not attached yet: nothing else would ever answer what waits.
        self.attached = true;
    }

    fn on_hello(&mut self, r: ReplicaId, header: ReplicaHeader) {
        if header.volume_id != self.cfg.volume_id {
            self.fail(r, FailReason::WrongVolume { found: header.volume_id });
            return;
        }
        self.known[r] = Known { size: header.size, chain: header.snapshots.clone() };
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
        if header.size > self.size {
            self.fail(r, FailReason::SizeAhead { replica: header.size, engine: self.size });
            return;
        }
        // Every replica that is not healthy while serving is out of sync; one the engine has no
        // record of needs everything copied, whatever its header says.
        let full = full_map(self.size, self.cfg.region_size);
        self.missing.entry(r).or_insert(full);
        self.replicas[r] = ReplicaState::Stale;
    }

    /// Decides which attached replicas are current: those at the highest revision known to the
    /// engine or any replica, not recorded as out of sync, as large as the largest of those and
    /// with the same snapshot chain as the first of them.
    fn finish_attach(&mut self) {
        let attached: Vec<(ReplicaId, ReplicaHeader)> = (0..self.replicas.len())
            .filter_map(|r| if let ReplicaState::Attached(h) = &self.replicas[r] { Some((r, h.clone())) } else { None })
            .collect();
        let Some(newest) = attached.iter().map(|(_, h)| h.revision).max() else { return };
        self.attached = true;
        // Current means at the newest revision *any replica* holds, not the persisted one: the
        // engine persists a bumped revision before the replicas learn it, and writes wait for
        // them to learn it, so a crash in between leaves the current replicas one behind.
        self.revision = self.revision.max(newest);
        let candidates: Vec<&(ReplicaId, ReplicaHeader)> =
            attached.iter().filter(|(r, h)| h.revision == newest && !self.missing.contains_key(r)).collect();
        if let Some(size) = candidates.iter().map(|(_, h)| h.size).max() {
            self.set_size(size);
        }
        // Replicas at the newest revision agree on the chain unless the engine crashed during
        // a snapshot operation; then any of them is a valid outcome and the others are rebuilt.
        let reference = candidates.iter().find(|(_, h)| h.size == self.size).map(|(_, h)| h.snapshots.clone());
        self.chain = reference.clone().unwrap_or_default();
        let names = |c: &[SnapshotInfo]| c.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        let full = full_map(self.size, self.cfg.region_size);
        for r in 0..self.replicas.len() {
            let ReplicaState::Attached(h) = self.replicas[r].clone() else {
                self.missing.entry(r).or_insert_with(|| full.clone());
                continue;
            };
            if h.size > self.size {
                self.fail(r, FailReason::SizeAhead { replica: h.size, engine: self.size });
                self.missing.entry(r).or_insert_with(|| full.clone());
                continue;
            }
            let candidate = h.revision == newest && !self.missing.contains_key(&r);
            let same_chain = reference.as_ref().is_some_and(|c| names(c) == names(&h.snapshots));
            if candidate && same_chain && h.size == self.size {
                self.replicas[r] = ReplicaState::Healthy;
                continue;
            }
            self.replicas[r] = ReplicaState::Stale;
            // Only a size behind (the engine crashed during a resize): its data is current.
            let lacks = if candidate && same_chain { empty_map(self.size, self.cfg.region_size) } else { full.clone() };
            self.missing.entry(r).or_insert(lacks);
        }
        self.resync_after_unclean_end(&attached);
        if self.replicas.iter().any(|s| *s != ReplicaState::Healthy) {
            self.bump_revision();
        }
        // Into this epoch's range (see EPOCH_REVISION_BITS) before the first write, also when
        // every replica is current.
        let floor = self.cfg.epoch.saturating_mul(1 << EPOCH_REVISION_BITS);
        if self.revision < floor {
            self.revision = floor;
            self.revision_sync_wanted = true;
        }
        tracing::info!(revision = self.revision, size = self.size, healthy = self.healthy_count(), "attached");
        self.persist();
        // The replicas may hold writes of the previous engine that never were flushed, which
        // this engine's `unflushed` does not know of. Until this flush is done, a replica that
        // fails is marked as lacking everything.
        let healthy: BTreeSet<ReplicaId> = self.healthy().into_iter().collect();
        if !healthy.is_empty() {
            let op = self.alloc_op();
            for r in &healthy {
                self.send(*r, op, Message::Flush);
            }
            let covered = full_map(self.size, self.cfg.region_size);
            let kind = Fanout::Flush { covered, window: empty_map(self.size, self.cfg.region_size) };
            self.ops.insert(op, Op::Fanout { client: None, kind, waiting: healthy, acked: BTreeSet::new() });
        }
    }

    /// The previous session did not end cleanly (a replica's header says dirty: its engine died
    /// or lost it without a final flush). Writes it sent but never acknowledged may have reached
    /// some replicas and not others, so replicas that agree on revision, size and chain can still
    /// differ in content; reading from more than one of them could return a block's old and new
    /// content alternately. One healthy replica (local first) becomes the source and stays the
    /// only healthy one; every other replica gets the suspect regions added to what it lacks and
    /// is rebuilt from the source, so afterwards all hold what the source holds, which is a valid
    /// outcome of the interrupted writes. The suspect regions are the previous session's intent
    /// map, or the whole volume when it is unknown (lost or old state file). Replicas already
    /// out of sync get them too: one in a rebuild's head phase received the same writes.
    fn resync_after_unclean_end(&mut self, attached: &[(ReplicaId, ReplicaHeader)]) {
        let prior = self.prior_intent.take();
        if !attached.iter().any(|(_, h)| h.dirty) {
            return;
        }
        let healthy = self.healthy();
        let Some(source) = healthy.iter().copied().find(|r| self.cfg.replicas[*r].local).or(healthy.first().copied())
        else {
            return;
        };
        let region_size = self.cfg.region_size;
        let suspect = match prior {
            // Grown when the replicas' size is newer than the persisted one; marks are kept.
            Some(mut m) if m.regions() <= self.size.div_ceil(region_size) => {
                m.grow(self.size);
                m
            }
            _ => full_map(self.size, region_size),
        };
        if suspect.is_empty() {
            return;
        }
        tracing::warn!(
            source,
            regions = suspect.count(),
            "previous session ended uncleanly: resyncing from one replica"
        );
        for r in (0..self.replicas.len()).filter(|r| *r != source) {
            if self.replicas[r] == ReplicaState::Healthy {
                self.replicas[r] = ReplicaState::Stale;
            }
            self.missing.entry(r).or_insert_with(|| empty_map(self.size, region_size)).merge(&suspect);
        }
    }

    /// Adopts a new volume size: maps grow keeping their marks. Volumes never shrink; a smaller
    /// size (only after a lost state file met older replicas) marks everything to be safe.
    fn set_size(&mut self, size: u64) {
        if size == self.size {
            return;
        }
        let region_size = self.cfg.region_size;
        if size > self.size {
            self.missing.values_mut().for_each(|m| m.grow(size));
            self.unflushed.grow(size);
            self.intent.grow(size);
            self.touched.grow(size);
        } else {
            self.missing.values_mut().for_each(|m| *m = full_map(size, region_size));
            self.unflushed = full_map(size, region_size);
            self.intent = full_map(size, region_size);
            self.touched = full_map(size, region_size);
        }
        self.size = size;
    }

    /// The healthy set changed: a new revision must reach every healthy replica before the next
    /// write, so the ones left behind are recognisably behind.
    fn bump_revision(&mut self) {
        self.revision += 1;
        self.revision_sync_wanted = true;
    }

    /// Marks in `r`'s map everything it may not hold durably: writes since the last flush
    /// started (a crash loses them), writes and unmaps in flight and what in-flight flushes
    /// cover (it may not have applied them).
    fn mark_unsettled(&mut self, r: ReplicaId) {
        let full = empty_map(self.size, self.cfg.region_size);
        let map = self.missing.entry(r).or_insert(full);
        map.merge(&self.unflushed);
        for op in self.ops.values() {
            match op {
                Op::Fanout { kind: Fanout::Write { offset, len, .. }, .. } => {
                    map.mark(*offset, *len);
                }
                Op::Fanout { kind: Fanout::Flush { covered, .. }, .. } => {
                    map.merge(covered);
                }
                _ => {}
            }
        }
    }

    fn fail(&mut self, r: ReplicaId, reason: FailReason) {
        let prev = std::mem::replace(&mut self.replicas[r], ReplicaState::Down);
        if prev == ReplicaState::Down {
            return;
        }
        self.actions.push(Action::ReplicaFailed { replica: r, reason });
        if matches!(prev, ReplicaState::Healthy | ReplicaState::Rebuilding) {
            self.mark_unsettled(r);
        }
        if prev == ReplicaState::Healthy {
            self.bump_revision();
        }
        if matches!(prev, ReplicaState::Healthy | ReplicaState::Rebuilding) {
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
                Some(Op::Hello | Op::Claim(_)) => {
                    self.ops.remove(&op_id);
                }
                Some(Op::Read { .. }) => {
                    if let Some(Op::Read { client, offset, len }) = self.ops.remove(&op_id) {
                        self.unlock(op_id);
                        // Retried like a new read, at the front so it keeps its place.
                        self.queue.push_front((op_id, Op::Read { client, offset, len }));
                    }
                }
                Some(Op::Fanout { waiting, .. }) => {
                    waiting.remove(&r);
                    self.maybe_complete(op_id);
                }
                // Rebuild requests go to the source or the target; the abort above removed them.
                Some(Op::Rebuild(_)) | None => {}
            }
        }
    }

    fn maybe_complete(&mut self, op_id: OpId) {
        let done = matches!(self.ops.get(&op_id), Some(Op::Fanout { waiting, .. }) if waiting.is_empty());
        if !done {
            return;
        }
        let Some(Op::Fanout { client, kind, acked, .. }) = self.ops.remove(&op_id) else { return };
        self.unlock(op_id);
        // Success needs an acknowledgment from a replica that is still healthy now: one that
        // acknowledged and then failed may have lost the data.
        let healthy_acked: BTreeSet<ReplicaId> =
            acked.iter().copied().filter(|r| self.replicas[*r] == ReplicaState::Healthy).collect();
        let ok = !healthy_acked.is_empty();
        // Snapshot operations must reach every configured replica, or the chains diverge.
        let everyone = ok && healthy_acked.len() == self.replicas.len();
        let result = match kind {
            Fanout::Write { offset, len, data } => {
                if ok {
                    self.unflushed.mark(offset, len);
                }
                // Marked at the end too: a write that finishes after a flush started is not
                // covered by it, even if it started long before.
                self.touched.mark(offset, len);
                ok.then_some(if data.is_some() { ClientReply::Written } else { ClientReply::Unmapped })
                    .ok_or_else(|| self.volume_error())
            }
            Fanout::Flush { window, .. } => {
                if ok {
                    self.clear_intent(&window);
                }
                ok.then_some(ClientReply::Flushed).ok_or_else(|| self.volume_error())
            }
            Fanout::Resize { size } => {
                if ok {
                    for r in &acked {
                        self.known[*r].size = size;
                    }
                    if let Some(b) = self.rebuild.as_mut().filter(|b| acked.contains(&b.target)) {
                        b.target_size = size;
                    }
                    tracing::info!(size, "volume resized");
                    self.set_size(size);
                    self.persist();
                    // A rebuild that started while this resize was in flight did not include
                    // its target; restarted, it grows the target first (its map is kept).
                    if self.rebuild.as_ref().is_some_and(|b| b.target_size < size) {
                        self.abort_rebuild();
                    }
                }
                ok.then_some(ClientReply::Resized).ok_or_else(|| self.volume_error())
            }
            Fanout::Snapshot { name, created_ns } => {
                let info = SnapshotInfo { name, revision: self.revision, created_ns };
                for r in &acked {
                    self.known[*r].chain.push(info.clone());
                }
                // Recorded when every replica still healthy has it, even if one failed: the
                // chain is the healthy replicas' chain, and a retry must find it.
                if ok && self.healthy().iter().all(|r| acked.contains(r)) {
                    self.chain.push(info);
                }
                everyone.then_some(ClientReply::SnapshotTaken).ok_or_else(|| self.degraded_error("a snapshot"))
            }
            Fanout::DeleteSnapshot { name } => {
                for r in &acked {
                    self.known[*r].chain.retain(|s| s.name != name);
                }
                if ok && self.healthy().iter().all(|r| acked.contains(r)) {
                    self.chain.retain(|s| s.name != name);
                }
                everyone
                    .then_some(ClientReply::SnapshotDeleted)
                    .ok_or_else(|| self.degraded_error("deleting a snapshot"))
            }
            Fanout::SetRevision { revision } => {
                self.revision_sync_in_flight = false;
                if let Some(t) = self.promote
                    && revision == self.revision
                    && acked.contains(&t)
                    && self.replicas[t] == ReplicaState::Rebuilding
                {
                    self.promote = None;
                    self.replicas[t] = ReplicaState::Healthy;
                    self.missing.remove(&t);
                    tracing::info!(replica = t, revision, "rebuild finished; replica healthy");
                    self.persist();
                    self.actions.push(Action::RebuildFinished { replica: t });
                }
                return;
            }
        };
        if let Some(client) = client {
            self.reply(client, result);
        }
    }

    /// After a flush succeeded: drops from the intent map every region no write touched since
    /// the previous flush started (`window`) nor since this one started, and none is in flight
    /// on. Every write to such a region finished before this flush started, so every replica
    /// still in the set holds it durably. Persisted only when something was cleared (at most
    /// once per flush): a stale mark would be safe, but a quiet volume would then keep its last
    /// marks on disk and pay for them with a larger resync after a crash.
    fn clear_intent(&mut self, window: &DirtyMap) {
        let mut busy = empty_map(self.size, self.cfg.region_size);
        for op in self.ops.values() {
            if let Op::Fanout { kind: Fanout::Write { offset, len, .. }, .. } = op {
                busy.mark(*offset, *len);
            }
        }
        let clear: Vec<u64> = self
            .intent
            .marked()
            .filter(|r| !window.is_marked(*r) && !self.touched.is_marked(*r) && !busy.is_marked(*r))
            .filter(|r| self.intent_touched.get(r).is_none_or(|t| self.now.saturating_sub(*t) >= INTENT_LINGER))
            .collect();
        let cleared = !clear.is_empty();
        for r in clear {
            self.intent.clear_region(r);
            self.intent_touched.remove(&r);
        }
        if cleared {
            self.persist();
        }
    }

    fn degraded_error(&self, what: &'static str) -> IoError {
        IoError::Degraded {
            volume_id: self.cfg.volume_id.clone(),
            healthy: self.healthy_count(),
            configured: self.replicas.len(),
            what,
        }
    }

    fn unlock(&mut self, op: OpId) {
        self.locks.retain(|l| l.op != op);
    }

    fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        start < end && self.locks.iter().any(|l| l.start < end && start < l.end && (exclusive || l.exclusive))
    }

    /// Starts whatever can start: a pending revision sync, queued client requests whose range
    /// is free, and the rebuild's next steps.
    fn pump(&mut self) {
        if self.fenced {
            while let Some((id, op)) = self.queue.pop_front() {
                self.unlock(id);
                if let Op::Read { client, .. } | Op::Fanout { client: Some(client), .. } = op {
                    self.reply(client, Err(self.volume_error()));
                }
            }
            return;
        }
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
            let (start, end, exclusive) = lock_range(&self.queue[i].1);
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
        self.pump_rebuild();
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
        for r in &targets {
            self.send(*r, op, Message::SetRevision { revision });
        }
        self.ops.insert(
            op,
            Op::Fanout {
                client: None,
                kind: Fanout::SetRevision { revision },
                waiting: targets,
                acked: BTreeSet::new(),
            },
        );
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
                    return self.reply(client, Err(self.volume_error()));
                };
                self.ops.insert(id, Op::Read { client, offset, len });
                // len ≤ MAX_IO, checked on arrival.
                self.send(r, id, Message::Read { offset, len: len as u32 });
            }
            Op::Fanout { client: Some(client), kind, .. } => self.start_fanout(id, client, kind),
            other => {
                self.ops.insert(id, other);
            }
        }
    }

    fn start_fanout(&mut self, id: OpId, client: ClientId, kind: Fanout) {
        if self.healthy_count() == 0 {
            self.unlock(id);
            return self.reply(client, Err(self.volume_error()));
        }
        let revision = self.revision;
        let (targets, message): (BTreeSet<ReplicaId>, Box<dyn Fn() -> Message>) = match &kind {
            Fanout::Write { offset, len, data } => {
                // Marked before any replica sees the write: if the engine crashes right after
                // sending, the persisted maps already cover what the missing replicas lack.
                let targets = self.writable();
                // Also before any replica sees it: if the engine crashes with it in flight, the
                // next attach knows the region may differ between replicas.
                let mut changed = self.intent.mark(*offset, *len);
                self.touched.mark(*offset, *len);
                let (first, last) = self.intent.region_span(*offset, *len);
                let now = self.now;
                for r in first..last {
                    self.intent_touched.insert(r, now);
                }
                for (r, map) in self.missing.iter_mut() {
                    if !targets.contains(r) {
                        changed |= map.mark(*offset, *len);
                    }
                }
                if changed {
                    self.persist();
                }
                let (offset, len) = (*offset, *len);
                // A write's payload is handed out below, shared, without the closure.
                let message: Box<dyn Fn() -> Message> = match data {
                    Some(_) => Box::new(|| Message::Flush),
                    None => Box::new(move || Message::Unmap { offset, len, revision }),
                };
                (targets, message)
            }
            Fanout::Flush { .. } => (self.writable(), Box::new(|| Message::Flush)),
            Fanout::Resize { size } => {
                let size = *size;
                if size < self.size {
                    self.unlock(id);
                    let e = IoError::Shrink { volume_id: self.cfg.volume_id.clone(), size: self.size, requested: size };
                    return self.reply(client, Err(e));
                }
                if size == self.size {
                    self.unlock(id);
                    return self.reply(client, Ok(ClientReply::Resized));
                }
                // A target being seeded grows too: it receives no writes, but its head phase
                // will, and the snapshot views it copies may be as large as the volume.
                let mut targets = self.writable();
                targets.extend((0..self.replicas.len()).filter(|r| self.replicas[*r] == ReplicaState::Seeding));
                (targets, Box::new(move || Message::Resize { size, revision }))
            }
            Fanout::Snapshot { name, .. } | Fanout::DeleteSnapshot { name } => {
                let taking = matches!(kind, Fanout::Snapshot { .. });
                let exists = self.chain.iter().any(|s| s.name == *name);
                if exists == taking {
                    // Already done: an idempotent retry.
                    self.unlock(id);
                    let reply = if taking { ClientReply::SnapshotTaken } else { ClientReply::SnapshotDeleted };
                    return self.reply(client, Ok(reply));
                }
                if self.healthy_count() < self.replicas.len() {
                    self.unlock(id);
                    let what = if taking { "a snapshot" } else { "deleting a snapshot" };
                    return self.reply(client, Err(self.degraded_error(what)));
                }
                let name = name.clone();
                let message: Box<dyn Fn() -> Message> = if taking {
                    Box::new(move || Message::Snapshot { name: name.clone(), revision })
                } else {
                    Box::new(move || Message::DeleteSnapshot { name: name.clone(), revision })
                };
                (self.healthy().into_iter().collect(), message)
            }
            Fanout::SetRevision { .. } => return,
        };
        if let Fanout::Flush { .. } = kind {
            // Writes completed before now are covered by this flush; later ones are not.
            let covered = std::mem::replace(&mut self.unflushed, empty_map(self.size, self.cfg.region_size));
            let window = std::mem::replace(&mut self.touched, empty_map(self.size, self.cfg.region_size));
            for r in &targets {
                self.send(*r, id, Message::Flush);
            }
            let kind = Fanout::Flush { covered, window };
            self.ops.insert(id, Op::Fanout { client: Some(client), kind, waiting: targets, acked: BTreeSet::new() });
            return;
        }
        let mut kind = kind;
        if let Fanout::Write { offset, data: Some(data), .. } = &mut kind {
            // The op keeps an empty payload (it still reads as a write, not an unmap): nothing
            // resends it, so the data is freed once every connection wrote it out. Every
            // replica's frame shares the one payload.
            let offset = *offset;
            let payload = std::mem::take(data);
            for r in &targets {
                self.send(*r, id, Message::Write { offset, revision, data: payload.clone() });
            }
        } else {
            for r in &targets {
                self.send(*r, id, message());
            }
        }
        self.ops.insert(id, Op::Fanout { client: Some(client), kind, waiting: targets, acked: BTreeSet::new() });
    }
}

fn fanout(client: ClientId, kind: Fanout) -> Op {
    Op::Fanout { client: Some(client), kind, waiting: BTreeSet::new(), acked: BTreeSet::new() }
}

/// The byte range a queued request locks; barriers lock the whole volume.
fn lock_range(op: &Op) -> (u64, u64, bool) {
    match op {
        Op::Read { offset, len, .. } => (*offset, offset + len, false),
        Op::Fanout { kind: Fanout::Write { offset, len, .. }, .. } => (*offset, offset + len, true),
        Op::Fanout {
            kind: Fanout::Resize { .. } | Fanout::Snapshot { .. } | Fanout::DeleteSnapshot { .. }, ..
        } => (0, u64::MAX, true),
        _ => (0, 0, false),
    }
}

/// Statuses that count as success for an operation: a snapshot that already exists (a retry
/// after a partial failure) and one that is already gone.
fn tolerated(kind: &Fanout, status: Status) -> bool {
    matches!(
        (kind, status),
        (Fanout::Snapshot { .. }, Status::AlreadyExists) | (Fanout::DeleteSnapshot { .. }, Status::NotFound)
    )
}

fn mismatch(message: &Message) -> FailReason {
    match message {
        Message::Reply { status }
        | Message::ReadReply { status, .. }
        | Message::HelloReply { status, .. }
        | Message::ExtentMap { status, .. }
            if *status != Status::Ok =>
        {
            FailReason::ErrorReply { status: *status }
        }
        _ => FailReason::Protocol("reply does not match its request"),
    }
}

/// `DirtyMap::new` only fails for a region size that is not a power of two, and `Engine::new`
/// replaces such a size with 1 MiB.
fn empty_map(size: u64, region_size: u64) -> DirtyMap {
    match DirtyMap::new(size, region_size) {
        Ok(m) => m,
        Err(_) => unreachable!("region size checked in Engine::new"),
    }
}

fn full_map(size: u64, region_size: u64) -> DirtyMap {
    let mut m = empty_map(size, region_size);
    m.mark_all();
    m
}
