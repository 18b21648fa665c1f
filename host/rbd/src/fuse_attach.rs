//! Node side on kernels without krbd or rbd-nbd: `rbd-fuse` exposes one image as a regular file
//! (`<mount>/<image>`), which the caller then puts under a loop device, formats and mounts with
//! `wasmcsi-frontend`'s helpers.
//!
//! Start is bounded: [`attach`] returns once the file is there with the image's size, or fails
//! (and cleans up) within its timeout. Teardown is bounded and leaves nothing behind: unmount,
//! then wait for rbd-fuse to exit, then abort its FUSE connection (which fails every pending
//! request instead of leaving processes in D state) and SIGKILL it.
//!
//! A connection is aborted only while its mount is still at our mount point: connection
//! numbers are device numbers, and once rbd-fuse is gone (the kernel aborts the connection
//! itself when the daemon's /dev/fuse closes) the next FUSE mount on the node may get the same
//! number. Aborting a recorded number blindly killed a neighbour's mount.
//!
//! The key never appears in argv or the environment: rbd-fuse gets `-c ceph.conf --id USER`,
//! and the conf names a keyring, both 0600 in a private 0700 directory removed on detach.
use crate::RbdCredentials;
use crate::names::check;
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use wasmcsi_frontend::fuse::connection::{abort_if_mounted_at, connection_at};

/// Errors of attaching and detaching.
#[derive(Debug, thiserror::Error)]
pub enum FuseAttachError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
    #[error("rbd-fuse for {image}: {reason}")]
    Failed { image: String, reason: String },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> FuseAttachError {
    move |source| FuseAttachError::Io { context: context.into(), source }
}

/// What to attach, and where.
#[derive(Clone, Debug)]
pub struct FuseAttachRequest {
    pub monitors: Vec<String>,
    pub pool: String,
    pub image: String,
    pub creds: RbdCredentials,
    /// The image's size: the attach is complete when the file shows it.
    pub size_bytes: u64,
    /// Mount points are created under it (created if missing).
    pub runtime_dir: PathBuf,
    /// Bound on start, and on each teardown step.
    pub timeout: Duration,
    /// Where ceph.conf, the keyring and rbd-fuse's log go: created (0700, must not exist) and
    /// removed on detach. `None`: a fresh temporary directory. A node plugin names one under
    /// its state directory, so that after a restart [`detach_recorded`] finds everything.
    pub private_dir: Option<PathBuf>,
}

/// What a detach needs once the [`FuseAttachment`] value is gone (the plugin restarted): kept
/// by the caller (e.g. in a state file) after [`FuseAttachment::persist`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FuseRecord {
    pub pid: u32,
    pub mount_point: PathBuf,
    /// The image as a file (`<mount_point>/<image>`).
    pub file: PathBuf,
    /// The FUSE connection number, to abort a connection that outlives the daemon.
    pub connection: Option<u64>,
    /// The private directory (conf, keyring, log); removed on detach.
    pub private_dir: PathBuf,
}

/// The private directory of one attachment.
#[derive(Debug)]
enum Private {
    Temp(tempfile::TempDir),
    Given(PathBuf),
}

impl Private {
    fn path(&self) -> &Path {
        match self {
            Self::Temp(t) => t.path(),
            Self::Given(p) => p,
        }
    }
}

/// One running rbd-fuse; detached (best effort, logged) on drop.
#[derive(Debug)]
pub struct FuseAttachment {
    image: String,
    mount_point: PathBuf,
    file: PathBuf,
    child: Option<Child>,
    /// Holds ceph.conf, the keyring and rbd-fuse's log; removed on drop.
    private: Option<Private>,
    /// Handed over with [`FuseAttachment::persist`]: dropping it does nothing.
    persisted: bool,
    /// The FUSE connection number, read from mountinfo while the mount was healthy.
    connection: Option<u64>,
    timeout: Duration,
}

/// Start rbd-fuse for `req.pool/req.image` and wait until the image file is there.
#[tracing::instrument(name = "rbd.fuse_attach", skip_all, fields(pool = %req.pool, image = %req.image))]
pub fn attach(req: &FuseAttachRequest) -> Result<FuseAttachment, FuseAttachError> {
    let invalid = |e: crate::RbdError| FuseAttachError::InvalidArgument(e.to_string());
    check("pool", &req.pool).map_err(invalid)?;
    check("image", &req.image).map_err(invalid)?;
    check("user", &req.creds.user).map_err(invalid)?;
    if req.monitors.iter().any(|m| m.contains(['\n', '\0'])) || req.creds.key().contains(['\n', '\0']) {
        return Err(FuseAttachError::InvalidArgument("monitors or key contain a line break".into()));
    }
    std::fs::create_dir_all(&req.runtime_dir).map_err(io_err(format!("creating {}", req.runtime_dir.display())))?;
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mount_point = req.runtime_dir.join(format!(
        "rbd-{}-{}.{}.{}",
        req.pool,
        req.image,
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir(&mount_point).map_err(io_err(format!("creating {}", mount_point.display())))?;
    let private = match &req.private_dir {
        None => Private::Temp(
            tempfile::Builder::new()
                .prefix("wasmcsi-rbd-fuse-")
                .permissions(std::fs::Permissions::from_mode(0o700))
                .tempdir()
                .map_err(io_err("creating a private directory"))?,
        ),
        Some(dir) => {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(dir)
                .map_err(io_err(format!("creating {}", dir.display())))?;
            Private::Given(dir.clone())
        }
    };
    let mut a = FuseAttachment {
        image: req.image.clone(),
        file: mount_point.join(&req.image),
        mount_point,
        child: None,
        private: None,
        persisted: false,
        connection: None,
        timeout: req.timeout,
    };
    let dir = private.path().to_owned();
    a.private = Some(private);
    match a.start(req, &dir) {
        Ok(()) => Ok(a),
        Err(e) => {
            if let Err(d) = a.detach() {
                tracing::warn!(error = %d, "cleaning up a failed rbd-fuse attach");
            }
            Err(e)
        }
    }
}

fn write_private(path: &Path, text: &str) -> Result<(), FuseAttachError> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err(format!("creating {}", path.display())))?;
    f.write_all(text.as_bytes()).map_err(io_err(format!("writing {}", path.display())))
}

impl FuseAttachment {
    fn start(&mut self, req: &FuseAttachRequest, dir: &Path) -> Result<(), FuseAttachError> {
        let (conf, keyring, log) = (dir.join("ceph.conf"), dir.join("keyring"), dir.join("rbd-fuse.log"));
        write_private(&keyring, &format!("[client.{}]\n\tkey = {}\n", req.creds.user, req.creds.key()))?;
        let secs = req.timeout.as_secs().max(1);
        write_private(
            &conf,
            &format!(
                "[global]\nmon host = {}\nkeyring = {}\nclient mount timeout = {secs}\n\
                 rados mon op timeout = {secs}\nadmin socket =\nlog file = {}\n",
                req.monitors.join(","),
                keyring.display(),
                log.display()
            ),
        )?;
        let stderr = std::fs::File::create(dir.join("stderr")).map_err(io_err("creating the stderr file"))?;
        // -f: foreground, so the process is ours to wait for and kill.
        let child = Command::new("rbd-fuse")
            .arg("-f")
            .arg("-c")
            .arg(&conf)
            .args(["--id", &req.creds.user, "-p", &req.pool, "-r", &req.image])
            .arg(&self.mount_point)
            .env_remove("CEPH_ARGS")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(io_err("starting rbd-fuse"))?;
        self.child = Some(child);

        let deadline = Instant::now() + req.timeout;
        loop {
            if let Some(c) = self.connection.or_else(|| connection_at(&self.mount_point)) {
                self.connection = Some(c);
                // Only stat once mounted: before that the path is our empty directory.
                if let Ok(m) = std::fs::metadata(&self.file) {
                    if m.len() == req.size_bytes {
                        tracing::debug!(file = %self.file.display(), "rbd-fuse attached");
                        return Ok(());
                    }
                    return Err(self.failed(format!(
                        "{} has {} bytes, expected {}",
                        self.file.display(),
                        m.len(),
                        req.size_bytes
                    )));
                }
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(self.failed(format!("exited ({status}) before the image appeared: {}", self.stderr_tail())));
            }
            if Instant::now() > deadline {
                return Err(self.failed(format!(
                    "the image did not appear within {:?}: {}",
                    req.timeout,
                    self.stderr_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn failed(&self, reason: String) -> FuseAttachError {
        FuseAttachError::Failed { image: self.image.clone(), reason }
    }

    fn stderr_tail(&self) -> String {
        let Some(p) = &self.private else { return String::new() };
        let mut s = String::new();
        let _ = std::fs::File::open(p.path().join("stderr")).and_then(|mut f| f.read_to_string(&mut s));
        let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    /// The image as a regular file.
    pub fn file(&self) -> &Path {
        &self.file
    }

    pub fn mount_point(&self) -> &Path {
        &self.mount_point
    }

    /// rbd-fuse's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Hand the running attachment over to a record: rbd-fuse keeps running (also after this
    /// process exits), a thread reaps it when it ends, and [`detach_recorded`] tears it down
    /// later, from this process or a restarted one.
    pub fn persist(mut self) -> Result<FuseRecord, FuseAttachError> {
        let Some(mut child) = self.child.take() else {
            return Err(self.failed("is not running".into()));
        };
        let record = FuseRecord {
            pid: child.id(),
            mount_point: self.mount_point.clone(),
            file: self.file.clone(),
            connection: self.connection,
            private_dir: self.private.as_ref().map(|p| p.path().to_owned()).unwrap_or_default(),
        };
        // A temporary directory would be deleted with the value: keep it (detach_recorded
        // removes it).
        if let Some(Private::Temp(t)) = self.private.take() {
            let _ = t.keep();
        }
        self.persisted = true;
        // Reaped as soon as it exits, so "is it alive" never sees a zombie of ours.
        let spawned = std::thread::Builder::new().name("rbd-fuse-reaper".into()).spawn(move || {
            let _ = child.wait();
        });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no reaper thread for rbd-fuse; it stays a zombie after it exits");
        }
        Ok(record)
    }

    /// Unmount, stop rbd-fuse, abort a connection that outlived it, remove the mount point and
    /// the private directory. Idempotent; each step is bounded by the attach timeout. The
    /// first error is returned after every step was tried.
    pub fn detach(&mut self) -> Result<(), FuseAttachError> {
        let mut first: Option<FuseAttachError> = None;
        if let Err(e) = self.unmount() {
            first.get_or_insert(e);
        }
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + self.timeout;
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                    // Still running (stuck in librbd, or the unmount failed): fail what is
                    // pending, then kill it; its /dev/fuse closing ends the connection.
                    _ => {
                        if let Some(id) = self.connection {
                            abort_if_mounted_at(&self.mount_point, id);
                        }
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                }
            }
        }
        self.connection = None;
        if self.mount_point.exists()
            && let Err(e) = std::fs::remove_dir(&self.mount_point)
            && e.kind() != io::ErrorKind::NotFound
        {
            first.get_or_insert(FuseAttachError::Io {
                context: format!("removing {}", self.mount_point.display()),
                source: e,
            });
        }
        if let Some(Private::Given(dir)) = self.private.take()
            && let Err(e) = remove_private(&dir)
        {
            first.get_or_insert(e);
        }
        first.map_or(Ok(()), Err)
    }

    fn unmount(&self) -> Result<(), FuseAttachError> {
        unmount_fuse(&self.mount_point)
    }
}

fn remove_private(dir: &Path) -> Result<(), FuseAttachError> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(FuseAttachError::Io { context: format!("removing {}", dir.display()), source: e })
        }
        _ => Ok(()),
    }
}

/// Unmount the rbd-fuse mount at `mount_point` if there is one.
fn unmount_fuse(mount_point: &Path) -> Result<(), FuseAttachError> {
    if connection_at(mount_point).is_none() {
        return Ok(());
    }
    match wasmcsi_frontend::mkfs::unmount(mount_point) {
        Ok(()) => Ok(()),
        Err(e) => {
            // Still busy (an open file, a loop device on it): detach lazily so the path is
            // free; the connection abort ends the daemon's side.
            tracing::warn!(mount = %mount_point.display(), error = %e, "unmount failed; detaching lazily");
            nix::mount::umount2(mount_point, nix::mount::MntFlags::MNT_DETACH).map_err(|errno| FuseAttachError::Io {
                context: format!("unmounting {}", mount_point.display()),
                source: errno.into(),
            })
        }
    }
}

/// Whether the rbd-fuse of `record` still runs: the pid is alive, not a zombie, and is that
/// rbd-fuse (its command line names the mount point), so a reused pid is never mistaken for it.
pub fn is_alive(record: &FuseRecord) -> bool {
    let proc = PathBuf::from(format!("/proc/{}", record.pid));
    let Ok(stat) = std::fs::read_to_string(proc.join("stat")) else { return false };
    // `pid (comm) S ...`: the state follows the last ')'.
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
    if matches!(state, Some('Z' | 'X') | None) {
        return false;
    }
    let Ok(cmdline) = std::fs::read(proc.join("cmdline")) else { return false };
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let named = |want: &[u8]| args.contains(&want);
    args.first().is_some_and(|a| a.ends_with(b"rbd-fuse")) && named(record.mount_point.as_os_str().as_encoded_bytes())
}

/// Tear down a persisted attachment: unmount, wait for rbd-fuse to exit (SIGKILL past
/// `timeout`), abort a connection that outlived it, remove the mount point and the private
/// directory. Idempotent, bounded, every step tried; the first error is returned.
#[tracing::instrument(name = "rbd.fuse_detach_recorded", skip_all, fields(pid = record.pid, mount = %record.mount_point.display()))]
pub fn detach_recorded(record: &FuseRecord, timeout: Duration) -> Result<(), FuseAttachError> {
    let mut first: Option<FuseAttachError> = None;
    if let Err(e) = unmount_fuse(&record.mount_point) {
        first.get_or_insert(e);
    }
    let deadline = Instant::now() + timeout;
    while is_alive(record) {
        if Instant::now() >= deadline {
            // Stuck in librbd (or the unmount failed): fail what is pending, then kill it.
            if let Some(id) = record.connection {
                abort_if_mounted_at(&record.mount_point, id);
            }
            let pid = nix::unistd::Pid::from_raw(i32::try_from(record.pid).unwrap_or(i32::MAX));
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            let killed = Instant::now() + timeout;
            while is_alive(record) && Instant::now() < killed {
                std::thread::sleep(Duration::from_millis(20));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Killing rbd-fuse leaves its mount behind, answering ENOTCONN: unmount once more.
    if let Err(e) = unmount_fuse(&record.mount_point) {
        first.get_or_insert(e);
    }
    if let Err(e) = std::fs::remove_dir(&record.mount_point)
        && e.kind() != io::ErrorKind::NotFound
    {
        first.get_or_insert(FuseAttachError::Io {
            context: format!("removing {}", record.mount_point.display()),
            source: e,
        });
    }
    if !record.private_dir.as_os_str().is_empty()
        && let Err(e) = remove_private(&record.private_dir)
    {
        first.get_or_insert(e);
    }
    first.map_or(Ok(()), Err)
}

impl Drop for FuseAttachment {
    fn drop(&mut self) {
        if self.persisted {
            return;
        }
        if let Err(e) = self.detach() {
            tracing::warn!(image = %self.image, error = %e, "detaching a dropped rbd-fuse attachment");
        }
    }
}
