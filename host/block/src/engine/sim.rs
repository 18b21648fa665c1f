//! Test-only simulated world for the replication engine: in-memory replicas with a revision
//! header, a volatile/durable split, a size that grows and a snapshot chain (each snapshot a full
//! view), a seeded network that delays and reorders every frame (through the real encoder and
//! decoder), and faults — lossy links, partitions, replica crashes that lose unflushed writes, and
//! engine crashes that restart the engine from its last persisted state. The workload mixes
//! reads, writes, unmaps, flushes, resizes, snapshots and snapshot deletions. A checker holds the
//! engine to its promises: every acknowledged write is read back, no read is ever served by a
//! replica that is out of sync, and after healing and rebuilding every replica is byte-identical
//! to the model, head and every snapshot view. It owns nothing outside tests.
//!
//! It is longer than the ~750 lines a module is kept to because the world, its faults, the
//! workload and the checker all act on one `World` and read as one scenario; split, each part
//! would reach into the others' fields.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use crate::engine::{
    Action, ClientReply, Engine, EngineConfig, Event, IoError, Millis, PersistedState, RebuildKind, ReplicaConfig,
    ReplicaId,
};
use crate::protocol::{self, Decoded, Extent, ExtentState, Frame, Message, ReplicaHeader, SnapshotInfo, Status};
use crate::testutil::Rng;

const VOLUME: &str = "pvc-sim";
const SIZE: u64 = 64 * 1024;
const REGION: u64 = 4096;
const REPLICAS: usize = 3;
const TIMEOUT: Millis = 40;
/// Resizes stop here, so runs stay fast.
const MAX_SIZE: u64 = 2 * SIZE;
/// Granularity of the extents a simulated replica reports.
const EXTENT: usize = 512;

/// A replica as the replica server will be, minus the disk: `volatile` is what reads see,
/// `durable` what survives a crash; the header (revision, size, chain) is written synchronously,
/// and taking a snapshot makes the head durable (the server fsyncs before recording it). The
/// dirty flag follows the server's rule: `Hello` answers the previous value and sets it; only a
/// clean end of the last session clears it, and the simulated engine never detaches cleanly (it
/// only crashes), so once set it stays set.
struct SimReplica {
    revision: u64,
    dirty: bool,
    volatile: Vec<u8>,
    durable: Vec<u8>,
    chain: Vec<(String, Vec<u8>)>,
    up: bool,
}

impl SimReplica {
    fn new() -> Self {
        Self {
            revision: 0,
            dirty: false,
            volatile: vec![0; SIZE as usize],
            durable: vec![0; SIZE as usize],
            chain: Vec::new(),
            up: true,
        }
    }

    fn range(&self, offset: u64, len: u64) -> Option<std::ops::Range<usize>> {
        let end = offset.checked_add(len)?;
        (end <= self.volatile.len() as u64).then_some(offset as usize..end as usize)
    }

    fn view(&self, name: &str) -> Option<&Vec<u8>> {
        self.chain.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    fn serve(&mut self, m: Message) -> Message {
        let reply = |status| Message::Reply { status };
        let fenced = |revision: u64, own: u64| revision < own;
        match m {
            Message::Hello { .. } => Message::HelloReply {
                status: Status::Ok,
                // The value from before this session, as the server answers it.
                header: ReplicaHeader {
                    volume_id: VOLUME.into(),
                    size: self.volatile.len() as u64,
                    revision: self.revision,
                    snapshots: self
                        .chain
                        .iter()
                        .map(|(name, _)| SnapshotInfo { name: name.clone(), revision: 0, created_ns: 0 })
                        .collect(),
                    dirty: std::mem::replace(&mut self.dirty, true),
                },
            },
            Message::Read { offset, len } => match self.range(offset, u64::from(len)) {
                Some(r) => Message::ReadReply { status: Status::Ok, data: self.volatile[r].to_vec() },
                None => Message::ReadReply { status: Status::OutOfRange, data: vec![] },
            },
            Message::ReadExtent { offset, len, revision } => {
                if self.revision < revision {
                    return Message::ReadReply { status: Status::StaleRevision, data: vec![] };
                }
                match self.range(offset, u64::from(len)) {
                    Some(r) => Message::ReadReply { status: Status::Ok, data: self.volatile[r].to_vec() },
                    None => Message::ReadReply { status: Status::OutOfRange, data: vec![] },
                }
            }
            Message::Write { offset, revision, data } => {
                if fenced(revision, self.revision) {
                    return reply(Status::StaleRevision);
                }
                match self.range(offset, data.len() as u64) {
                    Some(r) => {
                        self.volatile[r].copy_from_slice(&data);
                        reply(Status::Ok)
                    }
                    None => reply(Status::OutOfRange),
                }
            }
            Message::Unmap { offset, len, revision } => {
                if fenced(revision, self.revision) {
                    return reply(Status::StaleRevision);
                }
                match self.range(offset, len) {
                    Some(r) => {
                        self.volatile[r].iter_mut().for_each(|b| *b = 0);
                        reply(Status::Ok)
                    }
                    None => reply(Status::OutOfRange),
                }
            }
            Message::Flush => {
                self.durable.copy_from_slice(&self.volatile);
                reply(Status::Ok)
            }
            Message::SetRevision { revision } => {
                self.revision = self.revision.max(revision);
                reply(Status::Ok)
            }
            Message::Resize { size, revision } => {
                if fenced(revision, self.revision) {
                    return reply(Status::StaleRevision);
                }
                if size < self.volatile.len() as u64 {
                    return reply(Status::Invalid);
                }
                self.volatile.resize(size as usize, 0);
                self.durable.resize(size as usize, 0);
                reply(Status::Ok)
            }
            Message::Snapshot { name, revision } => {
                if fenced(revision, self.revision) {
                    return reply(Status::StaleRevision);
                }
                if self.view(&name).is_some() {
                    return reply(Status::AlreadyExists);
                }
                self.durable.copy_from_slice(&self.volatile);
                self.chain.push((name, self.volatile.clone()));
                reply(Status::Ok)
            }
            Message::DeleteSnapshot { name, revision } => {
                if fenced(revision, self.revision) {
                    return reply(Status::StaleRevision);
                }
                let before = self.chain.len();
                self.chain.retain(|(n, _)| *n != name);
                reply(if self.chain.len() < before { Status::Ok } else { Status::NotFound })
            }
            Message::Reinitialize { revision } => {
                if fenced(revision, self.revision) {
                    return reply(Status::StaleRevision);
                }
                self.revision = revision;
                self.chain.clear();
                self.volatile.iter_mut().for_each(|b| *b = 0);
                self.durable.iter_mut().for_each(|b| *b = 0);
                reply(Status::Ok)
            }
            Message::ReadSnapshot { name, offset, len } => {
                let Some(range) = self.range(offset, u64::from(len)) else {
                    return Message::ReadReply { status: Status::OutOfRange, data: vec![] };
                };
                let Some(view) = self.view(&name) else {
                    return Message::ReadReply { status: Status::NotFound, data: vec![] };
                };
                // A view taken before a resize reads zeros past its own end.
                let data = range.map(|i| view.get(i).copied().unwrap_or(0)).collect();
                Message::ReadReply { status: Status::Ok, data }
            }
            Message::ListSnapshotExtents { name, offset, len } => {
                let Some(view) = self.view(&name) else {
                    return Message::ExtentMap { status: Status::NotFound, extents: vec![] };
                };
                let end = offset.saturating_add(len).min(view.len() as u64) as usize;
                let mut extents: Vec<Extent> = Vec::new();
                let mut at = offset as usize / EXTENT * EXTENT;
                while at < end {
                    let stop = (at + EXTENT).min(view.len());
                    if view[at..stop].iter().any(|b| *b != 0) {
                        match extents.last_mut() {
                            Some(e) if e.offset + e.len == at as u64 => e.len += (stop - at) as u64,
                            _ => extents.push(Extent {
                                offset: at as u64,
                                len: (stop - at) as u64,
                                state: ExtentState::Allocated,
                            }),
                        }
                    }
                    at = stop;
                }
                Message::ExtentMap { status: Status::Ok, extents }
            }
            _ => reply(Status::Invalid),
        }
    }
}

/// What the checker expects of a client request's answer.
enum Expect {
    Read(u64, Vec<u8>),
    Write,
    Unmap,
    Flush,
    Resize(u64),
    /// The model's head as of the snapshot's issue time (writes issued before it are in it).
    Snapshot(String, Vec<u8>),
    Delete(String),
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Wire {
    ToReplica(ReplicaId, u64, Vec<u8>),
    ToEngine(ReplicaId, u64, Vec<u8>),
    Reconnect(ReplicaId),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    Lossy,
    Partition,
    Crash,
}

struct World {
    rng: Rng,
    now: Millis,
    seq: u64,
    engine: Engine,
    replicas: Vec<SimReplica>,
    /// Current connection generation per replica; 0 = not connected. Frames of an older
    /// generation are dropped, like bytes of a closed TCP connection.
    conn: Vec<u64>,
    next_conn: u64,
    wire: BinaryHeap<Reverse<(Millis, u64, Wire)>>,
    fault: Option<(ReplicaId, Fault, Millis)>,
    /// No new fault before this: a message lost just before a fault ended is only noticed a
    /// timeout later, and two overlapping failures could take every healthy replica down.
    calm_until: Millis,
    /// Out of sync from the checker's point of view: failed and not yet rebuilt.
    out: Vec<bool>,
    model: Vec<u8>,
    /// Snapshots acknowledged (or recorded by the engine), oldest first, with their views.
    snapshots: Vec<(String, Vec<u8>)>,
    next_client: u64,
    outstanding: BTreeMap<u64, Expect>,
    /// The last state the engine asked to persist: what a restarted engine starts from.
    persisted: Option<PersistedState>,
    /// Stop issuing client requests and crash the engine once none is outstanding.
    engine_crash_wanted: bool,
    /// Every `RebuildStarted`: (replica, kind, regions to copy).
    started: Vec<(ReplicaId, RebuildKind, u64)>,
    acked_writes: u64,
    rebuilds: u64,
    delta_rebuilds: u64,
    full_rebuilds: u64,
    faults: u64,
    engine_crashes: u64,
    unmaps: u64,
    resizes: u64,
    snapshots_taken: u64,
    snapshots_deleted: u64,
}

impl World {
    fn config() -> EngineConfig {
        EngineConfig {
            volume_id: VOLUME.into(),
            size: SIZE,
            region_size: REGION,
            request_timeout: TIMEOUT,
            attach_timeout: 100,
            rebuild_parallelism: 2,
            epoch: 0,
        }
    }

    /// Replica 0 is the engine's local one.
    fn replica_config() -> Vec<ReplicaConfig> {
        (0..REPLICAS)
            .map(|i| ReplicaConfig {
                local: i == 0,
                disk: crate::protocol::DEFAULT_DISK.into(),
                identity: String::new(),
            })
            .collect()
    }

    fn new(seed: u64) -> Self {
        let cfg = Self::config();
        let mut w = Self {
            rng: Rng::new(seed),
            now: 0,
            seq: 0,
            engine: Engine::new(cfg, Self::replica_config(), None, 0),
            replicas: (0..REPLICAS).map(|_| SimReplica::new()).collect(),
            conn: vec![0; REPLICAS],
            next_conn: 1,
            wire: BinaryHeap::new(),
            fault: None,
            calm_until: 0,
            out: vec![false; REPLICAS],
            model: vec![0; SIZE as usize],
            snapshots: Vec::new(),
            next_client: 1,
            outstanding: BTreeMap::new(),
            persisted: None,
            engine_crash_wanted: false,
            started: Vec::new(),
            acked_writes: 0,
            rebuilds: 0,
            delta_rebuilds: 0,
            full_rebuilds: 0,
            faults: 0,
            engine_crashes: 0,
            unmaps: 0,
            resizes: 0,
            snapshots_taken: 0,
            snapshots_deleted: 0,
        };
        for r in 0..REPLICAS {
            w.schedule(0, Wire::Reconnect(r));
        }
        w
    }

    fn schedule(&mut self, delay: Millis, what: Wire) {
        self.seq += 1;
        self.wire.push(Reverse((self.now + delay, self.seq, what)));
    }

    fn link_drops(&mut self, r: ReplicaId) -> bool {
        match self.fault {
            Some((f, Fault::Partition, _)) if f == r => true,
            Some((f, Fault::Lossy, _)) if f == r => self.rng.chance(30),
            _ => false,
        }
    }

    fn feed(&mut self, event: Event) {
        let actions = self.engine.handle(self.now, event);
        for a in actions {
            self.execute(a);
        }
    }

    fn execute(&mut self, action: Action) {
        if std::env::var_os("SIM_TRACE").is_some() {
            match &action {
                Action::Send { frame: Frame { message: Message::Write { .. } | Message::Read { .. }, .. }, .. }
                | Action::Persist(_) => {}
                Action::Send { replica, frame } => eprintln!("t={} -> {replica}: {:?}", self.now, frame.message),
                other => eprintln!("t={} {other:?}", self.now),
            }
        }
        match action {
            Action::Send { replica, frame } => {
                if self.conn[replica] == 0 || self.link_drops(replica) {
                    return;
                }
                let mut bytes = Vec::new();
                protocol::encode(&frame, &mut bytes).expect("engine frames encode");
                let delay = self.rng.below(5);
                self.schedule(delay, Wire::ToReplica(replica, self.conn[replica], bytes));
            }
            Action::Reply { client, result } => {
                let expected = self.outstanding.remove(&client).expect("reply to a known client request");
                let recorded = |name: &str, engine: &Engine| engine.snapshots().iter().any(|s| s.name == name);
                match (expected, result) {
                    (Expect::Read(offset, want), Ok(ClientReply::Read(got))) => {
                        assert!(got == want, "read at {offset} returned data that was never acknowledged there");
                    }
                    (Expect::Write, Ok(ClientReply::Written)) => self.acked_writes += 1,
                    (Expect::Unmap, Ok(ClientReply::Unmapped)) => self.unmaps += 1,
                    (Expect::Flush, Ok(ClientReply::Flushed)) => {}
                    (Expect::Resize(size), Ok(ClientReply::Resized)) => {
                        assert_eq!(self.engine.size(), size);
                        self.model.resize(size as usize, 0);
                        self.resizes += 1;
                    }
                    (Expect::Snapshot(name, view), Ok(ClientReply::SnapshotTaken)) => {
                        self.snapshots.push((name, view));
                        self.snapshots_taken += 1;
                    }
                    // A replica failed during it: it exists if every replica still healthy has it.
                    (Expect::Snapshot(name, view), Err(IoError::Degraded { .. })) => {
                        if recorded(&name, &self.engine) {
                            self.snapshots.push((name, view));
                        }
                    }
                    (Expect::Delete(name), Ok(ClientReply::SnapshotDeleted)) => {
                        self.snapshots.retain(|(n, _)| *n != name);
                        self.snapshots_deleted += 1;
                    }
                    (Expect::Delete(name), Err(IoError::Degraded { .. })) => {
                        if !recorded(&name, &self.engine) {
                            self.snapshots.retain(|(n, _)| *n != name);
                        }
                    }
                    (_, other) => panic!("client request {client} failed with ≥ 1 healthy replica: {other:?}"),
                }
            }
            Action::ReplicaFailed { replica, reason } => {
                if std::env::var_os("SIM_TRACE").is_some() {
                    eprintln!(
                        "t={} replica {replica} failed: {reason} (fault {:?})",
                        self.now,
                        self.fault.map(|f| f.0)
                    );
                }
                // Before attach nothing is written, so failing a handshake misses nothing.
                self.out[replica] |= self.engine.is_attached();
                self.conn[replica] = 0;
                self.schedule(10, Wire::Reconnect(replica));
            }
            Action::RebuildFinished { replica } => {
                self.out[replica] = false;
                self.rebuilds += 1;
            }
            Action::RebuildStarted { replica, kind, regions, .. } => {
                self.delta_rebuilds += u64::from(kind == RebuildKind::Delta);
                self.full_rebuilds += u64::from(kind == RebuildKind::Full);
                self.started.push((replica, kind, regions));
            }
            Action::Persist(state) => self.persisted = Some(state),
            Action::RebuildProgress { .. } => {}
        }
    }

    fn deliver(&mut self, what: Wire) {
        match what {
            Wire::Reconnect(r) => {
                let cut = matches!(self.fault, Some((f, Fault::Partition, _)) if f == r);
                if self.conn[r] != 0 {
                    return;
                }
                if !self.replicas[r].up || cut {
                    self.schedule(10, Wire::Reconnect(r));
                    return;
                }
                self.conn[r] = self.next_conn;
                self.next_conn += 1;
                self.feed(Event::ReplicaConnected(r));
            }
            Wire::ToReplica(r, conn, bytes) => {
                if conn != self.conn[r] || !self.replicas[r].up {
                    return;
                }
                let Ok(Decoded::Frame(frame, _)) = protocol::decode(&bytes) else { panic!("undecodable request") };
                let serves = matches!(
                    frame.message,
                    Message::Read { .. }
                        | Message::ReadExtent { .. }
                        | Message::ReadSnapshot { .. }
                        | Message::ListSnapshotExtents { .. }
                );
                if serves {
                    assert!(!self.out[r], "replica {r} is out of sync but was asked to serve {:?}", frame.message);
                }
                let reply = Frame { request_id: frame.request_id, message: self.replicas[r].serve(frame.message) };
                if self.link_drops(r) {
                    return;
                }
                let mut out = Vec::new();
                protocol::encode(&reply, &mut out).expect("replies encode");
                let delay = self.rng.below(5);
                self.schedule(delay, Wire::ToEngine(r, conn, out));
            }
            Wire::ToEngine(r, conn, bytes) => {
                if conn != self.conn[r] {
                    return;
                }
                let Ok(Decoded::Frame(frame, _)) = protocol::decode(&bytes) else { panic!("undecodable reply") };
                self.feed(Event::Received(r, frame));
            }
        }
    }

    /// Advances the clock by one millisecond, delivering everything due.
    fn step(&mut self) {
        self.now += 1;
        while let Some(Reverse((at, _, _))) = self.wire.peek() {
            if *at > self.now {
                break;
            }
            let Some(Reverse((_, _, what))) = self.wire.pop() else { break };
            self.deliver(what);
        }
        self.feed(Event::Tick);
    }

    fn issue(&mut self, expect: Expect, event: impl FnOnce(u64) -> Event) {
        let client = self.next_client;
        self.next_client += 1;
        self.outstanding.insert(client, expect);
        self.feed(event(client));
    }

    fn client_op(&mut self) {
        // Requests stay inside the size the model knows acknowledged; a resize in flight only
        // ever grows the volume, so they are in range whenever they start.
        let size = self.model.len() as u64;
        let offset = self.rng.below(size);
        let len = (self.rng.below(3 * REGION) + 1).min(size - offset);
        let range = offset as usize..(offset + len) as usize;
        match self.rng.below(40) {
            0..=15 => {
                let data: Vec<u8> = (0..len).map(|_| self.rng.next() as u8).collect();
                // The engine orders overlapping requests by arrival, so the model applies each
                // write at issue time and a read expects the model as of its own issue time.
                self.model[range].copy_from_slice(&data);
                self.issue(Expect::Write, |client| Event::ClientWrite { client, offset, data: data.into() });
            }
            16..=18 => {
                self.model[range].iter_mut().for_each(|b| *b = 0);
                self.issue(Expect::Unmap, |client| Event::ClientUnmap { client, offset, len });
            }
            19..=33 => {
                let want = self.model[range].to_vec();
                self.issue(Expect::Read(offset, want), |client| Event::ClientRead { client, offset, len });
            }
            34..=36 => self.issue(Expect::Flush, |client| Event::ClientFlush { client }),
            37 => {
                let resizing = self.outstanding.values().any(|e| matches!(e, Expect::Resize(_)));
                if !resizing && size < MAX_SIZE {
                    // Not region-aligned on purpose: the last region is partial.
                    let size = (size + 1 + self.rng.below(2 * REGION)).min(MAX_SIZE);
                    self.issue(Expect::Resize(size), |client| Event::ClientResize { client, size });
                }
            }
            38 => {
                let name = format!("snap-{}", self.next_client);
                let view = self.model.clone();
                let expect = Expect::Snapshot(name.clone(), view);
                self.issue(expect, |client| Event::ClientSnapshot { client, name, created_ns: 0 });
            }
            _ => {
                if !self.snapshots.is_empty() {
                    let i = self.rng.below(self.snapshots.len() as u64) as usize;
                    let name = self.snapshots[i].0.clone();
                    self.issue(Expect::Delete(name.clone()), |client| Event::ClientDeleteSnapshot { client, name });
                }
            }
        }
    }

    /// The engine process dies: connections close, in-memory state is gone; a new engine starts
    /// from the last persisted state and attaches again.
    fn crash_engine(&mut self) {
        assert!(self.outstanding.is_empty(), "the checker only crashes the engine between client requests");
        // A fault that outlives the engine ends with it: after the crash the replicas resync from
        // one source, the only healthy replica until then, and a fault on it would leave none
        // (the volume is then unavailable, rightly: the others may hold other outcomes).
        self.heal();
        self.engine_crash_wanted = false;
        self.engine_crashes += 1;
        if std::env::var_os("SIM_TRACE").is_some() {
            let revisions: Vec<u64> = self.replicas.iter().map(|r| r.revision).collect();
            let missing = self.persisted.as_ref().map(|p| p.missing.keys().copied().collect::<Vec<_>>());
            eprintln!("t={} engine crash; persisted {missing:?}, replica revisions {revisions:?}", self.now);
        }
        self.engine = Engine::new(Self::config(), Self::replica_config(), self.persisted.clone(), self.now);
        for r in 0..REPLICAS {
            self.conn[r] = 0;
            self.schedule(1, Wire::Reconnect(r));
        }
    }

    /// The engine dies with client writes in flight: frames already delivered were applied by
    /// their replica, frames still on the wire are lost with the connections, so a write may
    /// have reached some replicas only. The writes' clients never hear back.
    fn crash_engine_in_flight(&mut self) {
        self.outstanding.clear();
        self.heal();
        self.engine_crash_wanted = false;
        self.engine_crashes += 1;
        self.engine = Engine::new(Self::config(), Self::replica_config(), self.persisted.clone(), self.now);
        for r in 0..REPLICAS {
            self.conn[r] = 0;
            self.schedule(1, Wire::Reconnect(r));
        }
    }

    fn heal(&mut self) {
        if let Some((r, _, _)) = self.fault.take() {
            self.replicas[r].up = true;
            self.calm_until = self.now + 2 * TIMEOUT;
        }
    }

    fn maybe_fault(&mut self) {
        match self.fault {
            Some((r, kind, until)) if self.now >= until => {
                self.fault = None;
                self.calm_until = self.now + 2 * TIMEOUT;
                if kind == Fault::Crash {
                    self.replicas[r].up = true;
                }
            }
            None if self.now >= self.calm_until && self.rng.chance(2) && self.engine.healthy_count() >= 2 => {
                let r = self.rng.below(REPLICAS as u64) as usize;
                let kind = [Fault::Lossy, Fault::Partition, Fault::Crash][self.rng.below(3) as usize];
                let until = self.now + 20 + self.rng.below(150);
                self.fault = Some((r, kind, until));
                self.faults += 1;
                if kind == Fault::Crash {
                    let rep = &mut self.replicas[r];
                    rep.volatile.copy_from_slice(&rep.durable);
                    rep.up = false;
                    if self.conn[r] != 0 {
                        self.conn[r] = 0;
                        // The checker knows before the engine does: a crashed replica is behind.
                        self.out[r] = true;
                        self.feed(Event::ReplicaDisconnected(r));
                    }
                }
            }
            _ => {}
        }
    }

    fn run(&mut self, ops: usize) {
        self.run_with_engine_crashes(ops, 0);
    }

    /// `crash_per_mille`: chance per issued request that the engine crashes soon after.
    fn run_with_engine_crashes(&mut self, ops: usize, crash_per_mille: u64) {
        let mut issued = 0;
        while issued < ops {
            self.maybe_fault();
            if self.engine_crash_wanted && self.outstanding.is_empty() {
                self.crash_engine();
            }
            let ready = self.engine.is_attached() && !self.engine_crash_wanted;
            if ready && self.outstanding.len() < 8 && self.rng.chance(60) {
                self.client_op();
                issued += 1;
                self.engine_crash_wanted = self.rng.below(1000) < crash_per_mille;
            }
            self.step();
        }
        if self.engine_crash_wanted {
            while !self.outstanding.is_empty() {
                self.step();
            }
            self.crash_engine();
        }
        self.fault = None;
        self.replicas.iter_mut().for_each(|r| r.up = true);
        for _ in 0..20_000 {
            if self.outstanding.is_empty() && self.engine.healthy_count() == REPLICAS && self.engine.is_idle() {
                break;
            }
            self.step();
        }
        assert_eq!(self.engine.healthy_count(), REPLICAS, "every replica rebuilt after healing");
        assert!(self.outstanding.is_empty(), "every client request answered");
    }

    /// Reads the whole volume through the engine and compares every replica with the model,
    /// head and snapshot views.
    fn verify(&mut self) {
        let size = self.model.len() as u64;
        assert_eq!(self.engine.size(), size, "the engine's size is the acknowledged one");
        let mut offset = 0;
        while offset < size {
            let len = 5000.min(size - offset);
            let want = self.model[offset as usize..(offset + len) as usize].to_vec();
            self.issue(Expect::Read(offset, want), |client| Event::ClientRead { client, offset, len });
            offset += len;
        }
        while !self.outstanding.is_empty() {
            self.step();
        }
        let names: Vec<&str> = self.snapshots.iter().map(|(n, _)| n.as_str()).collect();
        let engine_names: Vec<&str> = self.engine.snapshots().iter().map(|s| s.name.as_str()).collect();
        assert_eq!(engine_names, names, "the engine's chain is the acknowledged one");
        for (i, r) in self.replicas.iter().enumerate() {
            let diff = r.volatile.iter().zip(&self.model).position(|(a, b)| a != b);
            assert!(
                r.volatile == self.model,
                "replica {i} differs from what was acknowledged: len {} vs {}, first difference at {diff:?}",
                r.volatile.len(),
                self.model.len()
            );
            let chain: Vec<&str> = r.chain.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(chain, names, "replica {i}'s snapshot chain");
            for ((name, got), (_, want)) in r.chain.iter().zip(&self.snapshots) {
                let n = got.len().max(want.len());
                let pad = |v: &Vec<u8>| v.iter().copied().chain(std::iter::repeat(0)).take(n).collect::<Vec<u8>>();
                assert!(pad(got) == pad(want), "replica {i}'s view of snapshot {name} differs");
            }
            assert_eq!(r.revision, self.engine.revision(), "replica {i} carries the engine's revision");
        }
        assert!((0..REPLICAS).all(|r| self.engine.missing(r).is_none()), "nothing left to rebuild");
    }
}

#[test]
fn seeded_faults_never_lose_acknowledged_writes_nor_serve_stale_reads() {
    let mut total = Totals::default();
    for seed in 0..200 {
        if std::env::var_os("SIM_TRACE").is_some() {
            eprintln!("seed {seed}");
        }
        let mut w = World::new(seed);
        w.run(300);
        w.verify();
        total.add(&w);
    }
    // The run must actually exercise the interesting paths, not pass vacuously.
    assert!(total.writes > 15_000, "{total:?}");
    assert!(total.faults > 200, "{total:?}");
    assert!(total.rebuilds > 100, "{total:?}");
    assert!(total.deltas * 2 > total.rebuilds, "most rebuilds are deltas: {total:?}");
    assert!(total.unmaps > 1000 && total.resizes > 200, "{total:?}");
    assert!(total.snapshots > 100 && total.deleted > 30 && total.fulls > 0, "{total:?}");
}

#[test]
fn seeded_engine_crashes_restart_from_the_persisted_state_and_lose_nothing() {
    let mut total = Totals::default();
    for seed in 1000..1100 {
        if std::env::var_os("SIM_TRACE").is_some() {
            eprintln!("seed {seed}");
        }
        let mut w = World::new(seed);
        w.run_with_engine_crashes(300, 8);
        w.verify();
        total.add(&w);
    }
    assert!(total.engine_crashes > 100, "{total:?}");
    assert!(total.rebuilds > 50, "{total:?}");
}

/// Counters over many seeded runs, to prove the paths were exercised.
#[derive(Debug, Default)]
struct Totals {
    writes: u64,
    faults: u64,
    rebuilds: u64,
    deltas: u64,
    fulls: u64,
    unmaps: u64,
    resizes: u64,
    snapshots: u64,
    deleted: u64,
    engine_crashes: u64,
}

impl Totals {
    fn add(&mut self, w: &World) {
        self.writes += w.acked_writes;
        self.faults += w.faults;
        self.rebuilds += w.rebuilds;
        self.deltas += w.delta_rebuilds;
        self.fulls += w.full_rebuilds;
        self.unmaps += w.unmaps;
        self.resizes += w.resizes;
        self.snapshots += w.snapshots_taken;
        self.deleted += w.snapshots_deleted;
        self.engine_crashes += w.engine_crashes;
    }
}

/// Runs the fault-free client workload for `steps` milliseconds.
fn drive(w: &mut World, steps: usize) {
    for _ in 0..steps {
        if w.engine.is_attached() && w.outstanding.len() < 8 {
            w.client_op();
        }
        w.step();
    }
}

fn settle(w: &mut World) {
    while !w.outstanding.is_empty() {
        w.step();
    }
}

/// A quiet period: two flushes with no write between them, the second after the intent map's
/// linger time, empty the engine's intent map (the first covers the writes, the second shows no
/// write touched anything for a whole interval and long enough).
fn quiesce(w: &mut World) {
    for round in 0..2 {
        if round == 1 {
            for _ in 0..=crate::engine::INTENT_LINGER {
                w.step();
            }
        }
        w.issue(Expect::Flush, |client| Event::ClientFlush { client });
        settle(w);
    }
    let intent = w.persisted.as_ref().and_then(|p| p.intent.as_ref()).map(|m| m.count());
    assert!(intent.is_none_or(|n| n == 0) || w.engine.healthy_count() < REPLICAS, "intent map cleared: {intent:?}");
}

#[test]
fn rebuild_resumes_after_an_engine_crash_instead_of_starting_from_zero() {
    let mut w = World::new(11);
    w.run(0);
    // Replica 2 crashes and misses writes to every region, so it lacks the whole volume.
    w.replicas[2].up = false;
    w.conn[2] = 0;
    w.out[2] = true;
    w.feed(Event::ReplicaDisconnected(2));
    let size = w.model.len() as u64;
    let mut offset = 0;
    while offset < size {
        let len = REGION.min(size - offset);
        let data = vec![0x5a; len as usize];
        w.model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
        w.issue(Expect::Write, |client| Event::ClientWrite { client, offset, data: data.into() });
        offset += len;
    }
    settle(&mut w);
    // The writes are flushed and the volume quiet, so the crash below leaves no write in flight:
    // the resync after it has nothing to add and the resumed rebuild is all that runs.
    quiesce(&mut w);
    let regions = w.engine.missing(2).expect("replica 2 is out of sync").count();
    assert_eq!(regions, size.div_ceil(REGION), "replica 2 lacks every region");
    // It comes back; once the rebuild has made a third of the regions durable the engine dies.
    w.replicas[2].up = true;
    while w.engine.missing(2).is_some_and(|m| m.count() > regions * 2 / 3) {
        w.step();
    }
    w.crash_engine();
    w.run(0);
    w.verify();
    let resumed: Vec<u64> = w.started.iter().filter(|(r, ..)| *r == 2).map(|(.., n)| *n).collect();
    assert_eq!(resumed.len(), 2, "one rebuild before the crash, one after: {:?}", w.started);
    assert_eq!(resumed[0], regions);
    assert!(resumed[1] < regions * 2 / 3 + 1, "the resumed rebuild copies only what is left: {resumed:?}");
}

#[test]
fn replica_that_missed_a_snapshot_gets_a_full_snapshot_aware_rebuild() {
    let mut w = World::new(12);
    w.run(0);
    drive(&mut w, 100);
    settle(&mut w);
    let view = w.model.clone();
    w.issue(Expect::Snapshot("first".into(), view), |client| Event::ClientSnapshot {
        client,
        name: "first".into(),
        created_ns: 1,
    });
    settle(&mut w);
    drive(&mut w, 100);
    settle(&mut w);
    // Replica 1 is cut off while the second snapshot is taken: it never gets it.
    w.fault = Some((1, Fault::Partition, u64::MAX));
    let view = w.model.clone();
    w.issue(Expect::Snapshot("second".into(), view), |client| Event::ClientSnapshot {
        client,
        name: "second".into(),
        created_ns: 2,
    });
    settle(&mut w);
    assert!(w.snapshots.iter().any(|(n, _)| n == "second"), "recorded: every healthy replica has it");
    assert!(!w.replicas[1].chain.iter().any(|(n, _)| n == "second"));
    drive(&mut w, 100);
    w.fault = None;
    w.run(0);
    w.verify();
    assert!(w.full_rebuilds >= 1, "{:?}", w.started);
}

#[test]
fn replica_that_missed_a_resize_is_grown_by_its_rebuild() {
    let mut w = World::new(13);
    w.run(0);
    w.replicas[0].up = false;
    w.conn[0] = 0;
    w.out[0] = true;
    w.feed(Event::ReplicaDisconnected(0));
    let size = SIZE + 3 * REGION + 17;
    w.issue(Expect::Resize(size), |client| Event::ClientResize { client, size });
    settle(&mut w);
    drive(&mut w, 200);
    w.replicas[0].up = true;
    w.run(0);
    w.verify();
    assert!(w.replicas[0].volatile.len() as u64 >= size);
}

#[test]
fn fault_free_run_keeps_every_replica_identical() {
    let mut w = World::new(7);
    // Drives the client directly instead of `run`'s loop, so no fault is ever injected.
    w.run(0);
    for _ in 0..200 {
        if w.outstanding.len() < 8 {
            w.client_op();
        }
        w.step();
    }
    w.run(0);
    w.verify();
    assert_eq!(w.rebuilds, 0);
}

/// One write cut off by an engine crash: where, what the range held before, what was written,
/// and whether the client heard back before the crash.
struct Interrupted {
    offset: usize,
    old: Vec<u8>,
    new: Vec<u8>,
    acked: bool,
}

/// Issues writes to disjoint ranges, lets the network carry them for `steps` milliseconds (each
/// frame takes 0–4), then crashes the engine: some writes reached some replicas only.
fn crash_with_writes_in_flight(w: &mut World, steps: u64) -> Vec<(u64, Interrupted)> {
    let size = w.model.len() as u64;
    let slots = 6;
    let slot = size / slots;
    let mut writes = Vec::new();
    for i in 0..slots {
        let offset = i * slot + w.rng.below(slot / 2);
        let len = 1 + w.rng.below(slot / 2);
        let data: Vec<u8> = (0..len).map(|_| w.rng.next() as u8).collect();
        let range = offset as usize..(offset + len) as usize;
        let old = w.model[range.clone()].to_vec();
        w.model[range].copy_from_slice(&data);
        let client = w.next_client;
        w.issue(Expect::Write, |client| Event::ClientWrite { client, offset, data: data.clone().into() });
        writes.push((client, Interrupted { offset: offset as usize, old, new: data, acked: false }));
    }
    for _ in 0..steps {
        w.step();
    }
    for (client, write) in &mut writes {
        write.acked = !w.outstanding.contains_key(client);
    }
    w.crash_engine_in_flight();
    writes
}

/// True when the replicas disagree somewhere in the written ranges.
fn diverged(w: &World, writes: &[(u64, Interrupted)]) -> bool {
    writes.iter().any(|(_, i)| {
        let range = i.offset..i.offset + i.new.len();
        w.replicas.iter().any(|r| r.volatile[range.clone()] != w.replicas[0].volatile[range.clone()])
    })
}

/// After re-attach and settling: every replica holds the same bytes everywhere, each interrupted
/// write's range holds its old or its new content (the new one if it was acknowledged), and
/// reading the whole volume through the engine returns that content from whichever replica.
fn check_resolved(w: &mut World, writes: &[(u64, Interrupted)]) {
    let reference = w.replicas[0].volatile.clone();
    for (r, rep) in w.replicas.iter().enumerate() {
        let diff = rep.volatile.iter().zip(&reference).position(|(a, b)| a != b);
        assert!(rep.volatile == reference, "replica {r} differs from replica 0 after the resync at {diff:?}");
    }
    for (_, i) in writes {
        let got = &reference[i.offset..i.offset + i.new.len()];
        assert!(got == i.new.as_slice() || (!i.acked && got == i.old.as_slice()), "write at {} is torn", i.offset);
    }
    // Every later read, from any replica, must see exactly this outcome.
    w.model = reference;
    w.verify();
    w.verify();
}

#[test]
fn engine_crash_with_writes_in_flight_leaves_every_block_reading_one_outcome() {
    let (mut divergent, mut full, mut delta) = (0, 0, 0);
    for seed in 2000..2060 {
        let mut w = World::new(seed);
        w.run(0);
        drive(&mut w, 100);
        settle(&mut w);
        // Half the runs crash on a quiet volume (only the in-flight writes are suspect), half
        // right after the workload, with the intent map partly cleared by its flushes.
        let quiet = seed % 2 == 1;
        if quiet {
            quiesce(&mut w);
        }
        // Every fourth run also loses the state file: nothing says which regions are suspect.
        let lost_state = seed % 4 == 0;
        let steps = 1 + w.rng.below(5);
        let before = w.started.len();
        let writes = crash_with_writes_in_flight(&mut w, steps);
        if lost_state {
            w.persisted = None;
            w.engine = Engine::new(World::config(), World::replica_config(), None, w.now);
        }
        divergent += u64::from(diverged(&w, &writes));
        w.run(0);
        let regions = (w.model.len() as u64).div_ceil(REGION);
        for (_, kind, n) in &w.started[before..] {
            assert_eq!(*kind, RebuildKind::Delta, "the chains agree");
            if lost_state {
                assert_eq!(*n, regions, "without a state file everything is suspect");
                full += 1;
            } else {
                assert!(!quiet || *n < regions, "only the intent map's regions are resynced: {n} of {regions}");
                delta += 1;
            }
        }
        check_resolved(&mut w, &writes);
    }
    assert!(divergent > 10, "crashes must leave replicas diverged for the test to mean anything: {divergent}");
    assert!(full > 0 && delta > 0, "{full} full, {delta} delta resyncs");
}
