//! Kernel block-device frontends for a volume served from userspace.
//!
//! A [`BlockDevice`] is what the replicated engine (or, in tests, a plain sparse [`FileDevice`])
//! implements; a [`Frontend`] makes it visible to the kernel as a block device node so it can be
//! formatted and mounted. The only frontend that works on this machine's kernel is
//! [`FuseLoopFrontend`]: a one-file FUSE filesystem under a loop device. NBD and ublk plug in
//! behind the same trait on kernels that have them.
//!
//! Teardown is the part that must never go wrong: loop devices and mounts are global to the
//! machine, so every attach step registers its undo in an [`Undo`] stack, and both an explicit
//! [`Attached::detach`] and a failed attach run that stack in reverse.

pub mod fuse;
pub mod loop_dev;
pub mod mkfs;
pub mod owner;
pub mod plug;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use fuse::{FailPoint, FuseLoopFrontend};
pub use plug::{Plug, is_plugged};

/// A virtual disk of fixed size, addressed in bytes.
///
/// Implementations must be safe to call from many threads at once: frontends issue requests
/// concurrently (queue depth > 1), and concurrent requests to disjoint ranges must not affect
/// each other. Overlapping concurrent writes may land in either order, as on real disks.
pub trait BlockDevice: Send + Sync + 'static {
    /// Size in bytes; constant while attached.
    fn size(&self) -> u64;
    /// Fills all of `buf` from `offset`; the range is within `size()`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`; the range is within `size()`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every write acknowledged so far durable.
    fn flush(&self) -> io::Result<()>;
    /// Drops the data of a range; later reads of it return zeros (frontends rely on that to
    /// serve both discard and write-zeroes with it).
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;

    /// Starts a write of `data` at `offset` and calls `done` with its result, on any thread,
    /// possibly before this returns. A frontend that can answer requests out of order (FUSE)
    /// uses it so that one of its threads keeps many requests in flight instead of sleeping on
    /// each: a device that completes I/O on its own threads saves a thread wakeup per request
    /// and is not limited to one request per frontend thread. The default writes synchronously.
    fn submit_write(&self, data: &[u8], offset: u64, done: WriteDone) {
        done(self.write_at(data, offset));
    }

    /// Starts a read of `len` bytes at `offset` and calls `done` with the data, like
    /// [`Self::submit_write`]. The default reads synchronously.
    fn submit_read(&self, offset: u64, len: usize, done: ReadDone) {
        let mut buf = vec![0u8; len];
        match self.read_at(&mut buf, offset) {
            Ok(()) => done(Ok(&buf)),
            Err(e) => done(Err(e)),
        }
    }

    /// Sends whatever `submit_*` calls held back while the calling thread was plugged (see
    /// [`plug`]). A frontend calls it after it unplugs and before it waits for the next request;
    /// a device that holds nothing back needs nothing here.
    fn unplug(&self) {}
}

/// Completion of [`BlockDevice::submit_write`].
pub type WriteDone = Box<dyn FnOnce(io::Result<()>) + Send>;
/// Completion of [`BlockDevice::submit_read`]: the data is borrowed for the call only.
pub type ReadDone = Box<dyn for<'a> FnOnce(io::Result<&'a [u8]>) + Send>;

/// A [`BlockDevice`] over a plain (sparse) file, for tests and as a reference implementation.
#[derive(Debug)]
pub struct FileDevice {
    file: File,
    size: AtomicU64,
    path: PathBuf,
}

impl FileDevice {
    /// Creates (or truncates) a sparse file of `size` bytes.
    pub fn create(path: &Path, size: u64) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        file.set_len(size)?;
        Ok(Self { file, size: AtomicU64::new(size), path: path.to_path_buf() })
    }

    /// Opens an existing file; its current length is the device size.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let size = file.metadata()?.len();
        Ok(Self { file, size: AtomicU64::new(size), path: path.to_path_buf() })
    }

    /// Grows the device (and its file) to `size`; shrinking is refused.
    pub fn grow(&self, size: u64) -> io::Result<()> {
        if size < self.size.load(Ordering::Acquire) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a block device does not shrink"));
        }
        self.file.set_len(size)?;
        self.size.store(size, Ordering::Release);
        Ok(())
    }

    /// The backing file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size.load(Ordering::Acquire) => Ok(()),
            _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "range beyond the end of the device")),
        }
    }
}

impl BlockDevice for FileDevice {
    fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.file.write_all_at(buf, offset)
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_range(offset, len)?;
        let (Ok(off), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "range does not fit off_t"));
        };
        // KEEP_SIZE: a discard must never change the device size.
        let mode = nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
        nix::fcntl::fallocate(&self.file, mode, off, len).map_err(io::Error::from)
    }
}

/// Errors of attaching and detaching a frontend.
#[derive(Debug, thiserror::Error)]
pub enum FrontendError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Command { command: String, status: String, stderr: String },
    #[error("invalid volume: {0}")]
    Invalid(String),
    #[error("{device} is still mounted at {mounts:?}; unmount it before detaching")]
    InUse { device: PathBuf, mounts: Vec<PathBuf> },
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("injected failure at {0:?}")]
    Injected(FailPoint),
}

impl FrontendError {
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io { context: context.into(), source }
    }
}

/// Something that exposes a [`BlockDevice`] to the kernel as a block device node.
pub trait Frontend {
    /// Exposes `dev` as a kernel block device. `name` identifies the volume in paths and logs
    /// (letters, digits, `.`, `_`, `-`). On error nothing of the attempt is left behind.
    fn attach(&self, dev: Arc<dyn BlockDevice>, name: &str) -> Result<Attached, FrontendError>;
}

type UndoStep = Box<dyn FnOnce() -> Result<(), FrontendError> + Send>;

/// The undo actions of the attach steps done so far, run in reverse order.
///
/// Dropping it runs whatever is left, so an early return or a panic mid-attach cannot leak a
/// loop device or a mount.
#[derive(Default)]
pub struct Undo {
    steps: Vec<(String, UndoStep)>,
}

impl Undo {
    /// Registers the undo of a step that just succeeded (or of one about to run, if the undo is
    /// harmless when the step did nothing).
    pub fn push(&mut self, what: impl Into<String>, step: impl FnOnce() -> Result<(), FrontendError> + Send + 'static) {
        self.steps.push((what.into(), Box::new(step)));
    }

    /// Runs every step, newest first. A failing step does not stop the later ones (the earlier
    /// steps' resources may still be releasable); the first error is returned.
    pub fn run_all(&mut self) -> Result<(), FrontendError> {
        let mut first = None;
        while let Some((what, step)) = self.steps.pop() {
            if let Err(e) = step() {
                tracing::warn!(step = %what, error = %e, "frontend teardown step failed");
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Undo {
    fn drop(&mut self) {
        // Errors are already logged by run_all; nothing else can be done with them in drop.
        let _ = self.run_all();
    }
}

impl std::fmt::Debug for Undo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.steps.iter().map(|(what, _)| what)).finish()
    }
}

/// A volume attached to the kernel. Detach explicitly to see errors; dropping it detaches
/// best-effort (errors are logged).
pub struct Attached {
    device: PathBuf,
    undo: Undo,
    refresh: RefreshSize,
    /// The FUSE connection behind the device: what a handover suspends and passes on.
    session: Option<fuse::Session>,
}

/// Makes the kernel device take on the `BlockDevice`'s current size; returns it.
pub(crate) type RefreshSize = Box<dyn Fn() -> Result<u64, FrontendError> + Send + Sync>;

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attached").field("device", &self.device).field("undo", &self.undo).finish_non_exhaustive()
    }
}

impl Attached {
    pub(crate) fn new(device: PathBuf, undo: Undo, refresh: RefreshSize) -> Self {
        Self { device, undo, refresh, session: None }
    }

    /// Stops serving the device at a request boundary, every request read answered, and keeps
    /// everything attached: the kernel's requests wait until [`Self::resume`], or until another
    /// process serves [`Self::session_fd`] ([`FuseLoopFrontend::adopt`]). Returns how long the
    /// in-flight requests took to drain.
    pub fn suspend(&self) -> Result<std::time::Duration, FrontendError> {
        let session =
            self.session.as_ref().ok_or_else(|| FrontendError::Invalid("no FUSE session to suspend".into()))?;
        session.server.suspend().map_err(|e| FrontendError::io(format!("suspending {}", self.device.display()), e))
    }

    /// Serves the device again after [`Self::suspend`].
    pub fn resume(&self) -> Result<(), FrontendError> {
        let session =
            self.session.as_ref().ok_or_else(|| FrontendError::Invalid("no FUSE session to resume".into()))?;
        session.server.resume().map_err(|e| FrontendError::io(format!("resuming {}", self.device.display()), e))
    }

    /// The FUSE connection's fd (the one its mount was made with), while attached.
    pub fn session_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        self.session.as_ref().map(|s| s.server.session().as_fd())
    }

    /// Forgets the teardown: the mount, the loop device and the FUSE connection stay as they are,
    /// for whoever holds the session fd now (after [`Self::suspend`], a handover).
    pub fn release(mut self) {
        self.undo.steps.clear();
    }

    /// Where the FUSE connection is mounted.
    pub fn mount_point(&self) -> Option<&Path> {
        self.session.as_ref().map(|s| s.mount.as_path())
    }

    /// Online expansion: after the `BlockDevice` grew, make the kernel device show the new size
    /// while it stays attached (and possibly mounted). Returns the size the device now has. The
    /// filesystem on it is the caller's to grow.
    pub fn refresh_size(&self) -> Result<u64, FrontendError> {
        (self.refresh)()
    }

    /// The kernel block device node, e.g. `/dev/loop3`.
    pub fn device(&self) -> &Path {
        &self.device
    }

    /// Tears the frontend down: loop device first, then the FUSE mount and its server threads.
    ///
    /// Refuses, leaving everything attached, while a filesystem on the device is still mounted:
    /// detaching a loop device under a mounted filesystem only schedules an auto-clear, which
    /// would keep the FUSE server pinned. Takes `&mut self` so that the caller keeps the handle
    /// in that case; after a successful detach, further calls and the drop do nothing.
    pub fn detach(&mut self) -> Result<(), FrontendError> {
        self.check_unused()?;
        self.undo.run_all()
    }

    fn check_unused(&self) -> Result<(), FrontendError> {
        if self.undo.steps.is_empty() {
            return Ok(());
        }
        let mounts = mkfs::mounts_of_device(&self.device)
            .map_err(|e| FrontendError::io(format!("reading the mounts of {}", self.device.display()), e))?;
        if mounts.is_empty() { Ok(()) } else { Err(FrontendError::InUse { device: self.device.clone(), mounts }) }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        match self.check_unused() {
            Err(e @ FrontendError::InUse { .. }) => {
                // Tearing down under a mounted filesystem would hang waiting for the loop device
                // to let go of its backing file; leaving it attached is the lesser evil, and loud.
                tracing::error!(device = %self.device.display(), error = %e, "dropping an attached volume that is still mounted; leaving it attached");
                self.undo.steps.clear();
            }
            // Not knowing whether it is mounted is no reason to leak it: try the teardown.
            Err(e) => {
                tracing::warn!(device = %self.device.display(), error = %e, "could not check the mounts of a dropped volume")
            }
            // The undo stack's own drop runs the teardown.
            Ok(()) => {}
        }
    }
}
