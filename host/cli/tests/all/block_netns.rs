//! The replicated block data path as separate processes on separate "nodes": every replica server
//! is a real `wasmcsi` process in its own network namespace, joined to the root namespace (where
//! the engine, `wasmcsi volume attach`, runs and exposes the volume as a loop device) by a veth
//! pair with addresses from 10.200.0.0/16. Faults are real: `kill -9` of a replica or of the
//! engine, and a partition (the node's veth link set down inside its namespace).
//!
//! The workload is a checksummed writer/reader on the loop device with `O_DIRECT`: every 4 KiB
//! block carries its index and a generation, a model remembers the last generation written, and
//! every read (during the faults and after) must return exactly the last written block. Replicas
//! are compared offline at the end by opening each replica directory with
//! [`ReplicaStore::open`] and reading the whole volume through it (not by comparing files: the
//! on-disk layout is not this test's business).
//!
//! Root only, with /dev/fuse and `ip`; skipped with a message otherwise. Namespaces, processes,
//! loop devices and FUSE mounts are torn down by drop guards, also when a test panics. No
//! assertion depends on timing; the waits only bound how long a broken build can hang.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::fs::{File, OpenOptions};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use wasmcsi_block::replica::{ReplicaStore, replica_dir_name};

use crate::support;

use support::direct::Aligned;
use support::process::{BIN, Proc};

// ----- every CLI invocation of this file --------------------------------------------------------
//
// The replica CLI is changing shape: from per-directory replicas (`replica create --dir`, then
// `replica serve --dir ROOT`; `volume attach --size`) to node-level servers (`replica serve --root
// DIR --listen ADDR`, replicas created by a control request, `volume create --volume-id V --size S
// --replica ADDR...`, no `--size` on attach). The helpers below are the only places that spell
// the CLI; while both shapes exist they ask the binary's `--help` which one it speaks.

/// Whether `wasmcsi <args> --help` mentions `needle` (cached per question).
fn help_has(args: &[&str], needle: &str) -> bool {
    static CACHE: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());
    let key = format!("{args:?} {needle}");
    if let Some((_, v)) = CACHE.lock().unwrap().iter().find(|(k, _)| *k == key) {
        return *v;
    }
    let out = Command::new(BIN).args(args).arg("--help").output().unwrap();
    let v = String::from_utf8_lossy(&out.stdout).lines().any(|l| l.trim_start().starts_with(needle));
    CACHE.lock().unwrap().push((key, v));
    v
}

/// The per-directory CLI: replicas are created offline, before their server starts.
fn offline_replica_create() -> bool {
    help_has(&["replica"], "create ")
}

/// Where a node keeps the replica of `volume`; opened offline with `ReplicaStore::open`.
fn replica_dir(node_root: &Path, volume: &str) -> PathBuf {
    node_root.join(replica_dir_name(volume).unwrap())
}

fn run_ok(args: &[String]) {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(out.status.success(), "wasmcsi {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Creates the replicas of `volume` on nodes whose servers are not running yet (per-directory
/// CLI only; a no-op when replicas are created through the servers).
fn volume_create_offline(node_roots: &[&Path], volume: &str, size: &str) {
    if !offline_replica_create() {
        return;
    }
    for root in node_roots {
        let dir = replica_dir(root, volume).display().to_string();
        run_ok(&["replica", "create", "--dir", &dir, "--volume-id", volume, "--size", size].map(String::from));
    }
}

/// Creates `volume` through the running replica servers (node-level CLI only).
fn volume_create_online(replicas: &[SocketAddr], volume: &str, size: &str) {
    if offline_replica_create() {
        return;
    }
    let mut args: Vec<String> = ["volume", "create", "--volume-id", volume, "--size", size].map(String::from).to_vec();
    for r in replicas {
        args.extend(["--replica".to_string(), r.to_string()]);
    }
    run_ok(&args);
}

/// The arguments of one node's replica server (run inside the node's namespace by the caller).
/// It prints a line starting with `serving replica` once it listens.
fn replica_serve(node_root: &Path, listen: SocketAddr) -> Vec<String> {
    let flag = if help_has(&["replica", "serve"], "--root") { "--root" } else { "--dir" };
    ["replica", "serve", flag, node_root.to_str().unwrap(), "--listen", &listen.to_string()].map(String::from).to_vec()
}

/// The engine: attaches `volume` over `replicas` as a loop device and stays in the foreground.
/// It prints the device path, then `replicas: H/N healthy, …, R rebuilds finished, …` lines; its
/// log (stderr) has `rebuild started … kind=Delta|Full`.
fn volume_attach(volume: &str, size: &str, replicas: &[SocketAddr], state: &Path, runtime: &Path) -> Vec<String> {
    let mut args: Vec<String> = ["volume", "attach", "--volume-id", volume].map(String::from).to_vec();
    if help_has(&["volume", "attach"], "--size") {
        args.extend(["--size".to_string(), size.to_string()]);
    }
    for r in replicas {
        args.extend(["--replica".to_string(), r.to_string()]);
    }
    args.extend([
        "--state-dir".into(),
        state.display().to_string(),
        "--runtime-dir".into(),
        runtime.display().to_string(),
    ]);
    args
}

/// Parses a `replicas: 2/2 healthy, 2 connected, 1 rebuilds finished, …` line into
/// (healthy, rebuilds finished).
fn parse_status(line: &str) -> Option<(usize, u64)> {
    let rest = line.strip_prefix("replicas: ")?;
    let healthy = rest.split('/').next()?.parse().ok()?;
    let rebuilds = rest.split(", ").find_map(|p| p.strip_suffix(" rebuilds finished"))?.parse().ok()?;
    Some((healthy, rebuilds))
}

// ----- nodes: network namespaces ----------------------------------------------------------------

static SEQ: AtomicUsize = AtomicUsize::new(0);

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip (iproute2)");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A network namespace joined to the root namespace by a veth pair; deleted on drop.
struct Netns {
    name: String,
    host_if: String,
    peer_if: String,
    /// The node's address (inside the namespace).
    addr: Ipv4Addr,
}

impl Netns {
    fn create() -> Self {
        let pid = std::process::id();
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let name = format!("wcsi-{pid}-{seq}");
        // Interface names are at most 15 bytes.
        let host_if = format!("wc{pid:x}h{seq}");
        let peer_if = format!("wc{pid:x}p{seq}");
        // A /30 per pair, from the process id and the sequence number.
        let subnet = (((pid as usize & 0x3ff) << 4) | (seq & 0xf)) * 4;
        let (hi, lo) = (((subnet >> 8) & 0xff) as u8, (subnet & 0xff) as u8);
        let host_addr = Ipv4Addr::new(10, 200, hi, lo + 1);
        let addr = Ipv4Addr::new(10, 200, hi, lo + 2);
        let ns = Self { name, host_if, peer_if, addr };
        ip(&["netns", "add", &ns.name]);
        ip(&["link", "add", &ns.host_if, "type", "veth", "peer", "name", &ns.peer_if]);
        ip(&["link", "set", &ns.peer_if, "netns", &ns.name]);
        ip(&["addr", "add", &format!("{host_addr}/30"), "dev", &ns.host_if]);
        ip(&["link", "set", &ns.host_if, "up"]);
        ip(&["-n", &ns.name, "addr", "add", &format!("{addr}/30"), "dev", &ns.peer_if]);
        ip(&["-n", &ns.name, "link", "set", &ns.peer_if, "up"]);
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// Cuts the node off: its end of the veth pair goes down, inside its namespace.
    fn partition(&self) {
        ip(&["-n", &self.name, "link", "set", &self.peer_if, "down"]);
    }

    fn heal(&self) {
        ip(&["-n", &self.name, "link", "set", &self.peer_if, "up"]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting the namespace destroys its veth end and with it the pair.
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).stderr(Stdio::null()).output();
    }
}

// ----- processes

/// The engine's status lines, as `wasmcsi volume attach` prints them.
trait EngineStatus {
    /// Waits for a status line with `healthy` replicas and at least `rebuilds` finished.
    fn wait_for_status(&mut self, healthy: usize, rebuilds: u64);
}

impl EngineStatus for Proc {
    fn wait_for_status(&mut self, healthy: usize, rebuilds: u64) {
        self.wait_line(&format!("{healthy} healthy, >= {rebuilds} rebuilds"), |l| {
            parse_status(l).is_some_and(|(h, r)| h == healthy && r >= rebuilds)
        });
    }
}

// ----- the engine and what it leaves behind -----------------------------------------------------

/// Loop devices whose backing file is under `runtime_dir`, and FUSE mounts under it: exactly what
/// an engine with that runtime dir may leave when it dies.
fn leftovers(runtime_dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut loops = Vec::new();
    for entry in std::fs::read_dir("/sys/block").unwrap().map_while(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(backing) = std::fs::read_to_string(entry.path().join("loop/backing_file"))
            && Path::new(backing.trim()).starts_with(runtime_dir)
        {
            loops.push(PathBuf::from("/dev").join(name));
        }
    }
    let mut mounts = Vec::new();
    for line in std::fs::read_to_string("/proc/self/mountinfo").unwrap().lines() {
        // Field 5 is the mount point (octal escapes for spaces, which our paths do not have).
        if let Some(point) = line.split(' ').nth(4)
            && Path::new(point).starts_with(runtime_dir)
        {
            mounts.push(PathBuf::from(point));
        }
    }
    (loops, mounts)
}

/// Detaches the loop devices and lazily unmounts the FUSE mounts a dead engine left behind
/// (loop first: it holds the FUSE file open). Returns what it found.
fn clean_leftovers(runtime_dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let (loops, mounts) = leftovers(runtime_dir);
    for dev in &loops {
        let _ = Command::new("losetup").arg("-d").arg(dev).output();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !leftovers(runtime_dir).0.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for m in &mounts {
        let _ = Command::new("umount").arg("-l").arg(m).output();
    }
    (loops, mounts)
}

/// A running `wasmcsi volume attach`. Dropping it stops the process (SIGINT, then SIGKILL) and
/// removes whatever loop device or mount it left.
struct Engine {
    proc: Option<Proc>,
    device: PathBuf,
    runtime_dir: PathBuf,
}

impl Engine {
    fn start(volume: &str, size: &str, replicas: &[SocketAddr], state: &Path, runtime_dir: &Path) -> Self {
        let mut proc = Proc::spawn("engine", None, &volume_attach(volume, size, replicas, state, runtime_dir));
        let device = PathBuf::from(proc.wait_line("with the loop device", |l| l.starts_with("/dev/loop")));
        Self { proc: Some(proc), device, runtime_dir: runtime_dir.to_path_buf() }
    }

    fn proc(&mut self) -> &mut Proc {
        self.proc.as_mut().unwrap()
    }

    /// Detaches cleanly (SIGINT, exit 0).
    fn stop(mut self) {
        self.proc().interrupt();
        let (loops, mounts) = leftovers(&self.runtime_dir);
        assert!(loops.is_empty() && mounts.is_empty(), "a clean detach left {loops:?} {mounts:?}");
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(mut p) = self.proc.take()
            && matches!(p.child.try_wait(), Ok(None))
        {
            let _ = kill(p.pid(), Signal::SIGINT);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(p.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        clean_leftovers(&self.runtime_dir);
    }
}

// ----- a small cluster --------------------------------------------------------------------------

const VOLUME_SIZE: &str = "64M";
const BLOCK: usize = 4096;
/// The workload's blocks: the first 16 MiB of the volume.
const BLOCKS: u64 = 4096;

struct Node {
    ns: Netns,
    root: tempfile::TempDir,
    addr: SocketAddr,
    server: Option<Proc>,
}

/// Replica nodes (each in its namespace) serving one volume, plus the engine's directories.
/// Field order is drop order: the engine goes first, then the servers, then the namespaces.
struct Cluster {
    engine: Option<Engine>,
    nodes: Vec<Node>,
    volume: String,
    state: tempfile::TempDir,
    runtime: tempfile::TempDir,
}

impl Cluster {
    fn new(volume: &str, replicas: usize) -> Self {
        let nodes: Vec<Node> = (0..replicas)
            .map(|_| {
                let ns = Netns::create();
                let addr = SocketAddr::from((ns.addr, 9501));
                Node { ns, root: tempfile::tempdir().unwrap(), addr, server: None }
            })
            .collect();
        let roots: Vec<&Path> = nodes.iter().map(|n| n.root.path()).collect();
        volume_create_offline(&roots, volume, VOLUME_SIZE);
        let mut c = Self {
            engine: None,
            nodes,
            volume: volume.into(),
            state: tempfile::tempdir().unwrap(),
            runtime: tempfile::tempdir().unwrap(),
        };
        for i in 0..replicas {
            c.start_server(i);
        }
        let addrs: Vec<SocketAddr> = c.nodes.iter().map(|n| n.addr).collect();
        volume_create_online(&addrs, volume, VOLUME_SIZE);
        c
    }

    fn start_server(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let args = replica_serve(node.root.path(), node.addr);
        let mut p = Proc::spawn(&format!("replica{i}"), Some(&node.ns.name), &args);
        p.wait_line("serving", |l| l.starts_with("serving replica"));
        node.server = Some(p);
    }

    fn start_engine(&mut self) -> &mut Engine {
        let addrs: Vec<SocketAddr> = self.nodes.iter().map(|n| n.addr).collect();
        let engine = Engine::start(&self.volume, VOLUME_SIZE, &addrs, self.state.path(), self.runtime.path());
        self.engine.insert(engine)
    }

    fn engine(&mut self) -> &mut Engine {
        self.engine.as_mut().unwrap()
    }

    /// Stops every replica server cleanly, then reads each replica offline, whole, through
    /// `ReplicaStore` and asserts they are byte-identical; returns the first one's bytes.
    fn stop_and_compare_replicas(&mut self) -> Vec<u8> {
        for node in &mut self.nodes {
            if let Some(mut p) = node.server.take() {
                p.interrupt();
            }
        }
        let mut first: Option<Vec<u8>> = None;
        for (i, node) in self.nodes.iter().enumerate() {
            let store = ReplicaStore::open(&replica_dir(node.root.path(), &self.volume)).unwrap();
            let size = store.header().size;
            let mut bytes = Vec::with_capacity(size as usize);
            let chunk = 1u64 << 20;
            for off in (0..size).step_by(chunk as usize) {
                bytes.extend(store.read(off, chunk.min(size - off) as u32).unwrap());
            }
            match &first {
                None => first = Some(bytes),
                Some(f) => {
                    let diff = f.iter().zip(&bytes).position(|(a, b)| a != b);
                    assert!(
                        diff.is_none() && f.len() == bytes.len(),
                        "replica {i} differs from replica 0 at byte {diff:?}"
                    );
                }
            }
        }
        first.unwrap()
    }
}

// ----- the checksummed workload -----------------------------------------------------------------

/// The content of `block` at generation `generation` (0: never written, zeros): index and
/// generation in the first 16 bytes, then bytes derived from both.
fn block_content(block: u64, generation: u64) -> Vec<u8> {
    if generation == 0 {
        return vec![0; BLOCK];
    }
    let mut out = Vec::with_capacity(BLOCK);
    out.extend_from_slice(&block.to_le_bytes());
    out.extend_from_slice(&generation.to_le_bytes());
    let mut s = (block << 32) ^ generation ^ 0x9e37_79b9_7f4a_7c15;
    while out.len() < BLOCK {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out
}

/// Says what a wrong block holds, for the failure message.
fn describe_block(data: &[u8]) -> String {
    let b = u64::from_le_bytes(data[..8].try_into().unwrap());
    let g = u64::from_le_bytes(data[8..16].try_into().unwrap());
    if data.iter().all(|&x| x == 0) {
        "zeros".into()
    } else if block_content(b, g) == data {
        format!("block {b} generation {g}")
    } else {
        "garbage".into()
    }
}

/// The loop device opened with `O_DIRECT`, and the model of what each block must hold.
struct Workload {
    dev: File,
    model: Vec<AtomicU64>,
    writes: AtomicU64,
    reads: AtomicU64,
    failures: Mutex<Vec<String>>,
}

impl Workload {
    fn open(device: &Path) -> Arc<Self> {
        Arc::new(Self {
            dev: Self::open_dev(device),
            model: (0..BLOCKS).map(|_| AtomicU64::new(0)).collect(),
            writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            failures: Mutex::new(Vec::new()),
        })
    }

    fn open_dev(device: &Path) -> File {
        OpenOptions::new().read(true).write(true).custom_flags(nix::fcntl::OFlag::O_DIRECT.bits()).open(device).unwrap()
    }

    fn fail(&self, what: String) {
        self.failures.lock().unwrap().push(what);
    }

    fn write(&self, buf: &mut Aligned, block: u64) -> bool {
        let generation = self.model[block as usize].load(Ordering::SeqCst) + 1;
        buf.get().copy_from_slice(&block_content(block, generation));
        if let Err(e) = self.dev.write_all_at(buf.get(), block * BLOCK as u64) {
            self.fail(format!("write of block {block}: {e}"));
            return false;
        }
        self.model[block as usize].store(generation, Ordering::SeqCst);
        self.writes.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Reads `block` and checks it against the model (the caller owns the block: no write to it
    /// is in flight).
    fn check(&self, buf: &mut Aligned, block: u64) -> bool {
        if let Err(e) = self.dev.read_exact_at(buf.get(), block * BLOCK as u64) {
            self.fail(format!("read of block {block}: {e}"));
            return false;
        }
        self.reads.fetch_add(1, Ordering::Relaxed);
        let generation = self.model[block as usize].load(Ordering::SeqCst);
        if buf.get()[..] != block_content(block, generation)[..] {
            let found = describe_block(buf.get());
            self.fail(format!("block {block}: expected generation {generation}, read {found}"));
            return false;
        }
        true
    }

    /// Runs `threads` writers until `stop`: each owns the blocks `b % threads == t`, writes a
    /// new generation of a random one, and every fourth step reads one back and checks it.
    fn run(self: &Arc<Self>, threads: u64, stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
        (0..threads)
            .map(|t| {
                let (w, stop) = (self.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut buf = Aligned::new(BLOCK);
                    let mut rng = 0x2545_f491_4f6c_dd1d_u64 ^ (t + 1);
                    let mut step = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let block = (rng % (BLOCKS / threads)) * threads + t;
                        step += 1;
                        let ok =
                            if step.is_multiple_of(4) { w.check(&mut buf, block) } else { w.write(&mut buf, block) };
                        if !ok {
                            return;
                        }
                    }
                })
            })
            .collect()
    }

    /// Checks every block of the working set.
    fn check_all(&self) {
        let mut buf = Aligned::new(BLOCK);
        for b in 0..BLOCKS {
            self.check(&mut buf, b);
        }
    }

    fn assert_clean(&self) {
        let failures = self.failures.lock().unwrap();
        assert!(
            failures.is_empty(),
            "{} failures, first ones: {:#?}",
            failures.len(),
            &failures[..failures.len().min(10)]
        );
    }

    /// The model: the generation each block must hold.
    fn generations(&self) -> Vec<u64> {
        self.model.iter().map(|g| g.load(Ordering::SeqCst)).collect()
    }
}

/// Asserts the volume's bytes (read from a replica offline) hold exactly `generations`.
fn assert_volume_holds(volume: &[u8], generations: &[u64]) {
    for (b, &generation) in generations.iter().enumerate() {
        let got = &volume[b * BLOCK..(b + 1) * BLOCK];
        assert!(
            got == &block_content(b as u64, generation)[..],
            "replica block {b}: expected generation {generation}, holds {}",
            describe_block(got)
        );
    }
}

/// Waits until the workload has done `n` more writes than `from` (or failed).
fn wait_writes(w: &Workload, from: u64, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while w.writes.load(Ordering::Relaxed) < from + n {
        w.assert_clean();
        assert!(Instant::now() < deadline, "workload made no progress");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn stop_workload(stop: &AtomicBool, threads: Vec<std::thread::JoinHandle<()>>) {
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
}

fn skip_reason() -> Option<String> {
    if let Some(why) = crate::support::needs_root_and_fuse() {
        return Some(why);
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some("ip (iproute2) missing; scripts/setup installs it".into());
    }
    None
}

macro_rules! require_root {
    () => {
        if let Some(why) = skip_reason() {
            eprintln!("skipping: {why}");
            return;
        }
    };
}

// ----- tests ------------------------------------------------------------------------------------

#[test]
fn replica_killed_mid_workload_is_rebuilt_and_no_write_is_lost() {
    require_root!();
    let mut c = Cluster::new("pvc-kill", 2);
    c.start_engine().proc().wait_for_status(2, 0);
    let w = Workload::open(&c.engine().device);
    let stop = Arc::new(AtomicBool::new(false));
    let threads = w.run(4, stop.clone());
    wait_writes(&w, 0, 2000);

    // kill -9 replica 1 while writes are in flight: the volume goes on, degraded.
    c.nodes[1].server.take().unwrap().kill9();
    c.engine().proc().wait_for_status(1, 0);
    let degraded_from = w.writes.load(Ordering::Relaxed);
    wait_writes(&w, degraded_from, 2000);

    // It comes back (same directory, same address) and is rebuilt while writes go on.
    c.start_server(1);
    c.engine().proc().wait_for_status(2, 1);
    wait_writes(&w, w.writes.load(Ordering::Relaxed), 1000);
    stop_workload(&stop, threads);
    w.assert_clean();
    w.check_all();
    w.assert_clean();
    eprintln!("writes {}, reads checked {}", w.writes.load(Ordering::Relaxed), w.reads.load(Ordering::Relaxed));
    let generations = w.generations();
    // The device must be closed before the engine detaches.
    drop(w);

    c.engine.take().unwrap().stop();
    let volume = c.stop_and_compare_replicas();
    assert_volume_holds(&volume, &generations);
}

#[test]
fn partitioned_replica_is_delta_rebuilt_and_never_serves_stale_data() {
    require_root!();
    let mut c = Cluster::new("pvc-part", 2);
    c.start_engine().proc().wait_for_status(2, 0);
    let w = Workload::open(&c.engine().device);
    let stop = Arc::new(AtomicBool::new(false));
    let threads = w.run(4, stop.clone());
    wait_writes(&w, 0, 2000);

    // Cut node 1 off; the engine times it out and goes on with node 0.
    c.nodes[1].ns.partition();
    c.engine().proc().wait_for_status(1, 0);
    let degraded_from = w.writes.load(Ordering::Relaxed);
    wait_writes(&w, degraded_from, 2000);

    // Heal: node 1 reconnects and gets only what it missed.
    c.nodes[1].ns.heal();
    c.engine().proc().wait_for_status(2, 1);
    wait_writes(&w, w.writes.load(Ordering::Relaxed), 1000);
    stop_workload(&stop, threads);
    w.assert_clean();
    c.engine().proc().drain();
    let rebuilds: Vec<&String> =
        c.engine().proc.as_ref().unwrap().seen.iter().filter(|l| l.contains("rebuild started")).collect();
    assert!(!rebuilds.is_empty(), "the engine logged no rebuild");
    assert!(
        rebuilds.iter().all(|l| l.contains("kind=Delta")),
        "the healed replica was not (only) delta-rebuilt: {rebuilds:#?}"
    );

    // Now only the rebuilt replica serves: kill -9 node 0's server and read everything back.
    c.nodes[0].server.take().unwrap().kill9();
    c.engine().proc().wait_for_status(1, 1);
    w.check_all();
    w.assert_clean();
    let generations = w.generations();
    drop(w);
    c.engine.take().unwrap().stop();
    // Node 0 went down last and holds everything too: the replicas still agree.
    let volume = c.stop_and_compare_replicas();
    assert_volume_holds(&volume, &generations);
}

#[test]
fn engine_killed_after_flushed_writes_restarts_with_every_flushed_write() {
    require_root!();
    let mut c = Cluster::new("pvc-engine", 2);
    c.start_engine().proc().wait_for_status(2, 0);
    let device = c.engine().device.clone();
    let w = Workload::open(&device);
    let mut buf = Aligned::new(BLOCK);
    // Two rounds over every third block, each round flushed (fdatasync of the device).
    for _round in 0..2 {
        for b in (0..BLOCKS).step_by(3) {
            assert!(w.write(&mut buf, b));
        }
        w.dev.sync_data().unwrap();
    }
    w.assert_clean();
    drop(w);

    // kill -9 the engine: its FUSE server dies with it, leaving its loop device and mount.
    c.engine().proc().kill9();
    let (loops, mounts) = clean_leftovers(c.runtime.path());
    assert_eq!(loops, vec![device.clone()], "the dead engine's loop device");
    assert_eq!(mounts.len(), 1, "the dead engine's FUSE mount: {mounts:?}");
    assert_eq!(leftovers(c.runtime.path()), (vec![], vec![]), "cleanup left something");
    c.engine = None;

    // A new engine over the same state dir serves every flushed write.
    c.start_engine().proc().wait_for_status(2, 0);
    let w2 = Workload::open(&c.engine().device);
    for b in 0..BLOCKS {
        let generation = if b % 3 == 0 { 2 } else { 0 };
        w2.model[b as usize].store(generation, Ordering::SeqCst);
    }
    w2.check_all();
    w2.assert_clean();
    let generations = w2.generations();
    drop(w2);
    c.engine.take().unwrap().stop();
    let volume = c.stop_and_compare_replicas();
    assert_volume_holds(&volume, &generations);
}
