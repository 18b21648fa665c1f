//! The capability providers of a composed backend test (`wasmcsi backend compose`): the
//! `wasmcsi:testkit/capabilities` world, exporting every capability a backend may import with
//! no wasmcsi host behind it, so that the plain `wasmtime run` can drive a backend.
//!
//! - `log`: one line per call on stderr (`LEVEL message key=value ...`);
//! - `kv`, `nfs`, `rbd`, `block`, `backup`: the SDK's in-memory fakes
//!   ([`wasmcsi_backend_sdk::fake`]), the same semantics the SDK's unit tests run against,
//!   answering what a wasmcsi host does not provide yet as the host does (`unimplemented`). They
//!   grant what the backend names (any NFS export, any cluster's pool), offer three replica nodes
//!   and no backup target: grant scoping is the real host's business, checked by `wasmcsi
//!   backend check`;
//! - `dir`: real files ([`dir`]) under the WASI directory preopened as `/`, granted as the root
//!   `default` (`wasmtime run --dir ROOT::/`).
//!
//! State lives in the instance (one `wasmtime run`). It owns no policy and no checks (those are
//! `wasmcsi-testkit-checks`); [`convert`] maps this world's generated types to the SDK's.
#![deny(unsafe_code)]

pub mod convert;
pub mod dir;
pub mod exports;

#[allow(unsafe_code, reason = "wit-bindgen expands to the canonical ABI's unsafe glue")]
#[doc(hidden)]
pub mod wit {
    wit_bindgen::generate!({
        path: ["../../../wit", "../../../wit/testkit"],
        world: "wasmcsi:testkit/capabilities@0.1.0",
    });

    // Natively the crate is an rlib of unit tests: no exports (their names contain ':').
    #[cfg(target_arch = "wasm32")]
    use crate::exports::Provider;
    #[cfg(target_arch = "wasm32")]
    export!(Provider with_types_in crate::wit);
}

/// The replica nodes the `block` fake offers: three, so that a backend placing three replicas
/// on distinct nodes can.
pub const BLOCK_NODES: &[&str] = &["node-1", "node-2", "node-3"];
/// Size of each replica node.
pub const BLOCK_NODE_BYTES: u64 = 1 << 40;
