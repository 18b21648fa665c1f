//! A replicated volume's snapshot as a [`wasmcsi_backup::Source`]: what changed since an earlier
//! snapshot comes from one replica's layer chain (`ListSnapshotDelta`, no data read), the bytes
//! from the same replica (`ReadSnapshot`), a bounded number of requests at a time.
//!
//! Here, in the runtime, which depends on both `wasmcsi-block` and `wasmcsi-backup`, so neither
//! library depends on the other: the replication library stays free of object-store clients, and
//! the backup store of replica protocol types. The `backup` import and `wasmcsi volume backup`
//! both read through it.
//!
//! One replica serves the whole backup: every replica that holds the snapshot holds the same
//! view of it (snapshots are taken on every member of the replica set, frozen, and checked
//! byte-identical by the rebuild), so the delta computed on one is valid for a parent backup read
//! from another. Among the replicas given, the one at the highest revision that holds the
//! snapshot is chosen (a lower revision is a replica the set left behind).

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::Semaphore;
use wasmcsi_backup::{Changes, Source};
use wasmcsi_block::control::{COPY_CHUNK, ControlError, Reach, ReplicaSession};
use wasmcsi_block::protocol::Status;

/// Bytes of the volume one `ListSnapshotDelta` covers, so its answer fits one frame (at most a
/// 4 KiB extent per 8 KiB of volume: 16 Mi extents × 17 bytes would not; real deltas are runs).
const DELTA_WINDOW: u64 = 64 << 30;

/// Errors opening a replica snapshot source.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaSourceError {
    #[error("no replica server of volume {volume} holds snapshot {snapshot:?} ({detail})")]
    NoReplica { volume: String, snapshot: String, detail: String },
    #[error(transparent)]
    Control(#[from] ControlError),
}

/// Snapshot `snapshot` of a replicated volume, read from one of its replicas.
pub struct ReplicaSnapshot {
    volume: String,
    snapshot: String,
    size: u64,
    addr: SocketAddr,
    /// The disk of the replica on its server.
    disk: String,
    timeout: Duration,
    reach: Reach,
    runtime: Handle,
    /// Where the snapshot holds data (sorted, disjoint): reads elsewhere are zeros, served here.
    allocated: Vec<Range<u64>>,
    /// Idle sessions; `permits` bounds the requests in flight (one per session in use).
    sessions: Mutex<Vec<ReplicaSession>>,
    permits: Semaphore,
}

impl std::fmt::Debug for ReplicaSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaSnapshot")
            .field("volume", &self.volume)
            .field("snapshot", &self.snapshot)
            .field("replica", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ReplicaSnapshot {
    /// Opens `snapshot` of `volume` on the best of `replicas`, each `(server, disk)` (see the module docs), with at most
    /// `reads_in_flight` requests to it at once. Must be called inside a tokio runtime, whose
    /// handle the blocking [`Source`] methods use.
    pub async fn open(
        volume: &str,
        snapshot: &str,
        replicas: &[(SocketAddr, String)],
        timeout: Duration,
        reach: Reach,
        reads_in_flight: usize,
    ) -> Result<Self, ReplicaSourceError> {
        let mut best: Option<(ReplicaSession, String)> = None;
        let mut problems = Vec::new();
        for (addr, disk) in replicas {
            match ReplicaSession::open_on(*addr, disk, volume, timeout, 0, &reach).await {
                Ok(s) if !s.header().snapshots.iter().any(|x| x.name == snapshot) => {
                    problems.push(format!("{addr} ({disk}): no such snapshot"));
                    close_quietly(s).await;
                }
                Ok(s) => {
                    if best.as_ref().is_none_or(|(b, _)| s.header().revision > b.header().revision) {
                        if let Some((old, _)) = best.replace((s, disk.clone())) {
                            close_quietly(old).await;
                        }
                    } else {
                        close_quietly(s).await;
                    }
                }
                Err(e) => problems.push(e.to_string()),
            }
        }
        let Some((mut first, disk)) = best else {
            return Err(ReplicaSourceError::NoReplica {
                volume: volume.to_owned(),
                snapshot: snapshot.to_owned(),
                detail: problems.join("; "),
            });
        };
        let size = first.header().size;
        let addr = first.addr();
        let allocated = match windowed_delta(&mut first, None, snapshot, size).await {
            Ok(a) => a,
            Err(e) => {
                close_quietly(first).await;
                return Err(e.into());
            }
        };
        tracing::info!(
            volume,
            snapshot,
            replica = %addr,
            allocated = allocated.iter().map(|r| r.end - r.start).sum::<u64>(),
            "backup source opened"
        );
        let reads_in_flight = reads_in_flight.max(1);
        Ok(Self {
            volume: volume.to_owned(),
            snapshot: snapshot.to_owned(),
            size,
            addr,
            disk,
            timeout,
            reach,
            runtime: Handle::current(),
            allocated,
            sessions: Mutex::new(vec![first]),
            permits: Semaphore::new(reads_in_flight),
        })
    }

    /// The replica server the snapshot is read from.
    pub fn replica(&self) -> SocketAddr {
        self.addr
    }

    /// Ends every idle session cleanly (a session only read, so the replica stays clean).
    pub async fn close(&self) {
        let sessions = std::mem::take(&mut *self.sessions.lock().unwrap_or_else(PoisonError::into_inner));
        for s in sessions {
            close_quietly(s).await;
        }
    }

    /// Runs `op` on an idle session (a new one if none is idle), under a permit. A session
    /// whose request was refused (a whole answer came back) is kept; one whose connection failed
    /// is dropped, not reused: its stream may be mid-frame.
    async fn with_session<T>(
        &self,
        op: impl AsyncFnOnce(&mut ReplicaSession) -> Result<T, ControlError>,
    ) -> Result<T, ControlError> {
        let _permit = self.permits.acquire().await.map_err(|_| ControlError::Invalid("source closed".into()))?;
        let idle = self.sessions.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let mut session = match idle {
            Some(s) => s,
            None => ReplicaSession::open_on(self.addr, &self.disk, &self.volume, self.timeout, 0, &self.reach).await?,
        };
        let result = op(&mut session).await;
        let answered = match &result {
            Ok(_) => true,
            // `Denied` closes the connection; a plain refusal leaves it in step.
            Err(e) => matches!(e, ControlError::Refused { .. }),
        };
        if answered {
            self.sessions.lock().unwrap_or_else(PoisonError::into_inner).push(session);
        }
        result
    }

    /// Reads `[offset, offset + buf.len())` of the snapshot from the replica, one frame per
    /// request.
    async fn read_remote(&self, offset: u64, buf: &mut [u8]) -> Result<(), ControlError> {
        self.with_session(async |s| {
            let mut done = 0;
            while done < buf.len() {
                // COPY_CHUNK fits a frame and a u32.
                let n = (buf.len() - done).min(COPY_CHUNK as usize);
                let data = s.read_snapshot(&self.snapshot, offset + done as u64, n as u32).await?;
                buf[done..done + n].copy_from_slice(&data);
                done += n;
            }
            Ok(())
        })
        .await
    }
}

impl Source for ReplicaSnapshot {
    fn size(&self) -> u64 {
        self.size
    }

    /// Against no base: where the snapshot holds data. Against `since`: the replica's delta
    /// between the two snapshots; when `since` is gone from the replica (deleted, reverted away)
    /// the delta is unknowable and the answer is [`Changes::Everything`], logged, so the backup
    /// reads the whole snapshot and compares it with the parent chunk by chunk.
    fn changes(&self, since: Option<&str>) -> std::io::Result<Changes> {
        let Some(base) = since else {
            return Ok(Changes::Ranges(self.allocated.clone()));
        };
        let delta = self
            .runtime
            .block_on(self.with_session(async |s| windowed_delta(s, Some(base), &self.snapshot, self.size).await));
        match delta {
            Ok(ranges) => Ok(Changes::Ranges(ranges)),
            Err(e) if e.status() == Some(Status::NotFound) => {
                tracing::warn!(
                    volume = %self.volume,
                    snapshot = %self.snapshot,
                    base,
                    replica = %self.addr,
                    "the parent backup's snapshot is gone from the replica: reading the whole snapshot"
                );
                Ok(Changes::Everything)
            }
            Err(e) => Err(std::io::Error::other(e)),
        }
    }

    /// A range the snapshot holds nothing in is zeros without a request; otherwise the span
    /// from its first to its last allocated byte is read in one go (gaps between fragments come
    /// back as zeros: fewer, larger requests beat one per 4 KiB fragment).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let end = offset + buf.len() as u64;
        buf.fill(0);
        let first = self.allocated.partition_point(|r| r.end <= offset);
        let mut inside = self.allocated[first..].iter().take_while(|r| r.start < end);
        let Some(lo) = inside.next().map(|r| r.start.max(offset)) else {
            return Ok(());
        };
        let hi = self.allocated[first..].iter().take_while(|r| r.start < end).last().map_or(end, |r| r.end.min(end));
        let part = &mut buf[(lo - offset) as usize..(hi - offset) as usize];
        self.runtime.block_on(self.read_remote(lo, part)).map_err(std::io::Error::other)
    }
}

/// The delta (or, with no base, the allocated extents) of the whole volume, merged into sorted
/// disjoint byte ranges.
async fn windowed_delta(
    s: &mut ReplicaSession,
    base: Option<&str>,
    name: &str,
    size: u64,
) -> Result<Vec<Range<u64>>, ControlError> {
    let mut out: Vec<Range<u64>> = Vec::new();
    let mut at = 0;
    while at < size {
        let len = DELTA_WINDOW.min(size - at);
        for e in s.snapshot_delta(base, name, at, len).await? {
            let r = e.offset..e.offset + e.len;
            match out.last_mut() {
                Some(last) if last.end >= r.start => last.end = last.end.max(r.end),
                _ => out.push(r),
            }
        }
        at += len;
    }
    Ok(out)
}

async fn close_quietly(s: ReplicaSession) {
    let addr = s.addr();
    if let Err(e) = s.close().await {
        tracing::debug!(replica = %addr, error = %e, "closing a backup read session");
    }
}
