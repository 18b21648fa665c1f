//! The part of `block_io` that measures a group snapshot's pause (`BLOCK_BENCH_ONLY=group`): a
//! node plugin in this process (controller + node, its replica server and the engines of what it
//! stages) and one replica node as a child process, as in `csi.rs`; N raw block volumes of two
//! replicas staged here, each under a writer of 4 KiB `O_DIRECT` writes at queue depth 1; then
//! `BLOCK_BENCH_GROUPS` group snapshots of all N through the controller's catalog (what
//! CreateVolumeGroupSnapshot runs), each one's pause the longest any engine held its writes
//! (hold → snapshot on every replica → release, the controller's round trips included), and
//! each call's whole time. Snapshots are deleted after each group so every round finds the same
//! chain length. N = 3 and 10.
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use wasmcsi::replica_process::ReplicaProcess;
use wasmcsi_benchkit::fio::MIB;
use wasmcsi_benchkit::pct;
use wasmcsi_proto::csi::v1 as csi;

use super::support;
use super::support::csi::{self as calls, Paths};
use super::support::replicated::{BACKEND, Sweep};
use super::{Aligned, DirectFile, Target};

const NODE: &str = "bench-node";

/// One size of group: its pauses and call times, and the writes done meanwhile.
pub struct GroupRow {
    pub volumes: usize,
    pub held: Vec<Duration>,
    pub call: Vec<Duration>,
    pub writes: u64,
}

fn block_cap() -> csi::VolumeCapability {
    calls::single_node_writer(None)
}

/// Runs the group snapshot measurement under `root` for each size in `sizes`.
pub fn run(root: &Path, sizes: &[usize], rounds: usize) -> Vec<GroupRow> {
    let rt = tokio::runtime::Builder::new_multi_thread().thread_name("plugin").enable_all().build().unwrap();
    let dir = root.join("group");
    let _sweep = Sweep(dir.clone());
    let nodes_file = dir.join("replica-nodes");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(&nodes_file, "").unwrap();
    let host =
        rt.block_on(support::replicated::host(&dir, NODE, wasmcsi_csi::Mode::All, &nodes_file, Default::default()));
    let local = host.datapath.as_ref().expect("the plugin's data path").local_addr();
    let exe = Path::new(env!("CARGO_BIN_EXE_wasmcsi"));
    let other = rt.block_on(ReplicaProcess::start(exe, &dir.join("replica-b"), "replica-b")).expect("a replica node");
    std::fs::write(&nodes_file, format!("{local}\n{}\n", other.addr())).unwrap();
    let (mut ctl, mut node) = rt.block_on(calls::clients(&host.socket));
    let backend = host.registry.get(BACKEND).expect("the backend");
    let catalog = backend.block_catalog().expect("a block grant").clone();

    let mut rows = Vec::new();
    for &n in sizes {
        eprintln!("group snapshots of {n} volumes under writers, {rounds} rounds");
        let mut staged = Vec::new();
        for i in 0..n {
            let name = format!("bench-group-{n}-{i}");
            let req = csi::CreateVolumeRequest {
                name: name.clone(),
                capacity_range: Some(csi::CapacityRange { required_bytes: (64 * MIB) as i64, limit_bytes: 0 }),
                volume_capabilities: vec![block_cap()],
                parameters: [("backend", BACKEND), ("numberOfReplicas", "2")]
                    .iter()
                    .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                    .collect(),
                ..Default::default()
            };
            let volume =
                rt.block_on(ctl.create_volume(req)).expect("CreateVolume").into_inner().volume.expect("volume");
            let ctx = rt.block_on(calls::controller_publish(&mut ctl, &volume, NODE, &block_cap())).expect("publish");
            let paths =
                Paths { staging: dir.join("staging").join(&name), target: dir.join("pods").join(&name).join("dev") };
            rt.block_on(calls::stage_and_publish(&mut node, &volume, &ctx, &paths, &block_cap()));
            staged.push((volume, paths));
        }
        let ids: Vec<String> =
            staged.iter().map(|(v, _)| v.volume_id.split_once(':').map_or("", |(_, s)| s).to_owned()).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicU64::new(0));
        let writers: Vec<_> = staged
            .iter()
            .map(|(_, p)| {
                let (target, stop, writes) = (p.target.clone(), stop.clone(), writes.clone());
                std::thread::spawn(move || {
                    let dev = DirectFile::open(&target);
                    let buf = Aligned::new(4096, 0x5a);
                    let mut offset = 0;
                    while !stop.load(Ordering::Relaxed) {
                        dev.write(buf.get(), offset);
                        offset = (offset + 4096) % (64 * MIB);
                        writes.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let (mut held, mut call) = (Vec::new(), Vec::new());
        for r in 0..rounds {
            let name = format!("bench-g{r}");
            let t = Instant::now();
            let group = rt.block_on(catalog.snapshot_group(&ids, &name)).expect("group snapshot");
            call.push(t.elapsed());
            held.push(group.held.expect("attached volumes are held"));
            for id in &ids {
                rt.block_on(catalog.delete_snapshot(id, &name)).expect("deleting a member");
            }
        }
        stop.store(true, Ordering::Relaxed);
        for w in writers {
            w.join().expect("a writer");
        }
        for (volume, paths) in staged {
            rt.block_on(calls::unpublish_and_unstage(&mut node, &volume, &paths));
            rt.block_on(calls::controller_unpublish(&mut ctl, &volume, NODE));
            let req = csi::DeleteVolumeRequest { volume_id: volume.volume_id, ..Default::default() };
            rt.block_on(ctl.delete_volume(req)).expect("DeleteVolume");
        }
        rows.push(GroupRow { volumes: n, held, call, writes: writes.load(Ordering::Relaxed) });
    }
    drop(other);
    rt.block_on(host.shutdown()).expect("stopping the node plugin");
    rows
}

/// The table of [`run`]'s rows.
pub fn print(rows: &mut [GroupRow]) {
    println!();
    println!("group snapshot pause: the longest an engine held writes (hold → snapshot on every replica → release)");
    println!(
        "{:<8} {:>7} {:>10} {:>10} {:>10} {:>12} {:>12} {:>9}",
        "volumes", "rounds", "p50 ms", "p99 ms", "max ms", "call p50 ms", "call p99 ms", "writes"
    );
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for r in rows {
        let max = r.held.iter().max().copied().unwrap_or_default();
        println!(
            "{:<8} {:>7} {:>10.2} {:>10.2} {:>10.2} {:>12.2} {:>12.2} {:>9}",
            r.volumes,
            r.held.len(),
            ms(pct(&mut r.held, 0.5)),
            ms(pct(&mut r.held, 0.99)),
            ms(max),
            ms(pct(&mut r.call, 0.5)),
            ms(pct(&mut r.call, 0.99)),
            r.writes,
        );
    }
}
