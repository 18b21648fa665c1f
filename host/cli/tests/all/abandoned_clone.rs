//! A clone the CO gave up on: CreateVolume from a snapshot (or a volume) answers ABORTED while
//! its copy runs; when the claim is deleted meanwhile the CO never asks again, or deletes the id
//! the name gives. Neither the half-made volume nor the hold on its source may stay: the
//! controller's rounds delete a clone no call named within the deadline, DeleteVolume of its id
//! deletes it at once, and the source snapshot and volume can then be deleted for good.
//!
//! Two hosts in this process (node-a also the controller, rounds every 250 ms, a clone abandoned
//! after 1 s unasked), each with its replica server on loopback; the bundled component. The
//! source holds enough data that its copies outlast the deadline.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use tonic::Code;
use wasmcsi::host::Host;
use wasmcsi_block::catalog::{Catalog, SetView};
use wasmcsi_block::control::ReplicaSet;
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::csi::{Controller, clients};
use crate::support::replicated::{BACKEND, Options};

const MIB: u64 = 1 << 20;
/// The source's size, and how much of it is written (what each clone copies).
const SIZE: u64 = 1024 * MIB;
const WRITTEN: u64 = 768 * MIB;
const ABANDON_AFTER: Duration = Duration::from_secs(1);
const TIMEOUT: Duration = Duration::from_secs(30);
/// The CSI name a set's record keeps (the backend's metadata).
const META_NAME: &str = "csi.name";

fn request(name: &str, source: Option<csi::VolumeContentSource>) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: SIZE as i64, limit_bytes: 0 }),
        volume_capabilities: vec![support::single_node_writer(Some("ext4"))],
        parameters: HashMap::from([
            ("backend".to_string(), BACKEND.to_string()),
            ("numberOfReplicas".to_string(), "2".to_string()),
        ]),
        volume_content_source: source,
        ..Default::default()
    }
}

/// Every set the catalog holds (a listing names no clone: it does not count as asking).
async fn sets(catalog: &Catalog) -> Vec<SetView> {
    catalog.list(None, usize::MAX).await.unwrap()
}

fn named<'a>(all: &'a [SetView], name: &str) -> Option<&'a SetView> {
    all.iter().find(|s| s.record.metadata.get(META_NAME).map(String::as_str) == Some(name))
}

/// Writes `WRITTEN` bytes of a pattern into every replica of set `id`, offline.
async fn fill_source(catalog: &Catalog, id: &str, addrs: &HashMap<String, SocketAddr>) {
    let view = catalog.get(id).await.unwrap().expect("the source set");
    let nodes = view.members.iter().map(|m| addrs[&m.node]).collect();
    let disks = view.members.iter().map(|m| m.disk.clone()).collect();
    let set = ReplicaSet::new(id, nodes, TIMEOUT).with_disks(disks).with_epoch(view.epoch);
    let mut sessions = set.open().await.unwrap();
    let chunk: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
    for s in &mut sessions {
        let mut at = 0;
        while at < WRITTEN {
            s.write(at, chunk.clone()).await.unwrap();
            at += MIB;
        }
    }
    for s in sessions {
        s.close().await.unwrap();
    }
}

/// CreateVolume of a clone: ABORTED while its copy runs, saying how far it is.
async fn started(ctl: &mut Controller, req: &csi::CreateVolumeRequest) -> String {
    let s = ctl.create_volume(req.clone()).await.expect_err("the copy takes a while");
    assert_eq!(s.code(), Code::Aborted, "{s:?}");
    assert!(s.message().contains("being filled"), "{s:?}");
    s.message().to_owned()
}

#[test]
fn a_clone_the_co_gave_up_on_is_deleted_and_its_source_released() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(flow());
}

async fn start(dir: &Path, name: &str, mode: wasmcsi_csi::Mode, nodes_file: &Path) -> Host {
    let options = Options {
        reconcile: Some(Duration::from_millis(250)),
        abandon_clones_after: Some(ABANDON_AFTER),
        ..Default::default()
    };
    support::replicated::host(&dir.join(name), name, mode, nodes_file, options).await
}

async fn flow() {
    let dir = tempfile::tempdir().unwrap();
    let nodes_file = dir.path().join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();
    let a = start(dir.path(), "node-a", wasmcsi_csi::Mode::All, &nodes_file).await;
    let b = start(dir.path(), "node-b", wasmcsi_csi::Mode::Node, &nodes_file).await;
    let addrs: HashMap<String, SocketAddr> = [("node-a", &a), ("node-b", &b)]
        .into_iter()
        .map(|(n, h)| (n.to_string(), h.datapath.as_ref().expect("data path").local_addr()))
        .collect();
    let list: Vec<String> = addrs.values().map(ToString::to_string).collect();
    std::fs::write(&nodes_file, list.join("\n") + "\n").unwrap();
    let catalog = a.registry.get(BACKEND).expect("loaded").block_catalog().expect("a block grant").clone();
    let (mut ctl, _) = clients(&a.socket).await;

    let source = ctl.create_volume(request("pvc-source", None)).await.unwrap().into_inner().volume.unwrap();
    let source_set = source.volume_id.strip_prefix(&format!("{BACKEND}:")).expect("an id of the backend").to_owned();
    fill_source(&catalog, &source_set, &addrs).await;
    let snap = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: source.volume_id.clone(),
            name: "snapshot-source".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();

    // Three clones start copying, and the CO gives up on each: two it never asks about again
    // (one of the snapshot, one of the volume: that one copies from a snapshot of its own),
    // one it deletes by the id its name gives.
    let of_snapshot = Some(support::from_snapshot(&snap.snapshot_id));
    let of_volume = Some(support::from_volume(&source.volume_id));
    let started_at = Instant::now();
    // The clone of the volume first: its snapshot is taken offline, which a copy already
    // reading the volume would refuse (its replicas are open).
    started(&mut ctl, &request("pvc-forgotten-of-volume", of_volume)).await;
    started(&mut ctl, &request("pvc-forgotten", of_snapshot.clone())).await;
    started(&mut ctl, &request("pvc-deleted", of_snapshot.clone())).await;
    let all = sets(&catalog).await;
    let deleted = named(&all, "pvc-deleted").expect("the clone's set");
    assert!(deleted.filling.is_some(), "still copying: {:?}", deleted.filling);
    let deleted_id = format!("{BACKEND}:{}", deleted.id);
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: deleted_id.clone(), ..Default::default() }).await.unwrap();
    assert!(named(&sets(&catalog).await, "pvc-deleted").is_none(), "DeleteVolume removed the copy at once");

    // The rounds delete the two nobody asks about, while they still copy.
    let forgotten = ["pvc-forgotten", "pvc-forgotten-of-volume"];
    let collected = loop {
        let all = sets(&catalog).await;
        if let Some(whole) = forgotten.iter().filter_map(|n| named(&all, n)).find(|s| s.filling.is_none()) {
            panic!("{} finished copying before its deadline: the source must hold more data", whole.id);
        }
        // Deletes that have not finished yet count too.
        let pending = catalog.clones_in_progress().await.unwrap();
        let left: Vec<&SetView> = forgotten.iter().filter_map(|n| named(&pending, n)).collect();
        if left.is_empty() {
            break started_at.elapsed();
        }
        assert!(started_at.elapsed() < Duration::from_secs(60), "not collected: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("abandoned clones collected {collected:?} after they started");
    assert!(collected >= ABANDON_AFTER, "collected before the deadline ({collected:?})");

    // Nothing holds the source any more: its snapshot and then the volume go for good.
    ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id.clone(), ..Default::default() })
        .await
        .unwrap();
    let snapshots = ctl.list_snapshots(csi::ListSnapshotsRequest::default()).await.unwrap().into_inner();
    assert!(snapshots.entries.is_empty(), "no snapshot left (the clone of the volume's own too): {snapshots:?}");
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: source.volume_id.clone(), ..Default::default() })
        .await
        .unwrap();
    let left = sets(&catalog).await;
    assert!(left.is_empty(), "no replica set left, hidden or not: {left:?}");
    // A CO asking for a forgotten clone again now finds its source gone.
    let late = ctl.create_volume(request("pvc-forgotten", of_snapshot)).await.unwrap_err();
    assert_eq!(late.code(), Code::NotFound, "{late:?}");

    for h in [a, b] {
        h.shutdown().await.unwrap();
    }
}
