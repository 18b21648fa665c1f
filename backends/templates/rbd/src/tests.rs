//! The policy against the SDK's in-memory host (`FakeHost`): what a create, a retry and a
//! delete leave in the pool and in kv. `cargo test` runs these natively in milliseconds.
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

const POOL: [(&str, &str); 2] = [("clusterID", "ceph"), ("pool", "rbd")];

#[test]
fn create_is_idempotent_rounds_to_mib_and_delete_removes_image_and_record() {
    let h = FakeHost::new();
    let pool = h.rbd.add_pool("ceph", "rbd");
    let v = MyBackend::create_volume(&h, request("pvc-1", (5 << 20) - 1, &POOL)).unwrap();
    assert_eq!(v.capacity_bytes, 5 << 20, "whole MiB");
    assert_eq!(h.rbd.images(&pool), std::slice::from_ref(&v.volume_id));
    assert_eq!(MyBackend::create_volume(&h, request("pvc-1", 5 << 20, &POOL)).unwrap(), v, "a retry gets the same volume");
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-1", 6 << 20, &POOL)), Err(Error::AlreadyExists(_))));
    let listed = MyBackend::list_volumes(&h, 0, String::new()).unwrap().entries;
    assert_eq!(listed, [VolumeStatus { volume: v.clone(), condition: None }]);
    let cap = request("x", 0, &[]).capabilities.remove(0);
    match MyBackend::attach_plan(&h, v.volume_id.clone(), vec![], cap.clone(), vec![]).unwrap() {
        Attachment::Rbd(plan) => assert_eq!((plan.cluster.as_str(), plan.pool.as_str(), plan.image.as_str()), ("ceph", "rbd", v.volume_id.as_str())),
        other => panic!("not an rbd plan: {other:?}"),
    }
    MyBackend::delete_volume(&h, v.volume_id.clone(), vec![]).unwrap();
    MyBackend::delete_volume(&h, v.volume_id.clone(), vec![]).unwrap();
    assert!(h.rbd.images(&pool).is_empty() && h.kv.entries().is_empty());
    assert!(matches!(MyBackend::attach_plan(&h, v.volume_id, vec![], cap, vec![]), Err(Error::NotFound(_))));
}

#[test]
fn a_retry_after_a_crash_before_the_record_adopts_the_image() {
    let h = FakeHost::new();
    let pool = h.rbd.add_pool("ceph", "rbd");
    h.kv.fail_next("set", Error::Internal("crash".into()));
    assert!(MyBackend::create_volume(&h, request("pvc-1", 1 << 20, &POOL)).is_err());
    assert_eq!(h.rbd.images(&pool).len(), 1, "the image was made, its record not");
    let v = MyBackend::create_volume(&h, request("pvc-1", 1 << 20, &POOL)).unwrap();
    assert_eq!(h.rbd.images(&pool), [v.volume_id]);
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-2", 1, &[POOL[0]])), Err(Error::InvalidArgument(_))));
}
