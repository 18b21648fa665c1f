//! Self-healing rounds of the controller: every backend that advertises `self-healing` is
//! asked to `reconcile-volume` each of its volumes, periodically; the policy (what to repair,
//! when, where) is the backend's. For a backend with a `block` grant the volumes are the replica
//! sets on its nodes (so volumes hidden because snapshots outlive them are healed too), and after
//! the backend's turn the host removes what a replacement left behind on nodes that were down
//! (`Catalog::collect`). A round never overlaps the previous one; one volume's failure is logged
//! and the round goes on.
use std::sync::Arc;
use std::time::Duration;

use wasmcsi_runtime::driver::{Feature, Timestamp};
use wasmcsi_runtime::{Backend, Registry};

/// How often a round starts by default.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

/// Runs rounds every `interval` until the task is dropped.
pub async fn run(registry: Arc<Registry>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        round(&registry).await;
    }
}

/// One round over every self-healing backend.
#[tracing::instrument(name = "reconcile.round", skip_all)]
pub async fn round(registry: &Registry) {
    for backend in registry.all().into_iter().filter(|b| b.has_feature(Feature::SelfHealing)) {
        if let Err(e) = heal(&backend).await {
            tracing::warn!(backend = %backend.name, error = %e, "reconcile round incomplete");
        }
    }
}

/// The volumes of one backend, each asked to reconcile.
async fn heal(backend: &Arc<Backend>) -> Result<(), String> {
    let ids = volume_ids(backend).await?;
    for id in ids {
        let span = tracing::info_span!("reconcile.volume", backend = %backend.name, volume.id = %id);
        let call = backend.reconcile_volume(id.clone(), now());
        if let Err(e) = tracing::Instrument::instrument(call, span.clone()).await {
            tracing::warn!(parent: &span, error = %e, "reconcile-volume failed; retried next round");
            continue;
        }
        if let Some(catalog) = backend.block_catalog()
            && let Err(e) = tracing::Instrument::instrument(catalog.collect(&id), span.clone()).await
        {
            tracing::info!(parent: &span, error = %e, "leftover replicas not collected yet");
        }
    }
    Ok(())
}

/// The host's clock, as `reconcile-volume` takes it: every decision by time is made against
/// it (a guest has no clock of its own to trust).
fn now() -> Timestamp {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Timestamp { seconds: i64::try_from(since.as_secs()).unwrap_or(i64::MAX), nanos: since.subsec_nanos() }
}

async fn volume_ids(backend: &Arc<Backend>) -> Result<Vec<String>, String> {
    if let Some(catalog) = backend.block_catalog() {
        let sets = catalog.list(None, usize::MAX).await.map_err(|e| e.to_string())?;
        return Ok(sets.into_iter().map(|s| s.id).collect());
    }
    let mut ids = Vec::new();
    let mut token = String::new();
    loop {
        let page = backend.list_volumes(0, token).await.map_err(|e| e.to_string())?;
        ids.extend(page.entries.into_iter().map(|e| e.volume.volume_id));
        if page.next_token.is_empty() {
            return Ok(ids);
        }
        token = page.next_token;
    }
}
