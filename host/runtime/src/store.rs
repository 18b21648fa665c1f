//! The host's embedded metadata store (redb): each backend's private `kv` namespace, and the
//! journal of which backend build (digest) created each volume. One file under the state
//! dir; every write is a durable transaction, so a restart between a CreateVolume and its
//! retry loses nothing.
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::Path;

const KV: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("kv");
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");

/// Largest key and value the `kv` capability accepts (see the WIT docs).
pub const MAX_KEY_BYTES: usize = 512;
pub const MAX_VALUE_BYTES: usize = 64 << 10;

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("metadata store {0}")]
    Db(String),
    #[error("key of {0} bytes exceeds {MAX_KEY_BYTES}")]
    KeyTooLarge(usize),
    #[error("value of {0} bytes exceeds {MAX_VALUE_BYTES}")]
    ValueTooLarge(usize),
}

fn db<E: std::fmt::Display>(e: E) -> StoreError {
    StoreError::Db(e.to_string())
}

/// Who created a volume: recorded at CreateVolume, kept until DeleteVolume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub backend: String,
    /// sha256 of the `.wasm` that created it
    pub digest: String,
    pub capacity_bytes: u64,
    /// seconds since the Unix epoch
    pub created_at: u64,
}

/// The store. Cheap to share behind an `Arc`.
pub struct MetaStore {
    db: Database,
}

impl MetaStore {
    /// Open (or create) the store file.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(db)?;
        }
        let database = Database::create(path).map_err(db)?;
        let tx = database.begin_write().map_err(db)?;
        tx.open_table(KV).map_err(db)?;
        tx.open_table(VOLUMES).map_err(db)?;
        tx.commit().map_err(db)?;
        Ok(Self { db: database })
    }

    fn check(key: &str, value: Option<&[u8]>) -> Result<(), StoreError> {
        if key.len() > MAX_KEY_BYTES {
            return Err(StoreError::KeyTooLarge(key.len()));
        }
        match value {
            Some(v) if v.len() > MAX_VALUE_BYTES => Err(StoreError::ValueTooLarge(v.len())),
            _ => Ok(()),
        }
    }

    pub fn kv_get(&self, backend: &str, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let tx = self.db.begin_read().map_err(db)?;
        let t = tx.open_table(KV).map_err(db)?;
        Ok(t.get((backend, key)).map_err(db)?.map(|v| v.value().to_vec()))
    }

    pub fn kv_set(&self, backend: &str, key: &str, value: &[u8]) -> Result<(), StoreError> {
        Self::check(key, Some(value))?;
        let tx = self.db.begin_write().map_err(db)?;
        tx.open_table(KV).map_err(db)?.insert((backend, key), value).map_err(db)?;
        tx.commit().map_err(db)
    }

    pub fn kv_delete(&self, backend: &str, key: &str) -> Result<(), StoreError> {
        let tx = self.db.begin_write().map_err(db)?;
        tx.open_table(KV).map_err(db)?.remove((backend, key)).map_err(db)?;
        tx.commit().map_err(db)
    }

    /// Swap `key` from `expected` to `new` in one write transaction (redb serialises
    /// writers, so two racing swaps cannot both win).
    pub fn kv_compare_and_swap(
        &self,
        backend: &str,
        key: &str,
        expected: Option<&[u8]>,
        new: Option<&[u8]>,
    ) -> Result<bool, StoreError> {
        Self::check(key, new)?;
        let tx = self.db.begin_write().map_err(db)?;
        {
            let mut t = tx.open_table(KV).map_err(db)?;
            let current = t.get((backend, key)).map_err(db)?.map(|v| v.value().to_vec());
            if current.as_deref() != expected {
                return Ok(false);
            }
            match new {
                Some(v) => t.insert((backend, key), v).map(|_| ()).map_err(db)?,
                None => t.remove((backend, key)).map(|_| ()).map_err(db)?,
            }
        }
        tx.commit().map_err(db)?;
        Ok(true)
    }

    pub fn kv_list(
        &self,
        backend: &str,
        prefix: &str,
        start_after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<String>, StoreError> {
        let tx = self.db.begin_read().map_err(db)?;
        let t = tx.open_table(KV).map_err(db)?;
        let start = start_after.unwrap_or(prefix).max(prefix);
        let mut out = Vec::new();
        for item in t.range((backend, start)..).map_err(db)? {
            let (k, _) = item.map_err(db)?;
            let (b, key) = k.value();
            if b != backend || !key.starts_with(prefix) || out.len() >= limit as usize {
                break;
            }
            if Some(key) != start_after {
                out.push(key.to_string());
            }
        }
        Ok(out)
    }

    pub fn record_volume(&self, volume_id: &str, record: &VolumeRecord) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(record).map_err(db)?;
        let tx = self.db.begin_write().map_err(db)?;
        tx.open_table(VOLUMES).map_err(db)?.insert(volume_id, bytes.as_slice()).map_err(db)?;
        tx.commit().map_err(db)
    }

    pub fn volume(&self, volume_id: &str) -> Result<Option<VolumeRecord>, StoreError> {
        let tx = self.db.begin_read().map_err(db)?;
        let t = tx.open_table(VOLUMES).map_err(db)?;
        let Some(v) = t.get(volume_id).map_err(db)? else { return Ok(None) };
        serde_json::from_slice(v.value()).map(Some).map_err(db)
    }

    pub fn forget_volume(&self, volume_id: &str) -> Result<(), StoreError> {
        let tx = self.db.begin_write().map_err(db)?;
        tx.open_table(VOLUMES).map_err(db)?.remove(volume_id).map_err(db)?;
        tx.commit().map_err(db)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, MetaStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = MetaStore::open(&dir.path().join("meta.redb")).expect("open");
        (dir, s)
    }

    #[test]
    fn kv_namespaces_do_not_leak_between_backends() {
        let (_d, s) = store();
        s.kv_set("a", "k", b"1").expect("set");
        assert_eq!(s.kv_get("b", "k").expect("get"), None);
        assert_eq!(s.kv_get("a", "k").expect("get").as_deref(), Some(&b"1"[..]));
        assert!(s.kv_list("b", "", None, 10).expect("list").is_empty());
    }

    #[test]
    fn compare_and_swap_only_swaps_on_match() {
        let (_d, s) = store();
        assert!(s.kv_compare_and_swap("a", "k", None, Some(b"1")).expect("cas"));
        assert!(!s.kv_compare_and_swap("a", "k", None, Some(b"2")).expect("cas"));
        assert!(s.kv_compare_and_swap("a", "k", Some(b"1"), None).expect("cas"));
        assert_eq!(s.kv_get("a", "k").expect("get"), None);
    }

    #[test]
    fn list_pages_by_prefix_and_start_after() {
        let (_d, s) = store();
        for k in ["n/1", "n/2", "n/3", "o/1"] {
            s.kv_set("a", k, b"").expect("set");
        }
        assert_eq!(s.kv_list("a", "n/", None, 2).expect("list"), ["n/1", "n/2"]);
        assert_eq!(s.kv_list("a", "n/", Some("n/2"), 10).expect("list"), ["n/3"]);
    }

    #[test]
    fn data_survives_reopen_and_oversized_values_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.redb");
        {
            let s = MetaStore::open(&path).expect("open");
            s.kv_set("a", "k", b"v").expect("set");
            let rec = VolumeRecord { backend: "a".into(), digest: "d".into(), capacity_bytes: 1, created_at: 2 };
            s.record_volume("a:v", &rec).expect("record");
            assert!(matches!(s.kv_set("a", "big", &vec![0; MAX_VALUE_BYTES + 1]), Err(StoreError::ValueTooLarge(_))));
        }
        let s = MetaStore::open(&path).expect("reopen");
        assert_eq!(s.kv_get("a", "k").expect("get").as_deref(), Some(&b"v"[..]));
        assert_eq!(s.volume("a:v").expect("get").map(|r| r.digest), Some("d".into()));
    }
}
