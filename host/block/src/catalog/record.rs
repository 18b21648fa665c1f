//! What the control plane keeps with every replica of a volume (the replica's opaque `record`,
//! see `replica::record`): the members in the engine's replica order, each a replica's
//! [`Location`] (a node and one of its disks), the node allowed to attach the volume, the
//! backend's metadata, the volume's I/O limits, and the state of a clone still being filled or
//! a delete in progress.
//! JSON, so a future field is an addition, not a format change.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::protocol::{DEFAULT_DISK, MAX_RECORD_LEN};
use crate::qos::IoLimits;

/// Where one replica of a volume lives: a node and one of its disks. A node may hold several
/// replicas of one volume, each on another disk (a cluster with fewer nodes than replicas), so
/// this pair, not the node, names a replica everywhere.
///
/// Stored as `{"node": …, "disk": …}`; a record written before disks names a member by its node
/// alone, which reads as that node's disk [`DEFAULT_DISK`] (the only disk a replica could be on
/// then).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Location {
    pub node: String,
    pub disk: String,
}

impl Location {
    pub fn new(node: impl Into<String>, disk: impl Into<String>) -> Self {
        Self { node: node.into(), disk: disk.into() }
    }

    /// The replica on `node`'s disk [`DEFAULT_DISK`].
    pub fn on_default(node: impl Into<String>) -> Self {
        Self::new(node, DEFAULT_DISK)
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.node, self.disk)
    }
}

impl<'de> Deserialize<'de> for Location {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Stored {
            /// A record of the version before disks: the node only.
            Node(String),
            Location {
                node: String,
                disk: String,
            },
        }
        Ok(match Stored::deserialize(d)? {
            Stored::Node(node) => Self::on_default(node),
            Stored::Location { node, disk } => Self { node, disk },
        })
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A volume's record, as every member holds it (the newest version wins).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// Where the replicas are, in the engine's replica order; no two alike.
    pub members: Vec<Location>,
    /// The last address each member's node's replica server answered at, by node: an engine
    /// keeps trying it while discovery cannot find the node (it may come back, and is then
    /// delta-rebuilt).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub addresses: BTreeMap<String, std::net::SocketAddr>,
    /// The node allowed to run the volume's engine (ControllerPublishVolume); `None` while no
    /// node is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The backend's own keys and values (its StorageClass parameters, the CSI name, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// When the set was created, nanoseconds since the Unix epoch.
    pub created_ns: u64,
    /// Set while the set is being filled from its source; cleared when the copy is whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fill: Option<FillSource>,
    /// A delete started: the set no longer exists for anyone, its replicas are being removed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleting: bool,
    /// The volume's I/O limits, applied by every engine that attaches it (none: unlimited).
    #[serde(default, skip_serializing_if = "IoLimits::is_unlimited")]
    pub limits: IoLimits,
    /// Its rebuild bandwidth in bytes per second, as the backend set it (0: the node's default).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rebuild_bytes_per_second: u64,
}

/// Where a new set's data comes from: a snapshot of another set (a clone), or a backup (a
/// restore).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillSource {
    /// The source set, or for a restore the backed-up volume's id on the target.
    pub volume_id: String,
    /// The source set's snapshot, or for a restore the backup's id.
    pub snapshot: String,
    /// The snapshot was taken for this copy (a clone of a volume) and is deleted after it.
    #[serde(default)]
    pub temporary: bool,
    /// A restore: the backup target (as the host configuration names it) the backup is on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("volume record is not readable: {0}")]
    Decode(String),
    #[error("volume record of {len} bytes exceeds the {MAX_RECORD_LEN}-byte limit")]
    TooLarge { len: usize },
}

impl VolumeRecord {
    pub fn encode(&self) -> Result<Vec<u8>, RecordError> {
        let bytes = serde_json::to_vec(self).map_err(|e| RecordError::Decode(e.to_string()))?;
        if bytes.len() > MAX_RECORD_LEN {
            return Err(RecordError::TooLarge { len: bytes.len() });
        }
        Ok(bytes)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, RecordError> {
        serde_json::from_slice(bytes).map_err(|e| RecordError::Decode(e.to_string()))
    }

    /// Index of the replica at `at` among the members.
    pub fn member_index(&self, at: &Location) -> Option<usize> {
        self.members.iter().position(|m| m == at)
    }

    /// Whether a member lives on `node` (on any of its disks).
    pub fn has_node(&self, node: &str) -> bool {
        self.members.iter().any(|m| m.node == node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_old_fields_default() {
        let r = VolumeRecord {
            members: vec![Location::on_default("n1"), Location::new("n1", "ssd"), Location::new("n2", "d-2")],
            addresses: [("n1".to_string(), "10.0.0.1:9501".parse().expect("addr"))].into(),
            owner: Some("n1".into()),
            metadata: [("csi.name".to_string(), "pvc-ü".to_string())].into(),
            created_ns: 7,
            fill: Some(FillSource { volume_id: "v".into(), snapshot: "s".into(), temporary: true, target: None }),
            deleting: false,
            limits: IoLimits { write_iops: 100, ..IoLimits::UNLIMITED },
            rebuild_bytes_per_second: 1 << 20,
        };
        assert_eq!(VolumeRecord::decode(&r.encode().expect("encode")).expect("decode"), r);
        let minimal = VolumeRecord::decode(br#"{"members":["a"],"created_ns":1}"#).expect("minimal");
        assert_eq!(minimal.owner, None);
        assert!(minimal.metadata.is_empty() && minimal.fill.is_none() && !minimal.deleting);
        assert!(minimal.limits.is_unlimited() && minimal.rebuild_bytes_per_second == 0);
        // An unlimited volume's record is the one a host before limits wrote.
        let plain = VolumeRecord { members: vec![Location::on_default("a")], ..VolumeRecord::default() };
        assert!(!String::from_utf8(plain.encode().expect("encode")).expect("utf-8").contains("limits"));
        assert!(VolumeRecord::decode(b"not json").is_err());
    }

    #[test]
    fn a_member_is_stored_as_node_and_disk_and_an_old_records_node_reads_as_its_default_disk() {
        let r = VolumeRecord {
            members: vec![Location::new("n1", "ssd"), Location::on_default("n1")],
            ..VolumeRecord::default()
        };
        let json: serde_json::Value = serde_json::from_slice(&r.encode().expect("encode")).expect("json");
        assert_eq!(
            json["members"],
            serde_json::json!([{"node": "n1", "disk": "ssd"}, {"node": "n1", "disk": DEFAULT_DISK}])
        );
        // A record as the version before disks wrote it, byte for byte: it keeps loading.
        let old = br#"{"members":["n1","n2"],"addresses":{"n1":"10.0.0.1:9501"},"owner":"n2","created_ns":5}"#;
        let read = VolumeRecord::decode(old).expect("an old record loads");
        assert_eq!(read.members, [Location::on_default("n1"), Location::on_default("n2")]);
        assert_eq!((read.owner.as_deref(), read.created_ns), (Some("n2"), 5));
        // Both forms in one record (a record an old controller extended) read alike.
        let mixed =
            VolumeRecord::decode(br#"{"members":["n1",{"node":"n1","disk":"ssd"}],"created_ns":1}"#).expect("mixed");
        assert_eq!(mixed.members, [Location::on_default("n1"), Location::new("n1", "ssd")]);
        assert_eq!(mixed.member_index(&Location::new("n1", "ssd")), Some(1));
        assert_eq!(mixed.member_index(&Location::new("n1", "hdd")), None);
        assert!(mixed.has_node("n1") && !mixed.has_node("n2"));
        assert!(VolumeRecord::decode(br#"{"members":[{"node":"n1"}],"created_ns":1}"#).is_err(), "a disk is named");
    }

    #[test]
    fn a_record_over_the_replica_limit_is_refused() {
        let r = VolumeRecord {
            metadata: [("k".to_string(), "x".repeat(MAX_RECORD_LEN))].into(),
            ..VolumeRecord::default()
        };
        assert!(matches!(r.encode(), Err(RecordError::TooLarge { .. })));
    }
}
