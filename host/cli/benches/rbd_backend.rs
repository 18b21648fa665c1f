//! `scripts/bench-rbd` (= `cargo bench --workspace --bench rbd_backend`): the ceph-rbd-shim
//! backend through the CSI socket against a real Ceph cluster (1 mon, 1 mgr, 2 BlueStore OSDs
//! on sparse files, pool size 2; `wasmcsi_ceph`), and the same fio jobs on a Ceph RBD
//! image and on a 2-replica wasmcsi volume. One run, one table:
//!
//! 1. CreateVolume + DeleteVolume through the socket: p50/p99 of each call, a retried
//!    CreateVolume (the image exists), sequential pairs/s and ops/s with 8 clients at once.
//! 2. fio (libaio, direct=1; 4k randwrite QD1/QD32, 4k randread QD32, 1M seq write QD4) on
//!    - a Ceph RBD image, staged as a raw block volume through the CSI socket: the node's
//!      rbd-fuse + loop executor (this kernel has neither krbd nor rbd-nbd), and
//!    - a 2-replica wasmcsi volume made by hand with the real binary (`wasmcsi replica serve` ×2,
//!      `wasmcsi volume create`, `wasmcsi volume attach`: the engine under its FUSE + loop
//!      frontend), replicas on the same disk as the OSDs' files.
//!
//! Both targets are prefilled over the working set first, so reads hit data. Knobs:
//! RBD_BENCH_PAIRS (100), RBD_BENCH_SECS per fio job (5), RBD_BENCH_MIB working set (256),
//! RBD_BENCH_DIR (/var/tmp: on disk, not tmpfs; the script exports it as TMPDIR). Needs root, /dev/fuse, fio and the Ceph
//! packages (`scripts/setup`). Prints numbers; asserts only that everything ran.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "benchmark harness")]
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use wasmcsi::host::connect;
use wasmcsi_benchkit::fio::{self, MIB, Res, SHAPES};
use wasmcsi_benchkit::{knob, ms, pct};
use wasmcsi_ceph::{CLUSTER, Ceph, Store};
use wasmcsi_proto::csi::v1 as csi;

#[path = "../tests/all/support/mod.rs"]
mod support;

type Controller = csi::controller_client::ControllerClient<tonic::transport::Channel>;
type Node = csi::node_client::NodeClient<tonic::transport::Channel>;

const BIN: &str = env!("CARGO_BIN_EXE_wasmcsi");
const POOL: &str = "bench";
const USER: &str = "csi-bench";

/// A raw block volume, or an ext4 mount.
fn capability(block: bool) -> csi::VolumeCapability {
    support::single_node_writer(if block { None } else { Some("ext4") })
}

struct Socket {
    ctl: Controller,
    node: Node,
    params: HashMap<String, String>,
    secrets: HashMap<String, String>,
}

impl Socket {
    fn request(&self, name: &str, bytes: u64, block: bool) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: bytes as i64, limit_bytes: 0 }),
            volume_capabilities: vec![capability(block)],
            parameters: self.params.clone(),
            secrets: self.secrets.clone(),
            ..Default::default()
        }
    }
}

/// Create, create again (a retry: the image exists), delete: the three latencies.
async fn triple(s: &Socket, ctl: &mut Controller, name: &str) -> [Duration; 3] {
    let req = s.request(name, 1 << 30, false);
    let t = Instant::now();
    let v = ctl.create_volume(req.clone()).await.expect("create").into_inner().volume.unwrap();
    let created = t.elapsed();
    let t = Instant::now();
    ctl.create_volume(req).await.expect("create again");
    let again = t.elapsed();
    let t = Instant::now();
    let del = csi::DeleteVolumeRequest { volume_id: v.volume_id, secrets: s.secrets.clone() };
    ctl.delete_volume(del).await.expect("delete");
    [created, again, t.elapsed()]
}

// ----- fio ---------------------------------------------------------------------------------

fn run_jobs(device: &Path, ws: u64, secs: u64) -> Vec<Res> {
    fio::prefill(device, ws);
    SHAPES.iter().map(|s| fio::run(device, s, ws, secs as f64)).collect()
}

// ----- the wasmcsi volume, by hand with the real binary --------------------------------------

/// Child processes, SIGINT then SIGKILL on drop (an attached volume detaches on SIGINT).
#[derive(Default)]
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in self.0.iter_mut().rev() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(c.id()).unwrap()),
                nix::sys::signal::Signal::SIGINT,
            );
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `args` and returns the first stdout line that `want` accepts (within a minute).
fn spawn_until(children: &mut Children, args: &[&str], want: impl Fn(&str) -> bool) -> String {
    let mut child = Command::new(BIN).args(args).stdout(Stdio::piped()).spawn().expect("wasmcsi");
    let out = child.stdout.take().unwrap();
    children.0.push(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("wasmcsi said nothing");
        if want(&line) {
            return line;
        }
    }
}

fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if !nix::unistd::geteuid().is_root() || !Path::new("/dev/fuse").exists() {
        eprintln!("rbd_backend bench: needs root and /dev/fuse (Ceph in a private namespace, rbd-fuse, loop devices)");
        return;
    }
    let (pairs, secs, ws) = (knob("RBD_BENCH_PAIRS", 100), knob("RBD_BENCH_SECS", 5), knob("RBD_BENCH_MIB", 256) * MIB);
    // scripts/bench-rbd points TMPDIR at RBD_BENCH_DIR (/var/tmp): the OSDs' BlueStore files
    // (the Ceph harness's directory) and the wasmcsi replicas then share one disk.
    let dir = tempfile::Builder::new().prefix("wasmcsi-bench-rbd-").tempdir().unwrap();
    let ceph = Ceph::start_with(Store::Bluestore { file_bytes: 8 << 30 }).expect("ceph (bluestore)");
    ceph.create_pool(POOL).unwrap();
    let key = ceph.create_user(USER, POOL).unwrap();
    println!(
        "Ceph: 1 mon, 1 mgr, 2 BlueStore OSDs on sparse files under {}, pool size 2 (started in {:.1} s)",
        std::env::temp_dir().display(),
        ceph.started_in().as_secs_f64()
    );

    let host = support::ceph_rbd_shim_host(&ceph, POOL, dir.path(), "bench").await;
    let channel = connect(&host.socket).await.unwrap();
    let s = Socket {
        ctl: Controller::new(channel.clone()),
        node: Node::new(channel.clone()),
        params: [("backend", "ceph-rbd-shim"), ("clusterID", CLUSTER), ("pool", POOL)]
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
        secrets: [("userID".to_string(), USER.to_string()), ("userKey".to_string(), key)].into_iter().collect(),
    };

    // ---- 1. CreateVolume / DeleteVolume through the socket, with the default features
    // (layering) and with object-map, which lets librbd skip deleting objects never written
    let mut ctl = s.ctl.clone();
    for i in 0..5 {
        triple(&s, &mut ctl, &format!("warm-{i}")).await;
    }
    let mut rows = vec![];
    let mut seq = Duration::ZERO;
    for (features, n) in [("layering", pairs), ("layering,exclusive-lock,object-map,fast-diff", pairs.div_ceil(3))] {
        let mut with =
            Socket { ctl: s.ctl.clone(), node: s.node.clone(), params: s.params.clone(), secrets: s.secrets.clone() };
        with.params.insert("imageFeatures".into(), features.into());
        let (mut creates, mut retries, mut deletes) = (vec![], vec![], vec![]);
        let t = Instant::now();
        for i in 0..n {
            let [c, r, d] = triple(&with, &mut ctl, &format!("seq-{i}")).await;
            creates.push(c);
            retries.push(r);
            deletes.push(d);
        }
        if seq.is_zero() {
            seq = t.elapsed() - retries.iter().sum::<Duration>();
        }
        rows.push((features, n, creates, retries, deletes));
    }
    let clients = 8u64;
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let shared = std::sync::Arc::new(s);
    for w in 0..clients {
        let s = shared.clone();
        tasks.spawn(async move {
            let mut ctl = s.ctl.clone();
            for i in 0..pairs / clients {
                let req = s.request(&format!("par-{w}-{i}"), 1 << 30, false);
                let v = ctl.create_volume(req).await.expect("create").into_inner().volume.unwrap();
                let del = csi::DeleteVolumeRequest { volume_id: v.volume_id, secrets: s.secrets.clone() };
                ctl.delete_volume(del).await.expect("delete");
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let par = t.elapsed();
    let s = shared;
    println!("\nceph-rbd-shim through the CSI socket (1 GiB images, librbd via the host's rbd capability)");
    println!("{:<34} {:>10} {:>10}", "", "p50", "p99");
    for (features, n, mut creates, mut retries, mut deletes) in rows {
        println!("imageFeatures={features} ({n} volumes)");
        for (label, samples) in [
            ("  CreateVolume", &mut creates),
            ("  CreateVolume, retried (exists)", &mut retries),
            ("  DeleteVolume", &mut deletes),
        ] {
            println!("{label:<34} {:>10} {:>10}", ms(pct(samples, 0.5)), ms(pct(samples, 0.99)));
        }
    }
    println!(
        "create+delete (layering): {pairs} pairs in sequence {:.1} pairs/s; {clients} clients at once {:.1} ops/s",
        pairs as f64 / seq.as_secs_f64(),
        2.0 * (pairs / clients * clients) as f64 / par.as_secs_f64()
    );
    let left = ceph.rbd(&["ls", POOL]).unwrap();
    assert!(left.trim().is_empty(), "the bench's volumes were not all deleted: {left}");

    // ---- 2. fio: the RBD image staged as a raw block volume on this node
    let size = (ws + 64 * MIB).max(1 << 30);
    let mut ctl = s.ctl.clone();
    let v =
        ctl.create_volume(s.request("fio", size, true)).await.expect("create fio volume").into_inner().volume.unwrap();
    let (staging, target) = (dir.path().join("kubelet/staging/fio"), dir.path().join("kubelet/pods/p/dev/fio"));
    let mut node = s.node.clone();
    node.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        volume_capability: Some(capability(true)),
        volume_context: v.volume_context.clone(),
        secrets: s.secrets.clone(),
        ..Default::default()
    })
    .await
    .expect("stage");
    node.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        target_path: target.to_string_lossy().into(),
        volume_capability: Some(capability(true)),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    })
    .await
    .expect("publish");
    let t = Instant::now();
    let ceph_res = tokio::task::block_in_place(|| run_jobs(&target, ws, secs));
    let ceph_took = t.elapsed();
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        target_path: target.to_string_lossy().into(),
    })
    .await
    .expect("unpublish");
    node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_string_lossy().into(),
    })
    .await
    .expect("unstage");
    ctl.delete_volume(csi::DeleteVolumeRequest { volume_id: v.volume_id.clone(), secrets: s.secrets.clone() })
        .await
        .expect("delete fio volume");

    // ---- 3. fio: a 2-replica wasmcsi volume through the real binary, FUSE + loop
    let wasmcsi_res = tokio::task::block_in_place(|| {
        let mut children = Children::default();
        let addrs: Vec<String> = (0..2)
            .map(|i| {
                let root = dir.path().join(format!("replicas{i}"));
                std::fs::create_dir_all(&root).unwrap();
                let addr = free_addr();
                spawn_until(
                    &mut children,
                    &["replica", "serve", "--root", root.to_str().unwrap(), "--listen", &addr],
                    |l| l.starts_with("serving replicas"),
                );
                addr
            })
            .collect();
        let size_arg = format!("{}M", size / MIB);
        let st = Command::new(BIN)
            .args(["volume", "create", "--volume-id", "fio", "--size", &size_arg])
            .args(["--replica", &addrs[0], "--replica", &addrs[1]])
            .status()
            .unwrap();
        assert!(st.success(), "wasmcsi volume create");
        let (state, runtime) = (dir.path().join("engine-state"), dir.path().join("engine-run"));
        let device = spawn_until(
            &mut children,
            &[
                "volume",
                "attach",
                "--volume-id",
                "fio",
                "--local",
                "0",
                "--replica",
                &addrs[0],
                "--replica",
                &addrs[1],
                "--state-dir",
                state.to_str().unwrap(),
                "--runtime-dir",
                runtime.to_str().unwrap(),
            ],
            |l| l.starts_with("/dev/loop"),
        );
        let res = run_jobs(Path::new(device.trim()), ws, secs);
        drop(children);
        res
    });

    println!(
        "\nfio, direct=1, libaio, {} MiB working set, {secs} s per job; one run, side by side (Ceph jobs took {:.0} s)",
        ws / MIB,
        ceph_took.as_secs_f64()
    );
    println!("{:<20} {:>22} {:>22} {:>8}", "job", "Ceph RBD rbd-fuse+loop", "wasmcsi 2-rep FUSE+loop", "ratio");
    for ((shape, c), w) in SHAPES.iter().zip(&ceph_res).zip(&wasmcsi_res) {
        let unit = if shape.bs >= MIB { "MB/s" } else { "IOPS" };
        let (c_head, w_head) = (c.headline(shape), w.headline(shape));
        println!(
            "{:<20} {:>12.0} {unit:<4} {:>4.0}µs {:>12.0} {unit:<4} {:>4.0}µs {:>7.2}x",
            shape.name,
            c_head,
            c.lat_us,
            w_head,
            w.lat_us,
            w_head / c_head.max(f64::MIN_POSITIVE)
        );
    }
    println!(
        "note: the Ceph read row is this node's page cache: the rbd executor's loop device does buffered I/O on \
         rbd-fuse's image file, which the kernel caches; wasmcsi's FUSE file is direct, every read reaches a replica"
    );
    let qd32 = wasmcsi_res[1].headline(&SHAPES[1]) / ceph_res[1].headline(&SHAPES[1]).max(f64::MIN_POSITIVE);
    println!(
        "goal: wasmcsi ≥ 3× Ceph on 4k randwrite QD32: {:.2}× — {}",
        qd32,
        if qd32 >= 3.0 { "met" } else { "missed" }
    );
    host.shutdown().await.unwrap();
    let left = ceph.rbd(&["ls", POOL]).unwrap();
    assert!(left.trim().is_empty(), "left in the pool: {left}");
}
