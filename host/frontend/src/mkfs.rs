//! Formatting and mounting an attached device.
//!
//! Formatting is idempotent by construction: a device is only formatted when `blkid` finds no
//! filesystem signature on it, so re-attaching a volume (or retrying a half-done stage) never
//! wipes data. The tools are util-linux's `blkid` and e2fsprogs' / xfsprogs' `mkfs.*`, run as
//! child processes; mounting uses the mount(2) syscall directly.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};

use crate::FrontendError;
use wasmcsi_mountinfo as mountinfo;

/// Filesystems the helpers can create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsType {
    Ext4,
    Xfs,
}

impl FsType {
    /// The kernel / blkid name.
    pub fn name(self) -> &'static str {
        match self {
            FsType::Ext4 => "ext4",
            FsType::Xfs => "xfs",
        }
    }
}

/// Runs a command and turns a non-zero exit into an error carrying its stderr.
pub(crate) fn run(cmd: &mut Command) -> Result<String, FrontendError> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| FrontendError::io(format!("running {shown}"), e))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(FrontendError::Command {
            command: shown,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// The filesystem type on `device`, or `None` if it carries no recognisable signature.
pub fn probe_fs(device: &Path) -> Result<Option<String>, FrontendError> {
    // -p: low-level probe of the device itself, bypassing the blkid cache (which can be stale
    // for a device just formatted by someone else). Exit status 2 means "nothing found".
    let shown = format!("blkid -p {}", device.display());
    let out = Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE"])
        .arg(device)
        .output()
        .map_err(|e| FrontendError::io(format!("running {shown}"), e))?;
    match out.status.code() {
        Some(0) => {
            let ty = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            Ok(if ty.is_empty() { None } else { Some(ty) })
        }
        Some(2) => Ok(None),
        _ => Err(FrontendError::Command {
            command: shown,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        }),
    }
}

/// Formats `device` with `fs` unconditionally.
pub fn mkfs(device: &Path, fs: FsType) -> Result<(), FrontendError> {
    let mut cmd = match fs {
        // -F: the target is a whole device, which mke2fs otherwise asks about.
        FsType::Ext4 => {
            let mut c = Command::new("mkfs.ext4");
            c.args(["-q", "-F"]);
            c
        }
        FsType::Xfs => {
            let mut c = Command::new("mkfs.xfs");
            c.arg("-q");
            c
        }
    };
    run(cmd.arg(device)).map(drop)
}

/// Grows the filesystem on `device` to fill it, after the device grew. XFS grows only while
/// mounted (`xfs_growfs` on the mount point); ext4 grows mounted or not (`resize2fs`), though
/// growing a *mounted* ext4 needs CAP_SYS_RESOURCE, which some hosts (this CI's) drop: then the
/// error says so and the caller unmounts, grows and remounts.
pub fn grow_fs(device: &Path, fstype: &str, mount_point: Option<&Path>) -> Result<(), FrontendError> {
    match (fstype, mount_point) {
        ("xfs", Some(mnt)) => run(Command::new("xfs_growfs").arg("-d").arg(mnt)).map(drop),
        ("xfs", None) => Err(FrontendError::Invalid("XFS grows only while mounted".into())),
        ("ext4" | "ext3" | "ext2", _) => run(Command::new("resize2fs").arg(device)).map(drop),
        (other, _) => Err(FrontendError::Invalid(format!("growing a {other} filesystem is not supported"))),
    }
}

/// Formats `device` with `fs` unless it already holds a filesystem. Returns the type found or
/// created; a different existing type is returned as is (never reformatted) for the caller to
/// judge.
pub fn ensure_fs(device: &Path, fs: FsType) -> Result<String, FrontendError> {
    if let Some(existing) = probe_fs(device)? {
        return Ok(existing);
    }
    mkfs(device, fs)?;
    Ok(fs.name().to_owned())
}

/// Mounts `device` (of filesystem type `fstype`) on `target` with comma-separated `data`
/// options.
pub fn mount(device: &Path, target: &Path, fstype: &str, data: Option<&str>) -> Result<(), FrontendError> {
    nix::mount::mount(Some(device), target, Some(fstype), MsFlags::empty(), data).map_err(|e| {
        FrontendError::io(format!("mounting {} ({fstype}) on {}", device.display(), target.display()), e.into())
    })
}

/// Unmounts `target`, retrying briefly while it is busy (a just-closed file can keep it busy
/// for a moment). Not mounted counts as success, so a retried teardown is harmless.
pub fn unmount(target: &Path) -> Result<(), FrontendError> {
    umount_retrying(target, Duration::from_secs(10))
}

pub(crate) fn umount_retrying(target: &Path, patience: Duration) -> Result<(), FrontendError> {
    let deadline = Instant::now() + patience;
    loop {
        match nix::mount::umount2(target, MntFlags::empty()) {
            Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => return Ok(()),
            Err(Errno::EBUSY) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(FrontendError::io(format!("unmounting {}", target.display()), e.into())),
        }
    }
}

/// Every mount point of the block device `device`, from /proc/self/mountinfo.
pub fn mounts_of_device(device: &Path) -> io::Result<Vec<PathBuf>> {
    let rdev = std::fs::metadata(device)?.rdev();
    let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    let table = mountinfo::read_current().map_err(io::Error::other)?;
    Ok(table
        .into_iter()
        .filter(|e| u64::from(e.major) == major && u64::from(e.minor) == minor)
        .map(|e| e.mount_point)
        .collect())
}
