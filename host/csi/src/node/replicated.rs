//! The replicated-block attacher: a volume of the host's replicated block engine. NodeStage asks
//! the volume's replica nodes (through the backend's `block` grant) whether it is published to
//! this node and with which members and epoch, starts its engine in this node's data path
//! ([`DataPath`]: this node's replica reached in-process, the others over TCP), exposes it as a
//! block device (FUSE + loop here), then formats it when blank and mounts it, or keeps the
//! device for a raw block volume. What it staged is recorded under
//! `<state>/replicated/<volume>.json`, so NodeUnstage needs neither the plan nor the backend.
//!
//! The engines run where [`Engines`] says: in this process, or in a data-path process of their
//! own (`wasmcsi datapath`, reached over its socket). In the second case a plugin that was
//! killed and restarted finds every volume it staged still served (the state file names the
//! data path's owner id) and publishes, reports and unstages it as if it had never gone. When the
//! process that ran an engine died (the plugin in the first case, the data path in the
//! second), its device is gone with it: the next start of the data path or the plugin reclaims
//! the FUSE mounts and loop devices it left (`wasmcsi_frontend::fuse::reclaim_dead`; a loop
//! device the staged filesystem holds goes when the unstage unmounts that), the next stage or
//! unstage of the volume whatever is left of it, and the replicas' dirty flags make the next
//! engine resync. What is dead is told by the mount's owner (`wasmcsi_frontend::owner`), never
//! by a pid: in pods both processes are pid 1.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use wasmcsi_datapath::client::{Engines, EnginesError};
use wasmcsi_datapath::wire::VolumeView;
use wasmcsi_frontend::{fuse, loop_dev};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::driver;

use super::attacher::{
    Attacher, ConfigSource, Expand, Placement, Publish, Stage, Stats, Unstaged, blocking, is_read_only_mode, mount_err,
    publish_device, publish_staged,
};
use super::filesystem::{self, Filesystem};
use super::mounts::MountSystem;
use super::usage;
use crate::convert;
use crate::error::{CsiError, CsiResult};
use wasmcsi_mountinfo as mountinfo;

/// How long NodeExpand waits for the device to show the size the controller gave the volume.
const GROW_WAIT: Duration = Duration::from_secs(10);

/// What NodeStage made of a volume, as kept on disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicatedState {
    /// The CSI volume id.
    pub volume_id: String,
    /// The replica set's id (the engine's volume).
    pub set_id: String,
    pub staging_path: PathBuf,
    /// The block device the frontend made.
    pub device: PathBuf,
    /// `None`: a raw block volume; otherwise the filesystem mounted at the staging path.
    pub filesystem: Option<Filesystem>,
    /// The process whose engine serves the device (this plugin, or the data path), for logs.
    pub pid: u32,
    /// That process start's owner id (`wasmcsi_frontend::owner`): a data path restarted in a
    /// new pid namespace has the same pid (1 in a pod) but another owner, and its predecessor's
    /// device is gone. Empty in a state written before owners were recorded.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub owner: String,
}

impl ReplicatedState {
    /// Whether `view` is the engine that serves what this state staged: the same process start
    /// and device. A state or a data path from before owner ids falls back to the pid.
    fn served_by(&self, view: &VolumeView) -> bool {
        let same_process = if self.owner.is_empty() || view.owner.is_empty() {
            view.pid == self.pid
        } else {
            view.owner == self.owner
        };
        same_process && view.device == self.device
    }
}

pub struct ReplicatedAttacher {
    node_id: String,
    state_dir: PathBuf,
    runtime_dir: PathBuf,
    config: Arc<dyn ConfigSource>,
    mounts: Arc<dyn MountSystem>,
    /// This node's engines; `None` when the plugin serves no replicas and knows no data path
    /// (then nothing of this kind can be staged here).
    engines: Option<Engines>,
}

impl ReplicatedAttacher {
    /// Staged volumes keep their state in `<state_dir>/replicated/<volume>.json`; the frontends'
    /// FUSE mounts live in `runtime_dir`.
    pub fn new(
        node_id: String,
        state_dir: &Path,
        runtime_dir: PathBuf,
        config: Arc<dyn ConfigSource>,
        mounts: Arc<dyn MountSystem>,
        engines: Option<Engines>,
    ) -> Self {
        Self { node_id, state_dir: state_dir.join("replicated"), runtime_dir, config, mounts, engines }
    }

    fn engines(&self) -> CsiResult<&Engines> {
        self.engines.as_ref().ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "node {} serves no replicated block volumes (start the plugin with --replica-listen or \
                 --datapath-socket)",
                self.node_id
            ))
        })
    }

    /// The running engine of what `state` says is staged, if it still runs in the process that
    /// started it (a restarted data path serves nothing of what its predecessor did).
    async fn running(&self, state: &ReplicatedState) -> CsiResult<Option<VolumeView>> {
        let Some(engines) = &self.engines else { return Ok(None) };
        let view = engines.view(&state.set_id).await.map_err(engines_err)?;
        Ok(view.filter(|v| state.served_by(v)))
    }

    fn state_path(&self, volume_id: &str) -> PathBuf {
        // CSI ids are BACKEND:LOCAL; the local part is [A-Za-z0-9._-].
        self.state_dir.join(format!("{}.json", volume_id.replace(':', "~")))
    }

    fn load(&self, volume_id: &str) -> CsiResult<Option<ReplicatedState>> {
        let path = self.state_path(volume_id);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| CsiError::Internal(format!("state of {volume_id} in {}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(CsiError::Internal(format!("reading {}: {e}", path.display()))),
        }
    }

    fn save(&self, state: &ReplicatedState) -> CsiResult<()> {
        std::fs::create_dir_all(&self.state_dir).map_err(mount_err)?;
        let bytes = serde_json::to_vec_pretty(state)
            .map_err(|source| CsiError::State { volume_id: state.volume_id.clone(), source })?;
        filesystem::write_atomically(&self.state_path(&state.volume_id), &bytes)
    }

    fn forget(&self, volume_id: &str) -> CsiResult<()> {
        match std::fs::remove_file(self.state_path(volume_id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(mount_err(e)),
            _ => Ok(()),
        }
    }

    /// Undoes a staging: the filesystem unmounted, the engine stopped (or, when the process that
    /// ran it died, its loop devices and FUSE mount reclaimed), the state forgotten.
    async fn teardown(&self, state: &ReplicatedState) -> CsiResult<()> {
        if state.filesystem.is_some() {
            let staging = state.staging_path.clone();
            blocking(move || filesystem::unmount_all(&staging, None)).await?;
        }
        let running = self.running(state).await?;
        match (&self.engines, running) {
            (Some(e), Some(_)) => e
                .detach(&state.set_id)
                .await
                .map_err(|e| CsiError::DataPath { volume_id: state.volume_id.clone(), source: e.into() })?,
            _ => {
                let (dir, name) = (self.runtime_dir.clone(), state.set_id.clone());
                let reclaimed = blocking(move || fuse::reclaim(&dir, &name).map_err(CsiError::Device)).await?;
                if reclaimed > 0 {
                    tracing::warn!(volume.id = %state.volume_id, "the process that ran the engine of this volume died; its device was reclaimed");
                }
            }
        }
        self.forget(&state.volume_id)
    }

    /// Whether what `state` says is staged still stands: the engine runs in the process that
    /// started it and the filesystem (if any) is mounted at the staging path.
    async fn standing(&self, state: &ReplicatedState) -> CsiResult<bool> {
        Ok(self.running(state).await?.is_some()
            && state.filesystem.as_ref().is_none_or(|_| {
                mountinfo::read_current()
                    .is_ok_and(|m| filesystem::device_mounted_at(&m, &state.device, &state.staging_path))
            }))
    }
}

#[tonic::async_trait]
impl Attacher for ReplicatedAttacher {
    type Plan = driver::BlockPlan;

    async fn stage(&self, call: &Stage<'_>, plan: &driver::BlockPlan) -> CsiResult<()> {
        let backend = call.volume.backend;
        if self.config.grants_for(&backend.name).block.is_none_or(|b| b.is_empty()) {
            return Err(CsiError::FailedPrecondition(format!(
                "backend {} has no block grant on this node ([backends.{}.grants.block])",
                backend.name, backend.name
            )));
        }
        let catalog = backend.block_catalog().ok_or_else(|| {
            CsiError::FailedPrecondition(format!("backend {} has no block grant on this node", backend.name))
        })?;
        let engines = self.engines()?.clone();
        let wanted_fs = match &call.capability.access_type {
            types::AccessType::Block => None,
            types::AccessType::Mount(m) => {
                let fs = if m.fs_type.is_empty() { plan.fs_type.clone() } else { m.fs_type.clone() };
                Some(Filesystem::wanted(&fs, &m.mount_flags, is_read_only_mode(call.capability))?)
            }
        };
        if let Some(old) = self.load(call.volume.id)? {
            let same_fs = match (&wanted_fs, &old.filesystem) {
                (None, None) => true,
                (Some(want), Some(have)) => want.satisfied_by(have),
                _ => false,
            };
            if old.set_id == plan.volume_id
                && old.staging_path == call.staging
                && same_fs
                && self.standing(&old).await?
            {
                return Ok(());
            }
            // Staged differently, or by a plugin that died: start over.
            self.teardown(&old).await?;
        }
        let mut info = catalog.attach_info(&plan.volume_id, &self.node_id).await?;
        // Absent (a controller of the version before grants, a publish without TLS): the data
        // path asks its grant source for one.
        info.grant = publish_grant(call.publish_context)?;
        let volume = engines.attach(&plan.volume_id, &info).await.map_err(engines_err)?;
        let mut state = ReplicatedState {
            volume_id: call.volume.id.to_owned(),
            set_id: plan.volume_id.clone(),
            staging_path: call.staging.to_owned(),
            device: volume.device.clone(),
            filesystem: None,
            pid: volume.pid,
            owner: volume.owner.clone(),
        };
        let Some(mut fs) = wanted_fs else {
            return self.save(&state);
        };
        let (device, staging) = (state.device.clone(), state.staging_path.clone());
        let what = format!("replicated volume {}", plan.volume_id);
        let mounted = blocking(move || {
            fs.format_and_mount(&device, &staging, &what)?;
            Ok(fs)
        })
        .await;
        match mounted {
            Ok(fs) => {
                state.filesystem = Some(fs);
                self.save(&state)
            }
            Err(e) => {
                // Nothing half-done stays: the engine stops again.
                if let Err(stop) = engines.detach(&plan.volume_id).await {
                    tracing::warn!(volume.id = %call.volume.id, error = %stop, "stopping the engine after a failed stage");
                }
                Err(e)
            }
        }
    }

    /// A volume with a replicated state file is this kind's, whatever the mount table shows.
    async fn unstage(&self, volume_id: &str, _staging: &Path) -> CsiResult<Unstaged> {
        let Some(state) = self.load(volume_id)? else { return Ok(Unstaged::NotMine) };
        self.teardown(&state).await?;
        Ok(Unstaged::Done)
    }

    async fn publish(&self, call: &Publish<'_>, _plan: &driver::BlockPlan) -> CsiResult<()> {
        if !matches!(call.capability.access_type, types::AccessType::Block) {
            return publish_staged(&self.mounts, call).await;
        }
        let state = self.load(call.volume.id)?.filter(|s| s.filesystem.is_none()).ok_or_else(|| {
            CsiError::FailedPrecondition(format!("volume {} is not staged as a raw block device", call.volume.id))
        })?;
        let (sys, to) = (self.mounts.clone(), Placement::of(call));
        blocking(move || publish_device(sys.as_ref(), &state.device, &to)).await
    }

    async fn stats(&self, call: &Stats<'_>, _plan: &driver::BlockPlan) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
        use csi::volume_usage::Unit;
        let state = self
            .load(call.volume.id)?
            .ok_or_else(|| CsiError::NotFound(format!("volume {} is not staged on this node", call.volume.id)))?;
        let mut shared = None;
        let problem = match self.running(&state).await {
            // The volume is staged: the answer is a condition, not a failed call.
            Err(e) => Some(format!("the data path does not answer: {e}")),
            Ok(None) => Some("the engine of this volume no longer runs (its process restarted); restage it".to_owned()),
            Ok(Some(v)) => {
                shared = v.shared_nodes().map(|(replicas, nodes)| (v.healthy(), replicas, nodes));
                if v.status.fenced {
                    Some("another node was given this volume; this node's engine is fenced".into())
                } else if v.healthy() < v.status.replicas.len() {
                    Some(format!(
                        "degraded: {}/{} replicas healthy{}",
                        v.healthy(),
                        v.status.replicas.len(),
                        rebuild_note(&v)
                    ))
                } else {
                    None
                }
            }
        };
        let mut answer = if state.filesystem.is_none() {
            let device = state.device.clone();
            let size = blocking(move || loop_dev::size_bytes(&device).map_err(CsiError::Device)).await?;
            csi::NodeGetVolumeStatsResponse {
                usage: vec![csi::VolumeUsage {
                    total: convert::bytes(size),
                    unit: Unit::Bytes as i32,
                    ..Default::default()
                }],
                volume_condition: Some(csi::VolumeCondition {
                    abnormal: problem.is_some(),
                    message: problem.unwrap_or_else(|| "healthy".into()),
                }),
            }
        } else {
            usage::fs_stats(call.path.to_owned(), "the volume's device does not answer", problem, None).await?
        };
        if let (Some(condition), Some(shared)) = (answer.volume_condition.as_mut(), shared) {
            note_shared_nodes(condition, shared);
        }
        Ok(answer)
    }

    async fn expand(&self, call: &Expand<'_>, _plan: &driver::BlockPlan) -> CsiResult<u64> {
        let state = self
            .load(call.volume.id)?
            .ok_or_else(|| CsiError::NotFound(format!("volume {} is not staged on this node", call.volume.id)))?;
        let not_running =
            || CsiError::FailedPrecondition(format!("the engine of {} does not run here; restage it", call.volume.id));
        let mut volume = self.running(&state).await?.ok_or_else(not_running)?;
        let required = call.required_bytes;
        let deadline = Instant::now() + GROW_WAIT;
        // The controller grows the volume through this engine (which refreshes the device);
        // a NodeExpand that races it waits a little.
        while volume.status.size < required && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
            volume = self.running(&state).await?.ok_or_else(not_running)?;
        }
        let device = state.device.clone();
        let size = blocking(move || loop_dev::size_bytes(&device).map_err(CsiError::Device)).await?;
        if size < required {
            return Err(CsiError::Unavailable(format!(
                "the device of {} shows {size} bytes, {required} asked: has the controller grown the volume?",
                call.volume.id
            )));
        }
        let Some(fs) = state.filesystem.clone() else { return Ok(size) };
        let (device, staging) = (state.device.clone(), state.staging_path.clone());
        blocking(move || fs.grow(&device, &staging, size)).await?;
        Ok(size)
    }
}

/// A volume whose replicas share a node (a cluster with fewer nodes than replicas, placed on
/// distinct disks) is not abnormal, but it does not survive the loss of that node: the
/// condition says so, on a healthy volume as on a degraded one. `shared`: (healthy replicas,
/// replicas, nodes holding them).
fn note_shared_nodes(condition: &mut csi::VolumeCondition, (healthy, replicas, nodes): (usize, usize, usize)) {
    // The words of the backend's condition (ControllerGetVolume), so both say it alike.
    let note = format!(
        "not node-redundant: {replicas} replicas on {nodes} node{} (distinct disks)",
        if nodes == 1 { "" } else { "s" }
    );
    condition.message = if condition.abnormal {
        format!("{}, {note}", condition.message)
    } else {
        format!("{healthy}/{replicas} replicas healthy, {note}")
    };
}

fn rebuild_note(v: &VolumeView) -> String {
    match v.rebuild() {
        Some((replica, done, total)) => {
            let pct = (done.saturating_mul(100)).checked_div(total).unwrap_or(0);
            format!(", replica {replica} rebuilding {pct}%")
        }
        None => String::new(),
    }
}

/// A data-path failure as the CSI call's error: a concurrent attach or detach is retried by the
/// CO (ABORTED), everything else is UNAVAILABLE (the data path or a replica may come back).
fn engines_err(e: EnginesError) -> CsiError {
    match e {
        EnginesError::Busy(m) => CsiError::InProgress(m),
        other => CsiError::Unavailable(other.to_string()),
    }
}

/// The key of the volume's grant in ControllerPublishVolume's `publish_context`: the grant's
/// bytes as `wasmcsi_trust::Grant` signs them, standard base64 with padding.
pub const GRANT_KEY: &str = "wasmcsi.io/grant";

/// The grant in `publish_context`, if there is one; an undecodable one is the caller's error
/// (the controller sent something else under the key).
fn publish_grant(publish_context: &HashMap<String, String>) -> CsiResult<Option<Vec<u8>>> {
    use base64::Engine as _;
    let Some(encoded) = publish_context.get(GRANT_KEY) else { return Ok(None) };
    base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .map(Some)
        .map_err(|e| CsiError::Invalid(format!("publish_context[{GRANT_KEY:?}] is not base64: {e}")))
}

#[cfg(test)]
mod served_by_tests {
    use super::*;
    use wasmcsi_block::catalog::engine_call::EngineStatus;

    #[test]
    fn the_engine_is_told_by_its_owner_not_by_a_pid_that_repeats_in_every_pod() {
        let view = |pid, owner: &str, device: &str| VolumeView {
            volume: "v".into(),
            device: device.into(),
            pid,
            owner: owner.into(),
            status: EngineStatus::default(),
        };
        let state = ReplicatedState {
            volume_id: "rb:v".into(),
            set_id: "v".into(),
            staging_path: "/staging".into(),
            device: "/dev/loop3".into(),
            filesystem: None,
            pid: 1,
            owner: "0a1b2c3d-00112233445566778899".into(),
        };
        assert!(state.served_by(&view(1, "0a1b2c3d-00112233445566778899", "/dev/loop3")));
        // A data path restarted as pid 1 of a new pid namespace, the same loop number reused.
        assert!(!state.served_by(&view(1, "0a1b2c3d-ffeeddccbbaa99887766", "/dev/loop3")));
        assert!(!state.served_by(&view(1, "0a1b2c3d-00112233445566778899", "/dev/loop4")));
        // A state from before owners were recorded: only the pid can say.
        let legacy = ReplicatedState { owner: String::new(), ..state.clone() };
        assert!(legacy.served_by(&view(1, "0a1b2c3d-ffeeddccbbaa99887766", "/dev/loop3")));
        assert!(!legacy.served_by(&view(7, "0a1b2c3d-ffeeddccbbaa99887766", "/dev/loop3")));
        // The plugin writes what a data path answered into the state it keeps.
        let saved: ReplicatedState =
            serde_json::from_slice(&serde_json::to_vec(&state).expect("encode")).expect("decode");
        assert_eq!(saved, state);
    }
}

#[cfg(test)]
mod grant_tests {
    use super::*;

    #[test]
    fn the_grant_is_read_from_publish_context_and_may_be_absent() {
        let mut context = HashMap::new();
        assert_eq!(publish_grant(&context).ok(), Some(None));
        context.insert(GRANT_KEY.to_owned(), "V0NTSUdSVDEA/w==".to_owned());
        assert_eq!(publish_grant(&context).ok(), Some(Some(b"WCSIGRT1\0\xff".to_vec())));
        context.insert(GRANT_KEY.to_owned(), "not base64!".to_owned());
        assert!(matches!(publish_grant(&context), Err(CsiError::Invalid(_))));
    }
}

#[cfg(test)]
mod condition_tests {
    use super::*;

    #[test]
    fn replicas_sharing_a_node_are_said_on_a_healthy_and_on_a_degraded_volume() {
        let mut healthy = csi::VolumeCondition { abnormal: false, message: "healthy".into() };
        note_shared_nodes(&mut healthy, (3, 3, 1));
        assert_eq!(healthy.message, "3/3 replicas healthy, not node-redundant: 3 replicas on 1 node (distinct disks)");
        assert!(!healthy.abnormal, "redundancy short of nodes is not a fault of the volume");
        let mut degraded = csi::VolumeCondition { abnormal: true, message: "degraded: 1/3 replicas healthy".into() };
        note_shared_nodes(&mut degraded, (1, 3, 2));
        assert_eq!(
            degraded.message,
            "degraded: 1/3 replicas healthy, not node-redundant: 3 replicas on 2 nodes (distinct disks)"
        );
        assert!(degraded.abnormal);
    }
}
