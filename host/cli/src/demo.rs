//! `wasmcsi demo`: a local controller and node plugin (two hosts in this process, each on its
//! own CSI socket) with the bundled backends, driving a real volume through the CSI sockets end
//! to end and saying what it did; then a replicated block volume on three replica nodes (this
//! node and two child processes, one of which is killed with SIGKILL on the way, see
//! [`replicated`]). The README's first command runs this.
//!
//! Every network channel runs as a cluster's does: mutual TLS (`required`), with a CA of the
//! demo's own (what `wasmcsi pki init` makes) and a certificate per process (`wasmcsi pki
//! issue`): the controller's calls to the node plugin's peer endpoint (hostpath is node-local)
//! and to the replica servers, the engines' sessions (each with the controller's grant of its
//! volume to this node, from ControllerPublish), the node's grant renewals at the controller's
//! authority endpoint.
//!
//! Whatever happens — a failed step, Ctrl-C — the demo takes apart what it made before it
//! returns: every volume it staged is unstaged (recorded in [`Staged`] before each NodeStage),
//! every volume and snapshot deleted, the host stopped (engines, FUSE, loop devices), the
//! child processes killed, and it fails if a mount or loop device of its work directory is
//! left.
use crate::host::{DataPathPlace, Host, HostOptions, PeerOptions, ReplicaOptions, connect};
use crate::replica_process::{ReplicaProcess, free_loopback_addr};
use crate::trust::TrustOptions;
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::{
    controller_client::ControllerClient, identity_client::IdentityClient, node_client::NodeClient,
};

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Work directory (socket, state, volumes); a fresh temporary one by default.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

mod replicated;

/// The node id of the demo's own node (node plugin and a replica server).
const NODE_ID: &str = "demo-node";
/// The replica nodes started as child processes.
const REPLICA_NODES: [&str; 2] = ["replica-node-b", "replica-node-c"];

/// The demo's CA (`pki/ca`, as `wasmcsi pki init` writes it) and a credentials directory per
/// process (`pki/NAME`, as `wasmcsi pki issue` writes them).
fn make_pki(dir: &Path) -> anyhow::Result<()> {
    use wasmcsi_trust::pki::{DEFAULT_CA_VALIDITY, DEFAULT_LEAF_VALIDITY};
    use wasmcsi_trust::{Authority, Role, Validity};
    let ca = Authority::generate(Validity::starting_now(DEFAULT_CA_VALIDITY))?;
    ca.save(&dir.join("ca"))?;
    let roles = std::iter::once(("controller".to_owned(), Role::Controller))
        .chain(std::iter::once(NODE_ID).chain(REPLICA_NODES).map(|n| (n.to_owned(), Role::Node(n.to_owned()))));
    for (name, role) in roles {
        ca.issue(&role, Validity::starting_now(DEFAULT_LEAF_VALIDITY))?.write(&dir.join(name), ca.bundle())?;
    }
    Ok(())
}

/// What the demo staged on its node (volume id, staging path, target path), recorded before
/// each NodeStage, so that the cleanup finds it even when a call was cut short.
#[derive(Default, Clone)]
struct Staged(Arc<Mutex<Vec<(String, PathBuf, PathBuf)>>>);

impl Staged {
    fn record(&self, volume_id: &str, staging: &Path, target: &Path) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push((
            volume_id.to_owned(),
            staging.to_owned(),
            target.to_owned(),
        ));
    }

    fn all(&self) -> Vec<(String, PathBuf, PathBuf)> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

fn step(n: &mut u32, what: &str, started: Instant) {
    *n += 1;
    println!("  {:>2}. {what}  ({:.1} ms)", n, started.elapsed().as_secs_f64() * 1e3);
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let scratch = tempfile::tempdir()?;
    let dir = args.dir.unwrap_or_else(|| scratch.path().to_path_buf());
    let (backends, root) = (dir.join("backends"), dir.join("hostpath-root"));
    std::fs::create_dir_all(&backends)?;
    std::fs::create_dir_all(&root)?;
    // The demo grants a dir root to hostpath and this node's own replica server to
    // replicated-block: nfs needs an export granted, ceph-rbd-shim a Ceph pool.
    let granted = |stem: &str| !matches!(stem, "nfs" | "ceph-rbd-shim");
    for (stem, bytes) in wasmcsi_artifacts::bundled().filter(|(stem, _)| granted(stem)) {
        std::fs::write(backends.join(format!("{stem}.wasm")), bytes)?;
    }
    // The replica server's port is known once it listens: the grant names a file of
    // addresses, written then (discovery re-reads it).
    let replica_nodes = dir.join("replica-nodes");
    std::fs::write(&replica_nodes, "")?;
    let config = wasmcsi_runtime::config::HostConfig::parse(
        &format!(
            "[backends.hostpath.grants]\ndir = {{ default = {:?} }}\n\
             [backends.replicated-block.grants.block]\nnodes_file = {:?}\n",
            root.display().to_string(),
            replica_nodes.display().to_string()
        ),
        Path::new("demo"),
    )?;
    println!("wasmcsi demo — work dir {}", dir.display());
    let t = Instant::now();
    let pki = dir.join("pki");
    make_pki(&pki)?;
    println!(
        "made a CA ({}/ca, as `wasmcsi pki init`) and a certificate for the controller, {NODE_ID} and {} ({:.0} ms)",
        pki.display(),
        REPLICA_NODES.join(", "),
        t.elapsed().as_secs_f64() * 1e3
    );
    let required = Some(wasmcsi_trust::TlsMode::Required);
    // The node plugin's peer endpoint is where the controller sends hostpath's calls: known
    // before either starts.
    let peer_addr = free_loopback_addr().context("finding a free loopback port")?;
    let options = |mode, node_id: &str, socket: &str, state: &str| HostOptions {
        driver_name: "wasmcsi.io".into(),
        mode,
        node_id: node_id.into(),
        socket: dir.join(socket),
        config: config.clone(),
        config_file: None,
        backends_dir: Some(backends.clone()),
        state_dir: dir.join(state),
        reload_interval: Duration::from_secs(2),
        metrics_addr: None,
        replicas: None,
        reconcile: None,
    };
    let controller = Host::start_with_trust(
        options(wasmcsi_csi::Mode::Controller, "demo-controller", "controller.sock", "controller-state"),
        DataPathPlace::InProcess,
        PeerOptions {
            listen: None,
            sources: wasmcsi_csi::peer::PeerSources {
                nodes: [(NODE_ID.to_owned(), peer_addr.to_string())].into_iter().collect(),
                services: vec![],
            },
            // The node directory: the demo's one node (its replica nodes answer for themselves).
            known_nodes: vec![NODE_ID.to_owned()],
        },
        TrustOptions {
            tls_mode: required,
            tls_dir: Some(pki.join("controller")),
            authority_listen: Some("127.0.0.1:0".parse()?),
            ..Default::default()
        },
    )
    .await?;
    let authority = controller.trust.authority_addr.context("the controller serves no authority endpoint")?;
    let host = Host::start_with_trust(
        HostOptions {
            metrics_addr: Some("127.0.0.1:0".parse()?),
            replicas: Some(ReplicaOptions {
                listen: "127.0.0.1:0".parse()?,
                root: dir.join("replicas"),
                disks: vec![],
                labels: vec![],
            }),
            ..options(wasmcsi_csi::Mode::Node, NODE_ID, "csi.sock", "state")
        },
        DataPathPlace::InProcess,
        PeerOptions { listen: Some(peer_addr), ..Default::default() },
        TrustOptions {
            tls_mode: required,
            tls_dir: Some(pki.join(NODE_ID)),
            authority: Some(format!("https://{authority}")),
            ..Default::default()
        },
    )
    .await?;
    println!(
        "controller serving CSI on {} (authority endpoint on {authority}); node plugin {NODE_ID} on {} \
         (peer endpoint on {peer_addr}) with backends {:?}; metrics on http://{}/metrics; every channel mutual TLS",
        controller.socket.display(),
        host.socket.display(),
        host.registry.names(),
        host.metrics_addr.map(|a| a.to_string()).unwrap_or_default()
    );
    // Two more replica nodes, as processes, for the replicated volume's three replicas.
    let replicated = nix::unistd::geteuid().is_root() && Path::new("/dev/fuse").exists();
    let mut replicas = Vec::new();
    let staged = Staged::default();
    let work = async {
        if replicated {
            let exe = std::env::current_exe().context("finding this binary to start replica nodes")?;
            for name in REPLICA_NODES {
                let t = Instant::now();
                let node = ReplicaProcess::start_with_tls(&exe, &dir.join(name), name, Some(&pki.join(name))).await?;
                println!(
                    "started {name} (pid {}, replicas on {}) in {:.0} ms",
                    node.pid().unwrap_or_default(),
                    node.addr(),
                    t.elapsed().as_secs_f64() * 1e3
                );
                replicas.push(node);
            }
        }
        let addrs = host.datapath.iter().map(|d| d.local_addr()).chain(replicas.iter().map(ReplicaProcess::addr));
        std::fs::write(&replica_nodes, addrs.map(|a| format!("{a}\n")).collect::<String>())?;
        drive(&controller, &host, &dir, &staged, &mut replicas).await
    };
    let result = tokio::select! {
        r = work => r,
        r = tokio::signal::ctrl_c() => match r {
            Ok(()) => Err(anyhow::anyhow!("interrupted")),
            Err(e) => Err(anyhow::Error::from(e).context("waiting for Ctrl-C")),
        },
    };
    if let Err(e) = &result {
        println!("demo stopped: {e:#}; taking apart what it made");
        // A node killed on the way comes back, so its replicas can be deleted too.
        for node in replicas.iter_mut().filter(|r| r.pid().is_none()) {
            if let Err(e) = node.restart().await {
                println!("  restarting {}: {e:#}", node.name());
            }
        }
        for problem in cleanup(&controller.socket, &host.socket, &staged).await {
            println!("  {problem}");
        }
    }
    let metrics = [&controller, &host].map(|h| h.registry.runtime().metrics.encode()).join("");
    let stopped = host.shutdown().await;
    let stopped = controller.shutdown().await.and(stopped);
    drop(replicas);
    let left = leftovers(&dir);
    result?;
    stopped?;
    anyhow::ensure!(left.is_empty(), "left behind: {}", left.join("; "));
    let calls: Vec<&str> = metrics.lines().filter(|l| l.starts_with("wasmcsi_backend_calls_total")).collect();
    println!("backend calls made (from the controller's and the node plugin's /metrics):");
    for l in calls {
        println!("  {l}");
    }
    println!(
        "done: every step went through the CSI sockets, every network channel over mutual TLS; nothing is left mounted."
    );
    Ok(())
}

/// Best effort, after a failure: unpublish and unstage everything the demo staged, then delete
/// every volume and snapshot the host lists (they are all the demo's; volumes first, since a
/// clone being filled holds its snapshot). Returns what failed.
async fn cleanup(controller: &Path, node: &Path, staged: &Staged) -> Vec<String> {
    let mut problems = Vec::new();
    let (ctl, node) = match (connect(controller).await, connect(node).await) {
        (Ok(c), Ok(n)) => (c, n),
        (Err(e), _) | (_, Err(e)) => return vec![format!("{e:#}")],
    };
    let mut ctl = ControllerClient::new(ctl);
    let node = NodeClient::new(node);
    for (volume_id, staging, target) in staged.all().into_iter().rev() {
        let unpublish =
            csi::NodeUnpublishVolumeRequest { volume_id: volume_id.clone(), target_path: target.display().to_string() };
        if let Err(e) = patiently(|| {
            let (mut client, request) = (node.clone(), unpublish.clone());
            async move { client.node_unpublish_volume(request).await }
        })
        .await
        {
            problems.push(format!("NodeUnpublishVolume {volume_id}: {}", e.message()));
        }
        let unstage = csi::NodeUnstageVolumeRequest {
            volume_id: volume_id.clone(),
            staging_target_path: staging.display().to_string(),
        };
        if let Err(e) = patiently(|| {
            let (mut client, request) = (node.clone(), unstage.clone());
            async move { client.node_unstage_volume(request).await }
        })
        .await
        {
            problems.push(format!("NodeUnstageVolume {volume_id}: {}", e.message()));
        }
    }
    if let Ok(list) = ctl.list_volumes(csi::ListVolumesRequest::default()).await {
        for v in list.into_inner().entries.into_iter().filter_map(|e| e.volume) {
            // Backends without ControllerPublish answer it as unsupported: nothing to undo.
            let unpublish = csi::ControllerUnpublishVolumeRequest {
                volume_id: v.volume_id.clone(),
                node_id: NODE_ID.into(),
                ..Default::default()
            };
            let _ = patiently(|| {
                let (mut client, request) = (ctl.clone(), unpublish.clone());
                async move { client.controller_unpublish_volume(request).await }
            })
            .await;
            let req = csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), ..Default::default() };
            if let Err(e) = patiently(|| {
                let (mut client, request) = (ctl.clone(), req.clone());
                async move { client.delete_volume(request).await }
            })
            .await
            {
                problems.push(format!("DeleteVolume {}: {}", v.volume_id, e.message()));
            }
        }
    }
    if let Ok(list) = ctl.list_snapshots(csi::ListSnapshotsRequest::default()).await {
        for s in list.into_inner().entries.into_iter().filter_map(|e| e.snapshot) {
            let req = csi::DeleteSnapshotRequest { snapshot_id: s.snapshot_id.clone(), ..Default::default() };
            if let Err(e) = patiently(|| {
                let (mut client, request) = (ctl.clone(), req.clone());
                async move { client.delete_snapshot(request).await }
            })
            .await
            {
                problems.push(format!("DeleteSnapshot {}: {}", s.snapshot_id, e.message()));
            }
        }
    }
    problems
}

/// Retries a call the host answers ABORTED (the same volume's call cut short by the failure is
/// still running there) for up to 30 s.
async fn patiently<T, F, Fut>(call: F) -> Result<T, tonic::Status>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match call().await {
            Err(s) if s.code() == tonic::Code::Aborted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            r => return r.map(tonic::Response::into_inner),
        }
    }
}

/// Mounts under `dir` and loop devices whose backing file is under it, as `/proc/self/mounts`
/// and sysfs show them.
fn leftovers(dir: &Path) -> Vec<String> {
    let prefix = format!("{}/", dir.display());
    let mut left: Vec<String> = std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(1))
        .filter(|m| m.starts_with(&prefix))
        .map(|m| format!("mount {m}"))
        .collect();
    for entry in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
        let backing = std::fs::read_to_string(entry.path().join("loop/backing_file")).unwrap_or_default();
        if backing.starts_with(&prefix) {
            left.push(format!("/dev/{} on {}", entry.file_name().to_string_lossy(), backing.trim()));
        }
    }
    left
}

async fn drive(
    controller: &Host,
    host: &Host,
    dir: &Path,
    staged: &Staged,
    replicas: &mut [ReplicaProcess],
) -> anyhow::Result<()> {
    let channel = connect(&controller.socket).await?;
    let mut identity = IdentityClient::new(channel.clone());
    let mut ctl = ControllerClient::new(channel);
    let mut node = NodeClient::new(connect(&host.socket).await?);
    let mut n = 0;
    let cap = crate::check::mount_capability();
    let root = nix::unistd::geteuid().is_root();

    let t = Instant::now();
    let info = identity.get_plugin_info(csi::GetPluginInfoRequest {}).await?.into_inner();
    let ready = identity.probe(csi::ProbeRequest {}).await?.into_inner().ready.unwrap_or(false);
    step(&mut n, &format!("identity: {} {} ready={ready}", info.name, info.vendor_version), t);

    let on_this_node = csi::Topology {
        segments: [(wasmcsi_csi::plugin::TOPOLOGY_NODE_KEY.to_owned(), NODE_ID.to_owned())].into_iter().collect(),
    };
    let t = Instant::now();
    let create = |name: &str, source: Option<csi::VolumeContentSource>| csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 64 << 20, limit_bytes: 0 }),
        volume_capabilities: vec![cap.clone()],
        parameters: [("backend".to_string(), "hostpath".to_string())].into_iter().collect(),
        volume_content_source: source,
        // hostpath is node-local: on this node (the controller forwards to its peer endpoint).
        accessibility_requirements: Some(csi::TopologyRequirement {
            requisite: vec![on_this_node.clone()],
            preferred: vec![on_this_node.clone()],
        }),
        ..Default::default()
    };
    let vol = ctl.create_volume(create("demo-volume", None)).await?.into_inner().volume.context("no volume")?;
    step(&mut n, &format!("CreateVolume demo-volume (64 MiB, backend hostpath) -> {}", vol.volume_id), t);

    let t = Instant::now();
    let again = ctl.create_volume(create("demo-volume", None)).await?.into_inner().volume.context("no volume")?;
    anyhow::ensure!(again.volume_id == vol.volume_id, "retry returned another volume");
    step(&mut n, "CreateVolume retried with the same name -> the same volume (idempotent)", t);

    let staging = dir.join("staging/demo-volume");
    let target = dir.join("pods/pod-a/volume");
    let marker = "hello from a pod, through wasmcsi\n";
    if root {
        let t = Instant::now();
        staged.record(&vol.volume_id, &staging, &target);
        node.node_stage_volume(csi::NodeStageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            volume_context: vol.volume_context.clone(),
            ..Default::default()
        })
        .await?;
        node.node_publish_volume(csi::NodePublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(cap.clone()),
            volume_context: vol.volume_context.clone(),
            ..Default::default()
        })
        .await?;
        step(&mut n, &format!("NodeStageVolume + NodePublishVolume -> bind mounts at {}", target.display()), t);
        let t = Instant::now();
        std::fs::write(target.join("greeting.txt"), marker)?;
        step(&mut n, "a \"pod\" wrote greeting.txt into the published volume", t);
    } else {
        println!(
            "      (not root: skipping stage/publish, which need mounts; the file is written into the volume directory instead)"
        );
        std::fs::write(dir.join("hostpath-root/volumes/demo-volume/greeting.txt"), marker)?;
    }

    let t = Instant::now();
    let snap = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: vol.volume_id.clone(),
            name: "demo-snap".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .context("no snapshot")?;
    step(
        &mut n,
        &format!("CreateSnapshot -> {} ({} bytes, ready={})", snap.snapshot_id, snap.size_bytes, snap.ready_to_use),
        t,
    );

    let t = Instant::now();
    let source = csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: snap.snapshot_id.clone(),
        })),
    };
    let restored =
        ctl.create_volume(create("demo-restored", Some(source))).await?.into_inner().volume.context("no volume")?;
    let copy = std::fs::read_to_string(dir.join("hostpath-root/volumes/demo-restored/greeting.txt"))?;
    anyhow::ensure!(copy == marker, "the restored volume does not hold the snapshot's data");
    step(&mut n, &format!("CreateVolume from the snapshot -> {} holds greeting.txt", restored.volume_id), t);

    let t = Instant::now();
    let grown = ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 128 << 20, limit_bytes: 0 }),
            ..Default::default()
        })
        .await?
        .into_inner();
    step(&mut n, &format!("ControllerExpandVolume -> {} MiB (online)", grown.capacity_bytes >> 20), t);

    if root {
        let t = Instant::now();
        let stats = node
            .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
                volume_id: vol.volume_id.clone(),
                volume_path: target.display().to_string(),
                ..Default::default()
            })
            .await?
            .into_inner();
        let bytes = stats.usage.first().map(|u| (u.used, u.total)).unwrap_or_default();
        step(
            &mut n,
            &format!(
                "NodeGetVolumeStats -> {} of {} bytes used, condition {:?}",
                bytes.0,
                bytes.1,
                stats.volume_condition.map(|c| c.message)
            ),
            t,
        );
        let t = Instant::now();
        node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            target_path: target.display().to_string(),
        })
        .await?;
        node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await?;
        step(&mut n, "NodeUnpublishVolume + NodeUnstageVolume -> unmounted", t);
    }

    let t = Instant::now();
    ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id, ..Default::default() }).await?;
    for v in [&vol.volume_id, &restored.volume_id] {
        ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.clone(), ..Default::default() }).await?;
    }
    step(&mut n, "DeleteSnapshot + DeleteVolume x2 -> gone", t);
    if root && Path::new("/dev/fuse").exists() && replicas.len() == 2 {
        replicated::run(host, &mut ctl, &mut node, dir, staged, replicas, &mut n).await?;
    } else {
        println!("      (not root or no /dev/fuse: skipping the replicated volume, whose device is FUSE + loop)");
    }
    let left = ctl.list_volumes(csi::ListVolumesRequest::default()).await?.into_inner().entries.len();
    anyhow::ensure!(left == 0, "{left} volumes left after delete");
    Ok(())
}
