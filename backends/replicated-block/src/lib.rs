//! The `replicated-block` backend: placement and sizing policy (replica count, nodes,
//! rounding) for the host's replicated block engine, driven through
//! `wasmcsi:backend/block` (declared in `wit/backend.wit`).
//!
//! Not written yet: the engine itself is its own issue ("The replicated block data path"),
//! and this component follows it. Until then the host refuses to link `block`, and this crate
//! builds no component.

pub mod policy;
