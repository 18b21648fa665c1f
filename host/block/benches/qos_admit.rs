//! What an I/O limit costs the engine per request: `Throttle::admit` with no limit, and with
//! limits so high that nothing waits (the bookkeeping alone), on one thread and on four at
//! once (the FUSE workers of one volume share its throttle). Nanoseconds per admission.
//!
//! `cargo bench --release --workspace --locked --bench qos_admit` (QOS_ADMITS: admissions per
//! thread, default 10 000 000).
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use wasmcsi_block::qos::{Direction, IoLimits, Throttle};

fn admits() -> u64 {
    std::env::var("QOS_ADMITS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000_000)
}

/// ns per admission of `n` 4 KiB writes and reads on each of `threads` threads.
fn run(throttle: &Arc<Throttle>, threads: usize, n: u64) -> f64 {
    let started = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let t = throttle.clone();
            std::thread::spawn(move || {
                for i in 0..n {
                    let direction = if i % 2 == 0 { Direction::Write } else { Direction::Read };
                    black_box(t.admit(direction, black_box(4096)));
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a bench thread panicked");
    }
    started.elapsed().as_nanos() as f64 / (n * threads as u64) as f64
}

fn main() {
    let n = admits();
    let unlimited = Arc::new(Throttle::default());
    let limited = Arc::new(Throttle::default());
    // Every bucket on, none ever binding: what a limit costs when the workload stays under it.
    limited.set(IoLimits {
        read_iops: u64::MAX / 4,
        write_iops: u64::MAX / 4,
        read_bytes_per_second: u64::MAX / 4,
        write_bytes_per_second: u64::MAX / 4,
    });
    println!("| throttle | threads | ns per admission |");
    println!("|----------|---------|------------------|");
    for threads in [1, 4] {
        println!("| none | {threads} | {:.1} |", run(&unlimited, threads, n));
        println!("| every limit set | {threads} | {:.1} |", run(&limited, threads, n));
    }
}
