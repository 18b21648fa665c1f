//! The driver against the SDK's in-memory `rbd`: deterministic names, idempotent creates,
//! snapshots, restores and clones (and their temporary snapshots), deferred deletion while
//! snapshots exist, flattening before data could be lost, and the errors on the way.
//! (Against a real Ceph: `host/runtime/tests/all/rbd_backend.rs` and `host/cli/tests/all/rbd_flow.rs`.)
#![allow(clippy::unwrap_used, reason = "tests")]
use super::*;
use wasmcsi_backend_sdk::fake::FakeHost;
use wasmcsi_backend_sdk::types::pairs;

fn host() -> (FakeHost, Target) {
    let h = FakeHost::new();
    let t = h.rbd.add_pool("ceph", "rbd");
    (h, t)
}

fn creds() -> Vec<SecretRef> {
    vec![SecretRef { key: "userID".into(), handle: 0 }, SecretRef { key: "userKey".into(), handle: 1 }]
}

fn mount(mode: AccessMode) -> VolumeCapability {
    VolumeCapability { access_type: AccessType::Mount(MountVolume { fs_type: "ext4".into(), mount_flags: vec![] }), access_mode: mode }
}

fn block(mode: AccessMode) -> VolumeCapability {
    VolumeCapability { access_type: AccessType::Block, access_mode: mode }
}

fn request(name: &str, required: u64, extra: &[(&str, &str)], source: Option<ContentSource>) -> CreateVolumeRequest {
    let mut params = vec![("clusterID", "ceph"), ("pool", "rbd")];
    params.extend_from_slice(extra);
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes: required, limit_bytes: 0 },
        capabilities: vec![mount(AccessMode::SingleNodeWriter)],
        parameters: pairs(params),
        secrets: creds(),
        content_source: source,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

fn image(name: &str) -> String {
    policy::image_name(policy::DEFAULT_PREFIX, name)
}

fn id(name: &str) -> String {
    format!("ceph.rbd.{}", image(name))
}

fn create(h: &FakeHost, req: CreateVolumeRequest) -> Result<Volume, Error> {
    CephRbd::create_volume(h, req)
}

fn snapshot(h: &FakeHost, name: &str, source: &str) -> Result<Snapshot, Error> {
    CephRbd::create_snapshot(h, name.into(), source.into(), pairs([("clusterID", "ceph")]), creds())
}

#[test]
fn create_names_the_image_after_the_request_and_a_retry_finds_it() {
    let (h, t) = host();
    let v = create(&h, request("pvc-1", 5 << 20, &[], None)).unwrap();
    assert_eq!((v.volume_id.clone(), v.capacity_bytes), (id("pvc-1"), 5 << 20));
    assert!(v.volume_context.contains(&Pair { key: "imageName".into(), value: image("pvc-1") }));
    let img = h.rbd.image(&t, &image("pvc-1")).unwrap();
    assert_eq!(img.metadata.get(policy::META_NAME).map(String::as_str), Some("pvc-1"));
    assert_eq!(img.metadata.get(policy::META_OWNER).map(String::as_str), Some(policy::OWNER));
    assert_eq!(img.features, ["layering"]);
    assert_eq!(h.kv.entries().keys().collect::<Vec<_>>(), ["pools/ceph.rbd"]);

    assert_eq!(create(&h, request("pvc-1", 5 << 20, &[], None)).unwrap(), v, "a retry");
    assert_eq!(h.rbd.journal.calls("create"), 1, "the retry created nothing");
    assert_eq!(create(&h, request("pvc-1", 1, &[], None)).unwrap().capacity_bytes, 5 << 20, "a smaller request fits the volume");
    assert!(matches!(create(&h, request("pvc-1", 6 << 20, &[], None)), Err(Error::AlreadyExists(_))));
    assert_eq!(create(&h, request("pvc-2", (1 << 20) + 1, &[], None)).unwrap().capacity_bytes, 2 << 20, "whole MiB");

    // an image of that name recording another request is never taken over
    h.rbd.create(&t.pool(&[]), &image("pvc-3"), 1 << 20, &[], None, &[(policy::META_NAME.into(), "other".into())]).unwrap();
    assert!(matches!(create(&h, request("pvc-3", 1 << 20, &[], None)), Err(Error::AlreadyExists(_))));
}

#[test]
fn requests_are_checked_before_the_cluster_is_touched() {
    let (h, t) = host();
    let mut anonymous = request("pvc-1", 1, &[], None);
    anonymous.secrets = vec![];
    assert!(matches!(create(&h, anonymous), Err(Error::InvalidArgument(m)) if m.contains("userID")));
    let mut half = request("pvc-1", 1, &[], None);
    half.secrets.truncate(1);
    assert!(matches!(create(&h, half), Err(Error::InvalidArgument(m)) if m.contains("userKey")));
    assert!(matches!(create(&h, request("pvc-1", 1, &[("imageFeatures", "object-map")], None)), Err(Error::InvalidArgument(_))));
    let mut shared_fs = request("pvc-1", 1, &[], None);
    shared_fs.capabilities = vec![mount(AccessMode::MultiNodeMultiWriter)];
    assert!(matches!(create(&h, shared_fs), Err(Error::InvalidArgument(_))));
    let mut over = request("pvc-1", 3 << 20, &[], None);
    over.capacity.limit_bytes = 2 << 20;
    assert!(matches!(create(&h, over), Err(Error::OutOfRange(_))));
    assert!(h.rbd.images(&t).is_empty() && h.rbd.journal.calls("info") == 0);
    // a shared raw block device is fine
    let mut shared_block = request("pvc-1", 1, &[], None);
    shared_block.capabilities = vec![block(AccessMode::MultiNodeMultiWriter)];
    create(&h, shared_block).unwrap();
    // the cluster's own errors surface with their case
    h.rbd.fail_next("create", Error::Unavailable("monitors unreachable".into()));
    assert!(matches!(create(&h, request("pvc-2", 1, &[], None)), Err(Error::Unavailable(_))));
    assert!(matches!(create(&h, request("pvc-3", 1, &[("pool", "other")], None)), Err(Error::PermissionDenied(_))));
}

#[test]
fn snapshots_are_rbd_snapshots_of_the_source_and_names_stay_with_their_source() {
    let (h, t) = host();
    let v = create(&h, request("pvc-1", 4 << 20, &[], None)).unwrap();
    let other = create(&h, request("pvc-2", 4 << 20, &[], None)).unwrap();
    let s = snapshot(&h, "snap-1", &v.volume_id).unwrap();
    let hash = policy::name_hash("snap-1");
    assert_eq!((s.snapshot_id.clone(), s.source_volume_id.clone(), s.size_bytes), (format!("{}.{hash}", v.volume_id), v.volume_id.clone(), 4 << 20));
    let snaps = h.rbd.image(&t, &image("pvc-1")).unwrap().snapshots;
    assert_eq!(snaps.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(), [format!("csi-snap-{hash}")]);
    assert_eq!(snapshot(&h, "snap-1", &v.volume_id).unwrap(), s, "a retry");
    assert!(matches!(snapshot(&h, "snap-1", &other.volume_id), Err(Error::AlreadyExists(_))), "same name, other source");
    let bad_params = CephRbd::create_snapshot(&h, "snap-2".into(), v.volume_id.clone(), pairs([("clusterID", "elsewhere")]), creds());
    assert!(matches!(bad_params, Err(Error::InvalidArgument(_))));
    assert!(matches!(snapshot(&h, "snap-2", "ceph.rbd.csi-vol-0000000000000000"), Err(Error::NotFound(_))));

    let by_volume = CephRbd::list_snapshots(&h, None, Some(v.volume_id.clone()), 0, String::new()).unwrap();
    assert_eq!(by_volume.entries, std::slice::from_ref(&s));
    let by_id = CephRbd::list_snapshots(&h, Some(s.snapshot_id.clone()), None, 0, String::new()).unwrap();
    assert_eq!(by_id.entries, std::slice::from_ref(&s));
    assert_eq!(CephRbd::list_snapshots(&h, None, None, 0, String::new()).unwrap().entries, std::slice::from_ref(&s));
    CephRbd::delete_snapshot(&h, s.snapshot_id.clone(), creds()).unwrap();
    CephRbd::delete_snapshot(&h, s.snapshot_id, creds()).unwrap();
    assert!(h.rbd.image(&t, &image("pvc-1")).unwrap().snapshots.is_empty());
    snapshot(&h, "snap-1", &other.volume_id).unwrap();
}

#[test]
fn restores_and_clones_hang_off_snapshots_until_the_depth_limit_flattens_them() {
    let (h, t) = host();
    let v = create(&h, request("pvc-1", 4 << 20, &[], None)).unwrap();
    let s = snapshot(&h, "snap-1", &v.volume_id).unwrap();
    let restored = create(&h, request("pvc-2", 0, &[], Some(ContentSource::Snapshot(s.snapshot_id.clone())))).unwrap();
    assert_eq!(restored.capacity_bytes, 4 << 20, "the snapshot's size");
    let img = h.rbd.image(&t, &image("pvc-2")).unwrap();
    let parent = (String::from("rbd"), image("pvc-1"), format!("csi-snap-{}", policy::name_hash("snap-1")));
    assert_eq!(img.parent, Some(parent));
    assert!(h.rbd.image(&t, &image("pvc-1")).unwrap().snapshots[0].protected);
    let again = create(&h, request("pvc-2", 0, &[], Some(ContentSource::Snapshot(s.snapshot_id.clone())))).unwrap();
    assert_eq!(again.volume_id, restored.volume_id, "a retry");
    let small = request("pvc-3", 1 << 20, &[], Some(ContentSource::Snapshot(s.snapshot_id.clone())));
    assert!(matches!(create(&h, small), Err(Error::OutOfRange(_))));
    let bigger = create(&h, request("pvc-4", 8 << 20, &[], Some(ContentSource::Snapshot(s.snapshot_id.clone())))).unwrap();
    assert_eq!((bigger.capacity_bytes, h.rbd.image(&t, &image("pvc-4")).unwrap().size_bytes), (8 << 20, 8 << 20), "grown after the clone");

    // a clone of a volume hangs off a temporary snapshot named after the new volume
    let tmp = policy::temp_snap_name("pvc-5");
    create(&h, request("pvc-5", 0, &[], Some(ContentSource::Volume(v.volume_id.clone())))).unwrap();
    assert_eq!(h.rbd.image(&t, &image("pvc-5")).unwrap().parent.map(|p| p.2), Some(tmp.clone()));
    // with maxCloneDepth 0 every clone is a full copy, and the temporary snapshot goes
    let flat = request("pvc-6", 0, &[("maxCloneDepth", "0")], Some(ContentSource::Volume(v.volume_id.clone())));
    create(&h, flat).unwrap();
    assert_eq!(h.rbd.image(&t, &image("pvc-6")).unwrap().parent, None);
    let names = |i: &str| h.rbd.image(&t, &image(i)).unwrap().snapshots.into_iter().map(|x| x.name).collect::<Vec<_>>();
    assert!(!names("pvc-1").contains(&policy::temp_snap_name("pvc-6")));
    assert!(names("pvc-1").contains(&tmp));
    // deleting the clone releases its temporary snapshot
    CephRbd::delete_volume(&h, id("pvc-5"), creds()).unwrap();
    assert!(!names("pvc-1").contains(&tmp));
    assert!(h.rbd.image(&t, &image("pvc-5")).is_none());

    let missing = request("pvc-7", 0, &[], Some(ContentSource::Snapshot(format!("{}.{}", v.volume_id, policy::name_hash("nope")))));
    assert!(matches!(create(&h, missing), Err(Error::NotFound(_))));
    h.rbd.add_pool("other-cluster", "rbd");
    let foreign = request("pvc-7", 0, &[], Some(ContentSource::Volume(format!("other-cluster.rbd.{}", image("x")))));
    assert!(matches!(create(&h, foreign), Err(Error::InvalidArgument(_))));
}

#[test]
fn a_volume_with_snapshots_is_deleted_for_csi_and_goes_with_its_last_snapshot() {
    let (h, t) = host();
    let v = create(&h, request("pvc-1", 4 << 20, &[], None)).unwrap();
    let s = snapshot(&h, "snap-1", &v.volume_id).unwrap();
    CephRbd::delete_volume(&h, v.volume_id.clone(), creds()).unwrap();
    CephRbd::delete_volume(&h, v.volume_id.clone(), creds()).unwrap();
    assert!(h.rbd.image(&t, &image("pvc-1")).is_some(), "kept for its snapshot");
    assert!(matches!(CephRbd::get_volume(&h, v.volume_id.clone()), Err(Error::NotFound(_))));
    assert!(CephRbd::list_volumes(&h, 0, String::new()).unwrap().entries.is_empty());
    assert!(matches!(create(&h, request("pvc-1", 4 << 20, &[], None)), Err(Error::Aborted(_))), "the name is still being deleted");
    // a restore of the snapshot keeps its data when the snapshot goes: flattened first
    create(&h, request("pvc-2", 0, &[], Some(ContentSource::Snapshot(s.snapshot_id.clone())))).unwrap();
    CephRbd::delete_snapshot(&h, s.snapshot_id, creds()).unwrap();
    assert_eq!(h.rbd.image(&t, &image("pvc-2")).unwrap().parent, None);
    assert!(h.rbd.image(&t, &image("pvc-1")).is_none(), "the deferred deletion finished");
    assert!(h.log.messages().contains(&"clone flattened before its parent snapshot goes".to_owned()));
}

#[test]
fn snapshots_this_backend_did_not_make_keep_an_image() {
    let (h, t) = host();
    let v = create(&h, request("pvc-1", 1 << 20, &[], None)).unwrap();
    h.rbd.snapshot_create(&t.pool(&[]), &image("pvc-1"), "by-hand").unwrap();
    assert!(matches!(CephRbd::delete_volume(&h, v.volume_id, creds()), Err(Error::FailedPrecondition(_))));
    assert!(h.rbd.image(&t, &image("pvc-1")).is_some());
    CephRbd::delete_volume(&h, "not.an.id.at-all".into(), creds()).unwrap();
}

#[test]
fn expand_list_validate_and_attach() {
    let (h, t) = host();
    let v = create(&h, request("pvc-1", 4 << 20, &[], None)).unwrap();
    create(&h, request("pvc-2", 4 << 20, &[], None)).unwrap();
    let grow = |required, limit, cap: Option<VolumeCapability>| {
        CephRbd::expand_volume(&h, v.volume_id.clone(), CapacityRange { required_bytes: required, limit_bytes: limit }, cap, creds())
    };
    assert_eq!(
        grow(6 << 20, 0, Some(mount(AccessMode::SingleNodeWriter))).unwrap(),
        Expansion { capacity_bytes: 6 << 20, node_expansion_required: true }
    );
    assert!(!grow(6 << 20, 0, Some(block(AccessMode::SingleNodeWriter))).unwrap().node_expansion_required, "a raw device is the image");
    assert_eq!(h.rbd.image(&t, &image("pvc-1")).unwrap().size_bytes, 6 << 20);
    assert!(matches!(grow(8 << 20, 7 << 20, None), Err(Error::OutOfRange(_))));
    assert!(matches!(
        CephRbd::expand_volume(&h, id("nope"), CapacityRange { required_bytes: 1, limit_bytes: 0 }, None, creds()),
        Err(Error::NotFound(_))
    ));

    let mut ids = [id("pvc-1"), id("pvc-2")];
    ids.sort();
    let first = CephRbd::list_volumes(&h, 1, String::new()).unwrap();
    assert_eq!((first.entries[0].volume.volume_id.clone(), first.next_token.as_str()), (ids[0].clone(), "1"));
    assert_eq!(CephRbd::list_volumes(&h, 1, first.next_token).unwrap().entries[0].volume.volume_id, ids[1]);

    let validate = |caps: Vec<VolumeCapability>, params: &[(&str, &str)]| {
        CephRbd::validate_volume_capabilities(&h, v.volume_id.clone(), vec![], caps, pairs(params.iter().copied()))
    };
    assert_eq!(validate(vec![mount(AccessMode::SingleNodeWriter)], &[]), Ok(None));
    assert!(validate(vec![mount(AccessMode::MultiNodeMultiWriter)], &[]).unwrap().is_some());
    assert!(validate(vec![mount(AccessMode::SingleNodeWriter)], &[("clusterID", "ceph"), ("pool", "other")]).unwrap().is_some());
    h.rbd.fail_next("info", Error::Unavailable("no credentials seen for this pool yet".into()));
    assert_eq!(validate(vec![block(AccessMode::MultiNodeMultiWriter)], &[]), Ok(None), "the id's form is enough then");
    assert!(matches!(CephRbd::validate_volume_capabilities(&h, id("nope"), vec![], vec![], vec![]), Err(Error::NotFound(_))));

    let plan = CephRbd::attach_plan(&h, v.volume_id.clone(), vec![], mount(AccessMode::SingleNodeWriter), vec![]).unwrap();
    let Attachment::Rbd(plan) = plan else { panic!("not an rbd plan: {plan:?}") };
    assert_eq!((plan.cluster.as_str(), plan.pool.as_str(), plan.image.clone()), ("ceph", "rbd", image("pvc-1")));
    assert_eq!(plan.secrets.iter().map(|s| s.key.as_str()).collect::<Vec<_>>(), ["userID", "userKey"]);
    assert!(matches!(
        CephRbd::attach_plan(&h, v.volume_id.clone(), vec![], mount(AccessMode::MultiNodeMultiWriter), vec![]),
        Err(Error::FailedPrecondition(_))
    ));
    assert!(matches!(CephRbd::attach_plan(&h, "junk".into(), vec![], mount(AccessMode::SingleNodeWriter), vec![]), Err(Error::NotFound(_))));

    h.rbd.set_total_bytes(&t, 100 << 20);
    let cap = CephRbd::get_capacity(&h, vec![], pairs([("clusterID", "ceph"), ("pool", "rbd")]), None).unwrap();
    assert_eq!((cap.available_bytes, cap.minimum_volume_bytes), ((100 - 6 - 4) << 20, policy::SIZE_UNIT));
}

#[test]
fn qos_limits_are_set_at_creation_modified_by_key_and_lifted_with_0() {
    use wasmcsi_backend_sdk::rbd::QOS_KEYS;
    let (h, t) = host();
    let qos = |name: &str| {
        let meta = h.rbd.image(&t, &image(name)).unwrap().metadata;
        QOS_KEYS.iter().map(|k| meta.get(*k).cloned()).collect::<Vec<_>>()
    };
    let mut req = request("pvc-1", 1 << 20, &[], None);
    req.mutable_parameters = pairs([("writeIOPS", "100"), ("readBytesPerSecond", "1Mi")]);
    let v = create(&h, req.clone()).unwrap();
    assert_eq!(qos("pvc-1"), [None, Some("100".into()), Some("1048576".into()), None]);
    assert_eq!(create(&h, req).unwrap(), v, "a retry");
    let plain = create(&h, request("pvc-2", 1 << 20, &[], None)).unwrap();
    assert_eq!(qos("pvc-2"), [None, None, None, None]);
    assert_eq!(h.rbd.journal.calls("set_qos"), 2, "no limits, no call");

    let modify = |id: &str, kv: &[(&str, &str)]| CephRbd::modify_volume(&h, id.into(), pairs(kv.iter().copied()), creds());
    modify(&v.volume_id, &[("readIOPS", "50"), ("writeIOPS", "0")]).unwrap();
    assert_eq!(qos("pvc-1"), [Some("50".into()), None, Some("1048576".into()), None], "a key not given stays");
    modify(&plain.volume_id, &[("writeBytesPerSecond", "20M")]).unwrap();
    assert_eq!(qos("pvc-2"), [None, None, None, Some("20000000".into())]);

    // Refused by name, nothing changed: an unknown key, a StorageClass parameter.
    let calls = h.rbd.journal.calls("set_qos");
    for (key, why) in [("colour", "unknown"), ("pool", "StorageClass"), ("imageFeatures", "StorageClass")] {
        let e = modify(&v.volume_id, &[("readIOPS", "7"), (key, "x")]).unwrap_err();
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains(&format!("{key:?}")) && m.contains(why)), "{e:?}");
    }
    assert!(matches!(modify(&v.volume_id, &[("readIOPS", "many")]), Err(Error::InvalidArgument(m)) if m.contains("readIOPS")));
    assert_eq!(h.rbd.journal.calls("set_qos"), calls);
    assert_eq!(qos("pvc-1"), [Some("50".into()), None, Some("1048576".into()), None]);
    // A missing volume is not-found whatever its keys; no credentials, no change.
    assert!(matches!(modify(&id("nope"), &[("colour", "x")]), Err(Error::NotFound(_))));
    assert!(matches!(modify("junk", &[("readIOPS", "1")]), Err(Error::NotFound(_))));
    let anonymous = CephRbd::modify_volume(&h, v.volume_id.clone(), pairs([("readIOPS", "1")]), vec![]);
    assert!(matches!(anonymous, Err(Error::InvalidArgument(m)) if m.contains("userID")));

    // At creation an unknown key makes nothing.
    let mut bad = request("pvc-3", 1 << 20, &[], None);
    bad.mutable_parameters = pairs([("colour", "red")]);
    assert!(matches!(create(&h, bad), Err(Error::InvalidArgument(m)) if m.contains("colour")));
    assert!(h.rbd.image(&t, &image("pvc-3")).is_none());
}

fn group(h: &FakeHost, name: &str, sources: &[&str]) -> Result<GroupSnapshot, Error> {
    let sources = sources.iter().map(|s| (*s).to_owned()).collect();
    CephRbd::create_group_snapshot(h, name.into(), sources, pairs([("clusterID", "ceph")]), creds())
}

#[test]
fn a_group_snapshot_is_one_rbd_group_snapshot_its_parts_found_again_by_id_restored_by_copy() {
    let (h, t) = host();
    let ids: Vec<String> = ["pvc-a", "pvc-b", "pvc-c"].iter().map(|n| create(&h, request(n, 4 << 20, &[], None)).unwrap().volume_id).collect();
    let sources: Vec<&str> = ids.iter().map(String::as_str).collect();
    let g = group(&h, "vgs-1", &sources).unwrap();
    let hash = policy::group_hash("vgs-1");
    assert_eq!(g.group_snapshot_id, format!("ceph.rbd.group-{hash}"));
    assert!(g.ready_to_use);
    assert_eq!(g.snapshots.iter().map(|s| s.source_volume_id.as_str()).collect::<Vec<_>>(), sources, "in the order asked");
    assert_eq!(g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect::<Vec<_>>(), ids.iter().map(|v| format!("{v}.{hash}")).collect::<Vec<_>>());
    for n in ["pvc-a", "pvc-b", "pvc-c"] {
        let snaps = h.rbd.image(&t, &image(n)).unwrap().snapshots;
        assert_eq!(snaps.iter().map(|s| s.name.clone()).collect::<Vec<_>>(), [format!("csi-group-{hash}@csi-snap-{hash}")]);
    }
    assert_eq!(h.rbd.journal.calls("group_snapshot"), 1);
    assert_eq!(group(&h, "vgs-1", &sources).unwrap(), g, "a retry: the same group");
    let member_ids: Vec<String> = g.snapshots.iter().map(|s| s.snapshot_id.clone()).collect();
    let get = |list: &[String]| CephRbd::get_group_snapshot(&h, g.group_snapshot_id.clone(), list.to_vec(), creds());
    let mut got = get(&member_ids).unwrap();
    got.snapshots.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
    let mut want = g.clone();
    want.snapshots.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
    assert_eq!(got, want);
    assert!(matches!(get(&member_ids[..1]), Err(Error::FailedPrecondition(_))), "a list that is not the group's");
    assert!(matches!(CephRbd::get_group_snapshot(&h, "ceph.rbd.group-0000000000000000".into(), vec![], creds()), Err(Error::NotFound(_))));

    // The same name with other sources; a VolumeSnapshot of the same name is apart.
    let e = group(&h, "vgs-1", &sources[..2]).unwrap_err();
    assert!(matches!(&e, Error::AlreadyExists(m) if m.contains("vgs-1")), "{e:?}");
    snapshot(&h, "vgs-1", &ids[0]).unwrap();

    // A volume restores from a member by copy: UNAVAILABLE with the progress until the host's
    // copy is done, then the volume; the copy records its source. ListSnapshots shows members.
    let from = Some(ContentSource::Snapshot(member_ids[1].clone()));
    let e = create(&h, request("pvc-r", 0, &[], from.clone())).unwrap_err();
    assert!(matches!(&e, Error::Unavailable(m) if m.contains("copied; retry")), "{e:?}");
    let restored = create(&h, request("pvc-r", 0, &[], from.clone())).unwrap();
    assert_eq!(restored.capacity_bytes, 4 << 20);
    let copy = h.rbd.image(&t, &image("pvc-r")).unwrap();
    assert_eq!((copy.parent, copy.metadata.get(policy::META_NAME).map(String::as_str)), (None, Some("pvc-r")));
    assert!(copy.metadata.get(policy::META_COPY_OF).is_some_and(|v| v.ends_with(&format!("csi-group-{hash}@csi-snap-{hash}"))));
    assert_eq!(create(&h, request("pvc-r", 0, &[], from)).unwrap(), restored, "a retry");
    let other = Some(ContentSource::Snapshot(member_ids[0].clone()));
    assert!(matches!(create(&h, request("pvc-r", 0, &[], other)), Err(Error::AlreadyExists(_))), "same name, other source");
    assert_eq!(h.rbd.journal.calls("clone_image"), 0, "never cloned");
    let listed = CephRbd::list_snapshots(&h, Some(member_ids[2].clone()), None, 0, String::new()).unwrap();
    assert_eq!(listed.entries.len(), 1);

    // A deleted source keeps its image for the member; deleting the group removes every member
    // and the RBD group, and finishes the deferred deletion.
    CephRbd::delete_volume(&h, ids[2].clone(), creds()).unwrap();
    assert!(h.rbd.image(&t, &image("pvc-c")).is_some());
    assert!(matches!(
        CephRbd::delete_group_snapshot(&h, g.group_snapshot_id.clone(), member_ids[..2].to_vec(), creds()),
        Err(Error::FailedPrecondition(_))
    ));
    CephRbd::delete_group_snapshot(&h, g.group_snapshot_id.clone(), member_ids.clone(), creds()).unwrap();
    CephRbd::delete_group_snapshot(&h, g.group_snapshot_id.clone(), member_ids.clone(), creds()).expect("absent: done");
    assert!(h.rbd.image(&t, &image("pvc-c")).is_none(), "the deferred deletion finished");
    assert_eq!(h.rbd.image(&t, &image("pvc-b")).unwrap().snapshots, vec![]);
    assert_eq!(h.rbd.image(&t, &image("pvc-a")).unwrap().snapshots.len(), 1, "the VolumeSnapshot stays");
    assert!(matches!(CephRbd::get_group_snapshot(&h, g.group_snapshot_id.clone(), vec![], creds()), Err(Error::NotFound(_))));
    CephRbd::delete_group_snapshot(&h, "not-a-group".into(), vec![], creds()).expect("not ours: nothing to delete");
    // the name is free again
    group(&h, "vgs-1", &sources[..2]).unwrap();
}

#[test]
fn a_group_snapshot_is_refused_before_anything_is_taken() {
    let (h, _) = host();
    h.rbd.add_pool("ceph", "other");
    let ids: Vec<String> = [("pvc-a", &[][..]), ("pvc-b", &[]), ("pvc-o", &[("pool", "other")]), ("pvc-p", &[("imageFeatures", "layering")])]
        .iter()
        .map(|(n, extra)| create(&h, request(n, 1 << 20, extra, None)).unwrap().volume_id)
        .collect();
    let [a, b, elsewhere, plain] = [ids[0].as_str(), ids[1].as_str(), ids[2].as_str(), ids[3].as_str()];
    let missing = id("missing");
    let e = group(&h, "g", &[a, elsewhere]).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains(elsewhere) && m.contains(a)), "{e:?}");
    let e = group(&h, "g", &[a, "other-cluster.rbd.csi-vol-0000000000000000"]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
    assert!(matches!(group(&h, "g", &[]), Err(Error::InvalidArgument(_))));
    assert!(matches!(group(&h, "g", &[a, a]), Err(Error::InvalidArgument(_))));
    assert!(matches!(group(&h, "", &[a]), Err(Error::InvalidArgument(_))));
    assert!(matches!(group(&h, "g", &[a, missing.as_str()]), Err(Error::NotFound(_))));
    assert!(matches!(group(&h, "g", &[a, "junk"]), Err(Error::NotFound(_))));
    let bad = CephRbd::create_group_snapshot(&h, "g".into(), vec![a.into()], pairs([("colour", "red")]), creds());
    assert!(matches!(bad, Err(Error::InvalidArgument(_))));
    let anonymous = CephRbd::create_group_snapshot(&h, "g".into(), vec![a.into()], vec![], vec![]);
    assert!(matches!(anonymous, Err(Error::InvalidArgument(m)) if m.contains("userID")));
    assert_eq!(h.rbd.journal.calls("group_snapshot"), 0, "nothing reached the host");
    // Any image can be in a group snapshot (no feature needed), in any number of them.
    group(&h, "g", &[b, a, plain]).unwrap();
    group(&h, "g2", &[a, plain]).unwrap();
    // A member goes on its own too; the group then has the others.
    let g2 = policy::group_hash("g2");
    CephRbd::delete_snapshot(&h, format!("{a}.{g2}"), creds()).unwrap();
    let left = CephRbd::get_group_snapshot(&h, format!("ceph.rbd.group-{g2}"), vec![], creds()).unwrap();
    assert_eq!(left.snapshots.iter().map(|s| s.source_volume_id.as_str()).collect::<Vec<_>>(), [plain]);
}

/// A restore by copy the CO gave up on (its claim deleted while the copy ran: it never got the
/// id) is found by the reconcile rounds once no CreateVolume asked for it for
/// `ABANDONED_RESTORE_SECS`, and deleted by the next call in its pool that carries credentials.
/// One the CO was answered for, or comes back for, is left alone.
#[test]
fn an_abandoned_restore_by_copy_is_deleted_and_an_answered_one_kept() {
    let (h, t) = host();
    let src = create(&h, request("pvc-src", 4 << 20, &[], None)).unwrap().volume_id;
    let g = group(&h, "vgs", &[src.as_str()]).unwrap();
    let from = || Some(ContentSource::Snapshot(g.snapshots[0].snapshot_id.clone()));
    let at = |seconds| Timestamp { seconds, nanos: 0 };
    let reconcile = |id: &str, now| CephRbd::reconcile_volume(&h, id.into(), at(now));

    // Answered: its record goes with the answer; the rounds leave it alone.
    assert!(matches!(create(&h, request("pvc-kept", 0, &[], from())), Err(Error::Unavailable(_))));
    let kept = create(&h, request("pvc-kept", 0, &[], from())).unwrap().volume_id;
    for now in [1_000, 2_000, 3_000] {
        reconcile(&kept, now).unwrap();
    }
    assert!(h.kv.entries().keys().all(|k| !k.starts_with("restores/")), "{:?}", h.kv.entries());

    // Abandoned after its first attempt.
    assert!(matches!(create(&h, request("pvc-gone", 0, &[], from())), Err(Error::Unavailable(_))));
    let gone = id("pvc-gone");
    assert!(h.rbd.image(&t, &image("pvc-gone")).is_some(), "the copy's image exists");
    reconcile(&gone, 1_000).unwrap();
    reconcile(&gone, 1_000 + policy::ABANDONED_RESTORE_SECS - 1).unwrap();
    create(&h, request("pvc-other", 1 << 20, &[], None)).unwrap();
    assert!(h.rbd.image(&t, &image("pvc-gone")).is_some(), "not abandoned yet");
    // A CreateVolume attempt in between starts the clock again.
    let back = create(&h, request("pvc-gone", 0, &[], from())).unwrap();
    reconcile(&gone, 5_000).unwrap();
    reconcile(&gone, 5_000 + policy::ABANDONED_RESTORE_SECS).unwrap();
    assert!(h.kv.entries().keys().all(|k| !k.starts_with("restores/")), "answered: no record");
    CephRbd::delete_volume(&h, back.volume_id, creds()).unwrap();

    assert!(matches!(create(&h, request("pvc-gone2", 0, &[], from())), Err(Error::Unavailable(_))));
    let gone2 = id("pvc-gone2");
    reconcile(&gone2, 1_000).unwrap();
    reconcile(&gone2, 1_000 + policy::ABANDONED_RESTORE_SECS).unwrap();
    assert!(h.rbd.image(&t, &image("pvc-gone2")).is_some(), "a round has no credentials to delete it");
    CephRbd::delete_volume(&h, id("pvc-nothing"), creds()).unwrap();
    assert!(h.rbd.image(&t, &image("pvc-gone2")).is_none(), "the next call in the pool deleted it");
    assert!(h.kv.entries().keys().all(|k| !k.starts_with("restores/")));
    assert!(matches!(reconcile("junk", 1), Err(Error::NotFound(_))));
}
