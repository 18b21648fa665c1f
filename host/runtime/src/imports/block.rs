//! `block`: the replicated block engine's replica sets on the nodes granted to the backend,
//! through `wasmcsi_block::catalog` (which reads everything back from the replica nodes, so the
//! controller keeps no state). One catalog per loaded backend, built from its grant's node
//! sources; every call is bounded by the backend's `import_timeout` as a whole, on top of the
//! catalog's per-request timeout, so a dead node answers `unavailable` or `deadline-exceeded`,
//! never a hung call.
//!
//! Its host functions see a [`BlockCtxView`]: the backend's [`BlockCtx`], nothing of the call.
use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use wasmcsi_block::catalog::{Catalog, CatalogError, Member, MemberState, NodeView, SetView};
use wasmcsi_block::protocol::SnapshotInfo;
use wasmtime::component::{HasData, LinkerInstance};

use crate::bindings::types::{Error, Pair, Timestamp};
use crate::bindings::wasmcsi::backend::block::{
    self as wit, BlockSnapshot, BlockSource, Host, NodeInfo, Replica, ReplicaSet, ReplicaState,
};

/// What `block` needs of one backend, resolved at load and shared by its calls.
pub struct BlockCtx {
    pub backend: String,
    /// the replica sets on the granted replica nodes; `None` without a block grant
    pub catalog: Option<Catalog>,
    /// how long one import may take
    pub import_timeout: Duration,
}

/// What `block` sees of a call.
pub struct BlockCtxView<'a> {
    pub ctx: &'a BlockCtx,
}

/// A store whose calls can reach `block`: it lends `block` its view.
pub trait BlockView: Send {
    fn block(&mut self) -> BlockCtxView<'_>;
}

/// `block` for the linker: its host functions get a [`BlockCtxView`].
pub struct Block;

impl HasData for Block {
    type Data<'a> = BlockCtxView<'a>;
}

/// Link `block`'s host functions into `instance` (named as the component's contract version
/// names the interface).
pub fn add_to_instance<T: BlockView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    wit::add_to_linker_instance::<T, Block>(instance, T::block)
}

/// Most metadata a backend may keep with a replica set (keys and values, in bytes), far below
/// what a replica's record holds, so members and owners always fit beside it.
pub const MAX_METADATA_BYTES: usize = 8 * 1024;

/// The WIT error for a catalog error: one case each, the message kept.
pub fn to_wit(e: CatalogError) -> Error {
    match e {
        CatalogError::Invalid(m) => Error::InvalidArgument(m),
        CatalogError::NotFound(m) => Error::NotFound(m),
        CatalogError::AlreadyExists(m) => Error::AlreadyExists(m),
        CatalogError::FailedPrecondition(m) => Error::FailedPrecondition(m),
        CatalogError::OutOfRange(m) => Error::OutOfRange(m),
        CatalogError::ResourceExhausted(m) => Error::ResourceExhausted(m),
        CatalogError::Unavailable(m) => Error::Unavailable(m),
        CatalogError::NotGranted(m) | CatalogError::Denied(m) => Error::PermissionDenied(m),
        CatalogError::Internal(m) => Error::Internal(m),
    }
}

fn timestamp(ns: u64) -> Timestamp {
    Timestamp { seconds: (ns / 1_000_000_000) as i64, nanos: (ns % 1_000_000_000) as u32 }
}

fn pairs(m: &BTreeMap<String, String>) -> Vec<Pair> {
    m.iter().map(|(k, v)| Pair { key: k.clone(), value: v.clone() }).collect()
}

fn node_to_wit(n: &NodeView) -> NodeInfo {
    NodeInfo {
        name: n.name.clone(),
        free_bytes: n.available,
        total_bytes: n.capacity,
        labels: n.labels.iter().map(|(k, v)| Pair { key: k.clone(), value: v.clone() }).collect(),
        replicas: u32::try_from(n.replicas.len()).unwrap_or(u32::MAX),
    }
}

fn member_to_wit(m: &Member) -> Replica {
    Replica {
        node: m.node.clone(),
        state: match m.state {
            MemberState::Healthy => ReplicaState::Healthy,
            MemberState::Rebuilding => ReplicaState::Rebuilding,
            MemberState::Stale => ReplicaState::Stale,
            MemberState::Unreachable => ReplicaState::Unreachable,
        },
        down_since: m.down_since_ns.map(timestamp),
        rebuilt_bytes: m.rebuilt,
        rebuild_total_bytes: m.rebuild_total,
    }
}

pub fn set_to_wit(v: &SetView) -> ReplicaSet {
    ReplicaSet {
        id: v.id.clone(),
        size_bytes: v.size,
        replicas: v.members.iter().map(member_to_wit).collect(),
        attached_to: v.attached_to.clone(),
        metadata: pairs(&v.record.metadata),
        created: timestamp(v.record.created_ns),
        filling: v.filling,
    }
}

fn snapshot_to_wit(volume_id: &str, s: &SnapshotInfo, size: u64) -> BlockSnapshot {
    BlockSnapshot {
        name: s.name.clone(),
        volume_id: volume_id.to_owned(),
        size_bytes: size,
        created: timestamp(s.created_ns),
    }
}

/// Checks the metadata a backend wants stored: bounded, keys unique.
fn metadata(list: Vec<Pair>) -> Result<BTreeMap<String, String>, Error> {
    let bytes: usize = list.iter().map(|p| p.key.len() + p.value.len()).sum();
    if bytes > MAX_METADATA_BYTES {
        return Err(Error::InvalidArgument(format!(
            "replica set metadata of {bytes} bytes exceeds the {MAX_METADATA_BYTES}-byte limit"
        )));
    }
    let count = list.len();
    let map: BTreeMap<String, String> = list.into_iter().map(|p| (p.key, p.value)).collect();
    if map.len() != count {
        return Err(Error::InvalidArgument("replica set metadata repeats a key".into()));
    }
    Ok(map)
}

impl BlockCtxView<'_> {
    /// The catalog and the deadline of one import.
    fn catalog(&self) -> Result<(Catalog, Duration), Error> {
        let catalog = self
            .ctx
            .catalog
            .clone()
            .ok_or_else(|| Error::PermissionDenied(format!("backend {} has no block grant", self.ctx.backend)))?;
        Ok((catalog, self.ctx.import_timeout))
    }
}

/// Runs one catalog operation under the import timeout.
async fn block_call<T, F, Fut>(handle: Result<(Catalog, Duration), Error>, what: &str, op: F) -> Result<T, Error>
where
    F: FnOnce(Catalog) -> Fut,
    Fut: Future<Output = Result<T, CatalogError>>,
{
    let (catalog, timeout) = handle?;
    match tokio::time::timeout(timeout, op(catalog)).await {
        Ok(result) => result.map_err(to_wit),
        Err(_) => Err(Error::DeadlineExceeded(format!("block {what} did not finish within {timeout:?}"))),
    }
}

impl Host for BlockCtxView<'_> {
    #[tracing::instrument(name = "import.block.list_nodes", skip_all, fields(backend = %self.ctx.backend))]
    async fn list_nodes(&mut self) -> Result<Vec<NodeInfo>, Error> {
        block_call(self.catalog(), "list-nodes", |c| async move {
            let d = c.discover().await;
            if d.nodes.is_empty() && !d.unreachable.is_empty() {
                let tried: Vec<String> = d.unreachable.iter().map(|(a, why)| format!("{a}: {why}")).collect();
                return Err(CatalogError::Unavailable(format!(
                    "no granted replica node answers ({})",
                    tried.join("; ")
                )));
            }
            Ok(d.nodes.values().map(node_to_wit).collect())
        })
        .await
    }

    #[tracing::instrument(name = "import.block.create", skip_all, fields(backend = %self.ctx.backend, %id, size_bytes))]
    async fn create(
        &mut self,
        id: String,
        size_bytes: u64,
        nodes: Vec<String>,
        source: Option<BlockSource>,
        metadata_list: Vec<Pair>,
    ) -> Result<ReplicaSet, Error> {
        let metadata = metadata(metadata_list)?;
        let source = source.map(|s| match s {
            BlockSource::Snapshot((volume, snapshot)) => (volume, Some(snapshot)),
            BlockSource::Volume(volume) => (volume, None),
        });
        block_call(self.catalog(), "create", |c| async move {
            c.create(&id, size_bytes, &nodes, source, metadata).await.map(|v| set_to_wit(&v))
        })
        .await
    }

    #[tracing::instrument(name = "import.block.get", skip_all, fields(backend = %self.ctx.backend, %id))]
    async fn get(&mut self, id: String) -> Result<Option<ReplicaSet>, Error> {
        block_call(self.catalog(), "get", |c| async move { c.get(&id).await.map(|v| v.as_ref().map(set_to_wit)) }).await
    }

    #[tracing::instrument(name = "import.block.list_sets", skip_all, fields(backend = %self.ctx.backend))]
    async fn list_sets(&mut self, start_after: Option<String>, limit: u32) -> Result<Vec<ReplicaSet>, Error> {
        block_call(self.catalog(), "list-sets", |c| async move {
            let sets = c.list(start_after.as_deref(), limit as usize).await?;
            Ok(sets.iter().map(set_to_wit).collect())
        })
        .await
    }

    #[tracing::instrument(name = "import.block.set_metadata", skip_all, fields(backend = %self.ctx.backend, %id))]
    async fn set_metadata(&mut self, id: String, metadata_list: Vec<Pair>) -> Result<(), Error> {
        let metadata = metadata(metadata_list)?;
        block_call(self.catalog(), "set-metadata", |c| async move { c.set_metadata(&id, metadata).await }).await
    }

    #[tracing::instrument(name = "import.block.delete", skip_all, fields(backend = %self.ctx.backend, %id))]
    async fn delete(&mut self, id: String) -> Result<(), Error> {
        block_call(self.catalog(), "delete", |c| async move { c.delete(&id).await }).await
    }

    #[tracing::instrument(name = "import.block.expand", skip_all, fields(backend = %self.ctx.backend, %id, size_bytes))]
    async fn expand(&mut self, id: String, size_bytes: u64) -> Result<ReplicaSet, Error> {
        block_call(self.catalog(), "expand", |c| async move { c.expand(&id, size_bytes).await.map(|v| set_to_wit(&v)) })
            .await
    }

    #[tracing::instrument(name = "import.block.replace", skip_all, fields(backend = %self.ctx.backend, %id, %node, %with))]
    async fn replace(&mut self, id: String, node: String, with: String) -> Result<ReplicaSet, Error> {
        block_call(
            self.catalog(),
            "replace",
            |c| async move { c.replace(&id, &node, &with).await.map(|v| set_to_wit(&v)) },
        )
        .await
    }

    #[tracing::instrument(name = "import.block.snapshot", skip_all, fields(backend = %self.ctx.backend, %id, %name))]
    async fn snapshot(&mut self, id: String, name: String) -> Result<BlockSnapshot, Error> {
        block_call(self.catalog(), "snapshot", |c| async move {
            let s = c.snapshot(&id, &name).await?;
            let size = c.get(&id).await?.map(|v| v.size).unwrap_or(0);
            Ok(snapshot_to_wit(&id, &s, size))
        })
        .await
    }

    #[tracing::instrument(name = "import.block.delete_snapshot", skip_all, fields(backend = %self.ctx.backend, %id, %name))]
    async fn delete_snapshot(&mut self, id: String, name: String) -> Result<(), Error> {
        block_call(self.catalog(), "delete-snapshot", |c| async move { c.delete_snapshot(&id, &name).await }).await
    }

    #[tracing::instrument(name = "import.block.list_snapshots", skip_all, fields(backend = %self.ctx.backend))]
    async fn list_snapshots(&mut self, id: Option<String>) -> Result<Vec<BlockSnapshot>, Error> {
        block_call(self.catalog(), "list-snapshots", |c| async move {
            let found = c.list_snapshots(id.as_deref()).await?;
            Ok(found.iter().map(|(volume, s, size)| snapshot_to_wit(volume, s, *size)).collect())
        })
        .await
    }
}
