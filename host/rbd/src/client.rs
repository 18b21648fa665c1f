//! `RbdClient`: the grants of one backend and its connection pool; [`RbdPool`]: the operations
//! of the WIT `rbd` interface on one granted pool.
//!
//! Every operation checks names, then takes the pooled connection, then runs its librbd calls
//! on a worker thread under the op deadline ([`crate::conn`]). An `Unavailable` result evicts
//! the pooled connection, so the next call starts a fresh session rather than reusing one
//! stuck on a dead monitor.
use crate::conn::{Ioctx, Pool};
use crate::copy::{Copies, CopyProgress, INCOMPLETE, Plan};
use crate::error::Target;
use crate::fence::{FENCE_LOCK, Fence, FenceHolder, describe, header_oid};
use crate::group::{GroupSnapshot, check_images};
use crate::image::{Image, features_from_names};
use crate::names::{SnapRef, check, check_metadata};
use crate::{ImageInfo, ImageSnapshot, ImageSpec, PoolStats, QosLimits, RbdConfig, RbdCredentials, RbdError};
use std::sync::Arc;

struct Inner {
    config: RbdConfig,
    pool: Pool,
    copies: Copies,
}

/// How long [`RbdPool::snapshot_copy`] waits for a copy it started before answering progress.
const COPY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The `rbd` capability of one backend. Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct RbdClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RbdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdClient").field("clusters", &self.inner.config.clusters).finish()
    }
}

impl RbdClient {
    pub fn new(config: RbdConfig) -> Self {
        let pool = Pool::new(config.max_in_flight, config.connect_timeout, config.op_timeout);
        Self { inner: Arc::new(Inner { config, pool, copies: Copies::default() }) }
    }

    pub fn config(&self) -> &RbdConfig {
        &self.inner.config
    }

    /// One granted pool of one granted cluster, to run operations on as `creds`. No network
    /// traffic: an ungranted cluster or pool is `PermissionDenied` here, a malformed pool name
    /// `InvalidArgument`.
    pub fn pool(&self, cluster: &str, pool: &str, creds: &RbdCredentials) -> Result<RbdPool, RbdError> {
        check("pool", pool)?;
        let target = self.target(cluster, pool)?;
        check("user", &creds.user)?;
        Ok(RbdPool { inner: self.inner.clone(), target, pool: pool.to_owned(), creds: creds.clone() })
    }

    fn target(&self, cluster: &str, pool: &str) -> Result<Target, RbdError> {
        let Some(c) = self.inner.config.clusters.iter().find(|c| c.name == cluster) else {
            return Err(RbdError::PermissionDenied(format!("cluster {cluster:?} is not granted to this backend")));
        };
        if !c.pools.iter().any(|p| p == pool) {
            return Err(RbdError::PermissionDenied(format!(
                "pool {pool:?} of cluster {cluster:?} is not granted to this backend"
            )));
        }
        Ok(Target { cluster: c.name.clone(), monitors: c.monitors.join(",") })
    }
}

/// Operations on one granted pool (see [`RbdClient::pool`]).
#[derive(Clone)]
pub struct RbdPool {
    inner: Arc<Inner>,
    target: Target,
    pool: String,
    creds: RbdCredentials,
}

impl std::fmt::Debug for RbdPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdPool")
            .field("cluster", &self.target.cluster)
            .field("pool", &self.pool)
            .field("user", &self.creds.user)
            .finish()
    }
}

impl RbdPool {
    pub fn cluster(&self) -> &str {
        &self.target.cluster
    }

    pub fn name(&self) -> &str {
        &self.pool
    }

    /// Run `f` with an ioctx on this pool (and, when given, one on `other`, a pool of the same
    /// cluster) on a worker thread, under the op deadline.
    async fn run<T: Send + 'static>(
        &self,
        what: String,
        other: Option<String>,
        f: impl FnOnce(&Target, &Ioctx, Option<&Ioctx>) -> Result<T, RbdError> + Send + 'static,
    ) -> Result<T, RbdError> {
        let pool = &self.inner.pool;
        let result = match pool.connection(&self.target, &self.creds).await {
            Ok(conn) => {
                let (t, name) = (self.target.clone(), self.pool.clone());
                pool.run(&self.target, &what, pool.op_timeout, move || {
                    let io = conn.ioctx(&t, &name)?;
                    let other = other.map(|o| conn.ioctx(&t, &o)).transpose()?;
                    f(&t, &io, other.as_ref())
                })
                .await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = &result
            && e.is_unavailable()
        {
            pool.evict(&self.target, &self.creds.user).await;
        }
        result
    }

    /// Run `f` on the image `name` opened read-write.
    async fn with_image<T: Send + 'static>(
        &self,
        what: String,
        name: &str,
        f: impl FnOnce(&Target, &Image) -> Result<T, RbdError> + Send + 'static,
    ) -> Result<T, RbdError> {
        check("image", name)?;
        let name = name.to_owned();
        self.run(what, None, move |t, io, _| f(t, &io.open(t, &name)?)).await
    }

    fn granted(&self, pool: &str) -> Result<(), RbdError> {
        check("pool", pool)?;
        let cluster = self.inner.config.clusters.iter().find(|c| c.name == self.target.cluster);
        if cluster.is_some_and(|c| c.pools.iter().any(|p| p == pool)) {
            Ok(())
        } else {
            Err(RbdError::PermissionDenied(format!(
                "pool {pool:?} of cluster {:?} is not granted to this backend",
                self.target.cluster
            )))
        }
    }

    /// Create an image (format 2) and set its metadata. AlreadyExists if the name is taken
    /// (whatever the existing image is like: comparing is the caller's policy). If setting the
    /// metadata fails the new image is removed again, so no image exists without its metadata.
    #[tracing::instrument(name = "rbd.create", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %name))]
    pub async fn create(&self, name: &str, spec: &ImageSpec) -> Result<(), RbdError> {
        check("image", name)?;
        for (k, v) in &spec.metadata {
            check_metadata(k, v)?;
        }
        if let Some(p) = &spec.data_pool {
            self.granted(p)?;
        }
        let features = features_from_names(&spec.features)?;
        let (name, spec) = (name.to_owned(), spec.clone());
        self.run(format!("create {}/{name}", self.pool), None, move |t, io, _| {
            io.create(t, &name, spec.size_bytes, features, spec.data_pool.as_deref())?;
            let set = || -> Result<(), RbdError> {
                let image = io.open(t, &name)?;
                spec.metadata.iter().try_for_each(|(k, v)| image.metadata_set(t, k, v))
            };
            if spec.metadata.is_empty() {
                return Ok(());
            }
            set().inspect_err(|_| {
                if let Err(e) = io.remove(t, &name) {
                    tracing::warn!(image = %name, error = %e, "could not remove an image whose metadata failed");
                }
            })
        })
        .await
    }

    /// Size, features, parent and metadata; `None` when the image does not exist.
    #[tracing::instrument(name = "rbd.info", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %name))]
    pub async fn info(&self, name: &str) -> Result<Option<ImageInfo>, RbdError> {
        check("image", name)?;
        let name = name.to_owned();
        self.run(format!("info {}/{name}", self.pool), None, move |t, io, _| match io.open_read_only(t, &name, None) {
            Ok(image) => image.info(t, &name).map(Some),
            Err(RbdError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        })
        .await
    }

    /// Names of the images whose metadata `key` equals `value`, sorted. One metadata read per
    /// image in the pool; images removed meanwhile are skipped.
    #[tracing::instrument(name = "rbd.find_by_metadata", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, key = %key))]
    pub async fn find_by_metadata(&self, key: &str, value: &str) -> Result<Vec<String>, RbdError> {
        check_metadata(key, value)?;
        let (key, value) = (key.to_owned(), value.to_owned());
        self.run(format!("find-by-metadata in {}", self.pool), None, move |t, io, _| {
            let mut found = Vec::new();
            for name in io.list(t)? {
                let image = match io.open_read_only(t, &name, None) {
                    Ok(i) => i,
                    Err(RbdError::NotFound(_)) => continue,
                    Err(e) => return Err(e),
                };
                if image.metadata_get(t, &key)?.as_deref() == Some(value.as_str()) {
                    found.push(name);
                }
            }
            found.sort();
            Ok(found)
        })
        .await
    }

    /// Remove an image; absent succeeds. FailedPrecondition while it has snapshots (clone
    /// children always come with one) or a client has it open.
    #[tracing::instrument(name = "rbd.remove", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %name))]
    pub async fn remove(&self, name: &str) -> Result<(), RbdError> {
        check("image", name)?;
        let name = name.to_owned();
        self.run(format!("remove {}/{name}", self.pool), None, move |t, io, _| io.remove(t, &name).map(drop)).await
    }

    /// Grow to `size_bytes`; the same size succeeds, a smaller one is OutOfRange.
    #[tracing::instrument(name = "rbd.resize", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %name, size_bytes))]
    pub async fn resize(&self, name: &str, size_bytes: u64) -> Result<(), RbdError> {
        let what = format!("resize {}/{name}", self.pool);
        let n = name.to_owned();
        self.with_image(what, name, move |t, image| {
            let current = image.size(t)?;
            if size_bytes < current {
                return Err(RbdError::OutOfRange(format!(
                    "image {n} has {current} bytes; shrinking to {size_bytes} is not supported"
                )));
            }
            if size_bytes == current { Ok(()) } else { image.resize(t, size_bytes) }
        })
        .await
    }

    /// Set the image's QoS limits in its own configuration (see [`QosLimits`]): a limit sets its
    /// key, 0 removes it. The same limits again change nothing.
    #[tracing::instrument(name = "rbd.set_qos", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image))]
    pub async fn set_qos(&self, image: &str, limits: &QosLimits) -> Result<(), RbdError> {
        let keys = limits.keys();
        self.with_image(format!("set-qos {}/{image}", self.pool), image, move |t, img| {
            for (key, value) in keys {
                match value {
                    0 => img.metadata_remove(t, key)?,
                    v => img.metadata_set(t, key, &v.to_string())?,
                }
            }
            Ok(())
        })
        .await
    }

    /// Create a snapshot; AlreadyExists if the name is taken. Returns it as listed.
    #[tracing::instrument(name = "rbd.snapshot_create", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image, snap = %snap))]
    pub async fn snapshot_create(&self, image: &str, snap: &str) -> Result<ImageSnapshot, RbdError> {
        check("snapshot", snap)?;
        let s = snap.to_owned();
        self.with_image(format!("snapshot-create {}/{image}@{snap}", self.pool), image, move |t, img| {
            img.snap_create(t, &s)?;
            // Ordinary snapshots only: no group pool matches -1.
            img.snap_list(t, -1)?
                .into_iter()
                .find(|x| x.name == s)
                .ok_or_else(|| RbdError::Internal(format!("snapshot {s} missing right after its creation")))
        })
        .await
    }

    /// Remove a snapshot; an absent snapshot succeeds (the image must exist). FailedPrecondition
    /// while clones of it exist (librbd would move it to the trash instead: a snapshot the
    /// caller believes gone would still pin data). A protected snapshot without children is
    /// unprotected and removed. `GROUP@SNAP` removes the image's part of that group snapshot
    /// (of a group in this pool) on its own: the group snapshot keeps its other images' parts.
    #[tracing::instrument(name = "rbd.snapshot_remove", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image, snap = %snap))]
    pub async fn snapshot_remove(&self, image: &str, snap: &str) -> Result<(), RbdError> {
        check("image", image)?;
        let member = matches!(SnapRef::parse(snap)?, SnapRef::Group { .. });
        let (i, s) = (image.to_owned(), snap.to_owned());
        self.run(format!("snapshot-remove {}/{image}@{snap}", self.pool), None, move |t, io, _| {
            let img = io.open(t, &i)?;
            if member {
                // A group member has no clones: Ceph 16.2 clones ordinary snapshots only.
                let r = SnapRef::parse(&s)?;
                return match img.snap_find(t, &r, io.pool_id())? {
                    Some((id, _)) => img.snap_remove_by_id(t, id, &s),
                    None => Ok(()),
                };
            }
            match io.open_read_only(t, &i, Some(&s)) {
                Ok(at_snap) => {
                    let children = at_snap.children(t)?;
                    if !children.is_empty() {
                        return Err(RbdError::FailedPrecondition(format!(
                            "snapshot {i}@{s} has clones: {}",
                            children.join(", ")
                        )));
                    }
                }
                Err(RbdError::NotFound(_)) => return Ok(()),
                Err(e) => return Err(e),
            }
            img.snap_remove(t, &s)
        })
        .await
    }

    /// Protect a snapshot (clone v1 needs it; with `require-min-compat-client mimic` clones work
    /// without). Already protected succeeds.
    #[tracing::instrument(name = "rbd.snapshot_protect", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image, snap = %snap))]
    pub async fn snapshot_protect(&self, image: &str, snap: &str) -> Result<(), RbdError> {
        check("snapshot", snap)?;
        let s = snap.to_owned();
        self.with_image(format!("snapshot-protect {}/{image}@{snap}", self.pool), image, move |t, img| {
            img.snap_protect(t, &s)
        })
        .await
    }

    /// Snapshots of an image, oldest first.
    #[tracing::instrument(name = "rbd.snapshot_list", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image))]
    pub async fn snapshot_list(&self, image: &str) -> Result<Vec<ImageSnapshot>, RbdError> {
        check("image", image)?;
        let i = image.to_owned();
        self.run(format!("snapshot-list {}/{image}", self.pool), None, move |t, io, _| {
            io.open_read_only(t, &i, None)?.snap_list(t, io.pool_id())
        })
        .await
    }

    /// Clone `image@snap` of this pool into `child_pool/child` (granted, same cluster) with
    /// `features` (empty: the cluster's default).
    #[tracing::instrument(name = "rbd.clone", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image, snap = %snap, child_pool = %child_pool, child = %child))]
    pub async fn clone_image(
        &self,
        image: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
    ) -> Result<(), RbdError> {
        check("image", image)?;
        check("snapshot", snap)?;
        check("image", child)?;
        self.granted(child_pool)?;
        let features = features_from_names(features)?;
        let (i, s, c) = (image.to_owned(), snap.to_owned(), child.to_owned());
        let other = (child_pool != self.pool).then(|| child_pool.to_owned());
        self.run(format!("clone {}/{image}@{snap} to {child_pool}/{child}", self.pool), other, move |t, io, cio| {
            io.clone_from(t, &i, &s, cio.unwrap_or(io), &c, features)
        })
        .await
    }

    /// Copy the parent's data into a clone and detach it; an image that is no clone succeeds.
    #[tracing::instrument(name = "rbd.flatten", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image))]
    pub async fn flatten(&self, image: &str) -> Result<(), RbdError> {
        self.with_image(format!("flatten {}/{image}", self.pool), image, |t, img| img.flatten(t)).await
    }

    /// Clones (`pool/image`) of `image@snap`. NotFound when image or snapshot does not exist.
    #[tracing::instrument(name = "rbd.children", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image, snap = %snap))]
    pub async fn children(&self, image: &str, snap: &str) -> Result<Vec<String>, RbdError> {
        check("image", image)?;
        check("snapshot", snap)?;
        let (i, s) = (image.to_owned(), snap.to_owned());
        self.run(format!("children of {}/{image}@{snap}", self.pool), None, move |t, io, _| {
            let mut c = io.open_read_only(t, &i, Some(&s))?.children(t)?;
            c.sort();
            Ok(c)
        })
        .await
    }

    /// Usage of the pool, from the monitors' `df` (needs a running ceph-mgr in the cluster, as
    /// every production cluster has).
    #[tracing::instrument(name = "rbd.stats", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool))]
    pub async fn stats(&self) -> Result<PoolStats, RbdError> {
        let out = self
            .run(format!("df for pool {}", self.pool), None, move |t, io, _| {
                // The ioctx (unused otherwise) proves the pool exists: NotFound if not.
                io.connection().rados.mon_command(t, r#"{"prefix": "df", "format": "json"}"#)
            })
            .await?;
        let name = &self.pool;
        let v: serde_json::Value =
            serde_json::from_slice(&out).map_err(|e| RbdError::Internal(format!("unparsable `df` output: {e}")))?;
        // The pool exists (the ioctx was created) but the manager has not reported it yet: a
        // pool created a moment ago. Transient.
        let entry =
            v["pools"].as_array().and_then(|pools| pools.iter().find(|p| p["name"] == name.as_str())).ok_or_else(
                || self.target.unavailable(format!("no statistics for pool {name} yet (ceph-mgr has not reported it)")),
            )?;
        let field = |k: &str| entry["stats"][k].as_u64();
        let (Some(stored), Some(avail)) = (field("stored"), field("max_avail")) else {
            return Err(RbdError::Internal(format!("`df` of pool {name} lacks stored/max_avail: {entry}")));
        };
        Ok(PoolStats { total_bytes: stored.saturating_add(avail), available_bytes: avail })
    }

    /// One crash-consistent snapshot of every image in `images` (all in this pool): the RBD
    /// group snapshot `group@snap`, its group a record of that snapshot only (see
    /// [`crate::group`]). Each image's part is named `GROUP@SNAP`. The same request again: its
    /// members as they are; the same `group@snap` with other images: AlreadyExists. The time
    /// librbd held writes is logged.
    #[tracing::instrument(name = "rbd.group_snapshot", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, %group, %snap, images = images.len()))]
    pub async fn group_snapshot(&self, group: &str, images: &[String], snap: &str) -> Result<GroupSnapshot, RbdError> {
        check_images(images)?;
        images.iter().try_for_each(|i| check("image", i))?;
        check("group", group)?;
        check("group snapshot", snap)?;
        let (images, g, s) = (images.to_vec(), group.to_owned(), snap.to_owned());
        let taken = self
            .run(format!("group snapshot {group}@{snap} in {}", self.pool), None, move |t, io, _| {
                crate::group::take(t, io, &g, &images, &s)
            })
            .await?;
        match taken.pause {
            Some(p) => tracing::info!(pause_ms = p.as_secs_f64() * 1e3, "group snapshot taken; writes were held"),
            None => tracing::info!("group snapshot existed already"),
        }
        Ok(taken)
    }

    /// Remove the group snapshot `group@snap` (each image's part still there) and its group
    /// once empty; absent: success.
    #[tracing::instrument(name = "rbd.group_snapshot_remove", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, %group, %snap))]
    pub async fn group_snapshot_remove(&self, group: &str, snap: &str) -> Result<(), RbdError> {
        check("group", group)?;
        check("group snapshot", snap)?;
        let (g, s) = (group.to_owned(), snap.to_owned());
        self.run(format!("group snapshot remove {group}@{snap} in {}", self.pool), None, move |t, io, _| {
            crate::group::remove(t, io, &g, &s)
        })
        .await
    }

    /// Copy `image@snap` (an ordinary snapshot, or `GROUP@SNAP`: the image's part of a group
    /// snapshot) into a new image `child_pool/child` (granted, same cluster) with `features`
    /// and `metadata`, in the background (see [`crate::copy`]): the first call creates the
    /// image and starts the copy, every call answers how far it is. Done once complete (and
    /// then again, idempotently, while the image exists without the incomplete marker).
    #[tracing::instrument(name = "rbd.snapshot_copy", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, %image, %snap, %child_pool, %child))]
    pub async fn snapshot_copy(
        &self,
        image: &str,
        snap: &str,
        child_pool: &str,
        child: &str,
        features: &[String],
        metadata: &[(String, String)],
    ) -> Result<CopyProgress, RbdError> {
        check("image", image)?;
        check("image", child)?;
        SnapRef::parse(snap)?;
        self.granted(child_pool)?;
        metadata.iter().try_for_each(|(k, v)| check_metadata(k, v))?;
        if metadata.iter().any(|(k, _)| k == INCOMPLETE) {
            return Err(RbdError::InvalidArgument(format!("metadata key {INCOMPLETE} is the host's")));
        }
        let bits = features_from_names(features)?;
        let key = format!("{}/{child_pool}/{child}", self.target.cluster);
        if let Some(status) = self.inner.copies.status(&key) {
            return status;
        }
        let (i, s, c, md) = (image.to_owned(), snap.to_owned(), child.to_owned(), metadata.to_vec());
        let prepared = self
            .run(
                format!("restore {}/{image}@{snap} into {child_pool}/{child}", self.pool),
                Some(child_pool.to_owned()),
                move |t, io, other| {
                    let dest = other.unwrap_or(io);
                    match dest.open_read_only(t, &c, None) {
                        Ok(existing) => {
                            if existing.metadata_get(t, INCOMPLETE)?.is_none() {
                                return Ok(None);
                            }
                            drop(existing);
                            // What a dead process left half-copied: start again.
                            tracing::info!(image = %c, "an interrupted restore by copy starts again");
                            dest.remove(t, &c)?;
                        }
                        Err(RbdError::NotFound(_)) => {}
                        Err(e) => return Err(e),
                    }
                    let r = SnapRef::parse(&s)?;
                    let (id, size) = io
                        .open_read_only(t, &i, None)?
                        .snap_find(t, &r, io.pool_id())?
                        .ok_or_else(|| RbdError::NotFound(format!("snapshot {i}@{s} not found")))?;
                    dest.create(t, &c, size, bits, None)?;
                    // The caller's metadata from the start (what it lists and judges the image by
                    // while it fills), and again after the copy, which copies the source's over it.
                    let made = dest.open(t, &c).and_then(|img| {
                        img.metadata_set(t, INCOMPLETE, "1")?;
                        md.iter().try_for_each(|(k, v)| img.metadata_set(t, k, v))
                    });
                    if let Err(e) = made {
                        let _ = dest.remove(t, &c);
                        return Err(e);
                    }
                    Ok(Some((id, size, md)))
                },
            )
            .await?;
        let Some((snap_id, size, metadata)) = prepared else { return Ok(CopyProgress::Done) };
        let job = self.inner.copies.start(&self.target, &key, size)?;
        let conn = self.inner.pool.connection(&self.target, &self.creds).await?;
        let plan = Plan {
            src_pool: self.pool.clone(),
            src: image.to_owned(),
            snap_id,
            dest_pool: child_pool.to_owned(),
            dest: child.to_owned(),
            metadata,
        };
        crate::copy::spawn(self.target.clone(), conn, plan, job)?;
        // A small image is done at once: answer that rather than a retry's worth of waiting.
        let until = std::time::Instant::now() + COPY_WAIT;
        loop {
            match self.inner.copies.status(&key) {
                Some(Ok(CopyProgress::Copying { .. })) if std::time::Instant::now() < until => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Some(status) => return status,
                None => return Ok(CopyProgress::Done),
            }
        }
    }

    /// Take the node fence of `image` for `node` (see [`crate::fence`]). FailedPrecondition,
    /// naming the holder, when another node holds it; NotFound when the image does not exist.
    #[tracing::instrument(name = "rbd.fence_acquire", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image, node = %node))]
    pub async fn fence_acquire(&self, image: &str, node: &str) -> Result<Fence, RbdError> {
        check("image", image)?;
        if node.is_empty() || node.contains('\0') {
            return Err(RbdError::InvalidArgument(format!("node id {node:?} cannot be a lock cookie")));
        }
        let (i, n, pool) = (image.to_owned(), node.to_owned(), self.pool.clone());
        self.run(format!("fence {}/{image}", self.pool), None, move |t, io, _| {
            let oid = header_oid(&io.open_read_only(t, &i, None)?.id(t)?);
            let refuse = |holders: &[FenceHolder]| {
                RbdError::FailedPrecondition(format!(
                    "image {pool}/{i} is staged on another node: {} (lock {FENCE_LOCK} on {oid})",
                    describe(holders)
                ))
            };
            // Twice: a holder that lets go between the list and the lock makes the lock fail
            // with EBUSY once more, and the second look tells who.
            for _ in 0..2 {
                let holders = io.lockers(t, &oid, FENCE_LOCK)?;
                if holders.iter().any(|h| h.cookie == n) {
                    return Ok(Fence::AlreadyHeld);
                }
                if !holders.is_empty() {
                    return Err(refuse(&holders));
                }
                match io.lock_exclusive(t, &oid, FENCE_LOCK, &n, &format!("staged on node {n}")) {
                    Ok(true) => return Ok(Fence::Acquired),
                    Ok(false) => return Ok(Fence::AlreadyHeld),
                    Err(RbdError::FailedPrecondition(_)) => continue,
                    Err(e) => return Err(e),
                }
            }
            Err(refuse(&io.lockers(t, &oid, FENCE_LOCK)?))
        })
        .await
    }

    /// Release the fence `node` holds on `image`, whichever client of that node took it (a
    /// restarted plugin is a new RADOS client). Not held, or no image, succeeds.
    #[tracing::instrument(name = "rbd.fence_release", skip_all, fields(cluster = %self.target.cluster, pool = %self.pool, image = %image, node = %node))]
    pub async fn fence_release(&self, image: &str, node: &str) -> Result<(), RbdError> {
        check("image", image)?;
        let (i, n) = (image.to_owned(), node.to_owned());
        self.run(format!("unfence {}/{image}", self.pool), None, move |t, io, _| {
            let oid = match io.open_read_only(t, &i, None) {
                Ok(img) => header_oid(&img.id(t)?),
                Err(RbdError::NotFound(_)) => return Ok(()),
                Err(e) => return Err(e),
            };
            for h in io.lockers(t, &oid, FENCE_LOCK)?.into_iter().filter(|h| h.cookie == n) {
                io.break_lock(t, &oid, FENCE_LOCK, &h.client, &h.cookie)?;
            }
            Ok(())
        })
        .await
    }

    /// Who holds the fence of `image` (empty when nobody).
    pub async fn fence_holders(&self, image: &str) -> Result<Vec<FenceHolder>, RbdError> {
        check("image", image)?;
        let i = image.to_owned();
        self.run(format!("fence holders of {}/{image}", self.pool), None, move |t, io, _| {
            let oid = header_oid(&io.open_read_only(t, &i, None)?.id(t)?);
            io.lockers(t, &oid, FENCE_LOCK)
        })
        .await
    }

    /// Read `len` bytes at `offset` through librbd (tests and diagnostics; guests have no data
    /// path).
    pub async fn read(&self, image: &str, offset: u64, len: usize) -> Result<Vec<u8>, RbdError> {
        check("image", image)?;
        let i = image.to_owned();
        self.run(format!("read {}/{image}", self.pool), None, move |t, io, _| {
            io.open_read_only(t, &i, None)?.read(t, offset, len)
        })
        .await
    }

    /// Read `len` bytes at `offset` of the snapshot `image@snap` (tests and diagnostics).
    /// `snap` as [`Self::snapshot_copy`] takes it.
    pub async fn read_snapshot(&self, image: &str, snap: &str, offset: u64, len: usize) -> Result<Vec<u8>, RbdError> {
        check("image", image)?;
        SnapRef::parse(snap)?;
        let (i, s) = (image.to_owned(), snap.to_owned());
        self.run(format!("read {}/{image}@{snap}", self.pool), None, move |t, io, _| {
            let img = io.open_read_only(t, &i, None)?;
            let (id, _) = img
                .snap_find(t, &SnapRef::parse(&s)?, io.pool_id())?
                .ok_or_else(|| RbdError::NotFound(format!("snapshot {i}@{s} not found")))?;
            img.snap_set_by_id(t, id)?;
            img.read(t, offset, len)
        })
        .await
    }

    /// Write `data` at `offset` through librbd and flush (tests and diagnostics).
    pub async fn write(&self, image: &str, offset: u64, data: &[u8]) -> Result<(), RbdError> {
        let data = data.to_vec();
        self.with_image(format!("write {}/{image}", self.pool), image, move |t, img| img.write(t, offset, &data)).await
    }
}
