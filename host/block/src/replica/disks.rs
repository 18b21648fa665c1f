//! `ReplicaDisks`: the disks of one replica server, each a [`ReplicaNode`] (a replica root) under
//! a name. Every server has the disk [`DEFAULT_DISK`] (its `--replica-root`); a node with several
//! disks serves more roots under names of their own. A volume has at most one replica per
//! server, on whichever disk it was created: a request naming a volume (`Hello`, `Describe`,
//! `SetRecord`, `DeleteReplica`) goes to the disk holding its replica; only a create names the
//! disk (`CreateReplicaOn`). This module owns the names and that lookup, not the replicas (that
//! is `node`).

use std::sync::Arc;

use super::node::{NodeError, NodeReport, Replica, ReplicaNode};
use super::store::ReplicaStore;

/// The disk every replica server has: its `--replica-root`, and what a replica created without
/// naming a disk (`CreateReplica`) and a record member without one mean.
pub const DEFAULT_DISK: &str = "default";

/// Longest disk name: a DNS label, so it fits every name it ends up in.
const MAX_DISK_NAME: usize = 63;

/// Whether `name` can name a disk: a DNS label (lowercase letters, digits and `-`, starting and
/// ending with a letter or digit, at most 63).
pub fn is_disk_name(name: &str) -> bool {
    (1..=MAX_DISK_NAME).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// One disk as [`ReplicaDisks::report`] gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskReport {
    pub name: String,
    pub report: NodeReport,
}

/// Every disk of a replica server, [`DEFAULT_DISK`] first.
#[derive(Debug, Clone)]
pub struct ReplicaDisks {
    disks: Vec<(String, Arc<ReplicaNode>)>,
}

impl ReplicaDisks {
    /// A server's disks: `default`, and `more` under their names (distinct, not `default`, each
    /// [`is_disk_name`]). A volume whose replica is found on two of them is refused: which one
    /// is the replica could not be told.
    pub fn new(default: Arc<ReplicaNode>, more: Vec<(String, Arc<ReplicaNode>)>) -> Result<Self, NodeError> {
        let mut disks = vec![(DEFAULT_DISK.to_owned(), default)];
        for (name, node) in more {
            if !is_disk_name(&name) || disks.iter().any(|(n, _)| *n == name) {
                return Err(NodeError::InvalidDisk(name));
            }
            disks.push((name, node));
        }
        let this = Self { disks };
        for (name, node) in &this.disks {
            for volume_id in node.volume_ids() {
                let holders: Vec<&str> =
                    this.disks.iter().filter(|(_, n)| n.holds(&volume_id)).map(|(n, _)| n.as_str()).collect();
                if holders.len() > 1 && holders[0] == name {
                    return Err(NodeError::OnTwoDisks { volume_id, disks: holders.join(", ") });
                }
            }
        }
        Ok(this)
    }

    /// One disk, `default`.
    pub fn single(default: Arc<ReplicaNode>) -> Self {
        Self { disks: vec![(DEFAULT_DISK.to_owned(), default)] }
    }

    pub fn default_disk(&self) -> &Arc<ReplicaNode> {
        &self.disks[0].1
    }

    pub fn get(&self, name: &str) -> Option<&Arc<ReplicaNode>> {
        self.disks.iter().find(|(n, _)| n == name).map(|(_, node)| node)
    }

    /// The disks' names, `default` first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.disks.iter().map(|(n, _)| n.as_str())
    }

    /// The disk holding `volume_id`'s replica (opening or not), with its name; `default` when
    /// none does (where a request for it is answered `NotFound`).
    pub fn holding(&self, volume_id: &str) -> (&str, &Arc<ReplicaNode>) {
        self.disks
            .iter()
            .find(|(_, node)| node.holds(volume_id))
            .map_or((DEFAULT_DISK, self.default_disk()), |(name, node)| (name.as_str(), node))
    }

    /// The replica of `volume_id`, on whichever disk, if it opens.
    pub fn replica(&self, volume_id: &str) -> Option<Arc<Replica>> {
        self.holding(volume_id).1.replica(volume_id)
    }

    /// The store of `volume_id`'s replica, on whichever disk.
    pub fn store(&self, volume_id: &str) -> Option<Arc<ReplicaStore>> {
        self.holding(volume_id).1.store(volume_id)
    }

    /// Creates an empty replica on `disk` (see [`ReplicaNode::create_replica`]).
    /// [`NodeError::NoSuchDisk`] when the server has no such disk, [`NodeError::AlreadyExists`]
    /// when another disk holds a replica of the volume (one replica per server).
    pub fn create_replica(&self, disk: &str, volume_id: &str, size: u64) -> Result<Arc<ReplicaStore>, NodeError> {
        let Some(node) = self.get(disk) else { return Err(NodeError::NoSuchDisk(disk.to_owned())) };
        let (holder, held) = self.holding(volume_id);
        if holder != disk && held.holds(volume_id) {
            let size = held.store(volume_id).map_or(0, |s| s.header().size);
            tracing::info!(replica.volume = volume_id, disk, holder, "replica exists on another disk");
            return Err(NodeError::AlreadyExists { volume_id: volume_id.to_owned(), size });
        }
        node.create_replica(volume_id, size)
    }

    /// Every disk's capacity and replicas.
    pub fn report(&self) -> Result<Vec<DiskReport>, NodeError> {
        self.disks.iter().map(|(name, node)| Ok(DiskReport { name: name.clone(), report: node.report()? })).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &std::path::Path, name: &str) -> Arc<ReplicaNode> {
        Arc::new(ReplicaNode::open(&dir.join(name)).expect("open root"))
    }

    #[test]
    fn disk_names_are_dns_labels_and_default_is_taken() {
        for ok in ["ssd", "nvme-1", "d2", "a"] {
            assert!(is_disk_name(ok), "{ok}");
        }
        for bad in ["", "-a", "a-", "Ssd", "a/b", "a b", &"x".repeat(64)] {
            assert!(!is_disk_name(bad), "{bad}");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let e = ReplicaDisks::new(open(dir.path(), "r0"), vec![(DEFAULT_DISK.into(), open(dir.path(), "r1"))])
            .expect_err("default twice");
        assert!(matches!(e, NodeError::InvalidDisk(_)), "{e}");
    }

    #[test]
    fn a_replica_is_created_on_the_named_disk_and_found_there_by_its_volume() {
        let dir = tempfile::tempdir().expect("tempdir");
        let disks = ReplicaDisks::new(
            open(dir.path(), "r0"),
            vec![("ssd".into(), open(dir.path(), "r1")), ("hdd".into(), open(dir.path(), "r2"))],
        )
        .expect("disks");
        disks.create_replica("ssd", "v", 1 << 20).expect("create on ssd");
        assert!(dir.path().join("r1/v/header").exists(), "the replica lives under the ssd root");
        assert_eq!(disks.holding("v").0, "ssd");
        assert!(disks.replica("v").is_some());
        // Idempotent on its disk; one replica per server: not a second one on another disk.
        disks.create_replica("ssd", "v", 1 << 20).expect("retry");
        let e = disks.create_replica("hdd", "v", 1 << 20).expect_err("second replica of v");
        assert!(matches!(e, NodeError::AlreadyExists { .. }), "{e}");
        let e = disks.create_replica("nvme", "w", 1 << 20).expect_err("no such disk");
        assert!(matches!(e, NodeError::NoSuchDisk(_)), "{e}");
        assert_eq!(disks.holding("w").0, DEFAULT_DISK, "absent: asked on default, which answers NotFound");
        let report = disks.report().expect("report");
        let names: Vec<&str> = report.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, [DEFAULT_DISK, "ssd", "hdd"]);
        assert_eq!(report[1].report.replicas.len(), 1);
        assert!(report[0].report.replicas.is_empty() && report[2].report.replicas.is_empty());
    }

    #[test]
    fn a_volume_found_on_two_disks_is_refused_at_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        open(dir.path(), "r0").create_replica("v", 1 << 20).expect("create");
        open(dir.path(), "r1").create_replica("v", 1 << 20).expect("create");
        let e = ReplicaDisks::new(open(dir.path(), "r0"), vec![("ssd".into(), open(dir.path(), "r1"))])
            .expect_err("v on two disks");
        assert!(matches!(e, NodeError::OnTwoDisks { .. }), "{e}");
    }
}
