//! What the bind-mount node tests (`node_paths`, `node_single_writer`) share: a natively linked
//! backend that plans every volume as the directory of its id under the granted root `data`, a
//! node's directory tree that detaches every mount under it when dropped (also after a failed
//! assertion), and a node plugin over that tree as freshly started (nothing in memory).
use std::path::{Path, PathBuf};
use std::sync::Arc;

use wasmcsi_csi::node::mounts::KernelMounts;
use wasmcsi_csi::node::{Attachers, NodeService, NodeSetup};
use wasmcsi_csi::plugin::{Mode, Plugin};
use wasmcsi_mountinfo as mountinfo;
use wasmcsi_runtime::bindings::driver::*;
use wasmcsi_runtime::bindings::types::Error;
use wasmcsi_runtime::config::HostConfig;
use wasmcsi_runtime::native::{Guest, NativeDriver};
use wasmcsi_runtime::{Registry, Runtime, RuntimeOptions};

/// Plans every volume as the directory of its id under the root `data`.
struct Dirs;

impl Guest for Dirs {
    fn info() -> BackendInfo {
        BackendInfo { name: "dirs".into(), version: "0".into(), parameters: vec![], features: vec![] }
    }
    fn attach_plan(
        volume_id: String,
        _: Vec<Pair>,
        _: VolumeCapability,
        _: Vec<SecretRef>,
    ) -> Result<Attachment, Error> {
        Ok(Attachment::Bind(BindPlan { root: "data".into(), path: volume_id, capacity_bytes: 1 << 20 }))
    }
}

/// A node's directories under a fresh temporary directory (`data/` is the granted root);
/// dropping it detaches every mount under it first, also after a failed assertion.
pub struct Tree {
    /// The canonical path of the directory: the mount table spells paths canonically.
    pub root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Tree {
    fn drop(&mut self) {
        for _ in 0..16 {
            let Ok(table) = mountinfo::read_current() else { return };
            let mut inside: Vec<_> = table.iter().filter(|e| e.mount_point.starts_with(&self.root)).collect();
            if inside.is_empty() {
                return;
            }
            inside.sort_by_key(|e| std::cmp::Reverse(e.mount_id));
            for entry in inside {
                let _ = nix::mount::umount2(&entry.mount_point, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

/// A fresh tree with the directories `subdirs` made; `None`, saying why, when not root.
pub fn tree(subdirs: &[&str]) -> Option<Tree> {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipping: bind mounts need root");
        return None;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().canonicalize().expect("canonical");
    for sub in subdirs {
        std::fs::create_dir_all(root.join(sub)).expect("tree");
    }
    Some(Tree { root, _dir: dir })
}

/// A node plugin (node `node-1`) over `tree`, as freshly started: nothing in memory, its
/// metadata store the file `store` and its state the directory `state` under the tree's root.
pub fn service(tree: &Tree, store: &str, state: &str) -> NodeService {
    let root = &tree.root;
    let toml = format!("[backends.dirs.grants]\ndir = {{ data = \"{}/data\" }}\n", root.display());
    let config = HostConfig::parse(&toml, Path::new("test")).expect("config");
    let runtime = Runtime::new(RuntimeOptions {
        config: config.clone(),
        cache_dir: None,
        store_path: root.join(store),
        wasm_engine: Default::default(),
    })
    .expect("runtime");
    let registry = Registry::new(runtime.clone(), None, None);
    registry.insert(runtime.load_native("dirs", NativeDriver::of::<Dirs>()).expect("native backend"));
    NodeService(Arc::new(Plugin {
        name: "wasmcsi.test".into(),
        version: "0".into(),
        mode: Mode::Node,
        node_id: "node-1".into(),
        registry,
        inflight: Default::default(),
        node_local: Default::default(),
        nodes: Default::default(),
        grant_signer: None,
        attachers: Attachers::new(NodeSetup {
            node_id: "node-1".into(),
            state_dir: root.join(state),
            config: Arc::new(config),
            mounts: Arc::new(KernelMounts),
            runtime_dir: root.join("run"),
            datapath: None,
        }),
    }))
}
