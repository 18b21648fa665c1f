//! The node's rbd executor against a real Ceph cluster (`wasmcsi_ceph::Ceph`, shared
//! by the tests of this binary): real rbd-fuse, real loop devices, real ext4/XFS mounts, driven
//! through the CSI Node service (the tonic handlers, as the gRPC server calls them) of one or
//! two "nodes" — node services with their own node id and state directory.
//!
//! The controller side (the `ceph-rbd-shim` component and the host's `rbd` capability) is not
//! used: images are created with the `wasmcsi-rbd` client, and the volume's attach plan comes
//! from a small backend linked natively (`RbdPlanner`), which plans `rbd(cluster "test",
//! pool, image)` for a volume id `rbdtest:POOL.IMAGE`.
//!
//! Skipped (saying why) when not root; the Ceph harness installs or skips on its own.
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tonic::Code;
use wasmcsi_ceph::{CLUSTER, Ceph};
use wasmcsi_csi::node::NodeService;
use wasmcsi_csi::node::mounts::KernelMounts;
use wasmcsi_csi::node::{Attachers, NodeSetup};
use wasmcsi_csi::plugin::{Mode, Plugin};
use wasmcsi_proto::csi::v1 as csi;
use wasmcsi_proto::csi::v1::node_server::Node;
use wasmcsi_rbd::{ImageSpec, RbdClient, RbdCredentials, RbdPool};
use wasmcsi_runtime::bindings::driver::*;
use wasmcsi_runtime::bindings::types::Error;
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::native::{Guest, NativeDriver};
use wasmcsi_runtime::{Registry, Runtime, RuntimeOptions};

const POOL: &str = "nodetest";
const USER: &str = "csi-node";
const MIB: u64 = 1 << 20;
/// mkfs.xfs (xfsprogs ≥ 5.19) refuses filesystems under 300 MB.
const XFS_SIZE: u64 = 320 * MIB;

// ---- a backend that only plans ------------------------------------------------------------

struct RbdPlanner;

impl Guest for RbdPlanner {
    fn info() -> BackendInfo {
        BackendInfo { name: "rbdtest".into(), version: "0".into(), parameters: vec![], features: vec![] }
    }
    fn attach_plan(
        volume_id: String,
        _: Vec<Pair>,
        _: VolumeCapability,
        _: Vec<SecretRef>,
    ) -> Result<Attachment, Error> {
        let (pool, image) =
            volume_id.split_once('.').ok_or_else(|| Error::NotFound(format!("{volume_id} is not POOL.IMAGE")))?;
        Ok(Attachment::Rbd(RbdPlan {
            cluster: CLUSTER.into(),
            pool: pool.into(),
            image: image.into(),
            secrets: vec![
                SecretRef { key: "userID".into(), handle: 0 },
                SecretRef { key: "userKey".into(), handle: 1 },
            ],
            encryption: None,
        }))
    }
}

// ---- the fixture: one cluster, one pool, one registry; nodes on demand ---------------------

struct Fixture {
    registry: Arc<Registry>,
    key: String,
    pool: RbdPool,
    _dir: tempfile::TempDir,
}

/// `None` (after saying why) where these tests cannot run.
fn fixture() -> Option<&'static Fixture> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping: rbd-fuse, loop devices and mounts need root");
        return None;
    }
    let ceph = Ceph::shared()?;
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    Some(FIXTURE.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        ceph.create_pool(POOL).expect("pool");
        let key = ceph.create_user(USER, POOL).expect("user");
        let dir = tempfile::tempdir().expect("tempdir");
        let monitors = ceph.monitors().iter().map(|m| format!("{m:?}")).collect::<Vec<_>>().join(", ");
        let toml = format!(
            "[clusters.{CLUSTER}]\nmonitors = [{monitors}]\n[backends.rbdtest.grants]\nrbd = [{{ cluster = \"{CLUSTER}\", pools = [\"{POOL}\"] }}]\n"
        );
        let config = HostConfig::parse(&toml, Path::new("test")).expect("config");
        let runtime = Runtime::new(RuntimeOptions {
            config,
            cache_dir: None,
            store_path: dir.path().join("meta.redb"),
            wasm_engine: Default::default(),
        })
        .expect("runtime");
        let registry = Registry::new(runtime.clone(), None, None);
        registry.insert(runtime.load_native("rbdtest", NativeDriver::of::<RbdPlanner>()).expect("native backend"));
        let client = RbdClient::new(ceph.config(&[POOL]));
        let pool = client.pool(CLUSTER, POOL, &RbdCredentials::new(USER, key.clone())).expect("granted");
        Fixture { registry, key, pool, _dir: dir }
    }))
}

/// One node: a node service with its own id and state directory, and a kubelet-like
/// directory for staging and publish paths.
struct TestNode {
    id: String,
    svc: NodeService,
    state: PathBuf,
    kubelet: PathBuf,
    _dir: tempfile::TempDir,
}

fn node(f: &Fixture, id: &str) -> TestNode {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().canonicalize().expect("canonical");
    let state = root.join("state");
    let driver = Plugin {
        name: "wasmcsi.test".into(),
        version: "0".into(),
        mode: Mode::Node,
        node_id: id.into(),
        registry: f.registry.clone(),
        inflight: Default::default(),
        node_local: Default::default(),
        nodes: Default::default(),
        grant_signer: None,
        attachers: attachers(f, id, &state),
    };
    TestNode { id: id.into(), svc: NodeService(Arc::new(driver)), state, kubelet: root.join("kubelet"), _dir: dir }
}

/// The attachers of a node with this id and state directory, granted what the registry's backends are.
fn attachers(f: &Fixture, id: &str, state: &Path) -> Attachers {
    Attachers::new(NodeSetup {
        node_id: id.into(),
        state_dir: state.to_owned(),
        config: f.registry.runtime().clone(),
        mounts: Arc::new(KernelMounts),
        runtime_dir: state.join("run"),
        datapath: None,
    })
}

fn mount_cap(fs_type: &str) -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, MountVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs_type.into(),
            mount_flags: vec!["noatime".into()],
            ..Default::default()
        })),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    }
}

fn block_cap() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, BlockVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    }
}

impl TestNode {
    fn staging(&self, image: &str) -> PathBuf {
        self.kubelet.join("plugins/staging").join(image)
    }

    fn target(&self, image: &str, pod: &str) -> PathBuf {
        self.kubelet.join("pods").join(pod).join(image)
    }

    async fn stage(&self, f: &Fixture, image: &str, cap: csi::VolumeCapability) -> Result<(), tonic::Status> {
        let staging = self.staging(image);
        std::fs::create_dir_all(&staging).expect("staging dir");
        let secrets: HashMap<String, String> =
            [("userID".to_string(), USER.to_string()), ("userKey".to_string(), f.key.clone())].into_iter().collect();
        self.svc
            .node_stage_volume(tonic::Request::new(csi::NodeStageVolumeRequest {
                volume_id: volume_id(image),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(cap),
                secrets,
                ..Default::default()
            }))
            .await
            .map(drop)
    }

    async fn unstage(&self, image: &str) -> Result<(), tonic::Status> {
        self.svc
            .node_unstage_volume(tonic::Request::new(csi::NodeUnstageVolumeRequest {
                volume_id: volume_id(image),
                staging_target_path: self.staging(image).display().to_string(),
            }))
            .await
            .map(drop)
    }

    async fn publish(&self, image: &str, pod: &str, cap: csi::VolumeCapability) -> Result<PathBuf, tonic::Status> {
        let target = self.target(image, pod);
        self.svc
            .node_publish_volume(tonic::Request::new(csi::NodePublishVolumeRequest {
                volume_id: volume_id(image),
                staging_target_path: self.staging(image).display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(cap),
                ..Default::default()
            }))
            .await
            .map(|_| target)
    }

    async fn unpublish(&self, image: &str, pod: &str) -> Result<(), tonic::Status> {
        self.svc
            .node_unpublish_volume(tonic::Request::new(csi::NodeUnpublishVolumeRequest {
                volume_id: volume_id(image),
                target_path: self.target(image, pod).display().to_string(),
            }))
            .await
            .map(drop)
    }

    async fn stats(&self, image: &str, path: &Path) -> Result<csi::NodeGetVolumeStatsResponse, tonic::Status> {
        self.svc
            .node_get_volume_stats(tonic::Request::new(csi::NodeGetVolumeStatsRequest {
                volume_id: volume_id(image),
                volume_path: path.display().to_string(),
                ..Default::default()
            }))
            .await
            .map(tonic::Response::into_inner)
    }

    async fn expand(
        &self,
        image: &str,
        path: &Path,
        bytes: u64,
        cap: csi::VolumeCapability,
    ) -> Result<i64, tonic::Status> {
        self.svc
            .node_expand_volume(tonic::Request::new(csi::NodeExpandVolumeRequest {
                volume_id: volume_id(image),
                volume_path: path.display().to_string(),
                capacity_range: Some(csi::CapacityRange { required_bytes: bytes as i64, limit_bytes: 0 }),
                volume_capability: Some(cap),
                ..Default::default()
            }))
            .await
            .map(|r| r.into_inner().capacity_bytes)
    }

    /// rbd-fuse's pid of a staged volume, from its state file.
    fn fuse_pid(&self, image: &str) -> u32 {
        let text = std::fs::read_to_string(self.state.join("rbd").join(volume_id(image)).join("state.json"))
            .expect("state file");
        let v: serde_json::Value = serde_json::from_str(&text).expect("state json");
        v["fuse"]["pid"].as_u64().expect("pid") as u32
    }

    /// Nothing of `image` is left on this node: no state, no loop device on a file under the
    /// state directory, no mount under it or at the staging path, no rbd-fuse naming it.
    fn assert_nothing_left(&self, image: &str) {
        assert!(!self.state.join("rbd").join(volume_id(image)).exists(), "state directory left");
        let state = self.state.display().to_string();
        for entry in std::fs::read_dir("/sys/block").expect("sysfs").flatten() {
            let backing = entry.path().join("loop/backing_file");
            if let Ok(b) = std::fs::read_to_string(&backing) {
                assert!(!b.starts_with(&state), "{} still backed by {b}", entry.path().display());
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        let staging = self.staging(image).display().to_string();
        for line in mounts.lines() {
            let point = line.split(' ').nth(4).unwrap_or_default();
            assert!(!point.starts_with(&state), "mount left: {line}");
            assert!(point != staging, "staging still mounted: {line}");
        }
        for entry in std::fs::read_dir("/proc").expect("proc").flatten() {
            if let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) {
                let cmd = String::from_utf8_lossy(&cmd);
                assert!(!(cmd.starts_with("rbd-fuse") && cmd.contains(&state)), "rbd-fuse left: {cmd}");
            }
        }
    }
}

fn volume_id(image: &str) -> String {
    format!("rbdtest:{POOL}.{image}")
}

async fn create_image(f: &Fixture, image: &str, size: u64) {
    let _ = f.pool.remove(image).await;
    f.pool.create(image, &ImageSpec { size_bytes: size, ..Default::default() }).await.expect("create image");
}

async fn fence_holders(f: &Fixture, image: &str) -> Vec<String> {
    f.pool.fence_holders(image).await.expect("fence holders").into_iter().map(|h| h.cookie).collect()
}

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> Code {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(s) => s.code(),
    }
}

fn statvfs_bytes(path: &Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(path).expect("statvfs");
    s.blocks() * s.fragment_size()
}

// ---- the tests ----------------------------------------------------------------------------

async fn filesystem_round_trip(fs: &str, image: &str, size: u64) {
    let Some(f) = fixture() else { return };
    create_image(f, image, size).await;
    let n = node(f, "node-a");

    let t = Instant::now();
    n.stage(f, image, mount_cap(fs)).await.expect("stage");
    eprintln!("{fs}: first stage (with mkfs) {:?}", t.elapsed());
    let t = Instant::now();
    n.stage(f, image, mount_cap(fs)).await.expect("a retried stage succeeds");
    eprintln!("{fs}: retried stage {:?}", t.elapsed());
    assert_eq!(code(n.stage(f, image, block_cap()).await), Code::AlreadyExists, "a conflicting stage is refused");
    assert_eq!(fence_holders(f, image).await, vec!["node-a"]);

    let target = n.publish(image, "pod1", mount_cap(fs)).await.expect("publish");
    n.publish(image, "pod1", mount_cap(fs)).await.expect("a retried publish succeeds");
    std::fs::write(target.join("hello"), format!("written on {fs}")).expect("write through the publish");
    let stats = n.stats(image, &target).await.expect("stats");
    assert_eq!(stats.usage.len(), 2, "{stats:?}");
    assert!(stats.usage[0].total > 0 && stats.usage[1].total > 0, "{stats:?}");
    assert_eq!(stats.volume_condition.map(|c| c.abnormal), Some(false));
    n.unpublish(image, "pod1").await.expect("unpublish");
    n.unpublish(image, "pod1").await.expect("a retried unpublish succeeds");
    assert!(!target.exists(), "the publish target is removed");

    let t = Instant::now();
    n.unstage(image).await.expect("unstage");
    eprintln!("{fs}: unstage {:?}", t.elapsed());
    n.unstage(image).await.expect("a retried unstage succeeds");
    n.assert_nothing_left(image);
    assert!(fence_holders(f, image).await.is_empty(), "fence released");

    let t = Instant::now();
    n.stage(f, image, mount_cap(fs)).await.expect("stage again");
    eprintln!("{fs}: stage of a formatted image {:?}", t.elapsed());
    let text = std::fs::read_to_string(n.staging(image).join("hello")).expect("the file is still there");
    assert_eq!(text, format!("written on {fs}"));
    n.unstage(image).await.expect("unstage");
    n.assert_nothing_left(image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ext4_volume_stages_publishes_and_keeps_its_data_across_restage() {
    filesystem_round_trip("ext4", "fs-ext4", 64 * MIB).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn xfs_volume_stages_publishes_and_keeps_its_data_across_restage() {
    filesystem_round_trip("xfs", "fs-xfs", XFS_SIZE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_stages_of_one_volume_leave_one_staging() {
    let Some(f) = fixture() else { return };
    let image = "concurrent";
    create_image(f, image, 64 * MIB).await;
    let n = Arc::new(node(f, "node-a"));
    let calls = (0..4).map(|_| {
        let n = n.clone();
        tokio::spawn(async move { n.stage(f, image, mount_cap("ext4")).await })
    });
    let results: Vec<_> = futures::future::join_all(calls).await.into_iter().map(|r| r.expect("task")).collect();
    assert!(results.iter().any(Result::is_ok), "{results:?}");
    for r in &results {
        if let Err(s) = r {
            assert_eq!(s.code(), Code::Aborted, "a concurrent call is told to retry: {s:?}");
        }
    }
    n.stage(f, image, mount_cap("ext4")).await.expect("the retry finds it staged");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    let staging = n.staging(image).display().to_string();
    assert_eq!(mounts.lines().filter(|l| l.split(' ').nth(4) == Some(staging.as_str())).count(), 1, "one mount");
    n.unstage(image).await.expect("unstage");
    n.assert_nothing_left(image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn block_volume_publishes_the_device_and_raw_writes_reach_the_image() {
    let Some(f) = fixture() else { return };
    let image = "raw";
    create_image(f, image, 32 * MIB).await;
    let n = node(f, "node-a");
    n.stage(f, image, block_cap()).await.expect("stage block");
    n.stage(f, image, block_cap()).await.expect("a retried stage succeeds");
    assert_eq!(code(n.stage(f, image, mount_cap("ext4")).await), Code::AlreadyExists);
    let target = n.publish(image, "pod1", block_cap()).await.expect("publish block");
    n.publish(image, "pod1", block_cap()).await.expect("a retried publish succeeds");
    {
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::metadata(&target).expect("stat target").file_type().is_block_device());
        let dev = std::fs::OpenOptions::new().read(true).write(true).open(&target).expect("open the device");
        let pattern: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        dev.write_all_at(&pattern, 5 * MIB).expect("raw write");
        dev.sync_all().expect("fsync the device");
        let mut back = vec![0u8; pattern.len()];
        dev.read_exact_at(&mut back, 5 * MIB).expect("raw read");
        assert_eq!(back, pattern);
        assert_eq!(f.pool.read(image, 5 * MIB, 8192).await.expect("librbd read"), pattern, "in the image");
    }
    let stats = n.stats(image, &target).await.expect("stats");
    assert_eq!(stats.usage.first().map(|u| u.total), Some((32 * MIB) as i64), "{stats:?}");
    n.unpublish(image, "pod1").await.expect("unpublish");
    assert!(!target.exists(), "the target file is removed");
    n.unstage(image).await.expect("unstage");
    n.assert_nothing_left(image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_node_is_refused_until_the_first_unstages() {
    let Some(f) = fixture() else { return };
    let image = "rwo";
    create_image(f, image, 32 * MIB).await;
    let (a, b) = (node(f, "node-a"), node(f, "node-b"));
    a.stage(f, image, mount_cap("ext4")).await.expect("node a stages");
    let refused = b.stage(f, image, mount_cap("ext4")).await;
    let status = refused.expect_err("node b must be refused");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("node-a"), "names the holder: {}", status.message());
    b.assert_nothing_left(image);
    // Also after a restart of node a's plugin (a new RADOS client): its fence is still its own.
    let restarted = TestNode {
        id: a.id.clone(),
        svc: node_with_state(f, &a),
        state: a.state.clone(),
        kubelet: a.kubelet.clone(),
        _dir: tempfile::tempdir().expect("tempdir"),
    };
    let pid = a.fuse_pid(image);
    restarted.stage(f, image, mount_cap("ext4")).await.expect("the restarted plugin finds it staged");
    assert_eq!(a.fuse_pid(image), pid, "the same rbd-fuse keeps serving");
    // Unstaged by the restarted plugin: it releases the fence another RADOS client of its
    // node took.
    restarted.unstage(image).await.expect("node a unstages");
    a.assert_nothing_left(image);
    b.stage(f, image, mount_cap("ext4")).await.expect("node b may stage now");
    assert_eq!(fence_holders(f, image).await, vec![b.id.clone()]);
    b.unstage(image).await.expect("node b unstages");
    b.assert_nothing_left(image);
}

/// A node service with `other`'s id and state directory: the plugin of that node, restarted.
fn node_with_state(f: &Fixture, other: &TestNode) -> NodeService {
    NodeService(Arc::new(Plugin {
        name: "wasmcsi.test".into(),
        version: "0".into(),
        mode: Mode::Node,
        node_id: other.id.clone(),
        registry: f.registry.clone(),
        inflight: Default::default(),
        node_local: Default::default(),
        nodes: Default::default(),
        grant_signer: None,
        attachers: attachers(f, &other.id, &other.state),
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn xfs_grows_online_and_ext4_grows_at_the_next_stage() {
    let Some(f) = fixture() else { return };
    let n = node(f, "node-a");

    let image = "grow-xfs";
    create_image(f, image, XFS_SIZE).await;
    n.stage(f, image, mount_cap("xfs")).await.expect("stage xfs");
    let target = n.publish(image, "pod1", mount_cap("xfs")).await.expect("publish");
    let before = statvfs_bytes(&target);
    f.pool.resize(image, XFS_SIZE + 128 * MIB).await.expect("grow the image");
    let t = Instant::now();
    let size = n.expand(image, &target, XFS_SIZE + 128 * MIB, mount_cap("xfs")).await.expect("expand xfs online");
    eprintln!("xfs: online expand {:?}", t.elapsed());
    assert_eq!(size as u64, XFS_SIZE + 128 * MIB);
    let after = statvfs_bytes(&target);
    assert!(after >= before + 120 * MIB, "{before} -> {after}");
    n.expand(image, &target, XFS_SIZE + 128 * MIB, mount_cap("xfs")).await.expect("a retried expand succeeds");
    n.unpublish(image, "pod1").await.expect("unpublish");
    n.unstage(image).await.expect("unstage");
    n.assert_nothing_left(image);

    let image = "grow-ext4";
    create_image(f, image, 64 * MIB).await;
    n.stage(f, image, mount_cap("ext4")).await.expect("stage ext4");
    let before = statvfs_bytes(&n.staging(image));
    f.pool.resize(image, 128 * MIB).await.expect("grow the image");
    match n.expand(image, &n.staging(image), 128 * MIB, mount_cap("ext4")).await {
        // A host that keeps CAP_SYS_RESOURCE grows ext4 online.
        Ok(size) => assert_eq!(size as u64, 128 * MIB),
        Err(s) => {
            assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
            assert!(s.message().contains("next time the volume is staged"), "{}", s.message());
            n.unstage(image).await.expect("unstage");
            n.stage(f, image, mount_cap("ext4")).await.expect("stage grows it");
        }
    }
    let after = statvfs_bytes(&n.staging(image));
    // 64 more MiB of device, less ext4's metadata for them.
    assert!(after >= before + 56 * MIB, "{before} -> {after}");
    n.unstage(image).await.expect("unstage");
    n.assert_nothing_left(image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unstage_cleans_up_after_rbd_fuse_was_killed() {
    let Some(f) = fixture() else { return };
    let image = "killed";
    create_image(f, image, 64 * MIB).await;
    let n = node(f, "node-a");
    n.stage(f, image, mount_cap("ext4")).await.expect("stage");
    let target = n.publish(image, "pod1", mount_cap("ext4")).await.expect("publish");
    {
        // Synced: what a killed rbd-fuse loses is what was not (as with a pulled disk).
        use std::io::Write;
        let mut file = std::fs::File::create(target.join("f")).expect("create");
        file.write_all(b"x").and_then(|()| file.sync_all()).expect("write and fsync");
    }
    let pid = n.fuse_pid(image);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).expect("kill");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::path::Path::new(&format!("/proc/{pid}/cmdline")).exists()
        && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty())
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = n.stats(image, &target).await.expect("stats");
    assert_eq!(stats.volume_condition.map(|c| c.abnormal), Some(true), "a dead rbd-fuse is abnormal");
    n.unpublish(image, "pod1").await.expect("unpublish");
    let t = Instant::now();
    n.unstage(image).await.expect("unstage after rbd-fuse died");
    eprintln!("unstage after kill -9: {:?}", t.elapsed());
    assert!(t.elapsed() < Duration::from_secs(60), "bounded");
    n.assert_nothing_left(image);
    assert!(fence_holders(f, image).await.is_empty(), "fence released");

    // A stage over a broken staging (rbd-fuse killed, nothing else touched) rebuilds it.
    n.stage(f, image, mount_cap("ext4")).await.expect("stage");
    let pid = n.fuse_pid(image);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL).expect("kill");
    tokio::time::sleep(Duration::from_millis(300)).await;
    n.stage(f, image, mount_cap("ext4")).await.expect("a stage repairs a broken staging");
    assert_ne!(n.fuse_pid(image), pid, "a new rbd-fuse");
    assert_eq!(std::fs::read_to_string(n.staging(image).join("f")).expect("data survived"), "x");
    n.unstage(image).await.expect("unstage");
    n.assert_nothing_left(image);
}
