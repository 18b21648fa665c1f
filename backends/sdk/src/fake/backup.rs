//! The fake `backup`: targets a test grants ([`FakeBackup::add_target`]); like the wasmcsi host
//! today, every function but `targets` answers permission-denied for a target not granted and
//! `unimplemented` ("… not provided by this host") for a granted one, so a backend's tests see
//! what it would see on the host.
use super::Journal;
use crate::backup::{Backup, BackupInfo, BackupSource};
use crate::types::{Error, Pair, SecretRef};
use std::cell::RefCell;

#[derive(Debug, Default)]
pub struct FakeBackup {
    targets: RefCell<Vec<String>>,
    pub journal: Journal,
}

impl FakeBackup {
    /// Grant a target.
    pub fn add_target(&self, name: &str) -> &Self {
        self.targets.borrow_mut().push(name.to_owned());
        self
    }

    fn call(&self, op: &str, target: &str) -> Error {
        if let Err(e) = self.journal.enter(op) {
            return e;
        }
        if !self.targets.borrow().iter().any(|t| t == target) {
            return Error::PermissionDenied(format!("backup target {target:?} is not granted to this backend"));
        }
        Error::Unimplemented(format!("backup {op}: backups: not provided by this host"))
    }
}

impl Backup for FakeBackup {
    fn targets(&self) -> Vec<String> {
        self.targets.borrow().clone()
    }
    fn start(&self, target: &str, _: &str, _: &BackupSource, _: &[Pair], _: &[SecretRef]) -> Result<BackupInfo, Error> {
        Err(self.call("start", target))
    }
    fn get(&self, target: &str, _: &str, _: &[SecretRef]) -> Result<Option<BackupInfo>, Error> {
        Err(self.call("get", target))
    }
    fn list(
        &self,
        target: &str,
        _: Option<&str>,
        _: Option<&str>,
        _: u32,
        _: &[SecretRef],
    ) -> Result<Vec<BackupInfo>, Error> {
        Err(self.call("list", target))
    }
    fn delete(&self, target: &str, _: &str, _: &[SecretRef]) -> Result<(), Error> {
        Err(self.call("delete", target))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn granted_targets_are_listed_and_backups_are_not_provided() {
        let b = FakeBackup::default();
        b.add_target("s3-main");
        assert_eq!(b.targets(), ["s3-main"]);
        assert!(matches!(b.get("other", "x", &[]), Err(Error::PermissionDenied(_))));
        let e = b.delete("s3-main", "x", &[]).expect_err("not provided");
        assert!(matches!(&e, Error::Unimplemented(m) if m.ends_with("not provided by this host")), "{e:?}");
        assert_eq!(b.journal.calls("delete"), 1);
    }
}
