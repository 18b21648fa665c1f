//! The Node service: stage, publish (read-write and read-only), use, unpublish and unstage a
//! volume on this machine, checked against the mount table, with ControllerPublishVolume first
//! when the controller offers it, as a CO does.
use crate::{DATA_FILE, NO_VOLUME, Objects, Suite, call, expect_code, path_str, status};
use csi::controller_service_capability::rpc::Type as ControllerRpc;
use csi::node_service_capability::rpc::Type as NodeRpc;
use std::collections::HashMap;
use std::path::Path;
use std::path::PathBuf;
use tonic::Code;
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_proto::csi::v1 as csi;

/// Mount points at or under `dir`, deepest first.
pub(crate) fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let table = mountinfo::read_current().map_err(|e| e.to_string())?;
    let mut found: Vec<PathBuf> = table.into_iter().map(|e| e.mount_point).filter(|m| m.starts_with(dir)).collect();
    found.sort_by_key(|m| std::cmp::Reverse(m.components().count()));
    Ok(found)
}

pub(crate) fn is_mounted(path: &Path) -> Result<(), String> {
    let table = mountinfo::read_current().map_err(|e| e.to_string())?;
    if mountinfo::mounts_at(&table, path).is_empty() {
        Err(format!("nothing is mounted at {}", path.display()))
    } else {
        Ok(())
    }
}

pub(crate) fn is_unmounted(path: &Path) -> Result<(), String> {
    match is_mounted(path) {
        Ok(()) => Err(format!("{} is still mounted", path.display())),
        Err(_) => Ok(()),
    }
}

impl Suite<'_> {
    pub(crate) fn stage_request(
        &self,
        id: &str,
        context: &HashMap<String, String>,
        staging: &Path,
    ) -> csi::NodeStageVolumeRequest {
        csi::NodeStageVolumeRequest {
            volume_id: id.to_string(),
            staging_target_path: path_str(staging),
            volume_capability: Some(self.profile.capability.clone()),
            volume_context: context.clone(),
            ..Default::default()
        }
    }

    pub(crate) fn publish_request(
        &self,
        id: &str,
        context: &HashMap<String, String>,
        staging: &Path,
        target: &Path,
        readonly: bool,
    ) -> csi::NodePublishVolumeRequest {
        csi::NodePublishVolumeRequest {
            volume_id: id.to_string(),
            staging_target_path: path_str(staging),
            target_path: path_str(target),
            volume_capability: Some(self.profile.capability.clone()),
            readonly,
            volume_context: context.clone(),
            ..Default::default()
        }
    }

    /// Whether the controller offers PUBLISH_UNPUBLISH_VOLUME (then a CO publishes a volume to
    /// a node before it stages it there).
    pub(crate) fn controller_publishes(&self) -> bool {
        self.controller_caps.as_ref().is_some_and(|c| c.contains(&(ControllerRpc::PublishUnpublishVolume as i32)))
    }

    /// ControllerPublishVolume of `id` to this node, when the controller offers it.
    pub(crate) async fn attach_to_node(&mut self, id: &str, context: &HashMap<String, String>) -> Result<(), String> {
        if !self.controller_publishes() {
            return Ok(());
        }
        let node = self.node_id.clone().ok_or("no node id to ControllerPublishVolume to: NodeGetInfo failed")?;
        self.created.attached.push((id.to_string(), node.clone()));
        let request = csi::ControllerPublishVolumeRequest {
            volume_id: id.to_string(),
            node_id: node,
            volume_capability: Some(self.profile.capability.clone()),
            readonly: false,
            secrets: self.profile.secrets.clone(),
            volume_context: context.clone(),
        };
        call(self.ctl().controller_publish_volume(request))
            .await
            .map(drop)
            .map_err(|s| format!("ControllerPublishVolume: {}", status(s)))
    }

    /// ControllerUnpublishVolume of `id` from this node, when the controller offers it.
    pub(crate) async fn detach_from_node(&mut self, id: &str) -> Result<(), String> {
        if !self.controller_publishes() {
            return Ok(());
        }
        let node = self.node_id.clone().unwrap_or_default();
        let request = csi::ControllerUnpublishVolumeRequest {
            volume_id: id.to_string(),
            node_id: node.clone(),
            secrets: self.profile.secrets.clone(),
        };
        let answer = call(self.ctl().controller_unpublish_volume(request)).await;
        if answer.is_ok() {
            self.created.attached.retain(|(v, n)| !(v == id && *n == node));
        }
        answer.map(drop).map_err(|s| format!("ControllerUnpublishVolume: {}", status(s)))
    }

    /// Stage, publish, use, unpublish and unstage the volume on this node. Returns whether
    /// [`DATA_FILE`] was written into the volume.
    pub(crate) async fn node_flow(&mut self, objects: &Objects) -> bool {
        const STAGE: &str = "NodeStageVolume stages the volume";
        const STAGE_AGAIN: &str = "NodeStageVolume repeated is OK";
        const PUBLISH: &str = "NodePublishVolume publishes the volume";
        const PUBLISH_AGAIN: &str = "NodePublishVolume repeated is OK";
        const WRITE: &str = "a file written through the target path reads back";
        const RO_CONFLICT: &str = "NodePublishVolume read-only on the same target is AlreadyExists";
        const RO_PUBLISH: &str = "a read-only publish shows the data and refuses writes";
        const STATS: &str = "NodeGetVolumeStats reports usage";
        const STATS_MISSING: &str = "NodeGetVolumeStats of a missing path is NotFound";
        const STATS_UNKNOWN: &str = "NodeGetVolumeStats of an unknown volume is NotFound, whatever its path";
        const EXPAND_UNKNOWN: &str = "NodeExpandVolume of an unknown volume is NotFound, whatever its path";
        const EXPAND: &str = "NodeExpandVolume answers";
        const UNPUBLISH: &str = "NodeUnpublishVolume unmounts and removes the target";
        const UNPUBLISH_AGAIN: &str = "NodeUnpublishVolume repeated is OK";
        const UNSTAGE: &str = "NodeUnstageVolume unmounts the staging path";
        const UNSTAGE_AGAIN: &str = "NodeUnstageVolume repeated is OK";
        const DETACH: &str = "ControllerUnpublishVolume releases the volume from the node";
        const NOTHING_LEFT: &str = "the node flow leaves nothing mounted under the work dir";

        let volume = objects.volume.as_ref();
        let id = volume.map(|v| v.volume_id.clone()).unwrap_or_default();
        let context = volume.map(|v| v.volume_context.clone()).unwrap_or_default();
        let capacity = objects.expanded.or(volume.map(|v| v.capacity_bytes)).unwrap_or(self.profile.required_bytes);
        let staging = self.work.join("staging");
        let target = self.work.join("target").join("mount");
        let target_ro = self.work.join("target-ro").join("mount");

        let mut blocked = if !self.profile.node {
            Some("profile.node is off (the node flow makes real mounts: needs root)".to_string())
        } else {
            Self::gates([self.node_gate(None), volume.is_none().then(|| NO_VOLUME.to_string())])
        };
        if blocked.is_none() {
            for dir in [&staging, &self.work.join("target"), &self.work.join("target-ro")] {
                if let Err(e) = std::fs::create_dir_all(dir) {
                    blocked = Some(format!("creating {}: {e}", dir.display()));
                }
            }
        }
        let flow_blocked = blocked.clone();

        // Stage (published to this node first, when the controller publishes).
        if self.open(STAGE, &blocked) {
            let attached = self.attach_to_node(&id, &context).await;
            self.created.staged.push((id.clone(), staging.clone()));
            let verdict = match attached {
                Err(e) => Err(e),
                Ok(()) => {
                    let answer = call(self.nd().node_stage_volume(self.stage_request(&id, &context, &staging))).await;
                    answer.map_err(status).and_then(|_| is_mounted(&staging))
                }
            };
            if verdict.is_err() {
                blocked = Some("NodeStageVolume failed".into());
            }
            self.judge(STAGE, verdict);
        }
        if self.open(STAGE_AGAIN, &blocked) {
            let answer = call(self.nd().node_stage_volume(self.stage_request(&id, &context, &staging))).await;
            self.record(STAGE_AGAIN, expect_code(&answer, Code::Ok));
        }
        let staged_blocked = blocked.clone();

        // Publish.
        if self.open(PUBLISH, &blocked) {
            self.created.published.push((id.clone(), target.clone()));
            let answer =
                call(self.nd().node_publish_volume(self.publish_request(&id, &context, &staging, &target, false)))
                    .await;
            let verdict = answer.map_err(status).and_then(|_| is_mounted(&target));
            if verdict.is_err() {
                blocked = Some("NodePublishVolume failed".into());
            }
            self.judge(PUBLISH, verdict);
        }
        if self.open(PUBLISH_AGAIN, &blocked) {
            let answer =
                call(self.nd().node_publish_volume(self.publish_request(&id, &context, &staging, &target, false)))
                    .await;
            self.record(PUBLISH_AGAIN, expect_code(&answer, Code::Ok));
        }

        let data = self.data();
        let mut written = false;
        if self.open(WRITE, &blocked) {
            let file = target.join(DATA_FILE);
            let verdict = match tokio::fs::write(&file, &data).await {
                Err(e) => Err(format!("writing {}: {e}", file.display())),
                Ok(()) => {
                    written = true;
                    match tokio::fs::read(&file).await {
                        Ok(back) if back == data => Ok(()),
                        Ok(back) => {
                            Err(format!("read back {} bytes that differ from the {} written", back.len(), data.len()))
                        }
                        Err(e) => Err(format!("reading {}: {e}", file.display())),
                    }
                }
            };
            self.judge(WRITE, verdict);
        }

        if self.open(RO_CONFLICT, &blocked) {
            let answer =
                call(self.nd().node_publish_volume(self.publish_request(&id, &context, &staging, &target, true))).await;
            self.record(RO_CONFLICT, expect_code(&answer, Code::AlreadyExists));
        }

        if self.open(RO_PUBLISH, &staged_blocked) {
            self.created.published.push((id.clone(), target_ro.clone()));
            let verdict = self.read_only_publish(&id, &context, &staging, &target_ro, written.then_some(&data)).await;
            self.judge(RO_PUBLISH, verdict);
        }

        let stats_blocked = Self::gates([blocked.clone(), self.node_gate(Some(NodeRpc::GetVolumeStats))]);
        if self.open(STATS, &stats_blocked) {
            let request = csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: path_str(&target),
                staging_target_path: path_str(&staging),
            };
            let answer = call(self.nd().node_get_volume_stats(request)).await;
            self.judge(
                STATS,
                answer.map_err(status).and_then(|r| {
                    if r.usage.is_empty() {
                        Err("no usage reported".into())
                    } else if r.usage.iter().any(|u| u.used < 0 || u.total < 0 || u.available < 0) {
                        Err(format!("negative usage: {:?}", r.usage))
                    } else {
                        Ok(())
                    }
                }),
            );
        }
        if self.open(STATS_MISSING, &stats_blocked) {
            let request = csi::NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: path_str(&self.work.join("no-such-path")),
                ..Default::default()
            };
            let answer = call(self.nd().node_get_volume_stats(request)).await;
            self.record(STATS_MISSING, expect_code(&answer, Code::NotFound));
        }
        // The volume is looked up before its path is judged: a CO asking about a volume that
        // is gone may send any path, a relative one too, and must hear NOT_FOUND.
        let unknown = "wasmcsi-conformance-no-such-volume".to_string();
        let stats_gate = self.node_gate(Some(NodeRpc::GetVolumeStats));
        if self.open(STATS_UNKNOWN, &stats_gate) {
            let request = csi::NodeGetVolumeStatsRequest {
                volume_id: unknown.clone(),
                volume_path: "some/relative/path".into(),
                ..Default::default()
            };
            let answer = call(self.nd().node_get_volume_stats(request)).await;
            self.record(STATS_UNKNOWN, expect_code(&answer, Code::NotFound));
        }
        let expand_gate = self.node_gate(Some(NodeRpc::ExpandVolume));
        if self.open(EXPAND_UNKNOWN, &expand_gate) {
            let request = csi::NodeExpandVolumeRequest {
                volume_id: unknown,
                volume_path: "some/relative/path".into(),
                capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }),
                ..Default::default()
            };
            let answer = call(self.nd().node_expand_volume(request)).await;
            self.record(EXPAND_UNKNOWN, expect_code(&answer, Code::NotFound));
        }

        let expand_blocked = Self::gates([blocked.clone(), self.node_gate(Some(NodeRpc::ExpandVolume))]);
        if self.open(EXPAND, &expand_blocked) {
            let request = csi::NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: path_str(&target),
                staging_target_path: path_str(&staging),
                capacity_range: Some(csi::CapacityRange { required_bytes: capacity, limit_bytes: 0 }),
                volume_capability: Some(self.profile.capability.clone()),
                ..Default::default()
            };
            let answer = call(self.nd().node_expand_volume(request)).await;
            self.judge_optional(EXPAND, answer, |r| {
                if r.capacity_bytes == 0 || r.capacity_bytes >= capacity {
                    Ok(())
                } else {
                    Err(format!("capacity {} < requested {capacity}", r.capacity_bytes))
                }
            });
        }

        // Unpublish and unstage (skipped only when there was nothing to undo).
        if self.open(UNPUBLISH, &blocked) {
            let answer = call(self.nd().node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: path_str(&target),
            }))
            .await;
            let verdict = answer.map_err(status).and_then(|_| is_unmounted(&target)).and_then(|()| {
                if target.exists() { Err(format!("{} still exists", target.display())) } else { Ok(()) }
            });
            self.judge(UNPUBLISH, verdict);
        }
        if self.open(UNPUBLISH_AGAIN, &blocked) {
            let answer = call(self.nd().node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: path_str(&target),
            }))
            .await;
            self.record(UNPUBLISH_AGAIN, expect_code(&answer, Code::Ok));
        }
        self.single_writer_checks(&id, &context, &staging, &staged_blocked).await;

        if self.open(UNSTAGE, &staged_blocked) {
            let answer = call(self.nd().node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: path_str(&staging),
            }))
            .await;
            self.judge(UNSTAGE, answer.map_err(status).and_then(|_| is_unmounted(&staging)));
        }
        if self.open(UNSTAGE_AGAIN, &staged_blocked) {
            let answer = call(self.nd().node_unstage_volume(csi::NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: path_str(&staging),
            }))
            .await;
            self.record(UNSTAGE_AGAIN, expect_code(&answer, Code::Ok));
        }
        let detach_blocked = Self::gates([
            staged_blocked.clone(),
            (!self.controller_publishes())
                .then(|| "the controller does not offer PUBLISH_UNPUBLISH_VOLUME".to_string()),
        ]);
        if self.open(DETACH, &detach_blocked) {
            let verdict = self.detach_from_node(&id).await;
            self.judge(DETACH, verdict);
        }
        if self.open(NOTHING_LEFT, &flow_blocked) {
            let verdict = mounts_under(&self.work)
                .and_then(|left| if left.is_empty() { Ok(()) } else { Err(format!("still mounted: {left:?}")) });
            self.judge(NOTHING_LEFT, verdict);
        }
        written
    }

    /// Publish read-only at `target`, read `data` (when given) and fail to write, unpublish.
    pub(crate) async fn read_only_publish(
        &mut self,
        id: &str,
        context: &HashMap<String, String>,
        staging: &Path,
        target: &Path,
        data: Option<&Vec<u8>>,
    ) -> Result<(), String> {
        let answer =
            call(self.nd().node_publish_volume(self.publish_request(id, context, staging, target, true))).await;
        answer.map_err(|s| format!("NodePublishVolume readonly: {}", status(s)))?;
        let mut verdict = Ok(());
        if let Some(data) = data {
            match tokio::fs::read(target.join(DATA_FILE)).await {
                Ok(back) if &back == data => {}
                Ok(_) => verdict = Err("the read-only mount shows other data".to_string()),
                Err(e) => verdict = Err(format!("reading through the read-only mount: {e}")),
            }
        }
        if verdict.is_ok() {
            let probe = target.join("write-probe");
            verdict = match tokio::fs::write(&probe, b"x").await {
                Ok(()) => Err(format!("wrote {} through a read-only publish", probe.display())),
                Err(e) if e.raw_os_error() == Some(nix::errno::Errno::EROFS as i32) => Ok(()),
                Err(e) => Err(format!("writing through the read-only mount failed, but not with EROFS: {e}")),
            };
        }
        let answer = call(self.nd().node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.to_string(),
            target_path: path_str(target),
        }))
        .await;
        verdict
            .and(answer.map(|_| ()).map_err(|s| format!("NodeUnpublishVolume of the read-only target: {}", status(s))))
    }

    /// Stage and publish a volume in fresh directories, read [`DATA_FILE`], undo both.
    pub(crate) async fn read_through_mount(
        &mut self,
        id: &str,
        context: &HashMap<String, String>,
        tag: &str,
    ) -> Result<Vec<u8>, String> {
        let staging = self.work.join(format!("{tag}-staging"));
        let target = self.work.join(format!("{tag}-target")).join("mount");
        for dir in [&staging, &self.work.join(format!("{tag}-target"))] {
            std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        }
        self.attach_to_node(id, context).await?;
        self.created.staged.push((id.to_string(), staging.clone()));
        self.created.published.push((id.to_string(), target.clone()));
        let staged = call(self.nd().node_stage_volume(self.stage_request(id, context, &staging))).await;
        let read = match staged {
            Err(s) => Err(format!("NodeStageVolume: {}", status(s))),
            Ok(_) => {
                match call(self.nd().node_publish_volume(self.publish_request(id, context, &staging, &target, true)))
                    .await
                {
                    Err(s) => Err(format!("NodePublishVolume: {}", status(s))),
                    Ok(_) => {
                        tokio::fs::read(target.join(DATA_FILE)).await.map_err(|e| format!("reading {DATA_FILE}: {e}"))
                    }
                }
            }
        };
        let unpublished = call(self.nd().node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: id.to_string(),
            target_path: path_str(&target),
        }))
        .await;
        let unstaged = call(self.nd().node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: id.to_string(),
            staging_target_path: path_str(&staging),
        }))
        .await;
        let detached = self.detach_from_node(id).await;
        let read = read?;
        unpublished.map_err(|s| format!("NodeUnpublishVolume: {}", status(s)))?;
        unstaged.map_err(|s| format!("NodeUnstageVolume: {}", status(s)))?;
        detached?;
        Ok(read)
    }
}
