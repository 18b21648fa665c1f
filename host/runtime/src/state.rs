//! What one backend call's store holds: deny-by-default WASI, the memory limiter, and the
//! handles of the capabilities this backend was granted. Built fresh for every call and
//! dropped with it, so nothing leaks from one call into the next.
use crate::capabilities::Capabilities;
use std::sync::Arc;
use wasmtime::ResourceLimiter;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// Store data of one call.
pub struct CallState {
    pub(crate) wasi: WasiCtx,
    pub(crate) table: ResourceTable,
    pub(crate) limiter: MemoryLimiter,
    pub(crate) caps: Arc<Capabilities>,
    /// Secret values of this call; the guest only ever sees indexes into this list.
    pub(crate) secrets: crate::backend::Secrets,
    /// What the guest may still make the host log in this call.
    pub(crate) log_budget: crate::imports::log::LogBudget,
    /// When the call must be over: imports that can run long stop before it.
    pub(crate) deadline: std::time::Instant,
}

impl CallState {
    pub(crate) fn new(
        caps: Arc<Capabilities>,
        memory_limit: usize,
        secrets: crate::backend::Secrets,
        deadline: std::time::Instant,
    ) -> Self {
        // Deny by default: no preopened directories, no env, no args, no network, no stdio
        // inheritance. Clocks and randomness stay (harmless, and std needs them).
        let wasi = WasiCtx::builder().allow_tcp(false).allow_udp(false).allow_ip_name_lookup(false).build();
        Self {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter::new(memory_limit),
            caps,
            secrets,
            log_budget: Default::default(),
            deadline,
        }
    }

    /// The secret value behind a handle the guest passed back, for capabilities that need it.
    pub fn secret(&self, handle: u32) -> Option<&str> {
        self.secrets.get(handle as usize).map(|(_, v)| v.as_str())
    }
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// Caps linear memory and remembers the peak and whether the cap was hit, so an OOM can be
/// told apart from any other trap. "The cap" is every limit a growth can meet: this limiter's,
/// but also the engine's own ceilings, which it never sees in `memory_growing` (the pooling
/// allocator's slot size, the memory type's maximum) and which wasmtime reports through the
/// `*_grow_failed` hooks; without those, a guest stopped by them was counted as a trap.
#[derive(Debug)]
pub(crate) struct MemoryLimiter {
    limit: usize,
    pub(crate) peak: usize,
    pub(crate) hit_limit: bool,
}

impl MemoryLimiter {
    fn new(limit: usize) -> Self {
        Self { limit, peak: 0, hit_limit: false }
    }
}

/// Elements a guest's table may grow to.
const MAX_TABLE_ELEMENTS: usize = 100_000;

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.limit {
            self.hit_limit = true;
            return Ok(false);
        }
        self.peak = self.peak.max(desired);
        Ok(true)
    }

    fn memory_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.hit_limit = true;
        Ok(())
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        // Tables hold function references; a policy guest needs few. Bound them so a guest
        // cannot use tables to get around the memory cap (and count it as that cap).
        if desired > MAX_TABLE_ELEMENTS {
            self.hit_limit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_grow_failed(&mut self, _error: wasmtime::Error) -> wasmtime::Result<()> {
        self.hit_limit = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refused_growth_counts_as_hitting_the_memory_cap() {
        let mut l = MemoryLimiter::new(1 << 20);
        assert!(l.memory_growing(0, 1 << 20, None).unwrap_or(false));
        assert!(!l.hit_limit);
        assert!(l.table_growing(0, MAX_TABLE_ELEMENTS, None).unwrap_or(false));
        assert!(!l.hit_limit);
        assert!(!l.table_growing(0, MAX_TABLE_ELEMENTS + 1, None).unwrap_or(true));
        assert!(l.hit_limit);
        let mut l = MemoryLimiter::new(1 << 20);
        // The engine refused what the limiter allowed (its own ceiling).
        l.memory_grow_failed(wasmtime::Error::msg("Memory maximum size exceeded")).ok();
        assert!(l.hit_limit);
        let mut l = MemoryLimiter::new(1 << 20);
        l.table_grow_failed(wasmtime::Error::msg("table maximum size exceeded")).ok();
        assert!(l.hit_limit);
    }
}
