//! The paths kubelet names for a volume, through the Node service with real bind mounts: a
//! target under a symlinked parent (a relocated `/var/lib/kubelet`) is published once, found
//! again by a retry and by unpublish, and measured as mounted; a target that is a symlink is
//! refused with nothing mounted where it points; relative paths are refused (issue 13, item 7).
//! The volumes are directories planned by a natively linked backend (`bind` under a granted
//! root). Skipped, saying why, when not root.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tonic::Code;
use wasmcsi_csi::driver::{Driver, Mode};
use wasmcsi_csi::node::mounts::KernelMounts;
use wasmcsi_csi::node::{Attachers, NodeService, NodeSetup, mountinfo};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::node_server::Node;
use wasmcsi_runtime::bindings::driver::*;
use wasmcsi_runtime::bindings::types::Error;
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::native::{Guest, NativeDriver};
use wasmcsi_runtime::{Registry, Runtime, RuntimeOptions};

/// Plans every volume as the directory of its id under the root `data`.
struct Dirs;

impl Guest for Dirs {
    fn info() -> BackendInfo {
        BackendInfo { name: "dirs".into(), version: "0".into(), parameters: vec![], features: vec![] }
    }
    fn attach_plan(volume_id: String, _: Vec<Pair>, _: VolumeCapability) -> Result<Attachment, Error> {
        Ok(Attachment::Bind(BindPlan { root: "data".into(), path: volume_id, capacity_bytes: 1 << 20 }))
    }
}

/// A node over a fresh directory: `data/` (the granted root), `real/` (kubelet's directory)
/// and `kubelet -> real`. Dropping it detaches every mount under it first, also after a
/// failed assertion.
struct TestNode {
    svc: NodeService,
    root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for TestNode {
    fn drop(&mut self) {
        for _ in 0..16 {
            let Ok(table) = mountinfo::read_current() else { return };
            let mut inside: Vec<_> = table.iter().filter(|e| e.mount_point.starts_with(&self.root)).collect();
            if inside.is_empty() {
                return;
            }
            inside.sort_by_key(|e| std::cmp::Reverse(e.mount_id));
            for entry in inside {
                let _ = nix::mount::umount2(&entry.mount_point, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

fn node() -> Option<TestNode> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping: bind mounts need root");
        return None;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().canonicalize().expect("canonical");
    for sub in ["data/v1", "real/staging/v1", "real/pods", "elsewhere"] {
        std::fs::create_dir_all(root.join(sub)).expect("tree");
    }
    std::os::unix::fs::symlink(root.join("real"), root.join("kubelet")).expect("symlink");
    let toml = format!("[backends.dirs.grants]\ndir = {{ data = \"{}/data\" }}\n", root.display());
    let config = HostConfig::parse(&toml, Path::new("test")).expect("config");
    let runtime = Runtime::new(RuntimeOptions {
        config: config.clone(),
        cache_dir: None,
        store_path: root.join("meta.redb"),
        engine: Default::default(),
    })
    .expect("runtime");
    let registry = Registry::new(runtime.clone(), None, None);
    registry.insert(runtime.load_native("dirs", NativeDriver::of::<Dirs>()).expect("native backend"));
    let driver = Driver {
        name: "wasmcsi.test".into(),
        version: "0".into(),
        mode: Mode::Node,
        node_id: "node-1".into(),
        registry,
        inflight: Default::default(),
        node_local: Default::default(),
        attachers: Attachers::new(NodeSetup {
            node_id: "node-1".into(),
            state_dir: root.join("state"),
            config: Arc::new(config),
            mounts: Arc::new(KernelMounts),
            runtime_dir: root.join("run"),
            datapath: None,
        }),
    };
    Some(TestNode { svc: NodeService(Arc::new(driver)), root, _dir: dir })
}

fn cap() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    }
}

fn mounts_at(path: &Path) -> usize {
    mountinfo::mounts_at(&mountinfo::read_current().expect("mount table"), path).len()
}

impl TestNode {
    fn staging(&self) -> PathBuf {
        self.root.join("real/staging/v1")
    }

    async fn stage(&self) {
        let req = csi::NodeStageVolumeRequest {
            volume_id: "dirs:v1".into(),
            staging_target_path: self.staging().display().to_string(),
            volume_capability: Some(cap()),
            ..Default::default()
        };
        self.svc.node_stage_volume(tonic::Request::new(req)).await.expect("stage");
    }

    async fn publish(&self, target: &str) -> Result<(), tonic::Status> {
        let req = csi::NodePublishVolumeRequest {
            volume_id: "dirs:v1".into(),
            staging_target_path: self.staging().display().to_string(),
            target_path: target.into(),
            volume_capability: Some(cap()),
            ..Default::default()
        };
        self.svc.node_publish_volume(tonic::Request::new(req)).await.map(drop)
    }

    async fn unpublish(&self, target: &str) -> Result<(), tonic::Status> {
        let req = csi::NodeUnpublishVolumeRequest { volume_id: "dirs:v1".into(), target_path: target.into() };
        self.svc.node_unpublish_volume(tonic::Request::new(req)).await.map(drop)
    }

    async fn stats(&self, path: &str) -> Result<csi::NodeGetVolumeStatsResponse, tonic::Status> {
        let req = csi::NodeGetVolumeStatsRequest {
            volume_id: "dirs:v1".into(),
            volume_path: path.into(),
            ..Default::default()
        };
        self.svc.node_get_volume_stats(tonic::Request::new(req)).await.map(tonic::Response::into_inner)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_target_under_a_symlinked_parent_is_published_once_and_unpublished() {
    let Some(n) = node() else { return };
    n.stage().await;
    let spelled = n.root.join("kubelet/pods/p1/mount");
    let canonical = n.root.join("real/pods/p1/mount");
    let target = spelled.display().to_string();

    n.publish(&target).await.expect("publish");
    assert_eq!(mounts_at(&canonical), 1, "published where the mount table shows it");
    n.publish(&target).await.expect("a retry");
    assert_eq!(mounts_at(&canonical), 1, "a retry finds the mount instead of stacking another");

    let stats = n.stats(&target).await.expect("stats");
    // Inodes in one scope, the volume's: its tree's count, and total = used + available (the
    // filesystem's total beside the volume's used mixed two scopes).
    let inodes = stats.usage.iter().find(|u| u.unit == csi::volume_usage::Unit::Inodes as i32).expect("inodes");
    assert!(inodes.used >= 1 && inodes.used < 100, "the volume's own inodes: {inodes:?}");
    assert_eq!(inodes.used + inodes.available, inodes.total, "one scope: {inodes:?}");
    let condition = stats.volume_condition.expect("condition");
    assert!(!condition.abnormal, "the published volume is seen mounted: {condition:?}");

    n.unpublish(&target).await.expect("unpublish");
    assert_eq!(mounts_at(&canonical), 0, "unpublish finds the mount");
    assert!(!canonical.exists(), "the target is removed");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_target_that_is_a_symlink_is_refused_with_nothing_mounted_where_it_points() {
    let Some(n) = node() else { return };
    n.stage().await;
    let link = n.root.join("real/pods/p2/mount");
    std::fs::create_dir_all(link.parent().expect("parent")).expect("pod directory");
    std::os::unix::fs::symlink(n.root.join("elsewhere"), &link).expect("symlink");

    let refused = n.publish(&link.display().to_string()).await.expect_err("a symlink target");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("symbolic link"), "{refused:?}");
    assert_eq!(mounts_at(&n.root.join("elsewhere")), 0, "nothing mounted at the link's destination");

    // Unpublish removes the link itself and leaves its destination alone.
    n.unpublish(&link.display().to_string()).await.expect("unpublish");
    assert!(std::fs::symlink_metadata(&link).is_err(), "the link is removed");
    assert!(n.root.join("elsewhere").is_dir(), "its destination stays");
}

#[tokio::test(flavor = "multi_thread")]
async fn relative_paths_are_refused() {
    let Some(n) = node() else { return };
    n.stage().await;
    for result in [n.publish("pods/p3/mount").await.map(drop), n.stats("real/staging/v1").await.map(drop)] {
        let status = result.expect_err("a relative path");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("absolute"), "{status:?}");
    }
    assert!(!Path::new("pods").exists(), "nothing made under the working directory");
}
