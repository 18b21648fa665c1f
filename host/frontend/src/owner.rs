//! Who owns a FUSE mount of ours and the loop devices on its file, and whether that owner still
//! lives: what lets any process tell a live volume from one a dead process left behind.
//!
//! A pid cannot say it: in Kubernetes both the data path and the node plugin run as pid 1 of
//! their own pid namespace, so a restarted process has the pid of the one that died, and a
//! process in another container cannot look the pid up at all. An *owner* is one process start
//! instead: an id made of this boot's id (`/proc/sys/kernel/random/boot_id`) and a random part,
//! written into the name of every FUSE mount point the process makes (`fuse-NAME.OWNER.SEQ`),
//! and a lock file per runtime directory it mounts under (`RUNTIME/owners/OWNER.lock`) that it
//! holds locked (`flock`) while it lives. The kernel drops the lock when the process dies, however
//! it dies, and a lock is the same lock in every mount and pid namespace that sees the file: an
//! owner is alive exactly when its lock file is locked. A live upgrade (`execve`) keeps the lock's
//! fd open for the next image, which takes the same id over ([`adopt`]): it is the same process.
//!
//! This module owns the id and the locks; what is reclaimed from a dead owner is
//! [`crate::fuse::reclaim_dead`]'s.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock, PoisonError};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

use crate::FrontendError;

/// Where the owners' lock files live, under a runtime directory.
const OWNERS: &str = "owners";

/// This process start's owner, and the lock it holds in each runtime directory it mounted under.
pub struct Owner {
    id: String,
    locks: Mutex<HashMap<PathBuf, Flock<File>>>,
}

static THIS_PROCESS: OnceLock<Owner> = OnceLock::new();

/// The owner of everything this process mounts (made on first use).
pub fn this_process() -> &'static Owner {
    THIS_PROCESS.get_or_init(|| Owner { id: new_id(), locks: Mutex::default() })
}

/// Takes over, in the image after a live upgrade's `execve`, the owner of the image before:
/// its id and the locks it kept open across the `execve` (runtime directory and fd, from
/// [`Owner::locks`]). Must run before anything in this process mounted or looked up its owner.
pub fn adopt(id: &str, locks: Vec<(PathBuf, OwnedFd)>) -> Result<&'static Owner, FrontendError> {
    if !is_owner_id(id) {
        return Err(FrontendError::Invalid(format!("{id:?} is not an owner id")));
    }
    let held = locks
        .into_iter()
        .map(|(dir, fd)| {
            // Already locked by this open file: locking again only confirms it (and takes it
            // if, against all expectation, nobody held it).
            Flock::lock(File::from(fd), FlockArg::LockExclusiveNonblock)
                .map(|lock| (dir.clone(), lock))
                .map_err(|(_, e)| FrontendError::io(format!("the inherited owner lock of {}", dir.display()), e.into()))
        })
        .collect::<Result<HashMap<_, _>, _>>()?;
    let mut fresh = Some(Owner { id: id.to_owned(), locks: Mutex::new(held) });
    let owner =
        THIS_PROCESS.get_or_init(|| fresh.take().unwrap_or_else(|| Owner { id: new_id(), locks: Mutex::default() }));
    if fresh.is_some() || owner.id != id {
        return Err(FrontendError::Invalid(format!("this process is owner {} already, not {id}", owner.id)));
    }
    Ok(owner)
}

impl Owner {
    /// `BOOT-RANDOM`: the first 8 hex digits of the boot id, then 16 random hex digits.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Makes sure this owner's lock in `runtime_dir` exists and is held (before anything is
    /// mounted there under its id).
    pub fn claim(&self, runtime_dir: &Path) -> Result<(), FrontendError> {
        let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        if locks.contains_key(runtime_dir) {
            return Ok(());
        }
        let dir = runtime_dir.join(OWNERS);
        std::fs::create_dir_all(&dir).map_err(|e| FrontendError::io(format!("creating {}", dir.display()), e))?;
        let path = lock_path(runtime_dir, &self.id);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| FrontendError::io(format!("opening {}", path.display()), e))?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| FrontendError::io(format!("locking {}", path.display()), e.into()))?;
        // For an operator who wonders whose it is.
        let _ = std::fs::write(&path, format!("pid {}\n", std::process::id()));
        locks.insert(runtime_dir.to_owned(), lock);
        Ok(())
    }

    /// The lock fds this owner holds, by runtime directory: what a live upgrade keeps open
    /// across its `execve` and names to the next image (see [`adopt`]).
    pub fn locks(&self) -> Vec<(PathBuf, i32)> {
        use std::os::fd::AsRawFd;
        let locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        locks.iter().map(|(dir, lock)| (dir.clone(), lock.as_raw_fd())).collect()
    }

    /// Runs `f` with this owner's lock fds borrowed (to clear close-on-exec for a handover).
    pub fn with_lock_fds<T>(&self, f: impl FnOnce(&[BorrowedFd<'_>]) -> T) -> T {
        let locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
        let fds: Vec<BorrowedFd<'_>> = locks.values().map(|l| l.as_fd()).collect();
        f(&fds)
    }
}

/// Whether `id` is the shape of an owner id (so a name that merely contains dots is not read
/// as a mount point of ours).
pub fn is_owner_id(id: &str) -> bool {
    let Some((boot, random)) = id.split_once('-') else { return false };
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    hex(boot, 8) && hex(random, 16)
}

/// The lock of owner `id` in `runtime_dir`, taken because its owner is dead: held, it keeps a
/// second reclaimer (the other process starting at the same time) away; [`Self::release`] then
/// removes the lock file, once nothing of the owner is left.
pub struct DeadOwner {
    path: PathBuf,
    _lock: Option<Flock<File>>,
}

impl DeadOwner {
    /// Forgets the dead owner: its lock file goes.
    pub fn release(self) {
        // Removed while locked: whoever opens it later finds no file, which says dead too.
        if let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %self.path.display(), error = %e, "removing a dead owner's lock file");
        }
    }
}

/// `Some` when owner `id` of mounts under `runtime_dir` is dead (and then holds its lock);
/// `None` while it lives, and for this process's own owner.
///
/// Dead: its boot is not this boot, or its lock file is missing (the owner creates it before it
/// mounts anything, and only a reclaimer removes it), or nobody holds its lock.
pub fn dead(runtime_dir: &Path, id: &str) -> Result<Option<DeadOwner>, FrontendError> {
    if THIS_PROCESS.get().is_some_and(|o| o.id == id) {
        return Ok(None);
    }
    let path = lock_path(runtime_dir, id);
    let other_boot = !id.starts_with(&boot_prefix());
    let file = match OpenOptions::new().write(true).open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Some(DeadOwner { path, _lock: None })),
        Err(e) => return Err(FrontendError::io(format!("opening {}", path.display()), e)),
    };
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(DeadOwner { path, _lock: Some(lock) })),
        // Locked: alive, unless it is of another boot (no lock survives a reboot; whoever holds
        // it now is a reclaimer of this boot, and it is dead all the same).
        Err((_, Errno::EWOULDBLOCK)) if other_boot => Ok(Some(DeadOwner { path, _lock: None })),
        Err((_, Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(FrontendError::io(format!("locking {}", path.display()), e.into())),
    }
}

/// The owners with a lock file under `runtime_dir`.
pub fn recorded(runtime_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(runtime_dir.join(OWNERS)) else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".lock").map(str::to_owned))
        .filter(|id| is_owner_id(id))
        .collect()
}

fn lock_path(runtime_dir: &Path, id: &str) -> PathBuf {
    runtime_dir.join(OWNERS).join(format!("{id}.lock"))
}

/// The first 8 hex digits of this boot's id.
fn boot_prefix() -> String {
    static BOOT: OnceLock<String> = OnceLock::new();
    BOOT.get_or_init(|| hex_of("/proc/sys/kernel/random/boot_id", 8)).clone()
}

fn new_id() -> String {
    // A fresh random UUID on every read: 122 random bits, of which 64 are plenty here.
    format!("{}-{}", boot_prefix(), hex_of("/proc/sys/kernel/random/uuid", 16))
}

/// The first `n` hex digits of the file at `path`; pseudo-random ones (from the time and pid) if
/// it cannot be read, which only a kernel without procfs would do.
fn hex_of(path: &str, n: usize) -> String {
    let read = std::fs::read_to_string(path).unwrap_or_default();
    let mut digits: String = read.chars().filter(char::is_ascii_hexdigit).map(|c| c.to_ascii_lowercase()).collect();
    if digits.len() < n {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        digits = format!("{:032x}", nanos ^ (u128::from(std::process::id()) << 64));
    }
    digits[..n].to_owned()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests")]
    use super::*;

    #[test]
    fn an_owner_id_is_boot_and_random_hex() {
        let id = this_process().id().to_owned();
        assert!(is_owner_id(&id), "{id}");
        assert!(id.starts_with(&boot_prefix()));
        assert_ne!(new_id(), new_id(), "two starts never share an id");
        for bad in ["", "1", "0123abcd", "0123abcd-", "0123ABCD-0123456789abcdef", "0123abcd-0123456789abcde", "x.y"] {
            assert!(!is_owner_id(bad), "{bad}");
        }
    }

    /// A real process holds an owner's lock (`flock(1)`, the same flock(2)): alive while it
    /// runs, dead once killed; a missing lock file is dead; this process's own owner never is.
    #[test]
    fn an_owner_lives_exactly_as_long_as_its_lock_is_held() {
        let dir = tempfile::tempdir().unwrap();
        let runtime = dir.path();
        std::fs::create_dir_all(runtime.join(OWNERS)).unwrap();
        let other = format!("{}-00000000000000aa", boot_prefix());
        let path = lock_path(runtime, &other);
        std::fs::write(&path, "").unwrap();
        // --no-fork: flock(1) execs `sleep` itself, so killing it releases the lock.
        let mut holder = std::process::Command::new("flock")
            .arg("--no-fork")
            .arg(&path)
            .args(["sleep", "120"])
            .spawn()
            .expect("flock(1) from util-linux");
        // Alive once flock(1) holds it.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while dead(runtime, &other).unwrap().is_some() {
            assert!(std::time::Instant::now() < deadline, "flock(1) never took the lock");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(dead(runtime, &other).unwrap().is_none(), "a held lock is a live owner");
        holder.kill().unwrap();
        holder.wait().unwrap();
        let found = dead(runtime, &other).unwrap().expect("the lock went with its holder");
        assert!(dead(runtime, &other).unwrap().is_none(), "held by the reclaimer: a second one keeps away");
        found.release();
        assert!(!path.exists(), "the dead owner's lock file is gone");
        assert!(dead(runtime, &other).unwrap().is_some(), "a missing lock file is a dead owner");

        let me = this_process();
        me.claim(runtime).unwrap();
        assert!(dead(runtime, me.id()).unwrap().is_none(), "never this process's own owner");
        assert!(recorded(runtime).contains(&me.id().to_owned()));
    }
}
