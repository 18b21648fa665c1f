//! One operation per volume (or name) at a time. A second concurrent call for the same key
//! gets ABORTED, as the CSI spec asks, instead of racing the first.
//!
//! A key alone cannot keep a creation apart from a deletion of the same object: CreateVolume
//! is known by its name, DeleteVolume by its id, and what id a backend gives a name is the
//! backend's business (it need not derive from the name, and is not known until the backend
//! answered). So each backend also has a [`Gate`] with two sides: creations (by name) on
//! one, operations that change or remove an existing object (by id) on the other. Either
//! side runs any number of calls at once, never both sides together; a call waits for the
//! other side to drain (bounded by its backend's deadline, then ABORTED), and a side with
//! callers waiting takes the next turn, so neither side starves the other.
use crate::error::CsiError;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default, Clone)]
pub struct InFlight {
    keys: Arc<Mutex<HashSet<String>>>,
    /// Per backend: creations kept apart from changes of existing objects.
    pub gates: Gates,
}

/// Held for the duration of one operation; releases the key on drop (also on panic).
pub struct OperationGuard {
    keys: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl InFlight {
    pub fn try_start(&self, key: String) -> Result<OperationGuard, CsiError> {
        let mut keys = self.keys.lock().map_err(|_| CsiError::Internal("in-flight table poisoned".into()))?;
        if !keys.insert(key.clone()) {
            return Err(CsiError::InProgress(key));
        }
        Ok(OperationGuard { keys: self.keys.clone(), key })
    }
}

impl Drop for OperationGuard {
    fn drop(&mut self) {
        if let Ok(mut keys) = self.keys.lock() {
            keys.remove(&self.key);
        }
    }
}

/// The side of a backend's [`Gate`] an operation is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Creating an object by name (CreateVolume, CreateSnapshot).
    Create,
    /// Changing or removing an object by id (DeleteVolume, DeleteSnapshot, ControllerExpandVolume).
    Existing,
}

impl Side {
    fn index(self) -> usize {
        match self {
            Self::Create => 0,
            Self::Existing => 1,
        }
    }
    fn other(self) -> Self {
        match self {
            Self::Create => Self::Existing,
            Self::Existing => Self::Create,
        }
    }
}

#[derive(Debug, Default)]
struct GateState {
    /// The side running while `holders > 0`.
    running: Option<Side>,
    holders: usize,
    /// Callers waiting, per side.
    waiting: [usize; 2],
    /// Who goes first once nobody holds the gate: the side that waited while the other ran.
    turn: Option<Side>,
}

impl GateState {
    fn admits(&self, side: Side) -> bool {
        if self.holders > 0 {
            return self.running == Some(side) && self.waiting[side.other().index()] == 0;
        }
        match self.turn {
            Some(t) => t == side || self.waiting[t.index()] == 0,
            None => true,
        }
    }
}

/// One backend's create/existing gate (see the module doc).
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: tokio::sync::Notify,
}

/// Held while an operation runs on its side of a gate; lets the other side in when the last
/// holder drops it (also on panic or when the RPC is cancelled).
pub struct GatePass {
    gate: Arc<Gate>,
}

/// A caller counted as waiting; uncounted when it is let in, gives up, or is cancelled.
struct Waiting<'a> {
    gate: &'a Gate,
    side: Side,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Ok(mut s) = self.gate.state.lock() {
            s.waiting[self.side.index()] -= 1;
        }
        // Whoever waited for this caller's turn looks again.
        self.gate.changed.notify_waiters();
    }
}

impl Gate {
    /// Enter on `side`, waiting at most `patience` for the other side to finish.
    pub async fn enter(self: &Arc<Self>, side: Side, patience: Duration, what: &str) -> Result<GatePass, CsiError> {
        let poisoned = || CsiError::Internal("operation gate poisoned".into());
        let deadline = tokio::time::Instant::now() + patience;
        let mut waiting: Option<Waiting<'_>> = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut s = self.state.lock().map_err(|_| poisoned())?;
                if s.admits(side) {
                    s.holders += 1;
                    s.running = Some(side);
                    s.turn = None;
                    if let Some(w) = waiting.take() {
                        // Uncounted here, under the lock its drop would take again.
                        std::mem::forget(w);
                        s.waiting[side.index()] -= 1;
                    }
                    return Ok(GatePass { gate: self.clone() });
                }
                if waiting.is_none() {
                    s.waiting[side.index()] += 1;
                    waiting = Some(Waiting { gate: self, side });
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(CsiError::InProgress(what.to_string()));
            }
        }
    }
}

impl Drop for GatePass {
    fn drop(&mut self) {
        if let Ok(mut s) = self.gate.state.lock() {
            s.holders -= 1;
            if s.holders == 0 {
                let finished = s.running.take();
                s.turn = finished.map(Side::other).filter(|o| s.waiting[o.index()] > 0);
            }
        }
        self.gate.changed.notify_waiters();
    }
}

/// The gates of every backend, by backend name (a handful: one per configured backend).
#[derive(Debug, Default, Clone)]
pub struct Gates {
    by_backend: Arc<Mutex<HashMap<String, Arc<Gate>>>>,
}

impl Gates {
    /// Enter `backend`'s gate on `side`; ABORTED naming `what` after `patience`.
    pub async fn enter(&self, backend: &str, side: Side, patience: Duration, what: &str) -> Result<GatePass, CsiError> {
        let gate = {
            let mut map = self.by_backend.lock().map_err(|_| CsiError::Internal("gate table poisoned".into()))?;
            map.entry(backend.to_string()).or_default().clone()
        };
        gate.enter(side, patience, what).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_operation_on_a_key_is_refused_until_the_first_ends() {
        let f = InFlight::default();
        let g = f.try_start("v".into()).expect("first");
        assert!(matches!(f.try_start("v".into()), Err(CsiError::InProgress(_))));
        assert!(f.try_start("w".into()).is_ok());
        drop(g);
        assert!(f.try_start("v".into()).is_ok());
    }

    const LONG: Duration = Duration::from_secs(5);

    async fn enter(g: &Gates, side: Side) -> GatePass {
        g.enter("b", side, LONG, "v").await.expect("enter")
    }

    /// Whether `side` gets in within 50 ms.
    async fn gets_in(g: &Gates, side: Side) -> Option<GatePass> {
        g.enter("b", side, Duration::from_millis(50), "v").await.ok()
    }

    #[tokio::test]
    async fn one_side_runs_together_and_the_other_waits_for_it() {
        let g = Gates::default();
        let (c1, c2) = (enter(&g, Side::Create).await, enter(&g, Side::Create).await);
        assert!(gets_in(&g, Side::Existing).await.is_none(), "a deletion ran beside creations");
        // Another backend's gate is its own.
        assert!(g.enter("other", Side::Existing, LONG, "v").await.is_ok());
        let waiter = tokio::spawn({
            let g = g.clone();
            async move { g.enter("b", Side::Existing, LONG, "v").await.is_ok() }
        });
        drop(c1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "let in while a creation still ran");
        drop(c2);
        assert!(waiter.await.expect("join"));
    }

    #[tokio::test]
    async fn a_waiting_side_takes_the_next_turn() {
        let g = Gates::default();
        let c = enter(&g, Side::Create).await;
        let deleting = tokio::spawn({
            let g = g.clone();
            async move {
                let pass = g.enter("b", Side::Existing, LONG, "v").await.expect("enter");
                tokio::time::sleep(Duration::from_millis(50)).await;
                drop(pass);
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        // A deletion waits: a new creation does not overtake it.
        assert!(gets_in(&g, Side::Create).await.is_none(), "a creation overtook a waiting deletion");
        drop(c);
        deleting.await.expect("join");
        assert!(gets_in(&g, Side::Create).await.is_some());
    }

    #[tokio::test]
    async fn a_caller_that_gives_up_is_aborted_and_leaves_no_trace() {
        let g = Gates::default();
        let c = enter(&g, Side::Create).await;
        let err = g.enter("b", Side::Existing, Duration::from_millis(20), "volume v").await.err();
        assert!(matches!(&err, Some(CsiError::InProgress(w)) if w == "volume v"), "{:?}", err.map(|e| e.to_string()));
        // A cancelled waiter too: neither holds up creations afterwards.
        let cancelled = tokio::spawn({
            let g = g.clone();
            async move { g.enter("b", Side::Existing, LONG, "v").await.is_ok() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        cancelled.abort();
        let _ = cancelled.await;
        assert!(gets_in(&g, Side::Create).await.is_some(), "a gone waiter still holds the turn");
        drop(c);
        assert!(gets_in(&g, Side::Existing).await.is_some());
    }
}
