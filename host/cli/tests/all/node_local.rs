//! A node-local backend (hostpath) in a two-node cluster, every part a real `wasmcsi serve`
//! process: node plugins A and B (each its own dir root, state and socket; each root a tmpfs of
//! its own, of different sizes, so capacity differs per node and nothing else on the machine
//! changes it) serving their peer endpoints on loopback,
//! and a controller forwarding node-local calls to them, signed with a key made by
//! `wasmcsi peer keygen`.
//!
//! CreateVolume for node B through the controller makes the directory on B's root only and
//! answers B's topology and an id naming B; NodeStage/Publish on B work and the data lands in
//! B's root, on A NodeStage is NOT_FOUND; expand and snapshots reach B; GetCapacity answers per
//! node (B's tmpfs, A's, nothing for a node that does not exist); DeleteVolume removes it
//! from B. A central backend (replicated-block, replicas on both nodes) is served by the same
//! controller unpinned. A node's peer endpoint refuses unsigned calls and calls signed for
//! another node. Runs as root (tmpfs and bind mounts); takes a few seconds.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use crate::support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use support::process::{BIN, Proc};
use tonic::Code;
use wasmcsi_csi::plugin::TOPOLOGY_NODE_KEY;
use wasmcsi_proto::csi::v1 as csi;

/// Node B's root; node A's is twice as large.
const TMPFS_BYTES: u64 = 64 << 20;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn topology(node: &str) -> csi::Topology {
    csi::Topology { segments: [(TOPOLOGY_NODE_KEY.to_string(), node.to_string())].into() }
}

fn mount_cap() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    }
}

fn params(backend: &str, extra: &[(&str, &str)]) -> HashMap<String, String> {
    [("backend", backend)].iter().chain(extra).map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()
}

/// Unmounts what the test mounted, also when it fails.
struct Mounts(Vec<PathBuf>);
impl Drop for Mounts {
    fn drop(&mut self) {
        for m in self.0.iter().rev() {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

struct Plugin {
    name: String,
    home: PathBuf,
    peer_port: u16,
    replica_port: u16,
    proc: Option<Proc>,
}

impl Plugin {
    fn new(base: &Path, name: &str) -> Self {
        let home = base.join(name);
        for d in ["root", "backends", "state", "replicas"] {
            std::fs::create_dir_all(home.join(d)).unwrap();
        }
        for (stem, wasm) in wasmcsi_artifacts::ALL.iter().filter(|(n, _)| ["hostpath", "replicated-block"].contains(n))
        {
            std::fs::write(home.join("backends").join(format!("{stem}.wasm")), wasm).unwrap();
        }
        Self { name: name.into(), home, peer_port: free_port(), replica_port: free_port(), proc: None }
    }

    fn root(&self) -> PathBuf {
        self.home.join("root")
    }

    fn socket(&self) -> PathBuf {
        self.home.join("csi.sock")
    }

    fn write_config(&self, replica_nodes: &[String]) -> PathBuf {
        let config = format!(
            "[backends.hostpath.grants]\ndir = {{ default = {:?} }}\n\
             [backends.replicated-block.grants.block]\nnodes = {replica_nodes:?}\n",
            self.root().to_string_lossy()
        );
        let path = self.home.join("config.toml");
        std::fs::write(&path, config).unwrap();
        path
    }

    fn start(&mut self, config: &Path, extra: &[String]) {
        let home = |p: &str| self.home.join(p).to_string_lossy().into_owned();
        let mut args: Vec<String> = [
            "serve",
            "--socket",
            &home("csi.sock"),
            "--config",
            &config.to_string_lossy(),
            "--backends-dir",
            &home("backends"),
            "--state-dir",
            &home("state"),
            "--node-id",
            &self.name,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().cloned());
        self.proc = Some(Proc::spawn(&self.name, None, &args));
    }

    async fn channel(&self) -> tonic::transport::Channel {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(ch) = wasmcsi::host::connect(&self.socket()).await {
                let mut id = csi::identity_client::IdentityClient::new(ch.clone());
                if let Ok(r) = id.probe(csi::ProbeRequest {}).await
                    && r.into_inner().ready == Some(true)
                {
                    return ch;
                }
            }
            assert!(Instant::now() < deadline, "{} never became ready", self.name);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn stage_req(id: &str, ctx: &HashMap<String, String>, staging: &Path) -> csi::NodeStageVolumeRequest {
    csi::NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.to_string_lossy().into(),
        volume_capability: Some(mount_cap()),
        volume_context: ctx.clone(),
        ..Default::default()
    }
}

async fn capacity(
    ctl: &mut csi::controller_client::ControllerClient<tonic::transport::Channel>,
    node: Option<&str>,
) -> i64 {
    let req = csi::GetCapacityRequest {
        volume_capabilities: vec![mount_cap()],
        parameters: params("hostpath", &[]),
        accessible_topology: node.map(topology),
    };
    ctl.get_capacity(req).await.unwrap().into_inner().available_capacity
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_local_volume_lives_on_the_node_it_was_made_for_and_central_backends_are_unpinned() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let (private, public) = (base.join("peer.key"), base.join("peer.pub"));
    let keygen = std::process::Command::new(BIN)
        .args(["peer", "keygen", "--private", &private.to_string_lossy(), "--public", &public.to_string_lossy()])
        .status()
        .unwrap();
    assert!(keygen.success());

    let mut a = Plugin::new(base, "node-a");
    let mut b = Plugin::new(base, "node-b");
    let mut ctl = Plugin::new(base, "controller");
    let mut mounts = Mounts(vec![]);
    let tmpfs = nix::mount::MsFlags::empty();
    // A's root is a tmpfs too, not the machine's disk: whatever else writes there (other tests,
    // the build) would change A's capacity between the calls that compare it.
    for (node, bytes) in [(&b, TMPFS_BYTES), (&a, 2 * TMPFS_BYTES)] {
        nix::mount::mount(Some("tmpfs"), &node.root(), Some("tmpfs"), tmpfs, Some(format!("size={bytes}").as_str()))
            .unwrap();
        mounts.0.push(node.root());
    }

    let replicas = vec![format!("127.0.0.1:{}", a.replica_port), format!("127.0.0.1:{}", b.replica_port)];
    for node in [&mut a, &mut b] {
        let config = node.write_config(&replicas);
        let extra: Vec<String> = vec![
            "--mode".into(),
            "node".into(),
            "--peer-listen".into(),
            format!("127.0.0.1:{}", node.peer_port),
            "--peer-trusted-key".into(),
            public.to_string_lossy().into(),
            "--replica-listen".into(),
            format!("127.0.0.1:{}", node.replica_port),
            "--replica-root".into(),
            node.home.join("replicas").to_string_lossy().into(),
            "--tls-mode".into(),
            "off".into(),
        ];
        node.start(&config, &extra);
    }
    let config = ctl.write_config(&replicas);
    ctl.start(
        &config,
        &[
            "--mode".into(),
            "controller".into(),
            "--peer-signing-key".into(),
            private.to_string_lossy().into(),
            "--peer".into(),
            format!("node-a=127.0.0.1:{}", a.peer_port),
            "--peer".into(),
            format!("node-b=127.0.0.1:{}", b.peer_port),
        ],
    );
    let mut controller = csi::controller_client::ControllerClient::new(ctl.channel().await);
    let mut node_a = csi::node_client::NodeClient::new(a.channel().await);
    let mut node_b = csi::node_client::NodeClient::new(b.channel().await);
    let started = Instant::now();

    // CreateVolume for node B (preferred B, A also allowed): made on B only, pinned to B.
    let create = csi::CreateVolumeRequest {
        name: "pvc-local-1".into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 1 << 20, limit_bytes: 0 }),
        volume_capabilities: vec![mount_cap()],
        parameters: params("hostpath", &[]),
        accessibility_requirements: Some(csi::TopologyRequirement {
            requisite: vec![topology("node-a"), topology("node-b")],
            preferred: vec![topology("node-b"), topology("node-a")],
        }),
        ..Default::default()
    };
    let volume = controller.create_volume(create.clone()).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(volume.volume_id, "hostpath@node-b:default.pvc-local-1");
    assert_eq!(volume.accessible_topology, vec![topology("node-b")]);
    assert!(b.root().join("volumes/pvc-local-1").is_dir());
    assert!(!a.root().join("volumes/pvc-local-1").exists());
    assert!(!ctl.root().join("volumes").exists(), "the controller made nothing in its own root");
    let again = controller.create_volume(create.clone()).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(again.volume_id, volume.volume_id, "a retry finds the same volume");

    // Only a node that does not exist is asked for: nothing can take it.
    let mut nowhere = create.clone();
    nowhere.name = "pvc-nowhere".into();
    nowhere.accessibility_requirements =
        Some(csi::TopologyRequirement { requisite: vec![topology("node-z")], preferred: vec![] });
    let refused = controller.create_volume(nowhere).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");

    // Per-node capacity: each node's own tmpfs, nothing on a node that does not exist.
    let (cap_a, cap_b) =
        (capacity(&mut controller, Some("node-a")).await, capacity(&mut controller, Some("node-b")).await);
    assert!(cap_b > 0 && cap_b as u64 <= TMPFS_BYTES, "node-b: {cap_b}");
    assert!(cap_a as u64 > TMPFS_BYTES && cap_a as u64 <= 2 * TMPFS_BYTES, "node-a: {cap_a}");
    assert_eq!(capacity(&mut controller, Some("node-z")).await, 0);
    let total = capacity(&mut controller, None).await;
    assert_eq!(total, cap_a + cap_b, "without a node: the sum");

    // The node side: B stages and publishes it, A has no such volume.
    let ctx = volume.volume_context.clone();
    let staging_a = a.home.join("staging");
    let refused = node_a.node_stage_volume(stage_req(&volume.volume_id, &ctx, &staging_a)).await.unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused:?}");
    let (staging, target) = (b.home.join("staging"), b.home.join("target"));
    node_b.node_stage_volume(stage_req(&volume.volume_id, &ctx, &staging)).await.unwrap();
    mounts.0.push(staging.clone());
    node_b
        .node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            target_path: target.to_string_lossy().into(),
            volume_capability: Some(mount_cap()),
            volume_context: ctx.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    mounts.0.push(target.clone());
    std::fs::write(target.join("hello"), b"from a pod on node-b").unwrap();
    assert_eq!(std::fs::read(b.root().join("volumes/pvc-local-1/hello")).unwrap(), b"from a pod on node-b");

    // Expansion and snapshots go to B.
    let expanded = controller
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: volume.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 2 << 20, limit_bytes: 0 }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(expanded.capacity_bytes, 2 << 20);
    let snap = controller
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: volume.volume_id.clone(),
            name: "snap-local-1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(snap.snapshot_id, "hostpath@node-b:default.snap-local-1");
    assert_eq!(snap.source_volume_id, volume.volume_id);
    assert!(b.root().join("snapshots/snap-local-1/hello").is_file());
    let got = controller
        .get_snapshot(csi::GetSnapshotRequest { snapshot_id: snap.snapshot_id.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.snapshot.unwrap().snapshot_id, snap.snapshot_id);
    // Every other call on the volume is forwarded to B too, and answered as B answers it.
    let validated = controller
        .validate_volume_capabilities(csi::ValidateVolumeCapabilitiesRequest {
            volume_id: volume.volume_id.clone(),
            volume_context: ctx.clone(),
            volume_capabilities: vec![mount_cap()],
            parameters: params("hostpath", &[]),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(validated.confirmed.is_some(), "{validated:?}");
    let status = controller
        .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: volume.volume_id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.volume.unwrap().volume_id, volume.volume_id);
    controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            node_id: "node-b".into(),
            volume_capability: Some(mount_cap()),
            volume_context: ctx.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            node_id: "node-b".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let of_volume = controller
        .list_snapshots(csi::ListSnapshotsRequest { source_volume_id: volume.volume_id.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let listed: Vec<_> = of_volume.entries.into_iter().map(|e| e.snapshot.unwrap().snapshot_id).collect();
    assert_eq!(listed, vec![snap.snapshot_id.clone()]);
    // ListVolumes and ListSnapshots through the controller cover every node's, page by page:
    // a second volume and snapshot on node A, listed one entry per page.
    let mut on_a = create.clone();
    on_a.name = "pvc-local-2".into();
    on_a.accessibility_requirements =
        Some(csi::TopologyRequirement { requisite: vec![topology("node-a")], preferred: vec![] });
    let on_a = controller.create_volume(on_a).await.unwrap().into_inner().volume.unwrap();
    assert_eq!(on_a.volume_id, "hostpath@node-a:default.pvc-local-2");
    let snap_a = controller
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: on_a.volume_id.clone(),
            name: "snap-local-2".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let mut volumes: Vec<_> = support::csi::list_volumes(&mut controller, 1)
        .await
        .into_iter()
        .map(|e| {
            let v = e.volume.unwrap();
            (v.volume_id, v.accessible_topology)
        })
        .collect();
    volumes.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        volumes,
        vec![(on_a.volume_id.clone(), vec![topology("node-a")]), (volume.volume_id.clone(), vec![topology("node-b")])]
    );
    let mut snapshots: Vec<_> = support::csi::list_snapshots(&mut controller, 1)
        .await
        .into_iter()
        .map(|e| e.snapshot.unwrap().snapshot_id)
        .collect();
    snapshots.sort();
    assert_eq!(snapshots, vec![snap_a.snapshot_id.clone(), snap.snapshot_id.clone()]);
    let forged = controller
        .list_volumes(csi::ListVolumesRequest { max_entries: 1, starting_token: "hostpath:+x".into() })
        .await
        .unwrap_err();
    assert_eq!(forged.code(), Code::Aborted, "{forged:?}");
    controller
        .delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap_a.snapshot_id.clone(), ..Default::default() })
        .await
        .unwrap();
    controller
        .delete_volume(csi::DeleteVolumeRequest { volume_id: on_a.volume_id.clone(), ..Default::default() })
        .await
        .unwrap();
    assert!(!a.root().join("volumes/pvc-local-2").exists());

    controller
        .delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id.clone(), ..Default::default() })
        .await
        .unwrap();
    assert!(!b.root().join("snapshots/snap-local-1").exists());

    // Unpublish, unstage, delete: gone from B.
    node_b
        .node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            target_path: target.to_string_lossy().into(),
        })
        .await
        .unwrap();
    node_b
        .node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: volume.volume_id.clone(),
            staging_target_path: staging.to_string_lossy().into(),
        })
        .await
        .unwrap();
    controller
        .delete_volume(csi::DeleteVolumeRequest { volume_id: volume.volume_id.clone(), ..Default::default() })
        .await
        .unwrap();
    assert!(!b.root().join("volumes/pvc-local-1").exists());
    assert!(!b.root().join("meta/pvc-local-1").exists());

    // A central backend through the same controller: made by the controller, no node pin.
    let central = controller
        .create_volume(csi::CreateVolumeRequest {
            name: "pvc-central-1".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 16 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![mount_cap()],
            parameters: params("replicated-block", &[("numberOfReplicas", "2")]),
            accessibility_requirements: create.accessibility_requirements.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap();
    assert!(central.volume_id.starts_with("replicated-block:"), "{}", central.volume_id);
    assert!(
        !central.accessible_topology.iter().any(|t| t.segments.contains_key(TOPOLOGY_NODE_KEY)),
        "{:?}",
        central.accessible_topology
    );
    controller
        .delete_volume(csi::DeleteVolumeRequest { volume_id: central.volume_id.clone(), ..Default::default() })
        .await
        .unwrap();

    // The peer endpoint: unsigned, or signed for another node, is refused before anything runs.
    let peer_b = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", b.peer_port)).unwrap();
    let mut direct = csi::controller_client::ControllerClient::new(peer_b.connect().await.unwrap());
    let delete = csi::DeleteVolumeRequest { volume_id: "hostpath@node-b:default.x".into(), ..Default::default() };
    let unsigned = direct.delete_volume(delete.clone()).await.unwrap_err();
    assert_eq!(unsigned.code(), Code::Unauthenticated, "{unsigned:?}");
    let signer = wasmcsi_csi::peer::auth::Signer::from_file(&private).unwrap();
    let mut for_a = tonic::Request::new(delete);
    for (k, v) in signer.sign("node-a", "/csi.v1.Controller/DeleteVolume") {
        for_a.metadata_mut().insert(k, v.parse().unwrap());
    }
    let misdirected = direct.delete_volume(for_a).await.unwrap_err();
    assert_eq!(misdirected.code(), Code::Unauthenticated, "{misdirected:?}");
    println!("two-node flow took {:?}", started.elapsed());
}
