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
//! - Self-healing: the host calls `reconcile-volume`; a replica whose node has been unreachable
//!   for longer than the volume's `staleReplicaTimeout` moves to another eligible node (or disk).
#![deny(unsafe_code)]

pub mod policy;

use std::collections::BTreeMap;

use policy::{Candidate, Disk, Policy, ReplicaHealth, ReplicaView, Slot};
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
            ],
            parameters: policy::PARAMETERS.iter().map(|p| (*p).to_owned()).collect(),
        }
    }

    fn create_volume(h: &impl Host, req: CreateVolumeRequest) -> Result<Volume, Error> {
        check_csi_name("volume", &req.name)?;
        let policy = policy::parse_parameters(&pairs_of(&req.parameters)).map_err(|e| Error::InvalidArgument(e.0))?;
        if let Some(why) = unsupported_mode(&req.capabilities) {
            return Err(Error::InvalidArgument(why));
        }
        let size = policy::size_for(req.capacity.required_bytes, req.capacity.limit_bytes)
            .map_err(|e| Error::OutOfRange(e.0))?;
        let source = match &req.content_source {
            None => None,
            Some(ContentSource::Snapshot(sid)) => {
                let (volume, snapshot) = policy::parse_snapshot_id(sid)
                    .ok_or_else(|| Error::NotFound(format!("snapshot {sid} not found")))?;
                Some(BlockSource::Snapshot((volume, snapshot)))
            }
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
                let held = h.block().list_snapshots(Some(&id))?.len();
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
        volume_of(&set, req.content_source)
    }

    fn delete_volume(h: &impl Host, id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        if !policy::is_volume_id(&id) {
            return Ok(());
        }
        let Some(set) = h.block().get(&id)? else { return Ok(()) };
        if !h.block().list_snapshots(Some(&id))?.is_empty() {
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
        _: Vec<Pair>,
        _: Vec<SecretRef>,
    ) -> Result<Snapshot, Error> {
        check_csi_name("snapshot", &name)?;
        let source = live(h, &source_volume_id)?;
        let snap = policy::snapshot_name(&name);
        if let Some(other) = h.block().list_snapshots(None)?.iter().find(|s| s.name == snap && s.volume_id != source.id)
        {
            return Err(Error::AlreadyExists(format!(
                "snapshot {name} exists of another volume ({})",
                other.volume_id
            )));
        }
        let taken = h.block().snapshot(&source.id, &snap)?;
        snapshot_of(&taken).ok_or_else(|| Error::Internal(format!("snapshot {snap} has no id")))
    }

    fn delete_snapshot(h: &impl Host, id: String, _: Vec<SecretRef>) -> Result<(), Error> {
        let Some((volume, snap)) = policy::parse_snapshot_id(&id) else { return Ok(()) };
        let Some(set) = h.block().get(&volume)? else { return Ok(()) };
        h.block().delete_snapshot(&volume, &snap)?;
        // The last snapshot of a volume deleted earlier takes its replicas with it.
        if is_deleted(&set) && h.block().list_snapshots(Some(&volume))?.is_empty() {
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
            (Some(sid), _) => match policy::parse_snapshot_id(sid) {
                Some((volume, _)) => {
                    snapshots(h, Some(&volume))?.into_iter().filter(|s| &s.snapshot_id == sid).collect()
                }
                None => vec![],
            },
            (None, Some(vid)) if policy::is_volume_id(vid) => snapshots(h, Some(vid))?,
            (None, Some(_)) => vec![],
            (None, None) => snapshots(h, None)?,
        };
        let all: Vec<Snapshot> =
            all.into_iter().filter(|s| source_volume_id.as_ref().is_none_or(|v| &s.source_volume_id == v)).collect();
        let (entries, next_token) = page(all, max_entries, &starting_token)?;
        Ok(SnapshotPage { entries, next_token })
    }

    fn get_snapshot(h: &impl Host, id: String) -> Result<Snapshot, Error> {
        let (volume, _) =
            policy::parse_snapshot_id(&id).ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")))?;
        snapshots(h, Some(&volume))?
            .into_iter()
            .find(|s| s.snapshot_id == id)
            .ok_or_else(|| Error::NotFound(format!("snapshot {id} not found")))
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
            return Ok(());
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
