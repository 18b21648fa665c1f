//! The sandbox. Loads backend components built against any contract version it serves
//! (`compat`: `wasmcsi:backend@0.1.0` and `@0.2.0`), checks what they import against the
//! operator's grants, links the granted capabilities, and runs every backend call in a fresh,
//! bounded store (memory cap, wall-clock deadline, optional fuel, concurrency limit, per-import
//! timeouts). Traps, timeouts and OOMs come back as [`CallError`] values; nothing a guest does
//! can take the process down. It knows nothing of CSI or gRPC: that is `wasmcsi-csi`.
//!
//! Each capability sees only its own view of a call (`imports::NAME`'s `…CtxView`); `state.rs`
//! holds the call's store data and lends each capability its view.
pub mod backend;
pub mod bindings;
pub mod cache;
pub mod call_error;
pub mod capabilities;
pub mod compat;
pub mod config;
pub mod contract;
pub mod engine;
pub mod executor;
mod imports;
mod limiter;
mod local_io;
pub mod metadata;
pub mod metrics;
pub mod native;
pub mod registry;
pub mod runtime;
pub mod secrets;
mod state;

pub use backend::Backend;
pub use bindings::driver;
pub use bindings::types::Error as WitError;
pub use call_error::{CallError, describe};
pub use contract::ContractVersion;
/// Map a backend-relative path under a granted dir root onto the host, refusing escapes.
pub use imports::dir::resolve as resolve_dir_path;
pub use registry::Registry;
pub use runtime::{LoadError, Runtime, RuntimeOptions};
pub use secrets::{Secrets, secret_refs};
pub use state::CallState;
