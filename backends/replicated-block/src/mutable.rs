//! The VolumeAttributesClass parameters of this backend (CSI `mutable_parameters`, at
//! CreateVolume and ControllerModifyVolume): the volume's I/O limits, which its engine
//! enforces, with the keys and parsing every backend shares (`wasmcsi_backend_sdk::io_limits`),
//! and the placement keys: `numberOfReplicas` (replicas added or removed one at a time while
//! the volume serves I/O: a new one is rebuilt from the others, one is removed only once the
//! rest are healthy), `replicaNodeSelector` (replicas on nodes that no longer match are moved,
//! one at a time, by the healing rounds) and `staleReplicaTimeout`. Each key given sets its
//! value; a key not given leaves it as it is (the spec: no change from the absence of a key);
//! `0` lifts a limit. Every key is checked before anything changes, and a key refused is named.
//!
//! `replicaSpreadKey` and `fsType` are refused here: the spread is decided at placement, and a
//! filesystem is made once.

use std::time::Duration;

use crate::policy::{self, Policy};
use wasmcsi_backend_sdk::io_limits::{self, KEYS as LIMIT_KEYS};
use wasmcsi_backend_sdk::types::Error;

/// The labels every replica's node must carry, as in the StorageClass; empty: any node.
pub const SELECTOR: &str = "replicaNodeSelector";
/// How long a replica's node may be unreachable before the replica is replaced.
pub const STALE_TIMEOUT: &str = "staleReplicaTimeout";
/// How many replicas the set keeps.
pub const REPLICAS: &str = "numberOfReplicas";

/// The keys this backend takes.
pub const MUTABLE_PARAMETERS: &[&str] = &[
    io_limits::READ_IOPS,
    io_limits::WRITE_IOPS,
    io_limits::READ_BPS,
    io_limits::WRITE_BPS,
    REPLICAS,
    SELECTOR,
    STALE_TIMEOUT,
];

/// StorageClass parameters a VolumeAttributesClass cannot change.
const IMMUTABLE: &[&str] = &["replicaSpreadKey", "fsType"];

/// What a set of mutable parameters changes: each value given, `None` where it stays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Modification {
    pub limits: io_limits::Modification,
    pub replicas: Option<u32>,
    pub selector: Option<Vec<(String, Option<String>)>>,
    pub stale_timeout: Option<Duration>,
}

impl Modification {
    /// Whether it changes anything.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// `policy` with the placement keys this sets.
    pub fn applied_to_policy(&self, policy: &Policy) -> Policy {
        let mut p = policy.clone();
        if let Some(n) = self.replicas {
            p.replicas = n;
        }
        if let Some(selector) = &self.selector {
            p.selector = selector.clone();
        }
        if let Some(timeout) = self.stale_timeout {
            p.stale_timeout = timeout;
        }
        p
    }
}

/// Parses mutable parameters; invalid-argument naming a key refused, and nothing is to change
/// then.
pub fn parse(params: &[(String, String)]) -> Result<Modification, Error> {
    let invalid = |e: policy::Invalid| Error::InvalidArgument(e.0);
    let mut m = Modification::default();
    let mut limits = Vec::new();
    for (key, value) in params {
        match key.as_str() {
            REPLICAS => m.replicas = Some(policy::parse_replicas(value).map_err(invalid)?),
            SELECTOR => m.selector = Some(policy::parse_selector(value).map_err(invalid)?),
            STALE_TIMEOUT => m.stale_timeout = Some(policy::parse_duration(value).map_err(invalid)?),
            k if LIMIT_KEYS.contains(&k) => limits.push((key.as_str(), value.as_str())),
            other => return Err(io_limits::refused(other, MUTABLE_PARAMETERS, IMMUTABLE)),
        }
    }
    m.limits = io_limits::parse(limits, &[])?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmcsi_backend_sdk::io_limits::WRITE_IOPS;

    fn p(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn keys_decided_once_are_refused_as_immutable_by_name_and_the_replica_count_is_checked() {
        let Err(Error::InvalidArgument(e)) = parse(&p(&[("replicaSpreadKey", "zone")])) else { panic!("accepted") };
        assert!(e.contains("\"replicaSpreadKey\"") && e.contains("StorageClass"), "{e:?}");
        assert_eq!(parse(&p(&[(REPLICAS, "3")])).map(|m| m.replicas), Ok(Some(3)));
        for bad in ["0", "17", "two"] {
            let Err(Error::InvalidArgument(e)) = parse(&p(&[(REPLICAS, bad)])) else { panic!("{bad} accepted") };
            assert!(e.contains(REPLICAS), "{bad}: {e:?}");
        }
        let Err(Error::InvalidArgument(e)) = parse(&p(&[(WRITE_IOPS, "5"), ("colour", "red")])) else {
            panic!("accepted")
        };
        assert!(e.contains("\"colour\"") && e.contains(WRITE_IOPS) && e.contains(SELECTOR), "{e:?}");
        assert_eq!(parse(&p(&[(WRITE_IOPS, "5")])).map(|m| m.limits.write_iops), Ok(Some(5)));
    }

    #[test]
    fn the_selector_and_the_stale_timeout_parse_as_in_the_storage_class() {
        let m = parse(&p(&[(SELECTOR, "zone=a, ssd"), (STALE_TIMEOUT, "90s"), (WRITE_IOPS, "0")])).expect("valid");
        assert_eq!(m.selector, Some(vec![("zone".into(), Some("a".into())), ("ssd".into(), None)]));
        assert_eq!(m.stale_timeout, Some(Duration::from_secs(90)));
        assert_eq!(m.limits.write_iops, Some(0));
        assert_eq!(parse(&p(&[(SELECTOR, "")])).expect("empty: any node").selector, Some(vec![]));
        for (key, value) in [(SELECTOR, "=a"), (STALE_TIMEOUT, "soon"), (STALE_TIMEOUT, "1s")] {
            let Err(Error::InvalidArgument(e)) = parse(&p(&[(key, value)])) else { panic!("{key}={value} accepted") };
            assert!(e.contains(key), "{key}={value}: {e:?}");
        }
    }
}
