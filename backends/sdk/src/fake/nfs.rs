//! The fake `nfs`: granted exports, each an in-memory [`Tree`]. Paths are checked as the
//! host's client does (anything but a plain relative path is invalid-argument); an export that
//! was not added is permission-denied. Background copies follow the WIT: the first call starts
//! one, later calls with the same target report on it, a target that exists with no copy
//! running is done. A copy finishes after [`FakeNfs::set_copy_polls`] calls that reported it
//! running (0 by default: done within the first call, as a small tree is on the host).
use super::{Clock, Journal, Tree};
use crate::nfs::{CopyProgress, FileStat, Nfs, NfsExport, Space};
use crate::types::Error;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

const TOTAL_BYTES: u64 = 100 << 30;

type ExportKey = (String, String);

#[derive(Debug)]
struct Copy {
    from: String,
    /// calls left that report the copy running
    polls_left: u32,
}

#[derive(Debug)]
pub struct FakeNfs {
    exports: RefCell<BTreeMap<ExportKey, Tree>>,
    copies: RefCell<BTreeMap<(ExportKey, String), Copy>>,
    copy_polls: Cell<u32>,
    total_bytes: Cell<u64>,
    clock: Clock,
    pub journal: Journal,
}

impl Default for FakeNfs {
    fn default() -> Self {
        Self {
            exports: RefCell::default(),
            copies: RefCell::default(),
            copy_polls: Cell::new(0),
            total_bytes: Cell::new(TOTAL_BYTES),
            clock: Clock::default(),
            journal: Journal::default(),
        }
    }
}

fn key(e: &NfsExport) -> ExportKey {
    (e.server.clone(), e.share.clone())
}

fn check_path(path: &str) -> Result<(), Error> {
    let bad = path.starts_with('/')
        || path.contains('\0')
        || path.len() > 4096
        || (!path.is_empty() && path.split('/').any(|p| p.is_empty() || p == "." || p == ".." || p.len() > 255));
    if bad { Err(Error::InvalidArgument(format!("path {path:?} is not a plain relative path"))) } else { Ok(()) }
}

impl FakeNfs {
    /// Grant an export (empty); returns it as the capability names it.
    pub fn add_export(&self, server: &str, share: &str) -> NfsExport {
        self.exports.borrow_mut().entry((server.to_owned(), share.to_owned())).or_default();
        NfsExport { server: server.to_owned(), share: share.to_owned() }
    }
    /// Calls that report a background copy running before it finishes.
    pub fn set_copy_polls(&self, polls: u32) {
        self.copy_polls.set(polls);
    }
    /// The size `fs-stats` reports; available = size − file data stored.
    pub fn set_total_bytes(&self, bytes: u64) {
        self.total_bytes.set(bytes);
    }
    /// Every path on an export, in order (empty for an unknown export).
    pub fn paths(&self, e: &NfsExport) -> Vec<String> {
        self.exports.borrow().get(&key(e)).map(Tree::paths).unwrap_or_default()
    }
    pub fn exists(&self, e: &NfsExport, path: &str) -> bool {
        self.exports.borrow().get(&key(e)).is_some_and(|t| t.exists(path))
    }
    /// Targets of the background copies running on an export.
    pub fn running_copies(&self, e: &NfsExport) -> Vec<String> {
        self.copies.borrow().keys().filter(|(k, _)| *k == key(e)).map(|(_, to)| to.clone()).collect()
    }
    pub fn fail_next(&self, op: &str, error: Error) {
        self.journal.fail_next(op, error)
    }

    fn with<T>(
        &self,
        op: &str,
        e: &NfsExport,
        paths: &[&str],
        f: impl FnOnce(&mut Tree) -> Result<T, Error>,
    ) -> Result<T, Error> {
        self.journal.enter(op)?;
        let mut exports = self.exports.borrow_mut();
        let tree = exports
            .get_mut(&key(e))
            .ok_or_else(|| Error::PermissionDenied(format!("nfs export {}:{} is not granted", e.server, e.share)))?;
        paths.iter().try_for_each(|p| check_path(p))?;
        f(tree)
    }
}

impl Nfs for FakeNfs {
    fn mkdir(&self, e: &NfsExport, path: &str, mode: u32, uid: u32, gid: u32) -> Result<(), Error> {
        let now = self.clock.now();
        self.with("mkdir", e, &[path], |t| t.mkdir(path, mode, uid, gid, now))
    }
    fn stat(&self, e: &NfsExport, path: &str) -> Result<Option<FileStat>, Error> {
        self.with("stat", e, &[path], |t| Ok(t.stat(path)))
    }
    fn read_dir(&self, e: &NfsExport, path: &str) -> Result<Vec<String>, Error> {
        self.with("read_dir", e, &[path], |t| t.read_dir(path))
    }
    fn read_file(&self, e: &NfsExport, path: &str) -> Result<Vec<u8>, Error> {
        self.with("read_file", e, &[path], |t| t.read_file(path))
    }
    fn write_file(&self, e: &NfsExport, path: &str, data: &[u8]) -> Result<(), Error> {
        let now = self.clock.now();
        self.with("write_file", e, &[path], |t| t.write_file(path, data, now))
    }
    fn copy_tree(&self, e: &NfsExport, from: &str, to: &str) -> Result<(), Error> {
        let now = self.clock.now();
        self.with("copy_tree", e, &[from, to], |t| t.copy_tree(from, to, now))
    }
    fn copy_tree_background(&self, e: &NfsExport, from: &str, to: &str) -> Result<CopyProgress, Error> {
        let now = self.clock.now();
        let polls = self.copy_polls.get();
        let mut copies = self.copies.borrow_mut();
        let job = (key(e), to.to_owned());
        self.with("copy_tree_background", e, &[from, to], |t| {
            let polls_left = match copies.get_mut(&job) {
                Some(c) if c.from != from => {
                    return Err(Error::InvalidArgument(format!(
                        "a copy from {:?} to {to:?} is running; not starting one from {from:?}",
                        c.from
                    )));
                }
                Some(c) => {
                    c.polls_left = c.polls_left.saturating_sub(1);
                    c.polls_left
                }
                // Renamed into place whole by an earlier call (or before a host restart).
                None if t.exists(to) => return Ok(CopyProgress { done: true, bytes: 0 }),
                None => {
                    // The checks of copy-tree, before anything runs.
                    if !t.exists(from) {
                        return Err(Error::NotFound(format!("copy-tree {from:?} -> {to:?}: source missing")));
                    }
                    copies.insert(job.clone(), Copy { from: from.to_owned(), polls_left: polls });
                    polls
                }
            };
            if polls_left > 0 {
                return Ok(CopyProgress { done: false, bytes: 0 });
            }
            copies.remove(&job);
            // A failed copy reports its error once and is forgotten (the next call starts over).
            t.copy_tree(from, to, now)?;
            Ok(CopyProgress { done: true, bytes: t.usage(to)? })
        })
    }
    fn cancel_copy(&self, e: &NfsExport, to: &str) {
        // Never fails; a fault queued for it is consumed and ignored.
        let _ = self.journal.enter("cancel_copy");
        self.copies.borrow_mut().remove(&(key(e), to.to_owned()));
    }
    fn rename(&self, e: &NfsExport, from: &str, to: &str) -> Result<(), Error> {
        self.with("rename", e, &[from, to], |t| t.rename(from, to))
    }
    fn remove_all(&self, e: &NfsExport, path: &str) -> Result<(), Error> {
        self.with("remove_all", e, &[path], |t| {
            if path.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "refusing to remove the export root {}:{} itself",
                    e.server, e.share
                )));
            }
            t.remove_all(path);
            Ok(())
        })
    }
    fn usage(&self, e: &NfsExport, path: &str) -> Result<u64, Error> {
        self.with("usage", e, &[path], |t| t.usage(path))
    }
    fn fs_stats(&self, e: &NfsExport) -> Result<Space, Error> {
        let total = self.total_bytes.get();
        self.with("fs_stats", e, &[], |t| {
            Ok(Space { total_bytes: total, available_bytes: total.saturating_sub(t.usage("")?) })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn background_copies_run_for_the_set_number_of_polls() {
        let n = FakeNfs::default();
        let e = n.add_export("h", "/x");
        n.mkdir(&e, "src", 0o755, 0, 0).expect("mkdir");
        n.write_file(&e, "src/f", b"abc").expect("write");
        n.set_copy_polls(2);
        let poll = || n.copy_tree_background(&e, "src", "dst");
        assert_eq!(poll().map(|p| p.done), Ok(false));
        assert_eq!(n.running_copies(&e), ["dst"]);
        assert!(matches!(n.copy_tree_background(&e, "elsewhere", "dst"), Err(Error::InvalidArgument(_))));
        assert_eq!(poll().map(|p| p.done), Ok(false));
        assert_eq!(poll(), Ok(CopyProgress { done: true, bytes: 3 }));
        assert!(n.exists(&e, "dst/f") && n.running_copies(&e).is_empty());
        assert_eq!(poll(), Ok(CopyProgress { done: true, bytes: 0 }), "an existing target is done");
        n.cancel_copy(&e, "never-started");
        let other = NfsExport { server: "h".into(), share: "/y".into() };
        assert!(matches!(n.stat(&other, ""), Err(Error::PermissionDenied(_))));
        assert!(matches!(n.stat(&e, "../x"), Err(Error::InvalidArgument(_))));
    }
}
