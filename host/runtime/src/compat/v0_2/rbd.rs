//! `rbd` as 0.2.0 (and 0.1.0) named it, served by the current capability: `(cluster, pool, …,
//! secrets)` become the `rbd-pool` record every current function takes first. Each function
//! converts its arguments, calls the current one on the same view and converts the answer, so
//! the two shapes cannot drift apart in behaviour (grants, credentials, timeouts, redaction).
use crate::bindings::types::{Error, SecretRef};
use crate::bindings::v0_2::rbd::{self as old, Host};
use crate::bindings::wasmcsi::backend::rbd as new;
use crate::compat::convert::record;
use crate::imports::rbd::{Rbd, RbdCtxView, RbdView};
use wasmtime::component::LinkerInstance;

/// Link 0.2.0's `rbd` into `instance` (named `wasmcsi:backend/rbd@0.2.0`, or `@0.1.0`: the
/// interface did not change between them).
pub fn add_to_instance<T: RbdView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    old::add_to_linker_instance::<T, Rbd>(instance, T::rbd)
}

record! {
    new::ImageInfo => old::ImageInfo { name, size_bytes, features, parent, metadata }
    new::ImageSnapshot => old::ImageSnapshot { name, size_bytes, protected, created }
    new::PoolStats => old::PoolStats { total_bytes, available_bytes }
}

/// Where, as 0.3.0 says it.
fn pool(cluster: String, pool: String, secrets: Vec<SecretRef>) -> new::RbdPool {
    new::RbdPool { cluster, pool, secrets }
}

impl Host for RbdCtxView<'_> {
    async fn create(
        &mut self,
        cluster: String,
        pool_name: String,
        name: String,
        size_bytes: u64,
        features: Vec<String>,
        data_pool: Option<String>,
        metadata: Vec<(String, String)>,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        let p = pool(cluster, pool_name, secrets);
        new::Host::create(self, p, name, size_bytes, features, data_pool, metadata).await
    }

    async fn info(
        &mut self,
        cluster: String,
        pool_name: String,
        name: String,
        secrets: Vec<SecretRef>,
    ) -> Result<Option<old::ImageInfo>, Error> {
        new::Host::info(self, pool(cluster, pool_name, secrets), name).await.map(|i| i.map(Into::into))
    }

    async fn find_by_metadata(
        &mut self,
        cluster: String,
        pool_name: String,
        key: String,
        value: String,
        secrets: Vec<SecretRef>,
    ) -> Result<Vec<String>, Error> {
        new::Host::find_by_metadata(self, pool(cluster, pool_name, secrets), key, value).await
    }

    async fn remove(
        &mut self,
        cluster: String,
        pool_name: String,
        name: String,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        new::Host::remove(self, pool(cluster, pool_name, secrets), name).await
    }

    async fn resize(
        &mut self,
        cluster: String,
        pool_name: String,
        name: String,
        size_bytes: u64,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        new::Host::resize(self, pool(cluster, pool_name, secrets), name, size_bytes).await
    }

    async fn snapshot_create(
        &mut self,
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        secrets: Vec<SecretRef>,
    ) -> Result<old::ImageSnapshot, Error> {
        new::Host::snapshot_create(self, pool(cluster, pool_name, secrets), image, snap).await.map(Into::into)
    }

    async fn snapshot_remove(
        &mut self,
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        new::Host::snapshot_remove(self, pool(cluster, pool_name, secrets), image, snap).await
    }

    async fn snapshot_protect(
        &mut self,
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        new::Host::snapshot_protect(self, pool(cluster, pool_name, secrets), image, snap).await
    }

    async fn snapshot_list(
        &mut self,
        cluster: String,
        pool_name: String,
        image: String,
        secrets: Vec<SecretRef>,
    ) -> Result<Vec<old::ImageSnapshot>, Error> {
        let list = new::Host::snapshot_list(self, pool(cluster, pool_name, secrets), image).await?;
        Ok(list.into_iter().map(Into::into).collect())
    }

    async fn clone(
        &mut self,
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        child_pool: String,
        child: String,
        features: Vec<String>,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        let p = pool(cluster, pool_name, secrets);
        new::Host::clone(self, p, image, snap, child_pool, child, features).await
    }

    async fn flatten(
        &mut self,
        cluster: String,
        pool_name: String,
        image: String,
        secrets: Vec<SecretRef>,
    ) -> Result<(), Error> {
        new::Host::flatten(self, pool(cluster, pool_name, secrets), image).await
    }

    async fn children(
        &mut self,
        cluster: String,
        pool_name: String,
        image: String,
        snap: String,
        secrets: Vec<SecretRef>,
    ) -> Result<Vec<String>, Error> {
        new::Host::children(self, pool(cluster, pool_name, secrets), image, snap).await
    }

    async fn stats(
        &mut self,
        cluster: String,
        pool_name: String,
        secrets: Vec<SecretRef>,
    ) -> Result<old::PoolStats, Error> {
        new::Host::stats(self, pool(cluster, pool_name, secrets)).await.map(Into::into)
    }
}

#[cfg(test)]
mod tests {
    //! The adapter reaches the current functions with the pool and the secrets where they
    //! belong, shown by the checks they make before any traffic (no cluster here; the operations
    //! themselves run against a real Ceph in `tests/all/rbd_backend.rs`).
    use super::*;
    use crate::config::{CephCluster, RbdGrant};
    use crate::imports::rbd::{RbdCtx, RbdProvider};
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    const KEY: &str = "AQBnBwFnAAAAABAAzlZ6nYv8w3G0fLrYL0aoNg==";

    #[tokio::test]
    async fn every_0_2_function_reaches_the_current_one_with_its_pool_and_secrets() {
        let clusters: BTreeMap<String, CephCluster> =
            [("c".to_owned(), CephCluster { monitors: vec!["192.0.2.1:6789".into()] })].into();
        let provider = RbdProvider::from_grants(
            &[RbdGrant { cluster: "c".into(), pools: vec!["p".into()] }],
            &clusters,
            Duration::from_secs(1),
        );
        let ctx =
            RbdCtx { backend: "old".into(), provider: provider.map(Arc::new), import_timeout: Duration::from_secs(1) };
        let secrets = vec![("userID".to_owned(), "csi".to_owned()), ("userKey".to_owned(), KEY.to_owned())];
        let mut v = RbdCtxView { ctx: &ctx, secrets: &secrets };
        let creds =
            || vec![SecretRef { key: "userID".into(), handle: 0 }, SecretRef { key: "userKey".into(), handle: 1 }];
        let (c, other) = (|| "c".to_string(), || "other".to_string());
        let s = || "s".to_string();
        // A pool not granted, named: the pool argument reached the current function.
        let denied: Vec<Result<(), Error>> = vec![
            Host::create(&mut v, c(), other(), s(), 4096, vec![], None, vec![], creds()).await,
            Host::info(&mut v, c(), other(), s(), creds()).await.map(drop),
            Host::find_by_metadata(&mut v, c(), other(), s(), s(), creds()).await.map(drop),
            Host::remove(&mut v, c(), other(), s(), creds()).await,
            Host::resize(&mut v, c(), other(), s(), 4096, creds()).await,
            Host::snapshot_create(&mut v, c(), other(), s(), s(), creds()).await.map(drop),
            Host::snapshot_remove(&mut v, c(), other(), s(), s(), creds()).await,
            Host::snapshot_protect(&mut v, c(), other(), s(), s(), creds()).await,
            Host::snapshot_list(&mut v, c(), other(), s(), creds()).await.map(drop),
            Host::clone(&mut v, c(), other(), s(), s(), "p".into(), s(), vec![], creds()).await,
            Host::flatten(&mut v, c(), other(), s(), creds()).await,
            Host::children(&mut v, c(), other(), s(), s(), creds()).await.map(drop),
            Host::stats(&mut v, c(), other(), creds()).await.map(drop),
        ];
        for (i, answer) in denied.into_iter().enumerate() {
            assert!(matches!(&answer, Err(Error::PermissionDenied(m)) if m.contains("other")), "#{i}: {answer:?}");
        }
        // A write without the secrets: the secrets argument reached it too.
        let e = Host::remove(&mut v, c(), "p".into(), s(), vec![]).await.expect_err("needs credentials");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("userID")), "{e:?}");
    }
}
