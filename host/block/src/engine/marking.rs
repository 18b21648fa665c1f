//! The engine's dirty maps: what an out-of-sync replica lacks (marked when a replica may have
//! missed writes) and the write-intent map (cleared lazily after flushes; see
//! [`super::INTENT_LINGER`]).

use super::*;

impl Engine {
    /// Marks in `r`'s map everything it may not hold durably: writes since the last flush
    /// started (a crash loses them), writes and unmaps in flight and what in-flight flushes
    /// cover (it may not have applied them).
    pub(super) fn mark_unsettled(&mut self, r: ReplicaId) {
        let full = empty_map(self.size, self.cfg.region_size);
        let map = self.missing.entry(r).or_insert(full);
        map.merge(&self.unflushed);
        for op in self.ops.values() {
            match op {
                Op::Fanout { kind: Fanout::Write { offset, len, .. }, .. } => {
                    map.mark(*offset, *len);
                }
                Op::Fanout { kind: Fanout::Flush { covered, .. }, .. } => {
                    map.merge(covered);
                }
                _ => {}
            }
        }
    }

    /// After a flush succeeded: drops from the intent map every region no write touched since
    /// the previous flush started (`window`) nor since this one started, and none is in flight
    /// on. Every write to such a region finished before this flush started, so every replica
    /// still in the set holds it durably. Persisted only when something was cleared (at most
    /// once per flush): a stale mark would be safe, but a quiet volume would then keep its last
    /// marks on disk and pay for them with a larger resync after a crash.
    pub(super) fn clear_intent(&mut self, window: &DirtyMap) {
        let mut busy = empty_map(self.size, self.cfg.region_size);
        for op in self.ops.values() {
            if let Op::Fanout { kind: Fanout::Write { offset, len, .. }, .. } = op {
                busy.mark(*offset, *len);
            }
        }
        let clear: Vec<u64> = self
            .intent
            .marked()
            .filter(|r| !window.is_marked(*r) && !self.touched.is_marked(*r) && !busy.is_marked(*r))
            .filter(|r| self.intent_touched.get(r).is_none_or(|t| self.now.saturating_sub(*t) >= INTENT_LINGER))
            .collect();
        let cleared = !clear.is_empty();
        for r in clear {
            self.intent.clear_region(r);
            self.intent_touched.remove(&r);
        }
        if cleared {
            self.persist();
        }
    }
}

/// `DirtyMap::new` only fails for a region size that is not a power of two, and `Engine::new`
/// replaces such a size with 1 MiB.
pub(super) fn empty_map(size: u64, region_size: u64) -> DirtyMap {
    match DirtyMap::new(size, region_size) {
        Ok(m) => m,
        Err(_) => unreachable!("region size checked in Engine::new"),
    }
}

pub(super) fn full_map(size: u64, region_size: u64) -> DirtyMap {
    let mut m = empty_map(size, region_size);
    m.mark_all();
    m
}
