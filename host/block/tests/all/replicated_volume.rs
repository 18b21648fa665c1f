//! The engine's driver end to end over real TCP on 127.0.0.1: replica servers in this process on
//! temp dirs, a `ReplicatedVolume` driven from plain threads like FUSE workers. Checks checksummed
//! 4k round trips from 8 threads with byte-identical replicas afterwards, degraded service when a
//! replica server goes away mid-workload and its rebuild when it returns, and (as root, with
//! /dev/fuse; skipped with a message otherwise) the full kernel path:
//! FUSE + loop, mkfs.ext4, mount, write, unmount, detach, nothing left behind.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;
use wasmcsi_block::engine::{EngineConfig, MAX_REPLICAS};
use wasmcsi_block::replica::store::DATA_FILE;
use wasmcsi_block::replica::{ReplicaNode, ReplicaServer, ReplicaStore};
use wasmcsi_block::volume::{
    InProcessNode, ReplicaEndpoint, ReplicatedVolume, STATE_FILE, VolumeConfig, VolumeError, load_state,
};
use wasmcsi_frontend::BlockDevice;

const VOLUME: &str = "pvc-driver";
const SIZE: u64 = 32 << 20;
const BLOCK: u64 = 4096;
const THREADS: u64 = 8;

/// The engine of every volume these tests start.
fn engine_config() -> EngineConfig {
    EngineConfig {
        volume_id: VOLUME.into(),
        size: SIZE,
        region_size: 1 << 20,
        request_timeout: 5_000,
        attach_timeout: 5_000,
        rebuild_parallelism: 4,
        epoch: 0,
    }
}

struct Cluster {
    rt: Runtime,
    _dirs: Vec<tempfile::TempDir>,
    node_roots: Vec<PathBuf>,
    servers: Vec<Option<ReplicaServer>>,
    addrs: Vec<SocketAddr>,
    state: tempfile::TempDir,
    /// Replica 0's node when the engine reaches it in-process (its TCP server is shut down, so
    /// nothing can reach it another way).
    in_process: Option<Arc<ReplicaNode>>,
}

impl Cluster {
    fn new(replicas: usize) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
        let dirs: Vec<_> = (0..replicas).map(|_| tempfile::tempdir().unwrap()).collect();
        let node_roots: Vec<PathBuf> = dirs.iter().map(|d| d.path().to_path_buf()).collect();
        let servers = node_roots
            .iter()
            .map(|dir| {
                drop(ReplicaStore::create(&dir.join(VOLUME), VOLUME, SIZE).unwrap());
                Some(rt.block_on(ReplicaServer::bind_plaintext("127.0.0.1:0", dir)).unwrap())
            })
            .collect::<Vec<_>>();
        let addrs = servers.iter().map(|s| s.as_ref().map(ReplicaServer::local_addr).unwrap()).collect();
        Self { rt, _dirs: dirs, node_roots, servers, addrs, state: tempfile::tempdir().unwrap(), in_process: None }
    }

    /// Like [`Cluster::new`], with replica 0 on this process's own node: the engine runs its
    /// requests in-process. Its TCP server is shut down first, so the volume can only be whole if
    /// the in-process link works.
    fn with_in_process_replica(replicas: usize) -> Self {
        let mut c = Self::new(replicas);
        let server = c.servers[0].take().unwrap();
        c.in_process = Some(server.node().clone());
        c.rt.block_on(server.shutdown()).unwrap();
        c
    }

    /// Replica 0 is the local one (reads go there) exactly when it is in-process.
    fn driver_config(&self) -> VolumeConfig {
        let replicas = (self.addrs.iter().enumerate())
            .map(|(i, addr)| match (i, &self.in_process) {
                (0, Some(node)) => ReplicaEndpoint::InProcess(InProcessNode { addr: *addr, node: node.clone() }),
                _ => ReplicaEndpoint::Remote(*addr),
            })
            .collect();
        VolumeConfig::new(engine_config(), replicas, self.state.path())
    }

    /// The node holding replica `i`, in this process either way.
    fn node(&self, i: usize) -> &Arc<ReplicaNode> {
        match (i, &self.in_process) {
            (0, Some(node)) => node,
            _ => self.servers[i].as_ref().unwrap().node(),
        }
    }

    /// Waits until no engine session is open on any replica (a stopped driver's links and
    /// connections end in the background), then returns each replica's dirty flag.
    fn dirty_after_sessions_ended(&self) -> Vec<bool> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while (0..self.addrs.len()).any(|i| self.node(i).replica(VOLUME).unwrap().open_sessions() > 0) {
            assert!(Instant::now() < deadline, "engine sessions still open 10 s after shutdown");
            std::thread::sleep(Duration::from_millis(10));
        }
        (0..self.addrs.len()).map(|i| self.node(i).store(VOLUME).unwrap().header().dirty).collect()
    }

    fn volume(&self) -> ReplicatedVolume {
        let vol = ReplicatedVolume::start(self.driver_config(), self.rt.handle()).unwrap();
        let n = self.addrs.len();
        assert!(vol.wait_for(Duration::from_secs(10), |s| s.attached && s.healthy == n), "{:?}", vol.status());
        vol
    }

    fn stop_replica(&mut self, i: usize) {
        let server = self.servers[i].take().unwrap();
        self.rt.block_on(server.shutdown()).unwrap();
    }

    /// Serves replica `i` again on its old address (the driver only knows addresses).
    fn restart_replica(&mut self, i: usize) {
        let server = self.rt.block_on(ReplicaServer::bind_plaintext(self.addrs[i], &self.node_roots[i])).unwrap();
        self.servers[i] = Some(server);
    }

    fn data(&self, i: usize) -> Vec<u8> {
        std::fs::read(self.node_roots[i].join(VOLUME).join(DATA_FILE)).unwrap()
    }
}

/// Each check runs twice, as `<check>::over_tcp` (every replica behind its TCP server) and
/// `<check>::with_an_in_process_replica` (replica 0 reached through its node, see
/// [`Cluster::with_in_process_replica`]): the two links must keep the same rules.
macro_rules! over_tcp_and_in_process {
    ($($check:ident),* $(,)?) => {$(
        mod $check {
            #[test]
            fn over_tcp() {
                super::$check(super::Cluster::new(2));
            }

            #[test]
            fn with_an_in_process_replica() {
                super::$check(super::Cluster::with_in_process_replica(2));
            }
        }
    )*};
}

over_tcp_and_in_process!(
    eight_threads_round_trip_checksummed_blocks_and_replicas_end_byte_identical,
    a_session_with_a_write_after_its_last_flush_leaves_every_replica_dirty,
    requests_submitted_with_completions_are_answered_without_waiting_and_fail_once_the_driver_stopped,
    a_plugged_threads_writes_go_out_at_its_unplug_and_a_blocking_call_is_never_held,
    losing_a_replica_mid_workload_keeps_io_going_every_acknowledged_write_reads_back_and_it_is_rebuilt,
    discard_unmaps_on_every_replica_and_a_degraded_unmap_is_rebuilt,
    online_resize_grows_every_replica_and_the_volume_size_follows,
    snapshots_are_taken_listed_and_deleted_on_every_replica_and_refused_while_degraded,
);

/// xorshift64*: reproducible per-thread randomness without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// One worker: random 4k writes to the blocks it owns (block % THREADS == t, so the checksum
/// model needs no locking), interleaved reads verified against the checksum of the last
/// *acknowledged* write, and flushes. Returns the model for a final verification.
fn worker(vol: &ReplicatedVolume, t: u64, ops: u64, progress: &AtomicU64) -> HashMap<u64, u32> {
    let mut rng = Rng::new(t + 1);
    let blocks = SIZE / BLOCK / THREADS;
    let mut model: HashMap<u64, u32> = HashMap::new();
    let mut buf = vec![0u8; BLOCK as usize];
    for i in 0..ops {
        let block = (rng.next() % blocks) * THREADS + t;
        match rng.next() % 10 {
            0..=5 => {
                rng.fill(&mut buf);
                vol.write_at(&buf, block * BLOCK).unwrap();
                model.insert(block, crc32fast::hash(&buf));
            }
            6..=8 => {
                vol.read_at(&mut buf, block * BLOCK).unwrap();
                let want = model.get(&block).copied().unwrap_or(crc32fast::hash(&[0; BLOCK as usize]));
                assert_eq!(crc32fast::hash(&buf), want, "thread {t} op {i}: block {block} reads back wrong");
            }
            _ => vol.flush().unwrap(),
        }
        progress.fetch_add(1, Ordering::Relaxed);
    }
    model
}

fn verify(vol: &ReplicatedVolume, models: &[HashMap<u64, u32>]) {
    let mut buf = vec![0u8; BLOCK as usize];
    for model in models {
        for (block, crc) in model {
            vol.read_at(&mut buf, block * BLOCK).unwrap();
            assert_eq!(crc32fast::hash(&buf), *crc, "acknowledged write to block {block} lost");
        }
    }
}

fn run_workload(vol: &Arc<ReplicatedVolume>, ops: u64, progress: &Arc<AtomicU64>) -> Vec<HashMap<u64, u32>> {
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (vol, progress) = (vol.clone(), progress.clone());
            std::thread::spawn(move || worker(&vol, t, ops, &progress))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn eight_threads_round_trip_checksummed_blocks_and_replicas_end_byte_identical(cluster: Cluster) {
    let vol = Arc::new(cluster.volume());
    let models = run_workload(&vol, 400, &Arc::new(AtomicU64::new(0)));
    vol.flush().unwrap();
    verify(&vol, &models);

    // Large, unaligned I/O is split into engine-sized pieces and comes back intact.
    let mut big = vec![0u8; (5 << 20) + 123];
    Rng::new(99).fill(&mut big);
    vol.write_at(&big, 7 << 20 | 17).unwrap();
    let mut back = vec![0u8; big.len()];
    vol.read_at(&mut back, 7 << 20 | 17).unwrap();
    assert!(back == big, "large unaligned round trip");
    // Discard reads back as zeros (replicated unmaps).
    vol.discard(8 << 20, 3 << 20).unwrap();
    vol.read_at(&mut back, 7 << 20 | 17).unwrap();
    assert!(back[(1 << 20) - 17..(4 << 20) - 17].iter().all(|b| *b == 0));
    assert!(back[..(1 << 20) - 17] == big[..(1 << 20) - 17]);
    assert!(back[(4 << 20) - 17..] == big[(4 << 20) - 17..]);
    // Out-of-range requests fail without touching anything.
    assert!(vol.read_at(&mut [0; 2], SIZE - 1).is_err());

    vol.flush().unwrap();
    let status = vol.status();
    assert_eq!(status.healthy, 2, "{status:?}");
    vol.shutdown();
    // The session ended with a flush: every replica is marked clean again.
    assert_eq!(cluster.dirty_after_sessions_ended(), [false, false]);
    let (a, b) = (cluster.data(0), cluster.data(1));
    assert_eq!(a.len(), b.len());
    assert!(a == b, "replica data files differ");
    // The engine recorded its attach; the state says nobody is out of sync.
    let state = load_state(cluster.state.path()).unwrap().unwrap();
    assert!(state.missing.is_empty(), "{state:?}");
    assert!(cluster.state.path().join(STATE_FILE).exists());
}

fn a_session_with_a_write_after_its_last_flush_leaves_every_replica_dirty(cluster: Cluster) {
    let vol = cluster.volume();
    vol.write_at(&[3; 4096], 0).unwrap();
    vol.flush().unwrap();
    vol.write_at(&[4; 4096], 4096).unwrap();
    vol.shutdown();
    // The next engine must learn that the replicas may disagree about block 1.
    assert_eq!(cluster.dirty_after_sessions_ended(), [true, true]);
    drop(vol);
    let vol = cluster.volume();
    vol.flush().unwrap();
    vol.shutdown();
    assert_eq!(cluster.dirty_after_sessions_ended(), [false, false]);
}

fn requests_submitted_with_completions_are_answered_without_waiting_and_fail_once_the_driver_stopped(cluster: Cluster) {
    let vol = cluster.volume();
    let (tx, rx) = std::sync::mpsc::channel::<(u64, std::io::Result<u32>)>();
    // One thread keeps 256 writes in flight: no request waits for the one before it.
    let mut want = HashMap::new();
    for i in 0..256u64 {
        let mut buf = vec![0u8; BLOCK as usize];
        Rng::new(i + 7).fill(&mut buf);
        want.insert(i, crc32fast::hash(&buf));
        let tx = tx.clone();
        vol.submit_write(&buf, i * BLOCK, Box::new(move |r| drop(tx.send((i, r.map(|()| 0))))));
    }
    for _ in 0..256 {
        let (i, r) = rx.recv_timeout(Duration::from_secs(10)).expect("a write completion");
        r.unwrap_or_else(|e| panic!("write {i}: {e}"));
    }
    for i in 0..256u64 {
        let tx = tx.clone();
        vol.submit_read(i * BLOCK, BLOCK as usize, Box::new(move |r| drop(tx.send((i, r.map(crc32fast::hash))))));
    }
    for _ in 0..256 {
        let (i, r) = rx.recv_timeout(Duration::from_secs(10)).expect("a read completion");
        assert_eq!(r.unwrap_or_else(|e| panic!("read {i}: {e}")), want[&i], "block {i} reads back wrong");
    }
    // Beyond the end: answered at once, with an error.
    let tx2 = tx.clone();
    vol.submit_write(&[1; 8], SIZE - 4, Box::new(move |r| drop(tx2.send((0, r.map(|()| 0))))));
    assert!(rx.recv_timeout(Duration::from_secs(10)).expect("completion").1.is_err());

    // Once the driver stopped, a completion is still called, with an error: a FUSE request
    // left unanswered would hang the kernel's I/O on it.
    vol.shutdown();
    let stopped = (0..200).any(|_| {
        let tx = tx.clone();
        vol.submit_write(&[1; 4096], 0, Box::new(move |r| drop(tx.send((0, r.map(|()| 0))))));
        let (_, r) = rx.recv_timeout(Duration::from_secs(10)).expect("a completion after shutdown");
        r.is_err() || {
            std::thread::sleep(Duration::from_millis(10));
            false
        }
    });
    assert!(stopped, "requests kept succeeding after shutdown");
}

/// The plug (`wasmcsi_frontend::plug`): what a plugged thread submits with a completion is held
/// (the replica over TCP never sees it, so nothing is acknowledged) until the thread unplugs; a
/// blocking call on that thread is never held, and sends what was held before it.
fn a_plugged_threads_writes_go_out_at_its_unplug_and_a_blocking_call_is_never_held(cluster: Cluster) {
    let mut cfg = cluster.driver_config();
    // The driver's tick sends whatever is held (a bound on how long anything is): none here, so
    // the hold shows.
    cfg.tick = Duration::from_secs(3600);
    let vol = ReplicatedVolume::start(cfg, cluster.rt.handle()).unwrap();
    assert!(vol.wait_for(Duration::from_secs(10), |s| s.attached && s.healthy == 2), "{:?}", vol.status());
    // The attach's own flush is answered to the driver task, and its pass, which is not plugged,
    // sends whatever is held: the hold shows only once nothing is in flight.
    let idle = || {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !vol.is_idle() {
            assert!(Instant::now() < deadline, "the volume never went idle: {:?}", vol.status());
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    idle();
    let block = |i: u64| {
        let mut buf = vec![0u8; BLOCK as usize];
        Rng::new(i + 99).fill(&mut buf);
        buf
    };
    let (tx, rx) = std::sync::mpsc::channel::<(u64, std::io::Result<()>)>();
    let submit = |i: u64| {
        let tx = tx.clone();
        vol.submit_write(&block(i), i * BLOCK, Box::new(move |r| drop(tx.send((i, r)))));
    };
    let completed = |n: usize| {
        for _ in 0..n {
            let (i, r) = rx.recv_timeout(Duration::from_secs(10)).expect("a write completion");
            r.unwrap_or_else(|e| panic!("write {i}: {e}"));
        }
    };
    {
        let _plug = wasmcsi_frontend::Plug::new();
        (0..8).for_each(submit);
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "a write held for the unplug was acknowledged");
        // A blocking write from the plugged thread: not held (it would wait forever), and the
        // eight before it go out with it.
        vol.write_at(&block(8), 8 * BLOCK).unwrap();
        completed(8);
        idle();
        (9..16).for_each(submit);
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "a write held for the unplug was acknowledged");
    }
    vol.unplug();
    completed(7);
    // Nothing is held for an unplugged thread.
    submit(16);
    completed(1);
    for i in 0..17 {
        let mut got = vec![0u8; BLOCK as usize];
        vol.read_at(&mut got, i * BLOCK).unwrap();
        assert!(got == block(i), "block {i} reads back wrong");
    }
    vol.shutdown();
}

#[test]
fn a_volume_with_more_replicas_than_the_engine_counts_is_refused_before_anything_is_created() {
    let rt = Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    // Nothing listens there; a refused volume never connects.
    let replicas = vec![ReplicaEndpoint::Remote("127.0.0.1:9".parse().unwrap()); MAX_REPLICAS + 1];
    let Err(err) = ReplicatedVolume::start(VolumeConfig::new(engine_config(), replicas, &state), rt.handle()) else {
        panic!("a volume of {} replicas started", MAX_REPLICAS + 1);
    };
    assert!(
        matches!(err, VolumeError::TooManyReplicas { count, max } if count == MAX_REPLICAS + 1 && max == MAX_REPLICAS),
        "{err:?}"
    );
    assert!(!state.exists(), "a refused volume leaves no state directory");
}

#[test]
fn a_volume_whose_runtime_shut_down_fails_requests_instead_of_hanging() {
    let cluster = Cluster::new(2);
    let engine_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let vol = Arc::new(
        ReplicatedVolume::start(
            VolumeConfig::new(
                engine_config(),
                cluster.addrs.iter().map(|a| ReplicaEndpoint::Remote(*a)).collect(),
                cluster.state.path(),
            ),
            engine_rt.handle(),
        )
        .unwrap(),
    );
    assert!(vol.wait_for(Duration::from_secs(10), |s| s.attached && s.healthy == 2), "{:?}", vol.status());
    vol.write_at(&[7; 4096], 0).unwrap();
    drop(engine_rt);

    let (tx, rx) = std::sync::mpsc::channel();
    let v = vol.clone();
    std::thread::spawn(move || drop(tx.send(v.write_at(&[8; 4096], 4096))));
    let blocking = rx.recv_timeout(Duration::from_secs(10)).expect("a blocking write answered");
    assert!(blocking.is_err(), "a write acknowledged by a driver that is gone");
    let (tx, rx) = std::sync::mpsc::channel();
    vol.submit_write(&[9; 4096], 8192, Box::new(move |r| drop(tx.send(r))));
    let completed = rx.recv_timeout(Duration::from_secs(10)).expect("a completion called");
    assert!(completed.is_err(), "a write acknowledged by a driver that is gone");
}

fn losing_a_replica_mid_workload_keeps_io_going_every_acknowledged_write_reads_back_and_it_is_rebuilt(
    mut cluster: Cluster,
) {
    let vol = Arc::new(cluster.volume());
    let progress = Arc::new(AtomicU64::new(0));
    let workload = {
        let (vol, progress) = (vol.clone(), progress.clone());
        std::thread::spawn(move || run_workload(&vol, 600, &progress))
    };
    while progress.load(Ordering::Relaxed) < THREADS * 150 {
        // A worker that failed stops counting: report its panic instead of waiting forever.
        if workload.is_finished() {
            workload.join().unwrap();
            panic!("the workload ended before replica 1 was stopped");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    cluster.stop_replica(1);
    let done_at_stop = progress.load(Ordering::Relaxed);
    let models = workload.join().unwrap();
    assert!(done_at_stop < THREADS * 600, "the replica went away before the workload ended");
    assert!(vol.wait_for(Duration::from_secs(5), |s| s.healthy == 1), "{:?}", vol.status());
    vol.flush().unwrap();
    verify(&vol, &models);
    // Degraded: the surviving replica is recorded as the only one in sync, durably.
    let state = load_state(cluster.state.path()).unwrap().unwrap();
    let lacks = state.missing.get(&1).expect("replica 1 recorded as out of sync");
    assert!(!lacks.is_empty(), "{state:?}");
    let status = vol.status();
    assert!(status.connected <= 1, "{status:?}");

    // The replica comes back on the same address: the driver's reconnect finds it, the engine
    // delta-rebuilds it while it stays stale, and afterwards both replicas are byte-identical.
    cluster.restart_replica(1);
    assert!(
        vol.wait_for(Duration::from_secs(20), |s| s.healthy == 2 && s.rebuilds_finished >= 1),
        "{:?}",
        vol.status()
    );
    verify(&vol, &models);
    vol.flush().unwrap();
    vol.shutdown();
    assert!(cluster.data(0) == cluster.data(1), "replica data files differ after the rebuild");
}

fn discard_unmaps_on_every_replica_and_a_degraded_unmap_is_rebuilt(mut cluster: Cluster) {
    let vol = cluster.volume();
    let mut data = vec![0u8; 6 << 20];
    Rng::new(5).fill(&mut data);
    vol.write_at(&data, 1 << 20).unwrap();
    // Larger than one engine unmap piece would be with a small volume; unaligned on both ends.
    vol.discard((2 << 20) + 512, (3 << 20) - 1024).unwrap();
    let mut back = vec![0u8; data.len()];
    vol.read_at(&mut back, 1 << 20).unwrap();
    let (hole_start, hole_end) = ((1 << 20) + 512, (4 << 20) - 512);
    assert!(back[..hole_start] == data[..hole_start]);
    assert!(back[hole_start..hole_end].iter().all(|b| *b == 0), "discarded bytes read as zeros");
    assert!(back[hole_end..] == data[hole_end..]);
    vol.flush().unwrap();

    // Degraded: the unmap is recorded for the missing replica and repaired by its rebuild.
    cluster.stop_replica(1);
    assert!(vol.wait_for(Duration::from_secs(10), |s| s.healthy == 1), "{:?}", vol.status());
    vol.discard(1 << 20, 1 << 20).unwrap();
    vol.flush().unwrap();
    let state = load_state(cluster.state.path()).unwrap().unwrap();
    assert!(state.missing.get(&1).is_some_and(|m| m.is_marked(1)), "{state:?}");
    cluster.restart_replica(1);
    assert!(
        vol.wait_for(Duration::from_secs(20), |s| s.healthy == 2 && s.rebuilds_finished >= 1),
        "{:?}",
        vol.status()
    );
    assert!(vol.status().rebuild.is_none());
    vol.flush().unwrap();
    vol.shutdown();
    assert!(cluster.data(0) == cluster.data(1), "replica data files differ after the rebuild");
    let state = load_state(cluster.state.path()).unwrap().unwrap();
    assert!(state.missing.is_empty(), "{state:?}");
}

fn online_resize_grows_every_replica_and_the_volume_size_follows(cluster: Cluster) {
    let vol = cluster.volume();
    assert_eq!(vol.size(), SIZE);
    assert!(vol.resize(SIZE - 1).is_err(), "volumes never shrink");
    vol.resize(SIZE).unwrap();
    vol.resize(2 * SIZE).unwrap();
    assert_eq!(vol.size(), 2 * SIZE, "size() reflects the growth at once");
    let data = vec![0xab; 8192];
    vol.write_at(&data, 2 * SIZE - 8192).unwrap();
    let mut back = vec![0; 8192];
    vol.read_at(&mut back, 2 * SIZE - 8192).unwrap();
    assert!(back == data);
    vol.flush().unwrap();
    assert_eq!(vol.status().size, 2 * SIZE);
    vol.shutdown();
    drop(vol);
    assert_eq!(cluster.data(0).len() as u64, 2 * SIZE);
    assert!(cluster.data(0) == cluster.data(1));
    // A new engine configured with the old size adopts the replicas' size.
    let vol = cluster.volume();
    assert_eq!(vol.size(), 2 * SIZE);
}

fn snapshots_are_taken_listed_and_deleted_on_every_replica_and_refused_while_degraded(mut cluster: Cluster) {
    let vol = cluster.volume();
    vol.write_at(&[1; 4096], 0).unwrap();
    vol.snapshot("first").unwrap();
    vol.snapshot("first").unwrap();
    vol.write_at(&[2; 4096], 0).unwrap();
    vol.snapshot("second").unwrap();
    let names: Vec<String> = vol.snapshots().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["first", "second"]);
    vol.delete_snapshot("first").unwrap();
    vol.delete_snapshot("first").unwrap();
    let names: Vec<String> = vol.snapshots().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["second"]);

    cluster.stop_replica(1);
    assert!(vol.wait_for(Duration::from_secs(10), |s| s.healthy == 1), "{:?}", vol.status());
    let refused = vol.snapshot("third").unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ResourceBusy, "{refused}");
    cluster.restart_replica(1);
    assert!(vol.wait_for(Duration::from_secs(20), |s| s.healthy == 2), "{:?}", vol.status());
    vol.snapshot("third").unwrap();
    vol.shutdown();
    drop(vol);
    // Attached again, the chain comes from the replicas' headers.
    let vol = cluster.volume();
    let names: Vec<String> = vol.snapshots().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["second", "third"]);
}

fn skip_reason(tools: &[&str]) -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse missing".into());
    }
    tools
        .iter()
        .find(|t| !["/usr/sbin", "/sbin", "/usr/bin", "/bin"].iter().any(|d| Path::new(d).join(t).exists()))
        .map(|t| format!("{t} missing"))
}

#[test]
fn replicated_volume_through_fuse_loop_mkfs_mount_write_and_clean_teardown() {
    use wasmcsi_frontend::mkfs::{self, FsType};
    use wasmcsi_frontend::{Frontend, FuseLoopFrontend};

    if let Some(why) = skip_reason(&["losetup", "mkfs.ext4", "blkid"]) {
        eprintln!("skipping: {why}");
        return;
    }
    let cluster = Cluster::new(2);
    let vol: Arc<dyn BlockDevice> = Arc::new(cluster.volume());
    let runtime_dir = tempfile::tempdir().unwrap();
    let target = tempfile::tempdir().unwrap();
    let mut attached = FuseLoopFrontend::new(runtime_dir.path()).attach(vol, "pvc-driver").unwrap();
    let device = attached.device().to_path_buf();
    mkfs::mkfs(&device, FsType::Ext4).unwrap();
    mkfs::mount(&device, target.path(), "ext4", None).unwrap();
    let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(target.path().join("hello"), &payload).unwrap();
    mkfs::unmount(target.path()).unwrap();
    // Mounted again, the file is there: it went through the replicas, not a cache alone.
    mkfs::mount(&device, target.path(), "ext4", None).unwrap();
    assert!(std::fs::read(target.path().join("hello")).unwrap() == payload);
    mkfs::unmount(target.path()).unwrap();
    attached.detach().unwrap();

    let loops = std::process::Command::new("losetup").arg("-a").output().unwrap();
    let loops = String::from_utf8_lossy(&loops.stdout);
    assert!(!loops.contains(&runtime_dir.path().display().to_string()), "loop device left behind: {loops}");
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for dir in [runtime_dir.path(), target.path()] {
        assert!(!info.contains(&dir.display().to_string()), "mount left behind at {}", dir.display());
    }
    // Both replicas hold the same filesystem image.
    assert!(cluster.data(0) == cluster.data(1), "replica data files differ");
}

/// A replica whose node is gone is replaced by a new, empty one on another server while I/O
/// continues: the engine fully rebuilds it, snapshots included (snapshot-aware rebuild over real
/// TCP), and afterwards the new replica matches the survivor in the head and in every snapshot.
#[test]
fn a_replaced_replica_is_fully_rebuilt_with_its_snapshots() {
    let mut cluster = Cluster::new(2);
    let vol = Arc::new(cluster.volume());
    let mut gen1 = vec![0u8; 4 << 20];
    Rng::new(11).fill(&mut gen1);
    vol.write_at(&gen1, 0).unwrap();
    vol.snapshot("s1").unwrap();
    let mut gen2 = vec![0u8; 2 << 20];
    Rng::new(12).fill(&mut gen2);
    vol.write_at(&gen2, 1 << 20).unwrap();
    vol.flush().unwrap();

    cluster.stop_replica(1);
    assert!(vol.wait_for(Duration::from_secs(10), |s| s.healthy == 1), "{:?}", vol.status());
    let refused = vol.replace_replica(0, cluster.addrs[1], "default");
    assert!(refused.is_err(), "two replicas of one volume on one server");
    let refused = vol.replace_replica(0, "127.0.0.1:9".parse().unwrap(), "default");
    assert!(refused.is_err(), "replacing the only healthy replica would lose the volume");

    // The new node: an empty replica created through the control surface.
    let new_root = tempfile::tempdir().unwrap();
    let server = cluster.rt.block_on(ReplicaServer::bind_plaintext("127.0.0.1:0", new_root.path())).unwrap();
    let new_addr = server.local_addr();
    cluster
        .rt
        .block_on(
            wasmcsi_block::control::ReplicaServerClient::new(new_addr, Duration::from_secs(5))
                .create_replica(VOLUME, SIZE),
        )
        .unwrap();
    vol.replace_replica(1, new_addr, "default").unwrap();
    // Writes go on during the rebuild.
    let writer = {
        let vol = vol.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            for i in 0..64u64 {
                Rng::new(100 + i).fill(&mut buf);
                vol.write_at(&buf, (8 << 20) + i * (64 << 10)).unwrap();
            }
            vol.flush().unwrap();
        })
    };
    writer.join().unwrap();
    assert!(
        vol.wait_for(Duration::from_secs(30), |s| s.healthy == 2 && s.rebuilds_finished >= 1),
        "{:?}",
        vol.status()
    );
    vol.flush().unwrap();
    vol.shutdown();
    drop(vol);
    cluster.rt.block_on(server.shutdown()).unwrap();
    cluster.stop_replica(0);

    let old = ReplicaStore::open(&cluster.node_roots[0].join(VOLUME)).unwrap();
    let new = ReplicaStore::open(&new_root.path().join(VOLUME)).unwrap();
    let names = |s: &ReplicaStore| s.header().snapshots.into_iter().map(|s| s.name).collect::<Vec<_>>();
    assert_eq!(names(&new), ["s1"], "the snapshot was rebuilt too");
    assert_eq!(names(&old), names(&new));
    for offset in (0..SIZE).step_by(4 << 20) {
        let head_old = old.read(offset, 4 << 20).unwrap();
        assert!(head_old == new.read(offset, 4 << 20).unwrap(), "head differs at {offset}");
        let snap_old = old.read_snapshot("s1", offset, 4 << 20).unwrap();
        assert!(snap_old == new.read_snapshot("s1", offset, 4 << 20).unwrap(), "s1 differs at {offset}");
        if offset == 0 {
            assert!(snap_old == gen1, "s1 holds the data from before it");
        }
    }
}

/// Makes replica 1 hold different bytes at `offset` than replica 0, the way an engine crash with
/// a write in flight can: written straight through a replica session at the current revision,
/// and the session dropped without `close()` and without a final flush, so the replica stays
/// dirty (a session whose last request was a flush counts as a clean end).
fn diverge_replica_1(c: &Cluster, offset: u64, data: Vec<u8>) {
    c.rt.block_on(async {
        let mut s = wasmcsi_block::control::ReplicaSession::open(c.addrs[1], VOLUME, Duration::from_secs(5)).await?;
        s.write(offset, data).await?;
        drop(s);
        Ok::<(), wasmcsi_block::control::ControlError>(())
    })
    .unwrap();
}

/// Attaches over replicas that differ at `offset` after an unclean end, waits for the resync,
/// and checks that both replicas are byte-identical and every read of the block agrees.
fn attach_and_check_resync(c: &Cluster, offset: u64, outcomes: [&[u8]; 2]) {
    let vol = c.volume();
    assert!(
        vol.wait_for(Duration::from_secs(20), |s| s.healthy == 2 && s.rebuild.is_none() && s.rebuilds_finished >= 1),
        "the resync ran and finished: {:?}",
        vol.status()
    );
    let mut first = vec![0; BLOCK as usize];
    vol.read_at(&mut first, offset).unwrap();
    assert!(outcomes.contains(&first.as_slice()), "the block holds one of the two outcomes");
    // Reads are spread over the replicas; without the resync they would alternate.
    for _ in 0..32 {
        let mut again = vec![0; BLOCK as usize];
        vol.read_at(&mut again, offset).unwrap();
        assert!(again == first, "the same block read differently");
    }
    vol.flush().unwrap();
    drop(vol);
    std::thread::sleep(Duration::from_millis(200));
    assert!(c.data(0) == c.data(1), "replicas are byte-identical after the resync");
}

#[test]
fn replicas_diverged_by_an_unclean_end_are_resynced_from_the_intent_map() {
    let c = Cluster::new(2);
    let offset = 5 * (1 << 20) + 3 * BLOCK;
    let (old, new) = (vec![0xaa; BLOCK as usize], vec![0x55; BLOCK as usize]);
    {
        // The engine writes the block and stops without the two flushes that would clear its
        // region from the intent map: the persisted state marks it as suspect.
        let vol = c.volume();
        vol.write_at(&old, offset).unwrap();
        drop(vol);
        std::thread::sleep(Duration::from_millis(200));
    }
    let state = load_state(c.state.path()).unwrap().unwrap();
    assert!(state.intent.as_ref().is_some_and(|m| m.is_marked(offset >> 20)), "{:?}", state.intent);
    diverge_replica_1(&c, offset, new.clone());
    std::thread::sleep(Duration::from_millis(200));
    assert!(c.data(0) != c.data(1));
    attach_and_check_resync(&c, offset, [&old, &new]);
}

#[test]
fn replicas_diverged_by_an_unclean_end_are_fully_resynced_without_a_state_file() {
    let c = Cluster::new(2);
    let offset = 9 * (1 << 20);
    let (old, new) = (vec![0x11; BLOCK as usize], vec![0x22; BLOCK as usize]);
    {
        let vol = c.volume();
        vol.write_at(&old, offset).unwrap();
        vol.flush().unwrap();
        drop(vol);
        std::thread::sleep(Duration::from_millis(200));
    }
    diverge_replica_1(&c, offset, new.clone());
    // Without a state file nothing says which regions are suspect: everything is copied.
    std::fs::remove_file(c.state.path().join(STATE_FILE)).unwrap();
    attach_and_check_resync(&c, offset, [&old, &new]);
}
