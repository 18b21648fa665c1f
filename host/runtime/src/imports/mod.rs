//! The host side of each WIT import, one module per capability. Every function is bounded
//! (`local_io` inline, network work under the import timeout), traced, and reports failures
//! as WIT `error` values.
//!
//! Each capability is written as wasmtime writes WASI's (`wasmtime_wasi::WasiCtxView`): what
//! it needs of one backend is its `…Ctx` (resolved at load), what its host functions see of
//! one call is its `…CtxView`, a store lends that view through its `…View` trait, and
//! `add_to_instance` links the functions into an instance of the linker. So a capability
//! sees only its own slice of a call: no capability names the call's state (`state.rs`
//! composes the views) or another capability.
//!
//! A function of the current contract that this host does not provide yet answers
//! [`not_provided`] (after the checks it would make anyway: grants, arguments), as its WIT doc
//! says, never a silent success; a test pins each such answer.
pub mod backup;
pub mod block;
pub mod dir;
pub mod kv;
pub mod log;
pub mod nfs;
pub mod rbd;
pub mod types;

use crate::bindings::types::Error;

/// The answer of a function this host does not provide: `unimplemented`, saying what is not
/// provided (`what`: the function and the mechanism it needs, e.g. "block set-limits: I/O
/// limits").
pub fn not_provided(what: &str) -> Error {
    Error::Unimplemented(format!("{what}: not provided by this host"))
}
