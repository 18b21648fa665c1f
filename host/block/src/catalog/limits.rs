//! A set's I/O limits and rebuild bandwidth: kept in its record (so every engine that attaches
//! it applies them from the start, see [`super::AttachInfo::limits`]) and, while it is
//! attached, handed to its engine at once.

use super::engine_call::EngineRequest;
use super::{Catalog, CatalogError, Result, SetView};
use crate::qos::IoLimits;

/// What an engine of the version before limits answers a request it cannot parse with.
const UNKNOWN_REQUEST: &str = "malformed engine request";

impl Catalog {
    /// Sets the volume's I/O limits and rebuild bandwidth: written to its record, then given to
    /// its engine when it runs. The same values again write nothing (and tell the engine again,
    /// which changes nothing there either). An engine too old to apply limits is
    /// `FailedPrecondition` saying so: they are recorded and apply from its next attach.
    #[tracing::instrument(name = "catalog.set_limits", skip(self), fields(%limits))]
    pub async fn set_limits(&self, id: &str, limits: IoLimits, rebuild_bytes_per_second: u64) -> Result<SetView> {
        self.update(id, |r| {
            r.limits = limits;
            r.rebuild_bytes_per_second = rebuild_bytes_per_second;
            Ok(false)
        })
        .await?;
        let d = self.discover().await;
        let view = self.live_view(&d, id).await?;
        // Recorded first: an engine that attaches from here on reads them from the record; one
        // that already runs is told now.
        if let Some(owner) = &view.attached_to {
            let reply = self.engine(&d, owner, id, &EngineRequest::SetLimits { limits }).await?;
            if !reply.ok {
                let why = reply.error.unwrap_or_default();
                if why.starts_with(UNKNOWN_REQUEST) {
                    return Err(CatalogError::FailedPrecondition(format!(
                        "the engine of {id} on node {owner} does not apply I/O limits (a data path older than \
                         limits): they are recorded and apply when the volume is next attached"
                    )));
                }
                return Err(CatalogError::Internal(format!("engine of {id} on {owner}: {why}")));
            }
        }
        Ok(view)
    }
}
