//! The rbd attacher: RBD images of the Ceph clusters the operator configured. NodeStage
//! resolves the plan on this node — the cluster's monitors from the configuration, the pool
//! checked against the backend's `rbd` grant, the credentials from the request's secrets — and
//! hands it to [`RbdNode`] (`staging`), which fences the image against a second node, maps it,
//! and formats and mounts it or keeps it as a raw block device. NodeUnstage finds the volume by
//! its state directory, so it needs neither the plan nor the backend (a restarted plugin, a
//! backend whose file was removed).
mod staging;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_rbd::RbdCredentials;
use wasmcsi_runtime::bindings::types;
use wasmcsi_runtime::driver;

pub use staging::{FuseOwner, RbdNode, RbdState, StageRequest, StagedAs, block_size_of};

use super::attacher::{
    Attacher, ConfigSource, Expand, Placement, Publish, Stage, Stats, Unstaged, blocking, is_read_only_mode,
    publish_device, publish_staged,
};
use super::mounts::MountSystem;
use super::usage;
use crate::convert;
use crate::error::{CsiError, CsiResult};

pub struct RbdAttacher {
    /// The fence's cookie: which node holds an image.
    node_id: String,
    config: Arc<dyn ConfigSource>,
    mounts: Arc<dyn MountSystem>,
    node: Arc<RbdNode>,
}

impl RbdAttacher {
    /// Staged volumes keep their state in `<state_dir>/rbd/<volume id>`; rbd-fuse runs in
    /// `datapath` when the node has one (see `staging`).
    pub fn new(
        node_id: String,
        state_dir: &Path,
        config: Arc<dyn ConfigSource>,
        mounts: Arc<dyn MountSystem>,
        datapath: Option<wasmcsi_datapath::client::Engines>,
    ) -> Self {
        Self { node_id, config, mounts, node: Arc::new(RbdNode::new(state_dir, datapath)) }
    }

    /// NodeStageVolume's plan, resolved on this node: the cluster's monitors from the
    /// configuration, the grant checked (the node executes only what the operator let this
    /// backend use), the credentials from the request's secrets.
    fn stage_request(&self, call: &Stage<'_>, p: &driver::RbdPlan) -> CsiResult<StageRequest> {
        let backend = &call.volume.backend.name;
        let cluster = self.config.cluster(&p.cluster).ok_or_else(|| {
            CsiError::FailedPrecondition(format!(
                "ceph cluster {:?} is not configured on this node ([clusters.{}] in the host config)",
                p.cluster, p.cluster
            ))
        })?;
        let granted = self
            .config
            .grants_for(backend)
            .rbd
            .iter()
            .flatten()
            .any(|g| g.cluster == p.cluster && g.pools.contains(&p.pool));
        if !granted {
            return Err(CsiError::FailedPrecondition(format!(
                "pool {:?} of cluster {:?} is not granted to backend {backend} on this node",
                p.pool, p.cluster
            )));
        }
        let cap = call.capability;
        let staged_as = match &cap.access_type {
            types::AccessType::Block => StagedAs::Block,
            types::AccessType::Mount(m) => {
                if !matches!(m.fs_type.as_str(), "" | "ext4" | "xfs") {
                    return Err(CsiError::Invalid(format!("fs_type {:?} is not supported (ext4, xfs)", m.fs_type)));
                }
                StagedAs::Filesystem { fs_type: m.fs_type.clone(), mount_flags: m.mount_flags.clone() }
            }
        };
        Ok(StageRequest {
            volume_id: call.volume.id.to_owned(),
            cluster: p.cluster.clone(),
            monitors: cluster.monitors,
            pool: p.pool.clone(),
            image: p.image.clone(),
            creds: resolve_credentials(&p.secrets, call.secrets)?,
            staging_path: call.staging.to_owned(),
            staged_as,
            read_only: is_read_only_mode(cap),
        })
    }
}

#[tonic::async_trait]
impl Attacher for RbdAttacher {
    type Plan = driver::RbdPlan;

    async fn stage(&self, call: &Stage<'_>, plan: &driver::RbdPlan) -> CsiResult<()> {
        let req = self.stage_request(call, plan)?;
        self.node.stage(&self.node_id, req).await
    }

    /// A volume with an rbd state directory is this kind's, whatever the mount table shows.
    async fn unstage(&self, volume_id: &str, staging: &Path) -> CsiResult<Unstaged> {
        let unstaged = self.node.unstage(&self.node_id, volume_id, staging).await?;
        Ok(if unstaged { Unstaged::Done } else { Unstaged::NotMine })
    }

    /// Raw block: the staged device node, bind-mounted onto the target file.
    async fn publish(&self, call: &Publish<'_>, _plan: &driver::RbdPlan) -> CsiResult<()> {
        if !matches!(call.capability.access_type, types::AccessType::Block) {
            return publish_staged(&self.mounts, call).await;
        }
        let (node, sys, volume) = (self.node.clone(), self.mounts.clone(), call.volume.id.to_owned());
        let to = Placement::of(call);
        blocking(move || {
            let (_, device) = node.staged_device(&volume)?;
            publish_device(sys.as_ref(), &device, &to)
        })
        .await
    }

    async fn stats(&self, call: &Stats<'_>, _plan: &driver::RbdPlan) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
        use csi::volume_usage::Unit;
        let (node, volume) = (self.node.clone(), call.volume.id.to_owned());
        let (state, condition) = blocking(move || Ok((node.load(&volume)?, node.condition(&volume)))).await?;
        let Some(state) = state else {
            return Err(CsiError::NotFound(format!("volume {} is not staged on this node", call.volume.id)));
        };
        if let (StagedAs::Block, Some(device)) = (&state.staged_as, &state.loop_device) {
            let size = block_size_of(device)?;
            return Ok(csi::NodeGetVolumeStatsResponse {
                usage: vec![csi::VolumeUsage {
                    total: convert::bytes(size),
                    unit: Unit::Bytes as i32,
                    ..Default::default()
                }],
                volume_condition: Some(csi::VolumeCondition {
                    abnormal: condition.is_some(),
                    message: condition.unwrap_or_else(|| "healthy".into()),
                }),
            });
        }
        usage::fs_stats(call.path.to_owned(), "the Ceph cluster of the volume does not answer", condition, None).await
    }

    async fn expand(&self, call: &Expand<'_>, _plan: &driver::RbdPlan) -> CsiResult<u64> {
        let (node, volume, required) = (self.node.clone(), call.volume.id.to_owned(), call.required_bytes);
        blocking(move || node.expand(&volume, required)).await
    }
}

/// The secret keys a plan names, resolved against NodeStageVolume's secrets: the ref whose key
/// ends in `ID` is the cephx user, the one ending in `Key` its key (ceph-csi's `userID` /
/// `userKey`, or `adminID` / `adminKey`). The guest never sees NodeStage's secrets (its plan is
/// computed without them), so the refs are matched by key, not by handle. Values never appear
/// in errors.
pub fn resolve_credentials(
    refs: &[wasmcsi_runtime::driver::SecretRef],
    secrets: &HashMap<String, String>,
) -> CsiResult<RbdCredentials> {
    let pick = |suffix: &str| -> CsiResult<&str> {
        let mut named = refs.iter().filter(|r| r.key.ends_with(suffix));
        let (Some(r), None) = (named.next(), named.next()) else {
            return Err(CsiError::Internal(format!(
                "the rbd plan must name exactly one secret key ending in {suffix:?}; it names {:?}",
                refs.iter().map(|r| r.key.as_str()).collect::<Vec<_>>()
            )));
        };
        secrets
            .get(&r.key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| CsiError::Invalid(format!("NodeStageVolume secrets lack {:?}", r.key)))
    };
    let (user, key) = (pick("ID")?, pick("Key")?);
    Ok(RbdCredentials::new(user, key))
}
#[cfg(test)]
mod tests {
    use super::*;
    use wasmcsi_runtime::driver::SecretRef;

    fn refs(keys: &[&str]) -> Vec<SecretRef> {
        keys.iter().enumerate().map(|(i, k)| SecretRef { key: (*k).into(), handle: i as u32 }).collect()
    }

    #[test]
    fn credentials_resolve_by_the_keys_the_plan_names() {
        let secrets: HashMap<String, String> =
            [("userID", "kube"), ("userKey", "AQB=="), ("adminID", "admin"), ("adminKey", "AQA==")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
        let c = resolve_credentials(&refs(&["userID", "userKey"]), &secrets).expect("resolved");
        assert_eq!((c.user.as_str(), c.key()), ("kube", "AQB=="));
        let c = resolve_credentials(&refs(&["adminID", "adminKey"]), &secrets).expect("resolved");
        assert_eq!(c.user, "admin");
        let missing = resolve_credentials(&refs(&["userID", "userKey"]), &HashMap::new());
        assert!(matches!(&missing, Err(CsiError::Invalid(m)) if m.contains("userID")), "{missing:?}");
        assert!(matches!(resolve_credentials(&refs(&["userID"]), &secrets), Err(CsiError::Internal(_))));
        let err = format!("{:?}", resolve_credentials(&refs(&["userID", "otherKey"]), &secrets));
        assert!(!err.contains("AQB"), "never a key in errors: {err}");
    }
}
