//! `backup`: backups of snapshots to the targets the operator granted the backend
//! (`[backends.NAME.grants] backup = ["TARGET", …]`). This host does not provide backups yet: it
//! knows which targets a backend was granted (`targets`, and permission-denied for any other),
//! and answers every other function `unimplemented` saying so (see [`super::not_provided`]), as
//! the WIT documents. The host that moves the data (chunks, manifests, an object store client)
//! implements the functions here, on the same grant.
//!
//! Its host functions see a [`BackupCtxView`]: the backend's [`BackupCtx`], nothing of the call.
use wasmtime::component::{HasData, LinkerInstance};

use super::not_provided;
use crate::bindings::types::{Error, Pair, SecretRef};
use crate::bindings::wasmcsi::backend::backup::{self as wit, BackupInfo, BackupSource, Host};

/// What `backup` needs of one backend, resolved at load and shared by its calls.
pub struct BackupCtx {
    pub backend: String,
    /// the granted targets' names, in the order the grant lists them
    pub targets: Vec<String>,
}

/// What `backup` sees of a call.
pub struct BackupCtxView<'a> {
    pub ctx: &'a BackupCtx,
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

impl BackupCtxView<'_> {
    /// `target` if it is granted, else permission-denied naming it.
    fn granted(&self, target: &str) -> Result<(), Error> {
        if self.ctx.targets.iter().any(|t| t == target) {
            Ok(())
        } else {
            Err(Error::PermissionDenied(format!(
                "backup target {target:?} is not granted to backend {}",
                self.ctx.backend
            )))
        }
    }
}

/// What every function but `targets` answers on a granted target.
fn backups_not_provided(function: &str) -> Error {
    not_provided(&format!("backup {function}: backups"))
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
        let _ = (source, labels, secrets);
        self.granted(&target)?;
        Err(backups_not_provided("start"))
    }

    #[tracing::instrument(name = "import.backup.get", skip_all, fields(backend = %self.ctx.backend, %target, %id))]
    async fn get(&mut self, target: String, id: String, secrets: Vec<SecretRef>) -> Result<Option<BackupInfo>, Error> {
        let _ = secrets;
        self.granted(&target)?;
        Err(backups_not_provided("get"))
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
        let _ = (volume_id, start_after, limit, secrets);
        self.granted(&target)?;
        Err(backups_not_provided("list"))
    }

    #[tracing::instrument(name = "import.backup.delete", skip_all, fields(backend = %self.ctx.backend, %target, %id))]
    async fn delete(&mut self, target: String, id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        let _ = secrets;
        self.granted(&target)?;
        Err(backups_not_provided("delete"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::wasmcsi::backend::backup::RbdSnapshot;

    fn ctx() -> BackupCtx {
        BackupCtx { backend: "b".into(), targets: vec!["s3-main".into(), "nfs-dr".into()] }
    }

    #[tokio::test]
    async fn targets_are_the_grant_and_any_other_is_permission_denied() {
        let ctx = ctx();
        let mut v = BackupCtxView { ctx: &ctx };
        assert_eq!(v.targets().await, ["s3-main", "nfs-dr"]);
        let e = v.get("elsewhere".into(), "b-1".into(), vec![]).await.expect_err("not granted");
        assert!(matches!(&e, Error::PermissionDenied(m) if m.contains("elsewhere")), "{e:?}");
    }

    /// Backups are not provided by this host: every function but `targets` says so on a granted
    /// target. The host that provides them flips this test.
    #[tokio::test]
    async fn backups_are_not_provided_by_this_host() {
        let ctx = ctx();
        let mut v = BackupCtxView { ctx: &ctx };
        let source = BackupSource::RbdSnapshot(RbdSnapshot {
            cluster: "c".into(),
            pool: "p".into(),
            image: "i".into(),
            snapshot: "s".into(),
        });
        let answers = [
            ("start", v.start("s3-main".into(), "b-1".into(), source, vec![], vec![]).await.map(drop)),
            ("get", v.get("s3-main".into(), "b-1".into(), vec![]).await.map(drop)),
            ("list", v.list("s3-main".into(), None, None, 10, vec![]).await.map(drop)),
            ("delete", v.delete("nfs-dr".into(), "b-1".into(), vec![]).await),
        ];
        for (function, answer) in answers {
            match answer {
                Err(Error::Unimplemented(m)) => {
                    assert_eq!(m, format!("backup {function}: backups: not provided by this host"))
                }
                other => panic!("{function}: expected unimplemented, got {other:?}"),
            }
        }
    }
}
