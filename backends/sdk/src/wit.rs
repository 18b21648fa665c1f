//! The WIT bindings: the one `wit_bindgen::generate!` of the guests, for the whole `backend`
//! world of `wit/` (never a copy of it). Hidden: a backend uses this crate's traits and
//! re-exports, never these modules. Unused imports cost nothing: `wit-component` keeps only
//! the interfaces the linked module calls (see the crate docs).
#![allow(unsafe_code, reason = "wit-bindgen expands to the canonical ABI's unsafe glue")]

wit_bindgen::generate!({
    path: "../../wit",
    world: "backend",
    // The export glue is expanded in the backend's crate, by `wasmcsi_backend_sdk::export!`.
    pub_export_macro: true,
    default_bindings_module: "wasmcsi_backend_sdk::wit",
    // Tests compare whole answers.
    additional_derives: [PartialEq, Eq],
});
