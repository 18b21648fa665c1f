//! A replicated class on a cluster of one node (edge, single-node k3s) through the CSI socket:
//! the node's data path serves four disks (replica roots), the class wants three replicas.
//! CreateVolume binds with three replicas on three disks of the one node, and the volume
//! condition says it is not node-redundant. Staged, written; then one disk loses its replica
//! (its files are gone, as after a disk swap, and the node restarts), the volume is staged
//! again and serves from the other two, the engine reports the lost one down, the controller's
//! healing replaces it on the spare disk and a full rebuild makes three healthy replicas again;
//! the data reads back throughout. `wasmcsi volume status` names each replica by node and disk.
//! The backend is the bundled component loaded from disk.
//!
//! Skipped (saying why) when not root or without /dev/fuse.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use wasmcsi::host::Host;
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::csi::{
    Node, Paths, clients, controller_publish, controller_unpublish, mounts_under, stage_and_publish, stats,
    unpublish_and_unstage,
};
use crate::support::replicated::{BACKEND, Options, Sweep, addr, volume_status};

const MIB: i64 = 1 << 20;
/// The disks of the node besides `default` (`replicas/`): three replicas on four disks leave a
/// spare for the replacement of a lost one.
const DISKS: [&str; 3] = ["d1", "d2", "d3"];

/// Every disk of the node by name, and its root.
fn roots(home: &Path) -> Vec<(String, PathBuf)> {
    let mut all = vec![("default".to_owned(), home.join("replicas"))];
    all.extend(DISKS.iter().map(|d| ((*d).to_owned(), home.join(format!("disk-{d}")))));
    all
}

/// The disks holding a replica (a directory under their root).
fn holding(home: &Path) -> BTreeSet<String> {
    roots(home)
        .into_iter()
        .filter(|(_, root)| std::fs::read_dir(root).into_iter().flatten().flatten().any(|e| e.path().is_dir()))
        .map(|(name, _)| name)
        .collect()
}

/// The one node (controller too), its disks, healing every second; its replica server's
/// address written to the grant's nodes file.
async fn start(home: &Path, nodes_file: &Path) -> Host {
    let options = Options {
        disks: roots(home).into_iter().skip(1).collect(),
        reconcile: Some(Duration::from_secs(1)),
        ..Default::default()
    };
    let host = support::replicated::host(home, "node-a", wasmcsi_csi::Mode::All, nodes_file, options).await;
    let addr = host.datapath.as_ref().expect("data path").local_addr();
    std::fs::write(nodes_file, format!("{addr}\n")).unwrap();
    host
}

async fn condition(node: &Node, v: &csi::Volume, p: &Paths) -> csi::VolumeCondition {
    stats(&mut node.clone(), v, &p.target).await.volume_condition.expect("a volume condition")
}

#[test]
fn three_replicas_on_three_disks_of_one_node_bind_lose_a_disk_and_heal() {
    support::run_with_fuse(flow());
}

async fn flow() {
    let dir = tempfile::tempdir().unwrap();
    let _sweep = Sweep(dir.path().to_owned());
    let home = dir.path().join("node-a");
    let nodes_file = dir.path().join("replica-nodes");
    let a = start(&home, &nodes_file).await;
    let (mut ctl, node) = clients(&a.socket).await;

    let cap = support::single_node_writer(Some("ext4"));
    let params: HashMap<String, String> =
        [("backend", BACKEND), ("numberOfReplicas", "3"), ("staleReplicaTimeout", "5s")]
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect();
    let v = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-one-node".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 64 * MIB, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            parameters: params,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|s| panic!("a 3-replica volume binds on one node of four disks: {s:?}"))
        .into_inner()
        .volume
        .unwrap();
    let set = v.volume_id.split_once(':').map(|(_, s)| s.to_owned()).unwrap();
    let first = holding(&home);
    assert_eq!(first.len(), 3, "three replicas, each on a disk of its own: {first:?}");

    let ctx = controller_publish(&mut ctl, &v, "node-a", &cap).await.unwrap();
    let p = Paths { staging: home.join("kubelet/staging/pvc"), target: home.join("kubelet/pods/pod/mount") };
    stage_and_publish(&mut node.clone(), &v, &ctx, &p, &cap).await;
    let cond = condition(&node, &v, &p).await;
    assert!(!cond.abnormal, "every replica is whole: {cond:?}");
    assert!(cond.message.contains("not node-redundant: 3 replicas on 1 node"), "{cond:?}");
    let payload: Vec<u8> = (0..3 * MIB).map(|i| (i * 11 % 251) as u8).collect();
    std::fs::write(p.target.join("data.bin"), &payload).unwrap();
    nix::unistd::sync();
    let status = volume_status(&set, &[addr(&a)]).await;
    assert!(status.contains("3/3 healthy"), "{status}");
    for disk in &first {
        assert!(status.contains(&format!("node-a/{disk}  healthy")), "{disk}: {status}");
    }

    // One disk loses its replica: the node goes down, the disk comes back empty (swapped), the
    // node restarts.
    unpublish_and_unstage(&mut node.clone(), &v, &p).await;
    drop((ctl, node));
    a.shutdown().await.unwrap();
    let lost = first.iter().next_back().unwrap().clone();
    let lost_root = roots(&home).into_iter().find(|(name, _)| *name == lost).unwrap().1;
    for entry in std::fs::read_dir(&lost_root).unwrap() {
        std::fs::remove_dir_all(entry.unwrap().path()).unwrap();
    }
    let a = start(&home, &nodes_file).await;
    let (mut ctl, node) = clients(&a.socket).await;

    // Staged again, it serves what was written from the two replicas left, degraded.
    stage_and_publish(&mut node.clone(), &v, &ctx, &p, &cap).await;
    assert_eq!(std::fs::read(p.target.join("data.bin")).unwrap(), payload, "served by the two left");

    // Healing replaces the lost replica on the spare disk; a full rebuild fills it.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut seen_degraded = false;
    let healed = loop {
        let cond = condition(&node, &v, &p).await;
        seen_degraded |= cond.abnormal;
        let now = holding(&home);
        if !cond.abnormal && now.len() == 3 && !now.contains(&lost) {
            break (cond, now);
        }
        assert!(Instant::now() < deadline, "never healed; last condition {cond:?}, disks {now:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(seen_degraded, "the lost replica showed as a degraded condition first");
    let (cond, now) = healed;
    assert!(cond.message.starts_with("3/3 replicas healthy"), "{cond:?}");
    assert!(cond.message.contains("not node-redundant: 3 replicas on 1 node"), "{cond:?}");
    let spare: Vec<&String> = now.difference(&first).collect();
    assert_eq!(spare.len(), 1, "the replacement is on the disk that held none: {first:?} → {now:?}");
    let status = volume_status(&set, &[addr(&a)]).await;
    assert!(status.contains("3/3 healthy") && !status.contains(&format!("node-a/{lost} ")), "{status}");
    assert!(status.contains(&format!("node-a/{}  healthy", spare[0])), "{status}");

    // What was written reads back, also after the volume moves through every replica again.
    assert_eq!(std::fs::read(p.target.join("data.bin")).unwrap(), payload, "the data after the rebuild");
    unpublish_and_unstage(&mut node.clone(), &v, &p).await;
    stage_and_publish(&mut node.clone(), &v, &ctx, &p, &cap).await;
    assert_eq!(std::fs::read(p.target.join("data.bin")).unwrap(), payload, "the data after a restage");
    unpublish_and_unstage(&mut node.clone(), &v, &p).await;

    controller_unpublish(&mut ctl, &v, "node-a").await;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }).await.unwrap();
    assert!(holding(&home).is_empty(), "every replica removed: {:?}", holding(&home));
    drop((ctl, node));
    a.shutdown().await.unwrap();
    assert_eq!(mounts_under(dir.path()), Vec::<String>::new(), "nothing left mounted");
}
