//! The integration tests of `wasmcsi-csi`: the Controller and Node services with real mounts,
//! grants, a real Ceph cluster and the kernel-VM tier.
//!
//! One binary per crate, one module per area (as wasmtime's `tests/all`): the crate and its
//! dependencies are linked once, not once per file. Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`.

mod authority_endpoint;
mod bind_node;
mod ca_store;
mod get_snapshot;
mod nfs_node_vm;
mod node_grants;
mod node_paths;
mod node_single_writer;
mod rbd_node;
mod selinux_vm;
