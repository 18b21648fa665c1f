//! The host's embedded metadata store (redb): each backend's private `kv` namespace with its
//! usage against the backend's quota, and the journal of which backend build (digest) created
//! each volume. One file under the state dir; every write is a durable transaction, so a
//! restart between a CreateVolume and its retry loses nothing, and a backend's usage is
//! updated in the same transaction as its keys (a crash never leaves the two apart).
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use std::path::Path;

const KV: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("kv");
const VOLUMES: TableDefinition<&str, &[u8]> = TableDefinition::new("volumes");
/// backend → (bytes, keys) of its `kv` namespace, as [`entry_cost`] counts them.
const KV_USAGE: TableDefinition<&str, (u64, u64)> = TableDefinition::new("kv_usage");
/// Store-wide facts: `schema` (2 = `kv_usage` is maintained).
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SCHEMA: u64 = 2;

/// Largest key and value the `kv` capability accepts (see the WIT docs).
pub const MAX_KEY_BYTES: usize = 512;
pub const MAX_VALUE_BYTES: usize = 64 << 10;

/// What one entry costs against a quota beyond its key and value: a flood of empty values
/// still grows the database (redb's per-entry overhead is of this order).
pub const ENTRY_OVERHEAD: u64 = 64;

fn entry_cost(key: &str, value_len: usize) -> u64 {
    key.len() as u64 + value_len as u64 + ENTRY_OVERHEAD
}

/// How much of the store one backend's `kv` namespace may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvQuota {
    pub bytes: u64,
    pub keys: u64,
}

impl KvQuota {
    /// No limit (the host's own callers and tests).
    pub const UNLIMITED: Self = Self { bytes: u64::MAX, keys: u64::MAX };
}

/// What one backend's `kv` namespace uses now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvUsage {
    /// keys + values + [`ENTRY_OVERHEAD`] per key
    pub bytes: u64,
    pub keys: u64,
}

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error("metadata store {0}")]
    Db(String),
    #[error("key of {0} bytes exceeds {MAX_KEY_BYTES}")]
    KeyTooLarge(usize),
    #[error("value of {0} bytes exceeds {MAX_VALUE_BYTES}")]
    ValueTooLarge(usize),
    #[error(
        "kv quota of backend {backend} exceeded: this write would use {} bytes in {} keys, the quota is {} bytes and {} keys",
        would.bytes, would.keys, quota.bytes, quota.keys
    )]
    QuotaExceeded { backend: String, would: KvUsage, quota: KvQuota },
}

fn db<E: std::fmt::Display>(e: E) -> MetadataError {
    MetadataError::Db(e.to_string())
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
    pub fn open(path: &Path) -> Result<Self, MetadataError> {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(db)?;
        }
        let database = Database::create(path).map_err(db)?;
        let tx = database.begin_write().map_err(db)?;
        tx.open_table(KV).map_err(db)?;
        tx.open_table(VOLUMES).map_err(db)?;
        tx.open_table(KV_USAGE).map_err(db)?;
        let schema = tx.open_table(META).map_err(db)?.get("schema").map_err(db)?.map(|v| v.value()).unwrap_or(1);
        if schema < SCHEMA {
            Self::recount_usage(&tx)?;
            tx.open_table(META).map_err(db)?.insert("schema", SCHEMA).map_err(db)?;
        }
        tx.commit().map_err(db)?;
        Ok(Self { db: database })
    }

    /// Count every backend's usage from its keys (a store written before usage was kept).
    fn recount_usage(tx: &redb::WriteTransaction) -> Result<(), MetadataError> {
        let mut usage: std::collections::BTreeMap<String, KvUsage> = Default::default();
        for item in tx.open_table(KV).map_err(db)?.iter().map_err(db)? {
            let (k, v) = item.map_err(db)?;
            let (backend, key) = k.value();
            let u = usage.entry(backend.to_string()).or_default();
            u.bytes += entry_cost(key, v.value().len());
            u.keys += 1;
        }
        let mut t = tx.open_table(KV_USAGE).map_err(db)?;
        for (backend, u) in usage {
            t.insert(backend.as_str(), (u.bytes, u.keys)).map_err(db)?;
        }
        Ok(())
    }

    /// The usage of `backend`'s namespace.
    pub fn kv_usage(&self, backend: &str) -> Result<KvUsage, MetadataError> {
        let tx = self.db.begin_read().map_err(db)?;
        let t = tx.open_table(KV_USAGE).map_err(db)?;
        Ok(t.get(backend)
            .map_err(db)?
            .map(|v| v.value())
            .map(|(bytes, keys)| KvUsage { bytes, keys })
            .unwrap_or_default())
    }

    /// Replace `key`'s value with `new` (`None` = remove) inside `tx`, keeping `backend`'s
    /// usage in step and refusing a write that grows it beyond `quota`. A write that does not
    /// grow usage always passes, so a backend over a lowered quota can still clean up.
    fn put(
        tx: &redb::WriteTransaction,
        backend: &str,
        key: &str,
        new: Option<&[u8]>,
        quota: KvQuota,
    ) -> Result<(), MetadataError> {
        let mut kv = tx.open_table(KV).map_err(db)?;
        let old = kv.get((backend, key)).map_err(db)?.map(|v| v.value().len());
        let mut usage_t = tx.open_table(KV_USAGE).map_err(db)?;
        let (bytes, keys) = usage_t.get(backend).map_err(db)?.map(|v| v.value()).unwrap_or((0, 0));
        let old_cost = old.map_or(0, |n| entry_cost(key, n));
        let new_cost = new.map_or(0, |v| entry_cost(key, v.len()));
        let would = KvUsage {
            bytes: (bytes + new_cost).saturating_sub(old_cost),
            keys: keys + u64::from(new.is_some()) - u64::from(old.is_some()),
        };
        let grows = would.bytes > bytes || would.keys > keys;
        if grows && (would.bytes > quota.bytes || would.keys > quota.keys) {
            return Err(MetadataError::QuotaExceeded { backend: backend.into(), would, quota });
        }
        match new {
            Some(v) => kv.insert((backend, key), v).map(|_| ()).map_err(db)?,
            None => kv.remove((backend, key)).map(|_| ()).map_err(db)?,
        }
        usage_t.insert(backend, (would.bytes, would.keys)).map_err(db)?;
        Ok(())
    }

    fn check(key: &str, value: Option<&[u8]>) -> Result<(), MetadataError> {
        if key.len() > MAX_KEY_BYTES {
            return Err(MetadataError::KeyTooLarge(key.len()));
        }
        match value {
            Some(v) if v.len() > MAX_VALUE_BYTES => Err(MetadataError::ValueTooLarge(v.len())),
            _ => Ok(()),
        }
    }

    pub fn kv_get(&self, backend: &str, key: &str) -> Result<Option<Vec<u8>>, MetadataError> {
        let tx = self.db.begin_read().map_err(db)?;
        let t = tx.open_table(KV).map_err(db)?;
        Ok(t.get((backend, key)).map_err(db)?.map(|v| v.value().to_vec()))
    }

    pub fn kv_set(&self, backend: &str, key: &str, value: &[u8], quota: KvQuota) -> Result<(), MetadataError> {
        Self::check(key, Some(value))?;
        let tx = self.db.begin_write().map_err(db)?;
        Self::put(&tx, backend, key, Some(value), quota)?;
        tx.commit().map_err(db)
    }

    pub fn kv_delete(&self, backend: &str, key: &str) -> Result<(), MetadataError> {
        let tx = self.db.begin_write().map_err(db)?;
        Self::put(&tx, backend, key, None, KvQuota::UNLIMITED)?;
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
        quota: KvQuota,
    ) -> Result<bool, MetadataError> {
        Self::check(key, new)?;
        let tx = self.db.begin_write().map_err(db)?;
        {
            let t = tx.open_table(KV).map_err(db)?;
            let current = t.get((backend, key)).map_err(db)?.map(|v| v.value().to_vec());
            if current.as_deref() != expected {
                return Ok(false);
            }
        }
        Self::put(&tx, backend, key, new, quota)?;
        tx.commit().map_err(db)?;
        Ok(true)
    }

    pub fn kv_list(
        &self,
        backend: &str,
        prefix: &str,
        start_after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<String>, MetadataError> {
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

    pub fn record_volume(&self, volume_id: &str, record: &VolumeRecord) -> Result<(), MetadataError> {
        let bytes = serde_json::to_vec(record).map_err(db)?;
        let tx = self.db.begin_write().map_err(db)?;
        tx.open_table(VOLUMES).map_err(db)?.insert(volume_id, bytes.as_slice()).map_err(db)?;
        tx.commit().map_err(db)
    }

    /// Record `record` for `volume_id` unless the volume has a record already (a retried
    /// creation keeps the first), in one transaction; the record the volume has afterwards.
    pub fn record_volume_once(&self, volume_id: &str, record: VolumeRecord) -> Result<VolumeRecord, MetadataError> {
        let tx = self.db.begin_write().map_err(db)?;
        let kept = {
            let mut t = tx.open_table(VOLUMES).map_err(db)?;
            let existing = t.get(volume_id).map_err(db)?.map(|v| serde_json::from_slice(v.value()).map_err(db));
            match existing {
                Some(kept) => kept?,
                None => {
                    t.insert(volume_id, serde_json::to_vec(&record).map_err(db)?.as_slice()).map_err(db)?;
                    record
                }
            }
        };
        tx.commit().map_err(db)?;
        Ok(kept)
    }

    pub fn volume(&self, volume_id: &str) -> Result<Option<VolumeRecord>, MetadataError> {
        let tx = self.db.begin_read().map_err(db)?;
        let t = tx.open_table(VOLUMES).map_err(db)?;
        let Some(v) = t.get(volume_id).map_err(db)? else { return Ok(None) };
        serde_json::from_slice(v.value()).map(Some).map_err(db)
    }

    /// The recorded volumes of `backend` (ids `BACKEND:LOCAL`, in id order), skipping the
    /// first `skip`, at most `take`.
    pub fn volumes_of(
        &self,
        backend: &str,
        skip: usize,
        take: usize,
    ) -> Result<Vec<(String, VolumeRecord)>, MetadataError> {
        let tx = self.db.begin_read().map_err(db)?;
        let t = tx.open_table(VOLUMES).map_err(db)?;
        // Every id of the backend sorts between "NAME:" and "NAME;" (';' follows ':').
        let (from, to) = (format!("{backend}:"), format!("{backend};"));
        let mut out = Vec::new();
        for item in t.range(from.as_str()..to.as_str()).map_err(db)?.skip(skip).take(take) {
            let (k, v) = item.map_err(db)?;
            out.push((k.value().to_string(), serde_json::from_slice(v.value()).map_err(db)?));
        }
        Ok(out)
    }

    /// The backends with at least one recorded volume.
    pub fn backends_with_volumes(&self) -> Result<std::collections::BTreeSet<String>, MetadataError> {
        let tx = self.db.begin_read().map_err(db)?;
        let t = tx.open_table(VOLUMES).map_err(db)?;
        let mut out = std::collections::BTreeSet::new();
        for item in t.iter().map_err(db)? {
            let (k, _) = item.map_err(db)?;
            if let Some((backend, _)) = k.value().split_once(':') {
                out.insert(backend.to_string());
            }
        }
        Ok(out)
    }

    pub fn forget_volume(&self, volume_id: &str) -> Result<(), MetadataError> {
        let tx = self.db.begin_write().map_err(db)?;
        tx.open_table(VOLUMES).map_err(db)?.remove(volume_id).map_err(db)?;
        tx.commit().map_err(db)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
mod tests {
    use super::*;

    #[test]
    fn the_volumes_of_one_backend_are_listed_in_pages_and_no_other() {
        let (_d, s) = store();
        let record = |backend: &str| VolumeRecord {
            backend: backend.into(),
            digest: "d".into(),
            capacity_bytes: 1,
            created_at: 0,
        };
        for id in ["b:v2", "b:v1", "b-x:v", "a:v", "b2:v"] {
            s.record_volume(id, &record(id.split_once(':').map_or("", |p| p.0))).unwrap();
        }
        let ids = |skip, take| s.volumes_of("b", skip, take).unwrap().into_iter().map(|(id, _)| id).collect::<Vec<_>>();
        assert_eq!(ids(0, 10), ["b:v1", "b:v2"]);
        assert_eq!(ids(1, 10), ["b:v2"]);
        assert_eq!(ids(0, 1), ["b:v1"]);
        let names: Vec<String> = s.backends_with_volumes().unwrap().into_iter().collect();
        assert_eq!(names, ["a", "b", "b-x", "b2"]);
    }

    #[test]
    fn a_volume_keeps_its_first_record() {
        let (_d, s) = store();
        let record = |digest: &str| VolumeRecord {
            backend: "b".into(),
            digest: digest.into(),
            capacity_bytes: 1,
            created_at: 0,
        };
        assert_eq!(s.record_volume_once("b:v", record("first")).unwrap().digest, "first");
        assert_eq!(s.record_volume_once("b:v", record("second")).unwrap().digest, "first");
        assert_eq!(s.volume("b:v").unwrap().map(|r| r.digest).as_deref(), Some("first"));
        s.forget_volume("b:v").unwrap();
        assert_eq!(s.record_volume_once("b:v", record("third")).unwrap().digest, "third");
    }

    fn store() -> (tempfile::TempDir, MetaStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = MetaStore::open(&dir.path().join("meta.redb")).expect("open");
        (dir, s)
    }

    #[test]
    fn kv_namespaces_do_not_leak_between_backends() {
        let (_d, s) = store();
        s.kv_set("a", "k", b"1", KvQuota::UNLIMITED).expect("set");
        assert_eq!(s.kv_get("b", "k").expect("get"), None);
        assert_eq!(s.kv_get("a", "k").expect("get").as_deref(), Some(&b"1"[..]));
        assert!(s.kv_list("b", "", None, 10).expect("list").is_empty());
    }

    #[test]
    fn compare_and_swap_only_swaps_on_match() {
        let (_d, s) = store();
        assert!(s.kv_compare_and_swap("a", "k", None, Some(b"1"), KvQuota::UNLIMITED).expect("cas"));
        assert!(!s.kv_compare_and_swap("a", "k", None, Some(b"2"), KvQuota::UNLIMITED).expect("cas"));
        assert!(s.kv_compare_and_swap("a", "k", Some(b"1"), None, KvQuota::UNLIMITED).expect("cas"));
        assert_eq!(s.kv_get("a", "k").expect("get"), None);
    }

    #[test]
    fn list_pages_by_prefix_and_start_after() {
        let (_d, s) = store();
        for k in ["n/1", "n/2", "n/3", "o/1"] {
            s.kv_set("a", k, b"", KvQuota::UNLIMITED).expect("set");
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
            s.kv_set("a", "k", b"v", KvQuota::UNLIMITED).expect("set");
            let rec = VolumeRecord { backend: "a".into(), digest: "d".into(), capacity_bytes: 1, created_at: 2 };
            s.record_volume("a:v", &rec).expect("record");
            assert!(matches!(
                s.kv_set("a", "big", &vec![0; MAX_VALUE_BYTES + 1], KvQuota::UNLIMITED),
                Err(MetadataError::ValueTooLarge(_))
            ));
        }
        let s = MetaStore::open(&path).expect("reopen");
        assert_eq!(s.kv_get("a", "k").expect("get").as_deref(), Some(&b"v"[..]));
        assert_eq!(s.volume("a:v").expect("get").map(|r| r.digest), Some("d".into()));
    }

    #[test]
    fn a_quota_bounds_bytes_and_keys_and_cleanup_always_passes() {
        let (_d, s) = store();
        let quota = KvQuota { bytes: 3 * (ENTRY_OVERHEAD + 1 + 100), keys: 3 };
        for k in ["a", "b", "c"] {
            s.kv_set("x", k, &[0; 100], quota).expect("within quota");
        }
        let over = s.kv_set("x", "d", &[], quota);
        assert!(matches!(over, Err(MetadataError::QuotaExceeded { .. })), "{over:?}");
        assert!(matches!(s.kv_set("x", "a", &[0; 101], quota), Err(MetadataError::QuotaExceeded { .. })));
        s.kv_set("x", "a", &[0; 10], quota).expect("shrinking passes");
        assert!(matches!(
            s.kv_compare_and_swap("x", "d", None, Some(b"1"), quota),
            Err(MetadataError::QuotaExceeded { .. })
        ));
        s.kv_set("other", "d", &[0; 100], quota).expect("quotas are per backend");
        s.kv_delete("x", "b").expect("delete");
        assert_eq!(s.kv_usage("x").expect("usage"), KvUsage { bytes: 2 * (ENTRY_OVERHEAD + 1) + 110, keys: 2 });
        s.kv_set("x", "d", &[], quota).expect("room again");
        // Lowered below what is used: nothing grows, everything shrinks.
        let tight = KvQuota { bytes: 1, keys: 1 };
        assert!(s.kv_set("x", "e", &[], tight).is_err());
        assert!(s.kv_compare_and_swap("x", "a", Some(&[0; 10]), None, tight).expect("cas delete"));
    }

    #[test]
    fn usage_is_recounted_for_a_store_written_before_it_was_kept() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.redb");
        {
            let s = MetaStore::open(&path).expect("open");
            s.kv_set("a", "k1", b"12345", KvQuota::UNLIMITED).expect("set");
            s.kv_set("a", "k2", b"", KvQuota::UNLIMITED).expect("set");
            // What an older host left: keys, no usage, no schema.
            let tx = s.db.begin_write().expect("tx");
            tx.delete_table(KV_USAGE).expect("drop usage");
            tx.delete_table(META).expect("drop meta");
            tx.commit().expect("commit");
        }
        let s = MetaStore::open(&path).expect("reopen");
        assert_eq!(s.kv_usage("a").expect("usage"), KvUsage { bytes: 2 * (ENTRY_OVERHEAD + 2) + 5, keys: 2 });
        assert_eq!(s.kv_usage("b").expect("usage"), KvUsage::default());
    }
}
