//! `block`: the host's replicated block engine, scoped to the granted nodes: list nodes and
//! their free space; create, look up, delete, expand, snapshot and clone replica sets. [`Block`]
//! is the capability, [`BlockImport`] the component's import of it.
use crate::types::Error;
use crate::wit::wasmcsi::backend::block as wit;

pub use wit::{BlockSnapshot, NodeInfo, ReplicaSet};

/// The `block` capability: one method per WIT function, same errors (see `wit/backend.wit`).
pub trait Block {
    /// Nodes granted to this backend.
    fn list_nodes(&self) -> Result<Vec<NodeInfo>, Error>;
    /// Create a replica set of `size_bytes` with one replica on each of `nodes`, empty or from
    /// a source; the same id and size again succeeds. Errors: already-exists (other size),
    /// resource-exhausted, permission-denied (node not granted), not-found (source).
    fn create(
        &self,
        id: &str,
        size_bytes: u64,
        nodes: &[String],
        from_snapshot: Option<&str>,
        from_volume: Option<&str>,
    ) -> Result<ReplicaSet, Error>;
    /// A replica set, `None` when absent.
    fn get(&self, id: &str) -> Result<Option<ReplicaSet>, Error>;
    /// Delete a replica set; absent succeeds. Errors: failed-precondition (attached).
    fn delete(&self, id: &str) -> Result<(), Error>;
    /// Grow a replica set online. Errors: not-found, out-of-range (shrink), resource-exhausted.
    fn expand(&self, id: &str, size_bytes: u64) -> Result<ReplicaSet, Error>;
    /// Crash-consistent snapshot on every replica; the same snapshot id again succeeds.
    fn snapshot(&self, id: &str, snapshot_id: &str) -> Result<BlockSnapshot, Error>;
    /// Delete a snapshot; absent succeeds.
    fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), Error>;
    /// Snapshots, of one volume or all.
    fn list_snapshots(&self, volume_id: Option<&str>) -> Result<Vec<BlockSnapshot>, Error>;
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
        from_snapshot: Option<&str>,
        from_volume: Option<&str>,
    ) -> Result<ReplicaSet, Error> {
        wit::create(id, size_bytes, nodes, from_snapshot, from_volume)
    }
    fn get(&self, id: &str) -> Result<Option<ReplicaSet>, Error> {
        wit::get(id)
    }
    fn delete(&self, id: &str) -> Result<(), Error> {
        wit::delete(id)
    }
    fn expand(&self, id: &str, size_bytes: u64) -> Result<ReplicaSet, Error> {
        wit::expand(id, size_bytes)
    }
    fn snapshot(&self, id: &str, snapshot_id: &str) -> Result<BlockSnapshot, Error> {
        wit::snapshot(id, snapshot_id)
    }
    fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), Error> {
        wit::delete_snapshot(snapshot_id)
    }
    fn list_snapshots(&self, volume_id: Option<&str>) -> Result<Vec<BlockSnapshot>, Error> {
        wit::list_snapshots(volume_id)
    }
}
