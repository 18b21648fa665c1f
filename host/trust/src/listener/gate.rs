//! Connection caps: a total and a per-source cap, and the [`Permit`] a connection holds while it
//! lives (dropping it gives the slot back).
//!
//! The per-source key is the IPv4 address, or the /64 of an IPv6 address (one host commonly owns
//! a whole /64; counting single IPv6 addresses would let it open 2^64 times the cap). An
//! IPv4-mapped IPv6 address counts as its IPv4 address.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use super::Stats;

/// Why a connection was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The listener holds its total cap of connections.
    Total,
    /// The source holds its cap of connections.
    PerSource,
}

pub(crate) struct Gate {
    max_total: usize,
    max_per_source: usize,
    counts: Mutex<Counts>,
    stats: Arc<Stats>,
}

#[derive(Default)]
struct Counts {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
}

impl Gate {
    pub(crate) fn new(max_total: usize, max_per_source: usize, stats: Arc<Stats>) -> Arc<Gate> {
        Arc::new(Gate { max_total, max_per_source, counts: Mutex::new(Counts::default()), stats })
    }

    pub(crate) fn try_admit(self: &Arc<Self>, ip: IpAddr) -> Result<Permit, Refusal> {
        let source = source_key(ip);
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if counts.total >= self.max_total {
            return Err(Refusal::Total);
        }
        let held = counts.by_source.entry(source).or_insert(0);
        if *held >= self.max_per_source {
            return Err(Refusal::PerSource);
        }
        *held += 1;
        counts.total += 1;
        self.stats.open.store(counts.total as u64, Ordering::Relaxed);
        Ok(Permit { gate: self.clone(), source })
    }

    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner).total
    }
}

/// One admitted connection's slot; released when dropped. Keep it as long as the connection.
pub struct Permit {
    gate: Arc<Gate>,
    source: IpAddr,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit").field("source", &self.source).finish()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut counts = self.gate.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.total = counts.total.saturating_sub(1);
        self.gate.stats.open.store(counts.total as u64, Ordering::Relaxed);
        if let Some(held) = counts.by_source.get_mut(&self.source) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                counts.by_source.remove(&self.source);
            }
        }
    }
}

fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let s = v6.segments();
            IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn per_source_cap_holds_and_dropping_a_permit_frees_its_slot() {
        let gate = Gate::new(10, 2, Arc::default());
        let a1 = gate.try_admit(ip("10.0.0.1")).expect("first");
        let _a2 = gate.try_admit(ip("10.0.0.1")).expect("second");
        assert_eq!(gate.try_admit(ip("10.0.0.1")).err(), Some(Refusal::PerSource));
        let _b = gate.try_admit(ip("10.0.0.2")).expect("other source");
        drop(a1);
        let _a3 = gate.try_admit(ip("10.0.0.1")).expect("slot freed");
        assert_eq!(gate.held(), 3);
    }

    #[test]
    fn total_cap_holds_across_sources() {
        let gate = Gate::new(2, 2, Arc::default());
        let _a = gate.try_admit(ip("10.0.0.1")).expect("a");
        let _b = gate.try_admit(ip("10.0.0.2")).expect("b");
        assert_eq!(gate.try_admit(ip("10.0.0.3")).err(), Some(Refusal::Total));
    }

    #[test]
    fn an_ipv6_64_is_one_source_and_mapped_ipv4_is_ipv4() {
        let gate = Gate::new(10, 1, Arc::default());
        let _a = gate.try_admit(ip("2001:db8:1:2::1")).expect("a");
        assert_eq!(gate.try_admit(ip("2001:db8:1:2:ffff::9")).err(), Some(Refusal::PerSource));
        let _b = gate.try_admit(ip("2001:db8:1:3::1")).expect("another /64");
        let _c = gate.try_admit(ip("192.0.2.1")).expect("v4");
        assert_eq!(gate.try_admit(ip("::ffff:192.0.2.1")).err(), Some(Refusal::PerSource));
    }

    #[test]
    fn every_permit_dropped_leaves_nothing_counted() {
        let gate = Gate::new(100, 100, Arc::default());
        let permits: Vec<Permit> =
            (0..50).map(|i| gate.try_admit(ip(&format!("10.0.0.{i}"))).expect("admit")).collect();
        drop(permits);
        assert_eq!(gate.held(), 0);
        assert!(gate.counts.lock().expect("lock").by_source.is_empty());
    }
}
