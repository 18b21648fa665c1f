//! The controller under faults no single backend call shows: a whole host in this process with
//! the hostpath example (and, where a test needs it, the hostile fixture) loaded from its
//! backends directory, real gRPC clients on the CSI socket, calls racing one another.
#![allow(clippy::unwrap_used, reason = "tests")]
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::Code;
use wasmcsi::host::{Host, HostOptions, connect};
use wasmcsi_csi::Mode;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::controller_client::ControllerClient;
use wasmcsi_runtime::config::HostConfig;

/// A controller host over `dir`: hostpath granted `dir/hostpath`, `extra` appended to its
/// configuration, each `(name, wasm)` in its backends directory.
async fn start_host(dir: &Path, components: &[(&str, &[u8])], extra: &str) -> Host {
    for sub in ["hostpath", "backends", "state"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
    }
    for (name, wasm) in components {
        std::fs::write(dir.join(format!("backends/{name}.wasm")), wasm).unwrap();
    }
    let config = format!("[backends.hostpath.grants]\ndir = {{ default = \"{}/hostpath\" }}\n{extra}", dir.display());
    Host::start(HostOptions {
        driver_name: "faults.test.wasmcsi.io".into(),
        mode: Mode::Controller,
        node_id: "node-1".into(),
        socket: dir.join("csi.sock"),
        config: HostConfig::parse(&config, Path::new("faults-test")).unwrap(),
        config_file: None,
        backends_dir: Some(dir.join("backends")),
        state_dir: dir.join("state"),
        reload_interval: Duration::from_secs(3600),
        metrics_addr: None,
        replicas: None,
        reconcile: None,
    })
    .await
    .unwrap()
}

fn create_request(name: &str, backend: &str) -> csi::CreateVolumeRequest {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode as AM};
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }),
        volume_capabilities: vec![csi::VolumeCapability {
            access_type: Some(AccessType::Mount(MountVolume::default())),
            access_mode: Some(AccessMode { mode: AM::SingleNodeWriter as i32 }),
        }],
        parameters: [("backend".to_string(), backend.to_string())].into(),
        ..Default::default()
    }
}

/// Whether hostpath's volume `name` exists as a whole: its metadata and its data directory.
fn volume_state(root: &Path, name: &str) -> (bool, bool) {
    (root.join("meta").join(name).exists(), root.join("volumes").join(name).is_dir())
}

/// CreateVolume of a name and DeleteVolume of the id that name gets, sent at once over the
/// socket, many times: one runs, the other waits or gets ABORTED. Never a volume reported
/// created whose data directory is gone (the race left metadata without data before the
/// backend's gate: 4 of 150 rounds in the issue).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn create_and_delete_of_one_volume_never_run_at_once() {
    let d = tempfile::tempdir().unwrap();
    let host = start_host(d.path(), &[("hostpath", wasmcsi_artifacts::HOSTPATH)], "").await;
    let channel = connect(&host.socket).await.unwrap();
    let root: PathBuf = d.path().join("hostpath");
    let mut aborted = 0;
    for round in 0..150 {
        let name = format!("race-{round}");
        let id = format!("hostpath:default.{name}");
        // Stagger the two by a few hundred microseconds either way, so every overlap occurs.
        let lead = Duration::from_micros((round % 7) * 150);
        let (create, delete) = {
            let (mut c, mut dl) = (ControllerClient::new(channel.clone()), ControllerClient::new(channel.clone()));
            let request = create_request(&name, "hostpath");
            let del = csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() };
            let create = tokio::spawn(async move {
                if round % 2 == 0 {
                    tokio::time::sleep(lead).await;
                }
                c.create_volume(request).await
            });
            let delete = tokio::spawn(async move {
                if round % 2 == 1 {
                    tokio::time::sleep(lead).await;
                }
                dl.delete_volume(del).await
            });
            (create.await.unwrap(), delete.await.unwrap())
        };
        for status in [create.as_ref().err(), delete.as_ref().err()].into_iter().flatten() {
            assert_eq!(status.code(), Code::Aborted, "round {round}: {status:?}");
            aborted += 1;
        }
        let (meta, data) = volume_state(&root, &name);
        assert_eq!(meta, data, "round {round}: metadata {meta}, data {data}: a half volume");
        if create.is_ok() && meta {
            // The volume the CO was told about is there and serves.
            let got = ControllerClient::new(channel.clone())
                .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id.clone() })
                .await;
            assert!(got.is_ok(), "round {round}: created volume not found: {got:?}");
        }
    }
    assert!(aborted < 150, "every round aborted: nothing was tested ({aborted})");
    drop(channel);
    host.shutdown().await.unwrap();
}

/// A StorageClass parameter the backend does not take, met as the provisioner meets it on a
/// WaitForFirstConsumer class: GetCapacity (the class's parameters and no capability, as the
/// external-provisioner asks) answers the root's free space, so a CSIStorageCapacity exists and
/// the scheduler lets the claim through; CreateVolume then refuses the parameter with
/// INVALID_ARGUMENT, naming it, which the provisioner shows on the claim (a ProvisioningFailed
/// event). A parameter the backend takes still reaches GetCapacity: a bad one is refused there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parameter_the_backend_does_not_take_is_refused_by_create_volume_not_get_capacity() {
    let d = tempfile::tempdir().unwrap();
    let host = start_host(d.path(), &[("hostpath", wasmcsi_artifacts::HOSTPATH)], "").await;
    let mut controller = ControllerClient::new(connect(&host.socket).await.unwrap());
    let class = |extra: (&str, &str)| -> std::collections::HashMap<String, String> {
        [("backend", "hostpath"), ("csi.storage.k8s.io/fstype", "ext4"), extra]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let capacity = |parameters| csi::GetCapacityRequest { parameters, ..Default::default() };

    let free = controller.get_capacity(capacity(class(("colour", "red")))).await;
    let free = free.expect("GetCapacity of a class with a parameter hostpath does not take").into_inner();
    assert!(free.available_capacity > 0, "{free:?}");
    let mut create = create_request("pvc-colour", "hostpath");
    create.parameters = class(("colour", "red"));
    let refused = controller.create_volume(create).await.expect_err("an unknown parameter");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("unknown parameter \"colour\""), "{refused:?}");
    assert!(!d.path().join("hostpath/volumes/pvc-colour").exists(), "nothing made");

    let bad_root = controller.get_capacity(capacity(class(("root", "nope")))).await.expect_err("root is hostpath's");
    assert_eq!(bad_root.code(), Code::InvalidArgument, "{bad_root:?}");
    assert!(bad_root.message().contains("root"), "{bad_root:?}");
    drop(controller);
    host.shutdown().await.unwrap();
}

/// Hostile's limits, for the copies of it a test loads: a short deadline, and a `dir` root
/// named `hang`, which makes it spin in the calls that visit every backend.
fn hostile_config(dir: &Path, names: &[&str]) -> String {
    names
        .iter()
        .map(|n| {
            std::fs::create_dir_all(dir.join(n)).unwrap();
            format!(
                "[backends.{n}]\ncall_deadline_ms = 500\nimport_timeout_ms = 400\nmemory_limit_mib = 32\n\
                 [backends.{n}.grants]\ndir = {{ hang = \"{}/{n}\" }}\n",
                dir.display()
            )
        })
        .collect()
}

fn list_entries(page: &csi::ListVolumesResponse) -> Vec<(String, Option<csi::VolumeCondition>)> {
    page.entries
        .iter()
        .map(|e| {
            let condition = e.status.as_ref().and_then(|s| s.volume_condition.clone());
            (e.volume.as_ref().unwrap().volume_id.clone(), condition)
        })
        .collect()
}

/// A backend that hangs, next to one that serves, in the calls that visit every backend:
/// GetCapacity asks them at once, not one deadline after another;
/// ListVolumes answers with what the host's journal knows of the hung backend's volumes,
/// marked abnormal, instead of failing whole; and a backend whose file was removed keeps its
/// volumes in ListVolumes, abnormal, instead of their vanishing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_failing_backend_does_not_take_down_calls_over_every_backend() {
    let d = tempfile::tempdir().unwrap();
    let hostile = wasmcsi_artifacts::HOSTILE;
    let components: [(&str, &[u8]); 3] =
        [("hostpath", wasmcsi_artifacts::HOSTPATH), ("hostile", hostile), ("hostile2", hostile)];
    let host = start_host(d.path(), &components, &hostile_config(d.path(), &["hostile", "hostile2"])).await;
    let channel = connect(&host.socket).await.unwrap();
    let mut controller = ControllerClient::new(channel.clone());
    for name in ["pvc-a", "pvc-b"] {
        controller.create_volume(create_request(name, "hostpath")).await.unwrap();
    }
    let mut ok = create_request("h-1", "hostile");
    ok.parameters.insert("mode".into(), "ok".into());
    controller.create_volume(ok).await.unwrap();

    // Both hostile copies spin in get-capacity until their 500 ms deadline.
    let started = std::time::Instant::now();
    let capacity = controller.get_capacity(csi::GetCapacityRequest::default()).await.unwrap().into_inner();
    let took = started.elapsed();
    assert!(capacity.available_capacity > 0, "{capacity:?}");
    assert!(took < Duration::from_millis(900), "GetCapacity took {took:?}: the backends were asked one after another");

    // hostile spins in list-volumes: its volume comes from the journal, abnormal.
    let page = controller.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner();
    let entries = list_entries(&page);
    let ids: Vec<&str> = entries.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["hostile:h-1", "hostpath:default.pvc-a", "hostpath:default.pvc-b"], "{entries:?}");
    let hung = entries[0].1.as_ref().unwrap();
    assert!(hung.abnormal && hung.message.contains("hostile"), "{hung:?}");
    assert!(entries[1..].iter().all(|(_, c)| c.as_ref().is_none_or(|c| !c.abnormal)), "{entries:?}");

    // hostpath's file removed: its volumes stay listed, abnormal, not silently gone.
    std::fs::remove_file(d.path().join("backends/hostpath.wasm")).unwrap();
    host.registry.scan().await;
    assert!(host.registry.get("hostpath").is_none());
    let page = controller.list_volumes(csi::ListVolumesRequest::default()).await.unwrap().into_inner();
    let entries = list_entries(&page);
    let gone: Vec<_> = entries.iter().filter(|(id, _)| id.starts_with("hostpath:")).collect();
    assert_eq!(gone.len(), 2, "{entries:?}");
    for (id, condition) in gone {
        let c = condition.as_ref().unwrap();
        assert!(c.abnormal && c.message.contains("not loaded"), "{id}: {c:?}");
    }
    // Paged one entry at a time, the same three come back in order.
    let paged: Vec<_> = crate::support::csi::list_volumes(&mut controller, 1)
        .await
        .into_iter()
        .map(|e| e.volume.unwrap().volume_id)
        .collect();
    assert_eq!(paged, ["hostile:h-1", "hostpath:default.pvc-a", "hostpath:default.pvc-b"]);
    drop((controller, channel));
    host.shutdown().await.unwrap();
}

/// CreateVolume for a backend whose file is briefly missing (an operator replacing it) is
/// UNAVAILABLE, which the provisioner retries, not INVALID_ARGUMENT, which it takes as final:
/// while the host's journal knows the backend's volumes, and for a while
/// after its file went away. A name the host never served stays INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn create_volume_for_a_backend_being_replaced_is_unavailable() {
    let d = tempfile::tempdir().unwrap();
    let spare = format!("[backends.spare.grants]\ndir = {{ default = \"{}/spare\" }}\n", d.path().display());
    std::fs::create_dir_all(d.path().join("spare")).unwrap();
    let components: [(&str, &[u8]); 2] =
        [("hostpath", wasmcsi_artifacts::HOSTPATH), ("spare", wasmcsi_artifacts::HOSTPATH)];
    let host = start_host(d.path(), &components, &spare).await;
    let channel = connect(&host.socket).await.unwrap();
    let mut controller = ControllerClient::new(channel.clone());
    controller.create_volume(create_request("pvc-1", "hostpath")).await.unwrap();

    for name in ["hostpath", "spare"] {
        std::fs::remove_file(d.path().join(format!("backends/{name}.wasm"))).unwrap();
    }
    host.registry.scan().await;
    assert!(host.registry.get("hostpath").is_none() && host.registry.get("spare").is_none());
    // hostpath: the journal knows its volume; spare: its file went away a moment ago.
    for name in ["hostpath", "spare"] {
        let status = controller.create_volume(create_request("pvc-2", name)).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{name}: {status:?}");
    }
    let status = controller.create_volume(create_request("pvc-2", "never-served")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    std::fs::write(d.path().join("backends/hostpath.wasm"), wasmcsi_artifacts::HOSTPATH).unwrap();
    host.registry.scan().await;
    controller.create_volume(create_request("pvc-2", "hostpath")).await.unwrap();
    drop((controller, channel));
    host.shutdown().await.unwrap();
}
