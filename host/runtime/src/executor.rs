//! Where guest code runs: each backend (by name, across hot reloads) has threads of its own,
//! apart from the tokio workers that serve gRPC. A guest that spins in every call slot then
//! competes for the CPU with one backend's share (its threads, scheduled by the kernel beside
//! every other thread), not with the workers every CSI call needs: another backend's calls,
//! Probe, and the deadline answers of the spinning backend's own calls (the caller's timeout
//! fires on a gRPC worker, whatever the guest does) keep their latency.
//!
//! Each executor is a small multi-thread tokio runtime, because guest calls are async (epoch
//! yields, host imports that await I/O under their own timeouts); what an import spawns there
//! (a background copy) lives as long as the executor, which is as long as the [`Runtime`]
//! (`crate::runtime::Runtime`). It knows nothing of what it runs.
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

/// Threads of one backend's executor: enough for one backend's calls to use both cores of a
/// small node, few enough that a spinning backend holds at most that many.
pub const GUEST_THREADS: usize = 2;

/// One backend's threads.
pub struct GuestExecutor {
    handle: Handle,
    /// Dropped with the executor: the thread that owns the runtime then shuts it down (a
    /// runtime cannot be dropped from async code, where the last `Arc` may well go).
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl GuestExecutor {
    fn start(backend: &str) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(GUEST_THREADS)
            .thread_name(format!("guest-{backend}"))
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new().name(format!("guest-{backend}-owner")).spawn(move || {
            runtime.block_on(async {
                let _ = stopped.await;
            });
            runtime.shutdown_background();
        })?;
        Ok(Self { handle, _stop: stop })
    }

    /// Run `call` on this backend's threads.
    pub fn spawn<F>(&self, call: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(call)
    }
}

/// Every backend's executor, made on first use.
#[derive(Default)]
pub struct Executors {
    by_backend: Mutex<HashMap<String, Arc<GuestExecutor>>>,
}

impl Executors {
    /// `backend`'s executor; `None` when its threads cannot be started (the caller then runs
    /// the call where it is, as before there were executors).
    pub fn of(&self, backend: &str) -> Option<Arc<GuestExecutor>> {
        let mut map = self.by_backend.lock().ok()?;
        if let Some(e) = map.get(backend) {
            return Some(e.clone());
        }
        match GuestExecutor::start(backend) {
            Ok(e) => {
                let e = Arc::new(e);
                map.insert(backend.to_string(), e.clone());
                Some(e)
            }
            Err(error) => {
                tracing::error!(backend, %error, "cannot start the backend's guest threads; its calls run on the gRPC workers");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn a_call_runs_on_its_backends_threads_and_the_executor_is_shared_by_name() {
        let executors = Executors::default();
        let a = executors.of("a").expect("executor");
        let name = a.spawn(async { std::thread::current().name().map(str::to_string) }).await.expect("join");
        assert_eq!(name.as_deref(), Some("guest-a"));
        assert!(Arc::ptr_eq(&a, &executors.of("a").expect("executor")));
        assert!(!Arc::ptr_eq(&a, &executors.of("b").expect("executor")));
        // Dropped from async code: no panic, the owner thread shuts the runtime down.
        drop(executors);
        drop(a);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_spinning_call_does_not_hold_the_callers_thread() {
        let executors = Executors::default();
        let spinning = executors.of("spin").expect("executor");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let spin = spinning.spawn(async move {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        // This (single) caller thread still runs its own timers while the guest spins.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spin.await.expect("join");
    }
}
