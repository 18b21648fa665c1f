//! A plan is the backend's word, a grant the operator's: NodeStageVolume must carry out no plan
//! the backend's grants do not cover, whatever its kind. A backend linked natively (no sandbox
//! needed: what is under test is what the node does with an answer) plans, for a volume id
//! `KIND.NAME`, an attachment of that kind on resources nobody granted it; each stage must
//! fail with FAILED_PRECONDITION naming the missing grant, with nothing mounted at the staging
//! path. Unprivileged: every refusal comes before a mount is tried.
use std::path::Path;
use std::sync::Arc;

use tonic::Code;
use wasmcsi_csi::node::mounts::KernelMounts;
use wasmcsi_csi::node::{Attachers, NodeService, NodeSetup};
use wasmcsi_csi::plugin::{Mode, Plugin};
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::node_server::Node;
use wasmcsi_runtime::bindings::driver::*;
use wasmcsi_runtime::bindings::types::Error;
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::native::{Guest, NativeDriver};
use wasmcsi_runtime::{Registry, Runtime, RuntimeOptions};

/// Plans whatever its volume id names, on resources of its own choosing.
struct Overreach;

impl Guest for Overreach {
    fn info() -> BackendInfo {
        BackendInfo { name: "overreach".into(), version: "0".into(), parameters: vec![], features: vec![] }
    }
    fn attach_plan(
        volume_id: String,
        _: Vec<Pair>,
        _: VolumeCapability,
        _: Vec<SecretRef>,
    ) -> Result<Attachment, Error> {
        let (kind, name) = volume_id.split_once('.').ok_or_else(|| Error::NotFound(volume_id.clone()))?;
        Ok(match kind {
            "nfs" => Attachment::Nfs(NfsPlan {
                server: "127.0.0.1".into(),
                share: "/export".into(),
                path: name.into(),
                mount_options: vec![],
            }),
            "bind" => Attachment::Bind(BindPlan { root: "data".into(), path: name.into(), capacity_bytes: 1 << 20 }),
            "rbd" => Attachment::Rbd(RbdPlan {
                cluster: "ceph".into(),
                pool: "other".into(),
                image: name.into(),
                secrets: vec![
                    SecretRef { key: "userID".into(), handle: 0 },
                    SecretRef { key: "userKey".into(), handle: 1 },
                ],
                encryption: None,
            }),
            other => return Err(Error::NotFound(format!("no kind {other}"))),
        })
    }
}

/// A node whose configuration grants the backend `overreach` other resources than the ones it
/// plans: another NFS export, another dir root, another pool of the one Ceph cluster.
struct TestNode {
    svc: NodeService,
    staging: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

fn node() -> TestNode {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().canonicalize().expect("canonical");
    let toml = format!(
        "[clusters.ceph]\nmonitors = [\"127.0.0.1:6789\"]\n\
         [backends.overreach.grants]\n\
         dir = {{ other = \"{root}/other\" }}\n\
         nfs = [{{ server = \"127.0.0.1\", share = \"/elsewhere\" }}]\n\
         rbd = [{{ cluster = \"ceph\", pools = [\"granted\"] }}]\n",
        root = root.display()
    );
    let config = HostConfig::parse(&toml, Path::new("test")).expect("config");
    let runtime = Runtime::new(RuntimeOptions {
        config: config.clone(),
        cache_dir: None,
        store_path: root.join("meta.redb"),
        wasm_engine: Default::default(),
    })
    .expect("runtime");
    let registry = Registry::new(runtime.clone(), None, None);
    registry.insert(runtime.load_native("overreach", NativeDriver::of::<Overreach>()).expect("native backend"));
    let driver = Plugin {
        name: "wasmcsi.test".into(),
        version: "0".into(),
        mode: Mode::Node,
        node_id: "node-1".into(),
        registry,
        inflight: Default::default(),
        node_local: Default::default(),
        nodes: Default::default(),
        grant_signer: None,
        attachers: Attachers::new(NodeSetup {
            node_id: "node-1".into(),
            state_dir: root.join("state"),
            config: Arc::new(config),
            mounts: Arc::new(KernelMounts),
            runtime_dir: root.join("run"),
            datapath: None,
        }),
    };
    TestNode { svc: NodeService(Arc::new(driver)), staging: root.join("staging"), _dir: dir }
}

fn stage_request(volume_id: &str, staging: &Path) -> csi::NodeStageVolumeRequest {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
        }),
        secrets: [("userID", "u"), ("userKey", "k")].into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
        ..Default::default()
    }
}

/// Stages `volume_id` and expects a refusal naming `missing`, with nothing mounted.
async fn assert_refused(volume_id: &str, missing: &str) {
    let n = node();
    let status = n
        .svc
        .node_stage_volume(tonic::Request::new(stage_request(volume_id, &n.staging)))
        .await
        .expect_err("a plan outside the grants must be refused");
    assert_eq!(status.code(), Code::FailedPrecondition, "{volume_id}: {status:?}");
    assert!(status.message().contains(missing), "{volume_id}: the message names {missing:?}: {status:?}");
    let table = mountinfo::read_current().expect("mount table");
    assert!(mountinfo::mounts_at(&table, &n.staging).is_empty(), "{volume_id}: something was mounted");
    assert!(!n.staging.exists(), "{volume_id}: the staging path was created");
}

#[tokio::test]
async fn an_nfs_plan_for_an_export_not_granted_is_refused_before_any_mount() {
    assert_refused("overreach:nfs.v1", "nfs export 127.0.0.1:/export is not granted to backend overreach").await;
}

#[tokio::test]
async fn a_bind_plan_under_a_root_not_granted_is_refused() {
    assert_refused("overreach:bind.v1", "dir root \"data\" of backend overreach is not granted").await;
}

#[tokio::test]
async fn an_rbd_plan_for_a_pool_not_granted_is_refused() {
    assert_refused("overreach:rbd.v1", "pool \"other\" of cluster \"ceph\" is not granted to backend overreach").await;
}
