//! VolumeGroupSnapshots: the host's `block.snapshot-group` takes one snapshot of every source at
//! one point (every attached engine holds its writes while the snapshots are taken), and each is
//! an ordinary snapshot of its volume, named [`policy::group_snapshot_name`] of the group's CSI
//! name. The group's id `group-HASH` and its members' ids `VOLUME.HASH` carry that name, so
//! Get and Delete find the members on the nodes (every snapshot of that name) with nothing kept
//! anywhere else. A member is a snapshot like any other: CreateVolume from it, DeleteSnapshot of
//! it, ListSnapshots shows it.

use std::collections::BTreeSet;

use wasmcsi_backend_sdk::block::BlockSnapshot;
use wasmcsi_backend_sdk::names::check_csi_name;
use wasmcsi_backend_sdk::prelude::*;

use crate::{ReplicatedBlock, live, pairs_of, policy, snapshot_of};

/// The members (engine snapshots named `engine` on any set), oldest volume id first.
fn members(h: &impl Host, engine: &str) -> Result<Vec<BlockSnapshot>, Error> {
    let mut found: Vec<BlockSnapshot> =
        h.block().list_snapshots(None)?.into_iter().filter(|s| s.name == engine).collect();
    found.sort_by(|a, b| a.volume_id.cmp(&b.volume_id));
    Ok(found)
}

/// The group of `members` as CSI sees it: taken when its first member was.
fn group_of(id: &str, members: &[BlockSnapshot]) -> Result<GroupSnapshot, Error> {
    let snapshots = members
        .iter()
        .map(|s| snapshot_of(s).ok_or_else(|| Error::Internal(format!("snapshot {} has no id", s.name))))
        .collect::<Result<Vec<_>, _>>()?;
    let creation_time = members
        .iter()
        .map(|s| s.created)
        .min_by_key(|t| (t.seconds, t.nanos))
        .ok_or_else(|| Error::NotFound(format!("group snapshot {id} not found")))?;
    Ok(GroupSnapshot { group_snapshot_id: id.to_owned(), snapshots, creation_time, ready_to_use: true })
}

/// `snapshot_ids` (the CO's list, empty: not given) must name every member of group `id`.
fn check_members(id: &str, members: &[BlockSnapshot], snapshot_ids: &[String]) -> Result<(), Error> {
    if snapshot_ids.is_empty() {
        return Ok(());
    }
    let given: BTreeSet<&str> = snapshot_ids.iter().map(String::as_str).collect();
    let ids: Vec<String> = members.iter().filter_map(|s| policy::snapshot_id(&s.volume_id, &s.name)).collect();
    if let Some(missing) = ids.iter().find(|m| !given.contains(m.as_str())) {
        return Err(Error::FailedPrecondition(format!(
            "snapshot {missing} of group snapshot {id} is not in snapshot_ids"
        )));
    }
    // A member deleted on its own since is no longer the group's: naming it is no mismatch.
    if let Some(other) = snapshot_ids
        .iter()
        .find(|s| policy::parse_snapshot_id(s).is_none_or(|(_, n)| Some(n) != policy::parse_group_id(id)))
    {
        return Err(Error::FailedPrecondition(format!("snapshot {other} is not of group snapshot {id}")));
    }
    Ok(())
}

pub(crate) fn create(
    h: &impl Host,
    name: &str,
    sources: &[String],
    parameters: &[Pair],
) -> Result<GroupSnapshot, Error> {
    check_csi_name("group snapshot", name)?;
    match policy::parse_snapshot_parameters(&pairs_of(parameters)).map_err(|e| Error::InvalidArgument(e.0))? {
        policy::SnapshotKind::Local => {}
        policy::SnapshotKind::Backup { .. } => {
            return Err(Error::InvalidArgument(
                "a group snapshot is local: type backup is not offered for groups".into(),
            ));
        }
    }
    if sources.is_empty() {
        return Err(Error::InvalidArgument("a group snapshot needs at least one source volume".into()));
    }
    for id in sources {
        live(h, id)?;
    }
    let engine = policy::group_snapshot_name(name);
    let id = policy::group_id(&engine).ok_or_else(|| Error::Internal(format!("snapshot {engine} has no group id")))?;
    let asked: BTreeSet<&str> = sources.iter().map(String::as_str).collect();
    if let Some(other) = members(h, &engine)?.iter().find(|s| !asked.contains(s.volume_id.as_str())) {
        return Err(Error::AlreadyExists(format!(
            "group snapshot {name} exists with other volumes (volume {} is in it)",
            other.volume_id
        )));
    }
    let taken = h.block().snapshot_group(sources, &engine)?;
    group_of(&id, &taken)
}

pub(crate) fn get(h: &impl Host, id: &str, snapshot_ids: &[String]) -> Result<GroupSnapshot, Error> {
    let engine = policy::parse_group_id(id).ok_or_else(|| Error::NotFound(format!("group snapshot {id} not found")))?;
    let found = members(h, &engine)?;
    check_members(id, &found, snapshot_ids)?;
    group_of(id, &found)
}

pub(crate) fn delete(h: &impl Host, id: &str, snapshot_ids: &[String], secrets: &[SecretRef]) -> Result<(), Error> {
    let Some(engine) = policy::parse_group_id(id) else { return Ok(()) };
    let found = members(h, &engine)?;
    check_members(id, &found, snapshot_ids)?;
    for s in &found {
        if let Some(sid) = policy::snapshot_id(&s.volume_id, &s.name) {
            // As DeleteSnapshot: a volume deleted earlier goes with its last snapshot.
            <ReplicatedBlock as Backend>::delete_snapshot(h, sid, secrets.to_vec())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The group's policy against the SDK's in-memory host (`FakeHost`): ids, retries, members
    //! as ordinary snapshots, the CO's snapshot list. The host's hold of attached engines is
    //! tested against real processes (`host/cli/tests/all/group_snapshots.rs`).
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;
    use wasmcsi_backend_sdk::fake::FakeHost;
    use wasmcsi_backend_sdk::types::pairs;

    fn volume(h: &FakeHost, name: &str) -> String {
        let mount = AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] });
        let req = CreateVolumeRequest {
            name: name.into(),
            capacity: CapacityRange { required_bytes: 4 << 20, limit_bytes: 0 },
            capabilities: vec![VolumeCapability { access_type: mount, access_mode: AccessMode::SingleNodeWriter }],
            parameters: pairs([("numberOfReplicas", "2")]),
            secrets: vec![],
            content_source: None,
            accessibility: None,
            mutable_parameters: vec![],
        };
        ReplicatedBlock::create_volume(h, req).unwrap().volume_id
    }

    fn host() -> FakeHost {
        let h = FakeHost::new();
        h.block.add_node("a", 10 << 30, &[]).add_node("b", 10 << 30, &[]);
        h
    }

    #[test]
    fn a_group_is_one_ordinary_snapshot_per_volume_found_again_by_its_id() {
        let h = host();
        let sources = vec![volume(&h, "pvc-1"), volume(&h, "pvc-2"), volume(&h, "pvc-3")];
        let g = create(&h, "vgs-1", &sources, &[]).unwrap();
        assert!(g.group_snapshot_id.starts_with(policy::GROUP_PREFIX) && g.ready_to_use);
        let mut of: Vec<String> = g.snapshots.iter().map(|s| s.source_volume_id.clone()).collect();
        of.sort();
        let mut want = sources.clone();
        want.sort();
        assert_eq!(of, want);
        assert_eq!(create(&h, "vgs-1", &sources, &[]).unwrap(), g, "a retry: the same group");
        let ids: Vec<String> = g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
        assert_eq!(get(&h, &g.group_snapshot_id, &ids).unwrap(), g);
        assert_eq!(get(&h, &g.group_snapshot_id, &[]).unwrap(), g, "no list given");
        // Every member is an ordinary snapshot.
        for s in &g.snapshots {
            assert_eq!(&ReplicatedBlock::get_snapshot(&h, s.snapshot_id.clone()).unwrap(), s);
        }
        // Another VolumeSnapshot of the same name is not the group's.
        let lone = ReplicatedBlock::create_snapshot(&h, "vgs-1".into(), sources[0].clone(), vec![], vec![]).unwrap();
        assert!(!ids.contains(&lone.snapshot_id));
        // The name with other volumes: ALREADY_EXISTS.
        let e = create(&h, "vgs-1", &sources[..2], &[]).unwrap_err();
        assert!(matches!(e, Error::AlreadyExists(_)), "{e:?}");
        // A list that is not the group's: FAILED_PRECONDITION, nothing deleted.
        let e = delete(&h, &g.group_snapshot_id, std::slice::from_ref(&lone.snapshot_id), &[]).unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
        let e = get(&h, &g.group_snapshot_id, &ids[..1]).unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
        delete(&h, &g.group_snapshot_id, &ids, &[]).unwrap();
        delete(&h, &g.group_snapshot_id, &ids, &[]).expect("absent: done");
        assert!(matches!(get(&h, &g.group_snapshot_id, &[]), Err(Error::NotFound(_))));
        assert!(ReplicatedBlock::get_snapshot(&h, lone.snapshot_id).is_ok(), "the lone snapshot stays");
        delete(&h, "not-a-group", &[], &[]).expect("an id that cannot be ours: nothing to delete");
    }

    #[test]
    fn a_missing_source_is_not_found_and_nothing_is_taken() {
        let h = host();
        let one = volume(&h, "pvc-1");
        let missing = "pvc-0-0123456789abcdef".to_owned();
        let e = create(&h, "vgs-2", &[one.clone(), missing], &[]).unwrap_err();
        assert!(matches!(e, Error::NotFound(_)), "{e:?}");
        assert!(h.block().list_snapshots(Some(&one)).unwrap().is_empty());
        let e = create(&h, "vgs-2", &[one], &pairs([("type", "backup"), ("target", "t")])).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    }
}
