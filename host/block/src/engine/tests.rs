//! Unit tests of the engine: one scenario per rule, driven by hand-made replica replies.

use super::*;
use std::collections::BTreeSet;

const SIZE: u64 = 1 << 20;

fn config() -> EngineConfig {
    EngineConfig {
        volume_id: "vol".into(),
        size: SIZE,
        region_size: 64 * 1024,
        request_timeout: 100,
        attach_timeout: 1000,
        rebuild_parallelism: 4,
        epoch: 0,
    }
}

/// One replica per entry of `locals`, local where it says so.
fn replicas(locals: &[bool]) -> Vec<ReplicaConfig> {
    locals
        .iter()
        .map(|l| ReplicaConfig { local: *l, disk: crate::protocol::DEFAULT_DISK.into(), identity: String::new() })
        .collect()
}

fn header(revision: u64) -> ReplicaHeader {
    ReplicaHeader { volume_id: "vol".into(), size: SIZE, revision, snapshots: vec![], dirty: false }
}

fn sends(actions: &[Action]) -> Vec<(ReplicaId, Frame)> {
    actions
        .iter()
        .filter_map(|a| if let Action::Send { replica, frame } = a { Some((*replica, frame.clone())) } else { None })
        .collect()
}

fn ok(id: u64) -> Frame {
    Frame { request_id: id, message: Message::Reply { status: Status::Ok } }
}

/// Attaches an engine whose replicas report the given revisions.
fn attached(locals: &[bool], revisions: &[u64]) -> (Engine, Vec<Action>) {
    let mut e = Engine::new(config(), replicas(locals), None, 0);
    let mut out = Vec::new();
    for (r, rev) in revisions.iter().enumerate() {
        let hello = sends(&e.handle(0, Event::ReplicaConnected(r)));
        let reply = Message::HelloReply { status: Status::Ok, header: header(*rev) };
        out = e.handle(0, Event::Received(r, Frame { request_id: hello[0].1.request_id, message: reply }));
    }
    assert!(e.is_attached());
    // The flush every attach starts (writes of a previous engine may be unflushed) succeeds.
    let (flushes, rest): (Vec<Action>, Vec<Action>) =
        out.into_iter().partition(|a| matches!(a, Action::Send { frame: Frame { message: Message::Flush, .. }, .. }));
    for (r, f) in sends(&flushes) {
        assert!(e.handle(0, Event::Received(r, ok(f.request_id))).is_empty());
    }
    (e, rest)
}

#[test]
fn write_is_acknowledged_only_after_every_healthy_replica_acknowledged() {
    let (mut e, _) = attached(&[false, false], &[3, 3]);
    let out = sends(&e.handle(1, Event::ClientWrite { client: 9, offset: 0, data: vec![1; 512].into() }));
    assert_eq!(out.len(), 2, "fans out to both replicas");
    assert!(e.handle(2, Event::Received(out[0].0, ok(out[0].1.request_id))).is_empty());
    let done = e.handle(3, Event::Received(out[1].0, ok(out[1].1.request_id)));
    assert_eq!(done, vec![Action::Reply { client: 9, result: Ok(ClientReply::Written) }]);
}

#[test]
fn failed_replica_is_dropped_and_writes_continue_degraded_with_the_region_marked_dirty() {
    let (mut e, _) = attached(&[false, false], &[3, 3]);
    let out = sends(&e.handle(1, Event::ClientWrite { client: 1, offset: 0, data: vec![1; 512].into() }));
    e.handle(2, Event::Received(0, ok(out[0].1.request_id)));
    // Replica 1 never answers: the timeout drops it and the write completes on replica 0.
    let actions = e.handle(200, Event::Tick);
    assert!(matches!(actions[0], Action::ReplicaFailed { replica: 1, reason: FailReason::Timeout { .. } }));
    let persist = actions.iter().position(|a| matches!(a, Action::Persist(_)));
    let reply = actions.iter().position(|a| matches!(a, Action::Reply { result: Ok(_), .. }));
    assert!(persist < reply, "the dirty map is persisted before the client hears of the write");
    assert!(e.missing(1).expect("out of sync").is_marked(0));
    assert_eq!(e.revision(), 4, "a replica set change bumps the revision");
    // The new revision reaches the healthy replica before any further write.
    let sync = sends(&actions);
    assert_eq!(
        sync,
        vec![(0, Frame { request_id: sync[0].1.request_id, message: Message::SetRevision { revision: 4 } })]
    );
    let queued = e.handle(201, Event::ClientWrite { client: 2, offset: 1 << 19, data: vec![2; 10].into() });
    assert!(sends(&queued).is_empty(), "writes wait for the revision to be recorded");
    let released = sends(&e.handle(202, Event::Received(0, ok(sync[0].1.request_id))));
    assert_eq!(released.len(), 1);
    assert!(matches!(released[0].1.message, Message::Write { revision: 4, .. }));
    assert!(e.missing(1).expect("out of sync").is_marked(8), "degraded writes are tracked for the delta rebuild");
}

#[test]
fn client_io_fails_when_no_healthy_replica_remains() {
    let (mut e, _) = attached(&[false], &[1]);
    e.handle(1, Event::ReplicaDisconnected(0));
    let read = e.handle(2, Event::ClientRead { client: 5, offset: 0, len: 10 });
    assert!(matches!(&read[..], [Action::Reply { client: 5, result: Err(IoError::NoHealthyReplica { .. }) }]));
    let write = e.handle(3, Event::ClientWrite { client: 6, offset: 0, data: vec![0; 4].into() });
    assert!(matches!(&write[..], [Action::Reply { client: 6, result: Err(IoError::NoHealthyReplica { .. }) }]));
}

#[test]
fn reads_go_to_the_local_replica_when_it_is_healthy() {
    let (mut e, _) = attached(&[false, true, false], &[1, 1, 1]);
    for c in 0..5 {
        let out = sends(&e.handle(1, Event::ClientRead { client: c, offset: c * 100, len: 10 }));
        assert_eq!(out[0].0, 1);
    }
}

#[test]
fn reads_spread_round_robin_without_a_local_replica() {
    let (mut e, _) = attached(&[false, false], &[1, 1]);
    let targets: BTreeSet<ReplicaId> =
        (0..4).map(|c| sends(&e.handle(1, Event::ClientRead { client: c, offset: c * 100, len: 10 }))[0].0).collect();
    assert_eq!(targets.len(), 2);
}

#[test]
fn replica_behind_at_attach_is_never_read_and_gets_a_full_rebuild_from_a_current_one() {
    let (mut e, attach) = attached(&[true, false], &[2, 5]);
    assert!(!e.is_healthy(0) && e.is_healthy(1));
    let sync = sends(&attach);
    assert_eq!(sync.len(), 1, "only the current replica learns the new revision");
    let after = e.handle(1, Event::Received(1, ok(sync[0].1.request_id)));
    assert!(after.contains(&Action::RebuildStarted { replica: 0, source: 1, kind: RebuildKind::Delta, regions: 16 }));
    for (r, f) in sends(&after) {
        assert_eq!(r, 1, "copies read from the current replica only: {f:?}");
        assert!(matches!(f.message, Message::ReadExtent { revision: 6, .. }));
    }
    // Even though replica 0 is local, reads avoid it while it is behind.
    let read = sends(&e.handle(2, Event::ClientRead { client: 1, offset: SIZE - 10, len: 10 }));
    assert_eq!(read[0].0, 1);
}

#[test]
fn replica_whose_revision_is_ahead_of_the_engine_is_refused() {
    let (mut e, _) = attached(&[false, false], &[3, 3]);
    e.handle(1, Event::ReplicaDisconnected(1));
    let hello = sends(&e.handle(2, Event::ReplicaConnected(1)));
    let reply = Message::HelloReply { status: Status::Ok, header: header(99) };
    let out = e.handle(3, Event::Received(1, Frame { request_id: hello[0].1.request_id, message: reply }));
    assert!(matches!(out[0], Action::ReplicaFailed { replica: 1, reason: FailReason::RevisionAhead { .. } }));
}

#[test]
fn out_of_range_and_oversized_requests_are_refused_without_touching_replicas() {
    let (mut e, _) = attached(&[false], &[1]);
    let out = e.handle(1, Event::ClientRead { client: 1, offset: SIZE - 1, len: 2 });
    assert!(matches!(&out[..], [Action::Reply { result: Err(IoError::OutOfRange { .. }), .. }]));
    let out = e.handle(1, Event::ClientRead { client: 2, offset: 0, len: MAX_IO + 1 });
    assert!(matches!(&out[..], [Action::Reply { result: Err(IoError::TooLarge { max: MAX_IO, .. }), .. }]));
}

/// Disconnects `r` and acknowledges the revision sync that follows on the others.
fn drop_replica(e: &mut Engine, r: ReplicaId) {
    for (to, f) in sends(&e.handle(1, Event::ReplicaDisconnected(r))) {
        e.handle(1, Event::Received(to, ok(f.request_id)));
    }
}

#[test]
fn unmap_fans_out_like_a_write_and_is_tracked_for_a_replica_that_is_down() {
    let (mut e, _) = attached(&[false, false, false], &[3, 3, 3]);
    drop_replica(&mut e, 2);
    let out = sends(&e.handle(4, Event::ClientUnmap { client: 7, offset: 3 << 16, len: 2 << 16 }));
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|(_, f)| matches!(f.message, Message::Unmap { offset: 196_608, len: 131_072, .. })));
    assert!(e.missing(2).expect("out of sync").is_marked(4));
    e.handle(5, Event::Received(out[0].0, ok(out[0].1.request_id)));
    let done = e.handle(6, Event::Received(out[1].0, ok(out[1].1.request_id)));
    assert_eq!(done, vec![Action::Reply { client: 7, result: Ok(ClientReply::Unmapped) }]);
    let big = e.handle(7, Event::ClientUnmap { client: 8, offset: 0, len: MAX_UNMAP + 1 });
    assert!(matches!(&big[..], [Action::Reply { result: Err(IoError::TooLarge { max: MAX_UNMAP, .. }), .. }]));
}

#[test]
fn snapshots_need_every_replica_healthy_and_resize_never_shrinks() {
    let (mut e, _) = attached(&[false, false], &[3, 3]);
    let snap = sends(&e.handle(1, Event::ClientSnapshot { client: 1, name: "a".into(), created_ns: 9 }));
    assert_eq!(snap.len(), 2);
    e.handle(2, Event::Received(snap[0].0, ok(snap[0].1.request_id)));
    let exists = Frame { request_id: snap[1].1.request_id, message: Message::Reply { status: Status::AlreadyExists } };
    let done = e.handle(3, Event::Received(snap[1].0, exists));
    assert_eq!(done, vec![Action::Reply { client: 1, result: Ok(ClientReply::SnapshotTaken) }]);
    assert_eq!(e.snapshots().iter().map(|s| s.name.as_str()).collect::<Vec<_>>(), vec!["a"]);
    let shrink = e.handle(4, Event::ClientResize { client: 2, size: SIZE - 1 });
    assert!(matches!(&shrink[..], [Action::Reply { result: Err(IoError::Shrink { .. }), .. }]));
    drop_replica(&mut e, 1);
    let refused = e.handle(6, Event::ClientDeleteSnapshot { client: 3, name: "a".into() });
    assert!(matches!(&refused[..], [.., Action::Reply { client: 3, result: Err(IoError::Degraded { .. }) }]));
}

#[test]
fn resize_waits_for_writes_in_flight_and_grows_the_missing_maps_keeping_marks() {
    let (mut e, _) = attached(&[false, false, false], &[3, 3, 3]);
    drop_replica(&mut e, 2);
    let write = sends(&e.handle(4, Event::ClientWrite { client: 1, offset: 0, data: vec![1; 10].into() }));
    let held = e.handle(5, Event::ClientResize { client: 2, size: 2 * SIZE });
    assert!(sends(&held).is_empty(), "the resize waits for the write");
    e.handle(6, Event::Received(write[0].0, ok(write[0].1.request_id)));
    let resize = sends(&e.handle(7, Event::Received(write[1].0, ok(write[1].1.request_id))));
    assert!(resize.iter().all(|(_, f)| matches!(f.message, Message::Resize { size, .. } if size == 2 * SIZE)));
    e.handle(8, Event::Received(resize[0].0, ok(resize[0].1.request_id)));
    let done = e.handle(9, Event::Received(resize[1].0, ok(resize[1].1.request_id)));
    assert!(done.contains(&Action::Reply { client: 2, result: Ok(ClientReply::Resized) }));
    assert_eq!(e.size(), 2 * SIZE);
    let map = e.missing(2).expect("out of sync");
    assert_eq!(map.regions(), 32);
    assert!(map.is_marked(0) && !map.is_marked(31));
}

/// The write path's cost of the intent map: persists per 10k random 4 KiB writes over a 1 GiB
/// volume with 1 MiB regions and a flush every 100 writes, with replicas answering at once.
/// Printed for the record (`--nocapture`); the clock advances 1 ms per request, so the 10 s run
/// spans two intent linger intervals.
#[test]
fn intent_map_persists_per_random_write_workload() {
    let mut cfg = config();
    cfg.size = 1 << 30;
    cfg.region_size = 1 << 20;
    let run = |hot: u64| {
        let mut e = Engine::new(cfg.clone(), replicas(&[true, false]), None, 0);
        let mut pending = Vec::new();
        for r in 0..2 {
            let hello = sends(&e.handle(0, Event::ReplicaConnected(r)));
            let h = ReplicaHeader { size: 1 << 30, ..header(1) };
            let reply = Message::HelloReply { status: Status::Ok, header: h };
            pending
                .extend(e.handle(0, Event::Received(r, Frame { request_id: hello[0].1.request_id, message: reply })));
        }
        let mut rng = crate::testutil::Rng::new(42);
        let mut persists = 0;
        for i in 0..10_000u64 {
            let offset = rng.below(hot / 4096) * 4096;
            let event = if i % 100 == 99 {
                Event::ClientFlush { client: i }
            } else {
                Event::ClientWrite { client: i, offset, data: vec![1; 4096].into() }
            };
            pending.extend(e.handle(i, event));
            // Every request is answered before the next: the replicas are instant.
            while !pending.is_empty() {
                let batch = std::mem::take(&mut pending);
                persists += batch.iter().filter(|a| matches!(a, Action::Persist(_))).count();
                for (r, f) in sends(&batch) {
                    pending.extend(e.handle(i, Event::Received(r, ok(f.request_id))));
                }
            }
        }
        persists
    };
    let (whole, hot) = (run(1 << 30), run(64 << 20));
    println!("persists per 10k random 4k writes, flush every 100: over 1 GiB {whole}, over a 64 MiB hot set {hot}");
    // About one persist per region first touched, plus one per linger interval and region.
    assert!(whole < 2_000 && hot < 200, "{whole} {hot}");
}

/// Connects replica `r` of an engine with an epoch: `Hello`, then the claim it sends.
fn hello_and_claim(e: &mut Engine, r: ReplicaId, revision: u64) -> (u64, Vec<Action>) {
    let hello = sends(&e.handle(0, Event::ReplicaConnected(r)));
    let reply = Message::HelloReply { status: Status::Ok, header: header(revision) };
    let claim = sends(&e.handle(0, Event::Received(r, Frame { request_id: hello[0].1.request_id, message: reply })));
    assert_eq!(claim.len(), 1);
    assert_eq!(claim[0].1.message, Message::Claim { epoch: e.cfg.epoch }, "the claim follows Hello at once");
    (claim[0].1.request_id, claim.iter().map(|(r, f)| Action::Send { replica: *r, frame: f.clone() }).collect())
}

#[test]
fn an_engine_with_an_epoch_attaches_a_replica_only_after_its_claim_succeeded() {
    let mut e = Engine::new(EngineConfig { epoch: 7, ..config() }, replicas(&[false, false]), None, 0);
    let (claim0, _) = hello_and_claim(&mut e, 0, 3);
    assert!(!e.is_attached());
    e.handle(0, Event::Received(0, ok(claim0)));
    assert!(!e.is_attached(), "waits for the other replica's claim");
    let (claim1, _) = hello_and_claim(&mut e, 1, 3);
    e.handle(0, Event::Received(1, ok(claim1)));
    assert!(e.is_attached() && e.healthy_count() == 2 && !e.is_fenced());
}

#[test]
fn a_fenced_claim_fences_the_whole_engine_and_every_request_fails() {
    let mut e = Engine::new(EngineConfig { epoch: 7, ..config() }, replicas(&[true, false]), None, 0);
    let (claim0, _) = hello_and_claim(&mut e, 0, 3);
    e.handle(0, Event::Received(0, ok(claim0)));
    let (claim1, _) = hello_and_claim(&mut e, 1, 3);
    let fenced = Frame { request_id: claim1, message: Message::Reply { status: Status::Fenced } };
    let out = e.handle(1, Event::Received(1, fenced));
    assert!(e.is_fenced());
    assert!(out.iter().any(|a| matches!(a, Action::ReplicaFailed { replica: 0, reason: FailReason::Fenced })));
    assert_eq!(e.healthy_count(), 0, "not even the replica whose claim succeeded serves");
    let write = e.handle(2, Event::ClientWrite { client: 4, offset: 0, data: vec![0; 4].into() });
    assert!(matches!(&write[..], [Action::Reply { client: 4, result: Err(IoError::Fenced { .. }) }]), "{write:?}");
    let read = e.handle(3, Event::ClientRead { client: 5, offset: 0, len: 4 });
    assert!(matches!(&read[..], [Action::Reply { client: 5, result: Err(IoError::Fenced { .. }) }]), "{read:?}");
    let again = e.handle(4, Event::ReplicaConnected(1));
    assert!(sends(&again).is_empty(), "a fenced engine never says Hello again");
}

#[test]
fn a_write_refused_as_fenced_fails_it_and_everything_after_it() {
    let (mut e, _) = attached(&[true, false], &[3, 3]);
    let out = sends(&e.handle(1, Event::ClientWrite { client: 1, offset: 0, data: vec![1; 512].into() }));
    // The local replica took it; the remote one says another engine holds the volume.
    assert!(e.handle(2, Event::Received(out[0].0, ok(out[0].1.request_id))).is_empty());
    let refused = Frame { request_id: out[1].1.request_id, message: Message::Reply { status: Status::Fenced } };
    let actions = e.handle(3, Event::Received(out[1].0, refused));
    let reply =
        actions.iter().find_map(|a| if let Action::Reply { client: 1, result } = a { Some(result) } else { None });
    assert!(matches!(reply, Some(Err(IoError::Fenced { .. }))), "{actions:?}");
    assert!(e.is_fenced() && e.healthy_count() == 0);
    let later = e.handle(4, Event::ClientFlush { client: 2 });
    assert!(matches!(&later[..], [Action::Reply { client: 2, result: Err(IoError::Fenced { .. }) }]), "{later:?}");
}

/// The revision an engine sends in its first `SetRevision`, acknowledging it on every replica.
fn first_revision_sync(e: &mut Engine, actions: &[Action]) -> u64 {
    let mut synced = None;
    for (r, f) in sends(actions) {
        if let Message::SetRevision { revision } = f.message {
            synced = Some(revision);
            e.handle(2, Event::Received(r, ok(f.request_id)));
        }
    }
    synced.expect("a revision sync")
}

/// Split brain, as the engine sees it: the engine of epoch 6 was cut off with its own replica
/// and, while the CO moved the volume on, kept counting revisions on that replica alone
/// (replica 0 at 10). The engine of epoch 7 attached the two others (at 8). Whatever the old
/// engine counted, the new engine's revisions must be above it, or the next engine would take
/// the cut-off replica as the only current one and rebuild the others from it: the writes made
/// after the move would be lost.
#[test]
fn revisions_of_a_newer_epoch_are_above_any_an_older_epoch_counted() {
    let mut e7 = Engine::new(EngineConfig { epoch: 7, ..config() }, replicas(&[false, false, false]), None, 0);
    for r in [1, 2] {
        let (claim, _) = hello_and_claim(&mut e7, r, 8);
        e7.handle(0, Event::Received(r, ok(claim)));
    }
    // Replica 0 never answers: the attach finishes without it.
    let out = e7.handle(1000, Event::Tick);
    assert!(e7.is_attached() && !e7.is_healthy(0));
    let ours = first_revision_sync(&mut e7, &out);
    assert!(ours > 10 && ours >> EPOCH_REVISION_BITS == 7, "epoch 7 counts from 7 << 32: {ours}");

    // Even with every replica current at attach, an engine moves them into its epoch's range:
    // otherwise an older engine cut off with one of them could count past them.
    let mut e9 = Engine::new(EngineConfig { epoch: 9, ..config() }, replicas(&[false, false]), None, 0);
    let mut out = Vec::new();
    for r in [0, 1] {
        let (claim, _) = hello_and_claim(&mut e9, r, ours);
        out = e9.handle(0, Event::Received(r, ok(claim)));
    }
    assert!(e9.is_attached() && e9.healthy_count() == 2);
    for (r, f) in sends(&out) {
        if matches!(f.message, Message::Flush) {
            e9.handle(1, Event::Received(r, ok(f.request_id)));
        }
    }
    let write = e9.handle(1, Event::ClientWrite { client: 1, offset: 0, data: vec![1; 512].into() });
    let both: Vec<Action> = out.into_iter().chain(write).collect();
    assert_eq!(first_revision_sync(&mut e9, &both), 9 << EPOCH_REVISION_BITS, "before its first write");

    // The next engine sees replica 0 (counted to 10 by epoch 6) as behind.
    let mut next = Engine::new(EngineConfig { epoch: 11, ..config() }, replicas(&[false, false, false]), None, 0);
    for (r, rev) in [(0, 10), (1, ours), (2, ours)] {
        let (claim, _) = hello_and_claim(&mut next, r, rev);
        next.handle(0, Event::Received(r, ok(claim)));
    }
    assert!(!next.is_healthy(0) && next.is_healthy(1) && next.is_healthy(2), "the cut-off replica is behind");
}

fn named(names: &[&str]) -> Vec<ReplicaConfig> {
    names
        .iter()
        .map(|n| ReplicaConfig { local: false, disk: crate::protocol::DEFAULT_DISK.into(), identity: (*n).into() })
        .collect()
}

fn persisted_of(actions: &[Action]) -> Option<PersistedState> {
    actions.iter().rev().find_map(|a| if let Action::Persist(p) = a { Some(p.clone()) } else { None })
}

#[test]
fn a_replica_added_while_attached_lacks_everything_persisted_first_and_becomes_a_rebuild_target() {
    let (mut e, _) = attached(&[false, false], &[3, 3]);
    let added = ReplicaConfig { local: false, disk: "ssd".into(), identity: "c/ssd".into() };
    let out = e.handle(1, Event::ReplicaAdded(added));
    assert_eq!(e.configured(), 3);
    let state = persisted_of(&out).expect("persisted before it connects");
    assert_eq!(state.missing.get(&2).map(|m| m.count()), Some(SIZE.div_ceil(64 * 1024)), "it lacks every region");
    assert_eq!(state.members[2], "c/ssd");
    // It connects and says hello with an empty header: stale, never read from.
    let hello = sends(&e.handle(2, Event::ReplicaConnected(2)));
    assert!(matches!(&hello[0].1.message, Message::Hello { disk, .. } if disk == "ssd"));
    let reply = Message::HelloReply { status: Status::Ok, header: header(0) };
    let out = e.handle(3, Event::Received(2, Frame { request_id: hello[0].1.request_id, message: reply }));
    assert_eq!(e.health(2), ReplicaHealth::Rebuilding, "rebuilt at once: {out:?}");
    assert!(out.iter().any(|a| matches!(a, Action::RebuildStarted { replica: 2, .. })), "{out:?}");
    for c in 0..4 {
        let reads = sends(&e.handle(4, Event::ClientRead { client: c, offset: c * 100, len: 10 }));
        assert!(reads.iter().all(|(r, _)| *r != 2), "never read from while rebuilt");
    }
    // It counts for the whole set (snapshots wait for it) but not as healthy yet.
    assert_eq!((e.configured(), e.healthy_count()), (3, 2));
}

#[test]
fn a_removed_replica_is_never_written_counted_or_reconnected_and_leaves_the_persisted_members() {
    let mut e = Engine::new(config(), named(&["a/default", "b/default", "c/default"]), None, 0);
    let mut out = Vec::new();
    for r in 0..3 {
        let hello = sends(&e.handle(0, Event::ReplicaConnected(r)));
        let reply = Message::HelloReply { status: Status::Ok, header: header(3) };
        out = e.handle(0, Event::Received(r, Frame { request_id: hello[0].1.request_id, message: reply }));
    }
    for (r, f) in sends(&out) {
        e.handle(0, Event::Received(r, ok(f.request_id)));
    }
    let out = e.handle(1, Event::ReplicaRemoved(1));
    assert!(out.iter().any(|a| matches!(a, Action::ReplicaFailed { replica: 1, reason: FailReason::Removed })));
    assert!(e.is_retired(1) && e.configured() == 2 && e.healthy_count() == 2);
    let state = persisted_of(&out).expect("persisted");
    assert_eq!(state.members, ["a/default", "", "c/default"], "a retired index names no one");
    assert!(!state.missing.contains_key(&1));
    assert!(e.revision() > 3, "a healthy replica left: the others move on without it");
    // The revision reaches the two that are left, then writes go to them only.
    for (r, f) in sends(&out) {
        assert_ne!(r, 1);
        e.handle(2, Event::Received(r, ok(f.request_id)));
    }
    let writes = sends(&e.handle(3, Event::ClientWrite { client: 5, offset: 0, data: vec![1; 512].into() }));
    assert_eq!(writes.iter().map(|(r, _)| *r).collect::<Vec<_>>(), vec![0, 2]);
    // A late connection of the removed one is ignored; a snapshot needs only the two.
    assert!(sends(&e.handle(4, Event::ReplicaConnected(1))).is_empty());
    for (r, f) in &writes {
        e.handle(5, Event::Received(*r, ok(f.request_id)));
    }
    let snap = sends(&e.handle(6, Event::ClientSnapshot { client: 9, name: "s".into(), created_ns: 1 }));
    assert_eq!(snap.iter().map(|(r, _)| *r).collect::<Vec<_>>(), vec![0, 2]);
}

#[test]
fn a_persisted_map_follows_its_replica_to_a_new_index_and_a_removed_ones_is_dropped() {
    let mut lacks = DirtyMap::new(SIZE, 64 * 1024).expect("map");
    lacks.mark(0, 1);
    let persisted = PersistedState {
        revision: 5,
        size: SIZE,
        missing: BTreeMap::from([(0, full_map(SIZE, 64 * 1024)), (2, lacks.clone())]),
        intent: None,
        members: vec!["a/default".into(), "b/default".into(), "c/default".into()],
    };
    // `a` was removed, a new `d` added: c's map moves from index 2 to 1; a's goes with it.
    let e = Engine::new(config(), named(&["b/default", "c/default", "d/default"]), Some(persisted.clone()), 0);
    assert!(e.missing(0).is_none(), "b was in sync");
    assert_eq!(e.missing(1), Some(&lacks));
    assert!(e.missing(2).is_none(), "d: decided by its header (an empty one lacks everything)");
    // A state file without identities keeps the indices.
    let old = PersistedState { members: vec![], ..persisted };
    let e = Engine::new(config(), named(&["b/default", "c/default", "d/default"]), Some(old), 0);
    assert_eq!(e.missing(2), Some(&lacks));
}

#[test]
fn an_empty_replica_where_a_map_was_kept_for_its_index_is_rebuilt_in_full() {
    // Index 1 lacked one region when this node last ran the volume; it was replaced (detached)
    // by an empty replica since: the map said nothing about the new one.
    let mut lacks = DirtyMap::new(SIZE, 64 * 1024).expect("map");
    lacks.mark(0, 1);
    let persisted = PersistedState {
        revision: 7,
        size: SIZE,
        missing: BTreeMap::from([(1, lacks)]),
        intent: None,
        members: vec![],
    };
    let epoch = EngineConfig { epoch: 1, ..config() };
    let member = 1 << EPOCH_REVISION_BITS;
    let mut e = Engine::new(epoch.clone(), replicas(&[false, false]), Some(persisted.clone()), 0);
    for (r, rev) in [(0, member + 8), (1, 0)] {
        let (claim, _) = hello_and_claim(&mut e, r, rev);
        e.handle(0, Event::Received(r, ok(claim)));
    }
    assert!(e.is_attached());
    assert_eq!(e.missing(1).map(|m| m.count()), Some(SIZE.div_ceil(64 * 1024)), "everything, not the kept map");
    // A replica at a member's revision keeps its map (a delta rebuild resumes).
    let mut e = Engine::new(epoch, replicas(&[false, false]), Some(persisted), 0);
    for (r, rev) in [(0, member + 8), (1, member + 7)] {
        let (claim, _) = hello_and_claim(&mut e, r, rev);
        e.handle(0, Event::Received(r, ok(claim)));
    }
    assert_eq!(e.missing(1).map(|m| m.count()), Some(1), "the kept map");
}
