//! A test hook (feature `test-hooks`, which only dev-dependencies turn on): hold the copies to
//! one export at the point where their tree is copied under its temporary name and is about to
//! be renamed into place. A test that needs "a copy longer than a call" holds it for as long
//! as it needs, on any machine, instead of betting that a big tree takes longer to copy than
//! the call waits. A held copy is a running copy: its progress is reported, a retry finds it,
//! and cancelling it stops it.
use crate::NfsExport;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Exports whose copies are held (a test holds its own server's export, so tests running side
/// by side in one process do not hold each other's copies).
static HELD: Mutex<Vec<NfsExport>> = Mutex::new(Vec::new());

fn held() -> std::sync::MutexGuard<'static, Vec<NfsExport>> {
    HELD.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Copies to `export` started or running while this lives wait before placing their copy;
/// dropping it lets them go on.
#[must_use = "the copies are let go when the hold is dropped"]
pub struct CopyHold(NfsExport);

/// Hold the copies to `export` (see [`CopyHold`]).
pub fn hold_copies(export: &NfsExport) -> CopyHold {
    let export = export.clone().normalized();
    held().push(export.clone());
    CopyHold(export)
}

impl Drop for CopyHold {
    fn drop(&mut self) {
        let mut held = held();
        if let Some(i) = held.iter().position(|e| *e == self.0) {
            held.swap_remove(i);
        }
    }
}

/// Wait while a [`CopyHold`] holds `export`. Polling keeps it simple; it runs in tests only.
pub(crate) async fn wait_while_held(export: &NfsExport) {
    while held().contains(export) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
