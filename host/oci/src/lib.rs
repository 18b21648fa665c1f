//! Backends as OCI artifacts. This crate owns the bytes between a registry and the host: the
//! CNCF Wasm OCI artifact layout (config `application/vnd.wasm.config.v0+json`, one layer
//! `application/wasm`), pushing a component in it, pulling one back *verified* (the manifest's
//! digest, the layer's digest, a bound on its size and on the time of every registry request),
//! a content-addressed cache that never holds a partial file, and cosign-compatible signatures
//! ("simple signing" payloads under the tag `sha256-<hex>.sig`, ECDSA P-256 with SHA-256).
//!
//! It does not know what a component *is*: the contract version and the backend's `info()`
//! that a push writes into annotations come from the caller (the runtime loads the component),
//! and loading a pulled component is the runtime's registry.
//!
//! ```text
//!   Source ("oci://REGISTRY/REPO@sha256:…")
//!      │ RegistryClient (auth from a docker config, TLS with a CA file, bounded requests)
//!      ▼
//!   fetch::fetch ── manifest: digest checked, a Wasm artifact? ── layer: size bound, digest
//!      │            signatures (when keys are configured): payload names this digest, a key verifies
//!      ▼
//!   ArtifactCache (temp file + rename; read back re-verified)
//! ```
pub mod artifact;
pub mod auth;
pub mod cache;
pub mod client;
pub mod error;
pub mod fetch;
pub mod push;
pub mod signature;
pub mod source;

pub use artifact::{ArtifactAnnotations, MEDIA_TYPE_WASM_CONFIG, MEDIA_TYPE_WASM_LAYER};
pub use cache::ArtifactCache;
pub use client::{ClientOptions, RegistryClient};
pub use error::OciError;
pub use fetch::{FetchPolicy, Fetched, fetch};
pub use push::{push, sign};
pub use signature::{PublicKeys, SigningKey};
pub use source::Source;

/// `sha256:<hex>` of bytes, as OCI writes digests.
pub fn sha256_digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(bytes)))
}
