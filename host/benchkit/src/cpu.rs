//! CPU time per I/O, for the whole machine: on a small machine every part of a data path (fio,
//! the kernel's loop and FUSE threads, the engine, the replicas) shares the same cores, so the
//! sum of their costs, not any one of them, sets the throughput.

/// Busy and total jiffies of all CPUs so far (`/proc/stat`; zeros where it cannot be read).
fn jiffies() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (total.saturating_sub(idle), total)
}

/// Runs `job`, which returns its result and how many I/Os it completed per second, and returns
/// that result with the machine's CPU µs per I/O meanwhile.
pub fn measure<T>(job: impl FnOnce() -> (T, f64)) -> (T, f64) {
    let (busy0, total0) = jiffies();
    let (res, iops) = job();
    let (busy1, total1) = jiffies();
    let cpus = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    let share = busy1.saturating_sub(busy0) as f64 / total1.saturating_sub(total0).max(1) as f64;
    (res, share * cpus * 1e6 / iops.max(1.0))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_busy_loop_costs_cpu_per_operation() {
        let (spins, per_op) = super::measure(|| {
            let t = std::time::Instant::now();
            let mut n = 0u64;
            while t.elapsed() < std::time::Duration::from_millis(300) {
                n = std::hint::black_box(n + 1);
            }
            // 10 "operations" per second over the 0.3 s.
            (n, 10.0)
        });
        assert!(spins > 0);
        // One core busy for the whole run: about 1e5 µs per op (1 s / 10); allow wide noise.
        assert!(per_op > 2e4, "{per_op}");
    }
}
