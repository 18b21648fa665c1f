//! The paths a CO names for a volume on this node — NodePublishVolume's and
//! NodeUnpublishVolume's target, the volume path of NodeGetVolumeStats and NodeExpandVolume —
//! checked and spelled as the mount table spells them, before anything is mounted at or
//! measured under them:
//! - absolute only: a relative path would resolve against the plugin's working directory;
//! - the parent resolved, symlinks and `..` included (a relocated `/var/lib/kubelet` behind a
//!   symlink is common): the mount table shows canonical paths, so the planners compare those,
//!   and a retry finds the mount it made;
//! - the path itself never a symlink: a mount over a link lands on the link's destination,
//!   which the next call, given the link, would not find.
//!
//! Kubelet creates the parents of a target before the call; a parent still missing is created
//! later by the mount plan, so it is resolved as far as it exists and spelled out beyond that.
//! Blocking (stat, readlink): call it from a blocking task.
use std::io;
use std::path::{Component, Path, PathBuf};

use crate::error::{CsiError, CsiResult};

/// `path` as the mount table spells it, refused when it is a symlink. `field` names the request
/// field in errors.
pub fn resolve(field: &'static str, path: &Path) -> CsiResult<PathBuf> {
    let resolved = spell(field, path)?;
    let invalid = |why: &str| CsiError::Invalid(format!("{field} {}: {why}", path.display()));
    match std::fs::symlink_metadata(&resolved) {
        Ok(m) if m.file_type().is_symlink() => Err(invalid("is a symbolic link; a volume is never mounted over one")),
        Ok(_) => Ok(resolved),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(resolved),
        Err(e) => Err(CsiError::Internal(format!("{field} {}: {e}", path.display()))),
    }
}

/// `path` with its parent as the mount table spells it; the last component is not looked at
/// (NodeUnpublishVolume removes a symlink left at its target, never what it points to).
pub fn spell(field: &'static str, path: &Path) -> CsiResult<PathBuf> {
    let invalid = |why: &str| CsiError::Invalid(format!("{field} {}: {why}", path.display()));
    let path = absolute(field, path)?;
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(invalid("must name a file or directory below /"));
    };
    Ok(resolve_dir(parent).map_err(|e| invalid(&e))?.join(name))
}

/// `path`, refused unless it is absolute (a staging path: the attachers compare it, and rbd
/// records it, as kubelet spells it).
pub fn absolute<'a>(field: &'static str, path: &'a Path) -> CsiResult<&'a Path> {
    if path.is_absolute() {
        Ok(path)
    } else {
        Err(CsiError::Invalid(format!("{field} {}: must be an absolute path", path.display())))
    }
}

/// The canonical spelling of directory `dir` (absolute): canonicalized as far as it exists,
/// the missing rest appended, which may hold no `..` (there is nothing to resolve it against).
fn resolve_dir(dir: &Path) -> Result<PathBuf, String> {
    let mut missing = Vec::new();
    let mut existing = dir;
    loop {
        match existing.canonicalize() {
            Ok(canonical) => {
                let mut out = canonical;
                for part in missing.iter().rev() {
                    out.push(part);
                }
                return Ok(out);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("resolving {}: {e}", existing.display())),
        }
        let mut components = existing.components();
        match components.next_back() {
            Some(Component::Normal(part)) => missing.push(part.to_owned()),
            Some(Component::ParentDir) => {
                return Err(format!("{} does not exist to resolve `..` in", existing.display()));
            }
            _ => return Err(format!("{} cannot be resolved", existing.display())),
        }
        existing = components.as_path();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "test setup on a fresh tempdir")]
mod tests {
    use super::*;

    fn tree() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        std::fs::create_dir_all(root.join("real/pods")).unwrap();
        std::os::unix::fs::symlink(root.join("real"), root.join("kubelet")).unwrap();
        (dir, root)
    }

    fn invalid(r: CsiResult<PathBuf>) -> String {
        match r {
            Err(CsiError::Invalid(m)) => m,
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        }
    }

    #[test]
    fn a_relative_path_or_the_root_is_refused() {
        assert!(invalid(resolve("target_path", Path::new("pods/1/mount"))).contains("absolute"));
        assert!(invalid(resolve("target_path", Path::new("/"))).contains("below /"));
        assert!(invalid(resolve("target_path", Path::new("/a/.."))).contains("below /"));
    }

    #[test]
    fn a_symlinked_parent_is_spelled_canonically() {
        let (_dir, root) = tree();
        let target = root.join("kubelet/pods/mount");
        assert_eq!(resolve("target_path", &target).unwrap(), root.join("real/pods/mount"));
        let dotted = root.join("kubelet/pods/../pods/./mount");
        assert_eq!(resolve("target_path", &dotted).unwrap(), root.join("real/pods/mount"));
    }

    #[test]
    fn missing_parents_are_spelled_out_beyond_what_exists() {
        let (_dir, root) = tree();
        let target = root.join("kubelet/pods/uid/volumes/pv/mount");
        assert_eq!(resolve("target_path", &target).unwrap(), root.join("real/pods/uid/volumes/pv/mount"));
        let escape = root.join("kubelet/pods/uid/../../../etc/mount");
        assert!(invalid(resolve("target_path", &escape)).contains("`..`"));
    }

    #[test]
    fn a_target_that_is_a_symlink_is_refused_even_when_it_dangles() {
        let (_dir, root) = tree();
        std::os::unix::fs::symlink("/etc", root.join("real/pods/mount")).unwrap();
        assert!(invalid(resolve("target_path", &root.join("kubelet/pods/mount"))).contains("symbolic link"));
        std::os::unix::fs::symlink(root.join("nowhere"), root.join("real/pods/dangling")).unwrap();
        assert!(invalid(resolve("volume_path", &root.join("real/pods/dangling"))).contains("volume_path"));
    }

    #[test]
    fn an_unpublish_target_that_is_a_symlink_is_spelled_not_followed() {
        let (_dir, root) = tree();
        std::os::unix::fs::symlink("/etc", root.join("real/pods/mount")).unwrap();
        assert_eq!(spell("target_path", &root.join("kubelet/pods/mount")).unwrap(), root.join("real/pods/mount"));
        assert!(matches!(spell("target_path", Path::new("mount")), Err(CsiError::Invalid(_))));
        assert!(matches!(absolute("staging_target_path", Path::new("staging")), Err(CsiError::Invalid(_))));
    }
}
