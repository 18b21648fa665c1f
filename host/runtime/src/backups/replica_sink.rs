//! Every replica of a new replica set as a [`wasmcsi_backup::Sink`]: what a restore writes into.
//! One session per replica; each write goes to all of them at once, in frames of at most
//! [`COPY_CHUNK`]. The set is new and filled only by this restore, so its holes are already
//! zeros ([`Sink::write_zeros`] writes nothing), and a retry of a restore rewrites the same
//! bytes: a replica a crashed restore left dirty is opened and overwritten like a clean one.

use std::sync::Mutex;

use futures::future::try_join_all;
use tokio::runtime::Handle;
use wasmcsi_backup::Sink;
use wasmcsi_block::catalog::RestoreInto;
use wasmcsi_block::control::{COPY_CHUNK, ControlError, ReplicaSession};

/// The replicas of one set being restored.
pub struct ReplicaSink {
    volume: String,
    runtime: Handle,
    /// One session per replica; `None` once closed. The lock is held for a whole write, so
    /// every replica sees the writes in the same order.
    sessions: tokio::sync::Mutex<Option<Vec<ReplicaSession>>>,
    /// The first failure: every later call reports it (a session that failed may be mid-frame).
    broken: Mutex<Option<String>>,
}

impl std::fmt::Debug for ReplicaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaSink").field("volume", &self.volume).finish_non_exhaustive()
    }
}

impl ReplicaSink {
    /// Opens a session on every replica of `into`. Must be called inside a tokio runtime, whose
    /// handle the blocking [`Sink`] methods use.
    pub async fn open(into: &RestoreInto) -> Result<Self, ControlError> {
        let mut sessions = Vec::with_capacity(into.replicas.len());
        for (addr, disk) in &into.replicas {
            match ReplicaSession::open_on(*addr, disk, &into.volume_id, into.timeout, into.epoch, &into.reach).await {
                Ok(s) => sessions.push(s),
                Err(e) => {
                    for s in sessions {
                        let _ = s.close().await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(Self {
            volume: into.volume_id.clone(),
            runtime: Handle::current(),
            sessions: tokio::sync::Mutex::new(Some(sessions)),
            broken: Mutex::new(None),
        })
    }

    fn check(&self) -> std::io::Result<()> {
        match &*self.broken.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            Some(why) => Err(std::io::Error::other(why.clone())),
            None => Ok(()),
        }
    }

    fn fail(&self, e: ControlError) -> std::io::Error {
        let why = format!("replica of {}: {e}", self.volume);
        *self.broken.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why.clone());
        std::io::Error::other(why)
    }

    async fn write_all(&self, offset: u64, data: &[u8]) -> Result<(), ControlError> {
        let mut guard = self.sessions.lock().await;
        let sessions = guard.as_mut().ok_or_else(|| ControlError::Invalid("restore sink closed".into()))?;
        let mut at = 0;
        while at < data.len() {
            let n = (data.len() - at).min(COPY_CHUNK as usize);
            let frame = &data[at..at + n];
            try_join_all(sessions.iter_mut().map(|s| s.write(offset + at as u64, frame.to_vec()))).await?;
            at += n;
        }
        Ok(())
    }

    /// Flushes and ends every session (a clean close: the replicas are not left dirty).
    pub async fn close(&self) -> Result<(), ControlError> {
        let Some(sessions) = self.sessions.lock().await.take() else { return Ok(()) };
        let mut first = Ok(());
        for s in sessions {
            if let Err(e) = s.close().await
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }
}

impl Sink for ReplicaSink {
    fn write_at(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.check()?;
        self.runtime.block_on(self.write_all(offset, data)).map_err(|e| self.fail(e))
    }

    /// The replicas are new: every byte not written reads as zeros already.
    fn write_zeros(&self, _offset: u64, _len: u64) -> std::io::Result<()> {
        self.check()
    }

    fn flush(&self) -> std::io::Result<()> {
        self.check()?;
        self.runtime
            .block_on(async {
                let mut guard = self.sessions.lock().await;
                match guard.as_mut() {
                    Some(sessions) => try_join_all(sessions.iter_mut().map(|s| s.flush())).await.map(drop),
                    None => Ok(()),
                }
            })
            .map_err(|e| self.fail(e))
    }
}
