//! SINGLE_NODE_SINGLE_WRITER on the node: a volume published with this access mode is published
//! at one target path at a time. A second target is FAILED_PRECONDITION (the NodePublishVolume
//! table of the spec), the same target again is OK, and once the first target is unpublished the
//! volume may be published at another. The mode comes with the node's SINGLE_NODE_MULTI_WRITER
//! capability; without it these checks are skipped.
use crate::{Suite, call, expect_code, is_mounted, is_unmounted, path_str, status};
use csi::node_service_capability::rpc::Type as NodeRpc;
use std::collections::HashMap;
use std::path::Path;
use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

impl Suite<'_> {
    /// On a volume staged at `staging` and published nowhere.
    pub(super) async fn single_writer_checks(
        &mut self,
        id: &str,
        context: &HashMap<String, String>,
        staging: &Path,
        blocked: &Option<String>,
    ) {
        const PUBLISH: &str = "NodePublishVolume of a SINGLE_NODE_SINGLE_WRITER volume publishes it";
        const AGAIN: &str = "NodePublishVolume of a SINGLE_NODE_SINGLE_WRITER volume at the same target again is OK";
        const SECOND: &str =
            "NodePublishVolume of a SINGLE_NODE_SINGLE_WRITER volume at a second target is FailedPrecondition";
        const MOVED: &str = "NodePublishVolume of a SINGLE_NODE_SINGLE_WRITER volume at another target works once the first is unpublished";
        let mut blocked = Self::gates([blocked.clone(), self.node_gate(Some(NodeRpc::SingleNodeMultiWriter))]);
        let (first, second) = (self.work.join("snsw-a").join("mount"), self.work.join("snsw-b").join("mount"));
        if blocked.is_none() {
            for dir in [&self.work.join("snsw-a"), &self.work.join("snsw-b")] {
                if let Err(e) = std::fs::create_dir_all(dir) {
                    blocked = Some(format!("creating {}: {e}", dir.display()));
                }
            }
        }
        let publish = |suite: &Self, target: &Path| {
            use csi::volume_capability::{AccessMode, access_mode::Mode};
            let mut request = suite.publish_request(id, context, staging, target, false);
            if let Some(cap) = request.volume_capability.as_mut() {
                cap.access_mode = Some(AccessMode { mode: Mode::SingleNodeSingleWriter as i32 });
            }
            request
        };

        if self.open(PUBLISH, &blocked) {
            self.created.published.push((id.to_string(), first.clone()));
            let answer = call(self.nd().node_publish_volume(publish(self, &first))).await;
            let verdict = answer.map_err(status).and_then(|_| is_mounted(&first));
            if verdict.is_err() {
                blocked = Some("the first SINGLE_NODE_SINGLE_WRITER publish failed".into());
            }
            self.judge(PUBLISH, verdict);
        }
        if self.open(AGAIN, &blocked) {
            let answer = call(self.nd().node_publish_volume(publish(self, &first))).await;
            self.record(AGAIN, expect_code(&answer, Code::Ok));
        }
        if self.open(SECOND, &blocked) {
            self.created.published.push((id.to_string(), second.clone()));
            let answer = call(self.nd().node_publish_volume(publish(self, &second))).await;
            let verdict = match answer {
                Err(s) if s.code() == Code::FailedPrecondition => is_unmounted(&second),
                Err(s) => Err(format!("expected FailedPrecondition, got {}", status(s))),
                Ok(_) => Err("expected FailedPrecondition, got OK: the volume is published at two targets".into()),
            };
            self.judge(SECOND, verdict);
        }
        if self.open(MOVED, &blocked) {
            let request = publish(self, &second);
            let verdict = self.move_publish(id, &first, &second, request).await;
            self.judge(MOVED, verdict);
        }
    }

    /// Unpublish `from`, publish with `request` (at `to`), unpublish `to`.
    async fn move_publish(
        &mut self,
        id: &str,
        from: &Path,
        to: &Path,
        request: csi::NodePublishVolumeRequest,
    ) -> Result<(), String> {
        let unpublish = |target: &Path| csi::NodeUnpublishVolumeRequest {
            volume_id: id.to_string(),
            target_path: path_str(target),
        };
        call(self.nd().node_unpublish_volume(unpublish(from)))
            .await
            .map_err(|s| format!("NodeUnpublishVolume {}: {}", from.display(), status(s)))?;
        let published = call(self.nd().node_publish_volume(request))
            .await
            .map_err(|s| format!("NodePublishVolume {}: {}", to.display(), status(s)))
            .and_then(|_| is_mounted(to));
        let unpublished = call(self.nd().node_unpublish_volume(unpublish(to)))
            .await
            .map_err(|s| format!("NodeUnpublishVolume {}: {}", to.display(), status(s)));
        published.and(unpublished.map(drop))
    }
}
