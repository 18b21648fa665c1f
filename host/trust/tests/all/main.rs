//! The integration tests of `wasmcsi-trust`: mutual TLS, rotation and the listener's bounds
//! over real TCP on loopback.
//!
//! One binary per crate, one module per area. Run one area with
//! `cargo test --release --workspace --locked --test all -- MODULE::`. The bounds tests that
//! measure a process (memory per connection, CPU under descriptor exhaustion) run their server
//! in a child process (this binary again, see `support::child`), so nothing else in this
//! binary disturbs the numbers and a lowered descriptor limit stays in the child.

mod bounds;
mod mtls;
mod rotation;
mod support;
