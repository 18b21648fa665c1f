//! Garbage collection of a volume's chunks: mark every chunk a manifest names, sweep the rest,
//! under the volume's collection lock.
//!
//! Why a running backup never loses a chunk it will name (see `lease.rs` for the exclusion):
//! 1. A backup holds a lease from before it reads its parent's manifest or heads any chunk until
//!    after its manifest is written; a collection takes the volume's lock and proceeds only when
//!    it sees no live lease, and a backup that sees a live lock steps back. So no collection's
//!    mark-and-sweep overlaps a backup's choice of chunks and its commit.
//! 2. Both sides stop working as soon as they can no longer be sure the other side considers
//!    them alive (renewal older than half the TTL); the collection checks before every batch of
//!    deletes, the backup before its commit.
//! 3. A chunk younger than the grace period (by the target's clock, against the collection's own
//!    lock) is never removed, whatever the leases say.
//!
//! A lease that expired (a backup that crashed) is removed by the collection, and the chunks only
//! that attempt uploaded go with it (a later retry uploads them again). Everything is listed per
//! volume: a collection reads the volume's manifests and lists its chunks, nothing else.

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt as _, TryStreamExt as _};

use crate::error::Error;
use crate::layout::VolumeKeys;
use crate::lease::{Held, is_live};
use crate::store::BackupStore;

/// Deletes sent between two checks of the collection's own lock.
const DELETE_BATCH: usize = 256;
/// Deletes in flight at once.
const DELETES_IN_FLIGHT: usize = 16;

/// What one collection of a volume did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub manifests: u64,
    pub chunks_referenced: u64,
    pub chunks_seen: u64,
    pub chunks_deleted: u64,
    pub bytes_deleted: u64,
    /// Unreferenced chunks kept because they are younger than the grace period.
    pub chunks_kept_young: u64,
    /// Expired leases (crashed backups) removed.
    pub stale_leases_removed: u64,
}

impl BackupStore {
    /// Collects the chunks of `volume` no manifest references. [`Error::Busy`] while a backup of
    /// the volume runs (nothing is deleted then).
    #[tracing::instrument(name = "backup.gc", skip_all, fields(volume = volume))]
    pub async fn collect_garbage(&self, volume: &str) -> Result<GcReport, Error> {
        let keys = VolumeKeys::new(volume)?;
        let options = self.options.lease;
        let body = serde_json::json!({ "pid": std::process::id() }).to_string();
        let lock = Held::take(self.target.clone(), keys.gc_lock(), Bytes::from(body), options).await?;
        let result = self.collect_locked(volume, &keys, &lock).await;
        lock.release().await;
        match &result {
            Ok(r) => tracing::info!(
                deleted = r.chunks_deleted,
                bytes = r.bytes_deleted,
                kept = r.chunks_kept_young,
                "collected"
            ),
            Err(e) => tracing::warn!(error = %e, "collection stopped"),
        }
        result
    }

    async fn collect_locked(&self, volume: &str, keys: &VolumeKeys, lock: &Held) -> Result<GcReport, Error> {
        let now = lock.modified;
        let ttl = self.options.lease.ttl;
        let mut report = GcReport::default();

        let leases: Vec<_> = self.target.list(&keys.leases()).try_collect().await?;
        let (live, stale): (Vec<_>, Vec<_>) = leases.into_iter().partition(|l| is_live(l.modified, now, ttl));
        if !live.is_empty() {
            let names: Vec<&str> = live.iter().map(|l| l.key.rsplit('/').next().unwrap_or(&l.key)).collect();
            return Err(Error::Busy {
                volume: volume.to_owned(),
                holder: format!("backups in progress ({})", names.join(", ")),
            });
        }
        for l in stale {
            self.target.delete(&l.key).await?;
            report.stale_leases_removed += 1;
        }

        // Mark. A manifest that cannot be read stops the collection: sweeping with part of the
        // references unknown could remove what a backup needs.
        let mut referenced = HashSet::new();
        let manifests: Vec<_> = self.target.list(&keys.backups()).try_collect().await?;
        for obj in manifests {
            let Some(id) = keys.backup_of(&obj.key) else { continue };
            let Some(m) = self.try_manifest(keys, volume, &id).await? else { continue };
            report.manifests += 1;
            referenced.extend(m.chunks.iter().map(|(_, h)| *h));
        }
        report.chunks_referenced = referenced.len() as u64;

        // Sweep, streaming the listing: a batch of deletes at a time.
        let grace = self.options.gc_grace;
        let chunks_prefix = keys.chunks();
        let mut listing = self.target.list(&chunks_prefix);
        let mut batch = Vec::with_capacity(DELETE_BATCH);
        loop {
            let next = listing.try_next().await?;
            let end = next.is_none();
            if let Some(obj) = next {
                let Some(hash) = keys.chunk_of(&obj.key) else { continue };
                report.chunks_seen += 1;
                if referenced.contains(&hash) {
                    continue;
                }
                if now.duration_since(obj.modified).unwrap_or(Duration::ZERO) < grace {
                    report.chunks_kept_young += 1;
                    continue;
                }
                batch.push(obj);
                if batch.len() < DELETE_BATCH {
                    continue;
                }
            }
            if !batch.is_empty() {
                if let Err(age) = lock.healthy() {
                    return Err(Error::LeaseLost {
                        volume: volume.to_owned(),
                        backup: "(collection)".into(),
                        seconds: age.as_secs(),
                    });
                }
                let deleted: Vec<u64> = futures::stream::iter(batch.drain(..))
                    .map(|o| async move { self.target.delete(&o.key).await.map(|()| o.size) })
                    .buffer_unordered(DELETES_IN_FLIGHT)
                    .try_collect()
                    .await?;
                report.chunks_deleted += deleted.len() as u64;
                report.bytes_deleted += deleted.iter().sum::<u64>();
            }
            if end {
                break;
            }
        }
        Ok(report)
    }
}
