//! The integration tests of `wasmcsi-nfs`: the client against a real nfs-ganesha.
//!
//! One binary per crate, one module per area (as wasmtime's `tests/all`): the crate and its
//! dependencies are linked once, not once per file. Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`.

mod ganesha_v3;
