//! Where backups are stored, behind one small trait: a filesystem path ([`FsTarget`]: an NFS mount
//! or a local disk) and S3-compatible object storage ([`S3Target`]). Keys are relative paths of
//! `[A-Za-z0-9._-]` components joined by `/` (built by [`crate::layout`] only).
//!
//! What the backup store needs from a target, and each target guarantees:
//! - `put` replaces an object atomically and durably: a reader sees the old object or the new
//!   one, never a part, and a `put` that returned survives a crash of the writer's machine;
//! - reads, heads and listings see every `put` that returned (S3 and RADOS Gateway are strongly
//!   consistent; a filesystem is);
//! - `modified` comes from one clock for every client (the server's, or the filesystem's), which
//!   leases and garbage collection compare with each other, never with a client's clock.

mod fs;
mod s3;

use std::fmt;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;

pub use fs::FsTarget;
pub use s3::S3Target;

use crate::error::TargetError;

/// One stored object as a listing or a head sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    pub modified: SystemTime,
}

/// A backup target.
#[async_trait]
pub trait Target: Send + Sync + fmt::Debug {
    /// How errors and logs name the target (`s3://bucket/prefix at endpoint`, a path); never a
    /// credential.
    fn describe(&self) -> &str;

    /// Stores `data` at `key`, replacing what was there (atomic and durable, see the module docs).
    async fn put(&self, key: &str, data: Bytes) -> Result<(), TargetError>;

    /// The whole object; [`crate::TargetErrorKind::NotFound`] when there is none.
    async fn get(&self, key: &str) -> Result<Bytes, TargetError>;

    /// The object's size and time, `None` when there is none.
    async fn head(&self, key: &str) -> Result<Option<ObjectInfo>, TargetError>;

    /// Every object whose key starts with `prefix` (a `…/` folder), in no particular order,
    /// streamed: a listing of millions of chunks is never held in memory at once.
    fn list<'a>(&'a self, prefix: &'a str) -> BoxStream<'a, Result<ObjectInfo, TargetError>>;

    /// The names of the folders directly under `prefix` (S3 common prefixes), without the prefix
    /// or the trailing `/`.
    async fn folders(&self, prefix: &str) -> Result<Vec<String>, TargetError>;

    /// Removes the object; removing one that is not there is not an error.
    async fn delete(&self, key: &str) -> Result<(), TargetError>;
}
