//! The FUSE-file-under-a-loop-device frontend, for kernels without NBD or ublk.
//!
//! A tiny FUSE filesystem (the project's own server, [`server`] over [`abi`], mounted directly
//! with mount(2) as root, so neither libfuse nor fusermount is needed) exposes exactly one
//! regular file, `volume`, whose reads, writes, fsync and hole punching go straight to the
//! [`BlockDevice`]. A loop device with direct I/O then turns that file into `/dev/loopN`. Direct I/O end to end keeps the page cache out of the
//! data path: a write acknowledged by the loop device has reached the `BlockDevice`.
//!
//! Requests are served by several threads, each reading its own cloned `/dev/fuse` fd
//! ([`server`]). Reads and writes are handed to the device with
//! [`BlockDevice::submit_read`]/[`BlockDevice::submit_write`] and answered from their
//! completion, on whatever thread the device completes them: a device with its own I/O threads
//! (the replicated engine) keeps any number of requests in flight from one FUSE thread, and a
//! synchronous one (a plain file) is served one request per thread. A write's data is copied (or
//! written) before `submit_write` returns, as the kernel's buffer belongs to the FUSE thread.
//!
//! A served volume can be handed to another process without the kernel noticing more than a
//! pause: [`crate::Attached::suspend`] stops the server at a request boundary, the session fd
//! (kept open across `execve`, or passed on) goes to the new process, and
//! [`FuseLoopFrontend::adopt`] serves the same connection, mount and loop device there.

pub mod abi;
pub mod connection;
pub mod server;

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::loop_dev::{self, LoopOptions};
use crate::mkfs::umount_retrying;
use crate::owner;
use crate::{Attached, BlockDevice, Frontend, FrontendError, RefreshSize, Undo};

pub use server::VOLUME_FILE;
use server::{Server, VOLUME_INO};
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

    fn check_name(name: &str) -> Result<(), FrontendError> {
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)) || name == ".." {
            return Err(FrontendError::Invalid(format!("volume name {name:?} must be [A-Za-z0-9._-]+")));
        }
        Ok(())
    }

    fn attach_steps(
        &self,
        dev: Arc<dyn BlockDevice>,
        name: &str,
        undo: &mut Undo,
    ) -> Result<(PathBuf, RefreshSize, Session), FrontendError> {
        let size = dev.size();
        if size == 0 || !size.is_multiple_of(512) {
            return Err(FrontendError::Invalid(format!("size {size} is not a positive multiple of 512")));
        }
        Self::check_name(name)?;

        std::fs::create_dir_all(&self.runtime_dir)
            .map_err(|e| FrontendError::io(format!("creating {}", self.runtime_dir.display()), e))?;
        // Named by this process's owner (see `owner`), whose lock is held before anything is
        // mounted: whoever finds the mount later can tell whether its server still lives.
        let owner = owner::this_process();
        owner.claim(&self.runtime_dir)?;
        // Unique per owner and attach, so two attaches of one name (or a stale dir from a
        // crashed run) never share a mount point.
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let mnt = loop {
            let mnt =
                self.runtime_dir.join(format!("fuse-{name}.{}.{}", owner.id(), SEQ.fetch_add(1, Ordering::Relaxed)));
            match std::fs::create_dir(&mnt) {
                // A process that adopted volumes from its previous image (same owner) holds
                // mount points of this owner already.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                r => {
                    break r
                        .map(|()| mnt.clone())
                        .map_err(|e| FrontendError::io(format!("creating {}", mnt.display()), e))?;
                }
            }
        };
        push_remove_dir(undo, &mnt);

        let session = mount(&mnt, name)?;
        // The connection's number, known while mounted: after the unmount it is gone from the
        // mount table. Pushed before the handshake: a failed INIT still unmounts.
        let connection = connection::connection_at(&mnt);
        let server = Arc::new(std::sync::OnceLock::<Arc<Server>>::new());
        push_unmount(undo, &mnt, connection, server.clone());
        server::handshake(&session).map_err(|e| FrontendError::io(format!("FUSE INIT on {}", mnt.display()), e))?;
        let started = Arc::new(
            Server::start(session, dev.clone(), self.threads, name)
                .map_err(|e| FrontendError::io("starting the FUSE server", e))?,
        );
        let _ = server.set(started.clone());
        self.fail_at(FailPoint::AfterFuseMount)?;

        let file = mnt.join(VOLUME_FILE);
        // Registered before attaching, and finding the devices by backing file rather than by
        // the attach's result: whatever happens to the attach, a loop device it created on our
        // (uniquely named) file is found and detached, and no other loop device is touched.
        push_detach_loops(undo, &file);
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
        let resize = FuseResize { server: started.clone(), file, device: device.clone(), dev: Arc::downgrade(&dev) };
        Ok((device, Box::new(move || resize.refresh()), Session { server: started, mount: mnt }))
    }

    /// Serves, in this process, a volume another process (or this one before an `execve`)
    /// attached and suspended ([`Attached::suspend`]): its FUSE connection `session` (whose INIT
    /// was answered), mounted at `mount` under this frontend's runtime directory, with the loop
    /// device `device` on its volume file. No new INIT, no new mount, no new loop device: the
    /// kernel sees one connection whose requests waited while nobody read them. The result
    /// detaches like any attach.
    pub fn adopt(
        &self,
        dev: Arc<dyn BlockDevice>,
        name: &str,
        session: OwnedFd,
        mount: &Path,
        device: &Path,
    ) -> Result<Attached, FrontendError> {
        Self::check_name(name)?;
        let expected = format!("fuse-{name}.");
        if mount.parent() != Some(self.runtime_dir.as_path())
            || !mount.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&expected))
        {
            return Err(FrontendError::Invalid(format!(
                "{} is not a mount point of volume {name} under {}",
                mount.display(),
                self.runtime_dir.display()
            )));
        }
        let file = mount.join(VOLUME_FILE);
        let backing = loop_dev::backing_file(device);
        if backing.as_deref() != Some(file.as_path()) {
            return Err(FrontendError::Invalid(format!(
                "{} is backed by {backing:?}, not by {}",
                device.display(),
                file.display()
            )));
        }
        // Nothing of the volume is torn down if this fails: the caller still decides.
        let server = Arc::new(
            Server::start(session, dev.clone(), self.threads, name)
                .map_err(|e| FrontendError::io("serving the adopted FUSE connection", e))?,
        );
        let connection = connection::connection_at(mount);
        let mut undo = Undo::default();
        push_remove_dir(&mut undo, mount);
        push_unmount(&mut undo, mount, connection, Arc::new(std::sync::OnceLock::from(server.clone())));
        push_detach_loops(&mut undo, &file);
        let resize = FuseResize { server: server.clone(), file, device: device.to_owned(), dev: Arc::downgrade(&dev) };
        let mut attached = Attached::new(device.to_owned(), undo, Box::new(move || resize.refresh()));
        attached.session = Some(Session { server, mount: mount.to_owned() });
        Ok(attached)
    }
}

/// The FUSE side of an attached volume: its server and mount point.
pub(crate) struct Session {
    pub(crate) server: Arc<Server>,
    pub(crate) mount: PathBuf,
}

fn push_remove_dir(undo: &mut Undo, mnt: &Path) {
    let mnt = mnt.to_owned();
    undo.push(format!("remove {}", mnt.display()), move || {
        std::fs::remove_dir(&mnt).map_err(|e| FrontendError::io(format!("removing {}", mnt.display()), e))
    });
}

fn push_detach_loops(undo: &mut Undo, file: &Path) {
    let file = file.to_owned();
    undo.push(format!("detach loop devices of {}", file.display()), move || loop_dev::detach_all_of(&file, PATIENCE));
}

fn push_unmount(undo: &mut Undo, mnt: &Path, connection: Option<u64>, server: Arc<std::sync::OnceLock<Arc<Server>>>) {
    let mnt = mnt.to_owned();
    undo.push(format!("unmount FUSE {}", mnt.display()), move || {
        // A copy of the mount in another mount namespace (a container, `ip netns exec`,
        // `unshare -m`, kubelet's mount propagation) keeps the connection alive after our
        // unmount, and the server threads would wait on /dev/fuse forever: abort it, which ends
        // it everywhere. Before the unmount, while our mount pins the number: after it, the
        // number is free, and another volume attached meanwhile may have it. Nothing is lost:
        // the loop devices are detached (and flushed) before this step, and FUSE writes are
        // write-through, so no request is pending.
        if let Some(id) = connection {
            connection::abort_if_mounted_at(&mnt, id);
        }
        umount_retrying(&mnt, PATIENCE)?;
        // The connection ended, so every worker's read fails (ECONNABORTED, or ENODEV) and it
        // returns; joining cannot hang once the unmount succeeded.
        match server.get() {
            Some(server) => server.join().map_err(|e| FrontendError::io("FUSE server", e)),
            None => Ok(()),
        }
    });
}

/// Opens `/dev/fuse` and mounts its connection at `mnt` (root, no libfuse, no fusermount).
fn mount(mnt: &Path, name: &str) -> Result<OwnedFd, FrontendError> {
    use nix::mount::MsFlags;
    let session: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| FrontendError::io("opening /dev/fuse", e))?
        .into();
    let options = format!("fd={},rootmode=40000,user_id=0,group_id=0", session.as_raw_fd());
    nix::mount::mount(
        Some(format!("wasmcsi-{name}").as_str()),
        mnt,
        Some("fuse.wasmcsi"),
        MsFlags::MS_NODEV | MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NOATIME,
        Some(options.as_str()),
    )
    .map_err(|e| FrontendError::io(format!("mounting FUSE on {}", mnt.display()), e.into()))?;
    Ok(session)
}

/// What an online resize needs to reach the kernel: the FUSE connection (to drop the kernel's
/// cached size of the file) and the loop device (to re-read it).
struct FuseResize {
    server: Arc<Server>,
    file: PathBuf,
    device: PathBuf,
    /// Weak: after a detach the device belongs to its owner alone again.
    dev: std::sync::Weak<dyn BlockDevice>,
}

impl FuseResize {
    /// The loop driver sizes itself from the backing inode's cached size, and FUSE only updates
    /// that from a getattr reply: invalidate the attributes, stat the file so the kernel asks
    /// again, then let the loop device pick the new size up (LOOP_SET_CAPACITY).
    fn refresh(&self) -> Result<u64, FrontendError> {
        let size = self.dev.upgrade().ok_or_else(|| FrontendError::Invalid("the volume is detached".into()))?.size();
        server::notify_inval_inode(self.server.session(), VOLUME_INO)
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
            Ok((device, refresh, session)) => {
                let mut attached = Attached::new(device, undo, refresh);
                attached.session = Some(session);
                Ok(attached)
            }
            Err(e) => {
                // Errors of the undo are logged by run_all; the attach error is what matters.
                let _ = undo.run_all();
                Err(e)
            }
        }
    }
}

/// Tears down what an attach of `name` under `runtime_dir` left when its process died (killed,
/// OOM, a crash), for a caller that knows no engine of `name` runs any more (its data path said
/// so): every FUSE mount point `fuse-NAME.OWNER.SEQ` there whose owner is dead (see
/// [`owner`]), and the loop devices on its volume file. A mount point named by a pid
/// (`fuse-NAME.PID.SEQ`, made by a binary before owners) is taken unless it is this process's
/// pid. Whatever is mounted from those loop devices (a staged filesystem) is the caller's to
/// unmount first: a loop device still in use detaches itself when it is let go. Returns how many
/// mount points it removed. Mount points of a live owner are never touched.
pub fn reclaim(runtime_dir: &Path, name: &str) -> Result<usize, FrontendError> {
    let prefix = format!("fuse-{name}.");
    let mut removed = 0;
    for (dir, mnt) in mount_dirs(runtime_dir)? {
        // `fuse-NAME.OWNER.SEQ` or `fuse-NAME.PID.SEQ`: the rest after the prefix must be those
        // two parts, so `fuse-a.` never matches the mounts of a volume named `a.b`.
        let Some(rest) = dir.strip_prefix(&prefix) else { continue };
        let Some((who, seq)) = rest.split_once('.') else { continue };
        if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let dead = if owner::is_owner_id(who) {
            // The owner's lock file stays: its other mounts may be another volume's.
            owner::dead(runtime_dir, who)?.is_some()
        } else {
            !who.is_empty() && who.bytes().all(|b| b.is_ascii_digit()) && who != std::process::id().to_string()
        };
        if dead {
            reclaim_mount(&mnt)?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// What [`reclaim_dead`] took back.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reclaimed {
    /// FUSE mount points removed.
    pub mounts: usize,
    /// Loop devices detached (or set to detach themselves when a filesystem on them is let go).
    pub loops: usize,
}

/// Tears down, under `runtime_dir`, everything of every dead owner (see [`owner`]): each of its
/// FUSE mounts (their server is gone) is unmounted lazily, after the loop devices on its volume
/// file are detached; a loop device a filesystem is still mounted on (a volume staged by the
/// node plugin, which unmounts it at unstage) is set to detach itself when that filesystem lets
/// go, and nothing waits for it. Logs one "reclaimed" line per mount and per loop device. Run at
/// every start of a process that mounts there (the data path, the node plugin): a live owner's
/// mounts, this process's own included, are never touched.
pub fn reclaim_dead(runtime_dir: &Path) -> Result<Reclaimed, FrontendError> {
    let mut reclaimed = Reclaimed::default();
    let mut by_owner: std::collections::BTreeMap<String, Vec<PathBuf>> = Default::default();
    for (dir, mnt) in mount_dirs(runtime_dir)? {
        if let Some(owner) = owner_of(&dir) {
            by_owner.entry(owner.to_owned()).or_default().push(mnt);
        }
    }
    for id in owner::recorded(runtime_dir) {
        by_owner.entry(id).or_default();
    }
    for (id, mounts) in by_owner {
        let Some(dead) = owner::dead(runtime_dir, &id)? else { continue };
        for mnt in mounts {
            reclaimed.loops += reclaim_mount(&mnt)?;
            reclaimed.mounts += 1;
        }
        dead.release();
    }
    Ok(reclaimed)
}

/// The owner a mount point's directory name says, `fuse-NAME.OWNER.SEQ` (`None` for any other
/// name, one of a pid among them).
fn owner_of(dir: &str) -> Option<&str> {
    let rest = dir.strip_prefix("fuse-")?;
    let (rest, seq) = rest.rsplit_once('.')?;
    let (_, owner) = rest.rsplit_once('.')?;
    (!seq.is_empty() && seq.bytes().all(|b| b.is_ascii_digit()) && owner::is_owner_id(owner)).then_some(owner)
}

/// The `fuse-*` directories under `runtime_dir`: (name, path).
fn mount_dirs(runtime_dir: &Path) -> Result<Vec<(String, PathBuf)>, FrontendError> {
    let entries = match std::fs::read_dir(runtime_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(FrontendError::io(format!("listing {}", runtime_dir.display()), e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| FrontendError::io(format!("listing {}", runtime_dir.display()), e))?;
        if let Some(name) = entry.file_name().to_str().filter(|n| n.starts_with("fuse-")) {
            found.push((name.to_owned(), entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// Detaches the loop devices on `file` without waiting for them: one a filesystem still holds
/// detaches itself when that lets go. Returns how many it detached (one set to detach itself by
/// an earlier reclaim is not counted, nor logged, again).
fn reclaim_loops(file: &Path) -> Result<usize, FrontendError> {
    // By path, and by the FUSE filesystem's device number while its mount shows here: a loop
    // device attached through a dead container's copy of the mount shows its file as `/volume`.
    let mut devices = loop_dev::devices_of(file)?;
    let table = wasmcsi_mountinfo::read_current()
        .map_err(|e| FrontendError::io("reading the mount table", std::io::Error::other(e.to_string())))?;
    if let Some(mnt) = file.parent()
        && let Some(top) = wasmcsi_mountinfo::mounts_at(&table, mnt).pop()
        && top.fs_type.starts_with("fuse")
    {
        devices.extend(loop_dev::devices_on(top.major, top.minor)?);
    }
    devices.sort();
    devices.dedup();
    let devices: Vec<PathBuf> = devices.into_iter().filter(|d| !loop_dev::detaches_itself(d)).collect();
    for device in &devices {
        let at_once = loop_dev::release(device)?;
        tracing::info!(
            device = %device.display(),
            backing = %file.display(),
            detached = if at_once { "now" } else { "when the filesystem on it is unmounted" },
            "reclaimed the loop device of a dead attach"
        );
    }
    Ok(devices.len())
}

/// Takes back one FUSE mount point of a dead attach: the loop devices on its file first (once
/// the mount is gone, their backing file no longer shows its path), the mount (lazily: the
/// server is gone, and a loop device a filesystem still holds keeps its file open), the
/// directory. Returns how many loop devices it detached.
fn reclaim_mount(mnt: &Path) -> Result<usize, FrontendError> {
    let loops = reclaim_loops(&mnt.join(VOLUME_FILE))?;
    if wasmcsi_mountinfo::is_mount_point(mnt).unwrap_or(true) {
        // Copies in other namespaces: as in a detach, aborted while the mount pins the number.
        if let Some(id) = connection::connection_at(mnt) {
            connection::abort_if_mounted_at(mnt, id);
        }
        match nix::mount::umount2(mnt, nix::mount::MntFlags::MNT_DETACH) {
            // EINVAL: not a mount point (any more) in this mount namespace.
            Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => return Err(FrontendError::io(format!("lazy unmount of {}", mnt.display()), e.into())),
        }
    }
    match std::fs::remove_dir(mnt) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        // Still a mount point where this process cannot unmount it (a node plugin that sees the
        // data path's mounts HostToContainer): the data path reclaims it at its next start.
        Err(e) => {
            tracing::warn!(mount = %mnt.display(), error = %e, "a dead attach's mount point stays for its data path");
            return Ok(loops);
        }
    }
    tracing::info!(mount = %mnt.display(), "reclaimed the FUSE mount of a dead attach");
    Ok(loops)
}

fn read_sys(path: &Path) -> Result<String, FrontendError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|e| FrontendError::io(format!("reading {}", path.display()), e))
}
