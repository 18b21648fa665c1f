//! Unit tests of the engine: one scenario per rule, driven by hand-made replica replies.

use super::*;
use crate::protocol::{Extent, ExtentState};

const SIZE: u64 = 1 << 20;

fn config(locals: &[bool]) -> EngineConfig {
    EngineConfig {
        volume_id: "vol".into(),
        size: SIZE,
        replicas: locals.iter().map(|l| ReplicaConfig { local: *l }).collect(),
        region_size: 64 * 1024,
        request_timeout: 100,
        attach_timeout: 1000,
        rebuild_parallelism: 4,
    }
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
    let mut e = Engine::new(config(locals), None, 0);
    let mut out = Vec::new();
    for (r, rev) in revisions.iter().enumerate() {
        let hello = sends(&e.handle(0, Event::ReplicaConnected(r)));
        let reply = Message::HelloReply { status: Status::Ok, header: header(*rev) };
        out = e.handle(0, Event::Received(r, Frame { request_id: hello[0].1.request_id, message: reply }));
    }
    assert!(e.is_attached());
    (e, out)
}

#[test]
fn write_is_acknowledged_only_after_every_healthy_replica_acknowledged() {
    let (mut e, _) = attached(&[false, false], &[3, 3]);
    let out = sends(&e.handle(1, Event::ClientWrite { client: 9, offset: 0, data: vec![1; 512] }));
    assert_eq!(out.len(), 2, "fans out to both replicas");
    assert!(e.handle(2, Event::Received(out[0].0, ok(out[0].1.request_id))).is_empty());
    let done = e.handle(3, Event::Received(out[1].0, ok(out[1].1.request_id)));
    assert_eq!(done, vec![Action::Reply { client: 9, result: Ok(ClientReply::Written) }]);
}

#[test]
fn failed_replica_is_dropped_and_writes_continue_degraded_with_the_region_marked_dirty() {
    let (mut e, _) = attached(&[false, false], &[3, 3]);
    let out = sends(&e.handle(1, Event::ClientWrite { client: 1, offset: 0, data: vec![1; 512] }));
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
    let queued = e.handle(201, Event::ClientWrite { client: 2, offset: 1 << 19, data: vec![2; 10] });
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
    let write = e.handle(3, Event::ClientWrite { client: 6, offset: 0, data: vec![0; 4] });
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
