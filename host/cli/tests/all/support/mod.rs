//! Shared by this crate's CSI-socket flow tests (`crate::support` of `tests/all`) and its benches
//! (`#[path = "../tests/all/support/mod.rs"] mod support;`): request pieces, and a real host
//! serving a bundled backend against a real cluster.
#![allow(dead_code, unused_imports, reason = "each test or bench binary uses a part")]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test support")]

pub mod cluster;
pub mod csi;
pub mod direct;
pub mod lan;
pub mod process;
pub mod replicated;

pub use csi::{from_snapshot, from_volume, single_node_writer};

use std::path::Path;
use std::time::Duration;

use wasmcsi::host::{Host, HostOptions};
use wasmcsi_ceph::{CLUSTER, Ceph};

/// Pseudo-random bytes (xorshift), different for each seed.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Writes `data` to `path` and makes it durable, as a database does before it acknowledges.
pub fn write_durably(path: &Path, data: &[u8]) {
    use std::io::Write as _;
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
    nix::unistd::syncfs(&f).unwrap();
}

/// Why a test that mounts replicated volumes (FUSE, loop devices) cannot run here, if it cannot:
/// it needs root and `/dev/fuse`. Tests needing more tools check them after this.
pub fn needs_root_and_fuse() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse missing".into());
    }
    None
}

/// Runs `flow` as a test that mounts replicated volumes does (on a runtime of four workers:
/// hosts, engines and the test's own I/O at once), or says why it is skipped
/// ([`needs_root_and_fuse`]).
pub fn run_with_fuse(flow: impl std::future::Future<Output = ()>) {
    if let Some(why) = needs_root_and_fuse() {
        eprintln!("skipped: {why}");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap();
    rt.block_on(flow);
}

/// A host (controller + node, node id `node_id`) serving the ceph-rbd-shim component loaded
/// from disk, granted `pool` of `ceph`'s cluster; component, state and socket under `dir`.
pub async fn ceph_rbd_shim_host(ceph: &Ceph, pool: &str, dir: &Path, node_id: &str) -> Host {
    let config = format!(
        "[runtime]\ncall_deadline_ms = 60000\nimport_timeout_ms = 30000\n\
         [clusters.{CLUSTER}]\nmonitors = {:?}\n\
         [backends.ceph-rbd-shim.grants]\nrbd = [{{ cluster = {CLUSTER:?}, pools = [{pool:?}] }}]\n",
        ceph.monitors()
    );
    host_with("ceph-rbd-shim", wasmcsi_artifacts::CEPH_RBD_SHIM, "rbd.wasmcsi.io", node_id, &config, dir).await
}

/// A host (controller + node) serving one component, `backend`, loaded from disk with `config`;
/// component, state and socket under `dir`.
pub async fn host_with(backend: &str, wasm: &[u8], driver: &str, node_id: &str, config: &str, dir: &Path) -> Host {
    let backends = dir.join("backends");
    std::fs::create_dir_all(&backends).unwrap();
    std::fs::write(backends.join(format!("{backend}.wasm")), wasm).unwrap();
    let host = Host::start(HostOptions {
        driver_name: driver.into(),
        mode: wasmcsi_csi::Mode::All,
        node_id: node_id.into(),
        socket: dir.join("csi.sock"),
        config: wasmcsi_runtime::config::HostConfig::parse(config, Path::new("test")).unwrap(),
        config_file: None,
        backends_dir: Some(backends),
        state_dir: dir.join("state"),
        reload_interval: Duration::from_secs(3600),
        metrics_addr: None,
        replicas: None,
        reconcile: None,
    })
    .await
    .expect("host");
    assert!(host.registry.get(backend).is_some(), "the {backend} component loads");
    host
}
