//! What a backend call's store holds, and the view each capability gets of it.
//!
//! [`Capabilities`] is what one backend was granted of each capability, resolved once at load
//! and shared by all its calls. [`CallState`] is one call's store data: those capabilities,
//! the call's own secrets, log budget and deadline, deny-by-default WASI and the memory
//! limiter. It is built fresh for every call and dropped with it, so nothing leaks from one
//! call into the next. Each capability sees only its own slice of it, through the view
//! `CallState` lends it (`imports::NAME::NAMEView`), as wasmtime's WASI sees only its
//! `WasiCtxView`: this file is the one place that knows every capability.
use crate::imports::backup::{BackupCtx, BackupCtxView, BackupView};
use crate::imports::block::{BlockCtx, BlockCtxView, BlockView};
use crate::imports::dir::{DirCtx, DirCtxView, DirView};
use crate::imports::kv::{KvCtx, KvCtxView, KvView};
use crate::imports::log::{LogBudget, LogCtxView, LogView};
use crate::imports::nfs::{NfsCtx, NfsCtxView, NfsView};
use crate::imports::rbd::{RbdCtx, RbdCtxView, RbdView};
use crate::limiter::MemoryLimiter;
use crate::secrets::Secrets;
use std::sync::Arc;
use std::time::Instant;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// What one backend was granted of each capability, resolved once at load and shared by all
/// its calls. A capability without a grant still has its context: it answers
/// `permission-denied` (the loader refuses a component importing it anyway).
pub struct Capabilities {
    pub backend: String,
    pub kv: KvCtx,
    pub dir: DirCtx,
    pub nfs: NfsCtx,
    pub rbd: RbdCtx,
    pub block: BlockCtx,
    pub backup: BackupCtx,
}

/// Store data of one call.
pub struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limiter: MemoryLimiter,
    caps: Arc<Capabilities>,
    /// Secret values of this call; the guest only ever sees indexes into this list.
    secrets: Secrets,
    /// What the guest may still make the host log in this call.
    log_budget: LogBudget,
    /// When the call must be over: imports that can run long stop before it.
    deadline: Instant,
}

impl CallState {
    pub(crate) fn new(caps: Arc<Capabilities>, memory_limit: usize, secrets: Secrets, deadline: Instant) -> Self {
        // Deny by default: no preopened directories, no env, no args, no network, no stdio
        // inheritance. Clocks and randomness stay (harmless, and std needs them).
        let wasi = WasiCtx::builder().allow_tcp(false).allow_udp(false).allow_ip_name_lookup(false).build();
        Self {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter::new(memory_limit),
            caps,
            secrets,
            log_budget: LogBudget::default(),
            deadline,
        }
    }
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl LogView for CallState {
    fn log(&mut self) -> LogCtxView<'_> {
        LogCtxView { backend: &self.caps.backend, budget: &mut self.log_budget }
    }
}

impl KvView for CallState {
    fn kv(&mut self) -> KvCtxView<'_> {
        KvCtxView { ctx: &self.caps.kv }
    }
}

impl DirView for CallState {
    fn dir(&mut self) -> DirCtxView<'_> {
        DirCtxView { ctx: &self.caps.dir, deadline: self.deadline }
    }
}

impl NfsView for CallState {
    fn nfs(&mut self) -> NfsCtxView<'_> {
        NfsCtxView { ctx: &self.caps.nfs }
    }
}

impl RbdView for CallState {
    fn rbd(&mut self) -> RbdCtxView<'_> {
        RbdCtxView { ctx: &self.caps.rbd, secrets: &self.secrets }
    }
}

impl BlockView for CallState {
    fn block(&mut self) -> BlockCtxView<'_> {
        BlockCtxView { ctx: &self.caps.block }
    }
}

impl BackupView for CallState {
    fn backup(&mut self) -> BackupCtxView<'_> {
        BackupCtxView { ctx: &self.caps.backup, secrets: &self.secrets }
    }
}
