//! A node-local backend (hostpath) in a two-node cluster, every part a real `wasmcsi serve`
//! process: node plugins A and B (each its own dir root, state and socket; each root a tmpfs of
//! its own, of different sizes, so capacity differs per node and nothing else on the machine
//! changes it) serving their peer endpoints on loopback over mutual TLS (credentials from
//! `wasmcsi pki`), and a controller forwarding node-local calls to them.
//!
//! CreateVolume for node B through the controller makes the directory on B's root only and
//! answers B's topology and an id naming B; NodeStage/Publish on B work and the data lands in
//! B's root, on A NodeStage is NOT_FOUND; expand and snapshots reach B; GetCapacity answers per
//! node (B's tmpfs, A's, nothing for a node that does not exist); DeleteVolume removes it
//! from B. A central backend (replicated-block, replicas on both nodes) is served by the same
//! controller unpinned. A node's peer endpoint refuses a plaintext client, a node's certificate
//! and a certificate of another CA before any request is read (its `/metrics` counts them); a
//! record altered in flight (through a forwarding proxy) is a TLS error and the call it carried
//! never runs; the bytes of a real call replayed on a new connection run nothing. Runs as root
//! (tmpfs and bind mounts); takes a few seconds.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test")]

use crate::support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::process::{BIN, Proc};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tonic::Code;
use wasmcsi_csi::plugin::TOPOLOGY_NODE_KEY;
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_trust::{Credentials, ExpectedRole, LiveCredentials};

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
async fn a_node_local_volume_lives_on_its_node_over_a_peer_channel_only_the_controller_gets_through() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let tls = |name: &str| base.join(format!("tls-{name}"));
    pki(&["init", "--dir", &base.join("ca").to_string_lossy()]);
    for (role, name) in [("--node", Some("node-a")), ("--node", Some("node-b")), ("--controller", None)] {
        let mut args = vec!["issue".to_string(), "--ca".into(), base.join("ca").to_string_lossy().into(), role.into()];
        args.extend(name.map(String::from));
        args.extend(["--out".into(), tls(name.unwrap_or("controller")).to_string_lossy().into()]);
        pki(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }
    // A CA nobody trusts, and a "controller" of it.
    pki(&["init", "--dir", &base.join("stranger-ca").to_string_lossy()]);
    pki(&[
        "issue",
        "--ca",
        &base.join("stranger-ca").to_string_lossy(),
        "--controller",
        "--out",
        &tls("stranger").to_string_lossy(),
    ]);
    // It trusts the cluster's CA too, so it accepts node B's certificate: what refuses it is the
    // server, not its own verifier.
    let bundle = [base.join("stranger-ca/ca.crt"), base.join("ca/ca.crt")].map(|f| std::fs::read_to_string(f).unwrap());
    std::fs::write(tls("stranger").join("ca.crt"), bundle.concat()).unwrap();
    let metrics_b = free_port();

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
            "--tls-dir".into(),
            tls(&node.name).to_string_lossy().into(),
            "--metrics-addr".into(),
            format!("127.0.0.1:{}", if node.name == "node-b" { metrics_b } else { free_port() }),
            "--replica-listen".into(),
            format!("127.0.0.1:{}", node.replica_port),
            "--replica-root".into(),
            node.home.join("replicas").to_string_lossy().into(),
        ];
        node.start(&config, &extra);
    }
    let config = ctl.write_config(&replicas);
    ctl.start(
        &config,
        &[
            "--mode".into(),
            "controller".into(),
            "--tls-dir".into(),
            tls("controller").to_string_lossy().into(),
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

    // The peer endpoint over TLS, attacked: a volume on B that no refused call may touch.
    let mut victim = create.clone();
    victim.name = "pvc-victim".into();
    victim.accessibility_requirements =
        Some(csi::TopologyRequirement { requisite: vec![topology("node-b")], preferred: vec![] });
    let victim = controller.create_volume(victim).await.unwrap().into_inner().volume.unwrap();
    let victim_dir = b.root().join("volumes/pvc-victim");
    assert!(victim_dir.is_dir());
    let delete_victim = csi::DeleteVolumeRequest { volume_id: victim.volume_id.clone(), ..Default::default() };
    let peer_b = format!("127.0.0.1:{}", b.peer_port);
    let mut refusals = handshakes_refused(metrics_b).await;
    // Each attempt below is refused in its TLS handshake, before a byte of a request is read:
    // the endpoint's `/metrics` counts one more failed handshake.
    let mut refused_in_handshake = async |what: &str| {
        // The server counts a refusal right after it sends its alert: poll a little.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let now = handshakes_refused(metrics_b).await;
            if now > refusals {
                refusals = now;
                return;
            }
            assert!(Instant::now() < deadline, "{what}: no failed handshake counted (still {now})");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };

    // A plaintext client (what a controller with --tls-mode off sends).
    let plain = wasmcsi_csi::peer::channel(&peer_b, &Transport::Plain, ExpectedRole::AnyNode, CALL, None).unwrap();
    let refused = Controller::new(plain).delete_volume(delete_victim.clone()).await.unwrap_err();
    println!("plaintext client: {refused:?}");
    refused_in_handshake("a plaintext client").await;
    // A node's certificate (A's, valid, of the cluster's CA), and a "controller" of another CA.
    for who in ["node-a", "stranger"] {
        let transport = Transport::Required(live(&tls(who)));
        let channel = wasmcsi_csi::peer::channel(&peer_b, &transport, ExpectedRole::AnyNode, CALL, None).unwrap();
        let refused = Controller::new(channel).delete_volume(delete_victim.clone()).await.unwrap_err();
        println!("{who}'s certificate: {refused:?}");
        refused_in_handshake(who).await;
    }
    assert!(victim_dir.is_dir(), "a refused client deleted the volume");

    // The controller's own calls through a proxy that can alter a record in flight.
    let ctl_transport = Transport::Required(live(&tls("controller")));
    let proxy = Proxy::start(&peer_b).await;
    let through =
        wasmcsi_csi::peer::channel(&proxy.addr, &ctl_transport, ExpectedRole::Node("node-b".into()), CALL, None)
            .unwrap();
    let info = Identity::new(through.clone()).get_plugin_info(csi::GetPluginInfoRequest {}).await.unwrap();
    assert_eq!(info.into_inner().manifest.get("node").map(String::as_str), Some("node-b"));
    proxy.tamper.store(true, Ordering::SeqCst);
    let altered = Controller::new(through).delete_volume(delete_victim.clone()).await.unwrap_err();
    println!("a record altered in flight: {altered:?}");
    assert!(!proxy.tamper.load(Ordering::SeqCst), "the proxy altered no record");
    assert!(victim_dir.is_dir(), "the altered call ran");

    // A real call's bytes, captured, then replayed to the endpoint on a new connection.
    let recorded =
        wasmcsi_csi::peer::channel(&proxy.addr, &ctl_transport, ExpectedRole::Node("node-b".into()), CALL, None)
            .unwrap();
    let mut replayed = create.clone();
    replayed.name = "pvc-replayed".into();
    replayed.accessibility_requirements = None;
    let made = Controller::new(recorded).create_volume(replayed.clone()).await.unwrap().into_inner().volume.unwrap();
    let replayed_dir = b.root().join("volumes/pvc-replayed");
    assert!(replayed_dir.is_dir(), "the recorded call made its volume");
    let direct =
        wasmcsi_csi::peer::channel(&peer_b, &ctl_transport, ExpectedRole::Node("node-b".into()), CALL, None).unwrap();
    Controller::new(direct.clone())
        .delete_volume(csi::DeleteVolumeRequest { volume_id: made.volume_id, ..Default::default() })
        .await
        .unwrap();
    assert!(!replayed_dir.exists());
    let capture = proxy.last_capture();
    assert!(capture.len() > 1000, "captured {} bytes", capture.len());
    let mut replay = tokio::net::TcpStream::connect(&peer_b).await.unwrap();
    let _ = replay.write_all(&capture).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), replay.read_to_end(&mut answer)).await;
    assert!(!replayed_dir.exists(), "the replayed call made its volume again");
    refused_in_handshake("the replayed session").await;

    // The same call, unaltered and from the controller, runs: the refusals above were the attack's.
    Controller::new(direct).delete_volume(delete_victim).await.unwrap();
    assert!(!victim_dir.exists());
    let scraped = scrape(metrics_b).await;
    let expiry = metric(&scraped, "wasmcsi_tls_certificate_expiry_seconds{role=\"node\"}");
    assert!(expiry > 23.0 * 3600.0 && expiry <= 24.0 * 3600.0, "{expiry}");
    assert!(metric(&scraped, "wasmcsi_listener_connections{listener=\"metrics\"}") >= 1.0, "{scraped}");
    println!("two-node flow took {:?}", started.elapsed());
}

/// How long a call of the test's own clients may take.
const CALL: Duration = Duration::from_secs(10);

type Controller = csi::controller_client::ControllerClient<tonic::transport::Channel>;
type Identity = csi::identity_client::IdentityClient<tonic::transport::Channel>;
use wasmcsi_block::transport::Transport;

/// `wasmcsi pki ARGS`, which must succeed.
fn pki(args: &[&str]) {
    let status = std::process::Command::new(BIN).arg("pki").args(args).status().unwrap();
    assert!(status.success(), "pki {args:?}");
}

fn live(dir: &Path) -> LiveCredentials {
    LiveCredentials::new(Credentials::load(dir).unwrap())
}

/// GET /metrics on `port`: the body.
async fn scrape(port: u16) -> String {
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut reply = String::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_string(&mut reply)).await.unwrap().unwrap();
    reply
}

/// The value of the sample `series` (name and labels, exactly) in `text`.
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
        .parse()
        .unwrap()
}

/// The peer endpoint's failed TLS handshakes, as node B's `/metrics` counts them.
async fn handshakes_refused(port: u16) -> f64 {
    metric(&scrape(port).await, "wasmcsi_listener_refusals_total{listener=\"peer\",reason=\"handshake_failed\"}")
}

/// A TCP proxy in front of `upstream` that records what each client sends and, when `tamper` is
/// set, flips one bit of the next TLS application-data record a client sends (then clears it).
struct Proxy {
    addr: String,
    tamper: Arc<AtomicBool>,
    captures: Arc<Mutex<Vec<Capture>>>,
    task: tokio::task::JoinHandle<()>,
}

/// What one client sent through the proxy.
type Capture = Arc<Mutex<Vec<u8>>>;

/// A TLS record's header: type (1), version (2), length (2).
const RECORD_HEADER: usize = 5;
const APPLICATION_DATA: u8 = 0x17;

impl Proxy {
    async fn start(upstream: &str) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let tamper = Arc::new(AtomicBool::new(false));
        let captures: Arc<Mutex<Vec<Capture>>> = Arc::default();
        let (upstream, flag, all) = (upstream.to_owned(), tamper.clone(), captures.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
                let capture = Arc::new(Mutex::new(Vec::new()));
                all.lock().unwrap().push(capture.clone());
                let (mut client_rd, mut client_wr) = client.into_split();
                let (mut server_rd, mut server_wr) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut server_rd, &mut client_wr).await;
                    let _ = client_wr.shutdown().await;
                });
                let flag = flag.clone();
                tokio::spawn(async move {
                    // Client to server, one whole record at a time.
                    let mut pending = Vec::new();
                    let mut chunk = vec![0u8; 64 * 1024];
                    loop {
                        let n = match client_rd.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        capture.lock().unwrap().extend_from_slice(&chunk[..n]);
                        pending.extend_from_slice(&chunk[..n]);
                        while pending.len() >= RECORD_HEADER {
                            let len = usize::from(u16::from_be_bytes([pending[3], pending[4]]));
                            if pending.len() < RECORD_HEADER + len {
                                break;
                            }
                            let mut record: Vec<u8> = pending.drain(..RECORD_HEADER + len).collect();
                            if record[0] == APPLICATION_DATA && len > 0 && flag.swap(false, Ordering::SeqCst) {
                                // Inside the ciphertext: the framing stays valid, the AEAD tag does not.
                                record[RECORD_HEADER + len / 2] ^= 0x01;
                            }
                            if server_wr.write_all(&record).await.is_err() {
                                return;
                            }
                        }
                    }
                    let _ = server_wr.shutdown().await;
                });
            }
        });
        Proxy { addr, tamper, captures, task }
    }

    /// Everything the last client to connect sent.
    fn last_capture(&self) -> Vec<u8> {
        self.captures.lock().unwrap().last().map(|c| c.lock().unwrap().clone()).unwrap_or_default()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
