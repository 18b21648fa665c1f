//! The host side of each WIT import, one module per capability. Every function is bounded
//! (see `capabilities::bounded`), traced, and reports failures as WIT `error` values.
pub mod block;
pub mod dir;
pub mod kv;
pub mod log;
pub mod nfs;
pub mod rbd;

use crate::state::CallState;

/// `types` only defines types, but the world imports it, so it needs an (empty) impl.
impl crate::bindings::types::Host for CallState {}
