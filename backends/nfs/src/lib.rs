//! The `nfs` backend: a volume is a subdirectory of an NFS export, its size and source
//! recorded in a metadata file inside it, snapshots server-side copies, all driven through
//! the host's userspace NFS client (`wasmcsi:backend/nfs`, declared in `wit/backend.wit`).
//!
//! Not written yet: it arrives with its own issue ("The nfs backend end to end against a real
//! NFS server"), together with the host's `nfs` capability provider and the node's kernel
//! NFS mount executor. Until then the host refuses to link `nfs` (a component importing it
//! fails to load with an error naming the import), and this crate builds no component.
