//! The VolumeAttributesClass parameters of this backend (CSI `mutable_parameters`, at
//! CreateVolume and ControllerModifyVolume): the volume's I/O limits, which its engine
//! enforces, and the two placement keys that need no replica added or removed:
//! `replicaNodeSelector` (replicas on nodes that no longer match are moved, one at a time, by
//! the healing rounds) and `staleReplicaTimeout`. Each key given sets its value; a key not given
//! leaves it as it is (the spec: no change from the absence of a key); `0` lifts a limit. Every
//! key is checked before anything changes, and the first one refused is named.
//!
//! `numberOfReplicas`, `replicaSpreadKey` and `fsType` are refused here: the host cannot add or
//! remove a replica of an existing set yet, and a filesystem is made once.

use std::time::Duration;

use crate::policy::{self, Invalid, Policy};
use wasmcsi_backend_sdk::types::IoLimits;

/// Read operations per second (0: unlimited).
pub const READ_IOPS: &str = "readIOPS";
/// Write operations per second (0: unlimited).
pub const WRITE_IOPS: &str = "writeIOPS";
/// Bytes read per second (0: unlimited); a plain number or a quantity (`100Mi`, `1G`).
pub const READ_BPS: &str = "readBytesPerSecond";
/// Bytes written per second (0: unlimited); a plain number or a quantity.
pub const WRITE_BPS: &str = "writeBytesPerSecond";
/// The labels every replica's node must carry, as in the StorageClass; empty: any node.
pub const SELECTOR: &str = "replicaNodeSelector";
/// How long a replica's node may be unreachable before the replica is replaced.
pub const STALE_TIMEOUT: &str = "staleReplicaTimeout";

/// The keys this backend takes.
pub const MUTABLE_PARAMETERS: &[&str] = &[READ_IOPS, WRITE_IOPS, READ_BPS, WRITE_BPS, SELECTOR, STALE_TIMEOUT];

/// What a set of mutable parameters changes: each value given, `None` where it stays.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Modification {
    pub read_iops: Option<u64>,
    pub write_iops: Option<u64>,
    pub read_bytes_per_second: Option<u64>,
    pub write_bytes_per_second: Option<u64>,
    pub selector: Option<Vec<(String, Option<String>)>>,
    pub stale_timeout: Option<Duration>,
}

impl Modification {
    /// Whether it changes anything.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Whether it sets an I/O limit.
    pub fn sets_limits(&self) -> bool {
        [self.read_iops, self.write_iops, self.read_bytes_per_second, self.write_bytes_per_second]
            .iter()
            .any(Option::is_some)
    }

    /// `current` with what this sets.
    pub fn applied_to(&self, current: IoLimits) -> IoLimits {
        IoLimits {
            read_iops: self.read_iops.unwrap_or(current.read_iops),
            write_iops: self.write_iops.unwrap_or(current.write_iops),
            read_bytes_per_second: self.read_bytes_per_second.unwrap_or(current.read_bytes_per_second),
            write_bytes_per_second: self.write_bytes_per_second.unwrap_or(current.write_bytes_per_second),
        }
    }

    /// `policy` with the placement keys this sets.
    pub fn applied_to_policy(&self, policy: &Policy) -> Policy {
        let mut p = policy.clone();
        if let Some(selector) = &self.selector {
            p.selector = selector.clone();
        }
        if let Some(timeout) = self.stale_timeout {
            p.stale_timeout = timeout;
        }
        p
    }
}

/// Parses mutable parameters; the first key refused is named, and nothing is to change then.
pub fn parse(params: &[(String, String)]) -> Result<Modification, Invalid> {
    let mut m = Modification::default();
    for (key, value) in params {
        let slot = match key.as_str() {
            READ_IOPS => &mut m.read_iops,
            WRITE_IOPS => &mut m.write_iops,
            READ_BPS => &mut m.read_bytes_per_second,
            WRITE_BPS => &mut m.write_bytes_per_second,
            SELECTOR => {
                m.selector = Some(policy::parse_selector(value)?);
                continue;
            }
            STALE_TIMEOUT => {
                m.stale_timeout = Some(policy::parse_duration(value)?);
                continue;
            }
            "numberOfReplicas" | "replicaSpreadKey" | "fsType" => {
                return Err(Invalid(format!(
                    "mutable parameter {key:?} cannot be changed on an existing volume (this backend modifies \
                     {MUTABLE_PARAMETERS:?}); set it in the StorageClass"
                )));
            }
            other => {
                return Err(Invalid(format!(
                    "unknown mutable parameter {other:?} (this backend takes {MUTABLE_PARAMETERS:?})"
                )));
            }
        };
        let quantity = key == READ_BPS || key == WRITE_BPS;
        *slot = Some(number(key, value, quantity)?);
    }
    Ok(m)
}

/// A non-negative whole number, or with `quantity` a Kubernetes-style quantity with a binary
/// (`Ki`, `Mi`, `Gi`, `Ti`) or decimal (`k`, `M`, `G`, `T`) suffix.
fn number(key: &str, value: &str, quantity: bool) -> Result<u64, Invalid> {
    let v = value.trim();
    let refuse = || {
        let form = if quantity { "a whole number of bytes, or a quantity like 100Mi" } else { "a whole number" };
        Invalid(format!("mutable parameter {key:?}: {value:?} is not {form} (0: unlimited)"))
    };
    let suffixes: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (digits, unit) = match suffixes.iter().find(|(s, _)| quantity && v.ends_with(s)) {
        Some((s, unit)) => (&v[..v.len() - s.len()], *unit),
        None => (v, 1),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(refuse());
    }
    digits.parse::<u64>().ok().and_then(|n| n.checked_mul(unit)).ok_or_else(refuse)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn each_key_sets_its_limit_and_the_others_stay() {
        let m = parse(&p(&[(WRITE_IOPS, "500"), (READ_BPS, "100Mi")])).expect("valid");
        let current = IoLimits { read_iops: 7, write_iops: 1, read_bytes_per_second: 1, write_bytes_per_second: 9 };
        assert_eq!(
            m.applied_to(current),
            IoLimits { read_iops: 7, write_iops: 500, read_bytes_per_second: 100 << 20, write_bytes_per_second: 9 }
        );
        let lift = parse(&p(&[(WRITE_IOPS, "0")])).expect("0 lifts");
        assert_eq!(lift.applied_to(current).write_iops, 0);
        assert!(parse(&[]).expect("nothing").is_empty());
    }

    #[test]
    fn quantities_take_binary_and_decimal_suffixes_for_bytes_only() {
        let bytes = |v: &str| parse(&p(&[(WRITE_BPS, v)])).map(|m| m.write_bytes_per_second);
        assert_eq!(bytes("1Gi"), Ok(Some(1 << 30)));
        assert_eq!(bytes("20M"), Ok(Some(20_000_000)));
        assert_eq!(bytes(" 4096 "), Ok(Some(4096)));
        for bad in ["", "-1", "1.5Mi", "Mi", "10Xi", "99999999999Ti"] {
            let e = bytes(bad).expect_err(bad);
            assert!(e.0.contains(WRITE_BPS) && e.0.contains("quantity"), "{bad}: {e:?}");
        }
        let e = parse(&p(&[(READ_IOPS, "1k")])).expect_err("operations are plain numbers");
        assert!(e.0.contains(READ_IOPS), "{e:?}");
    }

    #[test]
    fn an_unknown_or_immutable_key_is_refused_by_name() {
        let e = parse(&p(&[(WRITE_IOPS, "5"), ("colour", "red")])).expect_err("unknown");
        assert!(e.0.contains("\"colour\"") && e.0.contains(WRITE_IOPS), "{e:?}");
        let e = parse(&p(&[("numberOfReplicas", "2")])).expect_err("not mutable here");
        assert!(e.0.contains("\"numberOfReplicas\"") && e.0.contains("StorageClass"), "{e:?}");
    }
}
