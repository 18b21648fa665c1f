//! SINGLE_NODE_SINGLE_WRITER through the Node service with real bind mounts: a volume published
//! with it at one target is refused at a second one (FAILED_PRECONDITION, nothing mounted there),
//! the same target again is OK, and once the first target is unpublished the second works. What
//! is published where comes from the mount table, so a restarted plugin (a new service over the
//! same node) refuses the second target too. SINGLE_NODE_WRITER keeps allowing several targets
//! (kubelet publishes a RWO volume once per pod on the node). The volumes are directories planned
//! by a natively linked backend (`bind` under a granted root). Skipped, saying why, when not root.
use std::path::Path;

use csi::volume_capability::access_mode::Mode;
use tonic::Code;
use wasmcsi_csi::node::NodeService;
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::node_server::Node;

use crate::bind_node::{self, Tree};

fn tree() -> Option<Tree> {
    bind_node::tree(&["data/v1", "data/v2", "staging/v1", "staging/v2", "pods"])
}

/// A node plugin over `tree`, as freshly started: nothing in memory.
fn service(tree: &Tree, state: &str) -> NodeService {
    bind_node::service(tree, &format!("{state}.redb"), state)
}

fn cap(mode: Mode) -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

fn mounted(path: &Path) -> bool {
    mountinfo::is_mount_point(path).expect("mount table")
}

async fn stage(svc: &NodeService, tree: &Tree, volume: &str) {
    let req = csi::NodeStageVolumeRequest {
        volume_id: format!("dirs:{volume}"),
        staging_target_path: tree.root.join("staging").join(volume).display().to_string(),
        volume_capability: Some(cap(Mode::SingleNodeWriter)),
        ..Default::default()
    };
    svc.node_stage_volume(tonic::Request::new(req)).await.expect("stage");
}

async fn publish(svc: &NodeService, tree: &Tree, volume: &str, pod: &str, mode: Mode) -> Result<(), tonic::Status> {
    let req = csi::NodePublishVolumeRequest {
        volume_id: format!("dirs:{volume}"),
        staging_target_path: tree.root.join("staging").join(volume).display().to_string(),
        target_path: tree.root.join("pods").join(pod).join("mount").display().to_string(),
        volume_capability: Some(cap(mode)),
        ..Default::default()
    };
    svc.node_publish_volume(tonic::Request::new(req)).await.map(drop)
}

async fn unpublish(svc: &NodeService, tree: &Tree, volume: &str, pod: &str) {
    let req = csi::NodeUnpublishVolumeRequest {
        volume_id: format!("dirs:{volume}"),
        target_path: tree.root.join("pods").join(pod).join("mount").display().to_string(),
    };
    svc.node_unpublish_volume(tonic::Request::new(req)).await.expect("unpublish");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_single_writer_volume_is_published_at_one_target_even_after_a_restart() {
    let Some(t) = tree() else { return };
    let svc = service(&t, "state-1");
    stage(&svc, &t, "v1").await;
    stage(&svc, &t, "v2").await;
    let target = |pod: &str| t.root.join("pods").join(pod).join("mount");

    publish(&svc, &t, "v1", "a", Mode::SingleNodeSingleWriter).await.expect("the first target");
    publish(&svc, &t, "v1", "a", Mode::SingleNodeSingleWriter).await.expect("the same target again");
    let refused = publish(&svc, &t, "v1", "b", Mode::SingleNodeSingleWriter).await.expect_err("a second target");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains(&target("a").display().to_string()), "names where it is published: {refused:?}");
    assert!(!mounted(&target("b")) && !target("b").exists(), "nothing made at the refused target");
    // Another volume is another matter.
    publish(&svc, &t, "v2", "b", Mode::SingleNodeSingleWriter).await.expect("another volume");

    // A restarted plugin knows nothing but the mount table, and refuses all the same.
    drop(svc);
    let svc = service(&t, "state-2");
    let refused = publish(&svc, &t, "v1", "c", Mode::SingleNodeSingleWriter).await.expect_err("after a restart");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    publish(&svc, &t, "v1", "a", Mode::SingleNodeSingleWriter).await.expect("the same target, after a restart");

    // Unpublished at the first target, the volume may go to another.
    unpublish(&svc, &t, "v1", "a").await;
    publish(&svc, &t, "v1", "c", Mode::SingleNodeSingleWriter).await.expect("the first target is gone");
    assert!(mounted(&target("c")));
    for (volume, pod) in [("v1", "c"), ("v2", "b")] {
        unpublish(&svc, &t, volume, pod).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn other_access_modes_publish_at_several_targets() {
    let Some(t) = tree() else { return };
    let svc = service(&t, "state");
    stage(&svc, &t, "v1").await;
    for (pod, mode) in
        [("a", Mode::SingleNodeWriter), ("b", Mode::SingleNodeWriter), ("c", Mode::SingleNodeMultiWriter)]
    {
        publish(&svc, &t, "v1", pod, mode).await.unwrap_or_else(|s| panic!("{pod}: {s:?}"));
        assert!(mounted(&t.root.join("pods").join(pod).join("mount")), "{pod}");
    }
    // Published at several targets already, the volume takes no single-writer publish.
    let refused = publish(&svc, &t, "v1", "d", Mode::SingleNodeSingleWriter).await.expect_err("single writer");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    for pod in ["a", "b", "c"] {
        unpublish(&svc, &t, "v1", pod).await;
    }
}
