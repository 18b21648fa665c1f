//! The node fence of an image: which node has it staged, so a second node is refused (RWO).
//!
//! An exclusive RADOS advisory lock (`cls_lock`) on the image's header object
//! (`rbd_header.<id>`), under the lock name [`FENCE_LOCK`] with the node id as cookie. It
//! persists in the cluster until released — not tied to a session that a restart or a network
//! blip would end — and it goes away with the image (the header object is removed).
//!
//! Why not librbd's `rbd_lock_exclusive`: that takes the same `cls_lock` lock *name*
//! (`rbd_lock`) the `exclusive-lock` image feature (on by default) uses for its managed lock. A
//! writer (here rbd-fuse) then finds the lock held "by an external mechanism" and its writes
//! fail. Our own lock name sits beside librbd's lock on the same object without interfering.
//! Why not only ceph-csi's watcher check: it is racy (two nodes can both see no watcher, then
//! both map), and a watch of a crashed or partitioned node expires after ~30 s, after which a
//! second node would attach while the first may still write.
//!
//! Operators see the lock with `rados -p POOL lock info rbd_header.ID wasmcsi.node` and remove a
//! dead node's lock with `rados -p POOL lock break rbd_header.ID wasmcsi.node CLIENT --lock-cookie NODE`.
#![allow(unsafe_code, reason = "calls librados (FFI)")]

use crate::conn::{Ioctx, cstring};
use crate::error::Target;
use crate::image::Image;
use crate::{RbdError, ffi};
use std::ffi::{c_char, c_int};

/// The `cls_lock` lock name of the node fence.
pub const FENCE_LOCK: &str = "wasmcsi.node";

const ERANGE: isize = nix::errno::Errno::ERANGE as isize;
const EBUSY: c_int = nix::errno::Errno::EBUSY as c_int;
const EEXIST: c_int = nix::errno::Errno::EEXIST as c_int;
const ENOENT: c_int = nix::errno::Errno::ENOENT as c_int;

/// One holder of the fence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FenceHolder {
    /// The RADOS client entity that took it (`client.4123`).
    pub client: String,
    /// The node id.
    pub cookie: String,
    pub address: String,
}

/// What [`crate::RbdPool::fence_acquire`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// Taken by this call.
    Acquired,
    /// This node held it already (a retried stage, or one after a restart of the plugin).
    AlreadyHeld,
}

impl Image {
    /// The image id (the `<id>` of `rbd_header.<id>`).
    pub fn id(&self, t: &Target) -> Result<String, RbdError> {
        let mut cap = 64usize;
        loop {
            let mut buf = vec![0u8; cap];
            // SAFETY: buffer of `cap` bytes; librbd writes a NUL-terminated id or returns -ERANGE.
            let ret = unsafe { ffi::rbd_get_id(self.handle(), buf.as_mut_ptr().cast(), cap) };
            if ret == -(ERANGE as c_int) && cap < 4096 {
                cap *= 4;
                continue;
            }
            if ret < 0 {
                return Err(t.errno(ret, "image id"));
            }
            let id = std::ffi::CStr::from_bytes_until_nul(&buf)
                .map_err(|_| RbdError::Internal("image id not terminated".into()))?;
            return Ok(id.to_string_lossy().into_owned());
        }
    }
}

fn split(buf: &[u8], len: usize) -> Vec<String> {
    buf[..len.min(buf.len())]
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

impl Ioctx {
    /// Holders of lock `name` on object `oid` (none when the object has no such lock).
    pub fn lockers(&self, t: &Target, oid: &str, name: &str) -> Result<Vec<FenceHolder>, RbdError> {
        let (o, n) = (cstring(oid, "object")?, cstring(name, "lock")?);
        let mut cap = 1024usize;
        loop {
            let (mut tag, mut clients, mut cookies, mut addrs) =
                (vec![0u8; cap], vec![0u8; cap], vec![0u8; cap], vec![0u8; cap]);
            let (mut tl, mut cl, mut kl, mut al) = (cap, cap, cap, cap);
            let mut exclusive: c_int = 0;
            // SAFETY: four buffers of the stated lengths; librados fills NUL-separated lists or
            // returns -ERANGE with the lengths it needs.
            let ret = unsafe {
                ffi::rados_list_lockers(
                    self.handle,
                    o.as_ptr(),
                    n.as_ptr(),
                    &mut exclusive,
                    tag.as_mut_ptr().cast::<c_char>(),
                    &mut tl,
                    clients.as_mut_ptr().cast::<c_char>(),
                    &mut cl,
                    cookies.as_mut_ptr().cast::<c_char>(),
                    &mut kl,
                    addrs.as_mut_ptr().cast::<c_char>(),
                    &mut al,
                )
            };
            if ret == -ERANGE && cap < (1 << 20) {
                cap = tl.max(cl).max(kl).max(al).max(cap * 2);
                continue;
            }
            if ret < 0 {
                let ret = c_int::try_from(ret).unwrap_or(-EBUSY);
                if ret == -ENOENT {
                    return Ok(Vec::new());
                }
                return Err(t.errno(ret, &format!("lockers of {oid}")));
            }
            let (clients, cookies, addrs) = (split(&clients, cl), split(&cookies, kl), split(&addrs, al));
            return Ok(clients
                .into_iter()
                .zip(cookies)
                .enumerate()
                .map(|(i, (client, cookie))| FenceHolder {
                    client,
                    cookie,
                    address: addrs.get(i).cloned().unwrap_or_default(),
                })
                .collect());
        }
    }

    /// Take exclusive lock `name` on `oid` with `cookie`, no expiry. `Ok(false)` when this very
    /// client (entity and cookie) holds it already; FailedPrecondition when someone else does.
    pub fn lock_exclusive(
        &self,
        t: &Target,
        oid: &str,
        name: &str,
        cookie: &str,
        desc: &str,
    ) -> Result<bool, RbdError> {
        let (o, n, c, d) = (
            cstring(oid, "object")?,
            cstring(name, "lock")?,
            cstring(cookie, "cookie")?,
            cstring(desc, "description")?,
        );
        // SAFETY: valid ioctx and C strings; no duration (NULL), no flags.
        let ret = unsafe {
            ffi::rados_lock_exclusive(
                self.handle,
                o.as_ptr(),
                n.as_ptr(),
                c.as_ptr(),
                d.as_ptr(),
                std::ptr::null_mut(),
                0,
            )
        };
        match ret {
            0 => Ok(true),
            r if r == -EEXIST => Ok(false),
            r if r == -EBUSY => {
                Err(RbdError::FailedPrecondition(format!("lock {name} on {oid} is held by another client")))
            }
            r => Err(t.errno(r, &format!("locking {oid}"))),
        }
    }

    /// Remove one holder's lock; an absent lock succeeds.
    pub fn break_lock(&self, t: &Target, oid: &str, name: &str, client: &str, cookie: &str) -> Result<(), RbdError> {
        let (o, n, cl, c) =
            (cstring(oid, "object")?, cstring(name, "lock")?, cstring(client, "client")?, cstring(cookie, "cookie")?);
        // SAFETY: valid ioctx and C strings.
        let ret = unsafe { ffi::rados_break_lock(self.handle, o.as_ptr(), n.as_ptr(), cl.as_ptr(), c.as_ptr()) };
        if ret < 0 && ret != -ENOENT {
            return Err(t.errno(ret, &format!("releasing lock {name} on {oid}")));
        }
        Ok(())
    }
}

/// The header object of a format-2 image.
pub(crate) fn header_oid(id: &str) -> String {
    format!("rbd_header.{id}")
}

/// Sorted, for messages: `node-a (client.4123 at 10.0.0.1:0/123)`.
pub(crate) fn describe(holders: &[FenceHolder]) -> String {
    let mut v: Vec<String> = holders.iter().map(|h| format!("{} ({} at {})", h.cookie, h.client, h.address)).collect();
    v.sort();
    v.join(", ")
}
