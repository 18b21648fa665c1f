//! A replicated-block host as the flow tests, the conformance test and the block bench start
//! one in this process: the component loaded from disk, its grant naming the replica nodes of a
//! nodes file (as a headless Service's DNS would list them), a replica server on loopback; and
//! the sweep that takes down by force what a failed assertion left staged.
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use wasmcsi::host::{Host, HostOptions, ReplicaOptions};

pub const BACKEND: &str = "replicated-block";

/// How a replicated host differs between its users.
#[derive(Default)]
pub struct Options {
    /// Serve `/metrics` on a loopback port.
    pub metrics: bool,
    /// The replica server's labels (its zone, for placement).
    pub labels: Vec<(String, String)>,
    /// This host's identity (credentials, TLS mode, authority endpoint); none: plaintext.
    pub trust: wasmcsi::trust::TrustOptions,
    /// Disks of its replica server besides `default` (`replicas/`), by name.
    pub disks: Vec<(String, PathBuf)>,
    /// How often the controller reconciles volumes (heals them); none: never.
    pub reconcile: Option<Duration>,
    /// With `reconcile`: how long a clone being filled may go unasked for (default 10 min).
    pub abandon_clones_after: Option<Duration>,
    /// A filesystem backup target named `local` at this path, granted to the backend.
    pub backup_target: Option<PathBuf>,
}

/// Lists the replica servers of `hosts` in `nodes_file`, one address per line, as the grants of
/// every host started with that file read it.
pub fn list_replica_nodes(nodes_file: &Path, hosts: &[&Host]) {
    let addrs: Vec<String> =
        hosts.iter().map(|h| h.datapath.as_ref().expect("data path").local_addr().to_string()).collect();
    std::fs::write(nodes_file, addrs.join("\n") + "\n").unwrap();
}

/// A host (`mode`, node id `node_id`) serving replicated-block from `home` (component, state,
/// replicas, socket), granted the replica nodes listed in `nodes_file`.
pub async fn host(home: &Path, node_id: &str, mode: wasmcsi_csi::Mode, nodes_file: &Path, options: Options) -> Host {
    let backends = home.join("backends");
    std::fs::create_dir_all(&backends).unwrap();
    std::fs::write(backends.join(format!("{BACKEND}.wasm")), wasmcsi_artifacts::REPLICATED_BLOCK).unwrap();
    let backup = match &options.backup_target {
        Some(path) => format!(
            "[backup_targets.local]\nkind = \"filesystem\"\npath = {:?}\n[backends.{BACKEND}.grants]\nbackup = [\"local\"]\n",
            path.display().to_string()
        ),
        None => String::new(),
    };
    let config = format!(
        "[runtime]\ncall_deadline_ms = 60000\nimport_timeout_ms = 30000\n{backup}\
         [backends.{BACKEND}.grants.block]\nnodes_file = {:?}\n",
        nodes_file.display().to_string()
    );
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let host = Host::start_with_trust(
        HostOptions {
            driver_name: "replicated.wasmcsi.io".into(),
            mode,
            node_id: node_id.into(),
            socket: home.join("csi.sock"),
            config: wasmcsi_runtime::config::HostConfig::parse(&config, Path::new("test")).unwrap(),
            config_file: None,
            backends_dir: Some(backends),
            state_dir: home.join("state"),
            reload_interval: Duration::from_secs(3600),
            metrics_addr: options.metrics.then_some(loopback),
            replicas: Some(ReplicaOptions {
                listen: loopback,
                root: home.join("replicas"),
                disks: options.disks,
                labels: options.labels,
            }),
            reconcile: options.reconcile.map(|interval| wasmcsi_csi::reconcile::Rounds {
                interval,
                abandoned_clone_after: options
                    .abandon_clones_after
                    .unwrap_or(wasmcsi_csi::reconcile::DEFAULT_ABANDONED_CLONE_AFTER),
            }),
        },
        wasmcsi::host::DataPathPlace::InProcess,
        wasmcsi::host::PeerOptions::default(),
        options.trust,
    )
    .await
    .unwrap_or_else(|e| panic!("host {node_id} did not start: {e:#}"));
    assert!(host.registry.get(BACKEND).is_some(), "the {BACKEND} component loads");
    host
}

/// `wasmcsi volume status --volume-id SET --replica …` as an operator runs it (the real binary).
pub async fn volume_status(set: &str, replicas: &[SocketAddr]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_wasmcsi"));
    cmd.args(["volume", "status", "--volume-id", set]);
    for r in replicas {
        cmd.arg("--replica").arg(r.to_string());
    }
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "volume status failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    text
}

/// On a panic, takes down by force what the CSI calls left under its directory (the engines
/// die with the process, their mounts would not): every mount but FUSE's, the loop devices
/// whose backing file is there, then the FUSE mounts. So no failed assertion leaves them behind.
pub struct Sweep(pub PathBuf);

impl Drop for Sweep {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let prefix = format!("{}/", self.0.display());
        let table = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut mounts: Vec<(&str, bool)> = table
            .lines()
            .filter_map(|l| {
                let mut f = l.split(' ');
                let (point, fs) = (f.nth(1)?, f.next()?);
                point.starts_with(&prefix).then_some((point, fs.starts_with("fuse")))
            })
            .collect();
        mounts.sort_by_key(|(p, fuse)| (*fuse, std::cmp::Reverse(p.len())));
        let unmount = |p: &str| {
            let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
        };
        mounts.iter().filter(|(_, fuse)| !fuse).for_each(|(p, _)| unmount(p));
        for entry in std::fs::read_dir("/sys/block").into_iter().flatten().flatten() {
            let backing = std::fs::read_to_string(entry.path().join("loop/backing_file")).unwrap_or_default();
            if backing.starts_with(&prefix) {
                let dev = Path::new("/dev").join(entry.file_name());
                let _ = std::process::Command::new("losetup").arg("-d").arg(&dev).status();
            }
        }
        mounts.iter().filter(|(_, fuse)| *fuse).for_each(|(p, _)| unmount(p));
    }
}

/// Its replica server's address (where `volume_status` and the replica-nodes file reach it).
pub fn addr(host: &Host) -> SocketAddr {
    host.datapath.as_ref().expect("data path").local_addr()
}

/// Parameters from pairs.
pub fn map(kv: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    kv.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()
}

/// The nodes `status` (`wasmcsi volume status`) lists a healthy replica on, sorted.
pub fn healthy_on(status: &str) -> Vec<String> {
    let mut nodes: Vec<String> = status
        .lines()
        .filter_map(|l| l.trim_start().split_once("/default  healthy").map(|(node, _)| node.to_owned()))
        .collect();
    nodes.sort();
    nodes
}
