//! `ReplicaDisks`: the disks of one replica server, each a [`ReplicaNode`] (a replica root) under
//! a name. Every server has the disk [`DEFAULT_DISK`] (its `--replica-root`); a node with several
//! disks serves more roots under names of their own. A replica is named by its volume and its
//! disk: a server may hold several replicas of one volume, each on another disk (a cluster with
//! fewer nodes than a volume has replicas), and every request naming a replica (`Hello`,
//! `Describe`, `SetRecord`, `DeleteReplica`, `CreateReplicaOn`) names the disk, `default` when
//! it says none. This module owns the names and that lookup, not the replicas (that is `node`).

use std::sync::Arc;

use super::node::{NodeError, NodeReport, ReplicaNode};
use super::store::ReplicaStore;
pub use crate::protocol::DEFAULT_DISK;

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
    /// [`is_disk_name`]).
    pub fn new(default: Arc<ReplicaNode>, more: Vec<(String, Arc<ReplicaNode>)>) -> Result<Self, NodeError> {
        let mut disks = vec![(DEFAULT_DISK.to_owned(), default)];
        for (name, node) in more {
            if !is_disk_name(&name) || disks.iter().any(|(n, _)| *n == name) {
                return Err(NodeError::InvalidDisk(name));
            }
            disks.push((name, node));
        }
        Ok(Self { disks })
    }

    /// One disk, `default`.
    pub fn single(default: Arc<ReplicaNode>) -> Self {
        Self { disks: vec![(DEFAULT_DISK.to_owned(), default)] }
    }

    pub fn default_disk(&self) -> &Arc<ReplicaNode> {
        &self.disks[0].1
    }

    /// The disk `name`; [`NodeError::NoSuchDisk`] when the server has none of that name.
    pub fn get(&self, name: &str) -> Result<&Arc<ReplicaNode>, NodeError> {
        self.disks
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, node)| node)
            .ok_or_else(|| NodeError::NoSuchDisk(name.into()))
    }

    /// The disks' names, `default` first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.disks.iter().map(|(n, _)| n.as_str())
    }

    /// The store of `volume_id`'s replica on `disk`.
    pub fn store(&self, disk: &str, volume_id: &str) -> Option<Arc<ReplicaStore>> {
        self.get(disk).ok()?.store(volume_id)
    }

    /// Creates an empty replica on `disk` (see [`ReplicaNode::create_replica`]);
    /// [`NodeError::NoSuchDisk`] when the server has no such disk. Replicas of the volume on
    /// other disks are other replicas of it.
    pub fn create_replica(&self, disk: &str, volume_id: &str, size: u64) -> Result<Arc<ReplicaStore>, NodeError> {
        self.get(disk)?.create_replica(volume_id, size)
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
        assert!(disks.store("ssd", "v").is_some());
        assert!(disks.store(DEFAULT_DISK, "v").is_none(), "a replica is found on its own disk only");
        // Idempotent on its disk.
        disks.create_replica("ssd", "v", 1 << 20).expect("retry");
        let e = disks.create_replica("nvme", "w", 1 << 20).expect_err("no such disk");
        assert!(matches!(e, NodeError::NoSuchDisk(_)), "{e}");
        let report = disks.report().expect("report");
        let names: Vec<&str> = report.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, [DEFAULT_DISK, "ssd", "hdd"]);
        assert_eq!(report[1].report.replicas.len(), 1);
        assert!(report[0].report.replicas.is_empty() && report[2].report.replicas.is_empty());
    }

    #[test]
    fn one_server_holds_replicas_of_one_volume_on_several_disks_each_its_own() {
        let dir = tempfile::tempdir().expect("tempdir");
        open(dir.path(), "r1").create_replica("v", 1 << 20).expect("create on a disk before the server starts");
        let disks = ReplicaDisks::new(
            open(dir.path(), "r0"),
            vec![("ssd".into(), open(dir.path(), "r1")), ("hdd".into(), open(dir.path(), "r2"))],
        )
        .expect("a volume on one disk of several opens");
        disks.create_replica(DEFAULT_DISK, "v", 1 << 20).expect("a second replica of v, on default");
        disks.create_replica("hdd", "v", 1 << 20).expect("a third, on hdd");
        for name in [DEFAULT_DISK, "ssd", "hdd"] {
            assert!(disks.store(name, "v").is_some(), "{name}");
        }
        // Each is its own: deleting one leaves the others.
        disks.get("ssd").expect("ssd").delete_replica("v").expect("delete on ssd");
        assert!(disks.store("ssd", "v").is_none());
        assert!(disks.store(DEFAULT_DISK, "v").is_some() && disks.store("hdd", "v").is_some());
        let held: usize = disks.report().expect("report").iter().map(|d| d.report.replicas.len()).sum();
        assert_eq!(held, 2);
    }
}
