//! The synchronous librbd operations, each run on a worker thread by [`crate::client`]. Every
//! buffer librbd fills is sized by asking first (`-ERANGE` tells the size) and every list it
//! allocates is freed with its `*_cleanup` function before returning.
#![allow(unsafe_code, reason = "calls librbd (FFI)")]

use crate::conn::{Ioctx, cstring};
use crate::error::Target;
use crate::names::SnapRef;
use crate::{ImageInfo, ImageSnapshot, RbdError, Timestamp, ffi};
use std::ffi::{CStr, CString, c_char, c_int};

const ERANGE: c_int = nix::errno::Errno::ERANGE as c_int;
const ENOENT: c_int = nix::errno::Errno::ENOENT as c_int;
const EBUSY: c_int = nix::errno::Errno::EBUSY as c_int;
const ENOTEMPTY: c_int = nix::errno::Errno::ENOTEMPTY as c_int;
const EINVAL: c_int = nix::errno::Errno::EINVAL as c_int;

/// What a snapshot is: an ordinary one, or an image's part of an RBD group snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SnapKind {
    User(String),
    Group { pool: i64, group: String, snap: String },
}

/// One snapshot of an image as librbd lists it.
#[derive(Clone, Debug)]
pub(crate) struct SnapEntry {
    pub id: u64,
    pub size: u64,
    pub kind: SnapKind,
}

impl SnapEntry {
    /// Whether this is the snapshot `r` names, a group member only of a group in `group_pool`.
    pub fn is(&self, r: &SnapRef<'_>, group_pool: i64) -> bool {
        match (&self.kind, r) {
            (SnapKind::User(n), SnapRef::User(m)) => n == m,
            (SnapKind::Group { pool, group, snap }, SnapRef::Group { group: g, snap: s }) => {
                *pool == group_pool && group == g && snap == s
            }
            _ => false,
        }
    }
}

/// An open image; closed on drop.
pub(crate) struct Image {
    handle: ffi::rbd_image_t,
}

impl Image {
    pub(crate) fn handle(&self) -> ffi::rbd_image_t {
        self.handle
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        // SAFETY: opened by rbd_open*, closed once.
        unsafe { ffi::rbd_close(self.handle) };
    }
}

/// Copy a C string librbd owns.
fn owned(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: librbd hands out NUL-terminated strings that live until its cleanup call.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `pool/image` or `pool/namespace/image`, as the `rbd` CLI spells an image.
fn spec_name(spec: &ffi::rbd_linked_image_spec_t) -> String {
    let (pool, ns, image) = (owned(spec.pool_name), owned(spec.pool_namespace), owned(spec.image_name));
    if ns.is_empty() { format!("{pool}/{image}") } else { format!("{pool}/{ns}/{image}") }
}

/// Image options for create/clone: format 2, features, optional data pool.
struct Options {
    handle: ffi::rbd_image_options_t,
}

impl Options {
    fn new(t: &Target, features: Option<u64>, data_pool: Option<&str>) -> Result<Self, RbdError> {
        let mut handle: ffi::rbd_image_options_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        unsafe { ffi::rbd_image_options_create(&mut handle) };
        let opts = Self { handle };
        // SAFETY (all three): valid options handle, values are plain integers / C strings.
        let ret = unsafe { ffi::rbd_image_options_set_uint64(opts.handle, ffi::RBD_IMAGE_OPTION_FORMAT, 2) };
        if ret < 0 {
            return Err(t.errno(ret, "image option format"));
        }
        if let Some(f) = features {
            let ret = unsafe { ffi::rbd_image_options_set_uint64(opts.handle, ffi::RBD_IMAGE_OPTION_FEATURES, f) };
            if ret < 0 {
                return Err(t.errno(ret, "image option features"));
            }
        }
        if let Some(p) = data_pool {
            let c = cstring(p, "data pool")?;
            let ret =
                unsafe { ffi::rbd_image_options_set_string(opts.handle, ffi::RBD_IMAGE_OPTION_DATA_POOL, c.as_ptr()) };
            if ret < 0 {
                return Err(t.errno(ret, "image option data pool"));
            }
        }
        Ok(opts)
    }
}

impl Drop for Options {
    fn drop(&mut self) {
        // SAFETY: created by rbd_image_options_create, destroyed once.
        unsafe { ffi::rbd_image_options_destroy(self.handle) }
    }
}

/// Feature names (`layering`, `exclusive-lock`, ...) to librbd's bits, by librbd itself so the
/// names are exactly the `rbd` CLI's. Empty: librbd's default (`rbd_default_features`).
pub(crate) fn features_from_names(names: &[String]) -> Result<Option<u64>, RbdError> {
    if names.is_empty() {
        return Ok(None);
    }
    let mut bits = 0u64;
    for n in names {
        if n.is_empty() || n.contains(',') {
            return Err(RbdError::InvalidArgument(format!("unknown rbd feature {n:?}")));
        }
        let c = cstring(n, "feature")?;
        let mut b = 0u64;
        // SAFETY: valid C string, out-pointer to a local.
        let ret = unsafe { ffi::rbd_features_from_string(c.as_ptr(), &mut b) };
        if ret < 0 || b == 0 {
            return Err(RbdError::InvalidArgument(format!("unknown rbd feature {n:?}")));
        }
        bits |= b;
    }
    Ok(Some(bits))
}

pub(crate) fn features_to_names(bits: u64) -> Vec<String> {
    let mut buf = vec![0u8; 1024];
    let mut len = buf.len();
    // SAFETY: buffer of `len` bytes; librbd writes a NUL-terminated list into it.
    let ret = unsafe { ffi::rbd_features_to_string(bits, buf.as_mut_ptr().cast(), &mut len) };
    if ret < 0 {
        return vec![format!("0x{bits:x}")];
    }
    let s = CStr::from_bytes_until_nul(&buf).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default();
    s.split(',').filter(|f| !f.is_empty()).map(str::to_owned).collect()
}

impl Ioctx {
    fn open_with(&self, t: &Target, name: &str, snap: Option<&str>, read_only: bool) -> Result<Image, RbdError> {
        let n = cstring(name, "image")?;
        let s = snap.map(|s| cstring(s, "snapshot")).transpose()?;
        let sp = s.as_ref().map_or(std::ptr::null(), |s| s.as_ptr());
        let mut handle: ffi::rbd_image_t = std::ptr::null_mut();
        // SAFETY: valid ioctx and C strings; out-pointer to a local.
        let ret = unsafe {
            if read_only {
                ffi::rbd_open_read_only(self.handle, n.as_ptr(), &mut handle, sp)
            } else {
                ffi::rbd_open(self.handle, n.as_ptr(), &mut handle, sp)
            }
        };
        if ret < 0 {
            let what = match snap {
                Some(s) => format!("image {name}@{s}"),
                None => format!("image {name}"),
            };
            return Err(t.errno(ret, &what));
        }
        Ok(Image { handle })
    }

    pub fn open(&self, t: &Target, name: &str) -> Result<Image, RbdError> {
        self.open_with(t, name, None, false)
    }

    pub fn open_read_only(&self, t: &Target, name: &str, snap: Option<&str>) -> Result<Image, RbdError> {
        self.open_with(t, name, snap, true)
    }

    /// Names of every image in the pool.
    pub fn list(&self, t: &Target) -> Result<Vec<String>, RbdError> {
        let mut cap = 64usize;
        loop {
            let mut specs: Vec<ffi::rbd_image_spec_t> = Vec::with_capacity(cap);
            let mut max = cap;
            // SAFETY: room for `max` specs; librbd sets `max` to the count (or the needed count
            // with -ERANGE) and fills `ret` of them, which we clean up.
            let ret = unsafe { ffi::rbd_list2(self.handle, specs.as_mut_ptr(), &mut max) };
            if ret == -ERANGE {
                cap = max.max(cap * 2);
                continue;
            }
            if ret < 0 {
                return Err(t.errno(ret, "listing images"));
            }
            let n = max.min(cap);
            // SAFETY: librbd initialized the first `n` entries.
            unsafe { specs.set_len(n) };
            let names = specs.iter().map(|s| owned(s.name)).collect();
            // SAFETY: the `n` entries librbd allocated, cleaned once.
            unsafe { ffi::rbd_image_spec_list_cleanup(specs.as_mut_ptr(), n) };
            return Ok(names);
        }
    }

    pub fn create(
        &self,
        t: &Target,
        name: &str,
        size: u64,
        features: Option<u64>,
        data_pool: Option<&str>,
    ) -> Result<(), RbdError> {
        let n = cstring(name, "image")?;
        let opts = Options::new(t, features, data_pool)?;
        // SAFETY: valid ioctx, C string and options.
        let ret = unsafe { ffi::rbd_create4(self.handle, n.as_ptr(), size, opts.handle) };
        if ret < 0 {
            return Err(t.errno(ret, &format!("creating image {name}")));
        }
        Ok(())
    }

    /// Remove; `false` when there was nothing to remove.
    pub fn remove(&self, t: &Target, name: &str) -> Result<bool, RbdError> {
        let n = cstring(name, "image")?;
        // SAFETY: valid ioctx and C string.
        let ret = unsafe { ffi::rbd_remove(self.handle, n.as_ptr()) };
        match ret {
            0 => Ok(true),
            r if r == -ENOENT => Ok(false),
            r if r == -ENOTEMPTY => {
                Err(RbdError::FailedPrecondition(format!("image {name} has snapshots; remove them first")))
            }
            r if r == -EBUSY => Err(RbdError::FailedPrecondition(format!(
                "image {name} is in use (watched by a client, or has clone children)"
            ))),
            r => Err(t.errno(r, &format!("removing image {name}"))),
        }
    }

    pub fn clone_from(
        &self,
        t: &Target,
        parent: &str,
        snap: &str,
        child_io: &Ioctx,
        child: &str,
        features: Option<u64>,
    ) -> Result<(), RbdError> {
        let (p, s, c) = (cstring(parent, "image")?, cstring(snap, "snapshot")?, cstring(child, "image")?);
        let opts = Options::new(t, features, None)?;
        // SAFETY: valid ioctxs, C strings and options.
        let ret =
            unsafe { ffi::rbd_clone3(self.handle, p.as_ptr(), s.as_ptr(), child_io.handle, c.as_ptr(), opts.handle) };
        if ret < 0 {
            return Err(t.errno(ret, &format!("cloning {parent}@{snap} into {child}")));
        }
        Ok(())
    }
}

/// Converts a librbd return code with the image's name for context.
fn check(t: &Target, ret: c_int, what: impl FnOnce() -> String) -> Result<(), RbdError> {
    if ret < 0 { Err(t.errno(ret, &what())) } else { Ok(()) }
}

impl Image {
    pub fn size(&self, t: &Target) -> Result<u64, RbdError> {
        let mut size = 0;
        // SAFETY: open image, out-pointer to a local.
        check(t, unsafe { ffi::rbd_get_size(self.handle, &mut size) }, || "image size".into())?;
        Ok(size)
    }

    pub fn features(&self, t: &Target) -> Result<u64, RbdError> {
        let mut f = 0;
        // SAFETY: open image, out-pointer to a local.
        check(t, unsafe { ffi::rbd_get_features(self.handle, &mut f) }, || "image features".into())?;
        Ok(f)
    }

    /// `pool/image@snap` of the parent; `None` for an image that is not a clone (or was
    /// flattened).
    pub fn parent(&self, t: &Target) -> Result<Option<String>, RbdError> {
        // SAFETY: zeroed POD structs librbd fills and we clean up on success.
        let mut image: ffi::rbd_linked_image_spec_t = unsafe { std::mem::zeroed() };
        let mut snap: ffi::rbd_snap_spec_t = unsafe { std::mem::zeroed() };
        let ret = unsafe { ffi::rbd_get_parent(self.handle, &mut image, &mut snap) };
        if ret == -ENOENT {
            return Ok(None);
        }
        check(t, ret, || "image parent".into())?;
        let out = format!("{}@{}", spec_name(&image), owned(snap.name));
        // SAFETY: filled by a successful rbd_get_parent; cleaned once.
        unsafe {
            ffi::rbd_linked_image_spec_cleanup(&mut image);
            ffi::rbd_snap_spec_cleanup(&mut snap);
        }
        Ok(Some(out))
    }

    /// All metadata pairs, in key order.
    pub fn metadata(&self, t: &Target) -> Result<Vec<(String, String)>, RbdError> {
        let (mut kcap, mut vcap) = (4096usize, 4096usize);
        loop {
            let (mut keys, mut vals) = (vec![0u8; kcap], vec![0u8; vcap]);
            let (mut klen, mut vlen) = (kcap, vcap);
            let empty = c"";
            // SAFETY: buffers of the stated lengths; librbd writes NUL-separated keys/values or
            // returns -ERANGE with the needed lengths. max 0 = no limit.
            let ret = unsafe {
                ffi::rbd_metadata_list(
                    self.handle,
                    empty.as_ptr(),
                    0,
                    keys.as_mut_ptr().cast(),
                    &mut klen,
                    vals.as_mut_ptr().cast(),
                    &mut vlen,
                )
            };
            if ret == -ERANGE {
                kcap = klen.max(kcap * 2);
                vcap = vlen.max(vcap * 2);
                continue;
            }
            check(t, ret, || "image metadata".into())?;
            let split = |buf: &[u8], len: usize| -> Vec<String> {
                buf[..len.min(buf.len())]
                    .split(|b| *b == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect()
            };
            let (k, v) = (split(&keys, klen), split(&vals, vlen));
            if k.len() != v.len() {
                // An empty value would be dropped by the split above: fall back to one get per
                // key, which is exact.
                return k
                    .into_iter()
                    .map(|key| Ok((key.clone(), self.metadata_get(t, &key)?.unwrap_or_default())))
                    .collect();
            }
            return Ok(k.into_iter().zip(v).collect());
        }
    }

    pub fn metadata_get(&self, t: &Target, key: &str) -> Result<Option<String>, RbdError> {
        let k = cstring(key, "metadata key")?;
        let mut cap = 256usize;
        loop {
            let mut buf = vec![0u8; cap];
            let mut len = cap;
            // SAFETY: buffer of `len` bytes; -ERANGE reports the needed length.
            let ret = unsafe { ffi::rbd_metadata_get(self.handle, k.as_ptr(), buf.as_mut_ptr().cast(), &mut len) };
            if ret == -ERANGE {
                cap = len.max(cap * 2);
                continue;
            }
            if ret == -ENOENT {
                return Ok(None);
            }
            check(t, ret, || format!("metadata {key}"))?;
            // On success librbd leaves `len` as it was: the value ends at its NUL.
            let value = CStr::from_bytes_until_nul(&buf).map(|c| c.to_string_lossy().into_owned());
            return value.map(Some).map_err(|_| RbdError::Internal(format!("metadata {key}: value not terminated")));
        }
    }

    pub fn metadata_set(&self, t: &Target, key: &str, value: &str) -> Result<(), RbdError> {
        let (k, v) = (cstring(key, "metadata key")?, cstring(value, "metadata value")?);
        // SAFETY: open image, C strings.
        check(t, unsafe { ffi::rbd_metadata_set(self.handle, k.as_ptr(), v.as_ptr()) }, || format!("metadata {key}"))
    }

    /// Remove a metadata key; an absent key succeeds.
    pub fn metadata_remove(&self, t: &Target, key: &str) -> Result<(), RbdError> {
        let k = cstring(key, "metadata key")?;
        // SAFETY: open image, C string.
        match unsafe { ffi::rbd_metadata_remove(self.handle, k.as_ptr()) } {
            r if r == -ENOENT => Ok(()),
            r => check(t, r, || format!("removing metadata {key}")),
        }
    }

    pub fn resize(&self, t: &Target, size: u64) -> Result<(), RbdError> {
        // SAFETY: open image; no progress callback. allow_shrink false: librbd refuses too.
        let ret = unsafe { ffi::rbd_resize2(self.handle, size, false, None, std::ptr::null_mut()) };
        check(t, ret, || format!("resizing to {size}"))
    }

    pub fn flatten(&self, t: &Target) -> Result<(), RbdError> {
        // SAFETY: open image.
        let ret = unsafe { ffi::rbd_flatten(self.handle) };
        // Not a clone (any more): nothing to do.
        if ret == -EINVAL {
            return Ok(());
        }
        check(t, ret, || "flatten".into())
    }

    /// Children (`pool/image`) of the snapshot this image was opened at; images in the trash
    /// (being deleted) are left out.
    pub fn children(&self, t: &Target) -> Result<Vec<String>, RbdError> {
        let mut cap = 16usize;
        loop {
            let mut specs: Vec<ffi::rbd_linked_image_spec_t> = Vec::with_capacity(cap);
            let mut max = cap;
            // SAFETY: room for `max` entries; as for rbd_list2.
            let ret = unsafe { ffi::rbd_list_children3(self.handle, specs.as_mut_ptr(), &mut max) };
            if ret == -ERANGE {
                cap = max.max(cap * 2);
                continue;
            }
            check(t, ret, || "listing children".into())?;
            let n = max.min(cap);
            // SAFETY: librbd initialized the first `n` entries; cleaned once.
            unsafe { specs.set_len(n) };
            let out = specs.iter().filter(|s| !s.trash).map(spec_name).collect();
            unsafe { ffi::rbd_linked_image_spec_list_cleanup(specs.as_mut_ptr(), n) };
            return Ok(out);
        }
    }

    pub fn snap_create(&self, t: &Target, snap: &str) -> Result<(), RbdError> {
        let s = cstring(snap, "snapshot")?;
        // SAFETY: open image, C string.
        check(t, unsafe { ffi::rbd_snap_create(self.handle, s.as_ptr()) }, || format!("creating snapshot {snap}"))
    }

    /// Remove; absent is fine. A protected snapshot is unprotected first (the WIT has no
    /// unprotect; the caller checked that it has no children).
    pub fn snap_remove(&self, t: &Target, snap: &str) -> Result<(), RbdError> {
        let s = cstring(snap, "snapshot")?;
        let mut protected = 0;
        // SAFETY: open image, C string, out-pointer to a local.
        let ret = unsafe { ffi::rbd_snap_is_protected(self.handle, s.as_ptr(), &mut protected) };
        if ret == -ENOENT {
            return Ok(());
        }
        check(t, ret, || format!("snapshot {snap}"))?;
        if protected != 0 {
            // SAFETY: as above.
            let ret = unsafe { ffi::rbd_snap_unprotect(self.handle, s.as_ptr()) };
            if ret == -EBUSY {
                return Err(RbdError::FailedPrecondition(format!("snapshot {snap} has clone children")));
            }
            check(t, ret, || format!("unprotecting snapshot {snap}"))?;
        }
        // SAFETY: as above.
        match unsafe { ffi::rbd_snap_remove(self.handle, s.as_ptr()) } {
            r if r == -ENOENT => Ok(()),
            r if r == -EBUSY => Err(RbdError::FailedPrecondition(format!("snapshot {snap} is in use"))),
            r => check(t, r, || format!("removing snapshot {snap}")),
        }
    }

    /// Protect; already protected is fine.
    pub fn snap_protect(&self, t: &Target, snap: &str) -> Result<(), RbdError> {
        let s = cstring(snap, "snapshot")?;
        // SAFETY: open image, C string.
        match unsafe { ffi::rbd_snap_protect(self.handle, s.as_ptr()) } {
            r if r == -EBUSY => Ok(()),
            r => check(t, r, || format!("protecting snapshot {snap}")),
        }
    }

    /// Every snapshot of the image with its id and namespace (librbd lists all namespaces).
    pub fn snap_entries(&self, t: &Target) -> Result<Vec<SnapEntry>, RbdError> {
        let mut cap: c_int = 16;
        let raw = loop {
            let mut infos: Vec<ffi::rbd_snap_info_t> = Vec::with_capacity(cap as usize + 1);
            let mut max = cap;
            // SAFETY: room for `max` entries (+1: librbd writes an end marker after them,
            // which rbd_snap_list_end relies on).
            let ret = unsafe { ffi::rbd_snap_list(self.handle, infos.as_mut_ptr(), &mut max) };
            if ret == -ERANGE {
                cap = max.max(cap * 2);
                continue;
            }
            check(t, ret, || "listing snapshots".into())?;
            let n = (ret as usize).min(cap as usize);
            // SAFETY: librbd initialized `n` entries (and the marker after them).
            unsafe { infos.set_len(n) };
            let raw: Vec<(u64, u64, String)> = infos.iter().map(|i| (i.id, i.size, owned(i.name))).collect();
            // SAFETY: frees the names of the entries librbd filled, once.
            unsafe { ffi::rbd_snap_list_end(infos.as_mut_ptr()) };
            break raw;
        };
        let mut out = Vec::with_capacity(raw.len());
        for (id, size, name) in raw {
            let mut ns: c_int = -1;
            // SAFETY: open image, out-pointer to a local.
            check(t, unsafe { ffi::rbd_snap_get_namespace_type(self.handle, id, &mut ns) }, || {
                format!("namespace of snapshot {id}")
            })?;
            let kind = match ns {
                ffi::RBD_SNAP_NAMESPACE_TYPE_USER => SnapKind::User(name),
                ffi::RBD_SNAP_NAMESPACE_TYPE_GROUP => {
                    let mut g = ffi::rbd_snap_group_namespace_t {
                        group_pool: -1,
                        group_name: std::ptr::null_mut(),
                        group_snap_name: std::ptr::null_mut(),
                    };
                    let size_of = std::mem::size_of::<ffi::rbd_snap_group_namespace_t>();
                    // SAFETY: open image, out-pointer to a local of the size given.
                    let ret = unsafe { ffi::rbd_snap_get_group_namespace(self.handle, id, &mut g, size_of) };
                    check(t, ret, || format!("group of snapshot {id}"))?;
                    let kind = SnapKind::Group {
                        pool: g.group_pool,
                        group: owned(g.group_name),
                        snap: owned(g.group_snap_name),
                    };
                    // SAFETY: filled by librbd above, freed once.
                    unsafe { ffi::rbd_snap_group_namespace_cleanup(&mut g, size_of) };
                    kind
                }
                // Trash (a snapshot removed while clones still read it) and mirror snapshots
                // are librbd's own, never a guest's.
                _ => continue,
            };
            out.push(SnapEntry { id, size, kind });
        }
        Ok(out)
    }

    /// The snapshot `snap` names ([`SnapRef`]): its id and size; `None` when absent. A group
    /// member counts only when its group lives in `group_pool` (the pool of the call).
    pub fn snap_find(&self, t: &Target, snap: &SnapRef<'_>, group_pool: i64) -> Result<Option<(u64, u64)>, RbdError> {
        Ok(self.snap_entries(t)?.into_iter().find(|e| e.is(snap, group_pool)).map(|e| (e.id, e.size)))
    }

    /// The snapshots a guest sees: ordinary ones by name, an image's part of a group snapshot
    /// as `GROUP@SNAP` (never an ordinary name: `@` is refused in those) when its group lives in
    /// `group_pool`.
    pub fn snap_list(&self, t: &Target, group_pool: i64) -> Result<Vec<ImageSnapshot>, RbdError> {
        let mut out = Vec::new();
        for e in self.snap_entries(t)? {
            let (name, protected) = match &e.kind {
                SnapKind::User(name) => {
                    let c = CString::new(name.as_str()).unwrap_or_default();
                    let mut protected = 0;
                    // SAFETY: open image, C string, out-pointer to a local.
                    check(t, unsafe { ffi::rbd_snap_is_protected(self.handle, c.as_ptr(), &mut protected) }, || {
                        format!("snapshot {name}")
                    })?;
                    (name.clone(), protected != 0)
                }
                SnapKind::Group { pool, group, snap } if *pool == group_pool => (format!("{group}@{snap}"), false),
                SnapKind::Group { .. } => continue,
            };
            let mut ts = ffi::timespec::default();
            // SAFETY: open image, out-pointer to a local.
            check(t, unsafe { ffi::rbd_snap_get_timestamp(self.handle, e.id, &mut ts) }, || {
                format!("timestamp of snapshot {name}")
            })?;
            let created = Timestamp { seconds: ts.tv_sec, nanos: u32::try_from(ts.tv_nsec).unwrap_or(0) };
            out.push(ImageSnapshot { name, size_bytes: e.size, protected, created });
        }
        Ok(out)
    }

    /// Remove the snapshot with id `id` (any namespace: a group member goes on its own, the
    /// group snapshot keeps the others); absent is fine.
    pub fn snap_remove_by_id(&self, t: &Target, id: u64, name: &str) -> Result<(), RbdError> {
        // SAFETY: open image.
        match unsafe { ffi::rbd_snap_remove_by_id(self.handle, id) } {
            r if r == -ENOENT => Ok(()),
            r if r == -EBUSY => Err(RbdError::FailedPrecondition(format!("snapshot {name} is in use"))),
            r => check(t, r, || format!("removing snapshot {name}")),
        }
    }

    /// Read from the snapshot with id `id` from now on (any namespace).
    pub fn snap_set_by_id(&self, t: &Target, id: u64) -> Result<(), RbdError> {
        // SAFETY: open image.
        check(t, unsafe { ffi::rbd_snap_set_by_id(self.handle, id) }, || format!("opening snapshot {id}"))
    }

    /// The RBD group the image is in, as (group pool id, name); `None` when in none.
    pub fn group(&self, t: &Target) -> Result<Option<(i64, String)>, RbdError> {
        let mut g = ffi::rbd_group_info_t { name: std::ptr::null_mut(), pool: -1 };
        let size_of = std::mem::size_of::<ffi::rbd_group_info_t>();
        // SAFETY: open image, out-pointer to a local of the size given.
        check(t, unsafe { ffi::rbd_get_group(self.handle, &mut g, size_of) }, || "group of the image".into())?;
        let out = (g.pool >= 0).then(|| (g.pool, owned(g.name)));
        // SAFETY: filled by librbd above, freed once.
        unsafe { ffi::rbd_group_info_cleanup(&mut g, size_of) };
        Ok(out.filter(|(_, n)| !n.is_empty()))
    }

    pub fn info(&self, t: &Target, name: &str) -> Result<ImageInfo, RbdError> {
        Ok(ImageInfo {
            name: name.to_owned(),
            size_bytes: self.size(t)?,
            features: features_to_names(self.features(t)?),
            parent: self.parent(t)?,
            metadata: self.metadata(t)?,
        })
    }

    pub fn read(&self, t: &Target, offset: u64, len: usize) -> Result<Vec<u8>, RbdError> {
        let mut buf = vec![0u8; len];
        // SAFETY: buffer of `len` bytes.
        let n = unsafe { ffi::rbd_read(self.handle, offset, len, buf.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(t.errno(i32::try_from(n).unwrap_or(-EINVAL), "read"));
        }
        buf.truncate(n as usize);
        Ok(buf)
    }

    pub fn write(&self, t: &Target, offset: u64, data: &[u8]) -> Result<(), RbdError> {
        // SAFETY: `data` is valid for its length.
        let n = unsafe { ffi::rbd_write(self.handle, offset, data.len(), data.as_ptr().cast()) };
        if n < 0 {
            return Err(t.errno(i32::try_from(n).unwrap_or(-EINVAL), "write"));
        }
        if n as usize != data.len() {
            return Err(RbdError::Internal(format!("short write: {n} of {}", data.len())));
        }
        // SAFETY: open image.
        check(t, unsafe { ffi::rbd_flush(self.handle) }, || "flush".into())
    }
}
