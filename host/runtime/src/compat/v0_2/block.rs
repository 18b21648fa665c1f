//! `block` as 0.2.0 named it, served by the current capability: a replica goes to a node (now a
//! `placement` without a disk, the disk the host picks), a node and a set are reported without
//! what 0.3.0 added (disks, a replica's disk, limits, standby), and `replace` names nodes. Each
//! function converts its arguments, calls the current one on the same view, and converts the
//! answer, so the two versions cannot drift apart in behaviour.
use crate::bindings::types::{Error, Pair};
use crate::bindings::v0_2::block::{self as old, Host};
use crate::bindings::wasmcsi::backend::block as new;
use crate::compat::convert::{cases, record};
use crate::imports::block::{Block, BlockCtxView, BlockView};
use wasmtime::component::LinkerInstance;

/// Link 0.2.0's `block` into `instance` (named `wasmcsi:backend/block@0.2.0`).
pub fn add_to_instance<T: BlockView + 'static>(instance: &mut LinkerInstance<'_, T>) -> wasmtime::Result<()> {
    old::add_to_linker_instance::<T, Block>(instance, T::block)
}

record! {
    new::Replica => old::Replica { node, state, down_since, rebuilt_bytes, rebuild_total_bytes }
    new::ReplicaSet => old::ReplicaSet { id, size_bytes, replicas [each], attached_to, metadata, created, filling }
    new::NodeInfo => old::NodeInfo { name, free_bytes, total_bytes, labels, replicas }
    new::BlockSnapshot => old::BlockSnapshot { name, volume_id, size_bytes, created }
}

cases! {
    new::ReplicaState => old::ReplicaState { Healthy, Rebuilding, Stale, Unreachable }
    old::BlockSource => new::BlockSource { Snapshot(source), Volume(source) }
}

/// A 0.2.0 node name as a placement: the node's only disk.
fn on(node: String) -> new::Placement {
    new::Placement { node, disk: None }
}

fn each<A: Into<B>, B>(list: Vec<A>) -> Vec<B> {
    list.into_iter().map(Into::into).collect()
}

impl Host for BlockCtxView<'_> {
    async fn list_nodes(&mut self) -> Result<Vec<old::NodeInfo>, Error> {
        new::Host::list_nodes(self).await.map(each)
    }

    async fn create(
        &mut self,
        id: String,
        size_bytes: u64,
        nodes: Vec<String>,
        source: Option<old::BlockSource>,
        metadata: Vec<Pair>,
    ) -> Result<old::ReplicaSet, Error> {
        let placements = nodes.into_iter().map(on).collect();
        new::Host::create(self, id, size_bytes, placements, source.map(Into::into), metadata).await.map(Into::into)
    }

    async fn get(&mut self, id: String) -> Result<Option<old::ReplicaSet>, Error> {
        new::Host::get(self, id).await.map(|set| set.map(Into::into))
    }

    async fn list_sets(&mut self, start_after: Option<String>, limit: u32) -> Result<Vec<old::ReplicaSet>, Error> {
        new::Host::list_sets(self, start_after, limit).await.map(each)
    }

    async fn set_metadata(&mut self, id: String, metadata: Vec<Pair>) -> Result<(), Error> {
        new::Host::set_metadata(self, id, metadata).await
    }

    async fn delete(&mut self, id: String) -> Result<(), Error> {
        new::Host::delete(self, id).await
    }

    async fn expand(&mut self, id: String, size_bytes: u64) -> Result<old::ReplicaSet, Error> {
        new::Host::expand(self, id, size_bytes).await.map(Into::into)
    }

    async fn replace(&mut self, id: String, node: String, with: String) -> Result<old::ReplicaSet, Error> {
        new::Host::replace(self, id, on(node), on(with)).await.map(Into::into)
    }

    async fn snapshot(&mut self, id: String, name: String) -> Result<old::BlockSnapshot, Error> {
        new::Host::snapshot(self, id, name).await.map(Into::into)
    }

    async fn delete_snapshot(&mut self, id: String, name: String) -> Result<(), Error> {
        new::Host::delete_snapshot(self, id, name).await
    }

    async fn list_snapshots(&mut self, id: Option<String>) -> Result<Vec<old::BlockSnapshot>, Error> {
        new::Host::list_snapshots(self, id).await.map(each)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bindings::types::IoLimits;
    use crate::bindings::types::Timestamp;

    #[test]
    fn a_replica_set_reaches_a_0_2_guest_without_what_0_3_added() {
        let set = new::ReplicaSet {
            id: "v".into(),
            size_bytes: 4096,
            replicas: vec![new::Replica {
                node: "n1".into(),
                disk: Some("default".into()),
                state: new::ReplicaState::Unreachable,
                down_since: Some(Timestamp { seconds: 5, nanos: 1 }),
                rebuilt_bytes: 1,
                rebuild_total_bytes: 2,
            }],
            attached_to: Some("n1".into()),
            metadata: vec![Pair { key: "k".into(), value: "v".into() }],
            created: Timestamp { seconds: 1, nanos: 0 },
            filling: Some((1, 2)),
            limits: IoLimits { read_iops: 0, write_iops: 0, read_bytes_per_second: 0, write_bytes_per_second: 0 },
            rebuild_bytes_per_second: 0,
            standby: None,
        };
        let old = old::ReplicaSet::from(set);
        let text = format!("{old:?}");
        for kept in ["n1", "Unreachable", "seconds: 5", "filling: Some((1, 2))", "attached-to: Some(\"n1\")"] {
            assert!(text.contains(kept), "{kept} in {text}");
        }
        assert!(!text.contains("disk") && !text.contains("limits") && !text.contains("standby"), "{text}");
    }
}
