//! The replicated-block backend end to end through the CSI socket, as kubelet and the sidecars
//! drive it: three hosts in this process, each a node with its own replica server (loopback
//! TCP, ports found at start and given to the backend's `block` grant through a nodes file, as
//! a headless Service's DNS would), its own state and its own CSI socket; node-a also serves
//! the controller. The backend is the bundled component loaded from disk.
//!
//! Flow: bad parameters are refused before anything is made → CreateVolume (three replicas,
//! sent 50 times at once: one replica set) → ControllerPublish to node-b → stage (ext4 formatted on the
//! engine's FUSE + loop device) and publish there → write → stats (healthy) → a second node's
//! publish is refused while b holds it → snapshot → unpublish/unstage/ControllerUnpublish →
//! the same volume on node-c shows what b wrote (replicated, one writer at a time) → a clone
//! from the snapshot → a raw block volume written and read through its device on node-c →
//! ListVolumes → delete everything.
//! Ends with nothing mounted, no engine and no replica left.
//!
//! Skipped (saying why) when not root or without /dev/fuse.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::Code;
use wasmcsi::host::Host;
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::csi::{
    Controller, Node, Paths, at_once, clients, controller_publish as publish_to,
    controller_unpublish as unpublish_from, mounts_under, publish_at, stage_request, stats, unpublish_and_unstage,
};
use crate::support::replicated::{BACKEND, Options};

const MIB: i64 = 1 << 20;
const SIZE: i64 = 64 * MIB;

fn ext4() -> csi::VolumeCapability {
    support::single_node_writer(Some("ext4"))
}

/// A node (and, for node-a, the controller) with its replica server on loopback, in its zone.
async fn start_node(dir: &Path, name: &str, mode: wasmcsi_csi::Mode, nodes_file: &Path) -> Host {
    let labels = vec![("topology.kubernetes.io/zone".into(), format!("zone-{name}"))];
    support::replicated::host(&dir.join(name), name, mode, nodes_file, Options { labels, ..Default::default() }).await
}

/// Three nodes (node-a also the controller) whose replica servers the grant's nodes file lists.
async fn three_nodes(dir: &Path) -> [Host; 3] {
    let nodes_file = dir.join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();
    let a = start_node(dir, "node-a", wasmcsi_csi::Mode::All, &nodes_file).await;
    let b = start_node(dir, "node-b", wasmcsi_csi::Mode::Node, &nodes_file).await;
    let c = start_node(dir, "node-c", wasmcsi_csi::Mode::Node, &nodes_file).await;
    support::replicated::list_replica_nodes(&nodes_file, &[&a, &b, &c]);
    [a, b, c]
}

fn params(extra: &[(&str, &str)]) -> HashMap<String, String> {
    [("backend", BACKEND)].iter().chain(extra).map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()
}

fn create_request(name: &str, params: HashMap<String, String>) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: SIZE, limit_bytes: 0 }),
        volume_capabilities: vec![ext4()],
        parameters: params,
        ..Default::default()
    }
}

fn paths(dir: &Path, node: &str, pod: &str) -> Paths {
    Paths {
        staging: dir.join(node).join("kubelet/staging").join(pod),
        target: dir.join(node).join("kubelet/pods").join(pod).join("mount"),
    }
}

/// NodeStage (three at once) and NodePublish.
async fn mount_on(
    node: &Node,
    v: &csi::Volume,
    publish_context: &HashMap<String, String>,
    p: &Paths,
    cap: &csi::VolumeCapability,
) {
    let stage = stage_request(v, publish_context, p, cap);
    at_once(3, "stage", || {
        let (mut node, req) = (node.clone(), stage.clone());
        async move { node.node_stage_volume(req).await }
    })
    .await;
    publish_at(&mut node.clone(), v, publish_context, p, cap).await;
}

async fn unmount_on(node: &Node, v: &csi::Volume, p: &Paths) {
    unpublish_and_unstage(&mut node.clone(), v, p).await;
}

async fn condition(node: &Node, v: &csi::Volume, p: &Paths) -> csi::VolumeCondition {
    let stats = stats(&mut node.clone(), v, &p.target).await;
    assert!(stats.usage.iter().any(|u| u.total > 0), "usage reported: {stats:?}");
    stats.volume_condition.expect("a volume condition")
}

fn block_cap() -> csi::VolumeCapability {
    support::single_node_writer(None)
}

/// Create, publish to node-c, stage and publish as a device, write and read it back through
/// the device, then take it apart; the volume is left for the caller to delete.
async fn raw_block(ctl: &mut Controller, node: &Node, dir: &Path) -> csi::Volume {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut req = create_request("pvc-raw", params(&[("numberOfReplicas", "2")]));
    req.volume_capabilities = vec![block_cap()];
    let v = ctl.create_volume(req).await.unwrap().into_inner().volume.unwrap();
    let ctx = publish_to(ctl, &v, "node-c", &block_cap()).await.unwrap();
    let staged = paths(dir, "node-c", "pod-raw");
    let device = staged.target.join("dev");
    let p = Paths { staging: staged.staging, target: device.clone() };
    mount_on(node, &v, &ctx, &p, &block_cap()).await;
    let block: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 253) as u8).collect();
    {
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&device).unwrap();
        assert_eq!(f.seek(SeekFrom::End(0)).unwrap(), SIZE as u64, "the device has the volume's size");
        f.seek(SeekFrom::Start(8 << 20)).unwrap();
        f.write_all(&block).unwrap();
        f.sync_all().unwrap();
        let mut back = vec![0; block.len()];
        f.seek(SeekFrom::Start(8 << 20)).unwrap();
        f.read_exact(&mut back).unwrap();
        assert!(back == block, "what was written through the device reads back");
    }
    unmount_on(node, &v, &p).await;
    assert!(!device.exists(), "the target file is removed");
    unpublish_from(ctl, &v, "node-c").await;
    v
}

#[test]
fn replicated_volume_through_the_csi_socket_on_three_nodes() {
    support::run_with_fuse(flow());
}

async fn flow() {
    let dir = tempfile::tempdir().unwrap();
    let [a, b, c] = three_nodes(dir.path()).await;
    let (mut ctl, _) = clients(&a.socket).await;
    let (_, node_b) = clients(&b.socket).await;
    let (_, node_c) = clients(&c.socket).await;

    // Bad parameters: refused, nothing made.
    let bad = ctl.create_volume(create_request("bad", params(&[("numberOfReplicas", "three")]))).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("numberOfReplicas"), "names the parameter: {bad:?}");
    let many = ctl.create_volume(create_request("many", params(&[("numberOfReplicas", "4")]))).await.unwrap_err();
    assert_eq!(many.code(), Code::ResourceExhausted, "{many:?}");
    assert!(many.message().contains('3'), "says how many nodes were found: {many:?}");
    let listed = ctl.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner();
    assert!(listed.entries.is_empty(), "nothing made by refused requests: {listed:?}");

    // Capacity: what a volume of N replicas can still get, the same in every segment (the
    // volume is reachable from every node); none for more replicas than there are nodes.
    let capacity = |replicas: &str, zone: Option<&str>| {
        let mut ctl = ctl.clone();
        let request = csi::GetCapacityRequest {
            volume_capabilities: vec![ext4()],
            parameters: params(&[("numberOfReplicas", replicas)]),
            accessible_topology: zone.map(|z| csi::Topology {
                segments: [("topology.kubernetes.io/zone".to_string(), z.to_string())].into(),
            }),
        };
        async move { ctl.get_capacity(request).await.unwrap().into_inner() }
    };
    let three = capacity("3", None).await;
    assert!(three.available_capacity > SIZE, "{three:?}");
    // The replica roots share this machine's disk with everything else running: its free space
    // moves between two calls, so "the same answer" is within what other writers can change.
    let zoned = capacity("3", Some("zone-node-b")).await.available_capacity;
    assert!(zoned.abs_diff(three.available_capacity) < 256 << 20, "{zoned} vs {three:?}");
    assert_eq!(capacity("4", None).await.available_capacity, 0, "four replicas on three nodes");

    // One volume of three replicas, however many copies of the request arrive.
    let name = "pvc-0a1b2c3d-replicated";
    let req = create_request(name, params(&[("numberOfReplicas", "3")]));
    let answers = at_once(50, "create", || {
        let (mut ctl, req) = (ctl.clone(), req.clone());
        async move { ctl.create_volume(req).await }
    })
    .await;
    let vols: Vec<csi::Volume> = answers.into_iter().map(|a| a.volume.unwrap()).collect();
    assert!(vols.iter().all(|v| v.volume_id == vols[0].volume_id), "one volume per name: {vols:?}");
    let v = vols[0].clone();
    assert_eq!(v.capacity_bytes, SIZE);
    let listed = ctl.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner();
    assert_eq!(listed.entries.len(), 1, "one volume for 50 concurrent creates: {listed:?}");
    let replicas: Vec<PathBuf> = ["node-a", "node-b", "node-c"]
        .iter()
        .flat_map(|n| std::fs::read_dir(dir.path().join(n).join("replicas")).unwrap().map(|e| e.unwrap().path()))
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(replicas.len(), 3, "one replica set of three, one replica per node: {replicas:?}");

    // node-b gets it: stage, publish, write.
    let pb = paths(dir.path(), "node-b", "pod-1");
    // A node id no node of the cluster has: NOT_FOUND, and it does not become the owner.
    let nowhere = publish_to(&mut ctl, &v, "node-x", &ext4()).await.unwrap_err();
    assert_eq!(nowhere.code(), Code::NotFound, "{nowhere:?}");
    assert!(nowhere.message().contains("node-x"), "{nowhere:?}");
    let ctx_b = publish_to(&mut ctl, &v, "node-b", &ext4()).await.unwrap();
    mount_on(&node_b, &v, &ctx_b, &pb, &ext4()).await;
    let payload: Vec<u8> = (0..3 * MIB).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(pb.target.join("data.bin"), &payload).unwrap();
    nix::unistd::sync();
    let cond = condition(&node_b, &v, &pb).await;
    assert!(!cond.abnormal, "healthy on node-b: {cond:?}");

    // One writer: node-c cannot have it while node-b does.
    let refused = publish_to(&mut ctl, &v, "node-c", &ext4()).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");

    // A snapshot while it is attached.
    let snap = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "snapshot-0a1b2c3d".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(snap.source_volume_id, v.volume_id);
    assert!(snap.ready_to_use);

    // Hand over to node-c: what node-b wrote is there.
    unmount_on(&node_b, &v, &pb).await;
    unpublish_from(&mut ctl, &v, "node-b").await;
    let pc = paths(dir.path(), "node-c", "pod-2");
    let ctx_c = publish_to(&mut ctl, &v, "node-c", &ext4()).await.unwrap();
    mount_on(&node_c, &v, &ctx_c, &pc, &ext4()).await;
    assert_eq!(std::fs::read(pc.target.join("data.bin")).unwrap(), payload, "replicated to node-c");
    unmount_on(&node_c, &v, &pc).await;
    unpublish_from(&mut ctl, &v, "node-c").await;

    // A clone from the snapshot: filled in the background (ABORTED until whole).
    let mut clone_req = create_request("pvc-clone", params(&[("numberOfReplicas", "2")]));
    clone_req.volume_content_source = Some(support::from_snapshot(&snap.snapshot_id));
    let clone = loop {
        match ctl.create_volume(clone_req.clone()).await {
            Ok(r) => break r.into_inner().volume.unwrap(),
            Err(s) if s.code() == Code::Aborted => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(s) => panic!("clone: {s:?}"),
        }
    };
    let ctx = publish_to(&mut ctl, &clone, "node-b", &ext4()).await.unwrap();
    let pk = paths(dir.path(), "node-b", "pod-3");
    mount_on(&node_b, &clone, &ctx, &pk, &ext4()).await;
    assert_eq!(std::fs::read(pk.target.join("data.bin")).unwrap(), payload, "the clone holds the snapshot");
    unmount_on(&node_b, &clone, &pk).await;
    unpublish_from(&mut ctl, &clone, "node-b").await;

    // A raw block volume (volumeMode: Block): the engine's device at the target file.
    let raw = raw_block(&mut ctl, &node_c, dir.path()).await;

    let listed = ctl.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner();
    let ids: Vec<&str> =
        listed.entries.iter().filter_map(|e| e.volume.as_ref()).map(|v| v.volume_id.as_str()).collect();
    assert!(ids.contains(&v.volume_id.as_str()) && ids.contains(&clone.volume_id.as_str()), "{ids:?}");

    // Delete everything; deletes are idempotent.
    for id in [&clone.volume_id, &v.volume_id, &raw.volume_id] {
        for _ in 0..2 {
            ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() }).await.unwrap();
        }
    }
    // The snapshot keeps the deleted volume's replicas, and its name: a new volume of that name
    // is retried (ABORTED, saying why), never refused for good (ALREADY_EXISTS).
    let again = ctl.create_volume(req.clone()).await.unwrap_err();
    assert_eq!(again.code(), Code::Aborted, "{again:?}");
    assert!(again.message().contains("1 snapshot(s)") && again.message().contains(name), "{again:?}");
    ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id.clone(), ..Default::default() })
        .await
        .unwrap();
    let listed = ctl.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner();
    assert!(listed.entries.is_empty(), "nothing left: {listed:?}");
    // With the last snapshot gone the name is free: the retry makes a new, empty volume.
    let renewed = ctl.create_volume(req).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(renewed.volume_id, v.volume_id, "the name's id again");
    assert!(renewed.content_source.is_none());
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: renewed.volume_id, ..Default::default() }).await.unwrap();
    let listed = ctl.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner();
    assert!(listed.entries.is_empty(), "nothing left: {listed:?}");

    for h in [a, b, c] {
        h.shutdown().await.unwrap();
    }
    assert_eq!(mounts_under(dir.path()), Vec::<String>::new(), "nothing left mounted");
}

/// A replica node that stops answering while the volume is staged elsewhere: writes go on,
/// and the node reports the volume condition abnormal, saying it is degraded.
#[test]
fn a_lost_replica_node_shows_as_a_degraded_condition_while_writes_go_on() {
    if let Some(why) = crate::support::needs_root_and_fuse() {
        eprintln!("skipped: {why}");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let [a, b, c] = three_nodes(dir.path()).await;
        let (mut ctl, _) = clients(&a.socket).await;
        let (_, node_b) = clients(&b.socket).await;

        let v = ctl
            .create_volume(create_request("pvc-degraded", params(&[("numberOfReplicas", "3")])))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let ctx = publish_to(&mut ctl, &v, "node-b", &ext4()).await.unwrap();
        let p = paths(dir.path(), "node-b", "pod-1");
        mount_on(&node_b, &v, &ctx, &p, &ext4()).await;
        assert!(!condition(&node_b, &v, &p).await.abnormal, "healthy before");

        // node-c's replica server goes away (as with a node that died).
        c.datapath.as_ref().expect("data path").shutdown().await.unwrap();
        let data: Vec<u8> = (0..2 * MIB).map(|i| (i % 241) as u8).collect();
        let mut cond = None;
        for round in 0..100 {
            std::fs::write(p.target.join(format!("after-{round}.bin")), &data).unwrap();
            nix::unistd::sync();
            let now = condition(&node_b, &v, &p).await;
            if now.abnormal {
                cond = Some(now);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let cond = cond.expect("the condition turns abnormal once a replica is lost");
        assert!(cond.message.contains("degraded"), "{cond:?}");
        assert_eq!(std::fs::read(p.target.join("after-0.bin")).unwrap(), data, "writes went on");

        unmount_on(&node_b, &v, &p).await;
        for h in [a, b, c] {
            h.shutdown().await.unwrap();
        }
        assert_eq!(mounts_under(dir.path()), Vec::<String>::new(), "nothing left mounted");
    });
}
