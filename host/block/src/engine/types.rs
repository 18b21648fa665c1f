//! The engine's vocabulary: what a driver feeds it ([`Event`]), what it asks the driver to do
//! ([`Action`]), how it is configured and what it persists. Types only; the rules are in the
//! engine's other modules.

use std::collections::BTreeMap;

use bytes::Bytes;
use thiserror::Error;

use crate::dirty_map::DirtyMap;
use crate::protocol::{Frame, MAX_NAME_LEN, Status};

/// Index of a replica in the list the engine was started with (see [`crate::engine::Engine::new`]).
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

/// What the engine knows of one replica besides its index: the rest of where it is (its
/// address, how it is reached) is the driver's (`crate::volume::ReplicaEndpoint`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaConfig {
    /// On the engine's own node: preferred for reads (no network hop).
    pub local: bool,
    /// The disk of its replica server holding it, named in `Hello` (a server may hold several
    /// replicas of the volume, one per disk).
    pub disk: String,
    /// Who the replica is across engines (its node and disk), kept in the persisted state so a
    /// later engine finds each replica's map after the membership changed; empty: unknown (the
    /// maps keep their indices).
    pub identity: String,
}

/// The engine's settings; the replicas it replicates to are given beside them
/// (see [`crate::engine::Engine::new`]).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub volume_id: String,
    /// Initial size; after the first attach the persisted and the replicas' sizes win.
    pub size: u64,
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
    /// Each index's [`ReplicaConfig::identity`] when persisted (empty for a retired one);
    /// empty when unknown (a state file of a version before it).
    pub members: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Advances the clock; fails replicas whose requests timed out.
    Tick,
    /// A new connection to the replica is up; the engine starts the handshake on it.
    ReplicaConnected(ReplicaId),
    ReplicaDisconnected(ReplicaId),
    /// The replica now lives elsewhere (a new, empty replica on another server, or another disk
    /// of one, named here): whatever the old one held counts for nothing, and the new one gets a
    /// full rebuild. Its disk and its identity (see [`ReplicaConfig`]) follow.
    ReplicaReplaced(ReplicaId, String, String),
    /// A new, empty replica joins the set at the next index (the driver connects it): it is
    /// fully rebuilt while I/O goes on. Only while attached.
    ReplicaAdded(ReplicaConfig),
    /// The replica leaves the set: dropped like a failed one, never reconnected or counted
    /// again (its index stays, retired). The driver refuses removing the last healthy one.
    ReplicaRemoved(ReplicaId),
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
    #[error("removed from the replica set")]
    Removed,
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
