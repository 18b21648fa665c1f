//! `rbd`: RBD images on granted pools of a cluster the host is configured for, through the
//! host's librbd. Every call names where and as whom in an [`RbdPool`] (cluster, pool and the
//! CSI call's secret handles, which the host resolves; the guest never sees a key). [`Rbd`] is
//! the capability, [`RbdImport`] the component's import of it.
use crate::types::{Error, IoLimits, SecretRef};
use crate::wit::wasmcsi::backend::rbd as wit;

pub use wit::{CopyProgress, ImageInfo, ImageSnapshot, PoolStats, RbdPool};

/// Where images live: a configured cluster (ceph-csi's `clusterID`) and one of its pools. What a
/// backend keeps in its ids and state; [`Target::pool`] adds the credentials of one call.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    pub cluster: String,
    pub pool: String,
}

impl Target {
    pub fn new(cluster: impl Into<String>, pool: impl Into<String>) -> Self {
        Self { cluster: cluster.into(), pool: pool.into() }
    }

    /// The `rbd-pool` every [`Rbd`] call takes: this cluster and pool, as the user the call's
    /// `secrets` name (empty: read-only calls on credentials the host remembers).
    pub fn pool(&self, secrets: &[SecretRef]) -> RbdPool {
        RbdPool { cluster: self.cluster.clone(), pool: self.pool.clone(), secrets: secrets.to_vec() }
    }

    /// The cluster and pool an `rbd-pool` names.
    pub fn of(pool: &RbdPool) -> Self {
        Self::new(pool.cluster.clone(), pool.pool.clone())
    }
}

/// The image metadata keys of the read/write IOPS and bandwidth limits, as librbd reads them
/// (and ceph-csi and the host's `set-qos` set them), in [`IoLimits`] field order.
pub const QOS_KEYS: [&str; 4] = [
    "conf_rbd_qos_read_iops_limit",
    "conf_rbd_qos_write_iops_limit",
    "conf_rbd_qos_read_bps_limit",
    "conf_rbd_qos_write_bps_limit",
];

/// The QoS limits an image's metadata sets ([`QOS_KEYS`]); 0 where a key is absent. A value
/// that is no whole number (set by hand) counts as absent: librbd ignores it too.
pub fn qos_limits(metadata: &[(String, String)]) -> IoLimits {
    let get = |key: &str| metadata.iter().find(|(k, _)| k == key).and_then(|(_, v)| v.trim().parse().ok()).unwrap_or(0);
    IoLimits {
        read_iops: get(QOS_KEYS[0]),
        write_iops: get(QOS_KEYS[1]),
        read_bytes_per_second: get(QOS_KEYS[2]),
        write_bytes_per_second: get(QOS_KEYS[3]),
    }
}

/// The `rbd` capability: one method per WIT function, same errors (see `wit/backend.wit`).
pub trait Rbd {
    /// Create an image with features and metadata. Errors: already-exists, permission-denied.
    fn create(
        &self,
        pool: &RbdPool,
        name: &str,
        size_bytes: u64,
        features: &[String],
        data_pool: Option<&str>,
        metadata: &[(String, String)],
    ) -> Result<(), Error>;
    /// An image, `None` when absent.
    fn info(&self, pool: &RbdPool, name: &str) -> Result<Option<ImageInfo>, Error>;
    /// Images whose metadata `key` equals `value`.
    fn find_by_metadata(&self, pool: &RbdPool, key: &str, value: &str) -> Result<Vec<String>, Error>;
    /// Remove an image; absent succeeds. Errors: failed-precondition (snapshots).
    fn remove(&self, pool: &RbdPool, name: &str) -> Result<(), Error>;
    /// Grow an image. Errors: not-found, out-of-range (shrink).
    fn resize(&self, pool: &RbdPool, name: &str, size_bytes: u64) -> Result<(), Error>;
    /// Snapshot an image. Errors: not-found, already-exists.
    fn snapshot_create(&self, pool: &RbdPool, image: &str, snap: &str) -> Result<ImageSnapshot, Error>;
    /// Remove a snapshot (absent succeeds). Errors: failed-precondition (clones of it).
    fn snapshot_remove(&self, pool: &RbdPool, image: &str, snap: &str) -> Result<(), Error>;
    /// Protect a snapshot (already protected succeeds).
    fn snapshot_protect(&self, pool: &RbdPool, image: &str, snap: &str) -> Result<(), Error>;
    /// Snapshots of an image, oldest first. Errors: not-found.
    fn snapshot_list(&self, pool: &RbdPool, image: &str) -> Result<Vec<ImageSnapshot>, Error>;
    /// Clone `image@snap` into `child_pool/child` (same cluster, same credentials).
    fn clone_image(
        &self,
        pool: &RbdPool,
        image: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
    ) -> Result<(), Error>;
    /// Copy the parent's data into a clone and detach it.
    fn flatten(&self, pool: &RbdPool, image: &str) -> Result<(), Error>;
    /// Clones (`pool/image`) of `image@snap`. Errors: not-found.
    fn children(&self, pool: &RbdPool, image: &str, snap: &str) -> Result<Vec<String>, Error>;
    /// Pool usage.
    fn stats(&self, pool: &RbdPool) -> Result<PoolStats, Error>;
    /// Set the image's librbd QoS limits (0 removes one).
    fn set_qos(&self, pool: &RbdPool, image: &str, limits: &IoLimits) -> Result<(), Error>;
    /// One crash-consistent snapshot of every image in `images`: the RBD group snapshot
    /// `group@snap`, each image's part named `GROUP@SNAP` (listed and removable like any
    /// snapshot, restored by [`Rbd::snapshot_copy`]). The same again: the same parts.
    fn group_snapshot(
        &self,
        pool: &RbdPool,
        group: &str,
        images: &[String],
        snap: &str,
    ) -> Result<Vec<ImageSnapshot>, Error>;
    /// Remove the group snapshot `group@snap` and its group; absent: success.
    fn group_snapshot_remove(&self, pool: &RbdPool, group: &str, snap: &str) -> Result<(), Error>;
    /// Restore `image@snap` (or `GROUP@SNAP`) by a full copy into a new image, in the host's
    /// background: ask again until [`CopyProgress::done`].
    #[allow(clippy::too_many_arguments, reason = "the WIT function's parameters")]
    fn snapshot_copy(
        &self,
        pool: &RbdPool,
        image: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
        metadata: &[(String, String)],
    ) -> Result<CopyProgress, Error>;
}

/// The component's `rbd` import.
#[derive(Debug, Clone, Copy, Default)]
pub struct RbdImport;

impl Rbd for RbdImport {
    fn create(
        &self,
        pool: &RbdPool,
        name: &str,
        size_bytes: u64,
        features: &[String],
        data_pool: Option<&str>,
        metadata: &[(String, String)],
    ) -> Result<(), Error> {
        wit::create(pool, name, size_bytes, features, data_pool, metadata)
    }
    fn info(&self, pool: &RbdPool, name: &str) -> Result<Option<ImageInfo>, Error> {
        wit::info(pool, name)
    }
    fn find_by_metadata(&self, pool: &RbdPool, key: &str, value: &str) -> Result<Vec<String>, Error> {
        wit::find_by_metadata(pool, key, value)
    }
    fn remove(&self, pool: &RbdPool, name: &str) -> Result<(), Error> {
        wit::remove(pool, name)
    }
    fn resize(&self, pool: &RbdPool, name: &str, size_bytes: u64) -> Result<(), Error> {
        wit::resize(pool, name, size_bytes)
    }
    fn snapshot_create(&self, pool: &RbdPool, image: &str, snap: &str) -> Result<ImageSnapshot, Error> {
        wit::snapshot_create(pool, image, snap)
    }
    fn snapshot_remove(&self, pool: &RbdPool, image: &str, snap: &str) -> Result<(), Error> {
        wit::snapshot_remove(pool, image, snap)
    }
    fn snapshot_protect(&self, pool: &RbdPool, image: &str, snap: &str) -> Result<(), Error> {
        wit::snapshot_protect(pool, image, snap)
    }
    fn snapshot_list(&self, pool: &RbdPool, image: &str) -> Result<Vec<ImageSnapshot>, Error> {
        wit::snapshot_list(pool, image)
    }
    fn clone_image(
        &self,
        pool: &RbdPool,
        image: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
    ) -> Result<(), Error> {
        wit::clone(pool, image, snap, child_pool, child, features)
    }
    fn flatten(&self, pool: &RbdPool, image: &str) -> Result<(), Error> {
        wit::flatten(pool, image)
    }
    fn children(&self, pool: &RbdPool, image: &str, snap: &str) -> Result<Vec<String>, Error> {
        wit::children(pool, image, snap)
    }
    fn stats(&self, pool: &RbdPool) -> Result<PoolStats, Error> {
        wit::stats(pool)
    }
    fn set_qos(&self, pool: &RbdPool, image: &str, limits: &IoLimits) -> Result<(), Error> {
        wit::set_qos(pool, image, *limits)
    }
    fn group_snapshot(
        &self,
        pool: &RbdPool,
        group: &str,
        images: &[String],
        snap: &str,
    ) -> Result<Vec<ImageSnapshot>, Error> {
        wit::group_snapshot(pool, group, images, snap)
    }
    fn group_snapshot_remove(&self, pool: &RbdPool, group: &str, snap: &str) -> Result<(), Error> {
        wit::group_snapshot_remove(pool, group, snap)
    }
    fn snapshot_copy(
        &self,
        pool: &RbdPool,
        image: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
        metadata: &[(String, String)],
    ) -> Result<CopyProgress, Error> {
        wit::snapshot_copy(pool, image, snap, child_pool, child, features, metadata)
    }
}
