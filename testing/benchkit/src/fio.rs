//! fio with the project's job shapes on a file or block device, as JSON.

use std::path::Path;
use std::process::Command;

pub const MIB: u64 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rw {
    RandWrite,
    RandRead,
    SeqWrite,
}

impl Rw {
    fn fio_name(self) -> &'static str {
        match self {
            Rw::RandWrite => "randwrite",
            Rw::RandRead => "randread",
            Rw::SeqWrite => "write",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub name: &'static str,
    pub rw: Rw,
    pub bs: u64,
    pub qd: usize,
}

/// The jobs every block table runs.
pub const SHAPES: [Shape; 4] = [
    Shape { name: "4k randwrite QD1", rw: Rw::RandWrite, bs: 4096, qd: 1 },
    Shape { name: "4k randwrite QD32", rw: Rw::RandWrite, bs: 4096, qd: 32 },
    Shape { name: "4k randread QD32", rw: Rw::RandRead, bs: 4096, qd: 32 },
    Shape { name: "1M seq write QD4", rw: Rw::SeqWrite, bs: MIB, qd: 4 },
];

#[derive(Debug, Clone, Copy, Default)]
pub struct Res {
    pub iops: f64,
    pub bytes_per_sec: f64,
    /// Mean completion latency, µs.
    pub lat_us: f64,
    /// The whole machine's CPU time per I/O, µs (see [`crate::cpu`]).
    pub cpu_us: f64,
    /// fio's own CPU time (user + system) per I/O, µs, as fio counts it for itself (zero for
    /// runs without fio): unlike [`Self::cpu_us`], other tenants' load does not enter it.
    pub fio_cpu_us: f64,
}

impl Res {
    /// The number a table shows: IOPS for 4k jobs, MB/s for 1M jobs.
    pub fn headline(&self, shape: &Shape) -> f64 {
        if shape.bs >= MIB { self.bytes_per_sec / 1e6 } else { self.iops }
    }

    /// Runs `job` and returns its result with the machine's CPU per I/O meanwhile filled in.
    pub fn measured(job: impl FnOnce() -> Res) -> Res {
        let (mut res, cpu_us) = crate::cpu::measure(|| {
            let res = job();
            (res, res.iops)
        });
        res.cpu_us = cpu_us;
        res
    }

    /// [`Self::headline`] formatted with its unit ("-" for no result).
    pub fn fmt_headline(r: Option<&Res>, shape: &Shape) -> String {
        match r {
            None => "-".into(),
            Some(r) if shape.bs >= MIB => format!("{:.0} MB/s", r.headline(shape)),
            Some(r) => format!("{:.0}", r.headline(shape)),
        }
    }
}

/// Runs `shape` on `target` (which must exist) over its first `ws` bytes for `secs` seconds
/// after a one-second ramp, and measures the machine's CPU per I/O meanwhile.
pub fn run(target: &Path, shape: &Shape, ws: u64, secs: f64) -> Res {
    Res::measured(|| run_fio(target, shape, ws, secs))
}

fn run_fio(target: &Path, shape: &Shape, ws: u64, secs: f64) -> Res {
    let out = Command::new("fio")
        .arg("--name=job")
        .arg(format!("--filename={}", target.display()))
        .args(["--direct=1", "--ioengine=libaio", "--time_based", "--ramp_time=1", "--norandommap"])
        .args(["--randrepeat=0", "--group_reporting", "--output-format=json", "--allow_file_create=0"])
        .arg(format!("--rw={}", shape.rw.fio_name()))
        .arg(format!("--bs={}", shape.bs))
        .arg(format!("--iodepth={}", shape.qd))
        .arg(format!("--size={ws}"))
        .arg(format!("--runtime={}", secs.ceil() as u64))
        .output()
        .expect("running fio (scripts/setup installs it)");
    assert!(out.status.success(), "fio on {} failed: {}", target.display(), String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("fio json");
    let j = &json["jobs"][0][if shape.rw == Rw::RandRead { "read" } else { "write" }];
    Res {
        iops: j["iops"].as_f64().unwrap_or(0.0),
        bytes_per_sec: j["bw_bytes"].as_f64().unwrap_or(0.0),
        lat_us: j["lat_ns"]["mean"].as_f64().unwrap_or(0.0) / 1e3,
        cpu_us: 0.0,
        fio_cpu_us: fio_cpu_per_io(&json["jobs"][0], j["iops"].as_f64().unwrap_or(0.0)),
    }
}

/// fio's `usr_cpu` and `sys_cpu` are percent of one CPU over the job's run: per I/O at `iops`.
fn fio_cpu_per_io(job: &serde_json::Value, iops: f64) -> f64 {
    let percent = job["usr_cpu"].as_f64().unwrap_or(0.0) + job["sys_cpu"].as_f64().unwrap_or(0.0);
    percent / 100.0 * 1e6 / iops.max(1.0)
}

/// Several runs of one job: tables show the median and the spread, goals are judged on the
/// median (one run swings too much on a shared machine).
#[derive(Debug, Clone, Default)]
pub struct Runs(pub Vec<Res>);

impl Runs {
    /// Runs `job` `n` times (at least once).
    pub fn of(n: usize, mut job: impl FnMut() -> Res) -> Self {
        Self((0..n.max(1)).map(|_| job()).collect())
    }

    /// The median of each field on its own (an all-zero result for no runs).
    pub fn median(&self) -> Res {
        let field = |f: fn(&Res) -> f64| median(self.0.iter().map(f).collect());
        Res {
            iops: field(|r| r.iops),
            bytes_per_sec: field(|r| r.bytes_per_sec),
            lat_us: field(|r| r.lat_us),
            cpu_us: field(|r| r.cpu_us),
            fio_cpu_us: field(|r| r.fio_cpu_us),
        }
    }

    /// (largest − smallest) / median of the headline numbers, as a fraction.
    pub fn spread(&self, shape: &Shape) -> f64 {
        let heads: Vec<f64> = self.0.iter().map(|r| r.headline(shape)).collect();
        let (lo, hi) = heads.iter().fold((f64::MAX, f64::MIN), |(lo, hi), h| (lo.min(*h), hi.max(*h)));
        if heads.is_empty() { 0.0 } else { (hi - lo) / median(heads).max(f64::MIN_POSITIVE) }
    }
}

/// The median of `values` (the mean of the middle two for an even count); zero for none.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Writes the first `ws` bytes of `target` once with 1 MiB direct writes, so read jobs read
/// data (a hole or a never-written RBD object reads as zeros without touching a disk).
pub fn prefill(target: &Path, ws: u64) {
    let st = Command::new("fio")
        .arg("--name=prefill")
        .arg(format!("--filename={}", target.display()))
        .args(["--direct=1", "--ioengine=libaio", "--rw=write", "--bs=1M", "--iodepth=4", "--output=/dev/null"])
        .arg(format!("--size={ws}"))
        .status()
        .expect("running fio (scripts/setup installs it)");
    assert!(st.success(), "prefill of {}", target.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(iops: f64, lat_us: f64) -> Res {
        Res { iops, bytes_per_sec: iops * 4096.0, lat_us, cpu_us: 0.0, fio_cpu_us: 0.0 }
    }

    #[test]
    fn runs_report_the_median_of_each_field_and_the_spread_of_the_headline() {
        let shape = &SHAPES[1];
        let runs = Runs(vec![res(100.0, 9.0), res(300.0, 1.0), res(200.0, 5.0)]);
        let m = runs.median();
        assert_eq!((m.iops, m.lat_us), (200.0, 5.0));
        assert_eq!(runs.spread(shape), 1.0);
        assert_eq!(Runs(vec![res(7.0, 1.0)]).spread(shape), 0.0);
        assert_eq!(Runs::default().median().iops, 0.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
