//! The engine's state file: what [`crate::engine::Action::Persist`] asks to keep, written so that a
//! crash leaves either the old or the new state, and read back (older versions included) when the
//! volume is attached again.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write as _};
use std::path::Path;

use super::VolumeError;
use crate::dirty_map::DirtyMap;
use crate::engine::PersistedState;

/// Name of the engine's state file inside [`VolumeConfig::state_dir`].
pub const STATE_FILE: &str = "engine-state";
const STATE_MAGIC: [u8; 4] = *b"WCSE";
/// Version 4: who each replica index is (see [`PersistedState::members`]). Version 3 (an
/// intent map), 2 (the volume size and one map per out-of-sync replica) and 1 (one shared map
/// and a delta/full flag per replica) are still read.
const STATE_VERSION: u32 = 4;

/// Reads the state file in `dir`; `None` when there is none (a fresh volume).
pub fn load_state(dir: &Path) -> Result<Option<PersistedState>, VolumeError> {
    let path = dir.join(STATE_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => decode_state(&bytes).map(Some).map_err(|what| VolumeError::CorruptState { path, what }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(VolumeError::State { path, source }),
    }
}

/// Writes the state file in `dir` so that a crash leaves either the old or the new state: temp
/// file, fsync, rename over the old one, fsync the directory (the rename itself must survive).
pub fn save_state(dir: &Path, state: &PersistedState) -> io::Result<()> {
    let tmp = dir.join(format!(".{STATE_FILE}.tmp"));
    let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
    f.write_all(&encode_state(state))?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(STATE_FILE))?;
    File::open(dir)?.sync_all()
}

/// magic, version, revision, size, entry count, (replica u64, map length u64, map bytes)*,
/// intent flag u8 (1: an intent map follows), [intent map length u64, map bytes], member count
/// u64, (identity length u64, UTF-8 bytes)*, then a CRC32 of everything before it;
/// little-endian. Versions 1 and 2 are still read (without an intent map, which makes the next
/// unclean attach resync everything), and 3 (without members: the maps keep their indices).
pub(super) fn encode_state(s: &PersistedState) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&STATE_MAGIC);
    out.extend_from_slice(&STATE_VERSION.to_le_bytes());
    out.extend_from_slice(&s.revision.to_le_bytes());
    out.extend_from_slice(&s.size.to_le_bytes());
    out.extend_from_slice(&(s.missing.len() as u64).to_le_bytes());
    for (r, map) in &s.missing {
        let bytes = map.to_bytes();
        out.extend_from_slice(&(*r as u64).to_le_bytes());
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(&bytes);
    }
    match &s.intent {
        Some(map) => {
            let bytes = map.to_bytes();
            out.push(1);
            out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
            out.extend_from_slice(&bytes);
        }
        None => out.push(0),
    }
    out.extend_from_slice(&(s.members.len() as u64).to_le_bytes());
    for who in &s.members {
        out.extend_from_slice(&(who.len() as u64).to_le_bytes());
        out.extend_from_slice(who.as_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

pub(super) fn decode_state(bytes: &[u8]) -> Result<PersistedState, String> {
    let Some((body, crc)) = bytes.split_last_chunk::<4>() else { return Err("truncated".into()) };
    if crc32fast::hash(body) != u32::from_le_bytes(*crc) {
        return Err("checksum mismatch".into());
    }
    let mut rest = body;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let (head, tail) = rest.split_at_checked(n).ok_or("truncated")?;
        rest = tail;
        Ok(head)
    };
    let u64_at = |b: &[u8]| -> u64 { b.iter().rev().fold(0, |acc, x| (acc << 8) | u64::from(*x)) };
    if take(4)? != STATE_MAGIC {
        return Err("bad magic".into());
    }
    let version = u64_at(take(4)?);
    let revision = u64_at(take(8)?);
    let mut missing = BTreeMap::new();
    let mut intent = None;
    let mut members = Vec::new();
    let size = match version {
        1 => {
            let entries = u64_at(take(8)?);
            let mut delta = BTreeMap::new();
            for _ in 0..entries {
                let r = usize::try_from(u64_at(take(8)?)).map_err(|_| "replica index overflows")?;
                delta.insert(r, take(1)?[0] != 0);
            }
            let len = usize::try_from(u64_at(take(8)?)).map_err(|_| "dirty map length overflows")?;
            let dirty = DirtyMap::from_bytes(take(len)?).map_err(|e| format!("dirty map: {e}"))?;
            for (r, delta) in delta {
                let mut map = dirty.clone();
                if !delta {
                    map.mark_all();
                }
                missing.insert(r, map);
            }
            // Version 1 did not record the size; the engine falls back to the configured one.
            0
        }
        2..=4 => {
            let size = u64_at(take(8)?);
            let entries = u64_at(take(8)?);
            for _ in 0..entries {
                let r = usize::try_from(u64_at(take(8)?)).map_err(|_| "replica index overflows")?;
                let len = usize::try_from(u64_at(take(8)?)).map_err(|_| "map length overflows")?;
                let map = DirtyMap::from_bytes(take(len)?).map_err(|e| format!("map of replica {r}: {e}"))?;
                missing.insert(r, map);
            }
            if version >= 3 && take(1)?[0] != 0 {
                let len = usize::try_from(u64_at(take(8)?)).map_err(|_| "intent map length overflows")?;
                intent = Some(DirtyMap::from_bytes(take(len)?).map_err(|e| format!("intent map: {e}"))?);
            }
            if version >= 4 {
                let count = u64_at(take(8)?);
                for _ in 0..count {
                    let len = usize::try_from(u64_at(take(8)?)).map_err(|_| "member length overflows")?;
                    let who = std::str::from_utf8(take(len)?).map_err(|_| "member identity is not UTF-8")?;
                    members.push(who.to_owned());
                }
            }
            size
        }
        other => return Err(format!("unsupported version {other}")),
    };
    if !rest.is_empty() {
        return Err("trailing bytes".into());
    }
    Ok(PersistedState { revision, size, missing, intent, members })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_file_round_trips_and_detects_corruption() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(load_state(dir.path()).expect("load"), None);
        let mut dirty = DirtyMap::new(1 << 24, 1 << 20).expect("map");
        dirty.mark(3 << 20, 10);
        let full = DirtyMap::full(1 << 24, 1 << 20).expect("map");
        let mut intent = DirtyMap::new(1 << 24, 1 << 20).expect("map");
        intent.mark(5 << 20, 1);
        let missing = BTreeMap::from([(1, dirty), (2, full)]);
        let members = vec!["node-a/default".to_owned(), String::new(), "node-b/ssd".to_owned()];
        let state = PersistedState { revision: 7, size: 1 << 24, missing, intent: Some(intent), members };
        save_state(dir.path(), &state).expect("save");
        assert_eq!(load_state(dir.path()).expect("load"), Some(state.clone()));
        let unknown = PersistedState { intent: None, members: Vec::new(), ..state.clone() };
        assert_eq!(decode_state(&encode_state(&unknown)), Ok(unknown));
        let path = dir.path().join(STATE_FILE);
        let mut bytes = std::fs::read(&path).expect("read");
        bytes[12] ^= 1;
        std::fs::write(&path, &bytes).expect("write");
        assert!(matches!(load_state(dir.path()), Err(VolumeError::CorruptState { .. })));
        assert!(decode_state(&encode_state(&state)[..10]).is_err());
    }

    /// A version 2 file (before intent maps) still loads; its intent is unknown.
    #[test]
    fn version_2_state_file_loads_without_an_intent_map() {
        let mut map = DirtyMap::new(1 << 24, 1 << 20).expect("map");
        map.mark(1 << 20, 1);
        let bytes = map.to_bytes();
        let mut v2 = Vec::new();
        v2.extend_from_slice(&STATE_MAGIC);
        v2.extend_from_slice(&2u32.to_le_bytes());
        v2.extend_from_slice(&9u64.to_le_bytes());
        v2.extend_from_slice(&(1u64 << 24).to_le_bytes());
        v2.extend_from_slice(&1u64.to_le_bytes());
        v2.extend_from_slice(&1u64.to_le_bytes());
        v2.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        v2.extend_from_slice(&bytes);
        let crc = crc32fast::hash(&v2);
        v2.extend_from_slice(&crc.to_le_bytes());
        let want = PersistedState {
            revision: 9,
            size: 1 << 24,
            missing: BTreeMap::from([(1, map)]),
            intent: None,
            members: Vec::new(),
        };
        assert_eq!(decode_state(&v2), Ok(want));
    }
}
