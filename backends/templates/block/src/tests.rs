//! The policy against the SDK's in-memory host (`FakeHost`): where a create places its
//! replicas, what a retry and a delete do. `cargo test` runs these natively in milliseconds.
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

#[test]
fn create_places_replicas_on_the_emptiest_nodes_and_is_idempotent() {
    let h = FakeHost::new();
    h.block.add_node("a", 10 << 30, &[]).add_node("b", 20 << 30, &[]).add_node("c", 30 << 30, &[]);
    let v = MyBackend::create_volume(&h, request("pvc-1", (5 << 20) - 1, &[])).unwrap();
    assert_eq!(v.capacity_bytes, 5 << 20, "whole MiB");
    let set = h.block.replica_set(&v.volume_id).unwrap();
    let mut nodes: Vec<String> = set.set.replicas.iter().map(|r| r.node.clone()).collect();
    nodes.sort();
    assert_eq!(nodes, ["b", "c"]);
    assert_eq!(MyBackend::create_volume(&h, request("pvc-1", 5 << 20, &[])).unwrap(), v, "a retry gets the same volume");
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-1", 6 << 20, &[])), Err(Error::AlreadyExists(_))));
    let listed = MyBackend::list_volumes(&h, 0, String::new()).unwrap().entries;
    assert_eq!(listed, [VolumeStatus { volume: v.clone(), condition: None }]);
    let cap = request("x", 0, &[]).capabilities.remove(0);
    let plan = MyBackend::attach_plan(&h, v.volume_id.clone(), vec![], cap.clone(), vec![]).unwrap();
    assert_eq!(
        plan,
        Attachment::ReplicatedBlock(BlockPlan {
            volume_id: v.volume_id.clone(),
            size_bytes: 5 << 20,
            fs_type: String::new(),
            frontend: None,
            encryption: None
        })
    );
    MyBackend::delete_volume(&h, v.volume_id.clone(), vec![]).unwrap();
    MyBackend::delete_volume(&h, v.volume_id.clone(), vec![]).unwrap();
    assert!(h.block.replica_set(&v.volume_id).is_none());
    assert!(matches!(MyBackend::attach_plan(&h, v.volume_id, vec![], cap, vec![]), Err(Error::NotFound(_))));
}

#[test]
fn too_few_nodes_is_resource_exhausted_and_unknown_ids_are_not_found() {
    let h = FakeHost::new();
    h.block.add_node("a", 10 << 30, &[]);
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-1", 1, &[])), Err(Error::ResourceExhausted(_))));
    assert!(matches!(MyBackend::create_volume(&h, request("pvc-1", 1, &[("colour", "red")])), Err(Error::InvalidArgument(_))));
    for id in ["nope", "../etc"] {
        assert!(matches!(MyBackend::validate_volume_capabilities(&h, id.into(), vec![], vec![], vec![]), Err(Error::NotFound(_))), "{id}");
        MyBackend::delete_volume(&h, id.into(), vec![]).unwrap();
    }
}
