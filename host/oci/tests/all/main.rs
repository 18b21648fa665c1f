//! The integration tests of `wasmcsi-oci`: a real registry (distribution v2 with TLS and basic
//! auth, `wasmcsi-oci-registry`) pushed to and pulled from with the crate's own client.
//!
//! One binary per crate, one module per area (as wasmtime's `tests/all`). Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`.
#![allow(clippy::unwrap_used, reason = "tests")]

mod registry;
