//! The catalog against real replica servers on loopback, each with a node name and labels: the
//! truth read back from the replicas' records (a fresh catalog finds everything), idempotent
//! creates, publishing and its epoch fence on a live session, offline snapshots and expansion,
//! replacement, clones filled in the background, deletes and leftovers.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use wasmcsi_block::catalog::{Catalog, CatalogError, Location, MemberState, NodeSources, Origin, Placement};
use wasmcsi_block::control::{ControlError, ReplicaSession, ReplicaSet};
use wasmcsi_block::protocol::Status;
use wasmcsi_block::replica::{NodeIdentity, ReplicaDisks, ReplicaNode, ReplicaServer, ServerConfig};

const MIB: u64 = 1 << 20;
const T: Duration = Duration::from_secs(5);

struct Cluster {
    servers: Vec<Option<ReplicaServer>>,
    dirs: Vec<tempfile::TempDir>,
    addrs: Vec<SocketAddr>,
}

impl Cluster {
    async fn start(n: usize) -> Self {
        let mut c = Self { servers: Vec::new(), dirs: Vec::new(), addrs: Vec::new() };
        for i in 0..n {
            let dir = tempfile::tempdir().unwrap();
            let server = serve(dir.path(), i, "127.0.0.1:0").await;
            c.addrs.push(server.local_addr());
            c.servers.push(Some(server));
            c.dirs.push(dir);
        }
        c
    }

    fn catalog(&self) -> Catalog {
        let sources = NodeSources { nodes: self.addrs.iter().map(ToString::to_string).collect(), ..Default::default() };
        Catalog::new(sources, T)
    }

    async fn stop(&mut self, i: usize) {
        self.servers[i].take().unwrap().shutdown().await.unwrap();
    }

    async fn restart(&mut self, i: usize) {
        self.servers[i] = Some(serve(self.dirs[i].path(), i, &self.addrs[i].to_string()).await);
    }
}

async fn serve(root: &std::path::Path, i: usize, addr: &str) -> ReplicaServer {
    let node = Arc::new(ReplicaNode::open(root).unwrap());
    let identity = NodeIdentity { node: format!("n{i}"), labels: vec![("zone".into(), format!("z{}", i % 2))] };
    ReplicaServer::serve(addr, node, ServerConfig { identity, ..ServerConfig::plaintext() }).await.unwrap()
}

/// Replicas on the disk `default` of each node.
fn on_default(v: &[&str]) -> Vec<Location> {
    v.iter().map(|n| Location::on_default(*n)).collect()
}

fn names(v: &[&str]) -> Vec<String> {
    v.iter().map(ToString::to_string).collect()
}

fn meta(k: &str, v: &str) -> BTreeMap<String, String> {
    [(k.to_owned(), v.to_owned())].into()
}

#[tokio::test]
async fn discovery_names_every_node_with_its_labels_and_skips_the_dead() {
    let mut c = Cluster::start(3).await;
    let d = c.catalog().discover().await;
    assert_eq!(d.nodes.keys().cloned().collect::<Vec<_>>(), names(&["n0", "n1", "n2"]));
    assert_eq!(d.nodes["n1"].labels, vec![("zone".to_owned(), "z1".to_owned())]);
    c.stop(2).await;
    let d = c.catalog().discover().await;
    assert_eq!(d.nodes.len(), 2);
    assert_eq!(d.unreachable.len(), 1, "{:?}", d.unreachable);
}

/// A node that is switched off or cut off never answers (no refusal, no reset): here a socket
/// whose connections are accepted by the kernel and never served. It must cost discovery a
/// share of the operation's budget, not all of it, or every operation fails while it is down.
#[tokio::test]
async fn a_node_that_never_answers_costs_a_share_of_the_budget_and_the_rest_is_served() {
    let c = Cluster::start(2).await;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut sources = NodeSources { nodes: c.addrs.iter().map(ToString::to_string).collect(), ..Default::default() };
    sources.nodes.push(silent.local_addr().unwrap().to_string());
    let catalog = Catalog::new(sources, T);
    let started = std::time::Instant::now();
    let d = catalog.discover().await;
    let took = started.elapsed();
    assert_eq!(d.nodes.keys().cloned().collect::<Vec<_>>(), names(&["n0", "n1"]));
    assert_eq!(d.unreachable.len(), 1, "{:?}", d.unreachable);
    assert!(took < T / 2, "discovery waited {took:?} for a silent node (budget {T:?})");
    let v = catalog.create("v-silent", MIB, &names(&["n0", "n1"]), None, BTreeMap::new()).await.unwrap();
    assert_eq!(v.members.len(), 2);
    assert!(catalog.get("v-silent").await.unwrap().is_some(), "served by the nodes that answer");
}

#[tokio::test]
async fn a_created_set_is_found_by_a_fresh_catalog_and_a_retry_is_idempotent() {
    let c = Cluster::start(3).await;
    let created =
        c.catalog().create("vol-a", 4 * MIB, &names(&["n0", "n2"]), None, meta("csi.name", "pvc-ä")).await.unwrap();
    assert_eq!(created.size, 4 * MIB);
    assert!(created.members.iter().all(|m| m.state == MemberState::Healthy), "{:?}", created.members);
    // Another catalog (a controller restarted elsewhere) reads the same truth from the nodes.
    let fresh = c.catalog();
    let found = fresh.get("vol-a").await.unwrap().expect("found");
    assert_eq!(found.record.members, on_default(&["n0", "n2"]));
    assert_eq!(found.record.metadata["csi.name"], "pvc-ä");
    let again = fresh.create("vol-a", 4 * MIB, &names(&["n0", "n2"]), None, meta("csi.name", "pvc-ä")).await.unwrap();
    assert_eq!(again.version, found.version, "a retry changes nothing");
    let other_nodes = fresh.create("vol-a", 4 * MIB, &names(&["n0", "n1"]), None, BTreeMap::new()).await;
    assert!(matches!(other_nodes, Err(CatalogError::AlreadyExists(_))), "{other_nodes:?}");
    let bigger = fresh.create("vol-a", 8 * MIB, &names(&["n0", "n2"]), None, BTreeMap::new()).await;
    assert!(matches!(bigger, Err(CatalogError::AlreadyExists(_))), "{bigger:?}");
    assert!(matches!(
        fresh.create("x", 4097, &names(&["n0"]), None, BTreeMap::new()).await,
        Err(CatalogError::Invalid(_))
    ));
    // A second replica on a node of one disk has nowhere to go.
    let twice = fresh.create("x", 4096, &names(&["n0", "n0"]), None, BTreeMap::new()).await;
    assert!(matches!(&twice, Err(CatalogError::ResourceExhausted(m)) if m.contains("n0")), "{twice:?}");
    let unknown = fresh.create("x", 4096, &names(&["n9"]), None, BTreeMap::new()).await;
    assert!(matches!(unknown, Err(CatalogError::Unavailable(_))), "{unknown:?}");
    let listed: Vec<String> = fresh.list(None, 10).await.unwrap().into_iter().map(|v| v.id).collect();
    assert_eq!(listed, names(&["vol-a"]), "nothing was created by the refused calls");
}

#[tokio::test]
async fn publishing_fences_a_session_that_claimed_the_older_epoch() {
    let c = Cluster::start(2).await;
    let cat = c.catalog();
    cat.create("vol-f", MIB, &names(&["n0", "n1"]), None, BTreeMap::new()).await.unwrap();
    // A node no replica server is on is no node of the cluster: it never becomes the owner.
    let nowhere = cat.claim("vol-f", "n9").await;
    assert!(matches!(&nowhere, Err(CatalogError::NotFound(m)) if m.contains("n9")), "{nowhere:?}");
    cat.claim("vol-f", "n0").await.unwrap();
    cat.claim("vol-f", "n0").await.expect("the same node again is a retry");
    let busy = cat.claim("vol-f", "n1").await;
    assert!(matches!(&busy, Err(CatalogError::FailedPrecondition(m)) if m.contains("n0")), "{busy:?}");
    let info = cat.attach_info("vol-f", "n0").await.unwrap();
    assert!(matches!(cat.attach_info("vol-f", "n1").await, Err(CatalogError::FailedPrecondition(_))));
    // An engine on n0 claims the epoch it was given and writes.
    let mut old = ReplicaSession::open_claimed(c.addrs[1], "vol-f", T, info.epoch).await.unwrap();
    old.write(0, vec![7; 4096]).await.unwrap();
    // The CO declares n0 gone and moves the volume.
    cat.release("vol-f", Some("n0")).await.unwrap();
    cat.claim("vol-f", "n1").await.unwrap();
    let late = old.write(0, vec![9; 4096]).await;
    assert!(matches!(late, Err(ControlError::Refused { status: Status::Fenced, .. })), "{late:?}");
    let stale = ReplicaSession::open_claimed(c.addrs[0], "vol-f", T, info.epoch).await;
    assert!(
        matches!(stale, Err(ControlError::Refused { status: Status::Fenced, .. })),
        "a new session with the old epoch"
    );
    let new = cat.attach_info("vol-f", "n1").await.unwrap();
    assert!(new.epoch > info.epoch);
    let mut s = ReplicaSession::open_claimed(c.addrs[1], "vol-f", T, new.epoch).await.unwrap();
    assert_eq!(s.read(0, 4096).await.unwrap(), vec![7; 4096], "the fenced write never landed");
    s.close().await.unwrap();
    let _ = old.close().await;
    cat.release("vol-f", Some("n0")).await.expect("releasing a node that does not hold it is a no-op");
    assert!(matches!(cat.delete("vol-f").await, Err(CatalogError::FailedPrecondition(_))), "published");
    cat.release("vol-f", None).await.unwrap();
    cat.delete("vol-f").await.unwrap();
    assert!(cat.get("vol-f").await.unwrap().is_none());
}

#[tokio::test]
async fn snapshots_expansion_and_replacement_of_a_detached_set() {
    let c = Cluster::start(3).await;
    let cat = c.catalog();
    cat.create("vol-s", 2 * MIB, &names(&["n0", "n1"]), None, BTreeMap::new()).await.unwrap();
    let set = ReplicaSet::new("vol-s", vec![c.addrs[0], c.addrs[1]], T);
    let mut sessions = set.open().await.unwrap();
    for s in &mut sessions {
        s.write(MIB, vec![3; 4096]).await.unwrap();
    }
    for s in sessions {
        s.close().await.unwrap();
    }
    let snap = cat.snapshot("vol-s", "before").await.unwrap();
    assert_eq!(snap.name, "before");
    assert_eq!(cat.snapshot("vol-s", "before").await.unwrap(), snap, "the same name again");
    let grown = cat.expand("vol-s", 4 * MIB).await.unwrap();
    assert_eq!(grown.size, 4 * MIB);
    assert!(matches!(cat.expand("vol-s", MIB).await, Err(CatalogError::OutOfRange(_))));
    let moved = cat.replace("vol-s", "n1", "n2").await.unwrap();
    assert_eq!(moved.record.members, on_default(&["n0", "n2"]));
    let states: Vec<MemberState> = moved.members.iter().map(|m| m.state).collect();
    assert_eq!(states, vec![MemberState::Healthy, MemberState::Stale], "the new replica waits for its rebuild");
    assert!(moved.members[1].down_since_ns.is_some());
    assert!(cat.replace("vol-s", "n1", "n2").await.is_ok(), "a retry after it went through");
    let snaps = cat.list_snapshots(Some("vol-s")).await.unwrap();
    assert_eq!(snaps.len(), 1);
    cat.delete_snapshot("vol-s", "before").await.unwrap();
    cat.delete_snapshot("vol-s", "before").await.expect("absent is done");
    cat.delete("vol-s").await.unwrap();
    let d = cat.discover().await;
    assert!(d.nodes.values().all(|n| n.replicas.is_empty()), "no replica left anywhere");
}

#[tokio::test]
async fn a_node_down_during_a_replacement_keeps_a_leftover_that_is_collected_when_it_returns() {
    let mut c = Cluster::start(3).await;
    let cat = c.catalog();
    cat.create("vol-l", MIB, &names(&["n0", "n1"]), None, BTreeMap::new()).await.unwrap();
    c.stop(1).await;
    let view = cat.get("vol-l").await.unwrap().unwrap();
    assert_eq!(view.members[1].state, MemberState::Unreachable);
    let since = view.members[1].down_since_ns.expect("down since");
    assert_eq!(cat.get("vol-l").await.unwrap().unwrap().members[1].down_since_ns, Some(since), "the clock keeps");
    cat.replace("vol-l", "n1", "n2").await.unwrap();
    c.restart(1).await;
    let view = cat.get("vol-l").await.unwrap().unwrap();
    assert_eq!(view.leftovers, on_default(&["n1"]));
    assert_eq!(cat.collect("vol-l").await.unwrap(), 1);
    assert!(cat.get("vol-l").await.unwrap().unwrap().leftovers.is_empty());
    // A delete while a member's node is down finishes when it answers again.
    c.stop(2).await;
    let partial = cat.delete("vol-l").await;
    assert!(matches!(partial, Err(CatalogError::Unavailable(_))), "{partial:?}");
    assert!(cat.get("vol-l").await.unwrap().is_none(), "gone for everyone at once");
    c.restart(2).await;
    cat.delete("vol-l").await.unwrap();
    assert!(cat.discover().await.nodes.values().all(|n| n.replicas.is_empty()));
}

#[tokio::test]
async fn a_clone_is_filled_in_the_background_and_reports_its_progress() {
    let c = Cluster::start(2).await;
    let cat = c.catalog();
    cat.create("src", 8 * MIB, &names(&["n0"]), None, BTreeMap::new()).await.unwrap();
    let set = ReplicaSet::new("src", vec![c.addrs[0]], T);
    let mut s = set.open().await.unwrap().pop().unwrap();
    for i in 0..8u64 {
        s.write(i * MIB, vec![i as u8 + 1; MIB as usize]).await.unwrap();
    }
    s.close().await.unwrap();
    let first = cat
        .create("copy", 8 * MIB, &names(&["n1"]), Some(Origin::Volume("src".into())), BTreeMap::new())
        .await
        .unwrap();
    assert!(first.record.fill.is_some());
    assert!(
        matches!(cat.claim("copy", "n1").await, Err(CatalogError::FailedPrecondition(_))),
        "not before it is whole"
    );
    let mut view = first;
    for _ in 0..200 {
        if view.filling.is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        view = cat
            .create("copy", 8 * MIB, &names(&["n1"]), Some(Origin::Volume("src".into())), BTreeMap::new())
            .await
            .unwrap();
    }
    assert!(view.filling.is_none(), "filled: {view:?}");
    let src = cat.get("src").await.unwrap().unwrap();
    assert!(src.snapshots.is_empty(), "the temporary snapshot of the source is gone");
    let mut r = ReplicaSession::open(c.addrs[1], "copy", T).await.unwrap();
    for i in 0..8u64 {
        assert_eq!(r.read(i * MIB, 4096).await.unwrap(), vec![i as u8 + 1; 4096]);
    }
    r.close().await.unwrap();
}

/// A node serving two replica roots: discovery reports both disks with their volumes, a
/// placement names one (or none: the one with the most space), a replica is found on whichever
/// disk holds it, and a disk the node does not have is refused naming it.
#[tokio::test]
async fn a_node_with_two_disks_places_a_replica_on_the_named_one_and_serves_it_there() {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let disks = ReplicaDisks::new(
        Arc::new(ReplicaNode::open(dirs[0].path()).unwrap()),
        vec![("ssd".into(), Arc::new(ReplicaNode::open(dirs[1].path()).unwrap()))],
    )
    .unwrap();
    let identity = NodeIdentity { node: "n0".into(), labels: vec![] };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let two = ReplicaServer::serve_disks_on_listener(
        listener,
        disks,
        ServerConfig { identity, ..ServerConfig::plaintext() },
        None,
    )
    .await
    .unwrap();
    let one = serve(dirs[2].path(), 1, "127.0.0.1:0").await;
    let sources =
        NodeSources { nodes: vec![two.local_addr().to_string(), one.local_addr().to_string()], ..Default::default() };
    let catalog = Catalog::new(sources, T);
    let d = catalog.discover().await;
    let found: Vec<&str> = d.nodes["n0"].disks.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(found, ["default", "ssd"]);
    assert_eq!(d.nodes["n1"].disks.len(), 1);

    let on = |node: &str, disk: Option<&str>| Placement { node: node.into(), disk: disk.map(Into::into) };
    let v = catalog.create_on("vol-d", MIB, &[on("n0", Some("ssd")), on("n1", None)], None, BTreeMap::new()).await;
    let v = v.unwrap();
    assert!(dirs[1].path().join("vol-d/header").exists(), "the replica lives under the ssd root");
    assert!(!dirs[0].path().join("vol-d").exists());
    let disks: Vec<&str> = v.members.iter().map(|m| m.disk.as_str()).collect();
    assert_eq!(disks, ["ssd", "default"]);
    assert!(v.members.iter().all(|m| m.state == MemberState::Healthy), "{:?}", v.members);

    // A session names the replica's disk.
    let set = ReplicaSet::new("vol-d", vec![two.local_addr(), one.local_addr()], T)
        .with_disks(vec!["ssd".into(), "default".into()]);
    let mut sessions = set.open().await.unwrap();
    for s in &mut sessions {
        s.write(0, vec![5; 4096]).await.unwrap();
        s.flush().await.unwrap();
        assert_eq!(s.read(0, 4096).await.unwrap(), vec![5; 4096]);
    }
    for s in sessions {
        s.close().await.unwrap();
    }

    let e = catalog.create_on("vol-e", MIB, &[on("n0", Some("nvme"))], None, BTreeMap::new()).await;
    assert!(matches!(&e, Err(CatalogError::Invalid(m)) if m.contains("nvme") && m.contains("default, ssd")), "{e:?}");
    // Two replicas of one volume on one node, each on its own disk: the unnamed one gets the
    // disk the other did not name.
    let f = catalog.create_on("vol-f", MIB, &[on("n0", Some("ssd")), on("n0", None)], None, BTreeMap::new()).await;
    let f = f.unwrap();
    assert_eq!(f.record.members, [Location::new("n0", "ssd"), Location::new("n0", "default")]);
    assert!(dirs[0].path().join("vol-f/header").exists() && dirs[1].path().join("vol-f/header").exists());
    assert!(f.members.iter().all(|m| m.state == MemberState::Healthy), "{:?}", f.members);
    // Each is its own replica: one written offline leaves the other behind (a revision ahead).
    let ssd_only = ReplicaSet::new("vol-f", vec![two.local_addr()], T).with_disks(vec!["ssd".into()]);
    ssd_only.set_revision(9).await.unwrap();
    let f = catalog.get("vol-f").await.unwrap().unwrap();
    let states: Vec<MemberState> = f.members.iter().map(|m| m.state).collect();
    assert_eq!(states, [MemberState::Healthy, MemberState::Stale]);
    // But never two on one disk, nor more than a node has disks.
    let e =
        catalog.create_on("vol-g", MIB, &[on("n0", Some("ssd")), on("n0", Some("ssd"))], None, BTreeMap::new()).await;
    assert!(matches!(&e, Err(CatalogError::Invalid(_))), "{e:?}");
    let three = [on("n0", None), on("n0", None), on("n0", None)];
    let e = catalog.create_on("vol-h", MIB, &three, None, BTreeMap::new()).await;
    assert!(matches!(&e, Err(CatalogError::ResourceExhausted(m)) if m.contains("n0")), "{e:?}");
    // Deleting removes the replicas on both disks.
    catalog.delete("vol-f").await.unwrap();
    assert!(!dirs[0].path().join("vol-f").exists() && !dirs[1].path().join("vol-f").exists());
    for id in ["vol-e", "vol-f", "vol-g", "vol-h"] {
        assert!(catalog.get(id).await.unwrap().is_none(), "{id}");
    }
}

#[tokio::test]
async fn a_group_snapshot_of_detached_sets_is_all_or_nothing_and_a_retry_finds_it() {
    let c = Cluster::start(2).await;
    let cat = c.catalog();
    let ids = names(&["g-a", "g-b", "g-c"]);
    for id in &ids {
        cat.create(id, 2 * MIB, &names(&["n0", "n1"]), None, BTreeMap::new()).await.unwrap();
    }
    let group = cat.snapshot_group(&ids, "grp").await.unwrap();
    let taken: Vec<&str> =
        group.snapshots.iter().map(|(id, s, _)| (s.name == "grp").then_some(id.as_str()).unwrap()).collect();
    assert_eq!(taken, ["g-a", "g-b", "g-c"], "one snapshot per set, in the order asked");
    assert!(group.held.is_none(), "no set is attached: nothing held");
    let again = cat.snapshot_group(&ids, "grp").await.unwrap();
    assert_eq!(
        again.snapshots.iter().map(|(_, s, _)| s.clone()).collect::<Vec<_>>(),
        group.snapshots.iter().map(|(_, s, _)| s.clone()).collect::<Vec<_>>(),
        "the same name and sets again: the same snapshots"
    );

    // A missing set: nothing taken of the others.
    let with_missing = names(&["g-a", "g-none", "g-c"]);
    assert!(matches!(cat.snapshot_group(&with_missing, "grp2").await, Err(CatalogError::NotFound(_))));
    // A snapshot left alone by an attempt that could not clean up is taken anew with the others.
    cat.snapshot("g-b", "grp3").await.unwrap();
    let redone = cat.snapshot_group(&ids, "grp3").await.unwrap();
    assert_eq!(redone.snapshots.len(), 3);
    for id in &ids {
        let snaps: Vec<String> =
            cat.list_snapshots(Some(id)).await.unwrap().into_iter().map(|(_, s, _)| s.name).collect();
        assert_eq!(snaps, ["grp", "grp3"], "{id}: no grp2 anywhere");
    }
    assert!(matches!(cat.snapshot_group(&names(&["g-a", "g-a"]), "x").await, Err(CatalogError::Invalid(_))));
    assert!(matches!(cat.snapshot_group(&[], "x").await, Err(CatalogError::Invalid(_))));
    for id in &ids {
        cat.delete(id).await.unwrap();
    }
}
