//! Group snapshots: one crash-consistent point of several sets, attached or not, on whatever
//! nodes — every set's snapshot holds exactly the writes issued before that point, so a write
//! that was issued after another one was acknowledged is in the group only if that one is too.
//!
//! Three phases, the first two bounded by one deadline:
//! 1. every attached set's engine holds its writes and takes the snapshot while held
//!    (`EngineRequest::HoldSnapshot`, all engines at once); an engine lets go by itself at the
//!    deadline, so a controller that dies here never freezes a volume for longer;
//! 2. every detached set's snapshot is taken on its current replicas, while the attached ones
//!    are held: a detached set has no writes, and its session claims the record's epoch, so a
//!    set published meanwhile fences the session (the group fails) rather than write unseen;
//! 3. every engine lets go (`ReleaseHold`) and says how long it held; an engine that had already
//!    let go (its deadline passed) makes the group fail, since writes went on in the middle.
//!
//! Any failure lets go of every hold, deletes the snapshots this call took and answers the error:
//! none of the group is left. The same name and sets again find every snapshot there and succeed;
//! a group some of whose snapshots were left by an attempt that could not clean up is taken anew.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use super::engine_call::{EngineReply, EngineRequest, MAX_HOLD_MS};
use super::{Catalog, CatalogError, Discovery, Result, Route, SetView};
use crate::protocol::SnapshotInfo;

/// Most sets in one group.
pub const MAX_GROUP: usize = 64;

/// A group snapshot taken (or found).
#[derive(Debug, Clone)]
pub struct GroupSnapshot {
    /// Each set's id, its snapshot and its size, in the order asked.
    pub snapshots: Vec<(String, SnapshotInfo, u64)>,
    /// The longest any engine held its writes; `None` when nothing was held (the group existed
    /// already, or no set was attached).
    pub held: Option<Duration>,
}

impl Catalog {
    /// Takes snapshot `name` of every set in `ids` at one point (see the module docs).
    #[tracing::instrument(name = "catalog.snapshot_group", skip(self, ids), fields(sets = ids.len()))]
    pub async fn snapshot_group(&self, ids: &[String], name: &str) -> Result<GroupSnapshot> {
        check_group(ids)?;
        let d = Arc::new(self.discover().await);
        let mut views = Vec::with_capacity(ids.len());
        for id in ids {
            views.push(self.live_view(&d, id).await?);
        }
        let has = |v: &SetView| v.snapshots.iter().any(|s| s.name == name);
        if views.iter().all(has) {
            return Ok(GroupSnapshot { snapshots: found(&views, name)?, held: None });
        }
        // Taken without the others, they hold no common point with what is taken now.
        for v in views.iter().filter(|v| has(v)) {
            self.delete_snapshot_in(&d, &v.id, name, None).await?;
        }
        let mut routes = Vec::with_capacity(views.len());
        for v in &views {
            routes.push((v.id.clone(), self.route(&d, v).await?));
        }
        let held = match self.take_group(&d, &routes, name).await {
            Ok(held) => held,
            Err(e) => {
                for (id, _) in &routes {
                    if let Err(left) = self.delete_snapshot_in(&d, id, name, None).await {
                        tracing::warn!(volume.id = %id, error = %left, "snapshot of a failed group left behind");
                    }
                }
                return Err(e);
            }
        };
        if let Some(h) = held {
            tracing::info!(held_us = h.as_micros() as u64, "group snapshot taken");
        }
        let d = self.discover().await;
        let mut after = Vec::with_capacity(ids.len());
        for id in ids {
            after.push(self.live_view(&d, id).await?);
        }
        Ok(GroupSnapshot { snapshots: found(&after, name)?, held })
    }

    /// The three phases; lets go of every hold whatever happens. Returns the longest hold.
    async fn take_group(&self, d: &Arc<Discovery>, routes: &[(String, Route)], name: &str) -> Result<Option<Duration>> {
        let hold_ms =
            u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX).saturating_mul(2).clamp(1_000, MAX_HOLD_MS);
        let engines: Vec<(String, String)> = routes
            .iter()
            .filter_map(|(id, r)| match r {
                Route::Engine(owner) => Some((id.clone(), owner.clone())),
                Route::Offline(..) => None,
            })
            .collect();
        let request = EngineRequest::HoldSnapshot { holder: name.to_owned(), name: name.to_owned(), hold_ms };
        let mut taken = self
            .ask_engines(d, &engines, &request)
            .await
            .into_iter()
            .try_fold((), |(), (id, owner, r)| r.and_then(|reply| hold_result(&id, &owner, reply)));
        if taken.is_ok() {
            for (id, route) in routes {
                if let Route::Offline(set, raise) = route {
                    taken = Self::offline(set, *raise, |s| s.snapshot(name)).await.map_err(|e| {
                        CatalogError::Unavailable(format!("snapshot {name:?} of detached volume {id}: {e}"))
                    });
                    if taken.is_err() {
                        break;
                    }
                }
            }
        }
        let release = EngineRequest::ReleaseHold { holder: name.to_owned() };
        let mut longest: Option<Duration> = None;
        for (id, owner, r) in self.ask_engines(d, &engines, &release).await {
            match r {
                Ok(EngineReply { ok: true, held_us: Some(us), .. }) => {
                    longest = longest.max(Some(Duration::from_micros(us)));
                }
                Ok(EngineReply { ok: true, .. }) if taken.is_ok() => {
                    taken = Err(CatalogError::Unavailable(format!(
                        "the engine of {id} on {owner} let go of its hold at its deadline ({hold_ms} ms) before every \
                         snapshot of the group was taken; retry"
                    )));
                }
                Ok(EngineReply { ok: true, .. }) => {}
                // Its deadline lets go of it.
                Ok(reply) => {
                    tracing::warn!(volume.id = %id, node = %owner, error = ?reply.error, "release of a hold failed")
                }
                Err(e) => tracing::warn!(volume.id = %id, node = %owner, error = %e, "release of a hold failed"),
            }
        }
        taken.map(|()| longest)
    }

    /// Sends `request` to every engine at once; each answer with its set and node.
    async fn ask_engines(
        &self,
        d: &Arc<Discovery>,
        engines: &[(String, String)],
        request: &EngineRequest,
    ) -> Vec<(String, String, Result<EngineReply>)> {
        let mut tasks = tokio::task::JoinSet::new();
        for (id, owner) in engines {
            let (c, d, id, owner, request) = (self.clone(), d.clone(), id.clone(), owner.clone(), request.clone());
            tasks.spawn(async move {
                let reply = c.engine(&d, &owner, &id, &request).await;
                (id, owner, reply)
            });
        }
        let mut answers = Vec::with_capacity(engines.len());
        while let Some(joined) = tasks.join_next().await {
            match joined {
                Ok(answer) => answers.push(answer),
                Err(e) => answers.push((String::new(), String::new(), Err(CatalogError::Internal(e.to_string())))),
            }
        }
        answers
    }
}

/// What a group may hold: some sets, each once.
fn check_group(ids: &[String]) -> Result<()> {
    if ids.is_empty() {
        return Err(CatalogError::Invalid("a group snapshot needs at least one volume".into()));
    }
    if ids.len() > MAX_GROUP {
        return Err(CatalogError::Invalid(format!(
            "a group snapshot holds at most {MAX_GROUP} volumes, not {}",
            ids.len()
        )));
    }
    let mut seen = BTreeSet::new();
    if let Some(twice) = ids.iter().find(|id| !seen.insert(id.as_str())) {
        return Err(CatalogError::Invalid(format!("volume {twice} is named twice in the group")));
    }
    Ok(())
}

/// An engine's answer to `HoldSnapshot` as the group's outcome.
fn hold_result(id: &str, owner: &str, reply: EngineReply) -> Result<()> {
    match (reply.ok, reply.retry, reply.error.unwrap_or_default()) {
        (true, ..) => Ok(()),
        (false, true, e) => Err(CatalogError::Unavailable(format!("engine of {id} on {owner}: {e}"))),
        // An engine of the version before group snapshots cannot parse the request.
        (false, false, e) if e.starts_with("malformed engine request") => Err(CatalogError::Unavailable(format!(
            "the data path on node {owner}, which has {id} attached, does not provide group snapshots (upgrade it): {e}"
        ))),
        (false, false, e) => Err(CatalogError::Internal(format!("engine of {id} on {owner}: {e}"))),
    }
}

/// Each set's snapshot `name`.
fn found(views: &[SetView], name: &str) -> Result<Vec<(String, SnapshotInfo, u64)>> {
    views
        .iter()
        .map(|v| {
            let s = v.snapshots.iter().find(|s| s.name == name).ok_or_else(|| {
                CatalogError::Unavailable(format!("snapshot {name:?} of {} is not on every replica yet; retry", v.id))
            })?;
            Ok((v.id.clone(), s.clone(), v.size))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_names_some_sets_each_once() {
        assert!(matches!(check_group(&[]), Err(CatalogError::Invalid(_))));
        let twice = ["a".to_owned(), "b".to_owned(), "a".to_owned()];
        assert!(matches!(check_group(&twice), Err(CatalogError::Invalid(m)) if m.contains("volume a")));
        let many: Vec<String> = (0..=MAX_GROUP).map(|i| format!("v{i}")).collect();
        assert!(matches!(check_group(&many), Err(CatalogError::Invalid(_))));
        assert!(check_group(&["a".to_owned(), "b".to_owned()]).is_ok());
    }

    #[test]
    fn an_engine_that_does_not_know_holds_is_unavailable_saying_so() {
        let old = EngineReply::error("malformed engine request: unknown variant `hold-snapshot`");
        assert!(matches!(hold_result("v", "n1", old), Err(CatalogError::Unavailable(m)) if m.contains("upgrade")));
        let busy = EngineReply::retry("held by another group");
        assert!(matches!(hold_result("v", "n1", busy), Err(CatalogError::Unavailable(_))));
        assert!(hold_result("v", "n1", EngineReply::ok()).is_ok());
    }
}
