//! The Ceph RBD client behind the host's `rbd` capability (`wit/backend.wit`, interface
//! `rbd`), the node-side `rbd-fuse` attach for kernels without krbd/rbd-nbd ([`fuse_attach`];
//! [`fuse_daemons`] keeps many of them for a long-lived process). The Ceph cluster its tests
//! run against is test machinery of its own (`testing/ceph`, crate `wasmcsi-ceph`).
//!
//! What it owns: librados + librbd 16.2 through a small hand-written FFI; the grants of one
//! backend (which clusters, which pools: anything else is [`RbdError::PermissionDenied`] before
//! any traffic); name checks; a pooled connection per (cluster, user); a deadline on every
//! call, so an unreachable or frozen cluster is an [`RbdError::Unavailable`] naming its monitors,
//! never a hang; and the operations of the WIT interface with idempotent semantics where CSI
//! needs them (remove of an absent image succeeds, protect of a protected snapshot succeeds);
//! crash-consistent snapshots of several images (RBD group snapshots, [`group`]) and restores
//! of a snapshot by a copy in the background ([`copy`]).
//!
//! What it does not own: wasmtime (the runtime maps [`RbdError`] onto the WIT `error` and resolves
//! secret handles to [`RbdCredentials`] before calling here), the loop device / mkfs / mount over
//! an attached image (`wasmcsi-frontend`). [`krbd`] maps images where the kernel can (not on this
//! machine's kernel: the kernel-VM test tier tests it); rbd-nbd is not used.

mod client;
mod conn;
pub mod copy;
mod error;
pub mod fence;
mod ffi;
pub mod fuse_attach;
pub mod fuse_daemons;
pub mod group;
mod image;
pub mod krbd;
mod names;
mod qos;

pub use client::{RbdClient, RbdPool};
pub use copy::CopyProgress;
pub use error::RbdError;
pub use fence::{FENCE_LOCK, Fence, FenceHolder};
pub use group::GroupSnapshot;
pub use names::MAX_NAME;
pub use qos::QosLimits;

use std::fmt;
use std::time::Duration;

/// One cluster as the operator grants it to a backend: the name guests use, how to reach it,
/// and the only pools calls may name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RbdCluster {
    pub name: String,
    /// Monitor addresses as librados' `mon_host` takes them: `10.0.0.1`, `10.0.0.1:6789`,
    /// `[v2:10.0.0.1:3300,v1:10.0.0.1:6789]`.
    pub monitors: Vec<String>,
    pub pools: Vec<String>,
}

/// What the operator configured for one backend's `rbd` capability.
#[derive(Clone, Debug)]
pub struct RbdConfig {
    pub clusters: Vec<RbdCluster>,
    /// Bound on connecting (monitor session + authentication); also librados'
    /// `client_mount_timeout`.
    pub connect_timeout: Duration,
    /// Bound on one operation (which may be several RADOS calls); also librados'
    /// `rados_mon_op_timeout` and `rados_osd_op_timeout`.
    pub op_timeout: Duration,
    /// Calls per client that may be running at once; each runs on its own thread, and threads
    /// of calls past their deadline linger until librados' own timeout ends them.
    pub max_in_flight: usize,
}

impl RbdConfig {
    pub fn new(clusters: Vec<RbdCluster>) -> Self {
        Self {
            clusters,
            connect_timeout: Duration::from_secs(10),
            op_timeout: Duration::from_secs(30),
            max_in_flight: 64,
        }
    }
}

/// A cephx identity, resolved by the host from CSI secrets. `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct RbdCredentials {
    /// The id without `client.` (`admin`, `csi-rbd`); a `client.` prefix is stripped.
    pub user: String,
    key: String,
}

impl RbdCredentials {
    pub fn new(user: impl Into<String>, key: impl Into<String>) -> Self {
        let user = user.into();
        let user = user.strip_prefix("client.").map(str::to_owned).unwrap_or(user);
        Self { user, key: key.into() }
    }

    /// The secret itself, for what must hand it on (the rbd-fuse keyfile).
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl fmt::Debug for RbdCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RbdCredentials").field("user", &self.user).field("key", &"<redacted>").finish()
    }
}

/// What to create (WIT `rbd.create` minus the names).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageSpec {
    pub size_bytes: u64,
    /// Feature names as the `rbd` CLI spells them (`layering`, `exclusive-lock`, ...); empty
    /// means the cluster's default.
    pub features: Vec<String>,
    /// Pool for the data objects (erasure-coded pools); must be granted too.
    pub data_pool: Option<String>,
    pub metadata: Vec<(String, String)>,
}

/// Seconds and nanoseconds since the Unix epoch (WIT `types.timestamp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timestamp {
    pub seconds: i64,
    pub nanos: u32,
}

/// One image (WIT `rbd.image-info`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageInfo {
    pub name: String,
    pub size_bytes: u64,
    pub features: Vec<String>,
    /// `pool/image@snap` of the parent, while a clone is not flattened.
    pub parent: Option<String>,
    pub metadata: Vec<(String, String)>,
}

/// One snapshot (WIT `rbd.image-snapshot`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageSnapshot {
    pub name: String,
    pub size_bytes: u64,
    pub protected: bool,
    pub created: Timestamp,
}

/// Pool usage (WIT `rbd.pool-stats`), in bytes a user can store: `available` is the pool's
/// `max_avail` (raw free space divided by the replica count, up to the full ratio), `total` is
/// what is stored plus that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    pub total_bytes: u64,
    pub available_bytes: u64,
}
