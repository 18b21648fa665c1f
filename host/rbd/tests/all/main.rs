//! The integration tests of `wasmcsi-rbd`: the client and rbd-fuse attach against a real Ceph
//! cluster, and one that cannot be reached.
//!
//! One binary per crate, one module per area (as wasmtime's `tests/all`): the crate and its
//! dependencies are linked once, not once per file. Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`.

mod bluestore;
mod ceph_rbd;
mod fuse_attach;
mod unreachable;
