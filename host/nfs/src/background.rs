//! Copies that outlive the call that asked for them. A snapshot or clone of a big tree takes
//! longer than any sensible CSI call deadline (csi-driver-nfs's tarball snapshots time out and
//! start over on every retry); here the first call starts the copy in a task of the host, and
//! every retry of the same CSI call asks how far it got, until it reports done. CSI has the
//! states for it: `ready_to_use = false` for snapshots, a retried CreateVolume for clones.
//!
//! Jobs live in the host process. After a restart a copy that was running is gone; since
//! `copy-tree` renames its temporary copy into place only when whole, the target then is either
//! absent (start again) or complete (done). Temporary copies a dead process left in the target's
//! parent are removed when a copy there starts again; that parent must belong to this copy
//! alone (the nfs backend uses `.snapshots/NAME/` and `.wasmcsi/staging/NAME/`).
use crate::{NfsClient, NfsError, NfsExport};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

tokio::task_local! {
    /// Bytes of file content copied so far by the copy running in this task.
    pub(crate) static COPIED: Arc<AtomicU64>;
}

/// Add `n` to the progress of the copy running in this task, if it is a background copy.
pub(crate) fn copied(n: u64) {
    let _ = COPIED.try_with(|c| c.fetch_add(n, Ordering::Relaxed));
}

/// Where a background copy stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyProgress {
    pub done: bool,
    /// File content copied so far (holes and zero blocks are skipped, so it can end below the
    /// tree's size).
    pub bytes: u64,
}

/// How long a finished job's outcome is kept for the retry that collects it.
const KEEP_FINISHED: Duration = Duration::from_secs(3600);

enum State {
    Running,
    Finished(Result<(), NfsError>, Instant),
}

struct Job {
    from: String,
    bytes: Arc<AtomicU64>,
    state: Arc<Mutex<State>>,
    task: tokio::task::AbortHandle,
}

/// The background copies of one client, by (export, target).
#[derive(Default)]
pub(crate) struct Jobs(Mutex<HashMap<(NfsExport, String), Job>>);

impl Jobs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(NfsExport, String), Job>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn outcome(state: &Mutex<State>) -> Option<Result<(), NfsError>> {
    match &*state.lock().unwrap_or_else(PoisonError::into_inner) {
        State::Running => None,
        State::Finished(r, _) => Some(r.clone()),
    }
}

impl NfsClient {
    /// Start copying `from` to `to` in the background (the semantics of [`NfsClient::copy_tree`]),
    /// or report on the copy already started for `to`; waits up to `wait` for it to finish, so
    /// small trees are done in one call. A failed copy reports its error once and is forgotten,
    /// so the next call starts it again. Errors: `InvalidArgument` when a copy to `to` from
    /// another source is running, and those of `copy-tree`.
    #[tracing::instrument(name = "nfs.copy_tree_background", skip_all, fields(export = %export, from = %from, to = %to))]
    pub async fn copy_tree_background(
        &self,
        export: &NfsExport,
        from: &str,
        to: &str,
        wait: Duration,
    ) -> Result<CopyProgress, NfsError> {
        self.pool(export)?;
        let key = (export.clone(), to.to_string());
        let running = |jobs: &HashMap<(NfsExport, String), Job>| match jobs.get(&key) {
            Some(j) if j.from != from => Err(NfsError::InvalidArgument(format!(
                "a copy from {:?} to {to:?} on {export} is running; not starting one from {from:?}",
                j.from
            ))),
            Some(j) => Ok(Some((Arc::clone(&j.bytes), Arc::clone(&j.state)))),
            None => Ok(None),
        };
        let known = {
            let mut jobs = self.jobs.lock();
            jobs.retain(|_, j| {
                !matches!(&*j.state.lock().unwrap_or_else(PoisonError::into_inner),
                    State::Finished(_, at) if at.elapsed() > KEEP_FINISHED)
            });
            running(&jobs)?
        };
        let (bytes, state) = match known {
            Some(job) => job,
            // Renamed into place whole by an earlier process (or by a job whose outcome was
            // collected and expired).
            None if self.stat(export, to).await?.is_some() => return Ok(CopyProgress { done: true, bytes: 0 }),
            None => {
                let mut jobs = self.jobs.lock();
                // A concurrent call may have started it while this one looked at the target.
                match running(&jobs)? {
                    Some(job) => job,
                    None => {
                        let job = self.spawn_copy(export, from, to);
                        let handles = (Arc::clone(&job.bytes), Arc::clone(&job.state));
                        jobs.insert(key.clone(), job);
                        handles
                    }
                }
            }
        };
        let started = Instant::now();
        loop {
            if let Some(r) = outcome(&state) {
                if r.is_err() {
                    self.jobs.lock().remove(&key);
                }
                return r.map(|()| CopyProgress { done: true, bytes: bytes.load(Ordering::Relaxed) });
            }
            if started.elapsed() >= wait {
                return Ok(CopyProgress { done: false, bytes: bytes.load(Ordering::Relaxed) });
            }
            tokio::time::sleep(Duration::from_millis(10).min(wait)).await;
        }
    }

    fn spawn_copy(&self, export: &NfsExport, from: &str, to: &str) -> Job {
        let bytes = Arc::new(AtomicU64::new(0));
        let state = Arc::new(Mutex::new(State::Running));
        let (client, e, f, t) = (self.clone(), export.clone(), from.to_string(), to.to_string());
        let (b, s) = (Arc::clone(&bytes), Arc::clone(&state));
        let task = tokio::spawn(COPIED.scope(b, async move {
            client.remove_stale_temps(&e, &t).await;
            let r = client.copy_tree(&e, &f, &t).await;
            if let Err(err) = &r {
                tracing::warn!(export = %e, from = %f, to = %t, error = %err, "background copy failed");
            }
            *s.lock().unwrap_or_else(PoisonError::into_inner) = State::Finished(r, Instant::now());
        }));
        Job { from: from.to_string(), bytes, state, task: task.abort_handle() }
    }

    /// Stop the background copy to `to`, if one runs, and forget it; its temporary copy stays
    /// in the target's parent for the caller to remove with it. Absent: success.
    pub async fn cancel_copy(&self, export: &NfsExport, to: &str) {
        let job = self.jobs.lock().remove(&(export.clone(), to.to_string()));
        if let Some(job) = job {
            job.task.abort();
            // An aborted task stops at its next await; wait for it, so no RPC of the copy lands
            // after the caller removed the directory.
            while !job.task.is_finished() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    /// Temporary copies in the parent of `to` left by another process (the name carries the
    /// pid): that process died mid-copy, nothing will rename them into place.
    async fn remove_stale_temps(&self, export: &NfsExport, to: &str) {
        let parent = to.rsplit_once('/').map(|(p, _)| p).unwrap_or("");
        let Ok(names) = self.read_dir(export, parent).await else { return };
        let ours = format!(".wasmcsi-copy-{}-", std::process::id());
        for n in names.iter().filter(|n| n.starts_with(".wasmcsi-copy-") && !n.starts_with(&ours)) {
            let path = if parent.is_empty() { n.clone() } else { format!("{parent}/{n}") };
            if let Err(e) = self.remove_all(export, &path).await {
                tracing::warn!(export = %export, path, error = %e, "could not remove a stale temporary copy");
            }
        }
    }
}
