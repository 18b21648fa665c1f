//! `copy-tree` copies that outlive the call that asked for them. A snapshot or clone of a big
//! tree takes longer than any sensible call deadline, and a copy started over on every retry
//! never finishes. So the first `copy-tree(root, from, to)` starts the copy on a thread of its
//! own and waits a little; if it is not done, the call answers `aborted` ("in progress, retry")
//! and the copy goes on. A retry of the same copy waits on it again, and the one that finds it
//! done places it at `to` and succeeds. No WIT change: guests already retry `aborted`.
//!
//! The copy is made under a temporary name beside `to` and placed only when a caller collects
//! it, so a guest that removes `to` before copying again (hostpath does, to clear a half copy of
//! an older host) never removes a finished copy nobody has collected yet. Jobs are kept per
//! (backend, root, to) in the runtime, so a hot reload of the backend finds its copies. An
//! outcome nobody collects within [`KEEP_FINISHED`] is dropped with its copy. After a restart
//! the jobs are gone; their temporary trees, unlocked now, are swept when a copy into the same
//! directory starts again.
use super::ops::{self, Copied};
use super::path::GuestPath;
use super::root::Root;
use super::tree::{Progress, Stop};
use crate::bindings::types::Error;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long a finished copy waits for the retry that collects it.
pub const KEEP_FINISHED: Duration = Duration::from_secs(3600);

/// Copies one backend may have running at once; more are `resource-exhausted` until one ends.
pub const MAX_RUNNING_PER_BACKEND: usize = 4;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct JobKey {
    backend: String,
    root: PathBuf,
    to: String,
}

type Outcome = Option<Result<Copied, Error>>;

struct Job {
    from: String,
    progress: Arc<Progress>,
    /// `true` once `outcome` is set.
    done: watch::Receiver<bool>,
    outcome: Arc<Mutex<Outcome>>,
    cancel: Arc<AtomicBool>,
    finished_at: Arc<OnceLock<Instant>>,
}

impl Job {
    fn finished(&self) -> bool {
        *self.done.borrow()
    }
}

/// The background copies of every backend of one runtime.
#[derive(Default)]
pub struct CopyJobs {
    jobs: Mutex<HashMap<JobKey, Job>>,
}

impl Drop for CopyJobs {
    fn drop(&mut self) {
        for job in self.lock().values() {
            job.cancel.store(true, Ordering::Relaxed);
        }
    }
}

impl CopyJobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<JobKey, Job>> {
        self.jobs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `copy-tree` for `backend`: start the copy from `from` to `to` beneath `root`, or join
    /// the one running; wait up to `wait` for it; place it when done. Errors: those of the copy
    /// (once), `aborted` while it runs, `invalid-argument` when a copy to `to` from another
    /// source runs, `resource-exhausted` when the backend runs too many copies.
    pub async fn copy_tree(
        &self,
        backend: &str,
        root: PathBuf,
        from: &str,
        to: &str,
        wait: Duration,
    ) -> Result<(), Error> {
        GuestPath::parse(from)?;
        GuestPath::parse(to)?;
        let key = JobKey { backend: backend.into(), root, to: to.into() };
        let (mut done, outcome, progress) = {
            let mut jobs = self.lock();
            expire(&mut jobs);
            match jobs.get(&key) {
                Some(job) if job.from != from => {
                    return Err(Error::InvalidArgument(format!(
                        "copy-tree to {to:?}: a copy from {:?} is in progress; not starting one from {from:?}",
                        job.from
                    )));
                }
                Some(job) => (job.done.clone(), job.outcome.clone(), job.progress.clone()),
                None => {
                    let running = jobs.iter().filter(|(k, j)| k.backend == backend && !j.finished()).count();
                    if running >= MAX_RUNNING_PER_BACKEND {
                        return Err(Error::ResourceExhausted(format!(
                            "copy-tree to {to:?}: backend {backend} already runs {running} copies; retry when one is done"
                        )));
                    }
                    let job = spawn(&key, from)?;
                    let handles = (job.done.clone(), job.outcome.clone(), job.progress.clone());
                    jobs.insert(key.clone(), job);
                    handles
                }
            }
        };
        if tokio::time::timeout(wait, done.wait_for(|d| *d)).await.is_err() {
            return Err(Error::Aborted(format!(
                "copy-tree {from} -> {to}: in progress in the background ({} entries, {} bytes so far); retry to collect it",
                progress.entries.load(Ordering::Relaxed),
                progress.bytes.load(Ordering::Relaxed)
            )));
        }
        // Forget the job only if it is still the one waited on (a concurrent caller may have
        // collected it and started another).
        {
            let mut jobs = self.lock();
            if jobs.get(&key).is_some_and(|j| Arc::ptr_eq(&j.outcome, &outcome)) {
                jobs.remove(&key);
            }
        }
        let taken = outcome.lock().unwrap_or_else(PoisonError::into_inner).take();
        match taken {
            Some(Ok(copied)) => tokio::task::spawn_blocking(move || copied.place())
                .await
                .map_err(|e| Error::Internal(format!("copy-tree to {to:?}: placing the copy failed: {e}")))?,
            Some(Err(e)) => Err(e),
            None => Err(Error::Aborted(format!("copy-tree to {to:?}: collected by a concurrent call; retry"))),
        }
    }
}

/// Drop outcomes nobody collected in time; their copies are removed on a thread of their own.
fn expire(jobs: &mut HashMap<JobKey, Job>) {
    let stale: Vec<JobKey> = jobs
        .iter()
        .filter(|(_, j)| j.finished_at.get().is_some_and(|at| at.elapsed() > KEEP_FINISHED))
        .map(|(k, _)| k.clone())
        .collect();
    for key in stale {
        let Some(job) = jobs.remove(&key) else { continue };
        let copied = job.outcome.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(Ok(copied)) = copied {
            tracing::info!(backend = %key.backend, to = %key.to, "dropping a finished copy nobody collected");
            let _ = std::thread::Builder::new().name("dir-copy-drop".into()).spawn(move || copied.discard());
        }
    }
}

/// Start the copy of `key` on a thread of its own.
fn spawn(key: &JobKey, from: &str) -> Result<Job, Error> {
    let (tx, rx) = watch::channel(false);
    let outcome = Arc::new(Mutex::new(None));
    let progress = Arc::new(Progress::default());
    let cancel = Arc::new(AtomicBool::new(false));
    let finished_at = Arc::new(OnceLock::new());
    let (k, f, o, p, c) = (key.clone(), from.to_string(), outcome.clone(), progress.clone(), cancel.clone());
    let at = finished_at.clone();
    let span = tracing::info_span!("dir.copy_tree_background", backend = %key.backend, from, to = %key.to);
    std::thread::Builder::new()
        .name("dir-copy".into())
        .spawn(move || {
            let _entered = span.enter();
            let result = copy(&k, &f, &Stop::cancelled_by(c.clone()), &p);
            #[cfg(feature = "test-hooks")]
            super::hold::wait_while_held(&k.root, &c);
            if let Err(e) = &result {
                tracing::warn!(error = ?e, "background copy failed");
            }
            *o.lock().unwrap_or_else(PoisonError::into_inner) = Some(result);
            let _ = at.set(Instant::now());
            let _ = tx.send(true);
        })
        .map_err(|e| Error::Internal(format!("copy-tree to {:?}: cannot start a copy thread: {e}", key.to)))?;
    Ok(Job { from: from.to_string(), progress, done: rx, outcome, cancel, finished_at })
}

fn copy(key: &JobKey, from: &str, stop: &Stop, progress: &Progress) -> Result<Copied, Error> {
    let root = Root::open(&key.root).map_err(|e| ops::errno(&format!("dir root {}", key.root.display()), e))?;
    ops::copy_to_temp(&root, GuestPath::parse(from)?, GuestPath::parse(&key.to)?, stop, progress)
}
