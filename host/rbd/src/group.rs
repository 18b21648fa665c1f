//! Crash-consistent snapshots of several images at one point (WIT `rbd.group-snapshot`), as
//! ordinary snapshots that CreateVolume can clone.
//!
//! Why not librbd's groups: on Ceph 16.2 a group snapshot's image snapshots live in the group
//! namespace, and only `rbd_clone4` (Ceph 19) clones from a snapshot by id; restoring a member
//! would be a full copy. So the host takes the point itself, with the mechanism librbd's own
//! group snapshot uses: writes of an image need its exclusive lock, so while this host holds the
//! lock of every image no other client's write to any of them can complete, and one snapshot per
//! image taken then is one point of all of them. In order:
//!
//! ```text
//!   open every image (sorted by name: two group snapshots lock in the same order)
//!   all have `snap` already?  ── yes ──> the same group again: return them, nothing locked
//!   some have it?             ── yes ──> an interrupted attempt, not one point: remove them
//!   lock image 1 … image n    (each owner hands its lock over after its in-flight writes)
//!   snapshot image 1 … image n
//!   release every lock        (also on every error and on the deadline)
//! ```
//!
//! The writes are held from the first lock to the last release: that pause is measured and
//! logged. What a writer sees meanwhile is librbd's: its lock request is refused, so a write
//! that needs the lock during the pause fails with EROFS (a client that already waits for the
//! lock, or asks only after the release, just waits). The set of snapshots is a prefix of every
//! writer's acknowledged writes: a write acknowledged before another was issued is in every
//! snapshot that has the later one.
use crate::conn::Ioctx;
use crate::error::Target;
use crate::image::Image;
use crate::{ImageSnapshot, RbdError};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// What [`crate::RbdPool::group_snapshot`] took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSnapshot {
    /// Each image's snapshot, in the order the images were asked for.
    pub snapshots: Vec<ImageSnapshot>,
    /// How long other clients' writes were held (first lock taken to last lock released);
    /// `None` when every snapshot existed already and nothing was locked.
    pub pause: Option<Duration>,
}

/// The images of a group, checked: at least one, each once.
pub(crate) fn check_images(images: &[String]) -> Result<(), RbdError> {
    if images.is_empty() {
        return Err(RbdError::InvalidArgument("a group snapshot needs at least one image".into()));
    }
    let mut seen = BTreeSet::new();
    if let Some(twice) = images.iter().find(|i| !seen.insert(i.as_str())) {
        return Err(RbdError::InvalidArgument(format!("image {twice} is named twice in the group")));
    }
    Ok(())
}

/// An exclusive lock this host holds; released on drop (close would release it too, but an
/// explicit release is when the pause ends).
struct Held<'a> {
    t: &'a Target,
    name: &'a str,
    image: &'a Image,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.image.lock_release(self.t, self.name) {
            // The close that follows releases it as well.
            tracing::warn!(image = %self.name, error = %e, "releasing an exclusive lock failed");
        }
    }
}

fn has_snap(t: &Target, image: &Image, snap: &str) -> Result<bool, RbdError> {
    Ok(image.snap_list(t)?.iter().any(|s| s.name == snap))
}

/// Remove `name@snap` unless clones hang off it.
fn remove_unless_cloned(t: &Target, io: &Ioctx, name: &str, image: &Image, snap: &str) -> Result<(), RbdError> {
    let children = match io.open_read_only(t, name, Some(snap)) {
        Ok(at) => at.children(t)?,
        Err(RbdError::NotFound(_)) => return Ok(()),
        Err(e) => return Err(e),
    };
    if !children.is_empty() {
        return Err(RbdError::FailedPrecondition(format!(
            "snapshot {name}@{snap} has clones: {}",
            children.join(", ")
        )));
    }
    image.snap_remove(t, snap)
}

/// Take `snap` of every image in `images` at one point (see the module docs). Runs on a worker
/// thread; the locks are given up when `lock_deadline` passes before all are held.
pub(crate) fn take(
    t: &Target,
    io: &Ioctx,
    images: &[String],
    snap: &str,
    lock_deadline: Instant,
) -> Result<GroupSnapshot, RbdError> {
    check_images(images)?;
    let mut sorted: Vec<&str> = images.iter().map(String::as_str).collect();
    sorted.sort_unstable();
    let opened: Vec<(&str, Image)> =
        sorted.iter().map(|n| Ok((*n, io.open(t, n)?))).collect::<Result<_, RbdError>>()?;
    let lacking: Vec<&str> = opened
        .iter()
        .map(|(n, i)| Ok((!i.has_exclusive_lock(t)?).then_some(*n)))
        .collect::<Result<Vec<_>, RbdError>>()?
        .into_iter()
        .flatten()
        .collect();
    if !lacking.is_empty() {
        return Err(RbdError::FailedPrecondition(format!(
            "images without the exclusive-lock feature cannot be snapshotted at one point: {}",
            lacking.join(", ")
        )));
    }
    let existing: Vec<bool> = opened.iter().map(|(_, i)| has_snap(t, i, snap)).collect::<Result<_, _>>()?;
    let pause = if existing.iter().all(|e| *e) {
        None
    } else {
        // Snapshots of an interrupted attempt were not taken at one point with the others.
        for ((n, i), _) in opened.iter().zip(&existing).filter(|(_, e)| **e) {
            remove_unless_cloned(t, io, n, i, snap)?;
            tracing::info!(image = %n, snap, "removed the snapshot of an interrupted group snapshot");
        }
        Some(locked_snapshots(t, &opened, snap, lock_deadline)?)
    };
    let snapshots =
        images
            .iter()
            .map(|name| {
                let (_, image) = opened
                    .iter()
                    .find(|(n, _)| n == name)
                    .ok_or_else(|| RbdError::Internal(format!("image {name} of the group was not opened")))?;
                image.snap_list(t)?.into_iter().find(|s| s.name == snap).ok_or_else(|| {
                    RbdError::Internal(format!("snapshot {name}@{snap} missing right after its creation"))
                })
            })
            .collect::<Result<_, RbdError>>()?;
    Ok(GroupSnapshot { snapshots, pause })
}

/// Lock every image (in `opened`'s order), snapshot each, release: returns the pause. Any
/// failure removes the snapshots made so far and releases every lock before it returns.
fn locked_snapshots(t: &Target, opened: &[(&str, Image)], snap: &str, deadline: Instant) -> Result<Duration, RbdError> {
    let mut held: Vec<Held<'_>> = Vec::with_capacity(opened.len());
    let mut first: Option<Instant> = None;
    for (name, image) in opened {
        image.lock_acquire(t, name)?;
        first.get_or_insert_with(Instant::now);
        held.push(Held { t, name, image });
        if Instant::now() > deadline {
            drop(held);
            return Err(t.unavailable(format!(
                "the exclusive locks of the group's images were not all held by the deadline (stuck at {name}); \
                 released them, no snapshot taken"
            )));
        }
    }
    let mut made: Vec<&Held<'_>> = Vec::with_capacity(held.len());
    for h in &held {
        if let Err(e) = h.image.snap_create(t, snap) {
            for m in &made {
                if let Err(undo) = m.image.snap_remove(t, snap) {
                    tracing::warn!(image = %m.name, snap, error = %undo, "could not remove a snapshot of a failed group snapshot");
                }
            }
            return Err(e);
        }
        made.push(h);
    }
    drop(made);
    drop(held);
    let pause = first.map(|f| f.elapsed()).unwrap_or_default();
    Ok(pause)
}

/// Remove `snap` from every image of the pool that has it (see [`crate::RbdPool::group_snapshot_remove`]).
pub(crate) fn remove(t: &Target, io: &Ioctx, snap: &str) -> Result<Vec<String>, RbdError> {
    let mut having: Vec<(String, Image)> = Vec::new();
    for name in io.list(t)? {
        let image = match io.open(t, &name) {
            Ok(i) => i,
            Err(RbdError::NotFound(_)) => continue,
            Err(e) => return Err(e),
        };
        if has_snap(t, &image, snap)? {
            having.push((name, image));
        }
    }
    // Refused whole, before anything goes: no half-removed group.
    let mut cloned = Vec::new();
    for (name, _) in &having {
        if let Ok(at) = io.open_read_only(t, name, Some(snap)) {
            cloned.extend(at.children(t)?.into_iter().map(|c| format!("{c} (of {name}@{snap})")));
        }
    }
    if !cloned.is_empty() {
        return Err(RbdError::FailedPrecondition(format!("clones hang off the group snapshot: {}", cloned.join(", "))));
    }
    for (name, image) in &having {
        remove_unless_cloned(t, io, name, image, snap)?;
    }
    Ok(having.into_iter().map(|(n, _)| n).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_names_some_images_each_once() {
        assert!(matches!(check_images(&[]), Err(RbdError::InvalidArgument(_))));
        let twice = ["a".to_owned(), "b".to_owned(), "a".to_owned()];
        assert!(matches!(check_images(&twice), Err(RbdError::InvalidArgument(m)) if m.contains("image a")));
        assert!(check_images(&["b".to_owned(), "a".to_owned()]).is_ok());
    }
}
