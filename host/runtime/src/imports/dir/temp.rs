//! The host's own entries in a granted root: the temporary file of a `write-file`, the
//! temporary tree of a `copy-tree`, a subtree `remove-all` moved up to keep its walk shallow.
//! Each is named `.wasmcsi-KIND.PID.SEQ.TARGET` (a prefix guests may not use, see `path.rs`),
//! so `read-dir` can leave them out, and each is held under an exclusive `flock` by the process
//! working on it. A process killed with -9 loses its locks with it: an entry with the prefix
//! that nobody holds, and that settled, belongs to a dead writer and is swept.
use super::path::{MAX_NAME, RESERVED_PREFIX};
use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags};
use rustix::io::Errno;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// What a temporary entry is for (the second word of its name).
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Write,
    Copy,
    Remove,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Self::Write => "write",
            Self::Copy => "copy",
            Self::Remove => "rm",
        }
    }
}

/// An unlocked entry younger than this is not swept: it may be between its creation and its
/// `flock` (microseconds apart), or have been created by a writer on a clock a little ahead.
pub const SETTLE: Duration = Duration::from_secs(10);

static SEQ: AtomicU64 = AtomicU64::new(0);

/// Whether `name` is one of the host's entries.
pub fn is_host_entry(name: &[u8]) -> bool {
    name.starts_with(RESERVED_PREFIX.as_bytes())
}

/// A fresh name for a temporary entry beside `target` (the target's name is kept for whoever
/// looks at the directory, clipped so the whole fits in a file name).
pub fn name(kind: Kind, target: &str) -> String {
    let head =
        format!("{RESERVED_PREFIX}{}.{}.{}.", kind.word(), std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
    let mut end = target.len().min(MAX_NAME - head.len());
    while !target.is_char_boundary(end) {
        end -= 1;
    }
    head + &target[..end]
}

/// A temporary entry this process created and holds locked.
pub struct Held {
    pub fd: OwnedFd,
    pub name: String,
}

fn lock(fd: &OwnedFd) -> Result<(), Errno> {
    rustix::fs::flock(fd, FlockOperation::NonBlockingLockExclusive)
}

/// Create and lock an empty file of `kind` beside `target` in `dir`, owner-only.
pub fn create_file(dir: BorrowedFd<'_>, kind: Kind, target: &str) -> Result<Held, Errno> {
    let name = name(kind, target);
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(dir, &name, flags, Mode::from_raw_mode(0o600))?;
    lock(&fd)?;
    Ok(Held { fd, name })
}

/// Create and lock an empty directory of `kind` beside `target` in `dir`, owner-only.
pub fn create_dir(dir: BorrowedFd<'_>, kind: Kind, target: &str) -> Result<Held, Errno> {
    let name = name(kind, target);
    rustix::fs::mkdirat(dir, &name, Mode::from_raw_mode(0o700))?;
    let fd = rustix::fs::openat(
        dir,
        &name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    lock(&fd)?;
    Ok(Held { fd, name })
}

/// A host entry of `dir` whose writer is gone, opened and locked (so no other sweeper takes
/// it meanwhile); `None` when it is held, young, not ours, or no longer there.
pub fn claim_dead(dir: BorrowedFd<'_>, name: &str) -> Option<(OwnedFd, FileType)> {
    if !is_host_entry(name.as_bytes()) {
        return None;
    }
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let fd = rustix::fs::openat(dir, name, flags, Mode::empty()).ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    let kind = FileType::from_raw_mode(st.st_mode);
    if !matches!(kind, FileType::RegularFile | FileType::Directory) {
        return None;
    }
    // mtime, not ctime: a writer changes both, and a test can only age the first.
    let changed = UNIX_EPOCH + Duration::from_secs(u64::try_from(st.st_mtime).unwrap_or(0));
    if SystemTime::now().duration_since(changed).unwrap_or_default() < SETTLE {
        return None;
    }
    lock(&fd).ok()?;
    // The name may have been replaced between the open and the lock.
    let now = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW).ok()?;
    (now.st_dev == st.st_dev && now.st_ino == st.st_ino).then_some((fd, kind))
}

/// Unlink dead temporary *files* among `names` of `dir` (cheap: one unlink each); dead
/// temporary trees are left to `tree::sweep_trees`, which may take long.
pub fn sweep_files(dir: BorrowedFd<'_>, names: &[String]) {
    for name in names {
        if let Some((fd, FileType::RegularFile)) = claim_dead(dir, name) {
            match rustix::fs::unlinkat(dir, name.as_str(), AtFlags::empty()) {
                Ok(()) => tracing::info!(name, "removed a dead writer's temporary file"),
                Err(e) => tracing::warn!(name, error = %e, "could not remove a dead writer's temporary file"),
            }
            drop(fd);
        }
    }
}

/// Give `name` an mtime `age` in the past (tests: a writer that died that long ago).
#[cfg(test)]
pub fn age(dir: BorrowedFd<'_>, name: &str, age: Duration) {
    let past = SystemTime::now() - age;
    let secs = past.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let t = rustix::fs::Timespec { tv_sec: i64::try_from(secs).unwrap_or(0), tv_nsec: 0 };
    let times = rustix::fs::Timestamps { last_access: t, last_modification: t };
    rustix::fs::utimensat(dir, name, &times, AtFlags::SYMLINK_NOFOLLOW).expect("utimensat");
}
