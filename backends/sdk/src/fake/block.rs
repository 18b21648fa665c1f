//! The fake `block`: granted nodes with a size each, and replica sets that take `size` bytes on
//! every node they have a replica on. Follows the WIT's `block` interface; where it is silent
//! the fake chooses, and says so here: a create names at least one node, each once
//! (invalid-argument), and at most one source (invalid-argument); a volume made from a source
//! is at least the source's size (out-of-range); a snapshot id is unique across volumes
//! (already-exists); snapshots take no space and outlive their volume. Tests can mark a
//! volume attached ([`FakeBlock::attach`]: delete is then failed-precondition) or degraded
//! ([`FakeBlock::set_healthy`]).
//!
//! Written to be extended with the interface: one method per WIT function, state in plain maps.
use super::{Clock, Journal};
use crate::block::{Block, BlockSnapshot, NodeInfo, ReplicaSet};
use crate::types::Error;
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

/// A replica set as the fake holds it: the engine's view and what it was made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeReplicaSet {
    pub set: ReplicaSet,
    pub from_snapshot: Option<String>,
    pub from_volume: Option<String>,
}

/// A granted node: its size and topology labels.
#[derive(Debug, Clone)]
struct FakeNode {
    total_bytes: u64,
    labels: Vec<(String, String)>,
}

#[derive(Debug, Default)]
pub struct FakeBlock {
    nodes: RefCell<BTreeMap<String, FakeNode>>,
    sets: RefCell<BTreeMap<String, FakeReplicaSet>>,
    snapshots: RefCell<BTreeMap<String, BlockSnapshot>>,
    attached: RefCell<BTreeSet<String>>,
    clock: Clock,
    pub journal: Journal,
}

impl FakeBlock {
    /// Grant a node of `total_bytes` with topology labels.
    pub fn add_node(&self, name: &str, total_bytes: u64, labels: &[(&str, &str)]) -> &Self {
        let labels = labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        self.nodes.borrow_mut().insert(name.to_owned(), FakeNode { total_bytes, labels });
        self
    }
    /// A replica set, for assertions.
    pub fn replica_set(&self, id: &str) -> Option<FakeReplicaSet> {
        self.sets.borrow().get(id).cloned()
    }
    /// Mark a volume attached (its delete fails) or not.
    pub fn attach(&self, id: &str, attached: bool) {
        let mut a = self.attached.borrow_mut();
        if attached {
            a.insert(id.to_owned())
        } else {
            a.remove(id)
        };
    }
    /// Report `healthy` replicas for a volume (a degraded set when below its replica count).
    pub fn set_healthy(&self, id: &str, healthy: u32) {
        if let Some(s) = self.sets.borrow_mut().get_mut(id) {
            s.set.healthy = healthy;
        }
    }
    pub fn fail_next(&self, op: &str, error: Error) {
        self.journal.fail_next(op, error)
    }

    /// Free bytes of a node: its size minus every replica on it.
    fn free(&self, node: &str) -> u64 {
        let total = self.nodes.borrow().get(node).map_or(0, |n| n.total_bytes);
        let used: u64 = self
            .sets
            .borrow()
            .values()
            .filter(|s| s.set.replicas.iter().any(|r| r == node))
            .map(|s| s.set.size_bytes)
            .sum();
        total.saturating_sub(used)
    }

    fn need_room(&self, nodes: &[String], bytes: u64) -> Result<(), Error> {
        match nodes.iter().find(|n| self.free(n) < bytes) {
            Some(n) => {
                Err(Error::ResourceExhausted(format!("node {n} has {} bytes free, {bytes} needed", self.free(n))))
            }
            None => Ok(()),
        }
    }
}

impl Block for FakeBlock {
    fn list_nodes(&self) -> Result<Vec<NodeInfo>, Error> {
        self.journal.enter("list_nodes")?;
        let nodes = self.nodes.borrow();
        Ok(nodes
            .iter()
            .map(|(name, n)| NodeInfo {
                name: name.clone(),
                free_bytes: self.free(name),
                total_bytes: n.total_bytes,
                labels: n.labels.clone(),
            })
            .collect())
    }
    fn create(
        &self,
        id: &str,
        size_bytes: u64,
        nodes: &[String],
        from_snapshot: Option<&str>,
        from_volume: Option<&str>,
    ) -> Result<ReplicaSet, Error> {
        self.journal.enter("create")?;
        if let Some(s) = self.sets.borrow().get(id) {
            return if s.set.size_bytes == size_bytes {
                Ok(s.set.clone())
            } else {
                Err(Error::AlreadyExists(format!("replica set {id} exists with {} bytes", s.set.size_bytes)))
            };
        }
        if nodes.is_empty() || nodes.iter().collect::<BTreeSet<_>>().len() != nodes.len() {
            return Err(Error::InvalidArgument(format!(
                "replica set {id}: nodes {nodes:?} must be one or more distinct nodes"
            )));
        }
        if let Some(n) = nodes.iter().find(|n| !self.nodes.borrow().contains_key(*n)) {
            return Err(Error::PermissionDenied(format!("node {n} is not granted to this backend")));
        }
        let source_size = match (from_snapshot, from_volume) {
            (Some(_), Some(_)) => return Err(Error::InvalidArgument(format!("replica set {id}: two sources"))),
            (Some(s), None) => Some(
                self.snapshots
                    .borrow()
                    .get(s)
                    .map(|x| x.size_bytes)
                    .ok_or_else(|| Error::NotFound(format!("snapshot {s} not found")))?,
            ),
            (None, Some(v)) => Some(
                self.sets
                    .borrow()
                    .get(v)
                    .map(|x| x.set.size_bytes)
                    .ok_or_else(|| Error::NotFound(format!("volume {v} not found")))?,
            ),
            (None, None) => None,
        };
        if let Some(src) = source_size.filter(|s| *s > size_bytes) {
            return Err(Error::OutOfRange(format!(
                "replica set {id}: {size_bytes} bytes is smaller than its source's {src}"
            )));
        }
        self.need_room(nodes, size_bytes)?;
        let set = ReplicaSet { id: id.to_owned(), size_bytes, replicas: nodes.to_vec(), healthy: nodes.len() as u32 };
        let fake = FakeReplicaSet {
            set: set.clone(),
            from_snapshot: from_snapshot.map(str::to_owned),
            from_volume: from_volume.map(str::to_owned),
        };
        self.sets.borrow_mut().insert(id.to_owned(), fake);
        Ok(set)
    }
    fn get(&self, id: &str) -> Result<Option<ReplicaSet>, Error> {
        self.journal.enter("get")?;
        Ok(self.sets.borrow().get(id).map(|s| s.set.clone()))
    }
    fn delete(&self, id: &str) -> Result<(), Error> {
        self.journal.enter("delete")?;
        if self.attached.borrow().contains(id) {
            return Err(Error::FailedPrecondition(format!("replica set {id} is attached")));
        }
        self.sets.borrow_mut().remove(id);
        Ok(())
    }
    fn expand(&self, id: &str, size_bytes: u64) -> Result<ReplicaSet, Error> {
        self.journal.enter("expand")?;
        let (have, nodes) = match self.sets.borrow().get(id) {
            Some(s) => (s.set.size_bytes, s.set.replicas.clone()),
            None => return Err(Error::NotFound(format!("replica set {id} not found"))),
        };
        if size_bytes < have {
            return Err(Error::OutOfRange(format!(
                "replica set {id} has {have} bytes; shrinking to {size_bytes} is not supported"
            )));
        }
        self.need_room(&nodes, size_bytes - have)?;
        let mut sets = self.sets.borrow_mut();
        let s = sets.get_mut(id).ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        s.set.size_bytes = size_bytes;
        Ok(s.set.clone())
    }
    fn snapshot(&self, id: &str, snapshot_id: &str) -> Result<BlockSnapshot, Error> {
        self.journal.enter("snapshot")?;
        let size = self
            .sets
            .borrow()
            .get(id)
            .map(|s| s.set.size_bytes)
            .ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        let mut snaps = self.snapshots.borrow_mut();
        match snaps.get(snapshot_id) {
            Some(s) if s.volume_id == id => Ok(s.clone()),
            Some(s) => Err(Error::AlreadyExists(format!("snapshot {snapshot_id} exists of {}", s.volume_id))),
            None => {
                let s = BlockSnapshot {
                    id: snapshot_id.to_owned(),
                    volume_id: id.to_owned(),
                    size_bytes: size,
                    created: self.clock.now(),
                };
                snaps.insert(snapshot_id.to_owned(), s.clone());
                Ok(s)
            }
        }
    }
    fn delete_snapshot(&self, snapshot_id: &str) -> Result<(), Error> {
        self.journal.enter("delete_snapshot")?;
        self.snapshots.borrow_mut().remove(snapshot_id);
        Ok(())
    }
    fn list_snapshots(&self, volume_id: Option<&str>) -> Result<Vec<BlockSnapshot>, Error> {
        self.journal.enter("list_snapshots")?;
        Ok(self.snapshots.borrow().values().filter(|s| volume_id.is_none_or(|v| v == s.volume_id)).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn replica_sets_take_space_on_their_nodes_and_follow_the_wit() {
        let b = FakeBlock::default();
        b.add_node("n1", 100, &[("zone", "a")]).add_node("n2", 50, &[]);
        let set = b.create("v", 40, &nodes(&["n1", "n2"]), None, None).expect("create");
        assert_eq!((set.replicas.len(), set.healthy), (2, 2));
        assert_eq!(b.create("v", 40, &nodes(&["n1"]), None, None), Ok(set.clone()), "same id and size again");
        assert!(matches!(b.create("v", 41, &nodes(&["n1"]), None, None), Err(Error::AlreadyExists(_))));
        assert!(matches!(b.create("w", 20, &nodes(&["n2"]), None, None), Err(Error::ResourceExhausted(_))));
        assert!(matches!(b.create("w", 1, &nodes(&["n3"]), None, None), Err(Error::PermissionDenied(_))));
        assert!(matches!(b.create("w", 1, &nodes(&["n1", "n1"]), None, None), Err(Error::InvalidArgument(_))));
        assert!(matches!(b.create("w", 1, &nodes(&["n1"]), Some("nope"), None), Err(Error::NotFound(_))));
        assert_eq!(b.list_nodes().expect("nodes").iter().map(|n| n.free_bytes).collect::<Vec<_>>(), [60, 10]);
        b.snapshot("v", "s1").expect("snapshot");
        assert_eq!(b.snapshot("v", "s1").map(|s| s.volume_id), Ok("v".to_owned()), "same snapshot again");
        assert!(matches!(b.create("c", 10, &nodes(&["n1"]), Some("s1"), None), Err(Error::OutOfRange(_))));
        b.create("c", 40, &nodes(&["n1"]), Some("s1"), None).expect("from a snapshot");
        assert_eq!(b.replica_set("c").and_then(|s| s.from_snapshot), Some("s1".to_owned()));
        assert!(matches!(b.expand("v", 39), Err(Error::OutOfRange(_))));
        assert!(matches!(b.expand("v", 60), Err(Error::ResourceExhausted(_))), "n2 has 10 bytes free");
        assert_eq!(b.expand("v", 50).map(|s| s.size_bytes), Ok(50));
        b.attach("v", true);
        assert!(matches!(b.delete("v"), Err(Error::FailedPrecondition(_))));
        b.attach("v", false);
        b.delete("v").expect("delete");
        b.delete("v").expect("absent");
        assert_eq!(b.list_snapshots(Some("v")).map(|s| s.len()), Ok(1), "snapshots outlive their volume");
        b.delete_snapshot("s1").expect("delete snapshot");
        assert_eq!(b.list_snapshots(None), Ok(vec![]));
    }
}
