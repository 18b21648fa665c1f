//! The controller's rounds over every backend's volumes, periodically; a round never overlaps
//! the previous one, and one volume's failure is logged and the round goes on.
//!
//! - Self-healing: every backend that advertises `self-healing` is asked to `reconcile-volume`
//!   each of its volumes; the policy (what to repair, when, where) is the backend's. For a
//!   backend with a `block` grant the volumes are the replica sets on its nodes (so volumes
//!   hidden because snapshots outlive them are healed too), and after the backend's turn the
//!   host removes what a replacement left behind on nodes that were down (`Catalog::collect`).
//! - Clones being filled (every backend with a `block` grant): a fill that is not running is
//!   resumed, and a clone no call has named for [`Rounds::abandoned_clone_after`] is deleted
//!   with its temporary source snapshot, releasing its source (`Catalog::tend_fill`): the CO
//!   gave up on it (the claim was deleted while it copied) and will never delete it. They are
//!   not reconciled until whole.
use std::sync::Arc;
use std::time::Duration;

use wasmcsi_runtime::driver::{Feature, Timestamp};
use wasmcsi_runtime::{Backend, Registry};

/// How often a round starts by default.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// How long a clone being filled may go without a call naming it by default. The provisioner
/// retries an ABORTED CreateVolume within its backoff cap (5 minutes by default), so twice that
/// is a CO that gave up.
pub const DEFAULT_ABANDONED_CLONE_AFTER: Duration = Duration::from_secs(600);

/// What the rounds do and how often.
#[derive(Debug, Clone, Copy)]
pub struct Rounds {
    pub interval: Duration,
    /// A clone being filled that no call named for this long is deleted.
    pub abandoned_clone_after: Duration,
}

impl Default for Rounds {
    fn default() -> Self {
        Self { interval: DEFAULT_INTERVAL, abandoned_clone_after: DEFAULT_ABANDONED_CLONE_AFTER }
    }
}

/// Runs rounds every `rounds.interval` until the task is dropped.
pub async fn run(registry: Arc<Registry>, rounds: Rounds) {
    let mut tick = tokio::time::interval(rounds.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        round(&registry, &rounds).await;
    }
}

/// One round over every backend: clones first, then self-healing.
#[tracing::instrument(name = "reconcile.round", skip_all)]
pub async fn round(registry: &Registry, rounds: &Rounds) {
    for backend in registry.all() {
        if let Err(e) = heal(&backend, rounds).await {
            tracing::warn!(backend = %backend.name, error = %e, "reconcile round incomplete");
        }
    }
}

/// The volumes of one backend: clones being filled tended, the others (of a self-healing
/// backend) asked to reconcile.
async fn heal(backend: &Arc<Backend>, rounds: &Rounds) -> Result<(), String> {
    let healing = backend.has_feature(Feature::SelfHealing);
    if !healing && backend.block_catalog().is_none() {
        return Ok(());
    }
    if let Some(catalog) = backend.block_catalog() {
        let clones = catalog.clones_in_progress().await.map_err(|e| e.to_string())?;
        for id in clones.iter().map(|c| &c.id) {
            let span = tracing::info_span!("reconcile.clone", backend = %backend.name, volume.id = %id);
            let tended = catalog.tend_fill(id, rounds.abandoned_clone_after);
            if let Err(e) = tracing::Instrument::instrument(tended, span.clone()).await {
                tracing::info!(parent: &span, error = %e, "clone not tended; retried next round");
            }
        }
    }
    if !healing {
        return Ok(());
    }
    for id in volume_ids(backend).await? {
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

/// A backend's volumes to reconcile: (a `block` grant's) the whole ones.
async fn volume_ids(backend: &Arc<Backend>) -> Result<Vec<String>, String> {
    if let Some(catalog) = backend.block_catalog() {
        let sets = catalog.list(None, usize::MAX).await.map_err(|e| e.to_string())?;
        return Ok(sets.into_iter().filter(|s| s.filling.is_none()).map(|s| s.id).collect());
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
