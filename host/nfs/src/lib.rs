//! The userspace NFS client behind the host's `nfs` capability (`wit/backend.wit`, interface
//! `nfs`). The nfs-ganesha its tests run against is
//! test machinery of its own (`testing/ganesha`, crate `wasmcsi-ganesha`).
//!
//! What it owns: NFSv3 over TCP to the exports an operator granted a backend (portmapper → MOUNT
//! → NFS, as `nfs3_client` does it), a connection pool per export with reconnect after failure,
//! a timeout on every connection attempt and every call (an unreachable or frozen server is an
//! [`NfsError::Unavailable`] naming the server, never a hang), path checks that mirror the local
//! `dir` capability (relative paths only, no `..`, no NUL, no symlink on the way), and the
//! operations of the WIT interface with the same semantics: atomic `write-file` (temp + rename),
//! `copy-tree` through the client (NFSv3 has no server-side copy) with modes, owners, times and
//! symlinks preserved, `remove-all` where absent succeeds, `usage`, `fs-stats`.
//!
//! What it does not own: wasmtime (the runtime maps [`NfsError`] onto the WIT `error` and calls
//! these functions from its host impl), kernel mounts (the node side), NFSv4 (ganesha serves it to
//! kernels; this client speaks v3, which needs no state and no grace period).

#[macro_use]
mod pool;
mod background;
mod client;
mod copy;
mod error;
mod handles;
#[cfg(feature = "test-hooks")]
mod hold;
mod path;

pub use background::CopyProgress;
pub use client::NfsClient;
pub use error::NfsError;
#[cfg(feature = "test-hooks")]
pub use hold::{CopyHold, hold_copies};

use std::fmt;
use std::time::Duration;

/// Files `read-file` returns at most, like the `dir` capability: metadata, not data.
pub const MAX_READ: u64 = 1 << 20;

/// One export, as the operator grants it and the guest names it: `server` is an IP address or
/// a host name, `share` the path the server exports (`/export`; with ganesha's
/// `mount_path_pseudo` that is the pseudo path).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NfsExport {
    pub server: String,
    pub share: String,
}

impl NfsExport {
    pub fn new(server: impl Into<String>, share: impl Into<String>) -> Self {
        Self { server: server.into(), share: share.into() }.normalized()
    }

    /// `/export/` and `/export` are one export; grants and calls compare normalized values.
    fn normalized(mut self) -> Self {
        while self.share.len() > 1 && self.share.ends_with('/') {
            self.share.pop();
        }
        self
    }
}

impl fmt::Display for NfsExport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.server, self.share)
    }
}

/// What the operator configured for one backend's `nfs` capability.
#[derive(Clone, Debug)]
pub struct NfsConfig {
    /// The only exports calls may name; anything else is `PermissionDenied` before any traffic.
    pub exports: Vec<NfsExport>,
    /// Bound on establishing a connection: name resolution, portmapper, MOUNT and the NFS
    /// connection together.
    pub connect_timeout: Duration,
    /// Bound on one NFS call once connected (not on a whole operation: a `copy-tree` of a large
    /// tree is many calls, each bounded).
    pub op_timeout: Duration,
    /// Bound on COMMIT, which flushes everything written unstably to a file; it may take longer
    /// than one call of data (the server fsyncs up to a whole file).
    pub commit_timeout: Duration,
    /// Connections per export; also how many calls a `copy-tree` keeps in flight (the RPC
    /// client of `nfs3_client` has one call per connection at a time).
    pub max_connections: usize,
    /// Largest READ/WRITE a copy issues; the server's FSINFO `rtmax`/`wtmax` lower it.
    pub copy_chunk: u32,
    /// Connect from a reserved port (< 1024), as kernel nfsd's default `secure` export option
    /// requires. Needs root or CAP_NET_BIND_SERVICE.
    pub reserved_port: bool,
    /// The portmapper's port (111 everywhere but in tests).
    pub portmapper_port: u16,
}

impl NfsConfig {
    pub fn new(exports: Vec<NfsExport>) -> Self {
        Self {
            exports: exports.into_iter().map(NfsExport::normalized).collect(),
            connect_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(10),
            commit_timeout: Duration::from_secs(120),
            max_connections: 8,
            copy_chunk: 1 << 20,
            reserved_port: true,
            portmapper_port: 111,
        }
    }
}

/// What kind of file system object a path is (WIT `dir.file-kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Directory,
    File,
    Symlink,
    Other,
}

/// Seconds and nanoseconds since the Unix epoch (WIT `types.timestamp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timestamp {
    pub seconds: i64,
    pub nanos: u32,
}

/// Metadata of one path (WIT `dir.file-stat`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileStat {
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits including setuid/setgid/sticky (`& 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub modified: Timestamp,
}

/// Space of an export (WIT `dir.space`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Space {
    pub total_bytes: u64,
    pub available_bytes: u64,
}
