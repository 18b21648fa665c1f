//! CPU time per I/O, for the whole machine: on a small machine every part of a data path (fio,
//! the kernel's loop and FUSE threads, the engine, the replicas) shares the same cores, so the
//! sum of their costs, not any one of them, sets the throughput.

use std::collections::BTreeMap;

use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;

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
    // The machine's CPUs, not this thread's share of them (`available_parallelism` follows the
    // affinity, which a node-confined layout narrows).
    let cpus = online_cpus() as f64;
    let share = busy1.saturating_sub(busy0) as f64 / total1.saturating_sub(total0).max(1) as f64;
    (res, share * cpus * 1e6 / iops.max(1.0))
}

/// The CPUs `/proc/stat` counts (`cpuN` lines); at least one.
pub fn online_cpus() -> usize {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let n =
        stat.lines().filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit)).count();
    n.max(1)
}

/// One CPU's jiffies so far (`/proc/stat`'s `cpuN` line): busy, softirq and total; zeros where it
/// cannot be read.
pub fn cpu_jiffies(cpu: usize) -> CpuJiffies {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let name = format!("cpu{cpu}");
    let fields: Vec<u64> = stat
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name.as_str()))
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    CpuJiffies { busy: total.saturating_sub(idle), softirq: fields.get(6).copied().unwrap_or(0), total }
}

/// See [`cpu_jiffies`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuJiffies {
    pub busy: u64,
    pub softirq: u64,
    pub total: u64,
}

impl CpuJiffies {
    /// Busy and softirq µs of this CPU between `self` and `later`.
    pub fn spent_until(&self, later: &CpuJiffies) -> (f64, f64) {
        (
            later.busy.saturating_sub(self.busy) as f64 * TICK_US,
            later.softirq.saturating_sub(self.softirq) as f64 * TICK_US,
        )
    }
}

/// Confines the calling thread to `cpus`; threads (and processes) it starts from now on inherit
/// that. Panics if the kernel refuses (a CPU that is not online or not in this cgroup's set).
pub fn pin(cpus: &[usize]) {
    let mut set = CpuSet::new();
    for cpu in cpus {
        set.set(*cpu).expect("CPU number within the set's size");
    }
    sched_setaffinity(Pid::from_raw(0), &set).expect("sched_setaffinity");
}

/// The CPUs the calling thread may run on.
pub fn allowed() -> Vec<usize> {
    let Ok(set) = sched_getaffinity(Pid::from_raw(0)) else { return Vec::new() };
    (0..CpuSet::count()).filter(|c| set.is_set(*c).unwrap_or(false)).collect()
}

/// CPU time of this process's live threads so far, ns (each thread's `schedstat`: nanosecond
/// precision where `/proc/*/stat` counts 10 ms ticks, for costs of microseconds per call).
pub fn process_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|ns| ns.parse::<u64>().ok()))
        .sum()
}

/// `/proc` times are in USER_HZ ticks, which Linux fixes at 100 per second for user space.
const TICK_US: f64 = 10_000.0;

/// CPU time of this process's live threads so far, µs, by thread id, with each thread's name
/// group: its name up to the first `-` or digit, so a pool's threads (`fuser-3`, `fuser-12`)
/// count together.
pub fn threads() -> BTreeMap<u32, (String, f64)> {
    let mut threads = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return threads };
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        // "tid (name) state ppid ...": the name may hold spaces, the fields after it do not.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        let name = &stat[open + 1..close];
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat(5), 12th and 13th after the name.
        let ticks: u64 = fields.iter().skip(11).take(2).filter_map(|f| f.parse::<u64>().ok()).sum();
        let group = name.split(|c: char| c == '-' || c.is_ascii_digit()).next().unwrap_or(name);
        threads.insert(tid, (group.to_owned(), ticks as f64 * TICK_US));
    }
    threads
}

/// What each thread group spent between two [`threads`] snapshots, µs. A thread that ended in
/// between is left out (its time went with it); one that started counts from zero.
pub fn spent(before: &BTreeMap<u32, (String, f64)>, after: &BTreeMap<u32, (String, f64)>) -> BTreeMap<String, f64> {
    let mut groups = BTreeMap::new();
    for (tid, (group, us)) in after {
        let was = before.get(tid).filter(|(g, _)| g == group).map_or(0.0, |(_, us)| *us);
        *groups.entry(group.clone()).or_insert(0.0) += us - was;
    }
    groups
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

    #[test]
    fn a_named_thread_is_charged_to_its_group() {
        let before = super::threads();
        let spinner = std::thread::Builder::new()
            .name("spinner-7".into())
            .spawn(|| {
                let t = std::time::Instant::now();
                let (start, mut seen) = (super::threads(), 0.0);
                // Spin until the kernel has charged this thread at least 50 ms.
                while seen < 50_000.0 && t.elapsed() < std::time::Duration::from_secs(10) {
                    seen = super::spent(&start, &super::threads()).get("spinner").copied().unwrap_or(0.0);
                }
                seen
            })
            .expect("spawn");
        let seen = spinner.join().expect("spinner");
        assert!(seen >= 50_000.0, "spinner charged {seen} µs");
        assert!(before.values().all(|(group, _)| group != "spinner"));
    }

    #[test]
    fn a_pinned_thread_and_the_threads_it_starts_stay_on_its_cpu() {
        let all = super::allowed();
        let first = *all.first().expect("at least one CPU");
        std::thread::spawn(move || {
            super::pin(&[first]);
            assert_eq!(super::allowed(), [first]);
            let inherited = std::thread::spawn(super::allowed).join().expect("child");
            assert_eq!(inherited, [first]);
            let before = super::cpu_jiffies(first);
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_millis(100) {
                std::hint::black_box(0);
            }
            let (busy, _) = before.spent_until(&super::cpu_jiffies(first));
            // 100 ms of spinning on that CPU: at least some of it shows as busy.
            assert!(busy >= 10_000.0, "{busy}");
        })
        .join()
        .expect("pinned thread");
        assert_eq!(super::allowed(), all, "the test thread itself is not pinned");
    }
}
