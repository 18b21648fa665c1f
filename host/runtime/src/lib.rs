//! The sandbox. Loads backend components built against any contract version it serves
//! (`compat`: `wasmcsi:backend@0.1.0` and `@0.2.0`), checks what they import against the
//! operator's grants, links the granted capabilities, and runs every backend call in a fresh,
//! bounded store (memory cap, wall-clock deadline, optional fuel, concurrency limit, per-import
//! timeouts). Traps, timeouts and OOMs come back as [`CallError`] values; nothing a guest does
//! can take the process down. It knows nothing of CSI or gRPC: that is `wasmcsi-csi`.
//!
//! # The boundary, where each part of it is written
//!
//! - The contract's names and versions: `contract.rs`; each version's Rust types:
//!   `bindings.rs` (one `bindgen!` per version).
//! - **An export** (what the host calls): one row in the export table, `exports.rs`, which
//!   generates the `compat::Driver` trait, the current version's calls (`compat/current.rs`),
//!   the typed entry points (`Backend::create_volume`, …, in `backend.rs`) and the native test
//!   backend's table; plus one entry per previous contract version in its `impl Driver`
//!   (`compat/v0_1.rs`). `exports.rs` lists the steps.
//! - **An import** (what a backend calls): its host function in `imports/NAME.rs`, on that
//!   capability's view of the call (`…CtxView`); bindgen's `Host` trait makes a missing one a
//!   compile error. A new *capability*: a module in `imports/` (its `…Ctx`, `…CtxView`,
//!   `…View`, `add_to_instance`), a case of `capabilities::Capability` with its grant check,
//!   its context in `state::Capabilities` (built in `Runtime::assemble`) and its view in
//!   `state.rs`, an arm in `compat::link`.
//! - What one call's store holds and lends each capability: `state.rs`.
//!
//! With the `native` feature (benchmarks and tests only), `native` links backends into the
//! host instead of loading components; production builds carry none of it.
pub mod backend;
pub mod backups;
pub mod bindings;
pub mod cache;
pub mod call_error;
pub mod capabilities;
pub mod compat;
pub mod config;
pub mod contract;
pub mod executor;
mod exports;
mod imports;
mod limiter;
mod local_io;
pub mod metadata;
pub mod metrics;
#[cfg(feature = "native")]
pub mod native;
pub mod registry;
pub mod runtime;
pub mod secrets;
mod state;
pub mod wasm_engine;

pub use backend::Backend;
pub use bindings::driver;
pub use bindings::types::Error as WitError;
pub use call_error::{CallError, describe};
pub use contract::ContractVersion;
/// Map a backend-relative path under a granted dir root onto the host, refusing escapes.
pub use imports::dir::resolve as resolve_dir_path;
/// Tests hold background `dir` copies before they report done (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
pub use imports::dir::{CopyHold as DirCopyHold, hold_copies as hold_dir_copies};
pub use registry::Registry;
pub use runtime::{LoadError, Runtime, RuntimeOptions};
pub use secrets::{Secrets, secret_refs};
pub use state::CallState;
