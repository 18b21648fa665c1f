//! The backend against the SDK's in-memory host (`FakeHost`): what a VolumeAttributesClass
//! does at creation and on an existing volume. The limits' effect on I/O is the host's
//! (`wasmcsi_block::qos`), tested there and end to end in the CLI's tests.
#![allow(clippy::unwrap_used, reason = "tests")]
use super::*;
use wasmcsi_backend_sdk::fake::FakeHost;
use wasmcsi_backend_sdk::types::pairs;

fn request(name: &str, mutable: &[(&str, &str)]) -> CreateVolumeRequest {
    let mount = AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] });
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 },
        capabilities: vec![VolumeCapability { access_type: mount, access_mode: AccessMode::SingleNodeWriter }],
        parameters: pairs([("numberOfReplicas", "2")]),
        secrets: vec![],
        content_source: None,
        accessibility: None,
        mutable_parameters: pairs(mutable.iter().copied()),
    }
}

fn host() -> FakeHost {
    let h = FakeHost::new();
    h.block.add_node("a", 10 << 30, &[]).add_node("b", 10 << 30, &[]);
    h
}

#[test]
fn modify_is_declared() {
    assert!(ReplicatedBlock::info().features.contains(&Feature::ModifyVolume));
}

#[test]
fn a_class_at_creation_sets_the_limits_and_a_retry_keeps_them() {
    let h = host();
    let v =
        ReplicatedBlock::create_volume(&h, request("pvc-1", &[("writeIOPS", "200"), ("readBytesPerSecond", "1Mi")]))
            .unwrap();
    let limits = h.block.replica_set(&v.volume_id).unwrap().set.limits;
    assert_eq!(limits, IoLimits { write_iops: 200, read_bytes_per_second: 1 << 20, ..IoLimits::UNLIMITED });
    ReplicatedBlock::create_volume(&h, request("pvc-1", &[("writeIOPS", "200"), ("readBytesPerSecond", "1Mi")]))
        .unwrap();
    assert_eq!(h.block.replica_set(&v.volume_id).unwrap().set.limits, limits);
}

#[test]
fn an_unknown_key_at_creation_is_invalid_argument_naming_it_and_creates_nothing() {
    let h = host();
    let e = ReplicatedBlock::create_volume(&h, request("pvc-1", &[("writeIOPS", "5"), ("colour", "red")]))
        .expect_err("unknown key");
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("\"colour\"")), "{e:?}");
    assert_eq!(h.block.journal.calls("create"), 0);
    assert!(h.block.replica_set(&policy::volume_id("pvc-1")).is_none());
}

#[test]
fn modify_changes_only_the_keys_given_and_is_idempotent() {
    let h = host();
    let v = ReplicatedBlock::create_volume(&h, request("pvc-1", &[("readIOPS", "50")])).unwrap();
    let id = v.volume_id;
    let modify =
        |kv: &[(&str, &str)]| ReplicatedBlock::modify_volume(&h, id.clone(), pairs(kv.iter().copied()), vec![]);
    modify(&[("writeIOPS", "100"), ("writeBytesPerSecond", "10Mi")]).unwrap();
    modify(&[("writeIOPS", "100"), ("writeBytesPerSecond", "10Mi")]).unwrap();
    let limits = h.block.replica_set(&id).unwrap().set.limits;
    assert_eq!(
        limits,
        IoLimits { read_iops: 50, write_iops: 100, read_bytes_per_second: 0, write_bytes_per_second: 10 << 20 }
    );
    modify(&[("writeIOPS", "0")]).unwrap();
    assert_eq!(h.block.replica_set(&id).unwrap().set.limits.write_iops, 0, "0 lifts");
}

#[test]
fn modify_refuses_an_unknown_or_immutable_key_before_changing_anything() {
    let h = host();
    let id = ReplicatedBlock::create_volume(&h, request("pvc-1", &[])).unwrap().volume_id;
    let before = h.block.journal.calls("set_limits");
    for (key, value) in
        [("colour", "red"), ("replicaSpreadKey", "zone"), ("numberOfReplicas", "0"), ("writeIOPS", "fast")]
    {
        let e = ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("readIOPS", "9"), (key, value)]), vec![])
            .expect_err(key);
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains(key)), "{key}: {e:?}");
    }
    assert_eq!(h.block.journal.calls("set_limits"), before, "nothing was set");
    assert_eq!(h.block.replica_set(&id).unwrap().set.limits, IoLimits::UNLIMITED);
    let e = ReplicatedBlock::modify_volume(&h, "rb-nope".into(), pairs([("readIOPS", "1")]), vec![]).expect_err("none");
    assert!(matches!(e, Error::NotFound(_)), "{e:?}");
}

/// Nodes in two zones, two each.
fn zoned() -> FakeHost {
    let h = FakeHost::new();
    h.block
        .add_node("a", 10 << 30, &[("zone", "x")])
        .add_node("b", 10 << 30, &[("zone", "x")])
        .add_node("c", 10 << 30, &[("zone", "y")])
        .add_node("d", 10 << 30, &[("zone", "y")]);
    h
}

fn nodes_of(h: &FakeHost, id: &str) -> Vec<String> {
    let mut nodes: Vec<String> = h.block.replica_set(id).unwrap().set.replicas.iter().map(|r| r.node.clone()).collect();
    nodes.sort();
    nodes
}

fn meta(h: &FakeHost, id: &str, key: &str) -> Option<String> {
    h.block.replica_set(id).unwrap().set.metadata.iter().find(|p| p.key == key).map(|p| p.value.clone())
}

fn in_zone(name: &str, zone: &str) -> CreateVolumeRequest {
    let mut r = request(name, &[]);
    r.parameters.extend(pairs([("replicaNodeSelector", format!("zone={zone}").as_str())]));
    r
}

const NOW: Timestamp = Timestamp { seconds: 1_900_000_000, nanos: 0 };

#[test]
fn a_new_selector_moves_the_replicas_one_at_a_time_while_the_set_is_whole() {
    let h = zoned();
    let id = ReplicatedBlock::create_volume(&h, in_zone("pvc-1", "x")).unwrap().volume_id;
    assert_eq!(nodes_of(&h, &id), ["a", "b"]);
    ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("replicaNodeSelector", "zone=y")]), vec![]).unwrap();
    assert_eq!(meta(&h, &id, policy::META_SELECTOR).as_deref(), Some("zone=y"));
    assert_eq!(h.block.journal.calls("replace"), 0, "the modify itself moves nothing");

    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("replace"), 1, "one replica per round");
    let moved = nodes_of(&h, &id);
    let new = moved.iter().find(|n| *n == "c" || *n == "d").expect("one in zone y").clone();
    // The new replica is being filled: the next one waits.
    h.block.set_state(&id, &new, ReplicaState::Rebuilding, None);
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("replace"), 1, "no second move while one rebuilds");
    h.block.set_state(&id, &new, ReplicaState::Healthy, None);
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(nodes_of(&h, &id), ["c", "d"]);
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("replace"), 2, "nothing left to move");
}

#[test]
fn a_selector_no_nodes_satisfy_is_refused_naming_it_with_nothing_changed() {
    let h = zoned();
    let id = ReplicatedBlock::create_volume(&h, in_zone("pvc-1", "x")).unwrap().volume_id;
    let before = h.block.replica_set(&id).unwrap();
    for selector in ["zone=z", "zone=y,disk=ssd"] {
        let e = ReplicatedBlock::modify_volume(
            &h,
            id.clone(),
            pairs([("readIOPS", "9"), ("replicaNodeSelector", selector)]),
            vec![],
        )
        .expect_err(selector);
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("replicaNodeSelector")), "{selector}: {e:?}");
    }
    let e = ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("replicaNodeSelector", "zone=x,=x")]), vec![]);
    assert!(matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("replicaNodeSelector")), "not a label: {e:?}");
    assert_eq!(h.block.replica_set(&id).unwrap(), before, "neither limits nor metadata changed");
    assert_eq!(h.block.journal.calls("set_limits"), 0);
    // An empty selector: any node; nothing to move.
    ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("replicaNodeSelector", "")]), vec![]).unwrap();
    assert_eq!(meta(&h, &id, policy::META_SELECTOR), None);
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("replace"), 0);
}

#[test]
fn a_new_stale_timeout_decides_when_a_lost_replica_is_replaced() {
    let h = zoned();
    let id = ReplicatedBlock::create_volume(&h, request("pvc-1", &[])).unwrap().volume_id;
    let lost = nodes_of(&h, &id)[0].clone();
    let since = Timestamp { seconds: NOW.seconds - 100, nanos: 0 };
    h.block.set_state(&id, &lost, ReplicaState::Unreachable, Some(since));
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("replace"), 0, "100 s is within the class's timeout");
    ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("staleReplicaTimeout", "90s")]), vec![]).unwrap();
    assert_eq!(meta(&h, &id, policy::META_STALE).as_deref(), Some("90"));
    assert_eq!(meta(&h, &id, policy::META_NAME).as_deref(), Some("pvc-1"), "other keys kept");
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("replace"), 1, "past the new timeout: replaced");
    assert!(!nodes_of(&h, &id).contains(&lost));
    let e = ReplicatedBlock::modify_volume(&h, id, pairs([("staleReplicaTimeout", "soon")]), vec![]).expect_err("bad");
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("staleReplicaTimeout")), "{e:?}");
}

#[test]
fn a_class_selector_at_creation_places_the_replicas() {
    let h = zoned();
    let mut r = in_zone("pvc-1", "x");
    r.mutable_parameters = pairs([("replicaNodeSelector", "zone=y")]);
    let id = ReplicatedBlock::create_volume(&h, r).unwrap().volume_id;
    assert_eq!(nodes_of(&h, &id), ["c", "d"], "the VolumeAttributesClass wins over the StorageClass");
    assert_eq!(meta(&h, &id, policy::META_SELECTOR).as_deref(), Some("zone=y"));
}

#[test]
fn a_new_replica_count_adds_or_removes_one_replica_at_a_time_while_the_set_is_whole() {
    let h = zoned();
    let id = ReplicatedBlock::create_volume(&h, request("pvc-1", &[])).unwrap().volume_id;
    let two = nodes_of(&h, &id);
    assert_eq!(two.len(), 2);
    ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("numberOfReplicas", "4")]), vec![]).unwrap();
    assert_eq!(meta(&h, &id, policy::META_REPLICAS).as_deref(), Some("4"));
    assert_eq!(h.block.journal.calls("add_replica"), 1, "the modify takes the first step");
    let three = nodes_of(&h, &id);
    let new = three.iter().find(|n| !two.contains(n)).expect("a replica on a new node").clone();
    // The new replica is being rebuilt: the next one waits.
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("add_replica"), 1, "no second replica while one rebuilds");
    let status = ReplicatedBlock::get_volume(&h, id.clone()).unwrap();
    assert!(status.condition.as_ref().is_some_and(|c| c.abnormal && c.message.contains("2/4")), "{status:?}");
    h.block.set_state(&id, &new, ReplicaState::Healthy, None);
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("add_replica"), 2);
    assert_eq!(nodes_of(&h, &id), ["a", "b", "c", "d"], "distinct nodes while there are any");
    for n in ["a", "b", "c", "d"] {
        h.block.set_state(&id, n, ReplicaState::Healthy, None);
    }
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("add_replica"), 2, "four: nothing more");

    // Down to two: one per round, and only while every replica is healthy.
    ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("numberOfReplicas", "2")]), vec![]).unwrap();
    assert_eq!(nodes_of(&h, &id).len(), 3, "the modify removes the first");
    let left = nodes_of(&h, &id);
    h.block.set_state(&id, &left[0], ReplicaState::Stale, None);
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(nodes_of(&h, &id).len(), 3, "no removal while a replica is behind");
    h.block.set_state(&id, &left[0], ReplicaState::Healthy, None);
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(nodes_of(&h, &id).len(), 2);
    ReplicatedBlock::reconcile_volume(&h, id.clone(), NOW).unwrap();
    assert_eq!(h.block.journal.calls("remove_replica"), 2, "two: nothing more");
    let status = ReplicatedBlock::get_volume(&h, id).unwrap();
    assert!(status.condition.is_some_and(|c| !c.abnormal), "two of two healthy");
}

#[test]
fn more_replicas_than_the_nodes_can_place_are_refused_naming_the_key_with_nothing_changed() {
    let h = host();
    let id = ReplicatedBlock::create_volume(&h, request("pvc-1", &[])).unwrap().volume_id;
    let before = h.block.replica_set(&id).unwrap();
    let e = ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("numberOfReplicas", "3")]), vec![])
        .expect_err("two nodes");
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("numberOfReplicas")), "{e:?}");
    assert_eq!(h.block.replica_set(&id).unwrap(), before);
}

#[test]
fn the_replica_removed_is_one_off_the_selector_before_one_on_the_attached_node() {
    let slot = |n: &str| policy::Slot::new(n, None);
    let view = |n: &str| policy::ReplicaView {
        slot: slot(n),
        state: policy::ReplicaHealth::Healthy,
        down_since: None,
        rebuilt: 0,
        rebuild_total: 0,
    };
    let nodes = candidates(&zoned().block().list_nodes().unwrap());
    let mut p = policy::Policy { replicas: 2, ..policy::Policy::default() };
    let set = [view("a"), view("c"), view("d")];
    let next = |p: &policy::Policy, attached| policy::next_count_change(&set, &nodes, p, 1 << 20, attached).unwrap();
    assert_eq!(next(&p, Some("d")), Some(policy::CountChange::Shrink(slot("c"))), "not the attached node's own");
    assert_eq!(next(&p, None), Some(policy::CountChange::Shrink(slot("d"))), "the set's last");
    p.selector = vec![("zone".into(), Some("y".into()))];
    assert_eq!(next(&p, Some("d")), Some(policy::CountChange::Shrink(slot("a"))), "off the selector first");
}
