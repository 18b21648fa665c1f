//! Crash-consistent snapshots of several images at one point (WIT `rbd.group-snapshot`): RBD
//! group snapshots, librbd's own.
//!
//! librbd takes a group snapshot by asking every image's lock owner for its exclusive lock,
//! blocking writes on all of them, snapshotting each, then letting writes go: another client's
//! write meanwhile *waits* (it is not refused, as it is while a client keeps the lock with
//! `rbd_lock_acquire`, which an earlier design here used: rbd-fuse writers got EIO). Each image's
//! part is a snapshot in librbd's group namespace; this host shows it to guests as
//! `GROUP@SNAP` ([`crate::names::SnapRef`]).
//!
//! An image can be in one RBD group only, and a guest wants many group snapshots of overlapping
//! sets of images. So the group is a record of one group snapshot, not a standing set: its images
//! are added, the snapshot taken, and the images taken out again at once. A member snapshot
//! outlives its image's membership (librbd keeps it; `rbd_group_snap_remove` still removes
//! it), and can be removed on its own by id. In order:
//!
//! ```text
//!   the group has `snap`, complete?  ── yes ──> the same request again: its members, as they are
//!   the group has `snap`, incomplete ── remove it (an interrupted attempt), take it again:
//!   create the group (exists: fine); images in it that are not asked for: out
//!   each image: in another group of this pool → out of that one (its snapshots stay), then in
//!   rbd_group_snap_create                  (writes wait for the whole of it: the pause, logged)
//!   every image out of the group
//! ```
//!
//! Restoring a member: Ceph 16.2 clones only ordinary snapshots (`rbd_clone4`, which clones
//! any snapshot by id, is Ceph 19), so a member is restored by a full copy ([`crate::copy`]).
#![allow(unsafe_code, reason = "calls librbd's group API (FFI)")]

use crate::conn::{Ioctx, cstring};
use crate::error::Target;
use crate::{ImageSnapshot, RbdError, ffi};
use std::collections::BTreeSet;
use std::ffi::{CStr, c_int};
use std::time::{Duration, Instant};

const ENOENT: c_int = nix::errno::Errno::ENOENT as c_int;
const EEXIST: c_int = nix::errno::Errno::EEXIST as c_int;
const ERANGE: c_int = nix::errno::Errno::ERANGE as c_int;
const ENOTEMPTY: c_int = nix::errno::Errno::ENOTEMPTY as c_int;

/// What [`crate::RbdPool::group_snapshot`] took.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSnapshot {
    /// Each image's part (named `GROUP@SNAP`), in the order the images were asked for.
    pub snapshots: Vec<ImageSnapshot>,
    /// How long `rbd_group_snap_create` held other clients' writes (at most); `None` when the
    /// group snapshot existed already.
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

fn owned(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: librbd's NUL-terminated strings, alive until its cleanup call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn check(t: &Target, ret: c_int, what: impl FnOnce() -> String) -> Result<(), RbdError> {
    if ret < 0 { Err(t.errno(ret, &what())) } else { Ok(()) }
}

/// The group's snapshots as (name, complete); `None` when the group does not exist.
fn snaps(t: &Target, io: &Ioctx, group: &str) -> Result<Option<Vec<(String, bool)>>, RbdError> {
    let g = cstring(group, "group")?;
    let size_of = std::mem::size_of::<ffi::rbd_group_snap_info_t>();
    let mut cap = 8usize;
    loop {
        let mut infos: Vec<ffi::rbd_group_snap_info_t> = Vec::with_capacity(cap);
        let mut n = cap;
        // SAFETY: room for `n` entries of the size given.
        let ret = unsafe { ffi::rbd_group_snap_list(io.handle, g.as_ptr(), infos.as_mut_ptr(), size_of, &mut n) };
        if ret == -ENOENT {
            return Ok(None);
        }
        if ret == -ERANGE {
            cap = n.max(cap * 2);
            continue;
        }
        check(t, ret, || format!("snapshots of group {group}"))?;
        let n = n.min(cap);
        // SAFETY: librbd filled `n` entries.
        unsafe { infos.set_len(n) };
        let out = infos.iter().map(|i| (owned(i.name), i.state == ffi::RBD_GROUP_SNAP_STATE_COMPLETE)).collect();
        // SAFETY: frees what librbd allocated for those entries, once.
        unsafe { ffi::rbd_group_snap_list_cleanup(infos.as_mut_ptr(), size_of, n) };
        return Ok(Some(out));
    }
}

/// The images in the group (of this pool).
fn images_of(t: &Target, io: &Ioctx, group: &str) -> Result<Vec<String>, RbdError> {
    let g = cstring(group, "group")?;
    let size_of = std::mem::size_of::<ffi::rbd_group_image_info_t>();
    let mut cap = 16usize;
    loop {
        let mut infos: Vec<ffi::rbd_group_image_info_t> = Vec::with_capacity(cap);
        let mut n = cap;
        // SAFETY: room for `n` entries of the size given.
        let ret = unsafe { ffi::rbd_group_image_list(io.handle, g.as_ptr(), infos.as_mut_ptr(), size_of, &mut n) };
        if ret == -ENOENT {
            return Ok(vec![]);
        }
        if ret == -ERANGE {
            cap = n.max(cap * 2);
            continue;
        }
        check(t, ret, || format!("images of group {group}"))?;
        let n = n.min(cap);
        // SAFETY: librbd filled `n` entries.
        unsafe { infos.set_len(n) };
        let pool = io.pool_id();
        let out = infos.iter().filter(|i| i.pool == pool).map(|i| owned(i.name)).collect();
        // SAFETY: frees what librbd allocated for those entries, once.
        unsafe { ffi::rbd_group_image_list_cleanup(infos.as_mut_ptr(), size_of, n) };
        return Ok(out);
    }
}

fn image_add(t: &Target, io: &Ioctx, group: &str, image: &str) -> Result<(), RbdError> {
    let (g, i) = (cstring(group, "group")?, cstring(image, "image")?);
    // SAFETY: live ioctx (group and image in the same pool), C strings.
    match unsafe { ffi::rbd_group_image_add(io.handle, g.as_ptr(), io.handle, i.as_ptr()) } {
        r if r == -EEXIST => Ok(()),
        r => check(t, r, || format!("adding image {image} to group {group}")),
    }
}

fn image_remove(t: &Target, io: &Ioctx, group: &str, image: &str) -> Result<(), RbdError> {
    let (g, i) = (cstring(group, "group")?, cstring(image, "image")?);
    // SAFETY: as above.
    match unsafe { ffi::rbd_group_image_remove(io.handle, g.as_ptr(), io.handle, i.as_ptr()) } {
        r if r == -ENOENT => Ok(()),
        r => check(t, r, || format!("taking image {image} out of group {group}")),
    }
}

/// Each image's part of `group@snap`, in `images` order; NotFound naming an image without one.
fn members(t: &Target, io: &Ioctx, group: &str, snap: &str, images: &[String]) -> Result<Vec<ImageSnapshot>, RbdError> {
    let name = format!("{group}@{snap}");
    images
        .iter()
        .map(|i| {
            io.open_read_only(t, i, None)?
                .snap_list(t, io.pool_id())?
                .into_iter()
                .find(|s| s.name == name)
                .ok_or_else(|| RbdError::NotFound(format!("image {i} has no part in group snapshot {name}")))
        })
        .collect()
}

/// Take `group@snap` of `images` (checked by the caller) as the module docs say.
pub(crate) fn take(
    t: &Target,
    io: &Ioctx,
    group: &str,
    images: &[String],
    snap: &str,
) -> Result<GroupSnapshot, RbdError> {
    match snaps(t, io, group)?.unwrap_or_default().into_iter().find(|(n, _)| n == snap) {
        Some((_, true)) => {
            // The same request again; its images must be the ones asked for.
            let found = members(t, io, group, snap, images).map_err(|e| match e {
                RbdError::NotFound(m) => {
                    RbdError::AlreadyExists(format!("group snapshot {group}@{snap} exists with other images: {m}"))
                }
                e => e,
            })?;
            for i in images_of(t, io, group)? {
                image_remove(t, io, group, &i)?;
            }
            return Ok(GroupSnapshot { snapshots: found, pause: None });
        }
        Some((_, false)) => {
            tracing::info!(%group, %snap, "an interrupted group snapshot is taken again");
            remove_snap(t, io, group, snap)?;
        }
        None => {}
    }
    let g = cstring(group, "group")?;
    // SAFETY: live ioctx, C string.
    match unsafe { ffi::rbd_group_create(io.handle, g.as_ptr()) } {
        r if r == -EEXIST => {}
        r => check(t, r, || format!("creating group {group}"))?,
    }
    for left in images_of(t, io, group)? {
        if !images.contains(&left) {
            image_remove(t, io, group, &left)?;
        }
    }
    let pool = io.pool_id();
    for i in images {
        let img = io.open_read_only(t, i, None)?;
        match img.group(t)? {
            Some((p, other)) if p == pool && other != group => {
                // Left there by an interrupted group snapshot: membership holds no data, and
                // the other group's snapshots stay as they are.
                tracing::info!(image = %i, %other, "image taken out of another group first");
                image_remove(t, io, &other, i)?;
            }
            Some((p, other)) if p != pool => {
                return Err(RbdError::FailedPrecondition(format!("image {i} is in group {other} of another pool")));
            }
            _ => {}
        }
        image_add(t, io, group, i)?;
    }
    let s = cstring(snap, "group snapshot")?;
    let started = Instant::now();
    // SAFETY: live ioctx, C strings.
    let ret = unsafe { ffi::rbd_group_snap_create(io.handle, g.as_ptr(), s.as_ptr()) };
    let pause = started.elapsed();
    check(t, ret, || format!("taking group snapshot {group}@{snap}"))?;
    for i in images {
        image_remove(t, io, group, i)?;
    }
    Ok(GroupSnapshot { snapshots: members(t, io, group, snap, images)?, pause: Some(pause) })
}

fn remove_snap(t: &Target, io: &Ioctx, group: &str, snap: &str) -> Result<(), RbdError> {
    let (g, s) = (cstring(group, "group")?, cstring(snap, "group snapshot")?);
    // SAFETY: live ioctx, C strings.
    match unsafe { ffi::rbd_group_snap_remove(io.handle, g.as_ptr(), s.as_ptr()) } {
        r if r == -ENOENT => Ok(()),
        r => check(t, r, || format!("removing group snapshot {group}@{snap}")),
    }
}

/// Remove `group@snap` (every image's part still there) and the group once it records no
/// snapshot and holds no image. Absent: fine.
pub(crate) fn remove(t: &Target, io: &Ioctx, group: &str, snap: &str) -> Result<(), RbdError> {
    remove_snap(t, io, group, snap)?;
    let left = snaps(t, io, group)?;
    if left.is_some_and(|s| s.is_empty()) && images_of(t, io, group)?.is_empty() {
        let g = cstring(group, "group")?;
        // SAFETY: live ioctx, C string.
        match unsafe { ffi::rbd_group_remove(io.handle, g.as_ptr()) } {
            r if r == -ENOENT || r == -ENOTEMPTY => {}
            r => check(t, r, || format!("removing group {group}"))?,
        }
    }
    Ok(())
}
