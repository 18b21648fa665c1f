//! The `ceph-rbd-shim` backend: RBD images as volumes (naming, features, clone depth and
//! flatten policy, request-name metadata for idempotency) over the host's narrow
//! `wasmcsi:backend/rbd` capability (declared in `wit/backend.wit`).
//!
//! Not written yet: it arrives with its own issue ("The ceph-rbd-shim backend against a real
//! Ceph cluster"), with the host's librbd-backed `rbd` provider and the rbd-fuse + loop node
//! executor. Until then the host refuses to link `rbd`, and this crate builds no component.
