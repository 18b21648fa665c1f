//! A set's snapshots: taking and deleting them (through the attached engine, or offline on every
//! replica) and listing them; a snapshot a clone is still filled from is kept until the fill is
//! done.

use super::engine_call::EngineRequest;
use super::{Catalog, CatalogError, Discovery, Result, Route, lock};
use crate::protocol::SnapshotInfo;

impl Catalog {
    /// Takes a crash-consistent snapshot (the same name again: the existing one).
    #[tracing::instrument(name = "catalog.snapshot", skip(self))]
    pub async fn snapshot(&self, id: &str, name: &str) -> Result<SnapshotInfo> {
        let d = self.discover().await;
        self.snapshot_in(&d, id, name).await?;
        let view = self.live_view(&self.discover().await, id).await?;
        view.snapshots.into_iter().find(|s| s.name == name).ok_or_else(|| {
            CatalogError::Unavailable(format!("snapshot {name:?} of {id} is not on every replica yet; retry"))
        })
    }

    pub(super) async fn snapshot_in(&self, d: &Discovery, id: &str, name: &str) -> Result<()> {
        let view = self.live_view(d, id).await?;
        if view.snapshots.iter().any(|s| s.name == name) {
            return Ok(());
        }
        match self.route(d, &view).await? {
            Route::Engine(owner) => {
                self.engine_ok(d, &owner, id, &EngineRequest::Snapshot { name: name.to_owned() }).await
            }
            Route::Offline(set, raise) => Self::offline(&set, raise, |s| s.snapshot(name)).await,
        }
    }

    /// Deletes a snapshot; absent succeeds.
    #[tracing::instrument(name = "catalog.delete_snapshot", skip(self))]
    pub async fn delete_snapshot(&self, id: &str, name: &str) -> Result<()> {
        let d = self.discover().await;
        self.delete_snapshot_in(&d, id, name, None).await
    }

    /// `filled`: the clone whose fill is done with the snapshot (it no longer needs it).
    pub(super) async fn delete_snapshot_in(
        &self,
        d: &Discovery,
        id: &str,
        name: &str,
        filled: Option<&str>,
    ) -> Result<()> {
        let Some(view) = self.view(d, id).await?.filter(|v| !v.record.deleting) else { return Ok(()) };
        if !view.snapshots.iter().any(|s| s.name == name) {
            return Ok(());
        }
        if self.snapshot_feeds_a_fill(d, id, name, filled).await {
            return Err(CatalogError::FailedPrecondition(format!("a clone is being filled from {id}@{name}")));
        }
        match self.route(d, &view).await? {
            Route::Engine(owner) => {
                self.engine_ok(d, &owner, id, &EngineRequest::DeleteSnapshot { name: name.to_owned() }).await
            }
            Route::Offline(set, raise) => Self::offline(&set, raise, |s| s.delete_snapshot(name)).await,
        }
    }

    async fn snapshot_feeds_a_fill(&self, d: &Discovery, id: &str, name: &str, except: Option<&str>) -> bool {
        let fills: Vec<String> = lock(&self.fills).keys().filter(|t| Some(t.as_str()) != except).cloned().collect();
        for t in fills {
            if let Ok(Some((_, r))) = Self::newest(&self.holders(d, &t).await)
                && r.fill.is_some_and(|f| f.volume_id == id && f.snapshot == name)
            {
                return true;
            }
        }
        false
    }

    /// Snapshots of one set, or of every set.
    pub async fn list_snapshots(&self, id: Option<&str>) -> Result<Vec<(String, SnapshotInfo, u64)>> {
        let views = match id {
            Some(id) => self.get(id).await?.into_iter().collect(),
            None => self.list(None, usize::MAX).await?,
        };
        Ok(views
            .into_iter()
            .flat_map(|v| {
                let (id, size) = (v.id.clone(), v.size);
                v.snapshots.into_iter().map(move |s| (id.clone(), s, size))
            })
            .collect())
    }
}
