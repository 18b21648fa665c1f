//! What a replica's storage can fail with, and the conversions every file of the replica store
//! uses. Its own module so the store's parts (header file, layers, block maps, record) depend on
//! it rather than on the store that is built from them.

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::protocol::Status;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("replica header {path} is corrupt: {what}")]
    CorruptHeader { path: PathBuf, what: String },
    #[error("replica already exists in {0}")]
    AlreadyExists(PathBuf),
    #[error("range {offset}+{len} is outside the volume of {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("request revision {request} is older than the replica's {replica}")]
    StaleRevision { request: u64, replica: u64 },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("no snapshot {name:?}")]
    SnapshotNotFound { name: String },
    #[error("snapshot {name:?} already exists and is not the newest with nothing written since")]
    SnapshotExists { name: String },
    /// A header commit failed half way: what is on disk may differ from what is in memory, so the
    /// store refuses everything until it is reopened from disk.
    #[error("replica in {0} failed a metadata commit earlier; reopen it")]
    Failed(PathBuf),
}

impl StoreError {
    /// The wire status that answers a request failing with this error.
    pub fn status(&self) -> Status {
        match self {
            Self::Io { .. } | Self::CorruptHeader { .. } | Self::Failed(_) => Status::IoError,
            Self::AlreadyExists(_) | Self::SnapshotExists { .. } => Status::AlreadyExists,
            Self::OutOfRange { .. } => Status::OutOfRange,
            Self::StaleRevision { .. } => Status::StaleRevision,
            Self::Invalid(_) => Status::Invalid,
            Self::SnapshotNotFound { .. } => Status::NotFound,
        }
    }
}

pub(crate) fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { op, path: path.to_path_buf(), source }
}

pub(crate) fn nix_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(nix::Error) -> StoreError + 'a {
    move |e| StoreError::Io { op, path: path.to_path_buf(), source: std::io::Error::from(e) }
}

pub(crate) fn to_off(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::Invalid(format!("offset {v} exceeds the file offset range")))
}
