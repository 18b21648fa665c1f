//! [`BackupStore`]: one target and the operations on its volumes' backups. Reading, listing and
//! deleting backups live here; writing them in `backup.rs`, restoring in `restore.rs`, collecting
//! unreferenced chunks in `gc.rs`.

use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt as _;

use crate::error::{Error, TargetErrorKind};
use crate::layout::{self, VolumeKeys};
use crate::lease::LeaseOptions;
use crate::manifest::Manifest;
use crate::target::Target;

/// Options of a store (the same for every client of a target, so leases agree).
#[derive(Clone, Copy, Debug)]
pub struct StoreOptions {
    pub lease: LeaseOptions,
    /// A collection never removes a chunk written less than this long ago (by the target's
    /// clock), whatever the leases say: a second guard, against a clock or a lease gone wrong.
    pub gc_grace: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self { lease: LeaseOptions::default(), gc_grace: Duration::from_secs(3600) }
    }
}

/// The backups of every volume on one target.
#[derive(Clone, Debug)]
pub struct BackupStore {
    pub(crate) target: Arc<dyn Target>,
    pub(crate) options: StoreOptions,
}

/// What a listing tells of one backup (its manifest without the chunk list).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackupInfo {
    pub volume: String,
    pub backup: String,
    pub parent: Option<String>,
    pub snapshot: Option<String>,
    pub size: u64,
    pub created_ms: u64,
    /// Chunks holding data (the rest are holes).
    pub data_chunks: u64,
}

impl BackupStore {
    pub fn new(target: Arc<dyn Target>, options: StoreOptions) -> Self {
        Self { target, options }
    }

    pub fn target(&self) -> &Arc<dyn Target> {
        &self.target
    }

    /// The manifest of `backup`; [`Error::BackupNotFound`] when it has none (never written, or
    /// not complete: the manifest is written last).
    pub async fn manifest(&self, volume: &str, backup: &str) -> Result<Manifest, Error> {
        layout::check_backup_id(backup)?;
        let keys = VolumeKeys::new(volume)?;
        self.try_manifest(&keys, volume, backup)
            .await?
            .ok_or_else(|| Error::BackupNotFound { volume: volume.to_owned(), backup: backup.to_owned() })
    }

    pub(crate) async fn try_manifest(
        &self,
        keys: &VolumeKeys,
        volume: &str,
        backup: &str,
    ) -> Result<Option<Manifest>, Error> {
        let key = keys.manifest(backup);
        let bytes = match self.target.get(&key).await {
            Ok(b) => b,
            Err(e) if e.kind == TargetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let m: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| Error::CorruptManifest { key: key.clone(), why: e.to_string() })?;
        m.check(volume, backup).map_err(|why| Error::CorruptManifest { key, why })?;
        Ok(Some(m))
    }

    /// The complete backups of `volume`, oldest first. Lists only the volume's own manifests.
    #[tracing::instrument(name = "backup.list", skip_all, fields(volume = volume))]
    pub async fn list_backups(&self, volume: &str) -> Result<Vec<BackupInfo>, Error> {
        let keys = VolumeKeys::new(volume)?;
        let listed: Vec<_> = self.target.list(&keys.backups()).try_collect().await?;
        let mut out = Vec::with_capacity(listed.len());
        for obj in listed {
            let Some(id) = keys.backup_of(&obj.key) else { continue };
            // Deleted between the listing and the read: not a backup any more.
            let Some(m) = self.try_manifest(&keys, volume, &id).await? else { continue };
            out.push(BackupInfo {
                volume: m.volume,
                backup: m.backup,
                parent: m.parent,
                snapshot: m.snapshot,
                size: m.size,
                created_ms: m.created_ms,
                data_chunks: m.chunks.len() as u64,
            });
        }
        out.sort_by(|a, b| (a.created_ms, &a.backup).cmp(&(b.created_ms, &b.backup)));
        Ok(out)
    }

    /// The volumes that have anything on this target.
    pub async fn volumes(&self) -> Result<Vec<String>, Error> {
        let folders = self.target.folders(layout::VOLUMES).await?;
        Ok(folders.iter().filter_map(|f| layout::decode_volume(f)).collect())
    }

    /// Deletes `backup` (its manifest): it is no longer listed or restorable at once. The chunks
    /// only it used go with the volume's next [`BackupStore::collect_garbage`]. Returns whether
    /// it existed (deleting a deleted backup is not an error).
    #[tracing::instrument(name = "backup.delete", skip_all, fields(volume = volume, backup = backup))]
    pub async fn delete_backup(&self, volume: &str, backup: &str) -> Result<bool, Error> {
        layout::check_backup_id(backup)?;
        let keys = VolumeKeys::new(volume)?;
        let key = keys.manifest(backup);
        let existed = self.target.head(&key).await?.is_some();
        self.target.delete(&key).await?;
        tracing::info!(volume, backup, existed, "backup deleted");
        Ok(existed)
    }
}
