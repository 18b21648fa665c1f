//! SINGLE_NODE_SINGLE_WRITER through the Node service with real bind mounts: a volume published
//! with it at one target is refused at a second one (FAILED_PRECONDITION, nothing mounted there),
//! the same target again is OK, and once the first target is unpublished the second works. What
//! is published where comes from the mount table, so a restarted plugin (a new service over the
//! same node) refuses the second target too. SINGLE_NODE_WRITER keeps allowing several targets
//! (kubelet publishes a RWO volume once per pod on the node). The volumes are directories planned
//! by a natively linked backend (`bind` under a granted root). Skipped, saying why, when not root.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use csi::volume_capability::access_mode::Mode;
use tonic::Code;
use wasmcsi_csi::driver::{Driver, Mode as ServiceMode};
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

/// A node's directories (`data/` the granted root, `staging/`, `pods/`); dropping it detaches
/// every mount under it first, also after a failed assertion.
struct Tree {
    root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Tree {
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

fn tree() -> Option<Tree> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping: bind mounts need root");
        return None;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().canonicalize().expect("canonical");
    for sub in ["data/v1", "data/v2", "staging/v1", "staging/v2", "pods"] {
        std::fs::create_dir_all(root.join(sub)).expect("tree");
    }
    Some(Tree { root, _dir: dir })
}

/// A node plugin over `tree`, as freshly started: nothing in memory.
fn service(tree: &Tree, state: &str) -> NodeService {
    let root = &tree.root;
    let toml = format!("[backends.dirs.grants]\ndir = {{ data = \"{}/data\" }}\n", root.display());
    let config = HostConfig::parse(&toml, Path::new("test")).expect("config");
    let runtime = Runtime::new(RuntimeOptions {
        config: config.clone(),
        cache_dir: None,
        store_path: root.join(format!("{state}.redb")),
        engine: Default::default(),
    })
    .expect("runtime");
    let registry = Registry::new(runtime.clone(), None, None);
    registry.insert(runtime.load_native("dirs", NativeDriver::of::<Dirs>()).expect("native backend"));
    NodeService(Arc::new(Driver {
        name: "wasmcsi.test".into(),
        version: "0".into(),
        mode: ServiceMode::Node,
        node_id: "node-1".into(),
        registry,
        inflight: Default::default(),
        node_local: Default::default(),
        attachers: Attachers::new(NodeSetup {
            node_id: "node-1".into(),
            state_dir: root.join(state),
            config: Arc::new(config),
            mounts: Arc::new(KernelMounts),
            runtime_dir: root.join("run"),
            datapath: None,
        }),
    }))
}

fn cap(mode: Mode) -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

fn mounted(path: &Path) -> bool {
    !mountinfo::mounts_at(&mountinfo::read_current().expect("mount table"), path).is_empty()
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
