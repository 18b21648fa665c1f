//! The paths kubelet names for a volume, through the Node service with real bind mounts: a
//! target under a symlinked parent (a relocated `/var/lib/kubelet`) is published once, found
//! again by a retry and by unpublish, and measured as mounted; a target that is a symlink is
//! refused with nothing mounted where it points; relative paths are refused; NodeGetVolumeStats
//! on a path that is not the volume (nothing mounted there, or another directory) is NOT_FOUND.
//! The volumes are directories planned by a natively linked backend (`bind` under a granted
//! root). Skipped, saying why, when not root.
use std::path::{Path, PathBuf};

use tonic::Code;
use wasmcsi_csi::node::NodeService;
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::node_server::Node;

use crate::bind_node::{Tree, service, tree};

/// A node over a fresh directory: `data/` (the granted root), `real/` (kubelet's directory)
/// and `kubelet -> real`. Dropping it detaches every mount under it first, also after a
/// failed assertion (its [`Tree`]'s drop).
struct TestNode {
    svc: NodeService,
    root: PathBuf,
    _tree: Tree,
}

fn node() -> Option<TestNode> {
    let tree = tree(&["data/v1", "real/staging/v1", "real/pods", "elsewhere"])?;
    let root = tree.root.clone();
    std::os::unix::fs::symlink(root.join("real"), root.join("kubelet")).expect("symlink");
    Some(TestNode { svc: service(&tree, "meta.redb", "state"), root, _tree: tree })
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

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_volume_is_not_found_before_its_path_is_judged() {
    let Some(n) = node() else { return };
    // No id this driver makes: NOT_FOUND, though the path is relative (which a known volume's
    // call refuses as INVALID_ARGUMENT, as `relative_paths_are_refused` shows). An id of a
    // backend not loaded here is UNAVAILABLE instead (it may be loaded again), so not this case.
    for volume_id in ["no-backend-id", "not an id of ours"] {
        let stats = csi::NodeGetVolumeStatsRequest {
            volume_id: volume_id.into(),
            volume_path: "some/path".into(),
            ..Default::default()
        };
        let status = n.svc.node_get_volume_stats(tonic::Request::new(stats)).await.expect_err("unknown volume");
        assert_eq!(status.code(), Code::NotFound, "{volume_id}: {status:?}");
        let expand = csi::NodeExpandVolumeRequest {
            volume_id: volume_id.into(),
            volume_path: "some/path".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }),
            ..Default::default()
        };
        let status = n.svc.node_expand_volume(tonic::Request::new(expand)).await.expect_err("unknown volume");
        assert_eq!(status.code(), Code::NotFound, "{volume_id}: {status:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_of_a_path_that_is_not_the_volume_is_not_found() {
    let Some(n) = node() else { return };
    n.stage().await;
    let stats = n.stats(&n.staging().display().to_string()).await.expect("the staging path is the volume");
    assert!(!stats.volume_condition.expect("condition").abnormal);

    // A directory with nothing mounted on it.
    let status = n.stats(&n.root.join("elsewhere").display().to_string()).await.expect_err("not mounted");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(status.message().contains("nothing is mounted"), "{status:?}");

    // Another directory bound where a target would be.
    let other = n.root.join("data/other");
    let target = n.root.join("real/pods/p4/mount");
    std::fs::create_dir_all(&other).expect("other");
    std::fs::create_dir_all(&target).expect("target");
    nix::mount::mount(Some(&other), &target, None::<&str>, nix::mount::MsFlags::MS_BIND, None::<&str>).expect("bind");
    let status = n.stats(&target.display().to_string()).await.expect_err("another directory");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(status.message().contains("another directory"), "{status:?}");
}
