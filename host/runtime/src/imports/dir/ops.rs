//! The `dir` operations on an open [`Root`], as plain blocking functions with WIT errors:
//! each resolves its guest path beneath the root's fd (`root.rs`), decides on what it opened,
//! and walks trees through `tree.rs`. The WIT glue and where each runs are in `mod.rs`.
use super::path::GuestPath;
use super::root::Root;
use super::temp;
use super::tree::{self, Progress, Stop, WalkError};
use crate::bindings::types::{Error, Timestamp};
use crate::bindings::wasmcsi::backend::dir::{FileKind, FileStat, Space};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, RenameFlags, Stat};
use rustix::io::Errno;
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};

/// Files `read-file` returns at most (metadata, not data).
pub const MAX_READ: u64 = 1 << 20;

/// The WIT error for a failed syscall on `what`.
pub fn errno(what: &str, e: Errno) -> Error {
    let msg = format!("{what}: {}", std::io::Error::from(e));
    match e {
        Errno::NOENT | Errno::NOTDIR => Error::NotFound(msg),
        Errno::ACCESS | Errno::PERM => Error::PermissionDenied(msg),
        Errno::LOOP => {
            Error::PermissionDenied(format!("{what}: a symlink is on the way (symlinks are never followed)"))
        }
        Errno::EXIST | Errno::NOTEMPTY => Error::AlreadyExists(msg),
        Errno::INVAL | Errno::NAMETOOLONG | Errno::ISDIR => Error::InvalidArgument(msg),
        Errno::NOSPC | Errno::DQUOT => Error::ResourceExhausted(msg),
        _ => Error::Internal(msg),
    }
}

/// The WIT error for a walk that ended early on `what`.
///
/// A walk runs beneath a root the backend is granted, so a refusal inside it (EACCES, EPERM:
/// an entry of a pod's uid the host cannot read, an owner or mode it cannot set) never means
/// the caller lacks authorization, which is what `permission-denied` (CSI PERMISSION_DENIED)
/// says: it means the host process lacks a capability, and nothing changes until the operator
/// grants it. That is `failed-precondition` ("do not retry until the system is fixed"), with a
/// message naming the capabilities.
pub fn walk(what: &str, e: WalkError) -> Error {
    match e {
        WalkError::Io { name, errno: e @ (Errno::ACCESS | Errno::PERM) } => Error::FailedPrecondition(format!(
            "{what}: {name}: {}: the host process lacks the privilege to read the tree or keep its \
             owners and modes (it needs CAP_CHOWN, CAP_FOWNER, CAP_FSETID and CAP_DAC_OVERRIDE; deploy/README.md)",
            std::io::Error::from(e)
        )),
        e @ WalkError::ModeNotKept { .. } => Error::FailedPrecondition(format!("{what}: {e}")),
        WalkError::Io { name, errno: e } => errno(&format!("{what}: {name}"), e),
        WalkError::Deadline => Error::DeadlineExceeded(format!(
            "{what}: stopped at the call's deadline; what was done stays done, retry to go on"
        )),
        WalkError::Cancelled => Error::Aborted(format!("{what}: cancelled")),
        e @ (WalkError::TooDeep { .. } | WalkError::Unstable { .. } | WalkError::KeepsFilling { .. }) => {
            Error::FailedPrecondition(format!("{what}: {e}"))
        }
    }
}

fn cstr(name: &str) -> Result<CString, Error> {
    CString::new(name).map_err(|_| Error::InvalidArgument(format!("{name:?} contains NUL")))
}

fn kind(st: &Stat) -> FileType {
    FileType::from_raw_mode(st.st_mode)
}

fn file_stat(st: &Stat) -> FileStat {
    let kind = match kind(st) {
        FileType::Directory => FileKind::Directory,
        FileType::RegularFile => FileKind::File,
        FileType::Symlink => FileKind::Symlink,
        _ => FileKind::Other,
    };
    FileStat {
        kind,
        size: u64::try_from(st.st_size).unwrap_or(0),
        mode: st.st_mode & 0o7777,
        uid: st.st_uid,
        gid: st.st_gid,
        modified: Timestamp { seconds: st.st_mtime, nanos: u32::try_from(st.st_mtime_nsec).unwrap_or(0) },
    }
}

/// Create a directory and its parents; the last one gets exactly `mode`. An existing
/// directory is success (its mode untouched).
pub fn mkdir(root: &Root, path: GuestPath<'_>, mode: u32) -> Result<(), Error> {
    let what = || format!("mkdir {}", path.as_str());
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut held: Option<OwnedFd> = None;
    let mut parts = path.components().peekable();
    while let Some(part) = parts.next() {
        let last = parts.peek().is_none();
        let at = held.as_ref().map_or(root.fd(), |f| f.as_fd());
        let mut created = false;
        let fd = loop {
            match rustix::fs::openat(at, part, dir_flags, Mode::empty()) {
                Ok(fd) => break fd,
                Err(Errno::NOENT) => match rustix::fs::mkdirat(at, part, Mode::from_raw_mode(0o777)) {
                    Ok(()) => created = true,
                    Err(Errno::EXIST) => {}
                    Err(e) => return Err(errno(&what(), e)),
                },
                Err(e) => {
                    return Err(match super::root::classify(at, part, e) {
                        Errno::NOTDIR if last => Error::AlreadyExists(format!("{}: not a directory", what())),
                        e => errno(&what(), e),
                    });
                }
            }
        };
        if last && created {
            // mkdirat applied the umask; the guest asked for an exact mode.
            rustix::fs::fchmod(&fd, Mode::from_raw_mode(mode & 0o7777)).map_err(|e| errno(&what(), e))?;
        }
        held = Some(fd);
    }
    Ok(())
}

/// Metadata of `path`, `None` when absent. The path itself may not be a symlink.
pub fn stat(root: &Root, path: GuestPath<'_>) -> Result<Option<FileStat>, Error> {
    let what = || format!("stat {}", path.as_str());
    match root.open_at(path, OFlags::PATH) {
        Ok(fd) => rustix::fs::fstat(&fd).map(|st| Some(file_stat(&st))).map_err(|e| errno(&what(), e)),
        Err(Errno::NOENT | Errno::NOTDIR) => Ok(None),
        Err(e) => Err(errno(&what(), e)),
    }
}

/// Names in a directory, sorted, without the host's temporary entries; those of a dead
/// writer that are plain files are removed on the way (see `temp.rs`).
pub fn read_dir(root: &Root, path: GuestPath<'_>) -> Result<Vec<String>, Error> {
    let what = || format!("read-dir {}", path.as_str());
    let fd = root.open_at(path, OFlags::RDONLY | OFlags::DIRECTORY).map_err(|e| errno(&what(), e))?;
    let all = tree::names(fd.as_fd()).map_err(|e| errno(&what(), e))?;
    let (hosts, mut names): (Vec<String>, Vec<String>) =
        all.into_iter().partition(|n| temp::is_host_entry(n.as_bytes()));
    temp::sweep_files(fd.as_fd(), &hosts);
    names.sort();
    Ok(names)
}

/// A whole regular file of at most [`MAX_READ`] bytes, decided on the opened file.
pub fn read_file(root: &Root, path: GuestPath<'_>) -> Result<Vec<u8>, Error> {
    let what = || format!("read-file {}", path.as_str());
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY;
    let fd = root.open_at(path, flags).map_err(|e| errno(&what(), e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| errno(&what(), e))?;
    let too_big = || Error::InvalidArgument(format!("{}: not a regular file of at most {MAX_READ} bytes", what()));
    if kind(&st) != FileType::RegularFile || u64::try_from(st.st_size).unwrap_or(u64::MAX) > MAX_READ {
        return Err(too_big());
    }
    let mut data = Vec::new();
    // One byte more than allowed tells a file that grew since the fstat.
    std::fs::File::from(fd)
        .take(MAX_READ + 1)
        .read_to_end(&mut data)
        .map_err(|e| Error::Internal(format!("{}: {e}", what())))?;
    if data.len() as u64 > MAX_READ {
        return Err(too_big());
    }
    Ok(data)
}

/// Temp file (locked, named as the host's) + fsync + rename + fsync of the directory: after
/// a crash the file is the old or the new content, never a torn mix, and a temp file left by
/// a killed writer is recognised and swept.
pub fn write_file(root: &Root, path: GuestPath<'_>, data: &[u8]) -> Result<(), Error> {
    let what = || format!("write-file {}", path.as_str());
    let fail = |e| errno(&what(), e);
    let (parent, name) = root.parent_of(path).map_err(fail)?;
    match rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if kind(&st) == FileType::Symlink => return Err(fail(Errno::LOOP)),
        _ => {}
    }
    let tmp = temp::create_file(parent.as_fd(), temp::Kind::Write, name).map_err(fail)?;
    let result = (|| {
        let mut f = std::fs::File::from(tmp.fd.try_clone().map_err(|e| Errno::from_io_error(&e).unwrap_or(Errno::IO))?);
        f.write_all(data).map_err(|e| Errno::from_io_error(&e).unwrap_or(Errno::IO))?;
        rustix::fs::fsync(&f)?;
        rustix::fs::renameat(&parent, tmp.name.as_str(), &parent, name)?;
        rustix::fs::fsync(&parent)
    })();
    if result.is_err() {
        let _ = rustix::fs::unlinkat(&parent, tmp.name.as_str(), AtFlags::empty());
    }
    result.map_err(fail)
}

/// Rename within the root; the target must not exist.
pub fn rename(root: &Root, from: GuestPath<'_>, to: GuestPath<'_>) -> Result<(), Error> {
    let what = || format!("rename {} -> {}", from.as_str(), to.as_str());
    let fail = |e| errno(&what(), e);
    let (fp, fname) = root.parent_of(from).map_err(fail)?;
    let (tp, tname) = root.parent_of(to).map_err(fail)?;
    let st = rustix::fs::statat(&fp, fname, AtFlags::SYMLINK_NOFOLLOW).map_err(fail)?;
    if kind(&st) == FileType::Symlink {
        return Err(fail(Errno::LOOP));
    }
    match rustix::fs::renameat_with(&fp, fname, &tp, tname, RenameFlags::NOREPLACE) {
        Ok(()) => Ok(()),
        Err(Errno::EXIST) => Err(Error::AlreadyExists(format!("{}: target exists", what()))),
        // A file system without RENAME_NOREPLACE: check, then rename.
        Err(Errno::INVAL) => match rustix::fs::statat(&tp, tname, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(_) => Err(Error::AlreadyExists(format!("{}: target exists", what()))),
            Err(_) => rustix::fs::renameat(&fp, fname, &tp, tname).map_err(fail),
        },
        Err(e) => Err(fail(e)),
    }
}

/// Remove a file or a whole tree; absent succeeds. A walk stopped by `stop` leaves what it
/// has not reached yet for the next call.
pub fn remove_all(root: &Root, path: GuestPath<'_>, stop: &Stop) -> Result<(), Error> {
    let what = || format!("remove-all {}", path.as_str());
    let fail = |e| errno(&what(), e);
    let (parent, name) = match root.parent_of(path) {
        Ok(p) => p,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(fail(e)),
    };
    let st = match rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(fail(e)),
    };
    match kind(&st) {
        FileType::Symlink => Err(fail(Errno::LOOP)),
        FileType::Directory => tree::remove_tree(parent.as_fd(), &cstr(name)?, stop).map_err(|e| walk(&what(), e)),
        _ => match rustix::fs::unlinkat(&parent, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            // Became a directory since the stat.
            Err(Errno::ISDIR) => tree::remove_tree(parent.as_fd(), &cstr(name)?, stop).map_err(|e| walk(&what(), e)),
            Err(e) => Err(fail(e)),
        },
    }
}

/// Bytes used by a tree (apparent sizes of everything but directories).
pub fn usage(root: &Root, path: GuestPath<'_>, stop: &Stop) -> Result<u64, Error> {
    let what = || format!("usage {}", path.as_str());
    let fd = root.open_at(path, OFlags::PATH).map_err(|e| errno(&what(), e))?;
    let st = rustix::fs::fstat(&fd).map_err(|e| errno(&what(), e))?;
    if kind(&st) != FileType::Directory {
        return Ok(u64::try_from(st.st_size).unwrap_or(0));
    }
    // An O_PATH fd serves as the base of an *at call: reopen that very directory to read it.
    let dir = rustix::fs::openat(&fd, c".", OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| errno(&what(), e))?;
    tree::usage(dir.as_fd(), 1, stop).map_err(|e| walk(&what(), e))
}

/// Space of the file system holding the root.
pub fn space(root: &Root) -> Result<Space, Error> {
    let s = rustix::fs::fstatvfs(root.fd()).map_err(|e| errno(&format!("statvfs {}", root.path().display()), e))?;
    Ok(Space {
        total_bytes: s.f_blocks.saturating_mul(s.f_frsize),
        available_bytes: s.f_bavail.saturating_mul(s.f_frsize),
    })
}

/// A whole copy under a temporary name beside its target, held (locked) until placed.
pub struct Copied {
    parent: OwnedFd,
    temp: temp::Held,
    target: String,
}

impl Copied {
    /// Rename the copy to its target, which must still not exist.
    pub fn place(self) -> Result<(), Error> {
        let what = format!("copy-tree to {}", self.target);
        let placed = match rustix::fs::renameat_with(
            &self.parent,
            self.temp.name.as_str(),
            &self.parent,
            self.target.as_str(),
            RenameFlags::NOREPLACE,
        ) {
            Err(Errno::INVAL) => {
                match rustix::fs::statat(&self.parent, self.target.as_str(), AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(_) => Err(Errno::EXIST),
                    Err(_) => {
                        rustix::fs::renameat(&self.parent, self.temp.name.as_str(), &self.parent, self.target.as_str())
                    }
                }
            }
            other => other,
        };
        match placed {
            Ok(()) => rustix::fs::fsync(&self.parent).map_err(|e| errno(&what, e)),
            Err(e) => {
                self.discard();
                Err(match e {
                    Errno::EXIST | Errno::NOTEMPTY => Error::AlreadyExists(format!("{what}: target exists")),
                    e => errno(&what, e),
                })
            }
        }
    }

    /// Remove the unplaced copy.
    pub fn discard(self) {
        if let Ok(name) = CString::new(self.temp.name.as_str()) {
            let _ = tree::remove_tree(self.parent.as_fd(), &name, &Stop::never());
        }
    }
}

/// Copy `from` (a directory or a regular file) to a temporary entry beside `to`, which must
/// not exist: modes, owners, times and symlinks kept. The copy is placed by [`Copied::place`]
/// (so a copy that stops halfway never appears at `to`); dead temporary entries of earlier
/// copies in that directory are removed first.
pub fn copy_to_temp(
    root: &Root,
    from: GuestPath<'_>,
    to: GuestPath<'_>,
    stop: &Stop,
    progress: &Progress,
) -> Result<Copied, Error> {
    let what = || format!("copy-tree {} -> {}", from.as_str(), to.as_str());
    let fail = |e| errno(&what(), e);
    let (parent, target) = root.parent_of(to).map_err(fail)?;
    if rustix::fs::statat(&parent, target, AtFlags::SYMLINK_NOFOLLOW).is_ok() {
        return Err(Error::AlreadyExists(format!("{}: target exists", what())));
    }
    let src = root
        .open_at(from, OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY)
        .map_err(|e| walk(&what(), WalkError::Io { name: from.as_str().into(), errno: e }))?;
    let st = rustix::fs::fstat(&src).map_err(fail)?;
    tree::sweep_trees(parent.as_fd());
    let tname = cstr(target)?;
    let (held, copied) = match kind(&st) {
        FileType::Directory => {
            let held = temp::create_dir(parent.as_fd(), temp::Kind::Copy, target).map_err(fail)?;
            let copied = tree::copy_dir(src.as_fd(), held.fd.as_fd(), 1, stop, progress)
                .and_then(|()| tree::finish_top(held.fd.as_fd(), &st, &tname));
            (held, copied)
        }
        FileType::RegularFile => {
            let held = temp::create_file(parent.as_fd(), temp::Kind::Copy, target).map_err(fail)?;
            let dst = held.fd.try_clone().map_err(|e| Error::Internal(format!("{}: {e}", what())))?;
            (held, tree::copy_file(src, dst, &st, &tname, stop, progress))
        }
        _ => return Err(Error::InvalidArgument(format!("{}: the source is not a directory or regular file", what()))),
    };
    let copied =
        copied.and_then(|()| rustix::fs::syncfs(&held.fd).map_err(|e| WalkError::Io { name: target.into(), errno: e }));
    let copy = Copied { parent, temp: held, target: target.to_string() };
    match copied {
        Ok(()) => Ok(copy),
        Err(e) => {
            copy.discard();
            Err(walk(&what(), e))
        }
    }
}
