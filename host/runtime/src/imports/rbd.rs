//! `rbd`: RBD images on the pools granted to a backend, through the host's librados/librbd
//! client (`wasmcsi_rbd::RbdClient`). One client per loaded backend, built from its `rbd` grants
//! and the `[clusters]` monitors: clusters and pools not granted are refused before any network
//! traffic, connections are pooled per (cluster, user), and every call is bounded by the
//! backend's `import_timeout` on top of the client's own deadlines.
//!
//! Where. Every function takes an `rbd-pool` first: the cluster, the pool and the call's secret
//! handles (the WIT's `rbd-pool`; `RbdPoolRef` here, beside the client's [`RbdPool`]).
//!
//! Credentials. The guest passes the secret-refs of its CSI call; the host resolves the handles
//! to values for that one import: ceph-csi's `userID`/`userKey`, or else `adminID`/`adminKey`
//! (what ceph-csi accepts for provisioning). Values are never logged and never returned: an
//! error names the key, and any message that would contain a key value has it redacted.
//!
//! Calls without credentials. CSI gives GetCapacity, ListVolumes, ControllerGetVolume,
//! ListSnapshots and ValidateVolumeCapabilities no secrets (or the WIT does not pass them), yet
//! the backend must read the cluster to answer them. The provider therefore remembers, in memory
//! only, the last credentials the cluster accepted for each (cluster, pool), and lets an import
//! that carries *no* credential secrets use them for *read-only* operations (`info`,
//! `find-by-metadata`, `snapshot-list`, `children`, `stats`). Anything that changes the cluster
//! needs the call's own secrets. After a restart the read-only calls answer `unavailable` until
//! a call with secrets has succeeded on that pool.
//!
//! QoS. `set-qos` writes librbd's per-image QoS configuration as ceph-csi does (see
//! `wasmcsi_rbd::QosLimits`).
//!
//! Group snapshots. `group-snapshot` takes an RBD group snapshot (`wasmcsi_rbd::group`: the group
//! records that one snapshot, images join it only while it is taken); the pause it held writes
//! for is logged by the client. Its parts are restored by `snapshot-copy`, a copy the host runs
//! in the background past the call's deadline (`wasmcsi_rbd::copy`).
//!
//! Its host functions see an [`RbdCtxView`]: the backend's [`RbdCtx`] and the call's secrets.
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use wasmcsi_rbd::{
    CopyProgress, ImageSpec, QosLimits, RbdClient, RbdCluster, RbdConfig, RbdCredentials, RbdError, RbdPool,
};
use wasmtime::component::{HasData, LinkerInstance};

use crate::bindings::types::{Error, IoLimits, SecretRef, Timestamp};
use crate::bindings::wasmcsi::backend::rbd::{
    self as wit, Host, ImageInfo, ImageSnapshot, PoolStats, RbdPool as RbdPoolRef,
};
use crate::config::{CephCluster, RbdGrant};
use crate::secrets::Secrets;

/// What `rbd` needs of one backend, resolved at load and shared by its calls.
pub struct RbdCtx {
    pub backend: String,
    /// the client of the granted clusters and pools; `None` without an rbd grant
    pub provider: Option<Arc<RbdProvider>>,
    /// how long one import may take
    pub import_timeout: Duration,
}

/// What `rbd` sees of a call.
pub struct RbdCtxView<'a> {
    pub ctx: &'a RbdCtx,
    /// the call's secrets, which the guest names by handle
    pub secrets: &'a Secrets,
}

/// A store whose calls can reach `rbd`: it lends `rbd` its view.
pub trait RbdView: Send {
    fn rbd(&mut self) -> RbdCtxView<'_>;
}

/// `rbd` for the linker: its host functions get an [`RbdCtxView`].
pub struct Rbd;

impl HasData for Rbd {
    type Data<'a> = RbdCtxView<'a>;
}

/// Link `rbd`'s host functions into `instance` (named as the component's contract version
/// names the interface).
pub fn add_to_instance<T: RbdView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    wit::add_to_linker_instance::<T, Rbd>(instance, T::rbd)
}

/// ceph-csi's secret keys: the user (`userID`, `userKey`) and, accepted for provisioning, the
/// admin pair. The user pair wins when both are given.
const USER_KEYS: [(&str, &str); 2] = [("userID", "userKey"), ("adminID", "adminKey")];

/// The `rbd` capability of one backend: its client and the remembered read credentials.
pub struct RbdProvider {
    client: RbdClient,
    /// (cluster, pool) → the credentials the cluster last accepted there (see the module docs).
    readers: Mutex<HashMap<(String, String), RbdCredentials>>,
}

impl std::fmt::Debug for RbdProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RbdProvider").field("client", &self.client).finish_non_exhaustive()
    }
}

impl RbdProvider {
    pub fn new(client: RbdClient) -> Self {
        Self { client, readers: Mutex::new(HashMap::new()) }
    }

    /// The provider for a backend's grants, or `None` without any. The client's own deadlines
    /// stay below the import timeout, so it reports which cluster failed before the import's
    /// deadline cuts the call off (as the nfs provider does).
    pub fn from_grants(
        grants: &[RbdGrant],
        clusters: &std::collections::BTreeMap<String, CephCluster>,
        import_timeout: Duration,
    ) -> Option<Self> {
        if grants.is_empty() {
            return None;
        }
        let mut granted: Vec<RbdCluster> = Vec::new();
        for g in grants {
            // Config validation guarantees the cluster exists; skip defensively if not.
            let Some(c) = clusters.get(&g.cluster) else { continue };
            match granted.iter_mut().find(|x| x.name == g.cluster) {
                Some(x) => x.pools.extend(g.pools.iter().filter(|p| !x.pools.contains(p)).cloned().collect::<Vec<_>>()),
                None => granted.push(RbdCluster {
                    name: g.cluster.clone(),
                    monitors: c.monitors.clone(),
                    pools: g.pools.clone(),
                }),
            }
        }
        let mut config = RbdConfig::new(granted);
        let budget = import_timeout.mul_f32(0.8);
        config.connect_timeout = config.connect_timeout.min(budget);
        config.op_timeout = config.op_timeout.min(budget);
        Some(Self::new(RbdClient::new(config)))
    }

    fn remember(&self, cluster: &str, pool: &str, creds: &RbdCredentials) {
        let mut r = self.readers.lock().unwrap_or_else(PoisonError::into_inner);
        r.insert((cluster.to_owned(), pool.to_owned()), creds.clone());
    }

    fn remembered(&self, cluster: &str, pool: &str) -> Option<RbdCredentials> {
        let r = self.readers.lock().unwrap_or_else(PoisonError::into_inner);
        r.get(&(cluster.to_owned(), pool.to_owned())).cloned()
    }
}

/// The WIT error for a client error: one case each, the message kept.
pub fn to_wit(e: RbdError) -> Error {
    let msg = e.to_string();
    match e {
        RbdError::InvalidArgument(_) => Error::InvalidArgument(msg),
        RbdError::NotFound(_) => Error::NotFound(msg),
        RbdError::AlreadyExists(_) => Error::AlreadyExists(msg),
        RbdError::FailedPrecondition(_) => Error::FailedPrecondition(msg),
        RbdError::OutOfRange(_) => Error::OutOfRange(msg),
        RbdError::PermissionDenied(_) => Error::PermissionDenied(msg),
        RbdError::Unavailable { .. } => Error::Unavailable(msg),
        RbdError::ResourceExhausted(_) => Error::ResourceExhausted(msg),
        RbdError::Internal(_) => Error::Internal(msg),
    }
}

/// Replace every occurrence of `secret` in an error's message (belt and braces: librados does
/// not echo keys, but a message is the one thing that leaves the host).
fn redact(e: Error, secret: &str) -> Error {
    if secret.is_empty() {
        return e;
    }
    let r = |m: String| m.replace(secret, "<redacted>");
    match e {
        Error::InvalidArgument(m) => Error::InvalidArgument(r(m)),
        Error::NotFound(m) => Error::NotFound(r(m)),
        Error::AlreadyExists(m) => Error::AlreadyExists(r(m)),
        Error::FailedPrecondition(m) => Error::FailedPrecondition(r(m)),
        Error::OutOfRange(m) => Error::OutOfRange(r(m)),
        Error::ResourceExhausted(m) => Error::ResourceExhausted(r(m)),
        Error::Unavailable(m) => Error::Unavailable(r(m)),
        Error::Aborted(m) => Error::Aborted(r(m)),
        Error::Unimplemented(m) => Error::Unimplemented(r(m)),
        Error::DeadlineExceeded(m) => Error::DeadlineExceeded(r(m)),
        Error::PermissionDenied(m) => Error::PermissionDenied(r(m)),
        Error::Internal(m) => Error::Internal(r(m)),
    }
}

/// Whether an operation may run on remembered credentials (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
}

/// Everything one import needs, taken out of the view so the future awaiting the cluster holds
/// none of it.
struct Prepared {
    pool: RbdPool,
    creds: RbdCredentials,
    /// credentials came from this call's secrets (remember them on success)
    explicit: bool,
    provider: Arc<RbdProvider>,
    timeout: Duration,
}

impl RbdCtxView<'_> {
    /// Credentials from the guest's secret-refs: the handles are checked against this call's
    /// secrets by *their* key (a guest cannot pass a key's handle off as another key), values
    /// stay here. `Ok(None)`: the guest passed no credential keys at all.
    fn rbd_credentials(&self, refs: &[SecretRef]) -> Result<Option<RbdCredentials>, Error> {
        let mut found: HashMap<&str, &str> = HashMap::new();
        for r in refs {
            let Some((key, value)) = self.secrets.get(r.handle as usize) else {
                return Err(Error::PermissionDenied(format!(
                    "secret {:?}: handle {} is not valid for this call",
                    r.key, r.handle
                )));
            };
            if *key != r.key {
                return Err(Error::PermissionDenied(format!(
                    "secret {:?}: handle {} belongs to another key",
                    r.key, r.handle
                )));
            }
            found.insert(key.as_str(), value.as_str());
        }
        for (id_key, secret_key) in USER_KEYS {
            match (found.get(id_key), found.get(secret_key)) {
                (Some(id), Some(key)) => {
                    if id.is_empty() || key.is_empty() {
                        return Err(Error::InvalidArgument(format!("secrets {id_key}/{secret_key}: empty value")));
                    }
                    return Ok(Some(RbdCredentials::new(*id, *key)));
                }
                (Some(_), None) => {
                    return Err(Error::InvalidArgument(format!("secret {id_key} is given without {secret_key}")));
                }
                (None, Some(_)) => {
                    return Err(Error::InvalidArgument(format!("secret {secret_key} is given without {id_key}")));
                }
                (None, None) => {}
            }
        }
        Ok(None)
    }

    fn rbd_prepare(&self, cluster: &str, pool: &str, refs: &[SecretRef], access: Access) -> Result<Prepared, Error> {
        let provider = self
            .ctx
            .provider
            .clone()
            .ok_or_else(|| Error::PermissionDenied(format!("backend {} has no rbd grant", self.ctx.backend)))?;
        let (creds, explicit) = match self.rbd_credentials(refs)? {
            Some(c) => (c, true),
            None if access == Access::Read => match provider.remembered(cluster, pool) {
                Some(c) => (c, false),
                None => {
                    return Err(Error::Unavailable(format!(
                        "no ceph credentials for cluster {cluster:?} pool {pool:?} yet: pass secrets userID and \
                         userKey (read-only calls reuse the last credentials accepted there)"
                    )));
                }
            },
            None => {
                return Err(Error::InvalidArgument(
                    "ceph credentials missing: secrets userID and userKey (or adminID and adminKey) are required"
                        .into(),
                ));
            }
        };
        let pool = provider.client.pool(cluster, pool, &creds).map_err(to_wit)?;
        Ok(Prepared { pool, creds, explicit, provider, timeout: self.ctx.import_timeout })
    }
}

/// Run one client operation under the import timeout; remember explicit credentials the
/// cluster accepted; redact the key from any error.
async fn rbd_call<T, F, Fut>(prepared: Result<Prepared, Error>, what: &str, op: F) -> Result<T, Error>
where
    F: FnOnce(RbdPool) -> Fut,
    Fut: Future<Output = Result<T, RbdError>>,
{
    let Prepared { pool, creds, explicit, provider, timeout } = prepared?;
    let (cluster, name) = (pool.cluster().to_owned(), pool.name().to_owned());
    let result = match tokio::time::timeout(timeout, op(pool)).await {
        Ok(r) => r.map_err(to_wit),
        Err(_) => Err(Error::DeadlineExceeded(format!(
            "rbd {what} on cluster {cluster} pool {name} did not finish within {timeout:?}"
        ))),
    };
    match result {
        Ok(v) => {
            if explicit {
                provider.remember(&cluster, &name, &creds);
            }
            Ok(v)
        }
        Err(e) => Err(redact(e, creds.key())),
    }
}

fn ts(t: wasmcsi_rbd::Timestamp) -> Timestamp {
    Timestamp { seconds: t.seconds, nanos: t.nanos }
}

fn snap_to_wit(s: wasmcsi_rbd::ImageSnapshot) -> ImageSnapshot {
    ImageSnapshot { name: s.name, size_bytes: s.size_bytes, protected: s.protected, created: ts(s.created) }
}

/// One `rbd-pool`'s preparation for an operation of `access`.
macro_rules! prepare {
    ($view:expr, $pool:expr, $access:expr) => {
        $view.rbd_prepare(&$pool.cluster, &$pool.pool, &$pool.secrets, $access)
    };
}

impl Host for RbdCtxView<'_> {
    #[tracing::instrument(name = "import.rbd.create", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %name, size_bytes))]
    async fn create(
        &mut self,
        pool: RbdPoolRef,
        name: String,
        size_bytes: u64,
        features: Vec<String>,
        data_pool: Option<String>,
        metadata: Vec<(String, String)>,
    ) -> Result<(), Error> {
        let spec = ImageSpec { size_bytes, features, data_pool, metadata };
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "create", |p| async move { p.create(&name, &spec).await }).await
    }

    #[tracing::instrument(name = "import.rbd.info", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %name))]
    async fn info(&mut self, pool: RbdPoolRef, name: String) -> Result<Option<ImageInfo>, Error> {
        let p = prepare!(self, pool, Access::Read);
        let i = rbd_call(p, "info", |p| async move { p.info(&name).await }).await?;
        Ok(i.map(|i| ImageInfo {
            name: i.name,
            size_bytes: i.size_bytes,
            features: i.features,
            parent: i.parent,
            metadata: i.metadata,
        }))
    }

    #[tracing::instrument(name = "import.rbd.find_by_metadata", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %key))]
    async fn find_by_metadata(&mut self, pool: RbdPoolRef, key: String, value: String) -> Result<Vec<String>, Error> {
        let p = prepare!(self, pool, Access::Read);
        rbd_call(p, "find-by-metadata", |p| async move { p.find_by_metadata(&key, &value).await }).await
    }

    #[tracing::instrument(name = "import.rbd.remove", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %name))]
    async fn remove(&mut self, pool: RbdPoolRef, name: String) -> Result<(), Error> {
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "remove", |p| async move { p.remove(&name).await }).await
    }

    #[tracing::instrument(name = "import.rbd.resize", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %name, size_bytes))]
    async fn resize(&mut self, pool: RbdPoolRef, name: String, size_bytes: u64) -> Result<(), Error> {
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "resize", |p| async move { p.resize(&name, size_bytes).await }).await
    }

    #[tracing::instrument(name = "import.rbd.snapshot_create", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image, %snap))]
    async fn snapshot_create(&mut self, pool: RbdPoolRef, image: String, snap: String) -> Result<ImageSnapshot, Error> {
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "snapshot-create", |p| async move { p.snapshot_create(&image, &snap).await }).await.map(snap_to_wit)
    }

    #[tracing::instrument(name = "import.rbd.snapshot_remove", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image, %snap))]
    async fn snapshot_remove(&mut self, pool: RbdPoolRef, image: String, snap: String) -> Result<(), Error> {
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "snapshot-remove", |p| async move { p.snapshot_remove(&image, &snap).await }).await
    }

    #[tracing::instrument(name = "import.rbd.snapshot_protect", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image, %snap))]
    async fn snapshot_protect(&mut self, pool: RbdPoolRef, image: String, snap: String) -> Result<(), Error> {
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "snapshot-protect", |p| async move { p.snapshot_protect(&image, &snap).await }).await
    }

    #[tracing::instrument(name = "import.rbd.snapshot_list", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image))]
    async fn snapshot_list(&mut self, pool: RbdPoolRef, image: String) -> Result<Vec<ImageSnapshot>, Error> {
        let p = prepare!(self, pool, Access::Read);
        let list = rbd_call(p, "snapshot-list", |p| async move { p.snapshot_list(&image).await }).await?;
        Ok(list.into_iter().map(snap_to_wit).collect())
    }

    #[tracing::instrument(name = "import.rbd.clone", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image, %snap, %child_pool, %child))]
    async fn clone(
        &mut self,
        pool: RbdPoolRef,
        image: String,
        snap: String,
        child_pool: String,
        child: String,
        features: Vec<String>,
    ) -> Result<(), Error> {
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "clone", |p| async move { p.clone_image(&image, &snap, &child_pool, &child, &features).await })
            .await
    }

    #[tracing::instrument(name = "import.rbd.flatten", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image))]
    async fn flatten(&mut self, pool: RbdPoolRef, image: String) -> Result<(), Error> {
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "flatten", |p| async move { p.flatten(&image).await }).await
    }

    #[tracing::instrument(name = "import.rbd.children", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image, %snap))]
    async fn children(&mut self, pool: RbdPoolRef, image: String, snap: String) -> Result<Vec<String>, Error> {
        let p = prepare!(self, pool, Access::Read);
        rbd_call(p, "children", |p| async move { p.children(&image, &snap).await }).await
    }

    #[tracing::instrument(name = "import.rbd.stats", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool))]
    async fn stats(&mut self, pool: RbdPoolRef) -> Result<PoolStats, Error> {
        let p = prepare!(self, pool, Access::Read);
        let s = rbd_call(p, "stats", |p| async move { p.stats().await }).await?;
        Ok(PoolStats { total_bytes: s.total_bytes, available_bytes: s.available_bytes })
    }

    #[tracing::instrument(name = "import.rbd.set_qos", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image))]
    async fn set_qos(&mut self, pool: RbdPoolRef, image: String, limits: IoLimits) -> Result<(), Error> {
        let qos = QosLimits {
            read_iops: limits.read_iops,
            write_iops: limits.write_iops,
            read_bytes_per_second: limits.read_bytes_per_second,
            write_bytes_per_second: limits.write_bytes_per_second,
        };
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "set-qos", |p| async move { p.set_qos(&image, &qos).await }).await
    }

    #[tracing::instrument(name = "import.rbd.group_snapshot", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %group, %snap, images = images.len()))]
    async fn group_snapshot(
        &mut self,
        pool: RbdPoolRef,
        group: String,
        images: Vec<String>,
        snap: String,
    ) -> Result<Vec<ImageSnapshot>, Error> {
        let p = prepare!(self, pool, Access::Write);
        let taken =
            rbd_call(p, "group-snapshot", |p| async move { p.group_snapshot(&group, &images, &snap).await }).await?;
        Ok(taken.snapshots.into_iter().map(snap_to_wit).collect())
    }

    #[tracing::instrument(name = "import.rbd.group_snapshot_remove", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %group, %snap))]
    async fn group_snapshot_remove(&mut self, pool: RbdPoolRef, group: String, snap: String) -> Result<(), Error> {
        let p = prepare!(self, pool, Access::Write);
        rbd_call(p, "group-snapshot-remove", |p| async move { p.group_snapshot_remove(&group, &snap).await }).await
    }

    #[tracing::instrument(name = "import.rbd.snapshot_copy", skip_all, fields(backend = %self.ctx.backend, cluster = %pool.cluster, pool = %pool.pool, %image, %snap, %child_pool, %child))]
    async fn snapshot_copy(
        &mut self,
        pool: RbdPoolRef,
        image: String,
        snap: String,
        child_pool: String,
        child: String,
        features: Vec<String>,
        metadata: Vec<(String, String)>,
    ) -> Result<wit::CopyProgress, Error> {
        let p = prepare!(self, pool, Access::Write);
        let progress = rbd_call(p, "snapshot-copy", |p| async move {
            p.snapshot_copy(&image, &snap, &child_pool, &child, &features, &metadata).await
        })
        .await?;
        Ok(match progress {
            CopyProgress::Done => wit::CopyProgress { done: true, bytes: 0 },
            CopyProgress::Copying { copied, .. } => wit::CopyProgress { done: false, bytes: copied },
        })
    }
}

#[cfg(test)]
mod tests {
    //! Credential resolution, grants and the error mapping, without a cluster (no traffic
    //! happens before these checks). The operations against a real cluster are exercised through
    //! the ceph-rbd-shim component in `tests/all/rbd_backend.rs`.
    use std::collections::BTreeMap;

    use super::*;
    use crate::call_error::describe;

    const KEY: &str = "AQBnBwFnAAAAABAAzlZ6nYv8w3G0fLrYL0aoNg==";

    fn provider() -> RbdProvider {
        let clusters: BTreeMap<String, CephCluster> =
            [("c".to_owned(), CephCluster { monitors: vec!["192.0.2.1:6789".into()] })].into();
        let grants = [
            RbdGrant { cluster: "c".into(), pools: vec!["p".into()] },
            RbdGrant { cluster: "c".into(), pools: vec!["q".into(), "p".into()] },
        ];
        RbdProvider::from_grants(&grants, &clusters, Duration::from_secs(1)).expect("granted")
    }

    /// What one call's `rbd` view borrows: the backend's context and the call's secrets.
    struct Call {
        ctx: RbdCtx,
        secrets: Secrets,
    }

    impl Call {
        fn new(rbd: Option<RbdProvider>, secrets: &[(&str, &str)]) -> Self {
            let ctx = RbdCtx {
                backend: "rbd-test".into(),
                provider: rbd.map(Arc::new),
                import_timeout: Duration::from_secs(1),
            };
            Self { ctx, secrets: secrets.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect() }
        }

        fn view(&self) -> RbdCtxView<'_> {
            RbdCtxView { ctx: &self.ctx, secrets: &self.secrets }
        }
    }

    fn refs(keys: &[(&str, u32)]) -> Vec<SecretRef> {
        keys.iter().map(|(k, h)| SecretRef { key: (*k).into(), handle: *h }).collect()
    }

    fn pool(cluster: &str, pool: &str, secrets: Vec<SecretRef>) -> RbdPoolRef {
        RbdPoolRef { cluster: cluster.into(), pool: pool.into(), secrets }
    }

    #[test]
    fn grants_of_one_cluster_merge_and_timeouts_stay_below_the_import_timeout() {
        let p = provider();
        let c = &p.client.config().clusters;
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].pools, ["p", "q"]);
        assert!(p.client.config().op_timeout < Duration::from_secs(1));
        assert!(RbdProvider::from_grants(&[], &BTreeMap::new(), Duration::from_secs(1)).is_none());
    }

    #[test]
    fn credentials_resolve_from_handles_by_the_hosts_key() {
        let call = Call::new(
            Some(provider()),
            &[("adminID", "admin"), ("adminKey", KEY), ("userID", "csi"), ("userKey", KEY)],
        );
        let s = call.view();
        let user = s.rbd_credentials(&refs(&[("userID", 2), ("userKey", 3)])).expect("ok").expect("some");
        assert_eq!((user.user.as_str(), user.key()), ("csi", KEY));
        let admin = s.rbd_credentials(&refs(&[("adminID", 0), ("adminKey", 1)])).expect("ok").expect("some");
        assert_eq!(admin.user, "admin");
        // Both pairs: the user pair wins.
        let both = s.rbd_credentials(&refs(&[("adminID", 0), ("adminKey", 1), ("userID", 2), ("userKey", 3)]));
        assert_eq!(both.expect("ok").expect("some").user, "csi");
        assert!(s.rbd_credentials(&[]).expect("ok").is_none());

        // A handle passed off as another key, an unknown handle, half a pair: refused, naming
        // the key and never the value.
        for (r, want) in [
            (refs(&[("userID", 3), ("userKey", 3)]), "userID"),
            (refs(&[("userID", 2), ("userKey", 9)]), "userKey"),
            (refs(&[("userID", 2)]), "userKey"),
            (refs(&[("adminKey", 1)]), "adminID"),
        ] {
            let e = s.rbd_credentials(&r).expect_err("refused");
            let msg = format!("{e:?}");
            assert!(msg.contains(want), "{msg}");
            assert!(!msg.contains(KEY), "{msg}");
            assert!(matches!(e, Error::PermissionDenied(_) | Error::InvalidArgument(_)), "{e:?}");
        }
    }

    #[tokio::test]
    async fn calls_without_grant_or_credentials_fail_before_any_traffic() {
        let ungranted = Call::new(None, &[]);
        let mut none = ungranted.view();
        let e = none.info(pool("c", "p", vec![]), "img".into()).await.expect_err("no grant");
        assert!(matches!(e, Error::PermissionDenied(_)), "{e:?}");

        let call = Call::new(Some(provider()), &[("userID", "csi"), ("userKey", KEY)]);
        let mut s = call.view();
        let e = s.remove(pool("c", "p", vec![]), "img".into()).await.expect_err("write needs secrets");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("userID")), "{e:?}");
        let e = s
            .set_qos(
                pool("c", "p", vec![]),
                "img".into(),
                IoLimits { read_iops: 0, write_iops: 0, read_bytes_per_second: 0, write_bytes_per_second: 0 },
            )
            .await
            .expect_err("a write");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("userID")), "{e:?}");
        let e = s.stats(pool("c", "p", vec![])).await.expect_err("nothing remembered yet");
        assert!(matches!(e, Error::Unavailable(_)), "{e:?}");
        let creds = refs(&[("userID", 0), ("userKey", 1)]);
        let e = s.info(pool("c", "other", creds.clone()), "img".into()).await.expect_err("ungranted pool");
        assert!(matches!(&e, Error::PermissionDenied(m) if m.contains("other")), "{e:?}");
        let e = s.info(pool("x", "p", creds), "img".into()).await.expect_err("ungranted cluster");
        assert!(matches!(e, Error::PermissionDenied(_)), "{e:?}");
    }

    /// Group snapshots check the grant and the credentials before any traffic, then the group
    /// itself (at least one image, each once) before connecting: nothing reaches the (absent)
    /// cluster at 192.0.2.1. Against a real cluster: `tests/all/rbd_backend.rs`.
    #[tokio::test]
    async fn group_snapshots_check_grant_credentials_and_images_before_any_traffic() {
        let call = Call::new(Some(provider()), &[("userID", "csi"), ("userKey", KEY)]);
        let mut s = call.view();
        let creds = refs(&[("userID", 0), ("userKey", 1)]);
        let e = s.group_snapshot(pool("c", "other", creds.clone()), "g".into(), vec!["a".into()], "s".into()).await;
        assert!(matches!(e, Err(Error::PermissionDenied(_))), "{e:?}");
        let e = s.group_snapshot(pool("c", "p", vec![]), "g".into(), vec!["a".into()], "s".into()).await;
        assert!(matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("userID")), "a write: {e:?}");
        let e = s.group_snapshot(pool("c", "p", creds.clone()), "g".into(), vec![], "s".into()).await;
        assert!(matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("at least one")), "{e:?}");
        let twice = vec!["a".into(), "b".into(), "a".into()];
        let e = s.group_snapshot(pool("c", "p", creds.clone()), "g".into(), twice, "s".into()).await;
        assert!(matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("twice")), "{e:?}");
        let e = s.group_snapshot(pool("c", "p", creds.clone()), "g".into(), vec!["a/b".into()], "s".into()).await;
        assert!(matches!(e, Err(Error::InvalidArgument(_))), "a bad image name: {e:?}");
        let e = s.group_snapshot_remove(pool("c", "q", vec![]), "g".into(), "s".into()).await;
        assert!(matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("userID")), "a write: {e:?}");
        let e = s.group_snapshot_remove(pool("x", "p", creds), "g".into(), "s".into()).await;
        assert!(matches!(e, Err(Error::PermissionDenied(_))), "{e:?}");
    }

    #[test]
    fn every_client_error_maps_to_its_case_and_keys_are_redacted() {
        let cases = [
            (RbdError::InvalidArgument("x".into()), "invalid-argument"),
            (RbdError::NotFound("x".into()), "not-found"),
            (RbdError::AlreadyExists("x".into()), "already-exists"),
            (RbdError::FailedPrecondition("x".into()), "failed-precondition"),
            (RbdError::OutOfRange("x".into()), "out-of-range"),
            (RbdError::PermissionDenied("x".into()), "permission-denied"),
            (RbdError::Unavailable { cluster: "c".into(), monitors: "m".into(), reason: "r".into() }, "unavailable"),
            (RbdError::ResourceExhausted("x".into()), "resource-exhausted"),
            (RbdError::Internal("x".into()), "internal"),
        ];
        for (e, case) in cases {
            assert_eq!(e.wit_case(), case);
            assert_eq!(describe(&to_wit(e)).0, case);
        }
        let e = redact(Error::Internal(format!("auth with {KEY} failed")), KEY);
        assert_eq!(describe(&e).1, "auth with <redacted> failed");
    }
}
