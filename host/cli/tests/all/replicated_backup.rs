//! Backups of replicated volumes through the CSI socket, as the snapshotter and the provisioner
//! drive them: two hosts in this process (node-a also the controller), a filesystem backup
//! target `local` granted to the bundled replicated-block component.
//!
//! Flow: files written on an ext4 volume → CreateSnapshot of class `type: backup` (asked again
//! until `ready_to_use`, as the snapshotter does) → more written → a second backup, which reads
//! only what changed (its manifest says how much) → ListSnapshots by id and by volume →
//! the volume deleted → CreateVolume from each backup (ABORTED while it is restored, then OK)
//! staged on node-b: each shows exactly the files of its point in time → DeleteSnapshot → a
//! chunk flipped behind our back: the restore fails naming it, and nothing is served.
//! Bad classes are refused before anything is made.
//!
//! Skipped (saying why) when not root or without /dev/fuse.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tonic::Code;
use wasmcsi::host::Host;
use wasmcsi_proto::csi::v1 as csi;

use crate::support::csi::{
    Controller, Node, Paths, clients, controller_publish, controller_unpublish, from_snapshot, mounts_under,
    stage_and_publish, unpublish_and_unstage,
};
use crate::support::replicated::{BACKEND, Options};
use crate::support::{self, pattern};

const MIB: i64 = 1 << 20;
const SIZE: i64 = 64 * MIB;

#[test]
fn a_replicated_volume_backed_up_incrementally_and_restored_through_the_csi_socket() {
    support::run_with_fuse(flow());
}

fn ext4() -> csi::VolumeCapability {
    support::single_node_writer(Some("ext4"))
}

fn create_request(name: &str, source: Option<&str>) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: SIZE, limit_bytes: 0 }),
        volume_capabilities: vec![ext4()],
        parameters: [("backend", BACKEND), ("numberOfReplicas", "2")]
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect(),
        volume_content_source: source.map(from_snapshot),
        ..Default::default()
    }
}

fn backup_request(name: &str, volume: &str, class: &[(&str, &str)]) -> csi::CreateSnapshotRequest {
    csi::CreateSnapshotRequest {
        name: name.into(),
        source_volume_id: volume.into(),
        parameters: class.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect(),
        ..Default::default()
    }
}

const BACKUP_CLASS: &[(&str, &str)] = &[("type", "backup"), ("target", "local")];

/// CreateSnapshot, asked again until the backup is ready (as the snapshotter does).
async fn backed_up(ctl: &mut Controller, name: &str, volume: &str) -> csi::Snapshot {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut first = None;
    loop {
        let s = ctl.create_snapshot(backup_request(name, volume, BACKUP_CLASS)).await.unwrap().into_inner();
        let s = s.snapshot.unwrap();
        let id = first.get_or_insert_with(|| s.snapshot_id.clone());
        assert_eq!(&s.snapshot_id, id, "one id for every answer");
        if s.ready_to_use {
            return s;
        }
        assert!(Instant::now() < deadline, "backup {name} not ready in time: {s:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// CreateVolume, asked again while the restore runs (ABORTED, with progress) until it is done.
async fn restored(ctl: &mut Controller, name: &str, snapshot: &str) -> csi::Volume {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match ctl.create_volume(create_request(name, Some(snapshot))).await {
            Ok(r) => return r.into_inner().volume.unwrap(),
            Err(s) if s.code() == Code::Aborted => {
                assert!(s.message().contains("being filled"), "{s:?}");
                assert!(Instant::now() < deadline, "restore of {name} not done in time: {s:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(s) => panic!("restoring {name} from {snapshot}: {s:?}"),
        }
    }
}

fn paths(dir: &Path, node: &str, pod: &str) -> Paths {
    Paths {
        staging: dir.join(node).join("kubelet/staging").join(pod),
        target: dir.join(node).join("kubelet/pods").join(pod).join("mount"),
    }
}

async fn mount(ctl: &mut Controller, node: &Node, v: &csi::Volume, node_id: &str, p: &Paths) {
    let ctx = controller_publish(ctl, v, node_id, &ext4()).await.unwrap();
    stage_and_publish(&mut node.clone(), v, &ctx, p, &ext4()).await;
}

async fn unmount(ctl: &mut Controller, node: &Node, v: &csi::Volume, node_id: &str, p: &Paths) {
    unpublish_and_unstage(&mut node.clone(), v, p).await;
    controller_unpublish(ctl, v, node_id).await;
}

/// Writes `data` to `path`, fsynced. Not `support::write_durably`: its `syncfs` commits ext4's
/// journal and metadata across the filesystem, which the incremental backup's bound on what it
/// reads would then count as the file's change.
fn write_synced(path: &Path, data: &[u8]) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}

/// The manifest of backup `backup` of `volume` on the filesystem target at `root`.
fn manifest(root: &Path, volume: &str, backup: &str) -> wasmcsi_backup::Manifest {
    let key = wasmcsi_backup::layout::VolumeKeys::new(volume).unwrap().manifest(backup);
    serde_json::from_slice(&std::fs::read(root.join(key)).unwrap()).unwrap()
}

async fn start(home: &Path, name: &str, mode: wasmcsi_csi::Mode, nodes_file: &Path, target: &Path) -> Host {
    let options = Options { backup_target: Some(target.to_owned()), ..Default::default() };
    support::replicated::host(&home.join(name), name, mode, nodes_file, options).await
}

async fn flow() {
    let dir = tempfile::tempdir().unwrap();
    let target: PathBuf = dir.path().join("backups");
    std::fs::create_dir_all(&target).unwrap();
    let nodes_file = dir.path().join("replica-nodes");
    std::fs::write(&nodes_file, "").unwrap();
    let a = start(dir.path(), "node-a", wasmcsi_csi::Mode::All, &nodes_file, &target).await;
    let b = start(dir.path(), "node-b", wasmcsi_csi::Mode::Node, &nodes_file, &target).await;
    support::replicated::list_replica_nodes(&nodes_file, &[&a, &b]);
    let (mut ctl, node_a) = clients(&a.socket).await;
    let (_, node_b) = clients(&b.socket).await;

    let v = ctl.create_volume(create_request("pvc-src", None)).await.unwrap().into_inner().volume.unwrap();

    // Bad classes: refused, nothing made.
    for (class, says) in [
        (&[("type", "backup")][..], "needs parameter target"),
        (&[("type", "backup"), ("target", "elsewhere")][..], "not granted"),
        (&[("type", "copy")][..], "\"copy\""),
    ] {
        let e = ctl.create_snapshot(backup_request("bad", &v.volume_id, class)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{class:?}: {e:?}");
        assert!(e.message().contains(says), "{class:?}: {e:?}");
    }
    let none = ctl.list_snapshots(csi::ListSnapshotsRequest::default()).await.unwrap().into_inner();
    assert!(none.entries.is_empty(), "nothing made: {none:?}");

    // Point 1: one file; point 2: a second one.
    let src = paths(dir.path(), "node-a", "pod-src");
    mount(&mut ctl, &node_a, &v, "node-a", &src).await;
    let (one, two) = (pattern(1, 12 << 20), pattern(2, 1 << 20));
    write_synced(&src.target.join("one"), &one);
    let first = backed_up(&mut ctl, "snap-1", &v.volume_id).await;
    write_synced(&src.target.join("two"), &two);
    let second = backed_up(&mut ctl, "snap-2", &v.volume_id).await;
    unmount(&mut ctl, &node_a, &v, "node-a", &src).await;
    assert!(first.snapshot_id.ends_with(".local") && second.snapshot_id.ends_with(".local"), "{first:?}");
    assert_eq!(first.source_volume_id, v.volume_id);

    // The second backup read what changed since the first, not the volume.
    let set = v.volume_id.split_once(':').map_or(v.volume_id.as_str(), |(_, local)| local);
    let backups: Vec<String> = std::fs::read_dir(target.join("volumes").join(set).join("backups"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().trim_end_matches(".json").to_owned())
        .collect();
    assert_eq!(backups.len(), 2, "{backups:?}");
    let manifests: Vec<_> = backups.iter().map(|b| manifest(&target, set, b)).collect();
    let (full, incremental) =
        if manifests[0].parent.is_none() { (&manifests[0], &manifests[1]) } else { (&manifests[1], &manifests[0]) };
    assert_eq!(incremental.parent.as_deref(), Some(full.backup.as_str()), "incremental to the first");
    eprintln!(
        "full backup read {} KiB, uploaded {} KiB; incremental read {} KiB, uploaded {} KiB",
        full.stats.read_bytes >> 10,
        full.stats.uploaded_bytes >> 10,
        incremental.stats.read_bytes >> 10,
        incremental.stats.uploaded_bytes >> 10
    );
    assert!(full.stats.read_bytes >= one.len() as u64, "the full backup read the file: {:?}", full.stats);
    assert!(
        incremental.stats.read_bytes < full.stats.read_bytes / 2 && incremental.stats.read_bytes <= 8 << 20,
        "the incremental read only the changes: {:?} vs {:?}",
        incremental.stats,
        full.stats
    );

    // Listed by id and by volume, ready.
    let by_id = ctl
        .list_snapshots(csi::ListSnapshotsRequest { snapshot_id: second.snapshot_id.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(by_id.entries.len(), 1, "{by_id:?}");
    assert!(by_id.entries[0].snapshot.as_ref().unwrap().ready_to_use);
    let by_volume = ctl
        .list_snapshots(csi::ListSnapshotsRequest { source_volume_id: v.volume_id.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let mut ids: Vec<String> =
        by_volume.entries.iter().map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone()).collect();
    ids.sort();
    let mut want = vec![first.snapshot_id.clone(), second.snapshot_id.clone()];
    want.sort();
    assert_eq!(ids, want, "the backups, and no engine snapshot behind them");

    // The volume goes; its backups stay and restore, each its own point in time, on another node.
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() }).await.unwrap();
    for (name, snapshot, files) in
        [("pvc-at-2", &second, &[("one", &one), ("two", &two)][..]), ("pvc-at-1", &first, &[("one", &one)][..])]
    {
        let r = restored(&mut ctl, name, &snapshot.snapshot_id).await;
        let p = paths(dir.path(), "node-b", name);
        mount(&mut ctl, &node_b, &r, "node-b", &p).await;
        for (file, data) in files {
            let back = std::fs::read(p.target.join(file)).unwrap();
            assert!(back == **data, "{name}: {file} restored byte for byte");
        }
        assert!(files.len() == 2 || !p.target.join("two").exists(), "{name}: nothing of a later point");
        unmount(&mut ctl, &node_b, &r, "node-b", &p).await;
        ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: r.volume_id, ..Default::default() }).await.unwrap();
    }

    // Deleted: gone from the list and from the target (twice: idempotent).
    for _ in 0..2 {
        ctl.delete_snapshot(csi::DeleteSnapshotRequest {
            snapshot_id: first.snapshot_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let gone = ctl
        .list_snapshots(csi::ListSnapshotsRequest { snapshot_id: first.snapshot_id.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert!(gone.entries.is_empty(), "{gone:?}");

    // A chunk flipped on the target: the restore fails naming it, and never serves the volume.
    let chunks = target.join("volumes").join(set).join("chunks");
    let chunk = std::fs::read_dir(&chunks)
        .unwrap()
        .flat_map(|d| std::fs::read_dir(d.unwrap().path()).unwrap())
        .map(|e| e.unwrap().path())
        .find(|p| p.metadata().unwrap().len() > 4096)
        .expect("a data chunk");
    let mut bytes = std::fs::read(&chunk).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&chunk, bytes).unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let failed = loop {
        match ctl.create_volume(create_request("pvc-corrupt", Some(&second.snapshot_id))).await {
            Err(s) if s.code() == Code::Aborted => {
                assert!(Instant::now() < deadline, "no failure reported: {s:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(s) => break s,
            Ok(v) => panic!("a corrupt backup was restored: {v:?}"),
        }
    };
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    let name = chunk.file_name().unwrap().to_string_lossy().into_owned();
    assert!(failed.message().contains("corrupt") && failed.message().contains(&name), "{failed:?}");
    let leftover = ctl.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner();
    assert!(leftover.entries.is_empty(), "a failed restore is no volume: {leftover:?}");
    // The CO gives up on it: DeleteVolume of the id the name has removes the half-restored set.
    let corrupt = format!("{BACKEND}:{}", wasmcsi_backend_replicated_block::policy::volume_id("pvc-corrupt"));
    assert!(v.volume_id.starts_with(&format!("{BACKEND}:")), "ids are BACKEND:LOCAL: {}", v.volume_id);
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: corrupt, ..Default::default() }).await.unwrap();
    let again = ctl.create_volume(create_request("pvc-corrupt", None)).await.unwrap().into_inner().volume.unwrap();
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: again.volume_id, ..Default::default() }).await.unwrap();
    ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: second.snapshot_id.clone(), ..Default::default() })
        .await
        .unwrap();

    for h in [a, b] {
        h.shutdown().await.unwrap();
    }
    assert_eq!(mounts_under(dir.path()), Vec::<String>::new(), "nothing left mounted");
}
