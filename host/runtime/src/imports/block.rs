//! `block`: the replicated block engine's replica sets on the nodes granted to the backend,
//! through `wasmcsi_block::catalog` (which reads everything back from the replica nodes, so the
//! controller keeps no state). One catalog per loaded backend, built from its grant's node
//! sources; every call is bounded by the backend's `import_timeout` as a whole, on top of the
//! catalog's per-request timeout, so a dead node answers `unavailable` or `deadline-exceeded`,
//! never a hung call.
//!
//! Disks. A replica server keeps its replicas in one or more replica roots, its disks
//! (`default` always, more with `--replica-root NAME=PATH`): a node reports each with its space
//! and a replica the disk holding it; a placement names one of its node's disks (any other is
//! invalid-argument naming it) or none (the disk with the most space available that no other
//! replica of the set is on). A replica is named by its node and disk: several placements may
//! fall on one node, each on another disk (a cluster with fewer nodes than replicas; which
//! spread to choose is the backend's policy), and two on one named disk of one node are
//! invalid-argument. Each replica a set reports names its disk.
//!
//! A set created from a backup (`block-source::backup`, on a target granted to the backend's
//! `backup`) is filled by the catalog's restorer, the host's [`crate::backups::Backups`], like a
//! clone: `filling` says how far it is.
//!
//! I/O limits (`set-limits`) are kept in the set's record on every replica and applied by its
//! engine, now when it runs and at every attach (`wasmcsi_block::qos`); the rebuild bandwidth
//! is kept and reported, and not yet applied by the engine (its rebuilds run at the node's
//! pace).
//!
//! Not provided by this host yet (answered `unimplemented`, see [`super::not_provided`]): adding
//! and removing replicas and standby sets (`follow`, `activate`; no set is
//! one).
//!
//! Group snapshots (`snapshot-group`) are the catalog's: every attached set's engine holds its
//! writes while its snapshot is taken, then all let go (`wasmcsi_block::catalog`'s `group`);
//! how long the writes were held is logged with the call.
//!
//! Its host functions see a [`BlockCtxView`]: the backend's [`BlockCtx`], nothing of the call.
use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use wasmcsi_block::catalog::{self, Catalog, CatalogError, Member, MemberState, NodeView, Origin, SetView};
use wasmcsi_block::protocol::SnapshotInfo;
use wasmcsi_block::qos;
use wasmtime::component::{HasData, LinkerInstance};

use super::not_provided;
use crate::bindings::types::{Error, IoLimits, Pair, Timestamp};
use crate::bindings::wasmcsi::backend::block::{
    self as wit, BlockSnapshot, BlockSource, DiskInfo, Host, NodeInfo, Placement, Replica, ReplicaSet, ReplicaState,
};

/// What `block` needs of one backend, resolved at load and shared by its calls.
pub struct BlockCtx {
    pub backend: String,
    /// the replica sets on the granted replica nodes; `None` without a block grant
    pub catalog: Option<Catalog>,
    /// how long one import may take
    pub import_timeout: Duration,
    /// the backup targets granted to the backend: what a set may be restored from
    pub backup_targets: Vec<String>,
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
        CatalogError::Aborted(m) => Error::Aborted(m),
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
        labels: n.labels.iter().map(|(k, v)| Pair { key: k.clone(), value: v.clone() }).collect(),
        replicas: u32::try_from(n.replicas.len()).unwrap_or(u32::MAX),
        free_bytes: n.disks.iter().map(|d| d.available).sum(),
        total_bytes: n.disks.iter().map(|d| d.capacity).sum(),
        disks: n
            .disks
            .iter()
            .map(|d| DiskInfo { name: d.name.clone(), free_bytes: d.available, total_bytes: d.capacity })
            .collect(),
    }
}

/// The catalog's placements of `placements`, once no two name one disk of one node (several on
/// one node are fine, each on its own disk; which disks a node has, and which are left for the
/// placements naming none, is the catalog's to check).
fn placed(placements: &[Placement]) -> Result<Vec<catalog::Placement>, Error> {
    let mut out: Vec<catalog::Placement> = Vec::with_capacity(placements.len());
    for p in placements {
        if let Some(disk) = &p.disk
            && out.iter().any(|o| o.node == p.node && o.disk.as_ref() == Some(disk))
        {
            return Err(Error::InvalidArgument(format!(
                "two placements on disk {disk} of node {}: a disk holds one replica of a set",
                p.node
            )));
        }
        out.push(catalog::Placement { node: p.node.clone(), disk: p.disk.clone() });
    }
    Ok(out)
}

fn member_to_wit(m: &Member) -> Replica {
    Replica {
        node: m.node.clone(),
        disk: Some(m.disk.clone()),
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

fn limits_to_wit(l: &qos::IoLimits) -> IoLimits {
    IoLimits {
        read_iops: l.read_iops,
        write_iops: l.write_iops,
        read_bytes_per_second: l.read_bytes_per_second,
        write_bytes_per_second: l.write_bytes_per_second,
    }
}

fn limits_from_wit(l: &IoLimits) -> qos::IoLimits {
    qos::IoLimits {
        read_iops: l.read_iops,
        write_iops: l.write_iops,
        read_bytes_per_second: l.read_bytes_per_second,
        write_bytes_per_second: l.write_bytes_per_second,
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
        limits: limits_to_wit(&v.record.limits),
        rebuild_bytes_per_second: v.record.rebuild_bytes_per_second,
        // Standby sets are not provided by this host: none is one.
        standby: None,
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
        placements: Vec<Placement>,
        source: Option<BlockSource>,
        metadata_list: Vec<Pair>,
    ) -> Result<ReplicaSet, Error> {
        let metadata = metadata(metadata_list)?;
        let placements = placed(&placements)?;
        let source = match source {
            None => None,
            Some(BlockSource::Snapshot((volume, snapshot))) => Some(Origin::Snapshot { volume, snapshot }),
            Some(BlockSource::Volume(volume)) => Some(Origin::Volume(volume)),
            Some(BlockSource::Backup((target, backup_id))) => {
                // Whether the backend may read that target is its `backup` grant.
                if !self.ctx.backup_targets.contains(&target) {
                    return Err(Error::PermissionDenied(format!(
                        "backup target {target:?} is not granted to backend {}",
                        self.ctx.backend
                    )));
                }
                let Some((volume, backup)) = crate::backups::parse_backup_id(&backup_id) else {
                    return Err(Error::InvalidArgument(format!("backup id {backup_id:?} is not VOLUME/NAME")));
                };
                Some(Origin::Backup { target, volume: volume.to_owned(), backup: backup.to_owned() })
            }
        };
        block_call(self.catalog(), "create", |c| async move {
            c.create_on(&id, size_bytes, &placements, source, metadata).await.map(|v| set_to_wit(&v))
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

    #[tracing::instrument(name = "import.block.replace", skip_all, fields(backend = %self.ctx.backend, %id, node = %replica.node, with = %with.node))]
    async fn replace(&mut self, id: String, replica: Placement, with: Placement) -> Result<ReplicaSet, Error> {
        block_call(self.catalog(), "replace", |c| async move {
            let (from, to) = (replica.disk.as_deref(), with.disk.as_deref());
            c.replace_on(&id, &replica.node, from, &with.node, to).await.map(|v| set_to_wit(&v))
        })
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

    #[tracing::instrument(name = "import.block.set_limits", skip_all, fields(backend = %self.ctx.backend, %id))]
    async fn set_limits(
        &mut self,
        id: String,
        limits: IoLimits,
        rebuild_bytes_per_second: u64,
    ) -> Result<ReplicaSet, Error> {
        let limits = limits_from_wit(&limits);
        block_call(self.catalog(), "set-limits", |c| async move {
            c.set_limits(&id, limits, rebuild_bytes_per_second).await.map(|v| set_to_wit(&v))
        })
        .await
    }

    #[tracing::instrument(name = "import.block.add_replica", skip_all, fields(backend = %self.ctx.backend, %id, node = %placement.node))]
    async fn add_replica(&mut self, id: String, placement: Placement) -> Result<ReplicaSet, Error> {
        block_call(self.catalog(), "add-replica", |c| async move {
            c.add_replica_on(&id, &placement.node, placement.disk.as_deref()).await.map(|v| set_to_wit(&v))
        })
        .await
    }

    #[tracing::instrument(name = "import.block.remove_replica", skip_all, fields(backend = %self.ctx.backend, %id, node = %replica.node))]
    async fn remove_replica(&mut self, id: String, replica: Placement) -> Result<ReplicaSet, Error> {
        block_call(self.catalog(), "remove-replica", |c| async move {
            c.remove_replica_on(&id, &replica.node, replica.disk.as_deref()).await.map(|v| set_to_wit(&v))
        })
        .await
    }

    #[tracing::instrument(name = "import.block.snapshot_group", skip_all, fields(backend = %self.ctx.backend, %name))]
    async fn snapshot_group(&mut self, ids: Vec<String>, name: String) -> Result<Vec<BlockSnapshot>, Error> {
        block_call(self.catalog(), "snapshot-group", |c| async move {
            let group = c.snapshot_group(&ids, &name).await?;
            if let Some(held) = group.held {
                tracing::info!(sets = ids.len(), held_us = held.as_micros() as u64, "writes held for a group snapshot");
            }
            Ok(group.snapshots.iter().map(|(volume, s, size)| snapshot_to_wit(volume, s, *size)).collect())
        })
        .await
    }

    #[tracing::instrument(name = "import.block.follow", skip_all, fields(backend = %self.ctx.backend, %id, %target))]
    async fn follow(&mut self, id: String, target: String, source_volume: String) -> Result<ReplicaSet, Error> {
        let _ = source_volume;
        self.catalog()?;
        Err(not_provided("block follow: standby volumes"))
    }

    #[tracing::instrument(name = "import.block.activate", skip_all, fields(backend = %self.ctx.backend, %id))]
    async fn activate(&mut self, id: String) -> Result<ReplicaSet, Error> {
        self.catalog()?;
        Err(not_provided("block activate: standby volumes"))
    }
}

#[cfg(test)]
mod tests {
    //! The shape this host gives `block` without a node (placements, disks, what it does not
    //! provide); the catalog's work against real replica servers is in `tests/all/block_backend.rs`.
    use super::*;
    use wasmcsi_block::replica::DEFAULT_DISK;

    fn view(catalog: Option<Catalog>) -> BlockCtx {
        BlockCtx { backend: "b".into(), catalog, import_timeout: Duration::from_millis(200), backup_targets: vec![] }
    }

    fn granted() -> BlockCtx {
        // Nothing listens on port 9 of loopback: only what needs no node is reached.
        let sources = wasmcsi_block::catalog::NodeSources { nodes: vec!["127.0.0.1:9".into()], ..Default::default() };
        view(Some(Catalog::new(sources, Duration::from_millis(200))))
    }

    fn at(node: &str, disk: Option<&str>) -> Placement {
        Placement { node: node.into(), disk: disk.map(Into::into) }
    }

    #[test]
    fn placements_share_a_node_on_distinct_disks_and_two_on_one_named_disk_are_refused() {
        let placements = placed(&[at("n1", None), at("n2", Some("ssd-2"))]).expect("placed");
        assert_eq!(placements[1], catalog::Placement { node: "n2".into(), disk: Some("ssd-2".into()) });
        // One node, three disks: the catalog picks the unnamed one's disk among those left.
        let one_node = placed(&[at("n1", None), at("n1", Some("ssd-2")), at("n1", Some(DEFAULT_DISK))])
            .expect("several replicas on one node");
        assert_eq!(one_node.len(), 3);
        let e =
            placed(&[at("n1", Some("ssd-2")), at("n2", None), at("n1", Some("ssd-2"))]).expect_err("one disk twice");
        assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("n1") && m.contains("ssd-2")), "{e:?}");
    }

    /// What this host does not provide answers `unimplemented` saying so (after the grant
    /// check, which still comes first): the host that provides one flips its line here.
    #[tokio::test]
    async fn what_this_host_does_not_provide_answers_unimplemented_saying_so() {
        let ctx = granted();
        let mut v = BlockCtxView { ctx: &ctx };
        let answers = [
            ("follow", v.follow("v".into(), "t".into(), "src".into()).await.map(drop)),
            ("activate", v.activate("v".into()).await.map(drop)),
        ];
        for (what, answer) in answers {
            match answer {
                Err(Error::Unimplemented(m)) => {
                    assert!(m.contains(what) && m.ends_with("not provided by this host"), "{what}: {m}")
                }
                other => panic!("{what}: expected unimplemented, got {other:?}"),
            }
        }
        // I/O limits are provided: a set no node holds is not found.
        let limits = IoLimits { read_iops: 1, write_iops: 0, read_bytes_per_second: 0, write_bytes_per_second: 0 };
        let e = v.set_limits("v".into(), limits, 0).await;
        assert!(matches!(&e, Err(Error::NotFound(m)) if m.contains("v")), "{e:?}");
        // A restore reads only a target granted to the backend's `backup`.
        let from_backup = Some(BlockSource::Backup(("t".into(), "v/b".into())));
        let e = v.create("v".into(), 4096, vec![at("n1", None)], from_backup, vec![]).await.map(drop);
        assert!(matches!(&e, Err(Error::PermissionDenied(m)) if m.contains("\"t\"")), "{e:?}");
        // Without a grant, permission-denied as for every other function.
        let ungranted = view(None);
        let mut v = BlockCtxView { ctx: &ungranted };
        assert!(matches!(v.activate("v".into()).await, Err(Error::PermissionDenied(_))));
    }

    #[test]
    fn a_node_reports_each_disk_with_its_space_and_their_sum() {
        let disk = |name: &str, capacity, available| wasmcsi_block::protocol::DiskSummary {
            name: name.into(),
            capacity,
            available,
            volumes: vec![],
        };
        let node = NodeView {
            name: "n1".into(),
            addr: "127.0.0.1:9501".parse().expect("addr"),
            labels: vec![("zone".into(), "a".into())],
            capacity: 100,
            available: 40,
            replicas: vec![],
            disks: vec![disk(DEFAULT_DISK, 100, 40), disk("ssd", 50, 30)],
        };
        let info = node_to_wit(&node);
        assert_eq!((info.free_bytes, info.total_bytes), (70, 150));
        let disks: Vec<(&str, u64, u64)> =
            info.disks.iter().map(|d| (d.name.as_str(), d.free_bytes, d.total_bytes)).collect();
        assert_eq!(disks, [(DEFAULT_DISK, 40, 100), ("ssd", 30, 50)]);
    }
}
