//! Which volume is published to which node, as the controller knows it: the block catalog of
//! each backend that holds a `block` grant, the one ControllerPublishVolume claims volumes in.
//! A volume is published to node N at epoch E when the newest record its replicas hold names N
//! as its owner at E ([`wasmcsi_block::catalog::Catalog::attach_info`], what N's own attach
//! asks).
use std::sync::Arc;

use wasmcsi_block::catalog::CatalogError;
use wasmcsi_runtime::Registry;
use wasmcsi_trust::GrantSourceError;
use wasmcsi_trust::grant::source::{EpochFuture, Publications};

/// [`Publications`] read from the catalogs of the registry's backends.
pub struct CatalogPublications {
    registry: Arc<Registry>,
}

impl CatalogPublications {
    pub fn new(registry: Arc<Registry>) -> Self {
        CatalogPublications { registry }
    }

    /// The epoch `set_id` is published to `node` at. Each backend's catalog is asked in turn (a
    /// set id names one volume on the nodes that hold it, whichever backend made it); the first
    /// that holds the volume answers. One whose nodes do not answer makes the answer
    /// `Unavailable` unless another holds it.
    pub async fn published_epoch(&self, set_id: &str, node: &str) -> Result<u64, GrantSourceError> {
        let mut unavailable = None;
        for backend in self.registry.all() {
            let Some(catalog) = backend.block_catalog() else { continue };
            match catalog.attach_info(set_id, node).await {
                Ok(info) => return Ok(info.epoch),
                Err(CatalogError::NotFound(_)) => {}
                // Published elsewhere, to no one, or not whole yet (a clone being filled).
                Err(CatalogError::FailedPrecondition(why)) => return Err(GrantSourceError::refused(set_id, why)),
                Err(e) => unavailable = Some(format!("backend {}: {e}", backend.name)),
            }
        }
        Err(match unavailable {
            Some(why) => GrantSourceError::unavailable(set_id, why),
            None => GrantSourceError::refused(set_id, "no replica node of any backend holds it"),
        })
    }
}

impl Publications for CatalogPublications {
    fn published_epoch<'a>(&'a self, set_id: &'a str, node: &'a str) -> EpochFuture<'a> {
        Box::pin(CatalogPublications::published_epoch(self, set_id, node))
    }
}
