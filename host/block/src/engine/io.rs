//! Client I/O through the engine: the queue, the byte-range locks that keep conflicting
//! operations apart, the fan-out of writes, unmaps, flushes, resizes and snapshots to the
//! replicas, reads from one replica, and completing each operation once every replica answered.

use super::*;

impl Engine {
    pub(super) fn maybe_complete(&mut self, op_id: OpId) {
        let done = matches!(self.ops.get(&op_id), Some(Op::Fanout { waiting, .. }) if waiting.is_empty());
        if !done {
            return;
        }
        let Some(Op::Fanout { client, kind, acked, .. }) = self.ops.remove(&op_id) else { return };
        self.unlock(op_id);
        // Success needs an acknowledgment from a replica that is still healthy now: one that
        // acknowledged and then failed may have lost the data.
        let healthy_acked = acked.intersection(self.healthy());
        let ok = !healthy_acked.is_empty();
        // Snapshot operations must reach every configured replica, or the chains diverge.
        let everyone = ok && healthy_acked.len() == self.configured();
        let result = match kind {
            Fanout::Write { offset, len, data } => {
                if ok {
                    self.unflushed.mark(offset, len);
                }
                // Marked at the end too: a write that finishes after a flush started is not
                // covered by it, even if it started long before.
                self.touched.mark(offset, len);
                ok.then_some(if data.is_some() { ClientReply::Written } else { ClientReply::Unmapped })
                    .ok_or_else(|| self.volume_error())
            }
            Fanout::Flush { window, .. } => {
                if ok {
                    self.clear_intent(&window);
                }
                ok.then_some(ClientReply::Flushed).ok_or_else(|| self.volume_error())
            }
            Fanout::Resize { size } => {
                if ok {
                    for r in &acked {
                        self.known[r].size = size;
                    }
                    if let Some(b) = self.rebuild.as_mut().filter(|b| acked.contains(b.target)) {
                        b.target_size = size;
                    }
                    tracing::info!(size, "volume resized");
                    self.set_size(size);
                    self.persist();
                    // A rebuild that started while this resize was in flight did not include
                    // its target; restarted, it grows the target first (its map is kept).
                    if self.rebuild.as_ref().is_some_and(|b| b.target_size < size) {
                        self.abort_rebuild();
                    }
                }
                ok.then_some(ClientReply::Resized).ok_or_else(|| self.volume_error())
            }
            Fanout::Snapshot { name, created_ns } => {
                let info = SnapshotInfo { name, revision: self.revision, created_ns };
                for r in &acked {
                    self.known[r].chain.push(info.clone());
                }
                // Recorded when every replica still healthy has it, even if one failed: the
                // chain is the healthy replicas' chain, and a retry must find it.
                if ok && self.healthy().is_subset(acked) {
                    self.chain.push(info);
                }
                everyone.then_some(ClientReply::SnapshotTaken).ok_or_else(|| self.degraded_error("a snapshot"))
            }
            Fanout::DeleteSnapshot { name } => {
                for r in &acked {
                    self.known[r].chain.retain(|s| s.name != name);
                }
                if ok && self.healthy().is_subset(acked) {
                    self.chain.retain(|s| s.name != name);
                }
                everyone
                    .then_some(ClientReply::SnapshotDeleted)
                    .ok_or_else(|| self.degraded_error("deleting a snapshot"))
            }
            Fanout::SetRevision { revision } => {
                self.revision_sync_in_flight = false;
                if let Some(t) = self.promote
                    && revision == self.revision
                    && acked.contains(t)
                    && self.replicas[t] == ReplicaState::Rebuilding
                {
                    self.promote = None;
                    self.replicas[t] = ReplicaState::Healthy;
                    self.missing.remove(&t);
                    tracing::info!(replica = t, revision, "rebuild finished; replica healthy");
                    self.persist();
                    self.actions.push(Action::RebuildFinished { replica: t });
                }
                return;
            }
        };
        if let Some(client) = client {
            self.reply(client, result);
        }
    }

    pub(super) fn degraded_error(&self, what: &'static str) -> IoError {
        IoError::Degraded {
            volume_id: self.cfg.volume_id.clone(),
            healthy: self.healthy_count(),
            configured: self.configured(),
            what,
        }
    }

    pub(super) fn unlock(&mut self, op: OpId) {
        self.locks.retain(|l| l.op != op);
    }

    pub(super) fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        start < end && self.locks.iter().any(|l| l.start < end && start < l.end && (exclusive || l.exclusive))
    }

    /// Starts whatever can start: a pending revision sync, queued client requests whose range
    /// is free, and the rebuild's next steps.
    pub(super) fn pump(&mut self) {
        if self.fenced {
            while let Some((id, op)) = self.queue.pop_front() {
                self.unlock(id);
                if let Op::Read { client, .. } | Op::Fanout { client: Some(client), .. } = op {
                    self.reply(client, Err(self.volume_error()));
                }
            }
            return;
        }
        if !self.attached {
            return;
        }
        // Runs on every event: the scan of the locks only when a sync is wanted.
        if self.revision_sync_wanted && !self.revision_sync_in_flight && !self.locks.iter().any(|l| l.exclusive) {
            self.start_revision_sync();
        }
        let mut i = 0;
        let mut waiting: Vec<(u64, u64, bool)> = Vec::new();
        while i < self.queue.len() {
            let (start, end, exclusive) = lock_range(&self.queue[i].1);
            let barred = exclusive && (self.revision_sync_wanted || self.revision_sync_in_flight);
            let behind = waiting.iter().any(|(s, e, x)| *s < end && start < *e && (exclusive || *x));
            if barred || behind || self.conflicts(start, end, exclusive) {
                waiting.push((start, end, exclusive));
                i += 1;
                continue;
            }
            if let Some((id, op)) = self.queue.remove(i) {
                if start < end {
                    self.locks.push(Lock { op: id, start, end, exclusive });
                }
                self.start(id, op);
            }
        }
        self.pump_rebuild();
    }

    pub(super) fn start_revision_sync(&mut self) {
        self.revision_sync_wanted = false;
        let mut targets = self.healthy();
        if let Some(t) = self.promote
            && self.replicas[t] == ReplicaState::Rebuilding
        {
            targets.insert(t);
        }
        if targets.is_empty() {
            return;
        }
        self.revision_sync_in_flight = true;
        let op = self.alloc_op();
        let revision = self.revision;
        for r in &targets {
            self.send(r, op, Message::SetRevision { revision });
        }
        self.ops.insert(
            op,
            Op::Fanout {
                client: None,
                kind: Fanout::SetRevision { revision },
                waiting: targets,
                acked: ReplicaSet::new(),
            },
        );
    }

    pub(super) fn start(&mut self, id: OpId, op: Op) {
        match op {
            Op::Read { client, offset, len } => {
                let healthy = self.healthy();
                let local = healthy.iter().find(|r| self.replica_cfg[*r].local);
                let Some(r) = local.or_else(|| {
                    self.round_robin = self.round_robin.wrapping_add(1);
                    healthy.iter().nth(self.round_robin % healthy.len().max(1))
                }) else {
                    self.unlock(id);
                    return self.reply(client, Err(self.volume_error()));
                };
                self.ops.insert(id, Op::Read { client, offset, len });
                // len ≤ MAX_IO, checked on arrival.
                self.send(r, id, Message::Read { offset, len: len as u32 });
            }
            Op::Fanout { client: Some(client), kind, .. } => self.start_fanout(id, client, kind),
            other => {
                self.ops.insert(id, other);
            }
        }
    }

    pub(super) fn start_fanout(&mut self, id: OpId, client: ClientId, kind: Fanout) {
        if self.healthy_count() == 0 {
            self.unlock(id);
            return self.reply(client, Err(self.volume_error()));
        }
        let revision = self.revision;
        let (targets, message): (ReplicaSet, Box<dyn Fn() -> Message>) = match &kind {
            Fanout::Write { offset, len, data } => {
                // Marked before any replica sees the write: if the engine crashes right after
                // sending, the persisted maps already cover what the missing replicas lack.
                let targets = self.writable();
                // Also before any replica sees it: if the engine crashes with it in flight, the
                // next attach knows the region may differ between replicas.
                let mut changed = self.intent.mark(*offset, *len);
                self.touched.mark(*offset, *len);
                let (first, last) = self.intent.region_span(*offset, *len);
                let now = self.now;
                for r in first..last {
                    self.intent_touched.insert(r, now);
                }
                for (r, map) in self.missing.iter_mut() {
                    if !targets.contains(*r) {
                        changed |= map.mark(*offset, *len);
                    }
                }
                if changed {
                    self.persist();
                }
                let (offset, len) = (*offset, *len);
                // A write's payload is handed out below, shared, without the closure.
                let message: Box<dyn Fn() -> Message> = match data {
                    Some(_) => Box::new(|| Message::Flush),
                    None => Box::new(move || Message::Unmap { offset, len, revision }),
                };
                (targets, message)
            }
            Fanout::Flush { .. } => (self.writable(), Box::new(|| Message::Flush)),
            Fanout::Resize { size } => {
                let size = *size;
                if size < self.size {
                    self.unlock(id);
                    let e = IoError::Shrink { volume_id: self.cfg.volume_id.clone(), size: self.size, requested: size };
                    return self.reply(client, Err(e));
                }
                if size == self.size {
                    self.unlock(id);
                    return self.reply(client, Ok(ClientReply::Resized));
                }
                // A target being seeded grows too: it receives no writes, but its head phase
                // will, and the snapshot views it copies may be as large as the volume.
                let mut targets = self.writable();
                targets.extend((0..self.replicas.len()).filter(|r| self.replicas[*r] == ReplicaState::Seeding));
                (targets, Box::new(move || Message::Resize { size, revision }))
            }
            Fanout::Snapshot { name, .. } | Fanout::DeleteSnapshot { name } => {
                let taking = matches!(kind, Fanout::Snapshot { .. });
                let exists = self.chain.iter().any(|s| s.name == *name);
                if exists == taking {
                    // Already done: an idempotent retry.
                    self.unlock(id);
                    let reply = if taking { ClientReply::SnapshotTaken } else { ClientReply::SnapshotDeleted };
                    return self.reply(client, Ok(reply));
                }
                if self.healthy_count() < self.configured() {
                    self.unlock(id);
                    let what = if taking { "a snapshot" } else { "deleting a snapshot" };
                    return self.reply(client, Err(self.degraded_error(what)));
                }
                let name = name.clone();
                let message: Box<dyn Fn() -> Message> = if taking {
                    Box::new(move || Message::Snapshot { name: name.clone(), revision })
                } else {
                    Box::new(move || Message::DeleteSnapshot { name: name.clone(), revision })
                };
                (self.healthy(), message)
            }
            Fanout::SetRevision { .. } => return,
        };
        if let Fanout::Flush { .. } = kind {
            // Writes completed before now are covered by this flush; later ones are not.
            let covered = std::mem::replace(&mut self.unflushed, empty_map(self.size, self.cfg.region_size));
            let window = std::mem::replace(&mut self.touched, empty_map(self.size, self.cfg.region_size));
            for r in &targets {
                self.send(r, id, Message::Flush);
            }
            let kind = Fanout::Flush { covered, window };
            self.ops.insert(id, Op::Fanout { client: Some(client), kind, waiting: targets, acked: ReplicaSet::new() });
            return;
        }
        let mut kind = kind;
        if let Fanout::Write { offset, data: Some(data), .. } = &mut kind {
            // The op keeps an empty payload (it still reads as a write, not an unmap): nothing
            // resends it, so the data is freed once every connection wrote it out. Every
            // replica's frame shares the one payload.
            let offset = *offset;
            let payload = std::mem::take(data);
            for r in &targets {
                self.send(r, id, Message::Write { offset, revision, data: payload.clone() });
            }
        } else {
            for r in &targets {
                self.send(r, id, message());
            }
        }
        self.ops.insert(id, Op::Fanout { client: Some(client), kind, waiting: targets, acked: ReplicaSet::new() });
    }
}

pub(super) fn fanout(client: ClientId, kind: Fanout) -> Op {
    Op::Fanout { client: Some(client), kind, waiting: ReplicaSet::new(), acked: ReplicaSet::new() }
}

/// The byte range a queued request locks; barriers lock the whole volume.
pub(super) fn lock_range(op: &Op) -> (u64, u64, bool) {
    match op {
        Op::Read { offset, len, .. } => (*offset, offset + len, false),
        Op::Fanout { kind: Fanout::Write { offset, len, .. }, .. } => (*offset, offset + len, true),
        Op::Fanout {
            kind: Fanout::Resize { .. } | Fanout::Snapshot { .. } | Fanout::DeleteSnapshot { .. }, ..
        } => (0, u64::MAX, true),
        _ => (0, 0, false),
    }
}

/// Statuses that count as success for an operation: a snapshot that already exists (a retry
/// after a partial failure) and one that is already gone.
pub(super) fn tolerated(kind: &Fanout, status: Status) -> bool {
    matches!(
        (kind, status),
        (Fanout::Snapshot { .. }, Status::AlreadyExists) | (Fanout::DeleteSnapshot { .. }, Status::NotFound)
    )
}

pub(super) fn mismatch(message: &Message) -> FailReason {
    match message {
        Message::Reply { status }
        | Message::ReadReply { status, .. }
        | Message::HelloReply { status, .. }
        | Message::ExtentMap { status, .. }
            if *status != Status::Ok =>
        {
            FailReason::ErrorReply { status: *status }
        }
        _ => FailReason::Protocol("reply does not match its request"),
    }
}
