//! An engine session's requests, pipelined: read as fast as permits allow, batched, and run where
//! they cost least (see [`dispatch`]); replies go to the connection's writer as they complete.
//!
//! Backpressure: at most `ServerConfig::max_in_flight` requests per connection are executing or
//! waiting for their reply to be written; beyond that the server stops reading the socket, so a
//! fast engine fills its TCP window instead of the replica's memory. The protocol lets a replica
//! answer in completion order because the engine never has overlapping writes in flight on one
//! connection; `Flush` covers every write *acknowledged* before it arrived, and a write is only
//! acknowledged after its `pwrite` returned, so a flush needs no barrier.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::authorize::{self, Caller, Granted};
use super::frames::{ConnError, Reader};
use super::node::Replica;
use super::session::{self, Placement};
use crate::protocol::{Frame, Message};

/// Small reads run back to back on one blocking thread, this many per thread.
const SMALL_PER_TASK: usize = 8;
/// Most requests taken off the socket before they are dispatched.
const MAX_BATCH: usize = 64;

/// One request read and admitted (it holds its in-flight permit).
struct Admitted {
    frame: Frame,
    mutation: bool,
    permit: OwnedSemaphorePermit,
}

/// What one engine session may hold: requests executing at once, and the largest frame.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    pub(super) max_in_flight: usize,
    pub(super) max_payload: usize,
}

/// Pipelines requests until end of stream; returns whether the engine left cleanly (see the
/// module docs).
///
/// Every request that is already buffered when one is read is taken too (while permits last),
/// and small reads and writes of that batch run a few at a time per blocking task: a 4 KiB
/// request costs microseconds, a pool hop and its wakeups cost as much again.
///
/// A session bound to a grant (a node's) may claim only the grant's epoch: another claim is
/// answered `Denied` and ends the session ([`ConnError::Denied`], logged here with `peer` and
/// `caller`).
pub(super) async fn serve_requests(
    reader: &mut Reader,
    bounds: Bounds,
    replica: &Arc<Replica>,
    tx: &mpsc::Sender<Frame>,
    granted: Option<&Granted>,
    peer: SocketAddr,
    caller: &Caller,
) -> Result<bool, ConnError> {
    let max = bounds.max_in_flight.max(1);
    let permits = Arc::new(Semaphore::new(max));
    let rules = Arc::new(session::Session::default());
    let mutations_in_flight = Arc::new(AtomicUsize::new(0));
    let mut clean = false;
    let max_payload = bounds.max_payload;
    // No waiting at the end for started requests: each holds a reply sender, so on a clean end
    // the caller's wait for the writer is the wait for them, and on an error the caller closes
    // the writer, which also unblocks any request stuck queueing its reply for a peer not reading.
    loop {
        // Taking the permit before reading is the backpressure: no permit, no read.
        // Shutdown must not wait for a permit: a peer that stopped reading holds them all.
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break Ok(clean),
            },
            _ = reader.shutdown.wait_for(|stop| *stop) => break Ok(false),
        };
        let mut next = match reader.next().await {
            Ok(Some(frame)) => Some((frame, permit)),
            Ok(None) => break Ok(clean),
            Err(e) => break Err(e),
        };
        let mut batch = Vec::new();
        let mut failure = None;
        let mut refused = None;
        while let Some((frame, permit)) = next.take() {
            let Some(mutation) = session::classify(&frame.message) else {
                failure = Some(ConnError::Unexpected("not a request after Hello"));
                break;
            };
            if let Message::Claim { epoch } = frame.message
                && let Err(why) = authorize::may_claim(granted, epoch)
            {
                authorize::log_refusal(peer, caller, &frame.message, &why);
                refused = Some((frame.request_id, authorize::denied(&frame.message)));
                failure = Some(ConnError::Denied);
                break;
            }
            clean = matches!(frame.message, Message::Flush) && mutations_in_flight.load(Ordering::SeqCst) == 0;
            if mutation {
                mutations_in_flight.fetch_add(1, Ordering::SeqCst);
            }
            batch.push(Admitted { frame, mutation, permit });
            if batch.len() >= MAX_BATCH {
                break;
            }
            let Ok(permit) = permits.clone().try_acquire_owned() else { break };
            match reader.buffered() {
                Ok(Some(frame)) => next = Some((frame, permit)),
                Ok(None) => {}
                Err(e) => failure = Some(e),
            }
        }
        dispatch(batch, replica, &rules, tx, &mutations_in_flight, max_payload).await;
        if let Some((request_id, message)) = refused {
            let _ = tx.send(Frame { request_id, message }).await;
        }
        if let Some(e) = failure {
            break Err(e);
        }
    }
}

/// Runs a batch of admitted requests: small writes right here on the connection task (a
/// buffered 4 KiB write costs a few microseconds; a hop to the blocking pool and back costs two
/// thread wakeups), and so are small reads the page cache holds (tried without waiting for the
/// disk, `RWF_NOWAIT`); everything else on the blocking pool — other small reads a few per task
/// (they wait for the disk, which must not stall the runtime), the rest one per task (a
/// flush or a large write must not hold up the others). The engine never has overlapping
/// requests in flight, so their order among each other does not matter.
async fn dispatch(
    batch: Vec<Admitted>,
    replica: &Arc<Replica>,
    rules: &Arc<session::Session>,
    tx: &mpsc::Sender<Frame>,
    inflight: &Arc<AtomicUsize>,
    max_payload: usize,
) {
    let mut inline = Vec::new();
    let mut reads = Vec::new();
    let mut cached = Vec::new();
    let mut tasks: Vec<Vec<Admitted>> = Vec::new();
    for a in batch {
        match session::place(replica, &a.frame.message) {
            Placement::Inline => inline.push(a),
            Placement::Answered(message) => cached.push((a, message)),
            Placement::SmallRead => reads.push(a),
            Placement::Blocking => tasks.push(vec![a]),
        }
    }
    let mut reads = reads.into_iter().peekable();
    while reads.peek().is_some() {
        tasks.push(reads.by_ref().take(SMALL_PER_TASK).collect());
    }
    // The pool starts on its share first, so disk reads overlap with the inline writes.
    for task in tasks {
        let (replica, rules, tx, inflight) = (replica.clone(), rules.clone(), tx.clone(), inflight.clone());
        tokio::task::spawn_blocking(move || {
            for Admitted { frame, mutation, permit } in task {
                let message = session::execute(&replica, &rules, frame.message, max_payload);
                if mutation {
                    inflight.fetch_sub(1, Ordering::SeqCst);
                }
                // A closed channel means the connection is gone; the reply has nowhere to go.
                let _ = tx.blocking_send(Frame { request_id: frame.request_id, message });
                drop(permit);
            }
        });
    }
    for (Admitted { frame, mutation, permit }, message) in cached {
        debug_assert!(!mutation, "a read is not a mutation");
        let _ = tx.send(Frame { request_id: frame.request_id, message }).await;
        drop(permit);
    }
    for Admitted { frame, mutation, permit } in inline {
        let message = session::execute(replica, rules, frame.message, max_payload);
        if mutation {
            inflight.fetch_sub(1, Ordering::SeqCst);
        }
        let _ = tx.send(Frame { request_id: frame.request_id, message }).await;
        drop(permit);
    }
}
