//! The fake `dir`: named roots, each an in-memory [`Tree`]. Paths are checked as the host's
//! `resolve` does: absolute, NUL or over-long paths are invalid-argument, an empty, `.` or
//! `..` component (an escape) is permission-denied; so is a root that was not added.
use super::{Clock, Journal, Tree};
use crate::dir::{Dir, FileStat, Space};
use crate::types::Error;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

/// Size of every fake file system unless set otherwise.
const TOTAL_BYTES: u64 = 100 << 30;

#[derive(Debug)]
pub struct FakeDir {
    roots: RefCell<BTreeMap<String, Tree>>,
    total_bytes: Cell<u64>,
    clock: Clock,
    pub journal: Journal,
}

impl Default for FakeDir {
    fn default() -> Self {
        Self {
            roots: RefCell::default(),
            total_bytes: Cell::new(TOTAL_BYTES),
            clock: Clock::default(),
            journal: Journal::default(),
        }
    }
}

fn check_path(path: &str) -> Result<(), Error> {
    if path.starts_with('/') || path.contains('\0') || path.len() > 4096 {
        return Err(Error::InvalidArgument(format!("path {path:?} must be relative, without NUL, at most 4096 bytes")));
    }
    if path.is_empty() {
        return Ok(());
    }
    match path.split('/').find(|p| p.is_empty() || *p == "." || *p == ".." || p.len() > 255) {
        Some(part) => Err(Error::PermissionDenied(format!("path {path:?}: component {part:?} is not allowed"))),
        None => Ok(()),
    }
}

impl FakeDir {
    /// Grant a root (empty).
    pub fn add_root(&self, name: &str) -> &Self {
        self.roots.borrow_mut().entry(name.to_owned()).or_default();
        self
    }
    /// The size `fs-stats` reports for every root; available = size − file data stored.
    pub fn set_total_bytes(&self, bytes: u64) {
        self.total_bytes.set(bytes);
    }
    /// Every path under a root, in order (empty for an unknown root).
    pub fn paths(&self, root: &str) -> Vec<String> {
        self.roots.borrow().get(root).map(Tree::paths).unwrap_or_default()
    }
    pub fn exists(&self, root: &str, path: &str) -> bool {
        self.roots.borrow().get(root).is_some_and(|t| t.exists(path))
    }
    pub fn fail_next(&self, op: &str, error: Error) {
        self.journal.fail_next(op, error)
    }

    fn with<T>(
        &self,
        op: &str,
        root: &str,
        paths: &[&str],
        f: impl FnOnce(&mut Tree) -> Result<T, Error>,
    ) -> Result<T, Error> {
        self.journal.enter(op)?;
        let mut roots = self.roots.borrow_mut();
        let tree =
            roots.get_mut(root).ok_or_else(|| Error::PermissionDenied(format!("dir root {root:?} is not granted")))?;
        paths.iter().try_for_each(|p| check_path(p))?;
        f(tree)
    }
}

impl Dir for FakeDir {
    fn roots(&self) -> Vec<String> {
        self.roots.borrow().keys().cloned().collect()
    }
    fn mkdir(&self, root: &str, path: &str, mode: u32) -> Result<(), Error> {
        let now = self.clock.now();
        self.with("mkdir", root, &[path], |t| t.mkdir(path, mode, 0, 0, now))
    }
    fn stat(&self, root: &str, path: &str) -> Result<Option<FileStat>, Error> {
        self.with("stat", root, &[path], |t| Ok(t.stat(path)))
    }
    fn read_dir(&self, root: &str, path: &str) -> Result<Vec<String>, Error> {
        self.with("read_dir", root, &[path], |t| t.read_dir(path))
    }
    fn read_file(&self, root: &str, path: &str) -> Result<Vec<u8>, Error> {
        self.with("read_file", root, &[path], |t| t.read_file(path))
    }
    fn write_file(&self, root: &str, path: &str, data: &[u8]) -> Result<(), Error> {
        let now = self.clock.now();
        self.with("write_file", root, &[path], |t| t.write_file(path, data, now))
    }
    fn copy_tree(&self, root: &str, from: &str, to: &str) -> Result<(), Error> {
        let now = self.clock.now();
        self.with("copy_tree", root, &[from, to], |t| t.copy_tree(from, to, now))
    }
    fn rename(&self, root: &str, from: &str, to: &str) -> Result<(), Error> {
        self.with("rename", root, &[from, to], |t| t.rename(from, to))
    }
    fn remove_all(&self, root: &str, path: &str) -> Result<(), Error> {
        self.with("remove_all", root, &[path], |t| {
            if path.is_empty() {
                return Err(Error::InvalidArgument(format!("refusing to remove dir root {root:?} itself")));
            }
            t.remove_all(path);
            Ok(())
        })
    }
    fn usage(&self, root: &str, path: &str) -> Result<u64, Error> {
        self.with("usage", root, &[path], |t| t.usage(path))
    }
    fn fs_stats(&self, root: &str) -> Result<Space, Error> {
        let total = self.total_bytes.get();
        self.with("fs_stats", root, &[], |t| {
            Ok(Space { total_bytes: total, available_bytes: total.saturating_sub(t.usage("")?) })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_checked_like_the_hosts_resolve() {
        let d = FakeDir::default();
        d.add_root("r");
        assert!(matches!(d.mkdir("other", "x", 0o700), Err(Error::PermissionDenied(_))), "ungranted root");
        assert!(matches!(d.mkdir("r", "/abs", 0o700), Err(Error::InvalidArgument(_))));
        assert!(matches!(d.mkdir("r", "a/../b", 0o700), Err(Error::PermissionDenied(_))));
        assert!(matches!(d.mkdir("r", "a//b", 0o700), Err(Error::PermissionDenied(_))));
        assert!(matches!(d.remove_all("r", ""), Err(Error::InvalidArgument(_))));
        d.mkdir("r", "a/b", 0o750).expect("mkdir with parents");
        d.write_file("r", "a/b/f", b"12345").expect("write");
        assert_eq!(d.stat("r", "a/b").expect("stat").map(|s| s.mode), Some(0o750));
        d.set_total_bytes(100);
        assert_eq!(d.fs_stats("r"), Ok(Space { total_bytes: 100, available_bytes: 95 }));
        assert_eq!(d.paths("r"), ["a", "a/b", "a/b/f"]);
        assert_eq!(d.journal.calls("mkdir"), 5, "failed calls count too");
    }
}
