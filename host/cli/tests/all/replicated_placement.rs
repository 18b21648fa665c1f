//! A VolumeAttributesClass moves a replicated volume's replicas, through the CSI socket: three
//! hosts in this process (node-a also the controller, healing every second), labelled
//! node-a `zone=x`, node-b `zone=x,ssd=yes`, node-c `zone=y,ssd=yes`.
//!
//! Flow: a two-replica ext4 volume of the class `replicaNodeSelector: zone=x` lands on node-a
//! and node-b, attached on node-a, a file written → a selector only one node matches
//! (`zone=y`) is INVALID_ARGUMENT naming the key, nothing moves → `ssd=yes`: the healing rounds
//! move the replica of node-a (which it excludes) to node-c while the volume stays mounted and
//! takes a second file; node-b's stays → both files read back, also after a restage from the
//! two new members, and from node-c's alone while node-b is down. Ends with nothing mounted and
//! the volume deleted.
//!
//! Skipped (saying why) when not root or without /dev/fuse.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::time::{Duration, Instant};

use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::csi::{
    Paths, clients, controller_publish, controller_unpublish, mounts_under, stage_and_publish, stats,
    unpublish_and_unstage,
};
use crate::support::replicated::{BACKEND, Options, Sweep, addr, healthy_on, map, volume_status};

const MIB: i64 = 1 << 20;

#[test]
fn a_new_replica_node_selector_moves_a_mounted_volume_s_replica_and_keeps_its_data() {
    support::run_with_fuse(flow());
}

async fn flow() {
    let dir = tempfile::tempdir().unwrap();
    let _sweep = Sweep(dir.path().to_path_buf());
    let nodes_file = dir.path().join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();
    let start = |name: &'static str, mode, labels: &[(&str, &str)], reconcile| {
        let (home, nodes_file) = (dir.path().join(name), nodes_file.clone());
        let labels = labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        async move {
            let options = Options { labels, reconcile, ..Default::default() };
            support::replicated::host(&home, name, mode, &nodes_file, options).await
        }
    };
    let a = start("node-a", wasmcsi_csi::Mode::All, &[("zone", "x")], Some(Duration::from_secs(1))).await;
    let b = start("node-b", wasmcsi_csi::Mode::Node, &[("zone", "x"), ("ssd", "yes")], None).await;
    let c = start("node-c", wasmcsi_csi::Mode::Node, &[("zone", "y"), ("ssd", "yes")], None).await;
    support::replicated::list_replica_nodes(&nodes_file, &[&a, &b, &c]);
    let replicas = [addr(&a), addr(&b), addr(&c)];
    let (mut ctl, node) = clients(&a.socket).await;

    let cap = support::single_node_writer(Some("ext4"));
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-move".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 64 * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            parameters: map(&[("backend", BACKEND), ("numberOfReplicas", "2"), ("replicaNodeSelector", "zone=x")]),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let set = v.volume_id.split_once(':').map(|(_, s)| s.to_owned()).unwrap();
    assert_eq!(healthy_on(&volume_status(&set, &replicas).await), ["node-a", "node-b"]);

    let ctx = controller_publish(&mut ctl, &v, "node-a", &cap).await.unwrap();
    let p = Paths {
        staging: dir.path().join("node-a/kubelet/staging/pvc-move"),
        target: dir.path().join("node-a/kubelet/pods/pod/mount"),
    };
    stage_and_publish(&mut node.clone(), &v, &ctx, &p, &cap).await;
    let before = support::pattern(1, 6 << 20);
    support::write_durably(&p.target.join("before.bin"), &before);

    let modify = |kv: &[(&str, &str)]| csi::ControllerModifyVolumeRequest {
        volume_id: v.volume_id.clone(),
        mutable_parameters: map(kv),
        ..Default::default()
    };
    let e = ctl.controller_modify_volume(modify(&[("replicaNodeSelector", "zone=y")])).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("replicaNodeSelector"), "names the key: {e:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(healthy_on(&volume_status(&set, &replicas).await), ["node-a", "node-b"], "nothing moved");

    ctl.controller_modify_volume(modify(&[("replicaNodeSelector", "ssd=yes")])).await.unwrap();
    ctl.controller_modify_volume(modify(&[("replicaNodeSelector", "ssd=yes")])).await.expect("the same again: OK");
    let during = support::pattern(2, 6 << 20);
    support::write_durably(&p.target.join("during.bin"), &during);

    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        let status = volume_status(&set, &replicas).await;
        if healthy_on(&status) == ["node-b", "node-c"] && status.contains("2/2 healthy") {
            break status;
        }
        assert!(Instant::now() < deadline, "the replica never moved to node-c:\n{status}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(status.contains("attached to node-a"), "moved while attached: {status}");
    assert!(!status.contains("node-a/"), "node-a holds no replica any more: {status}");
    let cond = stats(&mut node.clone(), &v, &p.target).await.volume_condition.expect("a condition");
    assert!(!cond.abnormal, "{cond:?}");

    assert_eq!(std::fs::read(p.target.join("before.bin")).unwrap(), before, "written before the move");
    assert_eq!(std::fs::read(p.target.join("during.bin")).unwrap(), during, "written during the move");
    unpublish_and_unstage(&mut node.clone(), &v, &p).await;
    stage_and_publish(&mut node.clone(), &v, &ctx, &p, &cap).await;
    assert_eq!(std::fs::read(p.target.join("before.bin")).unwrap(), before, "from node-b and node-c");
    assert_eq!(std::fs::read(p.target.join("during.bin")).unwrap(), during, "from node-b and node-c");
    unpublish_and_unstage(&mut node.clone(), &v, &p).await;

    // node-c's replica is whole by itself: with node-b down, the volume stages from it alone.
    b.shutdown().await.unwrap();
    stage_and_publish(&mut node.clone(), &v, &ctx, &p, &cap).await;
    assert_eq!(std::fs::read(p.target.join("before.bin")).unwrap(), before, "from node-c alone");
    assert_eq!(std::fs::read(p.target.join("during.bin")).unwrap(), during, "from node-c alone");
    unpublish_and_unstage(&mut node.clone(), &v, &p).await;
    let b = start("node-b", wasmcsi_csi::Mode::Node, &[("zone", "x"), ("ssd", "yes")], None).await;
    support::replicated::list_replica_nodes(&nodes_file, &[&a, &b, &c]);

    controller_unpublish(&mut ctl, &v, "node-a").await;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }).await.unwrap();
    drop((ctl, node));
    for host in [c, b, a] {
        host.shutdown().await.unwrap();
    }
    assert_eq!(mounts_under(dir.path()), Vec::<String>::new(), "nothing left mounted");
}
