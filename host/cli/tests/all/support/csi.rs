//! CSI requests and calls as the flow tests (`replicated_flow`, `replicated_metrics`, `replicated_netns`) and
//! the block bench make them, each once: the clients of a socket, the two paths kubelet names for
//! a volume on a node, and one function per call whose answer the caller does not examine (it
//! panics, naming the call and the volume, when the driver refuses). A test that examines a
//! refusal builds the request itself or uses the `Result` of [`controller_publish`].
use std::collections::HashMap;
use std::future::Future;
use std::path::{Path, PathBuf};

use tonic::Code;
use tonic::transport::Channel;
use wasmcsi_proto::csi::v1 as csi;

pub type Controller = csi::controller_client::ControllerClient<Channel>;
pub type Node = csi::node_client::NodeClient<Channel>;

/// Single-node-writer access: a raw block volume (`fs_type` None) or a filesystem mount.
pub fn single_node_writer(fs_type: Option<&str>) -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(match fs_type {
            None => AccessType::Block(BlockVolume {}),
            Some(fs) => AccessType::Mount(MountVolume { fs_type: fs.into(), ..Default::default() }),
        }),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    }
}

pub fn from_snapshot(id: &str) -> csi::VolumeContentSource {
    use csi::volume_content_source::{SnapshotSource, Type};
    csi::VolumeContentSource { r#type: Some(Type::Snapshot(SnapshotSource { snapshot_id: id.into() })) }
}

pub fn from_volume(id: &str) -> csi::VolumeContentSource {
    use csi::volume_content_source::{Type, VolumeSource};
    csi::VolumeContentSource { r#type: Some(Type::Volume(VolumeSource { volume_id: id.into() })) }
}

/// A controller and a node client over one channel to the CSI socket at `socket`.
pub async fn clients(socket: &Path) -> (Controller, Node) {
    let channel = wasmcsi::host::connect(socket).await.unwrap();
    (Controller::new(channel.clone()), Node::new(channel))
}

/// Where kubelet stages a volume on a node, and where it publishes it for a pod.
pub struct Paths {
    pub staging: PathBuf,
    pub target: PathBuf,
}

/// ControllerPublishVolume of `v` to `node`: the publish context, or the driver's refusal.
pub async fn controller_publish(
    ctl: &mut Controller,
    v: &csi::Volume,
    node: &str,
    cap: &csi::VolumeCapability,
) -> Result<HashMap<String, String>, tonic::Status> {
    ctl.controller_publish_volume(csi::ControllerPublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: node.into(),
        volume_capability: Some(cap.clone()),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner().publish_context)
}

/// ControllerUnpublishVolume of `v` from `node`.
pub async fn controller_unpublish(ctl: &mut Controller, v: &csi::Volume, node: &str) {
    ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: node.into(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|s| panic!("ControllerUnpublish of {} from {node}: {s:?}", v.volume_id));
}

/// The NodeStageVolume request of `v` at `p.staging`, with the publish context `ctx`.
pub fn stage_request(
    v: &csi::Volume,
    ctx: &HashMap<String, String>,
    p: &Paths,
    cap: &csi::VolumeCapability,
) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: p.staging.to_string_lossy().into(),
        volume_capability: Some(cap.clone()),
        volume_context: v.volume_context.clone(),
        publish_context: ctx.clone(),
        ..Default::default()
    }
}

/// NodePublishVolume of `v`, staged at `p.staging`, at `p.target`.
pub async fn publish_at(
    node: &mut Node,
    v: &csi::Volume,
    ctx: &HashMap<String, String>,
    p: &Paths,
    cap: &csi::VolumeCapability,
) {
    node.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: p.staging.to_string_lossy().into(),
        target_path: p.target.to_string_lossy().into(),
        volume_capability: Some(cap.clone()),
        volume_context: v.volume_context.clone(),
        publish_context: ctx.clone(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|s| panic!("NodePublish of {} at {}: {s:?}", v.volume_id, p.target.display()));
}

/// NodeStageVolume, then NodePublishVolume, of `v` at `p`.
pub async fn stage_and_publish(
    node: &mut Node,
    v: &csi::Volume,
    ctx: &HashMap<String, String>,
    p: &Paths,
    cap: &csi::VolumeCapability,
) {
    node.node_stage_volume(stage_request(v, ctx, p, cap))
        .await
        .unwrap_or_else(|s| panic!("NodeStage of {} at {}: {s:?}", v.volume_id, p.staging.display()));
    publish_at(node, v, ctx, p, cap).await;
}

/// NodeUnpublishVolume of `v` at `target`.
pub async fn unpublish_at(node: &mut Node, v: &csi::Volume, target: &Path) {
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        target_path: target.to_string_lossy().into(),
    })
    .await
    .unwrap_or_else(|s| panic!("NodeUnpublish of {} at {}: {s:?}", v.volume_id, target.display()));
}

/// NodeUnpublishVolume at `p.target`, then NodeUnstageVolume at `p.staging`.
pub async fn unpublish_and_unstage(node: &mut Node, v: &csi::Volume, p: &Paths) {
    unpublish_at(node, v, &p.target).await;
    node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: p.staging.to_string_lossy().into(),
    })
    .await
    .unwrap_or_else(|s| panic!("NodeUnstage of {} at {}: {s:?}", v.volume_id, p.staging.display()));
}

/// NodeGetVolumeStats of `v` at `path`.
pub async fn stats(node: &mut Node, v: &csi::Volume, path: &Path) -> csi::NodeGetVolumeStatsResponse {
    node.node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
        volume_id: v.volume_id.clone(),
        volume_path: path.to_string_lossy().into(),
        staging_target_path: String::new(),
    })
    .await
    .unwrap_or_else(|s| panic!("NodeGetVolumeStats of {}: {s:?}", v.volume_id))
    .into_inner()
}

/// The lines of this machine's mount table whose mount point is under `dir`.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let dir = dir.to_string_lossy();
    table.lines().filter(|l| l.split(' ').nth(1).is_some_and(|m| m.starts_with(&*dir))).map(str::to_owned).collect()
}

/// Every ListVolumes entry, page by page with `max_entries` per page (each page checked to
/// hold no more), following the tokens until the last.
pub async fn list_volumes(ctl: &mut Controller, max_entries: i32) -> Vec<csi::list_volumes_response::Entry> {
    let mut entries = vec![];
    let mut token = String::new();
    loop {
        let page = ctl
            .list_volumes(csi::ListVolumesRequest { max_entries, starting_token: token })
            .await
            .expect("ListVolumes")
            .into_inner();
        match next_page(&mut entries, page.entries, page.next_token, max_entries) {
            Some(next) => token = next,
            None => return entries,
        }
    }
}

/// Every ListSnapshots entry (no filter), page by page as [`list_volumes`].
pub async fn list_snapshots(ctl: &mut Controller, max_entries: i32) -> Vec<csi::list_snapshots_response::Entry> {
    let mut entries = vec![];
    let mut token = String::new();
    loop {
        let page = ctl
            .list_snapshots(csi::ListSnapshotsRequest { max_entries, starting_token: token, ..Default::default() })
            .await
            .expect("ListSnapshots")
            .into_inner();
        match next_page(&mut entries, page.entries, page.next_token, max_entries) {
            Some(next) => token = next,
            None => return entries,
        }
    }
}

/// One page of a listing taken: checked to hold at most `max_entries`, added to `entries`; the
/// token of the next page, `None` after the last.
fn next_page<E: std::fmt::Debug>(entries: &mut Vec<E>, page: Vec<E>, next: String, max_entries: i32) -> Option<String> {
    assert!(page.len() <= max_entries as usize, "more than {max_entries} entries: {page:?}");
    entries.extend(page);
    (!next.is_empty()).then_some(next)
}

/// Sends `n` copies of one call at once and returns the answers that succeeded. A copy may be
/// refused with ABORTED while another is in flight (the CSI answer to a concurrent retry);
/// any other error fails the test. Then one more call, alone, must succeed, and its answer is
/// returned with the others.
pub async fn at_once<T, F, Fut>(n: usize, what: &str, call: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn() -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>> + Send + 'static,
{
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        set.spawn(call());
    }
    let mut ok = vec![];
    while let Some(r) = set.join_next().await {
        match r.unwrap() {
            Ok(v) => ok.push(v.into_inner()),
            Err(s) if s.code() == Code::Aborted => {}
            Err(s) => panic!("{what}: {s:?}"),
        }
    }
    assert!(!ok.is_empty() || n == 0 || what.contains("may abort"), "{what}: every concurrent copy was refused");
    ok.push(call().await.unwrap_or_else(|s| panic!("{what}, retried alone: {s:?}")).into_inner());
    ok
}
