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
    for (key, value) in [("colour", "red"), ("numberOfReplicas", "3"), ("writeIOPS", "fast")] {
        let e = ReplicatedBlock::modify_volume(&h, id.clone(), pairs([("readIOPS", "9"), (key, value)]), vec![])
            .expect_err(key);
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains(&format!("{key:?}"))), "{key}: {e:?}");
    }
    assert_eq!(h.block.journal.calls("set_limits"), before, "nothing was set");
    assert_eq!(h.block.replica_set(&id).unwrap().set.limits, IoLimits::UNLIMITED);
    let e = ReplicatedBlock::modify_volume(&h, "rb-nope".into(), pairs([("readIOPS", "1")]), vec![]).expect_err("none");
    assert!(matches!(e, Error::NotFound(_)), "{e:?}");
}
