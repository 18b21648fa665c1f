//! Whether the mounts a process makes beneath a directory reach the host and, from there, the
//! other containers. From inside a container a mount reaches the host only when the directory
//! is a *shared* mount there (the pod spec's `mountPropagation: Bidirectional` over a host path
//! that is itself shared); otherwise it stays in the container, unseen. Two directories need
//! it: kubelet's, where the node plugin stages and publishes volumes (kubelet and the pods must
//! see them), and the data path's state directory, where it mounts the FUSE files and rbd-fuse
//! images the node plugin puts loop devices on. Each process checks its own once, at start,
//! and refuses to serve with a message that says what to fix, rather than answering every call
//! with success. This module owns the decision only; the mount table's format is `mountinfo`'s.
use std::path::{Path, PathBuf};
use wasmcsi_mountinfo::MountEntry;

/// The directory's mount does not pass the plugin's mounts on to the host.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotShared {
    #[error(
        "{dir} is on mount {mount_point}, which is not a shared mount ({how}): what is mounted beneath it \
         would stay inside this container, unseen by the host. Mount it into the pod with mountPropagation: \
         Bidirectional, and make it shared on the host (systemd does for /; without systemd run \
         `mount --make-rshared /` at boot; deploy/README.md)"
    )]
    Private { dir: PathBuf, mount_point: PathBuf, how: &'static str },
    #[error("{0} is on no mount of this mount namespace")]
    Unmounted(PathBuf),
}

/// The mount a lookup of `path` (absolute, spelled as the kernel spells it) reaches: the
/// entry with the longest mount point holding `path`, the last mounted of those.
pub fn mount_holding<'a>(entries: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    entries.iter().filter(|e| path.starts_with(&e.mount_point)).fold(None, |best: Option<&MountEntry>, e| match best {
        Some(b) if b.mount_point.as_os_str().len() > e.mount_point.as_os_str().len() => Some(b),
        _ => Some(e),
    })
}

/// `Ok` when mounts made beneath `dir` propagate to the host: the mount holding it is shared.
pub fn check_shared(entries: &[MountEntry], dir: &Path) -> Result<(), NotShared> {
    let mount = mount_holding(entries, dir).ok_or_else(|| NotShared::Unmounted(dir.to_path_buf()))?;
    if mount.propagation.iter().any(|f| f.starts_with("shared:")) {
        return Ok(());
    }
    let how = if mount.propagation.iter().any(|f| f.starts_with("master:")) {
        "a slave: it receives the host's mounts and sends none back, as HostToContainer makes it"
    } else {
        "private: it propagates nothing"
    };
    Err(NotShared::Private { dir: dir.to_path_buf(), mount_point: mount.mount_point.clone(), how })
}

#[cfg(test)]
mod tests {
    use super::*;
    use wasmcsi_mountinfo::parse;

    /// The node plugin's container as the DaemonSet makes it: its root private, kubelet's dir
    /// Bidirectional (shared with the host's peer group), a HostToContainer mount, a None one.
    const CONTAINER: &str = "\
2000 1900 0:300 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
2001 2000 8:1 /var/lib/kubelet /var/lib/kubelet rw,relatime shared:7 master:1 - ext4 /dev/sda1 rw
2002 2001 0:51 / /var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount rw,relatime shared:9 - ext4 /dev/loop3 rw
2003 2000 8:1 /var/lib/wasmcsi/state /var/lib/wasmcsi/state rw,relatime - ext4 /dev/sda1 rw
2004 2000 8:1 /srv/kubelet /srv/kubelet rw,relatime master:1 - ext4 /dev/sda1 rw
";

    #[test]
    fn a_bidirectional_kubelet_dir_is_shared() {
        let entries = parse(CONTAINER).expect("parse");
        assert_eq!(check_shared(&entries, Path::new("/var/lib/kubelet")), Ok(()));
        let published = Path::new("/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount");
        assert_eq!(mount_holding(&entries, published).map(|e| e.mount_id), Some(2002));
        assert_eq!(mount_holding(&entries, Path::new("/var/lib/kubelet/plugins")).map(|e| e.mount_id), Some(2001));
    }

    #[test]
    fn a_private_or_slave_mount_is_refused_saying_what_to_fix() {
        let entries = parse(CONTAINER).expect("parse");
        let private = check_shared(&entries, Path::new("/var/lib/wasmcsi/state/run")).expect_err("private");
        assert!(
            matches!(&private, NotShared::Private { mount_point, .. } if mount_point == Path::new("/var/lib/wasmcsi/state"))
        );
        assert!(private.to_string().contains("Bidirectional"), "{private}");
        let slave = check_shared(&entries, Path::new("/srv/kubelet")).expect_err("slave");
        assert!(slave.to_string().contains("HostToContainer"), "{slave}");
        // Not under any bind: the container's root, private.
        let root = check_shared(&entries, Path::new("/var/lib/other")).expect_err("root");
        assert!(matches!(root, NotShared::Private { mount_point, .. } if mount_point == Path::new("/")));
        assert_eq!(check_shared(&[], Path::new("/x")), Err(NotShared::Unmounted(PathBuf::from("/x"))));
    }
}
