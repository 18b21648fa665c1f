//! The demo's replicated part: a volume of three replicas — this process's node (the engine
//! and its local replica) and two replica nodes as child processes — driven through the CSI
//! socket while one of the replica nodes is killed with SIGKILL and comes back.
use crate::host::Host;
use crate::replica_process::ReplicaProcess;
use anyhow::Context;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::{controller_client::ControllerClient, node_client::NodeClient};

use super::{NODE_ID, Staged, step};

type Ctl = ControllerClient<tonic::transport::Channel>;
type Node = NodeClient<tonic::transport::Channel>;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 256 * MIB;
const GROWN: u64 = 512 * MIB;
/// Files the "pod" keeps rewriting (1 MiB each, fsynced): bounded, so the demo writes at most
/// this much however long the outage lasts.
const FILES: u64 = 32;
/// How long the volume may take to be healthy again after the replica node restarts.
const HEAL_TIMEOUT: Duration = Duration::from_secs(120);

/// A volume staged and published on this node, as the demo recorded it.
struct Mounted {
    volume: csi::Volume,
    staging: PathBuf,
    target: PathBuf,
    publish_context: std::collections::HashMap<String, String>,
}

fn params() -> std::collections::HashMap<String, String> {
    [("backend", "replicated-block"), ("numberOfReplicas", "3")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn create_request(name: &str, source: Option<csi::VolumeContentSource>) -> csi::CreateVolumeRequest {
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: SIZE as i64, limit_bytes: 0 }),
        volume_capabilities: vec![crate::check::mount_capability()],
        parameters: params(),
        volume_content_source: source,
        ..Default::default()
    }
}

/// ControllerPublish to this node, NodeStage (recorded first, so the demo's cleanup finds it
/// even when interrupted half-way) and NodePublish.
async fn mount(
    ctl: &mut Ctl,
    node: &mut Node,
    staged: &Staged,
    volume: &csi::Volume,
    dir: &Path,
    pod: &str,
) -> anyhow::Result<Mounted> {
    let cap = crate::check::mount_capability();
    let publish_context = ctl
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: volume.volume_id.clone(),
            node_id: NODE_ID.into(),
            volume_capability: Some(cap.clone()),
            volume_context: volume.volume_context.clone(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .publish_context;
    let m = Mounted {
        volume: volume.clone(),
        staging: dir.join("staging").join(pod),
        target: dir.join("pods").join(pod).join("volume"),
        publish_context,
    };
    staged.record(&volume.volume_id, &m.staging, &m.target);
    stage(node, &m).await?;
    Ok(m)
}

async fn stage(node: &mut Node, m: &Mounted) -> anyhow::Result<()> {
    let cap = crate::check::mount_capability();
    node.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: m.volume.volume_id.clone(),
        staging_target_path: m.staging.display().to_string(),
        volume_capability: Some(cap.clone()),
        volume_context: m.volume.volume_context.clone(),
        publish_context: m.publish_context.clone(),
        ..Default::default()
    })
    .await?;
    node.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: m.volume.volume_id.clone(),
        staging_target_path: m.staging.display().to_string(),
        target_path: m.target.display().to_string(),
        volume_capability: Some(cap),
        volume_context: m.volume.volume_context.clone(),
        publish_context: m.publish_context.clone(),
        ..Default::default()
    })
    .await?;
    Ok(())
}

async fn unstage(node: &mut Node, m: &Mounted) -> anyhow::Result<()> {
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: m.volume.volume_id.clone(),
        target_path: m.target.display().to_string(),
    })
    .await?;
    node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: m.volume.volume_id.clone(),
        staging_target_path: m.staging.display().to_string(),
    })
    .await?;
    Ok(())
}

async fn unmount(ctl: &mut Ctl, node: &mut Node, m: &Mounted) -> anyhow::Result<()> {
    unstage(node, m).await?;
    ctl.controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
        volume_id: m.volume.volume_id.clone(),
        node_id: NODE_ID.into(),
        ..Default::default()
    })
    .await?;
    Ok(())
}

/// The "pod": rewrites `FILES` files of 1 MiB in turn, each fsynced, until told to stop (or
/// dropped: an interrupted demo must not write into a volume it is taking apart); what each
/// file last held is kept to check it afterwards.
struct Writer {
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<Vec<u64>>>>,
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn content(seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..MIB / 8)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s.to_le_bytes()
        })
        .collect()
}

impl Writer {
    fn start(dir: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicU64::new(0));
        let (s, w) = (stop.clone(), writes.clone());
        let task = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<u64>> {
            let mut last = vec![0u64; FILES as usize];
            let mut n = 0u64;
            while !s.load(Ordering::Relaxed) {
                let file = n % FILES;
                let seed = n + 1;
                let path = dir.join(format!("data-{file:02}.bin"));
                let mut f = std::fs::File::create(&path).with_context(|| format!("writing {}", path.display()))?;
                f.write_all(&content(seed)).with_context(|| format!("writing {}", path.display()))?;
                f.sync_all().with_context(|| format!("fsync of {}", path.display()))?;
                last[file as usize] = seed;
                n += 1;
                w.store(n, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(last)
        });
        Self { stop, writes, task: Some(task) }
    }

    fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    fn stopped(&self) -> bool {
        self.task.as_ref().is_none_or(tokio::task::JoinHandle::is_finished)
    }

    /// Stops it; how many writes it made, and what each file should now hold (0: never written).
    async fn finish(mut self) -> anyhow::Result<(u64, Vec<u64>)> {
        self.stop.store(true, Ordering::Relaxed);
        let task = self.task.take().context("the writer was already stopped")?;
        let last = task.await.context("the writer task")??;
        Ok((self.writes(), last))
    }
}

/// Every file the writer wrote holds what it wrote last.
fn verify(dir: &Path, last: &[u64]) -> anyhow::Result<usize> {
    let mut checked = 0;
    for (file, seed) in last.iter().enumerate().filter(|(_, s)| **s > 0) {
        let path = dir.join(format!("data-{file:02}.bin"));
        let mut got = Vec::new();
        std::fs::File::open(&path)?.read_to_end(&mut got)?;
        anyhow::ensure!(got == content(*seed), "{} does not hold what was written last", path.display());
        checked += 1;
    }
    Ok(checked)
}

async fn condition(node: &mut Node, m: &Mounted) -> anyhow::Result<String> {
    let stats = node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: m.volume.volume_id.clone(),
            volume_path: m.target.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(stats
        .volume_condition
        .map(|c| if c.abnormal { format!("abnormal: {}", c.message) } else { c.message })
        .unwrap_or_default())
}

/// CreateVolume as the external-provisioner sends it: retried while the host answers ABORTED
/// (a clone being filled from its source answers so, with its progress, until it is whole).
async fn create_patiently(ctl: &mut Ctl, request: csi::CreateVolumeRequest) -> anyhow::Result<csi::Volume> {
    let deadline = Instant::now() + HEAL_TIMEOUT;
    let mut last = String::new();
    loop {
        match ctl.create_volume(request.clone()).await {
            Ok(r) => return r.into_inner().volume.context("no volume"),
            Err(s) if s.code() == tonic::Code::Aborted && Instant::now() < deadline => {
                // "… being filled from its source: X of Y bytes copied; retry"
                let progress = s.message().rsplit(": ").next().unwrap_or_default().to_owned();
                if progress != last {
                    println!("        CreateVolume answered ABORTED, retried as the provisioner does: {progress}");
                    last = progress;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => return Err(s).context("CreateVolume"),
        }
    }
}

fn filesystem_mib(path: &Path) -> anyhow::Result<u64> {
    let s = nix::sys::statvfs::statvfs(path).with_context(|| format!("statvfs {}", path.display()))?;
    Ok(s.blocks().saturating_mul(s.fragment_size()) / MIB)
}

/// Create → stage → write → kill -9 a replica node → writes go on → it restarts and is
/// rebuilt → snapshot → clone → expand → unstage → delete.
pub async fn run(
    host: &Host,
    ctl: &mut Ctl,
    node: &mut Node,
    dir: &Path,
    staged: &Staged,
    replicas: &mut [ReplicaProcess],
    n: &mut u32,
) -> anyhow::Result<()> {
    let datapath = host.datapath.clone().context("this node serves no replicas")?;
    let names: Vec<String> =
        std::iter::once(NODE_ID.to_string()).chain(replicas.iter().map(|r| r.name().to_string())).collect();
    println!(
        "replicated block volume on three replica nodes: {} (this process) and {} (child processes)",
        NODE_ID,
        names[1..].join(", ")
    );

    let t = Instant::now();
    let vol =
        ctl.create_volume(create_request("demo-replicated", None)).await?.into_inner().volume.context("no volume")?;
    step(
        n,
        &format!("CreateVolume demo-replicated (256 MiB, 3 replicas on {}) -> {}", names.join(", "), vol.volume_id),
        t,
    );
    let set = vol.volume_id.split_once(':').map(|(_, s)| s.to_owned()).context("a volume id without backend")?;

    let t = Instant::now();
    let m = mount(ctl, node, staged, &vol, dir, "pod-r").await?;
    step(
        n,
        &format!("ControllerPublish + NodeStage (engine, FUSE + loop, ext4) + NodePublish -> {}", m.target.display()),
        t,
    );

    let t = Instant::now();
    std::fs::write(m.target.join("greeting.txt"), "hello from a replicated volume\n")?;
    let writer = Writer::start(m.target.clone());
    while writer.writes() < 5 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    step(
        n,
        &format!("a \"pod\" writes {FILES} files of 1 MiB in turn, each fsynced (3 replicas acknowledge every write)"),
        t,
    );

    let victim = replicas.last_mut().context("no replica node to kill")?;
    let pid = victim.pid().context("the replica node is not running")?;
    let killed = Instant::now();
    victim.kill();
    let before = writer.writes();
    let deadline = Instant::now() + Duration::from_secs(30);
    while writer.writes() < before + 10 {
        anyhow::ensure!(Instant::now() < deadline, "writes stalled after {} was killed", victim.name());
        anyhow::ensure!(!writer.stopped(), "the writer stopped after {} was killed", victim.name());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let degraded = loop {
        let c = condition(node, &m).await?;
        if c.starts_with("abnormal") {
            break c;
        }
        anyhow::ensure!(Instant::now() < deadline, "the volume never showed degraded: {c}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    step(
        n,
        &format!(
            "kill -9 {} (pid {pid}) -> {} more fsynced writes went on; NodeGetVolumeStats: {degraded}",
            victim.name(),
            writer.writes() - before
        ),
        killed,
    );

    let t = Instant::now();
    victim.restart().await?;
    let restarted = t.elapsed();
    let volume = datapath.volume(&set).context("the engine is not running on this node")?;
    let mut shown = Instant::now() - Duration::from_secs(1);
    let mut seen_rebuild = false;
    loop {
        let s = volume.engine_status();
        if let Some(r) = &s.rebuild {
            seen_rebuild = true;
            if shown.elapsed() >= Duration::from_millis(250) {
                shown = Instant::now();
                println!(
                    "        rebuilding replica {} ({:?}, {:?}): {:.1} of {:.1} MiB, {} writes so far",
                    r.replica,
                    r.kind,
                    r.phase,
                    (r.done * r.region_size) as f64 / MIB as f64,
                    (r.total * r.region_size) as f64 / MIB as f64,
                    writer.writes()
                );
            }
        }
        if s.healthy == s.replicas.len() && s.rebuild.is_none() && s.rebuilds_finished > 0 {
            let was_degraded = killed.elapsed();
            let c = condition(node, &m).await?;
            step(
                n,
                &format!(
                    "{} restarted in {:.0} ms -> delta rebuild of {:.1} MiB in {:.0} ms{}; {}/{} healthy, condition {c}; \
                     the volume was degraded for {:.2} s",
                    victim.name(),
                    restarted.as_secs_f64() * 1e3,
                    s.rebuilt_bytes as f64 / MIB as f64,
                    s.rebuild_time.as_secs_f64() * 1e3,
                    if seen_rebuild { "" } else { " (too quick to show progress)" },
                    s.healthy,
                    s.replicas.len(),
                    was_degraded.as_secs_f64()
                ),
                t,
            );
            break;
        }
        anyhow::ensure!(t.elapsed() < HEAL_TIMEOUT, "not healthy {HEAL_TIMEOUT:?} after the restart: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let metrics =
        crate::metrics_http::exposition(&host.registry.runtime().metrics, Some(datapath.as_ref()), &Default::default());
    println!("        from this node's /metrics:");
    for line in metrics.lines().filter(|l| l.starts_with("wasmcsi_replicated_volume_")) {
        println!("          {line}");
    }

    let t = Instant::now();
    let (writes, last) = writer.finish().await?;
    let checked = verify(&m.target, &last)?;
    step(n, &format!("the \"pod\" stopped after {writes} writes; the {checked} files hold what it wrote last"), t);

    let t = Instant::now();
    let snap = ctl
        .create_snapshot(csi::CreateSnapshotRequest {
            source_volume_id: vol.volume_id.clone(),
            name: "demo-replicated-snap".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .context("no snapshot")?;
    step(n, &format!("CreateSnapshot (through the engine, on every replica) -> {}", snap.snapshot_id), t);

    let t = Instant::now();
    let source = csi::VolumeContentSource {
        r#type: Some(csi::volume_content_source::Type::Snapshot(csi::volume_content_source::SnapshotSource {
            snapshot_id: snap.snapshot_id.clone(),
        })),
    };
    let clone = create_patiently(ctl, create_request("demo-replicated-clone", Some(source))).await?;
    step(
        n,
        &format!("CreateVolume from the snapshot (its replicas filled from the snapshot) -> {}", clone.volume_id),
        t,
    );
    let t = Instant::now();
    let c = mount(ctl, node, staged, &clone, dir, "pod-clone").await?;
    let checked = verify(&c.target, &last)?;
    unmount(ctl, node, &c).await?;
    step(n, &format!("the clone staged, its {checked} files checked (the snapshot's data), unstaged"), t);

    let t = Instant::now();
    let grown = ctl
        .controller_expand_volume(csi::ControllerExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            capacity_range: Some(csi::CapacityRange { required_bytes: GROWN as i64, limit_bytes: 0 }),
            volume_capability: Some(crate::check::mount_capability()),
            ..Default::default()
        })
        .await?
        .into_inner();
    let expanded = node
        .node_expand_volume(csi::NodeExpandVolumeRequest {
            volume_id: vol.volume_id.clone(),
            volume_path: m.target.display().to_string(),
            capacity_range: Some(csi::CapacityRange { required_bytes: GROWN as i64, limit_bytes: 0 }),
            staging_target_path: m.staging.display().to_string(),
            volume_capability: Some(crate::check::mount_capability()),
            ..Default::default()
        })
        .await;
    match expanded {
        Ok(_) => step(
            n,
            &format!(
                "ControllerExpandVolume (online, through the engine) + NodeExpandVolume -> {} MiB, ext4 {} MiB",
                grown.capacity_bytes >> 20,
                filesystem_mib(&m.target)?
            ),
            t,
        ),
        Err(status) if status.code() == tonic::Code::FailedPrecondition => {
            // This host drops CAP_SYS_RESOURCE: a mounted ext4 cannot grow; kubelet retries
            // NodeExpand, and the pod's restart (unstage, stage) grows it.
            unstage(node, &m).await?;
            stage(node, &m).await?;
            step(
                n,
                &format!(
                    "ControllerExpandVolume (online, through the engine) -> {} MiB; ext4 cannot grow while mounted \
                     here (no CAP_SYS_RESOURCE), so unstage + stage grew it -> {} MiB",
                    grown.capacity_bytes >> 20,
                    filesystem_mib(&m.target)?
                ),
                t,
            );
        }
        Err(status) => return Err(status).context("NodeExpandVolume"),
    }

    let t = Instant::now();
    anyhow::ensure!(
        std::fs::read_to_string(m.target.join("greeting.txt"))? == "hello from a replicated volume\n",
        "greeting.txt changed"
    );
    unmount(ctl, node, &m).await?;
    step(n, "NodeUnpublish + NodeUnstage (engine stopped, loop and FUSE gone) + ControllerUnpublish", t);

    let t = Instant::now();
    ctl.delete_snapshot(csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id, ..Default::default() }).await?;
    for v in [&vol.volume_id, &clone.volume_id] {
        ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.clone(), ..Default::default() }).await?;
    }
    step(n, "DeleteSnapshot + DeleteVolume x2 -> every replica gone from the three nodes", t);
    Ok(())
}
