//! [`Host`]: the capabilities a backend reaches, one accessor each. Three hosts exist:
//!
//! ```text
//!                 ┌─────────────── Host ─────────────────┐
//!                 │ kv  log  dir  nfs  rbd  block backup │   (one trait per capability)
//!                 └──────────────────────────────────────┘
//!       Imports (wasm32)     FakeHost (feature "fake")    a native host (wasmcsi-runtime,
//!   the component's imports   in memory, for unit tests   feature "native", benches only)
//! ```
//!
//! [`Ungranted`] answers every call of a capability with permission-denied: the part of a
//! host that grants nothing (a native host's `nfs`, a test host without `rbd`).
use crate::backup::{Backup, BackupImport, BackupInfo, BackupSource};
use crate::block::{Block, BlockImport, BlockSnapshot, BlockSource, NodeInfo, Placement, ReplicaSet};
use crate::dir::{Dir, DirImport, FileStat, Space};
use crate::kv::{Kv, KvImport};
use crate::log::{Log, LogImport};
use crate::nfs::{CopyProgress, Nfs, NfsExport, NfsImport};
use crate::rbd::{ImageInfo, ImageSnapshot, PoolStats, Rbd, RbdImport, RbdPool};
use crate::types::{Error, IoLimits, Pair, SecretRef};

/// What a backend can import. Reached through `&impl Host` (static dispatch): a capability a
/// backend never calls is not linked, so its component does not import it.
pub trait Host {
    type Kv: Kv;
    type Log: Log;
    type Dir: Dir;
    type Nfs: Nfs;
    type Rbd: Rbd;
    type Block: Block;
    type Backup: Backup;
    fn kv(&self) -> &Self::Kv;
    fn log(&self) -> &Self::Log;
    fn dir(&self) -> &Self::Dir;
    fn nfs(&self) -> &Self::Nfs;
    fn rbd(&self) -> &Self::Rbd;
    fn block(&self) -> &Self::Block;
    fn backup(&self) -> &Self::Backup;
}

/// The component's imports: the host of a backend loaded by wasmcsi. Natively every call
/// panics (wit-bindgen's stubs): native code uses a fake or a native host instead.
#[derive(Debug, Clone, Copy, Default)]
pub struct Imports;

impl Host for Imports {
    type Kv = KvImport;
    type Log = LogImport;
    type Dir = DirImport;
    type Nfs = NfsImport;
    type Rbd = RbdImport;
    type Block = BlockImport;
    type Backup = BackupImport;
    fn kv(&self) -> &KvImport {
        &KvImport
    }
    fn log(&self) -> &LogImport {
        &LogImport
    }
    fn dir(&self) -> &DirImport {
        &DirImport
    }
    fn nfs(&self) -> &NfsImport {
        &NfsImport
    }
    fn rbd(&self) -> &RbdImport {
        &RbdImport
    }
    fn block(&self) -> &BlockImport {
        &BlockImport
    }
    fn backup(&self) -> &BackupImport {
        &BackupImport
    }
}

/// A capability that is not granted: every call fails with permission-denied naming it
/// (`dir` lists no roots, `backup` no targets, `cancel-copy` does nothing).
#[derive(Debug, Clone, Copy, Default)]
pub struct Ungranted;

fn denied<T>(capability: &str) -> Result<T, Error> {
    Err(Error::PermissionDenied(format!("capability {capability} is not granted to this backend")))
}

impl Kv for Ungranted {
    fn get(&self, _: &str) -> Result<Option<Vec<u8>>, Error> {
        denied("kv")
    }
    fn set(&self, _: &str, _: &[u8]) -> Result<(), Error> {
        denied("kv")
    }
    fn delete(&self, _: &str) -> Result<(), Error> {
        denied("kv")
    }
    fn compare_and_swap(&self, _: &str, _: Option<&[u8]>, _: Option<&[u8]>) -> Result<bool, Error> {
        denied("kv")
    }
    fn list_keys(&self, _: &str, _: Option<&str>, _: u32) -> Result<Vec<String>, Error> {
        denied("kv")
    }
}

impl Dir for Ungranted {
    fn roots(&self) -> Vec<String> {
        Vec::new()
    }
    fn mkdir(&self, _: &str, _: &str, _: u32) -> Result<(), Error> {
        denied("dir")
    }
    fn stat(&self, _: &str, _: &str) -> Result<Option<FileStat>, Error> {
        denied("dir")
    }
    fn read_dir(&self, _: &str, _: &str) -> Result<Vec<String>, Error> {
        denied("dir")
    }
    fn read_file(&self, _: &str, _: &str) -> Result<Vec<u8>, Error> {
        denied("dir")
    }
    fn write_file(&self, _: &str, _: &str, _: &[u8]) -> Result<(), Error> {
        denied("dir")
    }
    fn copy_tree(&self, _: &str, _: &str, _: &str) -> Result<(), Error> {
        denied("dir")
    }
    fn rename(&self, _: &str, _: &str, _: &str) -> Result<(), Error> {
        denied("dir")
    }
    fn remove_all(&self, _: &str, _: &str) -> Result<(), Error> {
        denied("dir")
    }
    fn usage(&self, _: &str, _: &str) -> Result<u64, Error> {
        denied("dir")
    }
    fn fs_stats(&self, _: &str) -> Result<Space, Error> {
        denied("dir")
    }
}

impl Nfs for Ungranted {
    fn mkdir(&self, _: &NfsExport, _: &str, _: u32, _: u32, _: u32) -> Result<(), Error> {
        denied("nfs")
    }
    fn stat(&self, _: &NfsExport, _: &str) -> Result<Option<FileStat>, Error> {
        denied("nfs")
    }
    fn read_dir(&self, _: &NfsExport, _: &str) -> Result<Vec<String>, Error> {
        denied("nfs")
    }
    fn read_file(&self, _: &NfsExport, _: &str) -> Result<Vec<u8>, Error> {
        denied("nfs")
    }
    fn write_file(&self, _: &NfsExport, _: &str, _: &[u8]) -> Result<(), Error> {
        denied("nfs")
    }
    fn copy_tree(&self, _: &NfsExport, _: &str, _: &str) -> Result<(), Error> {
        denied("nfs")
    }
    fn copy_tree_background(&self, _: &NfsExport, _: &str, _: &str) -> Result<CopyProgress, Error> {
        denied("nfs")
    }
    fn cancel_copy(&self, _: &NfsExport, _: &str) {}
    fn rename(&self, _: &NfsExport, _: &str, _: &str) -> Result<(), Error> {
        denied("nfs")
    }
    fn remove_all(&self, _: &NfsExport, _: &str) -> Result<(), Error> {
        denied("nfs")
    }
    fn usage(&self, _: &NfsExport, _: &str) -> Result<u64, Error> {
        denied("nfs")
    }
    fn fs_stats(&self, _: &NfsExport) -> Result<Space, Error> {
        denied("nfs")
    }
}

impl Rbd for Ungranted {
    fn create(
        &self,
        _: &RbdPool,
        _: &str,
        _: u64,
        _: &[String],
        _: Option<&str>,
        _: &[(String, String)],
    ) -> Result<(), Error> {
        denied("rbd")
    }
    fn info(&self, _: &RbdPool, _: &str) -> Result<Option<ImageInfo>, Error> {
        denied("rbd")
    }
    fn find_by_metadata(&self, _: &RbdPool, _: &str, _: &str) -> Result<Vec<String>, Error> {
        denied("rbd")
    }
    fn remove(&self, _: &RbdPool, _: &str) -> Result<(), Error> {
        denied("rbd")
    }
    fn resize(&self, _: &RbdPool, _: &str, _: u64) -> Result<(), Error> {
        denied("rbd")
    }
    fn snapshot_create(&self, _: &RbdPool, _: &str, _: &str) -> Result<ImageSnapshot, Error> {
        denied("rbd")
    }
    fn snapshot_remove(&self, _: &RbdPool, _: &str, _: &str) -> Result<(), Error> {
        denied("rbd")
    }
    fn snapshot_protect(&self, _: &RbdPool, _: &str, _: &str) -> Result<(), Error> {
        denied("rbd")
    }
    fn snapshot_list(&self, _: &RbdPool, _: &str) -> Result<Vec<ImageSnapshot>, Error> {
        denied("rbd")
    }
    fn clone_image(&self, _: &RbdPool, _: &str, _: &str, _: &str, _: &str, _: &[String]) -> Result<(), Error> {
        denied("rbd")
    }
    fn flatten(&self, _: &RbdPool, _: &str) -> Result<(), Error> {
        denied("rbd")
    }
    fn children(&self, _: &RbdPool, _: &str, _: &str) -> Result<Vec<String>, Error> {
        denied("rbd")
    }
    fn stats(&self, _: &RbdPool) -> Result<PoolStats, Error> {
        denied("rbd")
    }
    fn set_qos(&self, _: &RbdPool, _: &str, _: &IoLimits) -> Result<(), Error> {
        denied("rbd")
    }
    fn group_snapshot(&self, _: &RbdPool, _: &str, _: &[String], _: &str) -> Result<Vec<ImageSnapshot>, Error> {
        denied("rbd")
    }
    fn group_snapshot_remove(&self, _: &RbdPool, _: &str, _: &str) -> Result<(), Error> {
        denied("rbd")
    }
    fn snapshot_copy(
        &self,
        _: &RbdPool,
        _: &str,
        _: &str,
        _: &str,
        _: &str,
        _: &[String],
        _: &[(String, String)],
    ) -> Result<crate::rbd::CopyProgress, Error> {
        denied("rbd")
    }
}

impl Block for Ungranted {
    fn list_nodes(&self) -> Result<Vec<NodeInfo>, Error> {
        denied("block")
    }
    fn create(
        &self,
        _: &str,
        _: u64,
        _: &[Placement],
        _: Option<&BlockSource>,
        _: &[Pair],
    ) -> Result<ReplicaSet, Error> {
        denied("block")
    }
    fn get(&self, _: &str) -> Result<Option<ReplicaSet>, Error> {
        denied("block")
    }
    fn list_sets(&self, _: Option<&str>, _: u32) -> Result<Vec<ReplicaSet>, Error> {
        denied("block")
    }
    fn set_metadata(&self, _: &str, _: &[Pair]) -> Result<(), Error> {
        denied("block")
    }
    fn delete(&self, _: &str) -> Result<(), Error> {
        denied("block")
    }
    fn expand(&self, _: &str, _: u64) -> Result<ReplicaSet, Error> {
        denied("block")
    }
    fn replace(&self, _: &str, _: &Placement, _: &Placement) -> Result<ReplicaSet, Error> {
        denied("block")
    }
    fn snapshot(&self, _: &str, _: &str) -> Result<BlockSnapshot, Error> {
        denied("block")
    }
    fn delete_snapshot(&self, _: &str, _: &str) -> Result<(), Error> {
        denied("block")
    }
    fn list_snapshots(&self, _: Option<&str>) -> Result<Vec<BlockSnapshot>, Error> {
        denied("block")
    }
    fn set_limits(&self, _: &str, _: &IoLimits, _: u64) -> Result<ReplicaSet, Error> {
        denied("block")
    }
    fn add_replica(&self, _: &str, _: &Placement) -> Result<ReplicaSet, Error> {
        denied("block")
    }
    fn remove_replica(&self, _: &str, _: &Placement) -> Result<ReplicaSet, Error> {
        denied("block")
    }
    fn snapshot_group(&self, _: &[String], _: &str) -> Result<Vec<BlockSnapshot>, Error> {
        denied("block")
    }
    fn follow(&self, _: &str, _: &str, _: &str) -> Result<ReplicaSet, Error> {
        denied("block")
    }
    fn activate(&self, _: &str) -> Result<ReplicaSet, Error> {
        denied("block")
    }
}

impl Backup for Ungranted {
    fn targets(&self) -> Vec<String> {
        Vec::new()
    }
    fn start(&self, _: &str, _: &str, _: &BackupSource, _: &[Pair], _: &[SecretRef]) -> Result<BackupInfo, Error> {
        denied("backup")
    }
    fn get(&self, _: &str, _: &str, _: &[SecretRef]) -> Result<Option<BackupInfo>, Error> {
        denied("backup")
    }
    fn list(
        &self,
        _: &str,
        _: Option<&str>,
        _: Option<&str>,
        _: u32,
        _: &[SecretRef],
    ) -> Result<Vec<BackupInfo>, Error> {
        denied("backup")
    }
    fn delete(&self, _: &str, _: &str, _: &[SecretRef]) -> Result<(), Error> {
        denied("backup")
    }
}
