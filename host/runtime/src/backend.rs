//! One loaded backend component, and the bounded call: a fresh store from the
//! pre-instantiated component per call, with the backend's memory cap, wall-clock deadline
//! (epoch interruption), fuel and concurrency limit. Whatever the guest does, the caller gets
//! a value: its result, its WIT error, or a [`CallError`] saying why the call was stopped.
//!
//! Callers use the typed entry points (`Backend::create_volume` and the rest), one per
//! `driver` export, generated from the export table (`crate::exports`).
use crate::bindings::driver::{
    self, Attachment, BackendInfo, Capacity, CapacityRange, CreateVolumeRequest, Expansion, GroupSnapshot, Pair,
    Snapshot, SnapshotPage, Timestamp, Topology, Volume, VolumeCapability, VolumePage, VolumeStatus,
};
pub use crate::call_error::MAX_ERROR_MESSAGE;
use crate::call_error::{CallError, clip_message, clip_wit};
use crate::capabilities::ImportSummary;
pub use crate::compat::CallFuture;
use crate::compat::{ComponentPre, Driver};
use crate::config::Limits;
use crate::contract::ContractVersion;
use crate::exports::for_each_export;
use crate::metrics::{BackendLabels, CallLabels, ErrorLabels, Metrics};
use crate::secrets::{Secrets, secret_refs};
use crate::state::{CallState, Capabilities};
use crate::wasm_engine::EPOCH_TICK;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use wasmtime::{Engine, Store, Trap, UpdateDeadline};

/// A loaded, checked, ready-to-call backend. Immutable: hot reload swaps in a new one, and
/// calls holding this `Arc` finish on this version.
pub struct Backend {
    pub name: String,
    /// sha256 of the `.wasm`, hex
    pub digest: String,
    pub path: Option<PathBuf>,
    pub info: BackendInfo,
    /// the `wasmcsi:backend` version the component was built against (native: the current)
    pub contract: ContractVersion,
    /// the configuration this backend's grants and limits come from (the runtime's when it
    /// was loaded; a reload of the configuration loads it again)
    pub config: Arc<crate::config::HostConfig>,
    pub imports: ImportSummary,
    pub limits: Limits,
    /// compiled artifact came from the on-disk cache
    pub cache_hit: bool,
    pub(crate) kind: Kind,
    pub(crate) caps: Arc<Capabilities>,
    pub(crate) permits: Arc<Semaphore>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) memory_peak: AtomicU64,
    /// The threads this backend's guest code runs on (`None`: they could not be started).
    pub(crate) executor: Option<Arc<crate::executor::GuestExecutor>>,
}

/// How a backend's code runs.
pub(crate) enum Kind {
    /// a sandboxed component (production), of any contract version this host serves
    Wasm { engine: Engine, pre: ComponentPre },
    /// the same guest source linked into the host (benchmarks, tests; feature `native`): no
    /// sandbox
    #[cfg(feature = "native")]
    Native(crate::native::NativeDriver),
}

/// Epoch ticks between deadline checks (each check may yield the worker).
const YIELD_TICKS: u64 = 5;

/// Slack on top of the deadline for the outer timeout; the epoch deadline normally fires
/// first, this only catches a host import that ignored its own timeout.
const OUTER_GRACE: Duration = Duration::from_millis(50);

impl Backend {
    /// Dir roots granted to this backend (the node side resolves bind plans with them).
    pub fn dir_root(&self, root: &str) -> Option<&std::path::Path> {
        self.caps.dir.root(root)
    }

    /// The caller found this backend's answer outside the contract (an invalid id, a size
    /// outside the request): count it like any failed call and say so.
    pub fn reject_output(&self, op: &'static str, message: String) -> CallError {
        self.metrics
            .errors
            .get_or_create(&ErrorLabels {
                backend: self.name.clone(),
                op: op.into(),
                code: "Internal".into(),
                kind: "bad-output".into(),
            })
            .inc();
        // Logged once, where the failure becomes a gRPC status.
        let message = clip_message(message);
        tracing::debug!(backend = %self.name, op, "backend answer rejected: {message}");
        CallError::BadOutput { backend: self.name.clone(), op, message }
    }

    /// The replica sets this backend's `block` grant reaches (the host's own control plane
    /// uses it too: publishing a replicated volume, the node's attach).
    pub fn block_catalog(&self) -> Option<&wasmcsi_block::catalog::Catalog> {
        self.caps.block.catalog.as_ref()
    }

    pub fn has_feature(&self, f: driver::Feature) -> bool {
        self.info.features.contains(&f)
    }

    /// An export behind `feature` (a `[FEATURE]` row of the export table) is called only when
    /// the backend declared it; otherwise the host answers `unimplemented` itself, without
    /// calling the backend, whatever contract version it is built against.
    fn require(&self, feature: driver::Feature, op: &'static str, export: &str) -> Result<(), CallError> {
        if self.has_feature(feature) {
            return Ok(());
        }
        let error = crate::bindings::types::Error::Unimplemented(format!(
            "{export}: backend {} does not declare the {} feature",
            self.name,
            feature_name(feature)
        ));
        Err(CallError::Backend { backend: self.name.clone(), op, error })
    }

    /// Run one export under every limit. `body` gets the fresh instance's exports (in the
    /// current types, whatever version the guest was built against) and the store; `secrets`
    /// become handles 0.. for this call only. The call runs on the backend's own threads
    /// (`crate::executor`), never on the caller's: a guest that spins, or a host import stuck in
    /// a syscall, cannot keep the caller (a gRPC worker) past the deadline.
    pub async fn call<R, F>(self: &Arc<Self>, op: &'static str, secrets: Secrets, body: F) -> Result<R, CallError>
    where
        R: Send + 'static,
        F: for<'a> FnOnce(&'a dyn Driver, &'a mut Store<CallState>) -> CallFuture<'a, R> + Send + 'static,
    {
        let this = self.clone();
        self.detached(op, self.on_guest_threads(op, async move { this.call_inner(op, secrets, body).await })).await
    }

    /// `call` on this backend's threads, in the caller's span; the caller awaits its end. A
    /// backend whose threads could not be started (logged when it was loaded) runs it in the
    /// caller's task, as before there were guest threads.
    fn on_guest_threads<R: Send + 'static>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<R, CallError>> + Send + 'static,
    ) -> Pin<Box<dyn Future<Output = Result<R, CallError>> + Send + 'static>> {
        let call = tracing::Instrument::in_current_span(call);
        let Some(executor) = &self.executor else { return Box::pin(call) };
        let task = executor.spawn(call);
        let backend = self.name.clone();
        Box::pin(async move {
            task.await.unwrap_or_else(|e| {
                Err(CallError::Trap { backend, op, message: format!("the call's task ended: {e}") })
            })
        })
    }

    /// Like [`Backend::call`], in the caller's task (loading: `info` before the backend is shared).
    pub(crate) async fn call_in_place<R, F>(&self, op: &'static str, body: F) -> Result<R, CallError>
    where
        F: for<'a> FnOnce(&'a dyn Driver, &'a mut Store<CallState>) -> CallFuture<'a, R>,
    {
        self.observed(op, self.call_inner(op, vec![], body)).await
    }

    /// Run one export of a native backend with this backend's dir roots, in its own task
    /// like a component call. A native call cannot be interrupted; its caller stops waiting
    /// at the deadline.
    #[cfg(feature = "native")]
    async fn call_native<R: Send + 'static>(
        self: &Arc<Self>,
        op: &'static str,
        f: impl FnOnce() -> Result<R, crate::bindings::types::Error> + Send + 'static,
    ) -> Result<R, CallError> {
        let this = self.clone();
        let call = async move {
            let _permit = this.permit(op, Instant::now() + this.limits.call_deadline()).await?;
            crate::local_io::local_io(|| crate::native::with_roots(&this.caps.dir.roots, f))
                .map_err(|error| CallError::Backend { backend: this.name.clone(), op, error: clip_wit(error) })
        };
        self.detached(op, self.on_guest_threads(op, call)).await
    }

    /// Run `call` in its own task and wait for it until the deadline (+ grace): traced,
    /// counted, and never longer than the deadline for the caller.
    async fn detached<R: Send + 'static>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<R, CallError>> + Send + 'static,
    ) -> Result<R, CallError> {
        let deadline = self.limits.call_deadline();
        let backend = self.name.clone();
        self.observed(op, async move {
            match tokio::time::timeout(deadline + OUTER_GRACE, call).await {
                Err(_) => Err(CallError::Timeout { backend, op, deadline }),
                Ok(result) => result,
            }
        })
        .await
    }

    /// One of the backend's concurrency slots, waiting at most until `deadline`.
    async fn permit(
        &self,
        op: &'static str,
        deadline: Instant,
    ) -> Result<tokio::sync::OwnedSemaphorePermit, CallError> {
        match tokio::time::timeout_at(deadline.into(), self.permits.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(p),
            _ => Err(CallError::Busy { backend: self.name.clone(), op, limit: self.limits.max_concurrent_calls }),
        }
    }

    /// Trace and count one call.
    async fn observed<R>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<R, CallError>>,
    ) -> Result<R, CallError> {
        let span = tracing::info_span!("backend.call", backend = %self.name, op, digest = %&self.digest[..12.min(self.digest.len())]);
        let started = Instant::now();
        let result = tracing::Instrument::instrument(call, span).await;
        let labels = CallLabels { backend: self.name.clone(), op: op.into() };
        self.metrics.calls.get_or_create(&labels).inc();
        self.metrics.latency.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            let labels =
                ErrorLabels { backend: self.name.clone(), op: op.into(), code: e.code().into(), kind: e.kind().into() };
            self.metrics.errors.get_or_create(&labels).inc();
            let b = BackendLabels { backend: self.name.clone() };
            match e {
                CallError::Timeout { .. } => {
                    self.metrics.timeouts.get_or_create(&b).inc();
                }
                CallError::Trap { .. } | CallError::OutOfMemory { .. } | CallError::OutOfFuel { .. } => {
                    self.metrics.traps.get_or_create(&b).inc();
                }
                _ => {}
            }
        }
        result
    }

    async fn call_inner<R, F>(&self, op: &'static str, secrets: Secrets, body: F) -> Result<R, CallError>
    where
        F: for<'a> FnOnce(&'a dyn Driver, &'a mut Store<CallState>) -> CallFuture<'a, R>,
    {
        let backend = || self.name.clone();
        let (engine, pre) = match &self.kind {
            Kind::Wasm { engine, pre } => (engine, pre),
            #[cfg(feature = "native")]
            Kind::Native(_) => {
                return Err(CallError::Trap {
                    backend: backend(),
                    op,
                    message: "a native backend has no component to call".into(),
                });
            }
        };
        let started = Instant::now();
        let deadline_len = self.limits.call_deadline();
        let deadline = started + deadline_len;
        let _permit = self.permit(op, deadline).await?;

        let state = CallState::new(self.caps.clone(), self.limits.memory_bytes(), secrets, deadline);
        let mut store = Store::new(engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_hostcall_fuel(self.limits.transfer_limit_bytes());
        let fuel = if self.limits.fuel == 0 { u64::MAX } else { self.limits.fuel };
        store.set_fuel(fuel).map_err(|e| CallError::Trap { backend: backend(), op, message: format!("{e:#}") })?;
        // Checked every few epoch ticks: past the deadline the guest traps; before it, the
        // call yields so a busy guest shares its async worker with other calls. Checking every
        // tick made every call that spanned a tick pay a reschedule (measurable on
        // CreateVolume); every YIELD_TICKS keeps a spinning guest to ~10 ms slices.
        store.epoch_deadline_callback(move |_| {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(UpdateDeadline::Interrupt);
            }
            let ticks = (left.as_micros() / EPOCH_TICK.as_micros()).max(1) as u64;
            Ok(UpdateDeadline::Yield(ticks.min(YIELD_TICKS)))
        });
        store.set_epoch_deadline(YIELD_TICKS);

        let outcome = tokio::time::timeout_at((deadline + OUTER_GRACE).into(), async {
            let instance = pre.instantiate(&mut store).await?;
            body(instance.driver(), &mut store).await
        })
        .await;

        let limiter = &store.data().limiter;
        let peak = limiter.peak as u64;
        if self.memory_peak.fetch_max(peak, Ordering::Relaxed) < peak {
            self.metrics.memory_peak.get_or_create(&BackendLabels { backend: backend() }).set(peak);
        }
        match outcome {
            Err(_) => Err(CallError::Timeout { backend: backend(), op, deadline: deadline_len }),
            Ok(Ok(Ok(value))) => Ok(value),
            Ok(Ok(Err(error))) => Err(CallError::Backend { backend: backend(), op, error: clip_wit(error) }),
            Ok(Err(e)) => Err(classify(e, limiter.hit_limit, backend(), op, &self.limits)),
        }
    }
}

/// A feature as the WIT names it (`modify-volume`).
fn feature_name(feature: driver::Feature) -> String {
    let debug = format!("{feature:?}");
    let camel = debug.rsplit("::").next().unwrap_or(&debug);
    let mut out = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('-');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// Turn a wasmtime error into why the call stopped. An OOM shows up as whatever trap the
/// guest's allocator raises after `memory.grow` failed, so the limiter's record decides.
fn classify(
    e: wasmtime::Error,
    hit_memory_limit: bool,
    backend: String,
    op: &'static str,
    limits: &Limits,
) -> CallError {
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => CallError::Timeout { backend, op, deadline: limits.call_deadline() },
        Some(Trap::OutOfFuel) => CallError::OutOfFuel { backend, op },
        Some(_) if hit_memory_limit => CallError::OutOfMemory { backend, op, limit_mib: limits.memory_limit_mib },
        // A trap's text can carry names from the guest's own name section: clipped too.
        Some(_) => CallError::Trap { backend, op, message: clip_message(format!("{e:#}")) },
        None if hit_memory_limit => CallError::OutOfMemory { backend, op, limit_mib: limits.memory_limit_mib },
        // Not a trap: lifting the guest's answer failed (bad UTF-8, bad pointers, …).
        None => CallError::BadOutput { backend, op, message: clip_message(format!("{e:#}")) },
    }
}

/// Secrets for the store: a `+ secrets` or `with secrets` row's argument, else none.
macro_rules! call_secrets {
    () => {
        Secrets::new()
    };
    ($secrets:ident) => {
        $secrets
    };
}

/// The typed entry points, one per export of the table, so callers never touch stores or
/// closures. Each runs the component (or, with the `native` feature, a native backend's
/// function) under the backend's limits; its `op` (metrics label, span field) is its name. An
/// export of a feature the backend did not declare is answered here (see
/// [`Backend::require`]).
macro_rules! entry_points {
    ($(
        $(#[$doc:meta])*
        $f:ident = $wit:literal $([$feature:ident])? ($($a:ident: $t:ty),*) $(+ $refs:ident)? $(with $values:ident)? -> $r:ty;
    )*) => {
        impl Backend {
            $(
                $(#[$doc])*
                pub async fn $f(
                    self: &Arc<Self>,
                    $($a: $t,)*
                    $($refs: Secrets,)?
                    $($values: Secrets,)?
                ) -> Result<$r, CallError> {
                    $(self.require(driver::Feature::$feature, stringify!($f), $wit)?;)?
                    let values: Secrets = call_secrets!($($refs)? $($values)?);
                    // The guest gets the secrets' handles; the values stay in the store.
                    $(let $refs = secret_refs(&values);)?
                    #[cfg(feature = "native")]
                    if let Kind::Native(native) = &self.kind {
                        let f = native.$f;
                        return self.call_native(stringify!($f), move || f($($a,)* $($refs,)?)).await;
                    }
                    self.call(stringify!($f), values, move |driver, store| driver.$f(store, $($a,)* $($refs,)?)).await
                }
            )*
        }
    };
}

for_each_export!(entry_points);
