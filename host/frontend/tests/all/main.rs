//! The integration tests of `wasmcsi-frontend`: the FUSE + loop frontend against the real kernel.
//!
//! One binary per crate, one module per area (as wasmtime's `tests/all`): the crate and its
//! dependencies are linked once, not once per file. Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`.

mod fuse_loop;
