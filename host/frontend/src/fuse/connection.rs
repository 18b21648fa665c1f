//! A FUSE connection's number (its directory in `/sys/fs/fuse/connections`) and aborting it.
//!
//! The number is the kernel's encoding of the mount's anonymous device number, and the kernel
//! hands that number to the next mount as soon as the last mount of the connection is gone. So
//! a number is only ever acted on while a mount that pins it is checked to still be there:
//! aborting a number remembered from before an unmount can end another volume's connection.

use std::path::Path;

use wasmcsi_mountinfo::{self as mountinfo, MountEntry};

/// The connection number of the FUSE filesystem mounted on top at `mnt`; `None` if what is
/// mounted there (if anything) is not FUSE.
///
/// Read from /proc/self/mountinfo, never by a stat of the mount: that waits for the server, which
/// may not answer yet (before INIT, or while suspended) or ever again (dead).
pub fn connection_at(mnt: &Path) -> Option<u64> {
    connection_in(&mountinfo::read_current().ok()?, mnt)
}

fn connection_in(table: &[MountEntry], mnt: &Path) -> Option<u64> {
    // The last entry at `mnt` is the mount on top, the one the path reaches.
    let top = mountinfo::mounts_at(table, mnt).pop()?;
    if top.fs_type != "fuse" && !top.fs_type.starts_with("fuse.") {
        return None;
    }
    Some((u64::from(top.major) << 20) | u64::from(top.minor))
}

/// Best effort: aborts connection `id` if it still is what is mounted at `mnt`, mounting fusectl
/// if needed; a number that another mount took since is left alone. The caller must keep `mnt`
/// mounted across the call (it owns the mount, and nobody else unmounts it): that is what keeps
/// the number from changing hands between the check and the abort.
///
/// Aborting ends the connection in every mount namespace that holds a copy of the mount (a
/// container, `ip netns exec`, kubelet's mount propagation); those copies then fail with
/// ENOTCONN, and the server's reads end.
pub fn abort_if_mounted_at(mnt: &Path, id: u64) {
    if connection_at(mnt) != Some(id) {
        tracing::debug!(connection = id, mount = %mnt.display(), "not aborting: the connection is no longer mounted there");
        return;
    }
    let root = Path::new("/sys/fs/fuse/connections");
    let dir = root.join(id.to_string());
    if !dir.exists() && !fusectl_mounted() {
        let _ = nix::mount::mount(Some("fusectl"), root, Some("fusectl"), nix::mount::MsFlags::empty(), None::<&str>);
    }
    match std::fs::write(dir.join("abort"), "1") {
        Ok(()) => tracing::debug!(connection = id, mount = %mnt.display(), "aborted the FUSE connection"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(connection = id, error = %e, "could not abort the FUSE connection"),
    }
}

fn fusectl_mounted() -> bool {
    mountinfo::read_current().is_ok_and(|table| table.iter().any(|e| e.fs_type == "fusectl"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
22 1 0:21 / /proc rw,nosuid - proc proc rw
90 22 0:77 / /run/wasmcsi/fuse-a.1.0 rw,nosuid,nodev - fuse.wasmcsi wasmcsi-a rw,user_id=0
91 22 0:78 / /run/wasmcsi/fuse\\040b rw - fuse fuse rw
92 90 0:79 / /run/wasmcsi/fuse-a.1.0 rw - tmpfs tmpfs rw
93 22 259:3 / /run/wasmcsi/fuse-c.1.0 rw - fuse.wasmcsi wasmcsi-c rw
";

    fn table() -> Vec<MountEntry> {
        mountinfo::parse(INFO).expect("the fixture parses")
    }

    #[test]
    fn the_number_is_the_top_fuse_mounts_device_number() {
        assert_eq!(connection_in(&table(), Path::new("/run/wasmcsi/fuse b")), Some(78));
        assert_eq!(connection_in(&table(), Path::new("/run/wasmcsi/fuse-c.1.0")), Some((259 << 20) | 3));
        assert_eq!(connection_in(&table(), Path::new("/run/wasmcsi/none")), None);
    }

    #[test]
    fn a_mount_on_top_that_is_not_fuse_has_no_connection() {
        // The FUSE mount under it still pins its number, but what the path reaches is the tmpfs.
        assert_eq!(connection_in(&table(), Path::new("/run/wasmcsi/fuse-a.1.0")), None);
        assert_eq!(connection_in(&table(), Path::new("/proc")), None);
    }
}
