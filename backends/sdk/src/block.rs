//! `block`: the host's replicated block engine, scoped to the granted replica nodes: list the
//! nodes, their disks and free space; create (empty or filled from a snapshot, a volume or a
//! backup), look up, list, tag, delete, expand, re-place, grow and shrink replica sets; snapshot
//! them (one at a time or a group at once); limit their I/O; keep standby sets. [`Block`] is the
//! capability, [`BlockImport`] the component's import of it. What a host does not provide yet
//! answers `unimplemented` (see each function in `wit/backend.wit`).
use crate::types::{Error, IoLimits, Pair};
use crate::wit::wasmcsi::backend::block as wit;

pub use wit::{BlockSnapshot, BlockSource, DiskInfo, NodeInfo, Placement, Replica, ReplicaSet, ReplicaState, Standby};

impl Placement {
    /// A replica on `node`, on whichever of its disks the host picks (or, naming a replica,
    /// the set's replica on that node).
    pub fn on(node: impl Into<String>) -> Self {
        Placement { node: node.into(), disk: None }
    }
}

/// The `block` capability: one method per WIT function, same errors (see `wit/backend.wit`).
pub trait Block {
    /// Replica nodes granted to this backend that answer, with their disks.
    fn list_nodes(&self) -> Result<Vec<NodeInfo>, Error>;
    /// Create a replica set of `size_bytes` with one replica at each of `placements`, empty or
    /// from `source`, with `metadata`; the same id, size and placements again is a retry (a fill
    /// goes on).
    fn create(
        &self,
        id: &str,
        size_bytes: u64,
        placements: &[Placement],
        source: Option<&BlockSource>,
        metadata: &[Pair],
    ) -> Result<ReplicaSet, Error>;
    /// A replica set, `None` when no granted node holds it.
    fn get(&self, id: &str) -> Result<Option<ReplicaSet>, Error>;
    /// Replica sets ordered by id, at most `limit`, strictly after `start_after`.
    fn list_sets(&self, start_after: Option<&str>, limit: u32) -> Result<Vec<ReplicaSet>, Error>;
    /// Replace a set's metadata (whole).
    fn set_metadata(&self, id: &str, metadata: &[Pair]) -> Result<(), Error>;
    /// Delete a replica set and its snapshots; absent succeeds. Errors: failed-precondition
    /// (attached).
    fn delete(&self, id: &str) -> Result<(), Error>;
    /// Grow a replica set (online when attached). Errors: not-found, out-of-range (shrink).
    fn expand(&self, id: &str, size_bytes: u64) -> Result<ReplicaSet, Error>;
    /// Move the replica at `replica` to `with`, where the set has none (rebuilt there).
    fn replace(&self, id: &str, replica: &Placement, with: &Placement) -> Result<ReplicaSet, Error>;
    /// Crash-consistent snapshot `name` of a set on every replica; the same name again succeeds.
    fn snapshot(&self, id: &str, name: &str) -> Result<BlockSnapshot, Error>;
    /// Delete a set's snapshot; absent succeeds.
    fn delete_snapshot(&self, id: &str, name: &str) -> Result<(), Error>;
    /// Snapshots of one set (oldest first), or of every set.
    fn list_snapshots(&self, id: Option<&str>) -> Result<Vec<BlockSnapshot>, Error>;
    /// Set a set's I/O limits and rebuild bandwidth (0 = the node's default).
    fn set_limits(&self, id: &str, limits: &IoLimits, rebuild_bytes_per_second: u64) -> Result<ReplicaSet, Error>;
    /// Add a replica at `placement` (rebuilt while the volume serves I/O).
    fn add_replica(&self, id: &str, placement: &Placement) -> Result<ReplicaSet, Error>;
    /// Remove the replica at `replica` once every other one is healthy (aborted until then).
    fn remove_replica(&self, id: &str, replica: &Placement) -> Result<ReplicaSet, Error>;
    /// One crash-consistent snapshot `name` of every set in `ids`.
    fn snapshot_group(&self, ids: &[String], name: &str) -> Result<Vec<BlockSnapshot>, Error>;
    /// Make a set a standby following `source_volume`'s backups on `target`.
    fn follow(&self, id: &str, target: &str, source_volume: &str) -> Result<ReplicaSet, Error>;
    /// Activate a standby set.
    fn activate(&self, id: &str) -> Result<ReplicaSet, Error>;
}

/// The component's `block` import.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockImport;

impl Block for BlockImport {
    fn list_nodes(&self) -> Result<Vec<NodeInfo>, Error> {
        wit::list_nodes()
    }
    fn create(
        &self,
        id: &str,
        size_bytes: u64,
        placements: &[Placement],
        source: Option<&BlockSource>,
        metadata: &[Pair],
    ) -> Result<ReplicaSet, Error> {
        wit::create(id, size_bytes, placements, source, metadata)
    }
    fn get(&self, id: &str) -> Result<Option<ReplicaSet>, Error> {
        wit::get(id)
    }
    fn list_sets(&self, start_after: Option<&str>, limit: u32) -> Result<Vec<ReplicaSet>, Error> {
        wit::list_sets(start_after, limit)
    }
    fn set_metadata(&self, id: &str, metadata: &[Pair]) -> Result<(), Error> {
        wit::set_metadata(id, metadata)
    }
    fn delete(&self, id: &str) -> Result<(), Error> {
        wit::delete(id)
    }
    fn expand(&self, id: &str, size_bytes: u64) -> Result<ReplicaSet, Error> {
        wit::expand(id, size_bytes)
    }
    fn replace(&self, id: &str, replica: &Placement, with: &Placement) -> Result<ReplicaSet, Error> {
        wit::replace(id, replica, with)
    }
    fn snapshot(&self, id: &str, name: &str) -> Result<BlockSnapshot, Error> {
        wit::snapshot(id, name)
    }
    fn delete_snapshot(&self, id: &str, name: &str) -> Result<(), Error> {
        wit::delete_snapshot(id, name)
    }
    fn list_snapshots(&self, id: Option<&str>) -> Result<Vec<BlockSnapshot>, Error> {
        wit::list_snapshots(id)
    }
    fn set_limits(&self, id: &str, limits: &IoLimits, rebuild_bytes_per_second: u64) -> Result<ReplicaSet, Error> {
        wit::set_limits(id, *limits, rebuild_bytes_per_second)
    }
    fn add_replica(&self, id: &str, placement: &Placement) -> Result<ReplicaSet, Error> {
        wit::add_replica(id, placement)
    }
    fn remove_replica(&self, id: &str, replica: &Placement) -> Result<ReplicaSet, Error> {
        wit::remove_replica(id, replica)
    }
    fn snapshot_group(&self, ids: &[String], name: &str) -> Result<Vec<BlockSnapshot>, Error> {
        wit::snapshot_group(ids, name)
    }
    fn follow(&self, id: &str, target: &str, source_volume: &str) -> Result<ReplicaSet, Error> {
        wit::follow(id, target, source_volume)
    }
    fn activate(&self, id: &str) -> Result<ReplicaSet, Error> {
        wit::activate(id)
    }
}
