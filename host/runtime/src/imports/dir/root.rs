//! A granted root held open, and every guest path opened *beneath* its file descriptor.
//!
//! A pod owns the directories of its volumes and can swap any entry for a symlink at any
//! moment, so a path checked first and opened later can lead anywhere. Here nothing is checked
//! by name and then used: each open resolves the path in the kernel relative to the root's fd,
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)` where the kernel
//! has it (Linux 5.6+), else one `openat(O_NOFOLLOW)` per component. Either way no symlink is
//! followed and nothing outside the root is ever opened; what a caller then decides, it decides
//! on the opened fd (`fstat`), never on an earlier lookup.
//!
//! Why not `cap-std`: it follows symlinks that stay inside its sandbox, where the `dir`
//! contract follows none, and its tree operations cannot stop between entries at a deadline.
//! The syscalls come from `rustix` (already in the tree through wasmtime).
use super::path::GuestPath;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Set once `openat2` is found missing (ENOSYS, or refused by a seccomp filter).
static NO_OPENAT2: AtomicBool = AtomicBool::new(false);

/// An open granted root.
pub struct Root {
    fd: OwnedFd,
    path: PathBuf,
}

impl Root {
    /// Open the operator's root directory (it may itself be reached through symlinks: the
    /// operator's path is trusted, the guest's are not).
    pub fn open(path: &Path) -> Result<Self, Errno> {
        let fd = rustix::fs::open(path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())?;
        Ok(Self { fd, path: path.to_path_buf() })
    }

    /// [`Root::open`], creating the root first when it is missing but its parent exists: a
    /// granted root is the operator's word that it may exist (as kubelet's `DirectoryOrCreate`
    /// makes a hostPath), and a controller or a new node where nothing made it yet must still
    /// answer (GetCapacity above all: the scheduler waits on its answer). Only the last
    /// component is created, 0755 like `DirectoryOrCreate`: a missing parent is more likely a
    /// disk that is not mounted, and creating the tree would put volumes on the wrong disk.
    pub fn open_or_create(path: &Path) -> Result<Self, Errno> {
        match Self::open(path) {
            Err(Errno::NOENT) => {}
            other => return other,
        }
        match rustix::fs::mkdir(path, Mode::from_raw_mode(0o755)) {
            Ok(()) => tracing::info!(root = %path.display(), "created the missing dir root"),
            Err(Errno::EXIST) => {}
            Err(e) => return Err(e),
        }
        Self::open(path)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Open `path` beneath the root with `flags` (CLOEXEC added). A symlink anywhere on the
    /// path, the last component included, is `ELOOP`; a missing component `ENOENT`; a
    /// component that is not a directory `ENOTDIR`.
    pub fn open_at(&self, path: GuestPath<'_>, flags: OFlags) -> Result<OwnedFd, Errno> {
        if path.is_root() {
            return rustix::fs::openat(self.fd(), c".", flags | OFlags::CLOEXEC, Mode::empty());
        }
        open_beneath(self.fd(), path.as_str(), flags)
    }

    /// The directory holding `path`'s last component (opened beneath the root), and that name.
    /// `EINVAL` for the root itself, which has no parent inside the root.
    pub fn parent_of<'p>(&self, path: GuestPath<'p>) -> Result<(OwnedFd, &'p str), Errno> {
        let (parent, name) = path.split_last().ok_or(Errno::INVAL)?;
        Ok((self.open_at(parent, OFlags::RDONLY | OFlags::DIRECTORY)?, name))
    }
}

/// Open the relative, checked `path` beneath `dir`, following no symlink.
pub fn open_beneath(dir: BorrowedFd<'_>, path: &str, flags: OFlags) -> Result<OwnedFd, Errno> {
    if !NO_OPENAT2.load(Ordering::Relaxed) {
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        match rustix::fs::openat2(dir, path, flags | OFlags::CLOEXEC, Mode::empty(), resolve) {
            Err(Errno::NOSYS) => NO_OPENAT2.store(true, Ordering::Relaxed),
            // EPERM may be a seccomp filter refusing a syscall it does not know: the walk
            // answers for this path (a real EPERM comes back from it as well). EAGAIN: openat2
            // gave up retrying around a concurrent rename.
            Err(Errno::PERM | Errno::AGAIN) => {}
            other => return other,
        }
    }
    open_by_components(dir, path, flags)
}

/// The portable walk: each directory on the way opened with `O_NOFOLLOW`, so a symlink is
/// never followed; the last component too (an `O_PATH` open of a symlink is refused here by
/// `fstat`, since `O_PATH | O_NOFOLLOW` would hand back the link itself).
pub fn open_by_components(dir: BorrowedFd<'_>, path: &str, flags: OFlags) -> Result<OwnedFd, Errno> {
    let mut parts = path.split('/').peekable();
    let mut held: Option<OwnedFd> = None;
    while let Some(part) = parts.next() {
        let at = held.as_ref().map_or(dir, |f| f.as_fd());
        if parts.peek().is_some() {
            let next = rustix::fs::openat(
                at,
                part,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| classify(at, part, e))?;
            held = Some(next);
            continue;
        }
        let fd = rustix::fs::openat(at, part, flags | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| classify(at, part, e))?;
        if flags.contains(OFlags::PATH) && FileType::from_raw_mode(rustix::fs::fstat(&fd)?.st_mode) == FileType::Symlink
        {
            return Err(Errno::LOOP);
        }
        return Ok(fd);
    }
    Err(Errno::INVAL)
}

/// Tell a symlink (`ELOOP`) from a non-directory (`ENOTDIR`) after an `O_NOFOLLOW` open of
/// `name` failed with either: with `O_DIRECTORY` the kernel says `ENOTDIR` for both.
pub fn classify(dir: BorrowedFd<'_>, name: &str, e: Errno) -> Errno {
    if e != Errno::NOTDIR && e != Errno::LOOP {
        return e;
    }
    match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => Errno::LOOP,
        Ok(_) => Errno::NOTDIR,
        Err(other) => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_root_is_created_when_its_parent_exists_and_only_then() {
        let d = tempfile::tempdir().expect("tempdir");
        let root = d.path().join("hostpath");
        Root::open_or_create(&root).expect("created");
        assert!(root.is_dir());
        Root::open_or_create(&root).expect("opened again");
        let deeper = d.path().join("unmounted-disk/hostpath");
        assert_eq!(Root::open_or_create(&deeper).err(), Some(Errno::NOENT));
        assert!(!d.path().join("unmounted-disk").exists(), "no parent created");
    }

    /// Both resolvers refuse a symlink anywhere and open what is beneath.
    #[test]
    fn both_resolvers_refuse_symlinks_on_the_way_and_at_the_end() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(d.path().join("a/b")).expect("mkdir");
        std::fs::write(d.path().join("a/b/f"), b"x").expect("write");
        std::os::unix::fs::symlink("/etc", d.path().join("a/up")).expect("symlink");
        std::os::unix::fs::symlink("b/f", d.path().join("a/lf")).expect("symlink");
        let root = Root::open(d.path()).expect("root");
        let open2 = |p: &str, f| open_beneath(root.fd(), p, f);
        let walk = |p: &str, f| open_by_components(root.fd(), p, f);
        for open in [&open2 as &dyn Fn(&str, OFlags) -> Result<OwnedFd, Errno>, &walk] {
            assert!(open("a/b/f", OFlags::RDONLY).is_ok());
            assert_eq!(open("a/up/passwd", OFlags::RDONLY).err(), Some(Errno::LOOP));
            assert_eq!(open("a/up", OFlags::RDONLY | OFlags::DIRECTORY).err(), Some(Errno::LOOP));
            assert_eq!(open("a/lf", OFlags::RDONLY).err(), Some(Errno::LOOP));
            assert_eq!(open("a/lf", OFlags::PATH).err(), Some(Errno::LOOP));
            assert_eq!(open("a/missing/x", OFlags::RDONLY).err(), Some(Errno::NOENT));
            assert_eq!(open("a/b/f/x", OFlags::RDONLY).err(), Some(Errno::NOTDIR));
        }
    }
}
