//! The VolumeAttributesClass parameters of this backend (CSI `mutable_parameters`, at
//! CreateVolume and ControllerModifyVolume): the volume's I/O limits, which its engine
//! enforces, with the keys and parsing every backend shares (`wasmcsi_backend_sdk::io_limits`):
//! each key given sets its limit, a key not given leaves it, `0` lifts it; every key is checked
//! before anything changes, and the first one refused is named.
//!
//! The placement parameters of a StorageClass (`numberOfReplicas`, `replicaNodeSelector`, ...)
//! are refused here: the host cannot add or remove a replica of an existing set yet.

use wasmcsi_backend_sdk::io_limits::parse as parse_limits;
pub use wasmcsi_backend_sdk::io_limits::{KEYS as MUTABLE_PARAMETERS, Modification};
use wasmcsi_backend_sdk::types::Error;

/// StorageClass parameters a VolumeAttributesClass cannot change.
const IMMUTABLE: &[&str] =
    &["numberOfReplicas", "replicaNodeSelector", "replicaSpreadKey", "staleReplicaTimeout", "fsType"];

/// Parses mutable parameters; invalid-argument naming the first key refused, and nothing is to
/// change then.
pub fn parse(params: &[(String, String)]) -> Result<Modification, Error> {
    parse_limits(params.iter().map(|(k, v)| (k.as_str(), v.as_str())), IMMUTABLE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmcsi_backend_sdk::io_limits::WRITE_IOPS;

    fn p(kv: &[(&str, &str)]) -> Vec<(String, String)> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn placement_keys_are_refused_as_immutable_by_name() {
        let Err(Error::InvalidArgument(e)) = parse(&p(&[("numberOfReplicas", "2")])) else { panic!("accepted") };
        assert!(e.contains("\"numberOfReplicas\"") && e.contains("StorageClass"), "{e:?}");
        let Err(Error::InvalidArgument(e)) = parse(&p(&[(WRITE_IOPS, "5"), ("colour", "red")])) else {
            panic!("accepted")
        };
        assert!(e.contains("\"colour\"") && e.contains(WRITE_IOPS), "{e:?}");
        assert_eq!(parse(&p(&[(WRITE_IOPS, "5")])).map(|m| m.write_iops), Ok(Some(5)));
    }
}
