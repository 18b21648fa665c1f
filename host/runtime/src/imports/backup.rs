//! `backup`: backups of snapshots to the targets the operator granted the backend
//! (`[backends.NAME.grants] backup = ["TARGET", …]`, each configured as `[backup_targets.TARGET]`),
//! run by the host's [`Backups`]. A backend granted no target still links: `targets` is empty and
//! every other function is permission-denied, so a backend can offer backups where the operator
//! configured them and work without them elsewhere.
//!
//! Ids. The host's id of a backup is `VOLUME/NAME`: the backed-up volume's id and the name
//! `start` was given (a backup's name is unique per volume and target, not across volumes).
//!
//! Sources: replicated block snapshots, read from one healthy replica through the backend's own
//! `block` catalog (a set of another grant is not found). RBD snapshots are not provided by
//! this host (`unimplemented`, see [`super::not_provided`]).
//!
//! Credentials: a call's secrets `AWS_ACCESS_KEY_ID` + `AWS_SECRET_ACCESS_KEY` (+
//! `AWS_SESSION_TOKEN`) replace the target's configured ones; the values stay in the host.
//!
//! Its host functions see a [`BackupCtxView`]: the backend's [`BackupCtx`] and the call's secrets.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use wasmcsi_backup::{ErrorKind, S3Credentials, Secret};
use wasmcsi_block::catalog::Catalog;
use wasmtime::component::{HasData, LinkerInstance};

use super::not_provided;
use crate::backups::{BackupState as State, BackupStatus, Backups, BackupsError, backup_id, parse_backup_id};
use crate::bindings::types::{Error, Pair, SecretRef, Timestamp};
use crate::bindings::wasmcsi::backend::backup::{self as wit, BackupInfo, BackupSource, BackupState, Host};

/// What `backup` needs of one backend, resolved at load and shared by its calls.
pub struct BackupCtx {
    pub backend: String,
    /// the granted targets' names, in the order the grant lists them
    pub targets: Vec<String>,
    /// the backend's `block` catalog (its replica sets are what it may back up); `None`
    /// without a block grant
    pub catalog: Option<Catalog>,
    pub backups: Arc<Backups>,
    /// how long one import may take
    pub import_timeout: Duration,
}

/// What `backup` sees of a call.
pub struct BackupCtxView<'a> {
    pub ctx: &'a BackupCtx,
    /// the call's secrets, by handle (see `crate::secrets`)
    pub secrets: &'a [(String, String)],
}

/// A store whose calls can reach `backup`: it lends `backup` its view.
pub trait BackupView: Send {
    fn backup(&mut self) -> BackupCtxView<'_>;
}

/// `backup` for the linker: its host functions get a [`BackupCtxView`].
pub struct Backup;

impl HasData for Backup {
    type Data<'a> = BackupCtxView<'a>;
}

/// Link `backup`'s host functions into `instance` (named as the component's contract version
/// names the interface).
pub fn add_to_instance<T: BackupView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    wit::add_to_linker_instance::<T, Backup>(instance, T::backup)
}

/// The secret keys of S3 credentials (Longhorn's names for its backup target secret).
const ACCESS_KEY_ID: &str = "AWS_ACCESS_KEY_ID";
const SECRET_ACCESS_KEY: &str = "AWS_SECRET_ACCESS_KEY";
const SESSION_TOKEN: &str = "AWS_SESSION_TOKEN";

/// The WIT error of a backup error.
fn to_wit(e: BackupsError) -> Error {
    let m = e.to_string();
    match e {
        BackupsError::UnknownTarget(_) => Error::FailedPrecondition(m),
        BackupsError::NotFound(_) => Error::NotFound(m),
        BackupsError::AlreadyExists(_) => Error::AlreadyExists(m),
        BackupsError::Invalid(_) => Error::InvalidArgument(m),
        BackupsError::Unavailable(_) => Error::Unavailable(m),
        BackupsError::Store(s) => match s.kind() {
            ErrorKind::Forbidden => Error::PermissionDenied(m),
            ErrorKind::BucketMissing => Error::FailedPrecondition(m),
            ErrorKind::TargetFull => Error::ResourceExhausted(m),
            ErrorKind::NotFound => Error::NotFound(m),
            ErrorKind::Busy | ErrorKind::Cancelled => Error::Aborted(m),
            ErrorKind::Invalid => Error::InvalidArgument(m),
            ErrorKind::Corrupt | ErrorKind::MissingChunk => Error::FailedPrecondition(m),
            _ => Error::Unavailable(m),
        },
    }
}

fn info(target: &str, b: BackupStatus) -> BackupInfo {
    let (state, error) = match b.state {
        State::InProgress => (BackupState::InProgress, None),
        State::Ready => (BackupState::Ready, None),
        State::Failed(why) => (BackupState::Failed, Some(why)),
    };
    BackupInfo {
        id: backup_id(&b.volume, &b.backup),
        target: target.to_owned(),
        volume_id: b.volume,
        snapshot: b.snapshot,
        size_bytes: b.size,
        created: Timestamp { seconds: (b.created_ms / 1000) as i64, nanos: ((b.created_ms % 1000) * 1_000_000) as u32 },
        state,
        uploaded_bytes: b.done_bytes,
        total_bytes: b.total_bytes,
        labels: vec![],
        error,
    }
}

/// `(volume, name)` of a host id, or invalid-argument.
fn parse_id(id: &str) -> Result<(&str, &str), Error> {
    parse_backup_id(id).ok_or_else(|| Error::InvalidArgument(format!("backup id {id:?} is not VOLUME/NAME")))
}

impl BackupCtxView<'_> {
    /// `target` if it is granted, else permission-denied naming it.
    fn granted(&self, target: &str) -> Result<(), Error> {
        if self.ctx.targets.iter().any(|t| t == target) {
            Ok(())
        } else if self.ctx.targets.is_empty() {
            Err(Error::PermissionDenied(format!(
                "backend {} is granted no backup target (add [backends.{}.grants] backup = [\"{target}\"])",
                self.ctx.backend, self.ctx.backend
            )))
        } else {
            Err(Error::PermissionDenied(format!(
                "backup target {target:?} is not granted to backend {}",
                self.ctx.backend
            )))
        }
    }

    /// S3 credentials from the guest's secret-refs (checked against this call's secrets by
    /// their key); `None` when it passed none.
    fn credentials(&self, refs: &[SecretRef]) -> Result<Option<S3Credentials>, Error> {
        let mut found: HashMap<&str, &str> = HashMap::new();
        for r in refs {
            match self.secrets.get(r.handle as usize) {
                Some((key, value)) if *key == r.key => {
                    found.insert(key.as_str(), value.as_str());
                }
                _ => {
                    return Err(Error::PermissionDenied(format!(
                        "secret {:?}: handle {} is not valid for this call",
                        r.key, r.handle
                    )));
                }
            }
        }
        match (found.get(ACCESS_KEY_ID), found.get(SECRET_ACCESS_KEY)) {
            (Some(id), Some(key)) if !id.is_empty() && !key.is_empty() => Ok(Some(S3Credentials {
                access_key_id: (*id).to_owned(),
                secret_access_key: Secret::new(*key),
                session_token: found.get(SESSION_TOKEN).map(|t| Secret::new(*t)),
            })),
            (None, None) => Ok(None),
            _ => Err(Error::InvalidArgument(format!(
                "secrets {ACCESS_KEY_ID} and {SECRET_ACCESS_KEY} must both be given, not empty"
            ))),
        }
    }

    /// Runs `op` bounded by the import timeout.
    async fn bounded<T>(&self, function: &str, op: impl Future<Output = Result<T, BackupsError>>) -> Result<T, Error> {
        match tokio::time::timeout(self.ctx.import_timeout, op).await {
            Ok(r) => r.map_err(to_wit),
            Err(_) => Err(Error::DeadlineExceeded(format!(
                "backup {function} took longer than {:?}",
                self.ctx.import_timeout
            ))),
        }
    }
}

impl Host for BackupCtxView<'_> {
    #[tracing::instrument(name = "import.backup.targets", skip_all, fields(backend = %self.ctx.backend))]
    async fn targets(&mut self) -> Vec<String> {
        self.ctx.targets.clone()
    }

    #[tracing::instrument(name = "import.backup.start", skip_all, fields(backend = %self.ctx.backend, %target, %name))]
    async fn start(
        &mut self,
        target: String,
        name: String,
        source: BackupSource,
        labels: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<BackupInfo, Error> {
        let _ = labels;
        self.granted(&target)?;
        let credentials = self.credentials(&secrets)?;
        let (volume, snapshot) = match source {
            BackupSource::BlockSnapshot(pair) => pair,
            BackupSource::RbdSnapshot(_) => return Err(not_provided("backup start of an rbd snapshot: rbd backups")),
        };
        let catalog = self.ctx.catalog.as_ref().ok_or_else(|| {
            Error::PermissionDenied(format!(
                "backend {} has no block grant: no replica set to back up",
                self.ctx.backend
            ))
        })?;
        let backups = self.ctx.backups.clone();
        let status =
            self.bounded("start", backups.start(catalog, &target, &volume, &snapshot, &name, credentials)).await?;
        Ok(info(&target, status))
    }

    #[tracing::instrument(name = "import.backup.get", skip_all, fields(backend = %self.ctx.backend, %target, %id))]
    async fn get(&mut self, target: String, id: String, secrets: Vec<SecretRef>) -> Result<Option<BackupInfo>, Error> {
        self.granted(&target)?;
        let credentials = self.credentials(&secrets)?;
        let (volume, name) = parse_id(&id)?;
        let found = self.bounded("get", self.ctx.backups.get(&target, volume, name, credentials)).await?;
        Ok(found.map(|b| info(&target, b)))
    }

    #[tracing::instrument(name = "import.backup.list", skip_all, fields(backend = %self.ctx.backend, %target))]
    async fn list(
        &mut self,
        target: String,
        volume_id: Option<String>,
        start_after: Option<String>,
        limit: u32,
        secrets: Vec<SecretRef>,
    ) -> Result<Vec<BackupInfo>, Error> {
        self.granted(&target)?;
        let credentials = self.credentials(&secrets)?;
        let all = self.bounded("list", self.ctx.backups.list(&target, volume_id.as_deref(), credentials)).await?;
        let mut all: Vec<BackupInfo> = all.into_iter().map(|b| info(&target, b)).collect();
        all.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(all
            .into_iter()
            .filter(|b| start_after.as_ref().is_none_or(|after| &b.id > after))
            .take(limit as usize)
            .collect())
    }

    #[tracing::instrument(name = "import.backup.delete", skip_all, fields(backend = %self.ctx.backend, %target, %id))]
    async fn delete(&mut self, target: String, id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        self.granted(&target)?;
        let credentials = self.credentials(&secrets)?;
        let (volume, name) = parse_id(&id)?;
        let backups = self.ctx.backups.clone();
        self.bounded("delete", backups.delete(&target, volume, name, credentials)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::wasmcsi::backend::backup::RbdSnapshot;
    use wasmcsi_backup::{BackupOptions, BackupRequest, BackupStore, BackupTargets, FsTarget, MemorySource, Progress};

    /// A context granted `s3-main` (not configured here) and `local` (a filesystem target in `dir`).
    fn ctx(dir: &std::path::Path) -> BackupCtx {
        let targets: BackupTargets =
            toml::from_str(&format!("[local]\nkind = \"filesystem\"\npath = {:?}\n", dir.display().to_string()))
                .expect("targets");
        BackupCtx {
            backend: "b".into(),
            targets: vec!["s3-main".into(), "local".into()],
            catalog: None,
            backups: Arc::new(Backups::new(targets)),
            import_timeout: Duration::from_secs(10),
        }
    }

    fn view<'a>(ctx: &'a BackupCtx, secrets: &'a [(String, String)]) -> BackupCtxView<'a> {
        BackupCtxView { ctx, secrets }
    }

    #[tokio::test]
    async fn targets_are_the_grant_and_any_other_is_permission_denied() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx(dir.path());
        let mut v = view(&ctx, &[]);
        assert_eq!(v.targets().await, ["s3-main", "local"]);
        let e = v.get("elsewhere".into(), "v/b-1".into(), vec![]).await.expect_err("not granted");
        assert!(matches!(&e, Error::PermissionDenied(m) if m.contains("elsewhere")), "{e:?}");
        // Granted but not configured on this host: the operator's to fix.
        let e = v.get("s3-main".into(), "v/b-1".into(), vec![]).await.expect_err("not configured");
        assert!(
            matches!(&e, Error::FailedPrecondition(m) if m.contains("s3-main") && m.contains("[backup_targets")),
            "{e:?}"
        );
        let e = v.get("local".into(), "no-slash".into(), vec![]).await.expect_err("bad id");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("VOLUME/NAME")), "{e:?}");
    }

    #[tokio::test]
    async fn rbd_sources_are_not_provided_and_block_sources_need_a_block_grant() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx(dir.path());
        let mut v = view(&ctx, &[]);
        let rbd = BackupSource::RbdSnapshot(RbdSnapshot {
            cluster: "c".into(),
            pool: "p".into(),
            image: "i".into(),
            snapshot: "s".into(),
        });
        let e = v.start("local".into(), "b-1".into(), rbd, vec![], vec![]).await.expect_err("rbd");
        assert!(matches!(&e, Error::Unimplemented(m) if m.contains("rbd backups")), "{e:?}");
        let block = BackupSource::BlockSnapshot(("v".into(), "s".into()));
        let e = v.start("local".into(), "b-1".into(), block, vec![], vec![]).await.expect_err("no block grant");
        assert!(matches!(&e, Error::PermissionDenied(m) if m.contains("no block grant")), "{e:?}");
    }

    #[tokio::test]
    async fn credentials_come_only_from_this_calls_secrets_by_their_own_key() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ctx = ctx(dir.path());
        let secrets = [(ACCESS_KEY_ID.to_owned(), "id".to_owned()), (SECRET_ACCESS_KEY.to_owned(), "key".to_owned())];
        let v = view(&ctx, &secrets);
        let r = |key: &str, handle| SecretRef { key: key.into(), handle };
        let c = v.credentials(&[r(ACCESS_KEY_ID, 0), r(SECRET_ACCESS_KEY, 1)]).expect("both").expect("some");
        assert_eq!((c.access_key_id.as_str(), c.secret_access_key.expose()), ("id", "key"));
        assert!(v.credentials(&[]).expect("none").is_none());
        let e = v.credentials(&[r(SECRET_ACCESS_KEY, 0)]).expect_err("another key's handle");
        assert!(matches!(&e, Error::PermissionDenied(_)), "{e:?}");
        let e = v.credentials(&[r(ACCESS_KEY_ID, 0)]).expect_err("half");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains(SECRET_ACCESS_KEY)), "{e:?}");
        assert!(!format!("{c:?}").contains("key\""), "a secret printed: {c:?}");
    }

    /// A backup the store holds is reported ready under `VOLUME/NAME`, listed by id, and gone
    /// after delete (a second delete succeeds).
    #[tokio::test]
    async fn a_complete_backup_is_got_listed_and_deleted_by_its_host_id() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = BackupStore::new(Arc::new(FsTarget::new(dir.path())), Default::default());
        let data: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
        let request = BackupRequest { volume: "vol-1", backup: "snap-a", parent: None, snapshot: Some("snap-a") };
        store
            .backup(
                request,
                Arc::new(MemorySource::new(data)),
                &BackupOptions::default(),
                Arc::new(Progress::default()),
                &Default::default(),
            )
            .await
            .expect("backup");
        let ctx = ctx(dir.path());
        let mut v = view(&ctx, &[]);
        let got = v.get("local".into(), "vol-1/snap-a".into(), vec![]).await.expect("get").expect("found");
        assert_eq!(
            (got.id.as_str(), got.volume_id.as_str(), got.snapshot.as_str()),
            ("vol-1/snap-a", "vol-1", "snap-a")
        );
        assert!(matches!(got.state, BackupState::Ready) && got.size_bytes == 4 << 20, "{got:?}");
        assert_eq!(got.uploaded_bytes, got.total_bytes);
        assert!(v.get("local".into(), "vol-1/snap-b".into(), vec![]).await.expect("get").is_none());
        let listed = v.list("local".into(), None, None, 10, vec![]).await.expect("list");
        assert_eq!(listed.iter().map(|b| b.id.as_str()).collect::<Vec<_>>(), ["vol-1/snap-a"]);
        let after = v.list("local".into(), Some("vol-1".into()), Some("vol-1/snap-a".into()), 10, vec![]).await;
        assert!(after.expect("list").is_empty());
        v.delete("local".into(), "vol-1/snap-a".into(), vec![]).await.expect("delete");
        assert!(v.get("local".into(), "vol-1/snap-a".into(), vec![]).await.expect("get").is_none());
        v.delete("local".into(), "vol-1/snap-a".into(), vec![]).await.expect("absent succeeds");
    }
}
