//! VolumeGroupSnapshots of the replicated-block backend end to end through the CSI socket: three
//! hosts in this process (node-a also the controller), three raw block volumes of two replicas,
//! attached on two nodes (two on node-b, one on node-c). A writer writes one numbered sequence
//! across them — record `i` to volume `i % 3` at slot `i / 3`, each made durable before the next
//! is written — while CreateVolumeGroupSnapshot runs. Every volume restored from the group holds
//! a prefix of the sequence: never a record without every earlier one (crash consistency across
//! volumes and nodes). Then: a retry answers the same group, Get finds it, every member is an
//! ordinary snapshot, a missing source is NOT_FOUND with nothing left, Delete removes it.
//!
//! Skipped (saying why) when not root or without /dev/fuse.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tonic::Code;
use wasmcsi::host::Host;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::group_controller_client::GroupControllerClient;
use wasmcsi_proto::csi::v1::identity_client::IdentityClient;

use crate::support;
use crate::support::csi::{
    Controller, Node, Paths, clients, controller_publish as publish_to, controller_unpublish as unpublish_from,
    mounts_under, publish_at, stage_request, unpublish_and_unstage,
};
use crate::support::replicated::{BACKEND, Options};

const MIB: i64 = 1 << 20;
const SIZE: i64 = 16 * MIB;
const RECORD: usize = 4096;
/// Marks a record as one of the writer's (a restored volume's zeroes are none).
const MAGIC: &[u8; 8] = b"wcsigrp1";

fn block_cap() -> csi::VolumeCapability {
    support::single_node_writer(None)
}

fn params() -> HashMap<String, String> {
    [("backend", BACKEND), ("numberOfReplicas", "2")]
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

fn create_request(name: &str) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: SIZE, limit_bytes: 0 }),
        volume_capabilities: vec![block_cap()],
        parameters: params(),
        ..Default::default()
    }
}

async fn three_nodes(dir: &Path) -> [Host; 3] {
    let nodes_file = dir.join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();
    let start = |name: &'static str, mode| {
        let (home, nodes_file) = (dir.join(name), nodes_file.clone());
        async move { support::replicated::host(&home, name, mode, &nodes_file, Options::default()).await }
    };
    let a = start("node-a", wasmcsi_csi::Mode::All).await;
    let b = start("node-b", wasmcsi_csi::Mode::Node).await;
    let c = start("node-c", wasmcsi_csi::Mode::Node).await;
    support::replicated::list_replica_nodes(&nodes_file, &[&a, &b, &c]);
    [a, b, c]
}

/// A raw block volume published, staged and published on `node_id`: its device.
async fn attach(ctl: &mut Controller, node: &Node, v: &csi::Volume, node_id: &str, dir: &Path, pod: &str) -> Paths {
    let ctx = publish_to(ctl, v, node_id, &block_cap()).await.unwrap();
    let p = Paths {
        staging: dir.join(node_id).join("kubelet/staging").join(pod),
        target: dir.join(node_id).join("kubelet/pods").join(pod).join("dev"),
    };
    node.clone().node_stage_volume(stage_request(v, &ctx, &p, &block_cap())).await.unwrap();
    publish_at(&mut node.clone(), v, &ctx, &p, &block_cap()).await;
    p
}

async fn detach(ctl: &mut Controller, node: &Node, v: &csi::Volume, node_id: &str, p: &Paths) {
    unpublish_and_unstage(&mut node.clone(), v, p).await;
    unpublish_from(ctl, v, node_id).await;
}

fn record(i: u64) -> Vec<u8> {
    let mut r = vec![0u8; RECORD];
    r[..8].copy_from_slice(MAGIC);
    r[8..16].copy_from_slice(&i.to_le_bytes());
    r
}

/// Writes record after record across `devices` until `stop`; each is durable (written back
/// and flushed to the volume) before the next starts. Returns how many were written.
fn write_sequence(devices: Vec<PathBuf>, stop: Arc<AtomicBool>) -> u64 {
    let files: Vec<std::fs::File> =
        devices.iter().map(|d| std::fs::OpenOptions::new().write(true).open(d).unwrap()).collect();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let f = &files[(i % 3) as usize];
        f.write_all_at(&record(i), (i / 3) * RECORD as u64).unwrap();
        f.sync_data().unwrap();
        i += 1;
    }
    i
}

/// The records a restored member `v` (volume `v % 3` of the sequence) holds, slot by slot up
/// to the first slot without one; a slot holding another record than its own fails the test.
fn records_in(device: &Path, v: u64) -> u64 {
    let f = std::fs::File::open(device).unwrap();
    let mut buf = vec![0u8; RECORD];
    let mut slot = 0u64;
    loop {
        f.read_exact_at(&mut buf, slot * RECORD as u64).unwrap();
        if &buf[..8] != MAGIC {
            assert!(buf.iter().all(|b| *b == 0), "volume {v} slot {slot}: neither a record nor zeroes");
            return slot;
        }
        let i = u64::from_le_bytes(buf[8..16].try_into().unwrap());
        assert_eq!(i, slot * 3 + v, "volume {v} slot {slot} holds another record");
        slot += 1;
    }
}

#[test]
fn a_group_snapshot_of_volumes_on_two_nodes_is_crash_consistent() {
    support::run_with_fuse(flow());
}

async fn flow() {
    let dir = tempfile::tempdir().unwrap();
    let _sweep = support::replicated::Sweep(dir.path().to_owned());
    let [a, b, c] = three_nodes(dir.path()).await;
    let (mut ctl, _) = clients(&a.socket).await;
    let (_, node_b) = clients(&b.socket).await;
    let (_, node_c) = clients(&c.socket).await;
    let channel = wasmcsi::host::connect(&a.socket).await.unwrap();
    let mut groups = GroupControllerClient::new(channel.clone());

    // Offered: the bundled replicated-block backend declares group snapshots.
    let caps =
        IdentityClient::new(channel).get_plugin_capabilities(csi::GetPluginCapabilitiesRequest {}).await.unwrap();
    use csi::plugin_capability::{Type, service};
    let offered = caps.into_inner().capabilities.iter().any(
        |c| matches!(&c.r#type, Some(Type::Service(s)) if s.r#type == service::Type::GroupControllerService as i32),
    );
    assert!(offered, "GROUP_CONTROLLER_SERVICE advertised");
    let caps = groups.group_controller_get_capabilities(csi::GroupControllerGetCapabilitiesRequest {}).await.unwrap();
    assert_eq!(caps.into_inner().capabilities.len(), 1, "CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT");

    // Three volumes, two attached on node-b and one on node-c.
    let mut volumes = Vec::new();
    for i in 0..3 {
        volumes
            .push(ctl.create_volume(create_request(&format!("pvc-g{i}"))).await.unwrap().into_inner().volume.unwrap());
    }
    let on = |i: usize| if i == 2 { ("node-c", &node_c) } else { ("node-b", &node_b) };
    let mut attached = Vec::new();
    for (i, v) in volumes.iter().enumerate() {
        let (node_id, node) = on(i);
        attached.push(attach(&mut ctl, node, v, node_id, dir.path(), &format!("pod-g{i}")).await);
    }

    // The writer runs before, during and after the group snapshot.
    let stop = Arc::new(AtomicBool::new(false));
    let devices: Vec<PathBuf> = attached.iter().map(|p| p.target.clone()).collect();
    let writer = std::thread::spawn({
        let stop = stop.clone();
        move || write_sequence(devices, stop)
    });
    // Each record costs a flush of every replica: a few dozen of them before the group.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sources: Vec<String> = volumes.iter().map(|v| v.volume_id.clone()).collect();
    let request = csi::CreateVolumeGroupSnapshotRequest {
        name: "vgs-1".into(),
        source_volume_ids: sources.clone(),
        ..Default::default()
    };
    let group =
        groups.create_volume_group_snapshot(request.clone()).await.unwrap().into_inner().group_snapshot.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let written = tokio::task::spawn_blocking(move || writer.join().unwrap()).await.unwrap();
    assert!(group.ready_to_use && group.snapshots.len() == 3, "{group:?}");
    for s in &group.snapshots {
        assert_eq!(s.group_snapshot_id, group.group_snapshot_id);
    }

    // A retry: the same group. Get finds it, with or without the member list.
    let again = groups.create_volume_group_snapshot(request).await.unwrap().into_inner().group_snapshot.unwrap();
    assert_eq!(again, group, "the same name and sources again");
    let member_ids: Vec<String> = group.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
    let got = groups
        .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            snapshot_ids: member_ids.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .group_snapshot
        .unwrap();
    assert_eq!(got, group);

    // The writer is done: take the originals apart.
    for (i, (v, p)) in volumes.iter().zip(&attached).enumerate() {
        let (node_id, node) = on(i);
        detach(&mut ctl, node, v, node_id, p).await;
    }

    // Every member restored: a prefix of the sequence across the three.
    let mut counts = [0u64; 3];
    let mut restored = Vec::new();
    for (i, v) in volumes.iter().enumerate() {
        let s = group.snapshots.iter().find(|s| s.source_volume_id == v.volume_id).expect("a member per source");
        // Every member is an ordinary snapshot.
        let alone = ctl
            .get_snapshot(csi::GetSnapshotRequest { snapshot_id: s.snapshot_id.clone(), ..Default::default() })
            .await
            .unwrap()
            .into_inner()
            .snapshot
            .unwrap();
        assert_eq!(alone.source_volume_id, v.volume_id);
        let mut req = create_request(&format!("pvc-r{i}"));
        req.volume_content_source = Some(support::from_snapshot(&s.snapshot_id));
        let r = loop {
            match ctl.create_volume(req.clone()).await {
                Ok(r) => break r.into_inner().volume.unwrap(),
                Err(s) if s.code() == Code::Aborted => tokio::time::sleep(Duration::from_millis(200)).await,
                Err(s) => panic!("restore: {s:?}"),
            }
        };
        let p = attach(&mut ctl, &node_c, &r, "node-c", dir.path(), &format!("pod-r{i}")).await;
        counts[i] = records_in(&p.target, i as u64);
        detach(&mut ctl, &node_c, &r, "node-c", &p).await;
        restored.push(r);
    }
    let total: u64 = counts.iter().sum();
    for (v, count) in counts.iter().enumerate() {
        // Records 0..total, those of volume v: a prefix of the sequence, nothing after a gap.
        let expected = (total + 2 - v as u64) / 3;
        assert_eq!(*count, expected, "volume {v}: {counts:?} is not a prefix of the sequence ({written} written)");
    }
    assert!(total > 0 && total < written, "the group fell inside the writes: {counts:?} of {written}");
    eprintln!("group snapshot: {total} of {written} records, per volume {counts:?}");

    // A missing source: NOT_FOUND, and no snapshot made of the others.
    let before = ctl.list_snapshots(csi::ListSnapshotsRequest::default()).await.unwrap().into_inner().entries.len();
    let missing = format!("{BACKEND}:pvc-missing-0123456789abcdef");
    let e = groups
        .create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
            name: "vgs-2".into(),
            source_volume_ids: vec![sources[0].clone(), missing],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let after = ctl.list_snapshots(csi::ListSnapshotsRequest::default()).await.unwrap().into_inner().entries.len();
    assert_eq!(after, before, "nothing left of the failed group");
    let e = groups
        .create_volume_group_snapshot(csi::CreateVolumeGroupSnapshotRequest {
            name: "vgs-3".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // Delete: gone, twice is fine, Get is NOT_FOUND after.
    for _ in 0..2 {
        groups
            .delete_volume_group_snapshot(csi::DeleteVolumeGroupSnapshotRequest {
                group_snapshot_id: group.group_snapshot_id.clone(),
                snapshot_ids: member_ids.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let e = groups
        .get_volume_group_snapshot(csi::GetVolumeGroupSnapshotRequest {
            group_snapshot_id: group.group_snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let left = ctl.list_snapshots(csi::ListSnapshotsRequest::default()).await.unwrap().into_inner().entries;
    assert!(left.is_empty(), "no member left: {left:?}");

    for v in volumes.iter().chain(&restored) {
        ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() })
            .await
            .unwrap();
    }
    for h in [a, b, c] {
        h.shutdown().await.unwrap();
    }
    assert_eq!(mounts_under(dir.path()), Vec::<String>::new(), "nothing left mounted");
}
