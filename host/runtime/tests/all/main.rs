//! The integration tests of `wasmcsi-runtime`: real components (the bundled backends, the
//! hostile and previous-contract fixtures) in a real `Runtime`. `log_budget` is a binary of its
//! own: it installs the process's tracing subscriber.
//!
//! One binary per crate, one module per area (as wasmtime's `tests/all`): the crate and its
//! dependencies are linked once, not once per file. Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`.

mod compat;
mod dir_hardening;
mod nfs_backend;
mod oci_source;
mod rbd_backend;
mod sandbox;
