//! The policy against the SDK's in-memory host (`FakeHost`): what a create, a retry and a
//! delete leave on the export and in kv. `cargo test` runs these natively in milliseconds.
#![allow(clippy::unwrap_used, reason = "tests")]
use super::*;
use wasmcsi_backend_sdk::fake::FakeHost;
use wasmcsi_backend_sdk::types::pairs;

fn request(name: &str, required_bytes: u64, parameters: &[(&str, &str)]) -> CreateVolumeRequest {
    let mount = AccessType::Mount(MountVolume { fs_type: String::new(), mount_flags: vec![] });
    CreateVolumeRequest {
        name: name.into(),
        capacity: CapacityRange { required_bytes, limit_bytes: 0 },
        capabilities: vec![VolumeCapability { access_type: mount, access_mode: AccessMode::SingleNodeWriter }],
        parameters: pairs(parameters.iter().copied()),
        secrets: vec![],
        content_source: None,
        accessibility: None,
        mutable_parameters: vec![],
    }
}

const EXPORT: [(&str, &str); 2] = [("server", "nfs.example"), ("share", "/export")];

#[test]
fn create_is_idempotent_and_delete_removes_directory_and_record() {
    let h = FakeHost::new();
    let export = h.nfs.add_export("nfs.example", "/export");
    let v = MyBackend::create_volume(&h, request("pvc-1", 5 << 20, &EXPORT)).unwrap();
    assert_eq!(v.capacity_bytes, 5 << 20);
    assert!(h.nfs.exists(&export, &format!("volumes/{}", v.volume_id)));
    assert_eq!(MyBackend::create_volume(&h, request("pvc-1", 5 << 20, &EXPORT)).unwrap(), v, "a retry gets the same volume");
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-1", 6 << 20, &EXPORT)), Err(Error::AlreadyExists(_))));
    let listed = MyBackend::list_volumes(&h, 0, String::new()).unwrap().entries;
    assert_eq!(listed, [VolumeStatus { volume: v.clone(), condition: None }]);
    let cap = request("x", 0, &[]).capabilities.remove(0);
    let plan = MyBackend::attach_plan(&h, v.volume_id.clone(), vec![], cap.clone(), vec![]).unwrap();
    let path = format!("volumes/{}", v.volume_id);
    assert_eq!(plan, Attachment::Nfs(NfsPlan { server: "nfs.example".into(), share: "/export".into(), path, mount_options: vec![] }));
    MyBackend::delete_volume(&h, v.volume_id.clone(), vec![]).unwrap();
    MyBackend::delete_volume(&h, v.volume_id.clone(), vec![]).unwrap();
    assert_eq!(h.nfs.paths(&export), ["volumes"]);
    assert!(h.kv.entries().is_empty());
    assert!(matches!(MyBackend::attach_plan(&h, v.volume_id, vec![], cap, vec![]), Err(Error::NotFound(_))));
}

#[test]
fn bad_requests_write_nothing_and_unknown_ids_are_not_found() {
    let h = FakeHost::new();
    let export = h.nfs.add_export("nfs.example", "/export");
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-1", 1, &[("server", "nfs.example")])), Err(Error::InvalidArgument(_))));
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-1", 1, &[EXPORT[0], EXPORT[1], ("colour", "red")])), Err(Error::InvalidArgument(_))));
    let ungranted = MyBackend::create_volume(&h, request("pvc-1", 1, &[("server", "other"), ("share", "/export")]));
    assert!(matches!(ungranted, Err(Error::PermissionDenied(_))), "{ungranted:?}");
    assert!(h.nfs.paths(&export).is_empty() && h.kv.entries().is_empty());
    for id in ["nope", "..", "../etc"] {
        assert!(matches!(MyBackend::validate_volume_capabilities(&h, id.into(), vec![], vec![], vec![]), Err(Error::NotFound(_))), "{id}");
        MyBackend::delete_volume(&h, id.into(), vec![]).unwrap();
    }
}
