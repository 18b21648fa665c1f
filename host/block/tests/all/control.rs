//! The control surface against real replica servers on loopback: replica sets created,
//! snapshotted, reverted, expanded, cloned and deleted through `wasmcsi_block::control`, with
//! the data checked through replica sessions, the idempotency retries rely on, and the refusals
//! that keep a hand-made change from making a stale replica look current.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use wasmcsi_block::control::{ControlError, ReplicaServerClient, ReplicaSession, ReplicaSet, list_nodes};
use wasmcsi_block::protocol::Status;
use wasmcsi_block::replica::ReplicaServer;

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(5);

struct Nodes {
    servers: Vec<ReplicaServer>,
    _dirs: Vec<tempfile::TempDir>,
}

impl Nodes {
    async fn start(n: usize) -> Self {
        let mut servers = Vec::new();
        let mut dirs = Vec::new();
        for _ in 0..n {
            let dir = tempfile::tempdir().unwrap();
            servers.push(ReplicaServer::bind_plaintext("127.0.0.1:0", dir.path()).await.unwrap());
            dirs.push(dir);
        }
        Self { servers, _dirs: dirs }
    }
    fn addrs(&self) -> Vec<SocketAddr> {
        self.servers.iter().map(ReplicaServer::local_addr).collect()
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i / 4096) as u8).wrapping_mul(31) ^ (i as u8)).collect()
}

/// Writes through a session on every replica, as an engine would, and closes cleanly.
async fn write_all(set: &ReplicaSet, offset: u64, data: &[u8]) {
    let mut sessions = set.open().await.unwrap();
    for s in &mut sessions {
        s.write(offset, data.to_vec()).await.unwrap();
    }
    // A session dropped without its final flush would leave its replica dirty.
    for s in sessions {
        s.close().await.unwrap();
    }
}

async fn read_view(addr: SocketAddr, volume: &str, snapshot: &str, offset: u64, len: u32) -> Vec<u8> {
    let mut s = ReplicaSession::open(addr, volume, T).await.unwrap();
    let data = s.read_snapshot(snapshot, offset, len).await.unwrap();
    s.close().await.unwrap();
    data
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_set_lifecycle_snapshot_revert_expand_clone_delete() {
    let nodes = Nodes::start(3).await;
    let addrs = nodes.addrs();
    let vol = ReplicaSet::new("pvc-ctl", addrs[..2].to_vec(), T);
    vol.create(16 * MIB).await.unwrap();
    vol.create(16 * MIB).await.expect("creating again with the same size is a retry");
    let other = vol.create(32 * MIB).await.expect_err("same id, other size");
    assert_eq!(other.status(), Some(Status::AlreadyExists), "{other}");

    let infos = list_nodes(&addrs, T).await;
    for (i, info) in infos.iter().enumerate() {
        let info = info.as_ref().unwrap();
        assert!(info.capacity > 0 && info.available <= info.capacity);
        let held: Vec<&str> = info.replicas.iter().map(|r| r.volume_id.as_str()).collect();
        assert_eq!(held, if i < 2 { vec!["pvc-ctl"] } else { Vec::<&str>::new() });
    }

    // Snapshot s1 over generation-1 data, overwrite, snapshot s2.
    let one = pattern(1, MIB as usize);
    write_all(&vol, 3 * MIB, &one).await;
    vol.snapshot("s1").await.unwrap();
    vol.snapshot("s1").await.expect("retrying the newest snapshot with nothing written since");
    let two = pattern(2, MIB as usize);
    write_all(&vol, 3 * MIB, &two).await;
    vol.snapshot("s2").await.unwrap();
    let (size, chain) = vol.describe().await.unwrap();
    assert_eq!(size, 16 * MIB);
    assert_eq!(chain.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["s1", "s2"]);
    assert!(chain.iter().all(|s| s.created_ns > 1_600_000_000_000_000_000), "wall-clock creation times");
    for addr in &addrs[..2] {
        assert_eq!(read_view(*addr, "pvc-ctl", "s1", 3 * MIB, MIB as u32).await, one);
        assert_eq!(read_view(*addr, "pvc-ctl", "s2", 3 * MIB, MIB as u32).await, two);
    }

    // Clone s1 onto the third server (and the first): only s1's data arrives.
    let clone = ReplicaSet::new("pvc-clone", vec![addrs[2], addrs[0]], T);
    clone.create(16 * MIB).await.unwrap();
    let mut last = (0, 0);
    clone.clone_from(&vol, "s1", |done, total| last = (done, total)).await.unwrap();
    assert_eq!(last, (MIB, MIB), "progress reports the bytes of the snapshot's extents");
    clone.snapshot("base").await.unwrap();
    for addr in [addrs[2], addrs[0]] {
        assert_eq!(read_view(addr, "pvc-clone", "base", 3 * MIB, MIB as u32).await, one);
        assert_eq!(read_view(addr, "pvc-clone", "base", 0, MIB as u32).await, vec![0; MIB as usize]);
    }
    let missing = clone.clone_from(&vol, "nope", |_, _| {}).await.expect_err("no such snapshot");
    assert!(matches!(missing, ControlError::Invalid(_)), "{missing}");

    // Revert to s1: the volume reads as at s1, s2 is gone.
    vol.revert("s1").await.unwrap();
    let (_, chain) = vol.describe().await.unwrap();
    assert_eq!(chain.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), ["s1"]);
    vol.snapshot("after-revert").await.unwrap();
    assert_eq!(read_view(addrs[1], "pvc-ctl", "after-revert", 3 * MIB, MIB as u32).await, one);

    // Delete a snapshot twice (the retry finds it gone), expand, shrink refused.
    vol.delete_snapshot("s1").await.unwrap();
    vol.delete_snapshot("s1").await.expect("deleting a deleted snapshot is a retry");
    assert_eq!(read_view(addrs[0], "pvc-ctl", "after-revert", 3 * MIB, MIB as u32).await, one);
    vol.expand(32 * MIB).await.unwrap();
    assert_eq!(vol.describe().await.unwrap().0, 32 * MIB);
    assert!(matches!(vol.expand(16 * MIB).await, Err(ControlError::Invalid(_))));

    vol.delete().await.unwrap();
    vol.delete().await.expect("deleting a deleted volume is a retry");
    clone.delete().await.unwrap();
    for info in list_nodes(&addrs, T).await {
        assert!(info.unwrap().replicas.is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_disagree_are_not_changed_by_hand() {
    let nodes = Nodes::start(2).await;
    let addrs = nodes.addrs();
    let vol = ReplicaSet::new("pvc-split", addrs.clone(), T);
    vol.create(8 * MIB).await.unwrap();
    // A snapshot on one replica only: the chains differ.
    let mut lone = ReplicaSession::open(addrs[0], "pvc-split", T).await.unwrap();
    lone.snapshot("only-here").await.unwrap();
    lone.close().await.unwrap();
    match vol.expand(16 * MIB).await {
        Err(ControlError::NotInSync { detail, .. }) => assert!(detail.contains("different snapshots"), "{detail}"),
        other => panic!("expand of a split set: {other:?}"),
    }
    // ...but retrying the snapshot that reached only one replica completes it.
    vol.snapshot("only-here").await.unwrap();
    assert_eq!(vol.describe().await.unwrap().1.len(), 1);

    // A session that ends without its final flush leaves the replica dirty: refused too.
    let crashed = ReplicaSession::open(addrs[1], "pvc-split", T).await.unwrap();
    drop(crashed);
    let deadline = Instant::now() + T;
    loop {
        match vol.snapshot("s2").await {
            Err(ControlError::NotInSync { detail, .. }) if detail.contains("dirty") => break,
            // The server notices the dropped connection asynchronously.
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            other => panic!("snapshot of a set with a dirty replica: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_servers_fail_fast_with_their_address() {
    // A port nothing listens on: bind, learn the port, close.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let started = Instant::now();
    let err =
        ReplicaServerClient::new(dead, Duration::from_millis(500)).node_info().await.expect_err("nothing listens");
    assert!(matches!(err, ControlError::Unreachable { addr, .. } if addr == dead), "{err}");
    assert!(err.to_string().contains(&dead.to_string()));
    assert!(started.elapsed() < Duration::from_secs(5));
    let nodes = Nodes::start(1).await;
    let both = list_nodes(&[nodes.addrs()[0], dead], T).await;
    assert!(both[0].is_ok(), "a dead node does not hide a live one");
    assert!(both[1].is_err());
    let set = ReplicaSet::new("v", vec![nodes.addrs()[0], nodes.addrs()[0]], T);
    assert!(matches!(set.create(MIB).await, Err(ControlError::Invalid(_))), "two replicas on one server");
}
