//! The mount work every attachment kind shares: binding a source onto a target (a directory
//! volume onto its staging path, a staging path onto a pod's target path, a staged device node
//! onto a raw-block target file), read-only when asked, and unmounting what is stacked at a path.
//!
//! Idempotency is computed, then executed: the caller reads state (the mount table, the
//! [`SourceIdentity`] of source and target), a pure planner (`plan_bind`, `plan_unmount`) turns it
//! into a list of [`MountAction`]s (empty when the node is already in the asked-for state), and
//! [`execute`] runs the list through a [`MountSystem`], rolling back what it mounted if a step
//! fails.
//!
//! It does not own volume ids, per-volume locking, CSI error codes or the choice of paths: the
//! node service and its attachers do. Nor does it parse the mount table (the `wasmcsi-mountinfo` crate does).
//! The executor blocks (syscalls, short sleeps while an unmount is busy): call it from a blocking
//! task.
//!
//! Over the ~750 lines a module is kept to only with its unit tests (the planner's cases against
//! mountinfo fixtures, the executor's rollback, real mounts in a sandbox), which stay beside the code; the code itself is
//! under 400 lines.

use std::fmt;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use nix::sys::statvfs::FsFlags;

use wasmcsi_mountinfo::{self as mountinfo, MountEntry};

/// One change to the node's mount table or file tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountAction {
    CreateDir(PathBuf),
    Bind {
        source: PathBuf,
        target: PathBuf,
    },
    /// Makes the bind mount at the path read-only without touching other mounts of the same
    /// filesystem (a bind remount changes per-mount flags only).
    RemountBindReadOnly(PathBuf),
    /// Removes the topmost mount at the path.
    Unmount(PathBuf),
    RemoveDir(PathBuf),
}

impl MountAction {
    /// The path the action changes.
    pub fn path(&self) -> &Path {
        match self {
            Self::CreateDir(path) | Self::RemountBindReadOnly(path) | Self::Unmount(path) | Self::RemoveDir(path) => {
                path
            }
            Self::Bind { target, .. } => target,
        }
    }
}

impl fmt::Display for MountAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::CreateDir(path) => write!(f, "create directory {}", path.display()),
            Self::Bind { source, target } => {
                write!(f, "bind-mount {} onto {}", source.display(), target.display())
            }
            Self::RemountBindReadOnly(path) => write!(f, "remount {} read-only", path.display()),
            Self::Unmount(path) => write!(f, "unmount {}", path.display()),
            Self::RemoveDir(path) => write!(f, "remove directory {}", path.display()),
        }
    }
}

/// What a directory is, independent of the path it is reached by: a bind mount of a source
/// directory shows the source's identity at its mount point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SourceIdentity {
    pub major: u32,
    pub minor: u32,
    pub ino: u64,
}

/// Stats `path` (following symlinks) for its device and inode.
pub fn identify(path: &Path) -> io::Result<SourceIdentity> {
    let stat = nix::sys::stat::stat(path)?;
    let part = |value: u64| {
        u32::try_from(value).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("device number of {} does not fit 32 bits", path.display()),
            )
        })
    };
    Ok(SourceIdentity {
        major: part(nix::sys::stat::major(stat.st_dev))?,
        minor: part(nix::sys::stat::minor(stat.st_dev))?,
        ino: stat.st_ino,
    })
}

/// Why a bind cannot be planned onto a target that already has a mount.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    #[error("the volume is already mounted there {}", access(*mounted_read_only))]
    AccessMode { mounted_read_only: bool },
    #[error("{fs_type} from {mount_source} (root {}) is mounted there", root.display())]
    OtherMount { fs_type: String, mount_source: String, root: PathBuf },
    /// The target could not be stat'ed, e.g. a stale network mount.
    #[error("{fs_type} from {mount_source} is mounted there and cannot be inspected")]
    Unidentified { fs_type: String, mount_source: String },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The CSI layer answers ALREADY_EXISTS: the target is in use in a way this request did not
    /// ask for.
    #[error(
        "cannot bind-mount {} onto {} {}: {conflict}",
        source_path.display(),
        target.display(),
        access(*read_only)
    )]
    Incompatible { source_path: PathBuf, target: PathBuf, read_only: bool, conflict: Conflict },
}

fn access(read_only: bool) -> &'static str {
    if read_only { "read-only" } else { "read-write" }
}

/// Plans binding `source` (whose identity is `source_identity`) onto `target`.
///
/// `mounts` is the current mount table; `target_identity` and `target_exists` are what stat'ing
/// `target` found (`None` identity when it does not exist or cannot be stat'ed). `target` must be
/// spelled as the mount table spells it (absolute, no symlinks).
///
/// The bind is recognised by identity rather than by the mount table's root string, which is
/// relative to the filesystem and differs between a bind of the volume and a bind of a bind.
pub fn plan_bind(
    mounts: &[MountEntry],
    source: &Path,
    source_identity: &SourceIdentity,
    target: &Path,
    target_identity: Option<SourceIdentity>,
    target_exists: bool,
    read_only: bool,
) -> Result<Vec<MountAction>, PlanError> {
    // With stacked mounts the last one is what the target path shows.
    let Some(top) = mountinfo::mounts_at(mounts, target).last().copied() else {
        let mut plan = Vec::with_capacity(3);
        if !target_exists {
            plan.push(MountAction::CreateDir(target.to_path_buf()));
        }
        plan.push(MountAction::Bind { source: source.to_path_buf(), target: target.to_path_buf() });
        if read_only {
            plan.push(MountAction::RemountBindReadOnly(target.to_path_buf()));
        }
        return Ok(plan);
    };

    let conflict = match target_identity {
        // The per-mount flag, not `is_read_only`: a writable bind of a read-only filesystem was
        // asked for and made as writable, and must stay "already done" on the next call.
        Some(found) if found == *source_identity => {
            if top.has_read_only_flag() == read_only {
                return Ok(Vec::new());
            }
            Conflict::AccessMode { mounted_read_only: top.has_read_only_flag() }
        }
        Some(_) => Conflict::OtherMount {
            fs_type: top.fs_type.clone(),
            mount_source: top.source.clone(),
            root: top.root.clone(),
        },
        None => Conflict::Unidentified { fs_type: top.fs_type.clone(), mount_source: top.source.clone() },
    };
    Err(PlanError::Incompatible {
        source_path: source.to_path_buf(),
        target: target.to_path_buf(),
        read_only,
        conflict,
    })
}

/// Where the file or directory at `path` shows in the mount table: the device of its filesystem
/// and its path inside that filesystem (what mountinfo writes as a bind mount's root). A mount
/// point is its top mount's root; any other path is reached through the deepest mount above it.
/// `None` when no mount contains `path` (a relative path).
pub fn locate(mounts: &[MountEntry], path: &Path) -> Option<(u32, u32, PathBuf)> {
    if let Some(top) = mountinfo::mounts_at(mounts, path).last() {
        return Some((top.major, top.minor, top.root.clone()));
    }
    // The deepest mount point above `path`; of several stacked there, the last (the top).
    let above = mounts
        .iter()
        .filter(|e| path.starts_with(&e.mount_point))
        .max_by_key(|e| e.mount_point.components().count())?;
    let rest = path.strip_prefix(&above.mount_point).ok()?;
    Some((above.major, above.minor, above.root.join(rest)))
}

/// The mount points, other than `source` itself and `except`, that show the same file or
/// directory as `source`: where a volume staged at `source` (or exposed as the device node
/// `source`) is published besides `except`. Read from the mount table alone, so a plugin that
/// restarted sees what its predecessor published. Oldest first, each once.
pub fn other_binds<'a>(mounts: &'a [MountEntry], source: &Path, except: &Path) -> Vec<&'a Path> {
    let Some((major, minor, root)) = locate(mounts, source) else { return Vec::new() };
    let mut found: Vec<&Path> = Vec::new();
    for e in mounts.iter().filter(|e| e.major == major && e.minor == minor && e.root == root) {
        let point = e.mount_point.as_path();
        if point != source && point != except && !found.contains(&point) {
            found.push(point);
        }
    }
    found
}

/// Plans removing every mount stacked at `target` and then, when `remove_dir`, the directory
/// itself (kubelet expects a publish target gone after unpublish; a staging path stays).
pub fn plan_unmount(mounts: &[MountEntry], target: &Path, target_exists: bool, remove_dir: bool) -> Vec<MountAction> {
    let stacked = mountinfo::mounts_at(mounts, target).len();
    let mut plan = vec![MountAction::Unmount(target.to_path_buf()); stacked];
    // A mounted target exists even when stat'ing it failed (a stale mount answers ENOTCONN).
    if remove_dir && (target_exists || stacked > 0) {
        plan.push(MountAction::RemoveDir(target.to_path_buf()));
    }
    plan
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("cannot {action}")]
    Step {
        action: MountAction,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Something this plan mounted or created is still there.
    #[error("{failed}; rolling back failed too: {rollback}")]
    RollbackFailed {
        #[source]
        failed: Box<MountError>,
        rollback: Box<MountError>,
    },
}

impl MountError {
    pub fn step(action: &MountAction, source: io::Error) -> Self {
        Self::Step { action: action.clone(), path: action.path().to_path_buf(), source }
    }

    /// The step that failed first.
    pub fn action(&self) -> &MountAction {
        match self {
            Self::Step { action, .. } => action,
            Self::RollbackFailed { failed, .. } => failed.action(),
        }
    }

    /// The path the first failed step was changing.
    pub fn path(&self) -> &Path {
        match self {
            Self::Step { path, .. } => path,
            Self::RollbackFailed { failed, .. } => failed.path(),
        }
    }
}

/// Carries out single [`MountAction`]s. A trait so that the executor's rollback can be tested
/// with injected failures and the node service can run without privileges in tests.
pub trait MountSystem: Send + Sync {
    fn apply(&self, action: &MountAction) -> Result<(), MountError>;
}

/// The real kernel, through mount(2)/umount2(2). Needs CAP_SYS_ADMIN in the mount namespace.
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelMounts;

/// How often, and how far apart, an unmount that fails with EBUSY is retried before detaching.
const BUSY_UNMOUNT_ATTEMPTS: u32 = 5;
const BUSY_UNMOUNT_DELAY: Duration = Duration::from_millis(100);

impl MountSystem for KernelMounts {
    fn apply(&self, action: &MountAction) -> Result<(), MountError> {
        tracing::debug!(%action, "applying mount action");
        let result = match action {
            MountAction::CreateDir(path) => std::fs::DirBuilder::new().recursive(true).mode(0o750).create(path),
            MountAction::Bind { source, target } => nix::mount::mount(
                Some(source.as_path()),
                target.as_path(),
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(io::Error::from),
            MountAction::RemountBindReadOnly(path) => remount_bind_read_only(path),
            MountAction::Unmount(path) => unmount(path),
            MountAction::RemoveDir(path) => match std::fs::remove_dir(path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                other => other,
            },
        };
        result.map_err(|source| MountError::step(action, source))
    }
}

fn remount_bind_read_only(path: &Path) -> io::Result<()> {
    // A bind remount sets the per-mount flags to exactly those given: MS_RDONLY alone would
    // silently clear nosuid/nodev/noexec inherited from the source mount (observed on 6.18),
    // and inside a user namespace clearing such locked flags fails with EPERM. So carry them.
    // Atime flags need no care: the kernel preserves them when none is given.
    let current = nix::sys::statvfs::statvfs(path)?.flags();
    let mut flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
    for (kept, flag) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
    ] {
        if current.contains(kept) {
            flags |= flag;
        }
    }
    nix::mount::mount(None::<&str>, path, None::<&str>, flags, None::<&str>)?;
    Ok(())
}

/// Unmounts the topmost mount at `path`; "not mounted" counts as done.
///
/// EBUSY means something still holds a file or working directory on this mount. Kubelet calls
/// unpublish/unstage only after the pod's containers are gone, so what remains is transient (a
/// runtime shim exiting, a stats scan): a few short retries absorb it. If it persists, a lazy
/// detach (MNT_DETACH) removes the mount from the namespace at once so the call can succeed and
/// the pod can terminate, instead of kubelet retrying forever. That is safe here because a bind
/// mount has no device of its own to flush or release: the remaining holders keep writing into
/// the volume directory and the kernel drops the mount when they let go. It is not safe for a
/// filesystem on a block device, which is why the attachers of block-backed kinds (rbd) unmount
/// their filesystems their own way and leave only bind mounts to this executor.
fn unmount(path: &Path) -> io::Result<()> {
    for attempt in 1..=BUSY_UNMOUNT_ATTEMPTS {
        match nix::mount::umount2(path, MntFlags::empty()) {
            Ok(()) => return Ok(()),
            // EINVAL: not a mount point (any more); ENOENT: the path is gone. Either way the
            // mount this action was planned against is not there.
            Err(Errno::EINVAL | Errno::ENOENT) => return Ok(()),
            Err(Errno::EBUSY) if attempt < BUSY_UNMOUNT_ATTEMPTS => {
                std::thread::sleep(BUSY_UNMOUNT_DELAY);
            }
            Err(Errno::EBUSY) => break,
            Err(e) => return Err(e.into()),
        }
    }
    tracing::warn!(
        path = %path.display(),
        attempts = BUSY_UNMOUNT_ATTEMPTS,
        "mount still busy, detaching lazily"
    );
    nix::mount::umount2(path, MntFlags::MNT_DETACH)?;
    Ok(())
}

/// Runs `plan` in order. If a step fails, what this plan created (directories, bind mounts) is
/// undone in reverse order, so a failed attachment leaves the node as it was. Unmounts and
/// removals are not undone: re-running an unmount plan finishes the job.
pub fn execute(sys: &dyn MountSystem, plan: &[MountAction]) -> Result<(), MountError> {
    let mut undo = Vec::new();
    for action in plan {
        if let Err(failed) = sys.apply(action) {
            return Err(roll_back(sys, &undo, failed));
        }
        match action {
            MountAction::CreateDir(path) => undo.push(MountAction::RemoveDir(path.clone())),
            MountAction::Bind { target, .. } => undo.push(MountAction::Unmount(target.clone())),
            MountAction::RemountBindReadOnly(_) | MountAction::Unmount(_) | MountAction::RemoveDir(_) => {}
        }
    }
    Ok(())
}

fn roll_back(sys: &dyn MountSystem, undo: &[MountAction], failed: MountError) -> MountError {
    let mut first_rollback_error = None;
    // Keep going after a failed undo step: the others may still succeed and leave less behind.
    for action in undo.iter().rev() {
        if let Err(e) = sys.apply(action) {
            first_rollback_error.get_or_insert(e);
        }
    }
    match first_rollback_error {
        None => failed,
        Some(rollback) => MountError::RollbackFailed { failed: Box::new(failed), rollback: Box::new(rollback) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::sandbox::Sandbox;
    use std::sync::Mutex;

    const KUBELET_NODE: &str = include_str!("../../../mountinfo/tests/fixtures/kubelet-node.txt");
    const STACKED: &str = include_str!("../../../mountinfo/tests/fixtures/stacked.txt");

    const VOLUME_DIR: &str = "/var/lib/wasmcsi/volumes/pvc-3f1c9a2e-8b7d-4c6e-a5f4-0b1c2d3e4f5a";
    const STAGING: &str = "/var/lib/kubelet/plugins/kubernetes.io/csi/wasmcsi.example.io/\
        9c2e51b7f0a4d8e3c6b1a7f2e9d4c5b8a3f6e1d0c7b2a9f4e8d3c6b1a5f0e9d2/globalmount";
    const PUBLISHED_RO: &str = "/var/lib/kubelet/pods/7d0b6c2e-4a51-4f0e-9c6b-1e2d3f4a5b6c/\
        volumes/kubernetes.io~csi/pvc-3f1c9a2e-8b7d-4c6e-a5f4-0b1c2d3e4f5a/mount";
    const PUBLISHED_RW: &str = "/var/lib/kubelet/pods/a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d/\
        volumes/kubernetes.io~csi/pvc-3f1c9a2e-8b7d-4c6e-a5f4-0b1c2d3e4f5a/mount";
    const UNPUBLISHED: &str = "/var/lib/kubelet/pods/ffffffff-0000-4000-8000-000000000000/\
        volumes/kubernetes.io~csi/pvc-3f1c9a2e-8b7d-4c6e-a5f4-0b1c2d3e4f5a/mount";
    const STACKED_TARGET: &str = "/var/lib/kubelet/pods/0a1b2c3d-0000-4000-8000-000000000001/\
        volumes/kubernetes.io~csi/pvc-aa11/mount";

    /// The volume directory's identity, shown by every bind of it.
    const VOLUME: SourceIdentity = SourceIdentity { major: 8, minor: 1, ino: 917_505 };
    const ELSEWHERE: SourceIdentity = SourceIdentity { major: 0, minor: 70, ino: 1 };

    fn fixture(text: &str) -> Vec<MountEntry> {
        match mountinfo::parse(text) {
            Ok(entries) => entries,
            Err(e) => panic!("fixture must parse: {e}"),
        }
    }

    fn path(p: &str) -> PathBuf {
        PathBuf::from(p)
    }

    // ---- other_binds --------------------------------------------------------------------------

    #[test]
    fn other_binds_are_the_other_publishes_of_the_staged_volume() {
        let mounts = fixture(KUBELET_NODE);
        let staging = Path::new(STAGING);
        assert_eq!(other_binds(&mounts, staging, Path::new(PUBLISHED_RO)), [Path::new(PUBLISHED_RW)]);
        assert_eq!(
            other_binds(&mounts, staging, Path::new(UNPUBLISHED)),
            [Path::new(PUBLISHED_RO), Path::new(PUBLISHED_RW)]
        );
        // Not the staging path itself, nor binds of other directories of the same disk.
        assert!(
            other_binds(&mounts, staging, Path::new(UNPUBLISHED))
                .iter()
                .all(|p| *p != staging && !p.ends_with("rootfs"))
        );
    }

    #[test]
    fn other_binds_of_an_unpublished_volume_are_none() {
        let mounts = fixture(KUBELET_NODE);
        let tmpfs_staging = "/var/lib/kubelet/plugins/kubernetes.io/csi/wasmcsi.example.io/\
            0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0/globalmount";
        assert_eq!(other_binds(&mounts, Path::new(tmpfs_staging), Path::new(UNPUBLISHED)), Vec::<&Path>::new());
    }

    #[test]
    fn a_device_node_is_located_inside_its_devtmpfs_and_found_where_bound() {
        let text = format!(
            "{KUBELET_NODE}\n400 22 0:5 /loop7 /var/lib/kubelet/pods/p1/volumeDevices/kubernetes.io~csi/pvc-b rw,relatime shared:2 - devtmpfs udev rw\n"
        );
        let mounts = fixture(&text);
        let device = Path::new("/dev/loop7");
        assert_eq!(locate(&mounts, device), Some((0, 5, path("/loop7"))));
        let bound = Path::new("/var/lib/kubelet/pods/p1/volumeDevices/kubernetes.io~csi/pvc-b");
        assert_eq!(other_binds(&mounts, device, Path::new("/var/lib/kubelet/pods/p2/dev")), [bound]);
        assert_eq!(other_binds(&mounts, device, bound), Vec::<&Path>::new(), "the same target is not another");
        assert_eq!(other_binds(&mounts, Path::new("/dev/loop8"), Path::new("/x")), Vec::<&Path>::new());
    }

    // ---- plan_bind ----------------------------------------------------------------------------

    #[test]
    fn publish_plan_is_empty_when_already_bind_mounted() {
        let mounts = fixture(KUBELET_NODE);
        let ro = plan_bind(&mounts, Path::new(STAGING), &VOLUME, Path::new(PUBLISHED_RO), Some(VOLUME), true, true);
        assert_eq!(ro, Ok(vec![]));
        let rw = plan_bind(&mounts, Path::new(STAGING), &VOLUME, Path::new(PUBLISHED_RW), Some(VOLUME), true, false);
        assert_eq!(rw, Ok(vec![]));
    }

    #[test]
    fn stage_plan_is_empty_when_volume_dir_already_bound() {
        let mounts = fixture(KUBELET_NODE);
        let plan = plan_bind(&mounts, Path::new(VOLUME_DIR), &VOLUME, Path::new(STAGING), Some(VOLUME), true, false);
        assert_eq!(plan, Ok(vec![]));
    }

    #[test]
    fn publish_plan_creates_binds_and_remounts_when_nothing_is_mounted() {
        let mounts = fixture(KUBELET_NODE);
        let plan = plan_bind(&mounts, Path::new(STAGING), &VOLUME, Path::new(UNPUBLISHED), None, false, true);
        assert_eq!(
            plan,
            Ok(vec![
                MountAction::CreateDir(path(UNPUBLISHED)),
                MountAction::Bind { source: path(STAGING), target: path(UNPUBLISHED) },
                MountAction::RemountBindReadOnly(path(UNPUBLISHED)),
            ])
        );
    }

    #[test]
    fn read_write_plan_only_binds_onto_an_existing_directory() {
        let mounts = fixture(KUBELET_NODE);
        // The unmounted directory shows its own identity, not the volume's.
        let plan =
            plan_bind(&mounts, Path::new(STAGING), &VOLUME, Path::new(UNPUBLISHED), Some(ELSEWHERE), true, false);
        assert_eq!(plan, Ok(vec![MountAction::Bind { source: path(STAGING), target: path(UNPUBLISHED) }]));
    }

    #[test]
    fn publish_plan_is_empty_for_a_writable_bind_of_a_read_only_filesystem() {
        // Writes fail through this mount, but only because of the superblock: the writable bind
        // that was asked for is what is there.
        let mounts = fixture("90 22 7:0 /vol /t rw,relatime - squashfs /dev/loop0 ro\n");
        let plan = plan_bind(&mounts, Path::new("/s"), &VOLUME, Path::new("/t"), Some(VOLUME), true, false);
        assert_eq!(plan, Ok(vec![]));
    }

    #[test]
    fn publish_plan_rejects_the_same_volume_with_another_access_mode() {
        let mounts = fixture(KUBELET_NODE);
        let plan = plan_bind(&mounts, Path::new(STAGING), &VOLUME, Path::new(PUBLISHED_RO), Some(VOLUME), true, false);
        assert_eq!(
            plan,
            Err(PlanError::Incompatible {
                source_path: path(STAGING),
                target: path(PUBLISHED_RO),
                read_only: false,
                conflict: Conflict::AccessMode { mounted_read_only: true },
            })
        );
    }

    #[test]
    fn publish_plan_rejects_another_mount_at_the_target() {
        let mounts = fixture(KUBELET_NODE);
        let other_volume = SourceIdentity { ino: 42, ..VOLUME };
        let plan =
            plan_bind(&mounts, Path::new(STAGING), &other_volume, Path::new(PUBLISHED_RO), Some(VOLUME), true, true);
        let Err(PlanError::Incompatible { conflict: Conflict::OtherMount { fs_type, root, .. }, .. }) = &plan else {
            panic!("expected another mount in the way, got {plan:?}");
        };
        assert_eq!(fs_type, "ext4");
        assert_eq!(root, Path::new(VOLUME_DIR));
    }

    #[test]
    fn publish_plan_rejects_a_mount_that_cannot_be_inspected() {
        let mounts = fixture(KUBELET_NODE);
        let plan = plan_bind(&mounts, Path::new(STAGING), &VOLUME, Path::new(PUBLISHED_RO), None, true, true);
        assert!(
            matches!(&plan, Err(PlanError::Incompatible { conflict: Conflict::Unidentified { .. }, .. })),
            "{plan:?}"
        );
    }

    #[test]
    fn publish_plan_judges_the_topmost_of_stacked_mounts() {
        let mounts = fixture(STACKED);
        // The volume's ro bind is buried under a tmpfs: the target shows the tmpfs.
        let plan =
            plan_bind(&mounts, Path::new(STAGING), &VOLUME, Path::new(STACKED_TARGET), Some(ELSEWHERE), true, true);
        assert!(
            matches!(
                &plan,
                Err(PlanError::Incompatible { conflict: Conflict::OtherMount { fs_type, .. }, .. })
                    if fs_type == "tmpfs"
            ),
            "{plan:?}"
        );
    }

    #[test]
    fn plan_error_names_source_target_and_conflict() {
        let err = PlanError::Incompatible {
            source_path: path("/a"),
            target: path("/b"),
            read_only: false,
            conflict: Conflict::AccessMode { mounted_read_only: true },
        };
        assert_eq!(
            err.to_string(),
            "cannot bind-mount /a onto /b read-write: the volume is already mounted there read-only"
        );
    }

    // ---- plan_unmount -------------------------------------------------------------------------

    #[test]
    fn unpublish_plan_unmounts_then_removes_the_target() {
        let mounts = fixture(KUBELET_NODE);
        assert_eq!(
            plan_unmount(&mounts, Path::new(PUBLISHED_RO), true, true),
            [MountAction::Unmount(path(PUBLISHED_RO)), MountAction::RemoveDir(path(PUBLISHED_RO)),]
        );
    }

    #[test]
    fn unstage_plan_keeps_the_staging_directory() {
        let mounts = fixture(KUBELET_NODE);
        assert_eq!(plan_unmount(&mounts, Path::new(STAGING), true, false), [MountAction::Unmount(path(STAGING))]);
    }

    #[test]
    fn unmount_plan_unmounts_every_stacked_mount() {
        let mounts = fixture(STACKED);
        assert_eq!(
            plan_unmount(&mounts, Path::new(STACKED_TARGET), true, true),
            [
                MountAction::Unmount(path(STACKED_TARGET)),
                MountAction::Unmount(path(STACKED_TARGET)),
                MountAction::RemoveDir(path(STACKED_TARGET)),
            ]
        );
    }

    #[test]
    fn unmount_plan_is_empty_when_nothing_is_mounted_and_no_directory_exists() {
        let mounts = fixture(KUBELET_NODE);
        assert_eq!(plan_unmount(&mounts, Path::new(UNPUBLISHED), false, true), []);
    }

    #[test]
    fn unmount_plan_removes_a_left_over_directory() {
        let mounts = fixture(KUBELET_NODE);
        assert_eq!(
            plan_unmount(&mounts, Path::new(UNPUBLISHED), true, true),
            [MountAction::RemoveDir(path(UNPUBLISHED))]
        );
    }

    #[test]
    fn unmount_plan_removes_a_mounted_directory_that_could_not_be_stated() {
        let mounts = fixture(KUBELET_NODE);
        assert_eq!(
            plan_unmount(&mounts, Path::new(PUBLISHED_RW), false, true),
            [MountAction::Unmount(path(PUBLISHED_RW)), MountAction::RemoveDir(path(PUBLISHED_RW)),]
        );
    }

    // ---- execute, with a recording fake -------------------------------------------------------

    /// Records every action and fails the ones listed in `failing`.
    #[derive(Default)]
    struct RecordingMounts {
        failing: Vec<MountAction>,
        applied: Mutex<Vec<MountAction>>,
    }

    impl RecordingMounts {
        fn failing(failing: Vec<MountAction>) -> Self {
            Self { failing, ..Self::default() }
        }

        fn applied(&self) -> Vec<MountAction> {
            match self.applied.lock() {
                Ok(applied) => applied.clone(),
                Err(poisoned) => poisoned.into_inner().clone(),
            }
        }
    }

    impl MountSystem for RecordingMounts {
        fn apply(&self, action: &MountAction) -> Result<(), MountError> {
            match self.applied.lock() {
                Ok(mut applied) => applied.push(action.clone()),
                Err(poisoned) => poisoned.into_inner().push(action.clone()),
            }
            if self.failing.contains(action) {
                return Err(MountError::step(action, io::Error::from_raw_os_error(5)));
            }
            Ok(())
        }
    }

    fn publish_plan() -> Vec<MountAction> {
        vec![
            MountAction::CreateDir(path("/t")),
            MountAction::Bind { source: path("/s"), target: path("/t") },
            MountAction::RemountBindReadOnly(path("/t")),
        ]
    }

    #[test]
    fn execute_applies_every_step_in_order() {
        let sys = RecordingMounts::default();
        let result = execute(&sys, &publish_plan());
        assert!(result.is_ok(), "{result:?}");
        assert_eq!(sys.applied(), publish_plan());
    }

    #[test]
    fn execute_rolls_back_bind_and_created_dir_when_a_later_step_fails() {
        let remount = MountAction::RemountBindReadOnly(path("/t"));
        let sys = RecordingMounts::failing(vec![remount.clone()]);
        let result = execute(&sys, &publish_plan());

        let mut expected = publish_plan();
        expected.extend([MountAction::Unmount(path("/t")), MountAction::RemoveDir(path("/t"))]);
        assert_eq!(sys.applied(), expected);
        match result {
            Err(err @ MountError::Step { .. }) => {
                assert_eq!(err.action(), &remount);
                assert_eq!(err.path(), Path::new("/t"));
                assert_eq!(err.to_string(), "cannot remount /t read-only");
            }
            other => panic!("expected the remount's error, got {other:?}"),
        }
    }

    #[test]
    fn execute_rolls_back_nothing_when_the_first_step_fails() {
        let sys = RecordingMounts::failing(vec![MountAction::CreateDir(path("/t"))]);
        let result = execute(&sys, &publish_plan());
        assert!(matches!(result, Err(MountError::Step { .. })), "{result:?}");
        assert_eq!(sys.applied(), [MountAction::CreateDir(path("/t"))]);
    }

    #[test]
    fn execute_reports_a_failed_rollback_with_the_original_failure() {
        let sys = RecordingMounts::failing(vec![
            MountAction::RemountBindReadOnly(path("/t")),
            MountAction::Unmount(path("/t")),
        ]);
        let result = execute(&sys, &publish_plan());
        // The directory is still removed even though the unmount before it failed.
        assert_eq!(sys.applied().last(), Some(&MountAction::RemoveDir(path("/t"))));
        match result {
            Err(err @ MountError::RollbackFailed { .. }) => {
                assert_eq!(err.action(), &MountAction::RemountBindReadOnly(path("/t")));
                assert_eq!(err.to_string(), "cannot remount /t read-only; rolling back failed too: cannot unmount /t");
            }
            other => panic!("expected a rollback failure, got {other:?}"),
        }
    }

    #[test]
    fn execute_does_not_undo_unmounts_when_removing_the_directory_fails() {
        let plan = vec![
            MountAction::Unmount(path("/t")),
            MountAction::Unmount(path("/t")),
            MountAction::RemoveDir(path("/t")),
        ];
        let sys = RecordingMounts::failing(vec![MountAction::RemoveDir(path("/t"))]);
        let result = execute(&sys, &plan);
        assert!(matches!(result, Err(MountError::Step { .. })), "{result:?}");
        assert_eq!(sys.applied(), plan);
    }

    // ---- the real kernel ----------------------------------------------------------------------

    fn plan_bind_now(source: &Path, target: &Path, read_only: bool) -> Vec<MountAction> {
        let table = mountinfo::read_current().expect("read mount table");
        plan_bind(
            &table,
            source,
            &identify(source).expect("identify source"),
            target,
            identify(target).ok(),
            target.exists(),
            read_only,
        )
        .expect("plan bind")
    }

    fn plan_unmount_now(target: &Path, remove_dir: bool) -> Vec<MountAction> {
        let table = mountinfo::read_current().expect("read mount table");
        plan_unmount(&table, target, target.exists(), remove_dir)
    }

    #[test]
    fn read_only_publish_mounts_refuses_writes_and_unpublishes_cleanly() {
        let Some(sandbox) = Sandbox::new("read_only_publish_mounts_refuses_writes_and_unpublishes_cleanly") else {
            return;
        };
        let staging = sandbox.dir("staging");
        std::fs::write(staging.join("data"), "hello").expect("write volume file");
        let target = sandbox.root.join("pods/uid/mount");

        let plan = plan_bind_now(&staging, &target, true);
        assert_eq!(plan.len(), 3, "{plan:?}");
        execute(&KernelMounts, &plan).expect("publish");

        let mounted = sandbox.mounts_at(&target);
        assert_eq!(mounted.len(), 1, "{mounted:?}");
        assert!(mounted[0].has_read_only_flag(), "{mounted:?}");
        assert_eq!(identify(&target).ok(), identify(&staging).ok());
        assert_eq!(std::fs::read_to_string(target.join("data")).expect("read through the mount"), "hello");
        let write = std::fs::write(target.join("new"), "x");
        assert_eq!(write.as_ref().map_err(io::Error::raw_os_error), Err(Some(Errno::EROFS as i32)), "{write:?}");

        assert_eq!(plan_bind_now(&staging, &target, true), [], "publish is idempotent");

        let unpublish = plan_unmount_now(&target, true);
        assert_eq!(unpublish, [MountAction::Unmount(target.clone()), MountAction::RemoveDir(target.clone()),]);
        execute(&KernelMounts, &unpublish).expect("unpublish");
        assert!(sandbox.mounts_at(&target).is_empty());
        assert!(!target.exists());
        assert!(staging.join("data").exists(), "the volume keeps its data");
        assert_eq!(plan_unmount_now(&target, true), [], "unpublish is idempotent");
    }

    #[test]
    fn read_write_stage_passes_writes_and_refuses_a_read_only_repeat() {
        let Some(sandbox) = Sandbox::new("read_write_stage_passes_writes_and_refuses_a_read_only_repeat") else {
            return;
        };
        let volume = sandbox.dir("volume");
        let staging = sandbox.dir("globalmount");

        let plan = plan_bind_now(&volume, &staging, false);
        assert_eq!(plan, [MountAction::Bind { source: volume.clone(), target: staging.clone() }]);
        execute(&KernelMounts, &plan).expect("stage");
        std::fs::write(staging.join("written"), "through").expect("write through the bind");
        assert!(volume.join("written").exists());

        let table = mountinfo::read_current().expect("read mount table");
        let repeat = plan_bind(
            &table,
            &volume,
            &identify(&volume).expect("identify volume"),
            &staging,
            identify(&staging).ok(),
            true,
            true,
        );
        assert!(
            matches!(
                repeat,
                Err(PlanError::Incompatible { conflict: Conflict::AccessMode { mounted_read_only: false }, .. })
            ),
            "{repeat:?}"
        );

        execute(&KernelMounts, &plan_unmount_now(&staging, false)).expect("unstage");
        assert!(sandbox.mounts_at(&staging).is_empty());
        assert!(staging.is_dir(), "the staging directory stays");
    }

    /// The kernel, except that one kind of step fails.
    struct FailingRemount;

    impl MountSystem for FailingRemount {
        fn apply(&self, action: &MountAction) -> Result<(), MountError> {
            if let MountAction::RemountBindReadOnly(_) = action {
                return Err(MountError::step(action, io::Error::from_raw_os_error(5)));
            }
            KernelMounts.apply(action)
        }
    }

    #[test]
    fn failed_remount_leaves_no_mount_and_no_directory_behind() {
        let Some(sandbox) = Sandbox::new("failed_remount_leaves_no_mount_and_no_directory_behind") else {
            return;
        };
        let staging = sandbox.dir("staging");
        let target = sandbox.root.join("pods/uid/mount");

        let result = execute(&FailingRemount, &plan_bind_now(&staging, &target, true));
        assert!(matches!(&result, Err(e) if matches!(e.action(), MountAction::RemountBindReadOnly(_))), "{result:?}");
        assert!(sandbox.mounts_at(&target).is_empty());
        assert!(!target.exists());
    }

    #[test]
    fn bind_plan_refuses_a_foreign_mount_at_the_target() {
        let Some(sandbox) = Sandbox::new("bind_plan_refuses_a_foreign_mount_at_the_target") else {
            return;
        };
        let staging = sandbox.dir("staging");
        let target = sandbox.dir("mount");
        sandbox.mount_tmpfs(&target, MsFlags::empty());

        let table = mountinfo::read_current().expect("read mount table");
        let plan = plan_bind(
            &table,
            &staging,
            &identify(&staging).expect("identify staging"),
            &target,
            identify(&target).ok(),
            true,
            false,
        );
        assert!(
            matches!(
                &plan,
                Err(PlanError::Incompatible { conflict: Conflict::OtherMount { fs_type, .. }, .. })
                    if fs_type == "tmpfs"
            ),
            "{plan:?}"
        );
    }

    #[test]
    fn unmount_plan_clears_stacked_bind_mounts() {
        let Some(sandbox) = Sandbox::new("unmount_plan_clears_stacked_bind_mounts") else {
            return;
        };
        let staging = sandbox.dir("staging");
        let target = sandbox.dir("mount");
        let bind = MountAction::Bind { source: staging.clone(), target: target.clone() };
        execute(&KernelMounts, &[bind.clone(), bind]).expect("stack two binds");
        assert_eq!(sandbox.mounts_at(&target).len(), 2);

        let plan = plan_unmount_now(&target, true);
        assert_eq!(plan.len(), 3, "{plan:?}");
        execute(&KernelMounts, &plan).expect("unmount the stack");
        assert!(sandbox.mounts_at(&target).is_empty());
        assert!(!target.exists());
    }

    #[test]
    fn busy_unmount_falls_back_to_a_lazy_detach() {
        let Some(sandbox) = Sandbox::new("busy_unmount_falls_back_to_a_lazy_detach") else {
            return;
        };
        let staging = sandbox.dir("staging");
        std::fs::write(staging.join("held"), "still readable").expect("write volume file");
        let target = sandbox.dir("mount");
        execute(&KernelMounts, &plan_bind_now(&staging, &target, false)).expect("bind");
        let held = std::fs::File::open(target.join("held")).expect("hold a file open");

        let busy = nix::mount::umount2(&target, MntFlags::empty());
        assert_eq!(busy, Err(Errno::EBUSY), "an open file keeps the mount busy");

        execute(&KernelMounts, &[MountAction::Unmount(target.clone())]).expect("unmount");
        assert!(sandbox.mounts_at(&target).is_empty());
        let mut text = String::new();
        io::Read::read_to_string(&mut &held, &mut text).expect("read the detached file");
        assert_eq!(text, "still readable");
    }

    #[test]
    fn unmounting_a_plain_directory_counts_as_done() {
        let Some(sandbox) = Sandbox::new("unmounting_a_plain_directory_counts_as_done") else {
            return;
        };
        let plain = sandbox.dir("plain");
        let missing = sandbox.root.join("missing");
        let result = execute(&KernelMounts, &[MountAction::Unmount(plain), MountAction::Unmount(missing.clone())]);
        assert!(result.is_ok(), "{result:?}");
        assert!(
            execute(&KernelMounts, &[MountAction::RemoveDir(missing)]).is_ok(),
            "removing a missing directory counts as done"
        );
    }

    #[test]
    fn read_only_remount_keeps_nosuid_nodev_noexec_of_the_source() {
        let Some(sandbox) = Sandbox::new("read_only_remount_keeps_nosuid_nodev_noexec_of_the_source") else {
            return;
        };
        let fs = sandbox.dir("fs");
        sandbox.mount_tmpfs(&fs, MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC);
        let volume = fs.join("volume");
        std::fs::create_dir(&volume).expect("create volume on tmpfs");
        let target = sandbox.root.join("mount");

        execute(&KernelMounts, &plan_bind_now(&volume, &target, true)).expect("publish");
        let mounted = sandbox.mounts_at(&target);
        let options = mounted.last().map(|e| e.mount_options.clone()).unwrap_or_default();
        for flag in ["ro", "nosuid", "nodev", "noexec"] {
            assert!(options.iter().any(|o| o == flag), "{flag} missing: {options:?}");
        }
    }
}
