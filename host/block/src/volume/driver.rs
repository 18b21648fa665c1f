//! The driver of one volume's engine: the engine is fed events — client requests (by the
//! callers' threads, see below), frames and connection changes from one connection per replica
//! and a periodic tick (by one tokio task) — and its actions are carried out in order: `Send` is
//! encoded and queued on the replica's connection, `Reply` completes the waiting client request,
//! `Persist` is written to the state file (atomic write + rename + fsync) *before* any later
//! action of the batch, and `ReplicaFailed` closes the connection and reconnects with
//! exponential backoff. The engine itself starts the handshake (`Hello`) when told a connection
//! is up.
//!
//! The engine sits behind a lock shared by the driver task and the handle's callers: a request
//! is queued and fed to the engine by whichever thread holds the lock (the caller itself when it
//! is free), which also writes the frames to the sockets, so a lone request is on the wire
//! without waking a runtime thread and a burst is carried in one batch. Its answer comes from
//! the thread that holds the lock when the replicas' replies arrive (a completion for
//! `submit_read`/`submit_write`, a oneshot for the blocking calls).
//!
//! A frontend thread that is plugged (`wasmcsi_frontend::plug`: it takes a burst of requests
//! already queued) has the frames of its completions held in the replicas' outboxes and sent
//! by its `unplug`, so a burst costs one send per replica (a 4 KiB write's send over TCP costs
//! the node more than the rest of the write). Whoever drives unplugged sends everything held,
//! and a pass that carries a blocking call is never held: its caller is about to wait.
//!
//! Connections carry a generation number: every event a connection task reports is tagged with
//! it, and the driver drops events of connections it has already given up on, like bytes of a
//! closed socket. The engine therefore never hears of a stale connection.
//!
//! Every task the driver spawns (its own, each replica's connection and writer, an in-process
//! replica's connect and the requests it runs on the blocking pool) runs in a span that names the
//! volume, so everything a volume's background work logs says which volume it is.
//!
//! It is a little over the ~750 lines a module is kept to because the lock discipline (who
//! drives, when frames are held for an unplug or sent) and the actions it carries out are one
//! invariant: split, each half would have to restate the other's. What a request is and where
//! its answer goes is apart (`request`), as are the connections (`connection`).

use std::cell::Cell;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant, SystemTime};

use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument as _;
use wasmcsi_trust::ExpectedRole;

use super::connection::{Conn, Dial, Outbox, connection};
use super::event::ConnEvent;
use super::hold::Hold;
use super::local::{LocalJob, LocalLink, Taken};
use super::request::{ReplyTx, Request, stopped, to_io_error};
use super::state_file::{load_state, save_state};
use super::{ReplicaEndpoint, VolumeConfig, VolumeError, VolumeStatus};
use crate::engine::{Action, ClientId, ClientReply, Engine, Event, MAX_REPLICAS, Millis, ReplicaHealth, ReplicaId};
use crate::protocol::{DEFAULT_DISK, Frame, PayloadCrc};

/// Most queued commands and events the driver handles before it sends what they produced.
const MAX_DRAIN: usize = 256;

/// The driver, shared by the task that serves its connections and timer and by the handles'
/// callers. A request is queued, and whoever holds the driver feeds everything queued to the
/// engine and writes the frames it produced: a lone request is on the wire from the caller's
/// own thread without waking a runtime thread, and under load one thread carries many
/// requests per lock and per socket write while the others go back to their work.
pub(super) struct Shared {
    driver: Mutex<Driver>,
    /// Requests and in-process replies not fed to the engine yet.
    queued: Mutex<Vec<Queued>>,
    /// A plugged pass left frames in an outbox (set under the driver's lock after it did):
    /// `unplug` has something to send.
    held: AtomicBool,
    /// A group snapshot's pause (see `super::hold`): checked as requests are fed.
    pub(super) hold: Hold,
}

enum Queued {
    Request(Request, ReplyTx),
    /// What an in-process replica answered (see `super::local`).
    Answer(ConnEvent<Link>),
}

/// A panic while a lock was held is a bug already reported; the state is still the best there
/// is, and every caller must get an answer.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    pub(super) fn submit(&self, request: Request, reply: ReplyTx) {
        lock(&self.queued).push(Queued::Request(request, reply));
        self.drive_if_free();
    }

    /// Feeds what a hold parked, in its order (see `super::hold`).
    pub(super) fn resubmit(&self, parked: Vec<(Request, ReplyTx)>) {
        lock(&self.queued).extend(parked.into_iter().map(|(request, reply)| Queued::Request(request, reply)));
        self.drive_if_free();
    }

    /// The runtime the driver runs on.
    pub(super) fn runtime(&self) -> tokio::runtime::Handle {
        self.with_driver(|d| d.runtime.clone())
    }

    /// Runs `f` on the driver, then as [`Self::drive`].
    pub(super) fn with_driver<T>(&self, f: impl FnOnce(&mut Driver) -> T) -> T {
        let value = self.drive(lock(&self.driver), f);
        self.drive_if_free();
        value
    }

    /// See [`super::ReplicatedVolume::is_idle`].
    pub(super) fn is_idle(&self) -> bool {
        self.with_driver(|d| d.engine.is_idle() && d.waiting.is_empty() && lock(&self.queued).is_empty())
    }

    /// Sends what plugged passes held back (see the module docs); nothing to do, and no lock
    /// taken, when none did.
    pub(super) fn unplug(&self) {
        if self.held.swap(false, Ordering::AcqRel) {
            self.with_driver(|_| ());
        }
    }

    /// Feeds what is queued unless another thread holds the driver: that one will, as it checks
    /// the queue again after letting go (so no request is left behind).
    fn drive_if_free(&self) {
        while !lock(&self.queued).is_empty() {
            let driver = match self.driver.try_lock() {
                Ok(d) => d,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => return,
            };
            self.drive(driver, |_| ());
        }
    }

    /// Runs `f`, then a batch of queued requests, sends the frames they produced, lets go of the
    /// driver, runs what in-process replicas got (queueing their replies) and completes what was
    /// answered (a completion may write to a FUSE device, or call back in).
    fn drive<T>(&self, mut d: MutexGuard<'_, Driver>, f: impl FnOnce(&mut Driver) -> T) -> T {
        let value = f(&mut d);
        // Swapped with the driver's spare, so neither vector is allocated anew per pass.
        let mut batch = std::mem::take(&mut d.spare_batch);
        std::mem::swap(&mut batch, &mut *lock(&self.queued));
        // Held back only for a plugged thread, and never when someone is about to wait for an
        // answer (the plugged thread itself, in `write_at` or `flush`, or another thread).
        let hold =
            wasmcsi_frontend::is_plugged() && !batch.iter().any(|q| matches!(q, Queued::Request(_, ReplyTx::Wait(_))));
        for queued in batch.drain(..) {
            match queued {
                Queued::Request(request, reply) => {
                    if let Some((request, reply)) = self.hold.admit(request, reply) {
                        d.on_request(request, reply);
                    }
                }
                Queued::Answer(event) => d.on_conn_event(event),
            }
        }
        d.spare_batch = batch;
        if d.send_out(!hold) {
            self.held.store(true, Ordering::Release);
        }
        d.publish_status();
        // Handed out in exchange for this thread's spares, which come back empty below.
        let mut done = std::mem::replace(&mut d.done, SPARE_DONE.take());
        let mut jobs = std::mem::replace(&mut d.local_jobs, SPARE_JOBS.take());
        let route = (!jobs.is_empty()).then(|| (d.events.clone(), d.runtime.clone()));
        drop(d);
        if let Some((events, runtime)) = route {
            for job in jobs.drain(..) {
                if let Some(answer) = job.run(&events, &runtime) {
                    // The caller's `drive_if_free` (or the thread holding the driver now) feeds
                    // it. Queued one by one: the lock is cheaper than collecting them first.
                    lock(&self.queued).push(Queued::Answer(answer));
                }
            }
        }
        SPARE_JOBS.set(jobs);
        for (tx, result) in done.drain(..) {
            tx.send(result);
        }
        SPARE_DONE.set(done);
        value
    }
}

thread_local! {
    // What a pass hands out of the driver (answers to complete, in-process jobs to run) is
    // swapped for these, and they come back emptied: no allocation per pass, at most one spare
    // of each per thread that drives. A completion that drives again (nested) finds them empty,
    // which is correct, only not reused.
    static SPARE_DONE: Cell<Vec<(ReplyTx, io::Result<ClientReply>)>> = const { Cell::new(Vec::new()) };
    static SPARE_JOBS: Cell<Vec<LocalJob>> = const { Cell::new(Vec::new()) };
}

/// How the driver reaches one replica: what a `Connected` event hands over.
pub(super) enum Link {
    Tcp(Conn),
    Local(LocalLink),
}

/// A TCP connection reports itself connected with its write side (see `super::connection`).
impl From<Conn> for Link {
    fn from(conn: Conn) -> Self {
        Self::Tcp(conn)
    }
}

struct Slot {
    /// Where the replica is served; changes when it is replaced.
    endpoint: ReplicaEndpoint,
    /// The disk of its server holding the replica; changes when it is replaced.
    disk: String,
    /// Generation of the current connection attempt; events of older ones are ignored.
    generation: u64,
    /// Set while connected: the connection's write side, or the in-process link.
    link: Option<Link>,
    /// Frames encoded for this replica during the current driver iteration, sent at its end
    /// (one write for everything a burst of requests produced).
    out: Outbox,
    /// Frames for an in-process replica during the current driver iteration, run at its end.
    local_out: Vec<Frame>,
    /// Connect-and-read task of the current generation.
    task: Option<JoinHandle<()>>,
    backoff: Duration,
    /// Who the replica server must be (TLS): the member node the record names, any node once
    /// the replica was replaced by one on a server named only by its address.
    server: ExpectedRole,
}

pub(super) struct Driver {
    engine: Engine,
    epoch: Instant,
    /// The configuration; its `replicas` are moved to `slots` (they change with replacements).
    cfg: VolumeConfig,
    slots: Vec<Slot>,
    /// Keyed by the driver's own client counter (see the engine's maps for the hasher).
    waiting: FxHashMap<ClientId, ReplyTx>,
    /// Answers produced while the lock was held, completed by whoever holds it once released.
    done: Vec<(ReplyTx, io::Result<ClientReply>)>,
    /// Requests for in-process replicas, run by whoever holds the lock once released.
    local_jobs: Vec<LocalJob>,
    /// The queue's previous buffer, swapped in when a pass takes the queue (see `Shared::drive`).
    spare_batch: Vec<Queued>,
    /// Set once the driver task ended: later requests fail at once.
    pub(super) stopped: bool,
    runtime: tokio::runtime::Handle,
    next_client: ClientId,
    events: mpsc::UnboundedSender<ConnEvent<Link>>,
    status: watch::Sender<VolumeStatus>,
    /// Shared with the handles: the engine's size, updated before any reply of a batch.
    size: Arc<AtomicU64>,
    rebuilds_finished: u64,
    /// Time spent rebuilding by rebuilds that ended, and since when the running one runs.
    rebuild_time: Duration,
    rebuild_since: Option<Instant>,
    /// Since when each replica is not healthy (see [`VolumeStatus::replicas`]).
    down_since: Vec<Option<SystemTime>>,
    /// Checksum of the last large write payload encoded, shared by the replicas' frames.
    payload_crc: PayloadCrc,
    /// The engine's actions of the event being fed (kept for its capacity, see `feed`).
    actions: Vec<Action>,
    /// A `Persist` failed: the engine's crash recovery can no longer be trusted, so nothing is
    /// acknowledged any more (a write acknowledged now might be lost to a stale replica later).
    poisoned: Option<String>,
}

impl Driver {
    fn now(&self) -> Millis {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn on_request(&mut self, request: Request, reply: ReplyTx) {
        if self.stopped {
            self.done.push((reply, Err(stopped())));
            return;
        }
        if let Some(why) = &self.poisoned {
            let why = io::Error::other(format!("volume stopped acknowledging I/O: {why}"));
            self.done.push((reply, Err(why)));
            return;
        }
        let client = self.next_client;
        self.next_client += 1;
        self.waiting.insert(client, reply);
        let event = match request {
            Request::Read { offset, len } => Event::ClientRead { client, offset, len },
            Request::Write { offset, data } => Event::ClientWrite { client, offset, data },
            Request::Flush => Event::ClientFlush { client },
            Request::Unmap { offset, len } => Event::ClientUnmap { client, offset, len },
            Request::Resize { size } => Event::ClientResize { client, size },
            Request::Snapshot { name } => {
                let created_ns = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
                Event::ClientSnapshot { client, name, created_ns }
            }
            Request::DeleteSnapshot { name } => Event::ClientDeleteSnapshot { client, name },
        };
        self.feed(event);
    }

    /// Number of replicas in the set (retired slots are none).
    pub(super) fn configured(&self) -> usize {
        self.engine.configured()
    }

    /// The slot of the set's `index`th replica, retired slots skipped: the control plane
    /// numbers replicas in its record's member order, where a removed one is gone.
    fn slot_of(&self, index: usize) -> Option<ReplicaId> {
        self.live().nth(index)
    }

    /// The slots of the set's replicas (every one but the retired), in order.
    fn live(&self) -> impl Iterator<Item = ReplicaId> + '_ {
        (0..self.slots.len()).filter(|r| !self.engine.is_retired(*r))
    }

    /// Points replica `index` at a new (empty) replica on `addr`'s disk `disk`; the engine
    /// fully rebuilds it.
    pub(super) fn replace_replica(&mut self, index: usize, addr: SocketAddr, disk: &str) -> io::Result<()> {
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        let configured = self.engine.configured();
        let Some(index) = self.slot_of(index) else {
            return Err(invalid(format!("replica {index} does not exist ({configured} replicas)")));
        };
        if self.live().any(|i| i != index && self.slots[i].endpoint.addr() == addr && self.slots[i].disk == disk) {
            return Err(invalid(format!("disk {disk} of {addr} already holds another replica of this volume")));
        }
        if self.engine.is_healthy(index) && self.engine.healthy_count() == 1 {
            return Err(invalid(format!(
                "replica {index} is the only healthy one; replacing it would lose the volume"
            )));
        }
        let slot = &mut self.slots[index];
        tracing::warn!(
            replica = index,
            old = %slot.endpoint.addr(),
            old.disk = %slot.disk,
            new = %addr,
            new.disk = disk,
            "replacing replica"
        );
        if addr != slot.endpoint.addr() {
            slot.server = ExpectedRole::AnyNode;
        }
        slot.endpoint = slot.endpoint.replaced_by(addr, slot.disk == disk);
        slot.disk = disk.to_owned();
        let node = match &slot.server {
            ExpectedRole::Node(node) => Some(node.as_str()),
            _ => None,
        };
        let who = super::identity(addr, node, disk);
        self.feed(Event::ReplicaReplaced(index, disk.to_owned(), who));
        self.close(index);
        self.slots[index].backoff = self.cfg.backoff_min;
        self.spawn_connect(index, Duration::ZERO);
        Ok(())
    }

    /// Adds a new, empty replica on disk `disk` of the replica server at `addr` (of the node
    /// `node`, when named) as the set's last; the engine fully rebuilds it while I/O goes on.
    /// The same place again: success. Returns the new replica's index in the set.
    pub(super) fn add_replica(&mut self, addr: SocketAddr, disk: &str, node: Option<&str>) -> io::Result<usize> {
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        if let Some(i) = self.live().position(|r| self.slots[r].endpoint.addr() == addr && self.slots[r].disk == disk) {
            return Ok(i);
        }
        if self.engine.is_fenced() || self.stopped {
            return Err(stopped());
        }
        // Attaching decides who is current from the members it started with; one added in the
        // middle would only make it wait for the attach timeout.
        if !self.engine.is_attached() {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "the volume is still attaching; add the replica later",
            ));
        }
        if self.slots.len() >= MAX_REPLICAS {
            return Err(invalid(format!("a volume's engine holds at most {MAX_REPLICAS} replicas over its life")));
        }
        let endpoint = ReplicaEndpoint::Remote(addr);
        let config = endpoint.engine_config(disk, node);
        tracing::warn!(new = %addr, new.disk = disk, "adding replica");
        self.slots.push(Slot {
            endpoint,
            disk: disk.to_owned(),
            generation: 0,
            link: None,
            out: Outbox::default(),
            local_out: Vec::new(),
            task: None,
            backoff: self.cfg.backoff_min,
            server: node.map_or(ExpectedRole::AnyNode, |n| ExpectedRole::Node(n.to_owned())),
        });
        self.feed(Event::ReplicaAdded(config));
        self.spawn_connect(self.slots.len() - 1, Duration::ZERO);
        Ok(self.engine.configured() - 1)
    }

    /// Removes the set's replica on disk `disk` of the server at `addr`: the engine stops using
    /// it at once (what it had in flight is resolved like a failure) and never reconnects it.
    /// None there: success. Refused for the last healthy replica; the caller deletes the
    /// replica itself afterwards.
    pub(super) fn remove_replica(&mut self, addr: SocketAddr, disk: &str) -> io::Result<()> {
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        let Some(r) = self.live().find(|r| self.slots[*r].endpoint.addr() == addr && self.slots[*r].disk == disk)
        else {
            return Ok(());
        };
        if self.engine.is_healthy(r) && self.engine.healthy_count() == 1 {
            return Err(invalid(format!(
                "the replica on disk {disk} of {addr} is the only healthy one; removing it would lose the volume"
            )));
        }
        tracing::warn!(replica = r, addr = %self.slots[r].endpoint.addr(), disk = %self.slots[r].disk, "removing replica");
        self.feed(Event::ReplicaRemoved(r));
        self.close(r);
        Ok(())
    }

    fn on_conn_event(&mut self, event: ConnEvent<Link>) {
        match event {
            ConnEvent::Connected { replica, generation, link } => {
                if self.slots[replica].generation != generation {
                    return;
                }
                tracing::debug!(replica, addr = %self.slots[replica].endpoint.addr(), "replica connected");
                self.slots[replica].link = Some(link);
                self.feed(Event::ReplicaConnected(replica));
            }
            ConnEvent::ConnectFailed { replica, generation, error } => {
                if self.slots[replica].generation != generation {
                    return;
                }
                tracing::debug!(replica, addr = %self.slots[replica].endpoint.addr(), %error, "replica connect failed");
                self.slots[replica].task = None;
                self.reconnect_later(replica);
            }
            ConnEvent::Received { replica, generation, frames } => {
                for frame in frames {
                    self.on_frame(replica, generation, frame);
                }
            }
            ConnEvent::Answered { replica, generation, frame } => self.on_frame(replica, generation, frame),
            ConnEvent::Closed { replica, generation, error } => {
                let slot = &self.slots[replica];
                if slot.generation != generation || slot.link.is_none() {
                    return;
                }
                tracing::warn!(replica, addr = %slot.endpoint.addr(), %error, "replica connection lost");
                self.feed(Event::ReplicaDisconnected(replica));
                // The engine reports `ReplicaFailed` (and we reconnect) only for a replica it
                // counted as up; otherwise reconnect here.
                if self.slots[replica].generation == generation {
                    self.drop_connection(replica);
                }
            }
        }
    }

    fn on_frame(&mut self, replica: ReplicaId, generation: u64, frame: Frame) {
        // Checked per frame: the one before may have made the engine drop the replica.
        let slot = &self.slots[replica];
        if slot.generation == generation && slot.link.is_some() {
            self.feed(Event::Received(replica, frame));
        }
    }

    fn feed(&mut self, event: Event) {
        // One buffer for every event's actions (taken, so a nested feed gets its own).
        let mut actions = std::mem::take(&mut self.actions);
        let now = self.now();
        self.engine.handle_into(now, event, &mut actions);
        // Before any reply: a caller whose resize returned must see the new size.
        self.size.store(self.engine.size(), Ordering::SeqCst);
        for action in actions.drain(..) {
            self.execute(action);
        }
        self.actions = actions;
        for r in 0..self.slots.len() {
            if self.engine.is_healthy(r) {
                self.slots[r].backoff = self.cfg.backoff_min;
            }
        }
    }

    /// Publishes the status as the engine shows it now: once per pass over the driver (see
    /// `Shared::drive`), before the pass's answers are completed, so a caller whose snapshot
    /// returned sees it in `snapshots()`. Not per event: building it allocates, and every I/O
    /// is several events that change nothing it shows.
    fn publish_status(&mut self) {
        if self.status_unchanged() {
            return;
        }
        let health = self.engine.replica_health();
        self.down_since.resize(health.len(), None);
        for (since, h) in self.down_since.iter_mut().zip(&health) {
            match h {
                ReplicaHealth::Healthy => *since = None,
                _ => *since = since.or_else(|| Some(SystemTime::now())),
            }
        }
        // The set as the control plane numbers it: retired slots are no replicas any more.
        let live: Vec<ReplicaId> = self.live().collect();
        let rebuild = self.engine.rebuild_status();
        match (rebuild.is_some(), self.rebuild_since) {
            (true, None) => self.rebuild_since = Some(Instant::now()),
            (false, Some(since)) => {
                self.rebuild_time += since.elapsed();
                self.rebuild_since = None;
            }
            _ => {}
        }
        let status = VolumeStatus {
            replicas: live.iter().map(|r| (health[*r], self.down_since[*r])).collect(),
            attached: self.engine.is_attached(),
            revision: self.engine.revision(),
            healthy: self.engine.healthy_count(),
            connected: self.slots.iter().filter(|s| s.link.is_some()).count(),
            rebuilds_finished: self.rebuilds_finished,
            rebuilt_bytes: self.engine.rebuilt_bytes(),
            rebuild_time: self.rebuild_time + self.rebuild_since.map_or(Duration::ZERO, |t| t.elapsed()),
            size: self.engine.size(),
            rebuild,
            snapshots: self.engine.snapshots().to_vec(),
            fenced: self.engine.is_fenced(),
            placement: live.iter().map(|r| (self.slots[*r].endpoint.addr(), self.slots[*r].disk.clone())).collect(),
        };
        self.status.send_if_modified(|old| {
            let changed = *old != status;
            *old = status;
            changed
        });
    }

    /// True when the status last sent is what [`Self::publish_status`] would build now. Checked
    /// first, without allocating: it holds for nearly every pass (a pass per I/O burst), and
    /// building a status allocates. With no rebuild running, every field is the engine's state
    /// or a counter that moves only with it (a replica's `since` changes only with its health).
    fn status_unchanged(&self) -> bool {
        let e = &self.engine;
        let old = self.status.borrow();
        // Every field named (no `..`): a field added to the status must be compared here too.
        let VolumeStatus {
            attached,
            revision,
            healthy,
            connected,
            rebuilds_finished,
            rebuilt_bytes,
            rebuild_time,
            size,
            rebuild,
            snapshots,
            fenced,
            replicas,
            placement,
        } = &*old;
        // No rebuild at the last publish (so `rebuild_since` is unset) nor now.
        rebuild.is_none()
            && e.rebuild_status().is_none()
            && *attached == e.is_attached()
            && *revision == e.revision()
            && *healthy == e.healthy_count()
            && *connected == self.slots.iter().filter(|s| s.link.is_some()).count()
            && *rebuilds_finished == self.rebuilds_finished
            && *rebuilt_bytes == e.rebuilt_bytes()
            && *rebuild_time == self.rebuild_time
            && *size == e.size()
            && *fenced == e.is_fenced()
            && snapshots.as_slice() == e.snapshots()
            && replicas.len() == e.configured()
            && replicas.iter().zip(self.live()).all(|((was, _), r)| *was == e.health(r))
            && placement.len() == e.configured()
            && placement
                .iter()
                .zip(self.live())
                .all(|((addr, disk), r)| *addr == self.slots[r].endpoint.addr() && *disk == self.slots[r].disk)
    }

    fn execute(&mut self, action: Action) {
        match action {
            Action::Send { replica, frame } => {
                // No connection: the frame is lost like on a dead socket; the engine hears of
                // the disconnect (or times the request out) and resolves it.
                let slot = &mut self.slots[replica];
                match &slot.link {
                    None => {}
                    Some(Link::Local(_)) => slot.local_out.push(frame),
                    Some(Link::Tcp(_)) => {
                        if let Err(e) = slot.out.push(&frame, &mut self.payload_crc) {
                            tracing::error!(replica, error = %e, "engine produced an unencodable frame");
                        }
                    }
                }
            }
            Action::Reply { client, result } => {
                let Some(tx) = self.waiting.remove(&client) else { return };
                let result = match (&self.poisoned, result) {
                    (Some(why), Ok(_)) => Err(io::Error::other(format!("volume stopped acknowledging I/O: {why}"))),
                    (_, r) => r.map_err(to_io_error),
                };
                self.done.push((tx, result));
            }
            Action::ReplicaFailed { replica, reason } => {
                tracing::warn!(replica, addr = %self.slots[replica].endpoint.addr(), %reason, "replica failed");
                if self.slots[replica].link.is_some() || self.slots[replica].task.is_some() {
                    self.drop_connection(replica);
                }
            }
            Action::Persist(state) => {
                // Synchronous on purpose: the engine requires it durable before the next action
                // of the batch, and it happens only when the replica set changes or a degraded
                // write touches a new region, so blocking the driver briefly is acceptable.
                if let Err(e) = save_state(&self.cfg.state_dir, &state) {
                    tracing::error!(dir = %self.cfg.state_dir.display(), error = %e, "persisting engine state failed");
                    self.poisoned.get_or_insert(format!("persisting engine state failed: {e}"));
                }
            }
            Action::RebuildStarted { replica, source, kind, regions } => {
                tracing::info!(replica, source, ?kind, regions, "rebuild started");
            }
            Action::RebuildProgress { replica, done, total } => {
                tracing::debug!(replica, done, total, "rebuild progress");
            }
            Action::RebuildFinished { replica } => {
                self.rebuilds_finished += 1;
                tracing::info!(replica, "rebuild finished; replica healthy");
            }
        }
    }

    /// Closes the replica's connection and schedules a new one after the backoff.
    fn drop_connection(&mut self, replica: ReplicaId) {
        self.close(replica);
        self.reconnect_later(replica);
    }

    /// Resets the replica's connection (see [`Conn::reset`]) and aborts its reader; frames not
    /// sent yet are lost like on a dead socket.
    fn close(&mut self, replica: ReplicaId) {
        let slot = &mut self.slots[replica];
        slot.out.clear();
        slot.local_out.clear();
        match slot.link.take() {
            Some(Link::Tcp(conn)) => conn.reset(),
            Some(Link::Local(link)) => link.reset(),
            None => {}
        }
        if let Some(t) = slot.task.take() {
            t.abort();
        }
    }

    /// Sends every replica the frames this iteration produced for it (in-process ones: see
    /// [`Self::take_local`]), those over TCP only if `network` (else they stay in the outboxes
    /// for a later call). What an in-process `Hello` reply produces goes out too. Returns
    /// whether frames stay held back.
    fn send_out(&mut self, network: bool) -> bool {
        loop {
            for slot in &mut self.slots {
                match &slot.link {
                    Some(Link::Tcp(conn)) if network => conn.send(&mut slot.out),
                    Some(Link::Tcp(_)) => {}
                    _ => slot.out.clear(),
                }
            }
            if !self.take_local() {
                return self.slots.iter().any(|s| !s.out.is_empty());
            }
        }
    }

    /// Takes the frames queued for in-process replicas: requests become jobs run once the
    /// driver is released, what is answered at once is fed to the engine; false if nothing was.
    fn take_local(&mut self) -> bool {
        let mut answered = Vec::new();
        for (replica, slot) in self.slots.iter_mut().enumerate() {
            if slot.local_out.is_empty() {
                continue;
            }
            let Some(Link::Local(link)) = &mut slot.link else {
                slot.local_out.clear();
                continue;
            };
            let mut replies = Vec::new();
            // Drained, not taken: the buffer is kept for the next pass.
            for frame in slot.local_out.drain(..) {
                match link.take(frame, replica, slot.generation) {
                    Ok(Taken::Answered(reply)) => replies.push(reply),
                    Ok(Taken::Job(job)) => self.local_jobs.push(job),
                    Err(error) => {
                        // Like a protocol error on a socket: the link ends, the engine hears of it.
                        let error = format!("in-process replica: {error}");
                        let _ = self.events.send(ConnEvent::Closed { replica, generation: slot.generation, error });
                        break;
                    }
                }
            }
            if !replies.is_empty() {
                answered.push(ConnEvent::Received { replica, generation: slot.generation, frames: replies });
            }
        }
        let ran = !answered.is_empty();
        for event in answered {
            self.on_conn_event(event);
        }
        ran
    }

    fn reconnect_later(&mut self, replica: ReplicaId) {
        if self.engine.is_fenced() || self.engine.is_retired(replica) {
            // Nothing a replica says can change that: stay disconnected.
            return;
        }
        let delay = self.slots[replica].backoff;
        self.slots[replica].backoff = (delay * 2).clamp(self.cfg.backoff_min, self.cfg.backoff_max);
        self.spawn_connect(replica, delay);
    }

    fn spawn_connect(&mut self, replica: ReplicaId, delay: Duration) {
        let slot = &mut self.slots[replica];
        slot.generation += 1;
        let (events, generation) = (self.events.clone(), slot.generation);
        // The connection's tasks log in the volume's and the replica's name.
        let span = tracing::info_span!(
            "volume.replica",
            volume.id = %self.cfg.engine.volume_id,
            replica,
            addr = %slot.endpoint.addr()
        );
        let task = match &slot.endpoint {
            ReplicaEndpoint::InProcess(local) => {
                let node = local.node.clone();
                self.runtime.spawn(
                    async move {
                        tokio::time::sleep(delay).await;
                        let link = Link::Local(LocalLink::new(node, tracing::Span::current()));
                        let _ = events.send(ConnEvent::Connected { replica, generation, link });
                    }
                    .instrument(span),
                )
            }
            ReplicaEndpoint::Remote(addr) | ReplicaEndpoint::Local(addr) => {
                let dial = Dial {
                    addr: *addr,
                    transport: self.cfg.transport.clone(),
                    expected: slot.server.clone(),
                    grant: self.cfg.grant.clone(),
                    timeout: self.cfg.connect_timeout,
                };
                self.runtime.spawn(connection(replica, generation, dial, delay, events).instrument(span))
            }
        };
        slot.task = Some(task);
    }
}

/// What a handle keeps of a driver it started.
pub(super) struct Started {
    pub(super) shared: Arc<Shared>,
    /// The engine's size, updated by the driver before any reply of a batch.
    pub(super) size: Arc<AtomicU64>,
    /// Stops the driver task when sent to or dropped.
    pub(super) stop: mpsc::UnboundedSender<()>,
    pub(super) status: watch::Receiver<VolumeStatus>,
}

/// Loads the persisted engine state from `cfg.state_dir` and starts the driver task on
/// `runtime`; it connects to every replica and attaches in the background.
pub(super) fn start(mut cfg: VolumeConfig, runtime: &tokio::runtime::Handle) -> Result<Started, VolumeError> {
    // Refused before anything is created.
    if cfg.replicas.len() > MAX_REPLICAS {
        return Err(VolumeError::TooManyReplicas { count: cfg.replicas.len(), max: MAX_REPLICAS });
    }
    std::fs::create_dir_all(&cfg.state_dir)
        .map_err(|source| VolumeError::State { path: cfg.state_dir.clone(), source })?;
    let persisted = load_state(&cfg.state_dir)?;
    let endpoints = std::mem::take(&mut cfg.replicas);
    let disks: Vec<String> =
        (0..endpoints.len()).map(|i| cfg.disks.get(i).cloned().unwrap_or_else(|| DEFAULT_DISK.to_owned())).collect();
    let replicas = endpoints
        .iter()
        .zip(&disks)
        .enumerate()
        .map(|(i, (e, disk))| e.engine_config(disk, cfg.nodes.get(i).and_then(|n| n.as_deref())))
        .collect();
    let engine = Engine::new(cfg.engine.clone(), replicas, persisted, 0);
    let size = Arc::new(AtomicU64::new(engine.size()));
    let (stop, stop_rx) = mpsc::unbounded_channel();
    let (events, event_rx) = mpsc::unbounded_channel();
    let (status_tx, status) = watch::channel(VolumeStatus::default());
    let nodes = std::mem::take(&mut cfg.nodes);
    let slots = endpoints
        .into_iter()
        .zip(disks)
        .enumerate()
        .map(|(i, (endpoint, disk))| Slot {
            disk,
            server: match nodes.get(i) {
                Some(Some(node)) => ExpectedRole::Node(node.clone()),
                _ => ExpectedRole::AnyNode,
            },
            endpoint,
            generation: 0,
            link: None,
            out: Outbox::default(),
            local_out: Vec::new(),
            task: None,
            backoff: cfg.backoff_min,
        })
        .collect();
    // Everything the driver task logs names its volume.
    let span = tracing::info_span!("volume", volume.id = %cfg.engine.volume_id);
    let driver = Driver {
        engine,
        epoch: Instant::now(),
        cfg,
        slots,
        waiting: FxHashMap::default(),
        done: Vec::new(),
        local_jobs: Vec::new(),
        spare_batch: Vec::new(),
        stopped: false,
        runtime: runtime.clone(),
        next_client: 1,
        events,
        status: status_tx,
        size: size.clone(),
        rebuilds_finished: 0,
        rebuild_time: Duration::ZERO,
        rebuild_since: None,
        down_since: Vec::new(),
        payload_crc: PayloadCrc::default(),
        actions: Vec::new(),
        poisoned: None,
    };
    let shared = Arc::new(Shared {
        driver: Mutex::new(driver),
        queued: Mutex::new(Vec::new()),
        held: AtomicBool::new(false),
        hold: Hold::new(),
    });
    runtime.spawn(run(shared.clone(), stop_rx, event_rx).instrument(span));
    Ok(Started { shared, size, stop, status })
}

/// Serves the driver's connections and timer until the handle asks it to stop (or is dropped).
async fn run(
    shared: Arc<Shared>,
    mut stop: mpsc::UnboundedReceiver<()>,
    mut events: mpsc::UnboundedReceiver<ConnEvent<Link>>,
) {
    // Also when the runtime drops this task unfinished (it shut down under a live handle): the
    // handles must see the driver gone rather than wait for answers nobody will read.
    let _stopped = StopOnDrop(shared.clone());
    let tick_every = shared.with_driver(|d| {
        for r in 0..d.slots.len() {
            d.spawn_connect(r, Duration::ZERO);
        }
        d.cfg.tick
    });
    let mut tick = tokio::time::interval(tick_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            // A stop request, or every handle is gone.
            _ = stop.recv() => break,
            Some(event) = events.recv() => shared.with_driver(|d| {
                d.on_conn_event(event);
                // Whatever else is queued already, before sending what it all produced.
                for _ in 0..MAX_DRAIN {
                    match events.try_recv() {
                        Ok(event) => d.on_conn_event(event),
                        Err(_) => break,
                    }
                }
            }),
            _ = tick.tick() => shared.with_driver(|d| d.feed(Event::Tick)),
        }
    }
}

/// Stops the driver when the task serving it ends, however it ends.
struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.with_driver(|d| {
            d.stopped = true;
            d.send_out(true);
            for slot in &mut d.slots {
                slot.link = None;
                if let Some(t) = slot.task.take() {
                    t.abort();
                }
            }
            // Every outstanding request fails: a blocked caller would see its channel close,
            // but a completion must be called.
            let waiting: Vec<_> = d.waiting.drain().map(|(_, tx)| (tx, Err(stopped()))).collect();
            d.done.extend(waiting);
        });
    }
}
