//! `backup`: backups of snapshots (replicated block or RBD) to the targets the operator
//! granted, incremental and deduplicated by the host; listed, looked up and deleted by id.
//! [`Backup`] is the capability, [`BackupImport`] the component's import of it. A host that
//! does not provide backups answers `unimplemented` for all but `targets`.
use crate::types::{Error, Pair, SecretRef};
use crate::wit::wasmcsi::backend::backup as wit;

pub use wit::{BackupInfo, BackupSource, BackupState, RbdSnapshot};

/// The `backup` capability: one method per WIT function, same errors (see `wit/backend.wit`).
pub trait Backup {
    /// Targets granted to this backend.
    fn targets(&self) -> Vec<String>;
    /// Start the backup `name` of `source` to `target`, or report on it (idempotent by name).
    fn start(
        &self,
        target: &str,
        name: &str,
        source: &BackupSource,
        labels: &[Pair],
        secrets: &[SecretRef],
    ) -> Result<BackupInfo, Error>;
    /// One backup by id, `None` when absent.
    fn get(&self, target: &str, id: &str, secrets: &[SecretRef]) -> Result<Option<BackupInfo>, Error>;
    /// Backups on `target` (of one volume, or all), by id, at most `limit`, after `start_after`.
    fn list(
        &self,
        target: &str,
        volume_id: Option<&str>,
        start_after: Option<&str>,
        limit: u32,
        secrets: &[SecretRef],
    ) -> Result<Vec<BackupInfo>, Error>;
    /// Delete a backup; absent succeeds.
    fn delete(&self, target: &str, id: &str, secrets: &[SecretRef]) -> Result<(), Error>;
}

/// The component's `backup` import.
#[derive(Debug, Clone, Copy, Default)]
pub struct BackupImport;

impl Backup for BackupImport {
    fn targets(&self) -> Vec<String> {
        wit::targets()
    }
    fn start(
        &self,
        target: &str,
        name: &str,
        source: &BackupSource,
        labels: &[Pair],
        secrets: &[SecretRef],
    ) -> Result<BackupInfo, Error> {
        wit::start(target, name, source, labels, secrets)
    }
    fn get(&self, target: &str, id: &str, secrets: &[SecretRef]) -> Result<Option<BackupInfo>, Error> {
        wit::get(target, id, secrets)
    }
    fn list(
        &self,
        target: &str,
        volume_id: Option<&str>,
        start_after: Option<&str>,
        limit: u32,
        secrets: &[SecretRef],
    ) -> Result<Vec<BackupInfo>, Error> {
        wit::list(target, volume_id, start_after, limit, secrets)
    }
    fn delete(&self, target: &str, id: &str, secrets: &[SecretRef]) -> Result<(), Error> {
        wit::delete(target, id, secrets)
    }
}
