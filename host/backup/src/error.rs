//! The crate's errors, each carrying what identifies it (target, key, volume, backup, chunk hash and
//! volume offset), and [`ErrorKind`], the classification the CSI layer maps to gRPC codes.

use std::fmt;

use crate::chunk::ChunkHash;

/// What went wrong, coarsely: the CSI layer maps each kind to one gRPC code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The target refused the credentials or the operation (wrong key, no permission).
    Forbidden,
    /// The bucket (or the filesystem target's root directory) does not exist.
    BucketMissing,
    /// The endpoint could not be reached (connection refused, DNS, timeout).
    Unreachable,
    /// The target has no room left (disk full, quota exceeded).
    TargetFull,
    /// A chunk or manifest is stored but its content is wrong.
    Corrupt,
    /// A chunk a manifest references is gone from the target.
    MissingChunk,
    /// The backup (or the target object asked for) does not exist.
    NotFound,
    /// Another operation holds the volume (a garbage collection, or a backup for a collection).
    Busy,
    /// The caller cancelled the operation.
    Cancelled,
    /// The request itself is wrong (a bad name, a chunk size out of range, a size mismatch).
    Invalid,
    /// Reading the volume being backed up, or writing the restore sink, failed.
    Local,
    /// Anything else the target answered.
    Other,
}

/// How a target operation failed, classified from the target's own answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TargetErrorKind {
    NotFound,
    Forbidden,
    BucketMissing,
    Unreachable,
    Full,
    Other,
}

impl fmt::Display for TargetErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotFound => "not found",
            Self::Forbidden => "access denied (wrong credentials or no permission)",
            Self::BucketMissing => "bucket missing",
            Self::Unreachable => "endpoint unreachable",
            Self::Full => "target full",
            Self::Other => "failed",
        })
    }
}

/// One failed operation on a [`crate::Target`]. Never holds credentials: the message is the
/// target's answer (status, error code) or the OS error.
#[derive(Debug, thiserror::Error)]
#[error("{op} {key} on {target}: {kind}: {message}")]
pub struct TargetError {
    pub kind: TargetErrorKind,
    /// `put`, `get`, `head`, `list`, `delete`.
    pub op: &'static str,
    pub key: String,
    /// The target as [`crate::Target::describe`] names it.
    pub target: String,
    pub message: String,
}

/// Everything the backup store's operations return.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Target(#[from] TargetError),
    #[error("backup {backup} of volume {volume} not found")]
    BackupNotFound { volume: String, backup: String },
    #[error("chunk {hash} at volume offset {offset} of backup {backup} (volume {volume}) is missing from the target")]
    MissingChunk { volume: String, backup: String, hash: ChunkHash, offset: u64 },
    #[error("chunk {hash} at volume offset {offset} of backup {backup} (volume {volume}) is corrupt: {why}")]
    CorruptChunk { volume: String, backup: String, hash: ChunkHash, offset: u64, why: String },
    #[error("manifest {key} is corrupt: {why}")]
    CorruptManifest { key: String, why: String },
    #[error("volume {volume} is busy: {holder}")]
    Busy { volume: String, holder: String },
    #[error(
        "backup {backup} of volume {volume} lost its lease (not renewed for {seconds} s); a garbage collection may run"
    )]
    LeaseLost { volume: String, backup: String, seconds: u64 },
    #[error("{what} cancelled")]
    Cancelled { what: String },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("reading the volume {volume} at offset {offset}: {source}")]
    Source { volume: String, offset: u64, source: std::io::Error },
    #[error("writing the restore of volume {volume} at offset {offset}: {source}")]
    Sink { volume: String, offset: u64, source: std::io::Error },
    #[error("backup target {name}: {why}")]
    Config { name: String, why: String },
}

impl Error {
    /// The classification the CSI layer maps to a gRPC code.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Target(e) => match e.kind {
                TargetErrorKind::NotFound => ErrorKind::NotFound,
                TargetErrorKind::Forbidden => ErrorKind::Forbidden,
                TargetErrorKind::BucketMissing => ErrorKind::BucketMissing,
                TargetErrorKind::Unreachable => ErrorKind::Unreachable,
                TargetErrorKind::Full => ErrorKind::TargetFull,
                TargetErrorKind::Other => ErrorKind::Other,
            },
            Self::BackupNotFound { .. } => ErrorKind::NotFound,
            Self::MissingChunk { .. } => ErrorKind::MissingChunk,
            Self::CorruptChunk { .. } | Self::CorruptManifest { .. } => ErrorKind::Corrupt,
            Self::Busy { .. } | Self::LeaseLost { .. } => ErrorKind::Busy,
            Self::Cancelled { .. } => ErrorKind::Cancelled,
            Self::Invalid(_) | Self::Config { .. } => ErrorKind::Invalid,
            Self::Source { .. } | Self::Sink { .. } => ErrorKind::Local,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
