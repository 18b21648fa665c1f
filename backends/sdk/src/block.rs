//! `block`: the host's replicated block engine, scoped to the granted replica nodes: list the
//! nodes and their free space; create (empty or filled from a snapshot or a volume), look up,
//! list, tag, delete, expand and re-place replica sets; snapshot them. [`Block`] is the
//! capability, [`BlockImport`] the component's import of it.
use crate::types::{Error, Pair};
use crate::wit::wasmcsi::backend::block as wit;

pub use wit::{BlockSnapshot, BlockSource, NodeInfo, Replica, ReplicaSet, ReplicaState};

/// The `block` capability: one method per WIT function, same errors (see `wit/backend.wit`).
pub trait Block {
    /// Replica nodes granted to this backend that answer.
    fn list_nodes(&self) -> Result<Vec<NodeInfo>, Error>;
    /// Create a replica set of `size_bytes` with one replica on each of `nodes`, empty or from
    /// `source`, with `metadata`; the same id, size and nodes again is a retry (a fill goes on).
    fn create(
        &self,
        id: &str,
        size_bytes: u64,
        nodes: &[String],
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
    /// Move the replica on `node` to the empty node `with` (rebuilt there).
    fn replace(&self, id: &str, node: &str, with: &str) -> Result<ReplicaSet, Error>;
    /// Crash-consistent snapshot `name` of a set on every replica; the same name again succeeds.
    fn snapshot(&self, id: &str, name: &str) -> Result<BlockSnapshot, Error>;
    /// Delete a set's snapshot; absent succeeds.
    fn delete_snapshot(&self, id: &str, name: &str) -> Result<(), Error>;
    /// Snapshots of one set (oldest first), or of every set.
    fn list_snapshots(&self, id: Option<&str>) -> Result<Vec<BlockSnapshot>, Error>;
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
        nodes: &[String],
        source: Option<&BlockSource>,
        metadata: &[Pair],
    ) -> Result<ReplicaSet, Error> {
        wit::create(id, size_bytes, nodes, source, metadata)
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
    fn replace(&self, id: &str, node: &str, with: &str) -> Result<ReplicaSet, Error> {
        wit::replace(id, node, with)
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
}
