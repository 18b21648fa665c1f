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
pub mod block;
pub mod dir;
pub mod kv;
pub mod log;
pub mod nfs;
pub mod rbd;
pub mod types;
