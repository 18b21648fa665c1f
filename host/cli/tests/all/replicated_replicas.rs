//! A VolumeAttributesClass changes a mounted replicated volume's `numberOfReplicas`, through the
//! CSI socket, under a checksummed workload: three hosts in this process (node-a also the
//! controller, healing every second).
//!
//! Flow: a two-replica ext4 volume attached on node-a; fio (`--verify=crc32c`, verified along
//! the way and at the end of every run) writes its file over and over → four replicas (three
//! nodes, one disk each) is INVALID_ARGUMENT naming the key, nothing changes → three: a replica
//! is added on the node that had none and rebuilt while fio writes → two again: one replica is
//! removed (not node-a's: the engine reads its own) once all three are healthy, and deleted →
//! fio saw no error in any run; the file verifies again after a restage from the two members
//! left. Ends with nothing mounted and the volume deleted.
//!
//! Skipped (saying why) when not root, without /dev/fuse or without fio.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::cluster::{fio, fio_ok, fio_until};
use crate::support::csi::{
    Paths, clients, controller_publish, controller_unpublish, mounts_under, stage_and_publish, stats,
    unpublish_and_unstage,
};
use crate::support::replicated::{BACKEND, Options, Sweep, addr, healthy_on, map, volume_status};

const MIB: i64 = 1 << 20;

#[test]
fn number_of_replicas_goes_two_three_two_on_a_mounted_volume_under_fio_verify() {
    if std::process::Command::new("fio").arg("--version").output().is_err() {
        eprintln!("skipped: fio is not installed (scripts/setup installs it)");
        return;
    }
    support::run_with_fuse(flow());
}

/// Polls the set's status until `done` holds (at most two minutes).
async fn until(set: &str, replicas: &[SocketAddr], what: &str, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = volume_status(set, replicas).await;
        if done(&status) {
            return status;
        }
        assert!(Instant::now() < deadline, "{what} never happened:\n{status}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn flow() {
    let dir = tempfile::tempdir().unwrap();
    let _sweep = Sweep(dir.path().to_path_buf());
    let nodes_file = dir.path().join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();
    let start = |name: &'static str, mode, reconcile| {
        let (home, nodes_file) = (dir.path().join(name), nodes_file.clone());
        async move {
            let options = Options { reconcile, ..Default::default() };
            support::replicated::host(&home, name, mode, &nodes_file, options).await
        }
    };
    let a = start("node-a", wasmcsi_csi::Mode::All, Some(Duration::from_secs(1))).await;
    let b = start("node-b", wasmcsi_csi::Mode::Node, None).await;
    let c = start("node-c", wasmcsi_csi::Mode::Node, None).await;
    support::replicated::list_replica_nodes(&nodes_file, &[&a, &b, &c]);
    let replicas = [addr(&a), addr(&b), addr(&c)];
    let (mut ctl, node) = clients(&a.socket).await;

    let cap = support::single_node_writer(Some("ext4"));
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-count".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 64 * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            parameters: map(&[("backend", BACKEND), ("numberOfReplicas", "2")]),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    let set = v.volume_id.split_once(':').map(|(_, s)| s.to_owned()).unwrap();
    let two = healthy_on(&volume_status(&set, &replicas).await);
    assert_eq!(two.len(), 2, "{two:?}");

    // Attached on node-a; placement by free space (equal here: one filesystem), then by name,
    // put a replica there, the one a shrink must keep.
    let owner = "node-a".to_owned();
    let mut ctl_node = node.clone();
    let ctx = controller_publish(&mut ctl, &v, &owner, &cap).await.unwrap();
    let p = Paths {
        staging: dir.path().join(format!("{owner}/kubelet/staging/pvc-count")),
        target: dir.path().join(format!("{owner}/kubelet/pods/pod/mount")),
    };
    stage_and_publish(&mut ctl_node, &v, &ctx, &p, &cap).await;
    let file = p.target.join("fio.bin");
    let stop = Arc::new(AtomicBool::new(false));
    let workload = {
        let (file, stop) = (file.clone(), stop.clone());
        std::thread::spawn(move || fio_until(file, stop))
    };

    let modify = |n: &str| csi::ControllerModifyVolumeRequest {
        volume_id: v.volume_id.clone(),
        mutable_parameters: map(&[("numberOfReplicas", n)]),
        ..Default::default()
    };
    let e = ctl.controller_modify_volume(modify("4")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("numberOfReplicas"), "names the key: {e:?}");
    assert_eq!(healthy_on(&volume_status(&set, &replicas).await), two, "nothing changed");

    ctl.controller_modify_volume(modify("3")).await.unwrap();
    ctl.controller_modify_volume(modify("3")).await.expect("the same again: OK");
    let three = until(&set, &replicas, "the third replica's rebuild", |s| {
        healthy_on(s) == ["node-a", "node-b", "node-c"] && s.contains("3/3 healthy")
    })
    .await;
    assert!(three.contains(&format!("attached to {owner}")), "grown while attached: {three}");

    ctl.controller_modify_volume(modify("2")).await.unwrap();
    let left =
        until(&set, &replicas, "a replica's removal", |s| healthy_on(s).len() == 2 && s.contains("2/2 healthy")).await;
    let kept = healthy_on(&left);
    if two.contains(&owner) {
        assert!(kept.contains(&owner), "the attached node keeps its own replica: {left}");
    }
    let removed = ["node-a", "node-b", "node-c"].into_iter().find(|n| !kept.iter().any(|k| k == n)).unwrap();
    assert!(!left.contains(&format!("{removed}/")), "{removed}'s replica is gone, not a leftover: {left}");
    let cond = stats(&mut ctl_node, &v, &p.target).await.volume_condition.expect("a condition");
    assert!(!cond.abnormal, "{cond:?}");

    // One more whole run after the last change, then stop.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    let (runs, failed, _) = tokio::task::spawn_blocking(move || workload.join().expect("fio thread")).await.unwrap();
    eprintln!("fio: {runs} verified runs across 2 → 3 → 2\nthree:\n{three}\ntwo:\n{left}");
    assert!(runs >= 1, "fio ran");
    assert_eq!(failed, 0, "fio --verify saw an error in {failed} of {runs} runs");
    fio_ok(fio(&file, true).current_dir(dir.path()), "verify after 2 → 3 → 2");
    unpublish_and_unstage(&mut ctl_node, &v, &p).await;
    stage_and_publish(&mut ctl_node, &v, &ctx, &p, &cap).await;
    fio_ok(fio(&file, true).current_dir(dir.path()), "verify from the two members left, restaged");
    unpublish_and_unstage(&mut ctl_node, &v, &p).await;

    controller_unpublish(&mut ctl, &v, &owner).await;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }).await.unwrap();
    drop((ctl, node, ctl_node));
    for host in [c, b, a] {
        host.shutdown().await.unwrap();
    }
    assert_eq!(mounts_under(dir.path()), Vec::<String>::new(), "nothing left mounted");
}
