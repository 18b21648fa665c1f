//! Replicas joining and leaving the engine: connect, `Hello`, the epoch claim, attaching (which
//! replicas are current, what the others lack, the resync after an unclean end), fencing,
//! revisions and a replica's failure.

use super::*;

impl Engine {
    pub(super) fn on_connected(&mut self, r: ReplicaId) {
        if self.replicas[r] == ReplicaState::Retired {
            // The driver raced the removal; the connection is closed with the slot.
            return;
        }
        if self.fenced {
            // The driver raced the fence; this engine never talks to a replica again.
            self.actions.push(Action::ReplicaFailed { replica: r, reason: FailReason::Fenced });
            return;
        }
        if self.replicas[r] != ReplicaState::Down {
            // The driver saw a new connection before reporting the old one gone.
            self.fail(r, FailReason::Disconnected);
        }
        self.replicas[r] = ReplicaState::Handshaking;
        let op = self.alloc_op();
        self.ops.insert(op, Op::Hello);
        let hello = Message::Hello {
            volume_id: self.cfg.volume_id.clone(),
            protocol_version: PROTOCOL_VERSION,
            revision: self.revision,
            disk: self.replica_cfg[r].disk.clone(),
        };
        self.send(r, op, hello);
    }

    pub(super) fn on_frame(&mut self, r: ReplicaId, frame: Frame) {
        // Unknown ids are late answers to requests already written off (timed out, or sent on a
        // connection that failed): whatever they say no longer counts.
        let Some(p) = self.pending.get(&frame.request_id) else { return };
        if p.replica != r {
            return;
        }
        let op_id = p.op;
        self.pending.remove(&frame.request_id);
        // The common case, a replica's answer to a write: counted in place.
        if let (Some(Op::Fanout { kind, waiting, acked, .. }), Message::Reply { status }) =
            (self.ops.get_mut(&op_id), &frame.message)
            && (*status == Status::Ok || tolerated(kind, *status))
        {
            waiting.remove(r);
            acked.insert(r);
            return self.maybe_complete(op_id);
        }
        let Some(op) = self.ops.remove(&op_id) else { return };
        let op_and_reason = match (op, frame.message) {
            (Op::Hello, Message::HelloReply { status: Status::Ok, header }) if self.cfg.epoch > 0 => {
                self.ops.insert(op_id, Op::Claim(header));
                return self.send(r, op_id, Message::Claim { epoch: self.cfg.epoch });
            }
            (Op::Hello, Message::HelloReply { status: Status::Ok, header }) => return self.on_hello(r, header),
            (Op::Claim(header), Message::Reply { status: Status::Ok }) => return self.on_hello(r, header),
            (Op::Read { client, len, .. }, Message::ReadReply { status: Status::Ok, data })
                if data.len() as u64 == len =>
            {
                self.unlock(op_id);
                return self.reply(client, Ok(ClientReply::Read(data)));
            }
            (Op::Rebuild(step), message) => match self.on_rebuild_reply(op_id, step, message) {
                Ok(()) => return,
                Err(given_back) => *given_back,
            },
            (op, message) => (op, mismatch(&message)),
        };
        // Put the op back so failing the replica resolves it like any other casualty.
        let (op, reason) = op_and_reason;
        self.ops.insert(op_id, op);
        self.pending.insert(frame.request_id, Pending { replica: r, op: op_id, deadline: self.now });
        if reason == (FailReason::ErrorReply { status: Status::Fenced }) {
            return self.fence();
        }
        self.fail(r, reason);
    }

    /// A replica said another engine holds the volume: drop every replica and fail everything
    /// (see the module docs).
    pub(super) fn fence(&mut self) {
        if !self.fenced {
            tracing::error!(volume = %self.cfg.volume_id, "fenced: another engine was given the volume; failing all I/O");
        }
        self.fenced = true;
        self.abort_rebuild();
        for r in 0..self.replicas.len() {
            self.fail(r, FailReason::Fenced);
        }
        // Not attached yet: nothing else would ever answer what waits.
        self.attached = true;
    }

    pub(super) fn on_hello(&mut self, r: ReplicaId, header: ReplicaHeader) {
        if header.volume_id != self.cfg.volume_id {
            self.fail(r, FailReason::WrongVolume { found: header.volume_id });
            return;
        }
        self.known[r] = Known { size: header.size, chain: header.snapshots.clone() };
        if !self.attached {
            self.replicas[r] = ReplicaState::Attached(header);
            if self.replicas.iter().all(|s| matches!(s, ReplicaState::Attached(_) | ReplicaState::Retired)) {
                self.finish_attach();
            }
            return;
        }
        if header.revision > self.revision {
            let reason = FailReason::RevisionAhead { replica: header.revision, engine: self.revision };
            self.fail(r, reason);
            return;
        }
        if header.size > self.size {
            self.fail(r, FailReason::SizeAhead { replica: header.size, engine: self.size });
            return;
        }
        // Every replica that is not healthy while serving is out of sync; one the engine has no
        // record of needs everything copied, whatever its header says, and so does a new one.
        let full = full_map(self.size, self.cfg.region_size);
        if self.never_a_member_at(header.revision, self.revision) {
            self.missing.insert(r, full);
        } else {
            self.missing.entry(r).or_insert(full);
        }
        self.replicas[r] = ReplicaState::Stale;
    }

    /// Decides which attached replicas are current: those at the highest revision known to the
    /// engine or any replica, not recorded as out of sync, as large as the largest of those and
    /// with the same snapshot chain as the first of them.
    pub(super) fn finish_attach(&mut self) {
        let attached: Vec<(ReplicaId, ReplicaHeader)> = (0..self.replicas.len())
            .filter_map(|r| if let ReplicaState::Attached(h) = &self.replicas[r] { Some((r, h.clone())) } else { None })
            .collect();
        let Some(newest) = attached.iter().map(|(_, h)| h.revision).max() else { return };
        self.attached = true;
        // Current means at the newest revision *any replica* holds, not the persisted one: the
        // engine persists a bumped revision before the replicas learn it, and writes wait for
        // them to learn it, so a crash in between leaves the current replicas one behind.
        self.revision = self.revision.max(newest);
        let candidates: Vec<&(ReplicaId, ReplicaHeader)> =
            attached.iter().filter(|(r, h)| h.revision == newest && !self.missing.contains_key(r)).collect();
        if let Some(size) = candidates.iter().map(|(_, h)| h.size).max() {
            self.set_size(size);
        }
        // Replicas at the newest revision agree on the chain unless the engine crashed during
        // a snapshot operation; then any of them is a valid outcome and the others are rebuilt.
        let reference = candidates.iter().find(|(_, h)| h.size == self.size).map(|(_, h)| h.snapshots.clone());
        self.chain = reference.clone().unwrap_or_default();
        let names = |c: &[SnapshotInfo]| c.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
        let full = full_map(self.size, self.cfg.region_size);
        for r in 0..self.replicas.len() {
            if self.replicas[r] == ReplicaState::Retired {
                continue;
            }
            let ReplicaState::Attached(h) = self.replicas[r].clone() else {
                self.missing.entry(r).or_insert_with(|| full.clone());
                continue;
            };
            if self.never_a_member_at(h.revision, newest) {
                // Created empty since a set it joins was last current (added, or replacing a
                // replica while detached): a map kept for its index was about what it replaced.
                self.missing.insert(r, full.clone());
            }
            if h.size > self.size {
                self.fail(r, FailReason::SizeAhead { replica: h.size, engine: self.size });
                self.missing.entry(r).or_insert_with(|| full.clone());
                continue;
            }
            let candidate = h.revision == newest && !self.missing.contains_key(&r);
            let same_chain = reference.as_ref().is_some_and(|c| names(c) == names(&h.snapshots));
            if candidate && same_chain && h.size == self.size {
                self.replicas[r] = ReplicaState::Healthy;
                continue;
            }
            self.replicas[r] = ReplicaState::Stale;
            // Only a size behind (the engine crashed during a resize): its data is current.
            let lacks = if candidate && same_chain { empty_map(self.size, self.cfg.region_size) } else { full.clone() };
            self.missing.entry(r).or_insert(lacks);
        }
        self.resync_after_unclean_end(&attached);
        if self.replicas.iter().any(|s| !matches!(s, ReplicaState::Healthy | ReplicaState::Retired)) {
            self.bump_revision();
        }
        // Into this epoch's range (see EPOCH_REVISION_BITS) before the first write, also when
        // every replica is current.
        let floor = self.cfg.epoch.saturating_mul(1 << EPOCH_REVISION_BITS);
        if self.revision < floor {
            self.revision = floor;
            self.revision_sync_wanted = true;
        }
        tracing::info!(revision = self.revision, size = self.size, healthy = self.healthy_count(), "attached");
        self.persist();
        // The replicas may hold writes of the previous engine that never were flushed, which
        // this engine's `unflushed` does not know of. Until this flush is done, a replica that
        // fails is marked as lacking everything.
        let healthy = self.healthy();
        if !healthy.is_empty() {
            let op = self.alloc_op();
            for r in &healthy {
                self.send(r, op, Message::Flush);
            }
            let covered = full_map(self.size, self.cfg.region_size);
            let kind = Fanout::Flush { covered, window: empty_map(self.size, self.cfg.region_size) };
            self.ops.insert(op, Op::Fanout { client: None, kind, waiting: healthy, acked: ReplicaSet::new() });
        }
    }

    /// The previous session did not end cleanly (a replica's header says dirty: its engine died
    /// or lost it without a final flush). Writes it sent but never acknowledged may have reached
    /// some replicas and not others, so replicas that agree on revision, size and chain can still
    /// differ in content; reading from more than one of them could return a block's old and new
    /// content alternately. One healthy replica (local first) becomes the source and stays the
    /// only healthy one; every other replica gets the suspect regions added to what it lacks and
    /// is rebuilt from the source, so afterwards all hold what the source holds, which is a valid
    /// outcome of the interrupted writes. The suspect regions are the previous session's intent
    /// map, or the whole volume when it is unknown (lost or old state file). Replicas already
    /// out of sync get them too: one in a rebuild's head phase received the same writes.
    pub(super) fn resync_after_unclean_end(&mut self, attached: &[(ReplicaId, ReplicaHeader)]) {
        let prior = self.prior_intent.take();
        if !attached.iter().any(|(_, h)| h.dirty) {
            return;
        }
        let healthy = self.healthy();
        let Some(source) = healthy.iter().find(|r| self.replica_cfg[*r].local).or(healthy.first()) else {
            return;
        };
        let region_size = self.cfg.region_size;
        let suspect = match prior {
            // Grown when the replicas' size is newer than the persisted one; marks are kept.
            Some(mut m) if m.regions() <= self.size.div_ceil(region_size) => {
                m.grow(self.size);
                m
            }
            _ => full_map(self.size, region_size),
        };
        if suspect.is_empty() {
            return;
        }
        tracing::warn!(
            source,
            regions = suspect.count(),
            "previous session ended uncleanly: resyncing from one replica"
        );
        for r in (0..self.replicas.len()).filter(|r| *r != source) {
            if self.replicas[r] == ReplicaState::Retired {
                continue;
            }
            if self.replicas[r] == ReplicaState::Healthy {
                self.replicas[r] = ReplicaState::Stale;
            }
            self.missing.entry(r).or_insert_with(|| empty_map(self.size, region_size)).merge(&suspect);
        }
    }

    /// Adopts a new volume size: maps grow keeping their marks. Volumes never shrink; a smaller
    /// size (only after a lost state file met older replicas) marks everything to be safe.
    pub(super) fn set_size(&mut self, size: u64) {
        if size == self.size {
            return;
        }
        let region_size = self.cfg.region_size;
        if size > self.size {
            self.missing.values_mut().for_each(|m| m.grow(size));
            self.unflushed.grow(size);
            self.intent.grow(size);
            self.touched.grow(size);
        } else {
            self.missing.values_mut().for_each(|m| *m = full_map(size, region_size));
            self.unflushed = full_map(size, region_size);
            self.intent = full_map(size, region_size);
            self.touched = full_map(size, region_size);
        }
        self.size = size;
    }

    /// The healthy set changed: a new revision must reach every healthy replica before the next
    /// write, so the ones left behind are recognisably behind.
    pub(super) fn bump_revision(&mut self) {
        self.revision += 1;
        self.revision_sync_wanted = true;
    }

    pub(super) fn fail(&mut self, r: ReplicaId, reason: FailReason) {
        if matches!(self.replicas[r], ReplicaState::Down | ReplicaState::Retired) {
            return;
        }
        let prev = std::mem::replace(&mut self.replicas[r], ReplicaState::Down);
        self.actions.push(Action::ReplicaFailed { replica: r, reason });
        if matches!(prev, ReplicaState::Healthy | ReplicaState::Rebuilding) {
            self.mark_unsettled(r);
        }
        if prev == ReplicaState::Healthy {
            self.bump_revision();
        }
        if matches!(prev, ReplicaState::Healthy | ReplicaState::Rebuilding) {
            self.persist();
        }
        if self.promote == Some(r) {
            self.promote = None;
        }
        let source_or_target = self.rebuild.as_ref().is_some_and(|b| b.source == r || b.target == r);
        if source_or_target {
            self.abort_rebuild();
        }
        let mine: Vec<(u64, OpId)> =
            self.pending.iter().filter(|(_, p)| p.replica == r).map(|(id, p)| (*id, p.op)).collect();
        for (request_id, op_id) in mine {
            self.pending.remove(&request_id);
            match self.ops.get_mut(&op_id) {
                Some(Op::Hello | Op::Claim(_)) => {
                    self.ops.remove(&op_id);
                }
                Some(Op::Read { .. }) => {
                    if let Some(Op::Read { client, offset, len }) = self.ops.remove(&op_id) {
                        self.unlock(op_id);
                        // Retried like a new read, at the front so it keeps its place.
                        self.queue.push_front((op_id, Op::Read { client, offset, len }));
                    }
                }
                Some(Op::Fanout { waiting, .. }) => {
                    waiting.remove(r);
                    self.maybe_complete(op_id);
                }
                // Rebuild requests go to the source or the target; the abort above removed them.
                Some(Op::Rebuild(_)) | None => {}
            }
        }
    }
}

impl Engine {
    /// A replica created empty, never a complete member (its revision was never set), of a set
    /// that has been current (`newest` > 0): it holds nothing, whatever a map kept for its index
    /// says. Only with an epoch: every engine with one raises its members into the epoch's range
    /// (see `finish_attach`), so 0 is never a member's; without one (a volume driven by hand) 0
    /// is the first revision every member starts at.
    fn never_a_member_at(&self, revision: u64, newest: u64) -> bool {
        revision == 0 && newest > 0 && self.cfg.epoch > 0
    }

    /// See [`Event::ReplicaAdded`]: the new replica lacks everything, persisted before it
    /// connects, so a crash before its rebuild ends cannot count it as current.
    pub(super) fn add_replica(&mut self, config: ReplicaConfig) {
        if self.replicas.len() >= MAX_REPLICAS || self.fenced {
            // The driver checks both first; never alias a replica onto another's bit.
            return;
        }
        let r = self.replicas.len();
        tracing::info!(volume = %self.cfg.volume_id, replica = r, disk = %config.disk, "replica added");
        self.replicas.push(ReplicaState::Down);
        self.known.push(Known::default());
        self.replica_cfg.push(config);
        self.missing.insert(r, full_map(self.size, self.cfg.region_size));
        self.persist();
    }

    /// See [`Event::ReplicaRemoved`]. Failing it first resolves what it had in flight like any
    /// casualty (and bumps the revision when it was healthy, so its copy is recognisably old).
    pub(super) fn remove_replica(&mut self, r: ReplicaId) {
        if self.replicas[r] == ReplicaState::Retired {
            return;
        }
        tracing::info!(volume = %self.cfg.volume_id, replica = r, "replica removed");
        self.fail(r, FailReason::Removed);
        self.replicas[r] = ReplicaState::Retired;
        self.missing.remove(&r);
        self.known[r] = Known::default();
        self.persist();
    }
}
