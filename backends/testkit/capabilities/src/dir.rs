//! [`PreopenDir`]: the `dir` capability over real files under one directory, the root
//! `default`. In the composed test that directory is the WASI preopen `/` (`wasmtime run --dir
//! ROOT::/`); natively (unit tests) any directory.
//!
//! Follows the WIT's `dir` where WASI can: paths are checked as the host checks them, writes
//! are atomic (temporary file, sync, rename), a tree is removed or copied whole. Where WASI
//! cannot, it says so here: modes and owners are neither set nor read (`stat` reports mode
//! 0o755 for directories and 0o644 otherwise, owner 0), and `fs-stats` reports
//! [`SPACE_BYTES`] total and free minus what the root holds (WASI has no statvfs). Symlinks are
//! reported by `stat` but never followed or copied.
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;
use wasmcsi_backend_sdk::dir::{Dir, FileKind, FileStat, Space};
use wasmcsi_backend_sdk::types::{Error, Timestamp};

/// The one root's name.
pub const ROOT: &str = "default";
/// What `fs-stats` reports as the root's size.
pub const SPACE_BYTES: u64 = 100 << 30;
/// The largest file `read-file` returns (the WIT's bound).
const MAX_READ_BYTES: u64 = 1 << 20;

/// The `dir` capability over the directory `base`, granted as the root [`ROOT`].
#[derive(Debug, Clone)]
pub struct PreopenDir {
    base: PathBuf,
}

impl PreopenDir {
    pub fn new(base: impl Into<PathBuf>) -> Self {
        Self { base: base.into() }
    }

    /// The real path of `path` under `root`, after the host's checks.
    fn resolve(&self, root: &str, path: &str) -> Result<PathBuf, Error> {
        if root != ROOT {
            return Err(Error::PermissionDenied(format!(
                "dir root {root:?} is not granted (the test kit grants {ROOT:?})"
            )));
        }
        let bad = path.starts_with('/')
            || path.contains('\0')
            || (!path.is_empty() && path.split('/').any(|p| p.is_empty() || p == "." || p == ".."));
        if bad {
            return Err(Error::InvalidArgument(format!("path {path:?} is not a plain relative path")));
        }
        Ok(if path.is_empty() { self.base.clone() } else { self.base.join(path) })
    }
}

fn io_error(what: &str, path: &str, e: std::io::Error) -> Error {
    let msg = format!("{what} {path:?}: {e}");
    match e.kind() {
        std::io::ErrorKind::NotFound => Error::NotFound(msg),
        std::io::ErrorKind::AlreadyExists => Error::AlreadyExists(msg),
        std::io::ErrorKind::PermissionDenied => Error::PermissionDenied(msg),
        _ => Error::Internal(msg),
    }
}

fn stat_of(meta: &fs::Metadata) -> FileStat {
    let kind = if meta.is_dir() {
        FileKind::Directory
    } else if meta.is_file() {
        FileKind::File
    } else if meta.file_type().is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    };
    let modified = meta.modified().ok().and_then(|t| t.duration_since(UNIX_EPOCH).ok()).map_or(
        Timestamp { seconds: 0, nanos: 0 },
        |d| Timestamp { seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX), nanos: d.subsec_nanos() },
    );
    let mode = if meta.is_dir() { 0o755 } else { 0o644 };
    FileStat { kind, size: meta.len(), mode, uid: 0, gid: 0, modified }
}

/// Bytes of the files under `path` (apparent sizes), not following symlinks.
fn tree_bytes(path: &Path) -> std::io::Result<u64> {
    let meta = fs::symlink_metadata(path)?;
    if !meta.is_dir() {
        return Ok(if meta.is_file() { meta.len() } else { 0 });
    }
    let mut sum = 0u64;
    for entry in fs::read_dir(path)? {
        sum = sum.saturating_add(tree_bytes(&entry?.path())?);
    }
    Ok(sum)
}

fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    let meta = fs::symlink_metadata(from)?;
    if meta.is_dir() {
        fs::create_dir(to)?;
        for entry in fs::read_dir(from)? {
            let entry = entry?;
            copy_tree(&entry.path(), &to.join(entry.file_name()))?;
        }
    } else if meta.is_file() {
        fs::copy(from, to)?;
    }
    Ok(())
}

impl Dir for PreopenDir {
    fn roots(&self) -> Vec<String> {
        vec![ROOT.to_owned()]
    }

    fn mkdir(&self, root: &str, path: &str, _mode: u32) -> Result<(), Error> {
        let real = self.resolve(root, path)?;
        if let Ok(meta) = fs::symlink_metadata(&real)
            && !meta.is_dir()
        {
            return Err(Error::AlreadyExists(format!("{path:?} exists and is not a directory")));
        }
        fs::create_dir_all(&real).map_err(|e| io_error("mkdir", path, e))
    }

    fn stat(&self, root: &str, path: &str) -> Result<Option<FileStat>, Error> {
        let real = self.resolve(root, path)?;
        match fs::symlink_metadata(&real) {
            Ok(meta) => Ok(Some(stat_of(&meta))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_error("stat", path, e)),
        }
    }

    fn read_dir(&self, root: &str, path: &str) -> Result<Vec<String>, Error> {
        let real = self.resolve(root, path)?;
        let mut names = Vec::new();
        for entry in fs::read_dir(&real).map_err(|e| io_error("read-dir", path, e))? {
            let entry = entry.map_err(|e| io_error("read-dir", path, e))?;
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    fn read_file(&self, root: &str, path: &str) -> Result<Vec<u8>, Error> {
        let real = self.resolve(root, path)?;
        let meta = fs::metadata(&real).map_err(|e| io_error("read-file", path, e))?;
        if meta.len() > MAX_READ_BYTES {
            return Err(Error::InvalidArgument(format!("{path:?} is {} bytes, over {MAX_READ_BYTES}", meta.len())));
        }
        fs::read(&real).map_err(|e| io_error("read-file", path, e))
    }

    fn write_file(&self, root: &str, path: &str, data: &[u8]) -> Result<(), Error> {
        let real = self.resolve(root, path)?;
        let parent = real.parent().ok_or_else(|| Error::InvalidArgument(format!("{path:?} has no parent")))?;
        let name = real.file_name().ok_or_else(|| Error::InvalidArgument(format!("{path:?} names no file")))?;
        let temp = parent.join(format!(".{}.tmp", name.to_string_lossy()));
        let write = || -> std::io::Result<()> {
            let mut file = fs::File::create(&temp)?;
            file.write_all(data)?;
            file.sync_all()?;
            fs::rename(&temp, &real)
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&temp);
            io_error("write-file", path, e)
        })
    }

    fn copy_tree(&self, root: &str, from: &str, to: &str) -> Result<(), Error> {
        let (src, dst) = (self.resolve(root, from)?, self.resolve(root, to)?);
        if fs::symlink_metadata(&dst).is_ok() {
            return Err(Error::AlreadyExists(format!("copy target {to:?} exists")));
        }
        fs::symlink_metadata(&src).map_err(|e| io_error("copy-tree from", from, e))?;
        copy_tree(&src, &dst).map_err(|e| {
            let _ = fs::remove_dir_all(&dst);
            io_error("copy-tree to", to, e)
        })
    }

    fn rename(&self, root: &str, from: &str, to: &str) -> Result<(), Error> {
        let (src, dst) = (self.resolve(root, from)?, self.resolve(root, to)?);
        fs::symlink_metadata(&src).map_err(|e| io_error("rename", from, e))?;
        if fs::symlink_metadata(&dst).is_ok() {
            return Err(Error::AlreadyExists(format!("rename target {to:?} exists")));
        }
        fs::rename(&src, &dst).map_err(|e| io_error("rename", from, e))
    }

    fn remove_all(&self, root: &str, path: &str) -> Result<(), Error> {
        if path.is_empty() {
            return Err(Error::InvalidArgument("remove-all of the root itself".into()));
        }
        let real = self.resolve(root, path)?;
        let removed = match fs::symlink_metadata(&real) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => Err(e),
            Ok(meta) if meta.is_dir() => fs::remove_dir_all(&real),
            Ok(_) => fs::remove_file(&real),
        };
        removed.map_err(|e| io_error("remove-all", path, e))
    }

    fn usage(&self, root: &str, path: &str) -> Result<u64, Error> {
        let real = self.resolve(root, path)?;
        tree_bytes(&real).map_err(|e| io_error("usage", path, e))
    }

    fn fs_stats(&self, root: &str) -> Result<Space, Error> {
        let real = self.resolve(root, "")?;
        let used = tree_bytes(&real).map_err(|e| io_error("fs-stats", root, e))?;
        Ok(Space { total_bytes: SPACE_BYTES, available_bytes: SPACE_BYTES.saturating_sub(used) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> (tempfile::TempDir, PreopenDir) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let d = PreopenDir::new(tmp.path());
        (tmp, d)
    }

    #[test]
    fn paths_outside_the_root_and_other_roots_are_refused() {
        let (_tmp, d) = dir();
        assert!(matches!(d.stat(ROOT, "../etc"), Err(Error::InvalidArgument(_))));
        assert!(matches!(d.stat(ROOT, "/etc"), Err(Error::InvalidArgument(_))));
        assert!(matches!(d.stat(ROOT, "a//b"), Err(Error::InvalidArgument(_))));
        assert!(matches!(d.stat("other", "a"), Err(Error::PermissionDenied(_))));
        assert!(matches!(d.remove_all(ROOT, ""), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn a_tree_is_made_written_copied_measured_and_removed() {
        let (_tmp, d) = dir();
        d.mkdir(ROOT, "v/a", 0o755).expect("mkdir");
        d.mkdir(ROOT, "v/a", 0o755).expect("mkdir again");
        d.write_file(ROOT, "v/a/f", b"hello").expect("write");
        assert_eq!(d.read_file(ROOT, "v/a/f").expect("read"), b"hello");
        assert!(matches!(d.mkdir(ROOT, "v/a/f", 0o755), Err(Error::AlreadyExists(_))));
        d.copy_tree(ROOT, "v", "w").expect("copy");
        assert!(matches!(d.copy_tree(ROOT, "v", "w"), Err(Error::AlreadyExists(_))));
        assert!(matches!(d.copy_tree(ROOT, "nope", "x"), Err(Error::NotFound(_))));
        assert_eq!(d.usage(ROOT, "w").expect("usage"), 5);
        assert_eq!(d.read_dir(ROOT, "").expect("ls"), vec!["v".to_string(), "w".to_string()]);
        assert_eq!(d.stat(ROOT, "w/a/f").expect("stat").map(|s| (s.kind, s.size)), Some((FileKind::File, 5)));
        let space = d.fs_stats(ROOT).expect("space");
        assert_eq!(space.total_bytes - space.available_bytes, 10);
        d.rename(ROOT, "w", "x").expect("rename");
        assert!(matches!(d.rename(ROOT, "w", "y"), Err(Error::NotFound(_))));
        d.remove_all(ROOT, "x").expect("remove");
        d.remove_all(ROOT, "x").expect("remove again");
        assert_eq!(d.stat(ROOT, "x").expect("stat"), None);
        assert!(matches!(d.read_dir(ROOT, "x"), Err(Error::NotFound(_))));
    }
}
