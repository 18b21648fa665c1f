//! [`ReplicaSet`]: the replicas of one volume while it is not attached, each a disk of a replica
//! server, and the offline operations on all of them at once (snapshot, revert, expand, clone
//! from a snapshot), which refuse a set whose members disagree (see the parent module).

use std::net::SocketAddr;
use std::time::Duration;

use super::{COPY_CHUNK, ControlError, EXTENT_WINDOW, Reach, ReplicaServerClient, ReplicaSession};
use crate::protocol::{DEFAULT_DISK, SnapshotInfo};

/// The replicas of one volume, addressed by their servers, for operations while it is not
/// attached.
#[derive(Debug, Clone)]
pub struct ReplicaSet {
    pub volume_id: String,
    pub nodes: Vec<SocketAddr>,
    /// The disk of each replica on its server, in the order of `nodes` (missing ones: the disk
    /// `default`). One server may hold several replicas of the set, each on its own disk.
    pub disks: Vec<String>,
    pub timeout: Duration,
    /// Claimed by every session (see [`ReplicaSession::open_claimed`]); 0 for a set without a
    /// record.
    pub epoch: u64,
    pub reach: Reach,
}

impl ReplicaSet {
    pub fn new(volume_id: impl Into<String>, nodes: Vec<SocketAddr>, timeout: Duration) -> Self {
        Self { volume_id: volume_id.into(), nodes, disks: Vec::new(), timeout, epoch: 0, reach: Reach::plaintext() }
    }

    /// The same set, its `i`th replica on its server's disk `disks[i]`.
    pub fn with_disks(mut self, disks: Vec<String>) -> Self {
        self.disks = disks;
        self
    }

    /// The disk of replica `i` on its server.
    fn disk(&self, i: usize) -> &str {
        self.disks.get(i).map_or(DEFAULT_DISK, String::as_str)
    }

    /// Each replica as (server, disk).
    fn replicas(&self) -> impl Iterator<Item = (SocketAddr, &str)> {
        self.nodes.iter().enumerate().map(|(i, addr)| (*addr, self.disk(i)))
    }

    /// The same set, reached as `reach` says.
    pub fn with_reach(mut self, reach: Reach) -> Self {
        self.reach = reach;
        self
    }

    /// The same set, its sessions claiming `epoch`.
    pub fn with_epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    fn check(&self) -> Result<(), ControlError> {
        if self.nodes.is_empty() {
            return Err(ControlError::Invalid("a replica set needs at least one replica server".into()));
        }
        let mut seen: Vec<(SocketAddr, &str)> = self.replicas().collect();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != self.nodes.len() {
            return Err(ControlError::Invalid("two replicas of one volume on the same disk of one server".into()));
        }
        Ok(())
    }

    /// Creates an empty replica on every node's disk (idempotent per replica; retry after a
    /// failure).
    pub async fn create(&self, size: u64) -> Result<(), ControlError> {
        self.check()?;
        if size == 0 || !size.is_multiple_of(4096) {
            return Err(ControlError::Invalid(format!("size {size} is not a positive multiple of 4096")));
        }
        for (addr, disk) in self.replicas() {
            ReplicaServerClient::over(addr, self.timeout, self.reach.clone())
                .create_replica_on(disk, &self.volume_id, size)
                .await?;
        }
        Ok(())
    }

    /// Deletes every replica; already deleted ones count as done.
    pub async fn delete(&self) -> Result<(), ControlError> {
        self.check()?;
        for (addr, disk) in self.replicas() {
            ReplicaServerClient::over(addr, self.timeout, self.reach.clone())
                .delete_replica_on(disk, &self.volume_id)
                .await?;
        }
        Ok(())
    }

    /// Opens every replica and checks that they agree (see the module docs).
    pub async fn open(&self) -> Result<Vec<ReplicaSession>, ControlError> {
        self.open_ignoring(None).await
    }

    /// Like [`Self::open`], but the chains may differ in snapshot `ignored`: what a retry of a
    /// snapshot operation that reached only some replicas finds.
    async fn open_ignoring(&self, ignored: Option<&str>) -> Result<Vec<ReplicaSession>, ControlError> {
        self.check()?;
        let mut sessions = Vec::with_capacity(self.nodes.len());
        for (addr, disk) in self.replicas() {
            match ReplicaSession::open_on(addr, disk, &self.volume_id, self.timeout, self.epoch, &self.reach).await {
                Ok(s) => sessions.push(s),
                Err(e) => {
                    // Sessions already open end cleanly rather than leaving replicas dirty.
                    let _ = close_all(sessions).await;
                    return Err(e);
                }
            }
        }
        let first = sessions[0].header().clone();
        for s in &sessions {
            let h = s.header();
            let detail = if h.dirty {
                Some(format!("{} was left dirty by an engine that did not detach cleanly", s.addr()))
            } else if h.revision != first.revision {
                Some(format!(
                    "{} is at revision {}, {} at {}",
                    s.addr(),
                    h.revision,
                    sessions[0].addr(),
                    first.revision
                ))
            } else if h.size != first.size {
                Some(format!("{} has {} bytes, {} has {}", s.addr(), h.size, sessions[0].addr(), first.size))
            } else if names(&h.snapshots, ignored) != names(&first.snapshots, ignored) {
                Some(format!("{} and {} hold different snapshots", s.addr(), sessions[0].addr()))
            } else {
                None
            };
            if let Some(detail) = detail {
                for s in sessions {
                    // Best effort: the error below is what matters.
                    let _ = s.close().await;
                }
                return Err(ControlError::NotInSync { volume_id: self.volume_id.clone(), detail });
            }
        }
        Ok(sessions)
    }

    /// The snapshot chain, oldest first, and the volume size.
    pub async fn describe(&self) -> Result<(u64, Vec<SnapshotInfo>), ControlError> {
        let sessions = self.open().await?;
        let header = sessions[0].header().clone();
        close_all(sessions).await?;
        Ok((header.size, header.snapshots))
    }

    pub async fn snapshot(&self, name: &str) -> Result<(), ControlError> {
        let mut sessions = self.open_ignoring(Some(name)).await?;
        let mut result = Ok(());
        for s in &mut sessions {
            result = result.and(s.snapshot(name).await);
        }
        close_all(sessions).await.and(result)
    }

    pub async fn delete_snapshot(&self, name: &str) -> Result<(), ControlError> {
        let mut sessions = self.open_ignoring(Some(name)).await?;
        let mut result = Ok(());
        for s in &mut sessions {
            result = result.and(s.delete_snapshot(name).await);
        }
        close_all(sessions).await.and(result)
    }

    pub async fn revert(&self, name: &str) -> Result<(), ControlError> {
        let mut sessions = self.open().await?;
        if !sessions[0].header().snapshots.iter().any(|s| s.name == name) {
            close_all(sessions).await?;
            return Err(ControlError::Invalid(format!("volume {} has no snapshot {name:?}", self.volume_id)));
        }
        let mut result = Ok(());
        for s in &mut sessions {
            result = result.and(s.revert(name).await);
        }
        close_all(sessions).await.and(result)
    }

    /// Moves every replica to `revision` (it only grows): the others of the volume's members,
    /// left out of a change made on these, are then behind and get it by a rebuild.
    pub async fn set_revision(&self, revision: u64) -> Result<(), ControlError> {
        let mut sessions = self.open().await?;
        let mut result = Ok(());
        for s in &mut sessions {
            result = result.and(s.set_revision(revision).await);
        }
        close_all(sessions).await.and(result)
    }

    pub async fn expand(&self, size: u64) -> Result<(), ControlError> {
        let mut sessions = self.open().await?;
        let current = sessions[0].header().size;
        if size < current || !size.is_multiple_of(4096) {
            close_all(sessions).await?;
            return Err(ControlError::Invalid(format!(
                "new size {size} must be a multiple of 4096 and at least the current {current}"
            )));
        }
        let mut result = Ok(());
        for s in &mut sessions {
            result = result.and(s.resize(size).await);
        }
        close_all(sessions).await.and(result)
    }

    /// Fills this (new, empty) replica set with `source`'s volume as of `snapshot`, copying only
    /// the extents that hold data; `progress(done, total)` is called in bytes. The source may be
    /// attached meanwhile: snapshots never change.
    pub async fn clone_from(
        &self,
        source: &ReplicaSet,
        snapshot: &str,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<(), ControlError> {
        self.check()?;
        source.check()?;
        let mut src = ReplicaSession::open_on(
            source.nodes[0],
            source.disk(0),
            &source.volume_id,
            source.timeout,
            source.epoch,
            &source.reach,
        )
        .await?;
        let size = src.header().size;
        if !src.header().snapshots.iter().any(|s| s.name == snapshot) {
            let _ = src.close().await;
            return Err(ControlError::Invalid(format!("volume {} has no snapshot {snapshot:?}", source.volume_id)));
        }
        let mut dst = self.open().await?;
        if dst[0].header().size < size {
            close_all(dst).await?;
            let _ = src.close().await;
            return Err(ControlError::Invalid(format!("the clone is smaller than its source's {size} bytes")));
        }
        let mut extents = Vec::new();
        let mut at = 0;
        while at < size {
            let len = EXTENT_WINDOW.min(size - at);
            extents.extend(src.snapshot_extents(snapshot, at, len).await?);
            at += len;
        }
        let total: u64 = extents.iter().map(|e| e.len).sum();
        let mut done = 0;
        progress(0, total);
        for e in extents {
            let mut at = e.offset;
            let end = e.offset + e.len;
            while at < end {
                // COPY_CHUNK fits u32.
                let len = COPY_CHUNK.min(end - at) as u32;
                let data = src.read_snapshot(snapshot, at, len).await?;
                for d in &mut dst {
                    d.write(at, data.clone()).await?;
                }
                at += u64::from(len);
                done += u64::from(len);
                progress(done, total);
            }
        }
        close_all(dst).await?;
        src.close().await
    }
}

fn names<'a>(chain: &'a [SnapshotInfo], ignored: Option<&str>) -> Vec<&'a str> {
    chain.iter().map(|s| s.name.as_str()).filter(|n| Some(*n) != ignored).collect()
}

/// Flushes and closes every session; the first error wins, but every session is closed.
async fn close_all(sessions: Vec<ReplicaSession>) -> Result<(), ControlError> {
    let mut result = Ok(());
    for s in sessions {
        result = result.and(s.close().await);
    }
    result
}
