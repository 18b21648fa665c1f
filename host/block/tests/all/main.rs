//! The integration tests of `wasmcsi-block`: replica servers, the catalog, the control surface
//! and replicated volumes over real TCP on loopback, plaintext and mutual TLS.
//!
//! One binary per crate, one module per area (as wasmtime's `tests/all`): the crate and its
//! dependencies are linked once, not once per file. Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`.

mod catalog;
mod control;
mod engine_tls;
mod replica_server;
mod replica_tls;
mod replicated_volume;
