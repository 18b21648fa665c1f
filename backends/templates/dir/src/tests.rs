//! The policy against the SDK's in-memory host (`FakeHost`): what a create, a retry, an expand
//! and a delete leave under the root. `cargo test` runs these natively in milliseconds.
#![allow(clippy::unwrap_used, reason = "tests")]
use super::*;
use wasmcsi_backend_sdk::fake::FakeHost;

fn host() -> FakeHost {
    let h = FakeHost::new();
    h.dir.add_root("default");
    h
}

fn request(name: &str, required_bytes: u64) -> CreateVolumeRequest {
    let mount = AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] });
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes, limit_bytes: 0 },
        capabilities: vec![VolumeCapability { access_type: mount, access_mode: AccessMode::SingleNodeWriter }],
        parameters: vec![],
        secrets: vec![],
        content_source: None,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

#[test]
fn create_is_idempotent_and_delete_removes_the_volume() {
    let h = host();
    let v = MyBackend::create_volume(&h, request("pvc-1", 5 << 20)).unwrap();
    assert_eq!(v.capacity_bytes, 5 << 20);
    assert!(h.dir.exists("default", &format!("volumes/{}", v.volume_id)));
    assert_eq!(MyBackend::create_volume(&h, request("pvc-1", 5 << 20)).unwrap(), v, "a retry gets the same volume");
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-1", 6 << 20)), Err(Error::AlreadyExists(_))));
    let listed = MyBackend::list_volumes(&h, 0, String::new()).unwrap().entries;
    assert_eq!(listed, [VolumeStatus { volume: v.clone(), condition: None }]);
    let plan = MyBackend::attach_plan(&h, v.volume_id.clone(), vec![], request("x", 0).capabilities[0].clone(), vec![]).unwrap();
    assert_eq!(plan, Attachment::Bind(BindPlan { root: "default".into(), path: format!("volumes/{}", v.volume_id), capacity_bytes: 5 << 20 }));
    MyBackend::delete_volume(&h, v.volume_id.clone(), vec![]).unwrap();
    MyBackend::delete_volume(&h, v.volume_id.clone(), vec![]).unwrap();
    assert_eq!(h.dir.paths("default"), ["meta", "volumes"], "nothing of the volume left");
    assert!(matches!(MyBackend::attach_plan(&h, v.volume_id, vec![], request("x", 0).capabilities[0].clone(), vec![]), Err(Error::NotFound(_))));
}

#[test]
fn bad_requests_write_nothing_and_unknown_ids_are_not_found() {
    let h = host();
    let mut req = request("pvc-1", 1);
    req.parameters = vec![Pair { key: "colour".into(), value: "red".into() }];
    assert!(matches!(MyBackend::create_volume(&h, req), Err(Error::InvalidArgument(_))));
    let mut block = request("pvc-1", 1);
    block.capabilities[0].access_type = AccessType::Block;
    assert!(matches!(MyBackend::create_volume(&h, block), Err(Error::InvalidArgument(_))));
    assert!(matches!(MyBackend::create_volume(&h, request("", 1)), Err(Error::InvalidArgument(_))));
    assert!(h.dir.paths("default").is_empty());
    for id in ["nope", "..", "../etc"] {
        assert!(matches!(MyBackend::validate_volume_capabilities(&h, id.into(), vec![], vec![], vec![]), Err(Error::NotFound(_))), "{id}");
        MyBackend::delete_volume(&h, id.into(), vec![]).unwrap();
    }
}

#[test]
fn expand_grows_the_record_and_never_shrinks() {
    let h = host();
    let v = MyBackend::create_volume(&h, request("pvc-1", 4 << 20)).unwrap();
    let grow = |required_bytes| MyBackend::expand_volume(&h, v.volume_id.clone(), CapacityRange { required_bytes, limit_bytes: 0 }, None, vec![]);
    assert_eq!(grow(8 << 20).unwrap().capacity_bytes, 8 << 20);
    assert_eq!(grow(2 << 20).unwrap().capacity_bytes, 8 << 20);
    assert_eq!(MyBackend::create_volume(&h, request("pvc-1", 8 << 20)).unwrap().capacity_bytes, 8 << 20, "the record holds the new size");
}
