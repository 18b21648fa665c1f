//! Loop devices: attach a file, find the loop devices of a file, refresh a device's capacity,
//! detach. Shared by the FUSE frontend (our own block volumes) and the node's rbd-fuse executor.
//!
//! Attach goes through the ioctls rather than `losetup` because only LOOP_CONFIGURE sets the
//! flags atomically with the backing file — in particular `LO_FLAGS_AUTOCLEAR`, which `losetup`
//! cannot set: an autoclear device detaches itself when its last opener (the filesystem mounted
//! on it) lets go, so a crash between unmount and detach cannot leak it.
//!
//! Lookups read sysfs (`/sys/block/loopN/loop/backing_file`), never stat the backing file: the
//! file may sit on a FUSE mount whose server is dead or stuck, where a stat fails or blocks.
//! Loop devices are global to the machine: callers detach exactly the devices of their own
//! (uniquely named) backing file.
#![allow(unsafe_code, reason = "loop device ioctls (no safe wrapper in nix or libc for these)")]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::libc;

use crate::FrontendError;

// <linux/loop.h>
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LOOP_SET_CAPACITY: libc::c_ulong = 0x4C07;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// How to attach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoopOptions {
    /// Open the backing file with O_DIRECT (no page cache between the loop device and the
    /// file). The kernel silently falls back to buffered I/O where the file does not allow it.
    pub direct_io: bool,
    /// Detach automatically on the last close. The device stays while the returned
    /// [`LoopDevice`] is open, so format and mount it before dropping that.
    pub autoclear: bool,
    pub read_only: bool,
}

/// A loop device this process just configured; its fd is held until drop (which matters with
/// [`LoopOptions::autoclear`]: dropping the last opener detaches).
#[derive(Debug)]
pub struct LoopDevice {
    path: PathBuf,
    _fd: File,
}

impl LoopDevice {
    /// `/dev/loopN`.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

fn ioctl_err(what: String) -> impl FnOnce(io::Error) -> FrontendError {
    move |e| FrontendError::io(what, e)
}

/// Attaches `backing` to a free loop device. Races with other attachers (EBUSY on a device
/// someone else took between GET_FREE and CONFIGURE) are retried.
pub fn attach(backing: &Path, opts: LoopOptions) -> Result<LoopDevice, FrontendError> {
    // As util-linux does: a backing fd opened with O_DIRECT is what makes the kernel keep the
    // loop device in direct-I/O mode.
    let odirect = if opts.direct_io { libc::O_DIRECT } else { 0 };
    let file = OpenOptions::new()
        .read(true)
        .write(!opts.read_only)
        .custom_flags(libc::O_CLOEXEC | odirect)
        .open(backing)
        .map_err(ioctl_err(format!("opening {}", backing.display())))?;
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map_err(ioctl_err("opening /dev/loop-control".into()))?;
    let mut flags = 0;
    if opts.autoclear {
        flags |= LO_FLAGS_AUTOCLEAR;
    }
    if opts.direct_io {
        flags |= LO_FLAGS_DIRECT_IO;
    }
    if opts.read_only {
        flags |= LO_FLAGS_READ_ONLY;
    }
    let mut last = None;
    for _ in 0..16 {
        // SAFETY: ioctl without argument on an open control fd.
        let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        if n < 0 {
            return Err(FrontendError::io("LOOP_CTL_GET_FREE", io::Error::last_os_error()));
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = match OpenOptions::new().read(true).write(!opts.read_only).custom_flags(libc::O_CLOEXEC).open(&path) {
            Ok(d) => d,
            // udev (or devtmpfs) has not created the node yet: take another turn.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => return Err(FrontendError::io(format!("opening {}", path.display()), e)),
        };
        let mut name = [0u8; LO_NAME_SIZE];
        let shown = backing.as_os_str().as_encoded_bytes();
        let len = shown.len().min(LO_NAME_SIZE - 1);
        name[..len].copy_from_slice(&shown[..len]);
        let config = LoopConfig {
            fd: u32::try_from(file.as_raw_fd()).map_err(|_| FrontendError::Invalid("negative fd".into()))?,
            block_size: 0,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: flags,
                lo_file_name: name,
                lo_crypt_name: [0; LO_NAME_SIZE],
                lo_encrypt_key: [0; 32],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads a `struct loop_config` we own for the call's duration.
        let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &config as *const LoopConfig) };
        if r == 0 {
            tracing::debug!(device = %path.display(), backing = %backing.display(), ?opts, "loop device attached");
            return Ok(LoopDevice { path, _fd: dev });
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(FrontendError::io(format!("LOOP_CONFIGURE {} on {}", path.display(), backing.display()), e));
        }
        last = Some(e);
    }
    Err(FrontendError::io(
        format!("no free loop device for {}", backing.display()),
        last.unwrap_or_else(|| io::Error::other("retries exhausted")),
    ))
}

/// `loopN` of `/dev/loopN`.
pub fn loop_name(device: &Path) -> Result<String, FrontendError> {
    device
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| n.strip_prefix("loop").is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())))
        .map(str::to_owned)
        .ok_or_else(|| FrontendError::Invalid(format!("{} is not a loop device", device.display())))
}

fn read_sys(path: &Path) -> Result<String, FrontendError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|e| FrontendError::io(format!("reading {}", path.display()), e))
}

/// The file `device` is attached to, as the kernel recorded its path; `None` when the device
/// is not attached (or does not exist).
pub fn backing_file(device: &Path) -> Option<PathBuf> {
    let name = loop_name(device).ok()?;
    std::fs::read_to_string(Path::new("/sys/block").join(name).join("loop/backing_file"))
        .ok()
        .map(|s| PathBuf::from(s.trim_end_matches('\n')))
}

/// The size of `device` in bytes, from sysfs.
pub fn size_bytes(device: &Path) -> Result<u64, FrontendError> {
    let name = loop_name(device)?;
    let sys = Path::new("/sys/block").join(name).join("size");
    let sectors: u64 =
        read_sys(&sys)?.parse().map_err(|_| FrontendError::Invalid(format!("unparsable {}", sys.display())))?;
    Ok(sectors * 512)
}

/// Every loop device whose backing file is `file`.
pub fn devices_of(file: &Path) -> Result<Vec<PathBuf>, FrontendError> {
    let entries = std::fs::read_dir("/sys/block").map_err(ioctl_err("listing /sys/block".into()))?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with("loop")) else { continue };
        let device = Path::new("/dev").join(name);
        if backing_file(&device).as_deref() == Some(file) {
            found.push(device);
        }
    }
    found.sort();
    Ok(found)
}

/// Detaches `device` and waits (up to `patience`) until the kernel released its backing file.
/// A device that is not attached counts as done. With a filesystem still mounted on it the
/// kernel only schedules an autoclear; the wait then times out.
pub fn detach(device: &Path, patience: Duration) -> Result<(), FrontendError> {
    let name = loop_name(device)?;
    let backing = Path::new("/sys/block").join(&name).join("loop/backing_file");
    if !backing.exists() {
        return Ok(());
    }
    match OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(device) {
        Ok(dev) => {
            // SAFETY: ioctl without argument on an open loop device fd.
            let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD as _, 0) };
            if r < 0 {
                let e = io::Error::last_os_error();
                // ENXIO: not attached (any more).
                if e.raw_os_error() != Some(libc::ENXIO) {
                    return Err(FrontendError::io(format!("LOOP_CLR_FD {}", device.display()), e));
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(FrontendError::io(format!("opening {}", device.display()), e)),
    }
    let deadline = Instant::now() + patience;
    while backing.exists() {
        if Instant::now() > deadline {
            return Err(FrontendError::Timeout(format!("{} still holds its backing file", device.display())));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Detaches `device` without waiting (LOOP_CLR_FD): returns `true` when it is detached now,
/// `false` when something still holds it open (a mounted filesystem), in which case the kernel
/// detaches it at its last close. A device that is not attached counts as detached.
pub fn release(device: &Path) -> Result<bool, FrontendError> {
    let name = loop_name(device)?;
    let backing = Path::new("/sys/block").join(&name).join("loop/backing_file");
    match OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(device) {
        Ok(dev) => {
            // SAFETY: ioctl without argument on an open loop device fd.
            let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD as _, 0) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::ENXIO) {
                    return Err(FrontendError::io(format!("LOOP_CLR_FD {}", device.display()), e));
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(FrontendError::io(format!("opening {}", device.display()), e)),
    }
    // Our fd is closed: with no other opener the device was cleared on that close.
    Ok(!backing.exists())
}

/// Every loop device whose backing file lives on the filesystem with device number
/// `major:minor` (as the mount table shows it), found with LOOP_GET_STATUS64. Unlike the path in
/// sysfs this holds after the mount the file was opened through is gone: a loop device a
/// container attached through its copy of a mount shows its file as `/volume` once that
/// container's mount namespace ended.
pub fn devices_on(major: u32, minor: u32) -> Result<Vec<PathBuf>, FrontendError> {
    // The kernel's new_encode_dev, which LOOP_GET_STATUS64 reports.
    let (major, minor) = (u64::from(major), u64::from(minor));
    let want = (minor & 0xff) | (major << 8) | ((minor & !0xff) << 12);
    let entries = std::fs::read_dir("/sys/block").map_err(ioctl_err("listing /sys/block".into()))?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str().filter(|n| n.starts_with("loop")) else { continue };
        if !entry.path().join("loop/backing_file").exists() {
            continue;
        }
        let device = Path::new("/dev").join(name);
        let Ok(dev) = OpenOptions::new().read(true).custom_flags(libc::O_CLOEXEC).open(&device) else { continue };
        let mut info = LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; LO_NAME_SIZE],
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        };
        // SAFETY: LOOP_GET_STATUS64 fills a `struct loop_info64` we own for the call's duration.
        let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_GET_STATUS64 as _, &mut info as *mut LoopInfo64) };
        if r == 0 && info.lo_device == want {
            found.push(device);
        }
    }
    found.sort();
    Ok(found)
}

/// Whether `device` is set to detach itself at its last close (autoclear, or a detach asked
/// while it was held open).
pub fn detaches_itself(device: &Path) -> bool {
    loop_name(device)
        .ok()
        .and_then(|n| read_sys(&Path::new("/sys/block").join(n).join("loop/autoclear")).ok())
        .is_some_and(|v| v == "1")
}

/// Detaches every loop device backed by `file` (see [`detach`]).
pub fn detach_all_of(file: &Path, patience: Duration) -> Result<(), FrontendError> {
    for device in devices_of(file)? {
        detach(&device, patience)?;
    }
    Ok(())
}

/// Makes `device` take on its backing file's current size (LOOP_SET_CAPACITY) and returns the
/// size it now has. The loop driver reads the size the backing inode has cached: for a FUSE
/// file the caller first makes sure a stat shows the new size.
pub fn set_capacity(device: &Path) -> Result<u64, FrontendError> {
    let dev = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(device)
        .map_err(ioctl_err(format!("opening {}", device.display())))?;
    // SAFETY: ioctl without argument on an open loop device fd.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_SET_CAPACITY as _, 0) };
    if r < 0 {
        return Err(FrontendError::io(format!("LOOP_SET_CAPACITY {}", device.display()), io::Error::last_os_error()));
    }
    size_bytes(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_names_are_checked() {
        assert_eq!(loop_name(Path::new("/dev/loop12")).ok().as_deref(), Some("loop12"));
        for bad in ["/dev/sda", "/dev/loop", "/dev/loop1p1", "/"] {
            assert!(loop_name(Path::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn config_struct_has_the_kernel_layout() {
        // struct loop_info64 is 232 bytes, struct loop_config 304 (uapi/linux/loop.h).
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn attach_resize_detach_a_plain_file() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping attach_resize_detach_a_plain_file: loop devices need root");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().canonicalize().expect("canonical").join("img");
        let f = File::create(&path).expect("create");
        f.set_len(4 << 20).expect("size");
        let dev = attach(&path, LoopOptions::default()).expect("attach");
        let device = dev.path().to_owned();
        assert_eq!(backing_file(&device).as_deref(), Some(path.as_path()));
        assert_eq!(devices_of(&path).expect("devices"), vec![device.clone()]);
        assert_eq!(size_bytes(&device).expect("size"), 4 << 20);
        f.set_len(8 << 20).expect("grow");
        assert_eq!(set_capacity(&device).expect("capacity"), 8 << 20);
        drop(dev);
        detach(&device, Duration::from_secs(10)).expect("detach");
        assert!(backing_file(&device).is_none());
        detach(&device, Duration::from_secs(10)).expect("detach is idempotent");

        // Autoclear: gone once the last fd closes.
        let dev = attach(&path, LoopOptions { autoclear: true, ..Default::default() }).expect("attach autoclear");
        let device = dev.path().to_owned();
        assert!(backing_file(&device).is_some());
        drop(dev);
        let deadline = Instant::now() + Duration::from_secs(10);
        while backing_file(&device).is_some() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(devices_of(&path).expect("devices").is_empty(), "autoclear detached it");
    }
}
