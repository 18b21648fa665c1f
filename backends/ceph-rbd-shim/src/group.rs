//! VolumeGroupSnapshots: the host's `rbd.group-snapshot` takes an RBD group snapshot of every
//! source image (librbd's: other clients' writes wait while it is taken, so the parts are one
//! crash-consistent point). Each part is a CSI snapshot of this backend: the image's snapshot
//! `csi-group-HASH@csi-snap-HASH` ([`policy::member_snap_name`]; HASH: [`policy::group_hash`] of
//! the group's CSI name), whose id `VOLUME_ID.HASH` restores through CreateVolume (by a full
//! copy: Ceph 16.2 cannot clone a group snapshot's part) and goes with DeleteSnapshot on its own
//! (so members need no `group_snapshot_id` outside the group calls: CSI asks for it only of
//! snapshots that cannot be deleted alone).
//!
//! Where the truth lives: the group id `CLUSTER.POOL.group-HASH` names the one pool every member
//! is in (an RBD group snapshot is of one pool) and the hash; the RBD group `csi-group-HASH`
//! records the group snapshot; Get and Delete find the members by that snapshot name on this
//! backend's images. kv `groups/HASH` records the sources a group name was taken of, so the
//! same name with other sources is already-exists without a scan (as `snapshots/HASH` does for
//! snapshots; without the record a reused name is not refused, see docs/ceph-rbd-shim.md).
use std::collections::BTreeSet;

use wasmcsi_backend_sdk::names::check_csi_name;
use wasmcsi_backend_sdk::prelude::*;
use wasmcsi_backend_sdk::rbd::ImageSnapshot;

use crate::policy::{self, Target};
use crate::{check_snapshot_params, delete_snapshot, live, remember_pool, require_credentials};

fn group_key(hash: &str) -> String {
    format!("groups/{hash}")
}

/// The members: (volume id, its snapshot) for every image of this backend in `t` that has
/// the part `member`, volume ids in order. A deleted volume's image kept for its snapshots counts too.
fn members(h: &impl Host, t: &Target, member: &str, s: &[SecretRef]) -> Result<Vec<(String, ImageSnapshot)>, Error> {
    let mut found = Vec::new();
    for image in h.rbd().find_by_metadata(&t.pool(s), policy::META_OWNER, policy::OWNER)? {
        let snaps = match h.rbd().snapshot_list(&t.pool(s), &image) {
            Ok(v) => v,
            Err(Error::NotFound(_)) => continue,
            Err(e) => return Err(e),
        };
        if let Some(x) = snaps.into_iter().find(|x| x.name == member) {
            found.push((policy::encode_volume_id(t, &image), x));
        }
    }
    found.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(found)
}

/// The group as CSI sees it, members in `order` (volume ids) when given: taken when its first
/// member was (all were, at one point).
fn group_of(id: &str, hash: &str, members: &[(String, ImageSnapshot)]) -> Result<GroupSnapshot, Error> {
    let snapshots: Vec<Snapshot> = members
        .iter()
        .map(|(vid, x)| Snapshot {
            snapshot_id: policy::encode_snapshot_id(vid, hash),
            source_volume_id: vid.clone(),
            size_bytes: x.size_bytes,
            creation_time: x.created,
            ready_to_use: true,
        })
        .collect();
    let creation_time = members
        .iter()
        .map(|(_, x)| x.created)
        .min_by_key(|t| (t.seconds, t.nanos))
        .ok_or_else(|| Error::NotFound(format!("group snapshot {id} not found")))?;
    Ok(GroupSnapshot { group_snapshot_id: id.to_owned(), snapshots, creation_time, ready_to_use: true })
}

/// `snapshot_ids` (the CO's list; empty: not given) must be exactly the group's members, give
/// or take members deleted on their own since.
fn check_members(id: &str, hash: &str, members: &[(String, ImageSnapshot)], snapshot_ids: &[String]) -> Result<(), Error> {
    if snapshot_ids.is_empty() {
        return Ok(());
    }
    let given: BTreeSet<&str> = snapshot_ids.iter().map(String::as_str).collect();
    let ids: Vec<String> = members.iter().map(|(vid, _)| policy::encode_snapshot_id(vid, hash)).collect();
    if let Some(missing) = ids.iter().find(|m| !given.contains(m.as_str())) {
        return Err(Error::FailedPrecondition(format!("snapshot {missing} of group snapshot {id} is not in snapshot_ids")));
    }
    let ours = |sid: &str| policy::decode_snapshot_id(sid).is_some_and(|(_, _, _, snap)| policy::csi_hash(&snap) == Some(hash));
    if let Some(other) = snapshot_ids.iter().find(|sid| !ours(sid)) {
        return Err(Error::FailedPrecondition(format!("snapshot {other} is not of group snapshot {id}")));
    }
    Ok(())
}

/// The sources, decoded and checked: each once, all in one cluster and pool.
fn sources_of(name: &str, sources: &[String]) -> Result<(Target, Vec<String>), Error> {
    if sources.is_empty() {
        return Err(Error::InvalidArgument("a group snapshot needs at least one source volume".into()));
    }
    let mut seen = BTreeSet::new();
    if let Some(twice) = sources.iter().find(|v| !seen.insert(v.as_str())) {
        return Err(Error::InvalidArgument(format!("volume {twice} is a source twice")));
    }
    let decoded = sources
        .iter()
        .map(|v| policy::decode_volume_id(v).ok_or_else(|| Error::NotFound(format!("volume {v} not found"))))
        .collect::<Result<Vec<_>, _>>()?;
    let t = decoded[0].0.clone();
    if let Some(i) = decoded.iter().position(|(x, _)| *x != t) {
        return Err(Error::InvalidArgument(format!(
            "group snapshot {name}: every volume must be in one cluster and pool (an RBD group snapshot is of one pool); \
             {} is in {}/{}, {} in {}/{}",
            sources[0], t.cluster, t.pool, sources[i], decoded[i].0.cluster, decoded[i].0.pool
        )));
    }
    Ok((t, decoded.into_iter().map(|(_, image)| image).collect()))
}

/// kv `groups/HASH`: refuse a name taken of other sources while any of its snapshots exists;
/// then record this request's sources (before the snapshots: a crash in between leaves a
/// record of nothing, which the next attempt checks and overwrites).
fn claim_name(h: &impl Host, name: &str, hash: &str, sources: &BTreeSet<&str>, s: &[SecretRef]) -> Result<(), Error> {
    let key = group_key(hash);
    let mine = sources.iter().copied().collect::<Vec<_>>().join(",");
    if let Some(prev) = h.kv().get(&key)? {
        let prev = String::from_utf8_lossy(&prev).into_owned();
        if prev != mine {
            let member = policy::member_snap_name(hash);
            for vid in prev.split(',') {
                let Some((pt, image)) = policy::decode_volume_id(vid) else { continue };
                let taken = match h.rbd().snapshot_list(&pt.pool(s), &image) {
                    Ok(v) => v.iter().any(|x| x.name == member),
                    Err(Error::NotFound(_) | Error::PermissionDenied(_)) => false,
                    Err(e) => return Err(e),
                };
                if taken {
                    return Err(Error::AlreadyExists(format!("group snapshot {name} exists with other volumes (volume {vid} is in it)")));
                }
            }
        }
    }
    h.kv().set(&key, mine.as_bytes())
}

pub(crate) fn create(h: &impl Host, name: &str, sources: &[String], parameters: &[Pair], s: &[SecretRef]) -> Result<GroupSnapshot, Error> {
    check_csi_name("group snapshot", name)?;
    let (t, images) = sources_of(name, sources)?;
    require_credentials(s)?;
    check_snapshot_params(parameters, &t)?;
    for (vid, image) in sources.iter().zip(&images) {
        live(h, &t, image, s)?.ok_or_else(|| Error::NotFound(format!("volume {vid} not found")))?;
    }
    let hash = policy::group_hash(name);
    let asked: BTreeSet<&str> = sources.iter().map(String::as_str).collect();
    claim_name(h, name, &hash, &asked, s)?;
    let taken = h.rbd().group_snapshot(&t.pool(s), &policy::group_name(&hash), &images, &policy::snap_name(&hash))?;
    remember_pool(h, &t)?;
    let id = policy::encode_group_id(&t, &hash);
    let members: Vec<(String, ImageSnapshot)> = sources.iter().cloned().zip(taken).collect();
    h.log().info("group snapshot taken", &[("group", &id), ("volumes", &sources.len().to_string())]);
    group_of(&id, &hash, &members)
}

pub(crate) fn get(h: &impl Host, id: &str, snapshot_ids: &[String], s: &[SecretRef]) -> Result<GroupSnapshot, Error> {
    let (t, hash) = policy::decode_group_id(id).ok_or_else(|| Error::NotFound(format!("group snapshot {id} not found")))?;
    let found = members(h, &t, &policy::member_snap_name(&hash), s)?;
    check_members(id, &hash, &found, snapshot_ids)?;
    group_of(id, &hash, &found)
}

pub(crate) fn delete(h: &impl Host, id: &str, snapshot_ids: &[String], s: &[SecretRef]) -> Result<(), Error> {
    let Some((t, hash)) = policy::decode_group_id(id) else { return Ok(()) };
    require_credentials(s)?;
    let found = members(h, &t, &policy::member_snap_name(&hash), s)?;
    check_members(id, &hash, &found, snapshot_ids)?;
    for (vid, _) in &found {
        // As DeleteSnapshot: a volume deleted earlier goes with its last snapshot.
        delete_snapshot(h, &policy::encode_snapshot_id(vid, &hash), s)?;
    }
    // Then the RBD group that recorded it (its parts are gone already).
    h.rbd().group_snapshot_remove(&t.pool(s), &policy::group_name(&hash), &policy::snap_name(&hash))?;
    h.kv().delete(&group_key(&hash))?;
    if !found.is_empty() {
        h.log().info("group snapshot deleted", &[("group", id)]);
    }
    Ok(())
}
