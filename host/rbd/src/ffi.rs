//! The few librados/librbd 16.2 (pacific) C functions the client calls, declared by hand from
//! `rados/librados.h` and `rbd/librbd.h`. There is no maintained librbd crate; the `ceph`
//! crate wraps only librados, and ~35 declarations are less to audit than a dependency.
//!
//! Everything here is `unsafe` to call; [`crate::conn`] and [`crate::image`] wrap each use in a
//! safe function that owns the handles and frees what the library allocated.
#![allow(unsafe_code, non_camel_case_types, reason = "FFI declarations of librados/librbd")]

use std::ffi::{c_char, c_int, c_void};

pub type rados_t = *mut c_void;
pub type rados_ioctx_t = *mut c_void;
pub type rbd_image_t = *mut c_void;
pub type rbd_image_options_t = *mut c_void;
pub type librbd_progress_fn_t = Option<unsafe extern "C" fn(u64, u64, *mut c_void) -> c_int>;

/// `struct timespec` on 64-bit Linux.
#[repr(C)]
#[derive(Default, Clone, Copy)]
pub struct timespec {
    pub tv_sec: i64,
    pub tv_nsec: i64,
}

#[repr(C)]
pub struct rbd_image_spec_t {
    pub id: *mut c_char,
    pub name: *mut c_char,
}

#[repr(C)]
pub struct rbd_linked_image_spec_t {
    pub pool_id: i64,
    pub pool_name: *mut c_char,
    pub pool_namespace: *mut c_char,
    pub image_id: *mut c_char,
    pub image_name: *mut c_char,
    pub trash: bool,
}

#[repr(C)]
pub struct rbd_snap_spec_t {
    pub id: u64,
    /// `rbd_snap_namespace_type_t`, a C enum (int).
    pub namespace_type: c_int,
    pub name: *mut c_char,
}

#[repr(C)]
pub struct rbd_snap_info_t {
    pub id: u64,
    pub size: u64,
    pub name: *const c_char,
}

pub const RBD_IMAGE_OPTION_FORMAT: c_int = 0;
pub const RBD_IMAGE_OPTION_FEATURES: c_int = 1;
pub const RBD_IMAGE_OPTION_DATA_POOL: c_int = 10;

/// `rbd_snap_namespace_type_t`: ordinary snapshots, and an image's part of a group snapshot.
pub const RBD_SNAP_NAMESPACE_TYPE_USER: c_int = 0;
pub const RBD_SNAP_NAMESPACE_TYPE_GROUP: c_int = 1;
/// `rbd_group_snap_state_t`: every image's snapshot was taken.
pub const RBD_GROUP_SNAP_STATE_COMPLETE: c_int = 1;

#[repr(C)]
pub struct rbd_snap_group_namespace_t {
    pub group_pool: i64,
    pub group_name: *mut c_char,
    pub group_snap_name: *mut c_char,
}

#[repr(C)]
pub struct rbd_group_info_t {
    pub name: *mut c_char,
    pub pool: i64,
}

#[repr(C)]
pub struct rbd_group_image_info_t {
    pub name: *mut c_char,
    pub pool: i64,
    pub state: c_int,
}

#[repr(C)]
pub struct rbd_group_snap_info_t {
    pub name: *mut c_char,
    pub state: c_int,
}

#[link(name = "rados")]
unsafe extern "C" {
    pub fn rados_create2(cluster: *mut rados_t, clustername: *const c_char, name: *const c_char, flags: u64) -> c_int;
    pub fn rados_conf_set(cluster: rados_t, option: *const c_char, value: *const c_char) -> c_int;
    pub fn rados_connect(cluster: rados_t) -> c_int;
    pub fn rados_shutdown(cluster: rados_t);
    pub fn rados_ioctx_create(cluster: rados_t, pool_name: *const c_char, ioctx: *mut rados_ioctx_t) -> c_int;
    pub fn rados_ioctx_destroy(io: rados_ioctx_t);
    pub fn rados_ioctx_get_id(io: rados_ioctx_t) -> i64;
    pub fn rados_mon_command(
        cluster: rados_t,
        cmd: *mut *const c_char,
        cmdlen: usize,
        inbuf: *const c_char,
        inbuflen: usize,
        outbuf: *mut *mut c_char,
        outbuflen: *mut usize,
        outs: *mut *mut c_char,
        outslen: *mut usize,
    ) -> c_int;
    pub fn rados_buffer_free(buf: *mut c_char);

    /// Advisory object locks (`cls_lock`), for the node's fence on an image header.
    pub fn rados_lock_exclusive(
        io: rados_ioctx_t,
        oid: *const c_char,
        name: *const c_char,
        cookie: *const c_char,
        desc: *const c_char,
        duration: *mut c_void,
        flags: u8,
    ) -> c_int;
    pub fn rados_list_lockers(
        io: rados_ioctx_t,
        oid: *const c_char,
        name: *const c_char,
        exclusive: *mut c_int,
        tag: *mut c_char,
        tag_len: *mut usize,
        clients: *mut c_char,
        clients_len: *mut usize,
        cookies: *mut c_char,
        cookies_len: *mut usize,
        addrs: *mut c_char,
        addrs_len: *mut usize,
    ) -> isize;
    pub fn rados_break_lock(
        io: rados_ioctx_t,
        oid: *const c_char,
        name: *const c_char,
        client: *const c_char,
        cookie: *const c_char,
    ) -> c_int;
}

#[link(name = "rbd")]
unsafe extern "C" {
    pub fn rbd_image_options_create(opts: *mut rbd_image_options_t);
    pub fn rbd_image_options_destroy(opts: rbd_image_options_t);
    pub fn rbd_image_options_set_string(opts: rbd_image_options_t, optname: c_int, optval: *const c_char) -> c_int;
    pub fn rbd_image_options_set_uint64(opts: rbd_image_options_t, optname: c_int, optval: u64) -> c_int;
    pub fn rbd_features_from_string(str_features: *const c_char, features: *mut u64) -> c_int;
    pub fn rbd_features_to_string(features: u64, str_features: *mut c_char, size: *mut usize) -> c_int;

    pub fn rbd_list2(io: rados_ioctx_t, images: *mut rbd_image_spec_t, max_images: *mut usize) -> c_int;
    pub fn rbd_image_spec_list_cleanup(images: *mut rbd_image_spec_t, num_images: usize);
    pub fn rbd_create4(io: rados_ioctx_t, name: *const c_char, size: u64, opts: rbd_image_options_t) -> c_int;
    pub fn rbd_clone3(
        p_ioctx: rados_ioctx_t,
        p_name: *const c_char,
        p_snapname: *const c_char,
        c_ioctx: rados_ioctx_t,
        c_name: *const c_char,
        c_opts: rbd_image_options_t,
    ) -> c_int;
    pub fn rbd_remove(io: rados_ioctx_t, name: *const c_char) -> c_int;

    pub fn rbd_open(io: rados_ioctx_t, name: *const c_char, image: *mut rbd_image_t, snap_name: *const c_char)
    -> c_int;
    pub fn rbd_open_read_only(
        io: rados_ioctx_t,
        name: *const c_char,
        image: *mut rbd_image_t,
        snap_name: *const c_char,
    ) -> c_int;
    pub fn rbd_close(image: rbd_image_t) -> c_int;

    pub fn rbd_get_size(image: rbd_image_t, size: *mut u64) -> c_int;
    pub fn rbd_get_id(image: rbd_image_t, id: *mut c_char, id_len: usize) -> c_int;
    pub fn rbd_get_features(image: rbd_image_t, features: *mut u64) -> c_int;
    pub fn rbd_get_parent(
        image: rbd_image_t,
        parent_image: *mut rbd_linked_image_spec_t,
        parent_snap: *mut rbd_snap_spec_t,
    ) -> c_int;
    pub fn rbd_linked_image_spec_cleanup(image: *mut rbd_linked_image_spec_t);
    pub fn rbd_linked_image_spec_list_cleanup(images: *mut rbd_linked_image_spec_t, num_images: usize);
    pub fn rbd_snap_spec_cleanup(snap: *mut rbd_snap_spec_t);
    pub fn rbd_resize2(
        image: rbd_image_t,
        size: u64,
        allow_shrink: bool,
        cb: librbd_progress_fn_t,
        cbdata: *mut c_void,
    ) -> c_int;
    pub fn rbd_flatten(image: rbd_image_t) -> c_int;
    pub fn rbd_list_children3(
        image: rbd_image_t,
        images: *mut rbd_linked_image_spec_t,
        max_images: *mut usize,
    ) -> c_int;

    pub fn rbd_metadata_get(image: rbd_image_t, key: *const c_char, value: *mut c_char, val_len: *mut usize) -> c_int;
    pub fn rbd_metadata_set(image: rbd_image_t, key: *const c_char, value: *const c_char) -> c_int;
    pub fn rbd_metadata_remove(image: rbd_image_t, key: *const c_char) -> c_int;
    pub fn rbd_metadata_list(
        image: rbd_image_t,
        start: *const c_char,
        max: u64,
        keys: *mut c_char,
        key_len: *mut usize,
        values: *mut c_char,
        vals_len: *mut usize,
    ) -> c_int;

    pub fn rbd_snap_list(image: rbd_image_t, snaps: *mut rbd_snap_info_t, max_snaps: *mut c_int) -> c_int;
    pub fn rbd_snap_list_end(snaps: *mut rbd_snap_info_t);
    pub fn rbd_snap_create(image: rbd_image_t, snapname: *const c_char) -> c_int;
    pub fn rbd_snap_remove(image: rbd_image_t, snapname: *const c_char) -> c_int;
    pub fn rbd_snap_protect(image: rbd_image_t, snap_name: *const c_char) -> c_int;
    pub fn rbd_snap_unprotect(image: rbd_image_t, snap_name: *const c_char) -> c_int;
    pub fn rbd_snap_is_protected(image: rbd_image_t, snap_name: *const c_char, is_protected: *mut c_int) -> c_int;
    pub fn rbd_snap_get_timestamp(image: rbd_image_t, snap_id: u64, timestamp: *mut timespec) -> c_int;

    pub fn rbd_snap_get_namespace_type(image: rbd_image_t, snap_id: u64, namespace_type: *mut c_int) -> c_int;
    pub fn rbd_snap_get_group_namespace(
        image: rbd_image_t,
        snap_id: u64,
        group_snap: *mut rbd_snap_group_namespace_t,
        group_snap_size: usize,
    ) -> c_int;
    pub fn rbd_snap_group_namespace_cleanup(group_snap: *mut rbd_snap_group_namespace_t, size: usize) -> c_int;
    pub fn rbd_snap_set_by_id(image: rbd_image_t, snap_id: u64) -> c_int;
    pub fn rbd_snap_remove_by_id(image: rbd_image_t, snap_id: u64) -> c_int;
    pub fn rbd_copy_with_progress2(
        src: rbd_image_t,
        dest: rbd_image_t,
        cb: librbd_progress_fn_t,
        cbdata: *mut c_void,
    ) -> c_int;

    pub fn rbd_get_group(image: rbd_image_t, group_info: *mut rbd_group_info_t, size: usize) -> c_int;
    pub fn rbd_group_info_cleanup(group_info: *mut rbd_group_info_t, size: usize) -> c_int;
    pub fn rbd_group_create(io: rados_ioctx_t, name: *const c_char) -> c_int;
    pub fn rbd_group_remove(io: rados_ioctx_t, name: *const c_char) -> c_int;
    pub fn rbd_group_image_add(
        group_p: rados_ioctx_t,
        group_name: *const c_char,
        image_p: rados_ioctx_t,
        image_name: *const c_char,
    ) -> c_int;
    pub fn rbd_group_image_remove(
        group_p: rados_ioctx_t,
        group_name: *const c_char,
        image_p: rados_ioctx_t,
        image_name: *const c_char,
    ) -> c_int;
    pub fn rbd_group_image_list(
        group_p: rados_ioctx_t,
        group_name: *const c_char,
        images: *mut rbd_group_image_info_t,
        info_size: usize,
        num_entries: *mut usize,
    ) -> c_int;
    pub fn rbd_group_image_list_cleanup(images: *mut rbd_group_image_info_t, info_size: usize, num: usize) -> c_int;
    pub fn rbd_group_snap_create(group_p: rados_ioctx_t, group_name: *const c_char, snap_name: *const c_char) -> c_int;
    pub fn rbd_group_snap_remove(group_p: rados_ioctx_t, group_name: *const c_char, snap_name: *const c_char) -> c_int;
    pub fn rbd_group_snap_list(
        group_p: rados_ioctx_t,
        group_name: *const c_char,
        snaps: *mut rbd_group_snap_info_t,
        info_size: usize,
        num_entries: *mut usize,
    ) -> c_int;
    pub fn rbd_group_snap_list_cleanup(snaps: *mut rbd_group_snap_info_t, info_size: usize, num: usize) -> c_int;

    pub fn rbd_read(image: rbd_image_t, ofs: u64, len: usize, buf: *mut c_char) -> isize;
    pub fn rbd_write(image: rbd_image_t, ofs: u64, len: usize, buf: *const c_char) -> isize;
    pub fn rbd_flush(image: rbd_image_t) -> c_int;
}
