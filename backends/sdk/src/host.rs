//! [`Host`]: the capabilities a backend reaches, one accessor each. Three hosts exist:
//!
//! ```text
//!                 ┌──────────── Host ─────────────┐
//!                 │ kv  log  dir  nfs  rbd  block │   (one trait per capability)
//!                 └───────────────────────────────┘
//!       Imports (wasm32)     FakeHost (feature "fake")    a native host (wasmcsi-runtime,
//!   the component's imports   in memory, for unit tests   feature "native", benches only)
//! ```
//!
//! [`Ungranted`] answers every call of a capability with permission-denied: the part of a
//! host that grants nothing (a native host's `nfs`, a test host without `rbd`).
use crate::block::{Block, BlockImport, BlockSnapshot, BlockSource, NodeInfo, ReplicaSet};
use crate::dir::{Dir, DirImport, FileStat, Space};
use crate::kv::{Kv, KvImport};
use crate::log::{Log, LogImport};
use crate::nfs::{CopyProgress, Nfs, NfsExport, NfsImport};
use crate::rbd::{ImageInfo, ImageSnapshot, PoolStats, Rbd, RbdImport, Target};
use crate::types::{Error, Pair, SecretRef};

/// What a backend can import. Reached through `&impl Host` (static dispatch): a capability a
/// backend never calls is not linked, so its component does not import it.
pub trait Host {
    type Kv: Kv;
    type Log: Log;
    type Dir: Dir;
    type Nfs: Nfs;
    type Rbd: Rbd;
    type Block: Block;
    fn kv(&self) -> &Self::Kv;
    fn log(&self) -> &Self::Log;
    fn dir(&self) -> &Self::Dir;
    fn nfs(&self) -> &Self::Nfs;
    fn rbd(&self) -> &Self::Rbd;
    fn block(&self) -> &Self::Block;
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
}

/// A capability that is not granted: every call fails with permission-denied naming it
/// (`dir` lists no roots, `cancel-copy` does nothing).
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
        _: &Target,
        _: &str,
        _: u64,
        _: &[String],
        _: Option<&str>,
        _: &[(String, String)],
        _: &[SecretRef],
    ) -> Result<(), Error> {
        denied("rbd")
    }
    fn info(&self, _: &Target, _: &str, _: &[SecretRef]) -> Result<Option<ImageInfo>, Error> {
        denied("rbd")
    }
    fn find_by_metadata(&self, _: &Target, _: &str, _: &str, _: &[SecretRef]) -> Result<Vec<String>, Error> {
        denied("rbd")
    }
    fn remove(&self, _: &Target, _: &str, _: &[SecretRef]) -> Result<(), Error> {
        denied("rbd")
    }
    fn resize(&self, _: &Target, _: &str, _: u64, _: &[SecretRef]) -> Result<(), Error> {
        denied("rbd")
    }
    fn snapshot_create(&self, _: &Target, _: &str, _: &str, _: &[SecretRef]) -> Result<ImageSnapshot, Error> {
        denied("rbd")
    }
    fn snapshot_remove(&self, _: &Target, _: &str, _: &str, _: &[SecretRef]) -> Result<(), Error> {
        denied("rbd")
    }
    fn snapshot_protect(&self, _: &Target, _: &str, _: &str, _: &[SecretRef]) -> Result<(), Error> {
        denied("rbd")
    }
    fn snapshot_list(&self, _: &Target, _: &str, _: &[SecretRef]) -> Result<Vec<ImageSnapshot>, Error> {
        denied("rbd")
    }
    fn clone_image(
        &self,
        _: &Target,
        _: &str,
        _: &str,
        _: &str,
        _: &str,
        _: &[String],
        _: &[SecretRef],
    ) -> Result<(), Error> {
        denied("rbd")
    }
    fn flatten(&self, _: &Target, _: &str, _: &[SecretRef]) -> Result<(), Error> {
        denied("rbd")
    }
    fn children(&self, _: &Target, _: &str, _: &str, _: &[SecretRef]) -> Result<Vec<String>, Error> {
        denied("rbd")
    }
    fn stats(&self, _: &Target, _: &[SecretRef]) -> Result<PoolStats, Error> {
        denied("rbd")
    }
}

impl Block for Ungranted {
    fn list_nodes(&self) -> Result<Vec<NodeInfo>, Error> {
        denied("block")
    }
    fn create(&self, _: &str, _: u64, _: &[String], _: Option<&BlockSource>, _: &[Pair]) -> Result<ReplicaSet, Error> {
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
    fn replace(&self, _: &str, _: &str, _: &str) -> Result<ReplicaSet, Error> {
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
}
