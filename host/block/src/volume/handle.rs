//! [`ReplicatedVolume`], the handle a frontend holds of a replicated volume: a synchronous
//! [`BlockDevice`] over the driver. It splits requests to the engine's limits ([`MAX_IO`],
//! [`MAX_UNMAP`]) and hands them to the driver, then blocks until the engine answers or, for
//! `submit_read`/`submit_write`, leaves the answer to a completion. The blocking calls must be
//! made from plain threads (FUSE workers), never from inside the tokio runtime: `blocking_recv`
//! panics there. It does not drive the engine itself (see `super::driver`).
//!
//! I/O limits ([`crate::qos`]): every read and write is admitted by the volume's [`Throttle`]
//! before the engine sees it. One that must wait does so on a timer: a submitted one is handed
//! to the driver by a task of the runtime after a `sleep` (the frontend's thread goes on to its
//! next request), a blocking one sleeps its own thread. Without limits nothing waits and the
//! admission is one atomic load.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};
use wasmcsi_frontend::{BlockDevice, ReadDone, WriteDone};

use super::driver::{self, Shared};
use super::request::{ReplyTx, Request, stopped, unexpected};
use super::{VolumeConfig, VolumeError, VolumeStatus};
use crate::engine::{ClientReply, MAX_IO, MAX_UNMAP};
use crate::protocol::SnapshotInfo;
use crate::qos::{Direction, IoLimits, Throttle};

/// Unmap pieces in flight at once for one discard: each locks up to [`MAX_UNMAP`] bytes.
const DISCARD_WINDOW: usize = 4;

/// A replicated volume served by a driver task; the [`BlockDevice`] a frontend exposes.
///
/// Every method blocks the calling thread until the engine answers, so call them from plain
/// threads, not from tasks of the runtime the driver runs on. Requests larger than the engine's
/// [`MAX_IO`] are split and their pieces submitted together. Dropping the handle stops the
/// driver (outstanding requests fail); call [`ReplicatedVolume::flush`] first to keep writes.
pub struct ReplicatedVolume {
    size: Arc<AtomicU64>,
    shared: Arc<Shared>,
    /// Stops the driver task when sent to or dropped.
    stop: mpsc::UnboundedSender<()>,
    status: watch::Receiver<VolumeStatus>,
    /// The volume's I/O limits as its reads and writes are admitted.
    throttle: Throttle,
    /// Where a throttled request waits for its timer.
    runtime: tokio::runtime::Handle,
}

impl std::fmt::Debug for ReplicatedVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicatedVolume")
            .field("size", &self.size)
            .field("status", &*self.status.borrow())
            .finish_non_exhaustive()
    }
}

impl ReplicatedVolume {
    /// Loads the persisted engine state from `cfg.state_dir` and starts the driver on `runtime`;
    /// it connects to every replica and attaches in the background (see [`Self::wait_for`]).
    pub fn start(cfg: VolumeConfig, runtime: &tokio::runtime::Handle) -> Result<Self, VolumeError> {
        let driver::Started { shared, size, stop, status } = driver::start(cfg, runtime)?;
        Ok(Self { size, shared, stop, status, throttle: Throttle::default(), runtime: runtime.clone() })
    }

    /// Applies `limits` to the reads and writes admitted from now on (see [`crate::qos`]).
    pub fn set_limits(&self, limits: IoLimits) {
        if self.throttle.limits() != limits {
            tracing::info!(%limits, "I/O limits set");
        }
        self.throttle.set(limits);
    }

    /// The I/O limits applied now.
    pub fn limits(&self) -> IoLimits {
        self.throttle.limits()
    }

    /// Blocks the calling (plain) thread until an I/O of `bytes` may start.
    fn admit_blocking(&self, direction: Direction, bytes: u64) {
        if let Some(wait) = self.throttle.admit(direction, bytes) {
            std::thread::sleep(wait);
        }
    }

    /// Hands `request` to the driver now, or after `wait` from a task of the runtime.
    fn submit_after(&self, wait: Option<Duration>, request: Request, reply: ReplyTx) {
        match wait {
            None => self.shared.submit(request, reply),
            Some(wait) => {
                let shared = self.shared.clone();
                self.runtime.spawn(async move {
                    tokio::time::sleep(wait).await;
                    shared.submit(request, reply);
                });
            }
        }
    }

    /// The driver's latest status.
    pub fn status(&self) -> VolumeStatus {
        self.status.borrow().clone()
    }

    /// Blocks until `pred` holds for the status or `timeout` passes; returns whether it held.
    pub fn wait_for(&self, timeout: Duration, pred: impl Fn(&VolumeStatus) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if pred(&self.status.borrow()) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops the driver: connections close, outstanding and later requests fail.
    pub fn shutdown(&self) {
        let _ = self.stop.send(());
    }

    /// Whether the driver stopped and let go of its connections (soon after [`Self::shutdown`]).
    pub fn is_stopped(&self) -> bool {
        self.shared.with_driver(|d| d.stopped)
    }

    /// Whether the volume waits for nothing: no request queued or unanswered, no rebuild, and
    /// none of the engine's own operations (the flush that follows an attach, a revision
    /// update) in flight. Only then is a replica's next frame an answer to something sent later.
    pub fn is_idle(&self) -> bool {
        self.shared.is_idle()
    }

    /// Submits `request`; the answer arrives on the receiver (an error once the driver stopped).
    fn submit(&self, request: Request) -> oneshot::Receiver<io::Result<ClientReply>> {
        let (tx, rx) = oneshot::channel();
        self.shared.submit(request, ReplyTx::Wait(tx));
        rx
    }

    fn wait(rx: oneshot::Receiver<io::Result<ClientReply>>) -> io::Result<ClientReply> {
        rx.blocking_recv().map_err(|_| stopped())?
    }

    /// Wait for every submitted write (or unmap), even after one failed, so none is still in
    /// flight when the caller returns; the first failure is the result.
    fn wait_all_written(pending: Vec<oneshot::Receiver<io::Result<ClientReply>>>) -> io::Result<()> {
        let mut result = Ok(());
        for rx in pending {
            match Self::wait(rx) {
                Ok(ClientReply::Written | ClientReply::Unmapped) => {}
                Ok(other) => result = result.and(Err(unexpected(&other))),
                Err(e) => result = result.and(Err(e)),
            }
        }
        result
    }

    /// Grows the volume to `new_size` bytes on every replica, online. Smaller than the current
    /// size is an error, the same size succeeds.
    pub fn resize(&self, new_size: u64) -> io::Result<()> {
        match Self::wait(self.submit(Request::Resize { size: new_size }))? {
            ClientReply::Resized => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Takes a crash-consistent snapshot `name` on every replica; idempotent for an existing
    /// name. Needs every replica healthy: fails with `ErrorKind::ResourceBusy` while degraded.
    pub fn snapshot(&self, name: &str) -> io::Result<()> {
        match Self::wait(self.submit(Request::Snapshot { name: name.to_owned() }))? {
            ClientReply::SnapshotTaken => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes snapshot `name` on every replica; a name that does not exist succeeds. Needs
    /// every replica healthy, like [`Self::snapshot`].
    pub fn delete_snapshot(&self, name: &str) -> io::Result<()> {
        match Self::wait(self.submit(Request::DeleteSnapshot { name: name.to_owned() }))? {
            ClientReply::SnapshotDeleted => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Holds the volume's writes for `holder` (a group snapshot), then takes snapshot `name` on
    /// every replica: it holds exactly the writes fed to the engine before the hold. Writes,
    /// unmaps and flushes then wait until [`Self::release_hold`] or, at the latest, until
    /// `deadline` has passed (the volume never stays paused for a holder that went away). The
    /// same holder again: its hold continues and the snapshot is the existing one. A snapshot
    /// that fails ends the hold. Errors: `WouldBlock` when another holder holds the volume, and
    /// those of [`Self::snapshot`].
    pub fn hold_snapshot(&self, holder: &str, name: &str, deadline: Duration) -> io::Result<()> {
        let generation = self.shared.hold.hold(holder).map_err(|other| {
            io::Error::new(io::ErrorKind::WouldBlock, format!("the volume is held by group snapshot {:?}", other.0))
        })?;
        let shared = Arc::downgrade(&self.shared);
        let owner = holder.to_owned();
        self.shared.runtime().spawn(async move {
            tokio::time::sleep(deadline).await;
            if let Some(shared) = shared.upgrade()
                && let Some(released) = shared.hold.release(&owner, Some(generation))
            {
                tracing::warn!(holder = %owner, held_ms = released.held_for.as_millis(), "hold deadline passed; writes resume");
                shared.resubmit(released.parked);
            }
        });
        self.snapshot(name).inspect_err(|_| {
            self.release_hold(holder);
        })
    }

    /// Ends `holder`'s hold: the writes it parked go on. Returns how long it held, `None` when
    /// `holder` does not hold the volume (its deadline ended it, or it never held it).
    pub fn release_hold(&self, holder: &str) -> Option<Duration> {
        let released = self.shared.hold.release(holder, None)?;
        self.shared.resubmit(released.parked);
        Some(released.held_for)
    }

    /// Moves replica `index` to a new, empty replica on the disk `disk` of the server at `addr`
    /// (created there first, e.g. with `control::ReplicaServerClient::create_replica_on`): the
    /// way to replace a replica whose node or disk is gone. The new replica is fully rebuilt while I/O continues; the volume must keep another
    /// healthy replica meanwhile.
    pub fn replace_replica(&self, index: usize, addr: SocketAddr, disk: &str) -> io::Result<()> {
        self.shared.with_driver(|d| if d.stopped { Err(stopped()) } else { d.replace_replica(index, addr, disk) })
    }

    /// Adds a new, empty replica on disk `disk` of the replica server at `addr` (created there
    /// first; `node`: the node it must be, over TLS) as the set's last: it is fully rebuilt
    /// while I/O continues. The same place again: success. Returns its index in the set.
    pub fn add_replica(&self, addr: SocketAddr, disk: &str, node: Option<&str>) -> io::Result<usize> {
        self.shared.with_driver(|d| if d.stopped { Err(stopped()) } else { d.add_replica(addr, disk, node) })
    }

    /// Removes the set's replica on disk `disk` of the server at `addr` (the engine stops using
    /// it at once; the caller deletes it). None there: success. Refused for the last healthy one.
    pub fn remove_replica(&self, addr: SocketAddr, disk: &str) -> io::Result<()> {
        self.shared.with_driver(|d| if d.stopped { Err(stopped()) } else { d.remove_replica(addr, disk) })
    }

    /// Number of replicas in the volume's set now (it changes with added and removed ones).
    pub fn replica_count(&self) -> usize {
        self.shared.with_driver(|d| d.configured())
    }

    /// The volume's snapshots, oldest first, as the engine last knew them.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.status.borrow().snapshots.clone()
    }

    fn check_range(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size.load(Ordering::SeqCst) => Ok(()),
            _ => Err(io::Error::new(io::ErrorKind::InvalidInput, "range beyond the end of the volume")),
        }
    }
}

impl Drop for ReplicatedVolume {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl BlockDevice for ReplicatedVolume {
    fn size(&self) -> u64 {
        self.size.load(Ordering::SeqCst)
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.admit_blocking(Direction::Read, buf.len() as u64);
        let mut pending = Vec::new();
        for (i, chunk) in buf.chunks(MAX_IO as usize).enumerate() {
            let at = offset + i as u64 * MAX_IO;
            pending.push(self.submit(Request::Read { offset: at, len: chunk.len() as u64 }));
        }
        for (chunk, rx) in buf.chunks_mut(MAX_IO as usize).zip(pending) {
            match Self::wait(rx)? {
                ClientReply::Read(data) if data.len() == chunk.len() => chunk.copy_from_slice(&data),
                other => return Err(unexpected(&other)),
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_range(offset, buf.len() as u64)?;
        self.admit_blocking(Direction::Write, buf.len() as u64);
        let mut pending = Vec::new();
        for (i, chunk) in buf.chunks(MAX_IO as usize).enumerate() {
            let at = offset + i as u64 * MAX_IO;
            // The one copy of the payload: from here on every replica's frame shares it.
            pending.push(self.submit(Request::Write { offset: at, data: Bytes::copy_from_slice(chunk) }));
        }
        Self::wait_all_written(pending)
    }

    fn submit_write(&self, data: &[u8], offset: u64, done: WriteDone) {
        if let Err(e) = self.check_range(offset, data.len() as u64) {
            return done(Err(e));
        }
        if data.len() as u64 > MAX_IO {
            // Larger than the frontend ever sends (FUSE: 1 MiB); pieces need joining, so block.
            return done(self.write_at(data, offset));
        }
        let wait = self.throttle.admit(Direction::Write, data.len() as u64);
        let data = Bytes::copy_from_slice(data);
        self.submit_after(wait, Request::Write { offset, data }, ReplyTx::Written(done));
    }

    fn submit_read(&self, offset: u64, len: usize, done: ReadDone) {
        if let Err(e) = self.check_range(offset, len as u64) {
            return done(Err(e));
        }
        if len as u64 > MAX_IO {
            let mut buf = vec![0u8; len];
            return match self.read_at(&mut buf, offset) {
                Ok(()) => done(Ok(&buf)),
                Err(e) => done(Err(e)),
            };
        }
        let wait = self.throttle.admit(Direction::Read, len as u64);
        self.submit_after(wait, Request::Read { offset, len: len as u64 }, ReplyTx::Read { len, done });
    }

    fn unplug(&self) {
        self.shared.unplug();
    }

    fn flush(&self) -> io::Result<()> {
        match Self::wait(self.submit(Request::Flush))? {
            ClientReply::Flushed => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.check_range(offset, len)?;
        let end = offset + len;
        let mut at = offset;
        while at < end {
            let mut window = Vec::with_capacity(DISCARD_WINDOW);
            while at < end && window.len() < DISCARD_WINDOW {
                // Pieces of at most MAX_UNMAP, so one large discard never locks the whole volume.
                let n = MAX_UNMAP.min(end - at);
                window.push(self.submit(Request::Unmap { offset: at, len: n }));
                at += n;
            }
            Self::wait_all_written(window)?;
        }
        Ok(())
    }
}
