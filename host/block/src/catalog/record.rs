//! What the control plane keeps with every replica of a volume (the replica's opaque `record`,
//! see `replica::record`): the members in the engine's replica order, the node allowed to attach
//! the volume, the backend's metadata, and the state of a clone still being filled or a delete
//! in progress. JSON, so a future field is an addition, not a format change.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::protocol::MAX_RECORD_LEN;

/// A volume's record, as every member holds it (the newest version wins).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    /// Node names holding the replicas, in the engine's replica order.
    pub members: Vec<String>,
    /// The last address each member's replica server answered at: an engine keeps trying it
    /// while discovery cannot find the node (it may come back, and is then delta-rebuilt).
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
}

/// Where a clone's data comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillSource {
    pub volume_id: String,
    pub snapshot: String,
    /// The snapshot was taken for this copy (a clone of a volume) and is deleted after it.
    #[serde(default)]
    pub temporary: bool,
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

    /// Index of `node` among the members.
    pub fn member_index(&self, node: &str) -> Option<usize> {
        self.members.iter().position(|m| m == node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_round_trips_and_old_fields_default() {
        let r = VolumeRecord {
            members: vec!["n1".into(), "n2".into()],
            addresses: [("n1".to_string(), "10.0.0.1:9501".parse().expect("addr"))].into(),
            owner: Some("n1".into()),
            metadata: [("csi.name".to_string(), "pvc-ü".to_string())].into(),
            created_ns: 7,
            fill: Some(FillSource { volume_id: "v".into(), snapshot: "s".into(), temporary: true }),
            deleting: false,
        };
        assert_eq!(VolumeRecord::decode(&r.encode().expect("encode")).expect("decode"), r);
        let minimal = VolumeRecord::decode(br#"{"members":["a"],"created_ns":1}"#).expect("minimal");
        assert_eq!(minimal.owner, None);
        assert!(minimal.metadata.is_empty() && minimal.fill.is_none() && !minimal.deleting);
        assert!(VolumeRecord::decode(b"not json").is_err());
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
