//! Publishing a set to a node (ControllerPublishVolume and its undoing, each raising the
//! epoch so an engine left elsewhere is fenced) and what that node's engine needs to start:
//! every member's node, address and disk.

use super::{AttachInfo, Catalog, CatalogError, Location, Result, VolumeRecord};

impl Catalog {
    /// ControllerPublishVolume: `node` may attach the volume. The same node again is a retry;
    /// another node while one holds it is `FailedPrecondition` naming it. Raises the epoch, so an
    /// engine left over from before can write nothing. Returns the epoch the volume is published
    /// to `node` at (the raised one, or the current one on a retry): what the node's grant names.
    #[tracing::instrument(name = "catalog.claim", skip(self))]
    pub async fn claim(&self, id: &str, node: &str) -> Result<u64> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else {
            return Err(CatalogError::NotFound(format!("volume {id} not found")));
        };
        if record.deleting {
            return Err(CatalogError::NotFound(format!("volume {id} is being deleted")));
        }
        if record.fill.is_some() {
            return Err(CatalogError::FailedPrecondition(format!("volume {id} is still being filled from its source")));
        }
        match record.owner.as_deref() {
            Some(owner) if owner == node => return Ok(info.epoch),
            Some(owner) => {
                return Err(CatalogError::FailedPrecondition(format!("volume {id} is attached to node {owner}")));
            }
            None => {}
        }
        // Only a node of the cluster may own the volume: an owner no node is would hold it until
        // an unpublish, and every publish to the real node would be refused meanwhile. Every
        // node that attaches replicated volumes runs a data path, whose replica server names
        // its node; one that does not answer now may be that node, so that is a retry.
        if d.node(node).is_none() {
            return Err(if d.unreachable.is_empty() {
                CatalogError::NotFound(format!(
                    "node {node} is not a node of this cluster: none of the {} replica server(s) that answer is on it",
                    d.nodes.len()
                ))
            } else {
                CatalogError::Unavailable(format!(
                    "node {node} is not among the replica servers that answer, and {} did not answer; retry",
                    d.unreachable.len()
                ))
            });
        }
        let claimed = VolumeRecord { owner: Some(node.to_owned()), ..record };
        let next = Self::next_seen(&d, &info, &claimed, info.epoch + 1)?;
        let targets: Vec<Location> = holders.iter().map(|h| h.at.clone()).collect();
        self.write_record(&d, id, &next, &targets).await.map(|_| next.epoch)
    }

    /// ControllerUnpublishVolume: `node` may no longer attach the volume (unknown volume or
    /// another owner: nothing to do). Raises the epoch: an engine still running there (a node the
    /// CO declared gone) is fenced by every replica that answers now, and by the others as soon
    /// as the next engine claims them.
    /// `node` `None` releases whichever node holds it (CSI's unpublish from every node).
    #[tracing::instrument(name = "catalog.release", skip(self))]
    pub async fn release(&self, id: &str, node: Option<&str>) -> Result<()> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else { return Ok(()) };
        if record.owner.is_none() || node.is_some_and(|n| record.owner.as_deref() != Some(n)) {
            return Ok(());
        }
        let released = VolumeRecord { owner: None, ..record };
        let next = Self::next(&info, &released, info.epoch + 1)?;
        let targets: Vec<Location> = holders.iter().map(|h| h.at.clone()).collect();
        self.write_record(&d, id, &next, &targets).await.map(|_| ())
    }

    /// What `node` needs to run the volume's engine: refused unless the volume is published to
    /// it and whole.
    #[tracing::instrument(name = "catalog.attach_info", skip(self))]
    pub async fn attach_info(&self, id: &str, node: &str) -> Result<AttachInfo> {
        let d = self.discover().await;
        let holders = self.holders(&d, id).await;
        let Some((info, record)) = Self::newest(&holders)? else {
            return Err(CatalogError::NotFound(format!("volume {id} not found on any replica node")));
        };
        if record.deleting {
            return Err(CatalogError::NotFound(format!("volume {id} is being deleted")));
        }
        if record.fill.is_some() {
            return Err(CatalogError::FailedPrecondition(format!("volume {id} is still being filled from its source")));
        }
        match record.owner.as_deref() {
            Some(owner) if owner == node => {}
            Some(owner) => {
                return Err(CatalogError::FailedPrecondition(format!("volume {id} is attached to node {owner}")));
            }
            None => {
                return Err(CatalogError::FailedPrecondition(format!(
                    "volume {id} is not published to node {node} (ControllerPublishVolume first)"
                )));
            }
        }
        let size =
            holders.iter().filter(|h| record.member_index(&h.at).is_some()).map(|h| h.header.size).max().unwrap_or(0);
        let members = record
            .members
            .iter()
            .map(|m| {
                let addr = d.node(&m.node).map(|n| n.addr).or_else(|| record.addresses.get(&m.node).copied());
                (m.node.clone(), addr)
            })
            .collect();
        let disks = record.members.iter().map(|m| m.disk.clone()).collect();
        Ok(AttachInfo { size, epoch: info.epoch, members, disks, grant: None, limits: record.limits })
    }
}
