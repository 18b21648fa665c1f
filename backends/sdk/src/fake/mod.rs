//! [`FakeHost`]: every capability in memory, for unit tests of a backend's policy that run
//! natively in milliseconds (cargo feature `fake`). Each capability is a public field with
//! its own state: grant what a test needs (`dir.add_root`, `nfs.add_export`, `rbd.add_pool`,
//! `block.add_node`, `backup.add_target`), call the backend, then look at the state
//! (`dir.paths`, `rbd.image`, …) and at what was logged (`log.messages`).
//!
//! The fakes follow the WIT's documented semantics and the host's behaviour where the WIT is
//! silent (noted per fake), including its errors: an ungranted root, export, pool or node is
//! permission-denied, and what the host does not provide yet answers as the host does
//! (`unimplemented`, "… not provided by this host"). [`Journal`] counts calls per operation and
//! injects failures
//! (`rbd.fail_next("create", Error::Unavailable(..))`), so a test can check what a retry does
//! and that errors surface with their case. They are single-threaded (`RefCell`), like a
//! component instance.
//!
//! Not faked: secrets (handles are accepted and ignored), data (volumes have no content), the
//! host's timeouts and rate limits.
mod backup;
mod block;
mod dir;
mod kv;
mod log;
mod nfs;
mod rbd;
mod tree;

pub use backup::FakeBackup;
pub use block::{FakeBlock, FakeReplicaSet};
pub use dir::FakeDir;
pub use kv::FakeKv;
pub use log::{FakeLog, LogLine};
pub use nfs::FakeNfs;
pub use rbd::{FakeImage, FakeRbd};
pub use tree::Tree;

use crate::host::Host;
use crate::types::{Error, Timestamp};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

/// An in-memory [`Host`]. Starts with nothing granted.
#[derive(Debug, Default)]
pub struct FakeHost {
    pub kv: FakeKv,
    pub log: FakeLog,
    pub dir: FakeDir,
    pub nfs: FakeNfs,
    pub rbd: FakeRbd,
    pub block: FakeBlock,
    pub backup: FakeBackup,
}

impl FakeHost {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Host for FakeHost {
    type Kv = FakeKv;
    type Log = FakeLog;
    type Dir = FakeDir;
    type Nfs = FakeNfs;
    type Rbd = FakeRbd;
    type Block = FakeBlock;
    type Backup = FakeBackup;
    fn kv(&self) -> &FakeKv {
        &self.kv
    }
    fn log(&self) -> &FakeLog {
        &self.log
    }
    fn dir(&self) -> &FakeDir {
        &self.dir
    }
    fn nfs(&self) -> &FakeNfs {
        &self.nfs
    }
    fn rbd(&self) -> &FakeRbd {
        &self.rbd
    }
    fn block(&self) -> &FakeBlock {
        &self.block
    }
    fn backup(&self) -> &FakeBackup {
        &self.backup
    }
}

/// Calls per operation, and failures queued for the next calls of an operation.
#[derive(Debug, Default)]
pub struct Journal {
    calls: RefCell<BTreeMap<String, usize>>,
    faults: RefCell<Vec<(String, Error)>>,
}

impl Journal {
    /// Make the next call of `op` (the method's name, e.g. `"create"`) fail with `error`
    /// before it does anything. Queued faults of one op fire in order.
    pub fn fail_next(&self, op: &str, error: Error) {
        self.faults.borrow_mut().push((op.to_owned(), error));
    }

    /// How many times `op` was called (failed calls included).
    pub fn calls(&self, op: &str) -> usize {
        self.calls.borrow().get(op).copied().unwrap_or(0)
    }

    /// Record a call of `op`; its queued fault, if any.
    pub(crate) fn enter(&self, op: &str) -> Result<(), Error> {
        *self.calls.borrow_mut().entry(op.to_owned()).or_default() += 1;
        let mut faults = self.faults.borrow_mut();
        match faults.iter().position(|(o, _)| o == op) {
            Some(i) => Err(faults.remove(i).1),
            None => Ok(()),
        }
    }
}

/// A clock that moves one second per reading, so every change has its own time.
#[derive(Debug)]
pub(crate) struct Clock(Cell<i64>);

impl Default for Clock {
    fn default() -> Self {
        // 2023-11-14, a plausible "now".
        Self(Cell::new(1_700_000_000))
    }
}

impl Clock {
    pub(crate) fn now(&self) -> Timestamp {
        let s = self.0.get() + 1;
        self.0.set(s);
        Timestamp { seconds: s, nanos: 0 }
    }
}
