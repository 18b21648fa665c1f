//! One engine's session on one replica, whichever way the engine reaches it: across a socket
//! (`server`) or inside this process (the driver's in-process link to its own node). Both must
//! keep the same rules, so both run them from here: `Hello` counts the session and marks the
//! replica dirty; every request runs through [`execute`]; the last session to leave clears the
//! dirty flag only if every session that overlapped it ended cleanly (see the server's module
//! docs for what clean means).
//!
//! A session also carries the epoch it claimed (`Claim`, see `record`): every request that
//! changes the replica passes the record's fence gate with it, so an engine that was fenced by a
//! newer epoch cannot change anything, whichever way it reaches the replica.
//!
//! Everything here blocks (fsync, positional I/O); async callers run it on the blocking pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::StoreError;
use super::node::{Replica, ReplicaNode};
use super::record::ClaimError;
use super::store::lock;
use crate::protocol::{Extent, Message, PROTOCOL_VERSION, ReplicaHeader, Status};

/// Requests of at most this many payload bytes are small: a buffered write or a cached read of
/// this size costs microseconds, less than a hop to the blocking pool and back.
pub(crate) const SMALL_REQUEST: usize = 64 * 1024;

/// What one engine session carries between its requests.
#[derive(Debug, Default)]
pub(crate) struct Session {
    /// The epoch the session claimed; 0 until it claims.
    epoch: AtomicU64,
}

/// Where a request should run.
pub(crate) enum Placement {
    /// A small write: cheap enough to run on the caller's thread.
    Inline,
    /// A small read the page cache already held (tried without waiting for the disk,
    /// `RWF_NOWAIT`): this is its reply.
    Answered(Message),
    /// A small read that would wait for the disk.
    SmallRead,
    /// Anything else: a flush, large I/O, snapshots and the rest must not hold up the others.
    Blocking,
}

/// Decides where `request` runs; answers it right away when that costs only a copy.
pub(crate) fn place(replica: &Replica, request: &Message) -> Placement {
    match request {
        Message::Write { data, .. } if data.len() <= SMALL_REQUEST => Placement::Inline,
        Message::Read { offset, len } if *len as usize <= SMALL_REQUEST => {
            match replica.store.read_cached(*offset, *len) {
                Some(data) => Placement::Answered(Message::ReadReply { status: Status::Ok, data }),
                None => Placement::SmallRead,
            }
        }
        _ => Placement::Blocking,
    }
}

/// What a `Hello` refused with `status` is answered: no session, an empty header.
pub(crate) fn refused(status: Status, volume_id: String) -> (Option<Arc<Replica>>, Status, ReplicaHeader) {
    let header = ReplicaHeader { volume_id, size: 0, revision: 0, snapshots: Vec::new(), dirty: false };
    (None, status, header)
}

/// Answers `Hello`: the replica for the session (with the session counted and the replica marked
/// dirty), or why not. `granted`: the epoch of the grant the session is bound to (a node's
/// session), refused `Denied` when the replica's epoch is newer.
#[tracing::instrument(name = "replica.hello", skip_all, fields(replica.volume = %volume_id))]
pub(crate) fn open(
    node: &ReplicaNode,
    volume_id: String,
    protocol_version: u16,
    granted: Option<u64>,
) -> (Option<Arc<Replica>>, Status, ReplicaHeader) {
    if protocol_version != PROTOCOL_VERSION {
        return refused(Status::UnsupportedVersion, volume_id);
    }
    match node.open_session(&volume_id, granted) {
        Ok((replica, header)) => {
            tracing::debug!("replica session opened");
            (Some(replica), Status::Ok, header)
        }
        Err(e) => {
            tracing::info!(error = %e, "replica hello refused");
            refused(e.status(), volume_id)
        }
    }
}

/// Ends one engine session; the last one to leave clears the dirty flag if every session that
/// overlapped it ended cleanly.
///
/// The flag is cleared before the session stops counting, under the sessions lock: a session
/// opening meanwhile (which marks the replica dirty under the same lock) can never have its mark
/// overwritten by this clean, and whoever sees no session open sees the flag already cleared.
pub(crate) fn end(replica: &Replica, clean: bool) {
    let mut s = lock(&replica.sessions);
    s.unclean |= !clean;
    if s.open == 1
        && !s.unclean
        && let Err(e) = replica.store.flush().and_then(|()| replica.store.set_dirty(false))
    {
        tracing::warn!(
            replica.volume = %replica.volume_id,
            error = %e,
            "replica could not clear its dirty flag after a clean close"
        );
    }
    s.open -= 1;
}

/// Whether a request changes what the replica stores (`None`: not a request at all).
pub(crate) fn classify(m: &Message) -> Option<bool> {
    match m {
        // Everything that changes what the replica stores: a final flush with one of these in
        // flight does not cover it, so the session did not end cleanly.
        Message::Write { .. }
        | Message::Unmap { .. }
        | Message::Snapshot { .. }
        | Message::Resize { .. }
        | Message::DeleteSnapshot { .. }
        | Message::Revert { .. }
        | Message::Reinitialize { .. } => Some(true),
        Message::Read { .. }
        | Message::Flush
        | Message::SetRevision { .. }
        | Message::ListExtents { .. }
        | Message::ReadExtent { .. }
        | Message::ReadSnapshot { .. }
        | Message::ListSnapshotExtents { .. }
        | Message::ListSnapshotDelta { .. } => Some(false),
        Message::Hello { .. }
        | Message::HelloReply { .. }
        | Message::ReadReply { .. }
        | Message::Reply { .. }
        | Message::ExtentMap { .. }
        | Message::CreateReplica { .. }
        | Message::CreateReplicaOn { .. }
        | Message::DeleteReplica { .. }
        | Message::NodeInfo
        | Message::ListDisks
        | Message::DiskList { .. }
        | Message::NodeInfoReply { .. }
        | Message::Describe { .. }
        | Message::Description { .. }
        | Message::SetRecord { .. }
        | Message::Identify
        | Message::Identity { .. }
        | Message::EngineCall { .. }
        | Message::EngineReply { .. }
        | Message::Grant { .. } => None,
        // Stores an epoch, never data: a final flush after it still ends the session cleanly.
        Message::Claim { .. } => Some(false),
    }
}

/// Whether a request must pass the epoch fence: everything that changes the replica's data,
/// chain, size or revision.
fn fenced(m: &Message) -> bool {
    matches!(
        m,
        Message::Write { .. }
            | Message::Unmap { .. }
            | Message::Snapshot { .. }
            | Message::Resize { .. }
            | Message::DeleteSnapshot { .. }
            | Message::Revert { .. }
            | Message::Reinitialize { .. }
            | Message::SetRevision { .. }
    )
}

/// Runs one request of `session` against its replica and builds its reply: a claim, or any
/// other request behind the epoch fence.
pub(crate) fn execute(replica: &Replica, session: &Session, request: Message, max_payload: usize) -> Message {
    if let Message::Claim { epoch } = request {
        let status = match replica.record.claim(replica.store.dir(), epoch) {
            Ok(()) => {
                session.epoch.store(epoch, Ordering::SeqCst);
                Status::Ok
            }
            Err(ClaimError::Fenced) => {
                tracing::info!(replica.volume = %replica.volume_id, epoch, "claim refused: a newer epoch holds the volume");
                Status::Fenced
            }
            Err(ClaimError::Store(e)) => failed(&e),
        };
        return Message::Reply { status };
    }
    if !fenced(&request) {
        return execute_admitted(replica, request, max_payload);
    }
    let epoch = session.epoch.load(Ordering::SeqCst);
    let Some(_gate) = replica.record.admit(epoch) else {
        tracing::debug!(replica.volume = %replica.volume_id, epoch, "request of a fenced session refused");
        return Message::Reply { status: Status::Fenced };
    };
    execute_admitted(replica, request, max_payload)
}

/// Runs one request that passed the fence against the session's replica and builds its reply.
fn execute_admitted(replica: &Replica, request: Message, max_payload: usize) -> Message {
    let store = &replica.store;
    // A ReadReply is a status and the data; a longer read cannot be answered in one frame.
    let max_read = max_payload.saturating_sub(2) as u64;
    let reply = |r: Result<(), StoreError>| Message::Reply { status: status_of(r) };
    match request {
        Message::Read { len, .. } | Message::ReadExtent { len, .. } | Message::ReadSnapshot { len, .. }
            if u64::from(len) > max_read =>
        {
            Message::ReadReply { status: Status::Invalid, data: Vec::new() }
        }
        Message::Read { offset, len } => read_reply(store.read(offset, len)),
        Message::ReadExtent { offset, len, revision } => read_reply(store.read_extent(offset, len, revision)),
        Message::Write { offset, revision, data } => reply(store.write(offset, &data, revision)),
        Message::Flush => reply(store.flush()),
        Message::Unmap { offset, len, revision } => reply(store.unmap(offset, len, revision)),
        Message::SetRevision { revision } => reply(store.set_revision(revision).map(|_| ())),
        Message::ListExtents { offset, len } => extent_map(store.list_extents(offset, len), max_payload),
        Message::Snapshot { name, revision } => {
            let _span = tracing::info_span!(
                "replica.snapshot",
                replica.volume = %replica.volume_id,
                snapshot = %name,
                revision,
            )
            .entered();
            reply(store.snapshot(&name, revision))
        }
        Message::DeleteSnapshot { name, revision } => {
            let _span = tracing::info_span!(
                "replica.delete_snapshot",
                replica.volume = %replica.volume_id,
                snapshot = %name,
                revision,
            )
            .entered();
            reply(store.delete_snapshot(&name, revision))
        }
        Message::Revert { name, revision } => {
            let _span = tracing::info_span!(
                "replica.revert",
                replica.volume = %replica.volume_id,
                snapshot = %name,
                revision,
            )
            .entered();
            revert(replica, &name, revision)
        }
        Message::Resize { size, revision } => {
            let _span =
                tracing::info_span!("replica.resize", replica.volume = %replica.volume_id, size, revision).entered();
            reply(store.resize(size, revision))
        }
        Message::Reinitialize { revision } => {
            let _span =
                tracing::info_span!("replica.reinitialize", replica.volume = %replica.volume_id, revision).entered();
            reply(store.reinitialize(revision))
        }
        Message::ReadSnapshot { name, offset, len } => read_reply(store.read_snapshot(&name, offset, len)),
        Message::ListSnapshotExtents { name, offset, len } => {
            extent_map(store.list_snapshot_extents(&name, offset, len), max_payload)
        }
        Message::ListSnapshotDelta { base, name, offset, len } => {
            extent_map(store.snapshot_delta(base.as_deref(), &name, offset, len), max_payload)
        }
        // serve_requests only passes requests.
        other => {
            tracing::error!(message = ?other, "replica asked to execute a non-request");
            Message::Reply { status: Status::Invalid }
        }
    }
}

/// Reverts only while the requesting session is the replica's only one, and keeps new sessions
/// out until it is done: another engine would see the volume change under it.
fn revert(replica: &Replica, name: &str, revision: u64) -> Message {
    {
        let mut s = lock(&replica.sessions);
        if s.open > 1 || s.exclusive {
            tracing::info!(sessions = s.open, "revert refused: the replica is open elsewhere");
            return Message::Reply { status: Status::Busy };
        }
        s.exclusive = true;
    }
    let result = replica.store.revert(name, revision);
    lock(&replica.sessions).exclusive = false;
    Message::Reply { status: status_of(result) }
}

fn extent_map(r: Result<Vec<Extent>, StoreError>, max_payload: usize) -> Message {
    match r {
        // Status (2) + count (4) + 17 bytes per extent must fit one frame; the engine asks for
        // smaller ranges instead of getting a silently truncated map.
        Ok(extents) if 6 + extents.len().saturating_mul(17) > max_payload => {
            Message::ExtentMap { status: Status::Invalid, extents: Vec::new() }
        }
        Ok(extents) => Message::ExtentMap { status: Status::Ok, extents },
        Err(e) => Message::ExtentMap { status: failed(&e), extents: Vec::new() },
    }
}

fn read_reply(r: Result<Vec<u8>, StoreError>) -> Message {
    match r {
        Ok(data) => Message::ReadReply { status: Status::Ok, data },
        Err(e) => Message::ReadReply { status: failed(&e), data: Vec::new() },
    }
}

fn status_of(r: Result<(), StoreError>) -> Status {
    match r {
        Ok(()) => Status::Ok,
        Err(e) => failed(&e),
    }
}

/// Logs a failed request once, where it becomes a status.
fn failed(e: &StoreError) -> Status {
    let status = e.status();
    match status {
        // Expected answers to a confused, fenced or retrying engine, not replica failures.
        Status::StaleRevision | Status::OutOfRange | Status::NotFound | Status::AlreadyExists => {
            tracing::debug!(error = %e, "replica refused request")
        }
        _ => tracing::warn!(error = %e, "replica request failed"),
    }
    status
}
