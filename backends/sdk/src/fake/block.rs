//! The fake `block`: granted nodes with a size and labels each, and replica sets that take
//! `size` bytes on every node holding one of their replicas. Follows the WIT's `block`
//! interface; where it is silent the fake chooses, and says so here: a fill from a source is
//! instant (`filling` is always `none`); snapshots take no space and go with their set. Tests
//! mark a set attached ([`FakeBlock::attach`]: delete is then failed-precondition) and change a
//! replica's state ([`FakeBlock::set_state`], e.g. unreachable since a given time).
//!
//! Like the wasmcsi host today, every node has one disk, [`FakeBlock::DISK`] (a placement names
//! it or none; any other is invalid-argument naming it), and what the host does not provide
//! answers as the host does (`unimplemented`, "… not provided by this host"): `add-replica`,
//! `remove-replica`, `snapshot-group`, `follow`, `activate` and filling from a backup. A
//! backend's tests thus see what it would see on the host. `set-limits` stores the limits in the
//! set, as the host's record does.
//!
//! Written to be extended with the interface: one method per WIT function, state in plain maps.
use super::{Clock, Journal};
use crate::block::{
    Block, BlockSnapshot, BlockSource, DiskInfo, NodeInfo, Placement, Replica, ReplicaSet, ReplicaState,
};
use crate::types::{Error, IoLimits, Pair, Timestamp};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

/// The WIT's bound on a set's metadata (keys and values, in all).
const MAX_METADATA_BYTES: usize = 8 << 10;

/// A replica set as the fake holds it: the engine's view and what it was filled from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeReplicaSet {
    pub set: ReplicaSet,
    pub source: Option<BlockSource>,
}

/// A granted node: its size and labels.
#[derive(Debug, Clone)]
struct FakeNode {
    total_bytes: u64,
    labels: Vec<Pair>,
}

#[derive(Debug, Default)]
pub struct FakeBlock {
    nodes: RefCell<BTreeMap<String, FakeNode>>,
    sets: RefCell<BTreeMap<String, FakeReplicaSet>>,
    /// By (volume id, snapshot name).
    snapshots: RefCell<BTreeMap<(String, String), BlockSnapshot>>,
    clock: Clock,
    pub journal: Journal,
}

fn healthy(node: &str) -> Replica {
    Replica {
        node: node.to_owned(),
        disk: Some(FakeBlock::DISK.to_owned()),
        state: ReplicaState::Healthy,
        down_since: None,
        rebuilt_bytes: 0,
        rebuild_total_bytes: 0,
    }
}

fn metadata_bytes(metadata: &[Pair]) -> usize {
    metadata.iter().map(|p| p.key.len() + p.value.len()).sum()
}

/// What the host answers for a function it does not provide.
fn not_provided(what: &str) -> Error {
    Error::Unimplemented(format!("{what}: not provided by this host"))
}

/// The nodes of `placements`, once each names the one disk of its node or none, and no two
/// fall on one disk (as the host checks them).
fn placed_nodes(placements: &[Placement]) -> Result<Vec<String>, Error> {
    let mut nodes: Vec<String> = vec![];
    for p in placements {
        let node = placed_node(p)?;
        if nodes.iter().any(|n| n == node) {
            return Err(Error::InvalidArgument(format!(
                "two placements on disk {} of node {node} (replicas of a set need distinct disks)",
                FakeBlock::DISK
            )));
        }
        nodes.push(node.to_owned());
    }
    Ok(nodes)
}

fn placed_node(p: &Placement) -> Result<&str, Error> {
    match p.disk.as_deref() {
        None => Ok(&p.node),
        Some(d) if d == FakeBlock::DISK => Ok(&p.node),
        Some(d) => Err(Error::InvalidArgument(format!(
            "placement on node {}: disk {d:?} does not exist there (its disks: {})",
            p.node,
            FakeBlock::DISK
        ))),
    }
}

impl FakeBlock {
    /// The one disk of every node, as the host names it.
    pub const DISK: &'static str = "default";

    /// Grant a node of `total_bytes` with labels.
    pub fn add_node(&self, name: &str, total_bytes: u64, labels: &[(&str, &str)]) -> &Self {
        let labels = labels.iter().map(|(k, v)| Pair { key: (*k).to_owned(), value: (*v).to_owned() }).collect();
        self.nodes.borrow_mut().insert(name.to_owned(), FakeNode { total_bytes, labels });
        self
    }
    /// Take a node away (its replicas stay in their sets, as on a node that left discovery).
    pub fn remove_node(&self, name: &str) {
        self.nodes.borrow_mut().remove(name);
    }
    /// A replica set, for assertions.
    pub fn replica_set(&self, id: &str) -> Option<FakeReplicaSet> {
        self.sets.borrow().get(id).cloned()
    }
    /// Mark a set attached to `node` (its delete fails), or detached with `None`.
    pub fn attach(&self, id: &str, node: Option<&str>) {
        if let Some(s) = self.sets.borrow_mut().get_mut(id) {
            s.set.attached_to = node.map(str::to_owned);
        }
    }
    /// Set the state of the replica of `id` on `node`, not healthy since `since`.
    pub fn set_state(&self, id: &str, node: &str, state: ReplicaState, since: Option<Timestamp>) {
        if let Some(s) = self.sets.borrow_mut().get_mut(id) {
            for r in s.set.replicas.iter_mut().filter(|r| r.node == node) {
                r.state = state;
                r.down_since = since;
            }
        }
    }
    pub fn fail_next(&self, op: &str, error: Error) {
        self.journal.fail_next(op, error)
    }

    /// Free bytes of a node: its size minus every replica on it.
    fn free(&self, node: &str) -> u64 {
        let total = self.nodes.borrow().get(node).map_or(0, |n| n.total_bytes);
        total.saturating_sub(self.used(node))
    }

    fn used(&self, node: &str) -> u64 {
        let sets = self.sets.borrow();
        sets.values().filter(|s| s.set.replicas.iter().any(|r| r.node == node)).map(|s| s.set.size_bytes).sum()
    }

    fn need_room(&self, nodes: &[String], bytes: u64) -> Result<(), Error> {
        match nodes.iter().find(|n| self.free(n) < bytes) {
            Some(n) => {
                Err(Error::ResourceExhausted(format!("node {n} has {} bytes free, {bytes} needed", self.free(n))))
            }
            None => Ok(()),
        }
    }

    fn granted(&self, node: &str) -> Result<(), Error> {
        match self.nodes.borrow().contains_key(node) {
            true => Ok(()),
            false => Err(Error::PermissionDenied(format!("node {node} is not granted to this backend"))),
        }
    }

    fn source_size(&self, source: &BlockSource) -> Result<u64, Error> {
        match source {
            BlockSource::Snapshot((volume, name)) => self
                .snapshots
                .borrow()
                .get(&(volume.clone(), name.clone()))
                .map(|s| s.size_bytes)
                .ok_or_else(|| Error::NotFound(format!("snapshot {name} of {volume} not found"))),
            BlockSource::Volume(v) => self
                .sets
                .borrow()
                .get(v)
                .map(|s| s.set.size_bytes)
                .ok_or_else(|| Error::NotFound(format!("volume {v} not found"))),
            BlockSource::Backup((target, id)) => Err(Error::NotFound(format!("backup {id} on {target} not found"))),
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
                replicas: self.sets.borrow().values().filter(|s| s.set.replicas.iter().any(|r| &r.node == name)).count()
                    as u32,
                disks: vec![DiskInfo {
                    name: Self::DISK.to_owned(),
                    free_bytes: self.free(name),
                    total_bytes: n.total_bytes,
                }],
            })
            .collect())
    }
    fn create(
        &self,
        id: &str,
        size_bytes: u64,
        placements: &[Placement],
        source: Option<&BlockSource>,
        metadata: &[Pair],
    ) -> Result<ReplicaSet, Error> {
        self.journal.enter("create")?;
        let placed = placed_nodes(placements)?;
        let nodes = placed.as_slice();
        if matches!(source, Some(BlockSource::Backup(_))) {
            return Err(not_provided("block create from a backup: restores from backups"));
        }
        if let Some(s) = self.sets.borrow().get(id) {
            return if s.set.size_bytes == size_bytes {
                Ok(s.set.clone())
            } else {
                Err(Error::AlreadyExists(format!("replica set {id} exists with {} bytes", s.set.size_bytes)))
            };
        }
        if size_bytes == 0 || !size_bytes.is_multiple_of(4096) {
            return Err(Error::InvalidArgument(format!("replica set {id}: {size_bytes} is not a multiple of 4096")));
        }
        if nodes.is_empty() || nodes.iter().collect::<BTreeSet<_>>().len() != nodes.len() {
            return Err(Error::InvalidArgument(format!(
                "replica set {id}: nodes {nodes:?} must be one or more distinct nodes"
            )));
        }
        if metadata_bytes(metadata) > MAX_METADATA_BYTES {
            return Err(Error::InvalidArgument(format!("replica set {id}: metadata over 8 KiB")));
        }
        nodes.iter().try_for_each(|n| self.granted(n))?;
        if let Some(src) = source {
            let have = self.source_size(src)?;
            if have > size_bytes {
                return Err(Error::OutOfRange(format!(
                    "replica set {id}: {size_bytes} bytes is smaller than its source's {have}"
                )));
            }
        }
        self.need_room(nodes, size_bytes)?;
        let set = ReplicaSet {
            id: id.to_owned(),
            size_bytes,
            replicas: nodes.iter().map(|n| healthy(n)).collect(),
            attached_to: None,
            metadata: metadata.to_vec(),
            created: self.clock.now(),
            filling: None,
            limits: IoLimits::UNLIMITED,
            rebuild_bytes_per_second: 0,
            standby: None,
        };
        let fake = FakeReplicaSet { set: set.clone(), source: source.cloned() };
        self.sets.borrow_mut().insert(id.to_owned(), fake);
        Ok(set)
    }
    fn get(&self, id: &str) -> Result<Option<ReplicaSet>, Error> {
        self.journal.enter("get")?;
        Ok(self.sets.borrow().get(id).map(|s| s.set.clone()))
    }
    fn list_sets(&self, start_after: Option<&str>, limit: u32) -> Result<Vec<ReplicaSet>, Error> {
        self.journal.enter("list_sets")?;
        let sets = self.sets.borrow();
        Ok(sets
            .iter()
            .filter(|(id, _)| start_after.is_none_or(|a| id.as_str() > a))
            .take(limit as usize)
            .map(|(_, s)| s.set.clone())
            .collect())
    }
    fn set_metadata(&self, id: &str, metadata: &[Pair]) -> Result<(), Error> {
        self.journal.enter("set_metadata")?;
        if metadata_bytes(metadata) > MAX_METADATA_BYTES {
            return Err(Error::InvalidArgument(format!("replica set {id}: metadata over 8 KiB")));
        }
        let mut sets = self.sets.borrow_mut();
        let s = sets.get_mut(id).ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        s.set.metadata = metadata.to_vec();
        Ok(())
    }
    fn delete(&self, id: &str) -> Result<(), Error> {
        self.journal.enter("delete")?;
        if let Some(node) = self.sets.borrow().get(id).and_then(|s| s.set.attached_to.clone()) {
            return Err(Error::FailedPrecondition(format!("replica set {id} is attached to {node}")));
        }
        self.sets.borrow_mut().remove(id);
        self.snapshots.borrow_mut().retain(|(v, _), _| v != id);
        Ok(())
    }
    fn expand(&self, id: &str, size_bytes: u64) -> Result<ReplicaSet, Error> {
        self.journal.enter("expand")?;
        let (have, nodes) = match self.sets.borrow().get(id) {
            Some(s) => (s.set.size_bytes, s.set.replicas.iter().map(|r| r.node.clone()).collect::<Vec<_>>()),
            None => return Err(Error::NotFound(format!("replica set {id} not found"))),
        };
        if size_bytes < have {
            return Err(Error::OutOfRange(format!(
                "replica set {id} has {have} bytes; shrinking to {size_bytes} is not supported"
            )));
        }
        if !size_bytes.is_multiple_of(4096) {
            return Err(Error::InvalidArgument(format!("replica set {id}: {size_bytes} is not a multiple of 4096")));
        }
        self.need_room(&nodes, size_bytes - have)?;
        let mut sets = self.sets.borrow_mut();
        let s = sets.get_mut(id).ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        s.set.size_bytes = size_bytes;
        Ok(s.set.clone())
    }
    fn replace(&self, id: &str, replica: &Placement, with: &Placement) -> Result<ReplicaSet, Error> {
        self.journal.enter("replace")?;
        let (node, with) = (placed_node(replica)?, placed_node(with)?);
        self.granted(with)?;
        let (size, members) = match self.sets.borrow().get(id) {
            Some(s) => (s.set.size_bytes, s.set.replicas.iter().map(|r| r.node.clone()).collect::<Vec<_>>()),
            None => return Err(Error::NotFound(format!("replica set {id} not found"))),
        };
        if !members.iter().any(|m| m == node) {
            return Err(Error::NotFound(format!("replica set {id} has no replica on {node}")));
        }
        if members.iter().any(|m| m == with) {
            return Err(Error::InvalidArgument(format!("replica set {id} already has a replica on {with}")));
        }
        self.need_room(&[with.to_owned()], size)?;
        let mut sets = self.sets.borrow_mut();
        let s = sets.get_mut(id).ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        for r in s.set.replicas.iter_mut().filter(|r| r.node == node) {
            *r = healthy(with);
        }
        Ok(s.set.clone())
    }
    fn snapshot(&self, id: &str, name: &str) -> Result<BlockSnapshot, Error> {
        self.journal.enter("snapshot")?;
        let size = self
            .sets
            .borrow()
            .get(id)
            .map(|s| s.set.size_bytes)
            .ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        let mut snaps = self.snapshots.borrow_mut();
        let s = snaps.entry((id.to_owned(), name.to_owned())).or_insert_with(|| BlockSnapshot {
            name: name.to_owned(),
            volume_id: id.to_owned(),
            size_bytes: size,
            created: self.clock.now(),
        });
        Ok(s.clone())
    }
    fn delete_snapshot(&self, id: &str, name: &str) -> Result<(), Error> {
        self.journal.enter("delete_snapshot")?;
        self.snapshots.borrow_mut().remove(&(id.to_owned(), name.to_owned()));
        Ok(())
    }
    fn list_snapshots(&self, id: Option<&str>) -> Result<Vec<BlockSnapshot>, Error> {
        self.journal.enter("list_snapshots")?;
        let mut all: Vec<BlockSnapshot> =
            self.snapshots.borrow().values().filter(|s| id.is_none_or(|v| v == s.volume_id)).cloned().collect();
        all.sort_by_key(|s| (s.created.seconds, s.created.nanos));
        Ok(all)
    }
    fn set_limits(&self, id: &str, limits: &IoLimits, rebuild_bytes_per_second: u64) -> Result<ReplicaSet, Error> {
        self.journal.enter("set_limits")?;
        let mut sets = self.sets.borrow_mut();
        let s = sets.get_mut(id).ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        s.set.limits = *limits;
        s.set.rebuild_bytes_per_second = rebuild_bytes_per_second;
        Ok(s.set.clone())
    }
    /// The new replica is `Rebuilding` (a test makes it healthy, as a finished rebuild would).
    fn add_replica(&self, id: &str, placement: &Placement) -> Result<ReplicaSet, Error> {
        self.journal.enter("add_replica")?;
        let node = placed_node(placement)?;
        self.granted(node)?;
        let (size, held) = match self.sets.borrow().get(id) {
            Some(s) => (s.set.size_bytes, s.set.replicas.iter().any(|r| r.node == node)),
            None => return Err(Error::NotFound(format!("replica set {id} not found"))),
        };
        if !held {
            self.need_room(&[node.to_owned()], size)?;
        }
        let mut sets = self.sets.borrow_mut();
        let s = sets.get_mut(id).ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        if !held {
            s.set.replicas.push(Replica { state: ReplicaState::Rebuilding, ..healthy(node) });
        }
        Ok(s.set.clone())
    }
    /// As the host: only once every other replica is healthy, never the last one.
    fn remove_replica(&self, id: &str, replica: &Placement) -> Result<ReplicaSet, Error> {
        self.journal.enter("remove_replica")?;
        let node = placed_node(replica)?;
        let mut sets = self.sets.borrow_mut();
        let s = sets.get_mut(id).ok_or_else(|| Error::NotFound(format!("replica set {id} not found")))?;
        let Some(i) = s.set.replicas.iter().position(|r| r.node == node) else { return Ok(s.set.clone()) };
        if s.set.replicas.len() == 1 {
            return Err(Error::FailedPrecondition(format!("the replica on {node} is the only one of {id}")));
        }
        if let Some(other) =
            s.set.replicas.iter().enumerate().find(|(j, r)| *j != i && r.state != ReplicaState::Healthy)
        {
            return Err(Error::Aborted(format!("the replica on {} of {id} is not healthy yet", other.1.node)));
        }
        s.set.replicas.remove(i);
        Ok(s.set.clone())
    }
    /// Every set's snapshot, or none: the sets are checked before any is taken.
    fn snapshot_group(&self, ids: &[String], name: &str) -> Result<Vec<BlockSnapshot>, Error> {
        self.journal.enter("snapshot_group")?;
        let mut seen = std::collections::BTreeSet::new();
        if ids.is_empty() || !ids.iter().all(|id| seen.insert(id)) {
            return Err(Error::InvalidArgument("a group names some sets, each once".into()));
        }
        if let Some(missing) = ids.iter().find(|id| !self.sets.borrow().contains_key(id.as_str())) {
            return Err(Error::NotFound(format!("replica set {missing} not found")));
        }
        ids.iter().map(|id| self.snapshot(id, name)).collect()
    }
    fn follow(&self, _: &str, _: &str, _: &str) -> Result<ReplicaSet, Error> {
        self.journal.enter("follow")?;
        Err(not_provided("block follow: standby volumes"))
    }
    fn activate(&self, _: &str) -> Result<ReplicaSet, Error> {
        self.journal.enter("activate")?;
        Err(not_provided("block activate: standby volumes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: u64 = 4096;

    fn nodes(names: &[&str]) -> Vec<Placement> {
        names.iter().map(|n| Placement::on(*n)).collect()
    }

    #[test]
    fn replica_sets_take_space_on_their_nodes_and_follow_the_wit() {
        let b = FakeBlock::default();
        b.add_node("n1", 100 * B, &[("zone", "a")]).add_node("n2", 50 * B, &[]);
        let set = b.create("v", 40 * B, &nodes(&["n1", "n2"]), None, &[]).expect("create");
        assert_eq!(set.replicas.iter().filter(|r| r.state == ReplicaState::Healthy).count(), 2);
        assert_eq!(b.create("v", 40 * B, &nodes(&["n1"]), None, &[]), Ok(set.clone()), "same id and size again");
        assert!(matches!(b.create("v", 41 * B, &nodes(&["n1"]), None, &[]), Err(Error::AlreadyExists(_))));
        assert!(matches!(b.create("w", 20 * B, &nodes(&["n2"]), None, &[]), Err(Error::ResourceExhausted(_))));
        assert!(matches!(b.create("w", B, &nodes(&["n3"]), None, &[]), Err(Error::PermissionDenied(_))));
        assert!(matches!(b.create("w", B, &nodes(&["n1", "n1"]), None, &[]), Err(Error::InvalidArgument(_))));
        assert!(matches!(b.create("w", 100, &nodes(&["n1"]), None, &[]), Err(Error::InvalidArgument(_))));
        let missing = BlockSource::Snapshot(("v".into(), "nope".into()));
        assert!(matches!(b.create("w", B, &nodes(&["n1"]), Some(&missing), &[]), Err(Error::NotFound(_))));
        let free: Vec<u64> = b.list_nodes().expect("nodes").iter().map(|n| n.free_bytes).collect();
        assert_eq!(free, [60 * B, 10 * B]);
        b.snapshot("v", "s1").expect("snapshot");
        assert_eq!(b.snapshot("v", "s1").map(|s| s.volume_id), Ok("v".to_owned()), "same snapshot again");
        let s1 = BlockSource::Snapshot(("v".into(), "s1".into()));
        assert!(matches!(b.create("c", 10 * B, &nodes(&["n1"]), Some(&s1), &[]), Err(Error::OutOfRange(_))));
        b.create("c", 40 * B, &nodes(&["n1"]), Some(&s1), &[]).expect("from a snapshot");
        assert_eq!(b.replica_set("c").and_then(|s| s.source), Some(s1));
        assert!(matches!(b.expand("v", 39 * B), Err(Error::OutOfRange(_))));
        assert!(matches!(b.expand("v", 60 * B), Err(Error::ResourceExhausted(_))), "n2 has 10 blocks free");
        assert_eq!(b.expand("v", 50 * B).map(|s| s.size_bytes), Ok(50 * B));
        let page = b.list_sets(None, 1).expect("page");
        assert_eq!(page.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["c"]);
        let rest = b.list_sets(Some("c"), 10).expect("rest");
        assert_eq!(rest.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["v"]);
        b.attach("v", Some("n1"));
        assert!(matches!(b.delete("v"), Err(Error::FailedPrecondition(_))));
        b.attach("v", None);
        b.delete("v").expect("delete");
        b.delete("v").expect("absent");
        assert_eq!(b.list_snapshots(Some("v")), Ok(vec![]), "snapshots go with their set");
    }

    #[test]
    fn a_replica_moves_to_an_empty_granted_node() {
        let b = FakeBlock::default();
        b.add_node("n1", 10 * B, &[]).add_node("n2", 10 * B, &[]).add_node("n3", 10 * B, &[]);
        b.create("v", B, &nodes(&["n1", "n2"]), None, &[]).expect("create");
        b.set_state("v", "n2", ReplicaState::Unreachable, Some(Timestamp { seconds: 1, nanos: 0 }));
        let on = Placement::on;
        assert!(matches!(b.replace("v", &on("n3"), &on("n1")), Err(Error::NotFound(_))), "no replica on n3");
        assert!(matches!(b.replace("v", &on("n2"), &on("n1")), Err(Error::InvalidArgument(_))), "n1 holds one");
        assert!(matches!(b.replace("v", &on("n2"), &on("n4")), Err(Error::PermissionDenied(_))));
        let set = b.replace("v", &on("n2"), &on("n3")).expect("replace");
        let on: Vec<(&str, ReplicaState)> = set.replicas.iter().map(|r| (r.node.as_str(), r.state)).collect();
        assert_eq!(on, [("n1", ReplicaState::Healthy), ("n3", ReplicaState::Healthy)]);
    }

    #[test]
    fn every_node_has_one_disk_and_a_placement_names_it_or_none() {
        let b = FakeBlock::default();
        b.add_node("n1", 10 * B, &[]).add_node("n2", 10 * B, &[]);
        let nodes = b.list_nodes().expect("nodes");
        let disks: Vec<(&str, u64)> = nodes[0].disks.iter().map(|d| (d.name.as_str(), d.total_bytes)).collect();
        assert_eq!(disks, [(FakeBlock::DISK, 10 * B)]);
        let on_disk = Placement { node: "n2".into(), disk: Some(FakeBlock::DISK.into()) };
        let set = b.create("v", B, &[Placement::on("n1"), on_disk], None, &[]).expect("create");
        assert!(set.replicas.iter().all(|r| r.disk.as_deref() == Some(FakeBlock::DISK)), "{set:?}");
        let elsewhere = Placement { node: "n1".into(), disk: Some("ssd".into()) };
        let e = b.create("w", B, &[elsewhere], None, &[]).expect_err("no such disk");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("\"ssd\"")), "{e:?}");
    }

    #[test]
    fn what_the_host_does_not_provide_answers_as_the_host_does() {
        let b = FakeBlock::default();
        b.add_node("n1", 10 * B, &[]);
        b.create("v", B, &nodes(&["n1"]), None, &[]).expect("create");
        let backup = BlockSource::Backup(("t".into(), "b".into()));
        let limits = IoLimits { write_iops: 7, ..IoLimits::UNLIMITED };
        assert_eq!(b.set_limits("v", &limits, 3).expect("limits are provided").limits, limits);
        let set = b.get("v").expect("get").expect("the set");
        assert_eq!((set.limits, set.rebuild_bytes_per_second), (limits, 3));
        assert!(matches!(b.set_limits("w", &limits, 0), Err(Error::NotFound(_))));
        // Adding and removing replicas, as the host: idempotent, the last one kept.
        b.add_node("n2", 10 * B, &[]);
        assert_eq!(b.add_replica("v", &Placement::on("n1")).expect("held: a retry").replicas.len(), 1);
        let grown = b.add_replica("v", &Placement::on("n2")).expect("added");
        assert_eq!(grown.replicas[1].state, ReplicaState::Rebuilding);
        let e = b.remove_replica("v", &Placement::on("n1")).expect_err("n2 is rebuilding");
        assert!(matches!(&e, Error::Aborted(m) if m.contains("n2")), "{e:?}");
        b.set_state("v", "n2", ReplicaState::Healthy, None);
        assert_eq!(b.remove_replica("v", &Placement::on("n1")).expect("removed").replicas.len(), 1);
        assert_eq!(b.remove_replica("v", &Placement::on("n1")).expect("absent").replicas.len(), 1);
        let e = b.remove_replica("v", &Placement::on("n2")).expect_err("the last one");
        assert!(matches!(&e, Error::FailedPrecondition(_)), "{e:?}");
        let answers = [
            b.follow("v", "t", "src").map(drop),
            b.activate("v").map(drop),
            b.create("w", B, &nodes(&["n1"]), Some(&backup), &[]).map(drop),
        ];
        for a in answers {
            assert!(matches!(&a, Err(Error::Unimplemented(m)) if m.ends_with("not provided by this host")), "{a:?}");
        }
    }
}
