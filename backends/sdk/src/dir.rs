//! `dir`: directory operations under the roots the operator granted (hostpath-like backends).
//! Paths are relative to a root, `/`-separated, never absolute, never with `..`. [`Dir`] is
//! the capability, [`DirImport`] the component's import of it.
use crate::types::Error;
use crate::wit::wasmcsi::backend::dir as wit;

pub use wit::{FileKind, FileStat, Space};

/// The `dir` capability: one method per WIT function, same errors (see `wit/backend.wit`).
pub trait Dir {
    /// Names of the granted roots.
    fn roots(&self) -> Vec<String>;
    /// Create a directory (parents too); an existing directory succeeds.
    fn mkdir(&self, root: &str, path: &str, mode: u32) -> Result<(), Error>;
    /// Metadata of a path, `None` when absent.
    fn stat(&self, root: &str, path: &str) -> Result<Option<FileStat>, Error>;
    /// Names in a directory, sorted.
    fn read_dir(&self, root: &str, path: &str) -> Result<Vec<String>, Error>;
    /// A whole small (≤ 1 MiB) file.
    fn read_file(&self, root: &str, path: &str) -> Result<Vec<u8>, Error>;
    /// Write a whole file atomically.
    fn write_file(&self, root: &str, path: &str, data: &[u8]) -> Result<(), Error>;
    /// Copy a tree to `to`, which must not exist.
    fn copy_tree(&self, root: &str, from: &str, to: &str) -> Result<(), Error>;
    /// Rename within a root.
    fn rename(&self, root: &str, from: &str, to: &str) -> Result<(), Error>;
    /// Remove a file or tree; absent succeeds, the root itself is invalid-argument.
    fn remove_all(&self, root: &str, path: &str) -> Result<(), Error>;
    /// Bytes used by a tree.
    fn usage(&self, root: &str, path: &str) -> Result<u64, Error>;
    /// Space of the file system holding a root.
    fn fs_stats(&self, root: &str) -> Result<Space, Error>;

    /// Names in a directory, `None` when it does not exist.
    fn try_read_dir(&self, root: &str, path: &str) -> Result<Option<Vec<String>>, Error> {
        match self.read_dir(root, path) {
            Ok(names) => Ok(Some(names)),
            Err(Error::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// A whole small file, `None` when absent.
    fn try_read_file(&self, root: &str, path: &str) -> Result<Option<Vec<u8>>, Error> {
        match self.read_file(root, path) {
            Ok(data) => Ok(Some(data)),
            Err(Error::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// The component's `dir` import.
#[derive(Debug, Clone, Copy, Default)]
pub struct DirImport;

impl Dir for DirImport {
    fn roots(&self) -> Vec<String> {
        wit::roots()
    }
    fn mkdir(&self, root: &str, path: &str, mode: u32) -> Result<(), Error> {
        wit::mkdir(root, path, mode)
    }
    fn stat(&self, root: &str, path: &str) -> Result<Option<FileStat>, Error> {
        wit::stat(root, path)
    }
    fn read_dir(&self, root: &str, path: &str) -> Result<Vec<String>, Error> {
        wit::read_dir(root, path)
    }
    fn read_file(&self, root: &str, path: &str) -> Result<Vec<u8>, Error> {
        wit::read_file(root, path)
    }
    fn write_file(&self, root: &str, path: &str, data: &[u8]) -> Result<(), Error> {
        wit::write_file(root, path, data)
    }
    fn copy_tree(&self, root: &str, from: &str, to: &str) -> Result<(), Error> {
        wit::copy_tree(root, from, to)
    }
    fn rename(&self, root: &str, from: &str, to: &str) -> Result<(), Error> {
        wit::rename(root, from, to)
    }
    fn remove_all(&self, root: &str, path: &str) -> Result<(), Error> {
        wit::remove_all(root, path)
    }
    fn usage(&self, root: &str, path: &str) -> Result<u64, Error> {
        wit::usage(root, path)
    }
    fn fs_stats(&self, root: &str) -> Result<Space, Error> {
        wit::fs_stats(root)
    }
}
