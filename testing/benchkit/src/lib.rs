//! What the project's benchmarks share, so that their tables compare: knobs read from the
//! environment, percentiles, and one fio runner with the same four job shapes everywhere
//! (4k randwrite QD1 and QD32, 4k randread QD32, 1M sequential write QD4; libaio, `direct=1`),
//! each result carrying the machine's CPU time per I/O beside its speed.
//!
//! Benchmarks are harnesses: a fio that is missing or fails panics with what went wrong.
#![allow(clippy::expect_used, reason = "benchmark harness: a failed run is reported by panicking")]

pub mod cpu;
pub mod fio;

use std::time::Duration;

/// `name` from the environment as a number, `default` when unset or not a number.
pub fn knob(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Like [`knob`], for fractional values (seconds).
pub fn knob_f64(name: &str, default: f64) -> f64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The `p` quantile (0..=1) of `samples`, which it sorts; zero for no samples.
pub fn pct(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let Some(last) = samples.len().checked_sub(1) else { return Duration::ZERO };
    samples[((last as f64 * p.clamp(0.0, 1.0)).round() as usize).min(last)]
}

/// `d` in milliseconds, two decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_nearest_rank_and_survive_no_samples() {
        let mut s: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        assert_eq!(pct(&mut s, 0.5), Duration::from_millis(51));
        assert_eq!(pct(&mut s, 0.99), Duration::from_millis(99));
        assert_eq!(pct(&mut s, 1.0), Duration::from_millis(100));
        assert_eq!(pct(&mut [], 0.5), Duration::ZERO);
        assert_eq!(ms(Duration::from_micros(1500)), "1.50 ms");
    }
}
