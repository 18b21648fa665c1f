//! A cluster of real `wasmcsi serve` processes on a private LAN ([`crate::support::lan`]): a
//! controller (`--mode controller`) and node plugins (`--mode node`, each serving its replicas
//! on 10.201.0.N:9501, or running its data path in a process of its own), called as kubelet and
//! the sidecars call them; and the verified fio workload the tests run on its volumes. Shared
//! by `replicated_netns` and `tls_upgrade`. Every process, mount and loop device is taken down
//! by the cluster's drop guard, also when a test panics.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use wasmcsi_block::replica::ReplicaStore;
use wasmcsi_proto::csi::v1 as csi;

use crate::support;
use crate::support::csi::{Controller, Node, Paths, controller_publish, stats};
use crate::support::lan::{Lan, Member};
use crate::support::process::Proc;

pub const MIB: i64 = 1 << 20;
pub const SIZE: i64 = 128 * MIB;
pub const BACKEND: &str = "replicated-block";
pub const REPLICA_PORT: u16 = 9501;

pub fn skip_reason() -> Option<String> {
    if let Some(why) = crate::support::needs_root_and_fuse() {
        return Some(why);
    }
    for tool in ["ip", "fio", "nsenter"] {
        if Command::new(tool).arg("--version").output().is_err() {
            return Some(format!("{tool} missing"));
        }
    }
    None
}

/// The longest I/O pause of a volume that `wasmcsi upgrade datapath` reported in `text` (its
/// output: "… longest I/O pause 38.4 ms …").
pub fn upgrade_pause(text: &str) -> Duration {
    let ms: f64 = text
        .split("longest I/O pause ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no pause reported in {text:?}"));
    Duration::from_secs_f64(ms / 1000.0)
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

// ----- the cluster --------------------------------------------------------------------------------

/// One `wasmcsi serve` process on its LAN member, with its own home (socket, state, replicas).
pub struct Plugin {
    pub name: String,
    pub member: Member,
    pub home: PathBuf,
    /// Serves replicas (node mode) or not (the controller).
    pub replicas: bool,
    /// Runs its data path in a process of its own (`--datapath-socket`, started by the plugin).
    pub datapath: bool,
    /// The TLS flags it starts with (and a data path it starts): `--tls-mode off` on a node
    /// unless a test sets others; none on the controller (plaintext).
    pub tls: Vec<String>,
    pub proc: Option<Proc>,
}

impl Plugin {
    pub fn socket(&self) -> PathBuf {
        self.home.join("csi.sock")
    }

    pub fn replica_root(&self) -> PathBuf {
        self.home.join("replicas")
    }

    pub fn args(&self, config: &Path) -> Vec<String> {
        let home = |p: &str| self.home.join(p).to_string_lossy().into_owned();
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--mode".into(),
            if self.replicas { "node" } else { "controller" }.into(),
            "--socket".into(),
            home("csi.sock"),
            "--config".into(),
            config.to_string_lossy().into(),
            "--backends-dir".into(),
            home("backends"),
            "--state-dir".into(),
            home("state"),
            "--node-id".into(),
            self.name.clone(),
            "--driver-name".into(),
            "replicated.wasmcsi.io".into(),
            // The volumes here ask for a long staleReplicaTimeout: a lost node is waited for.
            "--reconcile-interval".into(),
            "1s".into(),
        ];
        if self.replicas {
            args.extend([
                "--replica-listen".into(),
                format!("{}:{REPLICA_PORT}", self.member.addr),
                "--replica-root".into(),
                home("replicas"),
            ]);
        }
        args.extend(self.tls.iter().cloned());
        if self.datapath {
            args.extend(["--datapath-socket".into(), home("datapath.sock"), "--datapath-start".into()]);
        }
        args
    }

    /// The pid of the data-path process serving this node now (from its pid file), if one runs.
    pub fn datapath_pid(&self) -> Option<i32> {
        let pid: i32 = std::fs::read_to_string(self.home.join("state/datapath.pid")).ok()?.trim().parse().ok()?;
        alive_datapath(pid, &self.home).then_some(pid)
    }

    /// SIGKILLs this node's data-path process (it is not a child of the test: the plugin
    /// started it detached) and waits until it is gone.
    pub fn kill_datapath(&self) -> Option<i32> {
        let pid = self.datapath_pid()?;
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(30);
        while alive_datapath(pid, &self.home) {
            assert!(Instant::now() < deadline, "data path {pid} survived SIGKILL");
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(pid)
    }

    pub fn start(&mut self, config: &Path) {
        assert!(self.proc.is_none(), "{} runs already", self.name);
        let _ = std::fs::remove_file(self.socket());
        self.proc = Some(Proc::spawn(&self.name, Some(&self.member.netns), &self.args(config)));
    }

    pub fn kill9(&mut self) {
        self.proc.take().expect("running").kill9();
    }

    /// SIGINT, and the process must exit cleanly.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.interrupt();
        }
    }

    /// A channel once the plugin answers Probe as ready.
    pub async fn channel(&self) -> tonic::transport::Channel {
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            if let Ok(ch) = wasmcsi::host::connect(&self.socket()).await {
                let mut id = csi::identity_client::IdentityClient::new(ch.clone());
                if let Ok(r) = id.probe(csi::ProbeRequest {}).await
                    && r.into_inner().ready != Some(false)
                {
                    return ch;
                }
            }
            assert!(Instant::now() < deadline, "{} never answered Probe", self.name);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn node(&self) -> Node {
        csi::node_client::NodeClient::new(self.channel().await)
    }
}

/// A controller and `n` replica nodes (`node-a`, `node-b`, …) on one LAN; the backend's grant
/// names every node's replica server.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub lan: Lan,
    pub config: PathBuf,
    pub controller: Plugin,
    pub nodes: Vec<Plugin>,
}

impl Cluster {
    pub async fn start(n: usize) -> Self {
        Self::start_with(n, false).await
    }

    /// `n` nodes; node-a runs its data path in a process of its own when `datapath`.
    pub async fn start_with(n: usize, datapath: bool) -> Self {
        let mut cluster = Self::prepare(n);
        cluster.nodes[0].datapath = datapath;
        cluster.start_all().await;
        cluster
    }

    /// The LAN, the homes and the configuration of a controller and `n` nodes, nothing started
    /// yet (a test sets each plugin's flags first, then [`Self::start_all`]).
    pub fn prepare(n: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut lan = Lan::create();
        let mut plugin = |name: &str, replicas: bool| {
            let home = dir.path().join(name);
            std::fs::create_dir_all(home.join("backends")).unwrap();
            std::fs::write(home.join(format!("backends/{BACKEND}.wasm")), wasmcsi_artifacts::REPLICATED_BLOCK).unwrap();
            let tls = if replicas { vec!["--tls-mode".into(), "off".into()] } else { Vec::new() };
            Plugin { name: name.into(), member: lan.join(), home, replicas, datapath: false, tls, proc: None }
        };
        let controller = plugin("controller", false);
        let nodes: Vec<Plugin> =
            (0..n).map(|i| plugin(&format!("node-{}", char::from(b'a' + i as u8)), true)).collect();
        let addrs: Vec<String> = nodes.iter().map(|p| format!("\"{}:{REPLICA_PORT}\"", p.member.addr)).collect();
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!(
                "[runtime]\ncall_deadline_ms = 60000\nimport_timeout_ms = 10000\n\
                 [backends.{BACKEND}.grants.block]\nnodes = [{}]\n",
                addrs.join(", ")
            ),
        )
        .unwrap();
        Self { dir, lan, config, controller, nodes }
    }

    /// Starts the controller and every node, and waits until each answers Probe.
    pub async fn start_all(&mut self) {
        self.controller.start(&self.config);
        for i in 0..self.nodes.len() {
            self.nodes[i].start(&self.config);
        }
        for p in std::iter::once(&self.controller).chain(&self.nodes) {
            p.channel().await;
        }
    }

    /// Stops the plugin (the controller for `None`, else node `i`) with SIGINT and starts it
    /// again with `tls` as its TLS flags. A data path of its own is not touched.
    pub async fn restart_with_tls(&mut self, i: Option<usize>, tls: Vec<String>) {
        let config = self.config.clone();
        let plugin = match i {
            None => &mut self.controller,
            Some(i) => &mut self.nodes[i],
        };
        plugin.stop();
        plugin.tls = tls;
        plugin.start(&config);
        plugin.channel().await;
    }

    pub async fn controller(&self) -> Controller {
        csi::controller_client::ControllerClient::new(self.controller.channel().await)
    }

    pub fn restart(&mut self, i: usize) {
        let config = self.config.clone();
        self.nodes[i].start(&config);
    }

    /// Stops every process cleanly (each must exit 0 on SIGINT), data paths last (SIGTERM).
    pub fn stop(&mut self) {
        for p in std::iter::once(&mut self.controller).chain(&mut self.nodes) {
            p.stop();
        }
        for p in &self.nodes {
            if let Some(pid) = p.datapath_pid() {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
                let deadline = Instant::now() + Duration::from_secs(60);
                while alive_datapath(pid, &p.home) {
                    assert!(Instant::now() < deadline, "data path {pid} did not exit after SIGTERM");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    pub fn paths(&self, node: usize, pod: &str) -> Paths {
        let home = &self.nodes[node].home;
        Paths {
            staging: home.join("kubelet/staging").join(pod),
            target: home.join("kubelet/pods").join(pod).join("mount"),
        }
    }

    /// Every replica of the one volume the cluster holds, read whole offline (processes
    /// stopped); asserts they are byte-identical.
    pub fn assert_replicas_identical(&self, expected: usize) {
        let mut first: Option<(String, Vec<u8>)> = None;
        let mut found = 0;
        for node in &self.nodes {
            let Ok(entries) = std::fs::read_dir(node.replica_root()) else { continue };
            for entry in entries.map_while(Result::ok).filter(|e| e.path().is_dir()) {
                let store = ReplicaStore::open(&entry.path()).unwrap();
                let size = store.header().size;
                let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap());
                for off in (0..size).step_by(1 << 20) {
                    bytes.extend(store.read(off, u32::try_from((1u64 << 20).min(size - off)).unwrap()).unwrap());
                }
                found += 1;
                match &first {
                    None => first = Some((node.name.clone(), bytes)),
                    Some((name, f)) => {
                        let diff = f.iter().zip(&bytes).position(|(a, b)| a != b);
                        assert!(
                            diff.is_none() && f.len() == bytes.len(),
                            "{}'s replica differs from {name}'s at byte {diff:?}",
                            node.name
                        );
                    }
                }
            }
        }
        assert_eq!(found, expected, "replicas found");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Processes first (a dropped Proc is SIGKILLed), then whatever they left mounted: a
        // test that failed half-way must not leave a mount or loop device on the machine.
        for p in std::iter::once(&mut self.controller).chain(&mut self.nodes) {
            p.proc.take();
        }
        // Then the data paths the plugins started (their plugins, which restart them, are gone).
        for p in &self.nodes {
            p.kill_datapath();
        }
        let dir = self.dir.path().to_string_lossy().into_owned();
        // Loop devices first, while their backing files still show under the work dir: a
        // lazily unmounted FUSE file shows as "/volume" afterwards and would be missed.
        let loops =
            Command::new("losetup").args(["-nO", "NAME,BACK-FILE"]).output().map(|o| o.stdout).unwrap_or_default();
        let loops: Vec<String> = String::from_utf8_lossy(&loops)
            .lines()
            .filter_map(|l| l.split_once(' '))
            .filter(|(_, back)| back.trim_start().starts_with(&dir))
            .map(|(name, _)| name.to_string())
            .collect();
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut points: Vec<&str> =
            mounts.lines().filter_map(|l| l.split(' ').nth(1)).filter(|m| m.starts_with(&dir)).collect();
        points.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in points {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
        }
        // A device still held by a lazily unmounted filesystem is detached when that lets go.
        for l in loops {
            let _ = Command::new("losetup").args(["-d", &l]).output();
        }
    }
}

/// Whether `pid` is a live (not zombie) `wasmcsi datapath` of the node whose home is `home`: a
/// pid file may outlive its process, and the pid be reused.
pub fn alive_datapath(pid: i32, home: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
    let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| rest.starts_with('Z')))
        .unwrap_or(true);
    !zombie && args.iter().any(|a| a == "datapath") && args.iter().any(|a| a.starts_with(&*home.to_string_lossy()))
}

// ----- CSI calls ----------------------------------------------------------------------------------

pub fn mount_cap(fs: Option<&str>) -> csi::VolumeCapability {
    support::single_node_writer(fs)
}

pub async fn create(ctl: &mut Controller, name: &str, replicas: usize, cap: &csi::VolumeCapability) -> csi::Volume {
    let parameters: HashMap<String, String> = [
        ("backend", BACKEND.to_string()),
        ("numberOfReplicas", replicas.to_string()),
        ("staleReplicaTimeout", "1h".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    ctl.create_volume(csi::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(csi::CapacityRange { required_bytes: SIZE, limit_bytes: 0 }),
        volume_capabilities: vec![cap.clone()],
        parameters,
        ..Default::default()
    })
    .await
    .unwrap()
    .into_inner()
    .volume
    .unwrap()
}

pub async fn publish(
    ctl: &mut Controller,
    v: &csi::Volume,
    node: &str,
    cap: &csi::VolumeCapability,
) -> HashMap<String, String> {
    controller_publish(ctl, v, node, cap).await.unwrap_or_else(|s| panic!("ControllerPublish to {node}: {s:?}"))
}

pub async fn condition(node: &mut Node, v: &csi::Volume, p: &Paths) -> csi::VolumeCondition {
    stats(node, v, &p.target).await.volume_condition.expect("a volume condition")
}

/// Polls the volume's condition until `want(condition)`; returns how long it took.
pub async fn wait_condition(
    node: &mut Node,
    v: &csi::Volume,
    p: &Paths,
    what: &str,
    want: impl Fn(&csi::VolumeCondition) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let c = condition(node, v, p).await;
        if want(&c) {
            return start.elapsed();
        }
        assert!(start.elapsed() < Duration::from_secs(180), "never {what}: last {c:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ----- fio ----------------------------------------------------------------------------------------

/// A fio job writing `file` with 4 KiB random direct writes, each block checksummed (crc32c)
/// and verified: along the way (`verify_backlog`) and all of it at the end. `verify_only`
/// re-reads and checks what a previous run of the same job wrote.
pub fn fio(file: &Path, verify_only: bool) -> Command {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=verify",
        &format!("--filename={}", file.display()),
        "--size=16M",
        "--bs=4k",
        "--rw=randwrite",
        "--ioengine=psync",
        "--direct=1",
        "--verify=crc32c",
        "--verify_backlog=256",
        "--verify_fatal=1",
        "--randrepeat=1",
        // No state file in the working directory.
        "--verify_state_save=0",
        "--output-format=terse",
        "--terse-version=3",
    ]);
    if verify_only {
        cmd.arg("--verify_only");
    }
    cmd
}

/// Runs fio to completion: it must exit 0 with no error counted.
pub fn fio_ok(cmd: &mut Command, what: &str) {
    let out = cmd.output().expect("running fio");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "fio ({what}) failed: {text}\n{}", String::from_utf8_lossy(&out.stderr));
    // Terse v3: field 5 is the job's error number.
    let error = text.lines().find(|l| l.starts_with("3;")).and_then(|l| l.split(';').nth(4));
    assert_eq!(error, Some("0"), "fio ({what}) reports an error: {text}");
}

/// One fio run of the verified workload on `file` (JSON output): its error number and the
/// longest write latency it saw.
pub fn fio_run(file: &Path) -> (i64, Duration) {
    let mut cmd = fio(file, false);
    cmd.arg("--output-format=json");
    let out = cmd.output().expect("running fio");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("fio's JSON ({e}): {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    });
    let job = &json["jobs"][0];
    let error = job["error"].as_i64().unwrap_or(-1);
    let error = if out.status.success() { error } else { error.max(1) };
    (error, Duration::from_nanos(job["write"]["lat_ns"]["max"].as_u64().unwrap_or(0)))
}

/// Runs the verified workload on `file` over and over until `stop`; returns the runs, the
/// failed runs and the longest write latency.
pub fn fio_until(file: PathBuf, stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> (usize, usize, Duration) {
    let (mut runs, mut failed, mut longest) = (0, 0, Duration::ZERO);
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let (error, latency) = fio_run(&file);
        runs += 1;
        failed += usize::from(error != 0);
        longest = longest.max(latency);
    }
    (runs, failed, longest)
}
