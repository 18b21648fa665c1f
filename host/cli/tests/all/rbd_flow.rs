//! The ceph-rbd-shim backend end to end through the CSI socket, as kubelet and the sidecars
//! drive it: a real host (controller + node in one process, the component loaded from disk)
//! against a real Ceph cluster (`wasmcsi_ceph::Ceph`: 1 mon, 1 mgr, 2 OSDs, pool
//! size 2), the node attaching with rbd-fuse + loop (this kernel has neither krbd nor rbd-nbd)
//! and mounting XFS. Credentials are ceph-csi's `userID`/`userKey` secrets of a cephx user
//! limited to the test's pool.
//!
//! Flow: create → stage → publish → write → snapshot → change → clones from the snapshot and
//! from the volume, staged beside the original (XFS clones share its UUID) → expand online →
//! stats → unpublish → unstage → delete, every call also sent several times at once, as
//! retrying sidecars and kubelet do. Ends with nothing in the pool and nothing on the node
//! (mount, loop device, rbd-fuse).
//!
//! The same flow runs twice: here, where the node attaches with rbd-fuse + loop (this kernel
//! has neither krbd nor rbd-nbd), and in the kernel-VM tier (`testing/vmtest`), where the node
//! maps with krbd and Ceph runs inside the VM.
//!
//! Skipped (saying why) when not root or where Ceph cannot run; `WASMCSI_CEPH_TESTS=require`
//! (CI) turns the skip into a failure.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::Code;
use wasmcsi_ceph::{CLUSTER, Ceph};
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use support::csi::at_once;
use support::{from_snapshot, from_volume, pattern, write_durably};

fn mount_xfs() -> csi::VolumeCapability {
    support::single_node_writer(Some("xfs"))
}

type Controller = csi::controller_client::ControllerClient<tonic::transport::Channel>;
type Node = csi::node_client::NodeClient<tonic::transport::Channel>;

const POOL: &str = "flow";
const USER: &str = "csi-flow";
const MIB: i64 = 1 << 20;
/// mkfs.xfs refuses filesystems under 300 MB.
const SIZE: i64 = 320 * MIB;

struct Flow {
    ctl: Controller,
    node: Node,
    params: HashMap<String, String>,
    secrets: HashMap<String, String>,
    work: PathBuf,
    /// What the node mounts: `/dev/rbd` (krbd) or `/dev/loop` (rbd-fuse + loop).
    device_prefix: &'static str,
}

impl Flow {
    fn create_request(
        &self,
        name: &str,
        size: i64,
        source: Option<csi::VolumeContentSource>,
    ) -> csi::CreateVolumeRequest {
        csi::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(csi::CapacityRange { required_bytes: size, limit_bytes: 0 }),
            volume_capabilities: vec![mount_xfs()],
            parameters: self.params.clone(),
            secrets: self.secrets.clone(),
            volume_content_source: source,
            ..Default::default()
        }
    }

    /// CreateVolume four times at once: one volume.
    async fn create(&self, name: &str, source: Option<csi::VolumeContentSource>) -> csi::Volume {
        let req = self.create_request(name, SIZE, source);
        let ctl = self.ctl.clone();
        let answers = at_once(4, &format!("create {name}"), || {
            let (mut ctl, req) = (ctl.clone(), req.clone());
            async move { ctl.create_volume(req).await }
        })
        .await;
        let vols: Vec<csi::Volume> = answers.into_iter().map(|a| a.volume.unwrap()).collect();
        assert!(vols.iter().all(|v| v.volume_id == vols[0].volume_id), "one volume per name: {vols:?}");
        assert_eq!(vols[0].capacity_bytes, SIZE);
        vols[0].clone()
    }

    fn paths(&self, name: &str) -> (PathBuf, PathBuf) {
        (self.work.join("staging").join(name), self.work.join("pods").join(name).join("mount"))
    }

    async fn stage_and_publish(&self, v: &csi::Volume, name: &str) -> PathBuf {
        let (staging, target) = self.paths(name);
        let stage = csi::NodeStageVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            volume_capability: Some(mount_xfs()),
            volume_context: v.volume_context.clone(),
            secrets: self.secrets.clone(),
            ..Default::default()
        };
        let node = self.node.clone();
        at_once(3, &format!("stage {name}"), || {
            let (mut node, req) = (node.clone(), stage.clone());
            async move { node.node_stage_volume(req).await }
        })
        .await;
        let publish = csi::NodePublishVolumeRequest {
            volume_id: v.volume_id.clone(),
            staging_target_path: staging.to_string_lossy().into(),
            target_path: target.to_string_lossy().into(),
            volume_capability: Some(mount_xfs()),
            volume_context: v.volume_context.clone(),
            ..Default::default()
        };
        at_once(3, &format!("publish {name}"), || {
            let (mut node, req) = (node.clone(), publish.clone());
            async move { node.node_publish_volume(req).await }
        })
        .await;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let line = mounts.lines().find(|l| l.contains(&format!(" {} ", target.display()))).expect("published");
        assert!(line.contains(&format!(" - xfs {}", self.device_prefix)), "an XFS on {}: {line}", self.device_prefix);
        target
    }

    async fn unpublish_and_unstage(&self, id: &str, name: &str) {
        let (staging, target) = self.paths(name);
        let unpublish =
            csi::NodeUnpublishVolumeRequest { volume_id: id.into(), target_path: target.to_string_lossy().into() };
        let node = self.node.clone();
        at_once(3, &format!("unpublish {name}"), || {
            let (mut node, req) = (node.clone(), unpublish.clone());
            async move { node.node_unpublish_volume(req).await }
        })
        .await;
        let unstage = csi::NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.to_string_lossy().into(),
        };
        at_once(3, &format!("unstage {name}"), || {
            let (mut node, req) = (node.clone(), unstage.clone());
            async move { node.node_unstage_volume(req).await }
        })
        .await;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        for p in [&staging, &target] {
            assert!(!mounts.contains(&format!(" {} ", p.display())), "{} is still mounted", p.display());
        }
    }

    async fn delete_volume(&self, id: &str) {
        let req = csi::DeleteVolumeRequest { volume_id: id.into(), secrets: self.secrets.clone() };
        let ctl = self.ctl.clone();
        at_once(3, &format!("delete {id}"), || {
            let (mut ctl, req) = (ctl.clone(), req.clone());
            async move { ctl.delete_volume(req).await }
        })
        .await;
    }
}

fn read(path: &Path) -> Vec<u8> {
    let mut v = vec![];
    std::fs::File::open(path).unwrap().read_to_end(&mut v).unwrap();
    v
}

/// Loop devices whose backing file is under `dir` (read from sysfs: `losetup` could block on
/// a dead FUSE file).
fn loops_backed_under(dir: &str) -> Vec<String> {
    let mut found = vec![];
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).unwrap_or_default();
        if backing.starts_with(dir) {
            found.push(format!("{}: {}", e.file_name().to_string_lossy(), backing.trim()));
        }
    }
    found
}

/// rbd-fuse processes whose command line names `dir`.
fn rbd_fuse_under(dir: &str) -> Vec<String> {
    let mut found = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.starts_with("rbd-fuse") && cmd.contains(dir) {
            found.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
        }
    }
    found
}

#[test]
fn rbd_volume_lifecycle_through_the_csi_socket_with_retries_and_concurrency() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root (Ceph in a private namespace, rbd-fuse, loop devices, mounts)");
        return;
    }
    let Some(ceph) = Ceph::shared() else { return };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    assert!(!wasmcsi_rbd::krbd::available(), "this kernel maps RBD: the rbd-fuse path is not what runs here");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(flow(ceph, "/dev/loop"));
}

/// The same flow in the kernel-VM tier: the node maps the images with krbd. Ceph (memstore)
/// starts inside the VM, under TCG: slow, hence the generous timeout.
#[test]
fn rbd_volume_lifecycle_with_krbd_in_the_vm() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root");
        return;
    }
    let vm = wasmcsi_vmtest::Vm::new().timeout(Duration::from_secs(1500)).mem_mib(3072).env("TMPDIR", "/scratch");
    let Some(_guest) = wasmcsi_vmtest::enter!(vm) else { return };
    assert!(wasmcsi_rbd::krbd::available(), "the VM's kernel maps RBD images");
    let Some(ceph) = Ceph::shared() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(flow(ceph, "/dev/rbd"));
}

async fn flow(ceph: &Ceph, device_prefix: &'static str) {
    ceph.create_pool(POOL).expect("pool");
    let key = ceph.create_user(USER, POOL).expect("user");
    let dir = tempfile::tempdir().unwrap();
    let host = support::ceph_rbd_shim_host(ceph, POOL, dir.path(), "flow-node").await;
    let channel = wasmcsi::host::connect(&host.socket).await.unwrap();
    let f = Flow {
        ctl: csi::controller_client::ControllerClient::new(channel.clone()),
        node: csi::node_client::NodeClient::new(channel),
        params: [("backend", "ceph-rbd-shim"), ("clusterID", CLUSTER), ("pool", POOL), ("imageFeatures", "layering")]
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect(),
        secrets: [("userID", USER.to_string()), ("userKey", key.clone())]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        work: dir.path().join("kubelet"),
        device_prefix,
    };
    let mut ctl = f.ctl.clone();
    let mut node = f.node.clone();

    // bad input: a clear error with the right code, nothing created
    let mut bad = f.create_request("pvc-bad", SIZE, None);
    bad.parameters.insert("poool".into(), POOL.into());
    let e = ctl.create_volume(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("poool"), "names the parameter: {e:?}");
    let mut no_key = f.create_request("pvc-bad", SIZE, None);
    no_key.secrets.remove("userKey");
    let e = ctl.create_volume(no_key).await.unwrap_err();
    assert_ne!(e.code(), Code::Ok);
    assert!(!e.message().contains(&key), "never the key in an error");
    assert!(ceph.rbd(&["ls", POOL]).unwrap().trim().is_empty(), "bad requests created nothing");

    // create: retried at once, one image; same name, other size: AlreadyExists
    let v = f.create("pvc-1", None).await;
    let e = ctl.create_volume(f.create_request("pvc-1", 2 * SIZE, None)).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    assert_eq!(ceph.rbd(&["ls", POOL]).unwrap().lines().count(), 1);

    // stage + publish (rbd-fuse + loop + mkfs.xfs + mount), write durably
    let t1 = f.stage_and_publish(&v, "pvc-1").await;
    let before = pattern(1, 8 << 20);
    write_durably(&t1.join("data.bin"), &before);

    // snapshot, retried at once: one snapshot, ready at once (RBD snapshots are instant)
    let snap_req = csi::CreateSnapshotRequest {
        source_volume_id: v.volume_id.clone(),
        name: "snap-1".into(),
        secrets: f.secrets.clone(),
        ..Default::default()
    };
    let snaps = at_once(3, "snapshot", || {
        let (mut ctl, req) = (ctl.clone(), snap_req.clone());
        async move { ctl.create_snapshot(req).await }
    })
    .await;
    let snap = snaps[0].snapshot.clone().unwrap();
    assert!(snaps.iter().all(|s| s.snapshot.as_ref().unwrap().snapshot_id == snap.snapshot_id), "{snaps:?}");
    assert!(snap.ready_to_use && snap.source_volume_id == v.volume_id, "{snap:?}");
    let listed = ctl
        .list_snapshots(csi::ListSnapshotsRequest { source_volume_id: v.volume_id.clone(), ..Default::default() })
        .await
        .expect("list snapshots")
        .into_inner();
    assert_eq!(
        listed.entries.iter().filter_map(|e| e.snapshot.as_ref()).map(|s| &s.snapshot_id).collect::<Vec<_>>(),
        [&snap.snapshot_id]
    );

    // the volume changes after the cut
    let after = pattern(2, 8 << 20);
    write_durably(&t1.join("data.bin"), &after);

    // clones from the snapshot and from the volume, staged on the same node as the original
    let c1 = f.create("pvc-2", Some(from_snapshot(&snap.snapshot_id))).await;
    let c2 = f.create("pvc-3", Some(from_volume(&v.volume_id))).await;
    let t2 = f.stage_and_publish(&c1, "pvc-2").await;
    let t3 = f.stage_and_publish(&c2, "pvc-3").await;
    assert!(read(&t2.join("data.bin")) == before, "the clone of the snapshot holds the data at the cut");
    assert!(read(&t3.join("data.bin")) == after, "the clone of the volume holds its data now");
    write_durably(&t2.join("own.bin"), &pattern(3, 1 << 20));
    assert!(!t1.join("own.bin").exists(), "a clone's writes stay in the clone");

    // expand online: the controller resizes the image, the node grows the XFS while mounted
    let expand = csi::ControllerExpandVolumeRequest {
        volume_id: v.volume_id.clone(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 2 * SIZE, limit_bytes: 0 }),
        volume_capability: Some(mount_xfs()),
        secrets: f.secrets.clone(),
    };
    let grown = at_once(3, "expand", || {
        let (mut ctl, req) = (ctl.clone(), expand.clone());
        async move { ctl.controller_expand_volume(req).await }
    })
    .await;
    assert!(grown.iter().all(|g| g.capacity_bytes == 2 * SIZE && g.node_expansion_required), "{grown:?}");
    let (s1, _) = f.paths("pvc-1");
    let node_expand = csi::NodeExpandVolumeRequest {
        volume_id: v.volume_id.clone(),
        volume_path: t1.to_string_lossy().into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: 2 * SIZE, limit_bytes: 0 }),
        staging_target_path: s1.to_string_lossy().into(),
        volume_capability: Some(mount_xfs()),
        ..Default::default()
    };
    at_once(2, "node expand", || {
        let (mut node, req) = (node.clone(), node_expand.clone());
        async move { node.node_expand_volume(req).await }
    })
    .await;
    let st = nix::sys::statvfs::statvfs(&t1).unwrap();
    let total = st.blocks() * st.fragment_size();
    assert!(total > (SIZE as u64) * 3 / 2, "the mounted XFS grew: {total} bytes");
    assert!(read(&t1.join("data.bin")) == after, "data intact after growing");

    // stats
    let stats = node
        .node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
            volume_id: v.volume_id.clone(),
            volume_path: t1.to_string_lossy().into(),
            staging_target_path: s1.to_string_lossy().into(),
        })
        .await
        .expect("stats")
        .into_inner();
    let bytes = stats.usage.iter().find(|u| u.unit == csi::volume_usage::Unit::Bytes as i32).expect("bytes");
    assert!(bytes.total as u64 > (SIZE as u64) * 3 / 2 && bytes.used >= 8 << 20, "{stats:?}");
    assert_eq!(stats.volume_condition.map(|c| c.abnormal), Some(false));
    let got = ctl
        .controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: v.volume_id.clone() })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes, 2 * SIZE);

    // teardown in kubelet's order, then the controller's
    f.unpublish_and_unstage(&c2.volume_id, "pvc-3").await;
    f.unpublish_and_unstage(&c1.volume_id, "pvc-2").await;
    f.unpublish_and_unstage(&v.volume_id, "pvc-1").await;
    let work = f.work.to_string_lossy().into_owned();
    assert_eq!(loops_backed_under(&dir.path().to_string_lossy()), Vec::<String>::new(), "loop devices left");
    assert_eq!(rbd_fuse_under(&dir.path().to_string_lossy()), Vec::<String>::new(), "rbd-fuse left");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&work), "mounts left under {work}:\n{mounts}");

    // The source volume goes first while its snapshot and clones exist (ceph-csi's order does
    // not matter to the spec): the clones and the snapshot keep their data.
    f.delete_volume(&v.volume_id).await;
    let t2 = f.stage_and_publish(&c1, "pvc-2").await;
    assert!(read(&t2.join("data.bin")) == before, "the clone survives its source's deletion");
    f.unpublish_and_unstage(&c1.volume_id, "pvc-2").await;
    let del_snap = csi::DeleteSnapshotRequest { snapshot_id: snap.snapshot_id.clone(), secrets: f.secrets.clone() };
    at_once(3, "delete snapshot", || {
        let (mut ctl, req) = (ctl.clone(), del_snap.clone());
        async move { ctl.delete_snapshot(req).await }
    })
    .await;
    f.delete_volume(&c1.volume_id).await;
    f.delete_volume(&c2.volume_id).await;
    for id in [&v.volume_id, &c1.volume_id, &c2.volume_id] {
        let gone =
            ctl.controller_get_volume(csi::ControllerGetVolumeRequest { volume_id: id.clone() }).await.unwrap_err();
        assert_eq!(gone.code(), Code::NotFound, "{id}: {gone:?}");
    }
    let left = ceph.rbd(&["ls", "--long", POOL]).unwrap();
    assert!(left.trim().is_empty(), "left in the pool: {left}");
    let trash = ceph.rbd(&["trash", "ls", POOL]).unwrap();
    assert!(trash.trim().is_empty(), "left in the pool's trash: {trash}");
    host.shutdown().await.unwrap();
}

// ----- an rbd-fuse volume outlives the plugin ------------------------------------------------------

/// What a failing survival test leaves is taken down on drop: mounts under its directory
/// (lazily), loop devices backed there, rbd-fuse daemons naming it. Never anything else.
struct LeftBehind(PathBuf);

impl Drop for LeftBehind {
    fn drop(&mut self) {
        let dir = self.0.to_string_lossy().into_owned();
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<&str> =
            mounts.lines().filter_map(|l| l.split(' ').nth(4)).filter(|p| p.starts_with(&dir)).collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
        }
        for found in loops_backed_under(&dir) {
            let dev = format!("/dev/{}", found.split(':').next().unwrap_or_default());
            let _ = std::process::Command::new("losetup").args(["-d", &dev]).status();
        }
        for found in rbd_fuse_under(&dir) {
            if let Ok(pid) = found.split(':').next().unwrap_or_default().parse::<i32>() {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
}

/// The pid of the one rbd-fuse naming `dir`, and its parent's.
fn rbd_fuse_and_parent(dir: &Path) -> (i32, i32) {
    let found = rbd_fuse_under(&dir.to_string_lossy());
    assert_eq!(found.len(), 1, "one rbd-fuse: {found:?}");
    let pid: i32 = found[0].split(':').next().unwrap().parse().unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let ppid = stat.rsplit_once(')').unwrap().1.split_whitespace().nth(1).unwrap().parse().unwrap();
    (pid, ppid)
}

/// Children of `pid` that exited and were never waited for.
fn zombies_of(pid: i32) -> Vec<String> {
    let mut found = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let Some((head, rest)) = stat.rsplit_once(')') else { continue };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.first() == Some(&"Z") && fields.get(1) == Some(&pid.to_string().as_str()) {
            found.push(format!("{head})"));
        }
    }
    found
}

/// A database-like writer on the mounted volume: 64 KiB blocks over a ring of 64, each written
/// and fdatasync'd, until told to stop; counts errors and the slowest durable write, and keeps
/// what each block should hold.
struct Writer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: Option<std::thread::JoinHandle<Written>>,
    /// The slowest write since [`Writer::lap`], in microseconds.
    slowest: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// What a [`Writer`] did: writes, errors, the slowest, and the seed each block holds.
type Written = (usize, usize, Duration, Vec<u64>);

const BLOCK: usize = 64 << 10;
const RING: usize = 64;

impl Writer {
    fn start(file: PathBuf) -> Self {
        use std::os::unix::fs::FileExt;
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let slowest = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (s, l) = (stop.clone(), slowest.clone());
        let task = std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&file).unwrap();
            let (mut writes, mut errors, mut longest) = (0usize, 0usize, Duration::ZERO);
            let mut seeds = vec![0u64; RING];
            while !s.load(Ordering::SeqCst) {
                let slot = writes % RING;
                let seed = 1000 + writes as u64;
                let t = Instant::now();
                let ok = f.write_all_at(&pattern(seed, BLOCK), (slot * BLOCK) as u64).and_then(|()| f.sync_data());
                let took = t.elapsed();
                match ok {
                    Ok(()) => seeds[slot] = seed,
                    Err(e) => {
                        eprintln!("write {writes}: {e}");
                        errors += 1;
                    }
                }
                longest = longest.max(took);
                l.fetch_max(u64::try_from(took.as_micros()).unwrap(), Ordering::SeqCst);
                writes += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            (writes, errors, longest, seeds)
        });
        Self { stop, task: Some(task), slowest }
    }

    /// The slowest write since the last lap, and a new lap.
    fn lap(&self) -> Duration {
        Duration::from_micros(self.slowest.swap(0, std::sync::atomic::Ordering::SeqCst))
    }

    fn finish(mut self) -> Written {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.task.take().unwrap().join().unwrap()
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

use std::time::Instant;
use support::process::{BIN, Proc};

/// The node as Kubernetes runs it: `wasmcsi datapath` in a process of its own (its own
/// DaemonSet), and `wasmcsi serve --datapath-socket` (controller and node here) beside it.
struct Processes {
    dir: PathBuf,
    datapath: Proc,
    plugin: Option<Proc>,
}

impl Processes {
    fn path(&self, p: &str) -> String {
        self.dir.join(p).to_string_lossy().into_owned()
    }

    fn start_plugin(&mut self) {
        assert!(self.plugin.is_none());
        let _ = std::fs::remove_file(self.dir.join("csi.sock"));
        let args: Vec<String> = [
            "serve",
            "--mode",
            "all",
            "--socket",
            &self.path("csi.sock"),
            "--config",
            &self.path("config.toml"),
            "--backends-dir",
            &self.path("backends"),
            "--state-dir",
            &self.path("state"),
            "--node-id",
            "survive-node",
            "--driver-name",
            "rbd.wasmcsi.io",
            "--datapath-socket",
            &self.path("datapath.sock"),
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect();
        self.plugin = Some(Proc::spawn("plugin", None, &args));
    }

    /// Clients once the plugin answers Probe as ready.
    async fn clients(&self) -> (Controller, Node) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(ch) = wasmcsi::host::connect(&self.dir.join("csi.sock")).await {
                let mut id = csi::identity_client::IdentityClient::new(ch.clone());
                if let Ok(r) = id.probe(csi::ProbeRequest {}).await
                    && r.into_inner().ready != Some(false)
                {
                    return (
                        csi::controller_client::ControllerClient::new(ch.clone()),
                        csi::node_client::NodeClient::new(ch),
                    );
                }
            }
            assert!(Instant::now() < deadline, "the plugin never answered Probe");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn stats_of(node: &mut Node, id: &str, target: &Path, staging: &Path) -> csi::NodeGetVolumeStatsResponse {
    node.node_get_volume_stats(csi::NodeGetVolumeStatsRequest {
        volume_id: id.into(),
        volume_path: target.to_string_lossy().into(),
        staging_target_path: staging.to_string_lossy().into(),
    })
    .await
    .expect("stats")
    .into_inner()
}

/// Every process `pid` started, and theirs: what a restart of its container kills with it.
fn descendants(pid: i32) -> Vec<i32> {
    let mut parents: Vec<(i32, i32)> = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1)?.parse().ok());
        if let Some(ppid) = ppid {
            parents.push((p, ppid));
        }
    }
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(parents.iter().filter(|(_, pp)| *pp == parent).map(|(p, _)| *p));
        i += 1;
    }
    found.remove(0);
    found
}

/// SIGKILLs `proc` and every process it started, as Kubernetes does when it restarts the
/// container; returns those others.
fn kill_container(proc: &mut Proc) -> Vec<i32> {
    let others = descendants(proc.pid().as_raw());
    proc.kill9();
    for p in &others {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*p), nix::sys::signal::Signal::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while others.iter().any(|p| Path::new(&format!("/proc/{p}")).exists() && zombie_or_gone(*p).is_none()) {
        assert!(Instant::now() < deadline, "{others:?} survived SIGKILL");
        std::thread::sleep(Duration::from_millis(10));
    }
    others
}

/// `Some(())` when `pid` is gone or a zombie.
fn zombie_or_gone(pid: i32) -> Option<()> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    match stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().next()) {
        None | Some("Z" | "X") => Some(()),
        Some(_) => None,
    }
}

fn stream_holds_its_writes(file: &Path, seeds: &[u64]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(file).unwrap();
    for (slot, seed) in seeds.iter().enumerate().filter(|(_, s)| **s != 0) {
        let mut got = vec![0u8; BLOCK];
        f.read_exact_at(&mut got, (slot * BLOCK) as u64).unwrap();
        assert!(got == pattern(*seed, BLOCK), "block {slot} holds its last durable write");
    }
}

fn nothing_left(dir: &Path) {
    let left = dir.to_string_lossy().into_owned();
    assert_eq!(rbd_fuse_under(&left), Vec::<String>::new(), "rbd-fuse left");
    assert_eq!(loops_backed_under(&left), Vec::<String>::new(), "loop devices left");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&left), "mounts left under {left}:\n{mounts}");
}

/// An rbd-fuse-staged volume keeps serving through a `kill -9` of the node plugin's
/// container (the plugin and every process it started) and its restart, and through a live
/// upgrade of the data path: rbd-fuse is the data path's child, not the plugin's. A durable
/// writer runs throughout: no error, every block read back; the restarted plugin reports the
/// volume healthy, publishes it to a new target and unstages it; the upgraded data path reaps
/// the daemon it adopted. Then a crash of the data path's container (rbd-fuse dies with it):
/// the volume reports itself abnormal, and unstage + stage bring it back with every flushed
/// write. Nothing is left (rbd-fuse, loop device, mount, zombie).
#[test]
fn an_rbd_fuse_volume_keeps_serving_through_a_plugin_kill_9_and_a_data_path_upgrade() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("SKIPPED: not root (Ceph in a private namespace, rbd-fuse, loop devices, mounts)");
        return;
    }
    let Some(ceph) = Ceph::shared() else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(survive(ceph));
}

async fn survive(ceph: &Ceph) {
    const POOL: &str = "survive";
    const USER: &str = "csi-survive";
    ceph.create_pool(POOL).expect("pool");
    let key = ceph.create_user(USER, POOL).expect("user");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_owned();
    let _left = LeftBehind(dir.clone());
    std::fs::create_dir_all(dir.join("backends")).unwrap();
    std::fs::write(dir.join("backends/ceph-rbd-shim.wasm"), wasmcsi_artifacts::CEPH_RBD_SHIM).unwrap();
    std::fs::write(
        dir.join("config.toml"),
        format!(
            "[runtime]\ncall_deadline_ms = 60000\nimport_timeout_ms = 30000\n\
             [clusters.{CLUSTER}]\nmonitors = {:?}\n\
             [backends.ceph-rbd-shim.grants]\nrbd = [{{ cluster = {CLUSTER:?}, pools = [{POOL:?}] }}]\n",
            ceph.monitors()
        ),
    )
    .unwrap();
    let path = |p: &str| dir.join(p).to_string_lossy().into_owned();
    let datapath_args: Vec<String> = [
        "datapath",
        "--socket",
        &path("datapath.sock"),
        "--state-dir",
        &path("state"),
        "--node-id",
        "survive-node",
        "--replica-listen",
        "127.0.0.1:0",
        "--replica-root",
        &path("replicas"),
        "--tls-mode",
        "off",
    ]
    .iter()
    .map(|s| (*s).to_string())
    .collect();
    let datapath = Proc::spawn("datapath", None, &datapath_args);
    let dp = wasmcsi_datapath::client::DataPathClient::new(dir.join("datapath.sock"));
    let dp_pid = i32::try_from(dp.wait_ready(Duration::from_secs(60)).await.expect("the data path answers")).unwrap();
    let mut procs = Processes { dir: dir.clone(), datapath, plugin: None };
    procs.start_plugin();
    let (ctl, node) = procs.clients().await;
    let f = Flow {
        ctl,
        node,
        params: [("backend", "ceph-rbd-shim"), ("clusterID", CLUSTER), ("pool", POOL), ("imageFeatures", "layering")]
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect(),
        secrets: [("userID", USER.to_string()), ("userKey", key)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        work: dir.join("kubelet"),
        device_prefix: "/dev/loop",
    };
    let v = f.create("pvc-survive", None).await;
    let target = f.stage_and_publish(&v, "pvc-survive").await;
    let (staging, _) = f.paths("pvc-survive");
    let (fuse_pid, parent) = rbd_fuse_and_parent(&dir);
    assert_eq!(parent, dp_pid, "rbd-fuse is the data path's child, not the plugin's");
    let before = pattern(7, 8 << 20);
    write_durably(&target.join("data.bin"), &before);
    let writer = Writer::start(target.join("stream.bin"));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let baseline = writer.lap();

    // kill -9 of the plugin's container, and its restart, as kubelet restarts it
    let killed = kill_container(procs.plugin.as_mut().unwrap());
    procs.plugin = None;
    assert_eq!(killed, Vec::<i32>::new(), "the plugin ran no process of the volume's");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    procs.start_plugin();
    let (_, mut node) = procs.clients().await;
    let ready = t.elapsed();
    let stats = stats_of(&mut node, &v.volume_id, &target, &staging).await;
    let stats_after = t.elapsed();
    assert_eq!(stats.volume_condition.as_ref().map(|c| c.abnormal), Some(false), "{stats:?}");
    let through_restart = writer.lap();
    assert!(read(&target.join("data.bin")) == before, "the data written before the kill reads back");
    let more = pattern(8, 4 << 20);
    write_durably(&target.join("more.bin"), &more);
    assert_eq!(rbd_fuse_and_parent(&dir), (fuse_pid, dp_pid), "the same rbd-fuse serves");

    // a live upgrade of the data path: same pid, rbd-fuse stays its child
    let next = dir.join("wasmcsi-next");
    std::fs::copy(BIN, &next).unwrap();
    let t = Instant::now();
    let out = std::process::Command::new(BIN)
        .args(["upgrade", "datapath", "--socket", &path("datapath.sock"), "--binary"])
        .arg(&next)
        .output()
        .unwrap();
    let upgrade = t.elapsed();
    assert!(
        out.status.success(),
        "upgrade: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let (pid_after, report) = dp.report().await.expect("the upgraded data path answers");
    assert_eq!((i32::try_from(pid_after).unwrap(), report.handovers), (dp_pid, 1), "exec in place: same pid");
    let exe = std::fs::read_link(format!("/proc/{dp_pid}/exe")).unwrap();
    assert_eq!(exe, next, "the data path runs the new binary");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let through_upgrade = writer.lap();
    assert_eq!(
        rbd_fuse_and_parent(&dir),
        (fuse_pid, dp_pid),
        "rbd-fuse survives the upgrade, still the data path's child"
    );
    let listed = dp.call(wasmcsi_datapath::wire::Request::RbdFuseList).await.unwrap().rbd_fuse;
    assert!(
        listed.len() == 1 && listed[0].alive && listed[0].pid == u32::try_from(fuse_pid).unwrap(),
        "the new image adopted rbd-fuse: {listed:?}"
    );
    let stats = stats_of(&mut node, &v.volume_id, &target, &staging).await;
    assert_eq!(stats.volume_condition.as_ref().map(|c| c.abnormal), Some(false), "after the upgrade: {stats:?}");
    assert!(read(&target.join("more.bin")) == more, "the data written after the restart reads back");

    // the restarted plugin publishes to a new target, then unstages; the upgraded data path
    // reaps the rbd-fuse it adopted
    let (writes, errors, longest, seeds) = writer.finish();
    stream_holds_its_writes(&target.join("stream.bin"), &seeds);
    let second = dir.join("pods/second/mount");
    node.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        staging_target_path: staging.to_string_lossy().into(),
        target_path: second.to_string_lossy().into(),
        volume_capability: Some(mount_xfs()),
        volume_context: v.volume_context.clone(),
        ..Default::default()
    })
    .await
    .expect("publish to a new target after the restart");
    assert!(read(&second.join("data.bin")) == before, "the new target shows the volume");
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        target_path: second.to_string_lossy().into(),
    })
    .await
    .expect("unpublish the new target");
    let f = Flow { node: node.clone(), ..f };
    f.unpublish_and_unstage(&v.volume_id, "pvc-survive").await;
    nothing_left(&dir);
    assert_eq!(zombies_of(dp_pid), Vec::<String>::new(), "the upgraded data path reaped rbd-fuse");
    let listed = dp.call(wasmcsi_datapath::wire::Request::RbdFuseList).await.unwrap().rbd_fuse;
    assert!(listed.is_empty(), "the data path forgot the attachment: {listed:?}");

    // the data path's container crashes: rbd-fuse dies with it, the volume says so, and
    // unstage + stage bring it back with every flushed write
    let target = f.stage_and_publish(&v, "pvc-survive").await;
    let (fuse_pid, _) = rbd_fuse_and_parent(&dir);
    let last = pattern(9, 1 << 20);
    write_durably(&target.join("last.bin"), &last);
    let killed = kill_container(&mut procs.datapath);
    assert!(killed.contains(&fuse_pid), "rbd-fuse died with the data path's container: {killed:?}");
    procs.datapath = Proc::spawn("datapath", None, &datapath_args);
    dp.wait_ready(Duration::from_secs(60)).await.expect("the restarted data path answers");
    let stats = stats_of(&mut node, &v.volume_id, &target, &staging).await;
    let condition = stats.volume_condition.clone().unwrap_or_default();
    assert!(condition.abnormal && condition.message.contains("gone"), "{stats:?}");
    let listed = dp.call(wasmcsi_datapath::wire::Request::RbdFuseList).await.unwrap().rbd_fuse;
    assert!(listed.len() == 1 && !listed[0].alive, "the restarted data path lists the dead daemon: {listed:?}");
    f.unpublish_and_unstage(&v.volume_id, "pvc-survive").await;
    nothing_left(&dir);
    let target = f.stage_and_publish(&v, "pvc-survive").await;
    assert!(read(&target.join("data.bin")) == before, "flushed before the crash: data.bin");
    assert!(read(&target.join("more.bin")) == more, "flushed before the crash: more.bin");
    assert!(read(&target.join("last.bin")) == last, "flushed before the crash: last.bin");
    stream_holds_its_writes(&target.join("stream.bin"), &seeds);
    // Outside a pod only the data path dies: its rbd-fuse, orphaned, serves on, and the
    // restarted data path adopts it (not its child: init reaps it) and detaches it at unstage.
    let (fuse_pid, _) = rbd_fuse_and_parent(&dir);
    procs.datapath.kill9();
    procs.datapath = Proc::spawn("datapath", None, &datapath_args);
    dp.wait_ready(Duration::from_secs(60)).await.expect("the restarted data path answers");
    let listed = dp.call(wasmcsi_datapath::wire::Request::RbdFuseList).await.unwrap().rbd_fuse;
    assert!(
        listed.len() == 1 && listed[0].alive && listed[0].pid == u32::try_from(fuse_pid).unwrap(),
        "the restarted data path adopted the orphaned rbd-fuse: {listed:?}"
    );
    let stats = stats_of(&mut node, &v.volume_id, &target, &staging).await;
    assert_eq!(stats.volume_condition.as_ref().map(|c| c.abnormal), Some(false), "{stats:?}");
    write_durably(&target.join("last.bin"), &last);
    f.unpublish_and_unstage(&v.volume_id, "pvc-survive").await;
    nothing_left(&dir);
    // The killed rbd-fuse's watch on the image lingers until the OSDs time it out (30 s), and
    // the image cannot be removed before: fence the dead client, as an operator would.
    let image = v.volume_id.rsplit_once('.').unwrap().1;
    let status = ceph.rbd(&["status", "--format", "json", &format!("{POOL}/{image}")]).unwrap();
    let watchers: serde_json::Value = serde_json::from_str(&status).unwrap();
    for w in watchers["watchers"].as_array().into_iter().flatten() {
        ceph.ceph(&["osd", "blocklist", "add", w["address"].as_str().unwrap()]).unwrap();
    }
    f.delete_volume(&v.volume_id).await;
    eprintln!(
        "rbd-fuse volume through a plugin kill -9 and a data-path upgrade: plugin restart-to-ready {ready:?} \
         (first healthy stats {stats_after:?}); upgrade command {upgrade:?}; slowest durable 64 KiB write: \
         before {baseline:?}, through the restart {through_restart:?}, through the upgrade {through_upgrade:?}, \
         overall {longest:?} over {writes} writes, {errors} errors"
    );
    assert_eq!(errors, 0, "no write failed");
    procs.plugin.take().unwrap().interrupt();
    procs.datapath.interrupt();
}
