//! The driver against the SDK's in-memory host: ids, idempotent creates, the commit point,
//! snapshots and restores through background copies, the three onDelete policies, listing
//! and attach plans. (Against a real ganesha: `host/runtime/tests/all/nfs_backend.rs`.)
#![allow(clippy::unwrap_used, reason = "tests")]
use super::*;
use wasmcsi_backend_sdk::fake::FakeHost;
use wasmcsi_backend_sdk::types::pairs;

const ID: &str = "nfs.example_srv_pvc-1";

fn host() -> (FakeHost, NfsExport) {
    let h = FakeHost::new();
    let e = h.nfs.add_export("nfs.example", "/srv");
    (h, e)
}

fn mount() -> VolumeCapability {
    VolumeCapability {
        access_type: AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] }),
        access_mode: AccessMode::MultiNodeMultiWriter,
    }
}

fn request(name: &str, required: u64, extra: &[(&str, &str)], source: Option<ContentSource>) -> CreateVolumeRequest {
    let mut params = vec![("server", "nfs.example"), ("share", "/srv")];
    params.extend_from_slice(extra);
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes: required, limit_bytes: 0 },
        capabilities: vec![mount()],
        parameters: pairs(params),
        secrets: vec![],
        content_source: source,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

fn create(h: &FakeHost, req: CreateVolumeRequest) -> Result<Volume, Error> {
    Nfs::create_volume(h, req)
}

fn snap(h: &FakeHost, name: &str, source: &str) -> Result<Snapshot, Error> {
    Nfs::create_snapshot(h, name.into(), source.into(), vec![], vec![])
}

#[test]
fn create_names_the_volume_by_export_and_name_and_a_retry_finds_it() {
    let (h, e) = host();
    let v = create(&h, request("pvc-1", 5, &[("mountOptions", "nfsvers=4.1,hard")], None)).unwrap();
    assert_eq!((v.volume_id.as_str(), v.capacity_bytes), (ID, 5));
    let ctx = |k: &str| v.volume_context.iter().find(|p| p.key == k).map(|p| p.value.clone());
    assert_eq!((ctx("server"), ctx("share"), ctx("subDir")), (Some("nfs.example".into()), Some("/srv".into()), Some("pvc-1".into())));
    assert_eq!(ctx("mountOptions").as_deref(), Some("nfsvers=4.1,hard"));
    // the data directory, its metadata, the index (the commit point) and the known export
    assert_eq!(h.nfs.paths(&e), [".wasmcsi", ".wasmcsi/volumes", ".wasmcsi/volumes/pvc-1", "pvc-1", "pvc-1/.wasmcsi-volume"]);
    assert_eq!(h.kv.entries().keys().collect::<Vec<_>>(), ["exports/nfs.example_srv_x"]);
    assert_eq!(create(&h, request("pvc-1", 5, &[("mountOptions", "nfsvers=4.1,hard")], None)).unwrap(), v, "same request, same volume");
    assert_eq!(h.nfs.journal.calls("mkdir"), 2, "the retry created nothing");
    for other in [request("pvc-1", 6, &[], None), request("pvc-1", 5, &[("subDir", "elsewhere")], None)] {
        assert!(matches!(create(&h, other), Err(Error::AlreadyExists(_))));
    }
    assert_eq!(h.log.messages(), ["volume created"]);
}

#[test]
fn templates_parameters_and_grants_are_checked_before_anything_is_written() {
    let (h, e) = host();
    let templated =
        [("subDir", "${pvc.namespace}/${pvc.name}"), ("csi.storage.k8s.io/pvc/namespace", "team"), ("csi.storage.k8s.io/pvc/name", "data")];
    let v = create(&h, request("pvc-2", 1, &templated, None)).unwrap();
    assert!(v.volume_context.contains(&Pair { key: "subDir".into(), value: "team/data".into() }));
    assert!(h.nfs.exists(&e, "team/data/.wasmcsi-volume"));
    let before = h.nfs.paths(&e);
    for bad in [&[("colour", "red")][..], &[("subDir", "../escape")], &[("onDelete", "shred")]] {
        assert!(matches!(create(&h, request("pvc-3", 1, bad, None)), Err(Error::InvalidArgument(_))), "{bad:?}");
    }
    // Any CSI name is valid (`any_csi_name_is_one_volume_and_its_snapshots_too`); this is not.
    assert!(matches!(create(&h, request("bad\u{1b}name", 1, &[], None)), Err(Error::InvalidArgument(_))));
    let mut block = request("pvc-3", 1, &[], None);
    block.capabilities = vec![VolumeCapability { access_type: AccessType::Block, access_mode: AccessMode::SingleNodeWriter }];
    assert!(matches!(create(&h, block), Err(Error::InvalidArgument(_))));
    assert_eq!(h.nfs.paths(&e), before, "nothing written");
    let mut ungranted = request("pvc-3", 1, &[], None);
    ungranted.parameters = pairs([("server", "other"), ("share", "/srv")]);
    assert!(matches!(create(&h, ungranted), Err(Error::PermissionDenied(_))));
}

#[test]
fn an_interrupted_create_is_finished_and_a_foreign_directory_is_left_alone() {
    let (h, e) = host();
    // dies at the data directory, then between the directory and its metadata
    h.nfs.fail_next("mkdir", Error::Unavailable("server went away".into()));
    h.nfs.fail_next("write_file", Error::Unavailable("server went away".into()));
    assert!(matches!(create(&h, request("pvc-1", 5, &[], None)), Err(Error::Unavailable(_))));
    assert!(matches!(create(&h, request("pvc-1", 5, &[], None)), Err(Error::Unavailable(_))));
    assert!(matches!(Nfs::get_volume(&h, ID.into()), Err(Error::NotFound(_))), "no index yet: no volume");
    assert_eq!(create(&h, request("pvc-1", 5, &[], None)).unwrap().volume_id, ID);
    // died after the metadata, before the index: the directory names this volume, so it is ours
    h.nfs.mkdir(&e, "pvc-2", 0o755, 0, 0).unwrap();
    h.nfs.write_file(&e, "pvc-2/.wasmcsi-volume", &Meta::default().set("name", "pvc-2").encode()).unwrap();
    assert_eq!(create(&h, request("pvc-2", 5, &[], None)).unwrap().volume_id, "nfs.example_srv_pvc-2");
    // a directory that holds another volume's metadata is not taken over
    h.nfs.mkdir(&e, "taken", 0o755, 0, 0).unwrap();
    h.nfs.write_file(&e, "taken/.wasmcsi-volume", &Meta::default().set("name", "someone-else").encode()).unwrap();
    assert!(matches!(create(&h, request("pvc-3", 1, &[("subDir", "taken")], None)), Err(Error::AlreadyExists(_))));
    let from_source = request("pvc-4", 1, &[("subDir", "pvc-2")], Some(ContentSource::Volume(ID.into())));
    assert!(matches!(create(&h, from_source), Err(Error::AlreadyExists(_))), "a copy needs a new directory");
}

#[test]
fn snapshots_copy_in_the_background_and_restores_wait_for_them() {
    let (h, e) = host();
    create(&h, request("pvc-1", 5, &[], None)).unwrap();
    h.nfs.write_file(&e, "pvc-1/data", b"hello").unwrap();
    h.nfs.set_copy_polls(1);
    let first = snap(&h, "snap-1", ID).unwrap();
    assert_eq!((first.snapshot_id.as_str(), first.source_volume_id.as_str(), first.ready_to_use), ("nfs.example_srv_snap-1", ID, false));
    let restore = request("pvc-2", 5, &[], Some(ContentSource::Snapshot(first.snapshot_id.clone())));
    assert!(matches!(create(&h, restore.clone()), Err(Error::Aborted(_))), "a snapshot still copying is no source yet");
    let ready = snap(&h, "snap-1", ID).unwrap();
    assert!(ready.ready_to_use && ready.creation_time == first.creation_time, "the cut's time is kept");
    assert_eq!(h.nfs.read_file(&e, ".snapshots/snap-1/data/data").unwrap(), b"hello");
    assert!(matches!(snap(&h, "snap-1", "nfs.example_srv_pvc-2"), Err(Error::AlreadyExists(_))), "same name, other source");

    assert!(matches!(create(&h, restore.clone()), Err(Error::Aborted(_))), "the restore's own copy runs");
    let v = create(&h, restore.clone()).unwrap();
    assert_eq!((v.content_source, h.nfs.read_file(&e, "pvc-2/data").unwrap()), (restore.content_source.clone(), b"hello".to_vec()));
    assert!(!h.nfs.exists(&e, ".wasmcsi/staging/pvc-2"), "staging is cleaned up");
    assert_eq!(create(&h, restore).unwrap().volume_id, "nfs.example_srv_pvc-2", "a retry");

    h.nfs.set_copy_polls(0);
    let clone = create(&h, request("pvc-3", 5, &[], Some(ContentSource::Volume(ID.into())))).unwrap();
    assert_eq!(h.nfs.read_file(&e, "pvc-3/data").unwrap(), b"hello");
    assert_eq!(clone.content_source, Some(ContentSource::Volume(ID.into())));
    let gone = request("pvc-4", 5, &[], Some(ContentSource::Snapshot("nfs.example_srv_nope".into())));
    assert!(matches!(create(&h, gone), Err(Error::NotFound(_))));
    h.nfs.add_export("other", "/x");
    let foreign = request("pvc-4", 5, &[], Some(ContentSource::Snapshot("other_x_snap-1".into())));
    assert!(matches!(create(&h, foreign), Err(Error::InvalidArgument(_))));

    let all = Nfs::list_snapshots(&h, None, None, 0, String::new()).unwrap();
    assert_eq!(all.entries.iter().map(|s| s.snapshot_id.as_str()).collect::<Vec<_>>(), ["nfs.example_srv_snap-1"]);
    let filtered = Nfs::list_snapshots(&h, None, Some("nfs.example_srv_pvc-3".into()), 0, String::new()).unwrap();
    assert!(filtered.entries.is_empty());
    Nfs::delete_snapshot(&h, "nfs.example_srv_snap-1".into(), vec![]).unwrap();
    Nfs::delete_snapshot(&h, "nfs.example_srv_snap-1".into(), vec![]).unwrap();
    assert!(!h.nfs.exists(&e, ".snapshots/snap-1"));
    assert!(Nfs::list_snapshots(&h, Some("nfs.example_srv_snap-1".into()), None, 0, String::new()).unwrap().entries.is_empty());
}

#[test]
fn delete_follows_on_delete_and_is_idempotent() {
    let (h, e) = host();
    for (name, on_delete) in [("pvc-1", "delete"), ("pvc-2", "retain"), ("pvc-3", "archive")] {
        create(&h, request(name, 1, &[("onDelete", on_delete)], None)).unwrap();
    }
    for id in ["nfs.example_srv_pvc-1", "nfs.example_srv_pvc-2", "nfs.example_srv_pvc-3"] {
        Nfs::delete_volume(&h, id.into(), vec![]).unwrap();
        Nfs::delete_volume(&h, id.into(), vec![]).unwrap();
        assert!(matches!(Nfs::get_volume(&h, id.into()), Err(Error::NotFound(_))));
    }
    assert!(!h.nfs.exists(&e, "pvc-1"));
    assert!(h.nfs.exists(&e, "pvc-2/.wasmcsi-volume"), "retained");
    assert!(h.nfs.exists(&e, "archived-pvc-3") && !h.nfs.exists(&e, "pvc-3"));
    // archiving onto an existing archive is refused, the volume stays
    create(&h, request("pvc-3", 1, &[("onDelete", "archive")], None)).unwrap();
    assert!(matches!(Nfs::delete_volume(&h, "nfs.example_srv_pvc-3".into(), vec![]), Err(Error::FailedPrecondition(_))));
    assert!(Nfs::get_volume(&h, "nfs.example_srv_pvc-3".into()).is_ok());
    Nfs::delete_volume(&h, "not-an-nfs-id".into(), vec![]).unwrap();
}

#[test]
fn expand_list_and_attach() {
    let (h, e) = host();
    create(&h, request("pvc-1", 4, &[("mountOptions", "hard")], None)).unwrap();
    create(&h, request("pvc-2", 4, &[], None)).unwrap();
    let grow = |required, limit| Nfs::expand_volume(&h, ID.into(), CapacityRange { required_bytes: required, limit_bytes: limit }, None, vec![]);
    assert_eq!(grow(8, 0).unwrap(), Expansion { capacity_bytes: 8, node_expansion_required: false });
    assert_eq!(grow(1, 0).unwrap().capacity_bytes, 8, "never shrinks");
    assert!(matches!(grow(9, 5), Err(Error::OutOfRange(_))));
    h.nfs.write_file(&e, "pvc-1/big", b"0123456789").unwrap();
    let status = Nfs::get_volume(&h, ID.into()).unwrap();
    assert!(status.condition.is_some_and(|c| c.abnormal), "more used than recorded");

    let first = Nfs::list_volumes(&h, 1, String::new()).unwrap();
    assert_eq!((first.entries[0].volume.volume_id.as_str(), first.next_token.as_str()), (ID, "1"));
    let second = Nfs::list_volumes(&h, 1, first.next_token).unwrap();
    assert_eq!((second.entries[0].volume.volume_id.as_str(), second.next_token.as_str()), ("nfs.example_srv_pvc-2", ""));

    let from_meta = Nfs::attach_plan(&h, ID.into(), vec![], mount(), vec![]).unwrap();
    let plan =
        Attachment::Nfs(NfsPlan { server: "nfs.example".into(), share: "/srv".into(), path: "pvc-1".into(), mount_options: vec!["hard".into()] });
    assert_eq!(from_meta, plan);
    let ctx = pairs([("server", "nfs.example"), ("share", "/srv"), ("subDir", "pvc-1"), ("mountOptions", "hard")]);
    let stats = h.nfs.journal.calls("stat");
    assert_eq!(Nfs::attach_plan(&h, ID.into(), ctx, mount(), vec![]).unwrap(), plan);
    assert_eq!(h.nfs.journal.calls("stat"), stats, "the context carries everything: no nfs traffic on the node");
    let lying = pairs([("server", "elsewhere"), ("share", "/srv"), ("subDir", "pvc-1")]);
    assert!(matches!(Nfs::attach_plan(&h, ID.into(), lying, mount(), vec![]), Err(Error::InvalidArgument(_))));
    let block = VolumeCapability { access_type: AccessType::Block, access_mode: AccessMode::SingleNodeWriter };
    assert!(matches!(Nfs::attach_plan(&h, ID.into(), vec![], block, vec![]), Err(Error::FailedPrecondition(_))));
    assert!(matches!(Nfs::attach_plan(&h, "junk".into(), vec![], mount(), vec![]), Err(Error::NotFound(_))));
    h.nfs.set_total_bytes(1000);
    let cap = Nfs::get_capacity(&h, vec![], pairs([("server", "nfs.example"), ("share", "/srv")]), None).unwrap();
    assert_eq!(cap.available_bytes, 1000 - h.nfs.usage(&e, "").unwrap());
}

#[test]
fn any_csi_name_is_one_volume_and_its_snapshots_too() {
    let (h, e) = host();
    let long = format!("{}✓", "ü".repeat(62));
    let names = ["bad_name", ".hidden", "a/b", "../../etc", "Données ✓ 中文", "tab\there", long.as_str(), &"x".repeat(128)];
    let mut ids = vec![];
    for name in names {
        let v = create(&h, request(name, 1, &[], None)).unwrap();
        let (ve, local) = policy::decode_id(&v.volume_id).unwrap_or_else(|| panic!("{name:?} -> {}", v.volume_id));
        assert_eq!(ve, e);
        assert!(local.ends_with(&wasmcsi_backend_sdk::names::name_hash(name)), "{name:?} -> {local}");
        assert_eq!(create(&h, request(name, 1, &[], None)).unwrap(), v, "{name:?}: the same name, the same volume");
        let sub_dir = v.volume_context.iter().find(|p| p.key == "subDir").unwrap().value.clone();
        assert_eq!(sub_dir, local, "the default subDir is the local name");
        let meta = Meta::decode(&h.nfs.read_file(&e, &format!("{local}/.wasmcsi-volume")).unwrap()).unwrap();
        assert_eq!(meta.get("name"), name, "the metadata keeps the CSI name");
        let s = snap(&h, name, &v.volume_id).unwrap();
        assert!(policy::decode_id(&s.snapshot_id).is_some(), "{}", s.snapshot_id);
        assert_eq!(snap(&h, name, &v.volume_id).unwrap().snapshot_id, s.snapshot_id);
        assert_eq!(Nfs::get_snapshot(&h, s.snapshot_id.clone()).unwrap().snapshot_id, s.snapshot_id);
        ids.push(v.volume_id);
    }
    let listed: Vec<String> = Nfs::list_volumes(&h, 0, String::new()).unwrap().entries.into_iter().map(|s| s.volume.volume_id).collect();
    ids.sort();
    assert_eq!(listed, ids, "every name its own volume, each listed");
    assert_eq!(Nfs::list_snapshots(&h, None, None, 0, String::new()).unwrap().entries.len(), names.len());
    assert!(matches!(Nfs::get_snapshot(&h, "nfs.example_srv_nope".into()), Err(Error::NotFound(_))));
}
