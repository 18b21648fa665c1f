//! The world's exports: each call is one call of the SDK's fake (or of [`PreopenDir`]), its
//! arguments and answer converted by [`To`]. NFS exports and RBD pools are granted on first use;
//! no backup target is granted (a wasmcsi host does not provide backups yet either).
use crate::convert::{To, answer};
use crate::dir::PreopenDir;
use crate::wit::exports::wasmcsi::backend::types::{Error, IoLimits, Pair, SecretRef};
use crate::wit::exports::wasmcsi::backend::{backup, block, dir, kv, log, nfs, rbd};
use wasmcsi_backend_sdk::backup::Backup as _;
use wasmcsi_backend_sdk::block::Block as _;
use wasmcsi_backend_sdk::dir::Dir as _;
use wasmcsi_backend_sdk::fake::FakeHost;
use wasmcsi_backend_sdk::kv::Kv as _;
use wasmcsi_backend_sdk::nfs::Nfs as _;
use wasmcsi_backend_sdk::rbd::{Rbd as _, RbdPool};
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

/// The pool as the SDK's fake takes it, granted (every pool is, on first use).
fn granted(pool: rbd::RbdPool, s: &State) -> RbdPool {
    let pool: RbdPool = pool.to();
    s.fakes.rbd.add_pool(&pool.cluster, &pool.pool);
    pool
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
        placements: Vec<block::Placement>,
        source: Option<block::BlockSource>,
        metadata: Vec<Pair>,
    ) -> Result<block::ReplicaSet, Error> {
        let placements: Vec<sdk::block::Placement> = placements.to();
        let source: Option<sdk::block::BlockSource> = source.to();
        let metadata: Vec<sdk::types::Pair> = metadata.to();
        with(|s| answer(s.fakes.block.create(&id, size_bytes, &placements, source.as_ref(), &metadata)))
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
    fn replace(
        id: String,
        replica: block::Placement,
        with_placement: block::Placement,
    ) -> Result<block::ReplicaSet, Error> {
        let (replica, to): (sdk::block::Placement, sdk::block::Placement) = (replica.to(), with_placement.to());
        with(|s| answer(s.fakes.block.replace(&id, &replica, &to)))
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
    fn set_limits(id: String, limits: IoLimits, rebuild_bytes_per_second: u64) -> Result<block::ReplicaSet, Error> {
        let limits: sdk::types::IoLimits = limits.to();
        with(|s| answer(s.fakes.block.set_limits(&id, &limits, rebuild_bytes_per_second)))
    }
    fn add_replica(id: String, placement: block::Placement) -> Result<block::ReplicaSet, Error> {
        let placement: sdk::block::Placement = placement.to();
        with(|s| answer(s.fakes.block.add_replica(&id, &placement)))
    }
    fn remove_replica(id: String, replica: block::Placement) -> Result<block::ReplicaSet, Error> {
        let replica: sdk::block::Placement = replica.to();
        with(|s| answer(s.fakes.block.remove_replica(&id, &replica)))
    }
    fn snapshot_group(ids: Vec<String>, name: String) -> Result<Vec<block::BlockSnapshot>, Error> {
        with(|s| answer(s.fakes.block.snapshot_group(&ids, &name)))
    }
    fn follow(id: String, target: String, source_volume: String) -> Result<block::ReplicaSet, Error> {
        with(|s| answer(s.fakes.block.follow(&id, &target, &source_volume)))
    }
    fn activate(id: String) -> Result<block::ReplicaSet, Error> {
        with(|s| answer(s.fakes.block.activate(&id)))
    }
}

impl rbd::Guest for Provider {
    fn create(
        pool: rbd::RbdPool,
        name: String,
        size_bytes: u64,
        features: Vec<String>,
        data_pool: Option<String>,
        metadata: Vec<(String, String)>,
    ) -> Result<(), Error> {
        with(|s| {
            let p = granted(pool, s);
            if let Some(dp) = &data_pool {
                s.fakes.rbd.add_pool(&p.cluster, dp);
            }
            answer(s.fakes.rbd.create(&p, &name, size_bytes, &features, data_pool.as_deref(), &metadata))
        })
    }
    fn info(pool: rbd::RbdPool, name: String) -> Result<Option<rbd::ImageInfo>, Error> {
        with(|s| answer(s.fakes.rbd.info(&granted(pool, s), &name)))
    }
    fn find_by_metadata(pool: rbd::RbdPool, key: String, value: String) -> Result<Vec<String>, Error> {
        with(|s| answer(s.fakes.rbd.find_by_metadata(&granted(pool, s), &key, &value)))
    }
    fn remove(pool: rbd::RbdPool, name: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.remove(&granted(pool, s), &name)))
    }
    fn resize(pool: rbd::RbdPool, name: String, size_bytes: u64) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.resize(&granted(pool, s), &name, size_bytes)))
    }
    fn snapshot_create(pool: rbd::RbdPool, image: String, snap: String) -> Result<rbd::ImageSnapshot, Error> {
        with(|s| answer(s.fakes.rbd.snapshot_create(&granted(pool, s), &image, &snap)))
    }
    fn snapshot_remove(pool: rbd::RbdPool, image: String, snap: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.snapshot_remove(&granted(pool, s), &image, &snap)))
    }
    fn snapshot_protect(pool: rbd::RbdPool, image: String, snap: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.snapshot_protect(&granted(pool, s), &image, &snap)))
    }
    fn snapshot_list(pool: rbd::RbdPool, image: String) -> Result<Vec<rbd::ImageSnapshot>, Error> {
        with(|s| answer(s.fakes.rbd.snapshot_list(&granted(pool, s), &image)))
    }
    fn clone(
        pool: rbd::RbdPool,
        image: String,
        snap: String,
        child_pool: String,
        child: String,
        features: Vec<String>,
    ) -> Result<(), Error> {
        with(|s| {
            let p = granted(pool, s);
            // The child's pool is granted too (a clone may go to another pool of the cluster).
            s.fakes.rbd.add_pool(&p.cluster, &child_pool);
            answer(s.fakes.rbd.clone_image(&p, &image, &snap, &child_pool, &child, &features))
        })
    }
    fn flatten(pool: rbd::RbdPool, image: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.flatten(&granted(pool, s), &image)))
    }
    fn children(pool: rbd::RbdPool, image: String, snap: String) -> Result<Vec<String>, Error> {
        with(|s| answer(s.fakes.rbd.children(&granted(pool, s), &image, &snap)))
    }
    fn stats(pool: rbd::RbdPool) -> Result<rbd::PoolStats, Error> {
        with(|s| answer(s.fakes.rbd.stats(&granted(pool, s))))
    }
    fn set_qos(pool: rbd::RbdPool, image: String, limits: IoLimits) -> Result<(), Error> {
        let limits: sdk::types::IoLimits = limits.to();
        with(|s| answer(s.fakes.rbd.set_qos(&granted(pool, s), &image, &limits)))
    }
    fn group_snapshot(
        pool: rbd::RbdPool,
        group: String,
        images: Vec<String>,
        snap: String,
    ) -> Result<Vec<rbd::ImageSnapshot>, Error> {
        with(|s| answer(s.fakes.rbd.group_snapshot(&granted(pool, s), &group, &images, &snap)))
    }
    fn group_snapshot_remove(pool: rbd::RbdPool, group: String, snap: String) -> Result<(), Error> {
        with(|s| answer(s.fakes.rbd.group_snapshot_remove(&granted(pool, s), &group, &snap)))
    }
    fn snapshot_copy(
        pool: rbd::RbdPool,
        image: String,
        snap: String,
        child_pool: String,
        child: String,
        features: Vec<String>,
        metadata: Vec<(String, String)>,
    ) -> Result<rbd::CopyProgress, Error> {
        with(|s| {
            answer(s.fakes.rbd.snapshot_copy(
                &granted(pool, s),
                &image,
                &snap,
                &child_pool,
                &child,
                &features,
                &metadata,
            ))
        })
    }
}

impl backup::Guest for Provider {
    fn targets() -> Vec<String> {
        with(|s| s.fakes.backup.targets())
    }
    fn start(
        target: String,
        name: String,
        source: backup::BackupSource,
        labels: Vec<Pair>,
        secret_refs: Vec<SecretRef>,
    ) -> Result<backup::BackupInfo, Error> {
        let source: sdk::backup::BackupSource = source.to();
        let labels: Vec<sdk::types::Pair> = labels.to();
        with(|s| answer(s.fakes.backup.start(&target, &name, &source, &labels, &secrets(secret_refs))))
    }
    fn get(target: String, id: String, secret_refs: Vec<SecretRef>) -> Result<Option<backup::BackupInfo>, Error> {
        with(|s| answer(s.fakes.backup.get(&target, &id, &secrets(secret_refs))))
    }
    fn list(
        target: String,
        volume_id: Option<String>,
        start_after: Option<String>,
        limit: u32,
        secret_refs: Vec<SecretRef>,
    ) -> Result<Vec<backup::BackupInfo>, Error> {
        with(|s| {
            let list = s.fakes.backup.list(
                &target,
                volume_id.as_deref(),
                start_after.as_deref(),
                limit,
                &secrets(secret_refs),
            );
            answer(list)
        })
    }
    fn delete(target: String, id: String, secret_refs: Vec<SecretRef>) -> Result<(), Error> {
        with(|s| answer(s.fakes.backup.delete(&target, &id, &secrets(secret_refs))))
    }
}
