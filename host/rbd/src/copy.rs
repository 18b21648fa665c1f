//! Restores by copy: a snapshot (an image's part of a group snapshot, which Ceph 16.2 cannot
//! clone, or any other) copied into a new image in the background, for as long as it takes.
//!
//! A backend call has a wall-clock deadline far shorter than copying a large image, so the
//! copy runs on its own thread and the call answers how far it got; the guest answers
//! UNAVAILABLE and the CO's retry asks again ([`crate::RbdPool::snapshot_copy`]). Where the
//! truth lives: the new image carries the metadata key [`INCOMPLETE`] from its creation until
//! the last byte and the caller's metadata are in, so
//! - a copy this process runs is found in [`Copies`] (the retry sees its progress);
//! - an image with the key and no copy running here is what a dead process left: it is removed
//!   and the copy starts again (nothing half-copied is ever answered as done);
//! - an image without the key is a finished copy: done (the call is idempotent).
//!
//! Bounds: at most [`MAX_RUNNING`] copies per client at once (more: Unavailable, retried by
//! the CO); each librados operation is under the client's op timeout.
#![allow(unsafe_code, reason = "calls librbd (FFI) with a progress callback")]

use crate::RbdError;
use crate::conn::Connection;
use crate::error::Target;
use crate::ffi;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The metadata key of an image whose copy has not finished.
pub const INCOMPLETE: &str = "wasmcsi.io/copy-incomplete";

/// Copies one client runs at once.
pub const MAX_RUNNING: usize = 4;

/// How a copy stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyProgress {
    /// Complete: the image holds the snapshot's data and the caller's metadata.
    Done,
    /// Still copying: bytes copied of bytes in all.
    Copying { copied: u64, total: u64 },
}

/// One running copy.
#[derive(Default)]
pub(crate) struct Job {
    copied: AtomicU64,
    total: AtomicU64,
    result: Mutex<Option<Result<(), RbdError>>>,
}

impl Job {
    fn progress(&self) -> CopyProgress {
        CopyProgress::Copying { copied: self.copied.load(Ordering::Relaxed), total: self.total.load(Ordering::Relaxed) }
    }

    fn finished(&self) -> Option<Result<(), RbdError>> {
        self.result.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

/// The copies a client runs, by destination (`cluster/pool/image`).
#[derive(Default)]
pub(crate) struct Copies {
    jobs: Mutex<HashMap<String, Arc<Job>>>,
}

impl Copies {
    /// The copy into `key` this process runs: its progress, or its end (then forgotten).
    pub fn status(&self, key: &str) -> Option<Result<CopyProgress, RbdError>> {
        let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        let job = jobs.get(key)?.clone();
        match job.finished() {
            None => Some(Ok(job.progress())),
            Some(r) => {
                jobs.remove(key);
                Some(r.map(|()| CopyProgress::Done))
            }
        }
    }

    /// Register a copy into `key`; Unavailable when [`MAX_RUNNING`] run already.
    pub fn start(&self, t: &Target, key: &str, total: u64) -> Result<Arc<Job>, RbdError> {
        let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        if jobs.len() >= MAX_RUNNING {
            return Err(t.unavailable(format!("{MAX_RUNNING} restores by copy are running; retry later")));
        }
        let job = Arc::new(Job::default());
        job.total.store(total, Ordering::Relaxed);
        jobs.insert(key.to_owned(), job.clone());
        Ok(job)
    }
}

/// What to copy: `src_pool/src@snap_id` into the existing, empty `dest_pool/dest`.
pub(crate) struct Plan {
    pub src_pool: String,
    pub src: String,
    pub snap_id: u64,
    pub dest_pool: String,
    pub dest: String,
    /// the caller's metadata, set again once the copy (which copies the source's) is done
    pub metadata: Vec<(String, String)>,
}

unsafe extern "C" fn progress(offset: u64, total: u64, data: *mut c_void) -> c_int {
    // SAFETY: `data` is the `Job` that `run` keeps alive across the copy call.
    let job = unsafe { &*(data as *const Job) };
    job.copied.store(offset, Ordering::Relaxed);
    job.total.store(total, Ordering::Relaxed);
    0
}

/// The copy itself (on its own thread): data, then the caller's metadata, then the marker off.
fn copy(t: &Target, conn: &Arc<Connection>, plan: &Plan, job: &Job) -> Result<(), RbdError> {
    let src_io = conn.ioctx(t, &plan.src_pool)?;
    let dest_io = conn.ioctx(t, &plan.dest_pool)?;
    let src = src_io.open_read_only(t, &plan.src, None)?;
    src.snap_set_by_id(t, plan.snap_id)?;
    let dest = dest_io.open(t, &plan.dest)?;
    // SAFETY: both images open; the callback's data is `job`, alive for the whole call.
    let ret = unsafe {
        ffi::rbd_copy_with_progress2(src.handle(), dest.handle(), Some(progress), job as *const Job as *mut c_void)
    };
    if ret < 0 {
        return Err(
            t.errno(ret, &format!("copying {}/{} into {}/{}", plan.src_pool, plan.src, plan.dest_pool, plan.dest))
        );
    }
    for (k, v) in &plan.metadata {
        dest.metadata_set(t, k, v)?;
    }
    dest.metadata_remove(t, INCOMPLETE)?;
    let total = job.total.load(Ordering::Relaxed);
    job.copied.store(total, Ordering::Relaxed);
    Ok(())
}

/// Run `plan` on a thread of its own; the job holds the outcome. A failed copy removes its
/// image (a retry starts afresh).
pub(crate) fn spawn(t: Target, conn: Arc<Connection>, plan: Plan, job: Arc<Job>) -> Result<(), RbdError> {
    let what = format!("{}/{}", plan.dest_pool, plan.dest);
    let (j, w) = (job.clone(), what.clone());
    std::thread::Builder::new()
        .name("rbd-copy".into())
        .spawn(move || {
            let started = std::time::Instant::now();
            let r = copy(&t, &conn, &plan, &j);
            match &r {
                Ok(()) => tracing::info!(image = %w, bytes = j.total.load(Ordering::Relaxed), secs = started.elapsed().as_secs_f64(), "restore by copy done"),
                Err(e) => {
                    tracing::warn!(image = %w, error = %e, "restore by copy failed; its image is removed");
                    let removed = conn.ioctx(&t, &plan.dest_pool).and_then(|io| io.remove(&t, &plan.dest));
                    if let Err(e) = removed {
                        tracing::warn!(image = %w, error = %e, "removing a failed copy");
                    }
                }
            }
            *j.result.lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
        })
        .map(drop)
        .map_err(|e| {
            *job.result.lock().unwrap_or_else(PoisonError::into_inner) = Some(Err(RbdError::Internal(e.to_string())));
            RbdError::Internal(format!("spawning the copy into {what}: {e}"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target { cluster: "c".into(), monitors: String::new() }
    }

    #[test]
    fn a_client_runs_a_bounded_number_of_copies_and_forgets_finished_ones() {
        let copies = Copies::default();
        let t = target();
        let jobs: Vec<_> = (0..MAX_RUNNING).map(|i| copies.start(&t, &format!("k{i}"), 10).expect("room")).collect();
        assert!(matches!(copies.start(&t, "more", 10), Err(RbdError::Unavailable { .. })));
        assert!(matches!(copies.status("k0"), Some(Ok(CopyProgress::Copying { copied: 0, total: 10 }))));
        *jobs[0].result.lock().expect("lock") = Some(Ok(()));
        assert!(matches!(copies.status("k0"), Some(Ok(CopyProgress::Done))));
        assert!(copies.status("k0").is_none(), "forgotten once answered");
        *jobs[1].result.lock().expect("lock") = Some(Err(RbdError::Internal("x".into())));
        assert!(matches!(copies.status("k1"), Some(Err(RbdError::Internal(_)))));
        copies.start(&t, "more", 10).expect("room again");
    }
}
