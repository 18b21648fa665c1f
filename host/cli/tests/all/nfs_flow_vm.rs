//! The nfs backend end to end through the CSI socket, as kubelet and the sidecars drive it:
//! a real host (controller + node, the nfs component loaded from disk) against a real
//! nfs-ganesha, the node mounting with the kernel NFS client. This machine's kernel has no NFS
//! client, so the body runs in the kernel-VM tier (`testing/vmtest`, docs/vm-test-tier.md); it
//! skips only where that tier cannot run at all. Ganesha runs inside the VM in its private
//! namespace (`wasmcsi_ganesha::Ganesha`), exactly as the controller tests run it here.
//!
//! Flow: create (mode 0770, owner 1000:1000) → stage → publish → write as uid 1000 → snapshot
//! → clone from the snapshot and from the volume → publish the clone and read → expand →
//! stats (a volume written past its size is abnormal) → unpublish → unstage → delete, with the
//! repeated calls kubelet makes on retries.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use tonic::Code;
use wasmcsi_ganesha::{Ganesha, SHARE};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_vmtest::guest::sh;

use crate::support;
use support::{from_snapshot, from_volume};

type Controller = csi::controller_client::ControllerClient<tonic::transport::Channel>;
type Node = csi::node_client::NodeClient<tonic::transport::Channel>;

const GIB: i64 = 1 << 30;

fn mount_cap() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: Mode::MultiNodeMultiWriter as i32 }),
    }
}

fn create(
    name: &str,
    params: &HashMap<String, String>,
    source: Option<csi::VolumeContentSource>,
) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: GIB, limit_bytes: 0 }),
        volume_capabilities: vec![mount_cap()],
        parameters: params.clone(),
        volume_content_source: source,
        ..Default::default()
    }
}

async fn stage_and_publish(node: &mut Node, v: &csi::Volume, staging: &Path, target: &Path) {
    let stage = csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        volume_capability: Some(mount_cap()),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    };
    // kubelet retries: a repeated stage finds it done
    node.node_stage_volume(stage.clone()).await.expect("stage");
    node.node_stage_volume(stage).await.expect("stage again");
    let publish = csi::NodePublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        target_path: target.to_string_lossy().into(),
        volume_capability: Some(mount_cap()),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    };
    node.node_publish_volume(publish.clone()).await.expect("publish");
    node.node_publish_volume(publish).await.expect("publish again");
    // kubelet's pod directories are 0750 root: a container reaches the volume through its own
    // mount namespace, this test's uid-1000 shell through the path, so open the path up.
    for dir in target.ancestors().skip(1).take_while(|d| d.starts_with(staging.ancestors().nth(2).unwrap())) {
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
}

async fn unpublish_and_unstage(node: &mut Node, id: &str, staging: &Path, target: &Path) {
    for _ in 0..2 {
        let r = csi::NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.to_string_lossy().into() };
        node.node_unpublish_volume(r).await.expect("unpublish");
    }
    for _ in 0..2 {
        let r = csi::NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.to_string_lossy().into(),
        };
        node.node_unstage_volume(r).await.expect("unstage");
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for p in [staging, target] {
        assert!(!mounts.contains(&format!(" {} ", p.display())), "{} is still mounted:\n{mounts}", p.display());
    }
}

fn as_uid_1000(script: &str) -> String {
    sh("setpriv", &["--reuid=1000", "--regid=1000", "--clear-groups", "sh", "-c", script]).expect("shell as uid 1000")
}

#[test]
fn nfs_volume_lifecycle_through_the_csi_socket_with_kernel_mounts() {
    // Ganesha's export directory needs file handles: the VM's root is an overlay without them,
    // /scratch is ext4.
    let vm = wasmcsi_vmtest::Vm::new().timeout(Duration::from_secs(900)).mem_mib(2048).env("TMPDIR", "/scratch");
    let Some(guest) = wasmcsi_vmtest::enter!(vm) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(flow(guest.scratch()));
}

async fn flow(scratch: &Path) {
    let g = Ganesha::start().expect("ganesha");
    let dir = scratch.join("host");
    let config = format!(
        "[runtime]\ncall_deadline_ms = 120000\nimport_timeout_ms = 60000\n\
         [backends.nfs]\ncall_deadline_ms = 120000\n\
         [backends.nfs.grants]\nnfs = [{{ server = {:?}, share = {SHARE:?} }}]\n",
        g.server()
    );
    let host = support::host_with("nfs", wasmcsi_artifacts::NFS, "nfs.wasmcsi.io", "vm-node", &config, &dir).await;
    let channel = wasmcsi::host::connect(&host.socket).await.unwrap();
    let (mut ctl, mut node): (Controller, Node) =
        (csi::controller_client::ControllerClient::new(channel.clone()), csi::node_client::NodeClient::new(channel));

    let params: HashMap<String, String> = [
        ("backend", "nfs"),
        ("server", g.server().as_str()),
        ("share", SHARE),
        ("subDir", "${pvc.metadata.namespace}/${pvc.metadata.name}"),
        ("csi.storage.k8s.io/pvc/name", "data"),
        ("csi.storage.k8s.io/pvc/namespace", "team-a"),
        ("mountPermissions", "0770"),
        ("uid", "1000"),
        ("gid", "1000"),
        ("mountOptions", "nfsvers=4.1,hard,timeo=50,retrans=2"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
    .collect();

    // create, twice (the provisioner retries): one volume
    let v = ctl.create_volume(create("pvc-1", &params, None)).await.expect("create").into_inner().volume.unwrap();
    let again =
        ctl.create_volume(create("pvc-1", &params, None)).await.expect("create again").into_inner().volume.unwrap();
    assert_eq!(v.volume_id, again.volume_id);
    let on_server = g.export_dir().join("team-a/data");
    let md = std::fs::metadata(&on_server).expect("the volume directory on the server");
    assert_eq!((md.mode() & 0o7777, md.uid(), md.gid()), (0o770, 1000, 1000));

    // the node: mount with the kernel client, write as the pod's non-root uid
    let work = scratch.join("kubelet");
    let (staging, target) = (work.join("staging/pvc-1"), work.join("pods/p1/volumes/pvc-1"));
    stage_and_publish(&mut node, &v, &staging, &target).await;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let line = mounts.lines().find(|l| l.contains(&format!(" {} ", staging.display()))).expect("staging mount");
    assert!(line.contains(" nfs4 ") && line.contains("vers=4.1"), "{line}");
    let t = target.display();
    let out = as_uid_1000(&format!(
        "mkdir {t}/d && echo hello > {t}/d/f && ln -s d/f {t}/link && chmod 0640 {t}/d/f && cat {t}/link"
    ));
    assert_eq!(out, "hello\n");
    let f = std::fs::metadata(on_server.join("d/f")).unwrap();
    assert_eq!((f.uid(), f.mode() & 0o777), (1000, 0o640), "owned by the pod's uid on the server");

    // stats through the node
    let stats = node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: target.to_string_lossy().into(),
            staging_target_path: staging.to_string_lossy().into(),
        })
        .await
        .expect("stats")
        .into_inner();
    assert!(stats.usage.iter().any(|u| u.total > 0), "{stats:?}");
    assert_eq!(stats.volume_condition.map(|c| c.abnormal), Some(false));

    // snapshot (server-side copy), then change the volume: the snapshot keeps the old data
    let snap = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: v.volume_id.clone(),
            name: "snap-1".into(),
            ..Default::default()
        })
        .await
        .expect("snapshot")
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    as_uid_1000(&format!("echo changed > {t}/d/f"));

    // clones from the snapshot and from the volume, each in its own directory
    let mut clone_params = params.clone();
    clone_params.insert("csi.storage.k8s.io/pvc/name".into(), "from-snap".into());
    let c1 = ctl
        .create_volume(create("pvc-2", &clone_params, Some(from_snapshot(&snap.snapshot_id))))
        .await
        .expect("clone from snapshot")
        .into_inner()
        .volume
        .unwrap();
    clone_params.insert("csi.storage.k8s.io/pvc/name".into(), "from-vol".into());
    let c2 = ctl
        .create_volume(create("pvc-3", &clone_params, Some(from_volume(&v.volume_id))))
        .await
        .expect("clone from volume")
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(std::fs::read_to_string(g.export_dir().join("team-a/from-vol/d/f")).unwrap(), "changed\n");
    let (staging2, target2) = (work.join("staging/pvc-2"), work.join("pods/p2/volumes/pvc-2"));
    stage_and_publish(&mut node, &c1, &staging2, &target2).await;
    let t2 = target2.display();
    assert_eq!(as_uid_1000(&format!("cat {t2}/link && readlink {t2}/link")), "hello\nd/f\n");
    // Owners are checked on the server: without an idmap domain in the VM the v4 client shows
    // them as nobody.
    let f = std::fs::symlink_metadata(g.export_dir().join("team-a/from-snap/d/f")).unwrap();
    assert_eq!((f.uid(), f.gid(), f.mode() & 0o777), (1000, 1000, 0o640), "the clone keeps owner and mode");
    as_uid_1000(&format!("echo mine > {t2}/d/g"));

    // expand: recorded by the controller, nothing for the node to do on NFS
    let grown = ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: v.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 2 * GIB, limit_bytes: 0 }),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        })
        .await
        .expect("expand")
        .into_inner();
    assert_eq!(grown.capacity_bytes, 2 * GIB);
    assert!(!grown.node_expansion_required);
    let got = ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 2 * GIB);

    // sizes are recorded, not enforced: a volume written past its size is abnormal, to the node
    // and to the controller
    let mut small = create("pvc-small", &clone_params, None);
    small.parameters.insert("csi.storage.k8s.io/pvc/name".into(), "small".into());
    small.capacity_range = Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 });
    let s = ctl.create_volume(small).await.expect("small volume").into_inner().volume.unwrap();
    let (staging3, target3) = (work.join("staging/pvc-small"), work.join("pods/p3/volumes/pvc-small"));
    stage_and_publish(&mut node, &s, &staging3, &target3).await;
    as_uid_1000(&format!("head -c 2097152 /dev/urandom > {}/big", target3.display()));
    let stats = node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: s.volume_id.clone(),
            volume_path: target3.to_string_lossy().into(),
            staging_target_path: staging3.to_string_lossy().into(),
        })
        .await
        .expect("stats")
        .into_inner();
    let bytes = stats.usage.iter().find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32).expect("bytes usage");
    assert_eq!(bytes.total, 1 << 20, "{stats:?}");
    assert!(bytes.used >= 2 << 20, "{stats:?}");
    let condition = stats.volume_condition.unwrap();
    assert!(condition.abnormal && condition.message.contains("capacity"), "{condition:?}");
    let status = ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: s.volume_id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert!(status.status.unwrap().volume_condition.unwrap().abnormal, "the controller sees it too");
    unpublish_and_unstage(&mut node, &s.volume_id, &staging3, &target3).await;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: s.volume_id.clone(), ..Default::default() })
        .await
        .expect("delete small");

    // teardown in kubelet's order, each step repeated
    unpublish_and_unstage(&mut node, &c1.volume_id, &staging2, &target2).await;
    unpublish_and_unstage(&mut node, &v.volume_id, &staging, &target).await;
    for id in [&snap.snapshot_id, &snap.snapshot_id] {
        ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: id.clone(), ..Default::default() })
            .await
            .expect("delete snapshot");
    }
    for id in [&c1.volume_id, &c2.volume_id, &v.volume_id, &v.volume_id] {
        ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: id.clone(), ..Default::default() })
            .await
            .expect("delete");
    }
    let gone = ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound, "{gone:?}");
    let left: Vec<String> = std::fs::read_dir(g.export_dir().join("team-a"))
        .map(|d| d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left on the export: {left:?}");
    host.shutdown().await.unwrap();
}
