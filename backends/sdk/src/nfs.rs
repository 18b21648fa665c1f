//! `nfs`: directory operations on a granted NFS export through the host's userspace client
//! (the controller mounts nothing). Paths are relative to the export. [`Nfs`] is the
//! capability, [`NfsImport`] the component's import of it.
use crate::types::Error;
use crate::wit::wasmcsi::backend::nfs as wit;

pub use crate::dir::{FileKind, FileStat, Space};
pub use wit::{CopyProgress, NfsExport};

/// The `nfs` capability: one method per WIT function, same errors (see `wit/backend.wit`).
pub trait Nfs {
    /// Create a directory with mode and owner; an existing directory succeeds.
    fn mkdir(&self, export: &NfsExport, path: &str, mode: u32, uid: u32, gid: u32) -> Result<(), Error>;
    /// Metadata of a path, `None` when absent.
    fn stat(&self, export: &NfsExport, path: &str) -> Result<Option<FileStat>, Error>;
    /// Names in a directory.
    fn read_dir(&self, export: &NfsExport, path: &str) -> Result<Vec<String>, Error>;
    /// A small file.
    fn read_file(&self, export: &NfsExport, path: &str) -> Result<Vec<u8>, Error>;
    /// Write a small file atomically.
    fn write_file(&self, export: &NfsExport, path: &str, data: &[u8]) -> Result<(), Error>;
    /// Server-side copy of a tree within one call.
    fn copy_tree(&self, export: &NfsExport, from: &str, to: &str) -> Result<(), Error>;
    /// Start, or report on, a copy in the host's background that outlives the call.
    fn copy_tree_background(&self, export: &NfsExport, from: &str, to: &str) -> Result<CopyProgress, Error>;
    /// Stop and forget the background copy to `to`.
    fn cancel_copy(&self, export: &NfsExport, to: &str);
    /// Rename within the export.
    fn rename(&self, export: &NfsExport, from: &str, to: &str) -> Result<(), Error>;
    /// Remove a tree; absent succeeds.
    fn remove_all(&self, export: &NfsExport, path: &str) -> Result<(), Error>;
    /// Bytes used by a tree.
    fn usage(&self, export: &NfsExport, path: &str) -> Result<u64, Error>;
    /// Space of the export.
    fn fs_stats(&self, export: &NfsExport) -> Result<Space, Error>;

    /// A small file, `None` when absent.
    fn try_read_file(&self, export: &NfsExport, path: &str) -> Result<Option<Vec<u8>>, Error> {
        match self.read_file(export, path) {
            Ok(data) => Ok(Some(data)),
            Err(Error::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// The component's `nfs` import.
#[derive(Debug, Clone, Copy, Default)]
pub struct NfsImport;

impl Nfs for NfsImport {
    fn mkdir(&self, export: &NfsExport, path: &str, mode: u32, uid: u32, gid: u32) -> Result<(), Error> {
        wit::mkdir(export, path, mode, uid, gid)
    }
    fn stat(&self, export: &NfsExport, path: &str) -> Result<Option<FileStat>, Error> {
        wit::stat(export, path)
    }
    fn read_dir(&self, export: &NfsExport, path: &str) -> Result<Vec<String>, Error> {
        wit::read_dir(export, path)
    }
    fn read_file(&self, export: &NfsExport, path: &str) -> Result<Vec<u8>, Error> {
        wit::read_file(export, path)
    }
    fn write_file(&self, export: &NfsExport, path: &str, data: &[u8]) -> Result<(), Error> {
        wit::write_file(export, path, data)
    }
    fn copy_tree(&self, export: &NfsExport, from: &str, to: &str) -> Result<(), Error> {
        wit::copy_tree(export, from, to)
    }
    fn copy_tree_background(&self, export: &NfsExport, from: &str, to: &str) -> Result<CopyProgress, Error> {
        wit::copy_tree_background(export, from, to)
    }
    fn cancel_copy(&self, export: &NfsExport, to: &str) {
        wit::cancel_copy(export, to)
    }
    fn rename(&self, export: &NfsExport, from: &str, to: &str) -> Result<(), Error> {
        wit::rename(export, from, to)
    }
    fn remove_all(&self, export: &NfsExport, path: &str) -> Result<(), Error> {
        wit::remove_all(export, path)
    }
    fn usage(&self, export: &NfsExport, path: &str) -> Result<u64, Error> {
        wit::usage(export, path)
    }
    fn fs_stats(&self, export: &NfsExport) -> Result<Space, Error> {
        wit::fs_stats(export)
    }
}
