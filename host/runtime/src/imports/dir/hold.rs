//! A test hook (feature `test-hooks`, which only dev-dependencies turn on): hold the background
//! `copy-tree` copies beneath one root once their tree is copied, before they report done. A
//! test that needs "a copy longer than a call" holds it for as long as it needs, on any
//! machine, instead of betting that a big tree takes longer to copy than the call waits. A held
//! copy is a running copy: calls answer `aborted` ("in progress"), a copy from another source
//! is refused, and a cancel ends the wait.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Roots whose copies are held (a test holds its own temporary root, so tests running side by
/// side in one process do not hold each other's copies).
static HELD: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn held() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Copies beneath `root` (the granted directory, as configured) that finish their tree while
/// this lives wait before reporting done; dropping it lets them go on.
#[must_use = "the copies are let go when the hold is dropped"]
pub struct CopyHold(PathBuf);

/// Hold the background copies beneath `root` (see [`CopyHold`]).
pub fn hold_copies(root: &Path) -> CopyHold {
    held().push(root.to_path_buf());
    CopyHold(root.to_path_buf())
}

impl Drop for CopyHold {
    fn drop(&mut self) {
        let mut held = held();
        if let Some(i) = held.iter().position(|r| *r == self.0) {
            held.swap_remove(i);
        }
    }
}

/// Wait, on the copy's own thread, while a [`CopyHold`] holds `root` and the copy is not
/// cancelled. Polling keeps it simple; it runs in tests only.
pub(super) fn wait_while_held(root: &Path, cancel: &AtomicBool) {
    while !cancel.load(Ordering::Relaxed) && held().iter().any(|r| r == root) {
        std::thread::sleep(Duration::from_millis(10));
    }
}
