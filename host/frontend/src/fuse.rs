//! The FUSE-file-under-a-loop-device frontend, for kernels without NBD or ublk.
//!
//! A tiny FUSE filesystem (pure-Rust `fuser`, mounted directly with mount(2) as root, so neither
//! libfuse nor fusermount is needed) exposes exactly one regular file, `volume`, whose reads,
//! writes, fsync and hole punching go straight to the [`BlockDevice`]. a loop device with direct I/O
//! then turns that file into `/dev/loopN`. Direct I/O end to end keeps the page cache out of the
//! data path: a write acknowledged by the loop device has reached the `BlockDevice`.
//!
//! Requests are served by several threads, each reading its own cloned `/dev/fuse` fd. Reads and
//! writes are handed to the device with [`BlockDevice::submit_read`]/[`BlockDevice::submit_write`]
//! and answered from their completion, on whatever thread the device completes them: a device
//! with its own I/O threads (the replicated engine) keeps any number of requests in flight from
//! one FUSE thread, and a synchronous one (a plain file) is served one request per thread. A
//! write's data is copied (or written) before `submit_write` returns, as the kernel's buffer
//! belongs to the FUSE thread.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyStatfs, ReplyWrite, Request, Session, SessionACL, TimeOrNow, WriteFlags,
};
use nix::fcntl::FallocateFlags;

use crate::loop_dev::{self, LoopOptions};
use crate::mkfs::umount_retrying;
use crate::{Attached, BlockDevice, Frontend, FrontendError, RefreshSize, Undo};

/// The name of the one file in the FUSE filesystem.
pub const VOLUME_FILE: &str = "volume";
const VOLUME_INO: INodeNo = INodeNo(2);
/// The largest write the kernel may send in one request (its own limit is 256 pages by default).
const MAX_WRITE: u32 = 1 << 20;
/// Attributes change only on a resize, which invalidates them explicitly (see
/// [`FuseLoopFrontend::refresh_size`]), so the kernel may cache them for long.
const TTL: Duration = Duration::from_secs(3600);
/// How long teardown waits for the kernel to let go of a loop device or a mount.
const PATIENCE: Duration = Duration::from_secs(30);

/// Where to make a test attach fail on purpose, to prove that a half-done attach is undone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailPoint {
    /// After the FUSE filesystem is mounted and served, before the loop device is attached.
    AfterFuseMount,
    /// After the loop device exists, before the attach returns.
    AfterLosetup,
}

/// Exposes a [`BlockDevice`] as `/dev/loopN` over a FUSE file. Needs root, `/dev/fuse` and
/// `/dev/loop-control`.
#[derive(Debug, Clone)]
pub struct FuseLoopFrontend {
    runtime_dir: PathBuf,
    threads: usize,
    fail_point: Option<FailPoint>,
}

impl FuseLoopFrontend {
    /// Mount points are created as private subdirectories of `runtime_dir` (created if missing).
    pub fn new(runtime_dir: impl Into<PathBuf>) -> Self {
        Self { runtime_dir: runtime_dir.into(), threads: 16, fail_point: None }
    }

    /// Number of threads serving FUSE requests (default 16); bounds the useful queue depth.
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// Makes every attach fail at `point` (tests of the cleanup path).
    #[doc(hidden)]
    pub fn with_fail_point(mut self, point: FailPoint) -> Self {
        self.fail_point = Some(point);
        self
    }

    fn fail_at(&self, point: FailPoint) -> Result<(), FrontendError> {
        if self.fail_point == Some(point) { Err(FrontendError::Injected(point)) } else { Ok(()) }
    }

    fn attach_steps(
        &self,
        dev: Arc<dyn BlockDevice>,
        name: &str,
        undo: &mut Undo,
    ) -> Result<(PathBuf, RefreshSize), FrontendError> {
        let size = dev.size();
        if size == 0 || !size.is_multiple_of(512) {
            return Err(FrontendError::Invalid(format!("size {size} is not a positive multiple of 512")));
        }
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) || name == ".." {
            return Err(FrontendError::Invalid(format!("volume name {name:?} must be [A-Za-z0-9._-]+")));
        }

        std::fs::create_dir_all(&self.runtime_dir)
            .map_err(|e| FrontendError::io(format!("creating {}", self.runtime_dir.display()), e))?;
        // Unique per process and attach, so two attaches of one name (or a stale dir from a
        // crashed run) never share a mount point.
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let mnt = self.runtime_dir.join(format!(
            "fuse-{name}.{}.{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&mnt).map_err(|e| FrontendError::io(format!("creating {}", mnt.display()), e))?;
        {
            let mnt = mnt.clone();
            undo.push(format!("remove {}", mnt.display()), move || {
                std::fs::remove_dir(&mnt).map_err(|e| FrontendError::io(format!("removing {}", mnt.display()), e))
            });
        }

        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName(format!("wasmcsi-{name}")),
            MountOption::Subtype("wasmcsi".into()),
            MountOption::NoDev,
            MountOption::NoSuid,
            MountOption::NoExec,
            MountOption::NoAtime,
        ];
        config.acl = SessionACL::Owner;
        config.n_threads = Some(self.threads);
        // One fd per thread: requests are spread over the threads by the kernel instead of all
        // threads contending on one fd.
        config.clone_fd = true;
        // Mounts and completes the INIT handshake; if anything later fails before the thread
        // owns the session, dropping the session unmounts.
        let session = Session::new(VolumeFs { dev: dev.clone() }, &mnt, &config)
            .map_err(|e| FrontendError::io(format!("mounting FUSE on {}", mnt.display()), e))?;
        let notifier = session.notifier();
        let server: JoinHandle<std::io::Result<()>> = std::thread::Builder::new()
            .name(format!("fuse-{name}"))
            .spawn(move || session.run())
            .map_err(|e| FrontendError::io("spawning the FUSE server thread", e))?;
        {
            let mnt = mnt.clone();
            // Known now, while the mount answers: after the unmount only its number is left.
            let connection = fuse_connection(&mnt);
            undo.push(format!("unmount FUSE {}", mnt.display()), move || {
                umount_retrying(&mnt, PATIENCE)?;
                // A copy of the mount in another mount namespace (a container, `ip netns exec`,
                // `unshare -m`, kubelet's mount propagation) keeps the connection alive after
                // our unmount, and the server threads would wait on /dev/fuse forever. Aborting
                // the connection ends it everywhere; the copies then fail with ENOTCONN.
                if let Some(id) = connection {
                    abort_fuse_connection(id);
                }
                // The unmount aborts the connection, so every server thread sees ENODEV and
                // returns; joining cannot hang once the unmount succeeded. (On failure the `?`
                // above drops the handle: the thread is leaked rather than waited on forever.)
                match server.join() {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(FrontendError::io("FUSE server", e)),
                    Err(_) => Err(FrontendError::io("FUSE server", std::io::Error::other("thread panicked"))),
                }
            });
        }
        self.fail_at(FailPoint::AfterFuseMount)?;

        let file = mnt.join(VOLUME_FILE);
        // Registered before attaching, and finding the devices by backing file rather than by
        // the attach's result: whatever happens to the attach, a loop device it created on our
        // (uniquely named) file is found and detached, and no other loop device is touched.
        {
            let file = file.clone();
            undo.push(format!("detach loop devices of {}", file.display()), move || {
                loop_dev::detach_all_of(&file, PATIENCE)
            });
        }
        // Not autoclear: the device must outlive this call (the caller formats and mounts it
        // later, or hands it out raw).
        let device = loop_dev::attach(&file, LoopOptions { direct_io: true, ..Default::default() })?.path().to_owned();
        let loop_name = loop_dev::loop_name(&device)?;
        self.fail_at(FailPoint::AfterLosetup)?;

        let sys = Path::new("/sys/block").join(&loop_name);
        let sectors: u64 = read_sys(&sys.join("size"))?
            .parse()
            .map_err(|_| FrontendError::Invalid(format!("unparsable {}/size", sys.display())))?;
        if sectors * 512 != size {
            return Err(FrontendError::Invalid(format!(
                "{} has {} bytes, expected {size}",
                device.display(),
                sectors * 512
            )));
        }
        if read_sys(&sys.join("loop/dio")).ok().as_deref() != Some("1") {
            // Still correct (the FUSE file is opened with direct I/O), only slower.
            tracing::warn!(device = %device.display(), "loop device runs without direct I/O");
        }
        let resize = FuseResize { notifier, file, device: device.clone(), dev: Arc::downgrade(&dev) };
        Ok((device, Box::new(move || resize.refresh())))
    }
}

/// What an online resize needs to reach the kernel: the FUSE connection (to drop the kernel's
/// cached size of the file) and the loop device (to re-read it).
struct FuseResize {
    notifier: fuser::Notifier,
    file: PathBuf,
    device: PathBuf,
    /// Weak: after a detach the device belongs to its owner alone again.
    dev: std::sync::Weak<dyn BlockDevice>,
}

impl FuseResize {
    /// The loop driver sizes itself from the backing inode's cached size, and FUSE only updates
    /// that from a getattr reply: invalidate the attributes (offset -1: keep the page cache, there
    /// is none with direct I/O anyway), stat the file so the kernel asks again, then let the loop
    /// device pick the new size up (LOOP_SET_CAPACITY).
    fn refresh(&self) -> Result<u64, FrontendError> {
        let size = self.dev.upgrade().ok_or_else(|| FrontendError::Invalid("the volume is detached".into()))?.size();
        self.notifier
            .inval_inode(VOLUME_INO, -1, 0)
            .map_err(|e| FrontendError::io("invalidating the FUSE file's attributes", e))?;
        let seen = std::fs::metadata(&self.file)
            .map_err(|e| FrontendError::io(format!("stat {}", self.file.display()), e))?
            .len();
        if seen != size {
            return Err(FrontendError::Invalid(format!(
                "{} still shows {seen} bytes after invalidation, expected {size}",
                self.file.display()
            )));
        }
        let now = loop_dev::set_capacity(&self.device)?;
        if now != size {
            return Err(FrontendError::Invalid(format!(
                "{} has {now} bytes after resize, expected {size}",
                self.device.display()
            )));
        }
        tracing::info!(device = %self.device.display(), size, "block device resized online");
        Ok(size)
    }
}

impl Frontend for FuseLoopFrontend {
    fn attach(&self, dev: Arc<dyn BlockDevice>, name: &str) -> Result<Attached, FrontendError> {
        let mut undo = Undo::default();
        match self.attach_steps(dev, name, &mut undo) {
            Ok((device, refresh)) => Ok(Attached::new(device, undo, refresh)),
            Err(e) => {
                // Errors of the undo are logged by run_all; the attach error is what matters.
                let _ = undo.run_all();
                Err(e)
            }
        }
    }
}

/// The FUSE connection's number in `/sys/fs/fuse/connections`: the kernel's encoding of the
/// mount's anonymous device number.
/// Tears down what an attach of `name` under `runtime_dir` left when its process died (killed,
/// OOM, a crash): every FUSE mount point `fuse-NAME.*` there, whose server is gone, and the loop
/// devices on its volume file. Whatever is mounted from those loop devices (a staged filesystem)
/// is the caller's to unmount first; a loop device still in use is refused and left alone.
/// Returns how many mount points it removed. Mount points of this process are never touched:
/// their server is alive.
pub fn reclaim(runtime_dir: &Path, name: &str) -> Result<usize, FrontendError> {
    let entries = match std::fs::read_dir(runtime_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(FrontendError::io(format!("listing {}", runtime_dir.display()), e)),
    };
    let prefix = format!("fuse-{name}.");
    let ours = format!("fuse-{name}.{}.", std::process::id());
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(|e| FrontendError::io(format!("listing {}", runtime_dir.display()), e))?;
        let file_name = entry.file_name();
        let Some(dir) = file_name.to_str() else { continue };
        // `fuse-NAME.PID.SEQ`: the rest after the prefix must be two numbers, so `fuse-a.` never
        // matches the mounts of a volume named `a.b`.
        let Some(rest) = dir.strip_prefix(&prefix) else { continue };
        if dir.starts_with(&ours) || !rest.split('.').all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) {
            continue;
        }
        let mnt = entry.path();
        let connection = fuse_connection(&mnt);
        loop_dev::detach_all_of(&mnt.join(VOLUME_FILE), PATIENCE)?;
        if crate::mkfs::is_mount_point(&mnt).unwrap_or(true) {
            // The server is gone: the mount answers ENOTCONN; unmount it, lazily if it must.
            if umount_retrying(&mnt, PATIENCE).is_err() {
                nix::mount::umount2(&mnt, nix::mount::MntFlags::MNT_DETACH)
                    .map_err(|e| FrontendError::io(format!("lazy unmount of {}", mnt.display()), e.into()))?;
            }
            if let Some(id) = connection {
                abort_fuse_connection(id);
            }
        }
        std::fs::remove_dir(&mnt).map_err(|e| FrontendError::io(format!("removing {}", mnt.display()), e))?;
        tracing::info!(mount = %mnt.display(), "reclaimed the FUSE mount and loop devices of a dead attach");
        removed += 1;
    }
    Ok(removed)
}

fn fuse_connection(mnt: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(mnt).ok()?.dev();
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    Some((major << 20) | minor)
}

/// Best effort: mounts fusectl if needed and aborts connection `id`; a connection that is
/// already gone (the usual case: no other namespace held the mount) is fine.
fn abort_fuse_connection(id: u64) {
    let root = Path::new("/sys/fs/fuse/connections");
    let abort = root.join(id.to_string()).join("abort");
    if !root.join(id.to_string()).exists() && !fusectl_mounted() {
        let _ = nix::mount::mount(Some("fusectl"), root, Some("fusectl"), nix::mount::MsFlags::empty(), None::<&str>);
    }
    match std::fs::write(&abort, "1") {
        Ok(()) => tracing::debug!(connection = id, "aborted the FUSE connection after unmount"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(connection = id, error = %e, "could not abort the FUSE connection"),
    }
}

fn fusectl_mounted() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .is_ok_and(|m| m.lines().any(|l| l.split(" - ").nth(1).is_some_and(|t| t.starts_with("fusectl "))))
}

fn read_sys(path: &Path) -> Result<String, FrontendError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|e| FrontendError::io(format!("reading {}", path.display()), e))
}

/// The FUSE filesystem: a root directory holding the one `volume` file.
struct VolumeFs {
    dev: Arc<dyn BlockDevice>,
}

impl VolumeFs {
    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, perm, nlink, size) = match ino {
            INodeNo::ROOT => (FileType::Directory, 0o700, 2, 0),
            VOLUME_INO => (FileType::RegularFile, 0o600, 1, self.dev.size()),
            _ => return None,
        };
        let now = SystemTime::UNIX_EPOCH;
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    /// Clamps a request to the device: `None` if it starts at or beyond the end.
    fn clamp(&self, offset: u64, len: u64) -> Option<u64> {
        let size = self.dev.size();
        (offset < size).then(|| len.min(size - offset))
    }
}

fn errno(e: &std::io::Error) -> Errno {
    e.raw_os_error().map_or(Errno::EIO, Errno::from_i32)
}

impl Filesystem for VolumeFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Each is best effort: an older kernel without one still works, only slower.
        let _ = config.set_max_write(MAX_WRITE);
        // Lets the kernel keep several direct-I/O requests of one file in flight (the loop
        // device submits asynchronously); they are background requests, whose count is capped
        // by max_background, so raise that above any queue depth we care about.
        let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        let _ = config.set_max_background(256);
        let _ = config.set_congestion_threshold(192);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.attr(VOLUME_INO) {
            Some(attr) if parent == INodeNo::ROOT && name == VOLUME_FILE => reply.entry(&TTL, &attr, Generation(0)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // The size is the device's; a truncate (e.g. O_TRUNC) to anything else is refused.
        // Other attribute changes are accepted and ignored: nothing depends on them.
        match self.attr(ino) {
            Some(attr) if size.is_none_or(|s| s == attr.size) => reply.attr(&TTL, &attr),
            Some(_) => reply.error(Errno::EPERM),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if ino != VOLUME_INO {
            return reply.error(Errno::EISDIR);
        }
        // DIRECT_IO: no page cache in the FUSE layer (the loop device above has its own
        // semantics and flushes must reach the device). PARALLEL_DIRECT_WRITES: without it the
        // kernel serialises direct writes to one file on the inode lock, i.e. queue depth 1.
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != VOLUME_INO {
            return reply.error(Errno::EISDIR);
        }
        let Some(len) = self.clamp(offset, u64::from(size)) else {
            return reply.data(&[]);
        };
        // len <= size, which the kernel bounds by max_read (far below usize::MAX).
        self.dev.submit_read(
            offset,
            len as usize,
            Box::new(move |result| match result {
                Ok(data) => reply.data(data),
                Err(e) => reply.error(errno(&e)),
            }),
        );
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != VOLUME_INO {
            return reply.error(Errno::EISDIR);
        }
        // A block device does not grow: writing at or past the end is "no space".
        let Some(len) = self.clamp(offset, data.len() as u64) else {
            return reply.error(Errno::ENOSPC);
        };
        let data = &data[..len as usize];
        self.dev.submit_write(
            data,
            offset,
            Box::new(move |result| match result {
                // len <= data.len() <= max_write, which fits u32.
                Ok(()) => reply.written(len as u32),
                Err(e) => reply.error(errno(&e)),
            }),
        );
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        // Called on every close(2); not a durability point (fsync is), so nothing to do.
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        // The loop device turns REQ_PREFLUSH/FUA into fdatasync of this file.
        match self.dev.flush() {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (VOLUME_INO, FileType::RegularFile, VOLUME_FILE),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            // The offset given is that of the next entry.
            if reply.add(*ino, i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // The loop device derives its discard granularity from the backing fs's block size.
        let blocks = self.dev.size() / 4096;
        reply.statfs(blocks, 0, 0, 2, 0, 4096, 255, 4096);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if ino != VOLUME_INO {
            return reply.error(Errno::EISDIR);
        }
        let mode = FallocateFlags::from_bits_retain(mode);
        let keep = FallocateFlags::FALLOC_FL_KEEP_SIZE;
        let Some(len) = self.clamp(offset, length) else {
            return reply.error(Errno::EINVAL);
        };
        let result = if mode == keep || mode.is_empty() {
            // Plain preallocation: every byte of the device already exists.
            Ok(())
        } else if mode == FallocateFlags::FALLOC_FL_PUNCH_HOLE | keep
            || mode == FallocateFlags::FALLOC_FL_ZERO_RANGE | keep
            || mode == FallocateFlags::FALLOC_FL_ZERO_RANGE
        {
            // The loop device's discard and write-zeroes. Both are served by discard, which the
            // BlockDevice contract defines to read back as zeros.
            self.dev.discard(offset, len)
        } else {
            return reply.error(Errno::EOPNOTSUPP);
        };
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }
}
