//! `rbd`: RBD images on granted pools of a cluster the host is configured for, through the
//! host's librbd. Credentials travel as [`SecretRef`] handles the host resolves; the guest never
//! sees a key. [`Rbd`] is the capability, [`RbdImport`] the component's import of it.
use crate::types::{Error, SecretRef};
use crate::wit::wasmcsi::backend::rbd as wit;

pub use wit::{ImageInfo, ImageSnapshot, PoolStats};

/// Where images live: a configured cluster (ceph-csi's `clusterID`) and one of its pools.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    pub cluster: String,
    pub pool: String,
}

impl Target {
    pub fn new(cluster: impl Into<String>, pool: impl Into<String>) -> Self {
        Self { cluster: cluster.into(), pool: pool.into() }
    }
}

/// The `rbd` capability: one method per WIT function, same errors (see `wit/backend.wit`).
/// `secrets` are the CSI call's; empty where CSI passes none.
#[allow(clippy::too_many_arguments, reason = "mirrors the WIT functions one to one")]
pub trait Rbd {
    /// Create an image with features and metadata. Errors: already-exists, permission-denied.
    fn create(
        &self,
        t: &Target,
        name: &str,
        size_bytes: u64,
        features: &[String],
        data_pool: Option<&str>,
        metadata: &[(String, String)],
        secrets: &[SecretRef],
    ) -> Result<(), Error>;
    /// An image, `None` when absent.
    fn info(&self, t: &Target, name: &str, secrets: &[SecretRef]) -> Result<Option<ImageInfo>, Error>;
    /// Images whose metadata `key` equals `value`.
    fn find_by_metadata(&self, t: &Target, key: &str, value: &str, secrets: &[SecretRef])
    -> Result<Vec<String>, Error>;
    /// Remove an image; absent succeeds. Errors: failed-precondition (snapshots).
    fn remove(&self, t: &Target, name: &str, secrets: &[SecretRef]) -> Result<(), Error>;
    /// Grow an image. Errors: not-found, out-of-range (shrink).
    fn resize(&self, t: &Target, name: &str, size_bytes: u64, secrets: &[SecretRef]) -> Result<(), Error>;
    /// Snapshot an image. Errors: not-found, already-exists.
    fn snapshot_create(
        &self,
        t: &Target,
        image: &str,
        snap: &str,
        secrets: &[SecretRef],
    ) -> Result<ImageSnapshot, Error>;
    /// Remove a snapshot (absent succeeds). Errors: failed-precondition (clones of it).
    fn snapshot_remove(&self, t: &Target, image: &str, snap: &str, secrets: &[SecretRef]) -> Result<(), Error>;
    /// Protect a snapshot (already protected succeeds).
    fn snapshot_protect(&self, t: &Target, image: &str, snap: &str, secrets: &[SecretRef]) -> Result<(), Error>;
    /// Snapshots of an image, oldest first. Errors: not-found.
    fn snapshot_list(&self, t: &Target, image: &str, secrets: &[SecretRef]) -> Result<Vec<ImageSnapshot>, Error>;
    /// Clone `image@snap` into `child_pool/child` (same cluster).
    fn clone_image(
        &self,
        t: &Target,
        image: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
        secrets: &[SecretRef],
    ) -> Result<(), Error>;
    /// Copy the parent's data into a clone and detach it.
    fn flatten(&self, t: &Target, image: &str, secrets: &[SecretRef]) -> Result<(), Error>;
    /// Clones (`pool/image`) of `image@snap`. Errors: not-found.
    fn children(&self, t: &Target, image: &str, snap: &str, secrets: &[SecretRef]) -> Result<Vec<String>, Error>;
    /// Pool usage.
    fn stats(&self, t: &Target, secrets: &[SecretRef]) -> Result<PoolStats, Error>;
}

/// The component's `rbd` import.
#[derive(Debug, Clone, Copy, Default)]
pub struct RbdImport;

impl Rbd for RbdImport {
    fn create(
        &self,
        t: &Target,
        name: &str,
        size_bytes: u64,
        features: &[String],
        data_pool: Option<&str>,
        metadata: &[(String, String)],
        secrets: &[SecretRef],
    ) -> Result<(), Error> {
        wit::create(&t.cluster, &t.pool, name, size_bytes, features, data_pool, metadata, secrets)
    }
    fn info(&self, t: &Target, name: &str, secrets: &[SecretRef]) -> Result<Option<ImageInfo>, Error> {
        wit::info(&t.cluster, &t.pool, name, secrets)
    }
    fn find_by_metadata(
        &self,
        t: &Target,
        key: &str,
        value: &str,
        secrets: &[SecretRef],
    ) -> Result<Vec<String>, Error> {
        wit::find_by_metadata(&t.cluster, &t.pool, key, value, secrets)
    }
    fn remove(&self, t: &Target, name: &str, secrets: &[SecretRef]) -> Result<(), Error> {
        wit::remove(&t.cluster, &t.pool, name, secrets)
    }
    fn resize(&self, t: &Target, name: &str, size_bytes: u64, secrets: &[SecretRef]) -> Result<(), Error> {
        wit::resize(&t.cluster, &t.pool, name, size_bytes, secrets)
    }
    fn snapshot_create(
        &self,
        t: &Target,
        image: &str,
        snap: &str,
        secrets: &[SecretRef],
    ) -> Result<ImageSnapshot, Error> {
        wit::snapshot_create(&t.cluster, &t.pool, image, snap, secrets)
    }
    fn snapshot_remove(&self, t: &Target, image: &str, snap: &str, secrets: &[SecretRef]) -> Result<(), Error> {
        wit::snapshot_remove(&t.cluster, &t.pool, image, snap, secrets)
    }
    fn snapshot_protect(&self, t: &Target, image: &str, snap: &str, secrets: &[SecretRef]) -> Result<(), Error> {
        wit::snapshot_protect(&t.cluster, &t.pool, image, snap, secrets)
    }
    fn snapshot_list(&self, t: &Target, image: &str, secrets: &[SecretRef]) -> Result<Vec<ImageSnapshot>, Error> {
        wit::snapshot_list(&t.cluster, &t.pool, image, secrets)
    }
    fn clone_image(
        &self,
        t: &Target,
        image: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
        secrets: &[SecretRef],
    ) -> Result<(), Error> {
        wit::clone(&t.cluster, &t.pool, image, snap, child_pool, child, features, secrets)
    }
    fn flatten(&self, t: &Target, image: &str, secrets: &[SecretRef]) -> Result<(), Error> {
        wit::flatten(&t.cluster, &t.pool, image, secrets)
    }
    fn children(&self, t: &Target, image: &str, snap: &str, secrets: &[SecretRef]) -> Result<Vec<String>, Error> {
        wit::children(&t.cluster, &t.pool, image, snap, secrets)
    }
    fn stats(&self, t: &Target, secrets: &[SecretRef]) -> Result<PoolStats, Error> {
        wit::stats(&t.cluster, &t.pool, secrets)
    }
}
