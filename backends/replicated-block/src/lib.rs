//! The `replicated-block` backend: policy for the host's replicated block engine (Longhorn's
//! shape), over the `block` capability. It decides how many replicas a volume gets and where
//! (a node selector, spreading over a label, most free space first; distinct nodes when the
//! cluster has enough, else distinct disks of a node, which the volume condition then says is
//! not node-redundant), what volume and
//! snapshot ids are, what deleting a volume with snapshots means, and when a lost replica is
//! replaced; the host keeps every replica set, its record and its engine (see
//! `docs/replicated-block.md`).
//!
//! - Ids come from CSI names (`policy::volume_id`): a CreateVolume retried anywhere finds the
//!   set it made, and nothing is kept but what the replicas hold (their record carries this
//!   backend's metadata: the CSI name and the StorageClass policy).
//! - A volume deleted while it has snapshots is hidden (metadata `deleted`), its replicas kept
//!   until its last snapshot is deleted: CSI snapshots outlive their source. CreateVolume of
//!   its name meanwhile is ABORTED (retried by the provisioner) saying so: the volume id is the
//!   name's, free again with the last snapshot.
//! - A clone is filled by the host in the background: CreateVolume answers ABORTED with the
//!   progress until it is whole (the provisioner retries).
//! - Backups: a snapshot class `type: backup, target: NAME` makes CreateSnapshot an engine
//!   snapshot (`csi-backup-HASH`) the host uploads to that target; the CSI snapshot is the backup
//!   (`VOLUME.HASH.TARGET`), ready once uploaded, listed from the target, restored by
//!   CreateVolume like a clone. The newest backup snapshot stays in the chain as the next
//!   incremental's base.
//! - Group snapshots (`group`): one crash-consistent point of several volumes through the
//!   host's `snapshot-group`; every member an ordinary snapshot, the group's id `group-HASH`.
//! - Self-healing: the host calls `reconcile-volume`; a replica whose node has been unreachable
//!   for longer than the volume's `staleReplicaTimeout` moves to another eligible node (or disk);
//!   a replica on a node the volume's `replicaNodeSelector` no longer matches moves to one it
//!   matches, one at a time while every replica is healthy.
//! - VolumeAttributesClass (`modify-volume`, and `mutable_parameters` at creation): the volume's
//!   I/O limits, kept by the host with the set and enforced by its engine, and its selector and
//!   stale timeout, kept in the set's metadata (`mutable`). Every key is checked before anything
//!   changes; an unknown or immutable one, or a selector the nodes cannot satisfy, is
//!   INVALID_ARGUMENT naming it.
#![deny(unsafe_code)]

mod group;
pub mod mutable;
pub mod policy;

use std::collections::BTreeMap;

use policy::{Candidate, Disk, Policy, ReplicaHealth, ReplicaView, Slot};
use wasmcsi_backend_sdk::backup::{Backup as _, BackupInfo, BackupSource, BackupState};
use wasmcsi_backend_sdk::block::{BlockSnapshot, BlockSource, NodeInfo, Placement, ReplicaSet, ReplicaState};
use wasmcsi_backend_sdk::names::check_csi_name;
use wasmcsi_backend_sdk::prelude::*;

/// The backend.
pub struct ReplicatedBlock;

wasmcsi_backend_sdk::export!(ReplicatedBlock);

fn pairs_of(list: &[Pair]) -> Vec<(String, String)> {
    list.iter().map(|p| (p.key.clone(), p.value.clone())).collect()
}

fn metadata_of(set: &ReplicaSet) -> BTreeMap<String, String> {
    set.metadata.iter().map(|p| (p.key.clone(), p.value.clone())).collect()
}

fn is_deleted(set: &ReplicaSet) -> bool {
    set.metadata.iter().any(|p| p.key == policy::META_DELETED)
}

fn candidates(nodes: &[NodeInfo]) -> Vec<Candidate> {
    nodes
        .iter()
        .map(|n| Candidate {
            name: n.name.clone(),
            free: n.free_bytes,
            labels: n.labels.iter().map(|p| (p.key.clone(), p.value.clone())).collect(),
            disks: n.disks.iter().map(|d| Disk { name: d.name.clone(), free: d.free_bytes }).collect(),
        })
        .collect()
}

fn placement(slot: &Slot) -> Placement {
    Placement { node: slot.node.clone(), disk: slot.disk.clone() }
}

fn seconds(t: &Timestamp) -> u64 {
    u64::try_from(t.seconds).unwrap_or(0)
}

fn views(set: &ReplicaSet) -> Vec<ReplicaView> {
    set.replicas
        .iter()
        .map(|r| ReplicaView {
            slot: Slot::new(r.node.as_str(), r.disk.as_deref()),
            state: match r.state {
                ReplicaState::Healthy => ReplicaHealth::Healthy,
                ReplicaState::Rebuilding => ReplicaHealth::Rebuilding,
                ReplicaState::Stale => ReplicaHealth::Stale,
                ReplicaState::Unreachable => ReplicaHealth::Unreachable,
            },
            down_since: r.down_since.as_ref().map(seconds),
            rebuilt: r.rebuilt_bytes,
            rebuild_total: r.rebuild_total_bytes,
        })
        .collect()
}

/// A replica set that exists for CSI (not being deleted); NOT_FOUND otherwise.
fn live(h: &impl Host, id: &str) -> Result<ReplicaSet, Error> {
    if !policy::is_volume_id(id) {
        return Err(Error::NotFound(format!("volume {id} not found")));
    }
    match h.block().get(id)? {
        Some(set) if !is_deleted(&set) => Ok(set),
        _ => Err(Error::NotFound(format!("volume {id} not found"))),
    }
}

/// The VolumeAttributesClass parameters, checked whole: INVALID_ARGUMENT naming the first key
/// refused.
fn parse_mutable(params: &[Pair]) -> Result<mutable::Modification, Error> {
    mutable::parse(&pairs_of(params))
}

/// Sets what `modification` changes of `set`: its limits (through the host, which applies them
/// in the engine now or at the next attach) and the placement keys kept in its metadata (the
/// healing rounds move replicas a new selector excludes). A selector the nodes cannot satisfy
/// is refused before anything changes. Asked again with the same values, nothing changes and a
/// running engine is told its limits again: a retry after a failure completes it.
fn apply(h: &impl Host, set: &ReplicaSet, modification: &mutable::Modification) -> Result<(), Error> {
    if modification.is_empty() {
        return Ok(());
    }
    let mut metadata = metadata_of(set);
    let current = policy::policy_from_metadata(&metadata);
    let wanted = modification.applied_to_policy(&current);
    let grow = (wanted.replicas as usize).saturating_sub(set.replicas.len());
    if grow > 0 {
        // Refused now rather than found infeasible by every later healing round.
        let nodes = candidates(&h.block().list_nodes()?);
        let slots: Vec<Slot> = views(set).into_iter().map(|r| r.slot).collect();
        policy::place(&nodes, &wanted, set.size_bytes, grow, &slots).map_err(|e| {
            Error::InvalidArgument(format!("{} {}: {grow} more to place: {}", mutable::REPLICAS, wanted.replicas, e.0))
        })?;
    }
    if wanted.selector != current.selector {
        let nodes = candidates(&h.block().list_nodes()?);
        let slots: Vec<Slot> = views(set).into_iter().map(|r| r.slot).collect();
        let moving = policy::off_selector(&slots, &nodes, &wanted);
        if !moving.is_empty() {
            policy::place(&nodes, &wanted, set.size_bytes, moving.len(), &slots).map_err(|e| {
                Error::InvalidArgument(format!(
                    "{}: {} to move off the nodes it excludes: {}",
                    mutable::SELECTOR,
                    moving.len(),
                    e.0
                ))
            })?;
        }
    }
    if !modification.limits.is_empty() {
        let limits = modification.limits.applied_to(set.limits);
        h.block().set_limits(&set.id, &limits, set.rebuild_bytes_per_second)?;
        let shown = format!(
            "read {} IOPS {} B/s, write {} IOPS {} B/s",
            limits.read_iops, limits.read_bytes_per_second, limits.write_iops, limits.write_bytes_per_second
        );
        h.log().info("I/O limits set", &[("volume", &set.id), ("limits", &shown)]);
    }
    if wanted != current {
        policy::update_policy_metadata(&mut metadata, &wanted);
        let pairs: Vec<Pair> = metadata.into_iter().map(|(key, value)| Pair { key, value }).collect();
        h.block().set_metadata(&set.id, &pairs)?;
        let stale = format!("{}s", wanted.stale_timeout.as_secs());
        let selector = modification.selector.as_ref().map(|_| "changed").unwrap_or("kept");
        let replicas = wanted.replicas.to_string();
        h.log().info(
            "placement policy set",
            &[
                ("volume", &set.id),
                ("numberOfReplicas", &replicas),
                ("staleReplicaTimeout", &stale),
                ("replicaNodeSelector", selector),
            ],
        );
        // The first step now (the healing rounds take the rest, one replica at a time).
        if wanted.replicas != current.replicas {
            change_count(h, &set.id, &wanted)?;
        }
    }
    Ok(())
}

/// Adds or removes one replica toward the policy's `numberOfReplicas` when every replica is
/// healthy (see [`policy::next_count_change`]); returns whether it changed the set. A hidden
/// (deleted) volume's set stays as it is.
fn change_count(h: &impl Host, id: &str, policy: &Policy) -> Result<bool, Error> {
    let Some(set) = h.block().get(id)? else { return Err(Error::NotFound(format!("volume {id} not found"))) };
    let whole = set.replicas.iter().all(|r| r.state == ReplicaState::Healthy);
    if set.replicas.len() == policy.replicas as usize || is_deleted(&set) || !whole {
        return Ok(false);
    }
    let nodes = candidates(&h.block().list_nodes()?);
    let change = policy::next_count_change(&views(&set), &nodes, policy, set.size_bytes, set.attached_to.as_deref());
    match change {
        Ok(Some(policy::CountChange::Grow(to))) => {
            h.block().add_replica(id, &placement(&to))?;
            h.log().info("replica added for numberOfReplicas", &[("volume", id), ("at", &to.to_string())]);
            Ok(true)
        }
        Ok(Some(policy::CountChange::Shrink(from))) => {
            h.block().remove_replica(id, &placement(&from))?;
            h.log().info("replica removed for numberOfReplicas", &[("volume", id), ("from", &from.to_string())]);
            Ok(true)
        }
        Ok(None) => Ok(false),
        Err(e) => {
            h.log().warn("a replica for numberOfReplicas cannot be placed yet", &[("volume", id), ("why", &e.0)]);
            Ok(false)
        }
    }
}

/// Moves one replica whose node the volume's selector excludes (a VolumeAttributesClass changed
/// it) to a node it matches, when every replica is healthy: the host replaces it with an empty
/// one that the engine rebuilds from the others while the volume serves I/O (attached), or the
/// next attach rebuilds (detached). One per round, so the set is never short of more than one
/// whole replica; a hidden (deleted) volume's replicas stay where they are.
fn move_off_selector(h: &impl Host, set: &ReplicaSet, policy: &Policy) -> Result<(), Error> {
    // Before listing the nodes (a round trip to each): no move starts while one rebuilds.
    let whole = set.replicas.iter().all(|r| r.state == ReplicaState::Healthy);
    if policy.selector.is_empty() || is_deleted(set) || !whole {
        return Ok(());
    }
    let nodes = candidates(&h.block().list_nodes()?);
    match policy::next_move(&views(set), &nodes, policy, set.size_bytes) {
        Ok(Some((from, to))) => {
            h.block().replace(&set.id, &placement(&from), &placement(&to))?;
            h.log().info(
                "replica moved to a node matching replicaNodeSelector",
                &[("volume", &set.id), ("from", &from.to_string()), ("to", &to.to_string())],
            );
        }
        Ok(None) => {}
        Err(e) => {
            h.log().warn("a replica off replicaNodeSelector cannot move yet", &[("volume", &set.id), ("why", &e.0)])
        }
    }
    Ok(())
}

/// Replicated volumes attach to one node at a time (one engine writes them).
fn unsupported_mode(caps: &[VolumeCapability]) -> Option<String> {
    caps.iter().find_map(|c| match c.access_mode {
        AccessMode::MultiNodeReaderOnly | AccessMode::MultiNodeSingleWriter | AccessMode::MultiNodeMultiWriter => Some(
            format!("access mode {:?} is not supported: a replicated volume is attached to one node", c.access_mode),
        ),
        _ => None,
    })
}

/// The volume a finished set is, or ABORTED while it is still being filled.
fn volume_of(set: &ReplicaSet, source: Option<ContentSource>) -> Result<Volume, Error> {
    if let Some((done, total)) = set.filling {
        return Err(Error::Aborted(format!(
            "volume {} is being filled from its source: {done} of {total} bytes copied; retry",
            set.id
        )));
    }
    Ok(Volume {
        volume_id: set.id.clone(),
        capacity_bytes: set.size_bytes,
        volume_context: vec![],
        content_source: source,
        // The engine runs on whichever node stages the volume: reachable from everywhere.
        accessible_topology: vec![],
    })
}

fn status_of(set: &ReplicaSet) -> VolumeStatus {
    let wanted = policy::policy_from_metadata(&metadata_of(set)).replicas.max(set.replicas.len() as u32);
    let (abnormal, message) = policy::condition(&views(set), wanted);
    VolumeStatus {
        volume: Volume {
            volume_id: set.id.clone(),
            capacity_bytes: set.size_bytes,
            volume_context: vec![],
            content_source: None,
            accessible_topology: vec![],
        },
        condition: Some(VolumeCondition { abnormal, message }),
    }
}

fn snapshot_of(s: &BlockSnapshot) -> Option<Snapshot> {
    Some(Snapshot {
        snapshot_id: policy::snapshot_id(&s.volume_id, &s.name)?,
        source_volume_id: s.volume_id.clone(),
        size_bytes: s.size_bytes,
        creation_time: s.created,
        ready_to_use: true,
    })
}

/// Every CSI snapshot of `volume` (or of every volume), sorted by id.
fn snapshots(h: &impl Host, volume: Option<&str>) -> Result<Vec<Snapshot>, Error> {
    let mut all: Vec<Snapshot> = h.block().list_snapshots(volume)?.iter().filter_map(snapshot_of).collect();
    all.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
    Ok(all)
}

/// The CSI snapshots of `volume` in its chain (not the bases of its backups).
fn csi_snapshots_of(h: &impl Host, volume: &str) -> Result<Vec<BlockSnapshot>, Error> {
    Ok(h.block()
        .list_snapshots(Some(volume))?
        .into_iter()
        .filter(|s| s.name.starts_with(policy::SNAP_PREFIX))
        .collect())
}

/// Engine snapshot `engine` of set `volume`, for the CSI snapshot `name`: the existing one (a
/// retry), else taken now; ALREADY_EXISTS when another volume has a snapshot of that name.
fn take_snapshot(h: &impl Host, name: &str, volume: &str, engine: &str) -> Result<BlockSnapshot, Error> {
    if let Some(s) = h.block().list_snapshots(Some(volume))?.into_iter().find(|s| s.name == engine) {
        return Ok(s);
    }
    if let Some(other) = h.block().list_snapshots(None)?.iter().find(|s| s.name == engine && s.volume_id != volume) {
        return Err(Error::AlreadyExists(format!("snapshot {name} exists of another volume ({})", other.volume_id)));
    }
    h.block().snapshot(volume, engine)
}

/// Whether backup target `target` is granted to this backend.
fn granted(h: &impl Host, target: &str) -> bool {
    h.backup().targets().iter().any(|t| t == target)
}

/// The host's id of backup `backup` of `volume` (see the `backup` import: `VOLUME/NAME`).
fn host_backup_id(volume: &str, backup: &str) -> String {
    format!("{volume}/{backup}")
}

/// The CSI snapshot a backup is, while it uploads (not ready) and once complete; `None` for a
/// failed one (the host forgets it: the next CreateSnapshot starts it again) or one not made by
/// this backend.
fn backup_snapshot_of(info: &BackupInfo) -> Option<Snapshot> {
    let (volume, backup) = info.id.rsplit_once('/')?;
    let ready = match info.state {
        BackupState::Ready => true,
        BackupState::InProgress => false,
        BackupState::Failed => return None,
    };
    Some(Snapshot {
        snapshot_id: policy::backup_snapshot_id(volume, backup, &info.target)?,
        source_volume_id: volume.to_owned(),
        size_bytes: info.size_bytes,
        creation_time: info.created,
        ready_to_use: ready,
    })
}

/// Backup `backup` of `volume` on `target` as a CSI snapshot.
fn backup_of(h: &impl Host, volume: &str, backup: &str, target: &str) -> Result<Option<Snapshot>, Error> {
    if !granted(h, target) {
        return Ok(None);
    }
    Ok(h.backup().get(target, &host_backup_id(volume, backup), &[])?.as_ref().and_then(backup_snapshot_of))
}

/// Every backup this backend made of `volume` (or of every volume) on every granted target.
fn backups(h: &impl Host, volume: Option<&str>) -> Result<Vec<Snapshot>, Error> {
    let mut out = Vec::new();
    for target in h.backup().targets() {
        let mut after: Option<String> = None;
        loop {
            let page = h.backup().list(&target, volume, after.as_deref(), 1000, &[])?;
            out.extend(page.iter().filter_map(backup_snapshot_of));
            match page.last() {
                Some(last) if page.len() == 1000 => after = Some(last.id.clone()),
                _ => break,
            }
        }
    }
    Ok(out)
}

/// CreateSnapshot of class `type: backup`: a crash-consistent snapshot through the engine,
/// uploaded to `target` by the host (incremental against the volume's newest backup there).
/// Not ready until the upload is complete; the CO asks again (CreateSnapshot, ListSnapshots)
/// until it is. Once ready, the volume's older backup bases leave its chain: the newest is the
/// base of the next incremental.
fn backup_snapshot(
    h: &impl Host,
    name: &str,
    source: &ReplicaSet,
    target: &str,
    secrets: &[SecretRef],
) -> Result<Snapshot, Error> {
    if !granted(h, target) {
        return Err(Error::InvalidArgument(format!(
            "backup target {target:?} is not granted to this backend (granted: {:?})",
            h.backup().targets()
        )));
    }
    let base = policy::backup_name(name);
    let taken = take_snapshot(h, name, &source.id, &base)?;
    let labels = [Pair { key: "csi.name".into(), value: name.to_owned() }];
    let info = h.backup().start(
        target,
        &base,
        &BackupSource::BlockSnapshot((source.id.clone(), base.clone())),
        &labels,
        secrets,
    )?;
    if let (BackupState::Failed, why) = (&info.state, &info.error) {
        return Err(Error::Unavailable(format!(
            "the backup of {name} to {target} failed ({}); it starts again on the next call",
            why.as_deref().unwrap_or("no reason given")
        )));
    }
    if matches!(info.state, BackupState::Ready) {
        drop_older_bases(h, &source.id, &taken)?;
    }
    let mut snapshot =
        backup_snapshot_of(&info).ok_or_else(|| Error::Internal(format!("backup {} has no snapshot id", info.id)))?;
    snapshot.creation_time = taken.created;
    Ok(snapshot)
}

/// Deletes the backup bases of `volume` older than `newest`. A base whose backup still runs is
/// younger (a backup reads the snapshot taken for it), so none is taken from under a backup.
fn drop_older_bases(h: &impl Host, volume: &str, newest: &BlockSnapshot) -> Result<(), Error> {
    let older = |s: &BlockSnapshot| {
        s.name != newest.name
            && s.name.starts_with(policy::BACKUP_PREFIX)
            && (s.created.seconds, s.created.nanos) < (newest.created.seconds, newest.created.nanos)
    };
    for s in h.block().list_snapshots(Some(volume))?.iter().filter(|s| older(s)) {
        h.block().delete_snapshot(volume, &s.name)?;
    }
    Ok(())
}

/// The source of a volume restored from backup `backup` of `volume` on `target` (snapshot id
/// `sid`): it must be complete and fit `size`.
fn restore_source(
    h: &impl Host,
    sid: &str,
    volume: &str,
    backup: &str,
    target: &str,
    size: u64,
    secrets: &[SecretRef],
) -> Result<BlockSource, Error> {
    if !granted(h, target) {
        return Err(Error::NotFound(format!("snapshot {sid} not found: backup target {target} is not granted here")));
    }
    let id = host_backup_id(volume, backup);
    let info =
        h.backup().get(target, &id, secrets)?.ok_or_else(|| Error::NotFound(format!("snapshot {sid} not found")))?;
    match info.state {
        BackupState::Ready => {}
        BackupState::InProgress => {
            return Err(Error::Aborted(format!("snapshot {sid} is still being uploaded; retry when it is ready")));
        }
        BackupState::Failed => return Err(Error::NotFound(format!("snapshot {sid} failed and is not restorable"))),
    }
    if info.size_bytes > size {
        return Err(Error::OutOfRange(format!(
            "snapshot {sid} holds {} bytes, more than the {size} requested",
            info.size_bytes
        )));
    }
    Ok(BlockSource::Backup((target.to_owned(), info.id)))
}

impl Backend for ReplicatedBlock {
    fn info() -> BackendInfo {
        BackendInfo {
            name: "replicated-block".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            features: vec![
                Feature::CreateDeleteVolume,
                Feature::CreateDeleteSnapshot,
                Feature::ListSnapshots,
                Feature::CloneVolume,
                Feature::ExpandVolume,
                Feature::OnlineExpansion,
                Feature::GetCapacity,
                Feature::ListVolumes,
                Feature::GetVolume,
                Feature::VolumeCondition,
                Feature::SingleNodeMultiWriter,
                Feature::NodeExpansion,
                Feature::GetSnapshot,
                Feature::SelfHealing,
                Feature::ModifyVolume,
                Feature::GroupSnapshots,
            ],
            parameters: policy::PARAMETERS.iter().map(|p| (*p).to_owned()).collect(),
        }
    }

    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error> {
        check_csi_name("volume", &req.name)?;
        let class = policy::parse_parameters(&pairs_of(&req.parameters)).map_err(|e| Error::InvalidArgument(e.0))?;
        // Checked before anything is made: a class that cannot be applied creates nothing.
        let modification = parse_mutable(&req.mutable_parameters)?;
        // A VolumeAttributesClass's placement keys win over the StorageClass's.
        let policy = modification.applied_to_policy(&class);
        if let Some(why) = unsupported_mode(&req.capabilities) {
            return Err(Error::InvalidArgument(why));
        }
        let size = policy::size_for(req.capacity.required_bytes, req.capacity.limit_bytes)
            .map_err(|e| Error::OutOfRange(e.0))?;
        let source = match &req.content_source {
            None => None,
            Some(ContentSource::Snapshot(sid)) => match policy::parse_backup_snapshot_id(sid) {
                Some((volume, backup, target)) => {
                    Some(restore_source(h, sid, &volume, &backup, &target, size, &req.secrets)?)
                }
                None => {
                    let (volume, snapshot) = policy::parse_snapshot_id(sid)
                        .ok_or_else(|| Error::NotFound(format!("snapshot {sid} not found")))?;
                    Some(BlockSource::Snapshot((volume, snapshot)))
                }
            },
            Some(ContentSource::Volume(vid)) => Some(BlockSource::Volume(live(h, vid)?.id)),
        };
        let id = policy::volume_id(&req.name);
        if let Some(set) = h.block().get(&id)? {
            let recorded = metadata_of(&set).get(policy::META_NAME).cloned().unwrap_or_default();
            if recorded != req.name {
                return Err(Error::AlreadyExists(format!("volume id {id} belongs to another volume ({recorded:?})")));
            }
            if is_deleted(&set) {
                // The id is the name's: it is free again once the snapshots holding the
                // earlier volume's replicas are deleted. Until then the provisioner retries.
                let held = csi_snapshots_of(h, &id)?.len();
                return Err(Error::Aborted(format!(
                    "an earlier volume named {} was deleted while {held} snapshot(s) of it exist; they keep its \
                     replicas, and the name is free again once they are deleted",
                    req.name
                )));
            }
            let limit = req.capacity.limit_bytes;
            if set.size_bytes < size || (limit != 0 && set.size_bytes > limit) {
                return Err(Error::AlreadyExists(format!(
                    "volume {} exists with {} bytes, outside the requested range",
                    req.name, set.size_bytes
                )));
            }
            if set.filling.is_some() {
                // `create` again, not `get`: the host resumes a fill no process of it runs (it
                // restarted) and reports one that failed, naming why, on `create`.
                let placements: Vec<Placement> =
                    set.replicas.iter().map(|r| Placement { node: r.node.clone(), disk: r.disk.clone() }).collect();
                let set = h.block().create(&id, set.size_bytes, &placements, source.as_ref(), &set.metadata)?;
                apply(h, &set, &modification)?;
                return volume_of(&set, req.content_source);
            }
            apply(h, &set, &modification)?;
            return volume_of(&set, req.content_source);
        }
        let nodes = candidates(&h.block().list_nodes()?);
        let placed = policy::place(&nodes, &policy, size, policy.replicas as usize, &[])
            .map_err(|e| Error::ResourceExhausted(e.0))?;
        let metadata: Vec<Pair> =
            policy::policy_metadata(&req.name, &policy).into_iter().map(|(key, value)| Pair { key, value }).collect();
        let placements: Vec<Placement> = placed.iter().map(placement).collect();
        let set = h.block().create(&id, size, &placements, source.as_ref(), &metadata)?;
        let shown: Vec<String> = placed.iter().map(ToString::to_string).collect();
        h.log().info("replica set created", &[("volume", &id), ("replicas", &shown.join(","))]);
        // A failure here leaves the set without its limits; the provisioner's retry finds the
        // set and applies them (above) before the volume is handed out.
        apply(h, &set, &modification)?;
        volume_of(&set, req.content_source)
    }

    fn delete_volume(h: &impl Host, id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        if !policy::is_volume_id(&id) {
            return Ok(());
        }
        let Some(set) = h.block().get(&id)? else { return Ok(()) };
        if !csi_snapshots_of(h, &id)?.is_empty() {
            if !is_deleted(&set) {
                let mut metadata = set.metadata.clone();
                metadata.push(Pair { key: policy::META_DELETED.into(), value: "true".into() });
                h.block().set_metadata(&id, &metadata)?;
                h.log().info("volume hidden until its last snapshot is deleted", &[("volume", &id)]);
            }
            return Ok(());
        }
        h.block().delete(&id)
    }

    fn expand_volume(
        h: &impl Host,
        id: String,
        capacity: CapacityRange,
        capability: Option<VolumeCapability>,
        _: Vec<SecretRef>,
    ) -> Result<Expansion, Error> {
        let set = live(h, &id)?;
        let size =
            policy::size_for(capacity.required_bytes, capacity.limit_bytes).map_err(|e| Error::OutOfRange(e.0))?;
        let grown = if size > set.size_bytes { h.block().expand(&id, size)?.size_bytes } else { set.size_bytes };
        // A filesystem grows on the node; a raw block device is the size of the volume.
        let node_expansion_required = !matches!(capability.map(|c| c.access_type), Some(AccessType::Block));
        Ok(Expansion { capacity_bytes: grown, node_expansion_required })
    }

    fn modify_volume(h: &impl Host, id: String, mutable_parameters: Vec<Pair>, _: Vec<SecretRef>) -> Result<(), Error> {
        let set = live(h, &id)?;
        let modification = parse_mutable(&mutable_parameters)?;
        apply(h, &set, &modification)
    }

    fn get_volume(h: &impl Host, id: String) -> Result<VolumeStatus, Error> {
        Ok(status_of(&live(h, &id)?))
    }

    fn list_volumes(h: &impl Host, max_entries: u32, starting_token: String) -> Result<VolumePage, Error> {
        let all: Vec<VolumeStatus> = h
            .block()
            .list_sets(None, u32::MAX)?
            .iter()
            .filter(|s| !is_deleted(s) && s.filling.is_none() && policy::is_volume_id(&s.id))
            .map(status_of)
            .collect();
        let (entries, next_token) = page(all, max_entries, &starting_token)?;
        Ok(VolumePage { entries, next_token })
    }

    fn validate_volume_capabilities(
        h: &impl Host,
        id: String,
        _: Vec<Pair>,
        capabilities: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
    ) -> Result<Option<String>, Error> {
        live(h, &id)?;
        if let Err(e) = policy::parse_parameters(&pairs_of(&parameters)) {
            return Ok(Some(e.0));
        }
        Ok(unsupported_mode(&capabilities))
    }

    fn create_snapshot(
        h: &impl Host,
        name: String,
        source_volume_id: String,
        parameters: Vec<Pair>,
        secrets: Vec<SecretRef>,
    ) -> Result<Snapshot, Error> {
        check_csi_name("snapshot", &name)?;
        let kind =
            policy::parse_snapshot_parameters(&pairs_of(&parameters)).map_err(|e| Error::InvalidArgument(e.0))?;
        let source = live(h, &source_volume_id)?;
        if let policy::SnapshotKind::Backup { target } = kind {
            return backup_snapshot(h, &name, &source, &target, &secrets);
        }
        let snap = policy::snapshot_name(&name);
        let taken = take_snapshot(h, &name, &source.id, &snap)?;
        snapshot_of(&taken).ok_or_else(|| Error::Internal(format!("snapshot {snap} has no id")))
    }

    fn delete_snapshot(h: &impl Host, id: String, secrets: Vec<SecretRef>) -> Result<(), Error> {
        if let Some((volume, backup, target)) = policy::parse_backup_snapshot_id(&id) {
            h.backup().delete(&target, &host_backup_id(&volume, &backup), &secrets)?;
            // Its engine snapshot too, when it is still the volume's base (the next backup
            // then reads the volume whole, against the newest backup left).
            if h.block().get(&volume)?.is_some()
                && h.block().list_snapshots(Some(&volume))?.iter().any(|s| s.name == backup)
            {
                h.block().delete_snapshot(&volume, &backup)?;
            }
            return Ok(());
        }
        let Some((volume, snap)) = policy::parse_snapshot_id(&id) else { return Ok(()) };
        let Some(set) = h.block().get(&volume)? else { return Ok(()) };
        h.block().delete_snapshot(&volume, &snap)?;
        // The last snapshot of a volume deleted earlier takes its replicas with it.
        if is_deleted(&set) && csi_snapshots_of(h, &volume)?.is_empty() {
            h.block().delete(&volume)?;
        }
        Ok(())
    }

    fn list_snapshots(
        h: &impl Host,
        snapshot_id: Option<String>,
        source_volume_id: Option<String>,
        max_entries: u32,
        starting_token: String,
    ) -> Result<SnapshotPage, Error> {
        let all = match (&snapshot_id, &source_volume_id) {
            (Some(sid), _) => match (policy::parse_snapshot_id(sid), policy::parse_backup_snapshot_id(sid)) {
                (Some((volume, _)), _) => {
                    snapshots(h, Some(&volume))?.into_iter().filter(|s| &s.snapshot_id == sid).collect()
                }
                (None, Some((volume, backup, target))) => {
                    backup_of(h, &volume, &backup, &target)?.into_iter().collect()
                }
                (None, None) => vec![],
            },
            (None, Some(vid)) if policy::is_volume_id(vid) => {
                let mut all = snapshots(h, Some(vid))?;
                all.extend(backups(h, Some(vid))?);
                all
            }
            (None, Some(_)) => vec![],
            (None, None) => {
                let mut all = snapshots(h, None)?;
                all.extend(backups(h, None)?);
                all
            }
        };
        let mut all = all;
        all.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
        let all: Vec<Snapshot> =
            all.into_iter().filter(|s| source_volume_id.as_ref().is_none_or(|v| &s.source_volume_id == v)).collect();
        let (entries, next_token) = page(all, max_entries, &starting_token)?;
        Ok(SnapshotPage { entries, next_token })
    }

    fn get_snapshot(h: &impl Host, id: String) -> Result<Snapshot, Error> {
        if let Some((volume, backup, target)) = policy::parse_backup_snapshot_id(&id) {
            return backup_of(h, &volume, &backup, &target)?
                .ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")));
        }
        let (volume, _) =
            policy::parse_snapshot_id(&id).ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")))?;
        snapshots(h, Some(&volume))?
            .into_iter()
            .find(|s| s.snapshot_id == id)
            .ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")))
    }

    fn create_group_snapshot(
        h: &impl Host,
        name: String,
        source_volume_ids: Vec<String>,
        parameters: Vec<Pair>,
        _: Vec<SecretRef>,
    ) -> Result<GroupSnapshot, Error> {
        group::create(h, &name, &source_volume_ids, &parameters)
    }

    fn delete_group_snapshot(
        h: &impl Host,
        group_snapshot_id: String,
        snapshot_ids: Vec<String>,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        group::delete(h, &group_snapshot_id, &snapshot_ids, &secrets)
    }

    fn get_group_snapshot(
        h: &impl Host,
        group_snapshot_id: String,
        snapshot_ids: Vec<String>,
        _: Vec<SecretRef>,
    ) -> Result<GroupSnapshot, Error> {
        group::get(h, &group_snapshot_id, &snapshot_ids)
    }

    fn get_capacity(
        h: &impl Host,
        _: Vec<VolumeCapability>,
        parameters: Vec<Pair>,
        _: Option<Topology>,
    ) -> Result<Capacity, Error> {
        // The volume is reachable from every node: the capacity is the same in every segment.
        let policy = policy::parse_parameters(&pairs_of(&parameters)).map_err(|e| Error::InvalidArgument(e.0))?;
        let available = policy::capacity(&candidates(&h.block().list_nodes()?), &policy);
        Ok(Capacity {
            available_bytes: available,
            maximum_volume_bytes: available,
            minimum_volume_bytes: policy::SIZE_UNIT,
        })
    }

    fn attach_plan(
        h: &impl Host,
        id: String,
        _: Vec<Pair>,
        capability: VolumeCapability,
        _: Vec<SecretRef>,
    ) -> Result<Attachment, Error> {
        let set = live(h, &id)?;
        if let Some(why) = unsupported_mode(std::slice::from_ref(&capability)) {
            return Err(Error::FailedPrecondition(why));
        }
        let policy = policy::policy_from_metadata(&metadata_of(&set));
        Ok(Attachment::ReplicatedBlock(BlockPlan {
            volume_id: set.id,
            size_bytes: set.size_bytes,
            fs_type: policy.fs_type,
            frontend: None,
            encryption: None,
        }))
    }

    fn reconcile_volume(h: &impl Host, id: String, now: Timestamp) -> Result<(), Error> {
        if !policy::is_volume_id(&id) {
            return Err(Error::NotFound(format!("volume {id} not found")));
        }
        // A hidden volume still holds snapshots: it is healed too.
        let Some(set) = h.block().get(&id)? else { return Err(Error::NotFound(format!("volume {id} not found"))) };
        let policy: Policy = policy::policy_from_metadata(&metadata_of(&set));
        // The host's clock: when a replica has been down too long is decided against it.
        let now = u64::try_from(now.seconds).unwrap_or(0);
        let overdue = policy::overdue(&views(&set), &policy, now);
        if overdue.is_empty() {
            // One change per round: each waits until the set is whole again.
            if change_count(h, &id, &policy)? {
                return Ok(());
            }
            return move_off_selector(h, &set, &policy);
        }
        let nodes = candidates(&h.block().list_nodes()?);
        for lost in overdue {
            let set = h.block().get(&id)?.ok_or_else(|| Error::NotFound(format!("volume {id} not found")))?;
            // The lost replica's place stays taken: a replacement must not land on it.
            let taken: Vec<Slot> = set.replicas.iter().map(|r| Slot::new(r.node.as_str(), r.disk.as_deref())).collect();
            match policy::place(&nodes, &policy, set.size_bytes, 1, &taken) {
                Ok(chosen) => {
                    let with = &chosen[0];
                    h.block().replace(&id, &placement(&lost), &placement(with))?;
                    h.log().warn(
                        "replica lost for too long replaced",
                        &[("volume", &id), ("lost", &lost.to_string()), ("with", &with.to_string())],
                    );
                }
                Err(e) => {
                    h.log().warn(
                        "a lost replica cannot be replaced yet",
                        &[("volume", &id), ("lost", &lost.to_string()), ("why", &e.0)],
                    );
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
