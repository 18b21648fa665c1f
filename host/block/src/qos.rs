//! A volume's I/O limits ([`IoLimits`]: operations and bytes per second, reads and writes
//! apart, 0 = unlimited) and how its engine holds a volume to them ([`Throttle`]): four token
//! buckets, each kept as the time it is next full (the generic cell rate algorithm, i.e. a
//! token bucket that may go into debt), so admitting an I/O is arithmetic on one number per
//! bucket, and an I/O that must wait is told how long: it waits on a timer, never in a loop
//! that looks again.
//!
//! Reads and writes are limited; flushes and unmaps are not (a flush moves no data the
//! workload did not already pay for, and an unmap frees space rather than using bandwidth).
//! An I/O that must wait for one bucket also takes its share of the others at once, so each
//! limit holds on its own over any window longer than the burst.
//!
//! It does not own where the waiting happens (the volume's handle, `crate::volume`) nor where
//! the limits are kept (the volume's record, `crate::catalog`).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How much work a bucket lets through at once after an idle spell, as time at its rate. A
/// tenth of a second: a filesystem's burst of a few requests (a journal commit) passes
/// without being spaced out one by one, and a workload measured over a few seconds still
/// sees its limit within a few percent (the burst is at most 1/10 s of extra work: 1 % over
/// 10 s). Longer bursts (EBS-style credits of minutes) make a limit invisible to short tests
/// and to the neighbour it is meant to protect; shorter ones add a timer per request to
/// workloads that only briefly exceed their rate.
pub const BURST: Duration = Duration::from_millis(100);

const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// A volume's I/O limits; 0 = unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IoLimits {
    #[serde(default)]
    pub read_iops: u64,
    #[serde(default)]
    pub write_iops: u64,
    #[serde(default)]
    pub read_bytes_per_second: u64,
    #[serde(default)]
    pub write_bytes_per_second: u64,
}

impl IoLimits {
    /// No limit at all.
    pub const UNLIMITED: IoLimits =
        IoLimits { read_iops: 0, write_iops: 0, read_bytes_per_second: 0, write_bytes_per_second: 0 };

    pub fn is_unlimited(&self) -> bool {
        *self == Self::UNLIMITED
    }
}

impl std::fmt::Display for IoLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "read {} IOPS {} B/s, write {} IOPS {} B/s",
            self.read_iops, self.read_bytes_per_second, self.write_iops, self.write_bytes_per_second
        )
    }
}

/// Which way an I/O goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Read,
    Write,
}

/// One token bucket of `rate` units per second, held as the time (ns since the throttle's
/// origin) at which it would be full again had nothing more been taken: its theoretical
/// arrival time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    /// units per second; 0 = unlimited
    rate: u64,
    /// how far ahead of now the full time may run before an I/O waits: the burst, in time
    burst_ns: u64,
    /// when the bucket is full again
    full_at_ns: u64,
}

impl TokenBucket {
    /// A full bucket of `rate` units per second (0: unlimited) at `now_ns`. Its burst is
    /// [`BURST`] of its rate, and at least one unit (one operation passes at any rate).
    pub fn new(rate: u64, now_ns: u64) -> Self {
        let one_unit = if rate == 0 { 0 } else { NANOS_PER_SECOND.div_ceil(u128::from(rate)) as u64 };
        let burst_ns = (BURST.as_nanos() as u64).max(one_unit);
        Self { rate, burst_ns, full_at_ns: now_ns }
    }

    /// Takes `cost` units at `now_ns`; how long (ns) the I/O must wait before it starts, 0
    /// when it may start now. Never refuses: a cost larger than the burst waits for the rest.
    pub fn take(&mut self, now_ns: u64, cost: u64) -> u64 {
        if self.rate == 0 {
            return 0;
        }
        let interval = (u128::from(cost) * NANOS_PER_SECOND).div_ceil(u128::from(self.rate));
        let interval = u64::try_from(interval).unwrap_or(u64::MAX);
        self.full_at_ns = self.full_at_ns.max(now_ns).saturating_add(interval);
        self.full_at_ns.saturating_sub(self.burst_ns).saturating_sub(now_ns)
    }
}

/// The four buckets of a volume's limits.
#[derive(Debug)]
struct Buckets {
    limits: IoLimits,
    read_ops: TokenBucket,
    read_bytes: TokenBucket,
    write_ops: TokenBucket,
    write_bytes: TokenBucket,
}

impl Buckets {
    fn new(limits: IoLimits, now_ns: u64) -> Self {
        Self {
            limits,
            read_ops: TokenBucket::new(limits.read_iops, now_ns),
            read_bytes: TokenBucket::new(limits.read_bytes_per_second, now_ns),
            write_ops: TokenBucket::new(limits.write_iops, now_ns),
            write_bytes: TokenBucket::new(limits.write_bytes_per_second, now_ns),
        }
    }
}

/// A volume's limits as its I/O path applies them. Unlimited (the default) costs one relaxed
/// atomic load per I/O; limited, one short lock.
#[derive(Debug)]
pub struct Throttle {
    /// Whether any limit is set: the I/O path looks at nothing else when none is.
    limited: AtomicBool,
    buckets: Mutex<Buckets>,
    origin: Instant,
}

impl Default for Throttle {
    fn default() -> Self {
        Self {
            limited: AtomicBool::new(false),
            buckets: Mutex::new(Buckets::new(IoLimits::UNLIMITED, 0)),
            origin: Instant::now(),
        }
    }
}

impl Throttle {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn buckets(&self) -> std::sync::MutexGuard<'_, Buckets> {
        // The buckets are numbers: a panic elsewhere cannot leave them inconsistent.
        self.buckets.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Applies `limits` from now on, with full buckets. The same limits again change nothing
    /// (the buckets keep what was taken). I/O already told to wait keeps its wait.
    pub fn set(&self, limits: IoLimits) {
        let mut b = self.buckets();
        if b.limits == limits {
            return;
        }
        *b = Buckets::new(limits, self.now_ns());
        self.limited.store(!limits.is_unlimited(), Ordering::Release);
    }

    /// The limits applied now.
    pub fn limits(&self) -> IoLimits {
        self.buckets().limits
    }

    /// Admits an I/O of `bytes` going `direction`: `None` when it may start now, else how long
    /// it must wait first (its share of the buckets is taken either way).
    #[inline]
    pub fn admit(&self, direction: Direction, bytes: u64) -> Option<Duration> {
        if !self.limited.load(Ordering::Relaxed) {
            return None;
        }
        self.admit_limited(direction, bytes)
    }

    fn admit_limited(&self, direction: Direction, bytes: u64) -> Option<Duration> {
        let now = self.now_ns();
        let mut b = self.buckets();
        let b = &mut *b;
        let (ops, volume) = match direction {
            Direction::Read => (&mut b.read_ops, &mut b.read_bytes),
            Direction::Write => (&mut b.write_ops, &mut b.write_bytes),
        };
        let wait = ops.take(now, 1).max(volume.take(now, bytes));
        (wait > 0).then_some(Duration::from_nanos(wait))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;

    /// Runs `count` I/Os of `cost` back to back through `bucket` from `start`, each starting
    /// when it is let: the time the last one starts.
    fn run(bucket: &mut TokenBucket, start: u64, count: u64, cost: u64) -> u64 {
        let mut now = start;
        for _ in 0..count {
            now += bucket.take(now, cost);
        }
        now
    }

    #[test]
    fn an_unlimited_bucket_never_waits() {
        let mut b = TokenBucket::new(0, 0);
        assert_eq!(run(&mut b, 0, 1_000_000, u64::MAX), 0);
    }

    #[test]
    fn a_full_bucket_lets_its_burst_through_at_once_then_paces_at_its_rate() {
        // 100 IOPS: a burst of 100 ms is 10 operations.
        let mut b = TokenBucket::new(100, 0);
        assert_eq!(run(&mut b, 0, 10, 1), 0, "the burst");
        assert_eq!(b.take(0, 1), 10 * MS, "the 11th waits one interval");
        // 1000 more from a busy start: 10 s at 100 per second, to the interval.
        let mut b = TokenBucket::new(100, 0);
        let last = run(&mut b, 0, 1010, 1);
        assert_eq!(last, 10 * S, "{last}");
    }

    #[test]
    fn a_rate_holds_within_a_percent_over_ten_seconds_whatever_the_cost() {
        for (rate, cost) in [(1 << 20, 4096), (50 << 20, 1 << 20), (3, 1), (7_777, 13)] {
            let mut b = TokenBucket::new(rate, 0);
            // As many I/Os as the bucket lets through in 10 s, issued as soon as each may.
            let mut now = 0;
            let mut done = 0u64;
            while now <= 10 * S {
                now += b.take(now, cost);
                if now <= 10 * S {
                    done += cost;
                }
            }
            let measured = done as f64 / 10.0;
            let error = (measured - rate as f64).abs() / rate as f64;
            assert!(error < 0.011 + cost as f64 / (10.0 * rate as f64), "rate {rate} cost {cost}: {measured}");
        }
    }

    #[test]
    fn an_idle_bucket_refills_to_its_burst_and_no_further() {
        let mut b = TokenBucket::new(100, 0);
        run(&mut b, 0, 50, 1);
        // An hour idle: only the burst passes at once again.
        let later = 3600 * S;
        assert_eq!(run(&mut b, later, 10, 1), later);
        assert_eq!(b.take(later, 1), 10 * MS);
    }

    #[test]
    fn a_cost_larger_than_the_burst_waits_for_the_rest_and_is_never_refused() {
        // 1 MiB/s: the burst is ~100 KiB; a 1 MiB write waits the other ~0.9 s.
        let mut b = TokenBucket::new(1 << 20, 0);
        let wait = b.take(0, 1 << 20);
        assert_eq!(wait, S - 100 * MS);
        // A rate of one unit per second still lets one unit through at once.
        let mut slow = TokenBucket::new(1, 0);
        assert_eq!(slow.take(0, 1), 0);
        assert_eq!(slow.take(0, 1), S);
    }

    #[test]
    fn the_throttle_limits_reads_and_writes_apart_and_by_the_tighter_of_ops_and_bytes() {
        let t = Throttle::default();
        assert_eq!(t.admit(Direction::Write, 1 << 30), None, "unlimited by default");
        t.set(IoLimits { write_iops: 10, read_bytes_per_second: 4096, ..IoLimits::UNLIMITED });
        // Writes: one operation is the whole burst (10 IOPS: 100 ms), the second waits.
        assert_eq!(t.admit(Direction::Write, 1 << 20), None);
        let wait = t.admit(Direction::Write, 1).expect("the second write waits");
        assert!(wait > Duration::from_millis(90) && wait <= Duration::from_millis(100), "{wait:?}");
        // Reads: bytes bind (4 KiB/s, a burst of ~410 bytes), operations do not.
        let wait = t.admit(Direction::Read, 4096).expect("a 4 KiB read waits");
        assert!(wait > Duration::from_millis(850), "{wait:?}");
        // Lifted: nothing waits, the writes' debt is forgotten.
        t.set(IoLimits::UNLIMITED);
        assert_eq!(t.admit(Direction::Write, 1 << 20), None);
        assert_eq!(t.limits(), IoLimits::UNLIMITED);
    }

    #[test]
    fn setting_the_same_limits_again_keeps_what_was_taken() {
        let t = Throttle::default();
        let limits = IoLimits { write_iops: 1, ..IoLimits::UNLIMITED };
        t.set(limits);
        assert_eq!(t.admit(Direction::Write, 1), None);
        t.set(limits);
        assert!(t.admit(Direction::Write, 1).is_some(), "a retry of the same limits is no refill");
    }

    #[test]
    fn limits_are_stored_by_name_and_missing_ones_read_as_unlimited() {
        let l = IoLimits { read_iops: 1, write_iops: 2, read_bytes_per_second: 3, write_bytes_per_second: 4 };
        let json = serde_json::to_value(l).expect("json");
        assert_eq!(json["write_bytes_per_second"], 4);
        assert_eq!(serde_json::from_value::<IoLimits>(json).expect("back"), l);
        let partial: IoLimits = serde_json::from_str(r#"{"write_iops": 5}"#).expect("partial");
        assert_eq!(partial, IoLimits { write_iops: 5, ..IoLimits::UNLIMITED });
    }
}
