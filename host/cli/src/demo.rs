//! `wasmcsi demo`: a local host (controller + node in one process) with the bundled
//! backends on a local socket, driving a real volume through the CSI socket end to end and
//! saying what it did. The README's first command runs this.
use crate::host::{Host, HostOptions, ReplicaOptions, connect};
use anyhow::Context;
use std::path::{Path, PathBuf};
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
    let host = Host::start(HostOptions {
        driver_name: "wasmcsi.io".into(),
        mode: wasmcsi_csi::Mode::All,
        node_id: "demo-node".into(),
        socket: dir.join("csi.sock"),
        config,
        config_file: None,
        backends_dir: Some(backends.clone()),
        state_dir: dir.join("state"),
        reload_interval: Duration::from_secs(2),
        metrics_addr: Some("127.0.0.1:0".parse()?),
        replicas: Some(ReplicaOptions { listen: "127.0.0.1:0".parse()?, root: dir.join("replicas"), labels: vec![] }),
        reconcile_interval: None,
    })
    .await?;
    if let Some(d) = &host.datapath {
        std::fs::write(&replica_nodes, format!("{}\n", d.local_addr()))?;
    }
    println!(
        "host serving CSI on {} with backends {:?}; metrics on http://{}/metrics",
        host.socket.display(),
        host.registry.names(),
        host.metrics_addr.map(|a| a.to_string()).unwrap_or_default()
    );
    let result = drive(&host.socket, &dir).await;
    let metrics = host.registry.runtime().metrics.encode();
    host.shutdown().await?;
    result?;
    let calls: Vec<&str> = metrics.lines().filter(|l| l.starts_with("wasmcsi_backend_calls_total")).collect();
    println!("backend calls made (from /metrics):");
    for l in calls {
        println!("  {l}");
    }
    println!("done: every step went through the CSI socket; nothing is left mounted.");
    Ok(())
}

async fn drive(socket: &Path, dir: &Path) -> anyhow::Result<()> {
    let channel = connect(socket).await?;
    let mut identity = IdentityClient::new(channel.clone());
    let mut ctl = ControllerClient::new(channel.clone());
    let mut node = NodeClient::new(channel);
    let mut n = 0;
    let cap = crate::check::mount_capability();
    let root = nix::unistd::geteuid().is_root();

    let t = Instant::now();
    let info = identity.get_plugin_info(csi::GetPluginInfoRequest {}).await?.into_inner();
    let ready = identity.probe(csi::ProbeRequest {}).await?.into_inner().ready.unwrap_or(false);
    step(&mut n, &format!("identity: {} {} ready={ready}", info.name, info.vendor_version), t);

    let t = Instant::now();
    let create = |name: &str, source: Option<csi::VolumeContentSource>| csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 64 << 20, limit_bytes: 0 }),
        volume_capabilities: vec![cap.clone()],
        parameters: [("backend".to_string(), "hostpath".to_string())].into_iter().collect(),
        volume_content_source: source,
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
    if root && Path::new("/dev/fuse").exists() {
        replicated(&mut ctl, &mut node, dir, &mut n).await?;
    } else {
        println!("      (not root or no /dev/fuse: skipping the replicated volume, whose device is FUSE + loop)");
    }
    let left = ctl.list_volumes(csi::ListVolumesRequest::default()).await?.into_inner().entries.len();
    anyhow::ensure!(left == 0, "{left} volumes left after delete");
    Ok(())
}

/// The flagship: a replicated block volume (one replica: the demo is one node), given to this
/// node by ControllerPublish, formatted and mounted by NodeStage, written, then taken apart.
async fn replicated(
    ctl: &mut ControllerClient<tonic::transport::Channel>,
    node: &mut NodeClient<tonic::transport::Channel>,
    dir: &Path,
    n: &mut u32,
) -> anyhow::Result<()> {
    let cap = crate::check::mount_capability();
    let t = Instant::now();
    let vol = ctl
        .create_volume(csi::CreateVolumeRequest {
            name: "demo-replicated".into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: 64 << 20, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            parameters: [("backend", "replicated-block"), ("numberOfReplicas", "1")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .volume
        .context("no volume")?;
    step(n, &format!("CreateVolume demo-replicated (64 MiB, backend replicated-block) -> {}", vol.volume_id), t);

    let t = Instant::now();
    let published = ctl
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: "demo-node".into(),
            volume_capability: Some(cap.clone()),
            volume_context: vol.volume_context.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let staging = dir.join("staging/demo-replicated");
    let target = dir.join("pods/pod-b/volume");
    node.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap.clone()),
        volume_context: vol.volume_context.clone(),
        publish_context: published.publish_context.clone(),
        ..Default::default()
    })
    .await?;
    node.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap.clone()),
        volume_context: vol.volume_context.clone(),
        publish_context: published.publish_context,
        ..Default::default()
    })
    .await?;
    std::fs::write(target.join("greeting.txt"), "hello from a replicated volume\n")?;
    step(n, "ControllerPublish + NodeStage (engine, FUSE + loop, ext4) + NodePublish; a \"pod\" wrote a file", t);

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
    ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        node_id: "demo-node".into(),
        ..Default::default()
    })
    .await?;
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: vol.volume_id, ..Default::default() }).await?;
    step(n, "NodeUnpublish + NodeUnstage + ControllerUnpublish + DeleteVolume -> gone", t);
    Ok(())
}
