//! Conversions between CSI wire types and the WIT types backends see, with the checks the
//! spec asks of the plugin on the way in. A backend's answers on the way out are checked in
//! `answer` (a guest is not trusted to keep CSI's rules).
use crate::error::{CsiError, CsiResult};
use std::collections::HashMap;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::driver;

pub fn pairs(map: &HashMap<String, String>) -> Vec<driver::Pair> {
    let mut v: Vec<driver::Pair> = map.iter().map(|(k, v)| driver::Pair { key: k.clone(), value: v.clone() }).collect();
    v.sort_by(|a, b| a.key.cmp(&b.key));
    v
}

pub fn to_map(pairs: &[driver::Pair]) -> HashMap<String, String> {
    pairs.iter().map(|p| (p.key.clone(), p.value.clone())).collect()
}

pub fn secrets(map: &HashMap<String, String>) -> wasmcsi_runtime::Secrets {
    let mut v: Vec<(String, String)> = map.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    v.sort();
    v
}

fn access_mode(mode: i32) -> CsiResult<types::AccessMode> {
    use csi::volume_capability::access_mode::Mode;
    Ok(match Mode::try_from(mode).unwrap_or(Mode::Unknown) {
        Mode::SingleNodeWriter => types::AccessMode::SingleNodeWriter,
        Mode::SingleNodeReaderOnly => types::AccessMode::SingleNodeReaderOnly,
        Mode::MultiNodeReaderOnly => types::AccessMode::MultiNodeReaderOnly,
        Mode::MultiNodeSingleWriter => types::AccessMode::MultiNodeSingleWriter,
        Mode::MultiNodeMultiWriter => types::AccessMode::MultiNodeMultiWriter,
        Mode::SingleNodeSingleWriter => types::AccessMode::SingleNodeSingleWriter,
        Mode::SingleNodeMultiWriter => types::AccessMode::SingleNodeMultiWriter,
        Mode::Unknown => return Err(CsiError::Invalid(format!("volume capability access mode {mode} is unknown"))),
    })
}

/// A capability must name an access type and a known access mode.
pub fn capability(c: &csi::VolumeCapability) -> CsiResult<driver::VolumeCapability> {
    use csi::volume_capability::AccessType;
    let access_type = match &c.access_type {
        Some(AccessType::Block(_)) => types::AccessType::Block,
        Some(AccessType::Mount(m)) => types::AccessType::Mount(types::MountVolume {
            fs_type: m.fs_type.clone(),
            mount_flags: m.mount_flags.clone(),
        }),
        None => return Err(CsiError::Missing("volume_capability.access_type")),
    };
    let mode = c.access_mode.as_ref().ok_or(CsiError::Missing("volume_capability.access_mode"))?.mode;
    Ok(driver::VolumeCapability { access_type, access_mode: access_mode(mode)? })
}

pub fn capabilities(caps: &[csi::VolumeCapability]) -> CsiResult<Vec<driver::VolumeCapability>> {
    caps.iter().map(capability).collect()
}

/// CSI sizes are int64; negative ones are invalid.
pub fn capacity(range: Option<&csi::CapacityRange>) -> CsiResult<driver::CapacityRange> {
    let Some(r) = range else { return Ok(driver::CapacityRange { required_bytes: 0, limit_bytes: 0 }) };
    let (req, lim) = (u64::try_from(r.required_bytes), u64::try_from(r.limit_bytes));
    match (req, lim) {
        (Ok(required_bytes), Ok(limit_bytes)) => {
            if limit_bytes != 0 && required_bytes > limit_bytes {
                return Err(CsiError::Invalid(format!(
                    "capacity_range: required_bytes {required_bytes} exceeds limit_bytes {limit_bytes}"
                )));
            }
            Ok(driver::CapacityRange { required_bytes, limit_bytes })
        }
        _ => Err(CsiError::Invalid("capacity_range: sizes must not be negative".into())),
    }
}

pub fn topology(t: &csi::Topology) -> driver::Topology {
    driver::Topology { segments: pairs(&t.segments) }
}

pub fn bytes(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_without_type_or_mode_are_invalid() {
        let c = csi::VolumeCapability { access_type: None, access_mode: None };
        assert!(matches!(capability(&c), Err(CsiError::Missing(_))));
        let c = csi::VolumeCapability {
            access_type: Some(csi::volume_capability::AccessType::Block(Default::default())),
            access_mode: Some(csi::volume_capability::AccessMode { mode: 0 }),
        };
        assert!(matches!(capability(&c), Err(CsiError::Invalid(_))));
    }

    #[test]
    fn negative_or_inverted_capacity_ranges_are_invalid() {
        assert!(capacity(Some(&csi::CapacityRange { required_bytes: -1, limit_bytes: 0 })).is_err());
        assert!(capacity(Some(&csi::CapacityRange { required_bytes: 10, limit_bytes: 5 })).is_err());
        assert_eq!(capacity(None).map(|c| c.required_bytes).ok(), Some(0));
    }
}
