//! A replica's volume record: bytes the control plane keeps with every replica of a volume (who
//! the members are, which node may attach it, the backend's metadata) so that no controller has
//! to remember them, plus the two numbers the replica itself enforces:
//!
//! - the record's **version**, which orders updates: a write with an older version is refused,
//!   so two controllers (or a controller and an engine) never overwrite a newer record;
//! - the **epoch**, which fences engines: an engine `Claim`s the epoch of the record that gave
//!   it the volume, and once a newer record raised the epoch every mutating request of an older
//!   session is refused (`Fenced`). That is how a volume moves to another node while its old
//!   engine is cut off but alive: the move raises the epoch on the replicas first.
//!
//! The replica never reads the record's bytes. The file `record` beside `header` is replaced
//! atomically (temp file, fsync, rename, fsync of the directory) and CRC'd; a replica without
//! one has version 0, epoch 0 (made by hand, or before records existed).
//!
//! The fence gate: mutating requests hold the cell's read lock while they check their session's
//! epoch and run, raising the epoch takes the write lock. So when `SetRecord` or `Claim` answers,
//! no request of a fenced session is still running, and none starts after.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{RwLock, RwLockReadGuard};

use super::error::{StoreError, io_err};
use super::header_file::sync_dir;
use crate::protocol::{MAX_RECORD_LEN, RecordInfo};

/// File holding the record.
pub const RECORD_FILE: &str = "record";
const RECORD_TMP: &str = "record.tmp";
/// "WCSR": wasmcsi stored record.
const MAGIC: [u8; 4] = *b"WCSR";
const FORMAT: u16 = 1;
/// magic, format, version, epoch, length.
const FIXED: usize = 4 + 2 + 8 + 8 + 4;

/// The record of one replica and its fence gate.
#[derive(Debug, Default)]
pub(crate) struct RecordCell {
    current: RwLock<RecordInfo>,
}

/// Why a record update was not applied.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RecordRefusal {
    /// Older than (or conflicting with) what the replica holds.
    Stale,
    Invalid,
}

impl RecordCell {
    /// Loads `dir/record`, or an empty record when there is none.
    pub(crate) fn load(dir: &Path) -> Result<Self, StoreError> {
        let path = dir.join(RECORD_FILE);
        let info = match std::fs::read(&path) {
            Ok(bytes) => decode(&bytes).map_err(|what| StoreError::CorruptHeader { path, what: what.to_owned() })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => RecordInfo::default(),
            Err(e) => return Err(io_err("read", &path)(e)),
        };
        Ok(Self { current: RwLock::new(info) })
    }

    pub(crate) fn get(&self) -> RecordInfo {
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The gate a mutating request holds while it checks its session's epoch and runs; `None`
    /// when the session is fenced.
    pub(crate) fn admit(&self, session_epoch: u64) -> Option<RwLockReadGuard<'_, RecordInfo>> {
        let guard = self.current.read().unwrap_or_else(|p| p.into_inner());
        (session_epoch >= guard.epoch).then_some(guard)
    }

    /// A session claims `epoch`: refused when older than the replica's; a newer one is stored
    /// (durably) before the answer, fencing every older session.
    pub(crate) fn claim(&self, dir: &Path, epoch: u64) -> Result<(), ClaimError> {
        if epoch < self.get().epoch {
            return Err(ClaimError::Fenced);
        }
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        if epoch < current.epoch {
            return Err(ClaimError::Fenced);
        }
        if epoch > current.epoch {
            let next = RecordInfo { epoch, ..current.clone() };
            persist(dir, &next).map_err(ClaimError::Store)?;
            *current = next;
        }
        Ok(())
    }

    /// Replaces the record if `next` is newer (see the module docs); the same record again is a
    /// retry and succeeds.
    pub(crate) fn set(&self, dir: &Path, next: RecordInfo) -> Result<Result<(), RecordRefusal>, StoreError> {
        if next.data.len() > MAX_RECORD_LEN || next.version == 0 {
            return Ok(Err(RecordRefusal::Invalid));
        }
        let mut current = self.current.write().unwrap_or_else(|p| p.into_inner());
        if next.version == current.version {
            return Ok(if *current == next { Ok(()) } else { Err(RecordRefusal::Stale) });
        }
        if next.version < current.version || next.epoch < current.epoch {
            return Ok(Err(RecordRefusal::Stale));
        }
        persist(dir, &next)?;
        *current = next;
        Ok(Ok(()))
    }
}

#[derive(Debug)]
pub(crate) enum ClaimError {
    Fenced,
    Store(StoreError),
}

fn encode(r: &RecordInfo) -> Vec<u8> {
    let mut out = Vec::with_capacity(FIXED + r.data.len() + 4);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&r.version.to_le_bytes());
    out.extend_from_slice(&r.epoch.to_le_bytes());
    // Bounded by MAX_RECORD_LEN (set) or taken from a stored record (claim).
    out.extend_from_slice(&(r.data.len() as u32).to_le_bytes());
    out.extend_from_slice(&r.data);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn decode(bytes: &[u8]) -> Result<RecordInfo, &'static str> {
    if bytes.len() < FIXED + 4 {
        return Err("record file too short");
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err("record checksum mismatch");
    }
    if body[..4] != MAGIC {
        return Err("not a record file");
    }
    let u64_at = |at: usize| body.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    let format = body.get(4..6).and_then(|b| b.try_into().ok()).map(u16::from_le_bytes);
    if format != Some(FORMAT) {
        return Err("unknown record format");
    }
    let version = u64_at(6).ok_or("record file too short")?;
    let epoch = u64_at(14).ok_or("record file too short")?;
    let len = body.get(22..26).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes).ok_or("record too short")?;
    let data = body.get(FIXED..).ok_or("record file too short")?;
    if data.len() != len as usize || data.len() > MAX_RECORD_LEN {
        return Err("record length mismatch");
    }
    Ok(RecordInfo { version, epoch, data: data.to_vec() })
}

/// Replaces `dir/record` atomically.
fn persist(dir: &Path, record: &RecordInfo) -> Result<(), StoreError> {
    let tmp = dir.join(RECORD_TMP);
    let target = dir.join(RECORD_FILE);
    let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
    f.write_all(&encode(record)).map_err(io_err("write", &tmp))?;
    f.sync_all().map_err(io_err("fsync", &tmp))?;
    drop(f);
    std::fs::rename(&tmp, &target).map_err(io_err("rename over", &target))?;
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(version: u64, epoch: u64, data: &[u8]) -> RecordInfo {
        RecordInfo { version, epoch, data: data.to_vec() }
    }

    #[test]
    fn a_newer_record_replaces_an_older_one_durably_and_a_retry_succeeds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cell = RecordCell::load(dir.path()).expect("no record yet");
        assert_eq!(cell.get(), RecordInfo::default());
        cell.set(dir.path(), record(1, 1, b"a")).expect("io").expect("newer");
        cell.set(dir.path(), record(1, 1, b"a")).expect("io").expect("the same record again is a retry");
        assert_eq!(cell.set(dir.path(), record(1, 1, b"b")).expect("io"), Err(RecordRefusal::Stale), "same version");
        cell.set(dir.path(), record(3, 1, b"c")).expect("io").expect("newer");
        assert_eq!(cell.set(dir.path(), record(2, 9, b"x")).expect("io"), Err(RecordRefusal::Stale), "older");
        assert_eq!(cell.set(dir.path(), record(4, 0, b"x")).expect("io"), Err(RecordRefusal::Stale), "older epoch");
        assert_eq!(cell.set(dir.path(), record(0, 1, b"x")).expect("io"), Err(RecordRefusal::Invalid));
        let big = vec![0; MAX_RECORD_LEN + 1];
        assert_eq!(cell.set(dir.path(), record(5, 1, &big)).expect("io"), Err(RecordRefusal::Invalid));
        assert_eq!(RecordCell::load(dir.path()).expect("reload").get(), record(3, 1, b"c"));
    }

    #[test]
    fn a_raised_epoch_fences_older_sessions_and_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cell = RecordCell::load(dir.path()).expect("load");
        assert!(cell.admit(0).is_some(), "no record: unclaimed sessions write");
        cell.claim(dir.path(), 2).expect("first claim");
        assert!(cell.admit(1).is_none());
        assert!(cell.admit(2).is_some());
        assert!(matches!(cell.claim(dir.path(), 1), Err(ClaimError::Fenced)));
        cell.set(dir.path(), record(1, 5, b"moved")).expect("io").expect("newer epoch");
        assert!(cell.admit(2).is_none(), "the old engine is cut off");
        let again = RecordCell::load(dir.path()).expect("reload");
        assert_eq!(again.get().epoch, 5);
        assert!(again.admit(4).is_none());
    }

    #[test]
    fn a_damaged_record_is_an_error_not_an_empty_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cell = RecordCell::load(dir.path()).expect("load");
        cell.set(dir.path(), record(1, 1, b"members")).expect("io").expect("set");
        let path = dir.path().join(RECORD_FILE);
        let mut bytes = std::fs::read(&path).expect("read");
        let last = bytes.len() - 5;
        bytes[last] ^= 1;
        std::fs::write(&path, bytes).expect("write");
        assert!(RecordCell::load(dir.path()).is_err());
    }
}
