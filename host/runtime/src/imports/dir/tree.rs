//! Whole-tree work beneath a root, walked by file descriptor: copy, remove, usage. Every entry
//! is reached through `*at` calls on its directory's fd with `O_NOFOLLOW`, so a pod that swaps
//! entries while a walk runs can change what is copied or counted inside its own volume, never
//! make the walk read or remove anything outside it. A walk checks its [`Stop`] between
//! entries (the call's deadline, or the cancel flag of a background copy) and holds at most
//! one directory fd per level, [`MAX_DEPTH`] levels deep.
use super::temp;
use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, RenameFlags, Stat, Timestamps};
use rustix::io::Errno;
use std::ffi::CStr;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Deepest directory level a copy or a usage walk descends to (each level holds a directory
/// fd, two for a copy). Removal has no limit: deeper subtrees are moved up and removed later.
pub const MAX_DEPTH: usize = 256;

/// File content moves in pieces of this size, so a huge file does not hold a walk past its stop.
const CHUNK: u64 = 64 << 20;

/// Passes over a directory being removed that remove nothing before removal gives up (a
/// writer keeps filling it).
const MAX_IDLE_PASSES: u32 = 3;

/// When a walk must stop.
#[derive(Clone, Default)]
pub struct Stop {
    deadline: Option<Instant>,
    cancel: Option<Arc<AtomicBool>>,
}

impl Stop {
    /// Run to the end (no deadline, no cancel).
    pub fn never() -> Self {
        Self::default()
    }
    pub fn at(deadline: Instant) -> Self {
        Self { deadline: Some(deadline), cancel: None }
    }
    pub fn cancelled_by(flag: Arc<AtomicBool>) -> Self {
        Self { deadline: None, cancel: Some(flag) }
    }
    fn check(&self) -> Result<(), WalkError> {
        if self.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(WalkError::Cancelled);
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(WalkError::Deadline);
        }
        Ok(())
    }
}

/// How far a walk got (a background copy reports it while it runs).
#[derive(Debug, Default)]
pub struct Progress {
    pub entries: AtomicU64,
    pub bytes: AtomicU64,
}

/// Why a walk ended early.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    #[error("{name}: {errno}")]
    Io { name: String, errno: Errno },
    #[error("stopped at the call's deadline")]
    Deadline,
    #[error("cancelled")]
    Cancelled,
    #[error("{name}: deeper than {MAX_DEPTH} directory levels")]
    TooDeep { name: String },
    #[error("{name}: kept changing type while being copied")]
    Unstable { name: String },
    #[error("{name}: still not empty after {MAX_IDLE_PASSES} passes removed nothing")]
    KeepsFilling { name: String },
    /// The kernel took the copy's mode but dropped bits of it (a set-group-id bit for a group
    /// the copying process is not in, without CAP_FSETID): the copy would differ silently.
    #[error("{name}: mode {want:o} asked, {got:o} kept (the set-id bits need CAP_FSETID)")]
    ModeNotKept { name: String, want: u32, got: u32 },
}

fn io(name: &CStr) -> impl FnOnce(Errno) -> WalkError + '_ {
    move |errno| WalkError::Io { name: lossy(name), errno }
}

fn lossy(name: &CStr) -> String {
    name.to_string_lossy().into_owned()
}

fn kind(st: &Stat) -> FileType {
    FileType::from_raw_mode(st.st_mode)
}

const DIR_FLAGS: OFlags = OFlags::RDONLY.union(OFlags::DIRECTORY).union(OFlags::NOFOLLOW).union(OFlags::CLOEXEC);

/// Names in the directory `dir` (without `.` and `..`), unsorted.
pub fn names(dir: BorrowedFd<'_>) -> Result<Vec<String>, Errno> {
    let mut d = Dir::read_from(dir)?;
    let mut out = Vec::new();
    while let Some(entry) = d.read() {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            out.push(String::from_utf8_lossy(name).into_owned());
        }
    }
    Ok(out)
}

/// Call `f(dirfd, name, d_type)` for each entry of the directory `dir`, checking `stop`
/// before each. Names are passed as the kernel gave them (not UTF-8 is fine).
fn each_entry(
    dir: BorrowedFd<'_>,
    stop: &Stop,
    mut f: impl FnMut(BorrowedFd<'_>, &CStr, FileType) -> Result<(), WalkError>,
) -> Result<(), WalkError> {
    let mut d = Dir::read_from(dir).map_err(io(c"."))?;
    while let Some(entry) = d.read() {
        stop.check()?;
        let entry = entry.map_err(io(c"."))?;
        let name = entry.file_name();
        if name == c"." || name == c".." {
            continue;
        }
        f(dir, name, entry.file_type())?;
    }
    Ok(())
}

/// Bytes used beneath the open directory `dir` (apparent sizes of everything but
/// directories), `depth` levels below where the walk started.
pub fn usage(dir: BorrowedFd<'_>, depth: usize, stop: &Stop) -> Result<u64, WalkError> {
    let mut total = 0u64;
    each_entry(dir, stop, |dir, name, _| {
        let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(()),
            Err(e) => return Err(io(name)(e)),
        };
        if kind(&st) != FileType::Directory {
            total = total.saturating_add(u64::try_from(st.st_size).unwrap_or(0));
            return Ok(());
        }
        if depth >= MAX_DEPTH {
            return Err(WalkError::TooDeep { name: lossy(name) });
        }
        match rustix::fs::openat(dir, name, DIR_FLAGS, Mode::empty()) {
            Ok(sub) => total = total.saturating_add(usage(sub.as_fd(), depth + 1, stop)?),
            // Gone, or swapped for something else since the stat: nothing to count beneath.
            Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => {}
            Err(e) => return Err(io(name)(e)),
        }
        Ok(())
    })?;
    Ok(total)
}

/// Remove the directory `name` of `parent` and everything beneath it; absent succeeds.
pub fn remove_tree(parent: BorrowedFd<'_>, name: &CStr, stop: &Stop) -> Result<(), WalkError> {
    let top = match rustix::fs::openat(parent, name, DIR_FLAGS, Mode::empty()) {
        Ok(fd) => fd,
        Err(Errno::NOENT) => return Ok(()),
        Err(Errno::NOTDIR | Errno::LOOP) => {
            return match rustix::fs::unlinkat(parent, name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => Ok(()),
                Err(e) => Err(io(name)(e)),
            };
        }
        Err(e) => return Err(io(name)(e)),
    };
    let mut idle = 0;
    loop {
        let removed = empty_dir(top.as_fd(), top.as_fd(), 1, stop)?;
        match rustix::fs::unlinkat(parent, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => return Ok(()),
            // Subtrees moved up, or a writer adding entries: another pass.
            Err(Errno::NOTEMPTY | Errno::EXIST) => {}
            Err(e) => return Err(io(name)(e)),
        }
        idle = if removed == 0 { idle + 1 } else { 0 };
        if idle >= MAX_IDLE_PASSES {
            return Err(WalkError::KeepsFilling { name: lossy(name) });
        }
    }
}

/// Remove what `dir` holds, returning how many entries went. Directories at [`MAX_DEPTH`]
/// are moved up into `top` under a host name instead of descended into, so the fds held stay
/// bounded however deep a pod nested its tree; the next pass over `top` removes them.
fn empty_dir(dir: BorrowedFd<'_>, top: BorrowedFd<'_>, depth: usize, stop: &Stop) -> Result<u64, WalkError> {
    let mut removed = 0u64;
    each_entry(dir, stop, |dir, name, d_type| {
        let is_dir = match d_type {
            FileType::Directory => true,
            FileType::Unknown => rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW)
                .map(|st| kind(&st) == FileType::Directory)
                .unwrap_or(false),
            _ => false,
        };
        if !is_dir {
            match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
                Ok(()) => removed += 1,
                // Gone, or became a directory meanwhile (the next pass sees it).
                Err(Errno::NOENT | Errno::ISDIR) => {}
                Err(e) => return Err(io(name)(e)),
            }
            return Ok(());
        }
        if depth >= MAX_DEPTH {
            let hoisted = temp::name(temp::Kind::Remove, "");
            return match rustix::fs::renameat_with(dir, name, top, hoisted.as_str(), RenameFlags::NOREPLACE) {
                Ok(()) => {
                    removed += 1;
                    Ok(())
                }
                Err(Errno::NOENT) => Ok(()),
                Err(e) => Err(io(name)(e)),
            };
        }
        match rustix::fs::openat(dir, name, DIR_FLAGS, Mode::empty()) {
            Ok(sub) => removed += empty_dir(sub.as_fd(), top, depth + 1, stop)?,
            Err(Errno::NOENT) => return Ok(()),
            Err(Errno::NOTDIR | Errno::LOOP) => {
                // Swapped for a file or symlink: unlink the new entry itself.
                return match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
                    Ok(()) | Err(Errno::NOENT) => Ok(()),
                    Err(e) => Err(io(name)(e)),
                };
            }
            Err(e) => return Err(io(name)(e)),
        }
        match rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR) {
            Ok(()) => removed += 1,
            Err(Errno::NOENT | Errno::NOTEMPTY | Errno::EXIST) => {}
            Err(e) => return Err(io(name)(e)),
        }
        Ok(())
    })?;
    Ok(removed)
}

/// Give the copy `fd` the owner, mode and times of `src` (owner first: chown clears the
/// set-id bits a chmod sets). On the open fd, never by name. Needs CAP_CHOWN (an owner not
/// ours), CAP_FOWNER (mode and times of a file no longer ours) and CAP_FSETID (a set-group-id
/// bit for a group we are not in); without them the kernel refuses (EPERM) or, for the last,
/// silently drops the bit, which is checked here so a copy never differs without an error.
fn finish(fd: BorrowedFd<'_>, src: &Stat, name: &CStr) -> Result<(), WalkError> {
    rustix::fs::fchown(fd, Some(rustix::fs::Uid::from_raw(src.st_uid)), Some(rustix::fs::Gid::from_raw(src.st_gid)))
        .map_err(io(name))?;
    let want = src.st_mode & 0o7777;
    rustix::fs::fchmod(fd, Mode::from_raw_mode(want)).map_err(io(name))?;
    let got = rustix::fs::fstat(fd).map_err(io(name))?.st_mode & 0o7777;
    if got != want {
        return Err(WalkError::ModeNotKept { name: lossy(name), want, got });
    }
    rustix::fs::futimens(fd, &times(src)).map_err(io(name))
}

#[allow(clippy::cast_possible_wrap, reason = "nanoseconds are below 10^9")]
fn times(st: &Stat) -> Timestamps {
    let ts = |tv_sec, tv_nsec| rustix::fs::Timespec { tv_sec, tv_nsec };
    Timestamps {
        last_access: ts(st.st_atime, st.st_atime_nsec as i64),
        last_modification: ts(st.st_mtime, st.st_mtime_nsec as i64),
    }
}

/// Copy the content of the open source directory `src` into the empty directory `dst`.
pub fn copy_dir(
    src: BorrowedFd<'_>,
    dst: BorrowedFd<'_>,
    depth: usize,
    stop: &Stop,
    progress: &Progress,
) -> Result<(), WalkError> {
    each_entry(src, stop, |src, name, _| copy_entry(src, name, dst, depth, stop, progress))
}

/// Copy the open regular file `src` (already `fstat`ed as `st`) to the open file `dst`.
pub fn copy_file(
    src: OwnedFd,
    dst: OwnedFd,
    st: &Stat,
    name: &CStr,
    stop: &Stop,
    progress: &Progress,
) -> Result<(), WalkError> {
    let (src, mut dst) = (std::fs::File::from(src), std::fs::File::from(dst));
    loop {
        stop.check()?;
        let n = std::io::copy(&mut (&src).take(CHUNK), &mut dst)
            .map_err(|e| WalkError::Io { name: lossy(name), errno: Errno::from_io_error(&e).unwrap_or(Errno::IO) })?;
        progress.bytes.fetch_add(n, Ordering::Relaxed);
        if n == 0 {
            break;
        }
    }
    finish(dst.as_fd(), st, name)
}

/// Copy the entry `name` of `src_dir` into `dst_dir`. The kind is decided on what was opened:
/// an entry swapped between the stat and the open is looked at again (a few times), a
/// vanished one is skipped, sockets, fifos and devices are not copied.
fn copy_entry(
    src_dir: BorrowedFd<'_>,
    name: &CStr,
    dst_dir: BorrowedFd<'_>,
    depth: usize,
    stop: &Stop,
    progress: &Progress,
) -> Result<(), WalkError> {
    progress.entries.fetch_add(1, Ordering::Relaxed);
    for _ in 0..3 {
        let st = match rustix::fs::statat(src_dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(()),
            Err(e) => return Err(io(name)(e)),
        };
        match kind(&st) {
            FileType::Symlink => {
                let target = match rustix::fs::readlinkat(src_dir, name, Vec::new()) {
                    Ok(t) => t,
                    Err(Errno::NOENT) => return Ok(()),
                    Err(Errno::INVAL) => continue,
                    Err(e) => return Err(io(name)(e)),
                };
                match rustix::fs::symlinkat(target.as_c_str(), dst_dir, name) {
                    Err(Errno::EXIST) => return Ok(()),
                    other => other.map_err(io(name))?,
                }
                let (uid, gid) = (rustix::fs::Uid::from_raw(st.st_uid), rustix::fs::Gid::from_raw(st.st_gid));
                rustix::fs::chownat(dst_dir, name, Some(uid), Some(gid), AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(io(name))?;
                rustix::fs::utimensat(dst_dir, name, &times(&st), AtFlags::SYMLINK_NOFOLLOW).map_err(io(name))?;
                return Ok(());
            }
            FileType::Directory => {
                if depth >= MAX_DEPTH {
                    return Err(WalkError::TooDeep { name: lossy(name) });
                }
                let src = match rustix::fs::openat(src_dir, name, DIR_FLAGS, Mode::empty()) {
                    Ok(fd) => fd,
                    Err(Errno::NOENT) => return Ok(()),
                    Err(Errno::NOTDIR | Errno::LOOP) => continue,
                    Err(e) => return Err(io(name)(e)),
                };
                let st = rustix::fs::fstat(&src).map_err(io(name))?;
                match rustix::fs::mkdirat(dst_dir, name, Mode::from_raw_mode(0o700)) {
                    // Listed twice (a rename in the source while it was read): copied already.
                    Err(Errno::EXIST) => return Ok(()),
                    other => other.map_err(io(name))?,
                }
                let dst = rustix::fs::openat(dst_dir, name, DIR_FLAGS, Mode::empty()).map_err(io(name))?;
                copy_dir(src.as_fd(), dst.as_fd(), depth + 1, stop, progress)?;
                // Last: adding entries changed the directory's times.
                return finish(dst.as_fd(), &st, name);
            }
            FileType::RegularFile => {
                let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
                let src = match rustix::fs::openat(src_dir, name, flags, Mode::empty()) {
                    Ok(fd) => fd,
                    Err(Errno::NOENT) => return Ok(()),
                    Err(Errno::LOOP) => continue,
                    Err(e) => return Err(io(name)(e)),
                };
                let st = rustix::fs::fstat(&src).map_err(io(name))?;
                if kind(&st) != FileType::RegularFile {
                    continue;
                }
                let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let dst = match rustix::fs::openat(dst_dir, name, flags, Mode::from_raw_mode(0o600)) {
                    Err(Errno::EXIST) => return Ok(()),
                    other => other.map_err(io(name))?,
                };
                return copy_file(src, dst, &st, name, stop, progress);
            }
            // Sockets, fifos and devices have no place in a volume copy.
            _ => return Ok(()),
        }
    }
    Err(WalkError::Unstable { name: lossy(name) })
}

/// Give a copied top-level directory its source's owner, mode and times.
pub fn finish_top(dst: BorrowedFd<'_>, src: &Stat, name: &CStr) -> Result<(), WalkError> {
    finish(dst, src, name)
}

/// Remove every dead host entry of `dir` (see `temp`), trees included (for a background thread).
pub fn sweep_trees(dir: BorrowedFd<'_>) {
    let Ok(names) = names(dir) else { return };
    for name in names.into_iter().filter(|n| temp::is_host_entry(n.as_bytes())) {
        let Some((fd, kind)) = temp::claim_dead(dir, &name) else { continue };
        let result = if kind == FileType::Directory {
            let c = std::ffi::CString::new(name.as_str()).unwrap_or_default();
            remove_tree(dir, &c, &Stop::never()).map_err(|e| e.to_string())
        } else {
            rustix::fs::unlinkat(dir, name.as_str(), AtFlags::empty()).map_err(|e| e.to_string())
        };
        drop(fd);
        match result {
            Ok(()) => tracing::info!(name, "removed a dead writer's temporary entry"),
            Err(error) => tracing::warn!(name, error, "could not remove a dead writer's temporary entry"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_dir(p: &std::path::Path) -> OwnedFd {
        rustix::fs::open(p, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty()).expect("open")
    }

    #[test]
    fn removal_of_a_tree_deeper_than_the_fd_bound_completes() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut p = d.path().join("t");
        for _ in 0..(MAX_DEPTH * 2 + 7) {
            p.push("d");
        }
        std::fs::create_dir_all(&p).expect("deep tree");
        std::fs::write(p.join("f"), b"x").expect("leaf");
        let root = open_dir(d.path());
        let usage_err = {
            let t = rustix::fs::openat(&root, "t", DIR_FLAGS, Mode::empty()).expect("open");
            usage(t.as_fd(), 1, &Stop::never())
        };
        assert!(matches!(usage_err, Err(WalkError::TooDeep { .. })), "{usage_err:?}");
        remove_tree(root.as_fd(), c"t", &Stop::never()).expect("remove");
        assert!(!d.path().join("t").exists());
    }

    #[test]
    fn a_walk_stops_at_its_deadline() {
        let d = tempfile::tempdir().expect("tempdir");
        for i in 0..50 {
            std::fs::create_dir_all(d.path().join(format!("t/{i}"))).expect("mkdir");
        }
        let root = open_dir(d.path());
        let past = Stop::at(Instant::now());
        assert!(matches!(remove_tree(root.as_fd(), c"t", &past), Err(WalkError::Deadline)));
        let t = rustix::fs::openat(&root, "t", DIR_FLAGS, Mode::empty()).expect("open");
        assert!(matches!(usage(t.as_fd(), 1, &past), Err(WalkError::Deadline)));
        assert!(d.path().join("t").exists(), "nothing happens after the stop");
    }
}
