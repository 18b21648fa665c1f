//! How much of a volume is used, for NodeGetVolumeStats: a directory tree walked
//! ([`directory_usage`]: directory volumes, and NFS volumes against their recorded size), and a
//! mounted filesystem asked ([`fs_stats`]: NFS shares, filesystems on block devices), bounded in
//! time because a dead server or daemon under the mount blocks the calls in the kernel.
use std::collections::HashSet;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use wasmcsi_proto::csi::v1 as csi;

use super::attacher::{blocking, mount_err};
use super::bounded;
use crate::convert;
use crate::error::CsiResult;

/// Apparent size in bytes and number of inodes of the tree under `path` (included), like
/// `du --apparent-size -x`: symlinks are counted, not followed; hard links count once; other
/// filesystems mounted inside are skipped. A bind mount from the same filesystem shares the
/// device number and is therefore walked. Entries vanishing during the walk are ignored.
pub fn directory_usage(path: &Path) -> io::Result<(u64, u64)> {
    let root = std::fs::metadata(path)?;
    let device = root.dev();
    let mut bytes = root.size();
    let mut inodes = 1u64;
    let mut linked = HashSet::new();
    let mut pending = vec![path.to_path_buf()];

    while let Some(dir) = pending.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && dir != path => continue,
            other => other?,
        };
        for entry in entries {
            let metadata = match entry.and_then(|e| Ok((e.path(), e.metadata()?))) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                other => other?,
            };
            let (entry_path, metadata) = metadata;
            if metadata.dev() != device {
                continue;
            }
            if metadata.nlink() > 1 && !metadata.is_dir() && !linked.insert(metadata.ino()) {
                continue;
            }
            bytes = bytes.saturating_add(metadata.size());
            inodes += 1;
            if metadata.is_dir() {
                pending.push(entry_path);
            }
        }
    }
    Ok((bytes, inodes))
}

/// Stats of a mounted filesystem (an NFS share, a filesystem on an rbd image). Space and inodes
/// from statvfs; with `capacity` (an NFS volume's recorded size) the used bytes are the mounted
/// tree's, walked, so a volume over its size is abnormal. Every filesystem call is bounded: a
/// dead server makes them block, which is then the abnormal condition (`unreachable`) rather
/// than a hung call. `problem` is a known abnormal condition of the attachment.
pub async fn fs_stats(
    path: PathBuf,
    unreachable: &str,
    problem: Option<String>,
    capacity: Option<u64>,
) -> CsiResult<csi::NodeGetVolumeStatsResponse> {
    use csi::volume_usage::Unit;
    const LIVENESS: std::time::Duration = std::time::Duration::from_secs(10);
    const WALK: std::time::Duration = std::time::Duration::from_secs(60);
    let b = convert::bytes;
    let probe = path.clone();
    let fs = match blocking(move || Ok(bounded::bounded(LIVENESS, move || nix::sys::statvfs::statvfs(&probe)))).await? {
        Some(Ok(fs)) => fs,
        Some(Err(e)) => return Err(mount_err(format!("statvfs {}: {e}", path.display()))),
        None => {
            return Ok(csi::NodeGetVolumeStatsResponse {
                usage: vec![],
                volume_condition: Some(csi::VolumeCondition {
                    abnormal: true,
                    message: format!("{unreachable} ({})", path.display()),
                }),
            });
        }
    };
    let inodes = csi::VolumeUsage {
        available: b(fs.files_available()),
        total: b(fs.files()),
        used: b(fs.files().saturating_sub(fs.files_free())),
        unit: Unit::Inodes as i32,
    };
    let frag = fs.fragment_size();
    let whole_fs = |problem: Option<String>| csi::NodeGetVolumeStatsResponse {
        usage: vec![
            csi::VolumeUsage {
                available: b(fs.blocks_available() * frag),
                total: b(fs.blocks() * frag),
                used: b((fs.blocks() - fs.blocks_free()) * frag),
                unit: Unit::Bytes as i32,
            },
            inodes,
        ],
        volume_condition: Some(csi::VolumeCondition {
            abnormal: problem.is_some(),
            message: problem.unwrap_or_else(|| "healthy".into()),
        }),
    };
    let Some(capacity) = capacity else { return Ok(whole_fs(problem)) };
    let walk = path.clone();
    let used = match blocking(move || Ok(bounded::bounded(WALK, move || directory_usage(&walk)))).await? {
        Some(Ok((bytes, _))) => bytes,
        Some(Err(e)) => return Err(mount_err(format!("walking {}: {e}", path.display()))),
        // A tree too big to walk in time: the filesystem's numbers are the best there is.
        None => return Ok(whole_fs(problem)),
    };
    let problem =
        problem.or_else(|| (used > capacity).then(|| format!("uses {used} bytes of its {capacity} byte capacity")));
    Ok(csi::NodeGetVolumeStatsResponse {
        usage: vec![
            csi::VolumeUsage {
                available: b(capacity.saturating_sub(used)),
                total: b(capacity),
                used: b(used),
                unit: Unit::Bytes as i32,
            },
            inodes,
        ],
        volume_condition: Some(csi::VolumeCondition {
            abnormal: problem.is_some(),
            message: problem.unwrap_or_else(|| "healthy".into()),
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::sandbox::Sandbox;
    use nix::mount::MsFlags;

    // ---- directory_usage, unprivileged --------------------------------------------------------

    #[test]
    #[allow(clippy::unwrap_used, reason = "test setup on a fresh tempdir")]
    fn directory_usage_sums_apparent_sizes_without_following_symlinks() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("big"), vec![0u8; 10_000]).unwrap();

        let volume = tempfile::tempdir().unwrap();
        let root = volume.path();
        std::fs::write(root.join("a"), [1u8; 100]).unwrap();
        std::fs::create_dir(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/b"), [2u8; 200]).unwrap();
        std::fs::hard_link(root.join("a"), root.join("sub/a-again")).unwrap();
        std::os::unix::fs::symlink(outside.path(), root.join("escape")).unwrap();

        let size = |p: &Path| std::fs::symlink_metadata(p).unwrap().size();
        let expected_bytes = size(root) + 100 + size(&root.join("sub")) + 200 + size(&root.join("escape"));
        // root, a, sub, sub/b, escape; the hard link is the same inode as a.
        assert_eq!(directory_usage(root).unwrap(), (expected_bytes, 5));
    }

    #[test]
    fn directory_usage_fails_on_a_missing_directory() {
        let err = directory_usage(Path::new("/nonexistent/wasmcsi/volume"));
        assert!(matches!(&err, Err(e) if e.kind() == io::ErrorKind::NotFound), "{err:?}");
    }

    #[test]
    #[allow(clippy::unwrap_used, reason = "test setup in a fresh sandbox")]
    fn directory_usage_does_not_cross_into_other_mounts() {
        let Some(sandbox) = Sandbox::new("directory_usage_does_not_cross_into_other_mounts") else {
            return;
        };
        let volume = sandbox.dir("volume");
        std::fs::write(volume.join("a"), [1u8; 100]).unwrap();
        let inner = sandbox.dir("volume/inner");
        let before = directory_usage(&volume).unwrap();

        sandbox.mount_tmpfs(&inner, MsFlags::empty());
        std::fs::write(inner.join("big"), vec![0u8; 50_000]).unwrap();
        let after = directory_usage(&volume).unwrap();
        // The mount point is reached through the tmpfs root, so it drops out of the count.
        let inner_dir = std::fs::symlink_metadata(volume.join("inner")).unwrap();
        assert_eq!(before.1, 3);
        assert_eq!(after.1, 2);
        assert!(after.0 < before.0 + inner_dir.size(), "{before:?} -> {after:?}");
        assert!(after.0 < 50_000, "{after:?}");
    }
}
