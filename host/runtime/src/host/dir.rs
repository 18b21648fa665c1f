//! `dir`: directory operations under the roots the operator granted a backend. The guest
//! names a root and a relative path; this module turns that into a host path only if it
//! stays inside the root (no absolute paths, no `..`, no symlink on the way), then does the
//! operation without following symlinks. Operations are plain functions, tested directly.
use crate::bindings::types::{Error, Timestamp};
use crate::bindings::wasmcsi::backend::dir::{FileKind, FileStat, Host, Space};
use crate::capabilities::local_io;
use crate::state::CallState;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Files `read-file` returns at most (metadata, not data).
pub const MAX_READ: u64 = 1 << 20;

fn io_err(what: &str, e: io::Error) -> Error {
    let msg = format!("{what}: {e}");
    match e.kind() {
        io::ErrorKind::NotFound => Error::NotFound(msg),
        io::ErrorKind::PermissionDenied => Error::PermissionDenied(msg),
        io::ErrorKind::AlreadyExists => Error::AlreadyExists(msg),
        io::ErrorKind::InvalidInput => Error::InvalidArgument(msg),
        _ => Error::Internal(msg),
    }
}

/// Map a guest path onto the host, refusing anything that could leave `root`. An empty
/// path is the root itself.
pub fn resolve(root: &Path, path: &str) -> Result<PathBuf, Error> {
    if path.starts_with('/') || path.contains('\0') || path.len() > 4096 {
        return Err(Error::InvalidArgument(format!("path {path:?} must be relative, without NUL, at most 4096 bytes")));
    }
    let mut full = root.to_path_buf();
    if path.is_empty() {
        return Ok(full);
    }
    for part in path.split('/') {
        if part.is_empty() || part == "." || part == ".." || part.len() > 255 {
            return Err(Error::PermissionDenied(format!("path {path:?}: component {part:?} is not allowed")));
        }
        full.push(part);
        match fs::symlink_metadata(&full) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Error::PermissionDenied(format!("path {path:?} crosses a symlink at {part:?}")));
            }
            Ok(_) => {}
            // Nothing beyond a missing component can be a symlink.
            Err(_) => {
                for rest in path.split('/').skip_while(|p| *p != part).skip(1) {
                    if rest.is_empty() || rest == "." || rest == ".." || rest.len() > 255 {
                        return Err(Error::PermissionDenied(format!(
                            "path {path:?}: component {rest:?} is not allowed"
                        )));
                    }
                    full.push(rest);
                }
                return Ok(full);
            }
        }
    }
    Ok(full)
}

fn stamp(secs: i64, nanos: i64) -> Timestamp {
    Timestamp { seconds: secs, nanos: u32::try_from(nanos).unwrap_or(0) }
}

fn file_stat(m: &fs::Metadata) -> FileStat {
    let ft = m.file_type();
    let kind = if ft.is_dir() {
        FileKind::Directory
    } else if ft.is_file() {
        FileKind::File
    } else if ft.is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    };
    FileStat {
        kind,
        size: m.len(),
        mode: m.mode() & 0o7777,
        uid: m.uid(),
        gid: m.gid(),
        modified: stamp(m.mtime(), m.mtime_nsec()),
    }
}

pub fn mkdir(p: &Path, mode: u32) -> Result<(), Error> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(_) => return Err(Error::AlreadyExists(format!("mkdir {}: not a directory", p.display()))),
        Err(_) => {}
    }
    fs::create_dir_all(p).map_err(|e| io_err(&format!("mkdir {}", p.display()), e))?;
    // create_dir_all applies the umask; the guest asked for an exact mode.
    fs::set_permissions(p, fs::Permissions::from_mode(mode & 0o7777)).map_err(|e| io_err("chmod", e))
}

pub fn stat(p: &Path) -> Result<Option<FileStat>, Error> {
    match fs::symlink_metadata(p) {
        Ok(m) => Ok(Some(file_stat(&m))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(&format!("stat {}", p.display()), e)),
    }
}

pub fn read_dir(p: &Path) -> Result<Vec<String>, Error> {
    let what = format!("read-dir {}", p.display());
    let mut names = Vec::new();
    for entry in fs::read_dir(p).map_err(|e| io_err(&what, e))? {
        let entry = entry.map_err(|e| io_err(&what, e))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

pub fn read_file(p: &Path) -> Result<Vec<u8>, Error> {
    let what = format!("read-file {}", p.display());
    let m = fs::symlink_metadata(p).map_err(|e| io_err(&what, e))?;
    if !m.is_file() || m.len() > MAX_READ {
        return Err(Error::InvalidArgument(format!("{what}: not a regular file of at most {MAX_READ} bytes")));
    }
    fs::read(p).map_err(|e| io_err(&what, e))
}

static TMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Temp file + fsync + rename + fsync of the directory: after a crash the file is either the
/// old or the new content, never a torn mix.
pub fn write_file(p: &Path, data: &[u8]) -> Result<(), Error> {
    let what = format!("write-file {}", p.display());
    let parent = p.parent().ok_or_else(|| Error::InvalidArgument(format!("{what}: no parent")))?;
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = parent.join(format!(".{name}.tmp-{}-{}", std::process::id(), TMP_SEQ.fetch_add(1, Ordering::Relaxed)));
    let result = (|| {
        let mut f = fs::OpenOptions::new().write(true).create_new(true).mode_0600().open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        fs::rename(&tmp, p)?;
        fs::File::open(parent)?.sync_all()
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(|e| io_err(&what, e))
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}
impl Mode0600 for fs::OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::mode(self, 0o600)
    }
}

fn copy_times(src: &fs::Metadata, dst: &Path) -> io::Result<()> {
    use nix::sys::stat::{UtimensatFlags, utimensat};
    use nix::sys::time::TimeSpec;
    let at = TimeSpec::new(src.atime(), src.atime_nsec());
    let mt = TimeSpec::new(src.mtime(), src.mtime_nsec());
    utimensat(nix::fcntl::AT_FDCWD, dst, &at, &mt, UtimensatFlags::NoFollowSymlink).map_err(io::Error::from)
}

fn copy_entry(src: &Path, dst: &Path) -> io::Result<()> {
    let m = fs::symlink_metadata(src)?;
    let ft = m.file_type();
    if ft.is_symlink() {
        std::os::unix::fs::symlink(fs::read_link(src)?, dst)?;
    } else if ft.is_dir() {
        fs::create_dir(dst)?;
        for entry in fs::read_dir(src)? {
            let entry = entry?;
            copy_entry(&entry.path(), &dst.join(entry.file_name()))?;
        }
        fs::set_permissions(dst, fs::Permissions::from_mode(m.mode() & 0o7777))?;
    } else if ft.is_file() {
        fs::copy(src, dst)?;
        fs::set_permissions(dst, fs::Permissions::from_mode(m.mode() & 0o7777))?;
    } else {
        // Sockets, fifos and devices have no place in a volume copy.
        return Ok(());
    }
    std::os::unix::fs::lchown(dst, Some(m.uid()), Some(m.gid()))?;
    copy_times(&m, dst)
}

/// Copy a tree; a failure removes the partial copy.
pub fn copy_tree(from: &Path, to: &Path) -> Result<(), Error> {
    let what = format!("copy-tree {} -> {}", from.display(), to.display());
    if fs::symlink_metadata(to).is_ok() {
        return Err(Error::AlreadyExists(format!("{what}: target exists")));
    }
    fs::symlink_metadata(from).map_err(|e| io_err(&what, e))?;
    copy_entry(from, to).map_err(|e| {
        let _ = remove_all(to);
        io_err(&what, e)
    })
}

pub fn rename(from: &Path, to: &Path) -> Result<(), Error> {
    let what = format!("rename {} -> {}", from.display(), to.display());
    if fs::symlink_metadata(to).is_ok() {
        return Err(Error::AlreadyExists(format!("{what}: target exists")));
    }
    fs::rename(from, to).map_err(|e| io_err(&what, e))
}

pub fn remove_all(p: &Path) -> Result<(), Error> {
    let what = format!("remove {}", p.display());
    match fs::symlink_metadata(p) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err(&what, e)),
        // remove_dir_all does not follow symlinks inside the tree.
        Ok(m) if m.is_dir() => fs::remove_dir_all(p).map_err(|e| io_err(&what, e)),
        Ok(_) => fs::remove_file(p).map_err(|e| io_err(&what, e)),
    }
}

pub fn usage(p: &Path) -> Result<u64, Error> {
    fn walk(p: &Path) -> io::Result<u64> {
        let m = fs::symlink_metadata(p)?;
        let mut total = m.len();
        if m.is_dir() {
            total = 0;
            for entry in fs::read_dir(p)? {
                total += walk(&entry?.path())?;
            }
        }
        Ok(total)
    }
    walk(p).map_err(|e| io_err(&format!("usage {}", p.display()), e))
}

pub fn space(p: &Path) -> Result<Space, Error> {
    let s = nix::sys::statvfs::statvfs(p).map_err(|e| io_err(&format!("statvfs {}", p.display()), e.into()))?;
    let frsize = s.fragment_size();
    Ok(Space {
        total_bytes: s.blocks().saturating_mul(frsize),
        available_bytes: s.blocks_available().saturating_mul(frsize),
    })
}

impl CallState {
    fn root(&self, root: &str) -> Result<PathBuf, Error> {
        self.caps.dir_roots.get(root).cloned().ok_or_else(|| {
            Error::PermissionDenied(format!("dir root {root:?} is not granted to backend {}", self.caps.backend))
        })
    }

    /// Resolve and run one operation (see `local_io` for why inline).
    fn on_path<T>(&mut self, root: &str, path: &str, f: impl FnOnce(PathBuf) -> Result<T, Error>) -> Result<T, Error> {
        let base = self.root(root)?;
        local_io(|| f(resolve(&base, path)?))
    }
}

impl Host for CallState {
    async fn roots(&mut self) -> Vec<String> {
        self.caps.dir_roots.keys().cloned().collect()
    }
    #[tracing::instrument(name = "import.dir.mkdir", skip_all, fields(backend = %self.caps.backend, %root, %path))]
    async fn mkdir(&mut self, root: String, path: String, mode: u32) -> Result<(), Error> {
        self.on_path(&root, &path, move |p| mkdir(&p, mode))
    }
    #[tracing::instrument(name = "import.dir.stat", skip_all, fields(backend = %self.caps.backend, %root, %path))]
    async fn stat(&mut self, root: String, path: String) -> Result<Option<FileStat>, Error> {
        self.on_path(&root, &path, |p| stat(&p))
    }
    #[tracing::instrument(name = "import.dir.read_dir", skip_all, fields(backend = %self.caps.backend, %root, %path))]
    async fn read_dir(&mut self, root: String, path: String) -> Result<Vec<String>, Error> {
        self.on_path(&root, &path, |p| read_dir(&p))
    }
    #[tracing::instrument(name = "import.dir.read_file", skip_all, fields(backend = %self.caps.backend, %root, %path))]
    async fn read_file(&mut self, root: String, path: String) -> Result<Vec<u8>, Error> {
        self.on_path(&root, &path, |p| read_file(&p))
    }
    #[tracing::instrument(name = "import.dir.write_file", skip_all, fields(backend = %self.caps.backend, %root, %path))]
    async fn write_file(&mut self, root: String, path: String, data: Vec<u8>) -> Result<(), Error> {
        self.on_path(&root, &path, move |p| write_file(&p, &data))
    }
    #[tracing::instrument(name = "import.dir.copy_tree", skip_all, fields(backend = %self.caps.backend, %root, %from, %to))]
    async fn copy_tree(&mut self, root: String, from: String, to: String) -> Result<(), Error> {
        let target = resolve(&self.root(&root)?, &to)?;
        self.on_path(&root, &from, |p| copy_tree(&p, &target))
    }
    #[tracing::instrument(name = "import.dir.rename", skip_all, fields(backend = %self.caps.backend, %root, %from, %to))]
    async fn rename(&mut self, root: String, from: String, to: String) -> Result<(), Error> {
        let target = resolve(&self.root(&root)?, &to)?;
        self.on_path(&root, &from, move |p| rename(&p, &target))
    }
    #[tracing::instrument(name = "import.dir.remove_all", skip_all, fields(backend = %self.caps.backend, %root, %path))]
    async fn remove_all(&mut self, root: String, path: String) -> Result<(), Error> {
        if path.is_empty() {
            return Err(Error::InvalidArgument(format!("refusing to remove dir root {root:?} itself")));
        }
        self.on_path(&root, &path, |p| remove_all(&p))
    }
    #[tracing::instrument(name = "import.dir.usage", skip_all, fields(backend = %self.caps.backend, %root, %path))]
    async fn usage(&mut self, root: String, path: String) -> Result<u64, Error> {
        self.on_path(&root, &path, |p| usage(&p))
    }
    #[tracing::instrument(name = "import.dir.fs_stats", skip_all, fields(backend = %self.caps.backend, %root))]
    async fn fs_stats(&mut self, root: String) -> Result<Space, Error> {
        self.on_path(&root, "", |p| space(&p))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_refuses_escapes_and_symlinks() {
        let d = tempfile::tempdir().expect("tempdir");
        let root = d.path();
        assert!(matches!(resolve(root, "/etc"), Err(Error::InvalidArgument(_))));
        assert!(matches!(resolve(root, "a/../../etc"), Err(Error::PermissionDenied(_))));
        assert!(matches!(resolve(root, "missing/../x"), Err(Error::PermissionDenied(_))));
        assert!(matches!(resolve(root, "a//b"), Err(Error::PermissionDenied(_))));
        std::os::unix::fs::symlink("/etc", root.join("link")).expect("symlink");
        assert!(matches!(resolve(root, "link/passwd"), Err(Error::PermissionDenied(_))));
        assert!(matches!(resolve(root, "link"), Err(Error::PermissionDenied(_))));
        assert_eq!(resolve(root, "a/b").expect("plain path"), root.join("a/b"));
    }

    #[test]
    fn copy_tree_preserves_modes_owners_times_and_symlinks() {
        let d = tempfile::tempdir().expect("tempdir");
        let src = d.path().join("src");
        mkdir(&src.join("sub"), 0o750).expect("mkdir");
        write_file(&src.join("sub/f"), b"data").expect("write");
        fs::set_permissions(src.join("sub/f"), fs::Permissions::from_mode(0o640)).expect("chmod");
        std::os::unix::fs::symlink("sub/f", src.join("l")).expect("symlink");
        copy_tree(&src, &d.path().join("dst")).expect("copy");
        let (a, b) =
            (fs::metadata(src.join("sub/f")).expect("a"), fs::metadata(d.path().join("dst/sub/f")).expect("b"));
        assert_eq!((a.mode(), a.uid(), a.mtime(), a.mtime_nsec()), (b.mode(), b.uid(), b.mtime(), b.mtime_nsec()));
        assert_eq!(fs::read_link(d.path().join("dst/l")).expect("link"), PathBuf::from("sub/f"));
        assert_eq!(fs::metadata(d.path().join("dst/sub")).expect("dir").mode() & 0o777, 0o750);
        assert!(matches!(copy_tree(&src, &d.path().join("dst")), Err(Error::AlreadyExists(_))));
        assert_eq!(usage(&d.path().join("dst/sub")).expect("usage"), 4);
    }

    #[test]
    fn remove_all_is_idempotent_and_write_file_is_atomic() {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("f");
        write_file(&p, b"one").expect("write");
        write_file(&p, b"two").expect("overwrite");
        assert_eq!(read_file(&p).expect("read"), b"two");
        assert_eq!(read_dir(d.path()).expect("ls"), ["f"]);
        remove_all(&p).expect("remove");
        remove_all(&p).expect("remove again");
        assert!(matches!(read_file(&p), Err(Error::NotFound(_))));
    }
}
