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
