//! The policy against the SDK's in-memory host: what a create, retry, snapshot, clone, expand,
//! list and delete leave under the root.
#![allow(clippy::unwrap_used, reason = "tests")]
use super::*;
use wasmcsi_backend_sdk::dir::Dir;
use wasmcsi_backend_sdk::fake::FakeHost;
use wasmcsi_backend_sdk::types::pairs;

fn host() -> FakeHost {
    let h = FakeHost::new();
    h.dir.add_root("default").add_root("other");
    h
}

fn mount(mode: AccessMode) -> VolumeCapability {
    VolumeCapability { access_type: AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] }), access_mode: mode }
}

fn request(name: &str, required: u64, source: Option<ContentSource>) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes: required, limit_bytes: 0 },
        capabilities: vec![mount(AccessMode::SingleNodeWriter)],
        parameters: vec![],
        secrets: vec![],
        content_source: source,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

#[test]
fn create_is_idempotent_and_refuses_a_different_request_of_the_same_name() {
    let h = host();
    let v = HostPath::create_volume(&h, request("pvc-1", 5 << 20, None)).unwrap();
    assert_eq!((v.volume_id.as_str(), v.capacity_bytes), ("default.pvc-1", 5 << 20));
    assert_eq!(h.dir.paths("default"), ["meta", "meta/pvc-1", "volumes", "volumes/pvc-1"]);
    assert_eq!(HostPath::create_volume(&h, request("pvc-1", 5 << 20, None)).unwrap(), v, "a retry gets the same volume");
    assert!(matches!(HostPath::create_volume(&h, request("pvc-1", 6 << 20, None)), Err(Error::AlreadyExists(_))));
    assert_eq!(HostPath::create_volume(&h, request("pvc-2", 0, None)).unwrap().capacity_bytes, GIB, "the default size");
    assert_eq!(h.log.messages(), ["volume created", "volume created"]);
}

#[test]
fn bad_requests_are_rejected_before_anything_is_written() {
    let h = host();
    let mut req = request("pvc-1", 1, None);
    req.parameters = pairs([("root", "nope")]);
    assert!(matches!(HostPath::create_volume(&h, req.clone()), Err(Error::InvalidArgument(m)) if m.contains("root")));
    req.parameters = pairs([("colour", "red")]);
    assert!(matches!(HostPath::create_volume(&h, req.clone()), Err(Error::InvalidArgument(_))));
    // Any CSI name is valid (see `any_csi_name_maps_to_one_safe_directory`); these are not.
    for name in ["", "nul\0", "bell\u{7}", "c1\u{85}", &"x".repeat(129)] {
        assert!(matches!(HostPath::create_volume(&h, request(name, 1, None)), Err(Error::InvalidArgument(_))), "{name:?}");
    }
    let mut block = request("pvc-1", 1, None);
    block.capabilities = vec![VolumeCapability { access_type: AccessType::Block, access_mode: AccessMode::SingleNodeWriter }];
    assert!(matches!(HostPath::create_volume(&h, block), Err(Error::InvalidArgument(_))));
    let mut shared = request("pvc-1", 1, None);
    shared.capabilities = vec![mount(AccessMode::MultiNodeMultiWriter)];
    assert!(matches!(HostPath::create_volume(&h, shared), Err(Error::InvalidArgument(_))));
    let mut over = request("pvc-1", 10, None);
    over.capacity.limit_bytes = 5;
    assert!(matches!(HostPath::create_volume(&h, over), Err(Error::OutOfRange(_))));
    assert!(h.dir.paths("default").is_empty());
    assert!(matches!(HostPath::create_volume(&FakeHost::new(), request("pvc-1", 1, None)), Err(Error::FailedPrecondition(_))), "no root");
}

#[test]
fn snapshots_and_clones_copy_the_tree_and_record_their_source() {
    let h = host();
    let v = HostPath::create_volume(&h, request("src", 1 << 20, None)).unwrap();
    h.dir.write_file("default", "volumes/src/data", b"hello").unwrap();
    let s = HostPath::create_snapshot(&h, "snap".into(), v.volume_id.clone(), vec![], vec![]).unwrap();
    assert_eq!((s.snapshot_id.as_str(), s.source_volume_id.as_str(), s.size_bytes, s.ready_to_use), ("default.snap", "default.src", 1 << 20, true));
    assert_eq!(HostPath::create_snapshot(&h, "snap".into(), v.volume_id.clone(), vec![], vec![]).unwrap(), s, "a retry");
    HostPath::create_volume(&h, request("other-src", 1, None)).unwrap();
    assert!(matches!(HostPath::create_snapshot(&h, "snap".into(), "default.other-src".into(), vec![], vec![]), Err(Error::AlreadyExists(_))));

    let from_snap = request("restored", 1 << 20, Some(ContentSource::Snapshot(s.snapshot_id.clone())));
    let r = HostPath::create_volume(&h, from_snap.clone()).unwrap();
    assert_eq!(r.content_source, from_snap.content_source);
    assert_eq!(h.dir.read_file("default", "volumes/restored/data").unwrap(), b"hello");
    assert_eq!(HostPath::create_volume(&h, from_snap).unwrap(), r, "a retry of a restore");
    let clone = HostPath::create_volume(&h, request("clone", 1 << 20, Some(ContentSource::Volume(v.volume_id.clone())))).unwrap();
    assert_eq!(clone.volume_id, "default.clone");
    assert_eq!(h.dir.read_file("default", "volumes/clone/data").unwrap(), b"hello");
    assert!(matches!(HostPath::create_volume(&h, request("clone", 1 << 20, None)), Err(Error::AlreadyExists(_))), "other source");

    let missing = request("x", 1, Some(ContentSource::Snapshot("default.nope".into())));
    assert!(matches!(HostPath::create_volume(&h, missing), Err(Error::NotFound(_))));
    let elsewhere = request("x", 1, Some(ContentSource::Volume("other.src".into())));
    assert!(matches!(HostPath::create_volume(&h, elsewhere), Err(Error::InvalidArgument(_))));

    let page = HostPath::list_snapshots(&h, None, Some(v.volume_id.clone()), 0, String::new()).unwrap();
    assert_eq!(page.entries, std::slice::from_ref(&s));
    assert!(HostPath::list_snapshots(&h, None, Some("default.clone".into()), 0, String::new()).unwrap().entries.is_empty());
    HostPath::delete_snapshot(&h, s.snapshot_id.clone(), vec![]).unwrap();
    HostPath::delete_snapshot(&h, s.snapshot_id, vec![]).unwrap();
    assert!(!h.dir.exists("default", "snapshots/snap") && !h.dir.exists("default", "snapmeta/snap"));
}

#[test]
fn expand_grows_the_record_and_get_volume_reports_overuse() {
    let h = host();
    let v = HostPath::create_volume(&h, request("pvc-1", 4, None)).unwrap();
    let grow = |required, limit| {
        HostPath::expand_volume(&h, v.volume_id.clone(), CapacityRange { required_bytes: required, limit_bytes: limit }, None, vec![])
    };
    assert_eq!(grow(8, 0).unwrap().capacity_bytes, 8);
    assert_eq!(grow(2, 0).unwrap().capacity_bytes, 8, "never shrinks");
    assert!(matches!(grow(9, 5), Err(Error::OutOfRange(_))));
    assert!(!HostPath::get_volume(&h, v.volume_id.clone()).unwrap().condition.unwrap().abnormal);
    h.dir.write_file("default", "volumes/pvc-1/big", b"0123456789").unwrap();
    let status = HostPath::get_volume(&h, v.volume_id.clone()).unwrap();
    assert_eq!((status.volume.capacity_bytes, status.condition.unwrap().abnormal), (8, true));
    assert!(matches!(HostPath::get_volume(&h, "default.nope".into()), Err(Error::NotFound(_))));
    assert!(matches!(HostPath::get_volume(&h, "no-dot".into()), Err(Error::NotFound(_))));
}

#[test]
fn listing_pages_over_every_root_and_delete_is_idempotent() {
    let h = host();
    for (name, root) in [("a", "default"), ("b", "other"), ("c", "default")] {
        let mut req = request(name, 1, None);
        req.parameters = pairs([("root", root)]);
        HostPath::create_volume(&h, req).unwrap();
    }
    let first = HostPath::list_volumes(&h, 2, String::new()).unwrap();
    let ids = |p: &VolumePage| p.entries.iter().map(|e| e.volume.volume_id.clone()).collect::<Vec<_>>();
    assert_eq!((ids(&first), first.next_token.as_str()), (vec!["default.a".to_owned(), "default.c".to_owned()], "2"));
    assert_eq!(ids(&HostPath::list_volumes(&h, 2, first.next_token).unwrap()), ["other.b"]);
    assert!(matches!(HostPath::list_volumes(&h, 2, "x".into()), Err(Error::Aborted(_))));
    HostPath::delete_volume(&h, "default.a".into(), vec![]).unwrap();
    HostPath::delete_volume(&h, "default.a".into(), vec![]).unwrap();
    HostPath::delete_volume(&h, "not-ours".into(), vec![]).unwrap();
    HostPath::delete_volume(&h, "ungranted.a".into(), vec![]).expect("a root not granted holds no volume of ours");
    assert_eq!(h.dir.paths("default"), ["meta", "meta/c", "volumes", "volumes/c"]);
}

#[test]
fn attach_plans_bind_the_volume_directory() {
    let h = host();
    let v = HostPath::create_volume(&h, request("pvc-1", 7, None)).unwrap();
    let plan = HostPath::attach_plan(&h, v.volume_id.clone(), vec![], mount(AccessMode::SingleNodeWriter), vec![]).unwrap();
    assert_eq!(plan, Attachment::Bind(BindPlan { root: "default".into(), path: "volumes/pvc-1".into(), capacity_bytes: 7 }));
    let block = VolumeCapability { access_type: AccessType::Block, access_mode: AccessMode::SingleNodeWriter };
    assert!(matches!(HostPath::attach_plan(&h, v.volume_id.clone(), vec![], block.clone(), vec![]), Err(Error::FailedPrecondition(_))));
    let why = HostPath::validate_volume_capabilities(&h, v.volume_id.clone(), vec![], vec![block], vec![]).unwrap();
    assert!(why.is_some_and(|m| m.contains("block")));
    assert_eq!(HostPath::validate_volume_capabilities(&h, v.volume_id, vec![], vec![mount(AccessMode::SingleNodeWriter)], vec![]).unwrap(), None);
    let cap = HostPath::get_capacity(&h, vec![], vec![], None).unwrap();
    assert_eq!(cap.available_bytes, h.dir.fs_stats("default").unwrap().available_bytes);
}

#[test]
fn a_volume_larger_than_its_filesystem_is_out_of_range() {
    let h = host();
    h.dir.set_total_bytes(10 << 30);
    let huge = HostPath::create_volume(&h, request("huge", 8 << 60, None));
    assert!(matches!(huge, Err(Error::OutOfRange(_))), "{huge:?}");
    assert_eq!(h.dir.paths("default"), Vec::<String>::new(), "nothing written");
    assert_eq!(HostPath::create_volume(&h, request("fits", 10 << 30, None)).unwrap().capacity_bytes, 10 << 30);
}

#[test]
fn any_csi_name_maps_to_one_safe_directory() {
    let h = host();
    let long = format!("{}✓", "ü".repeat(62));
    assert_eq!(long.len(), 127);
    let names = [".hidden", "..", "a/b", "../../etc", "-rf", "Données ✓ 中文", "tab\there", long.as_str(), &"x".repeat(128)];
    let mut ids = vec![];
    for name in names {
        let v = HostPath::create_volume(&h, request(name, 1, None)).unwrap();
        let (root, file) = v.volume_id.split_once('.').unwrap();
        assert_eq!(root, "default");
        assert!(v.volume_id.len() <= MAX_ID_BYTES && is_file_name(file), "{name:?} -> {}", v.volume_id);
        assert!(file.ends_with(&wasmcsi_backend_sdk::names::name_hash(name)), "{name:?} -> {file}");
        assert!(h.dir.exists("default", &format!("volumes/{file}")), "{name:?}");
        assert_eq!(HostPath::create_volume(&h, request(name, 1, None)).unwrap(), v, "{name:?}: the same name, the same volume");
        let s = HostPath::create_snapshot(&h, name.into(), v.volume_id.clone(), vec![], vec![]).unwrap();
        assert_eq!(HostPath::get_snapshot(&h, s.snapshot_id.clone()).unwrap(), s);
        assert!(s.snapshot_id.len() <= MAX_ID_BYTES && is_file_name(s.snapshot_id.split_once('.').unwrap().1));
        ids.push(v.volume_id);
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), names.len(), "every name its own volume");
    // Nothing outside the root's own directories.
    assert!(h.dir.paths("default").iter().all(|p| ["meta", "volumes", "snapmeta", "snapshots"].contains(&p.split('/').next().unwrap())));
    // A plain name keeps its directory (volumes made before names were mapped are found again).
    assert_eq!(HostPath::create_volume(&h, request("pvc-1", 1, None)).unwrap().volume_id, "default.pvc-1");
    assert!(matches!(HostPath::get_snapshot(&h, "default.nope".into()), Err(Error::NotFound(_))));
}
