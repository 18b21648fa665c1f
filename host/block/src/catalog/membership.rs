//! Changing who holds a set: replacing the replica on one node with a new, empty one on another
//! (the record is written to the new member first; an attached engine is told to replace its
//! replica and rebuilds it, a detached set's current members move one revision ahead so the new
//! one looks behind to the next engine), and collecting the replicas a replacement or an
//! interrupted delete left behind.

use super::engine_call::EngineRequest;
use super::{Catalog, CatalogError, Holder, Result, SetView, lock};

impl Catalog {
    /// Moves the replica on `node` to the empty node `with`, on its disk with the most space.
    pub async fn replace(&self, id: &str, node: &str, with: &str) -> Result<SetView> {
        self.replace_on(id, node, with, None).await
    }

    /// Moves the replica on `node` to the empty node `with`, on its disk `disk` (see
    /// `block.replace`; `None`: the disk with the most space).
    #[tracing::instrument(name = "catalog.replace", skip(self))]
    pub async fn replace_on(&self, id: &str, node: &str, with: &str, disk: Option<&str>) -> Result<SetView> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)?.filter(|(_, r)| !r.deleting) else {
            return Err(CatalogError::NotFound(format!("replica set {id} not found")));
        };
        let Some(index) = record.member_index(node) else {
            // A retry after the replacement went through.
            if record.member_index(with).is_some() {
                return self.live_view(&d, id).await;
            }
            return Err(CatalogError::NotFound(format!("replica set {id} has no replica on node {node}")));
        };
        if record.member_index(with).is_some() {
            return Err(CatalogError::Invalid(format!("node {with} already holds a replica of {id}")));
        }
        let Some(target) = d.node(with) else {
            return Err(CatalogError::NotGranted(format!(
                "node {with} is not among the granted replica nodes that answer"
            )));
        };
        let view = self.assemble(&d, id, &holders, info.clone(), record.clone(), None);
        let size = view.size.max(holders.iter().map(|h| h.header.size).max().unwrap_or(0));
        let disk = super::create::choose_disk(target, disk, size)?;
        // A leftover of an earlier membership must not pass for the new, empty replica.
        if holders.iter().any(|h| h.node == with) {
            self.client(target.addr).delete_replica(id).await?;
        }
        self.client(target.addr).create_replica_on(&disk, id, size).await?;
        let mut moved = record.clone();
        moved.members[index] = with.to_owned();
        let next = Self::next_seen(&d, &info, &moved, info.epoch)?;
        let mut targets = vec![with.to_owned()];
        targets.extend(moved.members.iter().filter(|m| m.as_str() != with).cloned());
        self.write_record(&d, id, &next, &targets).await?;
        let live = self.view(&d, id).await?;
        if let Some(owner) = live.as_ref().and_then(|v| v.attached_to.clone()) {
            let request = EngineRequest::ReplaceReplica { index, addr: target.addr };
            self.engine_ok(&d, &owner, id, &request).await?;
        } else {
            // Detached: the new, empty replica must look behind to the next engine, whatever
            // revision the others are at. The current members move one revision ahead; a member
            // that is behind already stays behind.
            let newest = holders
                .iter()
                .filter(|h| moved.member_index(&h.node).is_some())
                .map(|h| h.header.revision)
                .max()
                .unwrap_or(0);
            for h in holders.iter().filter(|h| h.node != with && moved.member_index(&h.node).is_some()) {
                if h.header.revision == newest {
                    let mut s =
                        crate::control::ReplicaSession::open_over(h.addr, id, self.timeout, info.epoch, &self.reach)
                            .await?;
                    let raised = s.set_revision(newest + 1).await;
                    s.close().await?;
                    raised?;
                }
            }
        }
        // Best effort: what is left on the old node is a leftover and is collected later.
        if let Some(old) = d.node(node)
            && let Err(e) = self.client(old.addr).delete_replica(id).await
        {
            tracing::info!(volume = id, node, error = %e, "replaced replica not removed yet");
        }
        lock(&self.down_since).remove(&(id.to_owned(), node.to_owned()));
        self.live_view(&self.discover().await, id).await
    }

    /// Removes replicas of `id` on nodes that are not members of its newest record (left by a
    /// replacement whose node was down), and finishes a delete interrupted by a node that was
    /// down. Returns how many replicas it removed.
    #[tracing::instrument(name = "catalog.collect", skip(self))]
    pub async fn collect(&self, id: &str) -> Result<usize> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else { return Ok(0) };
        let doomed: Vec<Holder> = holders
            .into_iter()
            .filter(|h| record.deleting || (record.member_index(&h.node).is_none() && h.record.version < info.version))
            .collect();
        for h in &doomed {
            self.client(h.addr).delete_replica(id).await?;
            tracing::info!(volume = id, node = %h.node, "leftover replica removed");
        }
        Ok(doomed.len())
    }
}
