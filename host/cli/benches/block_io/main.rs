//! `cargo bench --workspace --bench block_io` (or `scripts/bench-block`): the replicated block
//! data path against a raw file, one table from one run, so every ratio is measured side by side
//! on the same noisy machine.
//!
//! Targets, all with the same job shapes (4k randwrite QD1 and QD32, 4k randread QD32, 1M
//! sequential write QD4; direct I/O; a prefilled working set):
//! - **raw file**: fio (libaio, `direct=1`), and this file's own job runner (QD = threads doing
//!   blocking `pread`/`pwrite` on an `O_DIRECT` fd);
//! - **engine**: a 2-replica [`ReplicatedVolume`] over loopback TCP (replica servers in-process on
//!   their own runtime), driven by the same runner through its `BlockDevice` calls;
//! - **(c) FUSE file**: a plain file ([`FileDevice`]) exposed by the FUSE + loop frontend, fio
//!   on the loop device. `FileDevice` does buffered `pread`/`pwrite` (page cache, `fdatasync` on
//!   flush), like the replicas' stores and unlike the raw rows' `O_DIRECT`: (d)/(c) compares
//!   like with like behind the frontend, and (c) can beat the raw rows;
//! - **(d) FUSE engine**: the same 2-replica volume under FUSE + loop, both replicas over TCP;
//! - **(e) FUSE engine, local replica in-process**: as (d), but replica 0 is on this process's
//!   own node and reached in-process (the layout of a node plugin that serves its local replica
//!   and runs the engine), replica 1 over TCP.
//! - **(f) CSI**: the layout of (e) made by the product itself: a volume created, published
//!   and staged through the CSI socket of a node plugin in this process, whose second replica
//!   is on a replica node running as a child process (`wasmcsi serve --mode node`), with fio
//!   on the device NodePublish gave (see `csi.rs`, which also times CreateVolume and
//!   DeleteVolume with three replicas and a replica node's kill -9 until the volume is healthy).
//!
//! - **(c') and (e') node-confined**: (c) and (e) again with everything of the node (fio, the
//!   FUSE server, the engine, the in-process local replica) on one CPU and the remote replica
//!   server on another (thread affinity, inherited by the threads and processes each side
//!   starts), so what a node pays is measured apart from what the remote replica's machine pays;
//!   with the CPU µs per I/O of the node's side (see [`Split::node_us`]).
//!
//! Every job runs `BLOCK_BENCH_RUNS` times (3); tables show medians and the spread, and the goals
//! are judged on the medians.
//!
//! - **tls**: the engine of "engine" over mutual TLS (replica servers in `required`, the
//!   engine with a node's certificate and the volume's grant) beside the same engine in
//!   plaintext, run alternately, with the attach (handshake) time of each (see `tls.rs`).
//!
//! Then rebuilds on a separate volume: a full rebuild of a fresh replica against a plain copy of
//! a same-size file, and a delta rebuild of a replica that missed 1% of the volume against that
//! full rebuild. The loopback TCP round trip is measured in the same run for the QD1 goal.
//!
//! Knobs (environment): `BLOCK_BENCH_SECS` per job (default 5), `BLOCK_BENCH_MIB` working set
//! (default 256), `BLOCK_BENCH_REBUILD_MIB` rebuild volume (default 1024), `BLOCK_BENCH_DIR`
//! (default: a temporary directory under /var/tmp, on disk, not tmpfs), `BLOCK_BENCH_FUSE_THREADS`
//! (the frontend's default unless set), `BLOCK_BENCH_CREATES` (CreateVolume/DeleteVolume
//! samples, 50), `BLOCK_BENCH_HEAL_MIB` (the kill -9 volume, 1024), `BLOCK_BENCH_RUNS` (3),
//! `BLOCK_BENCH_ONLY` (a comma-separated subset of raw, engine, fuse, node, csi, tls, rebuild, group;
//! `group`: a group snapshot's pause for 3 and 10 volumes, `BLOCK_BENCH_GROUPS` rounds, default 30). The FUSE rows and the CSI
//! part need root and /dev/fuse and are skipped otherwise. Everything is torn down by drop
//! guards, on panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark harness")]

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use wasmcsi_benchkit::fio::{self, MIB, Res, Runs, Rw, SHAPES, Shape};
use wasmcsi_benchkit::{cpu, knob, knob_f64, ms, pct};
use wasmcsi_block::engine::EngineConfig;
use wasmcsi_block::replica::{ReplicaServer, ReplicaStore, replica_dir_name};
use wasmcsi_block::volume::{InProcessNode, ReplicaEndpoint, ReplicatedVolume, VolumeConfig};
use wasmcsi_frontend::{BlockDevice, FileDevice, Frontend, FuseLoopFrontend};

mod csi;
mod group;
mod tls;
// The CSI calls the flow tests make, once (`tests/all/support/csi.rs`).
#[path = "../../tests/all/support/mod.rs"]
mod support;

const REGION: u64 = MIB;

// ----- the job runner ---------------------------------------------------------------------------

/// What the runner drives: a raw `O_DIRECT` file or any `BlockDevice`.
trait Target: Sync {
    fn read(&self, buf: &mut [u8], offset: u64);
    fn write(&self, buf: &[u8], offset: u64);
}

/// A plain file opened with `O_DIRECT`: what "raw" means for the runner.
struct DirectFile(File);

impl DirectFile {
    fn open(path: &Path) -> Self {
        let flags = nix::fcntl::OFlag::O_DIRECT.bits();
        Self(OpenOptions::new().read(true).write(true).custom_flags(flags).open(path).expect("open O_DIRECT"))
    }
}

impl Target for DirectFile {
    fn read(&self, buf: &mut [u8], offset: u64) {
        self.0.read_exact_at(buf, offset).expect("raw read");
    }
    fn write(&self, buf: &[u8], offset: u64) {
        self.0.write_all_at(buf, offset).expect("raw write");
    }
}

struct Device<'a>(&'a dyn BlockDevice);

impl Target for Device<'_> {
    fn read(&self, buf: &mut [u8], offset: u64) {
        self.0.read_at(buf, offset).expect("device read");
    }
    fn write(&self, buf: &[u8], offset: u64) {
        self.0.write_at(buf, offset).expect("device write");
    }
}

/// A 4096-aligned buffer of `len` bytes without `unsafe`: over-allocate and slice at the first
/// aligned address.
struct Aligned {
    mem: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize, fill: u8) -> Self {
        let mem = vec![fill; len + 4096];
        let start = (4096 - (mem.as_ptr() as usize) % 4096) % 4096;
        Self { mem, start, len }
    }
    fn get(&self) -> &[u8] {
        &self.mem[self.start..self.start + self.len]
    }
    fn get_mut(&mut self) -> &mut [u8] {
        &mut self.mem[self.start..self.start + self.len]
    }
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Runs `shape` on `target` over `[0, ws)` for `secs`, `runs` times: `qd` threads each issuing
/// one blocking request at a time (random aligned offsets, or one shared sequential cursor).
fn run_job(target: &dyn Target, shape: &Shape, ws: u64, secs: f64, runs: usize) -> Runs {
    Runs::of(runs, || Res::measured(|| run_threads(target, shape, ws, secs)))
}

fn run_threads(target: &dyn Target, shape: &Shape, ws: u64, secs: f64) -> Res {
    let blocks = ws / shape.bs;
    let cursor = AtomicU64::new(0);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let per_thread: Vec<(u64, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..shape.qd)
            .map(|t| {
                let cursor = &cursor;
                s.spawn(move || {
                    let mut buf = Aligned::new(shape.bs as usize, 0x5a ^ t as u8);
                    let mut rng = 0x9e37_79b9_7f4a_7c15_u64 ^ ((t as u64 + 1) << 32);
                    let (mut ops, mut busy) = (0u64, Duration::ZERO);
                    while Instant::now() < deadline {
                        let block = match shape.rw {
                            Rw::SeqWrite => cursor.fetch_add(1, Ordering::Relaxed) % blocks,
                            _ => xorshift(&mut rng) % blocks,
                        };
                        let t0 = Instant::now();
                        match shape.rw {
                            Rw::RandRead => target.read(buf.get_mut(), block * shape.bs),
                            Rw::RandWrite | Rw::SeqWrite => target.write(buf.get(), block * shape.bs),
                        }
                        busy += t0.elapsed();
                        ops += 1;
                    }
                    (ops, busy)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("runner thread")).collect()
    });
    let elapsed = start.elapsed().as_secs_f64();
    let ops: u64 = per_thread.iter().map(|(o, _)| o).sum();
    let busy: Duration = per_thread.iter().map(|(_, b)| *b).sum();
    Res {
        iops: ops as f64 / elapsed,
        bytes_per_sec: (ops * shape.bs) as f64 / elapsed,
        lat_us: busy.as_secs_f64() * 1e6 / ops.max(1) as f64,
        cpu_us: 0.0,
        fio_cpu_us: 0.0,
    }
}

/// Where a layout's threads run: the node's side (fio, the FUSE server, the engine, the local
/// replica) on CPU `node`, the remote replica server on CPU `remote`.
#[derive(Debug, Clone, Copy)]
pub struct Placement {
    pub node: usize,
    pub remote: usize,
}

impl Placement {
    /// The first two CPUs this process may use; none on a one-CPU machine.
    fn first_two() -> Option<Self> {
        match cpu::allowed()[..] {
            [node, remote, ..] => Some(Self { node, remote }),
            _ => None,
        }
    }
}

/// Where the CPU time of a fio job went, µs per I/O, the median of its runs.
#[derive(Debug, Clone, Default)]
pub struct Split {
    /// This process's thread groups (those above 0.1 µs).
    pub groups: Vec<(String, f64)>,
    /// Busy and softirq time of the [`Placement`]'s node CPU, and busy time of its remote CPU:
    /// whole CPUs, so other tenants' work on them counts too (only meaningful for the
    /// node-confined columns, and only on a quiet machine).
    pub node_cpu: f64,
    pub node_softirq: f64,
    pub remote_cpu: f64,
    /// What the node pays that other tenants' load does not enter: fio's own CPU (as fio counts
    /// it) and this process's threads except the remote replica server's (`replica`). Kernel
    /// work outside those threads (the loop device's workers, softirq run elsewhere) is not in
    /// it; behind the same frontend it is about the same for (c) and the engine.
    pub node_us: f64,
}

impl Split {
    /// The median of each part over `splits` (a group missing from a run counts as zero there).
    fn median(splits: Vec<Split>) -> Split {
        let mut names: Vec<String> = splits.iter().flat_map(|s| s.groups.iter().map(|(g, _)| g.clone())).collect();
        names.sort();
        names.dedup();
        let of = |f: &dyn Fn(&Split) -> f64| fio::median(splits.iter().map(f).collect());
        let groups = names
            .into_iter()
            .map(|name| {
                let us = of(&|s: &Split| s.groups.iter().find(|(g, _)| *g == name).map_or(0.0, |(_, us)| *us));
                (name, us)
            })
            .filter(|(_, us)| *us >= 0.1)
            .collect();
        Split {
            groups,
            node_cpu: of(&|s| s.node_cpu),
            node_softirq: of(&|s| s.node_softirq),
            remote_cpu: of(&|s| s.remote_cpu),
            node_us: of(&|s| s.node_us),
        }
    }
}

/// fio on `path`, `runs` times, and where the CPU went meanwhile (see [`Split`]), to show where
/// (c)'s and the engine's costs differ.
pub fn fio_split(path: &Path, shape: &Shape, ws: u64, secs: f64, runs: usize, cpus: Placement) -> (Runs, Split) {
    let (mut results, mut splits) = (Vec::new(), Vec::new());
    for _ in 0..runs.max(1) {
        let before = cpu::threads();
        let (node0, remote0) = (cpu::cpu_jiffies(cpus.node), cpu::cpu_jiffies(cpus.remote));
        let started = Instant::now();
        let res = fio::run(path, shape, ws, secs);
        // The same span as the whole-machine figure: fio's ramp included, its I/Os counted at
        // the measured rate.
        let ops = (res.iops * started.elapsed().as_secs_f64()).max(1.0);
        let (node1, remote1) = (cpu::cpu_jiffies(cpus.node), cpu::cpu_jiffies(cpus.remote));
        let groups: Vec<(String, f64)> =
            cpu::spent(&before, &cpu::threads()).into_iter().map(|(group, us)| (group, us / ops)).collect();
        let ours: f64 = groups.iter().filter(|(g, _)| g != "replica").map(|(_, us)| us).sum();
        let (node_busy, node_softirq) = node0.spent_until(&node1);
        splits.push(Split {
            groups,
            node_cpu: node_busy / ops,
            node_softirq: node_softirq / ops,
            remote_cpu: remote0.spent_until(&remote1).0 / ops,
            node_us: ours + res.fio_cpu_us,
        });
        results.push(res);
    }
    (Runs(results), Split::median(splits))
}

/// Writes the whole working set once (1 MiB pieces), so reads hit data, not holes.
fn prefill(target: &dyn Target, ws: u64) {
    let buf = Aligned::new(MIB as usize, 0xc3);
    for i in 0..ws / MIB {
        target.write(buf.get(), i * MIB);
    }
}

/// Two replica servers on their own runtime and an engine over them; dropping it stops the
/// engine, then the servers.
struct Cluster {
    volume: Arc<ReplicatedVolume>,
    servers: Vec<Option<ReplicaServer>>,
    /// Each replica server's node root.
    nodes: Vec<PathBuf>,
    addrs: Vec<SocketAddr>,
    server_rt: tokio::runtime::Runtime,
    _engine_rt: tokio::runtime::Runtime,
}

fn runtime(name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn engine_config(id: &str, size: u64) -> EngineConfig {
    EngineConfig {
        volume_id: id.into(),
        size,
        region_size: REGION,
        request_timeout: 5_000,
        attach_timeout: 10_000,
        rebuild_parallelism: 4,
        epoch: 0,
    }
}

impl Cluster {
    /// Serves the node roots in `nodes` (each holding a replica of `id`) and starts an engine
    /// (state in `state`); with `in_process`, the engine reaches replica 0 (the local one)
    /// through its node instead of its server.
    /// With a `placement`, the replica servers' threads run on its remote CPU and the engine's
    /// on its node CPU (threads inherit the affinity of the thread that starts them).
    fn start(
        id: &str,
        size: u64,
        nodes: Vec<PathBuf>,
        state: &Path,
        in_process: bool,
        placement: Option<Placement>,
    ) -> Self {
        let allowed = cpu::allowed();
        if let Some(p) = placement {
            cpu::pin(&[p.remote]);
        }
        let server_rt = runtime("replica");
        let servers: Vec<_> = nodes
            .iter()
            .map(|d| Some(server_rt.block_on(ReplicaServer::bind_plaintext("127.0.0.1:0", d)).expect("replica server")))
            .collect();
        let addrs: Vec<_> = servers.iter().map(|s| s.as_ref().unwrap().local_addr()).collect();
        if let Some(p) = placement {
            cpu::pin(&[p.node]);
        }
        let engine_rt = runtime("engine");
        if placement.is_some() {
            cpu::pin(&allowed);
        }
        // Replica 0 is this node's (reads go there): in-process, or its server over TCP.
        let mut replicas = vec![ReplicaEndpoint::Local(addrs[0]), ReplicaEndpoint::Remote(addrs[1])];
        if in_process {
            let node = servers[0].as_ref().unwrap().node().clone();
            replicas[0] = ReplicaEndpoint::InProcess(InProcessNode { addr: addrs[0], node });
        }
        let mut cfg = VolumeConfig::new(engine_config(id, size), replicas, state);
        // A restarted replica is found within a few ms, so rebuild timings are not backoff.
        cfg.backoff_min = Duration::from_millis(5);
        cfg.backoff_max = Duration::from_millis(20);
        let volume = Arc::new(ReplicatedVolume::start(cfg, engine_rt.handle()).expect("engine"));
        Self { volume, servers, nodes, addrs, server_rt, _engine_rt: engine_rt }
    }

    fn wait_healthy(&self, n: usize, rebuilds: u64) {
        let ok = self
            .volume
            .wait_for(Duration::from_secs(600), |s| s.attached && s.healthy == n && s.rebuilds_finished >= rebuilds);
        assert!(ok, "volume never reached {n} healthy / {rebuilds} rebuilds: {:?}", self.volume.status());
    }

    fn stop_replica(&mut self, i: usize) {
        let server = self.servers[i].take().expect("replica running");
        self.server_rt.block_on(server.shutdown()).expect("replica shutdown");
    }

    fn start_replica(&mut self, i: usize) {
        let server =
            self.server_rt.block_on(ReplicaServer::bind_plaintext(self.addrs[i], &self.nodes[i])).expect("replica");
        self.servers[i] = Some(server);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.volume.shutdown();
        for s in self.servers.iter_mut().filter_map(Option::take) {
            let _ = self.server_rt.block_on(s.shutdown());
        }
    }
}

/// Two node roots, each with an empty replica of `id`; returns the roots.
fn create_replicas(root: &Path, id: &str, size: u64) -> Vec<PathBuf> {
    (0..2)
        .map(|i| {
            let node = root.join(format!("{id}-node{i}"));
            let dir = node.join(replica_dir_name(id).unwrap());
            std::fs::create_dir_all(&dir).unwrap();
            ReplicaStore::create(&dir, id, size).expect("replica store");
            node
        })
        .collect()
}

// ----- loopback RTT ---------------------------------------------------------------------------

/// Median round trip of a 64-byte ping-pong over loopback TCP (nodelay) between two threads,
/// µs. Each round trip wakes both threads, as a replica round trip wakes the replica's worker
/// and the engine's reader: on a loaded machine this grows with the scheduler's wakeup latency,
/// which is a real cost of the engine too, not an artifact of the probe.
/// With a `placement`, the echo thread runs on its remote CPU and the caller's side on its node
/// CPU (the round trip of a node-confined engine to its remote replica).
fn loopback_rtt_us(placement: Option<Placement>) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let allowed = cpu::allowed();
    if let Some(p) = placement {
        cpu::pin(&[p.remote]);
    }
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = [0u8; 64];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    });
    if let Some(p) = placement {
        cpu::pin(&[p.node]);
    }
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let mut buf = [7u8; 64];
    let mut samples = Vec::with_capacity(20_000);
    for i in 0..21_000 {
        let t = Instant::now();
        c.write_all(&buf).unwrap();
        c.read_exact(&mut buf).unwrap();
        if i >= 1000 {
            samples.push(t.elapsed());
        }
    }
    drop(c);
    echo.join().unwrap();
    if placement.is_some() {
        cpu::pin(&allowed);
    }
    samples.sort();
    samples[samples.len() / 2].as_secs_f64() * 1e6
}

// ----- FUSE + loop ------------------------------------------------------------------------------

fn fuse_skip_reason() -> Option<&'static str> {
    if !nix::unistd::geteuid().is_root() {
        Some("not root")
    } else if !Path::new("/dev/fuse").exists() {
        Some("no /dev/fuse")
    } else {
        None
    }
}

/// Exposes `dev` through FUSE + loop as `name`, runs every job shape `runs` times with fio on the
/// loop device (with the CPU split of each), and detaches. The FUSE server's threads inherit the
/// calling thread's CPU affinity.
fn fio_under_fuse(
    dev: Arc<dyn BlockDevice>,
    runtime_dir: &Path,
    name: &str,
    ws: u64,
    secs: f64,
    runs: usize,
    cpus: Placement,
) -> (Vec<Runs>, Vec<Split>) {
    let mut frontend = FuseLoopFrontend::new(runtime_dir);
    if let Ok(threads) = std::env::var("BLOCK_BENCH_FUSE_THREADS") {
        frontend = frontend.with_threads(threads.parse().expect("BLOCK_BENCH_FUSE_THREADS: a number"));
    }
    let mut att = frontend.attach(dev, name).expect("FUSE + loop attach");
    let (mut results, mut splits) = (Vec::new(), Vec::new());
    for shape in &SHAPES {
        eprintln!("{name}: {}", shape.name);
        let (res, split) = fio_split(att.device(), shape, ws, secs, runs, cpus);
        results.push(res);
        splits.push(split);
    }
    att.detach().unwrap_or_else(|e| panic!("detach {name}: {e}"));
    (results, splits)
}

// ----- rebuilds ---------------------------------------------------------------------------------

struct Rebuilds {
    size: u64,
    raw_copy: Duration,
    full: Duration,
    delta: Duration,
    delta_regions: u64,
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len / 8).flat_map(|_| xorshift(&mut s).to_le_bytes()).collect()
}

fn bench_rebuilds(root: &Path, size: u64) -> Rebuilds {
    // The raw copy: a same-size file of data, copied in 1 MiB pieces (read + write, no fsync,
    // like a rebuild copy, which writes through the target's page cache).
    let src = root.join("copy-src");
    let dst = root.join("copy-dst");
    {
        let mut f = File::create(&src).unwrap();
        for i in 0..size / MIB {
            f.write_all(&pattern(i + 1, MIB as usize)).unwrap();
        }
        // On disk before timing, like the rebuild source (flushed below): no writeback of the
        // source competes with the copy.
        f.sync_all().unwrap();
    }
    let t = Instant::now();
    {
        let mut from = File::open(&src).unwrap();
        let mut to = File::create(&dst).unwrap();
        let mut buf = vec![0u8; MIB as usize];
        loop {
            let n = from.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            to.write_all(&buf[..n]).unwrap();
        }
    }
    let raw_copy = t.elapsed();
    std::fs::remove_file(&src).unwrap();
    std::fs::remove_file(&dst).unwrap();

    // Full rebuild: replica 0 holds the same amount of data at revision 1, replica 1 is fresh
    // (revision 0); a new engine attaches, finds replica 1 behind and copies every region.
    let id = "bench-rebuild";
    let nodes = create_replicas(root, id, size);
    {
        let store = ReplicaStore::open(&nodes[0].join(replica_dir_name(id).unwrap())).unwrap();
        for i in 0..size / MIB {
            store.write(i * MIB, &pattern(i + 1, MIB as usize), 0).unwrap();
        }
        store.flush().unwrap();
        store.set_revision(1).unwrap();
    }
    let state = root.join("rebuild-engine");
    let t = Instant::now();
    let mut cluster = Cluster::start(id, size, nodes, &state, false, None);
    cluster.wait_healthy(2, 1);
    let full = t.elapsed();

    // Delta: replica 1 goes away, 1% of the regions are written, it comes back.
    cluster.stop_replica(1);
    cluster.wait_healthy(1, 1);
    let regions = size / REGION;
    let step = 100;
    let data = pattern(99, REGION as usize);
    let mut delta_regions = 0;
    for r in (0..regions).step_by(step) {
        cluster.volume.write_at(&data, r * REGION).unwrap();
        delta_regions += 1;
    }
    cluster.volume.flush().unwrap();
    let t = Instant::now();
    cluster.start_replica(1);
    cluster.wait_healthy(2, 2);
    let delta = t.elapsed();
    Rebuilds { size, raw_copy, full, delta, delta_regions }
}

// ----- main -------------------------------------------------------------------------------------

/// One row of the verdict table.
struct Goal {
    /// "old" (the goals before the node was confined to its own CPU) or "new" (node-confined).
    set: &'static str,
    what: String,
    target: String,
    got: String,
    met: bool,
    /// Whether the stretch target is met too, for goals that have one.
    stretch: Option<bool>,
}

impl Goal {
    fn new(set: &'static str, what: impl Into<String>, target: impl Into<String>, got: String, met: bool) -> Self {
        Self { set, what: what.into(), target: target.into(), got, met, stretch: None }
    }

    fn verdict(&self) -> &'static str {
        match (self.met, self.stretch) {
            (false, _) => "MISSED",
            (true, Some(true)) => "met, stretch met",
            (true, Some(false)) => "met, stretch missed",
            (true, None) => "met",
        }
    }
}

/// Which parts of the run `BLOCK_BENCH_ONLY` (a comma-separated list of raw, engine, fuse, node, tls,
/// csi, rebuild, group; all when unset) asks for.
fn wants(part: &str) -> bool {
    std::env::var("BLOCK_BENCH_ONLY").map_or(true, |only| only.split(',').any(|p| p.trim() == part))
}

fn medians(runs: &[Runs]) -> Vec<Res> {
    runs.iter().map(Runs::median).collect()
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else to parse.
    let secs = knob_f64("BLOCK_BENCH_SECS", 5.0);
    let runs = knob("BLOCK_BENCH_RUNS", 3).max(1) as usize;
    let ws = knob("BLOCK_BENCH_MIB", 256) * MIB;
    let rebuild_size = knob("BLOCK_BENCH_REBUILD_MIB", 1024) * MIB;
    let base = std::env::var_os("BLOCK_BENCH_DIR").map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
    let tmp = tempfile::Builder::new().prefix("wasmcsi-block-bench.").tempdir_in(&base).expect("bench dir");
    let root = tmp.path();
    let runtime_dir = root.join("run");
    let skip_fuse = fuse_skip_reason();
    let placement = Placement::first_two();
    // For the unconfined columns the per-CPU figures are not shown; any two CPUs do.
    let cpus = placement.unwrap_or(Placement { node: 0, remote: 0 });
    let started = Instant::now();
    eprintln!("block_io: {secs}s per job, {runs} runs each, {} MiB working set, in {}", ws / MIB, root.display());

    let rtt = loopback_rtt_us(None);

    // Raw file: fio, then the runner, on the same prefilled file ((c) reuses it).
    let raw_path = root.join("raw.img");
    File::create(&raw_path).unwrap().set_len(ws).unwrap();
    let raw = DirectFile::open(&raw_path);
    prefill(&raw, ws);
    raw.0.sync_all().unwrap();
    let (mut fio_raw, mut run_raw) = (Vec::new(), Vec::new());
    if wants("raw") || wants("engine") {
        for shape in &SHAPES {
            eprintln!("raw file: {}", shape.name);
            fio_raw.push(Runs::of(runs, || fio::run(&raw_path, shape, ws, secs)));
            run_raw.push(run_job(&raw, shape, ws, secs, runs));
        }
    }
    drop(raw);

    // (c) the same plain file under FUSE + loop.
    let fuse = skip_fuse.is_none() && wants("fuse");
    let (fio_fuse_file, split_c) = if fuse {
        let dev: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(&raw_path).unwrap());
        fio_under_fuse(dev, &runtime_dir, "bench-file", ws, secs, runs, cpus)
    } else {
        Default::default()
    };

    // The node-confined layout: (c') and (e') with the node's side on one CPU, the remote
    // replica server on the other.
    let node = skip_fuse.is_none() && wants("node") && placement.is_some();
    let mut rtt_node = 0.0;
    let (mut fio_node_file, mut split_cn, mut fio_node_local, mut split_en) = Default::default();
    if let (true, Some(p)) = (node, placement) {
        let allowed = cpu::allowed();
        rtt_node = loopback_rtt_us(Some(p));
        cpu::pin(&[p.node]);
        let dev: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(&raw_path).unwrap());
        (fio_node_file, split_cn) = fio_under_fuse(dev, &runtime_dir, "bench-node-file", ws, secs, runs, p);
        cpu::pin(&allowed);
        let id = "bench-io-node";
        let cluster = Cluster::start(id, ws, create_replicas(root, id, ws), &root.join("io-node"), true, Some(p));
        cluster.wait_healthy(2, 0);
        cpu::pin(&[p.node]);
        prefill(&Device(cluster.volume.as_ref()), ws);
        cluster.volume.flush().unwrap();
        (fio_node_local, split_en) =
            fio_under_fuse(cluster.volume.clone(), &runtime_dir, "bench-node-local", ws, secs, runs, p);
        cpu::pin(&allowed);
    }
    std::fs::remove_file(&raw_path).unwrap();

    // The engine: runner on the volume, then (d) the same volume under FUSE + loop.
    let (mut run_engine, mut rtt_engine) = (Vec::new(), 0.0);
    let (mut fio_fuse_engine, mut split_d) = Default::default();
    if wants("engine") || fuse {
        let id = "bench-io";
        let cluster = Cluster::start(id, ws, create_replicas(root, id, ws), &root.join("io-engine"), false, None);
        cluster.wait_healthy(2, 0);
        let vol: &dyn BlockDevice = cluster.volume.as_ref();
        prefill(&Device(vol), ws);
        vol.flush().unwrap();
        if wants("engine") {
            // Again right before the engine's QD1 job: on a shared machine the load, and with it
            // the cost of a thread wakeup, changes over a run. Shown beside the first; the goal
            // keeps the first.
            rtt_engine = loopback_rtt_us(None);
            for shape in &SHAPES {
                eprintln!("engine: {}", shape.name);
                run_engine.push(run_job(&Device(vol), shape, ws, secs, runs));
            }
        }
        if fuse {
            (fio_fuse_engine, split_d) =
                fio_under_fuse(cluster.volume.clone(), &runtime_dir, "bench-engine", ws, secs, runs, cpus);
        }
    }

    // (e) a volume whose local replica is reached in-process, under FUSE + loop.
    let (fio_fuse_local, split_e) = if fuse {
        let id = "bench-io-local";
        let cluster = Cluster::start(id, ws, create_replicas(root, id, ws), &root.join("io-local"), true, None);
        cluster.wait_healthy(2, 0);
        prefill(&Device(cluster.volume.as_ref()), ws);
        cluster.volume.flush().unwrap();
        fio_under_fuse(cluster.volume.clone(), &runtime_dir, "bench-local", ws, secs, runs, cpus)
    } else {
        Default::default()
    };

    // (f) and the CSI timings: the same layout as (e), staged through the CSI socket.
    let csi = (skip_fuse.is_none() && wants("csi"))
        .then(|| csi::run(root, ws, secs, runs, cpus, knob("BLOCK_BENCH_HEAL_MIB", 1024) * MIB));
    let fio_csi = csi.as_ref().map(|c| c.io.clone()).unwrap_or_default();
    let split_f = csi.as_ref().map(|c| c.split.clone()).unwrap_or_default();

    // The engine over mutual TLS against the same engine in plaintext (see `tls.rs`).
    let tls_rows = wants("tls").then(|| tls::run(root, ws, secs, runs));

    // A group snapshot's pause, for groups of 3 and 10 volumes under writers (see `group.rs`).
    let mut groups = (skip_fuse.is_none() && wants("group"))
        .then(|| group::run(root, &[3, 10], knob("BLOCK_BENCH_GROUPS", 30).max(1) as usize));

    let rb = wants("rebuild").then(|| {
        eprintln!("rebuilds: {} MiB volume", rebuild_size / MIB);
        bench_rebuilds(root, rebuild_size)
    });

    // ----- the tables ---------------------------------------------------------------------------
    let all_runs = [&fio_raw, &run_raw, &run_engine, &fio_fuse_file, &fio_fuse_engine, &fio_fuse_local, &fio_csi];
    let [fio_raw_m, run_raw_m, run_engine_m, fio_fuse_file_m, fio_fuse_engine_m, fio_fuse_local_m, fio_csi_m] =
        all_runs.map(|r| medians(r));
    let (fio_node_file_m, fio_node_local_m) = (medians(&fio_node_file), medians(&fio_node_local));
    println!();
    println!(
        "block_io: {secs}s per job, median of {runs} runs each, {} MiB working set, direct I/O; loopback TCP RTT (p50) {rtt:.1} µs at the start, {rtt_engine:.1} µs before the engine jobs; 4k rows in IOPS",
        ws / MIB
    );
    println!(
        "raw = O_DIRECT file; (c) = the same file through FileDevice, buffered (page cache) like the replicas' stores"
    );
    println!("(d) = both replicas over loopback TCP; (e) = replica 0 in-process, replica 1 over TCP");
    println!(
        "(f) = as (e), staged through the CSI socket of a node plugin in this process, replica 1 on a replica node process"
    );
    println!(
        "{:<18} {:>11} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7} {:>11} {:>7} {:>11} {:>7}",
        "job",
        "raw fio",
        "raw runner",
        "engine",
        "eng/raw",
        "(c) FUSE",
        "(d) F+eng",
        "d/c",
        "(e) F+eng+L",
        "e/c",
        "(f) CSI",
        "f/e"
    );
    let over = |x: Option<&Res>, c: Option<&Res>, shape: &Shape| match (x, c) {
        (Some(x), Some(c)) => format!("{:.2}x", x.headline(shape) / c.headline(shape)),
        _ => "-".into(),
    };
    for (i, shape) in SHAPES.iter().enumerate() {
        println!(
            "{:<18} {:>11} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7} {:>11} {:>7} {:>11} {:>7}",
            shape.name,
            Res::fmt_headline(fio_raw_m.get(i), shape),
            Res::fmt_headline(run_raw_m.get(i), shape),
            Res::fmt_headline(run_engine_m.get(i), shape),
            over(run_engine_m.get(i), run_raw_m.get(i), shape),
            Res::fmt_headline(fio_fuse_file_m.get(i), shape),
            Res::fmt_headline(fio_fuse_engine_m.get(i), shape),
            over(fio_fuse_engine_m.get(i), fio_fuse_file_m.get(i), shape),
            Res::fmt_headline(fio_fuse_local_m.get(i), shape),
            over(fio_fuse_local_m.get(i), fio_fuse_file_m.get(i), shape),
            Res::fmt_headline(fio_csi_m.get(i), shape),
            over(fio_csi_m.get(i), fio_fuse_local_m.get(i), shape),
        );
    }
    let lat = |r: Option<&Res>| r.map_or("-".into(), |r| format!("{:.1} µs", r.lat_us));
    println!(
        "{:<18} {:>11} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7} {:>11} {:>7} {:>11}",
        "QD1 write lat",
        lat(fio_raw_m.first()),
        lat(run_raw_m.first()),
        lat(run_engine_m.first()),
        "",
        lat(fio_fuse_file_m.first()),
        lat(fio_fuse_engine_m.first()),
        "",
        lat(fio_fuse_local_m.first()),
        "",
        lat(fio_csi_m.first())
    );
    // How far apart the runs of each job were: a ratio is only as good as the spread of both
    // its sides.
    let spread = |r: &[Runs], i: usize, shape: &Shape| {
        r.get(i).map_or("-".into(), |r| format!("±{:.0}%", r.spread(shape) * 50.0))
    };
    println!("spread over the {runs} runs, ±(max − min)/median / 2:");
    for (i, shape) in SHAPES.iter().enumerate() {
        println!(
            "{:<18} {:>11} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7} {:>11} {:>7} {:>11}",
            shape.name,
            spread(&fio_raw, i, shape),
            spread(&run_raw, i, shape),
            spread(&run_engine, i, shape),
            "",
            spread(&fio_fuse_file, i, shape),
            spread(&fio_fuse_engine, i, shape),
            "",
            spread(&fio_fuse_local, i, shape),
            "",
            spread(&fio_csi, i, shape),
        );
    }
    // Where the throughput goes when every part shares the same cores (fio, loop, FUSE, the
    // engine and both replicas): (d) costs (c) plus the replication, so once both are CPU-bound
    // d/c cannot exceed cpu(c)/cpu(d), shown in the last column.
    let cpu = |r: Option<&Res>| r.map_or("-".into(), |r| format!("{:.1}", r.cpu_us));
    println!(
        "CPU µs per I/O, whole machine; after (d) and (e): cpu(c)/cpu(d) and cpu(c)/cpu(e), the most d/c and e/c can reach where both are CPU-bound (QD32)"
    );
    let bound = |c: Option<&Res>, x: Option<&Res>| match (c, x) {
        (Some(c), Some(x)) => format!("{:.2}x", c.cpu_us / x.cpu_us),
        _ => "-".into(),
    };
    for (i, shape) in SHAPES.iter().enumerate().filter(|(_, s)| s.bs < MIB) {
        println!(
            "{:<18} {:>11} {:>11} {:>11} {:>7} {:>11} {:>11} {:>7} {:>11} {:>7} {:>11}",
            shape.name,
            cpu(fio_raw_m.get(i)),
            cpu(run_raw_m.get(i)),
            cpu(run_engine_m.get(i)),
            "",
            cpu(fio_fuse_file_m.get(i)),
            cpu(fio_fuse_engine_m.get(i)),
            bound(fio_fuse_file_m.get(i), fio_fuse_engine_m.get(i)),
            cpu(fio_fuse_local_m.get(i)),
            bound(fio_fuse_file_m.get(i), fio_fuse_local_m.get(i)),
            cpu(fio_csi_m.get(i)),
        );
    }
    for (i, shape) in SHAPES.iter().enumerate().filter(|(_, s)| s.qd > 1 && s.bs < MIB) {
        for (col, res, split) in [
            ("(c)", fio_fuse_file_m.get(i), split_c.get(i)),
            ("(d)", fio_fuse_engine_m.get(i), split_d.get(i)),
            ("(e)", fio_fuse_local_m.get(i), split_e.get(i)),
            ("(f)", fio_csi_m.get(i), split_f.get(i)),
            ("(c')", fio_node_file_m.get(i), split_cn.get(i)),
            ("(e')", fio_node_local_m.get(i), split_en.get(i)),
        ] {
            let (Some(res), Some(split)) = (res, split) else { continue };
            print_split(col, shape, res, split);
        }
    }

    // The node-confined layout.
    if let (true, Some(p)) = (node, placement) {
        println!();
        println!(
            "node-confined: (c') = (c) and (e') = (e) with fio, the FUSE server, the engine and the local replica on CPU {} \
             and the remote replica server on CPU {}; loopback TCP RTT between them (p50) {rtt_node:.1} µs",
            p.node, p.remote
        );
        println!(
            "  the kernel still runs where it decides: the loop device's workers (an unbound workqueue, any CPU), the \
             receive softirq of a loopback packet mostly on the sending CPU (so the remote replica's inbound frames \
             are processed on the node's CPU and its replies on its own)"
        );
        println!(
            "{:<18} {:>11} {:>11} {:>7} {:>8} {:>8} {:>10} {:>10} {:>9} {:>10} {:>10} {:>9}",
            "job",
            "(c') FUSE",
            "(e') eng+L",
            "e'/c'",
            "±c'",
            "±e'",
            "node c'",
            "node e'",
            "e'-c'",
            "cpu c'",
            "cpu e'",
            "remote e'"
        );
        for (i, shape) in SHAPES.iter().enumerate() {
            let (Some(c), Some(e)) = (fio_node_file_m.get(i), fio_node_local_m.get(i)) else { continue };
            let (sc, se) = (&split_cn[i], &split_en[i]);
            println!(
                "{:<18} {:>11} {:>11} {:>7} {:>8} {:>8} {:>10.1} {:>10.1} {:>9.1} {:>10.1} {:>10.1} {:>9.1}",
                shape.name,
                Res::fmt_headline(Some(c), shape),
                Res::fmt_headline(Some(e), shape),
                over(Some(e), Some(c), shape),
                spread(&fio_node_file, i, shape),
                spread(&fio_node_local, i, shape),
                sc.node_us,
                se.node_us,
                se.node_us - sc.node_us,
                sc.node_cpu,
                se.node_cpu,
                se.remote_cpu,
            );
        }
        println!("{:<18} {:>11} {:>11}", "QD1 write lat", lat(fio_node_file_m.first()), lat(fio_node_local_m.first()));
        println!(
            "  node = µs per I/O of fio's own CPU + this process's threads except the remote replica server's (robust \
             under other tenants' load; the loop device's kernel work is outside it, and about equal in both); \
             cpu = the node CPU's busy time per I/O, remote = the remote CPU's (whole CPUs: other tenants' work counts)"
        );
    }

    if let Some(rb) = &rb {
        let mibs = |d: Duration| rb.size as f64 / MIB as f64 / d.as_secs_f64();
        println!(
            "rebuild of {} MiB: raw copy {:.2} s ({:.0} MiB/s); full rebuild {:.2} s ({:.0} MiB/s); delta ({} of {} regions) {:.3} s",
            rb.size / MIB,
            rb.raw_copy.as_secs_f64(),
            mibs(rb.raw_copy),
            rb.full.as_secs_f64(),
            mibs(rb.full),
            rb.delta_regions,
            rb.size / REGION,
            rb.delta.as_secs_f64()
        );
    }
    if let Some(c) = &csi {
        let (mut create, mut delete) = (c.create.clone(), c.delete.clone());
        println!(
            "through the CSI socket, 3 replicas, {} sequential calls each: CreateVolume p50 {} p99 {}; DeleteVolume p50 {} p99 {}",
            create.len(),
            ms(pct(&mut create, 0.5)),
            ms(pct(&mut create, 0.99)),
            ms(pct(&mut delete, 0.5)),
            ms(pct(&mut delete, 0.99)),
        );
        let h = &c.heal;
        println!(
            "kill -9 of a replica node under a staged {} MiB volume, 3 replicas: healthy again {:.2} s after the kill \
             ({} MiB = 1% written while it was down in {:.2} s; node restarted in {:.2} s; rebuild of {:.1} MiB ran {:.3} s; \
             the rest is the engine's reconnect backoff)",
            h.size / MIB,
            h.total.as_secs_f64(),
            h.written / MIB,
            h.write.as_secs_f64(),
            h.restart.as_secs_f64(),
            h.rebuilt as f64 / MIB as f64,
            h.rebuild.as_secs_f64()
        );
    }
    if let Some(rows) = &mut groups {
        group::print(rows);
    }
    if let Some(why) = skip_fuse {
        println!("(c), (d), (e), (c'), (e') and the CSI part skipped: {why}");
    } else if placement.is_none() && wants("node") {
        println!("(c') and (e') skipped: this process may use only one CPU");
    }

    // ----- goals, judged on the medians ---------------------------------------------------------
    let mut goals = Vec::new();
    let ratio = |x: &[Res], c: &[Res], i: usize| match (x.get(i), c.get(i)) {
        (Some(x), Some(c)) => Some(x.headline(&SHAPES[i]) / c.headline(&SHAPES[i])),
        _ => None,
    };
    for (i, min, why) in
        [(1, 0.5, " (both replicas share one disk: 0.5x is the physical limit)"), (2, 0.8, ""), (3, 0.45, "")]
    {
        if let Some(r) = ratio(&run_engine_m, &run_raw_m, i) {
            let what = format!("engine {}", SHAPES[i].name);
            goals.push(Goal::new("old", what, format!(">= {min:.2}x raw{why}"), format!("{r:.2}x"), r >= min));
        }
    }
    if let (Some(raw), Some(engine)) = (run_raw_m.first(), run_engine_m.first()) {
        let budget = raw.lat_us + 2.0 * rtt + 30.0;
        let target = format!("<= raw + 2 RTT + 30 µs = {budget:.1} µs");
        let got = format!("{:.1} µs", engine.lat_us);
        goals.push(Goal::new("old", "engine QD1 write latency", target, got, engine.lat_us <= budget));
    }
    for (i, shape) in SHAPES.iter().enumerate() {
        for (name, x) in [("(d)", &fio_fuse_engine_m), ("(e)", &fio_fuse_local_m)] {
            if let Some(r) = ratio(x, &fio_fuse_file_m, i) {
                let what = format!("{name}/(c) {}", shape.name);
                goals.push(Goal::new("old", what, ">= 0.80x", format!("{r:.2}x"), r >= 0.8));
            }
        }
    }
    // (f) is (e) with the node plugin around it: it should cost nothing on the I/O path.
    for (i, shape) in SHAPES.iter().enumerate() {
        if let Some(r) = ratio(&fio_csi_m, &fio_fuse_local_m, i) {
            let what = format!("(f)/(e) {}", shape.name);
            goals.push(Goal::new("old", what, ">= 0.85x (within noise)", format!("{r:.2}x"), r >= 0.85));
        }
    }
    if let Some(rb) = &rb {
        let delta_share = rb.delta.as_secs_f64() / rb.full.as_secs_f64();
        let got = format!("{:.1}%", delta_share * 100.0);
        goals.push(Goal::new("old", "delta rebuild (1% missed) / full", "<= 5%", got, delta_share <= 0.05));
        let full_vs_copy = rb.raw_copy.as_secs_f64() / rb.full.as_secs_f64();
        let got = format!("{full_vs_copy:.2}x");
        goals.push(Goal::new("old", "full rebuild speed / raw copy", ">= 0.80x", got, full_vs_copy >= 0.8));
    }
    // The node on its own CPU, fewer CPU µs per replicated write, medians.
    if let Some(r) = ratio(&run_engine_m, &run_raw_m, 3) {
        let target = ">= 0.50x raw (one disk for both replicas: the physical limit)";
        goals.push(Goal::new("new", "engine 1M seq write", target, format!("{r:.2}x"), r >= 0.5));
    }
    for (i, min, stretch) in [(1, 0.7, 0.8), (2, 0.9, 1.0)] {
        if let Some(r) = ratio(&fio_node_local_m, &fio_node_file_m, i) {
            let mut goal = Goal::new(
                "new",
                format!("(e')/(c') {}", SHAPES[i].name),
                format!(">= {min:.2}x (stretch {stretch:.2}x)"),
                format!("{r:.2}x"),
                r >= min,
            );
            goal.stretch = Some(r >= stretch);
            goals.push(goal);
        }
    }
    if let (Some(c), Some(e)) = (fio_node_file_m.first(), fio_node_local_m.first()) {
        let budget = c.lat_us + rtt_node + 20.0;
        let target = format!("<= (c') + 1 RTT + 20 µs = {budget:.1} µs");
        let got = format!("{:.1} µs", e.lat_us);
        goals.push(Goal::new("new", "(e') 4k randwrite QD1 latency", target, got, e.lat_us <= budget));
    }
    if let (Some(c), Some(e)) = (split_cn.get(1), split_en.get(1)) {
        let above = e.node_us - c.node_us;
        let mut goal = Goal::new(
            "new",
            "node CPU per 4k write (QD32), (e') - (c')",
            "<= 4 µs (stretch 2 µs)",
            format!("{above:.1} µs"),
            above <= 4.0,
        );
        goal.stretch = Some(above <= 2.0);
        goals.push(goal);
    }
    println!();
    println!("{:<4} {:<42} {:<62} {:>10}  ", "set", "goal", "target", "result");
    for g in &goals {
        println!("{:<4} {:<42} {:<62} {:>10}  {}", g.set, g.what, g.target, g.got, g.verdict());
    }
    if let Some(t) = &tls_rows {
        tls::print(t);
    }
    println!("(whole run {:.0} s)", started.elapsed().as_secs_f64());
}

/// One line of where a job's CPU went: the machine's total, this process's thread groups, the
/// rest; and the node's robust share (see [`Split::node_us`]).
fn print_split(col: &str, shape: &Shape, res: &Res, split: &Split) {
    let ours: f64 = split.groups.iter().map(|(_, us)| us).sum();
    let parts: Vec<String> = split.groups.iter().map(|(g, us)| format!("{g} {us:.1}")).collect();
    println!(
        "  {col} {}: {:.1} = {} + outside this process (fio, loop, softirq) {:.1}; fio itself {:.1}; node {:.1}",
        shape.name,
        res.cpu_us,
        parts.join(" + "),
        res.cpu_us - ours,
        res.fio_cpu_us,
        split.node_us,
    );
}
