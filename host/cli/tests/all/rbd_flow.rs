//! The ceph-rbd-shim backend end to end through the CSI socket, as kubelet and the sidecars
//! drive it: a real host (controller + node in one process, the component loaded from disk)
//! against a real Ceph cluster (`wasmcsi_ceph::Ceph`: 1 mon, 1 mgr, 2 OSDs, pool
//! size 2), the node attaching with rbd-fuse + loop (this kernel has neither krbd nor rbd-nbd)
//! and mounting XFS. Credentials are ceph-csi's `userID`/`userKey` secrets of a cephx user
//! limited to the test's pool.
//!
//! Flow: create → stage → publish → write → snapshot → change → clones from the snapshot and
//! from the volume, staged beside the original (XFS clones share its UUID) → expand online →
//! stats → unpublish → unstage → delete, every call also sent several times at once, as
//! retrying sidecars and kubelet do. Ends with nothing in the pool and nothing on the node
//! (mount, loop device, rbd-fuse).
//!
//! The same flow runs twice: here, where the node attaches with rbd-fuse + loop (this kernel
//! has neither krbd nor rbd-nbd), and in the kernel-VM tier (`testing/vmtest`), where the node
//! maps with krbd and Ceph runs inside the VM.
//!
//! Skipped (saying why) when not root or where Ceph cannot run; `WASMCSI_CEPH_TESTS=require`
//! (CI) turns the skip into a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::Code;
use wasmcsi_ceph::{CLUSTER, Ceph};
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use support::csi::at_once;
use support::{from_snapshot, from_volume};

fn mount_xfs() -> csi::VolumeCapability {
    support::single_node_writer(Some("xfs"))
}

type Controller = csi::controller_client::ControllerClient<tonic::transport::Channel>;
type Node = csi::node_client::NodeClient<tonic::transport::Channel>;

const POOL: &str = "flow";
const USER: &str = "csi-flow";
const MIB: i64 = 1 << 20;
/// mkfs.xfs refuses filesystems under 300 MB.
const SIZE: i64 = 320 * MIB;

struct Flow {
    ctl: Controller,
    node: Node,
    params: HashMap<String, String>,
    secrets: HashMap<String, String>,
    work: PathBuf,
    /// What the node mounts: `/dev/rbd` (krbd) or `/dev/loop` (rbd-fuse + loop).
    device_prefix: &'static str,
}

impl Flow {
    fn create_request(
        &self,
        name: &str,
        size: i64,
        source: Option<csi::VolumeContentSource>,
    ) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: size, limit_bytes: 0 }),
            volume_capabilities: vec![mount_xfs()],
            parameters: self.params.clone(),
            secrets: self.secrets.clone(),
            volume_content_source: source,
            ..Default::default()
        }
    }

    /// CreateVolume four times at once: one volume.
    async fn create(&self, name: &str, source: Option<csi::VolumeContentSource>) -> csi::Volume {
        let req = self.create_request(name, SIZE, source);
        let ctl = self.ctl.clone();
        let answers = at_once(4, &format!("create {name}"), || {
            let (mut ctl, req) = (ctl.clone(), req.clone());
            async move { ctl.create_volume(req).await }
        })
        .await;
        let vols: Vec<csi::Volume> = answers.into_iter().map(|a| a.volume.unwrap()).collect();
        assert!(vols.iter().all(|v| v.volume_id == vols[0].volume_id), "one volume per name: {vols:?}");
        assert_eq!(vols[0].capacity_bytes, SIZE);
        vols[0].clone()
    }

    fn paths(&self, name: &str) -> (PathBuf, PathBuf) {
        (self.work.join("staging").join(name), self.work.join("pods").join(name).join("mount"))
    }

    async fn stage_and_publish(&self, v: &csi::Volume, name: &str) -> PathBuf {
        let (staging, target) = self.paths(name);
        let stage = csi::NodeStageVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            volume_capability: Some(mount_xfs()),
            volume_context: v.volume_context.clone(),
            secrets: self.secrets.clone(),
            ..Default::default()
        };
        let node = self.node.clone();
        at_once(3, &format!("stage {name}"), || {
            let (mut node, req) = (node.clone(), stage.clone());
            async move { node.node_stage_volume(req).await }
        })
        .await;
        let publish = csi::NodePublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            target_path: target.to_string_lossy().into(),
            volume_capability: Some(mount_xfs()),
            volume_context: v.volume_context.clone(),
            ..Default::default()
        };
        at_once(3, &format!("publish {name}"), || {
            let (mut node, req) = (node.clone(), publish.clone());
            async move { node.node_publish_volume(req).await }
        })
        .await;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = mounts.lines().find(|l| l.contains(&format!(" {} ", target.display()))).expect("published");
        assert!(line.contains(&format!(" - xfs {}", self.device_prefix)), "an XFS on {}: {line}", self.device_prefix);
        target
    }

    async fn unpublish_and_unstage(&self, id: &str, name: &str) {
        let (staging, target) = self.paths(name);
        let unpublish =
            csi::NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.to_string_lossy().into() };
        let node = self.node.clone();
        at_once(3, &format!("unpublish {name}"), || {
            let (mut node, req) = (node.clone(), unpublish.clone());
            async move { node.node_unpublish_volume(req).await }
        })
        .await;
        let unstage = csi::NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.to_string_lossy().into(),
        };
        at_once(3, &format!("unstage {name}"), || {
            let (mut node, req) = (node.clone(), unstage.clone());
            async move { node.node_unstage_volume(req).await }
        })
        .await;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        for p in [&staging, &target] {
            assert!(!mounts.contains(&format!(" {} ", p.display())), "{} is still mounted", p.display());
        }
    }

    async fn delete_volume(&self, id: &str) {
        let req = csi::DeleteVolumeRequest { volume_id: id.into(), secrets: self.secrets.clone() };
        let ctl = self.ctl.clone();
        at_once(3, &format!("delete {id}"), || {
            let (mut ctl, req) = (ctl.clone(), req.clone());
            async move { ctl.delete_volume(req).await }
        })
        .await;
    }
}

/// Pseudo-random bytes (xorshift), different for each seed.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes `data` to `path` and makes it durable, as a database does before it acknowledges.
fn write_durably(path: &Path, data: &[u8]) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
    nix::unistd::syncfs(&f).unwrap();
}

fn read(path: &Path) -> Vec<u8> {
    let mut v = vec![];
    std::fs::File::open(path).unwrap().read_to_end(&mut v).unwrap();
    v
}

/// Loop devices whose backing file is under `dir` (read from sysfs: `losetup` could block on
/// a dead FUSE file).
fn loops_backed_under(dir: &str) -> Vec<String> {
    let mut found = vec![];
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).unwrap_or_default();
        if backing.starts_with(dir) {
            found.push(format!("{}: {}", e.file_name().to_string_lossy(), backing.trim()));
        }
    }
    found
}

/// rbd-fuse processes whose command line names `dir`.
fn rbd_fuse_under(dir: &str) -> Vec<String> {
    let mut found = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.starts_with("rbd-fuse") && cmd.contains(dir) {
            found.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
        }
    }
    found
}

#[test]
fn rbd_volume_lifecycle_through_the_csi_socket_with_retries_and_concurrency() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root (Ceph in a private namespace, rbd-fuse, loop devices, mounts)");
        return;
    }
    let Some(ceph) = Ceph::shared() else { return };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    assert!(!wasmcsi_rbd::krbd::available(), "this kernel maps RBD: the rbd-fuse path is not what runs here");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(flow(ceph, "/dev/loop"));
}

/// The same flow in the kernel-VM tier: the node maps the images with krbd. Ceph (memstore)
/// starts inside the VM, under TCG: slow, hence the generous timeout.
#[test]
fn rbd_volume_lifecycle_with_krbd_in_the_vm() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root");
        return;
    }
    let vm = wasmcsi_vmtest::Vm::new().timeout(Duration::from_secs(1500)).mem_mib(3072).env("TMPDIR", "/scratch");
    let Some(_guest) = wasmcsi_vmtest::enter!(vm) else { return };
    assert!(wasmcsi_rbd::krbd::available(), "the VM's kernel maps RBD images");
    let Some(ceph) = Ceph::shared() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(flow(ceph, "/dev/rbd"));
}

async fn flow(ceph: &Ceph, device_prefix: &'static str) {
    ceph.create_pool(POOL).expect("pool");
    let key = ceph.create_user(USER, POOL).expect("user");
    let dir = tempfile::tempdir().unwrap();
    let host = support::ceph_rbd_shim_host(ceph, POOL, dir.path(), "flow-node").await;
    let channel = wasmcsi::host::connect(&host.socket).await.unwrap();
    let f = Flow {
        ctl: csi::controller_client::ControllerClient::new(channel.clone()),
        node: csi::node_client::NodeClient::new(channel),
        params: [("backend", "ceph-rbd-shim"), ("clusterID", CLUSTER), ("pool", POOL), ("imageFeatures", "layering")]
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect(),
        secrets: [("userID", USER.to_string()), ("userKey", key.clone())]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        work: dir.path().join("kubelet"),
        device_prefix,
    };
    let mut ctl = f.ctl.clone();
    let mut node = f.node.clone();

    // bad input: a clear error with the right code, nothing created
    let mut bad = f.create_request("pvc-bad", SIZE, None);
    bad.parameters.insert("poool".into(), POOL.into());
    let e = ctl.create_volume(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("poool"), "names the parameter: {e:?}");
    let mut no_key = f.create_request("pvc-bad", SIZE, None);
    no_key.secrets.remove("userKey");
    let e = ctl.create_volume(no_key).await.unwrap_err();
    assert_ne!(e.code(), Code::Ok);
    assert!(!e.message().contains(&key), "never the key in an error");
    assert!(ceph.rbd(&["ls", POOL]).unwrap().trim().is_empty(), "bad requests created nothing");

    // create: retried at once, one image; same name, other size: AlreadyExists
    let v = f.create("pvc-1", None).await;
    let e = ctl.create_volume(f.create_request("pvc-1", 2 * SIZE, None)).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    assert_eq!(ceph.rbd(&["ls", POOL]).unwrap().lines().count(), 1);

    // stage + publish (rbd-fuse + loop + mkfs.xfs + mount), write durably
    let t1 = f.stage_and_publish(&v, "pvc-1").await;
    let before = pattern(1, 8 << 20);
    write_durably(&t1.join("data.bin"), &before);

    // snapshot, retried at once: one snapshot, ready at once (RBD snapshots are instant)
    let snap_req = csi::CreateSnapshotRequest {
        source_volume_id: v.volume_id.clone(),
        name: "snap-1".into(),
        secrets: f.secrets.clone(),
        ..Default::default()
    };
    let snaps = at_once(3, "snapshot", || {
        let (mut ctl, req) = (ctl.clone(), snap_req.clone());
        async move { ctl.create_snapshot(req).await }
    })
    .await;
    let snap = snaps[0].snapshot.clone().unwrap();
    assert!(snaps.iter().all(|s| s.snapshot.as_ref().unwrap().snapshot_id == snap.snapshot_id), "{snaps:?}");
    assert!(snap.ready_to_use && snap.source_volume_id == v.volume_id, "{snap:?}");
    let listed = ctl
        .list_snapshots(csi::ListSnapshotsRequest { source_volume_id: v.volume_id.clone(), ..Default::default() })
        .await
        .expect("list snapshots")
        .into_inner();
    assert_eq!(
        listed.entries.iter().filter_map(|e| e.snapshot.as_ref()).map(|s| &s.snapshot_id).collect::<Vec<_>>(),
        [&snap.snapshot_id]
    );

    // the volume changes after the cut
    let after = pattern(2, 8 << 20);
    write_durably(&t1.join("data.bin"), &after);

    // clones from the snapshot and from the volume, staged on the same node as the original
    let c1 = f.create("pvc-2", Some(from_snapshot(&snap.snapshot_id))).await;
    let c2 = f.create("pvc-3", Some(from_volume(&v.volume_id))).await;
    let t2 = f.stage_and_publish(&c1, "pvc-2").await;
    let t3 = f.stage_and_publish(&c2, "pvc-3").await;
    assert!(read(&t2.join("data.bin")) == before, "the clone of the snapshot holds the data at the cut");
    assert!(read(&t3.join("data.bin")) == after, "the clone of the volume holds its data now");
    write_durably(&t2.join("own.bin"), &pattern(3, 1 << 20));
    assert!(!t1.join("own.bin").exists(), "a clone's writes stay in the clone");

    // expand online: the controller resizes the image, the node grows the XFS while mounted
    let expand = csi::ControllerExpandVolumeRequest {
        volume_id: v.volume_id.clone(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 2 * SIZE, limit_bytes: 0 }),
        volume_capability: Some(mount_xfs()),
        secrets: f.secrets.clone(),
    };
    let grown = at_once(3, "expand", || {
        let (mut ctl, req) = (ctl.clone(), expand.clone());
        async move { ctl.controller_expand_volume(req).await }
    })
    .await;
    assert!(grown.iter().all(|g| g.capacity_bytes == 2 * SIZE && g.node_expansion_required), "{grown:?}");
    let (s1, _) = f.paths("pvc-1");
    let node_expand = csi::NodeExpandVolumeRequest {
        volume_id: v.volume_id.clone(),
        volume_path: t1.to_string_lossy().into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 2 * SIZE, limit_bytes: 0 }),
        staging_target_path: s1.to_string_lossy().into(),
        volume_capability: Some(mount_xfs()),
        ..Default::default()
    };
    at_once(2, "node expand", || {
        let (mut node, req) = (node.clone(), node_expand.clone());
        async move { node.node_expand_volume(req).await }
    })
    .await;
    let st = nix::sys::statvfs::statvfs(&t1).unwrap();
    let total = st.blocks() * st.fragment_size();
    assert!(total > (SIZE as u64) * 3 / 2, "the mounted XFS grew: {total} bytes");
    assert!(read(&t1.join("data.bin")) == after, "data intact after growing");

    // stats
    let stats = node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: t1.to_string_lossy().into(),
            staging_target_path: s1.to_string_lossy().into(),
        })
        .await
        .expect("stats")
        .into_inner();
    let bytes = stats.usage.iter().find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32).expect("bytes");
    assert!(bytes.total as u64 > (SIZE as u64) * 3 / 2 && bytes.used >= 8 << 20, "{stats:?}");
    assert_eq!(stats.volume_condition.map(|c| c.abnormal), Some(false));
    let got = ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 2 * SIZE);

    // teardown in kubelet's order, then the controller's
    f.unpublish_and_unstage(&c2.volume_id, "pvc-3").await;
    f.unpublish_and_unstage(&c1.volume_id, "pvc-2").await;
    f.unpublish_and_unstage(&v.volume_id, "pvc-1").await;
    let work = f.work.to_string_lossy().into_owned();
    assert_eq!(loops_backed_under(&dir.path().to_string_lossy()), Vec::<String>::new(), "loop devices left");
    assert_eq!(rbd_fuse_under(&dir.path().to_string_lossy()), Vec::<String>::new(), "rbd-fuse left");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&work), "mounts left under {work}:\n{mounts}");

    // The source volume goes first while its snapshot and clones exist (ceph-csi's order does
    // not matter to the spec): the clones and the snapshot keep their data.
    f.delete_volume(&v.volume_id).await;
    let t2 = f.stage_and_publish(&c1, "pvc-2").await;
    assert!(read(&t2.join("data.bin")) == before, "the clone survives its source's deletion");
    f.unpublish_and_unstage(&c1.volume_id, "pvc-2").await;
    let del_snap = csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id.clone(), secrets: f.secrets.clone() };
    at_once(3, "delete snapshot", || {
        let (mut ctl, req) = (ctl.clone(), del_snap.clone());
        async move { ctl.delete_snapshot(req).await }
    })
    .await;
    f.delete_volume(&c1.volume_id).await;
    f.delete_volume(&c2.volume_id).await;
    for id in [&v.volume_id, &c1.volume_id, &c2.volume_id] {
        let gone =
            ctl.controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id.clone() }).await.unwrap_err();
        assert_eq!(gone.code(), Code::NotFound, "{id}: {gone:?}");
    }
    let left = ceph.rbd(&["ls", "--long", POOL]).unwrap();
    assert!(left.trim().is_empty(), "left in the pool: {left}");
    let trash = ceph.rbd(&["trash", "ls", POOL]).unwrap();
    assert!(trash.trim().is_empty(), "left in the pool's trash: {trash}");
    host.shutdown().await.unwrap();
}
