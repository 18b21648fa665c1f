//! The world's exports: each call is one call of the SDK's fake (or of [`PreopenDir`]), its
//! arguments and answer converted by [`To`]. NFS exports and RBD pools are granted on first use.
use crate::convert::{To, answer};
use crate::dir::PreopenDir;
use crate::wit::exports::wasmcsi::backend::types::{Error, Pair, SecretRef};
use crate::wit::exports::wasmcsi::backend::{block, dir, kv, log, nfs, rbd};
use wasmcsi_backend_sdk::block::Block as _;
use wasmcsi_backend_sdk::dir::Dir as _;
use wasmcsi_backend_sdk::fake::FakeHost;
use wasmcsi_backend_sdk::kv::Kv as _;
use wasmcsi_backend_sdk::nfs::Nfs as _;
use wasmcsi_backend_sdk::rbd::{Rbd as _, Target};
use wasmcsi_backend_sdk::{self as sdk};

struct State {
    fakes: FakeHost,
    dir: PreopenDir,
}

thread_local! {
    static STATE: State = {
        let fakes = FakeHost::new();
        for node in crate::BLOCK_NODES {
            fakes.block.add_node(node, crate::BLOCK_NODE_BYTES, &[("topology.wasmcsi.io/node", node)]);
        }
        State { fakes, dir: PreopenDir::new("/") }
    };
}

fn with<T>(f: impl FnOnce(&State) -> T) -> T {
    STATE.with(f)
}

/// The exported capabilities.
pub struct Provider;

fn export_of(target: nfs::NfsExport, s: &State) -> sdk::nfs::NfsExport {
    s.fakes.nfs.add_export(&target.server, &target.share)
}

fn pool(cluster: &str, pool: &str, s: &State) -> Target {
    s.fakes.rbd.add_pool(cluster, pool)
}

fn secrets(list: Vec<SecretRef>) -> Vec<sdk::types::SecretRef> {
    list.to()
}

impl log::Guest for Provider {
    fn log(level: log::Level, message: String, fields: Vec<(String, String)>) {
        let level = match level {
            log::Level::Trace => "TRACE",
            log::Level::Debug => "DEBUG",
            log::Level::Info => "INFO",
            log::Level::Warn => "WARN",
            log::Level::Error => "ERROR",
        };
        let fields: String = fields.iter().map(|(k, v)| format!(" {k}={v:?}")).collect();
        eprintln!("{level} {message}{fields}");
    }
}

impl kv::Guest for Provider {
    fn get(key: String) -> Result<Option<Vec<u8>>, Error> {
        with(|s| answer(s.fakes.kv.get(&key)))
    }
    fn set(key: String, value: Vec<u8>) -> Result<(), Error> {
        with(|s| answer(s.fakes.kv.set(&key, &value)))
    }
    fn delete(key: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.kv.delete(&key)))
    }
    fn compare_and_swap(key: String, expected: Option<Vec<u8>>, new: Option<Vec<u8>>) -> Result<bool, Error> {
        with(|s| answer(s.fakes.kv.compare_and_swap(&key, expected.as_deref(), new.as_deref())))
    }
    fn list_keys(prefix: String, start_after: Option<String>, limit: u32) -> Result<Vec<String>, Error> {
        with(|s| answer(s.fakes.kv.list_keys(&prefix, start_after.as_deref(), limit)))
    }
}

impl dir::Guest for Provider {
    fn roots() -> Vec<String> {
        with(|s| s.dir.roots())
    }
    fn mkdir(root: String, path: String, mode: u32) -> Result<(), Error> {
        with(|s| answer(s.dir.mkdir(&root, &path, mode)))
    }
    fn stat(root: String, path: String) -> Result<Option<dir::FileStat>, Error> {
        with(|s| answer(s.dir.stat(&root, &path)))
    }
    fn read_dir(root: String, path: String) -> Result<Vec<String>, Error> {
        with(|s| answer(s.dir.read_dir(&root, &path)))
    }
    fn read_file(root: String, path: String) -> Result<Vec<u8>, Error> {
        with(|s| answer(s.dir.read_file(&root, &path)))
    }
    fn write_file(root: String, path: String, data: Vec<u8>) -> Result<(), Error> {
        with(|s| answer(s.dir.write_file(&root, &path, &data)))
    }
    fn copy_tree(root: String, from: String, to: String) -> Result<(), Error> {
        with(|s| answer(s.dir.copy_tree(&root, &from, &to)))
    }
    fn rename(root: String, from: String, to: String) -> Result<(), Error> {
        with(|s| answer(s.dir.rename(&root, &from, &to)))
    }
    fn remove_all(root: String, path: String) -> Result<(), Error> {
        with(|s| answer(s.dir.remove_all(&root, &path)))
    }
    fn usage(root: String, path: String) -> Result<u64, Error> {
        with(|s| answer(s.dir.usage(&root, &path)))
    }
    fn fs_stats(root: String) -> Result<dir::Space, Error> {
        with(|s| answer(s.dir.fs_stats(&root)))
    }
}

impl nfs::Guest for Provider {
    fn mkdir(target: nfs::NfsExport, path: String, mode: u32, uid: u32, gid: u32) -> Result<(), Error> {
        with(|s| answer(s.fakes.nfs.mkdir(&export_of(target, s), &path, mode, uid, gid)))
    }
    fn stat(target: nfs::NfsExport, path: String) -> Result<Option<nfs::FileStat>, Error> {
        with(|s| answer(s.fakes.nfs.stat(&export_of(target, s), &path)))
    }
    fn read_dir(target: nfs::NfsExport, path: String) -> Result<Vec<String>, Error> {
        with(|s| answer(s.fakes.nfs.read_dir(&export_of(target, s), &path)))
    }
    fn read_file(target: nfs::NfsExport, path: String) -> Result<Vec<u8>, Error> {
        with(|s| answer(s.fakes.nfs.read_file(&export_of(target, s), &path)))
    }
    fn write_file(target: nfs::NfsExport, path: String, data: Vec<u8>) -> Result<(), Error> {
        with(|s| answer(s.fakes.nfs.write_file(&export_of(target, s), &path, &data)))
    }
    fn copy_tree(target: nfs::NfsExport, from: String, to: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.nfs.copy_tree(&export_of(target, s), &from, &to)))
    }
    fn copy_tree_background(target: nfs::NfsExport, from: String, to: String) -> Result<nfs::CopyProgress, Error> {
        with(|s| answer(s.fakes.nfs.copy_tree_background(&export_of(target, s), &from, &to)))
    }
    fn cancel_copy(target: nfs::NfsExport, to: String) {
        with(|s| s.fakes.nfs.cancel_copy(&export_of(target, s), &to))
    }
    fn rename(target: nfs::NfsExport, from: String, to: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.nfs.rename(&export_of(target, s), &from, &to)))
    }
    fn remove_all(target: nfs::NfsExport, path: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.nfs.remove_all(&export_of(target, s), &path)))
    }
    fn usage(target: nfs::NfsExport, path: String) -> Result<u64, Error> {
        with(|s| answer(s.fakes.nfs.usage(&export_of(target, s), &path)))
    }
    fn fs_stats(target: nfs::NfsExport) -> Result<nfs::Space, Error> {
        with(|s| answer(s.fakes.nfs.fs_stats(&export_of(target, s))))
    }
}

impl block::Guest for Provider {
    fn list_nodes() -> Result<Vec<block::NodeInfo>, Error> {
        with(|s| answer(s.fakes.block.list_nodes()))
    }
    fn create(
        id: String,
        size_bytes: u64,
        nodes: Vec<String>,
        source: Option<block::BlockSource>,
        metadata: Vec<Pair>,
    ) -> Result<block::ReplicaSet, Error> {
        let source: Option<sdk::block::BlockSource> = source.to();
        let metadata: Vec<sdk::types::Pair> = metadata.to();
        with(|s| answer(s.fakes.block.create(&id, size_bytes, &nodes, source.as_ref(), &metadata)))
    }
    fn get(id: String) -> Result<Option<block::ReplicaSet>, Error> {
        with(|s| answer(s.fakes.block.get(&id)))
    }
    fn list_sets(start_after: Option<String>, limit: u32) -> Result<Vec<block::ReplicaSet>, Error> {
        with(|s| answer(s.fakes.block.list_sets(start_after.as_deref(), limit)))
    }
    fn set_metadata(id: String, metadata: Vec<Pair>) -> Result<(), Error> {
        let metadata: Vec<sdk::types::Pair> = metadata.to();
        with(|s| answer(s.fakes.block.set_metadata(&id, &metadata)))
    }
    fn delete(id: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.block.delete(&id)))
    }
    fn expand(id: String, size_bytes: u64) -> Result<block::ReplicaSet, Error> {
        with(|s| answer(s.fakes.block.expand(&id, size_bytes)))
    }
    fn replace(id: String, node: String, with_node: String) -> Result<block::ReplicaSet, Error> {
        with(|s| answer(s.fakes.block.replace(&id, &node, &with_node)))
    }
    fn snapshot(id: String, name: String) -> Result<block::BlockSnapshot, Error> {
        with(|s| answer(s.fakes.block.snapshot(&id, &name)))
    }
    fn delete_snapshot(id: String, name: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.block.delete_snapshot(&id, &name)))
    }
    fn list_snapshots(id: Option<String>) -> Result<Vec<block::BlockSnapshot>, Error> {
        with(|s| answer(s.fakes.block.list_snapshots(id.as_deref())))
    }
}

impl rbd::Guest for Provider {
    fn create(
        cluster: String,
        pool_name: String,
        name: String,
        size_bytes: u64,
        features: Vec<String>,
        data_pool: Option<String>,
        metadata: Vec<(String, String)>,
        secret_refs: Vec<SecretRef>,
    ) -> Result<(), Error> {
        with(|s| {
            let t = pool(&cluster, &pool_name, s);
            let sec = secrets(secret_refs);
            answer(s.fakes.rbd.create(&t, &name, size_bytes, &features, data_pool.as_deref(), &metadata, &sec))
        })
    }
    fn info(
        cluster: String,
        pool_name: String,
        name: String,
        secret_refs: Vec<SecretRef>,
    ) -> Result<Option<rbd::ImageInfo>, Error> {
        with(|s| answer(s.fakes.rbd.info(&pool(&cluster, &pool_name, s), &name, &secrets(secret_refs))))
    }
    fn find_by_metadata(
        cluster: String,
        pool_name: String,
        key: String,
        value: String,
        secret_refs: Vec<SecretRef>,
    ) -> Result<Vec<String>, Error> {
        with(|s| {
            answer(s.fakes.rbd.find_by_metadata(&pool(&cluster, &pool_name, s), &key, &value, &secrets(secret_refs)))
        })
    }
    fn remove(cluster: String, pool_name: String, name: String, secret_refs: Vec<SecretRef>) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.remove(&pool(&cluster, &pool_name, s), &name, &secrets(secret_refs))))
    }
    fn resize(
        cluster: String,
        pool_name: String,
        name: String,
        size_bytes: u64,
        secret_refs: Vec<SecretRef>,
    ) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.resize(&pool(&cluster, &pool_name, s), &name, size_bytes, &secrets(secret_refs))))
    }
    fn snapshot_create(
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        secret_refs: Vec<SecretRef>,
    ) -> Result<rbd::ImageSnapshot, Error> {
        with(|s| {
            answer(s.fakes.rbd.snapshot_create(&pool(&cluster, &pool_name, s), &image, &snap, &secrets(secret_refs)))
        })
    }
    fn snapshot_remove(
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        secret_refs: Vec<SecretRef>,
    ) -> Result<(), Error> {
        with(|s| {
            answer(s.fakes.rbd.snapshot_remove(&pool(&cluster, &pool_name, s), &image, &snap, &secrets(secret_refs)))
        })
    }
    fn snapshot_protect(
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        secret_refs: Vec<SecretRef>,
    ) -> Result<(), Error> {
        with(|s| {
            answer(s.fakes.rbd.snapshot_protect(&pool(&cluster, &pool_name, s), &image, &snap, &secrets(secret_refs)))
        })
    }
    fn snapshot_list(
        cluster: String,
        pool_name: String,
        image: String,
        secret_refs: Vec<SecretRef>,
    ) -> Result<Vec<rbd::ImageSnapshot>, Error> {
        with(|s| answer(s.fakes.rbd.snapshot_list(&pool(&cluster, &pool_name, s), &image, &secrets(secret_refs))))
    }
    fn clone(
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        child_pool: String,
        child: String,
        features: Vec<String>,
        secret_refs: Vec<SecretRef>,
    ) -> Result<(), Error> {
        with(|s| {
            // The child's pool is granted too (a clone may go to another pool of the cluster).
            pool(&cluster, &child_pool, s);
            let t = pool(&cluster, &pool_name, s);
            answer(s.fakes.rbd.clone_image(&t, &image, &snap, &child_pool, &child, &features, &secrets(secret_refs)))
        })
    }
    fn flatten(cluster: String, pool_name: String, image: String, secret_refs: Vec<SecretRef>) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.flatten(&pool(&cluster, &pool_name, s), &image, &secrets(secret_refs))))
    }
    fn children(
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        secret_refs: Vec<SecretRef>,
    ) -> Result<Vec<String>, Error> {
        with(|s| answer(s.fakes.rbd.children(&pool(&cluster, &pool_name, s), &image, &snap, &secrets(secret_refs))))
    }
    fn stats(cluster: String, pool_name: String, secret_refs: Vec<SecretRef>) -> Result<rbd::PoolStats, Error> {
        with(|s| answer(s.fakes.rbd.stats(&pool(&cluster, &pool_name, s), &secrets(secret_refs))))
    }
}
