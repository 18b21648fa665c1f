//! The memory limiter of a backend call's store: the cap on linear memory and tables, and the
//! record of whether the call met it, so an OOM is told apart from any other trap.
use wasmtime::ResourceLimiter;

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
    pub(crate) fn new(limit: usize) -> Self {
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
