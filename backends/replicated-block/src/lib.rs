//! The `replicated-block` backend: placement and sizing policy (replica count, nodes,
//! rounding) for the host's replicated block engine, driven through
//! `wasmcsi:backend/block` (declared in `wit/backend.wit`) on `wasmcsi-backend-sdk`.
//!
//! Not written yet: it follows the engine into CSI. Until then the host refuses to link
//! `block`, and this crate builds no component.
