//! Bookkeeping and cleanup: every object a call of the suite made (also one the driver should
//! have refused but made anyway), every stage, publish and ControllerPublishVolume tried, and
//! [`Suite::clean_up`](crate::Suite::clean_up), which undoes them at the end whatever the checks found.
use crate::{Suite, call, mounts_under, path_str, status};
use std::path::PathBuf;
use tonic::Code;
use wasmcsi_proto::csi::v1 as csi;

/// What a call the suite made left behind, so that it can be removed again.
pub(crate) enum Made {
    Nothing,
    Volume(String),
    Snapshot(String),
}

pub(crate) fn made_volume(r: csi::CreateVolumeResponse) -> Made {
    r.volume.map_or(Made::Nothing, |v| Made::Volume(v.volume_id))
}

pub(crate) fn made_snapshot(r: csi::CreateSnapshotResponse) -> Made {
    r.snapshot.map_or(Made::Nothing, |s| Made::Snapshot(s.snapshot_id))
}

#[derive(Default)]
pub(crate) struct Created {
    pub(crate) volumes: Vec<String>,
    pub(crate) snapshots: Vec<String>,
    /// (volume id, path) of every publish and stage tried; undone in reverse order.
    pub(crate) published: Vec<(String, PathBuf)>,
    pub(crate) staged: Vec<(String, PathBuf)>,
    /// (volume id, node id) of every ControllerPublishVolume tried; undone after the node's.
    pub(crate) attached: Vec<(String, String)>,
}

impl Created {
    pub(crate) fn volume(&mut self, id: &str) {
        if !id.is_empty() && !self.volumes.iter().any(|v| v == id) {
            self.volumes.push(id.to_string());
        }
    }
    pub(crate) fn snapshot(&mut self, id: &str) {
        if !id.is_empty() && !self.snapshots.iter().any(|s| s == id) {
            self.snapshots.push(id.to_string());
        }
    }
    pub(crate) fn made(&mut self, made: &Made) {
        match made {
            Made::Nothing => {}
            Made::Volume(id) => self.volume(id),
            Made::Snapshot(id) => self.snapshot(id),
        }
    }
}

impl Suite<'_> {
    /// Undo everything the suite made, whatever the checks found: mounts first (through the
    /// node service; a lazy detach only as the last resort), then snapshots, then volumes.
    pub(crate) async fn clean_up(&mut self) {
        const NAME: &str = "cleanup removes every mount, snapshot and volume the suite made";
        let mut problems = Vec::new();
        let created = std::mem::take(&mut self.created);
        if self.node_caps.is_some() {
            for (id, path) in created.published.iter().rev() {
                let request = csi::NodeUnpublishVolumeRequest { volume_id: id.clone(), target_path: path_str(path) };
                if let Err(s) = call(self.nd().node_unpublish_volume(request)).await
                    && s.code() != Code::NotFound
                {
                    problems.push(format!("NodeUnpublishVolume {}: {}", path.display(), status(s)));
                }
            }
            for (id, path) in created.staged.iter().rev() {
                let request =
                    csi::NodeUnstageVolumeRequest { volume_id: id.clone(), staging_target_path: path_str(path) };
                if let Err(s) = call(self.nd().node_unstage_volume(request)).await
                    && s.code() != Code::NotFound
                {
                    problems.push(format!("NodeUnstageVolume {}: {}", path.display(), status(s)));
                }
            }
        }
        for (id, node) in created.attached.iter().rev() {
            let request = csi::ControllerUnpublishVolumeRequest {
                volume_id: id.clone(),
                node_id: node.clone(),
                secrets: self.profile.secrets.clone(),
            };
            if let Err(s) = call(self.ctl().controller_unpublish_volume(request)).await
                && s.code() != Code::NotFound
            {
                problems.push(format!("ControllerUnpublishVolume {id} from {node}: {}", status(s)));
            }
        }
        for id in created.snapshots.iter().rev() {
            if let Err(s) = call(self.ctl().delete_snapshot(
                self.secreted(csi::DeleteSnapshotRequest { snapshot_id: id.clone(), ..Default::default() }),
            ))
            .await
            {
                problems.push(format!("DeleteSnapshot {id}: {}", status(s)));
            }
        }
        for id in created.volumes.iter().rev() {
            if let Err(s) = call(self.ctl().delete_volume(self.delete_request(id))).await {
                problems.push(format!("DeleteVolume {id}: {}", status(s)));
            }
        }
        match mounts_under(&self.work) {
            Ok(left) if left.is_empty() => {
                // Nothing mounted: removing the tree cannot reach into a volume.
                if let Err(e) = std::fs::remove_dir_all(&self.work) {
                    problems.push(format!("removing {}: {e}", self.work.display()));
                }
            }
            Ok(left) => {
                problems.push(format!("still mounted after NodeUnpublish/NodeUnstage, detached lazily: {left:?}"));
                for m in &left {
                    if let Err(e) = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH) {
                        problems.push(format!("detaching {}: {e}", m.display()));
                    }
                }
            }
            Err(e) => problems.push(e),
        }
        self.judge(NAME, if problems.is_empty() { Ok(()) } else { Err(problems.join("; ")) });
    }
}
