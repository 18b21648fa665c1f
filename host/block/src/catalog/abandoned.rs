//! Clones nobody asks for any more. A clone answers CreateVolume ABORTED until its fill is
//! whole, and the CO asks again and again; when the CO gives up (the claim deleted meanwhile)
//! it never asks again and never learns the volume's id to delete it, so the half-made set and
//! the hold on its source snapshot would stay forever.
//!
//! Each call that names a set being filled ([`Catalog::get`], which a backend's retried
//! CreateVolume makes) counts as asked. The controller's rounds ([`Catalog::tend_fill`]) resume
//! a fill that is not running (one that failed, or one this process never started: a controller
//! restarted meanwhile), and delete a clone not asked for within the deadline they are given,
//! its temporary source snapshot with it; a clone first seen by this process has its clock
//! started then. A delete of a clone that stopped half-way (its temporary source snapshot could
//! not be deleted yet) is finished by the same rounds. A CO that does come back after that finds
//! no volume and makes it anew.
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::{Catalog, CatalogError, Result, SetView, lock, no_node_answered};

/// What a round did with one set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tended {
    /// Not being filled (or not there): nothing to do.
    Whole,
    /// Being filled, and asked for within the deadline: its fill runs.
    Filling,
    /// Being filled, not asked for within the deadline: deleted.
    Abandoned,
}

impl Catalog {
    /// A call named the clone `id`: its deadline starts again.
    pub(super) fn asked(&self, id: &str) {
        lock(&self.asked).insert(id.to_owned(), Instant::now());
    }

    /// How long ago a call last named `id`, starting its clock now when none has yet.
    fn unasked_for(&self, id: &str) -> Duration {
        lock(&self.asked).entry(id.to_owned()).or_insert_with(Instant::now).elapsed()
    }

    /// Every clone not yet whole, and every clone whose delete has not finished: what the
    /// rounds tend ([`Catalog::list`] leaves the latter out).
    #[tracing::instrument(name = "catalog.clones_in_progress", skip(self))]
    pub async fn clones_in_progress(&self) -> Result<Vec<SetView>> {
        let d = self.discover().await;
        if d.nodes.is_empty() && !d.unreachable.is_empty() {
            return Err(CatalogError::Unavailable(no_node_answered(&d)));
        }
        let ids: BTreeSet<&str> =
            d.nodes.values().flat_map(|n| n.replicas.iter().map(|r| r.volume_id.as_str())).collect();
        let mut out = Vec::new();
        for id in ids {
            if let Some(v) = self.view(&d, id).await?
                && v.record.fill.is_some()
            {
                out.push(v);
            }
        }
        Ok(out)
    }

    /// One round's care of set `id` (see the module doc): a clone asked for within
    /// `abandon_after` has its fill running; one that was not is deleted.
    #[tracing::instrument(name = "catalog.tend_fill", skip(self))]
    pub async fn tend_fill(&self, id: &str, abandon_after: Duration) -> Result<Tended> {
        let d = self.discover().await;
        let Some(view) = self.view(&d, id).await? else {
            lock(&self.asked).remove(id);
            return Ok(Tended::Whole);
        };
        if view.record.fill.is_none() {
            lock(&self.asked).remove(id);
            return Ok(Tended::Whole);
        }
        if view.record.deleting {
            // A delete of a clone that did not finish (its source snapshot could not be deleted
            // then): nobody else would finish it.
            self.delete(id).await?;
            return Ok(Tended::Abandoned);
        }
        let idle = self.unasked_for(id);
        if idle >= abandon_after {
            tracing::warn!(
                volume = id,
                idle_s = idle.as_secs(),
                "a clone nobody asked for within its deadline: deleted with its fill"
            );
            self.delete(id).await?;
            return Ok(Tended::Abandoned);
        }
        self.ensure_fill(&d, id, &view.record).await?;
        Ok(Tended::Filling)
    }
}
