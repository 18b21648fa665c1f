//! Replicated volumes whose engine reaches its replica servers over real mutual TLS on
//! loopback, with certificates of a CA made for the test: the engine runs with node A's
//! credentials and presents the volume's grant before every session; the servers run in
//! `required` (or `permissive`) mode. Checked: checksummed 4k and large I/O from many threads with
//! byte-identical replicas afterwards; node B's credentials open nothing on a volume granted to
//! A (the replicas' dirty flag and epoch untouched); an engine that holds no grant or an expired
//! one asks for a fresh one and opens its sessions with it; a `permissive` server serving an
//! engine of the version before TLS and a TLS engine at once; credentials rotated on every
//! process while I/O runs, with a server restarted so that new handshakes use the new files.
#![allow(clippy::unwrap_used, reason = "tests")]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use tokio::runtime::Runtime;
use wasmcsi_block::engine::EngineConfig;
use wasmcsi_block::protocol::RecordInfo;
use wasmcsi_block::replica::{NodeIdentity, ReplicaNode, ReplicaServer, ServerConfig};
use wasmcsi_block::transport::Transport;
use wasmcsi_block::volume::{ReplicaEndpoint, ReplicatedVolume, VolumeConfig, VolumeGrant};
use wasmcsi_frontend::BlockDevice;
use wasmcsi_trust::credentials::Credentials;
use wasmcsi_trust::pki::{Authority, DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY, Validity};
use wasmcsi_trust::{Grant, LiveCredentials, Role, Watcher};

const VOLUME: &str = "vol-tls";
const SIZE: u64 = 32 << 20;
const BLOCK: u64 = 4096;
const EPOCH: u64 = 5;
const NODE_A: &str = "node-a";
const NODE_B: &str = "node-b";
const SERVERS: [&str; 2] = ["node-s1", "node-s2"];
const WAIT: Duration = Duration::from_secs(15);

fn engine_config(volume: &str) -> EngineConfig {
    EngineConfig {
        volume_id: volume.into(),
        size: SIZE,
        region_size: 1 << 20,
        request_timeout: 5_000,
        attach_timeout: 5_000,
        rebuild_parallelism: 4,
        epoch: EPOCH,
    }
}

/// The cluster's CA; credentials directories it issued, each followed as it rotates.
struct Pki {
    ca: Authority,
    dirs: Vec<tempfile::TempDir>,
    watchers: Vec<Watcher>,
}

impl Pki {
    fn new() -> Pki {
        let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY)).unwrap();
        Pki { ca, dirs: Vec::new(), watchers: Vec::new() }
    }

    /// Credentials for `role` in a directory of their own, re-read when it changes.
    fn live(&mut self, role: &Role) -> (LiveCredentials, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        self.write(role, dir.path());
        let (live, watcher) = wasmcsi_trust::watch(dir.path(), Duration::from_millis(100)).unwrap();
        let path = dir.path().to_owned();
        self.dirs.push(dir);
        self.watchers.push(watcher);
        (live, path)
    }

    /// A fresh certificate and key for `role` written over `dir` (a rotation).
    fn write(&self, role: &Role, dir: &Path) {
        let issued = self.ca.issue(role, Validity::starting_now(DEFAULT_LEAF_VALIDITY)).unwrap();
        issued.write(dir, &[self.ca.certificate().clone()]).unwrap();
    }
}

/// Replica servers of `SERVERS` holding `volumes` at `EPOCH`, in `mode`.
struct Cluster {
    rt: Runtime,
    pki: Pki,
    controller: LiveCredentials,
    roots: Vec<tempfile::TempDir>,
    servers: Vec<Option<ReplicaServer>>,
    server_dirs: Vec<std::path::PathBuf>,
    server_credentials: Vec<LiveCredentials>,
    addrs: Vec<SocketAddr>,
    state: tempfile::TempDir,
    permissive: bool,
}

impl Cluster {
    fn new(volumes: &[&str], permissive: bool) -> Cluster {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
        let mut pki = Pki::new();
        let (controller, _) = pki.live(&Role::Controller);
        let mut c = Cluster {
            rt,
            pki,
            controller,
            roots: Vec::new(),
            servers: Vec::new(),
            server_dirs: Vec::new(),
            server_credentials: Vec::new(),
            addrs: Vec::new(),
            state: tempfile::tempdir().unwrap(),
            permissive,
        };
        for name in SERVERS {
            let root = tempfile::tempdir().unwrap();
            let node = ReplicaNode::open(root.path()).unwrap();
            for volume in volumes {
                node.create_replica(volume, SIZE).unwrap();
                node.set_record(volume, RecordInfo { version: 1, epoch: EPOCH, data: b"{}".to_vec() }).unwrap();
            }
            drop(node);
            let (credentials, dir) = c.pki.live(&Role::Node(name.into()));
            c.roots.push(root);
            c.server_dirs.push(dir);
            c.server_credentials.push(credentials);
            c.servers.push(None);
            c.addrs.push("127.0.0.1:0".parse().unwrap());
            c.serve(c.servers.len() - 1);
        }
        c
    }

    /// Serves replica server `i` (again, on its old address once it had one).
    fn serve(&mut self, i: usize) {
        let credentials = self.server_credentials[i].clone();
        let transport =
            if self.permissive { Transport::Permissive(credentials) } else { Transport::Required(credentials) };
        let config = ServerConfig {
            identity: NodeIdentity { node: SERVERS[i].into(), labels: Vec::new() },
            transport,
            ..ServerConfig::plaintext()
        };
        let node = Arc::new(ReplicaNode::open(self.roots[i].path()).unwrap());
        let server = self.rt.block_on(ReplicaServer::serve(self.addrs[i], node, config)).unwrap();
        self.addrs[i] = server.local_addr();
        self.servers[i] = Some(server);
    }

    fn stop(&mut self, i: usize) {
        let server = self.servers[i].take().unwrap();
        self.rt.block_on(server.shutdown()).unwrap();
    }

    /// A grant of `volume` to `node` at `EPOCH`, signed by the controller, valid `from..until`.
    fn grant(&self, volume: &str, node: &str, from: SystemTime, until: SystemTime) -> Vec<u8> {
        let grant =
            Grant { volume: volume.into(), node: node.into(), epoch: EPOCH, not_before: from, not_after: until };
        grant.sign(&self.controller.current()).unwrap().encoded
    }

    fn fresh_grant(&self, volume: &str, node: &str) -> Vec<u8> {
        let now = SystemTime::now();
        self.grant(volume, node, now, now + Duration::from_secs(3600))
    }

    /// An engine of `volume` reaching every server over `transport`, presenting `grant`.
    fn volume(&self, volume: &str, transport: Transport, grant: Option<Arc<VolumeGrant>>) -> ReplicatedVolume {
        let replicas = self.addrs.iter().map(|a| ReplicaEndpoint::Remote(*a)).collect();
        let mut config = VolumeConfig::new(engine_config(volume), replicas, self.state.path().join(volume));
        config.transport = transport;
        config.nodes = SERVERS.iter().map(|n| Some((*n).to_owned())).collect();
        config.grant = grant;
        config.backoff_max = Duration::from_millis(500);
        ReplicatedVolume::start(config, self.rt.handle()).unwrap()
    }

    /// Each server's replica of `volume`: (dirty, epoch, open sessions).
    fn replica_state(&self, volume: &str) -> Vec<(bool, u64, usize)> {
        self.servers
            .iter()
            .map(|s| {
                let node = s.as_ref().unwrap().node();
                let (header, record) = node.describe(volume).unwrap();
                (header.dirty, record.epoch, node.replica(volume).map_or(0, |r| r.open_sessions()))
            })
            .collect()
    }

    fn data(&self, i: usize, volume: &str) -> Vec<u8> {
        std::fs::read(self.roots[i].path().join(volume).join(wasmcsi_block::replica::store::DATA_FILE)).unwrap()
    }
}

fn healthy(vol: &ReplicatedVolume) -> bool {
    vol.wait_for(WAIT, |s| s.attached && s.healthy == SERVERS.len())
}

/// Block `b` as written in round `round`: its number and round in every 8 bytes, so a block
/// read back from the wrong place or an old round is told apart.
fn pattern(b: u64, round: u64) -> Vec<u8> {
    (0..BLOCK / 8).flat_map(|i| (b << 40 | round << 20 | i).to_le_bytes()).collect()
}

/// `threads` workers writing and reading back their own blocks until `stop`, every read
/// checked; returns (I/Os done, errors).
fn run_io(
    vol: &Arc<ReplicatedVolume>,
    threads: u64,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<(u64, u64)>> {
    (0..threads)
        .map(|t| {
            let (vol, stop) = (vol.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut done, mut errors) = (0, 0);
                let mut round = 0;
                while !stop.load(Ordering::Relaxed) {
                    round += 1;
                    for k in 0..16 {
                        let b = t * 16 + k;
                        if vol.write_at(&pattern(b, round), b * BLOCK).is_err() {
                            errors += 1;
                        }
                        let mut back = vec![0; BLOCK as usize];
                        if vol.read_at(&mut back, b * BLOCK).is_err() || back != pattern(b, round) {
                            errors += 1;
                        }
                        done += 2;
                    }
                }
                (done, errors)
            })
        })
        .collect()
}

#[test]
fn an_engine_of_node_a_serves_verified_io_over_mutual_tls_with_its_grant() {
    let mut c = Cluster::new(&[VOLUME], false);
    let (node_a, _) = c.pki.live(&Role::Node(NODE_A.into()));
    let grant = Arc::new(VolumeGrant::new(Some(c.fresh_grant(VOLUME, NODE_A))));
    let vol = Arc::new(c.volume(VOLUME, Transport::Required(node_a), Some(grant)));
    assert!(healthy(&vol), "{:?}", vol.status());
    assert!(c.replica_state(VOLUME).iter().all(|&(dirty, epoch, sessions)| dirty && epoch == EPOCH && sessions == 1));

    let stop = Arc::new(AtomicBool::new(false));
    let workers = run_io(&vol, 8, &stop);
    // A large write too: its payload goes to the TLS connection as the shared buffer it is.
    let big: Vec<u8> = (0..(3 << 20)).map(|i: u32| (i % 251) as u8).collect();
    vol.write_at(&big, 16 << 20).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let (done, errors) = workers.into_iter().map(|w| w.join().unwrap()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert_eq!(errors, 0, "{done} I/Os");
    assert!(done > 100, "only {done} I/Os in a second");
    let mut back = vec![0; big.len()];
    vol.read_at(&mut back, 16 << 20).unwrap();
    assert!(back == big, "the large write read back differently");
    vol.flush().unwrap();
    vol.shutdown();
    assert!(vol.wait_for(WAIT, |_| c.replica_state(VOLUME).iter().all(|s| s.2 == 0)));
    assert!(c.data(0, VOLUME) == c.data(1, VOLUME), "the replicas differ");
    c.stop(0);
    c.stop(1);
}

#[test]
fn an_engine_reaching_a_server_that_is_not_the_member_named_connects_nowhere() {
    let c = Cluster::new(&[VOLUME], false);
    let dir = tempfile::tempdir().unwrap();
    c.pki.write(&Role::Node(NODE_A.into()), dir.path());
    let node_a = LiveCredentials::new(Credentials::load(dir.path()).unwrap());
    let grant = Arc::new(VolumeGrant::new(Some(c.fresh_grant(VOLUME, NODE_A))));
    let replicas = c.addrs.iter().map(|a| ReplicaEndpoint::Remote(*a)).collect();
    let mut config = VolumeConfig::new(engine_config(VOLUME), replicas, c.state.path().join("swapped"));
    config.transport = Transport::Required(node_a);
    // The record says the members the other way round: each server is the wrong node.
    config.nodes = vec![Some(SERVERS[1].into()), Some(SERVERS[0].into())];
    config.grant = Some(grant);
    let vol = ReplicatedVolume::start(config, c.rt.handle()).unwrap();
    assert!(!vol.wait_for(Duration::from_secs(2), |s| s.connected > 0), "{:?}", vol.status());
    assert!(c.replica_state(VOLUME).iter().all(|&(dirty, _, sessions)| !dirty && sessions == 0));
    vol.shutdown();
}

#[test]
fn node_b_opens_no_session_on_a_volume_granted_to_node_a_with_or_without_a_s_grant() {
    let mut c = Cluster::new(&[VOLUME], false);
    let (node_b, _) = c.pki.live(&Role::Node(NODE_B.into()));
    let before = c.replica_state(VOLUME);
    assert!(before.iter().all(|&(dirty, epoch, sessions)| !dirty && epoch == EPOCH && sessions == 0));
    let captured = Arc::new(VolumeGrant::new(Some(c.fresh_grant(VOLUME, NODE_A))));
    for grant in [Some(captured), None] {
        let vol = c.volume(VOLUME, Transport::Required(node_b.clone()), grant);
        assert!(!vol.wait_for(Duration::from_secs(2), |s| s.attached || s.connected > 0), "{:?}", vol.status());
        vol.shutdown();
        assert_eq!(c.replica_state(VOLUME), before, "a refused engine changed a replica");
    }
    c.stop(0);
    c.stop(1);
}

#[test]
fn an_engine_with_an_expired_grant_or_none_asks_for_a_fresh_one_and_opens_with_it() {
    let mut c = Cluster::new(&[VOLUME, "vol-none"], false);
    let (node_a, _) = c.pki.live(&Role::Node(NODE_A.into()));
    let long_ago = SystemTime::now() - Duration::from_secs(7200);
    let expired = c.grant(VOLUME, NODE_A, long_ago, long_ago + Duration::from_secs(3600));
    for (volume, held) in [(VOLUME, Some(expired)), ("vol-none", None)] {
        let grant = Arc::new(VolumeGrant::new(held));
        let vol = c.volume(volume, Transport::Required(node_a.clone()), Some(grant.clone()));
        // The connections say they need a fresh grant; the keeper (here: the test) gives one.
        c.rt.block_on(async { tokio::time::timeout(WAIT, grant.fresh_wanted()).await }).unwrap();
        assert!(!vol.status().attached, "attached with {volume}'s expired grant, or none");
        grant.set(c.fresh_grant(volume, NODE_A));
        assert!(healthy(&vol), "{volume}: {:?}", vol.status());
        vol.write_at(&pattern(1, 1), BLOCK).unwrap();
        let mut back = vec![0; BLOCK as usize];
        vol.read_at(&mut back, BLOCK).unwrap();
        assert!(back == pattern(1, 1));
        vol.flush().unwrap();
        vol.shutdown();
    }
    c.stop(0);
    c.stop(1);
}

#[test]
fn a_permissive_server_serves_an_engine_before_tls_and_a_tls_engine_at_once() {
    let mut c = Cluster::new(&["vol-old", "vol-new"], true);
    let (node_a, _) = c.pki.live(&Role::Node(NODE_A.into()));
    let old = Arc::new(c.volume("vol-old", Transport::Plain, None));
    let grant = Arc::new(VolumeGrant::new(Some(c.fresh_grant("vol-new", NODE_A))));
    let new = Arc::new(c.volume("vol-new", Transport::Permissive(node_a), Some(grant)));
    assert!(healthy(&old), "{:?}", old.status());
    assert!(healthy(&new), "{:?}", new.status());
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = run_io(&old, 2, &stop);
    workers.extend(run_io(&new, 2, &stop));
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let errors: u64 = workers.into_iter().map(|w| w.join().unwrap().1).sum();
    assert_eq!(errors, 0);
    old.shutdown();
    new.shutdown();
    c.stop(0);
    c.stop(1);
}

#[test]
fn rotating_every_credential_under_io_loses_no_io() {
    let mut c = Cluster::new(&[VOLUME], false);
    let (node_a, node_a_dir) = c.pki.live(&Role::Node(NODE_A.into()));
    let grant = Arc::new(VolumeGrant::new(Some(c.fresh_grant(VOLUME, NODE_A))));
    let vol = Arc::new(c.volume(VOLUME, Transport::Required(node_a.clone()), Some(grant)));
    assert!(healthy(&vol), "{:?}", vol.status());
    let stop = Arc::new(AtomicBool::new(false));
    let workers = run_io(&vol, 4, &stop);
    let generations =
        || (node_a.generation(), c.server_credentials[0].generation(), c.server_credentials[1].generation());
    let before = generations();
    c.pki.write(&Role::Node(NODE_A.into()), &node_a_dir);
    for (i, name) in SERVERS.iter().enumerate() {
        c.pki.write(&Role::Node((*name).into()), &c.server_dirs[i]);
    }
    let deadline = std::time::Instant::now() + WAIT;
    while {
        let now = generations();
        now.0 == before.0 || now.1 == before.1 || now.2 == before.2
    } {
        assert!(std::time::Instant::now() < deadline, "the rotated credentials were not picked up");
        std::thread::sleep(Duration::from_millis(50));
    }
    // New handshakes with the new files on both sides: server 0 restarts, the engine reconnects
    // (its writes go to server 1 meanwhile, and server 0 is rebuilt).
    c.stop(0);
    std::thread::sleep(Duration::from_millis(300));
    c.serve(0);
    assert!(healthy(&vol), "{:?}", vol.status());
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (done, errors) = workers.into_iter().map(|w| w.join().unwrap()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert_eq!(errors, 0, "{done} I/Os");
    assert!(vol.status().rebuilds_finished >= 1, "server 0 was not rebuilt after it came back: {:?}", vol.status());
    vol.flush().unwrap();
    vol.shutdown();
    assert!(vol.wait_for(WAIT, |_| c.replica_state(VOLUME).iter().all(|s| s.2 == 0)));
    assert!(c.data(0, VOLUME) == c.data(1, VOLUME), "the replicas differ after the rebuild");
    c.stop(0);
    c.stop(1);
}
