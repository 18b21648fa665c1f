//! One error type for everything between a registry and the cache, each case naming what it
//! was about (the reference, the digest, the file).
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OciError {
    /// A reference that is not `oci://REGISTRY/REPO(:TAG|@sha256:HEX)`.
    #[error("{reference:?} is not an OCI source: {why}")]
    Source { reference: String, why: String },
    /// A source naming a tag where a digest is required.
    #[error("{reference} names a tag, not a digest: pin it (@sha256:…) or opt in with allow_tag = true")]
    TagNotAllowed { reference: String },
    /// The registry answered with an error, or could not be reached.
    #[error("registry {operation} of {reference}: {message}")]
    Registry { operation: &'static str, reference: String, message: String },
    /// A registry request took longer than its bound.
    #[error("registry {operation} of {reference}: no answer within {timeout_ms} ms")]
    Timeout { operation: &'static str, reference: String, timeout_ms: u64 },
    /// Bytes whose sha256 is not the digest they were fetched by.
    #[error("digest mismatch on {what} of {reference}: expected {expected}, got {actual}")]
    DigestMismatch { what: &'static str, reference: String, expected: String, actual: String },
    /// A manifest that is not the Wasm artifact layout.
    #[error("{reference} is not a Wasm artifact: {why}")]
    NotWasmArtifact { reference: String, why: String },
    /// A layer larger than the configured bound.
    #[error("{reference}: layer of {size} bytes exceeds the bound of {limit} bytes")]
    TooLarge { reference: String, size: u64, limit: u64 },
    /// No signature of this digest verifies with any configured key.
    #[error("{reference}: signature refused: {why}")]
    Signature { reference: String, why: String },
    /// A key file that cannot be read or is not an ECDSA P-256 key.
    #[error("key {path}: {why}")]
    Key { path: PathBuf, why: String },
    /// The registry credentials file or the CA file.
    #[error("{what} {path}: {why}")]
    Config { what: &'static str, path: PathBuf, why: String },
    /// Reading or writing the cache.
    #[error("artifact cache {path}: {source}")]
    Cache { path: PathBuf, source: std::io::Error },
}
