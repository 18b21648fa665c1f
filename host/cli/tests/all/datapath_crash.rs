//! The data path and the node plugin as Kubernetes runs them: `wasmcsi datapath` and
//! `wasmcsi serve --datapath-socket` each pid 1 of its own pid namespace (so a restarted process
//! has the pid of the one that died), each in its own mount namespace with the propagation of
//! deploy/'s pods: the state directory Bidirectional in the data path and HostToContainer in the
//! plugin, kubelet's directory Bidirectional in the plugin and absent from the data path.
//!
//! - `kill -9` of the data path with three replicated volumes staged (ext4), a restart, and the
//!   unstage of all three: no `fuse.wasmcsi` mount and no loop device of ours is left, and the
//!   restarted data path says what it reclaimed.
//! - SIGTERM to the data path with a volume staged: it exits without detaching anything (while
//!   the test holds the loop device open, which a detach would wait for), leaving the FUSE mount
//!   and the loop device as a crash does; the next start reclaims them and the unstage leaves
//!   nothing.
//!
//! Root only, with /dev/fuse, unshare and mkfs.ext4; skipped with a message otherwise. The
//! processes, the mounts and the loop devices are taken down by a drop guard, also when a test
//! panics.
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::csi::{Controller, Node, Paths, controller_publish, controller_unpublish};
use crate::support::process::{BIN, Proc};

const BACKEND: &str = "replicated-block";
const NODE: &str = "node-a";
const SIZE: i64 = 64 << 20;

fn skip_reason() -> Option<String> {
    if let Some(why) = crate::support::needs_root_and_fuse() {
        return Some(why);
    }
    for tool in ["unshare", "mkfs.ext4", "losetup"] {
        if Command::new(tool).arg("--version").output().is_err() {
            return Some(format!("{tool} missing"));
        }
    }
    None
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A node: its state and kubelet directories shared bind mounts of the test's mount namespace
/// (as a node's host directories on a shared `/`), the data path and the plugin in theirs.
struct NodeHost {
    dir: PathBuf,
    _tmp: tempfile::TempDir,
    replica_port: u16,
    datapath: Option<Proc>,
    plugin: Option<Proc>,
}

impl NodeHost {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().canonicalize().unwrap();
        for shared in ["state", "kubelet"] {
            let d = dir.join(shared);
            std::fs::create_dir_all(&d).unwrap();
            run(Command::new("mount").arg("--bind").arg(&d).arg(&d));
            run(Command::new("mount").arg("--make-shared").arg(&d));
        }
        std::fs::create_dir_all(dir.join("backends")).unwrap();
        std::fs::write(dir.join(format!("backends/{BACKEND}.wasm")), wasmcsi_artifacts::REPLICATED_BLOCK).unwrap();
        // A port for the replica server, known before it starts: the grant names it.
        let replica_port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        std::fs::write(
            dir.join("config.toml"),
            format!(
                "[runtime]\ncall_deadline_ms = 60000\nimport_timeout_ms = 30000\n\
                 [backends.{BACKEND}.grants.block]\nnodes = [\"127.0.0.1:{replica_port}\"]\n"
            ),
        )
        .unwrap();
        Self { dir, _tmp: tmp, replica_port, datapath: None, plugin: None }
    }

    fn path(&self, p: &str) -> String {
        self.dir.join(p).to_string_lossy().into_owned()
    }

    /// `args` run by `sh -c script` as pid 1 of a new pid and mount namespace whose mounts start
    /// as copies of this one's (peers where this one's are shared), `$0` being `arg0`.
    fn spawn_pid_1(name: &str, script: &str, arg0: &str, args: &[String]) -> Proc {
        let mut all: Vec<String> = ["--pid", "--fork", "--mount-proc", "--kill-child", "--propagation", "unchanged"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        all.extend(["sh".into(), "-c".into(), format!("{script} && exec \"$@\""), arg0.into(), BIN.into()]);
        all.extend(args.iter().cloned());
        let mut proc = Proc::spawn_program(name, "unshare", &all);
        // The process unshare forked, once it runs our binary: pid 1 of its namespace.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(pid) = inner_pid(&proc) {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
                let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
                if exe == Path::new(BIN) {
                    let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap_or_default().to_owned();
                    assert!(nspid.trim_end().ends_with("\t1"), "{name} is pid 1 of its namespace: {nspid}");
                    return proc;
                }
            }
            assert!(Instant::now() < deadline, "{name} did not start: {:?}", proc.child.try_wait());
            proc.drain();
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn datapath_args(&self) -> Vec<String> {
        [
            "datapath",
            "--socket",
            &self.path("datapath.sock"),
            "--state-dir",
            &self.path("state"),
            "--shared-state-dir",
            "--node-id",
            NODE,
            "--replica-listen",
            &format!("127.0.0.1:{}", self.replica_port),
            "--replica-root",
            &self.path("replicas"),
            // What this test checks is the same in every mode; deploy/ says `off` too.
            "--tls-mode",
            "off",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect()
    }

    /// The data path, as its pod: kubelet's directory is not mounted in it.
    async fn start_datapath(&mut self) {
        assert!(self.datapath.is_none());
        let hide = "mount --make-rprivate \"$0\" && umount -l \"$0\"";
        let args = self.datapath_args();
        self.datapath = Some(Self::spawn_pid_1("datapath", hide, &self.path("kubelet"), &args));
        wasmcsi_datapath::client::DataPathClient::new(self.dir.join("datapath.sock"))
            .wait_ready(Duration::from_secs(60))
            .await
            .expect("the data path answers");
    }

    /// The node plugin (controller too), as its pod: the state directory HostToContainer.
    async fn start_plugin(&mut self) -> (Controller, Node) {
        assert!(self.plugin.is_none());
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
            NODE,
            "--driver-name",
            "replicated.wasmcsi.io",
            "--datapath-socket",
            &self.path("datapath.sock"),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        self.plugin = Some(Self::spawn_pid_1("plugin", "mount --make-rslave \"$0\"", &self.path("state"), &args));
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(ch) = wasmcsi::host::connect(&self.dir.join("csi.sock")).await {
                let mut id = csi::identity_client::IdentityClient::new(ch.clone());
                if let Ok(r) = id.probe(csi::ProbeRequest {}).await
                    && r.into_inner().ready != Some(false)
                {
                    return (Controller::new(ch.clone()), Node::new(ch));
                }
            }
            assert!(Instant::now() < deadline, "the plugin never answered Probe");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILLs the data path itself (pid 1 of its namespace, which takes the namespace down).
    fn kill9_datapath(&mut self) {
        let mut proc = self.datapath.take().expect("a data path runs");
        let pid = inner_pid(&proc).expect("the data path's process");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
        proc.child.wait().unwrap();
        proc.drain();
    }

    fn paths(&self, pod: &str) -> Paths {
        Paths { staging: self.dir.join("kubelet/staging").join(pod), target: self.dir.join("kubelet/pods").join(pod) }
    }

    /// The `fuse.wasmcsi` mounts this mount namespace sees under the node's directory.
    fn fuse_mounts(&self) -> Vec<String> {
        let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let dir = self.dir.to_string_lossy().into_owned();
        table
            .lines()
            .filter(|l| l.contains(" - fuse.wasmcsi ") && l.split(' ').nth(4).is_some_and(|m| m.starts_with(&dir)))
            .map(str::to_owned)
            .collect()
    }

    /// The loop devices `losetup -J` lists with a backing file under the node's directory.
    fn loops(&self) -> Vec<(String, String)> {
        let out = Command::new("losetup").arg("-J").output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        if text.trim().is_empty() {
            return Vec::new();
        }
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let dir = self.dir.to_string_lossy().into_owned();
        json["loopdevices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| Some((d["name"].as_str()?.to_owned(), d["back-file"].as_str()?.to_owned())))
            .filter(|(_, back)| back.starts_with(&dir))
            .collect()
    }

    /// The asserts of "nothing left": no FUSE mount of ours and none of the loop devices the
    /// volumes had (by name, from sysfs: a loop device whose FUSE file was unmounted lazily no
    /// longer shows its path).
    async fn assert_nothing_left(&self, devices: &[String]) {
        assert_eq!(self.fuse_mounts(), Vec::<String>::new(), "fuse.wasmcsi mounts left");
        // A loop device a filesystem held detaches on that filesystem's last close, which the
        // unmount ends: the wait only bounds a broken build.
        let deadline = Instant::now() + Duration::from_secs(30);
        let attached = |d: &String| {
            let name = d.trim_start_matches("/dev/");
            std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
                .is_ok_and(|b| b.trim() == "/volume" || b.starts_with(&*self.dir.to_string_lossy()))
        };
        while devices.iter().any(attached) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let left: Vec<&String> = devices.iter().filter(|d| attached(d)).collect();
        assert!(left.is_empty(), "loop devices of the volumes still attached: {left:?}");
        assert_eq!(self.loops(), Vec::new(), "losetup lists loop devices of ours");
        let mounts: Vec<String> = support::csi::mounts_under(&self.dir)
            .into_iter()
            .filter(|m| {
                let point = m.split(' ').nth(1).unwrap_or_default();
                point != self.path("state") && point != self.path("kubelet")
            })
            .collect();
        assert_eq!(mounts, Vec::<String>::new(), "mounts left under the node's directory");
    }
}

impl Drop for NodeHost {
    fn drop(&mut self) {
        // Processes first (a dropped Proc is SIGKILLed, and --kill-child takes its namespace
        // down), then what they left: mounts under the two shared directories, loop devices
        // backed there, then the two bind mounts.
        self.plugin.take();
        self.datapath.take();
        let dir = self.dir.to_string_lossy().into_owned();
        let backed: Vec<String> = std::fs::read_dir("/sys/block")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| std::fs::read_to_string(e.path().join("loop/backing_file")).is_ok_and(|b| b.starts_with(&dir)))
            .map(|e| format!("/dev/{}", e.file_name().to_string_lossy()))
            .collect();
        let table = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut points: Vec<&str> =
            table.lines().filter_map(|l| l.split(' ').nth(1)).filter(|m| m.starts_with(&dir)).collect();
        points.sort_by_key(|m| std::cmp::Reverse(m.len()));
        points.dedup();
        for m in points {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
        }
        for l in backed {
            let _ = Command::new("losetup").args(["-d", &l]).output();
        }
    }
}

/// The pid of the process `unshare --fork` started (in this namespace's numbering).
fn inner_pid(proc: &Proc) -> Option<i32> {
    let pid = proc.child.id();
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
    children.split_whitespace().next()?.parse().ok()
}

async fn create(ctl: &mut Controller, name: &str, cap: &csi::VolumeCapability) -> csi::Volume {
    let parameters: HashMap<String, String> =
        [("backend", BACKEND), ("numberOfReplicas", "1")].iter().map(|(k, v)| ((*k).into(), (*v).into())).collect();
    ctl.create_volume(csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: SIZE, limit_bytes: 0 }),
        volume_capabilities: vec![cap.clone()],
        parameters,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|s| panic!("CreateVolume {name}: {s:?}"))
    .into_inner()
    .volume
    .unwrap()
}

/// Creates, publishes to the node and stages (ext4) `n` volumes; returns them with their paths
/// and the loop devices they got.
async fn stage(
    host: &NodeHost,
    ctl: &mut Controller,
    node: &mut Node,
    n: usize,
    cap: &csi::VolumeCapability,
) -> (Vec<(csi::Volume, Paths)>, Vec<String>) {
    let mut volumes = Vec::new();
    for i in 0..n {
        let v = create(ctl, &format!("pvc-crash-{i}"), cap).await;
        let ctx = controller_publish(ctl, &v, NODE, cap).await.unwrap_or_else(|s| panic!("ControllerPublish: {s:?}"));
        let p = host.paths(&format!("pod-{i}"));
        support::csi::stage_and_publish(node, &v, &ctx, &p, cap).await;
        std::fs::write(p.target.join("written"), b"before the data path went").unwrap();
        volumes.push((v, p));
    }
    let devices: Vec<String> = host.loops().into_iter().map(|(name, _)| name).collect();
    assert_eq!(host.fuse_mounts().len(), n, "a FUSE mount per volume: {:?}", host.fuse_mounts());
    assert_eq!(devices.len(), n, "a loop device per volume: {devices:?}");
    (volumes, devices)
}

async fn unstage_all(ctl: &mut Controller, node: &mut Node, volumes: &[(csi::Volume, Paths)]) {
    for (v, p) in volumes {
        support::csi::unpublish_and_unstage(node, v, p).await;
        controller_unpublish(ctl, v, NODE).await;
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

#[test]
fn a_data_path_killed_with_three_volumes_staged_leaves_no_mount_and_no_loop_device_after_unstage() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut host = NodeHost::new();
        host.start_datapath().await;
        let (mut ctl, mut node) = host.start_plugin().await;
        let cap = support::single_node_writer(Some("ext4"));
        let (volumes, devices) = stage(&host, &mut ctl, &mut node, 3, &cap).await;

        host.kill9_datapath();
        host.start_datapath().await;
        let dp = host.datapath.as_mut().unwrap();
        for _ in 0..3 {
            dp.wait_line("reclaiming a FUSE mount", |l| l.contains("reclaimed the FUSE mount of a dead attach"));
        }
        dp.drain();
        let loops = dp.seen.iter().filter(|l| l.contains("reclaimed the loop device of a dead attach")).count();
        assert_eq!(loops, 3, "one line per loop device reclaimed");
        assert_eq!(host.fuse_mounts(), Vec::<String>::new(), "the restarted data path unmounted the dead FUSE mounts");

        unstage_all(&mut ctl, &mut node, &volumes).await;
        host.assert_nothing_left(&devices).await;
    });
}

#[test]
fn sigterm_leaves_the_volumes_as_a_crash_does_without_waiting_for_a_detach() {
    if let Some(why) = skip_reason() {
        eprintln!("skipped: {why}");
        return;
    }
    runtime().block_on(async {
        let mut host = NodeHost::new();
        host.start_datapath().await;
        let (mut ctl, mut node) = host.start_plugin().await;
        let cap = support::single_node_writer(Some("ext4"));
        let (volumes, devices) = stage(&host, &mut ctl, &mut node, 1, &cap).await;
        let device = devices[0].clone();
        let sys = PathBuf::from("/sys/block").join(device.trim_start_matches("/dev/")).join("loop");

        // Held open by the test: a detach of the device would wait for this hold to end.
        let hold = std::fs::File::open(&device).unwrap();
        let mut proc = host.datapath.take().unwrap();
        let pid = inner_pid(&proc).unwrap();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
        // The bound only catches a process that waits on the hold (which never ends here).
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = proc.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "the data path did not exit on SIGTERM while its device was held");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(status.success(), "the data path exits cleanly on SIGTERM: {status}");
        proc.drain();
        assert!(
            proc.seen.iter().any(|l| l.contains("stopped the data path with volumes attached")),
            "it says it left the volumes"
        );
        // Nothing was detached: no LOOP_CLR_FD (which would have set autoclear), the FUSE mount
        // is there.
        assert!(std::fs::read_to_string(sys.join("backing_file")).is_ok(), "the loop device stays attached");
        assert_eq!(std::fs::read_to_string(sys.join("autoclear")).unwrap().trim(), "0", "no detach was asked");
        assert_eq!(host.fuse_mounts().len(), 1, "the FUSE mount stays");
        drop(hold);

        // The next start reclaims them; the unstage then leaves nothing.
        host.start_datapath().await;
        let dp = host.datapath.as_mut().unwrap();
        dp.wait_line("reclaiming the FUSE mount", |l| l.contains("reclaimed the FUSE mount of a dead attach"));
        unstage_all(&mut ctl, &mut node, &volumes).await;
        host.assert_nothing_left(&devices).await;

        // With no volume, SIGTERM stops it as promptly.
        let mut proc = host.datapath.take().unwrap();
        let pid = inner_pid(&proc).unwrap();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
        let started = Instant::now();
        let status = proc.child.wait().unwrap();
        assert!(status.success(), "{status}");
        eprintln!("SIGTERM with no volume: exited in {:?}", started.elapsed());
    });
}
