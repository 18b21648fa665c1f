//! Changing who holds a set: replacing one replica with a new, empty one on another node or
//! another disk (the record is written to the new member first; an attached engine is told to replace its
//! replica and rebuilds it, a detached set's current members move one revision ahead so the new
//! one looks behind to the next engine), adding a new, empty replica the same way, removing one
//! once every other is healthy (the engine lets go of it before the record drops it), and
//! collecting the replicas a replacement or an interrupted delete left behind.

use super::engine_call::EngineRequest;
use super::{Catalog, CatalogError, Holder, Location, MemberState, Result, SetView, VolumeRecord, lock};
use crate::protocol::RecordInfo;

/// The most replicas a set may have (the replicated-block backend allows 16; an engine holds
/// at most 64 over its life, removed ones included).
pub const MAX_MEMBERS: usize = 16;

/// The index of the member on `node` (on its disk `disk`; `None`: the only member on the node).
fn find_member(record: &VolumeRecord, id: &str, node: &str, disk: Option<&str>) -> Result<Option<usize>> {
    if let Some(disk) = disk {
        return Ok(record.member_index(&Location::new(node, disk)));
    }
    let on_node: Vec<usize> = (0..record.members.len()).filter(|i| record.members[*i].node == node).collect();
    match on_node.as_slice() {
        [] => Ok(None),
        [i] => Ok(Some(*i)),
        _ => Err(CatalogError::Invalid(format!(
            "node {node} holds {} replicas of {id}, one per disk: name the disk of the one to replace",
            on_node.len()
        ))),
    }
}

impl Catalog {
    /// Moves the replica on `node` (its only one) to the empty node `with`, on its disk with
    /// the most space.
    pub async fn replace(&self, id: &str, node: &str, with: &str) -> Result<SetView> {
        self.replace_on(id, node, None, with, None).await
    }

    /// Moves the replica on `node`'s disk `from_disk` (`None`: the node's only replica of the
    /// set) to the node `with`, on its disk `disk` (see `block.replace`; `None`: its disk with
    /// the most space that holds no replica of the set). `with` may be `node` itself: the
    /// replica then moves to another of its disks (a disk lost, the node alive).
    #[tracing::instrument(name = "catalog.replace", skip(self))]
    pub async fn replace_on(
        &self,
        id: &str,
        node: &str,
        from_disk: Option<&str>,
        with: &str,
        disk: Option<&str>,
    ) -> Result<SetView> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)?.filter(|(_, r)| !r.deleting) else {
            return Err(CatalogError::NotFound(format!("replica set {id} not found")));
        };
        let Some(index) = find_member(&record, id, node, from_disk)? else {
            // A retry after the replacement went through.
            let arrived = match disk {
                Some(disk) => record.member_index(&Location::new(with, disk)).is_some(),
                None => with != node && record.has_node(with),
            };
            if arrived {
                return self.live_view(&d, id).await;
            }
            let what = from_disk.map_or_else(|| format!("node {node}"), |disk| format!("disk {disk} of node {node}"));
            return Err(CatalogError::NotFound(format!("replica set {id} has no replica on {what}")));
        };
        let old = record.members[index].clone();
        let Some(target) = d.node(with) else {
            return Err(CatalogError::NotGranted(format!(
                "node {with} is not among the granted replica nodes that answer"
            )));
        };
        let view = self.assemble(&d, id, &holders, info.clone(), record.clone(), None);
        let size = view.size.max(holders.iter().map(|h| h.header.size).max().unwrap_or(0));
        let taken: Vec<&str> = record.members.iter().filter(|m| m.node == with).map(|m| m.disk.as_str()).collect();
        let new = Location::new(with, super::create::choose_disk(target, disk, size, &taken)?);
        if record.member_index(&new).is_some() {
            return Err(CatalogError::Invalid(format!("{new} already holds a replica of {id}")));
        }
        // A leftover of an earlier membership must not pass for the new, empty replica.
        if holders.iter().any(|h| h.at == new) {
            self.client(target.addr).delete_replica_on(&new.disk, id).await?;
        }
        self.client(target.addr).create_replica_on(&new.disk, id, size).await?;
        let mut moved = record.clone();
        moved.members[index] = new.clone();
        let next = Self::next_seen(&d, &info, &moved, info.epoch)?;
        let mut targets = vec![new.clone()];
        targets.extend(moved.members.iter().filter(|m| **m != new).cloned());
        self.write_record(&d, id, &next, &targets).await?;
        let live = self.view(&d, id).await?;
        if let Some(owner) = live.as_ref().and_then(|v| v.attached_to.clone()) {
            let request = EngineRequest::ReplaceReplica { index, addr: target.addr, disk: new.disk.clone() };
            self.engine_ok(&d, &owner, id, &request).await?;
        } else {
            self.put_behind(&info, id, &holders, &moved, &new).await?;
        }
        // Best effort: what is left where it was is a leftover and is collected later.
        if let Some(n) = d.node(&old.node)
            && let Err(e) = self.client(n.addr).delete_replica_on(&old.disk, id).await
        {
            tracing::info!(volume = id, replica = %old, error = %e, "replaced replica not removed yet");
        }
        lock(&self.down_since).remove(&(id.to_owned(), old));
        self.live_view(&self.discover().await, id).await
    }

    /// Detached: the new, empty replica `new` must look behind to the next engine, whatever
    /// revision the others are at. The current members move one revision ahead; a member that
    /// is behind already stays behind.
    async fn put_behind(
        &self,
        info: &RecordInfo,
        id: &str,
        holders: &[Holder],
        record: &VolumeRecord,
        new: &Location,
    ) -> Result<()> {
        let newest = holders
            .iter()
            .filter(|h| record.member_index(&h.at).is_some())
            .map(|h| h.header.revision)
            .max()
            .unwrap_or(0);
        for h in holders.iter().filter(|h| h.at != *new && record.member_index(&h.at).is_some()) {
            if h.header.revision == newest {
                let mut s = crate::control::ReplicaSession::open_on(
                    h.addr,
                    &h.at.disk,
                    id,
                    self.timeout,
                    info.epoch,
                    &self.reach,
                )
                .await?;
                let raised = s.set_revision(newest + 1).await;
                s.close().await?;
                raised?;
            }
        }
        Ok(())
    }

    /// Adds a new, empty replica of `id` on `node`'s disk `disk` (`None`: its disk with the
    /// most space that holds no replica of the set) as the set's last member: written to the
    /// record first (the new member first of all), then an attached engine rebuilds it while
    /// I/O goes on, or a detached set's members move a revision ahead (see [`Self::put_behind`]).
    /// A retry after it went through (the node, or that disk of it, holds a member): success.
    #[tracing::instrument(name = "catalog.add_replica", skip(self))]
    pub async fn add_replica_on(&self, id: &str, node: &str, disk: Option<&str>) -> Result<SetView> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)?.filter(|(_, r)| !r.deleting) else {
            return Err(CatalogError::NotFound(format!("replica set {id} not found")));
        };
        let arrived = match disk {
            Some(disk) => record.member_index(&Location::new(node, disk)).is_some(),
            None => record.has_node(node),
        };
        if arrived {
            return self.live_view(&d, id).await;
        }
        if record.members.len() >= MAX_MEMBERS {
            return Err(CatalogError::Invalid(format!(
                "replica set {id} has {MAX_MEMBERS} replicas, the most a set may have"
            )));
        }
        let Some(target) = d.node(node) else {
            return Err(CatalogError::NotGranted(format!(
                "node {node} is not among the granted replica nodes that answer"
            )));
        };
        let view = self.assemble(&d, id, &holders, info.clone(), record.clone(), None);
        let size = view.size.max(holders.iter().map(|h| h.header.size).max().unwrap_or(0));
        let taken: Vec<&str> = record.members.iter().filter(|m| m.node == node).map(|m| m.disk.as_str()).collect();
        let new = Location::new(node, super::create::choose_disk(target, disk, size, &taken)?);
        // A leftover of an earlier membership must not pass for the new, empty replica.
        if holders.iter().any(|h| h.at == new) {
            self.client(target.addr).delete_replica_on(&new.disk, id).await?;
        }
        self.client(target.addr).create_replica_on(&new.disk, id, size).await?;
        let mut grown = record.clone();
        grown.members.push(new.clone());
        let next = Self::next_seen(&d, &info, &grown, info.epoch)?;
        let mut targets = vec![new.clone()];
        targets.extend(record.members.iter().cloned());
        self.write_record(&d, id, &next, &targets).await?;
        let live = self.view(&d, id).await?;
        if let Some(owner) = live.as_ref().and_then(|v| v.attached_to.clone()) {
            let request =
                EngineRequest::AddReplica { addr: target.addr, disk: new.disk.clone(), node: node.to_owned() };
            self.engine_ok(&d, &owner, id, &request).await?;
        } else {
            self.put_behind(&info, id, &holders, &grown, &new).await?;
        }
        tracing::info!(volume = id, replica = %new, "replica added");
        self.live_view(&self.discover().await, id).await
    }

    /// Removes the replica of `id` on `node`'s disk `disk` (`None`: the node's only one) once
    /// every other member is healthy (aborted until then; never the last one): an attached
    /// engine lets go of it first, then the record drops it, then it is deleted (best effort:
    /// a replica left is collected as a leftover). Absent: success.
    #[tracing::instrument(name = "catalog.remove_replica", skip(self))]
    pub async fn remove_replica_on(&self, id: &str, node: &str, disk: Option<&str>) -> Result<SetView> {
        let d = self.discover().await;
        let Some(view) = self.view(&d, id).await?.filter(|v| !v.record.deleting) else {
            return Err(CatalogError::NotFound(format!("replica set {id} not found")));
        };
        let Some(index) = find_member(&view.record, id, node, disk)? else {
            return Ok(view);
        };
        if view.record.members.len() == 1 {
            return Err(CatalogError::FailedPrecondition(format!(
                "{} is the only replica of {id}; a set keeps at least one",
                view.record.members[index]
            )));
        }
        if let Some(other) =
            view.members.iter().enumerate().find(|(i, m)| *i != index && m.state != MemberState::Healthy)
        {
            return Err(CatalogError::Aborted(format!(
                "replica on node {} disk {} of {id} is not healthy yet ({:?}): a replica is removed only once every other one is",
                other.1.node, other.1.disk, other.1.state
            )));
        }
        let old = view.record.members[index].clone();
        let addr = d.node(&old.node).map(|n| n.addr).or_else(|| view.record.addresses.get(&old.node).copied());
        if let (Some(owner), Some(addr)) = (view.attached_to.clone(), addr) {
            let request = EngineRequest::RemoveReplica { addr, disk: old.disk.clone() };
            self.engine_ok(&d, &owner, id, &request).await?;
        }
        let mut shrunk = view.record.clone();
        shrunk.members.remove(index);
        let info = RecordInfo { version: view.version, epoch: view.epoch, data: Vec::new() };
        let next = Self::next_seen(&d, &info, &shrunk, view.epoch)?;
        self.write_record(&d, id, &next, &shrunk.members).await?;
        if let Some(n) = d.node(&old.node)
            && let Err(e) = self.client(n.addr).delete_replica_on(&old.disk, id).await
        {
            tracing::info!(volume = id, replica = %old, error = %e, "removed replica not deleted yet");
        }
        lock(&self.down_since).remove(&(id.to_owned(), old.clone()));
        tracing::info!(volume = id, replica = %old, "replica removed");
        self.live_view(&self.discover().await, id).await
    }

    /// Removes replicas of `id` that are not members of its newest record (left by a
    /// replacement whose node was down), and finishes a delete interrupted by a node that was
    /// down. Returns how many replicas it removed.
    #[tracing::instrument(name = "catalog.collect", skip(self))]
    pub async fn collect(&self, id: &str) -> Result<usize> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else { return Ok(0) };
        let doomed: Vec<Holder> = holders
            .into_iter()
            .filter(|h| record.deleting || (record.member_index(&h.at).is_none() && h.record.version < info.version))
            .collect();
        for h in &doomed {
            self.client(h.addr).delete_replica_on(&h.at.disk, id).await?;
            tracing::info!(volume = id, replica = %h.at, "leftover replica removed");
        }
        Ok(doomed.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_is_found_by_node_and_disk_and_by_node_alone_only_when_it_is_the_nodes_only_one() {
        let record = VolumeRecord {
            members: vec![Location::new("n1", "default"), Location::new("n1", "ssd"), Location::new("n2", "default")],
            ..VolumeRecord::default()
        };
        assert_eq!(find_member(&record, "v", "n1", Some("ssd")).expect("found"), Some(1));
        assert_eq!(find_member(&record, "v", "n1", Some("hdd")).expect("looked up"), None);
        assert_eq!(find_member(&record, "v", "n2", None).expect("the only one"), Some(2));
        assert_eq!(find_member(&record, "v", "n3", None).expect("looked up"), None);
        let e = find_member(&record, "v", "n1", None).expect_err("two on n1");
        assert!(
            matches!(&e, CatalogError::Invalid(m) if m.contains("2 replicas") && m.contains("name the disk")),
            "{e}"
        );
    }
}
