//! A filesystem on a block device this node staged, whatever made the device (an RBD mapping,
//! a replicated volume's engine): format it only when blank, never over another filesystem,
//! grow an ext4 that missed an expansion while unmounted, mount it with the CSI mount flags,
//! grow it online, unmount it within a bound. Also the small file and process helpers the
//! block attachers share (state files written atomically, commands run with a time limit).
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use nix::mount::{MntFlags, MsFlags};
use serde::{Deserialize, Serialize};
use wasmcsi_frontend::fuse::connection::abort_if_mounted_at;
use wasmcsi_frontend::{loop_dev, mkfs};

use crate::error::{CsiError, CsiResult};
use crate::node::bounded;
use wasmcsi_mountinfo as mountinfo;

/// How long one unmount, fsck, resize or loop detach may take before it is given up on (an
/// unmount past it gets the FUSE connection under it aborted).
pub(crate) const PATIENCE: Duration = Duration::from_secs(30);

/// The filesystems this node formats and grows.
const SUPPORTED: &[&str] = &["ext4", "xfs"];

/// A filesystem volume's filesystem: what the capability asked for and, once mounted, what the
/// device holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Filesystem {
    /// Empty: ext4 when blank, else whatever the device holds.
    pub fs_type: String,
    pub mount_flags: Vec<String>,
    pub read_only: bool,
}

/// An I/O error as INTERNAL, saying what was being done.
pub(crate) fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> CsiError {
    let what = what.into();
    move |e| CsiError::Internal(format!("{what}: {e}"))
}

impl Filesystem {
    /// The filesystem a capability asks for, checked before anything is attached:
    /// INVALID_ARGUMENT for an fs type this node cannot make or a mount flag it refuses.
    pub fn wanted(fs_type: &str, mount_flags: &[String], read_only: bool) -> CsiResult<Self> {
        if !fs_type.is_empty() && !SUPPORTED.contains(&fs_type) {
            return Err(CsiError::Invalid(format!("fs_type {fs_type:?} is not supported ({})", SUPPORTED.join(", "))));
        }
        self::mount_flags(mount_flags, read_only)?;
        Ok(Self { fs_type: fs_type.to_owned(), mount_flags: mount_flags.to_vec(), read_only })
    }

    /// Whether a staged filesystem `other` satisfies this request (same type unless any is
    /// accepted, same flags and mode).
    pub fn satisfied_by(&self, other: &Filesystem) -> bool {
        (self.fs_type.is_empty() || self.fs_type == other.fs_type)
            && self.mount_flags == other.mount_flags
            && self.read_only == other.read_only
    }

    /// Formats `device` when blank (never otherwise: another filesystem than the one asked for
    /// is FAILED_PRECONDITION), grows an ext4 whose device grew while unmounted, and mounts it
    /// at `staging`. `fs_type` becomes what the device holds. `what` names the device in errors.
    pub fn format_and_mount(&mut self, device: &Path, staging: &Path, what: &str) -> CsiResult<()> {
        let existing = mkfs::probe_fs(device).map_err(CsiError::Device)?;
        let wanted = if self.fs_type.is_empty() { "ext4".to_owned() } else { self.fs_type.clone() };
        let actual = match existing {
            Some(found) if self.fs_type.is_empty() || found == self.fs_type => found,
            Some(found) => {
                return Err(CsiError::FailedPrecondition(format!(
                    "{what} holds {found}, the volume capability asks for {wanted}; it is never reformatted"
                )));
            }
            None if self.read_only => {
                return Err(CsiError::FailedPrecondition(format!("{what} has no filesystem and is staged read-only")));
            }
            None => {
                let fs = match wanted.as_str() {
                    "ext4" => mkfs::FsType::Ext4,
                    "xfs" => mkfs::FsType::Xfs,
                    other => {
                        return Err(CsiError::Invalid(format!("fs_type {other:?} is not supported (ext4, xfs)")));
                    }
                };
                let t = Instant::now();
                mkfs::mkfs(device, fs).map_err(CsiError::Device)?;
                tracing::info!(fs = fs.name(), took = ?t.elapsed(), "formatted blank device");
                wanted
            }
        };
        // An ext4 whose device grew while it was not staged (the expansion this host could not
        // do online) grows now, unmounted, which needs no CAP_SYS_RESOURCE.
        if actual == "ext4" && !self.read_only {
            grow_ext4_offline(device)?;
        }
        let (ms, mut data) = mount_flags(&self.mount_flags, self.read_only)?;
        // A clone or snapshot of an XFS volume carries its UUID, and XFS refuses a second mount
        // of one UUID on a node ("duplicate UUID"): always nouuid, as ceph-csi does.
        if actual == "xfs" && !data.split(',').any(|o| o == "nouuid") {
            data = if data.is_empty() { "nouuid".into() } else { format!("{data},nouuid") };
        }
        std::fs::create_dir_all(staging).map_err(io_err(format!("creating {}", staging.display())))?;
        let data = (!data.is_empty()).then_some(data);
        nix::mount::mount(Some(device), staging, Some(actual.as_str()), ms, data.as_deref()).map_err(|e| {
            CsiError::Mount(format!("mounting {} ({actual}) on {}: {e}", device.display(), staging.display()))
        })?;
        self.fs_type = actual;
        Ok(())
    }

    /// Grows the filesystem mounted at `staging` to its device (`size` bytes, for messages):
    /// XFS online; ext4 online where this process may (CAP_SYS_RESOURCE), else
    /// FAILED_PRECONDITION saying it grows at the next stage.
    pub fn grow(&self, device: &Path, staging: &Path, size: u64) -> CsiResult<()> {
        match self.fs_type.as_str() {
            "xfs" => mkfs::grow_fs(device, "xfs", Some(staging)).map_err(CsiError::Device)?,
            // Already as large as the device (formatted after the controller grew the volume):
            // nothing to grow, so nothing to refuse.
            "ext4" if ext4_bytes(device).is_ok_and(|(bytes, block)| bytes.saturating_add(block) > size) => {
                return Ok(());
            }
            "ext4" => {
                let cannot = |why: String| {
                    CsiError::FailedPrecondition(format!(
                        "ext4 on {} cannot grow while mounted on this host ({why}); it grows to {size} bytes the next \
                         time the volume is staged (stop the pods using it)",
                        device.display()
                    ))
                };
                // Without the capability the kernel refuses the online resize; not even trying
                // matters, because resize2fs first asks the loop device about its backing file,
                // a FUSE getattr that a FUSE server was seen to leave unanswered right after a
                // resize.
                if !has_capability(CAP_SYS_RESOURCE) {
                    return Err(cannot("the plugin lacks CAP_SYS_RESOURCE".into()));
                }
                run_bounded(Command::new("resize2fs").arg(device), PATIENCE).map_err(cannot)?;
            }
            other => return Err(CsiError::FailedPrecondition(format!("growing {other} is not supported"))),
        }
        tracing::info!(fs = %self.fs_type, size, "filesystem grown");
        Ok(())
    }
}

/// Splits CSI mount flags into mount(2) flags and filesystem data (`discard`, `nouuid`, ...).
/// Each entry may itself be comma-separated, as kubelet passes `mountOptions` through; an SELinux
/// `context="…"` stays one option, quoted, as the kernel parses it (see [`super::mount_options`]).
pub fn mount_flags(flags: &[String], read_only: bool) -> CsiResult<(MsFlags, String)> {
    let mut ms = MsFlags::empty();
    let mut data: Vec<String> = Vec::new();
    for opt in super::mount_options::for_mount(flags)? {
        match opt.as_str() {
            "ro" => ms |= MsFlags::MS_RDONLY,
            "rw" | "defaults" => {}
            "noatime" => ms |= MsFlags::MS_NOATIME,
            "nodiratime" => ms |= MsFlags::MS_NODIRATIME,
            "relatime" => ms |= MsFlags::MS_RELATIME,
            "strictatime" => ms |= MsFlags::MS_STRICTATIME,
            "lazytime" => ms |= MsFlags::MS_LAZYTIME,
            "nosuid" => ms |= MsFlags::MS_NOSUID,
            "nodev" => ms |= MsFlags::MS_NODEV,
            "noexec" => ms |= MsFlags::MS_NOEXEC,
            "sync" => ms |= MsFlags::MS_SYNCHRONOUS,
            "dirsync" => ms |= MsFlags::MS_DIRSYNC,
            _ => data.push(opt),
        }
    }
    if read_only {
        ms |= MsFlags::MS_RDONLY;
    }
    Ok((ms, data.join(",")))
}

/// Whether the mount table has `device` (a block device node) mounted at `path`.
pub fn device_mounted_at(mounts: &[mountinfo::MountEntry], device: &Path, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(rdev) = std::fs::metadata(device).map(|m| m.rdev()) else { return false };
    let (major, minor) = (nix::sys::stat::major(rdev), nix::sys::stat::minor(rdev));
    mountinfo::mounts_at(mounts, path).iter().any(|m| u64::from(m.major) == major && u64::from(m.minor) == minor)
}

/// Writes a state file (0600) so that a crash leaves the old content or the new, never half.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> CsiResult<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_err(format!("creating {}", tmp.display())))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(io_err(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io_err(format!("renaming {}", tmp.display())))
}

/// Unmount every mount stacked at `path`. A normal unmount that does not finish within
/// [`PATIENCE`] (writeback stuck on a cluster that does not answer) gets the FUSE connection
/// under the loop device aborted, which fails the pending I/O; if even that does not let it
/// finish, the mount is detached lazily so the call returns.
pub fn unmount_all(path: &Path, fuse_connection: Option<(&Path, u64)>) -> CsiResult<()> {
    let mounted = || -> CsiResult<bool> {
        let m = mountinfo::read_current().map_err(|e| CsiError::Mount(e.to_string()))?;
        Ok(!mountinfo::mounts_at(&m, path).is_empty())
    };
    for _ in 0..16 {
        if !mounted()? {
            return Ok(());
        }
        let p = path.to_owned();
        let unmount = bounded::start(move || mkfs::unmount(&p));
        match unmount.wait(PATIENCE) {
            Some(Ok(())) => continue,
            Some(Err(e)) => return Err(CsiError::Mount(e.to_string())),
            None => {
                tracing::warn!(path = %path.display(), "unmount does not finish; aborting the FUSE connection under it");
                if let Some((mount_point, id)) = fuse_connection {
                    abort_if_mounted_at(mount_point, id);
                }
                if unmount.wait(PATIENCE).is_none() {
                    nix::mount::umount2(path, MntFlags::MNT_DETACH)
                        .map_err(|e| CsiError::Mount(format!("lazy unmount of {}: {e}", path.display())))?;
                }
            }
        }
    }
    if mounted()? {
        return Err(CsiError::Mount(format!("{} is still mounted", path.display())));
    }
    Ok(())
}

/// Grows an unmounted ext4 to its device when the device is larger (by at least a block).
fn grow_ext4_offline(device: &Path) -> CsiResult<()> {
    let out = Command::new("dumpe2fs").arg("-h").arg(device).output().map_err(io_err("running dumpe2fs"))?;
    if !out.status.success() {
        return Err(CsiError::Internal(format!(
            "dumpe2fs -h {}: {}",
            device.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| -> Option<u64> {
        text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim_start_matches(':').trim().parse().ok())
    };
    let (Some(blocks), Some(block_size)) = (field("Block count"), field("Block size")) else {
        return Err(CsiError::Internal(format!("dumpe2fs -h {}: no block count/size", device.display())));
    };
    let device_bytes = loop_dev::size_bytes(device).map_err(CsiError::Device)?;
    if blocks.saturating_add(1).saturating_mul(block_size) > device_bytes {
        return Ok(());
    }
    let t = Instant::now();
    // resize2fs insists on a freshly checked filesystem; -p repairs only what is safe.
    let fsck = Command::new("e2fsck").args(["-f", "-p"]).arg(device).output().map_err(io_err("running e2fsck"))?;
    // 0: clean, 1: errors corrected.
    if !matches!(fsck.status.code(), Some(0 | 1)) {
        return Err(CsiError::Internal(format!(
            "e2fsck -f -p {} before growing: {}",
            device.display(),
            String::from_utf8_lossy(&fsck.stdout).trim()
        )));
    }
    mkfs::grow_fs(device, "ext4", None).map_err(CsiError::Device)?;
    tracing::info!(device = %device.display(), from = blocks * block_size, to = device_bytes, took = ?t.elapsed(), "ext4 grown before mounting");
    Ok(())
}

const CAP_SYS_RESOURCE: u32 = 24;

/// Whether this process has capability `cap` in its effective set.
/// The bytes an ext4 filesystem spans and its block size, from its superblock (1024 bytes into
/// the device): the block count (its high half only with the 64bit feature) times the block size.
fn ext4_bytes(device: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::FileExt;
    let mut sb = [0u8; 1024];
    std::fs::File::open(device)?.read_exact_at(&mut sb, 1024)?;
    let u32_at = |at: usize| u64::from(u32::from_le_bytes([sb[at], sb[at + 1], sb[at + 2], sb[at + 3]]));
    if u16::from_le_bytes([sb[0x38], sb[0x39]]) != 0xEF53 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("no ext4 superblock on {}", device.display())));
    }
    const INCOMPAT_64BIT: u64 = 0x80;
    let high = if u32_at(0x60) & INCOMPAT_64BIT != 0 { u32_at(0x150) } else { 0 };
    let block = 1024u64.checked_shl(u32::try_from(u32_at(24)).unwrap_or(u32::MAX)).filter(|b| *b <= 1 << 16);
    let block = block.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "ext4 block size out of range"))?;
    Ok((((high << 32) | u32_at(4)).saturating_mul(block), block))
}

fn has_capability(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:")).map(|v| v.trim().to_owned()))
        .and_then(|hex| u64::from_str_radix(&hex, 16).ok())
        .is_some_and(|bits| bits & (1 << cap) != 0)
}

/// Runs `cmd`, killing it past `limit`; the error carries its stderr.
fn run_bounded(cmd: &mut Command, limit: Duration) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("running {shown}: {e}"))?;
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = io::Read::read_to_string(&mut e, &mut err);
                }
                return Err(format!("{shown} failed ({status}): {}", err.trim()));
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{shown} did not finish within {limit:?}"));
            }
            Err(e) => return Err(format!("waiting for {shown}: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_flags_split_into_syscall_flags_and_data() {
        let (ms, data) = mount_flags(&["noatime".into(), "discard,nodev".into()], false).expect("flags");
        assert_eq!(ms, MsFlags::MS_NOATIME | MsFlags::MS_NODEV);
        assert_eq!(data, "discard");
        let (ms, data) = mount_flags(&[], true).expect("flags");
        assert_eq!((ms, data.as_str()), (MsFlags::MS_RDONLY, ""));
        assert!(mount_flags(&["bind".into()], false).is_err());
        assert!(mount_flags(&["a b".into()], false).is_err());
        // kubelet's SELinux label: one data option, quotes and all, commas inside kept.
        let label = "context=\"system_u:object_r:container_file_t:s0:c3,c7\"";
        let (ms, data) = mount_flags(&[format!("nodev,{label}"), "discard".into()], false).expect("flags");
        assert_eq!((ms, data), (MsFlags::MS_NODEV, format!("{label},discard")));
    }

    #[test]
    fn a_wanted_filesystem_is_checked_and_an_empty_type_takes_what_is_there() {
        assert!(matches!(Filesystem::wanted("btrfs", &[], false), Err(CsiError::Invalid(_))));
        assert!(matches!(Filesystem::wanted("ext4", &["remount".into()], false), Err(CsiError::Invalid(_))));
        let any = Filesystem::wanted("", &[], false).expect("any");
        let xfs = Filesystem { fs_type: "xfs".into(), mount_flags: vec![], read_only: false };
        assert!(any.satisfied_by(&xfs));
        assert!(!Filesystem::wanted("ext4", &[], false).expect("ext4").satisfied_by(&xfs));
        assert!(!Filesystem::wanted("", &[], true).expect("ro").satisfied_by(&xfs));
    }

    #[test]
    fn an_ext4_that_fills_its_device_needs_no_growing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let image = dir.path().join("fs.img");
        std::fs::File::create(&image).and_then(|f| f.set_len(16 << 20)).expect("image");
        let made = Command::new("mkfs.ext4").args(["-q", "-F", "-b", "4096"]).arg(&image).arg("8M").status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("skipping: mkfs.ext4 unavailable");
            return;
        }
        assert_eq!(ext4_bytes(&image).expect("superblock"), (8 << 20, 4096));
        let fs = Filesystem { fs_type: "ext4".into(), mount_flags: vec![], read_only: false };
        // As large as asked already: done, whatever this host may do to a mounted ext4.
        fs.grow(&image, dir.path(), 8 << 20).expect("nothing to grow");
        assert!(ext4_bytes(&dir.path().join("missing")).is_err());
        std::fs::write(dir.path().join("zeros"), vec![0u8; 4096]).expect("zeros");
        assert!(ext4_bytes(&dir.path().join("zeros")).is_err(), "no superblock");
    }
}
