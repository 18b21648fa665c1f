//! A volume's I/O hold, the pause of a group snapshot: while a holder holds the volume, the
//! writes, unmaps and flushes the driver is about to feed to the engine are parked here instead
//! (reads still pass: they change nothing a snapshot holds), and fed in their order when the
//! holder lets go or the hold's deadline passes — whichever comes first, so a controller that
//! crashed in the middle of a group snapshot never freezes a volume for longer than the deadline.
//!
//! The check is made where the driver feeds requests to the engine, under the driver's lock, so
//! "held" is one point in the engine's order: every write fed before it is ahead of a snapshot
//! fed after it (a snapshot is a barrier, see [`crate::engine`]), and no write fed after it
//! reaches the engine until the hold ends. A group snapshot holds every volume, takes each
//! volume's snapshot, then lets go of them all: a write that depends on another one
//! (issued after it was acknowledged) can then be in a snapshot only if that one is in its own.
//!
//! Requests parked while held and requests submitted right after the hold ends may reach the
//! engine in either order: they were in flight together, and a frontend orders only what it
//! waited for.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::request::{ReplyTx, Request, stopped};

/// The hold of one volume; see the module docs.
pub(super) struct Hold {
    /// Whether a holder holds it: read on every request without the lock.
    held: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    holder: Option<Holder>,
    parked: Vec<(Request, ReplyTx)>,
    /// Counts holds, so that the deadline of an earlier hold does not end a later one.
    generation: u64,
}

struct Holder {
    name: String,
    since: Instant,
    generation: u64,
}

/// Another holder holds the volume.
#[derive(Debug)]
pub(super) struct HeldByAnother(pub String);

/// What ending a hold gives back: how long it held, and what it parked meanwhile.
pub(super) struct Released {
    pub held_for: Duration,
    pub parked: Vec<(Request, ReplyTx)>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Hold {
    pub(super) fn new() -> Self {
        Self { held: AtomicBool::new(false), state: Mutex::new(State::default()) }
    }

    /// Gives `request` back to be fed now, or parks it while held.
    pub(super) fn admit(&self, request: Request, reply: ReplyTx) -> Option<(Request, ReplyTx)> {
        if !self.held.load(Ordering::Acquire) || !changes_data(&request) {
            return Some((request, reply));
        }
        let mut s = lock(&self.state);
        if s.holder.is_none() {
            return Some((request, reply));
        }
        s.parked.push((request, reply));
        None
    }

    /// Holds the volume for `holder`; the same holder again keeps its hold (a retry). Returns the
    /// hold's generation, for [`Self::release`] at its deadline.
    pub(super) fn hold(&self, holder: &str) -> Result<u64, HeldByAnother> {
        let mut s = lock(&self.state);
        match &s.holder {
            Some(h) if h.name == holder => return Ok(h.generation),
            Some(h) => return Err(HeldByAnother(h.name.clone())),
            None => {}
        }
        s.generation += 1;
        let generation = s.generation;
        s.holder = Some(Holder { name: holder.to_owned(), since: Instant::now(), generation });
        self.held.store(true, Ordering::Release);
        Ok(generation)
    }

    /// Ends `holder`'s hold (only the hold of that `generation`, when given); `None` when it
    /// does not hold the volume (released already, or never held).
    pub(super) fn release(&self, holder: &str, generation: Option<u64>) -> Option<Released> {
        let mut s = lock(&self.state);
        let h = s.holder.as_ref()?;
        if h.name != holder || generation.is_some_and(|g| g != h.generation) {
            return None;
        }
        let held_for = h.since.elapsed();
        s.holder = None;
        self.held.store(false, Ordering::Release);
        Some(Released { held_for, parked: std::mem::take(&mut s.parked) })
    }

    /// Who holds the volume now.
    #[cfg(test)]
    fn holder(&self) -> Option<String> {
        lock(&self.state).holder.as_ref().map(|h| h.name.clone())
    }
}

/// Whether a request changes what a snapshot would hold (or makes it durable).
fn changes_data(request: &Request) -> bool {
    matches!(request, Request::Write { .. } | Request::Unmap { .. } | Request::Flush)
}

impl Drop for Hold {
    /// A volume dropped while held answers what it parked: nobody will feed it any more.
    fn drop(&mut self) {
        let parked = std::mem::take(&mut lock(&self.state).parked);
        for (_, reply) in parked {
            reply.send(Err(stopped()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tokio::sync::oneshot;

    fn wait() -> (ReplyTx, oneshot::Receiver<std::io::Result<crate::engine::ClientReply>>) {
        let (tx, rx) = oneshot::channel();
        (ReplyTx::Wait(tx), rx)
    }

    #[test]
    fn a_held_volume_parks_what_changes_data_and_lets_reads_pass() {
        let hold = Hold::new();
        let (tx, _rx) = wait();
        assert!(hold.admit(Request::Flush, tx).is_some(), "not held: admitted");
        let generation = hold.hold("g").expect("hold");
        let (tx, _rx) = wait();
        assert!(hold.admit(Request::Read { offset: 0, len: 4096 }, tx).is_some());
        let (tx, _rx) = wait();
        assert!(hold.admit(Request::Snapshot { name: "s".into() }, tx).is_some());
        for request in [
            Request::Write { offset: 0, data: Bytes::from_static(b"x") },
            Request::Unmap { offset: 0, len: 4096 },
            Request::Flush,
        ] {
            let (tx, _rx) = wait();
            assert!(hold.admit(request, tx).is_none(), "parked");
        }
        assert_eq!(hold.holder().as_deref(), Some("g"));
        let released = hold.release("g", Some(generation)).expect("held by g");
        assert_eq!(released.parked.len(), 3);
        assert!(hold.holder().is_none());
        let (tx, _rx) = wait();
        assert!(hold.admit(Request::Flush, tx).is_some(), "released: admitted");
    }

    #[test]
    fn only_its_holder_and_only_its_own_deadline_end_a_hold() {
        let hold = Hold::new();
        let first = hold.hold("g").expect("hold");
        assert_eq!(hold.hold("g").expect("the same holder again"), first);
        assert!(matches!(hold.hold("h"), Err(HeldByAnother(h)) if h == "g"));
        assert!(hold.release("h", None).is_none(), "not h's hold");
        assert!(hold.release("g", None).is_some());
        let second = hold.hold("g").expect("hold again");
        assert_ne!(first, second);
        assert!(hold.release("g", Some(first)).is_none(), "the first hold's deadline leaves the second");
        assert!(hold.release("g", Some(second)).is_some());
    }

    #[test]
    fn a_hold_dropped_with_parked_requests_answers_them() {
        let hold = Hold::new();
        hold.hold("g").expect("hold");
        let (tx, mut rx) = wait();
        assert!(hold.admit(Request::Flush, tx).is_none());
        drop(hold);
        assert!(matches!(rx.try_recv(), Ok(Err(_))));
    }
}
