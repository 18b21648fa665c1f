//! The sandbox. Loads backend components built against any contract version it serves
//! (`compat`: `wasmcsi:backend@0.1.0` and `@0.2.0`), checks what they import against the
//! operator's grants, links the granted capabilities, and runs every backend call in a fresh,
//! bounded store (memory cap, wall-clock deadline, optional fuel, concurrency limit, per-import
//! timeouts). Traps, timeouts and OOMs come back as [`CallError`] values; nothing a guest does
//! can take the process down. It knows nothing of CSI or gRPC: that is `wasmcsi-csi`.
pub mod backend;
pub mod bindings;
pub mod cache;
pub mod capabilities;
pub mod compat;
pub mod config;
pub mod engine;
pub mod executor;
mod imports;
pub mod metadata;
pub mod metrics;
pub mod native;
pub mod registry;
pub mod runtime;
mod state;

pub use backend::{Backend, CallError, Secrets, describe, secret_refs};
pub use bindings::driver;
pub use bindings::types::Error as WitError;
pub use compat::ContractVersion;
/// Map a backend-relative path under a granted dir root onto the host, refusing escapes.
pub use imports::dir::resolve as resolve_dir_path;
/// Tests hold background `dir` copies before they report done (feature `test-hooks`).
#[cfg(feature = "test-hooks")]
pub use imports::dir::{CopyHold as DirCopyHold, hold_copies as hold_dir_copies};
pub use registry::Registry;
pub use runtime::{LoadError, Runtime, RuntimeOptions};
pub use state::CallState;
