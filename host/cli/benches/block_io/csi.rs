//! The rows and column of `block_io` that go through the CSI socket: a node plugin in this
//! process (controller + node, its replica server and the engines of what it stages, as
//! `wasmcsi serve --mode all` runs them) and replica nodes as child processes
//! (`wasmcsi serve --mode node`, see `wasmcsi::replica_process`).
//!
//! - **(f) CSI**: a volume of two replicas created, ControllerPublished and staged as a raw
//!   block device through the socket, with fio on the device it publishes: replica 0 on this
//!   node, reached in-process, replica 1 on a replica node over TCP (the layout of (e), with
//!   everything the node plugin adds);
//! - CreateVolume and DeleteVolume latency with three replicas, sequential;
//! - kill -9 of a replica node under a staged volume of `BLOCK_BENCH_HEAL_MIB` (1 GiB): 1 % of
//!   it written while the node is down, the node restarted at once, the time until every
//!   replica is healthy again.
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use wasmcsi::host::Host;
use wasmcsi::replica_process::ReplicaProcess;
use wasmcsi_benchkit::fio::{self, MIB, Runs, SHAPES};
use wasmcsi_proto::csi::v1 as csi;

use super::{Aligned, DirectFile, Placement, Split, Target, fio_split};

use super::support;
use super::support::csi::{self as calls, Controller as Ctl, Node, Paths};
use super::support::replicated::{BACKEND, Sweep};

const NODE: &str = "bench-node";

/// What the CSI part measured.
pub struct CsiResults {
    /// (f): the runs of each job shape, and the CPU split of each.
    pub io: Vec<Runs>,
    pub split: Vec<Split>,
    pub create: Vec<Duration>,
    pub delete: Vec<Duration>,
    pub heal: Heal,
}

/// kill -9 of a replica node until the volume is healthy again.
pub struct Heal {
    pub size: u64,
    pub written: u64,
    /// kill → every replica healthy.
    pub total: Duration,
    /// Writing (and flushing) the 1 % while the node was down.
    pub write: Duration,
    /// The node's restart: process start until its replica server listens.
    pub restart: Duration,
    /// The engine's rebuild time and bytes.
    pub rebuild: Duration,
    pub rebuilt: u64,
}

fn block_cap() -> csi::VolumeCapability {
    calls::single_node_writer(None)
}

fn create_request(name: &str, size: u64, replicas: u32) -> csi::CreateVolumeRequest {
    let params: HashMap<String, String> =
        [("backend", BACKEND.to_string()), ("numberOfReplicas", replicas.to_string())]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
    csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: size as i64, limit_bytes: 0 }),
        volume_capabilities: vec![block_cap()],
        parameters: params,
        ..Default::default()
    }
}

/// A volume published as a raw block device on this node.
struct Staged {
    volume: csi::Volume,
    paths: Paths,
}

impl Staged {
    /// The engine's volume id (the CSI id without its backend).
    fn set_id(&self) -> &str {
        self.volume.volume_id.split_once(':').map_or("", |(_, s)| s)
    }
}

async fn create_and_stage(ctl: &mut Ctl, node: &mut Node, dir: &Path, name: &str, size: u64, n: u32) -> Staged {
    let volume = ctl.create_volume(create_request(name, size, n)).await.expect("CreateVolume").into_inner();
    let volume = volume.volume.expect("a volume");
    let publish_context =
        calls::controller_publish(ctl, &volume, NODE, &block_cap()).await.expect("ControllerPublishVolume");
    let paths = Paths { staging: dir.join("staging").join(name), target: dir.join("pods").join(name).join("dev") };
    calls::stage_and_publish(node, &volume, &publish_context, &paths, &block_cap()).await;
    Staged { volume, paths }
}

async fn unstage_and_delete(ctl: &mut Ctl, node: &mut Node, s: Staged) {
    calls::unpublish_and_unstage(node, &s.volume, &s.paths).await;
    calls::controller_unpublish(ctl, &s.volume, NODE).await;
    let id = s.volume.volume_id.clone();
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: id, ..Default::default() }).await.expect("DeleteVolume");
}

/// Runs every CSI measurement under `root` (see the module docs).
pub fn run(root: &Path, ws: u64, secs: f64, runs: usize, cpus: Placement, heal_size: u64) -> CsiResults {
    let rt = tokio::runtime::Builder::new_multi_thread().thread_name("plugin").enable_all().build().unwrap();
    let dir = root.join("csi");
    let _sweep = Sweep(dir.clone());
    let nodes_file = dir.join("replica-nodes");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(&nodes_file, "").unwrap();
    let host =
        rt.block_on(support::replicated::host(&dir, NODE, wasmcsi_csi::Mode::All, &nodes_file, Default::default()));
    let local = host.datapath.as_ref().expect("the plugin's data path").local_addr();
    let exe = Path::new(env!("CARGO_BIN_EXE_wasmcsi"));
    let mut nodes: Vec<ReplicaProcess> = ["replica-b", "replica-c"]
        .iter()
        .map(|name| rt.block_on(ReplicaProcess::start(exe, &dir.join(name), name)).expect("a replica node"))
        .collect();
    let (mut ctl, mut node) = rt.block_on(calls::clients(&host.socket));

    // (f): two replicas, this node's and replica-b's (the only nodes granted for now).
    std::fs::write(&nodes_file, format!("{local}\n{}\n", nodes[0].addr())).unwrap();
    let staged = rt.block_on(create_and_stage(&mut ctl, &mut node, &dir, "bench-csi", ws, 2));
    fio::prefill(&staged.paths.target, ws);
    let (mut io, mut split) = (Vec::new(), Vec::new());
    for shape in &SHAPES {
        eprintln!("(f) CSI: {}", shape.name);
        let (res, s) = fio_split(&staged.paths.target, shape, ws, secs, runs, cpus);
        io.push(res);
        split.push(s);
    }
    rt.block_on(unstage_and_delete(&mut ctl, &mut node, staged));

    // Three replicas from here on.
    std::fs::write(&nodes_file, format!("{local}\n{}\n{}\n", nodes[0].addr(), nodes[1].addr())).unwrap();
    let count = wasmcsi_benchkit::knob("BLOCK_BENCH_CREATES", 50);
    eprintln!("CreateVolume x{count}, then DeleteVolume x{count}, 3 replicas");
    let (mut create, mut delete, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..count {
        let t = Instant::now();
        let v = rt.block_on(ctl.create_volume(create_request(&format!("bench-create-{i}"), 64 * MIB, 3)));
        create.push(t.elapsed());
        ids.push(v.expect("CreateVolume").into_inner().volume.expect("a volume").volume_id);
    }
    for id in ids {
        let t = Instant::now();
        rt.block_on(ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: id, ..Default::default() }))
            .expect("DeleteVolume");
        delete.push(t.elapsed());
    }

    let heal = rt.block_on(heal(&host, &mut ctl, &mut node, &dir, &mut nodes, heal_size));
    drop(nodes);
    rt.block_on(host.shutdown()).expect("stopping the node plugin");
    CsiResults { io, split, create, delete, heal }
}

/// A volume of `size` on three nodes, staged here; replica-c killed with SIGKILL, 1 % of the
/// volume written (every 100th MiB), replica-c restarted, until every replica is healthy.
async fn heal(
    host: &Host,
    ctl: &mut Ctl,
    node: &mut Node,
    dir: &Path,
    nodes: &mut [ReplicaProcess],
    size: u64,
) -> Heal {
    eprintln!("kill -9 of a replica node under a {} MiB volume", size / MIB);
    let staged = create_and_stage(ctl, node, dir, "bench-heal", size, 3).await;
    let volume = host.datapath.as_ref().and_then(|d| d.volume(staged.set_id())).expect("the engine runs here");
    let healthy = |s: &wasmcsi_block::volume::VolumeStatus| s.healthy == s.replicas.len() && s.rebuild.is_none();
    assert!(healthy(&volume.engine_status()), "healthy before the kill: {:?}", volume.engine_status());
    let before = volume.engine_status();

    let victim = &mut nodes[1];
    let killed = Instant::now();
    victim.kill();
    let target = staged.paths.target.clone();
    let written = tokio::task::spawn_blocking(move || {
        let dev = DirectFile::open(&target);
        let buf = Aligned::new(MIB as usize, 0xa5);
        let mut written = 0;
        for offset in (0..size).step_by(100 * MIB as usize) {
            dev.write(buf.get(), offset);
            written += MIB;
        }
        dev.0.sync_all().expect("flushing the device");
        written
    })
    .await
    .unwrap();
    let write = killed.elapsed();
    let t = Instant::now();
    victim.restart().await.expect("restarting the replica node");
    let restart = t.elapsed();
    let deadline = Instant::now() + Duration::from_secs(600);
    let after = loop {
        let s = volume.engine_status();
        if healthy(&s) && s.rebuilds_finished > before.rebuilds_finished {
            break s;
        }
        assert!(Instant::now() < deadline, "never healthy again: {s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let total = killed.elapsed();
    drop(volume);
    unstage_and_delete(ctl, node, staged).await;
    Heal {
        size,
        written,
        total,
        write,
        restart,
        rebuild: after.rebuild_time.saturating_sub(before.rebuild_time),
        rebuilt: after.rebuilt_bytes - before.rebuilt_bytes,
    }
}
